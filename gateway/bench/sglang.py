"""``kvgw bench sglang``: the same KV pages through SGLang 0.5.23's HiCache L3 storage backends, in one
run, on this machine:

    (a) kvgw's backend                  ``kvgw_client.sglang`` (``dynamic``, ``interface_v1``), native API
    (b) SGLang's S3 backend -> kvgw     ``seaweedfs`` (boto3, zero-copy interface), kvgw's S3 API
    (c) SGLang's file backend           ``HiCacheFile`` (generic interface), a directory on the same disk
                                        as kvgw's data

Each backend is created by SGLang's ``StorageBackendFactory`` and driven as SGLang's cache controller
drives it (``gateway.bench.sglang_engine``): ``_page_backup`` to store, ``_storage_hit_query`` then
``_page_transfer`` to load, batches of 128 pages, through the zero-copy interface where SGLang uses it
((a), (b)) and the generic one where it does not ((c)). The host pool is a CPU stand-in of SGLang's
``MHATokenToKVPoolHost`` with its real buffer shapes (``--layout``); a page is ``--page-tokens`` tokens
of ``--layers`` x ``--heads`` x ``--head-dim`` bfloat16 K and V (default 8 MiB). Every target stores
the same contents under the same page hashes (SGLang's own), in its own namespace; the first load of
every request is checked byte for byte.

Measured per target and cache state: store MB/s (``_page_backup`` of every request), lookup ms (the hit
query of one request, p50), get MB/s (``--rounds`` passes of query + load per request; only the load is
timed). ``--cache cold`` syncs and drops the page cache of every stored file (kvgw's chunk directory,
the file backend's directory) before each request. Ratios are printed against (c); exit status 1 when a
target could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from gateway.bench.launcher import (
    KvgwProcess,
    add_run_options,
    drop_page_cache,
    files_under,
    print_report,
    work_directory,
)

MiB = 1 << 20
ACCESS_KEY = "KVBENCHSGLANGACCESS0"
SECRET_KEY = "kvgw-bench-sglang-secret-key-0123456789"
BUCKET = "kvcache"


@contextlib.contextmanager
def kvgw_server(data_dir: Path, *, fsync: bool) -> Iterator[KvgwProcess]:
    """``kvgw serve`` on its defaults, plus root credentials."""
    env = {"KVGW_ROOT_ACCESS_KEY": ACCESS_KEY, "KVGW_ROOT_SECRET_KEY": SECRET_KEY}
    server = KvgwProcess(data_dir, extra_args=[] if fsync else ["--no-fsync"], env=env, inherit_kvgw_env=False,
                         log_path=data_dir.parent / "kvgw.log")
    with server:
        yield server


@dataclass
class Result:
    cache: str
    store_mbps: float = 0.0
    get_mbps: float = 0.0
    lookup_ms: float = 0.0
    error: str | None = None


@dataclass
class Target:
    key: str
    label: str
    backend: str  # the factory's backend name
    extra: dict[str, Any]  # --hicache-storage-backend-extra-config
    zero_copy: bool  # the controller's zero-copy loops (interface_v1 / built-in list) or the generic ones
    files: Callable[[], list[Path]]
    results: list[Result] = field(default_factory=list)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from gateway.bench import sglang_engine as se

        self.se = se
        self.args = args
        geometry = {"layer_num": args.layers, "head_num": args.heads, "head_dim": args.head_dim,
                    "page_size": args.page_tokens}
        self.write_pool = se.MHAHostPool(args.layout, pages=args.pages, **geometry)
        self.read_pool = se.MHAHostPool(args.layout, pages=args.pages, **geometry)
        self.page_bytes = self.write_pool.page_bytes
        self.request_bytes = self.page_bytes * args.pages
        self.hashes = [se.page_hashes(list(range(r * 1_000_000, r * 1_000_000 + args.pages * args.page_tokens)),
                                      args.page_tokens) for r in range(args.requests)]

    def attach(self, target: Target, pool: Any) -> Any:
        config = self.se.storage_config(extra=target.extra, model="bench/Bench-8B",
                                        page_first=pool.layout == "page_first")
        return self.se.attach(target.backend, config, pool)

    def run(self, target: Target, caches: Sequence[str]) -> None:
        import torch

        se, args = self.se, self.args
        writer = self.attach(target, self.write_pool)
        reader = self.attach(target, self.read_pool)
        try:
            digests: list[list[int]] = []
            store_s = 0.0
            for r, hashes in enumerate(self.hashes):
                indices = self.write_pool.alloc(args.pages * args.page_tokens)
                assert indices is not None
                pages = se.fill_pages(self.write_pool, indices, seed=r)
                digests.append([xxhash.xxh3_64_intdigest(p.view(-1).view(torch.uint8).numpy().data) for p in pages])
                started = time.perf_counter()
                stored = se.backup(writer, self.write_pool, hashes, indices, zero_copy=target.zero_copy)
                store_s += time.perf_counter() - started
                self.write_pool.free(indices)
                if stored != len(hashes):
                    raise RuntimeError(f"request {r}: {stored} of {len(hashes)} pages stored")
            store_mbps = args.requests * self.request_bytes / MiB / store_s
            checked = False
            for cache in caches:
                load_s, lookups = 0.0, []
                for _ in range(args.rounds):
                    for r, hashes in enumerate(self.hashes):
                        if cache == "cold":
                            drop_page_cache(target.files())
                        started = time.perf_counter()
                        hits = se.hit_query(reader, hashes)
                        lookups.append((time.perf_counter() - started) * 1000)
                        if hits != len(hashes):
                            raise RuntimeError(f"request {r}: {hits} of {len(hashes)} pages found")
                        indices = self.read_pool.alloc(args.pages * args.page_tokens)
                        assert indices is not None
                        started = time.perf_counter()
                        loaded = se.transfer(reader, self.read_pool, hashes, indices, zero_copy=target.zero_copy)
                        load_s += time.perf_counter() - started
                        if loaded != len(hashes):
                            raise RuntimeError(f"request {r}: {loaded} of {len(hashes)} pages loaded")
                        if not checked:
                            self._check(indices, digests[r], r)
                        self.read_pool.free(indices)
                    checked = True
                gets = args.rounds * args.requests * self.request_bytes
                target.results.append(Result(cache, store_mbps, gets / MiB / load_s, statistics.median(lookups)))
        finally:
            for backend in (writer, reader):
                with contextlib.suppress(Exception):
                    if hasattr(backend, "close"):
                        backend.close()
                    executor = getattr(backend, "_executor", None)
                    if executor is not None:
                        executor.shutdown(wait=True)

    def _check(self, indices: Any, digests: list[int], request: int) -> None:
        import torch

        ps = self.args.page_tokens
        for i, want in enumerate(digests):
            page = self.read_pool.page_tensor(int(indices[i * ps]))
            if xxhash.xxh3_64_intdigest(page.view(-1).view(torch.uint8).numpy().data) != want:
                raise RuntimeError(f"request {request} page {i}: loaded bytes differ from the stored ones")


def report(targets: list[Target], caches: Sequence[str], header: str) -> tuple[str, bool]:
    lines = [header, ""]
    lines.append(f"{'cache':<6}{'target':<44}{'store MB/s':>11}{'get MB/s':>10}{'lookup ms':>11}"
                 f"{'store vs (c)':>14}{'get vs (c)':>12}")
    ok = True
    for cache in caches:
        base = next((r for t in targets if t.key == "c" for r in t.results if r.cache == cache and not r.error), None)
        for t in targets:
            for r in t.results:
                if r.cache != cache:
                    continue
                name = f"({t.key}) {t.label}"
                if r.error:
                    ok = False
                    lines.append(f"{cache:<6}{name:<44}  error: {r.error}")
                    continue
                vs = ("", "") if base is None else (f"{r.store_mbps / base.store_mbps:.2f}x",
                                                    f"{r.get_mbps / base.get_mbps:.2f}x")
                lines.append(f"{cache:<6}{name:<44}{r.store_mbps:>11.0f}{r.get_mbps:>10.0f}{r.lookup_ms:>11.2f}"
                             f"{vs[0]:>14}{vs[1]:>12}")
    return "\n".join(lines), ok


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="kvgw bench sglang", description=__doc__.split("\n\n")[0] if __doc__ else "")
    p.add_argument("--layout", default="page_first",
                   choices=["page_first", "page_first_direct", "page_head", "layer_first"])
    p.add_argument("--page-tokens", type=int, default=64, help="tokens per page (default 64)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8, help="KV heads of this rank (default 8)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--pages", type=int, default=64, help="pages per request (default 64)")
    add_run_options(p, read="load", read_done="loaded", targets="abc", example="ac",
                    no_fsync_note="HiCacheFile never fsyncs", other="the file backend's")
    return p.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    from gateway.bench import sglang_engine as se

    try:
        se.load()
    except ImportError as exc:
        print(f"kvgw bench sglang needs SGLang 0.5.23's storage modules (.ci/install-sglang.sh): {exc}",
              file=sys.stderr)
        return 2
    caches = ["warm", "cold"] if args.cache == "both" else [args.cache]
    with work_directory(args, "kvgw-bench-sglang-") as workdir:
        kvgw_dir, file_dir = workdir / "kvgw-data", workdir / "hicache-file"
        bench = Bench(args)
        with kvgw_server(kvgw_dir, fsync=not args.no_fsync) as server:
            kvgw_files = lambda: files_under(kvgw_dir / "fs")  # noqa: E731
            targets = [t for t in (
                Target("a", "kvgw backend (native API)", "dynamic",
                       {"backend_name": "kvgw", "module_path": "kvgw_client.sglang", "class_name": "KvgwHiCacheStorage",
                        "interface_v1": 1, "url": server.url, "bucket": BUCKET, "access_key": ACCESS_KEY,
                        "secret_key": SECRET_KEY, "prefix": "bench-a"}, True, kvgw_files),
                Target("b", "SGLang S3 backend -> kvgw S3 API", "seaweedfs",
                       {"endpoint": server.url, "bucket": BUCKET, "access_key": ACCESS_KEY, "secret_key": SECRET_KEY,
                        "prefix": "bench-b"}, True, kvgw_files),
                Target("c", "SGLang file backend (HiCacheFile)", "file",
                       {"file_storage_path": str(file_dir)}, False, lambda: files_under(file_dir)),
            ) if t.key in args.only]
            for target in targets:
                print(f"running ({target.key}) {target.label} ...", file=sys.stderr, flush=True)
                try:
                    bench.run(target, caches)
                except Exception as exc:
                    target.results = [Result(c, error=f"{type(exc).__name__}: {exc}") for c in caches]
        file_dir.mkdir(exist_ok=True)
        return print_report(
            lambda header: report(targets, caches, header),
            title=(f"kvgw bench sglang: {args.requests} requests x {args.pages} pages x {bench.page_bytes / MiB:.1f} "
                   f"MiB ({args.requests * bench.request_bytes / MiB:.0f} MiB; page {args.page_tokens} tokens, "
                   f"{args.layers} layers, {args.heads} KV heads x {args.head_dim}, bf16, {args.layout}), "
                   f"{args.rounds} load rounds"),
            engine="SGLang", dist="sglang", fsync=not args.no_fsync, other="the file backend's directory",
            kvgw_dir=kvgw_dir, other_dir=file_dir, workdir=workdir)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""The ``kvgw`` command: serve, maintenance (db, index, scrub), catalog administration, benchmarks.

Every mistake gets one line and exit status 2: argparse's own (an unknown or abbreviated option, a
port outside 1-65535, ``--workers 0``), or a ``ConfigurationError`` (a config file that is missing or
not TOML, a bad setting, a data directory that is not there: only ``serve`` creates one, see
``gateway.datadir``). Listings are aligned tables for people, ``--json`` (one object per line) for
scripts; the commands that create or change something print the JSON of what they made.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from backends.tiers import TierId
from gateway import datadir
from gateway.config import Settings, load_settings
from gateway.version import kvgw_version


class _Parser(argparse.ArgumentParser):
    """Every parser and subparser of ``kvgw``: no abbreviations (``--worker 2`` is not ``--workers 2``;
    a new option must never change what an old abbreviation meant)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """One line (argparse's usage block would bury the mistake), and where the usage is."""
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def port_number(text: str) -> int:
    """``--port``: a TCP port, 1 to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (1 to 65535)")
    return port


def positive_int(text: str) -> int:
    """``--workers``: at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: at least 1")
    return value


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML config file (also KVGW_CONFIG)")
    parser.add_argument("--data-dir", type=Path,
                        help="data directory (also KVGW_DATA_DIR; default ./kvgw-data); only serve creates one")


def _settings(args: argparse.Namespace, **extra: Any) -> Settings:
    return load_settings(args.config, data_dir=args.data_dir, **extra)


def cmd_serve(args: argparse.Namespace) -> int:
    from gateway.logs import configure as configure_logging
    from gateway.serve import serve

    settings = _settings(
        args, host=args.host, port=args.port, anonymous=True if args.anonymous else None,
        anonymous_admin=True if args.anonymous_admin else None, fsync=False if args.no_fsync else None,
        tls_cert=args.tls_cert, tls_key=args.tls_key, log_format=args.log_format, workers=args.workers,
    )
    configure_logging(settings.log_level, settings.log_format)
    return serve(settings)


def _open_catalog(settings: Settings) -> Any:
    """The catalog for a command other than serve: never creates a data directory."""
    from gateway.runtime import open_catalog

    return open_catalog(settings, create_data_dir=False)


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    catalog = _open_catalog(_settings(args))
    print(f"catalog at {catalog.engine.url.render_as_string(hide_password=True)} is up to date")
    catalog.close()
    return 0


def _with_gateway(args: argparse.Namespace, job: Callable[[Any], Any]) -> Any:
    from gateway.runtime import Gateway

    settings = _settings(args)
    datadir.require(settings)  # these commands work on this gateway's index, which lives there
    gateway = Gateway(settings)
    try:
        return asyncio.run(job(gateway))
    finally:
        gateway.close()


def cmd_index_rebuild(args: argparse.Namespace) -> int:
    from gateway.maintenance import rebuild_index

    async def job(gw: Any) -> int:
        return await rebuild_index(gw.index, gw.tiers)

    count = _with_gateway(args, job)
    print(f"index rebuilt from the tiers: {count} chunks")
    return 0


def cmd_scrub(args: argparse.Namespace) -> int:
    from gateway.maintenance import scrub

    async def job(gw: Any) -> Any:
        return await scrub(gw.index, gw.fs, repair=not args.dry_run)

    report = _with_gateway(args, job)
    for line in report.details[:1000]:
        print(line)
    print(json.dumps(report.as_dict()))
    problems = report.corrupt + report.misplaced + report.dangling + report.reindexed
    return 1 if problems and args.dry_run else 0


def cmd_bucket(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from gateway.buckets import describe_policy, new_bucket_policy
    from gateway.runtime import validate_policy
    from kvgw_client.keys import is_valid_bucket_name

    settings = _settings(args)
    catalog = _open_catalog(settings)
    try:
        if args.bucket_cmd == "list":
            buckets = catalog.list_buckets()
            if args.json:
                for b in buckets:
                    print(json.dumps({**_policy_doc(b), "lifecycle": describe_policy(b)}))
            else:
                print(_bucket_table(buckets))
            return 0
        if not is_valid_bucket_name(args.name):
            print(f"invalid bucket name {args.name!r}", file=sys.stderr)
            return 2
        given = {f: getattr(args, f) for f in _POLICY_FLAGS if getattr(args, f) is not None}
        if args.bucket_cmd == "create":
            policy = replace(new_bucket_policy(args.name, settings), **given)
        else:
            current = catalog.get_bucket(args.name)
            if current is None:
                print(f"no bucket {args.name!r}", file=sys.stderr)
                return 2
            policy = replace(current, **given)
        validate_policy(policy)
        (catalog.create_bucket if args.bucket_cmd == "create" else catalog.update_bucket)(policy)
        print(json.dumps({**_policy_doc(policy), "lifecycle": describe_policy(policy)}))
        return 0
    finally:
        catalog.close()


_POLICY_FLAGS = ("default_ttl_seconds", "max_chunk_bytes", "capacity_bytes", "anonymous_read", "anonymous_write",
                 "write_tier", "write_through", "s3_capacity_bytes", "high_watermark", "low_watermark",
                 "eviction_policy", "max_lease_ms", "max_leased_bytes", "allow_empty_objects",
                 "etag_mode")


def _policy_doc(policy: Any) -> dict[str, Any]:
    return {f: getattr(policy, f) for f in policy.__slots__}


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Columns aligned on the widest cell, two spaces apart; the last column is not padded."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = []
    for row in [headers, *rows]:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=False)] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _size(value: int | None) -> str:
    if value is None:
        return "-"
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value >= 1 << shift:
            return f"{value / (1 << shift):.1f} {unit}"
    return f"{value} B"


def _duration(seconds: int | None) -> str:
    if not seconds:
        return "-"
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds % length == 0:
            return f"{seconds // length} {unit}"
    return f"{seconds} s"


def _bucket_table(buckets: list[Any]) -> str:
    rows = []
    for b in buckets:
        write = b.write_tier + ("+s3" if b.write_through else "")
        anonymous = "/".join(a for a, on in (("read", b.anonymous_read), ("write", b.anonymous_write)) if on) or "-"
        rows.append([b.name, write, _size(b.capacity_bytes), _size(b.s3_capacity_bytes),
                     _duration(b.default_ttl_seconds), b.eviction_policy, _size(b.max_chunk_bytes), anonymous,
                     "yes" if b.allow_empty_objects else "no"])
    return table(["NAME", "WRITE", "FS CAPACITY", "S3 CAPACITY", "TTL", "EVICTION", "MAX CHUNK", "ANONYMOUS",
                  "EMPTY OBJECTS"], rows)


def cmd_bucket_delete(args: argparse.Namespace) -> int:
    """Through the gateway's own BucketService: emptiness is decided by the index, as DeleteBucket does."""
    import functools

    from gateway.buckets import BucketService, new_bucket_policy
    from gateway.errors import KvgwError

    async def job(gateway: Any) -> int:
        buckets = BucketService(gateway.catalog, gateway.directory, gateway.index,
                                new_policy=functools.partial(new_bucket_policy, settings=gateway.settings))
        try:
            await buckets.delete(args.name)
        except KvgwError as exc:
            print(f"kvgw: {exc.code}: {exc}", file=sys.stderr)
            return 1
        print(json.dumps({"deleted": args.name}))
        return 0

    result: int = _with_gateway(args, job)
    return result


def cmd_cred(args: argparse.Namespace) -> int:
    catalog = _open_catalog(_settings(args))
    try:
        grants = {bucket: (True, bool(args.write)) for bucket in args.bucket or []}
        if args.delete and not grants:
            print("kvgw: --delete needs --bucket (the buckets it may delete from)", file=sys.stderr)
            return 2
        access_key, secret_key = catalog.create_credential(
            is_root=args.root, description=args.description, grants=grants,
            deletes=list(grants) if args.delete else (),
        )
        print(json.dumps({"access_key": access_key, "secret_key": secret_key, "root": args.root}))
        return 0
    finally:
        catalog.close()



def _with_catalog(args: argparse.Namespace, job: Callable[[Any], int]) -> int:
    catalog = _open_catalog(_settings(args))
    try:
        return job(catalog)
    finally:
        catalog.close()


def cmd_cred_list(args: argparse.Namespace) -> int:
    """A table of credentials (``--json``: one JSON line each): access key, root, disabled, grants;
    never the secret."""

    def job(catalog: Any) -> int:
        rows = []
        for record in sorted(catalog.credentials(), key=lambda r: r.access_key):
            grants = {bucket: {"read": read, "write": write, "delete": bucket in record.deletes}
                      for bucket, (read, write) in sorted(record.grants.items())}
            if args.json:
                print(json.dumps({"access_key": record.access_key, "root": record.is_root,
                                  "disabled": record.disabled, "grants": grants}))
                continue
            what = ", ".join(f"{bucket}: " + "+".join(k for k, on in rights.items() if on)
                             for bucket, rights in grants.items())
            rows.append([record.access_key, "root" if record.is_root else "-",
                         "disabled" if record.disabled else "active",
                         "every bucket" if record.is_root else what or "-"])
        if not args.json:
            print(table(["ACCESS KEY", "ROOT", "STATUS", "GRANTS"], rows))
        return 0

    return _with_catalog(args, job)


def cmd_cred_delete(args: argparse.Namespace) -> int:
    def job(catalog: Any) -> int:
        if not catalog.delete_credential(args.access_key):
            print(f"kvgw: no credential {args.access_key}", file=sys.stderr)
            return 1
        print(json.dumps({"deleted": args.access_key}))
        return 0

    return _with_catalog(args, job)


def cmd_cred_rotate(args: argparse.Namespace) -> int:
    from backends.catalog.store import CatalogNotFound

    def job(catalog: Any) -> int:
        try:
            secret_key = catalog.rotate_secret(args.access_key, args.secret_key)
        except CatalogNotFound:
            print(f"kvgw: no credential {args.access_key}", file=sys.stderr)
            return 1
        print(json.dumps({"access_key": args.access_key, "secret_key": secret_key}))
        return 0

    return _with_catalog(args, job)

def cmd_cluster_status(args: argparse.Namespace) -> int:
    """Members, feed, lifecycle leader, usage against capacity: read from the catalog, no gateway needed."""
    from sqlalchemy.exc import DBAPIError

    from gateway.cluster.db import ClusterDB
    from gateway.cluster.members import cluster_status, format_status

    settings = _settings(args)
    if settings.catalog_url is None:
        datadir.require(settings)  # the embedded SQLite catalog lives there
    db = ClusterDB(settings.catalog_dsn, channel=settings.cluster_feed_channel)
    try:
        status = cluster_status(db, timeout_seconds=settings.cluster_member_timeout_seconds)
    except DBAPIError as exc:
        print(f"kvgw: cannot read the cluster state from the catalog ({type(exc.orig).__name__}); "
              "is KVGW_CATALOG_URL right, and the catalog upgraded (kvgw db upgrade)?", file=sys.stderr)
        return 1
    finally:
        db.close()
    print(json.dumps(status, indent=1) if args.json else format_status(status))
    return 0


def cmd_cluster_reconcile(args: argparse.Namespace) -> int:
    """Recount the shared usage ledger from the tiers (reads every chunk's record)."""
    import time

    from gateway.cluster.resync import count_tiers
    from gateway.cluster.usage import usage_rows, write_usage

    async def job(gw: Any) -> list[dict[str, Any]]:
        db = gw.cluster.db
        head = await db.run(db.current_head)  # events after it were made while the tiers were read
        count = await count_tiers(gw.tiers)
        await db.run(lambda: write_usage(db, count, [int(t) for t in gw.tiers], now=time.time(), since=head))
        rows: list[dict[str, Any]] = await db.run(lambda: usage_rows(db))
        return rows

    rows = _with_gateway(args, job)
    for row in rows:
        print(json.dumps(row))
    print(f"usage ledger recounted from the tiers: {len(rows)} (bucket, tier) rows", file=sys.stderr)
    return 0


BENCHMARKS = {
    "io": "gateway.bench.io",  # native API I/O against raw disk and nginx
    "trace": "gateway.bench.trace",  # hit rates on Mooncake traces (sim / online)
    "qa": "gateway.bench.qa",  # multi-round QA through LMCache and SGLang against a live tier: TTFT saved
    "s3": "gateway.bench.s3",  # the S3 API against the native API and moto
    "lmcache": "gateway.bench.lmcache",  # LMCache's own storage paths through kvgw
    "slow-clients": "gateway.bench.slow_clients",  # latency while 1,000 stalled connections are open
    "memory": "gateway.bench.memory",  # peak RSS while 32 clients read large chunks
    "sglang": "gateway.bench.sglang",  # SGLang HiCache L3: kvgw's backend, SGLang's S3 and file backends
    "head": "gateway.bench.head",  # S3 HEAD rate at 8 and 64 clients (vLLM's object tier) against a FastAPI route
    "s3-outage": "gateway.bench.s3_outage",  # exists / PUT / S3-only GET latency with S3 hung or dead
    "floor": "gateway.bench.floor",  # where a small call's server CPU goes: socket, request cycle, kvgw, in process
    "cluster": "gateway.bench.cluster",  # RSS at 1M chunks, coordination cost, feed lag, --workers scaling
    "vllm": "gateway.bench.vllm_tiers",  # vLLM's tiering manager: kvgw's tier, vLLM's fs and obj tiers
    "dataplane": "gateway.bench.dataplane",  # issue 31: uvicorn+ASGI, an own httptools protocol, granian RSGI
    "etag": "gateway.bench.etag",  # what an MD5-mode bucket costs a PUT, against an xxh3 one
    "leases": "gateway.bench.leases",  # 64-key lookups with a read lease against the same without
    "first-read": "gateway.bench.first_read",  # issue 31: what direct writes cost the first read of a fresh chunk
}


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    import importlib

    module = importlib.import_module(BENCHMARKS[args.bench_cmd])
    result: int = module.main(rest)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvgw", description="KV-cache storage gateway")
    parser.add_argument("--version", action="version", version=f"kvgw {kvgw_version()}")
    sub = parser.add_subparsers(dest="cmd", required=True)

    serve = sub.add_parser("serve", help="run the gateway")
    _common(serve)
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=port_number, help="port, 1 to 65535 (default 8080)")
    serve.add_argument("--anonymous", action="store_true",
                       help="let unauthenticated requests read and write every bucket (local use)")
    serve.add_argument("--anonymous-admin", action="store_true",
                       help="let unauthenticated requests also delete and administer (local use only)")
    serve.add_argument("--no-fsync", action="store_true", help="do not fsync chunks (faster, not crash-safe)")
    serve.add_argument("--workers", type=positive_int, help="worker processes sharing the port (default: one per core, "
                       "at most KVGW_MAX_WORKERS, with a PostgreSQL catalog; 1 with the embedded SQLite one)")
    serve.add_argument("--log-format", choices=("text", "json"), help="log lines as text (default) or JSON")
    serve.add_argument("--tls-cert", type=Path, help="serve https with this certificate (PEM, chain first)")
    serve.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    serve.set_defaults(func=cmd_serve)

    db = sub.add_parser("db", help="catalog database")
    db_sub = db.add_subparsers(dest="db_cmd", required=True)
    upgrade = db_sub.add_parser("upgrade", help="apply catalog migrations")
    _common(upgrade)
    upgrade.set_defaults(func=cmd_db_upgrade)

    index = sub.add_parser("index", help="hot index")
    index_sub = index.add_subparsers(dest="index_cmd", required=True)
    rebuild = index_sub.add_parser("rebuild", help="recreate the index from the filesystem tier")
    _common(rebuild)
    rebuild.set_defaults(func=cmd_index_rebuild)

    scrub = sub.add_parser("scrub", help="verify every chunk and reconcile the index with the tier")
    _common(scrub)
    scrub.add_argument("--dry-run", action="store_true", help="report only; exit 1 if anything is wrong")
    scrub.set_defaults(func=cmd_scrub)

    bucket = sub.add_parser("bucket", help="buckets and their policies")
    bucket_sub = bucket.add_subparsers(dest="bucket_cmd", required=True)
    for name in ("create", "update"):
        p = bucket_sub.add_parser(name)
        _common(p)
        p.add_argument("name")
        p.add_argument("--ttl", dest="default_ttl_seconds", type=int, help="default chunk TTL in seconds")
        p.add_argument("--max-chunk-bytes", type=int)
        p.add_argument("--capacity-bytes", type=int, help="filesystem-tier capacity for this bucket")
        p.add_argument("--s3-capacity-bytes", type=int, help="S3-tier capacity for this bucket")
        p.add_argument("--anonymous-read", action=argparse.BooleanOptionalAction)
        p.add_argument("--anonymous-write", action=argparse.BooleanOptionalAction)
        p.add_argument("--write-tier", choices=TierId.labels())
        p.add_argument("--write-through", action=argparse.BooleanOptionalAction,
                       help="copy every filesystem write to S3 in the background")
        p.add_argument("--high-watermark", type=float)
        p.add_argument("--low-watermark", type=float)
        p.add_argument("--eviction-policy")
        p.add_argument("--max-lease-ms", type=int, help="the longest read lease a lookup may take (ms)")
        p.add_argument("--max-leased-bytes", type=int,
                       help="bytes leased at once (default: a tenth of the bucket's capacity)")
        p.add_argument("--allow-empty-objects", action=argparse.BooleanOptionalAction,
                       help="accept zero-length PUTs and parts (refused by default: a KV chunk is never empty)")
        p.add_argument("--etag", dest="etag_mode", choices=("xxh3", "md5"),
                       help="S3 ETags of chunks written from now on: xxh3 (default; the chunk's checksum) or md5 "
                            "(S3's, for aws s3 sync / rclone; costs an MD5 of every PUT)")
        p.set_defaults(func=cmd_bucket)
    remove = bucket_sub.add_parser("delete", help="delete an empty bucket (its grants go with it)")
    _common(remove)
    remove.add_argument("name")
    remove.set_defaults(func=cmd_bucket_delete)
    listing = bucket_sub.add_parser("list", help="buckets and their policies, as a table")
    _common(listing)
    listing.add_argument("--json", action="store_true", help="one JSON object per bucket and line (for scripts)")
    listing.set_defaults(func=cmd_bucket)

    cred = sub.add_parser("cred", help="credentials")
    cred_sub = cred.add_subparsers(dest="cred_cmd", required=True)
    create = cred_sub.add_parser("create", help="create a credential (secret printed once)")
    _common(create)
    create.add_argument("--root", action="store_true")
    create.add_argument("--bucket", action="append", help="grant read access to this bucket (repeatable)")
    create.add_argument("--write", action="store_true", help="grant write access too")
    create.add_argument("--delete", action="store_true",
                        help="also let it delete chunks in these buckets (DeleteObject(s), native DELETE); "
                             "never implied by --write")
    create.add_argument("--description", default="")
    create.set_defaults(func=cmd_cred)
    listing = cred_sub.add_parser("list", help="list credentials and their grants (secrets are never shown)")
    _common(listing)
    listing.add_argument("--json", action="store_true", help="one JSON object per credential and line (for scripts)")
    listing.set_defaults(func=cmd_cred_list)
    remove = cred_sub.add_parser("delete", help="delete a credential (gateways refuse it from their next refresh)")
    _common(remove)
    remove.add_argument("access_key")
    remove.set_defaults(func=cmd_cred_delete)
    rotate = cred_sub.add_parser("rotate", help="give a credential a new secret (printed once)")
    _common(rotate)
    rotate.add_argument("access_key")
    rotate.add_argument("--secret-key", help="the new secret (default: generated); e.g. a new KVGW_ROOT_SECRET_KEY")
    rotate.set_defaults(func=cmd_cred_rotate)

    cluster = sub.add_parser("cluster", help="several gateways on one catalog")
    cluster_sub = cluster.add_subparsers(dest="cluster_cmd", required=True)
    status = cluster_sub.add_parser("status", help="members, feed lag, lifecycle leader, usage vs capacity")
    _common(status)
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.set_defaults(func=cmd_cluster_status)
    reconcile = cluster_sub.add_parser("reconcile", help="recount the shared usage ledger from the tiers")
    _common(reconcile)
    reconcile.set_defaults(func=cmd_cluster_reconcile)

    bench = sub.add_parser("bench", help="benchmarks (each prints baselines measured in the same run)")
    bench.add_argument("bench_cmd", choices=sorted(BENCHMARKS))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["bench"]:
        args, _ = parser.parse_known_args(argv[:2])
        return cmd_bench(args, argv[2:])
    args = parser.parse_args(argv)
    from backends.errors import IndexError_
    from gateway.config import ConfigurationError

    try:
        result: int = args.func(args)
    except (ConfigurationError, IndexError_) as exc:
        print(f"kvgw: {exc}", file=sys.stderr)
        return 2
    return result


if __name__ == "__main__":
    sys.exit(main())

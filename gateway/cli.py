"""The ``kvgw`` command: serve, maintenance (db, index, scrub), catalog administration, benchmarks."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.config import Settings, load_settings


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML config file (also KVGW_CONFIG)")
    parser.add_argument("--data-dir", type=Path, help="data directory (default ./kvgw-data)")


def _settings(args: argparse.Namespace, **extra: Any) -> Settings:
    return load_settings(args.config, data_dir=args.data_dir, **extra)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.api.holding import HoldingHttpToolsProtocol
    from gateway.app import create_app

    settings = _settings(
        args, host=args.host, port=args.port, anonymous=True if args.anonymous else None,
        fsync=False if args.no_fsync else None,
    )
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    root = app.gateway.generated_root
    if root is not None:
        print(
            "kvgw: generated root credentials (shown once; saved to "
            f"{root.path}, mode 0600)\n  access key: {root.access_key}\n  secret key: {root.secret_key}",
            file=sys.stderr,
            flush=True,
        )
    print(f"kvgw: serving on http://{settings.host}:{settings.port} (data dir {settings.data_dir})",
          file=sys.stderr, flush=True)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=HoldingHttpToolsProtocol,  # httptools, small responses in one write
        lifespan="on",
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_keep_alive=30,
    )
    return 0


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from gateway.runtime import open_catalog

    catalog = open_catalog(_settings(args))
    print(f"catalog at {catalog.engine.url.render_as_string(hide_password=True)} is up to date")
    catalog.close()
    return 0


def _with_gateway(args: argparse.Namespace, job: Callable[[Any], Any]) -> Any:
    from gateway.runtime import Gateway

    gateway = Gateway(_settings(args))
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

    from backends.catalog.store import BucketPolicy
    from gateway.keys import is_valid_bucket_name
    from gateway.runtime import open_catalog, validate_policy

    settings = _settings(args)
    catalog = open_catalog(settings)
    try:
        if args.bucket_cmd == "list":
            for b in catalog.list_buckets():
                print(json.dumps(_policy_doc(b)))
            return 0
        if not is_valid_bucket_name(args.name):
            print(f"invalid bucket name {args.name!r}", file=sys.stderr)
            return 2
        given = {f: getattr(args, f) for f in _POLICY_FLAGS if getattr(args, f) is not None}
        if args.bucket_cmd == "create":
            policy = replace(BucketPolicy(args.name, settings.max_chunk_bytes), **given)
        else:
            current = catalog.get_bucket(args.name)
            if current is None:
                print(f"no bucket {args.name!r}", file=sys.stderr)
                return 2
            policy = replace(current, **given)
        validate_policy(policy)
        (catalog.create_bucket if args.bucket_cmd == "create" else catalog.update_bucket)(policy)
        print(json.dumps(_policy_doc(policy)))
        return 0
    finally:
        catalog.close()


_POLICY_FLAGS = ("default_ttl_seconds", "max_chunk_bytes", "capacity_bytes", "anonymous_read", "anonymous_write",
                 "write_tier", "write_through", "s3_capacity_bytes", "high_watermark", "low_watermark",
                 "eviction_policy")


def _policy_doc(policy: Any) -> dict[str, Any]:
    return {f: getattr(policy, f) for f in policy.__slots__}


def cmd_cred(args: argparse.Namespace) -> int:
    from gateway.runtime import open_catalog

    catalog = open_catalog(_settings(args))
    try:
        grants = {bucket: (True, bool(args.write)) for bucket in args.bucket or []}
        access_key, secret_key = catalog.create_credential(
            is_root=args.root, description=args.description, grants=grants
        )
        print(json.dumps({"access_key": access_key, "secret_key": secret_key, "root": args.root}))
        return 0
    finally:
        catalog.close()


BENCHMARKS = {
    "io": "gateway.bench.io",  # native API I/O against raw disk and nginx
    "trace": "gateway.bench.trace",  # hit rates on Mooncake traces (sim / online)
    "s3": "gateway.bench.s3",  # the S3 API against the native API and moto
    "lmcache": "gateway.bench.lmcache",  # LMCache's own storage paths through kvgw
}


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    import importlib

    module = importlib.import_module(BENCHMARKS[args.bench_cmd])
    result: int = module.main(rest)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgw", description="KV-cache storage gateway")
    sub = parser.add_subparsers(dest="cmd", required=True)

    serve = sub.add_parser("serve", help="run the gateway")
    _common(serve)
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8080)")
    serve.add_argument("--anonymous", action="store_true", help="allow unauthenticated requests (local use)")
    serve.add_argument("--no-fsync", action="store_true", help="do not fsync chunks (faster, not crash-safe)")
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
        p.add_argument("--write-tier", choices=["fs", "s3"])
        p.add_argument("--write-through", action=argparse.BooleanOptionalAction,
                       help="copy every filesystem write to S3 in the background")
        p.add_argument("--high-watermark", type=float)
        p.add_argument("--low-watermark", type=float)
        p.add_argument("--eviction-policy")
        p.set_defaults(func=cmd_bucket)
    listing = bucket_sub.add_parser("list")
    _common(listing)
    listing.set_defaults(func=cmd_bucket)

    cred = sub.add_parser("cred", help="credentials")
    cred_sub = cred.add_subparsers(dest="cred_cmd", required=True)
    create = cred_sub.add_parser("create", help="create a credential (secret printed once)")
    _common(create)
    create.add_argument("--root", action="store_true")
    create.add_argument("--bucket", action="append", help="grant read access to this bucket (repeatable)")
    create.add_argument("--write", action="store_true", help="grant write access too")
    create.add_argument("--description", default="")
    create.set_defaults(func=cmd_cred)

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

"""``kvgw serve``: bind the port, build the app, say where everything is, serve on the bound socket.

The data directory is locked first (``gateway.datadir.ServeLock``: a second ``kvgw serve`` on it is
refused in one line; the ``--workers`` processes share the lock), then the socket is bound before
anything is printed, so a port that is taken ends the start with one line (never a banner followed by a
traceback), and the banner's curl and aws lines work as printed. TLS (``--tls-cert``/``--tls-key``)
wraps the same socket; everything else is the same on https. SIGTERM or SIGINT drain in-flight requests;
the process then exits 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import resource
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from gateway.config import ConfigurationError, Settings
from gateway.datadir import ServeLock
from gateway.version import kvgw_version

log = logging.getLogger("kvgw")


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``; ConfigurationError (one line) if it cannot be had."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigurationError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ConfigurationError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def raise_open_files_limit() -> None:
    """Every connection is a descriptor: take the hard limit (the soft one is often 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard or hard == resource.RLIM_INFINITY:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def root_credentials(settings: Settings, generated: tuple[str, str] | None) -> tuple[str, str] | None:
    """How the banner's lines name the root credentials without printing a secret in every start's log:
    the values themselves only on the start that generated them (shown once anyway), else the shell
    variables or the file they come from."""
    if generated is not None:
        return generated
    if settings.root_access_key and settings.root_secret_key:
        return "$KVGW_ROOT_ACCESS_KEY", "$KVGW_ROOT_SECRET_KEY"
    path = settings.root_credentials_path
    if path.exists():
        return f"$(sed -n s/^access_key=//p {path})", f"$(sed -n s/^secret_key=//p {path})"
    return None


def banner(settings: Settings, credentials: tuple[str, str] | None, lifecycle: str | None = None) -> str:
    """What a newcomer needs on start: where the two APIs are, and a curl and an aws line that work."""
    scheme = "https" if settings.tls_cert else "http"
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    url = f"{scheme}://{host}:{settings.port}"
    bucket = settings.default_bucket
    ca = f" --cacert {settings.tls_cert}" if settings.tls_cert else ""
    aws_ca = f" --ca-bundle {settings.tls_cert}" if settings.tls_cert else ""
    lines = [f"kvgw {kvgw_version()}: serving on {url} (data dir {settings.data_dir})"]
    if settings.anonymous_admin or settings.anonymous or credentials is None:
        auth, aws_env = "", "AWS_ACCESS_KEY_ID=anonymous AWS_SECRET_ACCESS_KEY=anonymous "
    else:
        auth = f' -H "Authorization: Bearer {credentials[0]}:{credentials[1]}"'
        aws_env = f"AWS_ACCESS_KEY_ID={credentials[0]} AWS_SECRET_ACCESS_KEY={credentials[1]} "
    lines += [
        f"  native API: {url}/v1/buckets/{bucket}/chunks/<key>, e.g.",
        f"    curl -fsS{ca}{auth} -X PUT --data-binary hello {url}/v1/buckets/{bucket}/chunks/hello",
        f"  S3 API: the same port, path-style ({url}/{bucket}/<key>) or virtual-hosted "
        f"(<bucket>.{settings.s3_api_base_domain.split(',')[0]}:{settings.port}), any region, e.g.",
        f"    {aws_env}aws --endpoint-url {url}{aws_ca} --region us-east-1 s3 ls s3://{bucket}",
    ]
    if lifecycle is not None:
        lines.append(f"  bucket {bucket}: {lifecycle} (kvgw bucket update {bucket} --capacity-bytes N ...)")
    if credentials is None and not settings.anonymous:
        lines.append("  (root credentials: KVGW_ROOT_ACCESS_KEY / KVGW_ROOT_SECRET_KEY, or `kvgw cred create --root`)")
    return "\n".join(lines)


def worker_count(settings: Settings) -> int:
    """``--workers``, or by default one per core (at most ``max_workers``) for a gateway on a shared
    PostgreSQL catalog, and one for the embedded SQLite default (no extra process)."""
    if settings.workers is not None:
        return max(1, settings.workers)
    if settings.catalog_dsn.startswith("sqlite"):
        return 1
    return max(1, min(os.cpu_count() or 1, settings.max_workers))


def serve(settings: Settings) -> int:
    """Bind, announce, then run one worker in this process, or supervise ``workers`` forked ones that
    share the listening socket (and the LMDB index, the tiers and the catalog)."""
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise ConfigurationError("TLS needs both --tls-cert and --tls-key (KVGW_TLS_CERT / KVGW_TLS_KEY)")
    for path in (settings.tls_cert, settings.tls_key):
        if path is not None and not Path(path).is_file():
            raise ConfigurationError(f"TLS file {path} does not exist")
    raise_open_files_limit()
    lock = ServeLock.acquire(settings.data_dir, settings.port)  # held until this process (and its workers) end
    try:
        sock = listen(settings.host, settings.port)
        workers = worker_count(settings)
        if workers == 1:
            from gateway.app import create_app

            app = create_app(settings)
            root = app.gateway.generated_root
            announce(settings, None if root is None else root, app.gateway.directory.buckets(), workers)
            return run_worker(settings, app, sock)
        from gateway.runtime import bootstrap, open_catalog

        catalog = open_catalog(settings)  # once, before the workers: root credentials and the default bucket
        try:
            root = bootstrap(settings, catalog)
            buckets = catalog.list_buckets()
        finally:
            catalog.close()
        announce(settings, root, buckets, workers)
        return Supervisor(settings, sock, workers).run()
    finally:
        lock.release()


def announce(settings: Settings, root: Any, buckets: list[Any], workers: int) -> None:
    """Generated credentials (once), the banner, and the warnings an operator must see."""
    from gateway.buckets import describe_policy

    if root is not None:
        print(f"kvgw: generated root credentials (shown once; saved to {root.path}, mode 0600)\n"
              f"  access key: {root.access_key}\n  secret key: {root.secret_key}", file=sys.stderr, flush=True)
    generated = None if root is None else (root.access_key, root.secret_key)
    default = next((b for b in buckets if b.name == settings.default_bucket), None)
    lifecycle = None if default is None else describe_policy(default)
    print(banner(settings, root_credentials(settings, generated), lifecycle), file=sys.stderr, flush=True)
    if workers > 1:
        print(f"  {workers} worker processes (--workers)", file=sys.stderr, flush=True)
    if settings.anonymous_admin:
        print("kvgw: WARNING: --anonymous-admin: anyone who can reach this port may read, write, delete and "
              "administer every bucket", file=sys.stderr, flush=True)
    elif settings.anonymous:
        print("kvgw: WARNING: --anonymous: anyone who can reach this port may read and write every bucket "
              "(deleting and administering still need credentials; --anonymous-admin allows them)",
              file=sys.stderr, flush=True)


def run_worker(settings: Settings, app: Any, sock: socket.socket) -> int:
    """kvgw's HTTP server (``gateway.dataplane``) on the bound socket until SIGTERM/SIGINT, which drain
    in-flight requests first; the exit status (0 after a clean stop)."""
    import ssl

    from gateway.dataplane.limits import ConnectionLimits
    from gateway.dataplane.server import HttpServer, ServerState, run

    limits = ConnectionLimits(settings.header_timeout, settings.idle_timeout, settings.max_connections,
                              settings.max_connections_per_client)
    context = None
    if settings.tls_cert:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(settings.tls_cert), str(settings.tls_key) if settings.tls_key else None)
    state = ServerState(app, limits, lane=app.lane, access_log=settings.access_log)
    server = HttpServer(state, ssl_context=context, shutdown_grace=max(1.0, settings.shutdown_grace_seconds))
    return run(server, sock)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process if its parent (the supervisor) dies first: a worker must
    never outlive its gateway (it holds the data directory's lock and serves the shared socket), also
    when the supervisor itself is killed. Linux only; elsewhere workers are stopped by the supervisor
    alone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


class Supervisor:
    """The parent of ``--workers`` processes: forks them, restarts one that dies, and on SIGTERM or
    SIGINT passes SIGTERM on and waits for every worker to drain and exit.

    Workers are forked before any of them opens the index or starts a thread; each builds its own
    gateway (index environment, catalog connections, event loop). A worker that keeps dying within a
    second of its start is not restarted more than ``MAX_FAST_RESTARTS`` times in a row: then the whole
    server stops, with its exit status, instead of spinning.
    """

    MAX_FAST_RESTARTS = 5

    def __init__(self, settings: Settings, sock: socket.socket, count: int) -> None:
        self._settings = settings
        self._sock = sock
        self._count = count
        self._children: dict[int, tuple[int, float]] = {}  # pid -> (slot, started at)
        self._stopping = False
        self._fast_restarts = 0

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        for slot in range(self._count):
            self._spawn(slot)
        status = 0
        while self._children:
            try:
                pid, code = os.wait()
            except ChildProcessError:
                break
            slot_started = self._children.pop(pid, None)
            if slot_started is None:
                continue
            slot, started = slot_started
            exit_code = os.waitstatus_to_exitcode(code)
            if self._stopping:
                continue
            log.warning("worker %d (pid %d) exited with %d; starting another", slot, pid, exit_code)
            self._fast_restarts = self._fast_restarts + 1 if time.monotonic() - started < 1.0 else 0
            if self._fast_restarts > self.MAX_FAST_RESTARTS:
                log.error("workers keep failing at start; stopping")
                status = exit_code or 1
                self._stop(signal.SIGTERM, None)
                continue
            self._spawn(slot)
        return status

    def _spawn(self, slot: int) -> None:
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the worker
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            die_with_parent(parent)
            code = 0
            try:
                from gateway.app import create_app

                code = run_worker(self._settings, create_app(self._settings), self._sock)
            except BaseException:
                log.exception("worker %d failed", slot)
                code = 1
            finally:
                logging.shutdown()
                os._exit(code)
        self._children[pid] = (slot, time.monotonic())

    def _stop(self, signum: int, _frame: object) -> None:
        self._stopping = True
        for pid in list(self._children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

"""The data directory: only ``kvgw serve`` creates one, and only one ``kvgw serve`` serves it at a time.

A maintenance or administration command (``kvgw bucket list``, ``cred create``, ``scrub``, ...) run in
the wrong directory must not make a new, empty gateway there (a new catalog, a new catalog key, new
root credentials) and answer as if all were well: it refuses in one line naming where it looked
(``require``, ``missing``). A command needs the directory when its catalog is the embedded SQLite one
in it, when it would create the catalog key there (``gateway.runtime.open_catalog``), and when it works
on the gateway's index; one that reaches a PostgreSQL catalog whose key it is given needs none.

Two gateways on one data directory would share its LMDB index and staging files without knowing it.
``ServeLock`` is an exclusive ``flock`` on ``<data-dir>/serve.lock``, taken by ``kvgw serve`` before it
binds its port and held for its whole life; a second ``kvgw serve`` is refused with the holder's pid
and port. The ``--workers`` processes are forked with the descriptor, so they share the parent's lock
(an flock belongs to the open file, not the process) and hold it as long as any of them runs. The
kernel drops the lock when the last holder exits, however it exits, so there is nothing stale to clean
up; the file itself stays, with the last holder's pid and port.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from gateway.config import ConfigurationError, Settings

LOCK_NAME = "serve.lock"
DEFAULT = Settings.model_fields["data_dir"].default


def missing(settings: Settings) -> ConfigurationError:
    """The one line for a command that needs a data directory that is not there, saying where it looked."""
    path = settings.data_dir.resolve()
    if settings.data_dir == DEFAULT and not os.environ.get("KVGW_DATA_DIR"):
        where = "the default: ./kvgw-data in the current directory, as neither --data-dir nor KVGW_DATA_DIR is set"
    else:
        where = "as --data-dir, KVGW_DATA_DIR or the config file's data_dir say"
    return ConfigurationError(
        f"no data directory at {path} ({where}); only `kvgw serve` creates one: run this where the gateway "
        "keeps its data, or give its --data-dir"
    )


def require(settings: Settings) -> None:
    """ConfigurationError (``missing``) unless the data directory exists."""
    if not settings.data_dir.is_dir():
        raise missing(settings)


class ServeLock:
    """``<data-dir>/serve.lock``, held exclusively by one ``kvgw serve`` (and its forked workers)."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, data_dir: Path, port: int) -> ServeLock:
        """Create the data directory if needed and lock it; ConfigurationError, naming the pid and port
        of the gateway that holds it, when another ``kvgw serve`` does."""
        path = data_dir / LOCK_NAME
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConfigurationError(f"cannot use the data directory {data_dir.resolve()}: "
                                     f"{exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").split()
            os.close(fd)
            who = " ".join(holder) or "another process"
            raise ConfigurationError(
                f"the data directory {data_dir.resolve()} is already served by kvgw ({who}): stop that "
                "gateway first, or give this one its own --data-dir (gateways share chunks through "
                "KVGW_FS_ROOT and a PostgreSQL catalog, each with its own data directory)"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()} port={port}\n".encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        """Drop the lock (the kernel also drops it when every process holding the descriptor exits)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

"""``KvgwClient.blocking``: the client's calls for plain threads.

Each call runs on the client's I/O loop and blocks only the calling thread, except the lookups
(``exists``, ``prefix``), whose first attempt the calling thread makes itself (``KvgwClient.lookup_now``);
calling one from a thread that runs an event loop raises RuntimeError (blocking there would stall that
loop).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvgw_client.framing import BatchItem, BufferProvider, ItemStatus
from kvgw_client.wire import Hint, Retention

if TYPE_CHECKING:
    from kvgw_client.changes import ChangePage
    from kvgw_client.http import KvgwClient, Payload, PutOutcome


class BlockingClient:
    """The client's calls for plain threads: each blocks the calling thread, never an event loop."""

    def __init__(self, client: KvgwClient) -> None:
        self._c = client

    def exists(self, keys: Sequence[str], *, quiet: bool = False, timeout: float | None = None) -> list[bool]:
        """``KvgwClient.exists``, asked on this thread (``KvgwClient.lookup_now``)."""
        from kvgw_client.http import EXISTS

        return self._c.lookup_now(EXISTS, list(keys), quiet=quiet, timeout=timeout)

    def prefix(self, keys: Sequence[str], *, quiet: bool = False, timeout: float | None = None) -> int:
        """``KvgwClient.prefix``, asked on this thread (``KvgwClient.lookup_now``)."""
        from kvgw_client.http import PREFIX

        return self._c.lookup_now(PREFIX, list(keys), quiet=quiet, timeout=timeout)

    def put(
        self,
        key: str,
        data: Payload,
        *,
        parent: str | None = None,
        ttl: int | None = None,
        retention: Retention | None = None,
        quiet: bool = False,
        timeout: float | None = None,
    ) -> PutOutcome:
        return self._c.io.call(self._c.put(key, data, parent=parent, ttl=ttl, retention=retention, quiet=quiet,
                                           timeout=timeout))

    def hint(self, hint: Hint | str, keys: Sequence[str], *, quiet: bool = False,
             timeout: float | None = None) -> int:
        return self._c.io.call(self._c.hint(hint, keys, quiet=quiet, timeout=timeout))

    def get(self, key: str, *, quiet: bool = False, timeout: float | None = None) -> bytearray | None:
        return self._c.io.call(self._c.get(key, quiet=quiet, timeout=timeout))

    def delete(self, key: str, *, quiet: bool = False, timeout: float | None = None) -> bool:
        return self._c.io.call(self._c.delete(key, quiet=quiet, timeout=timeout))

    def ping(self) -> bool:
        return self._c.io.call(self._c.ping())

    def batch_get_into(
        self,
        keys: Sequence[str],
        into: BufferProvider,
        *,
        on_item: Callable[[BatchItem], None] | None = None,
        quiet: bool = False,
        timeout: float | None = None,
    ) -> list[ItemStatus]:
        return self._c.io.call(self._c.batch_get_into(keys, into, on_item=on_item, quiet=quiet, timeout=timeout))

    def list_keys(
        self,
        prefix: str = "",
        *,
        after: str | None = None,
        limit: int = 1000,
        quiet: bool = False,
        timeout: float | None = None,
    ) -> tuple[list[str], bool]:
        return self._c.io.call(self._c.list_keys(prefix, after=after, limit=limit, quiet=quiet, timeout=timeout))

    def changes(
        self,
        prefix: str = "",
        *,
        after: int | None = None,
        limit: int = 1000,
        quiet: bool = False,
        timeout: float | None = None,
    ) -> ChangePage | None:
        return self._c.io.call(self._c.changes(prefix, after=after, limit=limit, quiet=quiet, timeout=timeout))

"""Response heads: status lines and the headers every response carries (``date``, ``server``)."""

from __future__ import annotations

import http
import time
from email.utils import formatdate

STATUS_LINES: dict[int, bytes] = {
    status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode("latin-1")) for status in http.HTTPStatus
}


def status_line(status: int) -> bytes:
    line = STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d \r\n" % status


SERVER = b"kvgw"


class CommonHeaders:
    """``date`` and ``server`` as one ready line pair, reformatted once per second (HTTP dates have
    whole seconds). Not thread-safe; used on the event loop."""

    __slots__ = ("_lines", "_second")

    def __init__(self) -> None:
        self._second = -1
        self._lines = b""

    def lines(self) -> bytes:
        second = int(time.time())
        if second != self._second:
            self._second = second
            self._lines = b"date: %s\r\nserver: %s\r\n" % (formatdate(second, usegmt=True).encode(), SERVER)
        return self._lines

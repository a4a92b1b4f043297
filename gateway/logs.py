"""Logging set-up for ``kvgw serve``: plain text, or one JSON object per line (``--log-format json``),
both carrying the id of the request a record was logged for (``request_id``, the same id as the
response's ``x-kvgw-request-id`` / ``x-amz-request-id``).

The id travels in a context variable set where a request is parsed (``gateway.api.http.Request``), so a
record logged anywhere below, in the same task, carries it; records outside a request have none.
"""

from __future__ import annotations

import contextvars
import logging
import time
from typing import Any

import orjson

current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvgw_request_id", default=None)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(request)s: %(message)s"


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` (and ``request``, " [id]" or "", for the text format) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = current_request_id.get()
        record.request_id = request_id
        record.request = f" [{request_id}]" if request_id else ""
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            doc["request_id"] = request_id
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(doc).decode()


def configure(level: str, fmt: str) -> None:
    """Root logging for the server process (every logger of the process propagates to it)."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be text or json, not {fmt!r}")
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # alembic reports every migration context at INFO (7 lines per start): shown at debug only
    logging.getLogger("alembic").setLevel(logging.NOTSET if root.level <= logging.DEBUG else logging.WARNING)

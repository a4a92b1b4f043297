"""The lookup lane: HEAD, exists and prefix answered inside the HTTP protocol, with no ASGI request
cycle, when the index alone gives the whole answer: the native API's HEAD, exists and prefix, and the
S3 API's HeadObject (vLLM's object tier sends one per block).

Why: engines look up before every load, so a lookup's latency sits on time-to-first-token. An ASGI
request cycle (a task, the scope, the messages, the metrics wrapper) costs about what the lookup itself
does (``kvgw bench floor``); answered from inside the protocol, the same canned answer matches a raw
socket responder. BENCHMARKS.md ("kvgw bench floor") has the figures with the lane on and off.

How: the connection (``gateway.dataplane.protocol``) recognises such a request when its head is complete
(``GatewayApp.takes_indexed``), collects the small body itself and, when the message is complete, asks
``answer_indexed`` of the API the path belongs to: an answer is written at once, with the common
headers (date, server), and counted in the request metrics as the ASGI path counts. Misses are answered
too when every tier that would be asked rules the chunk out at once (``Tier.absent_now``: a local
filesystem's dentry cache; never S3 or NFS). Anything else (an error, a miss only a tier's answer
settles, a lease the view cannot grant, a credential, bucket or S3 attributes the in-memory views do not
hold yet) is handed over: a request cycle starts then with the head and body as received, and the API
answers as it would have; the lane has changed nothing but what it notes for the API (a signature it
verified). Authentication is the APIs' own (S3's SigV4 is verified on the lane as on the ASGI path).

Requests the connection leaves to the request cycle from their head on: anything but HTTP/1.1
keep-alive; ``Expect``; a target that is not a plain path (absolute form, a query string, a fragment);
a body without ``Content-Length`` or larger than ``LANE_BODY_LIMIT``; a request behind one still being
answered (pipelined) or on a connection whose writes are paused (the ASGI path waits for the client to
read). The access log (``KVGW_ACCESS_LOG``) logs the lane's answers as it logs the cycle's.

The header deadline (``gateway.dataplane.limits``) covers a lane request until its body is complete.
Everything here runs on the event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from gateway.api.http import IndexedAnswer, RawHeaders
from gateway.dataplane.heads import status_line
from gateway.metrics import RequestMetrics

log = logging.getLogger("kvgw.api")

LANE_BODY_LIMIT = 64 * 1024  # what the request cycle reads ahead of an app (``cycle.HIGH_WATER``)


class Answering(Protocol):
    """The gateway's APIs as the lane asks them (``gateway.app.GatewayApp``)."""

    def takes_indexed(self, method: str, raw_path: str) -> bool: ...

    def answer_indexed(self, method: str, raw_path: str, headers: RawHeaders, body: bytes,
                       notes: dict[str, Any]) -> tuple[str, IndexedAnswer] | None: ...


class LookupLane:
    """The APIs' indexed answers as complete HTTP responses, counted in the request metrics."""

    def __init__(self, apis: Answering, metrics: RequestMetrics,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._apis = apis
        self._metrics = metrics
        self.clock = clock

    def takes(self, method: str, raw_path: str) -> bool:
        return self._apis.takes_indexed(method, raw_path)

    def answer(self, method: str, raw_path: str, headers: RawHeaders, body: bytes, common: bytes,
               started: float, notes: dict[str, Any]) -> tuple[int, bytes] | None:
        """(status, the whole response), or None: the request must be handed to the ASGI app (nothing
        counted) with ``notes`` in its scope. ``common``: the header lines every response carries."""
        answered = self._apis.answer_indexed(method, raw_path, headers, body, notes)
        if answered is None:
            self._metrics.lane_handed_over.inc()
            return None
        self._metrics.lane_answered.inc()
        api, found = answered
        head = [status_line(found.status), common]
        for name, value in found.headers:
            head += (name, b": ", value, b"\r\n")
        head.append(b"\r\n")
        self._metrics.answered(api, found.op, found.status, self.clock() - started, len(body), len(found.body),
                               found.retried)
        head.append(found.body)
        return found.status, b"".join(head)

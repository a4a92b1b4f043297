"""The lookup lane: HEAD, exists and prefix answered inside the HTTP protocol, with no ASGI request
cycle, when the index alone gives the whole answer: the native API's HEAD, exists and prefix, and the
S3 API's HeadObject (vLLM's object tier sends one per block).

Why: engines look up before every load, so a lookup's latency sits on time-to-first-token.
``kvgw bench floor`` measured uvicorn's per-request machinery (a request cycle, its task, the ASGI
scope and messages, the metrics wrapper) at ~16-34 µs of server CPU per call, and an app answering
canned bytes through it at 1.22-1.37x the p50 of a raw-socket responder; answered from inside the
protocol, the same canned answer matched the raw responder. BENCHMARKS.md ("kvgw bench floor") has
the figures with the lane on and off.

How: ``LaneHttpProtocol`` (the last subclass of uvicorn's httptools protocol here) recognises such a
request when its head is complete (``GatewayApp.takes_indexed``), holds back uvicorn's request cycle
and collects the small body itself. When the message is complete it asks ``answer_indexed`` of the API
the path belongs to: an answer is written at once, with uvicorn's default headers (date, server), and
counted in the request metrics as the ASGI path counts. Misses are answered too when every tier that
would be asked rules the chunk out at once (``Tier.absent_now``: a local filesystem's dentry cache;
never S3 or NFS). Anything else (an error, a miss only a tier's answer settles, a lease, a credential,
bucket or S3 attributes the in-memory views do not hold yet) is handed over: uvicorn's cycle starts
then with the head and body as received, and the API answers as it would have; the lane has changed
nothing but what it notes for the API (a signature it verified). Authentication is the APIs' own
(S3's SigV4 is verified on the lane as on the ASGI path).

Requests the lane leaves to uvicorn from their head on: anything but HTTP/1.1 keep-alive; ``Expect``;
a target that is not a plain path (absolute form, a query string, a fragment); a body without
``Content-Length`` or larger than ``LANE_BODY_LIMIT`` (uvicorn's own read-ahead limit, so a connection
holds no more than before); a request behind one still being answered (pipelined) or on a connection
whose writes are paused (the ASGI path waits for the client to read); every request when kvgw's
access log is on (``KVGW_ACCESS_LOG``: uvicorn logs from its request cycle). That decision is kvgw's
setting alone: uvicorn guesses it from whether any log handler exists, so a handler installed by
someone else (pytest, an embedding application) would otherwise turn the lane off.

The header deadline (``gateway.api.connections``) covers a lane request until its body is complete.
Everything here runs on the event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from gateway.api.connections import ConnectionLimits
from gateway.api.http import IndexedAnswer, RawHeaders, plain_body_length
from gateway.api.intake import IntakeHttpProtocol
from gateway.metrics import RequestMetrics

log = logging.getLogger("kvgw.api")

LANE_BODY_LIMIT = 64 * 1024  # uvicorn's HIGH_WATER_LIMIT: what it reads ahead of an app


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

    def answer(self, method: str, raw_path: str, headers: RawHeaders, body: bytes,
               default_headers: list[tuple[bytes, bytes]], started: float, notes: dict[str, Any]) -> bytes | None:
        """The whole response, or None: the request must be handed to the ASGI app (nothing counted)
        with ``notes`` in its scope."""
        answered = self._apis.answer_indexed(method, raw_path, headers, body, notes)
        if answered is None:
            self._metrics.lane_handed_over.inc()
            return None
        self._metrics.lane_answered.inc()
        api, found = answered
        head = [STATUS_LINE[found.status]]
        for name, value in default_headers:
            head += (name, b": ", value, b"\r\n")
        for name, value in found.headers:
            head += (name, b": ", value, b"\r\n")
        head.append(b"\r\n")
        self._metrics.answered(api, found.op, found.status, self.clock() - started, len(body), len(found.body),
                               found.retried)
        return b"".join(head) + found.body


class LaneHttpProtocol(IntakeHttpProtocol):
    """``uvicorn.run(http=protocol_class(limits, lane))``: the guarded protocol, the body intake
    (``gateway.api.intake``) and the lookup lane."""

    lane: ClassVar[LookupLane | None] = None
    kvgw_access_log: ClassVar[bool] = False  # kvgw's setting; uvicorn's own flag is overridden with it

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.access_log = self.kvgw_access_log
        self._lane_body: list[bytes] | None = None  # a lane request is being received
        self._lane_started = 0.0

    def on_headers_complete(self) -> None:
        if not self._lane_takes():
            super().on_headers_complete()
            return
        self._lane_body = []
        assert self.lane is not None
        self._lane_started = self.lane.clock()
        # uvicorn's cycle waits: ``_hand_over`` starts it if the lane cannot answer. The header
        # deadline stays armed until the body is complete.

    def _lane_takes(self) -> bool:
        lane = self.lane
        if (lane is None or self.kvgw_access_log or self.pipeline or self.flow.write_paused or self.expect_100_continue
                or (self.cycle is not None and not self.cycle.response_complete)):
            return False
        parser = self.parser
        if parser.get_http_version() != "1.1" or not parser.should_keep_alive() or parser.should_upgrade():
            return False
        url: bytes = self.url
        method = parser.get_method().decode("ascii")
        if not url.startswith(b"/") or b"?" in url or b"#" in url or not lane.takes(method, url.decode("latin-1")):
            return False
        length = plain_body_length(self.headers)
        return length is not None and length <= (LANE_BODY_LIMIT if method == "POST" else 0)

    def on_body(self, body: bytes) -> None:
        if self._lane_body is None:
            super().on_body(body)
        else:
            self._lane_body.append(body)

    def on_message_complete(self) -> None:
        if self._lane_body is None:
            super().on_message_complete()
            return
        body = b"".join(self._lane_body)
        self._lane_body = None
        self._disarm_header_timer()
        assert self.lane is not None
        notes: dict[str, Any] = {}
        try:
            response = self.lane.answer(self.parser.get_method().decode("ascii"), self.url.decode("latin-1"),
                                        self.headers, body, self.server_state.default_headers, self._lane_started,
                                        notes)
        except Exception:
            log.exception("the lookup lane failed; the request goes to the ASGI app")
            response, notes = None, {}
        if response is None:
            self._hand_over(body, notes)
            return
        self._holding.write_now(response)  # complete: no flush to schedule
        self.on_response_complete()

    def _hand_over(self, body: bytes, notes: dict[str, Any]) -> None:
        """Start uvicorn's request cycle for the request just received, as if the lane were not here
        (plus ``notes`` in its scope: work the lane did that the app need not do again)."""
        super().on_headers_complete()
        self.scope.update(notes)  # type: ignore[typeddict-item]  # the cycle's task has not run yet
        if body:
            super().on_body(body)
        super().on_message_complete()


def protocol_class(limits: ConnectionLimits, lane: LookupLane | None = None,
                   access_log: bool = False) -> type[LaneHttpProtocol]:
    """The protocol class for one server, with its limits, lane and access-log setting (uvicorn
    instantiates it per connection); without a lane, or with the access log on, every request goes
    through uvicorn's request cycle."""
    return type("KvgwHttpProtocol", (LaneHttpProtocol,),
                {"limits": limits, "lane": lane, "kvgw_access_log": access_log})

"""The lookup lane (``gateway.api.lane``): index-only HEAD / exists / prefix (native) and HeadObject
(S3) answered inside the HTTP protocol, everything else handed to the ASGI app unchanged.

A real gateway (real LMDB, real directories) is served by kvgw's HTTP server on a real socket, in a thread of
this process, so the tests can see which requests reached the ASGI app: the lane's answers must not,
and every other request must, with the answer the ASGI path gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from gateway.api.http import Receive, Scope, Send
from gateway.app import GatewayApp, create_app
from gateway.config import Settings
from gateway.dataplane.lane import LANE_BODY_LIMIT
from gateway.dataplane.limits import ConnectionLimits
from gateway.dataplane.server import HttpServer, ServerState
from gateway.logs import RequestIdFilter
from tests.conftest import ROOT_AK, ROOT_SK, wait_for

AUTH = f"Bearer {ROOT_AK}:{ROOT_SK}"
KEYS = [f"lane-{i:03d}" for i in range(8)]


class CountingApp:
    """The gateway's ASGI app, recording each HTTP request that reaches it."""

    def __init__(self, app: GatewayApp) -> None:
        self.app = app
        self.seen: list[tuple[str, str]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.seen.append((scope["method"], scope["path"]))
        await self.app(scope, receive, send)


@dataclass
class LaneServer:
    port: int
    app: CountingApp
    state: ServerState
    server: HttpServer
    thread: threading.Thread = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def calls(self) -> list[tuple[str, str]]:
        """The requests the ASGI app saw since the last call (minus the metrics scrapes)."""
        seen, self.app.seen[:] = list(self.app.seen), []
        return [call for call in seen if call[1] != "/metrics"]


@contextlib.contextmanager
def serving(tmp_path: Path, *, access_log: bool = False) -> Iterator[LaneServer]:
    """A real gateway served in a thread through kvgw's protocol, with ``KEYS`` stored."""
    settings = Settings(data_dir=tmp_path / "data", root_access_key=ROOT_AK, root_secret_key=ROOT_SK,  # type: ignore[arg-type]
                        access_log=access_log)
    gateway_app = create_app(settings)
    app = CountingApp(gateway_app)
    state = ServerState(app, ConnectionLimits(header_timeout=1.0), lane=gateway_app.lane, access_log=access_log)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = HttpServer(state)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sock)), daemon=True)
    thread.start()
    running = LaneServer(sock.getsockname()[1], app, state, server, thread)
    try:
        wait_for(lambda: server.started, "the in-process gateway to start")
        with httpx.Client(base_url=running.url, headers={"Authorization": AUTH}) as client:
            for key in KEYS:
                assert client.put(chunk_path(key), content=key.encode() * 100).status_code == 201
        running.calls()
        yield running
    finally:
        server.request_stop()
        thread.join(30)
        sock.close()


@pytest.fixture
def lane(tmp_path: Path) -> Iterator[LaneServer]:
    with serving(tmp_path) as running:
        yield running


def chunk_path(key: str) -> str:
    return f"/v1/buckets/kvcache/chunks/{quote(key, safe='')}"


def keys_body(keys: list[str], **extra: Any) -> bytes:
    return json.dumps({"keys": keys, **extra}).encode()


def request(method: str, path: str, body: bytes = b"", *, auth: str | None = AUTH, extra: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: kvgw\r\n".encode()
    if auth is not None:
        head += f"Authorization: {auth}\r\n".encode()
    if method == "POST":
        head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
    return head + extra + b"\r\n" + body


@dataclass
class Reply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)

    def json(self) -> Any:
        return json.loads(self.body)


class Connection:
    """One keep-alive connection, answers read one by one (HEAD answers have no body)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("closed by the server")
        self.buffer += data

    def reply(self, *, head_request: bool = False) -> Reply:
        while b"\r\n\r\n" not in self.buffer:
            self._fill()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = [(k.lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines)]
        status = int(status_line.split()[1])
        length = 0 if head_request or status < 200 else int(next(v for k, v in headers if k == "content-length"))
        while len(self.buffer) < length:
            self._fill()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return Reply(status, headers, body)

    def closed(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except (ConnectionResetError, TimeoutError):
            return False

    def close(self) -> None:
        self.sock.close()


def exchange(server: LaneServer, data: bytes, *, head_request: bool = False) -> Reply:
    conn = Connection(server.port)
    try:
        conn.send(data)
        return conn.reply(head_request=head_request)
    finally:
        conn.close()


def normalized(reply: Reply) -> tuple[int, list[tuple[str, str]], bytes]:
    """A reply with its request id and date blanked, for comparing two answers to the same request."""
    request_id = reply.header("x-kvgw-request-id") or reply.header("x-amz-request-id") or ""
    ids = ("x-kvgw-request-id", "x-amz-request-id", "x-amz-id-2")
    headers = [(k, "<id>" if k in ids else "<date>" if k == "date" else v) for k, v in reply.headers]
    return reply.status, headers, reply.body.replace(request_id.encode(), b"<id>")


# -- answered by the lane ------------------------------------------------------------------------


def test_indexed_lookups_are_answered_without_the_asgi_app(lane: LaneServer) -> None:
    exists = exchange(lane, request("POST", "/v1/buckets/kvcache/exists", keys_body(KEYS)))
    prefix = exchange(lane, request("POST", "/v1/buckets/kvcache/prefix", keys_body(KEYS[:5])))
    head = exchange(lane, request("HEAD", chunk_path(KEYS[2])), head_request=True)
    empty = exchange(lane, request("POST", "/v1/buckets/kvcache/exists", keys_body([])))

    assert (exists.status, exists.json()) == (200, {"exists": [True] * len(KEYS)})
    assert (prefix.status, prefix.json()) == (200, {"length": 5})
    assert (empty.status, empty.json()) == (200, {"exists": []})
    assert head.status == 200 and head.header("content-length") == str(len(KEYS[2]) * 100)
    assert lane.calls() == []


def test_the_lane_engages_whatever_log_handlers_exist(lane: LaneServer) -> None:
    """Whether the lane answers does not depend on who installed a log handler (uvicorn, which kvgw
    served through before, turned its access log on when any handler could receive its records, and
    the lane then stepped aside)."""
    handler = logging.NullHandler()
    for name in ("", "uvicorn.access"):
        logging.getLogger(name).addHandler(handler)
    try:
        assert logging.getLogger("uvicorn.access").hasHandlers()
        exists = exchange(lane, request("POST", "/v1/buckets/kvcache/exists", keys_body(KEYS)))
    finally:
        for name in ("", "uvicorn.access"):
            logging.getLogger(name).removeHandler(handler)
    assert (exists.status, exists.json()) == (200, {"exists": [True] * len(KEYS)})
    assert lane.calls() == []


def test_with_the_access_log_on_lane_answers_are_logged_like_the_apps(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvgw.access")
    caplog.handler.addFilter(RequestIdFilter())  # as kvgw serve's handler has it (gateway.logs)
    with serving(tmp_path, access_log=True) as logged:
        exists = exchange(logged, request("POST", "/v1/buckets/kvcache/exists", keys_body(KEYS)))
        missing = exchange(logged, request("GET", chunk_path("not-there")))
        assert (exists.status, exists.json()) == (200, {"exists": [True] * len(KEYS)})
        assert missing.status == 404
        assert logged.calls() == [("GET", "/v1/buckets/kvcache/chunks/not-there")]  # the exists: on the lane
        wait_for(lambda: len([r for r in caplog.records if r.name == "kvgw.access"]) >= 2, "two access-log lines")
    lines = {r.getMessage(): r for r in caplog.records if r.name == "kvgw.access"}
    exists_line = next(m for m in lines if "POST /v1/buckets/kvcache/exists HTTP/1.1" in m)
    get_line = next(m for m in lines if "GET /v1/buckets/kvcache/chunks/not-there HTTP/1.1" in m)
    assert exists_line.endswith(" 200") and get_line.endswith(" 404")
    assert getattr(lines[exists_line], "request_id", None) == exists.header("x-kvgw-request-id")
    assert getattr(lines[get_line], "request_id", None) == missing.header("x-kvgw-request-id")


def test_lane_answers_equal_the_asgi_apps_byte_for_byte(lane: LaneServer) -> None:
    requests = [(request("POST", "/v1/buckets/kvcache/exists", keys_body(KEYS)), False),
                (request("POST", "/v1/buckets/kvcache/prefix", keys_body(KEYS)), False),
                (request("HEAD", chunk_path(KEYS[0])), True)]
    by_lane = [normalized(exchange(lane, raw, head_request=head)) for raw, head in requests]
    assert lane.calls() == []
    lane.state.lane = None  # every request through the request cycle and the ASGI app
    by_app = [normalized(exchange(lane, raw, head_request=head)) for raw, head in requests]
    assert len(lane.calls()) == len(requests)
    assert by_lane == by_app


@pytest.mark.parametrize("split", ["in the request line", "after the head", "in the body"])
def test_a_lookup_arriving_in_pieces_is_answered_on_the_lane_as_a_whole_one_is(lane: LaneServer, split: str) -> None:
    raw = request("POST", EXISTS, keys_body(KEYS))
    whole = normalized(exchange(lane, raw))
    at = {"in the request line": 7, "after the head": raw.index(b"\r\n\r\n") + 4, "in the body": len(raw) - 3}[split]
    conn = Connection(lane.port)
    try:
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.send(raw[:at])
        time.sleep(0.05)  # the server reads the first part before the rest is sent
        conn.send(raw[at:])
        pieces = normalized(conn.reply())
    finally:
        conn.close()
    assert pieces == whole
    assert lane.calls() == []


def test_lane_answers_are_counted_in_the_request_metrics(lane: LaneServer) -> None:
    for _ in range(3):
        exchange(lane, request("POST", "/v1/buckets/kvcache/exists", keys_body(KEYS)))
    exchange(lane, request("HEAD", chunk_path(KEYS[0])), head_request=True)
    assert lane.calls() == []
    metrics = httpx.get(f"{lane.url}/metrics", headers={"Authorization": AUTH}).text

    def value(pattern: str) -> float:
        match = re.search(pattern + r" (\S+)", metrics)
        assert match, pattern
        return float(match.group(1))

    assert value(r'kvgw_requests_total\{api="native",op="exists",status="200"\}') == 3
    assert value(r'kvgw_requests_total\{api="native",op="head_chunk",status="200"\}') == 1
    assert value(r'kvgw_request_seconds_count\{api="native",op="exists"\}') == 3
    assert value(r'kvgw_lookup_keys_total\{op="exists",result="hit"\}') == 3 * len(KEYS)
    assert value(r'kvgw_lookup_keys_total\{op="head",result="hit"\}') == 1
    assert value(r'kvgw_lane_requests_total\{result="answered"\}') == 4
    exchange(lane, request("POST", EXISTS, keys_body(KEYS), auth=None))  # 401: handed over
    metrics = httpx.get(f"{lane.url}/metrics", headers={"Authorization": AUTH}).text
    assert value(r'kvgw_lane_requests_total\{result="handed_over"\}') == 1


# -- handed over ---------------------------------------------------------------------------------


EXISTS = "/v1/buckets/kvcache/exists"
PREFIX = "/v1/buckets/kvcache/prefix"

HANDED_OVER: dict[str, tuple[bytes, int, Any]] = {
    # what the lane cannot answer from the in-memory views: the ASGI path answers, as documented
    "a lease asked for": (request("POST", EXISTS, keys_body(KEYS[:2], lease_ms=1000)), 200, None),
    "not JSON": (request("POST", EXISTS, b"{nope"), 400, "InvalidRequest"),
    "not a keys document": (request("POST", PREFIX, b'{"keys": [1]}'), 400, "InvalidRequest"),
    "wrong credentials": (request("POST", EXISTS, keys_body(KEYS), auth=f"Bearer {ROOT_AK}:wrong"), 401,
                          "Unauthorized"),
    "no credentials": (request("POST", EXISTS, keys_body(KEYS), auth=None), 401, "Unauthorized"),
    "an unknown bucket": (request("POST", "/v1/buckets/nosuch/exists", keys_body(KEYS)), 404, "NoSuchBucket"),
    "an invalid bucket name": (request("POST", "/v1/buckets/No_Such/exists", keys_body(KEYS)), 400,
                               "InvalidRequest"),
    # what the lane leaves to the request cycle from the request head on
    "a query string": (request("POST", EXISTS + "?x=1", keys_body(KEYS)), 200, {"exists": [True] * len(KEYS)}),
    "an absolute-form target": (request("POST", f"http://kvgw{EXISTS}", keys_body(KEYS)), 200,
                                {"exists": [True] * len(KEYS)}),
    "a chunked body": (
        b"POST " + EXISTS.encode() + b" HTTP/1.1\r\nHost: kvgw\r\nAuthorization: " + AUTH.encode()
        + b"\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(keys_body(KEYS)), keys_body(KEYS)),
        200, {"exists": [True] * len(KEYS)}),
    "a body larger than the lane's limit": (
        request("POST", EXISTS, keys_body(KEYS + ["k" * 1000] * (LANE_BODY_LIMIT // 1000 + 1))), 200, None),
    "Expect: 100-continue": (request("POST", PREFIX, keys_body(KEYS), extra=b"Expect: 100-continue\r\n"), 200,
                             {"length": len(KEYS)}),
    "repeated Authorization": (request("POST", PREFIX, keys_body(KEYS), extra=f"Authorization: {AUTH}\r\n".encode()),
                               401, "Unauthorized"),
}


@pytest.mark.parametrize("case", list(HANDED_OVER))
def test_what_the_lane_cannot_answer_reaches_the_asgi_app(lane: LaneServer, case: str) -> None:
    raw, status, expected = HANDED_OVER[case]
    head = raw.startswith(b"HEAD ")
    conn = Connection(lane.port)
    try:
        conn.send(raw)
        reply = conn.reply(head_request=head)
        if reply.status == 100:
            reply = conn.reply()
    finally:
        conn.close()
    assert reply.status == status
    assert len(lane.calls()) == 1
    if isinstance(expected, str):
        assert reply.json()["error"]["code"] == expected
        assert reply.json()["error"]["request_id"] == reply.header("x-kvgw-request-id")
    elif expected is not None:
        assert reply.json() == expected
    if case == "a lease asked for":
        assert reply.json()["exists"] == [True, True] and "lease" in reply.json()


def test_leased_lookups_are_answered_on_the_lane_once_the_process_grants_in_memory(lane: LaneServer) -> None:
    """The process's first lease syncs the lease table (the ASGI path awaits it); from then on leases
    are granted in memory (``LeaseBook.grant_now``), so leased exists / prefix stay on the lane."""
    first = exchange(lane, request("POST", EXISTS, keys_body(KEYS[:2], lease_ms=2000)))
    assert first.json()["lease"]["chunks"] == 2
    lane.calls()
    exists = exchange(lane, request("POST", EXISTS, keys_body([*KEYS[2:5], "never-stored"], lease_ms=2000)))
    prefix = exchange(lane, request("POST", PREFIX, keys_body([*KEYS[5:], "never-stored"], lease_ms=2000)))
    assert exists.json()["exists"] == [True, True, True, False]
    assert exists.json()["lease"]["chunks"] == 3 and exists.json()["lease"]["granted_ms"] == 2000
    assert prefix.json()["length"] == 3 and prefix.json()["lease"]["chunks"] == 3
    assert lane.calls() == []


def test_connection_close_and_http_1_0_go_through_the_request_cycle(lane: LaneServer) -> None:
    closing = request("POST", EXISTS, keys_body(KEYS), extra=b"Connection: close\r\n")
    old = request("POST", EXISTS, keys_body(KEYS)).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    for raw in (closing, old):
        conn = Connection(lane.port)
        try:
            conn.send(raw)
            reply = conn.reply()
            assert reply.json() == {"exists": [True] * len(KEYS)}
            assert conn.closed()
        finally:
            conn.close()
    assert len(lane.calls()) == 2


def test_pipelined_requests_are_answered_in_order_whichever_path_answers(lane: LaneServer) -> None:
    conn = Connection(lane.port)
    try:
        conn.send(request("POST", EXISTS, keys_body(KEYS))                    # lane
                  + request("GET", chunk_path(KEYS[1]))                         # ASGI
                  + request("POST", PREFIX, keys_body(KEYS[:3]))                # behind a running cycle: ASGI
                  + request("POST", EXISTS, keys_body(["absent", KEYS[0]]))     # behind a cycle, or lane
                  + request("HEAD", chunk_path(KEYS[3])))                       # lane or ASGI
        assert conn.reply().json() == {"exists": [True] * len(KEYS)}
        assert conn.reply().body == KEYS[1].encode() * 100
        assert conn.reply().json() == {"length": 3}
        assert conn.reply().json() == {"exists": [False, True]}
        assert conn.reply(head_request=True).header("content-length") == str(len(KEYS[3]) * 100)
        # and the connection still serves the lane afterwards
        conn.send(request("POST", PREFIX, keys_body(KEYS)))
        assert conn.reply().json() == {"length": len(KEYS)}
    finally:
        conn.close()
    seen = lane.calls()
    assert ("GET", chunk_path(KEYS[1])) in seen and ("POST", PREFIX) in seen
    assert seen.count(("POST", EXISTS)) <= 1  # the first exists never reached the app


def test_a_stalled_lane_body_gets_408_and_is_closed(lane: LaneServer) -> None:
    raw = request("POST", EXISTS, keys_body(KEYS))
    conn = Connection(lane.port)
    try:
        conn.send(raw[:-5])  # the head and most of the body; the rest never comes
        reply = conn.reply()
        assert reply.status == 408 and reply.json()["error"]["code"] == "RequestTimeout"
        assert conn.closed()
    finally:
        conn.close()
    assert lane.calls() == []


def test_a_chunk_deleted_through_the_api_is_absent_on_the_lane_at_once(lane: LaneServer) -> None:
    with httpx.Client(base_url=lane.url, headers={"Authorization": AUTH}) as client:
        assert client.delete(chunk_path(KEYS[4])).status_code == 204
        assert client.head(chunk_path(KEYS[4])).status_code == 404
        assert client.post(EXISTS, content=keys_body(KEYS[3:6])).json() == {"exists": [True, False, True]}
        assert client.post(PREFIX, content=keys_body(KEYS)).json() == {"length": 4}


# -- S3 HeadObject ---------------------------------------------------------------------------------


def s3_head(server: LaneServer, key: str, *, secret: str = ROOT_SK, extra: dict[str, str] | None = None) -> bytes:
    """A HeadObject signed with SigV4 as botocore signs it (header auth), path-style."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    host = f"127.0.0.1:{server.port}"
    path = f"/kvcache/{quote(key, safe='/~')}"
    signed = AWSRequest(method="HEAD", url=f"http://{host}{path}",
                        headers={"x-amz-content-sha256": EMPTY_SHA256, **(extra or {})})
    S3SigV4Auth(Credentials(ROOT_AK, secret), "s3", "us-east-1").add_auth(signed)
    lines = "".join(f"{name}: {value}\r\n" for name, value in signed.headers.items())
    return f"HEAD {path} HTTP/1.1\r\nHost: {host}\r\n{lines}\r\n".encode()


EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_s3_head_object_is_answered_on_the_lane_once_its_attributes_are_known(lane: LaneServer) -> None:
    first = exchange(lane, s3_head(lane, KEYS[5]), head_request=True)  # attributes not cached yet: ASGI
    assert first.status == 200 and len(lane.calls()) == 1
    second = exchange(lane, s3_head(lane, KEYS[5]), head_request=True)
    assert lane.calls() == []
    assert normalized(second) == normalized(first)
    assert second.header("content-length") == str(len(KEYS[5]) * 100) and second.header("etag")
    lane.state.lane = None
    by_app = exchange(lane, s3_head(lane, KEYS[5]), head_request=True)
    assert len(lane.calls()) == 1 and normalized(by_app) == normalized(second)


def test_s3_requests_marked_as_retries_are_counted_whichever_path_answers(lane: LaneServer) -> None:
    """AWS SDKs send ``amz-sdk-request: attempt=N; max=M`` on every request: from N = 2 on, kvgw counts
    the answer in ``kvgw_retried_requests`` too, whether the app or the lane gave it, a hit or a miss."""
    def head(key: str, attempt: str) -> int:
        return exchange(lane, s3_head(lane, key, extra={"amz-sdk-request": attempt}), head_request=True).status

    assert head(KEYS[4], "attempt=2; max=3") == 200 and len(lane.calls()) == 1  # not cached yet: the app
    assert head(KEYS[4], "attempt=3; max=3") == 200 and head("absent", "attempt=10; max=12") == 404
    for first in ("attempt=1; max=3", "attempt=1", "attempt=x; max=3", "attempt=", "unknown"):
        assert head(KEYS[4], first) == 200
    assert lane.calls() == []  # all but the first on the lane
    metrics = httpx.get(f"{lane.url}/metrics", headers={"Authorization": AUTH}).text
    pattern = r'^kvgw_(requests|retried_requests)_total\{api="s3",op="HeadObject",status="(\d+)"\} (\S+)$'
    counts = {(m[1], m[2]): float(m[3]) for m in re.finditer(pattern, metrics, re.M)}
    assert counts == {("requests", "200"): 7, ("requests", "404"): 1,
                      ("retried_requests", "200"): 2, ("retried_requests", "404"): 1}

def test_s3_head_answers_ranges_on_the_lane_and_leaves_errors_to_the_app(lane: LaneServer) -> None:
    exchange(lane, s3_head(lane, KEYS[6]), head_request=True)  # caches the attributes
    etag = exchange(lane, s3_head(lane, KEYS[6]), head_request=True).header("etag") or ""
    lane.calls()
    ranged = exchange(lane, s3_head(lane, KEYS[6], extra={"Range": "bytes=0-9"}), head_request=True)
    assert (ranged.status, ranged.header("content-length"), ranged.header("content-range")) == (
        206, "10", f"bytes 0-9/{len(KEYS[6]) * 100}")
    assert lane.calls() == []
    cases = {
        "not modified": (s3_head(lane, KEYS[6], extra={"If-None-Match": etag}), 304),
        "precondition": (s3_head(lane, KEYS[6], extra={"If-Match": '"nope"'}), 412),
        "wrong secret": (s3_head(lane, KEYS[6], secret="wrong"), 403),
        "unsigned": (f"HEAD /kvcache/{KEYS[6]} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode(), 403),
    }
    for name, (raw, status) in cases.items():
        reply = exchange(lane, raw, head_request=True)
        assert reply.status == status, name
        assert reply.header("x-amz-request-id"), name
        assert len(lane.calls()) == 1, name


def test_a_signature_verified_on_the_lane_is_not_verified_again_when_handed_over(
        lane: LaneServer, monkeypatch: pytest.MonkeyPatch) -> None:
    s3_api = lane.app.app.s3_api
    authenticated: list[str] = []
    original = s3_api._authenticate

    async def counting(req: Any) -> Any:
        authenticated.append(req.raw_path)
        return await original(req)

    monkeypatch.setattr(s3_api, "_authenticate", counting)
    uncached = f"/kvcache/{KEYS[7]}"  # never read through S3: its attributes are not cached yet
    first = exchange(lane, s3_head(lane, KEYS[7]), head_request=True)
    assert first.status == 200 and len(lane.calls()) == 1  # answered by the app ...
    assert authenticated == []  # ... with the lane's verified signature
    bad = exchange(lane, s3_head(lane, "absent", secret="wrong"), head_request=True)
    assert bad.status == 403 and authenticated == ["/kvcache/absent"]  # a failed check is the app's to repeat
    lane.state.lane = None
    exchange(lane, s3_head(lane, KEYS[7]), head_request=True)
    assert authenticated == ["/kvcache/absent", uncached]


# -- misses ----------------------------------------------------------------------------------------


MISSES = {
    "exists": (request("POST", EXISTS, keys_body([KEYS[0], "absent", KEYS[1], "gone"])), False),
    "prefix": (request("POST", PREFIX, keys_body([KEYS[0], KEYS[1], "absent", KEYS[2]])), False),
    "HEAD": (request("HEAD", chunk_path("absent")), True),
}


def test_misses_the_filesystem_tier_rules_out_at_once_are_answered_on_the_lane(lane: LaneServer) -> None:
    by_lane = {name: exchange(lane, raw, head_request=head) for name, (raw, head) in MISSES.items()}
    s3_miss = exchange(lane, s3_head(lane, "absent"), head_request=True)
    assert lane.calls() == []
    assert by_lane["exists"].json() == {"exists": [True, False, True, False]}
    assert by_lane["prefix"].json() == {"length": 2}
    assert by_lane["HEAD"].status == 404 and s3_miss.status == 404
    lane.state.lane = None
    by_app = {name: exchange(lane, raw, head_request=head) for name, (raw, head) in MISSES.items()}
    s3_by_app = exchange(lane, s3_head(lane, "absent"), head_request=True)
    assert len(lane.calls()) == len(MISSES) + 1
    assert {n: normalized(r) for n, r in by_lane.items()} == {n: normalized(r) for n, r in by_app.items()}
    assert normalized(s3_miss) == normalized(s3_by_app)


def test_misses_a_tier_cannot_rule_out_at_once_go_to_the_app(lane: LaneServer,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """As on NFS or with S3 behind (``Tier.absent_now`` cannot tell): the app asks the tiers."""
    for tier in lane.app.app.gateway.service._tiers.values():
        monkeypatch.setattr(tier, "absent_now", lambda digests: False)
    for name, (raw, head) in MISSES.items():
        reply = exchange(lane, raw, head_request=head)
        assert len(lane.calls()) == 1, name
        assert reply.status == (404 if head else 200), name
    hits = exchange(lane, request("POST", EXISTS, keys_body(KEYS)))
    assert hits.json() == {"exists": [True] * len(KEYS)} and lane.calls() == []

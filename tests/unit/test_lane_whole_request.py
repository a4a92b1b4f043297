"""``gateway.api.lane.whole_request``: the lookups the lane reads before httptools sees them.

The quick read may only ever decline more than httptools: whatever it returns must be exactly what
httptools and uvicorn make of the same bytes (method, path, headers as uvicorn's scope holds them,
body), for a single complete keep-alive HTTP/1.1 request. Checked on the requests kvgw's clients send
and on many thousands of mutated ones, against httptools itself.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import httptools
import pytest

from gateway.api.lane import WholeRequest, whole_request


@dataclass
class Parsed:
    """What httptools and uvicorn's callbacks make of some bytes."""

    url: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    begun: int = 0
    complete: int = 0
    method: str = ""
    version: str = ""
    keep_alive: bool = False
    upgrade: bool = False

    def on_message_begin(self) -> None:
        self.begun += 1

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))  # as uvicorn's ``on_header``

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete += 1


def parse(data: bytes) -> Parsed | None:
    """httptools' reading of ``data`` as uvicorn's parser is set up, or None if it refuses it."""
    parsed = Parsed()
    parser = httptools.HttpRequestParser(parsed)
    parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn sets its own
    try:
        parser.feed_data(data)
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):
        return None
    if parsed.begun:
        parsed.method = parser.get_method().decode("ascii")
        parsed.version = parser.get_http_version()
        parsed.keep_alive = parser.should_keep_alive()
        parsed.upgrade = parser.should_upgrade()
    return parsed


def assert_agrees(data: bytes, found: WholeRequest) -> None:
    parsed = parse(data)
    assert parsed is not None, data
    assert (parsed.begun, parsed.complete) == (1, 1), data
    assert (parsed.version, parsed.keep_alive, parsed.upgrade) == ("1.1", True, False), data
    assert parsed.method == found.method, data
    assert httptools.parse_url(parsed.url).path.decode("ascii") == found.raw_path, data
    assert parsed.url == found.raw_path.encode(), data  # a plain path: no query or fragment
    assert parsed.headers == found.headers, data
    assert parsed.body == found.body, data


EXISTS = b'{"keys":["k-0001","k-0002"]}'
CLIENT_REQUESTS = [
    # kvgw_client (aiohttp) and http.client: an exists / prefix, a native HEAD
    b"POST /v1/buckets/kv/exists HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nAuthorization: Bearer ak:sk\r\n"
    b"Accept: */*\r\nAccept-Encoding: gzip, deflate\r\nUser-Agent: Python/3.11 aiohttp/3.9.5\r\n"
    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(EXISTS), EXISTS),
    b"POST /v1/buckets/kv/prefix HTTP/1.1\r\nHost: gw\r\nAccept-Encoding: identity\r\n"
    b"Content-Length: %d\r\nConnection: keep-alive\r\n\r\n%s" % (len(EXISTS), EXISTS),
    b"HEAD /v1/buckets/kv/chunks/a%2Fb%40c HTTP/1.1\r\nHost: gw\r\n\r\n",
    # aws-sdk-cpp / botocore: a SigV4-signed HeadObject
    b"HEAD /kvcache/model%40abc/0001-layer HTTP/1.1\r\nHost: 127.0.0.1:9000\r\n"
    b"User-Agent: Boto3/1.34.0 md/Botocore#1.34.0 ua/2.0 os/linux#6.1.0 lang/python#3.11.7\r\n"
    b"X-Amz-Date: 20261128T010203Z\r\nX-Amz-Content-SHA256: UNSIGNED-PAYLOAD\r\n"
    b"Authorization: AWS4-HMAC-SHA256 Credential=AKIA/20261128/us-east-1/s3/aws4_request, "
    b"SignedHeaders=host;x-amz-content-sha256;x-amz-date, Signature=" + b"ab" * 32 + b"\r\n"
    b"amz-sdk-invocation-id: 3f1b2c4d-0000-1111-2222-333344445555\r\namz-sdk-request: attempt=1\r\n\r\n",
]


@pytest.mark.parametrize("data", CLIENT_REQUESTS)
def test_what_clients_send_is_read_as_httptools_reads_it(data: bytes) -> None:
    found = whole_request(data)
    assert found is not None  # the quick read must take the requests that matter
    assert_agrees(data, found)


@pytest.mark.parametrize("data", [
    CLIENT_REQUESTS[0][:-1],  # the body is not all here
    CLIENT_REQUESTS[0] + CLIENT_REQUESTS[2],  # another request behind it
    CLIENT_REQUESTS[2][:-2],  # the head is not complete
    CLIENT_REQUESTS[2].replace(b"HTTP/1.1", b"HTTP/1.0"),
    CLIENT_REQUESTS[2].replace(b"Host: gw\r\n", b"Host: gw\r\nConnection: close\r\n"),
    CLIENT_REQUESTS[2].replace(b"Host: gw\r\n", b"Host: gw\r\nExpect: 100-continue\r\n"),
    CLIENT_REQUESTS[2].replace(b"Host: gw\r\n", b"Host: gw\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"),
    CLIENT_REQUESTS[2].replace(b"Host: gw\r\n", b"Host: gw\r\nTransfer-Encoding: chunked\r\n"),
    CLIENT_REQUESTS[2].replace(b"Host: gw\r\n", b"Host: gw\r\n folded\r\n"),  # obs-fold
    CLIENT_REQUESTS[2].replace(b"\r\n", b"\n"),
    CLIENT_REQUESTS[2].replace(b"chunks/a", b"chunks/a?x=1"),
    CLIENT_REQUESTS[2].replace(b"HEAD /v1", b"HEAD http://gw/v1"),
    CLIENT_REQUESTS[2].replace(b"HEAD", b"GET"),
    CLIENT_REQUESTS[1].replace(b"Content-Length: ", b"Content-Length: 1\r\nContent-Length: "),
    CLIENT_REQUESTS[1].replace(b"Content-Length: ", b"Content-Length: +"),
])
def test_anything_but_one_whole_plain_request_is_left_to_httptools(data: bytes) -> None:
    assert whole_request(data) is None


GOOD_NAMES = [b"Host", b"content-length", b"X-Amz-Date", b"authorization", b"a", b"X_y", b"x~!#$%&'*+.^`|",
              b"Connection"]
BAD_NAMES = [b"Expect", b"Transfer-Encoding", b"Upgrade", b"bad name", b"bad:name", b"", b"\xc3\xa9", b"x\x00"]
GOOD_VALUE_BYTES = b"azAZ09 \t-_/:;,=\"'()<>@[]{}?#%~"
ODD_VALUE_BYTES = b"\x00\x01\x7f\x80\xff\r\n"


def mutated(rng: random.Random) -> bytes:
    """A request near the ones above: most parts kept plain, each sometimes replaced by an edge case."""
    def odd() -> bool:
        return rng.random() < 0.08

    method = rng.choice([b"GET", b"post", b"HEAD ", b"PUT"]) if odd() else rng.choice([b"HEAD", b"POST"])
    path = rng.choice([b"/v1/buckets/kv/exists", b"/v1/buckets/kv/chunks/k", b"/kvcache/obj"])
    if rng.random() < 0.5:
        chars = b"az09-._~!$&'()*+,;=:@%/" + (b"?#\"<>\\^`{|} \x00\x7f\x80" if odd() else b"")
        path += bytes(rng.choice(chars) for _ in range(rng.randint(1, 4)))
    version = rng.choice([b"HTTP/1.0", b"HTTP/2.0", b"http/1.1"]) if odd() else b"HTTP/1.1"
    body = rng.choice([b"", EXISTS, b"x" * rng.randint(1, 40)])
    lines = []
    for _ in range(rng.randint(0, 6)):
        name = rng.choice(BAD_NAMES) if odd() else rng.choice(GOOD_NAMES)
        value = bytes(rng.choice(GOOD_VALUE_BYTES + (ODD_VALUE_BYTES if odd() else b""))
                      for _ in range(rng.randint(0, 12)))
        if name.lower() == b"connection" and rng.random() < 0.7:
            value = rng.choice([b"keep-alive", b"Keep-Alive", b"close", b" keep-alive", b"keep-alive "])
        lines.append(name + rng.choice([b": ", b":", b":\t", b" : "] if odd() else [b": ", b":"]) + value)
    if rng.random() < 0.9:
        length = b"%d" % len(body)
        if odd():
            length = rng.choice([b"0%d" % len(body), b"%d" % (len(body) + 1), b"-1", b"1e3", b"", b"%d " % len(body)])
        lines.insert(rng.randint(0, len(lines)), b"Content-Length: " + length)
    data = method + b" " + path + b" " + version + b"\r\n" + b"".join(line + b"\r\n" for line in lines) + b"\r\n" + body
    if odd():
        cut = rng.randint(0, len(data))
        data = data[:cut] + rng.choice([b"", b"\r\n", b"\n", b" ", b"HEAD / HTTP/1.1\r\n\r\n"]) + data[cut:]
    return data


def test_mutated_requests_are_read_as_httptools_reads_them_or_left_to_it() -> None:
    rng = random.Random(14)
    taken = 0
    for _ in range(20_000):
        data = mutated(rng)
        found = whole_request(data)
        if found is not None:
            taken += 1
            assert_agrees(data, found)
    assert taken > 3_000  # the mutations keep enough requests whole to test what is taken

"""A scripted HTTP/1.1 server on a real socket, for the client's own connections (batch-get streams,
blocking lookups): each request read whole, each answer written by the test, framed, split, cut or
stalled as it likes."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable

from kvgw_client import wire
from kvgw_client.http import KvgwClient

Respond = Callable[[socket.socket, int], bool]
"""Writes the answer to request number ``n`` (0-based, over all connections); True keeps the
connection open for the next request."""


class ScriptedServer:
    """Reads each HTTP request (head and Content-Length body) and answers it with ``respond``."""

    instances: list[ScriptedServer] = []

    def __init__(self, respond: Respond) -> None:
        ScriptedServer.instances.append(self)
        self.respond = respond
        self.requests: list[bytes] = []
        self.connections = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        data = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in data:
                    got = conn.recv(65536)
                    if not got:
                        return
                    data += got
                head, _, data = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(data) < length:
                    data += conn.recv(65536)
                with self._lock:
                    self.requests.append(head + b"\r\n\r\n" + data[:length])
                    n = len(self.requests) - 1
                data = data[length:]
                try:
                    if not self.respond(conn, n):
                        return
                except OSError:
                    return

    def close(self) -> None:
        self._sock.close()


def head(status: str = "200 OK", *, framing: str, extra: str = "", ctype: str = wire.BATCH_CONTENT_TYPE) -> bytes:
    return f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\n{framing}{extra}\r\n".encode()


def chunked(body: bytes, rng: random.Random) -> bytes:
    """``body`` in chunked transfer coding, chunks of random sizes (1 byte to 1 MiB)."""
    out, at = [], 0
    while at < len(body):
        n = min(len(body) - at, rng.choice((1, 7, 24, 4096, 65536, 1 << 20)))
        out += [b"%x\r\n" % n, body[at : at + n], b"\r\n"]
        at += n
    return b"".join(out) + b"0\r\n\r\n"


def send_in_pieces(conn: socket.socket, data: bytes, rng: random.Random, *, small: bool) -> None:
    """``data`` in random pieces with pauses, so reads end anywhere: inside a head, a chunk-size line, a
    frame header or a payload."""
    at = 0
    while at < len(data):
        n = rng.randint(1, 40) if small else rng.randint(1, 3 << 20)
        conn.sendall(data[at : at + n])
        at += n
        if rng.random() < 0.05:
            time.sleep(0.001)


def server_of(client: KvgwClient) -> ScriptedServer:
    port = int(client.settings.url.rsplit(":", 1)[1])
    return next(s for s in ScriptedServer.instances if s.port == port)



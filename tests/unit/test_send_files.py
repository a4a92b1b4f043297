"""When a connection offers sendfile answers (gateway.dataplane.protocol.sends_files)."""

from __future__ import annotations

import pytest

from gateway.dataplane.protocol import sends_files


@pytest.mark.parametrize(("mode", "client", "offered"), [
    ("auto", ("127.0.0.1", 5000), False),  # loopback: the kernel copies anyway; a mapping costs less
    ("auto", ("::1", 5000), False),
    ("auto", ("10.1.2.3", 5000), True),  # off this host: sendfile spares the copy into the socket
    ("auto", ("fe80::1", 5000), True),
    ("auto", None, False),  # a Unix socket or an unknown peer
    ("always", ("127.0.0.1", 5000), True),
    ("never", ("10.1.2.3", 5000), False),
])
def test_sendfile_goes_to_peers_off_this_host_unless_told(mode: str, client: tuple[str, int] | None,
                                                          offered: bool) -> None:
    assert sends_files(mode, client) is offered

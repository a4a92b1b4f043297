"""``kvgw bench floor`` runs end to end: the servers answer the same calls without an error (a non-200
answer raises; the indexed responder must answer what kvgw answers), the in-process phase drives the
real gateway app, and the report splits the server CPU per call into its layers, with the lookup lane
on and off, beside the floor of a lookup answered from kvgw's index."""

from __future__ import annotations

import re

import pytest

from gateway.bench import floor


def test_floor_reports_every_layer(capsys: pytest.CaptureFixture[str]) -> None:
    assert floor.main(["--rounds", "1", "--duration", "0.3", "--calls", "200"]) == 0
    out = capsys.readouterr().out
    for name in (floor.RAW, floor.CANNED, floor.KVGW, floor.KVGW_NO_LANE):
        for op in (floor.EXISTS, floor.HEAD):
            row = re.search(rf"^{re.escape(name)}\s+{re.escape(op)}\s+(\d+)\s+([\d.]+)$", out, re.MULTILINE)
            assert row is not None, out
            assert int(row[1]) > 0 and float(row[2]) > 0  # a p50 and a server CPU per call were measured
    for op in (floor.EXISTS, floor.HEAD):
        line = re.search(rf"^{re.escape(op)}: server CPU per call: socket ([\d.]+) µs, .*in process: its ASGI app "
                         rf"([\d.]+), its lane ([\d.]+)\)", out, re.MULTILINE)
        assert line is not None and float(line[1]) > 0 and float(line[2]) > 0 and float(line[3]) > 0, out
    row = re.search(rf"^{re.escape(floor.INDEXED)}\s+{re.escape(floor.EXISTS)}\s+(\d+)\s+([\d.]+)$", out, re.MULTILINE)
    assert row is not None and int(row[1]) > 0 and float(row[2]) > 0, out
    assert re.search(rf"^{re.escape(floor.EXISTS)}: the index floor: .* / raw p50 [\d.]+x, server CPU [+-][\d.]+ µs "
                     r"per call above the raw responder; kvgw / that floor: p50 [\d.]+x", out, re.MULTILINE), out
    row = re.search(rf"^{re.escape(floor.KVGW_CLIENT)}\s+{re.escape(floor.EXISTS)}\s+(\d+)\s+([\d.]+)$", out,
                    re.MULTILINE)
    assert row is not None and int(row[1]) > 0 and float(row[2]) > 0, out
    client = re.search(rf"^{re.escape(floor.EXISTS)} through kvgw's client .*: p50 (\d+) µs .* the client's CPU "
                       r"(\d+) µs per call$", out, re.MULTILINE)
    assert client is not None and int(client[1]) > 0 and int(client[2]) > 0, out

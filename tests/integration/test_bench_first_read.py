"""``kvgw bench first-read`` end to end (``--quick``): both gateways (buffered and direct writes) store
their chunks and read every one back, OK, through kvgw's client in a fresh process, in each phase; the
page-cache shares it reports are the ones the phases stand for (evicted chunks are out of the page cache,
a second read finds what the first read brought in), and the report carries every row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.bench import first_read as fr


def test_first_read_runs_every_phase_on_both_gateways(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fr.json"
    assert fr.main(["--quick", "--data-dir", str(tmp_path), "--json", str(out)]) == 0  # 1: a request failed
    phases = json.loads(out.read_text())["phases"]
    want = {(g, ph) for g in (fr.BUFFERED, fr.DIRECT) for ph in fr.PHASES}
    assert {(p["gateway"], p["phase"]) for p in phases} == want
    for p in phases:
        assert p["errors"] == 0 and p["bytes"] == (2 if p["phase"] == fr.PUT else 1) * 4 * 8 * fr.MiB, p
    held = {(p["gateway"], p["phase"]): p["resident"] for p in phases}
    assert held[(fr.BUFFERED, fr.EVICTED)] == held[(fr.DIRECT, fr.EVICTED)] == 0.0
    assert min(held[(fr.BUFFERED, fr.SECOND)], held[(fr.DIRECT, fr.SECOND)]) > 0.99
    assert held[(fr.DIRECT, fr.FIRST)] < 0.01  # direct writes leave (at most) the footers' pages
    text = capsys.readouterr().out
    for name in fr.PHASES:
        assert f"| {fr.BUFFERED} | {name} | " in text and f"| {fr.DIRECT} | {name} | " in text
        assert f"\n| {name} | " in text  # its direct / buffered ratios
    assert not list(tmp_path.glob("kvgw-bench-first-read-*"))

"""``kvgw bench lmcache --only fe`` end to end on tiny chunks: (f) retrieves through the connector's direct
reads from a real ``kvgw serve``, and (v), measured between (f)'s rounds, reads the same chunk files
with the same checks; (w) does the same with LMCache's disk files between (e)'s rounds. Every chunk
must verify, or the row reports an error instead of a figure."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.bench import lmcache as bench


def test_f_e_and_their_bare_verified_reads_move_every_chunk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = bench.main(["--only", "fe", "--chunk-mib", "1", "--chunks", "3", "--requests", "2", "--rounds", "2",
                         "--cache", "both", "--workdir", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert status == 1, out  # (a) and the others did not run: their targets cannot pass
    for cache in ("warm", "cold"):
        f = re.search(rf"^{cache}  \(f\) kvgw connector, direct reads +\d+ +(\d+) ", out, re.M)
        v = re.search(rf"^{cache}  \(v\) \(f\)'s files read and verified +- +(\d+) .*median of 2", out, re.M)
        assert f and v, out
        assert int(f.group(1)) > 0 and int(v.group(1)) > 0
        w = re.search(rf"^{cache}  \(w\) \(e\)'s files read and verified +- +(\d+) .*median of 2", out, re.M)
        assert w and int(w.group(1)) > 0, out
        for ratio in (r"\(f\) / \(v\)", r"\(w\) / \(e\)", r"\(v\) / \(w\)"):
            assert re.search(rf"^{cache}  {ratio} +\d+ / \d+ += +[\d.]+ +\(no target", out, re.M), out

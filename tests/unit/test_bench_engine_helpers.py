"""What ``kvgw bench lmcache`` and ``kvgw bench sglang`` share (the end of ``gateway.bench.launcher``): both
benches print through these, so their options, work directory and report header are checked here once,
without an engine or a gateway running.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from gateway.bench.launcher import (
    add_run_options,
    drop_page_cache,
    files_under,
    print_report,
    version,
    work_directory,
)
from tests.requirements import require_module


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgw bench x")
    add_run_options(p, read="load", read_done="loaded", targets="abc", example="ac",
                    no_fsync_note="the other never fsyncs", other="the other's")
    return p


def test_run_options_defaults_and_help() -> None:
    args = parser().parse_args([])
    assert (args.requests, args.rounds, args.cache, args.only) == (4, 3, "both", "abc")
    assert (args.no_fsync, args.workdir, args.keep) == (False, None, False)
    text = " ".join(parser().format_help().split())
    for words in ("requests stored and loaded (default 4)", "load passes over all requests (default 3)",
                  "targets to run, e.g. 'ac' (default abc)", "run kvgw with --no-fsync (the other never fsyncs)",
                  "where kvgw's data and the other's go (default: a temp dir)", "keep the work directory"):
        assert words in text


def test_work_directory_removes_only_its_own_temp_dir(tmp_path: Path) -> None:
    with work_directory(parser().parse_args([]), "kvgw-test-") as temp:
        assert temp.is_dir() and temp.name.startswith("kvgw-test-")
        (temp / "data").write_bytes(b"x")
    assert not temp.exists()

    with work_directory(parser().parse_args(["--keep"]), "kvgw-test-") as kept:
        pass
    assert kept.is_dir()
    kept.rmdir()

    named = tmp_path / "a" / "b"

    def failing_bench() -> None:
        with work_directory(parser().parse_args(["--workdir", str(named)]), "x") as got:
            assert got == named and named.is_dir()
            raise RuntimeError("a failed bench")

    with pytest.raises(RuntimeError):
        failing_bench()
    assert named.is_dir()  # the user's directory is never removed, pass or fail


def test_files_under_and_drop_page_cache(tmp_path: Path) -> None:
    assert files_under(tmp_path / "missing") == []
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"y" * 4096)
    (tmp_path / "g").write_bytes(b"z")
    assert sorted(files_under(tmp_path)) == [tmp_path / "d" / "f", tmp_path / "g"]
    drop_page_cache([*files_under(tmp_path), tmp_path / "gone"])  # a vanished file is passed over
    assert (tmp_path / "d" / "f").read_bytes() == b"y" * 4096


def test_version_of_a_missing_distribution() -> None:
    assert version("kvgw-no-such-distribution") == "?"


@pytest.mark.parametrize(("ok", "status"), [(True, 0), (False, 1)])
def test_print_report_header_and_status(tmp_path: Path, capsys: pytest.CaptureFixture[str], ok: bool,
                                        status: int) -> None:
    torch = require_module("torch", "torch (the engines' CPU build) is not installed")
    (tmp_path / "k").mkdir()
    (tmp_path / "o").mkdir()
    headers: list[str] = []

    def report(header: str) -> tuple[str, bool]:
        headers.append(header)
        return f"{header}\n\ntable", ok

    got = print_report(report, title="kvgw bench x: 1 requests", engine="X", dist="kvgw-no-such-distribution",
                       fsync=False, other="the other's directory", kvgw_dir=tmp_path / "k", other_dir=tmp_path / "o",
                       workdir=tmp_path)
    assert got == status
    want = (f"kvgw bench x: 1 requests; X ?, torch {torch.__version__}, {os.cpu_count()} CPUs, "
            f"{os.uname().machine}\n"
            f"kvgw fsync off; kvgw data and the other's directory on the same device ({tmp_path})")
    assert headers == [want]
    assert capsys.readouterr().out == f"{want}\n\ntable\n"

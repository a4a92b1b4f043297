"""One clear line for every mistake, through the real ``kvgw`` command in a subprocess, as a new operator
meets them: config files, misspelt settings, ports, worker counts, abbreviations, the version, a data
directory in the wrong place or already served, how a stopped server exits, what a start logs, and the
listings' tables.

Each run has no ``KVGW_*`` variable but the ones the test sets, and a working directory of its own.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gateway.bench.launcher import free_port
from gateway.cli import build_parser
from gateway.config import known_keys, report_unknown_keys
from tests.conftest import REPO, ROOT_AK, ROOT_SK, ServerProcess

VERSION = importlib.metadata.version("kvgw")


def kvgw(*args: str, cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``kvgw ARGS`` in ``cwd`` with no inherited ``KVGW_*`` setting, plus ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVGW_")}
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], cwd=cwd, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single line a refused command printed (status 2, nothing on stdout, no traceback)."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


# -- the config file ---------------------------------------------------------------------------


@pytest.mark.parametrize("problem", ["missing", "unreadable", "not TOML", "not a table"])
def test_a_bad_config_file_is_one_line(tmp_path: Path, problem: str) -> None:
    config = tmp_path / "kvgw.toml"
    if problem == "unreadable":
        config.mkdir()  # root reads any file whatever its mode; a directory cannot be read as one
    elif problem == "not TOML":
        config.write_text("port = 8080\nfsync = yes\n")
    elif problem == "not a table":
        config.write_text('kvgw = "yes"\n')
    line = one_line(kvgw("serve", "--config", str(config), "--data-dir", str(tmp_path / "d"), cwd=tmp_path))
    expected = {"missing": "does not exist", "unreadable": "cannot read config file", "not TOML": "is not valid TOML",
                "not a table": "must be a table"}[problem]
    assert line.startswith("kvgw: ") and str(config) in line and expected in line
    if problem == "not TOML":
        assert "line 2" in line  # where the mistake is
    assert not (tmp_path / "d").exists()


def test_unknown_config_keys_are_named_like_unknown_variables(tmp_path: Path) -> None:
    config = tmp_path / "kvgw.toml"
    config.write_text("fsyncc = true\ncapacity = 1000\nport = 8081\n")
    (tmp_path / "d").mkdir()
    result = kvgw("db", "upgrade", "--config", str(config), "--data-dir", str(tmp_path / "d"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert f"unknown setting fsyncc in {config} ignored (did you mean fsync?)" in lines
    (capacity,) = [line for line in lines if line.startswith("unknown setting capacity ")]
    assert "--capacity-bytes" in capacity and "bucket" in capacity
    assert not any("port" in line for line in lines)  # a real setting is not reported


def test_unknown_keys_in_the_s3_table_and_beside_the_kvgw_table() -> None:
    """The nested S3 settings are checked by the same rule (pure logic: no S3 tier is started)."""
    lines = report_unknown_keys({"s3": {"endpont_url": "x", "bucket": "b"}, "fsync": True}, Path("k.toml"),
                                outside=["port"])
    assert lines == ["unknown setting s3.endpont_url in k.toml ignored (did you mean s3.endpoint_url?)",
                     "port in k.toml ignored: the settings are in its [kvgw] table"]
    assert {"s3.endpoint_url", "port"} <= known_keys()


def test_a_misspelt_variable_gets_a_good_guess(tmp_path: Path) -> None:
    env = {"KVGW_CAPACTY": "1000", "KVGW_CATALOG_URI": "x", "KVGW_WORKER": "2"}
    result = kvgw("db", "upgrade", "--data-dir", str(tmp_path), cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    (capacity,) = [line for line in lines if "KVGW_CAPACTY" in line]
    assert "KVGW_PORT" not in capacity  # the shared KVGW_ prefix made it look like the nearest name
    assert "--capacity-bytes" in capacity and "KVGW_DEFAULT_CAPACITY_FRACTION" in capacity
    assert "unknown setting KVGW_CATALOG_URI ignored (did you mean KVGW_CATALOG_URL?)" in lines
    assert "unknown setting KVGW_WORKER ignored (did you mean KVGW_WORKERS?)" in lines


# -- flags -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "env", "expected"), [
    (["--port", "99999"], {}, "not a TCP port (1 to 65535)"),
    (["--port", "0"], {}, "not a TCP port (1 to 65535)"),
    (["--port", "eighty"], {}, "not a port number"),
    ([], {"KVGW_PORT": "99999"}, "KVGW_PORT='99999'"),
    (["--workers", "0"], {}, "--workers: 0: at least 1"),
    ([], {"KVGW_WORKERS": "0"}, "KVGW_WORKERS='0'"),
    (["--worker", "2"], {}, "unrecognized arguments: --worker 2"),
    (["--anon"], {}, "unrecognized arguments: --anon"),
])
def test_bad_flags_are_one_line(tmp_path: Path, args: list[str], env: dict[str, str], expected: str) -> None:
    line = one_line(kvgw("serve", "--data-dir", str(tmp_path / "d"), *args, cwd=tmp_path, env=env))
    assert expected in line
    assert not (tmp_path / "d").exists()  # refused before anything was made


def test_no_parser_takes_abbreviations() -> None:
    """Every parser of ``kvgw`` and of its benchmarks (``kvgw bench X`` parses in the bench module)."""
    parsers = [build_parser()]
    for parser in parsers:
        assert parser.allow_abbrev is False, parser.prog
        for action in parser._actions:  # argparse has no public walk of its subparsers
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    assert len(parsers) > 15
    unguarded = []
    for path in sorted((REPO / "gateway").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "ArgumentParser"
                    and not any(k.arg == "allow_abbrev" for k in node.keywords)
                    and path.name != "lmcache_engine.py"):  # LMCache's own parser, filled by LMCache's code
                unguarded.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert unguarded == []


def test_version(tmp_path: Path, server_factory: type[ServerProcess]) -> None:
    result = kvgw("--version", cwd=tmp_path)
    assert (result.returncode, result.stdout.strip()) == (0, f"kvgw {VERSION}")
    server = server_factory(data_dir=tmp_path / "d").start()
    assert httpx.get(f"{server.url}/healthz").json() == {"status": "ok", "version": VERSION}
    assert f"kvgw {VERSION}: serving on {server.url}" in server.log()


# -- the data directory ------------------------------------------------------------------------


@pytest.mark.parametrize("command", [
    ["bucket", "list"], ["bucket", "create", "models"], ["bucket", "delete", "models"], ["cred", "list"],
    ["cred", "create", "--root"], ["db", "upgrade"], ["index", "rebuild"], ["scrub"], ["cluster", "status"],
    ["cluster", "reconcile"],
])
def test_commands_other_than_serve_never_create_a_data_dir(tmp_path: Path, command: list[str]) -> None:
    """Run in the wrong directory, they say where they looked instead of making a new, empty gateway."""
    line = one_line(kvgw(*command, cwd=tmp_path))
    assert f"no data directory at {tmp_path / 'kvgw-data'}" in line
    assert "--data-dir" in line and "KVGW_DATA_DIR" in line
    elsewhere = tmp_path / "elsewhere"
    line = one_line(kvgw(*command, "--data-dir", str(elsewhere), cwd=tmp_path))
    assert f"no data directory at {elsewhere}" in line
    line = one_line(kvgw(*command, cwd=tmp_path, env={"KVGW_DATA_DIR": str(elsewhere)}))
    assert f"no data directory at {elsewhere}" in line
    assert list(tmp_path.iterdir()) == []


def test_a_data_dir_serve_cannot_make_is_one_line(tmp_path: Path) -> None:
    line = one_line(kvgw("serve", "--data-dir", "/proc/kvgw-data", "--port", str(free_port()), cwd=tmp_path))
    assert line.startswith("kvgw: cannot use the data directory /proc/kvgw-data: ")


def test_a_second_serve_on_a_served_data_dir_is_refused(server: ServerProcess, tmp_path: Path) -> None:
    line = one_line(kvgw("serve", "--data-dir", str(server.data_dir), "--port", str(free_port()), cwd=tmp_path,
                         env={"KVGW_ROOT_ACCESS_KEY": ROOT_AK, "KVGW_ROOT_SECRET_KEY": ROOT_SK}))
    assert "already served" in line and f"pid={server.proc.pid if server.proc else 0}" in line
    assert f"port={server.port}" in line
    assert httpx.get(f"{server.url}/readyz").status_code == 200  # the first one is untouched
    server.restart()  # the lock went with the process that held it
    assert httpx.get(f"{server.url}/readyz").status_code == 200


def test_the_workers_of_one_gateway_share_its_lock(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    server = server_factory(data_dir=tmp_path / "d", extra_args=["--workers", "2"]).start()
    pids = set()
    for _ in range(40):  # both workers answer: neither was refused the lock its parent holds
        stats = httpx.get(f"{server.url}/v1/admin/stats", headers=server.auth).json()
        pids.add(stats["process"]["pid"])
        if len(pids) == 2:
            break
    assert len(pids) == 2
    line = one_line(kvgw("serve", "--data-dir", str(server.data_dir), "--port", str(free_port()), cwd=tmp_path))
    assert "already served" in line


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_clean_stop_exits_0(server_factory: type[ServerProcess], tmp_path: Path, workers: str,
                              signum: signal.Signals) -> None:
    server = server_factory(data_dir=tmp_path / "d", extra_args=["--workers", workers]).start()
    assert server.proc is not None
    server.proc.send_signal(signum)
    assert server.proc.wait(60) == 0, server.log()[-2000:]


def test_a_start_does_not_log_alembic_at_info(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    server = server_factory(data_dir=tmp_path / "d", env={"KVGW_LOG_LEVEL": "info"}).start()
    log = server.log()
    assert re.search(r" INFO kvgw", log)  # INFO lines are there...
    assert "alembic" not in log and "Context impl" not in log  # ...but not alembic's


# -- listings ----------------------------------------------------------------------------------


def columns(table: str) -> list[list[str]]:
    """The cells of an aligned table, cut at the header's column starts; fails if a cell is misaligned."""
    header, *rows = table.rstrip("\n").splitlines()
    starts = [m.start() for m in re.finditer(r"(?:^|(?<=  ))\S", header)]
    cut = []
    for line in [header, *rows]:
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
        for a in starts[1:]:
            assert line[a - 1: a] in (" ", ""), f"not aligned: {line!r}"
        cut.append(cells)
    return cut


def test_bucket_and_cred_lists_are_tables_and_json(server: ServerProcess, tmp_path: Path) -> None:
    env = {"KVGW_ROOT_ACCESS_KEY": ROOT_AK, "KVGW_ROOT_SECRET_KEY": ROOT_SK}
    data = ["--data-dir", str(server.data_dir)]
    assert kvgw("bucket", "create", "vllm-kv", "--capacity-bytes", str(2 << 40), "--ttl", "86400", *data,
                cwd=tmp_path, env=env).returncode == 0
    created = json.loads(kvgw("cred", "create", "--bucket", "vllm-kv", "--write", *data, cwd=tmp_path,
                              env=env).stdout)
    buckets = kvgw("bucket", "list", *data, cwd=tmp_path, env=env)
    assert buckets.returncode == 0 and "{" not in buckets.stdout
    header, *rows = columns(buckets.stdout)
    assert header[:5] == ["NAME", "WRITE", "FS CAPACITY", "S3 CAPACITY", "TTL"]
    assert [r[0] for r in rows] == ["kvcache", "vllm-kv"]
    assert rows[1][2:5] == ["2.0 TiB", "-", "1 d"]
    as_json = kvgw("bucket", "list", "--json", *data, cwd=tmp_path, env=env).stdout
    assert [json.loads(line)["name"] for line in as_json.splitlines()] == ["kvcache", "vllm-kv"]

    creds = kvgw("cred", "list", *data, cwd=tmp_path, env=env)
    assert creds.returncode == 0 and created["secret_key"] not in creds.stdout
    header, *rows = columns(creds.stdout)
    assert header == ["ACCESS KEY", "ROOT", "STATUS", "GRANTS"]
    assert [created["access_key"], "-", "active", "vllm-kv: read+write"] in rows
    assert [ROOT_AK, "root", "active", "every bucket"] in rows
    as_json = kvgw("cred", "list", "--json", *data, cwd=tmp_path, env=env).stdout
    listed = [json.loads(line) for line in as_json.splitlines()]
    mine = next(c for c in listed if c["access_key"] == created["access_key"])
    assert mine["grants"] == {"vllm-kv": {"read": True, "write": True, "delete": False}}

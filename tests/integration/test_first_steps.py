"""The README's first steps, run as written against a real ``kvgw serve`` started as a newcomer starts it:
in an empty directory, on the embedded defaults, with no ``KVGW_*`` setting (root credentials generated
and saved to ``kvgw-data/root-credentials``). Only the gateway's address is replaced, because port 8080
may be taken on a shared machine.

The shell block runs under ``bash -e -o pipefail``, so any step that fails (curl's ``-f``: an HTTP
error; ``cmp``: bytes that do not read back) fails the test; then what the comments promise is checked
on its output and on the files it left. The S3 clients' boto3 snippet runs after it, in the same
directory, with the generated credentials in place of ``KVGW...`` / ``...``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.bench.launcher import free_port, http_status, stop_process, wait_until
from kvgw_client import wire
from tests.conftest import require_or_skip
from tests.docs import README, code_blocks, section

DOC_ADDRESS = "127.0.0.1:8080"
DOC_S3_ENDPOINT = "http://kvgw.internal:8080"


def first_steps() -> str:
    (block,) = code_blocks(section(README.read_text(), "First steps"), "sh")
    return block


def boto3_snippet() -> str:
    (block,) = code_blocks(section(README.read_text(), "S3 clients (boto3, the aws CLI)"), "python")
    return block


@pytest.fixture
def newcomer(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """``kvgw serve`` in an empty directory with nothing configured: (that directory, host:port)."""
    for tool in ("curl", "cmp", "head", "sed"):
        if shutil.which(tool) is None:
            require_or_skip(f"the README's first steps need {tool}")
    home = tmp_path / "newcomer"
    home.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGW_")}
    log = tmp_path / "serve.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)], cwd=home,
                                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: http_status(f"http://127.0.0.1:{port}/readyz") == 200, proc, "kvgw serve", log)
        yield home, f"127.0.0.1:{port}"
    finally:
        stop_process(proc)


def test_the_first_steps_run_as_written(newcomer: tuple[Path, str]) -> None:
    home, address = newcomer
    script = first_steps()
    assert DOC_ADDRESS in script and "head -c" in script  # the steps make the files they use
    run = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script.replace(DOC_ADDRESS, address)], cwd=home,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "prompt-a-1 read back" in out
    assert json.loads(_line_with(out, '"exists"')) == {"exists": [True, False]}
    assert json.loads(_line_with(out, '"length"')) == {"length": 2}
    assert "x-kvgw-checksum" in out.lower()  # the HEAD's headers
    chunks = [(home / f"chunk{i}.bin").read_bytes() for i in range(2)]
    assert [len(c) for c in chunks] == [4 << 20, 4 << 20]
    assert _batch_payloads((home / "both.kvgb").read_bytes()) == chunks

    (home / "chunk0.bin").unlink()  # what happened to the README's old steps: the file is not there
    missing = script.replace(DOC_ADDRESS, address).replace("prompt-a-0", "prompt-c-0")
    missing = "\n".join(line for line in missing.splitlines() if not line.startswith("head -c"))
    again = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", missing], cwd=home, capture_output=True,
                           text=True, timeout=120)
    # curl warns "this makes an empty POST" and sends no bytes: the gateway refuses them and the step fails
    assert again.returncode != 0 and "error: 400" in again.stderr, again.stdout + again.stderr
    assert "prompt-a-1 read back" not in again.stdout  # -e: nothing ran after the refused PUT


def test_the_boto3_snippet_runs_as_written(newcomer: tuple[Path, str]) -> None:
    home, address = newcomer
    (home / "chunk0.bin").write_bytes(os.urandom(4 << 20))  # made by the first steps
    credentials = dict(line.split("=", 1) for line in
                       (home / "kvgw-data" / "root-credentials").read_text().splitlines() if "=" in line)
    snippet = boto3_snippet()
    assert DOC_S3_ENDPOINT in snippet
    snippet = (snippet.replace(DOC_S3_ENDPOINT, f"http://{address}")
               .replace('"KVGW..."', json.dumps(credentials["access_key"]))
               .replace('"..."', json.dumps(credentials["secret_key"])))
    run = subprocess.run([sys.executable, "-c", snippet], cwd=home, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(4 << 20)]


def _line_with(out: str, needle: str) -> str:
    (line,) = [ln for ln in out.splitlines() if needle in ln]
    return line


def _batch_payloads(stream: bytes) -> list[bytes]:
    """The payloads of a batch-get stream, parsed with the client's own parser."""
    parser = wire.BatchParser()
    frames = list(parser.feed(stream))
    assert parser.complete and all(frame.ok for frame in frames)
    return [frame.payload for frame in frames]

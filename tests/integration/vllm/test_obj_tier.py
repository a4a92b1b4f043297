"""NIXL 1.5.1's OBJ backend against kvgw's S3 API, driven as vLLM 0.33.0's ``ObjectStoreSecondaryTierManager``
drives it (``gateway.bench.vllm_obj``), for what vLLM itself cannot be made to do: NIXL's multipart mode
and required checksums (vLLM 0.33 passes neither), and a gateway frozen under a load (aws-sdk-cpp's
retries, counted on the wire). Everything vLLM can be configured to do is tested with vLLM's own tier
in ``test_vllm_obj.py``."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable

import httpx

from gateway.bench.vllm_obj import KeyForm, ObjTier
from tests.conftest import ServerProcess
from tests.integration.vllm.conftest import store_config

MiB = 1 << 20
DOC_ENDPOINT = "kvgw.internal:8080"


def s3_counts(server: ServerProcess) -> tuple[Counter[tuple[str, str]], Counter[tuple[str, str]]]:
    """(S3 operation, status) -> requests answered so far, and those of them the client marked as a
    retry, from the gateway's /metrics."""
    text = httpx.get(f"{server.url}/metrics", headers=server.auth, timeout=30).text
    out: tuple[Counter[tuple[str, str]], Counter[tuple[str, str]]] = (Counter(), Counter())
    for family, counts in zip(("requests", "retried_requests"), out, strict=True):
        pattern = rf'^kvgw_{family}_total\{{api="s3",op="(\w+)",status="(\d+)"\}} (\S+)$'
        for m in re.finditer(pattern, text, re.M):
            counts[(m[1], m[2])] = int(float(m[3]))
    return out


def s3_requests(server: ServerProcess) -> Counter[tuple[str, str]]:
    """(S3 operation, status) -> first attempts answered so far: the wire pattern the client chose.
    aws-sdk-cpp sends a request again when an answer takes over 3 s (a frozen gateway, or a VM that
    stalls), and marks the new one as a retry (``test_a_frozen_gateway_gets_retries``)."""
    requests, retried = s3_counts(server)
    return requests - retried


def block_hashes(n: int, seed: int) -> list[bytes]:
    return [((seed << 24) + i).to_bytes(32, "big") for i in range(n)]


def fill(tier: ObjTier, blocks: range, seed: int) -> list[bytes]:
    out = []
    for b in blocks:
        data = os.urandom(tier.block_bytes)
        tier.view(b)[:] = data
        out.append(data)
    return out


def round_trip(tier: ObjTier, keys: list[str], seed: int) -> list[bytes]:
    """Store ``keys`` from the buffer's first blocks, load them into the next ones: byte for byte; lookups
    miss before the store and hit after it (a key never stored still misses)."""
    n = len(keys)
    assert tier.blocks >= 2 * n
    absent = KeyForm().object_key(b"\xee" * 32 + seed.to_bytes(8, "big"))
    assert tier.lookup([*keys, absent]) == [False] * (n + 1)
    sent = fill(tier, range(n), seed)
    assert tier.store(list(range(n)), keys) == "DONE"
    assert tier.lookup([*keys, absent]) == [True] * n + [False]
    assert tier.load(list(range(n, 2 * n)), keys) == "DONE"
    assert [bytes(tier.view(n + i)) for i in range(n)] == sent
    return sent


def test_multipart_uploads_and_required_checksums(
    make_tier: Callable[..., ObjTier], gateway: ServerProcess, seed: int
) -> None:
    """NIXL's CRT client (``crtMinLimit``: multipart uploads in parts of that size, parallel ranged GETs)
    and ``req_checksum: required`` (signed SHA-256 payloads): 32 MiB objects go multipart, 1 MiB ones not."""
    params = {"crtMinLimit": str(8 * MiB), "req_checksum": "required"}
    big = make_tier(store_config(gateway), block_bytes=32 * MiB, blocks=4, backend_params=params)
    before = s3_requests(gateway)
    round_trip(big, [KeyForm().object_key(h) for h in block_hashes(2, seed)], seed)
    seen = s3_requests(gateway) - before
    assert (seen[("CreateMultipartUpload", "200")], seen[("UploadPart", "200")]) == (2, 8), seen
    assert (seen[("CompleteMultipartUpload", "200")], seen[("GetObject", "206")]) == (2, 8), seen
    small = make_tier(store_config(gateway), block_bytes=MiB, blocks=4, backend_params=params)
    round_trip(small, [KeyForm().object_key(h) for h in block_hashes(2, seed + 1)], seed + 1)


def test_a_frozen_gateway_gets_retries(
    make_tier: Callable[..., ObjTier], gateway: ServerProcess, seed: int
) -> None:
    """A gateway frozen (SIGSTOP) for longer than aws-sdk-cpp waits for an answer (3 s): the client sends
    the loads in flight again, marked ``amz-sdk-request: attempt=2``; kvgw answers both attempts and counts
    the second ones in ``kvgw_retried_requests``, so the first attempts are still vLLM's wire pattern
    and every block arrives byte for byte."""
    n = 8
    tier = make_tier(store_config(gateway), block_bytes=MiB, blocks=2 * n)
    keys = [KeyForm().object_key(h) for h in block_hashes(n, seed)]
    sent = fill(tier, range(n), seed)
    assert tier.store(list(range(n)), keys) == "DONE"
    requests_before, retried_before = s3_counts(gateway)
    loaded: list[str] = []
    (pid,) = gateway.pids()
    os.kill(pid, signal.SIGSTOP)
    try:
        loading = threading.Thread(target=lambda: loaded.append(tier.load(list(range(n, 2 * n)), keys)))
        loading.start()
        time.sleep(4.0)  # past aws-sdk-cpp's 3 s: the requests in flight time out and are sent again
    finally:
        os.kill(pid, signal.SIGCONT)
    loading.join(timeout=120)
    assert loaded == ["DONE"]
    assert [bytes(tier.view(n + i)) for i in range(n)] == sent
    requests, retried = s3_counts(gateway)
    retried -= retried_before
    assert set(retried) == {("GetObject", "206")} and retried[("GetObject", "206")] >= 1, retried
    assert requests - requests_before - retried == Counter({("GetObject", "206"): n})

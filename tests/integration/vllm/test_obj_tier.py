"""vLLM's object-store KV tier against kvgw's S3 API: NIXL 1.5.1's OBJ backend driven exactly as vLLM
0.33.0's ``ObjectStoreSecondaryTierManager`` drives it (``gateway.bench.vllm_obj``), DRAM buffers on CPU,
vLLM's object names, a real ``kvgw serve``."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.bench.vllm_obj import STORE_CONFIG_FIELDS, KeyForm, ObjTier, nixl_params, stored_name
from tests.conftest import ServerProcess
from tests.docs import README, section, text
from tests.integration.vllm.conftest import cli, store_config

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


@pytest.mark.parametrize("mib", [1, 8, 32])
def test_blocks_round_trip_byte_exact(
    make_tier: Callable[..., ObjTier], gateway: ServerProcess, seed: int, mib: int
) -> None:
    n = {1: 8, 8: 4, 32: 2}[mib]
    tier = make_tier(store_config(gateway), block_bytes=mib * MiB, blocks=2 * n)
    keys = [KeyForm().object_key(h) for h in block_hashes(n, seed)]
    assert all(k.startswith("/Qwen_Qwen3-8B_") and k.endswith(".bin") for k in keys)
    before = s3_requests(gateway)
    sent = round_trip(tier, keys, seed)
    # the wire pattern vLLM's tier relies on: a HEAD per key and lookup (misses are 404s), a PUT per
    # block with no existence check, a ranged GET per block
    seen = s3_requests(gateway) - before
    assert seen == Counter({("HeadObject", "404"): n + 2, ("HeadObject", "200"): n, ("PutObject", "200"): n,
                            ("GetObject", "206"): n}), seen
    # kvgw holds each block as an ordinary chunk of the bucket, under the name aws-sdk-cpp sent
    got = httpx.get(gateway.chunk_url(stored_name(keys[-1])), headers=gateway.auth, timeout=60)
    assert got.status_code == 200 and got.content == sent[-1]


def vllm_doc(where: str) -> str:
    """kvgw's vLLM documentation: ``docs/vllm.md``, or the README's short section."""
    if where == "README.md":
        return section(README.read_text(), "vLLM's object-store tier (no LMCache)")
    return text("docs/vllm.md")


def documented_kv_transfer_config(where: str) -> dict[str, Any]:
    (doc,) = re.findall(r"--kv-transfer-config '(\{.*?\})'", vllm_doc(where), re.S)
    parsed: dict[str, Any] = json.loads(doc)
    return parsed


def documented_shell_line(start: str, where: str) -> list[str]:
    (line,) = [ln for ln in vllm_doc(where).splitlines() if ln.startswith(start)]
    return line.split("#")[0].split()


@pytest.mark.parametrize("where", ["docs/vllm.md", "README.md"])
def test_the_documented_config_as_written(
    make_tier: Callable[..., ObjTier], gateway: ServerProcess, seed: int, where: str
) -> None:
    """The bucket, credential and ``--kv-transfer-config`` of the docs page and of the README, with only
    the gateway's address and the credential's values replaced: vLLM's tier builds its NIXL backend from
    it and round-trips blocks."""
    doc = documented_kv_transfer_config(where)
    assert (doc["kv_connector"], doc["kv_role"]) == ("OffloadingConnector", "kv_both")
    extra = doc["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec" and extra["cpu_bytes_to_use"] > 0
    (tier_config,) = extra["secondary_tiers"]
    assert tier_config["type"] == "obj"
    assert set(tier_config) <= {"type", "store_config", "prefix", "io_threads", "enable_kv_events", "locality"}
    written = tier_config["store_config"]
    assert set(written) <= set(STORE_CONFIG_FIELDS) and written["endpoint_override"] == DOC_ENDPOINT

    bucket_args = documented_shell_line("kvgw bucket create", where)[1:]
    assert bucket_args[:3] == ["bucket", "create", written["bucket"]] and "--ttl" in bucket_args
    bucket = f"{written['bucket']}-{seed}"  # write-once keys: a bucket of this test's own
    cli(gateway, *bucket_args[:2], bucket, *bucket_args[3:])
    cred_args = documented_shell_line("kvgw cred create", where)[1:]
    assert cred_args == ["cred", "create", "--bucket", written["bucket"], "--write"]
    cred = cli(gateway, "cred", "create", "--bucket", bucket, "--write")

    config = {**written, "bucket": bucket, "endpoint_override": f"127.0.0.1:{gateway.port}",
              "access_key": cred["access_key"], "secret_key": cred["secret_key"]}
    params = nixl_params(config, tier_config["io_threads"])
    assert params["num_threads"] == "4" and params["region"] == "us-east-1"
    deadline = time.monotonic() + 10  # the gateway picks the new bucket and credential up from the catalog
    while True:
        try:
            tier = make_tier(config, block_bytes=8 * MiB, blocks=8, io_threads=tier_config["io_threads"])
            break
        except Exception:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    keys = [KeyForm(prefix=tier_config["prefix"]).object_key(h) for h in block_hashes(4, seed)]
    round_trip(tier, keys, seed)


def test_a_prefix_and_a_host_name_endpoint(
    make_tier: Callable[..., ObjTier], gateway: ServerProcess, seed: int
) -> None:
    """``"prefix": "team-a"`` makes ``team-a//<model>...`` keys (vLLM joins a ``/`` twice); aws-sdk-cpp
    sends them with empty segments dropped, path-style to a host name too."""
    tier = make_tier(store_config(gateway, host="localhost"), block_bytes=MiB, blocks=4)
    keys = [KeyForm(prefix="team-a").object_key(h) for h in block_hashes(2, seed)]
    assert keys[0].startswith("team-a//Qwen_Qwen3-8B_")
    sent = round_trip(tier, keys, seed)
    name = stored_name(keys[0])
    assert name.startswith("team-a/Qwen_Qwen3-8B_")
    got = httpx.get(gateway.chunk_url(name), headers=gateway.auth, timeout=60)
    assert got.content == sent[0]


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


def test_credentials_from_the_environment(
    make_tier: Callable[..., ObjTier], gateway: ServerProcess, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No keys in ``store_config``: vLLM leaves them out of NIXL's parameters and aws-sdk-cpp takes
    ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``."""
    config = store_config(gateway)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", config.pop("access_key"))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", config.pop("secret_key"))
    assert "access_key" not in nixl_params(config)
    tier = make_tier(config, block_bytes=MiB, blocks=4)
    round_trip(tier, [KeyForm().object_key(h) for h in block_hashes(2, seed)], seed)


def test_a_misspelt_bucket_passes_the_probe_then_misses_and_fails(
    make_tier: Callable[..., ObjTier], gateway: ServerProcess, seed: int
) -> None:
    """What docs/vllm.md warns about: vLLM's start-up probe reads kvgw's 404 NoSuchBucket as a missing key."""
    tier = make_tier(store_config(gateway, bucket=f"vllm-kv-typo-{seed}"), block_bytes=MiB, blocks=2)
    keys = [KeyForm().object_key(h) for h in block_hashes(1, seed)]
    assert tier.lookup(keys) == [False]
    fill(tier, range(1), seed)
    assert tier.store([0], keys) != "DONE"
    assert tier.load([1], keys) != "DONE"


def test_a_wrong_secret_fails_vllms_start(make_tier: Callable[..., ObjTier], gateway: ServerProcess) -> None:
    with pytest.raises(Exception):  # noqa: B017,PT011 -- NIXL raises its own error type for the probe's 403
        make_tier(store_config(gateway, secret_key="not-the-secret"), block_bytes=MiB, blocks=2)


def test_a_bucket_ttl_expires_blocks_vllm_never_deletes(
    make_tier: Callable[..., ObjTier], gateway: ServerProcess, seed: int
) -> None:
    """The cleanup vLLM leaves to the store: a bucket created with ``--ttl`` expires the blocks (lookups
    miss again), and the same block can be stored anew afterwards."""
    bucket = f"vllm-ttl-{seed}"
    cli(gateway, "bucket", "create", bucket, "--ttl", "2")
    deadline = time.monotonic() + 10
    while True:
        try:
            tier = make_tier(store_config(gateway, bucket=bucket), block_bytes=MiB, blocks=4)
            keys = [KeyForm().object_key(h) for h in block_hashes(1, seed)]
            fill(tier, range(1), seed)
            if tier.store([0], keys) == "DONE":
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, "the gateway did not take the new bucket"
        time.sleep(0.2)
    assert tier.lookup(keys) == [True]
    deadline = time.monotonic() + 20
    while tier.lookup(keys) != [False]:
        assert time.monotonic() < deadline, "the block did not expire"
        time.sleep(0.2)
    sent = fill(tier, range(1), seed + 1)
    assert tier.store([0], keys) == "DONE"
    assert tier.load([2], keys) == "DONE" and bytes(tier.view(2)) == sent[0]


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

"""vLLM 0.33's own object-store tier (``ObjectStoreSecondaryTierManager``: NIXL 1.5.1's OBJ backend,
aws-sdk-cpp) inside vLLM's tiering manager on CPU, against kvgw's S3 API: what vLLM puts on the wire, 1,
8 and 32 MiB blocks byte for byte, README's configuration as written, credentials from the environment,
the faults README warns about, a bucket TTL, and blocks shared with kvgw's own tier (the same names).

NIXL-level modes vLLM 0.33 cannot configure (multipart, required checksums) and a frozen gateway's
retries are tested on NIXL directly in ``test_obj_tier.py``."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.bench.vllm_engine import block_keys
from gateway.bench.vllm_obj import STORE_CONFIG_FIELDS, stored_name
from tests.conftest import ServerProcess, wait_for
from tests.docs import README, section, text
from tests.integration.vllm.conftest import cli, kvgw_tier, store_config
from tests.integration.vllm.test_obj_tier import s3_requests

MiB = 1 << 20
DOC_ENDPOINT = "kvgw.internal:8080"


def obj_tier(store: dict[str, Any], **options: Any) -> dict[str, Any]:
    return {"type": "obj", "store_config": store, **options}


def blocks(n: int, size: int) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)]


@pytest.mark.parametrize("mib", [1, 8, 32])
def test_vllms_obj_tier_round_trips_blocks_byte_exact(
    engines: Callable[..., Any], gateway: ServerProcess, seed: int, mib: int
) -> None:
    n = {1: 8, 8: 4, 32: 2}[mib]
    keys, data = block_keys(n, seed), blocks(n, mib * MiB)
    tier = obj_tier(store_config(gateway))
    before = s3_requests(gateway)
    a = engines([tier], block_bytes=mib * MiB, cpu_blocks=n + 2)
    a.store(keys, data)
    b = engines([tier], block_bytes=mib * MiB, cpu_blocks=n + 2)
    got = b.load(keys)
    assert got.data == data and got.answers[0] == ["RETRY"] * n and got.answers[-1] == ["HIT"] * n
    seen = s3_requests(gateway) - before
    # vLLM's wire pattern: a probe HEAD per tier start, a PUT per block with no existence check, a HEAD
    # per key per lookup, a ranged GET per block
    assert seen == Counter({("HeadObject", "404"): 2, ("HeadObject", "200"): n, ("PutObject", "200"): n,
                            ("GetObject", "206"): n}), seen
    # kvgw holds each block as an ordinary chunk, under vLLM's name without the leading "/"
    name = b.tiers[0]._file_mapper.get_file_name(keys[-1]).lstrip("/")
    got_chunk = httpx.get(gateway.chunk_url(name), headers=gateway.auth, timeout=60)
    assert got_chunk.content == data[-1]


def test_blocks_are_shared_between_vllms_obj_tier_and_kvgws_tier(
    engines: Callable[..., Any], gateway: ServerProcess, seed: int
) -> None:
    """Same bucket, same (empty) prefix: what vLLM's obj tier stored, kvgw's tier loads, and back."""
    keys, data = block_keys(4, seed), blocks(4, MiB)
    engines([obj_tier(store_config(gateway))]).store(keys[:2], data[:2])
    engines([kvgw_tier(gateway)]).store(keys[2:], data[2:])
    assert engines([kvgw_tier(gateway)]).load(keys).data == data
    assert engines([obj_tier(store_config(gateway))]).load(keys).data == data


def vllm_doc(where: str) -> str:
    """kvgw's documentation of vLLM's obj tier: its section of ``docs/vllm.md``, or the README's short one."""
    if where == "README.md":
        return section(README.read_text(), "vLLM's object-store tier (no LMCache)")
    return section(text("docs/vllm.md"), "vLLM's object-store tier (no LMCache)")


def documented_kv_transfer_config(where: str) -> dict[str, Any]:
    (doc,) = re.findall(r"--kv-transfer-config '(\{.*?\})'", vllm_doc(where), re.S)
    parsed: dict[str, Any] = json.loads(doc)
    return parsed


def documented_shell_line(start: str, where: str) -> list[str]:
    (line,) = [ln for ln in vllm_doc(where).splitlines() if ln.startswith(start)]
    return line.split("#")[0].split()


@pytest.mark.parametrize("where", ["docs/vllm.md", "README.md"])
def test_the_documented_config_as_written(
    engines: Callable[..., Any], gateway: ServerProcess, seed: int, where: str
) -> None:
    """The bucket, credential and ``secondary_tiers`` entry of the docs page and of the README given to
    vLLM as written, with only the gateway's address and the credential's values replaced."""
    doc = documented_kv_transfer_config(where)
    assert (doc["kv_connector"], doc["kv_role"]) == ("OffloadingConnector", "kv_both")
    extra = doc["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec" and extra["cpu_bytes_to_use"] > 0
    (tier,) = extra["secondary_tiers"]
    written = tier["store_config"]
    assert tier["type"] == "obj" and set(written) <= set(STORE_CONFIG_FIELDS)
    assert written["endpoint_override"] == DOC_ENDPOINT
    bucket_args = documented_shell_line("kvgw bucket create", where)[1:]
    assert bucket_args[:3] == ["bucket", "create", written["bucket"]] and "--ttl" in bucket_args
    bucket = f"{written['bucket']}-{seed}"  # write-once keys: a bucket of this test's own
    cli(gateway, *bucket_args[:2], bucket, *bucket_args[3:])
    assert documented_shell_line("kvgw cred create", where)[1:] == ["cred", "create", "--bucket", written["bucket"],
                                                                     "--write"]
    cred = cli(gateway, "cred", "create", "--bucket", bucket, "--write")
    tier = {**tier, "store_config": {**written, "bucket": bucket, "endpoint_override": f"127.0.0.1:{gateway.port}",
                                     "access_key": cred["access_key"], "secret_key": cred["secret_key"]}}
    keys, data = block_keys(3, seed), blocks(3, MiB)

    def stores() -> bool:  # the gateway takes the new bucket and credential from the catalog within a refresh
        try:
            engines([tier], cpu_blocks=4).store(keys, data)
        except Exception:
            return False
        return True

    wait_for(stores, "vLLM's tier to start with the new credential", interval=0.5)
    assert engines([tier], cpu_blocks=4).load(keys).data == data


def test_a_prefix_a_host_name_and_credentials_from_the_environment(
    engines: Callable[..., Any], gateway: ServerProcess, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_config(gateway, host="localhost")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", store.pop("access_key"))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", store.pop("secret_key"))
    keys, data = block_keys(2, seed), blocks(2, MiB)
    engines([obj_tier(store, prefix="team-a")]).store(keys, data)
    b = engines([obj_tier(store, prefix="team-a")])
    assert b.load(keys).data == data
    name = b.tiers[0]._file_mapper.get_file_name(keys[0])
    assert name.startswith("team-a//Qwen_Qwen3-8B_")  # vLLM joins a "/" twice; aws-sdk-cpp drops the empty segment
    assert httpx.get(gateway.chunk_url(stored_name(name)), headers=gateway.auth, timeout=60).content == data[0]
    # kvgw's tier with the same prefix names the block as kvgw stored it: it loads the obj tier's blocks
    assert engines([kvgw_tier(gateway, prefix="team-a")]).load(keys).data == data


def test_a_wrong_secret_fails_vllms_start(engines: Callable[..., Any], gateway: ServerProcess) -> None:
    with pytest.raises(Exception):  # noqa: B017,PT011 -- NIXL raises its own error type for the probe's 403
        engines([obj_tier(store_config(gateway, secret_key="not-the-secret"))])


def test_a_misspelt_bucket_starts_then_misses_and_fails(
    engines: Callable[..., Any], gateway: ServerProcess, seed: int
) -> None:
    """What README warns about: the start-up probe reads kvgw's 404 NoSuchBucket as a missing key; then
    lookups miss and stores fail (vLLM logs the failed jobs and goes on)."""
    tier = obj_tier(store_config(gateway, bucket=f"vllm-kv-typo-{seed}"))
    keys = block_keys(2, seed)
    engines([tier]).store(keys, blocks(2, MiB))  # the store job fails; vLLM goes on
    assert engines([tier]).load(keys).data == [None, None]


def test_a_bucket_ttl_expires_blocks_vllm_never_deletes(
    engines: Callable[..., Any], gateway: ServerProcess, seed: int
) -> None:
    bucket = f"vllm-ttl-{seed}"
    cli(gateway, "bucket", "create", bucket, "--ttl", "2")
    tier = obj_tier(store_config(gateway, bucket=bucket))
    keys, data = block_keys(1, seed), blocks(1, MiB)

    def engine() -> Any:
        return engines([tier], cpu_blocks=4)

    def stored() -> bool:
        try:
            engine().store(keys, data)
        except Exception:
            return False
        return bool(engine().load(keys).data == data)

    wait_for(stored, "the gateway to take the new bucket", interval=0.5)
    wait_for(lambda: engine().load(keys).data == [None], "the block to expire", interval=0.5)
    fresh = blocks(1, MiB)
    engines([tier]).store(keys, fresh)  # stored anew after it expired
    assert engines([tier]).load(keys).data == fresh

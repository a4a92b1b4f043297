"""Settings value objects and the flat-dict reader plugins use."""

from __future__ import annotations

import pytest

from kvgw_client.chains import ParentMap
from kvgw_client.config import (
    ClientSettings,
    HealthPolicy,
    RetryPolicy,
    SettingsReader,
    Timeouts,
    credentials_from_env,
    read_client_settings,
)


def test_reader_coerces_strings_from_yaml_or_env() -> None:
    values: dict[str, object] = {
        "url": "http://gw:9000",
        "bucket": "kv-cache",
        "connect_timeout_s": "0.5",
        "retry_attempts": "5",
        "pool_size": 64.0,
        "require_checksum": "false",
        "max_chunk_bytes": "1_000_000",
    }
    reader = SettingsReader(values)
    settings = read_client_settings(reader)
    assert settings.timeouts.connect == 0.5 and settings.retry.attempts == 5 and settings.pool_size == 64
    assert settings.require_checksum is False and settings.max_chunk_bytes == 1_000_000
    assert settings.timeouts.transfer is None
    assert reader.leftover(values) == []


def test_reader_reports_unread_keys_and_prefers_earlier_sources() -> None:
    instance = {"bucket": "inst-bucket"}
    shared = {"url": "http://gw", "bucket": "shared-bucket", "pool_sise": 3}
    reader = SettingsReader(instance, shared)
    settings = read_client_settings(reader)
    assert settings.bucket == "inst-bucket"
    assert reader.leftover(shared) == ["pool_sise"]


@pytest.mark.parametrize(
    ("key", "value"),
    [("retry_attempts", "many"), ("retry_attempts", True), ("connect_timeout_s", [1]), ("require_checksum", "maybe")],
)
def test_reader_rejects_bad_values(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=key):
        read_client_settings(SettingsReader({"url": "http://gw", "bucket": "kvcache", key: value}))


def test_required_keys() -> None:
    with pytest.raises(ValueError, match="url"):
        read_client_settings(SettingsReader({"bucket": "kvcache"}))


def test_credentials_fall_back_to_the_environment() -> None:
    ak, sk = credentials_from_env({"KVGW_ACCESS_KEY": "AK", "KVGW_SECRET_KEY": "SK"})
    reader = SettingsReader({"url": "http://gw", "bucket": "kvcache"})
    settings = read_client_settings(reader, access_key=ak, secret_key=sk)
    assert (settings.access_key, settings.secret_key) == ("AK", "SK")
    assert "SK" not in repr(settings)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"url": "gw:9000"}, "url must be http"),
        ({"url": "http://gw/?x=1"}, "must not have a query"),
        ({"bucket": "KV"}, "invalid bucket name"),
        ({"bucket": "kv"}, "invalid bucket name"),
        ({"access_key": "a"}, "give both access_key and secret_key"),
        ({"access_key": "a:b", "secret_key": "s"}, "access_key must not contain ':'"),
        ({"pool_size": 0}, "must be at least 1"),
    ],
)
def test_client_settings_validation(kwargs: dict[str, object], error: str) -> None:
    values: dict[str, object] = {"url": "http://gw:9000", "bucket": "kvcache", **kwargs}
    with pytest.raises(ValueError, match=error):
        ClientSettings(**values)  # type: ignore[arg-type]


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="connect must be positive"):
        Timeouts(connect=0)
    with pytest.raises(ValueError, match="attempts must be at least 1"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="cooldown <= cooldown_max"):
        HealthPolicy(cooldown=5, cooldown_max=1)


def test_retry_delay_is_full_jitter_capped() -> None:
    policy = RetryPolicy(attempts=5, backoff=0.1, backoff_max=0.3)
    assert policy.delay(0, 0.5) == pytest.approx(0.05)
    assert policy.delay(1, 1.0) == pytest.approx(0.2)
    assert policy.delay(4, 1.0) == pytest.approx(0.3)
    assert policy.delay(3, 0.0) == 0.0


def test_parent_map_learns_chains_and_forgets_oldest() -> None:
    parents = ParentMap(capacity=3)
    parents.learn(["a", "b", "c", "d"])
    assert [parents.parent(k) for k in "abcd"] == [None, "a", "b", "c"]
    parents.learn(["d", "e"])
    assert len(parents) == 3 and parents.parent("b") is None and parents.parent("e") == "d"
    # a store run: learned parent for the first key, in-run predecessors for the rest
    assert parents.parents_of_run(["e", "f", "g"]) == ["d", "e", "f"]


def test_parent_map_respects_chain_boundaries() -> None:
    parents = ParentMap(same_chain=lambda a, b: a[0] == b[0])
    parents.learn(["x1", "x2", "y1", "y2"])
    assert parents.parent("y1") is None and parents.parent("y2") == "y1"
    assert parents.parents_of_run(["x3", "y3"]) == [None, None]

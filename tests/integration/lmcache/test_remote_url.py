"""LMCache's ``remote_url: http(s)://host:port[/bucket]`` selects kvgw's connector through
``KvgwConnectorAdapter`` (loaded by the ``remote_storage_plugins`` lines): built by the real LMCache
(0.5.6 or 0.5.7) from a config of just ``remote_url``, the plugin lines and credentials, against a real
``kvgw serve`` (plain HTTP, and HTTPS with the gateway's CA)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import httpx
import pytest

from gateway.bench import lmcache_engine as le
from kvgw_client.lmcache.connector import ConnectorSettings, KvgwConnector, KvgwConnectorAdapter
from tests.conftest import ROOT_AK, ROOT_SK, ServerProcess
from tests.integration.test_serve import make_tls

PLUGIN_LINES = {
    "remote_storage_plugin.kvgw.module_path": "kvgw_client.lmcache.connector",
    "remote_storage_plugin.kvgw.class_name": "KvgwConnectorAdapter",
}


@pytest.fixture
def make_url_worker() -> Iterator[Callable[..., le.Worker]]:
    made: list[le.Worker] = []

    def make(remote_url: str, **kvgw: object) -> le.Worker:
        extra: dict[str, object] = {**PLUGIN_LINES, "kvgw.access_key": ROOT_AK, "kvgw.secret_key": ROOT_SK}
        extra.update({k if k.startswith("remote_storage_plugin.") else f"kvgw.{k}": v for k, v in kvgw.items()})
        config = le.engine_config(cpu_gb=le.cpu_pool_gb(1, 4), extra=extra, remote_url=remote_url,
                                  remote_storage_plugins=["kvgw"])
        worker = le.Worker(config, le.make_metadata(1))
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.close()


def url_connector(worker: le.Worker) -> KvgwConnector:
    backends = set(worker.storage.storage_backends)
    # one remote backend: remote_url's. The plugin entry only loaded the adapter.
    assert le.REMOTE_URL in backends and le.REMOTE_KVGW not in backends, backends
    connection = worker.backend(le.REMOTE_URL).connection
    assert connection is not None, "LMCache did not build kvgw's connector for remote_url"
    inner = connection.getWrappedConnector()
    assert isinstance(inner, KvgwConnector)
    return inner


def round_trip(worker: le.Worker, server: ServerProcess, seed: int, bucket: str = "kvcache") -> None:
    keys = le.chunk_keys(3, seed=seed)
    assert worker.lookup(keys) == 0
    objs = worker.allocate(3)
    digests = le.random_fill_many(objs, seed)
    worker.store(keys, objs)
    assert worker.wait_stored(le.REMOTE_URL, keys, timeout=30)
    assert worker.lookup(keys) == 3
    got = worker.retrieve(keys)
    assert [le.digest(o) for o in got] == digests
    le.release(got)
    name = url_connector(worker).name_of(keys[0])
    stored = httpx.get(server.chunk_url(name, bucket), headers=server.auth, timeout=30, verify=False)
    assert stored.status_code == 200


def test_remote_url_with_the_bucket_in_its_path(
    make_url_worker: Callable[..., le.Worker], shared_server: ServerProcess, seed: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    lmcache_log = logging.getLogger("lmcache.v1.storage_backend")  # LMCache 0.5.6's loggers do not propagate
    lmcache_log.addHandler(caplog.handler)
    try:
        worker = make_url_worker(f"{shared_server.url}/kvcache")
    finally:
        lmcache_log.removeHandler(caplog.handler)
    conn = url_connector(worker)
    assert (conn.settings.client.url, conn.settings.client.bucket) == (shared_server.url, "kvcache")
    # LMCache says why the plugin entry built no backend of its own, in kvgw's words
    assert any("only loads kvgw's adapter" in r.getMessage() for r in caplog.records)
    round_trip(worker, shared_server, seed)


def test_remote_url_without_a_path_takes_kvgw_bucket(
    make_url_worker: Callable[..., le.Worker], shared_server: ServerProcess, seed: int
) -> None:
    boto3.client("s3", endpoint_url=shared_server.url, aws_access_key_id=ROOT_AK, aws_secret_access_key=ROOT_SK,
                 region_name="us-east-1").create_bucket(Bucket=f"other{seed}")
    worker = make_url_worker(shared_server.url + "/", bucket=f"other{seed}",
                             **{"remote_storage_plugin.kvgw.lookup_timeout_s": 1.5})  # plugin-scoped keys apply
    settings = url_connector(worker).settings
    assert (settings.client.bucket, settings.lookup_timeout) == (f"other{seed}", 1.5)
    round_trip(worker, shared_server, seed, bucket=f"other{seed}")


def test_remote_url_over_https(
    make_url_worker: Callable[..., le.Worker], server_factory: type[ServerProcess], tmp_path: Path, seed: int
) -> None:
    ca, cert, key = make_tls(tmp_path)
    server = server_factory(data_dir=tmp_path / "d", extra_args=["--tls-cert", str(cert), "--tls-key", str(key)],
                            ca_file=ca).start()
    assert server.url.startswith("https://")
    worker = make_url_worker(f"{server.url}/kvcache", ca_bundle=str(ca))
    assert url_connector(worker).settings.client.url == server.url
    round_trip(worker, server, seed)


def test_without_remote_url_the_adapter_plugin_is_the_backend(shared_server: ServerProcess, seed: int) -> None:
    """The adapter route as before: ``plugin://kvgw`` with kvgw.url (no remote_url) is the backend."""
    extra = le.kvgw_plugin_extra(shared_server.url, access_key=ROOT_AK, secret_key=ROOT_SK, prefetch_bytes=0)
    extra["remote_storage_plugin.kvgw.class_name"] = "KvgwConnectorAdapter"
    worker = le.Worker(le.engine_config(cpu_gb=le.cpu_pool_gb(1, 4), extra=extra, remote_storage_plugins=["kvgw"]),
                       le.make_metadata(1))
    try:
        connection = worker.backend(le.REMOTE_KVGW).connection
        assert connection is not None and isinstance(connection.getWrappedConnector(), KvgwConnector)
        keys = le.chunk_keys(2, seed=seed)
        objs = worker.allocate(2)
        digests = le.random_fill_many(objs, seed)
        worker.store(keys, objs)
        assert worker.wait_stored(le.REMOTE_KVGW, keys, timeout=30)
        got = worker.retrieve(keys)
        assert [le.digest(o) for o in got] == digests
        le.release(got)
    finally:
        worker.close()


@pytest.mark.parametrize(
    ("remote_url", "extra", "error"),
    [
        ("http://kvgw.internal:8080/a/b", {}, "one segment"),
        ("ftp://kvgw.internal/kvcache", {}, "expected http"),
        ("http://user:pw@kvgw.internal/kvcache", {}, "no credentials"),
        ("http://kvgw.internal:8080/kvcache", {"kvgw.url": "http://elsewhere:8080"}, "contradicts remote_url"),
        ("http://kvgw.internal:8080/kvcache", {"kvgw.bucket": "other"}, "contradicts remote_url"),
        ("http://kvgw.internal:8080", {}, "bucket is required"),
    ],
)
def test_remote_url_mistakes_fail_the_start(remote_url: str, extra: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        ConnectorSettings.from_extra_config(extra, None, {}, remote_url=remote_url)


def test_agreeing_settings_and_adapter_claims() -> None:
    settings = ConnectorSettings.from_extra_config(
        {"kvgw.url": "https://kvgw.internal:8443/", "kvgw.bucket": "kvcache"}, None, {},
        remote_url="https://kvgw.internal:8443/kvcache")
    assert (settings.client.url, settings.client.bucket) == ("https://kvgw.internal:8443", "kvcache")
    adapter = KvgwConnectorAdapter()
    for url in ("http://kvgw.internal:8080", "https://kvgw.internal/kvcache", "plugin://kvgw", "plugin://kvgw.a"):
        assert adapter.can_parse(url), url
    for url in ("s3://kvcache.kvgw.internal:8080", "fs:///tmp/x", "plugin://kvgwx", "redis://h:1"):
        assert not adapter.can_parse(url), url

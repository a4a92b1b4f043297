"""The LMCache configuration snippets of ``docs/lmcache.md`` and the README's short one, as written there,
loaded by LMCache itself and used for a round trip against a real ``kvgw serve``: only the gateway's
address, the credentials and the memory sizes are replaced for the test."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from lmcache.v1.config import LMCacheEngineConfig

from gateway.bench import lmcache_engine as le
from tests.conftest import ROOT_AK, ROOT_SK, ServerProcess
from tests.docs import README, code_blocks, section, text

DOC_HOST = "kvgw.internal:8080"


def lmcache_page() -> str:
    return text("docs/lmcache.md")


def yaml_snippets(page: str | None = None) -> list[dict[str, Any]]:
    return [yaml.safe_load(block) for block in code_blocks(lmcache_page() if page is None else page, "yaml")]


def readme_yaml() -> dict[str, Any]:
    """The README's one LMCache configuration (its "LMCache" section under "Connect an engine")."""
    (doc,) = yaml_snippets(section(README.read_text(), "LMCache (in vLLM)"))
    return doc


def l2_snippets() -> list[dict[str, Any]]:
    return [json.loads(spec) for spec in re.findall(r"--l2-adapter '(\{.*?\})'", lmcache_page(), re.S)]


def as_written(doc: dict[str, Any], server: ServerProcess, tmp_path: Path, host: str) -> LMCacheEngineConfig:
    text = json.dumps(doc).replace(DOC_HOST, f"{host}:{server.port}")
    text = text.replace('"KVGW..."', json.dumps(ROOT_AK)).replace('"..."', json.dumps(ROOT_SK))
    text = text.replace('"/mnt/kvgw/fs"', json.dumps(str((server.data_dir / "fs").resolve())))
    doc = json.loads(text)
    doc["max_local_cpu_size"] = 0.1
    doc["local_cpu"] = False  # every get goes to kvgw
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump(doc))
    return LMCacheEngineConfig.from_file(str(path))


def round_trip(worker: le.Worker, backend: str, seed: int) -> None:
    keys = le.chunk_keys(3, seed=seed)
    objs = worker.allocate(3)
    digests = le.random_fill_many(objs, seed)
    worker.store(keys, objs)
    assert worker.wait_stored(backend, keys, timeout=30)
    assert worker.lookup(keys) == 3
    got = worker.retrieve(keys)
    assert [le.digest(o) for o in got] == digests
    le.release(got)


def test_the_docs_have_the_snippets_this_test_checks() -> None:
    assert len(yaml_snippets()) == 3 and len(l2_snippets()) == 2
    assert readme_yaml()["extra_config"]["remote_storage_plugin.kvgw.class_name"] == "KvgwConnector"


def test_remote_url_yaml_comes_first(shared_server: ServerProcess, tmp_path: Path, seed: int) -> None:
    doc = yaml_snippets()[0]
    assert doc["remote_url"] == f"http://{DOC_HOST}/kvcache" and doc["remote_storage_plugins"] == ["kvgw"]
    assert "kvgw.url" not in doc["extra_config"] and "kvgw.bucket" not in doc["extra_config"]
    worker = le.Worker(as_written(doc, shared_server, tmp_path, "127.0.0.1"), le.make_metadata(1))
    try:
        assert le.REMOTE_KVGW not in worker.storage.storage_backends  # one kvgw backend, remote_url's
        assert worker.backend(le.REMOTE_URL).connection is not None, "kvgw's adapter did not take remote_url"
        round_trip(worker, le.REMOTE_URL, seed)
    finally:
        worker.close()


@pytest.mark.parametrize("where", ["docs/lmcache.md", "README.md"])
def test_connector_yaml(shared_server: ServerProcess, tmp_path: Path, seed: int, where: str) -> None:
    doc = yaml_snippets()[1] if where == "docs/lmcache.md" else readme_yaml()
    assert doc["remote_storage_plugins"] == ["kvgw"]
    worker = le.Worker(as_written(doc, shared_server, tmp_path, "127.0.0.1"), le.make_metadata(1))
    try:
        assert worker.backend(le.REMOTE_KVGW).connection is not None, "the kvgw plugin did not load"
        round_trip(worker, le.REMOTE_KVGW, seed)
    finally:
        worker.close()


def test_s3_connector_yaml(s3_gateway: ServerProcess, vhost: str, tmp_path: Path, seed: int) -> None:
    doc = yaml_snippets()[2]
    assert doc["remote_url"].startswith("s3://kvcache.")
    text = json.dumps(doc).replace(f"kvcache.{DOC_HOST}", f"{vhost}:{s3_gateway.port}")
    worker = le.Worker(as_written(json.loads(text), s3_gateway, tmp_path, "127.0.0.1"), le.make_metadata(1))
    try:
        round_trip(worker, le.REMOTE_URL, seed)
    finally:
        worker.close()


@pytest.mark.parametrize("which", ["kvgw", "s3"])
def test_l2_adapter_json(
    shared_server: ServerProcess, request: pytest.FixtureRequest, seed: int, which: str
) -> None:
    spec = next(s for s in l2_snippets() if (s["type"] == "s3") == (which == "s3"))
    if which == "s3":
        server: ServerProcess = request.getfixturevalue("s3_gateway")
        vhost: str = request.getfixturevalue("vhost")
        text = json.dumps(spec).replace(f"kvcache.{DOC_HOST}", f"{vhost}:{server.port}")
    else:
        server = shared_server
        text = json.dumps(spec).replace(DOC_HOST, f"127.0.0.1:{server.port}")
    text = text.replace('"KVGW..."', json.dumps(ROOT_AK)).replace('"..."', json.dumps(ROOT_SK))
    driver = le.L2Driver(json.loads(text), chunk_mib=1, l1_bytes=32 << 20)
    try:
        keys = le.object_keys(3, seed=seed)
        objs = driver.allocate(3)
        digests = le.random_fill_many(objs, seed)
        assert driver.store(keys, objs).is_successful()
        driver.free(objs)
        assert driver.lookup(keys) == [True] * 3
        into = driver.allocate(3)
        assert driver.load(keys, into) == [True] * 3
        assert [le.digest(o) for o in into] == digests
        driver.unlock(keys)
        driver.free(into)
    finally:
        driver.close()

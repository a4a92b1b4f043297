"""LMCache's own S3 connector with ``disable_tls: false`` against kvgw serving https (``--tls-cert``).

LMCache's S3 connector (awscrt) trusts the system's certificate store, which awscrt reads from
``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` when set; so the worker runs in a subprocess whose environment
trusts the test CA, as an inference host would trust the CA that signed the gateway's certificate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, ROOT_AK, ROOT_SK, ServerProcess
from tests.integration.test_serve import make_tls

WORKER = r"""
import json, sys
from gateway.bench import lmcache_engine as le
url, ak, sk = sys.argv[1:4]
extra = {**le.s3_connector_extra(ak, sk), "disable_tls": False}
config = le.engine_config(cpu_gb=le.cpu_pool_gb(1, 4), extra=extra, remote_url=url)
worker = le.Worker(config, le.make_metadata(1))
try:
    keys = le.chunk_keys(3, seed=7)
    objs = worker.allocate(3)
    digests = le.random_fill_many(objs, 7)
    worker.store(keys, objs)
    stored = worker.wait_stored(le.REMOTE_URL, keys, timeout=60)
    found = worker.lookup(keys)
    got = worker.retrieve(keys)
    print(json.dumps({"stored": stored, "found": found, "same": [le.digest(o) for o in got] == digests}))
finally:
    worker.close()
"""


def test_s3_connector_over_https(server_factory: type[ServerProcess], tmp_path: Path, vhost: str) -> None:
    ca, cert, key = make_tls(tmp_path)
    server = server_factory(data_dir=tmp_path / "d", ca_file=ca, env={"KVGW_S3_API_BASE_DOMAIN": "localhost"},
                            extra_args=["--tls-cert", str(cert), "--tls-key", str(key)]).start()
    env = {**os.environ, "SSL_CERT_FILE": str(ca), "SSL_CERT_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", WORKER, f"s3://{vhost}:{server.port}", ROOT_AK, ROOT_SK],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"stored": True, "found": 3, "same": True}

#!/usr/bin/env bash
# Install LMCache on a CPU-only machine, for kvgw's LMCache connector, L2 adapter and their tests.
#
#   bash .ci/install-lmcache.sh                      # LMCache 0.5.6 into the `python` on PATH (or $PYTHON)
#   bash .ci/install-lmcache.sh 0.5.7rc2 DIR         # LMCache 0.5.7rc2 into a venv of its own at DIR,
#                                                    # with kvgw (client, server, test extras) beside it
#
# The second form is how CI tests both LMCache versions: the project's environment keeps 0.5.6, and
# DIR (created if missing, without --system-site-packages, so nothing of 0.5.6 leaks in) gets torch,
# that LMCache, the extras below and `pip install -e ./client -e ".[test]"`; .ci/run then runs the
# LMCache tests again with DIR/bin/python.
#
# Idempotent: pip skips what is already installed at these versions. Order matters:
#   1. torch first, pinned: 2.13.0 resolves to the local CPU build (+cpu wheel); an unpinned torch, or
#      letting lmcache's dependency list pull torch, downloads gigabytes of CUDA wheels.
#   2. lmcache with --no-deps: its declared dependencies include GPU-only packages (cupy, cufile,
#      nvtx, cuda-python) and torch itself.
#   3. only what LMCache's connector path imports on CPU; each package below was added after an import
#      of lmcache.v1.config, memory_management, utils, local_cpu_backend, connector, s3_connector or
#      remote_backend failed without it.
# `pip check` afterwards lists the GPU-only packages as missing; that is expected here.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION="${1:-0.5.6}"
VENV="${2:-}"
PYTHON="${PYTHON:-python}"
PIP_QUIET=(--disable-pip-version-check -q)

if [ -n "$VENV" ]; then
    if [ ! -x "$VENV/bin/python" ]; then
        "$PYTHON" -m venv "$VENV"
    fi
    PYTHON="$VENV/bin/python"
fi

# Refuse to fetch torch from the registry: if pip would install it from anywhere but a local wheel
# (file://), stop before downloading anything.
"$PYTHON" -m pip install "${PIP_QUIET[@]}" --dry-run --no-deps --report - "torch==2.13.0" | "$PYTHON" -c '
import json, sys
for item in json.load(sys.stdin).get("install", []):
    url = item["download_info"]["url"]
    if not url.startswith("file:"):
        sys.exit(f"torch 2.13.0 would come from {url}, not the local CPU build; refusing")
'
"$PYTHON" -m pip install "${PIP_QUIET[@]}" "torch==2.13.0"
"$PYTHON" -m pip install "${PIP_QUIET[@]}" --no-deps "lmcache==$VERSION"

extras=(
  # first importer on that path, as traced with LMCache 0.5.6 (0.5.7rc2 needs the same):
  PyYAML              # lmcache.v1.config_base (YAML configs); numba.core.config
  sortedcontainers    # lmcache.v1.memory_management
  cachetools          # lmcache.utils
  numpy               # lmcache.v1.platform.torch_ops and numba
  awscrt              # lmcache.v1.storage_backend.connector.s3_connector, imported with the connector package
  numba               # lmcache.v1.platform.torch_ops.cachegen_kernels
  requests            # lmcache.v1.config_base
  prometheus_client   # lmcache.observability (LMCStatsMonitor, PrometheusLogger used by RemoteBackend)
  py-cpuinfo          # lmcache.usage_telemetry.env_probe
  psutil              # lmcache.usage_telemetry.env_probe
  aiohttp             # lmcache.connections; also kvgw's own client (kvgw_client.http)
  aiofile             # lmcache.v1.storage_backend.gds_backend
  aiofiles            # lmcache's fs connector, imported when RemoteBackend discovers connector adapters
  msgspec             # lmcache.v1.cache_controller.executor
  pyzmq               # lmcache.v1.cache_controller.executor
  transformers        # lmcache.storage_backend.serde.cachegen_basics
  cryptography        # lmcache.v1.distributed.serde.aesgcm
  opentelemetry-api   # the multiprocess StorageManager (L2 adapters' tests); 0.5.7rc2 imports it too
)
"$PYTHON" -m pip install "${PIP_QUIET[@]}" "${extras[@]}"

if [ -n "$VENV" ]; then
    # kvgw itself, for the tests that run in this venv (they start `kvgw serve` with this python).
    "$PYTHON" -m pip install "${PIP_QUIET[@]}" -e ./client -e ".[test]"
fi

# Fail here, not in a test, if the connector path does not import (module paths as kvgw's plugins
# import them: lmcache.inprocess.* from 0.5.7 on).
"$PYTHON" - "$VERSION" <<'EOF'
import importlib
import importlib.metadata
import sys

import torch

assert torch.__version__.startswith("2.13.0"), torch.__version__
installed = importlib.metadata.version("lmcache")
assert installed == sys.argv[1], f"lmcache {installed} installed, {sys.argv[1]} wanted"
for name in (
    "lmcache.v1.config",
    "lmcache.v1.memory_management",
    "lmcache.v1.storage_backend.local_cpu_backend",
    "lmcache.v1.storage_backend.connector",
    "lmcache.v1.storage_backend.remote_backend",
    "lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter",
):
    importlib.import_module(name)
print("lmcache", installed, "with torch", torch.__version__, "imports fine")
EOF

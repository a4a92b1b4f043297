#!/usr/bin/env bash
# Install LMCache 0.5.6 on a CPU-only machine, for kvgw's LMCache connector, L2 adapter and their tests.
#
# Idempotent: pip skips what is already installed at these versions. Uses the `python` on PATH
# (override with PYTHON=...). Order matters:
#   1. torch first, pinned: 2.13.0 resolves to the local CPU build (+cpu wheel); an unpinned torch, or
#      letting lmcache's dependency list pull torch, downloads gigabytes of CUDA wheels.
#   2. lmcache with --no-deps: its declared dependencies include GPU-only packages (cupy, cufile,
#      nvtx, cuda-python) and torch itself.
#   3. only what LMCache's connector path imports on CPU; each package below was added after an import
#      of lmcache.v1.config, memory_management, utils, local_cpu_backend, connector, s3_connector or
#      remote_backend failed without it.
# `pip check` afterwards lists the GPU-only packages as missing; that is expected here.
set -euo pipefail

PYTHON="${PYTHON:-python}"

# Refuse to fetch torch from the registry: if pip would install it from anywhere but a local wheel
# (file://), stop before downloading anything.
"$PYTHON" -m pip install --dry-run --quiet --no-deps --report - "torch==2.13.0" | "$PYTHON" -c '
import json, sys
for item in json.load(sys.stdin).get("install", []):
    url = item["download_info"]["url"]
    if not url.startswith("file:"):
        sys.exit(f"torch 2.13.0 would come from {url}, not the local CPU build; refusing")
'
"$PYTHON" -m pip install "torch==2.13.0"
"$PYTHON" -m pip install --no-deps "lmcache==0.5.6"

extras=(
  # first importer on that path, as traced with LMCache 0.5.6:
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
  aiohttp             # lmcache.connections; also kvgw's own client (gateway.client.http)
  aiofile             # lmcache.v1.storage_backend.gds_backend
  aiofiles            # lmcache's fs connector, imported when RemoteBackend discovers connector adapters
  msgspec             # lmcache.v1.cache_controller.executor
  pyzmq               # lmcache.v1.cache_controller.executor
  transformers        # lmcache.storage_backend.serde.cachegen_basics
  cryptography        # lmcache.v1.distributed.serde.aesgcm
)
"$PYTHON" -m pip install "${extras[@]}"

# Fail here, not in a test, if the connector path does not import.
"$PYTHON" - <<'EOF'
import importlib

import torch

assert torch.__version__.startswith("2.13.0"), torch.__version__
for name in (
    "lmcache.v1.config",
    "lmcache.v1.memory_management",
    "lmcache.v1.storage_backend.local_cpu_backend",
    "lmcache.v1.storage_backend.connector",
    "lmcache.v1.storage_backend.remote_backend",
    "lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter",
):
    importlib.import_module(name)
print("lmcache", importlib.metadata.version("lmcache"), "with torch", torch.__version__, "imports fine")
EOF

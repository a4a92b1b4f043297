#!/usr/bin/env bash
# Install NVIDIA NIXL 1.5.1 on a CPU-only machine, for the object-store tier of vLLM's OffloadingConnector
# (vllm/v1/kv_offload/tiering/obj/, which drives NIXL's OBJ backend: aws-sdk-cpp inside the wheel) and
# the tests in tests/integration/vllm/ that drive that backend against kvgw's S3 API.
#
# Idempotent: pip skips what is already installed at these versions. Uses the `python` on PATH
# (override with PYTHON=...).
#   - nixl-cu12 holds the bindings and plugins (libplugin_OBJ.so with its own aws-sdk-cpp, 68 MB);
#     nixl is the meta package whose `nixl._api` picks that backend (what vLLM imports).
#   - --no-deps: nixl-cu12 declares torch (and nixl both CUDA builds); the OBJ backend with DRAM buffers
#     needs neither a GPU, CUDA nor torch, only numpy, so nothing else is pulled.
set -euo pipefail

PYTHON="${PYTHON:-python}"

"$PYTHON" -m pip install --disable-pip-version-check -q --no-deps "nixl-cu12==1.5.1" "nixl==1.5.1"
"$PYTHON" -m pip install --disable-pip-version-check -q numpy

# Fail here, not in a test, if the OBJ backend cannot be created (no server needed to create it).
"$PYTHON" - <<'EOF'
import importlib.metadata

from nixl._api import nixl_agent, nixl_agent_config

agent = nixl_agent("kvgw-install-check", nixl_agent_config(backends=[]))
assert "OBJ" in agent.get_plugin_list(), agent.get_plugin_list()
agent.create_backend("OBJ", {"bucket": "probe", "endpoint_override": "127.0.0.1:9", "scheme": "http",
                             "access_key": "x", "secret_key": "y", "region": "us-east-1"})
print("nixl", importlib.metadata.version("nixl-cu12"), "OBJ backend loads")
EOF

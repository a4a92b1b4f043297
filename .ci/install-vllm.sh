#!/usr/bin/env bash
# Install vLLM 0.33.0's KV-offloading code on a CPU-only machine, in a venv of its own, for kvgw's vLLM
# secondary tier (kvgw_client.vllm), the tests in tests/integration/vllm/ and `kvgw bench vllm`.
#
#   bash .ci/install-vllm.sh DIR        # DIR: the venv (created if missing, no --system-site-packages)
#
# Idempotent: pip skips what is already installed at these versions. Order matters
# (../shared/notes/vllm-0.33-tiering.md):
#   1. torch first, pinned: 2.13.0 resolves to the local CPU build (+cpu wheel). vLLM declares
#      torch==2.14.0; an unpinned torch, or letting vllm's dependency list pull torch, downloads
#      gigabytes of CUDA wheels. So nothing here lets pip resolve vllm's or torch's dependencies.
#   2. vllm with --no-deps; then, all --no-deps, the ~55 small packages its tiering, connector,
#      scheduler and KV-event modules import on CPU (the set below, pinned where vLLM 0.33.0 holds a
#      range: xgrammar, fastapi, llguidance, apache-tvm-ffi).
#   3. NIXL 1.5.1 (what vLLM's `obj` tier drives), --no-deps, as .ci/install-nixl.sh.
#   4. kvgw itself (client, server, test extras), so the tests that run in this venv start `kvgw serve`
#      with this python.
# The venv is ~2.4 GB; `vllm._C` is absent and `vllm.fs_io_C` fails to load (it needs CUDA libraries):
# vLLM's `fs` tier then takes its pure-Python I/O path. `pip check` lists what is missing: expected here.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${1:?usage: install-vllm.sh VENV_DIR}"
PYTHON="${PYTHON:-python3}"
PIP_QUIET=(--disable-pip-version-check -q)

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# Refuse to fetch torch from the registry: if pip would install it from anywhere but a local wheel
# (file://), stop before downloading anything.
"$PY" -m pip install "${PIP_QUIET[@]}" --dry-run --no-deps --report - "torch==2.13.0" | "$PY" -c '
import json, sys
for item in json.load(sys.stdin).get("install", []):
    url = item["download_info"]["url"]
    if not url.startswith("file:"):
        sys.exit(f"torch 2.13.0 would come from {url}, not the local CPU build; refusing")
'
"$PY" -m pip install "${PIP_QUIET[@]}" --no-deps "torch==2.13.0"
"$PY" -m pip install "${PIP_QUIET[@]}" --no-deps "vllm==0.33.0"

deps=(
  typing_extensions==4.16.0 numpy==2.4.6 packaging==26.4 msgspec==0.22.0 psutil==7.2.2 pyzmq==27.3.0
  regex==2026.11.19 urllib3==2.8.0 requests==2.34.2 idna==3.20 charset-normalizer==3.5.3
  certifi==2026.10.19.post1 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 transformers==5.20.2 huggingface_hub==2.4.0 tokenizers==0.23.3
  safetensors==0.8.0 tqdm==4.70.1 PyYAML==6.0.4 filelock==4.3.1 httpx2==2.16.2 httpcore2==2.16.2
  truststore==0.10.5 h11==0.16.0 sympy==1.14.0 mpmath==1.4.1 networkx==3.6.1 cbor2==6.3.0
  aiohttp==3.14.5 multidict==7.2.1 attrs==26.1.0 yarl==1.25.1 propcache==0.5.4 aiohappyeyeballs==2.7.1
  aiosignal==1.4.0 frozenlist==1.8.0 openai-harmony==0.0.8 openai==3.57.0 sniffio==1.3.1 anyio==4.16.0
  pillow==13.0.0 pybase64==1.5.1 cachetools==8.0.2 cloudpickle==3.1.3 uvloop==0.23.0 py-cpuinfo==9.0.0
  prometheus_client==0.26.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11 fastapi==0.136.3 starlette==1.10.0
  annotated-doc==0.0.7 partial-json-parser==0.2.1.1.post7 llguidance==1.7.6 einops==0.8.2
  fsspec jinja2 markupsafe hf-xet
)
"$PY" -m pip install "${PIP_QUIET[@]}" --no-deps "${deps[@]}"
"$PY" -m pip install "${PIP_QUIET[@]}" --no-deps "nixl-cu12==1.5.1" "nixl==1.5.1"

# kvgw itself: its dependencies resolve normally (none of them is torch or vllm).
"$PY" -m pip install "${PIP_QUIET[@]}" -e ./client -e ".[test]"

# Fail here, not in a test, if the tiering code (or kvgw's tier) does not import.
VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 "$PY" - <<'PY'
import importlib
import importlib.metadata

import torch

assert torch.__version__.startswith("2.13.0"), torch.__version__
installed = importlib.metadata.version("vllm")
assert installed == "0.33.0", installed
for name in (
    "vllm.v1.kv_offload.tiering.base",
    "vllm.v1.kv_offload.tiering.manager",
    "vllm.v1.kv_offload.tiering.spec",
    "vllm.v1.kv_offload.tiering.fs.manager",
    "vllm.v1.kv_offload.tiering.obj.manager",
    "vllm.distributed.kv_events",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    "vllm.v1.core.sched.scheduler",
    "kvgw_client.vllm",
    "nixl._api",
):
    importlib.import_module(name)
print("vllm", installed, "with torch", torch.__version__, "imports fine")
PY

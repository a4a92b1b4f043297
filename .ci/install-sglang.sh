#!/usr/bin/env bash
# Install SGLang 0.5.23's HiCache storage modules on a CPU-only machine, for kvgw's SGLang backend
# (kvgw_client.sglang), the tests in tests/integration/sglang/ and `kvgw bench sglang`.
#
# Idempotent: pip skips what is already installed at these versions. Uses the `python` on PATH
# (override with PYTHON=...). Order matters (../shared/notes/sglang-0.5.23.md):
#   1. torch first, pinned: 2.13.0 resolves to the local CPU build (+cpu wheel); an unpinned torch, or
#      letting sglang's dependency list pull torch (it pins 2.14.1), downloads gigabytes of CUDA wheels.
#   2. sglang with --no-deps: its declared dependencies are the whole GPU serving stack.
#   3. only what the storage path imports: hicache_storage.py and storage/backend_factory.py need only
#      torch; the seaweedfs (S3) backend needs msgspec (its config) and boto3 (its client); numpy is
#      used at run time (Tensor.numpy()).
# `import sglang` itself pulls in the serving runtime (triton, zmq, ...), which is not installed: the
# storage modules are imported the way gateway/bench/sglang_engine.py describes.
# SGLang's page hashes are its own C++ (JIT-built by torch.utils.cpp_extension): g++, ninja, libssl-dev.
set -euo pipefail

PYTHON="${PYTHON:-python}"
cd "$(dirname "$0")/.."

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
"$PYTHON" -m pip install --no-deps "sglang==0.5.23"
"$PYTHON" -m pip install msgspec boto3 numpy

for tool in g++ ninja; do
    command -v "$tool" >/dev/null || { echo "install-sglang: $tool is missing (SGLang's page hash is JIT-built C++)" >&2; exit 1; }
done
[ -f /usr/include/openssl/sha.h ] || { echo "install-sglang: libssl-dev is missing (openssl/sha.h)" >&2; exit 1; }

# Fail here, not in a test, if the storage path does not import; build the page hash once.
"$PYTHON" - <<'PY'
import importlib.metadata

import torch

from gateway.bench import sglang_engine as se

assert torch.__version__.startswith("2.13.0"), torch.__version__
se.load()
for name in se.STORAGE_MODULES:
    importlib.import_module(name)
import kvgw_client.sglang  # noqa: F401,E402

assert len(se.page_hashes(list(range(32)), 16)) == 2
print("sglang", importlib.metadata.version("sglang"), "with torch", torch.__version__, "imports fine")
PY

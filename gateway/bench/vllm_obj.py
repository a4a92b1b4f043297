"""vLLM's object-store KV tier, as it drives NVIDIA NIXL's OBJ backend, without vLLM, a GPU or torch.

vLLM's ``OffloadingConnector`` with ``"spec_name": "TieringOffloadingSpec"`` and a secondary tier
``{"type": "obj", "store_config": {...}, "prefix": ..., "io_threads": ...}`` builds
``ObjectStoreSecondaryTierManager`` (``vllm/v1/kv_offload/tiering/obj/manager.py``, vLLM 0.33.0), which:

* turns ``store_config`` into NIXL backend parameters (``obj/config.py``, ``ObjStoreConfig``): ``bucket``,
  ``endpoint_override``, ``scheme`` always; ``access_key``, ``secret_key``, ``session_token``, ``region``,
  ``ca_bundle`` only when non-empty (else aws-sdk-cpp's default chain: ``AWS_ACCESS_KEY_ID``...), plus
  ``num_threads`` = ``io_threads``;
* creates one agent (``nixl_agent("ObjAgent", nixl_agent_config(backends=[]))``) and the ``OBJ`` backend,
  probes ``__nixl_probe__/connectivity_test`` with ``query_memory`` (a HEAD), registers its CPU KV buffer
  as ``DRAM`` and preps one descriptor per CPU-tier chunk;
* looks blocks up with one ``query_memory`` of (0, 1, 0, key) descriptors per batch: a HEAD per key
  (an answer of None is a miss);
* stores and loads with ``register_memory`` of (0, chunk bytes, dev id, key) ``OBJ`` descriptors (dev ids
  unique, from 1), ``prep_xfer_dlist``, ``make_prepped_xfer("WRITE" | "READ", ...)``, ``transfer``, then
  polls ``check_xfer_state`` until ``DONE`` (or ``ERR``) and releases everything; it never deletes.

``ObjTier`` does exactly that with a DRAM buffer of its own, so tests and benchmarks put the same
requests on the wire as vLLM. ``object_key`` builds vLLM's key (``vllm/v1/kv_offload/file_mapper.py``,
``parallel_agnostic``): ``{prefix}/{model, "/" -> "_"}_{sha256(fields)[:12]}_r0/{h[:3]}/{h[3:5]}_g{group}/{h}.bin``
where ``h`` is the block hash in hex; aws-sdk-cpp drops empty path segments, so the object kvgw stores has
no leading ``/`` (and no ``//`` after a prefix): ``stored_name`` gives that name.

Importing this module does not import NIXL; ``ObjTier`` does (``nixl._api``, as vLLM does).
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

NIXL_AGENT = "ObjAgent"
PROBE_KEY = "__nixl_probe__/connectivity_test"
STORE_CONFIG_FIELDS = ("bucket", "endpoint_override", "access_key", "secret_key", "session_token", "region",
                       "scheme", "ca_bundle")
"""The fields of vLLM 0.33.0's ``ObjStoreConfig``: any other key in ``store_config`` fails vLLM's start."""
OPTIONAL_FIELDS = ("access_key", "secret_key", "session_token", "region", "ca_bundle")


def nixl_params(store_config: Mapping[str, Any], io_threads: int = 4) -> dict[str, str]:
    """The NIXL ``OBJ`` backend parameters vLLM 0.33.0 builds from a tier's ``store_config``."""
    unknown = set(store_config) - set(STORE_CONFIG_FIELDS)
    if unknown:
        raise TypeError(f"vLLM's ObjStoreConfig takes no {sorted(unknown)}")
    params = {"bucket": str(store_config["bucket"]), "endpoint_override": str(store_config["endpoint_override"]),
              "scheme": str(store_config.get("scheme", "http"))}
    for key in OPTIONAL_FIELDS:
        value = store_config.get(key)
        if value:
            params[key] = str(value)
    params["num_threads"] = str(io_threads)
    return params


@dataclass(frozen=True)
class KeyForm:
    """What vLLM's FileMapper hashes into the object name (a parallelism-agnostic obj tier)."""

    model_name: str = "Qwen/Qwen3-8B"
    tokens_per_hash: int = 16
    blocks_per_file: int = 1
    dtype: str = "bfloat16"
    groups: tuple[tuple[int, tuple[str, ...]], ...] = ((16, ("model.layers.0.self_attn.attn",)),)
    prefix: str = ""

    def base(self) -> str:
        fields = {
            "model_name": self.model_name, "tokens_per_hash": self.tokens_per_hash,
            "blocks_per_file": self.blocks_per_file, "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1,
            "dtype": self.dtype,
            "kv_cache_groups": [{"tokens_per_block": t, "layer_names": list(names)} for t, names in self.groups],
            "inference_engine": "vllm",
        }
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]
        root = f"{self.prefix}/" if self.prefix else ""
        return f"{root}/{self.model_name.replace('/', '_')}_{digest}"

    def object_key(self, block_hash: bytes, group: int = 0) -> str:
        h = block_hash.hex()
        return f"{self.base()}_r0/{h[:3]}/{h[3:5]}_g{group}/{h}.bin"


def stored_name(object_key: str) -> str:
    """The key kvgw stores: aws-sdk-cpp sends the object key with empty path segments dropped."""
    return "/".join(part for part in object_key.split("/") if part)


@dataclass
class ObjTier:
    """One vLLM worker's object tier: a DRAM buffer of ``blocks`` chunks of ``block_bytes`` each, and the
    NIXL agent and ``OBJ`` backend vLLM makes for it. ``backend_params`` are extra NIXL parameters vLLM
    0.33.0 cannot pass (``crtMinLimit``, ``req_checksum``...), for tests of those modes."""

    store_config: Mapping[str, Any]
    block_bytes: int
    blocks: int
    io_threads: int = 4
    backend_params: Mapping[str, str] = field(default_factory=dict)
    probe: bool = True
    timeout: float = 120.0
    buffer: bytearray = field(init=False)

    def __post_init__(self) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self._np = __import__("numpy")
        self.buffer = bytearray(self.block_bytes * self.blocks)
        self.agent: Any = nixl_agent(NIXL_AGENT, nixl_agent_config(backends=[], capture_telemetry=True))
        self.agent.create_backend("OBJ", {**nixl_params(self.store_config, self.io_threads), **self.backend_params})
        self._next_dev_id = 1  # 0 is the lookups'
        if self.probe:
            self.lookup([PROBE_KEY])  # vLLM's start-up probe: an exception fails the start
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))
        self._reg = self.agent.register_memory([(base, len(self.buffer), 0, "")], "DRAM")
        self._dram = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [(base + i * self.block_bytes, self.block_bytes, 0) for i in range(self.blocks)], "DRAM"
        )

    def view(self, block: int) -> memoryview:
        return memoryview(self.buffer)[block * self.block_bytes : (block + 1) * self.block_bytes]

    def lookup(self, keys: Sequence[str]) -> list[bool]:
        """One ``query_memory``: a HEAD per key, in parallel on the backend's threads."""
        results = self.agent.query_memory([(0, 1, 0, k) for k in keys], "OBJ", "OBJ")
        return [r is not None for r in results]

    def store(self, blocks: Sequence[int], keys: Sequence[str]) -> str:
        return self._transfer("WRITE", blocks, keys)

    def load(self, blocks: Sequence[int], keys: Sequence[str]) -> str:
        return self._transfer("READ", blocks, keys)

    def _transfer(self, op: str, blocks: Sequence[int], keys: Sequence[str]) -> str:
        """One vLLM store/load job: ``DONE`` or the failing state (``ERR``, or ``register``/``prep``/``make``
        when NIXL refused to set the transfer up)."""
        np = self._np
        descs = [(0, self.block_bytes, dev, key) for dev, key in enumerate(keys, self._next_dev_id)]
        self._next_dev_id += len(descs)
        files = self.agent.register_memory(descs, "OBJ")
        if files is None:
            return "register"
        handle = self.agent.prep_xfer_dlist(NIXL_AGENT, files.trim())
        if not handle:
            self.agent.deregister_memory(files)
            return "prep"
        xfer = self.agent.make_prepped_xfer(op, self._dram, np.asarray(blocks, dtype=np.int32), handle,
                                            np.arange(len(descs), dtype=np.int32))
        if not xfer:
            self.agent.release_dlist_handle(handle)
            self.agent.deregister_memory(files)
            return "make"
        try:
            state = self.agent.transfer(xfer)
            deadline = time.monotonic() + self.timeout
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"NIXL {op} of {len(descs)} objects did not finish in {self.timeout}s")
                time.sleep(0.0005)
                try:
                    state = self.agent.check_xfer_state(xfer)
                except Exception:  # NIXL raises for a failed transfer; vLLM counts that as a failed job
                    return "ERR"
            return str(state)
        finally:
            self.agent.release_xfer_handle(xfer)
            self.agent.release_dlist_handle(handle)
            self.agent.deregister_memory(files)

    def close(self) -> None:
        """Release the DRAM registration and drop the agent, whose destructor stops NIXL's threads (a
        process that forks later must not carry them along)."""
        agent = getattr(self, "agent", None)
        if agent is None:
            return
        if getattr(self, "_dram", None) is not None:
            agent.release_dlist_handle(self._dram)
            self._dram = None
        if getattr(self, "_reg", None) is not None:
            agent.deregister_memory(self._reg)
            self._reg = None
        self.agent = None
        del agent
        gc.collect()

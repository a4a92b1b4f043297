"""SGLang 0.5.23's HiCache storage on CPU: its storage modules, its page hashes, host pools with the real
pools' shapes, and the cache controller's storage loops. Shared by ``kvgw bench sglang`` and the tests in
``tests/integration/sglang/`` (as ``lmcache_engine`` is for LMCache).

Importing: ``import sglang`` runs ``sglang/__init__.py``, which imports the serving runtime (triton, zmq,
...) that a CPU machine does not have (``../shared/notes/sglang-0.5.23.md``). ``load()`` puts empty
package objects for ``sglang`` and ``sglang.srt.utils`` into ``sys.modules`` (their ``__path__`` the
installed directories), so those two ``__init__`` files are skipped and every storage module imports
unchanged from its own file; the factory's ``importlib.import_module`` of a dynamic backend then works
as it does inside SGLang. (In a real SGLang process none of this is needed.)

Host pools: ``MHATokenToKVPoolHost`` (``mem_cache/pool_host/mha.py``) and ``MLATokenToKVPoolHost``
(``pool_host/mla.py``) need a device pool to be built; their storage-facing surface does not.
``MHAHostPool`` / ``MLAHostPool`` allocate ``kv_buffer`` with the dims of ``init_kv_buffer`` for each
layout and copy, formula for formula, the methods storage backends call: ``get_page_buffer_meta`` (the
zero-copy interface), ``get_data_page`` / ``get_dummy_flat_data_page`` / ``set_from_flat_data_page``
(the generic one), plus the page allocator the cache controller takes host indices from.

Controller loops (``managers/cache_controller.py``): ``backup`` (``_page_backup``), ``hit_query``
(``_storage_hit_query``), ``transfer`` (``_page_transfer``), one backend call per batch of 128 pages.
"""

from __future__ import annotations

import argparse
import ast
import decimal
import importlib
import importlib.machinery
import importlib.util
import os
import re
import sys
import types
from typing import Any

import torch

SGLANG_VERSION = "0.5.23"
STORAGE_MODULES = (
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.mem_cache.storage.backend_factory",
    "sglang.srt.mem_cache.storage.seaweedfs.seaweedfs_store",
    "sglang.srt.mem_cache.storage.file.lru_file_evictor",
)


def installed() -> bool:
    return importlib.util.find_spec("sglang") is not None


def load() -> types.SimpleNamespace:
    """Import SGLang's storage modules (idempotent); raises ImportError when SGLang is missing."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed")
    root = next(iter(spec.submodule_search_locations))
    for name, path in (("sglang", root), ("sglang.srt.utils", os.path.join(root, "srt", "utils"))):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [path]
            pkg.__file__ = os.path.join(path, "__init__.py")
            pkg.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            pkg.__spec__.submodule_search_locations = [path]
            sys.modules[name] = pkg
    if "sglang.srt.utils.common" not in sys.modules:
        sys.modules["sglang.srt.utils.common"] = _utils_common(os.path.join(root, "srt", "utils", "common.py"))
    storage = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
    factory = importlib.import_module("sglang.srt.mem_cache.storage.backend_factory")
    return types.SimpleNamespace(storage=storage, factory=factory.StorageBackendFactory)


def _utils_common(path: str) -> types.ModuleType:
    """``sglang.srt.utils.common`` as the storage modules see it. The real module imports the serving
    runtime (triton, PIL, starlette, ...); the file backend's evictor needs one pure function from it,
    ``human_readable_int``, so that function's own source is taken from SGLang's file and run alone."""
    try:
        spec = importlib.util.spec_from_file_location("sglang.srt.utils.common", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except ImportError:
        pass
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    wanted: list[ast.stmt] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "human_readable_int"]
    module = types.ModuleType("sglang.srt.utils.common")
    module.__file__ = path
    namespace: dict[str, Any] = module.__dict__
    namespace.update(re=re, argparse=argparse, Decimal=decimal.Decimal)
    exec(compile(ast.Module(body=wanted, type_ignores=[]), path, "exec"), namespace)
    return module


def page_hashes(tokens: list[int], page_size: int, prior: str | None = None) -> list[str]:
    """SGLang's storage keys for ``tokens``: one 64-hex chained SHA-256 per full page, computed by its
    own native hash (``mem_cache/cpp_utils``, JIT-built once per machine with g++ and libssl)."""
    load()
    from sglang.srt.mem_cache.cpp_utils.native_hash import get_native_hash

    digest = bytes.fromhex(prior) if prior else None
    hashes = get_native_hash(tokens, digest, page_size)
    assert isinstance(hashes, list)
    return hashes


def storage_config(*, extra: dict[str, Any], model: str = "Qwen/Qwen3-8B", tp_rank: int = 0, tp_size: int = 1,
                   is_mla: bool = False, page_first: bool = True, metrics: bool = False, **fields: Any) -> Any:
    """A ``HiCacheStorageConfig`` as the cache controller builds it (``_generate_storage_config``)."""
    sg = load()
    return sg.storage.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=fields.pop("pp_rank", 0), pp_size=fields.pop("pp_size", 1),
        attn_cp_rank=0, attn_cp_size=1, is_mla_model=is_mla, enable_storage_metrics=metrics,
        is_page_first_layout=page_first, model_name=model, extra_config=dict(extra), **fields,
    )


def attach(backend_name: str, config: Any, pool: Any) -> Any:
    """What ``HiCacheController.attach_storage_backend`` does: the factory, then the host pool."""
    sg = load()
    backend = sg.factory.create_backend(backend_name, config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


# -- the cache controller's storage loops (managers/cache_controller.py), one backend call per batch ---------

BATCH = 128  # hicache_storage.STORAGE_BATCH_SIZE


def extra_info(prefix_keys: list[str] | None) -> Any:
    return load().storage.HiCacheStorageExtraInfo(prefix_keys=prefix_keys)


def backup(backend: Any, pool: Any, hashes: list[str], host_indices: Any, *, zero_copy: bool = True,
           prefix_keys: list[str] | None = None) -> int:
    """``_page_backup``: batches of 128 through ``_page_set_zero_copy`` (``batch_set_v1``) or
    ``_generic_page_set`` (flat pages, ``batch_set``); stops at the first failed batch. Returns the
    pages backed up."""
    done = 0
    ps = pool.page_size
    for i in range(0, len(hashes), BATCH):
        batch = hashes[i : i + BATCH]
        indices = host_indices[i * ps : (i + len(batch)) * ps]
        info = extra_info(prefix_keys)
        if zero_copy:
            ok = all(backend.batch_set_v1(batch, indices, info))
        else:
            ok = backend.batch_set(batch, [pool.get_data_page(indices[j * ps]) for j in range(len(batch))])
        if not ok:
            break
        if prefix_keys is not None:
            prefix_keys = prefix_keys + batch
        done += len(batch)
    return done


def hit_query(backend: Any, hashes: list[str], *, prefix_keys: list[str] | None = None) -> int:
    """``_storage_hit_query``: ``batch_exists`` per batch of 128 until a batch is not all hits."""
    hits = 0
    for start in range(0, len(hashes), BATCH):
        batch = hashes[start : start + BATCH]
        found = backend.batch_exists(batch, extra_info(prefix_keys))
        hits += found
        if found < len(batch):
            break
        if prefix_keys is not None:
            prefix_keys = prefix_keys + batch
    return hits


def transfer(backend: Any, pool: Any, hashes: list[str], host_indices: Any, *, zero_copy: bool = True,
             prefix_keys: list[str] | None = None) -> int:
    """``_page_transfer``: ``_page_get_zero_copy`` (``batch_get_v1``, counting the leading run) or
    ``_generic_page_get`` (``batch_get`` into dummy flat pages, then ``set_from_flat_data_page``) per
    batch of 128, until a batch falls short. Returns the pages loaded."""
    done = 0
    ps = pool.page_size
    for i in range(0, len(hashes), BATCH):
        batch = hashes[i : i + BATCH]
        indices = host_indices[i * ps : (i + len(batch)) * ps]
        info = extra_info(prefix_keys)
        hits = 0
        if zero_copy:
            results = backend.batch_get_v1(batch, indices, info)
            for ok in results:
                if not ok:
                    break
                hits += 1
        else:
            pages = backend.batch_get(batch, [pool.get_dummy_flat_data_page() for _ in batch])
            for j, page in enumerate(pages or []):
                if page is None:
                    break
                pool.set_from_flat_data_page(int(indices[j * ps]), page)
                hits += 1
        done += hits
        if hits != len(batch):
            break
        if prefix_keys is not None:
            prefix_keys = prefix_keys + batch
    return done


# -- host pools --------------------------------------------------------------------------------------

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class _Pages:
    """Page-granular allocator over ``size`` tokens (``HostKVCache.alloc`` / ``free``)."""

    def __init__(self, size: int, page_size: int) -> None:
        self.size = size
        self.page_size = page_size
        self.page_num = size // page_size
        self._free = list(range(self.page_num))

    def alloc(self, need_size: int) -> torch.Tensor | None:
        pages = need_size // self.page_size
        if need_size % self.page_size or pages > len(self._free):
            return None
        taken, self._free = self._free[:pages], self._free[pages:]
        return torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in taken]) if taken \
            else torch.empty(0, dtype=torch.int64)

    def free(self, indices: torch.Tensor) -> int:
        self._free.extend(sorted({int(i) // self.page_size for i in indices.tolist()}))
        return len(indices)

    def available_size(self) -> int:
        return len(self._free) * self.page_size


class MHAHostPool(_Pages):
    """``MHATokenToKVPoolHost`` on CPU: K and V for ``layer_num`` layers of ``head_num`` heads."""

    def __init__(self, layout: str, *, layer_num: int = 4, head_num: int = 2, head_dim: int = 64,
                 page_size: int = 16, pages: int = 300, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(pages * page_size, page_size)
        self.layout = layout
        self.layer_num, self.head_num, self.head_dim, self.v_head_dim = layer_num, head_num, head_dim, head_dim
        self.dtype = dtype
        self.device = "cpu"
        self.pin_memory = False
        if layout == "layer_first":
            dims: tuple[int, ...] = (2, layer_num, self.size, head_num, head_dim)
        elif layout == "page_first":
            dims = (2, self.size, layer_num, head_num, head_dim)
        elif layout == "page_first_direct":
            dims = (2, self.page_num, layer_num, page_size, head_num, head_dim)
        elif layout == "page_head":
            dims = (2, self.page_num, head_num, page_size, layer_num, head_dim)
        else:
            raise ValueError(f"Unsupported layout: {layout}")
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    @property
    def page_bytes(self) -> int:
        return 2 * self.layer_num * self.page_size * self.head_num * self.head_dim * self.dtype.itemsize

    def get_size_per_token(self) -> int:
        return (self.head_dim + self.v_head_dim) * self.head_num * self.layer_num * self.dtype.itemsize

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        ptr_list = []
        kv_buffer_data_ptr = self.kv_buffer.data_ptr()
        idx = indices.tolist()
        itemsize = self.dtype.itemsize
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * itemsize
        if self.layout == "layer_first":
            for index in range(0, len(idx), self.page_size):
                for layer_id in range(self.layer_num):
                    k_ptr = (kv_buffer_data_ptr + idx[index] * self.head_num * self.head_dim * itemsize
                             + layer_id * self.size * self.head_num * self.head_dim * itemsize)
                    ptr_list.append(k_ptr)
                    ptr_list.append(k_ptr + v_offset)
            element_size = itemsize * self.page_size * self.head_num * self.head_dim
        elif self.layout in ("page_first", "page_first_direct", "page_head"):
            for index in range(0, len(idx), self.page_size):
                k_ptr = kv_buffer_data_ptr + idx[index] * self.layer_num * self.head_num * self.head_dim * itemsize
                ptr_list.append(k_ptr)
                ptr_list.append(k_ptr + v_offset)
            element_size = self.layer_num * itemsize * self.page_size * self.head_num * self.head_dim
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        return ptr_list, [element_size] * len(ptr_list)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, :, index : index + self.page_size, :, :]
        elif self.layout == "page_first":
            data_page = self.kv_buffer[:, index : index + self.page_size, :, :, :]
        else:
            real_index = index // self.page_size
            data_page = self.kv_buffer[:, real_index : real_index + 1, :, :, :, :]
        return data_page.flatten() if flat else data_page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        ps, ln, hn, hd = self.page_size, self.layer_num, self.head_num, self.head_dim
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index : index + ps, :, :] = data_page.reshape(2, ln, ps, hn, hd)
        elif self.layout == "page_first":
            self.kv_buffer[:, index : index + ps, :, :, :] = data_page.reshape(2, ps, ln, hn, hd)
        elif self.layout == "page_first_direct":
            real_index = index // ps
            self.kv_buffer[:, real_index : real_index + 1] = data_page.reshape(2, 1, ln, ps, hn, hd)
        elif self.layout == "page_head":
            real_index = index // ps
            self.kv_buffer[:, real_index : real_index + 1] = data_page.reshape(2, 1, hn, ps, ln, hd)
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")

    def page_tensor(self, host_index: int) -> torch.Tensor:
        """Every element of the page starting at token ``host_index`` (for comparisons)."""
        return self.get_data_page(host_index, flat=True).clone()


class MLAHostPool(_Pages):
    """``MLATokenToKVPoolHost`` on CPU: one latent row (``kv_cache_dim``) per layer and token."""

    def __init__(self, layout: str, *, layer_num: int = 4, kv_cache_dim: int = 576, page_size: int = 16,
                 pages: int = 300, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(pages * page_size, page_size)
        self.layout = layout
        self.layer_num, self.kv_cache_dim = layer_num, kv_cache_dim
        self.dtype = dtype
        self.device = "cpu"
        self.pin_memory = False
        if layout == "layer_first":
            dims: tuple[int, ...] = (layer_num, self.size, 1, kv_cache_dim)
        elif layout == "page_first":
            dims = (self.size, layer_num, 1, kv_cache_dim)
        elif layout == "page_first_direct":
            dims = (self.page_num, layer_num, page_size, 1, kv_cache_dim)
        else:
            raise ValueError(f"Unsupported layout: {layout}")
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    @property
    def page_bytes(self) -> int:
        return self.layer_num * self.page_size * self.kv_cache_dim * self.dtype.itemsize

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        ptr_list = []
        base = self.kv_buffer.data_ptr()
        itemsize = self.dtype.itemsize
        page_starts = indices.tolist()[:: self.page_size]
        if self.layout == "layer_first":
            for index in page_starts:
                for layer_id in range(self.layer_num):
                    ptr_list.append(base + index * self.kv_cache_dim * itemsize
                                    + layer_id * self.size * self.kv_cache_dim * itemsize)
            element_size = itemsize * self.page_size * self.kv_cache_dim
        else:
            for index in page_starts:
                ptr_list.append(base + index * self.layer_num * self.kv_cache_dim * itemsize)
            element_size = self.layer_num * itemsize * self.page_size * self.kv_cache_dim
        return ptr_list, [element_size] * len(ptr_list)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, index : index + self.page_size, :, :]
        elif self.layout == "page_first":
            data_page = self.kv_buffer[index : index + self.page_size, :, :, :]
        else:
            real_index = index // self.page_size
            data_page = self.kv_buffer[real_index : real_index + 1, :, :, :, :]
        return data_page.flatten() if flat else data_page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((self.layer_num, self.page_size, 1, self.kv_cache_dim), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        ps, ln, d = self.page_size, self.layer_num, self.kv_cache_dim
        if self.layout == "layer_first":
            self.kv_buffer[:, index : index + ps, :, :] = data_page.reshape(ln, ps, 1, d)
        elif self.layout == "page_first":
            self.kv_buffer[index : index + ps, :, :, :] = data_page.reshape(ps, ln, 1, d)
        else:
            real_index = index // ps
            self.kv_buffer[real_index : real_index + 1] = data_page.reshape(1, ln, ps, 1, d)

    def page_tensor(self, host_index: int) -> torch.Tensor:
        return self.get_data_page(host_index, flat=True).clone()


def fill_pages(pool: Any, host_indices: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """Write distinct random values into each page of ``host_indices``; returns each page's contents."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for start in range(0, len(host_indices), pool.page_size):
        index = int(host_indices[start])
        page = torch.randn(pool.get_dummy_flat_data_page().shape, generator=gen).to(pool.dtype)
        pool.set_from_flat_data_page(index, page)
        out.append(pool.page_tensor(index))
    return out

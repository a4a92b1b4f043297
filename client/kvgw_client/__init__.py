"""kvgw-client: what runs inside inference processes and benchmarks, never in the server.

A distribution of its own (``client/pyproject.toml``), so an inference host installs it without the
server's dependencies: aiohttp and xxhash are all it needs; engine integrations are extras. The server
depends on it for the one definition of the wire format (``wire``) and the key rules (``keys``).

* ``http``: ``KvgwClient``, the one client of the native chunk API (pool, quiet mode); ``policy``: its
  retries, circuit and error translation; ``blocking``: its calls for plain threads.
* ``prefetch``: ``Prefetcher``, the bounded CPU staging buffer fed by prefix + batch-get.
* ``framing``: ``BatchReader``, batch-get frames copied straight into caller buffers.
* ``direct``: ``DirectReader``, chunk files read straight from a mounted filesystem tier.
* ``lmcache.connector``: ``KvgwConnector`` for LMCache's ``remote_storage_plugins`` (imports lmcache).
* ``lmcache.l2_adapter``: ``KvgwNativeClient`` / ``KvgwL2Adapter`` for LMCache's multiprocess server
  (imports lmcache).
* ``sglang``: ``KvgwHiCacheStorage``, SGLang's HiCache L3 storage backend (imports sglang and torch);
  ``hicache``: its settings, page names and page buffers (imports neither).

This module imports nothing, so ``import kvgw_client.http`` never pulls in LMCache or SGLang.
"""

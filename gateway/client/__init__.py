"""Client side of kvgw: what runs inside inference processes and benchmarks, never in the server.

Shares only ``gateway.wire`` and ``gateway.keys`` with the server, so it installs without the server's
dependencies (aiohttp and xxhash are all it needs).

* ``http``: ``KvgwClient``, the one client of the native chunk API (pool, quiet mode); ``policy``: its
  retries, circuit and error translation; ``blocking``: its calls for plain threads.
* ``prefetch``: ``Prefetcher``, the bounded CPU staging buffer fed by prefix + batch-get.
* ``framing``: ``BatchReader``, batch-get frames copied straight into caller buffers.
* ``lmcache_connector``: ``KvgwConnector`` for LMCache's ``remote_storage_plugins`` (imports lmcache).
* ``l2_adapter``: ``KvgwNativeClient`` / ``KvgwL2Adapter`` for LMCache's multiprocess server (imports lmcache).

This module imports nothing, so ``import gateway.client.http`` never pulls in LMCache.
"""

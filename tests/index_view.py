"""A read-only look into a running gateway's LMDB index, for what the API does not show (the parent a
PUT recorded, a chunk's expiry). LMDB readers in another process see every committed write."""

from __future__ import annotations

from pathlib import Path

import lmdb

from backends.index import IndexEntry
from kvgw_client.keys import chunk_digest


class IndexView:
    def __init__(self, data_dir: Path) -> None:
        self._env = lmdb.open(str(data_dir / "index"), readonly=True, max_dbs=8, lock=True, readahead=False)
        self._chunks = self._env.open_db(b"chunks", create=False)
        self._parents = self._env.open_db(b"parents", create=False)

    def entry(self, key: str, bucket: str = "kvcache") -> IndexEntry | None:
        with self._env.begin(db=self._chunks) as txn:
            raw = txn.get(chunk_digest(bucket, key))
        return None if raw is None else IndexEntry.unpack(raw)

    def parent(self, key: str, bucket: str = "kvcache") -> bytes | None:
        """The digest of the X-Kvgw-Parent the chunk was stored with (compare with ``digest(parent)``)."""
        with self._env.begin(db=self._parents) as txn:
            raw = txn.get(chunk_digest(bucket, key))
        return None if raw is None else bytes(raw)

    @staticmethod
    def digest(key: str, bucket: str = "kvcache") -> bytes:
        return chunk_digest(bucket, key)

    def close(self) -> None:
        self._env.close()

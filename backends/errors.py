"""Errors raised by storage backends (tiers, index, catalog). Imports nothing from the project.

Every tier translates its foreign errors (OSError, botocore errors, timeouts) into this tree at its own
boundary, most specific first, with ``raise ... from exc``; the service maps this tree to domain errors
and the APIs map those to status codes. Nothing above a backend inspects errno or botocore codes.

    BackendError
    ├── ChunkNotFound          the tier has no such chunk
    ├── UploadNotFound         the multipart staging area has no such upload (or no such part)
    ├── ChunkExists            create-if-absent lost: the chunk was already published
    ├── ChunkCorrupt           stored bytes do not match their recorded checksum / size
    ├── StorageFull            no space left (ENOSPC, EDQUOT, quota)
    ├── TierUnavailable        the tier cannot be reached now (dead S3 endpoint, timeouts)
    │   └── ChunkHidden        the chunk's file is in its directory, but this host's lookups do not
    │                          see it yet (an NFS or FUSE negative lookup cache): try again later
    └── IndexError_            the LMDB index failed in a way a retry will not fix
"""

from __future__ import annotations


class BackendError(Exception):
    """Base of every backend failure."""


class ChunkNotFound(BackendError):
    pass


class UploadNotFound(BackendError):
    pass


class ChunkExists(BackendError):
    pass


class ChunkCorrupt(BackendError):
    def __init__(self, message: str, *, location: str = "") -> None:
        super().__init__(message)
        self.location = location


class StorageFull(BackendError):
    pass


class TierUnavailable(BackendError):
    pass


class ChunkHidden(TierUnavailable):
    """Never "not found": the chunk exists (its directory lists it), so nobody may forget it or report
    it removed; a TierUnavailable, so every caller already waits and retries (503 to a client)."""


class IndexError_(BackendError):
    pass

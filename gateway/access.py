"""Who is calling and what they may do: credentials and buckets as an in-memory view of the catalog.

Both APIs authenticate against this view (Bearer tokens here, SigV4 in the S3 API) and authorize
through ``Directory.authorize``, so the rules live in one place:

- root credentials may do everything;
- other credentials may read / write the buckets they have grants on;
- anonymous requests may do what the bucket's policy grants anonymous users, and everything when the
  gateway runs with ``--anonymous`` (local use);
- anonymous without rights is 401 (credentials would help), authenticated without rights is 403.

The view is refreshed from the catalog every few seconds (gateways sharing a PostgreSQL catalog see
each other's changes) and at once when a request names a bucket the view does not know.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import time
from dataclasses import dataclass, field

from backends.catalog.store import BucketPolicy, Catalog, CredentialRecord
from gateway.errors import AccessDenied, NoSuchBucket, Unauthorized


class Action(enum.Enum):
    READ = "read"
    WRITE = "write"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class Principal:
    access_key: str | None  # None: anonymous
    is_root: bool = False
    grants: dict[str, tuple[bool, bool]] = field(default_factory=dict)


ANONYMOUS = Principal(access_key=None)
ANONYMOUS_ROOT = Principal(access_key=None, is_root=True)


class Directory:
    """Buckets and credentials, cached from the catalog."""

    def __init__(self, catalog: Catalog, *, anonymous_is_root: bool, refresh_seconds: float) -> None:
        self._catalog = catalog
        self._anonymous = ANONYMOUS_ROOT if anonymous_is_root else ANONYMOUS
        self._refresh_seconds = refresh_seconds
        self._buckets: dict[str, BucketPolicy] = {}
        self._credentials: dict[str, CredentialRecord] = {}
        self._loaded_at = 0.0
        self._lock = asyncio.Lock()

    @property
    def anonymous(self) -> Principal:
        return self._anonymous

    def load(self) -> None:
        """Blocking reload from the catalog (start-up, CLI, worker thread)."""
        buckets = {b.name: b for b in self._catalog.list_buckets()}
        credentials = {c.access_key: c for c in self._catalog.credentials()}
        self._buckets, self._credentials = buckets, credentials
        self._loaded_at = time.monotonic()

    async def refresh(self, *, min_age: float = 0.0) -> None:
        async with self._lock:
            if time.monotonic() - self._loaded_at >= min_age:
                await asyncio.to_thread(self.load)

    def stale(self) -> bool:
        return time.monotonic() - self._loaded_at >= self._refresh_seconds

    # -- buckets -------------------------------------------------------------------------------

    def buckets(self) -> list[BucketPolicy]:
        return sorted(self._buckets.values(), key=lambda b: b.name)

    async def bucket(self, name: str) -> BucketPolicy:
        policy = self._buckets.get(name)
        if policy is None:
            await self.refresh(min_age=0.5)  # maybe created by another gateway a moment ago
            policy = self._buckets.get(name)
            if policy is None:
                raise NoSuchBucket(f"bucket {name!r} does not exist")
        return policy

    # -- credentials ---------------------------------------------------------------------------

    def secret_for(self, access_key: str) -> str | None:
        record = self._credentials.get(access_key)
        return None if record is None or record.disabled else record.secret

    def principal_for(self, access_key: str) -> Principal:
        record = self._credentials[access_key]
        return Principal(access_key=access_key, is_root=record.is_root, grants=record.grants)

    def authenticate_bearer(self, token: str) -> Principal:
        """``<access_key>:<secret_key>`` → Principal, or Unauthorized. Constant-time comparison."""
        access_key, sep, secret = token.partition(":")
        expected = self.secret_for(access_key) if sep else None
        if expected is None or not hmac.compare_digest(expected.encode(), secret.encode()):
            raise Unauthorized("invalid access key or secret")
        return self.principal_for(access_key)

    def authorize(self, principal: Principal, bucket: BucketPolicy, action: Action) -> None:
        if principal.is_root:
            return
        if action is not Action.ADMIN:
            if principal.access_key is None:
                allowed = bucket.anonymous_read if action is Action.READ else bucket.anonymous_write
            else:
                can_read, can_write = principal.grants.get(bucket.name, (False, False))
                allowed = can_read if action is Action.READ else can_write
            if allowed:
                return
        if principal.access_key is None:
            raise Unauthorized()
        raise AccessDenied(f"no {action.value} access to bucket {bucket.name!r}")

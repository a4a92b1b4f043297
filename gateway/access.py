"""Who is calling and what they may do: credentials and buckets as an in-memory view of the catalog.

Both APIs authenticate against this view (Bearer tokens here, SigV4 in the S3 API) and authorize
through ``Directory.authorize``, so the rules live in one place:

- root credentials may do everything;
- other credentials may read / write the buckets they have grants on, and delete chunks only in
  buckets they hold a delete grant on (``kvgw cred create --bucket B --write --delete``: SGLang's and
  LMCache's S3 backends delete what they cached on ``clear()``); write never implies delete;
- anonymous requests may do what the bucket's policy grants anonymous users; with ``--anonymous``
  (local use) they may read and write every bucket, and only with ``--anonymous-admin`` also delete
  and administer (a mistyped flag must not hand strangers DELETE);
- anonymous without rights is 401 (credentials would help), authenticated without rights is 403.

The view is refreshed from the catalog every few seconds (gateways sharing a PostgreSQL catalog see
each other's changes), at once when a request names a bucket the view does not know, and before an
unknown access key is rejected (``knows``: one re-read shared by every request waiting for it, at most
one per ``unknown_key_interval``), so a credential works on every gateway the moment it is created.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import logging
import time
from dataclasses import dataclass, field

from backends.catalog.store import BucketPolicy, Catalog, CredentialRecord
from gateway.errors import AccessDenied, NoSuchBucket, Unauthorized

log = logging.getLogger("kvgw.access")

UNKNOWN_KEY_INTERVAL = 0.25
"""Seconds between two catalog re-reads caused by unknown access keys (bogus keys cannot hammer it)."""
MAX_ACCESS_KEY_LEN = 128


def parse_bearer(authorization: str) -> tuple[str, str] | None:
    """``Bearer <access_key>:<secret_key>`` (scheme in any case) as (access_key, secret_key); None for
    another scheme or a token without a colon. The one parser of the native API's credentials."""
    scheme, _, token = authorization.partition(" ")
    access_key, sep, secret = token.strip().partition(":")
    return (access_key, secret) if scheme.lower() == "bearer" and sep else None


class Action(enum.Enum):
    READ = "read"
    WRITE = "write"
    DELETE = "delete"  # delete chunks: root, or a delete grant on the bucket
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class Principal:
    access_key: str | None  # None: anonymous
    is_root: bool = False
    grants: dict[str, tuple[bool, bool]] = field(default_factory=dict)
    every_bucket: bool = False  # may read and write every bucket (anonymous use under --anonymous)
    deletes: frozenset[str] = frozenset()  # buckets it may delete chunks from


ANONYMOUS = Principal(access_key=None)
ANONYMOUS_READ_WRITE = Principal(access_key=None, every_bucket=True)
ANONYMOUS_ROOT = Principal(access_key=None, is_root=True)


def anonymous_principal(*, anonymous: bool, admin: bool) -> Principal:
    """Who an unauthenticated request is: per bucket policy, read+write everywhere, or root."""
    if admin:
        return ANONYMOUS_ROOT
    return ANONYMOUS_READ_WRITE if anonymous else ANONYMOUS


def _principal_of(record: CredentialRecord) -> Principal:
    return Principal(access_key=record.access_key, is_root=record.is_root, grants=record.grants,
                     deletes=record.deletes)


class Directory:
    """Buckets and credentials, cached from the catalog."""

    def __init__(self, catalog: Catalog, *, anonymous: Principal = ANONYMOUS, refresh_seconds: float,
                 unknown_key_interval: float = UNKNOWN_KEY_INTERVAL) -> None:
        self._catalog = catalog
        self._anonymous = anonymous
        self._refresh_seconds = refresh_seconds
        self._unknown_key_interval = unknown_key_interval
        self._buckets: dict[str, BucketPolicy] = {}
        self._credentials: dict[str, CredentialRecord] = {}
        self._principals: dict[str, Principal] = {}  # by access key, built with ``_credentials``
        self._loaded_at = 0.0
        self._load_started = float("-inf")  # when the last successful load began
        self._lock = asyncio.Lock()
        self.unknown_key_reloads = 0  # catalog re-reads caused by unknown access keys

    @property
    def anonymous(self) -> Principal:
        return self._anonymous

    def load(self) -> None:
        """Blocking reload from the catalog (start-up, CLI, worker thread)."""
        started = time.monotonic()
        buckets = {b.name: b for b in self._catalog.list_buckets()}
        credentials = {c.access_key: c for c in self._catalog.credentials()}
        principals = {key: _principal_of(record) for key, record in credentials.items()}
        self._buckets, self._credentials, self._principals = buckets, credentials, principals
        self._loaded_at = time.monotonic()
        self._load_started = started

    async def refresh(self) -> None:
        """Re-read the catalog now (after a change this gateway made, and periodically)."""
        async with self._lock:
            await asyncio.to_thread(self.load)

    def stale(self) -> bool:
        return time.monotonic() - self._loaded_at >= self._refresh_seconds

    # -- buckets -------------------------------------------------------------------------------

    def buckets(self) -> list[BucketPolicy]:
        return sorted(self._buckets.values(), key=lambda b: b.name)

    async def bucket(self, name: str) -> BucketPolicy:
        """The bucket's policy. A name not in the view is looked up again in the catalog (``reread``):
        a bucket created a moment ago, through this gateway or another, must be found at once."""
        policy = self._buckets.get(name)
        if policy is None:
            if name and await self.reread(since=time.monotonic()):
                policy = self._buckets.get(name)
            if policy is None:
                raise NoSuchBucket(f"bucket {name!r} does not exist")
        return policy

    def bucket_in_view(self, name: str) -> BucketPolicy | None:
        """The bucket's policy if the view holds it, without re-reading the catalog (None otherwise;
        ``bucket`` then decides): for callers that cannot await (``gateway.dataplane.lane``)."""
        return self._buckets.get(name)

    # -- credentials ---------------------------------------------------------------------------

    def secret_for(self, access_key: str) -> str | None:
        record = self._credentials.get(access_key)
        return None if record is None or record.disabled else record.secret

    def principal_for(self, access_key: str) -> Principal:
        """Who a verified ``access_key`` is, built once per catalog read rather than per request (a
        frozen dataclass costs a few µs to build: ~3% of an S3 HEAD in the lookup lane)."""
        principal = self._principals.get(access_key)
        if principal is None:  # a reload (another thread) replaced the views between this request's reads
            principal = _principal_of(self._credentials[access_key])
        return principal

    async def knows(self, access_key: str) -> bool:
        """Whether ``access_key`` is in the view, re-reading the catalog first if it is not (a credential
        created a moment ago, through this gateway or another, must work at once).

        A catalog that cannot be read leaves the key unknown (rejected)."""
        if access_key in self._credentials:
            return True
        if not access_key or len(access_key) > MAX_ACCESS_KEY_LEN:
            return False
        await self.reread(since=time.monotonic())
        return access_key in self._credentials

    async def reread(self, *, since: float) -> bool:
        """Make sure the view holds a catalog read that began at or after ``since`` (monotonic): what
        was committed before the caller arrived is then in it. False when the catalog cannot be read.

        Single-flight and rate-limited: callers arriving together share one re-read, and re-reads
        start at most once per ``unknown_key_interval`` (a caller waits for the next one rather than
        being answered from an older view, so a flood of unknown names costs the catalog nothing more)."""
        async with self._lock:
            if self._load_started >= since:
                return True
            wait = self._load_started + self._unknown_key_interval - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self.unknown_key_reloads += 1
            try:
                await asyncio.to_thread(self.load)
            except Exception as exc:
                log.warning("catalog re-read for an unknown name failed: %s", exc)
                return False
        return True

    async def authenticate(self, authorization: str | None) -> Principal:
        """``authenticate_bearer``, after ``knows`` made sure a credential created a moment ago is known."""
        credentials = None if authorization is None else parse_bearer(authorization)
        if credentials is not None:
            await self.knows(credentials[0])
        return self.authenticate_bearer(authorization)

    def authenticate_bearer(self, authorization: str | None) -> Principal:
        """The caller an ``Authorization`` header names (the native API and the control plane):
        ``Bearer <access_key>:<secret_key>``, or anonymous without the header. Unauthorized for
        another scheme or wrong credentials. Constant-time comparison."""
        if authorization is None:
            return self.anonymous
        credentials = parse_bearer(authorization)
        if credentials is None:
            raise Unauthorized("use Authorization: Bearer <access_key>:<secret_key>")
        access_key, secret = credentials
        expected = self.secret_for(access_key)
        if expected is None or not hmac.compare_digest(expected.encode(), secret.encode()):
            raise Unauthorized("invalid access key or secret")
        return self.principal_for(access_key)

    def authorize(self, principal: Principal, bucket: BucketPolicy, action: Action) -> None:
        if principal.is_root:
            return
        if action is Action.DELETE:
            if bucket.name in principal.deletes:
                return
        elif principal.every_bucket and action is not Action.ADMIN:
            return
        elif action is not Action.ADMIN:
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

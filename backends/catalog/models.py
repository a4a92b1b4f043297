"""Catalog tables: buckets with their policies, credentials, and per-bucket grants.

The schema is owned by Alembic (``migrations/``); these models must match the latest revision.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    SmallInteger,
    String,
    Text,
    func,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from backends.tiers import TierId


class Base(DeclarativeBase):
    pass


class Bucket(Base):
    __tablename__ = "buckets"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    default_ttl_seconds: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_chunk_bytes: Mapped[int] = mapped_column(BigInteger)
    capacity_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    anonymous_read: Mapped[bool] = mapped_column(Boolean, default=False)
    anonymous_write: Mapped[bool] = mapped_column(Boolean, default=False)
    # placement (revision 0002): capacity_bytes above is the filesystem tier's share for this bucket
    write_tier: Mapped[str] = mapped_column(String(8), default=TierId.FS.label)
    write_through: Mapped[bool] = mapped_column(Boolean, default=False)
    s3_capacity_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    high_watermark: Mapped[float] = mapped_column(Float, default=0.9)
    low_watermark: Mapped[float] = mapped_column(Float, default=0.8)
    eviction_policy: Mapped[str] = mapped_column(String(32), default="default")
    # read leases (revision 0006): the longest lease a lookup may take, and the bytes leased at once
    max_lease_ms: Mapped[int] = mapped_column(Integer, default=10_000)
    max_leased_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # revision 0007: whether zero-length objects are accepted (a KV-cache chunk is never empty)
    allow_empty_objects: Mapped[bool] = mapped_column(Boolean, default=False)
    # ETag mode (revision 0008): "xxh3" or "md5" (backends.catalog.store.ETAG_MODES)
    etag_mode: Mapped[str] = mapped_column(String(8), default="xxh3")


class Credential(Base):
    __tablename__ = "credentials"

    access_key: Mapped[str] = mapped_column(String(128), primary_key=True)
    secret_encrypted: Mapped[str] = mapped_column(String(512))
    is_root: Mapped[bool] = mapped_column(Boolean, default=False)
    description: Mapped[str] = mapped_column(String(256), default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)


class Grant(Base):
    __tablename__ = "grants"

    access_key: Mapped[str] = mapped_column(
        String(128), ForeignKey("credentials.access_key", ondelete="CASCADE"), primary_key=True
    )
    bucket: Mapped[str] = mapped_column(
        String(63), ForeignKey("buckets.name", ondelete="CASCADE"), primary_key=True
    )
    can_read: Mapped[bool] = mapped_column(Boolean, default=True)
    can_write: Mapped[bool] = mapped_column(Boolean, default=False)
    # revision 0004: may delete chunks (DeleteObject(s), native DELETE); never implied by can_write
    can_delete: Mapped[bool] = mapped_column(Boolean, default=False)


class CatalogMeta(Base):
    """Facts about the catalog itself (revision 0003), e.g. the fingerprint of its secret key."""

    __tablename__ = "catalog_meta"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(512))


# -- cluster state (revision 0005; see migrations/versions/0005_cluster.py) --------------------------


class ChunkEvent(Base):
    __tablename__ = "chunk_events"

    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    at: Mapped[float] = mapped_column(Float)
    member: Mapped[str] = mapped_column(String(64))
    bucket: Mapped[str] = mapped_column(String(63))
    digest: Mapped[bytes] = mapped_column(LargeBinary(16))
    kind: Mapped[int] = mapped_column(SmallInteger)
    tier: Mapped[int] = mapped_column(SmallInteger)
    size: Mapped[int] = mapped_column(BigInteger, default=0)
    expires: Mapped[float] = mapped_column(Float, default=0.0)
    count: Mapped[int] = mapped_column(Integer, default=1)
    detail: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)


class FeedHead(Base):
    __tablename__ = "feed_head"

    id: Mapped[int] = mapped_column(SmallInteger, primary_key=True, autoincrement=False)
    seq: Mapped[int] = mapped_column(BigInteger)


class TierUsage(Base):
    __tablename__ = "tier_usage"

    bucket: Mapped[str] = mapped_column(String(63), primary_key=True)
    tier: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    chunks: Mapped[int] = mapped_column(BigInteger, default=0)
    rebuilt_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class ClusterMember(Base):
    __tablename__ = "cluster_members"

    member: Mapped[str] = mapped_column(String(64), primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    version: Mapped[str] = mapped_column(String(32))
    url: Mapped[str] = mapped_column(String(255), default="")
    started_at: Mapped[float] = mapped_column(Float)
    heartbeat_at: Mapped[float] = mapped_column(Float)
    feed_seq: Mapped[int] = mapped_column(BigInteger, default=0)


class ChunkLease(Base):
    """A chunk's lease state (revision 0006, ``gateway.leases``): read-leased by a lookup, being
    removed by the lifecycle, or removed lately. One row per chunk; rows outlive ``expires_at`` only
    until the next trim."""

    __tablename__ = "chunk_leases"

    digest: Mapped[bytes] = mapped_column(LargeBinary(16), primary_key=True)
    bucket: Mapped[str] = mapped_column(String(63), index=True)
    kind: Mapped[int] = mapped_column(SmallInteger)  # gateway.leases: READ, REMOVING, REMOVED
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    expires_at: Mapped[float] = mapped_column(Float)


class LeaseMember(Base):
    """A gateway process that grants read leases in memory (revision 0009, ``gateway.leases``): what it
    has told the catalog. ``seen``: the last removal claim (``lease_log.seq``) it knew of before its last
    sync, whose grants it had all written by then; ``quiet_at`` (the database's clock): past it, none of
    its leases that ``chunk_leases`` lacks is still in force."""

    __tablename__ = "lease_members"

    member: Mapped[str] = mapped_column(String(64), primary_key=True)
    seen: Mapped[int] = mapped_column(BigInteger)
    synced_at: Mapped[float] = mapped_column(Float)
    quiet_at: Mapped[float] = mapped_column(Float)


class LeaseLog(Base):
    """What the lifecycle did to lease states, for the processes that grant leases (revision 0009):
    claimed (``REMOVING``), removed (``REMOVED``) or let go (``RELEASED``), numbered per claim or settle
    in commit order (``lease_head``)."""

    __tablename__ = "lease_log"

    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    digest: Mapped[bytes] = mapped_column(LargeBinary(16), primary_key=True)
    state: Mapped[int] = mapped_column(SmallInteger)
    expires_at: Mapped[float] = mapped_column(Float)
    at: Mapped[float] = mapped_column(Float)  # the database's clock, for trimming


class LeaseHead(Base):
    """One row (``id`` = 1): the last ``lease_log`` number handed out, and the last one trimmed."""

    __tablename__ = "lease_head"

    id: Mapped[int] = mapped_column(SmallInteger, primary_key=True, autoincrement=False)
    seq: Mapped[int] = mapped_column(BigInteger)
    trimmed: Mapped[int] = mapped_column(BigInteger)


class LeaseQuota(Base):
    """A process's share of a bucket's leased-bytes cap (revision 0009): the bytes it may hold leased
    (``bytes``) and holds (``used``). The shares of the live processes never add up past the cap."""

    __tablename__ = "lease_quotas"

    bucket: Mapped[str] = mapped_column(String(63), primary_key=True)
    member: Mapped[str] = mapped_column(String(64), primary_key=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
    used: Mapped[int] = mapped_column(BigInteger)


class ClusterLease(Base):
    __tablename__ = "cluster_leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(64))
    epoch: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[float] = mapped_column(Float)


class PolicyState(Base):
    """What an eviction policy learnt for one (bucket, tier) (revision 0010, ``gateway.lifecycle.state``)."""

    __tablename__ = "policy_state"

    bucket: Mapped[str] = mapped_column(String(63), primary_key=True)
    tier: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    policy: Mapped[str] = mapped_column(String(32))
    state: Mapped[str] = mapped_column(Text)
    saved_at: Mapped[float] = mapped_column(Float)
    member: Mapped[str] = mapped_column(String(64), default="")

"""Catalog tables: buckets with their policies, credentials, and per-bucket grants.

The schema is owned by Alembic (``migrations/``); these models must match the latest revision.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Boolean, DateTime, Float, ForeignKey, Integer, String, func
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


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
    write_tier: Mapped[str] = mapped_column(String(8), default="fs")
    write_through: Mapped[bool] = mapped_column(Boolean, default=False)
    s3_capacity_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    high_watermark: Mapped[float] = mapped_column(Float, default=0.9)
    low_watermark: Mapped[float] = mapped_column(Float, default=0.8)
    eviction_policy: Mapped[str] = mapped_column(String(32), default="default")


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

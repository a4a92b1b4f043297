"""Cluster state shared by every gateway of a catalog: the change feed, the usage ledger, members, leases.

- ``chunk_events``: the change feed. ``seq`` is gap-free and in commit order: every batch takes its
  numbers from ``feed_head`` (one row) in the same transaction, so a reader that has applied up to N
  never misses an event committed later with a lower number.
- ``feed_head``: that one row (``id`` = 1): the last sequence number handed out.
- ``tier_usage``: bytes and chunks per (bucket, tier) for the whole tier, updated by the same
  transactions that publish the events that change them.
- ``cluster_members``: one row per gateway process (heartbeat, feed position) for ``kvgw cluster status``.
- ``cluster_leases``: named leases (the lifecycle leader): holder, epoch, expiry.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "chunk_events",
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("at", sa.Float, nullable=False),  # unix seconds, the publisher's clock
        sa.Column("member", sa.String(64), nullable=False),  # the gateway process that published it
        sa.Column("bucket", sa.String(63), nullable=False),
        sa.Column("digest", sa.LargeBinary(16), nullable=False),
        sa.Column("kind", sa.SmallInteger, nullable=False),  # stored, deleted, evicted, expired, ... read
        sa.Column("tier", sa.SmallInteger, nullable=False),  # TierId
        sa.Column("size", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("expires", sa.Float, nullable=False, server_default="0"),
        sa.Column("count", sa.Integer, nullable=False, server_default="1"),  # reads folded into one event
        sa.Column("detail", sa.LargeBinary, nullable=True),  # kind-specific extra (key, parent), packed
    )
    op.create_table(
        "feed_head",
        sa.Column("id", sa.SmallInteger, primary_key=True, autoincrement=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
    )
    op.execute("INSERT INTO feed_head (id, seq) VALUES (1, 0)")
    op.create_table(
        "tier_usage",
        sa.Column("bucket", sa.String(63), primary_key=True),
        sa.Column("tier", sa.SmallInteger, primary_key=True),
        sa.Column("bytes", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("chunks", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("rebuilt_at", sa.Float, nullable=True),  # when last recounted from the tier
    )
    op.create_table(
        "cluster_members",
        sa.Column("member", sa.String(64), primary_key=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("version", sa.String(32), nullable=False),
        sa.Column("url", sa.String(255), nullable=False, server_default=""),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("heartbeat_at", sa.Float, nullable=False),
        sa.Column("feed_seq", sa.BigInteger, nullable=False, server_default="0"),
    )
    op.create_table(
        "cluster_leases",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("holder", sa.String(64), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    for table in ("cluster_leases", "cluster_members", "tier_usage", "feed_head", "chunk_events"):
        op.drop_table(table)

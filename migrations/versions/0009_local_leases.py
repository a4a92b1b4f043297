"""Read leases granted in memory and shared in the background (issue 31, item 5; ``gateway.leases``).

- ``lease_members``: one row per process that grants leases: the last removal claim it acknowledged
  (``seen``), when it last synced, and ``quiet_at``, after which none of its unwritten leases holds.
- ``lease_log``: claims and their outcomes (removed, let go), numbered from ``lease_head`` in commit
  order, read by every such process.
- ``lease_head``: that one row (``id`` = 1): the last number handed out, the last one trimmed.
- ``lease_quotas``: each process's share of a bucket's leased-bytes cap.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "lease_members",
        sa.Column("member", sa.String(64), primary_key=True),
        sa.Column("seen", sa.BigInteger, nullable=False),
        sa.Column("synced_at", sa.Float, nullable=False),
        sa.Column("quiet_at", sa.Float, nullable=False),
    )
    op.create_table(
        "lease_log",
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("digest", sa.LargeBinary(16), primary_key=True),
        sa.Column("state", sa.SmallInteger, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
        sa.Column("at", sa.Float, nullable=False),
    )
    op.create_table(
        "lease_head",
        sa.Column("id", sa.SmallInteger, primary_key=True, autoincrement=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("trimmed", sa.BigInteger, nullable=False),
    )
    op.execute("INSERT INTO lease_head (id, seq, trimmed) VALUES (1, 0, 0)")
    op.create_table(
        "lease_quotas",
        sa.Column("bucket", sa.String(63), primary_key=True),
        sa.Column("member", sa.String(64), primary_key=True),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("used", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    for table in ("lease_quotas", "lease_head", "lease_log", "lease_members"):
        op.drop_table(table)

"""Placement policy per bucket: write tier, write-through, per-tier capacity and watermarks, eviction policy.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("buckets") as batch:
        batch.add_column(sa.Column("write_tier", sa.String(8), nullable=False, server_default="fs"))
        batch.add_column(sa.Column("write_through", sa.Boolean, nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("s3_capacity_bytes", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("high_watermark", sa.Float, nullable=False, server_default="0.9"))
        batch.add_column(sa.Column("low_watermark", sa.Float, nullable=False, server_default="0.8"))
        batch.add_column(sa.Column("eviction_policy", sa.String(32), nullable=False, server_default="default"))


def downgrade() -> None:
    with op.batch_alter_table("buckets") as batch:
        for column in ("eviction_policy", "low_watermark", "high_watermark", "s3_capacity_bytes",
                       "write_through", "write_tier"):
            batch.drop_column(column)

"""Initial catalog: buckets, credentials, grants.

Revision ID: 0001
Revises:
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "buckets",
        sa.Column("name", sa.String(63), primary_key=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("default_ttl_seconds", sa.Integer, nullable=True),
        sa.Column("max_chunk_bytes", sa.BigInteger, nullable=False),
        sa.Column("capacity_bytes", sa.BigInteger, nullable=True),
        sa.Column("anonymous_read", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("anonymous_write", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    op.create_table(
        "credentials",
        sa.Column("access_key", sa.String(128), primary_key=True),
        sa.Column("secret_encrypted", sa.String(512), nullable=False),
        sa.Column("is_root", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("description", sa.String(256), nullable=False, server_default=""),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("disabled", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    op.create_table(
        "grants",
        sa.Column("access_key", sa.String(128),
                  sa.ForeignKey("credentials.access_key", ondelete="CASCADE"), primary_key=True),
        sa.Column("bucket", sa.String(63), sa.ForeignKey("buckets.name", ondelete="CASCADE"), primary_key=True),
        sa.Column("can_read", sa.Boolean, nullable=False, server_default=sa.true()),
        sa.Column("can_write", sa.Boolean, nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    op.drop_table("grants")
    op.drop_table("credentials")
    op.drop_table("buckets")

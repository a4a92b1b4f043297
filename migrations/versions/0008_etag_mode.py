"""Per-bucket ETag mode (``kvgw bucket create|update --etag md5|xxh3``).

- ``buckets.etag_mode``: ``xxh3`` (the chunk's checksum; what every bucket had until now, so existing
  buckets keep it) or ``md5`` (S3's ETags, for buckets that generic S3 tools compare with MD5s). The
  mode applies to chunks written from then on: a chunk's ETag is recorded with it when it is written.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("buckets") as batch:
        batch.add_column(sa.Column("etag_mode", sa.String(8), nullable=False, server_default="xxh3"))


def downgrade() -> None:
    with op.batch_alter_table("buckets") as batch:
        batch.drop_column("etag_mode")

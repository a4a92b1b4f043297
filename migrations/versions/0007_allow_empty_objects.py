"""Empty objects per bucket: ``buckets.allow_empty_objects``.

A KV-cache chunk is never empty, so a zero-length PUT (native PUT, S3 PutObject and UploadPart) is
refused with 400 EmptyChunk by default; a bucket that holds generic S3 objects may allow them
(``kvgw bucket create|update --allow-empty-objects``). Existing buckets keep refusing them.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("buckets") as batch:
        batch.add_column(sa.Column("allow_empty_objects", sa.Boolean, nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("buckets") as batch:
        batch.drop_column("allow_empty_objects")

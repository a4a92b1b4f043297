"""Catalog facts: a name -> value table; the first is the fingerprint of the key that encrypts secrets.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "catalog_meta",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.String(512), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("catalog_meta")

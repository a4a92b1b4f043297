"""What the eviction policies learnt, kept in the catalog (issue 33).

- ``policy_state``: one row per (bucket, tier): the policy's name and its learnt state (a JSON document,
  ``gateway.lifecycle.policy_reuse.ReusePolicy.export``), when and by which gateway it was last saved.
  The lifecycle leader saves it every few seconds and when it stops; a gateway that becomes the leader
  loads it first, so what was learnt survives restarts and leader changes.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "policy_state",
        sa.Column("bucket", sa.String(63), primary_key=True),
        sa.Column("tier", sa.SmallInteger, primary_key=True),
        sa.Column("policy", sa.String(32), nullable=False),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("saved_at", sa.Float, nullable=False),
        sa.Column("member", sa.String(64), nullable=False, server_default=""),
    )


def downgrade() -> None:
    op.drop_table("policy_state")

"""Read leases between a lookup and the load that follows (``gateway.leases``).

- ``chunk_leases``: one row per chunk in a lease state: read-leased by a lookup (until ``expires_at``),
  being removed by the lifecycle, or removed lately (so a lookup that raced the removal re-checks).
- ``buckets.max_lease_ms``: the longest lease a lookup may take in the bucket (default 10 s).
- ``buckets.max_leased_bytes``: the bytes that may be leased at once (NULL: a tenth of the bucket's
  capacity, unlimited without one), so leases cannot starve eviction.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "chunk_leases",
        sa.Column("digest", sa.LargeBinary(16), primary_key=True),
        sa.Column("bucket", sa.String(63), nullable=False),
        sa.Column("kind", sa.SmallInteger, nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("expires_at", sa.Float, nullable=False),
    )
    op.create_index("ix_chunk_leases_bucket", "chunk_leases", ["bucket"])
    with op.batch_alter_table("buckets") as batch:
        batch.add_column(sa.Column("max_lease_ms", sa.Integer, nullable=False, server_default="10000"))
        batch.add_column(sa.Column("max_leased_bytes", sa.BigInteger, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("buckets") as batch:
        batch.drop_column("max_leased_bytes")
        batch.drop_column("max_lease_ms")
    op.drop_index("ix_chunk_leases_bucket", "chunk_leases")
    op.drop_table("chunk_leases")

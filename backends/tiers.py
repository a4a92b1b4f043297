"""Tier identities: the one definition of which tiers exist, how the index records them, and their names.

A chunk lives in one or more tiers. The index stores where as a bit mask of ``TierId`` values (on disk:
``IndexEntry.tiers``, one byte), so the values are part of the index format and never change. The
``label`` ("fs", "s3") is the tier's name everywhere text is involved: bucket policies (``write_tier``,
stored in the catalog), the CLI, HTTP headers and JSON answers, statistics and logs.

Members are in read-preference order: a read takes the first tier in ``TierId`` order that holds a
copy (the filesystem before S3).
"""

from __future__ import annotations

from enum import IntEnum


class TierId(IntEnum):
    FS = 1  # the filesystem tier: a local or NFS-shared directory (backends.posix)
    S3 = 2  # the S3 tier: an S3-compatible object store (backends.s3)

    @property
    def label(self) -> str:
        """The tier's name in text: "fs", "s3"."""
        return self.name.lower()

    @classmethod
    def parse(cls, label: str) -> TierId:
        """The tier named ``label`` ("fs", "s3"); ValueError for any other text."""
        for tier in cls:
            if tier.label == label:
                return tier
        raise ValueError(f"unknown tier {label!r}; one of {', '.join(cls.labels())}")

    @classmethod
    def labels(cls) -> tuple[str, ...]:
        return tuple(tier.label for tier in cls)

"""Read leases between a lookup and the load that follows (issue 13; granted in memory since issue 31).

- ``book.py``: ``LeaseBook``, what the service and the lifecycle call: ``grant_now`` (inline, no waiting),
  ``grant`` (async, one sync first), ``claim`` / ``settle`` (the lifecycle leader), and the syncer. Its
  docstring says why the lifecycle leader never removes a leased chunk.
- ``local.py``: the leases one process holds in memory and what it knows of the cluster's claims.
- ``table.py``: the catalog statements (``chunk_leases``, ``lease_log``, ``lease_members``, ``lease_quotas``).
"""

from gateway.leases.book import (
    CLAIM_SECONDS,
    MAX_LEASE_MS,
    REMOVED_MEMORY_SECONDS,
    LeaseBook,
    LeaseStats,
    LeaseUnavailable,
)
from gateway.leases.local import READ, RELEASED, REMOVED, REMOVING, LeaseGrant
from gateway.leases.table import LEASES

__all__ = ["CLAIM_SECONDS", "LEASES", "MAX_LEASE_MS", "READ", "RELEASED", "REMOVED", "REMOVED_MEMORY_SECONDS",
           "REMOVING", "LeaseBook", "LeaseGrant", "LeaseStats", "LeaseUnavailable"]

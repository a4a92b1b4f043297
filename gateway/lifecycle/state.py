"""What the eviction policies learnt, kept in the catalog so it survives restarts and leader changes.

One row per (bucket, tier) in ``policy_state`` (migration 0010): the policy's name, its learnt state
(``SampledPolicy.export``: a JSON document; only ``reuse`` keeps one), when and by whom it was saved.
The lifecycle leader saves every policy's state every ``save_seconds`` and when it stops leading
(``gateway.lifecycle.engine``); a process that becomes the leader loads every row before its first
eviction and hands each to a policy of the same name (``Ledgers.restore``). A state of another policy
(the bucket's policy changed) or of another format is ignored: that policy starts over.

Calls run in the cluster database's threads (``gateway.cluster.db.ClusterDB``), never on the event loop.
Saving is best effort: a catalog that cannot be reached costs what was learnt since the last save.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Table, select

from backends.catalog.models import PolicyState
from gateway.cluster.db import ClusterDB

log = logging.getLogger("kvgw.lifecycle")

STATES: Table = PolicyState.__table__  # type: ignore[assignment]

Saved = tuple[str, int, str, Any]  # bucket, tier, policy name, learnt state


class PolicyStates:
    """The ``policy_state`` rows, read and written through the cluster's database engine."""

    def __init__(self, db: ClusterDB, member: str, *, clock: Callable[[], float] = time.time) -> None:
        self._db = db
        self.member = member
        self._clock = clock

    async def load(self) -> dict[tuple[str, int], tuple[str, Any, str]]:
        """Every saved state: (bucket, tier) -> (policy name, state, the member that saved it). A row
        whose state is not JSON is left out (and logged)."""
        rows = await self._db.run(self._read)
        out: dict[tuple[str, int], tuple[str, Any, str]] = {}
        for bucket, tier, policy, state, member in rows:
            try:
                out[(bucket, int(tier))] = (policy, json.loads(state), member)
            except ValueError:
                log.warning("lifecycle: the learnt state of %s (tier %s) in the catalog is not JSON; ignored",
                            bucket, tier)
        return out

    async def save(self, states: Sequence[Saved]) -> None:
        """Write these states (one transaction, each row replaced)."""
        if states:
            rows = [{"bucket": bucket, "tier": tier, "policy": policy, "state": json.dumps(state),
                     "saved_at": self._clock(), "member": self.member} for bucket, tier, policy, state in states]
            await self._db.run(self._write, rows)

    def _read(self) -> list[tuple[Any, ...]]:
        with self._db.engine.connect() as conn:
            result = conn.execute(select(STATES.c.bucket, STATES.c.tier, STATES.c.policy, STATES.c.state,
                                         STATES.c.member))
            return [tuple(row) for row in result]

    def _write(self, rows: list[dict[str, Any]]) -> None:
        with self._db.engine.begin() as conn:
            for row in rows:
                stmt = self._db.upsert(STATES).values(**row)
                conn.execute(stmt.on_conflict_do_update(
                    index_elements=["bucket", "tier"],
                    set_={name: stmt.excluded[name] for name in ("policy", "state", "saved_at", "member")}))

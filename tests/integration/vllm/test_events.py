"""KV events of kvgw's tier through vLLM's own event path: the real scheduler publishes them on a ZMQ
``ipc://`` socket (vLLM's ``ZmqEventPublisher``) and a router-side subscriber reads them (``SUB``, with
vLLM's replay socket filling what a late subscription missed). Engine B reports, as ``BlockStored``
``STORAGE``/``REMOTE``, the blocks engine A stored through kvgw (the change stream), at most
``events_per_step`` a step; once kvgw's lifecycle evicts some of them, ``BlockRemoved`` for those. With
``kv_events: own`` a tier reports its own stores and reads no change stream."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.bench.vllm_engine import TINY_LLAMA, SchedulerEngine, block_keys
from kvgw_client.tiering import BlockNames
from tests.conftest import ServerProcess, wait_for
from tests.integration.vllm.conftest import cli, kvgw_tier

BLOCK = 8192  # the tiny model's KV per 16-token block: 2 x 16 tokens x 4 heads x 16 dims x 4 bytes


class EventReader:
    """A router's view of one engine's KV events: a SUB socket on its publisher, and its replay socket
    for the batches published before the subscription took (read by sequence number)."""

    def __init__(self, endpoint: str, replay: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq = zmq
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._replay_endpoint = replay
        self.batches: dict[int, Any] = {}

    def poll(self) -> None:
        while self._sub.poll(0):
            _, seq, payload = self._sub.recv_multipart()
            self.batches[int.from_bytes(seq, "big")] = self._decode(payload)
        if self.batches and len(self.batches) <= max(self.batches):  # a gap (or the first ones missed)
            self._replay(0)

    def _replay(self, start: int) -> None:
        sock = self._ctx.socket(self._zmq.DEALER)
        sock.connect(self._replay_endpoint)
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while sock.poll(10_000):
                _, _, seq, payload = sock.recv_multipart()
                if not payload:
                    break  # vLLM's end-of-replay marker
                self.batches[int.from_bytes(seq, "big")] = self._decode(payload)
        finally:
            sock.close(linger=0)

    def storage(self, cls_name: str) -> list[Any]:
        """The STORAGE events of one class (``BlockStored`` / ``BlockRemoved``), in publication order."""
        return [e for _, b in sorted(self.batches.items()) for e in b.events
                if type(e).__name__ == cls_name and e.medium == "STORAGE"]

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(tmp_path / "model")


@pytest.fixture
def schedulers(model_dir: str) -> Iterator[Callable[..., SchedulerEngine]]:
    made: list[SchedulerEngine] = []

    def make(tiers: list[dict[str, Any]], **kw: Any) -> SchedulerEngine:
        engine = SchedulerEngine(model_dir, tiers, **kw)
        made.append(engine)
        return engine

    yield make
    for engine in reversed(made):
        engine.close()


def hashes_in_kvgw(engine: SchedulerEngine, server: ServerProcess, bucket: str) -> list[bytes]:
    """The block hashes kvgw holds in the engine's namespace (listed from the bucket)."""
    names: BlockNames = engine.tiers[0].names
    keys, _ = engine.tiers[0].client.blocking.list_keys(names.prefix, limit=1000)
    return [parsed[0] for parsed in map(names.parse, keys) if parsed is not None]


def test_a_router_sees_other_engines_stores_and_kvgws_evictions(
    schedulers: Callable[..., SchedulerEngine], server_factory: type[ServerProcess], tmp_path: Path, seed: int
) -> None:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    server = server_factory(data_dir=tmp_path / "data", env={"KVGW_LIFECYCLE_INTERVAL": "0.2"}).start()
    bucket = f"vllm-ev-{seed}"
    cli(server, "bucket", "create", bucket, "--capacity-bytes", str(12 * BLOCK))
    tier = kvgw_tier(server, bucket=bucket, enable_kv_events=True, events_per_step=3, events_poll_s=0.1)
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp_path}/events",
              "replay_endpoint": f"ipc://{tmp_path}/replay"}
    b = schedulers([tier], kv_events=events)
    reader = EventReader(events["endpoint"], events["replay_endpoint"])
    try:
        a = schedulers([kvgw_tier(server, bucket=bucket)])
        prompt = [(seed + i) % 997 + 1 for i in range(4 * 16 + 5)]
        a.add("a-1", prompt)
        a.run()
        stored = hashes_in_kvgw(a, server, bucket)
        assert len(stored) == 4

        def b_reported(n: int) -> Callable[[], bool]:
            def check() -> bool:
                b.step()
                reader.poll()
                return len(reader.storage("BlockStored")) >= n
            return check

        wait_for(b_reported(4), "engine B to report A's four blocks")
        reported = reader.storage("BlockStored")
        assert {h for e in reported for h in e.block_hashes} == {maybe_convert_block_hash(h) for h in stored}
        assert {(e.locality, e.medium) for e in reported} == {("REMOTE", "STORAGE")}
        for batch in reader.batches.values():  # at most events_per_step blocks a step
            assert sum(len(e.block_hashes) for e in batch.events
                       if type(e).__name__ == "BlockStored" and e.medium == "STORAGE") <= 3

        # A stores more than the bucket holds: kvgw's lifecycle evicts, B reports the removals
        for i in range(3):
            a.add(f"a-{i + 2}", [(seed * 7 + i * 101 + j) % 997 + 1 for j in range(4 * 16 + 5)])
            a.run()

        def b_reported_removals() -> bool:
            b.step()
            reader.poll()
            return bool(reader.storage("BlockRemoved"))

        wait_for(b_reported_removals, "engine B to report blocks kvgw evicted", timeout=60)
        removed = {h for e in reader.storage("BlockRemoved") for h in e.block_hashes}
        still = {maybe_convert_block_hash(h) for h in hashes_in_kvgw(a, server, bucket)}
        assert removed and not removed & still  # what B said is gone is gone from kvgw
        assert {(e.locality, e.medium) for e in reader.storage("BlockRemoved")} == {("REMOTE", "STORAGE")}
    finally:
        reader.close()


def test_own_stores_only(engines: Callable[..., Any], gateway: ServerProcess, seed: int) -> None:
    """``kv_events: own``: the tier reports what it stored itself and never reads the change stream."""
    from vllm.v1.kv_offload.base import Locality, Medium

    c = engines([kvgw_tier(gateway, enable_kv_events=True, kv_events="own")], events=True)
    engines([kvgw_tier(gateway)]).store(block_keys(3, seed), [b"o" * (1 << 20)] * 3)  # another engine's
    mine = block_keys(2, seed + 1)
    c.store(mine, [b"m" * (1 << 20)] * 2)
    storage = [e for e in c.events() if e.medium is Medium.STORAGE]
    assert [(sorted(e.keys), e.removed, e.locality) for e in storage] == [(sorted(mine), False, Locality.REMOTE)]
    # a follower reads its first page when the tier starts: none was ever asked for
    assert "changes.calls" not in c.tiers[0].stats()["counters"]

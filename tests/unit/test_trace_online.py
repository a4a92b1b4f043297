"""The online trace replay's chunk sizes: a request's partial last block is stored as much smaller as it
holds fewer tokens, as the simulator sizes it (the lifecycle evicts such partial tails first)."""

from __future__ import annotations

from gateway.bench.trace_online import block_bytes
from gateway.bench.trace_sim import TraceRequest


def test_a_partial_last_block_is_stored_in_proportion_to_its_tokens() -> None:
    req = TraceRequest(0.0, 512 * 2 + 128, (1, 2, 3))
    assert [block_bytes(req, pos, 4096) for pos in range(3)] == [4096, 4096, 1024]


def test_a_full_last_block_is_a_full_chunk_and_a_tiny_one_at_least_a_byte() -> None:
    assert block_bytes(TraceRequest(0.0, 1024, (1, 2)), 1, 4096) == 4096
    assert block_bytes(TraceRequest(0.0, 513, (1, 2)), 1, 256) == 1

"""BatchReader: the batch-get framing of kvgw_client.wire, read incrementally into caller buffers."""

from __future__ import annotations

import random

import pytest

from kvgw_client import wire
from kvgw_client.framing import BatchItem, BatchReader, ItemStatus, byte_view


def frame_ok(payload: bytes, *, checksum: int | None = None) -> bytes:
    value = wire.checksum_int(payload) if checksum is None else checksum
    return wire.encode_frame_header(wire.FRAME_OK, len(payload), value) + payload


def stream(*frames: bytes, count: int | None = None, trailer: bool = True) -> bytes:
    n = len(frames) if count is None else count
    body = wire.encode_batch_header(n) + b"".join(frames)
    return body + (wire.encode_batch_trailer(n) if trailer else b"")


PAYLOADS = [b"alpha" * 100, b"", b"\x00\xff" * 3000, b"z"]


def sample() -> bytes:
    return stream(
        frame_ok(PAYLOADS[0]),
        wire.encode_frame_header(wire.FRAME_MISSING),
        frame_ok(PAYLOADS[2]),
        wire.encode_frame_header(wire.FRAME_ERROR),
        frame_ok(PAYLOADS[3]),
    )


def feed_all(reader: BatchReader, data: bytes, sizes: list[int]) -> list[BatchItem]:
    out: list[BatchItem] = []
    pos = 0
    for size in sizes:
        out += reader.feed(data[pos : pos + size])
        pos += size
    out += reader.feed(data[pos:])
    return out


def test_bytes_mode_reports_every_frame_in_order() -> None:
    reader = BatchReader(5)
    items = reader.feed(sample())
    assert [i.status for i in items] == [
        ItemStatus.OK, ItemStatus.MISSING, ItemStatus.OK, ItemStatus.FAILED, ItemStatus.OK,
    ]
    assert [i.index for i in items] == [0, 1, 2, 3, 4]
    assert items[0].data == PAYLOADS[0] and items[2].data == PAYLOADS[2] and items[4].data == PAYLOADS[3]
    assert reader.complete and reader.error is None
    assert reader.close() == []


@pytest.mark.parametrize("seed", range(20))
def test_any_split_of_the_stream_gives_the_same_items(seed: int) -> None:
    data = sample()
    rng = random.Random(seed)
    sizes = [rng.randint(0, 40) for _ in range(rng.randint(1, 200))]
    items = feed_all(BatchReader(5), data, sizes)
    whole = BatchReader(5).feed(data)
    assert [(i.index, i.status, i.data) for i in items] == [(i.index, i.status, i.data) for i in whole]


def test_byte_by_byte_matches_wire_batch_parser() -> None:
    data = stream(frame_ok(b"one"), frame_ok(b"two" * 50), wire.encode_frame_header(wire.FRAME_MISSING))
    reader = BatchReader(3)
    mine = [item for b in data for item in reader.feed(bytes([b]))]
    theirs = list(wire.BatchParser().feed(data))
    assert [(i.index, i.status is ItemStatus.OK, bytes(i.data or b"")) for i in mine] == [
        (f.index, f.ok, f.payload) for f in theirs
    ]


def test_payloads_land_in_caller_buffers_including_scattered_ones() -> None:
    head, tail = bytearray(7), bytearray(len(PAYLOADS[0]) - 7)
    single = bytearray(len(PAYLOADS[2]))
    asked: list[tuple[int, int]] = []

    def into(index: int, length: int) -> memoryview | list[memoryview] | None:
        asked.append((index, length))
        if index == 0:
            return [memoryview(head), memoryview(tail)]
        if index == 2:
            return memoryview(single)
        return None  # refuse the last one

    items = BatchReader(5, into=into).feed(sample())
    assert asked == [(0, len(PAYLOADS[0])), (2, len(PAYLOADS[2])), (4, 1)]
    assert bytes(head + tail) == PAYLOADS[0] and bytes(single) == PAYLOADS[2]
    assert [i.status for i in items] == [
        ItemStatus.OK, ItemStatus.MISSING, ItemStatus.OK, ItemStatus.FAILED, ItemStatus.REFUSED,
    ]
    assert all(i.data is None for i in items)


def test_ctypes_style_buffers_with_format_lt_B_are_writable() -> None:
    import ctypes

    raw = (ctypes.c_ubyte * 5)()
    view = memoryview(raw)
    assert view.format == "<B"
    items = BatchReader(1, into=lambda i, n: view).feed(stream(frame_ok(b"hello")))
    assert items[0].ok and bytes(raw) == b"hello"
    assert byte_view(view).format == "B"


def test_checksum_mismatch_marks_only_that_frame_corrupt() -> None:
    data = stream(frame_ok(b"good"), frame_ok(b"bad!", checksum=12345), frame_ok(b"fine"))
    items = BatchReader(3).feed(data)
    assert [i.status for i in items] == [ItemStatus.OK, ItemStatus.CORRUPT, ItemStatus.OK]
    assert items[1].data is None


def test_stream_cut_short_reports_the_rest_lost() -> None:
    data = stream(frame_ok(b"a" * 100), frame_ok(b"b" * 100), frame_ok(b"c"))
    cut = data[: wire.BATCH_HEADER.size + wire.FRAME_HEADER.size + 100 + wire.FRAME_HEADER.size + 10]
    reader = BatchReader(3)
    items = reader.feed(cut)
    assert [i.status for i in items] == [ItemStatus.OK]
    rest = reader.close()
    assert [(i.index, i.status) for i in rest] == [(1, ItemStatus.LOST), (2, ItemStatus.LOST)]
    assert reader.error is not None and not reader.complete


def test_missing_trailer_is_an_error_even_when_all_frames_arrived() -> None:
    reader = BatchReader(1)
    assert [i.status for i in reader.feed(stream(frame_ok(b"x"), trailer=False))] == [ItemStatus.OK]
    assert reader.close() == [] and reader.error is not None


@pytest.mark.parametrize(
    "data",
    [
        b"XXXX" + wire.encode_batch_header(1)[4:],
        wire.BATCH_HEADER.pack(wire.BATCH_MAGIC, 99, 0, 1),
        stream(frame_ok(b"x"), count=2, trailer=False),  # announces 2, one key asked
        stream(wire.encode_frame_header(wire.FRAME_MISSING, 5)),
        stream(wire.encode_frame_header(7)),
        stream(frame_ok(b"x"))[:-8] + wire.encode_batch_trailer(2),
        stream(frame_ok(b"x")) + b"extra",
    ],
    ids=["magic", "version", "count", "missing-with-payload", "unknown-status", "trailer-count", "after-trailer"],
)
def test_framing_violations_stop_the_reader(data: bytes) -> None:
    reader = BatchReader(1)
    reader.feed(data)
    assert reader.error is not None
    assert reader.feed(stream(frame_ok(b"x"))) == []
    reader.close()


def test_length_above_limit_is_refused_before_allocating() -> None:
    reader = BatchReader(1, max_length=10)
    items = reader.feed(stream(frame_ok(b"y" * 11)))
    assert items == [] and reader.error is not None
    assert [i.status for i in reader.close()] == [ItemStatus.LOST]


def test_provider_returning_the_wrong_size_is_a_caller_bug() -> None:
    reader = BatchReader(1, into=lambda i, n: memoryview(bytearray(n + 1)))
    with pytest.raises(ValueError, match="returned 4 bytes for 3"):
        reader.feed(stream(frame_ok(b"abc")))


def test_zero_frames() -> None:
    reader = BatchReader(0)
    assert reader.feed(stream()) == [] and reader.complete

"""What only the S3 tier does: object layout and metadata, multipart uploads, conditional writes and
lost replies, and behaviour when the endpoint is dead, hung or comes back. Against a real S3 server
over HTTP (moto, or ``KVGW_TEST_S3_ENDPOINT``; the race between gateways against Ceph RGW too);
outages use a private moto process or a closed port.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import xxhash
from botocore.exceptions import ClientError, ConnectTimeoutError, EndpointConnectionError
from pydantic import SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from backends import chunkfile
from backends.base import ChunkMeta
from backends.errors import BackendError, ChunkCorrupt, ChunkExists, ChunkNotFound, TierUnavailable
from backends.request_path import request_budget
from backends.s3 import S3StagedChunk, S3Tier, S3TierSettings
from backends.s3_guard import CircuitBreaker, RangeNotSatisfiable, UploadGone, WriteConflict, translate
from kvgw_client.keys import chunk_digest
from tests import s3server
from tests.rgw.fixtures import S3_SERVERS, s3_endpoint_of
from tests.s3server import FaultProxy, S3Endpoint

# The fixtures, until tests/conftest.py re-exports them (then these lines only cost a moto process).
s3_endpoint = s3server.s3_endpoint
s3_bucket = s3server.s3_bucket
moto_server = s3server.moto_server

PART = 5 << 20


def blob(size: int, seed: int = 0) -> bytes:
    import random

    return random.Random(seed).randbytes(size)


def meta_for(data: bytes, key: str) -> ChunkMeta:
    return ChunkMeta(bucket="kvcache", key=key, size=len(data), checksum=xxhash.xxh3_64_intdigest(data),
                     created=round(time.time(), 3))


async def write(tier: S3Tier, data: bytes, key: str, piece: int = 1 << 20) -> S3StagedChunk:
    staged = await tier.stage(chunk_digest("kvcache", key))
    for i in range(0, len(data), piece):
        await staged.write(data[i : i + piece])
    return staged


async def store(tier: S3Tier, data: bytes, key: str) -> bool:
    return await (await write(tier, data, key)).publish(meta_for(data, key))


@pytest.fixture
async def tier(s3_endpoint: S3Endpoint, s3_bucket: str) -> AsyncIterator[S3Tier]:
    t = S3Tier(s3_endpoint.settings(s3_bucket, part_size=PART))
    yield t
    await t.close()


# -- layout ------------------------------------------------------------------------------------


async def test_object_is_named_by_digest_and_holds_the_posix_encoding(
    s3_endpoint: S3Endpoint, s3_bucket: str
) -> None:
    tier = S3Tier(s3_endpoint.settings(s3_bucket, part_size=PART, prefix="kv/v1/"))
    try:
        data = blob(70_000)
        meta = meta_for(data, "layout")
        staged = await tier.stage(chunk_digest("kvcache", "layout"))
        await staged.write(data)
        assert await staged.publish(meta)
    finally:
        await tier.close()
    admin = s3_endpoint.admin()
    key = f"kv/v1/{chunk_digest('kvcache', 'layout').hex()}"
    assert [o["Key"] for o in admin.list_objects_v2(Bucket=s3_bucket)["Contents"]] == [key]
    obj = admin.get_object(Bucket=s3_bucket, Key=key)
    assert obj["Body"].read() == data + chunkfile.encode_footer(meta)
    assert obj["Metadata"]["kvgw-size"] == str(len(data))
    assert obj["Metadata"]["kvgw-checksum"] == f"{meta.checksum:016x}"
    assert "-" not in obj["ETag"]  # one PutObject, no multipart upload


async def test_large_chunk_streams_as_multipart_with_bounded_memory(
    tier: S3Tier, s3_endpoint: S3Endpoint, s3_bucket: str
) -> None:
    admin = s3_endpoint.admin()
    data = blob(3 * PART + 5, seed=4)
    staged = await write(tier, data, "big", piece=777_777)
    key = tier.key_for(chunk_digest("kvcache", "big"))
    assert staged.upload_id is not None
    assert staged.data_key.startswith(f"{key}.")  # the data object: a key of this write's own
    deadline = time.monotonic() + 20
    while True:  # the parts cut so far are (being) uploaded while the caller keeps writing
        parts = admin.list_parts(Bucket=s3_bucket, Key=staged.data_key, UploadId=staged.upload_id).get("Parts", [])
        if len(parts) == 3 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert [p["Size"] for p in parts] == [PART] * 3
    assert 1 <= staged.peak_parts_in_flight <= 2
    # an uncompleted multipart upload is not an object, for S3 nor for the tier
    assert "Contents" not in admin.list_objects_v2(Bucket=s3_bucket)
    with pytest.raises(ClientError):
        admin.head_object(Bucket=s3_bucket, Key=key)
    with pytest.raises(ChunkNotFound):
        await tier.stat(chunk_digest("kvcache", "big"))
    assert [d async for d in tier.scan()] == []

    data_key = staged.data_key
    meta = meta_for(data, "big")
    assert await staged.publish(meta)
    # the chunk object is a manifest: the footer alone, naming the data object; one conditional PutObject
    manifest = admin.get_object(Bucket=s3_bucket, Key=key)
    assert manifest["Body"].read() == chunkfile.encode_footer(meta)
    assert manifest["Metadata"]["kvgw-data"] == data_key.rsplit(".", 1)[1]
    assert manifest["Metadata"]["kvgw-size"] == str(len(data))
    assert manifest["Metadata"]["kvgw-checksum"] == f"{meta.checksum:016x}"
    head = admin.head_object(Bucket=s3_bucket, Key=data_key)
    assert head["ETag"].strip('"').endswith("-4")  # 3 full parts + (5 bytes + footer)
    assert head["ContentLength"] == len(data) + len(chunkfile.encode_footer(meta))  # the POSIX encoding
    assert sorted(o["Key"] for o in admin.list_objects_v2(Bucket=s3_bucket)["Contents"]) == [key, data_key]
    assert admin.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    digest = chunk_digest("kvcache", "big")
    assert bytes(await tier.read(digest, 0, len(data))) == data
    assert await tier.stat(digest) == meta
    assert await tier.delete(digest)  # the manifest and its data object
    assert "Contents" not in admin.list_objects_v2(Bucket=s3_bucket)


async def test_small_chunk_never_starts_a_multipart_upload(
    tier: S3Tier, s3_endpoint: S3Endpoint, s3_bucket: str
) -> None:
    staged = await write(tier, blob(PART), "exactly-one-part")
    assert staged.upload_id is None
    assert s3_endpoint.admin().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert await staged.publish(meta_for(blob(PART), "exactly-one-part"))


async def test_discard_aborts_the_multipart_upload(tier: S3Tier, s3_endpoint: S3Endpoint, s3_bucket: str) -> None:
    staged = await write(tier, blob(2 * PART + 1), "dropped")
    assert staged.upload_id is not None
    await staged.discard()
    admin = s3_endpoint.admin()
    assert admin.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert "Contents" not in admin.list_objects_v2(Bucket=s3_bucket)
    with pytest.raises(BackendError):
        await staged.write(b"more")


async def test_losing_a_multipart_race_aborts_the_loser(
    tier: S3Tier, s3_endpoint: S3Endpoint, s3_bucket: str
) -> None:
    assert await store(tier, blob(10), "raced")
    assert await store(tier, blob(PART + 10), "raced") is False
    admin = s3_endpoint.admin()
    assert admin.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    key = tier.key_for(chunk_digest("kvcache", "raced"))
    assert [o["Key"] for o in admin.list_objects_v2(Bucket=s3_bucket)["Contents"]] == [key]  # its data: deleted
    assert bytes(await tier.read(chunk_digest("kvcache", "raced"), 0, 10)) == blob(10)


async def test_cleanup_staging_deletes_data_objects_no_manifest_names(
    tier: S3Tier, s3_endpoint: S3Endpoint, s3_bucket: str
) -> None:
    """A writer that died between completing its data object and publishing the manifest (or a loser
    that could not delete its own) leaves a data object: invisible, counted, and removed once old."""
    admin = s3_endpoint.admin()
    kept_digest = chunk_digest("kvcache", "kept")
    assert await store(tier, blob(PART + 1), "kept")
    kept = tier.key_for(kept_digest)
    orphan = tier.data_key(tier.key_for(chunk_digest("kvcache", "died")), "ab" * 16)
    admin.put_object(Bucket=s3_bucket, Key=orphan, Body=b"o" * 100)
    foreign = tier.data_key(kept, "cd" * 16)  # beside a live manifest, but not the one it names
    admin.put_object(Bucket=s3_bucket, Key=foreign, Body=b"f" * 100)
    assert [d async for d, _ in tier.scan()] == [kept_digest]
    assert await tier.cleanup_staging(3600) == 0  # young: maybe a writer about to publish
    assert await tier.cleanup_staging(0) == 2
    left = sorted(o["Key"] for o in admin.list_objects_v2(Bucket=s3_bucket)["Contents"])
    assert len(left) == 2 and left[0] == kept and left[1].startswith(f"{kept}.")
    assert bytes(await tier.read(kept_digest, 0, PART + 1)) == blob(PART + 1)


async def test_cleanup_staging_leaves_an_upload_whose_start_is_still_unanswered(
    tier: S3Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store lists a new multipart upload as soon as it made it; its reply (the upload id this
    instance protects) may reach us after a cleanup pass's listing (two connections, one loop). That
    pass, even with no age limit, must leave the upload alone: it is ours and about to be written."""
    real_api = tier.api
    swept: list[int] = []

    async def create_answered_after_a_cleanup(what: str, op: str, **params: Any) -> Any:
        response = await real_api(what, op, **params)
        if op == "create_multipart_upload":
            swept.append(await tier.cleanup_staging(0))  # the listing is answered first
        return response

    monkeypatch.setattr(tier, "api", create_answered_after_a_cleanup)
    data = blob(2 * PART + 1)
    assert await store(tier, data, "started")
    assert swept == [0]
    assert bytes(await tier.read(chunk_digest("kvcache", "started"), 0, len(data))) == data


# -- conditional writes --------------------------------------------------------------------------


def test_endpoint_honours_if_none_match_on_put(s3_endpoint: S3Endpoint, s3_bucket: str) -> None:
    """What create-if-absent rests on; not on CompleteMultipartUpload (``backends.s3_staged``)."""
    admin = s3_endpoint.admin()
    admin.put_object(Bucket=s3_bucket, Key="k", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as put_err:
        admin.put_object(Bucket=s3_bucket, Key="k", Body=b"second", IfNoneMatch="*")
    assert put_err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert admin.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"first"


@pytest.mark.parametrize("server", S3_SERVERS)
@pytest.mark.parametrize("size", [40_000, PART + 1, 3 * PART])
async def test_concurrent_publishers_in_different_gateways(
    request: pytest.FixtureRequest, server: str, size: int
) -> None:
    """Across tier instances only the store can arbitrate: every chunk, of one part or several, is
    published by a conditional PutObject (Ceph RGW ignores If-None-Match on CompleteMultipartUpload and
    overwrites; moto 5.2.1 checks it there without a lock, so concurrent completes all "won"). Exactly
    one writer wins, and every reader, through any instance, sees the winner's bytes."""
    endpoint = s3_endpoint_of(request, server)
    bucket = endpoint.create_bucket()
    tiers = [S3Tier(endpoint.settings(bucket, part_size=PART)) for _ in range(4)]
    try:
        datas = [blob(size, seed=i) for i in range(len(tiers))]
        staged = [await write(t, d, "contended") for t, d in zip(tiers, datas, strict=True)]
        results = await asyncio.gather(*(s.publish(meta_for(d, "contended")) for s, d in
                                         zip(staged, datas, strict=True)))
        assert results.count(True) == 1, results
        winner = datas[results.index(True)]
        digest = chunk_digest("kvcache", "contended")
        for t in tiers:
            assert bytes(await t.read(digest, 0, size)) == winner
            assert b"".join([p async for p in t.stream(digest, 0, size, 1 << 20)]) == winner
            assert (await t.stat(digest)).checksum == xxhash.xxh3_64_intdigest(winner)
        assert await tiers[0].cleanup_staging(0) == 0  # the losers deleted their data objects
    finally:
        for t in tiers:
            await t.close()
        endpoint.drop_bucket(bucket)


@pytest.mark.parametrize(("size", "lost"), [(30_000, "PUT {key} "), (PART + 1, "PUT {key} "),
                                            (PART + 1, "POST {key}.")])
async def test_lost_reply_to_our_own_conditional_write_still_counts_as_created(
    s3_endpoint: S3Endpoint, s3_bucket: str, size: int, lost: str
) -> None:
    """The write lands, its reply is lost, botocore retries: the retry meets our own object (412 on
    the chunk object or manifest, or an already completed upload of the data object). The writer token
    in the metadata tells it was ours."""
    proxy = FaultProxy(s3_endpoint.url)
    tier = S3Tier(s3_endpoint.settings(s3_bucket, endpoint_url=proxy.url, part_size=PART))
    try:
        digest = chunk_digest("kvcache", "lost-reply")
        path = f"/{s3_bucket}/{tier.key_for(digest)}"
        data = blob(size)
        staged = await write(tier, data, "lost-reply")
        proxy.drop_reply_to(lost.format(key=path).encode())
        assert await staged.publish(meta_for(data, "lost-reply")) is True
        assert proxy.dropped == 1
        assert await store(tier, blob(size, seed=1), "lost-reply") is False
        assert bytes(await tier.read(digest, 0, size)) == data
    finally:
        await tier.close()
        proxy.close()


async def test_without_conditional_writes_a_head_guards_publish(s3_endpoint: S3Endpoint, s3_bucket: str) -> None:
    tier = S3Tier(s3_endpoint.settings(s3_bucket, part_size=PART, conditional_writes=False))
    try:
        for size in (100, PART + 1):
            assert await store(tier, blob(size), f"head-{size}") is True
            assert await store(tier, blob(size, seed=1), f"head-{size}") is False
            assert bytes(await tier.read(chunk_digest("kvcache", f"head-{size}"), 0, size)) == blob(size)
    finally:
        await tier.close()


# -- reading footers ---------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1000, PART + 1])  # the chunk itself, or a manifest of its data object
async def test_stat_reads_a_footer_larger_than_its_first_guess(tier: S3Tier, size: int) -> None:
    data = blob(size)
    meta = ChunkMeta(bucket="kvcache", key="fat", size=len(data), checksum=xxhash.xxh3_64_intdigest(data),
                     created=1.0, attrs=tuple(sorted((f"a{i}", "v" * 100) for i in range(80))))  # ~9 KiB footer
    digest = chunk_digest("kvcache", "fat")
    staged = await tier.stage(digest)
    await staged.write(data)
    assert await staged.publish(meta)
    assert await tier.stat(digest) == meta
    assert [m async for _, m in tier.scan()] == [meta]


async def test_stat_rejects_metadata_that_disagrees_with_the_footer(
    tier: S3Tier, s3_endpoint: S3Endpoint, s3_bucket: str
) -> None:
    data = blob(500)
    digest = chunk_digest("kvcache", "liar")
    body = data + chunkfile.encode_footer(meta_for(data, "liar"))
    s3_endpoint.admin().put_object(Bucket=s3_bucket, Key=tier.key_for(digest), Body=body,
                                   Metadata={"kvgw-size": "499"})
    with pytest.raises(ChunkCorrupt):
        await tier.stat(digest)
    assert await tier.stat_many([digest]) == [None]


async def test_scan_skips_foreign_objects_and_lists_empty_ones_as_unreadable(
    tier: S3Tier, s3_endpoint: S3Endpoint, s3_bucket: str
) -> None:
    admin = s3_endpoint.admin()
    admin.put_object(Bucket=s3_bucket, Key="chunks/README", Body=b"not a chunk")
    admin.put_object(Bucket=s3_bucket, Key="chunks/" + "AB" * 16, Body=b"upper case: not a name kvgw makes")
    admin.put_object(Bucket=s3_bucket, Key="elsewhere/" + "ab" * 16, Body=b"outside the prefix")
    empty = chunk_digest("kvcache", "empty-object")
    admin.put_object(Bucket=s3_bucket, Key=tier.key_for(empty), Body=b"")
    assert await store(tier, blob(10), "real")
    found = {d: m async for d, m in tier.scan()}
    assert set(found) == {empty, chunk_digest("kvcache", "real")}
    assert found[empty] is None


@pytest.mark.parametrize("size", [2000, PART + 1])  # a manifest's data object is what is kept
async def test_quarantine_keeps_a_copy_under_its_prefix(
    tier: S3Tier, s3_endpoint: S3Endpoint, s3_bucket: str, size: int
) -> None:
    data = blob(size)
    digest = chunk_digest("kvcache", "suspect")
    assert await store(tier, data, "suspect")
    assert await tier.quarantine(digest)
    admin = s3_endpoint.admin()
    kept = admin.list_objects_v2(Bucket=s3_bucket, Prefix="quarantine/")["Contents"]
    assert [o["Key"].split(".")[0] for o in kept] == [f"quarantine/{digest.hex()}"]
    assert admin.get_object(Bucket=s3_bucket, Key=kept[0]["Key"])["Body"].read()[: len(data)] == data
    assert await tier.usage() == 0  # quarantined bytes are not the tier's chunks
    assert "Contents" not in admin.list_objects_v2(Bucket=s3_bucket, Prefix="chunks/")


# -- dead, hung and returning endpoints --------------------------------------------------------


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def every_operation(tier: S3Tier) -> dict[str, Callable[[], Awaitable[object]]]:
    digest = chunk_digest("kvcache", "any")

    async def small_publish() -> object:
        staged = await tier.stage(digest)
        await staged.write(b"x" * 100)
        return await staged.publish(meta_for(b"x" * 100, "any"))

    async def large_write() -> object:
        staged = await tier.stage(digest)
        try:
            await staged.write(b"x" * (PART + 1))
        finally:
            await staged.discard()  # best effort: must neither hang nor raise
        return None

    async def stream() -> object:
        return [p async for p in tier.stream(digest, 0, 10, 4)]

    async def scan() -> object:
        return [d async for d in tier.scan()]

    return {
        "publish": small_publish, "multipart write": large_write, "stream": stream, "scan": scan,
        "read": lambda: tier.read(digest, 0, 10), "stat": lambda: tier.stat(digest),
        "stat_many": lambda: tier.stat_many([digest, chunk_digest("kvcache", "other")]),
        "delete": lambda: tier.delete(digest), "quarantine": lambda: tier.quarantine(digest),
        "cleanup_staging": lambda: tier.cleanup_staging(0), "usage": tier.usage,
    }


SCHEDULING_SLACK = 3.0
"""Seconds allowed past an operation deadline for a loaded machine; what the deadline bounds is far
longer (botocore's own 30 s timeouts, or retries without end)."""


async def timed_failure(op: Callable[[], Awaitable[object]]) -> tuple[float, BaseException | None]:
    start = time.monotonic()
    try:
        await op()
    except BaseException as exc:
        return time.monotonic() - start, exc
    return time.monotonic() - start, None


async def test_refused_connections_fail_every_operation_within_the_deadline() -> None:
    deadline = 2.0
    tier = S3Tier(S3TierSettings(endpoint_url=closed_port_url(), bucket="nowhere", access_key="a",
                                 secret_key=SecretStr("s"), addressing_style="path", max_attempts=3,
                                 operation_timeout=deadline, part_size=PART, breaker_threshold=10_000))
    try:
        ops = every_operation(tier)
        outcomes = await asyncio.gather(*(timed_failure(op) for op in ops.values()))
        for name, (elapsed, exc) in zip(ops, outcomes, strict=True):
            assert isinstance(exc, TierUnavailable), (name, exc)
            assert elapsed < 2 * deadline + SCHEDULING_SLACK, (name, elapsed)  # discard after a failed write: 2 ops
    finally:
        await tier.close()


async def test_max_attempts_counts_the_first_try() -> None:
    """botocore's ``retries.max_attempts`` means *retries*; the tier passes ``total_max_attempts``.
    (A POST, CreateMultipartUpload: aiohttp itself resends an idempotent request once when a reused
    connection is closed under it, which would double the count.)"""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = 0

    def accept_and_hang_up() -> None:
        nonlocal accepted
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                accepted += 1
                conn.close()

    threading.Thread(target=accept_and_hang_up, daemon=True).start()
    port = listener.getsockname()[1]
    tier = S3Tier(S3TierSettings(endpoint_url=f"http://127.0.0.1:{port}", bucket="nowhere", access_key="a",
                                 secret_key=SecretStr("s"), addressing_style="path", max_attempts=3, part_size=PART))
    try:
        staged = await tier.stage(chunk_digest("kvcache", "x"))
        with pytest.raises(TierUnavailable):
            await staged.write(b"x" * (PART + 1))  # starts the multipart upload
        await staged.discard()
        assert accepted == 3
    finally:
        await tier.close()
        listener.close()


async def warm_up(tier: S3Tier, key: str, attempts: int = 5) -> None:
    """Store ``blob(10)`` under ``key`` through a tier with a short deadline. The tier's first call
    also builds its HTTP session (TLS contexts, in a worker thread), which a loaded machine may not
    finish within that deadline: that call is tried again, and one whose PUT landed although its answer
    came too late leaves the chunk stored (``store`` then answers False)."""
    for _ in range(attempts):
        with contextlib.suppress(TierUnavailable):
            await store(tier, blob(10), key)
            return
    pytest.fail(f"the endpoint did not store {key!r} within the deadline in {attempts} attempts")


async def test_hung_endpoint_is_cut_at_the_operation_deadline(moto_server: S3Endpoint) -> None:
    """SIGSTOPped server: connections are accepted by the kernel, nothing ever answers, and botocore's
    own timeouts (30 s here) are far away. Every operation still ends at the deadline."""
    deadline = 1.0
    tier = S3Tier(moto_server.settings("kvgw-private", part_size=PART, connect_timeout=30.0, read_timeout=30.0,
                                       operation_timeout=deadline, breaker_threshold=10_000))
    assert moto_server.server is not None
    try:
        await warm_up(tier, "before")  # a pooled, keep-alive connection exists
        moto_server.server.pause()
        ops = every_operation(tier)
        outcomes = await asyncio.gather(*(timed_failure(op) for op in ops.values()))
        for name, (elapsed, exc) in zip(ops, outcomes, strict=True):
            assert isinstance(exc, TierUnavailable), (name, exc)
            assert elapsed < 2 * deadline + SCHEDULING_SLACK, (name, elapsed)  # discard after a failed write: 2 ops
        moto_server.server.resume()
        assert bytes(await tier.read(chunk_digest("kvcache", "before"), 0, 10)) == blob(10)
    finally:
        moto_server.server.resume()
        await tier.close()


async def test_breaker_fails_fast_during_an_outage_and_recovers(moto_server: S3Endpoint) -> None:
    """The breaker's clock is a fake one: the circuit stays open until the test moves time past the
    cooldown, however slow the machine; "fails fast" is proven by the breaker refusing each call
    before it reaches the network, not by a stopwatch."""
    server = moto_server.server
    assert server is not None
    now = [1000.0]
    tier = S3Tier(moto_server.settings("kvgw-private", part_size=PART, max_attempts=2, operation_timeout=3.0,
                                       breaker_threshold=3, breaker_cooldown=30.0), clock=lambda: now[0])
    digest = chunk_digest("kvcache", "outage")
    try:
        assert await store(tier, blob(10), "outage")
        server.stop()
        for _ in range(3):
            with pytest.raises(TierUnavailable) as refused:
                await tier.stat(digest)
            assert "circuit open" not in str(refused.value)  # these reached the dead endpoint
        now[0] += 29.0  # open, and still inside the cooldown
        for name, op in every_operation(tier).items():
            _, exc = await timed_failure(op)
            assert isinstance(exc, TierUnavailable), (name, exc)
            assert "circuit open" in str(exc), (name, exc)  # refused by the breaker: no network I/O
        server.start()  # same port, empty state
        moto_server.admin().create_bucket(Bucket="kvgw-private")
        _, exc = await timed_failure(lambda: tier.stat(digest))
        assert isinstance(exc, TierUnavailable) and "circuit open" in str(exc), exc  # no probe before the cooldown
        now[0] += 1.0  # the cooldown is over: the next call is the probe
        with pytest.raises(ChunkNotFound):  # the probe: the endpoint answers (moto lost its objects)
            await tier.stat(digest)
        assert await store(tier, blob(10), "outage")  # closed again
        assert bytes(await tier.read(digest, 0, 10)) == blob(10)
    finally:
        await tier.close()


async def test_request_path_call_ends_at_its_budget_and_trips_the_breaker(moto_server: S3Endpoint) -> None:
    """SIGSTOPped server (issue 12, item 2). A call made on the request path (``request_budget``) ends when
    its budget runs out, while a call on the background budget still waits for the frozen server; those
    timeouts count for the breaker like errors, and it opens. After the cooldown exactly one call, the
    probe, goes through; every other call fails fast until the probe has answered."""
    server = moto_server.server
    assert server is not None
    now = [1000.0]
    tier = S3Tier(moto_server.settings("kvgw-private", part_size=PART, operation_timeout=120.0, breaker_threshold=2,
                                       breaker_cooldown=30.0), clock=lambda: now[0])
    digest = chunk_digest("kvcache", "hung")
    try:
        assert await store(tier, blob(10), "hung")
        server.pause()
        background = asyncio.ensure_future(tier.stat(digest))  # no budget: up to the 120 s deadline
        await asyncio.sleep(0)
        for _ in range(2):
            with request_budget(0.2), pytest.raises(TierUnavailable, match="request path"):
                await tier.stat(digest)
        assert not background.done()  # the request path answered while this call is still hanging
        assert tier.breaker_state == "open"
        with request_budget(0.2), pytest.raises(TierUnavailable, match="circuit open"):
            await tier.stat(digest)
        now[0] += 31.0  # past the cooldown: the next call is the one probe
        probe = asyncio.ensure_future(tier.stat(digest))
        await asyncio.sleep(0)
        assert tier.breaker_state == "half-open"
        for name, op in every_operation(tier).items():
            _, exc = await timed_failure(op)
            assert isinstance(exc, TierUnavailable) and "circuit open" in str(exc), (name, exc)
        assert not probe.done()
        server.resume()
        assert (await probe).size == 10  # the probe's answer closes the breaker
        assert tier.breaker_state == "closed"
        assert bytes(await tier.read(digest, 0, 10)) == blob(10)
        assert (await background).size == 10
    finally:
        server.resume()
        await tier.close()


async def test_request_path_retries_refused_connections_within_its_budget() -> None:
    """A dead endpoint (issue 12, item 3): on the request path the tier makes ``request_max_attempts``
    attempts ``request_retry_backoff`` apart and fails, while the same call on the background budget
    (back-off from 2 s) is still between its attempts."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = 0

    def accept_and_hang_up() -> None:
        nonlocal accepted
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                accepted += 1
                conn.close()

    threading.Thread(target=accept_and_hang_up, daemon=True).start()
    tier = S3Tier(S3TierSettings(endpoint_url=f"http://127.0.0.1:{listener.getsockname()[1]}", bucket="nowhere",
                                 access_key="a", secret_key=SecretStr("s"), addressing_style="path",
                                 max_attempts=3, retry_backoff=2.0, request_max_attempts=3,
                                 request_retry_backoff=0.01, breaker_threshold=100))
    try:
        background = asyncio.ensure_future(tier.stat(chunk_digest("kvcache", "x")))
        await asyncio.sleep(0)
        with request_budget(5.0), pytest.raises(TierUnavailable):
            await tier.stat(chunk_digest("kvcache", "y"))
        assert not background.done()
        with pytest.raises(TierUnavailable):
            await background
        assert accepted >= 3 + 3  # both made all their attempts (aiohttp may resend a GET once per attempt)
    finally:
        await tier.close()
        listener.close()


# -- pure parts ---------------------------------------------------------------------------------


def test_breaker_state_machine() -> None:
    now = [100.0]
    breaker = CircuitBreaker(threshold=2, cooldown=5.0, clock=lambda: now[0])
    assert breaker.admit("op") is False
    breaker.record(probe=False, unavailable=True)
    breaker.record(probe=False, unavailable=False)  # a success resets the count
    breaker.record(probe=False, unavailable=True)
    assert not breaker.is_open
    breaker.record(probe=False, unavailable=True)
    assert breaker.is_open
    with pytest.raises(TierUnavailable):
        breaker.admit("op")
    now[0] += 5.0
    assert breaker.admit("op") is True  # the one probe
    with pytest.raises(TierUnavailable):
        breaker.admit("op")  # others still fail fast while it runs
    breaker.record(probe=True, unavailable=True)  # probe failed: a full cooldown again
    with pytest.raises(TierUnavailable):
        breaker.check("op")
    now[0] += 5.0
    breaker.check("op")  # due: check() lets it pass without taking the probe
    assert breaker.admit("op") is True
    breaker.abandon_probe()  # cancelled: the next caller probes
    assert breaker.admit("op") is True
    breaker.record(probe=True, unavailable=False)
    assert not breaker.is_open and breaker.admit("op") is False


def _client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "Op")


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (_client_error("NoSuchKey", 404), ChunkNotFound),
        (_client_error("404", 404), ChunkNotFound),
        (_client_error("NoSuchBucket", 404), BackendError),
        (_client_error("PreconditionFailed", 412), ChunkExists),
        (_client_error("ConditionalRequestConflict", 409), WriteConflict),
        (_client_error("InvalidRange", 416), RangeNotSatisfiable),
        (_client_error("NoSuchUpload", 404), UploadGone),
        (_client_error("SlowDown", 503), TierUnavailable),
        (_client_error("InternalError", 500), TierUnavailable),
        (_client_error("AccessDenied", 403), BackendError),
        (EndpointConnectionError(endpoint_url="http://x"), TierUnavailable),
        (ConnectTimeoutError(endpoint_url="http://x"), TierUnavailable),
        (TimeoutError(), TierUnavailable),
        (ConnectionResetError(), TierUnavailable),
        (ValueError("odd"), BackendError),
    ],
)
def test_error_translation(exc: BaseException, expected: type[BackendError]) -> None:
    got = translate(exc, "op")
    assert type(got) is expected
    assert str(got).startswith("op")


def test_settings_nest_into_the_gateway_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    class SettingsShape(BaseSettings):  # the shape of gateway.config.Settings
        model_config = SettingsConfigDict(env_prefix="KVGW_", env_nested_delimiter="__", extra="ignore")
        s3: S3TierSettings | None = None

    assert SettingsShape().s3 is None
    for name, value in {"ENDPOINT_URL": "https://minio:9000", "BUCKET": "kv-chunks", "ACCESS_KEY": "ak",
                        "SECRET_KEY": "sk", "VERIFY_TLS": "false", "PART_SIZE": str(16 << 20),
                        "ADDRESSING_STYLE": "path", "MAX_ATTEMPTS": "5", "LOOKUP_TIMEOUT": "0.03",
                        "REQUEST_TIMEOUT": "0.4"}.items():
        monkeypatch.setenv(f"KVGW_S3__{name}", value)
    s3 = SettingsShape().s3
    assert s3 is not None
    assert (s3.endpoint_url, s3.bucket, s3.access_key, s3.verify_tls, s3.part_size, s3.max_attempts) == (
        "https://minio:9000", "kv-chunks", "ak", False, 16 << 20, 5)
    assert (s3.lookup_timeout, s3.request_timeout) == (0.03, 0.4)
    assert s3.secret_key is not None and s3.secret_key.get_secret_value() == "sk"
    assert "sk" not in repr(s3)
    monkeypatch.setenv("KVGW_S3__VERIFY_TLS", "/etc/ssl/minio-ca.pem")
    assert SettingsShape().s3 is not None and SettingsShape().s3.verify_tls == "/etc/ssl/minio-ca.pem"  # type: ignore[union-attr]


@pytest.mark.parametrize("bad", [{"part_size": 1 << 20}, {"prefix": "/abs"}, {"max_attempts": 0},
                                 {"addressing_style": "weird"}, {"no_such_field": 1}, {"access_key": "no-secret"}])
def test_settings_refuse_what_s3_or_kvgw_cannot_use(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        S3TierSettings(bucket="b-ok", **bad)

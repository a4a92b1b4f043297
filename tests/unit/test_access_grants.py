"""``gateway.access.Directory``: the delete grant, and the catalog re-read an unknown access key or
bucket name causes (single-flight, rate-limited), over a stand-in catalog that counts its reads."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from backends.catalog.store import BucketPolicy, CredentialRecord
from gateway.access import ANONYMOUS_READ_WRITE, ANONYMOUS_ROOT, Action, Directory, Principal
from gateway.errors import AccessDenied, NoSuchBucket, Unauthorized

BUCKET = BucketPolicy(name="kvcache", max_chunk_bytes=1 << 20)
OTHER = BucketPolicy(name="other", max_chunk_bytes=1 << 20)


class CountingCatalog:
    def __init__(self, read_seconds: float = 0.0) -> None:
        self.records: list[CredentialRecord] = []
        self.buckets = [BUCKET, OTHER]
        self.reads = 0
        self.read_seconds = read_seconds
        self._lock = threading.Lock()

    def list_buckets(self) -> list[BucketPolicy]:
        return list(self.buckets)

    def credentials(self) -> list[CredentialRecord]:
        with self._lock:
            self.reads += 1
            records = list(self.records)
        time.sleep(self.read_seconds)
        return records

    def add(self, access_key: str, **kw: object) -> None:
        with self._lock:
            self.records.append(CredentialRecord(access_key=access_key, secret="s", is_root=False,
                                                 grants=kw.pop("grants", {"kvcache": (True, True)}),  # type: ignore[arg-type]
                                                 **kw))  # type: ignore[arg-type]


def directory(catalog: CountingCatalog, interval: float = 0.25) -> Directory:
    d = Directory(catalog, refresh_seconds=3600, unknown_key_interval=interval)  # type: ignore[arg-type]
    d.load()
    return d


def test_delete_is_its_own_grant() -> None:
    catalog = CountingCatalog()
    catalog.add("WRITER")
    catalog.add("DELETER", deletes=frozenset({"kvcache"}))
    d = directory(catalog)
    writer, deleter = d.principal_for("WRITER"), d.principal_for("DELETER")
    d.authorize(writer, BUCKET, Action.WRITE)
    with pytest.raises(AccessDenied):
        d.authorize(writer, BUCKET, Action.DELETE)
    d.authorize(deleter, BUCKET, Action.DELETE)
    with pytest.raises(AccessDenied):
        d.authorize(deleter, OTHER, Action.DELETE)
    with pytest.raises(AccessDenied):
        d.authorize(deleter, BUCKET, Action.ADMIN)
    d.authorize(Principal(access_key="ROOT", is_root=True), BUCKET, Action.DELETE)
    d.authorize(ANONYMOUS_ROOT, BUCKET, Action.DELETE)  # --anonymous-admin
    with pytest.raises(Unauthorized):
        d.authorize(ANONYMOUS_READ_WRITE, BUCKET, Action.DELETE)  # --anonymous alone never deletes


def test_principals_follow_each_catalog_read() -> None:
    """Principals are built once per catalog read: a grant changed in the catalog shows after the next
    read, and a key the credentials view holds but the principals view not yet (a reload in another
    thread between two reads of one request) still gets its principal."""
    catalog = CountingCatalog()
    catalog.add("KEY", grants={"kvcache": (True, False)})
    d = directory(catalog)
    first = d.principal_for("KEY")
    assert d.principal_for("KEY") is first  # not rebuilt per request
    with pytest.raises(AccessDenied):
        d.authorize(first, BUCKET, Action.WRITE)
    catalog.records = []
    catalog.add("KEY", grants={"kvcache": (True, True)})
    d.load()
    d.authorize(d.principal_for("KEY"), BUCKET, Action.WRITE)
    d._principals = {}  # the moment between the two views' replacement
    assert d.principal_for("KEY").grants == {"kvcache": (True, True)}


async def test_an_unknown_key_rereads_the_catalog_once() -> None:
    catalog = CountingCatalog()
    d = directory(catalog)
    reads = catalog.reads
    catalog.add("NEW")
    assert await d.knows("NEW")
    assert catalog.reads == reads + 1
    assert await d.knows("NEW")  # known now: no read
    assert catalog.reads == reads + 1
    assert d.unknown_key_reloads == 1


async def test_waiting_callers_share_a_reread() -> None:
    """Callers arriving together share the next re-read: a re-read that began before a caller arrived
    may have missed its credential, so at most two in all."""
    catalog = CountingCatalog(read_seconds=0.05)
    d = directory(catalog, interval=0.0)
    reads = catalog.reads
    results = await asyncio.gather(*(d.knows(f"BOGUS{i}") for i in range(50)))
    assert results == [False] * 50
    assert catalog.reads - reads <= 2


async def test_bogus_keys_cannot_hammer_the_catalog() -> None:
    catalog = CountingCatalog()
    d = directory(catalog, interval=0.1)
    reads = catalog.reads
    started = time.monotonic()
    while time.monotonic() - started < 0.55:
        assert not await d.knows("BOGUS")
    assert catalog.reads - reads <= 7  # one per 0.1 s, plus the first


async def test_a_catalog_that_cannot_be_read_rejects() -> None:
    catalog = CountingCatalog()
    d = directory(catalog)

    def broken() -> list[CredentialRecord]:
        raise OSError("catalog down")

    catalog.credentials = broken  # type: ignore[method-assign]
    assert not await d.knows("ANY")


async def test_long_or_empty_keys_never_reread() -> None:
    catalog = CountingCatalog()
    d = directory(catalog)
    reads = catalog.reads
    assert not await d.knows("")
    assert not await d.knows("K" * 500)
    assert catalog.reads == reads


async def test_a_bucket_created_just_after_a_periodic_read_is_found() -> None:
    """The CI failure of round 2: a periodic re-read that began before another gateway created the
    bucket ends after it; a request for the bucket must not be answered from that read."""
    catalog = CountingCatalog()
    d = directory(catalog, interval=0.0)
    await d.refresh()  # the periodic read, which cannot see the bucket yet
    catalog.buckets.append(BucketPolicy(name="fresh", max_chunk_bytes=1 << 20))
    assert (await d.bucket("fresh")).name == "fresh"


async def test_an_unknown_bucket_is_still_unknown_after_one_reread() -> None:
    catalog = CountingCatalog()
    d = directory(catalog, interval=0.0)
    reads = catalog.reads
    with pytest.raises(NoSuchBucket):
        await d.bucket("absent")
    assert catalog.reads == reads + 1

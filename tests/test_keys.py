"""Listing a namespace's held keys (``keys()``, what ``dmutex status`` without KEY shows).

Each store's ``keys(limit)`` on InMemoryBackend, SQLite, fakeredis and
mongomock, driven as the command drives it (``open_store`` /
``open_readwrite_store`` and a sync driver), and ``Reader.namespace`` over
them: the held keys only, sorted, at most ``limit``; the slots a store
reads (below its ``max_permits``), a read-write lock held by a writer or a
reader (not one left with a waiting writer's intent alone), rows and names
that are not dmutex's passed over. The real servers' statements run in
``tests/integration/test_cli_namespace.py``. Leases are long (an hour)
unless a test makes one expire: on a clock an hour behind (SQLite,
mongomock), a ``ManualClock`` moved on (InMemoryBackend), or a real short
TTL (fakeredis, whose server decides).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fakeredis
import mongomock
import pytest

from dmutex import (
    DMutex,
    DReadWriteLock,
    DSemaphore,
    InMemoryBackend,
    ManualClock,
    SQLiteBackend,
    UnsupportedClientError,
)
from dmutex._backends import open_readwrite_store, open_store
from dmutex._backends.redis.requests import SCAN_COUNT, glob_escape
from dmutex._cli.holders import Reader
from dmutex._core.abc import Listing
from dmutex._core.waiting import Waiter
from dmutex._options import DEFAULT_PREFIX, Kind, Options
from dmutex._runtime.drivers import SyncDriver
from tests._support.mongo_clients import frozen_ttl_monitor
from tests._support.redis_clients import Recording, SetEvalRedis

HOUR = 3600.0
BACKENDS = ["memory", "sqlite", "fakeredis", "mongomock"]


@dataclass
class Backend:
    name: str
    client: Any
    clock: ManualClock | None = None
    """InMemoryBackend's own clock, which the test moves."""


@pytest.fixture(params=BACKENDS)
def backend(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Backend]:
    if request.param == "memory":
        clock = ManualClock(time.time())
        yield Backend("memory", InMemoryBackend(clock=clock), clock)
    elif request.param == "sqlite":
        sqlite = SQLiteBackend(tmp_path / "locks.sqlite3")
        try:
            yield Backend("sqlite", sqlite)
        finally:
            sqlite.close()
    elif request.param == "fakeredis":
        redis_client = fakeredis.FakeRedis()
        try:
            yield Backend("fakeredis", redis_client)
        finally:
            redis_client.close()
    else:
        monkeypatch.setattr(mongomock, "utcnow", frozen_ttl_monitor)
        yield Backend("mongomock", mongomock.MongoClient())


def options(kind: Kind, service: str = "svc", permits: int = 1) -> Options:
    """The options ``dmutex status`` reads ``service``'s locks of ``kind`` with."""
    prefix = DEFAULT_PREFIX[kind]
    return Options.check(
        kind,
        service_name=service,
        max_permits=permits,
        default_ttl_seconds=300,
        db_name="dmutex",
        collection_prefix=prefix,
        table_prefix=prefix,
    )


def keys(client: object, limit: int, *, permits: int = 1, service: str = "svc") -> list[str]:
    """The store's ``keys(limit)`` for ``service``'s mutexes (semaphores of ``permits``)."""
    kind: Kind = "mutex" if permits == 1 else "semaphore"
    store = open_store(client, options(kind, service, permits), asynchronous=False)
    assert isinstance(store, Listing)
    return SyncDriver(store.clock, store.ready)(store.keys(limit))


def rw_keys(client: object, limit: int, service: str = "svc") -> list[str]:
    """The read-write store's ``keys(limit)`` for ``service``."""
    store = open_readwrite_store(client, options("readwrite", service), asynchronous=False)
    assert isinstance(store, Listing)
    return SyncDriver(store.clock, store.ready)(store.keys(limit))


def behind(backend: Backend) -> ManualClock | None:
    """The clock of a lock whose lease, of an hour or less, has run out by the store's clock."""
    if backend.name in ("sqlite", "mongomock"):
        return ManualClock(time.time() - 2 * HOUR)
    return None


def expire(backend: Backend) -> None:
    """Let the short leases that :func:`short_ttl` made run out."""
    if backend.clock is not None:
        backend.clock.advance(2.0)
    elif backend.name == "fakeredis":
        time.sleep(0.15)


def short_ttl(backend: Backend) -> float:
    """A TTL that :func:`expire` (or :func:`behind`'s clock) sees run out."""
    return {"fakeredis": 0.05, "memory": 1.0}.get(backend.name, HOUR)


# -- mutexes and semaphores ---------------------------------------------------


def test_the_held_mutex_keys_sorted_and_bounded(backend: Backend) -> None:
    client = backend.client
    held = ["b", "a", "c:d", "é", "with space", "{tag}"]
    mutex = DMutex("svc", client)
    for key in held:
        assert mutex.acquire(key, HOUR) is not None
    gone = mutex.acquire("released", HOUR)
    assert gone is not None
    assert gone.release()
    # Another service's keys, and this service's semaphores, are other namespaces.
    assert DMutex("other", client).acquire("elsewhere", HOUR) is not None
    assert DSemaphore("svc", client, max_permits=2).acquire("permits", HOUR) is not None

    assert keys(client, 100) == sorted(held)
    assert keys(client, len(held)) == sorted(held)
    two = keys(client, 2)
    assert len(two) == 2
    assert set(two) <= set(held)
    if backend.name != "fakeredis":  # SCAN meets keys in its own order
        assert two == sorted(held)[:2]
    assert keys(client, 100, service="other") == ["elsewhere"]
    assert keys(client, 100, service="nobody") == []


def test_expired_leases_are_not_listed(backend: Backend) -> None:
    client = backend.client
    assert DMutex("svc", client).acquire("kept", HOUR) is not None
    short = DMutex("svc", client, clock=behind(backend))
    assert short.acquire("lapsed", short_ttl(backend)) is not None
    expire(backend)
    assert keys(client, 10) == ["kept"]


def test_a_semaphores_keys_are_those_of_its_slots(backend: Backend) -> None:
    client = backend.client
    sem = DSemaphore("svc", client, max_permits=3)
    slots: dict[str, set[int]] = {"x": set(), "y": set()}
    for key in ("x", "x", "y"):
        permit = sem.acquire(key, HOUR)
        assert permit is not None
        slots[key].add(permit.slot)
    # z holds slot 2 alone: all three taken, then all but slot 2 released.
    z = [sem.acquire("z", HOUR) for _ in range(3)]
    for permit in z:
        assert permit is not None
        if permit.slot != 2:
            assert permit.release()
    slots["z"] = {2}
    assert keys(client, 10, permits=3) == ["x", "y", "z"]
    # A key counts once, however many of its slots are held: two keys fill a limit of 2.
    assert keys(client, 2, permits=3) == ["x", "y"]
    # A store of 2 permits reads slots 0 and 1 (as its holders() does; the
    # in-memory store's holders show every slot, and so do its keys).
    below = sorted(key for key, held in slots.items() if min(held) < 2)
    assert keys(client, 10, permits=2) == (["x", "y", "z"] if backend.name == "memory" else below)


def test_the_namespace_read_keeps_the_held_keys_and_says_more_exist(backend: Backend) -> None:
    client = backend.client
    mutex = DMutex("svc", client)
    handles = {key: mutex.acquire(key, HOUR) for key in ("a", "b", "c")}
    reader = Reader(client, service="svc", limit=1)
    whole = reader.namespace(10)
    assert [key for key, _ in whole.found] == ["a", "b", "c"]
    assert not whole.truncated
    for key, seen in whole.found:
        handle = handles[key]
        assert handle is not None
        assert [h.token for h in seen.holders] == [handle.token]
    assert whole.found[0][1].fence == (handles["a"].fence if handles["a"] else None)
    cut = reader.namespace(2)
    assert len(cut.found) == 2
    assert cut.truncated
    exact = reader.namespace(3)
    assert len(exact.found) == 3
    assert not exact.truncated, "three held keys and a bound of three: nothing more"
    empty = Reader(client, service="nobody", limit=1).namespace(10)
    assert (empty.found, empty.truncated) == ([], False)


# -- read-write locks ---------------------------------------------------------


def test_read_write_keys_held_by_a_writer_or_readers(backend: Backend) -> None:
    client = backend.client
    lock = DReadWriteLock("svc", client)
    assert lock.acquire_read("readers", HOUR) is not None
    assert lock.acquire_read("readers", HOUR) is not None
    assert lock.acquire_write("writer", HOUR) is not None
    done = lock.acquire_read("released", HOUR)
    assert done is not None
    assert done.release()
    short = DReadWriteLock("svc", client, clock=behind(backend))
    assert short.acquire_write("lapsed", short_ttl(backend)) is not None
    # A writer that waits for a reader leaves an intent; then the reader goes.
    store = open_readwrite_store(client, options("readwrite"), asynchronous=False)
    drive = SyncDriver(store.clock, store.ready)
    reader = lock.acquire_read("intent", HOUR)
    assert reader is not None
    waiting = Waiter(60_000, token="waiting-writer", ttl_ms=60_000)
    assert drive(store.acquire("intent", "waiting-writer", 60_000, waiting, write=True)) is None
    assert reader.release()
    expire(backend)

    listed = rw_keys(client, 10)
    if backend.name == "fakeredis":
        # The hash lives while the intent does: listed, and found free when read.
        assert listed == ["intent", "readers", "writer"]
    else:
        assert listed == ["readers", "writer"]
    found = Reader(client, service="svc", limit=1, readwrite=True).namespace(10)
    assert [(key, len(seen.holders)) for key, seen in found.found] == [
        ("readers", 2),
        ("writer", 1),
    ]
    assert rw_keys(client, 1) == listed[:1]
    # The mutex namespace of the service is another one.
    assert keys(client, 10) == []


# -- what each store passes over ----------------------------------------------


def test_sqlite_passes_over_rows_that_are_not_held_slots(tmp_path: Path) -> None:
    path = tmp_path / "locks.sqlite3"
    client = SQLiteBackend(path)
    try:
        sem = DSemaphore("svc", client, max_permits=3)
        assert sem.acquire("real", HOUR) is not None
        lock = DReadWriteLock("svc", client)
        assert lock.acquire_read("reading", HOUR) is not None
        future = int((time.time() + HOUR) * 1000)
        with closing(sqlite3.connect(path, isolation_level=None)) as raw:
            for name in (
                "permit:01:leading-zero",
                "permit:x:not-a-slot",
                "permit:-1:negative",
                "permit:3:past-the-limit",
                "permit:0:",
                "permit:0",
                "permitx:0:other",
                "waiters:real",
            ):
                raw.execute(
                    'INSERT INTO "_dsemaphore_svc" VALUES (?, ?, ?)', (name, "token", future)
                )
            raw.execute(
                'INSERT INTO "_drwlock_svc" VALUES (?, ?, ?)', ("rwlock:foreign", "{}", future)
            )
        assert keys(client, 10, permits=3) == ["real"]
        assert keys(client, 10, permits=4) == ["past-the-limit", "real"]
        assert rw_keys(client, 10) == ["reading"]
    finally:
        client.close()


def test_mongomock_passes_over_documents_that_are_not_held_slots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mongomock, "utcnow", frozen_ttl_monitor)
    client: mongomock.MongoClient[dict[str, Any]] = mongomock.MongoClient()
    assert DSemaphore("svc", client, max_permits=3).acquire("real", HOUR) is not None
    collection = client["dmutex"]["_dsemaphore_svc"]
    later = DSemaphore("svc", client, max_permits=3)  # a lease's expiry, as a datetime
    permit = later.acquire("other", HOUR)
    assert permit is not None
    expires = permit.expired_at
    assert permit.release()
    collection.insert_many(
        [
            {"_id": "permit:3:past-the-limit", "value": "t", "expiredAt": expires},
            {"_id": "permit:10:ten", "value": "t", "expiredAt": expires},
            {"_id": "fence:real", "kind": "dmutex-fence", "fence": 3},
        ]
    )
    client["dmutex"]["_drwlock_svc"].insert_one(
        {"_id": "rwlock:foreign", "w": {"t": "t", "e": expires}, "expiredAt": expires}
    )
    assert keys(client, 10, permits=3) == ["real"]
    assert keys(client, 10, permits=4) == ["past-the-limit", "real"]
    assert rw_keys(client, 10) == []


def test_redis_scans_the_prefix_as_a_literal_through_many_requests() -> None:
    server = fakeredis.FakeServer()
    inner = fakeredis.FakeRedis(server=server)
    try:
        # Another service whose name the pattern's wildcards would match.
        assert DMutex("s*[x]", inner).acquire("mine", HOUR) is not None
        assert DMutex("sa[x]", inner).acquire("theirs", HOUR) is not None
        assert DMutex("sx", inner).acquire("theirs too", HOUR) is not None
        assert glob_escape("_dmutex_s*[x]:") == r"_dmutex_s\*\[x\]:"
        # More names than one SCAN request looks at.
        with inner.pipeline(transaction=False) as pipe:
            for n in range(2 * SCAN_COUNT + 500):
                pipe.set(f"unrelated:{n}", "x")
            pipe.execute()
        for key in ("k1", "k2", "k3"):
            assert DMutex("svc", inner).acquire(key, HOUR) is not None
        inner.set("_dmutex_svc:permit:01:leading-zero", "t")
        inner.set("_dmutex_svc:permit:1:past-the-limit", "t")
        inner.set("_dmutex_svc:permit:0:", "t")
        recording = Recording(inner)
        assert keys(recording, 10) == ["k1", "k2", "k3"]
        scans = [c for c in recording.commands if c[0] == "SCAN"]
        assert len(scans) >= 3, "the cursor came round over many requests"
        assert all(c[2:] == ("MATCH", "_dmutex_svc:permit:*", "COUNT", SCAN_COUNT) for c in scans)
        assert keys(inner, 10, service="s*[x]") == ["mine"]
        assert keys(inner, 10, permits=2, service="svc") == []
    finally:
        inner.close()


def test_redis_without_execute_command_cannot_list() -> None:
    inner = fakeredis.FakeRedis()
    client = SetEvalRedis(inner)
    try:
        store = open_store(client, options("mutex"), asynchronous=False)
        assert isinstance(store, Listing)
        with pytest.raises(UnsupportedClientError, match="execute_command"):
            store.keys(10)
    finally:
        client.close()

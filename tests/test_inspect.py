"""``read_holders`` (what ``dmutex status`` shows): active permits by slot, and the fence.

On SQLite, InMemoryBackend, fakeredis and mongomock. ``read_holders`` reads
the time from the system clock (it takes no ``clock=``), so the leases here
are made in real time: long ones stay active for the whole test, and an
expired one is written with an expiry in the past. So are the fences on SQLite
and fakeredis (``dmutex._core.fences``): each the larger of the counter plus
one and the clock in microseconds, read between two readings of the test's.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import fakeredis
import mongomock
import pytest

from dmutex import (
    DMutex,
    DMutexLock,
    DSemaphore,
    DSemaphorePermit,
    InMemoryBackend,
    ManualClock,
    SQLiteBackend,
)
from dmutex._cli.holders import Holder, read_holders
from dmutex._core.fences import US_PER_S, next_fence
from dmutex._core.lease import now_ms
from tests._support.mongo_clients import frozen_ttl_monitor

H = TypeVar("H", DMutexLock, DSemaphorePermit)
HOUR = 3600.0
# fakeredis's TIME against the test's clock (SQLite reads the test's own: no slack).
SLACK_US = US_PER_S


def expires_ms(handle: DMutexLock | DSemaphorePermit) -> int:
    return round(handle.expired_at.timestamp() * 1000)


def now_us() -> int:
    return int(time.time() * US_PER_S)


def fenced(acquire: Callable[[], H | None], previous: int, slack_us: int = 0) -> tuple[H, int]:
    """The handle ``acquire`` returns and its fence: the next one after ``previous`` (0:
    none) by a clock read between the test's readings before and after, give or take
    ``slack_us``."""
    before = now_us()
    handle = acquire()
    after = now_us()
    assert handle is not None
    fence = handle.fence
    assert fence is not None
    assert (
        next_fence(previous, before - slack_us) <= fence <= next_fence(previous, after + slack_us)
    )
    return handle, fence


@pytest.fixture
def sqlite(tmp_path: Path) -> Iterator[SQLiteBackend]:
    backend = SQLiteBackend(tmp_path / "locks.sqlite3")
    try:
        yield backend
    finally:
        backend.close()


def test_sqlite_holders_by_slot_with_the_fence(sqlite: SQLiteBackend, tmp_path: Path) -> None:
    sem = DSemaphore("svc", sqlite, max_permits=4)
    permits: list[DSemaphorePermit] = []
    fence = 0
    for slot in range(3):
        permit, fence = fenced(partial(sem.acquire, "api", ttl=HOUR + slot), fence)
        permits.append(permit)
    assert permits[1].release() is True
    before = time.time() * 1000
    seen = read_holders(sqlite, service="svc", limit=4, key="api")
    after = time.time() * 1000
    assert seen.holders == [
        Holder(p.slot, p.token, expires_ms(p)) for p in (permits[0], permits[2])
    ]
    assert [h.slot for h in seen.holders] == [0, 2]
    assert seen.fence == fence, "the third grant's"
    assert before - 1 <= seen.now_ms <= after + 1


def test_sqlite_expired_rows_and_other_keys_are_not_shown(
    sqlite: SQLiteBackend, tmp_path: Path
) -> None:
    lock, fence = fenced(lambda: DMutex("svc", sqlite).acquire("job", ttl=HOUR), 0)
    other = DMutex("svc", sqlite).acquire("job2", ttl=HOUR)
    assert other is not None
    DSemaphore("svc", sqlite, max_permits=3).ready()
    with closing(sqlite3.connect(tmp_path / "locks.sqlite3", isolation_level=None)) as raw:
        past = round(time.time() * 1000) - 1000
        # An expired row, as the TypeScript store or a dead holder leaves it.
        raw.execute(
            "INSERT INTO _dsemaphore_svc VALUES ('permit:1:job', ?, ?)", (str(uuid.uuid4()), past)
        )
        raw.execute(
            "INSERT INTO _dsemaphore_svc VALUES ('permit:2:job', 'theirs', ?)", (past + 10**9,)
        )
    mutex = read_holders(sqlite, service="svc", limit=1, key="job")
    assert mutex.holders == [Holder(0, lock.token, expires_ms(lock))]
    assert mutex.fence == fence, "the grant's"
    sem = read_holders(sqlite, service="svc", limit=3, key="job")
    assert sem.holders == [Holder(2, "theirs", past + 10**9)], "the expired slot 1 is not shown"
    assert sem.fence is None, "no dmutex grant, no counter"
    empty = read_holders(sqlite, service="unused", limit=1, key="job")
    assert (empty.holders, empty.fence) == ([], None)


def test_sqlite_fencing_false_shows_no_fence(sqlite: SQLiteBackend, tmp_path: Path) -> None:
    lock = DMutex("svc", sqlite, fencing=False).acquire("job", ttl=HOUR)
    assert lock is not None
    seen = read_holders(sqlite, service="svc", limit=1, key="job")
    assert (seen.holders, seen.fence) == ([Holder(0, lock.token, expires_ms(lock))], None)


def test_sqlite_read_holders_changes_nothing(sqlite: SQLiteBackend, tmp_path: Path) -> None:
    path = tmp_path / "locks.sqlite3"
    lock = DMutex("svc", sqlite).acquire("job", ttl=HOUR)
    assert lock is not None
    with closing(sqlite3.connect(path, isolation_level=None)) as raw:
        before = raw.execute("SELECT * FROM _dmutex_svc ORDER BY 1").fetchall()
    for _ in range(2):
        read_holders(sqlite, service="svc", limit=1, key="job")
    with closing(sqlite3.connect(path, isolation_level=None)) as raw:
        assert raw.execute("SELECT * FROM _dmutex_svc ORDER BY 1").fetchall() == before


def test_in_memory_backend() -> None:
    clock = ManualClock(time.time())
    backend = InMemoryBackend(clock=clock)
    sem = DSemaphore("svc", backend, max_permits=3)
    short = sem.acquire("api", ttl=1)
    long = sem.acquire("api", ttl=HOUR)
    assert short is not None
    assert long is not None
    clock.advance(1)
    seen = read_holders(backend, service="svc", limit=3, key="api")
    assert seen.holders == [Holder(long.slot, long.token, expires_ms(long))]
    assert seen.fence == 2
    assert seen.now_ms == now_ms(clock), "the backend's own clock"
    lock = DMutex("svc", backend).acquire("api", ttl=HOUR)
    assert lock is not None
    mutex = read_holders(backend, service="svc", limit=1, key="api")
    assert (mutex.holders, mutex.fence) == ([Holder(0, lock.token, expires_ms(lock))], 1)


def test_fakeredis() -> None:
    server = fakeredis.FakeServer()
    client = fakeredis.FakeRedis(server=server)
    try:
        sem = DSemaphore("svc", client, max_permits=3)
        first, fence = fenced(lambda: sem.acquire("api", ttl=HOUR), 0, SLACK_US)
        kept, fence = fenced(lambda: sem.acquire("api", ttl=HOUR), fence, SLACK_US)
        assert first.release() is True
        seen = read_holders(client, service="svc", limit=3, key="api")
        (holder,) = seen.holders
        assert (holder.slot, holder.token) == (kept.slot, kept.token)
        # The server's expiry (its TIME + PTTL): within a few ms of the estimate.
        assert abs(holder.expires_ms - expires_ms(kept)) < 1000
        assert seen.fence == fence, "the second grant's"
        plain = DMutex("svc", client, fencing=False).acquire("job", ttl=HOUR)
        assert plain is not None
        mutex = read_holders(client, service="svc", limit=1, key="job")
        assert [h.token for h in mutex.holders] == [plain.token]
        assert mutex.fence is None
    finally:
        client.close()


def test_mongomock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mongomock, "utcnow", frozen_ttl_monitor)
    client: mongomock.MongoClient[dict[str, Any]] = mongomock.MongoClient()
    sem = DSemaphore("svc", client, max_permits=3, fencing=True)
    long = sem.acquire("api", ttl=HOUR)
    assert long is not None
    # A lease that ran out an hour ago, by a clock an hour behind: stored, not active.
    old = DSemaphore("svc", client, max_permits=3, clock=ManualClock(time.time() - 2 * HOUR))
    assert old.acquire("api", ttl=HOUR) is not None
    seen = read_holders(client, service="svc", limit=3, key="api")
    assert seen.holders == [Holder(long.slot, long.token, expires_ms(long))]
    assert seen.fence == 1, "fencing=True keeps a counter on MongoDB"
    lock = DMutex("svc", client).acquire("job", ttl=HOUR)
    assert lock is not None
    mutex = read_holders(client, service="svc", limit=1, key="job")
    assert (mutex.holders, mutex.fence) == ([Holder(0, lock.token, expires_ms(lock))], None)

"""Fences keep growing after the counter is lost or rolled back, on real servers.

Each case takes fences for one key (a mutex and a 2-permit semaphore, with
and without the holders index in the way), loses or rolls back the key's
counter the way production does, then takes more. What must hold: the
counter really was lost or rolled back (so the case tried what it names),
and every fence after is strictly greater than every fence before, and the
fences after still strictly increase. ``dmutex._core.fences``, rule 1: a
fence is the larger of the counter plus one and the server's clock in
microseconds.

- Redis without persistence (``--save ""``, no AOF), killed with SIGKILL and
  started again: every record is gone.
- Redis with RDB snapshots (the usual ``save`` setting), grants, ``SAVE``,
  more grants, SIGKILL, restart: the counter is rolled back to the snapshot
  and the fences after it were handed out once already, under the old rule.
- Redis: the counter key deleted (by hand, or evicted).
- The MongoDB test server (SecantusDB) in memory, killed with SIGKILL and
  started again: every document is gone. And its counter document deleted.
- SQLite: the counter row deleted, and the file replaced by a copy taken
  before the last grants (a restored backup).
- A TypeScript-style grant (the slot key set directly, no fence: the
  TypeScript library keeps none) between two dmutex grants leaves the
  counter alone, and the next fence is still above the last.

Loopback only; every server is started by the test and stopped by pid.
"""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pymongo
import pytest
import redis
from pymongo.database import Database

from dmutex import DMutex, DSemaphore, SQLiteBackend, SyncClient
from tests._support import fault_servers, mongo_servers

KEY = "job"
GRANTS = 6  # fences taken before the loss, and after it
SERVICE = "fences"


def take(lock: DMutex | DSemaphore, count: int = GRANTS) -> list[int]:
    """``count`` grants of :data:`KEY`, each released before the next: their fences."""
    fences: list[int] = []
    for _ in range(count):
        handle = lock.acquire(KEY, 30)
        assert handle is not None
        assert handle.fence is not None
        fences.append(handle.fence)
        assert handle.release() is True
    return fences


def assert_grows(before: list[int], after: list[int]) -> None:
    """Every fence after the loss above every fence before it; each run strictly increasing."""
    for run in (before, after):
        assert run == sorted(set(run)), f"not strictly increasing: {run}"
    assert min(after) > max(before), f"a fence went back: {before} then {after}"


def locks(client: SyncClient) -> list[DMutex | DSemaphore]:
    """A mutex and a 2-permit semaphore of one service, fenced (MongoDB asks for it)."""
    return [
        DMutex(SERVICE, client, fencing=True),
        DSemaphore(SERVICE, client, max_permits=2, fencing=True),
    ]


# --- Redis ------------------------------------------------------------------------------


@pytest.fixture
def restartable_redis(request: pytest.FixtureRequest) -> Iterator[fault_servers.DurableRedis]:
    executable = fault_servers.redis_executable()
    if executable is None:
        pytest.skip("no runnable redis-server executable to kill and restart")
    with fault_servers.DurableRedis(executable, persistence=request.param) as server:
        server.start()
        yield server


def redis_counter(client: redis.Redis, prefix: str) -> bytes | None:
    value = client.get(f"{prefix}fence:{KEY}")
    assert value is None or isinstance(value, bytes)
    return value


PREFIXES = ["_dmutex_fences:", "_dsemaphore_fences:"]


@pytest.mark.parametrize("restartable_redis", ["none"], indirect=True)
def test_redis_restarted_without_persistence(restartable_redis: fault_servers.DurableRedis) -> None:
    with redis.Redis.from_url(restartable_redis.url) as client:
        before = [take(lock) for lock in locks(client)]
    restartable_redis.kill()
    restartable_redis.start()
    with redis.Redis.from_url(restartable_redis.url) as client:
        assert [redis_counter(client, p) for p in PREFIXES] == [None, None], "counters lost"
        after = [take(lock) for lock in locks(client)]
    for old, new in zip(before, after, strict=True):
        assert_grows(old, new)


@pytest.mark.parametrize("restartable_redis", ["rdb"], indirect=True)
def test_redis_killed_after_a_snapshot(restartable_redis: fault_servers.DurableRedis) -> None:
    with redis.Redis.from_url(restartable_redis.url) as client:
        before = [take(lock, 3) for lock in locks(client)]
        client.save()
        snapshot = [redis_counter(client, p) for p in PREFIXES]
        before = [old + take(lock, 3) for old, lock in zip(before, locks(client), strict=True)]
        latest = [redis_counter(client, p) for p in PREFIXES]
    restartable_redis.kill()
    restartable_redis.start()
    with redis.Redis.from_url(restartable_redis.url) as client:
        rolled = [redis_counter(client, p) for p in PREFIXES]
        assert rolled == snapshot != latest, "the counters went back to the snapshot"
        after = [take(lock) for lock in locks(client)]
    for old, new in zip(before, after, strict=True):
        assert_grows(old, new)


@pytest.mark.parametrize("restartable_redis", ["aof-always"], indirect=True)
def test_redis_counter_deleted_and_a_typescript_grant_between(
    restartable_redis: fault_servers.DurableRedis,
) -> None:
    with redis.Redis.from_url(restartable_redis.url) as client:
        for lock, prefix in zip(locks(client), PREFIXES, strict=True):
            before = take(lock)
            assert client.delete(f"{prefix}fence:{KEY}") == 1
            after = take(lock)
            assert_grows(before, after)
            # The TypeScript library's grant: the slot key, PX, nothing else.
            assert client.set(f"{prefix}permit:0:{KEY}", "ts-token", px=50, nx=True)
            assert client.delete(f"{prefix}permit:0:{KEY}") == 1
            assert_grows(after, take(lock, 2))


# --- the MongoDB test server --------------------------------------------------------------


def secantus_or_skip() -> None:
    if "secantusdb" not in mongo_servers.allowed_sources():
        pytest.skip("DMUTEX_MONGODB_SERVERS leaves out secantusdb")
    if mongo_servers.secantus_version() is None:
        pytest.skip("SecantusDB is not installed")


def mongo_counters(client: pymongo.MongoClient[dict[str, object]]) -> list[object]:
    db = client.get_database("dmutex")
    found = []
    for collection in ("_dmutex_fences", "_dsemaphore_fences"):
        doc = db.get_collection(collection).find_one({"_id": f"fence:{KEY}"})
        found.append(None if doc is None else doc.get("fence"))
    return found


def test_mongodb_test_server_restarted_in_memory() -> None:
    secantus_or_skip()
    with fault_servers.DurableSecantusDB(in_memory=True) as server:
        server.start()
        client: pymongo.MongoClient[dict[str, object]]
        with pymongo.MongoClient(server.url) as client:
            before = [take(lock) for lock in locks(client)]
            assert None not in mongo_counters(client)
        server.kill()
        server.start()
        with pymongo.MongoClient(server.url) as client:
            assert mongo_counters(client) == [None, None], "the counters are gone"
            after = [take(lock) for lock in locks(client)]
    for old, new in zip(before, after, strict=True):
        assert_grows(old, new)


def test_mongodb_test_server_counter_deleted() -> None:
    secantus_or_skip()
    with fault_servers.DurableSecantusDB() as server:
        server.start()
        client: pymongo.MongoClient[dict[str, object]]
        with pymongo.MongoClient(server.url) as client:
            db: Database[dict[str, object]] = client.get_database("dmutex")
            collections = ("_dmutex_fences", "_dsemaphore_fences")
            for lock, collection in zip(locks(client), collections, strict=True):
                before = take(lock)
                deleted = db.get_collection(collection).delete_one({"_id": f"fence:{KEY}"})
                assert deleted.deleted_count == 1
                assert_grows(before, take(lock))


# --- SQLite -------------------------------------------------------------------------------


def test_sqlite_counter_row_deleted(tmp_path: Path) -> None:
    path = tmp_path / "locks.sqlite3"
    backend = SQLiteBackend(path)
    try:
        runs = [take(lock, 3) for lock in locks(backend)]
        with contextlib.closing(sqlite3.connect(path)) as conn:
            for table in ("_dmutex_fences", "_dsemaphore_fences"):
                gone = conn.execute(f'DELETE FROM "{table}" WHERE "key" = ?', (f"fence:{KEY}",))
                assert gone.rowcount == 1
            conn.commit()
        for run, lock in zip(runs, locks(backend), strict=True):
            assert_grows(run, take(lock))
    finally:
        backend.close()


def test_sqlite_file_restored_from_an_older_copy(tmp_path: Path) -> None:
    path, copy = tmp_path / "locks.sqlite3", tmp_path / "backup.sqlite3"
    backend = SQLiteBackend(path)
    try:
        runs = [take(lock, 3) for lock in locks(backend)]
        backend.close()
        shutil.copyfile(path, copy)  # closed: the WAL was checkpointed into the file
        backend = SQLiteBackend(path)
        runs = [run + take(lock, 3) for run, lock in zip(runs, locks(backend), strict=True)]
        backend.close()
        for suffix in ("-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        shutil.copyfile(copy, path)  # the restore: the last three grants never happened
        backend = SQLiteBackend(path)
        for run, lock in zip(runs, locks(backend), strict=True):
            assert_grows(run, take(lock))
    finally:
        backend.close()

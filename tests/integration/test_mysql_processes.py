"""Several OS processes contending for one lock key on a real MariaDB/MySQL server.

Each worker is a separate process started with ``spawn`` (through
``processes.run_workers``): it opens its own clients and its own dmutex
instance, waits on a barrier so that all of them start together, runs a
bounded number of cycles and reports a :class:`~tests._support.processes.Report`
(or the traceback of what it raised). A worker that has not reported by the
deadline is terminated and the test fails.

The workers take turns of kind: even ones use ``DMutex`` / ``DSemaphore`` on
a PyMySQL connection of their own (the mutex's every other one out of
autocommit: dmutex commits each statement), odd ones ``AsyncDMutex`` / ``AsyncDSemaphore`` on an
aiomysql pool; so the plain ``acquire()`` of one kind races the other's. No
release signals another process: their waiters poll (``RETRY_DELAY``).

What the mutex guards is a row of a table of its own (``counter``), read and
written by a connection of the worker's own in autocommit: a ``SELECT`` then
an ``UPDATE`` to the value read plus one, two transactions, so that two
holders at once lose an increment. The ``SELECT`` also reads the lock's row,
which must hold the reader's token. Each cycle first tries one plain
``acquire()``; when that is refused the worker counts it and falls back to
``acquire_with_retry()``: the refusals show that the processes contended.

The semaphore's gauge is the same table's other row, raised by one atomic
``UPDATE`` on entry (its new value read back through ``LAST_INSERT_ID``, as
the store reads its own answers) and lowered on exit: its highest reading is
the number of holders at once.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import aiomysql
import pymysql
import pytest
from pymysql.connections import Connection
from pymysql.cursors import Cursor

from dmutex import (
    AsyncDMutex,
    AsyncDMutexLock,
    AsyncDSemaphore,
    AsyncDSemaphorePermit,
    DMutex,
    DMutexLock,
    DSemaphore,
    DSemaphorePermit,
)
from dmutex._backends.clients import AsyncMySQLPoolLike, MySQLConnectionLike
from tests._support import processes
from tests._support.mysql_rows import quoted
from tests._support.mysql_servers import Server, Session, connect_args
from tests._support.processes import BARRIER_TIMEOUT, DEADLINE, Report, Tally

if TYPE_CHECKING:
    _Connection = Connection[Cursor]
else:
    _Connection = Connection

LOCK_KEY = "orders"
TTL = 30.0  # far longer than any test: no lease may expire while held
RETRY_TIMEOUT = 30.0
# No release wakes a waiter in another process: it polls within this.
RETRY_DELAY = 0.01
RETRY = processes.Retry(TTL, RETRY_TIMEOUT, RETRY_DELAY)

PROCESSES = 4
CYCLES = 200
SEM_PROCESSES = 5
SEM_PERMITS = 3
SEM_CYCLES = 40
HOLD = 0.003  # seconds a semaphore holder keeps its permit, so that holders overlap


@dataclass(frozen=True)
class Place:
    """Where a run's workers meet: the server, the database, the service and the counter."""

    url: str
    database: str
    service: str
    counter: str  # a table (name varchar PRIMARY KEY, n bigint) with rows counter and gauge

    def lock_table(self, prefix: str) -> str:
        return prefix + self.service

    def connect(self, *, autocommit: bool = True) -> _Connection:
        args = connect_args(self.url)
        args["database"] = self.database
        return pymysql.connect(**args, autocommit=autocommit)


def _row(slot: int) -> str:
    return f"permit:{slot}:{LOCK_KEY}"


# --- the guarded work: a read-modify-write, a gauge ---------------------------------------


class Work:
    """The statements a holder sends, on a connection of its own in autocommit."""

    def __init__(self, place: Place, prefix: str) -> None:
        self.conn = place.connect()
        counter, lock = quoted(place.counter), quoted(place.lock_table(prefix))
        self.read = (
            f"SELECT n, (SELECT `value` FROM {lock} WHERE `key` = %s) FROM {counter}"
            " WHERE name = 'counter'"
        )
        self.write = f"UPDATE {counter} SET n = %s WHERE name = 'counter'"
        self.enter = f"UPDATE {counter} SET n = LAST_INSERT_ID(n + 1) WHERE name = 'gauge'"
        self.leave = f"UPDATE {counter} SET n = n - 1 WHERE name = 'gauge'"

    def count(self, tally: Tally, token: str) -> None:
        """Add one to the counter by a read and a write; note a lock row of another token."""
        with self.conn.cursor() as cursor:
            cursor.execute(self.read, (_row(0),))
            found = cursor.fetchone()
            assert found is not None
            if found[1] != token:
                tally.foreign += 1
            cursor.execute(self.write, (int(found[0]) + 1,))

    def gauge(self, tally: Tally, slot: int, token: str) -> None:
        """Raise the gauge (noting its peak), check the slot's row, hold a moment, lower it."""
        tally.slots.add(slot)
        with self.conn.cursor() as cursor:
            cursor.execute(self.enter)
            tally.peak = max(tally.peak, int(cursor.lastrowid))
            cursor.execute(self.read, (_row(slot),))
            found = cursor.fetchone()
            if found is None or found[1] != token:
                tally.foreign += 1
            time.sleep(HOLD)
            cursor.execute(self.leave)

    def close(self) -> None:
        self.conn.close()


# --- workers (module level: spawn imports this module to find them) ---------------------


@contextlib.contextmanager
def sync_client(place: Place, *, autocommit: bool) -> Iterator[MySQLConnectionLike]:
    """A sync worker's dmutex connection, in autocommit or out of it."""
    conn = place.connect(autocommit=autocommit)
    try:
        # The cast is for mypy only (test_mysql_store.client says why).
        yield cast(MySQLConnectionLike, conn)
    finally:
        conn.close()


@contextlib.asynccontextmanager
async def async_client(place: Place) -> AsyncIterator[AsyncMySQLPoolLike]:
    """An asyncio worker's dmutex client: an aiomysql pool in autocommit."""
    args = connect_args(place.url)
    pool = await aiomysql.create_pool(
        minsize=1,
        maxsize=2,
        host=args["host"],
        port=args["port"],
        user=args["user"],
        password=args["password"],
        db=place.database,
        autocommit=True,
    )
    try:
        yield cast(AsyncMySQLPoolLike, pool)
    finally:
        pool.close()
        await pool.wait_closed()


def mutex_counter_worker(
    worker: int, reports: processes.Reports, barrier: processes.Barrier, place: Place, cycles: int
) -> None:
    """``cycles`` times: lock, read the counter, write it plus one, unlock; sync or asyncio."""
    work = Work(place, "_dmutex_")

    def sync(tally: Tally) -> None:
        with sync_client(place, autocommit=worker % 4 == 0) as client:
            mutex = DMutex(place.service, client)
            barrier.wait(BARRIER_TIMEOUT)

            def guarded(lock: DMutexLock) -> None:
                work.count(tally, lock.token)

            processes.cycle(mutex, LOCK_KEY, tally, cycles, guarded, RETRY)

    async def asynchronous(tally: Tally) -> None:
        async with async_client(place) as client:
            mutex = AsyncDMutex(place.service, client)
            barrier.wait(BARRIER_TIMEOUT)  # nothing else runs on this loop yet

            async def guarded(lock: AsyncDMutexLock) -> None:
                work.count(tally, lock.token)  # blocking: this loop runs nothing else

            await processes.cycle_async(mutex, LOCK_KEY, tally, cycles, guarded, RETRY)

    try:
        processes.report_errors(
            worker, reports, barrier, Tally(worker), processes.by_kind(worker, sync, asynchronous)
        )
    finally:
        work.close()


def semaphore_gauge_worker(
    worker: int,
    reports: processes.Reports,
    barrier: processes.Barrier,
    place: Place,
    cycles: int,
    permits: int,
) -> None:
    """``cycles`` times: take a permit, raise the gauge, read the slot's row, lower it, release."""
    work = Work(place, "_dsemaphore_")

    def sync(tally: Tally) -> None:
        # In autocommit only: out of it, a full semaphore's read leaves its
        # snapshot open (test_mysql_store.py's xfail tests), and the waiter
        # would see no release until its holder's TTL ran out.
        with sync_client(place, autocommit=True) as client:
            sem = DSemaphore(place.service, client, max_permits=permits)
            barrier.wait(BARRIER_TIMEOUT)

            def guarded(permit: DSemaphorePermit) -> None:
                work.gauge(tally, permit.slot, permit.token)

            processes.cycle(sem, LOCK_KEY, tally, cycles, guarded, RETRY)

    async def asynchronous(tally: Tally) -> None:
        async with async_client(place) as client:
            sem = AsyncDSemaphore(place.service, client, max_permits=permits)
            barrier.wait(BARRIER_TIMEOUT)

            async def guarded(permit: AsyncDSemaphorePermit) -> None:
                work.gauge(tally, permit.slot, permit.token)

            await processes.cycle_async(sem, LOCK_KEY, tally, cycles, guarded, RETRY)

    try:
        processes.report_errors(
            worker, reports, barrier, Tally(worker), processes.by_kind(worker, sync, asynchronous)
        )
    finally:
        work.close()


# --- the parent side --------------------------------------------------------------------


def _fetch(place: Place, sql: str) -> list[tuple[Any, ...]]:
    with place.connect() as conn, conn.cursor() as cursor:
        cursor.execute(sql)
        return list(cursor.fetchall())


@pytest.fixture
def place(mysql_session: Session) -> Iterator[Place]:
    """A service of its own in the session's database, and the counter table with its rows."""
    server: Server = mysql_session.server()
    suffix = uuid.uuid4().hex[:8]
    found = Place(server.url, server.database, f"procs_{suffix}", f"counter_{suffix}")
    counter = quoted(found.counter)
    _fetch(found, f"CREATE TABLE {counter} (name varchar(16) PRIMARY KEY, n bigint NOT NULL)")
    _fetch(found, f"INSERT INTO {counter} VALUES ('counter', 0), ('gauge', 0)")
    yield found
    for table in (found.counter, found.lock_table("_dmutex_"), found.lock_table("_dsemaphore_")):
        _fetch(found, f"DROP TABLE IF EXISTS {quoted(table)}")


def _counter(place: Place, name: str) -> int:
    found = _fetch(place, f"SELECT n FROM {quoted(place.counter)} WHERE name = '{name}'")
    return int(found[0][0])


def _active(place: Place, prefix: str) -> list[tuple[Any, ...]]:
    """The lock table's rows of active permits: none once every holder released."""
    now = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)"
    return _fetch(
        place,
        f"SELECT `key` FROM {quoted(place.lock_table(prefix))}"
        f" WHERE `key` LIKE 'permit:%%' AND `expired_at` > {now}",
    )


def _print_figures(name: str, started: float, reports: list[Report]) -> None:
    elapsed = time.monotonic() - started
    refused = [r.refused for r in reports]
    peak = max(r.peak for r in reports)
    # Shown with -s; no assertion uses the time.
    print(f"\n{name}: {elapsed:.2f} s, refused per worker {refused}", end="")
    print(f", peak gauge {peak}" if peak else "")


def test_mutex_serializes_read_modify_write_across_processes(place: Place) -> None:
    """4 processes x 200 cycles: PyMySQL connections (in and out of autocommit), aiomysql pools."""
    with place.connect() as conn:
        DMutex(place.service, cast(MySQLConnectionLike, conn)).ready()  # not 4 creating it
    started = time.monotonic()
    reports = processes.run_workers(
        mutex_counter_worker, PROCESSES, place, CYCLES, deadline=DEADLINE, report=Report
    )
    _print_figures(f"mutex counter, {PROCESSES} x {CYCLES} cycles", started, reports)
    processes.check_cycles(reports, PROCESSES, CYCLES)
    assert sum(r.foreign for r in reports) == 0, "a holder found another token in the lock's row"
    # A SELECT then an UPDATE of what it read loses increments unless the lock excludes.
    assert _counter(place, "counter") == PROCESSES * CYCLES
    assert sum(r.refused for r in reports) > 0, "the workers never contended"
    assert _active(place, "_dmutex_") == [], "the lock's row outlived its last release"


def test_semaphore_bounds_concurrency_across_processes(place: Place) -> None:
    """5 processes x 40 cycles on 3 permits: at most 3 holders at once, and 3 reached."""
    with place.connect() as conn:
        client = cast(MySQLConnectionLike, conn)
        DSemaphore(place.service, client, max_permits=SEM_PERMITS).ready()
    started = time.monotonic()
    reports = processes.run_workers(
        semaphore_gauge_worker,
        SEM_PROCESSES,
        place,
        SEM_CYCLES,
        SEM_PERMITS,
        deadline=DEADLINE,
        report=Report,
    )
    _print_figures(f"semaphore gauge, {SEM_PROCESSES} x {SEM_CYCLES} cycles", started, reports)
    processes.check_cycles(reports, SEM_PROCESSES, SEM_CYCLES)
    assert sum(r.foreign for r in reports) == 0, "a holder found another token in its slot's row"
    peak = max(r.peak for r in reports)
    assert peak <= SEM_PERMITS, f"{peak} holders at once with {SEM_PERMITS} permits"
    assert peak == SEM_PERMITS, "the permits were never all in use at once"
    assert {s for r in reports for s in r.slots} <= set(range(SEM_PERMITS))
    assert sum(r.refused for r in reports) > 0, "the workers never contended"
    assert _counter(place, "gauge") == 0
    assert _active(place, "_dsemaphore_") == [], "slots' rows outlived their last release"

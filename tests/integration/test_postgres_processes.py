"""Several OS processes hammering one lock key on a real PostgreSQL server.

Each worker is a separate process started with ``spawn`` (through
``processes.run_workers``): it opens its own clients and its own dmutex
instance, waits on a barrier so that all of them start together, runs its
cycles and reports a :class:`Report` (or the traceback of what it raised).
A worker that has not reported by the deadline is terminated and the test
fails.

The workers take turns of kind: even ones use ``DMutex`` / ``DSemaphore``
over a psycopg ``ConnectionPool`` (its waiters listen on a connection the
pool lends), odd ones ``AsyncDMutex`` / ``AsyncDSemaphore`` over an asyncpg
connection (which listens itself); so waiters are woken by the releases'
NOTIFY, and the plain ``acquire()`` of one kind races the other's.

What the lock guards is a row of a table of its own (``counter``), read and
written by a connection of its own in autocommit: a ``SELECT`` then an
``UPDATE`` of the value read plus one, two transactions, so that two
holders at once lose an increment. The ``SELECT`` also reads the lock's
row, which must hold the reader's token. Each cycle first tries one plain
``acquire()``; when that is refused the worker counts it and falls back to
``acquire_with_retry()``: the refusals show that the processes contended.

The semaphore's gauge is the same table's other row, moved by one atomic
``UPDATE ... RETURNING`` on entry and on exit: its highest reading is the
number of holders at once.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeAlias

import asyncpg
import psycopg
import psycopg_pool
import pytest
from psycopg import sql

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
from tests._support import processes
from tests._support.processes import BARRIER_TIMEOUT, DEADLINE, Report, Tally

LOCK_KEY = "orders"
TTL = 30.0  # far longer than any test: no lease may expire while held
RETRY_TIMEOUT = 60.0
# acquire_with_retry's default: waiters are woken by the release's NOTIFY, and
# poll within this only when no release comes. Measured on the shared 2-core
# machine, 0.01 made the 8 x 1000 cycles no faster (33-79 s against 32-43 s,
# 4 runs each, load 4-9): every waiter listening is woken by each release
# anyway, and polls only add attempts.
RETRY_DELAY = 0.1
RETRY = processes.Retry(TTL, RETRY_TIMEOUT, RETRY_DELAY)
# The 8 x 1000 cycles take 22-40 s here at load 4-6, 75-95 s when the machine
# is loaded to 10 by other work: a bound on a hang, not on speed.
DEADLINE_8 = 2 * DEADLINE

PROCESSES = 8
CYCLES = 1000
SEM_PROCESSES = 6
SEM_PERMITS = 3
SEM_CYCLES = 200


@dataclass(frozen=True)
class Place:
    """Where a run's workers meet: the server, the schema, the lock's and the counter's tables."""

    url: str
    schema: str
    service: str

    @property
    def counter(self) -> sql.Composed:
        return sql.SQL("{}.{}").format(sql.Identifier(self.schema), sql.Identifier("counter"))

    def lock_table(self, prefix: str) -> sql.Composed:
        table = sql.Identifier(prefix + self.service)
        return sql.SQL("{}.{}").format(sql.Identifier(self.schema), table)


Reports: TypeAlias = processes.Reports
Barrier: TypeAlias = processes.Barrier


# --- the guarded work, as SQL: psycopg's text, and asyncpg's ------------------------------


@dataclass(frozen=True)
class Work:
    """The statements a holder sends: read the counter (and the lock's row), write it, gauge."""

    read: str  # the counter's value, and the value of the lock's row %(row)s
    write: str  # set the counter to %(value)s
    enter: str  # the gauge plus one, returning it
    leave: str  # the gauge minus one

    @classmethod
    def of(cls, place: Place, prefix: str) -> Work:
        def text(statement: sql.Composable) -> str:
            return statement.as_string(None)

        counter, lock = place.counter, place.lock_table(prefix)
        read = sql.SQL(
            "SELECT n, (SELECT value FROM {} WHERE key = %(row)s) FROM {} WHERE name = 'counter'"
        ).format(lock, counter)
        write = sql.SQL("UPDATE {} SET n = %(value)s WHERE name = 'counter'").format(counter)
        enter = sql.SQL("UPDATE {} SET n = n + 1 WHERE name = 'gauge' RETURNING n").format(counter)
        leave = sql.SQL("UPDATE {} SET n = n - 1 WHERE name = 'gauge'").format(counter)
        return cls(text(read), text(write), text(enter), text(leave))

    @staticmethod
    def numbered(text: str, *names: str) -> str:
        """``text`` with asyncpg's ``$n`` for psycopg's ``%(name)s``, in the order of ``names``."""
        for n, name in enumerate(names, 1):
            text = text.replace(f"%({name})s", f"${n}")
        return text


def _row(slot: int) -> str:
    return f"permit:{slot}:{LOCK_KEY}"


# --- workers (module level: spawn imports this module to find them) ---------------------


@contextlib.contextmanager
def sync_clients(
    place: Place,
) -> Iterator[tuple[psycopg_pool.ConnectionPool, psycopg.Connection[Any]]]:
    """A sync worker's clients: dmutex's pool (its waiters listen on a connection it lends),
    and the guarded work's connection in autocommit."""
    with (
        psycopg_pool.ConnectionPool(
            place.url, min_size=1, max_size=2, kwargs={"autocommit": True}
        ) as pool,
        psycopg.connect(place.url, autocommit=True) as conn,
    ):
        yield pool, conn


@contextlib.asynccontextmanager
async def async_clients(
    place: Place,
) -> AsyncIterator[tuple[asyncpg.Connection, asyncpg.Connection]]:
    """An asyncio worker's clients: dmutex's asyncpg connection (it listens itself), and the
    guarded work's."""
    client, conn = await asyncpg.connect(place.url), await asyncpg.connect(place.url)
    try:
        yield client, conn
    finally:
        await client.close()
        await conn.close()


def mutex_counter_worker(
    worker: int, reports: Reports, barrier: Barrier, place: Place, cycles: int
) -> None:
    """``cycles`` times: lock, read the counter, write it plus one, unlock; sync or asyncio."""
    work = Work.of(place, "_dmutex_")

    def sync(tally: Tally) -> None:
        with sync_clients(place) as (pool, conn):
            mutex = DMutex(place.service, pool, schema_name=place.schema)
            barrier.wait(BARRIER_TIMEOUT)

            def guarded(lock: DMutexLock) -> None:
                found = conn.execute(work.read, {"row": _row(0)}).fetchone()
                assert found is not None
                if found[1] != lock.token:
                    tally.foreign += 1
                conn.execute(work.write, {"value": found[0] + 1})

            processes.cycle(mutex, LOCK_KEY, tally, cycles, guarded, RETRY)

    async def asynchronous(tally: Tally) -> None:
        async with async_clients(place) as (client, conn):
            mutex = AsyncDMutex(place.service, client, schema_name=place.schema)
            read, write = Work.numbered(work.read, "row"), Work.numbered(work.write, "value")
            barrier.wait(BARRIER_TIMEOUT)  # nothing else runs on this loop yet

            async def guarded(lock: AsyncDMutexLock) -> None:
                found = await conn.fetchrow(read, _row(0))
                assert found is not None
                if found[1] != lock.token:
                    tally.foreign += 1
                await conn.execute(write, found[0] + 1)

            await processes.cycle_async(mutex, LOCK_KEY, tally, cycles, guarded, RETRY)

    processes.report_errors(
        worker, reports, barrier, Tally(worker), processes.by_kind(worker, sync, asynchronous)
    )


def semaphore_gauge_worker(
    worker: int, reports: Reports, barrier: Barrier, place: Place, cycles: int, permits: int
) -> None:
    """``cycles`` times: take a permit, raise the gauge, read the slot's row, lower it, release."""
    work = Work.of(place, "_dsemaphore_")

    def sync(tally: Tally) -> None:
        with sync_clients(place) as (pool, conn):
            sem = DSemaphore(place.service, pool, max_permits=permits, schema_name=place.schema)
            barrier.wait(BARRIER_TIMEOUT)

            def guarded(permit: DSemaphorePermit) -> None:
                tally.slots.add(permit.slot)
                now = conn.execute(work.enter).fetchone()
                assert now is not None
                tally.peak = max(tally.peak, now[0])
                found = conn.execute(work.read, {"row": _row(permit.slot)}).fetchone()
                if found is None or found[1] != permit.token:
                    tally.foreign += 1
                conn.execute(work.leave)

            processes.cycle(sem, LOCK_KEY, tally, cycles, guarded, RETRY)

    async def asynchronous(tally: Tally) -> None:
        async with async_clients(place) as (client, conn):
            sem = AsyncDSemaphore(
                place.service, client, max_permits=permits, schema_name=place.schema
            )
            read = Work.numbered(work.read, "row")
            barrier.wait(BARRIER_TIMEOUT)

            async def guarded(permit: AsyncDSemaphorePermit) -> None:
                tally.slots.add(permit.slot)
                tally.peak = max(tally.peak, await conn.fetchval(work.enter))
                found = await conn.fetchrow(read, _row(permit.slot))
                if found is None or found[1] != permit.token:
                    tally.foreign += 1
                await conn.execute(work.leave)

            await processes.cycle_async(sem, LOCK_KEY, tally, cycles, guarded, RETRY)

    processes.report_errors(
        worker, reports, barrier, Tally(worker), processes.by_kind(worker, sync, asynchronous)
    )


# --- the parent side --------------------------------------------------------------------


@pytest.fixture
def place(postgres_server: str, postgres_schema: str) -> Iterator[Place]:
    """A service of its own in the session's schema, and the counter table with its two rows."""
    found = Place(postgres_server, postgres_schema, f"procs_{uuid.uuid4().hex[:8]}")
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(found.counter))
        conn.execute(
            sql.SQL("CREATE TABLE {} (name text PRIMARY KEY, n bigint NOT NULL)").format(
                found.counter
            )
        )
        conn.execute(
            sql.SQL("INSERT INTO {} VALUES ('counter', 0), ('gauge', 0)").format(found.counter)
        )
    yield found
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(found.counter))
        for prefix in ("_dmutex_", "_dsemaphore_"):
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(found.lock_table(prefix)))


def run_workers(
    target: Callable[..., None], count: int, *args: object, deadline: float = DEADLINE
) -> list[Report]:
    """Start ``count`` processes of ``target`` together; their reports, or a failed test."""
    return processes.run_workers(target, count, *args, deadline=deadline, report=Report)


def _read(place: Place, query: sql.Composed, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(place.url, autocommit=True) as conn:
        return conn.execute(query, params).fetchall()


def _counter(place: Place, name: str) -> int:
    query = sql.SQL("SELECT n FROM {} WHERE name = %s").format(place.counter)
    return int(_read(place, query, name)[0][0])


def _active(place: Place, prefix: str) -> list[tuple[Any, ...]]:
    """The lock table's rows of active permits of the key: none once every holder released."""
    query = sql.SQL("SELECT key FROM {} WHERE key LIKE 'permit:%%' AND expired_at > now()").format(
        place.lock_table(prefix)
    )
    return _read(place, query)


def _print_figures(name: str, started: float, reports: list[Report]) -> None:
    elapsed = time.monotonic() - started
    refused = [r.refused for r in reports]
    peak = max(r.peak for r in reports)
    # Shown with -s; no assertion uses the time.
    print(f"\n{name}: {elapsed:.2f} s, refused per worker {refused}", end="")
    print(f", peak gauge {peak}" if peak else "")


# --- the tests --------------------------------------------------------------------------


def test_mutex_serializes_read_modify_write_across_8_processes(place: Place) -> None:
    """8 processes x 1000 cycles, psycopg pools and asyncpg connections taking turns."""
    with psycopg.connect(place.url, autocommit=True) as conn:
        DMutex(place.service, conn, schema_name=place.schema).ready()  # not 8 creating it at once
    started = time.monotonic()
    reports = run_workers(mutex_counter_worker, PROCESSES, place, CYCLES, deadline=DEADLINE_8)
    _print_figures(f"mutex counter, {PROCESSES} x {CYCLES} cycles", started, reports)
    processes.check_cycles(reports, PROCESSES, CYCLES)
    assert sum(r.foreign for r in reports) == 0, "a holder found another token in the lock's row"
    # A SELECT then an UPDATE of what it read loses increments unless the lock excludes.
    assert _counter(place, "counter") == PROCESSES * CYCLES
    assert sum(r.refused for r in reports) > 0, "the workers never contended"
    assert _active(place, "_dmutex_") == [], "the lock's row outlived its last release"


def test_semaphore_bounds_concurrency_across_processes(place: Place) -> None:
    with psycopg.connect(place.url, autocommit=True) as conn:
        DSemaphore(place.service, conn, max_permits=SEM_PERMITS, schema_name=place.schema).ready()
    started = time.monotonic()
    reports = run_workers(semaphore_gauge_worker, SEM_PROCESSES, place, SEM_CYCLES, SEM_PERMITS)
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

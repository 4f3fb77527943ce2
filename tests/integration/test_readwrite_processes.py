"""OS processes of readers and writers on one read-write lock: Redis, PostgreSQL, MySQL.

Issue 28's check: 8 spawned workers x 1000 cycles on a real Redis server, a
quarter of them writes (seeded per worker), half the workers on the sync
face and half on the asyncio face, each cycle ``acquire_*_with_retry``, a
hold, a release. The same with the lock on PostgreSQL (psycopg, asyncpg)
and on MySQL (PyMySQL, aiomysql), 8 workers x 250 cycles each: there each
operation is a read and a compare-and-set write, and racing processes are
what makes the write lose and decide again. The gauges below live on Redis
in every case.

What the holders do, on the Redis server, in ``MULTI`` blocks so that each
step is one atomic read: a writer adds itself to the writers' gauge and
reads both gauges (it must be alone: writers 1, readers 0), then reads the
counter and writes it back plus one in two separate commands, which loses
an update if two writers ever overlap; a reader adds itself to the readers'
gauge and reads the writers' (it must read 0), and keeps the highest
readers' gauge it saw. Whoever entered second reads the other's mark, so
an overlap of a writer with anyone is seen by one of them.

Checked: no overlap seen, the counter equals the writes made, every cycle
ran and every release answered True; and readers did overlap (some reader
saw another one in), so the lock is not a mutex in disguise.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import redis

from dmutex import AsyncDReadWriteLock, DReadWriteLock
from tests._support import processes
from tests._support.mysql_servers import Session as MySQLSession
from tests._support.mysql_servers import aiomysql_connection, connect_args
from tests._support.redis_servers import Pool, flushed, newest

KEY = "model"
SERVICE = "rw-procs"
COUNTER = "test:rw:counter"
WRITERS = "test:rw:writers"
READERS = "test:rw:readers"
WORKERS = 8
CYCLES = 1000
WRITE_SHARE = 0.25
TTL = 10.0  # far longer than the test: no hold may expire while held
TIMEOUT = 60.0
RETRY_DELAY = 0.005
SEED = 28
SQL_WORKERS = 8
SQL_CYCLES = 250


@dataclass(frozen=True)
class Where:
    """Where a worker's lock lives (``kind``: redis, postgresql, mysql) and its gauges' Redis."""

    kind: str
    lock_url: str
    gauges_url: str
    cycles: int = CYCLES
    schema: str | None = None  # PostgreSQL's


@dataclass(frozen=True)
class Report:
    """What one worker did and saw."""

    worker: int
    cycles: int
    writes: int
    overlaps: int  # a writer not alone, or a reader that saw a writer
    peak_readers: int  # the most readers a reader saw in at once
    failed_releases: int


@dataclass
class Tally:
    worker: int
    cycles: int = 0
    writes: int = 0
    overlaps: int = 0
    peak_readers: int = 0
    failed_releases: int = 0

    def report(self) -> Report:
        return Report(
            self.worker,
            self.cycles,
            self.writes,
            self.overlaps,
            self.peak_readers,
            self.failed_releases,
        )


def _hold(server: redis.Redis, tally: Tally, write: bool) -> None:
    """What a holder does while it holds: mark itself in, check, work, mark itself out."""
    pipe = server.pipeline(transaction=True)
    if write:
        pipe.incr(WRITERS)
        pipe.get(READERS)
        writers, readers = pipe.execute()
        tally.overlaps += writers != 1 or int(readers or 0) != 0
        value = int(server.get(COUNTER) or 0)
        server.set(COUNTER, value + 1)
        server.decr(WRITERS)
        tally.writes += 1
    else:
        pipe.incr(READERS)
        pipe.get(WRITERS)
        readers, writers = pipe.execute()
        tally.overlaps += int(writers or 0) != 0
        tally.peak_readers = max(tally.peak_readers, int(readers))
        server.decr(READERS)


def work(worker: int, reports: processes.Reports, barrier: processes.Barrier, where: Where) -> None:
    """One worker: even ones on the sync face, odd ones on the asyncio face."""
    processes.report_errors(
        worker,
        reports,
        barrier,
        Tally(worker),
        lambda tally: (_async if worker % 2 else _sync)(tally, where, barrier),
    )


def _sides(rng: random.Random, cycles: int) -> list[bool]:
    return [rng.random() < WRITE_SHARE for _ in range(cycles)]


def _sync_client(where: Where) -> Any:
    if where.kind == "postgresql":
        import psycopg

        return psycopg.connect(where.lock_url, autocommit=True)
    if where.kind == "mysql":
        import pymysql

        return pymysql.connect(**connect_args(where.lock_url), autocommit=True, charset="utf8mb4")
    return redis.Redis.from_url(where.lock_url)


async def _async_client(where: Where) -> Any:
    if where.kind == "postgresql":
        import asyncpg

        return await asyncpg.connect(where.lock_url)
    if where.kind == "mysql":
        return await aiomysql_connection(where.lock_url)
    import redis.asyncio

    return redis.asyncio.Redis.from_url(where.lock_url)


def _options(where: Where) -> dict[str, Any]:
    return {} if where.schema is None else {"schema_name": where.schema}


def _sync(tally: Tally, where: Where, barrier: processes.Barrier) -> None:
    client = _sync_client(where)
    gauges = redis.Redis.from_url(where.gauges_url)
    lock = DReadWriteLock(SERVICE, client, **_options(where))
    sides = _sides(random.Random(SEED * 100 + tally.worker), where.cycles)
    barrier.wait(processes.BARRIER_TIMEOUT)
    try:
        for write in sides:
            acquire = lock.acquire_write_with_retry if write else lock.acquire_read_with_retry
            hold = acquire(KEY, ttl=TTL, timeout=TIMEOUT, retry_delay=RETRY_DELAY)
            assert hold is not None, "no hold within the timeout"
            _hold(gauges, tally, write)
            tally.failed_releases += not hold.release()
            tally.cycles += 1
    finally:
        client.close()
        gauges.close()


def _async(tally: Tally, where: Where, barrier: processes.Barrier) -> None:
    sides = _sides(random.Random(SEED * 100 + tally.worker), where.cycles)
    inspector = redis.Redis.from_url(where.gauges_url)

    async def main() -> None:
        client: Any = await _async_client(where)
        lock = AsyncDReadWriteLock(SERVICE, client, **_options(where))
        try:
            for write in sides:
                if write:
                    hold: Any = await lock.acquire_write_with_retry(
                        KEY, ttl=TTL, timeout=TIMEOUT, retry_delay=RETRY_DELAY
                    )
                else:
                    hold = await lock.acquire_read_with_retry(
                        KEY, ttl=TTL, timeout=TIMEOUT, retry_delay=RETRY_DELAY
                    )
                assert hold is not None, "no hold within the timeout"
                # The checks are sync calls on a connection of their own: they
                # run while the hold is held, which is all they need.
                _hold(inspector, tally, write)
                tally.failed_releases += not await hold.release()
                tally.cycles += 1
        finally:
            closed = client.aclose() if where.kind == "redis" else client.close()
            if closed is not None:
                await closed

    barrier.wait(processes.BARRIER_TIMEOUT)
    try:
        asyncio.run(main())
    finally:
        inspector.close()


def check(where: Where, workers: int) -> None:
    """Run ``workers`` workers on ``where``; no overlap, the counter exact, readers overlapping."""
    reports = processes.run_workers(
        work, workers, where, deadline=processes.DEADLINE, report=Report
    )
    processes.check_cycles(reports, workers, where.cycles)
    writes = sum(r.writes for r in reports)
    with redis.Redis.from_url(where.gauges_url) as server:
        assert int(server.get(COUNTER) or 0) == writes, "a writer's update was lost"
        assert int(server.get(WRITERS) or 0) == 0
        assert int(server.get(READERS) or 0) == 0
    assert sum(r.overlaps for r in reports) == 0, "a writer overlapped another holder"
    assert sum(r.failed_releases for r in reports) == 0, "a release answered False"
    assert 0 < writes < workers * where.cycles
    assert max(r.peak_readers for r in reports) > 1, "readers never overlapped"


def test_eight_processes_of_readers_and_writers(redis_pool: Pool) -> None:
    url = flushed(newest(redis_pool).url)
    check(Where("redis", url, url), WORKERS)


def test_processes_of_readers_and_writers_on_postgresql(
    redis_pool: Pool, postgres_server: str, postgres_schema: str
) -> None:
    gauges = flushed(newest(redis_pool).url)
    where = Where("postgresql", postgres_server, gauges, SQL_CYCLES, postgres_schema)
    check(where, SQL_WORKERS)


def test_processes_of_readers_and_writers_on_mysql(
    redis_pool: Pool, mysql_session: MySQLSession
) -> None:
    gauges = flushed(newest(redis_pool).url)
    check(Where("mysql", mysql_session.server().database_url, gauges, SQL_CYCLES), SQL_WORKERS)

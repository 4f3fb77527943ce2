"""SQLAlchemy engines on a real server: ``Engine`` (psycopg), ``AsyncEngine`` (asyncpg, psycopg).

Each engine's driver connections record what dmutex sends them (a psycopg
connection class of the test's, asyncpg's ``connection_class``), so "one
statement per operation" is counted at the driver, and SQLAlchemy's
``before_cursor_execute`` shows that SQLAlchemy itself runs none of it.
After every call the engine's pool has every connection back, the server
shows no session of the engine inside a transaction, and SQLAlchemy's pool
reset (its rollback on return) found the connection idle: nothing of
dmutex's stays open between calls, and SQLAlchemy has nothing to undo.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import asyncpg
import psycopg
import pytest
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from dmutex import AsyncDMutex, AsyncDSemaphore, DMutex, DMutexError, DSemaphore
from tests._support.faces import Calls, await_calls, run_calls

T = TypeVar("T")
Driver = Literal["psycopg", "asyncpg"]
APPLICATION = "dmutex-sqlalchemy-test"


class Seen:
    """What one engine saw: dmutex's statements at the driver, SQLAlchemy's own, pool resets."""

    def __init__(self) -> None:
        self.driver: list[str] = []
        self.sqlalchemy: list[str] = []
        self.resets_in_transaction = 0
        self.resets = 0

    def clear(self) -> None:
        self.driver.clear()
        self.sqlalchemy.clear()


def _url(server: str, driver: str) -> str:
    return server.replace("postgresql://", f"postgresql+{driver}://", 1)


def _watch(engine: Engine, seen: Seen, in_transaction: Callable[[Any], bool]) -> None:
    @event.listens_for(engine, "before_cursor_execute")
    def executed(*args: Any) -> None:
        seen.sqlalchemy.append(str(args[2]))

    @event.listens_for(engine.pool, "reset")
    def reset(dbapi_connection: Any, record: Any, state: Any) -> None:
        seen.resets += 1
        seen.resets_in_transaction += in_transaction(record.driver_connection)


def _psycopg_in_transaction(conn: Any) -> bool:
    return bool(conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE)


def sync_engine(server: str, seen: Seen) -> Engine:
    class Recording(psycopg.Connection[Any]):
        def execute(self, query: Any, params: Any = None, **options: Any) -> Any:
            seen.driver.append(str(query))
            return super().execute(query, params, **options)

    engine = create_engine(
        _url(server, "psycopg"),
        pool_size=2,
        creator=lambda: Recording.connect(server, application_name=APPLICATION),
    )
    _watch(engine, seen, _psycopg_in_transaction)
    return engine


def async_engine(server: str, driver: Driver, seen: Seen) -> AsyncEngine:
    make: Callable[[], Awaitable[Any]]
    if driver == "asyncpg":

        class RecordingAsyncpg(asyncpg.Connection):
            async def fetch(self, query: str, *args: Any, **options: Any) -> Any:
                seen.driver.append(query)
                return await super().fetch(query, *args, **options)

        def make() -> Awaitable[Any]:
            settings = {"application_name": APPLICATION}
            return asyncpg.connect(
                server, connection_class=RecordingAsyncpg, server_settings=settings
            )

        def in_transaction(conn: Any) -> bool:
            return bool(conn.is_in_transaction())
    else:

        class RecordingAsync(psycopg.AsyncConnection[Any]):
            async def execute(self, query: Any, params: Any = None, **options: Any) -> Any:
                seen.driver.append(str(query))
                return await super().execute(query, params, **options)

        def make() -> Awaitable[Any]:
            return RecordingAsync.connect(server, application_name=APPLICATION)

        in_transaction = _psycopg_in_transaction

    engine = create_async_engine(_url(server, driver), pool_size=2, async_creator=make)
    _watch(engine.sync_engine, seen, in_transaction)
    return engine


@pytest.fixture
def inspector(postgres_server: str) -> Iterator[psycopg.Connection[tuple[Any, ...]]]:
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        yield conn


def open_states(inspector: psycopg.Connection[tuple[Any, ...]]) -> list[str]:
    """The states of the engines' sessions on the server other than ``idle``."""
    rows = inspector.execute(
        "SELECT state FROM pg_stat_activity WHERE application_name = %s AND state <> 'idle'",
        (APPLICATION,),
    ).fetchall()
    return [str(state) for (state,) in rows]


def service() -> str:
    return f"sqla-{uuid.uuid4().hex[:12]}"


class Check:
    """After each call: one driver statement (or ``statements``), none by SQLAlchemy, all closed."""

    def __init__(
        self, seen: Seen, checked_out: Callable[[], int], inspector: psycopg.Connection[Any]
    ) -> None:
        self.seen, self.checked_out, self.inspector = seen, checked_out, inspector

    def __call__(self, statements: int = 1) -> None:
        assert len(self.seen.driver) == statements, self.seen.driver
        assert self.seen.sqlalchemy == []
        assert self.checked_out() == 0
        assert open_states(self.inspector) == []
        assert self.seen.resets_in_transaction == 0
        self.seen.clear()


# Each case: an engine and its driver; the tests are written once, as Calls of either face.
CASES = ["Engine-psycopg", "AsyncEngine-asyncpg", "AsyncEngine-psycopg"]


class Case:
    """One engine of ``name``, its classes, and the check after each call."""

    def __init__(self, name: str, server: str, schema: str, inspector: Any) -> None:
        self.asynchronous = name.startswith("Async")
        self.schema = schema
        self.seen = Seen()
        if self.asynchronous:
            driver: Driver = "asyncpg" if name.endswith("asyncpg") else "psycopg"
            self.async_engine = async_engine(server, driver, self.seen)
            self.engine: Any = self.async_engine
            pool: Any = self.async_engine.sync_engine.pool
        else:
            self.engine = sync_engine(server, self.seen)
            pool = self.engine.pool
        self.check = Check(self.seen, pool.checkedout, inspector)

    def mutex(self, name: str) -> Any:
        cls = AsyncDMutex if self.asynchronous else DMutex
        return cls(name, self.engine, schema_name=self.schema)

    def semaphore(self, name: str, permits: int) -> Any:
        cls = AsyncDSemaphore if self.asynchronous else DSemaphore
        return cls(name, self.engine, max_permits=permits, schema_name=self.schema)

    def run(self, calls: Calls[T]) -> T:
        """Run ``calls`` on this case's face, then dispose of the engine."""
        if not self.asynchronous:
            try:
                return run_calls(calls)
            finally:
                self.engine.dispose()

        async def run() -> T:
            try:
                return await await_calls(calls)
            finally:
                await self.async_engine.dispose()

        return asyncio.run(run())


@pytest.fixture(params=CASES)
def case(
    request: pytest.FixtureRequest,
    postgres_server: str,
    postgres_schema: str,
    inspector: psycopg.Connection[Any],
) -> Case:
    return Case(request.param, postgres_server, postgres_schema, inspector)


def lock_and_semaphore(case: Case) -> Calls[None]:
    check, seen = case.check, case.seen
    name = service()
    mutex, other = case.mutex(name), case.mutex(name)
    lock = yield mutex.acquire("job", ttl=30)
    assert lock is not None
    seen.clear()  # ready(): the table made, up to four statements
    assert (yield other.acquire("job")) is None
    check(2)  # its ready(): one read, the table being there; then the acquire
    first = lock.fence
    assert not (yield other.extend("job", "not-the-token", 60))
    check()
    assert (yield lock.extend(60))
    check()
    assert (yield lock.release())
    check()
    again = yield other.acquire("job", ttl=30)
    assert again is not None
    assert again.fence > first
    check()
    assert (yield again.release())
    check()

    semaphore = case.semaphore(name, 2)
    permits = [(yield semaphore.acquire("pool", ttl=30)), (yield semaphore.acquire("pool", ttl=30))]
    seen.clear()
    assert (yield semaphore.acquire("pool")) is None
    check()
    for permit in permits:
        assert permit is not None
        assert (yield permit.release())
        check()
    assert seen.resets > 0


def test_lock_and_semaphore(case: Case) -> None:
    """Acquire, contend, extend, release, fences, a semaphore: one statement each, all closed."""
    case.run(lock_and_semaphore(case))


def _foreign_table(inspector: psycopg.Connection[Any], schema: str, name: str) -> None:
    """A table of dmutex's name and another shape: ``ready()`` refuses it."""
    inspector.execute(f'CREATE TABLE "{schema}"."_dmutex_{name}" (x int)')


def refused_table(case: Case, inspector: psycopg.Connection[Any]) -> Calls[None]:
    name = service()
    _foreign_table(inspector, case.schema, name)
    with pytest.raises(DMutexError, match="another shape"):
        yield case.mutex(name).acquire("job")
    case.check(1)


def test_connection_back_after_an_error(case: Case, inspector: psycopg.Connection[Any]) -> None:
    case.run(refused_table(case, inspector))


def dropped(case: Case, inspector: psycopg.Connection[Any]) -> Calls[None]:
    mutex = case.mutex(service())
    lock = yield mutex.acquire("job", ttl=30)
    assert lock is not None
    terminated = inspector.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
        (APPLICATION,),
    ).fetchall()
    assert terminated == [(True,)]
    with pytest.raises(Exception, match="terminating connection"):
        yield lock.extend(30)
    case.seen.clear()  # asyncpg's statement failed at the driver, psycopg's BEGIN before it
    case.check(0)  # the dropped connection is out of the pool, not lent again
    for _ in range(3):
        assert (yield lock.extend(30))
        case.check()
    assert (yield lock.release())


def test_a_connection_the_server_dropped_is_not_lent_again(
    case: Case, inspector: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """It fails its statement, then the pool discards it (SQLAlchemy logs no failed reset)."""
    case.run(dropped(case, inspector))
    assert not [r for r in caplog.records if r.name.startswith("sqlalchemy")], caplog.text


def test_sync_engine_from_threads(
    postgres_server: str, postgres_schema: str, inspector: psycopg.Connection[Any]
) -> None:
    """8 threads race for 3 permits through one Engine of 2 pooled connections (and overflow)."""
    engine = sync_engine(postgres_server, Seen())
    try:
        semaphore = DSemaphore(service(), engine, max_permits=3, schema_name=postgres_schema)
        semaphore.ready()  # the table made before the race
        start = threading.Barrier(8)

        def take(_: int) -> Any:
            start.wait()
            return semaphore.acquire("pool", ttl=30)

        with ThreadPoolExecutor(8) as threads:
            granted = [permit for permit in threads.map(take, range(8)) if permit is not None]
        assert sorted(permit.slot for permit in granted) == [0, 1, 2]
        assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]  # QueuePool's
        assert open_states(inspector) == []
        assert all(permit.release() for permit in granted)
    finally:
        engine.dispose()


def test_sync_engine_in_autocommit(
    postgres_server: str, postgres_schema: str, inspector: psycopg.Connection[Any]
) -> None:
    """``isolation_level="AUTOCOMMIT"``: each statement commits on its own, no BEGIN around it."""
    engine = create_engine(
        _url(postgres_server, "psycopg"),
        isolation_level="AUTOCOMMIT",
        connect_args={"application_name": APPLICATION},
    )
    try:
        mutex = DMutex(service(), engine, schema_name=postgres_schema)
        lock = mutex.acquire("job", ttl=30)
        assert lock is not None
        assert mutex.acquire("job") is None
        assert lock.release()
        assert open_states(inspector) == []
    finally:
        engine.dispose()

"""The PostgreSQL store on a real server, driven through the engine by both drivers.

Below the public classes (whose behaviour the contract suite checks), these
tests build a ``PostgresStore`` on a psycopg 3 connection (sync, or asyncio
on a loop of its own) and run the engine's steps with ``SyncDriver`` /
``AsyncDriver``, as the public classes
do. Each face's connection records the statements it executes, so that
"one statement per operation" is counted, not assumed. A second, plain
connection reads and writes the table behind the store's back: the layout
byte for byte, expiry moved by the server's clock (the TypeScript store's
statements beside dmutex's: ``test_sql_typescript.py``). No test
sleeps: time passes by rewriting ``expired_at``.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from typing import Any, TypeVar
from urllib.parse import quote

import asyncpg
import psycopg
import psycopg_pool
import pytest

from dmutex import (
    AsyncDMutex,
    AsyncDReadWriteLock,
    DMutex,
    DMutexError,
    DReadWriteLock,
    InvalidArgumentError,
    ManualClock,
)
from dmutex._backends.postgresql import PostgresStore
from dmutex._backends.postgresql.statements import FOREVER, Statements
from dmutex._clock import SYSTEM_CLOCK, Clock
from dmutex._core.effects import Steps
from dmutex._core.engine import Engine
from dmutex._core.lease import Lease
from dmutex._core.waiting import Waiter
from dmutex._runtime.drivers import AsyncDriver, SyncDriver
from tests._support.postgres_rows import age, ms, rows

T = TypeVar("T")
FACES = ["sync", "async"]


@pytest.fixture(scope="module")
def postgres_server(postgres_server: str, postgres_schema: str) -> str:
    """The harness's server, with the run's schema first on every connection's search path.

    The tables these tests make by unqualified name then land in the schema
    the harness made for the run, on a server the user named too.
    """
    joiner = "&" if "?" in postgres_server else "?"
    return f"{postgres_server}{joiner}options={quote(f'-csearch_path={postgres_schema}')}"


class _Recording:
    """A psycopg connection whose ``execute`` records each statement it runs."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.statements: list[str] = []

    @property
    def autocommit(self) -> bool:
        return bool(self.inner.autocommit)

    @property
    def info(self) -> psycopg.ConnectionInfo:
        info: psycopg.ConnectionInfo = self.inner.info
        return info

    def transaction(self) -> Any:
        return self.inner.transaction()


class Recorded(_Recording):
    """A sync psycopg connection that records each statement it executes."""

    def execute(
        self, query: str, params: Mapping[str, object], /, *, prepare: bool | None = None
    ) -> psycopg.Cursor[Any]:
        self.statements.append(query)
        cursor: psycopg.Cursor[Any] = self.inner.execute(query, params, prepare=prepare)
        return cursor


class AsyncRecorded(_Recording):
    """The asyncio twin of :class:`Recorded`."""

    async def execute(
        self, query: str, params: Mapping[str, object], /, *, prepare: bool | None = None
    ) -> psycopg.AsyncCursor[Any]:
        self.statements.append(query)
        cursor: psycopg.AsyncCursor[Any] = await self.inner.execute(query, params, prepare=prepare)
        return cursor


class Face:
    """One face's recorded connection and driver; ``drive`` runs steps to their end."""

    def __init__(self, name: str, url: str) -> None:
        self.name = name
        self.asynchronous = name == "async"
        self.loop: asyncio.AbstractEventLoop | None = None
        self.conn: Recorded | AsyncRecorded
        if self.asynchronous:
            loop = self.loop = asyncio.new_event_loop()
            self.thread = threading.Thread(target=loop.run_forever, daemon=True)
            self.thread.start()
            inner = self.wait(psycopg.AsyncConnection.connect(url, autocommit=True))
            self.conn = AsyncRecorded(inner)
        else:
            self.conn = Recorded(psycopg.connect(url, autocommit=True))

    def wait(self, work: Coroutine[Any, Any, T]) -> T:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout=30)

    def store(
        self,
        table: str,
        permits: int = 1,
        *,
        schema: str | None = None,
        fencing: bool = True,
        clock: Clock = SYSTEM_CLOCK,
        client: object | None = None,
    ) -> Subject:
        store = PostgresStore(
            self.conn if client is None else client,
            table,
            permits,
            clock,
            schema=schema,
            asynchronous=self.asynchronous,
            fencing=fencing,
        )
        return Subject(self, store)

    def driver(self, prepare: Callable[[], Steps[None]]) -> Callable[[Steps[T]], T]:
        """A driver of this face that prepares with ``prepare``, as a plain call."""
        if self.asynchronous:
            driver = AsyncDriver(SYSTEM_CLOCK, prepare)
            return lambda steps: self.wait(_awaited(driver(steps)))
        return SyncDriver(SYSTEM_CLOCK, prepare)

    def close(self) -> None:
        if isinstance(self.conn, AsyncRecorded):
            self.wait(self.conn.inner.close())
            assert self.loop is not None
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            self.loop.close()
        else:
            self.conn.inner.close()


async def _awaited(work: Awaitable[T]) -> T:
    return await work


class Subject:
    """A store, its engine and its face: what a DMutex/DSemaphore instance would hold."""

    def __init__(self, face: Face, store: PostgresStore) -> None:
        self.face = face
        self.store = store
        self.engine = Engine(store, default_ttl=60)
        # Prepared before its first request, once, as an instance's driver is.
        self.drive: Callable[[Steps[Any]], Any] = face.driver(self.engine.prepare)
        self._unprepared: Callable[[Steps[Any]], Any] = face.driver(_nothing)

    def ready(self) -> None:
        self.drive(self.store.ready())

    def acquire(self, key: str, ttl: float = 60) -> Lease | None:
        lease: Lease | None = self.drive(self.engine.acquire(key, ttl))
        return lease

    def counted(self, steps: Steps[T]) -> tuple[T, int]:
        """What ``steps`` return, and how many statements they executed (none to prepare)."""
        before = len(self.face.conn.statements)
        result: T = self._unprepared(steps)
        return result, len(self.face.conn.statements) - before


def _nothing() -> Steps[None]:
    yield from ()


@pytest.fixture
def raw(postgres_server: str) -> Iterator[psycopg.Connection[Any]]:
    """A plain autocommit connection, to look at and change tables behind the store."""
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        yield conn


@pytest.fixture(params=FACES)
def face(request: pytest.FixtureRequest, postgres_server: str) -> Iterator[Face]:
    made = Face(request.param, postgres_server)
    yield made
    made.close()


@pytest.fixture
def table(raw: psycopg.Connection[Any]) -> Iterator[str]:
    """A fresh table name, dropped after the test."""
    name = f"_dmutex_t{uuid.uuid4().hex[:12]}"
    yield name
    raw.execute(f'DROP TABLE IF EXISTS "{name}"')


# --- the layout ------------------------------------------------------------------------


def test_ready_creates_the_typescript_table_and_index(
    face: Face, raw: psycopg.Connection[Any], table: str, postgres_schema: str
) -> None:
    subject = face.store(table)
    _, statements = subject.counted(subject.store.ready())
    assert statements == 4, "read the shape, create table, create index, read it again"
    columns = raw.execute(
        """SELECT column_name, data_type, is_nullable FROM information_schema.columns
        WHERE table_name = %s ORDER BY ordinal_position""",
        (table,),
    ).fetchall()
    assert columns == [
        ("key", "text", "NO"),
        ("value", "text", "NO"),
        ("expired_at", "timestamp with time zone", "NO"),
    ]
    indexes = dict(
        raw.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s", (table,)
        ).fetchall()
    )
    on = f"ON {postgres_schema}.{table} USING btree"
    assert indexes == {
        f"{table}_pkey": f"CREATE UNIQUE INDEX {table}_pkey {on} (key)",
        f"{table}_expired_at_idx": f"CREATE INDEX {table}_expired_at_idx {on} (expired_at)",
    }
    _, again = subject.counted(subject.store.ready())
    assert again == 1, "a table of the right shape with its index: one read, nothing created"


def test_ready_refuses_a_table_of_another_shape(
    face: Face, raw: psycopg.Connection[Any], table: str
) -> None:
    raw.execute(
        f'CREATE TABLE "{table}" ("key" text PRIMARY KEY, "value" varchar(64) NOT NULL, '
        '"expired_at" timestamptz NOT NULL)'
    )
    with pytest.raises(DMutexError, match="another shape") as refused:
        face.store(table).ready()
    assert "value character varying(64) NOT NULL" in str(refused.value), "what was found"
    assert "value text NOT NULL" in str(refused.value), "what dmutex needs"
    raw.execute(f'DROP TABLE "{table}"')
    raw.execute(
        f'CREATE TABLE "{table}" ("key" text NOT NULL, "value" text NOT NULL, '
        '"expired_at" timestamptz NOT NULL)'
    )
    with pytest.raises(DMutexError, match=r"primary key \(None\)"):
        face.store(table).ready()
    raw.execute(f'DROP TABLE "{table}"')
    raw.execute(f'CREATE VIEW "{table}" AS SELECT 1 AS one')
    try:
        with pytest.raises(DMutexError, match="is not a table"):
            face.store(table).ready()
    finally:
        raw.execute(f'DROP VIEW "{table}"')


def test_a_schema_and_an_odd_name_are_quoted_as_the_typescript_store_quotes_them(
    face: Face, raw: psycopg.Connection[Any]
) -> None:
    schema, table = f"s{uuid.uuid4().hex[:8]}", 'odd "name" 100%'
    raw.execute(f'CREATE SCHEMA "{schema}"')
    try:
        subject = face.store(table, 3, schema=schema)
        lease = subject.acquire("k%s")
        assert lease is not None
        quoted = f'"{schema}"."odd ""name"" 100%"'
        assert subject.store.statements.table == quoted
        found = raw.execute(f'SELECT "key", "value" FROM {quoted}').fetchall()
        assert (f"permit:{lease.slot}:k%s", lease.token) in found
        index = raw.execute(
            "SELECT indexname FROM pg_indexes WHERE schemaname = %s AND indexname LIKE %s",
            (schema, "%expired_at_idx"),
        ).fetchall()
        assert index == [(f"{table}_expired_at_idx",)]
    finally:
        raw.execute(f'DROP SCHEMA "{schema}" CASCADE')


def test_bad_identifiers_are_refused_before_any_statement() -> None:
    with pytest.raises(InvalidArgumentError, match="table_name"):
        Statements.of("")
    with pytest.raises(InvalidArgumentError, match="schema_name"):
        Statements.of("t", "a\0b")


def _tables_named(raw: psycopg.Connection[Any], name: str) -> int:
    found = raw.execute("SELECT count(*) FROM pg_tables WHERE tablename = %s", (name,)).fetchone()
    assert found is not None
    return int(found[0])


def test_a_key_with_nul_is_refused_before_the_table_is_made(
    postgres_server: str, raw: psycopg.Connection[Any]
) -> None:
    """PostgreSQL text holds no NUL: psycopg's DataError and asyncpg's came after ready()."""
    service = f"nul{uuid.uuid4().hex[:8]}"
    tables = [f"_dmutex_{service}", f"_drwlock_{service}"]
    try:
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            with pytest.raises(InvalidArgumentError, match="NUL character"):
                DMutex(service, conn).acquire("a\x00b")
            with pytest.raises(InvalidArgumentError, match="NUL character"):
                DReadWriteLock(service, conn).acquire_write("a\x00b")

        async def main() -> None:
            conn = await asyncpg.connect(postgres_server)
            try:
                with pytest.raises(InvalidArgumentError, match="NUL character"):
                    await AsyncDMutex(service, conn).acquire("a\x00b")
                with pytest.raises(InvalidArgumentError, match="NUL character"):
                    await AsyncDReadWriteLock(service, conn).acquire_read("\x00")
            finally:
                await conn.close()

        asyncio.run(main())
        assert [_tables_named(raw, name) for name in tables] == [0, 0], "nothing was sent"
    finally:
        for name in tables:
            raw.execute(f'DROP TABLE IF EXISTS "{name}"')


def test_each_driver_gets_its_placeholders_from_one_text() -> None:
    sql = Statements.of("100%", "s").release
    assert '"s"."100%%"' in sql.psycopg, "psycopg reads a lone % as a placeholder"
    assert '"s"."100%"' in sql.asyncpg
    assert sql.names == ("key", "first", "last", "token")
    # A name used twice is one argument, numbered where it first appears.
    assert sql.asyncpg.count("$1") == 1
    assert "%(" not in sql.asyncpg
    assert "$" not in sql.psycopg
    assert sql.arguments({"token": "t", "last": 2, "first": 0, "key": "k", "x": 1}) == (
        "k",
        0,
        2,
        "t",
    )
    acquire = Statements.of("t").acquire_semaphore
    assert acquire.asyncpg.count("$1") == acquire.psycopg.count("%(key)s") > 1


def test_a_grant_writes_the_slot_row_and_the_fence_row(
    face: Face, raw: psycopg.Connection[Any], table: str
) -> None:
    subject = face.store(table, 3)
    lease = subject.acquire("api", ttl=7.5)
    assert lease is not None
    assert lease.fence is not None
    stored = rows(raw, table)
    assert set(stored) == {f"permit:{lease.slot}:api", "fence:api"}
    value, expired_at = stored[f"permit:{lease.slot}:api"]
    assert value == lease.token
    assert ms(expired_at) == lease.expires_ms, "the handle's expiry is what the server stored"
    # The fence is the server's clock in µs in the grant's statement (the counter
    # was absent), and the expiry that clock plus the TTL: one instant for both.
    assert ms(expired_at) == (lease.fence + 7_500_000) // 1000
    fence_value, fence_expiry = stored["fence:api"]
    assert fence_value == str(lease.fence)
    assert fence_expiry.isoformat() == "9999-01-01T00:00:00+00:00"
    assert str(FOREVER).startswith("9999-01-01")


# --- the operations --------------------------------------------------------------------


def test_mutex_acquire_contend_extend_release(
    face: Face, raw: psycopg.Connection[Any], table: str
) -> None:
    subject = face.store(table)
    subject.ready()
    lease, n = subject.counted(subject.engine.acquire("job", 30))
    assert n == 1
    assert lease is not None
    assert lease.slot == 0
    other, n = subject.counted(subject.engine.acquire("job", 30))
    assert (other, n) == (None, 1)
    before = lease.expires_ms
    extended, n = subject.counted(subject.engine.extend(lease, 90))
    assert (extended, n) == (True, 1)
    assert lease.expires_ms >= before + 60_000
    assert ms(rows(raw, table)["permit:0:job"][1]) == lease.expires_ms
    released, n = subject.counted(subject.engine.release(lease))
    assert (released, n) == (True, 1)
    assert "permit:0:job" not in rows(raw, table)
    again, n = subject.counted(subject.engine.release(lease))
    assert (again, n) == (False, 1)
    assert subject.acquire("job") is not None


def test_expiry_is_decided_by_the_servers_clock(
    face: Face, raw: psycopg.Connection[Any], table: str
) -> None:
    # A client clock a year ahead changes nothing: the server's decides.
    clock = ManualClock()
    clock.advance(365 * 86_400)
    subject = face.store(table, clock=clock)
    first = subject.acquire("job", 30)
    assert first is not None
    assert subject.acquire("job") is None, "held by the server's clock"
    age(raw, table, "permit:0:job")
    second = subject.acquire("job", 30)
    assert second is not None, "taken over once expired"
    assert second.token != first.token
    assert subject.drive(subject.engine.extend(first, 30)) is False
    assert subject.drive(subject.engine.release(first)) is False
    assert rows(raw, table)["permit:0:job"][0] == second.token, "the successor's row untouched"
    age(raw, table, "permit:0:job")
    assert subject.drive(subject.engine.release(second)) is False, "expired: False"
    assert rows(raw, table)["permit:0:job"][0] == second.token, "its record still lies there"


@pytest.mark.parametrize("permits", [1, 3, 64])
def test_semaphore_free_then_full_one_statement_each(
    face: Face, raw: psycopg.Connection[Any], table: str, permits: int
) -> None:
    subject = face.store(table, permits)
    subject.ready()
    leases: list[Lease] = []
    for _ in range(permits):
        lease, n = subject.counted(subject.engine.acquire("pool", 30))
        assert n == 1
        assert lease is not None
        leases.append(lease)
    assert sorted(lease.slot for lease in leases) == list(range(permits))
    full, n = subject.counted(subject.engine.acquire("pool", 30))
    assert (full, n) == (None, 1)
    freed = leases[permits // 2]
    assert subject.drive(subject.engine.release(freed)) is True
    taken, n = subject.counted(subject.engine.acquire("pool", 30))
    assert n == 1
    assert taken is not None
    assert taken.slot == freed.slot
    age(raw, table, f"permit:{leases[0].slot}:pool")
    taken_over = subject.acquire("pool")
    assert taken_over is not None, "an expired slot is taken over"
    assert taken_over.slot == leases[0].slot
    stored = rows(raw, table)
    assert len(stored) == permits + 1  # every slot and the fence row
    holders, n = subject.counted(subject.store.holders("pool"))
    assert n == 1
    assert [h.slot for h in holders.holders] == list(range(permits))


def test_fences_strictly_increase_and_survive_a_lost_counter(
    face: Face, raw: psycopg.Connection[Any], table: str
) -> None:
    mutex, semaphore = face.store(table), face.store(table, 4)
    fences: list[int] = []
    for _ in range(5):
        lease = mutex.acquire("m")
        assert lease is not None
        assert lease.fence is not None
        fences.append(lease.fence)
        assert mutex.drive(mutex.engine.release(lease)) is True
    held = [semaphore.acquire("s") for _ in range(4)]
    assert all(lease is not None for lease in held)
    sem_fences = [lease.fence for lease in held if lease is not None and lease.fence is not None]
    assert sem_fences == sorted(sem_fences)
    assert len(set(sem_fences)) == 4
    assert fences == sorted(fences)
    assert len(set(fences)) == 5
    assert rows(raw, table)["fence:m"][0] == str(fences[-1])
    raw.execute(f"""DELETE FROM "{table}" WHERE "key" = 'fence:m'""")
    after = mutex.acquire("m")
    assert after is not None
    assert after.fence is not None
    assert after.fence > fences[-1], "a lost counter restarts at the server's clock, above"
    # A counter far ahead (a clock that stepped back since): the counter plus one.
    raw.execute(f"""UPDATE "{table}" SET "value" = '999999999999999990' WHERE "key" = 'fence:m'""")
    assert mutex.drive(mutex.engine.release(after)) is True
    ahead = mutex.acquire("m")
    assert ahead is not None
    assert ahead.fence == 999999999999999991


def test_without_fencing_no_fence_row(face: Face, raw: psycopg.Connection[Any], table: str) -> None:
    subject = face.store(table, 2, fencing=False)
    lease = subject.acquire("k")
    assert lease is not None
    assert lease.fence is None
    assert set(rows(raw, table)) == {f"permit:{lease.slot}:k"}


@pytest.mark.parametrize("permits", [1, 3])
def test_a_foreign_fence_row_stops_the_grant_and_stays(
    face: Face, raw: psycopg.Connection[Any], table: str, permits: int
) -> None:
    subject = face.store(table, permits)
    subject.ready()
    raw.execute(
        f"""INSERT INTO "{table}" VALUES ('fence:k', 'not ours', now() + interval '1 hour')"""
    )
    before = rows(raw, table)
    with pytest.raises(DMutexError, match="did not write"):
        subject.acquire("k")
    assert rows(raw, table) == before, "nothing written: the grant rolled back with its fence"


def test_a_resent_acquire_recognises_its_own_token(
    face: Face, raw: psycopg.Connection[Any], table: str
) -> None:
    for permits in (1, 3):
        subject = face.store(table, permits)
        key, token = f"k{permits}", str(uuid.uuid4())
        first = subject.drive(subject.store.acquire(key, token, 30_000))
        # The reply was lost: the same request, sent again.
        copy, n = subject.counted(subject.store.acquire(key, token, 30_000))
        assert n == 1
        assert first is not None
        assert copy is not None
        assert copy.slot == first.slot
        held = [k for k, (v, _) in rows(raw, table).items() if v == token]
        assert held == [f"permit:{first.slot}:{key}"], "one slot, not a second"
        assert copy.fence is not None
        assert first.fence is not None
        assert copy.fence > first.fence


def test_release_and_extend_by_token_find_the_slot(
    face: Face, raw: psycopg.Connection[Any], table: str
) -> None:
    subject = face.store(table, 5)
    leases = [subject.acquire("k") for _ in range(3)]
    assert all(lease is not None for lease in leases)
    target = leases[1]
    assert target is not None
    assert subject.drive(subject.engine.extend_token("k", target.token, 120)) is True
    assert subject.drive(subject.engine.extend_token("k", str(uuid.uuid4()), 120)) is False
    (released, n) = subject.counted(subject.engine.release_token("k", target.token))
    assert (released, n) == (True, 1)
    assert f"permit:{target.slot}:k" not in rows(raw, table)


def test_renewals_go_in_one_statement(face: Face, raw: psycopg.Connection[Any], table: str) -> None:
    subject = face.store(table, 4)
    leases = [subject.acquire(key, 10) for key in ("a", "a", "b")]
    alive = [lease for lease in leases if lease is not None]
    assert len(alive) == 3
    age(raw, table, f"permit:{alive[1].slot}:a")
    answers, n = subject.counted(subject.store.extend_many(alive))
    assert n == 1
    assert answers[1] is None, "expired: not renewed"
    stored = rows(raw, table)
    for lease, answer in zip(alive, answers, strict=True):
        if answer is not None:
            assert isinstance(answer, int)
            assert ms(stored[f"permit:{lease.slot}:{lease.key}"][1]) == answer


def test_holders_and_the_waiters_hint(face: Face, raw: psycopg.Connection[Any], table: str) -> None:
    subject = face.store(table, 2)
    a, b = subject.acquire("k", 30), subject.acquire("k", 90)
    assert a is not None
    assert b is not None
    found = subject.drive(subject.store.holders("k"))
    assert [(h.slot, h.token, h.expires_ms) for h in found.holders] == sorted(
        (lease.slot, lease.token, lease.expires_ms) for lease in (a, b)
    )
    assert found.fence == b.fence
    assert a.expires_ms - 30_000 <= found.now_ms < a.expires_ms
    waiter = Waiter(1000)
    assert subject.drive(subject.store.acquire("k", str(uuid.uuid4()), 1000, waiter)) is None
    assert waiter.expires_in is not None
    assert 29.0 < waiter.expires_in <= 30.0, "the lease in the way that ends first"


# --- the connection ----------------------------------------------------------------------


def test_a_connection_outside_autocommit_commits_each_statement(
    postgres_server: str, raw: psycopg.Connection[Any], table: str
) -> None:
    with psycopg.connect(postgres_server) as conn:
        store = PostgresStore(conn, table, 1, SYSTEM_CLOCK, asynchronous=False)
        drive = SyncDriver(SYSTEM_CLOCK, store.ready)
        lease = drive(Engine(store, default_ttl=60).acquire("k", None))
        assert lease is not None
        assert rows(raw, table)["permit:0:k"][0] == lease.token, "committed, seen by others"
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        conn.execute("SELECT 1")  # the caller's own transaction begins
        with pytest.raises(DMutexError, match="inside a transaction"):
            drive(store.release("k", lease.token, 0))
        conn.rollback()
        assert drive(store.release("k", lease.token, 0)) is True


def test_a_pool_lends_a_connection_per_statement(
    postgres_server: str, raw: psycopg.Connection[Any], table: str
) -> None:
    with psycopg_pool.ConnectionPool(postgres_server, min_size=1, max_size=2) as pool:
        store = PostgresStore(pool, table, 2, SYSTEM_CLOCK, asynchronous=False)
        engine = Engine(store, default_ttl=60)
        drive = SyncDriver(SYSTEM_CLOCK, store.ready)
        leases = [drive(engine.acquire("k", None)) for _ in range(3)]
        assert [lease is not None for lease in leases] == [True, True, False]
        assert len(rows(raw, table)) == 3


def test_an_async_pool_lends_a_connection_per_statement(
    postgres_server: str, raw: psycopg.Connection[Any], table: str
) -> None:
    async def main() -> list[Lease | None]:
        async with psycopg_pool.AsyncConnectionPool(
            postgres_server, min_size=1, max_size=2, open=False
        ) as pool:
            store = PostgresStore(pool, table, 2, SYSTEM_CLOCK, asynchronous=True)
            engine = Engine(store, default_ttl=60)
            drive = AsyncDriver(SYSTEM_CLOCK, store.ready)
            return [await drive(engine.acquire("k", None)) for _ in range(3)]

    leases = asyncio.run(main())
    assert [lease is not None for lease in leases] == [True, True, False]
    assert len(rows(raw, table)) == 3


def at_once(count: int, work: Callable[[psycopg.Connection[Any]], T], url: str) -> list[T]:
    """``work(connection)`` in ``count`` threads, each on its own connection, started together."""
    start = threading.Barrier(count)
    done: list[T] = []
    lock = threading.Lock()

    def one() -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            start.wait()
            answer = work(conn)
        with lock:
            done.append(answer)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return done


def test_racing_acquires_of_a_semaphore_all_get_a_permit(
    postgres_server: str, raw: psycopg.Connection[Any], table: str
) -> None:
    # Eight threads on eight connections, eight permits: none may answer None
    # (a lost race for one free slot is retried while others are free).
    with psycopg.connect(postgres_server, autocommit=True) as setup:
        store = PostgresStore(setup, table, 8, SYSTEM_CLOCK, asynchronous=False)
        SyncDriver(SYSTEM_CLOCK, store.ready).ready()

    def take(conn: psycopg.Connection[Any]) -> Lease | None:
        store = PostgresStore(conn, table, 8, SYSTEM_CLOCK, asynchronous=False)
        lease: Lease | None = SyncDriver(SYSTEM_CLOCK, _nothing)(
            Engine(store, default_ttl=60).acquire("k", None)
        )
        return lease

    got = at_once(8, take, postgres_server)
    assert len(got) == 8
    assert all(lease is not None for lease in got)
    assert sorted(lease.slot for lease in got if lease is not None) == list(range(8))


def test_asyncpg_runs_the_same_statements_with_numbered_parameters(
    postgres_server: str, raw: psycopg.Connection[Any], table: str
) -> None:
    async def main() -> None:
        # statement_cache_size=0: unnamed statements only, as a pooler needs.
        conn = await asyncpg.connect(postgres_server, statement_cache_size=0)
        try:
            store = PostgresStore(conn, table, 3, SYSTEM_CLOCK, asynchronous=True)
            engine = Engine(store, default_ttl=60)
            drive = AsyncDriver(SYSTEM_CLOCK, store.ready)
            leases = [await drive(engine.acquire("k", 30)) for _ in range(4)]
            assert leases[3] is None
            held = [lease for lease in leases if lease is not None]
            assert sorted(lease.slot for lease in held) == [0, 1, 2]
            found = await drive(store.holders("k"))
            assert [h.token for h in found.holders] == [
                lease.token for lease in sorted(held, key=lambda lease: lease.slot)
            ]
            renewed = await drive(store.extend_many(held))
            assert all(isinstance(answer, int) for answer in renewed)
            assert await drive(engine.release(held[0])) is True
            assert await drive(engine.release(held[0])) is False
        finally:
            await conn.close()

    asyncio.run(main())
    assert len(rows(raw, table)) == 3, "two slots and the fence row"


@pytest.mark.parametrize("permits", [3, 64])
def test_a_semaphores_acquire_gets_a_cached_generic_plan(
    postgres_server: str, table: str, permits: int
) -> None:
    """statements.py, rule 8: the server stops planning the prepared acquire afresh.

    asyncpg prepares every statement; PostgreSQL plans a prepared statement
    anew for each of its first five runs, then keeps a generic plan if it
    costs no more than those. With the slots' number a parameter, it never
    did (0 generic plans in 13 runs).
    """
    runs = 12

    async def main() -> tuple[int, int]:
        conn = await asyncpg.connect(postgres_server)
        try:
            store = PostgresStore(conn, table, permits, SYSTEM_CLOCK, asynchronous=True)
            engine = Engine(store, default_ttl=60)
            drive = AsyncDriver(SYSTEM_CLOCK, store.ready)
            for _ in range(runs):
                lease = await drive(engine.acquire("k", 30))
                assert lease is not None
                assert await drive(engine.release(lease)) is True
            found = await conn.fetch(  # the semaphore's acquire: its CTE "pick"
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
                " WHERE statement LIKE '%pick AS (SELECT%'"
                " AND statement NOT LIKE '%pg_prepared_statements%'"
            )
            assert len(found) == 1, found
            return int(found[0][0]), int(found[0][1])
        finally:
            await conn.close()

    generic, custom = asyncio.run(main())
    assert generic + custom == runs
    assert generic >= runs - 6, f"{generic} generic plans, {custom} custom"


class Scripted:
    """A psycopg-shaped connection in autocommit that answers each statement from a script."""

    autocommit = True
    info = None

    def __init__(self, replies: list[list[tuple[object, ...]]]) -> None:
        self.replies = replies
        self.description: list[str] | None = ["column"]
        self.sent = 0

    def execute(self, query: str, params: Mapping[str, object], /, *, prepare: bool) -> Scripted:
        assert prepare is False, "never a named prepared statement"
        self.sent += 1
        return self

    def fetchall(self) -> list[tuple[object, ...]]:
        return self.replies.pop(0)


def test_a_semaphore_acquire_that_lost_its_race_sends_the_statement_again() -> None:
    # (slot, expires, fence, ends, now, raced, foreign_row): the slot it picked
    # was taken between its read and its upsert, then a second pick succeeds.
    conn = Scripted(
        [[(None, None, None, None, 1000, True, None)], [(2, 61000, 7, None, 1000, False, None)]]
    )
    store = PostgresStore(conn, "t", 3, SYSTEM_CLOCK, asynchronous=False)
    lease = SyncDriver(SYSTEM_CLOCK, _nothing)(store.acquire("k", "token", 60_000))
    assert lease is not None
    assert (lease.slot, lease.expires_ms, lease.fence) == (2, 61000, 7)
    assert conn.sent == 2
    # Full, not raced: one statement, None, and the waiter learns the earliest end.
    full = Scripted([[(None, None, None, 4500, 1000, False, None)]])
    waiter = Waiter(1000)
    store = PostgresStore(full, "t", 3, SYSTEM_CLOCK, asynchronous=False)
    assert SyncDriver(SYSTEM_CLOCK, _nothing)(store.acquire("k", "token", 60_000, waiter)) is None
    assert (full.sent, waiter.expires_in) == (1, 3.5)


def test_processes_preparing_one_table_at_once_all_succeed(
    postgres_server: str, raw: psycopg.Connection[Any], table: str
) -> None:
    # CREATE TABLE IF NOT EXISTS may fail in a race (a unique violation in
    # the catalog); ready() forgives it once the table reads right.
    def prepare(conn: psycopg.Connection[Any]) -> BaseException | None:
        store = PostgresStore(conn, table, 1, SYSTEM_CLOCK, asynchronous=False)
        try:
            SyncDriver(SYSTEM_CLOCK, store.ready).ready()
        except BaseException as error:  # noqa: BLE001 - reported below
            return error
        return None

    assert at_once(6, prepare, postgres_server) == [None] * 6
    assert rows(raw, table) == {}
    indexes = raw.execute("SELECT count(*) FROM pg_indexes WHERE tablename = %s", (table,))
    assert indexes.fetchone() == (2,), "the primary key and the expiry index"

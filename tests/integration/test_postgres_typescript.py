"""The TypeScript dmutex's PostgreSQL store and dmutex on one table, on a real server.

The TypeScript library (github.com/song-younghoon/dmutex, 0.4.0, commit
fa55975) is not on npm and cannot run here, so :class:`TypeScript`
replays what it sends: the statements of its ``src/postgres-store.ts``
(``PostgresDMutexStore``: ``initialize``, ``acquire``, ``release``,
``extend``), quoted verbatim, with its way of naming and quoting the table,
driven by the slot loops of its ``src/semaphore.ts`` (``DSemaphore``; its
``DMutex`` is a one-permit semaphore under the prefix ``_dmutex_``). They
run as node-postgres runs them: one statement per query in autocommit,
numbered ``$n`` parameters (psycopg's ``RawCursor``), every value sent as
text. dmutex is driven through its public classes, on psycopg (sync and
asyncio) and asyncpg.

What must hold:

- a TypeScript holder excludes dmutex and dmutex excludes it, for a mutex
  and for a semaphore; both semaphores racing from threads never hold more
  than ``max_permits`` together, and a dmutex grant that a TypeScript commit
  overtakes tries again rather than overwrite it;
- either library releases and extends the other's grant by its token;
  ``dmutex status`` (``read_holders``) shows TypeScript grants as holders,
  and a dmutex waiter behind one is let in when it expires;
- dmutex's extra rows (``fence:{key}``, ``waiters:{key}``) are never a
  permit to the TypeScript store nor in its way, and it never changes them;
  each library's table creation accepts the other's table;
- the known differences, as facts: the TypeScript release ignores expiry;
  its acquire has no lost-reply rule; its semaphore acquire costs one
  statement per slot it tries; its ``ready()`` always needs ``CREATE``; it
  notifies no dmutex waiter; it lets PostgreSQL cut an index name dmutex
  refuses.

A lease runs out by rewriting ``expired_at``, except where waiting for an
expiry or a renewal is the point (TTLs of 0.3 and 0.6 s).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any, TypeVar

import asyncpg
import psycopg
import psycopg_pool
import pytest
from psycopg import sql

from dmutex import AsyncDSemaphore, DMutex, DSemaphore, InvalidArgumentError
from dmutex._backends.postgresql.statements import FOREVER, WAITERS, channel
from dmutex._cli.holders import read_holders
from tests._support.postgres_rows import age, ms, rows
from tests._support.sampling import until
from tests._support.typescript import PythonSide, TypeScriptSemaphore

T = TypeVar("T")
KEY = "job"
SIDES = ["psycopg", "psycopg-async", "asyncpg"]


# --- the TypeScript library, replayed -----------------------------------------------------


def quote_identifier(identifier: str) -> str:
    """postgres-store.ts's ``quoteIdentifier``."""
    if not identifier or "\0" in identifier:
        raise ValueError("PostgreSQL identifiers must be non-empty strings without null bytes")
    return '"' + identifier.replace('"', '""') + '"'


class TypeScript(TypeScriptSemaphore[datetime]):
    """The TypeScript ``DSemaphore`` (or ``DMutex``) on its ``PostgresDMutexStore``, replayed.

    ``conn`` must be in autocommit with ``RawCursor`` (node-postgres's ``$n``
    parameters): :func:`typescript_connection` makes one.
    """

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        service_name: str,
        *,
        max_permits: int = 1,
        table_prefix: str = "_dsemaphore_",
        table_name: str | None = None,
        schema_name: str | None = None,
    ) -> None:
        self.conn = conn
        self.max_permits = max_permits
        # PostgresDMutexStore's constructor.
        self.table_name = table_name or f"{table_prefix}{service_name}"
        self.index_name = f"{self.table_name}_expired_at_idx"
        self.table = (
            f"{quote_identifier(schema_name)}.{quote_identifier(self.table_name)}"
            if schema_name
            else quote_identifier(self.table_name)
        )

    @classmethod
    def mutex(cls, conn: psycopg.Connection[Any], service_name: str, **options: Any) -> TypeScript:
        """mutex.ts's ``DMutex``: one permit, tables prefixed ``_dmutex_``."""
        return cls(conn, service_name, max_permits=1, table_prefix="_dmutex_", **options)

    def query(self, text: str, values: tuple[object, ...] = ()) -> psycopg.Cursor[Any]:
        """``pool.query(text, values)``: each value sent as text, its type left to the server."""
        return self.conn.execute(text, [str(value) for value in values] if values else None)

    # postgres-store.ts, verbatim: the text of each statement as it builds it.

    def ready(self) -> None:
        self.query(f"""
      CREATE TABLE IF NOT EXISTS {self.table} (
        "key" text PRIMARY KEY,
        "value" text NOT NULL,
        "expired_at" timestamptz NOT NULL
      )
    """)
        self.query(f"""
      CREATE INDEX IF NOT EXISTS {quote_identifier(self.index_name)}
      ON {self.table} ("expired_at")
    """)

    def store_acquire(self, key: str, token: str, ttl_seconds: float) -> datetime | None:
        row = self.query(
            f"""
      INSERT INTO {self.table} AS locks ("key", "value", "expired_at")
      VALUES ($1, $2, NOW() + ($3::double precision * INTERVAL '1 second'))
      ON CONFLICT ("key") DO UPDATE
      SET
        "value" = EXCLUDED."value",
        "expired_at" = EXCLUDED."expired_at"
      WHERE locks."expired_at" <= NOW()
      RETURNING "expired_at"
    """,
            (key, token, ttl_seconds),
        ).fetchone()
        return None if row is None else row[0]

    def store_release(self, key: str, token: str) -> bool:
        done = self.query(
            f"""
      DELETE FROM {self.table}
      WHERE "key" = $1 AND "value" = $2
    """,
            (key, token),
        )
        return done.rowcount == 1

    def store_extend(self, key: str, token: str, ttl_seconds: float) -> datetime | None:
        row = self.query(
            f"""
      UPDATE {self.table}
      SET "expired_at" = NOW() + ($3::double precision * INTERVAL '1 second')
      WHERE "key" = $1
        AND "value" = $2
        AND "expired_at" > NOW()
      RETURNING "expired_at"
    """,
            (key, token, ttl_seconds),
        ).fetchone()
        return None if row is None else row[0]


# --- connections ----------------------------------------------------------------------------


class Counted(psycopg.Connection[Any]):
    """A psycopg connection that counts the statements sent through its ``execute``."""

    sent = 0

    def execute(
        self,
        query: Any,
        params: Any = None,
        *,
        prepare: bool | None = None,
        binary: bool = False,
    ) -> psycopg.Cursor[Any]:
        self.sent += 1
        return super().execute(query, params, prepare=prepare, binary=binary)


def connect(url: str, schema: str, **options: Any) -> Counted:
    """An autocommit connection whose search path is the run's schema."""
    return Counted.connect(url, autocommit=True, options=f"-csearch_path={schema}", **options)


def typescript_connection(url: str, schema: str) -> Counted:
    """A connection that runs statements as node-postgres does: ``$n`` parameters."""
    return connect(url, schema, cursor_factory=psycopg.RawCursor)


class Python(PythonSide):
    """dmutex's public classes on one kind of client, each call run to its end."""

    def __init__(self, kind: str, url: str, schema: str) -> None:
        self.loop = None if kind == "psycopg" else asyncio.new_event_loop()
        self.client: Any
        if kind == "psycopg":
            self.client = connect(url, schema)
        elif kind == "psycopg-async":
            self.client = self.run(
                psycopg.AsyncConnection.connect(
                    url, autocommit=True, options=f"-csearch_path={schema}"
                )
            )
        else:
            self.client = self.run(asyncpg.connect(url, server_settings={"search_path": schema}))

    def close(self) -> None:
        self.run(self.client.close())
        if self.loop is not None:
            self.loop.close()


@pytest.fixture
def url(postgres_server: str) -> str:
    """The server's URL; each connection sets its search path to the run's schema."""
    return postgres_server


@pytest.fixture
def raw(url: str, postgres_schema: str) -> Iterator[Counted]:
    """A plain autocommit connection, to look at and change tables behind both libraries."""
    with connect(url, postgres_schema) as conn:
        yield conn


@pytest.fixture
def ts_conn(url: str, postgres_schema: str) -> Iterator[Counted]:
    with typescript_connection(url, postgres_schema) as conn:
        yield conn


@pytest.fixture
def service(raw: Counted) -> Iterator[str]:
    """A fresh service name; its mutex and semaphore tables are dropped after the test."""
    name = f"svc{uuid.uuid4().hex[:10]}"
    yield name
    for prefix in ("_dmutex_", "_dsemaphore_"):
        raw.execute(f'DROP TABLE IF EXISTS "{prefix}{name}"')


@pytest.fixture(params=SIDES)
def side(request: pytest.FixtureRequest, url: str, postgres_schema: str) -> Iterator[Python]:
    made = Python(request.param, url, postgres_schema)
    yield made
    made.close()


# --- exclusion ------------------------------------------------------------------------------


def test_a_typescript_mutex_and_dmutexs_exclude_each_other(
    side: Python, ts_conn: Counted, raw: Counted, service: str
) -> None:
    ts = TypeScript.mutex(ts_conn, service)
    ts.ready()
    mutex = side.mutex(service)  # the same table: "_dmutex_<service>"
    theirs = ts.acquire(KEY, 30)
    assert theirs is not None
    assert side.run(mutex.acquire(KEY, 30)) is None
    assert ts.release(KEY, theirs.token)
    ours = side.run(mutex.acquire(KEY, 30))
    assert ours is not None
    assert ts.acquire(KEY, 30) is None
    assert rows(raw, f"_dmutex_{service}")[f"permit:0:{KEY}"][0] == ours.token
    assert side.run(ours.release()) is True
    assert ts.acquire(KEY, 30) is not None


def test_a_typescript_semaphore_and_dmutexs_share_the_permits(
    side: Python, ts_conn: Counted, raw: Counted, service: str
) -> None:
    ts = TypeScript(ts_conn, service, max_permits=3)
    ts.ready()
    sem = side.semaphore(service, 3)  # the same table: "_dsemaphore_<service>"
    first, second = ts.acquire(KEY, 30), ts.acquire(KEY, 30)
    assert first is not None
    assert second is not None
    assert (first.slot, second.slot) == (0, 1), "the TypeScript loop takes the lowest free slot"
    ours = side.run(sem.acquire(KEY, 30))
    assert ours is not None
    assert ours.slot == 2, "the one slot left"
    assert side.run(sem.acquire(KEY, 30)) is None
    assert ts.acquire(KEY, 30) is None
    assert ts.release(KEY, first.token)
    again = side.run(sem.acquire(KEY, 30))
    assert again is not None
    assert again.slot == 0
    held = {
        k: v for k, (v, _) in rows(raw, f"_dsemaphore_{service}").items() if k.startswith("permit:")
    }
    assert held == {
        f"permit:0:{KEY}": again.token,
        f"permit:1:{KEY}": second.token,
        f"permit:2:{KEY}": ours.token,
    }


def test_a_race_of_both_semaphores_never_exceeds_max_permits(
    url: str, postgres_schema: str, service: str
) -> None:
    # Two TypeScript slot loops and two dmutex semaphores (psycopg in a
    # thread, asyncpg on a loop in another) cycle on one key of two permits.
    # Each records its slot between its grant and its release: a slot held
    # twice at once, or more than two held, is an over-grant.
    permits, rounds = 2, 30
    inside: dict[int, str] = {}
    faults: list[str] = []
    cycles: dict[str, int] = {}
    guard = threading.Lock()
    start = threading.Barrier(4, timeout=30)

    def hold(slot: int, who: str) -> None:
        with guard:
            if slot in inside or len(inside) >= permits:
                faults.append(f"{who} got slot {slot} while {inside} held")
            inside[slot] = who
        time.sleep(0.001)  # a holder stays a moment, so that an overlap would show
        with guard:
            del inside[slot]

    def typescript(who: str) -> None:
        with typescript_connection(url, postgres_schema) as conn:
            ts = TypeScript(conn, service, max_permits=permits)
            start.wait()
            for _ in range(rounds):
                permit = ts.acquire_with_retry(KEY, 30, timeout=20, retry_delay=0.002)
                assert permit is not None, f"{who}: no permit in 20 s"
                hold(permit.slot, who)
                assert ts.release(KEY, permit.token)
                cycles[who] = cycles.get(who, 0) + 1

    def psycopg_side(who: str) -> None:
        with connect(url, postgres_schema) as conn:
            sem = DSemaphore(service, conn, max_permits=permits)
            start.wait()
            for _ in range(rounds):
                permit = sem.acquire_with_retry(KEY, ttl=30, timeout=20, retry_delay=0.005)
                assert permit is not None, f"{who}: no permit in 20 s"
                hold(permit.slot, who)
                assert permit.release()
                cycles[who] = cycles.get(who, 0) + 1

    async def asyncpg_main(who: str) -> None:
        conn = await asyncpg.connect(url, server_settings={"search_path": postgres_schema})
        try:
            sem = AsyncDSemaphore(service, conn, max_permits=permits)
            await asyncio.to_thread(start.wait)
            for _ in range(rounds):
                permit = await sem.acquire_with_retry(KEY, ttl=30, timeout=20, retry_delay=0.005)
                assert permit is not None, f"{who}: no permit in 20 s"
                hold(permit.slot, who)
                assert await permit.release()
                cycles[who] = cycles.get(who, 0) + 1
        finally:
            await conn.close()

    with connect(url, postgres_schema) as setup:
        DSemaphore(service, setup, max_permits=permits).ready()
    errors: list[BaseException] = []

    def guarded(work: Any, who: str) -> None:
        try:
            work(who)
        except BaseException as error:  # noqa: BLE001 - reported by the test below
            errors.append(error)

    workers = [
        threading.Thread(target=guarded, args=(typescript, "ts-1")),
        threading.Thread(target=guarded, args=(typescript, "ts-2")),
        threading.Thread(target=guarded, args=(psycopg_side, "psycopg")),
        threading.Thread(
            target=guarded, args=(lambda who: asyncio.run(asyncpg_main(who)), "asyncpg")
        ),
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=90)
    assert not any(worker.is_alive() for worker in workers), "bounded: every worker ended"
    assert errors == []
    assert faults == []
    assert cycles == {"ts-1": rounds, "ts-2": rounds, "psycopg": rounds, "asyncpg": rounds}


def test_a_dmutex_grant_that_a_typescript_commit_overtook_tries_again(
    url: str, postgres_schema: str, raw: Counted, ts_conn: Counted, service: str
) -> None:
    table = f"_dsemaphore_{service}"
    with connect(url, postgres_schema) as conn:
        sem = DSemaphore(service, conn, max_permits=2)
        sem.ready()
        ts = TypeScript(ts_conn, service, max_permits=2)
        assert ts.acquire(KEY, 30) is not None  # slot 0
        answers: list[object] = []
        with typescript_connection(url, postgres_schema) as late:
            pending = TypeScript(late, service, max_permits=2)
            # The TypeScript acquire of slot 1, its commit held back: dmutex's
            # statement reads slot 1 as free, then waits on its row.
            with late.transaction():
                token = str(uuid.uuid4())
                assert pending.store_acquire(f"permit:1:{KEY}", token, 30) is not None
                before = conn.sent
                worker = threading.Thread(target=lambda: answers.append(sem.acquire(KEY, 30)))
                worker.start()
                blocked = (
                    "SELECT count(*) FROM pg_stat_activity "
                    f"WHERE {late.info.backend_pid} = ANY(pg_blocking_pids(pid))"
                )
                until(
                    lambda: raw.execute(blocked).fetchone() == (1,), "dmutex waits on the row", 20
                )
            worker.join(timeout=20)
        assert answers == [None], "full once the TypeScript acquire committed: nothing overwritten"
        assert conn.sent - before == 2, "the statement lost its slot, so it was sent again"
    assert rows(raw, table)[f"permit:1:{KEY}"][0] == token


# --- each other's grants -------------------------------------------------------------------


def test_the_typescript_release_and_extend_work_on_dmutex_grants(
    side: Python, ts_conn: Counted, raw: Counted, service: str
) -> None:
    table = f"_dsemaphore_{service}"
    sem = side.semaphore(service, 2)
    ours = side.run(sem.acquire(KEY, 30))
    assert ours is not None
    ts = TypeScript(ts_conn, service, max_permits=2)
    assert ts.extend(KEY, ours.token, 90)
    stored = rows(raw, table)[f"permit:{ours.slot}:{KEY}"][1]
    assert ms(stored) > ms(ours.expired_at) + 50_000, "moved by the TypeScript extend"
    assert side.run(sem.extend(KEY, ours.token, 60)) is True, "still dmutex's to extend"
    assert ts.release(KEY, ours.token)
    assert f"permit:{ours.slot}:{KEY}" not in rows(raw, table)
    assert side.run(ours.extend()) is False, "the handle finds its lease gone"
    assert side.run(ours.release()) is False
    assert ts.release(KEY, ours.token) is False


def test_dmutexs_release_and_extend_by_token_work_on_typescript_grants(
    side: Python, ts_conn: Counted, raw: Counted, service: str
) -> None:
    ts = TypeScript(ts_conn, service, max_permits=2)
    ts.ready()
    theirs = ts.acquire(KEY, 30)
    assert theirs is not None
    sem = side.semaphore(service, 2)
    assert side.run(sem.extend(KEY, theirs.token, 90)) is True
    stored = rows(raw, f"_dsemaphore_{service}")[f"permit:0:{KEY}"][1]
    assert ms(stored) > ms(theirs.expired_at) + 50_000
    assert ts.extend(KEY, theirs.token, 30), "still the TypeScript holder's to extend"
    assert side.run(sem.release(KEY, theirs.token)) is True
    assert ts.release(KEY, theirs.token) is False, "gone"
    # A mutex: release by token is the deprecated unlock(key, token).
    tm = TypeScript.mutex(ts_conn, service)
    tm.ready()
    held = tm.acquire(KEY, 30)
    assert held is not None
    mutex = side.mutex(service)
    assert side.run(mutex.extend(KEY, held.token, 90)) is True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert side.run(mutex.unlock(KEY, held.token)) is True
    assert tm.acquire(KEY, 30) is not None


def test_an_auto_renewed_dmutex_lock_that_typescript_released_is_reported_lost(
    side: Python, ts_conn: Counted, service: str
) -> None:
    mutex = side.mutex(service)
    lock = side.run(mutex.acquire(KEY, 0.6, auto_renew=True))
    assert lock is not None
    assert TypeScript.mutex(ts_conn, service).release(KEY, lock.token)
    # The next renewal (a third of the TTL on) finds the row gone.
    assert side.run(lock.wait_lost(10)) is True
    assert lock.lost


def test_status_shows_typescript_grants_and_they_do_not_move_the_fence(
    raw: Counted, ts_conn: Counted, service: str
) -> None:
    ts = TypeScript(ts_conn, service, max_permits=3)
    ts.ready()
    theirs = [ts.acquire(KEY, 30 + n) for n in range(2)]
    found = read_holders(raw, service=service, limit=3, key=KEY)
    assert [(h.slot, h.token, h.expires_ms) for h in found.holders] == [
        (p.slot, p.token, ms(p.expired_at)) for p in theirs if p is not None
    ]
    assert found.fence is None, "the TypeScript store keeps no fence"
    sem = DSemaphore(service, raw, max_permits=3)
    ours = sem.acquire(KEY, 30)
    assert ours is not None
    assert ours.fence is not None
    assert ours.release()
    for permit in theirs:
        assert permit is not None
        assert ts.release(KEY, permit.token)
    assert ts.acquire(KEY, 30) is not None, "a TypeScript grant after dmutex's"
    found = read_holders(raw, service=service, limit=3, key=KEY)
    assert found.fence == ours.fence, "moved by dmutex's grants only"
    again = sem.acquire(KEY, 30)
    assert again is not None
    assert again.fence is not None
    assert again.fence > ours.fence


def test_a_dmutex_waiter_behind_a_typescript_lease_gets_in_when_it_expires(
    side: Python, ts_conn: Counted, raw: Counted, service: str
) -> None:
    ts = TypeScript.mutex(ts_conn, service)
    ts.ready()
    assert ts.acquire(KEY, 0.3) is not None
    mutex = side.mutex(service)
    # retry_delay=30: a wait lasts at least 15 s unless the lease in the way
    # ends it; the timeout is 10 s, so a lock here came from its expiry.
    lock = side.run(mutex.acquire_with_retry(KEY, ttl=30, timeout=10, retry_delay=30))
    assert lock is not None
    assert rows(raw, f"_dmutex_{service}")[f"permit:0:{KEY}"][0] == lock.token


# --- dmutex's extra rows and the tables ----------------------------------------------------


def extra_rows(
    url: str, schema: str, service: str, permits: int
) -> dict[str, tuple[str, datetime]]:
    """Let dmutex write its extra rows for KEY (a fence, a waiters mark), and return them."""
    with psycopg_pool.ConnectionPool(
        url,
        min_size=1,
        max_size=2,
        kwargs={"autocommit": True, "options": f"-csearch_path={schema}"},
    ) as pool:
        sem = DSemaphore(service, pool, max_permits=permits)
        held = [sem.acquire(KEY, 30) for _ in range(permits)]
        # A waiter's failed attempt marks the key's waiters (the pool can listen).
        assert sem.acquire_with_retry(KEY, ttl=30, timeout=0.05, retry_delay=5) is None
        for permit in held:
            assert permit is not None
            assert permit.release()
    with connect(url, schema) as conn:
        found = rows(conn, f"_dsemaphore_{service}")
    extra = {key: row for key, row in found.items() if not key.startswith("permit:")}
    assert extra.keys() == {f"fence:{KEY}", f"waiters:{KEY}"}
    assert extra[f"fence:{KEY}"][1] == datetime.fromisoformat(FOREVER)
    assert extra[f"waiters:{KEY}"][0] == WAITERS
    return extra


def test_dmutexs_extra_rows_are_no_permit_to_the_typescript_store(
    url: str, postgres_schema: str, raw: Counted, ts_conn: Counted, service: str
) -> None:
    table = f"_dsemaphore_{service}"
    extra = extra_rows(url, postgres_schema, service, 2)
    ts = TypeScript(ts_conn, service, max_permits=2)
    ts.ready()
    permits = [ts.acquire(KEY, 30) for _ in range(3)]
    assert [p is not None for p in permits] == [True, True, False], "both permits, then full"
    for permit in permits[:2]:
        assert permit is not None
        assert ts.extend(KEY, permit.token, 60)
        assert ts.release(KEY, permit.token)
    found = rows(raw, table)
    assert {key: found[key] for key in extra} == extra, "never changed by the TypeScript store"
    assert not [key for key in found if key.startswith("permit:")]


def test_each_librarys_ready_accepts_the_others_table(
    url: str, postgres_schema: str, raw: Counted, ts_conn: Counted, service: str
) -> None:
    # dmutex's table, with its extra rows: the TypeScript initialize() finds it.
    extra = extra_rows(url, postgres_schema, service, 2)
    table = f"_dsemaphore_{service}"
    indexes = "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s ORDER BY 1"
    before = raw.execute(indexes, (table,)).fetchall()
    TypeScript(ts_conn, service, max_permits=2).ready()
    assert raw.execute(indexes, (table,)).fetchall() == before
    assert rows(raw, table) == extra
    # The TypeScript table, in a schema of its own: dmutex's ready() reads it, creates nothing.
    schema = f"s{uuid.uuid4().hex[:8]}"
    raw.execute(f'CREATE SCHEMA "{schema}"')
    try:
        TypeScript.mutex(ts_conn, service, schema_name=schema).ready()
        with connect(url, postgres_schema) as conn:
            mutex = DMutex(service, conn, schema_name=schema)
            mutex.ready()
            assert conn.sent == 1, "one read of the shape"
            assert mutex.acquire(KEY, 30) is not None
    finally:
        raw.execute(f'DROP SCHEMA "{schema}" CASCADE')


# --- the known differences -----------------------------------------------------------------


def test_the_typescript_release_ignores_expiry_and_dmutexs_does_not(
    side: Python, ts_conn: Counted, raw: Counted, service: str
) -> None:
    table, row = f"_dmutex_{service}", f"permit:0:{KEY}"
    ts = TypeScript.mutex(ts_conn, service)
    ts.ready()
    theirs = ts.acquire(KEY, 30)
    assert theirs is not None
    age(raw, table, row)
    mutex = side.mutex(service)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert side.run(mutex.unlock(KEY, theirs.token)) is False, "dmutex: expired, left alone"
    assert row in rows(raw, table)
    assert ts.release(KEY, theirs.token), "the TypeScript release deletes the expired row"
    ours = side.run(mutex.acquire(KEY, 30))
    assert ours is not None
    age(raw, table, row)
    assert side.run(ours.release()) is False
    assert ts.release(KEY, ours.token), "whoever's row it is"


def test_the_typescript_acquire_has_no_lost_reply_rule(
    ts_conn: Counted, raw: Counted, service: str
) -> None:
    # A TypeScript acquire that committed but whose reply was lost: sent again
    # with its token (a retrying driver), or tried anew (acquire() draws a new
    # token each call), it is refused by the row it wrote itself, which holds
    # the key, unreleasable, until it expires. dmutex's acquire takes its own
    # row back (test_postgres_store.py: test_a_resent_acquire_recognises_its_own_token).
    ts = TypeScript.mutex(ts_conn, service)
    ts.ready()
    token, row = str(uuid.uuid4()), f"permit:0:{KEY}"
    assert ts.store_acquire(row, token, 30) is not None  # the reply that was lost
    assert ts.store_acquire(row, token, 30) is None
    assert ts.acquire(KEY, 30) is None
    assert rows(raw, f"_dmutex_{service}")[row][0] == token


def test_the_typescript_stores_now_is_read_a_moment_before_statement_timestamp(
    ts_conn: Counted,
) -> None:
    # node-postgres sends a statement with values as Parse, Bind and Execute
    # at once: NOW() is the implicit transaction's start, at the Parse;
    # dmutex's statement_timestamp() is the Execute's moment. One clock, read
    # microseconds apart (never the other way round); without values (one
    # simple Query message) the two are equal.
    gaps = [
        ts_conn.execute("SELECT statement_timestamp() - NOW(), $1::int", [n]).fetchone()
        for n in range(10)
    ]
    assert all(gap is not None and timedelta(0) <= gap[0] < timedelta(seconds=5) for gap in gaps)
    with psycopg.ClientCursor(ts_conn) as simple:
        assert simple.execute("SELECT statement_timestamp() - NOW()").fetchone() == (timedelta(0),)


def test_a_full_typescript_semaphore_costs_a_statement_per_slot(
    url: str, postgres_schema: str, ts_conn: Counted, service: str
) -> None:
    permits = 5
    ts = TypeScript(ts_conn, service, max_permits=permits)
    ts.ready()
    held = [ts.acquire(KEY, 30) for _ in range(permits)]
    assert held[-1] is not None
    assert held[-1].slot == permits - 1
    before = ts_conn.sent
    assert ts.acquire(KEY, 30) is None
    assert ts_conn.sent - before == permits, "one upsert per slot"
    before = ts_conn.sent
    assert ts.extend(KEY, held[-1].token, 30)
    assert ts.release(KEY, held[-1].token)
    assert ts_conn.sent - before == 2 * permits, "by token: one statement per slot, to the last"
    assert ts.acquire(KEY, 30) is not None
    with connect(url, postgres_schema) as conn:
        sem = DSemaphore(service, conn, max_permits=permits)
        sem.ready()
        before = conn.sent
        assert sem.acquire(KEY, 30) is None
        assert conn.sent - before == 1, "dmutex: one statement over every slot"
        token = rows(conn, f"_dsemaphore_{service}")[f"permit:{permits - 1}:{KEY}"][0]
        before = conn.sent
        assert sem.extend(KEY, token, 30)
        assert sem.release(KEY, token)
        assert conn.sent - before == 2, "by token: one statement each"


def test_the_typescript_ready_needs_create_and_dmutexs_does_not(
    url: str, postgres_schema: str, raw: Counted, ts_conn: Counted, service: str
) -> None:
    may = raw.execute("SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user")
    if may.fetchone() != (True,):
        pytest.skip("the server's role may not create the role this test needs")
    role = f"dmutex_user_{uuid.uuid4().hex[:8]}"
    table = f"_dmutex_{service}"
    DMutex(service, raw).ready()  # made by the owner, with its index
    raw.execute(f'CREATE ROLE "{role}" NOLOGIN')
    try:
        # A role that may use the table but not create anything.
        raw.execute(f'GRANT USAGE ON SCHEMA "{postgres_schema}" TO "{role}"')
        raw.execute(f'GRANT SELECT, INSERT, UPDATE, DELETE ON "{table}" TO "{role}"')
        ts_conn.execute(f'SET ROLE "{role}"')
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="schema"):
            TypeScript.mutex(ts_conn, service).ready()
        # With CREATE on the schema, its CREATE INDEX still needs the table's owner.
        raw.execute(f'GRANT CREATE ON SCHEMA "{postgres_schema}" TO "{role}"')
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="owner"):
            TypeScript.mutex(ts_conn, service).ready()
        raw.execute(f'REVOKE CREATE ON SCHEMA "{postgres_schema}" FROM "{role}"')
        with connect(url, postgres_schema) as conn:
            conn.execute(f'SET ROLE "{role}"')
            mutex = DMutex(service, conn)
            mutex.ready()
            lock = mutex.acquire(KEY, 30)
            assert lock is not None
            assert lock.release()
    finally:
        ts_conn.execute("RESET ROLE")
        raw.execute(f'REVOKE ALL ON "{table}" FROM "{role}"')
        raw.execute(f'REVOKE ALL ON SCHEMA "{postgres_schema}" FROM "{role}"')
        raw.execute(f'DROP ROLE "{role}"')


def test_a_typescript_release_notifies_no_dmutex_waiter(
    url: str, postgres_schema: str, raw: Counted, ts_conn: Counted, service: str
) -> None:
    extra_rows(url, postgres_schema, service, 1)  # the key's waiters marked, for 7 s
    heard = channel(f'"_dsemaphore_{service}"')
    ts = TypeScript(ts_conn, service, max_permits=1)
    with connect(url, postgres_schema) as listening:
        listening.execute(sql.SQL("LISTEN {}").format(sql.Identifier(heard)))

        def released_then_heard(release: Any, token: str) -> list[str]:
            assert release(KEY, token)
            # A notification of ours after it: what the release sent arrives first.
            raw.execute("SELECT pg_notify(%s, 'end')", (heard,))
            got: list[str] = []
            for note in listening.notifies(timeout=10):
                if note.payload == "end":
                    break
                got.append(note.payload)
            return got

        first = ts.acquire(KEY, 30)
        assert first is not None
        assert released_then_heard(ts.release, first.token) == [], "the TypeScript release: silence"
        second = ts.acquire(KEY, 30)
        assert second is not None
        sem = DSemaphore(service, raw, max_permits=1)
        assert released_then_heard(sem.release, second.token) == [KEY], "dmutex's: the key"


def test_an_index_name_postgresql_would_cut_is_the_typescript_stores_and_refused_by_dmutex(
    raw: Counted, ts_conn: Counted
) -> None:
    table = "_dmutex_" + "a" * 42  # 50 bytes: its index name would be 65
    ts = TypeScript.mutex(ts_conn, "", table_name=table)
    try:
        ts.ready()
        index = raw.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename = %s AND indexname <> %s",
            (table, f"{table}_pkey"),
        )
        assert index.fetchall() == [(f"{table}_expired_at_idx"[:63],)], "cut by PostgreSQL"
        with pytest.raises(InvalidArgumentError, match="at most 48 bytes"):
            DMutex("svc", raw, table_name=table)
    finally:
        raw.execute(f'DROP TABLE IF EXISTS "{table}"')

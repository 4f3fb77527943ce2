"""The TypeScript dmutex's SQL stores and dmutex on one table, on real PostgreSQL and MySQL servers.

The TypeScript library (github.com/song-younghoon/dmutex, 0.4.0, commit
fa55975) is not on npm and cannot run here, so each store's statements are
replayed verbatim, as its driver sends them: PostgreSQL's
(``src/postgres-store.ts``, as node-postgres runs them) in
``tests._support.typescript_postgres``, MySQL's (``src/mysql-store.ts``,
as mysql2 runs them) in ``tests._support.typescript_mysql``; both driven
by the slot loops of its ``src/semaphore.ts`` (``tests._support.typescript``).
dmutex is driven through its public classes: on psycopg (sync and asyncio)
and asyncpg; on PyMySQL, aiomysql and asyncmy. A test that holds for both
stores runs once per dialect (``[postgresql]``, ``[mysql]``), or once per
dialect and dmutex client (``[postgresql-psycopg]``, ``[mysql-asyncmy]``);
a fact of one store's runs for that store only.

What must hold, on both:

- a TypeScript holder excludes dmutex and dmutex excludes it, for a mutex
  and for a semaphore; both semaphores racing from threads never hold more
  than ``max_permits`` together, and a dmutex grant that a TypeScript commit
  overtakes tries again rather than overwrite it;
- either library releases and extends the other's grant by its token;
  ``dmutex status`` (``read_holders``) shows TypeScript grants as holders,
  and a dmutex waiter behind one is let in when it expires;
- dmutex's extra rows (``fence:{key}``; on PostgreSQL ``waiters:{key}``
  too) are never a permit to the TypeScript store nor in its way, and it
  never changes them.

The tables: on PostgreSQL each library's table creation accepts the
other's table. On MySQL, whoever makes it first: made by dmutex
(``utf8mb4_nopad_bin`` key and value), the TypeScript ``CREATE TABLE IF
NOT EXISTS`` changes nothing and both use it; made by the TypeScript store
(the database's default collation, case-insensitive here), dmutex refuses
it, naming the ``ALTER TABLE`` that fixes it, and after that both use it.
So the tests both stores share start on the TypeScript store's table on
PostgreSQL, on dmutex's on MySQL.

The known differences, as facts: the TypeScript release ignores expiry.
PostgreSQL: its acquire has no lost-reply rule; its semaphore acquire costs
one statement per slot it tries; its ``ready()`` always needs ``CREATE``;
it notifies no dmutex waiter; it lets PostgreSQL cut an index name dmutex
refuses. MySQL: the TypeScript store decides expiry by its host's clock (a
host whose clock is off takes or loses leases by that much); its extend
checks expiry; its acquire is two statements per slot (an upsert, then a
read-back), and a re-sent copy answers success with the first copy's
expiry; its constructor always sends ``CREATE TABLE``, so it needs
``CREATE``; its release wakes no dmutex waiter.

A few checks of the shared tests run on MySQL only (``if dialect.name ==
"mysql"``): the tests were written for each store apart, and each keeps
the checks it had.

A lease runs out by rewriting ``expired_at``, except where waiting for an
expiry or a renewal is the point (TTLs of 0.3 and 0.6 s).
"""

from __future__ import annotations

import inspect
import re
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any, TypeVar

import psycopg
import psycopg_pool
import pymysql
import pytest
from psycopg import sql
from pymysql.constants import CLIENT

from dmutex import DMutex, DMutexError, DMutexLock, DSemaphore, InvalidArgumentError
from dmutex._backends.mysql.statements import FOREVER as MYSQL_FOREVER
from dmutex._backends.postgresql.statements import FOREVER as POSTGRES_FOREVER
from dmutex._backends.postgresql.statements import WAITERS, channel
from dmutex._cli.holders import read_holders
from tests._support import postgres_rows
from tests._support import typescript_mysql as mysql_ts
from tests._support import typescript_postgres as postgres_ts
from tests._support.mysql_rows import server_ms
from tests._support.mysql_servers import Server, Session
from tests._support.typescript import Dialect, PythonSide, Race
from tests._support.typescript_mysql import COLLATION, MySQL
from tests._support.typescript_postgres import Postgres

F = TypeVar("F", bound=Callable[..., object])
KEY = "job"
DIALECTS: dict[str, type[Dialect[Any, Any]]] = {"postgresql": Postgres, "mysql": MySQL}


def cases(*names: str) -> list[tuple[str, str]]:
    """(dialect, side) of each of the named dialects' dmutex clients."""
    return [(name, side) for name in names for side in DIALECTS[name].sides]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Each test once per dialect, or per dialect and side if it takes one; :func:`only` narrows."""
    if metafunc.definition.get_closest_marker("parametrize") is not None:
        return  # only() named its dialect
    if "side" in metafunc.fixturenames:
        metafunc.parametrize(("dialect", "side"), cases(*DIALECTS), indirect=True)
    elif "dialect" in metafunc.fixturenames:
        metafunc.parametrize("dialect", list(DIALECTS), indirect=True)


def only(name: str) -> Callable[[F], F]:
    """Mark a test as a fact of one dialect's store: it runs on that dialect alone."""

    def mark(test: F) -> F:
        marked: F
        if "side" in inspect.signature(test).parameters:
            marked = pytest.mark.parametrize(("dialect", "side"), cases(name), indirect=True)(test)
        else:
            marked = pytest.mark.parametrize("dialect", [name], indirect=True)(test)
        return marked

    return mark


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture
def dialect(request: pytest.FixtureRequest) -> Dialect[Any, Any]:
    """The store under test, on its session's server: PostgreSQL in the run's schema, MySQL
    in the tests' database."""
    if request.param == "postgresql":
        return Postgres(
            request.getfixturevalue("postgres_server"), request.getfixturevalue("postgres_schema")
        )
    session: Session = request.getfixturevalue("mysql_session")
    return MySQL(session.server())


@pytest.fixture
def url(postgres_server: str) -> str:
    """PostgreSQL's URL; each connection sets its search path to the run's schema."""
    return postgres_server


@pytest.fixture
def server(mysql_session: Session) -> Server:
    return mysql_session.server()


@pytest.fixture
def raw(dialect: Dialect[Any, Any]) -> Iterator[Any]:
    """A plain autocommit connection, to look at and change tables behind both libraries."""
    with dialect.connect() as conn:
        yield conn


@pytest.fixture
def ts_conn(dialect: Dialect[Any, Any]) -> Iterator[Any]:
    with dialect.typescript_connection() as conn:
        yield conn


@pytest.fixture
def service(dialect: Dialect[Any, Any], raw: Any) -> Iterator[str]:
    """A fresh service name; its mutex and semaphore tables are dropped after the test."""
    name = f"svc{uuid.uuid4().hex[:10]}"
    yield name
    for prefix in ("_dmutex_", "_dsemaphore_"):
        dialect.drop(raw, prefix + name)


@pytest.fixture
def side(request: pytest.FixtureRequest, dialect: Dialect[Any, Any]) -> Iterator[PythonSide]:
    made = dialect.python(request.param)
    yield made
    made.close()


def slot_rows(dialect: Dialect[Any, Any], raw: Any, table: str) -> dict[str, tuple[str, Any]]:
    """The slot rows (``permit:...``): what both libraries hold, without dmutex's counters."""
    return {key: row for key, row in dialect.rows(raw, table).items() if key.startswith("permit:")}


# --- exclusion ------------------------------------------------------------------------------


def test_a_typescript_mutex_and_dmutexs_exclude_each_other(
    dialect: Dialect[Any, Any], side: PythonSide, ts_conn: Any, raw: Any, service: str
) -> None:
    ts = dialect.typescript_mutex(ts_conn, raw, service)
    mutex = side.mutex(service)  # the same table: "_dmutex_<service>"
    theirs = ts.acquire(KEY, 30)
    assert theirs is not None
    assert side.run(mutex.acquire(KEY, 30)) is None
    if dialect.name == "mysql":
        assert ts.acquire(KEY, 30) is None, "nor another TypeScript holder"
    assert ts.release(KEY, theirs.token)
    ours = side.run(mutex.acquire(KEY, 30))
    assert ours is not None
    assert ts.acquire(KEY, 30) is None
    assert dialect.rows(raw, f"_dmutex_{service}")[f"permit:0:{KEY}"][0] == ours.token
    assert side.run(ours.release()) is True
    assert ts.acquire(KEY, 30) is not None


def test_a_typescript_semaphore_and_dmutexs_share_the_permits(
    dialect: Dialect[Any, Any], side: PythonSide, ts_conn: Any, raw: Any, service: str
) -> None:
    ts = dialect.typescript(ts_conn, raw, service, 3)
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
    if dialect.name == "mysql":
        assert ts.acquire(KEY, 30) is None
    held = {k: v for k, (v, _) in slot_rows(dialect, raw, f"_dsemaphore_{service}").items()}
    assert held == {
        f"permit:0:{KEY}": again.token,
        f"permit:1:{KEY}": second.token,
        f"permit:2:{KEY}": ours.token,
    }


def test_a_race_of_both_semaphores_never_exceeds_max_permits(
    dialect: Dialect[Any, Any], raw: Any, service: str
) -> None:
    # Two TypeScript slot loops and dmutex semaphores (on PostgreSQL psycopg
    # and asyncpg, on MySQL PyMySQL, aiomysql and asyncmy; each in a thread,
    # an asyncio one on a loop of its own) cycle on one key of two permits.
    # Each records its slot between its grant and its release: a slot held
    # twice at once, or more than two held, is an over-grant.
    permits, rounds = 2, dialect.race_rounds
    race = Race(permits, 2 + len(dialect.race_sides))

    def typescript(who: str) -> None:
        with dialect.typescript_connection() as conn:
            ts = dialect.semaphore(conn, service, permits)
            race.start.wait()
            for _ in range(rounds):
                permit = ts.acquire_with_retry(KEY, 30, timeout=20, retry_delay=0.002)
                assert permit is not None, f"{who}: no permit in 20 s"
                race.hold(permit.slot, who)
                assert ts.release(KEY, permit.token)
                race.cycled(who)
                if dialect.race_pause:
                    time.sleep(dialect.race_pause)  # other work between two holds

    def dmutex_side(who: str) -> None:
        side = dialect.python(who)
        try:
            sem = side.semaphore(service, permits)
            race.start.wait()
            for _ in range(rounds):
                permit = side.run(
                    sem.acquire_with_retry(KEY, ttl=30, timeout=20, retry_delay=0.005)
                )
                assert permit is not None, f"{who}: no permit in 20 s"
                race.hold(permit.slot, who)
                assert side.run(permit.release())
                race.cycled(who)
        finally:
            side.close()

    DSemaphore(service, raw, max_permits=permits).ready()
    racers = {"ts-1": typescript, "ts-2": typescript}
    racers.update(dict.fromkeys(dialect.race_sides, dmutex_side))
    race.run(racers, timeout=90)
    assert race.errors == []
    assert race.faults == []
    assert race.cycles == dict.fromkeys(racers, rounds)
    if dialect.name == "mysql":
        assert race.mixed > 0, "the libraries held the permits together: they raced"
        assert slot_rows(dialect, raw, f"_dsemaphore_{service}") == {}, (
            "every permit released, nothing else written"
        )


def test_a_dmutex_grant_that_a_typescript_commit_overtook_tries_again(
    dialect: Dialect[Any, Any], raw: Any, ts_conn: Any, service: str
) -> None:
    table = f"_dsemaphore_{service}"
    with dialect.connect() as conn:
        sem = DSemaphore(service, conn, max_permits=2)
        sem.ready()
        ts = dialect.semaphore(ts_conn, service, 2)
        assert ts.acquire(KEY, 30) is not None  # slot 0
        answers: list[object] = []
        with dialect.typescript_connection() as late:
            pending = dialect.semaphore(late, service, 2)
            # The TypeScript acquire of slot 1, its commit held back: dmutex's
            # read finds slot 1 free, and its take then waits on the row.
            with dialect.uncommitted(late):
                token = str(uuid.uuid4())
                assert pending.store_acquire(f"permit:1:{KEY}", token, 30) is not None
                blocked = dialect.blocked(raw, conn, late)
                before = conn.sent
                worker = threading.Thread(target=lambda: answers.append(sem.acquire(KEY, 30)))
                worker.start()
                blocked()
            worker.join(timeout=20)
        assert answers == [None], "full once the TypeScript acquire committed: nothing overwritten"
        sent, why = dialect.overtaken
        assert conn.sent - before == sent, why
    assert dialect.rows(raw, table)[f"permit:1:{KEY}"][0] == token


# --- each other's grants -------------------------------------------------------------------


def test_the_typescript_release_and_extend_work_on_dmutex_grants(
    dialect: Dialect[Any, Any], side: PythonSide, ts_conn: Any, raw: Any, service: str
) -> None:
    table = f"_dsemaphore_{service}"
    sem = side.semaphore(service, 2)
    ours = side.run(sem.acquire(KEY, 30))
    assert ours is not None
    ts = dialect.semaphore(ts_conn, service, 2)
    assert ts.extend(KEY, ours.token, 90)
    stored = dialect.rows(raw, table)[f"permit:{ours.slot}:{KEY}"][1]
    assert dialect.expiry_ms(stored) > dialect.ms(ours.expired_at) + 50_000, (
        "moved by the TypeScript extend"
    )
    assert side.run(sem.extend(KEY, ours.token, 60)) is True, "still dmutex's to extend"
    assert ts.release(KEY, ours.token)
    assert f"permit:{ours.slot}:{KEY}" not in dialect.rows(raw, table)
    assert side.run(ours.extend()) is False, "the handle finds its lease gone"
    assert side.run(ours.release()) is False
    assert ts.release(KEY, ours.token) is False


def test_dmutexs_release_and_extend_by_token_work_on_typescript_grants(
    dialect: Dialect[Any, Any], side: PythonSide, ts_conn: Any, raw: Any, service: str
) -> None:
    ts = dialect.typescript(ts_conn, raw, service, 2)
    theirs = ts.acquire(KEY, 30)
    assert theirs is not None
    sem = side.semaphore(service, 2)
    assert side.run(sem.extend(KEY, theirs.token, 90)) is True
    stored = dialect.rows(raw, f"_dsemaphore_{service}")[f"permit:0:{KEY}"][1]
    assert dialect.expiry_ms(stored) > dialect.expiry_ms(theirs.expired_at) + 50_000
    assert ts.extend(KEY, theirs.token, 30), "still the TypeScript holder's to extend"
    assert side.run(sem.release(KEY, theirs.token)) is True
    assert ts.release(KEY, theirs.token) is False, "gone"
    # A mutex: release by token is the deprecated unlock(key, token).
    tm = dialect.typescript_mutex(ts_conn, raw, service)
    held = tm.acquire(KEY, 30)
    assert held is not None
    mutex = side.mutex(service)
    assert side.run(mutex.extend(KEY, held.token, 90)) is True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert side.run(mutex.unlock(KEY, held.token)) is True
    assert tm.acquire(KEY, 30) is not None


def test_an_auto_renewed_dmutex_lock_that_typescript_released_is_reported_lost(
    dialect: Dialect[Any, Any], side: PythonSide, ts_conn: Any, service: str
) -> None:
    mutex = side.mutex(service)
    lock = side.run(mutex.acquire(KEY, 0.6, auto_renew=True))
    assert lock is not None
    assert dialect.mutex(ts_conn, service).release(KEY, lock.token)
    # The next renewal (a third of the TTL on) finds the row gone.
    assert side.run(lock.wait_lost(10)) is True
    assert lock.lost


def test_status_shows_typescript_grants_and_they_do_not_move_the_fence(
    dialect: Dialect[Any, Any], raw: Any, ts_conn: Any, service: str
) -> None:
    ts = dialect.typescript(ts_conn, raw, service, 3)
    theirs = [ts.acquire(KEY, 30 + n) for n in range(2)]
    found = read_holders(raw, service=service, limit=3, key=KEY)
    assert [(h.slot, h.token, h.expires_ms) for h in found.holders] == [
        (p.slot, p.token, dialect.expiry_ms(p.expired_at)) for p in theirs if p is not None
    ]
    assert found.fence is None, "the TypeScript store keeps no fence"
    sem = DSemaphore(service, raw, max_permits=3, fencing=True)
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
    if dialect.name == "mysql":
        assert len(found.holders) == 1
    again = sem.acquire(KEY, 30)
    assert again is not None
    assert again.fence is not None
    assert again.fence > ours.fence


def test_a_dmutex_waiter_behind_a_typescript_lease_gets_in_when_it_expires(
    dialect: Dialect[Any, Any], side: PythonSide, ts_conn: Any, raw: Any, service: str
) -> None:
    ts = dialect.typescript_mutex(ts_conn, raw, service)
    assert ts.acquire(KEY, 0.3) is not None
    mutex = side.mutex(service)
    # retry_delay=30: a wait lasts at least 15 s unless the lease in the way
    # ends it; the timeout is 10 s, so a lock here came from its expiry.
    started = time.monotonic()
    lock = side.run(mutex.acquire_with_retry(KEY, ttl=30, timeout=10, retry_delay=30))
    assert lock is not None
    if dialect.name == "mysql":
        assert time.monotonic() - started < 5
    assert dialect.rows(raw, f"_dmutex_{service}")[f"permit:0:{KEY}"][0] == lock.token


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
    with postgres_ts.connect(url, schema) as conn:
        found = postgres_rows.rows(conn, f"_dsemaphore_{service}")
    extra = {key: row for key, row in found.items() if not key.startswith("permit:")}
    assert extra.keys() == {f"fence:{KEY}", f"waiters:{KEY}"}
    assert extra[f"fence:{KEY}"][1] == datetime.fromisoformat(POSTGRES_FOREVER)
    assert extra[f"waiters:{KEY}"][0] == WAITERS
    return extra


@only("postgresql")
def test_dmutexs_extra_rows_are_no_permit_to_the_typescript_store(
    dialect: Postgres,
    url: str,
    postgres_schema: str,
    raw: postgres_ts.Counted,
    ts_conn: postgres_ts.Counted,
    service: str,
) -> None:
    table = f"_dsemaphore_{service}"
    extra = extra_rows(url, postgres_schema, service, 2)
    ts = postgres_ts.TypeScript(ts_conn, service, max_permits=2)
    ts.ready()
    permits = [ts.acquire(KEY, 30) for _ in range(3)]
    assert [p is not None for p in permits] == [True, True, False], "both permits, then full"
    for permit in permits[:2]:
        assert permit is not None
        assert ts.extend(KEY, permit.token, 60)
        assert ts.release(KEY, permit.token)
    found = dialect.rows(raw, table)
    assert {key: found[key] for key in extra} == extra, "never changed by the TypeScript store"
    assert not [key for key in found if key.startswith("permit:")]


@only("postgresql")
def test_each_librarys_ready_accepts_the_others_table(
    dialect: Postgres,
    url: str,
    postgres_schema: str,
    raw: postgres_ts.Counted,
    ts_conn: postgres_ts.Counted,
    service: str,
) -> None:
    # dmutex's table, with its extra rows: the TypeScript initialize() finds it.
    extra = extra_rows(url, postgres_schema, service, 2)
    table = f"_dsemaphore_{service}"
    indexes = "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s ORDER BY 1"
    before = raw.execute(indexes, (table,)).fetchall()
    postgres_ts.TypeScript(ts_conn, service, max_permits=2).ready()
    assert raw.execute(indexes, (table,)).fetchall() == before
    assert dialect.rows(raw, table) == extra
    # The TypeScript table, in a schema of its own: dmutex's ready() reads it, creates nothing.
    schema = f"s{uuid.uuid4().hex[:8]}"
    raw.execute(f'CREATE SCHEMA "{schema}"')
    try:
        postgres_ts.TypeScript.mutex(ts_conn, service, schema_name=schema).ready()
        with postgres_ts.connect(url, postgres_schema) as conn:
            mutex = DMutex(service, conn, schema_name=schema)
            mutex.ready()
            assert conn.sent == 1, "one read of the shape"
            assert mutex.acquire(KEY, 30) is not None
    finally:
        raw.execute(f'DROP SCHEMA "{schema}" CASCADE')


@only("mysql")
def test_dmutexs_fence_row_is_no_permit_to_the_typescript_store(
    dialect: MySQL, raw: mysql_ts.Counted, ts_conn: mysql_ts.Counted, service: str
) -> None:
    table = f"_dsemaphore_{service}"
    # With fencing=False dmutex writes no row but its permits here.
    plain = DSemaphore(service, raw, max_permits=2, fencing=False)
    held = plain.acquire(KEY, 30)
    assert held is not None
    assert held.fence is None
    assert held.release()
    assert dialect.rows(raw, table) == {}
    fenced = DSemaphore(service, raw, max_permits=2, fencing=True)
    for ours in [fenced.acquire(KEY, 30) for _ in range(2)]:
        assert ours is not None
        assert ours.release()
    extra = dialect.rows(raw, table)
    assert extra.keys() == {f"fence:{KEY}"}
    assert extra[f"fence:{KEY}"][1] == MYSQL_FOREVER
    ts = mysql_ts.TypeScript(ts_conn, service, max_permits=2)
    permits = [ts.acquire(KEY, 30) for _ in range(3)]
    assert [p is not None for p in permits] == [True, True, False], "both permits, then full"
    for permit in permits[:2]:
        assert permit is not None
        assert ts.extend(KEY, permit.token, 60)
        assert ts.release(KEY, permit.token)
    assert dialect.rows(raw, table) == extra, "never changed by the TypeScript store"
    # A mutex's fence row, in its own table, alike.
    mutex = DMutex(service, raw, fencing=True)
    lock = mutex.acquire(KEY, 30)
    assert lock is not None
    assert lock.fence is not None
    fence = dialect.rows(raw, f"_dmutex_{service}")[f"fence:{KEY}"]
    assert fence == (str(lock.fence), MYSQL_FOREVER)
    tm = mysql_ts.TypeScript.mutex(ts_conn, service)
    assert tm.acquire(KEY, 30) is None, "dmutex's lock holds the key"
    assert lock.release()
    theirs = tm.acquire(KEY, 30)
    assert theirs is not None
    assert tm.release(KEY, theirs.token)
    assert dialect.rows(raw, f"_dmutex_{service}") == {f"fence:{KEY}": fence}


# --- MySQL: the table, whoever makes it first ----------------------------------------------


@only("mysql")
def test_on_dmutexs_table_the_typescript_create_changes_nothing_and_both_use_it(
    dialect: MySQL, side: PythonSide, ts_conn: mysql_ts.Counted, raw: mysql_ts.Counted, service: str
) -> None:
    table = f"_dmutex_{service}"
    mutex = side.mutex(service)
    side.run(mutex.ready())
    made = mysql_ts.create_table(raw, table)
    assert mysql_ts.column_collations(raw, table) == {
        "key": COLLATION,
        "value": COLLATION,
        "expired_at": None,
    }
    ts = mysql_ts.TypeScript.mutex(ts_conn, service)  # its CREATE TABLE IF NOT EXISTS
    assert mysql_ts.create_table(raw, table) == made
    # Keys compare byte for byte, for both: "Job" and "job" are two locks.
    theirs = ts.acquire("Job", 30)
    assert theirs is not None
    ours = side.run(mutex.acquire("job", 30))
    assert ours is not None
    assert ts.acquire("job", 30) is None
    assert side.run(mutex.acquire("Job", 30)) is None
    assert {k: v for k, (v, _) in slot_rows(dialect, raw, table).items()} == {
        "permit:0:Job": theirs.token,
        "permit:0:job": ours.token,
    }


@only("mysql")
def test_on_the_typescript_stores_table_dmutex_refuses_until_altered_as_advised(
    dialect: MySQL, ts_conn: mysql_ts.Counted, raw: mysql_ts.Counted, service: str
) -> None:
    table = f"_dmutex_{service}"
    ts = mysql_ts.TypeScript.mutex(ts_conn, service)  # made first: the database's default collation
    collations = mysql_ts.column_collations(raw, table)
    assert collations["key"] != COLLATION
    assert collations["key"] == mysql_ts.run(raw, "SELECT @@collation_database")[1][0][0]
    case_insensitive = mysql_ts.run(raw, "SELECT 'A' = 'a' COLLATE " + str(collations["key"]))[1]
    if case_insensitive != [(1,)]:
        pytest.skip(f"the database's collation ({collations['key']}) tells case apart")
    # On its own table, the TypeScript store takes "Job" and "job" for one lock.
    theirs = ts.acquire("Job", 30)
    assert theirs is not None
    assert ts.acquire("job", 30) is None
    mutex = DMutex(service, raw)
    with pytest.raises(DMutexError, match=rf"ALTER TABLE `{table}` MODIFY `key` .*{COLLATION}"):
        mutex.acquire("job", 30)
    assert {k: v for k, (v, _) in dialect.rows(raw, table).items()} == {
        "permit:0:Job": theirs.token
    }

    def refusal() -> str | None:
        """Why dmutex's ready() refuses the table; None once it accepts it."""
        try:
            mutex.ready()
        except DMutexError as error:
            return str(error)
        return None

    advised: list[str] = []
    while (refused := refusal()) is not None:
        found = re.search(r"Fix it with: (ALTER TABLE .*)$", refused)
        assert found is not None, f"no ALTER TABLE in {refused}"
        assert len(advised) < 2, f"still refused after {advised}: {refused}"
        advised.append(found.group(1))
        mysql_ts.run(raw, found.group(1))  # the advice, as given
    assert all(f"COLLATE {COLLATION}" in alter for alter in advised)
    assert set(re.findall(r"MODIFY `(\w+)`", " ".join(advised))) == {"key", "value"}
    assert mysql_ts.column_collations(raw, table) == {
        "key": COLLATION,
        "value": COLLATION,
        "expired_at": None,
    }
    # Now the table is dmutex's own, its rows kept, and both use it.
    assert {k: v for k, (v, _) in dialect.rows(raw, table).items()} == {
        "permit:0:Job": theirs.token
    }
    assert mutex.acquire("Job", 30) is None
    ours = mutex.acquire("job", 30)
    assert ours is not None
    assert ts.acquire("job", 30) is None
    assert mysql_ts.TypeScript.mutex(ts_conn, service).acquire("JOB", 30) is not None, (
        "a third lock"
    )
    assert mysql_ts.column_collations(raw, table)["key"] == COLLATION, "its CREATE changed nothing"
    assert ts.release("Job", theirs.token)
    assert ours.release()


@only("mysql")
def test_both_name_a_table_in_a_named_database_alike(
    dialect: MySQL, server: Server, raw: mysql_ts.Counted, service: str
) -> None:
    # databaseName / database_name: `db`.`table`, from connections that
    # have no current database.
    mysql_ts.made_by_dmutex(raw, service)
    with (
        mysql_ts.connect(
            server,
            client_flag=CLIENT.FOUND_ROWS,
            collation="utf8mb4_unicode_ci",
            in_database=False,
        ) as ts_nowhere,
        mysql_ts.connect(server, in_database=False) as nowhere,
    ):
        assert mysql_ts.run(nowhere, "SELECT DATABASE()")[1] == [(None,)]
        ts = mysql_ts.TypeScript.mutex(ts_nowhere, service, database_name=server.database)
        mutex = DMutex(service, nowhere, database_name=server.database)
        theirs = ts.acquire(KEY, 30)
        assert theirs is not None
        assert mutex.acquire(KEY, 30) is None
        assert ts.release(KEY, theirs.token)
        ours = mutex.acquire(KEY, 30)
        assert ours is not None
        assert ts.acquire(KEY, 30) is None
    assert slot_rows(dialect, raw, f"_dmutex_{service}") == {
        f"permit:0:{KEY}": (ours.token, dialect.ms(ours.expired_at))
    }


# --- the known differences -----------------------------------------------------------------


def test_the_typescript_release_ignores_expiry_and_dmutexs_does_not(
    dialect: Dialect[Any, Any], side: PythonSide, ts_conn: Any, raw: Any, service: str
) -> None:
    ts = dialect.typescript_mutex(ts_conn, raw, service)
    table, row = f"_dmutex_{service}", f"permit:0:{KEY}"
    theirs = ts.acquire(KEY, 30)
    assert theirs is not None
    dialect.age(raw, table, row)
    mutex = side.mutex(service)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert side.run(mutex.unlock(KEY, theirs.token)) is False, "dmutex: expired, left alone"
    if dialect.name == "mysql":
        assert ts.extend(KEY, theirs.token, 30) is False, "the TypeScript extend checks expiry"
    assert row in dialect.rows(raw, table)
    assert ts.release(KEY, theirs.token), "the TypeScript release deletes the expired row"
    ours = side.run(mutex.acquire(KEY, 30))
    assert ours is not None
    dialect.age(raw, table, row)
    assert side.run(ours.release()) is False
    assert ts.release(KEY, ours.token), "whoever's row it is"


@only("postgresql")
def test_the_typescript_acquire_has_no_lost_reply_rule(
    dialect: Postgres, ts_conn: postgres_ts.Counted, raw: postgres_ts.Counted, service: str
) -> None:
    # A TypeScript acquire that committed but whose reply was lost: sent again
    # with its token (a retrying driver), or tried anew (acquire() draws a new
    # token each call), it is refused by the row it wrote itself, which holds
    # the key, unreleasable, until it expires. dmutex's acquire takes its own
    # row back (test_postgres_store.py: test_a_resent_acquire_recognises_its_own_token).
    ts = postgres_ts.TypeScript.mutex(ts_conn, service)
    ts.ready()
    token, row = str(uuid.uuid4()), f"permit:0:{KEY}"
    assert ts.store_acquire(row, token, 30) is not None  # the reply that was lost
    assert ts.store_acquire(row, token, 30) is None
    assert ts.acquire(KEY, 30) is None
    assert dialect.rows(raw, f"_dmutex_{service}")[row][0] == token


@only("postgresql")
def test_the_typescript_stores_now_is_read_a_moment_before_statement_timestamp(
    ts_conn: postgres_ts.Counted,
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


@only("postgresql")
def test_a_full_typescript_semaphore_costs_a_statement_per_slot(
    dialect: Postgres, url: str, postgres_schema: str, ts_conn: postgres_ts.Counted, service: str
) -> None:
    permits = 5
    ts = postgres_ts.TypeScript(ts_conn, service, max_permits=permits)
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
    with postgres_ts.connect(url, postgres_schema) as conn:
        sem = DSemaphore(service, conn, max_permits=permits)
        sem.ready()
        before = conn.sent
        assert sem.acquire(KEY, 30) is None
        assert conn.sent - before == 1, "dmutex: one statement over every slot"
        token = dialect.rows(conn, f"_dsemaphore_{service}")[f"permit:{permits - 1}:{KEY}"][0]
        before = conn.sent
        assert sem.extend(KEY, token, 30)
        assert sem.release(KEY, token)
        assert conn.sent - before == 2, "by token: one statement each"


@only("postgresql")
def test_the_typescript_ready_needs_create_and_dmutexs_does_not(
    url: str,
    postgres_schema: str,
    raw: postgres_ts.Counted,
    ts_conn: postgres_ts.Counted,
    service: str,
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
            postgres_ts.TypeScript.mutex(ts_conn, service).ready()
        # With CREATE on the schema, its CREATE INDEX still needs the table's owner.
        raw.execute(f'GRANT CREATE ON SCHEMA "{postgres_schema}" TO "{role}"')
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="owner"):
            postgres_ts.TypeScript.mutex(ts_conn, service).ready()
        raw.execute(f'REVOKE CREATE ON SCHEMA "{postgres_schema}" FROM "{role}"')
        with postgres_ts.connect(url, postgres_schema) as conn:
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


@only("postgresql")
def test_a_typescript_release_notifies_no_dmutex_waiter(
    url: str,
    postgres_schema: str,
    raw: postgres_ts.Counted,
    ts_conn: postgres_ts.Counted,
    service: str,
) -> None:
    extra_rows(url, postgres_schema, service, 1)  # the key's waiters marked, for 7 s
    heard = channel(f'"_dsemaphore_{service}"')
    ts = postgres_ts.TypeScript(ts_conn, service, max_permits=1)
    with postgres_ts.connect(url, postgres_schema) as listening:
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


@only("postgresql")
def test_an_index_name_postgresql_would_cut_is_the_typescript_stores_and_refused_by_dmutex(
    raw: postgres_ts.Counted, ts_conn: postgres_ts.Counted
) -> None:
    table = "_dmutex_" + "a" * 42  # 50 bytes: its index name would be 65
    ts = postgres_ts.TypeScript.mutex(ts_conn, "", table_name=table)
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


@only("mysql")
def test_a_resent_typescript_acquire_answers_success_with_the_first_expiry(
    dialect: MySQL, ts_conn: mysql_ts.Counted, raw: mysql_ts.Counted, service: str
) -> None:
    # A TypeScript acquire sent again with its token (a retrying driver,
    # after a lost reply): its upsert leaves the unexpired row alone, but the
    # read-back finds its own token and answers success, with the expiry
    # the first copy wrote, not moved by the second TTL. acquire() itself
    # draws a new token on each call, which the row refuses.
    mysql_ts.made_by_dmutex(raw, service)
    ts = mysql_ts.TypeScript.mutex(ts_conn, service)
    token, row = str(uuid.uuid4()), f"permit:0:{KEY}"
    first = ts.store_acquire(row, token, 30)
    assert first is not None
    assert ts.store_acquire(row, token, 90) == first
    assert dialect.rows(raw, f"_dmutex_{service}")[row] == (token, first)
    assert ts.acquire(KEY, 30) is None


@only("mysql")
def test_the_typescript_stores_clock_is_its_hosts_and_dmutexs_the_servers(
    dialect: MySQL, ts_conn: mysql_ts.Counted, raw: mysql_ts.Counted, service: str
) -> None:
    mysql_ts.made_by_dmutex(raw, service)
    table, row = f"_dmutex_{service}", f"permit:0:{KEY}"
    mutex = DMutex(service, raw)
    # On one machine the two clocks agree: a grant by either ends where the
    # other expects it, to within the moment between the two readings.
    before = server_ms(raw)
    theirs = mysql_ts.TypeScript.mutex(ts_conn, service).acquire(KEY, 30)
    after = server_ms(raw)
    assert theirs is not None
    assert before + 30_000 - 50 <= theirs.expired_at <= after + 30_000 + 50
    assert mutex.acquire(KEY, 30) is None
    mysql_ts.run(raw, f"DELETE FROM {mysql_ts.quote_identifier(table)}")
    # A TypeScript host whose clock runs a minute ahead takes a dmutex lease
    # of 30 s at once, which the server's clock says has 30 s left.
    ours = mutex.acquire(KEY, 30)
    assert ours is not None
    ahead = mysql_ts.TypeScript.mutex(ts_conn, service, skew_ms=60_000)
    early = ahead.acquire(KEY, 30)
    assert early is not None, "taken 60 s early, by its host's clock"
    assert dialect.rows(raw, table)[row][0] == early.token
    assert ours.extend() is False, "the dmutex holder finds it gone"
    assert mutex.acquire(KEY, 30) is None, "dmutex: held, for 90 s by the server's clock"
    mysql_ts.run(raw, f"DELETE FROM {mysql_ts.quote_identifier(table)}")
    # One whose clock runs a minute behind writes a lease of 30 s that ended
    # 30 s ago by the server's: dmutex takes it at once, status shows none.
    behind = mysql_ts.TypeScript.mutex(ts_conn, service, skew_ms=-60_000)
    late = behind.acquire(KEY, 30)
    assert late is not None
    assert read_holders(raw, service=service, limit=1, key=KEY).holders == []
    taken = mutex.acquire(KEY, 30)
    assert taken is not None
    assert behind.extend(KEY, late.token, 30) is False, "its extend finds dmutex's token"


@only("mysql")
def test_a_typescript_acquire_costs_two_statements_per_slot(
    ts_conn: mysql_ts.Counted, raw: mysql_ts.Counted, service: str
) -> None:
    permits = 5
    mysql_ts.made_by_dmutex(raw, service, permits=permits)
    mysql_ts.made_by_dmutex(raw, service)
    sent = ts_conn.sent
    ts = mysql_ts.TypeScript(ts_conn, service, max_permits=permits)
    assert ts_conn.sent - sent == 1, "its constructor: CREATE TABLE IF NOT EXISTS"
    held = [ts.acquire(KEY, 30) for _ in range(permits)]
    assert held[-1] is not None
    assert held[-1].slot == permits - 1
    sent = ts_conn.sent
    assert ts.acquire(KEY, 30) is None
    assert ts_conn.sent - sent == 2 * permits, "an upsert and a read-back per slot"
    sent = ts_conn.sent
    assert ts.extend(KEY, held[-1].token, 30)
    assert ts.release(KEY, held[-1].token)
    assert ts_conn.sent - sent == 2 * permits, "by token: one statement per slot, to the last"
    sent = ts_conn.sent
    assert mysql_ts.TypeScript.mutex(ts_conn, service).acquire(KEY, 30) is not None
    assert ts_conn.sent - sent == 1 + 2, "a mutex: CREATE, then upsert and read-back"
    sem = DSemaphore(service, raw, max_permits=permits)
    sem.ready()
    sent = raw.sent
    ours = sem.acquire(KEY, 30)
    assert ours is not None
    assert raw.sent - sent == 2, "dmutex: a read of every slot, then the take"
    sent = raw.sent
    assert sem.acquire(KEY, 30) is None
    assert raw.sent - sent == 1, "full: the read alone"
    sent = raw.sent
    assert sem.extend(KEY, ours.token, 30)
    assert sem.release(KEY, ours.token)
    assert raw.sent - sent == 2, "by token: one statement each"
    mutex = DMutex(service, raw)
    mutex.ready()
    sent = raw.sent
    assert mutex.acquire("other", 30) is not None
    assert raw.sent - sent == 1, "a dmutex mutex: one statement"


@only("mysql")
def test_the_typescript_store_needs_create_and_dmutex_does_not(
    server: Server, ts_conn: mysql_ts.Counted, raw: mysql_ts.Counted, service: str
) -> None:
    table = f"_dmutex_{service}"
    mysql_ts.made_by_dmutex(raw, service)
    user = f"dmutex_{uuid.uuid4().hex[:8]}"
    password = uuid.uuid4().hex
    try:
        mysql_ts.run(raw, "CREATE USER %s@'%%' IDENTIFIED BY %s", user, password)
    except pymysql.err.OperationalError as error:
        pytest.skip(f"the server's user may not create users: {error}")
    try:
        # A user that may use the table, and create nothing.
        mysql_ts.run(
            raw,
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON {mysql_ts.quote_identifier(server.database)}."
            f"{mysql_ts.quote_identifier(table)} TO %s@'%%'",
            user,
        )
        with (
            mysql_ts.connect(
                server,
                user=user,
                password=password,
                client_flag=CLIENT.FOUND_ROWS,
                collation="utf8mb4_unicode_ci",
            ) as limited_ts,
            mysql_ts.connect(server, user=user, password=password) as limited,
        ):
            if mysql_ts.run(limited, "SELECT CURRENT_USER()")[1][0][0] != f"{user}@%":
                pytest.skip("another account of the server matches this user's connection")
            with pytest.raises(pymysql.err.OperationalError) as refused:
                mysql_ts.TypeScript.mutex(limited_ts, service)
            assert refused.value.args[0] == 1142, "CREATE command denied"
            mutex = DMutex(service, limited)
            mutex.ready()
            lock = mutex.acquire(KEY, 30)
            assert lock is not None
            assert lock.release()
    finally:
        mysql_ts.run(raw, "DROP USER %s@'%%'", user)


@only("mysql")
def test_a_typescript_release_wakes_no_dmutex_waiter_and_a_dmutex_release_does(
    server: Server, ts_conn: mysql_ts.Counted, raw: mysql_ts.Counted, service: str
) -> None:
    # dmutex wakes, at its release, the waiters of its own client object
    # (store.py, rule 5); a TypeScript release sends nothing, so a waiter
    # behind it tries again at the end of its wait: here its deadline.
    mysql_ts.made_by_dmutex(raw, service)
    ts = mysql_ts.TypeScript.mutex(ts_conn, service)
    mutex = DMutex(service, raw)

    def waited(release: Callable[[], bool]) -> float:
        got: list[DMutexLock | None] = []
        started = time.monotonic()

        def wait() -> None:
            got.append(mutex.acquire_with_retry(KEY, ttl=30, timeout=1.5, retry_delay=30))

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.2)
        assert release()
        waiter.join(10)
        assert len(got) == 1
        lock = got[0]
        assert lock is not None
        assert lock.release()
        return time.monotonic() - started

    theirs = ts.acquire(KEY, 30)
    assert theirs is not None
    assert waited(lambda: ts.release(KEY, theirs.token)) >= 1.4, "let in at its deadline"
    ours = mutex.acquire(KEY, 30)
    assert ours is not None
    assert waited(ours.release) < 1.0, "woken by the release"

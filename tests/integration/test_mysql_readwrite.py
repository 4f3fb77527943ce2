"""Read-write locks on a real MariaDB/MySQL server (``MySQLReadWriteStore``), public classes.

What is checked, through ``DReadWriteLock`` on PyMySQL and
``AsyncDReadWriteLock`` on aiomysql (``tests._support.rwfaces`` gives both
one sync interface), with a plain PyMySQL connection reading and changing
the table behind the store's back:

- fences: every grant's above the one before, a writer's above every
  earlier reader's, the row's ``"f"`` the last one granted; ``fencing=False``
  shows none;
- the layout byte for byte (``rwcas.py``, ``rwstate.py``): the table
  ``_drwlock_{service}`` (the mutex table's shape, its ``value`` column
  ``mediumtext`` in a binary collation), its one row ``rwlock:{k}``, that
  row's JSON text (fields in order, tokens sorted, ``"f"`` last), its
  ``expired_at`` the forever value, the row kept once everything is
  released;
- a row of that key that dmutex did not write: every operation raises
  ``DMutexError`` and leaves it as it was;
- statements, counted by a recording PyMySQL connection: a first grant is a
  read and a write, then a grant, an extend or a release on that key the
  write alone (``rwcas.py``, rule 8), a refused attempt and a release of
  nothing the read alone, ``holders`` the read alone;
- renewals of several keys the store remembers (``rwcas.py``, rule 9): the
  batch's update and read on every client package (PyMySQL, mysqlclient,
  mysql-connector, aiomysql, asyncmy, their pools and SQLAlchemy engines),
  each row holding the expiry answered, from the update's time;
- waiting: a release wakes a writer (or a reader) waiting through the same
  client object long before its ``retry_delay``, even one that lands between
  the waiter's refused attempt and its wait (it registered first).

Leases are 30 s and more: nothing expires while a test runs, unless a test
rewrites a hold's expiry in the row (``tests._support.rwrows``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest
from pymysql.connections import Connection
from pymysql.cursors import Cursor

from dmutex._backends.mysql.readwrite import MySQLReadWriteStore
from dmutex._backends.mysql.statements import COLLATIONS
from dmutex._clock import SystemClock
from dmutex._core.lease import Lease
from dmutex._runtime.drivers import AsyncDriver, SyncDriver
from tests._support.faces import FaceName, LoopThread
from tests._support.mysql_backend import MYSQL_CASES, MYSQL_VARIANTS, MySQL
from tests._support.mysql_rows import Counting, fetch, quoted
from tests._support.mysql_servers import (
    CONNECT_TIMEOUT,
    Server,
    Session,
    aiomysql_connection,
    connect_args,
    without_tls,
)
from tests._support.rwfaces import RWFace, Side
from tests._support.rwrows import granted, hold_expired, is_read
from tests._support.sql_rwchecks import (
    FOREIGN,
    KEY,
    ROW,
    TTL,
    WOKEN,
    check_fences,
    check_fencing_off,
    check_foreign,
    check_row,
    check_statements,
    store_of,
    waited,
    watch,
)

if TYPE_CHECKING:
    _Connection = Connection[Cursor]
else:
    _Connection = Connection

FOREVER = 253370764800000  # 9999-01-01T00:00:00Z in epoch ms
FACES: dict[str, FaceName] = {"pymysql": "sync", "aiomysql": "async"}
NOW_US = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))"


# --- the rig ------------------------------------------------------------------------------


def connect(server: Server, cls: type[_Connection] = _Connection) -> _Connection:
    """A new connection of ``cls`` in the session's database, in autocommit."""
    args = connect_args(server.url)
    args["database"] = server.database
    return cls(
        **args,
        autocommit=True,
        connect_timeout=CONNECT_TIMEOUT,
        ssl_disabled=without_tls(server.url),
    )


@pytest.fixture
def server(mysql_session: Session) -> Server:
    return mysql_session.server()


@pytest.fixture
def raw(server: Server) -> Iterator[_Connection]:
    """Another program's connection: reads and changes the table behind the store's back."""
    conn = connect(server)
    try:
        yield conn
    finally:
        conn.close()


@pytest.fixture
def service(raw: _Connection) -> Iterator[str]:
    """A service name of the test's own, so a table of its own; dropped afterwards."""
    name = f"rw{uuid.uuid4().hex[:12]}"
    yield name
    fetch(raw, f"DROP TABLE IF EXISTS {quoted(f'_drwlock_{name}')}")


@dataclass
class Env:
    """One client of one face, the service's table, and the plain connection to look at it."""

    face: FaceName
    client: object
    service: str
    raw: _Connection
    loop: LoopThread | None = None
    closing: list[Callable[[], object]] = field(default_factory=list)

    @property
    def table(self) -> str:
        return f"_drwlock_{self.service}"

    def make(self, **options: Any) -> RWFace:
        """A read-write lock of this face on the service, prepared (its table made)."""
        rw = RWFace(self.face, self.client, service_name=self.service, loop=self.loop, **options)
        rw.wait(rw.target.ready())
        return rw

    def stored(self) -> tuple[str, int] | None:
        """The row ``rwlock:{KEY}``: its value and its ``expired_at``."""
        found = fetch(
            self.raw,
            f"SELECT `value`, `expired_at` FROM {quoted(self.table)} WHERE `key` = %s",
            (ROW,),
        )
        if not found:
            return None
        ((value, expires),) = found
        return (value.decode() if isinstance(value, bytes) else str(value)), int(expires)

    def value(self) -> str:
        found = self.stored()
        assert found is not None, f"no row {ROW}"
        return found[0]

    def keys(self) -> list[str]:
        found = fetch(self.raw, f"SELECT `key` FROM {quoted(self.table)} ORDER BY `key`")
        return [key.decode() if isinstance(key, bytes) else str(key) for (key,) in found]

    def now_us(self) -> int:
        """The server's clock in µs (the store reads its time from the same clock)."""
        ((now,),) = fetch(self.raw, f"SELECT {NOW_US}")
        return int(now)

    def expire(self, token: str) -> None:
        """Let ``token``'s hold run out now, by the server's clock, in the row's JSON."""
        fetch(
            self.raw,
            f"UPDATE {quoted(self.table)} SET `value` = %s WHERE `key` = %s",
            (hold_expired(self.value(), token, self.now_us() // 1000), ROW),
        )


def _open(face: str, server: Server, env: Env) -> None:
    if face == "pymysql":
        conn = connect(server)
        env.client = conn
        env.closing.append(conn.close)
        return
    loop = env.loop = LoopThread()
    made = loop.run(aiomysql_connection(server.url, server.database))
    env.client = made

    async def close() -> None:
        made.close()

    env.closing.append(lambda: loop.run(close()))
    env.closing.append(loop.close)


@pytest.fixture(params=list(FACES))
def env(
    request: pytest.FixtureRequest, server: Server, raw: _Connection, service: str
) -> Iterator[Env]:
    made = Env(FACES[request.param], None, service, raw)
    try:
        _open(request.param, server, made)
        yield made
    finally:
        for close in made.closing:
            close()


# --- fences -----------------------------------------------------------------------------------


def test_fences_rise_and_a_writers_is_above_every_earlier_grant(env: Env) -> None:
    check_fences(env)


def test_fencing_off_shows_no_fence(env: Env) -> None:
    check_fencing_off(env)


# --- the layout, byte for byte ------------------------------------------------------------


def test_the_table_and_the_row_byte_for_byte(env: Env, server: Server) -> None:
    env.make()  # its table
    collation = COLLATIONS[server.flavour]
    assert collation.endswith("_bin")
    columns = fetch(
        env.raw,
        "SELECT COLUMN_NAME, COLUMN_TYPE, IS_NULLABLE, CHARACTER_SET_NAME, COLLATION_NAME, "
        "COLUMN_KEY FROM information_schema.COLUMNS "
        "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
        (env.table,),
    )
    bigint = "bigint(20)" if server.flavour == "mariadb" else "bigint"
    assert columns == [
        ("key", "varchar(512)", "NO", "utf8mb4", collation, "PRI"),
        ("value", "mediumtext", "NO", "utf8mb4", collation, ""),
        ("expired_at", bigint, "NO", None, None, "MUL"),
    ]
    check_row(env, FOREVER)


# --- a row dmutex did not write -----------------------------------------------------------


@pytest.mark.parametrize("value", FOREIGN)
def test_a_row_dmutex_did_not_write_raises_and_is_left_alone(env: Env, value: str) -> None:
    env.make()  # its table
    # Long expired: an expiry would not save it.
    fetch(env.raw, f"INSERT INTO {quoted(env.table)} VALUES (%s, %s, 0)", (ROW, value))
    stored = env.stored()
    assert stored == (value, 0)
    check_foreign(env)


# --- statements per operation -------------------------------------------------------------


def test_statements_per_operation(server: Server, raw: _Connection, service: str) -> None:
    conn = connect(server, Counting)
    assert isinstance(conn, Counting)
    try:
        lock = RWFace("sync", conn, service_name=service)
        lock.target.ready()
        conn.taken()
        check_statements(lock, conn.taken, "INSERT", "UPDATE")
        table = quoted(f"_drwlock_{service}")
        assert fetch(raw, f"SELECT COUNT(*) FROM {table}") == [(1,)], "no row for a key never held"
    finally:
        conn.close()


# --- waiting ------------------------------------------------------------------------------


def test_a_release_wakes_a_waiter_through_the_same_client(env: Env) -> None:
    holder = env.make()
    sides: list[Side] = ["write", "read"]
    for side in sides:
        rw = env.make()  # another instance, the same client object
        seen = watch(store_of(rw))
        hold = granted(holder.acquire("read" if side == "write" else "write", KEY, TTL))
        got, after = waited(rw, seen, side, hold)
        assert after < WOKEN, f"a {side}r in {after:.2f} s after the release"
        assert is_read(got) is (side == "read")
        state = json.loads(env.value())
        assert state["i"] == {}, "a writer's grant withdrew its intent"
        assert got.release() is True


def test_a_release_between_a_refused_attempt_and_its_wait_is_not_missed(
    server: Server, service: str
) -> None:
    """The waiter is registered before its attempt: a wake before its wait ends that wait."""
    conn = connect(server)
    try:
        holder = RWFace("sync", conn, service_name=service)
        holder.target.ready()
        sides: list[Side] = ["write", "read"]
        for side in sides:
            rw = RWFace("sync", conn, service_name=service)
            hold = granted(holder.acquire("read" if side == "write" else "write", KEY, TTL))
            seen = watch(store_of(rw), early=hold)
            got, after = waited(rw, seen, side, None)
            assert after < WOKEN, f"a {side}r in {after:.2f} s after the release"
            assert got.release() is True
    finally:
        conn.close()


# --- renewals in a batch ------------------------------------------------------------------


@pytest.mark.parametrize("variant", MYSQL_VARIANTS)
def test_a_renewal_batch_runs_on_every_client(mysql_session: Session, variant: str) -> None:
    """``rwcas.py`` rule 9 on each client package: the update, then the read, stamped alike.

    Two writers and two readers of four keys the store remembers; each row
    then holds the expiry the store answered, the update's ``NOW_MS`` plus
    the TTL.
    """
    asynchronous = variant in MYSQL_CASES["async"]
    rig = MySQL(mysql_session, variant)
    loop = rig.loop = LoopThread() if asynchronous else None
    table = f"_drwlock_rw{uuid.uuid4().hex[:12]}"
    try:
        client = rig.client(asynchronous)
        store = MySQLReadWriteStore(client, table, None, SystemClock(), asynchronous=asynchronous)
        sent: list[str] = []
        run_one = store._run

        def recorded(statement: Any, params: Any) -> Any:
            sent.append(statement.text.split(None, 1)[0].upper())
            return run_one(statement, params)

        store._run = recorded

        sync, aio = SyncDriver(store.clock, store.ready), AsyncDriver(store.clock, store.ready)

        def run(steps: Any) -> Any:
            return sync(steps) if loop is None else loop.run(aio(steps))

        keys = ["a", "b", "c", "d"]
        leases = []
        for key in keys:
            lease = run(store.acquire(key, str(uuid.uuid4()), 30_000, None, write=key < "c"))
            assert isinstance(lease, Lease)
            lease.ttl_ms = 60_000
            leases.append(lease)
        sent.clear()
        ((before,),) = fetch(rig._inspector, f"SELECT {NOW_US}")
        answers = run(store.extend_many(leases))
        ((after,),) = fetch(rig._inspector, f"SELECT {NOW_US}")
        assert sent == ["UPDATE", "SELECT"]
        assert len(set(answers)) == 1, "one statement's time for every lease"
        for key, lease, expires in zip(keys, leases, answers, strict=True):
            assert isinstance(expires, int)
            assert int(before) // 1000 + 60_000 <= expires <= int(after) // 1000 + 60_000
            ((value,),) = fetch(
                rig._inspector,
                f"SELECT `value` FROM {quoted(table)} WHERE `key` = %s",
                (f"rwlock:{key}",),
            )
            stored = json.loads(value)
            hold = stored["w"] if key < "c" else [lease.token, stored["r"][lease.token]]
            assert hold == [lease.token, expires]
    finally:
        fetch(rig._inspector, f"DROP TABLE IF EXISTS {quoted(table)}")
        if loop is None:
            rig.close(None)
        else:
            on = loop

            async def done(closing: Awaitable[object]) -> object:
                return await closing

            rig.close(lambda closing: on.run(done(closing)))
            loop.close()

"""The TypeScript dmutex's MySQL store and dmutex on one table, on a real server.

The TypeScript library (github.com/song-younghoon/dmutex, 0.4.0, commit
fa55975) is not on npm and cannot run here, so :class:`TypeScript`
replays what it sends: the statements of its ``src/mysql-store.ts``
(``MySQLDMutexStore``: ``initialize``, run by its constructor, ``acquire``,
``release``, ``extend``), quoted verbatim, with its way of naming and
quoting the table, driven by the slot loops of its ``src/semaphore.ts``
(``DSemaphore``; its ``DMutex`` is a one-permit semaphore under the prefix
``_dmutex_``). They run as mysql2's ``execute`` runs them: one statement
per call, autocommit, ``?`` placeholders, a JS number bound as a DOUBLE
(PyMySQL sends a float as a double literal, ``...e0``), a string as text,
``CLIENT_FOUND_ROWS`` set (mysql2's default flags: an ``UPDATE`` counts the
rows it matched). Its expiries are its host's ``Date.now()`` (here: this
machine's clock, the server's too), in epoch milliseconds.
dmutex is driven through its public classes, on PyMySQL (sync), aiomysql
and asyncmy (asyncio).

What must hold:

- a TypeScript holder excludes dmutex and dmutex excludes it, for a mutex
  and for a semaphore; both semaphores racing from threads never hold more
  than ``max_permits`` together, and a dmutex grant that a TypeScript commit
  overtakes tries again rather than overwrite it;
- either library releases and extends the other's grant by its token;
  ``dmutex status`` (``read_holders``) shows TypeScript grants as holders,
  and a dmutex waiter behind one is let in when it expires;
- dmutex's fence row (``fence:{key}``, unless ``fencing=False``) is never
  a permit to the TypeScript store nor in its way, and it never changes it;
- the table, whoever makes it first: made by dmutex (``utf8mb4_nopad_bin`` key and
  value), the TypeScript ``CREATE TABLE IF NOT EXISTS`` changes nothing and
  both use it; made by the TypeScript store (the database's default
  collation, case-insensitive here), dmutex refuses it, naming the
  ``ALTER TABLE`` that fixes it, and after that both use it;
- the known differences, as facts: the TypeScript store decides expiry by
  its host's clock (a host whose clock is off takes or loses leases by that
  much); its release ignores expiry, its extend does not; its acquire is two
  statements per slot (an upsert, then a read-back), and a re-sent copy
  answers success with the first copy's expiry; its constructor always
  sends ``CREATE TABLE``, so it needs ``CREATE``; its release wakes no
  dmutex waiter.

A lease runs out by rewriting ``expired_at``, except where waiting for an
expiry or a renewal is the point (TTLs of 0.3 and 0.6 s).
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import asyncmy
import pymysql
import pytest
from pymysql.connections import Connection
from pymysql.constants import CLIENT
from pymysql.cursors import Cursor

from dmutex import (
    DMutex,
    DMutexError,
    DMutexLock,
    DSemaphore,
)
from dmutex._backends.mysql.statements import COLLATIONS, FOREVER
from dmutex._cli.holders import read_holders
from tests._support.mysql_rows import age, ms, rows, server_ms
from tests._support.mysql_servers import Server, Session, aiomysql_connection, connect_args
from tests._support.sampling import until
from tests._support.typescript import PythonSide, TypeScriptSemaphore

T = TypeVar("T")
KEY = "job"
SIDES = ["pymysql", "aiomysql", "asyncmy"]
# The collation dmutex gives its text columns on the test server (MariaDB; MySQL 8's is
# COLLATIONS["mysql"]): binary, no padding.
COLLATION = COLLATIONS["mariadb"]


# --- the TypeScript library, replayed -----------------------------------------------------


def quote_identifier(identifier: str) -> str:
    """mysql-store.ts's ``quoteIdentifier``."""
    if not identifier or "\0" in identifier:
        raise ValueError("MySQL identifiers must be non-empty strings without null bytes")
    return "`" + identifier.replace("`", "``") + "`"


def date_now() -> int:
    """``Date.now()``: the host's clock in whole epoch milliseconds."""
    return time.time_ns() // 1_000_000


def get_time(at: float) -> int:
    """``new Date(at).getTime()``: a time value is cut to whole milliseconds, toward zero."""
    return math.trunc(at)


class TypeScript(TypeScriptSemaphore[int]):
    """The TypeScript ``DSemaphore`` (or ``DMutex``) on its ``MySQLDMutexStore``, replayed.

    ``conn`` must be as mysql2 opens one: :func:`typescript_connection`.
    Constructing it sends the ``CREATE TABLE IF NOT EXISTS``, as the store's
    constructor does (``readyPromise``). ``skew_ms`` puts its host's clock
    that far ahead of this machine's (behind, if negative).
    """

    def __init__(
        self,
        conn: Connection[Cursor],
        service_name: str,
        *,
        max_permits: int = 1,
        table_prefix: str = "_dsemaphore_",
        table_name: str | None = None,
        database_name: str | None = None,
        skew_ms: int = 0,
    ) -> None:
        self.conn = conn
        self.max_permits = max_permits
        self.skew_ms = skew_ms
        # MySQLDMutexStore's constructor.
        name = table_name or f"{table_prefix}{service_name}"
        self.table = (
            f"{quote_identifier(database_name)}.{quote_identifier(name)}"
            if database_name
            else quote_identifier(name)
        )
        self.initialize()

    @classmethod
    def mutex(cls, conn: Connection[Cursor], service_name: str, **options: Any) -> TypeScript:
        """mutex.ts's ``DMutex``: one permit, tables prefixed ``_dmutex_``."""
        return cls(conn, service_name, max_permits=1, table_prefix="_dmutex_", **options)

    def now(self) -> int:
        """``Date.now()`` on this host."""
        return date_now() + self.skew_ms

    def execute(self, text: str, values: tuple[object, ...] = ()) -> tuple[int, list[Any]]:
        """``mysqlClient.execute(sql, values)``: (``affectedRows``, the rows).

        ``?`` becomes PyMySQL's ``%s`` (no statement here has a ``?`` elsewhere);
        a number is sent as a double, as mysql2 binds every JS number.
        """
        with self.conn.cursor() as cursor:
            if values:
                sent = tuple(
                    float(v) if isinstance(v, int) and not isinstance(v, bool) else v
                    for v in values
                )
                cursor.execute(text.replace("%", "%%").replace("?", "%s"), sent)
            else:
                cursor.execute(text)
            return cursor.rowcount, list(cursor.fetchall())

    # mysql-store.ts, verbatim: the text of each statement as it builds it.

    def initialize(self) -> None:
        self.execute(f"""
      CREATE TABLE IF NOT EXISTS {self.table} (
        `key` varchar(512) NOT NULL,
        `value` varchar(128) NOT NULL,
        `expired_at` bigint NOT NULL,
        PRIMARY KEY (`key`),
        INDEX `expired_at_idx` (`expired_at`)
      ) ENGINE=InnoDB
    """)

    def store_acquire(self, key: str, token: str, ttl_seconds: float) -> int | None:
        now = self.now()
        expired_at = get_time(now + ttl_seconds * 1000)
        self.execute(
            f"""
      INSERT INTO {self.table} (`key`, `value`, `expired_at`)
      VALUES (?, ?, ?)
      ON DUPLICATE KEY UPDATE
        `value` = IF(`expired_at` <= ?, VALUES(`value`), `value`),
        `expired_at` = IF(`expired_at` <= ?, VALUES(`expired_at`), `expired_at`)
    """,
            (key, token, expired_at, now, now),
        )
        _, rows = self.execute(
            f"""
      SELECT `value`, `expired_at`
      FROM {self.table}
      WHERE `key` = ?
    """,
            (key,),
        )
        row = rows[0] if rows else None
        return int(row[1]) if row is not None and row[0] == token else None

    def store_release(self, key: str, token: str) -> bool:
        affected, _ = self.execute(
            f"""
      DELETE FROM {self.table}
      WHERE `key` = ? AND `value` = ?
    """,
            (key, token),
        )
        return affected == 1

    def store_extend(self, key: str, token: str, ttl_seconds: float) -> int | None:
        now = self.now()
        expired_at = get_time(now + ttl_seconds * 1000)
        affected, _ = self.execute(
            f"""
      UPDATE {self.table}
      SET `expired_at` = ?
      WHERE `key` = ?
        AND `value` = ?
        AND `expired_at` > ?
    """,
            (expired_at, key, token, now),
        )
        return expired_at if affected == 1 else None


# --- connections ----------------------------------------------------------------------------


if TYPE_CHECKING:
    _Connection = Connection[Cursor]
else:
    _Connection = Connection  # generic in the stubs only


class Counted(_Connection):
    """A PyMySQL connection that counts the statements it sends."""

    sent = 0

    def query(self, sql: Any, unbuffered: bool = False) -> int:
        self.sent += 1
        return super().query(sql, unbuffered)


def connect(
    server: Server,
    *,
    client_flag: int = 0,
    collation: str | None = None,
    user: str | None = None,
    password: str | None = None,
    in_database: bool = True,
) -> Counted:
    """An autocommit PyMySQL connection in the tests' database (``in_database``: else in none)."""
    args = connect_args(server.url)
    return Counted(
        host=args["host"],
        port=args["port"],
        user=user or args["user"],
        password=args["password"] if password is None else password,
        database=server.database if in_database else None,
        autocommit=True,
        charset="utf8mb4",
        collation=collation,
        client_flag=client_flag,
    )


def typescript_connection(server: Server) -> Counted:
    """A connection as mysql2 opens one: autocommit, ``CLIENT_FOUND_ROWS``, utf8mb4_unicode_ci."""
    return connect(server, client_flag=CLIENT.FOUND_ROWS, collation="utf8mb4_unicode_ci")


class Python(PythonSide):
    """dmutex's public classes on one kind of client, each call run to its end."""

    def __init__(self, kind: str, server: Server) -> None:
        self.kind = kind
        self.loop = None if kind == "pymysql" else asyncio.new_event_loop()
        args = connect_args(server.url)
        self.client: Any
        if kind == "pymysql":
            self.client = connect(server)
        elif kind == "aiomysql":
            self.client = self.run(aiomysql_connection(server.url, server.database))
        else:
            self.client = self.run(
                asyncmy.connect(
                    host=args["host"],
                    port=args["port"],
                    user=args["user"],
                    password=args["password"],
                    database=server.database,
                    charset="utf8mb4",
                    autocommit=True,
                )
            )

    def close(self) -> None:
        if self.loop is None:
            self.client.close()
            return
        self.run(self.client.ensure_closed())
        self.loop.close()


# --- the table behind both libraries -------------------------------------------------------


def run(raw: Connection[Cursor], text: str, *args: object) -> tuple[int, list[Any]]:
    """(affected rows, rows) of one statement on a plain connection."""
    with raw.cursor() as cursor:
        cursor.execute(text, args or None)
        return cursor.rowcount, list(cursor.fetchall())


def slot_rows(raw: Connection[Cursor], table: str) -> dict[str, tuple[str, int]]:
    """The slot rows (``permit:...``): what both libraries hold, without dmutex's counters."""
    return {key: row for key, row in rows(raw, table).items() if key.startswith("permit:")}


def create_table(raw: Connection[Cursor], table: str) -> str:
    """``SHOW CREATE TABLE``'s text for ``table``."""
    return str(run(raw, f"SHOW CREATE TABLE {quote_identifier(table)}")[1][0][1])


def column_collations(raw: Connection[Cursor], table: str) -> dict[str, str | None]:
    found = run(
        raw,
        "SELECT COLUMN_NAME, COLLATION_NAME FROM information_schema.COLUMNS "
        "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
        table,
    )[1]
    return {name: collation for name, collation in found}


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture
def server(mysql_session: Session) -> Server:
    return mysql_session.server()


@pytest.fixture
def raw(server: Server) -> Iterator[Counted]:
    """A plain autocommit connection, to look at and change tables behind both libraries."""
    with connect(server) as conn:
        yield conn


@pytest.fixture
def ts_conn(server: Server) -> Iterator[Counted]:
    with typescript_connection(server) as conn:
        yield conn


@pytest.fixture
def service(raw: Counted) -> Iterator[str]:
    """A fresh service name; its mutex and semaphore tables are dropped after the test."""
    name = f"svc{uuid.uuid4().hex[:10]}"
    yield name
    for prefix in ("_dmutex_", "_dsemaphore_"):
        run(raw, f"DROP TABLE IF EXISTS {quote_identifier(prefix + name)}")


@pytest.fixture(params=SIDES)
def side(request: pytest.FixtureRequest, server: Server) -> Iterator[Python]:
    made = Python(request.param, server)
    yield made
    made.close()


def made_by_dmutex(raw: Counted, service: str, *, permits: int = 1) -> None:
    """dmutex's table for ``service`` (``utf8mb4_nopad_bin`` key and value), made before any use."""
    if permits == 1:
        DMutex(service, raw).ready()
    else:
        DSemaphore(service, raw, max_permits=permits).ready()


# --- exclusion ------------------------------------------------------------------------------


def test_a_typescript_mutex_and_dmutexs_exclude_each_other(
    side: Python, ts_conn: Counted, raw: Counted, service: str
) -> None:
    made_by_dmutex(raw, service)
    ts = TypeScript.mutex(ts_conn, service)
    mutex = side.mutex(service)  # the same table: "_dmutex_<service>"
    theirs = ts.acquire(KEY, 30)
    assert theirs is not None
    assert side.run(mutex.acquire(KEY, 30)) is None
    assert ts.acquire(KEY, 30) is None, "nor another TypeScript holder"
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
    made_by_dmutex(raw, service, permits=3)
    ts = TypeScript(ts_conn, service, max_permits=3)
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
    assert ts.acquire(KEY, 30) is None
    held = {k: v for k, (v, _) in slot_rows(raw, f"_dsemaphore_{service}").items()}
    assert held == {
        f"permit:0:{KEY}": again.token,
        f"permit:1:{KEY}": second.token,
        f"permit:2:{KEY}": ours.token,
    }


def test_a_race_of_both_semaphores_never_exceeds_max_permits(
    server: Server, raw: Counted, service: str
) -> None:
    # Two TypeScript slot loops and three dmutex semaphores (PyMySQL in a
    # thread, aiomysql and asyncmy each on a loop in another) cycle on one
    # key of two permits. Each records its slot between its grant and its
    # release: a slot held twice at once, or more than two held, is an
    # over-grant.
    permits, rounds = 2, 40
    inside: dict[int, str] = {}
    faults: list[str] = []
    cycles: dict[str, int] = {}
    mixed = 0  # moments when a TypeScript and a dmutex holder held the two permits
    guard = threading.Lock()
    start = threading.Barrier(5, timeout=30)

    def hold(slot: int, who: str) -> None:
        nonlocal mixed
        with guard:
            if slot in inside or len(inside) >= permits:
                faults.append(f"{who} got slot {slot} while {inside} held")
            inside[slot] = who
            if len({name.startswith("ts-") for name in inside.values()}) == 2:
                mixed += 1
        time.sleep(0.001)  # a holder stays a moment, so that an overlap would show
        with guard:
            del inside[slot]

    def typescript(who: str) -> None:
        with typescript_connection(server) as conn:
            ts = TypeScript(conn, service, max_permits=permits)
            start.wait()
            for _ in range(rounds):
                permit = ts.acquire_with_retry(KEY, 30, timeout=20, retry_delay=0.002)
                assert permit is not None, f"{who}: no permit in 20 s"
                hold(permit.slot, who)
                assert ts.release(KEY, permit.token)
                cycles[who] = cycles.get(who, 0) + 1
                # Other work between two holds: two tight retry loops that
                # take a permit again the moment they release it would keep
                # both from dmutex's polling waiters for most of the race.
                time.sleep(0.003)

    def pymysql_side(who: str) -> None:
        with connect(server) as conn:
            sem = DSemaphore(service, conn, max_permits=permits)
            start.wait()
            for _ in range(rounds):
                permit = sem.acquire_with_retry(KEY, ttl=30, timeout=20, retry_delay=0.005)
                assert permit is not None, f"{who}: no permit in 20 s"
                hold(permit.slot, who)
                assert permit.release()
                cycles[who] = cycles.get(who, 0) + 1

    def async_side(who: str) -> None:
        side = Python(who, server)
        try:
            sem = side.semaphore(service, permits)
            start.wait()
            for _ in range(rounds):
                permit = side.run(
                    sem.acquire_with_retry(KEY, ttl=30, timeout=20, retry_delay=0.005)
                )
                assert permit is not None, f"{who}: no permit in 20 s"
                hold(permit.slot, who)
                assert side.run(permit.release())
                cycles[who] = cycles.get(who, 0) + 1
        finally:
            side.close()

    made_by_dmutex(raw, service, permits=permits)
    errors: list[BaseException] = []

    def guarded(work: Callable[[str], None], who: str) -> None:
        try:
            work(who)
        except BaseException as error:  # noqa: BLE001 - reported by the test below
            errors.append(error)

    workers = [
        threading.Thread(target=guarded, args=(typescript, "ts-1")),
        threading.Thread(target=guarded, args=(typescript, "ts-2")),
        threading.Thread(target=guarded, args=(pymysql_side, "pymysql")),
        threading.Thread(target=guarded, args=(async_side, "aiomysql")),
        threading.Thread(target=guarded, args=(async_side, "asyncmy")),
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=90)
    assert not any(worker.is_alive() for worker in workers), "bounded: every worker ended"
    assert errors == []
    assert faults == []
    assert cycles == dict.fromkeys(("ts-1", "ts-2", "pymysql", "aiomysql", "asyncmy"), rounds)
    assert mixed > 0, "the libraries held the permits together: they raced"
    assert slot_rows(raw, f"_dsemaphore_{service}") == {}, (
        "every permit released, nothing else written"
    )


def test_a_dmutex_grant_that_a_typescript_commit_overtook_tries_again(
    server: Server, raw: Counted, ts_conn: Counted, service: str
) -> None:
    table = f"_dsemaphore_{service}"
    with connect(server) as conn:
        sem = DSemaphore(service, conn, max_permits=2)
        sem.ready()
        ts = TypeScript(ts_conn, service, max_permits=2)
        assert ts.acquire(KEY, 30) is not None  # slot 0
        answers: list[object] = []
        with typescript_connection(server) as late:
            pending = TypeScript(late, service, max_permits=2)
            # The TypeScript acquire of slot 1, its commit held back: dmutex's
            # read finds slot 1 free, and its upsert then waits on the row.
            late.begin()
            token = str(uuid.uuid4())
            assert pending.store_acquire(f"permit:1:{KEY}", token, 30) is not None
            (thread,) = run(conn, "SELECT CONNECTION_ID()")[1][0]
            before = conn.sent
            worker = threading.Thread(target=lambda: answers.append(sem.acquire(KEY, 30)))
            worker.start()
            # INNODB_TRX is a cache that a read less than 0.1 s after the last
            # one does not refresh: polled every 0.2 s.
            waiting = (
                "SELECT count(*) FROM information_schema.INNODB_TRX "
                "WHERE trx_mysql_thread_id = %s AND trx_state = 'LOCK WAIT'"
            )
            until(
                lambda: run(raw, waiting, thread)[1] == [(1,)],
                "dmutex waits on the row",
                20,
                poll=0.2,
            )
            late.commit()
            worker.join(timeout=20)
        assert answers == [None], "full once the TypeScript acquire committed: nothing overwritten"
        assert conn.sent - before == 3, "read, take (refused), read again: full"
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
    assert stored > ms(ours.expired_at) + 50_000, "moved by the TypeScript extend"
    assert side.run(sem.extend(KEY, ours.token, 60)) is True, "still dmutex's to extend"
    assert ts.release(KEY, ours.token)
    assert f"permit:{ours.slot}:{KEY}" not in rows(raw, table)
    assert side.run(ours.extend()) is False, "the handle finds its lease gone"
    assert side.run(ours.release()) is False
    assert ts.release(KEY, ours.token) is False


def test_dmutexs_release_and_extend_by_token_work_on_typescript_grants(
    side: Python, ts_conn: Counted, raw: Counted, service: str
) -> None:
    made_by_dmutex(raw, service, permits=2)
    made_by_dmutex(raw, service)
    ts = TypeScript(ts_conn, service, max_permits=2)
    theirs = ts.acquire(KEY, 30)
    assert theirs is not None
    sem = side.semaphore(service, 2)
    assert side.run(sem.extend(KEY, theirs.token, 90)) is True
    stored = rows(raw, f"_dsemaphore_{service}")[f"permit:0:{KEY}"][1]
    assert stored > theirs.expired_at + 50_000
    assert ts.extend(KEY, theirs.token, 30), "still the TypeScript holder's to extend"
    assert side.run(sem.release(KEY, theirs.token)) is True
    assert ts.release(KEY, theirs.token) is False, "gone"
    # A mutex: release by token is the deprecated unlock(key, token).
    tm = TypeScript.mutex(ts_conn, service)
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
    made_by_dmutex(raw, service, permits=3)
    ts = TypeScript(ts_conn, service, max_permits=3)
    theirs = [ts.acquire(KEY, 30 + n) for n in range(2)]
    found = read_holders(raw, service=service, limit=3, key=KEY)
    assert [(h.slot, h.token, h.expires_ms) for h in found.holders] == [
        (p.slot, p.token, p.expired_at) for p in theirs if p is not None
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
    assert len(found.holders) == 1
    again = sem.acquire(KEY, 30)
    assert again is not None
    assert again.fence is not None
    assert again.fence > ours.fence


def test_a_dmutex_waiter_behind_a_typescript_lease_gets_in_when_it_expires(
    side: Python, ts_conn: Counted, raw: Counted, service: str
) -> None:
    made_by_dmutex(raw, service)
    ts = TypeScript.mutex(ts_conn, service)
    assert ts.acquire(KEY, 0.3) is not None
    mutex = side.mutex(service)
    # retry_delay=30: a wait lasts at least 15 s unless the lease in the way
    # ends it; the timeout is 10 s, so a lock here came from its expiry.
    started = time.monotonic()
    lock = side.run(mutex.acquire_with_retry(KEY, ttl=30, timeout=10, retry_delay=30))
    assert lock is not None
    assert time.monotonic() - started < 5
    assert rows(raw, f"_dmutex_{service}")[f"permit:0:{KEY}"][0] == lock.token


# --- dmutex's fence row --------------------------------------------------------------------


def test_dmutexs_fence_row_is_no_permit_to_the_typescript_store(
    raw: Counted, ts_conn: Counted, service: str
) -> None:
    table = f"_dsemaphore_{service}"
    # With fencing=False dmutex writes no row but its permits here.
    plain = DSemaphore(service, raw, max_permits=2, fencing=False)
    held = plain.acquire(KEY, 30)
    assert held is not None
    assert held.fence is None
    assert held.release()
    assert rows(raw, table) == {}
    fenced = DSemaphore(service, raw, max_permits=2, fencing=True)
    for ours in [fenced.acquire(KEY, 30) for _ in range(2)]:
        assert ours is not None
        assert ours.release()
    extra = rows(raw, table)
    assert extra.keys() == {f"fence:{KEY}"}
    assert extra[f"fence:{KEY}"][1] == FOREVER
    ts = TypeScript(ts_conn, service, max_permits=2)
    permits = [ts.acquire(KEY, 30) for _ in range(3)]
    assert [p is not None for p in permits] == [True, True, False], "both permits, then full"
    for permit in permits[:2]:
        assert permit is not None
        assert ts.extend(KEY, permit.token, 60)
        assert ts.release(KEY, permit.token)
    assert rows(raw, table) == extra, "never changed by the TypeScript store"
    # A mutex's fence row, in its own table, alike.
    mutex = DMutex(service, raw, fencing=True)
    lock = mutex.acquire(KEY, 30)
    assert lock is not None
    assert lock.fence is not None
    fence = rows(raw, f"_dmutex_{service}")[f"fence:{KEY}"]
    assert fence == (str(lock.fence), FOREVER)
    tm = TypeScript.mutex(ts_conn, service)
    assert tm.acquire(KEY, 30) is None, "dmutex's lock holds the key"
    assert lock.release()
    theirs = tm.acquire(KEY, 30)
    assert theirs is not None
    assert tm.release(KEY, theirs.token)
    assert rows(raw, f"_dmutex_{service}") == {f"fence:{KEY}": fence}


# --- the table, whoever makes it first -----------------------------------------------------


def test_on_dmutexs_table_the_typescript_create_changes_nothing_and_both_use_it(
    side: Python, ts_conn: Counted, raw: Counted, service: str
) -> None:
    table = f"_dmutex_{service}"
    mutex = side.mutex(service)
    side.run(mutex.ready())
    made = create_table(raw, table)
    assert column_collations(raw, table) == {
        "key": COLLATION,
        "value": COLLATION,
        "expired_at": None,
    }
    ts = TypeScript.mutex(ts_conn, service)  # its CREATE TABLE IF NOT EXISTS
    assert create_table(raw, table) == made
    # Keys compare byte for byte, for both: "Job" and "job" are two locks.
    theirs = ts.acquire("Job", 30)
    assert theirs is not None
    ours = side.run(mutex.acquire("job", 30))
    assert ours is not None
    assert ts.acquire("job", 30) is None
    assert side.run(mutex.acquire("Job", 30)) is None
    assert {k: v for k, (v, _) in slot_rows(raw, table).items()} == {
        "permit:0:Job": theirs.token,
        "permit:0:job": ours.token,
    }


def test_on_the_typescript_stores_table_dmutex_refuses_until_altered_as_advised(
    ts_conn: Counted, raw: Counted, service: str
) -> None:
    table = f"_dmutex_{service}"
    ts = TypeScript.mutex(ts_conn, service)  # made first: the database's default collation
    collations = column_collations(raw, table)
    assert collations["key"] != COLLATION
    assert collations["key"] == run(raw, "SELECT @@collation_database")[1][0][0]
    case_insensitive = run(raw, "SELECT 'A' = 'a' COLLATE " + str(collations["key"]))[1]
    if case_insensitive != [(1,)]:
        pytest.skip(f"the database's collation ({collations['key']}) tells case apart")
    # On its own table, the TypeScript store takes "Job" and "job" for one lock.
    theirs = ts.acquire("Job", 30)
    assert theirs is not None
    assert ts.acquire("job", 30) is None
    mutex = DMutex(service, raw)
    with pytest.raises(DMutexError, match=rf"ALTER TABLE `{table}` MODIFY `key` .*{COLLATION}"):
        mutex.acquire("job", 30)
    assert {k: v for k, (v, _) in rows(raw, table).items()} == {"permit:0:Job": theirs.token}

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
        run(raw, found.group(1))  # the advice, as given
    assert all(f"COLLATE {COLLATION}" in alter for alter in advised)
    assert set(re.findall(r"MODIFY `(\w+)`", " ".join(advised))) == {"key", "value"}
    assert column_collations(raw, table) == {
        "key": COLLATION,
        "value": COLLATION,
        "expired_at": None,
    }
    # Now the table is dmutex's own, its rows kept, and both use it.
    assert {k: v for k, (v, _) in rows(raw, table).items()} == {"permit:0:Job": theirs.token}
    assert mutex.acquire("Job", 30) is None
    ours = mutex.acquire("job", 30)
    assert ours is not None
    assert ts.acquire("job", 30) is None
    assert TypeScript.mutex(ts_conn, service).acquire("JOB", 30) is not None, "a third lock"
    assert column_collations(raw, table)["key"] == COLLATION, "its CREATE changed nothing"
    assert ts.release("Job", theirs.token)
    assert ours.release()


def test_both_name_a_table_in_a_named_database_alike(
    server: Server, raw: Counted, service: str
) -> None:
    # databaseName / database_name: `db`.`table`, from connections that
    # have no current database.
    made_by_dmutex(raw, service)
    with (
        connect(
            server,
            client_flag=CLIENT.FOUND_ROWS,
            collation="utf8mb4_unicode_ci",
            in_database=False,
        ) as ts_nowhere,
        connect(server, in_database=False) as nowhere,
    ):
        assert run(nowhere, "SELECT DATABASE()")[1] == [(None,)]
        ts = TypeScript.mutex(ts_nowhere, service, database_name=server.database)
        mutex = DMutex(service, nowhere, database_name=server.database)
        theirs = ts.acquire(KEY, 30)
        assert theirs is not None
        assert mutex.acquire(KEY, 30) is None
        assert ts.release(KEY, theirs.token)
        ours = mutex.acquire(KEY, 30)
        assert ours is not None
        assert ts.acquire(KEY, 30) is None
    assert slot_rows(raw, f"_dmutex_{service}") == {
        f"permit:0:{KEY}": (ours.token, ms(ours.expired_at))
    }


# --- the known differences -----------------------------------------------------------------


def test_the_typescript_release_ignores_expiry_and_dmutexs_does_not(
    side: Python, ts_conn: Counted, raw: Counted, service: str
) -> None:
    made_by_dmutex(raw, service)
    table, row = f"_dmutex_{service}", f"permit:0:{KEY}"
    ts = TypeScript.mutex(ts_conn, service)
    theirs = ts.acquire(KEY, 30)
    assert theirs is not None
    age(raw, table, row)
    mutex = side.mutex(service)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert side.run(mutex.unlock(KEY, theirs.token)) is False, "dmutex: expired, left alone"
    assert ts.extend(KEY, theirs.token, 30) is False, "the TypeScript extend checks expiry"
    assert row in rows(raw, table)
    assert ts.release(KEY, theirs.token), "the TypeScript release deletes the expired row"
    ours = side.run(mutex.acquire(KEY, 30))
    assert ours is not None
    age(raw, table, row)
    assert side.run(ours.release()) is False
    assert ts.release(KEY, ours.token), "whoever's row it is"


def test_a_resent_typescript_acquire_answers_success_with_the_first_expiry(
    ts_conn: Counted, raw: Counted, service: str
) -> None:
    # A TypeScript acquire sent again with its token (a retrying driver,
    # after a lost reply): its upsert leaves the unexpired row alone, but the
    # read-back finds its own token and answers success, with the expiry
    # the first copy wrote, not moved by the second TTL. acquire() itself
    # draws a new token on each call, which the row refuses.
    made_by_dmutex(raw, service)
    ts = TypeScript.mutex(ts_conn, service)
    token, row = str(uuid.uuid4()), f"permit:0:{KEY}"
    first = ts.store_acquire(row, token, 30)
    assert first is not None
    assert ts.store_acquire(row, token, 90) == first
    assert rows(raw, f"_dmutex_{service}")[row] == (token, first)
    assert ts.acquire(KEY, 30) is None


def test_the_typescript_stores_clock_is_its_hosts_and_dmutexs_the_servers(
    ts_conn: Counted, raw: Counted, service: str
) -> None:
    made_by_dmutex(raw, service)
    table, row = f"_dmutex_{service}", f"permit:0:{KEY}"
    mutex = DMutex(service, raw)
    # On one machine the two clocks agree: a grant by either ends where the
    # other expects it, to within the moment between the two readings.
    before = server_ms(raw)
    theirs = TypeScript.mutex(ts_conn, service).acquire(KEY, 30)
    after = server_ms(raw)
    assert theirs is not None
    assert before + 30_000 - 50 <= theirs.expired_at <= after + 30_000 + 50
    assert mutex.acquire(KEY, 30) is None
    run(raw, f"DELETE FROM {quote_identifier(table)}")
    # A TypeScript host whose clock runs a minute ahead takes a dmutex lease
    # of 30 s at once, which the server's clock says has 30 s left.
    ours = mutex.acquire(KEY, 30)
    assert ours is not None
    ahead = TypeScript.mutex(ts_conn, service, skew_ms=60_000)
    early = ahead.acquire(KEY, 30)
    assert early is not None, "taken 60 s early, by its host's clock"
    assert rows(raw, table)[row][0] == early.token
    assert ours.extend() is False, "the dmutex holder finds it gone"
    assert mutex.acquire(KEY, 30) is None, "dmutex: held, for 90 s by the server's clock"
    run(raw, f"DELETE FROM {quote_identifier(table)}")
    # One whose clock runs a minute behind writes a lease of 30 s that ended
    # 30 s ago by the server's: dmutex takes it at once, status shows none.
    behind = TypeScript.mutex(ts_conn, service, skew_ms=-60_000)
    late = behind.acquire(KEY, 30)
    assert late is not None
    assert read_holders(raw, service=service, limit=1, key=KEY).holders == []
    taken = mutex.acquire(KEY, 30)
    assert taken is not None
    assert behind.extend(KEY, late.token, 30) is False, "its extend finds dmutex's token"


def test_a_typescript_acquire_costs_two_statements_per_slot(
    ts_conn: Counted, raw: Counted, service: str
) -> None:
    permits = 5
    made_by_dmutex(raw, service, permits=permits)
    made_by_dmutex(raw, service)
    sent = ts_conn.sent
    ts = TypeScript(ts_conn, service, max_permits=permits)
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
    assert TypeScript.mutex(ts_conn, service).acquire(KEY, 30) is not None
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


def test_the_typescript_store_needs_create_and_dmutex_does_not(
    server: Server, ts_conn: Counted, raw: Counted, service: str
) -> None:
    table = f"_dmutex_{service}"
    made_by_dmutex(raw, service)
    user = f"dmutex_{uuid.uuid4().hex[:8]}"
    password = uuid.uuid4().hex
    try:
        run(raw, "CREATE USER %s@'%%' IDENTIFIED BY %s", user, password)
    except pymysql.err.OperationalError as error:
        pytest.skip(f"the server's user may not create users: {error}")
    try:
        # A user that may use the table, and create nothing.
        run(
            raw,
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON {quote_identifier(server.database)}."
            f"{quote_identifier(table)} TO %s@'%%'",
            user,
        )
        with (
            connect(
                server,
                user=user,
                password=password,
                client_flag=CLIENT.FOUND_ROWS,
                collation="utf8mb4_unicode_ci",
            ) as limited_ts,
            connect(server, user=user, password=password) as limited,
        ):
            if run(limited, "SELECT CURRENT_USER()")[1][0][0] != f"{user}@%":
                pytest.skip("another account of the server matches this user's connection")
            with pytest.raises(pymysql.err.OperationalError) as refused:
                TypeScript.mutex(limited_ts, service)
            assert refused.value.args[0] == 1142, "CREATE command denied"
            mutex = DMutex(service, limited)
            mutex.ready()
            lock = mutex.acquire(KEY, 30)
            assert lock is not None
            assert lock.release()
    finally:
        run(raw, "DROP USER %s@'%%'", user)


def test_a_typescript_release_wakes_no_dmutex_waiter_and_a_dmutex_release_does(
    server: Server, ts_conn: Counted, raw: Counted, service: str
) -> None:
    # dmutex wakes, at its release, the waiters of its own client object
    # (store.py, rule 5); a TypeScript release sends nothing, so a waiter
    # behind it tries again at the end of its wait: here its deadline.
    made_by_dmutex(raw, service)
    ts = TypeScript.mutex(ts_conn, service)
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

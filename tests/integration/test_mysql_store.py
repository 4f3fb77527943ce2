"""The MySQL store on a real MariaDB/MySQL server: its layout, round trips, keys and failures.

Below the public classes (whose behaviour the contract suite checks), these
tests look at what the store leaves on the server and what it sends. The
statements are counted on the client, by a PyMySQL connection that records
every query, ``COMMIT`` and ``ROLLBACK`` it sends (:class:`Counting`; each
is one round trip), and once against the server's own ``Questions``
counter. A second, plain connection (``raw``) reads and writes the table
behind the store's back; time passes by rewriting ``expired_at`` with the
server's clock, never by sleeping, except where a lock wait must time out.

The server is the session's (``mysql_session``); each test works in a table
of its own in the session's database, dropped afterwards. The restart tests
use the session's restartable server. Users a test creates are dropped by
the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, cast

import MySQLdb
import pymysql
import pytest
import sqlalchemy
from pymysql.connections import Connection
from pymysql.cursors import Cursor

from dmutex import (
    DMutex,
    DMutexError,
    DMutexLock,
    DSemaphore,
    DSemaphorePermit,
    InvalidArgumentError,
    UnsupportedClientError,
)
from dmutex._backends.clients import MySQLConnectionLike
from dmutex._backends.mysql import MySQLStore
from dmutex._backends.mysql.runners import DEADLOCK_TRIES, Outcome, runner
from dmutex._backends.mysql.statements import FOREVER, LISTED, Statement, granted, refused
from dmutex._cli.holders import read_holders
from dmutex._clock import SYSTEM_CLOCK
from dmutex._runtime.drivers import SyncDriver
from tests._support import mysql_servers
from tests._support.mysql_rows import (
    EPOCH,
    NOW_MS,
    Counting,
    fetch,
    quoted,
    rows,
    server_ms,
)
from tests._support.mysql_servers import Server, Session, connect_args

if TYPE_CHECKING:
    _Connection = Connection[Cursor]
else:
    _Connection = Connection

# The TypeScript dmutex's CREATE TABLE: no character set or collation named, so
# the columns take the database's default (case-insensitive) one.
TYPESCRIPT_DDL = (
    "CREATE TABLE {table} (`key` varchar(512) NOT NULL PRIMARY KEY, "
    "`value` varchar(128) NOT NULL, `expired_at` bigint NOT NULL, "
    "INDEX `expired_at_idx` (`expired_at`)) ENGINE=InnoDB"
)


# --- helpers ---------------------------------------------------------------------------


def client(conn: object) -> MySQLConnectionLike:
    """``conn`` as the type DMutex and DSemaphore take (for mypy only; nothing changes).

    A PyMySQL connection meets ``MySQLConnectionLike`` at run time; statically
    only while the protocol leaves out ``execute``, whose parameters
    types-PyMySQL annotates as a ``dict`` (clients.py). The cast holds either way.
    """
    return cast(MySQLConnectionLike, conn)


def thread_id(conn: _Connection) -> int:
    """The server's id of ``conn``'s session (what KILL takes)."""
    return int(conn.thread_id())  # type: ignore[no-untyped-call]  # untyped in types-PyMySQL


def counting(server: Server, *, autocommit: bool = True) -> Counting:
    """A new counting connection in the session's database."""
    args = connect_args(server.url)
    args["database"] = server.database
    return Counting(**args, autocommit=autocommit, connect_timeout=mysql_servers.CONNECT_TIMEOUT)


def permits(conn: _Connection, table: str) -> dict[str, tuple[str, int]]:
    """The slot rows of ``table`` (``permit:...``), without the fence counters."""
    return {key: row for key, row in rows(conn, table).items() if key.startswith("permit:")}


def expire(conn: _Connection, table: str, key: str) -> None:
    """End the lease of row ``key`` by the server's clock; the row stays."""
    fetch(conn, f"UPDATE {quoted(table)} SET `expired_at` = {NOW_MS} - 1 WHERE `key` = %s", (key,))


def tables(conn: _Connection) -> set[str]:
    found = fetch(
        conn, "SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE()"
    )
    return {str(name) for (name,) in found}


def ms_of(handle: DMutexLock | DSemaphorePermit) -> int:
    """A handle's expiry in epoch ms (it shows it as a datetime)."""
    expired_at: datetime = handle.expired_at
    return round((expired_at - EPOCH).total_seconds() * 1000)


def in_transaction(conn: _Connection) -> int:
    """MariaDB's ``@@in_transaction`` of ``conn``, asked on ``conn`` (it opens none)."""
    (inside,) = fetch(conn, "SELECT @@in_transaction")[0]
    return int(inside)


def open_transactions(raw: _Connection, conn: _Connection) -> int:
    """InnoDB's transactions of ``conn``'s session, seen from another connection."""
    found = fetch(
        raw,
        "SELECT COUNT(*) FROM information_schema.INNODB_TRX WHERE trx_mysql_thread_id = %s",
        (thread_id(conn),),
    )
    return int(found[0][0])


def store_driver(store: MySQLStore) -> SyncDriver:
    driver = SyncDriver(SYSTEM_CLOCK, store.ready)
    driver.ready()
    return driver


@pytest.fixture
def server(mysql_session: Session) -> Server:
    found = mysql_session.server()
    if found.flavour != "mariadb":
        # @@in_transaction and INNODB_TRX's columns as read here, the collation
        # (utf8mb4_nopad_bin) and the users' SQL are MariaDB's.
        pytest.skip(f"these tests read MariaDB's session variables; the server is {found.label}")
    return found


@pytest.fixture
def raw(server: Server) -> Iterator[_Connection]:
    """A plain autocommit connection, to look at and change tables behind the store."""
    conn = server.connect()
    try:
        yield conn
    finally:
        conn.close()


@pytest.fixture
def table(raw: _Connection) -> Iterator[str]:
    """A fresh table name in the session's database, dropped after the test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    fetch(raw, f"DROP TABLE IF EXISTS {quoted(name)}")
    fetch(raw, f"DROP VIEW IF EXISTS {quoted(name)}")


@pytest.fixture
def conn(server: Server) -> Iterator[Counting]:
    """dmutex's connection, in autocommit, counting what it sends."""
    made = counting(server)
    try:
        yield made
    finally:
        made.close()


# --- the layout ------------------------------------------------------------------------


@pytest.mark.parametrize("permits", [2, LISTED, LISTED + 1, 64, 1024])
def test_a_semaphore_picks_its_own_slot_then_a_free_one_then_reports_the_wait(
    conn: Counting, raw: _Connection, table: str, permits: int
) -> None:
    """Both forms of the read before a take (statements rule 7): listed and aggregated."""
    sem = DSemaphore("svc", client(conn), max_permits=permits, table_name=table)
    sem.ready()
    key = "k"
    # Every slot but one held by others, the last ending first: the free one is found.
    free = permits // 2
    now = server_ms(raw)
    held = [
        (f"permit:{slot}:{key}", f"other{slot}", now + 60_000 + slot)
        for slot in range(permits)
        if slot != free
    ]
    for start in range(0, len(held), 256):
        fetch(
            raw,
            f"INSERT INTO {quoted(table)} VALUES "
            + ", ".join(["(%s, %s, %s)"] * len(held[start : start + 256])),
            tuple(part for row in held[start : start + 256] for part in row),
        )
    permit = sem.acquire(key, 30)
    assert permit is not None
    assert permit.slot == free, "the one free slot, whichever the read's start"
    assert rows(raw, table)[f"permit:{free}:{key}"][0] == permit.token
    # Full: refused, the wait is until the earliest of the others' expiries.
    assert sem.acquire(key, 30) is None
    # The same token again (a re-sent copy): its own slot, not another.
    store = MySQLStore(client(conn), table, permits, SYSTEM_CLOCK, asynchronous=False)
    drive = store_driver(store)
    again = drive(store.acquire(key, permit.token, 30_000))
    assert again is not None
    assert again.slot == free
    # A stranger is told the wait until the earliest lease ends: this one's, renewed just now.
    earliest = min(again.expires_ms, *(expires for _, _, expires in held))
    slot, wait = drive(store._pick(key, "a stranger"))
    assert slot is None
    assert wait is not None
    assert abs(wait - (earliest - server_ms(raw))) < 2_000
    expire(raw, table, f"permit:{(free + 1) % permits}:{key}")
    other = sem.acquire(key, 30)
    assert other is not None
    assert other.slot == (free + 1) % permits, "an expired row is free"


def test_ready_creates_the_typescript_layout_with_byte_for_byte_text_columns(
    conn: Counting, raw: _Connection, table: str
) -> None:
    DMutex("svc", client(conn), table_name=table).ready()
    assert conn.taken() == ["SELECT", "CREATE", "SELECT"], "read, create, read it back"
    columns = fetch(
        raw,
        "SELECT COLUMN_NAME, COLUMN_TYPE, IS_NULLABLE, CHARACTER_SET_NAME, COLLATION_NAME, "
        "COLUMN_KEY FROM information_schema.COLUMNS "
        "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
        (table,),
    )
    assert columns == [
        ("key", "varchar(512)", "NO", "utf8mb4", "utf8mb4_nopad_bin", "PRI"),
        ("value", "varchar(128)", "NO", "utf8mb4", "utf8mb4_nopad_bin", ""),
        ("expired_at", "bigint(20)", "NO", None, None, "MUL"),
    ]
    indexes = fetch(
        raw,
        "SELECT INDEX_NAME, NON_UNIQUE, SEQ_IN_INDEX, COLUMN_NAME"
        " FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
        (table,),
    )
    assert sorted(indexes) == [("PRIMARY", 0, 1, "key"), ("expired_at_idx", 1, 1, "expired_at")]
    ((name, ddl),) = fetch(raw, f"SHOW CREATE TABLE {quoted(table)}")
    assert name == table
    assert ") ENGINE=InnoDB" in ddl
    assert "`key` varchar(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL" in ddl
    assert "`value` varchar(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL" in ddl
    assert "PRIMARY KEY (`key`)" in ddl
    assert "KEY `expired_at_idx` (`expired_at`)" in ddl
    DSemaphore("svc", client(conn), max_permits=2, table_name=table).ready()
    assert conn.taken() == ["SELECT"], "a table of the right shape: one read, nothing created"
    assert rows(raw, table) == {}


def test_a_grant_writes_its_slot_row_by_the_servers_clock(
    conn: Counting, raw: _Connection, table: str
) -> None:
    sem = DSemaphore("svc", client(conn), max_permits=3, table_name=table, fencing=False)
    before = server_ms(raw)
    permit = sem.acquire("api", ttl=7.5)
    after = server_ms(raw)
    assert permit is not None
    assert permit.fence is None, "fencing=False"
    stored = rows(raw, table)
    assert set(stored) == {f"permit:{permit.slot}:api"}, "no fence row either"
    value, expires = stored[f"permit:{permit.slot}:api"]
    assert value == permit.token
    assert expires == ms_of(permit), "the handle's expiry is the stored one"
    assert before + 7500 <= expires <= after + 7500, "the server's now plus the TTL, in epoch ms"


@pytest.mark.parametrize("permits", [1, 3])
def test_a_grant_advances_its_fence_row_in_its_own_statement(
    conn: Counting, raw: _Connection, table: str, permits: int
) -> None:
    """By default (fencing=None), as PostgreSQL's: one statement writes the slot and the counter."""
    sem = DSemaphore("svc", client(conn), max_permits=permits, table_name=table)
    sem.ready()
    fences: list[int] = []
    for _ in range(3):
        conn.taken()
        before = server_ms(raw)
        lock = sem.acquire("job", ttl=30)
        after = server_ms(raw)
        assert lock is not None
        assert conn.taken() == ["INSERT"] if permits == 1 else ["SELECT", "INSERT"]
        assert lock.fence is not None
        fences.append(lock.fence)
        stored = rows(raw, table)
        assert stored["fence:job"] == (str(lock.fence), FOREVER), "the answer is the stored one"
        assert stored[f"permit:{lock.slot}:job"][0] == lock.token
        if not fences[:-1] or fences[-2] < before * 1000:
            # The clock's part (fences rule 1): the statement's ms times 1,000.
            assert before * 1000 <= lock.fence <= after * 1000
        assert lock.release() is True
    assert fences == sorted(set(fences)), "strictly increasing"
    forever = datetime(9999, 1, 1, tzinfo=timezone.utc)
    assert round((forever - EPOCH).total_seconds() * 1000) == FOREVER
    assert set(rows(raw, table)) == {"fence:job"}, "the counter outlives the leases"


@pytest.mark.parametrize(
    "counter",
    [
        "ahead by 16,383 us or more: the grant's statement cannot say its fence",
        "not dmutex's: the grant's statement leaves it alone",
    ],
)
def test_a_counter_the_grant_cannot_answer_for_is_advanced_apart(
    conn: Counting, raw: _Connection, table: str, counter: str
) -> None:
    mutex = DMutex("svc", client(conn), table_name=table)
    mutex.ready()
    ahead = (server_ms(raw) + 60_000) * 1000
    stored = str(ahead) if counter.startswith("ahead") else "ours, says another program"
    fetch(raw, f"INSERT INTO {quoted(table)} VALUES ('fence:job', %s, {FOREVER})", (stored,))
    conn.taken()
    if counter.startswith("ahead"):
        lock = mutex.acquire("job", ttl=30)
        assert lock is not None
        assert conn.taken() == ["INSERT", "INSERT"], "the take, then the counter's own advance"
        assert lock.fence == ahead + 1, "the counter plus one: it was ahead of the clock"
        assert rows(raw, table)["fence:job"] == (str(ahead + 1), FOREVER)
        again = mutex.acquire("job", ttl=30)
        assert again is None
        assert lock.release() is True
        return
    with pytest.raises(DMutexError, match="holds a value dmutex did not write"):
        mutex.acquire("job", ttl=30)
    assert conn.taken() == ["INSERT", "INSERT", "DELETE"], "take, advance refused, the undo"
    assert rows(raw, table) == {"fence:job": (stored, FOREVER)}, "left as it was, no slot held"


def test_a_refused_take_writes_no_fence_row_and_shows_no_fence(
    conn: Counting, raw: _Connection
) -> None:
    """Only a grant makes the counter: a key never granted has no fence (statements rule 4).

    Its slot held by another program (as a TypeScript client's grant leaves
    it: the slot's row and no counter), the refused take is one statement
    that leaves the table as it was, so ``read_holders`` (``dmutex status``)
    shows the holder and no fence. The grant after it makes the counter at
    its own fence.
    """
    service = f"s{secrets.token_hex(4)}"
    table = f"_dmutex_{service}"
    try:
        mutex = DMutex(service, client(conn))
        mutex.ready()
        ends = server_ms(raw) + 60_000
        fetch(raw, f"INSERT INTO {quoted(table)} VALUES ('permit:0:job', 'theirs', %s)", (ends,))
        conn.taken()
        assert mutex.acquire("job", ttl=30) is None
        assert conn.taken() == ["INSERT"], "one statement, refused"
        assert rows(raw, table) == {"permit:0:job": ("theirs", ends)}, "no counter row made"
        seen = read_holders(client(conn), service=service, limit=1, key="job")
        assert [h.token for h in seen.holders] == ["theirs"]
        assert seen.fence is None, "never granted: no fence to show"
        expire(raw, table, "permit:0:job")
        lock = mutex.acquire("job", ttl=30)
        assert lock is not None
        assert lock.fence is not None
        assert rows(raw, table)["fence:job"] == (str(lock.fence), FOREVER), "made by the grant"
        assert read_holders(client(conn), service=service, limit=1, key="job").fence == lock.fence
        assert lock.release() is True
    finally:
        fetch(raw, f"DROP TABLE IF EXISTS {quoted(table)}")


def test_the_fenced_take_refused_neither_makes_nor_moves_the_counter(
    conn: Counting, raw: _Connection, table: str
) -> None:
    """The statement itself, as a semaphore's take that lost its slot sends it (slot 2)."""
    store = MySQLStore(conn, table, 4, SYSTEM_CLOCK, asynchronous=False)
    store_driver(store)
    run = runner(conn, asynchronous=False)
    take = store.statements.take_fenced
    params = {"row": "permit:2:k", "fence": "fence:k", "ttl": 10_000}
    held = cast(Outcome, run(take, {**params, "token": "first"})).answer
    assert granted(held) is not None
    before = rows(raw, table)
    assert set(before) == {"permit:2:k", "fence:k"}
    refusal = cast(Outcome, run(take, {**params, "token": "second"})).answer
    assert granted(refusal) is None
    assert 0 < refused(refusal) <= 10_000, "the ms until the lease in the way ends"
    assert rows(raw, table) == before, "the counter is where the grant left it"
    fetch(raw, f"DELETE FROM {quoted(table)} WHERE `key` = 'fence:k'")
    again = cast(Outcome, run(take, {**params, "token": "third"})).answer
    assert granted(again) is None
    assert set(rows(raw, table)) == {"permit:2:k"}, "a missing counter is not made"


def test_table_prefix_and_table_name_name_the_table(conn: Counting, raw: _Connection) -> None:
    service = f"s{secrets.token_hex(4)}"
    made = [f"_dmutex_{service}", f"_dsemaphore_{service}", f"p_{service}", f"n_{service}"]
    try:
        assert DMutex(service, client(conn)).acquire("k") is not None
        assert DSemaphore(service, client(conn), max_permits=2).acquire("k") is not None
        assert DMutex(service, client(conn), table_prefix="p_").acquire("k") is not None
        named = DMutex(service, client(conn), table_prefix="ignored_", table_name=made[3])
        assert named.acquire("k") is not None
        assert {t for t in tables(raw) if service in t} == set(made)
        for name in made:
            assert list(permits(raw, name)) in (["permit:0:k"], ["permit:1:k"]), name
    finally:
        for name in made:
            fetch(raw, f"DROP TABLE IF EXISTS {quoted(name)}")


def test_database_name_puts_the_table_in_another_database_than_the_connections(
    server: Server, raw: _Connection
) -> None:
    other = mysql_servers.unique_database()
    mysql_servers.make_database(server.url, other)
    name = "odd `name` 100%"
    try:
        for current in (other, None):  # another database, then none at all
            args = connect_args(server.url)
            args.pop("database", None)
            if current is not None:
                args["database"] = current
            made = Counting(**args, autocommit=True)
            try:
                mutex = DMutex("svc", client(made), table_name=name, database_name=server.database)
                lock = mutex.acquire(f"k{current}")
                assert lock is not None
                assert fetch(made, "SELECT DATABASE()") == [(current,)]
            finally:
                made.close()
            assert rows(raw, name, server.database)[f"permit:0:k{current}"][0] == lock.token
        found = fetch(
            raw,
            "SELECT TABLE_SCHEMA FROM information_schema.TABLES WHERE TABLE_NAME = %s",
            (name,),
        )
        assert found == [(server.database,)], "one table, in database_name, none in the current"
    finally:
        fetch(raw, f"DROP TABLE IF EXISTS {quoted(name)}")
        mysql_servers.drop_database(server.url, other)


# --- round trips -----------------------------------------------------------------------

# What each operation sends on a connection in autocommit, statement by
# statement (one round trip each). Outside autocommit each is followed by a
# COMMIT (runners.py, rule 2).
TRIPS = {
    "mutex grant": ["INSERT"],
    "mutex refusal": ["INSERT"],
    "mutex extend": ["UPDATE"],
    "mutex release": ["DELETE"],
    "release of a released lease": ["DELETE"],
    "fenced grant": ["INSERT"],
    "fenced refusal": ["INSERT"],
    "semaphore grant": ["SELECT", "INSERT"],
    "semaphore full": ["SELECT"],
    "extend by token": ["UPDATE"],
    "release by token": ["DELETE"],
    "renewal batch of 3": ["UPDATE", "SELECT"],
    "holders": ["SELECT"],
}
READS = ("semaphore grant", "semaphore full", "renewal batch of 3", "holders")
WRITES = tuple(name for name in TRIPS if name not in READS)


def committed(statements: list[str]) -> list[str]:
    """``statements``, each followed by the COMMIT dmutex sends outside autocommit."""
    return [sent for statement in statements for sent in (statement, "COMMIT")]


@dataclass(frozen=True)
class Trip:
    """What one operation sent, and whether a transaction was open after it."""

    sent: list[str]
    inside: int  # @@in_transaction, asked on the same connection afterwards
    innodb: int  # InnoDB's open transactions of that connection, seen from another


def measure(conn: Counting, raw: _Connection, table: str) -> dict[str, Trip]:
    """Run each operation of :data:`TRIPS` once on ``conn``, checking its answer."""
    mutex = DMutex("svc", client(conn), table_name=table)
    fenced = DMutex("svc", client(conn), table_name=table, fencing=True)
    sem = DSemaphore("svc", client(conn), max_permits=2, table_name=table)
    store = MySQLStore(conn, table, 3, SYSTEM_CLOCK, asynchronous=False)
    drive = SyncDriver(SYSTEM_CLOCK, store.ready)
    for face in (mutex, fenced, sem):
        face.ready()
    drive.ready()
    leases = [drive(store.acquire(key, str(uuid.uuid4()), 60_000)) for key in "rrq"]
    for lease in leases:
        assert lease is not None
        lease.ttl_ms = 60_000  # what renewal extends by (the engine sets it on a grant)
    conn.taken()
    trips: dict[str, Trip] = {}

    def note(name: str, answer: object, expected: object) -> None:
        assert answer == expected, name
        sent = conn.taken()
        trips[name] = Trip(sent, in_transaction(conn), open_transactions(raw, conn))
        conn.taken()

    lock = mutex.acquire("m")
    note("mutex grant", lock is not None, True)
    assert lock is not None
    note("mutex refusal", mutex.acquire("m"), None)
    note("mutex extend", lock.extend(60), True)
    note("mutex release", lock.release(), True)
    note("release of a released lease", lock.release(), False)
    fenced_lock = fenced.acquire("f")
    note("fenced grant", fenced_lock is not None and fenced_lock.fence is not None, True)
    note("fenced refusal", fenced.acquire("f"), None)
    first = sem.acquire("s")
    note("semaphore grant", first is not None, True)
    assert first is not None
    assert sem.acquire("s") is not None
    conn.taken()
    note("semaphore full", sem.acquire("s"), None)
    note("extend by token", sem.extend("s", first.token, 30), True)
    note("release by token", sem.release("s", first.token), True)
    renewed = drive(store.extend_many([lease for lease in leases if lease is not None]))
    note("renewal batch of 3", [isinstance(answer, int) for answer in renewed], [True] * 3)
    found = drive(store.holders("r"))
    note("holders", len(found.holders), 2)
    return trips


class Questions:
    """The server's ``Questions`` counter of one session: what it executed, as the server saw."""

    def __init__(self, conn: Counting) -> None:
        self.conn = conn
        first = self._read()
        self.own = self._read() - first  # what one read of the counter adds to it
        self.start, self.sent = self._read(), conn.count

    def _read(self) -> int:
        found = fetch(self.conn, "SHOW SESSION STATUS LIKE 'Questions'")
        self.conn.sent.pop()
        return int(found[0][1])

    def since(self) -> tuple[int, int]:
        """(the server's count, the client's) of the statements since, less these reads."""
        server = self._read() - self.start - self.own
        client = self.conn.count - self.sent - 1
        return server, client


def test_round_trips_per_operation_in_autocommit(
    conn: Counting, raw: _Connection, table: str
) -> None:
    questions = Questions(conn)
    trips = measure(conn, raw, table)
    server, client = questions.since()
    assert {name: trip.sent for name, trip in trips.items()} == TRIPS
    assert server == client, "the server executed what the client counted"
    assert client > sum(len(sent) for sent in TRIPS.values())
    assert all((trip.inside, trip.innodb) == (0, 0) for trip in trips.values())


@pytest.mark.parametrize(
    ("settings", "each"),
    [
        ({}, ["INSERT", "COMMIT", "ROLLBACK"]),
        ({"isolation_level": "AUTOCOMMIT"}, ["INSERT", "ROLLBACK"]),
        ({"isolation_level": "AUTOCOMMIT", "pool_reset_on_return": None}, ["INSERT"]),
    ],
)
def test_round_trips_through_a_sqlalchemy_engine(
    server: Server, table: str, settings: dict[str, Any], each: list[str]
) -> None:
    """What runners.py rule 6 says an engine costs: its commit and its pool's reset, unless told."""
    made: list[Counting] = []

    def creator() -> Counting:
        made.append(counting(server, autocommit=False))
        return made[-1]

    engine = sqlalchemy.create_engine("mysql+pymysql://", creator=creator, pool_size=1, **settings)
    try:
        mutex = DMutex("svc", engine, table_name=table)
        mutex.ready()
        (conn,) = made
        conn.taken()
        lock = mutex.acquire("k", 30)
        assert lock is not None
        assert conn.taken() == each
        assert lock.release() is True
        assert [word.replace("DELETE", "INSERT") for word in conn.taken()] == each
    finally:
        engine.dispose()


def test_round_trips_outside_autocommit_commit_each_write(
    server: Server, raw: _Connection, table: str
) -> None:
    conn = counting(server, autocommit=False)
    try:
        trips = measure(conn, raw, table)
        for name in WRITES:
            assert trips[name].sent == committed(TRIPS[name]), name
            assert (trips[name].inside, trips[name].innodb) == (0, 0), f"{name} left one open"
    finally:
        conn.close()


def test_round_trips_outside_autocommit_commit_each_read_too(
    server: Server, raw: _Connection, table: str
) -> None:
    conn = counting(server, autocommit=False)
    try:
        trips = measure(conn, raw, table)
        for name in READS:
            assert (trips[name].inside, trips[name].innodb) == (0, 0), f"{name} left one open"
            assert trips[name].sent == committed(TRIPS[name]), name
    finally:
        conn.close()


# --- keys and collations ----------------------------------------------------------------

# Keys that a case- or accent-insensitive collation (the server's default,
# utf8mb4_general_ci here) would take for one another, in pairs.
DISTINCT_KEYS = (
    "A",
    "a",
    "\u00e9",  # é, composed
    "e",
    "e\u0301",  # é, decomposed
    "\u00df",  # ß
    "ss",
    "\U0001f600",  # 😀: 4 bytes in UTF-8
    "\U0001f601",  # 😁: general_ci weighs every 4-byte character alike
    "\U0001d518" * 500,  # MATHEMATICAL FRAKTUR CAPITAL U x 500: the longest key, 2000 bytes
)


def test_keys_that_differ_in_case_accents_or_4_byte_characters_are_distinct_locks(
    conn: Counting, raw: _Connection, table: str
) -> None:
    mutex = DMutex("svc", client(conn), table_name=table)
    locks = [mutex.acquire(key) for key in DISTINCT_KEYS]
    assert all(lock is not None for lock in locks), "every key a lock of its own"
    stored = fetch(
        raw,
        f"SELECT CAST(`key` AS BINARY), `value` FROM {quoted(table)} WHERE `key` LIKE 'permit:%%'",
    )
    assert sorted(stored) == sorted(
        (f"permit:0:{key}".encode(), lock.token)
        for key, lock in zip(DISTINCT_KEYS, locks, strict=True)
        if lock is not None
    ), "stored byte for byte"
    assert all(mutex.acquire(key) is None for key in DISTINCT_KEYS), "each held by its own row"
    for lock in locks:
        assert lock is not None
        assert lock.release() is True
    assert permits(raw, table) == {}


def test_keys_that_differ_in_trailing_spaces_are_distinct_locks(
    conn: Counting, raw: _Connection, table: str
) -> None:
    mutex = DMutex("svc", client(conn), table_name=table)
    plain = mutex.acquire("k")
    assert plain is not None
    spaced = mutex.acquire("k ")
    assert spaced is not None, "'k ' is another key than 'k'"
    assert set(permits(raw, table)) == {"permit:0:k", "permit:0:k "}


def test_keys_with_a_nul_character_are_distinct_locks(
    conn: Counting, raw: _Connection, table: str
) -> None:
    """MySQL's text holds NUL, unlike PostgreSQL's: such a key is stored as sent, not refused."""
    mutex = DMutex("svc", client(conn), table_name=table)
    held = [mutex.acquire(key) for key in ("k", "k\x00", "k\x00x")]
    assert all(lock is not None for lock in held), "three locks"
    assert set(permits(raw, table)) == {"permit:0:k", "permit:0:k\x00", "permit:0:k\x00x"}
    assert mutex.acquire("k\x00") is None, "and held"
    assert all(lock is not None and lock.release() for lock in held)


@pytest.mark.parametrize("key", ["x" * 501, "\U0001d518" * 501])
def test_a_key_of_501_characters_is_refused_before_any_statement(
    conn: Counting, raw: _Connection, table: str, key: str
) -> None:
    mutex = DMutex("svc", client(conn), table_name=table)
    sem = DSemaphore("svc", client(conn), max_permits=2, table_name=table)
    mutex.ready()
    sem.ready()
    conn.taken()
    with pytest.raises(InvalidArgumentError, match="at most 500 characters"):
        mutex.acquire(key)
    with pytest.raises(InvalidArgumentError, match="at most 500 characters"):
        sem.acquire_with_retry(key, timeout=1)
    with pytest.raises(InvalidArgumentError, match="at most 500 characters"):
        sem.release(key, str(uuid.uuid4()))
    assert conn.taken() == [], "refused before any statement"
    assert rows(raw, table) == {}


# --- what ready() refuses ----------------------------------------------------------------


def _fix(message: str) -> str:
    """The ALTER TABLE a collation refusal says to run."""
    found = re.search(r"Fix it with: (ALTER TABLE .*)$", message)
    assert found is not None, message
    return found.group(1)


def test_the_typescript_tables_collation_is_refused_until_the_alter_it_names_is_run(
    conn: Counting, raw: _Connection, table: str
) -> None:
    fetch(raw, TYPESCRIPT_DDL.format(table=quoted(table)))
    fetch(raw, f"INSERT INTO {quoted(table)} VALUES ('permit:0:other', 'theirs', {NOW_MS} + 60000)")
    before = rows(raw, table)
    mutex = DMutex("svc", client(conn), table_name=table)
    with pytest.raises(DMutexError) as refused:
        mutex.acquire("k")
    message = str(refused.value)
    assert re.search(
        rf"the table `{table}` compares `key` by (\w+_ci), `value` by \1, "
        r"not byte for byte \(utf8mb4_nopad_bin\)",
        message,
    ), message
    assert "differ only in case, accents or trailing spaces would be one lock" in message
    fix = _fix(message)
    assert fix == (
        f"ALTER TABLE `{table}` "
        "MODIFY `key` varchar(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL, "
        "MODIFY `value` varchar(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL"
    )
    assert conn.taken() == ["SELECT"], "the shape read, nothing written"
    assert rows(raw, table) == before
    fetch(raw, fix)
    lock = mutex.acquire("k")
    assert lock is not None, "the one ALTER TABLE it named made the table acceptable"
    assert mutex.acquire("K") is not None, "case-sensitive now"
    assert rows(raw, table)["permit:0:other"] == before["permit:0:other"], "their row untouched"


def test_a_table_with_one_loose_column_is_told_the_alter_of_that_column(
    conn: Counting, raw: _Connection, table: str
) -> None:
    fetch(raw, TYPESCRIPT_DDL.format(table=quoted(table)))
    fetch(
        raw,
        f"ALTER TABLE {quoted(table)} MODIFY `key` varchar(512) CHARACTER SET utf8mb4"
        " COLLATE utf8mb4_nopad_bin NOT NULL",
    )
    mutex = DMutex("svc", client(conn), table_name=table)
    with pytest.raises(DMutexError) as refused:
        mutex.acquire("k")
    fix = _fix(str(refused.value))
    assert fix == (
        f"ALTER TABLE `{table}` "
        "MODIFY `value` varchar(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL"
    )
    fetch(raw, fix)
    assert mutex.acquire("k") is not None
    assert set(permits(raw, table)) == {"permit:0:k"}


@pytest.mark.parametrize(
    ("ddl", "refusal"),
    [
        pytest.param(
            "CREATE TABLE {table} (`key` varchar(512) CHARACTER SET latin1 NOT NULL PRIMARY KEY,"
            " `value` varchar(128) NOT NULL, `expired_at` bigint NOT NULL,"
            " INDEX `expired_at_idx` (`expired_at`)) ENGINE=MyISAM",
            "the table `{table}` uses the MyISAM engine: dmutex needs InnoDB",
            id="myisam",
        ),
        pytest.param(
            "CREATE VIEW {table} AS SELECT 'k' AS `key`, 'v' AS `value`, 0 AS `expired_at`",
            "`{table}` is not a table (VIEW): dmutex needs one",
            id="view",
        ),
        pytest.param(
            "CREATE TABLE {table} (`key` varchar(512) NOT NULL PRIMARY KEY,"
            " `value` varchar(128) NOT NULL, `expired_at` int NOT NULL,"
            " INDEX `expired_at_idx` (`expired_at`)) ENGINE=InnoDB COLLATE utf8mb4_nopad_bin",
            "has another shape than dmutex's: columns (('key', 'varchar(512)', 'NO'), "
            "('value', 'varchar(128)', 'NO'), ('expired_at', 'int(11)', 'NO'))",
            id="int-expiry",
        ),
        pytest.param(
            "CREATE TABLE {table} (`key` varchar(512) NOT NULL PRIMARY KEY,"
            " `value` varchar(64) NULL, `expired_at` bigint NOT NULL,"
            " INDEX `expired_at_idx` (`expired_at`)) ENGINE=InnoDB COLLATE utf8mb4_nopad_bin",
            "('value', 'varchar(64)', 'YES')",
            id="short-nullable-value",
        ),
        pytest.param(
            "CREATE TABLE {table} (`key` varchar(512) NOT NULL,"
            " `value` varchar(128) NOT NULL, `expired_at` bigint NOT NULL,"
            " INDEX `expired_at_idx` (`expired_at`)) ENGINE=InnoDB COLLATE utf8mb4_nopad_bin",
            "primary key [], index expired_at_idx present",
            id="no-primary-key",
        ),
        pytest.param(
            "CREATE TABLE {table} (`key` varchar(512) NOT NULL PRIMARY KEY,"
            " `value` varchar(128) NOT NULL, `expired_at` bigint NOT NULL)"
            " ENGINE=InnoDB COLLATE utf8mb4_nopad_bin",
            "primary key ['key'], index expired_at_idx missing",
            id="no-index",
        ),
    ],
)
def test_ready_refuses_another_engine_relation_or_shape_and_writes_nothing(
    conn: Counting, raw: _Connection, table: str, ddl: str, refusal: str
) -> None:
    fetch(raw, ddl.format(table=quoted(table)))
    before = tables(raw)
    for face in (
        DMutex("svc", client(conn), table_name=table),
        DSemaphore("svc", client(conn), max_permits=2, table_name=table),
    ):
        with pytest.raises(DMutexError) as refused:
            face.acquire("k")
        assert refusal.format(table=table) in str(refused.value)
        assert conn.taken() == ["SELECT"], "the shape read, nothing written"
    assert tables(raw) == before, "nothing created"
    assert fetch(raw, f"SELECT COUNT(*) FROM {quoted(table)}") == [
        (0,) if "VIEW" not in ddl else (1,)
    ]


# --- users with fewer privileges ------------------------------------------------------------


@dataclass
class Users:
    """Users made on the server for one test, with the grants asked; all dropped after."""

    server: Server
    raw: _Connection
    made: list[str]

    def make(self, *grants: str) -> _Connection:
        """A new user with ``grants`` (``"SELECT ON db.t"``), and a connection of it."""
        name, password = f"dmutex_u_{secrets.token_hex(4)}", secrets.token_hex(8)
        try:
            fetch(self.raw, f"CREATE USER '{name}'@'%%' IDENTIFIED BY '{password}'")
        except pymysql.err.OperationalError as error:
            pytest.skip(f"the tests' user may not create users: {error}")
        self.made.append(name)
        for grant in grants:
            fetch(self.raw, f"GRANT {grant} TO '{name}'@'%%'")
        args = connect_args(self.server.url)
        return pymysql.connect(
            host=args["host"],
            port=args["port"],
            user=name,
            password=password,
            database=self.server.database,
            autocommit=True,
        )


@pytest.fixture
def users(server: Server, raw: _Connection) -> Iterator[Users]:
    made = Users(server, raw, [])
    try:
        yield made
    finally:
        for name in made.made:
            fetch(raw, f"DROP USER IF EXISTS '{name}'@'%%'")


def test_a_user_with_row_privileges_on_an_existing_table_needs_no_more(
    server: Server, raw: _Connection, table: str, users: Users
) -> None:
    DMutex("svc", client(raw), table_name=table).ready()
    named = f"{quoted(server.database)}.{quoted(table)}"
    conn = users.make(f"SELECT, INSERT, UPDATE, DELETE ON {named}")
    try:
        mutex = DMutex("svc", client(conn), table_name=table, fencing=True)
        lock = mutex.acquire("k")
        assert lock is not None
        assert mutex.acquire("k") is None
        assert lock.extend(60) is True
        sem = DSemaphore("svc", client(conn), max_permits=2, table_name=table)
        permit = sem.acquire("s")
        assert permit is not None
        assert rows(raw, table)[f"permit:{permit.slot}:s"][0] == permit.token
        assert lock.release() is True
        assert permit.release() is True
    finally:
        conn.close()
    assert set(rows(raw, table)) == {"fence:k", "fence:s"}, "the counters; no slot left"


def test_a_user_who_may_only_read_gets_the_servers_refusal_and_writes_nothing(
    server: Server, raw: _Connection, table: str, users: Users
) -> None:
    DMutex("svc", client(raw), table_name=table).ready()
    conn = users.make(f"SELECT ON {quoted(server.database)}.{quoted(table)}")
    try:
        mutex = DMutex("svc", client(conn), table_name=table)
        mutex.ready()  # reading the table's shape is allowed
        with pytest.raises(pymysql.err.OperationalError) as refused:
            mutex.acquire("k")
        assert refused.value.args[0] == 1142, refused.value
        assert "INSERT, UPDATE command denied" in str(refused.value)
        sem = DSemaphore("svc", client(conn), max_permits=2, table_name=table)
        with pytest.raises(pymysql.err.OperationalError, match="INSERT, UPDATE command denied"):
            sem.acquire("s")
    finally:
        conn.close()
    assert rows(raw, table) == {}


def test_a_user_without_create_gets_a_clear_error_for_a_missing_table(
    server: Server, raw: _Connection, table: str, users: Users
) -> None:
    conn = users.make(f"SELECT, INSERT, UPDATE, DELETE ON {quoted(server.database)}.*")
    try:
        with pytest.raises(pymysql.err.OperationalError) as refused:
            DMutex("svc", client(conn), table_name=table).acquire("k")
        assert refused.value.args[0] == 1142, refused.value
        assert "CREATE command denied" in str(refused.value)
        assert f"table `{server.database}`.`{table}`" in str(refused.value)
    finally:
        conn.close()
    assert table not in tables(raw), "nothing created"


# --- the lost-reply rule and stale tokens ------------------------------------------------


@pytest.mark.parametrize("permits", [1, 3])
def test_an_acquire_sent_again_with_its_token_answers_the_same_slot(
    conn: Counting, raw: _Connection, table: str, permits: int
) -> None:
    store = MySQLStore(conn, table, permits, SYSTEM_CLOCK, asynchronous=False, fencing=True)
    drive = store_driver(store)
    # Another holder: of another slot of the key, or (a mutex) of another key.
    other = drive(store.acquire("k" if permits > 1 else "o", str(uuid.uuid4()), 60_000))
    assert other is not None
    token = str(uuid.uuid4())
    first = drive(store.acquire("k", token, 30_000))
    assert first is not None
    # Its reply was lost: the same acquire, sent again a while later with a longer TTL.
    fetch(
        raw,
        f"UPDATE {quoted(table)} SET `expired_at` = `expired_at` - 5000 WHERE `value` = %s",
        (token,),
    )
    conn.taken()
    copy = drive(store.acquire("k", token, 60_000))
    sent = conn.taken()
    assert copy is not None
    assert copy.slot == first.slot
    assert copy.expires_ms >= first.expires_ms + 30_000, "its expiry moved on"
    assert first.fence is not None
    assert copy.fence is not None
    assert copy.fence > first.fence
    held = {key: value for key, (value, _) in rows(raw, table).items() if value == token}
    assert held == {f"permit:{first.slot}:k": token}, "one slot, never a second"
    assert rows(raw, table)[f"permit:{other.slot}:{other.key}"][0] == other.token
    expected = ["INSERT"] if permits == 1 else ["SELECT", "INSERT"]
    assert sent == expected, "the copy found its own slot, the fence advanced with it"


def test_the_take_statement_run_twice_with_one_token_grants_one_slot(
    conn: Counting, raw: _Connection, table: str
) -> None:
    store = MySQLStore(conn, table, 4, SYSTEM_CLOCK, asynchronous=False)
    store_driver(store)
    run = runner(conn, asynchronous=False)
    token = str(uuid.uuid4())
    params = {"row": "permit:2:k", "token": token, "ttl": 10_000}
    answers = [cast(Outcome, run(store.statements.take, params)).answer for _ in range(2)]
    grants = [granted(answer) for answer in answers]
    assert grants[0] is not None
    assert grants[1] is not None
    assert grants[1] >= grants[0]
    assert rows(raw, table) == {"permit:2:k": (token, grants[1])}
    refusal = cast(
        Outcome, run(store.statements.take, {**params, "token": str(uuid.uuid4())})
    ).answer
    assert granted(refusal) is None, "another token is refused"
    assert rows(raw, table) == {"permit:2:k": (token, grants[1])}


def test_a_stale_token_after_takeover_releases_and_extends_nothing(
    conn: Counting, raw: _Connection, table: str
) -> None:
    mutex = DMutex("svc", client(conn), table_name=table)
    sem = DSemaphore("svc", client(conn), max_permits=2, table_name=table)
    stale = mutex.acquire("m", ttl=30)
    stale_permit = sem.acquire("s", ttl=30)
    assert stale is not None
    assert stale_permit is not None
    expire(raw, table, "permit:0:m")
    expire(raw, table, f"permit:{stale_permit.slot}:s")
    assert stale.release() is False, "ended by the server's clock: not its to release"
    successor = mutex.acquire("m", ttl=30)
    other = sem.acquire("s", ttl=30)
    taker = sem.acquire("s", ttl=30)
    assert successor is not None
    assert other is not None
    assert taker is not None
    assert stale_permit.slot in (other.slot, taker.slot), "the expired slot was taken over"
    before = rows(raw, table)
    assert before["permit:0:m"][0] == successor.token
    conn.taken()
    assert stale.extend(60) is False
    assert stale.release() is False
    assert stale_permit.extend(60) is False
    assert stale_permit.release() is False
    assert sem.extend("s", stale_permit.token, 60) is False, "by token, over the key's slots"
    assert sem.release("s", stale_permit.token) is False
    assert conn.taken() == ["UPDATE", "DELETE", "UPDATE", "DELETE", "UPDATE", "DELETE"]
    assert rows(raw, table) == before, "the successors' rows untouched"


# --- transactions ---------------------------------------------------------------------------


def test_a_connection_inside_the_callers_transaction_is_refused_and_writes_nothing(
    server: Server, raw: _Connection, table: str
) -> None:
    conn = counting(server, autocommit=False)
    try:
        mutex = DMutex("svc", client(conn), table_name=table)
        sem = DSemaphore("svc", client(conn), max_permits=2, table_name=table)
        mutex.ready()
        sem.ready()
        for begin in ("explicit", "implicit"):
            if begin == "explicit":
                conn.begin()
            else:  # autocommit off: the caller's own write opened one
                fetch(conn, f"DELETE FROM {quoted(table)} WHERE `key` = 'nothing'")
            conn.taken()
            attempts = (
                lambda: mutex.acquire("k"),
                lambda: sem.acquire("s"),
                lambda: sem.release("s", str(uuid.uuid4())),
                lambda: sem.extend("s", str(uuid.uuid4()), 30),
            )
            for attempt in attempts:
                with pytest.raises(DMutexError, match="inside a transaction: a lease written"):
                    attempt()
            assert conn.taken() == [], f"{begin}: refused before any statement"
            assert rows(raw, table) == {}
            conn.rollback()
        lock = mutex.acquire("k")
        assert lock is not None, "once the caller's transaction ended"
        assert rows(raw, table)["permit:0:k"][0] == lock.token, "committed: seen by others"
    finally:
        conn.close()


def test_mysqlclient_outside_autocommit_is_refused(
    server: Server, raw: _Connection, table: str
) -> None:
    args = connect_args(server.url)
    for autocommit in (False, True):
        opened = MySQLdb.connect(
            host=args["host"],
            port=args["port"],
            user=args["user"],
            password=args["password"],
            database=server.database,
            charset="utf8mb4",
            autocommit=autocommit,
        )
        with contextlib.closing(opened) as conn:
            mutex = DMutex("svc", conn, table_name=table)
            if not autocommit:
                with pytest.raises(UnsupportedClientError, match="is not in autocommit"):
                    mutex.acquire("k")
                assert table not in tables(raw), "refused before ready() created anything"
                continue
            lock = mutex.acquire("k")
            assert lock is not None, "in autocommit it is taken"
            assert lock.release() is True


def test_a_semaphore_outside_autocommit_sees_a_release_by_another_connection(
    server: Server, raw: _Connection, table: str
) -> None:
    conn = counting(server, autocommit=False)
    try:
        mine = DSemaphore("svc", client(conn), max_permits=2, table_name=table)
        theirs = DSemaphore("svc", client(raw), max_permits=2, table_name=table)
        held = [theirs.acquire("s"), theirs.acquire("s")]
        assert mine.acquire("s") is None, "full"
        first = held[0]
        assert first is not None
        assert first.release() is True
        assert permits(raw, table).keys() == {f"permit:{1 - first.slot}:s"}
        assert mine.acquire("s") is not None, "a slot is free: the release is committed"
    finally:
        conn.close()


# --- a row lock held elsewhere, and deadlocks ---------------------------------------------


def test_a_row_lock_held_elsewhere_surfaces_the_lock_wait_timeout_then_works(
    server: Server, conn: Counting, raw: _Connection, table: str
) -> None:
    holder = DMutex("svc", client(raw), table_name=table)
    held = holder.acquire("k", ttl=60)
    assert held is not None
    fetch(conn, "SET SESSION innodb_lock_wait_timeout = 1")
    mutex = DMutex("svc", client(conn), table_name=table)
    mutex.ready()
    before = permits(raw, table)
    blocker = server.connect(autocommit=False)
    try:
        fetch(blocker, f"SELECT * FROM {quoted(table)} WHERE `key` = 'permit:0:k' FOR UPDATE")
        conn.taken()
        started = time.monotonic()
        with pytest.raises(pymysql.err.OperationalError) as timed_out:
            mutex.acquire("k")
        waited = time.monotonic() - started
        assert timed_out.value.args[0] == 1205, timed_out.value
        assert "Lock wait timeout exceeded" in str(timed_out.value)
        assert waited >= 1.0, "it waited for the lock, then gave up"
        sent = conn.taken()
        assert sent[0] == "INSERT", "the take"
        assert set(sent[1:]) <= {"DELETE"}, "then at most its clean-up release (engine rule 6)"
        assert in_transaction(conn) == 0
        blocker.commit()
    finally:
        blocker.close()
    assert permits(raw, table) == before, "nothing changed, nothing orphaned"
    assert mutex.acquire("k") is None, "works again: refused, the holder holds it"
    assert held.release() is True
    lock = mutex.acquire("k")
    assert lock is not None
    assert permits(raw, table) == {"permit:0:k": (lock.token, ms_of(lock))}


class FakeServerError(Exception):
    """A driver's error: the server's number first, as PyMySQL's and mysqlclient's are."""


@dataclass
class FakeScript:
    """What the fake server answers: a deadlock (or another error) so many times, then OK."""

    failures: int
    code: int = 1213
    sent: int = 0
    rolled_back: int = 0
    committed: int = 0
    autocommit: bool = True


class FakeCursor:
    description = None
    rowcount = 1
    lastrowid = 7

    def __init__(self, script: FakeScript, owner: FakeConnection) -> None:
        self.script, self.owner = script, owner

    def execute(self, text: str, params: Mapping[str, object] | None) -> int:
        self.script.sent += 1
        if not self.script.autocommit:
            self.owner.server_status = 1  # SERVER_STATUS_IN_TRANS: the statement opened one
        if self.script.sent <= self.script.failures:
            raise FakeServerError(self.script.code, "Deadlock found when trying to get lock")
        return 1

    def close(self) -> None:
        pass


class FakeConnection:
    """A DB-API connection shaped like PyMySQL's: no server, a script."""

    def __init__(self, script: FakeScript) -> None:
        self.script = script
        self.server_status = 2 if script.autocommit else 0  # SERVER_STATUS_AUTOCOMMIT

    def cursor(self) -> FakeCursor:
        return FakeCursor(self.script, self)

    def get_server_info(self) -> str:
        return "10.11.0-MariaDB"

    def commit(self) -> None:
        self.script.committed += 1
        self.server_status = 0

    def rollback(self) -> None:
        self.script.rolled_back += 1
        self.server_status = 0


class FakeAsyncCursor(FakeCursor):
    async def execute(self, text: str, params: Mapping[str, object] | None) -> int:  # type: ignore[override]
        return FakeCursor.execute(self, text, params)

    async def close(self) -> None:  # type: ignore[override]
        pass


class FakeAsyncConnection(FakeConnection):
    """The asyncio twin (asyncmy's shape: ``cursor()`` answers the cursor itself)."""

    def cursor(self) -> FakeAsyncCursor:
        return FakeAsyncCursor(self.script, self)

    async def commit(self) -> None:  # type: ignore[override]
        FakeConnection.commit(self)

    async def rollback(self) -> None:  # type: ignore[override]
        FakeConnection.rollback(self)


STATEMENT = Statement("INSERT INTO t VALUES (%(row)s)")


def run_fake(script: FakeScript, asynchronous: bool) -> Outcome:
    if asynchronous:
        run = runner(FakeAsyncConnection(script), asynchronous=True)
        return asyncio.run(cast("Coroutine[Any, Any, Outcome]", run(STATEMENT, {"row": "r"})))
    return cast(
        Outcome, runner(FakeConnection(script), asynchronous=False)(STATEMENT, {"row": "r"})
    )


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "asyncio"])
@pytest.mark.parametrize("autocommit", [True, False], ids=["autocommit", "transactions"])
def test_a_deadlock_victim_is_sent_again_at_most_deadlock_tries_times(
    asynchronous: bool, autocommit: bool
) -> None:
    assert DEADLOCK_TRIES == 3
    once = FakeScript(failures=1, autocommit=autocommit)
    assert run_fake(once, asynchronous) == Outcome([], 1, 7)
    assert once.sent == 2, "sent again after the deadlock"
    assert (once.rolled_back, once.committed) == ((0, 0) if autocommit else (1, 1))

    twice = FakeScript(failures=DEADLOCK_TRIES - 1, autocommit=autocommit)
    assert run_fake(twice, asynchronous).answer == 7
    assert twice.sent == DEADLOCK_TRIES

    always = FakeScript(failures=100, autocommit=autocommit)
    with pytest.raises(FakeServerError) as deadlocked:
        run_fake(always, asynchronous)
    assert deadlocked.value.args[0] == 1213
    assert always.sent == DEADLOCK_TRIES, "then the deadlock reaches the caller"
    assert always.committed == 0

    timeout = FakeScript(failures=1, code=1205, autocommit=autocommit)
    with pytest.raises(FakeServerError):
        run_fake(timeout, asynchronous)
    assert timeout.sent == 1, "any other error is not sent again"
    assert timeout.rolled_back == (0 if autocommit else 1)


# --- a dropped connection, a restarted server -----------------------------------------------

# What PyMySQL raises on a connection the server ended: the server's "killed"
# (MariaDB tells an idle connection), or the client's "lost" / "gone away".
DROPPED = (1927, 2006, 2013)
DRIVER_ERRORS = (pymysql.err.Error, sqlalchemy.exc.DBAPIError)


def engine_url(url: str, database: str) -> str:
    """A SQLAlchemy URL on PyMySQL for ``url``'s server and ``database``."""
    args = connect_args(url)
    auth = args["user"] + (f":{args['password']}" if args["password"] else "")
    return f"mysql+pymysql://{auth}@{args['host']}:{args['port']}/{database}?charset=utf8mb4"


def pooled_thread_id(engine: sqlalchemy.Engine) -> int:
    """The server's id of the connection the engine's pool lends next (a pool of one)."""
    lent = engine.raw_connection()
    try:
        driver = lent.driver_connection
        assert isinstance(driver, Connection)
        return thread_id(driver)
    finally:
        lent.close()


def test_a_killed_connection_raises_and_the_lease_is_released_by_token_elsewhere(
    server: Server, conn: Counting, raw: _Connection, table: str
) -> None:
    mutex = DMutex("svc", client(conn), table_name=table)
    lock = mutex.acquire("k", ttl=60)
    assert lock is not None
    fetch(raw, f"KILL {thread_id(conn)}")
    with pytest.raises(pymysql.err.OperationalError) as dropped:
        mutex.acquire("other")
    assert dropped.value.args[0] in DROPPED, dropped.value
    # The connection stays closed (PyMySQL does not reconnect by itself), and
    # says little more: InterfaceError(0, ''), passed through as raised.
    with pytest.raises(pymysql.err.InterfaceError):
        lock.extend(60)
    assert permits(raw, table) == {"permit:0:k": (lock.token, ms_of(lock))}, "the lease is intact"
    fresh = server.connect()
    try:
        by_token = DSemaphore(
            "svc", client(fresh), max_permits=1, table_name=table
        )  # a mutex's rows
        assert by_token.release("k", lock.token) is True
        assert by_token.release("k", lock.token) is False
    finally:
        fresh.close()
    assert permits(raw, table) == {}


def test_a_pool_recovers_from_a_killed_connection_on_the_next_call(
    server: Server, raw: _Connection, table: str
) -> None:
    engine = sqlalchemy.create_engine(
        engine_url(server.url, server.database), pool_size=1, max_overflow=0
    )
    try:
        mutex = DMutex("svc", engine, table_name=table)
        lock = mutex.acquire("k", ttl=60)
        assert lock is not None
        killed = pooled_thread_id(engine)
        fetch(raw, f"KILL {killed}")
        with pytest.raises(pymysql.err.OperationalError) as dropped:
            mutex.acquire("other")  # the pool lends the dead connection once
        assert dropped.value.args[0] in DROPPED, dropped.value
        other = mutex.acquire("other")
        assert other is not None, "the next call gets a new connection"
        assert pooled_thread_id(engine) != killed
        assert permits(raw, table)["permit:0:k"] == (lock.token, ms_of(lock)), "held across"
        assert lock.release() is True
        assert other.release() is True
    finally:
        engine.dispose()
    assert permits(raw, table) == {}


def test_a_lease_survives_a_restart_and_a_pool_releases_it_after(
    mysql_session: Session,
) -> None:
    restartable = mysql_session.restartable()
    engine = sqlalchemy.create_engine(
        engine_url(restartable.url, restartable.database), pool_size=2, pool_pre_ping=True
    )
    try:
        mutex = DMutex("svc", engine)
        lock = mutex.acquire("k", ttl=120)
        assert lock is not None
        stored = {"permit:0:k": (lock.token, ms_of(lock))}
        restartable.restart()  # a clean shutdown
        with restartable.connect() as look:
            assert permits(look, "_dmutex_svc") == stored, "the row survived (InnoDB)"
        restartable.kill()  # and a crash: InnoDB recovers what was committed
        restartable.start()
        with restartable.connect() as look:
            assert permits(look, "_dmutex_svc") == stored
        assert mutex.acquire("k") is None, "still held"
        assert lock.release() is True, "released through the pool, on a new connection"
        with restartable.connect() as look:
            assert permits(look, "_dmutex_svc") == {}
    finally:
        engine.dispose()


@dataclass
class Waiting:
    """A waiter thread's record: the errors it retried through, and what it got when."""

    errors: list[BaseException]
    lock: DMutexLock | None = None
    got_at: float = 0.0

    def got(self) -> DMutexLock | None:
        return self.lock


def test_a_waiter_retrying_across_a_restart_gets_the_lock_after_its_release(
    mysql_session: Session,
) -> None:
    restartable = mysql_session.restartable()
    url = engine_url(restartable.url, restartable.database)
    holder_engine = sqlalchemy.create_engine(url, pool_size=1, pool_pre_ping=True)
    waiter_engine = sqlalchemy.create_engine(url, pool_size=1, pool_pre_ping=True)
    waiting = Waiting([])
    stop = threading.Event()

    def wait() -> None:
        mutex = DMutex("svc", waiter_engine)
        while not stop.is_set():
            try:
                waiting.lock = mutex.acquire_with_retry("k", ttl=60, timeout=15, retry_delay=0.05)
            except DRIVER_ERRORS as error:  # the server is down: the caller retries
                waiting.errors.append(error)
                time.sleep(0.05)
                continue
            waiting.got_at = time.monotonic()
            return

    waiter = threading.Thread(target=wait, daemon=True)
    try:
        holder = DMutex("svc", holder_engine)
        lock = holder.acquire("k", ttl=60)
        assert lock is not None
        waiter.start()
        time.sleep(0.2)  # a few refused attempts
        restartable.stop()
        deadline = time.monotonic() + 10
        while not waiting.errors and time.monotonic() < deadline:
            time.sleep(0.02)
        assert waiting.errors, "the waiter tried while the server was down"
        restartable.start()
        time.sleep(0.3)  # attempts on the restarted server, refused: the lease survived
        assert waiting.got() is None
        released_at = time.monotonic()
        assert lock.release() is True
        waiter.join(10)
        assert not waiter.is_alive()
        got = waiting.got()
        assert got is not None
        assert waiting.got_at >= released_at
        with restartable.connect() as look:
            assert permits(look, "_dmutex_svc") == {"permit:0:k": (got.token, ms_of(got))}
        assert got.release() is True
    finally:
        stop.set()
        waiter.join(10)
        holder_engine.dispose()
        waiter_engine.dispose()

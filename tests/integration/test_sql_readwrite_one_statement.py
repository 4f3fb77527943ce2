"""Read-write locks in one statement per change (``rwcas.py``, rule 8), on PostgreSQL and MySQL.

Each test drives a ``PostgresReadWriteStore`` or a ``MySQLReadWriteStore``
itself (``SyncDriver``) on a connection that records what it sends (psycopg:
each ``execute``; PyMySQL: each query, and the server's ``Questions``
status), with another connection to look at the row and another store's
changes behind its back. Leases are 30 s unless a test says otherwise.

- An uncontended cycle (a grant and its release) on a key the store has
  seen is two statements, each the stamped write alone; the first grant on
  a key is the read and the write.
- A stale memory (another store changed the row): the stamped write does
  not apply, and the change is still right, at the cost of one statement
  (PostgreSQL's stamped write reads the row it did not change; MySQL
  reads again).
- The guard: a remembered clock ahead of the server's (a prune that would
  drop a hold the server still counts) and one far behind it (a hold the
  server has let expire that the memory still counts) make the stamped
  write change nothing, and the read decides.
- The expiry and fence written are the server's: the row's text, the
  lease the store answers and what the store remembers agree, and the
  expiry is the write's time plus the TTL even with a remembered clock
  behind the server's.
- A re-sent grant with the same token (``_core.readwrite``, rule 4) finds
  its own hold: a new expiry and fence, one hold; a stamped write whose
  reply is lost makes the store forget the key, and the re-sent attempt
  reads.
- Renewals: the leases of keys the store remembers are one statement on
  PostgreSQL (``rwcas.py``, rule 9), two on MySQL (the update, then the
  read of which rows it wrote; the update alone where it wrote none), also
  by the server's ``Questions``; a lease whose row changed behind the
  store's back goes rule 1's way, an ended one gets no request. Each row
  of MySQL's batch applies on its own old text and window, and is stamped
  with the statement's time. MySQL splits a call of more than
  ``RENEW_BATCH`` leases into batches. asyncpg runs the same statements as
  psycopg.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Protocol
from urllib.parse import quote

import asyncpg
import psycopg
import pytest
from pymysql.connections import Connection
from pymysql.cursors import Cursor

from dmutex._backends.dynamodb.readwrite import DynamoReadWriteStore
from dmutex._backends.mysql import readwrite as readwrite_module
from dmutex._backends.mysql.readwrite import MySQLReadWriteStore
from dmutex._backends.postgresql.readwrite import PostgresReadWriteStore
from dmutex._backends.rwcas import STAMP_EXPIRY, CasReadWriteStore
from dmutex._clock import SystemClock
from dmutex._core.effects import Steps
from dmutex._core.lease import Lease
from dmutex._core.readwrite import READ_SLOT, WRITE_SLOT
from dmutex._runtime.drivers import AsyncDriver, SyncDriver
from tests._support.mysql_rows import Counting, fetch, quoted
from tests._support.mysql_servers import (
    CONNECT_TIMEOUT,
    Session,
    connect_args,
    without_tls,
)

KEY = "orders"
ROW = f"rwlock:{KEY}"
TTL_MS = 30_000
SERVERS = ["postgresql", "mysql"]

PgConnection = psycopg.Connection[tuple[Any, ...]]


class Recording(psycopg.Connection[tuple[Any, ...]]):
    """A psycopg connection that records each statement it executes (one round trip each)."""

    sent: list[str]

    def execute(self, *args: Any, **kwargs: Any) -> psycopg.Cursor[tuple[Any, ...]]:
        self.sent.append(str(args[0] if args else kwargs["query"]))
        cursor: psycopg.Cursor[tuple[Any, ...]] = super().execute(*args, **kwargs)
        return cursor


def kind(text: str) -> str:
    """A statement as this file names it: ``stamped`` (rule 8), ``read`` or ``write``."""
    if STAMP_EXPIRY in text:
        return "stamped"
    return "read" if text.split(None, 1)[0].upper() == "SELECT" else "write"


class Rig(Protocol):
    """A server's stores on a recording connection, and another connection to look."""

    name: str

    def store(self, *, counted: bool = True) -> CasReadWriteStore:
        """A new store of the test's table: on the recording connection, or on another."""
        ...

    def taken(self) -> list[str]:
        """What the recording connection sent since the last call, each as :func:`kind` names it."""
        ...

    def value(self, key: str = KEY) -> str:
        """The row ``rwlock:{key}``'s value."""
        ...

    def now_us(self) -> int:
        """The server's clock in µs."""
        ...


class PostgresRig:
    name = "postgresql"

    def __init__(self, url: str) -> None:
        self.table = f"_drwlock_rw{uuid.uuid4().hex[:12]}"
        self.counted = Recording.connect(url, autocommit=True)
        self.counted.sent = []
        self.raw: PgConnection = psycopg.connect(url, autocommit=True)

    def store(self, *, counted: bool = True) -> CasReadWriteStore:
        conn = self.counted if counted else self.raw
        made = PostgresReadWriteStore(
            conn, self.table, None, SystemClock(), asynchronous=False, listen=False
        )
        prepared(made)
        self.counted.sent.clear()
        return made

    def taken(self) -> list[str]:
        found = [kind(text) for text in self.counted.sent]
        self.counted.sent.clear()
        return found

    def value(self, key: str = KEY) -> str:
        row = self.raw.execute(
            f'SELECT "value" FROM "{self.table}" WHERE "key" = %s', (f"rwlock:{key}",)
        ).fetchone()
        assert row is not None, f"no row rwlock:{key}"
        return str(row[0])

    def now_us(self) -> int:
        row = self.raw.execute(
            "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
        ).fetchone()
        assert row is not None
        return int(row[0])

    def close(self) -> None:
        self.raw.execute(f'DROP TABLE IF EXISTS "{self.table}"')
        self.counted.close()
        self.raw.close()


class MySQLRig:
    name = "mysql"

    def __init__(self, session: Session) -> None:
        server = session.server()
        args = connect_args(server.url)
        args["database"] = server.database
        more: dict[str, Any] = {
            "autocommit": True,
            "connect_timeout": CONNECT_TIMEOUT,
            "ssl_disabled": without_tls(server.url),
        }
        self.table = f"_drwlock_rw{uuid.uuid4().hex[:12]}"
        self.counted = Counting(**args, **more)
        self.raw: Connection[Cursor] = Connection(**args, **more)

    def store(self, *, counted: bool = True) -> CasReadWriteStore:
        conn = self.counted if counted else self.raw
        made = MySQLReadWriteStore(conn, self.table, None, SystemClock(), asynchronous=False)
        prepared(made)
        self.counted.sent.clear()
        return made

    def taken(self) -> list[str]:
        found = [kind(text) for text in self.counted.sent]
        self.counted.sent.clear()
        return found

    def questions(self) -> int:
        """The recording connection's ``Questions`` status (its own ``SHOW`` included)."""
        ((_, count),) = fetch(self.counted, "SHOW SESSION STATUS LIKE 'Questions'")
        self.counted.sent.clear()
        return int(count)

    def value(self, key: str = KEY) -> str:
        ((value,),) = fetch(
            self.raw,
            f"SELECT `value` FROM {quoted(self.table)} WHERE `key` = %s",
            (f"rwlock:{key}",),
        )
        return value.decode() if isinstance(value, bytes) else str(value)

    def now_us(self) -> int:
        ((now,),) = fetch(
            self.raw,
            "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))",
        )
        return int(now)

    def close(self) -> None:
        fetch(self.raw, f"DROP TABLE IF EXISTS {quoted(self.table)}")
        self.counted.close()
        self.raw.close()


@pytest.fixture(params=SERVERS)
def rig(request: pytest.FixtureRequest) -> Iterator[PostgresRig | MySQLRig]:
    made: PostgresRig | MySQLRig
    if request.param == "postgresql":
        server: str = request.getfixturevalue("postgres_server")
        schema: str = request.getfixturevalue("postgres_schema")
        joiner = "&" if "?" in server else "?"
        made = PostgresRig(f"{server}{joiner}options={quote(f'-csearch_path={schema}')}")
    else:
        made = MySQLRig(request.getfixturevalue("mysql_session"))
    try:
        yield made
    finally:
        made.close()


def run(store: CasReadWriteStore, steps: Steps[Any]) -> Any:
    """``steps`` run to their end, on a store the rig has prepared."""
    return SyncDriver(store.clock, store.ready)(steps, prepared=True)


def prepared(store: CasReadWriteStore) -> CasReadWriteStore:
    SyncDriver(store.clock, store.ready).ready()
    return store


def take(
    store: CasReadWriteStore, *, write: bool, token: str | None = None, ttl_ms: int = TTL_MS
) -> Lease:
    lease = run(store, store.acquire(KEY, token or str(uuid.uuid4()), ttl_ms, None, write=write))
    assert isinstance(lease, Lease), "expected a grant"
    return lease


def held(store: CasReadWriteStore) -> list[tuple[int, str, int]]:
    """The active holds as a read finds them: (slot, token, expiry ms)."""
    found = run(store, store.holders(KEY))
    return sorted((h.slot, h.token, h.expires_ms) for h in found.holders)


def shift(store: CasReadWriteStore, key: str, by_us: int) -> None:
    """Move the store's remembered estimate of the server's clock by ``by_us``."""
    text, offset = store._known[key]
    store._known[key] = (text, offset + by_us)


def remembered(store: CasReadWriteStore, key: str = KEY) -> str | None:
    return store._known[key][0]


# --- statements per cycle -----------------------------------------------------------------


@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
def test_a_cycle_is_two_statements(rig: PostgresRig | MySQLRig, write: bool) -> None:
    store = rig.store()
    first = take(store, write=write)
    assert rig.taken() == ["read", "write"], "a key the store has not seen: read, then write"
    assert run(store, store.release(KEY, first.token, first.slot)) is True
    assert rig.taken() == ["stamped"]
    before = rig.questions() if isinstance(rig, MySQLRig) else 0
    cycles = 5
    for _ in range(cycles):
        lease = take(store, write=write)
        assert run(store, store.release(KEY, lease.token, lease.slot)) is True
        assert rig.taken() == ["stamped", "stamped"], "a cycle: two stamped writes"
    if isinstance(rig, MySQLRig):
        # The server's count: the cycles' statements and the second SHOW.
        assert rig.questions() - before == 2 * cycles + 1
    assert held(rig.store(counted=False)) == []


def test_renewals_are_one_statement_each(rig: PostgresRig | MySQLRig) -> None:
    store = rig.store()
    leases = [take(store, write=False) for _ in range(3)]
    for lease in leases:
        lease.ttl_ms = TTL_MS  # what the engine sets on the leases it renews
    rig.taken()
    answers = run(store, store.extend_many(leases))
    assert all(isinstance(answer, int) for answer in answers)
    assert rig.taken() == ["stamped"] * 3
    stored = json.loads(rig.value())
    assert [stored["r"][lease.token] for lease in leases] == answers


def test_renewals_of_remembered_keys_are_one_statement_on_postgresql_two_on_mysql(
    rig: PostgresRig | MySQLRig,
) -> None:
    store, other = rig.store(), rig.store(counted=False)
    keys = ["a", "b", "c", "d"]
    leases = [
        run(store, store.acquire(key, str(uuid.uuid4()), TTL_MS, None, write=key == "a"))
        for key in keys
    ]
    for lease in leases:
        lease.ttl_ms = TTL_MS
    # "c" changed behind the store's back (another reader), "d" released: its lease ended.
    stranger = run(other, other.acquire("c", str(uuid.uuid4()), TTL_MS, None, write=False))
    assert run(store, store.release("d", leases[3].token, leases[3].slot)) is True
    leases[3].ended = True
    rig.taken()
    before = rig.now_us()
    answers = run(store, store.extend_many(leases))
    after = rig.now_us()
    batch = ["stamped"] if rig.name == "postgresql" else ["stamped", "read"]
    assert rig.taken() == [*batch, "read", "write"], "a, b in one batch; c by rule 1"
    assert answers[3] is None
    for key, lease, expires in zip(keys[:3], leases[:3], answers[:3], strict=True):
        assert isinstance(expires, int)
        assert before // 1000 + TTL_MS <= expires <= after // 1000 + TTL_MS
        found = run(other, other.holders(key)).holders
        assert (lease.token, expires) in {(h.token, h.expires_ms) for h in found}
    assert stranger.token in {h.token for h in run(other, other.holders("c")).holders}
    # All three remembered now: one batch carries them all.
    before = rig.questions() if isinstance(rig, MySQLRig) else 0
    rig.taken()
    again = run(store, store.extend_many(leases[:3]))
    assert rig.taken() == batch
    if isinstance(rig, MySQLRig):
        # The server's count: the batch's statements and the second SHOW.
        assert rig.questions() - before == len(batch) + 1
    for key, lease, expires in zip(keys[:3], leases[:3], again, strict=True):
        found = run(other, other.holders(key)).holders
        assert (lease.token, expires) in {(h.token, h.expires_ms) for h in found}
        assert remembered(store, key) == rig.value(key)


def test_each_row_of_a_batch_applies_on_its_own_terms_at_the_statements_time(
    rig: PostgresRig | MySQLRig,
) -> None:
    """a: applies, stamped by the server; b: changed behind the store's back; c: expired
    by the server's clock though the memory, behind it, counts it live; d: a memory
    ahead of the server's clock, which prunes a hold the server still counts (a reader
    of 5 s). None but a is written by the batch."""
    store, other = rig.store(), rig.store(counted=False)
    early = run(store, store.acquire("d", str(uuid.uuid4()), 5_000, None, write=False))
    keys = ["a", "b", "c", "d"]
    leases = [
        run(
            store,
            store.acquire(key, str(uuid.uuid4()), 300 if key == "c" else TTL_MS, None, write=False),
        )
        for key in keys
    ]
    for lease in leases:
        lease.ttl_ms = TTL_MS
    stranger = run(other, other.acquire("b", str(uuid.uuid4()), TTL_MS, None, write=False))
    shift(store, "a", -50_000)  # 50 ms behind: an expiry from it would be early
    shift(store, "c", -10_000_000)  # 10 s behind: c's reader looks live to the memory
    shift(store, "d", 10_000_000)  # 10 s ahead: before its window
    while rig.now_us() // 1000 < leases[2].expires_ms:
        time.sleep(0.05)
    expired = rig.value("c")
    rig.taken()
    before = rig.now_us()
    answers = run(store, store.extend_many(leases))
    after = rig.now_us()
    batch = ["stamped"] if rig.name == "postgresql" else ["stamped", "read"]
    # b and d: rule 1's read and write; c: the read, which finds its reader expired.
    assert rig.taken() == [*batch, "read", "write", "read", "read", "write"]
    assert answers[2] is None
    assert rig.value("c") == expired, "the expired reader was not brought back"
    for n in (0, 1, 3):
        expires = answers[n]
        assert isinstance(expires, int)
        assert before // 1000 + TTL_MS <= expires <= after // 1000 + TTL_MS
        stored = json.loads(rig.value(keys[n]))
        assert stored["r"][leases[n].token] == expires
        assert remembered(store, keys[n]) == rig.value(keys[n])
    assert stranger.token in json.loads(rig.value("b"))["r"], "b's other reader was kept"
    assert json.loads(rig.value("d"))["r"][early.token] == early.expires_ms, (
        "d's live reader was kept"
    )


def test_mysql_splits_a_large_renewal_into_batches(
    mysql_session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = MySQLRig(mysql_session)
    try:
        store = rig.store()
        keys = [f"k{n}" for n in range(8)]
        leases = []
        for key in keys:
            lease = run(store, store.acquire(key, str(uuid.uuid4()), TTL_MS, None, write=True))
            lease.ttl_ms = TTL_MS
            leases.append(lease)
        monkeypatch.setattr(readwrite_module, "RENEW_BATCH", 3)
        rig.taken()
        answers = run(store, store.extend_many(leases))
        # 3 + 3 + 2: each part its own batch, the update and the read.
        assert rig.taken() == ["stamped", "read"] * 3
        for key, lease, expires in zip(keys, leases, answers, strict=True):
            assert isinstance(expires, int)
            assert json.loads(rig.value(key))["w"] == [lease.token, expires]
        # The texts' bound: each part as many leases as fit (here two).
        monkeypatch.setattr(readwrite_module, "RENEW_BATCH", 100)
        longest = max(len(remembered(store, key) or "") for key in keys)
        monkeypatch.setattr(readwrite_module, "RENEW_TEXT", 2 * longest)
        answers = run(store, store.extend_many(leases))
        assert rig.taken() == ["stamped", "read"] * 4
        assert all(isinstance(expires, int) for expires in answers)
    finally:
        rig.close()


def test_a_batch_that_writes_no_row_is_one_statement(rig: PostgresRig | MySQLRig) -> None:
    store, other = rig.store(), rig.store(counted=False)
    leases = []
    for key in ("a", "b"):
        lease = run(store, store.acquire(key, str(uuid.uuid4()), TTL_MS, None, write=False))
        lease.ttl_ms = TTL_MS
        leases.append(lease)
        run(other, other.acquire(key, str(uuid.uuid4()), TTL_MS, None, write=False))
    rig.taken()
    answers = run(store, store.extend_many(leases))
    assert rig.taken() == ["stamped", "read", "write", "read", "write"]
    for lease, expires in zip(leases, answers, strict=True):
        assert json.loads(rig.value(lease.key))["r"][lease.token] == expires


# --- a stale memory -----------------------------------------------------------------------


def test_a_stale_memory_costs_one_statement_and_changes_nothing_wrongly(
    rig: PostgresRig | MySQLRig,
) -> None:
    mine, other = rig.store(), rig.store(counted=False)
    first = take(mine, write=False)
    second = take(other, write=False)  # the row changes behind the first store's back
    rig.taken()
    third = take(mine, write=False)
    fallback = ["stamped", "write"] if rig.name == "postgresql" else ["stamped", "read", "write"]
    assert rig.taken() == fallback, "the stamped write, then rule 1's way"
    assert [token for _, token, _ in held(other)] == sorted(
        [first.token, second.token, third.token]
    ), "the other store's reader was kept"
    assert remembered(mine) == rig.value()
    assert run(mine, mine.release(KEY, third.token, third.slot)) is True
    assert rig.taken() == ["stamped"], "remembered again"
    # A writer of the other store: the first store's stale memory must not let its
    # reader in, nor a release of its own reader miss the change.
    assert run(other, other.release(KEY, second.token, second.slot)) is True
    assert run(mine, mine.release(KEY, first.token, first.slot)) is True
    writer = take(other, write=True)
    rig.taken()
    assert run(mine, mine.acquire(KEY, str(uuid.uuid4()), TTL_MS, None, write=False)) is None
    assert rig.taken() == (["stamped"] if rig.name == "postgresql" else ["stamped", "read"]), (
        "the stale memory's grant did not apply; the read refuses"
    )
    assert held(other) == [(WRITE_SLOT, writer.token, writer.expires_ms)]


# --- the guard ----------------------------------------------------------------------------


def test_a_remembered_clock_ahead_of_the_server_drops_no_live_hold(
    rig: PostgresRig | MySQLRig,
) -> None:
    store = rig.store()
    reader = take(store, write=False, ttl_ms=5_000)
    shift(store, KEY, 10_000_000)  # 10 s ahead: the reader looks expired by the memory
    text = rig.value()
    rig.taken()
    assert run(store, store.acquire(KEY, str(uuid.uuid4()), TTL_MS, None, write=True)) is None
    assert rig.taken() == (["stamped"] if rig.name == "postgresql" else ["stamped", "read"])
    assert rig.value() == text, "nothing written"
    assert held(store) == [(READ_SLOT, reader.token, reader.expires_ms)]


def test_a_remembered_clock_behind_the_server_extends_no_expired_hold(
    rig: PostgresRig | MySQLRig,
) -> None:
    store = rig.store()
    reader = take(store, write=False, ttl_ms=300)
    shift(store, KEY, -10_000_000)  # 10 s behind: the reader looks live to the memory
    while rig.now_us() // 1000 < reader.expires_ms:
        time.sleep(0.05)
    text = rig.value()
    rig.taken()
    assert run(store, store.extend(KEY, reader.token, READ_SLOT, TTL_MS)) is None
    assert rig.taken() == (["stamped"] if rig.name == "postgresql" else ["stamped", "read"])
    assert rig.value() == text, "nothing written"
    assert held(store) == []
    assert run(store, store.release(KEY, reader.token, READ_SLOT)) is False


# --- the expiry and the fence are the server's ----------------------------------------------


@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
def test_the_row_the_lease_and_the_memory_agree(rig: PostgresRig | MySQLRig, write: bool) -> None:
    store = rig.store()
    first = take(store, write=write)
    assert run(store, store.release(KEY, first.token, first.slot)) is True
    shift(store, KEY, -50_000)  # 50 ms behind: an expiry from it would be early
    rig.taken()
    before = rig.now_us()
    lease = take(store, write=write)
    after = rig.now_us()
    assert rig.taken() == ["stamped"]
    assert first.fence is not None
    assert lease.fence is not None
    assert before // 1000 + TTL_MS <= lease.expires_ms <= after // 1000 + TTL_MS
    assert max(first.fence + 1, before) <= lease.fence <= max(first.fence + 1, after)
    stored = json.loads(rig.value())
    hold = stored["w"] if write else [lease.token, stored["r"][lease.token]]
    assert hold == [lease.token, lease.expires_ms]
    assert stored["f"] == lease.fence
    assert remembered(store) == rig.value(), "the store remembers the text on the server"
    assert held(rig.store(counted=False)) == [(lease.slot, lease.token, lease.expires_ms)]
    # An extend: the server's time too.
    shift(store, KEY, -50_000)
    before = rig.now_us()
    expires = run(store, store.extend(KEY, lease.token, lease.slot, TTL_MS))
    after = rig.now_us()
    assert rig.taken() == ["stamped"]
    assert before // 1000 + TTL_MS <= expires <= after // 1000 + TTL_MS
    assert held(rig.store(counted=False)) == [(lease.slot, lease.token, expires)]
    assert remembered(store) == rig.value()


# --- a re-sent grant ----------------------------------------------------------------------


@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
def test_a_resent_grant_finds_its_own_hold(rig: PostgresRig | MySQLRig, write: bool) -> None:
    store = rig.store()
    token = str(uuid.uuid4())
    first = take(store, write=write, token=token)
    rig.taken()
    again = take(store, write=write, token=token)
    assert rig.taken() == ["stamped"]
    assert first.fence is not None
    assert again.fence is not None
    assert again.fence > first.fence
    assert again.expires_ms >= first.expires_ms
    assert held(store) == [(again.slot, token, again.expires_ms)], "one hold, its new expiry"
    assert json.loads(rig.value())["f"] == again.fence


def test_a_lost_reply_to_a_stamped_write_makes_the_store_forget(
    rig: PostgresRig | MySQLRig,
) -> None:
    store: Any = rig.store()
    token = str(uuid.uuid4())
    first = take(store, write=True, token=token)
    lose: Callable[..., Any] = store._run

    def lost(*args: Any, **kwargs: Any) -> Any:
        lose(*args, **kwargs)  # the statement ran
        raise ConnectionError("reply lost")

    store._run = lost
    with pytest.raises(ConnectionError):
        take(store, write=True, token=token)
    store._run = lose
    assert KEY not in store._known
    rig.taken()
    again = take(store, write=True, token=token)  # the attempt re-sent
    assert rig.taken() == ["read", "write"], "a forgotten key: rule 1's way"
    assert first.fence is not None
    assert again.fence is not None
    assert again.fence > first.fence
    assert held(store) == [(WRITE_SLOT, token, again.expires_ms)]


def test_dynamodb_is_not_stamped() -> None:
    assert DynamoReadWriteStore.stamped_writes is False
    assert PostgresReadWriteStore.stamped_writes is True
    assert MySQLReadWriteStore.stamped_writes is True


# --- asyncpg ------------------------------------------------------------------------------


def test_asyncpg_runs_the_stamped_statements(postgres_server: str, postgres_schema: str) -> None:
    """The stamped write and the renewals' batch through asyncpg (``$n``, arrays as lists)."""

    async def check() -> None:
        conn = await asyncpg.connect(
            postgres_server, server_settings={"search_path": postgres_schema}
        )
        table = f"_drwlock_rw{uuid.uuid4().hex[:12]}"
        try:
            store = PostgresReadWriteStore(
                conn, table, None, SystemClock(), asynchronous=True, listen=False
            )
            drive = AsyncDriver(store.clock, store.ready)
            # Counted at the store's runner: one call, one statement (asyncpg's query
            # logger reports them late, by call_soon).
            logged: list[str] = []
            run_one = store._run

            def recorded(statement: Any, params: Any) -> Any:
                logged.append(kind(statement.asyncpg))
                return run_one(statement, params)

            store._run = recorded

            async def taken() -> list[str]:
                found = list(logged)
                logged.clear()
                return found

            leases = []
            for key in ("a", "b"):
                lease = await drive(store.acquire(key, str(uuid.uuid4()), TTL_MS, None, write=True))
                assert isinstance(lease, Lease)
                lease.ttl_ms = TTL_MS
                leases.append(lease)
            await taken()
            answers = await drive(store.extend_many(leases))
            assert await taken() == ["stamped"]
            for lease, expires in zip(leases, answers, strict=True):
                assert isinstance(expires, int)
                assert expires >= lease.expires_ms
                assert await drive(store.release(lease.key, lease.token, lease.slot)) is True
            assert await taken() == ["stamped"] * 2
            again = await drive(store.acquire("a", str(uuid.uuid4()), TTL_MS, None, write=False))
            assert isinstance(again, Lease)
            assert await taken() == ["stamped"]
        finally:
            await conn.execute(f'DROP TABLE IF EXISTS "{table}"')
            await conn.close()

    asyncio.run(check())

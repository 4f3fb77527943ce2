"""The TypeScript dmutex's D1 layout on SQLite, and interop with rows its SQL writes.

``TypeScriptD1`` below runs the TypeScript D1 store's statements
(``src/d1-store.ts``) verbatim through a raw ``sqlite3`` connection of its
own, on the same file as the ``SQLiteBackend``: what that store writes,
dmutex must honour, and the reverse. Time is a ManualClock read in whole
milliseconds, as ``Date.now()`` would be; a fence is exactly the larger of
the counter plus one and that clock in microseconds (``dmutex._core.fences``).
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any, TypeVar

import pytest

from dmutex import (
    AsyncDMutex,
    AsyncDSemaphore,
    DMutex,
    DMutexError,
    DSemaphore,
    InvalidArgumentError,
    ManualClock,
    SQLiteBackend,
)
from dmutex._core.fences import clock_us, next_fence
from dmutex._core.lease import now_ms
from tests._support.sqlite_rows import listed, tables

FOREVER = 2**63 - 1
T = TypeVar("T")


def ts_quote(identifier: str) -> str:
    """``quoteIdentifier`` of ``d1-store.ts``."""
    assert identifier
    assert "\0" not in identifier
    return '"' + identifier.replace('"', '""') + '"'


class TypeScriptD1:
    """The TypeScript D1 store's SQL, by raw sqlite3, on one table; ``key`` is the row key."""

    def __init__(self, path: Path, table: str, clock: ManualClock) -> None:
        self.conn = sqlite3.connect(path, timeout=30.0, isolation_level=None)
        self.table = ts_quote(table)
        self.index = ts_quote(f"{table}_expired_at_idx")
        self.clock = clock

    def initialize(self) -> None:
        self.conn.execute(f"""
      CREATE TABLE IF NOT EXISTS {self.table} (
        "key" TEXT PRIMARY KEY,
        "value" TEXT NOT NULL,
        "expired_at" INTEGER NOT NULL
      )
    """)
        self.conn.execute(f"""
      CREATE INDEX IF NOT EXISTS {self.index}
      ON {self.table} ("expired_at")
    """)

    def acquire(self, key: str, token: str, ttl_seconds: float) -> int | None:
        """The new expiry (ms) if ``token`` now holds ``key``, else None."""
        now = now_ms(self.clock)
        expired_at = now + round(ttl_seconds * 1000)
        self.conn.execute(
            f"""
      INSERT INTO {self.table} ("key", "value", "expired_at")
      VALUES (?, ?, ?)
      ON CONFLICT("key") DO UPDATE
      SET
        "value" = excluded."value",
        "expired_at" = excluded."expired_at"
      WHERE "expired_at" <= ?
    """,
            (key, token, expired_at, now),
        )
        row = self.conn.execute(
            f"""
      SELECT "value", "expired_at"
      FROM {self.table}
      WHERE "key" = ?
    """,
            (key,),
        ).fetchone()
        return int(row[1]) if row is not None and row[0] == token else None

    def release(self, key: str, token: str) -> bool:
        cursor = self.conn.execute(
            f"""
      DELETE FROM {self.table}
      WHERE "key" = ? AND "value" = ?
    """,
            (key, token),
        )
        return cursor.rowcount == 1

    def extend(self, key: str, token: str, ttl_seconds: float) -> int | None:
        now = now_ms(self.clock)
        expired_at = now + round(ttl_seconds * 1000)
        cursor = self.conn.execute(
            f"""
      UPDATE {self.table}
      SET "expired_at" = ?
      WHERE "key" = ?
        AND "value" = ?
        AND "expired_at" > ?
    """,
            (expired_at, key, token, now),
        )
        return expired_at if cursor.rowcount == 1 else None


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "locks.sqlite3"


@pytest.fixture
def backend(path: Path) -> Iterator[SQLiteBackend]:
    made = SQLiteBackend(path)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def raw(path: Path, backend: SQLiteBackend) -> Iterator[sqlite3.Connection]:
    """A connection of the test's own to the backend's file."""
    conn = sqlite3.connect(path, timeout=30.0, isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()


@pytest.fixture
def ts(path: Path, clock: ManualClock, backend: SQLiteBackend) -> Iterator[TypeScriptD1]:
    """The TypeScript store of ``DMutex("svc")``'s table, created by the TypeScript DDL."""
    store = TypeScriptD1(path, "_dmutex_svc", clock)
    store.initialize()
    try:
        yield store
    finally:
        store.conn.close()


def schema(conn: sqlite3.Connection, table: str) -> dict[str, object]:
    """What SQLite says of ``table``: its columns, its indexes and their columns."""
    quoted = ts_quote(table)
    indexes = conn.execute(f"PRAGMA index_list({quoted})").fetchall()
    return {
        "columns": conn.execute(f"PRAGMA table_info({quoted})").fetchall(),
        "indexes": sorted(
            (
                name,
                unique,
                origin,
                partial,
                conn.execute(f"PRAGMA index_info({ts_quote(name)})").fetchall(),
            )
            for _, name, unique, origin, partial in indexes
        ),
    }


def held_by(conn: sqlite3.Connection, table: str) -> dict[str, str]:
    return {key: value for key, value, _ in listed(conn, table)}


# --- the table and its index --------------------------------------------------------------


def test_table_and_index_are_those_the_typescript_store_creates(
    path: Path, tmp_path: Path, backend: SQLiteBackend, clock: ManualClock, raw: sqlite3.Connection
) -> None:
    DMutex("orders", backend, clock=clock).ready()
    DSemaphore("orders", backend, max_permits=3, clock=clock).ready()
    assert tables(raw) == ["_dmutex_orders", "_dsemaphore_orders"]
    # The TypeScript DDL, verbatim, in a file of its own.
    other = tmp_path / "typescript.sqlite3"
    for table in ("_dmutex_orders", "_dsemaphore_orders"):
        store = TypeScriptD1(other, table, clock)
        store.initialize()
        try:
            assert schema(raw, table) == schema(store.conn, table)
        finally:
            store.conn.close()
    assert schema(raw, "_dmutex_orders") == {
        "columns": [
            (0, "key", "TEXT", 0, None, 1),
            (1, "value", "TEXT", 1, None, 0),
            (2, "expired_at", "INTEGER", 1, None, 0),
        ],
        "indexes": [
            ("_dmutex_orders_expired_at_idx", 0, "c", 0, [(0, 2, "expired_at")]),
            ("sqlite_autoindex__dmutex_orders_1", 1, "pk", 0, [(0, 0, "key")]),
        ],
    }


def test_rows_hold_slot_token_and_expiry_in_epoch_ms(
    backend: SQLiteBackend, clock: ManualClock, raw: sqlite3.Connection
) -> None:
    sem = DSemaphore("orders", backend, max_permits=3, clock=clock)
    permits = [sem.acquire("api", ttl=12.3451) for _ in range(3)]
    lock = DMutex("orders", backend, clock=clock).acquire("job", ttl=60)
    assert lock is not None
    expires = now_ms(clock) + 12346  # rounded up to a whole millisecond, as on MongoDB
    # The clock stands still: the first grant takes it, each next one the counter plus one.
    start = clock_us(clock)
    assert [p.fence for p in permits if p is not None] == [start, start + 1, start + 2]
    assert lock.fence == start, "another table, another counter"
    assert listed(raw, "_dsemaphore_orders") == sorted(
        [(f"permit:{p.slot}:api", p.token, expires) for p in permits if p is not None]
        + [("fence:api", str(start + 2), FOREVER)]
    )
    assert sorted(p.slot for p in permits if p is not None) == [0, 1, 2]
    assert listed(raw, "_dmutex_orders") == [
        ("fence:job", str(start), FOREVER),
        ("permit:0:job", lock.token, now_ms(clock) + 60_000),
    ]


@pytest.mark.parametrize(
    "service",
    ['we"ird name', 'x"; DROP TABLE "_dmutex_svc"; --', "spaces  and\ttabs", "ünï©ødé"],
)
def test_identifiers_are_quoted(
    service: str, backend: SQLiteBackend, clock: ManualClock, raw: sqlite3.Connection
) -> None:
    DMutex("svc", backend, clock=clock).ready()
    lock = DMutex(service, backend, clock=clock).acquire("job", ttl=60)
    assert lock is not None
    table = f"_dmutex_{service}"
    assert tables(raw) == sorted(["_dmutex_svc", table])
    assert listed(raw, table)[1][:2] == ("permit:0:job", lock.token)
    names = [row[1] for row in raw.execute(f"PRAGMA index_list({ts_quote(table)})").fetchall()]
    assert f"{table}_expired_at_idx" in names
    assert DMutex(service, backend, clock=clock).acquire("job") is None
    assert lock.release() is True


class CountingBackend(SQLiteBackend):
    """An SQLiteBackend that counts the calls made to its file (either face's)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.calls = 0

    def call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        self.calls += 1
        return super().call(fn)


@pytest.mark.parametrize(
    "options",
    [
        {"service_name": "a\0b"},
        {"service_name": "\0"},
        {"service_name": "svc", "table_name": "t\0"},
        {"service_name": "svc", "table_prefix": "\0"},
    ],
    ids=["service", "service-nul-only", "table_name", "table_prefix"],
)
def test_a_nul_in_a_table_name_is_refused_before_any_io(
    options: dict[str, Any], path: Path, clock: ManualClock
) -> None:
    counting = CountingBackend(path)
    try:
        before = path.read_bytes()
        makers: list[Callable[[], object]] = [
            lambda: DMutex(client=counting, clock=clock, **options),
            lambda: DSemaphore(client=counting, max_permits=2, clock=clock, **options),
            lambda: AsyncDMutex(client=counting, clock=clock, **options),
            lambda: AsyncDSemaphore(client=counting, max_permits=2, clock=clock, **options),
        ]
        for make in makers:
            with pytest.raises(InvalidArgumentError, match="NUL"):
                make()
        assert counting.calls == 0
        assert path.read_bytes() == before
        with closing(sqlite3.connect(path, isolation_level=None)) as conn:
            assert tables(conn) == []
    finally:
        counting.close()


def test_table_name_wins_over_table_prefix(
    backend: SQLiteBackend, clock: ManualClock, raw: sqlite3.Connection
) -> None:
    named = DMutex("svc", backend, table_name="locks", table_prefix="p_", clock=clock)
    assert named.acquire("job", ttl=60) is not None
    assert DSemaphore("svc", backend, max_permits=2, table_prefix="p_", clock=clock).acquire("job")
    assert DMutex("other", backend, table_prefix="", clock=clock).acquire("job")
    assert tables(raw) == ["locks", "other", "p_svc"]
    assert DMutex("svc2", backend, table_name="locks", clock=clock).acquire("job") is None, (
        "one table, one key: another service naming the table shares its locks"
    )


# --- interop with the TypeScript store ------------------------------------------------------


def test_a_typescript_held_row_blocks_acquire(
    backend: SQLiteBackend, clock: ManualClock, ts: TypeScriptD1, raw: sqlite3.Connection
) -> None:
    theirs = str(uuid.uuid4())
    assert ts.acquire("permit:0:job", theirs, 10) == now_ms(clock) + 10_000
    mutex = DMutex("svc", backend, clock=clock)
    before = listed(raw, "_dmutex_svc")
    assert mutex.acquire("job", ttl=60) is None
    assert listed(raw, "_dmutex_svc") == before, "a refused acquire writes nothing (no fence)"
    clock.advance(9.999)
    assert mutex.acquire("job", ttl=60) is None, "active until its expiry"
    assert ts.extend("permit:0:job", theirs, 10) is not None


def test_an_expired_typescript_row_is_taken_over(
    backend: SQLiteBackend, clock: ManualClock, ts: TypeScriptD1, raw: sqlite3.Connection
) -> None:
    theirs = str(uuid.uuid4())
    assert ts.acquire("permit:0:job", theirs, 10) is not None
    clock.advance(10)
    lock = DMutex("svc", backend, clock=clock).acquire("job", ttl=60)
    assert lock is not None
    assert held_by(raw, "_dmutex_svc")["permit:0:job"] == lock.token
    assert ts.extend("permit:0:job", theirs, 10) is None
    assert ts.release("permit:0:job", theirs) is False, "never the new holder's row"
    assert ts.acquire("permit:0:job", str(uuid.uuid4()), 10) is None
    assert lock.release() is True


def test_a_typescript_release_frees_a_dmutex_held_row(
    backend: SQLiteBackend, clock: ManualClock, ts: TypeScriptD1, raw: sqlite3.Connection
) -> None:
    mutex = DMutex("svc", backend, clock=clock)
    lock = mutex.acquire("job", ttl=60)
    assert lock is not None
    assert ts.release("permit:0:job", lock.token) is True
    assert "permit:0:job" not in held_by(raw, "_dmutex_svc")
    again = mutex.acquire("job", ttl=60)
    assert again is not None
    assert lock.release() is False
    assert lock.extend(60) is False
    assert again.release() is True


def test_the_typescript_acquire_does_not_take_a_dmutex_held_row(
    backend: SQLiteBackend, clock: ManualClock, ts: TypeScriptD1, raw: sqlite3.Connection
) -> None:
    lock = DMutex("svc", backend, clock=clock).acquire("job", ttl=60)
    assert lock is not None
    before = listed(raw, "_dmutex_svc")
    clock.advance(59.999)
    assert ts.acquire("permit:0:job", str(uuid.uuid4()), 10) is None
    assert listed(raw, "_dmutex_svc") == before
    assert ts.extend("permit:0:job", lock.token, 30) == now_ms(clock) + 30_000, (
        "the TypeScript extend of dmutex's token, as the same layout allows"
    )
    clock.advance(29.999)
    assert lock.release() is True


def test_a_semaphore_takes_the_slots_typescript_rows_leave(
    path: Path, backend: SQLiteBackend, clock: ManualClock, raw: sqlite3.Connection
) -> None:
    ts = TypeScriptD1(path, "_dsemaphore_svc", clock)
    try:
        ts.initialize()
        theirs = {slot: str(uuid.uuid4()) for slot in (0, 2)}
        for slot, token in theirs.items():
            assert ts.acquire(f"permit:{slot}:api", token, 30) is not None
        sem = DSemaphore("svc", backend, max_permits=4, clock=clock)
        permits = [sem.acquire("api", ttl=60) for _ in range(2)]
        assert sorted(p.slot for p in permits if p is not None) == [1, 3]
        assert sem.acquire("api", ttl=60) is None
        stored = held_by(raw, "_dsemaphore_svc")
        for slot, token in theirs.items():
            assert stored[f"permit:{slot}:api"] == token, "the TypeScript rows are untouched"
        assert ts.release("permit:2:api", theirs[2]) is True
        third = sem.acquire("api", ttl=60)
        assert third is not None
        assert third.slot == 2
        assert ts.acquire("permit:2:api", str(uuid.uuid4()), 30) is None
    finally:
        ts.conn.close()


# --- the fence row -------------------------------------------------------------------------


def fenced(
    backend: SQLiteBackend, clock: ManualClock, permits: int, fencing: bool | None = None
) -> tuple[DMutex | DSemaphore, str]:
    """A mutex (1 permit) or a semaphore of service ``svc``, and its table."""
    if permits == 1:
        return DMutex("svc", backend, clock=clock, fencing=fencing), "_dmutex_svc"
    return DSemaphore(
        "svc", backend, max_permits=permits, clock=clock, fencing=fencing
    ), "_dsemaphore_svc"


@pytest.mark.parametrize("permits", [1, 3])
def test_the_fence_row_counts_grants(
    permits: int, backend: SQLiteBackend, clock: ManualClock, raw: sqlite3.Connection
) -> None:
    """Each grant's fence is the larger of the row's count plus one and the clock in
    microseconds, and the row holds it (ASCII decimal, never expiring)."""
    lock, table = fenced(backend, clock, permits)
    fences: list[int | None] = []
    counter, start = 0, clock_us(clock)  # no row yet
    # The clock still (the count plus one wins after the first), then a second on (the clock).
    for step in (0.0, 0.0, 0.0, 1.0, 0.0):
        clock.advance(step)
        handle = lock.acquire("job", ttl=60)
        assert handle is not None
        counter = next_fence(counter, clock_us(clock))
        assert handle.fence == counter
        fences.append(handle.fence)
        assert held_by(raw, table)["fence:job"] == str(handle.fence)
        assert handle.release() is True
    assert fences == [start, start + 1, start + 2, start + 1_000_000, start + 1_000_001]
    released = [("fence:job", str(counter), FOREVER)]
    assert listed(raw, table) == released, "released: only the counter stays"


def test_fencing_false_writes_no_counter_and_leaves_one_alone(
    backend: SQLiteBackend, clock: ManualClock, raw: sqlite3.Connection
) -> None:
    plain = DMutex("svc", backend, fencing=False, clock=clock)
    lock = plain.acquire("a", ttl=60)
    assert lock is not None
    assert lock.fence is None
    assert listed(raw, "_dmutex_svc") == [("permit:0:a", lock.token, now_ms(clock) + 60_000)]
    assert lock.release() is True
    fenced = DMutex("svc", backend, clock=clock).acquire("b", ttl=60)
    assert fenced is not None
    assert fenced.fence == clock_us(clock), "the first grant: no counter yet, the clock"
    assert fenced.release() is True
    sem = DSemaphore("svc", backend, max_permits=2, fencing=False, clock=clock)
    for key in ("a", "b"):
        for handle in (plain.acquire(key, ttl=60), sem.acquire(key, ttl=60)):
            assert handle is not None
            assert handle.fence is None
    stored = held_by(raw, "_dmutex_svc")
    assert (stored.get("fence:a"), stored["fence:b"]) == (None, str(fenced.fence))
    assert [key for key in held_by(raw, "_dsemaphore_svc") if key.startswith("fence:")] == []


FOREIGN_FENCES = [
    pytest.param(("abc", FOREVER), id="text"),
    pytest.param(("", FOREVER), id="empty"),
    pytest.param(("-1", FOREVER), id="negative"),
    pytest.param(("1.5", FOREVER), id="decimal-point"),
    pytest.param(("7", 1_767_225_660_000), id="digits-with-a-lease-expiry"),
    pytest.param((str(uuid.UUID(int=7)), 1_767_225_660_000), id="typescript-lease"),
    pytest.param(("²", FOREVER), id="superscript-two"),
    pytest.param(("١٢", FOREVER), id="arabic-indic-digits"),
]


@pytest.mark.parametrize("foreign", FOREIGN_FENCES)
@pytest.mark.parametrize("permits", [1, 3])
def test_a_foreign_fence_row_fails_the_acquire_and_changes_nothing(
    foreign: tuple[str, int],
    permits: int,
    backend: SQLiteBackend,
    clock: ManualClock,
    raw: sqlite3.Connection,
) -> None:
    lock, table = fenced(backend, clock, permits)
    lock.ready()
    value, expired_at = foreign
    raw.execute(f"INSERT INTO {table} VALUES ('fence:job', ?, ?)", (value, expired_at))
    # Another key's lease and an expired slot of this key, both to stay as they are.
    raw.execute(f"INSERT INTO {table} VALUES ('permit:0:other', 'x', ?)", (now_ms(clock) + 5,))
    raw.execute(f"INSERT INTO {table} VALUES ('permit:0:job', 'old', ?)", (now_ms(clock),))
    before = listed(raw, table)
    with pytest.raises(DMutexError, match="fence:job"):
        lock.acquire("job", ttl=60)
    assert listed(raw, table) == before
    assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    unfenced, _ = fenced(backend, clock, permits, fencing=False)
    assert unfenced.acquire("job", ttl=60) is not None, "fencing=False never reads the row"
    assert held_by(raw, table)["fence:job"] == value

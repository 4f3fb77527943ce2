"""Read-write locks on SQLite (``SQLiteReadWriteStore``), both faces, and processes sharing a file.

What is checked, each through the public classes (``tests._support.rwfaces``
gives both faces one sync interface) and a raw ``sqlite3`` connection that
reads the table as another program would:

- the rules of ``dmutex._core.readwrite``: readers share, a writer excludes,
  ``max_readers``, a waiting writer's intent refuses new readers until it
  lapses or is withdrawn, a re-sent attempt finds its own hold, release and
  extend by token, fences that rise;
- waiting: a release wakes a waiter of this process at once; a waiter with
  no signal (another backend object, as another process) waits no longer
  than the hold in its way has left;
- the layout, byte for byte: the row ``rwlock:{k}`` (its JSON, its
  ``expired_at``), the fence row, the table;
- a row of that key that dmutex did not write: every operation raises
  ``DMutexError`` and the row is left as it was;
- spawned processes, readers and writers on one file, guarding plain files
  beside it: no writer overlaps anyone, and the counts are exact.

Time is a ManualClock where numbers are compared exactly (a fence is the
larger of the counter plus one and that clock in microseconds).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dmutex import (
    AsyncDReadLock,
    AsyncDReadWriteLock,
    DMutexError,
    DReadLock,
    DReadWriteLock,
    ManualClock,
    SQLiteBackend,
)
from dmutex._core.lease import Lease
from dmutex._core.readwrite import READ_SLOT, WRITE_SLOT
from tests._support import processes
from tests._support.faces import FaceName, Handle, LoopThread
from tests._support.processes import BARRIER_TIMEOUT, Barrier, Reports
from tests._support.rwfaces import RWFace, Side
from tests._support.sqlite_rows import Row, listed

KEY = "orders"
SERVICE = "svc"
TABLE = f"_drwlock_{SERVICE}"
ROW = f"rwlock:{KEY}"
FENCE_ROW = f"fence:{KEY}"
FOREVER = 2**63 - 1
START = 1_767_225_600.0  # 2026-01-01T00:00:00Z
START_MS = 1_767_225_600_000
START_US = 1_767_225_600_000_000
RETRY_DELAY = 0.1  # a dead writer's: its intent lasts this + 2 s
# A waiter that waits U(0.5, 1) * LONG_DELAY unless something ends its wait
# early, and how soon after that something it must be in (room for a busy machine).
LONG_DELAY = 20.0
LONG_TIMEOUT = 30.0
SIGNALLED = 5.0


# --- fixtures ----------------------------------------------------------------------------


@pytest.fixture(params=["sync", "async"])
def face(request: pytest.FixtureRequest) -> FaceName:
    name: FaceName = request.param
    return name


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "locks.db"


@pytest.fixture
def backend(path: Path) -> Iterator[SQLiteBackend]:
    opened = SQLiteBackend(path)
    yield opened
    opened.close()


@pytest.fixture
def loop(face: FaceName) -> Iterator[LoopThread | None]:
    thread = LoopThread() if face == "async" else None
    yield thread
    if thread is not None:
        thread.close()


@pytest.fixture
def raw(path: Path, backend: SQLiteBackend) -> Iterator[sqlite3.Connection]:
    """Another program's connection to the file (made after the backend made the file)."""
    with closing(sqlite3.connect(path, timeout=30.0, isolation_level=None)) as conn:
        yield conn


@pytest.fixture
def make(face: FaceName, loop: LoopThread | None, backend: SQLiteBackend) -> Callable[..., RWFace]:
    """A DReadWriteLock of the test's face over ``backend`` (or ``client=``), prepared."""

    def made(*, client: object = None, **options: Any) -> RWFace:
        rw = RWFace(face, backend if client is None else client, loop=loop, **options)
        rw.wait(rw.target.ready())
        return rw

    return made


def row(raw: sqlite3.Connection, name: str = ROW, table: str = TABLE) -> Row | None:
    return next((r for r in listed(raw, table) if r[0] == name), None)


def intent_stands(raw: sqlite3.Connection) -> bool:
    found = row(raw)
    return found is not None and not found[1].endswith('"i":{}}')


def held(rw: RWFace, key: str = KEY) -> list[tuple[int, str]]:
    return sorted((h.slot, h.token) for h in rw.holders(key).holders)


def is_read(handle: Handle) -> bool:
    """Whether ``handle`` is a read hold (a hold's handle shows no slot)."""
    return isinstance(handle.raw, (DReadLock, AsyncDReadLock))


def grant(rw: RWFace, side: Side, ttl: float = 60.0, key: str = KEY) -> Handle:
    handle = rw.acquire(side, key, ttl)
    assert handle is not None, f"a {side} hold refused"
    return handle


def store_acquire(rw: RWFace, write: bool, token: str, ttl_ms: int) -> Lease | None:
    """One attempt through the store, with a chosen token: as a re-sent request would be."""
    side: Any = rw.target._writing._store if write else rw.target._reading._store
    drive: Any = rw.target._drive
    lease: Lease | None = rw.wait(drive(side.acquire(KEY, token, ttl_ms, None)))
    return lease


# --- the rules -----------------------------------------------------------------------------


def test_readers_share_and_a_writer_excludes(
    make: Callable[..., RWFace], path: Path, raw: sqlite3.Connection
) -> None:
    rw = make()
    other = SQLiteBackend(path)  # a second connection, as another process has
    try:
        elsewhere = make(client=other)
        first, second = grant(rw, "read"), grant(elsewhere, "read")
        assert is_read(first)
        assert is_read(second)
        assert held(rw) == sorted([(READ_SLOT, first.token), (READ_SLOT, second.token)])
        assert rw.acquire("write", KEY, 60.0) is None
        assert elsewhere.acquire("write", KEY, 60.0) is None
        assert first.release() is True
        assert elsewhere.acquire("write", KEY, 60.0) is None  # one reader still in
        assert second.release() is True
        writer = grant(elsewhere, "write")
        assert not is_read(writer)
        assert held(rw) == [(WRITE_SLOT, writer.token)]
        assert rw.acquire("read", KEY, 60.0) is None
        assert rw.acquire("write", KEY, 60.0) is None
        assert grant(rw, "read", key="another key").release() is True  # keys are apart
        assert writer.release() is True
        assert first.release() is False
        assert grant(rw, "read").release() is True
        assert [name for name, _, _ in listed(raw, TABLE)] == ["fence:another key", FENCE_ROW]
    finally:
        other.close()


def test_max_readers(make: Callable[..., RWFace]) -> None:
    rw = make(max_readers=2)
    first, _ = grant(rw, "read"), grant(rw, "read")
    assert rw.acquire("read", KEY, 60.0) is None
    assert first.release() is True
    assert rw.acquire("read", KEY, 60.0) is not None


def test_a_waiting_writers_intent_refuses_new_readers_until_it_lapses(
    make: Callable[..., RWFace], raw: sqlite3.Connection
) -> None:
    clock = ManualClock(START)
    rw = make(clock=clock)
    reader = grant(rw, "read", 60.0)
    granted, token, window_ms = rw.intend(KEY, 10.0, RETRY_DELAY)
    assert not granted
    assert window_ms == 2100  # retry_delay + the registration margin
    found = row(raw)
    assert found is not None
    assert f'"i":{{"{token}":{START_MS + window_ms}}}' in found[1]
    assert rw.acquire("read", KEY, 60.0) is None, "a new reader passed a writer's intent"
    assert reader.extend(60.0) is True, "a reader already in keeps its hold"
    clock.advance(window_ms / 1000 - 0.001)
    assert rw.acquire("read", KEY, 60.0) is None
    clock.advance(0.001)
    late = grant(rw, "read")  # the intent lapsed
    found = row(raw)
    assert found is not None
    assert found[1].endswith('"i":{}}')
    assert held(rw) == sorted([(READ_SLOT, reader.token), (READ_SLOT, late.token)])


def test_a_retrying_writers_last_attempt_withdraws_its_intent(
    make: Callable[..., RWFace], raw: sqlite3.Connection
) -> None:
    clock = ManualClock(START)
    rw = make(clock=clock)
    reader = grant(rw, "read", 600.0)
    # On a ManualClock each wait advances the clock: the attempts run at once.
    assert rw.acquire_with_retry("write", KEY, ttl=10.0, timeout=1.0, retry_delay=0.25) is None
    assert clock.monotonic() >= 1.0
    found = row(raw)
    assert found is not None
    assert found[1].endswith('"i":{}}')
    assert grant(rw, "read").release() is True
    assert reader.release() is True
    assert row(raw) is None


def test_release_by_a_waiting_writers_token_withdraws_its_intent(
    make: Callable[..., RWFace], raw: sqlite3.Connection
) -> None:
    clock = ManualClock(START)
    rw = make(clock=clock)
    reader = grant(rw, "read")
    _, token, _ = rw.intend(KEY, 10.0, RETRY_DELAY)
    assert rw.acquire("read", KEY, 60.0) is None
    assert rw.release_token(KEY, token) is False  # an intent, not a hold
    assert grant(rw, "read").release() is True
    assert reader.release() is True
    assert row(raw) is None


def test_a_release_wakes_a_writer_waiting_in_this_process(
    make: Callable[..., RWFace], raw: sqlite3.Connection
) -> None:
    rw = make()
    reader = grant(rw, "read")
    result: list[Handle | None] = []

    def write() -> None:
        result.append(
            rw.acquire_with_retry(
                "write", KEY, ttl=60.0, timeout=LONG_TIMEOUT, retry_delay=LONG_DELAY
            )
        )

    thread = threading.Thread(target=write)
    thread.start()
    deadline = time.monotonic() + 10.0
    while not intent_stands(raw):  # the writer's first attempt is refused
        assert time.monotonic() < deadline, "the writer's first attempt left no intent"
        time.sleep(0.005)
    assert rw.acquire("read", KEY, 60.0) is None, "a new reader passed a waiting writer"
    released = time.monotonic()
    assert reader.release() is True
    thread.join(15.0)
    waited = time.monotonic() - released
    writer = result[0]
    assert writer is not None
    assert not is_read(writer)
    assert waited < SIGNALLED, f"woken {waited:.2f} s after the release (its wait: 10-20 s)"
    assert writer.release() is True


def test_a_waiter_without_a_signal_waits_no_longer_than_the_hold_in_its_way(
    make: Callable[..., RWFace], path: Path
) -> None:
    rw = make()
    other = SQLiteBackend(path)  # no wakeup crosses backend objects, as none crosses processes
    try:
        elsewhere = make(client=other)
        grant(rw, "read", ttl=0.5)
        started = time.monotonic()
        writer = elsewhere.acquire_with_retry(
            "write", KEY, ttl=60.0, timeout=LONG_TIMEOUT, retry_delay=LONG_DELAY
        )
        waited = time.monotonic() - started
        assert writer is not None
        assert waited < SIGNALLED, f"granted after {waited:.2f} s (its wait: 10-20 s)"
        assert writer.release() is True
    finally:
        other.close()


def test_a_re_sent_attempt_finds_its_own_hold(
    make: Callable[..., RWFace], raw: sqlite3.Connection
) -> None:
    clock = ManualClock(START)
    rw = make(clock=clock)
    for write, token in ((False, "token-r"), (True, "token-w")):
        first = store_acquire(rw, write, token, 10_000)
        clock.advance(1.0)
        again = store_acquire(rw, write, token, 10_000)
        assert first is not None
        assert again is not None
        assert again.slot == first.slot == (WRITE_SLOT if write else READ_SLOT)
        assert again.expires_ms == first.expires_ms + 1000
        assert first.fence is not None
        assert again.fence is not None
        assert again.fence > first.fence
        assert held(rw) == [(again.slot, token)], "a second hold for one token"
        assert rw.release_token(KEY, token) is True
        assert rw.release_token(KEY, token) is False
    assert row(raw) is None


def test_release_and_extend_by_token(make: Callable[..., RWFace], raw: sqlite3.Connection) -> None:
    clock = ManualClock(START)
    rw = make(clock=clock)
    reader, writer_rw = grant(rw, "read", 10.0), make(clock=clock)
    assert writer_rw.extend(KEY, reader.token, 30.0) is True
    assert row(raw) == (
        ROW,
        f'{{"dmutex":"rwlock","w":null,"r":{{"{reader.token}":{START_MS + 30_000}}},"i":{{}}}}',
        START_MS + 30_000,
    )
    assert writer_rw.extend(KEY, "a stranger", 30.0) is False
    assert writer_rw.release_token(KEY, "a stranger") is False
    assert writer_rw.release_token("another key", reader.token) is False
    assert writer_rw.release_token(KEY, reader.token) is True
    assert reader.release() is False
    assert row(raw) is None
    writer = grant(rw, "write", 10.0)
    clock.advance(5.0)
    assert rw.extend(KEY, writer.token, 20.0) is True
    assert row(raw) == (
        ROW,
        f'{{"dmutex":"rwlock","w":["{writer.token}",{START_MS + 25_000}],"r":{{}},"i":{{}}}}',
        START_MS + 25_000,
    )
    clock.advance(25.0)  # the writer's hold has run out: neither extend nor release finds it
    assert rw.extend(KEY, writer.token, 20.0) is False
    assert row(raw) is None  # the extend's transaction dropped what had expired
    assert rw.release_token(KEY, writer.token) is False


def test_fences_rise_a_writers_above_every_fence_before(
    make: Callable[..., RWFace], raw: sqlite3.Connection
) -> None:
    clock = ManualClock(START)
    rw = make(clock=clock)
    first, second = grant(rw, "read"), grant(rw, "read")
    assert (first.fence, second.fence) == (START_US, START_US + 1)
    assert held(rw) == sorted([(READ_SLOT, first.token), (READ_SLOT, second.token)])
    assert rw.holders(KEY).fence == START_US + 1
    first.release()
    second.release()
    writer = grant(rw, "write")
    assert writer.fence == START_US + 2
    assert row(raw, FENCE_ROW) == (FENCE_ROW, str(START_US + 2), FOREVER)
    writer.release()
    clock.advance(1.0)
    assert grant(rw, "read").fence == START_US + 1_000_000  # the clock, above the counter
    fence = grant(make(), "read").fence  # by the host's clock: still above every earlier one
    assert fence is not None
    assert fence > START_US + 1_000_000


def test_without_fencing_no_fence_row(make: Callable[..., RWFace], raw: sqlite3.Connection) -> None:
    rw = make(fencing=False)
    reader = grant(rw, "read")
    assert reader.fence is None
    assert [name for name, _, _ in listed(raw, TABLE)] == [ROW]
    reader.release()
    assert listed(raw, TABLE) == []


# --- the layout ----------------------------------------------------------------------------


def test_the_layout_byte_for_byte(make: Callable[..., RWFace], raw: sqlite3.Connection) -> None:
    clock = ManualClock(START)
    rw = make(clock=clock)
    assert raw.execute(
        "SELECT type, name, sql FROM sqlite_master WHERE tbl_name = ? ORDER BY name", (TABLE,)
    ).fetchall() == [
        (
            "table",
            TABLE,
            f'CREATE TABLE "{TABLE}" ("key" TEXT PRIMARY KEY, "value" TEXT NOT NULL, '
            '"expired_at" INTEGER NOT NULL)',
        ),
        (
            "index",
            f"{TABLE}_expired_at_idx",
            f'CREATE INDEX "{TABLE}_expired_at_idx" ON "{TABLE}" ("expired_at")',
        ),
        ("index", f"sqlite_autoindex_{TABLE}_1", None),
    ]
    one, two = grant(rw, "read", 20.0), grant(rw, "read", 10.0)
    (a, a_ms), (b, b_ms) = sorted([(one.token, 20_000), (two.token, 10_000)])
    readers = f'"{a}":{START_MS + a_ms},"{b}":{START_MS + b_ms}'
    assert listed(raw, TABLE) == [
        (FENCE_ROW, str(START_US + 1), FOREVER),
        (ROW, f'{{"dmutex":"rwlock","w":null,"r":{{{readers}}},"i":{{}}}}', START_MS + 20_000),
    ]
    _, token, window_ms = rw.intend(KEY, 10.0, 30.0)  # an intent outlasting both readers
    until = START_MS + window_ms
    assert listed(raw, TABLE)[1] == (
        ROW,
        f'{{"dmutex":"rwlock","w":null,"r":{{{readers}}},"i":{{"{token}":{until}}}}}',
        until,
    )
    clock.advance(10.0)  # the second reader runs out; the next change drops it
    assert one.extend(20.0) is True
    assert listed(raw, TABLE)[1] == (
        ROW,
        f'{{"dmutex":"rwlock","w":null,"r":{{"{one.token}":{START_MS + 30_000}}},'
        f'"i":{{"{token}":{until}}}}}',
        until,
    )
    assert rw.release_token(KEY, token) is False
    assert one.release() is True
    assert listed(raw, TABLE) == [(FENCE_ROW, str(START_US + 1), FOREVER)]
    writer = grant(rw, "write", 5.0)
    assert listed(raw, TABLE) == [
        (FENCE_ROW, str(START_US + 10_000_000), FOREVER),
        (
            ROW,
            f'{{"dmutex":"rwlock","w":["{writer.token}",{START_MS + 15_000}],"r":{{}},"i":{{}}}}',
            START_MS + 15_000,
        ),
    ]


def test_table_name_and_prefix(make: Callable[..., RWFace], raw: sqlite3.Connection) -> None:
    grant(make(table_name="my locks"), "read")
    grant(make(table_prefix="rw_"), "write")
    tables = raw.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
    assert [name for (name,) in tables.fetchall()] == ["my locks", f"rw_{SERVICE}"]
    assert [name for name, _, _ in listed(raw, "my locks")] == [FENCE_ROW, ROW]


# --- rows dmutex did not write -------------------------------------------------------------

FOREIGN = [
    "6f1c1a9e-3d0b-4c55-9b1e-1f2a3b4c5d6e",  # a token, as a lock of another program
    "{not json",
    '{"w":null,"r":{},"i":{}}',  # no mark
    '{"dmutex":"mutex","w":null,"r":{},"i":{}}',  # another mark
    '{"dmutex":"rwlock","w":null,"r":{},"i":{},"v":2}',  # a field this version does not know
    '{"dmutex":"rwlock","w":null,"r":{}}',  # a field missing
    '{"dmutex":"rwlock","w":["t",true],"r":{},"i":{}}',  # a writer's expiry not a number
    '{"dmutex":"rwlock","w":null,"r":{"t":1.5},"i":{}}',  # a reader's expiry not an integer
    '{"dmutex":"rwlock","w":null,"r":[],"i":{}}',  # readers not an object
    '["dmutex","rwlock"]',
]


@pytest.mark.parametrize("value", FOREIGN)
def test_a_row_dmutex_did_not_write_raises_and_is_left_alone(
    make: Callable[..., RWFace], raw: sqlite3.Connection, value: str
) -> None:
    rw = make()
    stored = (ROW, value, 0)  # long expired: an expiry would not save it
    raw.execute(f'INSERT INTO "{TABLE}" VALUES (?, ?, ?)', stored)
    calls: list[Callable[[], object]] = [
        lambda: rw.acquire("read", KEY, 60.0),
        lambda: rw.acquire("write", KEY, 60.0),
        lambda: rw.acquire_with_retry("write", KEY, ttl=60.0, timeout=0.05, retry_delay=0.01),
        lambda: rw.release_token(KEY, "6f1c1a9e-3d0b-4c55-9b1e-1f2a3b4c5d6e"),
        lambda: rw.extend(KEY, "6f1c1a9e-3d0b-4c55-9b1e-1f2a3b4c5d6e", 60.0),
        lambda: rw.holders(KEY),
    ]
    for call in calls:
        with pytest.raises(DMutexError, match=f"the row '{ROW}' of table '{TABLE}'"):
            call()
        assert listed(raw, TABLE) == [stored]


def test_a_renewal_batch_answers_a_foreign_row_for_its_lease_alone(
    make: Callable[..., RWFace], raw: sqlite3.Connection
) -> None:
    clock = ManualClock(START)
    rw = make(clock=clock)
    reader = grant(rw, "read", 10.0)
    stored = ("rwlock:elsewhere", "not ours", START_MS + 99)
    raw.execute(f'INSERT INTO "{TABLE}" VALUES (?, ?, ?)', stored)
    ours = Lease(KEY, reader.token, READ_SLOT, START_MS + 10_000, ttl_ms=30_000)
    theirs = Lease("elsewhere", "a token", READ_SLOT, START_MS + 10_000, ttl_ms=30_000)
    gone = Lease(KEY, "a stranger", WRITE_SLOT, START_MS + 10_000, ttl_ms=30_000)
    side: Any = rw.target._reading._store
    drive: Any = rw.target._drive
    answers = rw.wait(drive(side.extend_many([ours, theirs, gone])))
    assert answers[0] == START_MS + 30_000
    assert isinstance(answers[1], DMutexError)
    assert answers[2] is None
    assert row(raw, "rwlock:elsewhere") == stored
    found = row(raw)
    assert found is not None
    assert found[2] == START_MS + 30_000


def test_a_foreign_fence_row_makes_an_attempt_raise_and_change_nothing(
    make: Callable[..., RWFace], raw: sqlite3.Connection
) -> None:
    rw = make()
    stored = (FENCE_ROW, "12 apples", FOREVER)
    raw.execute(f'INSERT INTO "{TABLE}" VALUES (?, ?, ?)', stored)
    for side in ("read", "write"):
        with pytest.raises(DMutexError, match=f"the row '{FENCE_ROW}'"):
            rw.acquire(side, KEY, 60.0)
        assert listed(raw, TABLE) == [stored]
    assert make(fencing=False).acquire("read", KEY, 60.0) is not None  # fencing=False reads none
    assert row(raw, FENCE_ROW) == stored


# --- processes -----------------------------------------------------------------------------

PROCESSES = 4
CYCLES = 200
WRITE_EVERY = 4  # one cycle in four writes
TTL = 30.0  # far longer than the test: no hold may expire while held
RETRY_TIMEOUT = 60.0
PROCESS_RETRY_DELAY = 0.002


@dataclass(frozen=True)
class Report:
    """What one worker saw."""

    worker: int
    reads: int
    writes: int
    overlaps: int  # a writer found another writer or a reader inside, or a reader a writer
    stale: int  # a fence not above the last writer's
    failed_releases: int
    peak_readers: int


@dataclass
class Tally:
    worker: int
    reads: int = 0
    writes: int = 0
    overlaps: int = 0
    stale: int = 0
    failed_releases: int = 0
    peak_readers: int = 0

    def report(self) -> Report:
        return Report(
            self.worker,
            self.reads,
            self.writes,
            self.overlaps,
            self.stale,
            self.failed_releases,
            self.peak_readers,
        )


def _gauge(folder: str, delta: int) -> tuple[int, int]:
    """Add ``delta`` to the readers inside (and a read to the total) under ``flock``."""
    with open(os.path.join(folder, "gauge"), "r+") as gauge:
        fcntl.flock(gauge, fcntl.LOCK_EX)
        try:
            inside, total = (int(part) for part in gauge.read().split())
            inside += delta
            total += 1 if delta > 0 else 0
            gauge.seek(0)
            gauge.write(f"{inside} {total}\n")
            gauge.truncate()
        finally:
            fcntl.flock(gauge, fcntl.LOCK_UN)
    return inside, total


def _counter(folder: str) -> tuple[int, int]:
    with open(os.path.join(folder, "counter")) as counter:
        count, fence = (int(part) for part in counter.read().split())
    return count, fence


def _write(folder: str, fence: int | None, tally: Tally) -> None:
    """Under a write hold: alone, or an overlap is counted; the counter's read-modify-write."""
    assert fence is not None
    marker = os.path.join(folder, "writer")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        entered = True
    except FileExistsError:
        entered = False
    readers = _gauge(folder, 0)[0]
    count, last = _counter(folder)
    if last >= fence:
        tally.stale += 1
    with open(os.path.join(folder, "counter"), "w") as counter:
        counter.write(f"{count + 1} {fence}\n")
    time.sleep(0.0002)
    if not entered or readers or _gauge(folder, 0)[0]:
        tally.overlaps += 1
    try:
        os.unlink(marker)
    except FileNotFoundError:
        tally.overlaps += 1
    tally.writes += 1


def _read(folder: str, fence: int | None, tally: Tally) -> None:
    """Under a read hold: no writer inside; the last writer's fence below this one's."""
    assert fence is not None
    marker = os.path.join(folder, "writer")
    inside, _ = _gauge(folder, +1)
    tally.peak_readers = max(tally.peak_readers, inside)
    if os.path.exists(marker):
        tally.overlaps += 1
    if _counter(folder)[1] >= fence:
        tally.stale += 1
    time.sleep(0.0005)  # a little reading: lets readers share
    if os.path.exists(marker):
        tally.overlaps += 1
    _gauge(folder, -1)
    tally.reads += 1


def readers_and_writers_worker(
    worker: int, reports: Reports, barrier: Barrier, folder: str, cycles: int
) -> None:
    """``cycles`` holds of ``KEY``, one in :data:`WRITE_EVERY` a write; odd workers use asyncio."""
    path = os.path.join(folder, "locks.db")

    def work(tally: Tally, write: bool, hold: Any) -> None:
        assert hold is not None, "acquire timed out"
        (_write if write else _read)(folder, hold.fence, tally)

    def sync_body(tally: Tally) -> None:
        backend = SQLiteBackend(path)
        try:
            rw = DReadWriteLock(SERVICE, backend)
            rw.ready()
            barrier.wait(BARRIER_TIMEOUT)
            for cycle in range(cycles):
                write = (cycle + worker) % WRITE_EVERY == 0
                take: Any = rw.acquire_write_with_retry if write else rw.acquire_read_with_retry
                hold = take(KEY, ttl=TTL, timeout=RETRY_TIMEOUT, retry_delay=PROCESS_RETRY_DELAY)
                work(tally, write, hold)
                if not hold.release():
                    tally.failed_releases += 1
        finally:
            backend.close()

    async def async_body(tally: Tally) -> None:
        backend = SQLiteBackend(path)
        try:
            rw = AsyncDReadWriteLock(SERVICE, backend)
            await rw.ready()
            barrier.wait(BARRIER_TIMEOUT)  # blocking is fine: nothing else runs on this loop
            for cycle in range(cycles):
                write = (cycle + worker) % WRITE_EVERY == 0
                take: Any = rw.acquire_write_with_retry if write else rw.acquire_read_with_retry
                hold = await take(
                    KEY, ttl=TTL, timeout=RETRY_TIMEOUT, retry_delay=PROCESS_RETRY_DELAY
                )
                work(tally, write, hold)
                if not await hold.release():
                    tally.failed_releases += 1
        finally:
            backend.close()

    def body(tally: Tally) -> None:
        if worker % 2 == 0:
            sync_body(tally)
        else:
            asyncio.run(async_body(tally))

    processes.report_errors(worker, reports, barrier, Tally(worker), body)


def test_processes_readers_share_and_no_writer_overlaps_anyone(tmp_path: Path) -> None:
    (tmp_path / "counter").write_text("0 0\n")
    (tmp_path / "gauge").write_text("0 0\n")
    backend = SQLiteBackend(tmp_path / "locks.db")  # the file and table, before the workers
    try:
        DReadWriteLock(SERVICE, backend).ready()
    finally:
        backend.close()
    reports = processes.run_workers(
        readers_and_writers_worker,
        PROCESSES,
        str(tmp_path),
        CYCLES,
        deadline=processes.DEADLINE,
        report=Report,
    )
    assert [r.worker for r in reports] == list(range(PROCESSES))
    writes = sum(r.writes for r in reports)
    reads = sum(r.reads for r in reports)
    assert writes == PROCESSES * CYCLES // WRITE_EVERY
    assert reads + writes == PROCESSES * CYCLES
    assert _counter(str(tmp_path))[0] == writes, "a writer's update was lost"
    assert _gauge(str(tmp_path), 0) == (0, reads)
    assert sum(r.overlaps for r in reports) == 0
    assert sum(r.stale for r in reports) == 0
    assert sum(r.failed_releases for r in reports) == 0
    print(f"most readers inside at once: {max(r.peak_readers for r in reports)}")
    with closing(sqlite3.connect(tmp_path / "locks.db")) as conn:
        left = conn.execute(f'SELECT "key" FROM "{TABLE}"').fetchall()
    assert left == [(FENCE_ROW,)], "a hold or intent was left behind"

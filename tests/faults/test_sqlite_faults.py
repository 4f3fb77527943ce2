"""The fault suite on SQLiteBackend: a paused holder, cancellation, a busy file.

- Pause: a holder process is stopped by SIGSTOP past its TTL, the test takes
  its keys over, then continues it. Its extends and releases (by handle and by
  token, mutex and semaphore) return False and leave the new holder's rows as
  they were; its ``auto_renew`` lease is reported lost (``lost``,
  ``wait_lost``, ``on_lost`` once) and its release returns False.
- Cancellation: asyncio tasks on one backend are cancelled at random moments
  while their calls wait for the backend's worker thread (``queued``), run in
  SQLite (``running``), or have run but not yet answered (``answered``), in
  their bodies and in their retry waits. After every batch no permit row is
  left that no task believes it holds; after ``close()`` no worker thread is
  left.
- Busy file: another connection holds ``BEGIN IMMEDIATE``. With
  ``timeout=0.2`` every call raises ``sqlite3.OperationalError`` and changes
  no row; after the blocker commits they work, each fence the next one by
  the rule (the counter plus one, or the clock in microseconds if later). The
  asyncio face waits for the file in its worker thread: the event loop keeps
  running meanwhile (a ticker task's ticks are counted, not timed).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import random
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias, TypeVar

import pytest

from dmutex import AsyncDMutex, AsyncDMutexLock, AsyncDSemaphore, DMutex, DSemaphore, SQLiteBackend
from dmutex._core.fences import next_fence
from tests._support import processes
from tests._support.cancellation import (
    Face,
    NotingClock,
    Plan,
    Storage,
    Tally,
    current,
    judge,
    note_retry_waits,
    run_trials,
)
from tests._support.faces import Face as SyncView
from tests._support.faces import FaceName, Handle, LoopThread, RawHandle
from tests._support.pausing import CALLS, FILL_TTL, NEW_TTL, TTL, slot_of, stale_calls
from tests._support.sampling import until
from tests._support.sqlite_rows import quoted, tables

T = TypeVar("T")
Reports: TypeAlias = processes.ChildReports
Row: TypeAlias = tuple[str, int]

SERVICE = "faults"
MUTEX_TABLE = f"_dmutex_{SERVICE}"
SEMAPHORE_TABLE = f"_dsemaphore_{SERVICE}"
FOREVER = 2**63 - 1  # a fence row's expired_at

START_TIMEOUT = 60.0  # spawning and importing on a busy 2-core machine
STEP_TIMEOUT = 20.0  # any one wait of the test or of the child
POLL = 0.01


@contextlib.contextmanager
def raw(path: Path, timeout: float = STEP_TIMEOUT) -> Iterator[sqlite3.Connection]:
    """A plain connection to the lock file (autocommit); closed after."""
    conn = sqlite3.connect(path, timeout=timeout, isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()


def dump(conn: sqlite3.Connection) -> dict[str, list[tuple[object, ...]]]:
    """Every row of every table, sorted: to compare the whole file before and after."""
    return {
        name: sorted(conn.execute(f"SELECT * FROM {quoted(name)}").fetchall())
        for name in tables(conn)
    }


def row(path: Path, table: str, key: str) -> Row | None:
    """The row ``key`` of ``table``: ``(value, expired_at)``, or None."""
    with raw(path) as conn:
        found = conn.execute(
            f'SELECT "value", "expired_at" FROM "{table}" WHERE "key" = ?',
            (key,),
        ).fetchone()
    return None if found is None else (str(found[0]), int(found[1]))


def now_ms() -> int:
    """The wall clock in whole ms, as the store reads it (``round``)."""
    return round(time.time() * 1000)


def now_us() -> int:
    """The host's clock in whole microseconds, as SQLiteBackend reads it for a fence."""
    return int(time.time() * 1_000_000)


def worker_threads() -> list[threading.Thread]:
    """The SQLite backends' worker threads alive in this process."""
    return [t for t in threading.enumerate() if t.name.startswith("dmutex-sqlite")]


# --- pause: a holder stopped past its TTL ----------------------------------------------------

MUTEX_KEY = "paused-mutex"
SEMAPHORE_KEY = "paused-semaphore"
RENEWED_KEY = "paused-renewed"
PERMITS = 2
RENEW_TTL = 1.0  # the paused holder's auto_renew lease (renewed every third of it until the stop)


@dataclass(frozen=True)
class Held:
    """One lease of the paused holder, as it reported it."""

    table: str
    key: str
    token: str
    slot: int
    fence: int | None

    @property
    def name(self) -> str:
        return f"permit:{self.slot}:{self.key}"


def _held(table: str, lease: object) -> Held:
    assert isinstance(lease, RawHandle)
    return Held(table, lease.key, lease.token, slot_of(lease), lease.fence)


def _report_acquired(reports: Reports, lock: Handle, permit: Handle, renewed: Handle) -> list[bool]:
    """Report the three leases to the test; returns the renewed one's on_lost calls (lost)."""
    losses: list[bool] = []
    renewed.on_lost(lambda handle: losses.append(handle.lost))
    reports.put(
        (
            "acquired",
            [
                _held(MUTEX_TABLE, lock.raw),
                _held(SEMAPHORE_TABLE, permit.raw),
                _held(MUTEX_TABLE, renewed.raw),
            ],
        )
    )
    return losses


def _holder(
    face: FaceName, path: str, reports: Reports, go: multiprocessing.synchronize.Event
) -> object:
    # An asyncio face runs on its loop's thread: it goes on renewing while this one waits.
    loop = LoopThread() if face == "async" else None
    backend = SQLiteBackend(path)
    try:
        mutex = SyncView(face, "mutex", backend, service_name=SERVICE, loop=loop)
        sem = SyncView(
            face, "semaphore", backend, service_name=SERVICE, max_permits=PERMITS, loop=loop
        )
        lock = mutex.acquire(MUTEX_KEY, ttl=TTL)
        permit = sem.acquire(SEMAPHORE_KEY, ttl=TTL)
        renewed = mutex.acquire(RENEWED_KEY, ttl=RENEW_TTL, auto_renew=True)
        assert lock is not None
        assert permit is not None
        assert renewed is not None
        losses = _report_acquired(reports, lock, permit, renewed)
        assert go.wait(STEP_TIMEOUT), "the test never let the holder go on"
        # Continued: the holder acts as if no time had passed.
        results = {
            "mutex": stale_calls(mutex, MUTEX_KEY, lock),
            "semaphore": stale_calls(sem, SEMAPHORE_KEY, permit),
        }
        waited = renewed.wait_lost(STEP_TIMEOUT)
        until(lambda: bool(losses), "on_lost was called", STEP_TIMEOUT)
        return {
            **results,
            "renewed": {
                "wait_lost": waited,
                "lost": renewed.lost,
                "on_lost": list(losses),
                "release": renewed.release(),
            },
        }
    finally:
        backend.close()
        if loop is not None:
            loop.close()


def paused_holder(
    face: FaceName, path: str, reports: Reports, go: multiprocessing.synchronize.Event
) -> None:
    """The child (module level: spawn imports this module to find it)."""
    processes.send_results(reports, lambda: _holder(face, path, reports, go))


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_holder_paused_past_its_ttl_cannot_touch_its_successors(
    face: FaceName, tmp_path: Path
) -> None:
    """SIGSTOP past the TTL, keys taken over, SIGCONT: the old holder's extends and releases
    return False, its auto_renew lease is reported lost, the new rows are untouched."""
    path = tmp_path / "locks.db"
    backend = SQLiteBackend(path)
    mutex = DMutex(SERVICE, backend)
    sem = DSemaphore(SERVICE, backend, max_permits=PERMITS)
    # Hold the other permit, so that the holder and the taker meet in one slot.
    filler = sem.acquire(SEMAPHORE_KEY, ttl=FILL_TTL)
    assert filler is not None

    with processes.spawned(paused_holder, face, str(path)) as child:
        acquired = child.report("acquired", START_TIMEOUT)
        assert isinstance(acquired, list)
        leases: list[Held] = acquired
        assert leases[1].slot != filler.slot, "the holder got the permit the test holds"
        child.stop(STEP_TIMEOUT, poll=POLL)
        for held in leases:

            def expired(held: Held = held) -> bool:
                found = row(path, held.table, held.name)
                return found is None or found[0] != held.token or found[1] <= now_ms()

            until(expired, f"the paused holder's lease {held.key} expired", STEP_TIMEOUT)

        takers = [
            mutex.acquire(MUTEX_KEY, ttl=NEW_TTL),
            sem.acquire(SEMAPHORE_KEY, ttl=NEW_TTL),
            mutex.acquire(RENEWED_KEY, ttl=NEW_TTL),
        ]
        before: list[Row | None] = []
        for held, taker in zip(leases, takers, strict=True):
            assert taker is not None, f"the expired lease {held.key} should be free"
            taken = _held(held.table, taker)
            assert taken.slot == held.slot, "the taker should get the expired slot"
            assert held.fence is not None
            assert taken.fence is not None
            assert taken.fence > held.fence
            before.append(row(path, held.table, held.name))
            assert before[-1] is not None
            assert before[-1][0] == taker.token

        child.go_on()
        results = child.finish("results", STEP_TIMEOUT)

    try:
        after = [row(path, held.table, held.name) for held in leases]
        assert after == before, "the paused holder changed its successors' rows"
        assert isinstance(results, dict)
        for kind in ("mutex", "semaphore"):
            assert results[kind] == dict.fromkeys(CALLS, False), kind
        assert results["renewed"] == {
            "wait_lost": True,
            "lost": True,
            "on_lost": [True],
            "release": False,
        }
        for taker in takers:
            assert taker is not None
            assert taker.release()
        assert filler.release()
    finally:
        backend.close()


# --- cancellation ------------------------------------------------------------------------------

CANCEL_PERMITS = 3
CANCEL = Plan(
    "sqlite",
    batches=80,
    batch=8,
    keys=("job-a", "job-b"),
    cancel_after=0.05,
    ttl=30.0,
    timeout=0.1,
    retry_delay=0.01,
    body=0.003,
)
RUN_DELAY = 0.003  # the worker's sleep before a call, at most (the phase `running`)
ANSWER_DELAY = 0.002  # and after it, before the reply goes back (`answered`)
SEED = 20261202
PHASES = ("queued", "running", "answered")


class PhasedBackend(SQLiteBackend):
    """An SQLiteBackend whose asyncio calls note, for their task, where they are.

    ``queued``: submitted, waiting for the worker thread; ``running``: in
    SQLite, after a short sleep; ``answered``: SQLite done, a short sleep
    before the reply goes back to the loop.
    """

    def __init__(self, path: Path, rng: random.Random) -> None:
        super().__init__(path)
        self.rng = rng
        self.calls: Counter[str] = Counter()

    def call_async(self, fn: Callable[[sqlite3.Connection], T]) -> asyncio.Future[T]:
        trial = current()
        if trial is None:
            return super().call_async(fn)
        stage = trial.stage
        before, after = self.rng.uniform(0, RUN_DELAY), self.rng.uniform(0, ANSWER_DELAY)
        self.calls[stage] += 1

        def phased(conn: sqlite3.Connection) -> T:
            trial.doing = f"{stage}/running"
            time.sleep(before)
            result = fn(conn)
            trial.doing = f"{stage}/answered"
            time.sleep(after)
            return result

        trial.doing = f"{stage}/queued"
        return super().call_async(phased)


def _active_permits(conn: sqlite3.Connection) -> dict[str, str]:
    """Every active permit row of both tables: ``{table/key: token}``."""
    found: dict[str, str] = {}
    now = now_ms()
    for table in (MUTEX_TABLE, SEMAPHORE_TABLE):
        for key, value in conn.execute(
            f'SELECT "key", "value" FROM "{table}" '
            'WHERE "key" LIKE \'permit:%\' AND "expired_at" > ?',
            (now,),
        ).fetchall():
            found[f"{table}/{key}"] = str(value)
    return found


async def _run_trials(backend: PhasedBackend, path: Path, rng: random.Random) -> Tally:
    clock = NotingClock()
    faces: dict[str, Face] = {
        "mutex": AsyncDMutex(SERVICE, backend, clock=clock),
        "semaphore": AsyncDSemaphore(SERVICE, backend, max_permits=CANCEL_PERMITS, clock=clock),
    }
    for face in faces.values():
        await face.ready()
    with raw(path) as inspector:

        def clear() -> None:
            inspector.execute(f'DELETE FROM "{MUTEX_TABLE}" WHERE "key" LIKE \'permit:%\'')
            inspector.execute(f'DELETE FROM "{SEMAPHORE_TABLE}" WHERE "key" LIKE \'permit:%\'')

        storage = Storage(permits=lambda: _active_permits(inspector), clear=clear)
        tally = await run_trials(CANCEL, faces, storage, rng)
    tally.calls = backend.calls
    return tally


def test_cancelled_asyncio_calls_leave_no_lease_and_close_leaves_no_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancellations in every phase of a call, in bodies and retry waits: no orphan rows,
    every accepted cancellation propagates, and close() stops the worker thread."""
    note_retry_waits(monkeypatch)
    assert worker_threads() == [], "a worker thread from an earlier test is still alive"
    path = tmp_path / "locks.db"
    rng = random.Random(SEED)
    backend = PhasedBackend(path, rng)
    try:
        tally = asyncio.run(_run_trials(backend, path, rng))
        assert len(worker_threads()) == 1, "one worker thread per backend"
    finally:
        backend.close()
    summary = judge(tally)
    assert worker_threads() == [], "close() left the worker thread running"
    with raw(path) as conn:
        assert _active_permits(conn) == {}
    for where in (
        "body",
        "retry wait",
        *(f"{s}/{p}" for s in ("acquire", "release") for p in PHASES),
    ):
        assert tally.landed[where] > 0, f"no cancellation landed at {where}\n{summary}"


# --- a busy file ---------------------------------------------------------------------------------

BUSY_TIMEOUT = 0.2  # the backend's: how long a call waits for the file
BUSY_KEY = "report"


def grants_the_next_fence(lock: DMutex | DSemaphore, last: int) -> None:
    """``lock`` grants BUSY_KEY with the fence next after ``last`` (by the clock around
    the call), and releases it."""
    start_us = now_us()
    handle = lock.acquire(BUSY_KEY, ttl=NEW_TTL)
    end_us = now_us()
    assert handle is not None
    assert handle.fence is not None
    assert next_fence(last, start_us) <= handle.fence <= next_fence(last, end_us)
    assert handle.release()


def test_a_busy_file_makes_calls_with_a_short_timeout_raise_and_change_nothing(
    tmp_path: Path,
) -> None:
    """While another connection holds BEGIN IMMEDIATE: acquire (fenced, unfenced, semaphore,
    with retry; both faces), release and extend raise OperationalError; no row changes.
    After the blocker commits, the same calls work and each fence is the next by the rule
    from the counter the failed calls left alone."""
    path = tmp_path / "locks.db"
    backend = SQLiteBackend(path, timeout=BUSY_TIMEOUT)
    try:
        mutex = DMutex(SERVICE, backend)
        plain = DMutex(SERVICE, backend, fencing=False, table_name="plain")
        sem = DSemaphore(SERVICE, backend, max_permits=2)
        amutex = AsyncDMutex(SERVICE, backend)
        firsts: list[int | None] = []
        for face in (mutex, plain, sem):  # tables and fence rows exist before the blocker
            first = face.acquire(BUSY_KEY, ttl=NEW_TTL)
            assert first is not None
            firsts.append(first.fence)
            assert first.release()
        mutex_fence, unfenced_fence, sem_fence = firsts
        assert mutex_fence is not None
        assert unfenced_fence is None
        assert sem_fence is not None
        held = mutex.acquire("held", ttl=NEW_TTL)
        assert held is not None

        async def async_acquire() -> object:
            return await amutex.acquire(BUSY_KEY, ttl=NEW_TTL)

        attempts: dict[str, Callable[[], object]] = {
            "mutex acquire": lambda: mutex.acquire(BUSY_KEY, ttl=NEW_TTL),
            "unfenced acquire": lambda: plain.acquire(BUSY_KEY, ttl=NEW_TTL),
            "semaphore acquire": lambda: sem.acquire(BUSY_KEY, ttl=NEW_TTL),
            "acquire_with_retry": lambda: mutex.acquire_with_retry(
                BUSY_KEY, ttl=NEW_TTL, timeout=1.0, retry_delay=0.05
            ),
            "async acquire": lambda: asyncio.run(async_acquire()),
            "extend": lambda: held.extend(NEW_TTL),
            "release": held.release,
        }
        with raw(path) as blocker:
            before = dump(blocker)
            blocker.execute("BEGIN IMMEDIATE")
            try:
                outcomes: dict[str, str] = {}
                for name, attempt in attempts.items():
                    try:
                        outcomes[name] = f"returned {attempt()!r}"
                    except sqlite3.OperationalError as error:
                        outcomes[name] = f"OperationalError: {error}"
                during = dump(blocker)
            finally:
                blocker.execute("COMMIT")
            after = dump(blocker)
        expected = dict.fromkeys(attempts, "OperationalError: database is locked")
        assert outcomes == expected
        assert during == before, "a call that raised changed a row"
        assert after == before
        assert not held.lost, "a release that could not reach the file does not lose the lease"

        # The blocker is gone: everything works, each fence the next after the first
        # grant's (the rows above show that no failed call moved a counter).
        grants_the_next_fence(mutex, mutex_fence)
        unfenced = plain.acquire(BUSY_KEY, ttl=NEW_TTL)
        assert unfenced is not None
        assert unfenced.fence is None
        assert unfenced.release()
        grants_the_next_fence(sem, sem_fence)
        assert held.extend(NEW_TTL)
        assert held.release()
    finally:
        backend.close()
    assert worker_threads() == []


TICKS = 50  # ticker ticks that must pass while the acquire waits for the file


class WatchedBackend(SQLiteBackend):
    """An SQLiteBackend that says when one of its asyncio calls has started in SQLite."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)  # the default timeout: the acquire waits, it does not fail
        self.started = threading.Event()

    def call_async(self, fn: Callable[[sqlite3.Connection], T]) -> asyncio.Future[T]:
        def watched(conn: sqlite3.Connection) -> T:
            self.started.set()
            return fn(conn)

        return super().call_async(watched)


def test_the_event_loop_runs_while_an_asyncio_acquire_waits_for_a_busy_file(
    tmp_path: Path,
) -> None:
    """A ticker task keeps ticking while an AsyncDMutex.acquire waits on the file lock
    another connection holds; the acquire completes once the blocker commits."""
    path = tmp_path / "locks.db"
    backend = WatchedBackend(path)

    async def main() -> tuple[int, object, tuple[int, int]]:
        amutex = AsyncDMutex(SERVICE, backend)
        await amutex.ready()
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.002)
                ticks += 1

        ticking = asyncio.create_task(ticker())
        try:
            with raw(path) as blocker:
                blocker.execute("BEGIN IMMEDIATE")
                try:
                    backend.started.clear()
                    acquiring = asyncio.create_task(amutex.acquire(BUSY_KEY, ttl=NEW_TTL))
                    deadline = time.monotonic() + STEP_TIMEOUT
                    while not backend.started.is_set():  # the call is in SQLite, waiting
                        assert time.monotonic() < deadline, "the acquire never reached SQLite"
                        await asyncio.sleep(POLL)
                    start = ticks
                    while ticks < start + TICKS:
                        assert time.monotonic() < deadline, f"{ticks - start} ticks only"
                        await asyncio.sleep(POLL)
                    waited = ticks - start
                    assert not acquiring.done(), "the acquire ended while the file was busy"
                finally:
                    freed = now_us()
                    blocker.execute("COMMIT")
            lock = await asyncio.wait_for(acquiring, STEP_TIMEOUT)
            after = now_us()
        finally:
            ticking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticking
        assert lock is not None
        assert await lock.release()
        return waited, lock, (freed, after)

    try:
        waited, lock, (freed, after) = asyncio.run(main())
    finally:
        backend.close()
    assert waited >= TICKS
    assert isinstance(lock, AsyncDMutexLock)
    assert lock.fence is not None
    # The key's first grant: the clock, read in the transaction, once the file was free.
    assert freed <= lock.fence <= after
    assert worker_threads() == []

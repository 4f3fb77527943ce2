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
  no row; after the blocker commits they work, with the next fence. The
  asyncio face waits for the file in its worker thread: the event loop keeps
  running meanwhile (a ticker task's ticks are counted, not timed).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import os
import queue
import random
import signal
import sqlite3
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeAlias, TypeVar

import pytest

from dmutex import (
    AsyncDMutex,
    AsyncDMutexLock,
    AsyncDSemaphore,
    AsyncDSemaphorePermit,
    DMutex,
    DMutexLock,
    DSemaphore,
    DSemaphorePermit,
    SQLiteBackend,
    SystemClock,
)
from dmutex._core.waiting import Wakeup
from dmutex._faces import drive
from tests._support.sampling import until, wait_stopped

T = TypeVar("T")
FaceName: TypeAlias = Literal["sync", "async"]
Reports: TypeAlias = "multiprocessing.queues.Queue[tuple[str, object]]"
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
    names = [
        str(name)
        for (name,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
        ).fetchall()
    ]
    return {name: sorted(conn.execute(f'SELECT * FROM "{name}"').fetchall()) for name in names}


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


def worker_threads() -> list[threading.Thread]:
    """The SQLite backends' worker threads alive in this process."""
    return [t for t in threading.enumerate() if t.name.startswith("dmutex-sqlite")]


# --- pause: a holder stopped past its TTL ----------------------------------------------------

MUTEX_KEY = "paused-mutex"
SEMAPHORE_KEY = "paused-semaphore"
RENEWED_KEY = "paused-renewed"
PERMITS = 2
TTL = 0.5  # the paused holder's plain leases
RENEW_TTL = 1.0  # its auto_renew lease (renewed every third of it until the stop)
NEW_TTL = 20.0  # the new holders'
STALE_TTL = 60.0  # what the paused holder's extends ask for: longer than NEW_TTL
FILL_TTL = 30.0  # the semaphore's other permit, held by the test throughout
PLAIN_CALLS = ("extend by handle", "extend by token", "release by handle", "release by token")


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
    assert isinstance(lease, (DMutexLock, DSemaphorePermit, AsyncDMutexLock, AsyncDSemaphorePermit))
    slot = lease.slot if isinstance(lease, (DSemaphorePermit, AsyncDSemaphorePermit)) else 0
    return Held(table, lease.key, lease.token, slot, lease.fence)


def _sync_holder(path: str, reports: Reports, go: multiprocessing.synchronize.Event) -> object:
    backend = SQLiteBackend(path)
    try:
        mutex = DMutex(SERVICE, backend)
        sem = DSemaphore(SERVICE, backend, max_permits=PERMITS)
        lock = mutex.acquire(MUTEX_KEY, ttl=TTL)
        permit = sem.acquire(SEMAPHORE_KEY, ttl=TTL)
        renewed = mutex.acquire(RENEWED_KEY, ttl=RENEW_TTL, auto_renew=True)
        assert lock is not None
        assert permit is not None
        assert renewed is not None
        losses: list[bool] = []
        renewed.on_lost(lambda handle: losses.append(handle.lost))
        reports.put(
            (
                "acquired",
                [
                    _held(MUTEX_TABLE, lock),
                    _held(SEMAPHORE_TABLE, permit),
                    _held(MUTEX_TABLE, renewed),
                ],
            )
        )
        assert go.wait(STEP_TIMEOUT), "the test never let the holder go on"
        # Continued: the holder acts as if no time had passed.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # unlock(): by token
            results = {
                "mutex": {
                    "extend by handle": lock.extend(STALE_TTL),
                    "extend by token": mutex.extend(MUTEX_KEY, lock.token, STALE_TTL),
                    "release by handle": lock.release(),
                    "release by token": mutex.unlock(MUTEX_KEY, lock.token),
                },
                "semaphore": {
                    "extend by handle": permit.extend(STALE_TTL),
                    "extend by token": sem.extend(SEMAPHORE_KEY, permit.token, STALE_TTL),
                    "release by handle": permit.release(),
                    "release by token": sem.release(SEMAPHORE_KEY, permit.token),
                },
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


async def _async_holder(
    path: str, reports: Reports, go: multiprocessing.synchronize.Event
) -> object:
    backend = SQLiteBackend(path)
    try:
        mutex = AsyncDMutex(SERVICE, backend)
        sem = AsyncDSemaphore(SERVICE, backend, max_permits=PERMITS)
        lock = await mutex.acquire(MUTEX_KEY, ttl=TTL)
        permit = await sem.acquire(SEMAPHORE_KEY, ttl=TTL)
        renewed = await mutex.acquire(RENEWED_KEY, ttl=RENEW_TTL, auto_renew=True)
        assert lock is not None
        assert permit is not None
        assert renewed is not None
        losses: list[bool] = []
        renewed.on_lost(lambda handle: losses.append(handle.lost))
        reports.put(
            (
                "acquired",
                [
                    _held(MUTEX_TABLE, lock),
                    _held(SEMAPHORE_TABLE, permit),
                    _held(MUTEX_TABLE, renewed),
                ],
            )
        )
        # Waited for in a thread: the loop goes on renewing until the stop.
        went = await asyncio.get_running_loop().run_in_executor(None, go.wait, STEP_TIMEOUT)
        assert went, "the test never let the holder go on"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # unlock(): by token
            results = {
                "mutex": {
                    "extend by handle": await lock.extend(STALE_TTL),
                    "extend by token": await mutex.extend(MUTEX_KEY, lock.token, STALE_TTL),
                    "release by handle": await lock.release(),
                    "release by token": await mutex.unlock(MUTEX_KEY, lock.token),
                },
                "semaphore": {
                    "extend by handle": await permit.extend(STALE_TTL),
                    "extend by token": await sem.extend(SEMAPHORE_KEY, permit.token, STALE_TTL),
                    "release by handle": await permit.release(),
                    "release by token": await sem.release(SEMAPHORE_KEY, permit.token),
                },
            }
        waited = await renewed.wait_lost(STEP_TIMEOUT)
        deadline = time.monotonic() + STEP_TIMEOUT
        while not losses:
            assert time.monotonic() < deadline, "on_lost was never called"
            await asyncio.sleep(POLL)
        return {
            **results,
            "renewed": {
                "wait_lost": waited,
                "lost": renewed.lost,
                "on_lost": list(losses),
                "release": await renewed.release(),
            },
        }
    finally:
        backend.close()


def paused_holder(
    face: FaceName, path: str, reports: Reports, go: multiprocessing.synchronize.Event
) -> None:
    """The child (module level: spawn imports this module to find it)."""
    try:
        if face == "sync":
            results = _sync_holder(path, reports, go)
        else:
            results = asyncio.run(_async_holder(path, reports, go))
    except BaseException:
        reports.put(("error", traceback.format_exc()))
        raise
    reports.put(("results", results))


def _report(reports: Reports, expected: str, timeout: float) -> object:
    try:
        kind, payload = reports.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"the holder sent no {expected!r} report within {timeout} s")
    if kind == "error":
        pytest.fail(f"the holder raised:\n{payload}")
    assert kind == expected
    return payload


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

    ctx = multiprocessing.get_context("spawn")
    reports: Reports = ctx.Queue()
    go = ctx.Event()
    child = ctx.Process(target=paused_holder, args=(face, str(path), reports, go), daemon=True)
    child.start()
    stopped = False
    try:
        acquired = _report(reports, "acquired", START_TIMEOUT)
        assert isinstance(acquired, list)
        leases: list[Held] = acquired
        assert leases[1].slot != filler.slot, "the holder got the permit the test holds"
        assert child.pid is not None
        os.kill(child.pid, signal.SIGSTOP)
        stopped = True
        wait_stopped(child.pid, STEP_TIMEOUT, poll=POLL)
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

        os.kill(child.pid, signal.SIGCONT)
        stopped = False
        go.set()
        results = _report(reports, "results", STEP_TIMEOUT)
        child.join(STEP_TIMEOUT)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            if stopped and child.pid is not None:
                os.kill(child.pid, signal.SIGCONT)
            child.terminate()
            child.join(5)
            if child.is_alive():
                child.kill()
                child.join(5)
        child.close()
        reports.close()
        reports.join_thread()

    try:
        after = [row(path, held.table, held.name) for held in leases]
        assert after == before, "the paused holder changed its successors' rows"
        assert isinstance(results, dict)
        for kind in ("mutex", "semaphore"):
            assert results[kind] == dict.fromkeys(PLAIN_CALLS, False), kind
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

CANCEL_TTL = 30.0  # far longer than the test: an orphan stays visible
CANCEL_PERMITS = 3
CANCEL_KEYS = ("job-a", "job-b")
BATCH = 8  # concurrent tasks per batch
BATCHES = 80
RUN_DELAY = 0.003  # the worker's sleep before a call, at most (the phase `running`)
ANSWER_DELAY = 0.002  # and after it, before the reply goes back (`answered`)
BODY = 0.003  # the body's sleep, at most
CANCEL_AFTER = 0.05  # a task is cancelled after uniform(0, this) seconds
RETRY_TIMEOUT, RETRY_DELAY = 0.1, 0.01
SETTLE = 10.0  # the longest wait for the loop's tasks to finish after a batch
SEED = 20261202
PHASES = ("queued", "running", "answered")

PATTERNS = {
    "mutex": ("run", "run_with_retry", "async with", "release"),
    "semaphore": ("run", "run_with_retry", "async with", "release", "token release"),
}

Face: TypeAlias = AsyncDMutex | AsyncDSemaphore


@dataclass
class Trial:
    """One task: what it does, and where its cancellation landed."""

    number: int
    kind: str
    pattern: str
    stage: str = "acquire"
    """``acquire`` until the body ends, then ``release``."""
    doing: str = "start"
    """What the task awaits now: ``stage/phase`` of a call, ``body``, ``retry wait``."""
    cancel_accepted: bool = False
    landed: str | None = None
    tokens: set[str] = field(default_factory=set)


CURRENT: dict[asyncio.Task[None], Trial] = {}


def current() -> Trial | None:
    task = asyncio.current_task()
    return None if task is None else CURRENT.get(task)


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


class NotingClock(SystemClock):
    """The system clock, saying when a task is in a retry wait."""

    async def sleep_async(self, seconds: float) -> None:
        trial = current()
        if trial is None:
            await asyncio.sleep(seconds)
            return
        before, trial.doing = trial.doing, "retry wait"
        try:
            await asyncio.sleep(seconds)
        finally:
            trial.doing = before


async def _body(trial: Trial, rng: random.Random) -> None:
    """The guarded work: a short sleep. Whatever happens, what follows is the release."""
    trial.doing = "body"
    try:
        await asyncio.sleep(rng.uniform(0, BODY))
    finally:
        trial.stage = "release"
        trial.doing = "release/between"


async def _run_trial(
    trial: Trial, face: Face, key: str, believed: set[str], rng: random.Random
) -> None:
    """Use ``face`` on ``key`` in ``trial.pattern``; ``believed`` holds the tokens held."""

    async def callback(handle: AsyncDMutexLock | AsyncDSemaphorePermit) -> None:
        trial.tokens.add(handle.token)
        await _body(trial, rng)

    if trial.pattern == "run":
        await face.run(key, callback, ttl=CANCEL_TTL)
        return
    if trial.pattern == "run_with_retry":
        await face.run_with_retry(
            key, callback, ttl=CANCEL_TTL, timeout=RETRY_TIMEOUT, retry_delay=RETRY_DELAY
        )
        return
    if trial.pattern == "async with":
        handle = await face.acquire_with_retry(
            key, ttl=CANCEL_TTL, timeout=RETRY_TIMEOUT, retry_delay=RETRY_DELAY
        )
    else:
        handle = await face.acquire(key, ttl=CANCEL_TTL)
    if handle is None:
        trial.stage = "done"
        return
    token = handle.token
    trial.tokens.add(token)
    believed.add(token)  # no await since the acquire returned: nothing can land between
    if trial.pattern == "async with":
        async with handle:
            try:
                await _body(trial, rng)
            finally:
                believed.discard(token)
        return
    try:
        await _body(trial, rng)
    finally:
        believed.discard(token)  # from here on, the task means to hold nothing
        if trial.pattern == "release":
            await handle.release()
        else:
            assert isinstance(face, AsyncDSemaphore)
            await face.release(key, token)


@dataclass
class Tally:
    trials: Counter[str] = field(default_factory=Counter)
    accepted: int = 0
    landed: Counter[str] = field(default_factory=Counter)
    orphans: Counter[str] = field(default_factory=Counter)
    swallowed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return "\n".join(
            [
                f"sqlite: {sum(self.trials.values())} trials {dict(self.trials)}",
                f"  cancel() accepted: {self.accepted}; by what the task awaited then: "
                f"{dict(sorted(self.landed.items()))}",
                f"  orphans: {sum(self.orphans.values())} {dict(sorted(self.orphans.items()))}",
                f"  swallowed cancellations: {len(self.swallowed)} {self.swallowed[:5]}",
                f"  other errors: {len(self.errors)} {self.errors[:5]}",
            ]
        )


def _check_task(trial: Trial, task: asyncio.Task[None], tally: Tally) -> None:
    """A task whose cancel() was accepted ended cancelled; any other ended without error."""
    if trial.cancel_accepted:
        tally.accepted += 1
        tally.landed[trial.landed or "unknown"] += 1
        if not task.cancelled():
            error = task.exception()
            tally.swallowed.append(
                f"trial {trial.number} {trial.kind} {trial.pattern} at {trial.landed}: "
                f"{'returned' if error is None else repr(error)}"
            )
        return
    if task.cancelled():
        tally.errors.append(f"trial {trial.number} cancelled without a cancel()")
    elif task.exception() is not None:
        tally.errors.append(f"trial {trial.number} {trial.pattern}: {task.exception()!r}")


async def _settle() -> None:
    """Wait until every other task of the loop has finished."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE
    me = asyncio.current_task()
    while True:
        others = {task for task in asyncio.all_tasks() if task is not me}
        if not others:
            return
        remaining = deadline - loop.time()
        assert remaining > 0, f"{len(others)} task(s) still running {SETTLE} s after a batch"
        await asyncio.wait(others, timeout=remaining)


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


async def _run_trials(
    backend: PhasedBackend, path: Path, rng: random.Random
) -> tuple[Tally, dict[str, int]]:
    clock = NotingClock()
    faces: dict[str, Face] = {
        "mutex": AsyncDMutex(SERVICE, backend, clock=clock),
        "semaphore": AsyncDSemaphore(SERVICE, backend, max_permits=CANCEL_PERMITS, clock=clock),
    }
    for face in faces.values():
        await face.ready()
    tally = Tally()
    believed: set[str] = set()
    owners: dict[str, Trial] = {}
    loop = asyncio.get_running_loop()
    number = 0
    with raw(path) as inspector:
        for _ in range(BATCHES):
            batch: list[tuple[Trial, asyncio.Task[None]]] = []
            timers: list[asyncio.TimerHandle] = []
            for _ in range(BATCH):
                kind = rng.choice(sorted(faces))
                trial = Trial(number, kind, rng.choice(PATTERNS[kind]))
                number += 1
                tally.trials[f"{kind} {trial.pattern}"] += 1
                task = asyncio.create_task(
                    _run_trial(trial, faces[kind], rng.choice(CANCEL_KEYS), believed, rng)
                )
                CURRENT[task] = trial
                batch.append((trial, task))

                def cancel(trial: Trial = trial, task: asyncio.Task[None] = task) -> None:
                    trial.cancel_accepted = task.cancel()
                    if trial.cancel_accepted:
                        trial.landed = trial.doing

                timers.append(loop.call_later(rng.uniform(0, CANCEL_AFTER), cancel))
            await asyncio.wait([task for _, task in batch])
            for timer in timers:
                timer.cancel()
            await _settle()
            for trial, task in batch:
                _check_task(trial, task, tally)
                del CURRENT[task]
                owners.update(dict.fromkeys(trial.tokens, trial))
            for name, token in _active_permits(inspector).items():
                if token in believed:
                    continue
                owner = owners.get(token)
                where = "unknown" if owner is None else owner.landed or "not cancelled"
                tally.orphans[f"{name} ({where})"] += 1
            inspector.execute(f'DELETE FROM "{MUTEX_TABLE}" WHERE "key" LIKE \'permit:%\'')
            inspector.execute(f'DELETE FROM "{SEMAPHORE_TABLE}" WHERE "key" LIKE \'permit:%\'')
    assert not believed, f"tokens still believed held after every trial ended: {believed}"
    return tally, dict(backend.calls)


def test_cancelled_asyncio_calls_leave_no_lease_and_close_leaves_no_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancellations in every phase of a call, in bodies and retry waits: no orphan rows,
    every accepted cancellation propagates, and close() stops the worker thread."""
    # On the system clock a registered waiter waits for a release of the same backend
    # (the driver's _woken), not in the clock's sleep_async: say so there as well.
    woken = drive._woken

    async def noting(wakeup: Wakeup, seconds: float) -> None:
        trial = current()
        if trial is None:
            await woken(wakeup, seconds)
            return
        before, trial.doing = trial.doing, "retry wait"
        try:
            await woken(wakeup, seconds)
        finally:
            trial.doing = before

    monkeypatch.setattr(drive, "_woken", noting)
    assert worker_threads() == [], "a worker thread from an earlier test is still alive"
    path = tmp_path / "locks.db"
    rng = random.Random(SEED)
    backend = PhasedBackend(path, rng)
    try:
        tally, calls = asyncio.run(_run_trials(backend, path, rng))
        assert len(worker_threads()) == 1, "one worker thread per backend"
    finally:
        backend.close()
    summary = f"{tally.summary()}\n  calls by stage: {calls}"
    print(summary)
    assert worker_threads() == [], "close() left the worker thread running"
    with raw(path) as conn:
        assert _active_permits(conn) == {}
    assert tally.accepted > 0, summary
    assert not tally.errors, summary
    assert not tally.swallowed, summary
    assert sum(tally.orphans.values()) == 0, summary
    for where in (
        "body",
        "retry wait",
        *(f"{s}/{p}" for s in ("acquire", "release") for p in PHASES),
    ):
        assert tally.landed[where] > 0, f"no cancellation landed at {where}\n{summary}"


# --- a busy file ---------------------------------------------------------------------------------

BUSY_TIMEOUT = 0.2  # the backend's: how long a call waits for the file
BUSY_KEY = "report"


def test_a_busy_file_makes_calls_with_a_short_timeout_raise_and_change_nothing(
    tmp_path: Path,
) -> None:
    """While another connection holds BEGIN IMMEDIATE: acquire (fenced, unfenced, semaphore,
    with retry; both faces), release and extend raise OperationalError; no row changes.
    After the blocker commits, the same calls work and the fences go on by one."""
    path = tmp_path / "locks.db"
    backend = SQLiteBackend(path, timeout=BUSY_TIMEOUT)
    try:
        mutex = DMutex(SERVICE, backend)
        plain = DMutex(SERVICE, backend, fencing=False, table_name="plain")
        sem = DSemaphore(SERVICE, backend, max_permits=2)
        amutex = AsyncDMutex(SERVICE, backend)
        for face in (mutex, plain, sem):  # tables and fence rows exist before the blocker
            first = face.acquire(BUSY_KEY, ttl=NEW_TTL)
            assert first is not None
            assert first.release()
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

        # The blocker is gone: everything works, and no failed call used up a fence.
        lock = mutex.acquire(BUSY_KEY, ttl=NEW_TTL)
        assert lock is not None
        assert lock.fence == 2
        assert lock.release()
        unfenced = plain.acquire(BUSY_KEY, ttl=NEW_TTL)
        assert unfenced is not None
        assert unfenced.fence is None
        assert unfenced.release()
        permit = sem.acquire(BUSY_KEY, ttl=NEW_TTL)
        assert permit is not None
        assert permit.fence == 2
        assert permit.release()
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

    async def main() -> tuple[int, object]:
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
                    blocker.execute("COMMIT")
            lock = await asyncio.wait_for(acquiring, STEP_TIMEOUT)
        finally:
            ticking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticking
        assert lock is not None
        assert await lock.release()
        return waited, lock

    try:
        waited, lock = asyncio.run(main())
    finally:
        backend.close()
    assert waited >= TICKS
    assert isinstance(lock, AsyncDMutexLock)
    assert lock.fence == 1
    assert worker_threads() == []

"""Several OS processes of this host sharing one SQLite lock file.

Each worker is a separate process started with ``spawn`` (through
``processes.run_workers``): it opens its own :class:`SQLiteBackend` on the
shared file, waits on a barrier so that all of them start together, runs its
cycles and reports a :class:`Report` (or the traceback of what it raised).
A worker that has not reported by the deadline is terminated and the test
fails.

What the lock guards is outside SQLite, in plain files of the test's
directory, so that a lost update or an overlap cannot hide in the store:

- the counter file holds ``count fence worker``: a read-modify-write of it
  under the lock loses updates unless the lock excludes, the count read is
  the grant's place in the grant order, the fence written by the previous
  holder must be lower than the current holder's, and the worker that wrote
  last tells the next holder whether the lock changed hands;
- the marker file is created with ``O_EXCL`` on entry and removed on exit:
  finding it there on entry, or gone on exit, is an overlap;
- the semaphore's gauge is a count of holders kept under ``flock`` (a lock
  SQLite does not use), with one ``O_EXCL`` marker per slot.

Each cycle first tries one plain ``acquire()``; when that is refused the
worker counts it and falls back to ``acquire_with_retry()``. In the mutex
tests even workers use the sync face and odd ones the asyncio face.

Fences (``dmutex._core.fences``) are each the larger of the stored counter
plus one and the host's clock in microseconds, read in the grant's
transaction: so each lies between the test's clock readings before the
workers start and after they end (plus one for each grant that may have
followed another within a microsecond), and they strictly increase in grant
order.

Also here: processes that open a new file together; a holder killed by
SIGKILL keeps its lease until its TTL and leaves the file intact; a file
shared by root and ``nobody``; and a backend object used on both sides of a
``fork()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import os
import pwd
import select
import shutil
import signal
import sqlite3
import stat
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import pytest

from dmutex import AsyncDMutex, AsyncDSemaphore, DMutex, DSemaphore, SQLiteBackend
from dmutex._core.fences import next_fence
from tests._support import processes, sqlite_rows
from tests._support.processes import BARRIER_TIMEOUT, DEADLINE

KEY = "orders"
SERVICE = "procs"
MUTEX_TABLE = f"_dmutex_{SERVICE}"
SEMAPHORE_TABLE = f"_dsemaphore_{SERVICE}"

TTL = 30.0  # far longer than any test: no lease may expire while held
RETRY_TIMEOUT = 60.0
RETRY_DELAY = 0.001
RETRY = processes.Retry(TTL, RETRY_TIMEOUT, RETRY_DELAY)
STEP_TIMEOUT = 30.0  # any one wait of a single-holder test
POLL = 0.02

PROCESSES = 8
CYCLES = 1000
SEM_PROCESSES = 6
SEM_CYCLES = 300
SEM_PERMITS = 3
SHARED_CYCLES = 300  # per worker, root and nobody
SHARED_PAUSE = 0.001  # between a release and the next acquire, in the two-user test
OPENERS = 6  # processes opening one new file together, per trial
OPEN_TRIALS = 80  # without the retry, about 1 trial in 10 fails on this machine
KILL_TTL = 3.0  # the killed holder's lease: long enough to see it stay after the kill

Reports: TypeAlias = processes.Reports
Barrier: TypeAlias = processes.Barrier
ChildReports: TypeAlias = processes.ChildReports


@dataclass(frozen=True)
class Report:
    """What one worker saw."""

    worker: int
    uid: int  # the effective user the worker ran as
    cycles: int  # cycles completed: acquired, worked, released
    refused: int  # plain acquire() attempts that returned None
    overlaps: int  # the marker was there on entry, or gone on exit
    stale: int  # the counter's last fence was not lower than this grant's
    handoffs: int  # cycles whose previous holder was another worker
    failed_releases: int  # release() that returned False
    fences: tuple[int, ...] = ()  # every grant's fence, in this worker's order
    places: tuple[int, ...] = ()  # each grant's place in the grant order (mutex tests)
    peak: int = 0  # most holders at once by the gauge (semaphore test)
    slots: tuple[int, ...] = ()  # every slot a permit reported (semaphore test)


@dataclass
class Tally:
    """A worker's running counts, turned into a Report at the end."""

    worker: int
    cycles: int = 0
    refused: int = 0
    overlaps: int = 0
    stale: int = 0
    handoffs: int = 0
    failed_releases: int = 0
    fences: list[int] = field(default_factory=list)
    places: list[int] = field(default_factory=list)
    peak: int = 0
    slots: set[int] = field(default_factory=set)

    def report(self) -> Report:
        return Report(
            self.worker,
            os.geteuid(),
            self.cycles,
            self.refused,
            self.overlaps,
            self.stale,
            self.handoffs,
            self.failed_releases,
            tuple(self.fences),
            tuple(self.places),
            self.peak,
            tuple(sorted(self.slots)),
        )


# --- the guarded work (plain files beside the lock file) ----------------------------------


def _enter(marker: str) -> bool:
    """Create ``marker`` with O_EXCL; False if it was there (someone else is inside)."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def _leave(marker: str) -> bool:
    """Remove ``marker``; False if it was gone (someone else left meanwhile)."""
    try:
        os.unlink(marker)
    except FileNotFoundError:
        return False
    return True


def _counter_cycle(folder: str, worker: int, fence: int | None, tally: Tally) -> None:
    """Under the lock: note its fence, enter, read-modify-write the counter file (its count
    is the grant's place in the order), leave."""
    assert fence is not None, "SQLite keeps a fence by default"
    tally.fences.append(fence)
    marker = os.path.join(folder, "inside")
    entered = _enter(marker)
    with open(os.path.join(folder, "counter"), "r+") as counter:
        count, last_fence, last_worker = (int(part) for part in counter.read().split())
        counter.seek(0)
        counter.write(f"{count + 1} {fence} {worker}\n")
        counter.truncate()
    tally.places.append(count)
    if last_fence >= fence:
        tally.stale += 1
    if last_worker not in (-1, worker):
        tally.handoffs += 1
    if not entered or not _leave(marker):
        tally.overlaps += 1


def _read_counter(folder: Path) -> tuple[int, int, int]:
    count, fence, worker = (int(part) for part in (folder / "counter").read_text().split())
    return count, fence, worker


def _make_shared_files(folder: Path, mode: int = 0o644) -> Path:
    """The counter (count 0, fence 0, no worker) and the gauge; returns the lock file's path."""
    for name, text in (("counter", "0 0 -1\n"), ("gauge", "0\n")):
        (folder / name).write_text(text)
        os.chmod(folder / name, mode)
    return folder / "locks.db"


# --- workers (module level: spawn imports this module to find them) ---------------------


def _sync_face(backend: SQLiteBackend, permits: int | None) -> DMutex | DSemaphore:
    """A mutex, or a semaphore of ``permits``."""
    if permits is None:
        return DMutex(SERVICE, backend)
    return DSemaphore(SERVICE, backend, max_permits=permits)


def _async_face(backend: SQLiteBackend, permits: int | None) -> AsyncDMutex | AsyncDSemaphore:
    """The asyncio face of :func:`_sync_face`."""
    if permits is None:
        return AsyncDMutex(SERVICE, backend)
    return AsyncDSemaphore(SERVICE, backend, max_permits=permits)


def _cycles(
    worker: int,
    reports: Reports,
    barrier: Barrier,
    folder: str,
    cycles: int,
    permits: int | None,
    work: Callable[[Tally, Any], None],
) -> None:
    """``cycles`` times: take ``KEY`` (a mutex, or a semaphore of ``permits``), ``work``, release.

    Even workers use the sync face, odd ones the asyncio face.
    """
    path = os.path.join(folder, "locks.db")

    def sync_body(tally: Tally) -> None:
        backend = SQLiteBackend(path)
        try:
            face = _sync_face(backend, permits)
            face.ready()
            barrier.wait(BARRIER_TIMEOUT)
            processes.cycle(face, KEY, tally, cycles, lambda lease: work(tally, lease), RETRY)
        finally:
            backend.close()

    async def async_main(tally: Tally) -> None:
        backend = SQLiteBackend(path)
        try:
            face = _async_face(backend, permits)
            await face.ready()
            barrier.wait(BARRIER_TIMEOUT)  # blocking is fine: nothing else runs on this loop

            async def async_work(lease: Any) -> None:
                work(tally, lease)

            await processes.cycle_async(face, KEY, tally, cycles, async_work, RETRY)
        finally:
            backend.close()

    def body(tally: Tally) -> None:
        if worker % 2 == 0:
            sync_body(tally)
        else:
            asyncio.run(async_main(tally))

    processes.report_errors(worker, reports, barrier, Tally(worker), body)


def mutex_counter_worker(
    worker: int, reports: Reports, barrier: Barrier, folder: str, cycles: int
) -> None:
    """``cycles`` times: lock, read-modify-write the counter, unlock; odd workers use asyncio."""

    def work(tally: Tally, lock: Any) -> None:
        _counter_cycle(folder, worker, lock.fence, tally)

    _cycles(worker, reports, barrier, folder, cycles, None, work)


def _gauge(folder: str, delta: int) -> int:
    """Add ``delta`` to the gauge under ``flock``; the new value."""
    with open(os.path.join(folder, "gauge"), "r+") as gauge:
        fcntl.flock(gauge, fcntl.LOCK_EX)
        try:
            value = int(gauge.read()) + delta
            gauge.seek(0)
            gauge.write(f"{value}\n")
            gauge.truncate()
            gauge.flush()
        finally:
            fcntl.flock(gauge, fcntl.LOCK_UN)
    return value


def _permit_cycle(folder: str, slot: int, tally: Tally) -> None:
    """Under a permit: enter the slot's marker, count in, work a little, count out, leave."""
    marker = os.path.join(folder, f"slot-{slot}")
    entered = _enter(marker)
    tally.slots.add(slot)
    tally.peak = max(tally.peak, _gauge(folder, +1))
    time.sleep(0.0005)  # a little work while holding the permit: lets holders overlap
    _gauge(folder, -1)
    if not entered or not _leave(marker):
        tally.overlaps += 1


def semaphore_gauge_worker(
    worker: int, reports: Reports, barrier: Barrier, folder: str, cycles: int, permits: int
) -> None:
    """``cycles`` times: take a permit, count in and out of the gauge, release; odd: asyncio."""

    def work(tally: Tally, permit: Any) -> None:
        assert permit.fence is not None, "SQLite keeps a fence by default"
        tally.fences.append(permit.fence)
        _permit_cycle(folder, permit.slot, tally)

    _cycles(worker, reports, barrier, folder, cycles, permits, work)


def shared_file_worker(
    worker: int,
    reports: Reports,
    barrier: Barrier,
    folder: str,
    cycles: int,
    uid: int,
    gid: int,
) -> None:
    """The sync counter worker; worker 0 first becomes ``uid``/``gid`` (no way back)."""

    def body(tally: Tally) -> None:
        if worker == 0:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        backend = SQLiteBackend(os.path.join(folder, "locks.db"))
        try:
            mutex = DMutex(SERVICE, backend)
            barrier.wait(BARRIER_TIMEOUT)
            mutex.ready()  # after the barrier: either user may be the one creating the table
            processes.cycle(
                mutex,
                KEY,
                tally,
                cycles,
                lambda lock: _counter_cycle(folder, worker, lock.fence, tally),
                RETRY,
                # Without a pause the releasing worker mostly takes the lock straight back
                # (measured: one handoff in 2 x 300 cycles); with it, the two alternate.
                pause=SHARED_PAUSE,
            )
        finally:
            backend.close()

    processes.report_errors(worker, reports, barrier, Tally(worker), body)


# --- the parent side --------------------------------------------------------------------


def run_workers(target: Callable[..., None], count: int, *args: object) -> list[Report]:
    """Start ``count`` processes of ``target`` together; their reports, or a failed test."""
    return processes.run_workers(target, count, *args, deadline=DEADLINE, report=Report)


@contextlib.contextmanager
def raw(path: Path) -> Iterator[sqlite3.Connection]:
    """A plain connection to the lock file, for the test's own reads; closed after."""
    conn = sqlite3.connect(path, timeout=STEP_TIMEOUT, isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()


def rows(path: Path, table: str) -> dict[str, tuple[str, int]]:
    """Every row of ``table`` in the file at ``path``: ``{key: (value, expired_at)}``."""
    with raw(path) as conn:
        return sqlite_rows.rows(conn, table)


def active_permits(path: Path, table: str) -> dict[str, str]:
    """The permit rows of ``table`` still active now: ``{key: token}``."""
    now = round(time.time() * 1000)
    return {
        key: value
        for key, (value, at) in rows(path, table).items()
        if key.startswith("permit:") and at > now
    }


def integrity(path: Path) -> list[str]:
    """``PRAGMA integrity_check``'s lines: ``["ok"]`` for an intact file."""
    with raw(path) as conn:
        return [str(line) for (line,) in conn.execute("PRAGMA integrity_check").fetchall()]


def now_us() -> int:
    """The host's clock in whole microseconds, as SQLiteBackend reads it for a fence."""
    return int(time.time() * 1_000_000)


def _check_fences(fences: list[int], table: str, path: Path, started: int, finished: int) -> None:
    """Every grant its own fence, all taken between the clock readings ``started`` and
    ``finished`` (one more microsecond at most for each grant), and the stored counter
    the largest of them."""
    assert len(set(fences)) == len(fences), "two grants had one fence"
    assert started <= min(fences)
    assert max(fences) <= finished + len(fences)
    assert rows(path, table).get(f"fence:{KEY}") == (str(max(fences)), 2**63 - 1)


def _check_counter(
    reports: list[Report],
    folder: Path,
    path: Path,
    workers: int,
    cycles: int,
    clock: tuple[int, int],
) -> None:
    """No lost update, no overlap, one fence per grant strictly increasing in grant order,
    nothing left held. ``clock``: the host's, in microseconds, before and after the run."""
    processes.check_cycles(reports, workers, cycles)
    assert sum(r.overlaps for r in reports) == 0, "two holders were inside at once"
    count, last_fence, _ = _read_counter(folder)
    # Read-modify-write of a plain file loses updates unless the lock excludes.
    assert count == workers * cycles
    assert sum(r.stale for r in reports) == 0, "a holder followed one with a higher fence"
    grants = sorted(
        (place, fence) for r in reports for place, fence in zip(r.places, r.fences, strict=True)
    )
    assert [place for place, _ in grants] == list(range(workers * cycles)), "one place each"
    fences = [fence for _, fence in grants]
    assert fences == sorted(set(fences)), "fences did not strictly increase in grant order"
    assert last_fence == fences[-1], "the last holder's fence is the largest"
    _check_fences(fences, MUTEX_TABLE, path, *clock)
    assert active_permits(path, MUTEX_TABLE) == {}, "the lock outlived its last release"
    assert integrity(path) == ["ok"]


def _print_figures(name: str, started: float, reports: list[Report]) -> None:
    elapsed = time.monotonic() - started
    refused = [r.refused for r in reports]
    handoffs = sum(r.handoffs for r in reports)
    peak = max(r.peak for r in reports)
    # Shown with -s; no assertion uses the time.
    print(
        f"\n{name}: {len(reports)} workers in {elapsed:.2f} s, refused per worker {refused}, "
        f"{handoffs} handoffs" + (f", peak gauge {peak}" if peak else "")
    )


# --- the tests --------------------------------------------------------------------------


def test_mutex_serializes_read_modify_write_across_8_processes(tmp_path: Path) -> None:
    """8 processes x 1000 cycles on one key, half sync and half asyncio: no lost update."""
    path = _make_shared_files(tmp_path)
    started, clock = time.monotonic(), now_us()
    reports = run_workers(mutex_counter_worker, PROCESSES, str(tmp_path), CYCLES)
    _print_figures("mutex counter", started, reports)
    _check_counter(reports, tmp_path, path, PROCESSES, CYCLES, (clock, now_us()))
    assert sum(r.refused for r in reports) > 0, "the workers never contended"
    assert sum(r.handoffs for r in reports) > 0, "the lock never changed hands"


def test_semaphore_bounds_concurrency_across_processes(tmp_path: Path) -> None:
    """6 processes on a semaphore of 3 permits: never more than 3 inside, never 2 in a slot."""
    path = _make_shared_files(tmp_path)
    started, clock = time.monotonic(), now_us()
    reports = run_workers(
        semaphore_gauge_worker, SEM_PROCESSES, str(tmp_path), SEM_CYCLES, SEM_PERMITS
    )
    finished = now_us()
    _print_figures("semaphore gauge", started, reports)
    processes.check_cycles(reports, SEM_PROCESSES, SEM_CYCLES)
    assert sum(r.overlaps for r in reports) == 0, "two holders were in one slot at once"
    peak = max(r.peak for r in reports)
    assert peak <= SEM_PERMITS, f"{peak} holders at once with {SEM_PERMITS} permits"
    # A refused acquire means every slot was held at that moment: the bound was reached.
    assert sum(r.refused for r in reports) > 0, "the permits were never all in use"
    assert {s for r in reports for s in r.slots} == set(range(SEM_PERMITS))
    assert (tmp_path / "gauge").read_text().split() == ["0"]
    assert active_permits(path, SEMAPHORE_TABLE) == {}, "permits outlived their last release"
    # One fence per grant; each worker's grants came one after another, so its own
    # fences strictly increase (the order across workers holding at once is not known).
    for report in reports:
        assert list(report.fences) == sorted(set(report.fences)), f"worker {report.worker}"
    fences = [fence for r in reports for fence in r.fences]
    assert len(fences) == SEM_PROCESSES * SEM_CYCLES
    _check_fences(fences, SEMAPHORE_TABLE, path, clock, finished)
    assert integrity(path) == ["ok"]


# --- a holder killed mid-lease ------------------------------------------------------------


def killed_holder(
    folder: str, ttl: float, reports: ChildReports, go: multiprocessing.synchronize.Event
) -> None:
    """Hold ``KEY`` for ``ttl``, then take and release another key until killed (bounded)."""
    try:
        backend = SQLiteBackend(os.path.join(folder, "locks.db"))
        mutex = DMutex(SERVICE, backend)
        lock = mutex.acquire(KEY, ttl=ttl)
        assert lock is not None, "the key should be free for the holder"
        expires = round(lock.expired_at.timestamp() * 1000)
        reports.put(("acquired", (lock.token, lock.fence, expires)))
        busy = DSemaphore(SERVICE, backend, max_permits=2)
        ends = time.monotonic() + STEP_TIMEOUT
        cycles = 0
        while time.monotonic() < ends:  # writing all the time: the kill lands in a write
            permit = busy.acquire("busy", ttl=1.0)
            if permit is not None:
                busy.extend("busy", permit.token, 1.0)
                permit.release()
            cycles += 1
            if cycles == 50:
                reports.put(("busy", cycles))
    except BaseException:
        reports.put(("error", traceback.format_exc()))
        raise


def test_a_killed_holder_keeps_its_lease_until_its_ttl_and_the_file_stays_intact(
    tmp_path: Path,
) -> None:
    """SIGKILL mid-lease (and mid-write): the row stays and blocks until its expiry; then
    another process takes the key with a higher fence; integrity_check says ok."""
    path = _make_shared_files(tmp_path)
    spawning = now_us()
    with processes.spawned(killed_holder, str(tmp_path), KILL_TTL, who="the child") as child:
        acquired = child.report("acquired", BARRIER_TIMEOUT)
        assert isinstance(acquired, tuple)
        token, fence, expires = acquired
        assert spawning <= fence <= now_us(), "a new file's first grant: the clock"
        child.report("busy", STEP_TIMEOUT)
        child.kill(STEP_TIMEOUT)

    assert rows(path, MUTEX_TABLE)[f"permit:0:{KEY}"] == (token, expires)
    assert integrity(path) == ["ok"], "the kill left the file corrupt"

    backend = SQLiteBackend(path)
    try:
        mutex = DMutex(SERVICE, backend)
        refused_before_expiry = 0
        taken = None
        deadline = time.monotonic() + KILL_TTL + STEP_TIMEOUT
        while taken is None:
            assert time.monotonic() < deadline, "the dead holder's lease never became free"
            before_us = now_us()
            before = round(time.time() * 1000)
            taken = mutex.acquire(KEY, ttl=TTL)
            after = round(time.time() * 1000)
            after_us = now_us()
            if taken is None:
                # The store's now is at least ``before``: a refusal then means not yet expired.
                assert before < expires, f"refused {before - expires} ms after the expiry"
                refused_before_expiry += 1
                time.sleep(POLL)
            else:
                assert after >= expires, f"granted {expires - after} ms before the expiry"
        assert refused_before_expiry > 0, "no attempt landed before the expiry: raise KILL_TTL"
        assert taken.fence is not None
        assert next_fence(fence, before_us) <= taken.fence <= next_fence(fence, after_us)
        assert rows(path, MUTEX_TABLE)[f"permit:0:{KEY}"][0] == taken.token
        assert rows(path, MUTEX_TABLE)[f"fence:{KEY}"] == (str(taken.fence), 2**63 - 1)
        assert taken.release()
        # The key the child was writing when it died works too.
        busy = DSemaphore(SERVICE, backend, max_permits=2)
        permit = busy.acquire_with_retry("busy", ttl=TTL, timeout=STEP_TIMEOUT)
        assert permit is not None
        assert permit.release()
    finally:
        backend.close()
    assert integrity(path) == ["ok"]


# --- a file shared by two users ------------------------------------------------------------


@pytest.fixture
def shared_folder() -> Iterator[Path]:
    """A directory every user may write (mode 2777) outside pytest's private tmp dirs."""
    base = tempfile.gettempdir()
    if not os.stat(base).st_mode & stat.S_IXOTH:
        pytest.skip(f"{base} is not searchable by other users")
    folder = Path(tempfile.mkdtemp(prefix="dmutex-shared-", dir=base))
    try:
        os.chmod(folder, 0o2777)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_root_and_nobody_exclude_each_other_on_a_shared_file(shared_folder: Path) -> None:
    """A lock file 0o666 in a 2777 directory: a process running as nobody and one running
    as root contend for one key and exclude each other."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the test runs one worker as root and one as nobody")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' on this host")
    path = _make_shared_files(shared_folder, 0o666)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    os.close(fd)
    os.chmod(path, 0o666)  # whatever the umask
    started, clock = time.monotonic(), now_us()
    reports = run_workers(
        shared_file_worker,
        2,
        str(shared_folder),
        SHARED_CYCLES,
        nobody.pw_uid,
        nobody.pw_gid,
    )
    finished = now_us()
    _print_figures("root and nobody", started, reports)
    assert [r.uid for r in reports] == [nobody.pw_uid, 0]
    _check_counter(reports, shared_folder, path, 2, SHARED_CYCLES, (clock, finished))
    # A, B, A: both held the lock while the other still had cycles to run.
    assert sum(r.handoffs for r in reports) >= 2, "the two users never contended"


# --- processes that open a new file together ----------------------------------------------


def _open_and_use(path: str, opener: int, barrier: Barrier) -> None:
    """In a forked child: open the file as the others do, take and give back a lease."""
    barrier.wait(BARRIER_TIMEOUT)
    backend = SQLiteBackend(path)
    if opener % 2:
        mutex = DMutex(SERVICE, backend)
        lock = mutex.acquire_with_retry(KEY, ttl=TTL, timeout=RETRY_TIMEOUT, retry_delay=0.001)
        assert lock is not None
        assert lock.release()
    else:

        async def main() -> None:
            amutex = AsyncDMutex(SERVICE, backend)
            alock = await amutex.acquire_with_retry(
                KEY, ttl=TTL, timeout=RETRY_TIMEOUT, retry_delay=0.001
            )
            assert alock is not None
            assert await alock.release()

        asyncio.run(main())
    backend.close()


def _forked_opener(path: str, opener: int, barrier: Barrier) -> tuple[int, int]:
    """Fork a child running :func:`_open_and_use`; its pid and the pipe it answers on."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer "ok" or the traceback, and exit without cleanup
        os.close(read)
        try:
            _open_and_use(path, opener, barrier)
            answer = "ok"
        except BaseException:  # noqa: BLE001 - the parent reports whatever the child raised
            answer = traceback.format_exc()
        os.write(write, answer.encode())
        os._exit(0)
    os.close(write)
    return pid, read


@dataclass(frozen=True)
class RaceReport:
    """How many openers succeeded, over every trial, and what the others raised."""

    opened: int
    errors: tuple[str, ...]


@dataclass
class RaceTally:
    """The race worker's running counts, turned into a RaceReport at the end."""

    opened: int = 0
    errors: list[str] = field(default_factory=list)

    def report(self) -> RaceReport:
        return RaceReport(self.opened, tuple(self.errors))


def new_file_race_worker(
    worker: int, reports: Reports, barrier: Barrier, folder: str, trials: int
) -> None:
    """Per trial, fork ``OPENERS`` children that open one new file together (this spawned
    process has started no thread, so it may fork)."""

    def body(tally: RaceTally) -> None:
        barrier.wait(BARRIER_TIMEOUT)
        ctx = multiprocessing.get_context("fork")
        for trial in range(trials):
            path = os.path.join(folder, f"new-{trial}.db")
            start = ctx.Barrier(OPENERS)
            children = [_forked_opener(path, i, start) for i in range(OPENERS)]
            for pid, read in children:
                answer = _read_pipe(read, time.monotonic() + DEADLINE).decode()
                os.close(read)
                os.waitpid(pid, 0)
                if answer == "ok":
                    tally.opened += 1
                else:
                    tally.errors.append(answer)

    processes.report_errors(worker, reports, barrier, RaceTally(), body)


def test_processes_that_open_a_new_file_together_all_succeed(tmp_path: Path) -> None:
    """Six processes open one new file at once and each takes a lease, 80 times over.

    Switching a new file to WAL can meet SQLITE_BUSY at once, without the busy
    handler; the backend retries it within ``timeout``. Before it did, about
    one trial in ten raised "database is locked" from the constructor.
    """
    (seen,) = processes.run_workers(
        new_file_race_worker, 1, str(tmp_path), OPEN_TRIALS, deadline=DEADLINE, report=RaceReport
    )
    assert seen.errors == ()
    assert seen.opened == OPENERS * OPEN_TRIALS
    for trial in range(OPEN_TRIALS):
        path = tmp_path / f"new-{trial}.db"
        assert active_permits(path, MUTEX_TABLE) == {}
        with raw(path) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


# --- a backend used on both sides of fork() ------------------------------------------------


def _use_after_fork(backend: SQLiteBackend) -> dict[str, object]:
    """In the forked child: the inherited backend object, sync and asyncio faces."""
    mutex = DMutex(SERVICE, backend)
    seen: dict[str, object] = {"held elsewhere": mutex.acquire("parent", ttl=TTL) is None}
    lock = mutex.acquire("child", ttl=TTL)
    assert lock is not None
    seen["sync fence"] = lock.fence
    seen["sync release"] = lock.release()

    async def main() -> None:
        amutex = AsyncDMutex(SERVICE, backend)
        alock = await amutex.acquire("child-async", ttl=TTL)
        assert alock is not None
        seen["async fence"] = alock.fence
        seen["async release"] = await alock.release()

    asyncio.run(main())
    backend.close()
    return seen


def _read_pipe(fd: int, deadline: float) -> bytes:
    """Everything written to ``fd`` until EOF; fails the test past ``deadline`` (monotonic)."""
    chunks: list[bytes] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the forked child did not finish")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


@dataclass(frozen=True)
class ForkReport:
    """What the forked child saw, and what its parent saw after it."""

    child: dict[str, object]
    parent: dict[str, object]


def fork_worker(worker: int, reports: Reports, barrier: Barrier, folder: str) -> None:
    """Use a backend (both faces), fork, use it in the child and again in the parent."""

    def body() -> None:
        backend = SQLiteBackend(os.path.join(folder, "locks.db"))
        mutex = DMutex(SERVICE, backend)
        held = mutex.acquire("parent", ttl=TTL)  # held across the fork
        assert held is not None

        async def warm() -> None:  # starts the backend's worker thread
            amutex = AsyncDMutex(SERVICE, backend)
            alock = await amutex.acquire("warm", ttl=TTL)
            assert alock is not None
            assert await alock.release()

        asyncio.run(warm())
        read, write = os.pipe()
        with warnings.catch_warnings():
            # The backend's worker thread is alive at the fork: that is the point.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(read)
                text = json.dumps({"ok": _use_after_fork(backend)})
                code = 0
            except BaseException:  # noqa: BLE001 - sent to the parent, which fails the test
                text = json.dumps({"error": traceback.format_exc()})
            finally:
                os.write(write, text.encode())
                os._exit(code)
        os.close(write)
        try:
            answer = json.loads(_read_pipe(read, time.monotonic() + STEP_TIMEOUT))
            _, status = os.waitpid(pid, 0)
            pid = 0
        finally:
            os.close(read)
            if pid:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        assert "error" not in answer, f"the forked child raised:\n{answer['error']}"
        assert os.waitstatus_to_exitcode(status) == 0
        # The parent's connection survived the child's use of the object.
        after: dict[str, object] = {"parent release": held.release()}
        again = mutex.acquire("child", ttl=TTL)
        assert again is not None
        after["parent fence"] = again.fence
        assert again.release()
        backend.close()
        reports.put((worker, ForkReport(answer["ok"], after)))

    try:
        body()
    except BaseException:
        reports.put((worker, traceback.format_exc()))
        raise


def test_a_forked_child_can_use_the_backend_object_of_its_parent(tmp_path: Path) -> None:
    """After fork() the child uses the inherited SQLiteBackend (both faces) on a connection
    of its own: the parent's lease excludes it, its grants and releases work, and the
    parent's connection works on after."""
    path = _make_shared_files(tmp_path)
    started = now_us()
    (seen,) = processes.run_workers(
        fork_worker, 1, str(tmp_path), deadline=DEADLINE, report=ForkReport
    )
    finished = now_us()
    child, parent = dict(seen.child), dict(seen.parent)
    sync, async_ = child.pop("sync fence"), child.pop("async fence")
    again = parent.pop("parent fence")
    assert child == {"held elsewhere": True, "sync release": True, "async release": True}
    assert parent == {"parent release": True}
    assert isinstance(sync, int)
    assert isinstance(async_, int)
    assert isinstance(again, int)
    # Each key's first grant takes the clock; the parent's later grant of the child's key
    # is above the child's.
    assert started <= sync <= finished
    assert started <= async_ <= finished
    assert sync < again <= next_fence(sync, finished)
    table = rows(path, MUTEX_TABLE)
    assert table["fence:child"] == (str(again), 2**63 - 1)
    assert table["fence:child-async"] == (str(async_), 2**63 - 1)
    assert active_permits(path, MUTEX_TABLE) == {}
    assert integrity(path) == ["ok"]

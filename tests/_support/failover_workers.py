"""The failover test's workers and their shared record (``tests/faults/failover/test_failover.py``).

:func:`work` runs in a spawned process (``processes.run_workers``): it takes,
holds and releases a :class:`~dmutex.DMutex` and a 3-permit
:class:`~dmutex.DSemaphore` (or their asyncio twins) in a loop through a
redis-py Sentinel client, until told to stop or its time is up. The workers
are split between modes (:class:`Mode`: a service name and the locks'
options, ``replicas=`` or not), which run side by side through the same
failovers. Every
exception a failover can cause (redis-py's errors, dmutex's
:class:`~dmutex.NotReplicatedError`) is counted by its class and the loop
goes on; anything else ends the worker with its traceback.

:class:`Record` is the guarded resource: an SQLite file every worker writes
with ``BEGIN IMMEDIATE`` (one writer at a time), holding who is inside each
(lock, slot), the highest fence written to each, every grant with its
wall-clock time, and the holders someone else entered beside. A holder
enters (a fenced write: refused when its fence is not above the highest the
record has for that lock and slot), holds, exits.
"""

from __future__ import annotations

import contextlib
import os
import random
import sqlite3
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import redis.asyncio.sentinel
import redis.sentinel

from dmutex import DMutexError, NotReplicatedError
from tests._support import processes
from tests._support.faces import Face, FaceName, Handle, Kind, LoopThread

KINDS: tuple[Kind, ...] = ("mutex", "semaphore")
PERMITS = {"mutex": 1, "semaphore": 3}
KEY = "ledger"
TTL = 2.0  # a short hold's lease: stranded on a dead primary, it lapses fast
# A long hold's lease: longer than a failover (4-5 s with these Sentinels),
# so that a holder can still be inside when the new primary grants again.
LONG_TTL = 8.0
LONG_SPARE = 0.3  # a long hold ends this long before the holder's deadline (time_left)
HOLD = (0.010, 0.030)  # a short hold, seconds
ACQUIRE_TIMEOUT = 1.0  # acquire_with_retry's; a timeout is counted and the loop goes on
RETRY_DELAY = 0.02
PAUSE_AFTER_ERROR = 0.05  # the server is gone or refusing: do not spin
SOCKET_TIMEOUT = 2.0  # above any WAIT (replicas_timeout) and BLPOP dmutex sends
SQLITE_TIMEOUT = 30.0
# What a failover makes the clients raise: redis-py's errors (ConnectionError,
# TimeoutError, MasterNotFoundError, ReadOnlyError, ...) and dmutex's.
SURVIVED = (redis.RedisError, DMutexError)


def failover_rounds() -> int:
    """The faults a failover test makes: 3, or ``DMUTEX_FAILOVER_ROUNDS`` (at least 2)."""
    rounds = int(os.environ.get("DMUTEX_FAILOVER_ROUNDS", "3"))
    if rounds < 2:
        raise ValueError(f"DMUTEX_FAILOVER_ROUNDS must be 2 or more, not {rounds}")
    return rounds


@dataclass(frozen=True)
class Mode:
    """One way of taking the locks: its name, its service name, its options."""

    name: str
    service: str  # the locks' service name: each mode its own keys
    options: tuple[tuple[str, Any], ...]  # replicas=, replicas_timeout= (or nothing)


@dataclass(frozen=True)
class Config:
    """What every worker of one run is told (pickled to the spawned processes)."""

    sentinels: tuple[tuple[str, int], ...]
    master: str  # the name the Sentinels monitor the primary under
    modes: tuple[Mode, ...]  # worker i runs modes[i % len(modes)]
    record: str  # the SQLite file
    duration: float  # a worker stops by itself after this many seconds
    seed: int

    def mode(self, worker: int) -> Mode:
        """The mode worker ``worker`` runs."""
        return self.modes[worker % len(self.modes)]

    def face(self, worker: int) -> FaceName:
        """The face worker ``worker`` uses: sync and asyncio alternate within each mode."""
        return "async" if (worker // len(self.modes)) % 2 else "sync"


@dataclass(frozen=True)
class WorkerReport:
    """What one worker counted."""

    worker: int
    mode: str
    face: FaceName
    grants: int  # acquires that returned a handle
    long_holds: int  # of which held until near their deadline
    overlaps: int  # entries into a (lock, slot) someone else held by a valid lease
    stale_fences: int  # fenced writes refused: the fence was not above the highest
    lost: int  # releases that answered False though the holder left before its deadline
    overstays: int  # holders that left after their deadline (a starved process)
    timeouts: int  # acquire_with_retry that returned None
    not_replicated: int  # NotReplicatedError from an acquire
    release_errors: int  # releases that raised
    errors: tuple[tuple[str, int], ...]  # every other exception survived, by class name


@dataclass
class Tally:
    """A worker's running counts; :meth:`report` makes its :class:`WorkerReport`."""

    worker: int
    mode: str
    face: FaceName
    grants: int = 0
    long_holds: int = 0
    overlaps: int = 0
    stale_fences: int = 0
    lost: int = 0
    overstays: int = 0
    timeouts: int = 0
    not_replicated: int = 0
    release_errors: int = 0
    errors: Counter[str] = field(default_factory=Counter)

    def report(self) -> WorkerReport:
        return WorkerReport(
            self.worker,
            self.mode,
            self.face,
            self.grants,
            self.long_holds,
            self.overlaps,
            self.stale_fences,
            self.lost,
            self.overstays,
            self.timeouts,
            self.not_replicated,
            self.release_errors,
            tuple(sorted(self.errors.items())),
        )


# --- the shared record ------------------------------------------------------------------------


class Record:
    """The guarded resource, in an SQLite file: who is inside, the fences, the grants."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)

    @contextlib.contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.path, timeout=SQLITE_TIMEOUT, isolation_level=None)
        try:
            yield conn
        finally:
            conn.close()

    def create(self) -> None:
        """Make the tables (WAL: the test reads while the workers write)."""
        with self._connection() as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(
                """
                CREATE TABLE inside (mode TEXT, lock TEXT, slot INTEGER, worker INTEGER,
                                     token TEXT PRIMARY KEY, deadline REAL);
                CREATE TABLE fences (mode TEXT, lock TEXT, slot INTEGER, fence INTEGER,
                                     PRIMARY KEY (mode, lock, slot));
                CREATE TABLE grants (mode TEXT, worker INTEGER, lock TEXT, slot INTEGER,
                                     fence INTEGER, at REAL, long INTEGER, overlap INTEGER,
                                     stale INTEGER);
                CREATE TABLE overlapped (mode TEXT, token TEXT PRIMARY KEY);
                """
            )

    def enter(
        self,
        mode: str,
        worker: int,
        lock: Kind,
        handle: Handle,
        deadline: float,
        long: bool,
    ) -> tuple[bool, bool]:
        """Record ``handle``'s holder inside ``mode``'s ``lock``; ``(overlap, stale fence)``.

        An overlap: another holder is inside the same slot, or more than the
        lock's permits would be inside, counting only holders whose deadline
        has not passed (one past it holds nothing, whatever it still does).
        The fenced write: the fence must be above the highest written to the
        slot, else it is refused (not recorded) and counted stale.
        """
        slot, fence = handle.slot, handle.fence
        with self._connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            now = time.time()
            held = conn.execute(
                "SELECT slot, token FROM inside WHERE mode = ? AND lock = ? AND deadline > ?",
                (mode, lock, now),
            ).fetchall()
            same = [token for s, token in held if s == slot]
            overlap = bool(same) or len(held) + 1 > PERMITS[lock]
            if overlap:
                # The holders the newcomer overlaps: those it shares a slot
                # with, or all of them when the permits are exceeded.
                victims = same or [token for _, token in held]
                conn.executemany(
                    "INSERT OR IGNORE INTO overlapped VALUES (?, ?)", [(mode, t) for t in victims]
                )
            row = conn.execute(
                "SELECT fence FROM fences WHERE mode = ? AND lock = ? AND slot = ?",
                (mode, lock, slot),
            ).fetchone()
            stale = fence is None or (row is not None and fence <= row[0])
            if not stale:
                conn.execute(
                    "INSERT OR REPLACE INTO fences VALUES (?, ?, ?, ?)", (mode, lock, slot, fence)
                )
            conn.execute(
                "INSERT INTO inside VALUES (?, ?, ?, ?, ?, ?)",
                (mode, lock, slot, worker, handle.token, deadline),
            )
            conn.execute(
                "INSERT INTO grants VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (mode, worker, lock, slot, fence, now, long, overlap, stale),
            )
            conn.execute("COMMIT")
        return overlap, stale

    def leave(self, handle: Handle) -> None:
        """Record ``handle``'s holder gone."""
        with self._connection() as conn:
            conn.execute("DELETE FROM inside WHERE token = ?", (handle.token,))

    def grants(self, mode: str) -> list[tuple[int, str, float, bool, bool, bool]]:
        """``mode``'s grants: ``(worker, lock, at, long, overlap, stale)``, in time order."""
        with self._connection() as conn:
            rows = conn.execute(
                "SELECT worker, lock, at, long, overlap, stale FROM grants WHERE mode = ? "
                "ORDER BY at",
                (mode,),
            ).fetchall()
        return [(w, k, a, bool(g), bool(o), bool(s)) for w, k, a, g, o, s in rows]

    def overlapped(self, mode: str) -> int:
        """How many of ``mode``'s holders someone entered beside: grants handed out twice."""
        with self._connection() as conn:
            (count,) = conn.execute(
                "SELECT COUNT(*) FROM overlapped WHERE mode = ?", (mode,)
            ).fetchone()
        return int(count)

    def workers_since(self, moment: float) -> set[int]:
        """The workers granted something after wall-clock ``moment``."""
        with self._connection() as conn:
            rows = conn.execute("SELECT DISTINCT worker FROM grants WHERE at > ?", (moment,))
            return {w for (w,) in rows}


# --- a worker --------------------------------------------------------------------------------


def _clients(face: FaceName, config: Config) -> Any:
    """A Sentinel and the primary's client it manages, of ``face``'s redis-py flavour."""
    if face == "async":
        sentinel: Any = redis.asyncio.sentinel.Sentinel(
            list(config.sentinels), socket_timeout=SOCKET_TIMEOUT
        )
    else:
        sentinel = redis.sentinel.Sentinel(list(config.sentinels), socket_timeout=SOCKET_TIMEOUT)
    return sentinel.master_for(
        config.master, socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT
    )


def work(
    worker: int,
    reports: processes.Reports,
    barrier: processes.Barrier,
    config: Config,
    stop: Any,
    hold_long: Any,
) -> None:
    """One worker process: cycles until ``stop`` is set or ``config.duration`` passes.

    Its mode and face are ``config.mode(worker)`` and ``config.face(worker)``. A grant made
    while ``hold_long`` is set is leased for :data:`LONG_TTL` and held until
    its deadline nears; any other for :data:`TTL`, held 10-30 ms.
    """
    processes.report_errors(
        worker,
        reports,
        barrier,
        Tally(worker, config.mode(worker).name, config.face(worker)),
        lambda tally: _cycles(tally, config, stop, hold_long, barrier),
    )


def _cycles(tally: Tally, config: Config, stop: Any, hold_long: Any, barrier: Any) -> None:
    rng = random.Random(config.seed * 100 + tally.worker)
    loop = LoopThread() if tally.face == "async" else None
    client = _clients(tally.face, config)
    mode = config.mode(tally.worker)
    options = dict(mode.options)
    faces = {
        kind: Face(
            tally.face,
            kind,
            client,
            service_name=mode.service,
            max_permits=PERMITS[kind],
            loop=loop,
            **options,
        )
        for kind in KINDS
    }
    record = Record(config.record)
    barrier.wait(processes.BARRIER_TIMEOUT)
    ends = time.monotonic() + config.duration
    try:
        while not stop.is_set() and time.monotonic() < ends:
            _cycle(tally, faces, record, rng, hold_long.is_set())
    finally:
        if loop is not None:
            with contextlib.suppress(Exception):
                loop.run(client.aclose())
            loop.close()
        else:
            client.close()


def _cycle(
    tally: Tally, faces: dict[Kind, Face], record: Record, rng: random.Random, long: bool
) -> None:
    """One acquire, hold and release; what a failover raises is counted, not raised."""
    kind = rng.choice(KINDS)
    try:
        handle = faces[kind].acquire_with_retry(
            KEY,
            ttl=LONG_TTL if long else TTL,
            timeout=ACQUIRE_TIMEOUT,
            retry_delay=RETRY_DELAY,
        )
    except NotReplicatedError:
        tally.not_replicated += 1
        time.sleep(PAUSE_AFTER_ERROR)
        return
    except SURVIVED as error:
        tally.errors[type(error).__name__] += 1
        time.sleep(PAUSE_AFTER_ERROR)
        return
    if handle is None:
        tally.timeouts += 1
        return
    tally.grants += 1
    tally.long_holds += long
    # The holder's own deadline (wall clock, which every process shares):
    # until then dmutex promises that nobody else is granted this permit.
    deadline = time.time() + handle.time_left
    overlap, stale = record.enter(tally.mode, tally.worker, kind, handle, deadline, long)
    tally.overlaps += overlap
    tally.stale_fences += stale
    time.sleep(max(0.0, handle.time_left - LONG_SPARE) if long else rng.uniform(*HOLD))
    record.leave(handle)
    left = time.time()
    tally.overstays += left > deadline
    try:
        released = handle.release()
    except SURVIVED as error:
        tally.release_errors += 1
        tally.errors[f"release:{type(error).__name__}"] += 1
        return
    if not released and left < deadline:
        tally.lost += 1

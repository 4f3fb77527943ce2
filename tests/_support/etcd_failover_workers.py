"""The etcd failover test's workers (``tests/faults/failover/test_etcd_failover.py``).

:func:`work` runs in a spawned process (``processes.run_workers``), as
``failover_workers.work`` does for Redis, and shares its machinery: the
shared record (:class:`~tests._support.failover_workers.Record`, here
:class:`EtcdRecord`), the counts (``Tally``, ``WorkerReport``), the key,
the locks (a ``DMutex`` and a 3-permit ``DSemaphore``, or their asyncio
twins) and their timing. What differs is the client: etcd3gw on the sync
face, aetcd on the asyncio one, each talking to ONE member. dmutex does not
move between endpoints; the application does, and so does the worker: when
a request fails (an etcd3gw or aetcd error, or dmutex's), it closes its
client and makes a new one to the next member (a *reconnect*), new locks
on it, and goes on. Anything else ends the worker with its traceback.

Two kinds of hold, as in the Redis proof:

- short (most): a lease of :data:`~tests._support.failover_workers.TTL`
  (2 s: etcd's shortest lease with its default timing), held 10-30 ms;
- long: a grant made while the test's ``hold_long`` event is set (the
  moments just before each kill) is taken with ``auto_renew=True`` and held
  for :data:`LONG_HOLD`, across the kill and the election, by waiting in
  ``wait_lost()``. Its holder registers ``on_lost`` first, and keeps its
  deadline in the record moving with its renewals (so that the overlap
  check knows how long it holds). A long hold that is lost ends at once;
  when it was told, by the callback and by ``wait_lost()``, and the expiry
  its last answered renewal gave it (``expired_at``) go into the worker's
  report as a :class:`Telling`.

Inside the mutex the holder also increments the record's counter, read when
it enters and written when it leaves (a lost update if two holders were
ever inside at once), only while its lease is still valid (``time_left``),
and counts the increments it made.

:func:`partition_holder` is the partition test's holder, one spawned
process: it takes the lock through one member with etcd3gw and
``auto_renew=True``, reports :class:`Held` once a renewal was answered,
keeps a log of its deadline while it waits in ``wait_lost()``, and sends
:class:`Told` (times on ``time.monotonic()``) once it was told of the loss.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aetcd
import etcd3gw
import etcd3gw.exceptions

from dmutex import DMutex, DMutexError
from tests._support import processes
from tests._support.faces import Face, FaceName, Handle, Kind, LoopThread
from tests._support.failover_workers import (
    ACQUIRE_TIMEOUT,
    HOLD,
    KEY,
    KINDS,
    PAUSE_AFTER_ERROR,
    PERMITS,
    RETRY_DELAY,
    TTL,
    Record,
    Tally,
    WorkerReport,
)

MODE = "etcd"  # the record's mode: one for every worker here
SERVICE = "etcd-failover"
LONG_HOLD = 3.0  # seconds: past the kill, the election (1-2 s) and a renewal or two
STEP = 0.1  # a long holder's wait_lost() slice, between looks at its deadline
MOVED = 0.05  # a deadline that moved this much is written to the record
REQUEST_TIMEOUT = 2.0  # each client's, per request: a member without a leader hangs
CLOSE_TIMEOUT = 5.0  # an aetcd client's close, on reconnect and at the end
SETTLE = 0.2  # seconds the asyncio loop runs on after its client closed, before it closes
TOLD_WAIT = 1.0  # a lost hold's wait for its on_lost callback (another thread) to have run
# What a leader kill makes the clients raise: a refused connection, a
# timeout, etcd's "no leader"; and dmutex's own errors.
SURVIVED = (etcd3gw.exceptions.Etcd3Exception, aetcd.ClientError, DMutexError)


@dataclass(frozen=True)
class Config:
    """What every worker of one run is told (pickled to the spawned processes)."""

    endpoints: tuple[tuple[str, int], ...]  # every member's client (host, port)
    record: str  # the SQLite file
    duration: float  # a worker stops by itself after this many seconds
    seed: int

    def face(self, worker: int) -> FaceName:
        """The face worker ``worker`` uses: sync (etcd3gw) and asyncio (aetcd) alternate."""
        return "async" if worker % 2 else "sync"

    def first(self, worker: int) -> int:
        """The member worker ``worker`` connects to first."""
        return worker % len(self.endpoints)


@dataclass(frozen=True)
class Telling:
    """A long hold found lost, and how its holder was told (wall-clock seconds)."""

    worker: int
    kind: Kind
    granted: float
    told: float  # the on_lost callback ran (inf: it never did)
    waited: float  # wait_lost() returned True (inf: it never did)
    expired: float  # expired_at: the last answered request's send time plus its TTL
    ttl: float


@dataclass(frozen=True)
class EtcdReport:
    """What one worker counted: the Redis proof's report, and what is etcd's here."""

    base: WorkerReport
    increments: int  # counter increments made under the mutex
    reconnects: int  # moves to the next member
    tellings: tuple[Telling, ...]

    @property
    def worker(self) -> int:
        return self.base.worker


@dataclass
class EtcdTally:
    """A worker's running counts; :meth:`report` makes its :class:`EtcdReport`."""

    base: Tally
    increments: int = 0
    reconnects: int = 0
    tellings: list[Telling] = field(default_factory=list)

    def report(self) -> EtcdReport:
        return EtcdReport(
            self.base.report(), self.increments, self.reconnects, tuple(self.tellings)
        )


# --- the shared record ------------------------------------------------------------------------


class EtcdRecord(Record):
    """The Redis proof's record, with the counter and the holders' deadlines moving on."""

    def create(self) -> None:
        super().create()
        with self._connection() as conn:
            conn.executescript(
                "CREATE TABLE counter (value INTEGER); INSERT INTO counter VALUES (0);"
            )

    def counter(self) -> int:
        """The guarded counter."""
        with self._connection() as conn:
            (value,) = conn.execute("SELECT value FROM counter").fetchone()
        return int(value)

    def set_counter(self, value: int) -> None:
        with self._connection() as conn:
            conn.execute("UPDATE counter SET value = ?", (value,))

    def renew(self, handle: Handle, deadline: float) -> None:
        """``handle``'s holder is inside until ``deadline`` now (its lease was renewed)."""
        with self._connection() as conn:
            conn.execute("UPDATE inside SET deadline = ? WHERE token = ?", (deadline, handle.token))

    def fences(self, mode: str) -> list[tuple[str, int, int | None]]:
        """``mode``'s grants as ``(lock, slot, fence)``, in the order they entered."""
        with self._connection() as conn:
            rows = conn.execute(
                "SELECT lock, slot, fence FROM grants WHERE mode = ? ORDER BY rowid", (mode,)
            ).fetchall()
        return [
            (str(lock), int(slot), None if fence is None else int(fence))
            for lock, slot, fence in rows
        ]


# --- a worker --------------------------------------------------------------------------------


class Connection:
    """A worker's client to one member and the locks made on it; :meth:`move` reconnects."""

    def __init__(
        self, face: FaceName, config: Config, member: int, loop: LoopThread | None
    ) -> None:
        self.face = face
        self.config = config
        self.member = member
        self.loop = loop
        self.client: Any = None
        self.faces: dict[Kind, Face] = {}
        self._open()

    def _open(self) -> None:
        host, port = self.config.endpoints[self.member]
        if self.face == "async":
            self.client = aetcd.Client(host=host, port=port, timeout=REQUEST_TIMEOUT)
        else:
            self.client = etcd3gw.Etcd3Client(host=host, port=port, timeout=REQUEST_TIMEOUT)
        self.faces = {
            kind: Face(
                self.face,
                kind,
                self.client,
                service_name=SERVICE,
                max_permits=PERMITS[kind],
                loop=self.loop,
            )
            for kind in KINDS
        }

    def close(self) -> None:
        """Close the client; what a dead member makes it raise on the way is of no interest."""
        client = self.client
        if self.loop is not None:
            with contextlib.suppress(Exception):
                self.loop.run(asyncio.wait_for(client.close(), CLOSE_TIMEOUT))
        else:
            client.session.close()

    def move(self) -> None:
        """The application's reconnect: a new client, to the next member."""
        self.close()
        self.member = (self.member + 1) % len(self.config.endpoints)
        self._open()


def work(
    worker: int,
    reports: processes.Reports,
    barrier: processes.Barrier,
    config: Config,
    stop: Any,
    hold_long: Any,
) -> None:
    """One worker process: cycles until ``stop`` is set or ``config.duration`` passes.

    Its face is ``config.face(worker)``, its first member ``config.first(worker)``.
    A grant made while ``hold_long`` is set is a long hold; any other a short one.
    """
    tally = EtcdTally(Tally(worker, MODE, config.face(worker)))
    processes.report_errors(
        worker, reports, barrier, tally, lambda t: _cycles(t, config, stop, hold_long, barrier)
    )


def _cycles(tally: EtcdTally, config: Config, stop: Any, hold_long: Any, barrier: Any) -> None:
    worker = tally.base.worker
    rng = random.Random(config.seed * 100 + worker)
    loop = LoopThread() if tally.base.face == "async" else None
    connection = Connection(tally.base.face, config, config.first(worker), loop)
    record = EtcdRecord(config.record)
    barrier.wait(processes.BARRIER_TIMEOUT)
    ends = time.monotonic() + config.duration
    try:
        while not stop.is_set() and time.monotonic() < ends:
            _cycle(tally, connection, record, rng, hold_long.is_set())
    finally:
        connection.close()
        if loop is not None:
            # gRPC's calls end in tasks of their own, one turn after their reply:
            # closed under them, the loop would warn of each one it destroys.
            loop.run(asyncio.sleep(SETTLE))
            loop.close()


def _survived(tally: EtcdTally, connection: Connection, name: str) -> None:
    """Count an error a kill caused, and reconnect to the next member."""
    tally.base.errors[name] += 1
    tally.reconnects += 1
    connection.move()
    time.sleep(PAUSE_AFTER_ERROR)


def _cycle(
    tally: EtcdTally, connection: Connection, record: EtcdRecord, rng: random.Random, long: bool
) -> None:
    """One acquire, hold and release; what a kill raises is counted, and the worker moves on."""
    counts = tally.base
    kind = rng.choice(KINDS)
    try:
        handle = connection.faces[kind].acquire_with_retry(
            KEY, ttl=TTL, timeout=ACQUIRE_TIMEOUT, retry_delay=RETRY_DELAY, auto_renew=long
        )
    except SURVIVED as error:
        _survived(tally, connection, type(error).__name__)
        return
    if handle is None:
        counts.timeouts += 1
        return
    granted = time.time()
    counts.grants += 1
    counts.long_holds += long
    told: list[float] = []
    if long:
        # Registered before anything else: a loss from here on is told here.
        handle.on_lost(lambda _: told.append(time.time()))
    # The holder's own deadline (wall clock, which every process shares):
    # until then dmutex promises that nobody else is granted this permit.
    deadline = granted + handle.time_left
    overlap, stale = record.enter(MODE, counts.worker, kind, handle, deadline, long)
    counts.overlaps += overlap
    counts.stale_fences += stale
    seen = record.counter() if kind == "mutex" else None
    waited = math.inf
    if long:
        waited, deadline = _hold_long(record, handle, deadline)
    else:
        time.sleep(rng.uniform(*HOLD))
    lost = handle.lost
    if long and lost and waited == math.inf and handle.wait_lost(0):
        waited = time.time()  # lost after the hold ended, before this look
    if seen is not None and not lost and handle.time_left > 0:
        record.set_counter(seen + 1)
        tally.increments += 1
    record.leave(handle)
    left = time.time()
    counts.overstays += left > deadline and not lost
    if long and lost:
        tally.tellings.append(_telling(counts.worker, kind, handle, granted, told, waited))
    try:
        released = handle.release()
    except SURVIVED as error:
        counts.release_errors += 1
        _survived(tally, connection, f"release:{type(error).__name__}")
        return
    if not released and not lost and left < deadline:
        counts.lost += 1


def _hold_long(record: EtcdRecord, handle: Handle, deadline: float) -> tuple[float, float]:
    """Hold for :data:`LONG_HOLD` or until lost; ``(when wait_lost() said lost, last deadline)``."""
    ends = time.monotonic() + LONG_HOLD
    while (rest := ends - time.monotonic()) > 0:
        if handle.wait_lost(min(STEP, rest)):
            return time.time(), deadline
        moved = time.time() + handle.time_left
        if moved > deadline + MOVED:
            record.renew(handle, moved)
            deadline = moved
    return math.inf, deadline


def _telling(
    worker: int, kind: Kind, handle: Handle, granted: float, told: list[float], waited: float
) -> Telling:
    """How a lost hold's holder was told; waits (bounded) for the callback's thread to run it."""
    until = time.monotonic() + TOLD_WAIT
    while not told and time.monotonic() < until:
        time.sleep(0.01)
    first = told[0] if told else math.inf
    return Telling(worker, kind, granted, first, waited, handle.expired_at.timestamp(), TTL)


# --- the partition test's holder --------------------------------------------------------------

PARTITION_SERVICE = "etcd-partition"
RENEWED_TIMEOUT = 5.0  # for the holder's first renewal (a third of its 2 s TTL, on a busy machine)
HOLDER_PATIENCE = 30.0  # the holder gives up waiting for its loss after this long


@dataclass(frozen=True)
class Held:
    """What the partition test's holder reports once its lease has been renewed."""

    fence: int | None
    token: str


@dataclass(frozen=True)
class Told:
    """How the partition test's holder lost its lease; times on ``time.monotonic()``.

    ``CLOCK_MONOTONIC`` is one clock for the whole host, so the test compares
    them with its own.
    """

    lost: bool
    told: float  # the on_lost callback ran (inf: it never did)
    waited: float  # wait_lost() returned True (inf: it never did)
    expired: float  # expired_at: the last answered renewal's send time plus its TTL
    deadlines: tuple[tuple[float, float], ...]  # (when seen, deadline) each time it moved
    released: str  # what the release did: "True", "False", or the error's class


def partition_holder(host: str, port: int, reports: processes.ChildReports, go: Any) -> None:
    """A spawned holder (``processes.spawned``): takes the lock through the member at
    ``host:port`` with ``auto_renew=True``, reports :class:`Held` once a renewal was
    answered, then waits for the loss and sends :class:`Told`."""
    processes.send_results(reports, lambda: _hold_until_lost(host, port, reports))


def _hold_until_lost(host: str, port: int, reports: processes.ChildReports) -> Told:
    client = etcd3gw.Etcd3Client(host=host, port=port, timeout=REQUEST_TIMEOUT)
    try:
        handle = DMutex(PARTITION_SERVICE, client).acquire(KEY, ttl=TTL, auto_renew=True)
        assert handle is not None, "the lock was free: the holder was refused"
        told: list[float] = []
        handle.on_lost(lambda _: told.append(time.monotonic()))
        first = handle.expired_at
        until = time.monotonic() + RENEWED_TIMEOUT
        while handle.expired_at == first:
            assert time.monotonic() < until, "no renewal was answered"
            time.sleep(0.01)
        reports.put(("held", Held(handle.fence, handle.token)))
        deadlines: list[tuple[float, float]] = []
        waited = math.inf
        until = time.monotonic() + HOLDER_PATIENCE
        while time.monotonic() < until:
            now = time.monotonic()
            deadline = now + handle.time_left
            if handle.wait_lost(0.02):
                waited = time.monotonic()
                break
            if not deadlines or deadline > deadlines[-1][1] + 0.01:
                deadlines.append((now, deadline))
        until = time.monotonic() + TOLD_WAIT
        while not told and time.monotonic() < until:
            time.sleep(0.01)
        offset = time.time() - time.monotonic()
        expired = handle.expired_at.timestamp() - offset
        try:
            released = str(handle.release())
        except SURVIVED as error:
            released = type(error).__name__
        return Told(
            handle.lost,
            told[0] if told else math.inf,
            waited,
            expired,
            tuple(deadlines),
            released,
        )
    finally:
        client.session.close()

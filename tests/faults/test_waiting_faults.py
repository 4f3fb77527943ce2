"""Waiters blocked in BLPOP when a fault hits: they recover, and mutual exclusion holds.

Since issue 12 a retrying acquire on Redis waits between attempts in
``BLPOP`` on the lock's signal list, which a release pushes to. These tests
start waiters (threads; on the async face their calls run as tasks of one
event loop; each with a client of its own),
check with the server's ``INFO clients`` (``blocked_clients``) that every one
is blocked, and then hit them with a fault:

1. **the connections are cut** (:class:`CuttingProxy`, a
   :class:`~tests._support.fault_proxy.FaultProxy` that can also close every
   open connection at once). The clients retry nothing, so the cut reaches
   dmutex: a cut ``BLPOP`` never raises out of ``acquire_with_retry``, the
   waiter sleeps out the rest of its wait and tries again. With the path
   back at once, every waiter takes the lock after the holder releases it.
   When the path stays down (every request dropped) past the rest of the
   wait, the *attempt* after the failed ``BLPOP`` raises the client's
   ``ConnectionError``, after its clean-up release (engine rule 6) was tried:
   that is what the code does, and what the test asserts. Called again once
   the path is back, every waiter takes the lock after the holder's release.
2. **the server restarts** (SIGKILL, then started again on its port; a
   :class:`VolatileRedis`, which keeps nothing) and the holder's lease, the
   waiters' registrations and the script cache go with it. No release ever
   signals the waiters; their ``BLPOP`` (re-sent by redis-py on the new
   server) runs out and they try again: each one takes the lock within a
   bounded number of attempts, long before the lost lease's TTL, and the
   holder's release answers False.
3. **the server is paused** (SIGSTOP, then SIGCONT, by its pid) while they
   block and the holder's release waits in the socket: every waiter has a
   request in flight across the pause, and proceeds after SIGCONT.
4. **the holder is killed** (SIGKILL, a child process): nothing signals the
   waiters, no ``BLPOP`` returns a signal before the first grant, a waiter
   takes the lock when the lease runs out, within a bounded number of
   attempts, and no ``BLPOP`` timeout exceeds ``retry_delay`` nor the
   holder's remaining TTL that the attempt before it reported.
5. **a contended run**: several workers loop acquire_with_retry /
   read-modify-write of a counter / release through the proxy, which tears
   connections at random and every so often cuts every open connection
   (blocked waiters included). A holder sends each counter command only
   while its lease has :data:`WRITE_BUDGET` left, on a client that retries
   nothing, so it never outlives the lease. The counter equals the number of
   writes known to have been applied, no two holders overlap (an in-process marker), and
   no record of the namespace but the fence counter lacks a TTL, throughout
   and afterwards.

Every client records each command dmutex sends through it (:class:`Log`), so
the assertions count attempts and check the order of commands and events,
never the wall clock. Everything runs on one Redis server of this module's
own (the newest found, 7.0 where there is one), whose pid the tests signal.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import select
import selectors
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from typing import Any, Literal, TypeAlias

import pytest
import redis
import redis.asyncio
import redis.asyncio.retry
import redis.backoff
import redis.retry

from dmutex import DMutex, DMutexLock, DSemaphore, DSemaphorePermit
from dmutex._backends.redis.scripts import ACQUIRE, MUTEX_ACQUIRE, MUTEX_RELEASE, RELEASE
from tests._support import faces, fault_servers
from tests._support.fault_proxy import FaultProxy, Rates
from tests._support.sampling import process_state, sampling
from tests._support.sampling import until as poll_until

Face: TypeAlias = Literal["sync", "async"]
Kind: TypeAlias = Literal["mutex", "semaphore"]
SyncLock: TypeAlias = DMutex | DSemaphore
SyncHandle: TypeAlias = DMutexLock | DSemaphorePermit

SEED = int(os.environ.get("DMUTEX_FAULT_SEED", "20240611"))
KEY = "ledger"
COUNTER = "waiting-faults:counter"  # outside every lock's namespace
PERMITS = {"mutex": 1, "semaphore": 2}
WAITERS = 3
ERRORS: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError)

RETRY_DELAY = 0.5  # scenarios 1 to 3: waiters block most of the time
HOLDER_TTL = 60.0  # the test's holder: never runs out during a test
WAITER_TTL = 10.0
ACQUIRE_TIMEOUT = 20.0  # far shorter than HOLDER_TTL: a grant is no expiry of it
HOLD = 0.005  # seconds a waiter holds the lock
CALLS = 4  # acquire_with_retry calls a waiter makes at most (after each raise)
SOCKET_TIMEOUT = 5.0  # longer than any block (dmutex caps a block at 0.8 x this)
CONNECT_TIMEOUT = 2.0
STEP = 15.0  # the longest any one wait of a test may take
POLL = 0.005
CUT_ROUNDS = 8  # scenario 1: cuts until every waiter had a BLPOP cut
PAUSE_WAITS = 2  # scenario 3: the pause lasts this many retry delays
KILLED_TTL = 1.5  # scenario 4: the killed holder's lease
KILLED_RETRY_DELAY = 0.4
RESTART_RETRY = (0.05, 200)  # scenario 2: redis-py retries (backoff s, count) span a restart
MS = 0.0005  # BLPOP's timeout is sent with three decimals

# Every wait of a test for a condition: bounded by STEP.
until = partial(poll_until, timeout=STEP, poll=POLL)

# Scenario 5.
RUN_WORKERS = 4
RUN_CYCLES = 1000  # per worker, at most: the deadline ends the run first
RUN_SECONDS = 3.0  # no cycle starts after this
RUN_RETRY_DELAY = 0.05
RUN_TTL = 1.5  # what an orphaned lease (its release failed) holds the run up for
# A holder sends a counter command only with this much of its lease left: the
# command (no retries) ends by the next cut, RUN_CUT_EVERY, well within it.
WRITE_BUDGET = 0.5
RUN_TIMEOUT = 2.0  # longer than RUN_TTL: a waiter outlasts an orphaned lease
RUN_RATES = Rates(drop_request=0.02, drop_reply=0.02, cut=0.03)  # each tears the connection
RUN_CUT_EVERY = (0.05, 0.25)  # seconds between two cuts of every connection
RELEASE_ATTEMPTS = 3
SAMPLE_EVERY = 0.05
OUTAGE = Rates(drop_request=1.0)  # nothing reaches the server


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


# --- what every client sent -----------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One command a waiter's client ran (``start < end``), or an event (``start == end``).

    ``what``: "acquire" / "release" (dmutex's scripts), "blpop", another
    command's name, or an event of the test ("call", "raised", "granted",
    "none", "released", ...).
    """

    start: int
    end: int
    who: str
    what: str
    timeout: float | None = None  # BLPOP's, in seconds
    error: str | None = None
    reply: object = None

    @property
    def event(self) -> bool:
        return self.start == self.end

    @property
    def pttl(self) -> int | None:
        """A failed acquire's report of the holder's PTTL (ms), else None."""
        if self.what != "acquire" or not isinstance(self.reply, list) or len(self.reply) != 3:
            return None
        return int(self.reply[2])


def _what(args: tuple[Any, ...]) -> str:
    name = str(args[0]).upper()
    if name in ("EVALSHA", "EVAL") and len(args) > 1:
        script = args[1]
        if script in (ACQUIRE.sha, ACQUIRE.text, MUTEX_ACQUIRE.sha, MUTEX_ACQUIRE.text):
            return "acquire"
        if script in (RELEASE.sha, RELEASE.text, MUTEX_RELEASE.sha, MUTEX_RELEASE.text):
            return "release"
    return name.lower()


class Log:
    """Every command and event, in one order (a sequence number per step); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self.entries: list[Entry] = []
        self.inflight: dict[str, tuple[int, str]] = {}  # who -> (start, what)

    def tick(self) -> int:
        with self._lock:
            return next(self._seq)

    def begin(self, who: str, what: str) -> int:
        with self._lock:
            start = next(self._seq)
            self.inflight[who] = (start, what)
            return start

    def end(
        self, who: str, start: int, args: tuple[Any, ...], error: str | None, reply: object
    ) -> None:
        what = _what(args)
        timeout = float(args[2]) if what == "blpop" else None
        with self._lock:
            self.inflight.pop(who, None)
            self.entries.append(Entry(start, next(self._seq), who, what, timeout, error, reply))

    def event(self, who: str, what: str) -> int:
        with self._lock:
            seq = next(self._seq)
            self.entries.append(Entry(seq, seq, who, what))
            return seq

    def of(self, who: str) -> list[Entry]:
        with self._lock:
            return sorted((e for e in self.entries if e.who == who), key=lambda e: e.start)

    def blocked_since(self, who: str, seq: int) -> bool:
        """Whether ``who`` has a BLPOP in flight that it sent after ``seq``."""
        with self._lock:
            found = self.inflight.get(who)
        return found is not None and found[1] == "blpop" and found[0] > seq


def _plain(reply: Any) -> object:
    if isinstance(reply, (list, tuple)):
        return [_plain(r) for r in reply]
    return reply.decode(errors="replace") if isinstance(reply, bytes) else reply


class SpyRedis(redis.Redis):
    """redis-py's client, logging each command it runs; ``who`` names its waiter."""

    log: Log
    who: str

    def execute_command(self, *args: Any, **options: Any) -> Any:
        # redis-py leaves execute_command unannotated: called as a Callable.
        execute: Callable[..., Any] = super().execute_command
        start = self.log.begin(self.who, _what(args))
        try:
            reply = execute(*args, **options)
        except Exception as error:
            self.log.end(self.who, start, args, type(error).__name__, None)
            raise
        self.log.end(self.who, start, args, None, _plain(reply))
        return reply


class AsyncSpyRedis(redis.asyncio.Redis):
    """:class:`SpyRedis` for ``redis.asyncio``."""

    log: Log
    who: str

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        # redis-py leaves execute_command unannotated: called as a Callable.
        execute: Callable[..., Awaitable[Any]] = super().execute_command
        start = self.log.begin(self.who, _what(args))
        try:
            reply = await execute(*args, **options)
        except Exception as error:
            self.log.end(self.who, start, args, type(error).__name__, None)
            raise
        self.log.end(self.who, start, args, None, _plain(reply))
        return reply


Client: TypeAlias = SpyRedis | AsyncSpyRedis


# --- the fault injectors --------------------------------------------------------------------


class CuttingProxy(FaultProxy):
    """A :class:`FaultProxy` that can also close every open connection at once.

    :meth:`cut_all` asks the proxy's thread to close every client connection
    and its upstream twin, whatever is in flight (a blocked ``BLPOP``, a
    request, nothing), and waits until it did.
    """

    def __init__(self, upstream: tuple[str, int], rates: Rates, *, seed: int) -> None:
        super().__init__(upstream, rates, seed=seed, lifetime=120.0)
        self._cut_asked = threading.Event()
        self._cut_done = threading.Event()
        self._cut_closed = 0
        self.cuts = 0  # connections closed by cut_all, in all

    def __enter__(self) -> CuttingProxy:
        super().__enter__()
        return self

    def cut_all(self) -> int:
        """Close every open connection now; how many there were."""
        self._cut_done.clear()
        self._cut_asked.set()
        self._wake_w.send(b"c")
        if not self._cut_done.wait(STEP):
            raise RuntimeError(f"proxy on port {self.port} did not cut its connections")
        return self._cut_closed

    def _on_event(self, key: selectors.SelectorKey, events: int) -> None:
        super()._on_event(key, events)
        if key.fileobj is self._wake_r and self._cut_asked.is_set():
            self._cut_asked.clear()
            pairs = list(self._pairs)
            for pair in pairs:
                self._close(pair)
            self._cut_closed = len(pairs)
            self.cuts += len(pairs)
            self._cut_done.set()


class VolatileRedis(fault_servers.DurableRedis):
    """:class:`~tests._support.fault_servers.DurableRedis` with no append-only file.

    A SIGKILL loses every key: a lease, the waiters' records, the scripts.
    """

    name = "redis-volatile"

    def command(self) -> list[str]:
        args = super().command()
        args[args.index("--appendonly") + 1] = "no"
        return args


# --- the waiters ----------------------------------------------------------------------------


class Marker:
    """Who holds the lock now, as the holders themselves say; counts overlaps."""

    def __init__(self, permits: int) -> None:
        self.permits = permits
        self.overlaps: list[str] = []
        self.overran = 0  # holders that left after their lease's expiry
        self._holders: dict[str, datetime] = {}
        self._lock = threading.Lock()

    def enter(self, who: str, expired_at: datetime) -> None:
        with self._lock:
            if len(self._holders) >= self.permits:
                self.overlaps.append(f"{who} entered while {sorted(self._holders)} held it")
            self._holders[who] = expired_at

    def leave(self, who: str) -> None:
        with self._lock:
            if self._holders.pop(who) <= utcnow():
                self.overran += 1


@dataclass
class Plan:
    """What each waiter does: ``cycles`` times acquire_with_retry (up to ``calls``
    calls, after each raise), then hold (a read-modify-write of the counter
    when ``rmw``, on a client of its own that retries nothing), then release."""

    retry_delay: float = RETRY_DELAY
    ttl: float = WAITER_TTL
    timeout: float = ACQUIRE_TIMEOUT
    calls: int = CALLS
    cycles: int = 1
    rmw: bool = False
    deadline: float = math.inf  # monotonic: no cycle starts after it


@dataclass
class Shared:
    """What the test and its waiters share."""

    log: Log
    marker: Marker
    truth: redis.Redis  # a clean client on the server's own port
    path_up: threading.Event = field(default_factory=threading.Event)
    applied: int = 0  # counter writes known to have reached the server
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count_applied(self) -> None:
        with self.lock:
            self.applied += 1


def _truth_applied(shared: Shared, expected: int) -> bool:
    """After a SET of the counter raised: whether the server holds ``expected``.

    The writer still holds the lock, and a torn connection leaves nothing in
    flight: the value read is final.
    """
    return int(shared.truth.get(COUNTER) or 0) == expected


def waiter(name: str, lock: faces.Face, data: Client | None, plan: Plan, shared: Shared) -> None:
    """One waiter's cycles (see :class:`Plan`), on its own thread, for either face.

    ``lock`` runs the async face's calls on the crew's event loop, where they
    run as tasks side by side. ``data``: the client of the read-modify-write
    (``plan.rmw``), else None.
    """
    log = shared.log
    for _ in range(plan.cycles):
        if time.monotonic() > plan.deadline:
            return
        handle: faces.Handle | None = None
        for _ in range(plan.calls):
            log.event(name, "call")
            try:
                handle = lock.acquire_with_retry(
                    KEY, ttl=plan.ttl, timeout=plan.timeout, retry_delay=plan.retry_delay
                )
            except ERRORS:
                log.event(name, "raised")
                assert shared.path_up.wait(STEP), "the path never came back"
                continue
            if handle is None:
                log.event(name, "none")  # timed out
            break
        if handle is None:
            continue
        log.event(name, "granted")
        shared.marker.enter(name, handle.expired_at)
        try:
            if data is None:
                time.sleep(HOLD)
            elif not rmw(lock, handle, data, shared):
                log.event(name, "gave-up")
        finally:
            shared.marker.leave(name)
        for _ in range(RELEASE_ATTEMPTS):
            try:
                released = handle.release()
            except ERRORS:
                continue
            log.event(name, "released" if released else "release-false")
            break
        else:
            log.event(name, "abandoned")  # the lease runs out by its TTL


def rmw(lock: faces.Face, handle: faces.Handle, data: Client, shared: Shared) -> bool:
    """Add one to the counter, a command at a time while the lease has time for one.

    False: gave up, the lease had less than :data:`WRITE_BUDGET` left before a
    command (nothing written then). A command of ``data`` (no retries) ends by
    the next cut of its connection, within :data:`RUN_CUT_EVERY`, so the
    holder leaves before its lease's deadline.
    """
    if handle.time_left < WRITE_BUDGET:
        return False
    try:
        value = int(lock.wait(data.get(COUNTER)) or 0)
    except ERRORS:
        return True  # nothing written
    if handle.time_left < WRITE_BUDGET:
        return False
    try:
        lock.wait(data.set(COUNTER, value + 1))
    except ERRORS:
        if not _truth_applied(shared, value + 1):
            return True
    shared.count_applied()
    return True


@dataclass(frozen=True)
class Options:
    """How the waiters' clients connect: where, and what redis-py retries."""

    host: str
    port: int
    retries: int = 0  # 0: none, so that a fault reaches dmutex
    backoff: float = 0.0
    default_retries: bool = False  # redis-py's own policy instead

    def client(self, face: Face, log: Log, who: str) -> Client:
        """A client of ``face`` that logs each command as ``who``'s."""
        kwargs: dict[str, Any] = {}
        if not self.default_retries:
            retry = redis.retry.Retry if face == "sync" else redis.asyncio.retry.Retry
            kwargs["retry"] = retry(self._backoff(), self.retries)
        cls = SpyRedis if face == "sync" else AsyncSpyRedis
        client = cls(
            host=self.host,
            port=self.port,
            socket_timeout=SOCKET_TIMEOUT,
            socket_connect_timeout=CONNECT_TIMEOUT,
            **kwargs,
        )
        client.log, client.who = log, who
        return client

    def bare(self) -> Options:
        """The same place with no retries: each command's time is bounded by the path's."""
        return Options(self.host, self.port)

    def _backoff(self) -> redis.backoff.AbstractBackoff:
        if self.backoff > 0:
            return redis.backoff.ConstantBackoff(self.backoff)
        return redis.backoff.NoBackoff()


def sync_lock(kind: Kind, service: str, client: redis.Redis) -> SyncLock:
    if kind == "mutex":
        return DMutex(service, client)
    return DSemaphore(service, client, max_permits=PERMITS[kind])


class Crew:
    """Waiters on threads, each with a client of its own (``options``), named ``w0``, ``w1``, ...

    On the async face every waiter's calls run on one event loop (in a
    thread of its own), as tasks side by side. Whatever a waiter raises but
    the client errors it catches is kept and fails the test at :meth:`join`.
    """

    def __init__(
        self,
        face: Face,
        kind: Kind,
        service: str,
        options: Options,
        plan: Plan,
        shared: Shared,
        *,
        count: int = WAITERS,
        options_of: Callable[[int], Options] | None = None,
    ) -> None:
        self.names = [f"w{i}" for i in range(count)]
        self.errors: list[str] = []
        self._threads: list[threading.Thread] = []
        self._loop = faces.LoopThread() if face == "async" else None
        choose = options_of or (lambda _: options)
        for i, name in enumerate(self.names):
            clients = [choose(i).client(face, shared.log, name)]
            if plan.rmw:
                clients.append(choose(i).bare().client(face, shared.log, name))
            lock = faces.Face(
                face,
                kind,
                clients[0],
                service_name=service,
                max_permits=PERMITS[kind],
                loop=self._loop,
            )
            data = clients[1] if plan.rmw else None
            self._start(name, partial(waiter, name, lock, data, plan, shared), lock, clients)

    def _start(
        self, name: str, target: Callable[[], None], lock: faces.Face, clients: list[Client]
    ) -> None:
        def run() -> None:
            try:
                target()
            except BaseException:  # noqa: BLE001 - kept; join() fails the test with it
                self.errors.append(traceback.format_exc())
            finally:
                for client in clients:
                    if isinstance(client, AsyncSpyRedis):
                        lock.wait(client.aclose())
                    else:
                        client.close()

        thread = threading.Thread(target=run, name=f"waiter-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def join(self, timeout: float = ACQUIRE_TIMEOUT + STEP) -> None:
        ends = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, ends - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"waiters still running after {timeout} s: {alive}"
        if self._loop is not None:
            self._loop.close()
        assert not self.errors, "a waiter raised:\n" + "\n".join(self.errors)


# --- checks ---------------------------------------------------------------------------------


def blocked(client: redis.Redis) -> int:
    info: dict[str, Any] = client.info("clients")
    return int(info["blocked_clients"])


def every_blocked_since(log: Log, names: list[str], seq: int) -> bool:
    """Whether every waiter of ``names`` is in a BLPOP it sent after ``seq``."""
    return all(log.blocked_since(name, seq) for name in names)


def events(entries: list[Entry], what: str) -> list[Entry]:
    return [e for e in entries if e.event and e.what == what]


def commands(entries: list[Entry], what: str) -> list[Entry]:
    return [e for e in entries if not e.event and e.what == what]


def wait_problems(who: str, entries: list[Entry], retry_delay: float) -> list[str]:
    """What the waiting code promises, checked on one waiter's commands and events.

    A failed BLPOP never raises out of acquire_with_retry: the waiter's next
    step is an attempt. A raise comes from an attempt: the acquire raised,
    then its clean-up release was sent. No BLPOP timeout exceeds retry_delay.
    """
    problems = []
    for i, entry in enumerate(entries):
        after = entries[i + 1] if i + 1 < len(entries) else None
        failed = entry.what == "blpop" and entry.error is not None
        if failed and (after is None or after.what != "acquire"):
            problems.append(f"{who}: after a failed BLPOP came {after}, not an attempt")
        if entry.event and entry.what == "raised":
            j = i - 1
            while j >= 0 and entries[j].what == "release":  # the clean-up (and its EVAL)
                j -= 1
            attempt = entries[j] if j >= 0 else None
            if j == i - 1 or attempt is None or attempt.what != "acquire" or not attempt.error:
                problems.append(f"{who}: raised after {entries[j:i]}, not a failed attempt")
        if entry.what == "blpop" and (entry.timeout is None or entry.timeout > retry_delay + MS):
            problems.append(f"{who}: BLPOP with timeout {entry.timeout} > {retry_delay}")
    return problems


def untimed(client: redis.Redis, prefix: str) -> list[str]:
    """Records of the namespace without an expiry, but the fence counter (it persists)."""
    found = []
    for raw in client.scan_iter(match=f"{prefix}*"):
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        if client.pttl(name) == -1 and not name.startswith(f"{prefix}fence:"):
            found.append(name)
    return found


def prefix_of(kind: Kind, service: str) -> str:
    return f"_dmutex_{service}:" if kind == "mutex" else f"_dsemaphore_{service}:"


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def volatile_redis() -> Iterator[VolatileRedis]:
    executable = fault_servers.redis_executable()
    if executable is None:
        pytest.skip("no runnable redis-server executable to signal and restart")
    with VolatileRedis(executable) as server:
        server.start()
        yield server


@dataclass
class Rig:
    """One test's server, clean client, service name and shared state."""

    server: VolatileRedis
    clean: redis.Redis
    service: str
    shared: Shared

    def holder(self, kind: Kind) -> tuple[SyncLock, list[SyncHandle]]:
        """The test's own lock instance, and every permit of KEY taken with it."""
        lock = sync_lock(kind, self.service, self.clean)
        handles = [lock.acquire(KEY, ttl=HOLDER_TTL) for _ in range(PERMITS[kind])]
        taken = [h for h in handles if h is not None]
        assert len(taken) == PERMITS[kind], "the key should be free for the holder"
        return lock, taken

    def all_blocked(self, count: int = WAITERS) -> None:
        until(lambda: blocked(self.clean) == count, f"{count} waiters blocked in BLPOP")


@pytest.fixture
def rig(volatile_redis: VolatileRedis) -> Iterator[Rig]:
    if not volatile_redis.running:
        volatile_redis.start()
    clean = redis.Redis(host="127.0.0.1", port=volatile_redis.port, socket_timeout=STEP)
    try:
        clean.flushall()
        service = f"waiting-{uuid.uuid4().hex[:8]}"
        yield Rig(volatile_redis, clean, service, Shared(Log(), Marker(1), clean))
    finally:
        clean.close()


def _marker(rig: Rig, kind: Kind) -> Marker:
    rig.shared.marker = Marker(PERMITS[kind])
    return rig.shared.marker


def _granted_after(rig: Rig, names: list[str], seq: int) -> list[str]:
    """Every waiter was granted exactly once, after ``seq``: the problems, if not."""
    problems = []
    for name in names:
        grants = events(rig.shared.log.of(name), "granted")
        if len(grants) != 1:
            problems.append(f"{name}: granted {len(grants)} times")
        elif grants[0].start < seq:
            problems.append(f"{name}: granted before the holder let go")
    return problems


# --- 1. the proxy cuts the waiters' connections ---------------------------------------------

CUT_CASES = [("sync", "mutex"), ("async", "mutex"), ("sync", "semaphore")]


@pytest.mark.parametrize(("face", "kind"), CUT_CASES, ids=[f"{f}-{k}" for f, k in CUT_CASES])
def test_cut_blpop_connections_do_not_fail_the_waiters(rig: Rig, face: Face, kind: Kind) -> None:
    """Every blocked BLPOP's connection cut: no raise from it, all acquire after the release."""
    shared, log = rig.shared, rig.shared.log
    marker = _marker(rig, kind)
    shared.path_up.set()
    _, handles = rig.holder(kind)
    server = ("127.0.0.1", rig.server.port)
    with CuttingProxy(server, Rates(), seed=SEED) as proxy:
        crew = Crew(face, kind, rig.service, Options(proxy.host, proxy.port), Plan(), shared)
        rounds = 0
        while True:
            rig.all_blocked()
            cut = {n for n in crew.names if any(e.error for e in commands(log.of(n), "blpop"))}
            if cut == set(crew.names):
                break
            assert rounds < CUT_ROUNDS, f"after {rounds} cuts only {sorted(cut)} had a BLPOP cut"
            seq = log.event("test", "cut")
            assert proxy.cut_all() >= WAITERS
            rounds += 1
            # Back in BLPOP, on new connections, before the next round.
            until(partial(every_blocked_since, log, crew.names, seq), "blocked again after a cut")
        released = log.event("test", "release")
        assert all(handle.release() for handle in handles)
        crew.join()
        assert proxy.errors == []
    problems = _granted_after(rig, crew.names, released)
    for name in crew.names:
        problems += wait_problems(name, log.of(name), RETRY_DELAY)
    assert not marker.overlaps, marker.overlaps
    assert not problems, problems
    raises = sum(len(events(log.of(n), "raised")) for n in crew.names)
    failed = sum(1 for n in crew.names for e in commands(log.of(n), "blpop") if e.error)
    print(
        f"[waiting-faults cut {face}-{kind}] rounds={rounds} connections_cut={proxy.cuts} "
        f"blpop_failed={failed} raised_from_attempts={raises}"
    )
    assert untimed(rig.clean, prefix_of(kind, rig.service)) == []


OUTAGE_CASES: list[Face] = ["sync", "async"]


@pytest.mark.parametrize("face", OUTAGE_CASES)
def test_an_outage_past_the_wait_raises_from_the_next_attempt(rig: Rig, face: Face) -> None:
    """Cut and kept down: the failed BLPOP sleeps, the attempt after it raises (after its
    clean-up release); called again once the path is back, all acquire after the release."""
    shared, log = rig.shared, rig.shared.log
    marker = _marker(rig, "mutex")
    _, handles = rig.holder("mutex")
    server = ("127.0.0.1", rig.server.port)
    with CuttingProxy(server, Rates(), seed=SEED) as proxy:
        crew = Crew(face, "mutex", rig.service, Options(proxy.host, proxy.port), Plan(), shared)
        rig.all_blocked()
        proxy.rates = OUTAGE
        proxy.enabled = True
        down = log.event("test", "down")
        assert proxy.cut_all() >= WAITERS
        until(
            lambda: all(events(log.of(n), "raised") for n in crew.names),
            "every waiter raised out of acquire_with_retry while the path was down",
        )
        proxy.enabled = False
        up = log.event("test", "up")
        shared.path_up.set()
        until(partial(every_blocked_since, log, crew.names, up), "blocked again, path back")
        rig.all_blocked()
        released = log.event("test", "release")
        assert handles[0].release() is True
        crew.join()
        assert proxy.errors == []
    problems = _granted_after(rig, crew.names, released)
    cut_first: list[str] = []
    for name in crew.names:
        entries = log.of(name)
        problems += wait_problems(name, entries, RETRY_DELAY)
        raised = [e for e in events(entries, "raised") if down < e.start < up]
        if len(raised) != 1:
            problems.append(f"{name}: raised {len(raised)} times in the outage, not once")
            continue
        # Its BLPOP cut, the waiter slept and then tried: that attempt raised.
        # (A waiter whose block ran out just before the cut has its attempt
        # cut instead: allowed, and rare.)
        if any(e.error for e in commands(entries, "blpop") if down < e.end < raised[0].start):
            cut_first.append(name)
    assert not marker.overlaps, marker.overlaps
    assert not problems, problems
    assert cut_first, "no waiter had its BLPOP cut before it raised"
    print(f"[waiting-faults outage {face}] waiters whose BLPOP was cut first: {len(cut_first)}")


# --- 2. the server restarts, the holder's lease lost with it --------------------------------

RESTART_CASES = [("sync", "mutex"), ("async", "mutex"), ("sync", "semaphore")]


@pytest.mark.parametrize(
    ("face", "kind"), RESTART_CASES, ids=[f"{f}-{k}" for f, k in RESTART_CASES]
)
def test_a_restart_that_loses_the_lease_lets_the_waiters_in(
    rig: Rig, face: Face, kind: Kind
) -> None:
    """The server SIGKILLed and started again, empty: the waiters take the lock within a
    bounded number of attempts, though no release signals them; the holder's release is False."""
    shared, log = rig.shared, rig.shared.log
    marker = _marker(rig, kind)
    shared.path_up.set()
    _, handles = rig.holder(kind)
    backoff, retries = RESTART_RETRY
    options = Options("127.0.0.1", rig.server.port, retries=retries, backoff=backoff)
    crew = Crew(face, kind, rig.service, options, Plan(), shared)
    rig.all_blocked()
    killed = log.event("test", "kill")
    rig.server.kill()
    rig.server.start()
    up = log.event("test", "up")
    crew.join()
    assert all(handle.release() is False for handle in handles), "a lost lease was released"
    problems = _granted_after(rig, crew.names, killed)
    # After the restart the lock is free. A waiter's attempt fails only while
    # another waiter holds it, and each hold ends in a release.
    bound = 2 * WAITERS + 2
    attempts = {}
    for name in crew.names:
        entries = log.of(name)
        problems += wait_problems(name, entries, RETRY_DELAY)
        attempts[name] = len([e for e in commands(entries, "acquire") if e.start > killed])
        if not 1 <= attempts[name] <= bound:
            problems.append(f"{name}: {attempts[name]} attempts after the restart (bound {bound})")
        if not any(e.start > up for e in commands(entries, "acquire")):
            problems.append(f"{name}: no attempt on the restarted server")
    assert not marker.overlaps, marker.overlaps
    assert not problems, problems
    assert untimed(rig.clean, prefix_of(kind, rig.service)) == []
    print(f"[waiting-faults restart {face}-{kind}] attempts_after_restart={attempts}")


# --- 3. the server paused --------------------------------------------------------------------


PAUSE_CASES: list[Face] = ["sync", "async"]


@pytest.mark.parametrize("face", PAUSE_CASES)
def test_waiters_proceed_after_the_server_is_continued(rig: Rig, face: Face) -> None:
    """SIGSTOP while they block and the holder's release waits; after SIGCONT all proceed."""
    shared, log = rig.shared, rig.shared.log
    marker = _marker(rig, "mutex")
    shared.path_up.set()
    _, handles = rig.holder("mutex")
    options = Options("127.0.0.1", rig.server.port, default_retries=True)
    crew = Crew(face, "mutex", rig.service, options, Plan(), shared)
    rig.all_blocked()
    released: list[bool] = []
    releaser = threading.Thread(target=lambda: released.append(handles[0].release()), daemon=True)
    pid = rig.server.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        if process_state(pid) is not None:
            until(lambda: process_state(pid) in ("T", "t"), "the server stopped")
        releaser.start()
        # Long enough for every waiter's block to run out while the server sleeps.
        time.sleep(PAUSE_WAITS * RETRY_DELAY)
        assert not released, "the release was answered by a stopped server"
    finally:
        continued = log.event("test", "cont")
        os.kill(pid, signal.SIGCONT)
    releaser.join(STEP)
    assert released == [True]
    crew.join()
    problems = _granted_after(rig, crew.names, continued)
    for name in crew.names:
        entries = log.of(name)
        problems += wait_problems(name, entries, RETRY_DELAY)
        across = [e for e in entries if not e.event and e.start < continued and e.end > continued]
        if not across:
            problems.append(f"{name}: no request in flight across the pause")
        failed = [e for e in entries if e.error is not None]
        if failed:
            problems.append(f"{name}: requests failed: {failed}")
        if events(entries, "raised"):
            problems.append(f"{name}: acquire_with_retry raised")
    assert not marker.overlaps, marker.overlaps
    assert not problems, problems


# --- 4. the holder killed ------------------------------------------------------------------

# Run with ``python -c``: takes the lock, prints its token, waits to be killed.
HOLDER = """\
import sys, time
import redis
from dmutex import DMutex

port, service, key, ttl = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
client = redis.Redis(host="127.0.0.1", port=port)
lease = DMutex(service, client).acquire(key, ttl=ttl)
print(lease.token if lease is not None else "-", flush=True)
time.sleep(60)
"""

KILL_CASES: list[Face] = ["sync", "async"]


def _read_line(process: subprocess.Popen[str], timeout: float) -> str:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready:
        pytest.fail(f"the holder printed nothing within {timeout} s")
    return process.stdout.readline().strip()


@pytest.mark.parametrize("face", KILL_CASES)
def test_a_killed_holder_lets_a_waiter_in_when_its_ttl_runs_out(rig: Rig, face: Face) -> None:
    """SIGKILL the holder: no signal comes, a waiter takes the lock at the lease's expiry,
    each BLPOP no longer than retry_delay nor than the holder's reported remaining TTL."""
    shared, log = rig.shared, rig.shared.log
    marker = _marker(rig, "mutex")
    shared.path_up.set()
    args = [str(rig.server.port), rig.service, KEY, str(KILLED_TTL)]
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, *args], stdout=subprocess.PIPE, text=True
    )
    try:
        token = _read_line(child, STEP)
        assert token not in ("", "-"), "the key should be free for the holder"
        options = Options("127.0.0.1", rig.server.port)
        plan = Plan(retry_delay=KILLED_RETRY_DELAY)
        crew = Crew(face, "mutex", rig.service, options, plan, shared, count=2)
        rig.all_blocked(2)
        holder_key = f"{prefix_of('mutex', rig.service)}permit:0:{KEY}"
        assert rig.clean.pttl(holder_key) > 0, "the lease ran out before the kill: too slow"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(STEP)
        killed = log.event("test", "kill")
    finally:
        if child.poll() is None:
            child.kill()  # by its pid
            child.wait(STEP)
        if child.stdout is not None:
            child.stdout.close()
    crew.join()
    grants = sorted(e.start for n in crew.names for e in events(log.of(n), "granted"))
    assert len(grants) == 2, f"grants: {grants}"
    first = grants[0]
    assert first > killed
    unsignalled = min(e.start for n in crew.names for e in commands(log.of(n), "release"))
    assert unsignalled > first
    # The fewest attempts a waiter can make while the lease lasts: each wait
    # lasts at least half retry_delay, or until the expiry it was told of.
    bound = math.ceil(KILLED_TTL / (0.5 * KILLED_RETRY_DELAY)) + 2
    problems = []
    tries_of: dict[str, int] = {}
    for name in crew.names:
        entries = log.of(name)
        problems += wait_problems(name, entries, KILLED_RETRY_DELAY)
        # A signal can only come from a release, and no waiter released before
        # the first grant (the holder never did): every BLPOP that ended
        # before the first release was sent ran out.
        woken = [e for e in commands(entries, "blpop") if e.end < unsignalled and e.reply]
        if woken:
            problems.append(f"{name}: a BLPOP returned a signal before any release: {woken}")
        tries = [e for e in commands(entries, "acquire") if e.start < first]
        tries_of[name] = len(tries)
        if len(tries) > bound:
            problems.append(f"{name}: {len(tries)} attempts before the first grant (> {bound})")
        reported: int | None = None
        for entry in entries:
            if entry.what == "acquire":
                reported = entry.pttl
                continue
            told = math.inf if reported is None else (reported + 1) / 1000 + MS
            if entry.what == "blpop" and (entry.timeout or 0.0) > told:
                problems.append(f"{name}: BLPOP of {entry.timeout} s after PTTL {reported} ms")
        refused = [e for e in tries if isinstance(e.reply, list) and e.reply[0] == -1]
        if not refused or any(e.pttl is None or e.pttl < 0 for e in refused):
            problems.append(f"{name}: a failed attempt did not report the holder's PTTL")
    assert not marker.overlaps, marker.overlaps
    assert not problems, problems
    print(f"[waiting-faults killed-holder {face}] attempts_before_grant={tries_of} bound={bound}")


# --- 5. a contended run through random cuts -----------------------------------------------

RUN_CASES: list[Face] = ["sync", "async"]


@pytest.mark.parametrize("face", RUN_CASES)
def test_a_contended_run_through_cuts_stays_exact(rig: Rig, face: Face) -> None:
    """Workers loop acquire_with_retry / read-modify-write / release through random cuts:
    the counter is exact, no two holders overlap, every record but the fence counter expires."""
    shared, log = rig.shared, rig.shared.log
    marker = _marker(rig, "mutex")
    shared.path_up.set()
    prefix = prefix_of("mutex", rig.service)
    untimed_seen: set[str] = set()
    server = ("127.0.0.1", rig.server.port)
    rng = random.Random(f"{SEED}:run:{face}")
    with CuttingProxy(server, RUN_RATES, seed=SEED) as proxy:
        # Half the workers keep redis-py's retries, half retry nothing.
        default = Options(proxy.host, proxy.port, default_retries=True)
        bare = Options(proxy.host, proxy.port)
        plan = Plan(
            retry_delay=RUN_RETRY_DELAY,
            ttl=RUN_TTL,
            timeout=RUN_TIMEOUT,
            calls=1,
            cycles=RUN_CYCLES,
            rmw=True,
            deadline=time.monotonic() + RUN_SECONDS,
        )
        stop = threading.Event()

        def cutter() -> None:
            while not stop.wait(rng.uniform(*RUN_CUT_EVERY)):
                proxy.cut_all()

        cutting = threading.Thread(target=cutter, name="cutter", daemon=True)
        with sampling(lambda: untimed_seen.update(untimed(rig.clean, prefix)), SAMPLE_EVERY, "ttl"):
            proxy.enabled = True
            cutting.start()
            try:
                crew = Crew(
                    face,
                    "mutex",
                    rig.service,
                    bare,
                    plan,
                    shared,
                    count=RUN_WORKERS,
                    options_of=lambda i: default if i % 2 == 0 else bare,
                )
                crew.join(RUN_SECONDS + RUN_TIMEOUT + STEP)
            finally:
                stop.set()
                cutting.join(STEP)
                proxy.enabled = False
        assert proxy.errors == []
        injected = proxy.injected
    untimed_seen.update(untimed(rig.clean, prefix))
    counter = int(rig.clean.get(COUNTER) or 0)
    granted = sum(len(events(log.of(n), "granted")) for n in crew.names)
    problems = []
    for name in crew.names:
        problems += wait_problems(name, log.of(name), RUN_RETRY_DELAY)
    blpop_failed = sum(
        1 for n in crew.names for e in commands(log.of(n), "blpop") if e.error is not None
    )
    raised = sum(len(events(log.of(n), "raised")) for n in crew.names)
    timeouts = sum(len(events(log.of(n), "none")) for n in crew.names)
    abandoned = sum(len(events(log.of(n), "abandoned")) for n in crew.names)
    gave_up = sum(len(events(log.of(n), "gave-up")) for n in crew.names)
    print(
        f"[waiting-faults run {face}] granted={granted} applied={shared.applied} "
        f"counter={counter} faults={injected} connections_cut={proxy.cuts} "
        f"blpop_failed={blpop_failed} raised={raised} timeouts={timeouts} abandoned={abandoned} "
        f"gave_up={gave_up} overran={marker.overran} untimed={sorted(untimed_seen)}"
    )
    assert counter == shared.applied, f"counter {counter}, writes applied {shared.applied}"
    assert not marker.overlaps, marker.overlaps
    assert marker.overran == 0, "a holder outlived its lease: the run proves nothing"
    assert not untimed_seen, f"records without a TTL: {sorted(untimed_seen)}"
    assert not problems, problems
    assert granted >= RUN_WORKERS, "the run made no progress"
    assert shared.applied > 0, "no write was applied"
    assert injected > 0, "no fault was injected at random"
    assert proxy.cuts > 0, "no connection was cut"
    assert blpop_failed > 0, "no fault hit a blocked waiter"

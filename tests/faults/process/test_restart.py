"""The server killed (SIGKILL) and restarted on the same port while workers hold and queue.

Workers loop acquire_with_retry / work / release on one key, a DMutex or a
DSemaphore(max_permits=2). Mid-run the test kills the server with SIGKILL,
keeps it down for 0.5 to 1 s (drawn from a seeded generator), starts it again
on the same port with the same data folder, and does that twice. Before the
first kill the test takes a lease of its own (the straddler) and releases it
after the restart. The servers keep every acknowledged write
(``tests/_support/fault_servers.py``): Redis with ``appendonly yes`` and
``appendfsync always``, SecantusDB with ``sync_on_commit=True``.

The workers: on Redis, two threads whose redis-py clients keep their default
retries, two whose clients retry nothing (so that the outage reaches dmutex
as exceptions), and the same two kinds on the asyncio face; on the MongoDB
test server, two sync workers and one asyncio one. Each worker has its own
client, instance and thread; the asyncio workers' calls run on one event
loop in a thread of its own, as tasks side by side.

What is checked:

- every exception a worker sees is a clear connection error (redis-py's
  ``ConnectionError`` / ``TimeoutError`` family, pymongo's
  ``ConnectionFailure``), none before the first kill, and some while down;
- ``acquire_with_retry`` never returns None (its timeout is far longer than
  any outage and TTL);
- no overlap: every lease is an interval from the moment acquire returned to
  the moment release was called, cut at the lease's ``expired_at`` (dmutex
  computes it before sending, so it is never later than the server's
  expiry). A lease whose release raised may still be held: if the request
  cannot have been sent (no retries and the connection refused, or no server
  selected) it counts until its ``expired_at``; if it may have been sent and
  done, until the last sample that still showed its token. At no instant may
  more than ``max_permits`` intervals be open. (Counting every raised release
  to its expiry would be wrong the other way: a release done by the server
  whose reply was lost frees the key for the next holder at once.)
- the straddler's release() after the restart returns True: a lease
  acknowledged before the kill was still held by its token;
- after each restart every worker completes more cycles;
- no permit taken for an attempt that reported contention (a wrong None),
  and none held by a token that no worker was handed unless it is the last
  attempt of an acquire that raised: the workers' clients record every token
  their acquires send (redis-py's by its ``execute_command``, pymongo's by
  command monitoring, as each command starts), and a monitor samples the
  slot keys every 10 ms, so a token seen on the server is attributed to the
  attempt that sent it;
- no released token seen on the server after its release returned (True or
  False), and no key without a TTL;
- at the end, after all workers stopped: the permits still held are only
  those of a release or an acquire that raised (counted and printed, with -s),
  and they run out by their TTL. An acquire's write can reach the server just
  before the kill, be kept, and lose its reply; its clean-up release finds no
  server, so its permit stays until its TTL, which on the semaphore (one slot
  left for the workers) can outlast the test.
"""

from __future__ import annotations

import contextlib
import heapq
import random
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal, Protocol, TypeAlias

import pymongo
import pymongo.errors
import pymongo.monitoring
import pytest
import redis
import redis.asyncio
import redis.asyncio.retry
import redis.backoff
import redis.retry

from dmutex import (
    __version__,
)
from tests._support import faces, fault_servers, mongo_servers
from tests._support.tokens import TOKEN

Kind: TypeAlias = Literal["mutex", "semaphore"]
FaceName: TypeAlias = Literal["sync", "async"]
Doc: TypeAlias = dict[str, Any]
Outcome: TypeAlias = Literal["lease", "none", "raised"]

KEY = "orders"
SERVICE = "restart"
PERMITS = 2  # the semaphore's
TTL = 2.5  # long against one cycle (a few ms), short against the test
STRADDLE_TTL = 15.0  # the straddler's: outlasts a kill, an outage and a restart
ACQUIRE_TIMEOUT = 20.0  # far longer than an outage plus a TTL: None would be wrong
RETRY_DELAY = 0.005
WORK = 0.002  # seconds each holder "works" while holding
PAUSE_AFTER_ERROR = 0.02
MONITOR_EVERY = 0.01
ROUNDS = 2  # kills per test
WARM_CYCLES = 5  # per worker, before the first kill
AFTER_CYCLES = 2  # per worker, after each restart
DOWN = (0.5, 1.0)  # seconds the server stays down
STEP_TIMEOUT = 40.0  # any one wait of the test
SEED = 1042
MONGO_DB = "dmutex_faults"


# --- which tokens an acquire sent ------------------------------------------------------------

# The list the current thread or task collects the tokens of its requests in.
SENT: ContextVar[list[str] | None] = ContextVar("SENT", default=None)


def _note(args: Iterable[object]) -> None:
    sent = SENT.get()
    if sent is None:
        return
    for arg in args:
        text = arg.decode(errors="replace") if isinstance(arg, bytes) else arg
        if isinstance(text, str) and TOKEN.fullmatch(text) and text not in sent:
            sent.append(text)


def _leaves(document: object) -> Iterator[object]:
    """Every value in a command document, its nested documents and arrays opened."""
    if isinstance(document, Mapping):
        for value in document.values():
            yield from _leaves(value)
    elif isinstance(document, list | tuple):
        for value in document:
            yield from _leaves(value)
    else:
        yield document


class SpiedRedis(redis.Redis):
    """redis-py's client, noting the tokens it sends; its retries are redis-py's own."""

    def execute_command(self, *args: Any, **options: Any) -> Any:
        _note(args)
        return super().execute_command(*args, **options)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated


class AsyncSpiedRedis(redis.asyncio.Redis):
    """:class:`SpiedRedis` for asyncio."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        _note(args)
        return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]  # as above


class SpiedCommands(pymongo.monitoring.CommandListener):
    """Notes the tokens in every command a pymongo client (sync or asyncio) starts to send.

    pymongo publishes a command's start in the thread or task that sends it,
    before the bytes go out, so every request that may have reached the
    server is noted (one that failed before that, such as finding no server,
    sent nothing).
    """

    def started(self, event: pymongo.monitoring.CommandStartedEvent) -> None:
        _note(_leaves(event.command))

    def succeeded(self, event: pymongo.monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: pymongo.monitoring.CommandFailedEvent) -> None:
        pass


# --- what the workers saw, shared ---------------------------------------------------------


Ending: TypeAlias = Literal["holding", "released", "unsent", "maybe-done"]


@dataclass
class Leased:
    """One lease a worker was handed, and how its release went (wall-clock times)."""

    worker: str
    token: str
    start: float  # acquire returned
    expires: float  # the lease's expired_at: never later than the server's expiry
    called: float | None = None  # release called
    ending: Ending = "holding"

    def end(self, seen: dict[str, float]) -> float:
        """Until when the lease surely counted as held."""
        if self.ending == "released":
            assert self.called is not None
            return min(self.called, self.expires)
        if self.ending == "maybe-done":
            assert self.called is not None
            return min(self.expires, max(self.called, seen.get(self.token, 0.0)))
        return self.expires  # unsent, or still holding when the workers stopped


def overlaps(leases: list[Leased], seen: dict[str, float], permits: int) -> tuple[list[str], int]:
    """Moments when more than ``permits`` leases were held at once, and the peak."""
    intervals = sorted((x.start, x.end(seen), x.worker) for x in leases)
    open_: list[tuple[float, str]] = []  # a heap of (end, worker)
    found: list[str] = []
    peak = 0
    for start, end, worker in intervals:
        if end <= start:
            continue  # handed out already expired: never held
        while open_ and open_[0][0] <= start:
            heapq.heappop(open_)
        if len(open_) >= permits:
            found.append(f"{worker} at {start:.3f} while {sorted(w for _, w in open_)} held")
        heapq.heappush(open_, (end, worker))
        peak = max(peak, len(open_))
    return found, peak


@dataclass
class Tally:
    """One worker's counts."""

    cycles: int = 0
    cycles_after: list[int] = field(default_factory=lambda: [0] * ROUNDS)
    timeouts: int = 0  # acquire_with_retry returned None
    false_releases: int = 0  # release() returned False


@dataclass
class Call:
    """One acquire_with_retry call: the tokens it sent and how it ended."""

    worker: str
    tokens: list[str]
    outcome: Outcome
    lease: str | None
    ended: float  # wall clock


class Run:
    """Everything the workers, the monitor and the test share."""

    def __init__(self, permits: int) -> None:
        self.permits = permits
        self.leases: list[Leased] = []
        self.stop = threading.Event()
        self.monitor_stop = threading.Event()
        self.changed = threading.Condition()
        self.deadline = time.monotonic() + 4 * STEP_TIMEOUT
        # Event times are wall-clock (time.time()), comparable with expired_at.
        self.windows: list[tuple[float, float]] = []  # (killed, up again)
        self.killed_at: float | None = None
        self.tallies: dict[str, Tally] = {}
        self.errors: list[tuple[str, str, type[BaseException], float]] = []
        self.crashes: list[str] = []
        self.calls: list[Call] = []
        self.released: dict[str, float] = {}  # token: when its release returned
        self.seen: dict[str, float] = {}  # token: when the last sample showing it was sent
        self.straddles: list[bool] = []  # release() after the restart, of a lease from before
        self.no_ttl = 0
        self.samples = 0
        self.monitor_errors = 0

    def tally(self, worker: str) -> Tally:
        with self.changed:
            return self.tallies.setdefault(worker, Tally())

    def running(self) -> bool:
        return not self.stop.is_set() and time.monotonic() < self.deadline

    def error(self, worker: str, operation: str, error: BaseException) -> None:
        with self.changed:
            self.errors.append((worker, operation, type(error), time.time()))

    def call(self, worker: str, tokens: list[str], outcome: Outcome, lease: str | None) -> None:
        ended = time.time()
        with self.changed:
            self.calls.append(Call(worker, list(tokens), outcome, lease, ended))

    def acquired(self, worker: str, token: str, expires: float) -> Leased:
        leased = Leased(worker, token, time.time(), expires)
        with self.changed:
            self.leases.append(leased)
        return leased

    def completed(self, worker: str, started: float, token: str, released: bool) -> None:
        with self.changed:
            tally = self.tallies[worker]
            self.released[token] = time.time()
            tally.cycles += 1
            tally.false_releases += not released
            for i, (_, up) in enumerate(self.windows):
                if started >= up:
                    tally.cycles_after[i] += 1
            self.changed.notify_all()

    def sampled(self, sent_at: float, tokens: list[str], without_ttl: int) -> None:
        with self.changed:
            self.samples += 1
            self.no_ttl += without_ttl
            for token in tokens:
                self.seen[token] = sent_at

    def crashed(self, worker: str) -> None:
        with self.changed:
            self.crashes.append(f"{worker}:\n{traceback.format_exc()}")
            self.stop.set()
            self.changed.notify_all()

    def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: condition() or bool(self.crashes), STEP_TIMEOUT):
                pytest.fail(f"{what}: not within {STEP_TIMEOUT} s")
        if self.crashes:
            pytest.fail("a worker crashed:\n" + "\n".join(self.crashes))

    def phase(self, when: float) -> str:
        """Whether ``when`` was before the first kill, while down, or after a restart."""
        windows = list(self.windows)
        if self.killed_at is not None:
            windows.append((self.killed_at, float("inf")))
        if not windows or when < windows[0][0]:
            return "before"
        return "down" if any(k <= when < up for k, up in windows) else "after"

    def after_restart(self, round_: int) -> Callable[[Tally], int]:
        return lambda tally: tally.cycles_after[round_]


# --- the workers ----------------------------------------------------------------------------

Unsent: TypeAlias = Callable[[BaseException], bool]


def worker_loop(run: Run, worker: str, lock: faces.Face, unsent: Unsent) -> None:
    """acquire_with_retry / work / release until the test says stop, on a thread of its own.

    ``lock`` runs the async face's calls on the test's event loop thread, where
    the async workers' calls run as tasks side by side; a task copies the
    worker thread's context, so :data:`SENT` reaches its client. ``unsent(error)``
    says whether a release that raised ``error`` cannot have reached the server.
    """
    try:
        run.tally(worker)
        while run.running():
            started = time.time()
            sent: list[str] = []
            reset = SENT.set(sent)
            try:
                lease = lock.acquire_with_retry(
                    KEY, ttl=TTL, timeout=ACQUIRE_TIMEOUT, retry_delay=RETRY_DELAY
                )
            except Exception as error:  # noqa: BLE001 - counted; the check judges its type
                run.call(worker, sent, "raised", None)
                run.error(worker, "acquire", error)
                run.stop.wait(PAUSE_AFTER_ERROR)
                continue
            finally:
                SENT.reset(reset)
            run.call(worker, sent, "lease" if lease else "none", lease.token if lease else None)
            if lease is None:
                run.tally(worker).timeouts += 1
                continue
            leased = run.acquired(worker, lease.token, lease.expired_at.timestamp())
            time.sleep(WORK)
            leased.called = time.time()
            try:
                released = lease.release()
            except Exception as error:  # noqa: BLE001 - counted; the check judges its type
                leased.ending = "unsent" if unsent(error) else "maybe-done"
                run.error(worker, "release", error)
                run.stop.wait(PAUSE_AFTER_ERROR)
                continue
            leased.ending = "released"
            run.completed(worker, started, lease.token, released)
    except BaseException:  # noqa: BLE001 - the test fails with this traceback
        run.crashed(worker)


# --- the servers, as the test sees them ----------------------------------------------------


@dataclass(frozen=True)
class Worker:
    name: str
    face: FaceName
    retries: bool = True  # the client's default retries (Redis; pymongo has none here)


Closer: TypeAlias = Callable[[], object]


def face_lock(
    worker: Worker, kind: Kind, client: object, loop: faces.LoopThread, **options: Any
) -> faces.Face:
    """``worker``'s lock over ``client``, of its face (the async one's calls run on ``loop``)."""
    on = loop if worker.face == "async" else None
    return faces.Face(
        worker.face, kind, client, service_name=SERVICE, max_permits=PERMITS, loop=on, **options
    )


class Rig(Protocol):
    """One server under test: workers' locks, the monitor's sample, what is left."""

    @property
    def server(self) -> fault_servers.DurableRedis | fault_servers.DurableSecantusDB: ...

    @property
    def clear(self) -> tuple[type[BaseException], ...]:
        """The exceptions an outage may raise."""
        ...

    @property
    def workers(self) -> tuple[Worker, ...]: ...

    def lock(self, worker: Worker, kind: Kind, loop: faces.LoopThread) -> tuple[faces.Face, Closer]:
        """``worker``'s lock, of its face, on a client of its own; what closes the client."""
        ...

    def unsent(self, worker: Worker) -> Unsent:
        """For ``worker``: whether a request that raised this cannot have reached the server."""
        ...

    def sample(self) -> tuple[list[str], int]:
        """Tokens of the active permits of the key, and how many records lack an expiry."""
        ...

    def left(self) -> dict[str, str]:
        """The active permits still stored: record name, token."""
        ...

    def anything_left(self) -> bool:
        """Whether any record of the namespace still counts (Redis: any key but a counter)."""
        ...

    def close(self) -> None: ...


def _refused(error: BaseException) -> bool:
    """Whether ``error`` came from a refused connection (in its cause or context)."""
    seen: BaseException | None = error
    for _ in range(10):
        if seen is None:
            return False
        if isinstance(seen, ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _prefix(kind: Kind) -> str:
    return f"_dmutex_{SERVICE}:" if kind == "mutex" else f"_dsemaphore_{SERVICE}:"


class RedisRig:
    clear = (redis.ConnectionError, redis.TimeoutError)
    workers = (
        Worker("sync-retries-0", "sync"),
        Worker("sync-retries-1", "sync"),
        Worker("sync-no-retry-0", "sync", retries=False),
        Worker("sync-no-retry-1", "sync", retries=False),
        Worker("async-retries", "async"),
        Worker("async-no-retry", "async", retries=False),
    )

    def __init__(self, server: fault_servers.DurableRedis, kind: Kind) -> None:
        self.server = server
        self.kind = kind
        permits = 1 if kind == "mutex" else PERMITS
        self.names = [f"{_prefix(kind)}permit:{slot}:{KEY}" for slot in range(permits)]
        self.monitor = self._client()

    def _options(self) -> dict[str, Any]:
        return {
            "host": "127.0.0.1",
            "port": self.server.port,
            "socket_timeout": 10,  # a timeout only if the server hangs, never while it runs
            "socket_connect_timeout": 2,
        }

    def _client(self) -> redis.Redis:
        no_retry = redis.retry.Retry(redis.backoff.NoBackoff(), 0)
        return redis.Redis(**self._options(), retry=no_retry)

    def lock(self, worker: Worker, kind: Kind, loop: faces.LoopThread) -> tuple[faces.Face, Closer]:
        sync = worker.face == "sync"
        options = self._options()
        if not worker.retries:
            retry = redis.retry.Retry if sync else redis.asyncio.retry.Retry
            options["retry"] = retry(redis.backoff.NoBackoff(), 0)
        if sync:
            client = SpiedRedis(**options)
            return face_lock(worker, kind, client, loop), client.close
        aclient = AsyncSpiedRedis(**options)
        return face_lock(worker, kind, aclient, loop), lambda: loop.run(aclient.aclose())

    def unsent(self, worker: Worker) -> Unsent:
        # With retries an earlier try may have been done; without, only a refused
        # connection shows that nothing was sent.
        return lambda error: not worker.retries and _refused(error)

    def sample(self) -> tuple[list[str], int]:
        with self.monitor.pipeline(transaction=True) as pipe:
            pipe.mget(self.names)
            for name in self.names:
                pipe.pttl(name)
            values, *ttls = pipe.execute()
        tokens = [v.decode() for v in values if v is not None]
        return tokens, sum(1 for t in ttls if t == -1)

    def left(self) -> dict[str, str]:
        values: list[Any] = self.monitor.mget(self.names)
        return {n: v.decode() for n, v in zip(self.names, values, strict=True) if v is not None}

    def anything_left(self) -> bool:
        # Any key but the fence counters, which persist by design.
        names = self.monitor.keys(f"{_prefix(self.kind)}*")
        return any(not _decoded(name).startswith(f"{_prefix(self.kind)}fence:") for name in names)

    def close(self) -> None:
        self.monitor.close()


class MongoRig:
    clear = (pymongo.errors.ConnectionFailure,)
    workers = (
        Worker("sync-0", "sync"),
        Worker("sync-1", "sync"),
        Worker("async", "async"),
    )

    def __init__(self, server: fault_servers.DurableSecantusDB, kind: Kind) -> None:
        self.server = server
        self.kind = kind
        permits = 1 if kind == "mutex" else PERMITS
        self.ids = [f"permit:{slot}:{KEY}" for slot in range(permits)]
        self.monitor: pymongo.MongoClient[Doc] = pymongo.MongoClient(
            server.url, tz_aware=True, **self._options()
        )
        name = f"{'_dmutex_' if kind == 'mutex' else '_dsemaphore_'}{SERVICE}"
        self.collection = self.monitor.get_database(MONGO_DB).get_collection(name)

    def _options(self) -> dict[str, Any]:
        return {
            "serverSelectionTimeoutMS": 1_000,  # an outage raises within a second
            "connectTimeoutMS": 1_000,
            "socketTimeoutMS": 10_000,  # a timeout only if the server hangs
        }

    def lock(self, worker: Worker, kind: Kind, loop: faces.LoopThread) -> tuple[faces.Face, Closer]:
        options = {**self._options(), "event_listeners": [SpiedCommands()]}
        client: pymongo.MongoClient[Doc] | pymongo.AsyncMongoClient[Doc] = (
            pymongo.MongoClient(self.server.url, **options)
            if worker.face == "sync"
            else pymongo.AsyncMongoClient(self.server.url, **options)
        )
        lock = face_lock(worker, kind, client, loop, db_name=MONGO_DB)
        if worker.face == "sync":
            lock.wait(lock.target.ready())
        return lock, lambda: lock.wait(client.close())

    def unsent(self, worker: Worker) -> Unsent:
        # pymongo re-sends no write to a standalone server; it raises this one
        # before sending, when it found no server to send to.
        return lambda error: isinstance(error, pymongo.errors.ServerSelectionTimeoutError)

    def _active(self) -> Iterator[Doc]:
        docs = list(self.collection.find({"_id": {"$in": self.ids}}))
        now = datetime.now(timezone.utc)
        for doc in docs:
            expiry = doc.get("expiredAt")
            if not isinstance(expiry, datetime) or expiry > now:
                yield doc

    def sample(self) -> tuple[list[str], int]:
        docs = list(self._active())
        tokens = [str(doc.get("value")) for doc in docs]
        return tokens, sum(1 for doc in docs if not isinstance(doc.get("expiredAt"), datetime))

    def left(self) -> dict[str, str]:
        return {str(doc["_id"]): str(doc.get("value")) for doc in self._active()}

    def anything_left(self) -> bool:
        return bool(self.left())

    def close(self) -> None:
        self.monitor.close()


def _decoded(name: object) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


# --- one run ----------------------------------------------------------------------------------


def monitor(run: Run, rig: Rig) -> None:
    """Sample the key's permits every 10 ms until told to stop."""
    try:
        while not run.monitor_stop.is_set():
            sent_at = time.time()
            try:
                tokens, without_ttl = rig.sample()
            except rig.clear:
                with run.changed:
                    run.monitor_errors += 1
            else:
                run.sampled(sent_at, tokens, without_ttl)
            run.monitor_stop.wait(MONITOR_EVERY)
    except BaseException:  # noqa: BLE001 - the test fails with this traceback
        run.crashed("monitor")


def drive(rig: Rig, kind: Kind, rng: random.Random) -> Run:
    """Start the workers and the monitor, kill and restart the server ROUNDS times, stop.

    Before every other kill the test itself takes a lease (the straddler) and
    releases it after the restart: release() must find it still held.
    """
    run = Run(1 if kind == "mutex" else PERMITS)
    closers: list[Closer] = []
    threads: list[threading.Thread] = []
    watcher = threading.Thread(target=monitor, args=(run, rig), name="monitor")
    loop = faces.LoopThread()  # the async workers' calls run on it, as tasks side by side
    straddler, close = rig.lock(Worker("straddler", "sync"), kind, loop)
    closers.append(close)
    try:
        for worker in rig.workers:
            lock, close = rig.lock(worker, kind, loop)
            closers.append(close)
            thread = threading.Thread(
                target=worker_loop,
                args=(run, worker.name, lock, rig.unsent(worker)),
                name=worker.name,
            )
            threads.append(thread)
        watcher.start()
        for thread in threads:
            thread.start()
        names = [w.name for w in rig.workers]

        def every(least: int, count: Callable[[Tally], int]) -> Callable[[], bool]:
            return lambda: all(n in run.tallies and count(run.tallies[n]) >= least for n in names)

        run.wait_for(every(WARM_CYCLES, lambda t: t.cycles), "every worker warmed up")
        for round_ in range(ROUNDS):
            time.sleep(rng.uniform(0.0, 0.2))  # a point in mid-run: the fault, not a sync
            straddle = None
            if round_ % 2 == 0:
                # A lease acknowledged before the kill, released after the restart.
                lease = straddler.acquire_with_retry(
                    KEY, ttl=STRADDLE_TTL, timeout=STEP_TIMEOUT, retry_delay=RETRY_DELAY
                )
                assert lease is not None, "the straddler found no free permit"
                straddle = (
                    lease,
                    run.acquired("straddler", lease.token, lease.expired_at.timestamp()),
                )
            with run.changed:
                run.killed_at = time.time()
            rig.server.kill()
            time.sleep(rng.uniform(*DOWN))  # the outage itself
            rig.server.start()
            with run.changed:
                assert run.killed_at is not None
                run.windows.append((run.killed_at, time.time()))
                run.killed_at = None
            if straddle is not None:
                lease, leased = straddle
                leased.called = time.time()
                survived = lease.release()
                leased.ending = "released"
                with run.changed:
                    run.released[lease.token] = time.time()
                    run.straddles.append(survived)
            run.wait_for(
                every(AFTER_CYCLES, run.after_restart(round_)),
                f"every worker completed {AFTER_CYCLES} cycles after restart {round_ + 1}",
            )
    finally:
        run.stop.set()
        for thread in threads:
            if thread.ident is not None:
                thread.join(STEP_TIMEOUT)
        run.monitor_stop.set()
        if watcher.ident is not None:
            watcher.join(STEP_TIMEOUT)
        for close in closers:
            with contextlib.suppress(Exception):
                close()
        loop.close()
    stuck = [t.name for t in (*threads, watcher) if t.is_alive()]
    assert not stuck, f"threads still running after stop: {stuck}"
    return run


# --- the checks ------------------------------------------------------------------------------


def check(run: Run, rig: Rig, kind: Kind, label: str) -> None:
    """Every assertion of the module docstring, and a line of figures (shown with -s)."""
    assert not run.crashes, "a worker crashed:\n" + "\n".join(run.crashes)
    problems: list[str] = []

    kinds = sorted({t.__name__ for _, _, t, _ in run.errors})
    unclear = sorted({t.__name__ for _, _, t, _ in run.errors if not issubclass(t, rig.clear)})
    if unclear:
        problems.append(f"exceptions other than connection errors: {unclear}")
    phases = {p: 0 for p in ("before", "down", "after")}
    for _, _, _, when in run.errors:
        phases[run.phase(when)] += 1
    if phases["before"]:
        problems.append(f"{phases['before']} exceptions before the first kill")
    if not run.errors:
        problems.append("no worker saw the outage: the fault did not happen")

    timeouts = sum(t.timeouts for t in run.tallies.values())
    if timeouts:
        problems.append(f"acquire_with_retry returned None {timeouts} times")
    found, peak = overlaps(run.leases, run.seen, run.permits)
    if found:
        problems.append(f"{len(found)} overlaps: {found[:3]}")
    if peak < run.permits:
        problems.append(f"never {run.permits} holders at once (peak {peak})")
    short = {
        n: t.cycles_after for n, t in run.tallies.items() if min(t.cycles_after) < AFTER_CYCLES
    }
    if short:
        problems.append(f"workers without cycles after a restart: {short}")

    handed = {x.token for x in run.leases}  # the workers' and the straddler's
    refused: dict[str, Call] = {}
    raised: dict[str, Call] = {}
    for c in run.calls:
        last = c.tokens[-1] if c.outcome == "raised" and c.tokens else None
        for token in c.tokens:
            if token == last:
                raised[token] = c
            elif token != c.lease:
                refused[token] = c
    orphans = {t: at for t, at in run.seen.items() if t not in handed}
    wrong_none = sorted(refused[t].worker for t in orphans if t in refused)
    if wrong_none:
        problems.append(f"{len(wrong_none)} attempts took a permit and returned None: {wrong_none}")
    # An acquire that raised may leave its permit while the server cannot be reached.
    raised_calls = sum(1 for c in run.calls if c.outcome == "raised")
    left_by_raise = sorted(t for t, at in orphans.items() if t in raised and at > raised[t].ended)
    unknown = sorted(t for t in orphans if t not in refused and t not in raised)
    if unknown:
        problems.append(f"{len(unknown)} permits held by tokens no worker sent")
    stale = sorted(t for t, at in run.released.items() if run.seen.get(t, 0) > at)
    if stale:
        problems.append(f"{len(stale)} tokens held a permit after their release returned")
    if not all(run.straddles):
        problems.append(f"leases held across a restart were gone after it: {run.straddles}")
    if run.no_ttl:
        problems.append(f"{run.no_ttl} samples showed a permit without a TTL")

    # After the last release: only permits whose release or acquire raised may remain.
    left = rig.left()
    raised_releases = {x.token: x for x in run.leases if x.ending in ("unsent", "maybe-done")}
    from_release = sorted(n for n, t in left.items() if t in raised_releases)
    from_acquire = sorted(n for n, t in left.items() if t in raised)
    other = sorted(set(left) - set(from_release) - set(from_acquire))
    if other:
        problems.append(f"permits left that no raise explains: {other}")
    deadline = time.monotonic() + TTL + 3
    while rig.anything_left() and time.monotonic() < deadline:
        time.sleep(0.05)
    if rig.anything_left():
        problems.append(f"records still there {TTL + 3} s after the last lease")

    cycles = sum(t.cycles for t in run.tallies.values())
    false_releases = sum(t.false_releases for t in run.tallies.values())
    unsent = sum(1 for x in raised_releases.values() if x.ending == "unsent")
    late = sum(1 for x in run.leases if x.expires <= x.start)
    overran = sum(1 for x in run.leases if x.called is not None and x.called > x.expires)
    print(
        f"\n{label} {kind} (dmutex {__version__}): {ROUNDS} kills, {cycles} cycles, "
        f"{len(run.calls)} acquire calls ({raised_calls} raised), "
        f"{len(run.errors)} exceptions {kinds} by phase {phases}, "
        f"{len(raised_releases)} releases raised ({unsent} unsent), "
        f"{false_releases} returned False, straddlers released {run.straddles}, "
        f"peak {peak}, overlaps {len(found)}, "
        f"leases handed out expired {late}, released after expiry {overran}, "
        f"wrong None {len(wrong_none)}, permits seen but never handed {len(orphans)} "
        f"({len(left_by_raise)} outlived the acquire that raised), "
        f"left at the end {len(left)} (release raised {len(from_release)}, "
        f"acquire raised {len(from_acquire)}), samples {run.samples} "
        f"({run.monitor_errors} failed)"
    )
    assert not problems, f"{label} {kind}: " + "; ".join(problems)


# --- the tests -------------------------------------------------------------------------------

KINDS: list[Kind] = ["mutex", "semaphore"]


@pytest.fixture(scope="module")
def durable_redis() -> Iterator[fault_servers.DurableRedis]:
    executable = fault_servers.redis_executable()
    if executable is None:
        pytest.skip("no runnable redis-server executable to kill and restart")
    with fault_servers.DurableRedis(executable) as server:
        server.start()
        yield server


@pytest.fixture(scope="module")
def durable_secantus() -> Iterator[fault_servers.DurableSecantusDB]:
    if "secantusdb" not in mongo_servers.allowed_sources():
        pytest.skip("DMUTEX_MONGODB_SERVERS leaves out secantusdb")
    if mongo_servers.secantus_version() is None:
        pytest.skip("SecantusDB is not installed")
    with fault_servers.DurableSecantusDB() as server:
        server.start()
        yield server


@pytest.mark.parametrize("kind", KINDS)
def test_redis_killed_and_restarted_under_load(
    durable_redis: fault_servers.DurableRedis, kind: Kind
) -> None:
    """Redis, SIGKILLed twice under load: clear errors, no overlap, no orphan, work resumes."""
    if not durable_redis.running:
        durable_redis.start()
    rig = RedisRig(durable_redis, kind)
    try:
        rig.monitor.flushdb()
        run = drive(rig, kind, random.Random(f"{SEED}-redis-{kind}"))
        check(run, rig, kind, f"redis-{durable_redis.executable.version}")
    finally:
        rig.close()


@pytest.mark.parametrize("kind", KINDS)
def test_secantusdb_killed_and_restarted_under_load(
    durable_secantus: fault_servers.DurableSecantusDB, kind: Kind
) -> None:
    """The MongoDB test server, SIGKILLed twice under load: the same checks as Redis."""
    if not durable_secantus.running:
        durable_secantus.start()
    rig = MongoRig(durable_secantus, kind)
    try:
        rig.monitor.drop_database(MONGO_DB)
        run = drive(rig, kind, random.Random(f"{SEED}-mongodb-{kind}"))
        check(run, rig, kind, f"secantusdb-{mongo_servers.secantus_version()}")
    finally:
        rig.close()

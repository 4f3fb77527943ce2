"""A holder whose client hangs is told it lost the lease before anyone else can take it.

Each case takes leases with ``auto_renew=True`` through a client with the
library's default settings and no socket timeout, so that a request the
network swallows waits for ever: redis-py (``socket_timeout=None``: redis-py
8 would otherwise time out after 5 s; its default retries) and pymongo
(``MongoClient`` / ``AsyncMongoClient`` with their defaults, which have no
socket timeout) through a :class:`~tests._support.fault_proxy.FaultProxy`
each, to the session's Redis 7.0 server and to the MongoDB test server; and
``SQLiteBackend`` on a file of its own per trial (default timeout, 30 s).
Twenty trials per case, at TTLs from 1 to 3 s (more of them at 1-2 s, where
the margin is 0.1-0.2 s), run at once, each with a client of its own; on the
sync face (``DMutex``) and the asyncio one (``AsyncDMutex``).

Per trial the holder acquires a key and registers ``on_lost``; a thread
(sync) or a task (asyncio) waits in ``handle.wait_lost()``. On the asyncio
face the trial also runs ``run(key, body, auto_renew=True)`` on a second key,
whose body sleeps for an hour and notes when its ``CancelledError`` comes.
Once every lease has been renewed at least once, the network is cut for all
trials at once: every proxy becomes a blackhole (the open connections stay
open and carry nothing more; new ones are accepted and never answered), and
for SQLite another process takes the write lock of every file
(``BEGIN IMMEDIATE``) and keeps it until the trial's TTL has run out since
(plus 0.25 s), so that the holder's renewal waits in SQLite's busy handler.
Right after the cut a second holder, through a direct client (its own
``SQLiteBackend``), polls each key with ``acquire_with_retry(retry_delay=0.01)``.
The second holders run in a process of their own (``tests/_support/rivals.py``),
as another holder would: polling in the holders' process, they took its GIL
from the holders' timekeeper.

Every time is ``time.monotonic()``, in this process (the SQLite blocker's
and the second holders' times too: ``CLOCK_MONOTONIC`` is one clock for the
whole host). For every
lease of every trial:

- every way of telling the holder (``on_lost``, ``wait_lost()`` returning
  True, the ``run()`` body's cancellation) comes before the second holder's
  acquire returns its handle, and before the TTL has run out since the cut
  (every renewal answered was sent before it, so the record expires by then);
- none comes before the cut, and the lease was not lost before it;
- ``handle.lost`` is True at the end; ``run()`` raises ``LeaseLostError``,
  even though its release through the dead network fails (that error is
  logged, never raised in its place).

The smallest margin of each case (the second holder's grant less the last
telling) is in the failure message and in the terminal summary
(``tests/faults/conftest.py``). Finally the proxies stop (closing every
socket, so the hung requests fail) or the blocker lets go, and the clients
close; the holders' handles are not released (their leases are lost). Each
case is bounded: every wait has a timeout, and the asyncio case runs under
``asyncio.wait_for``.

Two more tests, on Redis, one per face: one ``DMutex`` on a blackholed client
holds a lease (TTL 2 s) while another ``DMutex`` of the same process, on a
healthy client, holds four leases of 1 s. For 4 s after the cut a sampler
reads the four keys' PTTL and value on the server every 50 ms: each key
always exists, holds its token, and its expiry keeps moving on; the healthy
leases are never lost, and the blackholed one is reported lost within its TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, Protocol, TypeAlias, TypeVar

import pymongo
import pytest
import redis
import redis.asyncio

from dmutex import (
    AsyncDMutex,
    AsyncDMutexLock,
    DMutex,
    DMutexLock,
    LeaseLostError,
    SQLiteBackend,
)
from tests._support import deadlines, rivals
from tests._support.deadlines import Trial
from tests._support.faces import FaceName
from tests._support.fault_proxy import FaultProxy, Rates, upstream_address
from tests._support.mongo_servers import Doc, Session
from tests._support.mongo_servers import Server as MongoServer
from tests._support.redis_servers import Pool
from tests._support.redis_servers import Server as RedisServer
from tests._support.rivals import Direct, Rival, Taken
from tests._support.sampling import sampling, until

T = TypeVar("T")
BackendName: TypeAlias = Literal["redis", "mongo", "sqlite"]
Kind: TypeAlias = Literal["acquire", "run"]

SERVICE = "deadlines"
SEED = 20240611  # the proxies inject no random fault: the seed only fills the argument

TRIALS = 20
# Cycled over the trials: more of them at 1-2 s, whose margin is 0.1-0.2 s (longer
# TTLs only lengthen each case: their margin is the same 0.2 s, reached the same way).
TTLS = (1.0, 1.0, 1.5, 2.0, 2.0, 3.0)
RIVAL_TTL = 1.0  # the second holder's lease, released at once
RETRY_DELAY = 0.01  # the second holder's polling
RIVAL_PATIENCE = 10.0  # seconds beyond the TTL that the second holder keeps trying
RENEWED_TIMEOUT = 15.0  # for every lease's first renewal (a third of 3 s, on a loaded machine)
TOLD_GRACE = 1.0  # after the last grant: a telling still missing then is late anyway
END_TIMEOUT = 20.0  # for hung calls to return once the fault has ended
CASE_TIMEOUT = 60.0  # the asyncio case, start to finish
SQLITE_SLACK = 0.25  # the blocker keeps a file this long past the trial's TTL since it took it
BLOCKER_TIMEOUT = 15.0  # for the blocker to take every file (a write may be under way)
# The one setting the holders' pymongo clients change: server selection, 30 s by
# default, runs only for a request that has no known server yet, never times out
# one that was sent; shorter, it ends run()'s release sooner once the proxy has
# stopped (the client then knows the server is gone), which bounds the test.
SELECTION_TIMEOUT_MS = 2_000

HEALTHY_LEASES = 4
HEALTHY_TTL = 1.0
HUNG_TTL = 2.0
WATCH = 4.0  # seconds watched after the cut
SAMPLE_EVERY = 0.05


def redis_name(key: str) -> str:
    """The Redis key of a mutex lease on ``key`` (slot 0 of the service's prefix)."""
    return f"_dmutex_{SERVICE}:permit:0:{key}"


def ttl_of(index: int) -> float:
    return TTLS[index % len(TTLS)]


def make_trials(case: str, kind: Kind) -> list[Trial]:
    """The leases of one kind for every trial of ``case``."""
    expected = ("on_lost", "wait_lost") if kind == "acquire" else ("on_lost", "cancelled")
    return [
        Trial(case, index, f"t{index:02d}-{kind}-ttl{ttl_of(index):g}", ttl_of(index), expected)
        for index in range(TRIALS)
    ]


def telling(trial: Trial, how: str) -> Callable[[object], None]:
    """An ``on_lost`` callback that records the time it is called."""

    def told(_handle: object) -> None:
        trial.tell(how)

    return told


# --- the backends: a client per trial through the fault, one direct for the second holder -----


class Rig:
    """One backend as a case uses it; :meth:`end_fault` and :meth:`close` are idempotent."""

    name: BackendName

    def sync_lock(self, index: int) -> DMutex:
        """Trial ``index``'s holder: a lock on a client of its own, through the fault."""
        raise NotImplementedError

    async def async_lock(self, index: int) -> AsyncDMutex:
        raise NotImplementedError

    def direct(self) -> Direct:
        """How the second holders' process reaches the store, bypassing the fault."""
        raise NotImplementedError

    def cut(self, trials: Sequence[Trial]) -> None:
        """Stop answering every trial's holder at once; set each lease's ``cut``."""
        raise NotImplementedError

    def end_fault(self) -> None:
        """End the fault, so that the hung calls return (with an error or an answer)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Close the asyncio clients, on the loop that used them."""

    def close(self) -> None:
        """Close the sync clients (after :meth:`end_fault`)."""


class Closable(Protocol):
    def close(self) -> None: ...


class ProxiedRig(Rig):
    """A server reached through one blackholing proxy per trial.

    A subclass makes the clients (:meth:`sync_client`, :meth:`async_client`), through
    trial ``index``'s proxy, and says how the second holders reach the server
    directly (:meth:`direct`); the rig keeps one lock per trial and face.
    """

    lock_options: dict[str, Any]  # what every DMutex of the rig is given besides the client

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.proxies: dict[int, FaultProxy] = {}
        self.sync_clients: list[Closable] = []
        self.sync_locks: dict[int, DMutex] = {}
        self.async_clients: list[redis.asyncio.Redis | pymongo.AsyncMongoClient[Doc]] = []
        self.async_locks: dict[int, AsyncDMutex] = {}
        self.lock_options = {}

    def sync_client(self, index: int) -> redis.Redis | pymongo.MongoClient[Doc]:
        """A new sync client, through trial ``index``'s proxy."""
        raise NotImplementedError

    def async_client(self, index: int) -> redis.asyncio.Redis | pymongo.AsyncMongoClient[Doc]:
        """A new asyncio client, as :meth:`sync_client`."""
        raise NotImplementedError

    def sync_lock(self, index: int) -> DMutex:
        if index not in self.sync_locks:
            client = self.sync_client(index)
            self.sync_clients.append(client)
            self.sync_locks[index] = DMutex(SERVICE, client, **self.lock_options)
        return self.sync_locks[index]

    async def async_lock(self, index: int) -> AsyncDMutex:
        if index not in self.async_locks:
            client = self.async_client(index)
            self.async_clients.append(client)
            self.async_locks[index] = AsyncDMutex(SERVICE, client, **self.lock_options)
        return self.async_locks[index]

    async def aclose(self) -> None:
        clients, self.async_clients = self.async_clients, []
        for client in clients:
            # redis-py's asyncio client closes by aclose(), pymongo's by close().
            await (client.aclose() if isinstance(client, redis.asyncio.Redis) else client.close())

    def close(self) -> None:
        clients, self.sync_clients = self.sync_clients, []
        for client in clients:
            client.close()

    def proxy(self, index: int) -> FaultProxy:
        if index not in self.proxies:
            proxy = FaultProxy(self.upstream, Rates(), seed=SEED + index)
            self.proxies[index] = proxy.__enter__()
        return self.proxies[index]

    def cut(self, trials: Sequence[Trial]) -> None:
        for index, proxy in sorted(self.proxies.items()):
            asked = time.monotonic()
            proxy.blackholed = True
            done = time.monotonic()  # from here on, nothing more crosses
            for trial in trials:
                if trial.index == index:
                    trial.cut, trial.cut_done = asked, done

    def end_fault(self) -> None:
        for proxy in self.proxies.values():
            proxy.stop()

    def proxy_errors(self) -> list[str]:
        return [f"proxy {i}: {e}" for i, p in sorted(self.proxies.items()) for e in p.errors]


class RedisRig(ProxiedRig):
    name = "redis"

    def __init__(self, server: RedisServer) -> None:
        super().__init__((server.host, server.port))
        self.server = server

    def through(self, index: int) -> dict[str, Any]:
        """A holder's client options: through trial ``index``'s proxy, no socket timeout
        (a request the blackhole swallows waits for ever), redis-py's default retries
        (10, with backoff)."""
        proxy = self.proxy(index)
        return {
            "host": proxy.host,
            "port": proxy.port,
            "password": self.server.password,
            "db": self.server.db,
            "socket_timeout": None,
        }

    def sync_client(self, index: int) -> redis.Redis:
        return redis.Redis(**self.through(index))

    def async_client(self, index: int) -> redis.asyncio.Redis:
        return redis.asyncio.Redis(**self.through(index))

    def direct(self) -> Direct:
        return Direct("redis", self.server.url)


class MongoRig(ProxiedRig):
    name = "mongo"

    def __init__(self, server: MongoServer) -> None:
        super().__init__(upstream_address(server.url))
        self.server = server
        self.lock_options = {"db_name": server.db_name}

    def through(self, index: int) -> str:
        proxy = self.proxy(index)
        # directConnection: the proxy's address is not the one the server reports.
        return f"mongodb://{proxy.host}:{proxy.port}/?directConnection=true"

    def sync_client(self, index: int) -> pymongo.MongoClient[Doc]:
        return pymongo.MongoClient(
            self.through(index), serverSelectionTimeoutMS=SELECTION_TIMEOUT_MS
        )

    def async_client(self, index: int) -> pymongo.AsyncMongoClient[Doc]:
        return pymongo.AsyncMongoClient(
            self.through(index), serverSelectionTimeoutMS=SELECTION_TIMEOUT_MS
        )

    def direct(self) -> Direct:
        return Direct("mongo", self.server.url, options=(("db_name", self.server.db_name),))


# The blocker: takes the write lock of each file (BEGIN IMMEDIATE), printing
# when, then lets each go at its own time. argv[1]: [[index, path, hold], ...].
BLOCKER = r"""
import json, sqlite3, sys, time
plan = json.loads(sys.argv[1])
held = []
for index, path, hold in plan:
    conn = sqlite3.connect(path, timeout=10, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    now = time.monotonic()
    held.append((now + hold, index, conn))
    print(json.dumps({"index": index, "held": now}), flush=True)
print(json.dumps({"all": time.monotonic()}), flush=True)
for until, index, conn in sorted(held, key=lambda h: h[0]):
    time.sleep(max(0.0, until - time.monotonic()))
    conn.execute("ROLLBACK")
    conn.close()
"""


class SQLiteRig(Rig):
    """A file per trial; the fault is another process holding every file's write lock."""

    name = "sqlite"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.backends: list[SQLiteBackend] = []
        self.holders: dict[int, SQLiteBackend] = {}
        self.blocker: subprocess.Popen[str] | None = None
        self.trials: list[Trial] = []

    def path(self, index: int) -> Path:
        return rivals.sqlite_file(self.folder, index)

    def backend(self, index: int, side: dict[int, SQLiteBackend]) -> SQLiteBackend:
        if index not in side:
            backend = SQLiteBackend(self.path(index))  # the default timeout: 30 s
            self.backends.append(backend)
            side[index] = backend
        return side[index]

    def sync_lock(self, index: int) -> DMutex:
        return DMutex(SERVICE, self.backend(index, self.holders))

    async def async_lock(self, index: int) -> AsyncDMutex:
        return AsyncDMutex(SERVICE, self.backend(index, self.holders))

    def direct(self) -> Direct:
        return Direct("sqlite", str(self.folder))

    def cut(self, trials: Sequence[Trial]) -> None:
        holds: dict[int, float] = {}
        for trial in trials:
            holds[trial.index] = max(holds.get(trial.index, 0.0), trial.ttl + SQLITE_SLACK)
        plan = [[index, str(self.path(index)), hold] for index, hold in sorted(holds.items())]
        self.blocker = subprocess.Popen(
            [sys.executable, "-c", BLOCKER, json.dumps(plan)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.blocker.stdout is not None
        deadline = time.monotonic() + BLOCKER_TIMEOUT
        while True:
            line = self.blocker.stdout.readline()  # the blocker prints or dies within 10 s
            if not line:
                self.end_fault()
                pytest.fail(f"the SQLite blocker died before taking every file: {self.stderr()}")
            report = json.loads(line)
            if "all" in report:
                break
            for trial in trials:
                if trial.index == report["index"]:
                    trial.cut = float(report["held"])
            if time.monotonic() > deadline:
                self.end_fault()
                pytest.fail(f"the SQLite blocker took {BLOCKER_TIMEOUT} s and more")

    def stderr(self) -> str:
        if self.blocker is None or self.blocker.stderr is None:
            return ""
        return self.blocker.stderr.read()

    def end_fault(self) -> None:
        """Wait until the blocker has let every file go (it exits); kill it by pid if it hangs."""
        blocker, self.blocker = self.blocker, None
        if blocker is None:
            return
        try:
            blocker.wait(max(TTLS) + SQLITE_SLACK + END_TIMEOUT)
        except subprocess.TimeoutExpired:
            blocker.kill()
            blocker.wait(10)
        finally:
            for stream in (blocker.stdout, blocker.stderr):
                if stream is not None:
                    stream.close()

    def close(self) -> None:
        backends, self.backends = self.backends, []
        for backend in backends:
            backend.close()


@pytest.fixture
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    """The backend of ``request.param``; its fault ended and its clients closed after."""
    name: BackendName = request.param
    found: Rig
    if name == "redis":
        found = RedisRig(deadlines.redis_target(request.getfixturevalue("redis_pool")))
    elif name == "mongo":
        session: Session = request.getfixturevalue("mongo_session")
        found = MongoRig(session.fresh())
    else:
        found = SQLiteRig(tmp_path)
    try:
        yield found
    finally:
        found.end_fault()
        found.close()


# --- the second holders, in a process of their own ----------------------------------------------


@contextlib.contextmanager
def second_holders(rig: Rig, trials: Sequence[Trial]) -> Iterator[Callable[[], None]]:
    """The second holders' process, ready; in the block, call what it yields right after the
    cut: it lets them go and waits until each has its grant (``trial.taken``) or gave up."""
    plans = [Rival(t.index, t.key, RIVAL_TTL, t.ttl + RIVAL_PATIENCE, RETRY_DELAY) for t in trials]
    with rivals.spawned_rivals(rig.direct(), SERVICE, plans) as child:

        def release() -> None:
            child.go.set()
            results = child.finish("results", max(TTLS) + RIVAL_PATIENCE + 5)
            assert isinstance(results, list)
            by_key = {trial.key: trial for trial in trials}
            for taken in results:
                assert isinstance(taken, Taken)
                trial = by_key[taken.key]
                trial.taken = taken.taken
                if taken.note is not None:
                    trial.note(taken.note)

        yield release


# --- the sync face -------------------------------------------------------------------------------


class Expiring(Protocol):
    """A handle of either face, as far as its expiry goes."""

    @property
    def expired_at(self) -> datetime: ...


def first_renewals(leases: Sequence[tuple[Expiring, datetime]]) -> Callable[[], bool]:
    """A condition: every lease's ``expired_at`` has moved past the one it was granted with."""
    return lambda: all(lease.expired_at > first for lease, first in leases)


def sync_case(rig: Rig, case: str) -> list[Trial]:
    trials = make_trials(case, "acquire")
    with second_holders(rig, trials) as let_go:
        return sync_trials(rig, case, trials, let_go)


def sync_trials(
    rig: Rig, case: str, trials: list[Trial], let_go: Callable[[], None]
) -> list[Trial]:
    handles: dict[str, DMutexLock] = {}
    for trial in trials:
        handle = rig.sync_lock(trial.index).acquire(trial.key, ttl=trial.ttl, auto_renew=True)
        assert handle is not None, f"{trial.key} should be free"
        handle.on_lost(telling(trial, "on_lost"))
        handles[trial.key] = handle

    def wait_lost(trial: Trial, handle: DMutexLock) -> None:
        lost = handle.wait_lost(trial.ttl + RIVAL_PATIENCE + END_TIMEOUT)
        if lost:
            trial.tell("wait_lost")
        else:
            trial.note("wait_lost() returned False")

    waiters = [
        threading.Thread(target=wait_lost, args=(t, handles[t.key]), name=f"wait-{t.key}")
        for t in trials
    ]
    for waiter in waiters:
        waiter.daemon = True
        waiter.start()
    granted = [(h, h.expired_at) for h in handles.values()]
    until(first_renewals(granted), "every lease renewed once", RENEWED_TIMEOUT, poll=0.01)
    for trial in trials:
        trial.lost_before_cut = handles[trial.key].lost or bool(trial.told)

    rig.cut(trials)
    let_go()
    time.sleep(TOLD_GRACE)  # a telling still missing is late: this only tells late from never
    for trial in trials:
        trial.lost_at_end = handles[trial.key].lost
    rig.end_fault()  # the hung requests fail now; whatever they say comes too late to count
    for waiter in waiters:
        waiter.join(END_TIMEOUT)
    return trials


# --- the asyncio face ----------------------------------------------------------------------------


async def until_async(condition: Callable[[], bool], what: str, timeout: float) -> None:
    """:func:`until` for a coroutine: the loop runs (and renews) while it polls."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {timeout} s")
        await asyncio.sleep(0.01)


@dataclass
class Body:
    """What an asyncio ``run()`` body saw of its handle."""

    handle: AsyncDMutexLock
    first: datetime
    outcome: list[str] = field(default_factory=list)


async def run_forever(
    lock: AsyncDMutex, trial: Trial, bodies: dict[str, Body], outcomes: Counter[str]
) -> None:
    """``run()`` a body that sleeps for an hour: it must be cancelled, and run() raise."""

    async def body(handle: AsyncDMutexLock) -> None:
        bodies[trial.key] = Body(handle, handle.expired_at)
        handle.on_lost(telling(trial, "on_lost"))
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            trial.tell("cancelled")
            raise
        trial.note("the body slept its hour out")

    try:
        await lock.run(trial.key, body, ttl=trial.ttl, auto_renew=True)
    except asyncio.CancelledError:
        trial.note("run() itself was cancelled")
        raise
    except Exception as error:  # noqa: BLE001 - judged below, and noted if wrong
        if isinstance(error, LeaseLostError):
            outcomes["LeaseLostError"] += 1
        else:
            outcomes[type(error).__name__] += 1
            trial.note(f"run() raised {error!r}, not LeaseLostError")
        return
    outcomes["returned"] += 1
    trial.note("run() returned instead of raising LeaseLostError")


async def async_case(rig: Rig, case: str, outcomes: Counter[str]) -> list[Trial]:
    acquired = make_trials(case, "acquire")
    ran = make_trials(case, "run")
    trials = acquired + ran
    # Spawned and ready before the leases are taken (the loop waits meanwhile).
    with second_holders(rig, trials) as let_go:
        return await async_trials(rig, acquired, ran, outcomes, let_go)


async def async_trials(
    rig: Rig,
    acquired: list[Trial],
    ran: list[Trial],
    outcomes: Counter[str],
    let_go: Callable[[], None],
) -> list[Trial]:
    trials = acquired + ran
    handles: dict[str, AsyncDMutexLock] = {}
    bodies: dict[str, Body] = {}
    tasks: list[asyncio.Task[None]] = []
    try:
        for trial in acquired:
            lock = await rig.async_lock(trial.index)
            handle = await lock.acquire(trial.key, ttl=trial.ttl, auto_renew=True)
            assert handle is not None, f"{trial.key} should be free"
            handle.on_lost(telling(trial, "on_lost"))
            handles[trial.key] = handle

        async def wait_lost(trial: Trial, handle: AsyncDMutexLock) -> None:
            if await handle.wait_lost(trial.ttl + RIVAL_PATIENCE + END_TIMEOUT):
                trial.tell("wait_lost")
            else:
                trial.note("wait_lost() returned False")

        waiters = [asyncio.create_task(wait_lost(t, handles[t.key])) for t in acquired]
        runs = [
            asyncio.create_task(run_forever(await rig.async_lock(t.index), t, bodies, outcomes))
            for t in ran
        ]
        tasks += waiters + runs
        await until_async(lambda: len(bodies) == len(ran), "every body running", RENEWED_TIMEOUT)
        granted: list[tuple[Expiring, datetime]] = [(h, h.expired_at) for h in handles.values()]
        granted += [(seen.handle, seen.first) for seen in bodies.values()]
        await until_async(first_renewals(granted), "every lease renewed once", RENEWED_TIMEOUT)
        for trial in trials:
            handle = handles[trial.key] if trial.key in handles else bodies[trial.key].handle
            trial.lost_before_cut = handle.lost or bool(trial.told)

        await asyncio.to_thread(rig.cut, trials)  # the loop runs on meanwhile
        await asyncio.to_thread(let_go)
        await asyncio.sleep(TOLD_GRACE)
        for trial in trials:
            handle = handles[trial.key] if trial.key in handles else bodies[trial.key].handle
            trial.lost_at_end = handle.lost
        await asyncio.to_thread(rig.end_fault)
        await asyncio.wait(waiters + runs, timeout=END_TIMEOUT)
        for trial, task in zip(ran, runs, strict=True):
            if not task.done():
                trial.note(f"run() had not returned {END_TIMEOUT} s after the fault ended")
        return trials
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await rig.aclose()


def run_bounded(main: Awaitable[T], case: str) -> T:
    """``asyncio.run(main)``, failing the test if it takes longer than :data:`CASE_TIMEOUT`."""

    async def bounded() -> T:
        return await asyncio.wait_for(main, CASE_TIMEOUT)

    try:
        return asyncio.run(bounded())
    except asyncio.TimeoutError:  # the builtin TimeoutError only from Python 3.11
        pytest.fail(f"{case}: did not finish within {CASE_TIMEOUT} s")


# --- the cases -----------------------------------------------------------------------------------


@pytest.mark.parametrize("face", ["sync", "async"])
@pytest.mark.parametrize("rig", ["redis", "mongo", "sqlite"], indirect=True)
def test_a_hung_client_is_told_of_the_loss_before_anyone_takes_the_lease(
    rig: Rig, face: FaceName
) -> None:
    """20 trials at once: every telling precedes the second holder's grant (see the docstring)."""
    tell_case(rig, f"{rig.name}-{face}", face)


def tell_case(rig: Rig, case: str, face: FaceName) -> None:
    """Run ``case``'s trials on ``rig`` with ``face``, print its margin, and judge it.

    The other servers' fault suites run it on rigs of their own.
    """
    started = time.monotonic()
    outcomes: Counter[str] = Counter()  # how the asyncio run() calls ended
    with deadlines.Scheduling.watching() as scheduling:
        if face == "sync":
            trials = sync_case(rig, case)
        else:
            trials = run_bounded(async_case(rig, case, outcomes), case)
    extra = rig.proxy_errors() if isinstance(rig, ProxiedRig) else []
    ended = ",".join(f"{k}:{v}" for k, v in sorted(outcomes.items())) or "-"
    margin = deadlines.record(case, trials, scheduling)
    seconds = time.monotonic() - started
    print(f"[deadlines {case}] {margin.text()} run_ended={ended} seconds={seconds:.1f}")
    deadlines.judge(margin, trials, extra)


# --- a hung client delays no other client's renewals ----------------------------------------------


@dataclass
class HealthWatch:
    """The healthy leases as the server sees them, sampled by a clean client."""

    observer: redis.Redis
    tokens: dict[str, str]  # Redis key name -> the token its holder has
    samples: int = 0
    min_pttl: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def sample(self) -> None:
        names = list(self.tokens)
        with self.observer.pipeline(transaction=True) as pipe:
            for name in names:
                pipe.pttl(name)
                pipe.get(name)
            replies = pipe.execute()
        moment = time.monotonic()
        self.samples += 1
        for at, name in enumerate(names):
            pttl, value = int(replies[2 * at]), replies[2 * at + 1]
            self.min_pttl[name] = min(self.min_pttl.get(name, pttl), pttl)
            token = value.decode() if isinstance(value, bytes) else value
            if pttl <= 0 or token != self.tokens[name]:
                self.problems.append(f"{name} at {moment:.3f}: pttl={pttl} value={token!r}")


def healthy_checks(
    watch: HealthWatch,
    hung: Trial,
    healthy: list[Trial],
    moved: dict[str, float],
    lost: dict[str, bool],
) -> None:
    """Healthy leases held and renewed throughout; the hung one lost within its TTL."""
    expected_samples = WATCH / SAMPLE_EVERY / 4  # a loaded machine samples less often
    summary = (
        f"samples={watch.samples} min_pttl_ms={watch.min_pttl} expiry_moved_s="
        f"{ {k: round(v, 3) for k, v in moved.items()} } hung_told="
        f"{ {k: round(v - (hung.cut or 0), 3) for k, v in hung.told.items()} }"
    )
    print(f"[deadlines healthy] {summary}")
    assert watch.samples >= expected_samples, summary
    assert not watch.problems, f"a healthy lease lapsed on the server: {watch.problems[:10]}"
    assert not any(lost.values()), f"a healthy lease was reported lost: {lost}; {summary}"
    assert not any(t.told for t in healthy), f"on_lost on a healthy lease; {summary}"
    for key, seconds in moved.items():
        # Renewed throughout the window: its expiry moved on by about the window.
        assert seconds >= WATCH - HEALTHY_TTL, f"{key}'s expiry moved {seconds:.3f} s; {summary}"
    problems = hung.problems()
    assert not [p for p in problems if "second holder" not in p], (problems, summary)


def healthy_trials(face: FaceName) -> tuple[Trial, list[Trial]]:
    """The hung client's trial (it must be told of its loss), and the healthy leases'."""
    hung = Trial(f"redis-{face}-hung", 0, "hung", HUNG_TTL, ("on_lost",))
    healthy = [
        Trial(f"redis-{face}-healthy", i, f"healthy-{i}", HEALTHY_TTL, ())
        for i in range(HEALTHY_LEASES)
    ]
    return hung, healthy


@pytest.fixture
def redis_healthy_server(redis_pool: Pool) -> RedisServer:
    return deadlines.redis_target(redis_pool)


def test_sync_leases_of_a_healthy_client_renew_on_time_while_another_client_hangs(
    redis_healthy_server: RedisServer,
) -> None:
    server = redis_healthy_server
    hung, healthy = healthy_trials("sync")
    with contextlib.ExitStack() as stack:
        proxy = stack.enter_context(FaultProxy((server.host, server.port), Rates(), seed=SEED))
        stack.callback(proxy.stop)  # first of the exits: the hung request fails, then clients close
        hung_client = stack.enter_context(
            redis.Redis(
                host=proxy.host, port=proxy.port, password=server.password, socket_timeout=None
            )
        )
        healthy_client = stack.enter_context(redis.Redis.from_url(server.url))
        observer = stack.enter_context(redis.Redis.from_url(server.url))
        hung_handle = DMutex(SERVICE, hung_client).acquire("hung", ttl=HUNG_TTL, auto_renew=True)
        assert hung_handle is not None
        hung_handle.on_lost(telling(hung, "on_lost"))
        lock = DMutex(SERVICE, healthy_client)  # a second instance, on the healthy client
        handles: dict[str, DMutexLock] = {}
        for trial in healthy:
            handle = lock.acquire(trial.key, ttl=HEALTHY_TTL, auto_renew=True)
            assert handle is not None
            handle.on_lost(telling(trial, "on_lost"))
            handles[trial.key] = handle
        every = {**handles, "hung": hung_handle}
        granted = [(h, h.expired_at) for h in every.values()]
        until(first_renewals(granted), "every lease renewed once", RENEWED_TIMEOUT, poll=0.01)
        assert not hung_handle.lost
        watch = HealthWatch(observer, {redis_name(k): h.token for k, h in handles.items()})
        lost = dict.fromkeys(handles, False)

        def sample() -> None:
            watch.sample()
            for key, handle in handles.items():
                lost[key] = lost[key] or handle.lost

        at_cut = {key: handle.expired_at for key, handle in handles.items()}
        hung.cut = time.monotonic()
        proxy.blackholed = True
        hung.cut_done = time.monotonic()
        with sampling(sample, SAMPLE_EVERY, "healthy-sampler"):
            time.sleep(WATCH)
        hung.lost_at_end = hung_handle.lost
        hung.lost_before_cut = False  # checked above
        moved = {k: (h.expired_at - at_cut[k]).total_seconds() for k, h in handles.items()}
        healthy_checks(watch, hung, healthy, moved, lost)
        for handle in handles.values():
            assert handle.release() is True


def test_async_leases_of_a_healthy_client_renew_on_time_while_another_client_hangs(
    redis_healthy_server: RedisServer,
) -> None:
    server = redis_healthy_server
    hung, healthy = healthy_trials("async")

    async def main(proxy: FaultProxy, observer: redis.Redis) -> None:
        hung_client = redis.asyncio.Redis(
            host=proxy.host, port=proxy.port, password=server.password, socket_timeout=None
        )
        healthy_client = redis.asyncio.Redis.from_url(server.url)
        try:
            hung_handle = await AsyncDMutex(SERVICE, hung_client).acquire(
                "hung", ttl=HUNG_TTL, auto_renew=True
            )
            assert hung_handle is not None
            hung_handle.on_lost(telling(hung, "on_lost"))
            lock = AsyncDMutex(SERVICE, healthy_client)  # a second instance, on the healthy client
            handles: dict[str, AsyncDMutexLock] = {}
            for trial in healthy:
                handle = await lock.acquire(trial.key, ttl=HEALTHY_TTL, auto_renew=True)
                assert handle is not None
                handle.on_lost(telling(trial, "on_lost"))
                handles[trial.key] = handle
            every = {**handles, "hung": hung_handle}
            granted = [(h, h.expired_at) for h in every.values()]
            await until_async(first_renewals(granted), "every lease renewed once", RENEWED_TIMEOUT)
            assert not hung_handle.lost
            watch = HealthWatch(observer, {redis_name(k): h.token for k, h in handles.items()})
            lost = dict.fromkeys(handles, False)
            at_cut = {key: handle.expired_at for key, handle in handles.items()}
            hung.cut = time.monotonic()
            await asyncio.to_thread(setattr, proxy, "blackholed", True)
            hung.cut_done = time.monotonic()
            # The server's view from a thread; ``lost`` on the loop, which owns the handles.
            with sampling(watch.sample, SAMPLE_EVERY, "healthy-sampler"):
                ends = time.monotonic() + WATCH
                while time.monotonic() < ends:
                    for key, handle in handles.items():
                        lost[key] = lost[key] or handle.lost
                    await asyncio.sleep(SAMPLE_EVERY)
            hung.lost_at_end = hung_handle.lost
            hung.lost_before_cut = False  # checked above
            moved = {k: (h.expired_at - at_cut[k]).total_seconds() for k, h in handles.items()}
            healthy_checks(watch, hung, healthy, moved, lost)
            for handle in handles.values():
                assert await handle.release() is True
        finally:
            await asyncio.to_thread(proxy.stop)  # the hung request fails; then the clients close
            await hung_client.aclose()
            await healthy_client.aclose()

    with (
        FaultProxy((server.host, server.port), Rates(), seed=SEED) as proxy,
        redis.Redis.from_url(server.url) as observer,
    ):
        run_bounded(main(proxy, observer), "redis-async-healthy")

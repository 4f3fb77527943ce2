"""Renewal, loss and fencing against real servers: Redis and the SecantusDB test server.

Every test runs once per Redis server version found (``tests/_support/redis_servers.py``)
and once on the server ``tests/_support/mongo_servers.py`` finds (SecantusDB here, a
MongoDB-compatible server that is not MongoDB); each skips with the one-line reason of
its discovery when there is none.

- **Held**: a sync and an async lease (ttl=1 s, ``auto_renew=True``, different keys)
  are held together while another process tries to acquire both keys over and over.
  It never gets either; at the end both releases return True and neither lease is
  lost. The hold is :data:`HOLD_LONG` (6 s) on the newest Redis found and on the
  MongoDB-compatible server, :data:`HOLD_SHORT` (3 s, still three TTLs) on the other
  Redis versions, so the file stays near a minute in all.
- **Lost**: the test deletes the lease's record on the server (Redis: ``DEL`` of
  ``_dmutex_svc:permit:0:<key>``; MongoDB: the document ``permit:0:<key>``). The
  clients count the renewal requests they send (a connection class for redis-py, a
  command listener for pymongo), and the loss must be known by the first renewal
  sent after the delete: counted when the delete returned, N renewals had been sent;
  the loss is found at renewal N (one in flight across the delete) or N + 1, and no
  renewal follows it. No wall-clock figure is asserted; waits have a generous
  deadline only as a hang guard.
- **Fences**: 4 processes x 25 grants of one key with ``acquire_with_retry``. While
  holding, each grant increments a counter on the server (Redis ``INCR``, MongoDB
  ``$inc`` of another document): the mutex orders those increments, so the counter
  value is the grant's place in the order. Sorted by it, the fences strictly
  increase. Redis uses its default fencing; MongoDB ``fencing=True``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import threading
import time
import traceback
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import pymongo
import pymongo.monitoring
import pytest
import redis
import redis.asyncio
import redis.asyncio.connection
import redis.connection
from pymongo import ReturnDocument

import dmutex
from dmutex import AsyncDMutex, AsyncDMutexLock, DMutex, DMutexLock
from dmutex._backends.redis.scripts import RENEW
from tests._support import processes
from tests._support.mongo_servers import SELECTION_TIMEOUT_MS, mongo_label
from tests._support.mongo_servers import Session as MongoSession
from tests._support.redis_servers import Pool, server_or_skip
from tests._support.redis_servers import labels_or_skip as redis_labels

Kind: TypeAlias = Literal["redis", "mongo"]
Reports: TypeAlias = processes.Reports
Barrier: TypeAlias = processes.Barrier

SERVICE = "svc"
PERMIT = "permit:0:"  # the one slot of a mutex key, as both backends name it
REDIS_PREFIX = f"_dmutex_{SERVICE}:"
COLLECTION = f"_dmutex_{SERVICE}"
ORDER_KEY = "test:order"  # Redis: the counter the fence workers INCR while holding
ORDER_COLLECTION = "test_order"  # MongoDB: where the same counter is a document

TTL = 1.0
HOLD_LONG = 6.0  # the newest Redis found, and the MongoDB-compatible server
HOLD_SHORT = 3.0  # the other Redis versions
CONTENDER_PAUSE = 0.02  # between the contender's rounds of attempts
MIN_ATTEMPTS = 20  # per key: the contender really tried, many times over the hold
DEADLINE = 30.0  # hang guard for every wait in this process
POLL = 0.01
BARRIER_TIMEOUT = 60.0  # spawning and importing on a busy 2-core machine
WORKERS_DEADLINE = 120.0

FENCE_PROCESSES = 4
FENCE_GRANTS = 25
FENCE_KEY = "fenced"
FENCE_TTL = 10.0  # no grant may expire while held: the order is the mutex's
RETRY_TIMEOUT = 60.0
RETRY_DELAY = 0.005


# --- counting renewals ----------------------------------------------------------------


class Renewals:
    """How many renewal requests a client sent, per lock key (any thread may count)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def saw(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def __getitem__(self, key: str) -> int:
        with self._lock:
            return self._counts[key]


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _count_redis(renewals: Renewals, args: tuple[object, ...]) -> None:
    """Count each lease ``args`` renews, if it is the renewal script.

    ``EVALSHA sha n <slot key>... token ttl...``: one slot key per lease.
    """
    if len(args) < 4 or _text(args[0]).upper() not in ("EVALSHA", "EVAL"):
        return
    if _text(args[1]) in (RENEW.sha, RENEW.text):
        for name in args[3 : 3 + int(_text(args[2]))]:
            renewals.saw(_text(name).removeprefix(REDIS_PREFIX).removeprefix(PERMIT))


def counting_redis(url: str, renewals: Renewals) -> redis.Redis:
    """A redis-py client on ``url`` whose connections count the renewals they send."""

    class Connection(redis.connection.Connection):
        def send_command(self, *args: Any, **options: Any) -> None:
            _count_redis(renewals, args)
            # redis-py leaves send_command unannotated: called as a Callable.
            send: Callable[..., None] = super().send_command
            send(*args, **options)

    return redis.Redis.from_url(url, connection_class=Connection)


def async_counting_redis(url: str, renewals: Renewals) -> redis.asyncio.Redis:
    """:func:`counting_redis` for ``redis.asyncio``."""

    class Connection(redis.asyncio.connection.Connection):
        async def send_command(self, *args: Any, **options: Any) -> None:
            _count_redis(renewals, args)
            send: Callable[..., Awaitable[None]] = super().send_command
            await send(*args, **options)

    return redis.asyncio.Redis.from_url(url, connection_class=Connection)


class MongoRenewals(pymongo.monitoring.CommandListener):
    """Counts the extends a pymongo client sends: updates that set ``expiredAt`` only.

    An acquire's upsert sets ``value`` too; a release is a ``delete``.
    """

    def __init__(self, renewals: Renewals) -> None:
        self.renewals = renewals

    def started(self, event: pymongo.monitoring.CommandStartedEvent) -> None:
        if event.command_name != "update":
            return
        for update in event.command.get("updates", []):
            fields = update.get("u", {}).get("$set", {})
            if "expiredAt" in fields and "value" not in fields:
                self.renewals.saw(_text(update["q"]["_id"]).removeprefix(PERMIT))

    def succeeded(self, event: pymongo.monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: pymongo.monitoring.CommandFailedEvent) -> None:
        pass


# --- where the locks live (picklable: the workers get one too) ----------------------------


@dataclass(frozen=True)
class Place:
    """A Redis server (``url``), or a MongoDB-compatible one and its test database."""

    kind: Kind
    url: str
    db_name: str = ""

    @property
    def fencing(self) -> bool | None:
        """Redis fences by default; MongoDB only when asked."""
        return True if self.kind == "mongo" else None

    @contextlib.contextmanager
    def sync_mutex(
        self, renewals: Renewals | None = None, *, fencing: bool | None = None
    ) -> Iterator[DMutex]:
        """A sync mutex on a client of its own, counting renewals into ``renewals``."""
        if self.kind == "redis":
            client = (
                redis.Redis.from_url(self.url)
                if renewals is None
                else counting_redis(self.url, renewals)
            )
            try:
                yield DMutex(SERVICE, client, fencing=fencing)
            finally:
                client.close()
            return
        listeners = [] if renewals is None else [MongoRenewals(renewals)]
        mongo: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
            self.url, serverSelectionTimeoutMS=SELECTION_TIMEOUT_MS, event_listeners=listeners
        )
        try:
            yield DMutex(SERVICE, mongo, db_name=self.db_name, fencing=fencing)
        finally:
            mongo.close()

    @contextlib.asynccontextmanager
    async def async_mutex(self, renewals: Renewals) -> AsyncIterator[AsyncDMutex]:
        """An asyncio mutex on a client of its own, counting renewals into ``renewals``."""
        if self.kind == "redis":
            client = async_counting_redis(self.url, renewals)
            try:
                yield AsyncDMutex(SERVICE, client)
            finally:
                await client.aclose()
            return
        mongo: pymongo.AsyncMongoClient[dict[str, Any]] = pymongo.AsyncMongoClient(
            self.url,
            serverSelectionTimeoutMS=SELECTION_TIMEOUT_MS,
            event_listeners=[MongoRenewals(renewals)],
        )
        try:
            yield AsyncDMutex(SERVICE, mongo, db_name=self.db_name)
        finally:
            await mongo.close()

    @contextlib.contextmanager
    def tools(self) -> Iterator[Tools]:
        """Direct access to the server: delete a lease's record, take a turn of the counter."""
        if self.kind == "redis":
            client = redis.Redis.from_url(self.url)

            def delete(key: str) -> int:
                return int(client.delete(f"{REDIS_PREFIX}{PERMIT}{key}"))

            def next_order() -> int:
                return int(client.incr(ORDER_KEY))

            try:
                yield Tools(delete, next_order)
            finally:
                client.close()
            return
        mongo: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
            self.url, serverSelectionTimeoutMS=SELECTION_TIMEOUT_MS
        )
        db = mongo.get_database(self.db_name)

        def delete_doc(key: str) -> int:
            return db.get_collection(COLLECTION).delete_one({"_id": f"{PERMIT}{key}"}).deleted_count

        def next_doc_order() -> int:
            doc = db.get_collection(ORDER_COLLECTION).find_one_and_update(
                {"_id": "order"},
                {"$inc": {"n": 1}},
                upsert=True,
                return_document=ReturnDocument.AFTER,
            )
            assert doc is not None
            return int(doc["n"])

        try:
            yield Tools(delete_doc, next_doc_order)
        finally:
            mongo.close()


@dataclass(frozen=True)
class Tools:
    delete: Callable[[str], int]  # how many records it deleted
    next_order: Callable[[], int]  # the counter after this increment


@dataclass(frozen=True)
class Target:
    label: str
    place: Place
    hold: float  # seconds the held-lease test holds


def _targets() -> list[Any]:
    labels = redis_labels()  # [""]: skip with discovery's reason
    params = [
        pytest.param(("redis", label), id=f"redis@{label or 'no-server'}") for label in labels
    ]
    params.append(pytest.param(("mongo", ""), id=f"pymongo@{mongo_label()}"))
    return params


@pytest.fixture(params=_targets())
def target(request: pytest.FixtureRequest, redis_pool: Pool, mongo_session: MongoSession) -> Target:
    """The server of this case, emptied for the test (or a skip saying why there is none)."""
    kind, label = request.param
    if kind == "redis":
        server = server_or_skip(redis_pool, label)
        with redis.Redis.from_url(server.url) as client:
            client.flushdb()
        hold = HOLD_LONG if label == redis_pool.labels[-1] else HOLD_SHORT
        return Target(server.label, Place("redis", server.url), hold)
    mongo = mongo_session.fresh()
    return Target(mongo.label, Place("mongo", mongo.url, mongo.db_name), HOLD_LONG)


# --- waiting, with a hang guard --------------------------------------------------------


def wait_until(done: Callable[[], bool], what: str) -> None:
    ends = time.monotonic() + DEADLINE
    while not done():
        if time.monotonic() > ends:
            pytest.fail(f"no {what} within {DEADLINE} s")
        time.sleep(POLL)


async def wait_until_async(done: Callable[[], bool], what: str) -> None:
    ends = time.monotonic() + DEADLINE
    while not done():
        if time.monotonic() > ends:
            pytest.fail(f"no {what} within {DEADLINE} s")
        await asyncio.sleep(POLL)


# --- workers (module level: spawn imports this module to find them) ---------------------


@dataclass(frozen=True)
class Contention:
    """What the contender saw, per key."""

    worker: int
    attempts: tuple[int, ...]
    grants: tuple[int, ...]


def contender_worker(
    worker: int, reports: Reports, barrier: Barrier, place: Place, keys: list[str], seconds: float
) -> None:
    """For ``seconds``: try to acquire each of ``keys``, again and again."""
    try:
        attempts, grants = [0] * len(keys), [0] * len(keys)
        with place.sync_mutex() as mutex:
            mutex.ready()
            barrier.wait(BARRIER_TIMEOUT)
            ends = time.monotonic() + seconds
            while time.monotonic() < ends:
                for i, key in enumerate(keys):
                    got = mutex.acquire(key, TTL)
                    attempts[i] += 1
                    if got is not None:
                        grants[i] += 1
                        got.release()
                time.sleep(CONTENDER_PAUSE)
    except BaseException:
        barrier.abort()
        reports.put((worker, traceback.format_exc()))
        raise
    reports.put((worker, Contention(worker, tuple(attempts), tuple(grants))))


@dataclass(frozen=True)
class Grants:
    """(counter value taken while holding, fence) for each grant of one worker."""

    worker: int
    grants: tuple[tuple[int, int], ...]


def fence_worker(
    worker: int, reports: Reports, barrier: Barrier, place: Place, key: str, count: int
) -> None:
    """``count`` times: acquire with retry, take a turn of the counter, release."""
    grants: list[tuple[int, int]] = []
    try:
        with place.sync_mutex(fencing=place.fencing) as mutex, place.tools() as tools:
            mutex.ready()
            barrier.wait(BARRIER_TIMEOUT)
            for _ in range(count):
                lock = mutex.acquire_with_retry(
                    key, ttl=FENCE_TTL, timeout=RETRY_TIMEOUT, retry_delay=RETRY_DELAY
                )
                assert lock is not None, "acquire_with_retry timed out"
                assert lock.fence is not None, "a grant without a fence"
                grants.append((tools.next_order(), lock.fence))
                assert lock.release(), "a grant's release found it gone"
    except BaseException:
        barrier.abort()
        reports.put((worker, traceback.format_exc()))
        raise
    reports.put((worker, Grants(worker, tuple(grants))))


# --- held: renewed leases outlive many TTLs, and no other process gets them ---------------


@dataclass(frozen=True)
class Held:
    """One holder's lease at the end of the hold."""

    renewals: int  # sent while held
    lost_while_held: bool
    released: bool
    lost_after_release: bool
    lost_calls: int


async def hold_async(
    place: Place, key: str, acquired: threading.Event, done: threading.Event
) -> Held:
    """Hold ``key`` with the asyncio face until ``done`` is set (in a thread of its own)."""
    renewals = Renewals()
    async with place.async_mutex(renewals) as mutex:
        lock = await mutex.acquire(key, TTL, auto_renew=True)
        assert lock is not None, f"{key!r} was not free"
        calls: list[AsyncDMutexLock] = []
        lock.on_lost(calls.append)
        acquired.set()
        # The renewer task runs on this loop meanwhile.
        assert await asyncio.to_thread(done.wait, WORKERS_DEADLINE), "never told to release"
        lost, count = lock.lost, renewals[key]
        released = await lock.release()
        return Held(count, lost, released, lock.lost, len(calls))


def test_renewed_leases_outlive_many_ttls_and_no_other_process_gets_them(target: Target) -> None:
    place, hold = target.place, target.hold
    keys = ["held-sync", "held-async"]
    renewals = Renewals()
    acquired, done = threading.Event(), threading.Event()
    started = time.monotonic()
    with (
        place.sync_mutex(renewals) as mutex,
        concurrent.futures.ThreadPoolExecutor(1) as executor,
    ):
        lock = mutex.acquire(keys[0], TTL, auto_renew=True)
        assert lock is not None
        calls: list[DMutexLock] = []
        lock.on_lost(calls.append)
        async_holder = executor.submit(asyncio.run, hold_async(place, keys[1], acquired, done))
        try:
            ends = time.monotonic() + DEADLINE
            while not acquired.wait(POLL):
                if async_holder.done():
                    async_holder.result()  # raises what the holder raised
                if time.monotonic() > ends:
                    pytest.fail(f"the async holder did not acquire within {DEADLINE} s")
            (contention,) = processes.run_workers(
                contender_worker,
                1,
                place,
                keys,
                hold,
                deadline=WORKERS_DEADLINE,
                report=Contention,
            )
            lost, count = lock.lost, renewals[keys[0]]
            released = lock.release()
        finally:
            done.set()
        held_async = async_holder.result(DEADLINE)
    held_sync = Held(count, lost, released, lock.lost, len(calls))
    print(
        f"\nheld on {target.label} for {time.monotonic() - started:.1f} s (contender {hold} s):"
        f" {contention}, sync {held_sync}, async {held_async}"
    )
    assert contention.grants == (0, 0), "another process got a renewed lease"
    assert min(contention.attempts) >= MIN_ATTEMPTS
    # Held through the contender's whole window of `hold` seconds with ttl=1 s:
    # only renewals kept the records alive, at least one per TTL.
    for held in (held_sync, held_async):
        assert held.renewals >= hold / TTL - 1
        assert (held.lost_while_held, held.released, held.lost_after_release) == (
            False,
            True,
            False,
        )
        assert held.lost_calls == 0


# --- lost: deleting the record is found by the next renewal --------------------------------


def test_a_deleted_sync_lease_is_lost_at_the_next_renewal(target: Target) -> None:
    place, renewals = target.place, Renewals()
    with place.sync_mutex(renewals) as mutex, place.tools() as tools:
        # A handle: lost, on_lost once, wait_lost.
        key = "gone"
        lock = mutex.acquire(key, TTL, auto_renew=True)
        assert lock is not None
        calls: list[tuple[DMutexLock, int]] = []
        lock.on_lost(lambda handle: calls.append((handle, renewals[key])))
        wait_until(lambda: renewals[key] >= 1, "first renewal")
        assert tools.delete(key) == 1
        deleted_at = renewals[key]
        assert lock.wait_lost(DEADLINE) is True
        assert lock.lost
        wait_until(lambda: bool(calls), "on_lost call")
        ((handle, lost_at),) = calls
        assert handle is lock
        assert lost_at in (deleted_at, deleted_at + 1), "not lost by the next renewal"
        with pytest.raises(dmutex.LeaseLostError) as raised:
            lock.raise_if_lost()
        assert (raised.value.key, raised.value.token) == (key, lock.token)
        assert lock.release() is False
        assert len(calls) == 1, "on_lost was called again"
        assert renewals[key] == lost_at, "renewed after the loss"

        # run(..., auto_renew=True): the callback sees raise_if_lost() raise, run() raises.
        key = "ran"
        seen: dict[str, int] = {}

        def work(handle: DMutexLock) -> str:
            wait_until(lambda: renewals[key] >= 1, "first renewal")
            assert tools.delete(key) == 1
            seen["deleted_at"] = renewals[key]
            ends = time.monotonic() + DEADLINE
            while time.monotonic() < ends:
                try:
                    handle.raise_if_lost()
                except dmutex.LeaseLostError:
                    seen["raised_at"] = renewals[key]
                    return "saw the loss"
                time.sleep(POLL)
            return "never saw the loss"

        with pytest.raises(dmutex.LeaseLostError) as raised:
            mutex.run(key, work, TTL, auto_renew=True)
        assert raised.value.key == key
        assert "raised_at" in seen, "raise_if_lost() never raised in the callback"
        assert seen["raised_at"] in (seen["deleted_at"], seen["deleted_at"] + 1)
        assert renewals[key] == seen["raised_at"], "renewed after the loss"


def test_a_deleted_async_lease_is_lost_at_the_next_renewal(target: Target) -> None:
    place, renewals = target.place, Renewals()

    async def body(tools: Tools) -> None:
        async with place.async_mutex(renewals) as mutex:
            # A handle: lost, on_lost once, wait_lost.
            key = "gone"
            lock = await mutex.acquire(key, TTL, auto_renew=True)
            assert lock is not None
            calls: list[tuple[AsyncDMutexLock, int]] = []
            lock.on_lost(lambda handle: calls.append((handle, renewals[key])))
            await wait_until_async(lambda: renewals[key] >= 1, "first renewal")
            assert tools.delete(key) == 1  # blocks the loop for one request: no matter
            deleted_at = renewals[key]
            assert await lock.wait_lost(DEADLINE) is True
            assert lock.lost
            await wait_until_async(lambda: bool(calls), "on_lost call")
            ((handle, lost_at),) = calls
            assert handle is lock
            assert lost_at in (deleted_at, deleted_at + 1), "not lost by the next renewal"
            with pytest.raises(dmutex.LeaseLostError):
                lock.raise_if_lost()
            assert await lock.release() is False
            assert len(calls) == 1, "on_lost was called again"
            assert renewals[key] == lost_at, "renewed after the loss"

            # run(..., auto_renew=True): the callback's task is cancelled, run() raises.
            key = "ran"
            seen: dict[str, int] = {}

            async def work(handle: AsyncDMutexLock) -> str:
                await wait_until_async(lambda: renewals[key] >= 1, "first renewal")
                assert tools.delete(key) == 1
                seen["deleted_at"] = renewals[key]
                try:
                    await asyncio.sleep(DEADLINE)
                except asyncio.CancelledError:
                    seen["cancelled_at"] = renewals[key]
                    seen["lost_when_cancelled"] = handle.lost
                    raise
                return "not cancelled"

            with pytest.raises(dmutex.LeaseLostError) as raised:
                await mutex.run(key, work, TTL, auto_renew=True)
            assert raised.value.key == key
            assert "cancelled_at" in seen, "the callback was not cancelled"
            assert seen["lost_when_cancelled"] is True
            assert seen["cancelled_at"] in (seen["deleted_at"], seen["deleted_at"] + 1)
            assert renewals[key] == seen["cancelled_at"], "renewed after the loss"

    with place.tools() as tools:
        asyncio.run(body(tools))


# --- fences: successive holders in several processes ---------------------------------------


def test_fences_of_successive_holders_across_processes_strictly_increase(target: Target) -> None:
    started = time.monotonic()
    reports = processes.run_workers(
        fence_worker,
        FENCE_PROCESSES,
        target.place,
        FENCE_KEY,
        FENCE_GRANTS,
        deadline=WORKERS_DEADLINE,
        report=Grants,
    )
    grants = sorted((order, fence, r.worker) for r in reports for order, fence in r.grants)
    switches = sum(1 for a, b in itertools.pairwise(grants) if a[2] != b[2])
    print(
        f"\nfences on {target.label}: {time.monotonic() - started:.1f} s, {len(grants)} grants,"
        f" holder changed {switches} times, fences {grants[0][1]}..{grants[-1][1]}"
    )
    assert [len(r.grants) for r in reports] == [FENCE_GRANTS] * FENCE_PROCESSES
    total = FENCE_PROCESSES * FENCE_GRANTS
    # Every grant took its own turn of the counter: the holders never overlapped.
    assert [order for order, _, _ in grants] == list(range(1, total + 1))
    fences = [fence for _, fence, _ in grants]
    increasing = [(a, b) for a, b in itertools.pairwise(fences) if not a < b]
    assert not increasing, f"fences did not strictly increase in grant order: {increasing}"

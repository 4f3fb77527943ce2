"""Locks through a network that loses requests and replies: no overlap, no orphan, no lie.

Clients reach the server through :class:`~tests._support.fault_proxy.FaultProxy`,
which drops requests, drops replies after the server executed the request,
delays requests and tears connections mid-message, at points a seeded
random generator picks (2%, 5%, 5% and 1% of the requests). The clients keep
their default retry policy:

- redis-py 8.1 (``redis.Redis`` and ``redis.asyncio.Redis``) re-sends a
  command up to 10 times after a ``ConnectionError`` or ``TimeoutError``,
  with exponential backoff from 10 ms (jittered, capped at 1 s). A lost
  reply is therefore a re-sent request, which the server executes again.
- pymongo against a standalone server (SecantusDB here, which runs without
  the replica-set advertisement) retries reads, never writes: a lost reply to
  an upsert or a delete is an ``AutoReconnect`` for the caller. Each
  worker's client has a proxy of its own, which lets the request after each
  fault through (the clean-up a failed acquire sends reaches the server) and
  never faults the driver's ``hello`` handshakes and heartbeats.

Several workers, each with its own client, run rounds of cycles: acquire
(or, when the shared key is held, ``acquire_with_retry``), a little work,
release; on a ``DMutex`` and on a ``DSemaphore(max_permits=3)``. One worker
of each run has a key of its own, which nobody else touches. The test checks:

- **no overlap**: an in-process tracker records every holder from the moment
  acquire returned its handle until release is called; at no instant does a
  key have more unexpired holders than its limit;
- **no orphan** (a stored permit that no holder has): between rounds every
  worker is idle, so every permit still stored is one, and so is whatever
  the worker with its own key finds on it after a cycle; after ``release()``
  returned, True or False, its token must hold no permit; and a token seen
  in storage that no acquire returned is one (:class:`Run` says when that
  last check applies). Each orphan found is counted once, then deleted so
  that the next cycles start clean. After the last round, with faults off,
  storage must hold no permit;
- **every record expires**: on Redis a sampler thread, through a clean client
  on the server's own port, reads the PTTL of every key under the service's
  prefix throughout the run; on MongoDB every document must have an
  ``expiredAt`` date;
- **every failure is an exception**: ``acquire()`` on the worker's own free
  key returning None is a defect (a "wrong None"); exceptions must be the
  client's connection errors, and are counted by type.

Each run prints one summary line (``pytest -s`` shows it): cycles, faults
injected by kind, exceptions by type, wrong Nones, orphans, overlaps, and
its duration. Everything is bounded: no round starts after 20 s, a round
has a deadline, the proxy stops by itself, sockets time out after a few
seconds. ``DMUTEX_FAULT_SEED`` changes the seed (the interleaving of the
workers still varies from run to run). A first test checks the proxy
itself: one INCR through each fault, as the client and the server see it,
and an INCR held by a delay when its client closes: dropped, or with
``deliver_late`` delivered when the delay ends. Then its blackhole, on raw
sockets: a connection open when it starts, and one accepted during it, get
no byte back (within 0.3 s) and are not closed, even when the server
closes its side; the server never sees their requests; after the blackhole
new connections are forwarded again while the old one stays dead; stopping
the proxy ends every one of them (EOF or reset), and a redis-py client hung
on one without a socket timeout gets its ``ConnectionError``.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal, Protocol

import pymongo
import pymongo.errors
import pytest
import redis
import redis.asyncio
import redis.backoff
import redis.exceptions
import redis.retry
from pymongo.collection import Collection

from tests._support import faces
from tests._support.fault_proxy import Fault, FaultProxy, Rates, upstream_address
from tests._support.mongo_servers import Doc, Session
from tests._support.proxied import redis_options
from tests._support.redis_servers import Pool, Server
from tests._support.sampling import sampling as sampling_thread
from tests._support.tracking import Tracker, utcnow

Kind = Literal["mutex", "semaphore"]
FaceName = Literal["sync", "async"]

SEED = int(os.environ.get("DMUTEX_FAULT_SEED", "20240611"))
REDIS_LABEL = "redis-7.0"  # one server version: the suite runs once, not per version
SERVICE = "faults"
SHARED_KEY = "shared"
PERMITS = {"mutex": 1, "semaphore": 3}

# Per client chunk (about one request): 2% dropped, 5% replies dropped after
# the server executed the request, 5% delayed by 1-10 ms, 1% torn mid-message.
RATES = Rates(drop_request=0.02, drop_reply=0.05, delay=0.05, cut=0.01)

REDIS_TIMEOUT = 2.0  # socket_timeout and socket_connect_timeout: nothing hangs
REDIS_TTL = 2.0  # a cycle holds for a few ms; an orphan lasts this long
REDIS_WORKERS = {"mutex": 4, "semaphore": 5}  # on the shared key, plus one on its own
REDIS_CYCLES = 500  # per test, at least: four tests, about 2000 cycles
REDIS_ROUND = 10  # cycles per worker between two idle checks
REDIS_WORK = 0.002  # the most a holder works, in seconds

MONGO_TIMEOUT_MS = 3_000  # serverSelection, connect and socket timeouts
MONGO_TTL = 10.0  # longer than a round: an orphan is still there at the idle check
MONGO_WORKERS = {"mutex": 2, "semaphore": 4}
MONGO_CYCLES = 150  # per test: SecantusDB is slow
MONGO_ROUND = 5
MONGO_WORK = 0.01  # a request takes a few ms here: holders overlap in time

RETRY_DELAY = 0.01
RETRY_TIMEOUT = 5.0  # longer than a Redis TTL: a waiter outlasts an orphan there
RELEASE_ATTEMPTS = 3  # a release that raised is tried again: the lease is still ours
REDIS_SAMPLE_EVERY = 0.02  # seconds between two samples of every key's PTTL
MONGO_SAMPLE_EVERY = 0.25  # of every document's expiredAt (SecantusDB is slow)
ROUNDS_DEADLINE = 20.0  # no round starts after this (seconds from the first)
ROUND_TIMEOUT = 60.0  # a round that has not finished by then fails the test

REDIS_FAILURES: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)
MONGO_FAILURES: tuple[type[Exception], ...] = (pymongo.errors.ConnectionFailure,)
REDIS_RUN = (REDIS_FAILURES, REDIS_TTL, REDIS_WORK)
MONGO_RUN = (MONGO_FAILURES, MONGO_TTL, MONGO_WORK)


@dataclass
class Tally:
    """One worker's counts; merged into the run's at the end."""

    cycles: int = 0
    acquired: int = 0
    refused: int = 0  # plain acquire() found the shared key fully held
    retry_timeouts: int = 0  # acquire_with_retry() returned None at its timeout
    wrong_none: int = 0  # acquire() returned None on the worker's own, free key
    release_false: int = 0  # release() answered False (allowed after a re-sent release)
    release_gave_up: int = 0  # release() raised RELEASE_ATTEMPTS times
    exceptions: Counter[str] = field(default_factory=Counter)

    def add(self, other: Tally) -> None:
        for name in ("cycles", "acquired", "refused", "retry_timeouts", "wrong_none"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.release_false += other.release_false
        self.release_gave_up += other.release_gave_up
        self.exceptions.update(other.exceptions)


# A fence counter's value: it persists by design, so it is no record without an expiry.
COUNTER = r"dmutex:fence:[0-9]+"


class Inspector(Protocol):
    """Storage as a clean client (on the server's own port) sees it."""

    def holders(self, key: str) -> dict[str, str]:
        """The active permits of ``key``: record name -> token."""
        ...

    def permits(self) -> dict[str, str]:
        """Every active permit of the service: record name -> token."""
        ...

    def untimed(self) -> list[str]:
        """Records of the service that have no expiry."""
        ...

    def delete(self, names: list[str]) -> None:
        """Delete these records (orphans already counted)."""
        ...


class Run:
    """What one test shares between its workers: tracker, orphans, clocks.

    Orphans are found three ways. At an idle point (between rounds, or after
    a cycle on a worker's own key) nobody holds or acquires anything, so every
    stored permit is one. After ``release()`` returned, a permit still holding
    the token is one. And a token the sampler saw in storage that no acquire
    ever returned is one: whoever wrote it never got its handle (a re-sent
    acquire that reported contention or took another slot). That last way is
    exact only when no acquire raised, since an acquire that raised may have
    written its token and deleted it again; :meth:`orphan_tokens` counts it
    only then, and the summary shows it either way.
    """

    def __init__(
        self,
        kind: Kind,
        inspector: Inspector,
        failures: tuple[type[Exception], ...],
        ttl: float,
        work: float,
    ) -> None:
        self.kind = kind
        self.ttl = ttl  # of every lease
        self.work = work  # the most a holder works, in seconds
        self.limit = PERMITS[kind]
        self.inspector = inspector
        self.failures = failures
        self.tracker = Tracker(self.limit)
        self.idle_orphans: dict[str, str] = {}  # token -> record name, each counted once
        self.seen: dict[str, str] = {}  # every token the sampler saw stored -> record name
        self.returned: set[str] = set()  # every token an acquire returned
        self.abandoned: set[str] = set()  # tokens whose release never got an answer
        self.stale = 0  # release() returned, and the token still held a permit
        self.untimed: set[str] = set()
        self.tally = Tally()
        self.rounds = 0
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.deadline = self.started + ROUNDS_DEADLINE

    def abandon(self, token: str) -> None:
        """The test gave up releasing ``token``: its permit is no orphan of the library's."""
        with self._lock:
            self.abandoned.add(token)

    def claimed(self, token: str) -> None:
        """An acquire returned a handle with ``token``."""
        with self._lock:
            self.returned.add(token)

    def record(self, found: dict[str, str]) -> None:
        """Count the permits in ``found`` as orphans (once each) and delete them.

        Deleting them lets the next cycles start clean, so that one orphan is
        not counted again as a refusal or a wrong None.
        """
        orphans = {name: token for name, token in found.items() if token not in self.abandoned}
        if not orphans:
            return
        with self._lock:
            for name, token in orphans.items():
                self.idle_orphans.setdefault(token, name)
        self.inspector.delete(list(orphans))

    def after_release(self, key: str, token: str) -> None:
        """After release() returned: the token must hold no permit of ``key``."""
        held = {name: t for name, t in self.inspector.holders(key).items() if t == token}
        if held:
            with self._lock:
                self.stale += 1
            self.record(held)

    def idle_check(self) -> None:
        """Every worker is idle: every stored permit is an orphan; every record expires."""
        self.sample()
        self.record(self.inspector.permits())

    def sample(self) -> None:
        """What storage holds now: tokens seen, records without an expiry."""
        permits = self.inspector.permits()
        untimed = self.inspector.untimed()
        with self._lock:
            for name, token in permits.items():
                self.seen.setdefault(token, name)
            self.untimed.update(untimed)

    def unclaimed(self) -> dict[str, str]:
        """Tokens seen in storage that no acquire returned (and no release gave up on)."""
        with self._lock:
            skip = self.returned | self.abandoned
            return {token: name for token, name in self.seen.items() if token not in skip}

    def acquires_raised(self) -> int:
        return sum(n for name, n in self.tally.exceptions.items() if name.startswith("acquire:"))

    def orphan_tokens(self) -> dict[str, str]:
        """Every orphan found: token -> record name."""
        found = dict(self.idle_orphans)
        if self.acquires_raised() == 0:
            found.update(self.unclaimed())
        return found

    def summary(self, label: str, proxies: list[FaultProxy], extra: str = "") -> str:
        counts: Counter[str] = Counter()
        for proxy in proxies:
            counts.update({fault.value: n for fault, n in proxy.counts.items()})
        faults = " ".join(f"{f.value}={counts[f.value]}" for f in Fault if f is not Fault.PASS)
        t = self.tally
        exceptions = ",".join(f"{k}:{v}" for k, v in sorted(t.exceptions.items())) or "none"
        return (
            f"[fault-proxy {label} {self.kind}] seed={SEED} rounds={self.rounds} "
            f"cycles={t.cycles} acquired={t.acquired} refused={t.refused} "
            f"retry_timeouts={t.retry_timeouts} chunks={sum(counts.values())} "
            f"faults: {faults} exceptions={exceptions} wrong_none={t.wrong_none} "
            f"release_false={t.release_false} release_gave_up={t.release_gave_up} "
            f"stale_after_release={self.stale} idle_orphans={len(self.idle_orphans)} "
            f"unclaimed={len(self.unclaimed())} orphans={len(self.orphan_tokens())} "
            f"overlaps={self.tracker.overlaps} peak={self.tracker.peak} "
            f"overran={self.tracker.overran} untimed={len(self.untimed)}{extra} "
            f"seconds={time.monotonic() - self.started:.1f}"
        )

    def check(self, proxies: list[FaultProxy]) -> None:
        """The assertions every test makes at the end; one failure naming every problem."""
        for proxy in proxies:
            assert proxy.errors == [], proxy.errors
        assert sum(proxy.injected for proxy in proxies) > 0, "no fault was injected"
        assert self.tally.acquired > 0, "no cycle acquired anything"
        orphans = self.orphan_tokens()
        problems = [
            f"{what}: {count}"
            for what, count in (
                ("overlaps", self.tracker.overlaps),
                ("wrong None from acquire() on a free key", self.tally.wrong_none),
                ("tokens still holding a permit after release()", self.stale),
                ("orphaned permits", len(orphans)),
                ("records without an expiry", len(self.untimed)),
            )
            if count
        ]
        assert not problems, "; ".join(problems) + f" (orphans: {sorted(orphans.values())})"


# --- the workers ----------------------------------------------------------------------------


class Worker:
    """One thread's lock instance (either face) and key; runs cycles when asked.

    On the async face the lock's calls run on the test's event loop thread,
    where the workers' calls run as tasks side by side.
    """

    def __init__(self, run: Run, index: int, lock: faces.Face, key: str) -> None:
        self.run = run
        self.index = index
        self.lock = lock
        self.key = key
        self.solo = key != SHARED_KEY
        face = "" if lock.loop is None else "async:"
        self.rng = random.Random(f"{SEED}:{run.kind}:{face}{index}")
        self.tally = Tally()

    def cycles(self, count: int, hard_deadline: float) -> None:
        for _ in range(count):
            if time.monotonic() > hard_deadline:
                return
            self.cycle()

    def cycle(self) -> None:
        tally = self.tally
        tally.cycles += 1
        handle: faces.Handle | None = None
        try:
            handle = self.lock.acquire(self.key, ttl=self.run.ttl)
            if handle is None and self.solo:
                tally.wrong_none += 1
            elif handle is None:
                tally.refused += 1
                handle = self.lock.acquire_with_retry(
                    self.key, ttl=self.run.ttl, timeout=RETRY_TIMEOUT, retry_delay=RETRY_DELAY
                )
                if handle is None:
                    tally.retry_timeouts += 1
        except self.run.failures as error:
            tally.exceptions[f"acquire:{type(error).__name__}"] += 1
        if handle is not None:
            tally.acquired += 1
            self.run.claimed(handle.token)
            self.run.tracker.enter(self.key, self.index, handle.expired_at)
            time.sleep(self.rng.uniform(0, self.run.work))
            self.run.tracker.leave(self.key, self.index)
            self.release(handle)
        if self.solo:  # nobody else uses this key: whatever it holds now is an orphan
            self.run.record(self.run.inspector.holders(self.key))

    def release(self, handle: faces.Handle) -> None:
        for _ in range(RELEASE_ATTEMPTS):
            try:
                released = handle.release()
            except self.run.failures as error:
                self.tally.exceptions[f"release:{type(error).__name__}"] += 1
                continue
            if not released:
                self.tally.release_false += 1
            self.run.after_release(self.key, handle.token)
            return
        self.tally.release_gave_up += 1
        self.run.abandon(handle.token)


def rounds_needed(cycles: int, workers: int, per_round: int) -> int:
    return -(-cycles // (workers * per_round))


def drive(run: Run, workers: list[Worker], cycles: int, per_round: int) -> None:
    """Rounds of ``per_round`` cycles per worker, all at once; an idle check after each."""
    with ThreadPoolExecutor(len(workers), thread_name_prefix="fault-worker") as pool:
        for _ in range(rounds_needed(cycles, len(workers), per_round)):
            if time.monotonic() > run.deadline:
                break
            hard = time.monotonic() + ROUND_TIMEOUT
            futures = [pool.submit(w.cycles, per_round, hard) for w in workers]
            for future in futures:
                future.result(timeout=ROUND_TIMEOUT + 30)  # an unexpected exception raises here
            run.rounds += 1
            run.idle_check()
    for worker in workers:
        run.tally.add(worker.tally)


@contextlib.contextmanager
def sampling(run: Run, every: float) -> Iterator[None]:
    """Sample the records' expiries in a thread while the block runs."""
    with sampling_thread(run.sample, every, "fault-ttl-sampler"):
        yield


# --- Redis ------------------------------------------------------------------------------------


class RedisInspector:
    """The service's keys on the Redis server, through a client on its real port."""

    def __init__(self, client: redis.Redis, prefix: str, permits: int) -> None:
        self.client = client
        self.prefix = prefix
        self.permits_per_key = permits

    def _decoded(self, value: object) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    def holders(self, key: str) -> dict[str, str]:
        names = [f"{self.prefix}permit:{i}:{key}" for i in range(self.permits_per_key)]
        values = self.client.mget(names)
        return {n: self._decoded(v) for n, v in zip(names, values, strict=True) if v is not None}

    def permits(self) -> dict[str, str]:
        names = [self._decoded(n) for n in self.client.scan_iter(match=f"{self.prefix}permit:*")]
        if not names:
            return {}
        values = self.client.mget(names)
        return {n: self._decoded(v) for n, v in zip(names, values, strict=True) if v is not None}

    def untimed(self) -> list[str]:
        """Records without an expiry, but for the fence counters, which are meant to persist."""
        # PTTL -1: the key exists without an expiry; -2: it vanished since SCAN.
        names = [self._decoded(n) for n in self.client.scan_iter(match=f"{self.prefix}*")]
        untimed = [name for name in names if self.client.pttl(name) == -1]
        return [name for name in untimed if not self._is_counter(name)]

    def _is_counter(self, name: str) -> bool:
        if not name.startswith(f"{self.prefix}fence:"):
            return False
        value = self.client.get(name)
        return (
            value is not None
            and re.fullmatch(r"dmutex:fence:[0-9]+", self._decoded(value)) is not None
        )

    def delete(self, names: list[str]) -> None:
        if names:
            self.client.delete(*names)


def redis_target(pool: Pool) -> Server:
    """The one Redis server these tests run on: 7.0 if there is one, else the first."""
    labels = pool.labels
    if not labels:
        pytest.skip(pool.discovery.reason)
    return pool.server(REDIS_LABEL if REDIS_LABEL in labels else labels[0])


def redis_prefix(kind: Kind) -> str:
    return f"_dmutex_{SERVICE}:" if kind == "mutex" else f"_dsemaphore_{SERVICE}:"


def worker_keys(kind: Kind, shared: int) -> list[str]:
    return [SHARED_KEY] * shared + [f"own:{kind}"]


@pytest.fixture
def redis_target_server(redis_pool: Pool) -> Server:
    server = redis_target(redis_pool)
    with redis.Redis(host=server.host, port=server.port, password=server.password) as client:
        client.flushdb()
    return server


# What each fault does to one command, seen from a client that does not retry and
# from the server: (raises, the server executed it). A cut tears either side.
ONE_COMMAND = {
    Fault.PASS: (False, {1}),
    Fault.DROP_REQUEST: (True, {0}),
    Fault.DROP_REPLY: (True, {1}),
    Fault.DELAY: (False, {1}),
    Fault.CUT: (True, {0, 1}),
}


@pytest.mark.parametrize("fault", list(Fault), ids=[f.value for f in Fault])
def test_the_proxy_injects_each_fault(redis_target_server: Server, fault: Fault) -> None:
    """With one fault at rate 1, an INCR meets it: the client's error and the server agree."""
    server = redis_target_server
    rates = Rates(
        drop_request=1.0 if fault is Fault.DROP_REQUEST else 0.0,
        drop_reply=1.0 if fault is Fault.DROP_REPLY else 0.0,
        delay=1.0 if fault is Fault.DELAY else 0.0,
        cut=1.0 if fault is Fault.CUT else 0.0,
    )
    raises, executed = ONE_COMMAND[fault]
    no_retry = redis.retry.Retry(redis.backoff.NoBackoff(), 0)
    with (
        FaultProxy((server.host, server.port), rates, seed=SEED) as proxy,
        redis.Redis(
            host=proxy.host, port=proxy.port, socket_timeout=REDIS_TIMEOUT, retry=no_retry
        ) as client,
        redis.Redis(host=server.host, port=server.port, password=server.password) as clean,
    ):
        client.ping()  # connected, faults off
        before = proxy.counts
        with proxy.faults():
            if raises:
                with pytest.raises(redis.exceptions.ConnectionError):
                    client.incr("counter")
            else:
                assert client.incr("counter") == 1
        after = proxy.counts
        assert {f: after[f] - before[f] for f in Fault if after[f] != before[f]} == {fault: 1}
        assert int(clean.get("counter") or 0) in executed
        assert client.ping() is True  # faults off: a new connection goes through
        assert proxy.injected == (0 if fault is Fault.PASS else 1)
        assert proxy.errors == []


HELD = 0.2  # seconds a delayed command is held


@pytest.mark.parametrize("late", [False, True], ids=["dropped", "delivered-late"])
def test_a_delayed_command_whose_client_closed_is_dropped_or_delivered_late(
    redis_target_server: Server, late: bool
) -> None:
    """A client closes while its INCR is held by a delay: by default the INCR is dropped with
    the connection; with ``deliver_late`` the server gets it when the delay ends, as a network
    delivers what was sent before a close."""
    server = redis_target_server
    if server.password:
        pytest.skip("raw inline commands need a server without a password")
    rates = Rates(delay=1.0, delay_seconds=(HELD, HELD))
    with (
        FaultProxy((server.host, server.port), rates, seed=SEED, deliver_late=late) as proxy,
        redis.Redis(host=server.host, port=server.port) as clean,
    ):
        sock = raw_connection(proxy)
        assert ask(sock, b"PING") == b"+PONG\r\n"  # connected, faults off
        with proxy.faults():
            sock.sendall(b"INCR counter\r\n")
            deadline = time.monotonic() + GONE_WITHIN
            while proxy.counts[Fault.DELAY] == 0:
                assert time.monotonic() < deadline, "the INCR never reached the proxy"
                time.sleep(0.005)
            sock.close()
            time.sleep(3 * HELD)
        assert counter(clean) == (1 if late else 0)
        assert proxy.errors == []


# --- the blackhole ---------------------------------------------------------------------------

SILENCE = 0.3  # seconds a blackholed connection is watched for a byte or an EOF
GONE_WITHIN = 5.0  # seconds for a closed connection's EOF or reset to reach the client


def raw_connection(proxy: FaultProxy) -> socket.socket:
    """A plain TCP connection to the proxy (a Redis server without a password behind it)."""
    sock = socket.create_connection((proxy.host, proxy.port), timeout=GONE_WITHIN)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def ask(sock: socket.socket, command: bytes) -> bytes:
    """Send one inline command and read its one-line reply (RESP)."""
    sock.sendall(command + b"\r\n")
    reply = b""
    while not reply.endswith(b"\r\n"):
        chunk = sock.recv(4096)
        assert chunk, f"the connection closed before the reply to {command!r}"
        reply += chunk
    return reply


def silent(sock: socket.socket, seconds: float = SILENCE) -> bool:
    """Whether ``sock`` gets neither a byte nor an EOF for ``seconds``: it hangs, open."""
    sock.settimeout(seconds)
    try:
        data = sock.recv(4096)
    except TimeoutError:
        return True
    finally:
        sock.settimeout(GONE_WITHIN)
    raise AssertionError(f"a blackholed connection got {data!r} ({'EOF' if not data else 'bytes'})")


def ended(sock: socket.socket) -> bool:
    """Whether ``sock`` sees its peer close (EOF or reset) within :data:`GONE_WITHIN`."""
    sock.settimeout(GONE_WITHIN)
    try:
        while sock.recv(4096):
            pass  # nothing should come, but only the close matters here
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


def counter(clean: redis.Redis) -> int:
    return int(clean.get("counter") or 0)


@pytest.fixture
def clean_client(redis_target_server: Server) -> Iterator[redis.Redis]:
    """A client on the server's own port: what the server saw."""
    server = redis_target_server
    with redis.Redis(host=server.host, port=server.port, password=server.password) as client:
        yield client


@pytest.fixture
def raw_proxy(redis_target_server: Server) -> Iterator[FaultProxy]:
    """A proxy that injects nothing, before a server that raw inline commands can use.

    Skips on a server with a password: an inline command cannot AUTH.
    """
    server = redis_target_server
    if server.password:
        pytest.skip("raw inline commands need a server without a password")
    with FaultProxy((server.host, server.port), Rates(), seed=SEED) as proxy:
        yield proxy


def test_a_blackhole_silences_an_open_connection_without_closing_it(
    raw_proxy: FaultProxy, clean_client: redis.Redis
) -> None:
    """Blackholed: no reply, no EOF, the server never sees the request; stop() ends it."""
    proxy = raw_proxy
    with contextlib.closing(raw_connection(proxy)) as sock:
        assert ask(sock, b"INCR counter") == b":1\r\n"  # forwarded before
        proxy.blackholed = True
        assert proxy.blackholed
        sock.sendall(b"INCR counter\r\n")
        assert silent(sock)
        assert counter(clean_client) == 1  # the request never reached the server
        assert proxy.swallowed >= 1
        # The server closes its side: the client still sees nothing.
        clean_client.client_kill_filter(_type="normal", skipme=True)
        sock.sendall(b"PING\r\n")  # the client can still send
        assert silent(sock)
        proxy.stop()
        assert ended(sock), "the client's connection outlived the proxy"
    assert proxy.errors == []


def test_a_blackhole_accepts_new_connections_and_answers_nothing(
    raw_proxy: FaultProxy, clean_client: redis.Redis
) -> None:
    """A connection made during the blackhole is accepted, and hangs; stop() ends it."""
    proxy = raw_proxy
    proxy.blackholed = True
    before = proxy.connections
    with contextlib.closing(raw_connection(proxy)) as sock:
        sock.sendall(b"INCR counter\r\n")
        assert silent(sock)
        assert proxy.connections == before + 1
        assert counter(clean_client) == 0
        proxy.stop()
        assert ended(sock), "the client's connection outlived the proxy"
    assert proxy.errors == []


def test_after_a_blackhole_new_connections_pass_and_the_old_ones_stay_dead(
    raw_proxy: FaultProxy, clean_client: redis.Redis
) -> None:
    """The block form: inside it all is silent; after it, new connections are forwarded."""
    proxy = raw_proxy
    with contextlib.closing(raw_connection(proxy)) as old:
        assert ask(old, b"PING") == b"+PONG\r\n"
        with proxy.blackhole():
            old.sendall(b"INCR counter\r\n")
            assert silent(old)
        assert not proxy.blackholed
        with contextlib.closing(raw_connection(proxy)) as new:
            assert ask(new, b"INCR counter") == b":1\r\n"
        old.sendall(b"PING\r\n")
        assert silent(old)  # its stream lost bytes: it stays dead
        assert counter(clean_client) == 1
    assert proxy.errors == []


def test_a_client_without_a_socket_timeout_hangs_until_the_proxy_stops(
    redis_target_server: Server,
) -> None:
    """redis-py with no socket timeout waits for ever on a blackhole; stop() unblocks it."""
    server = redis_target_server
    no_retry = redis.retry.Retry(redis.backoff.NoBackoff(), 0)
    outcome: list[BaseException | object] = []
    with (
        FaultProxy((server.host, server.port), Rates(), seed=SEED) as proxy,
        redis.Redis(
            host=proxy.host,
            port=proxy.port,
            password=server.password,
            socket_timeout=None,
            retry=no_retry,
        ) as client,
    ):
        assert client.ping() is True

        def call() -> None:
            try:
                outcome.append(client.incr("counter"))
            except redis.exceptions.ConnectionError as error:
                outcome.append(error)

        proxy.blackholed = True
        caller = threading.Thread(target=call, name="hung-client", daemon=True)
        caller.start()
        caller.join(SILENCE)
        assert caller.is_alive(), f"the call ended on a blackhole: {outcome!r}"
        stopped = time.monotonic()
        proxy.stop()
        caller.join(GONE_WITHIN)
        assert not caller.is_alive(), "the client stayed hung after the proxy stopped"
        assert time.monotonic() - stopped < GONE_WITHIN
        assert len(outcome) == 1
        assert isinstance(outcome[0], redis.exceptions.ConnectionError), outcome
        assert proxy.errors == []


def make_lock(
    face: FaceName,
    kind: Kind,
    client: object,
    ttl: float,
    loop: faces.LoopThread | None = None,
    db_name: str = "dmutex",
) -> faces.Face:
    return faces.Face(
        face,
        kind,
        client,
        service_name=SERVICE,
        max_permits=PERMITS[kind],
        loop=loop,
        default_ttl_seconds=ttl,
        db_name=db_name,
    )


def redis_through_faults(server: Server, kind: Kind, face: FaceName) -> None:
    """Workers of ``face`` through a faulty proxy, their clients with default retries: checked."""
    clean = redis.Redis(host=server.host, port=server.port, password=server.password)
    run = Run(kind, RedisInspector(clean, redis_prefix(kind), PERMITS[kind]), *REDIS_RUN)
    keys = worker_keys(kind, REDIS_WORKERS[kind])
    loop = faces.LoopThread() if face == "async" else None
    clients: list[redis.Redis | redis.asyncio.Redis] = []
    try:
        with FaultProxy((server.host, server.port), RATES, seed=SEED) as proxy:
            workers = []
            for index, key in enumerate(keys):
                client_class = redis.Redis if face == "sync" else redis.asyncio.Redis
                client = client_class(**redis_options(proxy, server, REDIS_TIMEOUT))
                clients.append(client)
                lock = make_lock(face, kind, client, REDIS_TTL, loop)
                lock.wait(client.ping())  # connected before the faults start
                workers.append(Worker(run, index, lock, key))
            retry = clients[0].get_retry()
            retries = retry.get_retries() if retry is not None else 0
            with sampling(run, REDIS_SAMPLE_EVERY), proxy.faults():
                drive(run, workers, REDIS_CYCLES, REDIS_ROUND)
            run.idle_check()  # faults off: nothing may be left
            print(run.summary(f"{server.label} {face}", [proxy], f" client_retries={retries}"))
            run.check([proxy])
    finally:
        for client in clients:
            if isinstance(client, redis.asyncio.Redis):
                assert loop is not None
                loop.run(client.aclose())
            else:
                client.close()
        clean.close()
        if loop is not None:
            loop.close()


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_redis_sync_through_faults(redis_target_server: Server, kind: Kind) -> None:
    """redis.Redis with its default retries: no overlap, orphan, wrong None or untimed key."""
    redis_through_faults(redis_target_server, kind, "sync")


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_redis_async_through_faults(redis_target_server: Server, kind: Kind) -> None:
    """redis.asyncio.Redis with its default retries, on one event loop: as the sync test."""
    redis_through_faults(redis_target_server, kind, "async")


# --- MongoDB ---------------------------------------------------------------------------------


def is_handshake(chunk: bytes) -> bool:
    """Whether ``chunk`` carries a ``hello`` / ``isMaster`` command (handshake or heartbeat).

    Spared from faults: a lost heartbeat marks the server unknown for the
    whole client, which tests pymongo's monitoring rather than dmutex.
    """
    return b"hello\x00" in chunk or b"ismaster\x00" in chunk.lower()


class MongoInspector:
    """The service's collection, through the session's clean client."""

    def __init__(self, collection: Collection[Doc], permits: int) -> None:
        self.collection = collection
        self.permits_per_key = permits

    def holders(self, key: str) -> dict[str, str]:
        ids = [f"permit:{i}:{key}" for i in range(self.permits_per_key)]
        found = self.collection.find({"_id": {"$in": ids}, "expiredAt": {"$gt": utcnow()}})
        return {str(doc["_id"]): str(doc.get("value")) for doc in found}

    def permits(self) -> dict[str, str]:
        found = self.collection.find({"expiredAt": {"$gt": utcnow()}})
        return {str(doc["_id"]): str(doc.get("value")) for doc in found}

    def untimed(self) -> list[str]:
        docs = self.collection.find({})
        return [str(doc["_id"]) for doc in docs if not isinstance(doc.get("expiredAt"), datetime)]

    def delete(self, names: list[str]) -> None:
        if names:
            self.collection.delete_many({"_id": {"$in": names}})


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_mongo_sync_through_faults(mongo_session: Session, kind: Kind) -> None:
    """pymongo (standalone: writes are not retried): no overlap, orphan, wrong None; all expire.

    Each worker's client has a proxy of its own, which lets the request right
    after each fault through: the clean-up a failed acquire sends, or the
    second try of a release, reaches the server (the guarantee is for a
    server that can still be reached). Handshakes and heartbeats pass.
    """
    server = mongo_session.fresh()
    prefix = "_dmutex_" if kind == "mutex" else "_dsemaphore_"
    collection = mongo_session.admin.get_database(server.db_name).get_collection(prefix + SERVICE)
    run = Run(kind, MongoInspector(collection, PERMITS[kind]), *MONGO_RUN)
    keys = worker_keys(kind, MONGO_WORKERS[kind])
    clients: list[pymongo.MongoClient[Doc]] = []
    with contextlib.ExitStack() as stack:
        proxies = [
            stack.enter_context(
                FaultProxy(
                    upstream_address(server.url),
                    RATES,
                    seed=SEED + index,
                    spare=is_handshake,
                    calm_after_fault=1,
                )
            )
            for index in range(len(keys))
        ]
        try:
            workers = []
            for index, (key, proxy) in enumerate(zip(keys, proxies, strict=True)):
                client: pymongo.MongoClient[Doc] = pymongo.MongoClient(
                    f"mongodb://{proxy.host}:{proxy.port}/?directConnection=true",
                    serverSelectionTimeoutMS=MONGO_TIMEOUT_MS,
                    connectTimeoutMS=MONGO_TIMEOUT_MS,
                    socketTimeoutMS=MONGO_TIMEOUT_MS,
                )
                clients.append(client)
                lock = make_lock("sync", kind, client, MONGO_TTL, db_name=server.db_name)
                lock.wait(lock.target.ready())  # the TTL index, before the faults start
                workers.append(Worker(run, index, lock, key))
            with sampling(run, MONGO_SAMPLE_EVERY), contextlib.ExitStack() as faults:
                for proxy in proxies:
                    faults.enter_context(proxy.faults())
                drive(run, workers, MONGO_CYCLES, MONGO_ROUND)
            run.idle_check()
            print(run.summary(server.label, proxies))
            run.check(proxies)
        finally:
            for client in clients:
                client.close()

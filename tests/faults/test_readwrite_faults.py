"""Read-write locks under the fault suites' faults (issue 28): Redis; cancellation on more.

Each case is an existing suite's, its machinery driving a read-write lock;
:class:`~tests._support.rwfaces.SideFace` lends a ``DReadWriteLock`` or an
``AsyncDReadWriteLock`` the mutexes' ``Face`` methods, each acquire a
reader's or a writer's, so the suites' workers run unchanged. On Redis a
lock is one hash (``tests/_support/rwredis.py`` reads it): a hold or an
intent is a field, live while its expiry is after the server's ``TIME``.

1. **Proxy** (``network/test_proxy.py``): workers of both faces through the seeded
   fault proxy (requests and replies dropped, delays, cuts), their
   redis-py clients with default retries; each cycle is a reader's or
   (30%) a writer's: a plain acquire, and on the shared key
   ``acquire_*_with_retry`` when refused. No overlap: on a clean
   connection each holder marks itself in a gauge and reads the others'
   in one ``MULTI`` (as ``tests/integration/test_readwrite_processes.py``
   does), cut at the leases' expiries (:class:`Gauges`); a writer seeing
   anyone, or a reader seeing a writer, is an overlap. No orphan:
   ``test_proxy.Run``'s checks over the hashes' live hold fields (every one
   live at an idle point, after a release, or never handed out), and every
   writer's intent live at an idle point. No wrong None: ``acquire_read`` or
   ``acquire_write`` refused on a key only its worker uses (it transfers:
   a plain acquire leaves no intent, and a re-sent grant finds its own
   hold). No key without an expiry (the hash's ``PEXPIREAT``).
2. **Pause** (``process/test_pause.py``): two spawned holders (sync, asyncio) each
   hold four keys (a reader, a writer; each then taken by a reader and by
   a writer), are stopped by SIGSTOP past their 0.5 s TTL, the test takes
   every key, and SIGCONT: each stale hold's ``lost`` is True, and its
   extend and release by handle and by token (``pausing.stale_calls``)
   return False and leave the new hold's field and the hash's
   ``PEXPIRETIME`` as they were.
3. **Restart** (``process/test_restart.py``): its Redis workers (with and without
   client retries, both faces) each cycle a reader or (30%) a writer with
   ``acquire_*_with_retry`` while the server (``appendfsync always``) is
   SIGKILLed and restarted twice: connection errors only and only while
   down, every worker acquires again after each restart, no writer's hold
   overlaps another hold, no hold taken by an attempt that returned None
   or held by a token nobody sent, none held after its release returned,
   the straddler's survives the restart, and all lapses.
4. **Cancellation** (``cancellation/test_cancellation.py``): its seeded trials on the
   two sides of an ``AsyncDReadWriteLock`` (``run_read``/``run_write``,
   ``*_with_retry``, ``async with``, release by handle and by token),
   cancelled at random points, on ``InMemoryBackend``, on Redis behind its
   delaying client and on PostgreSQL behind its delaying asyncpg pool
   (each operation there is a read and a compare-and-set write: a
   cancellation between the two, or in the write's reply, is what it
   adds): after each batch no hold and no intent is left, a new reader of
   each key gets in at once, and no cancellation was swallowed.

Each case prints one summary (``pytest -s``). Seeded, on 127.0.0.1, bounded:
the module ran in 14 to 26 s here (2 cores, shared).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing.synchronize
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
import redis
import redis.asyncio
import redis.asyncio.retry
import redis.backoff
import redis.retry
from psycopg import sql

from dmutex import AsyncDReadWriteLock, DReadWriteLock, InMemoryBackend, __version__
from dmutex._core.lease import now_ms
from tests._support import cancellation, fault_servers, pausing, processes, rwredis
from tests._support.cancellation import (
    NotingClock,
    ReadWriteSide,
    Storage,
    Tally,
    judge,
    note_retry_waits,
    run_trials,
)
from tests._support.faces import Face, FaceName, Handle, LoopThread
from tests._support.fault_clients import DelayingRedis
from tests._support.fault_proxy import FaultProxy
from tests._support.postgres_clients import Phases
from tests._support.proxied import redis_options
from tests._support.redis_servers import Pool, Server
from tests._support.rwfaces import RWFace, Side, SideFace
from tests._support.sampling import until
from tests._support.tracking import Tracker
from tests.faults.cancellation import test_cancellation
from tests.faults.network import test_proxy
from tests.faults.process import test_restart

WRITE_SHARE = 0.3  # of the cycles of the proxy's and the restart's workers


def chooser(rng: random.Random) -> Iterator[Side]:
    """Sides drawn from ``rng``: a writer's :data:`WRITE_SHARE` of the time."""
    while True:
        yield "write" if rng.random() < WRITE_SHARE else "read"


def side_face(rw: RWFace, seed: str) -> SideFace:
    """``rw`` as a Face whose acquires are a reader's or a writer's, drawn from ``seed``."""
    sides = chooser(random.Random(seed))
    return SideFace(rw, lambda: next(sides))


@pytest.fixture
def rw_redis(redis_pool: Pool) -> Server:
    """The fault suites' Redis server (7.0 where there is one), emptied; 7.0 or later."""
    server = test_proxy.redis_target(redis_pool)
    if tuple(int(part) for part in server.version.split(".")[:2]) < (7, 0):
        pytest.skip("reading a hash's expiry takes PEXPIRETIME, Redis 7.0 or later")
    with redis.Redis(host=server.host, port=server.port, password=server.password) as client:
        client.flushdb()
    return server


def clean_client(server: Server, **options: Any) -> redis.Redis:
    """A client on the server's own port, past any proxy."""
    return redis.Redis(host=server.host, port=server.port, password=server.password, **options)


# --- 1. the fault proxy ------------------------------------------------------------------------

PROXY_SERVICE = "rw-faults"
PROXY_PREFIX = f"_drwlock_{PROXY_SERVICE}:"
PROXY_SHARED = 5  # workers on the shared key, the sync and the asyncio face in turn
PROXY_SOLO: tuple[FaceName, ...] = ("sync", "async")  # one each on a key of its own
PROXY_CYCLES = 700  # at least: rounds of 10 cycles per worker


class RWInspector(test_proxy.RedisInspector):
    """The service's read-write hashes, as ``test_proxy.Run`` reads storage.

    A permit is a live hold's field, named ``"<hash>#<field>"``; :meth:`delete`
    removes such fields. :meth:`untimed` is the base's (any key under the
    prefix without an expiry) and every hash whose expiry comes before one
    of its live fields'.
    """

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(client, PROXY_PREFIX, 1)

    def holders(self, key: str) -> dict[str, str]:
        return rwredis.read(self.client, rwredis.hash_name(self.prefix, key)).named()

    def permits(self) -> dict[str, str]:
        return rwredis.live(self.client, self.prefix)

    def untimed(self) -> list[str]:
        early = [
            found.name for found in rwredis.hashes(self.client, self.prefix) if found.untimed()
        ]
        return [*super().untimed(), *early]

    def intents(self) -> dict[str, str]:
        """Every live intent of a waiting writer, named as the permits are."""
        return rwredis.live(self.client, self.prefix, rwredis.INTENTS)

    def delete(self, names: list[str]) -> None:
        rwredis.drop(self.client, names)


def gauge(key: str, side: Side) -> str:
    return f"test:gauge:{key}:{side}"


class Gauges(Tracker):
    """Who holds each key, marked on the server by a clean client: the proxy case's oracle.

    Once its acquire returned, a holder marks itself in the hash
    ``test:gauge:<key>:<side>`` (its worker number: its lease's expiry, epoch
    ms) and reads both of the key's gauges in the same ``MULTI``; it removes
    its mark before it releases. Whoever marks itself second sees the other:
    a writer that sees any other live mark, or a reader that sees a writer's,
    is an overlap. A mark counts until its lease's expiry, as a
    :class:`Tracker`'s holder does (one handed out expired holds nothing).
    ``peak`` is the most holders one of them saw at once (readers share).
    """

    def __init__(self, client: redis.Redis, faces: dict[int, SideFace]) -> None:
        super().__init__(1)
        self.client = client  # decode_responses=True
        self.faces = faces  # each worker's, by its number
        self.found: list[str] = []

    def _side(self, who: int) -> Side:
        side = self.faces[who].held
        assert side is not None, f"worker {who} holds nothing"
        return side

    def enter(self, key: str, who: int, expired_at: datetime) -> None:
        side = self._side(who)
        expires = int(expired_at.timestamp() * 1000)
        with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(gauge(key, side), str(who), expires)
            pipe.hgetall(gauge(key, "write"))
            pipe.hgetall(gauge(key, "read"))
            _, writers, readers = pipe.execute()
        now = time.time() * 1000

        def others(marks: dict[str, str]) -> list[str]:
            return [w for w, until in marks.items() if w != str(who) and int(until) > now]

        live_writers, live_readers = others(writers), others(readers)
        with self._lock:
            self._holders.setdefault(key, {})[who] = expired_at
            if expires <= now:
                return
            self.peak = max(self.peak, 1 + len(live_writers) + len(live_readers))
            if live_writers or (side == "write" and live_readers):
                self.overlaps += 1
                self.found.append(
                    f"{side} {who} on {key} with writers {live_writers} readers {live_readers}"
                )

    def leave(self, key: str, who: int) -> None:
        self.client.hdel(gauge(key, self._side(who)), str(who))
        super().leave(key, who)


class RWRun(test_proxy.Run):
    """``test_proxy.Run`` over the read-write hashes, the gauges its tracker; and intents.

    An intent live at an idle point was left by nobody (every retrying
    writer has returned): counted once by its token, then deleted, as the
    base counts and deletes an orphaned hold.
    """

    def __init__(self, inspector: RWInspector, gauges: Gauges) -> None:
        # The base's kind sizes its Tracker, which the gauges replace.
        super().__init__("mutex", inspector, *test_proxy.REDIS_RUN)
        self.rw = inspector
        self.gauges = gauges
        self.tracker = gauges
        self.idle_intents: dict[str, str] = {}  # token -> field

    def idle_check(self) -> None:
        super().idle_check()
        found = self.rw.intents()
        with self._lock:
            for name, token in found.items():
                self.idle_intents.setdefault(token, name)
        self.rw.delete(list(found))

    def summary(self, label: str, proxies: list[FaultProxy], extra: str = "") -> str:
        extra = f"{extra} idle_intents={len(self.idle_intents)}"
        return super().summary(label, proxies, extra).replace(f" {self.kind}] ", " rwlock] ", 1)

    def check(self, proxies: list[FaultProxy]) -> None:
        super().check(proxies)
        assert not self.gauges.found, self.gauges.found[:5]
        assert not self.idle_intents, f"intents left by nobody: {sorted(self.idle_intents)}"


def test_readers_and_writers_through_a_faulty_network(rw_redis: Server) -> None:
    """Both faces' workers through the fault proxy, default client retries: every check's zero."""
    server = rw_redis
    clean = clean_client(server)
    faces: dict[int, SideFace] = {}
    run = RWRun(RWInspector(clean), Gauges(clean_client(server, decode_responses=True), faces))
    keys: list[tuple[FaceName, str]] = [
        ("sync" if index % 2 == 0 else "async", test_proxy.SHARED_KEY)
        for index in range(PROXY_SHARED)
    ]
    keys += [(face, f"own:{face}") for face in PROXY_SOLO]
    loop = LoopThread()
    clients: list[redis.Redis | redis.asyncio.Redis] = []
    try:
        with FaultProxy(
            (server.host, server.port), test_proxy.RATES, seed=test_proxy.SEED
        ) as proxy:
            workers = []
            for index, (face, key) in enumerate(keys):
                options = redis_options(proxy, server, test_proxy.REDIS_TIMEOUT)
                client = (
                    redis.Redis(**options) if face == "sync" else redis.asyncio.Redis(**options)
                )
                clients.append(client)
                rw = RWFace(
                    face,
                    client,
                    service_name=PROXY_SERVICE,
                    loop=loop if face == "async" else None,
                    default_ttl_seconds=test_proxy.REDIS_TTL,
                )
                lock = faces[index] = side_face(rw, f"{test_proxy.SEED}:rw:{index}")
                lock.wait(client.ping())  # connected before the faults start
                workers.append(test_proxy.Worker(run, index, lock, key))
            with test_proxy.sampling(run, test_proxy.REDIS_SAMPLE_EVERY), proxy.faults():
                test_proxy.drive(run, workers, PROXY_CYCLES, test_proxy.REDIS_ROUND)
            run.idle_check()  # faults off: nothing may be left
            writes = sum(
                1 for face in faces.values() for side in face.sides.values() if side == "write"
            )
            print(run.summary(f"{server.label} sync+async", [proxy], f" writes={writes}"))
            run.check([proxy])
            assert 0 < writes < run.tally.acquired
    finally:
        for client in clients:
            if isinstance(client, redis.asyncio.Redis):
                loop.run(client.aclose())
            else:
                client.close()
        loop.close()
        run.gauges.client.close()
        clean.close()


# --- 2. a holder paused past its TTL --------------------------------------------------------

# (the paused holder's side, the side of who takes the key after it)
PAUSED: tuple[tuple[Side, Side], ...] = (
    ("read", "write"),
    ("read", "read"),
    ("write", "read"),
    ("write", "write"),
)
PAUSE_FACES: tuple[FaceName, ...] = ("sync", "async")
START_TIMEOUT = 60.0  # spawning and importing on a busy 2-core machine
STEP_TIMEOUT = 20.0
POLL = 0.01
LOST = ("lost before the calls", "lost after them")


@dataclass(frozen=True)
class PauseCase:
    """What ``pausing.holder_client`` needs to know: the backend and the face."""

    backend: str
    face: FaceName


def pause_key(face: FaceName, held: Side, taker: Side) -> str:
    return f"{face}:{held}-then-{taker}"


def _paused_holder(
    case: PauseCase,
    url: str,
    db_name: str | None,
    service: str,
    reports: processes.ChildReports,
    go: multiprocessing.synchronize.Event,
) -> dict[str, dict[str, bool]]:
    """The child: hold every key of :data:`PAUSED`, report, wait; then the stale calls."""
    with pausing.holder_client(case, url) as (client, loop):
        rw = RWFace(case.face, client, service_name=service, loop=loop)
        holds: dict[str, Handle] = {}
        for held, taker in PAUSED:
            key = pause_key(case.face, held, taker)
            handle = rw.acquire(held, key, pausing.TTL)
            assert handle is not None, "the key should be free for the holder"
            holds[key] = handle
        reports.put(("acquired", {key: handle.token for key, handle in holds.items()}))
        assert go.wait(STEP_TIMEOUT), "the test never let the holder go on"
        # Continued: the holder acts as if no time had passed.
        face = SideFace(rw, lambda: "read")
        results: dict[str, dict[str, bool]] = {}
        for key, handle in holds.items():
            lost = handle.lost
            calls = pausing.stale_calls(face, key, handle)
            results[key] = {**calls, LOST[0]: lost, LOST[1]: handle.lost}
        return results


def test_holders_paused_past_their_ttl_cannot_touch_their_successors(rw_redis: Server) -> None:
    """SIGSTOPped past the TTL and continued, a stale reader's or writer's four calls return
    False, its ``lost`` is True, and the new hold's field and the hash's expiry stay."""
    server = rw_redis
    service = f"rw-pause-{uuid.uuid4().hex[:8]}"
    prefix = f"_drwlock_{service}:"
    started = time.monotonic()
    clean = clean_client(server)
    lock = DReadWriteLock(service, clean)  # the test's own, on its own client

    def record(key: str, field: str) -> tuple[str | None, int]:
        found = rwredis.read(clean, rwredis.hash_name(prefix, key))
        return found.fields.get(field), found.expire_at_ms

    try:
        with contextlib.ExitStack() as stack:
            children = {
                face: stack.enter_context(
                    pausing.spawned_holder(
                        _paused_holder, PauseCase("redis", face), server.url, None, service
                    )
                )
                for face in PAUSE_FACES
            }
            tokens: dict[str, str] = {}
            for child in children.values():
                acquired = child.report("acquired", START_TIMEOUT)
                assert isinstance(acquired, dict)
                tokens.update(acquired)
            for child in children.values():
                child.stop(STEP_TIMEOUT, poll=POLL)

            def expired() -> bool:
                return all(
                    token not in rwredis.read(clean, rwredis.hash_name(prefix, key)).live().values()
                    for key, token in tokens.items()
                )

            until(expired, "the paused holders' holds expired", STEP_TIMEOUT, poll=POLL)
            takers: dict[str, Any] = {}
            fields: dict[str, str] = {}
            for face in PAUSE_FACES:
                for held, taker in PAUSED:
                    key = pause_key(face, held, taker)
                    take = lock.acquire_write if taker == "write" else lock.acquire_read
                    hold = take(key, pausing.NEW_TTL)
                    assert hold is not None, f"{key}: the expired hold should be free to take over"
                    takers[key] = hold
                    fields[key] = f"{taker[0]}:{hold.token}"
            before = {key: record(key, field) for key, field in fields.items()}
            for child in children.values():
                child.go_on()
            results: dict[str, dict[str, bool]] = {}
            for child in children.values():
                finished = child.finish("results", STEP_TIMEOUT)
                assert isinstance(finished, dict)
                results.update(finished)
        after = {key: record(key, field) for key, field in fields.items()}

        problems: list[str] = []
        for key in fields:
            got = results[key]
            assert set(got) == {*pausing.CALLS, *LOST}, got
            problems += [f"{key}: {call} returned True" for call in pausing.CALLS if got[call]]
            problems += [f"{key}: {what} is False" for what in LOST if not got[what]]
            if after[key] != before[key] or before[key][0] is None:
                problems.append(
                    f"{key}: the new hold (value, PEXPIRETIME) {before[key]} -> {after[key]}"
                )
        calls = len(fields) * len(pausing.CALLS)
        false = sum(1 for got in results.values() for call in pausing.CALLS if got[call] is False)
        lost = sum(1 for got in results.values() if all(got[what] for what in LOST))
        unchanged = sum(1 for key in fields if after[key] == before[key])
        print(
            f"\n[rw-pause {server.label}] paused holds={len(fields)} ({len(PAUSE_FACES)} holders "
            f"x {len(PAUSED)}: reader/writer, taken by a reader/writer) stale calls={calls} "
            f"returned False={false} lost reported={lost} new holds unchanged={unchanged} "
            f"seconds={time.monotonic() - started:.1f}"
        )
        assert not problems, "; ".join(problems)
        assert all(hold.release() for hold in takers.values())
    finally:
        clean.close()


# --- 3. the server killed and restarted ----------------------------------------------------


@pytest.fixture
def durable_redis() -> Iterator[fault_servers.DurableRedis]:
    executable = fault_servers.redis_executable()
    if executable is None:
        pytest.skip("no runnable redis-server executable to kill and restart")
    if tuple(int(part) for part in executable.version.split(".")[:2]) < (7, 0):
        pytest.skip("reading a hash's expiry takes PEXPIRETIME, Redis 7.0 or later")
    with fault_servers.DurableRedis(executable) as server:
        server.start()
        yield server


class RWRestartRig(test_restart.RedisRig):
    """``test_restart``'s Redis rig on one read-write lock: each cycle a reader or a writer.

    Its workers' clients are the base's (spied, with or without retries);
    the monitor samples the lock's hash (the live holds' tokens; whether the
    hash lacks an expiry, or has one before a live field's). :attr:`faces`
    keeps every lock handed out, whose ``sides`` say which kind each hold was.
    """

    def __init__(self, server: fault_servers.DurableRedis) -> None:
        super().__init__(server, "mutex")  # the base's kind names slot keys, not used here
        self.prefix = f"_drwlock_{test_restart.SERVICE}:"
        self.name = rwredis.hash_name(self.prefix, test_restart.KEY)
        self.faces: list[SideFace] = []

    def lock(
        self, worker: test_restart.Worker, kind: test_restart.Kind, loop: LoopThread
    ) -> tuple[Face, test_restart.Closer]:
        sync = worker.face == "sync"
        options = self._options()
        if not worker.retries:
            retry = redis.retry.Retry if sync else redis.asyncio.retry.Retry
            options["retry"] = retry(redis.backoff.NoBackoff(), 0)
        client: test_restart.SpiedRedis | test_restart.AsyncSpiedRedis
        if sync:
            client = test_restart.SpiedRedis(**options)
            close: test_restart.Closer = client.close
        else:
            client = test_restart.AsyncSpiedRedis(**options)
            aclient = client
            close = lambda: loop.run(aclient.aclose())  # noqa: E731
        rw = RWFace(
            worker.face, client, service_name=test_restart.SERVICE, loop=None if sync else loop
        )
        face = side_face(rw, f"{test_restart.SEED}-rw-{worker.name}")
        self.faces.append(face)
        return face, close

    def sample(self) -> tuple[list[str], int]:
        found = rwredis.read(self.monitor, self.name)
        return list(found.live().values()), int(found.untimed())

    def left(self) -> dict[str, str]:
        return rwredis.read(self.monitor, self.name).named()

    def anything_left(self) -> bool:
        return any(True for _ in self.monitor.scan_iter(match=f"{self.prefix}*"))

    def sides(self) -> dict[str, Side]:
        return {token: side for face in self.faces for token, side in face.sides.items()}


def rw_overlaps(
    leases: list[test_restart.Leased], seen: dict[str, float], sides: dict[str, Side]
) -> list[str]:
    """Each pair of holds, one a writer's, held at once (as ``test_restart.overlaps`` cuts them)."""
    spans = sorted((x.start, x.end(seen), sides.get(x.token, "write"), x.worker) for x in leases)
    spans = [span for span in spans if span[1] > span[0]]  # handed out expired: never held
    found = []
    for index, (start, end, side, worker) in enumerate(spans):
        for later, _, other, by in spans[index + 1 :]:
            if later >= end:
                break
            if "write" in (side, other):
                found.append(f"{side} {worker} at {start:.3f} and {other} {by} at {later:.3f}")
    return found


def check_restart(run: test_restart.Run, rig: RWRestartRig, label: str) -> None:
    """``test_restart.check``'s assertions, a writer's hold the only one allowed alone."""
    assert not run.crashes, "a worker crashed:\n" + "\n".join(run.crashes)
    problems: list[str] = []
    kinds = sorted({t.__name__ for _, _, t, _ in run.errors})
    unclear = sorted({t.__name__ for _, _, t, _ in run.errors if not issubclass(t, rig.clear)})
    if unclear:
        problems.append(f"exceptions other than connection errors: {unclear}")
    phases = {phase: 0 for phase in ("before", "down", "after")}
    for _, _, _, when in run.errors:
        phases[run.phase(when)] += 1
    if phases["before"]:
        problems.append(f"{phases['before']} exceptions before the first kill")
    if not run.errors:
        problems.append("no worker saw the outage: the fault did not happen")
    timeouts = sum(t.timeouts for t in run.tallies.values())
    if timeouts:
        problems.append(f"acquire_with_retry returned None {timeouts} times")
    sides = rig.sides()
    found = rw_overlaps(run.leases, run.seen, sides)
    if found:
        problems.append(f"{len(found)} overlaps: {found[:3]}")
    _, peak = test_restart.overlaps(run.leases, run.seen, len(run.leases) + 1)
    short = {
        n: t.cycles_after
        for n, t in run.tallies.items()
        if min(t.cycles_after) < test_restart.AFTER_CYCLES
    }
    if short:
        problems.append(f"workers without cycles after a restart: {short}")

    handed = {x.token for x in run.leases}
    refused: set[str] = set()
    raised: set[str] = set()
    for call in run.calls:
        last = call.tokens[-1] if call.outcome == "raised" and call.tokens else None
        for token in call.tokens:
            if token == last:
                raised.add(token)
            elif token != call.lease:
                refused.add(token)
    orphans = {t for t in run.seen if t not in handed}
    wrong_none = sorted(orphans & refused)
    if wrong_none:
        problems.append(f"{len(wrong_none)} attempts took a hold and returned None")
    unknown = sorted(orphans - refused - raised)
    if unknown:
        problems.append(f"{len(unknown)} holds by tokens no worker sent")
    stale = sorted(t for t, at in run.released.items() if run.seen.get(t, 0) > at)
    if stale:
        problems.append(f"{len(stale)} tokens held the lock after their release returned")
    if not all(run.straddles):
        problems.append(f"holds kept across a restart were gone after it: {run.straddles}")
    if run.no_ttl:
        problems.append(f"{run.no_ttl} samples showed the hash without an expiry (or too early)")
    left = rig.left()
    raised_releases = {x.token for x in run.leases if x.ending in ("unsent", "maybe-done")}
    other = sorted(n for n, t in left.items() if t not in raised_releases and t not in raised)
    if other:
        problems.append(f"holds left that no raise explains: {other}")
    deadline = time.monotonic() + test_restart.TTL + 3
    while rig.anything_left() and time.monotonic() < deadline:
        time.sleep(0.05)
    if rig.anything_left():
        problems.append(f"records still there {test_restart.TTL + 3} s after the last hold")

    cycles = sum(t.cycles for t in run.tallies.values())
    writes = sum(1 for x in run.leases if sides.get(x.token) == "write")
    # How long after each restart the last worker got its first hold: a writer whose acquire
    # raised while the server was down may leave its intent, which keeps new readers out until
    # it lapses (readwrite rule 2: retry_delay + 2 s at most).
    resumed = [
        max(
            min((x.start for x in run.leases if x.worker == name and x.start >= up), default=up)
            - up
            for name in run.tallies
        )
        for _, up in run.windows
    ]
    raised_calls = sum(1 for c in run.calls if c.outcome == "raised")
    print(
        f"\n[rw-restart {label}] (dmutex {__version__}) {test_restart.ROUNDS} kills, "
        f"{cycles} cycles, {len(run.leases)} holds ({writes} writers'), "
        f"{len(run.calls)} acquire calls ({raised_calls} raised), "
        f"{len(run.errors)} exceptions {kinds} by phase {phases}, "
        f"{len(raised_releases)} releases raised, straddlers released {run.straddles}, "
        f"every worker held again within {[round(r, 2) for r in resumed]} s of each restart, "
        f"peak {peak}, overlaps {len(found)}, wrong None {len(wrong_none)}, "
        f"holds seen but never handed {len(orphans)}, stale after release {len(stale)}, "
        f"left at the end {len(left)} (unexplained {len(other)}), "
        f"samples {run.samples} ({run.monitor_errors} failed)"
    )
    assert not problems, f"{label}: " + "; ".join(problems)


def test_redis_killed_and_restarted_under_readers_and_writers(
    durable_redis: fault_servers.DurableRedis,
) -> None:
    """SIGKILLed twice under readers and writers: clear errors, work resumes, no overlap."""
    rig = RWRestartRig(durable_redis)
    try:
        rig.monitor.flushdb()
        # test_restart.drive's kind sizes a count its own check uses; check_restart does not.
        run = test_restart.drive(rig, "mutex", random.Random(f"{test_restart.SEED}-rw"))
        check_restart(run, rig, f"redis-{durable_redis.executable.version}")
    finally:
        rig.close()


# --- 4. asyncio cancellation ------------------------------------------------------------------

CANCEL_SERVICE = "svc"
CANCEL_PREFIX = f"_drwlock_{CANCEL_SERVICE}:"
CANCEL_SEED = test_cancellation.SEED + 28
PROBE_TTL = 5.0
MEMORY = test_cancellation.plan("memory", batches=40, cancel_after=0.005)
REDIS = test_cancellation.plan("redis", batches=80, cancel_after=0.015)
REDIS_LEAST = 640  # trials; then the Redis run stops once every phase of both stages was hit


def admitting(probe: AsyncDReadWriteLock) -> Callable[[str], Awaitable[bool]]:
    """Storage's ``admits``: whether a new reader of a key gets in at once (then it leaves)."""

    async def admits(key: str) -> bool:
        hold = await probe.acquire_read(key, PROBE_TTL)
        if hold is None:
            return False
        assert await hold.release()
        return True

    return admits


def rw_faces(lock: AsyncDReadWriteLock) -> dict[str, cancellation.Face]:
    return {"read": ReadWriteSide(lock, write=False), "write": ReadWriteSide(lock, write=True)}


def test_cancellation_on_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """InMemoryBackend: cancellations in bodies and retry waits leave no hold and no intent."""
    note_retry_waits(monkeypatch)
    rng = random.Random(CANCEL_SEED)
    backend = InMemoryBackend(clock=NotingClock())
    lock = AsyncDReadWriteLock(CANCEL_SERVICE, backend)
    sync = DReadWriteLock(CANCEL_SERVICE, backend)

    def intents() -> dict[str, str]:
        # The backend shows holds (snapshot()), not intents: its states, read under its lock.
        now = now_ms(backend.clock)
        with backend._lock:
            states = backend._rw.get(CANCEL_PREFIX, {})
            return {
                f"{CANCEL_PREFIX}intent:{token}:{key}": token
                for key, state in states.items()
                for token, until in state.intents.items()
                if until > now
            }

    def clear() -> None:
        for name, token in intents().items():
            sync.release(name.rpartition(":")[2], token)  # withdraws the intent
        for key in MEMORY.keys:
            backend.force_expire(key)

    storage = Storage(
        permits=lambda: {name: token for name, (token, _) in backend.snapshot().items()},
        clear=clear,
        intents=intents,
        admits=admitting(AsyncDReadWriteLock(CANCEL_SERVICE, backend)),
    )
    tally = asyncio.run(run_trials(MEMORY, rw_faces(lock), storage, rng))
    summary = judge(tally)
    assert tally.landed["retry wait"] > 0, summary


def test_cancellation_on_redis(rw_redis: Server) -> None:
    """Redis behind the delaying client: cancellations in every phase of a request leave no
    hold and no intent, and none is swallowed."""
    rng = random.Random(CANCEL_SEED)
    owners = test_cancellation.Owners()
    inspector = clean_client(rw_redis)

    def clear() -> None:
        names = list(inspector.scan_iter(match=f"{CANCEL_PREFIX}*"))
        if names:
            inspector.delete(*names)

    def enough(tally: Tally) -> bool:
        ran = sum(tally.trials.values())
        phases = test_cancellation.STAGE_PHASES
        return ran >= REDIS_LEAST and all(tally.landed[where] for where in phases)

    async def main() -> tuple[Tally, DelayingRedis]:
        # No socket_timeout: see cancellation/test_cancellation.py's docstring.
        inner = redis.asyncio.Redis.from_url(rw_redis.url, socket_timeout=None)
        client = DelayingRedis(
            inner,
            rng,
            test_cancellation.MAX_DELAY,
            on_send=owners.sent,
            on_phase=test_cancellation.in_request,
        )
        lock = AsyncDReadWriteLock(CANCEL_SERVICE, client, clock=NotingClock())
        storage = Storage(
            permits=lambda: rwredis.live(inspector, CANCEL_PREFIX),
            clear=clear,
            owner=owners.of,
            intents=lambda: rwredis.live(inspector, CANCEL_PREFIX, rwredis.INTENTS),
            admits=admitting(AsyncDReadWriteLock(CANCEL_SERVICE, client)),
        )
        try:
            return await run_trials(REDIS, rw_faces(lock), storage, rng, enough), client
        finally:
            await inner.aclose()

    try:
        tally, client = asyncio.run(main())
    finally:
        inspector.close()
    tally.sent = client.sent
    summary = judge(tally)
    for where in test_cancellation.STAGE_PHASES:
        assert tally.landed[where] > 0, summary


POSTGRES_LEAST = 640  # trials; then the run stops once every phase of both stages was hit
POSTGRES = test_cancellation.plan("postgresql", batches=80, cancel_after=0.015, spread=(1, 2, 4))


def postgres_rows(
    inspector: psycopg.Connection[tuple[Any, ...]], table: str, field: str
) -> dict[str, str]:
    """The live holds (``field`` "r" and "w") or intents ("i") of ``table``'s rows, by name."""
    found: dict[str, str] = {}
    rows = inspector.execute(
        sql.SQL(
            'SELECT "key", "value", floor(extract(epoch FROM statement_timestamp()) * 1000)'
            "::bigint FROM {}"
        ).format(sql.Identifier(table))
    ).fetchall()
    for name, value, now in rows:
        state = json.loads(value)
        if field == "w":
            held = {} if state["w"] is None else {state["w"][0]: state["w"][1]}
        else:
            held = state[field]
        found |= {f"{name}:{field}:{t}": t for t, until in held.items() if until > now}
    return found


def test_cancellation_on_postgresql(
    postgres_server: str, postgres_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL behind the delaying asyncpg pool: cancellations in every phase of a
    statement (the read's and the write's) leave no hold and no intent, and none is swallowed."""
    note_retry_waits(monkeypatch)
    rng = random.Random(CANCEL_SEED)
    owners = test_cancellation.Owners()
    service = f"rwcancel_{uuid.uuid4().hex[:8]}"
    table = f"_drwlock_{service}"
    url = f"{postgres_server}{'&' if '?' in postgres_server else '?'}options=" + quote(
        f"-csearch_path={postgres_schema}"
    )
    inspector = psycopg.connect(url, autocommit=True)

    def clear() -> None:
        inspector.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(table)))

    def enough(tally: Tally) -> bool:
        ran = sum(tally.trials.values())
        phases = test_cancellation.STAGE_PHASES
        return ran >= POSTGRES_LEAST and all(tally.landed[where] for where in phases)

    phases = Phases(
        rng, test_cancellation.MAX_DELAY, on_send=owners.sent, on_phase=test_cancellation.in_request
    )

    async def main() -> Tally:
        client, close = await test_cancellation.postgres_client("asyncpg pool", url, phases)
        lock = AsyncDReadWriteLock(
            service, client, schema_name=postgres_schema, clock=NotingClock()
        )
        probe = AsyncDReadWriteLock(service, client, schema_name=postgres_schema)
        try:
            await lock.ready()
            storage = Storage(
                permits=lambda: (
                    postgres_rows(inspector, table, "r") | postgres_rows(inspector, table, "w")
                ),
                clear=clear,
                owner=owners.of,
                intents=lambda: postgres_rows(inspector, table, "i"),
                admits=admitting(probe),
            )
            return await run_trials(POSTGRES, rw_faces(lock), storage, rng, enough)
        finally:
            await close()

    try:
        tally = asyncio.run(main())
    finally:
        inspector.close()
    summary = judge(tally)
    for where in test_cancellation.STAGE_PHASES:
        assert tally.landed[where] > 0, summary

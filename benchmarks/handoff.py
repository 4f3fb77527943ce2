"""How fast a released Redis lock reaches a waiter, and what waiting costs the server.

Run from the repository root (a report, not a test; about 3 minutes on 2 cores,
``--quick``: about 50 seconds)::

    .venv/bin/python benchmarks/handoff.py
    .venv/bin/python benchmarks/handoff.py --quick
    .venv/bin/python benchmarks/handoff.py --server /path/to/redis-server --json out.json

Without ``--url`` it starts ``redis-server`` (``/usr/bin/redis-server``, or
``--server``) on a free 127.0.0.1 port with persistence off, and stops it by
pid at the end. With ``--url`` it works under its own random names, and the
server's command counts then include other clients' commands.

Every lock has a TTL of 30 s, so no lease expires during a run. The variants:
``dmutex`` (``DMutex.acquire_with_retry(key, timeout=30)``, default
``retry_delay``), ``dmutex-async`` (``AsyncDMutex``, the same in asyncio),
``python-redis-lock`` (``redis_lock.Lock(conn, name, expire=30)``,
``acquire(blocking=True)``: ``BLPOP`` on a signal list), ``redis-py`` (redis-py's
``client.lock(name, timeout=30).acquire(blocking=True)``: sleeps 0.1 s between
attempts) and ``dmutex-polling``: dmutex on a client built with
``max_connections=1``, on which dmutex never blocks a connection and so
waits by jittered sleeping (``U(0.5, 1) x retry_delay``), the reference for
what waking gains. Each process has its own clients; processes start by
``multiprocessing`` spawn.

1. Hand-off: two processes ping-pong one key. Each turn, one process takes
   the lock (blocking), notes ``time.perf_counter()`` (``CLOCK_MONOTONIC``:
   one clock for all processes on Linux), tells its peer over a pipe, holds
   15 ms (and at least 5 ms after the peer began its acquire), checks with
   ``INFO clients`` that the peer is blocked (``BLPOP`` variants; the others
   make the same ``INFO`` call), notes the time and releases; it tries again
   only after the peer reports that it holds the lock, so every hand-off goes
   to a waiter whose attempt failed. A hand-off is the time from the holder's
   call to release to the waiter holding the lock. Also: the release's own
   duration with that waiter blocked, and for ``dmutex`` with nobody waiting
   (the same turns in one process).
1b. The same ping-pong for ``dmutex``, ``dmutex-async`` and
   ``python-redis-lock`` with every request of the lock's client timestamped
   (a wrapper on ``execute_command``) and, on a server the benchmark started,
   every command in ``SLOWLOG`` (threshold 0, settings restored after): each
   step of a hand-off, and the server's time per kind of request.
2. Contended throughput: 4 processes x 500 cycles of acquire (blocking, as
   in 1) / ``GET`` counter / ``SET`` counter + 1 / release on one key; wall
   time from the start barrier to the last finish, the final counter, how
   many acquires took the lock over from another process, how long acquires
   took, and ``INFO commandstats`` calls per cycle.
3. Waiting cost: one process holds a key while 8 waiter processes wait for
   it; over 5 s, ``INFO commandstats`` calls (which count each command a
   script runs as well) and ``INFO cpu`` per waiter per second; over the
   next 5 s, the requests the waiters sent, read from ``MONITOR``.
4. The uncontended cycle: ``benchmarks/redis_cycle.py --rounds 5`` (its
   dmutex / raw ratio), and ``AsyncDMutex`` acquire + release against the same
   two requests made raw with ``redis.asyncio`` (``SET NX PX`` + ``EVALSHA``
   compare-and-delete), on one connection, in interleaved turns of 100.

Targets (issue 12): dmutex hand-off median <= 0.8 ms and p99 <= 3 ms, dmutex's
median below python-redis-lock's in the same run, and dmutex's contended wall
time <= 0.9 x redis-py Lock's; each printed as PASS or MISS for ``dmutex``
and ``dmutex-async``. The exit code is 0 either way (non-zero only when the
benchmark itself could not run).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import redis
import redis.asyncio
import redis_lock
from redis_cycle import (
    RAW_RELEASE,
    BenchmarkError,
    Figures,
    Target,
    machine,
    measure,
    run,
    shown,
    throughput_target,
)

from dmutex import AsyncDMutex, DMutex
from dmutex._backends.redis.scripts import ACQUIRE, RELEASE

DEFAULT_SERVER = "/usr/bin/redis-server"  # Redis 7.0 here; PATH in the venv finds 6.2
LOCK_TTL_S = 30  # every lease and lock: none expires during a run
WAIT_S = 30.0  # the blocking acquires' timeout
HOLD_S = 0.015  # how long a ping-pong turn holds the lock
MIN_HEAD_S = 0.005  # and at least this long after the waiter began its acquire
BLOCKED_WAIT_S = 2.0  # the longest a holder waits to see its peer blocked
SLOWLOG_LEN = 20_000  # entries kept while the traced hand-offs run
SETTLE_S = 1.0  # waiters' time to get past their first attempt before counting
STEP_TIMEOUT_S = 120.0  # the longest the parent waits for a worker's answer
CYCLE_TURN = 100

DMUTEX, DMUTEX_ASYNC, PRL = "dmutex", "dmutex-async", "python-redis-lock"
REDIS_PY, POLLING = "redis-py", "dmutex-polling"
WOKEN = (DMUTEX, DMUTEX_ASYNC, PRL)  # the variants whose waiters BLPOP: interleaved
CONTENDED_KINDS = (DMUTEX, DMUTEX_ASYNC, REDIS_PY, PRL)
CONTENDED_COMMANDS = ("evalsha", "blpop", "set", "get")
BLPOP_KINDS = frozenset(WOKEN)
WAKES_BY = {
    DMUTEX: "BLPOP",
    DMUTEX_ASYNC: "BLPOP",
    PRL: "BLPOP",
    REDIS_PY: "sleep 0.1 s",
    POLLING: "sleep U(.5,1)x0.1 s",
}

Release = Callable[[], Awaitable[None]]
Request = tuple[str, float, float]  # command, perf_counter before the call and after its reply


def traced(execute: Callable[..., Any], log: list[Request]) -> Callable[..., Any]:
    """``execute`` (a sync ``execute_command``), noting each request in ``log``."""
    clock = time.perf_counter

    def run(*args: Any, **options: Any) -> Any:
        start = clock()
        try:
            return execute(*args, **options)
        finally:
            log.append((str(args[0]), start, clock()))

    return run


def traced_async(
    execute: Callable[..., Awaitable[Any]], log: list[Request]
) -> Callable[..., Awaitable[Any]]:
    """``traced`` for ``redis.asyncio``'s ``execute_command``."""
    clock = time.perf_counter

    async def run(*args: Any, **options: Any) -> Any:
        start = clock()
        try:
            return await execute(*args, **options)
        finally:
            log.append((str(args[0]), start, clock()))

    return run


# --- one library's lock, driven from a coroutine --------------------------------------


@dataclass(frozen=True)
class Spec:
    """Which library locks what: everything a spawned worker needs (picklable)."""

    kind: str
    url: str
    service: str  # dmutex's service name; the other libraries' lock name
    key: str = "k"
    retry_delay: float | None = None  # dmutex only; None: its default
    trace: bool = False  # timestamp every request of the lock's client

    @property
    def counter(self) -> str:
        return f"_handoff_counter_{self.service}"


class Locker:
    """One library's blocking acquire on ``spec.key``, and a counter beside the lock.

    The sync libraries are called from the coroutine as they are: nothing
    else runs in that event loop, so blocking it costs nothing.
    """

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.probe = redis.Redis.from_url(spec.url)  # the holder's INFO calls only
        self.log: list[Request] = []  # the lock client's requests, with spec.trace

    async def connect(self) -> None:
        raise NotImplementedError

    async def acquire(self) -> Release:
        """Block until the lock is ours; return its release."""
        raise NotImplementedError

    async def increment(self) -> None:
        """``GET`` the counter, ``SET`` it one higher."""
        raise NotImplementedError

    async def close(self) -> None:
        self.probe.close()

    def blocked(self) -> int:
        """How many clients the server has blocked (``BLPOP``) right now."""
        return int(self.probe.info("clients")["blocked_clients"])


class SyncLocker(Locker):
    """dmutex's ``DMutex``, redis-py's ``Lock`` or python-redis-lock, on a sync client."""

    def __init__(self, spec: Spec) -> None:
        super().__init__(spec)
        options: dict[str, Any] = {}
        if spec.kind == POLLING:  # one connection at most: dmutex never blocks it, and polls
            options["max_connections"] = 1
        elif spec.kind == PRL:  # its BLPOP lasts `expire` s, past redis-py's 5 s socket timeout
            options["socket_timeout"] = None
        self.client = redis.Redis.from_url(spec.url, **options)
        if spec.trace:  # an instance attribute, in place before dmutex binds the method
            vars(self.client)["execute_command"] = traced(self.client.execute_command, self.log)
        self.mutex = DMutex(spec.service, self.client, default_ttl_seconds=LOCK_TTL_S)
        self.name = f"{spec.service}:{spec.key}"

    async def connect(self) -> None:
        self.client.ping()

    async def acquire(self) -> Release:
        done = self._take()

        async def release() -> None:
            done()

        return release

    def _take(self) -> Callable[[], object]:
        kind = self.spec.kind
        if kind == REDIS_PY:
            lock = self.client.lock(self.name, timeout=LOCK_TTL_S)  # sleep: 0.1 s, its default
            if not lock.acquire(blocking=True):
                raise BenchmarkError("redis-py Lock: blocking acquire returned False")
            unlock: Callable[[], None] = lock.release  # raises LockNotOwnedError if not ours
            return unlock
        if kind == PRL:
            plock = redis_lock.Lock(self.client, self.name, expire=LOCK_TTL_S)
            if not plock.acquire(blocking=True):
                raise BenchmarkError("python-redis-lock: blocking acquire returned False")
            return plock.release  # raises NotAcquired if it was not ours
        delay = self.spec.retry_delay
        if delay is None:
            held = self.mutex.acquire_with_retry(self.spec.key, timeout=WAIT_S)
        else:
            held = self.mutex.acquire_with_retry(self.spec.key, timeout=WAIT_S, retry_delay=delay)
        if held is None:
            raise BenchmarkError(f"{kind}: acquire_with_retry timed out")

        def release() -> None:
            if not held.release():
                raise BenchmarkError(f"{kind}: release found the lease gone")

        return release

    async def increment(self) -> None:
        value = self.client.get(self.spec.counter)
        self.client.set(self.spec.counter, int(value or 0) + 1)

    async def close(self) -> None:
        self.client.close()
        await super().close()


class AsyncLocker(Locker):
    """dmutex's ``AsyncDMutex`` on ``redis.asyncio``."""

    def __init__(self, spec: Spec) -> None:
        super().__init__(spec)
        self.client = redis.asyncio.Redis.from_url(spec.url)
        if spec.trace:
            execute = traced_async(self.client.execute_command, self.log)
            vars(self.client)["execute_command"] = execute
        self.mutex = AsyncDMutex(spec.service, self.client, default_ttl_seconds=LOCK_TTL_S)

    async def connect(self) -> None:
        await self.client.ping()

    async def acquire(self) -> Release:
        delay, key = self.spec.retry_delay, self.spec.key
        if delay is None:
            held = await self.mutex.acquire_with_retry(key, timeout=WAIT_S)
        else:
            held = await self.mutex.acquire_with_retry(key, timeout=WAIT_S, retry_delay=delay)
        if held is None:
            raise BenchmarkError("dmutex-async: acquire_with_retry timed out")

        async def release() -> None:
            if not await held.release():
                raise BenchmarkError("dmutex-async: release found the lease gone")

        return release

    async def increment(self) -> None:
        value = await self.client.get(self.spec.counter)
        await self.client.set(self.spec.counter, int(value or 0) + 1)

    async def close(self) -> None:
        await self.client.aclose()
        await super().close()


def locker(spec: Spec) -> Locker:
    return AsyncLocker(spec) if spec.kind == DMUTEX_ASYNC else SyncLocker(spec)


# --- running workers in processes -----------------------------------------------------


def report(results: Any, work: Callable[[], object]) -> None:
    """Run ``work`` in a worker; put ``("ok", value)`` or ``("error", text)`` on ``results``."""
    try:
        results.put(("ok", work()))
    except BaseException as error:  # noqa: BLE001 - the parent reports it
        results.put(("error", f"{type(error).__name__}: {error}"))


@contextmanager
def workers(
    target: Callable[..., None], arglists: Sequence[tuple[object, ...]], results: Any
) -> Iterator[Callable[[], list[Any]]]:
    """Start one spawned process per argument tuple; yield a function that collects answers.

    Each process puts one answer on ``results``. On the way out every process
    is joined, and one that does not end is terminated (by its own handle).
    """
    ctx = multiprocessing.get_context("spawn")
    processes: list[BaseProcess] = [
        ctx.Process(target=target, args=(*args, results), daemon=True) for args in arglists
    ]
    for process in processes:
        process.start()

    def collect() -> list[Any]:
        answers = []
        for _ in processes:
            try:
                status, value = results.get(timeout=STEP_TIMEOUT_S)
            except queue.Empty:
                raise BenchmarkError("a worker did not answer in time") from None
            if status != "ok":
                raise BenchmarkError(f"a worker failed: {value}")
            answers.append(value)
        return answers

    try:
        yield collect
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)


def receive(peer: Connection) -> object:
    if not peer.poll(STEP_TIMEOUT_S):
        raise BenchmarkError("the peer process stopped answering")
    return peer.recv()


def expect(peer: Connection, tag: str, index: int) -> float:
    """Receive the peer's ``(tag, index, time)``; return its time."""
    message = receive(peer)
    if not (isinstance(message, tuple) and message[:2] == (tag, index)):
        raise BenchmarkError(f"ping-pong out of order: {message!r}, not ({tag!r}, {index})")
    at: float = message[2]
    return at


# --- 1. hand-off ----------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    """One holding of the ping-ponged lock, in ``perf_counter`` seconds."""

    index: int
    called: float  # just before the blocking acquire was called
    acquired: float  # just after it returned
    releasing: float  # just before the release was called
    released: float  # just after it returned
    probes: int  # INFO calls until the waiter was seen blocked; 0: not seen
    acquiring: tuple[Request, ...] = ()  # with spec.trace: the acquire's requests
    releasing_requests: tuple[Request, ...] = ()  # and the release's
    variant: int = 0  # its index in the schedule's specs


@dataclass(frozen=True)
class Schedule:
    """Which variant each ping-pong turn uses: ``chunk`` turns of each, in rotation.

    Interleaving the variants of one ping-pong puts them under the same load
    from elsewhere on the machine, as ``redis_cycle.py`` does.
    """

    specs: tuple[Spec, ...]
    chunk: int

    def which(self, index: int) -> int:
        return (index // self.chunk) % len(self.specs)


async def pingpong(schedule: Schedule, turns: range, peer: Connection | None) -> list[Turn]:
    """Hold the lock on each of ``turns`` (every other one, or all when ``peer`` is None)."""
    lockers = [locker(spec) for spec in schedule.specs]
    clock = time.perf_counter
    last = turns.stop - 1
    records = []
    try:
        for held in lockers:
            await held.connect()
        if peer is not None:
            peer.send("ready")
            receive(peer)
        for index in turns:
            variant = schedule.which(index)
            held = lockers[variant]
            # The next turn waits for this lock (not another variant's, free).
            waited = peer is not None and index < last and schedule.which(index + 1) == variant
            if peer is not None and index > 0:
                expect(peer, "got", index - 1)
                peer.send(("trying", index, clock()))
            mark = len(held.log)
            called = clock()
            release = await held.acquire()
            acquired = clock()
            acquiring = tuple(held.log[mark:])
            if peer is not None and index < last:
                peer.send(("got", index, acquired))
            await asyncio.sleep(HOLD_S)
            if peer is not None and index < last:
                since = expect(peer, "trying", index + 1)
                # The waiter has been trying for MIN_HEAD_S: its first attempt failed.
                if waited and (left := since + MIN_HEAD_S - clock()) > 0:
                    await asyncio.sleep(left)
            if waited and held.spec.kind in BLPOP_KINDS:
                probes = see_blocked(held)
            else:  # the same INFO call, so that every release follows one
                held.blocked()
                probes = 1
            mark = len(held.log)
            releasing = clock()
            await release()
            released = clock()
            done = tuple(held.log[mark:])
            records.append(
                Turn(index, called, acquired, releasing, released, probes, acquiring, done, variant)
            )
    finally:
        for held in lockers:
            await held.close()
    return records


def see_blocked(held: Locker) -> int:
    """``INFO clients`` until the server has a blocked client; the calls made, 0 if never."""
    deadline = time.monotonic() + BLOCKED_WAIT_S
    probes = 0
    while time.monotonic() < deadline:
        probes += 1
        if held.blocked() >= 1:
            return probes
        time.sleep(0.001)
    return 0


def pingpong_worker(
    schedule: Schedule, first: int, total: int, peer: Connection | None, results: Any
) -> None:
    step = 1 if peer is None else 2
    report(results, lambda: asyncio.run(pingpong(schedule, range(first, total, step), peer)))


@dataclass
class HandOffs:
    """The hand-offs of one variant (and its releases with a waiter blocked)."""

    kind: str
    latency: Figures  # ns: holder's release call to waiter holding
    release: Figures  # ns: the holder's release call, a waiter blocked
    head_start_ms: float  # least time a waiter had been acquiring when the release began
    unseen: int  # hand-offs whose waiter the holder never saw blocked (BLPOP variants)
    overlaps: int  # waiter holding before the holder began releasing: must be 0
    pairs: list[tuple[Turn, Turn]]  # (holder's turn, waiter's turn) of each hand-off
    server_us: dict[str, float]  # server µs per call of each command (INFO commandstats)
    requests_us: dict[str, Figures]  # with slowlog: server time of each kind of request

    def steps(self) -> tuple[dict[str, Figures], int]:
        """With ``spec.trace``: each step of the hand-offs (ns), and how many had no BLPOP.

        A step runs from one timestamp to the next: the holder's release
        call, its request, the waiter's BLPOP reply, its next (successful)
        acquire request and reply, the acquire returning.
        """
        names = (
            "release() call -> its request sent",
            "release request -> waiter's BLPOP reply",
            "BLPOP reply -> acquire request sent",
            "acquire request -> its reply",
            "acquire reply -> acquire returns",
            "total (the hand-off)",
            "holder's release request -> its reply",
        )
        steps: dict[str, Figures] = {name: Figures() for name in names}
        skipped = 0
        for a, b in self.pairs:
            blpops = [r for r in b.acquiring if r[0].upper() == "BLPOP"]
            if not blpops or not a.releasing_requests:
                skipped += 1
                continue
            rel, blpop, grab = a.releasing_requests[0], blpops[-1], b.acquiring[-1]
            stamps = (a.releasing, rel[1], blpop[2], grab[1], grab[2], b.acquired)
            spans = [*(y - x for x, y in itertools.pairwise(stamps)), stamps[-1] - stamps[0]]
            for name, span in zip(names, [*spans, rel[2] - rel[1]], strict=True):
                steps[name].samples.append(round(span * 1e9))
        return steps, skipped


def run_turns(
    url: str, arglists: list[tuple[object, ...]], *, slowlog: bool
) -> tuple[list[list[Turn]], dict[str, float], list[Mapping[str, Any]]]:
    """Run ping-pong workers; their turns, server µs per call of each command, SLOWLOG.

    ``slowlog``: log every command meanwhile (``SLOWLOG``, threshold 0), for
    the server's time per request; the server's settings are put back after.
    """
    ctx = multiprocessing.get_context("spawn")
    with redis.Redis.from_url(url) as client:
        settings: dict[str, str] = client.config_get("slowlog-*") if slowlog else {}
        if slowlog:
            client.config_set("slowlog-max-len", SLOWLOG_LEN)
            client.config_set("slowlog-log-slower-than", 0)
            client.slowlog_reset()
        before = command_stats(client)
        try:
            with workers(pingpong_worker, arglists, ctx.Queue()) as collect:
                parts = collect()
            after = command_stats(client)
            logged = client.slowlog_get(SLOWLOG_LEN) if slowlog else []
        finally:
            for name, value in settings.items():
                client.config_set(name, value)
    server_us = {}
    for name, (calls, usec) in after.items():
        was_calls, was_usec = before.get(name, (0, 0))
        if calls > was_calls and name not in ("info", "ping", "client", "hello"):
            server_us[name] = (usec - was_usec) / (calls - was_calls)
    return parts, server_us, logged


def handoffs(
    specs: Sequence[Spec], count: int, warmup: int, *, chunk: int = 20, slowlog: bool = False
) -> list[HandOffs]:
    """``count`` measured hand-offs of each of ``specs`` between two processes.

    One variant: after ``warmup`` more. Several: interleaved in turns of
    ``chunk`` (see :class:`Schedule`), after a first round of each; the
    hand-off between two variants' turns is not one, and is left out.
    """
    schedule = Schedule(tuple(specs), chunk)
    n = len(specs)
    if n == 1:
        first, total = warmup, warmup + count + 1
    else:
        first = n * chunk
        total = first + math.ceil(count / (chunk - 1)) * n * chunk + 1
    ends = multiprocessing.get_context("spawn").Pipe()
    arglists: list[tuple[object, ...]] = [(schedule, i, total, ends[i]) for i in (0, 1)]
    parts, server_us, logged = run_turns(specs[0].url, arglists, slowlog=slowlog)
    turns = sorted((turn for part in parts for turn in part), key=lambda turn: turn.index)
    if [turn.index for turn in turns] != list(range(total)):
        raise BenchmarkError("ping-pong lost a turn")
    results = []
    for variant, spec in enumerate(specs):
        pairs = [
            (a, b)
            for a, b in itertools.pairwise(turns[first:])
            if a.variant == b.variant == variant
        ][:count]
        ns = 1e9
        results.append(
            HandOffs(
                kind=spec.kind,
                latency=Figures([round((b.acquired - a.releasing) * ns) for a, b in pairs]),
                release=Figures([round((a.released - a.releasing) * ns) for a, _ in pairs]),
                head_start_ms=min(a.releasing - b.called for a, b in pairs) * 1000,
                unseen=sum(1 for a, _ in pairs if a.probes == 0) if spec.kind in BLPOP_KINDS else 0,
                overlaps=sum(1 for a, b in pairs if b.acquired < a.releasing),
                pairs=pairs,
                # The server's figures are the whole run's, the variants' together.
                server_us=server_us,
                requests_us=request_times(logged, spec.service),
            )
        )
    return results


ACQUIRE_TRIES = {"0": "acquire, first attempt (fails)", "1": "acquire, after waking (takes)"}
PRL_RELEASE = hashlib.sha1(redis_lock.UNLOCK_SCRIPT).hexdigest()


def request_times(logged: Sequence[Mapping[str, Any]], service: str) -> dict[str, Figures]:
    """Server µs (SLOWLOG) of each kind of hand-off request, as ``Figures`` of ns.

    dmutex's acquire script: the first attempt (ARGV "registered" 0: it
    fails, as the lock is held) and the attempt after the wake-up (1);
    its release script. python-redis-lock: a lock's first ``SET NX``
    (fails), its second (takes: the same token), its release script. Only
    requests naming a key of ``service``.
    """
    mine = service.encode()
    kinds: dict[str, Figures] = {}
    tokens: set[bytes] = set()
    for entry in reversed(logged):  # SLOWLOG lists the newest first
        if bytes(entry.get("client_address") or b"?").startswith(b"?"):
            continue  # a command a script ran ("?:0"): its time is the script's
        if mine not in bytes(entry["command"]):
            continue
        words: list[bytes] = bytes(entry["command"]).split(b" ")
        name, kind = words[0].upper(), None
        if name == b"EVALSHA" and len(words) > 1:
            sha = words[1].decode()
            if sha == ACQUIRE.sha and words[-1] in (b"0", b"1"):
                kind = ACQUIRE_TRIES[words[-1].decode()]
            elif sha in (RELEASE.sha, PRL_RELEASE):
                kind = "release"
        elif name == b"SET" and b"NX" in (w.upper() for w in words) and len(words) > 2:
            kind = "SET NX, second (takes)" if words[2] in tokens else "SET NX, first (fails)"
            tokens.add(words[2])
        if kind is not None:
            kinds.setdefault(kind, Figures()).samples.append(int(entry["duration"]) * 1000)
    return kinds


def solo_releases(
    spec: Spec, count: int, warmup: int, *, slowlog: bool = False
) -> tuple[Figures, dict[str, Figures]]:
    """``count`` releases with nobody waiting (one process, the ping-pong's turn alone).

    Also, with ``slowlog``, the server's time of each kind of request.
    """
    schedule = Schedule((spec,), warmup + count)
    arglists: list[tuple[object, ...]] = [(schedule, 0, warmup + count, None)]
    (turns,), _, logged = run_turns(spec.url, arglists, slowlog=slowlog)
    released = [round((t.released - t.releasing) * 1e9) for t in turns[warmup:]]
    return Figures(released), request_times(logged, spec.service)


# --- 2. contended throughput ----------------------------------------------------------


async def contend(
    spec: Spec, cycles: int, barrier: Any
) -> tuple[float, float, list[float], list[float]]:
    """Run ``cycles`` cycles after the barrier.

    Returns the start, the end, when each acquire returned and how long it took.
    """
    held = locker(spec)
    clock = time.perf_counter
    acquired, waited = [0.0] * cycles, [0.0] * cycles
    try:
        await held.connect()
        barrier.wait(STEP_TIMEOUT_S)
        start = clock()
        for i in range(cycles):
            called = clock()
            release = await held.acquire()
            acquired[i] = clock()
            waited[i] = acquired[i] - called
            await held.increment()
            await release()
        return start, clock(), acquired, waited
    finally:
        await held.close()


def contended_worker(spec: Spec, cycles: int, barrier: Any, results: Any) -> None:
    report(results, lambda: asyncio.run(contend(spec, cycles, barrier)))


@dataclass(frozen=True)
class Contended:
    kind: str
    wall_s: float
    counter: int
    expected: int
    commands: dict[str, int]  # INFO commandstats calls over the run (script calls included)
    switches: int  # acquires that took the lock from another process (hand-offs)
    waits: Figures  # ns: each acquire's duration

    def per_cycle(self, name: str) -> float:
        return self.commands.get(name, 0) / self.expected


def contended(spec: Spec, processes: int, cycles: int) -> Contended:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(processes)
    arglists = [(spec, cycles, barrier)] * processes
    with redis.Redis.from_url(spec.url) as client:
        before = command_calls(client)
        with workers(contended_worker, arglists, ctx.Queue()) as collect:
            spans = collect()
        after = command_calls(client)
        counter = int(client.get(spec.counter) or 0)
    wall = max(span[1] for span in spans) - min(span[0] for span in spans)
    commands = {name: calls - before.get(name, 0) for name, calls in after.items()}
    stamps = sorted((t, who) for who, span in enumerate(spans) for t in span[2])
    owners = [who for _, who in stamps]
    switches = sum(1 for a, b in itertools.pairwise(owners) if a != b)
    waits = Figures([round(w * 1e9) for span in spans for w in span[3]])
    return Contended(spec.kind, wall, counter, processes * cycles, commands, switches, waits)


# --- 3. what waiting costs the server -------------------------------------------------


async def wait_once(spec: Spec, ready: Any) -> float:
    held = locker(spec)
    try:
        await held.connect()
        ready.put(os.getpid())
        release = await held.acquire()
        acquired = time.perf_counter()
        await release()
        return acquired
    finally:
        await held.close()


def waiting_worker(spec: Spec, ready: Any, results: Any) -> None:
    report(results, lambda: asyncio.run(wait_once(spec, ready)))


def command_stats(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """``INFO commandstats``: (calls, µs of server time) per command (lower case)."""
    stats: Mapping[str, Mapping[str, object]] = client.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): (int(str(stat["calls"])), int(str(stat["usec"])))
        for name, stat in stats.items()
        if name.startswith("cmdstat_")
    }


def command_calls(client: redis.Redis) -> dict[str, int]:
    """``INFO commandstats`` calls per command (lower case)."""
    return {name: calls for name, (calls, _) in command_stats(client).items()}


class RequestCounter:
    """The requests clients send between two markers, read from ``MONITOR`` by a thread.

    ``MONITOR`` shows each request once when the server runs it (a ``BLPOP``
    when it is sent, not when it returns), and marks what a script ran with
    ``lua``: those are counted apart, as they are not requests.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.marker = f"handoff-window-{uuid.uuid4().hex}"
        self.requests: dict[str, int] = {}
        self.in_scripts: dict[str, int] = {}
        self.seconds = 0.0
        self._listening = threading.Event()
        self._thread = threading.Thread(target=self._read, name="handoff-monitor", daemon=True)

    def _read(self) -> None:
        with (
            redis.Redis.from_url(self.url, socket_timeout=None) as client,
            client.monitor() as monitor,
        ):
            self._listening.set()
            opened: float | None = None
            while True:
                seen: dict[str, Any] = monitor.next_command()
                words = str(seen["command"]).split(" ")
                name = words[0].lower()
                if name == "echo" and words[-1] == self.marker:
                    if opened is not None:
                        self.seconds = float(seen["time"]) - opened
                        return
                    opened = float(seen["time"])
                elif opened is not None and name not in ("info", "echo"):
                    counts = self.in_scripts if seen["client_type"] == "lua" else self.requests
                    counts[name] = counts.get(name, 0) + 1

    def __enter__(self) -> RequestCounter:
        self._thread.start()
        if not self._listening.wait(STEP_TIMEOUT_S):
            raise BenchmarkError("MONITOR did not start")
        return self

    def mark(self, client: redis.Redis) -> None:
        """Open the window, or close it (the second time)."""
        client.echo(self.marker)

    def __exit__(self, *exc: object) -> None:
        self._thread.join(timeout=STEP_TIMEOUT_S)


@dataclass(frozen=True)
class Waiting:
    label: str
    waiters: int
    seconds: float  # the first window
    commands: dict[str, int]  # INFO commandstats calls in it (script calls included)
    cpu_s: float  # the server's CPU time in it (INFO cpu)
    monitored_s: float  # the second window, between the markers' server times
    requests: dict[str, int]  # MONITOR: what the waiters sent in it

    @property
    def cpu_ms_per_waiter_s(self) -> float:
        return self.cpu_s * 1000 / (self.waiters * self.seconds)

    @property
    def requests_per_waiter_s(self) -> float:
        return sum(self.requests.values()) / (self.waiters * self.monitored_s)

    @property
    def commands_per_waiter_s(self) -> float:
        return sum(self.commands.values()) / (self.waiters * self.seconds)

    def breakdown(self) -> str:
        ordered = sorted(self.requests.items(), key=lambda item: -item[1])
        return ", ".join(f"{name.upper()} {calls}" for name, calls in ordered if calls) or "none"


async def hold(spec: Spec, label: str, waiters: int, seconds: float) -> Waiting:
    """Hold ``spec``'s lock for ``seconds`` while ``waiters`` processes wait for it."""
    holder = locker(spec)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    try:
        await holder.connect()
        release = await holder.acquire()
        with workers(waiting_worker, [(spec, ready)] * waiters, ctx.Queue()) as collect:
            try:
                for _ in range(waiters):
                    ready.get(timeout=STEP_TIMEOUT_S)
                time.sleep(SETTLE_S)
                before, cpu = command_calls(holder.probe), server_cpu(holder.probe)
                start = time.perf_counter()
                time.sleep(seconds)
                cpu, after = server_cpu(holder.probe) - cpu, command_calls(holder.probe)
                counted = time.perf_counter() - start
                # Then as long again under MONITOR, which costs the server CPU itself.
                with RequestCounter(spec.url) as counter:
                    counter.mark(holder.probe)
                    time.sleep(seconds)
                    counter.mark(holder.probe)
            finally:
                await release()
            acquired = collect()
    finally:
        await holder.close()
    if len(acquired) != waiters:
        raise BenchmarkError("a waiter did not get the lock after the release")
    delta = {name: calls - before.get(name, 0) for name, calls in after.items()}
    for own in ("info", "echo", "monitor"):  # the holder's probes: all it sent
        delta.pop(own, None)
    commands = {name: calls for name, calls in delta.items() if calls}
    return Waiting(label, waiters, counted, commands, cpu, counter.seconds, counter.requests)


def server_cpu(client: redis.Redis) -> float:
    """The server's CPU seconds so far (``INFO cpu``: user + system, all threads)."""
    cpu: Mapping[str, object] = client.info("cpu")
    return float(str(cpu["used_cpu_user"])) + float(str(cpu["used_cpu_sys"]))


# --- 4. the uncontended cycle ---------------------------------------------------------


def redis_cycle(url: str, args: argparse.Namespace) -> tuple[str, dict[str, Any] | None]:
    """Run ``benchmarks/redis_cycle.py`` once; its output, and its figures (None on failure)."""
    script = Path(__file__).with_name("redis_cycle.py")
    with tempfile.TemporaryDirectory(prefix="dmutex-handoff-") as workdir:
        out = Path(workdir) / "cycle.json"
        command = [sys.executable, str(script), "--json", str(out)]
        command += ["--url", url] if args.url else ["--server", args.server]
        command += ["--rounds", str(args.cycle_rounds)]
        command += ["--cycles", "500", "--warmup", "100"] if args.quick else []
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        figures = json.loads(out.read_text()) if done.returncode == 0 and out.exists() else None
    text = done.stdout if done.returncode == 0 else done.stdout + done.stderr
    return text, figures


def async_cycle(url: str, rounds: int, cycles: int, warmup: int) -> dict[str, Figures]:
    """``AsyncDMutex`` acquire + release against raw ``SET NX PX`` + ``EVALSHA``, one connection.

    The batches run on one event loop, each by ``run_until_complete``
    outside the timed regions, so that ``redis_cycle.measure`` interleaves them.
    """
    loop = asyncio.new_event_loop()
    client = redis.asyncio.Redis.from_url(url, single_connection_client=True)
    run_id = uuid.uuid4().hex[:8]
    mutex = AsyncDMutex(f"cycle-{run_id}", client, default_ttl_seconds=LOCK_TTL_S)
    key, ttl_ms = f"_raw_handoff-{run_id}:permit:0:k", LOCK_TTL_S * 1000
    clock = time.perf_counter_ns

    async def dmutex_batch(n: int) -> list[int]:
        samples = [0] * n
        for i in range(n):
            start = clock()
            lock = await mutex.acquire("k")
            if lock is None or not await lock.release():
                raise BenchmarkError("AsyncDMutex: uncontended acquire/release failed")
            samples[i] = clock() - start
        return samples

    async def raw_batch(n: int, sha: str) -> list[int]:
        samples = [0] * n
        execute: Callable[..., Awaitable[object]] = client.execute_command
        for i in range(n):
            start = clock()
            token = str(uuid.uuid4())
            taken = await execute("SET", key, token, "PX", ttl_ms, "NX")
            if not taken or await execute("EVALSHA", sha, 1, key, token) != 1:
                raise BenchmarkError("raw: uncontended SET NX / compare-and-delete failed")
            samples[i] = clock() - start
        return samples

    try:
        sha = str(loop.run_until_complete(client.script_load(RAW_RELEASE)))
        return measure(
            {
                "AsyncDMutex": lambda n: loop.run_until_complete(dmutex_batch(n)),
                "raw async": lambda n: loop.run_until_complete(raw_batch(n, sha)),
            },
            cycles=cycles,
            rounds=rounds,
            warmup=warmup,
            chunk=CYCLE_TURN,
        )
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()


# --- the run --------------------------------------------------------------------------


def latency_ms(figures: Figures) -> dict[str, float]:
    return {
        "median": figures.percentile_us(0.5) / 1000,
        "p99": figures.percentile_us(0.99) / 1000,
        "mean": figures.mean_us / 1000,
        "max": max(figures.samples) / 1e6,
    }


def print_handoffs(results: list[HandOffs], solo: Figures, count: int) -> None:
    print()
    print(f"1. Hand-off, {count} per variant (holder's release call -> waiter holding), ms;")
    print("   release: the holder's release() with the waiter blocked, µs")
    head = f"{'variant':<18} {'waits by':<20} {'median':>7} {'p99':>7} {'mean':>7} {'max':>7}"
    print(f"{head} {'release p50':>11}  unseen overlaps head-start")
    for r in results:
        lat = r.latency
        print(
            f"{r.kind:<18} {WAKES_BY[r.kind]:<20} {lat.percentile_us(0.5) / 1000:7.3f} "
            f"{lat.percentile_us(0.99) / 1000:7.3f} {lat.mean_us / 1000:7.3f} "
            f"{max(lat.samples) / 1e6:7.3f} {r.release.percentile_us(0.5):11.1f}  "
            f"{r.unseen:6d} {r.overlaps:8d} {r.head_start_ms:7.1f} ms"
        )
    dm = next(r for r in results if r.kind == DMUTEX)
    with_waiter, alone = dm.release.percentile_us(0.5), solo.percentile_us(0.5)
    print(
        f"dmutex release() p50: {alone:.1f} µs with nobody waiting, {with_waiter:.1f} µs with "
        f"one waiter blocked ({with_waiter - alone:+.1f} µs; p99 {solo.percentile_us(0.99):.1f} "
        f"/ {dm.release.percentile_us(0.99):.1f})"
    )


def print_steps(traced: list[HandOffs], alone: Figures | None) -> dict[str, dict[str, float]]:
    """The traced hand-offs' steps, median µs (p99 beside the total); returned for the JSON."""
    table = {r.kind: r.steps() for r in traced}
    print()
    print("1b. Where a hand-off's time goes: the same ping-pong again, every request")
    print("    timestamped in the client (a wrapper on execute_command); median µs")
    print(f"{'step':<42}" + "".join(f" {kind:>17}" for kind in table))
    names = list(next(iter(table.values()))[0])
    out: dict[str, dict[str, float]] = {kind: {} for kind in table}
    for name in names:
        cells = []
        for kind, (steps, _) in table.items():
            median = steps[name].percentile_us(0.5) if steps[name].samples else math.nan
            out[kind][name] = median
            cells.append(f" {median:17.1f}")
        print(f"{name:<42}" + "".join(cells))
    totals = []
    for kind, (steps, _) in table.items():
        total = steps["total (the hand-off)"]
        p99 = total.percentile_us(0.99) if total.samples else math.nan
        out[kind]["total p99"] = p99
        totals.append(f" {p99:17.1f}")
    print(f"{'total, p99':<42}" + "".join(totals))
    skipped = {kind: n for kind, (_, n) in table.items() if n}
    if skipped:
        print(f"    hand-offs without a BLPOP (left out): {skipped}")
    print("    server time per request (SLOWLOG at threshold 0 during the traced run), µs:")
    for r in traced:
        cells = [
            f"{name} p50 {fig.percentile_us(0.5):.0f} / p99 {fig.percentile_us(0.99):.0f}"
            for name, fig in sorted(r.requests_us.items())
        ]
        print(f"      {r.kind}: " + "; ".join(cells))
        out[r.kind] |= {
            f"server {name}": fig.percentile_us(0.5) for name, fig in r.requests_us.items()
        }
    if alone is not None:
        print(
            f"      dmutex release with nobody waiting (one process): p50 "
            f"{alone.percentile_us(0.5):.0f} / p99 {alone.percentile_us(0.99):.0f}"
        )
        out[DMUTEX]["server release, nobody waiting"] = alone.percentile_us(0.5)
    print("    and per call of each command over the traced run, the three variants together")
    print("    (INFO commandstats; a script's includes the commands it ran), µs:")
    calls = sorted(traced[0].server_us.items())
    line = "     "
    for name, us in calls:
        cell = f" {name.upper()} {us:.1f}"
        if len(line) + len(cell) > 96:
            print(line)
            line = "     "
        line += cell
    print(line)
    return out


def handoff_targets(results: list[HandOffs], contention: list[Contended]) -> list[Target]:
    by = {r.kind: r for r in results}
    walls = {c.kind: c.wall_s for c in contention}
    prl = by[PRL].latency.percentile_us(0.5) / 1000
    targets = []
    for kind in (DMUTEX, DMUTEX_ASYNC):
        lat = by[kind].latency
        median = lat.percentile_us(0.5) / 1000
        targets += [
            Target(f"{kind} hand-off median, ms", median, 0.8, at_least=False),
            Target(f"{kind} hand-off p99, ms", lat.percentile_us(0.99) / 1000, 3.0, at_least=False),
            Target(
                f"{kind} / python-redis-lock median",
                median / prl,
                1.0,
                at_least=False,
                note=f"{median:.3f} ms against {prl:.3f} ms (target: below it)",
            ),
            Target(
                f"{kind} / redis-py Lock wall time",
                walls[kind] / walls[REDIS_PY],
                0.9,
                at_least=False,
            ),
        ]
    return targets


def bench(url: str, args: argparse.Namespace) -> dict[str, object]:
    run_id = uuid.uuid4().hex[:8]
    quick: bool = args.quick
    count: int = args.handoffs
    warm = 3 if quick else 10
    cycles: int = args.cycles
    window: float = args.window
    waiters: int = args.waiters
    with redis.Redis.from_url(url) as client:
        about = machine(client)
    print(
        f"Redis {about['redis_server']} at {shown(url)}; Python {about['python']}, "
        f"redis-py {about['redis_py']} ({about['redis_py_parser']} parser), "
        f"python-redis-lock {redis_lock.__version__}, {about['cpus']} CPUs, load average "
        f"{os.getloadavg()[0]:.2f}" + (" (--quick)" if quick else ""),
        flush=True,
    )

    def spec(kind: str, part: str, retry_delay: float | None = None) -> Spec:
        return Spec(kind, url, f"handoff-{part}-{kind}-{run_id}", retry_delay=retry_delay)

    print(f"  hand-off: {', '.join(WOKEN)}, interleaved", file=sys.stderr, flush=True)
    results = handoffs([spec(kind, "pp") for kind in WOKEN], count, warm)
    for kind in (REDIS_PY, POLLING):
        print(f"  hand-off: {kind}", file=sys.stderr, flush=True)
        results += handoffs([spec(kind, "pp")], count, warm)
    solo, _ = solo_releases(spec(DMUTEX, "solo"), count, warm)
    print_handoffs(results, solo, count)
    print("  traced hand-offs", file=sys.stderr, flush=True)
    traced_specs = [replace(spec(kind, "tr"), trace=True) for kind in WOKEN]
    traced = handoffs(traced_specs, count, warm, slowlog=not args.url)
    alone = solo_releases(spec(DMUTEX, "trs"), count, warm, slowlog=not args.url)[1]
    steps = print_steps(traced, alone.get("release"))

    contention = []
    for kind in CONTENDED_KINDS:
        print(f"  contended: {kind}", file=sys.stderr, flush=True)
        contention.append(contended(spec(kind, "ct"), args.processes, cycles))
    print()
    print(f"2. Contended: {args.processes} processes x {cycles} cycles (acquire/GET/SET/release)")
    print("   per cycle: INFO commandstats calls / cycles (SET and GET include the counter's")
    print("   and those run by scripts)")
    print("   hand-offs: acquires that took the lock over from another process; acquire:")
    print("   how long one acquire took (ms, p50 / p99 / max)")
    head = f"{'variant':<18} {'wall s':>7} {'cycles/s':>9} {'counter':>8} {'hand-offs':>9}"
    head += "".join(f" {name.upper():>7}" for name in CONTENDED_COMMANDS)
    print(f"{head}  acquire p50 / p99 / max")
    for c in contention:
        ok = "" if c.counter == c.expected else f"  WRONG: expected {c.expected}"
        cells = "".join(f" {c.per_cycle(name):7.2f}" for name in CONTENDED_COMMANDS)
        line = f"{c.kind:<18} {c.wall_s:7.3f} {c.expected / c.wall_s:9.0f} {c.counter:8d}"
        took = c.waits
        spread = (
            f"{took.percentile_us(0.5) / 1000:.2f} / {took.percentile_us(0.99) / 1000:.1f} / "
            f"{max(took.samples) / 1e6:.1f}"
        )
        print(f"{line} {c.switches:9d}{cells}  {spread}{ok}")

    waiting_runs = [
        (spec(DMUTEX, "w1", 0.1), "dmutex, waking, retry_delay 0.1"),
        (spec(DMUTEX, "w2", 1.0), "dmutex, waking, retry_delay 1.0"),
        (spec(POLLING, "w3", 0.1), "dmutex-polling, retry_delay 0.1"),
        (spec(REDIS_PY, "w4"), "redis-py Lock, sleep 0.1"),
        (spec(PRL, "w5"), "python-redis-lock"),
    ]
    waiting = []
    for wspec, label in waiting_runs:
        print(f"  waiting: {label}", file=sys.stderr, flush=True)
        waiting.append(asyncio.run(hold(wspec, label, waiters, window)))
    print()
    print(f"3. Waiting: {waiters} waiter processes on a key held for {window:g} s")
    print("   per waiter per second: commands (INFO commandstats, which also counts each")
    print("   command a script runs) and server CPU ms (INFO cpu) in one window; requests")
    print("   (MONITOR: what the waiters sent, scripts' commands left out) in the next")
    print(f"{'variant':<34} {'requests':>9} {'commands':>9} {'CPU ms':>7}  requests in the window")
    for w in waiting:
        print(
            f"{w.label:<34} {w.requests_per_waiter_s:9.2f} {w.commands_per_waiter_s:9.2f} "
            f"{w.cpu_ms_per_waiter_s:7.3f}  {w.breakdown()}"
        )

    print()
    print("4. Uncontended cycle: benchmarks/redis_cycle.py", flush=True)
    cycle_text, cycle = redis_cycle(url, args)
    print("   " + cycle_text.rstrip().replace("\n", "\n   "))
    rounds: int = args.cycle_rounds
    n = 500 if quick else 2000
    afig = async_cycle(url, rounds, n, 100 if quick else 500)
    ratio = throughput_target("AsyncDMutex / raw async", afig["AsyncDMutex"], afig["raw async"], 0)
    print()
    print(f"   AsyncDMutex vs raw redis.asyncio, one connection, {rounds} x {n} cycles:")
    print(f"   {'variant':<12} {'ops/s':>8} {'p50 µs':>8} {'p99 µs':>8} {'mean µs':>8}")
    for name, fig in afig.items():
        print(
            f"   {name:<12} {fig.ops_per_s:8.0f} {fig.percentile_us(0.5):8.1f} "
            f"{fig.percentile_us(0.99):8.1f} {fig.mean_us:8.1f}"
        )
    print(f"   ratio AsyncDMutex / raw async (ops/s, median of rounds): {ratio.value:.3f}")
    print(f"        {ratio.note}")

    targets = handoff_targets(results, contention)
    print()
    print(f"Load average at the end: {os.getloadavg()[0]:.2f} (1 min)")
    print("Targets:")
    for target in targets:
        print(target.line())
    wrong = [c.kind for c in contention if c.counter != c.expected]
    if wrong:
        print(f"  WRONG counter (a lost update: mutual exclusion failed): {', '.join(wrong)}")

    cycle_ratio = None
    if cycle is not None:
        cycle_ratio = cycle["targets"]["DMutex / raw (ops/s)"]["value"]
    return {
        "machine": about | {"python_redis_lock": redis_lock.__version__},
        "config": {
            "handoffs": count,
            "warmup_handoffs": warm,
            "hold_s": HOLD_S,
            "processes": args.processes,
            "cycles": cycles,
            "waiters": waiters,
            "window_s": window,
            "quick": quick,
            "url": shown(url) if args.url else "private redis-server",
        },
        "handoff": {
            r.kind: {
                "latency_ms": latency_ms(r.latency),
                "release_p50_us": r.release.percentile_us(0.5),
                "release_p99_us": r.release.percentile_us(0.99),
                "head_start_ms": r.head_start_ms,
                "unseen": r.unseen,
                "overlaps": r.overlaps,
            }
            for r in results
        },
        "traced_steps_median_us": steps,
        "release_alone_us": {"p50": solo.percentile_us(0.5), "p99": solo.percentile_us(0.99)},
        "contended": [
            {
                "variant": c.kind,
                "wall_s": c.wall_s,
                "counter": c.counter,
                "expected": c.expected,
                "hand_offs": c.switches,
                "commands": c.commands,
                "acquire_ms": latency_ms(c.waits),
            }
            for c in contention
        ],
        "waiting": [
            {
                "variant": w.label,
                "seconds": w.seconds,
                "monitored_s": w.monitored_s,
                "requests_per_waiter_s": w.requests_per_waiter_s,
                "commands_per_waiter_s": w.commands_per_waiter_s,
                "server_cpu_ms_per_waiter_s": w.cpu_ms_per_waiter_s,
                "requests": w.requests,
                "commands": w.commands,
            }
            for w in waiting
        ],
        "cycle": {
            "redis_cycle_dmutex_over_raw": cycle_ratio,
            "async": {name: fig.summary() for name, fig in afig.items()},
            "async_dmutex_over_raw": ratio.value,
        },
        "targets": {
            t.name: {"value": t.value, "bound": t.bound, "passed": t.passed} for t in targets
        },
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--url", help="use this Redis server instead of starting one")
    parser.add_argument(
        "--server", default=DEFAULT_SERVER, help=f"redis-server to start (default {DEFAULT_SERVER})"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 20 hand-offs, 100 cycles, a 1.5 s window, 1 round of part 4",
    )
    parser.add_argument("--handoffs", type=int, help="measured hand-offs per variant (200)")
    parser.add_argument("--processes", type=int, default=4, help="contending processes")
    parser.add_argument("--cycles", type=int, help="cycles per contending process (500)")
    parser.add_argument("--waiters", type=int, default=8, help="waiter processes in part 3")
    parser.add_argument("--window", type=float, help="seconds counted in part 3 (5)")
    parser.add_argument("--cycle-rounds", type=int, help="rounds of part 4's cycles (5)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    quick = {"handoffs": 20, "cycles": 100, "window": 1.5, "cycle_rounds": 1}
    full = {"handoffs": 200, "cycles": 500, "window": 5.0, "cycle_rounds": 5}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    counts = (args.handoffs, args.processes, args.cycles, args.waiters, args.cycle_rounds)
    if min(counts) < 1 or not args.window > 0:
        parser.error("counts must be >= 1 and --window > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    return run(bench, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

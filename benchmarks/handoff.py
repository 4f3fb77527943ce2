"""How fast a released Redis lock reaches a waiter, and what waiting costs the server.

Run from the repository root (a report, not a test; about 3 minutes a server
on 2 cores, ``--quick``: about 50 seconds)::

    .venv/bin/python benchmarks/handoff.py
    .venv/bin/python benchmarks/handoff.py --quick
    .venv/bin/python benchmarks/handoff.py --redis 7.0 --json out.json

With ``--url`` it works under its own random names (its keys deleted at the
end), leaves ``SLOWLOG`` alone, and the server's command counts then include
other clients' commands.

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
   call to release to the waiter holding the lock. The three ``BLPOP``
   variants take turns of 20 hand-offs (each turn a round of the ratio
   table). Also: the release's own duration with that waiter blocked, and
   for ``dmutex`` with nobody waiting (the same turns in one process).
1b. The same ping-pong for the ``BLPOP`` variants with every request of the
   lock's client timestamped (``harness.trace_requests``) and, on a server
   the benchmark started, every command in ``SLOWLOG`` (threshold 0,
   settings restored after): each step of a hand-off, and the server's time
   per kind of request. A dmutex waiter on a redis-py client sends its
   ``BLPOP`` and its next attempt as one pipeline (traced as one request):
   its ``BLPOP`` reply is its grant, so the two steps between them show "-".
2. Contended throughput: 4 processes x 500 cycles of acquire (blocking, as
   in 1) / ``GET`` counter / ``SET`` counter + 1 / release on one key, the
   cycles split into ``--contended-rounds`` rounds in which the variants take
   turns; wall time from the start barrier to the last finish, the final
   counter, the most processes holding at once (from each acquire's return
   to its release call, on the one clock), how many acquires took the lock
   over from another process, the longest streak of one process's acquires,
   how long acquires took (and each process's longest), and ``INFO
   commandstats`` calls per cycle.
3. Waiting cost: one process holds a key while 8 waiter processes wait for
   it; over 5 s, ``INFO commandstats`` calls (which count each command a
   script runs as well) and ``INFO cpu`` per waiter per second; over the
   next 5 s, the requests the waiters sent, read from ``MONITOR``.
4. The uncontended cycle: ``redis_cycle.py``'s measurement, in process
   (``--cycle-rounds`` rounds), ``AsyncDMutex`` against raw ``redis.asyncio``
   among its contenders.

Options: ``--handoffs`` per variant (parts 1 and 1b), ``--processes`` and
``--cycles`` (per process) and ``--contended-rounds`` (part 2), ``--waiters``
and ``--window`` (s, part 3), ``--cycle-rounds`` (part 4); and the harness's
``--url``, ``--redis VERSION...``, ``--quick``, ``--json FILE``.

Targets (issue 12): dmutex hand-off median <= 0.8 ms and p99 <= 3 ms, dmutex's
median below python-redis-lock's in the same run, and dmutex's contended wall
time <= 0.9 x redis-py Lock's; for ``dmutex`` and ``dmutex-async``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import math
import multiprocessing
import os
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import harness
import redis
import redis.asyncio
import redis_cycle
import redis_lock
from harness import BenchmarkError, Figures, Request, Target

from dmutex import AsyncDMutex, DMutex, DSemaphore

LOCK_TTL_S = 30  # every lease and lock: none expires during a run
WAIT_S = 30.0  # the blocking acquires' timeout
HOLD_S = 0.015  # how long a ping-pong turn holds the lock
MIN_HEAD_S = 0.005  # and at least this long after the waiter began its acquire
BLOCKED_WAIT_S = 2.0  # the longest a holder waits to see its peer blocked
SLOWLOG_LEN = 20_000  # entries kept while the traced hand-offs run
SETTLE_S = 1.0  # waiters' time to get past their first attempt before counting
CHUNK = 20  # hand-offs per turn when variants are interleaved
OPTIONS = {  # name: (default, under --quick)
    "handoffs": (200, 20), "processes": (4, 4), "cycles": (500, 100), "contended_rounds": (2, 1),
    "waiters": (8, 8), "window": (5.0, 1.5), "cycle_rounds": (5, 1),
}  # fmt: skip

DMUTEX, DMUTEX_ASYNC, PRL = "dmutex", "dmutex-async", "python-redis-lock"
REDIS_PY, POLLING = "redis-py", "dmutex-polling"
SEMAPHORE = "dsemaphore"  # a DSemaphore of Spec.permits permits (redis_peers.py)
WOKEN = (DMUTEX, DMUTEX_ASYNC, PRL)  # the variants whose waiters BLPOP: interleaved
BLPOP_WAITERS = (*WOKEN, SEMAPHORE)  # every variant whose waiters BLPOP
CONTENDED_KINDS = (DMUTEX, DMUTEX_ASYNC, REDIS_PY, PRL)
CONTENDED_COMMANDS = ("evalsha", "blpop", "set", "get")
WAKES_BY = {
    DMUTEX: "BLPOP",
    DMUTEX_ASYNC: "BLPOP",
    PRL: "BLPOP",
    REDIS_PY: "sleep 0.1 s",
    POLLING: "sleep U(.5,1)x0.1 s",
    SEMAPHORE: "BLPOP",
}

Release = Callable[[], Awaitable[None]]


# --- one library's lock, driven from a coroutine --------------------------------------


@dataclass(frozen=True)
class Spec:
    """Which library locks what: everything a spawned worker needs (picklable)."""

    kind: str
    url: str
    service: str  # dmutex's service name; the other libraries' lock name
    key: str = "k"
    retry_delay: float = 0.1  # dmutex only; 0.1 is its default
    trace: bool = False  # timestamp every request of the lock's client
    permits: int = 3  # SEMAPHORE only: its max_permits

    @property
    def counter(self) -> str:
        return f"_handoff_counter_{self.service}"


class Locker:
    """One library's blocking acquire on ``spec.key``, and a counter beside the lock.

    The sync libraries are called from the coroutine as they are: nothing
    else runs in that event loop, so blocking it costs nothing.
    """

    def __init__(self, spec: Spec) -> None:
        self.spec, self.name = spec, f"{spec.service}:{spec.key}"
        self.probe = redis.Redis.from_url(spec.url)  # the holder's INFO calls only
        options: dict[str, Any] = {}
        if spec.kind == POLLING:  # one connection at most: dmutex never blocks it, and polls
            options["max_connections"] = 1
        elif spec.kind == PRL:  # its BLPOP lasts `expire` s, past redis-py's 5 s socket timeout
            options["socket_timeout"] = None
        self.client = redis.Redis.from_url(spec.url, **options)
        self.aclient = redis.asyncio.Redis.from_url(spec.url)
        traced = self.aclient if spec.kind == DMUTEX_ASYNC else self.client
        self.log = harness.trace_requests(traced) if spec.trace else []  # before dmutex binds it
        self.mutex: DMutex | DSemaphore
        if spec.kind == DMUTEX_ASYNC:
            self.amutex = AsyncDMutex(spec.service, self.aclient, default_ttl_seconds=LOCK_TTL_S)
        elif spec.kind == SEMAPHORE:
            self.mutex = DSemaphore(
                spec.service, self.client, max_permits=spec.permits, default_ttl_seconds=LOCK_TTL_S
            )
        else:
            self.mutex = DMutex(spec.service, self.client, default_ttl_seconds=LOCK_TTL_S)

    async def acquire(self) -> Release:
        """Block until the lock is ours; return its release."""
        kind, key = self.spec.kind, self.spec.key
        delay = self.spec.retry_delay
        if kind == DMUTEX_ASYNC:
            held = await self.amutex.acquire_with_retry(key, timeout=WAIT_S, retry_delay=delay)
            if held is None:
                raise BenchmarkError(f"{kind}: acquire_with_retry timed out")
            return lambda: checked(kind, held.release())
        unlock: Callable[[], object]
        if kind == REDIS_PY:
            lock = self.client.lock(self.name, timeout=LOCK_TTL_S)  # sleep: 0.1 s, its default
            taken, unlock = lock.acquire(blocking=True), lock.release  # raises if not ours
        elif kind == PRL:
            plock = redis_lock.Lock(self.client, self.name, expire=LOCK_TTL_S)
            taken, unlock = plock.acquire(blocking=True), plock.release  # raises if not ours
        else:
            lease = self.mutex.acquire_with_retry(key, timeout=WAIT_S, retry_delay=delay)
            taken, unlock = lease is not None, lease.release if lease else bool
        if not taken:
            raise BenchmarkError(f"{kind}: the blocking acquire failed")
        return lambda: checked(kind, unlock())

    async def connect(self) -> None:
        """Open the lock's connection before any clock starts."""
        if self.spec.kind == DMUTEX_ASYNC:
            await self.aclient.ping()
        else:
            self.client.ping()

    async def increment(self) -> None:
        """``GET`` the counter, ``SET`` it one higher."""
        if self.spec.kind == DMUTEX_ASYNC:
            value = await self.aclient.get(self.spec.counter)
            await self.aclient.set(self.spec.counter, int(value or 0) + 1)
        else:
            value = self.client.get(self.spec.counter)
            self.client.set(self.spec.counter, int(value or 0) + 1)

    async def close(self) -> None:
        for client in (self.client, self.probe):
            client.close()
        await self.aclient.aclose()

    def blocked(self) -> int:
        """How many clients the server has blocked (``BLPOP``) right now."""
        return int(self.probe.info("clients")["blocked_clients"])


async def checked(kind: str, released: object) -> None:
    """Fail unless a release said the lease was ours (the others raise instead)."""
    if isinstance(released, Awaitable):
        released = await released
    if released is False:
        raise BenchmarkError(f"{kind}: release found the lease gone")


def receive(peer: Connection) -> object:
    if not peer.poll(harness.WORKER_TIMEOUT_S):
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
    lockers = [Locker(spec) for spec in schedule.specs]
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
            if waited and held.spec.kind in BLPOP_WAITERS:
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
    harness.answer(
        results, lambda: asyncio.run(pingpong(schedule, range(first, total, step), peer))
    )


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
        acquire request and reply, the acquire returning. A dmutex waiter
        that sent its next attempt with its BLPOP (one pipeline) has no
        steps between its BLPOP reply and the grant: the reply is the grant.
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
        steps: dict[str, list[int]] = {name: [] for name in names}
        skipped = 0
        for a, b in self.pairs:
            blpops = [r for r in b.acquiring if str(r[0][0]).upper() == "BLPOP"]
            piped = bool(b.acquiring) and b.acquiring[-1][0][:2] == ("PIPELINE", "BLPOP")
            if not (blpops or piped) or not a.releasing_requests:
                skipped += 1
                continue
            rel, grab = a.releasing_requests[0], b.acquiring[-1]
            stamps: tuple[float, ...]
            if piped:
                stamps = (a.releasing, rel[1], grab[2], b.acquired)
                taken = [names[0], names[1], names[4]]
            else:
                stamps = (a.releasing, rel[1], blpops[-1][2], grab[1], grab[2], b.acquired)
                taken = list(names[:5])
            spans = [*(y - x for x, y in itertools.pairwise(stamps)), stamps[-1] - stamps[0]]
            spans.append(rel[2] - rel[1])
            for name, span in zip([*taken, names[5], names[6]], spans, strict=True):
                steps[name].append(round(span * 1e9))
        return {name: Figures([ns]) for name, ns in steps.items()}, skipped


def run_turns(
    url: str, arglists: list[tuple[object, ...]], *, slowlog: bool
) -> tuple[list[list[Turn]], dict[str, float], list[Mapping[str, Any]]]:
    """Run ping-pong workers; their turns, server µs per call of each command, SLOWLOG.

    ``slowlog``: log every command meanwhile (``SLOWLOG``, threshold 0), for
    the server's time per request; the server's settings are put back after.
    """
    logging = harness.slowlog_everything if slowlog else lambda _, __: nullcontext(False)
    with redis.Redis.from_url(url) as client, logging(client, SLOWLOG_LEN) as logs:
        before = harness.server_counters(client)[0]
        with harness.workers(pingpong_worker, arglists) as collect:
            parts = collect()
        after = harness.server_counters(client)[0]
        logged = client.slowlog_get(SLOWLOG_LEN) if logs else []
    server_us = {}
    for name, (calls, usec) in after.items():
        was_calls, was_usec = before.get(name, (0, 0))
        if calls > was_calls and name not in ("info", "ping", "client", "hello"):
            server_us[name] = (usec - was_usec) / (calls - was_calls)
    return parts, server_us, logged


def handoffs(
    specs: Sequence[Spec], count: int, warmup: int, *, slowlog: bool = False
) -> list[HandOffs]:
    """``count`` measured hand-offs of each of ``specs`` between two processes.

    One variant: after ``warmup`` more. Several: interleaved in turns of
    ``chunk`` (see :class:`Schedule`), after a first round of each; the
    hand-off between two variants' turns is not one, and is left out.
    """
    schedule = Schedule(tuple(specs), CHUNK)
    chunk = CHUNK
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
        results.append(
            HandOffs(
                kind=spec.kind,
                latency=by_turn(pairs, lambda a, b: b.acquired - a.releasing),
                release=by_turn(pairs, lambda a, _: a.released - a.releasing),
                head_start_ms=min(a.releasing - b.called for a, b in pairs) * 1000,
                unseen=(
                    sum(1 for a, _ in pairs if a.probes == 0) if spec.kind in BLPOP_WAITERS else 0
                ),
                overlaps=sum(1 for a, b in pairs if b.acquired < a.releasing),
                pairs=pairs,
                # The server's figures are the whole run's, the variants' together.
                server_us=server_us,
                requests_us=request_times(logged, spec.service),
            )
        )
    return results


def by_turn(pairs: Sequence[tuple[Turn, Turn]], span: Callable[[Turn, Turn], float]) -> Figures:
    """``span`` of each hand-off in ns, a round per turn of the schedule (``CHUNK`` turns)."""
    rounds: dict[int, list[int]] = {}
    for a, b in pairs:
        rounds.setdefault(a.index // CHUNK, []).append(round(span(a, b) * 1e9))
    return Figures(list(rounds.values()))


ACQUIRE_TRIES = {"0": "acquire, first attempt (fails)", "1": "acquire, after waking (takes)"}
PRL_RELEASE = hashlib.sha1(redis_lock.UNLOCK_SCRIPT).hexdigest()
RELEASES = (harness.SCRIPT_SHAS["release"], harness.SCRIPT_SHAS["mutex-release"], PRL_RELEASE)


def request_times(logged: Sequence[Mapping[str, Any]], service: str) -> dict[str, Figures]:
    """Server µs (SLOWLOG) of each kind of hand-off request, as ``Figures`` of ns.

    dmutex's acquire script: the first attempt (ARGV "registered" 0: it
    fails, as the lock is held) and the attempt after the wake-up (1);
    its release script. python-redis-lock: a lock's first ``SET NX``
    (fails), its second (takes: the same token), its release script. Only
    requests naming a key of ``service``.
    """
    mine = service.encode()
    kinds: dict[str, list[int]] = {}
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
            if sha == harness.SCRIPT_SHAS["acquire"] and words[-1] in (b"0", b"1"):
                kind = ACQUIRE_TRIES[words[-1].decode()]
            elif sha in RELEASES:
                kind = "release"
        elif name == b"SET" and b"NX" in (w.upper() for w in words) and len(words) > 2:
            kind = "SET NX, second (takes)" if words[2] in tokens else "SET NX, first (fails)"
            tokens.add(words[2])
        if kind is not None:
            kinds.setdefault(kind, []).append(int(entry["duration"]) * 1000)
    return {kind: Figures([ns]) for kind, ns in kinds.items()}


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
    return Figures([released]), request_times(logged, spec.service)


# --- 2. contended throughput ----------------------------------------------------------


Span = tuple[float, float, list[float], list[float], list[float]]
"""A contending process's start, end, and each cycle's acquire return, wait and release call."""


async def contend(spec: Spec, cycles: int, barrier: Any) -> Span:
    """Run ``cycles`` cycles after the barrier.

    Returns the start, the end, when each acquire returned, how long it took
    and when its release was called.
    """
    held = Locker(spec)
    clock = time.perf_counter
    acquired, waited, releasing = [0.0] * cycles, [0.0] * cycles, [0.0] * cycles
    try:
        await held.connect()
        barrier.wait(harness.WORKER_TIMEOUT_S)
        start = clock()
        for i in range(cycles):
            called = clock()
            release = await held.acquire()
            acquired[i] = clock()
            waited[i] = acquired[i] - called
            await held.increment()
            releasing[i] = clock()
            await release()
        return start, clock(), acquired, waited, releasing
    finally:
        await held.close()


def contended_worker(spec: Spec, cycles: int, barrier: Any, results: Any) -> None:
    harness.answer(results, lambda: asyncio.run(contend(spec, cycles, barrier)))


@dataclass(frozen=True)
class Contended:
    kind: str
    wall_s: float
    counter: int
    expected: int
    commands: dict[str, int]  # INFO commandstats calls over the run (script calls included)
    switches: int  # acquires that took the lock from another process (hand-offs)
    waits: Figures  # ns: each acquire's duration, a round per process
    longest_streak: int  # the most acquires in a row by one process
    peak: int  # the most processes holding at once (acquire returned .. release called)

    def per_cycle(self, name: str) -> float:
        return self.commands.get(name, 0) / self.expected

    def __add__(self, other: Contended) -> Contended:
        """Two rounds' figures together."""
        commands = {n: self.commands.get(n, 0) + other.commands.get(n, 0) for n in self.commands}
        return Contended(
            self.kind,
            self.wall_s + other.wall_s,
            self.counter + other.counter,
            self.expected + other.expected,
            commands | {n: c for n, c in other.commands.items() if n not in commands},
            self.switches + other.switches,
            Figures(self.waits.rounds + other.waits.rounds),
            max(self.longest_streak, other.longest_streak),
            max(self.peak, other.peak),
        )

    def longest_waits_ms(self) -> tuple[float, float]:
        """The least and the most of each process's longest acquire (ms; every round's)."""
        longest = [max(ns) / 1e6 for ns in self.waits.rounds if ns]
        return min(longest), max(longest)


def calls(client: redis.Redis) -> dict[str, int]:
    """``INFO commandstats`` calls per command (a script's commands included)."""
    return {name: count for name, (count, _) in harness.server_counters(client)[0].items()}


def contended(spec: Spec, processes: int, cycles: int) -> Contended:
    barrier = multiprocessing.get_context("spawn").Barrier(processes)
    with redis.Redis.from_url(spec.url) as client:
        before = calls(client)
        with harness.workers(contended_worker, [(spec, cycles, barrier)] * processes) as collect:
            spans = collect()
        after = calls(client)
        counter = int(client.get(spec.counter) or 0)
    wall = max(span[1] for span in spans) - min(span[0] for span in spans)
    commands = {name: calls - before.get(name, 0) for name, calls in after.items()}
    stamps = sorted((t, who) for who, span in enumerate(spans) for t in span[2])
    owners = [who for _, who in stamps]
    switches = sum(1 for a, b in itertools.pairwise(owners) if a != b)
    streak = max(len(list(run)) for _, run in itertools.groupby(owners))
    waits = Figures([[round(w * 1e9) for w in span[3]] for span in spans])
    holding = [(t, 1) for span in spans for t in span[2]]
    holding += [(t, -1) for span in spans for t in span[4]]
    peak = max(itertools.accumulate(step for _, step in sorted(holding)))  # ties: -1 first
    return Contended(
        spec.kind, wall, counter, processes * cycles, commands, switches, waits, streak, peak
    )


def contend_in_turns(
    spec: Callable[[str, str], Spec], kinds: Sequence[str], args: argparse.Namespace
) -> dict[str, list[Contended]]:
    """Each of ``kinds`` contended, in ``args.contended_rounds`` rounds in which they take turns.

    ``spec(kind, part)``: the variant's spec, under names of its own for
    ``part`` (the round); ``args``: ``processes``, ``cycles`` (per process,
    over all rounds), ``contended_rounds``.
    """
    contention: dict[str, list[Contended]] = {kind: [] for kind in kinds}
    per_round = max(1, args.cycles // args.contended_rounds)
    for r in range(args.contended_rounds):
        for kind in kinds:
            harness.progress(f"contended: {kind}, round {r + 1}")
            contention[kind].append(contended(spec(kind, f"ct{r}"), args.processes, per_round))
    return contention


# --- 3. what waiting costs the server -------------------------------------------------


async def wait_once(spec: Spec, ready: Any) -> float:
    held = Locker(spec)
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
    harness.answer(results, lambda: asyncio.run(wait_once(spec, ready)))


def monitored(url: str, probe: redis.Redis, seconds: float) -> tuple[float, dict[str, int]]:
    """The requests clients send in the next ``seconds``, read from ``MONITOR``; its length.

    The window runs between two ``ECHO`` markers of ``probe`` (the second sent
    by a timer thread), timed by the server. ``MONITOR`` shows a request when
    the server runs it (a ``BLPOP`` when it is sent, not when it returns);
    what a script ran is marked ``lua`` and left out, as it is no request.
    """
    marker, opened = f"handoff-window-{uuid.uuid4().hex}", None
    requests: dict[str, int] = {}
    with redis.Redis.from_url(url, socket_timeout=None) as client, client.monitor() as monitor:
        probe.echo(marker)  # MONITOR is on: its __enter__ waited for the server's OK
        threading.Timer(seconds, probe.echo, (marker,)).start()
        while True:
            seen: dict[str, Any] = monitor.next_command()
            words = str(seen["command"]).split(" ")
            name = words[0].lower()
            if name == "echo" and words[-1] == marker:
                if opened is not None:
                    return float(seen["time"]) - opened, requests
                opened = float(seen["time"])
            elif (
                opened is not None and name not in ("info", "echo") and seen["client_type"] != "lua"
            ):
                requests[name] = requests.get(name, 0) + 1


@dataclass(frozen=True)
class Waiting:
    label: str
    waiters: int
    seconds: float  # the first window
    commands: dict[str, int]  # INFO commandstats calls in it (script calls included)
    cpu_s: float  # the server's CPU time in it (INFO cpu)
    monitored_s: float  # the second window, between the markers' server times
    requests: dict[str, int]  # MONITOR: what the waiters sent in it

    def per_waiter_s(self) -> tuple[float, float, float]:
        """Per waiter per second: requests (MONITOR), commands and server CPU ms (INFO)."""
        requests = sum(self.requests.values()) / (self.waiters * self.monitored_s)
        commands = sum(self.commands.values()) / (self.waiters * self.seconds)
        return requests, commands, self.cpu_s * 1000 / (self.waiters * self.seconds)

    def breakdown(self) -> str:
        ordered = sorted(self.requests.items(), key=lambda item: -item[1])
        return ", ".join(f"{name.upper()} {calls}" for name, calls in ordered if calls) or "none"


async def hold(spec: Spec, label: str, waiters: int, seconds: float) -> Waiting:
    """Hold ``spec``'s lock for ``seconds`` while ``waiters`` processes wait for it."""
    holder = Locker(spec)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    try:
        await holder.connect()
        release = await holder.acquire()
        with harness.workers(waiting_worker, [(spec, ready)] * waiters) as collect:
            try:
                for _ in range(waiters):
                    ready.get(timeout=harness.WORKER_TIMEOUT_S)
                time.sleep(SETTLE_S)
                (before, cpu), start = harness.server_counters(holder.probe), time.perf_counter()
                time.sleep(seconds)
                after, cpu_after = harness.server_counters(holder.probe)
                cpu = cpu_after - cpu
                counted = time.perf_counter() - start
                # Then as long again under MONITOR, which costs the server CPU itself.
                monitored_s, requests = monitored(spec.url, holder.probe, seconds)
            finally:
                await release()
            acquired = collect()
    finally:
        await holder.close()
    if len(acquired) != waiters:
        raise BenchmarkError("a waiter did not get the lock after the release")
    delta = {name: n - before.get(name, (0, 0))[0] for name, (n, _) in after.items()}
    for own in ("info", "echo", "monitor"):  # the holder's probes: all it sent
        delta.pop(own, None)
    commands = {name: calls for name, calls in delta.items() if calls}
    return Waiting(label, waiters, counted, commands, cpu, monitored_s, requests)


# --- the run --------------------------------------------------------------------------


def print_handoffs(
    results: list[HandOffs], solo: Figures | None, heading: str = "1. Hand-off"
) -> dict[str, object]:
    """The hand-offs' table; ratios of each BLPOP variant's to python-redis-lock's.

    ``solo``: dmutex's releases with nobody waiting, beside its releases with a waiter.
    """
    latencies = ("p50", "p99", "mean", "max")
    rows = [
        [
            r.kind,
            WAKES_BY[r.kind],
            *(r.latency.us(s) / 1000 for s in latencies),
            r.release.us("p50"),
            r.unseen,
            r.overlaps,
            r.head_start_ms,
        ]
        for r in results
    ]
    head = ["variant", "waits by", "median ms", "p99 ms", "mean ms", "max ms", "release p50 µs"]
    head += ["unseen", "overlaps", "head start ms"]
    title = f"{heading} (holder's release call -> waiter holding); release: the holder's "
    harness.table(head, rows, title + "release() with the waiter blocked")
    dm = next(r for r in results if r.kind == DMUTEX)
    if solo is not None:
        print(
            f"\ndmutex release() p50: {solo.us('p50'):.1f} µs with nobody waiting, "
            f"{dm.release.us('p50'):.1f} µs with one waiter blocked (p99 {solo.us('p99'):.1f} / "
            f"{dm.release.us('p99'):.1f})"
        )
    latency = {r.kind: r.latency for r in results if r.kind in BLPOP_WAITERS}
    pairs = [(kind, PRL) for kind in latency if kind != PRL]
    ratios = harness.ratio_table(latency, pairs, ("p50", "p99"))
    return {
        "handoffs": {
            r.kind: {
                "latency": r.latency,
                "release": r.release,
                "head_start_ms": r.head_start_ms,
                "unseen": r.unseen,
                "overlaps": r.overlaps,
            }
            for r in results
        },
        "release_alone": solo,
        "ratios": ratios,
    }


def print_steps(traced: list[HandOffs], alone: Figures | None) -> dict[str, object]:
    """The traced hand-offs' steps (median µs, p99 beside the total) and server times."""
    found = {r.kind: r.steps() for r in traced}
    names = list(next(iter(found.values()))[0])
    rows = [[name, *(steps[name].us("p50") for steps, _ in found.values())] for name in names]
    rows.append(
        ["total, p99", *(steps["total (the hand-off)"].us("p99") for steps, _ in found.values())]
    )
    kinds = sorted({kind for r in traced for kind in r.requests_us})
    rows += [
        [
            f"server (SLOWLOG): {kind}",
            *(r.requests_us[kind].us("p50") if kind in r.requests_us else None for r in traced),
        ]
        for kind in kinds
    ]
    title = "1b. Where a hand-off's time goes, median µs (every request timestamped)"
    harness.table(["step", *found], rows, title)
    skipped = {kind: n for kind, (_, n) in found.items() if n}
    if skipped:
        print(f"hand-offs without a BLPOP (left out): {skipped}")
    print("(a dmutex waiter pipelines its BLPOP and next attempt: its BLPOP reply is its grant)")
    if alone is not None:
        print(
            f"dmutex release with nobody waiting, server: p50 {alone.us('p50'):.0f} "
            f"/ p99 {alone.us('p99'):.0f} µs"
        )
    server = sorted(traced[0].server_us.items())
    print("server µs per call, the three variants together (INFO commandstats):")
    print("  " + ", ".join(f"{name.upper()} {us:.1f}" for name, us in server))
    return {
        "steps": {kind: steps for kind, (steps, _) in found.items()},
        "server_requests": {r.kind: r.requests_us for r in traced},
        "server_us_per_call": dict(server),
        "release_alone_server": alone,
    }


def print_contended(
    contention: dict[str, list[Contended]],
    args: argparse.Namespace,
    heading: str = "2. Contended",
) -> dict[str, object]:
    """The contended runs' table (``args``: ``processes``, ``cycles``, ``contended_rounds``).

    Also each one's fairness: the longest streak of one process's acquires, and
    each process's longest acquire; the wall times' ratios to redis-py Lock's.
    """
    runs = {kind: sum(rounds[1:], rounds[0]) for kind, rounds in contention.items()}
    rows = [
        [c.kind, c.wall_s, c.expected / c.wall_s, f"{c.counter}/{c.expected}", c.peak, c.switches]
        + [c.per_cycle(name) for name in CONTENDED_COMMANDS]
        + [c.waits.us("p50") / 1000, c.waits.us("p99") / 1000, c.waits.us("max") / 1000]
        + [c.longest_streak, "{:.1f} .. {:.1f}".format(*c.longest_waits_ms())]
        for c in runs.values()
    ]
    head = ["variant", "wall s", "cycles/s", "counter", "most holding", "hand-offs"]
    head += [f"{name.upper()} / cycle" for name in CONTENDED_COMMANDS]
    head += ["acquire p50 ms", "p99 ms", "max ms", "longest streak", "processes' max ms"]
    title = (
        f"{heading}: {args.processes} processes x {args.cycles} cycles (acquire/GET/SET/release)"
    )
    harness.table(
        head,
        rows,
        f"{title} in {args.contended_rounds} round(s); INFO commandstats calls per cycle; "
        "most holding: processes between acquire and release at once; processes' max: the "
        "least and the most of their longest acquires",
    )
    walls = {
        kind: Figures([[round(c.wall_s * 1e9)] for c in rounds])
        for kind, rounds in contention.items()
    }
    pairs = [(kind, REDIS_PY) for kind in contention if kind != REDIS_PY]
    ratios = harness.ratio_table(walls, pairs, ("mean",), "Contended wall time / redis-py Lock's:")
    return {"runs": runs, "walls": walls, "ratios": ratios}


def bench(url: str, args: argparse.Namespace) -> dict[str, object]:
    run_id, quick, count = uuid.uuid4().hex[:8], args.quick, args.handoffs
    warm = 3 if quick else 10
    print(f"python-redis-lock {redis_lock.__version__}" + (" (--quick)" if quick else ""))

    def spec(kind: str, part: str, retry_delay: float = 0.1) -> Spec:
        return Spec(kind, url, f"handoff-{part}-{kind}-{run_id}", retry_delay=retry_delay)

    harness.progress(f"hand-off: {', '.join(WOKEN)}, interleaved")
    results = handoffs([spec(kind, "pp") for kind in WOKEN], count, warm)
    for kind in (REDIS_PY, POLLING):
        harness.progress(f"hand-off: {kind}")
        results += handoffs([spec(kind, "pp")], count, warm)
    solo, _ = solo_releases(spec(DMUTEX, "solo"), count, warm)
    found: dict[str, object] = {"handoff": print_handoffs(results, solo)}
    harness.progress("traced hand-offs")
    traced_specs = [replace(spec(kind, "tr"), trace=True) for kind in WOKEN]
    traced = handoffs(traced_specs, count, warm, slowlog=not args.url)
    alone = solo_releases(spec(DMUTEX, "trs"), count, warm, slowlog=not args.url)[1]
    found["traced"] = print_steps(traced, alone.get("release"))

    contention = contend_in_turns(spec, CONTENDED_KINDS, args)
    found["contended"] = print_contended(contention, args)

    waiting_runs = [
        (spec(DMUTEX, "w1", 0.1), "dmutex, waking, retry_delay 0.1"),
        (spec(DMUTEX, "w2", 1.0), "dmutex, waking, retry_delay 1.0"),
        (spec(POLLING, "w3", 0.1), "dmutex-polling, retry_delay 0.1"),
        (spec(REDIS_PY, "w4"), "redis-py Lock, sleep 0.1"),
        (spec(PRL, "w5"), "python-redis-lock"),
    ]
    waiting = []
    for wspec, label in waiting_runs:
        harness.progress(f"waiting: {label}")
        waiting.append(asyncio.run(hold(wspec, label, args.waiters, args.window)))
    rows = [[w.label, *w.per_waiter_s(), w.breakdown()] for w in waiting]
    head = ["variant", "requests", "commands", "server CPU ms", "requests in the window (MONITOR)"]
    title = f"3. Waiting: {args.waiters} waiters on a key held {args.window:g} s; per waiter per s"
    harness.table(head, rows, title)
    found["waiting"] = waiting

    print("\n4. Uncontended cycle: redis_cycle.py")
    options = {"cycles": 500, "warmup": 100} if quick else {"cycles": 2000, "warmup": 500}
    cycle = argparse.Namespace(rounds=args.cycle_rounds, chunk=100, ttl=30.0, **options)
    found["cycle"] = redis_cycle.bench(url, cycle)

    by = {r.kind: r.latency for r in results}
    walls = {kind: sum(c.wall_s for c in rounds) for kind, rounds in contention.items()}
    targets = []
    for kind in (DMUTEX, DMUTEX_ASYNC):
        median = by[kind].us("p50") / 1000
        targets += [
            Target(f"{kind} hand-off median, ms", median, 0.8, False),
            Target(f"{kind} hand-off p99, ms", by[kind].us("p99") / 1000, 3.0, False),
            Target(
                f"{kind} / python-redis-lock median", median * 1000 / by[PRL].us("p50"), 1.0, False
            ),
            Target(f"{kind} / redis-py Lock wall time", walls[kind] / walls[REDIS_PY], 0.9, False),
        ]
    harness.targets_table(targets)
    harness.delete_keys(url, f"*{run_id}*")  # the fence counters and the counters
    wrong = [c.kind for rounds in contention.values() for c in rounds if c.counter != c.expected]
    if wrong:
        print(f"WRONG counter (a lost update: mutual exclusion failed): {', '.join(wrong)}")
    return found | {"targets": targets, "wrong_counters": wrong}


def run(argv: Sequence[str] | None = None) -> int:
    return harness.main(bench, harness.parse(__doc__, argv, OPTIONS))


if __name__ == "__main__":
    sys.exit(run())

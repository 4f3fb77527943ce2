"""What a read-write lock costs on Redis, against the mutex, in one run (issue 28).

Run from the repository root (a report, not a test; about 1 minute on 2
cores, ``--quick``: about 10 seconds)::

    .venv/bin/python benchmarks/redis_readwrite.py
    .venv/bin/python benchmarks/redis_readwrite.py --quick --json out.json
    .venv/bin/python benchmarks/redis_readwrite.py --url redis://127.0.0.1:6379/0

One Redis server: 7.0 when the test harness finds it, else the newest it
finds, started for the run and stopped by pid after it; ``--redis`` names
others (one after another), ``--url`` one of your own, on which it works
under its own random names (its keys deleted at the end; the server's
command counts then include other clients', and ``INFO clients``' blocked
count too). Every lease has the defaults a user gets (fences on, no
``replicas``). Its three parts:

1. The uncontended cycle, on ONE connection per face
   (``single_connection_client``): ``mutex`` (``DMutex.acquire`` +
   ``release``), ``read`` (``DReadWriteLock.acquire_read`` + ``release``),
   ``write`` (``acquire_write`` + ``release``), and their ``-async`` twins
   (``AsyncDMutex``, ``AsyncDReadWriteLock`` on ``redis.asyncio``).
   ``--rounds`` rounds of ``--cycles`` per contender in turns of ``--chunk``
   after ``--warmup`` (``harness.interleave``): p50 / p90 / p99 µs and the
   ratios ``read / mutex`` and ``write / mutex`` of each face (the median of
   the per-round ratios of p50, p90 and ops/s, their spread, the pooled
   ratio). Then each contender alone, ``--counted`` cycles after a warm-up,
   on the same kind of connection: requests (round trips, every one the
   client sent, by ``harness.trace_requests``; a pipeline is one), split
   into the acquire's and the release's (the release scripts told apart by
   their SHA1s), and the server's commands per cycle (``INFO
   commandstats``, which counts a script's own commands beside its
   ``EVALSHA``).
2. Hand-off to a woken waiter: this process holds a key while a spawned
   process waits for it with ``retry_delay`` of 10 s, so that only a wake
   (the release's signal, ``BLPOP``) explains a grant within milliseconds.
   Three variants, rotating trial by trial: ``write`` (a writer waiting in
   ``acquire_write_with_retry``, a reader holding), ``read`` (a reader
   waiting in ``acquire_read_with_retry``, a writer holding) and ``mutex``
   (``DMutex.acquire_with_retry``, a mutex holding: ``handoff.py``'s
   figure, measured here in the same run). Each trial: the waiter notes
   ``time.perf_counter()`` (``CLOCK_MONOTONIC``, one clock for every
   process on Linux) and calls its acquire; the holder waits at least 5 ms
   and until ``INFO clients`` shows a blocked client, notes the time, calls
   ``release()``, notes the time it returned; the waiter notes when its
   acquire returned. The hand-off: from ``release()`` returning to the
   waiter's acquire returning, which is negative where the waiter's acquire
   returned first (the server woke it while the holder's process still
   waited for a CPU to read its own reply: seen with one core busy); also
   from the release call (``handoff.py``'s definition), which never is.
   ``--handoffs`` trials per variant after 2 of each unmeasured;
   p50 / p90 / p99 and the ratios to ``mutex`` (rounds of 10 trials each).
3. Writer preference under a stream of readers: ``--readers`` spawned
   processes each cycle ``acquire_read_with_retry`` (``ttl`` ``--reader-ttl``
   s, the default ``retry_delay`` 0.1 s) / hold ``--hold-ms`` / ``release``
   with no pause, so that some reader holds the key nearly all the time.
   ``--trials`` times, after a random pause of 50-150 ms, this process calls
   ``acquire_write_with_retry`` (``retry_delay`` 0.1 s, dmutex's default),
   then releases. Per trial: the writer's wait (its call to its return), in
   ms and over one reader TTL; how many readers held the key when it called;
   when the last reader granted before it (by fence) called its release,
   and the writer's return after that; and the reader grants after its
   first attempt. Every grant takes the key's next fence, at least the
   server's ``TIME`` in µs (``dmutex._core.readwrite`` rule 3), so a grant's
   fence is its place in the server's order and, within a few µs, its
   server time. The writer's first attempt (its first request, traced) is
   placed on the server's clock by ``TIME`` requests before and after the
   trial (the offset to ``perf_counter`` of the fastest, bounded by half
   its round trip and the change between the two). A reader grant whose
   fence is below the writer's and above the first attempt's reply, plus
   that bound, came after the writer's first attempt: writer preference
   says none; one within the bound of the attempt is counted as in flight.

Then the summary, a row a figure, and the targets: ``read / mutex`` cycle at
p50 within 1.2x (the issue's, both faces), the writer's longest wait within
one reader TTL and no reader granted after its first attempt. Options: the
counts named above; and the harness's ``--url``, ``--redis VERSION...``,
``--quick``, ``--json FILE``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import handoff
import harness
import redis
import redis_cycle
import redis_replicas
from harness import Batch, BenchmarkError, Figures, Request, Target, quantile
from redis_cycle import Connections, connections, timed, timed_async

from dmutex import AsyncDMutex, AsyncDReadWriteLock, DMutex, DReadWriteLock

# dmutex's internals this benchmark reads: the read-write scripts' SHA1s
# (a release's request, and the writer's attempts, told apart by them).
from dmutex._backends.redis.scripts import RW_ACQUIRE, RW_RELEASE

KEY = "k"
TTL_S = 30.0  # every lease of parts 1 and 2, and the writer's of part 3
TARGET = 1.2  # the issue's: a read cycle within 1.2x the mutex cycle
WAIT_S = 30.0  # the timeout of every retrying acquire
LONG_RETRY_S = 10.0  # part 2's waiters: only a wake explains a grant within ms
RETRY_S = 0.1  # part 3's readers and writer: dmutex's default retry_delay
SLOW_S = 1.0  # a part 2 hand-off slower than this was not a wake
TRIAL_ROUND = 10  # part 2: trials per variant in a round of the ratio table
HANDOFF_WARMUP = 2  # part 2: unmeasured trials per variant first
PAUSE_S = (0.05, 0.15)  # part 3: the random pause before each writer's trial
TIME_PROBES = 15  # part 3: TIME requests per estimate of the server's clock
CYCLES = ("mutex", "read", "write", "mutex-async", "read-async", "write-async")
PAIRS = [
    ("read", "mutex"),
    ("write", "mutex"),
    ("read", "write"),
    ("read-async", "mutex-async"),
    ("write-async", "mutex-async"),
]
MUTEX, WRITE, READ = "mutex", "write", "read"  # part 2's variants: who waits
HANDOFFS = (WRITE, READ, MUTEX)
HOLDER = {WRITE: "a reader", READ: "a writer", MUTEX: "a mutex holder"}
OPTIONS = {  # name: (default, under --quick)
    "cycles": (2000, 300), "rounds": (7, 2), "chunk": (100, 100), "warmup": (300, 50),
    "counted": (500, 100), "handoffs": (200, 10), "readers": (4, 4), "hold_ms": (20.0, 20.0),
    "reader_ttl": (1.0, 1.0), "trials": (50, 6),
}  # fmt: skip
# p90 is this benchmark's statistic as redis_replicas.py's; the ratios look it up by name.
harness.STATISTICS.setdefault("p90", lambda ns: quantile(ns, 0.9))


# --- 1. the uncontended cycle ------------------------------------------------------------


def cycles(faces: Connections, run_id: str) -> dict[str, Batch]:
    """The six contenders on ``faces``, each on a key of its own, in :data:`CYCLES` order."""
    client, aclient, loop = faces.client, faces.aclient, faces.loop
    mutex = DMutex(f"rwcycle-m-{run_id}", client, default_ttl_seconds=TTL_S)
    rw = DReadWriteLock(f"rwcycle-rw-{run_id}", client, default_ttl_seconds=TTL_S)
    amutex = AsyncDMutex(f"rwcycle-am-{run_id}", aclient, default_ttl_seconds=TTL_S)
    arw = AsyncDReadWriteLock(f"rwcycle-arw-{run_id}", aclient, default_ttl_seconds=TTL_S)

    def mutex_cycle() -> None:
        lock = mutex.acquire("m")
        if lock is None or not lock.release():
            raise BenchmarkError("DMutex: uncontended acquire/release failed")

    def read_cycle() -> None:
        lock = rw.acquire_read("r")
        if lock is None or not lock.release():
            raise BenchmarkError("DReadWriteLock: uncontended acquire_read/release failed")

    def write_cycle() -> None:
        lock = rw.acquire_write("w")
        if lock is None or not lock.release():
            raise BenchmarkError("DReadWriteLock: uncontended acquire_write/release failed")

    async def mutex_async() -> None:
        lock = await amutex.acquire("m")
        if lock is None or not await lock.release():
            raise BenchmarkError("AsyncDMutex: uncontended acquire/release failed")

    async def read_async() -> None:
        lock = await arw.acquire_read("r")
        if lock is None or not await lock.release():
            raise BenchmarkError("AsyncDReadWriteLock: uncontended acquire_read/release failed")

    async def write_async() -> None:
        lock = await arw.acquire_write("w")
        if lock is None or not await lock.release():
            raise BenchmarkError("AsyncDReadWriteLock: uncontended acquire_write/release failed")

    found = {
        "mutex": timed(mutex_cycle),
        "read": timed(read_cycle),
        "write": timed(write_cycle),
        "mutex-async": timed_async(loop, mutex_async),
        "read-async": timed_async(loop, read_async),
        "write-async": timed_async(loop, write_async),
    }
    return {name: found[name] for name in CYCLES}


RW_SCRIPTS = (RW_ACQUIRE.sha, RW_ACQUIRE.text)
RELEASES = frozenset(
    {RW_RELEASE.sha, harness.SCRIPT_SHAS["release"], harness.SCRIPT_SHAS["mutex-release"]}
)


def is_release(request: Request) -> bool:
    """Whether ``request`` runs a release script (by its SHA1, or its text sent by EVAL)."""
    args = request[0]
    if len(args) < 2 or str(args[0]).upper() not in ("EVALSHA", "EVAL"):
        return False
    named = str(args[1])
    return named in RELEASES or named == RW_RELEASE.text


def names(request: Request) -> tuple[object, ...]:
    """A request's command name; a pipeline's, each of its commands'."""
    args = request[0]
    return args[1:] if args[0] == "PIPELINE" else args[:1]


@dataclass(frozen=True)
class Counts:
    """Per cycle: the server's commands by name, the requests, and theirs of each half."""

    commands: dict[str, float]
    acquire: float  # requests of the acquire
    release: float  # requests of the release
    sent: list[str]  # each distinct request's command name(s)

    @property
    def total(self) -> float:
        return sum(self.commands.values())

    @property
    def requests(self) -> float:
        return self.acquire + self.release

    def breakdown(self) -> str:
        ordered = sorted(self.commands.items(), key=lambda item: (-item[1], item[0]))
        return ", ".join(f"{name.upper()} {n:g}" for name, n in ordered)


def counted(url: str, run_id: str, n: int) -> dict[str, Counts]:
    """Each contender alone, ``n`` cycles after a warm-up: what the server ran, what was sent."""
    found: dict[str, Counts] = {}
    with connections(url) as faces, redis.Redis.from_url(url) as probe:
        # Before dmutex binds the clients' execute_command and pipeline.
        logs = [harness.trace_requests(faces.client), harness.trace_requests(faces.aclient)]
        for name, batch in cycles(faces, run_id).items():
            batch(max(10, n // 10))  # scripts loaded, connections open
            before, marks = harness.server_counters(probe)[0], [len(log) for log in logs]
            batch(n)
            after = harness.server_counters(probe)[0]
            sent = [r for log, mark in zip(logs, marks, strict=True) for r in log[mark:]]
            calls = {k: c - before.get(k, (0, 0))[0] for k, (c, _) in after.items()}
            released = sum(map(is_release, sent))
            found[name] = Counts(
                commands={k: c / n for k, c in calls.items() if c and k != "info"},
                acquire=(len(sent) - released) / n,
                release=released / n,
                sent=sorted({" + ".join(map(str, names(r))) for r in sent}),
            )
    rows = [
        [name, c.total, c.requests, c.acquire, c.release, c.breakdown(), "; ".join(c.sent)]
        for name, c in found.items()
    ]
    head = ["contender", "commands", "requests", "acquire", "release", "commands by name", "sent"]
    title = (
        f"1b. Per cycle, {n} of each alone: the server's commands (INFO commandstats, a "
        "script's own included) and requests (round trips; a pipeline is one)"
    )
    harness.table(head, rows, title)
    return found


# --- 2. hand-off to a woken waiter -------------------------------------------------------


@dataclass(frozen=True)
class Handoff:
    """One trial of part 2, in ``perf_counter`` seconds."""

    index: int
    variant: str
    called: float  # the waiter's acquire called
    releasing: float  # the holder's release called
    released: float  # the holder's release returned
    got: float  # the waiter's acquire returned
    seen: bool  # the holder saw a blocked client before it released


def handoff_services(run_id: str) -> tuple[str, str]:
    """The mutex's and the read-write lock's service names of part 2."""
    return f"rwhand-m-{run_id}", f"rwhand-rw-{run_id}"


def wait_in_turns(url: str, run_id: str, peer: Connection) -> int:
    """The waiter of part 2: acquire as told, note the times, release; the trials run."""
    clock = time.perf_counter
    mutex_name, rw_name = handoff_services(run_id)
    with redis.Redis.from_url(url) as client:
        mutex = DMutex(mutex_name, client, default_ttl_seconds=TTL_S)
        rw = DReadWriteLock(rw_name, client, default_ttl_seconds=TTL_S)
        mutex.ready()
        rw.ready()
        acquire: dict[str, Callable[[], object]] = {
            MUTEX: lambda: mutex.acquire_with_retry(KEY, timeout=WAIT_S, retry_delay=LONG_RETRY_S),
            WRITE: lambda: rw.acquire_write_with_retry(
                KEY, timeout=WAIT_S, retry_delay=LONG_RETRY_S
            ),
            READ: lambda: rw.acquire_read_with_retry(KEY, timeout=WAIT_S, retry_delay=LONG_RETRY_S),
        }
        peer.send("ready")
        done = 0
        while True:
            message = handoff.receive(peer)
            if message == "stop":
                return done
            if not (isinstance(message, tuple) and len(message) == 2):
                raise BenchmarkError(f"the holder sent {message!r}")
            variant, index = message
            called = clock()
            peer.send(("trying", index, called))
            lease = acquire[variant]()
            got = clock()
            release = getattr(lease, "release", None)
            if release is None:
                raise BenchmarkError(f"{variant}: the waiter's acquire timed out")
            if not release():
                raise BenchmarkError(f"{variant}: the waiter's lease was gone at its release")
            peer.send(("got", index, called, got))
            done += 1


def waiter_worker(url: str, run_id: str, peer: Connection, results: Any) -> None:
    harness.answer(results, lambda: wait_in_turns(url, run_id, peer))


def blocked(probe: redis.Redis, since: float) -> bool:
    """Wait until ``since`` + 5 ms and ``INFO clients`` shows a blocked client; False if never."""
    if (left := since + handoff.MIN_HEAD_S - time.perf_counter()) > 0:
        time.sleep(left)
    deadline = time.monotonic() + handoff.BLOCKED_WAIT_S
    while time.monotonic() < deadline:
        if int(probe.info("clients")["blocked_clients"]) >= 1:
            return True
        time.sleep(0.001)
    return False


def run_handoffs(url: str, run_id: str, count: int) -> list[Handoff]:
    """``count`` measured trials of each variant (after :data:`HANDOFF_WARMUP` of each)."""
    clock = time.perf_counter
    total = (HANDOFF_WARMUP + count) * len(HANDOFFS)
    mine, theirs = multiprocessing.get_context("spawn").Pipe()
    mutex_name, rw_name = handoff_services(run_id)
    trials: list[Handoff] = []
    with (
        redis.Redis.from_url(url) as client,
        redis.Redis.from_url(url) as probe,
        harness.workers(waiter_worker, [(url, run_id, theirs)]) as collect,
    ):
        mutex = DMutex(mutex_name, client, default_ttl_seconds=TTL_S)
        rw = DReadWriteLock(rw_name, client, default_ttl_seconds=TTL_S)
        hold: dict[str, Callable[[], object]] = {
            MUTEX: lambda: mutex.acquire(KEY),
            WRITE: lambda: rw.acquire_read(KEY),
            READ: lambda: rw.acquire_write(KEY),
        }
        try:
            if handoff.receive(mine) != "ready":
                raise BenchmarkError("the waiter did not start")
            for index in range(total):
                variant = HANDOFFS[index % len(HANDOFFS)]
                lease = hold[variant]()
                release = getattr(lease, "release", None)
                if release is None:
                    raise BenchmarkError(f"{variant}: {HOLDER[variant]} could not take the key")
                mine.send((variant, index))
                since = handoff.expect(mine, "trying", index)
                seen = blocked(probe, since)
                releasing = clock()
                if not release():
                    raise BenchmarkError(f"{variant}: the holder's lease was gone")
                released = clock()
                message = handoff.receive(mine)
                if not (isinstance(message, tuple) and message[:2] == ("got", index)):
                    raise BenchmarkError(f"hand-off out of order: {message!r}")
                _, _, called, got = message
                trials.append(Handoff(index, variant, called, releasing, released, got, seen))
        finally:
            mine.send("stop")
        collect()
    return trials[HANDOFF_WARMUP * len(HANDOFFS) :]


def by_round(trials: Sequence[Handoff], span: Callable[[Handoff], float]) -> Figures:
    """``span`` of each trial in ns, a round per :data:`TRIAL_ROUND` trials of each variant."""
    rounds: dict[int, list[int]] = {}
    for n, trial in enumerate(trials):
        rounds.setdefault(n // TRIAL_ROUND, []).append(round(span(trial) * 1e9))
    return Figures(list(rounds.values()))


def handoffs(url: str, run_id: str, count: int) -> dict[str, object]:
    """Part 2: the trials, each variant's figures, the ratios to the mutex's; printed."""
    trials = run_handoffs(url, run_id, count)
    mine = {v: [t for t in trials if t.variant == v] for v in HANDOFFS}
    from_return = {v: by_round(mine[v], lambda t: t.got - t.released) for v in HANDOFFS}
    from_call = {v: by_round(mine[v], lambda t: t.got - t.releasing) for v in HANDOFFS}
    releases = {v: by_round(mine[v], lambda t: t.released - t.releasing) for v in HANDOFFS}
    slow = {v: sum(1 for t in mine[v] if t.got - t.releasing > SLOW_S) for v in HANDOFFS}
    unseen = {v: sum(1 for t in mine[v] if not t.seen) for v in HANDOFFS}
    early = {v: sum(1 for t in mine[v] if t.got < t.releasing) for v in HANDOFFS}
    rows = []
    for v in HANDOFFS:
        a, b, r = from_return[v], from_call[v], releases[v]
        rows.append(
            [
                f"{v} (waiter; {HOLDER[v]} holds)",
                len(a.samples),
                a.us("p50"),
                a.us("p90"),
                a.us("p99"),
                a.us("max"),
                b.us("p50"),
                b.us("p90"),
                r.us("p50"),
                slow[v],
                unseen[v] + early[v],
            ]
        )
    head = [
        "hand-off",
        "trials",
        "p50 µs",
        "p90 µs",
        "p99 µs",
        "max µs",
        "from call: p50",
        "p90",
        "release p50 µs",
        f"> {SLOW_S:g} s",
        "unseen / early",
    ]
    title = (
        f"2. Hand-off to a waiter (retry_delay {LONG_RETRY_S:g} s: only a wake is fast), from "
        "the holder's release() returning to the waiter's acquire returning; 'from call': "
        "from the release call (handoff.py's definition)"
    )
    harness.table(head, rows, title)
    pairs = [(WRITE, MUTEX), (READ, MUTEX)]
    ratios = {
        "from_return": harness.ratio_table(
            from_return, pairs, ("p50", "p90"), "Hand-off ratios (from release returning):"
        ),
        "from_call": harness.ratio_table(
            from_call, pairs, ("p50", "p90"), "Hand-off ratios (from the release call):"
        ),
    }
    return {
        "from_return": from_return,
        "from_call": from_call,
        "release": releases,
        "slow": slow,
        "unseen": unseen,
        "early": early,
        "ratios": ratios,
        "trials": trials,
    }


# --- 3. writer preference under a stream of readers ---------------------------------------

Grant = tuple[int, float, float, float, float]
"""A reader's grant: its fence, and (``perf_counter``) its acquire called and returned,
its release called and returned."""


def read_stream(
    url: str, service: str, hold_s: float, ttl_s: float, start: Any, stop: Any
) -> list[Grant]:
    """A reader of part 3: acquire, hold, release, again, until ``stop`` is set."""
    clock = time.perf_counter
    grants: list[Grant] = []
    with redis.Redis.from_url(url) as client:
        rw = DReadWriteLock(service, client, default_ttl_seconds=ttl_s)
        rw.ready()
        client.ping()
        start.wait(harness.WORKER_TIMEOUT_S)
        while not stop.is_set():
            called = clock()
            lease = rw.acquire_read_with_retry(KEY, ttl=ttl_s, timeout=WAIT_S, retry_delay=RETRY_S)
            granted = clock()
            if lease is None or lease.fence is None:
                raise BenchmarkError("a reader's acquire timed out (or took no fence)")
            time.sleep(hold_s)
            releasing = clock()
            if not lease.release():
                raise BenchmarkError("a reader's lease was gone at its release")
            grants.append((lease.fence, called, granted, releasing, clock()))
    return grants


def reader_worker(
    url: str, service: str, hold_s: float, ttl_s: float, start: Any, stop: Any, results: Any
) -> None:
    harness.answer(results, lambda: read_stream(url, service, hold_s, ttl_s, start, stop))


@dataclass(frozen=True)
class Clocks:
    """The server's clock (µs) less ``perf_counter`` (µs), and how far off it may be."""

    offset_us: float
    error_us: float

    @staticmethod
    def estimate(probe: redis.Redis) -> Clocks:
        """From :data:`TIME_PROBES` ``TIME`` requests: the one with the shortest round trip."""
        clock = time.perf_counter
        best: tuple[float, float] | None = None
        for _ in range(TIME_PROBES):
            sent = clock()
            seconds, micros = probe.time()
            answered = clock()
            trip_us = (answered - sent) * 1e6
            if best is None or trip_us < best[1]:
                best = (seconds * 1e6 + micros - (sent + answered) / 2 * 1e6, trip_us)
        if best is None:
            raise BenchmarkError("no TIME answered")
        return Clocks(best[0], best[1] / 2)

    def spanning(self, other: Clocks) -> Clocks:
        """An estimate that holds wherever either does (two taken around one trial)."""
        low = min(self.offset_us - self.error_us, other.offset_us - other.error_us)
        high = max(self.offset_us + self.error_us, other.offset_us + other.error_us)
        return Clocks((low + high) / 2, (high - low) / 2)

    def server_us(self, at: float) -> float:
        return at * 1e6 + self.offset_us


@dataclass(frozen=True)
class Trial:
    """One writer's acquire among the readers, in ``perf_counter`` seconds."""

    called: float
    got: float
    fence: int  # the writer's
    first_sent: float  # its first attempt's request
    first_answered: float
    attempts: int  # its requests that ran the acquire script (a pipeline counted once)
    signals: int  # signals pending on the key's signal list just before it called
    clocks: Clocks  # the server's clock, around the trial

    @property
    def at_once(self) -> bool:
        """Granted by its first attempt: there was no reader to wait for."""
        return self.attempts == 1


def is_attempt(request: Request) -> bool:
    """Whether ``request`` runs the read-write acquire script (alone or in a pipeline)."""
    args = [str(a) for a in request[0]]
    if args[0] == "PIPELINE":  # the block and the next attempt: traced by command names
        return "EVALSHA" in args or "EVAL" in args
    return len(args) > 1 and args[0] in ("EVALSHA", "EVAL") and args[1] in RW_SCRIPTS


@dataclass(frozen=True)
class Judged:
    """A trial read against every reader's grants."""

    wait_ms: float
    attempts: int  # the writer's requests that ran the acquire script
    signals: int  # signals pending when it called (LLEN of the key's signal list)
    holding: int  # readers holding the key when the writer called
    before: int  # reader grants since the writer's call, before its first attempt
    in_flight: int  # within the clocks' bound of its first attempt
    after: int  # after its first attempt's reply (and the bound), before its grant
    drain_ms: float  # writer's call to the last reader's release call granted before it
    lag_us: float  # that release call to the writer's acquire returning


def judge(trial: Trial, grants: Sequence[Grant]) -> Judged:
    """Place ``grants`` against ``trial`` by fence (the server's order) and clock."""
    clocks = trial.clocks
    low = clocks.server_us(trial.first_sent) - clocks.error_us
    high = clocks.server_us(trial.first_answered) + clocks.error_us
    since = clocks.server_us(trial.called) - clocks.error_us
    ahead = [g for g in grants if g[0] < trial.fence]  # granted before the writer
    mine = [g for g in ahead if g[0] >= since]  # since it called
    holding = sum(1 for g in grants if g[2] <= trial.called < g[4])
    # The readers the writer waited for: granted before it, still holding when it called.
    waited = [g[3] for g in ahead if g[4] > trial.called]
    last = max(waited, default=trial.called)
    return Judged(
        wait_ms=(trial.got - trial.called) * 1000,
        attempts=trial.attempts,
        signals=trial.signals,
        holding=holding,
        before=sum(1 for g in mine if g[0] < low),
        in_flight=sum(1 for g in mine if low <= g[0] <= high),
        after=0 if trial.at_once else sum(1 for g in mine if g[0] > high),
        drain_ms=(last - trial.called) * 1000,
        lag_us=(trial.got - last) * 1e6,
    )


def preference(url: str, run_id: str, args: argparse.Namespace) -> Preference:
    """Part 3: the readers' stream, the writer's trials, each judged; printed."""
    service = f"rwpref-{run_id}"
    signal = f"_drwlock_{service}:signal:{KEY}"  # the default key_prefix's
    ctx = multiprocessing.get_context("spawn")
    start, stop = ctx.Barrier(args.readers + 1), ctx.Event()
    hold_s = args.hold_ms / 1000
    arglists: list[tuple[object, ...]] = [
        (url, service, hold_s, args.reader_ttl, start, stop) for _ in range(args.readers)
    ]
    clock = time.perf_counter
    trials: list[Trial] = []
    pause = random.Random(28)
    with (
        redis.Redis.from_url(url) as client,
        redis.Redis.from_url(url) as probe,
        harness.workers(reader_worker, arglists) as collect,
    ):
        log = harness.trace_requests(client)  # before dmutex binds it
        rw = DReadWriteLock(service, client, default_ttl_seconds=TTL_S)
        rw.ready()
        try:
            try:
                start.wait(harness.WORKER_TIMEOUT_S)
            except threading.BrokenBarrierError:
                raise BenchmarkError("the readers did not start") from None
            time.sleep(10 * hold_s)  # every reader in its stream
            for _ in range(args.trials):
                time.sleep(pause.uniform(*PAUSE_S))
                before = Clocks.estimate(probe)
                signals = int(probe.llen(signal))
                mark = len(log)
                called = clock()
                lease = rw.acquire_write_with_retry(
                    KEY, ttl=TTL_S, timeout=WAIT_S, retry_delay=RETRY_S
                )
                got = clock()
                if lease is None or lease.fence is None:
                    raise BenchmarkError("the writer's acquire timed out (or took no fence)")
                if not lease.release():
                    raise BenchmarkError("the writer's lease was gone at its release")
                after = Clocks.estimate(probe)
                attempts = [r for r in log[mark:] if is_attempt(r)]
                if not attempts:
                    raise BenchmarkError(f"no acquire request traced: {log[mark:]!r}")
                first = attempts[0]
                trials.append(
                    Trial(
                        called,
                        got,
                        lease.fence,
                        first[1],
                        first[2],
                        len(attempts),
                        signals,
                        before.spanning(after),
                    )
                )
        finally:
            stop.set()
        streams: list[list[Grant]] = collect()
    grants = sorted(g for stream in streams for g in stream)
    judged = [judge(trial, grants) for trial in trials]
    return summarize_preference(args, trials, judged, grants, streams)


@dataclass(frozen=True)
class Preference:
    """Part 3's figures, over every trial."""

    readers: int
    hold_ms: float
    reader_ttl_s: float
    trials: int
    granted_at_once: int  # trials whose first attempt was granted: no reader to wait for
    wait: Figures  # the writer's waits, ns (one round)
    wait_over_ttl_max: float  # the longest wait over one reader TTL
    holding: list[int]  # readers holding when the writer called, per trial
    drain_ms: list[float]  # the writer's call to the last earlier reader's release call
    lag_us: list[float]  # that release call to the writer's return (trials that waited)
    in_flight: list[int]  # reader grants within the clocks' bound of the first attempt
    after_first_attempt: int  # reader grants after it, before the writer's grant: all trials
    clock_bound_us_max: float
    reader_grants: list[int]  # per reader
    reader_grants_per_s: float
    judged: list[Judged]


def summarize_preference(
    args: argparse.Namespace,
    trials: Sequence[Trial],
    judged: Sequence[Judged],
    grants: Sequence[Grant],
    streams: Sequence[Sequence[Grant]],
) -> Preference:
    """Part 3's figures, printed."""
    waits = [j.wait_ms for j in judged]
    span_s = (grants[-1][4] - grants[0][1]) if grants else 0.0
    found = Preference(
        readers=args.readers,
        hold_ms=args.hold_ms,
        reader_ttl_s=args.reader_ttl,
        trials=len(trials),
        granted_at_once=sum(1 for t in trials if t.at_once),
        wait=Figures([[round(w * 1e6) for w in waits]]),
        wait_over_ttl_max=max(waits) / (args.reader_ttl * 1000),
        holding=[j.holding for j in judged],
        drain_ms=[j.drain_ms for j in judged],
        lag_us=[j.lag_us for j, t in zip(judged, trials, strict=True) if not t.at_once],
        in_flight=[j.in_flight for j in judged],
        after_first_attempt=sum(j.after for j in judged),
        clock_bound_us_max=max(t.clocks.error_us for t in trials),
        reader_grants=[len(s) for s in streams],
        reader_grants_per_s=len(grants) / span_s if span_s else float("nan"),
        judged=list(judged),
    )
    wait, cell = found.wait, harness.cell

    def p50_max(values: Sequence[float], unit: str) -> str:
        most = max(values, default=float("nan"))
        return f"{cell(quantile(values, 0.5))} / {cell(most)}" + (f" {unit}" if unit else "")

    rows: list[list[object]] = [
        ["trials (granted at its first attempt)", f"{found.trials} ({found.granted_at_once})"],
        [
            "the writer's wait, p50 / p90 / max ms",
            " / ".join(cell(wait.us(s) / 1000) for s in ("p50", "p90", "max")),
        ],
        ["its longest wait / one reader TTL", found.wait_over_ttl_max],
        [
            "its attempts (requests running the script), p50 / max",
            p50_max([j.attempts for j in judged], ""),
        ],
        [
            "signals pending on the key when it called, p50 / max",
            p50_max([j.signals for j in judged], ""),
        ],
        [
            "readers holding when it called, p50 (least)",
            f"{quantile(found.holding, 0.5):g} ({min(found.holding)})",
        ],
        [
            "its call -> the last earlier reader's release call, p50 / max",
            p50_max(found.drain_ms, "ms"),
        ],
        ["that release call -> the writer's return, p50 / max", p50_max(found.lag_us, "µs")],
        ["reader grants after its first attempt (all trials)", found.after_first_attempt],
        [
            "reader grants in flight at it (all trials; most in one)",
            f"{sum(found.in_flight)} ({max(found.in_flight)})",
        ],
        ["the clocks' bound, most µs", found.clock_bound_us_max],
        [
            "reader grants (per s; per reader)",
            f"{len(grants)} ({found.reader_grants_per_s:.0f}/s; {found.reader_grants})",
        ],
    ]
    title = (
        f"3. Writer preference: {args.readers} readers cycling (hold {args.hold_ms:g} ms, "
        f"ttl {args.reader_ttl:g} s), a writer's acquire_write_with_retry (retry_delay "
        f"{RETRY_S:g} s) {found.trials} times"
    )
    harness.table(["figure", "value"], rows, title)
    return found


# --- the run ----------------------------------------------------------------------------


def summarize(
    figures: Mapping[str, Figures],
    ratios: Mapping[str, harness.Ratio],
    counts: Mapping[str, Counts],
    hand: Mapping[str, Any],
    pref: Preference,
) -> list[list[object]]:
    """A row a figure: the cycles and their ratios, the hand-offs, writer preference."""

    def cycle(name: str) -> list[object]:
        f, c = figures[name], counts[name]
        base = "mutex-async" if name.endswith("-async") else "mutex"
        x = "-" if name == base else ratios[f"{name} / {base}, p50"].median
        sends = f"{c.total:g} / {c.requests:g} ({c.acquire:g} + {c.release:g})"
        return [f"cycle: {name}", f.us("p50"), f.us("p90"), x, sends]

    rows = [cycle(name) for name in CYCLES]
    for v in HANDOFFS:
        f = hand["from_return"][v]
        x = "-" if v == MUTEX else hand["ratios"]["from_return"][f"{v} / {MUTEX}, p50"].median
        rows.append([f"hand-off: {v} waiter, {HOLDER[v]} held", f.us("p50"), f.us("p90"), x, "-"])
    wait, after = pref.wait, f"reader grants after its first attempt: {pref.after_first_attempt}"
    rows.append(
        [
            "the writer's wait among readers (x: its longest over one reader TTL)",
            wait.us("p50"),
            wait.us("p90"),
            pref.wait_over_ttl_max,
            after,
        ]
    )
    head = [
        "figure",
        "p50 µs",
        "p90 µs",
        "x mutex p50 (wait: max / reader ttl)",
        "commands / requests (acquire + release)",
    ]
    harness.table(head, rows, "Summary (x: median of the per-round ratios)")
    return rows


def bench(url: str, args: argparse.Namespace) -> dict[str, object]:
    run_id = uuid.uuid4().hex[:8]
    print(
        f"1: {args.rounds} rounds x {args.cycles} per contender in turns of {args.chunk}, "
        f"after {args.warmup} warm-up, one connection per face; 2: {args.handoffs} hand-offs "
        f"per variant; 3: {args.readers} readers, {args.trials} writer's trials"
        + (" (--quick)" if args.quick else ""),
        flush=True,
    )
    try:
        with connections(url) as faces:
            harness.progress("1. the cycle, interleaved")
            figures = redis_cycle.interleaved(cycles(faces, f"{run_id}t"), args)
        redis_replicas.times_table(figures, "1. The uncontended cycle (acquire + release)")
        ratios = harness.ratio_table(figures, PAIRS, ("p50", "p90", "ops/s"))
        harness.progress("1b. counted")
        counts = counted(url, f"{run_id}n", args.counted)
        harness.progress("2. hand-off")
        hand = handoffs(url, run_id, args.handoffs)
        harness.progress("3. writer preference")
        pref = preference(url, run_id, args)
    finally:
        harness.delete_keys(url, f"*{run_id}*")
    summary = summarize(figures, ratios, counts, hand, pref)
    targets = [
        Target("read / mutex cycle (p50)", ratios["read / mutex, p50"].median, TARGET, False),
        Target(
            "read-async / mutex-async cycle (p50)",
            ratios["read-async / mutex-async, p50"].median,
            TARGET,
            False,
        ),
        Target("the writer's longest wait / one reader TTL", pref.wait_over_ttl_max, 1.0, False),
        Target(
            "reader grants after the writer's first attempt", pref.after_first_attempt, 0, False
        ),
    ]
    harness.targets_table(targets)
    requests: dict[str, float] = {}
    for name, c in counts.items():  # requests per operation, as the tests check them
        requests |= {f"{name}: acquire": c.acquire, f"{name}: release": c.release}
    return {
        "figures": figures,
        "ratios": ratios,
        "counted": counts,
        "requests": requests,
        "handoff": hand,
        "preference": pref,
        "summary": summary,
        "targets": targets,
    }


def run(argv: Sequence[str] | None = None) -> int:
    args = harness.parse(__doc__, argv, OPTIONS)
    if not args.url and not args.redis:
        args.redis = harness.one_redis("7.0")
    return harness.main(bench, args)


if __name__ == "__main__":
    sys.exit(run())

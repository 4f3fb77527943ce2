"""What holding many auto-renewed leases costs, and what the fence counters cost.

Run from the repository root (a report, not a test; about 35 seconds on 2 cores,
80 with ``--ttl 10``)::

    .venv/bin/python benchmarks/renewal_scale.py
    .venv/bin/python benchmarks/renewal_scale.py --leases 2000 --ttl 3
    .venv/bin/python benchmarks/renewal_scale.py --server /path/to/redis-server

Without ``--url`` it starts ``redis-server`` (the one on PATH, or ``--server``)
on a free 127.0.0.1 port with persistence off, and stops it by pid at the end.
With ``--url`` it works under its own random key prefixes and deletes its keys
at the end; the server's command counts then include other clients' commands.

1. Renewal, sync: ``--leases`` leases taken by ONE ``DMutex`` with
   ``acquire(f"k{i}", ttl=--ttl, auto_renew=True)``, on Redis (redis-py) and on
   ``InMemoryBackend``, held for ``--hold`` renewal intervals (an interval is
   a third of the TTL less up to 10% jitter). Reported: threads before and
   while holding, the renewals done in the holding window (counted by a
   wrapper on the store's ``extend_many``, which also timestamps each one), the
   ``EVALSHA`` calls the server saw in it (``INFO commandstats``: renewals
   due together share one request, up to 256 leases), requests
   per nominal interval and their ratio to the number of leases, the
   process's CPU time (``time.process_time``: every thread) per 1,000
   renewals, the server's CPU (``INFO cpu``) per 1,000 renewals, the gap
   between successive renewals of one lease, and how many leases were lost.
2. Renewal, async: the same with ``AsyncDMutex`` on ``redis.asyncio`` and on
   ``InMemoryBackend``, both in one event loop; tasks are counted with
   ``asyncio.all_tasks()`` (the benchmark's own task included).
3. Fence counters: ``MEMORY USAGE`` of ``_dmutex_bench:fence:<key>`` for a few
   key lengths (beside that of a held permit key), and the ``used_memory``
   delta for ``--counters`` counters made by acquire + release (they persist).
4. The uncontended acquire + release cycle on one connection with
   ``fencing=None`` (the counter is incremented in the acquire's script) and
   ``fencing=False`` (no counter): client p50/mean and server time per cycle,
   in interleaved turns of 100 cycles.

The exit code is 0 after a run (non-zero only when the benchmark could not run).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import platform
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import redis
import redis.asyncio
from redis_cycle import BenchmarkError, private_server, shown

from dmutex import AsyncDMutex, AsyncDMutexLock, DMutex, DMutexLock, InMemoryBackend
from dmutex._core.abc import Renewed
from dmutex._core.effects import Steps
from dmutex._core.lease import Lease

RENEWER = "dmutex-renewer"
SAMPLE_EVERY_S = 0.25  # how often the holding phase counts threads and tasks
FENCE_KEY_LENGTHS = (1, 8, 32, 128)
CYCLE_TURN = 100


# --- counting renewals ----------------------------------------------------------------


class _Extending(Protocol):
    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]: ...


@dataclass
class Renewals:
    """When each renewal started (``time.monotonic()``), and for which key."""

    stamps: list[tuple[float, str]] = field(default_factory=list)

    def between(self, start: float, end: float) -> int:
        return sum(1 for at, _ in self.stamps if start <= at < end)

    def gaps(self, granted: Mapping[str, float]) -> list[float]:
        """Seconds from each lease's grant to its first renewal, and between renewals."""
        last = dict(granted)
        gaps = []
        for at, key in self.stamps:
            gaps.append(at - last[key])
            last[key] = at
        return gaps


def count_renewals(face: DMutex | AsyncDMutex) -> Renewals:
    """Timestamp every lease the face's store renews (``extend_many``: renewal's batches).

    Wraps the store's method on the instance; the wrapper costs about 0.2 µs
    per renewed lease here (a clock read and a list append).
    """
    store: _Extending = face._engine._store
    inner = store.extend_many
    renewals = Renewals()
    stamps, clock = renewals.stamps, time.monotonic

    def extend_many(leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        at = clock()
        stamps.extend((at, lease.key) for lease in leases)
        return inner(leases)

    vars(store)["extend_many"] = extend_many  # an instance attribute shadows the method
    return renewals


# --- what the server and the process report --------------------------------------------


@dataclass(frozen=True)
class ServerStats:
    """Counters of a Redis server at one instant."""

    evalsha: int
    evalsha_usec: int
    cpu_s: float

    @classmethod
    def of(cls, commands: Mapping[str, object], cpu: Mapping[str, object]) -> ServerStats:
        stat = commands.get("cmdstat_evalsha")
        calls = usec = 0
        if isinstance(stat, Mapping):
            calls, usec = int(stat.get("calls", 0)), int(stat.get("usec", 0))
        used = float(str(cpu["used_cpu_user"])) + float(str(cpu["used_cpu_sys"]))
        return cls(calls, usec, used)

    def __sub__(self, other: ServerStats) -> ServerStats:
        return ServerStats(
            self.evalsha - other.evalsha,
            self.evalsha_usec - other.evalsha_usec,
            self.cpu_s - other.cpu_s,
        )


def server_stats(client: redis.Redis) -> ServerStats:
    return ServerStats.of(client.info("commandstats"), client.info("cpu"))


async def server_stats_async(client: redis.asyncio.Redis) -> ServerStats:
    return ServerStats.of(await client.info("commandstats"), await client.info("cpu"))


def renewer_threads() -> int:
    return sum(1 for thread in threading.enumerate() if thread.name == RENEWER)


def renewer_tasks() -> int:
    return sum(1 for task in asyncio.all_tasks() if task.get_name() == RENEWER)


def quantile(values: Iterable[float], q: float) -> float:
    """Nearest-rank quantile; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# --- holding many renewed leases ------------------------------------------------------


def window_start(granted: Mapping[str, float], interval_s: float) -> float:
    """When to open the holding window: half an interval off the first lease's phase.

    Leases taken faster than one interval renew in near step, in passes about
    one interval apart; a window of whole intervals opened between two passes
    then counts every lease's renewals once per interval, whereas one opened
    on a pass would count that pass once or twice depending on the jitter.
    The first pass after the last grant bounds the window's start.
    """
    first, last = min(granted.values()), max(granted.values())
    passes = max(0, math.ceil((last - first) / interval_s - 0.5))
    return first + (passes + 0.5) * interval_s


@dataclass
class Hold:
    """What one run of holding ``leases`` renewed leases showed."""

    face: str
    backend: str
    leases: int
    ttl_s: float
    acquire_s: float = 0.0
    window_s: float = 0.0
    threads_before: int = 0
    threads_holding: int = 0  # the most seen while holding
    renewer_threads: int = 0  # the most seen while holding
    tasks_before: int | None = None
    tasks_holding: int | None = None
    renewer_tasks: int | None = None
    other_tasks: set[str] = field(default_factory=set)  # coroutines of any other task seen
    renewals: int = 0  # in the holding window, counted by the wrapper
    cpu_s: float = 0.0  # this process, in the holding window
    server: ServerStats | None = None  # delta over the holding window
    gaps: list[float] = field(default_factory=list)
    lost: int = 0
    released: int = 0
    renewer_gone_s: float | None = None  # after the last release; None: still there

    @property
    def interval_s(self) -> float:
        """The mean renewal interval the renewer aims at: a third of the TTL, less 5%."""
        return self.ttl_s / 3 * 0.95

    @property
    def per_interval(self) -> float:
        """Renewal requests per nominal interval: the server's count where there is one."""
        done = self.server.evalsha if self.server is not None else self.renewals
        return done / (self.window_s / self.interval_s)

    def per_thousand_ms(self, seconds: float) -> float:
        return seconds / self.renewals * 1e6 if self.renewals else math.nan


def _acquire_all(
    mutex: DMutex, leases: int, ttl_s: float
) -> tuple[list[DMutexLock], dict[str, float]]:
    handles, granted = [], {}
    for i in range(leases):
        key = f"k{i}"
        handle = mutex.acquire(key, ttl=ttl_s, auto_renew=True)
        if handle is None:
            raise BenchmarkError(f"could not take {key!r}: is the key space shared?")
        handles.append(handle)
        granted[key] = time.monotonic()
    return handles, granted


def hold_sync(
    backend: str, mutex: DMutex, server: redis.Redis | None, args: argparse.Namespace
) -> Hold:
    """Take ``--leases`` renewed leases with ``mutex``, hold them, release them."""
    ttl_s: float = args.ttl
    result = Hold("sync", backend, args.leases, ttl_s)
    renewals = count_renewals(mutex)
    result.threads_before = threading.active_count()
    if renewer_threads():
        raise BenchmarkError("a renewer thread is already running")
    started = time.monotonic()
    handles, granted = _acquire_all(mutex, args.leases, ttl_s)
    result.acquire_s = time.monotonic() - started

    time.sleep(max(0.0, window_start(granted, result.interval_s) - time.monotonic()))
    before = server_stats(server) if server is not None else None
    cpu, start = time.process_time(), time.monotonic()
    end = start + args.hold * result.interval_s
    while (now := time.monotonic()) < end:
        result.threads_holding = max(result.threads_holding, threading.active_count())
        result.renewer_threads = max(result.renewer_threads, renewer_threads())
        time.sleep(min(SAMPLE_EVERY_S, end - now))
    result.cpu_s = time.process_time() - cpu
    stop = time.monotonic()
    result.window_s = stop - start
    if server is not None and before is not None:
        result.server = server_stats(server) - before
    result.renewals = renewals.between(start, stop)

    result.lost = sum(handle.lost for handle in handles)
    result.released = sum(handle.release() for handle in handles)
    result.gaps = renewals.gaps(granted)
    del handles
    released = time.monotonic()
    while renewer_threads() and time.monotonic() < released + ttl_s:
        time.sleep(0.02)
    if not renewer_threads():
        result.renewer_gone_s = time.monotonic() - released
    return result


async def hold_async(
    backend: str,
    mutex: AsyncDMutex,
    server: redis.asyncio.Redis | None,
    args: argparse.Namespace,
) -> Hold:
    """The async twin of :func:`hold_sync`, on the running loop."""
    ttl_s: float = args.ttl
    result = Hold("async", backend, args.leases, ttl_s)
    renewals = count_renewals(mutex)
    result.threads_before = threading.active_count()
    result.tasks_before = len(asyncio.all_tasks())
    if renewer_tasks():
        raise BenchmarkError("a renewer task is already running")
    started = time.monotonic()
    handles: list[AsyncDMutexLock] = []
    granted: dict[str, float] = {}
    for i in range(args.leases):
        key = f"k{i}"
        handle = await mutex.acquire(key, ttl=ttl_s, auto_renew=True)
        if handle is None:
            raise BenchmarkError(f"could not take {key!r}: is the key space shared?")
        handles.append(handle)
        granted[key] = time.monotonic()
    result.acquire_s = time.monotonic() - started

    await asyncio.sleep(max(0.0, window_start(granted, result.interval_s) - time.monotonic()))
    before = await server_stats_async(server) if server is not None else None
    cpu, start = time.process_time(), time.monotonic()
    end = start + args.hold * result.interval_s
    result.tasks_holding = result.renewer_tasks = 0
    this = asyncio.current_task()
    while (now := time.monotonic()) < end:
        result.threads_holding = max(result.threads_holding, threading.active_count())
        result.renewer_threads = max(result.renewer_threads, renewer_threads())
        tasks = asyncio.all_tasks()
        result.tasks_holding = max(result.tasks_holding, len(tasks))
        result.renewer_tasks = max(result.renewer_tasks, renewer_tasks())
        result.other_tasks.update(
            str(getattr(task.get_coro(), "__qualname__", "?"))
            for task in tasks
            if task is not this and task.get_name() != RENEWER
        )
        await asyncio.sleep(min(SAMPLE_EVERY_S, end - now))
    result.cpu_s = time.process_time() - cpu
    stop = time.monotonic()
    result.window_s = stop - start
    if server is not None and before is not None:
        result.server = await server_stats_async(server) - before
    result.renewals = renewals.between(start, stop)

    result.lost = sum(handle.lost for handle in handles)
    for handle in handles:
        result.released += await handle.release()
    result.gaps = renewals.gaps(granted)
    del handles
    released = time.monotonic()
    while renewer_tasks() and time.monotonic() < released + ttl_s:
        await asyncio.sleep(0.02)
    if not renewer_tasks():
        result.renewer_gone_s = time.monotonic() - released
    return result


def settle() -> None:
    """Between runs: collect the last run's handles and let its renewer end."""
    gc.collect()
    deadline = time.monotonic() + 30
    while renewer_threads() and time.monotonic() < deadline:
        time.sleep(0.05)


def sync_runs(url: str, base: str, args: argparse.Namespace) -> list[Hold]:
    client = redis.Redis.from_url(url, socket_timeout=10)
    try:
        print(f"  sync, Redis: {args.leases} leases", file=sys.stderr, flush=True)
        mutex = DMutex(f"{base}-sync", client, default_ttl_seconds=args.ttl)
        on_redis = hold_sync("Redis", mutex, client, args)
        settle()
        print(f"  sync, InMemoryBackend: {args.leases} leases", file=sys.stderr, flush=True)
        memory = DMutex(f"{base}-sync", InMemoryBackend(), default_ttl_seconds=args.ttl)
        in_memory = hold_sync("InMemoryBackend", memory, None, args)
        settle()
    finally:
        client.close()
    return [on_redis, in_memory]


async def async_runs(url: str, base: str, args: argparse.Namespace) -> list[Hold]:
    client = redis.asyncio.Redis.from_url(url, socket_timeout=10)
    try:
        print(f"  async, Redis: {args.leases} leases", file=sys.stderr, flush=True)
        mutex = AsyncDMutex(f"{base}-async", client, default_ttl_seconds=args.ttl)
        on_redis = await hold_async("Redis", mutex, client, args)
        gc.collect()
        print(f"  async, InMemoryBackend: {args.leases} leases", file=sys.stderr, flush=True)
        memory = AsyncDMutex(f"{base}-async", InMemoryBackend(), default_ttl_seconds=args.ttl)
        in_memory = await hold_async("InMemoryBackend", memory, None, args)
        gc.collect()
    finally:
        await client.aclose()
    return [on_redis, in_memory]


# --- fence counters -------------------------------------------------------------------


@dataclass
class FenceMemory:
    """``MEMORY USAGE`` by key length, and ``used_memory`` per counter."""

    prefix: str
    by_length: list[tuple[int, int, int]] = field(default_factory=list)  # len, counter, permit
    counters: int = 0
    keys_added: int = 0
    used_memory_delta: int = 0


def memory_usage(client: redis.Redis, name: str) -> int:
    used = client.memory_usage(name, samples=0)
    if not isinstance(used, int):
        raise BenchmarkError(f"MEMORY USAGE {name} answered {used!r}")
    return used


def fence_memory(client: redis.Redis, base: str, args: argparse.Namespace) -> FenceMemory:
    mutex = DMutex(base, client)
    prefix = f"_dmutex_{base}:"
    result = FenceMemory(prefix)
    for length in FENCE_KEY_LENGTHS:
        key = "x" * length
        lock = mutex.acquire(key)
        if lock is None or lock.fence is None:
            raise BenchmarkError(f"no fenced grant for a {length}-character key")
        permit = memory_usage(client, f"{prefix}permit:0:{key}")
        lock.release()
        result.by_length.append((length, memory_usage(client, f"{prefix}fence:{key}"), permit))

    result.counters = args.counters
    keys = client.dbsize()
    used = int(client.info("memory")["used_memory"])
    for i in range(args.counters):
        lock = mutex.acquire(f"c{i:05d}")
        if lock is None or not lock.release():
            raise BenchmarkError("uncontended acquire/release failed")
    result.used_memory_delta = int(client.info("memory")["used_memory"]) - used
    result.keys_added = client.dbsize() - keys
    return result


# --- the cycle with and without a fence ------------------------------------------------


@dataclass
class Cycle:
    name: str
    samples: list[int] = field(default_factory=list)  # ns per acquire + release
    server_usec: int = 0  # EVALSHA time on the server, over every sample

    def p50_us(self) -> float:
        return quantile(self.samples, 0.5) / 1000

    def mean_us(self) -> float:
        return statistics.fmean(self.samples) / 1000

    def server_us(self) -> float:
        return self.server_usec / len(self.samples)


def cycle_turn(mutex: DMutex, key: str, n: int, fenced: bool) -> list[int]:
    samples = [0] * n
    clock = time.perf_counter_ns
    for i in range(n):
        start = clock()
        lock = mutex.acquire(key)
        if lock is None or not lock.release():
            raise BenchmarkError("uncontended acquire/release failed")
        samples[i] = clock() - start
        if (lock.fence is not None) != fenced:
            raise BenchmarkError(f"fence {lock.fence!r} with fencing={fenced or None}")
    return samples


def cycles(url: str, base: str, args: argparse.Namespace) -> list[Cycle]:
    client = redis.Redis.from_url(url, single_connection_client=True, socket_timeout=10)
    try:
        variants = [
            (Cycle("fencing=None (counter)"), DMutex(f"{base}-cycle", client), True),
            (Cycle("fencing=False"), DMutex(f"{base}-cycle", client, fencing=False), False),
        ]
        for _, mutex, fenced in variants:
            cycle_turn(mutex, "k", 200, fenced)  # warm-up: scripts cached, code paths hot
        done = 0
        while done < args.cycles:
            n = min(CYCLE_TURN, args.cycles - done)
            for figures, mutex, fenced in variants if done // CYCLE_TURN % 2 else variants[::-1]:
                gc.collect()
                before = server_stats(client)
                figures.samples.extend(cycle_turn(mutex, "k", n, fenced))
                figures.server_usec += (server_stats(client) - before).evalsha_usec
            done += n
    finally:
        client.close()
    return [figures for figures, _, _ in variants]


# --- the report -----------------------------------------------------------------------


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def table(head: list[str], rows: Iterable[list[str]]) -> Iterator[str]:
    yield "| " + " | ".join(head) + " |"
    yield "| --- | " + " | ".join("---:" for _ in head[1:]) + " |"
    for row in rows:
        yield "| " + " | ".join(row) + " |"


def hold_rows(runs: list[Hold]) -> Iterator[list[str]]:
    def row(name: str, cell: Callable[[Hold], str]) -> list[str]:
        return [name, *(cell(run) for run in runs)]

    def gaps(run: Hold) -> str:
        return " / ".join(fmt(quantile(run.gaps, q), ".2f") for q in (0.5, 0.99, 1.0))

    def tasks(run: Hold) -> str:
        if run.tasks_holding is None:
            return "-"
        return f"{run.tasks_before} / {run.tasks_holding} ({run.renewer_tasks} renewer)"

    yield row("leases (one instance)", lambda r: str(r.leases))
    yield row("acquire all, s", lambda r: fmt(r.acquire_s, ".2f"))
    yield row(
        "threads before / holding",
        lambda r: f"{r.threads_before} / {r.threads_holding} ({r.renewer_threads} renewer)",
    )
    yield row("tasks before / holding", tasks)
    yield row("other tasks seen", lambda r: ", ".join(sorted(r.other_tasks)) or "-")
    yield row("holding window, s", lambda r: fmt(r.window_s, ".2f"))
    yield row("renewals in window (client)", lambda r: str(r.renewals))
    yield row("EVALSHA in window (server)", lambda r: str(r.server.evalsha) if r.server else "-")
    yield row("renewals per second", lambda r: fmt(r.renewals / r.window_s, ".0f"))
    yield row("requests per interval", lambda r: fmt(r.per_interval, ".0f"))
    yield row("requests per interval / leases", lambda r: fmt(r.per_interval / r.leases, ".2f"))
    yield row("process CPU ms per 1,000 renewals", lambda r: fmt(r.per_thousand_ms(r.cpu_s)))
    yield row(
        "server CPU ms per 1,000 renewals",
        lambda r: fmt(r.per_thousand_ms(r.server.cpu_s) if r.server else None),
    )
    yield row(
        "server µs per request (EVALSHA)",
        lambda r: fmt(r.server.evalsha_usec / r.server.evalsha if r.server else None, ".2f"),
    )
    yield row("gap between renewals p50 / p99 / max, s", gaps)
    yield row("leases lost / released", lambda r: f"{r.lost} / {r.released}")
    yield row("renewer gone after last release, s", lambda r: fmt(r.renewer_gone_s, ".2f"))


def report(
    about: str, args: argparse.Namespace, runs: list[Hold], fence: FenceMemory, cyc: list[Cycle]
) -> None:
    low, high = args.ttl / 3 * 0.9, args.ttl / 3
    print(f"\n{about}\n")
    print(
        f"Renewal: {args.leases} leases, ttl {args.ttl:g} s (interval {low:.2f} .. {high:.2f} s, "
        f"nominal {runs[0].interval_s:.2f} s), held {args.hold:g} intervals\n"
    )
    head = ["", *(f"{run.face}, {run.backend}" for run in runs)]
    for line in table(head, hold_rows(runs)):
        print(line)

    print(f"\nFence counters (`{fence.prefix}fence:<key>`, no TTL; value `dmutex:fence:N`)\n")
    rows = [[str(length), str(counter), str(permit)] for length, counter, permit in fence.by_length]
    for line in table(["key length", "counter, bytes", "held permit key, bytes"], rows):
        print(line)
    per = fence.used_memory_delta / fence.counters if fence.counters else math.nan
    print(
        f"\n{fence.counters} counters (keys `c00000`..): used_memory +{fence.used_memory_delta} "
        f"bytes = {per:.1f} bytes per counter; keys added: {fence.keys_added}\n"
    )

    rows = [[c.name, fmt(c.p50_us()), fmt(c.mean_us()), fmt(c.server_us(), ".2f")] for c in cyc]
    head = ["acquire + release, one connection", "p50 µs", "mean µs", "server µs (EVALSHA)"]
    for line in table(head, rows):
        print(line)
    fenced, plain = cyc
    print(
        f"\nThe counter costs {fenced.p50_us() - plain.p50_us():+.1f} µs p50, "
        f"{fenced.mean_us() - plain.mean_us():+.1f} µs mean, "
        f"{fenced.server_us() - plain.server_us():+.2f} µs server time per cycle "
        f"({len(fenced.samples)} cycles each, interleaved in turns of {CYCLE_TURN})."
    )


def machine(client: redis.Redis) -> str:
    version = client.info("server")["redis_version"]
    return (
        f"Redis {version}, Python {platform.python_version()}, redis-py {redis.__version__}, "
        f"{os.cpu_count()} CPUs, {platform.platform()}"
    )


def cleanup(url: str, base: str) -> None:
    """With ``--url``: delete every key this run made (all under ``_dmutex_{base}``)."""
    with redis.Redis.from_url(url) as client:
        names = list(client.scan_iter(match=f"_dmutex_{base}*", count=1000))
        for i in range(0, len(names), 1000):
            client.unlink(*names[i : i + 1000])


def bench(url: str, args: argparse.Namespace) -> None:
    base = "bench" if args.url is None else f"bench-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    try:
        with redis.Redis.from_url(url) as client:
            about = machine(client)
            print(f"{about}; server at {shown(url)}", file=sys.stderr, flush=True)
        runs = sync_runs(url, base, args)
        runs += asyncio.run(async_runs(url, base, args))
        print("  fence counters", file=sys.stderr, flush=True)
        with redis.Redis.from_url(url, single_connection_client=True) as client:
            fence = fence_memory(client, base, args)
        print(f"  cycles: {args.cycles} each", file=sys.stderr, flush=True)
        cyc = cycles(url, base, args)
    finally:
        if args.url is not None:
            cleanup(url, base)
    report(about, args, runs, fence, cyc)
    print(f"\n(run took {time.monotonic() - started:.0f} s)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--url", help="use this Redis server instead of starting one")
    parser.add_argument(
        "--server", default="redis-server", help="redis-server binary to start (default: on PATH)"
    )
    parser.add_argument("--leases", type=int, default=10_000, help="leases held at once")
    parser.add_argument("--ttl", type=float, default=3.0, help="lease TTL in seconds")
    parser.add_argument(
        "--hold", type=float, default=4.0, help="holding window, in renewal intervals"
    )
    parser.add_argument("--counters", type=int, default=10_000, help="fence counters to make")
    parser.add_argument("--cycles", type=int, default=2000, help="cycles per fencing variant")
    args = parser.parse_args(argv)
    if min(args.leases, args.counters, args.cycles) < 1 or not (args.ttl > 0 and args.hold > 0):
        parser.error("--leases, --counters and --cycles must be >= 1, --ttl and --hold > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.url:
            bench(args.url, args)
        else:
            with private_server(args.server) as url:
                bench(url, args)
    except (BenchmarkError, redis.RedisError, OSError) as error:
        print(f"benchmark failed: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

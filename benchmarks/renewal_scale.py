"""What holding many auto-renewed leases costs, and what the fence counters cost.

Run from the repository root (a report, not a test; about 35 seconds a server,
80 with ``--ttl 10``)::

    .venv/bin/python benchmarks/renewal_scale.py
    .venv/bin/python benchmarks/renewal_scale.py --leases 2000 --ttl 3
    .venv/bin/python benchmarks/renewal_scale.py --quick --json out.json

With ``--url`` it works under its own random key prefixes and deletes its keys
at the end; the server's command counts then include other clients' commands.

1. Renewal: ``--leases`` leases taken by ONE face with ``acquire(f"k{i}",
   ttl=--ttl, auto_renew=True)``: ``DMutex`` on Redis (redis-py) and on
   ``InMemoryBackend``, then ``AsyncDMutex`` on ``redis.asyncio`` and on
   ``InMemoryBackend`` in one event loop; held for ``--hold`` renewal intervals
   (a third of the TTL less up to 10% jitter), then released. Reported:
   threads and tasks before and while holding (the benchmark's own task
   included), the renewals in the holding window (counted by a wrapper on
   the store's ``extend_many``, which timestamps each), the ``EVALSHA`` calls
   the server saw in it (``INFO commandstats``: renewals due together share
   one request, up to 256 leases), requests per nominal interval and per
   lease, the process's CPU time (``time.process_time``: every thread) and the
   server's (``INFO cpu``) per 1,000 renewals, the gap between successive
   renewals of one lease, leases lost, and when the renewer ended.
2. Fence counters: ``MEMORY USAGE`` of ``_dmutex_bench:fence:<key>`` for a few
   key lengths (beside that of a held permit key), and the ``used_memory``
   delta for ``--counters`` counters made by acquire + release (they persist).
3. The uncontended acquire + release on one connection with ``fencing=None``
   (the counter incremented in the acquire's script) against ``fencing=False``
   (no counter), interleaved in rounds (``harness.interleave``): client time
   and the server's ``EVALSHA`` time per cycle.

Options: ``--leases``, ``--ttl`` (s), ``--hold`` (renewal intervals),
``--counters``, ``--cycles`` (per fencing variant) and ``--rounds`` (of the
cycles); and the harness's ``--url``, ``--redis VERSION...``, ``--quick``,
``--json FILE``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import harness
import redis
import redis.asyncio
from harness import Batch, BenchmarkError

from dmutex import AsyncDMutex, AsyncDMutexLock, DMutex, DMutexLock, InMemoryBackend

RENEWER = "dmutex-renewer"
SAMPLE_EVERY_S = 0.25  # how often the holding phase counts threads and tasks
FENCE_KEY_LENGTHS = (1, 8, 32, 128)
OPTIONS = {  # name: (default, under --quick)
    "leases": (10_000, 1000), "ttl": (3.0, 1.5), "hold": (4.0, 2.0), "counters": (10_000, 1000),
    "cycles": (2000, 400), "rounds": (5, 2),
}  # fmt: skip
Counters = tuple[dict[str, tuple[int, int]], float]  # INFO commandstats, server CPU s


class _Keyed(Protocol):
    key: str


def count_renewals(face: DMutex | AsyncDMutex) -> list[tuple[float, str]]:
    """``(time.monotonic(), key)`` of every lease the face's store renews.

    Wraps the store's ``extend_many`` (the renewer's batches) on the instance,
    reached through dmutex's private ``_engine._store``; about 0.2 µs a lease.
    """
    store = face._engine._store
    inner: Callable[..., object] = store.extend_many
    stamps: list[tuple[float, str]] = []

    def extend_many(leases: Sequence[_Keyed]) -> object:
        at = time.monotonic()
        stamps.extend((at, lease.key) for lease in leases)
        return inner(leases)

    vars(store)["extend_many"] = extend_many  # an instance attribute shadows the method
    return stamps


def window_start(granted: Mapping[str, float], interval_s: float) -> float:
    """When to open the holding window: half an interval off the first lease's phase.

    Leases taken faster than one interval renew in near step, in passes about
    one interval apart; a window of whole intervals opened between two passes
    counts every lease's renewals once per interval, whereas one opened on a
    pass would count that pass once or twice depending on the jitter.
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
    threads: tuple[int, int, int] = (0, 0, 0)  # before, most while holding, renewers
    tasks: tuple[int, int, int] | None = None  # the same, async only
    other_tasks: set[str] = field(default_factory=set)  # coroutines of any other task seen
    renewals: int = 0  # in the holding window, counted by the wrapper
    cpu_s: float = 0.0  # this process, in the holding window
    evalsha: tuple[int, int] | None = None  # calls and usec in the window (Redis)
    server_cpu_s: float | None = None
    gaps: list[float] = field(default_factory=list)  # s between a lease's renewals
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
        done = self.evalsha[0] if self.evalsha is not None else self.renewals
        return done / (self.window_s / self.interval_s)

    def per_thousand_ms(self, seconds: float | None) -> float | None:
        return seconds / self.renewals * 1e6 if seconds is not None and self.renewals else None


def renewers() -> tuple[int, int]:
    """Dmutex's renewer threads, and tasks of the running loop."""
    threads = sum(1 for t in threading.enumerate() if t.name == RENEWER)
    return threads, sum(1 for t in asyncio.all_tasks() if t.get_name() == RENEWER)


async def hold(
    face: DMutex | AsyncDMutex,
    backend: str,
    server: Callable[[], Awaitable[Counters]] | None,
    args: argparse.Namespace,
) -> Hold:
    """Take ``--leases`` renewed leases with ``face``, hold them, release them.

    Runs in the event loop for both faces: a sync face's calls block it, and
    nothing else runs in it then.
    """
    is_async = isinstance(face, AsyncDMutex)
    result = Hold("async" if is_async else "sync", backend, args.leases, args.ttl)
    stamps = count_renewals(face)
    deadline = time.monotonic() + 30  # the last run's renewer and renewal worker, ending
    while (
        any(t.name.startswith("dmutex-") for t in threading.enumerate())
        and time.monotonic() < deadline
    ):
        await asyncio.sleep(0.05)
    before = (threading.active_count(), len(asyncio.all_tasks()))
    if any(renewers()):
        raise BenchmarkError("a renewer is already running")
    started, granted = time.monotonic(), {}
    handles: list[DMutexLock | AsyncDMutexLock] = []
    for i in range(args.leases):
        if isinstance(face, AsyncDMutex):
            handle: DMutexLock | AsyncDMutexLock | None = await face.acquire(
                f"k{i}", ttl=args.ttl, auto_renew=True
            )
        else:
            handle = face.acquire(f"k{i}", ttl=args.ttl, auto_renew=True)
        if handle is None:
            raise BenchmarkError(f"could not take k{i}: is the key space shared?")
        handles.append(handle)
        granted[f"k{i}"] = time.monotonic()
    result.acquire_s = time.monotonic() - started

    await asyncio.sleep(max(0.0, window_start(granted, result.interval_s) - time.monotonic()))
    counted = await server() if server else None
    cpu, start = time.process_time(), time.monotonic()
    end, most = start + args.hold * result.interval_s, [0, 0, 0, 0]
    this = asyncio.current_task()
    while (now := time.monotonic()) < end:
        tasks = asyncio.all_tasks()
        seen = (threading.active_count(), *renewers(), len(tasks))
        most = [max(a, b) for a, b in zip(most, seen, strict=True)]
        result.other_tasks.update(
            str(getattr(task.get_coro(), "__qualname__", "?"))
            for task in tasks
            if task is not this and task.get_name() != RENEWER
        )
        await asyncio.sleep(min(SAMPLE_EVERY_S, end - now))
    result.cpu_s, stop = time.process_time() - cpu, time.monotonic()
    result.window_s = stop - start
    if server and counted:
        stats, server_cpu = await server()
        calls, usec = stats.get("evalsha", (0, 0))
        old_calls, old_usec = counted[0].get("evalsha", (0, 0))
        result.evalsha, result.server_cpu_s = (
            (calls - old_calls, usec - old_usec),
            server_cpu - counted[1],
        )
    result.renewals = sum(1 for at, _ in stamps if start <= at < stop)
    result.threads = (before[0], most[0], most[1])
    result.tasks = (before[1], most[3], most[2]) if is_async else None

    result.lost = sum(handle.lost for handle in handles)
    for handle in handles:
        if isinstance(handle, AsyncDMutexLock):
            result.released += await handle.release()
        else:
            result.released += handle.release()
    last = dict(granted)
    for at, key in stamps:
        result.gaps.append(at - last[key])
        last[key] = at
    del handles
    released = time.monotonic()
    while any(renewers()) and time.monotonic() < released + max(args.ttl, 30):
        await asyncio.sleep(0.02)
    if not any(renewers()):
        result.renewer_gone_s = time.monotonic() - released
    gc.collect()  # the next run starts without this one's handles
    return result


async def holds(url: str, base: str, args: argparse.Namespace) -> list[Hold]:
    sync_client = redis.Redis.from_url(url, socket_timeout=10)
    async_client = redis.asyncio.Redis.from_url(url, socket_timeout=10)

    async def sync_counters() -> Counters:
        return harness.server_counters(sync_client)

    async def async_counters() -> Counters:
        stats, cpu = await async_client.info("commandstats"), await async_client.info("cpu")
        return harness.commandstats(stats), harness.cpu_seconds(cpu)

    ttl = args.ttl
    runs: list[tuple[str, DMutex | AsyncDMutex, Callable[[], Awaitable[Counters]] | None]] = [
        ("Redis", DMutex(f"{base}-sync", sync_client, default_ttl_seconds=ttl), sync_counters),
        (
            "InMemoryBackend",
            DMutex(f"{base}-sync", InMemoryBackend(), default_ttl_seconds=ttl),
            None,
        ),
        (
            "Redis",
            AsyncDMutex(f"{base}-async", async_client, default_ttl_seconds=ttl),
            async_counters,
        ),
        (
            "InMemoryBackend",
            AsyncDMutex(f"{base}-async", InMemoryBackend(), default_ttl_seconds=ttl),
            None,
        ),
    ]
    found = []
    try:
        for backend, face, server in runs:
            harness.progress(f"{type(face).__name__}, {backend}: {args.leases} leases")
            found.append(await hold(face, backend, server, args))
    finally:
        sync_client.close()
        await async_client.aclose()
    return found


def fence_memory(client: redis.Redis, base: str, args: argparse.Namespace) -> dict[str, object]:
    """``MEMORY USAGE`` of counters and permit keys by key length; ``used_memory`` per counter."""
    mutex, prefix = DMutex(base, client), f"_dmutex_{base}:"
    by_length = []
    for length in FENCE_KEY_LENGTHS:
        key = "x" * length
        lock = mutex.acquire(key)
        if lock is None or lock.fence is None:
            raise BenchmarkError(f"no fenced grant for a {length}-character key")
        permit = client.memory_usage(f"{prefix}permit:0:{key}", samples=0)
        lock.release()
        by_length.append([length, client.memory_usage(f"{prefix}fence:{key}", samples=0), permit])
    keys, used = client.dbsize(), int(client.info("memory")["used_memory"])
    for i in range(args.counters):
        lock = mutex.acquire(f"c{i:05d}")
        if lock is None or not lock.release():
            raise BenchmarkError("uncontended acquire/release failed")
    delta = int(client.info("memory")["used_memory"]) - used
    harness.table(
        ["key length", "counter, bytes", "held permit key, bytes"],
        by_length,
        f"Fence counters (`{prefix}fence:<key>`, no TTL):",
    )
    print(
        f"\n{args.counters} counters (keys `c00000`..): used_memory +{delta} bytes = "
        f"{delta / args.counters:.1f} bytes per counter; keys added: {client.dbsize() - keys}"
    )
    return {"by_length": by_length, "counters": args.counters, "used_memory_delta": delta}


def cycles(url: str, base: str, args: argparse.Namespace) -> dict[str, object]:
    """The cycle with and without the fence counter, interleaved; the server's EVALSHA time."""
    client = redis.Redis.from_url(url, single_connection_client=True, socket_timeout=10)
    usec = {"fencing=None (counter)": 0, "fencing=False": 0}

    def cycle(name: str, mutex: DMutex, fenced: bool) -> Batch:
        def run(n: int) -> list[int]:
            samples, clock = [0] * n, time.perf_counter_ns
            before = harness.server_counters(client)[0].get("evalsha", (0, 0))[1]
            for i in range(n):
                start = clock()
                lock = mutex.acquire("k")
                if lock is None or not lock.release():
                    raise BenchmarkError("uncontended acquire/release failed")
                samples[i] = clock() - start
                if (lock.fence is not None) != fenced:
                    raise BenchmarkError(f"fence {lock.fence!r} with fencing={fenced or None}")
            usec[name] += harness.server_counters(client)[0].get("evalsha", (0, 0))[1] - before
            return samples

        return run

    try:
        fenced, plain = list(usec)
        contenders = {
            fenced: cycle(fenced, DMutex(f"{base}-cycle", client), True),
            plain: cycle(plain, DMutex(f"{base}-cycle", client, fencing=False), False),
        }
        per_round = max(1, args.cycles // args.rounds)
        figures = harness.interleave(
            contenders, rounds=args.rounds, per_round=per_round, turn=100, warmup=200
        )
    finally:
        client.close()
    n = {name: len(fig.samples) for name, fig in figures.items()}
    rows = [
        [name, fig.us("p50"), fig.us("mean"), usec[name] / n[name]] for name, fig in figures.items()
    ]
    harness.table(
        ["acquire + release, one connection", "p50 µs", "mean µs", "server µs (EVALSHA)"], rows
    )
    ratios = harness.ratio_table(figures, [(fenced, plain)])
    return {"figures": figures, "ratios": ratios, "server_usec": usec}


def report(args: argparse.Namespace, runs: list[Hold]) -> None:
    low, high = args.ttl / 3 * 0.9, args.ttl / 3
    title = (
        f"Renewal: {args.leases} leases, ttl {args.ttl:g} s (interval {low:.2f} .. {high:.2f} s, "
        f"nominal {runs[0].interval_s:.2f} s), held {args.hold:g} intervals"
    )

    def rate(r: Hold) -> float | None:
        return r.evalsha[1] / r.evalsha[0] if r.evalsha and r.evalsha[0] else None

    rows: list[tuple[str, Callable[[Hold], object]]] = [
        ("acquire all, s", lambda r: r.acquire_s),
        ("threads before / holding (renewers)", lambda r: "{} / {} ({})".format(*r.threads)),
        (
            "tasks before / holding (renewers)",
            lambda r: "{} / {} ({})".format(*r.tasks) if r.tasks else "-",
        ),
        ("other tasks seen", lambda r: ", ".join(sorted(r.other_tasks)) or "-"),
        ("holding window, s", lambda r: r.window_s),
        ("renewals in window (client)", lambda r: r.renewals),
        ("EVALSHA in window (server)", lambda r: r.evalsha[0] if r.evalsha else None),
        ("renewals per second", lambda r: r.renewals / r.window_s),
        ("requests per interval", lambda r: r.per_interval),
        ("requests per interval / leases", lambda r: r.per_interval / r.leases),
        ("process CPU ms per 1,000 renewals", lambda r: r.per_thousand_ms(r.cpu_s)),
        ("server CPU ms per 1,000 renewals", lambda r: r.per_thousand_ms(r.server_cpu_s)),
        ("server µs per request (EVALSHA)", rate),
        (
            "gap between renewals p50 / p99 / max, s",
            lambda r: " / ".join(f"{harness.quantile(r.gaps, q):.2f}" for q in (0.5, 0.99, 1.0)),
        ),
        ("leases lost / released", lambda r: f"{r.lost} / {r.released}"),
        ("renewer gone after last release, s", lambda r: r.renewer_gone_s),
    ]
    head = ["", *(f"{r.face}, {r.backend}" for r in runs)]
    harness.table(head, [[name, *(cell(r) for r in runs)] for name, cell in rows], title)


def bench(url: str, args: argparse.Namespace) -> dict[str, object]:
    base = "bench" if args.url is None else f"bench-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    try:
        runs = asyncio.run(holds(url, base, args))
        report(args, runs)
        harness.progress("fence counters")
        with redis.Redis.from_url(url, single_connection_client=True) as client:
            fence = fence_memory(client, base, args)
        harness.progress(f"cycles: {args.cycles} each")
        cycle = cycles(url, base, args)
    finally:
        if args.url is not None:
            harness.delete_keys(url, f"_dmutex_{base}*")
    print(f"\n(run took {time.monotonic() - started:.0f} s)")
    return {"renewal": runs, "fence_memory": fence, "cycle": cycle}


def run(argv: Sequence[str] | None = None) -> int:
    return harness.main(bench, harness.parse(__doc__, argv, OPTIONS))


if __name__ == "__main__":
    sys.exit(run())

"""Several OS processes hammering one lock key on a real Redis server (the newest found).

What the scripts do on each version is the contract suite's and the state
machine's; what processes add (spawned clients, the host's scheduling) does
not depend on the version, so these run on one.

Each worker is a separate process started with ``spawn``; it builds its own
client and its own dmutex instance, waits on a barrier so that all of them
start together, runs its cycles and reports a :class:`Report` (or the
traceback of what it raised) through a queue. The parent bounds everything:
a worker that has not reported by the deadline is terminated and the test
fails.

Each cycle first tries one plain ``acquire()``; when that is refused the
worker counts it and falls back to ``acquire_with_retry()``. The refusal
count shows that the processes really contended for the key.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeAlias

import pytest
import redis
import redis.asyncio

from dmutex import AsyncDMutex, AsyncDMutexLock, DMutex, DMutexLock, DSemaphore, DSemaphorePermit
from tests._support import processes
from tests._support.processes import BARRIER_TIMEOUT, DEADLINE, Report, Tally
from tests._support.redis_servers import Pool, Server, flushed, newest

LOCK_KEY = "orders"
COUNTER = "test:counter"
GAUGE = "test:gauge"
SCRATCH = "test:scratch"
MUTEX_SERVICE = "procs"
SEMAPHORE_SERVICE = "procs"
MUTEX_SLOT_KEY = f"_dmutex_{MUTEX_SERVICE}:permit:0:{LOCK_KEY}"

TTL = 10.0  # far longer than any test: no lease may expire while held
RETRY_TIMEOUT = 30.0
RETRY_DELAY = 0.001
RETRY = processes.Retry(TTL, RETRY_TIMEOUT, RETRY_DELAY)

PROCESSES = 4
CYCLES = 500
SEM_PROCESSES = 6
SEM_PERMITS = 3


Reports: TypeAlias = processes.Reports
Barrier: TypeAlias = processes.Barrier


def _as_str(value: object) -> str | None:
    return value.decode() if isinstance(value, bytes) else None if value is None else str(value)


# --- workers (module level: spawn imports this module to find them) ---------------------


def mutex_counter_worker(
    worker: int,
    reports: Reports,
    barrier: Barrier,
    url: str,
    cycles: int,
    retry_delay: float = RETRY_DELAY,
) -> None:
    """``cycles`` times: lock, GET the counter, SET it to one more, unlock."""

    def body(tally: Tally) -> None:
        client = redis.Redis.from_url(url)
        try:
            mutex = DMutex(MUTEX_SERVICE, client)
            client.ping()
            barrier.wait(BARRIER_TIMEOUT)

            def work(lock: DMutexLock) -> None:
                if _as_str(client.get(MUTEX_SLOT_KEY)) != lock.token:
                    tally.foreign += 1
                value = client.get(COUNTER)
                client.set(COUNTER, int(value or 0) + 1)

            retry = processes.Retry(TTL, RETRY_TIMEOUT, retry_delay)
            processes.cycle(mutex, LOCK_KEY, tally, cycles, work, retry)
        finally:
            client.close()

    processes.report_errors(worker, reports, barrier, Tally(worker), body)


def semaphore_gauge_worker(
    worker: int, reports: Reports, barrier: Barrier, url: str, cycles: int, permits: int
) -> None:
    """``cycles`` times: take a permit, INCR the gauge, work, DECR it, release."""

    def body(tally: Tally) -> None:
        client = redis.Redis.from_url(url)
        try:
            sem = DSemaphore(SEMAPHORE_SERVICE, client, max_permits=permits)
            client.ping()
            barrier.wait(BARRIER_TIMEOUT)

            def work(permit: DSemaphorePermit) -> None:
                tally.slots.add(permit.slot)
                now = int(client.incr(GAUGE))
                tally.peak = max(tally.peak, now)
                slot_key = f"_dsemaphore_{SEMAPHORE_SERVICE}:permit:{permit.slot}:{LOCK_KEY}"
                if _as_str(client.get(slot_key)) != permit.token:
                    tally.foreign += 1
                client.get(SCRATCH)  # a little work while holding the permit
                client.decr(GAUGE)

            processes.cycle(sem, LOCK_KEY, tally, cycles, work, RETRY)
        finally:
            client.close()

    processes.report_errors(worker, reports, barrier, Tally(worker), body)


def async_mutex_counter_worker(
    worker: int, reports: Reports, barrier: Barrier, url: str, cycles: int
) -> None:
    """The counter worker with the asyncio face, in its own event loop."""

    async def main(tally: Tally) -> None:
        client = redis.asyncio.Redis.from_url(url)
        try:
            mutex = AsyncDMutex(MUTEX_SERVICE, client)
            await client.ping()
            # Blocking here is fine: nothing else runs on this loop yet.
            barrier.wait(BARRIER_TIMEOUT)

            async def work(lock: AsyncDMutexLock) -> None:
                if _as_str(await client.get(MUTEX_SLOT_KEY)) != lock.token:
                    tally.foreign += 1
                value = await client.get(COUNTER)
                await client.set(COUNTER, int(value or 0) + 1)

            await processes.cycle_async(mutex, LOCK_KEY, tally, cycles, work, RETRY)
        finally:
            await client.aclose()

    processes.report_errors(
        worker, reports, barrier, Tally(worker), lambda tally: asyncio.run(main(tally))
    )


# --- the parent side --------------------------------------------------------------------


def run_workers(target: Callable[..., None], count: int, *args: object) -> list[Report]:
    """Start ``count`` processes of ``target`` together; their reports, or a failed test."""
    return processes.run_workers(target, count, *args, deadline=DEADLINE, report=Report)


def _print_figures(name: str, server: Server, started: float, reports: list[Report]) -> None:
    elapsed = time.monotonic() - started
    refused = [r.refused for r in reports]
    peak = max(r.peak for r in reports)
    # Shown with -s; the brief asks for these figures, no assertion uses them.
    print(f"\n{name} on {server.label}: {elapsed:.2f} s, refused per worker {refused}", end="")
    print(f", peak gauge {peak}" if peak else "")


# --- the tests --------------------------------------------------------------------------


def _check_counter(reports: list[Report], client: redis.Redis, workers: int) -> None:
    processes.check_cycles(reports, workers, CYCLES)
    assert sum(r.foreign for r in reports) == 0, "a holder found another token in the lock key"
    # Read-modify-write with GET and SET loses updates unless the lock excludes.
    assert int(client.get(COUNTER) or 0) == workers * CYCLES
    assert sum(r.refused for r in reports) > 0, "the workers never contended"
    assert client.exists(MUTEX_SLOT_KEY) == 0, "the lock key outlived its last release"


@pytest.mark.parametrize(
    "worker", [mutex_counter_worker, async_mutex_counter_worker], ids=["sync", "async"]
)
def test_mutex_serializes_read_modify_write_across_processes(
    redis_pool: Pool, worker: Callable[..., None]
) -> None:
    """On the newest server: what processes add is the host's, not the version's."""
    redis_server = newest(redis_pool)
    redis_url = flushed(redis_server.url)
    started = time.monotonic()
    reports = run_workers(worker, PROCESSES, redis_url, CYCLES)
    _print_figures(f"mutex counter ({worker.__name__})", redis_server, started, reports)
    with redis.Redis.from_url(redis_url) as client:
        _check_counter(reports, client, PROCESSES)


def test_semaphore_bounds_concurrency_across_processes(redis_pool: Pool) -> None:
    """On the newest server, as the mutex's."""
    redis_server = newest(redis_pool)
    redis_url = flushed(redis_server.url)
    started = time.monotonic()
    reports = run_workers(semaphore_gauge_worker, SEM_PROCESSES, redis_url, CYCLES, SEM_PERMITS)
    _print_figures("semaphore gauge", redis_server, started, reports)
    processes.check_cycles(reports, SEM_PROCESSES, CYCLES)
    assert sum(r.foreign for r in reports) == 0, "a holder found another token in its slot key"
    peak = max(r.peak for r in reports)
    assert peak <= SEM_PERMITS, f"{peak} holders at once with {SEM_PERMITS} permits"
    assert peak == SEM_PERMITS, "the permits were never all in use at once"
    slots = {s for r in reports for s in r.slots}
    assert slots <= set(range(SEM_PERMITS))
    assert sum(r.refused for r in reports) > 0, "the workers never contended"
    with redis.Redis.from_url(redis_url) as client:
        assert int(client.get(GAUGE) or 0) == 0
        leftovers = client.keys(f"_dsemaphore_{SEMAPHORE_SERVICE}:permit:*")
        assert leftovers == [], "slot keys outlived their last release"


# --- waiters woken by the release (issue 12) ----------------------------------------------

WAKE_PROCESSES = 8
WAKE_CYCLES = 1000
DEFAULT_RETRY_DELAY = 0.1  # acquire_with_retry's default


def mutex_wakeup_worker(
    worker: int, reports: Reports, barrier: Barrier, url: str, cycles: int
) -> None:
    """The counter worker, waiting with the default ``retry_delay`` (0.1 s).

    A refused worker registers and blocks (BLPOP); each release wakes one.
    Measured on a 2-core machine: with the wake-up, about 80% of the plain
    attempts are refused and each refusal waits for a signal; with polling
    alone the releasing worker re-acquires at once and the others mostly
    sleep, so the lock changes hands far less often (not more slowly).
    """
    mutex_counter_worker(worker, reports, barrier, url, cycles, retry_delay=DEFAULT_RETRY_DELAY)


def _calls(client: redis.Redis, *commands: str) -> dict[str, int]:
    """``INFO commandstats`` call counts (Lua's ``redis.call`` counts too)."""
    stats: dict[str, Any] = client.info("commandstats")
    return {c: int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in commands}


def test_woken_waiters_serialize_read_modify_write_across_8_processes(redis_pool: Pool) -> None:
    """8 processes x 1000 cycles on the newest server; refused waiters block and are woken."""
    server = newest(redis_pool)
    with redis.Redis.from_url(server.url) as client:
        client.flushdb()
        before = _calls(client, "blpop", "lpush")
        started = time.monotonic()
        reports = processes.run_workers(
            mutex_wakeup_worker,
            WAKE_PROCESSES,
            server.url,
            WAKE_CYCLES,
            deadline=DEADLINE,
            report=Report,
        )
        elapsed = time.monotonic() - started
        after = _calls(client, "blpop", "lpush")
        blpops = after["blpop"] - before["blpop"]
        signals = after["lpush"] - before["lpush"]
        refused = [r.refused for r in reports]
        # Shown with -s; the brief asks for these figures, no assertion uses them.
        print(
            f"\nwoken mutex counter on {server.label}: {WAKE_PROCESSES} x {WAKE_CYCLES} cycles "
            f"in {elapsed:.2f} s, refused per worker {refused}, {blpops} BLPOP, "
            f"{signals} signals pushed"
        )
        processes.check_cycles(reports, WAKE_PROCESSES, WAKE_CYCLES)
        assert sum(r.foreign for r in reports) == 0, "a holder found another token in the lock key"
        # Read-modify-write with GET and SET loses updates unless the lock excludes.
        assert int(client.get(COUNTER) or 0) == WAKE_PROCESSES * WAKE_CYCLES
        assert sum(refused) > 0, "the workers never contended"
        assert blpops > 0, "refused waiters blocked on the server"
        assert signals > 0, "releases woke them"
        assert client.exists(MUTEX_SLOT_KEY) == 0, "the lock key outlived its last release"

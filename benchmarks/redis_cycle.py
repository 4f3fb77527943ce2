"""How close dmutex's Redis lock cycle comes to the two-request limit.

Run from the repository root (a report, not a test; about 20 seconds a server)::

    .venv/bin/python benchmarks/redis_cycle.py
    .venv/bin/python benchmarks/redis_cycle.py --cycles 4000 --rounds 7 --json out.json
    .venv/bin/python benchmarks/redis_cycle.py --redis 7.0 --quick
    .venv/bin/python benchmarks/redis_cycle.py --url redis://127.0.0.1:6379/0

With ``--url`` it works under its own random names and deletes its keys at the
end. Everything runs on ONE connection (``single_connection_client=True``), so each
figure is request latency plus client-side Python work. After a warm-up, each
round runs every contender ``--cycles`` times, interleaved in turns of
``--chunk`` cycles (``harness.interleave``), timed with ``time.perf_counter_ns``:

- ``dmutex``: ``DMutex.acquire(key)`` then ``lock.release()``;
- ``redis-py``: ``client.lock(name, timeout=ttl)``, ``acquire(blocking=False)``,
  ``release()`` (a new ``Lock`` per cycle, as in ``with client.lock(...)``);
- ``raw``: ``SET key token PX ttl NX`` then ``EVALSHA`` of a compare-and-delete
  script, a fresh ``str(uuid.uuid4())`` token per cycle, through
  ``client.execute_command``: the two requests any token lock needs;
- ``sem-64`` / ``sem-1``: only the ``acquire()`` of a ``DSemaphore`` with
  ``max_permits=64`` and 63 permits already held / with ``max_permits=1``;
  the release is not timed;
- ``dmutex-async`` / ``raw-async``: ``AsyncDMutex`` acquire + release, and the
  raw cycle's two requests, on one ``redis.asyncio`` connection; each turn
  runs by ``run_until_complete`` on one event loop, outside the timed region.

Options: ``--cycles`` per contender per round, ``--rounds``, ``--chunk``
(cycles per turn), ``--warmup`` (cycles per contender), ``--ttl`` (s); with
the harness's ``--url``, ``--redis VERSION...``, ``--quick``, ``--json FILE``.

Targets (issue 10): dmutex >= 0.95x raw ops/s and >= 1.0x redis-py Lock ops/s
(medians of the per-round ratios), sem-64 <= 1.3x sem-1 acquire time (p50 and
mean of all samples).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import harness
import redis
import redis.asyncio
from harness import Batch, BenchmarkError, Figures, Target

from dmutex import AsyncDMutex, DMutex, DSemaphore, DSemaphorePermit

# Compare-and-delete, as every token lock releases: one atomic script.
RAW_RELEASE = """\
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
HOLDER_TTL_S = 3600.0  # the 63 permits held during the whole run
OPTIONS = {  # name: (default, under --quick)
    "cycles": (2000, 500), "rounds": (5, 2), "chunk": (100, 100), "warmup": (500, 100),
    "ttl": (30.0, 30.0),
}  # fmt: skip


def timed(operation: Callable[[], object]) -> Batch:
    """A batch of ``operation``, each call timed; it raises when the call fails."""

    def run(n: int) -> list[int]:
        samples = [0] * n
        clock = time.perf_counter_ns
        for i in range(n):
            start = clock()
            operation()
            samples[i] = clock() - start
        return samples

    return run


def timed_async(
    loop: asyncio.AbstractEventLoop, operation: Callable[[], Awaitable[object]]
) -> Batch:
    """:func:`timed` for a coroutine function, each batch run to completion on ``loop``."""

    async def run(n: int) -> list[int]:
        samples = [0] * n
        clock = time.perf_counter_ns
        for i in range(n):
            start = clock()
            await operation()
            samples[i] = clock() - start
        return samples

    return lambda n: loop.run_until_complete(run(n))


@dataclass(frozen=True)
class Connections:
    """One connection of each face, and the event loop the asyncio one runs on."""

    client: redis.Redis
    aclient: redis.asyncio.Redis
    loop: asyncio.AbstractEventLoop


@contextmanager
def connections(url: str) -> Iterator[Connections]:
    """One connection of each face to ``url`` (``single_connection_client``), a new loop."""
    loop = asyncio.new_event_loop()
    aclient = redis.asyncio.Redis.from_url(url, single_connection_client=True)
    try:
        with redis.Redis.from_url(url, single_connection_client=True) as client:
            yield Connections(client, aclient, loop)
    finally:
        loop.run_until_complete(aclient.aclose())
        loop.close()


def interleaved(contenders: Mapping[str, Batch], args: argparse.Namespace) -> dict[str, Figures]:
    """``harness.interleave`` by the options --rounds, --cycles, --chunk and --warmup."""
    return harness.interleave(
        contenders,
        rounds=args.rounds,
        per_round=args.cycles,
        turn=args.chunk,
        warmup=args.warmup,
    )


def cycles(faces: Connections, run_id: str, ttl_s: float) -> dict[str, Batch]:
    """The contenders on ``faces``; the 63 held permits are left to the caller."""
    client = faces.client
    sem64 = DSemaphore(f"bench64-{run_id}", client, max_permits=64, default_ttl_seconds=ttl_s)
    sem1 = DSemaphore(f"bench1-{run_id}", client, max_permits=1, default_ttl_seconds=ttl_s)
    held = [sem64.acquire("k", ttl=HOLDER_TTL_S) for _ in range(63)]
    if None in held:
        raise BenchmarkError("could not take the 63 held semaphore permits")

    def acquire(sem: DSemaphore, slot: int) -> Batch:
        def run(n: int) -> list[int]:
            samples, clock = [0] * n, time.perf_counter_ns
            for i in range(n):
                start = clock()
                permit: DSemaphorePermit | None = sem.acquire("k")
                samples[i] = clock() - start
                if permit is None or permit.slot != slot or not permit.release():
                    raise BenchmarkError(f"semaphore: acquire did not get the free slot {slot}")
            return samples

        return run

    mutexes = mutex_cycles(faces, run_id, ttl_s)
    order = ("dmutex", "redis-py", "raw", "sem-64", "sem-1", "dmutex-async", "raw-async")
    found = mutexes | {"sem-64": acquire(sem64, 63), "sem-1": acquire(sem1, 0)}
    return {name: found[name] for name in order}


def mutex_cycles(faces: Connections, run_id: str, ttl_s: float) -> dict[str, Batch]:
    """The lock cycles: ``dmutex``, ``redis-py``, ``raw``, ``dmutex-async``, ``raw-async``."""
    client, aclient, loop = faces.client, faces.aclient, faces.loop
    mutex = DMutex(f"bench-{run_id}", client, default_ttl_seconds=ttl_s)
    sha = str(client.script_load(RAW_RELEASE))
    # redis-py leaves execute_command unannotated; its reply is any RESP value.
    execute: Callable[..., object] = client.execute_command
    raw_key, name = f"_raw_bench-{run_id}:permit:0:k", f"_redispy_bench-{run_id}:k"
    ttl_ms = math.ceil(ttl_s * 1000)

    def dmutex() -> None:
        lock = mutex.acquire("k")
        if lock is None or not lock.release():
            raise BenchmarkError("dmutex: uncontended acquire/release failed")

    def redis_py() -> None:
        lock = client.lock(name, timeout=ttl_s)
        if not lock.acquire(blocking=False):
            raise BenchmarkError("redis-py Lock: uncontended acquire failed")
        lock.release()  # raises LockNotOwnedError if it was not ours

    def raw() -> None:
        token = str(uuid.uuid4())
        taken = execute("SET", raw_key, token, "PX", ttl_ms, "NX")
        if not taken or execute("EVALSHA", sha, 1, raw_key, token) != 1:
            raise BenchmarkError("raw: uncontended SET NX / compare-and-delete failed")

    amutex = AsyncDMutex(f"bench-async-{run_id}", aclient, default_ttl_seconds=ttl_s)
    aexecute: Callable[..., Awaitable[object]] = aclient.execute_command

    async def dmutex_async() -> None:
        lock = await amutex.acquire("k")
        if lock is None or not await lock.release():
            raise BenchmarkError("AsyncDMutex: uncontended acquire/release failed")

    async def raw_async() -> None:
        token = str(uuid.uuid4())
        taken = await aexecute("SET", raw_key, token, "PX", ttl_ms, "NX")
        if not taken or await aexecute("EVALSHA", sha, 1, raw_key, token) != 1:
            raise BenchmarkError("raw-async: uncontended SET NX / compare-and-delete failed")

    return {
        "dmutex": timed(dmutex),
        "redis-py": timed(redis_py),
        "raw": timed(raw),
        "dmutex-async": timed_async(loop, dmutex_async),
        "raw-async": timed_async(loop, raw_async),
    }


def bench(url: str, args: argparse.Namespace) -> dict[str, object]:
    """Measure every contender on ``url``; print and return the figures."""
    print(
        f"{args.rounds} rounds x {args.cycles} cycles in turns of {args.chunk}, after "
        f"{args.warmup} warm-up cycles, one connection",
        flush=True,
    )
    run_id = uuid.uuid4().hex[:8]
    try:
        with connections(url) as faces:
            figures = interleaved(cycles(faces, run_id, args.ttl), args)
    finally:
        harness.delete_keys(url, f"*{run_id}*")  # the held permits, the fence counters
    harness.figures_table(figures, "sem-64, sem-1: acquire alone; the others: acquire + release")
    pairs = [("dmutex", "raw"), ("redis-py", "raw"), ("dmutex", "redis-py"), ("sem-64", "sem-1")]
    pairs.append(("dmutex-async", "raw-async"))
    ratios = harness.ratio_table(figures, pairs, ("ops/s", "p50", "mean"))
    targets = [
        Target("DMutex / raw (ops/s)", ratios["dmutex / raw, ops/s"].median, 0.95, True),
        Target(
            "DMutex / redis-py Lock (ops/s)", ratios["dmutex / redis-py, ops/s"].median, 1.0, True
        ),
        Target("N=64 / N=1 acquire (p50)", ratios["sem-64 / sem-1, p50"].pooled, 1.3, False),
        Target("N=64 / N=1 acquire (mean)", ratios["sem-64 / sem-1, mean"].pooled, 1.3, False),
    ]
    harness.targets_table(targets)
    return {"figures": figures, "ratios": ratios, "targets": targets}


def run(argv: Sequence[str] | None = None) -> int:
    return harness.main(bench, harness.parse(__doc__, argv, OPTIONS))


if __name__ == "__main__":
    sys.exit(run())

"""What a lock costs on SQLiteBackend: one process's cycle, and many processes contending.

Run from the repository root (a report, not a test; about 30 seconds)::

    .venv/bin/python benchmarks/sqlite_cycle.py
    .venv/bin/python benchmarks/sqlite_cycle.py --cycles 2000 --procs 4 --dir /mnt/disk

- One process: ``acquire`` + ``release`` of one key, per cycle, for a mutex
  with and without fencing, a 64-permit semaphore with 63 held, and the
  asyncio face; with ``synchronous=FULL`` (dmutex's setting) and, for
  comparison only, ``NORMAL`` set on the backend's connection (a database
  file each). The eight contenders run interleaved (``harness.interleave``).
- ``--procs`` processes: each runs ``--cycles`` cycles of one key with
  ``acquire_with_retry`` (``retry_delay=0.005``), started together on a barrier;
  cycles per second from the barrier to the last finish, and with start-up.

Options: ``--cycles`` (per contender, and per contending process),
``--rounds`` (the one-process cycles split among them), ``--procs``,
``--dir``; and the harness's ``--quick`` and ``--json FILE``.

The database files live in a new temporary directory in ``--dir`` (default:
the system's) and are removed afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import harness
from harness import Batch, BenchmarkError

from dmutex import AsyncDMutex, DMutex, DSemaphore, SQLiteBackend

OPTIONS = {"cycles": (1000, 200), "rounds": (5, 2), "procs": (8, 2), "dir": ("", "")}
FENCED, PLAIN = "DMutex, fencing on", "DMutex, fencing=False"
SEMAPHORE, ASYNC = "DSemaphore(64), 63 held", "AsyncDMutex"


def contenders(path: Path, synchronous: str, loop: asyncio.AbstractEventLoop) -> dict[str, Batch]:
    """The four cycles on one database file, ``synchronous`` set on the backend's connection."""
    backend = SQLiteBackend(str(path))
    backend.call(lambda conn: conn.execute(f"PRAGMA synchronous={synchronous}"))
    semaphore = DSemaphore("bench", backend, max_permits=64)
    if None in [semaphore.acquire("pool", 3600) for _ in range(63)]:
        raise BenchmarkError("could not take the 63 held permits")
    clock = time.perf_counter_ns

    def cycles(face: DMutex | DSemaphore, key: str) -> Batch:
        def run(n: int) -> list[int]:
            samples = [0] * n
            for i in range(n):
                start = clock()
                lock = face.acquire(key, 30)
                if lock is None or not lock.release():
                    raise BenchmarkError(f"{key}: uncontended acquire/release failed")
                samples[i] = clock() - start
            return samples

        return run

    mutex = AsyncDMutex("bench", backend)

    async def async_cycles(n: int) -> list[int]:
        samples = [0] * n
        for i in range(n):
            start = clock()
            lock = await mutex.acquire("job", 30)
            if lock is None or not await lock.release():
                raise BenchmarkError("AsyncDMutex: uncontended acquire/release failed")
            samples[i] = clock() - start
        return samples

    return {
        f"{FENCED}, {synchronous}": cycles(DMutex("bench", backend), "job"),
        f"{PLAIN}, {synchronous}": cycles(DMutex("bench", backend, fencing=False), "job"),
        f"{SEMAPHORE}, {synchronous}": cycles(semaphore, "pool"),
        f"{ASYNC}, {synchronous}": lambda n: loop.run_until_complete(async_cycles(n)),
    }


def contend(path: str, cycles: int, barrier: Any, results: Any) -> None:
    def work() -> tuple[float, float]:
        mutex = DMutex("bench", SQLiteBackend(path))
        barrier.wait(60)
        start = time.perf_counter()
        for _ in range(cycles):
            lock = mutex.acquire_with_retry("contended", ttl=30, timeout=60, retry_delay=0.005)
            if lock is None or not lock.release():
                raise BenchmarkError("a contended acquire timed out, or its lease was lost")
        return start, time.perf_counter()

    harness.answer(results, work)


def bench(_: str, args: argparse.Namespace) -> dict[str, object]:
    folder = Path(tempfile.mkdtemp(dir=args.dir or None))
    loop = asyncio.new_event_loop()
    try:
        found: dict[str, Batch] = {}
        for synchronous in ("FULL", "NORMAL"):
            found |= contenders(folder / f"one-{synchronous}.sqlite3", synchronous, loop)
        per_round = max(1, args.cycles // args.rounds)
        figures = harness.interleave(
            found, rounds=args.rounds, per_round=per_round, turn=100, warmup=20
        )
        harness.figures_table(figures, "One process, acquire + release of one key:")
        pairs = [(f"{name}, NORMAL", f"{name}, FULL") for name in (FENCED, PLAIN, SEMAPHORE, ASYNC)]
        pairs += [(f"{name}, FULL", f"{FENCED}, FULL") for name in (PLAIN, SEMAPHORE, ASYNC)]
        ratios = harness.ratio_table(figures, pairs)

        path = str(folder / "many.sqlite3")
        started = time.perf_counter()
        barrier = multiprocessing.get_context("spawn").Barrier(args.procs)
        with harness.workers(contend, [(path, args.cycles, barrier)] * args.procs) as collect:
            spans = collect()
        total = args.procs * args.cycles
        wall, with_start = (
            max(e for _, e in spans) - min(s for s, _ in spans),
            time.perf_counter() - started,
        )
        print(
            f"\nContended (synchronous=FULL): {args.procs} processes x {args.cycles} cycles: "
            f"{total / wall:.0f} cycles/s ({wall:.2f} s from the barrier; {total / with_start:.0f} "
            f"cycles/s, {with_start:.1f} s, with start-up)"
        )
    finally:
        loop.close()
        shutil.rmtree(folder)
    contended = {
        "processes": args.procs,
        "cycles": args.cycles,
        "wall_s": wall,
        "with_start_up_s": with_start,
    }
    return {"figures": figures, "ratios": ratios, "contended": contended}


def run(argv: Sequence[str] | None = None) -> int:
    return harness.main(bench, harness.parse(__doc__, argv, OPTIONS, redis=False))


if __name__ == "__main__":
    sys.exit(run())

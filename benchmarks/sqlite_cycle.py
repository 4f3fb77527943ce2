"""What a lock costs on SQLiteBackend: one process's cycle, and many processes contending.

Usage: ``.venv/bin/python benchmarks/sqlite_cycle.py [--cycles N] [--procs P] [--dir DIR]``.

- One process: ``acquire`` + ``release`` of one key, p50/p99 per cycle, for
  a mutex with and without fencing, a 64-permit semaphore with 63 held, and
  the asyncio face; with ``synchronous=FULL`` (dmutex's setting) and, for
  comparison, ``NORMAL`` set on the backend's connection.
- ``--procs`` processes: each runs ``--cycles`` acquire/release cycles of one
  key with ``acquire_with_retry``; reported as cycles per second in all.

The database file lives in ``--dir`` (default: a new temporary directory on
the disk of ``/tmp``) and is removed afterwards. Exit code 0 always.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

from dmutex import AsyncDMutex, DMutex, DSemaphore, SQLiteBackend


def _quantiles(samples: list[float]) -> str:
    samples.sort()
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
    return f"p50 {statistics.median(samples):7.1f} µs   p99 {p99:7.1f} µs"


def _time(cycle: Callable[[], None], cycles: int) -> list[float]:
    for _ in range(20):
        cycle()
    samples = []
    for _ in range(cycles):
        started = time.perf_counter()
        cycle()
        samples.append((time.perf_counter() - started) * 1e6)
    return samples


def one_process(path: str, cycles: int, synchronous: str) -> None:
    backend = SQLiteBackend(path)
    backend.call(lambda conn: conn.execute(f"PRAGMA synchronous={synchronous}"))
    for fencing in (True, False):
        mutex = DMutex("bench", backend, fencing=fencing)

        def cycle(mutex: DMutex = mutex) -> None:
            lock = mutex.acquire("job", 30)
            assert lock is not None
            lock.release()

        print(f"  DMutex fencing={fencing!s:5}   {_quantiles(_time(cycle, cycles))}")
    semaphore = DSemaphore("bench", backend, max_permits=64)
    held = [semaphore.acquire("pool", 60) for _ in range(63)]

    def sem_cycle() -> None:
        permit = semaphore.acquire("pool", 30)
        assert permit is not None
        permit.release()

    print(f"  DSemaphore(64), 63 held {_quantiles(_time(sem_cycle, cycles))}")
    for permit in held:
        assert permit is not None
        permit.release()

    async def async_cycles() -> list[float]:
        mutex = AsyncDMutex("bench", backend)
        samples = []
        for _ in range(20 + cycles):
            started = time.perf_counter()
            lock = await mutex.acquire("job", 30)
            assert lock is not None
            await lock.release()
            samples.append((time.perf_counter() - started) * 1e6)
        return samples[20:]

    print(f"  AsyncDMutex             {_quantiles(asyncio.run(async_cycles()))}")
    backend.close()


def _worker(path: str, cycles: int) -> None:
    mutex = DMutex("bench", SQLiteBackend(path))
    for _ in range(cycles):
        lock = mutex.acquire_with_retry("contended", ttl=30, timeout=60, retry_delay=0.005)
        assert lock is not None
        lock.release()


def many_processes(path: str, procs: int, cycles: int) -> None:
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_worker, args=(path, cycles)) for _ in range(procs)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(300)
    elapsed = time.perf_counter() - started
    failed = sum(worker.exitcode != 0 for worker in workers)
    print(
        f"  {procs} processes x {cycles} cycles: {procs * cycles / elapsed:7.0f} cycles/s "
        f"({elapsed:.1f} s, including start-up; {failed} failed)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(dir=args.dir)
    try:
        for synchronous in ("FULL", "NORMAL"):
            print(f"one process, synchronous={synchronous}:")
            path = os.path.join(folder, f"one-{synchronous}.sqlite3")
            one_process(path, args.cycles, synchronous)
        print("contended (synchronous=FULL):")
        many_processes(os.path.join(folder, "many.sqlite3"), args.procs, args.cycles)
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()

"""The drivers: readiness, callbacks of the wrong kind, cancellation, concurrency.

Readiness is watched through a Mongo-shaped double whose ``create_index``
(what ``ready()`` sends) calls a function of the test's.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from dmutex import (
    AsyncDMutex,
    AsyncDSemaphore,
    DMutex,
    DMutexLock,
    DSemaphore,
    InMemoryBackend,
    UnsupportedClientError,
)
from tests._support.doubles import AsyncPreparingMongo, PreparingMongo


def test_sync_ready_runs_once_for_concurrent_threads() -> None:
    calls: list[int] = []

    def prepare() -> None:
        calls.append(1)
        time.sleep(0.05)  # hold the gate while the other threads arrive

    sem = DSemaphore("svc", PreparingMongo(prepare), max_permits=8)
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(sem.acquire("k"))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [1]
    assert all(result is not None for result in results)
    assert len(results) == 6
    sem.ready()
    assert calls == [1], "ready() after readiness does nothing"


def test_async_ready_runs_once_for_concurrent_tasks() -> None:
    calls: list[int] = []

    async def prepare() -> None:
        calls.append(1)
        await asyncio.sleep(0.01)

    async def main() -> list[object]:
        sem = AsyncDSemaphore("svc", AsyncPreparingMongo(prepare), max_permits=8)
        return list(await asyncio.gather(*(sem.acquire("k") for _ in range(6))))

    results = asyncio.run(main())
    assert calls == [1]
    assert all(result is not None for result in results)


def test_ready_failure_surfaces_then_is_retried() -> None:
    attempts: list[int] = []

    def prepare() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("createIndexes failed")

    mutex = DMutex("svc", PreparingMongo(prepare))
    with pytest.raises(RuntimeError, match="createIndexes"):
        mutex.ready()
    lock = mutex.acquire("k")
    assert lock is not None
    assert len(attempts) == 2
    assert lock.release() is True
    assert len(attempts) == 2


def test_ready_failure_surfaces_from_the_next_operation() -> None:
    def prepare() -> None:
        raise PermissionError("not authorized to create index")

    mutex = DMutex("svc", PreparingMongo(prepare))
    for operation in (mutex.ready, lambda: mutex.acquire("k"), lambda: mutex.extend("k", "t")):
        with pytest.raises(PermissionError):
            operation()


def test_sync_run_refuses_an_async_callback_and_releases() -> None:
    backend = InMemoryBackend()
    mutex = DMutex("svc", backend)

    async def callback(lock: DMutexLock) -> None:
        raise AssertionError("never awaited")

    with pytest.raises(UnsupportedClientError, match="returned an awaitable"):
        mutex.run("k", callback)  # a type checker cannot refuse this: T may be a coroutine
    assert backend.snapshot() == {}


def test_async_run_refuses_a_sync_callback_and_releases() -> None:
    backend = InMemoryBackend()

    async def main() -> None:
        mutex = AsyncDMutex("svc", backend)
        with pytest.raises(UnsupportedClientError, match="not an awaitable"):
            await mutex.run("k", lambda lock: "plain")  # type: ignore[arg-type, return-value]  # the mistake under test

    asyncio.run(main())
    assert backend.snapshot() == {}


def test_cancelled_async_run_releases() -> None:
    backend = InMemoryBackend()

    async def main() -> None:
        mutex = AsyncDMutex("svc", backend)
        entered = asyncio.Event()

        async def work(lock: Any) -> None:
            entered.set()
            await asyncio.sleep(3600)

        task = asyncio.create_task(mutex.run("k", work))
        await entered.wait()
        assert len(backend.snapshot()) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert backend.snapshot() == {}


def test_keyboard_interrupt_in_sync_run_releases() -> None:
    backend = InMemoryBackend()
    mutex = DMutex("svc", backend)

    def work(lock: DMutexLock) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        mutex.run("k", work)
    assert backend.snapshot() == {}


def test_threads_never_share_a_mutex() -> None:
    """Many threads, one key: the critical section is never entered twice at once."""
    mutex = DMutex("svc", InMemoryBackend())
    inside: list[int] = []
    overlaps: list[int] = []
    done: list[int] = []

    def worker() -> None:
        for _ in range(200):
            lock = mutex.acquire_with_retry("k", timeout=10, retry_delay=0.0005)
            assert lock is not None
            with lock:
                inside.append(1)
                if len(inside) > 1:
                    overlaps.append(len(inside))
                inside.pop()
                done.append(1)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlaps == []
    assert len(done) == 800


def test_tasks_never_exceed_the_semaphore_and_do_reach_it() -> None:
    backend = InMemoryBackend()
    gauge = [0, 0]  # now, peak
    finished: list[int] = []

    async def work(permit: Any) -> None:
        gauge[0] += 1
        gauge[1] = max(gauge[1], gauge[0])
        await asyncio.sleep(0.001)
        gauge[0] -= 1
        finished.append(permit.slot)

    async def main() -> None:
        sem = AsyncDSemaphore("svc", backend, max_permits=3)
        await asyncio.gather(
            *(sem.run_with_retry("k", work, timeout=30, retry_delay=0.0005) for _ in range(20))
        )

    asyncio.run(main())
    assert gauge[1] == 3
    assert len(finished) == 20
    assert set(finished) == {0, 1, 2}
    assert backend.snapshot() == {}

"""dmutex on InMemoryBackend: a mutex and a semaphore shared by threads.

Run: python examples/threads.py

Eight threads each add 1 to a shared counter 200 times, with a deliberate gap
between reading and writing it. Without a lock, updates are lost; under a
DMutex, none is. Then twelve threads share a DSemaphore of 3 permits and the
script reports how many ever held one at once. It exits non-zero if the
mutex lost an update or the semaphore admitted more than 3.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from dmutex import DMutex, DMutexLock, DSemaphore, DSemaphorePermit, InMemoryBackend

THREADS, INCREMENTS = 8, 200


def hammer(increment: Callable[[], None]) -> None:
    def repeat() -> None:
        for _ in range(INCREMENTS):
            increment()

    workers = [threading.Thread(target=repeat) for _ in range(THREADS)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def main() -> int:
    backend = InMemoryBackend()
    expected = THREADS * INCREMENTS

    counter = [0]

    def unguarded() -> None:
        value = counter[0]
        time.sleep(0)  # let another thread run between the read and the write
        counter[0] = value + 1

    hammer(unguarded)
    print(f"without a lock: {counter[0]} of {expected} increments survived")

    mutex = DMutex("demo", backend)
    counter[0] = 0

    def add_one(lock: DMutexLock) -> None:
        value = counter[0]
        time.sleep(0)
        counter[0] = value + 1

    def guarded() -> None:
        mutex.run_with_retry("counter", add_one, ttl=5, timeout=30, retry_delay=0.0005)

    hammer(guarded)
    print(f"with DMutex:    {counter[0]} of {expected} increments survived")

    semaphore = DSemaphore("demo", backend, max_permits=3)
    holding, peak = [0], [0]
    guard = threading.Lock()

    def hold(permit: DSemaphorePermit) -> None:
        with guard:
            holding[0] += 1
            peak[0] = max(peak[0], holding[0])
        time.sleep(0.01)
        with guard:
            holding[0] -= 1

    workers = [
        threading.Thread(
            target=lambda: semaphore.run_with_retry("api", hold, ttl=5, retry_delay=0.001)
        )
        for _ in range(12)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    print(f"DSemaphore(max_permits=3): at most {peak[0]} of 12 threads held a permit at once")
    print(f"locks left behind: {len(backend.snapshot())}")

    ok = counter[0] == expected and peak[0] <= 3 and not backend.snapshot()
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

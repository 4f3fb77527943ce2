"""InMemoryBackend's own API: the storage keys it shows and force_expire."""

from __future__ import annotations

from datetime import timedelta

from dmutex import DMutex, DSemaphore, InMemoryBackend, ManualClock


def test_snapshot_names_records_as_the_redis_layout_does() -> None:
    clock = ManualClock()
    backend = InMemoryBackend(clock=clock)
    sem = DSemaphore("billing", backend, max_permits=3)
    first, second = sem.acquire("invoice:7", ttl=10), sem.acquire("invoice:7", ttl=20)
    lock = DMutex("billing", backend).acquire("nightly", ttl=30)
    custom = DMutex("billing", backend, key_prefix="app:").acquire("nightly")
    assert first is not None
    assert second is not None
    assert lock is not None
    assert custom is not None
    assert backend.snapshot() == {
        "_dsemaphore_billing:permit:0:invoice:7": (
            first.token,
            clock.now() + timedelta(seconds=10),
        ),
        "_dsemaphore_billing:permit:1:invoice:7": (
            second.token,
            clock.now() + timedelta(seconds=20),
        ),
        "_dmutex_billing:permit:0:nightly": (lock.token, clock.now() + timedelta(seconds=30)),
        "app:permit:0:nightly": (custom.token, clock.now() + timedelta(seconds=300)),
    }
    clock.advance(10)
    assert "_dsemaphore_billing:permit:0:invoice:7" not in backend.snapshot()


def test_force_expire_counts_and_respects_slot() -> None:
    backend = InMemoryBackend(clock=ManualClock())
    sem = DSemaphore("svc", backend, max_permits=3)
    permits = [sem.acquire("k") for _ in range(3)]
    DMutex("svc", backend).acquire("k")
    DMutex("svc", backend).acquire("other")
    assert backend.force_expire("k", slot=1) == 1
    assert backend.force_expire("k", slot=1) == 0, "already expired"
    assert backend.force_expire("k") == 3, "slots 0 and 2 of the semaphore, slot 0 of the mutex"
    assert list(backend.snapshot()) == ["_dmutex_svc:permit:0:other"]
    assert all(p is not None and p.release() is False for p in permits)


def test_released_keys_leave_nothing_behind() -> None:
    backend = InMemoryBackend()
    mutex = DMutex("svc", backend)
    for n in range(100):
        lock = mutex.acquire(f"key-{n}")
        assert lock is not None
        assert lock.release() is True
    assert backend.snapshot() == {}
    assert backend._records == {"_dmutex_svc:": {}}, "no per-key entries accumulate"

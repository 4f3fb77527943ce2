"""InMemoryBackend's own API (storage keys, force_expire) and its cost per operation."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest

from dmutex import (
    MAX_PERMITS,
    DMutex,
    DSemaphore,
    DSemaphorePermit,
    InMemoryBackend,
    ManualClock,
)
from dmutex._backends.memory import backend as memory


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


# Semaphores at scale (issue 14): no operation scans the slots of a key. The
# cost tests count the records an operation reads: a scan of max_permits
# slots reads one per slot, so they fail on any O(N) implementation, and they
# need no timing.


class _CountedRecord(memory.Record):
    """A permit record that counts the reads of its fields, across all instances."""

    reads = 0

    def __getattribute__(self, name: str) -> object:
        if name in ("token", "expires_ms"):
            _CountedRecord.reads += 1
        return super().__getattribute__(name)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Count record reads from here on; returns the count so far."""
    monkeypatch.setattr(memory, "Record", _CountedRecord)
    monkeypatch.setattr(_CountedRecord, "reads", 0)
    return lambda: _CountedRecord.reads


def full(
    backend: InMemoryBackend, permits: int = MAX_PERMITS
) -> tuple[DSemaphore, list[DSemaphorePermit]]:
    """A semaphore of ``permits`` with every permit of key "k" held, expiries all distinct."""
    sem = DSemaphore("svc", backend, max_permits=permits)
    held = []
    for n in range(permits):
        permit = sem.acquire("k", ttl=60 + n)
        assert permit is not None
        held.append(permit)
    return sem, held


def taken(permit: DSemaphorePermit | None) -> DSemaphorePermit:
    """``permit``, which must have been granted."""
    assert permit is not None
    return permit


def test_a_full_acquire_reads_a_few_records_whatever_max_permits(reads: Callable[[], int]) -> None:
    sem, held = full(InMemoryBackend(clock=ManualClock()))
    before = reads()
    assert sem.acquire("k") is None
    assert reads() - before <= 4
    before = reads()
    # A retrying attempt also asks for the earliest expiry (the waiter's
    # expires_in): a min over the records would read them all.
    assert sem.acquire_with_retry("k", timeout=1, retry_delay=0.5) is None
    assert reads() - before <= 20, "a few attempts, a few reads each"
    before = reads()
    assert held[0].release() is True
    assert reads() > before, "the count is live: a release reads its record"


def test_release_and_extend_by_token_read_a_few_records(reads: Callable[[], int]) -> None:
    sem, held = full(InMemoryBackend(clock=ManualClock()))
    last = held[-1]
    before = reads()
    assert sem.extend("k", last.token, ttl=600) is True
    assert sem.release("k", last.token) is True
    assert sem.release("k", last.token) is False
    assert reads() - before <= 12


def test_release_and_extend_by_token_at_max_permits() -> None:
    clock = ManualClock()
    backend = InMemoryBackend(clock=clock)
    sem, held = full(backend)
    assert sem.release("k", held[700].token) is True
    assert sem.release("k", held[700].token) is False, "already released"
    assert sem.extend("k", held[700].token) is False
    assert sem.extend("k", held[-1].token, ttl=5000) is True
    storage_key = f"_dsemaphore_svc:permit:{MAX_PERMITS - 1}:k"
    assert backend.snapshot()[storage_key][1] == clock.now() + timedelta(seconds=5000)
    again = sem.acquire("k")
    assert again is not None
    assert again.slot == 700, "the one free slot"
    assert sem.acquire("k") is None


def test_the_lowest_free_slot_is_taken_first() -> None:
    sem, held = full(InMemoryBackend(clock=ManualClock()), permits=4)
    assert held[2].release() is True
    assert held[0].release() is True
    slots = [permit.slot if permit else None for permit in (sem.acquire("k") for _ in range(3))]
    assert slots == [0, 2, None]


def test_expired_slots_are_taken_over_lowest_first() -> None:
    clock = ManualClock()
    sem = DSemaphore("svc", InMemoryBackend(clock=clock), max_permits=4)
    ttls = [5, 1, 3, 60]
    held = [sem.acquire("k", ttl=ttl) for ttl in ttls]
    assert held[3] is not None
    assert held[3].release() is True
    clock.advance(3)
    # Slots 1 and 2 expired, slot 3 is free: the lowest goes first, whether
    # expired or free.
    slots = [permit.slot if permit else None for permit in (sem.acquire("k") for _ in range(4))]
    assert slots == [1, 2, 3, None]
    assert all(permit is not None and permit.release() is False for permit in held[1:3])


def test_a_force_expired_slot_is_taken_by_the_next_acquire() -> None:
    backend = InMemoryBackend(clock=ManualClock())
    sem, held = full(backend, permits=3)
    assert backend.force_expire("k", slot=1) == 1
    taken = sem.acquire("k")
    assert taken is not None
    assert taken.slot == 1
    assert held[1].release() is False, "its lease was lost"
    assert sem.acquire("k") is None


def test_an_extended_lease_keeps_its_slot_past_its_old_expiry() -> None:
    clock = ManualClock()
    sem = DSemaphore("svc", InMemoryBackend(clock=clock), max_permits=2)
    first, second = sem.acquire("k", ttl=1), sem.acquire("k", ttl=2)
    assert first is not None
    assert second is not None
    assert first.extend(10) is True
    clock.advance(1)
    assert sem.acquire("k") is None, "slot 0's old expiry no longer counts"
    start = clock.now()
    # The wait ends at the earliest expiry (slot 1's, in 1 s), not at
    # slot 0's stale one and not after retry_delay.
    taken = sem.acquire_with_retry("k", timeout=30, retry_delay=20)
    assert taken is not None
    assert taken.slot == 1
    assert clock.now() - start == timedelta(seconds=1)
    assert first.release() is True


def test_a_key_index_stays_small_however_often_its_leases_change() -> None:
    backend = InMemoryBackend(clock=ManualClock())
    sem, held = full(backend, permits=2)
    for n in range(10_000):
        assert sem.extend("k", held[0].token, ttl=60 + n % 7) is True
    for _ in range(2_000):
        assert sem.acquire("k") is None
        assert held[1].release() is True
        held[1] = taken(sem.acquire("k"))
        assert backend.force_expire("k", slot=0) == 1
        assert held[0].extend() is False
        held[0] = taken(sem.acquire("k"))
    slots = backend._records["_dsemaphore_svc:"]["k"]
    assert len(slots.records) == 2
    assert len(slots._expiries) <= 2 * 2 + memory._STALE_SLACK
    assert len(slots._free) == 0

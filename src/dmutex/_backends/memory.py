"""InMemoryBackend: dmutex without a server, for tests and single-process use."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from .._clock import SYSTEM_CLOCK, Clock
from .._core.effects import Steps, Wait
from .._core.lease import MAX_EXPIRY_MS, Lease, expiry_datetime, now_ms
from .._core.waiting import Waiter, Wakeup
from .store import Renewed, extend_each

__all__ = ["InMemoryBackend", "MemoryStore"]


@dataclass
class _Record:
    token: str
    expires_ms: int


# prefix -> key -> slot -> record, mirroring the Redis key layout
# f"{prefix}permit:{slot}:{key}" without having to parse it back.
_Records = dict[str, dict[str, dict[int, _Record]]]


class InMemoryBackend:
    """A thread-safe, in-process backend with the semantics of the real ones.

    Pass it wherever a client goes: ``DMutex("svc", InMemoryBackend())``. One
    instance may serve sync and async classes at once; instances that share it
    see each other's locks, just as they would on one server. Records are kept
    per namespace exactly as the Redis layout names them (``key_prefix``;
    the MongoDB options are ignored), so a ``DMutex`` and a ``DSemaphore`` of
    one service never collide.

    Inject a :class:`~dmutex.ManualClock` to make time stand still until a
    test moves it: leases then expire only when the test advances the clock,
    and retry waits advance it instead of sleeping.

    A retrying acquire (``acquire_with_retry``) is woken at once by a
    release of its key, by any thread or task, and waits no longer than
    the lease in its way has left: contended code under test does not
    wait out ``retry_delay``. On a ``ManualClock`` nothing waits in real
    time: a wait advances the clock to the next expiry or retry, unless a
    release came first.

    Caveat: it is one process's memory. It coordinates threads and tasks of
    this process only.
    """

    def __init__(self, *, clock: Clock | None = None) -> None:
        """Make an empty backend reading time from ``clock`` (the system clock if None)."""
        self._clock: Clock = SYSTEM_CLOCK if clock is None else clock
        self._lock = threading.Lock()
        self._records: _Records = {}
        # prefix -> key -> the last fence granted; kept when the records go,
        # as Redis keeps its counter records.
        self._fences: dict[str, dict[str, int]] = {}
        # (prefix, key) -> the wakeups of retrying acquires waiting for it;
        # held weakly, so that an acquire that was abandoned leaves nothing.
        self._waiters: dict[tuple[str, str], weakref.WeakSet[Wakeup]] = {}

    @property
    def clock(self) -> Clock:
        """The clock that decides when leases expire."""
        return self._clock

    def snapshot(self) -> dict[str, tuple[str, datetime]]:
        """Every active permit, as ``{storage key: (token, expires at)}``.

        Storage keys are the Redis ones, ``f"{key_prefix}permit:{slot}:{key}"``.
        Useful to assert that code under test left no lock behind.
        """
        now = now_ms(self._clock)
        with self._lock:
            return {
                f"{prefix}permit:{slot}:{key}": (rec.token, expiry_datetime(rec.expires_ms))
                for prefix, keys in self._records.items()
                for key, slots in keys.items()
                for slot, rec in slots.items()
                if now < rec.expires_ms
            }

    def force_expire(self, key: str, slot: int | None = None) -> int:
        """Make the permits of lock ``key`` expire now, in every namespace.

        Only ``slot`` if given. The records stay in place, as an expired record
        that a server has not yet removed would, so the next acquire takes
        them over. Returns how many active permits expired. Use it to test
        what code does when its lease is lost.
        """
        now = now_ms(self._clock)
        expired = 0
        with self._lock:
            for keys in self._records.values():
                for number, rec in keys.get(key, {}).items():
                    if (slot is None or number == slot) and now < rec.expires_ms:
                        rec.expires_ms = now
                        expired += 1
            woken = [self._waiters.pop((prefix, key), ()) for prefix in self._records]
        _wake(wakeup for wakeups in woken for wakeup in wakeups)
        return expired


def _wake(wakeups: Iterable[Wakeup]) -> None:
    """Wake each of ``wakeups``: called outside the backend's lock (a wakeup calls listeners)."""
    for wakeup in list(wakeups):
        wakeup.set()


class MemoryStore:
    """One namespace (key prefix) of an :class:`InMemoryBackend`; a ``Store``."""

    max_expiry_ms = MAX_EXPIRY_MS

    def __init__(
        self, backend: InMemoryBackend, prefix: str, max_permits: int, *, fencing: bool = True
    ) -> None:
        self._backend = backend
        self._prefix = prefix
        self._max_permits = max_permits
        self._fencing = fencing

    @property
    def clock(self) -> Clock:
        return self._backend.clock

    def _active(self, key: str, token: str, slot: int | None) -> int | None:
        """The slot of the active record of ``key`` holding ``token``.

        The caller holds the backend's lock.
        """
        slots = self._backend._records.get(self._prefix, {}).get(key, {})
        now = now_ms(self.clock)
        numbers = range(self._max_permits) if slot is None else (slot,)
        for number in numbers:
            rec = slots.get(number)
            if rec is not None and rec.token == token and now < rec.expires_ms:
                return number
        return None

    # Each operation is a generator with nothing to yield: no I/O. The
    # ``yield from ()`` makes it one, so that it fits the Store seam.

    def ready(self) -> Steps[None]:
        yield from ()

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None = None
    ) -> Steps[Lease | None]:
        yield from ()
        with self._backend._lock:
            now = now_ms(self.clock)
            keys = self._backend._records.setdefault(self._prefix, {})
            slots = keys.setdefault(key, {})
            for number in range(self._max_permits):
                rec = slots.get(number)
                if rec is None or rec.expires_ms <= now:
                    slots[number] = _Record(token, now + ttl_ms)
                    fence = None
                    if self._fencing:
                        fences = self._backend._fences.setdefault(self._prefix, {})
                        fence = fences[key] = fences.get(key, 0) + 1
                    if waiter is not None:
                        self._register(key, waiter, None)
                    return Lease(key, token, number, now + ttl_ms, fence)
            if waiter is not None:
                first = min(rec.expires_ms for rec in slots.values())
                self._register(key, waiter, None if waiter.last else (first - now) / 1000)
        return None

    def _register(self, key: str, waiter: Waiter, expires_in: float | None) -> None:
        """Register ``waiter`` for a wake when ``key`` is released (None: forget it).

        The caller holds the backend's lock, so that no release falls
        between the failed attempt and the registration.
        """
        waiting = self._backend._waiters
        wakeups = waiting.get((self._prefix, key))
        if expires_in is None:
            if wakeups is not None:
                wakeups.discard(waiter.wakeup)
                if not wakeups:
                    del waiting[(self._prefix, key)]
            waiter.registered = False
            return
        if wakeups is None:
            wakeups = waiting[(self._prefix, key)] = weakref.WeakSet()
        waiter.wakeup.clear()
        wakeups.add(waiter.wakeup)
        waiter.registered = True
        waiter.expires_in = expires_in

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        yield Wait(waiter.wakeup, seconds)

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        yield from ()
        with self._backend._lock:
            number = self._active(key, token, slot)
            if number is None:
                return False
            keys = self._backend._records[self._prefix]
            del keys[key][number]
            if not keys[key]:
                del keys[key]
            woken = self._backend._waiters.pop((self._prefix, key), ())
        _wake(woken)
        return True

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        yield from ()
        with self._backend._lock:
            number = self._active(key, token, slot)
            if number is None:
                return None
            rec = self._backend._records[self._prefix][key][number]
            rec.expires_ms = now_ms(self.clock) + ttl_ms
            return rec.expires_ms

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        return extend_each(self, leases)

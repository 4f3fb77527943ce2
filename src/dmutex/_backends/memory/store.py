"""The mutex and semaphore store of an :class:`InMemoryBackend`."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from ..._clock import Clock
from ..._core.abc import Holder, Inspection, Renewed, extend_each
from ..._core.effects import Steps, Wait
from ..._core.lease import MAX_EXPIRY_MS, Lease, now_ms
from ..._core.waiting import Waiter, Wakeup
from .backend import InMemoryBackend, Slots, register, wake, watch_key


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

    def _active(self, key: str, token: str, slot: int | None) -> tuple[Slots, int] | None:
        """The slots of ``key`` and the one whose active record holds ``token``.

        O(1): a lookup by token (or by ``slot`` if given), not a scan. The
        caller holds the backend's lock.
        """
        slots = self._backend._records.get(self._prefix, {}).get(key)
        if slots is None:
            return None
        number = slots.active(token, slot, now_ms(self.clock))
        return None if number is None else (slots, number)

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
            slots = keys.get(key)
            if slots is None:
                slots = keys[key] = Slots()
            # Expired records free their slots first, so the lowest free or
            # expired slot is taken, as a scan from slot 0 would take it.
            slots.reap(now)
            if slots.lowest_free() < self._max_permits:
                number = slots.add(token, now + ttl_ms)
                fence = None
                if self._fencing:
                    fences = self._backend._fences.setdefault(self._prefix, {})
                    fence = fences[key] = fences.get(key, 0) + 1
                if waiter is not None:
                    self._register(key, waiter, None)
                return Lease(key, token, number, now + ttl_ms, fence)
            if waiter is not None:
                first = slots.earliest()
                self._register(key, waiter, None if waiter.last else (first - now) / 1000)
        return None

    def _register(self, key: str, waiter: Waiter, expires_in: float | None) -> None:
        register(self._backend, self._prefix, key, waiter, expires_in)

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        yield Wait(waiter.wakeup, seconds)

    def watch(self, key: str, seconds: float) -> Steps[bool]:
        """Wait for a release of ``key`` (``abc.Watching``), its earliest expiry, or ``seconds``."""
        wakeup = Wakeup()
        with self._backend._lock:
            slots = self._backend._records.get(self._prefix, {}).get(key)
            if slots is not None and slots.records:
                left = (slots.earliest() - now_ms(self.clock)) / 1000
                seconds = max(0.0, min(seconds, left))
            watch_key(self._backend, self._prefix, key, wakeup)
        yield Wait(wakeup, seconds)
        return wakeup.is_set()

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        yield from ()
        with self._backend._lock:
            found = self._active(key, token, slot)
            if found is None:
                return False
            slots, number = found
            slots.remove(number)
            if not slots.records:
                del self._backend._records[self._prefix][key]
            woken = self._backend._waiters.pop((self._prefix, key), ())
        wake(woken)
        return True

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        yield from ()
        with self._backend._lock:
            found = self._active(key, token, slot)
            if found is None:
                return None
            slots, number = found
            expires_ms = now_ms(self.clock) + ttl_ms
            slots.set_expiry(number, expires_ms)
            return expires_ms

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        return extend_each(self, leases)

    def holders(self, key: str) -> Steps[Inspection]:
        yield from ()
        with self._backend._lock:
            now = now_ms(self.clock)
            slots = self._backend._records.get(self._prefix, {}).get(key)
            records = {} if slots is None else slots.records
            found = [
                Holder(number, rec.token, rec.expires_ms)
                for number, rec in sorted(records.items())
                if now < rec.expires_ms
            ]
            fence = self._backend._fences.get(self._prefix, {}).get(key)
        return Inspection(found, fence if self._fencing else None, now)

    def keys(self, limit: int) -> Steps[list[str]]:
        """The first ``limit`` keys, sorted, with an active record in any slot (as ``holders``)."""
        yield from ()
        with self._backend._lock:
            now = now_ms(self.clock)
            records = self._backend._records.get(self._prefix, {})
            held = (
                key
                for key, slots in records.items()
                if any(now < rec.expires_ms for rec in slots.records.values())
            )
            return heapq.nsmallest(limit, held)

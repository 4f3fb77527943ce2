"""The read-write store of an :class:`InMemoryBackend`."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from ..._clock import Clock
from ..._core import readwrite
from ..._core.abc import Holder, Inspection, Renewed, extend_each
from ..._core.effects import Steps, Wait
from ..._core.lease import MAX_EXPIRY_MS, Lease, now_ms
from ..._core.waiting import Waiter, Wakeup
from .backend import InMemoryBackend, register, wake


class MemoryReadWriteStore:
    """One namespace of read-write locks in an :class:`InMemoryBackend`; a ``ReadWriteStore``.

    Each key's holds are a :class:`~dmutex._core.readwrite.State`, decided
    by that module under the backend's lock. Fences count 1, 2, 3, ... per
    key, as a mutex's do here, and outlive the holds.
    """

    max_expiry_ms = MAX_EXPIRY_MS

    def __init__(
        self,
        backend: InMemoryBackend,
        prefix: str,
        max_readers: int | None,
        *,
        fencing: bool = True,
    ) -> None:
        self._backend = backend
        self._prefix = prefix
        self._max_readers = max_readers
        self._fencing = fencing

    @property
    def clock(self) -> Clock:
        return self._backend.clock

    def _state(self, key: str) -> readwrite.State:
        """``key``'s state, made if absent, its fence counter restored; under the lock."""
        states = self._backend._rw.setdefault(self._prefix, {})
        state = states.get(key)
        if state is None:
            fence = self._backend._fences.get(self._prefix, {}).get(key, 0)
            state = states[key] = readwrite.State(fence=fence)
        return state

    def _settle(self, key: str, state: readwrite.State) -> None:
        """Keep the fence counter; forget the key once nothing is held or intended."""
        if self._fencing:
            self._backend._fences.setdefault(self._prefix, {})[key] = state.fence
        if state.empty():
            self._backend._rw.get(self._prefix, {}).pop(key, None)

    def ready(self) -> Steps[None]:
        yield from ()

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None, *, write: bool
    ) -> Steps[Lease | None]:
        yield from ()
        woken: Iterable[Wakeup] = ()
        with self._backend._lock:
            now = now_ms(self.clock)
            state = self._state(key)
            had_intent = token in state.intents
            if write:
                intent = readwrite.intent_until(now, waiter)
                # Counted 1, 2, 3: the clock in microseconds is no floor here.
                decided = readwrite.take_write(state, token, ttl_ms, now, 0, intent)
            else:
                decided = readwrite.take_read(state, token, ttl_ms, now, 0, self._max_readers)
            if had_intent and token not in state.intents and not state.writer:
                # A writer gave up: the readers its intent held back may enter.
                woken = self._backend._waiters.pop((self._prefix, key), ())
            self._settle(key, state)
            if isinstance(decided, readwrite.Grant):
                if waiter is not None:
                    self._register(key, waiter, None)
                slot = readwrite.WRITE_SLOT if write else readwrite.READ_SLOT
                fence = decided.fence if self._fencing else None
                lease = Lease(key, token, slot, decided.expires_ms, fence)
            else:
                lease = None
                if waiter is not None:
                    clears = None if waiter.last else (decided.clears_ms - now) / 1000
                    self._register(key, waiter, clears)
        wake(woken)
        return lease

    def _register(self, key: str, waiter: Waiter, expires_in: float | None) -> None:
        register(self._backend, self._prefix, key, waiter, expires_in)

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        yield Wait(waiter.wakeup, seconds)

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        yield from ()
        woken: Iterable[Wakeup] = ()
        with self._backend._lock:
            state = self._backend._rw.get(self._prefix, {}).get(key)
            if state is None:
                return False
            had_intent = token in state.intents
            released = readwrite.drop(state, token, now_ms(self.clock))
            if released or had_intent:
                woken = self._backend._waiters.pop((self._prefix, key), ())
            self._settle(key, state)
        wake(woken)
        return released

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        yield from ()
        with self._backend._lock:
            state = self._backend._rw.get(self._prefix, {}).get(key)
            if state is None:
                return None
            expires = readwrite.extend(state, token, slot, ttl_ms, now_ms(self.clock))
            self._settle(key, state)
            return expires

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        return extend_each(self, leases)

    def holders(self, key: str) -> Steps[Inspection]:
        yield from ()
        with self._backend._lock:
            now = now_ms(self.clock)
            state = self._backend._rw.get(self._prefix, {}).get(key)
            found = [] if state is None else readwrite.holders(state, now)
            fence = self._backend._fences.get(self._prefix, {}).get(key)
        holders = [Holder(slot, token, expires) for slot, token, expires in found]
        return Inspection(holders, fence if self._fencing else None, now)

    def keys(self, limit: int) -> Steps[list[str]]:
        """The first ``limit`` keys, sorted, held by a writer or a reader now."""
        yield from ()
        with self._backend._lock:
            now = now_ms(self.clock)
            states = self._backend._rw.get(self._prefix, {})
            held = (key for key, state in states.items() if readwrite.is_held(state, now))
            return heapq.nsmallest(limit, held)

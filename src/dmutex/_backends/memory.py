"""InMemoryBackend: dmutex without a server, for tests and single-process use."""

from __future__ import annotations

import heapq
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from .._clock import SYSTEM_CLOCK, Clock
from .._core import readwrite
from .._core.abc import Holder, Inspection, Renewed, extend_each
from .._core.effects import Steps, Wait
from .._core.lease import MAX_EXPIRY_MS, Lease, expiry_datetime, now_ms
from .._core.waiting import Waiter, Wakeup

__all__ = ["InMemoryBackend", "MemoryReadWriteStore", "MemoryStore"]


@dataclass
class _Record:
    token: str
    expires_ms: int


# A key's expiry heap is rebuilt once it holds more than twice as many entries
# as the key has records, plus this slack: the rebuild then costs O(1)
# amortised per stale entry, and the heap stays within that size.
_STALE_SLACK = 16


class _Slots:
    """The permits of one key: its records by slot, with the indexes that spare a scan.

    Every operation costs O(1) or O(log N) amortised in the number of slots,
    and memory stays proportional to the most slots the key has held at once.
    ``records`` is the truth; the indexes follow it:

    - ``_by_token``: the slot each token holds (tokens are random per
      acquire; were one reused, the lookup would find its latest slot only);
    - ``_free`` and ``_top``: every slot from ``_top`` up is free, and
      ``_free`` is a min-heap of exactly the free slots below it, so the
      lowest free slot is taken first, as a scan from 0 would take it;
    - ``_expiries``: a min-heap of ``(expires_ms, slot, token)``, one entry
      pushed per expiry set. Entries are deleted lazily: one counts only
      while the record at its slot still has its token and expiry.

    Caveat: not thread-safe; the backend's lock guards it.
    """

    __slots__ = ("_by_token", "_expiries", "_free", "_top", "records")

    def __init__(self) -> None:
        self.records: dict[int, _Record] = {}
        self._by_token: dict[str, int] = {}
        self._free: list[int] = []
        self._top = 0
        self._expiries: list[tuple[int, int, str]] = []

    def active(self, token: str, slot: int | None, now: int) -> int | None:
        """The slot whose active record holds ``token`` (``slot`` only, if given)."""
        number = self._by_token.get(token) if slot is None else slot
        rec = None if number is None else self.records.get(number)
        if rec is None or rec.token != token or rec.expires_ms <= now:
            return None
        return number

    def reap(self, now: int) -> None:
        """Remove every record expired at ``now``, freeing its slot."""
        while self._expiries and self._expiries[0][0] <= now:
            entry = heapq.heappop(self._expiries)
            if self._current(entry):
                self._drop(entry[1])
        self._compact()

    def lowest_free(self) -> int:
        """The lowest slot with no record (expired records count until reaped)."""
        return self._free[0] if self._free else self._top

    def add(self, token: str, expires_ms: int) -> int:
        """Record ``token`` in the lowest free slot, and return that slot."""
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            slot = self._top
            self._top += 1
        self.records[slot] = _Record(token, expires_ms)
        self._by_token[token] = slot
        self._push((expires_ms, slot, token))
        return slot

    def remove(self, slot: int) -> None:
        """Delete the record in ``slot``, freeing it."""
        self._drop(slot)
        self._compact()

    def set_expiry(self, slot: int, expires_ms: int) -> None:
        """Move the expiry of the record in ``slot``; its old heap entry goes stale."""
        rec = self.records[slot]
        rec.expires_ms = expires_ms
        self._push((expires_ms, slot, rec.token))

    def earliest(self) -> int:
        """The earliest expiry among the records; there must be at least one."""
        while not self._current(self._expiries[0]):
            heapq.heappop(self._expiries)
        return self._expiries[0][0]

    def _current(self, entry: tuple[int, int, str]) -> bool:
        """Whether an expiry heap entry still describes the record at its slot."""
        expires_ms, slot, token = entry
        rec = self.records.get(slot)
        return rec is not None and rec.token == token and rec.expires_ms == expires_ms

    def _drop(self, slot: int) -> None:
        rec = self.records.pop(slot)
        if self._by_token.get(rec.token) == slot:
            del self._by_token[rec.token]
        heapq.heappush(self._free, slot)

    def _push(self, entry: tuple[int, int, str]) -> None:
        heapq.heappush(self._expiries, entry)
        self._compact()

    def _compact(self) -> None:
        """Rebuild the expiry heap from the records once it is mostly stale entries."""
        if len(self._expiries) > 2 * len(self.records) + _STALE_SLACK:
            self._expiries = [(rec.expires_ms, n, rec.token) for n, rec in self.records.items()]
            heapq.heapify(self._expiries)


# prefix -> key -> its slots, mirroring the Redis key layout
# f"{prefix}permit:{slot}:{key}" without having to parse it back. A key
# whose last record is released is removed.
_Records = dict[str, dict[str, _Slots]]


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
        # prefix -> key -> its read-write lock's holds (dmutex._core.readwrite);
        # a key whose last hold and intent end is removed, its fence kept in
        # _fences.
        self._rw: dict[str, dict[str, readwrite.State]] = {}
        # (prefix, key) -> the wakeups of retrying acquires waiting for it;
        # held weakly, so that an acquire that was abandoned leaves nothing.
        self._waiters: dict[tuple[str, str], weakref.WeakSet[Wakeup]] = {}

    @property
    def clock(self) -> Clock:
        """The clock that decides when leases expire."""
        return self._clock

    def snapshot(self) -> dict[str, tuple[str, datetime]]:
        """Every active permit, as ``{storage key: (token, expires at)}``.

        Storage keys are the Redis ones, ``f"{key_prefix}permit:{slot}:{key}"``;
        a read-write lock's holds show as ``f"{key_prefix}write:{key}"`` and
        ``f"{key_prefix}read:{token}:{key}"`` (on Redis they are fields of
        one record). Useful to assert that code under test left no lock behind.
        """
        now = now_ms(self._clock)
        with self._lock:
            found = {
                f"{prefix}permit:{slot}:{key}": (rec.token, expiry_datetime(rec.expires_ms))
                for prefix, keys in self._records.items()
                for key, slots in keys.items()
                for slot, rec in slots.records.items()
                if now < rec.expires_ms
            }
            for prefix, states in self._rw.items():
                for key, state in states.items():
                    for slot, token, expires_ms in readwrite.holders(state, now):
                        name = "write:" if slot == readwrite.WRITE_SLOT else f"read:{token}:"
                        found[f"{prefix}{name}{key}"] = (token, expiry_datetime(expires_ms))
            return found

    def force_expire(self, key: str, slot: int | None = None, *, token: str | None = None) -> int:
        """Make the permits of lock ``key`` expire now, in every namespace.

        Only ``slot``'s if given (a read-write lock: 0 its writer, 1 its
        readers), only ``token``'s if given. The records stay in place, as an
        expired record that a server has not yet removed would, so the next
        acquire takes them over. Returns how many active permits expired.
        Use it to test what code does when its lease is lost.
        """
        now = now_ms(self._clock)
        expired = 0
        with self._lock:
            for keys in self._records.values():
                slots = keys.get(key)
                if slots is None:
                    continue
                numbers = list(slots.records) if slot is None else [slot]
                for number in numbers:
                    rec = slots.records.get(number)
                    if rec is None or now >= rec.expires_ms:
                        continue
                    if token is None or rec.token == token:
                        slots.set_expiry(number, now)
                        expired += 1
            for states in self._rw.values():
                state = states.get(key)
                if state is None:
                    continue
                for number, held, _ in readwrite.holders(state, now):
                    if slot in (None, number) and token in (None, held):
                        readwrite.extend(state, held, number, 0, now)
                        expired += 1
            prefixes = {*self._records, *self._rw}
            woken = [self._waiters.pop((prefix, key), ()) for prefix in prefixes]
        _wake(wakeup for wakeups in woken for wakeup in wakeups)
        return expired


def _wake(wakeups: Iterable[Wakeup]) -> None:
    """Wake each of ``wakeups``: called outside the backend's lock (a wakeup calls listeners)."""
    for wakeup in list(wakeups):
        wakeup.set()


def _register(
    backend: InMemoryBackend, prefix: str, key: str, waiter: Waiter, expires_in: float | None
) -> None:
    """Register ``waiter`` for a wake when ``prefix``'s ``key`` changes (None: forget it).

    The caller holds the backend's lock, so that no release falls between
    the failed attempt and the registration.
    """
    waiting = backend._waiters
    wakeups = waiting.get((prefix, key))
    if expires_in is None:
        if wakeups is not None:
            wakeups.discard(waiter.wakeup)
            if not wakeups:
                del waiting[(prefix, key)]
        waiter.registered = False
        return
    if wakeups is None:
        wakeups = waiting[(prefix, key)] = weakref.WeakSet()
    waiter.wakeup.clear()
    wakeups.add(waiter.wakeup)
    waiter.registered = True
    waiter.expires_in = expires_in


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

    def _active(self, key: str, token: str, slot: int | None) -> tuple[_Slots, int] | None:
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
                slots = keys[key] = _Slots()
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
        _register(self._backend, self._prefix, key, waiter, expires_in)

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        yield Wait(waiter.wakeup, seconds)

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
        _wake(woken)
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
        _wake(woken)
        return lease

    def _register(self, key: str, waiter: Waiter, expires_in: float | None) -> None:
        _register(self._backend, self._prefix, key, waiter, expires_in)

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
        _wake(woken)
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

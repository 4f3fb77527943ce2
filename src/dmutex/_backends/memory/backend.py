"""InMemoryBackend: dmutex without a server, for tests and single-process use.

The backend holds every namespace's records, fences and waiters under one
lock; its stores (``store.py``, ``readwrite.py``) decide under that lock.
"""

from __future__ import annotations

import heapq
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from ..._clock import SYSTEM_CLOCK, Clock
from ..._core import readwrite
from ..._core.lease import expiry_datetime, now_ms
from ..._core.waiting import Waiter, Wakeup


@dataclass
class Record:
    token: str
    expires_ms: int


# A key's expiry heap is rebuilt once it holds more than twice as many entries
# as the key has records, plus this slack: the rebuild then costs O(1)
# amortised per stale entry, and the heap stays within that size.
_STALE_SLACK = 16


class Slots:
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
        self.records: dict[int, Record] = {}
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
        self.records[slot] = Record(token, expires_ms)
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
_Records = dict[str, dict[str, Slots]]


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
        wake(wakeup for wakeups in woken for wakeup in wakeups)
        return expired


def wake(wakeups: Iterable[Wakeup]) -> None:
    """Wake each of ``wakeups``: called outside the backend's lock (a wakeup calls listeners)."""
    for wakeup in list(wakeups):
        wakeup.set()


def watch_key(backend: InMemoryBackend, prefix: str, key: str, wakeup: Wakeup) -> None:
    """Have the next release of ``prefix``'s ``key`` set ``wakeup`` too (an observer's).

    The set holds it weakly: a watch that ran out leaves nothing behind once
    its wakeup is gone. The caller holds the backend's lock.
    """
    wakeups = backend._waiters.get((prefix, key))
    if wakeups is None:
        wakeups = backend._waiters[(prefix, key)] = weakref.WeakSet()
    wakeups.add(wakeup)


def register(
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

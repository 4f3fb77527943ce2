"""Read-write locks: many readers or one writer per key, each hold a lease.

Rules of this module:

1. A key is held by any number of readers (at most ``max_readers`` when
   the lock has that bound), or by exactly one writer, never both. Every
   hold is a lease with its own token and expiry; a hold whose expiry has
   passed counts for nothing, and is dropped by the next change.
2. Writer preference. A writer that waits (an attempt of
   ``acquire_write_with_retry`` that is not the last) leaves an *intent*:
   its token, until :func:`intent_until` (its next attempt's time, with a
   margin). While another writer's intent stands, a new reader is refused:
   a stream of readers cannot starve a writer. The readers already in keep
   their leases (and renew them); the writer gets in once they are gone.
   A writer's grant, its last failed attempt and its release by token
   withdraw its intent; a writer that dies while waiting blocks new readers
   until its intent lapses, ``retry_delay`` + 2 s after its last attempt at
   most. Writers do not yield to each other's intents: whichever writer
   tries first once the key is free gets it.
3. Fences. Every grant, read or write, takes the next fence of the key
   (``fences.next_fence``: above the key's counter and at least the store's
   clock in microseconds), so a writer's fence is above every fence handed
   out before it on that key, and a reader's above the writers' before it.
4. A re-sent grant (an attempt whose reply was lost, sent again with the
   same token) finds its own hold: it is granted again, its expiry set anew
   and a new fence taken, never a second hold.
5. A release by token ends that token's hold and its intent; it answers
   whether a hold (not an intent) was active. An extend moves an active
   hold's expiry only.
6. The state is plain data, and every decision here is a pure function of
   it and the time: a store that keeps the state in one record (memory,
   SQLite, the SQL servers) reads it, asks here, and writes it back in one
   atomic step; the Redis store's script follows these rules in Lua, and
   the model tests hold both to them.

A lease's ``slot`` says which kind of hold it is: :data:`WRITE_SLOT` or
:data:`READ_SLOT`. :class:`ReadWriteStore` is what a backend implements; the
engine, written for mutexes and semaphores, drives each side through
:func:`side`, unchanged. Every read-write store of ``dmutex._backends``
also lists its held keys (:class:`~.abc.Listing`, apart from the protocol,
as for mutexes), deciding "held" as :func:`is_held` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .._clock import Clock
from .abc import Inspection, Renewed, Store, text_rule
from .effects import Steps
from .fences import next_fence
from .lease import Lease
from .waiting import Waiter

WRITE_SLOT = 0
"""The ``slot`` of a writer's lease (and of a writer in :class:`~.abc.Inspection`)."""
READ_SLOT = 1
"""The ``slot`` of a reader's lease (and of each reader in :class:`~.abc.Inspection`)."""


@dataclass(slots=True)
class State:
    """One key's holds: the writer, the readers and the waiting writers' intents.

    Times are epoch milliseconds. ``fence`` is the last fence granted (0:
    none yet).
    """

    writer: tuple[str, int] | None = None
    readers: dict[str, int] = field(default_factory=dict)
    intents: dict[str, int] = field(default_factory=dict)
    fence: int = 0

    def prune(self, now_ms: int) -> None:
        """Drop every hold and intent that has expired at ``now_ms`` (rule 1)."""
        if self.writer is not None and self.writer[1] <= now_ms:
            self.writer = None
        self.readers = {t: e for t, e in self.readers.items() if e > now_ms}
        self.intents = {t: e for t, e in self.intents.items() if e > now_ms}

    def empty(self) -> bool:
        """Whether nothing is held or intended: a store may delete the record."""
        return self.writer is None and not self.readers and not self.intents

    def until_ms(self) -> int:
        """The latest expiry of a hold or intent: the record is needed until then."""
        ends = [*self.readers.values(), *self.intents.values()]
        if self.writer is not None:
            ends.append(self.writer[1])
        return max(ends, default=0)


@dataclass(frozen=True, slots=True)
class Grant:
    """A decision to grant: the hold's expiry and fence."""

    expires_ms: int
    fence: int


@dataclass(frozen=True, slots=True)
class Refusal:
    """A decision to refuse: when what stands in the way lapses at the latest, epoch ms."""

    clears_ms: int


def intent_until(now_ms: int, waiter: Waiter | None) -> int | None:
    """Until when a writer's failed attempt leaves its intent (rule 2); None: leave none.

    A waiter's registration window is its longest wait plus a margin for
    the next attempt to reach the store: the intent lasts as long.
    """
    if waiter is None or waiter.last:
        return None
    return now_ms + waiter.window_ms


def take_read(
    state: State, token: str, ttl_ms: int, now_ms: int, now_us: int, max_readers: int | None
) -> Grant | Refusal:
    """Decide a reader's attempt, changing ``state`` if it is granted (rules 1-4)."""
    state.prune(now_ms)
    if token not in state.readers:
        if state.writer is not None:
            return Refusal(state.writer[1])
        others = [until for t, until in state.intents.items() if t != token]
        if others:
            return Refusal(min(others))
        if max_readers is not None and len(state.readers) >= max_readers:
            return Refusal(min(state.readers.values()))
    return _grant(state, token, ttl_ms, now_ms, now_us, write=False)


def take_write(
    state: State, token: str, ttl_ms: int, now_ms: int, now_us: int, intent: int | None
) -> Grant | Refusal:
    """Decide a writer's attempt, changing ``state`` (rules 1-4).

    ``intent``: until when a refusal leaves this writer's intent
    (:func:`intent_until`); None withdraws it.
    """
    state.prune(now_ms)
    ours = state.writer is not None and state.writer[0] == token
    if not ours and (state.writer is not None or state.readers):
        if intent is None:
            state.intents.pop(token, None)
        else:
            state.intents[token] = intent
        ends = [*state.readers.values()]
        if state.writer is not None:
            ends.append(state.writer[1])
        return Refusal(max(ends))
    state.intents.pop(token, None)
    return _grant(state, token, ttl_ms, now_ms, now_us, write=True)


def _grant(
    state: State, token: str, ttl_ms: int, now_ms: int, now_us: int, *, write: bool
) -> Grant:
    expires = now_ms + ttl_ms
    if write:
        state.writer = (token, expires)
    else:
        state.readers[token] = expires
    state.fence = next_fence(state.fence, now_us)
    return Grant(expires, state.fence)


def drop(state: State, token: str, now_ms: int) -> bool:
    """End ``token``'s hold and intent (rule 5); whether an active hold was ended."""
    state.prune(now_ms)
    state.intents.pop(token, None)
    if state.writer is not None and state.writer[0] == token:
        state.writer = None
        return True
    return state.readers.pop(token, None) is not None


def extend(state: State, token: str, slot: int | None, ttl_ms: int, now_ms: int) -> int | None:
    """Move the expiry of ``token``'s active hold to now + ttl; the new expiry, or None."""
    state.prune(now_ms)
    expires = now_ms + ttl_ms
    if slot != READ_SLOT and state.writer is not None and state.writer[0] == token:
        state.writer = (token, expires)
        return expires
    if slot != WRITE_SLOT and token in state.readers:
        state.readers[token] = expires
        return expires
    return None


def holders(state: State, now_ms: int) -> list[tuple[int, str, int]]:
    """The active holds as ``(slot, token, expires_ms)``: the writer, else the readers."""
    state.prune(now_ms)
    if state.writer is not None:
        return [(WRITE_SLOT, *state.writer)]
    return sorted((READ_SLOT, t, e) for t, e in state.readers.items())


def is_held(state: State, now_ms: int) -> bool:
    """Whether :func:`holders` would find a hold at ``now_ms``; ``state`` is left as it is."""
    if state.writer is not None and state.writer[1] > now_ms:
        return True
    return any(expires > now_ms for expires in state.readers.values())


class ReadWriteStore(Protocol):
    """One namespace of read-write locks on one backend: a :class:`~.abc.Store` with two sides.

    Everything but ``acquire`` is the :class:`~.abc.Store` protocol's, for
    holds of either kind (a lease's ``slot`` says which); ``acquire`` takes
    ``write``: a writer's attempt, or a reader's.
    """

    @property
    def clock(self) -> Clock:
        """The clock that expiries are computed from, and retries timed by."""
        ...

    @property
    def max_expiry_ms(self) -> int:
        """The latest expiry this store can hold."""
        ...

    def ready(self) -> Steps[None]:
        """Prepare storage; a driver runs it once per instance."""
        ...

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None, *, write: bool
    ) -> Steps[Lease | None]:
        """A writer's (``write``) or a reader's attempt on ``key``; None if refused."""
        ...

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        """Wait up to ``seconds`` for a change of ``key`` to wake ``waiter``."""
        ...

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        """End ``token``'s hold and intent on ``key`` (rule 5)."""
        ...

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        """Move ``token``'s active hold's expiry to now + ttl; the new expiry, or None."""
        ...

    def holders(self, key: str) -> Steps[Inspection]:
        """The active holds of ``key`` and its fence counter; changes nothing."""
        ...

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        """Extend each of ``leases``, in as few requests as the store can."""
        ...


class _Side:
    """One side of a :class:`ReadWriteStore`, as the :class:`~.abc.Store` an engine drives."""

    __slots__ = ("_refuse", "_store", "_write")

    def __init__(self, store: ReadWriteStore, write: bool) -> None:
        self._store = store
        self._write = write
        self._refuse = text_rule(store)

    def refuse_text(self, what: str, text: str) -> None:
        """The store's own rule for keys and tokens (``abc.TextRule``), if it has one."""
        if self._refuse is not None:
            self._refuse(what, text)

    @property
    def clock(self) -> Clock:
        return self._store.clock

    @property
    def max_expiry_ms(self) -> int:
        return self._store.max_expiry_ms

    def ready(self) -> Steps[None]:
        return self._store.ready()

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None = None
    ) -> Steps[Lease | None]:
        return self._store.acquire(key, token, ttl_ms, waiter, write=self._write)

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        return self._store.wait(key, waiter, seconds)

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        return self._store.release(key, token, slot)

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        return self._store.extend(key, token, slot, ttl_ms)

    def holders(self, key: str) -> Steps[Inspection]:
        return self._store.holders(key)

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        return self._store.extend_many(leases)


def side(store: ReadWriteStore, *, write: bool) -> Store:
    """The writers' (``write``) or the readers' side of ``store``, as a plain :class:`Store`."""
    return _Side(store, write)

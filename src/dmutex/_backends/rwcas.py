"""Read-write locks kept as one record per key and changed by compare-and-set: SQL's, DynamoDB's.

The SQL servers' stores (PostgreSQL, MySQL) and DynamoDB's subclass
:class:`CasReadWriteStore`: each says how to read a record, write it over
the text read, prepare its table and wait, and this module decides. The
layout below is the SQL servers' (DynamoDB's item is the same record in
its own table shape: ``dynamodb/readwrite.py``).

Layout (dmutex's own; the TypeScript library has no read-write lock): the
mutex store's table shape on each server (MySQL's ``value`` column is
``mediumtext`` here, since the state does not fit 128 characters),
``table_prefix`` ``_drwlock_``. Lock ``k`` is the one row ``key =
f"rwlock:{k}"``; its ``value`` the key's state as ``rwstate.py`` writes it,
fence counter included (``"f"``); its ``expired_at`` the server's largest
(the mutex stores' fence-row expiry): the row is the key's fence counter,
so it stays when nothing is held, and an expiry sweep never reaches it.

Rules of this module:

1. An operation reads the row and the server's time in one statement,
   asks ``dmutex._core.readwrite`` (which drops what has expired and
   decides), and writes the new state in a second statement that applies
   only over the text it read (compare-and-set: an upsert that inserts
   where there was no row, or updates a row still holding that text). Two
   callers that read the same state cannot both write: the second finds
   the text changed, reads again and decides again. Nothing is written
   when the decision changed nothing but what had expired (a refused
   reader: one statement); ``holders`` is the read alone. A store whose
   class sets :attr:`CasReadWriteStore.stamped_writes` (PostgreSQL, MySQL;
   not DynamoDB) skips the read where rule 8 lets it.
2. Time is the server's, read by the first statement: a grant's expiry is
   that moment plus the TTL, so the lease the store keeps never outlasts
   the one its holder counts from before it sent the read. A write that
   skipped the read (rule 8) takes its time from its own statement.
3. The state is the whole decision's input and the fence counter is in
   it, so a grant and its fence are written together or not at all, and
   a fence is above every fence granted before it on the key
   (``fences.next_fence`` over the counter and the server's clock).
4. A row at ``rwlock:{k}`` whose value is not dmutex's (``rwstate.py``,
   rule 2) is never written: every operation on the key raises
   :class:`~dmutex.DMutexError`; a renewal batch answers that error for
   that lease only.
5. A change that can let a waiter in (a writer's hold ended, a reader's
   hold ended, an intent withdrawn; not an expiry, which waiters time
   themselves) wakes the key's waiters as each server's mutex store does:
   PostgreSQL notifies the table's channel in the write's own statement,
   MySQL wakes the waiters of this process through the same client. A
   refused attempt tells its waiter when what stands in its way lapses at
   the latest, so a waiter that is not woken waits no longer than that.
6. A compare-and-set lost to another caller is retried at once: each loss
   means another caller's change committed. After :data:`RACES` losses in
   a row the operation raises :class:`~dmutex.DMutexError` rather than
   spin.
7. Listing the held keys (``keys``, for ``dmutex status``) reads the rows
   in key order, :data:`KEYS_PAGE` a statement, each page after the last
   key of the one before, and stops at the ``limit``-th key a writer or a
   reader holds by the server's time. A row stays once its lock is free,
   so the statement leaves out, by its text, every row that holds neither
   a writer nor a reader (``"w":null,"r":{}``); what it reads beyond the
   keys it lists is rows whose holds expired without a release (their
   text keeps them until the key's next operation) and rows that are not
   dmutex's, which hold nothing.
8. One statement per change. The store remembers, per key (at most
   :data:`REMEMBERED` keys, the oldest dropped first), the text it last
   knew on the server (from its last read or its last applied write) and
   the offset of the server's clock from this host's monotonic clock, as
   its last statement on the key bounded it (the server's time less the
   local reading after the reply: so the estimate ``lo`` it gives later
   is never ahead of the server's clock while the two clocks run alike).
   An operation on a key it remembers decides on that text at ``lo``
   (``_core.readwrite`` decides, as in rule 1), and if the decision is a
   grant, a release that ended a hold or an extend, it sends the write
   alone: the decided text, with the grant's or extend's expiry and the
   grant's fence as :data:`STAMP_EXPIRY` and :data:`STAMP_FENCE`, which
   the statement replaces by the server's ``now + ttl`` and
   ``max(counter + 1, now_us)`` (``_core.readwrite._grant``,
   ``readwrite.extend``, ``fences.next_fence``: rules 2 and 3 hold with
   the write's own time). It applies only while the row still holds the
   remembered text and ``lo <= now < next``, ``next`` being the earliest
   expiry left in the state after dropping what expired by ``lo``: then
   the state has the same holds by the server's ``now`` as by ``lo``, so
   the decision and the text written are exactly those that rule 1's read
   at ``now`` would give (the store rebuilds the answer and the text it
   remembers by deciding again at the ``now`` the statement returns).
   Otherwise it changes nothing, the store forgets the key and goes rule
   1's way (PostgreSQL's statement returns the row and its time when it
   did not apply, and that is the read; MySQL reads again). A refusal, or
   a decision that writes nothing, taken from a remembered text is never
   trusted, since that text may be stale: it goes rule 1's way. The
   guarantee is rule 1's: what a caller gets, and what the row holds, is
   what the server's row and clock decide at the write, whatever the
   memory holds; the memory and the clock estimate decide only how often
   the one statement does: a stale memory (another store changed the row,
   the server's clock stepped back, the estimate drifted, a hold expired
   between ``lo`` and the server's ``now``) costs one statement that
   changes nothing. Its limits: a key the store does not remember (its
   first operation here, one of more than :data:`REMEMBERED` keys, one
   whose statement failed or was cancelled after it was sent, which the
   store forgets, or one with no row, whose insert is rule 1's) and a
   text in which a stamp's digits appear elsewhere (a token) go rule 1's
   way, as do refusals, which leave a writer's intent until a time of the
   read's clock.
9. Renewals in a batch: where the server's store batches (PostgreSQL,
   MySQL), ``extend_many`` sends the extends that rule 8 would send alone,
   one lease a key, together, each applying on its own terms (its row's
   text, its window) and stamped with the one statement's time: one
   statement a batch on PostgreSQL; two on MySQL (the update, whose OK
   packet carries its time, then a read of the rows that tells which it
   wrote; the update alone where it wrote none), which splits a large
   call into batches (``mysql/readwrite.py``, rule 5). A lease counts as
   extended only where the server says its row took its text stamped with
   that time, that time in its window, and its answer and remembered text
   are rebuilt at that time as rule 8's are; the leases not extended so,
   and every other lease (a key not remembered, a second lease of one
   key, a batch of one), go one after another, each by rule 8 or rule 1.
   A failed batch statement is the answer of each lease it carried, and
   only of those.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from .._clock import Clock
from .._core import readwrite
from .._core.abc import Holder, Inspection, Renewed, extend_each
from .._core.effects import Steps
from .._core.fences import next_fence
from .._core.lease import MAX_EXPIRY_MS, Lease
from .._core.waiting import Waiter
from .._errors import DMutexError
from . import rwstate

__all__ = [
    "KEYS_PAGE",
    "RACES",
    "REMEMBERED",
    "STAMP_EXPIRY",
    "STAMP_FENCE",
    "CasReadWriteStore",
    "Extension",
    "Stamped",
    "StampedWrite",
]

T = TypeVar("T")

RACES = 1000
"""Rule 6: compare-and-sets lost in a row before an operation gives up."""

KEYS_PAGE = 500
"""Rule 7: rows per statement when listing the held keys."""

REMEMBERED = 1024
"""Rule 8: keys whose last known text a store keeps, at most."""

# Rule 8: the numbers a stamped write carries where the server's time goes. Each is
# 19 digits: above any expiry dmutex writes (lease.MAX_EXPIRY_MS, 15 digits) and any
# fence a clock in microseconds gives before the year 2250; a text in which either
# shows anywhere but where it was put (a token, a counter written by hand) is not
# written this way.
STAMP_EXPIRY = "7777777777777777777"
STAMP_FENCE = "8888888888888888888"
# Rule 8's upper bound when nothing in the state expires; a counter beyond this is
# not sent (the statements add 1 to it in a bigint).
_NO_END = 1 << 62

_ROW = "rwlock:"


def _local_us() -> int:
    """The host's monotonic clock in µs: what a remembered server-clock offset is from."""
    return time.monotonic_ns() // 1000


@dataclass(frozen=True, slots=True)
class Stamped:
    """What a stamped write answered (rule 8).

    ``applied``: it wrote; then ``now_ms`` and ``now_us`` are its
    statement's time. Else, where the statement read the row (PostgreSQL),
    ``value`` is the row's value (None: no row) at ``now_ms`` / ``now_us``,
    a read as ``_fetch`` answers it; else (MySQL) both times are None.
    """

    applied: bool
    now_ms: int | None = None
    now_us: int | None = None
    value: object = None


@dataclass(frozen=True, slots=True)
class StampedWrite:
    """One write of rule 8: ``new`` over ``old`` in the row of ``key``, stamped by the server."""

    key: str
    old: str
    new: str
    ttl_ms: int
    counter: int
    since_ms: int
    until_ms: int
    wake: bool

    def params(self) -> dict[str, object]:
        """The statement's parameters that every server's store names alike."""
        return {
            "row": f"{_ROW}{self.key}",
            "value": self.new,
            "old": self.old,
            "ttl": self.ttl_ms,
            "counter": self.counter,
            "since": self.since_ms,
            "until": self.until_ms,
        }


@dataclass(frozen=True, slots=True)
class Extension:
    """One lease of a batch of renewals written without reads (rule 9)."""

    index: int  # in the batch
    key: str
    old: str
    new: str
    ttl_ms: int
    since_ms: int
    until_ms: int
    pruned: readwrite.State  # the remembered state, what expired by since_ms dropped
    decide: Callable[[readwrite.State, int, int], int | None]


@dataclass(frozen=True, slots=True)
class _Done(Generic[T]):
    """A change that a stamped write made: the decision and the server's ms."""

    decided: T
    now_ms: int


def _wakes(before: readwrite.State, after: readwrite.State) -> bool:
    """Whether going from ``before`` to ``after`` can let a waiter in (rule 5)."""
    writer_left = before.writer is not None and (
        after.writer is None or after.writer[0] != before.writer[0]
    )
    reader_left = any(token not in after.readers for token in before.readers)
    intent_left = any(token not in after.intents for token in before.intents)
    return writer_left or reader_left or intent_left


def _copy(state: readwrite.State) -> readwrite.State:
    return readwrite.State(state.writer, dict(state.readers), dict(state.intents), state.fence)


def _next_end(state: readwrite.State) -> int:
    """The earliest expiry of a hold or intent in ``state``; :data:`_NO_END` if none."""
    ends = [*state.readers.values(), *state.intents.values()]
    if state.writer is not None:
        ends.append(state.writer[1])
    return min(ends, default=_NO_END)


Stamp = Callable[[readwrite.State, T], "bool | int"]
"""Rule 8: marks a decision's stamps in the state; see :meth:`CasReadWriteStore._change`."""


def _extension(
    token: str, slot: int | None, ttl_ms: int
) -> tuple[
    Callable[[readwrite.State, int, int], int | None],
    Callable[[readwrite.State, int | None], bool | int],
]:
    """An extend's decision and its stamp (rule 8)."""

    def decide(state: readwrite.State, now: int, _us: int) -> int | None:
        return readwrite.extend(state, token, slot, ttl_ms, now)

    def stamp(state: readwrite.State, expires: int | None) -> bool | int:
        # Rule 8: the new expiry (readwrite.extend: now + ttl), where it put it.
        if expires is None:
            return False
        if slot != readwrite.READ_SLOT and state.writer == (token, expires):
            state.writer = (token, int(STAMP_EXPIRY))
        elif state.readers.get(token) == expires:
            state.readers[token] = int(STAMP_EXPIRY)
        else:
            return False
        return ttl_ms

    return decide, stamp


class CasReadWriteStore:
    """The read-write lock records of one table; a ``ReadWriteStore``.

    A server's store says how to read a row, write it over the text read,
    prepare the table and wait; this class decides (rules 1-6, 8).
    """

    max_expiry_ms = MAX_EXPIRY_MS

    stamped_writes = False
    """Rule 8: whether the server's store has :meth:`_write_stamped` (PostgreSQL, MySQL)."""

    stamped_batches = False
    """Rule 9: whether it also has :meth:`_extend_stamped` (PostgreSQL, MySQL)."""

    def __init__(self, table: str, max_readers: int | None, clock: Clock, *, fencing: bool) -> None:
        self._table = table
        self._max_readers = max_readers
        self._clock = clock
        self._fencing = fencing
        # Rule 8: key -> (the text last known on the server, None: no row; the server's
        # µs less the local µs, as its last statement on the key bounded it).
        self._known: dict[str, tuple[str | None, int]] = {}

    @property
    def clock(self) -> Clock:
        return self._clock

    # --- what each server's store supplies --------------------------------------

    def ready(self) -> Steps[None]:
        """Create the table if missing; refuse one of another shape."""
        raise NotImplementedError

    server = "SQL"
    """The server's name, in errors."""

    def _fetch(self, key: str) -> Steps[Sequence[Sequence[object]]]:
        """The read's rows: one, ``(value or NULL, server ms, server µs)``."""
        raise NotImplementedError

    def _read(self, key: str) -> Steps[tuple[object, int, int]]:
        """The row's value (None if absent), the server's time in ms and in µs.

        Remembers the value and the server clock's offset (rule 8).
        """
        rows = yield from self._fetch(key)
        local = _local_us()
        if len(rows) != 1 or len(rows[0]) != 3:
            raise DMutexError(f"unexpected reply from {self.server}: {rows!r}")
        value, now, now_us = rows[0]
        if not isinstance(now, int) or not isinstance(now_us, int):
            raise DMutexError(f"unexpected time from {self.server}: {rows!r}")
        if isinstance(value, (bytes, bytearray)):  # a driver's answer for a binary collation
            value = bytes(value).decode()
        self._remember(key, value, now_us - local)
        return value, now, now_us

    def _write(self, key: str, old: object, new: str, wake: bool) -> Steps[bool]:
        """Write ``new`` over ``old`` (None: no row), notifying if ``wake``; whether it applied."""
        raise NotImplementedError

    def _write_stamped(self, write: StampedWrite) -> Steps[Stamped]:
        """Rule 8's one statement: ``write.new`` over the row's ``write.old``, server-stamped.

        In ``new``, :data:`STAMP_EXPIRY` becomes the statement's ms plus
        ``ttl_ms`` and :data:`STAMP_FENCE` the larger of ``counter`` + 1 and
        its µs; it applies only if the row holds ``old`` and
        ``since_ms <= now_ms < until_ms``. Notifies if ``wake`` and applied.
        """
        raise NotImplementedError

    def _extend_stamped(self, writes: Sequence[Extension]) -> Steps[tuple[set[str], int, int]]:
        """Rule 9's one statement: each of ``writes`` as :meth:`_write_stamped` would write it.

        Keys all different, no fence stamped, nobody to wake. Answers the
        keys it wrote and the statement's ms and µs.
        """
        raise NotImplementedError

    def _page(self, after: str, size: int) -> Steps[Sequence[Sequence[object]]]:
        """Up to ``size`` rows after the row ``after`` in byte order, each ``(key, value, now ms)``.

        Rule 7: the rows of read-write locks (``rwlock:...``) whose value is
        not that of a lock with neither writer nor reader.
        """
        raise NotImplementedError

    def _woke(self, key: str) -> None:
        """After a write that woke (rule 5): the in-process part of the wake, if any."""

    def _before(self, key: str, waiter: Waiter | None) -> None:
        """Before an attempt: register ``waiter`` for a wake, where the server's store does."""

    def _after(self, key: str, waiter: Waiter | None, granted: bool) -> None:
        """After an attempt (or its failure): keep or drop ``waiter``'s registration."""

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        """Wait up to ``seconds`` for a change of ``key`` to wake ``waiter``."""
        raise NotImplementedError

    # --- rule 8's memory --------------------------------------------------------

    def _remember(self, key: str, value: object, offset_us: int) -> None:
        """Keep ``value`` (None: no row) as the text of ``key`` on the server."""
        if not self.stamped_writes:
            return
        known = self._known
        if value is not None and not isinstance(value, str):
            known.pop(key, None)
            return
        if key not in known and len(known) >= REMEMBERED:
            # The oldest entry; another thread may be changing the dict.
            with contextlib.suppress(KeyError, RuntimeError, StopIteration):
                del known[next(iter(known))]
        known[key] = (value, offset_us)

    def _forget(self, key: str) -> None:
        self._known.pop(key, None)

    # --- the decisions ----------------------------------------------------------

    def _state(self, key: str, value: object) -> readwrite.State:
        if value is None:
            return readwrite.State()
        state = rwstate.decode(value, fenced=True)
        if state is None:
            raise DMutexError(
                f"the row 'rwlock:{key}' of table {self._table} holds a value dmutex did not write"
            )
        return state

    def _stamped(
        self,
        key: str,
        decide: Callable[[readwrite.State, int, int], T],
        stamp: Stamp[T],
    ) -> Steps[_Done[T] | tuple[object, int, int] | None]:
        """Rule 8: the change in one statement if the remembered text allows it.

        Its decision if the write applied; else the row as the statement
        read it, or None (then the caller reads).
        """
        text, offset_us = self._known.get(key, (None, 0))
        if text is None:
            return None  # no row known, or nothing: rule 1's read
        state = rwstate.decode(text, fenced=True)
        if state is None or state.fence >= _NO_END:
            return None
        lo_us = _local_us() + offset_us
        lo = lo_us // 1000
        state.prune(lo)
        until = _next_end(state)
        pruned = _copy(state)
        decided = decide(state, lo, lo_us)
        ttl_ms = stamp(state, decided)
        if ttl_ms is False:
            return None  # a refusal or a decision that writes nothing: rule 1's way
        written = rwstate.encode(state, fenced=True)
        expiries = 0 if ttl_ms is True else 1
        fences = 1 if isinstance(decided, readwrite.Grant) else 0
        if written.count(STAMP_EXPIRY) != expiries or written.count(STAMP_FENCE) != fences:
            return None
        wake = _wakes(pruned, state)
        ttl = 0 if ttl_ms is True else ttl_ms
        counter = pruned.fence
        try:
            outcome = yield from self._write_stamped(
                StampedWrite(key, text, written, ttl, counter, lo, until, wake)
            )
        except BaseException:
            self._forget(key)
            raise
        local = _local_us()
        if not outcome.applied:
            self._forget(key)
            if outcome.now_ms is None or outcome.now_us is None:
                return None
            self._remember(key, outcome.value, outcome.now_us - local)
            return outcome.value, outcome.now_ms, outcome.now_us
        now, now_us = outcome.now_ms, outcome.now_us
        if now is None or now_us is None or not lo <= now < until:
            self._forget(key)
            raise DMutexError(f"unexpected answer from {self.server} to a write: {outcome!r}")
        # The decision again, at the server's time: the answer and the text now stored
        # (lo <= now < until: the same holds, so the same decision, stamped as the
        # statement stamped it).
        decided = decide(pruned, now, now_us)
        stored = rwstate.encode(pruned, fenced=True)
        # What the statement wrote, by the formulas it cites; the same text unless the
        # two disagree, which would only cost the next change its stamped write.
        sent = written.replace(STAMP_EXPIRY, str(now + ttl))
        sent = sent.replace(STAMP_FENCE, str(next_fence(counter, now_us)))
        if sent == stored:
            self._remember(key, stored, now_us - local)
        else:
            self._forget(key)
        if wake:
            self._woke(key)
        return _Done(decided, now)

    def _change(
        self,
        key: str,
        decide: Callable[[readwrite.State, int, int], T],
        stamp: Stamp[T] | None = None,
    ) -> Steps[tuple[T, int]]:
        """Rule 1: read, decide, write over what was read; the decision and the read's time.

        ``stamp`` (rule 8), given the state as ``decide`` left it and the
        decision: False if the decision is not one to write without a
        read; else it puts :data:`STAMP_EXPIRY` where the decision put its
        expiry and :data:`STAMP_FENCE` where it put its fence, and answers
        the TTL of that expiry (True: it stamped none).
        """
        seen: tuple[object, int, int] | None = None
        if stamp is not None and self.stamped_writes:
            done = yield from self._stamped(key, decide, stamp)
            if isinstance(done, _Done):
                return done.decided, done.now_ms
            seen = done
        for _ in range(RACES):
            if seen is None:
                value, now, now_us = yield from self._read(key)
            else:
                (value, now, now_us), seen = seen, None
            state = self._state(key, value)
            state.prune(now)
            before = _copy(state)
            kept = rwstate.encode(state, fenced=True)
            decided = decide(state, now, now_us)
            written = rwstate.encode(state, fenced=True)
            if written == kept:
                return decided, now
            wake = _wakes(before, state)
            try:
                applied = yield from self._write(key, value, written, wake)
            except BaseException:
                self._forget(key)
                raise
            if applied:
                known = self._known.get(key)  # the read's offset, kept by _read
                if known is not None:
                    self._remember(key, written, known[1])
                if wake:
                    self._woke(key)
                return decided, now
        raise DMutexError(
            f"the row 'rwlock:{key}' of table {self._table} changed under {RACES} attempts in a row"
        )

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None, *, write: bool
    ) -> Steps[Lease | None]:
        """A writer's or a reader's attempt: one read and, if it changes anything, one write.

        A grant on a key whose text the store remembers: the write alone (rule 8).
        """
        readers = self._max_readers

        def decide(state: readwrite.State, now: int, now_us: int) -> object:
            if write:
                intent = readwrite.intent_until(now, waiter)
                return readwrite.take_write(state, token, ttl_ms, now, now_us, intent)
            return readwrite.take_read(state, token, ttl_ms, now, now_us, readers)

        def stamp(state: readwrite.State, decided: object) -> bool | int:
            # Rule 8: a grant's expiry (readwrite._grant: now + ttl) and fence.
            if not isinstance(decided, readwrite.Grant) or state.fence != decided.fence:
                return False
            if write:
                if state.writer != (token, decided.expires_ms):
                    return False
                state.writer = (token, int(STAMP_EXPIRY))
            else:
                if state.readers.get(token) != decided.expires_ms:
                    return False
                state.readers[token] = int(STAMP_EXPIRY)
            state.fence = int(STAMP_FENCE)
            return ttl_ms

        self._before(key, waiter)
        try:
            decided, now = yield from self._change(key, decide, stamp)
        except BaseException:
            self._after(key, waiter, True)
            raise
        self._after(key, waiter, isinstance(decided, readwrite.Grant))
        if isinstance(decided, readwrite.Grant):
            slot = readwrite.WRITE_SLOT if write else readwrite.READ_SLOT
            fence = decided.fence if self._fencing else None
            return Lease(key, token, slot, decided.expires_ms, fence=fence)
        if waiter is not None and isinstance(decided, readwrite.Refusal):
            waiter.expires_in = max(decided.clears_ms - now, 0) / 1000
        return None

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        """End ``token``'s hold and intent: one read and, if either was there, one write.

        A release that ends a hold on a key whose text the store remembers:
        the write alone (rule 8).
        """

        def decide(state: readwrite.State, now: int, _us: int) -> bool:
            return readwrite.drop(state, token, now)

        def stamp(_state: readwrite.State, released: bool) -> bool | int:
            return released  # True: nothing to stamp; False: rule 1's way

        released, _ = yield from self._change(key, decide, stamp)
        return released

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        """Move the expiry of ``token``'s active hold: one read and, if it is active, one write.

        On a key whose text the store remembers: the write alone (rule 8).
        """
        decide, stamp = _extension(token, slot, ttl_ms)
        expires, _ = yield from self._change(key, decide, stamp)
        return expires

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        """Extend the leases that have not ended (rule 9); a failure is the answer of those it hit.

        Where the server's store batches (PostgreSQL, MySQL): the leases of keys it
        remembers, one a key, in one statement; every other lease, and any
        that statement did not extend, one after another
        (``abc.extend_each``).
        """
        if not (self.stamped_writes and self.stamped_batches):
            return (yield from extend_each(self, leases))
        answers: list[Renewed] = [None] * len(leases)
        batch = self._batch(leases)
        rest = [n for n, lease in enumerate(leases) if not lease.ended]
        if len(batch) > 1:
            try:
                written, now, now_us = yield from self._extend_stamped(batch)
            except BaseException as error:
                for item in batch:
                    self._forget(item.key)
                if not isinstance(error, Exception):
                    raise
                for item in batch:
                    answers[item.index] = error
                written, now, now_us = set(), 0, 0
                rest = [n for n in rest if n not in {item.index for item in batch}]
            local = _local_us()
            for item in batch:
                if item.key not in written:
                    self._forget(item.key)
                    continue
                rest.remove(item.index)
                if not item.since_ms <= now < item.until_ms:
                    self._forget(item.key)
                    answers[item.index] = DMutexError(
                        f"unexpected answer from {self.server} to a renewal: {now}"
                    )
                    continue
                # Rule 8's way: the decision again at the server's time, the text stored.
                expires = item.decide(item.pruned, now, now_us)
                stored = rwstate.encode(item.pruned, fenced=True)
                sent = item.new.replace(STAMP_EXPIRY, str(now + item.ttl_ms))
                if sent == stored:
                    self._remember(item.key, stored, now_us - local)
                else:
                    self._forget(item.key)
                answers[item.index] = expires
        for n in rest:
            answers[n] = (yield from extend_each(self, [leases[n]]))[0]
        return answers

    def _batch(self, leases: Sequence[Lease]) -> list[Extension]:
        """Rule 9: the leases to extend in one statement, as rule 8 would write each alone."""
        batch: list[Extension] = []
        keys: set[str] = set()
        for n, lease in enumerate(leases):
            text, offset_us = self._known.get(lease.key, (None, 0))
            if lease.ended or text is None or lease.key in keys:
                continue
            state = rwstate.decode(text, fenced=True)
            if state is None:
                continue
            lo_us = _local_us() + offset_us
            lo = lo_us // 1000
            state.prune(lo)
            until = _next_end(state)
            pruned = _copy(state)
            decide, stamp = _extension(lease.token, lease.slot, lease.ttl_ms)
            if stamp(state, decide(state, lo, lo_us)) is False:
                continue
            new = rwstate.encode(state, fenced=True)
            if new.count(STAMP_EXPIRY) != 1 or STAMP_FENCE in new:
                continue
            keys.add(lease.key)
            batch.append(
                Extension(n, lease.key, text, new, lease.ttl_ms, lo, until, pruned, decide)
            )
        return batch

    def holders(self, key: str) -> Steps[Inspection]:
        """The active holds of ``key`` and its fence counter: the read alone."""
        value, now, _ = yield from self._read(key)
        state = self._state(key, value)
        found = [Holder(*hold) for hold in readwrite.holders(state, now)]
        fence = state.fence if self._fencing and state.fence else None
        return Inspection(found, fence, now)

    def keys(self, limit: int) -> Steps[list[str]]:
        """The first ``limit`` keys in byte order held by a writer or a reader (rule 7).

        Reads pages of :data:`KEYS_PAGE` rows until it found ``limit`` held
        keys or read the last row; a row that is not dmutex's is passed
        over, as holding nothing.
        """
        found: list[str] = []
        after = ""
        while len(found) < limit:
            rows = yield from self._page(after, KEYS_PAGE)
            for row in rows:
                if len(row) != 3 or not isinstance(row[2], int):
                    raise DMutexError(f"unexpected reply from {self.server}: {row!r}")
                name, value, now = row[0], row[1], row[2]
                if isinstance(name, (bytes, bytearray)):  # a binary collation's answer
                    name = bytes(name).decode()
                if isinstance(value, (bytes, bytearray)):
                    value = bytes(value).decode()
                if not isinstance(name, str) or not name.startswith(_ROW):
                    raise DMutexError(f"unexpected reply from {self.server}: {row!r}")
                state = rwstate.decode(value, fenced=True)
                if state is not None and readwrite.is_held(state, now):
                    found.append(name[len(_ROW) :])
                    if len(found) == limit:
                        break
                after = name
            if len(rows) < KEYS_PAGE:
                break
        return found

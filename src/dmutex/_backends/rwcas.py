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
   reader: one statement); ``holders`` is the read alone.
2. Time is the server's, read by the first statement: a grant's expiry is
   that moment plus the TTL, so the lease the store keeps never outlasts
   the one its holder counts from before it sent the read.
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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from .._clock import Clock
from .._core import readwrite
from .._core.abc import Holder, Inspection, Renewed, extend_each
from .._core.effects import Steps
from .._core.lease import MAX_EXPIRY_MS, Lease
from .._core.waiting import Waiter
from .._errors import DMutexError
from . import rwstate

__all__ = ["KEYS_PAGE", "RACES", "CasReadWriteStore"]

T = TypeVar("T")

RACES = 1000
"""Rule 6: compare-and-sets lost in a row before an operation gives up."""

KEYS_PAGE = 500
"""Rule 7: rows per statement when listing the held keys."""

_ROW = "rwlock:"


def _wakes(before: readwrite.State, after: readwrite.State) -> bool:
    """Whether going from ``before`` to ``after`` can let a waiter in (rule 5)."""
    writer_left = before.writer is not None and (
        after.writer is None or after.writer[0] != before.writer[0]
    )
    reader_left = any(token not in after.readers for token in before.readers)
    intent_left = any(token not in after.intents for token in before.intents)
    return writer_left or reader_left or intent_left


class CasReadWriteStore:
    """The read-write lock records of one table; a ``ReadWriteStore``.

    A server's store says how to read a row, write it over the text read,
    prepare the table and wait; this class decides (rules 1-6).
    """

    max_expiry_ms = MAX_EXPIRY_MS

    def __init__(self, table: str, max_readers: int | None, clock: Clock, *, fencing: bool) -> None:
        self._table = table
        self._max_readers = max_readers
        self._clock = clock
        self._fencing = fencing

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
        """The row's value (None if absent), the server's time in ms and in µs."""
        rows = yield from self._fetch(key)
        if len(rows) != 1 or len(rows[0]) != 3:
            raise DMutexError(f"unexpected reply from {self.server}: {rows!r}")
        value, now, now_us = rows[0]
        if not isinstance(now, int) or not isinstance(now_us, int):
            raise DMutexError(f"unexpected time from {self.server}: {rows!r}")
        if isinstance(value, (bytes, bytearray)):  # a driver's answer for a binary collation
            value = bytes(value).decode()
        return value, now, now_us

    def _write(self, key: str, old: object, new: str, wake: bool) -> Steps[bool]:
        """Write ``new`` over ``old`` (None: no row), notifying if ``wake``; whether it applied."""
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

    def _change(
        self, key: str, decide: Callable[[readwrite.State, int, int], T]
    ) -> Steps[tuple[T, int]]:
        """Rule 1: read, decide, write over what was read; the decision and the read's time."""
        for _ in range(RACES):
            value, now, now_us = yield from self._read(key)
            state = self._state(key, value)
            state.prune(now)
            before = readwrite.State(state.writer, dict(state.readers), dict(state.intents))
            kept = rwstate.encode(state, fenced=True)
            decided = decide(state, now, now_us)
            written = rwstate.encode(state, fenced=True)
            if written == kept:
                return decided, now
            wake = _wakes(before, state)
            if (yield from self._write(key, value, written, wake)):
                if wake:
                    self._woke(key)
                return decided, now
        raise DMutexError(
            f"the row 'rwlock:{key}' of table {self._table} changed under {RACES} attempts in a row"
        )

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None, *, write: bool
    ) -> Steps[Lease | None]:
        """A writer's or a reader's attempt: one read and, if it changes anything, one write."""
        readers = self._max_readers

        def decide(state: readwrite.State, now: int, now_us: int) -> object:
            if write:
                intent = readwrite.intent_until(now, waiter)
                return readwrite.take_write(state, token, ttl_ms, now, now_us, intent)
            return readwrite.take_read(state, token, ttl_ms, now, now_us, readers)

        self._before(key, waiter)
        try:
            decided, now = yield from self._change(key, decide)
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
        """End ``token``'s hold and intent: one read and, if either was there, one write."""

        def decide(state: readwrite.State, now: int, _us: int) -> bool:
            return readwrite.drop(state, token, now)

        released, _ = yield from self._change(key, decide)
        return released

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        """Move the expiry of ``token``'s active hold: one read and, if it is active, one write."""

        def decide(state: readwrite.State, now: int, _us: int) -> int | None:
            return readwrite.extend(state, token, slot, ttl_ms, now)

        expires, _ = yield from self._change(key, decide)
        return expires

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        """Extend each lease in turn (``abc.extend_each``): a failure is its answer alone."""
        return extend_each(self, leases)

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

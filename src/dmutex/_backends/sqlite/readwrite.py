"""The SQLite read-write store: one row per key, its state decided by the core (rules 6-9)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeAlias, cast

from ..._clock import Clock
from ..._core import readwrite
from ..._core.abc import Holder, Inspection, Renewed
from ..._core.effects import Call, Sleep, Steps, Wait
from ..._core.fences import clock_us
from ..._core.lease import Lease, now_ms
from ..._core.waiting import Waiter, Wakeup
from ..._errors import DMutexError
from .. import rwstate
from .backend import Conn, SQLiteBackend, T, in_transaction, register, transaction
from .statements import fence_counter, put_fence, shown_fence
from .store import TableStore

# A read-write row as the transaction read it: (value, expired_at), or None if absent.
_Read: TypeAlias = "tuple[str, int] | None"


# A call's result, and the wakeups of the waiters it woke.
_Woken: TypeAlias = "tuple[T, list[Wakeup]]"


def _woken(reply: object) -> object:
    """The result of a :meth:`SQLiteReadWriteStore._waking` call, its wakeups set."""
    result, wakeups = cast("_Woken[object]", reply)
    for wakeup in wakeups:
        wakeup.set()  # outside the backend's lock: a wakeup calls listeners
    return result


class SQLiteReadWriteStore(TableStore):
    """One table of read-write lock rows; a ``ReadWriteStore`` (rules 6-8).

    Each operation is one call of the backend and one transaction, a batch
    of renewals included. Fences are the mutex store's (``fence:{k}``).
    """

    def __init__(
        self,
        backend: SQLiteBackend,
        table: str,
        max_readers: int | None,
        clock: Clock,
        *,
        asynchronous: bool,
        fencing: bool = True,
    ) -> None:
        super().__init__(backend, table, clock, asynchronous=asynchronous, fencing=fencing)
        self._max_readers = max_readers

    def _load(self, conn: Conn, key: str) -> tuple[readwrite.State, _Read]:
        """``key``'s state and its row as read; an empty state if none; raise on a foreign row."""
        name = f"rwlock:{key}"
        row = conn.execute(self._sql.read, {"name": name}).fetchone()
        if row is None:
            return readwrite.State(), None
        state = rwstate.decode(row[0])
        if state is None:
            raise DMutexError(
                f"the row {name!r} of table {self._table!r} holds a value dmutex did not write"
            )
        return state, (row[0], row[1])

    def _save(self, conn: Conn, key: str, state: readwrite.State, read: _Read) -> None:
        """Write ``state`` over the row as it was ``read`` (rule 7); nothing if it is unchanged."""
        name, sql = f"rwlock:{key}", self._sql
        if state.empty():
            if read is not None:
                conn.execute(sql.remove, {"name": name, "old": read[0]})
            return
        value, expires = rwstate.encode(state), state.until_ms()
        if read is None:
            conn.execute(sql.insert, {"name": name, "value": value, "expires": expires})
        elif (value, expires) != read:
            changed = {"name": name, "value": value, "expires": expires, "old": read[0]}
            conn.execute(sql.update, changed)

    def _waking(
        self, key: str, body: Callable[[Conn], tuple[T, bool]]
    ) -> Callable[[Conn], _Woken[T]]:
        """The call of ``body`` in a transaction, with the key's waiters if it says to wake them.

        Taken after the commit, so that a transaction that fails wakes no
        one; the caller sets them outside the backend's lock (rule 4).
        """
        name = (self._table, f"rwlock:{key}")

        def call(conn: Conn) -> _Woken[T]:
            result, wake = in_transaction(conn, body)
            return result, list(self._backend._waiters.pop(name, ())) if wake else []

        return call

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None, *, write: bool
    ) -> Steps[Lease | None]:
        """A writer's or a reader's attempt: one transaction (rule 6)."""
        clock, backend, fencing = self._clock, self._backend, self._fencing
        name = (self._table, f"rwlock:{key}")  # the waiters' registration, as rule 4's

        def attempt(conn: Conn) -> tuple[tuple[int, int | None] | None, bool]:
            now = now_ms(clock)
            state, read = self._load(conn, key)
            if fencing:
                state.fence = fence_counter(conn, self._sql, self._table, key)
            state.prune(now)
            had_intent = token in state.intents
            now_us = clock_us(clock)
            if write:
                intent = readwrite.intent_until(now, waiter)
                decided = readwrite.take_write(state, token, ttl_ms, now, now_us, intent)
            else:
                decided = readwrite.take_read(state, token, ttl_ms, now, now_us, self._max_readers)
            self._save(conn, key, state, read)
            # A writer that gave up: the readers its intent held back may enter.
            gave_up = had_intent and token not in state.intents and state.writer is None
            if isinstance(decided, readwrite.Grant):
                if fencing:
                    put_fence(conn, self._sql, key, decided.fence)
                if waiter is not None:
                    register(backend, name, waiter, False)
                return (decided.expires_ms, decided.fence if fencing else None), gave_up
            if waiter is not None:
                waiter.expires_in = (decided.clears_ms - now) / 1000
                register(backend, name, waiter, not waiter.last)
            return None, gave_up

        reply = yield Call(self._run, (self._waking(key, attempt),))
        granted = cast("tuple[int, int | None] | None", _woken(reply))  # what attempt() returned
        if granted is None:
            return None
        expires, fence = granted
        slot = readwrite.WRITE_SLOT if write else readwrite.READ_SLOT
        return Lease(key, token, slot, expires, fence=fence)

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        """Wait for a release through this backend (rule 8), or the whole time."""
        if waiter.registered:
            yield Wait(waiter.wakeup, seconds)
        else:
            yield Sleep(seconds)

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        """End ``token``'s hold and intent: one transaction."""
        clock = self._clock

        def drop(conn: Conn) -> tuple[bool, bool]:
            now = now_ms(clock)
            state, read = self._load(conn, key)
            if read is None:
                return False, False
            state.prune(now)
            had_intent = token in state.intents
            released = readwrite.drop(state, token, now)
            self._save(conn, key, state, read)
            return released, released or had_intent

        reply = yield Call(self._run, (self._waking(key, drop),), complete=True)
        return cast(bool, _woken(reply))  # what drop() returned

    def _extend(
        self, conn: Conn, key: str, token: str, slot: int | None, ttl_ms: int, now: int
    ) -> int | None:
        """Move ``token``'s active hold's expiry, in the caller's transaction."""
        state, read = self._load(conn, key)
        if read is None:
            return None
        expires = readwrite.extend(state, token, slot, ttl_ms, now)
        self._save(conn, key, state, read)
        return expires

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        """Move the expiry of ``token``'s active hold: one transaction."""
        clock = self._clock

        def update(conn: Conn) -> int | None:
            return self._extend(conn, key, token, slot, ttl_ms, now_ms(clock))

        expires = yield Call(self._run, (transaction(update),))
        return cast("int | None", expires)  # what update() returned

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        """Extend every lease in one transaction; a failed call fails them all.

        A lease whose row is not dmutex's answers that error alone (rule 7):
        its check raises before anything of it is written.
        """
        clock = self._clock
        batch = [(lease.key, lease.token, lease.slot, lease.ttl_ms) for lease in leases]

        def update(conn: Conn) -> list[Renewed]:
            now = now_ms(clock)
            answers: list[Renewed] = []
            for key, token, slot, ttl_ms in batch:
                try:
                    answers.append(self._extend(conn, key, token, slot, ttl_ms, now))
                except DMutexError as error:
                    answers.append(error)
            return answers

        try:
            answers = yield Call(self._run, (transaction(update),))
        except Exception as error:  # noqa: BLE001 - every lease's answer
            return [error] * len(leases)
        return cast("list[Renewed]", answers)  # what update() returned

    def holders(self, key: str) -> Steps[Inspection]:
        """The active holds of ``key`` and its fence counter: one read transaction, no change."""
        clock = self._clock

        def read(conn: Conn) -> Inspection:
            now = now_ms(clock)
            state, _ = self._load(conn, key)
            found = [Holder(*hold) for hold in readwrite.holders(state, now)]
            return Inspection(found, shown_fence(conn, self._sql, key), now)

        def call(conn: Conn) -> Inspection:
            return in_transaction(conn, read, "BEGIN")

        inspection = yield Call(self._run, (call,))
        return cast(Inspection, inspection)  # what read() returned

    def keys(self, limit: int) -> Steps[list[str]]:
        """The first ``limit`` keys, sorted, held by a writer or a reader now (rule 9).

        Reads the rows in key order and stops at the ``limit``-th held one;
        a row that is not dmutex's is passed over, as holding nothing.
        """
        sql, clock = self._sql, self._clock

        def read(conn: Conn) -> list[str]:
            now = now_ms(clock)
            found: list[str] = []
            rows = conn.execute(sql.rows, {"now": now})
            try:
                for name, value in rows:
                    state = rwstate.decode(value)
                    if state is not None and readwrite.is_held(state, now):
                        found.append(str(name)[len("rwlock:") :])
                        if len(found) >= limit:
                            break
            finally:
                rows.close()
            return found

        found = yield Call(self._run, (read,))
        return cast("list[str]", found)  # what read() returned

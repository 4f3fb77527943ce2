"""The SQLite mutex and semaphore store: lease rows, one call each (rules 1-4, 9)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from ..._clock import Clock
from ..._core.abc import Holder, Inspection, Renewed
from ..._core.effects import Call, Sleep, Steps, Wait
from ..._core.fences import clock_us, next_fence
from ..._core.lease import MAX_EXPIRY_MS, Lease, now_ms
from ..._core.waiting import Waiter, Wakeup
from .backend import Conn, SQLiteBackend, register, transaction
from .statements import (
    Sql,
    creation,
    fence_counter,
    put_fence,
    shown_fence,
    slot_of,
)


class TableStore:
    """What both SQLite stores hold: the table's statements, the backend's call, the clock."""

    max_expiry_ms = MAX_EXPIRY_MS

    def __init__(
        self,
        backend: SQLiteBackend,
        table: str,
        clock: Clock,
        *,
        asynchronous: bool,
        fencing: bool,
    ) -> None:
        self._sql = Sql.of(table)
        self._table = table
        self._backend = backend
        self._run: Callable[[Callable[[Conn], object]], object] = (
            backend.call_async if asynchronous else backend.call
        )
        self._clock = clock
        self._fencing = fencing

    @property
    def clock(self) -> Clock:
        return self._clock

    def ready(self) -> Steps[None]:
        """Create the table and its expiry index if missing: one call."""
        yield Call(self._run, (creation(self._sql),))


class SQLiteStore(TableStore):
    """One table of lease rows; a ``Store``.

    One call to the backend per operation (rule 1): acquire (with its
    fence), release, extend, and a whole batch of renewals each run as one
    transaction.
    """

    def __init__(
        self,
        backend: SQLiteBackend,
        table: str,
        max_permits: int,
        clock: Clock,
        *,
        asynchronous: bool,
        fencing: bool = True,
    ) -> None:
        super().__init__(backend, table, clock, asynchronous=asynchronous, fencing=fencing)
        self._permits = max_permits

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None = None
    ) -> Steps[Lease | None]:
        """Take the slot holding ``token``, else the lowest free or expired one; None if none is.

        A mutex without fencing is one statement; anything else is one
        ``BEGIN IMMEDIATE`` transaction (rule 1).
        """
        sql, permits, backend, clock = self._sql, self._permits, self._backend, self._clock

        def grant(conn: Conn) -> tuple[int, int, int | None] | None:
            now = now_ms(clock)  # rule 3: when the call runs, not when it was queued
            expires = now + ttl_ms
            rows: list[tuple[str, str, int]] = []
            if permits == 1:
                slot = 0
            else:
                found = {"permits": permits, "key": key, "now": now, "token": token}
                rows = conn.execute(sql.slots, found).fetchall()
                held = {slot_of(name, key): value for name, value, _ in rows}
                mine = [slot for slot, value in held.items() if value == token]
                free = (slot for slot in range(permits) if slot not in held)
                slot = mine[0] if mine else next(free, -1)
            if slot >= 0:
                name = f"permit:{slot}:{key}"
                taken = {"name": name, "token": token, "expires": expires, "now": now}
                cursor = conn.execute(sql.take, taken)
                if cursor.rowcount == 1:
                    if waiter is not None:
                        register(backend, (self._table, key), waiter, False)
                    fence = self._bump(conn, key, clock_us(clock)) if self._fencing else None
                    return slot, expires, fence
            if waiter is not None:
                if permits == 1:
                    asked = {"permits": 1, "key": key, "now": now, "token": None}
                    rows = conn.execute(sql.slots, asked).fetchall()
                ends = [at for _, _, at in rows if at > now]
                waiter.expires_in = (min(ends) - now) / 1000 if ends else None
                register(backend, (self._table, key), waiter, not waiter.last)
            return None

        one = permits == 1 and not self._fencing
        reply = yield Call(self._run, (grant if one else transaction(grant),))
        granted = cast("tuple[int, int, int | None] | None", reply)  # what grant() returned
        if granted is None:
            return None
        slot, expires, fence = granted
        return Lease(key, token, slot, expires, fence=fence)

    def _bump(self, conn: Conn, key: str, now_us: int) -> int:
        """Move the fence counter of ``key`` on (``fences``, rule 1); raise on a foreign row."""
        fence = next_fence(fence_counter(conn, self._sql, self._table, key), now_us)
        put_fence(conn, self._sql, key, fence)
        return fence

    def _match(self, key: str, token: str, slot: int | None) -> dict[str, object]:
        """The parameters that pick the row of ``key`` holding ``token`` (add: now, expires)."""
        name = None if slot is None else f"permit:{slot}:{key}"
        return {"permits": self._permits, "key": key, "name": name, "token": token}

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        """Delete the active row holding ``token``: one statement."""
        statement = self._sql.delete_any if slot is None else self._sql.delete
        params, clock = self._match(key, token, slot), self._clock
        backend, name = self._backend, (self._table, key)

        def delete(conn: Conn) -> list[Wakeup] | None:
            if conn.execute(statement, {**params, "now": now_ms(clock)}).rowcount != 1:
                return None
            return list(backend._waiters.pop(name, ()))

        woken = yield Call(self._run, (delete,), complete=True)
        if woken is None:
            return False
        for wakeup in cast("list[Wakeup]", woken):  # what delete() returned
            wakeup.set()  # outside the backend's lock: a wakeup calls listeners
        return True

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        """Move the expiry of the active row holding ``token``: one statement."""
        statement = self._sql.extend_any if slot is None else self._sql.extend
        params, clock = self._match(key, token, slot), self._clock

        def update(conn: Conn) -> int | None:
            now = now_ms(clock)
            done = conn.execute(statement, {**params, "now": now, "expires": now + ttl_ms}).rowcount
            return now + ttl_ms if done == 1 else None

        expires = yield Call(self._run, (update,))
        return cast("int | None", expires)  # what update() returned

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        """Extend every lease in one transaction; a failed call fails them all."""
        statement, clock = self._sql.extend, self._clock
        batch = [
            (self._match(lease.key, lease.token, lease.slot), lease.ttl_ms) for lease in leases
        ]

        def update(conn: Conn) -> list[Renewed]:
            now = now_ms(clock)
            return [
                now + ttl_ms
                if conn.execute(statement, {**params, "now": now, "expires": now + ttl_ms}).rowcount
                == 1
                else None
                for params, ttl_ms in batch
            ]

        try:
            answers = yield Call(self._run, (transaction(update),))
        except Exception as error:  # noqa: BLE001 - every lease's answer
            return [error] * len(leases)
        return cast("list[Renewed]", answers)  # what update() returned

    def holders(self, key: str) -> Steps[Inspection]:
        """The active permits of ``key`` and its fence counter: one call, no change."""
        sql, permits, clock = self._sql, self._permits, self._clock

        def read(conn: Conn) -> Inspection:
            now = now_ms(clock)
            asked = {"permits": permits, "key": key, "now": now, "token": None}
            rows = conn.execute(sql.slots, asked).fetchall()
            found = sorted(Holder(slot_of(name, key), value, at) for name, value, at in rows)
            return Inspection(found, shown_fence(conn, sql, key), now)

        inspection = yield Call(self._run, (read,))
        return cast(Inspection, inspection)  # what read() returned

    def keys(self, limit: int) -> Steps[list[str]]:
        """The first ``limit`` keys, sorted, with an active permit in slots 0 .. N-1 (rule 9)."""
        sql, permits, clock = self._sql, self._permits, self._clock

        def read(conn: Conn) -> list[str]:
            asked = {"now": now_ms(clock), "permits": permits, "limit": limit}
            return [str(key) for (key,) in conn.execute(sql.keys, asked).fetchall()]

        found = yield Call(self._run, (read,))
        return cast("list[str]", found)  # what read() returned

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        """Wait for a release through this backend (rule 4), or the whole time."""
        if waiter.registered:
            yield Wait(waiter.wakeup, seconds)
        else:
            yield Sleep(seconds)

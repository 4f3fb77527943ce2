"""The PostgreSQL store: leases as rows of the TypeScript dmutex's table, one statement each.

Layout (shared with the TypeScript dmutex's PostgreSQL store): table
``table_name``, else ``table_prefix + service_name`` (``_dmutex_`` /
``_dsemaphore_``), in schema ``schema_name`` if given (else wherever the
search path finds or creates it), with columns ``"key" text PRIMARY KEY,
"value" text NOT NULL, "expired_at" timestamptz NOT NULL`` and the index
``"<table>_expired_at_idx"`` on ``"expired_at"``; identifiers in double
quotes, inner quotes doubled. Slot ``i`` of lock ``k`` is the row
``key = f"permit:{i}:{k}"``, ``value`` its token, ``expired_at`` its expiry.
dmutex adds one row per fenced key, ``fence:{k}`` (``statements.py``,
rule 4).

Rules of this module:

1. Time is the server's (``statements.py``, rule 1): every expiry is
   decided, stored and compared by the database's clock, as the TypeScript
   store's are, so hosts whose clocks disagree still agree on every lease.
   The instance's clock only times retries and renewals; a lease's
   ``expires_ms`` is what the server stored, rounded down to the millisecond.
2. Every operation is one statement (``statements.py``, rule 2), so one
   ``Call`` of the client's runner (``runners.py``): acquire with its
   fence, release, extend, a batch of up to :data:`RENEW_BATCH` renewals,
   the holders of a key, the table's held keys (``dmutex status``). A
   semaphore acquire that lost the slot it picked to another caller
   between its read and its upsert (``raced``) sends the statement again:
   one more per race lost, and only when another caller took a permit
   meanwhile.
3. An acquire finds its own token first (``statements.py``, rule 3): a copy
   re-sent after a lost reply answers with the slot the first copy took
   (its expiry and fence moved on, as Redis's script does), never a second.
   Release and extend match key, token and an expiry still in the future,
   so a holder whose lease ran out can neither remove nor prolong its
   successor's row, and a lease that expired answers False even if its row
   is still there. Nothing deletes expired rows; the next acquire of the
   slot overwrites them.
4. ``ready()`` creates the table and its index if missing and checks the
   table it finds: another relation of that name, or a table of another
   shape (columns, types, NOT NULL, primary key), is refused with what was
   found and what dmutex needs. A role that may not create tables can use
   a table that exists with its index: then ready() is one read.
5. A release notifies the table's channel in its own statement when the
   key's waiters are marked (``statements.py``, rule 7), and a waiter
   listens for it during its wait where its client can
   (``listening.py``): a pool lends it a connection, an asyncpg
   connection listens itself. Its failed attempts mark the key's waiters
   in their own statement (the first, then at most once a second, for
   ``retry_delay`` + 2 s), so that a release after the attempt notifies.
   A single psycopg connection, a SQLAlchemy engine, a store made with ``listen=False``
   (behind a pooler in transaction mode) and a clock other than the
   system's neither mark nor listen: their waiters sleep the wait out,
   and so poll within ``retry_delay`` (``waiting.py``, rule 3). Either way
   a failed attempt learns from its own statement when the first lease in
   its way ends, and the wait ends then at the latest: expiry notifies
   nobody. A wait that fails (the connection, the budget of lent
   connections) sleeps the rest; a woken waiter that then lost the race
   pauses before it listens again (``waiting.py``, rule 4).
6. PostgreSQL's ``text`` holds no NUL character: a key or token with one
   is refused (``InvalidArgumentError``) when the operation is asked for,
   before any request, the table's creation included
   (``dmutex._core.abc.TextRule``). Table and schema names with one are
   refused at construction (``dmutex._validate``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

from ..._clock import Clock, SystemClock
from ..._core.abc import Holder, Inspection, Renewed
from ..._core.effects import Call, Sleep, Steps
from ..._core.lease import MAX_EXPIRY_MS, Lease
from ..._core.waiting import REGISTRATION_MARGIN_MS, Waiter, lost_pause
from ..._errors import DMutexError
from ..._validate import refuse_nul
from ..blocking import REFRESH
from .listening import POOLED, Probe, listener
from .runners import Params, Row, runner
from .statements import COLUMNS, FOREIGN, PRIMARY_KEY, Statement, Statements

__all__ = ["RENEW_BATCH", "PostgresStore"]

# At most this many leases per renewal statement.
RENEW_BATCH = 256


def _int(value: object, what: str) -> int:
    """An integer column of a reply; anything else is a server that does not speak this SQL."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise DMutexError(f"unexpected {what} from PostgreSQL: {value!r}")
    return value


def _str(value: object, what: str) -> str:
    """A text column of a reply; anything else is a server that does not speak this SQL."""
    if not isinstance(value, str):
        raise DMutexError(f"unexpected {what} from PostgreSQL: {value!r}")
    return value


def _maybe_int(value: object, what: str) -> int | None:
    return None if value is None else _int(value, what)


def _one(rows: list[Row], width: int) -> Row:
    """The one row of ``width`` columns that a statement answers."""
    if len(rows) != 1 or len(rows[0]) != width:
        raise DMutexError(f"unexpected reply from PostgreSQL: {rows!r}")
    return rows[0]


class PostgresStore:
    """One table of lease rows on a PostgreSQL server; a ``Store``.

    ``client`` is a psycopg 3 connection or pool (sync or asyncio, as
    ``asynchronous`` says), an asyncpg connection or pool (asyncio), or a
    SQLAlchemy ``Engine`` or ``AsyncEngine`` on one of them.
    ``listen=False``: waiters never ``LISTEN`` (behind a pooler in
    transaction mode) and poll instead (rule 5). ``probe``: what a wait
    reads once it listens (``listening.py``, rule 2), if not the key's
    permits.
    """

    max_expiry_ms = MAX_EXPIRY_MS

    def __init__(
        self,
        client: object,
        table: str,
        max_permits: int,
        clock: Clock,
        *,
        schema: str | None = None,
        asynchronous: bool,
        fencing: bool = True,
        listen: bool = True,
        probe: Probe | None = None,
    ) -> None:
        self._sql = Statements.of(table, schema, fencing=fencing)
        self._index = self._sql.index_name
        self._run = runner(client, asynchronous=asynchronous)
        self._listen = (
            listener(client, self._sql, max_permits, asynchronous=asynchronous, probe=probe)
            if listen and isinstance(clock, SystemClock)
            else None
        )
        self._permits = max_permits
        self._clock = clock
        self._acquire = (
            self._sql.acquire_mutex
            if max_permits == 1
            else self._sql.acquire_semaphore_of(max_permits)
        )

    @property
    def clock(self) -> Clock:
        return self._clock

    def refuse_text(self, what: str, text: str) -> None:
        """Refuse a key or token with a NUL character, before any request (rule 6)."""
        refuse_nul(what, text, "PostgreSQL")

    @property
    def statements(self) -> Statements:
        """The statements this store sends."""
        return self._sql

    def _call(self, statement: Statement, params: Params) -> Steps[list[Row]]:
        rows = yield Call(self._run, (statement, params))
        return cast("list[Row]", rows)  # what a runner answers

    # --- ready -----------------------------------------------------------------

    def _shape(self) -> Steps[bool | None]:
        """Whether the table is indexed; None if absent. Raises for another relation or shape."""
        asked = {"table": self._sql.table, "index": self._index}
        kind, columns, key, indexed = _one((yield from self._call(self._sql.shape, asked)), 4)
        if kind is None:
            return None
        name = self._sql.table
        if kind not in ("r", "p"):
            raise DMutexError(f"{name} is not a table (relkind {kind!r}): dmutex needs one")
        if columns != COLUMNS or key != PRIMARY_KEY:
            raise DMutexError(
                f"the table {name} has another shape than dmutex's: columns ({columns}), "
                f"primary key ({key}); dmutex and the TypeScript dmutex need columns "
                f"({COLUMNS}), primary key ({PRIMARY_KEY})"
            )
        return bool(indexed)

    def _create(self, statement: Statement, made: tuple[bool | None, ...]) -> Steps[None]:
        """Run a ``CREATE ... IF NOT EXISTS``.

        A failure is forgiven if the shape then reads as one of ``made``:
        another process created the same thing at the same moment (which
        PostgreSQL may answer with a unique violation in its catalog).
        """
        try:
            yield from self._call(statement, {})
        except Exception:
            if (yield from self._shape()) not in made:
                raise

    def ready(self) -> Steps[None]:
        """Create the table and its index if missing; refuse a table of another shape (rule 4).

        One statement when both exist; else up to four (read, create the
        table, create the index, read again: another process may have
        created a table of another shape meanwhile).
        """
        state = yield from self._shape()
        if state is True:
            return
        if state is None:
            yield from self._create(self._sql.create_table, (False, True))
        yield from self._create(self._sql.create_index, (True,))
        if (yield from self._shape()) is None:
            raise DMutexError(f"the table {self._sql.table} could not be created")

    # --- operations ---------------------------------------------------------------

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None = None
    ) -> Steps[Lease | None]:
        """Take the slot holding ``token``, else a free or expired one: one statement (rule 2)."""
        params: dict[str, object] = {
            "key": key,
            "token": token,
            "ttl": ttl_ms,
            "permits": self._permits,
            "waiting": 0,
        }
        started = self._clock.monotonic()
        # Mark the key's waiters (statements.py, rule 7), again once a second.
        if (
            waiter is not None
            and self._listen is not None
            and not waiter.last
            and (not waiter.registered or started - waiter.registered_at >= REFRESH)
        ):
            params["waiting"] = waiter.window_ms
        while True:
            try:
                rows = yield from self._call(self._acquire, params)
            except Exception as error:
                if FOREIGN in str(error):
                    raise DMutexError(
                        f"the row 'fence:{key}' of table {self._sql.table} {FOREIGN}"
                    ) from error
                raise
            slot, expires, fence, ends, now, raced, _ = _one(rows, 7)
            if slot is not None:
                lease = Lease(key, token, _int(slot, "slot"), _int(expires, "expiry"))
                lease.fence = _maybe_int(fence, "fence")
                if waiter is not None:
                    waiter.registered = False
                return lease
            if raced is not True:
                break
        if waiter is not None:
            if params["waiting"]:
                waiter.registered, waiter.registered_at = True, started
            end, at = _maybe_int(ends, "expiry"), _int(now, "time")
            waiter.expires_in = None if end is None else max(end - at, 0) / 1000
        return None

    def _match(self, key: str, token: str, slot: int | None) -> dict[str, object]:
        """The parameters that pick ``key``'s row holding ``token``: in ``slot``, or in any."""
        first, last = (0, self._permits - 1) if slot is None else (slot, slot)
        return {"key": key, "token": token, "first": first, "last": last}

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        """Delete the active row holding ``token``: one statement."""
        rows = yield from self._call(self._sql.release, self._match(key, token, slot))
        return len(rows) > 0

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        """Move the expiry of the active row holding ``token`` to now + ttl: one statement."""
        params = {**self._match(key, token, slot), "ttl": ttl_ms}
        rows = yield from self._call(self._sql.extend, params)
        return _int(rows[0][0], "expiry") if rows else None

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        """Extend the leases that have not ended, up to :data:`RENEW_BATCH` per statement.

        A failed statement fails the leases it carried, and only those.
        """
        answers: list[Renewed] = [None] * len(leases)
        alive = [n for n, lease in enumerate(leases) if not lease.ended]
        for start in range(0, len(alive), RENEW_BATCH):
            batch = alive[start : start + RENEW_BATCH]
            params: dict[str, object] = {
                "names": [f"permit:{leases[n].slot}:{leases[n].key}" for n in batch],
                "tokens": [leases[n].token for n in batch],
                "ttls": [leases[n].ttl_ms for n in batch],
            }
            try:
                rows = yield from self._call(self._sql.extend_many, params)
            except Exception as error:  # noqa: BLE001 - the answer of each lease it carried
                for n in batch:
                    answers[n] = error
                continue
            for position, expires in rows:
                answers[batch[_int(position, "position") - 1]] = _int(expires, "expiry")
        return answers

    def holders(self, key: str) -> Steps[Inspection]:
        """The active permits of ``key`` and its fence counter: one statement, no change."""
        rows = yield from self._call(self._sql.holders, {"key": key, "permits": self._permits})
        found: list[Holder] = []
        fence: int | None = None
        now = 0
        for slot, value, expires, at in rows:
            now = _int(at, "time")
            if slot is None:
                fence = None if value is None else int(str(value))
            else:
                found.append(Holder(_int(slot, "slot"), str(value), _int(expires, "expiry")))
        return Inspection(sorted(found), fence, now)

    def keys(self, limit: int) -> Steps[list[str]]:
        """The first ``limit`` keys in byte order with an active permit in slots 0 .. N-1.

        One statement, no change (``statements.py``, rule 2).
        """
        params = {"permits": self._permits, "limit": limit}
        rows = yield from self._call(self._sql.keys, params)
        return [_str(row[0], "key") for row in rows]

    @property
    def listens(self) -> bool:
        """Whether its waiters listen for releases (rule 5); else they poll."""
        return self._listen is not None

    def watch(self, key: str, seconds: float) -> Steps[bool]:
        """Listen for a release of ``key`` up to ``seconds`` (``abc.Watching``), else sleep.

        As a waiter listens (rule 5): a pool or an asyncpg connection is
        woken; a single connection, an engine or a pooler sleeps it out.
        """
        if self._listen is None or seconds <= 0:
            yield Sleep(seconds)
            return False
        started = self._clock.monotonic()
        # The release notifies while the key's waiters mark is on (statements.py,
        # rule 7): an observer writes it as a failed attempt does, for its wait.
        waiting = math.ceil(seconds * 1000) + REGISTRATION_MARGIN_MS
        try:
            yield from self._call(self._sql.mark, {"key": key, "waiting": waiting})
        except Exception:  # noqa: BLE001 - Watching never raises: it sleeps out the rest
            rest = seconds - (self._clock.monotonic() - started)
            if rest > 0:
                yield Sleep(rest)
            return False
        rest = seconds - (self._clock.monotonic() - started)
        return rest > 0 and (yield from self._listened(key, rest)) is True

    def _listened(self, key: str, seconds: float) -> Steps[bool | None]:
        """One listen for ``key``: True woken, False timed out, None it could not (slept out)."""
        assert self._listen is not None  # the callers check
        started = self._clock.monotonic()
        try:
            woken = yield Call(self._listen, (key, seconds))
        except Exception:  # noqa: BLE001 - the wait degrades to sleeping, rule 3 of waiting.py
            woken = None
        if woken == POOLED:  # behind a pooler: poll from now on (listening.py, rule 4)
            self._listen = None
            woken = None
        if woken is None:
            rest = seconds - (self._clock.monotonic() - started)
            if rest > 0:
                yield Sleep(rest)
            return None
        return woken is True

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        """Listen for a release of ``key`` up to ``seconds``, else sleep (rule 5); never raises."""
        if waiter.woken:
            waiter.woken = False
            yield Sleep(lost_pause(seconds))
            return
        if self._listen is None or seconds <= 0:
            yield Sleep(seconds)
            return
        woken = yield from self._listened(key, seconds)
        if woken is not None:
            waiter.woken = woken

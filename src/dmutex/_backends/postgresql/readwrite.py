"""The PostgreSQL store of read-write locks: one row per key, decided, compare-and-set.

Layout and rules: ``../rwcas.py`` (the decisions, the state, the
compare-and-set), on the mutex store's table shape (``statements.py``), in
the ``_drwlock_`` table. What is PostgreSQL's here:

1. Time is ``statement_timestamp()`` of the read (``statements.py``, rule 1).
2. The write is one upsert: it inserts where the read found no row and
   updates only a row whose ``value`` is still the text read (its
   ``DO UPDATE ... WHERE``, which PostgreSQL evaluates on the row's latest
   version under its row lock, so two writers of one text cannot both
   apply). A write that can let a waiter in (``rwcas.py``, rule 5)
   notifies the table's channel, the key as payload, in the same statement:
   only when it applied, and leaving with its commit; whether or not the
   store that writes listens itself (a single connection's release must
   wake a pool's waiter). Unlike the mutex store's, it reads no waiters
   mark first: such a write notifies whether anyone waits or not.
3. A waiter listens as the mutex store's do (``listening.py``: a pool lends
   it a connection, an asyncpg connection listens itself; a single psycopg
   connection, a SQLAlchemy engine, ``listen=False``, a pooler in
   transaction mode and a clock other than the system's poll). Once
   listening it reads the key's row and ends its wait at once if the row
   would let a writer in (nothing held) or a reader (no writer, no intent,
   a place under ``max_readers``); else it waits for the notification or
   its time. So no release between the refused attempt and the ``LISTEN``
   is missed where it let someone in.
4. A key or token with a NUL character is refused before any request, as
   the mutex store refuses it (``store.py``, rule 6): PostgreSQL's
   ``text`` cannot hold one.
5. The write without its read (``rwcas.py``, rule 8) is one statement: an
   ``UPDATE`` of the row only while its ``value`` is the text the store
   remembers and the statement's time is in the window the store sends,
   the decided text's stamps replaced by that time (``n.ms + ttl``,
   ``greatest(counter + 1, n.us)``, ``n`` read as rule 1's read reads it),
   in a common table expression; the ``SELECT`` over it answers whether it
   applied and the statement's ms and µs, notifies as rule 2's write does
   (if asked and applied), and, where it did not apply, reads the row's
   value as the statement's snapshot holds it: the read that rule 1's way
   goes on from, so a stale memory costs the one statement and no more. It
   never inserts: a key whose row the store does not know goes rule 1's
   way.
6. Renewals without their reads (``rwcas.py``, rule 9) are one
   ``UPDATE ... FROM unnest(...)`` of rule 5's updates, fence-less, each
   row on its own old text and window, as the mutex store's batch is; it
   answers the statement's ms and µs and the keys it wrote.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from ..._clock import Clock
from ..._core.effects import Call, Steps
from ..._core.waiting import Waiter
from ..._errors import DMutexError
from .. import rwstate
from ..rwcas import (
    STAMP_EXPIRY,
    STAMP_FENCE,
    CasReadWriteStore,
    Extension,
    Stamped,
    StampedWrite,
)
from .listening import Probe
from .runners import Row, runner
from .statements import _FOREVER, _NOW, _NOW_US, Statement, _escape, _in_literal, _ms, qualified
from .store import PostgresStore

__all__ = ["PostgresReadWriteStore"]


def _read(t: str) -> Statement:
    """The key's row (its value, NULL if absent) and the server's time in ms and µs."""
    return Statement.of(
        f'SELECT r."value", {_ms(_NOW)}, {_NOW_US}\n'
        f'FROM (SELECT 1) AS one LEFT JOIN {t} AS r ON r."key" = %(row)s::text'
    )


def _write(t: str, channel: str) -> Statement:
    """Rule 2's upsert: 1 if it applied, else 0; it notifies ``channel`` if asked and applied."""
    return Statement.of(
        f'WITH w AS (INSERT INTO {t} AS t ("key", "value", "expired_at")\n'
        f"  VALUES (%(row)s::text, %(value)s::text, {_FOREVER})\n"
        '  ON CONFLICT ("key") DO UPDATE SET "value" = EXCLUDED."value"\n'
        '  WHERE t."value" = %(old)s::text\n'
        "  RETURNING 1)\n"
        "SELECT count(*)::int, CASE WHEN %(wake)s::bool AND count(*) > 0\n"
        f"  THEN pg_notify('{_escape(_in_literal(channel))}', %(key)s::text) END\n"
        "FROM w"
    )


def _stamped(t: str, channel: str) -> Statement:
    """Rule 5's one statement (``rwcas.py``, rule 8): the write without its read.

    It updates the row only if its ``value`` is still %(old)s and the
    statement's ms is in [%(since)s, %(until)s), the decided text's stamps
    replaced by the statement's time: the expiry by ``now_ms + ttl``
    (``_core.readwrite``: a grant's and an extend's ``now + ttl``), the fence
    by ``greatest(counter + 1, now_us)`` (``_core.fences.next_fence``). It
    answers one row: 1 if it applied, else 0; the statement's ms and µs
    (read as rule 1's read reads them); where it did not apply, the row's
    value as its snapshot holds it (NULL: no row); and the notification,
    sent if asked and applied.
    """
    return Statement.of(
        f"WITH n AS (SELECT {_ms(_NOW)} AS ms, {_NOW_US} AS us),\n"
        f'w AS (UPDATE {t} AS t SET "value" = replace(replace(%(value)s::text,\n'
        f"    '{STAMP_EXPIRY}', (n.ms + %(ttl)s::bigint)::text),\n"
        f"    '{STAMP_FENCE}', greatest(%(counter)s::bigint + 1, n.us)::text)\n"
        "  FROM n\n"
        '  WHERE t."key" = %(row)s::text AND t."value" = %(old)s::text\n'
        "    AND n.ms >= %(since)s::bigint AND n.ms < %(until)s::bigint\n"
        "  RETURNING 1),\n"
        "c AS (SELECT count(*)::int AS applied FROM w)\n"
        "SELECT c.applied, n.ms, n.us,\n"
        f'  CASE WHEN c.applied = 0 THEN (SELECT r."value" FROM {t} AS r\n'
        '    WHERE r."key" = %(row)s::text) END,\n'
        "  CASE WHEN %(wake)s::bool AND c.applied > 0\n"
        f"  THEN pg_notify('{_escape(_in_literal(channel))}', %(key)s::text) END\n"
        "FROM n, c"
    )


def _extend_stamped(t: str) -> Statement:
    """Rule 6's one statement (``rwcas.py``, rule 9): extends without their reads.

    Each row of the arrays (keys all different) is one :func:`_stamped`
    update without a fence: applied only over its old text, in its window.
    Answers one row: the statement's ms and µs, and the keys it wrote.
    """
    return Statement.of(
        f"WITH n AS (SELECT {_ms(_NOW)} AS ms, {_NOW_US} AS us),\n"
        "v AS (SELECT * FROM unnest(%(rows)s::text[], %(olds)s::text[], %(values)s::text[],\n"
        "    %(ttls)s::bigint[], %(sinces)s::bigint[], %(untils)s::bigint[])\n"
        "    AS v(row_key, old, new, ttl, since, until)),\n"
        f"w AS (UPDATE {t} AS t\n"
        f"  SET \"value\" = replace(v.new, '{STAMP_EXPIRY}', (n.ms + v.ttl)::text)\n"
        "  FROM v, n\n"
        '  WHERE t."key" = v.row_key AND t."value" = v.old\n'
        "    AND n.ms >= v.since AND n.ms < v.until\n"
        '  RETURNING t."key")\n'
        'SELECT n.ms, n.us, ARRAY(SELECT w."key" FROM w) FROM n'
    )


# The text of a lock that holds neither a writer nor a reader (rwstate.py, rule 1),
# as a LIKE pattern: its start.
FREE_PATTERN = '{"dmutex":"rwlock","w":null,"r":{},%'


def _page(t: str) -> Statement:
    """Up to %(size)s rows after %(after)s in byte order that may hold something (listing)."""
    return Statement.of(
        f'SELECT r."key", r."value", {_ms(_NOW)}\n'
        f"FROM {t} AS r\n"
        'WHERE r."key" LIKE \'rwlock:%%\' AND r."key" COLLATE "C" > %(after)s::text\n'
        f"  AND r.\"value\" NOT LIKE '{_escape(FREE_PATTERN)}'\n"
        'ORDER BY r."key" COLLATE "C" LIMIT %(size)s::int'
    )


def _admits(max_readers: int | None) -> Callable[[Sequence[Row]], bool]:
    """The probe's verdict (rule 3): whether the key's row would let some waiter in now.

    A writer gets in where nothing is held; a reader where no writer holds
    or intends and a place is left under ``max_readers``. The probe does
    not know which the waiter is, so it says go if either would get in: a
    reader woken for a writer's chance tries once and pauses
    (``waiting.py``, rule 4).
    """

    def admits(rows: Sequence[Row]) -> bool:
        if len(rows) != 1:
            return False
        value, now, _ = rows[0]
        if value is None:
            return True
        state = rwstate.decode(value, fenced=True)
        if state is None or not isinstance(now, int):
            return False
        state.prune(now)
        if state.writer is not None:
            return False
        room = max_readers is None or len(state.readers) < max_readers
        return not state.readers or (not state.intents and room)

    return admits


class PostgresReadWriteStore(CasReadWriteStore):
    """One table of read-write lock rows on a PostgreSQL server; a ``ReadWriteStore``.

    ``client`` is any client :class:`~.store.PostgresStore` takes;
    ``listen=False`` as there.
    """

    server = "PostgreSQL"
    stamped_writes = True
    stamped_batches = True

    def __init__(
        self,
        client: object,
        table: str,
        max_readers: int | None,
        clock: Clock,
        *,
        schema: str | None = None,
        asynchronous: bool,
        fencing: bool = True,
        listen: bool = True,
    ) -> None:
        named = qualified(table, schema)
        super().__init__(named, max_readers, clock, fencing=fencing)
        self._read_sql = _read(_escape(named))
        probe = Probe(self._read_sql, lambda key: {"row": f"rwlock:{key}"}, _admits(max_readers))
        # The mutex store's table (its shape, ready() and channel) and its wait.
        self._rows = PostgresStore(
            client,
            table,
            1,
            clock,
            schema=schema,
            asynchronous=asynchronous,
            listen=listen,
            probe=probe,
        )
        self._write_sql = _write(_escape(named), self._rows.statements.channel)
        self._stamped_sql = _stamped(_escape(named), self._rows.statements.channel)
        self._extend_sql = _extend_stamped(_escape(named))
        self._page_sql = _page(_escape(named))
        self._run = runner(client, asynchronous=asynchronous)

    @property
    def listens(self) -> bool:
        """Whether its waiters listen for releases (rule 3); else they poll."""
        return self._rows.listens

    def refuse_text(self, what: str, text: str) -> None:
        """Refuse a key or token with a NUL character, before any request (rule 4)."""
        self._rows.refuse_text(what, text)

    def ready(self) -> Steps[None]:
        """The mutex store's ``ready()``: create the table and index, refuse another shape."""
        return self._rows.ready()

    def _call(self, statement: Statement, params: dict[str, object]) -> Steps[list[Row]]:
        rows = yield Call(self._run, (statement, params))
        return cast("list[Row]", rows)  # what a runner answers

    def _fetch(self, key: str) -> Steps[list[Row]]:
        return (yield from self._call(self._read_sql, {"row": f"rwlock:{key}"}))

    def _page(self, after: str, size: int) -> Steps[list[Row]]:
        return (yield from self._call(self._page_sql, {"after": after, "size": size}))

    def _write(self, key: str, old: object, new: str, wake: bool) -> Steps[bool]:
        params: dict[str, object] = {
            "row": f"rwlock:{key}",
            "value": new,
            "old": old,
            "wake": wake,
            "key": key,
        }
        rows = yield from self._call(self._write_sql, params)
        return bool(rows and rows[0][0])

    def _write_stamped(self, write: StampedWrite) -> Steps[Stamped]:
        params = {**write.params(), "wake": write.wake, "key": write.key}
        rows = yield from self._call(self._stamped_sql, params)
        if len(rows) != 1 or len(rows[0]) != 5:
            raise DMutexError(f"unexpected reply from PostgreSQL: {rows!r}")
        applied, now, now_us, value, _ = rows[0]
        if applied not in (0, 1) or not isinstance(now, int) or not isinstance(now_us, int):
            raise DMutexError(f"unexpected reply from PostgreSQL: {rows!r}")
        return Stamped(applied == 1, now, now_us, value)

    def _extend_stamped(self, writes: Sequence[Extension]) -> Steps[tuple[set[str], int, int]]:
        params: dict[str, object] = {
            "rows": [f"rwlock:{w.key}" for w in writes],
            "olds": [w.old for w in writes],
            "values": [w.new for w in writes],
            "ttls": [w.ttl_ms for w in writes],
            "sinces": [w.since_ms for w in writes],
            "untils": [w.until_ms for w in writes],
        }
        rows = yield from self._call(self._extend_sql, params)
        if len(rows) != 1 or len(rows[0]) != 3:
            raise DMutexError(f"unexpected reply from PostgreSQL: {rows!r}")
        now, now_us, names = rows[0]
        if not isinstance(now, int) or not isinstance(now_us, int) or not isinstance(names, list):
            raise DMutexError(f"unexpected reply from PostgreSQL: {rows!r}")
        return {str(name).removeprefix("rwlock:") for name in names}, now, now_us

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        """Listen for a change of ``key`` up to ``seconds``, else sleep (rule 3); never raises."""
        return self._rows.wait(key, waiter, seconds)

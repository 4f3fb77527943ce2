"""The MySQL store of read-write locks: one row per key, decided, compare-and-set.

Layout and rules: ``../rwcas.py`` (the decisions, the state, the
compare-and-set), on the mutex store's table shape (``statements.py``) but
for its ``value`` column, ``mediumtext`` (a state with many readers needs
more than 128 characters; up to 16 MiB), in the ``_drwlock_`` table. What
is MySQL's here:

1. Time is the read's ``UTC_TIMESTAMP(6)`` (``statements.py``, rule 1).
2. The write is one upsert: ``INSERT ... ON DUPLICATE KEY UPDATE``, whose
   update keeps the row's value unless it is still the text read (InnoDB
   runs it under the row's lock, so two writers of one text cannot both
   apply). It answers in its OK packet (``statements.py``, rule 2): the
   insert's values set ``LAST_INSERT_ID`` to 1, the update sets it again to
   1 if it applied, to 0 if not.
3. Waking is the mutex store's (``store.py``, rule 5): a waiter registers
   with this process's waiters of the client before each attempt, and a
   write that can let a waiter in wakes them once it applied. Other
   processes' waiters poll within ``retry_delay``, told by their refusal
   when what stands in their way lapses at the latest.
4. The write without its read (``rwcas.py``, rule 8) is one ``UPDATE`` of
   the row, only while its ``value`` is the text the store remembers and
   the statement's ``NOW_MS`` is in the window the store sends, the
   decided text's stamps replaced by the statement's time (``NOW_MS +
   ttl``, ``GREATEST(counter + 1, NOW_US)``: one ``UTC_TIMESTAMP(6)`` a
   statement, so the two agree). With no ``RETURNING`` on ``UPDATE``, it
   answers in its OK packet (rule 2's way): ``LAST_INSERT_ID(NOW_US)``
   where it applied, so the id is the statement's µs (the store takes its
   ms as ``DIV 1000`` does), else 0. One that did not apply is followed by
   rule 1's read. It never inserts: a key whose row the store does not
   know goes rule 1's way.
5. Renewals without their reads (``rwcas.py``, rule 9) are two statements
   per batch (one where no row changed), a batch being up to
   ``store.RENEW_BATCH`` leases and :data:`RENEW_TEXT` characters of
   remembered text (a larger call is split, each part its own batch).
   The first is one ``UPDATE`` of rule 4's updates, fence-less, one
   ``CASE`` branch a key (keys all different): a row changes only while
   its ``value`` is its own old text and the statement's ``NOW_MS`` is in
   its own window, its text's stamp replaced by ``NOW_MS`` plus its own
   TTL; its OK packet's id is ``LAST_INSERT_ID(NOW_US)``, set by any row it
   changed, so the statement's µs (its ms ``DIV 1000``), else 0. An id of
   0 means no row changed: nothing more is sent. Else the second reads the
   batch's rows by key, and the store counts a key written where its value
   is that key's text stamped with the first statement's ``NOW_MS + ttl``
   and that ms is in the key's window: what the update wrote, unless
   another store changed the row between the two, which only sends that
   lease rule 1's way (``rwcas.py``, rule 9); a row that holds that text
   without this update (another writer of the very same text) holds the
   same extended lease.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from ..._clock import Clock
from ..._core.abc import Renewed
from ..._core.effects import Call, Sleep, Steps, Wait
from ..._core.lease import Lease
from ..._core.waiting import Waiter
from ..._errors import DMutexError
from ..rwcas import (
    STAMP_EXPIRY,
    STAMP_FENCE,
    CasReadWriteStore,
    Extension,
    Stamped,
    StampedWrite,
)
from .runners import Outcome, Row, runner
from .statements import FOREVER, NOW_MS, NOW_US, Statement
from .store import RENEW_BATCH, MySQLStore, waiters_of

__all__ = ["RENEW_TEXT", "MySQLReadWriteStore"]

# Rule 2: a value of that column type, up to 16 MiB.
VALUE_TYPE = "mediumtext"

# Rule 5: at most this many characters of remembered text a renewal batch carries, unless
# one lease's alone is more. Each goes twice (the old text, and nearly alike the new):
# about 2 MiB for texts in ASCII, below max_allowed_packet's smallest default (4 MiB).
RENEW_TEXT = 1 << 20


def _read(t: str) -> Statement:
    """The key's row (its value, NULL if absent) and the server's time in ms and µs."""
    return Statement(
        f"SELECT r.`value`, {NOW_MS}, {NOW_US}\n"
        f"FROM (SELECT 1) AS one LEFT JOIN {t} AS r ON r.`key` = %(row)s"
    )


def _write(t: str) -> Statement:
    """Rule 2's upsert: its OK packet's id is 1 if it applied, else 0."""
    return Statement(
        f"INSERT INTO {t} (`key`, `value`, `expired_at`)\n"
        f"VALUES (%(row)s, %(value)s, LAST_INSERT_ID(1) * {FOREVER})\n"
        "ON DUPLICATE KEY UPDATE `value` = IF(`value` = %(old)s,\n"
        "  CONCAT(%(value)s, LEFT(LAST_INSERT_ID(1), 0)),\n"
        "  CONCAT(`value`, LEFT(LAST_INSERT_ID(0), 0)))"
    )


def _stamped(t: str) -> Statement:
    """Rule 4's one statement (``rwcas.py``, rule 8): the write without its read.

    It updates the row only if its ``value`` is still %(old)s and the
    statement's ms is in [%(since)s, %(until)s), the decided text's stamps
    replaced by the statement's time: the expiry by ``NOW_MS + ttl``
    (``_core.readwrite``: a grant's and an extend's ``now + ttl``), the fence
    by ``GREATEST(counter + 1, NOW_US)`` (``_core.fences.next_fence``). Its
    OK packet's id is the statement's µs if it applied (``NOW_MS`` is that
    ``DIV 1000``: one ``UTC_TIMESTAMP(6)`` a statement), else 0.
    """
    return Statement(
        f"UPDATE {t} SET `value` = CONCAT(REPLACE(REPLACE(%(value)s,\n"
        f"    '{STAMP_EXPIRY}', {NOW_MS} + %(ttl)s),\n"
        f"    '{STAMP_FENCE}', GREATEST(%(counter)s + 1, {NOW_US})),\n"
        f"  LEFT(LAST_INSERT_ID({NOW_US}), 0))\n"
        "WHERE `key` = %(row)s AND `value` = %(old)s\n"
        f"  AND {NOW_MS} >= %(since)s AND {NOW_MS} < %(until)s"
    )


def _extend_stamped(t: str, count: int) -> Statement:
    """Rule 5's update (``rwcas.py``, rule 9): ``count`` extends without their reads.

    Lease ``n`` is ``%(row{n})s``: it changes only while its ``value`` is
    ``%(old{n})s`` and the statement's ms is in [``%(since{n})s``,
    ``%(until{n})s``), to ``%(value{n})s`` with its stamp replaced by
    ``NOW_MS + %(ttl{n})s``. Its OK packet's id is the statement's µs if any
    row changed (``NOW_MS`` is that ``DIV 1000``), else 0.
    """
    keys = range(count)
    rows = ", ".join(f"%(row{n})s" for n in keys)
    values = "".join(f"\n    WHEN %(row{n})s THEN %(value{n})s" for n in keys)
    ttls = "".join(f" WHEN %(row{n})s THEN %(ttl{n})s" for n in keys)
    terms = "".join(
        f"\n    WHEN %(row{n})s THEN `value` = %(old{n})s"
        f" AND {NOW_MS} >= %(since{n})s AND {NOW_MS} < %(until{n})s"
        for n in keys
    )
    return Statement(
        f"UPDATE {t} SET `value` = CONCAT(REPLACE(CASE `key`{values} END,\n"
        f"    '{STAMP_EXPIRY}', {NOW_MS} + CASE `key`{ttls} END),\n"
        f"  LEFT(LAST_INSERT_ID({NOW_US}), 0))\n"
        f"WHERE `key` IN ({rows})\n"
        f"  AND CASE `key`{terms} END"
    )


def _renewed(t: str, count: int) -> Statement:
    """Rule 5's read after the update: the rows ``(key, value)`` of ``%(row0)s`` ..."""
    rows = ", ".join(f"%(row{n})s" for n in range(count))
    return Statement(f"SELECT `key`, `value` FROM {t} WHERE `key` IN ({rows})")


def _text(value: object) -> object:
    """A text column's value as a ``str`` (a driver may answer bytes for a binary collation)."""
    return bytes(value).decode() if isinstance(value, (bytes, bytearray)) else value


# The text of a lock that holds neither a writer nor a reader (rwstate.py, rule 1),
# as a LIKE pattern: its start.
FREE_PATTERN = '{"dmutex":"rwlock","w":null,"r":{},%'


def _page(t: str) -> Statement:
    """Up to %(size)s rows after %(after)s in byte order that may hold something (listing)."""
    return Statement(
        f"SELECT `key`, `value`, {NOW_MS} FROM {t}\n"
        "WHERE `key` LIKE 'rwlock:%%' AND `key` > %(after)s\n"
        f"  AND `value` NOT LIKE '{FREE_PATTERN.replace('%', '%%')}'\n"
        "ORDER BY `key` LIMIT %(size)s"
    )


class MySQLReadWriteStore(CasReadWriteStore):
    """One table of read-write lock rows on a MySQL or MariaDB server; a ``ReadWriteStore``.

    ``client`` is any client :class:`~.store.MySQLStore` takes.
    """

    server = "MySQL"
    stamped_writes = True
    stamped_batches = True

    def __init__(
        self,
        client: object,
        table: str,
        max_readers: int | None,
        clock: Clock,
        *,
        database: str | None = None,
        asynchronous: bool,
        fencing: bool = True,
    ) -> None:
        # The mutex store's table checks and creation, with a wider value column.
        self._rows = MySQLStore(
            client,
            table,
            1,
            clock,
            database=database,
            asynchronous=asynchronous,
            value_type=VALUE_TYPE,
        )
        sql = self._rows.statements
        super().__init__(sql.table, max_readers, clock, fencing=fencing)
        t = sql.table.replace("%", "%%")  # a driver would read "%" as a placeholder
        self._read_sql = _read(t)
        self._write_sql = _write(t)
        self._stamped_sql = _stamped(t)
        self._page_sql = _page(t)
        self._t = t
        # Rule 5's statements, by the batch's size.
        self._extend_sql: dict[int, tuple[Statement, Statement]] = {}
        self._run = runner(client, asynchronous=asynchronous)
        self._waiting = waiters_of(client)

    def ready(self) -> Steps[None]:
        """The mutex store's ``ready()``, for a ``mediumtext`` value column."""
        return self._rows.ready()

    def _call(self, statement: Statement, params: dict[str, object]) -> Steps[Outcome]:
        outcome = yield Call(self._run, (statement, params))
        return cast(Outcome, outcome)  # what a runner answers

    def _fetch(self, key: str) -> Steps[list[Row]]:
        return (yield from self._call(self._read_sql, {"row": f"rwlock:{key}"})).rows

    def _page(self, after: str, size: int) -> Steps[list[Row]]:
        return (yield from self._call(self._page_sql, {"after": after, "size": size})).rows

    def _write(self, key: str, old: object, new: str, wake: bool) -> Steps[bool]:
        params: dict[str, object] = {"row": f"rwlock:{key}", "value": new, "old": old}
        answer = (yield from self._call(self._write_sql, params)).answer
        if answer not in (0, 1):
            raise DMutexError(f"unexpected answer from MySQL to a write: {answer!r}")
        return answer == 1

    def _write_stamped(self, write: StampedWrite) -> Steps[Stamped]:
        params = write.params()
        answer = (yield from self._call(self._stamped_sql, params)).answer
        if not isinstance(answer, int) or answer < 0:
            raise DMutexError(f"unexpected answer from MySQL to a write: {answer!r}")
        if answer == 0:
            return Stamped(False)
        return Stamped(True, answer // 1000, answer)

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        """``rwcas.py``'s renewals (rule 9), in parts of at most :data:`RENEW_BATCH` leases.

        And of at most :data:`RENEW_TEXT` characters of remembered text,
        unless one lease's alone is more (rule 5): each part is its own batch.
        """
        answers: list[Renewed] = []
        start = 0
        while start < len(leases):
            end, size = start, 0
            while end < len(leases) and end - start < RENEW_BATCH:
                text = self._known.get(leases[end].key, (None, 0))[0]
                size += len(text or "")
                if end > start and size > RENEW_TEXT:
                    break
                end += 1
            part = leases[start:end]
            answers.extend((yield from super().extend_many(part)))
            start = end
        return answers

    def _extend_stamped(self, writes: Sequence[Extension]) -> Steps[tuple[set[str], int, int]]:
        count = len(writes)
        sql = self._extend_sql.get(count)
        if sql is None:
            sql = self._extend_sql[count] = (
                _extend_stamped(self._t, count),
                _renewed(self._t, count),
            )
        update, read = sql
        params: dict[str, object] = {}
        rows: dict[str, object] = {}
        for n, w in enumerate(writes):
            rows[f"row{n}"] = f"rwlock:{w.key}"
            params[f"value{n}"] = w.new
            params[f"old{n}"] = w.old
            params[f"ttl{n}"] = w.ttl_ms
            params[f"since{n}"] = w.since_ms
            params[f"until{n}"] = w.until_ms
        params.update(rows)
        answer = (yield from self._call(update, params)).answer
        if not isinstance(answer, int) or answer < 0:
            raise DMutexError(f"unexpected answer from MySQL to a renewal: {answer!r}")
        if answer == 0:
            return set(), 0, 0  # no row changed: nothing to read
        now_us, now = answer, answer // 1000
        found = (yield from self._call(read, rows)).rows
        values: dict[object, object] = {}
        for row in found:
            if len(row) != 2:
                raise DMutexError(f"unexpected reply from MySQL: {row!r}")
            values[_text(row[0])] = _text(row[1])
        written = {
            w.key
            for w in writes
            if w.since_ms <= now < w.until_ms
            and values.get(f"rwlock:{w.key}") == w.new.replace(STAMP_EXPIRY, str(now + w.ttl_ms))
        }
        return written, now, now_us

    def _name(self, key: str) -> tuple[str, str]:
        return (self._table, f"rwlock:{key}")

    def _woke(self, key: str) -> None:
        self._waiting.wake(self._name(key))

    def _before(self, key: str, waiter: Waiter | None) -> None:
        if waiter is not None and not waiter.last:
            self._waiting.register(self._name(key), waiter.wakeup)

    def _after(self, key: str, waiter: Waiter | None, granted: bool) -> None:
        if waiter is None:
            return
        registering = not waiter.last
        if granted or not registering:
            self._waiting.forget(self._name(key), waiter.wakeup)
        waiter.registered = registering and not granted

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        """Wait for a wake through this client (rule 3), or the whole time."""
        if waiter.registered:
            yield Wait(waiter.wakeup, seconds)
        else:
            yield Sleep(seconds)

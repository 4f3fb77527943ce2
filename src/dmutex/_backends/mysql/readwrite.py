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
"""

from __future__ import annotations

from typing import cast

from ..._clock import Clock
from ..._core.effects import Call, Sleep, Steps, Wait
from ..._core.waiting import Waiter
from ..._errors import DMutexError
from ..rwcas import STAMP_EXPIRY, STAMP_FENCE, CasReadWriteStore, Stamped, StampedWrite
from .runners import Outcome, Row, runner
from .statements import FOREVER, NOW_MS, NOW_US, Statement
from .store import MySQLStore, waiters_of

__all__ = ["MySQLReadWriteStore"]

# Rule 2: a value of that column type, up to 16 MiB.
VALUE_TYPE = "mediumtext"


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

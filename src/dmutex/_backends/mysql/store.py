"""The MySQL store: leases as rows of the TypeScript dmutex's table, in the fewest statements.

Layout (shared with the TypeScript dmutex's MySQL store): table
``table_name``, else ``table_prefix + service_name`` (``_dmutex_`` /
``_dsemaphore_``), in database ``database_name`` if given (else the
connection's current one), with columns ``key varchar(512) NOT NULL PRIMARY
KEY, value varchar(128) NOT NULL, expired_at bigint NOT NULL`` (epoch
milliseconds), the index ``expired_at_idx`` on ``expired_at``, and
``ENGINE=InnoDB``; identifiers in backquotes, inner ones doubled. Slot ``i``
of lock ``k`` is the row ``permit:{i}:{k}``, ``value`` its token. dmutex
adds one row per fenced key, ``fence:{k}`` (``statements.py``, rule 4).

Rules of this module:

1. Time is the server's (``statements.py``, rule 1): every expiry is
   decided, stored and compared by the database's clock, so that hosts
   whose clocks disagree still agree on every lease. The TypeScript store
   uses its host's clock instead; in a mixed fleet a TypeScript host whose
   clock runs ahead of the server's by ``d`` takes a lease ``d`` before it
   expires, as it does against another TypeScript host. The instance's
   clock only times retries and renewals.
2. Round trips (``docs/usage/mysql.md`` has the table): a mutex's acquire
   is one statement, granted or refused, its fence included
   (``statements.py``, rule 4). A semaphore's acquire reads the
   key's slots first (one statement, the same as ``holders``) and then
   takes a free one, so two; one when every slot is held; one more per
   race lost to another caller between the read and the take. Release,
   extend, ``holders`` and ``keys`` (the held keys, with a ``LIMIT``) are
   one statement each; a batch of up to :data:`RENEW_BATCH` renewals
   two (the update, then which rows it extended, which MySQL's OK packet
   cannot say). ``fencing=None`` keeps a fence here too, since it costs no
   statement: only a second row written in the grant's.
3. An acquire finds its own token first (``statements.py``, rule 3): a copy
   re-sent after a lost reply answers with the slot the first copy took
   (its expiry moved on), never a second. Release and extend match key,
   token and an expiry still in the future, so a holder whose lease ran
   out can neither remove nor prolong its successor's row.
4. ``ready()`` creates the table if missing and checks the table it finds:
   another kind of relation, another engine than InnoDB, another shape, a
   key or value column that does not compare byte for byte (the TypeScript
   store's ``CREATE TABLE`` takes the database's default collation, which
   is case-insensitive: the error says the ``ALTER TABLE`` that fixes it),
   or a session that could change a key silently (neither ``utf8mb4`` nor a
   strict SQL mode) is refused with what was found and what dmutex needs.
5. A release wakes at once the retrying acquires of its key that wait
   through the same client object (threads and tasks of this process), as
   the SQLite store does; a waiter registers before each attempt, so no
   release after that attempt's read misses it. Other processes send no
   signal: their waiters poll within ``retry_delay``, and a failed attempt
   learns when the first lease in its way ends.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import cast

from ..._clock import Clock
from ..._core.abc import Holder, Inspection, Renewed
from ..._core.chance import CHANCE
from ..._core.effects import Call, Sleep, Steps, Wait
from ..._core.lease import MAX_EXPIRY_MS, Lease
from ..._core.waiting import Waiter, Wakeup
from ..._errors import DMutexError
from .runners import Outcome, Params, runner
from .statements import (
    COLLATIONS,
    LISTED,
    Statement,
    Statements,
    fence_of,
    granted,
    refused,
)

__all__ = ["RENEW_BATCH", "MySQLStore"]

# At most this many leases per renewal statement.
RENEW_BATCH = 128

# The table's shape as ready() reads it back: (column, type, nullable) in order.
COLUMNS = (
    ("key", "varchar(512)", "NO"),
    ("value", "varchar(128)", "NO"),
    ("expired_at", "bigint(20)", "NO"),
)
_TEXT_COLUMNS = ("key", "value")
_STRICT = ("STRICT_TRANS_TABLES", "STRICT_ALL_TABLES")


def _int(value: object, what: str) -> int:
    """An integer column of a reply; anything else is a server that does not speak this SQL."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise DMutexError(f"unexpected {what} from MySQL: {value!r}")
    return value


def _text(value: object) -> str:
    """A text column as str (a driver may answer bytes for a binary collation)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode()
    return str(value)


class Waiting:
    """The retrying acquires of this process that wait through one client (rule 5)."""

    __slots__ = ("__weakref__", "by_key", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_key: dict[tuple[str, str], weakref.WeakSet[Wakeup]] = {}

    def register(self, name: tuple[str, str], wakeup: Wakeup) -> None:
        with self.lock:
            wakeup.clear()
            self.by_key.setdefault(name, weakref.WeakSet()).add(wakeup)

    def forget(self, name: tuple[str, str], wakeup: Wakeup) -> None:
        with self.lock:
            wakeups = self.by_key.get(name)
            if wakeups is not None:
                wakeups.discard(wakeup)
                if not wakeups:
                    del self.by_key[name]

    def wake(self, name: tuple[str, str]) -> None:
        with self.lock:
            woken = list(self.by_key.pop(name, ()))
        for wakeup in woken:
            wakeup.set()  # outside the lock: a wakeup calls its listeners


_CLIENTS: weakref.WeakKeyDictionary[object, Waiting] = weakref.WeakKeyDictionary()
_CLIENTS_LOCK = threading.Lock()


def waiters_of(client: object) -> Waiting:
    """The waiters of ``client``, shared by every store on it; per store if it takes no weakref."""
    with _CLIENTS_LOCK:
        try:
            return _CLIENTS.setdefault(client, Waiting())
        except TypeError:
            return Waiting()


class MySQLStore:
    """One table of lease rows on a MySQL or MariaDB server; a ``Store``.

    ``client`` is a PyMySQL, mysqlclient or mysql-connector connection, a
    mysql-connector pool (sync), an aiomysql or asyncmy connection or pool
    (asyncio), or a SQLAlchemy ``Engine`` / ``AsyncEngine`` on one of them.
    """

    max_expiry_ms = MAX_EXPIRY_MS

    def __init__(
        self,
        client: object,
        table: str,
        max_permits: int,
        clock: Clock,
        *,
        database: str | None = None,
        asynchronous: bool,
        fencing: bool = False,
        value_type: str = "varchar(128)",
    ) -> None:
        self._sql = Statements.of(table, database)
        self._value_type = value_type
        self._run = runner(client, asynchronous=asynchronous)
        self._waiting = waiters_of(client)
        self._permits = max_permits
        self._pick_sql = self._sql.pick(max_permits)
        self._clock = clock
        self._fencing = fencing

    @property
    def clock(self) -> Clock:
        return self._clock

    @property
    def statements(self) -> Statements:
        """The statements this store sends."""
        return self._sql

    def _call(self, statement: Statement, params: Params) -> Steps[Outcome]:
        outcome = yield Call(self._run, (statement, params))
        return cast(Outcome, outcome)  # what a runner answers

    # --- ready -----------------------------------------------------------------

    def _shape(self) -> Steps[str | None]:
        """The server's flavour if the table is absent, else None; raises as rule 4 says."""
        table, database = self._sql.table, self._sql.database
        asked = {"table": self._sql.name, "database": database}
        session, *rows = (yield from self._call(self._sql.shape, asked)).rows
        _, version, charset, mode, *_ = session
        if _text(charset) != "utf8mb4" and not any(m in _text(mode) for m in _STRICT):
            raise DMutexError(
                f"the MySQL session uses character set {_text(charset)} and a SQL mode without "
                "STRICT_TRANS_TABLES: a key it cannot encode would be changed, not refused. "
                "Connect with charset utf8mb4, or a strict SQL mode"
            )
        flavour = "mariadb" if "mariadb" in _text(version).lower() else "mysql"
        if not rows:
            return flavour
        columns = [tuple(_text(part) for part in row[1:8]) for row in rows]
        kind, engine = columns[0][0], columns[0][1]
        if kind != "BASE TABLE":
            raise DMutexError(f"{table} is not a table ({kind}): dmutex needs one")
        if engine.lower() != "innodb":
            raise DMutexError(f"the table {table} uses the {engine} engine: dmutex needs InnoDB")
        found = tuple(
            (name, kind_.lower().replace(" signed", ""), null)
            for _, _, name, kind_, null, _, _ in columns
        )
        keyed = [name for _, _, name, _, _, _, key in columns if key == "PRI"]
        indexed = bool(rows[0][8])
        if not _same_columns(found, self._value_type) or keyed != ["key"] or not indexed:
            raise DMutexError(
                f"the table {table} has another shape than dmutex's: columns {found}, primary "
                f"key {keyed}, index expired_at_idx {'present' if indexed else 'missing'}; dmutex "
                f"needs `key` varchar(512) NOT NULL PRIMARY KEY, `value` {self._value_type} "
                "NOT NULL, `expired_at` bigint NOT NULL, INDEX `expired_at_idx` (`expired_at`)"
            )
        loose = [
            (name, kind_, collation)
            for _, _, name, kind_, _, collation, _ in columns
            if name in _TEXT_COLUMNS and collation not in COLLATIONS.values()
        ]
        if loose:
            needed = COLLATIONS[flavour]
            found_as = ", ".join(f"`{name}` by {collation}" for name, _, collation in loose)
            fix = ", ".join(
                f"MODIFY `{name}` {kind_} CHARACTER SET utf8mb4 COLLATE {needed} NOT NULL"
                for name, kind_, _ in loose
            )
            raise DMutexError(
                f"the table {table} compares {found_as}, not byte for byte ({needed}): keys "
                "that differ only in case, accents or trailing spaces would be one lock (the "
                "TypeScript store's CREATE TABLE takes the database's default collation). "
                f"Fix it with: ALTER TABLE {table} {fix}"
            )
        return None

    def ready(self) -> Steps[None]:
        """Create the table if missing; refuse a table of another shape (rule 4).

        One statement when it exists; else three (read, create, read again:
        another process may have created one of another shape meanwhile).
        """
        flavour = yield from self._shape()
        if flavour is None:
            return
        yield from self._call(self._sql.create(flavour, self._value_type), {})
        if (yield from self._shape()) is not None:
            raise DMutexError(f"the table {self._sql.table} could not be created")

    # --- operations ---------------------------------------------------------------

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None = None
    ) -> Steps[Lease | None]:
        """Take the slot holding ``token``, else a free or expired one (rule 2)."""
        name = (self._sql.table, key)
        registering = waiter is not None and not waiter.last
        if waiter is not None and registering:
            self._waiting.register(name, waiter.wakeup)
        try:
            lease, ends = yield from self._take(key, token, ttl_ms)
        except BaseException:
            if waiter is not None:
                self._waiting.forget(name, waiter.wakeup)
            raise
        if waiter is not None:
            if lease is not None or not registering:
                self._waiting.forget(name, waiter.wakeup)
            waiter.registered = lease is None and registering
            waiter.expires_in = None if ends is None else ends / 1000
        return lease

    def _take(self, key: str, token: str, ttl_ms: int) -> Steps[tuple[Lease | None, int | None]]:
        """The lease taken, or None and the ms until the first lease in the way ends."""
        take = self._sql.take_fenced if self._fencing else self._sql.take
        while True:
            slot = 0
            if self._permits > 1:
                picked, ends = yield from self._pick(key, token)
                if picked is None:
                    return None, ends
                slot = picked
            params = {"row": f"permit:{slot}:{key}", "token": token, "ttl": ttl_ms}
            if self._fencing:
                params["fence"] = f"fence:{key}"
            answer = (yield from self._call(take, params)).answer
            expires = granted(answer)
            if expires is not None:
                lease = Lease(key, token, slot, expires)
                if self._fencing:
                    fence = fence_of(answer, ttl_ms)
                    lease.fence = (yield from self._fence(key)) if fence is None else fence
                return lease, None
            if answer == 0:
                raise DMutexError(f"unexpected answer from MySQL to a take: {answer!r}")
            if self._permits == 1:
                return None, refused(answer)
            # A semaphore's pick lost its slot to another caller: read again.

    def _pick(self, key: str, token: str) -> Steps[tuple[int | None, int | None]]:
        """A slot to take: the one holding ``token``, else a random free one; else the wait.

        One statement (``statements.py``, rule 7); random choices spread
        racing callers, they are not secrecy.
        """
        permits = self._permits
        if permits <= LISTED:
            names = {f"permit:{slot}:{key}": slot for slot in range(permits)}
            params: dict[str, object] = {f"name{slot}": name for name, slot in names.items()}
            *rows, (_, _, _, now) = (yield from self._call(self._pick_sql, params)).rows
            held: dict[int, int] = {}
            for name, value, expires, _ in rows:
                slot = names[_text(name)]
                if _text(value) == token:
                    return slot, None
                held[slot] = _int(expires, "expiry")
            free = [slot for slot in range(permits) if slot not in held]
            if free:
                return CHANCE.choice(free), None
            return None, min(held.values()) - _int(now, "time")
        start = CHANCE.randrange(permits)
        asked = {"key": key, "token": token, "start": start, "first": 0, "last": permits - 1}
        rows = (yield from self._call(self._pick_sql, asked)).rows
        mine, after, ends, now = rows[0]
        if mine is not None:
            return _int(mine, "slot"), None
        if after is not None:
            return (start + _int(after, "slot")) % permits, None
        return None, _int(ends, "expiry") - _int(now, "time")

    def _fence(self, key: str) -> Steps[int]:
        """Advance ``key``'s fence counter after a grant; its new value (statements rule 4)."""
        answer = (yield from self._call(self._sql.fence, {"row": f"fence:{key}"})).answer
        if answer == 0:
            raise DMutexError(
                f"the row 'fence:{key}' of table {self._sql.table} holds a value "
                "dmutex did not write"
            )
        return answer

    def _match(self, key: str, token: str, slot: int | None) -> tuple[Statement, dict[str, object]]:
        """The statement form and parameters that pick ``key``'s row holding ``token``."""
        if slot is None and self._permits == 1:
            slot = 0
        if slot is not None:
            return self._sql.release, {"row": f"permit:{slot}:{key}", "token": token}
        return self._sql.release_any, {
            "key": key,
            "token": token,
            "first": 0,
            "last": self._permits - 1,
        }

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        """Delete the active row holding ``token``: one statement; wakes this process's waiters."""
        statement, params = self._match(key, token, slot)
        outcome = yield from self._call(statement, params)
        if outcome.count < 1:
            return False
        self._waiting.wake((self._sql.table, key))
        return True

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        """Move the expiry of the active row holding ``token`` to now + ttl: one statement."""
        statement, params = self._match(key, token, slot)
        extend = self._sql.extend if statement is self._sql.release else self._sql.extend_any
        answer = (yield from self._call(extend, {**params, "ttl": ttl_ms})).answer
        return answer or None

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        """Extend the leases that have not ended, :data:`RENEW_BATCH` per update (rule 2).

        A failed batch fails the leases it carried, and only those.
        """
        answers: list[Renewed] = [None] * len(leases)
        alive = [n for n, lease in enumerate(leases) if not lease.ended]
        for start in range(0, len(alive), RENEW_BATCH):
            batch = alive[start : start + RENEW_BATCH]
            params: dict[str, object] = {}
            for n, index in enumerate(batch):
                lease = leases[index]
                params[f"name{n}"] = f"permit:{lease.slot}:{lease.key}"
                params[f"token{n}"] = lease.token
                params[f"ttl{n}"] = lease.ttl_ms
            try:
                yield from self._call(self._sql.extend_many(len(batch)), params)
                rows = (yield from self._call(self._sql.renewed(len(batch)), params)).rows
            except Exception as error:  # noqa: BLE001 - the answer of each lease it carried
                for index in batch:
                    answers[index] = error
                continue
            renewed = {(_text(name), _text(token)): expires for name, token, expires in rows}
            for n, index in enumerate(batch):
                expires = renewed.get((str(params[f"name{n}"]), str(params[f"token{n}"])))
                if expires is not None:
                    answers[index] = _int(expires, "expiry")
        return answers

    def holders(self, key: str) -> Steps[Inspection]:
        """The active permits of ``key`` and its fence counter: one statement, no change."""
        params = {"key": key, "first": 0, "last": self._permits - 1}
        rows = (yield from self._call(self._sql.holders, params)).rows
        found: list[Holder] = []
        fence: int | None = None
        now = 0
        for slot, value, expires, at in rows:
            now = _int(at, "time")
            if slot is None:
                fence = None if value is None else int(_text(value))
            else:
                found.append(Holder(_int(slot, "slot"), _text(value), _int(expires, "expiry")))
        return Inspection(sorted(found), fence, now)

    def keys(self, limit: int) -> Steps[list[str]]:
        """The first ``limit`` keys in byte order with an active permit in slots 0 .. N-1.

        One statement, no change.
        """
        params = {"permits": self._permits, "limit": limit}
        rows = (yield from self._call(self._sql.keys, params)).rows
        return [_text(row[0]) for row in rows]

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        """Wait for a release through this client (rule 5), or the whole time."""
        if waiter.registered:
            yield Wait(waiter.wakeup, seconds)
        else:
            yield Sleep(seconds)


def _same_columns(found: tuple[tuple[str, str, str], ...], value_type: str) -> bool:
    """Whether the columns are dmutex's: MySQL 8 spells ``bigint`` without a display width."""
    wanted = (COLUMNS[0], (COLUMNS[1][0], value_type, COLUMNS[1][2]), COLUMNS[2])
    if len(found) != len(wanted):
        return False
    return all(
        name == want_name and null == want_null and (kind == want or kind + "(20)" == want)
        for (name, kind, null), (want_name, want, want_null) in zip(found, wanted, strict=True)
    )

"""The SQLite store: leases as rows of one table in a file that the processes of one host share.

Layout (shared with the TypeScript dmutex's D1 store): table ``table_name``,
else ``table_prefix + service_name`` (``_dmutex_`` / ``_dsemaphore_``), with
columns ``"key" TEXT PRIMARY KEY, "value" TEXT NOT NULL, "expired_at"
INTEGER NOT NULL`` (epoch milliseconds) and the index
``f"{table}_expired_at_idx"`` on ``expired_at``. Slot ``i`` of lock ``k`` is
the row ``key = f"permit:{i}:{k}"``, ``value`` its token. dmutex adds one row
per fenced key, ``key = f"fence:{k}"``: the fence counter, in decimal, with
``expired_at`` at the largest INTEGER so that nothing takes it for a lease.

Read-write locks (dmutex's own layout; the TypeScript library has none) use
the same table schema, ``table_prefix`` ``_drwlock_``: lock ``k`` is the one
row ``key = f"rwlock:{k}"``, whose ``value`` is the key's whole state as
compact JSON, ``{"dmutex":"rwlock","w":W,"r":R,"i":I}`` in that order, no
whitespace, ASCII only: ``W`` the writer ``["<token>",<expiry ms>]`` or
``null``, ``R`` the readers ``{"<token>":<expiry ms>,...}`` and ``I`` the
waiting writers' intents ``{"<token>":<until ms>,...}``, each sorted by
token, with nothing expired kept. ``expired_at`` is the latest of those
times, so a cleanup that deletes expired rows never removes a live hold;
the row is deleted when the last hold and intent end. The fence row is the
mutex's, ``fence:{k}``.

The rules of this module:

1. Every operation is one call of :class:`SQLiteBackend` and one transaction:
   a grant, its fence and its token check commit together or not at all. A
   lone statement is its own transaction; several run in ``BEGIN IMMEDIATE``,
   which takes the file's write lock first, so two processes never both read
   a slot free and both take it.
2. A slot is taken by an upsert whose ``DO UPDATE`` applies only to a row
   that has expired or already holds the caller's token (a re-sent copy of
   an acquire), so a held row is never overwritten; the statement's change
   count is the token check. Release and extend match key, token and an
   expiry still in the future, so a holder whose lease ran out can neither
   remove nor prolong its successor's row.
3. Time is the instance's clock (the host's, unless a test passes one):
   every process that shares the file reads the same one. It is read in the
   call, inside the transaction: a call that waited for the file decides
   and stores expiries by the time it runs, not the time it was asked.
   Nothing deletes expired rows; the next acquire of the slot overwrites them.
4. A release wakes the retrying acquires that wait for its key through the
   same backend object (threads and tasks of this process), as
   InMemoryBackend does; a waiter registers in the call of its failed
   attempt, under the backend's lock, so no release falls between. Other
   processes send no signal: their waiters poll (``waiting.py``, rule 3),
   and a failed attempt learns when the first lease in its way ends.
5. The sync face calls SQLite in the caller's thread; the asyncio face in
   one worker thread per backend, never on the event loop: a busy file makes
   a call wait up to ``timeout``. One worker keeps the calls in order, so the
   release that undoes a cancelled acquire runs after that acquire.
6. A read-write lock's operation (:class:`SQLiteReadWriteStore`) is one
   ``BEGIN IMMEDIATE`` transaction, as rule 1's: it reads the key's row,
   asks ``dmutex._core.readwrite`` (which drops what has expired, and
   decides), and writes the state back, or deletes the row once nothing is
   held or intended; a grant moves the fence row in the same transaction.
   Nothing is written when the decision changed nothing (a refused reader,
   say). Time is rule 3's, read once per transaction.
7. The row ``rwlock:{k}`` is written only over the value the transaction
   read and checked as dmutex's (the ``"dmutex":"rwlock"`` mark and exactly
   the layout's fields and types), and inserted only where there was none.
   A row of that key holding anything else (another program's, or a later
   format, which would carry another mark or field) makes every operation
   on the key raise :class:`~dmutex.DMutexError` and change nothing; a
   renewal batch answers that error for that lease only. A foreign fence
   row makes every attempt to acquire raise, granted or not, since the
   decision needs the counter.
8. Waking is rule 4's: a release, and a writer's last attempt that
   withdrew its intent, wake this process's waiters of the key; a refused
   attempt registers its waiter and tells it when what stands in its way
   lapses at the latest (the refusal's ``clears_ms``), so that waiters in
   other processes poll no longer than that.
9. Listing the held keys (``keys``, for ``dmutex status``) is one call and
   one statement, a read: the mutex store's finds the distinct keys of
   active slot rows (slots 0 to ``max_permits`` - 1, as ``holders`` reads)
   with ``LIMIT``; the read-write store's reads the rows whose
   ``expired_at`` is ahead in key order and stops at the ``limit``-th that
   a writer or reader holds (a row left with an intent alone holds none).
"""

from __future__ import annotations

import asyncio
import math
import numbers
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeAlias, TypeVar, cast

from .._clock import Clock
from .._core import readwrite
from .._core.abc import Holder, Inspection, Renewed
from .._core.effects import Call, Sleep, Steps, Wait
from .._core.fences import clock_us, next_fence
from .._core.lease import MAX_EXPIRY_MS, Lease, now_ms
from .._core.waiting import Waiter, Wakeup
from .._errors import ArgumentTypeError, DMutexError, InvalidArgumentError
from . import rwstate

__all__ = ["SQLiteBackend", "SQLiteReadWriteStore", "SQLiteStore"]

T = TypeVar("T")
Conn = sqlite3.Connection

_HEADER = b"SQLite format 3\x00"
_SQLITE_BUSY = 5  # the primary result code; sqlite3.SQLITE_BUSY is 3.11+
# A fence row's expiry: the largest INTEGER, so that nothing takes it for a lease's.
_FOREVER = 2**63 - 1

# Every open backend, so that a forked child drops the connections it inherited.
_OPEN: weakref.WeakSet[SQLiteBackend] = weakref.WeakSet()
# The connections a forked child inherited: kept, never closed nor collected,
# since closing one in the child would act on the parent's file state.
_INHERITED: list[Conn] = []


def _forked() -> None:
    for backend in list(_OPEN):
        backend._after_fork()


os.register_at_fork(after_in_child=_forked)


def quote(identifier: str) -> str:
    """An SQL identifier in double quotes; refuses what the TypeScript store refuses."""
    if not identifier or "\0" in identifier:
        raise InvalidArgumentError(
            f"an SQLite table name must be non-empty and without NUL bytes, not {identifier!r}"
        )
    if identifier[:7].lower() == "sqlite_":  # SQLite refuses them only at the first statement
        raise InvalidArgumentError(
            f"SQLite reserves table names that begin with 'sqlite_' (any case): {identifier!r}"
        )
    return '"' + identifier.replace('"', '""') + '"'


def _check_timeout(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"timeout must be an int or float, not {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:  # an int or Fraction beyond the largest float
        seconds = math.inf
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgumentError(f"timeout must be a finite number >= 0 seconds, not {value!r}")
    return seconds


def _check_path(path: object) -> str:
    """The absolute path of a database file dmutex can open, read and write; else a clear error."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise ArgumentTypeError(f"path must be a str or os.PathLike, not {type(path).__name__}")
    if path in ("", ":memory:") or path.startswith("file:"):
        raise InvalidArgumentError(
            f"path must name a file, not {path!r}: processes share locks through the file "
            "(use InMemoryBackend for locks within one process)"
        )
    full = os.path.abspath(path)
    folder = os.path.dirname(full)
    if not os.path.isdir(folder):
        raise InvalidArgumentError(
            f"cannot open the SQLite lock file {full!r}: its directory does not exist"
        )
    if os.path.isdir(full):
        raise InvalidArgumentError(f"cannot open the SQLite lock file {full!r}: it is a directory")
    if os.path.exists(full):
        if not os.access(full, os.R_OK | os.W_OK):
            raise InvalidArgumentError(
                f"the SQLite lock file {full!r} is not readable and writable by this user: "
                "every lock operation writes to it"
            )
        with open(full, "rb") as file:
            head = file.read(len(_HEADER))
        if head and head != _HEADER:
            raise InvalidArgumentError(f"{full!r} is not an SQLite database")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidArgumentError(
            f"cannot use the SQLite lock file {full!r}: its directory is not writable by this "
            "user, and SQLite creates the file and its -wal and -shm files there"
        )
    return full


class SQLiteBackend:
    """An SQLite database file holding lock tables: a client for every dmutex class.

    ``SQLiteBackend(path)`` opens (creating it if missing) the file at
    ``path`` in WAL mode with ``synchronous=FULL``. Locks are exclusive
    across every thread and process on the host that opens the same file,
    and survive the crash of any of them; a process that dies holding a
    lease leaves it until its TTL runs out. ``timeout`` is how long one
    operation waits for another process's transaction to finish before it
    raises ``sqlite3.OperationalError`` ("database is locked").

    Raises :class:`~dmutex.InvalidArgumentError` for a path whose directory
    is missing, a file this user cannot read and write, or a file that is
    not an SQLite database, before any lock state changes.

    Caveats: one host only. SQLite's locks do not work reliably over
    network filesystems (NFS, SMB), so neither does this. For a file that
    several users share, each needs write access to the file and to its
    directory (SQLite creates ``path-wal`` and ``path-shm`` beside it): a
    group-writable directory with the setgid bit and a umask of 002, say.
    """

    __slots__ = (
        "__weakref__",
        "_conn",
        "_gate",
        "_path",
        "_pid",
        "_starting",
        "_timeout",
        "_waiters",
        "_worker",
    )

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 30.0) -> None:
        self._timeout = _check_timeout(timeout)
        self._path = _check_path(path)
        self._gate = threading.Lock()
        # Guards _worker only: _gate is held through whole calls, busy waits
        # included, and the event loop must never wait for one.
        self._starting = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._conn: Conn | None = None
        # (table, key) -> the wakeups of this process's waiters (rule 4),
        # held weakly: an abandoned acquire leaves nothing. Under _gate.
        self._waiters: dict[tuple[str, str], weakref.WeakSet[Wakeup]] = {}
        try:
            self._conn = self._connect()
        except sqlite3.OperationalError:
            raise  # a file another process keeps busy past the timeout: not bad input
        except sqlite3.DatabaseError as error:
            raise InvalidArgumentError(
                f"cannot open the SQLite lock file {self._path!r}: {error}"
            ) from None
        _OPEN.add(self)

    @property
    def path(self) -> str:
        """The absolute path of the database file."""
        return self._path

    def _connect(self) -> Conn:
        conn = sqlite3.connect(
            self._path, timeout=self._timeout, isolation_level=None, check_same_thread=False
        )
        try:
            # WAL: readers never block the writer; FULL: a grant or fence
            # that was answered survives a power cut, so no fence is reused.
            _switch_to_wal(conn, time.monotonic() + self._timeout)
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA schema_version").fetchall()  # "not a database" surfaces here
        except BaseException:
            conn.close()
            raise
        return conn

    def _after_fork(self) -> None:
        # The parent's connection and worker thread are not the child's:
        # SQLite forbids carrying a connection across fork. Abandon them.
        if self._conn is not None:
            _INHERITED.append(self._conn)
        self._gate = threading.Lock()
        self._starting = threading.Lock()
        self._worker = None
        self._conn = None
        self._waiters = {}
        self._pid = os.getpid()

    def call(self, fn: Callable[[Conn], T]) -> T:
        """Run ``fn(connection)`` in this thread, one caller at a time."""
        with self._gate:
            conn = self._conn
            if conn is None or self._pid != os.getpid():
                self._pid = os.getpid()
                conn = self._conn = self._connect()
            return fn(conn)

    def call_async(self, fn: Callable[[Conn], T]) -> asyncio.Future[T]:
        """Run ``fn(connection)`` in this backend's worker thread; a future of the running loop."""
        loop = asyncio.get_running_loop()
        with self._starting:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="dmutex-sqlite")
            worker = self._worker
        return asyncio.wrap_future(worker.submit(self.call, fn), loop=loop)

    def close(self) -> None:
        """Close the connection and stop the worker thread; a later call opens them anew."""
        with self._starting:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)
        with self._gate:
            conn, self._conn = self._conn, None
        if conn is not None and self._pid == os.getpid():
            conn.close()

    def __del__(self) -> None:
        # A backend dropped without close() closes its connection, as a file
        # object would, and quietly: the file's locks never outlive a call.
        conn = self._conn if hasattr(self, "_conn") else None
        if conn is not None and self._pid == os.getpid():
            conn.close()

    def __repr__(self) -> str:
        return f"SQLiteBackend({self._path!r})"


def _switch_to_wal(conn: Conn, deadline: float) -> None:
    """Put the file in WAL mode, retrying while other connections are busy until ``deadline``.

    Why a loop: switching the journal mode can need the file's exclusive
    lock, and SQLite answers SQLITE_BUSY at once, without its busy handler,
    when processes open a new file together (one in ten of six doing so on
    this machine). The loop gives the switch the same ``timeout`` as any call.
    """
    pause = 0.001
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL").fetchall()
            return
        except sqlite3.OperationalError as error:
            if not _is_busy(error) or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _is_busy(error: sqlite3.OperationalError) -> bool:
    """Whether ``error`` is SQLITE_BUSY (any extended code): another connection holds the file."""
    code = getattr(error, "sqlite_errorcode", None)  # Python 3.11+; 3.10 has the message only
    if isinstance(code, int):
        return code & 0xFF == _SQLITE_BUSY
    return str(error) == "database is locked"


def _register(backend: SQLiteBackend, name: tuple[str, str], waiter: Waiter, on: bool) -> None:
    """Add ``waiter`` to (or, ``on`` False, drop it from) ``name``'s waiters; under the gate."""
    waiting = backend._waiters
    wakeups = waiting.get(name)
    if not on:
        if wakeups is not None:
            wakeups.discard(waiter.wakeup)
            if not wakeups:
                del waiting[name]
        waiter.registered = False
        return
    if wakeups is None:
        wakeups = waiting[name] = weakref.WeakSet()
    waiter.wakeup.clear()
    wakeups.add(waiter.wakeup)
    waiter.registered = True


def _in_transaction(conn: Conn, body: Callable[[Conn], T], begin: str = "BEGIN IMMEDIATE") -> T:
    """``body(conn)`` in ``begin``'s transaction: committed if it returns, rolled back if it raises.

    ``BEGIN IMMEDIATE`` (the default) for a body that writes; a plain
    ``BEGIN`` for one that only reads, which in WAL mode waits for no writer
    and sees one snapshot.
    """
    conn.execute(begin)
    try:
        result = body(conn)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    try:
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return result


@dataclass(frozen=True, slots=True)
class _Sql:
    """The statements of one table, with its quoted name filled in."""

    create_table: str
    create_index: str
    take: str
    slots: str
    read: str
    put: str
    delete: str
    delete_any: str
    extend: str
    extend_any: str
    insert: str
    update: str
    remove: str
    keys: str
    rows: str

    @classmethod
    def of(cls, table: str) -> _Sql:
        t = quote(table)
        index = quote(f"{table}_expired_at_idx")
        # The names of slots 0 .. :permits - 1 of :key (the recursion stops there).
        # Parameters are named: numbered ones (?1) with a sequence warn on
        # Python 3.12.0-3.12.3, and 3.14 refuses them.
        names = (
            "WITH RECURSIVE slot(i) AS "
            "(SELECT 0 UNION ALL SELECT i + 1 FROM slot WHERE i + 1 < :permits) "
            "SELECT 'permit:' || i || ':' || :key FROM slot"
        )
        return cls(
            create_table=(
                f'CREATE TABLE IF NOT EXISTS {t} ("key" TEXT PRIMARY KEY, '
                '"value" TEXT NOT NULL, "expired_at" INTEGER NOT NULL)'
            ),
            create_index=f'CREATE INDEX IF NOT EXISTS {index} ON {t} ("expired_at")',
            # Rule 2. Inside DO UPDATE, a bare column is the stored row's.
            take=(
                f'INSERT INTO {t} ("key", "value", "expired_at") VALUES (:name, :token, :expires) '
                'ON CONFLICT("key") DO UPDATE SET "value" = excluded."value", '
                '"expired_at" = excluded."expired_at" '
                'WHERE "expired_at" <= :now OR "value" = :token'
            ),
            slots=(
                f'SELECT "key", "value", "expired_at" FROM {t} WHERE "key" IN ({names}) '
                'AND ("expired_at" > :now OR "value" = :token)'
            ),
            read=f'SELECT "value", "expired_at" FROM {t} WHERE "key" = :name',
            put=(
                f'INSERT INTO {t} ("key", "value", "expired_at") VALUES (:name, :token, :expires) '
                'ON CONFLICT("key") DO UPDATE SET "value" = excluded."value"'
            ),
            delete=(
                f'DELETE FROM {t} WHERE "key" = :name AND "value" = :token AND "expired_at" > :now'
            ),
            delete_any=(
                f'DELETE FROM {t} WHERE "key" IN ({names}) '
                'AND "value" = :token AND "expired_at" > :now'
            ),
            extend=(
                f'UPDATE {t} SET "expired_at" = :expires '
                'WHERE "key" = :name AND "value" = :token AND "expired_at" > :now'
            ),
            extend_any=(
                f'UPDATE {t} SET "expired_at" = :expires WHERE "key" IN ({names}) '
                'AND "value" = :token AND "expired_at" > :now'
            ),
            # A read-write lock's row (rule 7): written only over the value
            # the transaction read, and inserted only where none was.
            insert=(
                f'INSERT INTO {t} ("key", "value", "expired_at") VALUES (:name, :value, :expires)'
            ),
            update=(
                f'UPDATE {t} SET "value" = :value, "expired_at" = :expires '
                'WHERE "key" = :name AND "value" = :old'
            ),
            remove=f'DELETE FROM {t} WHERE "key" = :name AND "value" = :old',
            # Rule 9: the held keys of slots 0 .. :permits - 1, each once. The
            # slot is the text between "permit:" and the next ":", read as a
            # number only where it is one as dmutex writes it (no sign, no
            # leading zero); the key is what follows. A range of the primary
            # key ("permit;" follows every "permit:..." byte for byte).
            keys=(
                'SELECT DISTINCT substr(p."key", length(p.slot) + 9) AS k FROM '
                """(SELECT "key", substr("key", 8, instr(substr("key", 8), ':') - 1) AS slot """
                f"""FROM {t} WHERE "key" >= 'permit:' AND "key" < 'permit;' """
                'AND "expired_at" > :now) AS p '
                "WHERE CAST(CAST(p.slot AS INTEGER) AS TEXT) = p.slot "
                "AND CAST(p.slot AS INTEGER) BETWEEN 0 AND :permits - 1 "
                'AND length(p."key") > length(p.slot) + 8 '
                "ORDER BY k LIMIT :limit"
            ),
            # Rule 9: the read-write lock rows that may hold something, in key order.
            rows=(
                f"""SELECT "key", "value" FROM {t} WHERE "key" >= 'rwlock:' """
                """AND "key" < 'rwlock;' AND "expired_at" > :now """
                'ORDER BY "key"'
            ),
        )


def _is_count(value: object) -> bool:
    """Whether ``value`` is a fence counter as dmutex writes it: ASCII decimal digits."""
    return isinstance(value, str) and value.isascii() and value.isdigit()


def _slot_of(name: str, key: str) -> int:
    return int(name[len("permit:") : -len(key) - 1])


def _create(sql: _Sql) -> Callable[[Conn], None]:
    """The call that creates a table and its expiry index if missing."""

    def create(conn: Conn) -> None:
        conn.execute(sql.create_table)
        conn.execute(sql.create_index)

    return create


def _fence_counter(conn: Conn, sql: _Sql, table: str, key: str) -> int:
    """The fence counter of ``key`` (0: no row yet); raise on a row dmutex did not write."""
    name = f"fence:{key}"
    row = conn.execute(sql.read, {"name": name}).fetchone()
    if row is None:
        return 0
    value, expires = row
    if not (_is_count(value) and expires == _FOREVER):
        raise DMutexError(f"the row {name!r} of table {table!r} holds a value dmutex did not write")
    return int(str(value))


def _put_fence(conn: Conn, sql: _Sql, key: str, fence: int) -> None:
    """Store ``fence`` as ``key``'s counter; the caller read the row (or its absence) first."""
    conn.execute(sql.put, {"name": f"fence:{key}", "token": str(fence), "expires": _FOREVER})


def _shown_fence(conn: Conn, sql: _Sql, key: str) -> int | None:
    """``key``'s fence counter as an inspection shows it: None without a row of dmutex's."""
    counter = conn.execute(sql.read, {"name": f"fence:{key}"}).fetchone()
    return int(counter[0]) if counter and _is_count(counter[0]) else None


class _TableStore:
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
        self._sql = _Sql.of(table)
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
        yield Call(self._run, (_create(self._sql),))


class SQLiteStore(_TableStore):
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
                held = {_slot_of(name, key): value for name, value, _ in rows}
                mine = [slot for slot, value in held.items() if value == token]
                free = (slot for slot in range(permits) if slot not in held)
                slot = mine[0] if mine else next(free, -1)
            if slot >= 0:
                name = f"permit:{slot}:{key}"
                taken = {"name": name, "token": token, "expires": expires, "now": now}
                cursor = conn.execute(sql.take, taken)
                if cursor.rowcount == 1:
                    if waiter is not None:
                        _register(backend, (self._table, key), waiter, False)
                    fence = self._bump(conn, key, clock_us(clock)) if self._fencing else None
                    return slot, expires, fence
            if waiter is not None:
                if permits == 1:
                    asked = {"permits": 1, "key": key, "now": now, "token": None}
                    rows = conn.execute(sql.slots, asked).fetchall()
                ends = [at for _, _, at in rows if at > now]
                waiter.expires_in = (min(ends) - now) / 1000 if ends else None
                _register(backend, (self._table, key), waiter, not waiter.last)
            return None

        one = permits == 1 and not self._fencing
        reply = yield Call(self._run, (grant if one else _transaction(grant),))
        granted = cast("tuple[int, int, int | None] | None", reply)  # what grant() returned
        if granted is None:
            return None
        slot, expires, fence = granted
        return Lease(key, token, slot, expires, fence=fence)

    def _bump(self, conn: Conn, key: str, now_us: int) -> int:
        """Move the fence counter of ``key`` on (``fences``, rule 1); raise on a foreign row."""
        fence = next_fence(_fence_counter(conn, self._sql, self._table, key), now_us)
        _put_fence(conn, self._sql, key, fence)
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
            answers = yield Call(self._run, (_transaction(update),))
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
            found = sorted(Holder(_slot_of(name, key), value, at) for name, value, at in rows)
            return Inspection(found, _shown_fence(conn, sql, key), now)

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


class SQLiteReadWriteStore(_TableStore):
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
            result, wake = _in_transaction(conn, body)
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
                state.fence = _fence_counter(conn, self._sql, self._table, key)
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
                    _put_fence(conn, self._sql, key, decided.fence)
                if waiter is not None:
                    _register(backend, name, waiter, False)
                return (decided.expires_ms, decided.fence if fencing else None), gave_up
            if waiter is not None:
                waiter.expires_in = (decided.clears_ms - now) / 1000
                _register(backend, name, waiter, not waiter.last)
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

        expires = yield Call(self._run, (_transaction(update),))
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
            answers = yield Call(self._run, (_transaction(update),))
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
            return Inspection(found, _shown_fence(conn, self._sql, key), now)

        def call(conn: Conn) -> Inspection:
            return _in_transaction(conn, read, "BEGIN")

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


def _transaction(body: Callable[[Conn], T]) -> Callable[[Conn], T]:
    """``body`` run by :func:`_in_transaction`."""

    def run(conn: Conn) -> T:
        return _in_transaction(conn, body)

    return run

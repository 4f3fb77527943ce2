"""How one statement runs on each kind of MySQL client: the callable of the store's calls.

Rules of this module:

1. A runner takes a :class:`~.statements.Statement` and its parameters by
   name, sends the statement, and returns an :class:`Outcome`: its rows as
   tuples (none without a result), the affected-row count and the OK
   packet's id (``cursor.lastrowid``: what ``LAST_INSERT_ID(expr)`` set, 0
   if nothing did); an asyncio runner returns an awaitable of it. It is
   what the store's ``Call`` effects call, so the store never touches a
   client itself.
2. Nothing stays open between two statements. A connection in autocommit
   runs the statement alone. One that is not opens a transaction with it,
   which the runner commits at once (one more round trip; rolls back if
   the statement failed), reads included (:func:`_opened`), so no row lock
   and no old snapshot outlives the statement. A
   connection already inside the caller's transaction is refused, since a
   lease written there would commit only with the caller's work: PyMySQL,
   aiomysql and asyncmy tell it by ``server_status``, mysql-connector by
   ``in_transaction``. mysqlclient tells neither: its own connection is
   taken in autocommit only (it cannot show an explicit ``BEGIN`` then; a
   documented limit). A pool (an engine's included) lends a connection for
   the one statement, which no caller's transaction can be open on: it is
   taken as it comes, in autocommit or not.
3. Rows may come as tuples or mappings (a ``DictCursor``): they are read in
   column order either way.
4. One connection runs one of dmutex's statements at a time: a lock per
   connection (a thread lock, or an asyncio lock for aiomysql and asyncmy),
   shared by every store, renewal and waiter on it, since none of these
   drivers may be used by two threads or tasks at once. The caller's own
   statements on that connection do not take these turns: they need a
   connection of their own.
5. A statement that InnoDB chose as a deadlock's victim (error 1213) was
   rolled back whole, so it is sent again, up to :data:`DEADLOCK_TRIES`
   times in all; every other error reaches the store as raised. dmutex's
   statements each lock one row, or a key's slots in primary-key order, so
   a deadlock needs another program's multi-row transaction.
6. A SQLAlchemy engine is a pool (``dmutex._backends.sql.engines``): its
   statement runs on the driver's own connection as rules 2 to 5 say.
   Which drivers: ``pymysql``, ``mysqldb`` and ``mysqlconnector`` for an
   ``Engine``, ``aiomysql`` and ``asyncmy`` for an ``AsyncEngine``, on the
   ``mysql`` or ``mariadb`` dialect; decided before any I/O. Its lent
   connections are out of autocommit unless the engine says
   ``isolation_level="AUTOCOMMIT"`` (so rule 2 commits each statement),
   and the pool's reset on return sends a ``ROLLBACK`` unless it says
   ``pool_reset_on_return=None``: three round trips per statement by
   default, one with both (counted on MariaDB with PyMySQL).
7. A statement that a cancellation cut short is over on the server before
   the cancellation goes on. aiomysql and asyncmy close the connection when
   a task is cancelled while they await a reply, and the server may not
   have run the statement yet: the store's clean-up, a release by token
   on the pool's next connection, could run before it, and the row it
   then took would be held by nobody (``engine.py``, rule 6). So a runner
   whose statement raised ``CancelledError`` with its connection closed,
   and shielded from further cancellations, opens that connection again
   (the driver's ``ping(reconnect=True)``: a single connection serves the
   next call instead of failing it, a pool's goes back to the pool open)
   and ends the old session from it (``KILL CONNECTION`` of its thread id,
   sent again until the server knows the thread no more: a statement it
   ran has committed or rolled back by then); then raises the cancellation.
   That waits for the server, as the clean-up does. A connection the driver
   did not close had its reply read, or sent nothing; one it cannot open
   again is left closed, and the cancellation goes on at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, cast

from ..._errors import DMutexError, UnsupportedClientError
from ..shapes import method
from ..sql.clients import SQLAlchemyDialectLike
from ..sql.engines import check_face, lend, lend_async
from .clients import (
    AsyncMySQLConnectionLike,
    AsyncMySQLCursorLike,
    AsyncMySQLPoolLike,
    MySQLConnectionLike,
    MySQLConnectorPoolLike,
    MySQLCursorLike,
)
from .shapes import mysql_method
from .statements import Statement

__all__ = ["DEADLOCK_TRIES", "Outcome", "Params", "Row", "Runner", "runner"]

Row: TypeAlias = tuple[object, ...]
Params: TypeAlias = Mapping[str, object]
Runner: TypeAlias = Callable[[Statement, Params], object]
"""``run(statement, params)``: its :class:`Outcome` (sync), or an awaitable of it (asyncio)."""

DEADLOCK_TRIES = 3
_DEADLOCK = 1213  # ER_LOCK_DEADLOCK
# Rule 7: between two KILLs of a session still ending, seconds (doubled each time, to the cap).
_ENDING_PAUSE = 0.001
_ENDING_PAUSE_CAP = 0.05
_IN_TRANS = 0x0001  # SERVER_STATUS_IN_TRANS


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one statement answered: its rows, its affected-row count, its OK packet's id."""

    rows: list[Row]
    count: int
    answer: int


def _rows(found: object) -> list[Row]:
    """Rows as tuples in column order (rule 3)."""
    if not isinstance(found, Sequence):
        raise DMutexError(f"unexpected result from MySQL: {found!r}")
    rows: list[Row] = []
    for row in found:
        if isinstance(row, Mapping):
            rows.append(tuple(row.values()))
        elif isinstance(row, Iterable) and not isinstance(row, (str, bytes)):
            rows.append(tuple(row))
        else:
            raise DMutexError(f"unexpected row from MySQL: {row!r}")
    return rows


def _code(error: BaseException) -> object:
    """The server's error number: ``errno`` (mysql-connector), else the first argument."""
    errno = getattr(error, "errno", None)
    if isinstance(errno, int):
        return errno
    return error.args[0] if error.args else None


def _in_transaction(conn: object) -> bool | None:
    """Whether the driver reports ``conn`` inside a transaction; None if it cannot tell."""
    status = getattr(conn, "server_status", None)  # PyMySQL, aiomysql, asyncmy
    if isinstance(status, int) and not isinstance(status, bool):
        return bool(status & _IN_TRANS)
    # mysql-connector: its last OK packet's flag (a pooled connection forwards it).
    inside = getattr(conn, "in_transaction", None)
    return inside if isinstance(inside, bool) else None


def _autocommit(conn: object) -> bool:
    """Whether ``conn`` commits each statement on its own, read without I/O (mysqlclient)."""
    get = getattr(conn, "get_autocommit", None)
    return bool(get()) if callable(get) else False


def _opened(conn: object) -> bool:
    """Whether the statement just sent may have opened a transaction that must end now (rule 2).

    PyMySQL, aiomysql and asyncmy read the transaction flag from OK packets
    only, not from the end of a result set: after a ``SELECT`` on a
    connection out of autocommit, ``server_status`` says no transaction
    while one is open. So out of autocommit (their ``get_autocommit()``,
    read from the same flags, no I/O) every statement is ended; a driver
    without it (mysql-connector) is trusted for its own flag, which it
    reads from both.
    """
    get = getattr(conn, "get_autocommit", None)
    if callable(get):
        return not get()
    return bool(_in_transaction(conn))


def _outside_transaction(conn: object) -> None:
    """Refuse a connection inside the caller's transaction, or one that cannot tell (rule 2)."""
    inside = _in_transaction(conn)
    if inside is None and not _autocommit(conn):
        raise UnsupportedClientError(
            f"{type(conn).__module__}.{type(conn).__qualname__} is not in autocommit and does "
            "not tell whether it is inside a transaction: open it with autocommit=True, or "
            "give dmutex a pool"
        )
    if inside:
        raise DMutexError(
            "the MySQL connection is inside a transaction: a lease written there would not "
            "commit until it does. Give dmutex a connection of its own (in autocommit, or "
            "idle between statements), or a pool"
        )


class _Executes(Protocol):
    """The ``execute`` of every driver's cursor, as dmutex calls it (why here: ``clients.py``)."""

    def execute(self, query: str, args: Params | None, /) -> object: ...


def _execute(cursor: object, statement: Statement, params: Params) -> object:
    """Send ``statement``; with its parameters only if it takes some (statements rule 6)."""
    args = params if statement.takes_params else None
    return cast(_Executes, cursor).execute(statement.text, args)


def _outcome(cursor: MySQLCursorLike | AsyncMySQLCursorLike, rows: list[Row]) -> Outcome:
    count = cursor.rowcount
    return Outcome(rows, count if isinstance(count, int) else -1, cursor.lastrowid or 0)


_TURNS: weakref.WeakKeyDictionary[object, threading.Lock] = weakref.WeakKeyDictionary()
_ATURNS: weakref.WeakKeyDictionary[object, asyncio.Lock] = weakref.WeakKeyDictionary()
_TURNS_LOCK = threading.Lock()


def _turn(conn: object) -> contextlib.AbstractContextManager[object]:
    """The turn of a statement on a sync connection (rule 4)."""
    with _TURNS_LOCK:
        try:
            return _TURNS.setdefault(conn, threading.Lock())
        except TypeError:  # takes no weak reference: no turns
            return contextlib.nullcontext()


def _aturn(conn: object) -> contextlib.AbstractAsyncContextManager[object]:
    """The turn of a statement on an asyncio connection (rule 4)."""
    try:
        turn = _ATURNS.get(conn)
        if turn is None:
            turn = _ATURNS[conn] = asyncio.Lock()
    except TypeError:
        return contextlib.nullcontext()
    return turn


def _closed(conn: object) -> bool:
    """Whether the driver reports ``conn`` closed.

    PyMySQL's ``open``, aiomysql's ``closed``, asyncmy's ``connected``,
    mysql-connector's ``is_connected()``.
    """
    opened = getattr(conn, "open", None)
    if isinstance(opened, bool):
        return not opened
    closed = getattr(conn, "closed", None)
    if isinstance(closed, bool):
        return closed
    connected = getattr(conn, "connected", None)
    if isinstance(connected, bool):
        return not connected
    is_connected = getattr(conn, "is_connected", None)
    return callable(is_connected) and not is_connected()


async def _to_the_end(work: Awaitable[None]) -> None:
    """Await ``work`` as a task of its own to its end, whatever cancellations arrive meanwhile.

    The caller raises the cancellation it is handling once this returns (rule 7).
    """
    task = asyncio.ensure_future(work)
    while not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait((task,))


async def _end_session(
    conn: object, once: Callable[[Statement, Params], Awaitable[Outcome]]
) -> None:
    """Open ``conn`` again and end its old session on the server (rule 7).

    ``once`` sends a statement on ``conn``. Nothing is raised: a connection
    that cannot be opened again, or a ``KILL`` refused, ends the wait (the
    cancellation this runs for is raised after it).
    """
    thread_id, ping = getattr(conn, "thread_id", None), getattr(conn, "ping", None)
    if not callable(thread_id) or not callable(ping):
        return
    try:
        ended = int(thread_id())
        await ping(reconnect=True)  # a new session: ``ended`` is not this one any more
    except Exception:  # noqa: BLE001 - not opened again: the cancellation goes on
        return
    kill = Statement(f"KILL CONNECTION {ended}", takes_params=False)
    pause = _ENDING_PAUSE
    while True:
        try:
            await once(kill, {})
        except Exception:  # noqa: BLE001 - the answer, not a failure to report
            # ER_NO_SUCH_THREAD (1094): the server knows the thread no more, so what it
            # ran has committed or rolled back. Another refusal cannot tell: no wait then.
            return
        await asyncio.sleep(pause)  # killed, and still ending: ask again
        pause = min(pause * 2, _ENDING_PAUSE_CAP)


def _connection(client: object, lent: bool = False) -> Callable[[Statement, Params], Outcome]:
    """A runner on a sync DB-API connection (PyMySQL, mysqlclient, mysql-connector).

    ``lent``: a pool lent it for this statement, so no caller's transaction
    can be open on it (rule 2).
    """
    conn = cast(MySQLConnectionLike, client)
    method(conn, "cursor")

    def once(statement: Statement, params: Params) -> Outcome:
        cursor = conn.cursor()
        try:
            _execute(cursor, statement, params)
            return _outcome(cursor, [] if cursor.description is None else _rows(cursor.fetchall()))
        finally:
            cursor.close()

    turn = _turn(conn)  # one per connection, looked up once (rule 4)

    def run(statement: Statement, params: Params) -> Outcome:
        with turn:
            if not lent:
                _outside_transaction(conn)
            for attempt in range(1, DEADLOCK_TRIES + 1):
                try:
                    outcome = once(statement, params)
                except Exception as error:
                    if _opened(conn):
                        with contextlib.suppress(Exception):
                            conn.rollback()
                    if _code(error) != _DEADLOCK or attempt == DEADLOCK_TRIES:
                        raise
                    continue
                if _opened(conn):
                    conn.commit()
                return outcome
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    return run


def _connection_async(
    client: object, lent: bool = False
) -> Callable[[Statement, Params], Awaitable[Outcome]]:
    """A runner on an asyncio connection (aiomysql, asyncmy); ``lent``: see :func:`_connection`."""
    conn = cast(AsyncMySQLConnectionLike, client)
    method(conn, "cursor")

    async def once(statement: Statement, params: Params) -> Outcome:
        opened = conn.cursor()
        # aiomysql's cursor() answers an awaitable of the cursor, asyncmy's the cursor.
        cursor = await opened if inspect.isawaitable(opened) else opened
        try:
            await cast("Awaitable[object]", _execute(cursor, statement, params))
            rows = [] if cursor.description is None else _rows(await cursor.fetchall())
            return _outcome(cursor, rows)
        finally:
            await cursor.close()

    turn = _aturn(conn)  # one per connection, looked up once (rule 4)

    async def run(statement: Statement, params: Params) -> Outcome:
        async with turn:
            if not lent:
                _outside_transaction(conn)
            try:
                for attempt in range(1, DEADLOCK_TRIES + 1):
                    try:
                        outcome = await once(statement, params)
                    except Exception as error:
                        if _opened(conn):
                            with contextlib.suppress(Exception):
                                await conn.rollback()
                        if _code(error) != _DEADLOCK or attempt == DEADLOCK_TRIES:
                            raise
                        continue
                    if _opened(conn):
                        await conn.commit()
                    return outcome
            except asyncio.CancelledError:
                if _closed(conn):  # cut while it awaited the server (rule 7)
                    await _to_the_end(_end_session(conn, once))
                raise
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    return run


def _connector_pool(client: object) -> Callable[[Statement, Params], Outcome]:
    """A runner on a mysql-connector pool: one connection lent per statement."""
    pool = cast(MySQLConnectorPoolLike, client)
    method(pool, "get_connection")

    def run(statement: Statement, params: Params) -> Outcome:
        conn = pool.get_connection()
        try:
            return _connection(conn, lent=True)(statement, params)
        finally:
            close = getattr(conn, "close", None)
            if callable(close):
                close()  # gives it back to the pool

    return run


def _pool_async(client: object) -> Callable[[Statement, Params], Awaitable[Outcome]]:
    """A runner on an aiomysql or asyncmy pool: one connection lent per statement."""
    pool = cast(AsyncMySQLPoolLike, client)
    method(pool, "acquire")

    async def run(statement: Statement, params: Params) -> Outcome:
        async with pool.acquire() as conn:
            return await _connection_async(conn, lent=True)(statement, params)

    return run


_ENGINE_DRIVERS = {False: ("pymysql", "mysqldb", "mysqlconnector"), True: ("aiomysql", "asyncmy")}


def _engine_driver(engine: object, asynchronous: bool) -> str:
    """The driver of a SQLAlchemy engine on MySQL that dmutex can run on, or an error (rule 6)."""
    dialect = cast(SQLAlchemyDialectLike, getattr(engine, "dialect", None))
    driver = getattr(dialect, "driver", None)
    kind = "AsyncEngine" if asynchronous else "Engine"
    drivers = " or ".join(_ENGINE_DRIVERS[asynchronous])
    if driver not in _ENGINE_DRIVERS[asynchronous]:
        raise UnsupportedClientError(
            f"a SQLAlchemy {kind} on MySQL with the {driver!r} driver: dmutex runs its "
            f"statements on the driver's connection, and a {kind}'s must be {drivers}"
        )
    return str(driver)


def runner(client: object, *, asynchronous: bool) -> Runner:
    """The runner of ``client``, by its shape (``shapes.mysql_method``), before any I/O."""
    kind = mysql_method(client)
    if kind == "raw_connection":
        check_face(client, asynchronous)
        _engine_driver(client, asynchronous)
        if asynchronous:
            return lend_async(client, lambda conn: _connection_async(conn, lent=True), _closed)
        return lend(client, lambda conn: _connection(conn, lent=True), _closed)
    if kind == "get_connection":
        if asynchronous:
            raise UnsupportedClientError(
                "a mysql-connector pool is a sync client: use DMutex / DSemaphore"
            )
        return _connector_pool(client)
    if kind == "acquire":
        if not asynchronous:
            raise UnsupportedClientError(
                "an aiomysql or asyncmy pool is an asyncio client: "
                "use AsyncDMutex / AsyncDSemaphore"
            )
        return _pool_async(client)
    return _connection_async(client) if asynchronous else _connection(client)

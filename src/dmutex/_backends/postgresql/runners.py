"""How one statement runs on each kind of PostgreSQL client: the callable of the store's calls.

Rules of this module:

1. A runner takes a :class:`~.statements.Statement` and its parameters by
   name, sends the statement once, and returns its rows as tuples (none
   for a statement without a result, DDL); an
   asyncio runner returns an awaitable of them. It is what the store's
   ``Call`` effects call, so the store never touches a client itself.
2. Nothing stays open between two statements: a connection in autocommit
   runs the statement alone; a connection that is not runs it in a
   transaction of its own (``BEGIN`` ... ``COMMIT``), and one already inside
   the caller's transaction is refused, since a lease written there would
   commit only with the caller's work, and lock nobody out until then. A
   pool lends a connection for the one statement.
3. No named prepared statement: psycopg is asked for ``prepare=False``
   (else it prepares a statement run five times, which a pooler in
   transaction mode cannot keep). asyncpg prepares every statement it runs,
   unnamed only with ``statement_cache_size=0``: the caller's setting.
4. Rows may come as tuples, records or mappings (a psycopg connection with
   ``dict_row``): they are read in column order either way.
5. One asyncpg connection runs one statement at a time: asyncpg refuses a
   second while one is in progress (``InterfaceError``: another operation
   is in progress), where a psycopg connection queues it under its own
   lock. dmutex's statements on one asyncpg connection take turns, by one
   lock per connection (:func:`asyncpg_turn`) that every store, renewal and
   waiter on it shares: concurrent tasks, a lease's renewal beside the
   next acquire, a wait's ``LISTEN``. A pool lends each statement a
   connection and needs none. The caller's own statements on that
   connection do not take these turns: they need a connection of their own.
6. A SQLAlchemy engine is a pool (``dmutex._backends.sql.engines``): its
   statement runs on the driver's own connection (psycopg's or asyncpg's)
   as rules 2 to 5 say for that driver. Nothing of SQLAlchemy's
   transaction state changes: it began none, and on return its pool's
   reset (a rollback) finds the connection idle and sends nothing, on
   either driver. A connection the driver reports closed after a failure
   is invalidated (asyncpg's would otherwise come back from the pool
   closed, every time). Which runner is decided
   before any I/O by the dialect: ``name`` must be ``postgresql`` and
   ``driver`` psycopg (sync or asyncio, as the engine's face) or asyncpg
   (asyncio); any other (psycopg2, pg8000, another database) is refused.
   So is a SQLAlchemy ``Connection`` or ``Session`` (sync or asyncio),
   which has a psycopg connection's ``execute`` and ``info`` but is not
   one: it would hold dmutex's statements in its own transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TypeAlias, cast

from ..._errors import DMutexError, UnsupportedClientError
from ..shapes import defines, method
from ..sql.clients import SQLAlchemyDialectLike
from ..sql.engines import check_face, lend, lend_async
from .clients import (
    AsyncpgLike,
    AsyncPsycopgConnectionLike,
    AsyncPsycopgPoolLike,
    PsycopgConnectionLike,
    PsycopgConnectionStateLike,
    PsycopgPoolLike,
)
from .shapes import postgres_method
from .statements import Statement

__all__ = ["Params", "Row", "Runner", "asyncpg_turn", "runner"]

Row: TypeAlias = tuple[object, ...]
Params: TypeAlias = Mapping[str, object]
Runner: TypeAlias = Callable[[Statement, Params], object]
"""``run(statement, params)``: its rows (sync), or an awaitable of them (asyncio)."""

_IDLE = 0  # libpq's PQTRANS_IDLE: connected, outside any transaction


def _rows(found: object) -> list[Row]:
    """Rows as tuples in column order (rule 4)."""
    if not isinstance(found, Sequence):
        raise DMutexError(f"unexpected result from PostgreSQL: {found!r}")
    rows: list[Row] = []
    for row in found:
        if isinstance(row, Mapping):
            rows.append(tuple(row.values()))
        elif isinstance(row, Iterable) and not isinstance(row, (str, bytes)):
            rows.append(tuple(row))  # a tuple, or an asyncpg Record: values in column order
        else:
            raise DMutexError(f"unexpected row from PostgreSQL: {row!r}")
    return rows


def _outside_transaction(conn: PsycopgConnectionStateLike) -> None:
    """Refuse a connection inside the caller's transaction (rule 2)."""
    if conn.info.transaction_status != _IDLE:
        raise DMutexError(
            "the PostgreSQL connection is inside a transaction: a lease written there "
            "would not commit until it does. Give dmutex a connection of its own (in "
            "autocommit, or idle between statements), or a pool"
        )


def _psycopg(client: object) -> Callable[[Statement, Params], list[Row]]:
    """A runner on a sync psycopg connection."""
    conn = cast(PsycopgConnectionLike, client)
    method(conn, "execute")  # the one check of its shape that a call cannot wait for

    def once(statement: Statement, params: Params) -> list[Row]:
        cursor = conn.execute(statement.psycopg, params, prepare=False)
        return [] if cursor.description is None else _rows(cursor.fetchall())

    def run(statement: Statement, params: Params) -> list[Row]:
        if conn.autocommit:
            return once(statement, params)
        _outside_transaction(conn)
        with conn.transaction():
            return once(statement, params)

    return run


def _psycopg_async(client: object) -> Callable[[Statement, Params], Awaitable[list[Row]]]:
    """A runner on an asyncio psycopg connection."""
    conn = cast(AsyncPsycopgConnectionLike, client)
    method(conn, "execute")

    async def once(statement: Statement, params: Params) -> list[Row]:
        cursor = await conn.execute(statement.psycopg, params, prepare=False)
        return [] if cursor.description is None else _rows(await cursor.fetchall())

    async def run(statement: Statement, params: Params) -> list[Row]:
        if conn.autocommit:
            return await once(statement, params)
        _outside_transaction(conn)
        async with conn.transaction():
            return await once(statement, params)

    return run


def _psycopg_pool(client: object) -> Callable[[Statement, Params], list[Row]]:
    """A runner on a sync psycopg pool: one connection lent per statement."""
    pool = cast(PsycopgPoolLike, client)
    method(pool, "connection")

    def run(statement: Statement, params: Params) -> list[Row]:
        with pool.connection() as conn:
            return _psycopg(conn)(statement, params)

    return run


def _psycopg_pool_async(client: object) -> Callable[[Statement, Params], Awaitable[list[Row]]]:
    """A runner on an asyncio psycopg pool: one connection lent per statement."""
    pool = cast(AsyncPsycopgPoolLike, client)
    method(pool, "connection")

    async def run(statement: Statement, params: Params) -> list[Row]:
        async with pool.connection() as conn:
            return await _psycopg_async(conn)(statement, params)

    return run


_TURNS: weakref.WeakKeyDictionary[object, asyncio.Lock] = weakref.WeakKeyDictionary()


def asyncpg_turn(client: object) -> contextlib.AbstractAsyncContextManager[object]:
    """The turn of a statement on an asyncpg connection (rule 5); none on a pool.

    A connection that takes no weak reference takes no turns.
    """
    if defines(client, "acquire"):  # a pool: a connection of its own per statement
        return contextlib.nullcontext()
    try:
        turn = _TURNS.get(client)
    except TypeError:
        return contextlib.nullcontext()
    if turn is None:
        turn = _TURNS[client] = asyncio.Lock()
    return turn


def _asyncpg(client: object) -> Callable[[Statement, Params], Awaitable[list[Row]]]:
    """A runner on an asyncpg connection or pool (``fetch(query, *args)``, ``$n`` parameters)."""
    conn = cast(AsyncpgLike, client)
    method(conn, "fetch")

    async def run(statement: Statement, params: Params) -> list[Row]:
        async with asyncpg_turn(client):
            return _rows(await conn.fetch(statement.asyncpg, *statement.arguments(params)))

    return run


_ENGINE_DRIVERS = {False: ("psycopg",), True: ("psycopg", "asyncpg")}


def _engine_driver(engine: object, asynchronous: bool) -> str:
    """The driver of a SQLAlchemy engine that dmutex can run on, or an error (rule 6)."""
    dialect = cast(SQLAlchemyDialectLike, getattr(engine, "dialect", None))
    name, driver = getattr(dialect, "name", None), getattr(dialect, "driver", None)
    kind = "AsyncEngine" if asynchronous else "Engine"
    drivers = " or ".join(_ENGINE_DRIVERS[asynchronous])
    if name != "postgresql":
        raise UnsupportedClientError(
            f"a SQLAlchemy {kind} on {name!r} ({driver!r}): dmutex takes SQLAlchemy engines "
            f"on PostgreSQL, with the {drivers} driver, or on MySQL (for SQLite, pass a "
            "dmutex.SQLiteBackend)"
        )
    if driver not in _ENGINE_DRIVERS[asynchronous]:
        raise UnsupportedClientError(
            f"a SQLAlchemy {kind} on PostgreSQL with the {driver!r} driver: dmutex runs "
            f"its statements on the driver's connection, and a {kind}'s must be {drivers} "
            "(postgresql+psycopg://" + (" or postgresql+asyncpg://" if asynchronous else "") + ")"
        )
    return str(driver)


def _closed(conn: object) -> bool:
    """Whether the driver reports ``conn`` closed (asyncpg: is_closed(), psycopg: closed)."""
    is_closed = getattr(conn, "is_closed", None)
    return bool(is_closed() if callable(is_closed) else getattr(conn, "closed", False))


def runner(client: object, *, asynchronous: bool) -> Runner:
    """The runner of ``client``: a psycopg pool or connection, or an asyncpg connection or pool.

    By shape (``shapes.postgres_method``): ``fetch`` is asyncpg's (asyncio
    only), ``getconn`` a psycopg pool's (a psycopg connection has a
    ``connection`` property too), ``raw_connection`` a SQLAlchemy engine's
    (``sync_engine`` tells an ``AsyncEngine``), else a psycopg connection's
    ``execute``.
    """
    kind = postgres_method(client)
    if kind == "raw_connection":
        check_face(client, asynchronous)
        driver = _engine_driver(client, asynchronous)
        if asynchronous:
            on = _asyncpg if driver == "asyncpg" else _psycopg_async
            return lend_async(client, on, _closed)
        return lend(client, _psycopg, _closed)
    if kind == "execute" and type(client).__module__.split(".")[0] == "sqlalchemy":
        raise UnsupportedClientError(
            f"{type(client).__module__}.{type(client).__qualname__} is SQLAlchemy's, not a "
            "driver's connection, and holds a transaction of its own: give dmutex the Engine "
            "(or AsyncEngine) it came from"
        )
    if kind == "fetch":
        if not asynchronous:
            raise UnsupportedClientError(
                "asyncpg is an asyncio client: use AsyncDMutex / AsyncDSemaphore"
            )
        return _asyncpg(client)
    if kind == "getconn":
        return _psycopg_pool_async(client) if asynchronous else _psycopg_pool(client)
    return _psycopg_async(client) if asynchronous else _psycopg(client)

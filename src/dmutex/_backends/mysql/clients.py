"""The MySQL and MariaDB client contracts, as :class:`typing.Protocol` classes.

``dmutex._backends.clients`` gathers them for ``dmutex`` to publish.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Protocol

__all__ = [
    "AsyncMySQLConnectionLike",
    "AsyncMySQLCursorLike",
    "AsyncMySQLPoolLike",
    "MySQLConnectionLike",
    "MySQLConnectorPoolLike",
    "MySQLCursorLike",
]


class MySQLCursorLike(Protocol):
    """What dmutex uses of a sync MySQL cursor (PyMySQL, mysqlclient, mysql-connector)."""

    @property
    def description(self) -> Sequence[object] | None:
        """The result's columns; None for a statement without a result."""
        ...

    @property
    def rowcount(self) -> object:
        """The rows the statement changed (or returned): an int (asyncmy annotates no type)."""
        ...

    @property
    def lastrowid(self) -> int | None:
        """The id of the statement's OK packet: what ``LAST_INSERT_ID(expr)`` set, else 0."""
        ...

    # dmutex also calls execute(query, params), params a dict of str and int
    # values by name (%(name)s) or None; the drivers annotate its second
    # parameter too differently (a dict of Any, of their own union) for one
    # protocol to state it.

    def fetchall(self) -> Sequence[object]:
        """Every row of the result (tuples or mappings)."""
        ...

    def close(self) -> object:
        """Free the cursor."""
        ...


class MySQLConnectionLike(Protocol):
    """A sync MySQL or MariaDB connection: PyMySQL, mysqlclient (``MySQLdb``), mysql-connector.

    dmutex runs each statement on a cursor of its own and commits it if the
    connection is not in autocommit; it refuses a connection inside the
    caller's transaction (where the driver tells). One connection runs one
    of dmutex's statements at a time.
    """

    def cursor(self) -> MySQLCursorLike:
        """A new cursor."""
        ...

    def commit(self) -> object:
        """Commit the transaction a statement opened (autocommit off)."""
        ...

    def rollback(self) -> object:
        """Undo the transaction a failed statement opened (autocommit off)."""
        ...

    def get_server_info(self) -> str:
        """Never called: beside ``cursor`` it tells a MySQL connection from other DB-API ones."""
        ...


class AsyncMySQLCursorLike(Protocol):
    """What dmutex uses of an asyncio MySQL cursor (aiomysql, asyncmy)."""

    @property
    def description(self) -> Sequence[object] | None:
        """The result's columns; None for a statement without a result."""
        ...

    @property
    def rowcount(self) -> object:
        """The rows the statement changed (or returned): an int (asyncmy annotates no type)."""
        ...

    @property
    def lastrowid(self) -> int | None:
        """The id of the statement's OK packet."""
        ...

    # dmutex also awaits execute(query, params), as for MySQLCursorLike.

    def fetchall(self) -> Awaitable[Sequence[object]]:
        """Every row of the result."""
        ...

    def close(self) -> Awaitable[object]:
        """Free the cursor."""
        ...


class AsyncMySQLConnectionLike(Protocol):
    """An asyncio MySQL or MariaDB connection: ``aiomysql.Connection``, ``asyncmy.Connection``."""

    def cursor(self) -> AsyncMySQLCursorLike | Awaitable[AsyncMySQLCursorLike]:
        """A new cursor (aiomysql answers an awaitable of it)."""
        ...

    def commit(self) -> Awaitable[object]:
        """Commit the transaction a statement opened (autocommit off)."""
        ...

    def rollback(self) -> Awaitable[object]:
        """Undo the transaction a failed statement opened (autocommit off)."""
        ...

    def get_server_info(self) -> str:
        """Never called: beside ``cursor`` it tells a MySQL connection from other clients."""
        ...


class MySQLConnectorPoolLike(Protocol):
    """A mysql-connector pool (``mysql.connector.pooling.MySQLConnectionPool``).

    Each statement runs on a connection that ``get_connection()`` lends and
    ``close()`` gives back.
    """

    def get_connection(self) -> MySQLConnectionLike:
        """A connection of the pool, lent until its ``close()``."""
        ...

    @property
    def pool_name(self) -> str:
        """Never used: beside ``get_connection`` it tells the pool."""
        ...


class AsyncMySQLPoolLike(Protocol):
    """An aiomysql or asyncmy pool: each statement on a connection ``acquire()`` lends."""

    def acquire(self) -> AbstractAsyncContextManager[AsyncMySQLConnectionLike]:
        """A connection of the pool for the block, given back at its end."""
        ...

    @property
    def freesize(self) -> int:
        """Never used: beside ``acquire`` it tells an aiomysql or asyncmy pool."""
        ...

"""The client contracts, as :class:`typing.Protocol` classes.

dmutex imports no database package. It accepts any object shaped like one of
these, and detects which at run time from the object's type (see
``shapes.py``). The sync contracts return plain values and the asyncio ones
return awaitables, so that a type checker can tell an asyncio client handed
to a sync class wherever the client package's own annotations allow it.

Arguments that dmutex passes are positional-only here so that clients may
name their parameters as they like.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Protocol, TypeAlias

__all__ = [
    "AsyncMongoClientLike",
    "AsyncMongoCollectionLike",
    "AsyncMongoDatabaseLike",
    "AsyncMySQLConnectionLike",
    "AsyncMySQLCursorLike",
    "AsyncMySQLPoolLike",
    "AsyncPsycopgConnectionLike",
    "AsyncPsycopgCursorLike",
    "AsyncPsycopgPoolLike",
    "AsyncRedisCommandClient",
    "AsyncRedisSetEvalClient",
    "AsyncSQLAlchemyConnectionLike",
    "AsyncSQLAlchemyEngineLike",
    "AsyncpgLike",
    "MongoClientLike",
    "MongoCollectionLike",
    "MongoDatabaseLike",
    "MongoDeleteResultLike",
    "MongoUpdateResultLike",
    "MySQLConnectionLike",
    "MySQLConnectorPoolLike",
    "MySQLCursorLike",
    "PsycopgConnectionInfoLike",
    "PsycopgConnectionLike",
    "PsycopgConnectionStateLike",
    "PsycopgCursorLike",
    "PsycopgPoolLike",
    "RedisArg",
    "RedisCommandClient",
    "RedisReply",
    "RedisSetEvalClient",
    "SQLAlchemyDialectLike",
    "SQLAlchemyEngineLike",
    "SQLAlchemyLentConnectionLike",
]

RedisArg: TypeAlias = str | bytes | int | float
"""An argument dmutex sends in a Redis command."""

RedisReply: TypeAlias = bool | int | float | str | bytes | Sequence[object] | None
"""A reply dmutex can read from a sync Redis client (RESP2 or RESP3)."""

IndexKeys: TypeAlias = Sequence[tuple[str, int]]
Document: TypeAlias = Mapping[str, object]


# --- Redis -------------------------------------------------------------------


class RedisCommandClient(Protocol):
    """A sync Redis client with ``execute_command`` (redis-py, valkey-py, fakeredis)."""

    def execute_command(self, *args: RedisArg) -> RedisReply:
        """Send one command and return its reply."""
        ...


class AsyncRedisCommandClient(Protocol):
    """An asyncio Redis client with ``execute_command`` (``redis.asyncio.Redis``)."""

    def execute_command(self, *args: RedisArg) -> Awaitable[object]:
        """Send one command; the awaitable gives its reply."""
        ...


class RedisSetEvalClient(Protocol):
    """A sync Redis client offering ``set`` with ``px``/``nx`` and ``eval``."""

    def set(self, name: str, value: str, /, *, px: int, nx: bool) -> bool | str | bytes | None:
        """``SET name value PX px [NX]``."""
        ...

    def eval(self, script: str, numkeys: int, /, *keys_and_args: RedisArg) -> object:
        """Run a Lua script with ``EVAL``."""
        ...


class AsyncRedisSetEvalClient(Protocol):
    """An asyncio Redis client offering ``set`` with ``px``/``nx`` and ``eval``."""

    def set(
        self, name: str, value: str, /, *, px: int, nx: bool
    ) -> Awaitable[bool | str | bytes | None]:
        """``SET name value PX px [NX]``."""
        ...

    def eval(self, script: str, numkeys: int, /, *keys_and_args: RedisArg) -> Awaitable[object]:
        """Run a Lua script with ``EVAL``."""
        ...


# --- MongoDB -----------------------------------------------------------------


class MongoUpdateResultLike(Protocol):
    """What dmutex reads from the result of ``update_one``."""

    @property
    def matched_count(self) -> int:
        """How many documents the filter matched."""
        ...

    @property
    def upserted_id(self) -> object:
        """The ``_id`` of an inserted document, or None."""
        ...


class MongoDeleteResultLike(Protocol):
    """What dmutex reads from the result of ``delete_one``."""

    @property
    def deleted_count(self) -> int:
        """How many documents were deleted."""
        ...


class MongoCollectionLike(Protocol):
    """A sync MongoDB collection (``pymongo.collection.Collection``).

    A duplicate-key error is any exception whose ``code`` attribute is 11000.
    """

    def create_index(self, keys: IndexKeys, /, *, expireAfterSeconds: int) -> object:
        """Create a TTL index (idempotent on the server)."""
        ...

    def update_one(
        self, filter: Document, update: Document, /, *, upsert: bool = ...
    ) -> MongoUpdateResultLike:
        """Update (or with ``upsert``, insert) one document."""
        ...

    def delete_one(self, filter: Document, /) -> MongoDeleteResultLike:
        """Delete one matching document."""
        ...

    def distinct(self, key: str, filter: Document, /) -> list[object]:
        """The distinct values of ``key`` among matching documents."""
        ...


class MongoDatabaseLike(Protocol):
    """A sync MongoDB database (``pymongo.database.Database``)."""

    def get_collection(self, name: str, /) -> MongoCollectionLike:
        """The named collection (no I/O)."""
        ...


class MongoClientLike(Protocol):
    """A sync MongoDB client (``pymongo.MongoClient``, ``mongomock.MongoClient``)."""

    def get_database(self, name: str, /) -> MongoDatabaseLike:
        """The named database (no I/O)."""
        ...


class AsyncMongoCollectionLike(Protocol):
    """An asyncio MongoDB collection (pymongo's ``AsyncCollection``, motor's)."""

    def create_index(
        self,
        keys: IndexKeys,
        /,
        *,
        expireAfterSeconds: int,
    ) -> Awaitable[object]:
        """Create a TTL index (idempotent on the server)."""
        ...

    def update_one(
        self, filter: Document, update: Document, /, *, upsert: bool = ...
    ) -> Awaitable[MongoUpdateResultLike]:
        """Update (or with ``upsert``, insert) one document."""
        ...

    def delete_one(self, filter: Document, /) -> Awaitable[MongoDeleteResultLike]:
        """Delete one matching document."""
        ...

    def distinct(self, key: str, filter: Document, /) -> Awaitable[list[object]]:
        """The distinct values of ``key`` among matching documents."""
        ...


class AsyncMongoDatabaseLike(Protocol):
    """An asyncio MongoDB database (pymongo's ``AsyncDatabase``, motor's)."""

    def get_collection(self, name: str, /) -> AsyncMongoCollectionLike:
        """The named collection (no I/O)."""
        ...


class AsyncMongoClientLike(Protocol):
    """An asyncio MongoDB client (``pymongo.AsyncMongoClient``, motor's)."""

    def get_database(self, name: str, /) -> AsyncMongoDatabaseLike:
        """The named database (no I/O)."""
        ...


# --- PostgreSQL: psycopg 3 ----------------------------------------------------


class PsycopgCursorLike(Protocol):
    """What dmutex reads from a sync psycopg cursor: its rows (tuples or mappings)."""

    @property
    def description(self) -> Sequence[object] | None:
        """The result's columns; None for a statement without a result (DDL)."""
        ...

    def fetchall(self) -> Sequence[object]:
        """Every row of the result."""
        ...


class AsyncPsycopgCursorLike(Protocol):
    """What dmutex reads from an asyncio psycopg cursor: its rows (tuples or mappings)."""

    @property
    def description(self) -> Sequence[object] | None:
        """The result's columns; None for a statement without a result (DDL)."""
        ...

    def fetchall(self) -> Awaitable[Sequence[object]]:
        """Every row of the result."""
        ...


class PsycopgConnectionInfoLike(Protocol):
    """What dmutex reads of a psycopg connection's state (``Connection.info``)."""

    @property
    def transaction_status(self) -> int:
        """The transaction status (libpq's): 0 when idle, outside a transaction."""
        ...


class PsycopgConnectionStateLike(Protocol):
    """What dmutex reads of any psycopg connection before a statement: how it commits."""

    @property
    def autocommit(self) -> bool:
        """Whether each statement commits on its own."""
        ...

    @property
    def info(self) -> PsycopgConnectionInfoLike:
        """The connection's state."""
        ...


class PsycopgConnectionLike(PsycopgConnectionStateLike, Protocol):
    """A sync psycopg 3 connection (``psycopg.Connection``).

    In autocommit each statement commits on its own; otherwise dmutex runs
    each of its statements in a transaction of its own
    (``transaction()``), and refuses a connection already inside one.
    """

    def execute(
        self, query: str, params: Mapping[str, object], /, *, prepare: bool | None = ...
    ) -> PsycopgCursorLike:
        """Run one statement; dmutex passes ``prepare=False`` (no named prepared statement)."""
        ...

    def transaction(self) -> AbstractContextManager[object]:
        """A block that commits on success and rolls back on error."""
        ...


class AsyncPsycopgConnectionLike(PsycopgConnectionStateLike, Protocol):
    """An asyncio psycopg 3 connection (``psycopg.AsyncConnection``)."""

    def execute(
        self, query: str, params: Mapping[str, object], /, *, prepare: bool | None = ...
    ) -> Awaitable[AsyncPsycopgCursorLike]:
        """Run one statement; dmutex passes ``prepare=False`` (no named prepared statement)."""
        ...

    def transaction(self) -> AbstractAsyncContextManager[object]:
        """A block that commits on success and rolls back on error."""
        ...


class PsycopgPoolLike(Protocol):
    """A sync psycopg pool (``psycopg_pool.ConnectionPool``): one connection per statement."""

    def connection(self) -> AbstractContextManager[PsycopgConnectionLike]:
        """A connection of the pool for the block, given back at its end."""
        ...

    def getconn(self) -> object:
        """Never called: beside ``connection`` it tells a pool from a connection."""
        ...


class AsyncPsycopgPoolLike(Protocol):
    """An asyncio psycopg pool (``psycopg_pool.AsyncConnectionPool``)."""

    def connection(self) -> AbstractAsyncContextManager[AsyncPsycopgConnectionLike]:
        """A connection of the pool for the block, given back at its end."""
        ...

    def getconn(self) -> Awaitable[object]:
        """Never called: beside ``connection`` it tells a pool from a connection."""
        ...


# --- PostgreSQL: asyncpg ---------------------------------------------------------


class AsyncpgLike(Protocol):
    """An asyncpg connection or pool (``asyncpg.Connection``, ``asyncpg.Pool``).

    dmutex sends ``$n`` parameters positionally. asyncpg names and caches a
    prepared statement per query unless ``statement_cache_size=0``, which a
    pooler in transaction mode (PgBouncer) needs.
    """

    def fetch(self, query: str, /, *args: object) -> Awaitable[Sequence[object]]:
        """Run one statement; the awaitable gives its rows (records)."""
        ...

    def fetchrow(self, query: str, /, *args: object) -> Awaitable[object]:
        """Never called: beside ``fetch`` it tells asyncpg from other clients."""
        ...


# --- PostgreSQL: a SQLAlchemy engine ---------------------------------------------


class SQLAlchemyDialectLike(Protocol):
    """What dmutex reads of a SQLAlchemy engine's dialect, before any I/O."""

    @property
    def name(self) -> str:
        """The database: dmutex needs ``"postgresql"``."""
        ...

    @property
    def driver(self) -> str:
        """The driver: ``"psycopg"`` (sync or asyncio) or ``"asyncpg"``."""
        ...


class SQLAlchemyLentConnectionLike(Protocol):
    """A connection a SQLAlchemy pool lends (``PoolProxiedConnection``).

    dmutex runs its statement on ``driver_connection`` (a psycopg or asyncpg
    connection, as above) and gives nothing else to SQLAlchemy.
    """

    @property
    def driver_connection(self) -> object:
        """The driver's own connection."""
        ...

    def invalidate(self, e: BaseException | None = ..., /) -> None:
        """Discard the connection (the server dropped it) instead of giving it back."""
        ...

    def close(self) -> None:
        """Give the connection back to the pool."""
        ...


class SQLAlchemyEngineLike(Protocol):
    """A sync SQLAlchemy 2 engine (``sqlalchemy.Engine``) on PostgreSQL with psycopg 3.

    Each statement runs on a connection that ``raw_connection()`` lends, in
    a transaction of its own, and the connection goes back to the pool
    (``close()``) at once.
    """

    @property
    def dialect(self) -> SQLAlchemyDialectLike:
        """Its dialect: the database and driver, read before any I/O."""
        ...

    def raw_connection(self) -> SQLAlchemyLentConnectionLike:
        """A connection of the pool, lent until its ``close()``."""
        ...


class AsyncSQLAlchemyConnectionLike(Protocol):
    """What dmutex uses of an asyncio SQLAlchemy connection (``AsyncConnection``)."""

    def get_raw_connection(self) -> Awaitable[SQLAlchemyLentConnectionLike]:
        """The pool's connection that this one holds."""
        ...

    def invalidate(self, exception: BaseException | None = ..., /) -> Awaitable[None]:
        """Discard the pool's connection (the server dropped it) instead of giving it back."""
        ...


class AsyncSQLAlchemyEngineLike(Protocol):
    """An asyncio SQLAlchemy 2 engine (``AsyncEngine``) on asyncpg or psycopg 3.

    Each statement runs on the driver connection of a connection that
    ``connect()`` opens for it and closes after it.
    """

    @property
    def dialect(self) -> SQLAlchemyDialectLike:
        """Its dialect: the database and driver, read before any I/O."""
        ...

    @property
    def sync_engine(self) -> object:
        """Never used: it tells an asyncio engine from a sync one."""
        ...

    def connect(self) -> AbstractAsyncContextManager[AsyncSQLAlchemyConnectionLike]:
        """A connection for the block, closed (its pool's connection given back) at its end."""
        ...

    def raw_connection(self) -> Awaitable[object]:
        """Never called: a coroutine function, it tells the engine's face."""
        ...


# --- MySQL / MariaDB: DB-API connections -----------------------------------------


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

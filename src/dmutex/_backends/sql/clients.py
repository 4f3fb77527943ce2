"""The SQLAlchemy engines (both SQL backends) client contracts, as :class:`typing.Protocol` classes.

``dmutex._backends.clients`` gathers them for ``dmutex`` to publish.
"""

from __future__ import annotations

from collections.abc import Awaitable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

__all__ = [
    "AsyncSQLAlchemyConnectionLike",
    "AsyncSQLAlchemyEngineLike",
    "SQLAlchemyDialectLike",
    "SQLAlchemyEngineLike",
    "SQLAlchemyLentConnectionLike",
]


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

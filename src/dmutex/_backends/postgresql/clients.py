"""The PostgreSQL (psycopg 3, asyncpg) client contracts, as :class:`typing.Protocol` classes.

``dmutex._backends.clients`` gathers them for ``dmutex`` to publish.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Protocol

__all__ = [
    "AsyncPsycopgConnectionLike",
    "AsyncPsycopgCursorLike",
    "AsyncPsycopgPoolLike",
    "AsyncpgLike",
    "PsycopgConnectionInfoLike",
    "PsycopgConnectionLike",
    "PsycopgConnectionStateLike",
    "PsycopgCursorLike",
    "PsycopgPoolLike",
]


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

"""SQLAlchemy engines as pools: one driver connection lent per statement, for the SQL stores.

Rules of this module:

1. A SQLAlchemy engine is a pool of its driver's connections, and dmutex
   uses it as one: each statement runs on the driver's own connection
   (``driver_connection``), by the runner the store has for that driver,
   and SQLAlchemy runs none of dmutex's SQL. A sync ``Engine`` lends it
   with ``raw_connection()`` (until its ``close()``, in every SQLAlchemy 2
   release); an ``AsyncEngine`` with ``connect()`` (whose close gives the
   connection back on the event loop; a raw connection's own ``close()``
   would need SQLAlchemy's greenlet).
2. A statement that fails on a connection the driver then reports closed
   (the server dropped it) has it invalidated, as SQLAlchemy does on a
   disconnect: its pool discards it instead of lending it again.
3. Which engine face a client is, before any I/O: an ``AsyncEngine`` has
   ``sync_engine``; one of the other face is refused with the classes to use.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

from ..._errors import UnsupportedClientError
from ..shapes import defines, method
from .clients import AsyncSQLAlchemyEngineLike, SQLAlchemyEngineLike

__all__ = ["check_face", "lend", "lend_async"]

S = TypeVar("S")
P = TypeVar("P")
R = TypeVar("R")


def check_face(client: object, asynchronous: bool) -> None:
    """Refuse an engine of the other face (rule 3)."""
    is_async = defines(client, "sync_engine")
    if is_async != asynchronous:
        face = "AsyncDMutex / AsyncDSemaphore" if is_async else "DMutex / DSemaphore"
        raise UnsupportedClientError(
            f"a SQLAlchemy {'AsyncEngine' if is_async else 'Engine'} is "
            f"{'an asyncio' if is_async else 'a sync'} client: use {face}"
        )


def lend(
    client: object,
    on: Callable[[object], Callable[[S, P], R]],
    closed: Callable[[object], bool],
) -> Callable[[S, P], R]:
    """A runner on a sync engine: ``on(driver connection)``'s, one connection lent per statement."""
    engine = cast(SQLAlchemyEngineLike, client)
    method(engine, "raw_connection")

    def run(statement: S, params: P) -> R:
        lent = engine.raw_connection()
        conn = lent.driver_connection
        try:
            return on(conn)(statement, params)
        except Exception as error:
            if closed(conn):
                lent.invalidate(error)
            raise
        finally:
            lent.close()

    return run


def lend_async(
    client: object,
    on: Callable[[object], Callable[[S, P], Awaitable[R]]],
    closed: Callable[[object], bool],
) -> Callable[[S, P], Awaitable[R]]:
    """A runner on an asyncio engine: one connection opened per statement (rule 1)."""
    engine = cast(AsyncSQLAlchemyEngineLike, client)
    method(engine, "connect")

    async def run(statement: S, params: P) -> R:
        async with engine.connect() as opened:
            conn = (await opened.get_raw_connection()).driver_connection
            try:
                return await on(conn)(statement, params)
            except Exception as error:
                if closed(conn):
                    await opened.invalidate(error)
                raise

    return run

"""How a waiter listens for a release (``LISTEN``), on each kind of PostgreSQL client.

It sits beside the store (``store.py``), whose ``wait`` calls what
:func:`listener` returns; the release's notification is ``statements.py``'s
(rule 7).

Rules of this module:

1. A wait listens on a server session of its own for its length, and never
   blocks a connection that anyone else may need: a psycopg pool (sync or
   asyncio) or an asyncpg pool lends one connection for the wait, at most
   half the pool's ``max_size`` at once (:class:`~..redis.waits.Blockers`,
   shared by every store on the pool), and it is lent for no longer than
   the wait (``connection(timeout=...)``); an asyncpg connection listens
   itself (``add_listener``), since asyncpg reads notifications as they come
   without holding the connection, and stays free for other statements
   meanwhile. A single psycopg connection cannot: it delivers notifications
   only to a caller blocked on it (``notifies()``, under its lock), and the
   holder's release may need that very connection. Its waiters poll
   (``waiting.py``, rule 3); give dmutex a pool to wake them.
2. No release is missed between the failed attempt and the ``LISTEN``:
   once listening, the wait reads the key's holders (one statement,
   ``holders``) and ends at once if a permit is free. A wait that listens
   costs three statements besides the block: ``LISTEN``, that read,
   ``UNLISTEN`` (asyncpg's ``add_listener``/``remove_listener`` send the two).
3. A notification wakes every listener of the table; a wait ends only for
   its own key (the payload), and keeps listening for the rest of its time
   otherwise. A release of a semaphore's permit wakes all of that key's
   waiters: one wins, the others pause and wait again (``waiting.py``, rule 4).
4. A pooler in transaction mode (PgBouncer) hands the ``LISTEN`` to a server
   connection that the next transaction may give to another client, and a
   release's notification never reaches the waiter; no statement tells
   such a pooler from a server. So listening is the store's option
   (``listen``, on by default): behind such a pooler, turn it off and
   waiters poll within ``retry_delay``. Left on, they still get the lock
   by polling, as the wait times out; only the stray ``LISTEN`` remains on
   the pooler's server connections.
5. A wait answers True when it ended early (a notification for its key, or
   a free permit when it began), False when its time ran out, None when it
   could not listen (the budget was spent): the store then sleeps the rest.
   Errors propagate to the store, which sleeps the rest (``Store.wait``
   never raises).
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    aclosing,
    closing,
)
from typing import Protocol, TypeAlias, cast

from ..redis.waits import Blockers
from ..shapes import defines
from .runners import Row, _asyncpg, _psycopg, _psycopg_async
from .statements import Statements

__all__ = ["Listen", "listener"]

Listen: TypeAlias = Callable[[str, float], object]
"""``listen(key, seconds)``: rule 5's answer (sync), or an awaitable of it (asyncio)."""


class _Notify(Protocol):
    @property
    def payload(self) -> str: ...


class _ListeningConnection(Protocol):
    def notifies(
        self, *, timeout: float | None = None, stop_after: int | None = None
    ) -> Iterator[_Notify]: ...


class _AsyncListeningConnection(Protocol):
    def notifies(
        self, *, timeout: float | None = None, stop_after: int | None = None
    ) -> AsyncIterator[_Notify]: ...


class _Pool(Protocol):
    @property
    def max_size(self) -> int: ...

    def connection(self, timeout: float | None = None) -> AbstractContextManager[object]: ...


class _AsyncPool(Protocol):
    @property
    def max_size(self) -> int: ...

    def connection(self, timeout: float | None = None) -> AbstractAsyncContextManager[object]: ...


_Listener: TypeAlias = Callable[[object, int, str, str], None]


class _Asyncpg(Protocol):
    def add_listener(self, channel: str, callback: _Listener, /) -> Awaitable[None]: ...

    def remove_listener(self, channel: str, callback: _Listener, /) -> Awaitable[None]: ...


class _AsyncpgPool(Protocol):
    def get_max_size(self) -> int: ...

    def acquire(self, *, timeout: float | None = None) -> AbstractAsyncContextManager[object]: ...


def _free(rows: Sequence[Row], permits: int) -> bool:
    """Whether the ``holders`` statement's rows leave a permit free (rule 2)."""
    return sum(1 for row in rows if row[0] is not None) < permits


_POOLS: weakref.WeakKeyDictionary[object, Blockers] = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def _budget(pool: object, size: object) -> Blockers | None:
    """The waits' budget on ``pool``: half its ``size``, shared by its stores (rule 1)."""
    if isinstance(size, bool) or not isinstance(size, int) or size // 2 < 1:
        return None
    with _POOLS_LOCK:
        try:
            return _POOLS.setdefault(pool, Blockers(size // 2))
        except TypeError:  # a pool that takes no weak reference: a budget per store
            return Blockers(size // 2)


def _psycopg_pool(pool: _Pool, sql: Statements, permits: int) -> Listen | None:
    blockers = _budget(pool, pool.max_size)
    if blockers is None:
        return None

    def listen(key: str, seconds: float) -> bool | None:
        if not blockers.take():
            return None
        deadline = time.monotonic() + seconds
        try:
            with pool.connection(timeout=seconds) as conn:
                run = _psycopg(conn)
                run(sql.listen, {})
                try:
                    if _free(run(sql.holders, {"key": key, "permits": permits}), permits):
                        return True
                    heard = cast(_ListeningConnection, conn)
                    while (left := deadline - time.monotonic()) > 0:
                        with closing(heard.notifies(timeout=left, stop_after=1)) as notes:  # type: ignore[type-var]  # a generator has close()
                            if any(note.payload == key for note in notes):
                                return True
                    return False
                finally:
                    run(sql.unlisten, {})
        finally:
            blockers.give()

    return listen


def _budgeted(
    blockers: Blockers | None, wait: Callable[[str, float], Awaitable[bool]]
) -> Listen | None:
    """``wait`` on a connection lent by a pool, within the pool's budget (rule 1)."""
    if blockers is None:
        return None
    budget = blockers

    async def listen(key: str, seconds: float) -> bool | None:
        if not budget.take():
            return None
        try:
            return await wait(key, seconds)
        finally:
            budget.give()

    return listen


def _psycopg_pool_async(pool: _AsyncPool, sql: Statements, permits: int) -> Listen | None:
    async def lent(key: str, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        async with pool.connection(timeout=seconds) as conn:
            run = _psycopg_async(conn)
            await run(sql.listen, {})
            try:
                if _free(await run(sql.holders, {"key": key, "permits": permits}), permits):
                    return True
                heard = cast(_AsyncListeningConnection, conn)
                while (left := deadline - time.monotonic()) > 0:
                    notes = heard.notifies(timeout=left, stop_after=1)
                    async with aclosing(notes):  # type: ignore[type-var]  # an async generator
                        async for note in notes:
                            if note.payload == key:
                                return True
                return False
            finally:
                await run(sql.unlisten, {})

    return _budgeted(_budget(pool, pool.max_size), lent)


async def _asyncpg_wait(
    conn: object, key: str, seconds: float, sql: Statements, permits: int
) -> bool:
    """Rule 2 on an asyncpg connection: listen, read the holders, await the key's notification."""
    woken = asyncio.Event()

    def heard(_conn: object, _pid: int, _channel: str, payload: str) -> None:
        if payload == key:
            woken.set()

    listening = cast(_Asyncpg, conn)
    await listening.add_listener(sql.channel, heard)
    try:
        rows = await _asyncpg(conn)(sql.holders, {"key": key, "permits": permits})
        if _free(rows, permits):
            return True
        try:
            await asyncio.wait_for(woken.wait(), seconds)
        except asyncio.TimeoutError:
            return False
        return True
    finally:
        await listening.remove_listener(sql.channel, heard)


def _asyncpg_pool(pool: _AsyncpgPool, sql: Statements, permits: int) -> Listen | None:
    async def lent(key: str, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        async with pool.acquire(timeout=seconds) as conn:
            left = deadline - time.monotonic()
            return left > 0 and await _asyncpg_wait(conn, key, left, sql, permits)

    return _budgeted(_budget(pool, pool.get_max_size()), lent)


def listener(client: object, sql: Statements, permits: int, *, asynchronous: bool) -> Listen | None:
    """How a wait on ``client`` listens for ``sql``'s table; None where it cannot (rule 1).

    By shape, as :func:`~.runners.runner` tells clients apart: ``fetch`` is
    asyncpg's (a pool also has ``acquire``), ``getconn`` a psycopg pool's;
    anything else is a single psycopg connection, which never listens.
    """
    if defines(client, "fetch"):
        if defines(client, "acquire"):
            return _asyncpg_pool(cast(_AsyncpgPool, client), sql, permits)
        if not defines(client, "add_listener"):
            return None

        def listen(key: str, seconds: float) -> Awaitable[bool]:
            return _asyncpg_wait(client, key, seconds, sql, permits)

        return listen
    if defines(client, "getconn"):
        if asynchronous:
            return _psycopg_pool_async(cast(_AsyncPool, client), sql, permits)
        return _psycopg_pool(cast(_Pool, client), sql, permits)
    return None

"""How a waiter listens for a release (``LISTEN``), on each kind of PostgreSQL client.

It sits beside the store (``store.py``), whose ``wait`` calls what
:func:`listener` returns; the release's notification is ``statements.py``'s
(rule 7).

Rules of this module:

1. A wait listens on a server session of its own for its length, and never
   blocks a connection that anyone else may need: a psycopg pool (sync or
   asyncio) or an asyncpg pool lends one connection for the wait, at most
   half the pool's ``max_size`` at once (``..blocking``, rule 1), and it is
   lent for no longer than the wait (``connection(timeout=...)``); an asyncpg connection listens
   itself (``add_listener``), since asyncpg reads notifications as they come
   without holding the connection, and stays free for other statements
   meanwhile. A single psycopg connection cannot: it delivers notifications
   only to a caller blocked on it (``notifies()``, under its lock), and the
   holder's release may need that very connection. Its waiters poll
   (``waiting.py``, rule 3); give dmutex a pool to wake them. A SQLAlchemy
   engine's waiters poll too: its pool's size and overflow are its own
   business, and a wait that held one of its connections for seconds
   would count against the application's checkouts.
2. No release is missed between the failed attempt and the ``LISTEN``:
   once listening, the wait reads the key's holders (one statement,
   ``holders``; a read-write lock's store reads its row instead, a
   :class:`Probe`) and ends at once if a permit is free. A wait that listens
   costs three statements besides the block: ``LISTEN``, that read,
   ``UNLISTEN`` (asyncpg's ``add_listener``/``remove_listener`` send the two).
3. A notification wakes every listener of the table; a wait ends only for
   its own key (the payload), and keeps listening for the rest of its time
   otherwise. A release of a semaphore's permit wakes all of that key's
   waiters: one wins, the others pause and wait again (``waiting.py``, rule 4).
4. A pooler in transaction mode (PgBouncer) hands the ``LISTEN`` to a server
   connection that the next transaction may give to another client, so a
   release's notification would never reach the waiter. Such a pooler is
   told from a server by the process id: a server's session reports its own
   (``pg_backend_pid()``) at connection start, a pooler reports one of its
   own making. The first wait on a pool (or asyncpg connection) compares the
   two, once (one statement, remembered per pool); where they differ, the
   wait answers :data:`POOLED` and the store stops listening and marking for
   good: its waiters poll within ``retry_delay``. A pooler in session mode
   is taken for one too (its waiters poll, as they would on any pooler).
   ``listen=False`` on the store skips even that one statement.
5. A wait answers True when it ended early (a notification for its key, or
   a free permit when it began), False when its time ran out, None when it
   could not listen (the budget was spent): the store then sleeps the rest;
   :data:`POOLED` behind a pooler (rule 4).
   Errors propagate to the store, which sleeps the rest (``Store.wait``
   never raises).
6. A cancellation always propagates: a wait woken at the moment it is
   cancelled raises ``CancelledError``, it does not answer True (no
   ``asyncio.wait_for``, which swallows it there on Python <= 3.11); and
   the connection a wait was lent goes back with a budget of its own
   (:data:`RELEASE_TIMEOUT`), an error of its return never taking the
   place of the cancellation.
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
    suppress,
)
from dataclasses import dataclass
from typing import Protocol, TypeAlias, cast

from ..blocking import Blockers, pool_budget
from ..shapes import defines
from .runners import Params, Row, _asyncpg, _psycopg, _psycopg_async, asyncpg_turn
from .statements import Statement, Statements

__all__ = ["POOLED", "Listen", "Probe", "holders_probe", "listener"]

Listen: TypeAlias = Callable[[str, float], object]
"""``listen(key, seconds)``: rule 5's answer (sync), or an awaitable of it (asyncio)."""

POOLED = "pooled"
"""A wait's answer behind a pooler: never listen on this client again (rule 4)."""

PID_CHECK = Statement.of("SELECT pg_backend_pid()")

RELEASE_TIMEOUT = 10.0
"""The budget of an asyncpg pool's reset of a connection lent for a wait (rule 6).

asyncpg's default is the ``acquire``'s timeout, which the wait has spent by
then: the reset would time out, asyncpg terminate the connection, and its
``TimeoutError`` take the place of a cancellation that ended the wait."""


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

    def get_server_pid(self) -> int: ...


class _AsyncpgPool(Protocol):
    def get_max_size(self) -> int: ...

    def acquire(self, *, timeout: float | None = None) -> Awaitable[object]: ...

    def release(self, connection: object, *, timeout: float | None = None) -> Awaitable[None]: ...


@dataclass(frozen=True, slots=True)
class Probe:
    """What a wait reads once it listens (rule 2): a statement, and whether its rows say go.

    ``params(key)`` are the statement's parameters for ``key``; ``free(rows)``
    whether its rows say an attempt may now succeed. A store whose probe says
    go too rarely wakes its waiter later (by the end of its wait), never
    wrongly; one that says it too often costs an attempt.
    """

    statement: Statement
    params: Callable[[str], Params]
    free: Callable[[Sequence[Row]], bool]


def holders_probe(sql: Statements, permits: int) -> Probe:
    """The mutex store's probe: the ``holders`` statement leaves a permit free."""

    def free(rows: Sequence[Row]) -> bool:
        return sum(1 for row in rows if row[0] is not None) < permits

    return Probe(sql.holders, lambda key: {"key": key, "permits": permits}, free)


def _budget(pool: object, size: object) -> Blockers | None:
    """The waits' budget on ``pool``: half its ``size``, shared by its stores (rule 1)."""
    if isinstance(size, bool) or not isinstance(size, int) or size // 2 < 1:
        return None
    return pool_budget(pool, size // 2)


class _Info(Protocol):
    @property
    def backend_pid(self) -> int: ...


class _Described(Protocol):
    @property
    def info(self) -> _Info: ...


_VERDICTS: weakref.WeakKeyDictionary[object, bool] = weakref.WeakKeyDictionary()
_VERDICTS_LOCK = threading.Lock()


def _known(owner: object) -> bool | None:
    """Whether ``owner`` was found behind a pooler (rule 4); None: not checked yet."""
    with _VERDICTS_LOCK:
        try:
            return _VERDICTS.get(owner)
        except TypeError:  # takes no weak reference: checked at every wait
            return None


def _judge(owner: object, reported: object, rows: Sequence[Row]) -> bool:
    """Rule 4's verdict on ``owner`` from the pid its session reported and ``PID_CHECK``'s rows."""
    pooled = not rows or rows[0][0] != reported
    with _VERDICTS_LOCK, suppress(TypeError):  # takes no weak reference: checked at every wait
        _VERDICTS[owner] = pooled
    return pooled


def _psycopg_pool(pool: _Pool, sql: Statements, probe: Probe) -> Listen | None:
    blockers = _budget(pool, pool.max_size)
    if blockers is None:
        return None

    def listen(key: str, seconds: float) -> bool | str | None:
        if not blockers.take():
            return None
        deadline = time.monotonic() + seconds
        try:
            with pool.connection(timeout=seconds) as conn:
                run = _psycopg(conn)
                pooled = _known(pool)
                if pooled is None:
                    reported = cast(_Described, conn).info.backend_pid
                    pooled = _judge(pool, reported, run(PID_CHECK, {}))
                if pooled:
                    return POOLED
                run(sql.listen, {})
                try:
                    if probe.free(run(probe.statement, probe.params(key))):
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
    blockers: Blockers | None, wait: Callable[[str, float], Awaitable[bool | str]]
) -> Listen | None:
    """``wait`` on a connection lent by a pool, within the pool's budget (rule 1)."""
    if blockers is None:
        return None
    budget = blockers

    async def listen(key: str, seconds: float) -> bool | str | None:
        if not budget.take():
            return None
        try:
            return await wait(key, seconds)
        finally:
            budget.give()

    return listen


def _psycopg_pool_async(pool: _AsyncPool, sql: Statements, probe: Probe) -> Listen | None:
    async def lent(key: str, seconds: float) -> bool | str:
        deadline = time.monotonic() + seconds
        async with pool.connection(timeout=seconds) as conn:
            run = _psycopg_async(conn)
            pooled = _known(pool)
            if pooled is None:
                reported = cast(_Described, conn).info.backend_pid
                pooled = _judge(pool, reported, await run(PID_CHECK, {}))
            if pooled:
                return POOLED
            await run(sql.listen, {})
            try:
                if probe.free(await run(probe.statement, probe.params(key))):
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
    conn: object, key: str, seconds: float, sql: Statements, probe: Probe, owner: object
) -> bool | str:
    """Rule 2 on an asyncpg connection: listen, read the holders, await the key's notification.

    ``owner`` (the pool, or the connection itself) keeps rule 4's verdict.
    """
    pooled = _known(owner)
    if pooled is None:
        reported = cast(_Asyncpg, conn).get_server_pid()
        pooled = _judge(owner, reported, await _asyncpg(conn)(PID_CHECK, {}))
    if pooled:
        return POOLED
    woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def heard(_conn: object, _pid: int, _channel: str, payload: str) -> None:
        if payload == key and not woken.done():
            woken.set_result(None)

    listening = cast(_Asyncpg, conn)
    async with asyncpg_turn(conn):  # its LISTEN (runners.py, rule 5)
        await listening.add_listener(sql.channel, heard)
    try:
        rows = await _asyncpg(conn)(probe.statement, probe.params(key))
        if probe.free(rows):
            return True
        # Not asyncio.wait_for: on Python <= 3.11 it returns the wakeup and
        # swallows a cancellation that lands as the notification does (rule 6).
        done, _ = await asyncio.wait({woken}, timeout=seconds)
        return bool(done)
    finally:
        async with asyncpg_turn(conn):  # its UNLISTEN
            await listening.remove_listener(sql.channel, heard)


def _asyncpg_pool(pool: _AsyncpgPool, sql: Statements, probe: Probe) -> Listen | None:
    async def lent(key: str, seconds: float) -> bool | str:
        deadline = time.monotonic() + seconds
        conn = await pool.acquire(timeout=seconds)
        try:
            left = deadline - time.monotonic()
            woken = left > 0 and await _asyncpg_wait(conn, key, left, sql, probe, pool)
        except BaseException:
            with suppress(Exception):  # the wait's error (a cancellation) outranks the release's
                await pool.release(conn, timeout=RELEASE_TIMEOUT)
            raise
        await pool.release(conn, timeout=RELEASE_TIMEOUT)
        return woken

    return _budgeted(_budget(pool, pool.get_max_size()), lent)


def listener(
    client: object,
    sql: Statements,
    permits: int,
    *,
    asynchronous: bool,
    probe: Probe | None = None,
) -> Listen | None:
    """How a wait on ``client`` listens for ``sql``'s table; None where it cannot (rule 1).

    ``probe``: what the wait reads once listening (rule 2); the mutex
    store's, for ``permits`` permits, if None.

    By shape, as :func:`~.runners.runner` tells clients apart: ``fetch`` is
    asyncpg's (a pool also has ``acquire``), ``getconn`` a psycopg pool's;
    anything else is a single psycopg connection or a SQLAlchemy engine,
    which never listen.
    """
    if probe is None:
        probe = holders_probe(sql, permits)
    if defines(client, "fetch"):
        if defines(client, "acquire"):
            return _asyncpg_pool(cast(_AsyncpgPool, client), sql, probe)
        if not defines(client, "add_listener"):
            return None

        def listen(key: str, seconds: float) -> Awaitable[bool | str]:
            return _asyncpg_wait(client, key, seconds, sql, probe, client)

        return listen
    if defines(client, "getconn"):
        if asynchronous:
            return _psycopg_pool_async(cast(_AsyncPool, client), sql, probe)
        return _psycopg_pool(cast(_Pool, client), sql, probe)
    return None

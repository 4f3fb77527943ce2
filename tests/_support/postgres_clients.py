"""PostgreSQL clients for the fault tests: asyncio wrappers around each statement, a table read.

An intercepted client hands each statement dmutex sends to a :class:`Sender`,
which sends it on the real client when it likes:

- :class:`Phases` (``tests/faults/cancellation/test_cancellation.py``), the PostgreSQL
  twin of :class:`~tests._support.fault_clients.DelayingRedis`: a random short
  sleep before the statement is handed to the real client and another after
  its reply came back, each of :data:`~tests._support.fault_clients.PHASES`
  noted, so that a test can tell whether a cancellation landed before the
  statement was sent, while the driver awaited the server, or after the reply
  but before dmutex had it;
- :class:`Gate` (``tests/faults/cancellation/test_holes.py``): the statement runs, then its
  reply is held until the test opens the gate.

The wrappers, each with the names by which dmutex tells its kind
(``shapes.py``) and nothing else of the real client's:

- :class:`InterceptedPsycopg`: a ``psycopg.AsyncConnection`` (its ``execute``);
- :class:`InterceptedPsycopgPool`: a ``psycopg_pool.AsyncConnectionPool``,
  whose lent connections are :class:`InterceptedPsycopg`;
- :class:`InterceptedAsyncpg`: an ``asyncpg`` connection (its ``fetch``);
- :class:`InterceptedAsyncpgPool`: an ``asyncpg`` pool (its ``fetch``).

A connection that a pool lends for a waiter's ``LISTEN`` (asked with a
``timeout``: only ``listening.py`` asks so) is the real one, not intercepted,
and the task is noted as in a retry wait while it holds it: its statements
are the wait's, not the request's.

:func:`active_permits` reads what a lock table holds behind dmutex's back.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

import psycopg
from psycopg import sql

from tests._support.cancellation import doing
from tests._support.fault_clients import PHASES

T = TypeVar("T")


class Sender(Protocol):
    """Sends one statement: ``request()`` sends it on the real client; ``values`` are its
    parameters' values."""

    async def send(self, values: tuple[object, ...], request: Callable[[], Awaitable[T]]) -> T: ...


class Phases:
    """The two sleeps around each statement, and the notes of its phases.

    ``on_phase(phase)`` as each phase begins, and None when the statement is
    over however it ended; ``on_send(values)`` with its parameters' values as
    it is handed to the real client.
    """

    def __init__(
        self,
        rng: random.Random,
        max_delay: float,
        on_send: Callable[[tuple[object, ...]], None],
        on_phase: Callable[[str | None], None],
    ) -> None:
        self._rng = rng
        self._max_delay = max_delay
        self._on_send = on_send
        self._on_phase = on_phase

    async def send(self, values: tuple[object, ...], request: Callable[[], Awaitable[T]]) -> T:
        before, in_flight, after = PHASES
        try:
            self._on_phase(before)
            await asyncio.sleep(self._rng.uniform(0, self._max_delay))
            self._on_phase(in_flight)
            self._on_send(values)
            reply = await request()
            self._on_phase(after)
            await asyncio.sleep(self._rng.uniform(0, self._max_delay))
        finally:
            self._on_phase(None)
        return reply


class Gate:
    """Each statement runs on the server; the reply of a held one waits for :attr:`gate`.

    :meth:`hold` holds the next statement sent: it runs, :attr:`arrived` is
    set, and its reply is returned once :attr:`gate` is set (the moment a
    cancellation can land between "done on the server" and "reply read").
    :attr:`sent` counts the statements sent.
    """

    def __init__(self) -> None:
        self._hold = False
        self.arrived = asyncio.Event()
        self.gate = asyncio.Event()
        self.sent = 0

    def hold(self) -> None:
        self._hold = True
        self.arrived.clear()
        self.gate.clear()

    async def send(self, values: tuple[object, ...], request: Callable[[], Awaitable[T]]) -> T:
        reply = await request()
        self.sent += 1
        if self._hold:
            self._hold = False
            self.arrived.set()
            await self.gate.wait()
        return reply


@contextlib.asynccontextmanager
async def _waiting(lent: contextlib.AbstractAsyncContextManager[T]) -> AsyncIterator[T]:
    """A connection lent for a wait, the task noted as in a retry wait while it holds it."""
    before = doing("retry wait")
    try:
        async with lent as conn:
            yield conn
    finally:
        doing(before)


class InterceptedPsycopg:
    """A ``psycopg.AsyncConnection`` whose ``execute`` goes through a :class:`Sender`."""

    def __init__(self, inner: Any, sender: Sender) -> None:
        self._inner = inner
        self._sender = sender

    @property
    def info(self) -> psycopg.ConnectionInfo:
        info: psycopg.ConnectionInfo = self._inner.info
        return info

    @property
    def autocommit(self) -> bool:
        return bool(self._inner.autocommit)

    def transaction(self) -> Any:
        return self._inner.transaction()

    async def execute(
        self, query: str, params: Mapping[str, object], /, *, prepare: bool | None = None
    ) -> Any:
        return await self._sender.send(
            tuple(params.values()), lambda: self._inner.execute(query, params, prepare=prepare)
        )


class InterceptedPsycopgPool:
    """A ``psycopg_pool.AsyncConnectionPool`` lending :class:`InterceptedPsycopg` connections."""

    def __init__(self, inner: Any, sender: Sender) -> None:
        self._inner = inner
        self._sender = sender

    @property
    def max_size(self) -> int:
        size: int = self._inner.max_size
        return size

    async def getconn(self) -> Any:  # the shape of a pool; dmutex never calls it
        raise AssertionError("dmutex borrows connections by connection()")

    def connection(
        self, timeout: float | None = None
    ) -> contextlib.AbstractAsyncContextManager[Any]:
        if timeout is not None:  # a waiter's LISTEN
            return _waiting(self._inner.connection(timeout=timeout))
        return self._lent()

    @contextlib.asynccontextmanager
    async def _lent(self) -> AsyncIterator[InterceptedPsycopg]:
        async with self._inner.connection() as conn:
            yield InterceptedPsycopg(conn, self._sender)


class _InterceptedFetch:
    def __init__(self, inner: Any, sender: Sender) -> None:
        self._inner = inner
        self._sender = sender

    async def fetch(self, query: str, *args: object) -> Any:
        return await self._sender.send(args, lambda: self._inner.fetch(query, *args))

    async def fetchrow(self, query: str, *args: object) -> Any:  # the shape; never called
        raise AssertionError("dmutex reads rows by fetch()")


class InterceptedAsyncpg(_InterceptedFetch):
    """An ``asyncpg`` connection whose ``fetch`` goes through a :class:`Sender`; it listens
    itself, as the real one does."""

    def get_server_pid(self) -> int:
        pid: int = self._inner.get_server_pid()
        return pid

    async def add_listener(self, channel: str, callback: Callable[..., None], /) -> None:
        await self._inner.add_listener(channel, callback)

    async def remove_listener(self, channel: str, callback: Callable[..., None], /) -> None:
        await self._inner.remove_listener(channel, callback)


class InterceptedAsyncpgPool(_InterceptedFetch):
    """An ``asyncpg`` pool whose ``fetch`` goes through a :class:`Sender`."""

    def get_max_size(self) -> int:
        size: int = self._inner.get_max_size()
        return size

    def acquire(
        self, *, timeout: float | None = None
    ) -> contextlib.AbstractAsyncContextManager[Any]:
        return _waiting(self._inner.acquire(timeout=timeout))  # only a waiter's LISTEN asks


def _present(
    raw: psycopg.Connection[Any], schema: str, tables: list[str]
) -> list[tuple[str, sql.Composable]]:
    """Those of ``tables`` that exist in ``schema``: each name, and its qualified identifier."""
    named = [(table, sql.Identifier(schema, table)) for table in tables]
    return [
        (table, name)
        for table, name in named
        if raw.execute("SELECT to_regclass(%s)", (name.as_string(raw),)).fetchone() != (None,)
    ]


def active_permits(raw: psycopg.Connection[Any], schema: str, tables: list[str]) -> dict[str, str]:
    """Active permit rows of the ``tables`` that exist in ``schema``: ``{table/key: token}``."""
    found: dict[str, str] = {}
    for table, name in _present(raw, schema, tables):
        query = sql.SQL(
            'SELECT "key", "value" FROM {} '
            'WHERE "key" LIKE %s AND "expired_at" > statement_timestamp()'
        ).format(name)
        for key, value in raw.execute(query, ("permit:%",)).fetchall():
            found[f"{table}/{key}"] = str(value)
    return found


def drop_permits(raw: psycopg.Connection[Any], schema: str, tables: list[str]) -> None:
    """Delete every permit row of ``tables`` in ``schema`` (the fence rows stay)."""
    for _, name in _present(raw, schema, tables):
        raw.execute(sql.SQL('DELETE FROM {} WHERE "key" LIKE %s').format(name), ("permit:%",))

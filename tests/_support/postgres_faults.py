"""What the PostgreSQL fault suites share: spied clients, the table seen directly, the locks.

The suites (``tests/faults/network/test_postgres_proxy.py``,
``network/test_postgres_lost_reply.py``, ``process/test_postgres_restart.py``
and ``tests/faults/test_postgres_faults.py``) judge every row a run leaves
by the calls that explain it:

- :class:`SpiedConnection` (psycopg) and :class:`SpiedAsyncpg` record the
  tokens each statement carries, before it is sent, in the calling
  worker's :data:`SENT` list, and the tokens of each release statement the
  server answered in :data:`RELEASED`;
- :class:`Inspector` reads and deletes a table's rows through a direct
  autocommit connection of its own, reconnecting once after a restart;
- :func:`make_lock` makes a mutex or a ``max_permits=3`` semaphore of either
  face; :func:`release_by_token` and :func:`release_by_token_async` release
  a lease on another instance than the one that took it;
- :func:`spied_pool` lends them from a psycopg pool;
- :func:`proxied_url`, :func:`asyncpg_dsn` and :func:`is_startup` put the
  clients behind a :class:`~tests._support.fault_proxy.FaultProxy`.

What the clients raise when the network or the server goes away:
:data:`SYNC_FAILURES` and :data:`ASYNC_FAILURES`. asyncpg has one error
that is not a connection error by type: a connection whose server ended
it while idle, used before asyncpg has seen it close, raises
``InternalClientError("cannot switch to state 12; another operation (2)
is in progress")`` (MagicStack/asyncpg issues 784 and 1069). It is
accepted with that message only (:func:`unclear`), and shown by name in
the summaries.

``DMUTEX_FAULT_SEED`` changes the seed (:data:`SEED`).
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import asyncpg
import psycopg
import psycopg_pool
from psycopg import sql

from dmutex import AsyncDMutex, AsyncDSemaphore, DMutex, DSemaphore
from tests._support import postgres_servers, servers
from tests._support.fault_proxy import FaultProxy
from tests._support.tokens import TOKEN

Kind: TypeAlias = Literal["mutex", "semaphore"]
FaceName: TypeAlias = Literal["sync", "async"]
SyncLock: TypeAlias = DMutex | DSemaphore
AsyncLock: TypeAlias = AsyncDMutex | AsyncDSemaphore
Lock: TypeAlias = SyncLock | AsyncLock

SEED = int(os.environ.get("DMUTEX_FAULT_SEED", "20240611"))
PERMITS = {"mutex": 1, "semaphore": 3}
TTL = 1.0  # every worker's lease: an orphan lasts this long at most
CONNECT_TIMEOUT = 2  # seconds: libpq's connect_timeout, asyncpg's timeout
POOL_TIMEOUT = 5.0  # psycopg_pool's wait for a connection


# What the clients raise when the network or the server goes away.
SYNC_FAILURES: tuple[type[Exception], ...] = (psycopg.OperationalError,)
ASYNC_FAILURES: tuple[type[Exception], ...] = (
    asyncpg.PostgresConnectionError,  # ConnectionDoesNotExistError, ...
    asyncpg.CannotConnectNowError,  # the server starting up (recovery)
    asyncpg.InterfaceError,  # "connection is closed" on a proxy of a dead connection
    OSError,  # ConnectionRefusedError, ConnectionResetError
    asyncio.TimeoutError,  # the connect timeout
    # A connection whose server ended it while idle, used before asyncpg saw it close:
    # "cannot switch to state 12; another operation (2) is in progress" (MagicStack/asyncpg
    # issues 784 and 1069, open). Only that message is let through: see ``judged_async``.
    asyncpg.InternalClientError,
)
ASYNCPG_STATE_ERROR = "another operation (2) is in progress"


def unclear(error: BaseException) -> str | None:
    """Why ``error``, a failure of the asyncio client, is not the known one; None if it is."""
    if isinstance(error, asyncpg.InternalClientError) and ASYNCPG_STATE_ERROR not in str(error):
        return f"asyncpg's internal error is not the known one: {error!r}"
    return None


# --- the tokens each call sent ----------------------------------------------------------------

SENT: ContextVar[list[str] | None] = ContextVar("SENT", default=None)
# Tokens whose release statement completed: the server answered it, so no live row holds them.
RELEASED: set[str] = set()
RELEASE_TEXT = "WITH gone AS (DELETE FROM"  # how dmutex's release statement starts


def _released(query: object, values: Sequence[object]) -> None:
    if isinstance(query, str) and query.startswith(RELEASE_TEXT):
        RELEASED.update(v for v in values if isinstance(v, str) and TOKEN.fullmatch(v))


def _note(values: Sequence[object]) -> None:
    """Record every token among ``values`` in the calling worker's list (if it keeps one)."""
    sent = SENT.get()
    if sent is not None:
        sent.extend(v for v in values if isinstance(v, str) and TOKEN.fullmatch(v))


class SpiedConnection(psycopg.Connection[tuple[Any, ...]]):
    """A psycopg connection that records the tokens of each statement, before it is sent."""

    def execute(  # one signature for psycopg's overloads (Any: compatible with each)
        self,
        query: Any,
        params: Any = None,
        *,
        prepare: bool | None = None,
        binary: bool = False,
    ) -> psycopg.Cursor[tuple[Any, ...]]:
        values = list(params.values()) if isinstance(params, Mapping) else []
        _note(values)
        cursor = super().execute(query, params, prepare=prepare, binary=binary)
        _released(query, values)
        return cursor


class SpiedAsyncpg(asyncpg.Connection):
    """An asyncpg connection that records the tokens of each statement, before it is sent."""

    async def fetch(self, query: str, *args: object, **options: Any) -> list[Any]:
        _note(args)
        found: list[Any] = await super().fetch(query, *args, **options)
        _released(query, args)
        return found


def spied_pool(url: str) -> psycopg_pool.ConnectionPool[SpiedConnection]:
    """An open psycopg pool of one or two :class:`SpiedConnection` in autocommit, to ``url``."""
    return psycopg_pool.ConnectionPool(
        url,
        min_size=1,
        max_size=2,
        kwargs={"autocommit": True},
        connection_class=SpiedConnection,
        timeout=POOL_TIMEOUT,
        open=True,
    )


def proxied_url(url: str, proxy: FaultProxy) -> str:
    """``url`` through ``proxy``: its host and port, no TLS (the proxy sees plain messages)."""
    params = psycopg.conninfo.conninfo_to_dict(url)
    params.update(host=proxy.host, port=str(proxy.port), sslmode="disable")
    params.setdefault("connect_timeout", str(CONNECT_TIMEOUT))
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in params.items()})


def asyncpg_dsn(conninfo: str) -> dict[str, Any]:
    """asyncpg's keyword arguments for a libpq ``conninfo`` (host, port, user, database)."""
    params = psycopg.conninfo.conninfo_to_dict(conninfo)
    return {
        "host": str(params.get("host") or servers.LOOPBACK),
        "port": int(str(params.get("port") or 5432)),
        "user": str(params.get("user") or postgres_servers.SUPERUSER),
        "database": str(params.get("dbname") or postgres_servers.DATABASE),
        "password": None if params.get("password") is None else str(params["password"]),
        "ssl": False,
        "timeout": CONNECT_TIMEOUT,
    }


def is_startup(chunk: bytes) -> bool:
    """A startup packet (protocol 3.0) or SSLRequest: spared, so that connecting is not faulted."""
    return len(chunk) >= 8 and chunk[4:8] in (b"\x00\x03\x00\x00", b"\x04\xd2\x16\x2f")


def release_by_token(lock: SyncLock, key: str, token: str) -> bool:
    """``DSemaphore.release(key, token)``, else the mutex's ``unlock(key, token)`` (pytestmark)."""
    if isinstance(lock, DSemaphore):
        return lock.release(key, token)
    return lock.unlock(key, token)


async def release_by_token_async(lock: AsyncLock, key: str, token: str) -> bool:
    if isinstance(lock, AsyncDSemaphore):
        return await lock.release(key, token)
    return await lock.unlock(key, token)


def table_of(kind: Kind, service: str) -> str:
    return ("_dmutex_" if kind == "mutex" else "_dsemaphore_") + service


def make_lock(
    face: FaceName, kind: Kind, client: Any, service: str, schema: str | None, **more: Any
) -> Lock:
    options: dict[str, Any] = {"schema_name": schema, "default_ttl_seconds": TTL, **more}
    if kind == "semaphore":
        options["max_permits"] = PERMITS[kind]
    if face == "sync":
        return (DMutex if kind == "mutex" else DSemaphore)(service, client, **options)
    return (AsyncDMutex if kind == "mutex" else AsyncDSemaphore)(service, client, **options)


# --- the table, seen from a clean direct connection ------------------------------------------


@dataclass
class Live:
    """A live row: its key, token, and seconds left by the server's clock."""

    key: str
    token: str
    left: float


class Inspector:
    """One table through a direct autocommit connection of its own (shared, serialized)."""

    def __init__(self, url: str, schema: str | None, table: str) -> None:
        self.url = url
        self.conn = self._connect()
        self.name = sql.Identifier(table) if schema is None else sql.Identifier(schema, table)
        self._lock = threading.Lock()

    def _connect(self) -> psycopg.Connection[tuple[Any, ...]]:
        return psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT)

    def execute(self, query: sql.Composed, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        """Its rows; on a connection the server dropped (a restart), once more on a new one."""
        with self._lock:
            if self.conn.broken or self.conn.closed:
                self.conn = self._connect()
            try:
                cursor = self.conn.execute(query, params)
            except psycopg.OperationalError:
                if not (self.conn.broken or self.conn.closed):
                    raise
                self.conn = self._connect()
                cursor = self.conn.execute(query, params)
            return [] if cursor.description is None else cursor.fetchall()

    def live(self) -> list[Live]:
        query = sql.SQL(
            """SELECT "key", "value", extract(epoch FROM "expired_at" - clock_timestamp())
            FROM {} WHERE "key" LIKE 'permit:%%' AND "expired_at" > clock_timestamp()"""
        ).format(self.name)
        found = self.execute(query)
        return [Live(str(k), str(v), float(left)) for k, v, left in found]

    def holding(self, tokens: Sequence[str]) -> list[str]:
        """Keys of every row (live or not) that holds one of ``tokens``."""
        if not tokens:
            return []
        query = sql.SQL('SELECT "key" FROM {} WHERE "value" = ANY(%s)').format(self.name)
        return [str(k) for (k,) in self.execute(query, (list(tokens),))]

    def delete(self, tokens: Sequence[str]) -> None:
        query = sql.SQL('DELETE FROM {} WHERE "value" = ANY(%s)').format(self.name)
        self.execute(query, (list(tokens),))

    def close(self) -> None:
        self.conn.close()


def service_name(prefix: str) -> str:
    """A service of the case's own: ``prefix`` and 32 random bits."""
    return f"{prefix}{random.Random().getrandbits(32):08x}"

"""The backends the behaviour tests run on, behind one interface.

A :class:`Backend` makes clients of either face over one storage, forces a
permit to expire, lists what storage holds, and cleans up. The contract suite
(``tests/contract``) and the state machine (``tests/model``) both see a
backend through a :class:`Rig`: one backend, one face, and the event loop an
async face needs. A new backend adds a class here; neither suite changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sqlite3
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

import asyncpg
import fakeredis
import mongomock
import psycopg
import psycopg_pool
import pymongo
import redis
import sqlalchemy
import sqlalchemy.pool
from psycopg import sql
from sqlalchemy.ext.asyncio import create_async_engine

from dmutex import InMemoryBackend, ManualClock, SQLiteBackend
from dmutex._core.lease import now_ms
from tests._support.dynamodb_backend import Dynamo
from tests._support.elections import ElectionFace
from tests._support.etcd_backend import Etcd
from tests._support.faces import Face, FaceName, Kind, LoopThread
from tests._support.mongo_clients import AsyncMongomockClient, frozen_ttl_monitor
from tests._support.mongo_servers import AsyncRedirectedClient, RedirectedClient, Session
from tests._support.mysql_backend import MySQL
from tests._support.postgres_servers import Session as PostgresSession
from tests._support.redis_clients import SERVER_VARIANTS, Made, close_made
from tests._support.rwfaces import RWFace
from tests._support.rwrows import hold_expired
from tests._support.sqlite_rows import quoted

Runner = Callable[[Awaitable[object]], object]


class Backend(Protocol):
    clock: ManualClock | None
    """A clock tests may move (instances are made with it), or None: real time."""

    ttls: tuple[float, ...]
    """Lease lengths (seconds) to draw from; whole milliseconds each."""

    def client(self, asynchronous: bool) -> object:
        """A client for the sync or the asyncio classes; all share one storage."""
        ...

    def force_expire(self, key: str, slot: int | None = None) -> None:
        """Make the permits of ``key`` (only ``slot``'s if given) expire now, in every namespace."""
        ...

    def active(self, prefix: str) -> dict[str, str]:
        """Active permits under key prefix ``prefix``: storage key -> token."""
        ...

    def close(self, run: Runner | None) -> None:
        """Release what the backend holds; ``run`` awaits on the async face's loop."""
        ...


def slot_pattern(key: str, slot: int | None) -> str:
    """A regular expression for the MongoDB ``_id`` of ``key``'s slot(s)."""
    return f"^permit:{'[0-9]+' if slot is None else slot}:{re.escape(key)}$"


class Memory:
    """InMemoryBackend on a ManualClock."""

    ttls: tuple[float, ...] = (0.001, 0.25, 1.5, 30.0)

    def __init__(self) -> None:
        self.clock: ManualClock | None = ManualClock()
        self._backend = InMemoryBackend(clock=self.clock)

    def client(self, asynchronous: bool) -> object:
        return self._backend

    def force_expire(self, key: str, slot: int | None = None) -> None:
        self._backend.force_expire(key, slot)

    def active(self, prefix: str) -> dict[str, str]:
        snapshot = self._backend.snapshot().items()
        return {name: token for name, (token, _) in snapshot if name.startswith(prefix)}

    def close(self, run: Runner | None) -> None:
        pass


class _Redis:
    """What every Redis backend shares: a sync inspector (decoding to str) on the server.

    Leases are long enough (30 s and more) that none runs out during a test
    in real time; expiry is forced by giving the slot key an expiry in the
    past, which makes the server delete it.
    """

    clock: ManualClock | None = None
    ttls: tuple[float, ...] = (30.0, 61.5, 90.001)

    def __init__(self, inspector: redis.Redis) -> None:
        self._inspector = inspector
        self._made: list[Made] = []

    def expire_hold(self, key: str, token: str) -> None:
        """Make ``token``'s read-write hold of ``key`` expire now (by the server's clock)."""
        seconds, micros = self._inspector.time()
        now = seconds * 1000 + micros // 1000
        for name in self._inspector.keys(f"*rwlock:{key}"):
            for field in (f"w:{token}", f"r:{token}"):
                if self._inspector.hexists(name, field):
                    self._inspector.hset(name, field, str(now))

    def force_expire(self, key: str, slot: int | None = None) -> None:
        for name in self._inspector.keys(f"*permit:{'*' if slot is None else slot}:{key}"):
            self._expire_in_index(str(name), key)
            self._inspector.pexpireat(name, 1)

    def _expire_in_index(self, name: str, key: str) -> None:
        """Give the lease in slot key ``name`` an expiry in the past in its semaphore's index too.

        As a real expiry would find it: the index scores each token with its
        lease's expiry (ms * 1024 + slot). Deleting only the slot key is
        another thing, a holder removed by hand, which the index does not see.
        """
        number = name.rsplit(":", 2)[-2] if name.endswith(f":{key}") else None
        tail = f"permit:{number}:{key}"
        token = self._inspector.get(name)
        if number is None or token is None or not name.endswith(tail):
            return
        holders = f"{name[: -len(tail)]}holders:{key}"
        if self._inspector.type(holders) == "zset":
            self._inspector.zadd(holders, {str(token): 1024 + int(number)}, xx=True)

    def active(self, prefix: str) -> dict[str, str]:
        # A key may expire between KEYS and GET.
        names = self._inspector.keys(f"{prefix}permit:*")
        found = {str(name): self._inspector.get(name) for name in names}
        return {name: str(token) for name, token in found.items() if token is not None}

    def close(self, run: Runner | None) -> None:
        for made in self._made:
            close_made(made, run)
        self._made.clear()
        self._inspector.close()


class RealRedis(_Redis):
    """A real Redis server through one client package (``SERVER_VARIANTS``); flushed first."""

    def __init__(self, url: str, variant: str = "redis-py") -> None:
        super().__init__(redis.Redis.from_url(url, decode_responses=True))
        self._inspector.flushdb()
        self._url = url
        self._variant = variant

    def client(self, asynchronous: bool) -> object:
        made = SERVER_VARIANTS[self._variant][asynchronous](self._url)
        self._made.append(made)
        return made.client


class FakeRedis(_Redis):
    """fakeredis: one fake server, clients of either face on it."""

    def __init__(self) -> None:
        self._server = fakeredis.FakeServer()
        super().__init__(fakeredis.FakeRedis(server=self._server, decode_responses=True))

    def client(self, asynchronous: bool) -> object:
        if asynchronous:
            fake_async = fakeredis.FakeAsyncRedis(server=self._server)
            made = Made(fake_async, fake_async.aclose)
        else:
            fake = fakeredis.FakeRedis(server=self._server)
            made = Made(fake, fake.close)
        self._made.append(made)
        return made.client


class Mongomock:
    """mongomock (an imitation of pymongo, not a server) on a ManualClock.

    MongoDB leases are timed by the instance's clock, so tests may move time
    here. mongomock's TTL imitation is held still: expired records stay
    stored, and force-expiry sets ``expiredAt`` to now, so takeover of a
    stored record is what gets exercised.
    """

    ttls: tuple[float, ...] = Memory.ttls

    def __init__(self) -> None:
        self.clock: ManualClock | None = ManualClock()
        self._client: mongomock.MongoClient[dict[str, object]] = mongomock.MongoClient()
        # mongomock's type stubs do not declare utcnow, its documented test hook.
        self._saved = getattr(mongomock, "utcnow")  # noqa: B009
        setattr(mongomock, "utcnow", frozen_ttl_monitor)  # noqa: B010

    def client(self, asynchronous: bool) -> object:
        return AsyncMongomockClient(self._client) if asynchronous else self._client

    def _collections(self) -> list[mongomock.Collection[dict[str, object]]]:
        database = self._client.get_database("dmutex")
        return [database.get_collection(name) for name in database.list_collection_names()]

    def force_expire(self, key: str, slot: int | None = None) -> None:
        assert self.clock is not None
        now = self.clock.now()
        for collection in self._collections():
            collection.update_many(
                {"_id": {"$regex": slot_pattern(key, slot)}, "expiredAt": {"$gt": now}},
                {"$set": {"expiredAt": now}},
            )

    def expire_hold(self, key: str, token: str) -> None:
        """Make ``token``'s read-write hold of ``key`` expire now, in its document."""
        assert self.clock is not None
        now = self.clock.now()
        for collection in self._collections():
            doc = collection.find_one({"_id": f"rwlock:{key}"})
            if doc is None:
                continue
            writer = doc.get("w")
            if isinstance(writer, dict) and writer.get("t") == token:
                writer["e"] = now
            readers = doc.get("r")
            for reader in readers if isinstance(readers, list) else []:
                if reader.get("t") == token:
                    reader["e"] = now
            collection.replace_one({"_id": doc["_id"]}, doc)

    def active(self, prefix: str) -> dict[str, str]:
        # The tests use the default collections: the Redis-style prefix
        # without its colon (_dmutex_svc, _dsemaphore_svc).
        assert self.clock is not None
        collection = self._client.get_database("dmutex").get_collection(prefix.rstrip(":"))
        found = collection.find({"expiredAt": {"$gt": self.clock.now()}})
        return {f"{prefix}{doc['_id']}": str(doc["value"]) for doc in found}

    def close(self, run: Runner | None) -> None:
        setattr(mongomock, "utcnow", self._saved)  # noqa: B010


# The SQLite backend's files: in memory where the machine has a tmpfs, since
# these suites test what the store decides, not SQLite's fsync (the process
# and fault suites use files on disk).
_FAST_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class SQLite:
    """SQLiteBackend over a temporary file, on a ManualClock.

    SQLite leases are timed by the instance's clock, as MongoDB's are. One
    backend serves both faces. An inspector connection of its own reads and
    writes the rows (force-expiry sets ``expired_at`` to now and leaves the
    row stored, so takeover of a stored row is what gets exercised).
    """

    ttls: tuple[float, ...] = Memory.ttls

    def __init__(self) -> None:
        self.clock: ManualClock | None = ManualClock()
        handle, self.path = tempfile.mkstemp(prefix="dmutex-", suffix=".sqlite3", dir=_FAST_DIR)
        os.close(handle)
        self._backend = SQLiteBackend(self.path)
        # Used from the test's thread and from async callbacks' worker threads, one at a time.
        self._inspector = sqlite3.connect(
            self.path, timeout=30.0, isolation_level=None, check_same_thread=False
        )
        self._inspecting = threading.Lock()

    def client(self, asynchronous: bool) -> object:
        return self._backend

    def _now(self) -> int:
        assert self.clock is not None
        return now_ms(self.clock)

    def expire_hold(self, key: str, token: str) -> None:
        """Make ``token``'s read-write hold of ``key`` expire now, in every table."""
        now = self._now()
        with self._inspecting:
            for table in self._tables():
                row = self._inspector.execute(
                    f'SELECT "value" FROM {quoted(table)} WHERE "key" = ?', (f"rwlock:{key}",)
                ).fetchone()
                if row is None:
                    continue
                self._inspector.execute(
                    f'UPDATE {quoted(table)} SET "value" = ? WHERE "key" = ?',
                    (hold_expired(row[0], token, now), f"rwlock:{key}"),
                )

    def _tables(self) -> list[str]:
        rows = self._inspector.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        return [str(name) for (name,) in rows.fetchall()]

    def _rows(self, table: str, now: int) -> list[tuple[str, str]]:
        """The permit rows of ``table`` active at ``now``: (row key, token)."""
        if table not in self._tables():
            return []
        found = self._inspector.execute(
            f'SELECT "key", "value" FROM {quoted(table)} WHERE "expired_at" > ?', (now,)
        )
        return [(str(k), str(v)) for k, v in found.fetchall() if str(k).startswith("permit:")]

    def force_expire(self, key: str, slot: int | None = None) -> None:
        pattern = re.compile(slot_pattern(key, slot))
        now = self._now()
        with self._inspecting:
            for table in self._tables():
                for name, _ in self._rows(table, now):
                    if pattern.match(name):
                        self._inspector.execute(
                            f'UPDATE {quoted(table)} SET "expired_at" = :now '
                            'WHERE "key" = :name AND "expired_at" > :now',
                            {"now": now, "name": name},
                        )

    def active(self, prefix: str) -> dict[str, str]:
        # The tests use the default tables: the Redis-style prefix without
        # its colon (_dmutex_svc, _dsemaphore_svc), as for MongoDB.
        with self._inspecting:
            rows = self._rows(prefix.rstrip(":"), self._now())
        return {f"{prefix}{name}": token for name, token in rows}

    async def drain(self) -> None:
        """Wait until the calls already given to the backend's worker thread have answered."""
        await self._backend.call_async(_nothing)

    def close(self, run: Runner | None) -> None:
        self._backend.close()
        self._inspector.close()
        for suffix in ("", "-wal", "-shm", "-journal"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path + suffix)


def _nothing(conn: sqlite3.Connection) -> None:
    """A call that does nothing: its answer means the worker ran every call before it."""


class RealMongo:
    """A real MongoDB-compatible server, in real time, through pymongo (sync and asyncio).

    Starts from an empty test database; instances that use the default
    ``db_name`` are pointed at it (``RedirectedClient``). Leases are 30 s and
    more, so none runs out during a test; force-expiry sets ``expiredAt`` to
    now and leaves the record stored (the server's TTL monitor may or may not
    remove it before the next step: dmutex must take it over either way).
    """

    clock: ManualClock | None = None
    ttls: tuple[float, ...] = (30.0, 61.5, 90.001)

    def __init__(self, session: Session) -> None:
        self._server = session.fresh()
        self._admin = session.admin
        self._db = self._admin.get_database(session.db_name)
        self._async: list[pymongo.AsyncMongoClient[dict[str, Any]]] = []

    def client(self, asynchronous: bool) -> object:
        if not asynchronous:
            return RedirectedClient(self._admin, self._server.db_name)
        inner = self._server.async_client()
        self._async.append(inner)
        return AsyncRedirectedClient(inner, self._server.db_name)

    def force_expire(self, key: str, slot: int | None = None) -> None:
        now = datetime.now(timezone.utc)
        for name in self._db.list_collection_names():
            self._db.get_collection(name).update_many(
                {"_id": {"$regex": slot_pattern(key, slot)}, "expiredAt": {"$gt": now}},
                {"$set": {"expiredAt": now}},
            )

    def active(self, prefix: str) -> dict[str, str]:
        now = datetime.now(timezone.utc)
        found = self._db.get_collection(prefix.rstrip(":")).find({"expiredAt": {"$gt": now}})
        return {f"{prefix}{doc['_id']}": str(doc["value"]) for doc in found}

    def close(self, run: Runner | None) -> None:
        # The shared sync client belongs to the session; async ones were made
        # here, for the rig's loop, and are closed on it.
        if self._async and run is None:
            raise RuntimeError("async clients need the rig's loop to close on")
        for inner in self._async:
            assert run is not None
            run(inner.close())
        self._async.clear()


# The PostgreSQL clients the suites run on: how each reaches the test schema.
POSTGRES_VARIANTS = (
    "psycopg",
    "psycopg-pool",
    "asyncpg",
    "psycopg-pgbouncer",
    "asyncpg-pgbouncer",
    "sqlalchemy-psycopg",
    "sqlalchemy-asyncpg",
)


def _dispose_when_returned(engine: sqlalchemy.Engine, bound: float = 5.0) -> None:
    """Dispose of ``engine`` once no connection is checked out (at most ``bound`` seconds on).

    A renewal of the test's last lease may still be in flight on the
    renewer's thread when the test ends; disposing of the pool under it would
    leave its connection to be closed by the garbage collector.
    """
    deadline = time.monotonic() + bound
    pool = engine.pool
    while isinstance(pool, sqlalchemy.pool.QueuePool) and pool.checkedout() > 0:
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    engine.dispose()


class Postgres:
    """A real PostgreSQL server through one client package, in real time; the schema emptied first.

    Every variant works in the session's test schema, each reaching it its own
    way, so that each way is exercised: ``psycopg`` and ``psycopg-pool`` put
    it on the search path (``options=-csearch_path=`` in the URL), asyncpg in
    its ``server_settings``, and psycopg and asyncpg through PgBouncer in
    transaction mode (which passes no such startup parameter on) name it
    with ``schema_name=`` (:attr:`options`), psycopg with
    ``prepare_threshold=None``, asyncpg with ``statement_cache_size=0``.
    SQLAlchemy engines (``sqlalchemy-psycopg``: an ``Engine`` or an
    ``AsyncEngine`` as the face says; ``sqlalchemy-asyncpg``: an
    ``AsyncEngine``) pass the search path to their driver as the others do. Leases
    are 30 s and more, so none runs out during a test; force-expiry sets
    ``expired_at`` to the server's now and leaves the row stored, so takeover
    of a stored row is what gets exercised.
    """

    clock: ManualClock | None = None
    ttls: tuple[float, ...] = (30.0, 61.5, 90.001)

    def __init__(self, session: PostgresSession, variant: str = "psycopg") -> None:
        assert variant in POSTGRES_VARIANTS, variant
        server = session.fresh()
        self.schema = server.schema
        self.variant = variant
        self.url = self._direct = server.url
        self.options: dict[str, object] = {}
        if variant.endswith("-pgbouncer"):
            self.url = session.bouncer().url
            self.options["schema_name"] = self.schema
        self.loop: LoopThread | None = None
        """The rig's loop, where asyncio clients are made (and must be used)."""
        self._inspector = server.connect()
        self._closers: list[Callable[[], object]] = []
        self._async_closers: list[Callable[[], Awaitable[object]]] = []

    def _search_path_url(self, url: str | None = None) -> str:
        url = self.url if url is None else url
        joiner = "&" if "?" in url else "?"
        return f"{url}{joiner}options=-csearch_path%3D{self.schema}"

    def _engine_url(self, driver: str) -> str:
        return self._search_path_url().replace("postgresql://", f"postgresql+{driver}://", 1)

    def client(self, asynchronous: bool) -> object:
        if asynchronous:
            assert self.loop is not None, "the rig gives its loop first"
            return self.loop.run(self._async_client())
        if self.variant == "sqlalchemy-psycopg":
            engine = sqlalchemy.create_engine(self._engine_url("psycopg"), pool_size=4)
            self._closers.append(lambda: _dispose_when_returned(engine))
            return engine
        if self.variant == "psycopg":
            conn = psycopg.connect(self._search_path_url(), autocommit=True)
            self._closers.append(conn.close)
            return conn
        if self.variant == "psycopg-pool":
            # Filled before use, so that it is not opening a connection when it is
            # closed at the end of a test: two CI runs failed a later test on a
            # psycopg connection collected unclosed, which a pool growing then may
            # leave (the likeliest of the causes found; not reproduced here).
            pool = psycopg_pool.ConnectionPool(
                self._search_path_url(), min_size=4, max_size=4, open=True
            )
            pool.wait(timeout=10.0)
            self._closers.append(pool.close)
            return pool
        if self.variant == "psycopg-pgbouncer":
            conn = psycopg.connect(self.url, autocommit=True, prepare_threshold=None)
            self._closers.append(conn.close)
            return conn
        raise AssertionError(f"{self.variant} has no sync client")

    async def _async_client(self) -> object:
        if self.variant.startswith("sqlalchemy-"):
            driver = self.variant.removeprefix("sqlalchemy-")
            if driver == "asyncpg":  # asyncpg takes the search path as a server setting
                settings = {"search_path": self.schema}
                url = self.url.replace("postgresql://", "postgresql+asyncpg://", 1)
                engine = create_async_engine(
                    url, pool_size=4, connect_args={"server_settings": settings}
                )
            else:
                engine = create_async_engine(self._engine_url(driver), pool_size=4)
            self._async_closers.append(engine.dispose)
            return engine
        if self.variant == "psycopg":
            conn = await psycopg.AsyncConnection.connect(self._search_path_url(), autocommit=True)
            self._async_closers.append(conn.close)
            return conn
        if self.variant == "psycopg-pool":
            pool = psycopg_pool.AsyncConnectionPool(
                self._search_path_url(), min_size=1, max_size=4, open=False
            )
            await pool.open()
            self._async_closers.append(pool.close)
            return pool
        if self.variant == "asyncpg":
            made = await asyncpg.connect(self.url, server_settings={"search_path": self.schema})
            self._async_closers.append(made.close)
            return made
        if self.variant == "asyncpg-pgbouncer":
            made = await asyncpg.connect(self.url, statement_cache_size=0)
            self._async_closers.append(made.close)
            return made
        conn = await psycopg.AsyncConnection.connect(
            self.url, autocommit=True, prepare_threshold=None
        )
        self._async_closers.append(conn.close)
        return conn

    def status_client(self) -> object:
        """A sync psycopg connection to the server with the test schema on its search path.

        What ``dmutex status`` is given (it names no schema): any variant's
        storage, read by default table names, whichever way its clients reach
        the schema (PgBouncer passes no search path on, asyncpg has no sync client).
        """
        conn = psycopg.connect(self._search_path_url(self._direct), autocommit=True)
        self._closers.append(conn.close)
        return conn

    def _tables(self) -> list[str]:
        found = self._inspector.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s", (self.schema,)
        )
        return [str(name) for (name,) in found.fetchall()]

    def _table(self, name: str) -> sql.Composable:
        return sql.Identifier(self.schema, name)

    def force_expire(self, key: str, slot: int | None = None) -> None:
        for table in self._tables():
            self._inspector.execute(
                sql.SQL(
                    'UPDATE {} SET "expired_at" = statement_timestamp() '
                    'WHERE "key" ~ %s AND "expired_at" > statement_timestamp()'
                ).format(self._table(table)),
                (slot_pattern(key, slot),),
            )

    def expire_hold(self, key: str, token: str) -> None:
        """Make ``token``'s read-write hold of ``key`` expire now (the server's), in every table."""
        now_ms = "floor(extract(epoch FROM statement_timestamp()) * 1000)::bigint"
        for table in self._tables():
            row = self._inspector.execute(
                sql.SQL(f'SELECT "value", {now_ms} FROM {{}} WHERE "key" = %s').format(
                    self._table(table)
                ),
                (f"rwlock:{key}",),
            ).fetchone()
            if row is not None:
                value, now = row
                assert isinstance(now, int)
                self._inspector.execute(
                    sql.SQL('UPDATE {} SET "value" = %s WHERE "key" = %s').format(
                        self._table(table)
                    ),
                    (hold_expired(str(value), token, now), f"rwlock:{key}"),
                )

    def active(self, prefix: str) -> dict[str, str]:
        # The tests use the default tables: the Redis-style prefix without
        # its colon (_dmutex_svc, _dsemaphore_svc), as for SQLite.
        table = prefix.rstrip(":")
        if table not in self._tables():
            return {}
        found = self._inspector.execute(
            sql.SQL(
                'SELECT "key", "value" FROM {} '
                'WHERE "key" LIKE \'permit:%%\' AND "expired_at" > statement_timestamp()'
            ).format(self._table(table))
        )
        return {f"{prefix}{name}": str(token) for name, token in found.fetchall()}

    def close(self, run: Runner | None) -> None:
        if self._async_closers and run is None:
            raise RuntimeError("async clients need the rig's loop to close on")
        for close in self._async_closers:
            assert run is not None
            run(close())
        self._async_closers.clear()
        for close_sync in self._closers:
            close_sync()
        self._closers.clear()
        self._inspector.close()


class Rig:
    """One backend through one face: makes instances, moves or forces time, cleans up."""

    def __init__(self, backend: Backend, face: FaceName) -> None:
        self.backend = backend
        self.face = face
        self.loop = LoopThread() if face == "async" else None
        if isinstance(backend, (Postgres, MySQL, Dynamo)):
            backend.loop = self.loop  # asyncio clients belong to their loop
        self.client = backend.client(face == "async")

    @property
    def clock(self) -> ManualClock | None:
        return self.backend.clock

    def make(self, kind: Kind, **options: Any) -> Face:
        """A DMutex/DSemaphore of this face over the rig's client (sync methods either way)."""
        if self.clock is not None:
            options.setdefault("clock", self.clock)
        if isinstance(self.backend, Etcd):
            options["key_prefix"] = self.backend.key_prefix(kind, options)
        if isinstance(self.backend, Dynamo):
            self.backend.table_options(kind, options)
        if isinstance(self.backend, (Postgres, MySQL)):
            for name, value in self.backend.options.items():
                options.setdefault(name, value)
        return Face(self.face, kind, self.client, loop=self.loop, **options)

    def make_rw(self, **options: Any) -> RWFace:
        """A DReadWriteLock of this face over the rig's client (sync methods either way)."""
        if self.clock is not None:
            options.setdefault("clock", self.clock)
        if isinstance(self.backend, Etcd):
            options["key_prefix"] = self.backend.key_prefix("rwlock", options)
        if isinstance(self.backend, Dynamo):
            self.backend.table_options("rwlock", options)
        if isinstance(self.backend, (Postgres, MySQL)):
            for name, value in self.backend.options.items():
                options.setdefault(name, value)
        return RWFace(self.face, self.client, loop=self.loop, **options)

    def make_election(self, **options: Any) -> ElectionFace:
        """A DElection of this face over the rig's client, with the options ``make`` gives a mutex.

        An election is a mutex of the same names (etcd: the mutex's key prefix).
        """
        if self.clock is not None:
            options.setdefault("clock", self.clock)
        if isinstance(self.backend, Etcd):
            options["key_prefix"] = self.backend.key_prefix("mutex", options)
        if isinstance(self.backend, Dynamo):
            self.backend.table_options("mutex", options)
        if isinstance(self.backend, (Postgres, MySQL)):
            for name, value in self.backend.options.items():
                options.setdefault(name, value)
        return ElectionFace(self.face, self.client, loop=self.loop, **options)

    def settle(self, face: Face | RWFace) -> None:
        """Let the async face's loop run what is ready (its renewer, after a ManualClock moved).

        ``face.settle()`` turns the loop a few times, which is enough where
        nothing waits on I/O. An SQLite call of the async face runs in the
        backend's worker thread: a renewal started by those turns has
        answered once a later call to the same worker has, and a few more
        turns then handle the answer (a loss, its listeners).
        """
        face.settle()
        backend = self.backend
        if self.loop is None or not isinstance(backend, SQLite):
            return

        async def drain() -> None:
            for _ in range(3):
                await backend.drain()
                for _ in range(5):
                    await asyncio.sleep(0)

        self.loop.run(drain())

    def expire(self, key: str, slot: int | None = None) -> None:
        """Make the permits of ``key`` expire now (in every namespace)."""
        self.backend.force_expire(key, slot)

    def need_clock(self) -> ManualClock:
        """The ManualClock; tests calling this carry the ``manual_clock`` mark."""
        assert self.clock is not None, "mark the test with @pytest.mark.manual_clock"
        return self.clock

    def now(self) -> datetime:
        """The time expiries are computed from, as an aware UTC datetime."""
        return datetime.now(timezone.utc) if self.clock is None else self.clock.now()

    def assert_expiry(
        self, before: datetime, after: datetime, expired_at: datetime, ttl: float
    ) -> None:
        """``expired_at`` is ``now + ttl`` for some now read between ``before`` and ``after``.

        Exact on a ManualClock; on real time, within the millisecond that
        expiries are rounded to.
        """
        slack = timedelta(0) if self.clock is not None else timedelta(milliseconds=1)
        lease = timedelta(seconds=ttl)
        assert before + lease - slack <= expired_at <= after + lease + slack

    def close(self) -> None:
        loop = self.loop
        if loop is None:
            self.backend.close(None)
            return

        def run(awaitable: Awaitable[object]) -> object:
            async def wait() -> object:
                return await awaitable

            return loop.run(wait())

        self.backend.close(run)
        loop.close()

"""Backend detection against real client objects (no server needed to build them)."""

from __future__ import annotations

import asyncio
import inspect
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aetcd
import asyncpg
import etcd3gw
import fakeredis
import mongomock
import motor.motor_asyncio
import psycopg
import psycopg_pool
import pymongo
import pytest
import redis
import redis.asyncio
import sqlalchemy
import sqlalchemy.orm
import valkey
import valkey.asyncio
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from dmutex import (
    AsyncDMutex,
    AsyncDSemaphore,
    BackendName,
    DMutex,
    DSemaphore,
    InMemoryBackend,
    UnsupportedClientError,
)
from dmutex._backends import detect
from dmutex._clock import SystemClock
from dmutex._core.effects import Call, Steps
from dmutex._runtime.drivers import AsyncDriver, SyncDriver
from tests._support.doubles import StandInAsyncEngine, StandInEngine

SYNC: list[Any] = [DMutex, DSemaphore]
ASYNC: list[Any] = [AsyncDMutex, AsyncDSemaphore]

# name -> (factory, backend it must be detected as, is it an asyncio client)
CLIENTS: dict[str, tuple[Callable[[], Any], BackendName, bool]] = {
    "pymongo.MongoClient": (lambda: pymongo.MongoClient(connect=False), "mongodb", False),
    "pymongo.AsyncMongoClient": (
        lambda: pymongo.AsyncMongoClient(connect=False),
        "mongodb",
        True,
    ),
    "mongomock.MongoClient": (mongomock.MongoClient, "mongodb", False),
    "motor.AsyncIOMotorClient": (
        lambda: motor.motor_asyncio.AsyncIOMotorClient(connect=False),
        "mongodb",
        True,
    ),
    "redis.Redis": (redis.Redis, "redis", False),
    "redis.asyncio.Redis": (redis.asyncio.Redis, "redis", True),
    "valkey.Valkey": (valkey.Valkey, "redis", False),
    "valkey.asyncio.Valkey": (valkey.asyncio.Valkey, "redis", True),
    "fakeredis.FakeRedis": (fakeredis.FakeRedis, "redis", False),
    "fakeredis.FakeAsyncRedis": (fakeredis.FakeAsyncRedis, "redis", True),
    # Neither connects before its first request.
    "etcd3gw.Etcd3Client": (lambda: etcd3gw.Etcd3Client(port=1), "etcd", False),
    "aetcd.Client": (lambda: aetcd.Client(port=1), "etcd", True),
}


@pytest.fixture(params=sorted(CLIENTS))
def real_client(request: pytest.FixtureRequest) -> Iterator[tuple[Any, BackendName, bool]]:
    factory, backend, is_async = CLIENTS[request.param]
    client = factory()
    yield client, backend, is_async
    close(client)


def close(client: object) -> None:
    """Close a client of any package, sync or asyncio (motor's close is sync)."""
    for name in ("aclose", "close"):
        try:
            inspect.getattr_static(client, name)
        except AttributeError:
            continue
        result = getattr(client, name)()
        if asyncio.iscoroutine(result):
            asyncio.run(result)
        return


def make(cls: Any, client: object, **options: Any) -> Any:
    if cls in (DSemaphore, AsyncDSemaphore):
        options["max_permits"] = 2
    return cls("svc", client, **options)


def test_detected_without_backend(real_client: tuple[Any, BackendName, bool]) -> None:
    client, backend, _ = real_client
    assert detect(client, None) == backend


def test_backend_override_accepted_and_checked(real_client: tuple[Any, BackendName, bool]) -> None:
    client, backend, _ = real_client
    assert detect(client, backend) == backend
    other: BackendName = "redis" if backend == "mongodb" else "mongodb"
    with pytest.raises(UnsupportedClientError, match=f"backend='{other}'"):
        detect(client, other)


def test_right_face_builds(real_client: tuple[Any, BackendName, bool]) -> None:
    """Accepted by the face it belongs to, with no I/O."""
    client, _, is_async = real_client
    for cls in ASYNC if is_async else SYNC:
        assert isinstance(make(cls, client), cls)


@pytest.mark.parametrize("name", ["pymongo.AsyncMongoClient", "motor.AsyncIOMotorClient"])
def test_asyncio_mongo_client_refused_by_sync_classes(name: str) -> None:
    """Caught at construction, before any call: motor would start the request on the call."""
    client = CLIENTS[name][0]()
    try:
        for cls in SYNC:
            with pytest.raises(UnsupportedClientError, match="asyncio collection"):
                make(cls, client)
    finally:
        close(client)


@pytest.mark.parametrize(
    "name",
    [name for name, (_, backend, is_async) in CLIENTS.items() if is_async and backend == "redis"],
)
def test_asyncio_redis_client_refused_by_sync_classes(name: str) -> None:
    """Its methods are coroutine functions, so this is caught before any call."""
    client = CLIENTS[name][0]()
    for cls in SYNC:
        with pytest.raises(UnsupportedClientError, match="asyncio client"):
            make(cls, client)


def nothing_to_prepare() -> Steps[None]:
    yield from ()


def test_sync_driver_refuses_an_awaitable_reply_without_io() -> None:
    """A client method that returns a coroutine is closed unawaited, then refused."""
    client = redis.asyncio.Redis(port=1)  # nothing listens there; nothing may try

    def steps() -> Steps[object]:
        return (yield Call(client.execute_command, ("PING",)))

    with pytest.raises(UnsupportedClientError, match="asyncio client"):
        SyncDriver(SystemClock(), nothing_to_prepare)(steps())


def test_async_driver_refuses_a_plain_reply() -> None:
    client = fakeredis.FakeRedis()

    def steps() -> Steps[object]:
        return (yield Call(client.execute_command, ("PING",)))

    with pytest.raises(UnsupportedClientError, match="sync client"):
        asyncio.run(AsyncDriver(SystemClock(), nothing_to_prepare)(steps()))


@pytest.mark.parametrize("cls", SYNC + ASYNC)
def test_in_memory_backend_everywhere(cls: Any) -> None:
    backend = InMemoryBackend()
    for option in (None, "redis", "mongodb"):
        assert isinstance(make(cls, backend, backend=option), cls)


class AnswersEverything:
    """Like pymongo's MongoClient: __getattr__ returns something for any name."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


class MongoThatAnswersEverything(AnswersEverything):
    def get_database(self, name: str) -> object:
        return self


def test_getattr_does_not_fool_detection() -> None:
    with pytest.raises(UnsupportedClientError):
        detect(AnswersEverything(), None)
    assert detect(MongoThatAnswersEverything(), None) == "mongodb"


class SetEvalOnly:
    def set(self, name: str, value: str, *, px: int, nx: bool) -> bool:
        return True

    def eval(self, script: str, numkeys: int, *keys_and_args: object) -> object:
        return None


class SetOnly:
    def set(self, name: str, value: str, *, px: int, nx: bool) -> bool:
        return True


def test_set_and_eval_path_is_redis_shaped() -> None:
    assert detect(SetEvalOnly(), None) == "redis"
    with pytest.raises(UnsupportedClientError):
        detect(SetOnly(), None)


# --- PostgreSQL: real connections (they connect when made) and pools --------------

POSTGRES_SYNC = ("psycopg.Connection", "psycopg_pool.ConnectionPool")
POSTGRES_ASYNC = (
    "psycopg.AsyncConnection",
    "psycopg_pool.AsyncConnectionPool",
    "asyncpg.Connection",
    "asyncpg.Pool",
)


async def postgres_client(name: str, url: str) -> Any:
    """A real client of ``name`` on the server at ``url`` (pools opened: a real one has conns)."""
    if name == "psycopg.Connection":
        return psycopg.connect(url, autocommit=True)
    if name == "psycopg_pool.ConnectionPool":
        return psycopg_pool.ConnectionPool(url, min_size=1, open=True)
    if name == "psycopg.AsyncConnection":
        return await psycopg.AsyncConnection.connect(url, autocommit=True)
    if name == "psycopg_pool.AsyncConnectionPool":
        pool = psycopg_pool.AsyncConnectionPool(url, min_size=1, open=False)
        await pool.open()
        return pool
    if name == "asyncpg.Connection":
        return await asyncpg.connect(url)
    return await asyncpg.create_pool(url, min_size=1, max_size=1)


async def close_postgres(client: Any) -> None:
    result = client.close()
    if inspect.isawaitable(result):
        await result


@pytest.mark.parametrize("name", POSTGRES_SYNC + POSTGRES_ASYNC)
def test_postgresql_clients_detected_and_faces_told_apart(postgres_server: str, name: str) -> None:
    """Each is detected as PostgreSQL, built by its own face, refused by the other before I/O."""
    is_async = name in POSTGRES_ASYNC

    async def check() -> None:
        client = await postgres_client(name, postgres_server)
        try:
            postgresql_of_one_face(client, is_async)
        finally:
            await close_postgres(client)

    asyncio.run(check())


def postgresql_of_one_face(client: object, is_async: bool) -> None:
    """``client`` is detected as PostgreSQL, built by its face, refused by the other (no I/O)."""
    assert detect(client, None) == "postgresql"
    assert detect(client, "postgresql") == "postgresql"
    for other in ("mongodb", "redis"):
        with pytest.raises(UnsupportedClientError, match=f"backend='{other}'"):
            detect(client, other)
    for cls in ASYNC if is_async else SYNC:
        assert isinstance(make(cls, client), cls)
    face = "use AsyncDMutex / AsyncDSemaphore" if is_async else "use DMutex / DSemaphore"
    for cls in SYNC if is_async else ASYNC:
        with pytest.raises(UnsupportedClientError, match=face):
            make(cls, client)


def test_sqlite3_connection_is_detected_as_nothing() -> None:
    """``execute`` (and ``autocommit`` on Python 3.12+) without psycopg's ``info``."""
    conn = sqlite3.connect(":memory:")
    try:
        with pytest.raises(UnsupportedClientError, match="a PostgreSQL client needs"):
            detect(conn, None)
    finally:
        conn.close()


# --- PostgreSQL: SQLAlchemy engines (made without a connection) --------------------

# Nothing listens on port 1: an engine that tried to connect would fail the test.
NOWHERE = "u@127.0.0.1:1/db"
ENGINES: dict[str, tuple[Callable[[], Any], bool]] = {
    "Engine/psycopg": (lambda: sqlalchemy.create_engine(f"postgresql+psycopg://{NOWHERE}"), False),
    "AsyncEngine/asyncpg": (lambda: create_async_engine(f"postgresql+asyncpg://{NOWHERE}"), True),
    "AsyncEngine/psycopg": (lambda: create_async_engine(f"postgresql+psycopg://{NOWHERE}"), True),
}


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_sqlalchemy_engines_detected_and_faces_told_apart(name: str) -> None:
    """Detected as PostgreSQL, built by its face and refused by the other, with no I/O."""
    factory, is_async = ENGINES[name]
    engine = factory()
    pool = engine.sync_engine.pool if is_async else engine.pool
    postgresql_of_one_face(engine, is_async)
    assert pool.checkedout() == 0
    assert pool.checkedin() == 0  # never connected


def test_sqlalchemy_engine_of_another_database_refused_before_io(tmp_path: Path) -> None:
    """A SQLite engine is refused, its file never made (SQLite makes it on connecting)."""
    path = tmp_path / "app.db"
    engine = sqlalchemy.create_engine(f"sqlite:///{path}")
    for cls in SYNC:
        with pytest.raises(UnsupportedClientError, match=r"on PostgreSQL, .*SQLiteBackend"):
            make(cls, engine)
    assert not path.exists()


@pytest.mark.parametrize(
    ("engine", "classes", "needs"),
    [
        (StandInEngine("postgresql", "psycopg2"), SYNC, r"'psycopg2' driver.*must be psycopg \("),
        (StandInEngine("postgresql", "pg8000"), SYNC, "'pg8000' driver"),
        (StandInAsyncEngine("postgresql", "aiopg"), ASYNC, "must be psycopg or asyncpg"),
        (StandInEngine("oracle", "oracledb"), SYNC, "'oracle'.*on PostgreSQL, .*or on MySQL"),
        (StandInAsyncEngine("mssql", "aioodbc"), ASYNC, "'mssql'.*on PostgreSQL, .*or on MySQL"),
    ],
)
def test_sqlalchemy_engine_of_another_driver_refused(
    engine: object, classes: list[Any], needs: str
) -> None:
    assert detect(engine, None) == "postgresql"
    for cls in classes:
        with pytest.raises(UnsupportedClientError, match=needs):
            make(cls, engine)


def test_the_runner_tells_an_async_engine_by_sync_engine() -> None:
    """Past the face check (a plain ``raw_connection``), ``sync_engine`` still says asyncio."""

    class Confused(StandInEngine):
        sync_engine = "the engine it wraps"

    with pytest.raises(UnsupportedClientError, match="AsyncEngine is an asyncio client"):
        make(DMutex, Confused("postgresql", "psycopg"))


def test_sqlalchemy_connections_and_sessions_refused_before_io() -> None:
    """They look like a psycopg connection (``execute``, ``info``): refused, the engine named.

    An ``AsyncConnection`` connects when started, a ``Connection`` when made:
    the unstarted one stands for both.
    """
    engine = sqlalchemy.create_engine(f"postgresql+psycopg://{NOWHERE}")
    aengine = create_async_engine(f"postgresql+asyncpg://{NOWHERE}")
    cases = [
        (sqlalchemy.orm.Session(engine), SYNC),
        (AsyncSession(aengine), ASYNC),
        (aengine.connect(), ASYNC),
    ]
    for client, classes in cases:
        for cls in classes:
            with pytest.raises(UnsupportedClientError, match="give dmutex the Engine"):
                make(cls, client)
    assert engine.pool.checkedin() == 0  # type: ignore[attr-defined]  # QueuePool's
    assert aengine.sync_engine.pool.checkedin() == 0  # type: ignore[attr-defined]  # likewise

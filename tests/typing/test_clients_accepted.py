"""Static check: each real client is accepted by the constructor it belongs to.

mypy --strict checks this file (it runs in CI). The functions also run under
pytest, which builds each client without a server and shows that the
constructor's runtime detection agrees with the type checker.
"""

from __future__ import annotations

from collections.abc import Callable

import aetcd
import etcd3gw
import fakeredis
import mongomock
import motor.motor_asyncio
import pymongo
import redis
import redis.asyncio
import sqlalchemy
import valkey
import valkey.asyncio
from sqlalchemy.ext.asyncio import create_async_engine

from dmutex import (
    AsyncDMutex,
    AsyncDSemaphore,
    DMutex,
    DSemaphore,
    InMemoryBackend,
)
from tests.typing.mysql_clients import MySQLClients
from tests.typing.postgres_clients import PostgresClients


def recognised(make: Callable[[], object]) -> None:
    """The constructor accepts the client (and does no I/O)."""
    assert isinstance(make(), (DMutex, DSemaphore, AsyncDMutex, AsyncDSemaphore))


def test_sync_clients_are_accepted_by_sync_classes() -> None:
    recognised(lambda: DMutex("svc", pymongo.MongoClient(connect=False)))
    recognised(lambda: DMutex("svc", mongomock.MongoClient()))
    recognised(lambda: DMutex("svc", redis.Redis()))
    recognised(lambda: DMutex("svc", valkey.Valkey()))
    recognised(lambda: DMutex("svc", fakeredis.FakeRedis()))
    recognised(lambda: DSemaphore("svc", pymongo.MongoClient(connect=False), max_permits=3))
    recognised(lambda: DSemaphore("svc", mongomock.MongoClient(), max_permits=3))
    recognised(lambda: DSemaphore("svc", redis.Redis(), max_permits=3))
    recognised(lambda: DSemaphore("svc", valkey.Valkey(), max_permits=3))
    recognised(lambda: DSemaphore("svc", fakeredis.FakeRedis(), max_permits=3))
    recognised(lambda: DMutex("svc", etcd3gw.Etcd3Client(port=1)))
    recognised(lambda: DSemaphore("svc", etcd3gw.Etcd3Client(port=1), max_permits=3))


def test_asyncio_clients_are_accepted_by_async_classes() -> None:
    recognised(lambda: AsyncDMutex("svc", pymongo.AsyncMongoClient(connect=False)))
    recognised(lambda: AsyncDMutex("svc", redis.asyncio.Redis()))
    recognised(lambda: AsyncDMutex("svc", motor.motor_asyncio.AsyncIOMotorClient(connect=False)))
    recognised(lambda: AsyncDMutex("svc", valkey.asyncio.Valkey()))
    recognised(lambda: AsyncDMutex("svc", fakeredis.FakeAsyncRedis()))
    recognised(
        lambda: AsyncDSemaphore("svc", pymongo.AsyncMongoClient(connect=False), max_permits=3)
    )
    recognised(lambda: AsyncDSemaphore("svc", redis.asyncio.Redis(), max_permits=3))
    recognised(lambda: AsyncDSemaphore("svc", valkey.asyncio.Valkey(), max_permits=3))
    recognised(lambda: AsyncDSemaphore("svc", fakeredis.FakeAsyncRedis(), max_permits=3))
    # aetcd ships no annotations: mypy reads the tests' stub (stubs/aetcd), as it types aetcd.
    recognised(lambda: AsyncDMutex("svc", aetcd.Client(port=1)))
    recognised(lambda: AsyncDSemaphore("svc", aetcd.Client(port=1), max_permits=3))


def postgresql_clients_are_accepted_by_their_face(c: PostgresClients) -> None:
    """Static only: see ``postgres_clients.py``."""
    recognised(lambda: DMutex("svc", c.conn))
    recognised(lambda: DSemaphore("svc", c.pool, max_permits=3))
    recognised(lambda: AsyncDMutex("svc", c.aconn))
    recognised(lambda: AsyncDSemaphore("svc", c.apool, max_permits=3))
    recognised(lambda: AsyncDMutex("svc", c.apg))
    recognised(lambda: AsyncDSemaphore("svc", c.apg_pool, max_permits=3))


def mysql_clients_are_accepted_by_their_face(c: MySQLClients) -> None:
    """Static only: see ``mysql_clients.py``."""
    recognised(lambda: DMutex("svc", c.pymysql_conn))
    recognised(lambda: DSemaphore("svc", c.mysqldb_conn, max_permits=3))
    recognised(lambda: DMutex("svc", c.connector_conn))
    recognised(lambda: DSemaphore("svc", c.connector_pool, max_permits=3))
    recognised(lambda: AsyncDMutex("svc", c.aiomysql_conn))
    recognised(lambda: AsyncDSemaphore("svc", c.aiomysql_pool, max_permits=3))
    recognised(lambda: AsyncDMutex("svc", c.asyncmy_conn))
    recognised(lambda: AsyncDSemaphore("svc", c.asyncmy_pool, max_permits=3))


# Engines connect on first use only, so these are built for real (nothing listens on port 1).
NOWHERE = "u@127.0.0.1:1/db"


def test_sqlalchemy_engines_are_accepted_by_their_face() -> None:
    engine = sqlalchemy.create_engine(f"postgresql+psycopg://{NOWHERE}")
    recognised(lambda: DMutex("svc", engine))
    recognised(lambda: DSemaphore("svc", engine, max_permits=3))
    apg = create_async_engine(f"postgresql+asyncpg://{NOWHERE}")
    recognised(lambda: AsyncDMutex("svc", apg))
    recognised(lambda: AsyncDSemaphore("svc", apg, max_permits=3))
    apsycopg = create_async_engine(f"postgresql+psycopg://{NOWHERE}")
    recognised(lambda: AsyncDMutex("svc", apsycopg))
    recognised(lambda: AsyncDSemaphore("svc", apsycopg, max_permits=3))


def test_in_memory_backend_is_accepted_everywhere() -> None:
    backend = InMemoryBackend()
    assert isinstance(DMutex("svc", backend), DMutex)
    assert isinstance(DSemaphore("svc", backend, max_permits=2), DSemaphore)
    assert isinstance(AsyncDMutex("svc", backend), AsyncDMutex)
    assert isinstance(AsyncDSemaphore("svc", backend, max_permits=2), AsyncDSemaphore)

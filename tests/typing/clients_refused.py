"""Static check: a client of the wrong face is refused by the type checker (and a bad observer).

Each line below must fail ``mypy --strict`` with ``arg-type`` (an observer
of the wrong shape in ``observers=``: ``list-item``). The targeted
``type: ignore`` keeps the file clean while it does; mypy.ini turns on
``warn_unused_ignores``, so the day a line stops failing, CI's mypy run fails.
``test_typing.py`` also strips the ignores and checks that mypy reports every
marked line.

Not listed, because the client packages' own types cannot support it: the
sync ``redis.Redis``, ``valkey.Valkey`` and ``fakeredis.FakeRedis`` handed to
an async class. Their ``execute_command`` is unannotated (returns ``Any``), so
it matches the async contract too; dmutex refuses them at run time instead,
on the first call. Nor motor's ``AsyncIOMotorClient`` handed to a sync class,
whose types do not say its methods return awaitables; dmutex refuses it at
construction.
"""

from __future__ import annotations

import sqlite3

import aetcd
import etcd3gw
import fakeredis
import mongomock
import pymongo
import redis.asyncio
import sqlalchemy
import valkey.asyncio
from sqlalchemy.ext.asyncio import create_async_engine

from dmutex import AsyncDMutex, AsyncDSemaphore, DMutex, DSemaphore, InMemoryBackend
from tests.typing.postgres_clients import PostgresClients


def asyncio_clients_to_sync_classes() -> None:
    DMutex("svc", pymongo.AsyncMongoClient(connect=False))  # type: ignore[arg-type]  # negative
    DMutex("svc", redis.asyncio.Redis())  # type: ignore[arg-type]  # negative
    DMutex("svc", valkey.asyncio.Valkey())  # type: ignore[arg-type]  # negative
    DMutex("svc", fakeredis.FakeAsyncRedis())  # type: ignore[arg-type]  # negative
    DSemaphore("svc", redis.asyncio.Redis(), max_permits=2)  # type: ignore[arg-type]  # negative
    DMutex("svc", aetcd.Client())  # type: ignore[arg-type]  # negative


def sync_clients_to_async_classes() -> None:
    AsyncDMutex("svc", pymongo.MongoClient(connect=False))  # type: ignore[arg-type]  # negative
    AsyncDMutex("svc", mongomock.MongoClient())  # type: ignore[arg-type]  # negative
    AsyncDSemaphore("svc", pymongo.MongoClient(), max_permits=2)  # type: ignore[arg-type]  # negative
    AsyncDMutex("svc", etcd3gw.Etcd3Client())  # type: ignore[arg-type]  # negative


def postgresql_clients_of_the_other_face(c: PostgresClients) -> None:
    DMutex("svc", c.aconn)  # type: ignore[arg-type]  # negative
    DMutex("svc", c.apool)  # type: ignore[arg-type]  # negative
    DMutex("svc", c.apg)  # type: ignore[arg-type]  # negative
    DSemaphore("svc", c.apg_pool, max_permits=2)  # type: ignore[arg-type]  # negative
    AsyncDMutex("svc", c.conn)  # type: ignore[arg-type]  # negative
    AsyncDSemaphore("svc", c.pool, max_permits=2)  # type: ignore[arg-type]  # negative


def sqlalchemy_engines_of_the_other_face() -> None:
    engine = sqlalchemy.create_engine("postgresql+psycopg://")
    aengine = create_async_engine("postgresql+asyncpg://")
    DMutex("svc", aengine)  # type: ignore[arg-type]  # negative
    DSemaphore("svc", aengine, max_permits=2)  # type: ignore[arg-type]  # negative
    AsyncDMutex("svc", engine)  # type: ignore[arg-type]  # negative
    AsyncDSemaphore("svc", engine, max_permits=2)  # type: ignore[arg-type]  # negative


def not_clients() -> None:
    DMutex("svc", "redis://localhost:6379")  # type: ignore[arg-type]  # negative
    AsyncDMutex("svc", object())  # type: ignore[arg-type]  # negative
    DMutex("svc", sqlite3.connect(":memory:"))  # type: ignore[arg-type]  # negative


def observers_of_the_wrong_shape() -> None:
    def takes_a_string(event: str) -> None: ...

    def takes_nothing() -> None: ...

    backend = InMemoryBackend()
    DMutex("svc", backend, observers=[takes_a_string])  # type: ignore[list-item]  # negative
    DMutex("svc", backend, observers=[takes_nothing])  # type: ignore[list-item]  # negative

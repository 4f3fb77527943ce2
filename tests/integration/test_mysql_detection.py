"""MySQL client detection against every real client object, and the DB-API look-alikes refused.

Objects that need no server are made unconnected (PyMySQL's
``defer_connect``, mysql-connector's bare ``MySQLConnection``, aiomysql's and
asyncmy's connection classes, SQLAlchemy engines pointed at a closed port),
so that building a lock over them shows that detection and the face check do
no I/O. mysqlclient connects as it is made, and a mysql-connector pool makes
its connections at once: those are made on the test server.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from typing import Any

import aiomysql
import asyncmy
import mysql.connector
import mysql.connector.connection
import mysql.connector.pooling
import MySQLdb
import psycopg
import pymysql
import pytest
import sqlalchemy
from sqlalchemy.ext.asyncio import create_async_engine

from dmutex import (
    AsyncDMutex,
    AsyncDSemaphore,
    BackendName,
    DMutex,
    DSemaphore,
    UnsupportedClientError,
)
from dmutex._backends import detect
from tests._support.doubles import StandInAsyncEngine, StandInEngine
from tests._support.mysql_servers import connect_args

ASYNCMY_CONNECTION: Any = asyncmy.Connection
SYNC: list[Any] = [DMutex, DSemaphore]
ASYNC: list[Any] = [AsyncDMutex, AsyncDSemaphore]
OTHERS: tuple[BackendName, ...] = ("mongodb", "postgresql", "redis")
# Nothing listens on port 1: a client that tried to connect would fail the test.
NOWHERE = "u:p@127.0.0.1:1/db"


def make(cls: Any, client: object) -> Any:
    options: dict[str, Any] = {"max_permits": 2} if cls in (DSemaphore, AsyncDSemaphore) else {}
    return cls("svc", client, **options)


def mysql_of_one_face(client: object, is_async: bool) -> None:
    """``client`` is detected as MySQL, built by its face, refused by the other (no I/O)."""
    assert detect(client, None) == "mysql"
    assert detect(client, "mysql") == "mysql"
    for other in OTHERS:
        with pytest.raises(UnsupportedClientError, match=f"backend='{other}'"):
            detect(client, other)
    for cls in ASYNC if is_async else SYNC:
        assert isinstance(make(cls, client), cls)
    face = "use AsyncDMutex / AsyncDSemaphore" if is_async else "use DMutex / DSemaphore"
    for cls in SYNC if is_async else ASYNC:
        with pytest.raises(UnsupportedClientError, match=face):
            make(cls, client)


UNCONNECTED: dict[str, tuple[Callable[[], Any], bool]] = {
    "pymysql.Connection": (
        lambda: pymysql.connect(host="127.0.0.1", port=1, defer_connect=True),
        False,
    ),
    "mysql.connector.MySQLConnection": (mysql.connector.connection.MySQLConnection, False),
    "aiomysql.Connection": (lambda: aiomysql.Connection(host="127.0.0.1", port=1), True),
    # asyncmy's Cython classes carry no annotations for their constructor.
    "asyncmy.Connection": (lambda: ASYNCMY_CONNECTION(host="127.0.0.1", port=1), True),
}


@pytest.mark.parametrize("name", sorted(UNCONNECTED))
def test_unconnected_clients_detected_and_faces_told_apart(name: str) -> None:
    factory, is_async = UNCONNECTED[name]

    async def check() -> None:  # aiomysql's connection takes the running loop as it is made
        mysql_of_one_face(factory(), is_async)

    asyncio.run(check())


def test_mysqlclient_connection(mysql_server: str, mysql_database: str) -> None:
    a = connect_args(mysql_server)
    conn: Any = MySQLdb.connect(
        host=a["host"], port=a["port"], user=a["user"], password=a["password"], autocommit=True
    )
    try:
        mysql_of_one_face(conn, False)
    finally:
        conn.close()


def test_mysql_connector_pool(mysql_server: str, mysql_database: str) -> None:
    pool = mysql.connector.pooling.MySQLConnectionPool(
        pool_size=1, use_pure=True, **connect_args(mysql_server)
    )
    try:
        mysql_of_one_face(pool, False)
    finally:
        pool._remove_connections()


@pytest.mark.parametrize("package", ["aiomysql", "asyncmy"])
def test_asyncio_pools(package: str, mysql_server: str, mysql_database: str) -> None:
    a = connect_args(mysql_server)

    async def check() -> None:
        pool: Any
        if package == "aiomysql":
            pool = await aiomysql.create_pool(
                minsize=0, host=a["host"], port=a["port"], user=a["user"], password=a["password"]
            )
        else:
            pool = await asyncmy.create_pool(minsize=0, **a)
        try:
            mysql_of_one_face(pool, True)
            assert pool.size == 0, "detection and construction opened no connection"
        finally:
            pool.close()
            await pool.wait_closed()

    asyncio.run(check())


ENGINES: dict[str, tuple[Callable[[], Any], bool]] = {
    "Engine/pymysql": (lambda: sqlalchemy.create_engine(f"mysql+pymysql://{NOWHERE}"), False),
    "Engine/mysqldb": (lambda: sqlalchemy.create_engine(f"mysql+mysqldb://{NOWHERE}"), False),
    "Engine/mysqlconnector": (
        lambda: sqlalchemy.create_engine(f"mysql+mysqlconnector://{NOWHERE}"),
        False,
    ),
    "Engine/mariadb+pymysql": (
        lambda: sqlalchemy.create_engine(f"mariadb+pymysql://{NOWHERE}"),
        False,
    ),
    "AsyncEngine/aiomysql": (lambda: create_async_engine(f"mysql+aiomysql://{NOWHERE}"), True),
    "AsyncEngine/asyncmy": (lambda: create_async_engine(f"mysql+asyncmy://{NOWHERE}"), True),
}


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_sqlalchemy_engines_detected_and_faces_told_apart(name: str) -> None:
    """An engine on a MySQL dialect is MySQL's, not PostgreSQL's (both have raw_connection)."""
    factory, is_async = ENGINES[name]
    engine = factory()
    pool = engine.sync_engine.pool if is_async else engine.pool
    mysql_of_one_face(engine, is_async)
    assert pool.checkedout() == 0
    assert pool.checkedin() == 0  # never connected


@pytest.mark.parametrize(
    ("engine", "classes", "needs"),
    [
        (StandInEngine("mysql", "oursql"), SYNC, "'oursql' driver.*pymysql or mysqldb"),
        (StandInEngine("mariadb", "mariadbconnector"), SYNC, "'mariadbconnector' driver"),
        (StandInAsyncEngine("mysql", "aiomysql2"), ASYNC, "must be aiomysql or asyncmy"),
        (StandInAsyncEngine("mysql", "pymysql"), ASYNC, "must be aiomysql or asyncmy"),
    ],
)
def test_sqlalchemy_engine_of_another_driver_refused(
    engine: object, classes: list[Any], needs: str
) -> None:
    assert detect(engine, None) == "mysql"
    for cls in classes:
        with pytest.raises(UnsupportedClientError, match=needs):
            make(cls, engine)


def test_other_db_api_connections_are_not_mysql() -> None:
    """sqlite3 and psycopg connections have ``cursor`` too, but not ``get_server_info``."""
    lite = sqlite3.connect(":memory:")
    pg = psycopg.Connection  # the class: its shape is what detection reads
    try:
        with pytest.raises(UnsupportedClientError, match="a MySQL client needs"):
            detect(lite, None)
        with pytest.raises(UnsupportedClientError, match="backend='mysql'"):
            detect(lite, "mysql")
        assert "mysql" not in {detect(pg, "postgresql")}
        with pytest.raises(UnsupportedClientError, match="backend='mysql'"):
            detect(pg, "mysql")
    finally:
        lite.close()

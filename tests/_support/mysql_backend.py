"""The MySQL backend of the behaviour suites: a real server through one client package.

Variants, per face (``MYSQL_CASES``): PyMySQL in autocommit and out of it
(each statement then committed by dmutex), mysqlclient (autocommit: it
cannot tell a transaction), mysql-connector as it comes (autocommit off)
and its pool, SQLAlchemy ``Engine``s on PyMySQL and on mysqlclient (its
lent connections out of autocommit); aiomysql and asyncmy connections and
pools, and ``AsyncEngine``s on each. Every variant
works in the session's test database (``dmutex_test_<hex>``), emptied of
tables first. Leases are 30 s and more, so none runs out during a test;
force-expiry sets ``expired_at`` to the server's now and leaves the row
stored, so takeover of a stored row is what gets exercised.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import aiomysql
import asyncmy
import mysql.connector
import mysql.connector.pooling
import MySQLdb
import pymysql
import sqlalchemy
from sqlalchemy.ext.asyncio import create_async_engine

from dmutex import ManualClock
from dmutex._backends.mysql.runners import _turn
from tests._support.faces import FaceName, LoopThread
from tests._support.mysql_rows import NOW_MS, quoted
from tests._support.mysql_servers import Session, aiomysql_connection, connect_args, without_tls
from tests._support.rwrows import hold_expired

Runner = Callable[[Awaitable[object]], object]

MYSQL_VARIANTS = (
    "pymysql",
    "pymysql-transactions",
    "mysqlclient",
    "mysql-connector",
    "mysql-connector-pool",
    "sqlalchemy-pymysql",
    "sqlalchemy-mysqldb",
    "aiomysql",
    "aiomysql-pool",
    "asyncmy",
    "asyncmy-pool",
    "sqlalchemy-asyncmy",
    "sqlalchemy-aiomysql",
)
MYSQL_CASES: dict[FaceName, tuple[str, ...]] = {
    "sync": MYSQL_VARIANTS[:7],
    "async": MYSQL_VARIANTS[7:],
}


def chosen_variants() -> frozenset[str]:
    """``DMUTEX_MYSQL_VARIANTS``: a comma-separated subset of the variants to run (all)."""
    chosen = os.environ.get("DMUTEX_MYSQL_VARIANTS", "").strip()
    if not chosen:
        return frozenset(MYSQL_VARIANTS)
    names = frozenset(name.strip() for name in chosen.split(","))
    unknown = sorted(names - set(MYSQL_VARIANTS))
    if unknown:
        raise ValueError(
            f"DMUTEX_MYSQL_VARIANTS names {unknown}; the variants are {MYSQL_VARIANTS}"
        )
    return names


class MySQL:
    """A real MySQL or MariaDB server through one client package (module docstring)."""

    clock: ManualClock | None = None
    ttls: tuple[float, ...] = (30.0, 61.5, 90.001)

    def __init__(self, session: Session, variant: str = "pymysql") -> None:
        assert variant in MYSQL_VARIANTS, variant
        server = session.server()
        self.variant = variant
        self.url = server.url
        self.database = server.database
        self.args: dict[str, Any] = {**connect_args(server.url), "database": server.database}
        self.options: dict[str, object] = {}
        self.plain = without_tls(server.url)  # PyMySQL: no TLS context to build on loopback
        self.loop: LoopThread | None = None
        """The rig's loop, where asyncio clients are made (and must be used)."""
        self._inspector = server.connect()
        self._closers: list[Callable[[], object]] = []
        self._async_closers: list[Callable[[], Awaitable[object]]] = []
        for table in self._tables():
            self._execute(f"DROP TABLE {quoted(table)}")

    def _execute(self, statement: str, args: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        with self._inspector.cursor() as cursor:
            cursor.execute(statement, args or None)
            return list(cursor.fetchall())

    def _engine_url(self, driver: str) -> str:
        a = self.args
        return (
            f"mysql+{driver}://{a['user']}:{a['password']}@{a['host']}:{a['port']}/{a['database']}"
        )

    def client(self, asynchronous: bool) -> object:
        if asynchronous:
            assert self.loop is not None, "the rig gives its loop first"
            return self.loop.run(self._async_client())
        a = self.args
        made: Any
        if self.variant == "pymysql":
            made = pymysql.connect(**a, autocommit=True, ssl_disabled=self.plain)
        elif self.variant == "pymysql-transactions":
            made = pymysql.connect(**a, ssl_disabled=self.plain)
        elif self.variant == "mysqlclient":
            made = MySQLdb.connect(
                host=a["host"],
                port=a["port"],
                user=a["user"],
                password=a["password"],
                database=a["database"],
                charset="utf8mb4",
                autocommit=True,
            )
        elif self.variant == "mysql-connector":
            made = mysql.connector.connect(**a, use_pure=True)
        elif self.variant == "mysql-connector-pool":
            made = mysql.connector.pooling.MySQLConnectionPool(
                pool_size=4, use_pure=True, autocommit=True, **a
            )
            self._closers.append(lambda: made._remove_connections())
            return made
        elif self.variant == "sqlalchemy-mysqldb":
            # Out of autocommit, as SQLAlchemy lends it: dmutex commits each statement.
            engine = sqlalchemy.create_engine(self._engine_url("mysqldb"), pool_size=4)
            self._closers.append(engine.dispose)
            return engine
        elif self.variant == "sqlalchemy-pymysql":
            engine = sqlalchemy.create_engine(
                self._engine_url("pymysql"),
                pool_size=4,
                connect_args={"ssl_disabled": self.plain},
            )
            self._closers.append(engine.dispose)
            return engine
        else:
            raise AssertionError(f"{self.variant} has no sync client")

        def close() -> None:
            # In a turn of the connection (the store's rule 4): a renewal handed to the
            # renewer's worker before the test's last release may still be sending on it
            # (it waited for the turn that the release held), and mysqlclient refuses a
            # close from another thread meanwhile (CI run J: ProgrammingError at teardown).
            with _turn(made):
                made.close()

        self._closers.append(close)
        return made

    async def _async_client(self) -> object:
        a = self.args
        made: Any
        if self.variant.startswith("sqlalchemy-"):
            driver = self.variant.removeprefix("sqlalchemy-")
            engine = create_async_engine(self._engine_url(driver), pool_size=4)
            self._async_closers.append(engine.dispose)
            return engine
        if self.variant == "aiomysql":
            made = await aiomysql_connection(self.url, a["database"])
        elif self.variant == "asyncmy":
            made = await asyncmy.connect(**a, charset="utf8mb4", autocommit=True)
        elif self.variant in ("aiomysql-pool", "asyncmy-pool"):
            if self.variant == "aiomysql-pool":
                pool: Any = await aiomysql.create_pool(
                    host=a["host"],
                    port=a["port"],
                    user=a["user"],
                    password=a["password"],
                    db=a["database"],
                    charset="utf8mb4",
                    maxsize=4,
                )
            else:
                pool = await asyncmy.create_pool(**a, charset="utf8mb4", maxsize=4)

            async def close_pool() -> None:
                pool.close()
                await pool.wait_closed()

            self._async_closers.append(close_pool)
            return pool
        else:
            raise AssertionError(f"{self.variant} has no asyncio client")

        async def close() -> None:
            made.close()

        self._async_closers.append(close)
        return made

    def status_client(self) -> object:
        """A sync PyMySQL connection in the test database: what ``dmutex status`` is given."""
        conn = pymysql.connect(**self.args, autocommit=True, ssl_disabled=self.plain)
        self._closers.append(conn.close)
        return conn

    def _tables(self) -> list[str]:
        rows = self._execute(
            "SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s",
            (self.database,),
        )
        return [str(name) for (name,) in rows]

    def force_expire(self, key: str, slot: int | None = None) -> None:
        pattern = f"^permit:{'[0-9]+' if slot is None else slot}:{_regexp_quote(key)}$"
        for table in self._tables():
            self._execute(
                f"UPDATE {quoted(table)} SET `expired_at` = {NOW_MS} "
                f"WHERE `key` LIKE 'permit:%%' AND `expired_at` > {NOW_MS} "
                "AND `key` REGEXP %s",
                (pattern,),
            )

    def expire_hold(self, key: str, token: str) -> None:
        """Make ``token``'s read-write hold of ``key`` expire now (the server's), in every table."""
        for table in self._tables():
            rows = self._execute(
                f"SELECT `value`, {NOW_MS} FROM {quoted(table)} WHERE `key` = %s",
                (f"rwlock:{key}",),
            )
            for value, now in rows:
                text = value.decode() if isinstance(value, bytes) else str(value)
                self._execute(
                    f"UPDATE {quoted(table)} SET `value` = %s WHERE `key` = %s",
                    (hold_expired(text, token, int(now)), f"rwlock:{key}"),
                )

    def active(self, prefix: str) -> dict[str, str]:
        # The tests use the default tables: the Redis-style prefix without its colon.
        table = prefix.rstrip(":")
        if table not in self._tables():
            return {}
        rows = self._execute(
            f"SELECT `key`, `value` FROM {quoted(table)} "
            f"WHERE `key` LIKE 'permit:%%' AND `expired_at` > {NOW_MS}"
        )
        return {f"{prefix}{name}": str(token) for name, token in rows}

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


def _regexp_quote(text: str) -> str:
    """``text`` as a literal in a MariaDB/MySQL regular expression."""
    return "".join("\\" + char if char in "\\^$.|?*+()[]{}" else char for char in text)

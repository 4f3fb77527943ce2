"""The TypeScript dmutex's MySQL store replayed, and MySQL's side of the interop suite.

The TypeScript library (github.com/song-younghoon/dmutex, 0.4.0, commit
fa55975) is not on npm and cannot run here, so :class:`TypeScript`
replays what it sends: the statements of its ``src/mysql-store.ts``
(``MySQLDMutexStore``: ``initialize``, run by its constructor, ``acquire``,
``release``, ``extend``), quoted verbatim, with its way of naming and
quoting the table, driven by the slot loops of its ``src/semaphore.ts``
(``DSemaphore``; its ``DMutex`` is a one-permit semaphore under the prefix
``_dmutex_``). They run as mysql2's ``execute`` runs them: one statement
per call, autocommit, ``?`` placeholders, a JS number bound as a DOUBLE
(PyMySQL sends a float as a double literal, ``...e0``), a string as text,
``CLIENT_FOUND_ROWS`` set (mysql2's default flags: an ``UPDATE`` counts the
rows it matched). Its expiries are its host's ``Date.now()`` (here: this
machine's clock, the server's too), in epoch milliseconds.
dmutex's side is its public classes on PyMySQL (sync), aiomysql and asyncmy
(asyncio).

:class:`MySQL` is what ``tests/integration/test_sql_typescript.py`` asks of
the store: the table is dmutex's (``utf8mb4_nopad_bin`` key and value, made
before either library uses it: dmutex refuses the TypeScript store's own,
case-insensitive one until altered); a lease runs out by rewriting its
``expired_at`` by the server's clock (``tests._support.mysql_rows``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any

import asyncmy
from pymysql.connections import Connection
from pymysql.constants import CLIENT
from pymysql.cursors import Cursor

from dmutex import DMutex, DSemaphore
from dmutex._backends.mysql.statements import COLLATIONS
from tests._support import mysql_rows
from tests._support.mysql_servers import Server, aiomysql_connection, connect_args
from tests._support.sampling import until
from tests._support.typescript import Dialect, PythonSide, TypeScriptSemaphore

# The collation dmutex gives its text columns on the test server (MariaDB; MySQL 8's is
# COLLATIONS["mysql"]): binary, no padding.
COLLATION = COLLATIONS["mariadb"]


# --- the TypeScript library, replayed -----------------------------------------------------


def quote_identifier(identifier: str) -> str:
    """mysql-store.ts's ``quoteIdentifier``."""
    if not identifier or "\0" in identifier:
        raise ValueError("MySQL identifiers must be non-empty strings without null bytes")
    return "`" + identifier.replace("`", "``") + "`"


def date_now() -> int:
    """``Date.now()``: the host's clock in whole epoch milliseconds."""
    return time.time_ns() // 1_000_000


def get_time(at: float) -> int:
    """``new Date(at).getTime()``: a time value is cut to whole milliseconds, toward zero."""
    return math.trunc(at)


class TypeScript(TypeScriptSemaphore[int]):
    """The TypeScript ``DSemaphore`` (or ``DMutex``) on its ``MySQLDMutexStore``, replayed.

    ``conn`` must be as mysql2 opens one: :func:`typescript_connection`.
    Constructing it sends the ``CREATE TABLE IF NOT EXISTS``, as the store's
    constructor does (``readyPromise``). ``skew_ms`` puts its host's clock
    that far ahead of this machine's (behind, if negative).
    """

    def __init__(
        self,
        conn: Connection[Cursor],
        service_name: str,
        *,
        max_permits: int = 1,
        table_prefix: str = "_dsemaphore_",
        table_name: str | None = None,
        database_name: str | None = None,
        skew_ms: int = 0,
    ) -> None:
        self.conn = conn
        self.max_permits = max_permits
        self.skew_ms = skew_ms
        # MySQLDMutexStore's constructor.
        name = table_name or f"{table_prefix}{service_name}"
        self.table = (
            f"{quote_identifier(database_name)}.{quote_identifier(name)}"
            if database_name
            else quote_identifier(name)
        )
        self.initialize()

    @classmethod
    def mutex(cls, conn: Connection[Cursor], service_name: str, **options: Any) -> TypeScript:
        """mutex.ts's ``DMutex``: one permit, tables prefixed ``_dmutex_``."""
        return cls(conn, service_name, max_permits=1, table_prefix="_dmutex_", **options)

    def now(self) -> int:
        """``Date.now()`` on this host."""
        return date_now() + self.skew_ms

    def execute(self, text: str, values: tuple[object, ...] = ()) -> tuple[int, list[Any]]:
        """``mysqlClient.execute(sql, values)``: (``affectedRows``, the rows).

        ``?`` becomes PyMySQL's ``%s`` (no statement here has a ``?`` elsewhere);
        a number is sent as a double, as mysql2 binds every JS number.
        """
        with self.conn.cursor() as cursor:
            if values:
                sent = tuple(
                    float(v) if isinstance(v, int) and not isinstance(v, bool) else v
                    for v in values
                )
                cursor.execute(text.replace("%", "%%").replace("?", "%s"), sent)
            else:
                cursor.execute(text)
            return cursor.rowcount, list(cursor.fetchall())

    # mysql-store.ts, verbatim: the text of each statement as it builds it.

    def initialize(self) -> None:
        self.execute(f"""
      CREATE TABLE IF NOT EXISTS {self.table} (
        `key` varchar(512) NOT NULL,
        `value` varchar(128) NOT NULL,
        `expired_at` bigint NOT NULL,
        PRIMARY KEY (`key`),
        INDEX `expired_at_idx` (`expired_at`)
      ) ENGINE=InnoDB
    """)

    def store_acquire(self, key: str, token: str, ttl_seconds: float) -> int | None:
        now = self.now()
        expired_at = get_time(now + ttl_seconds * 1000)
        self.execute(
            f"""
      INSERT INTO {self.table} (`key`, `value`, `expired_at`)
      VALUES (?, ?, ?)
      ON DUPLICATE KEY UPDATE
        `value` = IF(`expired_at` <= ?, VALUES(`value`), `value`),
        `expired_at` = IF(`expired_at` <= ?, VALUES(`expired_at`), `expired_at`)
    """,
            (key, token, expired_at, now, now),
        )
        _, rows = self.execute(
            f"""
      SELECT `value`, `expired_at`
      FROM {self.table}
      WHERE `key` = ?
    """,
            (key,),
        )
        row = rows[0] if rows else None
        return int(row[1]) if row is not None and row[0] == token else None

    def store_release(self, key: str, token: str) -> bool:
        affected, _ = self.execute(
            f"""
      DELETE FROM {self.table}
      WHERE `key` = ? AND `value` = ?
    """,
            (key, token),
        )
        return affected == 1

    def store_extend(self, key: str, token: str, ttl_seconds: float) -> int | None:
        now = self.now()
        expired_at = get_time(now + ttl_seconds * 1000)
        affected, _ = self.execute(
            f"""
      UPDATE {self.table}
      SET `expired_at` = ?
      WHERE `key` = ?
        AND `value` = ?
        AND `expired_at` > ?
    """,
            (expired_at, key, token, now),
        )
        return expired_at if affected == 1 else None


# --- connections ----------------------------------------------------------------------------


if TYPE_CHECKING:
    _Connection = Connection[Cursor]
else:
    _Connection = Connection  # generic in the stubs only


class Counted(_Connection):
    """A PyMySQL connection that counts the statements it sends."""

    sent = 0

    def query(self, sql: Any, unbuffered: bool = False) -> int:
        self.sent += 1
        return super().query(sql, unbuffered)


def connect(
    server: Server,
    *,
    client_flag: int = 0,
    collation: str | None = None,
    user: str | None = None,
    password: str | None = None,
    in_database: bool = True,
) -> Counted:
    """An autocommit PyMySQL connection in the tests' database (``in_database``: else in none)."""
    args = connect_args(server.url)
    return Counted(
        host=args["host"],
        port=args["port"],
        user=user or args["user"],
        password=args["password"] if password is None else password,
        database=server.database if in_database else None,
        autocommit=True,
        charset="utf8mb4",
        collation=collation,
        client_flag=client_flag,
    )


def typescript_connection(server: Server) -> Counted:
    """A connection as mysql2 opens one: autocommit, ``CLIENT_FOUND_ROWS``, utf8mb4_unicode_ci."""
    return connect(server, client_flag=CLIENT.FOUND_ROWS, collation="utf8mb4_unicode_ci")


class Python(PythonSide):
    """dmutex's public classes on one kind of client, each call run to its end."""

    def __init__(self, kind: str, server: Server) -> None:
        self.kind = kind
        self.loop = None if kind == "pymysql" else asyncio.new_event_loop()
        args = connect_args(server.url)
        self.client: Any
        if kind == "pymysql":
            self.client = connect(server)
        elif kind == "aiomysql":
            self.client = self.run(aiomysql_connection(server.url, server.database))
        else:
            self.client = self.run(
                asyncmy.connect(
                    host=args["host"],
                    port=args["port"],
                    user=args["user"],
                    password=args["password"],
                    database=server.database,
                    charset="utf8mb4",
                    autocommit=True,
                )
            )

    def close(self) -> None:
        if self.loop is None:
            self.client.close()
            return
        self.run(self.client.ensure_closed())
        self.loop.close()


# --- the table behind both libraries -------------------------------------------------------


def run(raw: Connection[Cursor], text: str, *args: object) -> tuple[int, list[Any]]:
    """(affected rows, rows) of one statement on a plain connection."""
    with raw.cursor() as cursor:
        cursor.execute(text, args or None)
        return cursor.rowcount, list(cursor.fetchall())


def create_table(raw: Connection[Cursor], table: str) -> str:
    """``SHOW CREATE TABLE``'s text for ``table``."""
    return str(run(raw, f"SHOW CREATE TABLE {quote_identifier(table)}")[1][0][1])


def column_collations(raw: Connection[Cursor], table: str) -> dict[str, str | None]:
    found = run(
        raw,
        "SELECT COLUMN_NAME, COLLATION_NAME FROM information_schema.COLUMNS "
        "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
        table,
    )[1]
    return {name: collation for name, collation in found}


def made_by_dmutex(raw: Counted, service: str, *, permits: int = 1) -> None:
    """dmutex's table for ``service`` (``utf8mb4_nopad_bin`` key and value), made before any use."""
    if permits == 1:
        DMutex(service, raw).ready()
    else:
        DSemaphore(service, raw, max_permits=permits).ready()


class MySQL(Dialect[Counted, int]):
    """MySQL's side of the interop suite, in the tests' database on ``server``."""

    name = "mysql"
    sides = ("pymysql", "aiomysql", "asyncmy")
    race_sides = ("pymysql", "aiomysql", "asyncmy")
    race_rounds = 40
    # Two tight retry loops that take a permit again the moment they release it
    # would keep both from dmutex's polling waiters for most of the race.
    race_pause = 0.003
    overtaken = (3, "read, take (refused), read again: full")

    def __init__(self, server: Server) -> None:
        self.server = server

    def connect(self) -> Counted:
        return connect(self.server)

    def typescript_connection(self) -> Counted:
        return typescript_connection(self.server)

    def python(self, kind: str) -> Python:
        return Python(kind, self.server)

    def semaphore(self, conn: Counted, service: str, permits: int) -> TypeScript:
        return TypeScript(conn, service, max_permits=permits)

    def mutex(self, conn: Counted, service: str) -> TypeScript:
        return TypeScript.mutex(conn, service)

    def typescript(self, conn: Counted, raw: Counted, service: str, permits: int) -> TypeScript:
        made_by_dmutex(raw, service, permits=permits)
        return TypeScript(conn, service, max_permits=permits)

    def typescript_mutex(self, conn: Counted, raw: Counted, service: str) -> TypeScript:
        made_by_dmutex(raw, service)
        return TypeScript.mutex(conn, service)

    def rows(self, raw: Counted, table: str) -> dict[str, tuple[str, int]]:
        return mysql_rows.rows(raw, table)

    def expiry_ms(self, at: int) -> int:
        return at

    def ms(self, at: datetime) -> int:
        return mysql_rows.ms(at)

    def age(self, raw: Counted, table: str, key: str) -> None:
        mysql_rows.age(raw, table, key)

    def drop(self, raw: Counted, table: str) -> None:
        run(raw, f"DROP TABLE IF EXISTS {quote_identifier(table)}")

    @contextmanager
    def uncommitted(self, conn: Counted) -> Iterator[None]:
        conn.begin()
        yield
        conn.commit()

    def blocked(self, raw: Counted, conn: Counted, late: Counted) -> Callable[[], None]:
        (thread,) = run(conn, "SELECT CONNECTION_ID()")[1][0]
        # INNODB_TRX is a cache that a read less than 0.1 s after the last
        # one does not refresh: polled every 0.2 s.
        waiting = (
            "SELECT count(*) FROM information_schema.INNODB_TRX "
            "WHERE trx_mysql_thread_id = %s AND trx_state = 'LOCK WAIT'"
        )
        return lambda: until(
            lambda: run(raw, waiting, thread)[1] == [(1,)],
            "dmutex waits on the row",
            20,
            poll=0.2,
        )

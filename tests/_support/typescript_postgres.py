"""The TypeScript dmutex's PostgreSQL store replayed, and PostgreSQL's side of the interop suite.

The TypeScript library (github.com/song-younghoon/dmutex, 0.4.0, commit
fa55975) is not on npm and cannot run here, so :class:`TypeScript`
replays what it sends: the statements of its ``src/postgres-store.ts``
(``PostgresDMutexStore``: ``initialize``, ``acquire``, ``release``,
``extend``), quoted verbatim, with its way of naming and quoting the table,
driven by the slot loops of its ``src/semaphore.ts`` (``DSemaphore``; its
``DMutex`` is a one-permit semaphore under the prefix ``_dmutex_``). They
run as node-postgres runs them: one statement per query in autocommit,
numbered ``$n`` parameters (psycopg's ``RawCursor``), every value sent as
text. dmutex's side is its public classes on psycopg (sync and asyncio) and
asyncpg.

:class:`Postgres` is what ``tests/integration/test_sql_typescript.py`` asks
of the store: the table is the TypeScript store's own (its ``ready()``
makes it, and dmutex uses it as it is); time is the server's, and a lease
runs out by rewriting its ``expired_at`` (``tests._support.postgres_rows``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import asyncpg
import psycopg

from tests._support import postgres_rows
from tests._support.sampling import until
from tests._support.typescript import Dialect, PythonSide, TypeScriptSemaphore

# --- the TypeScript library, replayed -----------------------------------------------------


def quote_identifier(identifier: str) -> str:
    """postgres-store.ts's ``quoteIdentifier``."""
    if not identifier or "\0" in identifier:
        raise ValueError("PostgreSQL identifiers must be non-empty strings without null bytes")
    return '"' + identifier.replace('"', '""') + '"'


class TypeScript(TypeScriptSemaphore[datetime]):
    """The TypeScript ``DSemaphore`` (or ``DMutex``) on its ``PostgresDMutexStore``, replayed.

    ``conn`` must be in autocommit with ``RawCursor`` (node-postgres's ``$n``
    parameters): :func:`typescript_connection` makes one.
    """

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        service_name: str,
        *,
        max_permits: int = 1,
        table_prefix: str = "_dsemaphore_",
        table_name: str | None = None,
        schema_name: str | None = None,
    ) -> None:
        self.conn = conn
        self.max_permits = max_permits
        # PostgresDMutexStore's constructor.
        self.table_name = table_name or f"{table_prefix}{service_name}"
        self.index_name = f"{self.table_name}_expired_at_idx"
        self.table = (
            f"{quote_identifier(schema_name)}.{quote_identifier(self.table_name)}"
            if schema_name
            else quote_identifier(self.table_name)
        )

    @classmethod
    def mutex(cls, conn: psycopg.Connection[Any], service_name: str, **options: Any) -> TypeScript:
        """mutex.ts's ``DMutex``: one permit, tables prefixed ``_dmutex_``."""
        return cls(conn, service_name, max_permits=1, table_prefix="_dmutex_", **options)

    def query(self, text: str, values: tuple[object, ...] = ()) -> psycopg.Cursor[Any]:
        """``pool.query(text, values)``: each value sent as text, its type left to the server."""
        return self.conn.execute(text, [str(value) for value in values] if values else None)

    # postgres-store.ts, verbatim: the text of each statement as it builds it.

    def ready(self) -> None:
        self.query(f"""
      CREATE TABLE IF NOT EXISTS {self.table} (
        "key" text PRIMARY KEY,
        "value" text NOT NULL,
        "expired_at" timestamptz NOT NULL
      )
    """)
        self.query(f"""
      CREATE INDEX IF NOT EXISTS {quote_identifier(self.index_name)}
      ON {self.table} ("expired_at")
    """)

    def store_acquire(self, key: str, token: str, ttl_seconds: float) -> datetime | None:
        row = self.query(
            f"""
      INSERT INTO {self.table} AS locks ("key", "value", "expired_at")
      VALUES ($1, $2, NOW() + ($3::double precision * INTERVAL '1 second'))
      ON CONFLICT ("key") DO UPDATE
      SET
        "value" = EXCLUDED."value",
        "expired_at" = EXCLUDED."expired_at"
      WHERE locks."expired_at" <= NOW()
      RETURNING "expired_at"
    """,
            (key, token, ttl_seconds),
        ).fetchone()
        return None if row is None else row[0]

    def store_release(self, key: str, token: str) -> bool:
        done = self.query(
            f"""
      DELETE FROM {self.table}
      WHERE "key" = $1 AND "value" = $2
    """,
            (key, token),
        )
        return done.rowcount == 1

    def store_extend(self, key: str, token: str, ttl_seconds: float) -> datetime | None:
        row = self.query(
            f"""
      UPDATE {self.table}
      SET "expired_at" = NOW() + ($3::double precision * INTERVAL '1 second')
      WHERE "key" = $1
        AND "value" = $2
        AND "expired_at" > NOW()
      RETURNING "expired_at"
    """,
            (key, token, ttl_seconds),
        ).fetchone()
        return None if row is None else row[0]


# --- connections ----------------------------------------------------------------------------


class Counted(psycopg.Connection[Any]):
    """A psycopg connection that counts the statements sent through its ``execute``."""

    sent = 0

    def execute(
        self,
        query: Any,
        params: Any = None,
        *,
        prepare: bool | None = None,
        binary: bool = False,
    ) -> psycopg.Cursor[Any]:
        self.sent += 1
        return super().execute(query, params, prepare=prepare, binary=binary)


def connect(url: str, schema: str, **options: Any) -> Counted:
    """An autocommit connection whose search path is the run's schema."""
    return Counted.connect(url, autocommit=True, options=f"-csearch_path={schema}", **options)


def typescript_connection(url: str, schema: str) -> Counted:
    """A connection that runs statements as node-postgres does: ``$n`` parameters."""
    return connect(url, schema, cursor_factory=psycopg.RawCursor)


class Python(PythonSide):
    """dmutex's public classes on one kind of client, each call run to its end."""

    def __init__(self, kind: str, url: str, schema: str) -> None:
        self.loop = None if kind == "psycopg" else asyncio.new_event_loop()
        self.client: Any
        if kind == "psycopg":
            self.client = connect(url, schema)
        elif kind == "psycopg-async":
            self.client = self.run(
                psycopg.AsyncConnection.connect(
                    url, autocommit=True, options=f"-csearch_path={schema}"
                )
            )
        else:
            self.client = self.run(asyncpg.connect(url, server_settings={"search_path": schema}))

    def close(self) -> None:
        self.run(self.client.close())
        if self.loop is not None:
            self.loop.close()


class Postgres(Dialect[Counted, datetime]):
    """PostgreSQL's side of the interop suite, in the run's schema of ``url``."""

    name = "postgresql"
    sides = ("psycopg", "psycopg-async", "asyncpg")
    race_sides = ("psycopg", "asyncpg")
    race_rounds = 30
    race_pause = 0.0
    overtaken = (
        2,
        "the statement lost its slot, so it was sent again",
    )

    def __init__(self, url: str, schema: str) -> None:
        self.url = url
        self.schema = schema

    def connect(self) -> Counted:
        return connect(self.url, self.schema)

    def typescript_connection(self) -> Counted:
        return typescript_connection(self.url, self.schema)

    def python(self, kind: str) -> Python:
        return Python(kind, self.url, self.schema)

    def semaphore(self, conn: Counted, service: str, permits: int) -> TypeScript:
        return TypeScript(conn, service, max_permits=permits)

    def mutex(self, conn: Counted, service: str) -> TypeScript:
        return TypeScript.mutex(conn, service)

    def typescript(self, conn: Counted, raw: Counted, service: str, permits: int) -> TypeScript:
        ts = TypeScript(conn, service, max_permits=permits)
        ts.ready()
        return ts

    def typescript_mutex(self, conn: Counted, raw: Counted, service: str) -> TypeScript:
        ts = TypeScript.mutex(conn, service)
        ts.ready()
        return ts

    def rows(self, raw: Counted, table: str) -> dict[str, tuple[str, datetime]]:
        return postgres_rows.rows(raw, table)

    def expiry_ms(self, at: datetime) -> int:
        return postgres_rows.ms(at)

    def ms(self, at: datetime) -> int:
        return postgres_rows.ms(at)

    def age(self, raw: Counted, table: str, key: str) -> None:
        postgres_rows.age(raw, table, key)

    def drop(self, raw: Counted, table: str) -> None:
        raw.execute(f'DROP TABLE IF EXISTS "{table}"')

    @contextmanager
    def uncommitted(self, conn: Counted) -> Iterator[None]:
        with conn.transaction():
            yield

    def blocked(self, raw: Counted, conn: Counted, late: Counted) -> Callable[[], None]:
        blocked = (
            "SELECT count(*) FROM pg_stat_activity "
            f"WHERE {late.info.backend_pid} = ANY(pg_blocking_pids(pid))"
        )
        return lambda: until(
            lambda: raw.execute(blocked).fetchone() == (1,), "dmutex waits on the row", 20
        )

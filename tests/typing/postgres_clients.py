"""The real PostgreSQL clients the static checks hand to the constructors.

Building them needs a server, so the typing files only annotate them: the
type checker's half. ``tests/integration/test_client_detection.py`` builds
each against the test server and checks that detection agrees.
"""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg
import psycopg
import psycopg_pool


@dataclass(frozen=True)
class PostgresClients:
    """One of each: psycopg's connections and pools of both faces, asyncpg's connection and pool."""

    conn: psycopg.Connection[tuple[object, ...]]
    aconn: psycopg.AsyncConnection[tuple[object, ...]]
    pool: psycopg_pool.ConnectionPool
    apool: psycopg_pool.AsyncConnectionPool
    apg: asyncpg.Connection
    apg_pool: asyncpg.Pool

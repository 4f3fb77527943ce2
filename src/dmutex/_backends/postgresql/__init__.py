"""The PostgreSQL backend, one file per thing it holds.

- ``statements.py``: the SQL, one builder per statement, and the
  placeholder style of each driver;
- ``runners.py``: how one statement runs on each kind of client (psycopg 3
  connections and pools, sync and asyncio; asyncpg; SQLAlchemy engines on
  either);
- ``store.py``: :class:`PostgresStore`, which sends the statements;
- ``readwrite.py``: :class:`PostgresReadWriteStore`, read-write locks on the same table shape.
"""

from __future__ import annotations

from .descriptor import BACKEND
from .readwrite import PostgresReadWriteStore
from .store import PostgresStore

__all__ = ["BACKEND", "PostgresReadWriteStore", "PostgresStore"]

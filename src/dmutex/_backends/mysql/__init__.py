"""The MySQL backend (MySQL and MariaDB), one file per thing it holds.

- ``statements.py``: the SQL, one builder per statement, and how a
  statement's one-integer answer reads;
- ``runners.py``: how one statement runs on each kind of client (PyMySQL,
  mysqlclient and mysql-connector connections and pools; aiomysql and
  asyncmy connections and pools; SQLAlchemy engines on any of them);
- ``store.py``: :class:`MySQLStore`, which sends the statements;
- ``readwrite.py``: :class:`MySQLReadWriteStore`, read-write locks on the same table shape.
"""

from __future__ import annotations

from .descriptor import BACKEND
from .readwrite import MySQLReadWriteStore
from .store import MySQLStore

__all__ = ["BACKEND", "MySQLReadWriteStore", "MySQLStore"]

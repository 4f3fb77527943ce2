"""A SQLite lock table seen from a plain connection, behind the libraries' backs.

- :func:`quoted`: a table name as SQLite quotes an identifier;
- :func:`tables`: the file's tables;
- :func:`rows`: what a table holds, key by key;
- :func:`listed`: the same rows as a list in key order, to compare whole.

SQLite stores expiries as epoch ms already: nothing here converts them.
"""

from __future__ import annotations

import sqlite3

Row = tuple[str, str, int]


def quoted(identifier: str) -> str:
    """An SQL identifier in double quotes, a double quote in it doubled."""
    return '"' + identifier.replace('"', '""') + '"'


def tables(raw: sqlite3.Connection) -> list[str]:
    """The names of the file's tables, sorted."""
    found = raw.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
    return [str(name) for (name,) in found.fetchall()]


def rows(raw: sqlite3.Connection, table: str) -> dict[str, tuple[str, int]]:
    """The table's rows: key -> (value, expired_at)."""
    found = raw.execute(f'SELECT "key", "value", "expired_at" FROM {quoted(table)}').fetchall()
    return {str(key): (str(value), int(at)) for key, value, at in found}


def listed(raw: sqlite3.Connection, table: str) -> list[Row]:
    """The table's rows in key order: (key, value, expired_at)."""
    found = raw.execute(f'SELECT "key", "value", "expired_at" FROM {quoted(table)} ORDER BY 1')
    return [(str(k), str(v), int(e)) for k, v, e in found.fetchall()]

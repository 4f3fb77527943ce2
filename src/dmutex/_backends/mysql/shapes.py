"""What makes a client a MySQL or MariaDB client, and which of its faces it has: no I/O."""

from __future__ import annotations

from ..shapes import defines
from ..sql.shapes import dialect_of

# Per MySQL client kind, the two names that tell it, the first one the method
# the runner is chosen by: a DB-API connection (PyMySQL, mysqlclient,
# mysql-connector, aiomysql, asyncmy), a mysql-connector pool, an aiomysql or
# asyncmy pool, a SQLAlchemy engine on a MySQL dialect.
_SHAPES = (
    ("cursor", "get_server_info"),
    ("get_connection", "pool_name"),
    ("acquire", "freesize"),
    ("raw_connection", "dialect"),
)
DIALECTS = ("mysql", "mariadb")
"""The SQLAlchemy dialects of MySQL: an engine on one is a MySQL client."""
# The method whose face tells sync from asyncio, per kind: a connection's
# commit is a coroutine function on aiomysql and asyncmy; its cursor is a
# function of the sync driver's own module (mysqlclient's commit is C's).
_FACES = {True: {"cursor": "cursor"}, False: {"cursor": "commit"}}


def mysql_method(client: object) -> str | None:
    """The first name of the MySQL shape ``client`` has, None if none.

    ``cursor`` (a connection), ``get_connection`` (a mysql-connector pool),
    ``acquire`` (an aiomysql or asyncmy pool) or ``raw_connection`` (a
    SQLAlchemy engine whose dialect is ``mysql`` or ``mariadb``).
    """
    for name, beside in _SHAPES:
        if defines(client, name) and defines(client, beside):
            if name == "raw_connection" and dialect_of(client) not in DIALECTS:
                return None
            return name
    return None


def recognises(client: object) -> bool:
    """Whether ``client`` has one of the MySQL shapes."""
    return mysql_method(client) is not None


def face(client: object, asynchronous: bool) -> str:
    """The method of a MySQL client whose face tells it is not ``asynchronous``'s."""
    kind = mysql_method(client) or "cursor"
    return _FACES[asynchronous].get(kind, kind)

"""Client shapes: every check dmutex makes of what a client object is.

One contract each:

- :func:`defines`: does the object's *type* define the name (a static lookup,
  so a ``__getattr__`` that answers any name, like pymongo's, cannot fool it);
- :func:`method`: the bound method to call, or :class:`UnsupportedClientError`;
- :func:`detect`: which backend contract a client meets, or an error saying
  what each contract needs. A PostgreSQL client is known by what psycopg 3
  and asyncpg have and no other client (``sqlite3.Connection`` included)
  does: a psycopg connection's ``info`` beside ``execute``, a psycopg
  pool's ``getconn`` beside ``connection``, asyncpg's ``fetchrow`` beside
  ``fetch``, a SQLAlchemy engine's ``dialect`` beside ``raw_connection``
  (whichever database the dialect names: ``runners.py`` refuses all but
  PostgreSQL, before any I/O);
- :func:`postgres_method`: the method of a PostgreSQL client whose face
  tells sync from asyncio;
- :func:`is_cluster_client`: whether a Redis client routes by hash slot;
- :func:`refuse_asyncio`: an asyncio object given to a sync class, refused
  before any call;
- :func:`wrong_face`: the error for a call that answered in the other face's
  way (a driver's check, on the first request).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Literal

from .._errors import AmbiguousClientError, UnsupportedClientError
from .._validate import BackendName
from .memory import InMemoryBackend
from .sqlite import SQLiteBackend

Found = Literal["memory", "mongodb", "mysql", "postgresql", "redis", "sqlite"]

_NEEDS: dict[BackendName, str] = {
    "mongodb": "get_database(name)",
    "mysql": (
        "cursor() and get_server_info() (a PyMySQL, mysqlclient, mysql-connector, aiomysql "
        "or asyncmy connection), get_connection() and pool_name (a mysql-connector pool), "
        "acquire() and freesize (an aiomysql or asyncmy pool), or raw_connection() "
        "and a mysql or mariadb dialect (a SQLAlchemy Engine or AsyncEngine)"
    ),
    "postgresql": (
        "execute(query, params) and info (a psycopg 3 connection), getconn() and "
        "connection() (a psycopg_pool pool), fetch(query, *args) and fetchrow() "
        "(an asyncpg connection or pool), or raw_connection() and dialect (a SQLAlchemy "
        "Engine or AsyncEngine)"
    ),
    "redis": (
        "execute_command(*args), or both set(name, value, px=..., nx=...) "
        "and eval(script, numkeys, *keys_and_args)"
    ),
}
_LABELS: dict[BackendName, str] = {
    "mongodb": "MongoDB",
    "mysql": "MySQL",
    "postgresql": "PostgreSQL",
    "redis": "Redis",
}
# Per PostgreSQL client kind: the two names that tell it, the first one the
# method whose face (coroutine function or not) tells sync from asyncio.
_POSTGRES_SHAPES = (
    ("fetch", "fetchrow"),
    ("getconn", "connection"),
    ("execute", "info"),
    ("raw_connection", "dialect"),
)
# Per MySQL client kind, the same: a DB-API connection (PyMySQL, mysqlclient,
# mysql-connector, aiomysql, asyncmy), a mysql-connector pool, an aiomysql or
# asyncmy pool, a SQLAlchemy engine on a MySQL dialect.
_MYSQL_SHAPES = (
    ("cursor", "get_server_info"),
    ("get_connection", "pool_name"),
    ("acquire", "freesize"),
    ("raw_connection", "dialect"),
)
# The SQLAlchemy dialects of MySQL: an engine on one is a MySQL client.
MYSQL_DIALECTS = ("mysql", "mariadb")
# The method whose face tells sync from asyncio, per kind: a connection's
# commit is a coroutine function on aiomysql and asyncmy; its cursor is a
# function of the sync driver's own module (mysqlclient's commit is C's).
_MYSQL_FACES = {True: {"cursor": "cursor"}, False: {"cursor": "commit"}}


def _described(target: object) -> str:
    return f"{type(target).__module__}.{type(target).__qualname__}"


def defines(target: object, name: str) -> bool:
    """Whether ``target``'s type (or the object itself) defines ``name`` as non-None."""
    try:
        return inspect.getattr_static(target, name) is not None
    except AttributeError:
        return False


def method(target: object, name: str) -> Callable[..., object]:
    """``target.name`` if it is callable; else :class:`UnsupportedClientError`."""
    found: object = getattr(target, name, None)
    if not callable(found):
        raise UnsupportedClientError(f"{_described(target)} has no {name}() that dmutex can call")
    return found


def _shapes(client: object) -> set[BackendName]:
    shapes: set[BackendName] = set()
    if defines(client, "get_database"):
        shapes.add("mongodb")
    if defines(client, "execute_command") or (defines(client, "set") and defines(client, "eval")):
        shapes.add("redis")
    if postgres_method(client) is not None:
        shapes.add("postgresql")
    if mysql_method(client) is not None:
        shapes.add("mysql")
    return shapes


def _on_mysql(engine: object) -> bool:
    """Whether a SQLAlchemy engine's dialect is MySQL's or MariaDB's (an attribute, no I/O)."""
    return getattr(getattr(engine, "dialect", None), "name", None) in MYSQL_DIALECTS


def mysql_method(client: object) -> str | None:
    """The first name of the MySQL shape ``client`` has, None if none.

    ``cursor`` (a connection), ``get_connection`` (a mysql-connector pool),
    ``acquire`` (an aiomysql or asyncmy pool) or ``raw_connection`` (a
    SQLAlchemy engine whose dialect is ``mysql`` or ``mariadb``).
    """
    for name, beside in _MYSQL_SHAPES:
        if defines(client, name) and defines(client, beside):
            if name == "raw_connection" and not _on_mysql(client):
                return None
            return name
    return None


def mysql_face(client: object, asynchronous: bool) -> str:
    """The method of a MySQL client whose face tells it is not ``asynchronous``'s."""
    kind = mysql_method(client) or "cursor"
    return _MYSQL_FACES[asynchronous].get(kind, kind)


def postgres_method(client: object) -> str | None:
    """The method that tells a PostgreSQL client's face.

    ``fetch``, ``getconn``, ``execute`` or ``raw_connection`` (a coroutine
    function on SQLAlchemy's ``AsyncEngine``, a plain one on ``Engine``).

    None if ``client`` has none of the PostgreSQL shapes.
    """
    for name, beside in _POSTGRES_SHAPES:
        if defines(client, name) and defines(client, beside):
            if name == "raw_connection" and _on_mysql(client):
                return None
            return name
    return None


def detect(client: object, backend: BackendName | None) -> Found:
    """Name the backend for ``client``; raise if there is none or it is ambiguous.

    An :class:`InMemoryBackend` or an :class:`SQLiteBackend` is accepted
    whatever ``backend`` says, so that code which passes ``backend=`` from its
    configuration can be tested with one.
    """
    if isinstance(client, InMemoryBackend):
        return "memory"
    if isinstance(client, SQLiteBackend):
        return "sqlite"
    shapes = _shapes(client)
    if backend is not None:
        if backend not in shapes:
            raise UnsupportedClientError(
                f"backend={backend!r}, but {_described(client)} does not offer {_NEEDS[backend]}"
            )
        return backend
    if len(shapes) > 1:
        found = sorted(shapes)
        labels = " and the ".join(_LABELS[name] for name in found)
        choices = " or ".join(f"backend={name!r}" for name in found)
        both = "both " if len(found) == 2 else ""
        raise AmbiguousClientError(
            f"{_described(client)} matches {both}the {labels} contract; pass {choices}"
        )
    if shapes:
        return shapes.pop()
    raise UnsupportedClientError(
        f"{_described(client)} is not a client dmutex can use. A MongoDB client needs "
        f"{_NEEDS['mongodb']}; a Redis client needs {_NEEDS['redis']}; a PostgreSQL "
        f"client needs {_NEEDS['postgresql']}; a MySQL client needs {_NEEDS['mysql']}; "
        "or pass a dmutex.SQLiteBackend or dmutex.InMemoryBackend"
    )


def is_cluster_client(client: object) -> bool:
    """Whether a Redis ``client`` routes commands by hash slot: it has a ``keyslot`` method.

    Looked up dynamically, so a wrapper that forwards attributes to a cluster
    client counts as one. Erring towards "cluster" only costs requests (one
    key per request); erring the other way would send scripts the cluster
    refuses.
    """
    return callable(getattr(client, "keyslot", None))


def refuse_asyncio(target: object, name: str, what: str) -> None:
    """Refuse an asyncio ``target`` (a client or a collection) for a sync class.

    Known before any call when ``target.name`` is a coroutine function
    (redis.asyncio, pymongo's async API, psycopg's and asyncpg's) or
    ``target`` is a motor object (every one has ``get_io_loop``; motor starts
    its request before it returns a Future, so this must be caught here).
    The other direction cannot be told from the object: a sync-looking
    method may return an awaitable, so the async driver checks the first
    reply (:func:`wrong_face`).
    """
    if inspect.iscoroutinefunction(getattr(target, name, None)) or defines(target, "get_io_loop"):
        raise UnsupportedClientError(
            f"{_described(target)} is an asyncio {what}: use AsyncDMutex / AsyncDSemaphore"
        )


# Packages whose plain (non-coroutine) client methods do their I/O before they
# return: redis-py, valkey-py, pymongo, psycopg (with psycopg_pool) and
# SQLAlchemy, outside their asyncio modules.
_SYNC_PACKAGES = (
    "redis",
    "valkey",
    "pymongo",
    "psycopg",
    "psycopg_pool",
    "sqlalchemy",
    "pymysql",
    "MySQLdb",
    "mysql",
)
_ASYNC_MODULES = ("asyncio", "asynchronous")


def refuse_sync(target: object, name: str, what: str) -> None:
    """Refuse a sync ``target`` (a client or a collection) for an asyncio class.

    Known before any call when ``target.name`` is a plain function of
    redis-py, valkey-py, pymongo, psycopg or SQLAlchemy outside their asyncio modules:
    such a call sends its request before it returns, so the reply check
    would come too late. Other clients are judged by their first reply (:func:`wrong_face`).
    """
    fn = getattr(type(target), name, None)
    # motor wraps pymongo's sync methods (their __module__ is pymongo's) into
    # ones that return Futures; every motor object has get_io_loop.
    if fn is None or inspect.iscoroutinefunction(fn) or defines(target, "get_io_loop"):
        return
    parts = str(getattr(fn, "__module__", "") or "").split(".")
    if parts[0] in _SYNC_PACKAGES and not set(parts) & set(_ASYNC_MODULES):
        raise UnsupportedClientError(
            f"{_described(target)} is a sync {what}: use DMutex / DSemaphore, or pass "
            "its asyncio counterpart (redis.asyncio, valkey.asyncio, pymongo.AsyncMongoClient, "
            "psycopg.AsyncConnection, psycopg_pool.AsyncConnectionPool, asyncpg, "
            "aiomysql, asyncmy, sqlalchemy.ext.asyncio.AsyncEngine)"
        )


def wrong_face(fn: object, result: object, *, callback: bool = False) -> UnsupportedClientError:
    """The error for a call that answered the other face's way.

    An awaitable reached a sync class, or a plain value an asyncio class;
    ``callback`` says the call was the user's ``run()`` callback, not the client.
    """
    name = getattr(fn, "__qualname__", repr(fn))
    awaitable = inspect.isawaitable(result)
    if callback and awaitable:
        said = (
            f"callback {name} returned an awaitable; a sync class cannot await it "
            "(use the Async class for async callbacks)"
        )
    elif callback:
        said = (
            f"callback {name} returned {type(result).__name__}, not an awaitable; "
            "the Async classes need an async callback"
        )
    elif awaitable:
        said = (
            f"{name} returned an awaitable: this is an asyncio client, "
            "use AsyncDMutex / AsyncDSemaphore"
        )
    else:
        said = f"{name} did not return an awaitable: this is a sync client, use DMutex / DSemaphore"
    return UnsupportedClientError(said)

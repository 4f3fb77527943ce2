"""The backends: a store per kind of client, and the one function that opens them.

Each store implements the :class:`Store` protocol the engine talks to, which
lives below this package, in ``dmutex._core.abc``.

- ``shapes.py``: detection and every other check of a client's shape;
- ``engines.py``: SQLAlchemy engines lending their driver's connections to
  the SQL stores;
- ``clients.py``: the client contracts, published as ``typing.Protocol``;
- ``memory.py``, ``redis/`` (with ``cluster.py``), ``mongo.py``, ``sqlite.py``,
  ``postgres/``, ``mysql/``: one store each.
"""

from __future__ import annotations

from .._clock import SYSTEM_CLOCK
from .._core.abc import Store
from .._core.readwrite import ReadWriteStore
from .._errors import InvalidArgumentError
from .._options import Options
from .._validate import (
    check_collection_name,
    check_db_name,
    check_mysql_names,
    check_postgres_names,
    check_redis_prefix,
)
from .memory import InMemoryBackend, MemoryReadWriteStore, MemoryStore
from .mongodb import MongoReadWriteStore, MongoStore
from .mysql import MySQLReadWriteStore, MySQLStore
from .postgresql import PostgresReadWriteStore, PostgresStore
from .redis import RedisReadWriteStore, RedisStore
from .shapes import (
    defines,
    detect,
    method,
    mysql_face,
    postgres_method,
    refuse_asyncio,
    refuse_sync,
)
from .sqlite import SQLiteBackend, SQLiteReadWriteStore, SQLiteStore, quote

# What replicas= would mean on the backends that replicate by their own
# settings. An InMemoryBackend or SQLiteBackend accepts it and waits for no
# one: they have no replicas, and code that sets it from its configuration
# can be tested with them (as backend= is).
_NOT_WAITED = {
    "mongodb": "on MongoDB, give the collection the write concern locks need "
    "(w='majority', j=True); dmutex uses it as it is",
    "postgresql": "on PostgreSQL, configure synchronous replication on the server "
    "(synchronous_standby_names, synchronous_commit)",
    "mysql": "on MySQL or MariaDB, configure semi-synchronous replication on the server",
}


def _check_memory(client: InMemoryBackend, options: Options) -> None:
    if options.clock is not None and options.clock is not client.clock:
        raise InvalidArgumentError(
            "an InMemoryBackend decides expiry by its own clock: pass clock= to "
            "InMemoryBackend(clock=...), not to the lock"
        )


def backend_of(client: object, options: Options) -> str:
    """The backend's name as events report it: ``"memory"``, ``"sqlite"``, or the detected one."""
    if isinstance(client, InMemoryBackend):
        return "memory"
    if isinstance(client, SQLiteBackend):
        return "sqlite"
    return detect(client, options.backend)


def _face_checked(client: object, found: str, options: Options, *, asynchronous: bool) -> None:
    """A Redis, PostgreSQL or MySQL client's names and face, checked before any request."""
    if found == "redis":
        check_redis_prefix(options.key_prefix, options.key_origin)
        face = "execute_command" if defines(client, "execute_command") else "eval"
    elif found == "postgresql":
        check_postgres_names(options.table_name, options.table_origin, options.schema_name)
        face = postgres_method(client) or "execute"
    else:
        check_mysql_names(options.table_name, options.table_origin, options.database_name)
        face = mysql_face(client, asynchronous)
    (refuse_sync if asynchronous else refuse_asyncio)(client, face, "client")


def _collection(client: object, options: Options, needed: str, *, asynchronous: bool) -> object:
    """The MongoDB collection of ``options``, its names and face checked; no I/O."""
    check_db_name(options.db_name)
    check_collection_name(options.collection_name, options.collection_origin, options.db_name)
    database = method(client, "get_database")(options.db_name)
    collection = method(database, "get_collection")(options.collection_name)
    (refuse_sync if asynchronous else refuse_asyncio)(collection, needed, "collection")
    return collection


def open_store(client: object, options: Options, *, asynchronous: bool) -> Store:
    """The store that serves ``options``' namespace through ``client``.

    Detects the backend, checks what depends on it (MongoDB's and
    PostgreSQL's and MySQL's names, the clock of an :class:`InMemoryBackend`, a client
    of the other face where its type tells), and makes no request: the only
    calls it makes are MongoDB's ``get_database`` and ``get_collection``,
    which do no I/O.
    """
    found = detect(client, options.backend)
    if options.replicas and found in _NOT_WAITED:
        raise InvalidArgumentError(
            f"replicas={options.replicas} is the Redis backend's option: {_NOT_WAITED[found]}"
        )
    if isinstance(client, InMemoryBackend):
        _check_memory(client, options)
        fencing = options.fencing is not False
        return MemoryStore(client, options.key_prefix, options.max_permits, fencing=fencing)
    clock = SYSTEM_CLOCK if options.clock is None else options.clock
    if isinstance(client, SQLiteBackend):
        quote(options.table_name)  # refuses a name SQLite cannot hold, before any request
        fencing = options.fencing is not False
        table, permits = options.table_name, options.max_permits
        return SQLiteStore(
            client, table, permits, clock, asynchronous=asynchronous, fencing=fencing
        )
    if found in ("redis", "postgresql", "mysql"):
        _face_checked(client, found, options, asynchronous=asynchronous)
    if found == "redis":
        prefix, permits = options.key_prefix, options.max_permits
        return RedisStore(
            client,
            prefix,
            permits,
            clock,
            fencing=options.fencing,
            replicas=options.replicas,
            replicas_ms=options.replicas_timeout_ms,
        )
    if found == "postgresql":
        fencing = options.fencing is not False
        table, schema, permits = options.table_name, options.schema_name, options.max_permits
        return PostgresStore(
            client, table, permits, clock, schema=schema, asynchronous=asynchronous, fencing=fencing
        )
    if found == "mysql":
        table, permits = options.table_name, options.max_permits
        return MySQLStore(
            client,
            table,
            permits,
            clock,
            database=options.database_name,
            asynchronous=asynchronous,
            fencing=options.fencing is not False,
        )
    collection = _collection(client, options, "update_one", asynchronous=asynchronous)
    return MongoStore(collection, options.max_permits, clock, fencing=options.fencing is True)


def open_readwrite_store(client: object, options: Options, *, asynchronous: bool) -> ReadWriteStore:
    """The store that serves ``options``' namespace of read-write locks through ``client``.

    Detects and checks as :func:`open_store` does, and makes no request.
    """
    found = detect(client, options.backend)
    if options.replicas and found in _NOT_WAITED:
        raise InvalidArgumentError(
            f"replicas={options.replicas} is the Redis backend's option: {_NOT_WAITED[found]}"
        )
    fencing = options.fencing is not False
    if isinstance(client, InMemoryBackend):
        _check_memory(client, options)
        return MemoryReadWriteStore(
            client, options.key_prefix, options.max_readers, fencing=fencing
        )
    clock = SYSTEM_CLOCK if options.clock is None else options.clock
    if isinstance(client, SQLiteBackend):
        quote(options.table_name)  # refuses a name SQLite cannot hold, before any request
        table, readers = options.table_name, options.max_readers
        return SQLiteReadWriteStore(
            client, table, readers, clock, asynchronous=asynchronous, fencing=fencing
        )
    if found in ("redis", "postgresql", "mysql"):
        _face_checked(client, found, options, asynchronous=asynchronous)
    if found == "redis":
        return RedisReadWriteStore(
            client,
            options.key_prefix,
            options.max_readers,
            clock,
            fencing=fencing,
            replicas=options.replicas,
            replicas_ms=options.replicas_timeout_ms,
        )
    if found == "postgresql":
        table, schema, readers = options.table_name, options.schema_name, options.max_readers
        return PostgresReadWriteStore(
            client, table, readers, clock, schema=schema, asynchronous=asynchronous, fencing=fencing
        )
    if found == "mysql":
        table, readers = options.table_name, options.max_readers
        return MySQLReadWriteStore(
            client,
            table,
            readers,
            clock,
            database=options.database_name,
            asynchronous=asynchronous,
            fencing=fencing,
        )
    collection = _collection(client, options, "find_one_and_update", asynchronous=asynchronous)
    readers = options.max_readers
    return MongoReadWriteStore(collection, readers, clock, fencing=fencing)


__all__ = [
    "InMemoryBackend",
    "SQLiteBackend",
    "Store",
    "backend_of",
    "open_readwrite_store",
    "open_store",
]

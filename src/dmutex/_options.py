"""Options: one instance's constructor arguments, checked once and resolved.

Both faces' constructors build one :class:`Options` and hand it, with the
client, to store opening (``dmutex._backends.open_store``). Nothing here
looks at the client: checks that depend on which backend it is (MongoDB's
naming rules, Redis's key prefixes) run when the store is opened.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ._clock import Clock
from ._validate import (
    BackendName,
    check_backend,
    check_clock,
    check_flag,
    check_max_permits,
    check_max_readers,
    check_replicas,
    check_replicas_timeout,
    check_str,
    check_ttl,
)

Kind = Literal["mutex", "semaphore", "readwrite"]

# The TypeScript library's defaults, per kind: collection and key prefixes
# (the read-write lock is dmutex's own, with a prefix of its own).
DEFAULT_PREFIX: dict[Kind, str] = {
    "mutex": "_dmutex_",
    "semaphore": "_dsemaphore_",
    "readwrite": "_drwlock_",
}


@dataclass(frozen=True, slots=True)
class Options:
    """The checked options of one DMutex/DSemaphore, sync or async.

    Build it with :meth:`check`, which raises ``TypeError``/``ValueError``
    for a bad argument before anything touches a client.
    """

    kind: Kind
    service_name: str
    max_permits: int
    default_ttl: float
    backend: BackendName | None
    db_name: str
    collection_name: str
    """The MongoDB collection: ``collection_name``, else prefix + service name."""
    collection_origin: str
    """Where :attr:`collection_name` came from, for error messages."""
    key_prefix: str
    """The Redis key prefix: ``key_prefix``, else ``f"{kind's prefix}{service_name}:"``."""
    key_origin: str
    """Where :attr:`key_prefix` came from, for error messages."""
    clock: Clock | None
    fencing: bool | None
    """``fencing=``: None keeps a fence where it costs no request (Redis, SQLite, memory)."""
    table_name: str
    """The SQLite, PostgreSQL or MySQL table: ``table_name``, else prefix + service name."""
    table_origin: str
    """Where :attr:`table_name` came from, for error messages."""
    schema_name: str | None
    """The PostgreSQL schema of the table; None: the connection's search path."""
    database_name: str | None
    """The MySQL database of the table; None: the connection's current database."""
    replicas: int
    """Redis: how many replicas must acknowledge a grant, extend or renewal (0: none)."""
    replicas_timeout_ms: int
    """Redis: how long the ``WAIT`` for them may last, in whole ms (at least 1)."""
    max_readers: int | None = None
    """A read-write lock's bound on readers at once; None: no bound."""
    identity: str | None = None
    """Who the leases say holds them; None: ``host:pid``, ``""``: nobody."""

    @classmethod
    def check(
        cls,
        kind: Kind,
        /,
        *,
        service_name: object,
        max_permits: object,
        default_ttl_seconds: object,
        db_name: object,
        collection_prefix: object,
        table_prefix: object,
        backend: object = None,
        collection_name: object = None,
        key_prefix: object = None,
        clock: object = None,
        fencing: object = None,
        table_name: object = None,
        schema_name: object = None,
        database_name: object = None,
        replicas: object = 0,
        replicas_timeout: object = 1.0,
        max_readers: object = None,
        identity: object = None,
    ) -> Options:
        """Check every argument, by the names of the constructors' parameters.

        Checked in the order the constructors' signatures give them, so the
        first bad argument is the one reported. The arguments with a default
        here are those whose constructors' default is None.
        """
        service = check_str("service_name", service_name)
        permits = check_max_permits(max_permits)
        default_ttl = check_ttl("default_ttl_seconds", default_ttl_seconds)
        chosen = check_backend(backend)
        database = check_str("db_name", db_name, allow_empty=True)
        prefix = check_str("collection_prefix", collection_prefix, allow_empty=True)
        if collection_name is None:
            collection = prefix + service
            origin = f"collection_prefix {prefix!r} + service_name {service!r}"
        else:
            collection = check_str("collection_name", collection_name, allow_empty=True)
            origin = "collection_name"
        if key_prefix is None:
            keys = f"{DEFAULT_PREFIX[kind]}{service}:"
            key_origin = f"service_name {service!r} (key_prefix {keys!r})"
        else:
            keys = check_str("key_prefix", key_prefix, allow_empty=True)
            key_origin = f"key_prefix {keys!r}"
        if table_name is None:
            table_start = check_str("table_prefix", table_prefix, allow_empty=True)
            table = table_start + service
            table_origin = f"table_prefix {table_start!r} + service_name {service!r}"
        else:
            table = check_str("table_name", table_name)
            table_origin = "table_name"
        schema = None if schema_name is None else check_str("schema_name", schema_name)
        database_of_table = (
            None if database_name is None else check_str("database_name", database_name)
        )
        waited_for = check_replicas(replicas)
        wait_ms = check_replicas_timeout(replicas_timeout)
        readers = None if max_readers is None else check_max_readers(max_readers)
        holder = None if identity is None else check_str("identity", identity, allow_empty=True)
        return cls(
            kind=kind,
            service_name=service,
            max_permits=permits,
            default_ttl=default_ttl,
            backend=chosen,
            db_name=database,
            collection_name=collection,
            collection_origin=origin,
            key_prefix=keys,
            key_origin=key_origin,
            clock=check_clock(clock),
            fencing=None if fencing is None else check_flag("fencing", fencing),
            table_name=table,
            table_origin=table_origin,
            schema_name=schema,
            database_name=database_of_table,
            replicas=waited_for,
            replicas_timeout_ms=wait_ms,
            max_readers=readers,
            identity=holder,
        )

"""The PostgreSQL backend as the registry sees it: its :class:`Descriptor`."""

from __future__ import annotations

from ..._clock import Clock
from ..._options import Options
from ..abc import Descriptor
from ..shapes import Packages, refuse_other_face
from ..sql.shapes import ASYNC_ENGINE
from ..sql.shapes import SYNC_PACKAGES as ENGINE_PACKAGES
from .names import check_postgres_names
from .readwrite import PostgresReadWriteStore
from .shapes import DIALECTS, face, recognises
from .store import PostgresStore
from .url import FORM

PACKAGES = Packages(
    sync=("psycopg", "psycopg_pool", *ENGINE_PACKAGES),
    asyncio=(
        "psycopg.AsyncConnection",
        "psycopg_pool.AsyncConnectionPool",
        "asyncpg",
        ASYNC_ENGINE,
    ),
)


def _checked(client: object, options: Options, asynchronous: bool) -> None:
    """The table's and schema's names and the client's face, checked before any request."""
    check_postgres_names(options.table_name, options.table_origin, options.schema_name)
    refuse_other_face(
        client, face(client, asynchronous), "client", PACKAGES, asynchronous=asynchronous
    )


def open_store(
    client: object, options: Options, clock: Clock, *, asynchronous: bool
) -> PostgresStore:
    """The table of ``options``' mutexes or semaphores."""
    _checked(client, options, asynchronous)
    return PostgresStore(
        client,
        options.table_name,
        options.max_permits,
        clock,
        schema=options.schema_name,
        asynchronous=asynchronous,
        fencing=options.fencing is not False,
    )


def open_readwrite_store(
    client: object, options: Options, clock: Clock, *, asynchronous: bool
) -> PostgresReadWriteStore:
    """The table of ``options``' read-write locks."""
    _checked(client, options, asynchronous)
    return PostgresReadWriteStore(
        client,
        options.table_name,
        options.max_readers,
        clock,
        schema=options.schema_name,
        asynchronous=asynchronous,
        fencing=options.fencing is not False,
    )


BACKEND = Descriptor(
    name="postgresql",
    label="PostgreSQL",
    recognises=recognises,
    open_store=open_store,
    open_readwrite_store=open_readwrite_store,
    needs=(
        "execute(query, params) and info (a psycopg 3 connection), getconn() and "
        "connection() (a psycopg_pool pool), fetch(query, *args) and fetchrow() "
        "(an asyncpg connection or pool), or raw_connection() and dialect (a SQLAlchemy "
        "Engine or AsyncEngine)"
    ),
    replicas=(
        "on PostgreSQL, configure synchronous replication on the server "
        "(synchronous_standby_names, synchronous_commit)"
    ),
    dialects=DIALECTS,
    url=FORM,
)
"""PostgreSQL (psycopg 3 and its pools, asyncpg, SQLAlchemy engines)."""

"""The MySQL and MariaDB backend as the registry sees it: its :class:`Descriptor`."""

from __future__ import annotations

from ..._clock import Clock
from ..._options import Options
from ..abc import Descriptor
from ..shapes import Packages, refuse_other_face
from ..sql.shapes import ASYNC_ENGINE
from ..sql.shapes import SYNC_PACKAGES as ENGINE_PACKAGES
from .names import check_mysql_names
from .readwrite import MySQLReadWriteStore
from .shapes import DIALECTS, face, recognises
from .store import MySQLStore
from .url import FORM

PACKAGES = Packages(
    sync=("pymysql", "MySQLdb", "mysql", *ENGINE_PACKAGES),
    asyncio=("aiomysql", "asyncmy", ASYNC_ENGINE),
)


def _checked(client: object, options: Options, asynchronous: bool) -> None:
    """The table's and database's names and the client's face, checked before any request."""
    check_mysql_names(options.table_name, options.table_origin, options.database_name)
    refuse_other_face(
        client, face(client, asynchronous), "client", PACKAGES, asynchronous=asynchronous
    )


def open_store(client: object, options: Options, clock: Clock, *, asynchronous: bool) -> MySQLStore:
    """The table of ``options``' mutexes or semaphores."""
    _checked(client, options, asynchronous)
    return MySQLStore(
        client,
        options.table_name,
        options.max_permits,
        clock,
        database=options.database_name,
        asynchronous=asynchronous,
        fencing=options.fencing is not False,
    )


def open_readwrite_store(
    client: object, options: Options, clock: Clock, *, asynchronous: bool
) -> MySQLReadWriteStore:
    """The table of ``options``' read-write locks."""
    _checked(client, options, asynchronous)
    return MySQLReadWriteStore(
        client,
        options.table_name,
        options.max_readers,
        clock,
        database=options.database_name,
        asynchronous=asynchronous,
        fencing=options.fencing is not False,
    )


BACKEND = Descriptor(
    name="mysql",
    label="MySQL",
    recognises=recognises,
    open_store=open_store,
    open_readwrite_store=open_readwrite_store,
    needs=(
        "cursor() and get_server_info() (a PyMySQL, mysqlclient, mysql-connector, aiomysql "
        "or asyncmy connection), get_connection() and pool_name (a mysql-connector pool), "
        "acquire() and freesize (an aiomysql or asyncmy pool), or raw_connection() "
        "and a mysql or mariadb dialect (a SQLAlchemy Engine or AsyncEngine)"
    ),
    replicas="on MySQL or MariaDB, configure semi-synchronous replication on the server",
    dialects=DIALECTS,
    url=FORM,
)
"""MySQL and MariaDB (PyMySQL, mysqlclient, mysql-connector, aiomysql, asyncmy, SQLAlchemy)."""

"""The real MySQL clients the static checks hand to the constructors.

Some need a server to be built (mysqlclient, the pools), so the typing files
only annotate them: the type checker's half.
``tests/integration/test_mysql_detection.py`` builds each (on the test server
where it must) and checks that detection agrees.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiomysql
import asyncmy
import mysql.connector.connection
import mysql.connector.pooling
import MySQLdb.connections
import pymysql.connections


@dataclass(frozen=True)
class MySQLClients:
    """One of each: the sync connections and pool, the asyncio connections and pools."""

    pymysql_conn: pymysql.connections.Connection[pymysql.cursors.Cursor]
    mysqldb_conn: MySQLdb.connections.Connection
    connector_conn: mysql.connector.connection.MySQLConnection
    connector_pool: mysql.connector.pooling.MySQLConnectionPool
    aiomysql_conn: aiomysql.Connection
    aiomysql_pool: aiomysql.Pool
    asyncmy_conn: asyncmy.Connection
    asyncmy_pool: asyncmy.Pool

"""Session-wide MariaDB/MySQL fixtures: the server ``mysql_servers.py`` finds or starts.

- ``mysql_session``: the session's
  :class:`~tests._support.mysql_servers.Session`; at the end the test
  database is dropped and the servers it started are stopped (by pid). Its
  ``fresh()`` empties the test database; its ``restartable()`` is a second
  server, from the executables, that a test may stop, kill and restart;
- ``mysql_server``: the URL of the server (``mysql://root@127.0.0.1:PORT/``
  when the tests started it), started on first use (or a skip saying why; a
  failure under ``DMUTEX_REQUIRE_MYSQL=1``);
- ``mysql_database``: the database the session's tests use on it
  (``dmutex_test_<12 hex>``): on a server the user names, the tests must not
  touch anything else.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._support import mysql_servers


def pytest_report_header() -> list[str]:
    """Which server the MySQL tests use, and what discovery passed over."""
    # Unchecked: DMUTEX_REQUIRE_MYSQL fails the tests that need a server, not the header.
    return mysql_servers.header()


@pytest.fixture(scope="session")
def mysql_session() -> Iterator[mysql_servers.Session]:
    """The session's MariaDB/MySQL server, started on first use."""
    session = mysql_servers.new_session()
    try:
        yield session
    finally:
        session.close()


@pytest.fixture(scope="session")
def mysql_server(mysql_session: mysql_servers.Session) -> str:
    """The URL of a real MariaDB/MySQL server (``mysql_servers.connect_args`` reads it)."""
    return mysql_session.server().url


@pytest.fixture(scope="session")
def mysql_database(mysql_session: mysql_servers.Session) -> str:
    """The database the session's tests use on ``mysql_server``, made at its start."""
    return mysql_session.server().database

"""Session-wide PostgreSQL fixtures: the server ``postgres_servers.py`` finds, and a PgBouncer.

- ``postgres_session``: the session's
  :class:`~tests._support.postgres_servers.Session`; at the end the pooler is
  stopped, the test schema dropped and the server stopped (each by its pid);
- ``postgres_server``: the URL of the direct server, started on first use (or
  a skip saying why; a failure under ``DMUTEX_REQUIRE_POSTGRESQL=1``);
- ``postgres_schema``: the schema the session's tests use on it
  (``dmutex_test_<random>``): on a server the user names, the tests must not
  touch anything else;
- ``pgbouncer_url``: the URL of the same database through PgBouncer in
  transaction mode, started on first use in front of that server.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._support import postgres_servers


def pytest_report_header() -> list[str]:
    """Which server and pooler the PostgreSQL tests use, and what discovery passed over."""
    # Unchecked: DMUTEX_REQUIRE_POSTGRESQL fails the tests that need a server, not the header.
    return postgres_servers.header()


@pytest.fixture(scope="session")
def postgres_session() -> Iterator[postgres_servers.Session]:
    """The session's PostgreSQL server and PgBouncer, each started on first use."""
    session = postgres_servers.new_session()
    try:
        yield session
    finally:
        session.close()


@pytest.fixture(scope="session")
def postgres_server(postgres_session: postgres_servers.Session) -> str:
    """The URL of a real PostgreSQL server (direct, no pooler)."""
    return postgres_session.server().url


@pytest.fixture(scope="session")
def postgres_schema(postgres_session: postgres_servers.Session) -> str:
    """The schema the session's tests use on ``postgres_server``, made at its start."""
    return postgres_session.server().schema


@pytest.fixture(scope="session")
def pgbouncer_url(postgres_session: postgres_servers.Session) -> str:
    """The URL of ``postgres_server``'s database through PgBouncer in transaction mode."""
    return postgres_session.bouncer().url

"""Session-wide fixtures of the servers that speak DynamoDB's protocol (``dynamodb_servers.py``).

Neither moto's server nor dynalite is DynamoDB; the user's endpoint
(``DMUTEX_DYNAMODB_URL``) may be.

- ``dynamodb_session``: the session's :class:`~tests._support.dynamodb_servers.Session`;
  ``dynamodb_session.server(kind)`` is the running server of a kind
  (``"moto"``, ``"dynalite"``, ``"url"``; none: the first found), started on
  first use, or a skip saying why there is none (a failure under
  ``DMUTEX_REQUIRE_DYNAMODB``). Its ``prefix`` (``dmutex-test-<12 hex>-``)
  starts the name of every table the tests make
  (``dynamodb_session.table_name("locks")``): on a user's endpoint they must
  not touch any other. At the end the prefix's tables are deleted there, and
  the servers started here are stopped (by their pids);
- ``dynamodb_server``: one running :class:`~tests._support.dynamodb_servers.Server`
  per kind the run tries (parametrized by kind: ``[moto]``, ``[dynalite]``,
  or ``[url]`` in moto's place; a kind not found is a case that skips saying
  why). ``dynamodb_server.client()`` is a sync boto3 client of it,
  ``dynamodb_server.client_args()`` what an aiobotocore client takes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._support import dynamodb_servers


def pytest_report_header() -> list[str]:
    """Which servers the tests of DynamoDB's protocol use, and what discovery passed over."""
    # Unchecked: DMUTEX_REQUIRE_DYNAMODB fails the tests that need a server, not the header.
    return dynamodb_servers.header()


@pytest.fixture(scope="session")
def dynamodb_session() -> Iterator[dynamodb_servers.Session]:
    """The session's servers, each started on first use, and the table prefix of its tests."""
    session = dynamodb_servers.new_session()
    try:
        yield session
    finally:
        session.close()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``dynamodb_server`` runs once per kind this run tries."""
    if "dynamodb_server" in metafunc.fixturenames:
        metafunc.parametrize(
            "dynamodb_server", dynamodb_servers.kinds(), indirect=True, scope="session"
        )


@pytest.fixture(scope="session")
def dynamodb_server(
    request: pytest.FixtureRequest, dynamodb_session: dynamodb_servers.Session
) -> dynamodb_servers.Server:
    """The running server of one kind (a skip, or a failure if required, when there is none)."""
    kind: str = request.param
    return dynamodb_session.server(kind)

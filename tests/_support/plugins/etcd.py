"""Session-wide etcd fixtures: the server ``etcd_servers.py`` finds or starts, and clusters.

- ``etcd_session``: the session's :class:`~tests._support.etcd_servers.Session`;
  its ``url`` (``http://127.0.0.1:PORT`` when the tests started it),
  ``host``, ``port``, ``endpoints`` and ``label`` (``etcd-3.4.23``) are the
  server's, started on first use (or a skip saying why; a failure under
  ``DMUTEX_REQUIRE_ETCD=1``); its ``prefix`` (``dmutex-test-<12 hex>/``) is
  where the tests keep every key: on a user's etcd they must not touch
  anything else. At the end the prefix is deleted and a server started here
  is stopped (by its pid);
- ``etcd_cluster``: a new three-member cluster for one test, from the
  executable, with a leader; closed after the test (every member by its pid,
  the folders removed). ``etcd_servers.fresh_cluster()`` is the same as a
  context manager, for a test that wants it for longer or shorter.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._support import etcd_servers


def pytest_report_header() -> list[str]:
    """Which etcd server the etcd tests use, and what discovery passed over."""
    # Unchecked: DMUTEX_REQUIRE_ETCD fails the tests that need a server, not the header.
    return etcd_servers.header()


@pytest.fixture(scope="session")
def etcd_session() -> Iterator[etcd_servers.Session]:
    """The session's etcd server, started on first use, and the key prefix of its tests."""
    session = etcd_servers.new_session()
    try:
        yield session
    finally:
        session.close()


@pytest.fixture
def etcd_cluster() -> Iterator[etcd_servers.Cluster]:
    """A new three-member etcd cluster with a leader, for one test; closed after it."""
    with etcd_servers.fresh_cluster() as cluster:
        yield cluster

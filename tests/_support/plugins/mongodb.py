"""Session-wide fixtures for the MongoDB test server (``mongo_servers.py``), and its deviations.

- ``mongo_session``: the session's
  :class:`~tests._support.mongo_servers.Session`, started on first use (or a
  skip saying why); at the end its test database is dropped and it is stopped;
- each test that :data:`~tests._support.mongo_servers.DEVIATIONS` lists for
  the session's server is marked strict xfail there, with the reason: it still
  runs, and fails the suite once it passes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._support import mongo_servers


def pytest_report_header() -> str:
    """Which server the MongoDB tests use, and what discovery passed over ("no mongod ...")."""
    # Unchecked: DMUTEX_REQUIRE_MONGODB fails the tests that need the server, not the header.
    return mongo_servers._discovered_once().header("MongoDB test server")


@pytest.fixture(scope="session")
def mongo_session() -> Iterator[mongo_servers.Session]:
    """A real MongoDB for the session, started on first use (or a skip saying why)."""
    session = mongo_servers.Session(mongo_servers.discovered())
    try:
        yield session
    finally:
        session.close()


def _runs_on(item: pytest.Item, label: str) -> bool:
    """Whether a parameter of ``item`` names server ``label`` ("label", "...@label")."""
    callspec = getattr(item, "callspec", None)
    params = callspec.params.values() if callspec is not None else ()
    return any(isinstance(p, str) and (p == label or p.endswith(f"@{label}")) for p in params)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Strict xfail, with the reason, for each test in ``mongo_servers.DEVIATIONS``."""
    label = mongo_servers.mongo_label()
    for item in items:
        name = getattr(item, "originalname", item.name)
        reason = mongo_servers.deviation(label, name)
        if reason is not None and _runs_on(item, label):
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))

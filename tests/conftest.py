"""Session-wide fixtures: real Redis and MongoDB servers (``tests/_support/*_servers.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests._support import mongo_servers
from tests._support.redis_servers import Pool, Server, discovered


@pytest.fixture(scope="session")
def redis_pool() -> Iterator[Pool]:
    """Every Redis server the tests may use; each starts on first use."""
    pool = Pool(discovered())
    try:
        yield pool
    finally:
        pool.close()


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


def redis_labels() -> list[str]:
    """The server labels to parametrize over, or ``[""]`` meaning: skip."""
    return discovered().labels or [""]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "redis_server" in metafunc.fixturenames:
        metafunc.parametrize("redis_server", redis_labels(), indirect=True, scope="session")


def server_or_skip(pool: Pool, label: str) -> Server:
    """The running server for ``label``, or skip with discovery's one-line reason."""
    if not label:
        pytest.skip(pool.discovery.reason)
    return pool.server(label)


@pytest.fixture(scope="session")
def redis_server(request: pytest.FixtureRequest, redis_pool: Pool) -> Server:
    """One real Redis server per discovered version."""
    label: str = request.param
    return server_or_skip(redis_pool, label)


@pytest.fixture
def redis_url(redis_server: Server) -> str:
    """The URL of ``redis_server``, with its database emptied for this test."""
    with redis.Redis.from_url(redis_server.url) as client:
        client.flushdb()
    return redis_server.url

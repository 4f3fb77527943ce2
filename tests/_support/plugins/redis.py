"""Session-wide Redis fixtures: every server ``redis_servers.py`` finds, each started on first use.

- ``redis_pool``: the session's :class:`~tests._support.redis_servers.Pool`,
  closed (each server stopped by pid) at the end;
- ``redis_server``: one real server, a test per version found (parametrized
  by label; with none found, one case that skips with discovery's reason);
- ``redis_url``: the URL of ``redis_server``, its database emptied first;
- ``server``: a sync client of ``redis_url`` that reads strings. A test module
  that needs another ``server`` defines its own, which overrides this one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests._support import redis_servers
from tests._support.redis_servers import (
    Pool,
    Server,
    discovered,
    flushed,
    labels_or_skip,
    server_or_skip,
)


def pytest_report_header() -> str:
    """Which Redis servers the run uses, and what discovery passed over ("no Docker ...")."""
    # Unchecked: a version DMUTEX_REQUIRE_REDIS misses fails the tests, not the header.
    return redis_servers._discovered_once().header("redis servers")


@pytest.fixture(scope="session")
def redis_pool() -> Iterator[Pool]:
    """Every Redis server the tests may use; each starts on first use."""
    pool = Pool(discovered())
    try:
        yield pool
    finally:
        pool.close()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``redis_server`` runs once per server version found."""
    if "redis_server" in metafunc.fixturenames:
        metafunc.parametrize("redis_server", labels_or_skip(), indirect=True, scope="session")


@pytest.fixture(scope="session")
def redis_server(request: pytest.FixtureRequest, redis_pool: Pool) -> Server:
    """One real Redis server per discovered version."""
    label: str = request.param
    return server_or_skip(redis_pool, label)


@pytest.fixture
def redis_url(redis_server: Server) -> str:
    """The URL of ``redis_server``, with its database emptied for this test."""
    return flushed(redis_server.url)


@pytest.fixture
def server(redis_url: str) -> Iterator[redis.Redis]:
    """A sync client of ``redis_url`` (an empty database) that decodes replies to ``str``."""
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        yield client

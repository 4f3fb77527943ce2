"""The backends the contract suite runs against.

Each case makes clients for one backend and one face. Later backends add a
case here; the tests in this folder do not change.

Redis cases: every client package of ``tests/_support/redis_clients.py`` on
the newest server found, fakeredis, and redis-py on every other server
version found (see ``tests/_support/redis_servers.py``).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from functools import partial
from typing import Any

import mongomock
import pytest
import redis

import dmutex._backends
from dmutex import InMemoryBackend, ManualClock
from tests._support.faces import Face, FaceName, Kind, LoopThread
from tests._support.mongo_clients import AsyncMongomockClient, frozen_ttl_monitor
from tests._support.mongo_servers import AsyncRedirectedClient, RedirectedClient, mongo_label
from tests._support.mongo_servers import Session as MongoSession
from tests._support.redis_clients import SERVER_VARIANTS, Made, close_made, fake_pair
from tests._support.redis_servers import Pool, discovered
from tests.conftest import server_or_skip


@dataclass
class Env:
    """One backend, one face: makes instances over a shared client."""

    face: FaceName
    client: object
    clock: ManualClock | None
    expire_fn: Callable[[str, int | None], None]
    loop: LoopThread | None = None
    closers: list[Made] = field(default_factory=list)

    def make(self, kind: Kind, **options: Any) -> Face:
        return Face(self.face, kind, self.client, loop=self.loop, **options)

    def expire(self, key: str, slot: int | None = None) -> None:
        """Make the permits of ``key`` expire now (in every namespace)."""
        self.expire_fn(key, slot)

    def need_clock(self) -> ManualClock:
        """The ManualClock; tests calling this carry the ``manual_clock`` mark."""
        assert self.clock is not None, "mark the test with @pytest.mark.manual_clock"
        return self.clock

    def now(self) -> datetime:
        """The time expiries are computed from, as an aware UTC datetime."""
        if self.clock is not None:
            return self.clock.now()
        return datetime.now(timezone.utc)

    def assert_expiry(
        self, before: datetime, after: datetime, expired_at: datetime, ttl: float
    ) -> None:
        """``expired_at`` is ``now + ttl`` for some now read between ``before`` and ``after``.

        Exact on a ManualClock; on real time, within the millisecond that
        expiries are rounded to.
        """
        slack = timedelta(0) if self.clock is not None else timedelta(milliseconds=1)
        lease = timedelta(seconds=ttl)
        assert before + lease - slack <= expired_at <= after + lease + slack


def _memory(face: FaceName) -> Env:
    clock = ManualClock()
    backend = InMemoryBackend(clock=clock)

    def expire(key: str, slot: int | None) -> None:
        backend.force_expire(key, slot)

    return Env(face, backend, clock, expire)


def redis_expirer(inspector: redis.Redis) -> Callable[[str, int | None], None]:
    """Expire slot keys of ``key`` on the server: an expiry in the past deletes them."""

    def expire(key: str, slot: int | None) -> None:
        pattern = f"*permit:{'*' if slot is None else slot}:{key}"
        for name in inspector.keys(pattern):
            inspector.pexpireat(name, 1)

    return expire


def _redis_env(face: FaceName, made: Made, inspector: redis.Redis) -> Env:
    env = Env(face, made.client, None, redis_expirer(inspector))
    env.closers.append(made)
    env.closers.append(Made(inspector, inspector.close))
    return env


def _mongomock(face: FaceName) -> Env:
    """mongomock (an in-memory imitation of pymongo, not a server) on a ManualClock."""
    clock = ManualClock()
    client: mongomock.MongoClient[dict[str, object]] = mongomock.MongoClient()

    def expire(key: str, slot: int | None) -> None:
        # Set expiredAt to now: the record stays, as on a server before its TTL
        # monitor runs, so the next acquire takes it over.
        pattern = f"^permit:{'[0-9]+' if slot is None else slot}:{re.escape(key)}$"
        now = clock.now()
        for name in client.get_database("dmutex").list_collection_names():
            client.get_database("dmutex").get_collection(name).update_many(
                {"_id": {"$regex": pattern}, "expiredAt": {"$gt": now}},
                {"$set": {"expiredAt": now}},
            )

    made = AsyncMongomockClient(client) if face == "async" else client
    return Env(face, made, clock, expire)


def _mongomock_case(face: FaceName, servers: Servers) -> Env:
    return _mongomock(face)


@dataclass
class Servers:
    """The real servers a case may need; each starts (or skips) on first use."""

    redis: Pool
    mongo: MongoSession


def _real_mongo(face: FaceName, servers: Servers) -> Env:
    """pymongo against a real MongoDB (skips with one line where there is none)."""
    server = servers.mongo.fresh()
    database = servers.mongo.admin.get_database(servers.mongo.db_name)

    def expire(key: str, slot: int | None) -> None:
        pattern = f"^permit:{'[0-9]+' if slot is None else slot}:{re.escape(key)}$"
        now = datetime.now(timezone.utc)
        for name in database.list_collection_names():
            database.get_collection(name).update_many(
                {"_id": {"$regex": pattern}, "expiredAt": {"$gt": now}},
                {"$set": {"expiredAt": now}},
            )

    if face == "sync":
        return Env(face, RedirectedClient(servers.mongo.admin, server.db_name), None, expire)
    inner = server.async_client()
    env = Env(face, AsyncRedirectedClient(inner, server.db_name), None, expire)
    env.closers.append(Made(inner, inner.close))
    return env


Case = Callable[[Servers], Env]


def _server_case(label: str, variant: str, face: FaceName) -> Case:
    def make(servers: Servers) -> Env:
        server = server_or_skip(servers.redis, label)
        inspector = redis.Redis.from_url(server.url, decode_responses=True)
        inspector.flushdb()
        maker = SERVER_VARIANTS[variant][face == "async"]
        return _redis_env(face, maker(server.url), inspector)

    return make


def _fake_case(face: FaceName) -> Case:
    def make(servers: Servers) -> Env:
        made, inspector = fake_pair(face == "async")
        return _redis_env(face, made, inspector)

    return make


def _cases() -> dict[str, Case]:
    cases: dict[str, Case] = {
        "memory-sync": lambda servers: _memory("sync"),
        "memory-async": lambda servers: _memory("async"),
    }
    faces: tuple[FaceName, ...] = ("sync", "async")
    for face in faces:
        cases[f"fakeredis-{face}"] = _fake_case(face)
        cases[f"mongomock-{face}"] = partial(_mongomock_case, face)
        cases[f"pymongo-{face}@{mongo_label()}"] = partial(_real_mongo, face)
    labels = discovered().labels or [""]  # "": skip with discovery's reason
    newest, others = labels[-1], labels[:-1]
    for face in faces:
        for variant in SERVER_VARIANTS:
            cases[f"{variant}-{face}@{newest or 'no-server'}"] = _server_case(newest, variant, face)
        for label in others:
            cases[f"redis-py-{face}@{label}"] = _server_case(label, "redis-py", face)
    return cases


CASES = _cases()
MANUAL_CLOCK_CASES = ("memory-async", "memory-sync", "mongomock-async", "mongomock-sync")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests that move time (``manual_clock`` mark) run on the ManualClock cases only."""
    if "env" in metafunc.fixturenames:
        moves_time = metafunc.definition.get_closest_marker("manual_clock") is not None
        names = MANUAL_CLOCK_CASES if moves_time else sorted(CASES)
        metafunc.parametrize("env", names, indirect=True)


@pytest.fixture
def env(
    request: pytest.FixtureRequest,
    redis_pool: Pool,
    mongo_session: MongoSession,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Env]:
    made = CASES[request.param](Servers(redis_pool, mongo_session))
    if made.clock is not None:
        # MongoDB leases are timed by the client's clock: let the test move it.
        clock = made.clock
        monkeypatch.setattr(dmutex._backends, "_mongo_clock", lambda: clock)
        monkeypatch.setattr(mongomock, "utcnow", frozen_ttl_monitor)
    if made.face == "async":
        made.loop = LoopThread()
    try:
        yield made
    finally:
        loop = made.loop

        def run(awaitable: Awaitable[object]) -> object:
            assert loop is not None

            async def wait() -> object:
                return await awaitable

            return loop.run(wait())

        for closer in made.closers:
            close_made(closer, run)
        if loop is not None:
            loop.close()

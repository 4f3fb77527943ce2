"""What the state machine needs from a backend, and the InMemoryBackend's answer.

A harness makes clients, forces a permit to expire, reads what storage holds,
and cleans up. The Redis and MongoDB issues add a harness each; the state
machine does not change.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import mongomock
import redis

from dmutex import InMemoryBackend, ManualClock
from tests._support.mongo_clients import AsyncMongomockClient, frozen_ttl_monitor
from tests._support.redis_clients import SERVER_VARIANTS, Made, close_made

Runner = Callable[[Awaitable[object]], object]


class Harness(Protocol):
    clock: ManualClock | None
    """A clock the machine may move, or None where the backend keeps real time."""

    ttls: tuple[float, ...]
    """Lease lengths (seconds) to draw from; whole milliseconds each."""

    def client(self, asynchronous: bool) -> object:
        """A client for the sync or the asyncio classes; all share one storage."""
        ...

    def force_expire(self, prefix: str, key: str, slot: int) -> None:
        """Make the permit in ``slot`` of ``key`` expire now, wherever it is stored."""
        ...

    def active(self, prefix: str) -> dict[str, str]:
        """Active permits under ``prefix``: storage key -> token."""
        ...

    def close(self, run: Runner | None) -> None:
        """Release whatever the harness holds; ``run`` awaits on the async face's loop."""
        ...


class MemoryHarness:
    """InMemoryBackend on a ManualClock."""

    ttls: tuple[float, ...] = (0.001, 0.25, 1.5, 30.0)

    def __init__(self) -> None:
        self.clock: ManualClock | None = ManualClock()
        self._backend = InMemoryBackend(clock=self.clock)

    def client(self, asynchronous: bool) -> object:
        return self._backend

    def force_expire(self, prefix: str, key: str, slot: int) -> None:
        self._backend.force_expire(key, slot)

    def active(self, prefix: str) -> dict[str, str]:
        return {
            name: token
            for name, (token, _) in self._backend.snapshot().items()
            if name.startswith(prefix)
        }

    def close(self, run: Runner | None) -> None:
        pass


class RedisHarness:
    """A real Redis server, in real time, through one client package.

    Leases are long enough (30 s and more) that none runs out during an
    example; expiry is forced by giving the slot key an expiry in the past,
    which makes the server delete it.
    """

    clock: ManualClock | None = None
    ttls: tuple[float, ...] = (30.0, 61.5, 90.001)

    def __init__(self, url: str, variant: str = "redis-py") -> None:
        self._url = url
        self._variant = variant
        self._made: list[Made] = []
        self._server = redis.Redis.from_url(url, decode_responses=True)
        self._server.flushdb()

    def client(self, asynchronous: bool) -> object:
        made = SERVER_VARIANTS[self._variant][asynchronous](self._url)
        self._made.append(made)
        return made.client

    def force_expire(self, prefix: str, key: str, slot: int) -> None:
        self._server.pexpireat(f"{prefix}permit:{slot}:{key}", 1)

    def active(self, prefix: str) -> dict[str, str]:
        # The client decodes replies to str; a key may expire between KEYS and GET.
        names = self._server.keys(f"{prefix}permit:*")
        found = {str(name): self._server.get(name) for name in names}
        return {name: str(token) for name, token in found.items() if token is not None}

    def close(self, run: Runner | None) -> None:
        for made in self._made:
            close_made(made, run)
        self._server.close()


class MongomockHarness:
    """mongomock (an imitation of pymongo, not a server) on a ManualClock.

    MongoDB leases are timed by the client's clock, so the machine may move
    time here. The TTL monitor never runs: expired records stay stored, and
    force-expiry sets ``expiredAt`` to now, so takeover of a stored record is
    what gets exercised.
    """

    ttls: tuple[float, ...] = MemoryHarness.ttls

    def __init__(self) -> None:
        self.clock: ManualClock | None = ManualClock()
        self._client: mongomock.MongoClient[dict[str, object]] = mongomock.MongoClient()
        # mongomock's type stubs do not declare utcnow, its documented test hook.
        self._saved = getattr(mongomock, "utcnow")  # noqa: B009
        setattr(mongomock, "utcnow", frozen_ttl_monitor)  # noqa: B010

    def client(self, asynchronous: bool) -> object:
        return AsyncMongomockClient(self._client) if asynchronous else self._client

    def _collection(self, prefix: str) -> mongomock.Collection[dict[str, object]]:
        # The machine's instances use the defaults: the collection is the
        # Redis-style prefix without its colon (_dmutex_svc, _dsemaphore_svc).
        return self._client.get_database("dmutex").get_collection(prefix.rstrip(":"))

    def force_expire(self, prefix: str, key: str, slot: int) -> None:
        assert self.clock is not None
        now = self.clock.now()
        self._collection(prefix).update_one(
            {"_id": f"permit:{slot}:{key}", "expiredAt": {"$gt": now}},
            {"$set": {"expiredAt": now}},
        )

    def active(self, prefix: str) -> dict[str, str]:
        assert self.clock is not None
        found = self._collection(prefix).find({"expiredAt": {"$gt": self.clock.now()}})
        return {f"{prefix}{doc['_id']}": str(doc["value"]) for doc in found}

    def close(self, run: Runner | None) -> None:
        setattr(mongomock, "utcnow", self._saved)  # noqa: B010

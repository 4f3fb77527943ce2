"""MongoDB clients for tests that have no server: mongomock, and an asyncio face over it.

mongomock imitates pymongo in memory; it is not a MongoDB server. The async
wrappers only await mongomock's answers, so that the Async classes can be run
over the same semantics.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import mongomock

# mongomock imitates the TTL monitor on every read, by its own clock. Tests
# move a ManualClock instead, and want expired records to stay (as on a server
# whose monitor has not run yet, the case dmutex itself must handle): patch
# mongomock.utcnow with this, a monitor that never runs.
TTL_MONITOR_NEVER_RUNS = datetime(1970, 1, 1)


def frozen_ttl_monitor() -> datetime:
    """What mongomock.utcnow returns under test: the epoch, so nothing is TTL-expired."""
    return TTL_MONITOR_NEVER_RUNS


class AsyncMongomockCursor:
    """The documents of a find, handed over by ``await cursor.to_list(None)``."""

    def __init__(self, docs: list[Any]) -> None:
        self.docs = docs

    async def to_list(self, length: int | None, /) -> list[Any]:
        return self.docs if length is None else self.docs[:length]


class AsyncMongomockCollection:
    """``update_one`` and friends as coroutines, over a mongomock collection."""

    def __init__(self, inner: mongomock.Collection[Any]) -> None:
        self.inner = inner

    async def create_index(self, keys: Any, /, *, expireAfterSeconds: int) -> object:
        return self.inner.create_index(keys, expireAfterSeconds=expireAfterSeconds)

    async def update_one(self, filter: Any, update: Any, /, *, upsert: bool = False) -> Any:
        return self.inner.update_one(filter, update, upsert=upsert)

    async def delete_one(self, filter: Any, /) -> Any:
        return self.inner.delete_one(filter)

    async def distinct(self, key: str, filter: Any, /) -> list[object]:
        found: list[object] = self.inner.distinct(key, filter)
        return found

    async def find_one(self, filter: Any, /) -> Any:
        return self.inner.find_one(filter)

    def find(self, filter: Any, /) -> AsyncMongomockCursor:
        """A cursor read by ``to_list``, as motor's and PyMongo's asyncio cursors are."""
        return AsyncMongomockCursor(list(self.inner.find(filter)))

    async def find_one_and_update(
        self, filter: Any, update: Any, /, *, upsert: bool = False, return_document: bool = False
    ) -> Any:
        return self.inner.find_one_and_update(
            filter, update, upsert=upsert, return_document=return_document
        )


class AsyncMongomockDatabase:
    def __init__(self, inner: mongomock.Database[Any]) -> None:
        self.inner = inner

    def get_collection(self, name: str, /) -> AsyncMongomockCollection:
        return AsyncMongomockCollection(self.inner.get_collection(name))


class AsyncMongomockClient:
    """An asyncio-shaped client over a mongomock client (shares its data)."""

    def __init__(self, inner: mongomock.MongoClient[Any]) -> None:
        self.inner = inner

    def get_database(self, name: str, /) -> AsyncMongomockDatabase:
        return AsyncMongomockDatabase(self.inner.get_database(name))

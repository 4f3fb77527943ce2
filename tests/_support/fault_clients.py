"""Client doubles and wrappers for the fault tests (``tests/faults``).

Recording doubles (``tests/faults/test_parameters.py``): each answers as a
free server would and records every request that reaches it in a
:class:`Recorder`, so that a test can tell whether an operation that raised
had sent anything first.

- Redis: :class:`RecordingRedis` / :class:`AsyncRecordingRedis` are fakeredis
  clients (so real ``redis.Redis`` / ``redis.asyncio.Redis`` instances, with
  fakeredis's Lua) whose ``execute_command`` records each command before
  running it. A command that cannot be encoded fails in redis-py's encoder,
  as it would on the wire.
- MongoDB: :class:`RecordingMongo` / :class:`AsyncRecordingMongo` over
  mongomock. ``get_database`` / ``get_collection`` do no I/O, as pymongo's do:
  they are recorded as *lookups*, not requests, and apply pymongo's own
  name checks (raising pymongo's ``InvalidName`` as pymongo does). Every
  collection method is a request: recorded, then its arguments and namespace
  are BSON/UTF-8 encoded as the driver would (so a lone surrogate fails
  there, as in pymongo), then mongomock answers.

The cancellation wrapper (``tests/faults/test_cancellation.py``):
:class:`DelayingRedis` awaits a random short sleep before and after handing
each command to a real asyncio client, and notes in which phase a
cancellation landed: before the request was sent, while it was in flight,
or after the server had answered but before the reply was returned.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import bson
import fakeredis
import mongomock
import redis.asyncio
from pymongo.errors import InvalidName

# --- recording doubles --------------------------------------------------------------


@dataclass
class Recorder:
    """What reached a double: requests (I/O on a real client) and lookups (no I/O)."""

    requests: list[tuple[object, ...]] = field(default_factory=list)
    lookups: list[tuple[object, ...]] = field(default_factory=list)


class RecordingRedis(fakeredis.FakeRedis):
    """A sync redis-py client on a fake server that records every command first."""

    def __init__(self, recorder: Recorder, server: fakeredis.FakeServer) -> None:
        super().__init__(server=server)
        self.recorder = recorder

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.recorder.requests.append(args)
        # redis-py leaves execute_command unannotated: called as a Callable.
        execute: Callable[..., Any] = super().execute_command
        return execute(*args, **options)


class AsyncRecordingRedis(fakeredis.FakeAsyncRedis):
    """A ``redis.asyncio`` client on a fake server that records every command first."""

    def __init__(self, recorder: Recorder, server: fakeredis.FakeServer) -> None:
        super().__init__(server=server)
        self.recorder = recorder

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        self.recorder.requests.append(args)
        # redis-py leaves execute_command unannotated: called as a Callable.
        execute: Callable[..., Awaitable[Any]] = super().execute_command
        return await execute(*args, **options)


def check_database_name(name: object) -> str:
    """pymongo's checks of a database name (``pymongo.database_shared._check_name``)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be an instance of str, not {type(name)}")
    if not name:
        raise InvalidName("database name cannot be the empty string")
    for char in (" ", ".", "$", "/", "\\", "\x00", '"'):
        if char in name:
            raise InvalidName(f"database names cannot contain the character {char!r}")
    return name


def check_collection_name(name: object) -> str:
    """pymongo's checks of a collection name (``Collection.__init__``)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be an instance of str, not {type(name)}")
    if not name or ".." in name:
        raise InvalidName("collection names cannot be empty")
    if "$" in name and not name.startswith(("oplog.$main", "$cmd")):
        raise InvalidName(f"collection names must not contain '$': {name!r}")
    if name[0] == "." or name[-1] == ".":
        raise InvalidName(f"collection names must not start or end with '.': {name!r}")
    if "\x00" in name:
        raise InvalidName("collection names must not contain the null character")
    return name


class _CollectionCore:
    """Records a request, encodes it as the driver would, then asks mongomock."""

    def __init__(
        self, inner: mongomock.Collection[Any], namespace: str, recorder: Recorder
    ) -> None:
        self.inner = inner
        self.namespace = namespace
        self.recorder = recorder

    def _request(self, name: str, args: tuple[Any, ...], options: dict[str, Any]) -> Any:
        self.recorder.requests.append((name, *args))
        # What pymongo does before a byte leaves: the namespace and the
        # command are encoded (UTF-8, strict; BSON).
        self.namespace.encode("utf-8")
        bson.encode({"args": list(args), "options": options})
        return getattr(self.inner, name)(*args, **options)


class RecordingMongoCollection(_CollectionCore):
    """A sync collection: every method is one recorded request."""

    def create_index(self, *args: Any, **options: Any) -> Any:
        return self._request("create_index", args, options)

    def insert_one(self, *args: Any, **options: Any) -> Any:
        return self._request("insert_one", args, options)

    def update_one(self, *args: Any, **options: Any) -> Any:
        return self._request("update_one", args, options)

    def update_many(self, *args: Any, **options: Any) -> Any:
        return self._request("update_many", args, options)

    def delete_one(self, *args: Any, **options: Any) -> Any:
        return self._request("delete_one", args, options)

    def delete_many(self, *args: Any, **options: Any) -> Any:
        return self._request("delete_many", args, options)

    def find_one(self, *args: Any, **options: Any) -> Any:
        return self._request("find_one", args, options)

    def find_one_and_update(self, *args: Any, **options: Any) -> Any:
        return self._request("find_one_and_update", args, options)

    def distinct(self, *args: Any, **options: Any) -> Any:
        return self._request("distinct", args, options)


class AsyncRecordingMongoCollection(_CollectionCore):
    """An asyncio collection: every coroutine method is one recorded request."""

    async def create_index(self, *args: Any, **options: Any) -> Any:
        return self._request("create_index", args, options)

    async def insert_one(self, *args: Any, **options: Any) -> Any:
        return self._request("insert_one", args, options)

    async def update_one(self, *args: Any, **options: Any) -> Any:
        return self._request("update_one", args, options)

    async def update_many(self, *args: Any, **options: Any) -> Any:
        return self._request("update_many", args, options)

    async def delete_one(self, *args: Any, **options: Any) -> Any:
        return self._request("delete_one", args, options)

    async def delete_many(self, *args: Any, **options: Any) -> Any:
        return self._request("delete_many", args, options)

    async def find_one(self, *args: Any, **options: Any) -> Any:
        return self._request("find_one", args, options)

    async def find_one_and_update(self, *args: Any, **options: Any) -> Any:
        return self._request("find_one_and_update", args, options)

    async def distinct(self, *args: Any, **options: Any) -> Any:
        return self._request("distinct", args, options)


class _MongoCore:
    """A client that is its own lookups: ``get_database`` then ``get_collection``."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.inner: mongomock.MongoClient[dict[str, Any]] = mongomock.MongoClient()
        self.collections: list[_CollectionCore] = []

    def _collection(self, database: str, name: object) -> mongomock.Collection[Any]:
        self.recorder.lookups.append(("get_collection", name))
        checked = check_collection_name(name)
        return self.inner.get_database(database).get_collection(checked)

    def active(self, now: float) -> int:
        """How many documents of the collections handed out are active at ``now`` (epoch s)."""
        when = {"expiredAt": {"$gt": datetime.fromtimestamp(now, timezone.utc)}}
        return sum(core.inner.count_documents(when) for core in self.collections)

    def reset(self) -> None:
        """Empty every collection handed out: the server is free again."""
        for core in self.collections:
            core.inner.delete_many({})


class RecordingMongo(_MongoCore):
    """A sync Mongo-shaped client over mongomock that records what reaches it."""

    def get_database(self, name: object) -> RecordingMongoDatabase:
        self.recorder.lookups.append(("get_database", name))
        return RecordingMongoDatabase(self, check_database_name(name))


class RecordingMongoDatabase:
    def __init__(self, client: RecordingMongo, name: str) -> None:
        self._client = client
        self._name = name

    def get_collection(self, name: object) -> RecordingMongoCollection:
        inner = self._client._collection(self._name, name)
        made = RecordingMongoCollection(inner, f"{self._name}.{name}", self._client.recorder)
        self._client.collections.append(made)
        return made


class AsyncRecordingMongo(_MongoCore):
    """The asyncio twin of :class:`RecordingMongo` (lookups sync, requests coroutines)."""

    def get_database(self, name: object) -> AsyncRecordingMongoDatabase:
        self.recorder.lookups.append(("get_database", name))
        return AsyncRecordingMongoDatabase(self, check_database_name(name))


class AsyncRecordingMongoDatabase:
    def __init__(self, client: AsyncRecordingMongo, name: str) -> None:
        self._client = client
        self._name = name

    def get_collection(self, name: object) -> AsyncRecordingMongoCollection:
        inner = self._client._collection(self._name, name)
        made = AsyncRecordingMongoCollection(inner, f"{self._name}.{name}", self._client.recorder)
        self._client.collections.append(made)
        return made


# --- the delaying wrapper -----------------------------------------------------------

PHASES = ("before", "in-flight", "after")
"""Where a cancellation can land in one command: before it is sent, while the
client awaits the server, after the server answered but before the reply is
returned to dmutex."""


class DelayingRedis:
    """An asyncio Redis-shaped client that sleeps before and after each command.

    Delegates ``execute_command`` to a real ``redis.asyncio.Redis``. Each sleep
    lasts ``uniform(0, max_delay)`` seconds from ``rng``. ``on_send(args)`` is
    called as a command is handed to the real client; when a cancellation
    lands inside a command, ``on_cancel(phase, args)`` is called with the
    phase (one of :data:`PHASES`) before the ``CancelledError`` goes on.
    """

    def __init__(
        self,
        inner: redis.asyncio.Redis,
        rng: random.Random,
        max_delay: float,
        on_send: Callable[[tuple[object, ...]], None],
        on_cancel: Callable[[str, tuple[object, ...]], None],
    ) -> None:
        # redis-py leaves execute_command unannotated: called as a Callable.
        self._execute: Callable[..., Awaitable[Any]] = inner.execute_command
        self._rng = rng
        self._max_delay = max_delay
        self._on_send = on_send
        self._on_cancel = on_cancel
        self.sent: Counter[str] = Counter()
        """Commands handed to the real client, by name."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        phase = PHASES[0]
        try:
            await asyncio.sleep(self._rng.uniform(0, self._max_delay))
            phase = PHASES[1]
            self.sent[str(args[0])] += 1
            self._on_send(args)
            reply = await self._execute(*args, **options)
            phase = PHASES[2]
            await asyncio.sleep(self._rng.uniform(0, self._max_delay))
        except asyncio.CancelledError:
            self._on_cancel(phase, args)
            raise
        return reply

"""Client doubles and wrappers for the fault tests (``tests/faults``).

Recording doubles (``tests/faults/cancellation/test_parameters.py``): each answers as a
free server would and records every request that reaches it in a
:class:`Recorder`, so that a test can tell whether an operation that raised
had sent anything first.

- Redis: :func:`recording_redis` / :func:`async_recording_redis` are
  fakeredis clients (real ``redis.Redis`` / ``redis.asyncio.Redis``
  instances, untouched, with fakeredis's Lua) whose connections record each
  command they send (the connection handshake included). A command that
  cannot be encoded fails in redis-py's encoder, as it would on the wire.
- MongoDB: :class:`RecordingMongo`, a real ``pymongo.MongoClient`` or
  ``AsyncMongoClient`` that never connects. ``get_database`` /
  ``get_collection`` are pymongo's (with its name checks: ``InvalidName``),
  recorded as *lookups*: they do no I/O. Every collection method is a
  request: recorded, then its arguments and namespace are BSON/UTF-8 encoded
  as the driver would (so a lone surrogate fails there, as in pymongo), then
  mongomock answers.

Both keep the client's own types, so that dmutex sees what an application
would pass it (a sync redis-py or pymongo client given to an asyncio class
is recognisable as one).

The cancellation wrapper (``tests/faults/cancellation/test_cancellation.py``):
:class:`DelayingRedis` awaits a random short sleep before and after handing
each command to a real asyncio client, and says which phase each command is
in, so that a test can tell where a cancellation landed: before the request
was sent, while it was in flight, or after the server had answered but
before the reply was returned.
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
import pymongo
import redis.asyncio

# --- recording doubles --------------------------------------------------------------


@dataclass
class Recorder:
    """What reached a double: requests (I/O on a real client) and lookups (no I/O)."""

    requests: list[tuple[object, ...]] = field(default_factory=list)
    lookups: list[tuple[object, ...]] = field(default_factory=list)


def recording_redis(recorder: Recorder, server: fakeredis.FakeServer) -> fakeredis.FakeRedis:
    """A sync redis-py client on ``server`` that records each command its connection sends."""

    class Connection(fakeredis.FakeRedisConnection):
        def send_command(self, *args: Any, **options: Any) -> None:
            recorder.requests.append(args)
            # redis-py leaves send_command unannotated: called as a Callable.
            send: Callable[..., None] = super().send_command
            send(*args, **options)

    return fakeredis.FakeRedis(server=server, connection_class=Connection)


def async_recording_redis(
    recorder: Recorder, server: fakeredis.FakeServer
) -> fakeredis.FakeAsyncRedis:
    """A ``redis.asyncio`` client on ``server`` that records each command its connection sends."""

    class Connection(fakeredis.FakeAsyncRedisConnection):
        async def send_command(self, *args: Any, **options: Any) -> None:
            recorder.requests.append(args)
            # redis-py leaves send_command unannotated: called as a Callable.
            send: Callable[..., Awaitable[None]] = super().send_command
            await send(*args, **options)

    return fakeredis.FakeAsyncRedis(server=server, connection_class=Connection)


# The collection methods a request can go through; each is intercepted.
REQUEST_METHODS = (
    "create_index", "insert_one", "update_one", "update_many", "delete_one", "delete_many",
    "find_one", "find_one_and_update", "distinct",
)  # fmt: skip
# Never connected to: the client only lends its real pymongo types and name checks.
_NOWHERE = "mongodb://127.0.0.1:9/?connect=false"


class RecordingMongo:
    """A real pymongo client, sync or asyncio, whose requests reach mongomock and are recorded.

    :attr:`client` is a ``pymongo.MongoClient`` (``AsyncMongoClient`` if
    ``asynchronous``) that never connects. Its ``get_database`` and its
    databases' ``get_collection`` are pymongo's own, with pymongo's name checks,
    recorded as lookups. The collections they return are pymongo's, with each
    method of :data:`REQUEST_METHODS` replaced on the instance: it records
    the request, encodes the namespace and the arguments as the driver would
    (UTF-8, BSON), and answers with mongomock, as a free server would.
    """

    def __init__(self, recorder: Recorder, *, asynchronous: bool) -> None:
        self.recorder = recorder
        self.asynchronous = asynchronous
        self.client: pymongo.MongoClient[dict[str, Any]] | pymongo.AsyncMongoClient[dict[str, Any]]
        if asynchronous:
            self.client = pymongo.AsyncMongoClient(_NOWHERE, connect=False)
        else:
            self.client = pymongo.MongoClient(_NOWHERE, connect=False)
        self.mock: mongomock.MongoClient[dict[str, Any]] = mongomock.MongoClient()
        self.stores: list[mongomock.Collection[dict[str, Any]]] = []
        setattr(self.client, "get_database", self._wrap_get_database(self.client.get_database))  # noqa: B010

    def _wrap_get_database(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def get_database(name: Any, *args: Any, **options: Any) -> Any:
            self.recorder.lookups.append(("get_database", name))
            database = real(name, *args, **options)
            setattr(database, "get_collection", self._wrap_get_collection(database))  # noqa: B010
            return database

        return get_database

    def _wrap_get_collection(self, database: Any) -> Callable[..., Any]:
        real: Callable[..., Any] = database.get_collection

        def get_collection(name: Any, *args: Any, **options: Any) -> Any:
            self.recorder.lookups.append(("get_collection", name))
            collection = real(name, *args, **options)
            store = self.mock.get_database(database.name).get_collection(name)
            self.stores.append(store)
            for method in REQUEST_METHODS:
                setattr(collection, method, self._request(store, f"{database.name}.{name}", method))
            return collection

        return get_collection

    def _request(
        self, store: mongomock.Collection[dict[str, Any]], namespace: str, method: str
    ) -> Callable[..., Any]:
        recorder = self.recorder

        def answer(args: tuple[Any, ...], options: dict[str, Any]) -> Any:
            recorder.requests.append((method, *args))
            # What pymongo does before a byte leaves: the namespace and the
            # command are encoded (UTF-8, strict; BSON).
            namespace.encode("utf-8")
            bson.encode({"args": list(args), "options": options})
            return getattr(store, method)(*args, **options)

        if not self.asynchronous:
            return lambda *args, **options: answer(args, options)

        async def coroutine(*args: Any, **options: Any) -> Any:
            return answer(args, options)

        return coroutine

    def active(self, now: float) -> int:
        """How many lease documents are active at ``now`` (epoch seconds)."""
        when = {"expiredAt": {"$gt": datetime.fromtimestamp(now, timezone.utc)}}
        return sum(store.count_documents(when) for store in self.stores)

    def reset(self) -> None:
        """Empty every collection handed out: the server is free again."""
        for store in self.stores:
            store.delete_many({})

    async def close(self) -> None:
        if isinstance(self.client, pymongo.AsyncMongoClient):
            await self.client.close()
        else:
            self.client.close()


# --- the delaying wrapper -----------------------------------------------------------

PHASES = ("before", "in-flight", "after")
"""Where a cancellation can land in one command: before it is sent, while the
client awaits the server, after the server answered but before the reply is
returned to dmutex."""


class DelayingRedis:
    """An asyncio Redis-shaped client that sleeps before and after each command.

    Delegates ``execute_command`` to a real ``redis.asyncio.Redis``. Each sleep
    lasts ``uniform(0, max_delay)`` seconds from ``rng``. ``on_phase(phase)``
    is called as each phase of a command begins (one of :data:`PHASES`), and
    with None when the command is over, however it ended; ``on_send(args)``
    as the command is handed to the real client.
    """

    def __init__(
        self,
        inner: redis.asyncio.Redis,
        rng: random.Random,
        max_delay: float,
        on_send: Callable[[tuple[object, ...]], None],
        on_phase: Callable[[str | None], None],
    ) -> None:
        # redis-py leaves execute_command unannotated: called as a Callable.
        self._execute: Callable[..., Awaitable[Any]] = inner.execute_command
        self._rng = rng
        self._max_delay = max_delay
        self._on_send = on_send
        self._on_phase = on_phase
        self.sent: Counter[str] = Counter()
        """Commands handed to the real client, by name."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        before, in_flight, after = PHASES
        try:
            self._on_phase(before)
            await asyncio.sleep(self._rng.uniform(0, self._max_delay))
            self._on_phase(in_flight)
            self.sent[str(args[0])] += 1
            self._on_send(args)
            reply = await self._execute(*args, **options)
            self._on_phase(after)
            await asyncio.sleep(self._rng.uniform(0, self._max_delay))
        finally:
            self._on_phase(None)
        return reply

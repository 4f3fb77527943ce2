"""The MongoDB store through the real pymongo driver, over the wire, against mockupdb.

mockupdb is a mock server: pymongo (``MongoClient``, or ``AsyncMongoClient`` or
motor's ``AsyncIOMotorClient`` on an event loop thread for the async classes)
connects to it over TCP on
127.0.0.1, and every command dmutex causes is handed to the test, which
asserts the command exactly as it arrived (decoded from the BSON on the wire)
and answers it with what a real server would reply. Operations run on a
background thread (``go``) while the test answers.

What this proves, and what it cannot:

- spec section 6: database and collection names, ``_id``, ``value``,
  ``expiredAt`` as a BSON date, the TTL index, byte for byte as pymongo sends
  them;
- spec section 7: commands counted by a pymongo ``CommandListener``
  (handshakes and heartbeats excluded) for every case of the table;
- replies fed back: duplicate key (E11000) means contention, every other
  error raises (write errors, command errors, write concern errors, a hang-up,
  a failing ``createIndexes``).

It is not a MongoDB: the server's matching, upserts and TTL monitor are the
test's own answers. Semantics are proven on mongomock and real servers
elsewhere.

Time is a ManualClock (every instance is made with ``clock=``), so every date sent
is known in advance. The semaphore's first slot is random and is not pinned:
the tests read which slot each upsert names and check the next command
against it.
"""

from __future__ import annotations

import math
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any, Generic, TypeVar

import motor.motor_asyncio
import pymongo
import pymongo.errors
import pytest
from mockupdb import MockupDB, Request
from pymongo import monitoring

from dmutex import ManualClock
from tests._support.faces import Face, FaceName, Handle, Kind, LoopThread

T = TypeVar("T")

# --- the rig ----------------------------------------------------------------------------

# 2026-01-01T00:00:00.123Z: a start with milliseconds, so that rounding shows.
START = datetime(2026, 1, 1, 0, 0, 0, 123000, tzinfo=timezone.utc)
START_MS = 1_767_225_600_123
# How the mock server decodes a BSON date: a naive datetime in UTC.
EPOCH = datetime(1970, 1, 1)

# How long the test waits for dmutex's next command, and pymongo for the server.
REQUEST_TIMEOUT = 5.0
CLIENT_OPTIONS: dict[str, Any] = {
    "serverSelectionTimeoutMS": 5000,
    "connectTimeoutMS": 5000,
    "socketTimeoutMS": 5000,
    # A retried write would be a second command for the same operation.
    "retryWrites": False,
    "retryReads": False,
}
# Commands the driver sends on its own: handshakes, heartbeats, session cleanup.
DRIVER_COMMANDS = frozenset({"hello", "ismaster", "endsessions", "ping", "buildinfo"})
# Session fields pymongo adds when a server supports sessions (this one does not).
ENVELOPE = frozenset({"$db", "lsid", "$clusterTime"})


def at(ms: int) -> datetime:
    """The date ``ms`` milliseconds after the epoch, as the mock server decodes it."""
    return EPOCH + timedelta(milliseconds=ms)


def permit_id(slot: int, key: str) -> str:
    return f"permit:{slot}:{key}"


class Future(Generic[T]):
    """``fn()`` running on a daemon thread; calling the future joins it.

    Not ``mockupdb.go``: its future re-raises ``type(error)(str(error))``,
    which drops pymongo's ``code`` and ``details``. This one re-raises the
    error object itself.
    """

    def __init__(self, fn: Callable[[], T]) -> None:
        self._result: list[T] = []
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self._result.append(fn())
        except BaseException as error:  # noqa: BLE001 - handed to the joining thread
            self._error.append(error)

    def __call__(self, timeout: float = REQUEST_TIMEOUT) -> T:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"the operation did not finish within {timeout} s")
        if self._error:
            raise self._error[0]
        return self._result[0]


def go(fn: Callable[..., T], *args: Any) -> Future[T]:
    """Start ``fn(*args)`` in the background (the test answers its commands meanwhile)."""
    return Future(lambda: fn(*args))


class Commands(monitoring.CommandListener):
    """The names of the commands pymongo starts, handshakes and heartbeats excluded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: list[str] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name.lower() not in DRIVER_COMMANDS:
            with self._lock:
                self._names.append(event.command_name)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass

    @property
    def names(self) -> list[str]:
        with self._lock:
            return list(self._names)

    def since(self, mark: int) -> list[str]:
        return self.names[mark:]


class Wire:
    """A mock server, pymongo clients of one face connected to it, and their commands."""

    def __init__(
        self, server: MockupDB, face: FaceName, clock: ManualClock, motor: bool = False
    ) -> None:
        self.server = server
        self.face = face
        self.motor = motor
        self.clock = clock
        self.commands = Commands()
        self.loop = LoopThread() if face == "async" else None
        self._clients: list[Any] = []

    def client(self, **options: Any) -> Any:
        """A new pymongo client of this face, closed at the end of the test."""
        settings = {**CLIENT_OPTIONS, "event_listeners": [self.commands], **options}
        client: Any
        if self.loop is None:
            client = pymongo.MongoClient(self.server.uri, **settings)
        else:

            async def open_client() -> Any:
                if self.motor:
                    return motor.motor_asyncio.AsyncIOMotorClient(self.server.uri, **settings)
                return pymongo.AsyncMongoClient(self.server.uri, **settings)

            client = self.loop.run(open_client())
        self._clients.append(client)
        return client

    def make(self, kind: Kind, *, max_permits: int = 1, client: Any = None, **options: Any) -> Face:
        """A DMutex/DSemaphore of this face (sync methods either way)."""
        return Face(
            self.face,
            kind,
            self.client() if client is None else client,
            max_permits=max_permits,
            loop=self.loop,
            clock=self.clock,
            **options,
        )

    def receive(self, name: str, db: str = "dmutex") -> Request:
        """The next command dmutex sent: it must be ``name`` on database ``db``."""
        request = self.server.receives(timeout=REQUEST_TIMEOUT)
        assert request.command_name == name, f"expected {name}, got {request!r}"
        assert request.namespace == db
        assert request.doc["$db"] == db
        return request

    def close(self) -> None:
        """Close the clients; fail if a command was left unanswered."""
        leftover = []
        while self.server.got(timeout=0):
            leftover.append(self.server.receives(timeout=0))
        for client in self._clients:
            if self.loop is None or self.motor:  # motor's close() is not a coroutine
                client.close()
            else:
                self.loop.run(client.close())
        if self.loop is not None:
            self.loop.close()
        assert not leftover, f"commands left unanswered: {leftover!r}"


@pytest.fixture
def clock() -> ManualClock:
    """The clock the instances read the time from."""
    return ManualClock(START)


@pytest.fixture(scope="module")
def server() -> Iterator[MockupDB]:
    """One mock server for the module (stopping one takes a second); tests open own clients."""
    mock = MockupDB(
        auto_ismaster={"maxWireVersion": 21, "minWireVersion": 0},
        request_timeout=REQUEST_TIMEOUT,
    )
    mock.run()
    try:
        yield mock
    finally:
        mock.stop()


@pytest.fixture(params=["sync", "async", "motor"])
def wire(request: pytest.FixtureRequest, server: MockupDB, clock: ManualClock) -> Iterator[Wire]:
    """pymongo's MongoClient, its AsyncMongoClient, and motor's AsyncIOMotorClient."""
    face: FaceName = "sync" if request.param == "sync" else "async"
    rig = Wire(server, face, clock, motor=request.param == "motor")
    try:
        yield rig
    finally:
        rig.close()


def body(request: Request) -> dict[str, Any]:
    """The command document, without the envelope (``$db`` is checked by ``receive``)."""
    return {name: value for name, value in request.doc.items() if name not in ENVELOPE}


def ready(face: Face) -> None:
    face.wait(face.target.ready())


def ready_counted(wire: Wire, face: Face, collection: str, db: str = "dmutex") -> None:
    """Run ``ready()``: one createIndexes, answered ok."""
    future = go(ready, face)
    request = wire.receive("createIndexes", db)
    assert body(request) == create_indexes(collection)
    request.ok(CREATED)
    future()


# --- server replies ---------------------------------------------------------------------

CREATED = {"createdCollectionAutomatically": True, "numIndexesBefore": 1, "numIndexesAfter": 2}


def inserted(request: Request) -> dict[str, Any]:
    """The reply to an upsert that matched nothing and inserted its document."""
    slot_id = request.doc["updates"][0]["q"]["_id"]
    return {"n": 1, "nModified": 0, "upserted": [{"index": 0, "_id": slot_id}]}


# The reply to an update that matched one document (an expired one, or the lease extended).
MATCHED = {"n": 1, "nModified": 1}
MATCHED_NONE = {"n": 0, "nModified": 0}


def granted(wire: Wire, face: Face, *args: Any) -> Handle:
    """``face.acquire("k", *args)``, its upsert answered "inserted": the handle."""
    future = go(face.acquire, "k", *args)
    request = wire.receive("update")
    request.ok(inserted(request))
    handle = future()
    assert handle is not None
    return handle


def duplicate(request: Request) -> dict[str, Any]:
    """A real server's reply when the upsert collides with an active document."""
    slot_id = request.doc["updates"][0]["q"]["_id"]
    namespace = f"{request.doc['$db']}.{request.doc['update']}"
    return {
        "n": 0,
        "nModified": 0,
        "writeErrors": [
            {
                "index": 0,
                "code": 11000,
                "keyPattern": {"_id": 1},
                "keyValue": {"_id": slot_id},
                "errmsg": (
                    f"E11000 duplicate key error collection: {namespace} "
                    f'index: _id_ dup key: {{ _id: "{slot_id}" }}'
                ),
            }
        ],
    }


# --- expected commands ------------------------------------------------------------------


def create_indexes(collection: str) -> dict[str, Any]:
    return {
        "createIndexes": collection,
        "indexes": [{"key": {"expiredAt": 1}, "name": "expiredAt_1", "expireAfterSeconds": 0}],
    }


def take(collection: str, slot_id: str, token: str, now_ms: int, ttl_ms: int) -> dict[str, Any]:
    """The acquire upsert of one slot: free, expired, or already holding ``token``."""
    return {
        "update": collection,
        "ordered": True,
        "updates": [
            {
                "q": {
                    "_id": slot_id,
                    "$or": [{"expiredAt": {"$lte": at(now_ms)}}, {"value": token}],
                },
                "u": {"$set": {"value": token, "expiredAt": at(now_ms + ttl_ms)}},
                "multi": False,
                "upsert": True,
            }
        ],
    }


def active(key: str, permits: int, now_ms: int, slot: int | None) -> dict[str, Any]:
    """The filter of release and extend: the active document of ``key`` holding the token."""
    ids: object = (
        permit_id(slot, key)
        if slot is not None
        else {"$in": [permit_id(i, key) for i in range(permits)]}
    )
    return {"_id": ids, "expiredAt": {"$gt": at(now_ms)}}


def token_of(request: Request) -> str:
    """The token an acquire upsert sets: a UUID4 string, then its holder's stamp."""
    token = request.doc["updates"][0]["u"]["$set"]["value"]
    assert isinstance(token, str)
    random = token.partition("|")[0]
    assert uuid.UUID(random).version == 4
    assert str(uuid.UUID(random)) == random
    return token


def slot_of(request: Request, key: str) -> int:
    """The slot an acquire upsert tries, read from its ``_id``."""
    slot_id = request.doc["updates"][0]["q"]["_id"]
    prefix, slot, rest = slot_id.split(":", 2)
    assert (prefix, rest) == ("permit", key)
    return int(slot)


def check_dates(request: Request) -> None:
    """Every ``expiredAt`` sent is a BSON date, not a number or a string."""
    for update in request.doc["updates"]:
        sent = update["u"]["$set"]["expiredAt"]
        assert type(sent) is datetime
        for operator in expiry_condition(update["q"]).values():
            assert type(operator) is datetime


# --- 1. ready(): the TTL index ---------------------------------------------------------

NAMESPACES = [
    pytest.param("mutex", {}, "dmutex", "_dmutex_svc", id="mutex-defaults"),
    pytest.param("semaphore", {}, "dmutex", "_dsemaphore_svc", id="semaphore-defaults"),
    pytest.param(
        "mutex",
        {"db_name": "locks", "collection_name": "leases"},
        "locks",
        "leases",
        id="mutex-db-and-collection",
    ),
    pytest.param(
        "semaphore", {"collection_prefix": "p_"}, "dmutex", "p_svc", id="semaphore-prefix"
    ),
    pytest.param(
        "mutex",
        {"collection_name": "leases", "collection_prefix": "p_"},
        "dmutex",
        "leases",
        id="collection-name-wins-over-prefix",
    ),
    pytest.param(
        "semaphore",
        {"db_name": "other", "collection_prefix": "sem."},
        "other",
        "sem.svc",
        id="semaphore-db-and-prefix",
    ),
]


@pytest.mark.parametrize(("kind", "options", "db", "collection"), NAMESPACES)
def test_ready_creates_the_ttl_index_once(
    wire: Wire, kind: Kind, options: dict[str, Any], db: str, collection: str
) -> None:
    face = wire.make(kind, max_permits=2, **options)
    mark = len(wire.commands.names)
    future = go(ready, face)
    request = wire.receive("createIndexes", db)
    assert body(request) == create_indexes(collection)
    # The index spec in the order pymongo encodes it: key first.
    assert list(request.doc["indexes"][0]["key"].items()) == [("expiredAt", 1)]
    request.ok(CREATED)
    assert future() is None
    assert wire.commands.since(mark) == ["createIndexes"]

    # Ready once per instance: a second ready() and an acquire send no createIndexes.
    go(ready, face)()
    future_lease = go(face.acquire, "k")
    update = wire.receive("update", db)
    assert update.doc["update"] == collection
    update.ok(inserted(update))
    assert future_lease() is not None
    assert wire.commands.since(mark) == ["createIndexes", "update"]


def test_an_operation_on_a_fresh_instance_creates_the_index_first(wire: Wire) -> None:
    sem = wire.make("semaphore", max_permits=2)
    future = go(sem.acquire, "k")
    wire.receive("createIndexes").ok(CREATED)
    update = wire.receive("update")
    update.ok(inserted(update))
    assert future() is not None
    # release(key, token) on another fresh instance: createIndexes, then the delete.
    other = wire.make("semaphore", max_permits=2)
    released = go(other.release_token, "k", "0b9d3d55-8a3e-4c5e-9f55-3b0d3b0e6a11")
    wire.receive("createIndexes").ok(CREATED)
    wire.receive("delete").ok(n=0)
    assert released() is False
    assert wire.commands.names == ["createIndexes", "update", "createIndexes", "delete"]


def test_concurrent_first_operations_share_one_create_indexes(wire: Wire) -> None:
    face = wire.make("semaphore", max_permits=4)
    futures = [go(face.acquire, f"k{i}") for i in range(3)]
    wire.receive("createIndexes").ok(CREATED)
    for _ in futures:
        update = wire.receive("update")
        update.ok(inserted(update))
    keys = sorted(lease.key for lease in (future() for future in futures) if lease is not None)
    assert keys == ["k0", "k1", "k2"]
    assert wire.commands.names.count("createIndexes") == 1
    assert wire.commands.names.count("update") == 3


# --- 2. shapes and counts: mutex --------------------------------------------------------

TTLS = [
    pytest.param(30, 30_000, id="30s"),
    pytest.param(1.2345, 1235, id="1.2345s-rounds-up"),
    pytest.param(0.0015, 2, id="1.5ms-rounds-up"),
    pytest.param(0.0001, 1, id="0.1ms-is-1ms"),
    pytest.param(None, 300_000, id="default-300s"),
]


@pytest.mark.parametrize(("ttl", "ttl_ms"), TTLS)
@pytest.mark.parametrize("state", ["free", "expired-but-stored", "held"])
def test_mutex_acquire_is_one_upsert(
    wire: Wire, state: str, ttl: float | None, ttl_ms: int
) -> None:
    assert ttl is None or math.ceil(ttl * 1000) == ttl_ms
    mutex = wire.make("mutex")
    ready_counted(wire, mutex, "_dmutex_svc")
    mark = len(wire.commands.names)

    future = go(mutex.acquire, "job", ttl)
    request = wire.receive("update")
    token = token_of(request)
    assert body(request) == take("_dmutex_svc", "permit:0:job", token, START_MS, ttl_ms)
    check_dates(request)
    sent = request.doc["updates"][0]
    assert sent["u"]["$set"]["expiredAt"] - expiry_condition(sent["q"])["$lte"] == timedelta(
        milliseconds=ttl_ms
    )
    reply = {"free": inserted(request), "expired-but-stored": MATCHED, "held": duplicate(request)}
    request.ok(reply[state])
    lock = future()

    assert wire.commands.since(mark) == ["update"]
    if state == "held":
        assert lock is None
        return
    assert lock is not None
    assert (lock.key, lock.token, lock.slot) == ("job", token, 0)
    assert lock.expired_at == START + timedelta(milliseconds=ttl_ms)
    assert lock.expired_at.tzinfo is not None


def test_a_mutex_semaphore_of_one_permit_is_one_upsert_too(wire: Wire) -> None:
    sem = wire.make("semaphore", max_permits=1)
    ready_counted(wire, sem, "_dsemaphore_svc")
    mark = len(wire.commands.names)
    future = go(sem.acquire, "k", 5)
    request = wire.receive("update")
    assert body(request) == take("_dsemaphore_svc", "permit:0:k", token_of(request), START_MS, 5000)
    request.ok(duplicate(request))
    assert future() is None
    assert wire.commands.since(mark) == ["update"]


# --- 2. shapes and counts: semaphore ----------------------------------------------------

PERMITS = [pytest.param(3, id="3-permits"), pytest.param(64, id="64-permits")]


def start_semaphore(wire: Wire, permits: int) -> tuple[Face, int]:
    sem = wire.make("semaphore", max_permits=permits)
    ready_counted(wire, sem, "_dsemaphore_svc")
    return sem, len(wire.commands.names)


def first_try(wire: Wire, key: str, ttl_ms: int) -> tuple[Request, str, int]:
    """Receive a semaphore's first upsert and check its shape; (request, token, slot)."""
    request = wire.receive("update")
    token = token_of(request)
    slot = slot_of(request, key)
    assert body(request) == take("_dsemaphore_svc", permit_id(slot, key), token, START_MS, ttl_ms)
    check_dates(request)
    return request, token, slot


def first_slot_taken(wire: Wire, sem: Face) -> tuple[Future[Handle | None], str, int]:
    """Start ``sem.acquire("k", 2.5)``; its first upsert (checked) finds the slot taken.

    The acquire's future, its token, and the slot it tried first.
    """
    future = go(sem.acquire, "k", 2.5)
    request, token, slot = first_try(wire, "k", 2500)
    request.ok(duplicate(request))
    return future, token, slot


def cleanup_of(wire: Wire, collection: str, key: str, token: str, permits: int) -> None:
    """An acquire that raised releases by its token: one delete over every slot (answered n=0)."""
    request = wire.receive("delete")
    ids = {"$in": [permit_id(i, key) for i in range(permits)]}
    query = {"_id": ids, "value": token, "expiredAt": {"$gt": at(START_MS)}}
    assert body(request) == {
        "delete": collection,
        "ordered": True,
        "deletes": [{"q": query, "limit": 1}],
    }
    request.ok(n=0)


def distinct_of(wire: Wire, key: str, permits: int) -> Request:
    """Receive the ``distinct`` of active slots and check its exact shape."""
    request = wire.receive("distinct")
    assert body(request) == {
        "distinct": "_dsemaphore_svc",
        "key": "_id",
        "query": {
            "_id": {"$in": [permit_id(i, key) for i in range(permits)]},
            "expiredAt": {"$gt": at(START_MS)},
        },
    }
    assert type(request.doc["query"]["expiredAt"]["$gt"]) is datetime
    return request


@pytest.mark.parametrize("permits", PERMITS)
def test_semaphore_first_slot_free_is_one_upsert(wire: Wire, permits: int) -> None:
    sem, mark = start_semaphore(wire, permits)
    future = go(sem.acquire, "k", 2.5)
    request, token, slot = first_try(wire, "k", 2500)
    assert 0 <= slot < permits
    request.ok(inserted(request))
    permit = future()
    assert permit is not None
    assert (permit.token, permit.slot) == (token, slot)
    assert permit.expired_at == START + timedelta(milliseconds=2500)
    assert wire.commands.since(mark) == ["update"]


@pytest.mark.parametrize("permits", PERMITS)
def test_semaphore_all_active_is_two_commands(wire: Wire, permits: int) -> None:
    sem, mark = start_semaphore(wire, permits)
    future, _, _ = first_slot_taken(wire, sem)
    distinct_of(wire, "k", permits).ok(values=[permit_id(i, "k") for i in range(permits)])
    assert future() is None
    assert wire.commands.since(mark) == ["update", "distinct"]


@pytest.mark.parametrize("permits", PERMITS)
def test_semaphore_takes_the_free_slot_distinct_names_in_three(wire: Wire, permits: int) -> None:
    sem, mark = start_semaphore(wire, permits)
    future, token, first = first_slot_taken(wire, sem)
    free = (first + permits // 2) % permits
    held = [permit_id(i, "k") for i in range(permits) if i != free]
    distinct_of(wire, "k", permits).ok(values=held)
    # Whatever max_permits is, the next upsert goes straight to the free slot.
    second = wire.receive("update")
    assert body(second) == take("_dsemaphore_svc", permit_id(free, "k"), token, START_MS, 2500)
    second.ok(MATCHED)
    permit = future()
    assert permit is not None
    assert (permit.token, permit.slot) == (token, free)
    assert wire.commands.since(mark) == ["update", "distinct", "update"]


def test_semaphore_lost_race_costs_one_more(wire: Wire) -> None:
    sem, mark = start_semaphore(wire, 3)
    future = go(sem.acquire, "k", 2.5)
    request, token, first = first_try(wire, "k", 2500)
    request.ok(duplicate(request))
    distinct_of(wire, "k", 3).ok(values=[permit_id(first, "k")])
    others = {i for i in range(3) if i != first}
    # The third command loses a race: someone took that slot since distinct.
    lost = wire.receive("update")
    lost_slot = slot_of(lost, "k")
    assert lost_slot in others
    assert body(lost) == take("_dsemaphore_svc", permit_id(lost_slot, "k"), token, START_MS, 2500)
    lost.ok(duplicate(lost))
    won = wire.receive("update")
    (won_slot,) = others - {lost_slot}
    assert body(won) == take("_dsemaphore_svc", permit_id(won_slot, "k"), token, START_MS, 2500)
    won.ok(inserted(won))
    permit = future()
    assert permit is not None
    assert permit.slot == won_slot
    # 3 + 1 per race lost.
    assert wire.commands.since(mark) == ["update", "distinct", "update", "update"]


def test_semaphore_losing_every_race_returns_none(wire: Wire) -> None:
    sem, mark = start_semaphore(wire, 3)
    future = go(sem.acquire, "k")
    request, _, first = first_try(wire, "k", 300_000)
    request.ok(duplicate(request))
    distinct_of(wire, "k", 3).ok(values=[])
    tried = set()
    for _ in range(2):
        lost = wire.receive("update")
        tried.add(slot_of(lost, "k"))
        lost.ok(duplicate(lost))
    assert future() is None
    assert tried == {0, 1, 2} - {first}
    # Two races lost: within 3 + 2; each free slot tried once, the first never again.
    assert wire.commands.since(mark) == ["update", "distinct", "update", "update"]


def test_semaphore_first_slot_spreads_over_the_slots(wire: Wire) -> None:
    sem, _ = start_semaphore(wire, 2)
    seen: set[int] = set()
    # P(only one slot in 40 tries) = 2 * 2**-40: not a flaky test.
    for attempt in range(40):
        future = go(sem.acquire, f"k{attempt}")
        request = wire.receive("update")
        seen.add(slot_of(request, f"k{attempt}"))
        request.ok(inserted(request))
        assert future() is not None
        if seen == {0, 1}:
            break
    assert seen == {0, 1}


# --- 2. release and extend: one command each --------------------------------------------


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
@pytest.mark.parametrize("deleted", [1, 0])
def test_release_by_handle_is_one_delete(wire: Wire, kind: Kind, deleted: int) -> None:
    collection = "_dmutex_svc" if kind == "mutex" else "_dsemaphore_svc"
    face = wire.make(kind, max_permits=3)
    ready_counted(wire, face, collection)
    handle = granted(wire, face)
    wire.clock.advance(10)
    mark = len(wire.commands.names)

    released = go(handle.release)
    delete = wire.receive("delete")
    assert body(delete) == {
        "delete": collection,
        "ordered": True,
        "deletes": [
            {
                "q": {
                    "_id": permit_id(handle.slot, "k"),
                    "value": handle.token,
                    "expiredAt": {"$gt": at(START_MS + 10_000)},
                },
                "limit": 1,
            }
        ],
    }
    assert list(delete.doc["deletes"][0]["q"]) == ["_id", "value", "expiredAt"]
    delete.ok(n=deleted)
    assert released() is bool(deleted)
    assert wire.commands.since(mark) == ["delete"]


@pytest.mark.parametrize("permits", [1, 3])
def test_semaphore_release_by_token_is_one_delete(wire: Wire, permits: int) -> None:
    sem, mark = start_semaphore(wire, permits)
    token = "1c6f1f7e-5a4f-4d0e-8c77-2b1f9a1f3f10"
    released = go(sem.release_token, "k", token)
    delete = wire.receive("delete")
    q = active("k", permits, START_MS, None)
    assert body(delete) == {
        "delete": "_dsemaphore_svc",
        "ordered": True,
        "deletes": [
            {"q": {"_id": q["_id"], "value": token, "expiredAt": q["expiredAt"]}, "limit": 1}
        ],
    }
    delete.ok(n=1)
    assert released() is True
    assert wire.commands.since(mark) == ["delete"]


def extend_command(collection: str, query: dict[str, Any], expires_ms: int) -> dict[str, Any]:
    return {
        "update": collection,
        "ordered": True,
        "updates": [
            {
                "q": query,
                "u": {"$set": {"expiredAt": at(expires_ms)}},
                "multi": False,
                "upsert": False,
            }
        ],
    }


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
@pytest.mark.parametrize("matched", [1, 0])
def test_extend_by_handle_is_one_update_without_upsert(
    wire: Wire, kind: Kind, matched: int
) -> None:
    collection = "_dmutex_svc" if kind == "mutex" else "_dsemaphore_svc"
    face = wire.make(kind, max_permits=3)
    ready_counted(wire, face, collection)
    handle = granted(wire, face, 20)
    wire.clock.advance(10)
    now_ms = START_MS + 10_000
    mark = len(wire.commands.names)

    extended = go(handle.extend, 7.5)
    update = wire.receive("update")
    query = {
        "_id": permit_id(handle.slot, "k"),
        "value": handle.token,
        "expiredAt": {"$gt": at(now_ms)},
    }
    assert body(update) == extend_command(collection, query, now_ms + 7500)
    check_dates(update)
    update.ok(MATCHED if matched else MATCHED_NONE)
    assert extended() is bool(matched)
    assert wire.commands.since(mark) == ["update"]
    # extend sets now + ttl, not old expiry + ttl; the handle follows only on success.
    expected = now_ms + 7500 if matched else START_MS + 20_000
    assert handle.expired_at == START + timedelta(milliseconds=expected - START_MS)


@pytest.mark.parametrize(("kind", "permits"), [("mutex", 1), ("semaphore", 3)])
def test_extend_by_token_is_one_update(wire: Wire, kind: Kind, permits: int) -> None:
    collection = "_dmutex_svc" if kind == "mutex" else "_dsemaphore_svc"
    face = wire.make(kind, max_permits=permits)
    ready_counted(wire, face, collection)
    mark = len(wire.commands.names)
    token = "5d1b0c3e-2f7a-4b8e-9a0d-6c2e1f4b7a90"
    extended = go(face.extend, "k", token, 60)
    update = wire.receive("update")
    q = active("k", permits, START_MS, None)
    query = {"_id": q["_id"], "value": token, "expiredAt": q["expiredAt"]}
    assert body(update) == extend_command(collection, query, START_MS + 60_000)
    update.ok(MATCHED)
    assert extended() is True
    assert wire.commands.since(mark) == ["update"]


# --- 3. server replies fed back ----------------------------------------------------------

BAD_VALUE = "Performing an update on the path '_id' would modify the immutable field '_id'"
UNAUTHORIZED = 'not authorized on dmutex to execute command { update: "_dmutex_svc" }'


def write_error(code: int, message: str) -> dict[str, Any]:
    return {"n": 0, "nModified": 0, "writeErrors": [{"index": 0, "code": code, "errmsg": message}]}


def command_error(code: int, name: str, message: str) -> dict[str, Any]:
    return {"ok": 0, "code": code, "codeName": name, "errmsg": message}


FAILURES = [
    pytest.param(write_error(2, BAD_VALUE), pymongo.errors.WriteError, 2, BAD_VALUE, id="BadValue"),
    pytest.param(
        command_error(13, "Unauthorized", UNAUTHORIZED),
        pymongo.errors.OperationFailure,
        13,
        UNAUTHORIZED,
        id="Unauthorized",
    ),
    pytest.param(
        write_error(11001, "E11001 not a duplicate key"),
        pymongo.errors.WriteError,
        11001,
        "E11001",
        id="code-11001-is-not-11000",
    ),
]


@pytest.mark.parametrize(("reply", "error", "code", "message"), FAILURES)
@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_acquire_raises_on_any_other_error(
    wire: Wire,
    kind: Kind,
    reply: dict[str, Any],
    error: type[pymongo.errors.PyMongoError],
    code: int,
    message: str,
) -> None:
    face = wire.make(kind, max_permits=3)
    ready_counted(wire, face, "_dmutex_svc" if kind == "mutex" else "_dsemaphore_svc")
    mark = len(wire.commands.names)
    future = go(face.acquire, "k")
    request = wire.receive("update")
    request.ok(reply)
    collection = "_dmutex_svc" if kind == "mutex" else "_dsemaphore_svc"
    cleanup_of(wire, collection, "k", token_of(request), 1 if kind == "mutex" else 3)
    with pytest.raises(error, match=re.escape(message[:20])) as raised:
        future()
    assert isinstance(raised.value, pymongo.errors.OperationFailure)
    assert raised.value.code == code
    # Raised at once: the semaphore did not go on to distinct; the delete is
    # the failed acquire releasing by its token, in case it took a slot.
    assert wire.commands.since(mark) == ["update", "delete"]


def test_distinct_failure_raises(wire: Wire) -> None:
    sem, mark = start_semaphore(wire, 3)
    future = go(sem.acquire, "k")
    request, token, _ = first_try(wire, "k", 300_000)
    request.ok(duplicate(request))
    wire.receive("distinct").ok(command_error(13, "Unauthorized", "not authorized: distinct"))
    cleanup_of(wire, "_dsemaphore_svc", "k", token, 3)
    with pytest.raises(pymongo.errors.OperationFailure, match="not authorized: distinct") as raised:
        future()
    assert raised.value.code == 13
    assert wire.commands.since(mark) == ["update", "distinct", "delete"]


def test_race_lost_then_other_error_raises(wire: Wire) -> None:
    sem, mark = start_semaphore(wire, 3)
    future = go(sem.acquire, "k")
    request, token, _ = first_try(wire, "k", 300_000)
    request.ok(duplicate(request))
    wire.receive("distinct").ok(values=[])
    wire.receive("update").ok(write_error(2, BAD_VALUE))
    cleanup_of(wire, "_dsemaphore_svc", "k", token, 3)
    with pytest.raises(pymongo.errors.WriteError, match="immutable field") as raised:
        future()
    assert raised.value.code == 2
    assert wire.commands.since(mark) == ["update", "distinct", "update", "delete"]


WRITE_CONCERN_ERROR = {
    "code": 64,
    "codeName": "WriteConcernFailed",
    "errmsg": "waiting for replication timed out",
    "errInfo": {"wtimeout": True},
}


@pytest.mark.parametrize("operation", ["acquire", "release", "extend"])
def test_write_concern_error_raises(wire: Wire, operation: str) -> None:
    face = wire.make("mutex")
    ready_counted(wire, face, "_dmutex_svc")
    handle: Handle | None = None
    if operation != "acquire":
        handle = granted(wire, face)
    mark = len(wire.commands.names)
    target: Callable[[], object] = {
        "acquire": lambda: face.acquire("k"),
        "release": lambda: handle is not None and handle.release(),
        "extend": lambda: handle is not None and handle.extend(5),
    }[operation]
    future_result = go(target)
    # The write itself succeeded on the primary; replication did not confirm it.
    if operation == "release":
        wire.receive("delete").ok(n=1, writeConcernError=WRITE_CONCERN_ERROR)
    else:
        request = wire.receive("update")
        success = inserted(request) if operation == "acquire" else MATCHED
        request.ok({**success, "writeConcernError": WRITE_CONCERN_ERROR})
        if operation == "acquire":  # it may have taken the slot: released by its token
            cleanup_of(wire, "_dmutex_svc", "k", token_of(request), 1)
    with pytest.raises(pymongo.errors.WriteConcernError, match="replication timed out") as raised:
        future_result()
    assert raised.value.code == 64
    sent = {"acquire": ["update", "delete"], "release": ["delete"], "extend": ["update"]}
    assert wire.commands.since(mark) == sent[operation]


HANGUPS = ["ready", "acquire", "distinct", "release", "extend"]


@pytest.mark.parametrize("where", HANGUPS)
def test_a_hang_up_raises(wire: Wire, where: str) -> None:
    sem = wire.make("semaphore", max_permits=2)
    if where != "ready":
        ready_counted(wire, sem, "_dsemaphore_svc")
    handle: Handle | None = None
    if where in ("release", "extend"):
        handle = granted(wire, sem)
    mark = len(wire.commands.names)
    operations: dict[str, Callable[[], object]] = {
        "ready": lambda: ready(sem),
        "acquire": lambda: sem.acquire("k"),
        "distinct": lambda: sem.acquire("k"),
        "release": lambda: handle is not None and handle.release(),
        "extend": lambda: handle is not None and handle.extend(5),
    }
    future_result = go(operations[where])
    # A hung-up acquire may have taken its slot: it releases by its token.
    expected = {
        "ready": ["createIndexes"],
        "acquire": ["update", "delete"],
        "distinct": ["update", "distinct", "delete"],
    }
    if where == "ready":
        wire.receive("createIndexes").hangup()
    elif where == "distinct":
        request = wire.receive("update")
        request.ok(duplicate(request))
        wire.receive("distinct").hangup()
        cleanup_of(wire, "_dsemaphore_svc", "k", token_of(request), 2)
    elif where == "acquire":
        request = wire.receive("update")
        request.hangup()
        cleanup_of(wire, "_dsemaphore_svc", "k", token_of(request), 2)
    else:
        wire.receive("delete" if where == "release" else "update").hangup()
    with pytest.raises(pymongo.errors.ConnectionFailure):
        future_result()
    sent = expected.get(where, ["delete" if where == "release" else "update"])
    assert wire.commands.since(mark) == sent


INDEX_CONFLICT = (
    "An existing index has the same name as the requested index. When index names are "
    "not specified, they are auto generated and can cause conflicts. Please refer to our "
    'documentation. Requested index: { v: 2, key: { expiredAt: 1 }, name: "expiredAt_1", '
    "expireAfterSeconds: 0 }, existing index: { v: 2, key: { expiredAt: 1 }, "
    'name: "expiredAt_1", expireAfterSeconds: 3600 }'
)


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_a_failing_create_indexes_surfaces_until_it_succeeds(wire: Wire, kind: Kind) -> None:
    collection = "_dmutex_svc" if kind == "mutex" else "_dsemaphore_svc"
    face = wire.make(kind, max_permits=3)

    future = go(ready, face)
    request = wire.receive("createIndexes")
    assert body(request) == create_indexes(collection)
    request.ok(command_error(85, "IndexOptionsConflict", INDEX_CONFLICT))
    with pytest.raises(pymongo.errors.OperationFailure, match="existing index") as raised:
        future()
    assert raised.value.code == 85
    assert wire.commands.names == ["createIndexes"]

    # The next operation tries createIndexes again and raises again; no upsert is sent.
    acquired = go(face.acquire, "k")
    wire.receive("createIndexes").ok(command_error(85, "IndexOptionsConflict", INDEX_CONFLICT))
    with pytest.raises(pymongo.errors.OperationFailure, match="existing index") as raised:
        acquired()
    assert raised.value.code == 85
    token = "7a0c9b1e-3d2f-4e6a-8b5c-1f0e9d8c7b6a"
    extended = go(face.extend, "k", token, 5)
    wire.receive("createIndexes").ok(command_error(13, "Unauthorized", "not authorized on dmutex"))
    with pytest.raises(pymongo.errors.OperationFailure, match="not authorized") as raised:
        extended()
    assert raised.value.code == 13
    assert wire.commands.names == ["createIndexes"] * 3

    # Once it succeeds, operations proceed, and createIndexes is never sent again.
    acquired = go(face.acquire, "k")
    body_sent = wire.receive("createIndexes")
    assert body(body_sent) == create_indexes(collection)
    body_sent.ok(CREATED)
    update = wire.receive("update")
    update.ok(inserted(update))
    lease = acquired()
    assert lease is not None
    released = go(lease.release)
    wire.receive("delete").ok(n=1)
    assert released() is True
    go(ready, face)()
    assert wire.commands.names == ["createIndexes"] * 4 + ["update", "delete"]


# --- 4. naive and tz-aware clients send the same commands --------------------------------


def without_token(document: dict[str, Any]) -> dict[str, Any]:
    """A command with the token (random per acquire) replaced by a marker."""
    copy: dict[str, Any] = body_dict(document)
    for update in copy.get("updates", []):
        if "value" in update["u"].get("$set", {}):
            update["u"]["$set"]["value"] = "<token>"
        for condition in update["q"].get("$or", []):
            if "value" in condition:
                condition["value"] = "<token>"
    return copy


def expiry_condition(query: dict[str, Any]) -> Any:
    """The ``expiredAt`` condition of a query: at its top, or an acquire's first ``$or`` arm."""
    return query["expiredAt"] if "expiredAt" in query else query["$or"][0]["expiredAt"]


def body_dict(document: Any) -> Any:
    """A deep copy as plain dicts and lists (mockupdb decodes to OrderedDict)."""
    if isinstance(document, dict):
        return {name: body_dict(value) for name, value in document.items() if name not in ENVELOPE}
    if isinstance(document, list):
        return [body_dict(value) for value in document]
    return document


def session_on(wire: Wire, client: Any) -> list[dict[str, Any]]:
    """acquire, extend and release of a semaphore on ``client``; the commands as received."""
    sem = wire.make("semaphore", max_permits=2, client=client)
    received: list[dict[str, Any]] = []
    ready_future = go(ready, sem)
    request = wire.receive("createIndexes")
    received.append(body_dict(request.doc))
    request.ok(CREATED)
    ready_future()

    acquired = go(sem.acquire, "k", 12.5)
    first = wire.receive("update")
    received.append(without_token(first.doc))
    first.ok(duplicate(first))
    distinct = wire.receive("distinct")
    received.append(body_dict(distinct.doc))
    # Both slots free by distinct's account: the one not tried first gets the upsert.
    distinct.ok(values=[])
    second = wire.receive("update")
    received.append(without_token(second.doc))
    second.ok(inserted(second))
    permit = acquired()
    assert permit is not None
    # Name the slots by try order, not number, so that both sessions compare equal.
    received[1]["updates"][0]["q"]["_id"] = "<first>"
    received[3]["updates"][0]["q"]["_id"] = "<second>"
    for request_doc in (received[1], received[3]):
        check = request_doc["updates"][0]
        assert type(check["u"]["$set"]["expiredAt"]) is datetime

    extended = go(permit.extend, 3)
    update = wire.receive("update")
    received.append(without_token(update.doc))
    update.ok(MATCHED)
    assert extended() is True
    assert permit.expired_at == START + timedelta(seconds=3)
    assert permit.expired_at.tzinfo is not None

    released = go(permit.release)
    delete = wire.receive("delete")
    received.append(body_dict(delete.doc))
    delete.ok(n=1)
    assert released() is True
    for document in received[4:]:
        for operation in document.get("updates", document.get("deletes", [])):
            operation["q"]["_id"] = "<slot>"
            operation["q"]["value"] = "<token>"
    return received


def test_naive_and_tz_aware_clients_send_the_same_commands(wire: Wire) -> None:
    aware = session_on(wire, wire.client(tz_aware=True))
    naive = session_on(wire, wire.client(tz_aware=False))
    assert aware == naive
    # And they are the dates of this clock, not shifted by a local offset.
    assert expiry_condition(aware[1]["updates"][0]["q"]) == {"$lte": at(START_MS)}
    assert aware[1]["updates"][0]["u"]["$set"]["expiredAt"] == at(START_MS + 12_500)
    assert aware[4]["updates"][0]["u"]["$set"]["expiredAt"] == at(START_MS + 3000)
    assert [next(iter(document)) for document in aware] == [
        "createIndexes",
        "update",
        "distinct",
        "update",
        "update",
        "delete",
    ]


# --- write concern: the client's own -----------------------------------------------------


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        pytest.param({}, None, id="default-sends-none"),
        pytest.param({"w": "majority"}, {"w": "majority"}, id="majority"),
        pytest.param({"w": 1, "wTimeoutMS": 500}, {"w": 1, "wtimeout": 500}, id="w1-wtimeout"),
        # What the docs advise for locks on a replica set: kept whole, never weakened.
        pytest.param(
            {"w": "majority", "journal": True, "wTimeoutMS": 2000},
            {"w": "majority", "j": True, "wtimeout": 2000},
            id="majority-journal",
        ),
    ],
)
def test_writes_carry_the_clients_write_concern(
    wire: Wire, options: dict[str, Any], expected: dict[str, Any] | None
) -> None:
    mutex = wire.make("mutex", client=wire.client(**options))
    ready_future = go(ready, mutex)
    create = wire.receive("createIndexes")
    create.ok(CREATED)
    ready_future()
    acquired = go(mutex.acquire, "k")
    update = wire.receive("update")
    update.ok(inserted(update))
    lock = acquired()
    assert lock is not None
    released = go(lock.release)
    delete = wire.receive("delete")
    delete.ok(n=1)
    assert released() is True
    for request in (create, update, delete):
        assert request.doc.get("writeConcern") == expected


def test_every_write_of_a_semaphore_carries_majority_and_journal(wire: Wire) -> None:
    """A semaphore's index, extend and release keep ``w="majority"`` and ``j`` as set."""
    expected = {"w": "majority", "j": True}
    sem = wire.make("semaphore", max_permits=3, client=wire.client(w="majority", journal=True))
    ready_future = go(ready, sem)
    create = wire.receive("createIndexes")
    create.ok(CREATED)
    ready_future()
    permit = granted(wire, sem, 20)
    extended = go(permit.extend, 30)
    extend = wire.receive("update")
    extend.ok(MATCHED)
    assert extended() is True
    released = go(permit.release)
    delete = wire.receive("delete")
    delete.ok(n=1)
    assert released() is True
    assert [r.doc.get("writeConcern") for r in (create, extend, delete)] == [expected] * 3

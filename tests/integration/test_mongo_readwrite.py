"""Read-write locks on MongoDB (``mongo_readwrite.py``): the layout, the rules, the requests.

Each test runs on mongomock (an imitation of pymongo, not a server; a
ManualClock) through both faces, and on the session's server
(``mongo_servers.py``: a MongoDB, or SecantusDB, a MongoDB-compatible server
that is not MongoDB; real time) through pymongo, pymongo's
``AsyncMongoClient`` and motor. Where there is no server those cases skip
with discovery's one line.

Requests are counted by name: on the server by a pymongo
``CommandListener`` (handshakes and heartbeats excluded), on mongomock by
the collection wrapper dmutex is handed, under the same names.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import bson
import mongomock
import motor.motor_asyncio
import pymongo
import pytest
from bson.codec_options import CodecOptions
from bson.int64 import Int64
from bson.raw_bson import RawBSONDocument
from pymongo import monitoring

from dmutex import (
    AsyncDReadWriteLock,
    DMutexError,
    DReadWriteLock,
    ManualClock,
    UnsupportedClientError,
)
from dmutex._core import waiting
from dmutex._core.lease import EPOCH, Lease, new_token
from tests._support.faces import FaceName, Handle, LoopThread
from tests._support.mongo_clients import AsyncMongomockClient, frozen_ttl_monitor
from tests._support.mongo_servers import Session, mongo_label
from tests._support.rwfaces import RWFace

COLLECTION = "_drwlock_svc"
# Commands the driver sends on its own: handshakes, heartbeats, session cleanup.
DRIVER_COMMANDS = frozenset({"hello", "ismaster", "endsessions", "ping", "buildinfo"})
LABEL = mongo_label()
CASES = [
    "mongomock-sync",
    "mongomock-async",
    f"pymongo-sync@{LABEL}",
    f"pymongo-async@{LABEL}",
    f"motor-async@{LABEL}",
]


# --- the rig ------------------------------------------------------------------------------


class Requests(monitoring.CommandListener):
    """The names of the requests made, as the server names its commands."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: list[str] = []

    def add(self, name: str) -> None:
        with self._lock:
            self._names.append(name)

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name.lower() not in DRIVER_COMMANDS:
            self.add(event.command_name)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass

    def take(self) -> list[str]:
        """The names since the last take."""
        with self._lock:
            names, self._names = self._names, []
        return names


class CountedCollection:
    """A mongomock collection (or its asyncio wrapper) that counts what dmutex asks of it."""

    def __init__(self, inner: Any, requests: Requests) -> None:
        self._inner = inner
        self._requests = requests

    def create_index(self, keys: Any, /, **options: Any) -> Any:
        self._requests.add("createIndexes")
        return self._inner.create_index(keys, **options)

    def find_one_and_update(self, filter: Any, update: Any, /, **options: Any) -> Any:
        self._requests.add("findAndModify")
        return self._inner.find_one_and_update(filter, update, **options)

    def find_one(self, filter: Any, /) -> Any:
        self._requests.add("find")
        return self._inner.find_one(filter)


@dataclass
class Databases:
    """A client whose ``get_database("dmutex")`` is ``db_name`` of ``inner``, its collections
    wrapped by ``wrap`` (any other database is an error: the tests' own database only)."""

    inner: Any
    db_name: str
    wrap: Callable[[Any], Any] = lambda collection: collection

    def get_database(self, name: str, /) -> Databases:
        assert name == "dmutex", name
        return self

    def get_collection(self, name: str, /) -> Any:
        return self.wrap(self.inner.get_database(self.db_name).get_collection(name))


@dataclass
class Env:
    """One case: a client of one face, the collection to inspect (sync), time, and requests."""

    case: str
    face: FaceName
    client: Any
    coll: Any  # a sync collection over the same documents
    clock: ManualClock | None
    requests: Requests
    loop: LoopThread | None = None
    closing: list[Callable[[], object]] = field(default_factory=list)

    def make(self, **options: Any) -> RWFace:
        if self.clock is not None:
            options.setdefault("clock", self.clock)
        return RWFace(self.face, self.client, loop=self.loop, **options)

    def now(self) -> datetime:
        return datetime.now(timezone.utc) if self.clock is None else self.clock.now()

    def doc(self, key: str = "doc") -> dict[str, Any] | None:
        found: dict[str, Any] | None = self.coll.find_one({"_id": f"rwlock:{key}"})
        return found

    def need_clock(self) -> ManualClock:
        if self.clock is None:
            pytest.skip("moves time: mongomock's ManualClock only")
        return self.clock


def _mongomock_env(case: str, face: FaceName, requests: Requests) -> Env:
    client: mongomock.MongoClient[dict[str, Any]] = mongomock.MongoClient()
    inner: Any = AsyncMongomockClient(client) if face == "async" else client
    counted = Databases(inner, "dmutex", lambda coll: CountedCollection(coll, requests))
    coll = client.get_database("dmutex").get_collection(COLLECTION)
    loop = LoopThread() if face == "async" else None
    return Env(case, face, counted, coll, ManualClock(), requests, loop)


def _server_env(case: str, face: FaceName, requests: Requests, session: Session) -> Env:
    server = session.fresh()
    coll = session.admin.get_database(server.db_name).get_collection(COLLECTION)
    if face == "sync":
        client: Any = server.client(event_listeners=[requests])
        env = Env(case, face, Databases(client, server.db_name), coll, None, requests)
        env.closing.append(client.close)
        return env
    loop = LoopThread()

    async def open_client() -> Any:
        if case.startswith("motor"):
            return motor.motor_asyncio.AsyncIOMotorClient(server.url, event_listeners=[requests])
        return server.async_client(event_listeners=[requests])

    inner = loop.run(open_client())
    env = Env(case, face, Databases(inner, server.db_name), coll, None, requests, loop)

    async def close() -> None:
        result = inner.close()
        if result is not None:
            await result  # pymongo's AsyncMongoClient.close is a coroutine; motor's is not

    env.closing.append(lambda: loop.run(close()))
    return env


@pytest.fixture(params=CASES)
def env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    case: str = request.param
    face: FaceName = "async" if "-async" in case else "sync"
    requests = Requests()
    if case.startswith("mongomock"):
        # mongomock's TTL imitation held still: expired documents stay, as
        # on a server whose monitor has not run yet.
        monkeypatch.setattr(mongomock, "utcnow", frozen_ttl_monitor)
        made = _mongomock_env(case, face, requests)
    else:
        session: Session = request.getfixturevalue("mongo_session")
        made = _server_env(case, face, requests, session)
    try:
        yield made
    finally:
        for close in made.closing:
            close()
        if made.loop is not None:
            made.loop.close()


def held(handle: Handle | None) -> Handle:
    assert handle is not None, "expected the hold to be granted"
    return handle


def fence_of(handle: Handle) -> int:
    assert handle.fence is not None, "read-write locks fence by default"
    return handle.fence


def at(ms: int) -> datetime:
    """Epoch ms as a datetime (UTC)."""
    return EPOCH + timedelta(milliseconds=ms)


def ms_of(moment: datetime) -> int:
    """A datetime as epoch ms; a naive one is UTC, as pymongo and mongomock give it back."""
    aware = moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)
    return (aware - EPOCH) // timedelta(milliseconds=1)


def send(face: RWFace, key: str, token: str, ttl_ms: int, *, write: bool) -> Lease | None:
    """One attempt of the store's own, with a token of the caller's (a re-sent request)."""
    engine = face.target._writing if write else face.target._reading
    drive: Any = face.target._drive
    lease: Lease | None = face.wait(drive(engine._store.acquire(key, token, ttl_ms, None)))
    return lease


# --- the rules ----------------------------------------------------------------------------


def test_readers_share_and_a_writer_keeps_everyone_out(env: Env) -> None:
    lock, other = env.make(), env.make()
    a, b = held(lock.acquire("read", "doc")), held(other.acquire("read", "doc"))
    assert other.acquire("write", "doc") is None
    assert a.release() is True
    assert other.acquire("write", "doc") is None, "one reader is still in"
    assert b.release() is True
    writer = held(other.acquire("write", "doc"))
    assert lock.acquire("read", "doc") is None
    assert lock.acquire("write", "doc") is None
    assert writer.release() is True
    held(lock.acquire("read", "doc"))


def test_max_readers(env: Env) -> None:
    lock = env.make(max_readers=2)
    a = held(lock.acquire("read", "doc"))
    held(lock.acquire("read", "doc"))
    assert lock.acquire("read", "doc") is None
    assert a.release() is True
    held(lock.acquire("read", "doc"))


def test_a_waiting_writers_intent_refuses_new_readers_and_a_grant_withdraws_it(env: Env) -> None:
    lock, writer = env.make(), env.make()
    reader = held(lock.acquire("read", "doc", ttl=60))
    granted, token, window_ms = writer.intend("doc", ttl=30, retry_delay=0.1)
    assert not granted
    assert window_ms == 2100
    stored = env.doc()
    assert stored is not None
    assert [entry["t"] for entry in stored["i"]] == [token]
    assert lock.acquire("read", "doc") is None, "a new reader passed a waiting writer"
    assert reader.extend(60) is True, "a reader already in keeps its lease"
    assert reader.release() is True
    won = send(writer, "doc", token, 30_000, write=True)
    assert won is not None, "the waiting writer gets in once the readers are gone"
    stored = env.doc()
    assert stored is not None
    assert stored["i"] == []
    assert stored["w"]["t"] == token


def test_a_dead_writers_intent_lapses(env: Env) -> None:
    clock = env.need_clock()
    lock, writer = env.make(), env.make()
    reader = held(lock.acquire("read", "doc", ttl=60))
    granted, _, window_ms = writer.intend("doc", ttl=30, retry_delay=0.1)
    assert not granted
    clock.advance((window_ms - 1) / 1000)
    assert lock.acquire("read", "doc") is None
    clock.advance(0.001)
    held(lock.acquire("read", "doc"))
    assert reader.release() is True


def test_a_refused_attempt_is_told_when_the_refusal_clears(env: Env) -> None:
    lock, writer = env.make(), env.make()
    start = env.now()
    held(lock.acquire("read", "doc", ttl=40))
    held(lock.acquire("read", "doc", ttl=50))
    engine = writer.target._writing
    waiter = waiting.waiter(0.1)
    waiter.token = new_token()
    drive: Any = writer.target._drive
    steps = engine._store.acquire("doc", waiter.token, 30_000, waiter)
    assert writer.wait(drive(steps)) is None
    assert waiter.expires_in is not None
    # The last reader's lease ends 50 s after the start, as this client reads time.
    assert 49 < waiter.expires_in <= 50
    assert env.now() - start < timedelta(seconds=1)


def test_a_resent_grant_finds_its_own_hold(env: Env) -> None:
    lock = env.make()
    for write in (False, True):
        token = new_token()
        first = send(lock, "doc", token, 10_000, write=write)
        assert first is not None
        if env.clock is not None:
            env.clock.advance(1)
        again = send(lock, "doc", token, 20_000, write=write)
        assert again is not None, "a re-sent attempt is granted as the first was"
        assert again.expires_ms > first.expires_ms
        assert again.fence is not None
        assert first.fence is not None
        assert again.fence > first.fence
        stored = env.doc()
        assert stored is not None
        holds = [stored["w"]] if write else stored["r"]
        assert [(h["t"], ms_of(h["e"])) for h in holds] == [(token, again.expires_ms)]
        assert lock.release_token("doc", token) is True


def test_release_and_extend_by_token_of_either_kind(env: Env) -> None:
    lock, other = env.make(), env.make()
    reader = held(lock.acquire("read", "doc", ttl=5))
    before = env.now()
    assert other.extend("doc", reader.token, 20) is True
    stored = env.doc()
    assert stored is not None
    extended = ms_of(stored["r"][0]["e"])
    assert ms_of(before) + 20_000 <= extended <= ms_of(env.now()) + 20_000
    assert other.extend("other", reader.token, 20) is False, "the wrong key"
    assert other.release_token("doc", reader.token) is True
    assert other.release_token("doc", reader.token) is False
    writer = held(lock.acquire("write", "doc", ttl=5))
    assert other.extend("doc", writer.token, 20) is True
    assert other.release_token("doc", writer.token) is True
    assert writer.release() is False
    stranger = str(uuid.uuid4())
    assert other.release_token("doc", stranger) is False
    assert other.extend("doc", stranger, 20) is False
    assert other.release_token("never", stranger) is False, "no document"
    assert other.extend("never", stranger, 20) is False


def test_extend_by_handle_keeps_to_its_kind(env: Env) -> None:
    lock = env.make()
    reader = held(lock.acquire("read", "doc", ttl=5))
    store = lock.target._reading._store
    drive: Any = lock.target._drive
    as_writer = store.extend("doc", reader.token, 0, 20_000)
    assert lock.wait(drive(as_writer)) is None, "a reader's hold is no writer's"
    as_reader = store.extend("doc", reader.token, 1, 20_000)
    assert lock.wait(drive(as_reader)) is not None


def test_fences_rise_and_a_writers_is_above_every_earlier_grant(env: Env) -> None:
    lock = env.make()
    start_us = ms_of(datetime.now(timezone.utc)) * 1000
    r1, r2 = held(lock.acquire("read", "doc")), held(lock.acquire("read", "doc"))
    assert r1.release()
    assert r2.release()
    w1 = held(lock.acquire("write", "doc"))
    assert w1.release()
    r3 = held(lock.acquire("read", "doc"))
    w2_refused = lock.acquire("write", "doc")
    assert w2_refused is None
    assert r3.release()
    w2 = held(lock.acquire("write", "doc"))
    seen = [fence_of(h) for h in (r1, r2, w1, r3, w2)]
    assert seen == sorted(set(seen)), "strictly rising"
    stored = env.doc()
    assert stored is not None
    assert stored["fence"] == seen[-1]
    assert lock.holders("doc").fence == seen[-1]
    if env.clock is None:
        # The server's clock is the floor (its $$NOW, in whole ms times 1,000).
        assert seen[0] >= start_us - 1000
    else:
        # mongomock has no $$NOW: its fences count on from 1.
        assert seen == [1, 2, 3, 4, 5]


def test_fencing_off_shows_no_fence(env: Env) -> None:
    lock = env.make(fencing=False)
    hold = held(lock.acquire("write", "doc"))
    assert hold.fence is None
    assert lock.holders("doc").fence is None


def test_holders(env: Env) -> None:
    lock = env.make()
    assert lock.holders("doc").holders == []
    a, b = held(lock.acquire("read", "doc")), held(lock.acquire("read", "doc"))
    found = lock.holders("doc")
    assert sorted((h.slot, h.token) for h in found.holders) == sorted([(1, a.token), (1, b.token)])
    assert a.release()
    assert b.release()
    writer = held(lock.acquire("write", "doc"))
    assert [(h.slot, h.token) for h in lock.holders("doc").holders] == [(0, writer.token)]


def test_expired_holds_count_for_nothing_and_go_with_the_next_write(env: Env) -> None:
    clock = env.need_clock()
    lock = env.make()
    writer = held(lock.acquire("write", "doc", ttl=5))
    clock.advance(5)
    assert writer.extend() is False
    reader = held(lock.acquire("read", "doc", ttl=7))
    stored = env.doc()
    assert stored is not None
    assert stored["w"] is None
    assert [h["t"] for h in stored["r"]] == [reader.token]
    assert fence_of(reader) > fence_of(writer)


# --- the layout, byte for byte ---------------------------------------------------------------


def test_ready_creates_the_ttl_index(env: Env) -> None:
    lock = env.make()
    lock.wait(lock.target.ready())
    index = env.coll.index_information()["expiredAt_1"]
    assert index["key"] == [("expiredAt", 1)]
    assert index["expireAfterSeconds"] == 0


def test_the_document_byte_for_byte(env: Env) -> None:
    lock, writer = env.make(max_readers=3), env.make()
    a = held(lock.acquire("read", "doc", ttl=30))
    b = held(lock.acquire("read", "doc", ttl=45.5))
    before = env.now()
    granted, token, window_ms = writer.intend("doc", ttl=30, retry_delay=0.5)
    assert not granted
    stored = env.doc()
    assert stored is not None
    intent_ms = ms_of(stored["i"][0]["e"])
    expected = {
        "_id": "rwlock:doc",
        "kind": "dmutex-rwlock",
        "w": None,
        "r": [
            {"t": a.token, "e": a.expired_at},
            {"t": b.token, "e": b.expired_at},
        ],
        "i": [{"t": token, "e": at(intent_ms)}],
        "fence": Int64(fence_of(b)),
        "expiredAt": b.expired_at,
    }
    assert window_ms == 2500, "retry_delay + 2 s"
    assert ms_of(before) + window_ms <= intent_ms <= ms_of(env.now()) + window_ms
    _check_bytes(env, expected)
    assert writer.release_token("doc", token) is False, "an intent is no hold"
    assert a.release() is True
    b_writer = env.make()
    assert b.release() is True
    w = held(b_writer.acquire("write", "doc", ttl=12.3451))
    _check_bytes(
        env,
        {
            "_id": "rwlock:doc",
            "kind": "dmutex-rwlock",
            "w": {"t": w.token, "e": w.expired_at},
            "r": [],
            "i": [],
            "fence": Int64(fence_of(w)),
            "expiredAt": w.expired_at,
        },
    )
    before = env.now()
    assert w.release() is True
    stored = env.doc()
    assert stored is not None
    assert (stored["w"], stored["r"], stored["i"]) == (None, [], [])
    # Nothing is left: expiredAt is the release's now, so the TTL monitor removes it soon.
    assert ms_of(before) <= ms_of(stored["expiredAt"]) <= ms_of(env.now())


def _check_bytes(env: Env, expected: dict[str, Any]) -> None:
    """The stored document is ``expected``: its BSON bytes on a server, its fields in order."""
    stored = env.doc()
    assert stored is not None
    assert list(stored) == list(expected), "the field order"
    if env.clock is not None:
        # mongomock keeps Python values, not BSON: dates naive UTC, the fence an int.
        plain = {**expected, "fence": int(expected["fence"])}
        assert stored == _naive(plain)
        return
    raw_coll = env.coll.with_options(codec_options=CodecOptions(document_class=RawBSONDocument))
    raw = raw_coll.find_one({"_id": expected["_id"]})
    assert raw is not None
    assert raw.raw == bson.encode(expected)


def _naive(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc).replace(tzinfo=None)
    if isinstance(value, dict):
        return {k: _naive(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_naive(v) for v in value]
    return value


# --- a document dmutex did not write ------------------------------------------------------


def test_a_foreign_document_raises_and_is_left_untouched(env: Env) -> None:
    foreign = {
        "_id": "rwlock:doc",
        "value": "someone else's",
        "expiredAt": datetime(2030, 1, 1, tzinfo=timezone.utc),
    }
    env.coll.insert_one(dict(foreign))
    lock = env.make()
    token = str(uuid.uuid4())
    attempts: list[Callable[[], object]] = [
        lambda: lock.acquire("read", "doc"),
        lambda: lock.acquire("write", "doc"),
        lambda: lock.release_token("doc", token),
        lambda: lock.extend("doc", token, 10),
        lambda: lock.holders("doc"),
    ]
    for attempt in attempts:
        with pytest.raises(DMutexError, match="did not write"):
            attempt()
        assert list(_naive(env.doc()).items()) == list(_naive(foreign).items())
    assert env.coll.count_documents({}) == 1


# --- one request per operation --------------------------------------------------------------


def test_one_request_per_operation(env: Env) -> None:
    lock = env.make()
    env.requests.take()
    lock.wait(lock.target.ready())
    assert env.requests.take() == ["createIndexes"]
    reader = held(lock.acquire("read", "doc"))
    assert env.requests.take() == ["findAndModify"], "a first acquire: the upsert inserts"
    assert lock.acquire("write", "doc") is None
    assert env.requests.take() == ["findAndModify"], "a refused writer, its intent and all"
    held(lock.acquire("read", "doc"))
    assert env.requests.take() == ["findAndModify"]
    assert reader.extend(30) is True
    assert env.requests.take() == ["findAndModify"]
    assert lock.holders("doc").holders
    assert env.requests.take() == ["find"]
    assert reader.release() is True
    assert env.requests.take() == ["findAndModify"]
    assert lock.release_token("never", reader.token) is False
    assert env.requests.take() == ["findAndModify"], "no document: still one request"
    assert lock.extend("never", reader.token, 30) is False
    assert env.requests.take() == ["findAndModify"]


# --- the faces -----------------------------------------------------------------------------


def test_a_client_of_the_other_face_is_refused_before_any_request() -> None:
    sync_client: Any = pymongo.MongoClient(connect=False)
    async_client: Any = pymongo.AsyncMongoClient(connect=False)
    try:
        with pytest.raises(UnsupportedClientError, match="asyncio collection"):
            DReadWriteLock("svc", async_client)
        with pytest.raises(UnsupportedClientError, match="sync collection"):
            AsyncDReadWriteLock("svc", sync_client)
    finally:
        sync_client.close()

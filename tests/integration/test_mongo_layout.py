"""The TypeScript dmutex's MongoDB layout, on mongomock (an imitation of pymongo, not a server)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import mongomock
import pytest
from pymongo.errors import DuplicateKeyError

from dmutex import DMutex, DMutexError, DSemaphore, ManualClock
from tests._support.mongo_clients import frozen_ttl_monitor


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    """The instances' clock; mongomock's TTL imitation is held still beside it."""
    monkeypatch.setattr(mongomock, "utcnow", frozen_ttl_monitor)
    return ManualClock()


def test_documents_indexes_and_names(clock: ManualClock) -> None:
    client: mongomock.MongoClient[dict[str, Any]] = mongomock.MongoClient()
    sem = DSemaphore("orders", client, max_permits=3, clock=clock)
    sem.ready()
    permits = [sem.acquire("api", ttl=12.3451) for _ in range(3)]
    lock = DMutex("orders", client, clock=clock).acquire("job", ttl=60)
    assert lock is not None
    assert client.list_database_names() == ["dmutex"]
    database = client.get_database("dmutex")
    assert sorted(database.list_collection_names()) == ["_dmutex_orders", "_dsemaphore_orders"]
    stored = {doc["_id"]: doc for doc in database.get_collection("_dsemaphore_orders").find()}
    expected = clock.now() + timedelta(milliseconds=12346)
    assert stored == {
        f"permit:{p.slot}:api": {
            "_id": f"permit:{p.slot}:api",
            "value": p.token,
            # mongomock, like pymongo without tz_aware, gives naive UTC back.
            "expiredAt": expected.replace(tzinfo=None),
        }
        for p in permits
        if p is not None
    }
    assert sorted(stored) == [f"permit:{i}:api" for i in range(3)]
    (mutex_doc,) = database.get_collection("_dmutex_orders").find()
    assert mutex_doc == {
        "_id": "permit:0:job",
        "value": lock.token,
        "expiredAt": lock.expired_at.replace(tzinfo=None),
    }
    for name in ("_dsemaphore_orders", "_dmutex_orders"):
        index = database.get_collection(name).index_information()["expiredAt_1"]
        assert index["key"] == [("expiredAt", 1)]
        assert index["expireAfterSeconds"] == 0


def test_db_and_collection_options(clock: ManualClock) -> None:
    client: mongomock.MongoClient[dict[str, Any]] = mongomock.MongoClient()
    DMutex("svc", client, db_name="locks", collection_prefix="lk_", clock=clock).acquire("a")
    DMutex("svc", client, db_name="locks", collection_name="chosen", clock=clock).acquire("b")
    assert sorted(client.get_database("locks").list_collection_names()) == ["chosen", "lk_svc"]


def test_a_document_written_by_the_typescript_library_is_honoured(clock: ManualClock) -> None:
    client: mongomock.MongoClient[dict[str, Any]] = mongomock.MongoClient()
    collection = client.get_database("dmutex").get_collection("_dsemaphore_svc")
    collection.insert_one(
        {
            "_id": "permit:0:api",
            "value": "ts-token",
            "expiredAt": clock.now() + timedelta(minutes=1),
        }
    )
    sem = DSemaphore("svc", client, max_permits=2, clock=clock)
    mine = sem.acquire("api")
    assert mine is not None
    assert mine.slot == 1
    assert sem.acquire("api") is None
    assert sem.release("api", "ts-token") is True
    assert collection.find_one({"_id": "permit:0:api"}) is None


# --- fence counters (fencing=True) ------------------------------------------------------


def test_fence_counter_document_beside_the_slots(clock: ManualClock) -> None:
    client: mongomock.MongoClient[dict[str, Any]] = mongomock.MongoClient()
    sem = DSemaphore("orders", client, max_permits=2, clock=clock, fencing=True)
    permits = [sem.acquire("api", ttl=60) for _ in range(2)]
    assert [p.fence for p in permits if p is not None] == [1, 2]
    collection = client.get_database("dmutex").get_collection("_dsemaphore_orders")
    counter = collection.find_one({"_id": "fence:api"})
    assert counter == {"_id": "fence:api", "kind": "dmutex-fence", "fence": 2}
    assert "expiredAt" not in counter, "the TTL index never removes it"
    unfenced = DSemaphore("orders", client, max_permits=2, clock=clock)
    assert all(p is not None and p.release() for p in permits)
    assert held_fence(unfenced.acquire("api", ttl=60)) is None, "the default keeps no fence"
    assert collection.find_one({"_id": "fence:api"}) == counter, "and leaves the counter alone"


def held_fence(handle: object) -> object:
    assert handle is not None
    return getattr(handle, "fence")  # noqa: B009 - a handle of either kind


@pytest.mark.parametrize("foreign", [{"fence": 7}, {"kind": "other", "fence": 7}, {"x": 1}])
def test_a_foreign_fence_document_is_never_written(
    clock: ManualClock, foreign: dict[str, object]
) -> None:
    """A document at the counter's _id that dmutex did not write: the acquire raises,
    the document is unchanged, and the slot the acquire took is released (rule 6)."""
    client: mongomock.MongoClient[dict[str, Any]] = mongomock.MongoClient()
    collection = client.get_database("dmutex").get_collection("_dmutex_svc")
    collection.insert_one({"_id": "fence:job", **foreign})
    mutex = DMutex("svc", client, clock=clock, fencing=True)
    with pytest.raises(DMutexError, match="dmutex did not write"):
        mutex.acquire("job", ttl=60)
    assert collection.find_one({"_id": "fence:job"}) == {"_id": "fence:job", **foreign}
    assert collection.find_one({"_id": "permit:0:job"}) is None, "nothing left held"


def test_two_first_acquires_creating_the_counter_at_once_both_get_fences(
    clock: ManualClock,
) -> None:
    """The counter's first upsert may collide with another acquire's: it is tried once more."""
    client: mongomock.MongoClient[dict[str, Any]] = mongomock.MongoClient()
    inner = client.get_database("dmutex").get_collection("_dmutex_svc")

    class Racing:
        """The collection, where the first counter upsert meets a rival's insert first."""

        raced = False

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        def find_one_and_update(self, *args: Any, **kwargs: Any) -> Any:
            if not self.raced:
                self.raced = True
                inner.insert_one({"_id": "fence:job", "kind": "dmutex-fence", "fence": 1})
                raise DuplicateKeyError("E11000 duplicate key (a rival's insert)", code=11000)
            return inner.find_one_and_update(*args, **kwargs)

    class Database:
        def get_collection(self, name: str) -> Racing:
            return Racing()

    class Client:
        def get_database(self, name: str) -> Database:
            return Database()

    lock = DMutex("svc", Client(), clock=clock, fencing=True).acquire("job", ttl=60)
    assert lock is not None
    assert lock.fence == 2, "after the rival's 1"

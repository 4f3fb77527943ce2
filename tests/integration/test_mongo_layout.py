"""The TypeScript dmutex's MongoDB layout, on mongomock (an imitation of pymongo, not a server)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import mongomock
import pytest

from dmutex import DMutex, DSemaphore, ManualClock
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

"""A full MongoDB semaphore on a real server: two requests, and the index behind the second.

The server is the session's (``tests/_support/mongo_servers.py``): a MongoDB
(``MONGODB_URL``, a container, ``mongod``) or SecantusDB, a MongoDB-compatible
server that is not MongoDB. The holders are written with one ``insert_many``,
as other callers' leases, so that a 1,024-permit semaphore is full at once.

What the store sends is read from a pymongo ``CommandListener``, and the
``distinct`` it sends is explained as sent, not rebuilt by hand.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import pymongo
import pymongo.monitoring
import pytest
from pymongo.collection import Collection

from dmutex import MAX_PERMITS, DSemaphore
from tests._support import mongo_servers
from tests._support.mongo_servers import Doc, RedirectedClient, Session

# Commands the driver sends on its own: handshakes, heartbeats, session cleanup.
DRIVER_COMMANDS = frozenset({"hello", "ismaster", "endsessions", "ping", "buildinfo"})
# Fields the driver adds to every command; the rest is what dmutex asked for.
ENVELOPE = frozenset({"lsid", "$db", "$clusterTime", "$readPreference", "readConcern"})
COLLECTION = "_dsemaphore_svc"
KEY = "api"
DUPLICATE_KEY = 11000
INDEX_SCANS = frozenset({"IXSCAN", "DISTINCT_SCAN"})

# Servers whose explain is known to disagree with mongod's here, and how.
EXPLAIN_DEVIATIONS = {
    "secantusdb-0.7.0b3": (
        "SecantusDB 0.7.0b3 explains a filter of two fields as a COLLSCAN "
        "(Storage._pick_index_for_filter has no per-clause fallback), while it executes "
        "it by point lookups of the _id $in (Storage._try_index_id_keys tries one clause "
        "at a time, _id first)"
    ),
}
LABEL = mongo_servers.mongo_label()


@dataclass
class Sent:
    """One command a client sent: its name, its body (no envelope), and the reply."""

    name: str
    body: dict[str, Any]
    reply: Mapping[str, Any] | None = None


@dataclass
class Commands(pymongo.monitoring.CommandListener):
    """Every command a client sends, with its reply; handshakes and heartbeats left out."""

    sent: list[Sent] = field(default_factory=list)
    _by_id: dict[int, Sent] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def started(self, event: pymongo.monitoring.CommandStartedEvent) -> None:
        if event.command_name.lower() in DRIVER_COMMANDS:
            return
        body = {name: value for name, value in event.command.items() if name not in ENVELOPE}
        with self._lock:
            self._by_id[event.request_id] = entry = Sent(event.command_name, body)
            self.sent.append(entry)

    def succeeded(self, event: pymongo.monitoring.CommandSucceededEvent) -> None:
        with self._lock:
            entry = self._by_id.pop(event.request_id, None)
        if entry is not None:
            entry.reply = event.reply

    def failed(self, event: pymongo.monitoring.CommandFailedEvent) -> None:
        with self._lock:
            self._by_id.pop(event.request_id, None)

    @property
    def names(self) -> list[str]:
        return [entry.name for entry in self.sent]


@dataclass
class Rig:
    """A semaphore on a client of its own, the commands it sends, and the collection."""

    session: Session
    client: pymongo.MongoClient[Doc]
    commands: Commands

    @property
    def collection(self) -> Collection[Doc]:
        return self.session.admin.get_database(self.session.db_name).get_collection(COLLECTION)

    def semaphore(self, permits: int) -> DSemaphore:
        """A ready ``DSemaphore("svc", max_permits=permits)``; the commands start empty."""
        sem = DSemaphore(
            "svc", RedirectedClient(self.client, self.session.db_name), max_permits=permits
        )
        sem.ready()
        self.commands.sent.clear()
        return sem


@pytest.fixture
def rig(mongo_session: Session) -> Iterator[Rig]:
    """The session's server, its test database empty, and a client counting commands."""
    server = mongo_session.fresh()
    commands = Commands()
    # No retries: a retried command would be a second request for one operation.
    client = server.client(event_listeners=[commands], retryWrites=False, retryReads=False)
    try:
        yield Rig(mongo_session, client, commands)
    finally:
        client.close()


def permit_ids(key: str, permits: int) -> list[str]:
    return [f"permit:{slot}:{key}" for slot in range(permits)]


def hold_all(coll: Collection[Doc], key: str, permits: int, until: datetime) -> None:
    """Every slot of ``key`` held until ``until`` by a token that is not the caller's."""
    coll.insert_many(
        [
            {"_id": slot_id, "value": f"other-{slot}", "expiredAt": until}
            for slot, slot_id in enumerate(permit_ids(key, permits))
        ]
    )


def later(minutes: int) -> datetime:
    return datetime.now(timezone.utc) + timedelta(minutes=minutes)


def index_scans(node: Any) -> list[str]:
    """The index names of every index scan in a plan tree, in tree order.

    An index scan is an ``IXSCAN``, or the ``DISTINCT_SCAN`` a mongod may plan
    for ``distinct`` instead. Walks ``inputStage``/``inputStages`` and the
    ``queryPlan`` a mongod that runs the slot-based engine nests its plan under.
    """
    if isinstance(node, list):
        return [name for child in node for name in index_scans(child)]
    if not isinstance(node, Mapping):
        return []
    found = [str(node.get("indexName"))] if node.get("stage") in INDEX_SCANS else []
    for child in ("queryPlan", "inputStage", "inputStages"):
        found += index_scans(node.get(child))
    return found


# --- a full semaphore: at most two requests ------------------------------------------------


@pytest.mark.parametrize("label", [LABEL])
@pytest.mark.parametrize(
    ("permits", "expected"),
    [
        pytest.param(1, ["update"], id="1"),
        pytest.param(64, ["update", "distinct"], id="64"),
        pytest.param(MAX_PERMITS, ["update", "distinct"], id="max"),
    ],
)
def test_a_full_semaphore_answers_none_in_at_most_two_requests(
    rig: Rig, label: str, permits: int, expected: list[str]
) -> None:
    sem = rig.semaphore(permits)
    until = later(60)
    hold_all(rig.collection, KEY, permits, until)
    before = {doc["_id"]: doc for doc in rig.collection.find()}

    assert sem.acquire(KEY) is None
    assert rig.commands.names == expected
    # The upsert collided with an active slot: duplicate key, the one "held" answer.
    upsert = rig.commands.sent[0]
    assert upsert.reply is not None
    assert [error["code"] for error in upsert.reply["writeErrors"]] == [DUPLICATE_KEY]
    if permits > 1:
        distinct = rig.commands.sent[1]
        assert distinct.body["key"] == "_id"
        assert sorted(distinct.body["query"]["_id"]["$in"]) == sorted(permit_ids(KEY, permits))
        assert distinct.reply is not None
        assert sorted(distinct.reply["values"]) == sorted(permit_ids(KEY, permits))
    assert {doc["_id"]: doc for doc in rig.collection.find()} == before, "a holder was displaced"


# --- the distinct of active slots: served by the _id index -----------------------------------

# Active leases of other keys, expiring before the full key's: a scan of the
# TTL index (expiredAt_1) from "now" meets all of them first, so a planner that
# compares both plans sees the _id_ one finish while the other has found nothing.
OTHER_KEYS = 8
OTHER_PERMITS = 64


def explain_marks(label: str) -> list[pytest.MarkDecorator]:
    reason = EXPLAIN_DEVIATIONS.get(label)
    return [] if reason is None else [pytest.mark.xfail(reason=reason, strict=True)]


@pytest.mark.parametrize("label", [pytest.param(LABEL, marks=explain_marks(LABEL))])
def test_the_distinct_of_active_slots_is_served_by_the_id_index(rig: Rig, label: str) -> None:
    sem = rig.semaphore(64)
    for other in range(OTHER_KEYS):
        hold_all(rig.collection, f"other-{other}", OTHER_PERMITS, later(30))
    hold_all(rig.collection, KEY, 64, later(60))

    assert sem.acquire(KEY) is None
    assert rig.commands.names == ["update", "distinct"]
    sent = rig.commands.sent[1].body
    database = rig.session.admin.get_database(rig.session.db_name)
    reply = database.command({"explain": sent, "verbosity": "queryPlanner"})
    plan = reply.get("queryPlanner", {}).get("winningPlan")
    if not plan:
        pytest.skip(f"{label}: explain of distinct reports no winning plan: {reply!r}")
    assert index_scans(plan) == ["_id_"], f"winning plan: {plan!r}"


def test_index_scans_finds_the_scans_at_any_depth() -> None:
    # Plan shapes as mongod's explain nests them (written here, not captured).
    ixscan = {"stage": "IXSCAN", "indexName": "_id_", "keyPattern": {"_id": 1}}
    fetch = {"stage": "FETCH", "filter": {"expiredAt": {}}, "inputStage": ixscan}
    classic = {"stage": "PROJECTION_DEFAULT", "inputStage": fetch}
    slot_based = {"queryPlan": classic, "slotBasedPlan": {"stages": "..."}}
    both = {"stage": "OR", "inputStages": [ixscan, {**ixscan, "indexName": "expiredAt_1"}]}
    distinct_scan = {
        "stage": "PROJECTION_COVERED",
        "inputStage": {**ixscan, "stage": "DISTINCT_SCAN"},
    }
    assert index_scans(classic) == ["_id_"]
    assert index_scans(slot_based) == ["_id_"]
    assert index_scans(both) == ["_id_", "expiredAt_1"]
    assert index_scans(distinct_scan) == ["_id_"]
    assert index_scans({"stage": "COLLSCAN", "filter": {}}) == []

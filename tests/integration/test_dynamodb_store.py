"""The DynamoDB store on servers that speak its protocol: requests counted, layout, foreign items.

On moto's server and on dynalite (neither is DynamoDB). Requests are
counted by botocore's own ``before-call`` event, once per operation the
client is asked for (botocore's retries of one call are not counts of
dmutex's). What is checked:

- the requests of each operation, as the documentation's table gives them
  (a mutex acquire: one PutItem, free, held or expired; a semaphore's:
  one when the slot tried first is free, one more BatchGetItem per 100
  permits when it is not, plus one PutItem per free slot tried; release
  and extend: one; a fenced grant: one UpdateItem more; ``holders``: one
  BatchGetItem per 100 items; a read-write change: a GetItem and a
  PutItem, a refused reader the GetItem alone);
- the items byte for byte: a slot ``{key, value, expiredAt}`` with the
  expiry the handle shows, the fence counter ``{key, kind, fence}``, a
  read-write lock's ``{key, value, expiredAt}`` with the SQL stores' JSON;
- items dmutex did not write: a fence item of another shape makes a fenced
  acquire raise and leaves the slot released; a read-write item of another
  shape makes every operation raise and is left as it is; a table whose
  key is not the string ``key`` is refused by ``ready()``.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from dmutex import DMutex, DMutexError, DReadWriteLock, DSemaphore
from dmutex._backends.dynamodb.readwrite import FOREVER_MS
from tests._support.dynamodb_servers import Server, Session


class Counted:
    """A boto3 client of ``server`` whose calls are counted by operation name."""

    def __init__(self, server: Server) -> None:
        self.client = server.client()
        self.calls: Counter[str] = Counter()
        self.client.meta.events.register("before-call.dynamodb.*", self._count)

    def _count(self, model: Any, **_: Any) -> None:
        self.calls[model.name] += 1

    def take(self) -> dict[str, int]:
        """The calls counted since the last take, and a fresh count."""
        counted, self.calls = dict(self.calls), Counter()
        return counted


@pytest.fixture
def counted(dynamodb_server: Server) -> Iterator[Counted]:
    made = Counted(dynamodb_server)
    yield made
    made.client.close()


@pytest.fixture
def table(
    dynamodb_session: Session, counted: Counted, request: pytest.FixtureRequest
) -> Iterator[str]:
    """A table name of the session's, deleted after the test (if it was made)."""
    name = dynamodb_session.table_name(f"store-{abs(hash(request.node.nodeid)) % 10**8}")
    yield name
    with contextlib.suppress(counted.client.exceptions.ResourceNotFoundException):
        counted.client.delete_table(TableName=name)


def item(counted: Counted, table: str, name: str) -> dict[str, Any] | None:
    found = counted.client.get_item(
        TableName=table, Key={"key": {"S": name}}, ConsistentRead=True
    ).get("Item")
    return None if found is None else dict(found)


def test_a_mutex_costs_one_request_an_operation(counted: Counted, table: str) -> None:
    mutex = DMutex("svc", counted.client, table_name=table)
    mutex.ready()
    counted.take()
    lock = mutex.acquire("job", 60)
    assert lock is not None
    assert counted.take() == {"PutItem": 1}
    assert mutex.acquire("job", 60) is None
    assert counted.take() == {"PutItem": 1}, "held: the refused put is the answer"
    assert lock.extend(30) is True
    assert counted.take() == {"UpdateItem": 1}
    assert lock.release() is True
    assert counted.take() == {"DeleteItem": 1}
    assert lock.release() is False
    assert counted.take() == {"DeleteItem": 1}


def test_ready_makes_the_table_once_and_finds_it_after(counted: Counted, table: str) -> None:
    DMutex("svc", counted.client, table_name=table).ready()
    made = counted.take()
    assert made["CreateTable"] == 1
    assert made["DescribeTable"] >= 2, "once to find none, then until ACTIVE"
    DMutex("svc", counted.client, table_name=table).ready()
    assert counted.take() == {"DescribeTable": 1}, "an ACTIVE table: one request, no creation"
    described = counted.client.describe_table(TableName=table)["Table"]
    assert described["KeySchema"] == [{"AttributeName": "key", "KeyType": "HASH"}]
    assert described["AttributeDefinitions"] == [{"AttributeName": "key", "AttributeType": "S"}]
    assert described["BillingModeSummary"]["BillingMode"] == "PAY_PER_REQUEST"


def test_the_slot_item_is_the_typescript_stores(counted: Counted, table: str) -> None:
    lock = DMutex("svc", counted.client, table_name=table).acquire("job", 60)
    assert lock is not None
    stored = item(counted, table, "permit:0:job")
    expires = round(lock.expired_at.timestamp() * 1000)
    assert stored == {
        "key": {"S": "permit:0:job"},
        "value": {"S": lock.token},
        "expiredAt": {"N": str(expires)},
    }
    assert lock.release() is True
    assert item(counted, table, "permit:0:job") is None, "a release deletes the item"


@pytest.mark.parametrize("permits", [3, 150])
def test_a_semaphore_reads_every_slot_only_when_its_first_is_held(
    counted: Counted, table: str, permits: int
) -> None:
    semaphore = DSemaphore("svc", counted.client, max_permits=permits, table_name=table)
    semaphore.ready()
    counted.take()
    taken = []
    batches = -(-permits // 100)
    for _ in range(permits):
        permit = semaphore.acquire("pool", 60)
        assert permit is not None
        taken.append(permit)
        calls = counted.take()
        assert calls.get("BatchGetItem", 0) in (0, batches)
        if not calls.get("BatchGetItem"):
            assert calls == {"PutItem": 1}, "the slot tried first was free"
        else:
            assert calls["PutItem"] >= 2, "the held first, then a free one (or more: races)"
    assert sorted(p.slot for p in taken) == list(range(permits))
    assert semaphore.acquire("pool", 60) is None
    assert counted.take() == {"PutItem": 1, "BatchGetItem": batches}, "full: one try, one read"
    assert semaphore.release("pool", taken[-1].token) is True
    assert counted.take() == {"BatchGetItem": batches, "DeleteItem": 1}, "by token: the slot read"
    assert taken[0].release() is True
    assert counted.take() == {"DeleteItem": 1}, "by handle: the slot known"
    assert len(semaphore.holders("pool")) == permits - 2
    assert counted.take() == {"BatchGetItem": -(-(permits + 1) // 100)}, "slots and fence"


def test_a_fenced_grant_moves_the_counter_item_in_one_more_request(
    counted: Counted, table: str
) -> None:
    mutex = DMutex("svc", counted.client, table_name=table, fencing=True)
    mutex.ready()
    counted.take()
    fences = []
    for _ in range(3):
        lock = mutex.acquire("job", 60)
        assert lock is not None
        assert counted.take() == {"PutItem": 1, "UpdateItem": 1}
        assert lock.fence is not None
        fences.append(lock.fence)
        assert lock.release() is True
        counted.take()
    assert fences == sorted(set(fences)), "strictly increasing"
    stored = item(counted, table, "fence:job")
    assert stored == {
        "key": {"S": "fence:job"},
        "kind": {"S": "dmutex-fence"},
        "fence": {"N": str(fences[-1])},
    }
    # A counter ahead of the clock moves by one, in a second update.
    ahead = fences[-1] + 10**12
    counted.client.put_item(
        TableName=table,
        Item={"key": {"S": "fence:job"}, "kind": {"S": "dmutex-fence"}, "fence": {"N": str(ahead)}},
    )
    counted.take()
    lock = mutex.acquire("job", 60)
    assert lock is not None
    assert lock.fence == ahead + 1
    assert counted.take() == {"PutItem": 1, "UpdateItem": 2}
    assert lock.release() is True


def test_a_fence_item_dmutex_did_not_write_is_left_and_the_slot_released(
    counted: Counted, table: str
) -> None:
    mutex = DMutex("svc", counted.client, table_name=table, fencing=True)
    mutex.ready()
    foreign = {"key": {"S": "fence:job"}, "value": {"S": "someone else's"}}
    counted.client.put_item(TableName=table, Item=foreign)
    with pytest.raises(DMutexError, match="did not write"):
        mutex.acquire("job", 60)
    assert item(counted, table, "fence:job") == foreign
    assert item(counted, table, "permit:0:job") is None, "the engine released the slot"
    assert DMutex("svc", counted.client, table_name=table).acquire("job", 60) is not None


def test_a_table_of_another_key_is_refused_before_any_lock_request(
    counted: Counted, table: str
) -> None:
    counted.client.create_table(
        TableName=table,
        AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
        BillingMode="PAY_PER_REQUEST",
    )
    counted.take()
    with pytest.raises(DMutexError, match="partition key 'key' of type S"):
        DMutex("svc", counted.client, table_name=table).acquire("job", 60)
    calls = counted.take()
    assert set(calls) == {"DescribeTable"}, f"no lock request: {calls}"


def test_a_readwrite_change_is_a_read_and_a_compare_and_set(counted: Counted, table: str) -> None:
    lock = DReadWriteLock("svc", counted.client, table_name=table)
    lock.ready()
    counted.take()
    reader = lock.acquire_read("doc", 60)
    assert reader is not None
    assert counted.take() == {"GetItem": 1, "PutItem": 1}
    assert lock.acquire_write("doc", 60) is None
    assert counted.take() == {"GetItem": 1}, "refused, nothing changed: the read alone"
    stored = item(counted, table, "rwlock:doc")
    assert stored is not None
    assert stored["expiredAt"] == {"N": str(FOREVER_MS)}
    state = json.loads(stored["value"]["S"])
    assert list(state) == ["dmutex", "w", "r", "i", "f"]
    assert state["r"] == {reader.token: round(reader.expired_at.timestamp() * 1000)}
    counted.take()
    assert reader.release() is True
    assert counted.take() == {"GetItem": 1, "PutItem": 1}
    assert item(counted, table, "rwlock:doc") is not None, "kept: it is the key's fence counter"


def test_a_readwrite_item_dmutex_did_not_write_raises_and_is_left(
    counted: Counted, table: str
) -> None:
    lock = DReadWriteLock("svc", counted.client, table_name=table)
    lock.ready()
    foreign = {"key": {"S": "rwlock:doc"}, "value": {"S": '{"someone":"else"}'}}
    counted.client.put_item(TableName=table, Item=foreign)
    for attempt in (lambda: lock.acquire_read("doc", 60), lambda: lock.acquire_write("doc", 60)):
        with pytest.raises(DMutexError, match="did not write"):
            attempt()
    assert item(counted, table, "rwlock:doc") == foreign

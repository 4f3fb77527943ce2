"""How the DynamoDB store reads answers, with no server: errors, waits, unprocessed keys.

A scripted client stands in for botocore's: each operation answers the
next item of its script, a dictionary as botocore parses DynamoDB's JSON,
or raises an error shaped as botocore's ``ClientError`` (dmutex reads its
``response["Error"]["Code"]`` and nothing else). Time is a ManualClock, so
the table's polling and the batch reads' pauses are read, not waited.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from dmutex import DMutex, DMutexError, DSemaphore, ManualClock
from dmutex._backends.dynamodb import table as table_module

ACTIVE = {
    "Table": {
        "TableStatus": "ACTIVE",
        "KeySchema": [{"AttributeName": "key", "KeyType": "HASH"}],
        "AttributeDefinitions": [{"AttributeName": "key", "AttributeType": "S"}],
    }
}


class ClientError(Exception):
    """Shaped as botocore's: only ``response["Error"]["Code"]`` matters to dmutex."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.response = {"Error": {"Code": code, "Message": code}}


YEAR_2100 = "4102444800000"  # an expiry in epoch ms, far ahead
HELD = ClientError("ConditionalCheckFailedException")
THROTTLED = ClientError("ProvisionedThroughputExceededException")


def _operation(name: str) -> Callable[..., Any]:
    def call(self: Scripted, **request: Any) -> Any:
        self.requests.append((name, request))
        answer = self.script.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    call.__name__ = name
    return call


class Scripted:
    """A client with botocore's DynamoDB operations, answering from a script."""

    put_item = _operation("PutItem")
    get_item = _operation("GetItem")
    update_item = _operation("UpdateItem")
    delete_item = _operation("DeleteItem")
    batch_get_item = _operation("BatchGetItem")
    scan = _operation("Scan")
    describe_table = _operation("DescribeTable")
    create_table = _operation("CreateTable")

    def __init__(self, *script: object) -> None:
        self.script = list(script)
        self.requests: list[tuple[str, dict[str, Any]]] = []

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.requests]


def test_a_failed_condition_is_held_and_nothing_else_is() -> None:
    client = Scripted(ACTIVE, HELD)
    assert DMutex("svc", client).acquire("k") is None
    assert client.names == ["DescribeTable", "PutItem"]
    # Throttling (botocore's retries spent) raises; the engine then releases
    # by the token, since the put may have been applied before its reply was lost.
    throttled = Scripted(ACTIVE, THROTTLED, {})
    with pytest.raises(ClientError, match="ProvisionedThroughputExceeded"):
        DMutex("svc", throttled).acquire("k")
    assert throttled.names == ["DescribeTable", "PutItem", "DeleteItem"]
    put, delete = throttled.requests[1][1], throttled.requests[2][1]
    assert delete["ExpressionAttributeValues"][":token"] == put["Item"]["value"]


def test_the_grant_recognises_its_own_token() -> None:
    client = Scripted(ACTIVE, {})
    lock = DMutex("svc", client).acquire("k", 30)
    assert lock is not None
    _, put = client.requests[1]
    assert put["ConditionExpression"] == "attribute_not_exists(#k) OR #e <= :now OR #v = :token"
    assert put["ExpressionAttributeValues"][":token"] == {"S": lock.token}
    now = int(put["ExpressionAttributeValues"][":now"]["N"])
    assert put["Item"]["expiredAt"] == {"N": str(now + 30_000)}


def test_a_missing_table_is_created_and_polled_until_active() -> None:
    clock = ManualClock()
    missing = ClientError("ResourceNotFoundException")
    creating = {"Table": {**ACTIVE["Table"], "TableStatus": "CREATING"}}
    client = Scripted(missing, {}, missing, creating, creating, creating, ACTIVE)
    start = clock.monotonic()
    DMutex("svc", client, clock=clock).ready()
    assert client.names == ["DescribeTable", "CreateTable", *["DescribeTable"] * 5]
    assert client.requests[1][1]["BillingMode"] == "PAY_PER_REQUEST"
    # Pauses of 20, 40, 80, 160 and 250 ms: after the creation, before each describe.
    assert clock.monotonic() - start == pytest.approx(0.02 + 0.04 + 0.08 + 0.16 + 0.25)


def test_a_table_never_active_is_an_error_after_the_timeout() -> None:
    clock = ManualClock()
    creating = {"Table": {**ACTIVE["Table"], "TableStatus": "CREATING"}}
    client = Scripted(*[creating] * 200)
    start = clock.monotonic()
    with pytest.raises(DMutexError, match="not ACTIVE after 30 s"):
        DMutex("svc", client, clock=clock).ready()
    waited = clock.monotonic() - start
    assert table_module.TIMEOUT <= waited < table_module.TIMEOUT + table_module.POLL
    assert len(client.requests) < 200, "bounded by the timeout, not by the script"


def test_another_creators_race_is_no_error() -> None:
    missing = ClientError("ResourceNotFoundException")
    client = Scripted(missing, ClientError("ResourceInUseException"), ACTIVE)
    DMutex("svc", client, clock=ManualClock()).ready()
    assert client.names == ["DescribeTable", "CreateTable", "DescribeTable"]


def test_unprocessed_keys_are_asked_for_again_then_an_error() -> None:
    clock = ManualClock()
    table = "_dsemaphore_svc"
    left = {"UnprocessedKeys": {table: {"Keys": [{"key": {"S": "permit:1:k"}}]}}}
    got = {
        "Responses": {
            table: [
                {
                    "key": {"S": "permit:0:k"},
                    "value": {"S": "t"},
                    "expiredAt": {"N": "4102444800000"},
                }
            ]
        }
    }
    done: dict[str, Any] = {"Responses": {table: []}}
    sem = DSemaphore("svc", Scripted(ACTIVE, {**got, **left}, done), max_permits=2, clock=clock)
    assert [h.slot for h in sem.holders("k")] == [0]
    stuck = Scripted(ACTIVE, *[{**got, **left}] * 20)
    with pytest.raises(DMutexError, match="unprocessed 9 times in a row"):
        DSemaphore("svc", stuck, max_permits=2, clock=clock).holders("k")
    assert stuck.names.count("BatchGetItem") == 9


def test_a_batch_reply_without_responses_is_no_answer() -> None:
    # botocore reads a 200 reply torn inside its headers as {}: not "no items".
    sem = DSemaphore("svc", Scripted(ACTIVE, {}), max_permits=2, clock=ManualClock())
    with pytest.raises(DMutexError, match="unexpected reply from DynamoDB BatchGetItem"):
        sem.holders("k")


@pytest.mark.parametrize(
    "answer",
    [None, [], {"Attributes": {"fence": {"N": "x"}}}, {"Attributes": {"fence": {"S": "1"}}}],
)
def test_unreadable_fence_replies_raise(answer: object) -> None:
    client = Scripted(ACTIVE, {}, answer, {})
    with pytest.raises(DMutexError, match="DynamoDB"):
        DMutex("svc", client, fencing=True).acquire("k")
    assert client.names[-1] == "DeleteItem", "the slot released after the failed fence"

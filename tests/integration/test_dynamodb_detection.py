"""DynamoDB clients told apart by their shape, and bad names refused, before any request.

Every client here points at port 1 of loopback, where nothing listens: a
request would fail with a connection error, so an error of dmutex's own
shows that it was raised before any.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from aiobotocore.session import get_session

from dmutex import (
    AsyncDMutex,
    AsyncDReadWriteLock,
    AsyncDSemaphore,
    DMutex,
    DReadWriteLock,
    DSemaphore,
    InvalidArgumentError,
    UnsupportedClientError,
)
from dmutex._backends import detect
from dmutex._backends.dynamodb.names import KEY_BYTES
from dmutex._validate import MAX_KEY_LENGTH, MAX_PERMITS

NOWHERE = {
    "endpoint_url": "http://127.0.0.1:1",
    "region_name": "us-east-1",
    "aws_access_key_id": "testing",
    "aws_secret_access_key": "testing",
}
SYNC: list[Any] = [DMutex, DSemaphore, DReadWriteLock]
ASYNC: list[Any] = [AsyncDMutex, AsyncDSemaphore, AsyncDReadWriteLock]


def make(cls: Any, client: object, **options: Any) -> Any:
    if cls in (DSemaphore, AsyncDSemaphore):
        options["max_permits"] = 3
    return cls("svc", client, **options)


@pytest.fixture
def client() -> Iterator[Any]:
    made = boto3.client("dynamodb", **NOWHERE)
    yield made
    made.close()


@pytest.fixture
def async_client() -> Iterator[Any]:
    """aiobotocore's client, entered (which sends nothing), on a loop of its own."""
    loop = asyncio.new_event_loop()
    context = get_session().create_client("dynamodb", **NOWHERE)
    made = loop.run_until_complete(context.__aenter__())
    yield made
    loop.run_until_complete(context.__aexit__(None, None, None))
    loop.close()


def test_botocore_clients_are_dynamodb_and_build_on_their_face(
    client: Any, async_client: Any
) -> None:
    assert detect(client, None) == "dynamodb"
    assert detect(async_client, None) == "dynamodb"
    assert detect(client, "dynamodb") == "dynamodb"
    with pytest.raises(UnsupportedClientError, match="backend='redis'"):
        detect(client, "redis")
    for cls in SYNC:
        assert isinstance(make(cls, client), cls)
    for cls in ASYNC:
        assert isinstance(make(cls, async_client), cls)


def test_each_face_refuses_the_others_client(client: Any, async_client: Any) -> None:
    for cls in SYNC:
        with pytest.raises(UnsupportedClientError, match="asyncio DynamoDB client"):
            make(cls, async_client)
    for cls in ASYNC:
        with pytest.raises(UnsupportedClientError, match="sync DynamoDB client"):
            make(cls, client)


def test_another_services_client_is_no_dynamodb_client() -> None:
    s3 = boto3.client("s3", **NOWHERE)
    try:
        with pytest.raises(UnsupportedClientError, match="a DynamoDB client needs put_item"):
            detect(s3, None)
    finally:
        s3.close()


def test_the_resource_layer_is_refused_with_advice() -> None:
    resource = boto3.resource("dynamodb", **NOWHERE)
    table = resource.Table("locks")
    with pytest.raises(UnsupportedClientError, match=r"resource Table.*table\.meta\.client"):
        DMutex("svc", table)
    with pytest.raises(UnsupportedClientError, match=r"service resource.*meta\.client"):
        DMutex("svc", resource)
    assert isinstance(DMutex("svc", table.meta.client, table_name=table.name), DMutex)


def test_a_client_not_yet_entered_is_refused_with_advice() -> None:
    async def check() -> None:
        context = get_session().create_client("dynamodb", **NOWHERE)
        with pytest.raises(UnsupportedClientError, match="enter it first"):
            AsyncDMutex("svc", context)
        async with context as entered:  # made (no request), so that nothing is left unawaited
            assert isinstance(AsyncDMutex("svc", entered), AsyncDMutex)

    asyncio.run(check())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"table_name": "ab"}, "3 to 255 characters"),
        ({"table_name": "locks/1"}, "3 to 255 characters"),
        ({"table_name": "x" * 256}, "3 to 255 characters"),
        ({"table_prefix": "bad prefix "}, r"table_prefix 'bad prefix ' \+ service_name"),
    ],
)
def test_a_table_name_dynamodb_refuses_is_refused_at_construction(
    client: Any, options: dict[str, Any], message: str
) -> None:
    for cls in SYNC:
        with pytest.raises(InvalidArgumentError, match=message):
            make(cls, client, **options)


def test_every_key_the_engine_accepts_fits_an_item_key() -> None:
    """So the stores need no rule of their own (``names.KEY_BYTES``): the longest fits."""
    longest = f"permit:{MAX_PERMITS - 1}:" + "\U0001f512" * MAX_KEY_LENGTH  # 4 bytes each
    assert len(longest.encode()) == 2012 <= KEY_BYTES

"""The DynamoDB client contracts, as :class:`typing.Protocol` classes.

``dmutex._backends.clients`` gathers them for ``dmutex`` to publish. A
client is botocore's low-level client of the ``dynamodb`` service:
``boto3.client("dynamodb")`` (sync), or aiobotocore's (and aioboto3's)
client entered with ``async with`` (asyncio). dmutex calls its operations
with keyword arguments, as botocore names them, and reads the JSON-shaped
dictionaries they answer.

Each operation is declared as a callable taking any arguments, so that a
client typed by stubs (``types-boto3``, ``types-aiobotocore``), whose
operations name every parameter, still matches.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

__all__ = ["AsyncDynamoDBClientLike", "DynamoDBClientLike"]


class DynamoDBClientLike(Protocol):
    """A sync DynamoDB client: ``boto3.client("dynamodb")`` (botocore).

    Its retries and timeouts are the client's configuration
    (``botocore.config.Config``); see the DynamoDB page of the documentation
    for the ones dmutex suggests.
    """

    @property
    def put_item(self) -> Callable[..., object]:
        """PutItem: a slot's grant, a read-write lock's state."""
        ...

    @property
    def get_item(self) -> Callable[..., object]:
        """GetItem, strongly consistent: a read-write lock's state."""
        ...

    @property
    def update_item(self) -> Callable[..., object]:
        """UpdateItem: an extend, a fence counter."""
        ...

    @property
    def delete_item(self) -> Callable[..., object]:
        """DeleteItem: a release."""
        ...

    @property
    def batch_get_item(self) -> Callable[..., object]:
        """BatchGetItem, strongly consistent: a semaphore's slots."""
        ...

    @property
    def scan(self) -> Callable[..., object]:
        """Scan: the held keys, for ``dmutex status``."""
        ...

    @property
    def describe_table(self) -> Callable[..., object]:
        """DescribeTable: whether the table exists, its shape, and whether it is ACTIVE."""
        ...

    @property
    def create_table(self) -> Callable[..., object]:
        """CreateTable: the table, on first use, if it does not exist."""
        ...


class AsyncDynamoDBClientLike(Protocol):
    """An asyncio DynamoDB client: aiobotocore's (or aioboto3's), entered with ``async with``.

    dmutex never enters or closes it: its lifetime is the application's.
    """

    @property
    def put_item(self) -> Callable[..., Awaitable[object]]:
        """PutItem: a slot's grant, a read-write lock's state."""
        ...

    @property
    def get_item(self) -> Callable[..., Awaitable[object]]:
        """GetItem, strongly consistent: a read-write lock's state."""
        ...

    @property
    def update_item(self) -> Callable[..., Awaitable[object]]:
        """UpdateItem: an extend, a fence counter."""
        ...

    @property
    def delete_item(self) -> Callable[..., Awaitable[object]]:
        """DeleteItem: a release."""
        ...

    @property
    def batch_get_item(self) -> Callable[..., Awaitable[object]]:
        """BatchGetItem, strongly consistent: a semaphore's slots."""
        ...

    @property
    def scan(self) -> Callable[..., Awaitable[object]]:
        """Scan: the held keys, for ``dmutex status``."""
        ...

    @property
    def describe_table(self) -> Callable[..., Awaitable[object]]:
        """DescribeTable: whether the table exists, its shape, and whether it is ACTIVE."""
        ...

    @property
    def create_table(self) -> Callable[..., Awaitable[object]]:
        """CreateTable: the table, on first use, if it does not exist."""
        ...

"""The DynamoDB backend as the registry sees it: its :class:`Descriptor`."""

from __future__ import annotations

from ..._clock import Clock
from ..._errors import UnsupportedClientError
from ..._options import Options
from ..abc import Descriptor
from ..shapes import described
from .names import check_table_name
from .readwrite import DynamoReadWriteStore
from .shapes import is_asyncio, is_service_resource, is_table, is_unentered, recognises
from .store import DynamoStore
from .url import FORM


def _checked(client: object, options: Options, asynchronous: bool) -> str:
    """The table's name, and the client's kind and face, checked before any request."""
    name = check_table_name(options.table_name, options.table_origin)
    if is_table(client):
        raise UnsupportedClientError(
            f"{described(client)} is a boto3 resource Table; dmutex needs the low-level client: "
            "pass table.meta.client (and table_name=table.name to use that table)"
        )
    if is_service_resource(client):
        raise UnsupportedClientError(
            f"{described(client)} is boto3's DynamoDB service resource; dmutex needs the "
            "low-level client: pass its meta.client, or boto3.client('dynamodb')"
        )
    if is_unentered(client):
        raise UnsupportedClientError(
            f"{described(client)} is a client not yet made: enter it first "
            "(async with session.create_client('dynamodb') as client) and pass the client"
        )
    if asynchronous and not is_asyncio(client):
        raise UnsupportedClientError(
            f"{described(client)} is a sync DynamoDB client: use DMutex / DSemaphore, or pass "
            "an asyncio one (aiobotocore's or aioboto3's client, entered)"
        )
    if not asynchronous and is_asyncio(client):
        raise UnsupportedClientError(
            f"{described(client)} is an asyncio DynamoDB client: use AsyncDMutex / AsyncDSemaphore"
        )
    return name


def open_store(
    client: object, options: Options, clock: Clock, *, asynchronous: bool
) -> DynamoStore:
    """The table of ``options``' mutexes or semaphores.

    Fencing only if asked (``fencing=True``): it costs one more request per grant here.
    """
    table = _checked(client, options, asynchronous)
    fencing = options.fencing is True
    return DynamoStore(client, table, options.max_permits, clock, fencing=fencing)


def open_readwrite_store(
    client: object, options: Options, clock: Clock, *, asynchronous: bool
) -> DynamoReadWriteStore:
    """The table of ``options``' read-write locks; a fence unless ``fencing=False`` (no cost)."""
    table = _checked(client, options, asynchronous)
    fencing = options.fencing is not False
    return DynamoReadWriteStore(client, table, options.max_readers, clock, fencing=fencing)


BACKEND = Descriptor(
    name="dynamodb",
    label="DynamoDB",
    recognises=recognises,
    open_store=open_store,
    open_readwrite_store=open_readwrite_store,
    needs=(
        "put_item, get_item, update_item, delete_item, batch_get_item, scan, describe_table "
        "and create_table (botocore's DynamoDB client: boto3.client('dynamodb'), "
        "or aiobotocore's)"
    ),
    replicas=(
        "DynamoDB answers a write once the service has stored it; "
        "there is nothing for replicas= to wait for"
    ),
    url=FORM,
)
"""DynamoDB (botocore's client through boto3, or aiobotocore's for asyncio)."""

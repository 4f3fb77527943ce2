"""What makes a client a DynamoDB client, and which face it has: no I/O.

Rules:

1. A DynamoDB client is botocore's low-level client of the ``dynamodb``
   service (``boto3.client("dynamodb")``; aiobotocore's and aioboto3's
   ``create_client`` / ``client`` entered with ``async with``): its type
   defines the operations dmutex sends (:data:`OPERATIONS`). The type is
   read, never called: botocore generates these classes per service, so
   another service's client lacks them.
2. Its face is its ``_make_api_call``: a coroutine function on
   aiobotocore's clients, a plain one on botocore's. The operations
   themselves are botocore's plain functions on both.
3. boto3's resource layer (a ``Table``, the ``dynamodb`` service
   resource) and an aiobotocore client not yet entered are recognised as
   DynamoDB's too, so that opening refuses them with advice instead of
   the error for an unknown client.
"""

from __future__ import annotations

import inspect

from ..shapes import defines

OPERATIONS = (
    "put_item",
    "get_item",
    "update_item",
    "delete_item",
    "batch_get_item",
    "scan",
    "describe_table",
    "create_table",
)
"""The operations a client's type must define (rule 1)."""


def is_client(client: object) -> bool:
    """Whether ``client`` has a DynamoDB low-level client's shape (rule 1)."""
    return all(defines(client, name) for name in OPERATIONS)


def is_table(client: object) -> bool:
    """Whether ``client`` is a boto3 resource ``Table`` (rule 3): a table name and ``put_item``."""
    return defines(client, "table_name") and defines(client, "put_item") and not is_client(client)


def is_service_resource(client: object) -> bool:
    """Whether ``client`` is boto3's ``dynamodb`` service resource (rule 3): it makes Tables."""
    return defines(client, "Table") and defines(client, "batch_get_item")


def is_unentered(client: object) -> bool:
    """Whether ``client`` is an aiobotocore ``create_client(...)`` not yet entered (rule 3)."""
    kind = type(client)
    return kind.__name__ == "ClientCreatorContext" and kind.__module__.startswith("aiobotocore")


def recognises(client: object) -> bool:
    """Whether ``client`` is DynamoDB's (rules 1 and 3)."""
    return (
        is_client(client) or is_table(client) or is_service_resource(client) or is_unentered(client)
    )


def is_asyncio(client: object) -> bool:
    """Whether a recognised client is an asyncio one (rule 2)."""
    return inspect.iscoroutinefunction(getattr(type(client), "_make_api_call", None))

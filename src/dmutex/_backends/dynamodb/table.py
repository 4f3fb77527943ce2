"""A store's table: found or created, then waited for until ACTIVE; another shape refused.

Rules:

1. ``ready()`` asks first (DescribeTable): a table that exists is used as
   it is, so an application whose role may not create tables runs against
   one made beforehand. Only a table that does not exist is created, as
   the TypeScript store creates it: partition key ``key`` of type string,
   no sort key, on-demand capacity (``PAY_PER_REQUEST``). Another
   creator's ``ResourceInUseException`` (a race) is no error.
2. The table must then be ACTIVE before any lock request: DescribeTable
   again after a pause that starts at :data:`FIRST_POLL` seconds and
   doubles up to :data:`POLL` (a table a server makes at once costs no
   quarter second; DynamoDB's own allows ten DescribeTable calls a
   second), for at most :data:`TIMEOUT` seconds, after which ``ready()``
   raises :class:`~dmutex.DMutexError`.
3. A table whose key schema is not exactly the partition key ``key`` of
   type string is refused (:class:`~dmutex.DMutexError`), before any lock
   request: its items could not be the layout's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..._clock import Clock
from ..._core.effects import Call, Sleep, Steps
from ..._errors import DMutexError
from .requests import IN_USE, NOT_FOUND, error_code, reply

FIRST_POLL = 0.02
POLL = 0.25
TIMEOUT = 30.0

_KEY_SCHEMA = [{"AttributeName": "key", "KeyType": "HASH"}]
_DEFINITIONS = [{"AttributeName": "key", "AttributeType": "S"}]


def _described(answer: object) -> Mapping[str, object]:
    table = reply(answer, "DescribeTable").get("Table")
    if not isinstance(table, Mapping):
        raise DMutexError(f"unexpected reply from DynamoDB DescribeTable: {answer!r}")
    return table


def check_shape(name: str, table: Mapping[str, object]) -> None:
    """Rule 3: refuse a table whose key is not the string partition key ``key`` alone."""
    schema = table.get("KeySchema")
    definitions = table.get("AttributeDefinitions")
    types = {
        d.get("AttributeName"): d.get("AttributeType")
        for d in (definitions if isinstance(definitions, list) else [])
        if isinstance(d, Mapping)
    }
    if (
        not isinstance(schema, list)
        or [dict(part) for part in schema] != _KEY_SCHEMA
        or (types.get("key") != "S")
    ):
        raise DMutexError(
            f"DynamoDB table {name!r} has the key schema {schema!r} (attributes {types!r}); "
            "dmutex needs the partition key 'key' of type S (string) and no sort key"
        )


def prepare(
    describe_table: Callable[..., object],
    create_table: Callable[..., object],
    name: str,
    clock: Clock,
) -> Steps[None]:
    """Rules 1-3: the table found or created, its shape checked, and ACTIVE."""
    try:
        table = _described((yield Call(describe_table, (), {"TableName": name})))
    except Exception as error:
        if error_code(error) != NOT_FOUND:
            raise
        table = None
    if table is None:
        request = {
            "TableName": name,
            "AttributeDefinitions": _DEFINITIONS,
            "KeySchema": _KEY_SCHEMA,
            "BillingMode": "PAY_PER_REQUEST",
        }
        try:
            yield Call(create_table, (), request)
        except Exception as error:
            if error_code(error) != IN_USE:
                raise
    deadline = clock.monotonic() + TIMEOUT
    pause = FIRST_POLL
    while True:
        if table is not None:
            check_shape(name, table)
            if table.get("TableStatus") == "ACTIVE":
                return
        if clock.monotonic() >= deadline:
            raise DMutexError(f"DynamoDB table {name!r} was not ACTIVE after {TIMEOUT:g} s")
        yield Sleep(pause)
        pause = min(pause * 2, POLL)
        try:
            table = _described((yield Call(describe_table, (), {"TableName": name})))
        except Exception as error:
            if error_code(error) != NOT_FOUND:
                raise
            table = None  # created, but not yet described (eventually consistent)

"""DynamoDB as a backend of the behaviour suites: boto3 (sync) and aiobotocore (asyncio).

The server is one the session found or started (``dynamodb_servers.py``):
moto's server, dynalite, or the endpoint ``DMUTEX_DYNAMODB_URL`` names.
Neither local server is DynamoDB; both speak its protocol.

Every table the suites make is under a namespace of this backend's own
(the session's prefix and a number, ``dmutex-test-<12 hex>-<n>-``), so that
one test's tables are not another's and, on a user's endpoint, nothing else
is touched: :meth:`Dynamo.table_options` puts it before the table name or
prefix each instance gets (the library's default, or the test's own).
What :meth:`Dynamo.active` lists is named as on the other table stores: the
Redis-style prefix (``_dmutex_svc:``) plus the item's key.
:meth:`Dynamo.close` deletes the namespace's tables.

Expiry is forced by hand, as a clock would: an active item's ``expiredAt``
is set to now, leaving the item stored, so that takeover of a stored item
is what gets exercised.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Awaitable, Callable
from typing import Any

from dmutex import ManualClock
from dmutex._clock import SYSTEM_CLOCK
from dmutex._core.lease import now_ms
from tests._support.dynamodb_servers import Server, make_async_client
from tests._support.faces import LoopThread
from tests._support.rwrows import hold_expired

Runner = Callable[[Awaitable[object]], object]

# The prefixes the library gives each kind's table by default, before the service name.
DEFAULT_PREFIXES = {"mutex": "_dmutex_", "semaphore": "_dsemaphore_", "rwlock": "_drwlock_"}

_NUMBERS = itertools.count()


def _slot_pattern(key: str, slot: int | None) -> re.Pattern[str]:
    return re.compile(f"permit:{'[0-9]+' if slot is None else slot}:{re.escape(key)}")


class Dynamo:
    """A server that speaks DynamoDB's protocol, through boto3 or aiobotocore; fresh tables."""

    clock: ManualClock | None = None
    ttls: tuple[float, ...] = (30.0, 61.5, 90.001)

    def __init__(self, server: Server, prefix: str) -> None:
        self.server = server
        self.namespace = f"{prefix}{next(_NUMBERS)}-"
        self.loop: LoopThread | None = None
        self._inspector = server.client()
        self._closers: list[Callable[[], object]] = [self._inspector.close]
        self._async_exits: list[Callable[[], Awaitable[object]]] = []

    def table_options(self, kind: str, options: dict[str, Any]) -> None:
        """Put this backend's namespace before the table an instance made with ``options`` gets."""
        named = options.get("table_name")
        if named is not None:
            options["table_name"] = f"{self.namespace}{named}"
        else:
            prefix = options.get("table_prefix", DEFAULT_PREFIXES[kind])
            options["table_prefix"] = f"{self.namespace}{prefix}"

    def client(self, asynchronous: bool) -> object:
        if not asynchronous:
            made_sync = self.server.client()
            self._closers.append(made_sync.close)
            return made_sync
        loop = self.loop
        assert loop is not None, "the rig gives an asyncio backend its loop first"
        made = make_async_client(**self.server.client_args())

        async def enter() -> object:
            return await made.__aenter__()

        entered = loop.run(enter())

        async def leave() -> object:
            return await made.__aexit__(None, None, None)

        self._async_exits.append(leave)
        return entered

    def tables(self) -> list[str]:
        """The tables of this backend's namespace."""
        names: list[str] = []
        for page in self._inspector.get_paginator("list_tables").paginate():
            names.extend(n for n in page["TableNames"] if n.startswith(self.namespace))
        return names

    def _items(self, table: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        pages = self._inspector.get_paginator("scan").paginate(TableName=table, ConsistentRead=True)
        for page in pages:
            items.extend(page["Items"])
        return items

    def force_expire(self, key: str, slot: int | None = None) -> None:
        pattern = _slot_pattern(key, slot)
        now = now_ms(SYSTEM_CLOCK)
        for table in self.tables():
            for item in self._items(table):
                name = item["key"]["S"]
                if pattern.fullmatch(name) and int(item["expiredAt"]["N"]) > now:
                    self._inspector.update_item(
                        TableName=table,
                        Key={"key": {"S": name}},
                        UpdateExpression="SET expiredAt = :now",
                        ExpressionAttributeValues={":now": {"N": str(now)}},
                    )

    def expire_hold(self, key: str, token: str) -> None:
        """Make ``token``'s read-write hold of ``key`` expire now, in every table."""
        now = now_ms(SYSTEM_CLOCK)
        for table in self.tables():
            found = self._inspector.get_item(
                TableName=table, Key={"key": {"S": f"rwlock:{key}"}}, ConsistentRead=True
            ).get("Item")
            if found is not None:
                found["value"] = {"S": hold_expired(found["value"]["S"], token, now)}
                self._inspector.put_item(TableName=table, Item=found)

    def stored_fence(self, kind: str, service: str, key: str) -> int | None:
        """The fence counter of ``key`` in ``kind``'s default table of ``service``, or None."""
        table = f"{self.namespace}{DEFAULT_PREFIXES[kind]}{service}"
        if table not in self.tables():
            return None
        item = self._inspector.get_item(
            TableName=table, Key={"key": {"S": f"fence:{key}"}}, ConsistentRead=True
        ).get("Item")
        return None if item is None else int(item["fence"]["N"])

    def active(self, prefix: str) -> dict[str, str]:
        # The tests use the default tables: the Redis-style prefix without
        # its colon (_dmutex_svc, _dsemaphore_svc), as for the SQL stores.
        table = f"{self.namespace}{prefix.rstrip(':')}"
        if table not in self.tables():
            return {}
        now = now_ms(SYSTEM_CLOCK)
        return {
            f"{prefix}{item['key']['S']}": item["value"]["S"]
            for item in self._items(table)
            if item["key"]["S"].startswith("permit:") and int(item["expiredAt"]["N"]) > now
        }

    def close(self, run: Runner | None) -> None:
        if self._async_exits and run is None:
            raise RuntimeError("async clients need the rig's loop to close on")
        for leave in self._async_exits:
            assert run is not None
            run(leave())
        self._async_exits.clear()
        for table in self.tables():
            self._inspector.delete_table(TableName=table)
        for close in self._closers:
            close()
        self._closers.clear()

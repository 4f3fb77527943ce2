"""The DynamoDB store of read-write locks: one item per key, read, decided, compare-and-set.

Layout (dmutex's own; the TypeScript library has no read-write lock): the
mutex store's table shape, in the ``_drwlock_`` table. Lock ``k`` is the
one item ``{key: "rwlock:{k}", value: <state>, expiredAt:
253370764800000}``: ``value`` the state's JSON text as the SQL stores
write it, fence counter included (``rwstate.py``); ``expiredAt``
9999-01-01 in epoch milliseconds, since the item is the key's fence
counter and stays once nothing is held.

The decisions, the state and the compare-and-set loop are the SQL stores'
(``rwcas.py``, its rules 1, 3, 4 and 6). What is DynamoDB's here:

1. The read is one strongly consistent GetItem; time is this process's
   clock, as the mutex store's (``store.py``, rule 1).
2. The write is one PutItem conditioned on the item's ``value`` still
   being the text read (or on there being no item, where the read found
   none): two callers that read one state cannot both write it.
3. Nothing wakes a waiter: waiters poll (jittered), and a refused attempt
   tells its waiter when what stands in its way lapses at the latest.
4. Listing the held keys is a Scan of the read-write items, each decoded
   and kept if a writer or a reader holds it by this process's clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..._clock import Clock
from ..._core import readwrite
from ..._core.abc import sleep
from ..._core.effects import Call, Steps
from ..._core.fences import clock_us
from ..._core.lease import now_ms
from ..._core.waiting import Waiter
from ..._errors import DMutexError
from .. import rwstate
from ..rwcas import CasReadWriteStore
from ..shapes import method
from .requests import (
    CONDITION_FAILED,
    error_code,
    item_of,
    key_of,
    number,
    read_string,
    reply,
    scan_items,
    string,
)
from .table import prepare

__all__ = ["DynamoReadWriteStore"]

FOREVER_MS = 253_370_764_800_000
"""The item's ``expiredAt``: 9999-01-01 00:00:00 UTC in epoch milliseconds."""

_ROW = "rwlock:"


class DynamoReadWriteStore(CasReadWriteStore):
    """One table of read-write lock items on DynamoDB; a ``ReadWriteStore``."""

    server = "DynamoDB"

    def __init__(
        self,
        client: object,
        table: str,
        max_readers: int | None,
        clock: Clock,
        *,
        fencing: bool = True,
    ) -> None:
        super().__init__(table, max_readers, clock, fencing=fencing)
        self._get = method(client, "get_item")
        self._put = method(client, "put_item")
        self._scan = method(client, "scan")
        self._describe = method(client, "describe_table")
        self._create = method(client, "create_table")

    def ready(self) -> Steps[None]:
        """Find or create the table, check its key, wait until it is ACTIVE (``table.py``)."""
        return prepare(self._describe, self._create, self._table, self._clock)

    def _fetch(self, key: str) -> Steps[Sequence[Sequence[object]]]:
        """Rule 1: the item's value (None if absent) and this process's time in ms and µs."""
        request = {"TableName": self._table, "Key": key_of(f"{_ROW}{key}"), "ConsistentRead": True}
        item = item_of((yield Call(self._get, (), request)), "GetItem")
        value = None if item is None else read_string(item, "value")
        if item is not None and value is None:
            raise DMutexError(
                f"the item '{_ROW}{key}' of DynamoDB table {self._table!r} holds a value "
                "dmutex did not write"
            )
        return [(value, now_ms(self._clock), clock_us(self._clock))]

    def _write(self, key: str, old: object, new: str, wake: bool) -> Steps[bool]:
        """Rule 2: put ``new`` over the text ``old`` (None: over no item); whether it applied."""
        request: dict[str, object] = {
            "TableName": self._table,
            "Item": {
                "key": string(f"{_ROW}{key}"),
                "value": string(new),
                "expiredAt": number(FOREVER_MS),
            },
        }
        if old is None:
            request["ConditionExpression"] = "attribute_not_exists(#k)"
            request["ExpressionAttributeNames"] = {"#k": "key"}
        else:
            request["ConditionExpression"] = "#v = :old"
            request["ExpressionAttributeNames"] = {"#v": "value"}
            request["ExpressionAttributeValues"] = {":old": string(str(old))}
        try:
            yield Call(self._put, (), request)
        except Exception as error:
            if error_code(error) == CONDITION_FAILED:
                return False
            raise
        return True

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        """Sleep: nothing here signals a change (rule 3)."""
        return sleep(seconds)

    def keys(self, limit: int) -> Steps[list[str]]:
        """Up to ``limit`` keys a writer or a reader holds, sorted: a Scan (rule 4)."""
        found: set[str] = set()
        request: dict[str, object] = {
            "TableName": self._table,
            "FilterExpression": "begins_with(#k, :rw)",
            "ExpressionAttributeNames": {"#k": "key"},
            "ExpressionAttributeValues": {":rw": string(_ROW)},
            "ConsistentRead": True,
        }
        now = now_ms(self._clock)
        while len(found) < limit:
            answer = reply((yield Call(self._scan, (), request)), "Scan")
            for item in scan_items(answer):
                name = read_string(item, "key")
                state = rwstate.decode(read_string(item, "value"), fenced=True)
                if name is None or state is None or not readwrite.is_held(state, now):
                    continue
                found.add(name[len(_ROW) :])
            after = answer.get("LastEvaluatedKey")
            if not after:
                break
            request = {**request, "ExclusiveStartKey": after}
        return sorted(found)[:limit]

"""The DynamoDB store: leases as items of one table, each taken by one conditional write.

Layout (the TypeScript dmutex's DynamoDB store): table ``table_name``, else
``table_prefix + service_name``, whose partition key is ``key`` (a string);
slot ``i`` of lock ``k`` is the item ``{key: "permit:{i}:{k}", value:
<token>, expiredAt: <epoch ms>}`` (``value`` a string, ``expiredAt`` a
number). ``ready()`` makes the table if it is missing (``table.py``).

Rules of this module:

1. Time is the holder's clock: DynamoDB's conditions read no server clock,
   so, as in the TypeScript store, "expired" means ``expiredAt <= now`` as
   the process that asks reads ``now``, when it hands the request to its
   client (:meth:`DynamoStore._send`), so that an expiry counts from its
   own request, not from before the table was made. Processes whose clocks disagree by
   more than a lease's margin can take each other's leases early (the
   guarantees page says how much). A holder's own deadline is, as on every
   backend, counted on its monotonic clock from the send time of the
   request that set the expiry (``renewal.py``).
2. A grant is one conditional PutItem of the slot's item: it applies if
   the item does not exist, has expired, or holds the caller's own token.
   The last is a re-sent copy of a grant whose reply was lost (botocore's
   own retry, or the engine's next attempt, which keeps its token): it
   succeeds as the first copy did. A failed condition means held, and is
   the only error that does.
3. A mutex tries its one slot. A semaphore tries a random slot first, so
   that callers spread out; if that one is held it reads every slot
   (BatchGetItem, 100 a request, strongly consistent) and tries the free
   ones in random order, each failure a race lost to another caller.
   When every slot is active it answers None, and a waiter learns when
   the first of them expires.
4. Release is a DeleteItem, extend an UpdateItem of ``expiredAt``, each
   conditioned on the item holding the token *and* not having expired: a
   holder whose lease ran out can neither remove nor prolong the item of
   whoever took it over, and gets False. By key and token alone on a
   semaphore (``release(key, token)``), one BatchGetItem finds the slot
   first.
5. Fences, with ``fencing=True`` only (one more request per grant): the
   counter is the item ``{key: "fence:{k}", kind: "dmutex-fence", fence:
   <n>}`` beside the slots. It moves after the grant, to the larger of
   itself plus one and the clock in microseconds (``fences.py``): one
   UpdateItem that sets the clock where the counter is below it, else a
   second that adds one. The grant counts only if that reply arrives
   before the lease's expiry estimate, so the move happened while the
   lease was active and any later holder's move comes after it (the
   MongoDB store's argument, on the holders' clocks as well). An item of
   that key that lacks dmutex's ``kind`` is never changed: the acquire
   raises :class:`~dmutex.DMutexError`, and the engine releases the slot.
6. Nothing here wakes a waiter: waiters poll, jittered (``waiting.py``).
7. Every key and token the engine accepts fits: an item key holds 2,048
   bytes of UTF-8, and the longest a lock key makes is 2,012
   (``names.KEY_BYTES``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ..._clock import Clock
from ..._core.abc import Holder, Inspection, Renewed, extend_each, sleep
from ..._core.chance import CHANCE
from ..._core.effects import Call, Steps
from ..._core.fences import clock_us
from ..._core.lease import MAX_EXPIRY_MS, Lease, now_ms
from ..._core.waiting import Waiter
from ..._errors import DMutexError
from ..shapes import method
from .requests import (
    CONDITION_FAILED,
    batch_get,
    error_code,
    key_of,
    number,
    read_number,
    read_string,
    reply,
    scan_items,
    string,
)
from .table import prepare

# A request's keyword arguments, as botocore names them.
Request = dict[str, object]

FENCE_KIND = "dmutex-fence"
"""Rule 5: the ``kind`` that marks a fence counter item as dmutex's."""

# Expression attribute names: "key" and "value" are reserved words in
# DynamoDB's expressions, so every attribute is named through a placeholder.
_NAMES = {"#k": "key", "#v": "value", "#e": "expiredAt"}
_GRANT = "attribute_not_exists(#k) OR #e <= :now OR #v = :token"
_HELD_BY = "#v = :token AND #e > :now"
_FENCE_NAMES = {"#k": "key", "#kind": "kind", "#f": "fence"}
_FENCE_TO_CLOCK = (
    "(attribute_not_exists(#k) OR #kind = :kind) AND (attribute_not_exists(#f) OR #f < :clock)"
)
_FENCE_BY_ONE = "#kind = :kind AND attribute_exists(#f)"


def _failed_condition(error: BaseException) -> bool:
    return error_code(error) == CONDITION_FAILED


class DynamoStore:
    """One table of lease items on DynamoDB; a ``Store``.

    Requests per operation: a mutex acquire is one PutItem; a semaphore
    acquire one when the slot it tries first is free, else one more
    BatchGetItem per 100 permits, plus one PutItem per free slot tried;
    with ``fencing=True`` a grant adds one UpdateItem (two when the counter
    is ahead of the clock). Release and extend are one request each (by
    key and token on a semaphore: one BatchGetItem more); ``holders`` one
    BatchGetItem per 100 slots; ``ready()`` one DescribeTable once the
    table is ACTIVE.
    """

    max_expiry_ms = MAX_EXPIRY_MS

    def __init__(
        self, client: object, table: str, max_permits: int, clock: Clock, *, fencing: bool = False
    ) -> None:
        self._put = method(client, "put_item")
        self._update = method(client, "update_item")
        self._delete = method(client, "delete_item")
        self._batch_get = method(client, "batch_get_item")
        self._scan = method(client, "scan")
        self._describe = method(client, "describe_table")
        self._create = method(client, "create_table")
        self._table = table
        self._permits = max_permits
        self._clock = clock
        self._fencing = fencing

    @property
    def clock(self) -> Clock:
        return self._clock

    @property
    def table(self) -> str:
        """The table's name."""
        return self._table

    def ready(self) -> Steps[None]:
        """Find or create the table, check its key, wait until it is ACTIVE (``table.py``)."""
        return prepare(self._describe, self._create, self._table, self._clock)

    @staticmethod
    def _name(slot: int, key: str) -> str:
        return f"permit:{slot}:{key}"

    def _names(self, key: str) -> list[str]:
        return [self._name(slot, key) for slot in range(self._permits)]

    def _send(
        self, sent: list[int], operation: Callable[..., object], build: Callable[[int], Request]
    ) -> object:
        """Rule 1: ``operation`` called with ``build``'s request for now, noted in ``sent``.

        The time is read as the request is handed to the client: after the
        driver prepared the store (an instance's first request waits for
        its table), so a lease's expiry counts from its own request.
        """
        now = now_ms(self._clock)
        sent.append(now)
        return operation(**build(now))

    def _take(self, slot: int, key: str, token: str, ttl_ms: int) -> Steps[int | None]:
        """Rule 2: put slot ``slot``'s item if free, expired or ours; its expiry, None if held."""

        def build(now: int) -> Request:
            item = {
                "key": string(self._name(slot, key)),
                "value": string(token),
                "expiredAt": number(now + ttl_ms),
            }
            return {
                "TableName": self._table,
                "Item": item,
                "ConditionExpression": _GRANT,
                "ExpressionAttributeNames": _NAMES,
                "ExpressionAttributeValues": {":now": number(now), ":token": string(token)},
            }

        sent: list[int] = []
        try:
            yield Call(self._send, (sent, self._put, build))
        except Exception as error:
            if _failed_condition(error):
                return None
            raise
        return sent[0] + ttl_ms

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None = None
    ) -> Steps[Lease | None]:
        """Take a free or expired slot (rules 2-3), then its fence (rule 5); None: all held."""
        lease = yield from self._take_any(key, token, ttl_ms, waiter)
        if lease is None or not self._fencing:
            return lease
        return (yield from self._fence(lease))

    def _take_any(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None
    ) -> Steps[Lease | None]:
        permits = self._permits
        first = 0 if permits == 1 else CHANCE.randrange(permits)
        expires = yield from self._take(first, key, token, ttl_ms)
        if expires is not None:
            return Lease(key, token, first, expires)
        if permits == 1:
            return None
        items = yield from batch_get(self._batch_get, self._table, self._names(key))
        now = now_ms(self._clock)
        free: list[int] = []
        soonest: int | None = None
        for slot in range(permits):
            if slot == first:
                continue
            item = items.get(self._name(slot, key))
            at = None if item is None else read_number(item, "expiredAt")
            if item is None or at is None or at <= now or read_string(item, "value") == token:
                free.append(slot)
            else:
                soonest = at if soonest is None else min(soonest, at)
        CHANCE.shuffle(free)
        for slot in free:
            expires = yield from self._take(slot, key, token, ttl_ms)
            if expires is not None:
                return Lease(key, token, slot, expires)
        if waiter is not None and soonest is not None and not free:
            waiter.expires_in = max(soonest - now, 0) / 1000
        return None

    def _fence(self, lease: Lease) -> Steps[Lease | None]:
        """Rule 5: move the key's fence counter on for ``lease``; None if the lease ran out."""
        # DynamoDB refuses a placeholder that an expression does not use.
        base = {
            "TableName": self._table,
            "Key": key_of(f"fence:{lease.key}"),
            "ReturnValues": "UPDATED_NEW",
        }
        to_clock = {
            **base,
            "ExpressionAttributeNames": _FENCE_NAMES,
            "UpdateExpression": "SET #f = :clock, #kind = :kind",
            "ConditionExpression": _FENCE_TO_CLOCK,
            "ExpressionAttributeValues": {
                ":clock": number(clock_us(self._clock)),
                ":kind": string(FENCE_KIND),
            },
        }
        by_one = {
            **base,
            "ExpressionAttributeNames": {"#kind": "kind", "#f": "fence"},
            "UpdateExpression": "SET #f = #f + :one",
            "ConditionExpression": _FENCE_BY_ONE,
            "ExpressionAttributeValues": {":one": number(1), ":kind": string(FENCE_KIND)},
        }
        try:
            answer = yield Call(self._update, (), to_clock)
        except Exception as error:
            if not _failed_condition(error):
                raise
            try:
                answer = yield Call(self._update, (), by_one)
            except Exception as again:
                if not _failed_condition(again):
                    raise
                raise DMutexError(
                    f"the item 'fence:{lease.key}' of DynamoDB table {self._table!r} holds "
                    "a value dmutex did not write"
                ) from again
        attributes = reply(answer, "UpdateItem").get("Attributes")
        fence = read_number(attributes, "fence") if isinstance(attributes, Mapping) else None
        if fence is None or fence < 1:
            raise DMutexError(f"unexpected fence from DynamoDB UpdateItem: {answer!r}")
        if now_ms(self._clock) >= lease.expires_ms:
            return None
        lease.fence = fence
        return lease

    def _slot_of(self, key: str, token: str, slot: int | None) -> Steps[int | None]:
        """The slot that holds ``token``: ``slot`` if known, else read (rule 4); None: none does."""
        if slot is not None or self._permits == 1:
            return 0 if slot is None else slot
        items = yield from batch_get(self._batch_get, self._table, self._names(key))
        for index in range(self._permits):
            item = items.get(self._name(index, key))
            if item is not None and read_string(item, "value") == token:
                return index
        return None

    @staticmethod
    def _held_by(token: str, now: int, **values: dict[str, str]) -> Request:
        """Rule 4's condition: the item holds ``token`` and has not expired at ``now``."""
        return {
            "ConditionExpression": _HELD_BY,
            "ExpressionAttributeNames": {"#v": "value", "#e": "expiredAt"},
            "ExpressionAttributeValues": {":token": string(token), ":now": number(now), **values},
        }

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        """Delete the active item holding ``token`` (rule 4): one DeleteItem."""
        found = yield from self._slot_of(key, token, slot)
        if found is None:
            return False
        name = self._name(found, key)

        def build(now: int) -> Request:
            return {"TableName": self._table, "Key": key_of(name), **self._held_by(token, now)}

        try:
            yield Call(self._send, ([], self._delete, build))
        except Exception as error:
            if _failed_condition(error):
                return False
            raise
        return True

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        """Set ``expiredAt`` of the active item holding ``token`` (rule 4): one UpdateItem."""
        found = yield from self._slot_of(key, token, slot)
        if found is None:
            return None
        name = self._name(found, key)

        def build(now: int) -> Request:
            return {
                "TableName": self._table,
                "Key": key_of(name),
                "UpdateExpression": "SET #e = :expires",
                **self._held_by(token, now, **{":expires": number(now + ttl_ms)}),
            }

        sent: list[int] = []
        try:
            yield Call(self._send, (sent, self._update, build))
        except Exception as error:
            if _failed_condition(error):
                return None
            raise
        return sent[0] + ttl_ms

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        """One UpdateItem per lease, in turn: DynamoDB has no batch of conditional updates.

        (TransactWriteItems has one, but a failed condition cancels the
        whole transaction, and renewal answers each lease alone.)
        """
        return extend_each(self, leases)

    def holders(self, key: str) -> Steps[Inspection]:
        """The active slot items of ``key`` and its fence counter: BatchGetItem, 100 a request."""
        now = now_ms(self._clock)
        fence_name = f"fence:{key}"
        items = yield from batch_get(self._batch_get, self._table, [*self._names(key), fence_name])
        found: list[Holder] = []
        for slot in range(self._permits):
            item = items.get(self._name(slot, key))
            if item is None:
                continue
            token, at = read_string(item, "value"), read_number(item, "expiredAt")
            if token is not None and at is not None and at > now:
                found.append(Holder(slot, token, at))
        fence: int | None = None
        counter = items.get(fence_name)
        if counter is not None and read_string(counter, "kind") == FENCE_KIND:
            fence = read_number(counter, "fence")
        return Inspection(found, fence, now)

    def keys(self, limit: int) -> Steps[list[str]]:
        """Up to ``limit`` keys with an active slot item (slots 0 .. N-1), sorted: a Scan.

        A Scan reads the table in the service's order, a page (1 MB) a
        request, until ``limit`` keys are found or the table ends; only the
        matching items' keys come back.
        """
        found: set[str] = set()
        request: dict[str, object] = {
            "TableName": self._table,
            "FilterExpression": "begins_with(#k, :permit) AND #e > :now",
            "ProjectionExpression": "#k",
            "ExpressionAttributeNames": {"#k": "key", "#e": "expiredAt"},
            "ExpressionAttributeValues": {
                ":permit": string("permit:"),
                ":now": number(now_ms(self._clock)),
            },
            "ConsistentRead": True,
        }
        while len(found) < limit:
            answer = reply((yield Call(self._scan, (), request)), "Scan")
            for item in scan_items(answer):
                key = self._key_of_slot(read_string(item, "key"))
                if key is not None:
                    found.add(key)
            after = answer.get("LastEvaluatedKey")
            if not after:
                break
            request = {**request, "ExclusiveStartKey": after}
        return sorted(found)[:limit]

    def _key_of_slot(self, name: str | None) -> str | None:
        """The key of a slot item's key ``permit:{i}:{key}`` with ``i`` below N; else None."""
        if name is None:
            return None
        parts = name.split(":", 2)
        if len(parts) != 3 or not parts[2] or not parts[1].isdigit():
            return None
        return parts[2] if int(parts[1]) < self._permits else None

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        """Sleep: nothing here signals a release (rule 6)."""
        return sleep(seconds)

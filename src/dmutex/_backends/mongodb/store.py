"""The MongoDB store: leases as documents, taken by one upsert each.

Layout (shared with the TypeScript dmutex): database ``db_name``, collection
``collection_name``; slot ``i`` of lock ``key`` is the document
``{_id: f"permit:{i}:{key}", value: token, expiredAt: <date>}``; ``ready()``
creates the TTL index ``{expiredAt: 1}`` with ``expireAfterSeconds=0``.

Guarantees: a slot is taken by an upsert whose filter matches the slot's
document only if it has expired (or matches nothing, so the upsert inserts
it). While the document is active the filter matches nothing and the insert
collides with the existing ``_id``: duplicate key (code 11000), which is the
one error that means "held". The filter also matches a document that holds
the caller's own token, so a re-sent copy of an acquire whose reply was lost
succeeds as the first copy did. Release and extend match on ``value`` (the
token) and on ``expiredAt`` being in the future, so a holder whose lease
expired can neither remove nor prolong the record of whoever took it over.

Limits:

- Time is this process's clock: "expired" means ``expiredAt <= now`` as the
  client reads ``now``. Clients whose clocks disagree by more than a lease's
  margin can take over each other's leases early. The server's TTL monitor
  only removes expired documents, some time later (every 60 s by default);
  correctness never depends on it.
- Writes use the write concern the collection has from the client you pass:
  with ``w=1`` a lease acknowledged by a primary that fails before
  replicating it can vanish in a failover. Use ``w="majority"`` (in the URI or
  the client options) for leases that survive one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import cast

from ..._clock import Clock
from ..._core.abc import Holder, Inspection, Renewed, extend_each, sleep
from ..._core.chance import CHANCE
from ..._core.effects import Call, Steps
from ..._core.lease import EPOCH, MAX_EXPIRY_MS, Lease, expiry_datetime, now_ms
from ..._core.waiting import Waiter
from ..._errors import DMutexError, UnsupportedClientError
from ..shapes import method

DUPLICATE_KEY = 11000
# Marks a fence counter document as dmutex's own.
_FENCE_KIND = "dmutex-fence"


def next_fence(counter: object) -> dict[str, object]:
    """The aggregation expression of the fence after ``counter`` (an expression).

    By ``dmutex._core.fences`` (rule 1): the larger of the counter plus one
    and the server's clock in microseconds ($$NOW is in milliseconds), so
    that a counter that was deleted (by hand; a read-write lock's by the TTL
    monitor) restarts above the fences handed out before, by the one clock
    that every client's request reads.
    """
    return {"$max": [{"$add": [counter, 1]}, {"$multiply": [{"$toLong": "$$NOW"}, 1000]}]}


# The counter document's update: an update pipeline (MongoDB 4.2 and later),
# so that the counter and the clock are read and written in one atomic step.
_NEXT_FENCE = [{"$set": {"fence": next_fence({"$ifNull": ["$fence", 0]})}}]


def create_ttl_index(create_index: Callable[..., object]) -> Steps[None]:
    """Create the TTL index ``{expiredAt: 1}``; an existing identical index is no error."""
    yield Call(create_index, ([("expiredAt", 1)],), {"expireAfterSeconds": 0})


def is_duplicate_key(error: BaseException) -> bool:
    """Whether ``error`` is a duplicate-key error: any exception whose ``code`` is 11000."""
    return getattr(error, "code", None) == DUPLICATE_KEY


def _count(result: object, name: str) -> int:
    """``result.<name>``, which must be an int: matched or deleted documents."""
    value = getattr(result, name, None)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DMutexError(f"unexpected result from MongoDB: {name}={value!r}")
    return value


def _found(find: Callable[..., object], query: Mapping[str, object]) -> object:
    """Every document ``find(query)`` gives: the cursor read to its end.

    An asyncio client's cursor (motor's, PyMongo's ``AsyncCursor``) is read
    by its ``to_list(None)``, whose awaitable the async driver awaits.
    """
    cursor = find(query)
    if isinstance(cursor, Iterable):
        return list(cursor)
    to_list = getattr(cursor, "to_list", None)
    if not callable(to_list):
        raise DMutexError(f"find() gave {type(cursor).__name__}, not a cursor to read")
    return to_list(None)


def found_keys(
    find: Callable[..., object],
    query: Mapping[str, object],
    key_of: Callable[[object], str | None],
    limit: int,
    most: int,
) -> list[str]:
    """The first ``limit`` distinct keys of the documents ``query`` finds, sorted.

    The documents come by ``_id`` (only it), at most ``most`` of them, and
    the cursor is closed once ``limit`` keys are found; ``key_of`` reads a
    document's key from its ``_id`` (None: none).
    """
    cursor = find(query, {"_id": 1}, sort=[("_id", 1)], limit=most)
    if not isinstance(cursor, Iterable):
        raise DMutexError(f"find() gave {type(cursor).__name__}, not a cursor to read")
    found: set[str] = set()
    try:
        for doc in cursor:
            key = key_of(doc.get("_id") if isinstance(doc, Mapping) else None)
            if key is not None:
                found.add(key)
                if len(found) >= limit:
                    break
    finally:
        close = getattr(cursor, "close", None)
        if callable(close):
            close()
    return sorted(found)


def _fencing_method(collection: object) -> Callable[..., object]:
    try:
        return method(collection, "find_one_and_update")
    except UnsupportedClientError as error:
        raise UnsupportedClientError(f"fencing=True on MongoDB needs it: {error}") from None


class MongoStore:
    """One collection of lease documents; a ``Store``.

    Requests per operation (see the documentation's MongoDB page,
    "Requests"): a mutex acquire is one upsert;
    a semaphore acquire is one upsert when the slot it tries first is free,
    two (upsert, then ``distinct`` of the active slots) when all are held,
    else three, plus one per race lost to another caller; with
    ``fencing=True`` a successful acquire adds one (:meth:`_fence`). Release
    and extend are one request each, and so are ``holders`` and ``keys``;
    ``ready()`` one, once per instance.
    """

    max_expiry_ms = MAX_EXPIRY_MS

    def __init__(
        self, collection: object, max_permits: int, clock: Clock, *, fencing: bool = False
    ) -> None:
        self._update = method(collection, "update_one")
        # Fencing needs the counter's new value back: find_one_and_update.
        self._bump = _fencing_method(collection) if fencing else None
        self._delete = method(collection, "delete_one")
        self._distinct = method(collection, "distinct")
        self._create_index = method(collection, "create_index")
        self._collection = collection
        self._permits = max_permits
        self._clock = clock

    @property
    def clock(self) -> Clock:
        return self._clock

    @staticmethod
    def _id(slot: int, key: str) -> str:
        return f"permit:{slot}:{key}"

    def _ids(self, key: str) -> list[str]:
        return [f"permit:{slot}:{key}" for slot in range(self._permits)]

    def ready(self) -> Steps[None]:
        """Create the TTL index; an existing identical index is no error."""
        return create_ttl_index(self._create_index)

    def _take(self, slot: int, key: str, token: str, now: int, expires: int) -> Steps[bool]:
        """Upsert slot ``slot`` if free, expired or ours; False on duplicate key (held).

        "Ours": the document already holds ``token``, because an earlier copy
        of this very request was applied and its reply lost. The upsert then
        matches it and the acquire succeeds, as the first copy did.
        """
        selector = {
            "_id": self._id(slot, key),
            "$or": [{"expiredAt": {"$lte": expiry_datetime(now)}}, {"value": token}],
        }
        update = {"$set": {"value": token, "expiredAt": expiry_datetime(expires)}}
        try:
            yield Call(self._update, (selector, update), {"upsert": True})
        except Exception as error:
            if is_duplicate_key(error):
                return False
            raise
        return True

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None = None
    ) -> Steps[Lease | None]:
        """Take a free or expired slot; None when every slot is active.

        A mutex tries its one slot. A semaphore tries a random slot first
        (so concurrent callers spread out), then asks which slots are active
        and tries the others in random order. With fencing, a taken slot
        then gets its fence: one more request (:meth:`_fence`).
        """
        lease = yield from self._take_any(key, token, ttl_ms)
        if lease is None or self._bump is None:
            return lease
        return (yield from self._fence(lease))

    def _fence(self, lease: Lease) -> Steps[Lease | None]:
        """Move the key's fence counter on for ``lease``; None if the lease ran out first.

        The counter is the document ``{_id: "fence:<key>", kind:
        "dmutex-fence", fence: <n>}`` beside the slots (no ``expiredAt``, so
        the TTL index never removes it), moved to the larger of itself plus
        one and the server's clock in microseconds (:data:`_NEXT_FENCE`).
        It moves after the slot is taken, and the grant counts only if the
        reply comes back before the lease's expiry estimate: then the move
        happened while the lease was active, and any later holder of the
        slot took it after that expiry, so its move comes later and its
        fence is higher. A holder paused past its expiry between the two
        requests gets None, never a fence above a later holder's. A
        document with that ``_id`` that dmutex did not write is never
        changed: the upsert collides with it (twice: the first collision may
        be another acquire creating the counter at the same moment) and the
        acquire raises.
        """
        assert self._bump is not None  # only called with fencing on
        selector = {"_id": f"fence:{lease.key}", "kind": _FENCE_KIND}
        # return_document=True is pymongo's ReturnDocument.AFTER.
        options = {"upsert": True, "return_document": True}
        for attempt in (1, 2):
            try:
                doc = yield Call(self._bump, (selector, _NEXT_FENCE), options)
                break
            except Exception as error:
                if not is_duplicate_key(error):
                    raise
                # Once: two first acquires of the key may both insert the
                # counter, and one collides. Twice: the _id holds a document
                # dmutex did not write.
                if attempt == 2:
                    raise DMutexError(
                        f"the document {selector['_id']!r} holds a value dmutex did not write"
                    ) from error
        fence = doc.get("fence") if isinstance(doc, Mapping) else None
        if isinstance(fence, bool) or not isinstance(fence, int) or fence < 1:
            raise DMutexError(f"unexpected fence document from MongoDB: {doc!r}")
        if now_ms(self._clock) >= lease.expires_ms:
            return None
        lease.fence = fence
        return lease

    def _take_any(self, key: str, token: str, ttl_ms: int) -> Steps[Lease | None]:
        now = now_ms(self._clock)
        expires = now + ttl_ms
        permits = self._permits
        first = 0 if permits == 1 else CHANCE.randrange(permits)
        if (yield from self._take(first, key, token, now, expires)):
            return Lease(key, token, first, expires)
        if permits == 1:
            return None
        active = yield Call(
            self._distinct,
            ("_id", {"_id": {"$in": self._ids(key)}, "expiredAt": {"$gt": expiry_datetime(now)}}),
        )
        if not isinstance(active, list):
            raise DMutexError(f"unexpected result from MongoDB distinct: {active!r}")
        held = set(active)
        free = [slot for slot in range(permits) if self._id(slot, key) not in held]
        free = [slot for slot in free if slot != first]
        CHANCE.shuffle(free)
        for slot in free:
            # Each failure here is a race lost: someone took it since distinct.
            if (yield from self._take(slot, key, token, now, expires)):
                return Lease(key, token, slot, expires)
        return None

    def _selector(self, key: str, token: str, slot: int | None) -> dict[str, object]:
        """The active document of ``key`` that holds ``token``, in slot ``slot`` if known."""
        now = expiry_datetime(now_ms(self._clock))
        ids: object = self._id(slot, key) if slot is not None else {"$in": self._ids(key)}
        return {"_id": ids, "value": token, "expiredAt": {"$gt": now}}

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        """Delete the active document holding ``token``: one ``delete_one``."""
        result = yield Call(self._delete, (self._selector(key, token, slot),))
        return _count(result, "deleted_count") == 1

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        """Set ``expiredAt`` of the active document holding ``token``: one ``update_one``."""
        selector = self._selector(key, token, slot)
        expires = now_ms(self._clock) + ttl_ms
        update = {"$set": {"expiredAt": expiry_datetime(expires)}}
        result = yield Call(self._update, (selector, update), {"upsert": False})
        return expires if _count(result, "matched_count") == 1 else None

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        """One ``update_one`` per lease, in turn: each must match its own token."""
        return extend_each(self, leases)

    def holders(self, key: str) -> Steps[Inspection]:
        """The active slot documents of ``key`` and its fence counter: one ``find``.

        The collection needs ``find``, which no other operation uses; an
        asyncio client's cursor is read with ``to_list``.
        """
        now = now_ms(self._clock)
        names = [*self._ids(key), f"fence:{key}"]
        query = {"_id": {"$in": names}}
        docs = yield Call(_found, (method(self._collection, "find"), query))
        found: list[Holder] = []
        fence: int | None = None
        for doc in cast("list[Mapping[str, object]]", docs):
            name, value, at = doc.get("_id"), doc.get("value"), doc.get("expiredAt")
            if name == names[-1]:
                counted = doc.get("fence")
                if doc.get("kind") == _FENCE_KIND and isinstance(counted, int):
                    fence = counted
            elif isinstance(name, str) and isinstance(value, str) and isinstance(at, datetime):
                at = at if at.tzinfo else at.replace(tzinfo=timezone.utc)
                expires = round((at - EPOCH).total_seconds() * 1000)
                if expires > now:
                    found.append(Holder(int(name.split(":", 2)[1]), value, expires))
        return Inspection(sorted(found), fence, now)

    def keys(self, limit: int) -> Steps[list[str]]:
        """The first ``limit`` keys with an active slot document (slots 0 .. N-1): one ``find``.

        By ``_id`` order (``permit:0:...`` first) and at most ``limit`` times N
        documents: a key has at most N, so that many hold ``limit`` keys if
        they exist. Sync collections only, as :meth:`holders`.
        """
        now = expiry_datetime(now_ms(self._clock))
        slots = "|".join(str(slot) for slot in range(self._permits))
        query = {"_id": {"$regex": f"^permit:(?:{slots}):"}, "expiredAt": {"$gt": now}}
        find = method(self._collection, "find")
        most = limit * self._permits
        keys = yield Call(found_keys, (find, query, _key_of_slot, limit, most))
        return cast("list[str]", keys)  # what found_keys() returned

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        """Sleep: nothing here signals a release (jittered polling, ``waiting.py``)."""
        return sleep(seconds)


def _key_of_slot(name: object) -> str | None:
    """The key of a slot document's ``_id``, ``permit:{i}:{key}``."""
    if not isinstance(name, str):
        return None
    parts = name.split(":", 2)
    return parts[2] if len(parts) == 3 and parts[2] else None

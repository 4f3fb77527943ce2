"""The MongoDB store of read-write locks: one document per key, changed by one pipeline update.

Layout (dmutex's own; the TypeScript library has no read-write lock): the
collection is the mutex store's option (``collection_prefix`` ``_drwlock_``
by default, so ``_drwlock_{service}``), with the same TTL index
``{expiredAt: 1}``, ``expireAfterSeconds=0``. Lock ``key`` is the one
document::

    {_id: f"rwlock:{key}", kind: "dmutex-rwlock",
     w: {t: <token>, e: <date>} | null,       # the writer
     r: [{t: <token>, e: <date>}, ...],       # the readers, in the order granted
     i: [{t: <token>, e: <date>}, ...],       # the waiting writers' intents, until e
     fence: <int64>,                          # the last fence granted
     expiredAt: <date>}                       # the latest e, or now when none is left

in that field order, nothing expired kept (each write drops what has).

Rules of this module:

1. One request per operation. Acquire, release and extend are each one
   ``find_one_and_update`` whose update is an aggregation pipeline (MongoDB
   4.2 and later) whose ``$replaceRoot`` stage drops what has expired,
   decides by the rules of ``dmutex._core.readwrite`` and writes the whole
   document, all in the server's one atomic step on that document, so
   concurrent callers are decided one after the other. ``holders`` is one
   ``find_one`` and changes nothing. A renewal batch is one extend per
   lease, in turn.
2. Time is this process's clock, as the mutex store's: ``now`` and every
   expiry go in the pipeline as date literals. Fences are not: a grant's
   fence is the larger of the counter plus one and the server's ``$$NOW``
   in microseconds (``mongo.next_fence``, the mutex counter's expression),
   because the counter lives in the document, which the TTL monitor
   deletes once nothing in it is live: the next grant then restarts from
   the one clock every client's request reads, not from a client's clock
   that may be behind the last grant's.
3. The answer is read from the document the server returns: after the
   update for acquire and extend (the hold is there with the expiry this
   request set, or it is not; the fence is the stored one), before it for a
   release (whether a hold of the token was active, by ``readwrite.drop``).
   A refused attempt learns when what stands in its way lapses from the
   rules asked again of the state it left (a refusal changes nothing but
   the writer's own intent, which no refusal counts).
4. A document at ``rwlock:{key}`` without ``kind: "dmutex-rwlock"`` is never
   written. Acquire's filter names the kind, so its upsert's insert collides
   with such a document (E11000); once may be two first acquires of the key
   racing to insert, so it is sent again once, and a second collision
   raises :class:`~dmutex.DMutexError`. Release and extend do not upsert:
   their filter is the ``_id`` alone and their pipeline gives a document
   without the kind back as it is (``$$ROOT``), which the reply then shows,
   and they raise; ``holders`` raises on it too. A later layout would carry
   another kind.
5. The TTL index removes a document only once ``expiredAt`` has passed, by
   the server's clock: every hold and intent in it has ended by the clock of
   the client that wrote it last. Clients whose clocks disagree by more than
   a lease's margin can lose holds early, as with the mutex store.
6. Nothing signals a release: a retrying attempt polls (``waiting.py``),
   told by its refusal when the hold or intent in its way lapses at the
   latest, so that it waits no longer than that.
7. The pipeline keeps to the forms that MongoDB, SecantusDB and mongomock
   evaluate alike, so that the suites with and without a server check the
   same requests: every path into a value that may be null or missing goes
   through ``$ifNull``, an array built from the request's constants is a
   ``$literal``, and the comments say where another form was chosen for one
   of them. mongomock has no ``$$NOW``: its fences count 1, 2, 3, as
   InMemoryBackend's do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import cast

from ..._clock import Clock
from ..._core import readwrite
from ..._core.abc import Holder, Inspection, Renewed, extend_each, sleep
from ..._core.effects import Call, Steps
from ..._core.lease import EPOCH, MAX_EXPIRY_MS, Lease, expiry_datetime, now_ms
from ..._core.waiting import Waiter
from ..._errors import DMutexError
from ..shapes import method
from .store import create_ttl_index, found_keys, is_duplicate_key, next_fence

__all__ = ["KIND", "MongoReadWriteStore"]

KIND = "dmutex-rwlock"
"""The ``kind`` that marks a read-write lock document as dmutex's."""

# pymongo's ReturnDocument.BEFORE and .AFTER are these booleans; motor's too.
_BEFORE, _AFTER = False, True
_ONE_MS = timedelta(milliseconds=1)

Expr = object  # an aggregation expression: what the server evaluates


def _id(key: str) -> str:
    return f"rwlock:{key}"


# --- the pipeline: small builders, one per piece of the rules ---------------------------


def _let(names: dict[str, Expr], body: Expr) -> dict[str, Expr]:
    """``body`` with ``names`` bound (``$$name``); a later piece reads an earlier one's."""
    return {"$let": {"vars": names, "in": body}}


def _token(token: str) -> dict[str, Expr]:
    # A token is data, never a field path, even one that starts with "$".
    return {"$literal": token}


def _hold(token: str, until: datetime) -> dict[str, Expr]:
    return {"$literal": {"t": token, "e": until}}


def _live(array: Expr, now: datetime) -> dict[str, Expr]:
    """The entries of ``array`` (missing: none) that end after ``now``."""
    return {
        "$filter": {
            "input": {"$ifNull": [array, []]},
            "as": "h",
            "cond": {"$gt": ["$$h.e", now]},
        }
    }


def _without(array: Expr, token: str) -> dict[str, Expr]:
    """The entries of ``array`` whose token is not ``token``."""
    return {"$filter": {"input": array, "as": "h", "cond": {"$ne": ["$$h.t", _token(token)]}}}


def _has(array: Expr, token: str) -> dict[str, Expr]:
    """Whether an entry of ``array`` has ``token``."""
    mine = {"$filter": {"input": array, "as": "h", "cond": {"$eq": ["$$h.t", _token(token)]}}}
    return {"$gt": [{"$size": mine}, 0]}


def _ends(array: Expr) -> dict[str, Expr]:
    """The ends of the entries of ``array``."""
    # $map, not the path "$$array.e": a server may give null for that path
    # into an empty array, where MongoDB gives [].
    return {"$map": {"input": array, "as": "h", "in": "$$h.e"}}


def _writer_is(token: str) -> dict[str, Expr]:
    """Whether the live writer ``$$w`` (null if none) is ``token``."""
    return {"$eq": [{"$ifNull": ["$$w.t", None]}, _token(token)]}


def _pruned(now: datetime) -> dict[str, Expr]:
    """The stored state less what has expired: ``$$w``, ``$$r``, ``$$i``, ``$$f`` (rule 1)."""
    return {
        "w": {"$cond": [{"$gt": [{"$ifNull": ["$w.e", None]}, now]}, "$w", None]},
        "r": _live("$r", now),
        "i": _live("$i", now),
        "f": {"$ifNull": ["$fence", 0]},
    }


def _document(now: datetime) -> dict[str, Expr]:
    """The whole document from the new state ``$$nw``, ``$$nr``, ``$$ni``, ``$$nf``.

    ``expiredAt`` is the latest end among them, so the TTL monitor leaves
    the document while anything in it is live; ``now`` once nothing is left,
    so that it goes soon.
    """
    # The ends bound to a name first: mongomock takes $max's one operand for
    # an array only when it is a name, as "$$ends" is.
    ends = {"$concatArrays": [_ends("$$nr"), _ends("$$ni")]}
    latest = _let({"ends": ends}, {"$max": [{"$max": "$$ends"}, {"$ifNull": ["$$nw.e", None]}]})
    return {
        "_id": "$_id",
        "kind": KIND,
        "w": "$$nw",
        "r": "$$nr",
        "i": "$$ni",
        "fence": {"$toLong": "$$nf"},
        "expiredAt": {"$ifNull": [latest, now]},
    }


def _pipeline(
    now: datetime, steps: Sequence[dict[str, Expr]], *, guarded: bool
) -> list[dict[str, Expr]]:
    """The update: prune, then each of ``steps`` (names bound in turn), then the document.

    The last step binds the new state (``nw``, ``nr``, ``ni``, ``nf``).
    ``guarded``: a document without dmutex's kind is given back as it is
    (rule 4), for the requests whose filter does not name the kind.
    """
    body: Expr = _document(now)
    for names in reversed([_pruned(now), *steps]):
        body = _let(names, body)
    if not guarded:
        return [{"$replaceRoot": {"newRoot": body}}]
    ours = {"$eq": [{"$ifNull": ["$kind", None]}, KIND]}
    # The first stage changes nothing; after it mongomock hands $replaceRoot a
    # copy, where $$ROOT would be the very document it empties to replace.
    return [
        {"$set": {"_id": "$_id"}},
        {"$replaceRoot": {"newRoot": {"$cond": [ours, body, "$$ROOT"]}}},
    ]


def _unchanged(**changes: Expr) -> dict[str, Expr]:
    """The new state: ``changes`` over the pruned one."""
    return {"nw": "$$w", "nr": "$$r", "ni": "$$i", "nf": "$$f", **changes}


def read_pipeline(
    token: str, now: datetime, expires: datetime, max_readers: int | None
) -> list[dict[str, Expr]]:
    """A reader's attempt (``readwrite.take_read``).

    Granted to a token already reading (a re-sent attempt), else only with
    no writer, no other writer's intent and room under ``max_readers``; a
    grant puts the token last among the readers with the new expiry and
    moves the fence.
    """
    room: list[Expr] = [
        {"$eq": ["$$w", None]},
        {"$eq": [{"$size": _without("$$i", token)}, 0]},
    ]
    if max_readers is not None:
        room.append({"$lt": [{"$size": "$$r"}, max_readers]})
    ok = {"$or": [_has("$$r", token), {"$and": room}]}
    readers = {
        "$concatArrays": [_without("$$r", token), {"$literal": [{"t": token, "e": expires}]}]
    }
    decided = _unchanged(
        nr={"$cond": ["$$ok", readers, "$$r"]},
        nf={"$cond": ["$$ok", next_fence("$$f"), "$$f"]},
    )
    return _pipeline(now, [{"ok": ok}, decided], guarded=False)


def write_pipeline(
    token: str, now: datetime, expires: datetime, intent: datetime | None
) -> list[dict[str, Expr]]:
    """A writer's attempt (``readwrite.take_write``).

    Granted to the writer itself (a re-sent attempt), else only with no
    writer and no reader; other writers' intents do not count. Granted or
    not, the token's intent goes; refused, it comes back until ``intent``
    (a retrying writer's attempt that is not its last), else not.
    """
    free = {"$and": [{"$eq": ["$$w", None]}, {"$eq": [{"$size": "$$r"}, 0]}]}
    ok = {"$or": [_writer_is(token), free]}
    others = _without("$$i", token)
    waiting: Expr = others
    if intent is not None:
        waiting = {"$concatArrays": [others, {"$literal": [{"t": token, "e": intent}]}]}
    decided = _unchanged(
        nw={"$cond": ["$$ok", _hold(token, expires), "$$w"]},
        ni={"$cond": ["$$ok", others, waiting]},
        nf={"$cond": ["$$ok", next_fence("$$f"), "$$f"]},
    )
    return _pipeline(now, [{"ok": ok}, decided], guarded=False)


def release_pipeline(token: str, now: datetime) -> list[dict[str, Expr]]:
    """End the token's hold, of either kind, and its intent (``readwrite.drop``)."""
    decided = _unchanged(
        nw={"$cond": [_writer_is(token), None, "$$w"]},
        nr=_without("$$r", token),
        ni=_without("$$i", token),
    )
    return _pipeline(now, [decided], guarded=True)


def extend_pipeline(
    token: str, slot: int | None, now: datetime, expires: datetime
) -> list[dict[str, Expr]]:
    """Move the token's live hold of ``slot``'s kind (None: either) to ``expires``.

    ``readwrite.extend``: an intent is no hold and stays as it is. A token
    is never both writer and reader, so both kinds may be tried at once.
    """
    changes: dict[str, Expr] = {}
    if slot != readwrite.READ_SLOT:
        changes["nw"] = {"$cond": [_writer_is(token), _hold(token, expires), "$$w"]}
    if slot != readwrite.WRITE_SLOT:
        moved = {"$cond": [{"$eq": ["$$h.t", _token(token)]}, _hold(token, expires), "$$h"]}
        changes["nr"] = {"$map": {"input": "$$r", "as": "h", "in": moved}}
    return _pipeline(now, [_unchanged(**changes)], guarded=True)


# --- the document, read back -------------------------------------------------------------


def _foreign(name: str) -> DMutexError:
    return DMutexError(f"the document {name!r} holds a value dmutex did not write")


def _ms(value: object) -> int | None:
    """A BSON date as epoch ms (a naive one is UTC, as pymongo gives it); None if not one."""
    if not isinstance(value, datetime):
        return None
    at = value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    return (at - EPOCH) // _ONE_MS


def _entry(value: object) -> tuple[str, int] | None:
    if not isinstance(value, Mapping):
        return None
    token, ends = value.get("t"), _ms(value.get("e"))
    return (token, ends) if isinstance(token, str) and ends is not None else None


def _entries(value: object) -> dict[str, int] | None:
    if not isinstance(value, list):
        return None
    found = [_entry(item) for item in value]
    if any(entry is None for entry in found):
        return None
    return dict(cast("list[tuple[str, int]]", found))


def decode(doc: object, name: str) -> readwrite.State | None:
    """The state the document ``name`` holds; None if there is none.

    Raises :class:`~dmutex.DMutexError` for a document without dmutex's kind
    (rule 4), or with it and fields of other types than the layout's.
    """
    if doc is None:
        return None
    if not isinstance(doc, Mapping) or doc.get("kind") != KIND:
        raise _foreign(name)
    w, fence = doc.get("w"), doc.get("fence")
    writer = None if w is None else _entry(w)
    readers, intents = _entries(doc.get("r")), _entries(doc.get("i"))
    if (
        (w is None or writer is not None)
        and readers is not None
        and intents is not None
        and isinstance(fence, int)
        and not isinstance(fence, bool)
    ):
        return readwrite.State(writer, readers, intents, fence)
    raise DMutexError(f"unexpected read-write lock document from MongoDB: {doc!r}")


def _clears(
    state: readwrite.State, token: str, now: int, write: bool, max_readers: int | None
) -> int:
    """When what refused ``token`` lapses at the latest: the rules' refusal on the state left.

    Asked of a copy: the state a refusal left decides the same refusal
    (rule 3). Were the rules to grant here after all, the answer is now:
    try again at once.
    """
    probe = readwrite.State(state.writer, dict(state.readers), dict(state.intents), state.fence)
    if write:
        decided = readwrite.take_write(probe, token, 1, now, 0, None)
    else:
        decided = readwrite.take_read(probe, token, 1, now, 0, max_readers)
    return decided.clears_ms if isinstance(decided, readwrite.Refusal) else now


class MongoReadWriteStore:
    """One collection of read-write lock documents; a ``ReadWriteStore`` (rules 1-7).

    Requests per operation: acquire 1 (2 when two first acquires of a key
    race to insert its document), release 1, extend 1, holders 1, keys 1, a
    renewal batch 1 per lease, ``ready()`` 1, once per instance. With
    ``fencing=False`` the document counts fences all the same (it costs no
    request); leases and inspections show none.
    """

    max_expiry_ms = MAX_EXPIRY_MS

    def __init__(
        self,
        collection: object,
        max_readers: int | None,
        clock: Clock,
        *,
        fencing: bool = True,
    ) -> None:
        self._update = method(collection, "find_one_and_update")
        self._create_index = method(collection, "create_index")
        self._collection = collection
        self._max_readers = max_readers
        self._clock = clock
        self._fencing = fencing

    @property
    def clock(self) -> Clock:
        return self._clock

    def ready(self) -> Steps[None]:
        """Create the TTL index; an existing identical index is no error."""
        return create_ttl_index(self._create_index)

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None, *, write: bool
    ) -> Steps[Lease | None]:
        """A writer's or a reader's attempt: one upsert, sent again once on a collision."""
        name = _id(key)
        now = now_ms(self._clock)
        expires = now + ttl_ms
        at, until = expiry_datetime(now), expiry_datetime(expires)
        if write:
            intent = readwrite.intent_until(now, waiter)
            shown = None if intent is None else expiry_datetime(intent)
            pipeline = write_pipeline(token, at, until, shown)
        else:
            pipeline = read_pipeline(token, at, until, self._max_readers)
        selector = {"_id": name, "kind": KIND}
        options = {"upsert": True, "return_document": _AFTER}
        for attempt in (1, 2):
            try:
                doc = yield Call(self._update, (selector, pipeline), options)
                break
            except Exception as error:
                if not is_duplicate_key(error):
                    raise
                if attempt == 2:
                    raise _foreign(name) from error
        state = decode(doc, name)
        if state is None:
            raise DMutexError(f"MongoDB gave no document back from an upsert of {name!r}")
        # Granted: the hold is stored with the expiry this request set (rule 3).
        held = state.writer if write else (token, state.readers.get(token))
        if held == (token, expires):
            slot = readwrite.WRITE_SLOT if write else readwrite.READ_SLOT
            fence = state.fence if self._fencing else None
            return Lease(key, token, slot, expires, fence)
        if waiter is not None:
            clears = _clears(state, token, now, write, self._max_readers)
            waiter.expires_in = (clears - now) / 1000
        return None

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        """Sleep: nothing here signals a release (rule 6)."""
        return sleep(seconds)

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        """End ``token``'s hold and intent: one update, answered from the document before it."""
        name = _id(key)
        now = now_ms(self._clock)
        pipeline = release_pipeline(token, expiry_datetime(now))
        options = {"return_document": _BEFORE}
        doc = yield Call(self._update, ({"_id": name}, pipeline), options, complete=True)
        state = decode(doc, name)
        return state is not None and readwrite.drop(state, token, now)

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        """Move ``token``'s live hold's expiry: one update, answered from the document after it."""
        name = _id(key)
        now = now_ms(self._clock)
        expires = now + ttl_ms
        pipeline = extend_pipeline(token, slot, expiry_datetime(now), expiry_datetime(expires))
        options = {"return_document": _AFTER}
        doc = yield Call(self._update, ({"_id": name}, pipeline), options)
        state = decode(doc, name)
        if state is None:
            return None
        writer = slot != readwrite.READ_SLOT and state.writer == (token, expires)
        reader = slot != readwrite.WRITE_SLOT and state.readers.get(token) == expires
        return expires if writer or reader else None

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        """One extend per lease, in turn."""
        return extend_each(self, leases)

    def holders(self, key: str) -> Steps[Inspection]:
        """The live holds of ``key`` and its fence counter: one ``find_one``, no change.

        The collection needs ``find_one``, which no other operation uses.
        """
        name = _id(key)
        find_one: Callable[..., object] = method(self._collection, "find_one")
        doc = yield Call(find_one, ({"_id": name},))
        now = now_ms(self._clock)
        state = decode(doc, name)
        if state is None:
            return Inspection([], None, now)
        found = [Holder(*hold) for hold in readwrite.holders(state, now)]
        return Inspection(found, state.fence if self._fencing else None, now)

    def keys(self, limit: int) -> Steps[list[str]]:
        """The first ``limit`` keys by ``_id`` held by a writer or a reader now: one ``find``.

        Its filter names the kind (rule 4) and a live writer or reader, so
        it finds no document that holds nothing. Sync collections only, as
        :meth:`holders`.
        """
        now = expiry_datetime(now_ms(self._clock))
        query = {
            "_id": {"$regex": "^rwlock:"},
            "kind": KIND,
            "$or": [{"w.e": {"$gt": now}}, {"r.e": {"$gt": now}}],
        }
        find = method(self._collection, "find")
        keys = yield Call(found_keys, (find, query, _key_of, limit, limit))
        return cast("list[str]", keys)  # what found_keys() returned


def _key_of(name: object) -> str | None:
    """The key of a lock document's ``_id``, ``rwlock:{key}``."""
    if not isinstance(name, str) or not name.startswith("rwlock:") or name == "rwlock:":
        return None
    return name[len("rwlock:") :]

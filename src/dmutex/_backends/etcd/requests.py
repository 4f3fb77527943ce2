"""How the etcd store's requests are sent, and their replies read: one dialect per kind of client.

The store (``store.py``) decides what to ask in plain terms (a lease
grant, a :class:`Txn`, a watch) and yields the :class:`~dmutex._core.effects.Call`
a dialect makes of it; the reply comes back to the store, which hands it to
the same dialect to read. A dialect does no I/O of its own: its calls are
the client's methods, or (the gateway's) a function that makes one request
through the client.

Rules:

1. Two dialects, one per client family, chosen by the client's shape
   (``shapes.py``): :class:`Gateway` speaks etcd's JSON gateway through
   etcd3gw's ``post`` (keys and values base64, 64-bit numbers as decimal
   strings, fields at their zero value left out); :class:`Grpc` speaks
   through the methods of aetcd's client (its ``transactions`` builders,
   its lease methods, its replies' attributes).
2. Every reply is read into the plain types here (:class:`Record`,
   :class:`Outcome`); a reply of another shape is a
   :class:`~dmutex.DMutexError` naming it, never a guess.
3. A lease's existence is read from the server's words, the same on both
   dialects: "lease already exists" for a grant of a lease ID in use, and
   "requested lease not found" for a revoke of one that is gone
   (:func:`lease_exists`, :func:`lease_missing`).
4. etcd renews one lease a keep-alive, and neither client sends several in
   one request: a renewal of many leases keeps :data:`IN_FLIGHT` of them
   in flight at once, on threads shared by every gateway dialect (etcd3gw's
   session is one pool of connections) or as tasks on aetcd's channel.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeAlias

from ..._core.effects import Call
from ..._errors import DMutexError

__all__ = [
    "Absent",
    "Delete",
    "Dialect",
    "Gateway",
    "Grpc",
    "Holds",
    "Outcome",
    "Put",
    "Read",
    "Record",
    "Txn",
    "lease_exists",
    "lease_missing",
    "prefix_end",
    "reads",
]


@dataclass(frozen=True, slots=True)
class Record:
    """One key as etcd holds it."""

    key: bytes
    value: bytes
    lease: int
    create_revision: int
    mod_revision: int


@dataclass(frozen=True, slots=True)
class Absent:
    """A comparison: no key in ``[key, end)`` exists (``version == 0``); no ``end``: ``key``."""

    key: bytes
    end: bytes | None = None


@dataclass(frozen=True, slots=True)
class Holds:
    """A comparison: ``key`` exists and holds ``value``."""

    key: bytes
    value: bytes


@dataclass(frozen=True, slots=True)
class Put:
    """An operation: put ``value`` at ``key`` under lease ``lease``."""

    key: bytes
    value: bytes
    lease: int


@dataclass(frozen=True, slots=True)
class Delete:
    """An operation: delete ``key``."""

    key: bytes


@dataclass(frozen=True, slots=True)
class Read:
    """An operation: read the keys in ``[key, end)``; ``end`` None: ``key`` alone."""

    key: bytes
    end: bytes | None = None


Compare: TypeAlias = "Absent | Holds"
Op: TypeAlias = "Put | Delete | Read"


@dataclass(frozen=True, slots=True)
class Txn:
    """A transaction: if every comparison holds, ``success``; else ``failure``.

    No comparison: ``success`` runs.
    """

    compare: tuple[Compare, ...]
    success: tuple[Op, ...]
    failure: tuple[Op, ...] = ()


def reads(*keys: bytes) -> Txn:
    """A transaction that reads ``keys`` and changes nothing."""
    return Txn((), tuple(Read(key) for key in keys))


@dataclass(frozen=True, slots=True)
class Outcome:
    """A transaction's answer: whether its comparison held, the put's revision, what it read.

    ``revision`` is the put's (the transaction's own) when it put, else 0;
    ``records`` the keys read that exist, in the order asked.
    """

    succeeded: bool
    revision: int
    records: list[Record]


def _text(error: BaseException) -> str:
    """What the server said in ``error``: its message, and etcd3gw's ``detail_text``."""
    detail = getattr(error, "detail_text", None)
    return f"{error} {detail if isinstance(detail, str) else ''}"


IN_FLIGHT = 8
"""How many keep-alives a renewal keeps in flight at once (rule 4).

Eight: urllib3 keeps ten connections a host by default, so etcd3gw's session
opens none it would then discard.
"""

_THREADS: ThreadPoolExecutor | None = None
_THREADS_LOCK = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    """The threads that carry the gateway's keep-alives, started on first use."""
    global _THREADS
    with _THREADS_LOCK:
        if _THREADS is None:
            _THREADS = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="dmutex-etcd-keepalive")
        return _THREADS


def lease_exists(error: BaseException) -> bool:
    """Whether ``error`` is etcd's refusal of a grant whose lease ID is in use (rule 3).

    aetcd raises ``DuplicateLeaseError`` with no message; etcd3gw, an error
    whose ``detail_text`` holds etcd's.
    """
    return type(error).__name__ == "DuplicateLeaseError" or "lease already exists" in _text(error)


def lease_missing(error: BaseException) -> bool:
    """Whether ``error`` is etcd's answer that the lease is gone (rule 3)."""
    return "requested lease not found" in _text(error)


def _int(value: object, what: str) -> int:
    """A 64-bit number of a reply: an int, or the gateway's decimal string; absent is 0."""
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    raise DMutexError(f"unexpected {what} in a reply from etcd: {value!r}")


class Dialect:
    """What the store asks of a client family; each method makes a Call or reads a reply."""

    def grant(self, lease: int, seconds: int) -> Call:
        """Grant lease ``lease`` for ``seconds``; raises if the ID is in use (``lease_exists``)."""
        raise NotImplementedError

    def granted(self, reply: object) -> int:
        """The TTL (seconds) a grant's ``reply`` gave, the server's minimum applied."""
        raise NotImplementedError

    def granted_id(self, reply: object) -> int:
        """The lease ID a grant's ``reply`` gave (the server's choice, when asked for ID 0)."""
        raise NotImplementedError

    def keepalive(self, lease: int) -> Call:
        """Renew lease ``lease`` to its granted TTL from now."""
        raise NotImplementedError

    def kept(self, reply: object) -> int:
        """The TTL (seconds) a keep-alive's ``reply`` renewed the lease to; 0: it is gone."""
        raise NotImplementedError

    def keepalives(self, leases: Sequence[int]) -> Call:
        """Renew every lease of ``leases`` (rule 4): several keep-alives in flight at once.

        The reply is each lease's answer, in order: the TTL it was renewed to
        (0: it is gone), or the exception its request raised.
        """
        raise NotImplementedError

    def revoke(self, lease: int) -> Call:
        """Revoke lease ``lease`` and delete its keys; raises if it is gone (``lease_missing``)."""
        raise NotImplementedError

    def time_to_live(self, lease: int) -> Call:
        """Read lease ``lease``'s remaining TTL."""
        raise NotImplementedError

    def remaining(self, reply: object) -> int:
        """The seconds a time-to-live ``reply`` gave; <= 0: the lease is gone."""
        raise NotImplementedError

    def txn(self, txn: Txn) -> Call:
        """Send ``txn``."""
        raise NotImplementedError

    def outcome(self, reply: object) -> Outcome:
        """Read a transaction's ``reply``."""
        raise NotImplementedError

    def range(self, prefix: bytes, start: bytes, limit: int) -> Call:
        """Read up to ``limit`` keys (no values) from ``start`` on that begin with ``prefix``.

        In key order. A dialect whose client sends no limit reads them all.
        """
        raise NotImplementedError

    def keys(self, reply: object) -> tuple[list[bytes], bool]:
        """The keys a range's ``reply`` read, and whether more are in the range."""
        raise NotImplementedError

    def watch(self, key: bytes, end: bytes | None, revision: int, seconds: float) -> Call:
        """Wait up to ``seconds`` for a change of ``key`` (or ``[key, end)``) at ``revision`` on.

        Returns an event when one came; raises when ``seconds`` passed (each
        client its own error) or the watch failed.
        """
        raise NotImplementedError


def prefix_end(prefix: bytes) -> bytes:
    """The end of the range of keys that begin with ``prefix`` (etcd's range_end for a prefix)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\x00"  # every key
    end[-1] += 1
    return bytes(end)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(value: object, what: str) -> bytes:
    if value is None:
        return b""
    if not isinstance(value, str):
        raise DMutexError(f"unexpected {what} in a reply from etcd: {value!r}")
    return base64.b64decode(value)


def _mapping(reply: object, what: str) -> Mapping[str, object]:
    if not isinstance(reply, Mapping):
        raise DMutexError(f"unexpected reply from etcd to {what}: {reply!r}")
    return reply


def _list(value: object, what: str) -> Sequence[object]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise DMutexError(f"unexpected {what} in a reply from etcd: {value!r}")
    return value


class Gateway(Dialect):
    """etcd's JSON gateway, through an etcd3gw client's ``post`` and ``watch_once`` (rule 1)."""

    def __init__(self, client: object) -> None:
        self._client = client
        self._post: Callable[..., object] = client.post  # type: ignore[attr-defined]  # shapes.py checked it
        self._url: Callable[[str], str] = client.get_url  # type: ignore[attr-defined]  # as post
        self._watch: Callable[..., object] = client.watch_once  # type: ignore[attr-defined]  # as post

    def _request(self, path: str, payload: Mapping[str, object]) -> object:
        """POST ``payload`` to ``path``: one request (etcd3gw finds its API path on the first)."""
        return self._post(self._url(path), json=payload)

    def _call(self, path: str, payload: Mapping[str, object]) -> Call:
        return Call(self._request, (path, payload))

    def grant(self, lease: int, seconds: int) -> Call:
        return self._call("/lease/grant", {"TTL": seconds, "ID": lease})

    def granted(self, reply: object) -> int:
        return _int(_mapping(reply, "a lease grant").get("TTL"), "TTL")

    def granted_id(self, reply: object) -> int:
        return _int(_mapping(reply, "a lease grant").get("ID"), "ID")

    def keepalive(self, lease: int) -> Call:
        return self._call("/lease/keepalive", {"ID": lease})

    def kept(self, reply: object) -> int:
        result = _mapping(_mapping(reply, "a keep-alive").get("result"), "a keep-alive")
        return _int(result.get("TTL"), "TTL")

    def keepalives(self, leases: Sequence[int]) -> Call:
        return Call(self._keepalives, (tuple(leases),))

    def _keepalives(self, leases: Sequence[int]) -> list[int | Exception]:
        """One keep-alive a lease, :data:`IN_FLIGHT` at once on threads (rule 4)."""
        pool = _threads()
        sent = [pool.submit(self._request, "/lease/keepalive", {"ID": lease}) for lease in leases]
        answers: list[int | Exception] = []
        for future in sent:
            try:
                answers.append(self.kept(future.result()))
            except Exception as error:  # noqa: BLE001 - this lease's answer; the others go on
                answers.append(error)
        return answers

    def revoke(self, lease: int) -> Call:
        return self._call("/kv/lease/revoke", {"ID": lease})

    def time_to_live(self, lease: int) -> Call:
        return self._call("/kv/lease/timetolive", {"ID": lease})

    def remaining(self, reply: object) -> int:
        return _int(_mapping(reply, "a lease's time to live").get("TTL"), "TTL")

    def txn(self, txn: Txn) -> Call:
        payload = {
            "compare": [self._compare(compare) for compare in txn.compare],
            "success": [self._op(op) for op in txn.success],
            "failure": [self._op(op) for op in txn.failure],
        }
        return self._call("/kv/txn", payload)

    @staticmethod
    def _compare(compare: Compare) -> dict[str, object]:
        if isinstance(compare, Holds):
            return {
                "key": _b64(compare.key),
                "target": "VALUE",
                "result": "EQUAL",
                "value": _b64(compare.value),
            }
        found: dict[str, object] = {
            "key": _b64(compare.key),
            "target": "VERSION",
            "result": "EQUAL",
            "version": 0,
        }
        if compare.end is not None:
            found["range_end"] = _b64(compare.end)
        return found

    @staticmethod
    def _op(op: Op) -> dict[str, object]:
        if isinstance(op, Put):
            put = {"key": _b64(op.key), "value": _b64(op.value), "lease": op.lease}
            return {"request_put": put}
        if isinstance(op, Delete):
            return {"request_delete_range": {"key": _b64(op.key)}}
        read = {"key": _b64(op.key)}
        if op.end is not None:
            read["range_end"] = _b64(op.end)
        return {"request_range": read}

    def outcome(self, reply: object) -> Outcome:
        body = _mapping(reply, "a transaction")
        succeeded = body.get("succeeded", False) is True
        revision = 0
        records: list[Record] = []
        for item in _list(body.get("responses"), "responses"):
            op = _mapping(item, "a transaction")
            if "response_put" in op:
                put = _mapping(op["response_put"], "a put")
                revision = revision or _int(
                    _mapping(put.get("header"), "a put").get("revision"), "revision"
                )
            elif "response_range" in op:
                found = _mapping(op["response_range"], "a read")
                records.extend(self._record(kv) for kv in _list(found.get("kvs"), "kvs"))
            elif "response_delete_range" not in op:
                raise DMutexError(f"unexpected reply from etcd to a transaction: {reply!r}")
        return Outcome(succeeded, revision, records)

    @staticmethod
    def _record(kv: object) -> Record:
        fields = _mapping(kv, "a read")
        return Record(
            _unb64(fields.get("key"), "key"),
            _unb64(fields.get("value"), "value"),
            _int(fields.get("lease"), "lease"),
            _int(fields.get("create_revision"), "create_revision"),
            _int(fields.get("mod_revision"), "mod_revision"),
        )

    def range(self, prefix: bytes, start: bytes, limit: int) -> Call:
        end = prefix_end(prefix)
        payload = {"key": _b64(start), "range_end": _b64(end), "limit": limit, "keys_only": True}
        return self._call("/kv/range", payload)

    def keys(self, reply: object) -> tuple[list[bytes], bool]:
        body = _mapping(reply, "a read")
        found = [
            _unb64(_mapping(kv, "a read").get("key"), "key") for kv in _list(body.get("kvs"), "kvs")
        ]
        return found, body.get("more", False) is True

    def watch(self, key: bytes, end: bytes | None, revision: int, seconds: float) -> Call:
        # NOPUT: only a key's deletion (a release, an expiry) ends the wait.
        options: dict[str, object] = {
            "timeout": seconds,
            "start_revision": revision,
            "filters": ["NOPUT"],
        }
        if end is not None:
            options["range_end"] = end  # etcd3gw base64-encodes bytes as they are
        return Call(self._watch, (key,), options)


class Grpc(Dialect):
    """etcd's gRPC API, through an aetcd client's methods (rule 1)."""

    def __init__(self, client: object) -> None:
        self._client = client
        # The client's own request builders: dmutex imports nothing of aetcd.
        self._ops: object = client.transactions  # type: ignore[attr-defined]  # shapes.py checked it

    def _method(self, name: str) -> Callable[..., object]:
        found: Callable[..., object] = getattr(self._client, name)
        return found

    def grant(self, lease: int, seconds: int) -> Call:
        # aetcd sends lease_id=None as ID 0: the server's choice.
        return Call(self._method("lease"), (seconds,), {"lease_id": lease or None})

    def granted(self, reply: object) -> int:
        return _int(getattr(reply, "ttl", None), "TTL")

    def granted_id(self, reply: object) -> int:
        return _int(getattr(reply, "id", None), "ID")

    def keepalive(self, lease: int) -> Call:
        return Call(self._method("refresh_lease"), (lease,))

    def kept(self, reply: object) -> int:
        return _int(getattr(reply, "TTL", None), "TTL")

    def keepalives(self, leases: Sequence[int]) -> Call:
        return Call(self._keepalives, (tuple(leases),))

    async def _keepalives(self, leases: Sequence[int]) -> list[int | Exception]:
        """One keep-alive a lease, :data:`IN_FLIGHT` at once on the client's channel (rule 4)."""
        refresh = self._method("refresh_lease")
        turns = asyncio.Semaphore(IN_FLIGHT)

        async def one(lease: int) -> int | Exception:
            async with turns:
                try:
                    reply = refresh(lease)
                    return self.kept(await reply if inspect.isawaitable(reply) else reply)
                except Exception as error:  # noqa: BLE001 - this lease's answer
                    return error

        return list(await asyncio.gather(*(one(lease) for lease in leases)))

    def revoke(self, lease: int) -> Call:
        return Call(self._method("revoke_lease"), (lease,))

    def time_to_live(self, lease: int) -> Call:
        return Call(self._method("get_lease_info"), (lease,), {"keys": False})

    def remaining(self, reply: object) -> int:
        return _int(getattr(reply, "TTL", None), "TTL")

    def _builder(self, name: str) -> Callable[..., object]:
        found: Callable[..., object] = getattr(self._ops, name)
        return found

    def txn(self, txn: Txn) -> Call:
        compare = [self._compare(item) for item in txn.compare]
        success = [self._op(op) for op in txn.success]
        failure = [self._op(op) for op in txn.failure]
        return Call(
            self._method("transaction"),
            (),
            {"compare": compare, "success": success, "failure": failure},
        )

    def _compare(self, compare: Compare) -> object:
        if isinstance(compare, Holds):
            return self._builder("value")(compare.key) == compare.value
        return self._builder("version")(compare.key, compare.end) == 0

    def _op(self, op: Op) -> object:
        if isinstance(op, Put):
            return self._builder("put")(op.key, op.value, lease=op.lease)
        if isinstance(op, Delete):
            return self._builder("delete")(op.key)
        return self._builder("get")(op.key, op.end)

    def outcome(self, reply: object) -> Outcome:
        if not isinstance(reply, tuple) or len(reply) != 2 or not isinstance(reply[0], bool):
            raise DMutexError(f"unexpected reply from etcd to a transaction: {reply!r}")
        succeeded, responses = reply
        revision = 0
        records: list[Record] = []
        for response in _list(responses, "responses"):
            if isinstance(response, list):  # a read: aetcd's (value, key-value) pairs
                records.extend(self._record(pair) for pair in response)
                continue
            which = getattr(response, "WhichOneof", None)
            if not callable(which):
                raise DMutexError(f"unexpected reply from etcd to a transaction: {reply!r}")
            if which("response") == "response_put":  # aetcd hands protobuf's ResponseOp over
                header = getattr(getattr(response, "response_put", None), "header", None)
                revision = revision or _int(getattr(header, "revision", None), "revision")
        return Outcome(succeeded, revision, records)

    @staticmethod
    def _record(pair: object) -> Record:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise DMutexError(f"unexpected read in a reply from etcd: {pair!r}")
        value, kv = pair
        key = getattr(kv, "key", None)
        if not isinstance(value, bytes) or not isinstance(key, bytes):
            raise DMutexError(f"unexpected read in a reply from etcd: {pair!r}")
        return Record(
            key,
            value,
            _int(getattr(kv, "lease", None), "lease"),
            _int(getattr(kv, "create_revision", None), "create_revision"),
            _int(getattr(kv, "mod_revision", None), "mod_revision"),
        )

    def range(self, prefix: bytes, start: bytes, limit: int) -> Call:
        # aetcd sends no limit: the whole prefix, in one reply.
        return Call(self._method("get_prefix"), (prefix,), {"keys_only": True})

    def keys(self, reply: object) -> tuple[list[bytes], bool]:
        kvs = getattr(reply, "kvs", None)
        if kvs is None:
            raise DMutexError(f"unexpected reply from etcd to a read: {reply!r}")
        found = []
        for kv in kvs:
            key = getattr(kv, "key", None)
            if not isinstance(key, bytes):
                raise DMutexError(f"unexpected key in a reply from etcd: {key!r}")
            found.append(key)
        return found, getattr(reply, "more", False) is True

    def watch(self, key: bytes, end: bytes | None, revision: int, seconds: float) -> Call:
        # aetcd filters by event kind only through its own enum: a put wakes too (a hint).
        options: dict[str, object] = {"timeout": seconds, "start_revision": revision}
        if end is not None:
            options["range_end"] = end
        return Call(self._watch_once, (key, options))

    async def _watch_once(self, key: bytes, options: Mapping[str, object]) -> object:
        """Aetcd's ``watch_once``, in a task of its own, cancelled with the caller.

        aetcd waits through ``asyncio.wait_for``, which on Python <= 3.11
        returns a result that arrives with a cancellation and drops the
        cancellation (CPython gh-86296): awaited directly, a waiter cancelled
        as a release woke it went on to take the lock. ``asyncio.wait``
        raises the caller's cancellation whatever the task did.
        """
        started = self._method("watch_once")(key, **options)
        if not inspect.isawaitable(started):
            return started  # a sync client's answer: the driver refuses it as of the other face
        task = asyncio.ensure_future(started)
        try:
            await asyncio.wait((task,))
        except asyncio.CancelledError:
            task.cancel()
            raise
        return task.result()

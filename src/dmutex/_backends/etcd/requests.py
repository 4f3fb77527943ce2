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
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..._core.effects import Call
from ..._errors import DMutexError

__all__ = [
    "Dialect",
    "Gateway",
    "Grpc",
    "Outcome",
    "Record",
    "Txn",
    "lease_exists",
    "lease_missing",
    "prefix_end",
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
class Txn:
    """A transaction: if its comparison holds, ``put``; else (or with none) ``reads``.

    The comparison: ``absent`` does not exist, or ``holds`` (a key and a
    value) is that key's value; at most one of the two. ``put`` is ``(key,
    value, lease ID)``. With neither, the transaction reads ``reads``.
    """

    absent: bytes | None
    put: tuple[bytes, bytes, int] | None
    reads: tuple[bytes, ...]
    holds: tuple[bytes, bytes] | None = None


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

    def watch(self, key: bytes, revision: int, seconds: float) -> Call:
        """Wait up to ``seconds`` for a change of ``key`` at ``revision`` or later.

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

    def revoke(self, lease: int) -> Call:
        return self._call("/kv/lease/revoke", {"ID": lease})

    def time_to_live(self, lease: int) -> Call:
        return self._call("/kv/lease/timetolive", {"ID": lease})

    def remaining(self, reply: object) -> int:
        return _int(_mapping(reply, "a lease's time to live").get("TTL"), "TTL")

    def txn(self, txn: Txn) -> Call:
        reads = [{"request_range": {"key": _b64(key)}} for key in txn.reads]
        compare: dict[str, object]
        if txn.absent is not None:
            compare = {
                "key": _b64(txn.absent),
                "target": "VERSION",
                "result": "EQUAL",
                "version": 0,
            }
        elif txn.holds is not None:
            held, value = txn.holds
            compare = {
                "key": _b64(held),
                "target": "VALUE",
                "result": "EQUAL",
                "value": _b64(value),
            }
        else:
            return self._call("/kv/txn", {"success": reads})
        success = []
        if txn.put is not None:
            key, value, lease = txn.put
            put = {"key": _b64(key), "value": _b64(value), "lease": lease}
            success.append({"request_put": put})
        return self._call("/kv/txn", {"compare": [compare], "success": success, "failure": reads})

    def outcome(self, reply: object) -> Outcome:
        body = _mapping(reply, "a transaction")
        succeeded = body.get("succeeded", False) is True
        revision = 0
        records: list[Record] = []
        for item in _list(body.get("responses"), "responses"):
            op = _mapping(item, "a transaction")
            if "response_put" in op:
                put = _mapping(op["response_put"], "a put")
                revision = _int(_mapping(put.get("header"), "a put").get("revision"), "revision")
            elif "response_range" in op:
                found = _mapping(op["response_range"], "a read")
                records.extend(self._record(kv) for kv in _list(found.get("kvs"), "kvs"))
            else:
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

    def watch(self, key: bytes, revision: int, seconds: float) -> Call:
        # NOPUT: only a key's deletion (a release, an expiry) ends the wait.
        return Call(
            self._watch,
            (key,),
            {"timeout": seconds, "start_revision": revision, "filters": ["NOPUT"]},
        )


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
        reads = [self._builder("get")(key) for key in txn.reads]
        transaction = self._method("transaction")
        if txn.absent is not None:
            compare = self._builder("version")(txn.absent) == 0
        elif txn.holds is not None:
            compare = self._builder("value")(txn.holds[0]) == txn.holds[1]
        else:
            return Call(transaction, (), {"compare": [], "success": reads, "failure": []})
        success = []
        if txn.put is not None:
            key, value, lease = txn.put
            success.append(self._builder("put")(key, value, lease=lease))
        return Call(transaction, (), {"compare": [compare], "success": success, "failure": reads})

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
            put = getattr(response, "response_put", None)
            header = getattr(put, "header", None)
            revision = _int(getattr(header, "revision", None), "revision")
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

    def watch(self, key: bytes, revision: int, seconds: float) -> Call:
        return Call(
            self._method("watch_once"), (key,), {"timeout": seconds, "start_revision": revision}
        )

"""The etcd leases of a store's holds: which lease a hold is under, and the requests on it.

Both etcd stores (``store.py``, ``readwrite.py``) keep each hold as a key
under an etcd lease of its own; this module is what they share about those
leases.

Rules:

1. A hold's lease ID is derived from its kind, the namespace, the key and
   the token (:func:`lease_id`), so that a request about a hold names its
   lease without reading it first, and a re-sent grant finds its own.
2. Release is the lease's revoke, extend its keep-alive: one request each.
   A revoke answers whether the lease existed; it deletes the hold's key.
   A renewal of many holds sends their keep-alives together, several in
   flight at once (``requests.py``, rule 4).
3. etcd cannot lengthen a lease: an extend to a longer TTL than the lease's
   moves the hold's key to a new lease of that TTL (a grant with an ID the
   server picks, a transaction that moves the key only if it still holds
   the token, the old lease's revoke), and the book remembers the new lease
   for the hold (at most :data:`MOVED` of them, the oldest forgotten first).
4. A lease that is gone (a revoke or a keep-alive finds none) makes release
   and extend read the hold's key, in case the hold moved in another store
   (or was forgotten here): one request more.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from ..._core.abc import Renewed
from ..._core.effects import Steps
from ..._errors import DMutexError
from .requests import Dialect, Holds, Put, Record, Txn, lease_missing

__all__ = ["MOVED", "Find", "LeaseBook", "Renewal", "lease_id", "lease_seconds"]

# How many moved holds (rule 3) a book remembers; one it forgot costs its
# release or extend a read more (rule 4).
MOVED = 65536

Find = Callable[[], Steps["Record | None"]]
"""Reads the key that holds a hold's token: its record, or None if no key holds it."""


@dataclass(frozen=True, slots=True)
class Renewal:
    """One hold to renew: what :meth:`LeaseBook.extend` takes for it."""

    hold: Hashable
    derived: int
    token: str
    find: Find
    ttl_ms: int
    name: bytes | None = None


def lease_id(kind: str, prefix: str, key: str, token: str) -> int:
    """The lease ID of ``token``'s hold of ``key`` in ``prefix`` (rule 1): 1 .. 2**63 - 1.

    ``kind`` tells the holds of one token apart (a permit, a reader, a
    writer, a writer's intent). 64 bits of BLAKE2b over the four, each after
    its length in bytes (so that no two tuples hash the same text), kept
    positive: two holds share one only by a collision of that hash.
    """
    parts = [part.encode() for part in (kind, prefix, key, token)]
    text = b"".join(len(part).to_bytes(4, "big") + part for part in parts)
    digest = hashlib.blake2b(text, digest_size=8, person=b"dmutex.lease").digest()
    return int.from_bytes(digest, "big") & (2**63 - 1) or 1


def lease_seconds(ttl_ms: int) -> int:
    """The TTL of the lease for ``ttl_ms``: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(ttl_ms / 1000))


class LeaseBook:
    """The leases of one store's holds, and the requests that end or renew them (rules 2-4)."""

    def __init__(self, dialect: Dialect) -> None:
        self._dialect = dialect
        self._moved: OrderedDict[Hashable, int] = OrderedDict()

    def current(self, hold: Hashable, derived: int) -> int:
        """The lease ``hold`` is under, as far as this book knows: a moved one, else ``derived``."""
        return self._moved.get(hold) or derived

    def revoked(self, lease: int) -> Steps[bool]:
        """Revoke ``lease``; whether it existed."""
        try:
            yield self._dialect.revoke(lease)
        except Exception as error:
            if lease_missing(error):
                return False
            raise
        return True

    def revoke_quietly(self, lease: int) -> Steps[None]:
        """Revoke ``lease``; a failure is left to its TTL (the lease expires by itself)."""
        try:
            yield self._dialect.revoke(lease)
        except Exception:  # noqa: BLE001 - nothing depends on it: the lease expires anyway
            return

    def release(self, hold: Hashable, derived: int, find: Find) -> Steps[bool]:
        """End ``hold``: revoke its lease (rule 2), or the one its key is under (rule 4)."""
        lease = self.current(hold, derived)
        self._moved.pop(hold, None)
        if (yield from self.revoked(lease)):
            return True
        found = yield from find()
        if found is None or found.lease in (0, lease):
            return False
        return (yield from self.revoked(found.lease))

    def extend(
        self,
        hold: Hashable,
        derived: int,
        token: str,
        find: Find,
        ttl_ms: int,
        name: bytes | None = None,
    ) -> Steps[bool]:
        """Renew ``hold`` for at least ``ttl_ms`` from now (rules 2-4); False if it is gone.

        ``name``: the hold's key, where the caller knows it (a move then reads
        nothing first: its transaction checks the key holds the token).
        """
        dialect = self._dialect
        lease = self.current(hold, derived)
        kept = dialect.kept((yield dialect.keepalive(lease)))
        found: Record | None = None
        if kept <= 0:
            self._moved.pop(hold, None)
            found = yield from find()
            if found is None or found.lease in (0, lease):
                return False
            lease = found.lease
            kept = dialect.kept((yield dialect.keepalive(lease)))
            if kept <= 0:
                return False
        if kept * 1000 >= ttl_ms:
            return True
        if found is not None:
            name = found.key
        elif name is None:
            found = yield from find()
            if found is None:
                return False
            name = found.key
        return (yield from self._move(hold, token, name, lease, ttl_ms))

    def renew(self, holds: Sequence[Renewal], now: int) -> Steps[list[Renewed]]:
        """Renew each of ``holds`` from ``now``: one batch of keep-alives (rule 2).

        A hold whose lease is gone, or too short for its TTL, then goes the
        way of :meth:`extend` (a read, a move). Answers each one's new
        expiry, None (gone), or the error its request raised.
        """
        leases = [self.current(hold.hold, hold.derived) for hold in holds]
        answers = yield self._dialect.keepalives(leases)
        if not isinstance(answers, list) or len(answers) != len(holds):
            raise DMutexError(f"unexpected answers to {len(holds)} keep-alives: {answers!r}")
        renewed: list[Renewed] = []
        for hold, answer in zip(holds, answers, strict=True):
            if isinstance(answer, Exception):
                renewed.append(answer)
            elif isinstance(answer, int) and answer * 1000 >= hold.ttl_ms:
                renewed.append(now + hold.ttl_ms)
            else:
                try:
                    kept = yield from self.extend(
                        hold.hold, hold.derived, hold.token, hold.find, hold.ttl_ms, hold.name
                    )
                except Exception as error:  # noqa: BLE001 - this hold's answer; the others go on
                    renewed.append(error)
                else:
                    renewed.append(now + hold.ttl_ms if kept else None)
        return renewed

    def _move(
        self, hold: Hashable, token: str, name: bytes, lease: int, ttl_ms: int
    ) -> Steps[bool]:
        """Put key ``name`` (holding ``token``) under a new lease of ``ttl_ms`` (rule 3).

        The old lease was just renewed, so the key never goes without one.
        """
        dialect = self._dialect
        moved = dialect.granted_id((yield dialect.grant(0, lease_seconds(ttl_ms))))
        value = token.encode()
        txn = Txn((Holds(name, value),), (Put(name, value, moved),))
        if not dialect.outcome((yield dialect.txn(txn))).succeeded:
            yield from self.revoke_quietly(moved)
            return False
        self._moved[hold] = moved
        self._moved.move_to_end(hold)
        while len(self._moved) > MOVED:
            self._moved.popitem(last=False)
        yield from self.revoke_quietly(lease)
        return True

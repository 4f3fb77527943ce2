"""The etcd store: mutexes and semaphores as keys under etcd leases.

Layout: slot ``i`` of lock ``key`` is the etcd key
``f"{key_prefix}permit:{i}:{key}"`` (UTF-8), the Redis layout's name; its
value is the holder's token, and it is attached to an etcd lease of its own
whose TTL is the grant's. etcd deletes the key when the lease expires or is
revoked, so "active" is "the key exists". Nothing else is written: no fence
counter (the fence is etcd's revision), no waiting records (a waiter
watches the key).

Rules of this store:

1. One lease per grant, its ID derived from the namespace, the key and the
   token (``leases.lease_id``), so that every request about a hold names
   its lease without reading it first, and a re-sent grant finds its own.
2. A grant is two requests: the lease grant, then one transaction that puts
   the slot key under it only if the key does not exist (etcd's
   ``version == 0``), and otherwise reads every slot key of the lock (a
   semaphore of more permits than one transaction reads: in transactions
   of their own after it). A semaphore whose first choice was taken tries
   a slot that read showed free, one transaction each, while one is free.
3. A grant whose lease ID is in use (:func:`requests.lease_exists`) was
   sent before with this token: its reply was lost, or the token is used
   again. The lease is renewed first (so that a slot it holds lasts from
   this attempt on, renewal rule 1), then every slot key is read: a slot
   that holds it is this attempt's grant (the lost-reply rule of every
   store); none, and the grant goes on as rule 2 says. A transaction that
   finds its slot taken looks for its own lease among the slots it read
   too: a copy of it that a client sent again may have been there first.
4. A failed attempt revokes its lease (one request more), so that a lease
   of this namespace outlives its slot key only for the span of one
   attempt. A revoke that fails, or a grant that a cancellation cut in
   flight and that reached the server after the attempt's revoke, leaves a
   lease holding no key, to its TTL: it blocks no one.
5. Release is the lease's revoke: one request, which deletes the slot key
   and answers whether the lease existed. Extend is its keep-alive: one
   request, which renews the lease to its granted TTL from the moment the
   server handles it. A longer TTL than the lease's moves the key to a new
   lease, and a lease that is gone costs a read (``leases.py``, rules 3-4).
6. The fence is the revision of the transaction that put the slot key (its
   ``create_revision``): etcd's one counter for the whole cluster, which
   only grows, and survives a leader change.
7. A failed attempt notes a slot key to watch (``watching.py``): a
   release, an expiry or a revoke ends the wait at once, one between the
   attempt and the watch included. A semaphore's waiter watches one slot,
   the one held longest.

Limits:

- etcd's leases count whole seconds, and etcd raises a shorter TTL to its
  minimum (with its default timing, 2 s: 1.5 elections of 1 s, rounded
  up): a grant's lease lasts ``ceil(ttl)`` seconds or that minimum, never
  less than asked. So a holder that dies blocks the lock up to that long,
  however short its ttl; the holder's own deadline is its ttl's.
- A keep-alive renews a lease to the TTL it was granted with: an
  ``extend`` to a shorter ttl leaves the key to the longer one.
- etcd reports a lease's time left in whole seconds: :meth:`holders`'
  expiries are that precise.
- A grant whose reply was lost and which the server applies after the next
  attempt read the slots (rule 3) can leave a semaphore's token on two
  slots until its release, which frees both (they share the lease).
- A slot key deleted by hand is not noticed by ``extend`` (its lease lives
  on); release answers True for it, and the next grant takes the slot.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..._clock import Clock
from ..._core.abc import Holder, Inspection, Renewed
from ..._core.chance import CHANCE
from ..._core.effects import Sleep, Steps
from ..._core.lease import MAX_EXPIRY_MS, Lease, now_ms
from ..._core.waiting import Waiter
from .leases import Find, LeaseBook, Renewal, lease_id, lease_seconds
from .names import TXN_OPS
from .requests import (
    Absent,
    Dialect,
    Outcome,
    Put,
    Read,
    Record,
    Txn,
    lease_exists,
)
from .requests import reads as read_keys
from .watching import Watches

__all__ = ["PERMIT", "EtcdStore"]

PERMIT = "permit"
"""The kind of a mutex's or semaphore's hold, in its lease ID (``leases.lease_id``)."""


class EtcdStore:
    """One namespace (key prefix) of locks on an etcd cluster; a ``Store`` (rules at the top)."""

    def __init__(
        self,
        dialect: Dialect,
        prefix: str,
        max_permits: int,
        clock: Clock,
        *,
        fencing: bool | None = None,
    ) -> None:
        self._dialect = dialect
        self._prefix = prefix
        self._permits = max_permits
        self._clock = clock
        self._fencing = fencing is not False
        self._watches = Watches(dialect, clock)
        self._book = LeaseBook(dialect)

    @property
    def clock(self) -> Clock:
        """The clock that expiries are computed from."""
        return self._clock

    @property
    def max_expiry_ms(self) -> int:
        """The latest expiry a lease may have."""
        return MAX_EXPIRY_MS

    def ready(self) -> Steps[None]:
        """Nothing to prepare: etcd needs no index or table; no request."""
        yield from ()

    def _slot_key(self, key: str, slot: int) -> bytes:
        return f"{self._prefix}permit:{slot}:{key}".encode()

    def _slots(self, key: str) -> tuple[bytes, ...]:
        """The slot keys a grant's transaction reads when its slot is taken: all, if they fit.

        A semaphore of more permits than one transaction may read
        (:data:`~dmutex._backends.etcd.names.TXN_OPS`) reads them after it
        (:meth:`_read_slots`).
        """
        if self._permits > TXN_OPS:
            return ()
        return tuple(self._slot_key(key, slot) for slot in range(self._permits))

    def _read_slots(self, key: str) -> Steps[list[Record]]:
        """Every slot key of ``key`` that exists: one transaction per :data:`TXN_OPS` slots."""
        dialect = self._dialect
        names = [self._slot_key(key, slot) for slot in range(self._permits)]
        records: list[Record] = []
        for first in range(0, len(names), TXN_OPS):
            reads = tuple(names[first : first + TXN_OPS])
            records.extend(dialect.outcome((yield dialect.txn(read_keys(*reads)))).records)
        return records

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None = None
    ) -> Steps[Lease | None]:
        """Grant a slot of ``key`` to ``token`` (rules 2-4): two requests when it is free."""
        lease = self._lease(key, token)
        seconds = lease_seconds(ttl_ms)
        expires = now_ms(self._clock) + ttl_ms
        dialect = self._dialect
        value = token.encode()
        records: list[Record] | None = None
        try:
            yield dialect.grant(lease, seconds)
        except Exception as error:
            if not lease_exists(error):
                raise
            found = yield from self._find_own(key, lease, value, seconds, ttl_ms)
            if isinstance(found, tuple):
                own, revision = found
                return Lease(key, token, own, expires, revision if self._fencing else None)
            records = found
        slot = 0 if records is None else self._free_slot(key, records)
        while slot is not None:
            put = (self._slot_key(key, slot), value, lease)
            txn = Txn(
                (Absent(put[0]),), (Put(*put),), tuple(Read(name) for name in self._slots(key))
            )
            reply = yield dialect.txn(txn)
            outcome: Outcome = dialect.outcome(reply)
            if outcome.succeeded:
                self._watches.forget(waiter)
                return Lease(key, token, slot, expires, outcome.revision if self._fencing else None)
            records = outcome.records if self._slots(key) else (yield from self._read_slots(key))
            copy = _own(records, lease, value)
            if copy is not None:
                # A copy of this transaction (a client that sent it again) was there first.
                self._watches.forget(waiter)
                fence = copy.create_revision if self._fencing else None
                return Lease(key, token, self._slot_of(key, copy), expires, fence)
            slot = self._free_slot(key, records)
        if waiter is not None and not waiter.last and records:
            # The slot held longest, its holder likeliest to leave first (rule 7).
            oldest = min(records, key=lambda record: record.mod_revision)
            self._watches.note(waiter, oldest.key, None, [oldest])
        yield from self._book.revoke_quietly(lease)
        return None

    def _find_own(
        self, key: str, lease: int, value: bytes, seconds: int, ttl_ms: int
    ) -> Steps[tuple[int, int] | list[Record]]:
        """Rule 3: the slot this token's lease holds, as ``(slot, fence)``; else every slot's.

        Renews the lease first, or grants it again if it is gone, or too
        short for ``ttl_ms`` (it holds no slot then that anyone was told of).
        """
        dialect = self._dialect
        kept = dialect.kept((yield dialect.keepalive(lease)))
        if 0 < kept * 1000 < ttl_ms:
            yield from self._book.revoke_quietly(lease)
            kept = 0
        if kept <= 0:
            yield dialect.grant(lease, seconds)
        records = yield from self._read_slots(key)
        own = _own(records, lease, value)
        if own is not None:
            return self._slot_of(key, own), own.create_revision
        return records

    def _slot_of(self, key: str, record: Record) -> int:
        """The slot of a record read from ``key``'s slot keys."""
        head = f"{self._prefix}permit:".encode()
        slot = record.key[len(head) :].partition(b":")[0]
        return int(slot)

    def _free_slot(self, key: str, records: Sequence[Record]) -> int | None:
        """A slot of ``key`` that ``records`` (every slot's, as read) show free; None if full.

        At random among the free ones, so that attempts that read the same
        slots do not all race for the first.
        """
        held = {record.key for record in records}
        free = [slot for slot in range(self._permits) if self._slot_key(key, slot) not in held]
        return CHANCE.choice(free) if free else None  # spreading, not secrecy

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        """Watch the slot key the last attempt noted, up to ``seconds`` (``watching.py``)."""
        return self._watches.wait(waiter, seconds)

    def watch(self, key: str, seconds: float) -> Steps[bool]:
        """Watch the slot of ``key`` held longest for its end, up to ``seconds`` (``abc.Watching``).

        One read of the slot keys, then a watch from the revision after that
        slot's newest put: its release, expiry or revoke ends it, one since
        the read included. Nothing held, or a failed or timed-out watch:
        sleeps out the rest (False).
        """
        started = self._clock.monotonic()
        try:
            records = yield from self._read_slots(key)
            if records:
                oldest = min(records, key=lambda record: record.mod_revision)
                revision = oldest.mod_revision + 1
                yield self._dialect.watch(oldest.key, None, revision, seconds)
                return True
        except Exception:  # noqa: BLE001 - a timeout, or a failed watch: sleep the rest
            pass
        rest = seconds - (self._clock.monotonic() - started)
        if rest > 0:
            yield Sleep(rest)
        return False

    def _lease(self, key: str, token: str) -> int:
        """The lease ID of ``token``'s hold of ``key`` (rule 1)."""
        return lease_id(PERMIT, self._prefix, key, token)

    def _finder(self, key: str, token: str, slot: int | None) -> Find:
        """Reads the slot key of ``key`` that holds ``token``: one request per 128 slots."""
        value = token.encode()

        def find() -> Steps[Record | None]:
            if slot is not None:
                reply = yield self._dialect.txn(read_keys(self._slot_key(key, slot)))
                records = self._dialect.outcome(reply).records
            else:
                records = yield from self._read_slots(key)
            return next((record for record in records if record.value == value), None)

        return find

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        """Revoke ``token``'s lease, deleting its slot key (rule 5): one request.

        A lease that is gone costs one read more (``leases.py``, rule 4).
        """
        return self._book.release(
            (key, token), self._lease(key, token), self._finder(key, token, slot)
        )

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        """Renew ``token``'s lease (rule 5): one request; None if the hold is gone.

        A ``ttl_ms`` longer than the lease's TTL moves the hold to a lease of
        its own (``leases.py``, rule 3: three requests more, four without
        the slot). A lease that is gone costs one read more.
        """
        expires = now_ms(self._clock) + ttl_ms
        find = self._finder(key, token, slot)
        name = None if slot is None else self._slot_key(key, slot)
        kept = yield from self._book.extend(
            (key, token), self._lease(key, token), token, find, ttl_ms, name
        )
        return expires if kept else None

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        """One keep-alive per lease, several in flight at once (``leases.py``, rule 2).

        A lease that ended while the batch was made gets no request: None.
        """
        now = now_ms(self._clock)
        live = [lease for lease in leases if not lease.ended]
        holds = [
            Renewal(
                (lease.key, lease.token),
                self._lease(lease.key, lease.token),
                lease.token,
                self._finder(lease.key, lease.token, lease.slot),
                lease.ttl_ms,
                self._slot_key(lease.key, lease.slot),
            )
            for lease in live
        ]
        answers = iter((yield from self._book.renew(holds, now)) if holds else [])
        renewed = {id(lease): next(answers) for lease in live}
        return [renewed.get(id(lease)) for lease in leases]

    def holders(self, key: str) -> Steps[Inspection]:
        """Every slot key of ``key`` (one transaction), and each one's lease's time left.

        One request more per holder; expiries are whole seconds from now.
        ``fence``: the newest holder's (etcd keeps no counter per lock), None
        when no one holds the key.
        """
        dialect = self._dialect
        now = now_ms(self._clock)
        found = []
        fences = []
        for record in (yield from self._read_slots(key)):
            left = dialect.remaining((yield dialect.time_to_live(record.lease)))
            if left > 0:
                token = record.value.decode(errors="replace")
                found.append(Holder(self._slot_of(key, record), token, now + left * 1000))
                fences.append(record.create_revision)
        return Inspection(sorted(found), max(fences, default=None), now)

    def keys(self, limit: int) -> Steps[list[str]]:
        """Up to ``limit`` held keys of the namespace, sorted: ranges over its slot keys.

        Each page reads ``limit`` keys at most, from the last one read on,
        until ``limit`` distinct locks are found or the range ends.
        """
        prefix = f"{self._prefix}permit:".encode()
        start = prefix
        found: set[str] = set()
        while True:
            names, more = self._dialect.keys((yield self._dialect.range(prefix, start, limit)))
            for name in names:
                held = _key_of_slot(name[len(prefix) :], self._permits)
                if held is not None:
                    found.add(held)
            if not more or not names or len(found) >= limit:
                return sorted(found)[:limit]
            start = names[-1] + b"\x00"


def _own(records: Sequence[Record], lease: int, value: bytes) -> Record | None:
    """The record among ``records`` that holds ``value`` under ``lease``: this attempt's own."""
    return next((r for r in records if r.lease == lease and r.value == value), None)


def _key_of_slot(rest: bytes, permits: int) -> str | None:
    """The lock key of a slot key's ``{slot}:{key}``, if the slot is one of ``permits``."""
    slot, colon, key = rest.partition(b":")
    if not colon or not key or not slot.isdigit() or int(slot) >= permits:
        return None
    try:
        return key.decode()
    except UnicodeDecodeError:
        return None

"""The etcd store of read-write locks: each hold a key under a lease, decided by comparisons.

Layout (dmutex's own). The keys of lock ``key`` share one prefix, ``base``
= ``f"{key_prefix}rwlock:{n}:{key}:"`` with ``n`` the key's length in UTF-8
bytes (so that no lock's prefix begins another's, whatever the keys hold):

- ``base + "w"``: the writer, its value the token;
- ``base + "r:" + token``: each reader (with ``max_readers``: ``base +
  "r:" + slot``, slots ``0 .. max_readers - 1``, the value the token);
- ``base + "i:" + token``: each waiting writer's intent.

Each is under an etcd lease of its own (``leases.lease_id`` of its kind,
``w``, ``r`` or ``i``): a hold's for its TTL, an intent's for its waiter's
window. etcd deletes a key whose lease ends, so a key that exists is in
force: nothing here reads a clock to decide.

Rules (``dmutex._core.readwrite``'s, each by etcd's own means):

1. A reader's grant is a transaction that puts its key only if no writer
   key and no intent exist (two comparisons, the second over the range of
   intents), and, with ``max_readers``, its slot's key does not exist. A
   writer's puts the writer key only if no writer and no reader exist, and
   deletes its own intent. Either, refused, reads the lock's whole range.
2. A refused writer that will try again leaves its intent: a key under a
   lease of its waiter's window (``retry_delay`` + 2 s, rounded up to
   whole seconds), granted on its first refusal and renewed on each after.
   Readers already in keep their leases; new ones are refused while any
   intent stands; writers ignore intents. A writer's grant deletes its
   intent; its last refused attempt, and a release by token, revoke it.
3. Fences are the revisions of the puts that granted the holds: one
   counter for the cluster, so a writer's is above every earlier grant's.
   ``holders`` reports the newest hold's as the lock's fence.
4. A re-sent grant finds its own hold (its lease exists): the lease is
   renewed, and the hold is granted again with its own fence.
5. Release and extend are the mutexes': the hold's lease revoked or kept
   alive (``leases.py``); a release by token also revokes the token's
   intent, and answers whether a hold was ended.
6. A refused attempt's waiter watches the lock's whole range from the
   revision after the newest put in it (``watching.py``): any hold or
   intent deleted wakes it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..._clock import Clock
from ..._core.abc import Holder, Inspection, Renewed
from ..._core.chance import CHANCE
from ..._core.effects import Steps
from ..._core.lease import MAX_EXPIRY_MS, Lease, now_ms
from ..._core.readwrite import READ_SLOT, WRITE_SLOT
from ..._core.waiting import Waiter
from .leases import Find, LeaseBook, Renewal, lease_id, lease_seconds
from .requests import (
    Absent,
    Delete,
    Dialect,
    Put,
    Read,
    Record,
    Txn,
    lease_exists,
    prefix_end,
)
from .watching import Watches

__all__ = ["EtcdReadWriteStore"]

WRITER, READER, INTENT = "w", "r", "i"


class EtcdReadWriteStore:
    """One namespace of read-write locks on an etcd cluster; a ``ReadWriteStore`` (rules above)."""

    def __init__(
        self,
        dialect: Dialect,
        prefix: str,
        max_readers: int | None,
        clock: Clock,
        *,
        fencing: bool | None = None,
    ) -> None:
        self._dialect = dialect
        self._prefix = prefix
        self._readers = max_readers
        self._clock = clock
        self._fencing = fencing is not False
        self._book = LeaseBook(dialect)
        self._watches = Watches(dialect, clock)

    @property
    def clock(self) -> Clock:
        """The clock that expiries are computed from."""
        return self._clock

    @property
    def max_expiry_ms(self) -> int:
        """The latest expiry a lease may have."""
        return MAX_EXPIRY_MS

    def ready(self) -> Steps[None]:
        """Nothing to prepare; no request."""
        yield from ()

    def _base(self, key: str) -> bytes:
        name = key.encode()
        return f"{self._prefix}rwlock:{len(name)}:".encode() + name + b":"

    def _lease(self, kind: str, key: str, token: str) -> int:
        return lease_id(f"rwlock:{kind}", self._prefix, key, token)

    def _reader_key(self, key: str, token: str, slot: int | None) -> bytes:
        return self._base(key) + b"r:" + (token if slot is None else str(slot)).encode()

    def _range(self, key: str, part: bytes = b"") -> tuple[bytes, bytes]:
        start = self._base(key) + part
        return start, prefix_end(start)

    def _read_all(self, key: str) -> Steps[list[Record]]:
        """Every key of lock ``key`` (holds and intents): one request."""
        start, end = self._range(key)
        outcome = self._dialect.outcome((yield self._dialect.txn(Txn((), (Read(start, end),)))))
        return outcome.records

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None, *, write: bool
    ) -> Steps[Lease | None]:
        """A writer's or a reader's attempt (rules 1-4): two requests when granted."""
        dialect = self._dialect
        kind = WRITER if write else READER
        lease = self._lease(kind, key, token)
        expires = now_ms(self._clock) + ttl_ms
        slot = WRITE_SLOT if write else READ_SLOT
        value = token.encode()
        try:
            yield dialect.grant(lease, lease_seconds(ttl_ms))
        except Exception as error:
            if not lease_exists(error):
                raise
            own = yield from self._find_own(key, token, lease, ttl_ms)
            if own is not None:
                self._watches.forget(waiter)
                return Lease(key, token, slot, expires, own if self._fencing else None)
        records: list[Record] = []
        bound = 0 if write or self._readers is None else self._readers
        reader_slot = CHANCE.randrange(bound) if bound else None  # spreading, not secrecy
        for _ in range(max(bound, 1)):
            txn = self._attempt(key, token, lease, write, reader_slot)
            outcome = dialect.outcome((yield dialect.txn(txn)))
            if outcome.succeeded:
                self._watches.forget(waiter)
                return Lease(key, token, slot, expires, outcome.revision if self._fencing else None)
            records = outcome.records
            copy = next((r for r in records if r.lease == lease and r.value == value), None)
            if copy is not None:
                # A copy of this transaction (a client that sent it again) was there first.
                self._watches.forget(waiter)
                fence = copy.create_revision if self._fencing else None
                return Lease(key, token, slot, expires, fence)
            reader_slot = None if reader_slot is None else self._free_slot(key, records)
            if reader_slot is None:
                break
        yield from self._book.revoke_quietly(lease)
        if write:
            yield from self._intend(key, token, waiter)
        if waiter is not None and not waiter.last:
            self._watches.note(waiter, *self._range(key), records)
        return None

    def _attempt(
        self, key: str, token: str, lease: int, write: bool, reader_slot: int | None
    ) -> Txn:
        """The transaction of one try (rule 1); a bounded reader's, for ``reader_slot``."""
        base = self._base(key)
        whole = Read(*self._range(key))
        value = token.encode()
        if write:
            readers = Absent(*self._range(key, b"r:"))
            success = (Put(base + b"w", value, lease), Delete(base + b"i:" + value))
            return Txn((Absent(base + b"w"), readers), success, (whole,))
        name = self._reader_key(key, token, reader_slot)
        open_ = (Absent(base + b"w"), Absent(*self._range(key, b"i:")))
        compare = open_ if reader_slot is None else (*open_, Absent(name))
        return Txn(compare, (Put(name, value, lease),), (whole,))

    def _free_slot(self, key: str, records: Sequence[Record]) -> int | None:
        """A reader slot that ``records`` (the lock's, as read) show free, if the lock is open.

        None: a writer or an intent is in the way, or every slot is held.
        At random among the free ones, as the semaphores choose.
        """
        base = self._base(key)
        names = {record.key for record in records}
        if base + b"w" in names or any(name.startswith(base + b"i:") for name in names):
            return None
        assert self._readers is not None
        free = [s for s in range(self._readers) if self._reader_key(key, "", s) not in names]
        return CHANCE.choice(free) if free else None  # spreading, not secrecy

    def _find_own(self, key: str, token: str, lease: int, ttl_ms: int) -> Steps[int | None]:
        """Rule 4: the fence of the hold this token's lease holds, renewed; None if it holds none.

        Renews the lease first; one too short for ``ttl_ms``, or gone, is
        granted again (it holds no key anyone was told of).
        """
        dialect = self._dialect
        kept = dialect.kept((yield dialect.keepalive(lease)))
        if 0 < kept * 1000 < ttl_ms:
            yield from self._book.revoke_quietly(lease)
            kept = 0
        if kept <= 0:
            yield dialect.grant(lease, lease_seconds(ttl_ms))
            return None
        for record in (yield from self._read_all(key)):
            if record.lease == lease and record.value == token.encode():
                return record.create_revision
        return None

    def _intend(self, key: str, token: str, waiter: Waiter | None) -> Steps[None]:
        """Leave, renew or withdraw a refused writer's intent (rule 2)."""
        dialect = self._dialect
        lease = self._lease(INTENT, key, token)
        if waiter is None:
            return
        if waiter.last:
            yield from self._book.revoke_quietly(lease)
            return
        try:
            if dialect.kept((yield dialect.keepalive(lease))) > 0:
                return
            yield dialect.grant(lease, lease_seconds(waiter.window_ms))
        except Exception as error:
            if not lease_exists(error):
                raise
        name = self._base(key) + b"i:" + token.encode()
        yield dialect.txn(Txn((), (Put(name, token.encode(), lease),)))

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        """Watch the lock's range, up to ``seconds`` (rule 6)."""
        return self._watches.wait(waiter, seconds)

    def _finder(self, key: str, token: str, slot: int | None) -> Find:
        """Reads the key of lock ``key`` that holds ``token`` as a hold (not an intent)."""
        base, value = self._base(key), token.encode()

        def find() -> Steps[Record | None]:
            for record in (yield from self._read_all(key)):
                writer = record.key == base + b"w"
                reader = record.key.startswith(base + b"r:")
                side = slot is None or (slot == WRITE_SLOT) == writer
                if record.value == value and (writer or reader) and side:
                    return record
            return None

        return find

    def _kinds(self, slot: int | None) -> tuple[str, ...]:
        if slot == WRITE_SLOT:
            return (WRITER,)
        if slot == READ_SLOT:
            return (READER,)
        return (WRITER, READER)

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        """End ``token``'s hold (its lease revoked) and, by token, its intent (rule 5)."""
        released = False
        for kind in self._kinds(slot):
            hold = (key, token, kind)
            lease = self._lease(kind, key, token)
            found = self._finder(key, token, WRITE_SLOT if kind == WRITER else READ_SLOT)
            if (yield from self._book.release(hold, lease, found)):
                released = True
                break
        if slot is None:
            yield from self._book.revoke_quietly(self._lease(INTENT, key, token))
        return released

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        """Renew ``token``'s hold (rule 5): one request; None if it is gone."""
        expires = now_ms(self._clock) + ttl_ms
        for kind in self._kinds(slot):
            side = WRITE_SLOT if kind == WRITER else READ_SLOT
            find = self._finder(key, token, side)
            lease = self._lease(kind, key, token)
            name = self._base(key) + b"w" if kind == WRITER and slot is not None else None
            if (yield from self._book.extend((key, token, kind), lease, token, find, ttl_ms, name)):
                return expires
        return None

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        """One keep-alive per hold, several in flight at once (``leases.py``, rule 2)."""
        now = now_ms(self._clock)
        live = [lease for lease in leases if not lease.ended]
        holds = []
        for lease in live:
            kind = WRITER if lease.slot == WRITE_SLOT else READER
            name = self._base(lease.key) + b"w" if kind == WRITER else None
            holds.append(
                Renewal(
                    (lease.key, lease.token, kind),
                    self._lease(kind, lease.key, lease.token),
                    lease.token,
                    self._finder(lease.key, lease.token, lease.slot),
                    lease.ttl_ms,
                    name,
                )
            )
        answers = iter((yield from self._book.renew(holds, now)) if holds else [])
        renewed = {id(lease): next(answers) for lease in live}
        return [renewed.get(id(lease)) for lease in leases]

    def holders(self, key: str) -> Steps[Inspection]:
        """The writer or the readers of ``key`` (one read, and one per hold for its time left).

        ``fence``: the newest hold's, None when nothing is held (rule 3).
        """
        dialect = self._dialect
        now = now_ms(self._clock)
        base = self._base(key)
        found: list[Holder] = []
        fences: list[int] = []
        for record in (yield from self._read_all(key)):
            if record.key == base + b"w":
                slot = WRITE_SLOT
            elif record.key.startswith(base + b"r:"):
                slot = READ_SLOT
            else:
                continue
            left = dialect.remaining((yield dialect.time_to_live(record.lease)))
            if left > 0:
                token = record.value.decode(errors="replace")
                found.append(Holder(slot, token, now + left * 1000))
                fences.append(record.create_revision)
        writers = [holder for holder in found if holder.slot == WRITE_SLOT]
        return Inspection(sorted(writers or found), max(fences, default=None), now)

    def keys(self, limit: int) -> Steps[list[str]]:
        """Up to ``limit`` keys of the namespace with a lock's key (a hold or an intent), sorted."""
        prefix = f"{self._prefix}rwlock:".encode()
        start = prefix
        found: set[str] = set()
        while True:
            names, more = self._dialect.keys((yield self._dialect.range(prefix, start, limit)))
            for name in names:
                held = _key_of(name[len(prefix) :])
                if held is not None:
                    found.add(held)
            if not more or not names or len(found) >= limit:
                return sorted(found)[:limit]
            start = names[-1] + b"\x00"


def _key_of(rest: bytes) -> str | None:
    """The lock key of ``{n}:{key}:...``, the part of a name after ``rwlock:``."""
    length, colon, tail = rest.partition(b":")
    if not colon or not length.isdigit():
        return None
    size = int(length)
    if len(tail) <= size or tail[size : size + 1] != b":":
        return None
    try:
        return tail[:size].decode()
    except UnicodeDecodeError:
        return None

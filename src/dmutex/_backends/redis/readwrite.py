"""The Redis store of read-write locks: one hash per lock, one script per operation.

It sits in ``dmutex._backends.redis`` beside the mutexes' and semaphores'
store (``store.py``), whose way of sending requests it shares
(:class:`~.store.RedisRequests`); its scripts are the ``RW_*`` ones of
``scripts.py``.

Rules of this module:

1. Layout (dmutex's own: the TypeScript library has no read-write lock).
   Lock ``key`` is the hash ``f"{key_prefix}rwlock:{key}"``: the field
   ``kind`` holds the mark ``dmutex:rwlock``; ``w:<token>`` the writer's
   expiry (at most one), ``r:<token>`` each reader's, ``i:<token>`` each
   waiting writer's intent's, in epoch milliseconds by the server's clock
   (``TIME``); ``fence`` the last fence, in decimal, with fencing on. The
   hash expires (``PEXPIREAT``) with its latest hold or intent, and is
   deleted when none is left: its fence goes with it, and the next one
   starts from ``TIME`` in microseconds (``fences`` rule 2), above it.
   Its name, as every record's here, is ``key_prefix`` + a word of the
   layout + ``:``, under the prefix rule of ``store.py`` ("Names"), so no
   other namespace's record bears it.
2. A key of that name that is not a hash holding the mark is not
   dmutex's: every operation on it raises :class:`DMutexError` and
   changes nothing.
3. Every operation is one script, so one atomic step and one request:
   acquire, release, extend, an inspection; ``extend_many`` sends one per
   ``RENEW_BATCH`` holds (on a cluster, per hash slot). The scripts decide
   as ``dmutex._core.readwrite`` says, rule by rule.
4. Waiting is the mutexes': a retrying acquire registers in
   ``f"{key_prefix}waiters:{key}"`` and blocks on
   ``f"{key_prefix}signal:{key}"`` (``BLPOP``), its next attempt sent with
   the block where the client pipelines. Readers and writers share the
   two records, because a ``BLPOP`` cannot choose which of them pops a
   signal: a change that may let someone in (a writer's release; a
   reader's that leaves no reader, or frees a place under
   ``max_readers``; a writer's last intent withdrawn) signals every
   registered waiter, and their attempts decide. A retrying writer's
   intent is written whether or not its waiter can be woken.
5. ``replicas=N``: a grant, an extend and a renewal count once ``N``
   replicas acknowledged them (``WAIT``, pipelined), as the mutexes' do; a
   grant that too few acknowledged raises :class:`NotReplicatedError`, and
   the engine releases it.
6. On a cluster the hash is one key, so any lock key works, fenced; its
   waiters are woken only where the waiting records share its hash slot
   (a hash-tagged key, ``"{orders}"``), as the mutexes' are.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ..._clock import Clock
from ..._core import readwrite
from ..._core.abc import Holder, Inspection, Renewed
from ..._core.effects import Steps
from ..._core.lease import MAX_EXPIRY_MS, Lease, now_ms
from ..._core.readwrite import READ_SLOT, WRITE_SLOT
from ..._core.waiting import Ahead, Waiter
from ..._errors import DMutexError, NotReplicatedError
from ..blocking import REFRESH
from .cluster import hash_slot, same_hash_slot
from .requests import (
    AheadAttempt,
    RedisRequests,
    answered,
    as_int,
    foreign,
    glob_escape,
    is_noscript,
)
from .scripts import (
    FOREIGN,
    RENEW_BATCH,
    RW_ACQUIRE,
    RW_EXTEND,
    RW_INSPECT,
    RW_RELEASE,
    RW_RENEW,
)

__all__ = ["RedisReadWriteStore"]

# Store.wait is not told which side a waiter is on, and its next attempt,
# sent with the block (waiting rule 6), must be of that side: the store keeps
# the side of each retrying acquire by its token, from its first failed
# attempt to its grant, its last attempt or its release. A token is one
# acquire's, so a side kept is never wrong; one forgotten only costs that
# attempt its ride (it goes after the block). The oldest go past this many.
_SIDES_KEPT = 4096
_FENCE_MAX = 2**63 - 1


def _text(value: object) -> str:
    """A reply's string, however the client decoded it."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _decision(reply: object) -> tuple[bool, int]:
    """The acquire script's ``{1, fence}`` (granted) or ``{0, ms until it clears}``."""
    if not isinstance(reply, (list, tuple)) or len(reply) != 2:
        raise DMutexError(f"unexpected reply from Redis: {reply!r}")
    granted = as_int(reply[0], 0, 1) == 1
    return granted, as_int(reply[1], 0, _FENCE_MAX if granted else MAX_EXPIRY_MS)


class RedisReadWriteStore(RedisRequests):
    """One namespace of read-write locks on one Redis server or cluster; a ``ReadWriteStore``."""

    def __init__(
        self,
        client: object,
        prefix: str,
        max_readers: int | None,
        clock: Clock,
        *,
        fencing: bool = True,
        replicas: int = 0,
        replicas_ms: int = 1000,
    ) -> None:
        super().__init__(client, prefix, clock, replicas=replicas, replicas_ms=replicas_ms)
        # The scripts' ARGV: 0 is no bound.
        self._most = max_readers or 0
        self._fencing = fencing
        self._sides: dict[str, bool] = {}
        # The writers among them whose attempt sent ahead was refused and left its intent.
        self._left: set[str] = set()
        self._sides_lock = threading.Lock()

    def _name(self, key: str) -> str:
        return f"{self._prefix}rwlock:{key}"

    def _wakes(self, key: str) -> list[str]:
        """The waiters and signal records of ``key``, or none: its waiters are not woken.

        Not on a client that cannot block, nor on a cluster unless both
        share the hash's hash slot (rule 6).
        """
        if self._blockers is None:
            return []
        names = [f"{self._prefix}waiters:{key}", f"{self._prefix}signal:{key}"]
        if self._cluster and not same_hash_slot([self._name(key), *names]):
            return []
        return names

    def _keep_side(self, token: str, write: bool | None) -> None:
        """Keep ``token``'s side for its next attempt (None: forget it, and its intent left)."""
        with self._sides_lock:
            if write is None:
                self._sides.pop(token, None)
                self._left.discard(token)
                return
            self._sides[token] = write
            while len(self._sides) > _SIDES_KEPT:
                oldest = next(iter(self._sides))
                del self._sides[oldest]
                self._left.discard(oldest)

    def _leave_intent(self, token: str) -> None:
        """Note that ``token``'s attempt sent ahead was a writer's refusal that left its intent."""
        with self._sides_lock:
            if token in self._sides:
                self._left.add(token)

    def _intent_left(self, token: str) -> bool:
        """Whether ``token``'s attempt sent ahead left an intent; the note goes."""
        with self._sides_lock:
            found = token in self._left
            self._left.discard(token)
            return found

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None, *, write: bool
    ) -> Steps[Lease | None]:
        """A writer's (``write``) or a reader's attempt on ``key``: one script.

        ``waiter``: an attempt of a retrying acquire; a writer's then leaves
        its intent (``readwrite`` rule 2) unless it is the last, and a
        waiter that can be woken registers.
        """
        if waiter is not None:
            left = self._intent_left(token)
            self._keep_side(token, None if waiter.last else write)
            if waiter.ahead is not None and token == waiter.token:
                # Sent with the wait before this attempt (waiting rule 6): answered already.
                ahead, waiter.ahead = waiter.ahead, None
                if not (left and waiter.last):
                    return answered(ahead, waiter)
                # A writer's refusal sent ahead as not the last (the block
                # outlasted the deadline: a server ends it on its tick) left
                # its intent; the last attempt must withdraw it (readwrite
                # rule 2), so it goes now.
        return self._acquire(key, token, ttl_ms, waiter, write)

    def _acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None, write: bool
    ) -> Steps[Lease | None]:
        wakes = self._wakes(key) if waiter is not None else []
        expires = now_ms(self._clock) + ttl_ms
        started = self._clock.monotonic()
        args, window = self._args(token, ttl_ms, write, waiter, wakes, started)
        keys = [self._name(key), *wakes]
        acks = 0
        if self._replicas:
            reply, acks = yield from self._take_waited(RW_ACQUIRE, keys, args)
        else:
            reply = yield from self._take(RW_ACQUIRE, keys, args)
        lease = self._decided(
            reply, key, token, write, expires, waiter, bool(wakes), started, window
        )
        if lease is not None and self._replicas:
            self._replicated(key, acks)  # the engine releases it again
        return lease

    def _args(
        self,
        token: str,
        ttl_ms: int,
        write: bool,
        waiter: Waiter | None,
        wakes: list[str],
        started: float,
    ) -> tuple[tuple[object, ...], int]:
        """The acquire script's ARGV (``scripts.py``), and the waiter's registration window."""
        # How long a refusal leaves this writer's intent: intent_until from time 0.
        intent = readwrite.intent_until(0, waiter) if write else None
        side = "write" if write else "read"
        fence = "1" if self._fencing else "0"
        args: tuple[object, ...] = (token, ttl_ms, side, self._most, fence, intent or 0)
        if waiter is None or not wakes:
            return args, 0
        window = 0 if waiter.last else waiter.window_ms
        if window and waiter.registered and started - waiter.registered_at < REFRESH:
            window = -1  # registered a moment ago: no need to again
        return (*args, waiter.name, window, "1" if waiter.registered else "0"), window

    def _decided(
        self,
        reply: object,
        key: str,
        token: str,
        write: bool,
        expires: int,
        waiter: Waiter | None,
        wakes: bool,
        started: float,
        window: int,
    ) -> Lease | None:
        """The lease the acquire script's ``reply`` grants, if any; a waiter's state follows it."""
        granted, value = _decision(reply)
        if granted:
            self._keep_side(token, None)
            if waiter is not None:
                waiter.registered = False
            slot = WRITE_SLOT if write else READ_SLOT
            return Lease(key, token, slot, expires, value if self._fencing else None)
        if waiter is not None:
            if wakes:
                waiter.registered = not waiter.last
                if window > 0:
                    waiter.registered_at = started
            # What refused it lapses by then at the latest (a hold is active
            # while now < its expiry): the wait need not be longer.
            waiter.expires_in = value / 1000
        return None

    def _ahead(self, key: str, waiter: Waiter, started: float) -> AheadAttempt | None:
        """The acquire script to send with a block (waiting rule 6), or None.

        Only for a waiter whose side is kept and who can be woken.
        """
        with self._sides_lock:
            write = self._sides.get(waiter.token)
        wakes = self._wakes(key)
        if write is None or not wakes:
            return None
        token, last = waiter.token, waiter.last
        args, window = self._args(token, waiter.ttl_ms, write, waiter, wakes, started)
        expires = now_ms(self._clock) + waiter.ttl_ms

        def answer(reply: object) -> Ahead | None:
            # A server that had not cached the script answered NOSCRIPT: the
            # next attempt asks again (``_run`` falls back to ``EVAL``).
            if isinstance(reply, Exception):
                if is_noscript(reply):
                    return None
                return Ahead(None, foreign(reply) or reply, started)
            try:
                lease = self._decided(
                    reply, key, token, write, expires, waiter, True, started, window
                )
            except DMutexError as error:
                return Ahead(None, error, started)
            if lease is None and write and not last:
                self._leave_intent(token)
            return Ahead(lease, None, started)

        return RW_ACQUIRE, [self._name(key), *wakes], args, answer

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        """End ``token``'s hold and intent on ``key``, waking its waiters if that may let one in."""
        self._keep_side(token, None)
        keys = [self._name(key), *self._wakes(key)]
        reply = yield from self._take(RW_RELEASE, keys, (token, self._most))
        return as_int(reply, 0, 1) == 1

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        """Move ``token``'s active hold's expiry (of kind ``slot`` if given) to now + ttl."""
        expires = now_ms(self._clock) + ttl_ms
        args = (token, "-" if slot is None else slot, ttl_ms)
        if not self._replicas:
            done = as_int((yield from self._take(RW_EXTEND, [self._name(key)], args)), 0, 1)
        else:
            reply, acks = yield from self._take_waited(RW_EXTEND, [self._name(key)], args)
            done = as_int(reply, 0, 1)
            if done == 1:
                self._replicated(key, acks)
        return expires if done == 1 else None

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        """Renew ``leases`` by their TTLs: one request per up to ``RENEW_BATCH`` of them.

        On a cluster, one request per hash slot among their hashes. Answers
        each lease's new expiry, None, or the error of its request (or of
        its hash, one dmutex did not write).
        """
        names = [self._name(lease.key) for lease in leases]
        groups: dict[int, list[int]] = {}
        for index, name in enumerate(names):
            groups.setdefault(hash_slot(name) if self._cluster else 0, []).append(index)
        answers: list[Renewed] = [None] * len(leases)
        for indexes in groups.values():
            for start in range(0, len(indexes), RENEW_BATCH):
                chunk = indexes[start : start + RENEW_BATCH]
                try:
                    done = yield from self._renew(chunk, leases, names)
                except Exception as error:  # noqa: BLE001 - these leases' answer; other requests go on
                    done = [error] * len(chunk)
                for i, answer in zip(chunk, done, strict=True):
                    answers[i] = answer
        return answers

    def _renew(
        self, chunk: list[int], leases: Sequence[Lease], names: list[str]
    ) -> Steps[list[Renewed]]:
        """One RW_RENEW request for the leases at ``chunk``: each one's answer."""
        expires = [now_ms(self._clock) + leases[i].ttl_ms for i in chunk]
        # Each hash once in KEYS; a hold names its hash by position (1-based).
        where: dict[str, int] = {}
        args: list[object] = []
        for i in chunk:
            lease = leases[i]
            args += (where.setdefault(names[i], len(where) + 1), lease.token, lease.slot)
            args.append(lease.ttl_ms)
        acks = 0
        if not self._replicas:
            reply = yield from self._run(RW_RENEW, list(where), tuple(args))
        else:
            reply, acks = yield from self._run_waited(RW_RENEW, list(where), tuple(args))
        if not isinstance(reply, (list, tuple)) or len(reply) != len(chunk):
            raise DMutexError(f"unexpected reply from Redis: {reply!r}")
        renewed: list[Renewed] = []
        for i, done, ends in zip(chunk, reply, expires, strict=True):
            code = as_int(done, -1, 1)
            if code < 0:
                renewed.append(DMutexError(f"{names[i]!r} {FOREIGN}: dmutex leaves it alone"))
            elif code == 0:
                renewed.append(None)
            elif acks < self._replicas:
                # Not replicated: a failed renewal, retried until the lease's deadline.
                renewed.append(NotReplicatedError(leases[i].key, acks, self._replicas))
            else:
                renewed.append(ends)
        return renewed

    def holders(self, key: str) -> Steps[Inspection]:
        """The active holds of ``key`` (the writer, else the readers) and its fence; one script.

        Expiries are the server's: the hash's fields, judged at its ``TIME``.
        """
        reply = yield from self._take(RW_INSPECT, [self._name(key)], ())
        if not isinstance(reply, (list, tuple)) or len(reply) % 2 != 1:
            raise DMutexError(f"unexpected reply from Redis: {reply!r}")
        now = as_int(reply[0], 0, MAX_EXPIRY_MS)
        state = readwrite.State()
        fence: int | None = None
        for at in range(1, len(reply), 2):
            name, value = _text(reply[at]), reply[at + 1]
            kind, token = name[:2], name[2:]
            if name == "fence":
                fence = as_int(value, 0, _FENCE_MAX)
            elif kind == "w:":
                ends = as_int(value, 0, MAX_EXPIRY_MS)
                if state.writer is None or ends > state.writer[1]:
                    state.writer = (token, ends)
            elif kind == "r:":
                state.readers[token] = as_int(value, 0, MAX_EXPIRY_MS)
        found = [Holder(*hold) for hold in readwrite.holders(state, now)]
        return Inspection(found, fence if self._fencing else None, now)

    def keys(self, limit: int) -> Steps[list[str]]:
        """The keys with a lock hash, by ``SCAN MATCH`` on the prefix; at most ``limit``, sorted.

        A hash lives while a hold or an intent in it does (rule 1), so a key
        is listed while a writer or reader holds it, and also while only a
        waiting writer's intent is left (its holders then show none). One
        server only (``store.RedisRequests._scan``).
        """
        start = f"{self._prefix}rwlock:"

        def key_of(name: str) -> str | None:
            key = name[len(start) :]
            return key if name.startswith(start) and key else None

        return self._scan(glob_escape(start) + "*", key_of, limit)

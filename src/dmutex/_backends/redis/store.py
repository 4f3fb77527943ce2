"""The Redis store: each operation is one request to the server.

It sits in ``dmutex._backends.redis`` with the Lua scripts it runs
(``scripts.py``) and the budget of its blocking waits (``waits.py``). How it
sends requests (:class:`~dmutex._backends.redis.requests.RedisRequests`,
``requests.py``) is shared with the read-write locks' store (``readwrite.py``).

Layout (shared with the TypeScript dmutex): slot ``i`` of lock ``key`` is the
string key ``f"{key_prefix}permit:{i}:{key}"``, its value the holder's token,
its expiry set with ``PX`` in milliseconds. Redis deletes a key whose expiry
has passed, so "active" is simply "the key exists and holds the token".
Beside them dmutex keeps only records of its own, each marked as dmutex's
and never written where something else is: a lock's fence counter, a
semaphore's holders index (above 32 permits, ``scripts.py``: a hint that spares reading every
slot key, never trusted for safety) and, while someone waits, its waiting
records.

Names: every record, here and in ``readwrite.py``, is ``key_prefix`` + a
word of ``names.REDIS_KINDS`` (``permit``, ``fence``,
``holders``, ``waiters``, ``signal``, ``rwlock``) + ``:`` + the key (a slot
key: ``{slot}:{key}``). Opening a store refuses a prefix with a
``:``-separated part, other than its last, that is one of those words
(``check_redis_prefix``: for the default prefix, a service name such as
``x:permit:0``, whose key ``k`` would be service ``x``'s ``permit:0:k``),
so that between prefixes that are empty or end in ``:`` no record name is
two namespaces' records.

Guarantees, on one Redis server: at most ``max_permits`` keys of a lock exist
at any instant, because each is created only by ``SET ... NX``; release and
extend compare the token and act in one atomic script, so a holder whose lease
expired and was taken over cannot touch the new holder's key. Every script
declares, in ``KEYS``, every key it touches, and writes only slot keys that
are absent or hold the caller's own token (and the records above).

Listing the held keys (``keys``, for ``dmutex status``) is the one operation
of more than one request: ``SCAN`` with ``MATCH`` on the prefix and ``COUNT``
:data:`SCAN_COUNT`, request after request, until it found as many keys as
asked or the cursor came round, so a database with many other keys takes
many requests (each one short on the server). One server only: a cluster
client's keys are spread over its primaries, and it is refused.

An acquire is idempotent: the token is fixed before the first send, and a
script that finds the token already in a slot returns that slot. So when a
client re-sends an acquire whose reply was lost (redis-py and valkey-py do,
after a connection error), the copy answers with the lease the first one
took, instead of reporting contention or taking a second slot.

Limits:

- Expiry is the server's: Redis treats a key as expired once its clock is past
  the expiry, so a lease lasts ``ttl`` plus up to a millisecond, and
  ``expired_at`` (computed with this process's clock before the request is
  sent) is an estimate that is never later than the server's.
- A release whose reply was lost and re-sent answers False (the first copy
  deleted the key): after ``release()`` returns, True or False, the token
  holds no slot.
- Replication is asynchronous. A key written on a primary that fails before
  the write reaches a replica is lost on failover, and a second holder can
  then be granted the same slot. With ``replicas=N`` a grant, an extend and a
  renewal count only once ``N`` replicas acknowledged them (``WAIT``,
  pipelined with the script: the same round trip); that narrows the window
  to what Redis cannot promise (a promoted replica that had not
  acknowledged, an old primary that stays writable in a partition). See the
  Redis page's "Failover" in the documentation.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..._clock import Clock
from ..._core.abc import Holder, Inspection, Renewed
from ..._core.effects import Call, Steps
from ..._core.lease import MAX_EXPIRY_MS, Lease, now_ms
from ..._core.waiting import Ahead, Waiter
from ..._errors import DMutexError, InvalidArgumentError, NotReplicatedError
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
    ACQUIRE,
    EXTEND,
    FENCE_MARK,
    INDEXED_ABOVE,
    INSPECT,
    MUTEX_ACQUIRE,
    MUTEX_RELEASE,
    RELEASE,
    RENEW,
    RENEW_BATCH,
    Script,
)

# The mutex's scripts' SHA1s, for the requests written out below.
_ACQUIRE, _RELEASE = MUTEX_ACQUIRE.sha, MUTEX_RELEASE.sha


def _grant(reply: object, last: int) -> tuple[int, int, int]:
    """The acquire script's ``{position, fence[, expiry]}``; expiry -1 when not given.

    Position in ``-1..last``, fence >= 0, expiry (a holder's PTTL) >= -2.
    """
    if not isinstance(reply, (list, tuple)) or len(reply) not in (2, 3):
        raise DMutexError(f"unexpected reply from Redis: {reply!r}")
    position, fence = as_int(reply[0], -1, last), as_int(reply[1], 0, 2**63 - 1)
    if len(reply) == 2:
        return position, fence, -1
    if position != -1 or fence != 0:  # only a failed attempt reports the holder's expiry
        raise DMutexError(f"unexpected reply from Redis: {reply!r}")
    return position, fence, as_int(reply[2], -2, 2**63 - 1)


class RedisStore(RedisRequests):
    """One namespace of lock keys on one Redis server or cluster; a ``Store``.

    Two client paths: ``execute_command`` (redis-py, valkey-py, fakeredis,
    cluster clients), where scripts run by ``EVALSHA`` and fall back to
    ``EVAL`` once when the server answers ``NOSCRIPT``; and ``set`` + ``eval``
    (the ioredis shape), where scripts run by ``EVAL``.

    Every operation is one script, a mutex's acquire too: a plain ``SET NX``
    could not tell a re-sent copy of itself from contention.

    On a cluster client, a lock whose slot keys fall into different hash
    slots is handled one key per request (see :meth:`acquire`); wrap the lock
    key in a hash tag, ``"{orders}"``, to keep one request per operation.
    """

    # Every request of a release is marked to run to completion here
    # (``_run``'s ``complete``), so the engine adds no generator to mark them
    # (``dmutex._core.abc``, rule 7).
    releases_complete = True

    def __init__(
        self,
        client: object,
        prefix: str,
        max_permits: int,
        clock: Clock,
        *,
        fencing: bool | None = None,
        replicas: int = 0,
        replicas_ms: int = 1000,
    ) -> None:
        super().__init__(client, prefix, clock, replicas=replicas, replicas_ms=replicas_ms)
        self._permits = max_permits
        self._fencing = fencing
        # A mutex's slot key and fence counter are these + the key (``_groups``,
        # ``_counter``): built once, as every acquire and release of one needs them.
        self._slot0 = f"{prefix}permit:0:"
        # Where a mutex's counter simply follows its slot key (``_counter``'s rule).
        self._fence0 = None if fencing is False or self._cluster else f"{prefix}fence:"

    def _groups(self, key: str) -> list[list[str]]:
        """Every slot key of ``key``, in slot order, in groups one script may touch.

        One group, except on a cluster when the keys span hash slots: then
        one group per key.
        """
        names = [f"{self._prefix}permit:{slot}:{key}" for slot in range(self._permits)]
        if self._cluster and not same_hash_slot(names):
            return [[name] for name in names]
        return [names]

    def _counter(self, key: str, groups: list[list[str]]) -> str | None:
        """The fence counter of ``key``, or None: no fencing, or no hash slot to share.

        On a cluster the counter must share the hash slot of the slot keys,
        so that the acquire's own script can increment it; with
        ``fencing=True`` a key whose records cannot is an error.
        """
        if self._fencing is False:
            return None
        name = f"{self._prefix}fence:{key}"
        if self._cluster and (len(groups) > 1 or not same_hash_slot([groups[0][0], name])):
            if self._fencing:
                raise InvalidArgumentError(
                    f"fencing=True on a cluster needs the key's records in one hash slot: "
                    f"wrap the key in a hash tag, for example {'{' + key + '}'!r}"
                )
            return None
        return name

    def _holders(self, key: str, groups: list[list[str]]) -> str | None:
        """The holders index of ``key`` (``scripts.py``), or None: a small lock, or no shared slot.

        A semaphore's scripts read it to answer without looking at every
        slot key; on a cluster it must share the slot keys' hash slot.
        """
        if self._permits <= INDEXED_ABOVE:
            return None  # a mutex, or a small semaphore (scripts.INDEXED_ABOVE)
        name = f"{self._prefix}holders:{key}"
        # By handle, ``groups`` is the one slot key: where only it shares the
        # index's hash slot, no acquire wrote an index, and the script finds none.
        if self._cluster and (len(groups) > 1 or not same_hash_slot([groups[0][0], name])):
            return None
        return name

    def _wakes(self, key: str, groups: list[list[str]]) -> list[str]:
        """The waiters and signal records of ``key``, or none: its waiters are not woken.

        Not on a client that cannot block, nor on a cluster unless both
        records share the hash slot of the slot keys (a hash-tagged key).
        """
        if self._blockers is None:
            return []
        names = [f"{self._prefix}waiters:{key}", f"{self._prefix}signal:{key}"]
        if self._cluster and (len(groups) > 1 or not same_hash_slot([groups[0][0], *names])):
            return []
        return names

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None = None
    ) -> Steps[Lease | None]:
        """Take a free slot of ``key``, or return None when all are held.

        One request: one script over every slot key, the fence counter and,
        for a ``waiter`` that can be woken, its records. On a cluster with
        the slot keys in different hash slots, one request per slot until
        one succeeds (at most ``max_permits``), no fence and no wake-up.
        Raises before any request when ``fencing=True`` cannot be met.
        """
        if waiter is not None and waiter.ahead is not None and token == waiter.token:
            # Sent with the wait before this attempt (waiting rule 6): answered already.
            ahead, waiter.ahead = waiter.ahead, None
            return answered(ahead, waiter)
        if self._permits == 1 and (waiter is None or self._blockers is None):
            # The mutex's own script: nothing of the semaphore, no waiter to
            # register (a waiter that cannot be woken registers nowhere).
            slot = self._slot0 + key
            if self._fence0 is not None:  # _counter's answer, without the call
                return self._acquire_mutex(key, token, ttl_ms, (slot, self._fence0 + key))
            counter = self._counter(key, [[slot]])
            return self._acquire_mutex(key, token, ttl_ms, (slot, counter) if counter else (slot,))
        groups, records, wakes = self._plan(key, waiter is not None)
        return self._acquire(key, token, ttl_ms, groups, records, waiter if wakes else None, wakes)

    def _plan(
        self, key: str, waiting: bool
    ) -> tuple[list[list[str]], tuple[list[str], str], list[str]]:
        """The acquire script's keys for ``key``: slot key groups, extra records, waiting records.

        The extra records come as KEYS and as ARGV names them; the waiting
        records only for an attempt that ``waiting`` and whose waiter can be woken.
        """
        groups = self._groups(key)
        counter = self._counter(key, groups)
        holders = self._holders(key, groups)
        records: tuple[list[str], str]
        if holders is None:
            records = ([counter], "fence") if counter else ([], "-")
        else:
            records = ([counter, holders], "fence+holders") if counter else ([holders], "holders")
        return groups, records, self._wakes(key, groups) if waiting else []

    def _acquire_mutex(
        self, key: str, token: str, ttl_ms: int, keys: tuple[str, ...]
    ) -> Steps[Lease | None]:
        expires = round(self._wall() * 1000) + ttl_ms  # now_ms(self._clock)
        acks = 0
        execute = self._execute
        if self._replicas:
            reply, acks = yield from self._take_waited(MUTEX_ACQUIRE, keys, (token, ttl_ms))
        elif execute is None:
            reply = yield from self._take(MUTEX_ACQUIRE, keys, (token, ttl_ms))
        else:
            # _take's first request, written out: every acquire of a mutex sends it.
            failed: Exception | None = None
            try:
                reply = yield Call(execute, ("EVALSHA", _ACQUIRE, len(keys), *keys, token, ttl_ms))
            except Exception as error:  # noqa: BLE001 - NOSCRIPT, or raised by _take_again
                failed = error
            if failed is not None:
                reply = yield from self._take_again(MUTEX_ACQUIRE, keys, (token, ttl_ms), failed)
        counted = len(keys) > 1
        high = 2**63 - 1 if counted else 1
        fence = reply if type(reply) is int and 0 <= reply <= high else as_int(reply, 0, high)
        if fence == 0:
            return None
        if self._replicas:
            # The engine releases what this took before the error reaches the caller.
            self._replicated(key, acks)
        return Lease(key, token, 0, expires, fence if counted else None)

    def _acquire(
        self,
        key: str,
        token: str,
        ttl_ms: int,
        groups: list[list[str]],
        records: tuple[list[str], str],
        waiter: Waiter | None,
        wakes: list[str],
    ) -> Steps[Lease | None]:
        expires = now_ms(self._clock) + ttl_ms
        extra, kinds = records
        args: tuple[object, ...] = (token, ttl_ms) if not extra else (token, ttl_ms, kinds)
        started, window = 0.0, 0
        if waiter is not None:
            started = self._clock.monotonic()
            args, window = self._waiting_args(token, ttl_ms, kinds, waiter, started)
        first = 0
        for group in groups:
            keys = [*group, *extra, *wakes]
            acks = 0
            if self._replicas:
                reply, acks = yield from self._take_waited(ACQUIRE, keys, args)
            else:
                reply = yield from self._take(ACQUIRE, keys, args)
            lease = self._granted(reply, key, token, expires, group, first, waiter, started, window)
            if lease is not None:
                if self._replicas:
                    self._replicated(key, acks)  # the engine releases it again
                return lease
            first += len(group)
        return None

    def _waiting_args(
        self, token: str, ttl_ms: int, kinds: str, waiter: Waiter, started: float
    ) -> tuple[tuple[object, ...], int]:
        """The acquire script's ARGV for an attempt of ``waiter``, and its registration window."""
        window = 0 if waiter.last else waiter.window_ms
        if window and waiter.registered and started - waiter.registered_at < REFRESH:
            window = -1  # registered a moment ago: no need to again
        registered = "1" if waiter.registered else "0"
        return (token, ttl_ms, kinds, waiter.name, window, registered), window

    def _granted(
        self,
        reply: object,
        key: str,
        token: str,
        expires: int,
        group: list[str],
        first: int,
        waiter: Waiter | None,
        started: float,
        window: int,
    ) -> Lease | None:
        """The lease an acquire script's ``reply`` grants, if any; a waiter's state follows it."""
        position, fence, left = _grant(reply, len(group) - 1)
        if position >= 0:
            if waiter is not None:
                waiter.registered = False
            return Lease(key, token, first + position, expires, fence or None)
        if waiter is not None:
            waiter.registered = not waiter.last
            if window > 0:
                waiter.registered_at = started
            waiter.expires_in = (left + 1) / 1000 if left >= 0 else None
        return None

    def _ahead(self, key: str, waiter: Waiter, started: float) -> AheadAttempt | None:
        """The acquire script to send with a block (waiting rule 6), or None.

        Only where one request reaches every slot key and the waiting records.
        """
        groups, (extra, kinds), wakes = self._plan(key, True)
        if len(groups) != 1 or not wakes:
            return None
        group = groups[0]
        args, window = self._waiting_args(waiter.token, waiter.ttl_ms, kinds, waiter, started)
        expires = now_ms(self._clock) + waiter.ttl_ms

        def answer(reply: object) -> Ahead | None:
            return self._ahead_answer(reply, key, group, waiter, expires, started, window)

        return ACQUIRE, [*group, *extra, *wakes], args, answer

    def _ahead_answer(
        self,
        reply: object,
        key: str,
        group: list[str],
        waiter: Waiter,
        expires: int,
        sent: float,
        window: int,
    ) -> Ahead | None:
        """What the attempt sent ahead answered, for the next attempt to return; None: ask again.

        A server that had not cached the script answered NOSCRIPT, and the
        next attempt asks again (``_run`` falls back to ``EVAL``).
        """
        if isinstance(reply, Exception):
            if is_noscript(reply):
                return None
            return Ahead(None, foreign(reply) or reply, sent)
        try:
            lease = self._granted(reply, key, waiter.token, expires, group, 0, waiter, sent, window)
        except DMutexError as error:
            return Ahead(None, error, sent)
        return Ahead(lease, None, sent)

    def _holder(
        self,
        script: Script,
        key: str,
        slot: int | None,
        head: tuple[object, ...],
        *,
        wake: bool = False,
    ) -> Steps[bool]:
        """Run a compare-token script on the slot key(s) that may hold the token.

        ``head`` is the script's arguments (the token, and the TTL for
        extend). ``wake``: the script is the release, and gets the lock's
        waiting records where its waiters can be woken. A semaphore's
        scripts also get its holders index, which names the token's slot.
        Returns whether a key held it.
        """
        if slot is not None or self._permits == 1:
            groups = [[f"{self._prefix}permit:{slot or 0}:{key}"]]
        else:
            groups = self._groups(key)
        holders = self._holders(key, groups)
        wakes = self._wakes(key, groups) if wake else []
        args = head
        if holders is None:
            if wakes:
                args = (*head, self._permits)
            after = wakes
        else:
            args = (*head, self._permits if wakes else "-") if wake else head
            args = (*args, "holders")
            after = [holders, *wakes]
        waited = self._replicas and not wake  # an extend's write counts once replicated
        for group in groups:
            keys = [*group, *after] if after else group
            if not waited:  # a release's requests run to completion (releases_complete)
                if as_int((yield from self._run(script, keys, args, wake)), 0, 1) == 1:
                    return True
                continue
            reply, acks = yield from self._run_waited(script, keys, args)
            if as_int(reply, 0, 1) == 1:
                self._replicated(key, acks)
                return True
        return False

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        """Delete the slot key that holds ``token`` and wake a waiter, in one atomic script."""
        if self._permits == 1:
            name = self._slot0 + key
            if self._blockers is None:  # _wakes' answer, without the call
                return self._release_mutex((name,), token)
            return self._release_mutex((name, *self._wakes(key, [[name]])), token)
        return self._holder(RELEASE, key, slot, (token,), wake=True)

    def _release_mutex(self, keys: tuple[str, ...], token: str) -> Steps[bool]:
        execute = self._execute
        if execute is None:
            reply = yield from self._run(MUTEX_RELEASE, keys, (token,), True)
        else:
            # _run's first request, written out: every release of a mutex sends it.
            failed: Exception | None = None
            request = ("EVALSHA", _RELEASE, len(keys), *keys, token)
            try:
                reply = yield Call(execute, request, None, True)
            except Exception as error:  # noqa: BLE001 - NOSCRIPT, or raised by _run_again
                failed = error
            if failed is not None:
                reply = yield from self._run_again(MUTEX_RELEASE, keys, (token,), failed, True)
        return (reply if type(reply) is int and 0 <= reply <= 1 else as_int(reply, 0, 1)) == 1

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        """Set the expiry of the slot key that holds ``token`` to now + ttl."""
        expires = now_ms(self._clock) + ttl_ms
        done = yield from self._holder(EXTEND, key, slot, (token, ttl_ms))
        return expires if done else None

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        """Renew ``leases`` by their TTLs: one request per up to ``RENEW_BATCH`` of them.

        On a cluster, one request per hash slot among their slot keys (a
        script touches one slot). Answers each lease's new expiry, or None.
        """
        names = [f"{self._prefix}permit:{lease.slot}:{lease.key}" for lease in leases]
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

    def holders(self, key: str) -> Steps[Inspection]:
        """The slot keys of ``key`` that exist, and its fence counter: one read-only script.

        On a cluster with the slot keys in different hash slots, one request
        per slot key. Expiries are the server's (``PTTL`` from its ``TIME``);
        a key without one shows the latest expiry a lease may have.
        """
        groups = self._groups(key)
        counter = self._counter(key, groups)
        found: list[Holder] = []
        fence: int | None = None
        now = 0
        first = 0
        for number, group in enumerate(groups):
            extra = [counter] if counter and number == 0 else []
            reply = yield from self._run(INSPECT, [*group, *extra], ("1" if extra else "0",))
            if not isinstance(reply, (list, tuple)) or len(reply) < 2 or len(reply) % 3 != 2:
                raise DMutexError(f"unexpected reply from Redis: {reply!r}")
            now = as_int(reply[0], 0, MAX_EXPIRY_MS)
            stored = reply[1].decode() if isinstance(reply[1], bytes) else reply[1]
            if extra and isinstance(stored, str) and stored.startswith(FENCE_MARK):
                fence = as_int(stored[len(FENCE_MARK) :], 0, 2**63 - 1)
            for at in range(2, len(reply), 3):
                position, token, left = reply[at : at + 3]
                expires = MAX_EXPIRY_MS if left == -1 else now + as_int(left, 0, MAX_EXPIRY_MS)
                shown = token.decode() if isinstance(token, bytes) else str(token)
                found.append(Holder(first + as_int(position, 0, len(group)), shown, expires))
            first += len(group)
        return Inspection(found, fence, now)

    def keys(self, limit: int) -> Steps[list[str]]:
        """The held keys: their slot keys (slots 0 .. N-1) by ``SCAN MATCH`` on the prefix.

        At most ``limit``, sorted; which ones when there are more is the
        order ``SCAN`` meets them in. A slot key exists only while its lease
        is active (Redis expires it), so what is found is held. One server
        only (:meth:`_scan`).
        """
        start = f"{self._prefix}permit:"
        permits = self._permits

        def key_of(name: str) -> str | None:
            if not name.startswith(start):
                return None
            slot, colon, key = name[len(start) :].partition(":")
            if not (colon and key and slot.isascii() and slot.isdigit()):
                return None
            if str(int(slot)) != slot or int(slot) >= permits:
                return None
            return key

        return self._scan(glob_escape(start) + "*", key_of, limit)

    def _renew(
        self, chunk: list[int], leases: Sequence[Lease], names: list[str]
    ) -> Steps[list[Renewed]]:
        """One RENEW request for the leases at ``chunk``: each one's new expiry or None."""
        expires = [now_ms(self._clock) + leases[i].ttl_ms for i in chunk]
        keys = [names[i] for i in chunk]
        # Each semaphore's index once, after the slot keys: its position in KEYS.
        where: dict[str, int] = {}
        args: list[object] = []
        for i in chunk:
            lease = leases[i]
            holders = self._holders(lease.key, [[names[i]]])
            at = 0
            if holders is not None:
                at = where.get(holders) or where.setdefault(holders, len(chunk) + len(where) + 1)
            args += (lease.token, lease.ttl_ms, at)
        if not self._replicas:
            reply = yield from self._run(RENEW, [*keys, *where], tuple(args))
            acks = 0
        else:
            reply, acks = yield from self._run_waited(RENEW, [*keys, *where], tuple(args))
        if not isinstance(reply, (list, tuple)) or len(reply) != len(chunk):
            raise DMutexError(f"unexpected reply from Redis: {reply!r}")
        renewed: list[Renewed] = [
            e if as_int(d, 0, 1) == 1 else None for d, e in zip(reply, expires, strict=True)
        ]
        if self._replicas and acks < self._replicas:
            # Not replicated: a failed renewal, retried until the lease's deadline.
            return [
                NotReplicatedError(leases[i].key, acks, self._replicas) if r is not None else r
                for i, r in zip(chunk, renewed, strict=True)
            ]
        return renewed

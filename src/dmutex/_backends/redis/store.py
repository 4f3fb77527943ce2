"""The Redis store: each operation is one request to the server.

It sits in ``dmutex._backends.redis`` with the Lua scripts it runs
(``scripts.py``) and the budget of its blocking waits (``waits.py``). How it
sends requests (:class:`RedisRequests`) is shared with the read-write locks'
store (``readwrite.py``).

Layout (shared with the TypeScript dmutex): slot ``i`` of lock ``key`` is the
string key ``f"{key_prefix}permit:{i}:{key}"``, its value the holder's token,
its expiry set with ``PX`` in milliseconds. Redis deletes a key whose expiry
has passed, so "active" is simply "the key exists and holds the token".
Beside them dmutex keeps only records of its own, each marked as dmutex's
and never written where something else is: a lock's fence counter, a
semaphore's holders index (``scripts.py``: a hint that spares reading every
slot key, never trusted for safety) and, while someone waits, its waiting
records.

Names: every record, here and in ``readwrite.py``, is ``key_prefix`` + a
word of ``dmutex._validate.REDIS_KINDS`` (``permit``, ``fence``,
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

import contextlib
import re
from collections.abc import Callable, Sequence
from typing import Protocol, cast

from ..._clock import Clock, SystemClock
from ..._core.abc import Holder, Inspection, Renewed
from ..._core.effects import Call, Sleep, Steps
from ..._core.lease import MAX_EXPIRY_MS, Lease, now_ms
from ..._core.waiting import Ahead, Waiter, lost_pause
from ..._errors import DMutexError, InvalidArgumentError, NotReplicatedError, UnsupportedClientError
from ..blocking import REFRESH, Blockers
from ..cluster import hash_slot, same_hash_slot
from ..shapes import defines, is_cluster_client, method
from .scripts import (
    ACQUIRE,
    EXTEND,
    FENCE_MARK,
    FOREIGN,
    INSPECT,
    MUTEX_ACQUIRE,
    MUTEX_RELEASE,
    RELEASE,
    RENEW,
    RENEW_BATCH,
    Script,
)
from .waits import MIN_BLOCK, TICK, block_budget

__all__ = ["SCAN_COUNT", "RedisStore", "glob_escape"]

# An attempt goes ahead with a block (waiting rule 6) only while the block is
# at most this share of the lease's TTL: the grant's deadline counts from
# before the block, and so may lose up to that share of the lease.
AHEAD_SHARE = 20


# An attempt sent ahead with a block: its script, keys and arguments, and
# what reads its reply into the waiter's Ahead (None: ask again).
AheadAttempt = tuple[Script, list[str], tuple[object, ...], Callable[[object], Ahead | None]]


class _Pipeline(Protocol):
    """What the store uses of a client's ``pipeline(transaction=False)`` (redis-py's shape)."""

    def execute_command(self, *args: object, **options: object) -> object: ...

    def execute(self, raise_on_error: bool = ...) -> object: ...


def _is_noscript(error: BaseException) -> bool:
    """Whether ``error`` is the server's NOSCRIPT reply to EVALSHA.

    redis-py and valkey-py strip the ``NOSCRIPT`` code into the exception
    class (``NoScriptError``); other clients keep it in the message.
    """
    message = str(error)
    return (
        type(error).__name__ == "NoScriptError"
        or message.startswith("NOSCRIPT")
        or message.startswith("No matching script")
    )


def _foreign(error: Exception) -> DMutexError | None:
    """A clear error for ``error`` when it is a script's refusal of a record not dmutex's."""
    said = str(error)
    if FOREIGN not in said:
        return None
    name = said[said.find("DMUTEX ") + 7 : said.find(f" {FOREIGN}")]
    return DMutexError(f"{name!r} {FOREIGN}: dmutex leaves it alone")


def _stock(client: object) -> bool:
    """Whether ``client`` pipelines, with no ``execute_command`` of its own that its pipeline skips.

    A subclass that overrides ``execute_command`` (to log, retry or
    instrument each request) and not ``pipeline`` would not see a
    pipelined request: its waits do not pipeline.
    """
    mro = type(client).__mro__
    sends = next((i for i, c in enumerate(mro) if "execute_command" in vars(c)), None)
    pipes = next((i for i, c in enumerate(mro) if "pipeline" in vars(c)), None)
    return sends is not None and pipes is not None and pipes <= sends


def _waited_pipeline(client: object, cluster: bool) -> Callable[..., _Pipeline]:
    """The ``pipeline`` that ``replicas=`` sends each write and its ``WAIT`` through.

    Raises, before any request, for a client without one (the ioredis shape,
    ``set`` + ``eval``): a ``WAIT`` sent on its own could reach another
    connection than the write, and count nothing of it. A cluster client
    also needs ``get_node_from_key``, to send the ``WAIT`` where the write goes.
    """
    pipeline = getattr(client, "pipeline", None)
    if not defines(client, "execute_command") or not callable(pipeline):
        raise UnsupportedClientError(
            f"replicas= needs a Redis client that pipelines (execute_command and pipeline, "
            f"redis-py's shape); {type(client).__name__} has not both"
        )
    if cluster and not callable(getattr(client, "get_node_from_key", None)):
        raise UnsupportedClientError(
            f"replicas= on a cluster needs get_node_from_key, to send WAIT to the key's "
            f"node; {type(client).__name__} has none"
        )
    return cast("Callable[..., _Pipeline]", pipeline)


# Keys a SCAN request asks the server to look at (listing a namespace's keys).
SCAN_COUNT = 1000
_GLOB = re.compile(r"([\\*?\[\]])")


def glob_escape(text: str) -> str:
    r"""``text`` as a literal in a ``SCAN MATCH`` pattern: ``\ * ? [ ]`` escaped."""
    return _GLOB.sub(r"\\\1", text)


def _scanned(reply: object) -> tuple[int, list[object]]:
    """A ``SCAN`` reply's next cursor and names, however the client decoded it."""
    if not isinstance(reply, (list, tuple)) or len(reply) != 2:
        raise DMutexError(f"unexpected reply from Redis: {reply!r}")
    cursor, names = reply
    if not isinstance(names, (list, tuple)):
        raise DMutexError(f"unexpected reply from Redis: {reply!r}")
    return _as_int(cursor, 0, 2**64 - 1), list(names)


def _answered(ahead: Ahead, waiter: Waiter) -> Steps[Lease | None]:
    """The steps of an attempt answered already: no request; its send time for the engine."""
    yield from ()
    waiter.sent = ahead.sent
    if ahead.error is not None:
        raise ahead.error
    return ahead.lease


def _pair(replies: object) -> tuple[object, object]:
    """A pipeline's replies to a script and the ``WAIT`` after it."""
    if not isinstance(replies, (list, tuple)) or len(replies) != 2:
        raise DMutexError(f"unexpected reply from Redis: {replies!r}")
    return replies[0], replies[1]


def _grant(reply: object, last: int) -> tuple[int, int, int]:
    """The acquire script's ``{position, fence[, expiry]}``; expiry -1 when not given.

    Position in ``-1..last``, fence >= 0, expiry (a holder's PTTL) >= -2.
    """
    if not isinstance(reply, (list, tuple)) or len(reply) not in (2, 3):
        raise DMutexError(f"unexpected reply from Redis: {reply!r}")
    position, fence = _as_int(reply[0], -1, last), _as_int(reply[1], 0, 2**63 - 1)
    if len(reply) == 2:
        return position, fence, -1
    if position != -1 or fence != 0:  # only a failed attempt reports the holder's expiry
        raise DMutexError(f"unexpected reply from Redis: {reply!r}")
    return position, fence, _as_int(reply[2], -2, 2**63 - 1)


def _as_int(reply: object, low: int, high: int) -> int:
    """An integer script reply in ``low..high``, however the client decoded it.

    Anything else is a client or server that does not speak this protocol; it
    raises rather than pass for contention or success.
    """
    value: int | None = None
    if isinstance(reply, int) and not isinstance(reply, bool):
        value = reply
    elif isinstance(reply, (bytes, str)):
        with contextlib.suppress(ValueError):
            value = int(reply)
    if value is None or not low <= value <= high:
        raise DMutexError(f"unexpected reply from Redis: {reply!r}")
    return value


class RedisRequests:
    """How a Redis store sends its requests: scripts, replicated writes and blocking waits.

    What :class:`RedisStore` and the read-write locks' store
    (``readwrite.py``) share. Two client paths: ``execute_command``
    (redis-py, valkey-py, fakeredis, cluster clients), where scripts run by
    ``EVALSHA`` and fall back to ``EVAL`` once when the server answers
    ``NOSCRIPT``; and ``set`` + ``eval`` (the ioredis shape), where scripts
    run by ``EVAL``. With ``replicas=N``, a write goes with its ``WAIT`` in
    one pipeline (:meth:`_run_waited`). A waiter blocks on its key's signal
    list (:meth:`wait`), and a store may send its next attempt with the
    block (:meth:`_ahead`).
    """

    max_expiry_ms = MAX_EXPIRY_MS

    def __init__(
        self,
        client: object,
        prefix: str,
        clock: Clock,
        *,
        replicas: int = 0,
        replicas_ms: int = 1000,
    ) -> None:
        self._prefix = prefix
        self._cluster = is_cluster_client(client)
        # Detection checked the client's shape; pick its path once.
        self._execute: Callable[..., object] | None = None
        self._eval: Callable[..., object] | None = None
        if defines(client, "execute_command"):
            self._execute = method(client, "execute_command")
        else:
            self._eval = method(client, "eval")
        # A waiter's next attempt rides with its block where the client can
        # pipeline (waiting rule 6). Not on a cluster client, whose pipeline
        # is another machine, nor where execute_command is a subclass's own:
        # what logs, retries or instruments each request would not see these.
        self._pipeline: Callable[..., _Pipeline] | None = None
        if self._execute is not None and not self._cluster and _stock(client):
            self._pipeline = getattr(client, "pipeline", None)
        # Writes acknowledged by replicas: WAIT pipelined after the script, on
        # the connection that wrote (WAIT counts that connection's writes).
        # On a cluster, WAIT goes to the node that owns the keys' hash slot.
        self._replicas, self._replicas_ms = replicas, replicas_ms
        self._waited: Callable[..., _Pipeline] | None = None
        self._node_of: Callable[[str], object] | None = None
        if replicas:
            self._waited = _waited_pipeline(client, self._cluster)
            if self._cluster:
                self._node_of = method(client, "get_node_from_key")
        self._clock = clock
        # Waiters block (BLPOP) only where that is safe: a command client
        # on the system clock, with connections to spare.
        found = block_budget(client) if self._execute and isinstance(clock, SystemClock) else None
        self._blockers: Blockers | None = None
        self._block_cap = 0.0
        if found is not None:
            self._blockers, self._block_cap = found

    @property
    def clock(self) -> Clock:
        return self._clock

    def _run(self, script: Script, keys: Sequence[str], args: tuple[object, ...]) -> Steps[object]:
        """Run ``script`` in one request (two the first time on a fresh server)."""
        if self._execute is None:
            assert self._eval is not None  # detection: no execute_command means set + eval
            return (yield Call(self._eval, (script.text, len(keys), *keys, *args)))
        try:
            return (yield Call(self._execute, ("EVALSHA", script.sha, len(keys), *keys, *args)))
        except Exception as error:
            if not _is_noscript(error):
                raise
        # EVAL caches the script, so the next EVALSHA on this server succeeds.
        return (yield Call(self._execute, ("EVAL", script.text, len(keys), *keys, *args)))

    def _run_waited(
        self, script: Script, keys: Sequence[str], args: tuple[object, ...]
    ) -> Steps[tuple[object, int]]:
        """Run ``script`` and ``WAIT`` in one request: its reply, and the replicas that have it.

        Replication rule: the count is of replicas that acknowledged every
        write of the connection up to the script's, so a script that wrote
        nothing (a refusal) counts whatever was acknowledged before. On a
        cluster, a reply that moved the key's hash slot to another node (a
        redirect) counts none: the ``WAIT`` went to the node it left.
        """
        node = self._node_of(keys[0]) if self._node_of is not None else None
        reply, acks = _pair((yield Call(self._send_waited, ("EVALSHA", script.sha, keys, args))))
        if isinstance(reply, Exception) and _is_noscript(reply):
            # EVAL caches the script, so the next EVALSHA on this server succeeds.
            reply, acks = _pair((yield Call(self._send_waited, ("EVAL", script.text, keys, args))))
        if isinstance(reply, Exception):
            raise reply
        if isinstance(acks, Exception):
            raise acks
        if node is not None and self._node_of is not None and self._node_of(keys[0]) != node:
            return reply, 0
        return reply, _as_int(acks, 0, 2**31)

    def _send_waited(
        self, command: str, body: str, keys: Sequence[str], args: tuple[object, ...]
    ) -> object:
        """The script (``EVALSHA`` or ``EVAL``), then ``WAIT``, pipelined on one connection.

        Errors come back as values (``raise_on_error=False``); on a cluster
        the ``WAIT`` names the node that owns the keys.
        """
        assert self._waited is not None
        pipe = self._waited(transaction=False)
        pipe.execute_command(command, body, len(keys), *keys, *args)
        if self._node_of is None:
            pipe.execute_command("WAIT", self._replicas, self._replicas_ms)
        else:
            node = self._node_of(keys[0])
            pipe.execute_command("WAIT", self._replicas, self._replicas_ms, target_nodes=node)
        return pipe.execute(raise_on_error=False)

    def _replicated(self, key: str, acks: int) -> None:
        """Raise :class:`NotReplicatedError` unless ``acks`` replicas are enough."""
        if acks < self._replicas:
            raise NotReplicatedError(key, acks, self._replicas)

    def _take(self, script: Script, keys: Sequence[str], args: tuple[object, ...]) -> Steps[object]:
        """Run an acquire ``script``; a record not dmutex's raises a clear :class:`DMutexError`."""
        try:
            return (yield from self._run(script, keys, args))
        except Exception as error:
            clear = _foreign(error)
            if clear is None:
                raise
            raise clear from error

    def _take_waited(
        self, script: Script, keys: Sequence[str], args: tuple[object, ...]
    ) -> Steps[tuple[object, int]]:
        """:meth:`_take`, with the replicas that acknowledged it (:meth:`_run_waited`)."""
        try:
            return (yield from self._run_waited(script, keys, args))
        except Exception as error:
            clear = _foreign(error)
            if clear is None:
                raise
            raise clear from error

    def ready(self) -> Steps[None]:
        """Nothing to prepare: Redis needs no index."""
        yield from ()

    def _scan(
        self, pattern: str, key_of: Callable[[str], str | None], limit: int
    ) -> Steps[list[str]]:
        """The first ``limit`` keys, sorted, of the names ``SCAN MATCH pattern`` finds.

        :data:`SCAN_COUNT` names looked at per request, until ``limit`` keys
        are found or the cursor comes round (``SCAN`` may name a key twice:
        each counts once). ``key_of`` reads a name's key (None: not one). On
        one server only: raises :class:`UnsupportedClientError` for a cluster
        client (each primary holds its own part of the keys) and for a
        client without ``execute_command`` (the ``set`` + ``eval`` shape),
        when called, before any request.
        """
        if self._cluster:
            raise UnsupportedClientError(
                "listing a namespace's keys scans one Redis server; a cluster client's "
                "keys are spread over its primaries"
            )
        if self._execute is None:
            raise UnsupportedClientError(
                "listing a namespace's keys needs a Redis client with execute_command (SCAN)"
            )
        return self._scanning(self._execute, pattern, key_of, limit)

    @staticmethod
    def _scanning(
        execute: Callable[..., object],
        pattern: str,
        key_of: Callable[[str], str | None],
        limit: int,
    ) -> Steps[list[str]]:
        found: set[str] = set()
        cursor = 0
        while True:
            reply = yield Call(execute, ("SCAN", cursor, "MATCH", pattern, "COUNT", SCAN_COUNT))
            cursor, names = _scanned(reply)
            for name in names:
                try:
                    text = name.decode() if isinstance(name, bytes) else str(name)
                except UnicodeDecodeError:
                    continue  # not a name dmutex writes
                key = key_of(text)
                if key is not None:
                    found.add(key)
            if cursor == 0 or len(found) >= limit:
                return sorted(found)[:limit]

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        """Block on ``key``'s signal list (``BLPOP``) for up to ``seconds``, else sleep.

        Blocks only when the last attempt registered ``waiter`` and a
        connection of the pool is to spare (see :class:`Blockers`). A
        failed block (a socket timeout, a server that refuses the command)
        sleeps the rest of the wait: it never raises.

        A wait longer than a server tick (:data:`TICK`) blocks a tick less
        than it lasts, and may end that much early; a shorter one blocks
        all of it and may end up to a tick late, since the server times
        the block out only on its tick, unless the holder's expiry cuts it
        short: that one sleeps, to try on time.

        Caveat: a client that re-sends a command whose connection was cut
        (redis-py's default retry policy) re-sends the BLPOP with its whole
        timeout, so a cut in the middle of a block stretches that one wait
        by up to the client's retries times the block. A release still
        ends it at once; only what sends no signal waits longer.
        """
        blockers = self._blockers
        if waiter.woken:
            # Woken, then beaten to the permit: pause before blocking (waiting.py, rule 4).
            waiter.woken = False
            yield Sleep(lost_pause(seconds))
            return
        block = min(seconds, self._block_cap)
        if block >= TICK + MIN_BLOCK:
            block -= TICK
        elif waiter.expires_in is not None and seconds >= waiter.expires_in:
            # Cut short by the holder's expiry: a block would end a tick late.
            block = 0.0
        if not waiter.registered or blockers is None or block < MIN_BLOCK or not blockers.take():
            yield Sleep(seconds)
            return
        assert self._execute is not None  # blocking needs a command client
        signal = f"{self._prefix}signal:{key}"
        started = self._clock.monotonic()
        ahead = None
        # Only on a client that pipelines, for an acquire whose token the
        # engine fixed, and for a block short beside the TTL (AHEAD_SHARE).
        if (
            self._pipeline is not None
            and waiter.token
            and block * 1000 * AHEAD_SHARE <= waiter.ttl_ms
        ):
            ahead = self._ahead(key, waiter, started)
        failed = False
        try:
            if ahead is None:
                reply = yield Call(self._execute, ("BLPOP", signal, f"{block:.3f}"))
            else:
                script, keys, args, answer = ahead
                replies = yield Call(self._send_ahead, (signal, f"{block:.3f}", script, keys, args))
                sent = 3 if self._replicas else 2
                if not isinstance(replies, (list, tuple)) or len(replies) != sent:
                    raise DMutexError(f"unexpected reply from Redis: {replies!r}")
                reply = replies[0]
                waiter.ahead = answer(replies[1])
                if self._replicas:
                    waiter.ahead = self._ahead_replicated(waiter.ahead, key, replies[2])
        except Exception:  # noqa: BLE001 - the wait degrades to sleeping, rule 3 of waiting.py
            # An attempt that went ahead may have taken a permit: the next
            # attempt, with the same token, finds it (rule 3 of scripts.py).
            failed, waiter.ahead = True, None
        else:
            waiter.woken = reply is not None
        finally:
            blockers.give()
        rest = seconds - (self._clock.monotonic() - started)
        if failed and rest > 0:
            yield Sleep(rest)

    def _ahead(self, key: str, waiter: Waiter, started: float) -> AheadAttempt | None:
        """The attempt to send with a block that starts at ``started`` (waiting rule 6), or None.

        A store that sends one answers with its script, keys and arguments,
        and what makes the :class:`Ahead` of its reply (None: ask again).
        """
        return None

    def _send_ahead(
        self, signal: str, block: str, script: Script, keys: list[str], args: tuple[object, ...]
    ) -> object:
        """``BLPOP``, then the acquire ``script``, pipelined: the attempt runs as the block ends.

        One round trip; the client's connection is blocked for both, so the
        attempt runs right after the block, before this client reads a
        byte. Errors come back as values (``raise_on_error=False``).
        """
        assert self._pipeline is not None
        pipe = self._pipeline(transaction=False)
        pipe.execute_command("BLPOP", signal, block)
        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        if self._replicas:
            pipe.execute_command("WAIT", self._replicas, self._replicas_ms)
        return pipe.execute(raise_on_error=False)

    def _ahead_replicated(self, ahead: Ahead | None, key: str, acks: object) -> Ahead | None:
        """What an attempt sent ahead answered, once its ``WAIT``'s count ``acks`` is known.

        A grant too few replicas acknowledged answers :class:`NotReplicatedError`
        (the engine releases it); a ``WAIT`` that failed, its error.
        """
        if ahead is None or ahead.lease is None:
            return ahead
        try:
            if isinstance(acks, Exception):
                raise acks
            self._replicated(key, _as_int(acks, 0, 2**31))
        except Exception as error:  # noqa: BLE001 - the attempt's answer, raised by the next
            return Ahead(None, error, ahead.sent)
        return ahead


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
        """The holders index of ``key`` (``scripts.py``), or None: a mutex, or no shared hash slot.

        A semaphore's scripts read it to answer without looking at every
        slot key; on a cluster it must share the slot keys' hash slot.
        """
        if self._permits == 1:
            return None
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
            return _answered(ahead, waiter)
        if self._permits == 1 and (waiter is None or self._blockers is None):
            # The mutex's own script: nothing of the semaphore, no waiter to
            # register (a waiter that cannot be woken registers nowhere).
            slot = f"{self._prefix}permit:0:{key}"
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
        holders = None if self._permits == 1 else self._holders(key, groups)
        records: tuple[list[str], str]
        if holders is None:
            records = ([counter], "fence") if counter else ([], "-")
        else:
            records = ([counter, holders], "fence+holders") if counter else ([holders], "holders")
        return groups, records, self._wakes(key, groups) if waiting else []

    def _acquire_mutex(
        self, key: str, token: str, ttl_ms: int, keys: tuple[str, ...]
    ) -> Steps[Lease | None]:
        expires = now_ms(self._clock) + ttl_ms
        acks = 0
        if self._replicas:
            reply, acks = yield from self._take_waited(MUTEX_ACQUIRE, keys, (token, ttl_ms))
        else:
            reply = yield from self._take(MUTEX_ACQUIRE, keys, (token, ttl_ms))
        counted = len(keys) > 1
        fence = _as_int(reply, 0, 2**63 - 1 if counted else 1)
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
            if _is_noscript(reply):
                return None
            return Ahead(None, _foreign(reply) or reply, sent)
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
        holders = None if self._permits == 1 else self._holders(key, groups)
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
            if not waited:
                if _as_int((yield from self._run(script, keys, args)), 0, 1) == 1:
                    return True
                continue
            reply, acks = yield from self._run_waited(script, keys, args)
            if _as_int(reply, 0, 1) == 1:
                self._replicated(key, acks)
                return True
        return False

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        """Delete the slot key that holds ``token`` and wake a waiter, in one atomic script."""
        if self._permits == 1:
            name = f"{self._prefix}permit:0:{key}"
            return self._release_mutex((name, *self._wakes(key, [[name]])), token)
        return self._holder(RELEASE, key, slot, (token,), wake=True)

    def _release_mutex(self, keys: tuple[str, ...], token: str) -> Steps[bool]:
        return _as_int((yield from self._run(MUTEX_RELEASE, keys, (token,))), 0, 1) == 1

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
            now = _as_int(reply[0], 0, MAX_EXPIRY_MS)
            stored = reply[1].decode() if isinstance(reply[1], bytes) else reply[1]
            if extra and isinstance(stored, str) and stored.startswith(FENCE_MARK):
                fence = _as_int(stored[len(FENCE_MARK) :], 0, 2**63 - 1)
            for at in range(2, len(reply), 3):
                position, token, left = reply[at : at + 3]
                expires = MAX_EXPIRY_MS if left == -1 else now + _as_int(left, 0, MAX_EXPIRY_MS)
                shown = token.decode() if isinstance(token, bytes) else str(token)
                found.append(Holder(first + _as_int(position, 0, len(group)), shown, expires))
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
            e if _as_int(d, 0, 1) == 1 else None for d, e in zip(reply, expires, strict=True)
        ]
        if self._replicas and acks < self._replicas:
            # Not replicated: a failed renewal, retried until the lease's deadline.
            return [
                NotReplicatedError(leases[i].key, acks, self._replicas) if r is not None else r
                for i, r in zip(chunk, renewed, strict=True)
            ]
        return renewed

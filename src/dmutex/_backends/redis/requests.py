"""How the Redis stores send their requests: scripts, replicated writes, waits and scans.

:class:`RedisRequests` is what :class:`~dmutex._backends.redis.store.RedisStore`
and the read-write locks' store (``readwrite.py``) share; the layout and the
guarantees are the store's (``store.py``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from typing import Protocol, cast

from ..._clock import Clock, SystemClock
from ..._core.effects import Call, Sleep, Steps
from ..._core.lease import MAX_EXPIRY_MS, Lease
from ..._core.waiting import Ahead, Waiter, lost_pause
from ..._errors import DMutexError, NotReplicatedError, UnsupportedClientError
from ..blocking import Blockers
from ..shapes import defines, method
from .scripts import (
    FOREIGN,
    Script,
)
from .shapes import is_cluster_client
from .waits import MIN_BLOCK, TICK, block_budget

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


def is_noscript(error: BaseException) -> bool:
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


def foreign(error: Exception) -> DMutexError | None:
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
    return as_int(cursor, 0, 2**64 - 1), list(names)


def answered(ahead: Ahead, waiter: Waiter) -> Steps[Lease | None]:
    """The steps of an attempt answered already: no request; its send time for the engine."""
    yield from ()
    waiter.sent = ahead.sent
    if ahead.error is not None:
        raise ahead.error
    return ahead.lease


def pair(replies: object) -> tuple[object, object]:
    """A pipeline's replies to a script and the ``WAIT`` after it."""
    if not isinstance(replies, (list, tuple)) or len(replies) != 2:
        raise DMutexError(f"unexpected reply from Redis: {replies!r}")
    return replies[0], replies[1]


def as_int(reply: object, low: int, high: int) -> int:
    """An integer script reply in ``low..high``, however the client decoded it.

    Anything else is a client or server that does not speak this protocol; it
    raises rather than pass for contention or success.
    """
    if type(reply) is int and low <= reply <= high:
        return reply  # the common case, first: this reads every script's reply
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
        # Its wall clock, as lease.now_ms reads it (one call less per request).
        self._wall = clock.time
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

    def _run(
        self,
        script: Script,
        keys: Sequence[str],
        args: tuple[object, ...],
        complete: bool = False,
    ) -> Steps[object]:
        """Run ``script`` in one request (two the first time on a fresh server).

        ``complete``: the requests are a release's, marked to run to
        completion (``Call.complete``; the store's ``releases_complete``).
        """
        if self._execute is None:
            assert self._eval is not None  # detection: no execute_command means set + eval
            return (yield Call(self._eval, (script.text, len(keys), *keys, *args), None, complete))
        try:
            return (
                yield Call(
                    self._execute, ("EVALSHA", script.sha, len(keys), *keys, *args), None, complete
                )
            )
        except Exception as error:  # noqa: BLE001 - NOSCRIPT, or raised by _run_again
            failed = error
        return (yield from self._run_again(script, keys, args, failed, complete))

    def _run_again(
        self,
        script: Script,
        keys: Sequence[str],
        args: tuple[object, ...],
        failed: Exception,
        complete: bool = False,
    ) -> Steps[object]:
        """After ``script``'s ``EVALSHA`` raised ``failed``: ``EVAL`` on NOSCRIPT, else raise it.

        What :meth:`_run` does after its first request; the store's mutex
        requests, written out where they are made, end here too.
        """
        if not is_noscript(failed):
            raise failed
        assert self._execute is not None  # EVALSHA went through execute_command
        # EVAL caches the script, so the next EVALSHA on this server succeeds.
        return (
            yield Call(
                self._execute, ("EVAL", script.text, len(keys), *keys, *args), None, complete
            )
        )

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
        reply, acks = pair((yield Call(self._send_waited, ("EVALSHA", script.sha, keys, args))))
        if isinstance(reply, Exception) and is_noscript(reply):
            # EVAL caches the script, so the next EVALSHA on this server succeeds.
            reply, acks = pair((yield Call(self._send_waited, ("EVAL", script.text, keys, args))))
        if isinstance(reply, Exception):
            raise reply
        if isinstance(acks, Exception):
            raise acks
        if node is not None and self._node_of is not None and self._node_of(keys[0]) != node:
            return reply, 0
        return reply, as_int(acks, 0, 2**31)

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
        """Run an acquire ``script``; a record not dmutex's raises a clear :class:`DMutexError`.

        :meth:`_run`'s requests, written out here rather than delegated to:
        one generator less per acquire, which every cycle makes.
        """
        try:
            if self._execute is None:
                assert self._eval is not None  # detection: no execute_command means set + eval
                return (yield Call(self._eval, (script.text, len(keys), *keys, *args)))
            try:
                return (yield Call(self._execute, ("EVALSHA", script.sha, len(keys), *keys, *args)))
            except Exception as error:  # noqa: BLE001 - NOSCRIPT, or raised by _run_again
                failed = error
            return (yield from self._run_again(script, keys, args, failed))
        except Exception as error:
            clear = foreign(error)
            if clear is None:
                raise
            raise clear from error

    def _take_again(
        self, script: Script, keys: Sequence[str], args: tuple[object, ...], failed: Exception
    ) -> Steps[object]:
        """:meth:`_take` after its ``EVALSHA`` raised ``failed`` (see :meth:`_run_again`)."""
        try:
            return (yield from self._run_again(script, keys, args, failed))
        except Exception as error:
            clear = foreign(error)
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
            clear = foreign(error)
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
            self._replicated(key, as_int(acks, 0, 2**31))
        except Exception as error:  # noqa: BLE001 - the attempt's answer, raised by the next
            return Ahead(None, error, ahead.sent)
        return ahead

"""The Redis store: each operation is one request to the server.

Layout (shared with the TypeScript dmutex): slot ``i`` of lock ``key`` is the
string key ``f"{key_prefix}permit:{i}:{key}"``, its value the holder's token,
its expiry set with ``PX`` in milliseconds. Redis deletes a key whose expiry
has passed, so "active" is simply "the key exists and holds the token".

Guarantees, on one Redis server: at most ``max_permits`` keys of a lock exist
at any instant, because each is created only by ``SET ... NX``; release and
extend compare the token and act in one atomic script, so a holder whose lease
expired and was taken over cannot touch the new holder's key.

Limits:

- Expiry is the server's: Redis treats a key as expired once its clock is past
  the expiry, so a lease lasts ``ttl`` plus up to a millisecond, and
  ``expired_at`` (computed with this process's clock before the request is
  sent) is an estimate that is never later than the server's.
- Replication is asynchronous. A key written on a primary that fails before
  the write reaches a replica is lost on failover, and a second holder can
  then be granted the same slot. See the README's section on failover.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._clock import Clock
from .._core.effects import Call, Steps
from .._core.lease import MAX_EXPIRY_MS, Lease, now_ms
from .._errors import DMutexError
from .cluster import same_hash_slot
from .shapes import defines, is_cluster_client, method

# Every script works in one of two modes. On a cluster, KEYS are the slot keys
# to look at (all in one hash slot). On a single server there are no KEYS: the
# script builds the slot key names itself from the prefix and lock key in
# ARGV, so a request stays a few bytes long whatever max_permits is, and it
# keeps a hint key, f"{prefix}hint:{key}", saying which slot to try first.
# The hint only orders the search: a slot is taken by SET NX on its own key,
# the TypeScript layout's record, so a wrong, missing or foreign hint costs
# time, never correctness. It expires with the leases that wrote it.

# ARGV: token, ttl ms [, prefix, lock key, slot count]. Returns the slot
# taken, or -1 when every slot is held.
_ACQUIRE = """\
local token, ttl = ARGV[1], ARGV[2]
if #KEYS > 0 then
  for i = 1, #KEYS do
    if redis.call('SET', KEYS[i], token, 'PX', ttl, 'NX') then return i - 1 end
  end
  return -1
end
local prefix, key, n = ARGV[3], ARGV[4], tonumber(ARGV[5])
local hint = prefix .. 'hint:' .. key
local start = tonumber(redis.call('GET', hint)) or 0
if start ~= math.floor(start) or start < 0 or start >= n then start = 0 end
for j = 0, n - 1 do
  local i = (start + j) % n
  if redis.call('SET', prefix .. 'permit:' .. i .. ':' .. key, token, 'PX', ttl, 'NX') then
    redis.call('SET', hint, (i + 1) % n, 'PX', ttl)
    return i
  end
end
return -1
"""

# ARGV: token [, prefix, lock key, first slot, last slot]. Deletes the slot
# key holding the token and returns 1, or returns 0. On a single server the
# freed slot becomes the hint, for as long as the lease had left.
_RELEASE = """\
local token = ARGV[1]
if #KEYS > 0 then
  for i = 1, #KEYS do
    if redis.call('GET', KEYS[i]) == token then
      redis.call('DEL', KEYS[i])
      return 1
    end
  end
  return 0
end
local prefix, key = ARGV[2], ARGV[3]
for i = tonumber(ARGV[4]), tonumber(ARGV[5]) do
  local name = prefix .. 'permit:' .. i .. ':' .. key
  if redis.call('GET', name) == token then
    local left = redis.call('PTTL', name)
    redis.call('DEL', name)
    if left > 0 then redis.call('SET', prefix .. 'hint:' .. key, i, 'PX', left) end
    return 1
  end
end
return 0
"""

# ARGV: token, ttl ms [, prefix, lock key, first slot, last slot]. Sets the
# expiry of the slot key holding the token to now + ttl and returns 1, or 0.
_EXTEND = """\
local token, ttl = ARGV[1], ARGV[2]
local function extend(name)
  if redis.call('GET', name) == token then
    redis.call('PEXPIRE', name, ttl)
    return true
  end
  return false
end
if #KEYS > 0 then
  for i = 1, #KEYS do
    if extend(KEYS[i]) then return 1 end
  end
  return 0
end
for i = tonumber(ARGV[5]), tonumber(ARGV[6]) do
  if extend(ARGV[3] .. 'permit:' .. i .. ':' .. ARGV[4]) then return 1 end
end
return 0
"""


@dataclass(frozen=True)
class _Script:
    text: str
    sha: str

    @classmethod
    def of(cls, text: str) -> _Script:
        # SHA-1 is how Redis names a cached script, not a security measure.
        return cls(text, hashlib.sha1(text.encode()).hexdigest())


ACQUIRE, RELEASE, EXTEND = _Script.of(_ACQUIRE), _Script.of(_RELEASE), _Script.of(_EXTEND)


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


def _set_succeeded(reply: object) -> bool:
    """Whether ``SET ... NX`` set the key: OK (in any decoding) or nil."""
    if reply is None or reply is False:
        return False
    if reply is True or reply in ("OK", b"OK"):
        return True
    raise DMutexError(f"unexpected reply from Redis to SET: {reply!r}")


# --- the store ------------------------------------------------------------------------


class RedisStore:
    """One namespace of lock keys on one Redis server or cluster; a ``Store``.

    Two client paths: ``execute_command`` (redis-py, valkey-py, fakeredis,
    cluster clients), where scripts run by ``EVALSHA`` and fall back to
    ``EVAL`` once when the server answers ``NOSCRIPT``; and ``set`` + ``eval``
    (the ioredis shape), where scripts run by ``EVAL``.

    On a cluster client, a lock whose slot keys fall into different hash
    slots is handled one key per request (see :meth:`acquire`); wrap the lock
    key in a hash tag, ``"{orders}"``, to keep one request per operation.
    """

    max_expiry_ms = MAX_EXPIRY_MS

    def __init__(self, client: object, prefix: str, max_permits: int, clock: Clock) -> None:
        self._prefix = prefix
        self._permits = max_permits
        self._standalone = not is_cluster_client(client)
        # Detection checked the client's shape; pick its path once.
        self._execute: Callable[..., object] | None = None
        self._eval: Callable[..., object] | None = None
        self._set: Callable[..., object] | None = None
        if defines(client, "execute_command"):
            self._execute = method(client, "execute_command")
        else:
            self._eval, self._set = method(client, "eval"), method(client, "set")
        self._clock = clock

    @property
    def clock(self) -> Clock:
        return self._clock

    def _name(self, slot: int, key: str) -> str:
        return f"{self._prefix}permit:{slot}:{key}"

    def _run(self, script: _Script, keys: Sequence[str], args: tuple[object, ...]) -> Steps[object]:
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

    def _set_nx(self, name: str, token: str, ttl_ms: int) -> Steps[bool]:
        if self._execute is None:
            assert self._set is not None  # detection: no execute_command means set + eval
            reply = yield Call(self._set, (name, token), {"px": ttl_ms, "nx": True})
        else:
            reply = yield Call(self._execute, ("SET", name, token, "PX", ttl_ms, "NX"))
        return _set_succeeded(reply)

    def ready(self) -> Steps[None]:
        """Nothing to prepare: Redis needs no index."""
        yield from ()

    def acquire(self, key: str, token: str, ttl_ms: int) -> Steps[Lease | None]:
        """Take a free slot of ``key``, or return None when all are held.

        One request: ``SET NX`` for a single permit, else one script that
        tries the slots, starting from the hint on a single server and from
        slot 0 on a cluster. On a cluster with the slot keys in different hash
        slots, one ``SET NX`` per slot until one succeeds (at most
        ``max_permits``).
        """
        expires = now_ms(self._clock) + ttl_ms
        permits = self._permits
        if permits == 1 and self._execute is not None:  # the mutex path, inlined
            reply = yield Call(
                self._execute, ("SET", f"{self._prefix}permit:0:{key}", token, "PX", ttl_ms, "NX")
            )
            return Lease(key, token, 0, expires) if reply is True or _set_succeeded(reply) else None
        if permits == 1:
            taken = yield from self._set_nx(self._name(0, key), token, ttl_ms)
            return Lease(key, token, 0, expires) if taken else None
        if self._standalone:
            args = (token, ttl_ms, self._prefix, key, permits)
            reply = yield from self._run(ACQUIRE, (), args)
        else:
            names = [self._name(slot, key) for slot in range(permits)]
            if not same_hash_slot(names):
                for slot, name in enumerate(names):
                    if (yield from self._set_nx(name, token, ttl_ms)):
                        return Lease(key, token, slot, expires)
                return None
            reply = yield from self._run(ACQUIRE, names, (token, ttl_ms))
        slot = _as_int(reply, -1, permits - 1)
        return Lease(key, token, slot, expires) if slot >= 0 else None

    def _holder(
        self, script: _Script, key: str, slot: int | None, head: tuple[object, ...]
    ) -> Steps[bool]:
        """Run a compare-token script on the slot(s) that may hold the token.

        ``head`` is the script's leading arguments (the token, and the TTL for
        extend). Returns whether a slot held it.
        """
        permits = self._permits
        if self._standalone and permits > 1:
            first, last = (0, permits - 1) if slot is None else (slot, slot)
            args = (*head, self._prefix, key, first, last)
            return _as_int((yield from self._run(script, (), args)), 0, 1) == 1
        if slot is not None or permits == 1:
            name = self._name(slot or 0, key)
            return _as_int((yield from self._run(script, (name,), head)), 0, 1) == 1
        names = [self._name(number, key) for number in range(permits)]
        groups = [names] if same_hash_slot(names) else [[name] for name in names]
        for group in groups:
            if _as_int((yield from self._run(script, group, head)), 0, 1):
                return True
        return False

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        """Delete the slot key that holds ``token``, in one atomic script."""
        if self._permits == 1:  # the mutex path, one frame shorter
            name = f"{self._prefix}permit:0:{key}"
            return _as_int((yield from self._run(RELEASE, (name,), (token,))), 0, 1) == 1
        return (yield from self._holder(RELEASE, key, slot, (token,)))

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        """Set the expiry of the slot key that holds ``token`` to now + ttl."""
        expires = now_ms(self._clock) + ttl_ms
        done = yield from self._holder(EXTEND, key, slot, (token, ttl_ms))
        return expires if done else None

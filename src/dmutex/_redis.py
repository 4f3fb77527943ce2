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

from ._clock import Clock, SystemClock
from ._effects import Steps, call
from ._errors import DMutexError
from ._store import MAX_EXPIRY_MS, Grant, Namespace, now_ms

# KEYS: the slot keys to try, in slot order. ARGV: token, ttl in ms.
# Returns the index of the key taken, or -1 when every one is held.
_ACQUIRE = """\
for i = 1, #KEYS do
  if redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2], 'NX') then
    return i - 1
  end
end
return -1
"""

# KEYS: the slot keys that may hold the token. ARGV: token.
# Deletes the one that holds it; returns 1 if there was one, else 0.
_RELEASE = """\
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    redis.call('DEL', KEYS[i])
    return 1
  end
end
return 0
"""

# KEYS: the slot keys that may hold the token. ARGV: token, ttl in ms.
# Sets the expiry of the one that holds it to now + ttl; returns 1 or 0.
_EXTEND = """\
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
    return 1
  end
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


# --- Redis Cluster hash slots ---------------------------------------------------------


def _crc16_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
        table.append(crc & 0xFFFF)
    return table


_CRC16 = _crc16_table()


def hash_slot(key: str) -> int:
    """The Redis Cluster hash slot of ``key`` (CRC16/XMODEM mod 16384, hash tags honoured)."""
    data = key.encode()
    start = data.find(b"{")
    if start != -1:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16[((crc >> 8) ^ byte) & 0xFF]
    return crc % 16384


def is_cluster_client(client: object) -> bool:
    """Whether ``client`` routes commands by hash slot: it has a ``keyslot`` method.

    Looked up dynamically, so a wrapper that forwards attributes to a cluster
    client counts as one. Erring towards "cluster" only costs requests (one
    key per request); erring the other way would send scripts the cluster
    refuses.
    """
    return callable(getattr(client, "keyslot", None))


def _method(client: object, name: str) -> Callable[..., object] | None:
    method = getattr(client, name, None)
    return method if callable(method) else None


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

    def __init__(self, client: object, namespace: Namespace) -> None:
        self._prefix = namespace.key_prefix
        self._permits = namespace.max_permits
        self._cluster = is_cluster_client(client)
        # The client's shape was checked by detection; pick its path once.
        self._execute = _method(client, "execute_command")
        self._eval = _method(client, "eval")
        self._set = _method(client, "set")
        self._clock = SystemClock()

    @property
    def clock(self) -> Clock:
        return self._clock

    def _keys(self, key: str) -> list[str]:
        prefix = self._prefix
        return [f"{prefix}permit:{slot}:{key}" for slot in range(self._permits)]

    def _one_request(self, keys: Sequence[str]) -> bool:
        """Whether one script may touch all of ``keys``: always, but on a cluster."""
        if not self._cluster or len(keys) == 1:
            return True
        first = hash_slot(keys[0])
        return all(hash_slot(k) == first for k in keys[1:])

    def _run(self, script: _Script, keys: Sequence[str], *args: object) -> Steps[object]:
        """Run ``script`` on ``keys`` in one request (two the first time on a fresh server)."""
        if self._execute is None:
            assert self._eval is not None  # detection: no execute_command means set + eval
            return (yield from call(self._eval, script.text, len(keys), *keys, *args))
        try:
            reply = yield from call(self._execute, "EVALSHA", script.sha, len(keys), *keys, *args)
        except Exception as error:
            if not _is_noscript(error):
                raise
            # EVAL caches the script, so the next EVALSHA on this server succeeds.
            reply = yield from call(self._execute, "EVAL", script.text, len(keys), *keys, *args)
        return reply

    def _set_nx(self, key: str, token: str, ttl_ms: int) -> Steps[bool]:
        if self._execute is None:
            assert self._set is not None  # detection: no execute_command means set + eval
            reply = yield from call(self._set, key, token, px=ttl_ms, nx=True)
        else:
            reply = yield from call(self._execute, "SET", key, token, "PX", ttl_ms, "NX")
        return _set_succeeded(reply)

    def ready(self) -> Steps[None]:
        """Nothing to prepare: Redis needs no index."""
        yield from ()

    def acquire(self, key: str, token: str, ttl_ms: int) -> Steps[Grant | None]:
        """Take the lowest free slot of ``key``.

        One request: ``SET NX`` for a single permit, else one script that tries
        every slot. On a cluster with the slot keys in different hash slots,
        one ``SET NX`` per slot until one succeeds (at most ``max_permits``).
        """
        expires = now_ms(self._clock) + ttl_ms
        keys = self._keys(key)
        if len(keys) == 1:
            taken = yield from self._set_nx(keys[0], token, ttl_ms)
            return Grant(0, expires) if taken else None
        if self._one_request(keys):
            reply = yield from self._run(ACQUIRE, keys, token, ttl_ms)
            slot = _as_int(reply, -1, len(keys) - 1)
            return Grant(slot, expires) if slot >= 0 else None
        for slot, name in enumerate(keys):
            taken = yield from self._set_nx(name, token, ttl_ms)
            if taken:
                return Grant(slot, expires)
        return None

    def _each(self, script: _Script, key: str, slot: int | None, *args: object) -> Steps[bool]:
        """Run a compare-token script on the slot key(s) that may hold the token."""
        keys = self._keys(key) if slot is None else [f"{self._prefix}permit:{slot}:{key}"]
        groups = [keys] if self._one_request(keys) else [[k] for k in keys]
        for group in groups:
            reply = yield from self._run(script, group, *args)
            if _as_int(reply, 0, 1):
                return True
        return False

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        """Delete the slot key that holds ``token``, in one atomic script."""
        return (yield from self._each(RELEASE, key, slot, token))

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        """Set the expiry of the slot key that holds ``token`` to now + ttl."""
        expires = now_ms(self._clock) + ttl_ms
        done = yield from self._each(EXTEND, key, slot, token, ttl_ms)
        return expires if done else None

"""The Redis store: each operation is one request to the server.

Layout (shared with the TypeScript dmutex): slot ``i`` of lock ``key`` is the
string key ``f"{key_prefix}permit:{i}:{key}"``, its value the holder's token,
its expiry set with ``PX`` in milliseconds. Redis deletes a key whose expiry
has passed, so "active" is simply "the key exists and holds the token".
Beside them dmutex keeps only records of its own, each marked as dmutex's
and never written where something else is: a lock's fence counter, a
semaphore's holders index (``_HOLDERS``: a hint that spares reading every
slot key, never trusted for safety) and, while someone waits, its waiting
records.

Guarantees, on one Redis server: at most ``max_permits`` keys of a lock exist
at any instant, because each is created only by ``SET ... NX``; release and
extend compare the token and act in one atomic script, so a holder whose lease
expired and was taken over cannot touch the new holder's key. Every script
declares, in ``KEYS``, every key it touches, and writes only slot keys that
are absent or hold the caller's own token (and the records above).

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
  then be granted the same slot. See the README's section on failover.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._clock import Clock, SystemClock
from .._core.abc import Holder, Inspection, Renewed
from .._core.effects import Call, Sleep, Steps
from .._core.lease import MAX_EXPIRY_MS, Lease, now_ms
from .._core.waiting import Waiter, lost_pause
from .._errors import DMutexError, InvalidArgumentError
from .._validate import MAX_PERMITS
from .cluster import hash_slot, same_hash_slot
from .shapes import defines, is_cluster_client, method

# KEYS of every script: slot keys of one lock, in slot order, all in one hash
# slot on a cluster. Slot numbers are positions in KEYS (0-based, KEYS is
# 1-based), so a script never builds a key name: what it touches is what the
# request declares, as Redis, ACL key patterns, proxies and clusters require.
# After the slot keys come the lock's extra records that the request names.

# The holders index of a semaphore (``{prefix}holders:{key}``), so that a
# full semaphore, and a release or extend by token, cost the same whatever
# max_permits is: a sorted set whose member MARK, at +inf, says that dmutex
# wrote it, and whose other members are the tokens of the leases that dmutex
# granted, each scored ``expiry_ms * SLOTS + slot``. It is a hint, never the
# truth: the slot keys are. It may only under-report (a holder that the
# TypeScript library or an older dmutex granted is not in it, and an expiry
# past HORIZON, the year 2248, is stored rounded down to it): then the
# script reads the slot keys, as it would without the index. It
# over-reports only when a slot key that dmutex granted is deleted or
# shortened by someone else (the TypeScript library releasing or extending
# by token, a deletion by hand), and then for at most CHECK_MS: an acquire
# that finds the index full checks it against the slot keys if it was not
# checked that recently (H.full). A record of
# that name that dmutex did not write is neither read nor written. Scores
# are exact integers below 2^53: expiry_ms <= HORIZON and slot < SLOTS.
SLOTS = 1024
HORIZON = 2**53 // SLOTS - 1
# A full index is checked against the slot keys at most this often (ms): a
# permit the TypeScript library released or shortened (by token, without the
# index), or a slot key deleted by hand, is counted at most this long.
CHECK_MS = 250
if MAX_PERMITS > SLOTS:  # pragma: no cover - a guard on the two constants
    raise ImportError(f"the holders index scores fit {SLOTS} slots, not {MAX_PERMITS}")
_HOLDERS = f"""\
-- The index's helpers, made only by a script that names an index: a
-- mutex's scripts never pay for them.
local function index_helpers()
  local H, MARK, SLOTS, HORIZON = {{}}, 'dmutex:holders', {SLOTS}, {HORIZON}
  -- When the index was last checked against the slot keys, scored -ms: below
  -- every lease, so no count, range or pruning of leases ever sees it.
  local CHECKED, CHECK_MS = 'dmutex:checked', {CHECK_MS}
  function H.now_ms()
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  -- 1: dmutex's index; 0: absent, dmutex may create it; false: another's record.
  -- pcall: a record of another type answers an error (a table).
  function H.state(holders)
    local marked = redis.pcall('ZSCORE', holders, MARK)
    if type(marked) == 'string' then return 1 end
    if type(marked) == 'table' or redis.call('EXISTS', holders) == 1 then return false end
    return 0
  end
  -- The slot the index has for token, if any.
  function H.slot(holders, token)
    local mine = redis.call('ZSCORE', holders, token)
    return mine and tonumber(mine) % SLOTS
  end
  -- Scores from time now on: the active leases'.
  function H.from(now)
    return string.format('%d', now * SLOTS)
  end
  -- The latest expiry of a lease in it, or nil; the mark scores +inf.
  function H.latest(holders)
    local last = redis.call('ZREVRANGEBYSCORE', holders, '(+inf', '0', 'WITHSCORES', 'LIMIT', 0, 1)
    return last[2] and math.floor(tonumber(last[2]) / SLOTS)
  end
  -- Whether the index still counts n active leases once checked against the
  -- n slot keys KEYS[1..n], if it was not checked in the last CHECK_MS: a
  -- member whose slot key no longer holds its token is dropped.
  function H.full(holders, n, now)
    local checked = redis.call('ZSCORE', holders, CHECKED)
    if checked and now + tonumber(checked) < CHECK_MS then return true end
    local active = redis.call('ZRANGEBYSCORE', holders, H.from(now), '(+inf', 'WITHSCORES')
    for i = 1, #active, 2 do
      local at = tonumber(active[i + 1]) % SLOTS
      if at >= n or redis.call('GET', KEYS[at + 1]) ~= active[i] then
        redis.call('ZREM', holders, active[i])
      end
    end
    redis.call('ZADD', holders, string.format('%d', -now), CHECKED)
    H.settle(holders)
    return redis.call('ZCOUNT', holders, H.from(now), '(+inf') >= n
  end
  -- The earliest expiry of an active lease in it, from time now on.
  function H.earliest(holders, now)
    local first = redis.call('ZRANGEBYSCORE', holders, H.from(now), '(+inf',
      'WITHSCORES', 'LIMIT', 0, 1)
    return math.floor(tonumber(first[2]) / SLOTS)
  end
  -- The index lasts exactly as long as the latest lease in it: with none, it goes.
  function H.settle(holders)
    local ends = H.latest(holders)
    if ends then
      redis.call('PEXPIREAT', holders, string.format('%d', ends + 1))
    else
      redis.call('DEL', holders)
    end
  end
  -- Record (or move) token's expiry. ttl is the ARGV string.
  function H.note(holders, token, slot, ttl, fresh, now)
    local expires = math.min((now or H.now_ms()) + tonumber(ttl), HORIZON)
    local at = string.format('%d', expires * SLOTS + slot)
    if fresh then
      redis.call('ZADD', holders, '+inf', MARK, at, token)
    else
      redis.call('ZADD', holders, 'XX', at, token)
    end
    H.settle(holders)
  end
  return H
end
"""

# ARGV: token, ttl ms, then the extra records before any waiting keys:
# "fence" (the lock's fence counter), "holders" (the index above), both as
# "fence+holders", or "-"; then, for an attempt of a retrying acquire, the
# waiter's name, its registration window in ms ("0": do not register, the
# attempt is its last; "-1": an earlier attempt registered it recently
# enough, leave the records alone) and "1" if an earlier attempt registered
# it; the last two KEYS are then the waiters and signal records.
# Returns {position, fence[, expiry]}: the 0-based position of the key that
# holds the token (taken now, or by an earlier copy of this request) or -1
# when every key is held by another token; the grant's fence, 0 without a
# counter; and for a failed waiting attempt the time left on the lease in
# the way: a mutex's PTTL, the earliest expiry in a full index, else -1.
# A semaphore whose index counts max_permits active holders is full without
# a look at its slot keys; otherwise MGET reads every slot in one
# server-side call. SET NX, not SET, because MGET also answers nil for a key
# of another type, which is not free. Every record dmutex does not own stops
# the script before it writes: a counter value it did not write, or (only
# when registering) a waiters or signal record it did not write; GET, TYPE
# and ZSCORE raise WRONGTYPE or find no mark.
_ACQUIRE = (
    _HOLDERS
    + """\
local token, ttl, records, waiter = ARGV[1], ARGV[2], ARGV[3] or '-', ARGV[4]
local WAITERS, SIGNAL = 'dmutex:waiters', 'dmutex:signal'
-- The server's clock, read once (TIME) if at all: microseconds, milliseconds.
local micros
local function clock_us()
  if not micros then
    local t = redis.call('TIME')
    micros = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  return micros
end
local function clock_ms() return math.floor(clock_us() / 1000) end
local n, counter, holders, fence, waiters, signal = #KEYS, nil, nil, 0, nil, nil
if waiter then
  waiters, signal, n = KEYS[#KEYS - 1], KEYS[#KEYS], #KEYS - 2
end
if string.find(records, 'holders', 1, true) then holders, n = KEYS[n], n - 1 end
if string.find(records, 'fence', 1, true) then
  counter, n = KEYS[n], n - 1
  local stored = redis.call('GET', counter)
  if stored then
    fence = tonumber(string.match(stored, '^dmutex:fence:(%d+)$'))
    if not fence then
      return redis.error_reply('DMUTEX ' .. counter .. ' holds a value dmutex did not write')
    end
  end
end
-- Which waiting record, if any, dmutex did not write. pcall: a record of
-- another type answers an error (a table) instead of stopping the script.
local function foreign()
  local marked = redis.pcall('ZSCORE', waiters, WAITERS)
  if type(marked) == 'table' or (not marked and redis.call('EXISTS', waiters) == 1) then
    return waiters
  end
  local head = redis.pcall('LINDEX', signal, 0)
  if type(head) == 'table' or (head and head ~= SIGNAL) then return signal end
end
local H = holders and index_helpers()
local slot, taken, full, index, now = -1, false, false, H and H.state(holders), nil
if index == 1 then
  now = clock_ms()
  -- Full by the index, unless a copy of this request took the last permit.
  -- Not full: the slot keys' MGET below finds such a copy's grant.
  if redis.call('ZCOUNT', holders, H.from(now), '(+inf') >= n then
    local mine = H.slot(holders, token)
    if mine and mine < n and redis.call('GET', KEYS[mine + 1]) == token then
      slot = mine
    else
      full = H.full(holders, n, now)
    end
  end
end
if slot >= 0 or full then
  -- known from the index: a copy of this request took it, or all are held
elseif n == 1 then
  if redis.call('SET', KEYS[1], token, 'PX', ttl, 'NX') then
    slot, taken = 0, true
  elseif redis.call('GET', KEYS[1]) == token then
    slot = 0
  end
else
  local values = redis.call('MGET', unpack(KEYS, 1, n))
  for i = 1, n do
    if values[i] == token then slot = i - 1 break end
  end
  if slot < 0 then
    for i = 1, n do
      if not values[i] and redis.call('SET', KEYS[i], token, 'PX', ttl, 'NX') then
        slot, taken = i - 1, true
        break
      end
    end
  end
end
if slot >= 0 then
  if counter then
    -- dmutex._core.fences, rule 1: above the counter, and at least the
    -- server's clock in microseconds, so a lost counter restarts above it.
    fence = math.max(fence + 1, clock_us())
    redis.call('SET', counter, string.format('dmutex:fence:%d', fence))
  end
  -- index is 0 (absent: create it) or 1 here; false leaves another's record alone.
  if taken and index then
    now = now or clock_ms()
    redis.call('ZREMRANGEBYSCORE', holders, '0', '(' .. H.from(now))
    H.note(holders, token, slot, ttl, true, now)
  end
  -- Its own member, uniquely named: removing it never touches another's record.
  if waiter and ARGV[6] == '1' then redis.pcall('ZREM', waiters, waiter) end
  return {slot, fence}
end
if not waiter then return {-1, 0} end
local window = tonumber(ARGV[5])
local theirs = window >= 0 and foreign()
if theirs then
  return redis.error_reply('DMUTEX ' .. theirs .. ' holds a value dmutex did not write')
end
if window > 0 then
  local t = clock_ms()
  redis.call('ZREMRANGEBYSCORE', waiters, '-inf', string.format('(%d', t))
  redis.call('ZADD', waiters, '+inf', WAITERS, string.format('%d', t + window), waiter)
  if redis.call('PTTL', waiters) < window then redis.call('PEXPIRE', waiters, window) end
elseif window == 0 and ARGV[6] == '1' then
  redis.pcall('ZREM', waiters, waiter)
end
local left = -1
if n == 1 then
  left = redis.call('PTTL', KEYS[1])
elseif full then
  left = math.max(H.earliest(holders, now) - now, 0)
end
return {-1, 0, left}
"""
)
# How the client reports that answer (redis-py: ResponseError, the code kept).
_FOREIGN = "holds a value dmutex did not write"

# ARGV: token; then max_permits when the last two KEYS are the lock's
# waiters and signal records, "-" when not; then "holders" when the KEYS
# before those (or the last) is the index. Deletes the key that holds the
# token and returns 1, or 0; a slot the index names for the token is the one
# it checks, else every slot. A release that deleted a key wakes a waiter if
# one is registered: it pushes a signal, unless the signal list already holds
# one per registered waiter (or per permit), and gives the list the waiters
# record's expiry. Registrations of waiters that vanished count until a
# waiter's attempt prunes them (a needless signal, at worst). With no one
# waiting it writes nothing more (one ZSCORE read). It never fails after the
# DEL: a waiters or signal record that dmutex did not write is left alone.
_RELEASE = (
    _HOLDERS
    + """\
local token, permits = ARGV[1], tonumber(ARGV[2])
local WAITERS, SIGNAL = 'dmutex:waiters', 'dmutex:signal'
local n, done, holders, waiters, signal = #KEYS, 0, nil, nil, nil
if permits then waiters, signal, n = KEYS[n - 1], KEYS[n], n - 2 end
if ARGV[3] == 'holders' then holders, n = KEYS[n], n - 1 end
local H = holders and index_helpers()
local index = H and H.state(holders) == 1
local mine = index and n > 1 and H.slot(holders, token)
if n == 1 then
  if redis.call('GET', KEYS[1]) == token then done = redis.call('DEL', KEYS[1]) end
elseif mine then
  if mine < n and redis.call('GET', KEYS[mine + 1]) == token then
    done = redis.call('DEL', KEYS[mine + 1])
  end
else
  local values = redis.call('MGET', unpack(KEYS, 1, n))
  for i = 1, n do
    if values[i] == token then done = redis.call('DEL', KEYS[i]) break end
  end
end
-- Its own member: after this the token holds nothing.
if index and redis.call('ZREM', holders, token) == 1 then H.settle(holders) end
if done == 1 and permits then
  -- pcall: a record of another type answers an error (a table), and is left alone.
  local marked = redis.pcall('ZSCORE', waiters, WAITERS)
  if type(marked) == 'string' then
    local waiting = redis.call('ZCARD', waiters) - 1
    local head = redis.pcall('LINDEX', signal, 0)
    if waiting > 0 and (head == false or head == SIGNAL) then
      local left = redis.call('PTTL', waiters)
      local pending = head and (permits > 1 and redis.call('LLEN', signal) or 1) or 0
      if left > 0 and pending < math.min(waiting, permits) then
        redis.call('LPUSH', signal, SIGNAL)
        redis.call('PEXPIRE', signal, left)
      end
    end
  end
end
return done
"""
)

# ARGV: token, ttl ms, and "holders" when the last KEYS is the index. Sets
# the expiry of the key that holds the token to now + ttl, and the token's
# expiry in the index if it has one; returns 1, or 0.
_EXTEND = (
    _HOLDERS
    + """\
local token, ttl = ARGV[1], ARGV[2]
local n, holders = #KEYS, nil
if ARGV[3] == 'holders' then holders, n = KEYS[n], n - 1 end
local H = holders and index_helpers()
local mine = H and H.state(holders) == 1 and H.slot(holders, token)
local at = -1
if n == 1 then
  if redis.call('GET', KEYS[1]) == token then at = 1 end
elseif mine then
  if mine < n and redis.call('GET', KEYS[mine + 1]) == token then at = mine + 1 end
else
  local values = redis.call('MGET', unpack(KEYS, 1, n))
  for i = 1, n do
    if values[i] == token then at = i break end
  end
end
if at < 0 then return 0 end
redis.call('PEXPIRE', KEYS[at], ttl)
if mine then H.note(holders, token, mine, ttl, false) end
return 1
"""
)


@dataclass(frozen=True)
class _Script:
    text: str
    sha: str

    @classmethod
    def of(cls, text: str) -> _Script:
        # SHA-1 is how Redis names a cached script, not a security measure.
        return cls(text, hashlib.sha1(text.encode()).hexdigest())


# The renewal of many leases at once. KEYS: one slot key per lease, then the
# holders indexes of the semaphores among them; ARGV: per lease, its token,
# TTL ms and the position in KEYS of its index ("0": none). Sets the expiry
# of each key that still holds its token, and the token's expiry in its
# index; returns one 1 or 0 per lease, in order.
_RENEW = (
    _HOLDERS
    + """\
local done, ours, H = {}, {}, #KEYS > #ARGV / 3 and index_helpers()
for i = 1, #ARGV / 3 do
  local token, ttl, at = ARGV[3 * i - 2], ARGV[3 * i - 1], tonumber(ARGV[3 * i])
  if redis.call('GET', KEYS[i]) == token then
    done[i] = redis.call('PEXPIRE', KEYS[i], ttl)
    if at > 0 then
      if ours[at] == nil then ours[at] = H.state(KEYS[at]) == 1 end
      local mine = ours[at] and H.slot(KEYS[at], token)
      if mine then H.note(KEYS[at], token, mine, ttl, false) end
    end
  else
    done[i] = 0
  end
end
return done
"""
)

# What a lock's records hold, for ``dmutex status``; writes nothing. KEYS: slot
# keys of one group, then the fence counter if ARGV[1] is "1". Returns the
# server's time in ms, the counter's value (or nil), then slot position,
# token and PTTL of each slot key that holds a string.
_INSPECT = """\
local now = redis.call('TIME')
local slots = #KEYS - tonumber(ARGV[1])
local out = {tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000), false}
if slots < #KEYS then out[2] = redis.call('GET', KEYS[#KEYS]) end
for i = 1, slots do
  if redis.call('TYPE', KEYS[i]).ok == 'string' then
    local left = redis.call('PTTL', KEYS[i])
    if left ~= -2 then
      out[#out + 1] = i - 1
      out[#out + 1] = redis.call('GET', KEYS[i])
      out[#out + 1] = left
    end
  end
end
return out
"""

# How the acquire script stores a fence counter's value: this, then the number.
_FENCE_MARK = "dmutex:fence:"

ACQUIRE, RELEASE, EXTEND = _Script.of(_ACQUIRE), _Script.of(_RELEASE), _Script.of(_EXTEND)
RENEW, INSPECT = _Script.of(_RENEW), _Script.of(_INSPECT)
# At most this many leases per renewal request: a request of this size blocks
# the server for well under a millisecond.
RENEW_BATCH = 256


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


# --- blocking waits -------------------------------------------------------------------

# A wait shorter than this sleeps: BLPOP counts its timeout in milliseconds,
# and a timeout that rounds to 0 would block forever.
MIN_BLOCK = 0.002
# Seconds after which a waiter's failed attempt registers it again: well
# inside the registration's margin past its longest wait (REGISTRATION_MARGIN_MS).
REFRESH = 1.0
# A server ends a blocked command whose timeout passed on its next timer
# tick, every 1/hz seconds (hz 10 by default; 6.2, 7.0 and 7.4 alike): a
# BLPOP of 0.15 s returns after 0.2 s. A longer wait blocks this much less
# than it lasts, so that it still ends on time.
TICK = 0.1


class _Blockers:
    """How many blocking waits may hold connections of one pool at once.

    Half the pool's ``max_connections``, so that waiters never take the
    connections that a holder's release, or any other work, needs.
    """

    __slots__ = ("__weakref__", "_count", "_limit", "_lock")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._count = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        """Claim a connection for one blocking wait; False when the budget is spent."""
        with self._lock:
            if self._count >= self._limit:
                return False
            self._count += 1
            return True

    def give(self) -> None:
        """Return what :meth:`take` claimed."""
        with self._lock:
            self._count -= 1


_POOLS: weakref.WeakKeyDictionary[object, _Blockers] = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def _blocking(client: object) -> tuple[_Blockers, float] | None:
    """The budget and the longest single block for waits through ``client``; None: never block.

    Never on a client with one dedicated connection (redis-py's
    ``single_connection_client``): a blocked wait would hold the very
    connection that the holder's release needs. On a pool, half its
    ``max_connections`` (none below 2); a block lasts at most 0.8 of the
    pool's ``socket_timeout``, so that it ends before the socket gives up.
    """
    # redis.asyncio makes the one connection at the first command: the flag says it first.
    if getattr(client, "connection", None) is not None or (
        getattr(client, "single_connection_client", False) is True
    ):
        return None
    pool = getattr(client, "connection_pool", None)
    limit = getattr(pool, "max_connections", None)
    budget = limit // 2 if isinstance(limit, int) and not isinstance(limit, bool) else sys.maxsize
    if budget < 1:
        return None
    kwargs = getattr(pool, "connection_kwargs", None)
    timeout = kwargs.get("socket_timeout") if isinstance(kwargs, dict) else None
    cap = 0.8 * timeout if isinstance(timeout, (int, float)) and timeout > 0 else float("inf")
    if pool is None:
        return _Blockers(budget), cap
    with _POOLS_LOCK:
        try:
            blockers = _POOLS.get(pool)
            if blockers is None:
                blockers = _POOLS[pool] = _Blockers(budget)
        except TypeError:  # a pool that takes no weak reference: a budget per store
            blockers = _Blockers(budget)
    return blockers, cap


# --- the store ------------------------------------------------------------------------


class RedisStore:
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

    max_expiry_ms = MAX_EXPIRY_MS

    def __init__(
        self,
        client: object,
        prefix: str,
        max_permits: int,
        clock: Clock,
        *,
        fencing: bool | None = None,
    ) -> None:
        self._prefix = prefix
        self._permits = max_permits
        self._fencing = fencing
        self._cluster = is_cluster_client(client)
        # Detection checked the client's shape; pick its path once.
        self._execute: Callable[..., object] | None = None
        self._eval: Callable[..., object] | None = None
        if defines(client, "execute_command"):
            self._execute = method(client, "execute_command")
        else:
            self._eval = method(client, "eval")
        self._clock = clock
        # Waiters block (BLPOP) only where that is safe: a command client
        # on the system clock, with connections to spare.
        blocking = _blocking(client) if self._execute and isinstance(clock, SystemClock) else None
        self._blockers: _Blockers | None = None
        self._block_cap = 0.0
        if blocking is not None:
            self._blockers, self._block_cap = blocking

    @property
    def clock(self) -> Clock:
        return self._clock

    def _groups(self, key: str) -> list[list[str]]:
        """Every slot key of ``key``, in slot order, in groups one script may touch.

        One group, except on a cluster when the keys span hash slots: then
        one group per key.
        """
        names = [f"{self._prefix}permit:{slot}:{key}" for slot in range(self._permits)]
        if self._cluster and not same_hash_slot(names):
            return [[name] for name in names]
        return [names]

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

    def ready(self) -> Steps[None]:
        """Nothing to prepare: Redis needs no index."""
        yield from ()

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
        """The holders index of ``key`` (``_HOLDERS``), or None: a mutex, or no shared hash slot.

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
        groups = self._groups(key)
        counter = self._counter(key, groups)
        holders = None if self._permits == 1 else self._holders(key, groups)
        # The extra records, as KEYS and as ARGV names them.
        records: tuple[list[str], str]
        if holders is None:
            records = ([counter], "fence") if counter else ([], "-")
        else:
            records = ([counter, holders], "fence+holders") if counter else ([holders], "holders")
        wakes = self._wakes(key, groups) if waiter is not None else []
        return self._acquire(key, token, ttl_ms, groups, records, waiter if wakes else None, wakes)

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
        if waiter is not None:
            started = self._clock.monotonic()
            window = 0 if waiter.last else waiter.window_ms
            if window and waiter.registered and started - waiter.registered_at < REFRESH:
                window = -1  # registered a moment ago: no need to again
            registered = "1" if waiter.registered else "0"
            args = (token, ttl_ms, kinds, waiter.name, window, registered)
        first = 0
        for group in groups:
            keys = [*group, *extra, *wakes]
            try:
                reply = yield from self._run(ACQUIRE, keys, args)
            except Exception as error:
                said = str(error)
                if _FOREIGN in said:
                    name = said[said.find("DMUTEX ") + 7 : said.find(f" {_FOREIGN}")]
                    raise DMutexError(f"{name!r} {_FOREIGN}: dmutex leaves it alone") from error
                raise
            position, fence, left = _grant(reply, len(group) - 1)
            if position >= 0:
                if waiter is not None:
                    waiter.registered = False
                return Lease(key, token, first + position, expires, fence or None)
            first += len(group)
            if waiter is not None:
                waiter.registered = not waiter.last
                if window > 0:
                    waiter.registered_at = started
                waiter.expires_in = (left + 1) / 1000 if left >= 0 else None
        return None

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        """Block on ``key``'s signal list (``BLPOP``) for up to ``seconds``, else sleep.

        Blocks only when the last attempt registered ``waiter`` and a
        connection of the pool is to spare (see :class:`_Blockers`). A
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
        started = self._clock.monotonic()
        failed = False
        try:
            reply = yield Call(
                self._execute, ("BLPOP", f"{self._prefix}signal:{key}", f"{block:.3f}")
            )
        except Exception:  # noqa: BLE001 - the wait degrades to sleeping, rule 3 of waiting.py
            failed = True
        else:
            waiter.woken = reply is not None
        finally:
            blockers.give()
        rest = seconds - (self._clock.monotonic() - started)
        if failed and rest > 0:
            yield Sleep(rest)

    def _holder(
        self,
        script: _Script,
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
        for group in groups:
            keys = [*group, *after] if after else group
            if _as_int((yield from self._run(script, keys, args)), 0, 1) == 1:
                return True
        return False

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        """Delete the slot key that holds ``token`` and wake a waiter, in one atomic script."""
        return (yield from self._holder(RELEASE, key, slot, (token,), wake=True))

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
            if extra and isinstance(stored, str) and stored.startswith(_FENCE_MARK):
                fence = _as_int(stored[len(_FENCE_MARK) :], 0, 2**63 - 1)
            for at in range(2, len(reply), 3):
                position, token, left = reply[at : at + 3]
                expires = MAX_EXPIRY_MS if left == -1 else now + _as_int(left, 0, MAX_EXPIRY_MS)
                shown = token.decode() if isinstance(token, bytes) else str(token)
                found.append(Holder(first + _as_int(position, 0, len(group)), shown, expires))
            first += len(group)
        return Inspection(found, fence, now)

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
        reply = yield from self._run(RENEW, [*keys, *where], tuple(args))
        if not isinstance(reply, (list, tuple)) or len(reply) != len(chunk):
            raise DMutexError(f"unexpected reply from Redis: {reply!r}")
        return [e if _as_int(d, 0, 1) == 1 else None for d, e in zip(reply, expires, strict=True)]

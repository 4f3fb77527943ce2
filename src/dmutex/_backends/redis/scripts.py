"""The Lua scripts of the Redis store, one named constant each.

They sit in ``dmutex._backends.redis`` beside the stores that run them
(``store.py``; the ``RW_*`` ones, ``readwrite.py``); tests and benchmarks
import them from here.

Rules of the scripts:

1. Every script declares, in ``KEYS``, every key it touches, and builds no
   key name: what it touches is what the request declares, as Redis, ACL
   key patterns, proxies and clusters require.
2. A script writes only slot keys that are absent or hold the caller's own
   token, and dmutex's own records (each marked as dmutex's); a record it
   did not write stops it before it writes, or is left alone.
3. An acquire finds its own token first, so a re-sent copy answers with the
   lease the first took.
4. The holders index is a hint, never the truth: the slot keys are.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ..._validate import MAX_PERMITS

__all__ = [
    "ACQUIRE",
    "CHECK_MS",
    "EXTEND",
    "FENCE_MARK",
    "FOREIGN",
    "HORIZON",
    "INDEXED_ABOVE",
    "INSPECT",
    "MUTEX_ACQUIRE",
    "MUTEX_RELEASE",
    "RELEASE",
    "RENEW",
    "RENEW_BATCH",
    "RW_ACQUIRE",
    "RW_EXTEND",
    "RW_INSPECT",
    "RW_MARK",
    "RW_RELEASE",
    "RW_RENEW",
    "SLOTS",
    "Script",
]

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
# Only a semaphore of more permits than this keeps an index (issue 43). Below,
# reading every slot key (one MGET) costs less than the index's upkeep on each
# grant and release: on Redis 7.0, a cycle was 7-11% quicker without it from 2
# to 32 permits, and a full semaphore's refusal as quick by 32 and 5-11%
# slower from 64. A small semaphore's scripts neither read nor write the index,
# as the TypeScript library's do: the index may only under-report (rule 4), so
# a key's holders granted by a small semaphore are found in its slot keys by a
# large one of the same key (or an older dmutex) as the TypeScript library's
# are; a release or extend by token of one that a large semaphore granted
# over-reports for at most CHECK_MS, as the TypeScript library's does.
INDEXED_ABOVE = 32
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
# the way: a mutex's PTTL, the earliest expiry in a full index, a small
# semaphore's soonest slot key PTTL (no index: INDEXED_ABOVE), else -1.
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
elseif not holders then
  -- No index (a small semaphore): the soonest expiry of its slot keys.
  for i = 1, n do
    local t = redis.call('PTTL', KEYS[i])
    if t >= 0 and (left < 0 or t < left) then left = t end
  end
end
return {-1, 0, left}
"""
)
# How the client reports that answer (redis-py: ResponseError, the code kept).
FOREIGN = "holds a value dmutex did not write"

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


# The mutex's own pair: a lock of one permit, acquired by a call that does
# not wait (``acquire``, and the engine's re-sent copies), and released. No
# holders index, no waiter to register: none of the semaphore's work, and
# one integer back, the cheapest reply a client reads.
#
# MUTEX_ACQUIRE. KEYS: the slot key, then the fence counter if the lock
# keeps one. ARGV: token, ttl ms. Returns the grant's fence (1 without a
# counter), or 0 when another token holds the key. A key that holds the
# token already is this request's own grant, sent again (rule 3): it gets
# a new fence, above the one whose reply was lost. The counter is read
# only for a grant, so a refusal costs a SET NX and a GET; a counter
# dmutex did not write then undoes the SET NX this request made (nobody
# can see it: a script is atomic) and stops it (rule 2).
_MUTEX_ACQUIRE = """\
local token, counter = ARGV[1], KEYS[2]
local taken = redis.call('SET', KEYS[1], token, 'PX', ARGV[2], 'NX')
if not taken and redis.call('GET', KEYS[1]) ~= token then return 0 end
if not counter then return 1 end
local fence, stored = 0, redis.call('GET', counter)
if stored then
  fence = tonumber(string.match(stored, '^dmutex:fence:(%d+)$'))
  if not fence then
    if taken then redis.call('DEL', KEYS[1]) end
    return redis.error_reply('DMUTEX ' .. counter .. ' holds a value dmutex did not write')
  end
end
-- dmutex._core.fences, rule 1: above the counter, and at least the
-- server's clock in microseconds, so a lost counter restarts above it.
local t = redis.call('TIME')
fence = math.max(fence + 1, tonumber(t[1]) * 1000000 + tonumber(t[2]))
redis.call('SET', counter, string.format('dmutex:fence:%d', fence))
return fence
"""

# MUTEX_RELEASE. KEYS: the slot key, then the waiters and signal records
# when the lock's waiters are woken. ARGV: token. Deletes the slot key if
# it holds the token and returns 1, else 0. After a deletion it pushes a
# signal for a registered waiter unless one is already pending, as RELEASE
# does for one permit; a waiting record dmutex did not write is left alone.
_MUTEX_RELEASE = """\
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
local waiters, signal = KEYS[2], KEYS[3]
-- pcall: a record of another type answers an error (a table), and is left alone.
if waiters and type(redis.pcall('ZSCORE', waiters, 'dmutex:waiters')) == 'string'
    and redis.call('ZCARD', waiters) > 1 then
  local head = redis.pcall('LINDEX', signal, 0)
  local left = redis.call('PTTL', waiters)
  if head == false and left > 0 then
    redis.call('LPUSH', signal, 'dmutex:signal')
    redis.call('PEXPIRE', signal, left)
  end
end
return 1
"""


@dataclass(frozen=True)
class Script:
    """A script's text and the SHA-1 that ``EVALSHA`` names it by."""

    text: str
    sha: str

    @classmethod
    def of(cls, text: str) -> Script:
        """The script of ``text``, its SHA-1 computed once."""
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
# token and time left of each slot key that holds a string. The time left is
# taken from PEXPIRETIME where the server has it (7.0+): PTTL counts from the
# script's frozen clock, TIME from the running one, and their sum would move
# an unchanged lease's expiry by a millisecond from one read to the next.
_INSPECT = """\
local now = redis.call('TIME')
local slots = #KEYS - tonumber(ARGV[1])
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local out = {now_ms, false}
if slots < #KEYS then out[2] = redis.call('GET', KEYS[#KEYS]) end
for i = 1, slots do
  if redis.call('TYPE', KEYS[i]).ok == 'string' then
    local left = redis.call('PTTL', KEYS[i])
    local at = redis.pcall('PEXPIRETIME', KEYS[i])
    if type(at) == 'number' and at >= 0 and left >= 0 then left = math.max(at - now_ms, 0) end
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
FENCE_MARK = "dmutex:fence:"

ACQUIRE, RELEASE, EXTEND = Script.of(_ACQUIRE), Script.of(_RELEASE), Script.of(_EXTEND)
MUTEX_ACQUIRE, MUTEX_RELEASE = Script.of(_MUTEX_ACQUIRE), Script.of(_MUTEX_RELEASE)
RENEW, INSPECT = Script.of(_RENEW), Script.of(_INSPECT)
# At most this many leases per renewal request: a request of this size blocks
# the server for well under a millisecond.
RENEW_BATCH = 256


# --- Read-write locks (``readwrite.py``) ---------------------------------------------
#
# One hash per lock, KEYS[1] of each script: the field ``kind`` holds RW_MARK;
# ``w:<token>``, ``r:<token>`` and ``i:<token>`` a writer's, a reader's and a
# waiting writer's intent's expiry (epoch ms, the server's clock); ``fence``
# the last fence. A hold or intent whose expiry is past counts for nothing and
# is dropped by the next script that writes; the hash expires (PEXPIREAT) with
# its latest hold or intent, and is deleted when none is left. A key of that
# name that is not a hash holding the mark stops every script before it
# writes (rule 2). The decisions follow ``dmutex._core.readwrite`` rule by
# rule. Numbers are Lua doubles: epoch ms and fences (epoch µs) are exact far
# beyond any date dmutex stores.
RW_MARK = "dmutex:rwlock"
_RW_HELPERS = f"""\
local MARK, WAITERS, SIGNAL = '{RW_MARK}', 'dmutex:waiters', 'dmutex:signal'
-- The server's clock (TIME), in microseconds and milliseconds.
local function clock()
  local t = redis.call('TIME')
  local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  return us, math.floor(us / 1000)
end
local function ms(value) return string.format('%d', value) end
local function foreign(name)
  return redis.error_reply('DMUTEX ' .. name .. ' {FOREIGN}')
end
-- Whether hash is dmutex's lock (true), absent (false), or a record dmutex
-- did not write (nil). pcall: a record of another type answers an error (a table).
local function marked(hash)
  local kind = redis.pcall('HGET', hash, 'kind')
  if kind == MARK then return true end
  if kind == false and redis.call('EXISTS', hash) == 0 then return false end
  return nil
end
-- The lock's state at now: its writer, readers (and their count) and
-- intents by token, each with its expiry, its fence, the expired fields
-- (dead) and whether the hash is absent; nil for a record dmutex did not write.
local function load(hash, now)
  local ours = marked(hash)
  if ours == nil then return nil end
  local s = {{readers = {{}}, count = 0, intents = {{}}, fence = 0, dead = {{}}, absent = not ours}}
  if not ours then return s end
  local fields = redis.call('HGETALL', hash)
  for i = 1, #fields, 2 do
    local name, value = fields[i], fields[i + 1]
    local head, token = string.sub(name, 1, 2), string.sub(name, 3)
    if name == 'fence' then
      s.fence = tonumber(value) or 0
    elseif head == 'w:' or head == 'r:' or head == 'i:' then
      local ends = tonumber(value) or 0
      if ends <= now then
        s.dead[#s.dead + 1] = name
      elseif head == 'w:' then
        s.writer, s.writer_ends = token, ends
      elseif head == 'r:' then
        s.readers[token], s.count = ends, s.count + 1
      else
        s.intents[token] = ends
      end
    end
  end
  return s
end
-- Drop the expired fields (rule 1), a thousand per HDEL.
local function prune(hash, s)
  for i = 1, #s.dead, 1000 do
    redis.call('HDEL', hash, unpack(s.dead, i, math.min(i + 999, #s.dead)))
  end
end
-- The hash lasts as long as its latest hold or intent; with none left it
-- goes, its fence with it (dmutex._core.fences, rule 2: TIME keeps fences rising).
local function settle(hash, s)
  local last = s.writer_ends or 0
  for _, ends in pairs(s.readers) do if ends > last then last = ends end end
  for _, ends in pairs(s.intents) do if ends > last then last = ends end end
  if last > 0 then
    redis.call('PEXPIREAT', hash, ms(last))
  elseif not s.absent then
    redis.call('DEL', hash)
  end
end
-- Wake every waiter registered on the lock (KEYS[2], its signal list
-- KEYS[3]): one signal per live registration, less those pending. Readers
-- and writers share the list, and BLPOP cannot choose who pops: all try,
-- and the attempts decide. A waiting record dmutex did not write is left alone.
local function wake(now)
  local waiters, signal = KEYS[2], KEYS[3]
  if not waiters or type(redis.pcall('ZSCORE', waiters, WAITERS)) ~= 'string' then return end
  redis.call('ZREMRANGEBYSCORE', waiters, '-inf', '(' .. ms(now))
  local head = redis.pcall('LINDEX', signal, 0)
  local left = redis.call('PTTL', waiters)
  if left <= 0 or not (head == false or head == SIGNAL) then return end
  local missing = redis.call('ZCARD', waiters) - 1 - (head and redis.call('LLEN', signal) or 0)
  if missing < 1 then return end
  while missing > 0 do
    local batch = {{}}
    for i = 1, math.min(missing, 1000) do batch[i] = SIGNAL end
    redis.call('LPUSH', signal, unpack(batch))
    missing = missing - #batch
  end
  redis.call('PEXPIRE', signal, left)
end
"""

# RW_ACQUIRE. KEYS: the hash, then the waiting records (waiters, signal) for
# an attempt of a retrying acquire whose waiter can be woken. ARGV: token,
# ttl ms, "write" or "read", max readers ("0": no bound), "1" to take a
# fence, the intent ms (a writer's refused attempt leaves its intent this
# long; "0": it leaves none, and withdraws one it left); then, with the
# waiting records, the waiter's name, its registration window and "1" if an
# earlier attempt registered it (as ACQUIRE's). Returns {1, fence} (fence 0
# without fencing) or {0, ms until what refused it lapses at the latest}.
# It decides before it writes, so that a record dmutex did not write (the
# hash, or a waiting record it would register in) stops it with nothing
# changed. A writer that withdraws its intent, and was the last, wakes the
# waiters: the readers it held back may enter.
_RW_ACQUIRE = (
    _RW_HELPERS
    + """\
local hash, token, ttl, write = KEYS[1], ARGV[1], tonumber(ARGV[2]), ARGV[3] == 'write'
local most, fencing, intent = tonumber(ARGV[4]), ARGV[5] == '1', tonumber(ARGV[6])
local waiter, window, registered = ARGV[7], tonumber(ARGV[8] or '0'), ARGV[9] == '1'
local us, now = clock()
local s = load(hash, now)
if not s then return foreign(hash) end
local had = s.intents[token] ~= nil
-- The decision (rules 1-2): clears is when what refuses the attempt lapses
-- at the latest; nil grants it.
local clears
if write then
  if s.writer ~= token and (s.writer or s.count > 0) then
    clears = s.writer_ends or 0
    for _, ends in pairs(s.readers) do if ends > clears then clears = ends end end
  end
elseif not s.readers[token] then
  if s.writer then
    clears = s.writer_ends
  else
    for other, ends in pairs(s.intents) do
      if other ~= token and (not clears or ends < clears) then clears = ends end
    end
    if not clears and most > 0 and s.count >= most then
      for _, ends in pairs(s.readers) do if not clears or ends < clears then clears = ends end end
    end
  end
end
if clears and waiter and window >= 0 then
  local marked = redis.pcall('ZSCORE', KEYS[2], WAITERS)
  if type(marked) == 'table' or (not marked and redis.call('EXISTS', KEYS[2]) == 1) then
    return foreign(KEYS[2])
  end
  local head = redis.pcall('LINDEX', KEYS[3], 0)
  if type(head) == 'table' or (head and head ~= SIGNAL) then return foreign(KEYS[3]) end
end
prune(hash, s)
local changed = #s.dead > 0
if write and clears and intent > 0 then
  s.intents[token] = now + intent
  redis.call('HSET', hash, 'i:' .. token, ms(now + intent))
  changed = true
elseif had and write then
  s.intents[token] = nil
  redis.call('HDEL', hash, 'i:' .. token)
  changed = true
end
if not clears then
  -- Rules 3-4: a hold of this token already (a re-sent grant) is granted
  -- again, its expiry set anew, with a new fence.
  local ends = now + ttl
  local fields = {(write and 'w:' or 'r:') .. token, ms(ends)}
  if write then
    s.writer, s.writer_ends = token, ends
  else
    s.readers[token] = ends
  end
  if s.absent then fields[#fields + 1], fields[#fields + 2] = 'kind', MARK end
  local fence = 0
  if fencing then
    -- dmutex._core.fences, rule 1: above the counter, at least TIME in µs.
    fence = math.max(s.fence + 1, us)
    fields[#fields + 1], fields[#fields + 2] = 'fence', ms(fence)
  end
  redis.call('HSET', hash, unpack(fields))
  settle(hash, s)
  -- Its own member, uniquely named: removing it never touches another's record.
  if waiter and registered then redis.pcall('ZREM', KEYS[2], waiter) end
  return {1, fence}
end
if changed then settle(hash, s) end
if had and not s.intents[token] and not s.writer and next(s.intents) == nil then wake(now) end
if waiter and window > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ms(now))
  redis.call('ZADD', KEYS[2], '+inf', WAITERS, ms(now + window), waiter)
  if redis.call('PTTL', KEYS[2]) < window then redis.call('PEXPIRE', KEYS[2], window) end
elseif waiter and window == 0 and registered then
  redis.pcall('ZREM', KEYS[2], waiter)
end
return {0, clears - now}
"""
)

# RW_RELEASE. KEYS: the hash, then the waiting records when the lock's
# waiters are woken. ARGV: token, max readers ("0": no bound). Ends the
# token's hold and its intent (rule 5); returns 1 if a hold was active, else
# 0. Wakes the waiters when that may let someone in: a writer's release; a
# reader's that leaves no reader, or frees a place under max readers; a
# withdrawn intent that was the last.
_RW_RELEASE = (
    _RW_HELPERS
    + """\
local hash, token, most = KEYS[1], ARGV[1], tonumber(ARGV[2])
local _, now = clock()
local s = load(hash, now)
if not s then return foreign(hash) end
if s.absent then return 0 end
prune(hash, s)
local changed, done, woken = #s.dead > 0, 0, false
local had = s.intents[token] ~= nil
if had then
  s.intents[token], changed = nil, true
  redis.call('HDEL', hash, 'i:' .. token)
end
if s.writer == token then
  s.writer, s.writer_ends, done, woken = nil, nil, 1, true
  redis.call('HDEL', hash, 'w:' .. token)
elseif s.readers[token] then
  s.readers[token], s.count, done = nil, s.count - 1, 1
  redis.call('HDEL', hash, 'r:' .. token)
  woken = s.count == 0 or s.count == most - 1
end
if had and not s.writer and next(s.intents) == nil then woken = true end
if changed or done == 1 then settle(hash, s) end
if woken then wake(now) end
return done
"""
)

# The extend of one hold, for RW_EXTEND and RW_RENEW: 1 if token's active
# hold of the kind slot names ("0" writer, "1" reader, "-" either) now ends
# at now + ttl, 0 if there is none, -1 for a hash dmutex did not write.
_RW_EXTEND_ONE = """\
local function extend(hash, token, slot, ttl, now)
  local s = load(hash, now)
  if not s then return -1 end
  if s.absent then return 0 end
  prune(hash, s)
  local ends, field = now + ttl, nil
  if slot ~= '1' and s.writer == token then
    s.writer_ends, field = ends, 'w:' .. token
  elseif slot ~= '0' and s.readers[token] then
    s.readers[token], field = ends, 'r:' .. token
  end
  if field then redis.call('HSET', hash, field, ms(ends)) end
  if field or #s.dead > 0 then settle(hash, s) end
  return field and 1 or 0
end
"""

# RW_EXTEND. KEYS: the hash. ARGV: token, slot ("0", "1" or "-"), ttl ms.
# Returns 1 or 0 (rule 5: an active hold's expiry only).
_RW_EXTEND = (
    _RW_HELPERS
    + _RW_EXTEND_ONE
    + """\
local _, now = clock()
local done = extend(KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3]), now)
if done < 0 then return foreign(KEYS[1]) end
return done
"""
)

# RW_RENEW, many holds at once. KEYS: the hashes, each once. ARGV: per
# hold, the position in KEYS of its hash, its token, slot and ttl ms.
# Returns per hold 1, 0, or -1 for a hash dmutex did not write (that hold's
# answer is the error; the others go on).
_RW_RENEW = (
    _RW_HELPERS
    + _RW_EXTEND_ONE
    + """\
local _, now = clock()
local done = {}
for i = 1, #ARGV / 4 do
  local at, ttl = tonumber(ARGV[4 * i - 3]), tonumber(ARGV[4 * i])
  done[i] = extend(KEYS[at], ARGV[4 * i - 2], ARGV[4 * i - 1], ttl, now)
end
return done
"""
)

# RW_INSPECT, for ``dmutex status`` and tests; writes nothing. KEYS: the
# hash. Returns the server's time in ms, then the hash's fields and values
# (HGETALL), none when it is absent.
_RW_INSPECT = (
    _RW_HELPERS
    + """\
local _, now = clock()
local ours = marked(KEYS[1])
if ours == nil then return foreign(KEYS[1]) end
local out = {now}
if ours then
  for _, value in ipairs(redis.call('HGETALL', KEYS[1])) do out[#out + 1] = value end
end
return out
"""
)

RW_ACQUIRE, RW_RELEASE = Script.of(_RW_ACQUIRE), Script.of(_RW_RELEASE)
RW_EXTEND, RW_RENEW = Script.of(_RW_EXTEND), Script.of(_RW_RENEW)
RW_INSPECT = Script.of(_RW_INSPECT)

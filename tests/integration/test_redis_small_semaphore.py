"""A small semaphore on real servers: its slot keys and nothing else (issue 43).

A semaphore of at most ``INDEXED_ABOVE`` (32) permits keeps no holders index
(``{prefix}holders:{key}``, ``test_redis_holders.py``): its acquire reads
every slot key with one ``MGET`` and takes a free one with ``SET NX``, its
release and extend by handle touch the one slot key and by token read them
all with one ``MGET``, as the TypeScript library's semaphore does. What must
hold on each server version:

- no index record is written, nor named in any request, at any point of an
  acquire, a full refusal, a waiting refusal, an extend, a renewal or a
  release: the key space holds the slot keys, the fence counter and, while
  someone waits, the waiting records;
- an uncontended acquire and release is ten server commands, one ``MGET``
  more than a mutex's cycle, and fewer than an indexed semaphore's;
- on one key, a large semaphore (indexed) and a small one share the slot
  keys: neither grants a permit the other holds, and a permit the small one
  releases by token that the large one granted (the index still counting it)
  is the large one's to grant again once its index's check window passed;
- an index record at the small semaphore's index name (a large semaphore's,
  or someone else's) is neither read nor changed by it;
- a refused waiting attempt learns the soonest expiry among the slot keys.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis

from dmutex import DMutex, DSemaphore, DSemaphorePermit, ManualClock
from dmutex._backends.redis import RedisStore
from dmutex._backends.redis.scripts import CHECK_MS, INDEXED_ABOVE
from dmutex._clock import SYSTEM_CLOCK
from dmutex._core.waiting import waiter
from dmutex._runtime.drivers import SyncDriver
from tests._support.redis_clients import slot_key
from tests._support.sampling import until
from tests.integration.test_redis_holders_typescript import check_age_ms

KEY = "api"
PREFIX = "_dsemaphore_svc:"
HOLDERS = f"{PREFIX}holders:{KEY}"
FENCE = f"{PREFIX}fence:{KEY}"
WAITING = {f"{PREFIX}waiters:{KEY}", f"{PREFIX}signal:{KEY}"}
LARGE = INDEXED_ABOVE + 1  # the smallest semaphore that keeps an index
TTL = 60.0


def taken(permit: DSemaphorePermit | None) -> DSemaphorePermit:
    assert permit is not None, "expected the permit to be granted"
    return permit


def slot_keys(permits: int) -> list[str]:
    return [slot_key(slot) for slot in range(permits)]


def waiting_attempt(server: redis.Redis, permits: int) -> float | None:
    """One refused attempt of a waiting acquire: what it learnt of the soonest expiry (s)."""
    store = RedisStore(server, PREFIX, permits, SYSTEM_CLOCK)
    made = waiter(0.1)
    drive = SyncDriver(SYSTEM_CLOCK, store.ready)
    assert drive(store.acquire(KEY, str(uuid.uuid4()), 60_000, made)) is None
    return made.expires_in


@contextmanager
def monitored(redis_url: str) -> Iterator[list[str]]:
    """Every command the server ran while the block ran (``MONITOR``), filled in after it."""
    seen: list[str] = []
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        monitor = client.monitor()
        with monitor:
            yield seen
            client.echo("done")
            while (command := str(monitor.next_command()["command"])) != "ECHO done":
                seen.append(command)


# --- no index, ever -----------------------------------------------------------------------


@pytest.mark.parametrize("permits", [3, INDEXED_ABOVE])
def test_a_small_semaphore_writes_no_index_at_any_point(
    redis_url: str, server: redis.Redis, permits: int
) -> None:
    allowed = {*slot_keys(permits), FENCE, *WAITING}

    def only_its_own_records() -> None:
        found = set(server.keys("*"))
        assert found <= allowed, f"unexpected: {found - allowed}"

    with monitored(redis_url) as commands:
        clock = ManualClock()
        renewing = DSemaphore("svc", server, max_permits=permits, clock=clock)
        renewed = taken(renewing.acquire(KEY, TTL, auto_renew=True))
        only_its_own_records()
        sem = DSemaphore("svc", server, max_permits=permits)
        handles = []
        for _ in range(permits - 1):
            handles.append(taken(sem.acquire(KEY, TTL)))
            only_its_own_records()
        assert sem.acquire(KEY, TTL) is None, "full"
        only_its_own_records()
        assert waiting_attempt(server, permits) is not None, "refused, told the soonest expiry"
        assert server.exists(f"{PREFIX}waiters:{KEY}") == 1, "the waiter registered"
        only_its_own_records()
        assert handles[0].extend(30) is True
        assert sem.extend(KEY, handles[-1].token, 30) is True
        only_its_own_records()
        server.pexpire(slot_key(renewed.slot), 30_000)  # so that the renewal shows
        clock.advance(TTL / 3)  # the renewal's turn
        assert server.pttl(slot_key(renewed.slot)) > 50_000, "renewed"
        assert renewed.lost is False
        only_its_own_records()
        assert handles[0].release() is True
        only_its_own_records()
        assert sem.release(KEY, handles[-1].token) is True
        only_its_own_records()
        assert renewed.release() is True
        for handle in handles[1:-1]:
            assert handle.release() is True
        assert set(server.keys("*")) <= {FENCE, *WAITING}, "every slot key gone"
    assert commands, "MONITOR showed the requests"
    assert not [command for command in commands if HOLDERS in command], "the index never named"


def command_calls(admin: redis.Redis) -> Counter[str]:
    """``calls`` per command from ``INFO commandstats`` (a script's own commands included)."""
    info: dict[str, dict[str, int]] = admin.info("commandstats")
    return Counter({name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in info.items()})


def cycle(admin: redis.Redis, lock: DSemaphore | DMutex, key: str) -> tuple[Counter[str], ...]:
    """The server's commands for one uncontended acquire, and for its release (INFO left out)."""
    before = command_calls(admin)
    handle = lock.acquire(key, TTL)
    granted = command_calls(admin)
    assert handle is not None
    assert handle.release() is True
    after = command_calls(admin)
    spent = granted - before, after - granted
    for counted in spent:
        del counted["info"]
    return spent


# EVALSHA; the fence counter's GET; one MGET of every slot key; the free one's
# SET NX; the server's TIME (the fence is at least its microseconds); the counter's SET.
SMALL_ACQUIRE = {"evalsha": 1, "get": 1, "mget": 1, "set": 2, "time": 1}
# EVALSHA; GET of the handle's own slot key; its DEL; one ZSCORE: does anyone wait?
RELEASE = {"evalsha": 1, "get": 1, "del": 1, "zscore": 1}


@pytest.mark.parametrize("permits", [3, INDEXED_ABOVE])
def test_a_small_semaphore_s_cycle_is_ten_commands(redis_url: str, permits: int) -> None:
    """Issue 43's target: at most 10 server commands per fenced acquire and release.

    Counted by ``INFO commandstats``, which counts each command a script runs.
    The same on every version, and whatever the small semaphore's size: one
    ``MGET`` more than a mutex's cycle (9), and half an indexed semaphore's (20).
    """
    with redis.Redis.from_url(redis_url) as admin:
        small = DSemaphore("svc", admin, max_permits=permits)
        mutex = DMutex("svc", admin)
        indexed = DSemaphore("svc", admin, max_permits=LARGE)
        for lock in (small, mutex, indexed):
            cycle(admin, lock, "warm-up")  # the scripts cached: EVALSHA answered
        for _ in range(3):
            acquire, release = cycle(admin, small, KEY)
            assert acquire == SMALL_ACQUIRE
            assert release == RELEASE
            assert sum(acquire.values()) + sum(release.values()) == 10
        mutex_acquire, mutex_release = cycle(admin, mutex, "job")
        assert mutex_acquire + Counter(mget=1) == SMALL_ACQUIRE, "the mutex's, and one MGET"
        assert mutex_release == RELEASE
        indexed_acquire, indexed_release = cycle(admin, indexed, "big")
        assert sum(indexed_acquire.values()) == 12, "grant, then the index made and settled"
        assert sum(indexed_release.values()) == 8, "release, then the index's ZREM and DEL"
        small_cycle = sum(acquire.values()) + sum(release.values())
        assert small_cycle < sum(indexed_acquire.values()) + sum(indexed_release.values())
        assert admin.keys("*holders*") == [], "the indexed semaphore's went with its lease"


# --- a large and a small semaphore on one key ---------------------------------------------


def test_permits_a_small_semaphore_holds_are_never_granted_by_a_large_one(
    server: redis.Redis,
) -> None:
    small = DSemaphore("svc", server, max_permits=3)
    large = DSemaphore("svc", server, max_permits=LARGE)
    mine = [taken(small.acquire(KEY, TTL)) for _ in range(3)]
    assert [p.slot for p in mine] == [0, 1, 2]
    assert server.exists(HOLDERS) == 0
    theirs = [taken(large.acquire(KEY, TTL)) for _ in range(LARGE - 3)]
    assert sorted(p.slot for p in theirs) == list(range(3, LARGE)), "only the other slots"
    for _ in range(2):
        assert large.acquire(KEY, TTL) is None, "full: the small one holds the rest"
    assert [server.get(key) for key in slot_keys(3)] == [p.token for p in mine], "untouched"
    members = set(server.zrange(HOLDERS, 0, -1))
    assert members >= {p.token for p in theirs}
    assert not members & {p.token for p in mine}, "the index never saw the small one's"
    assert server.exists(*slot_keys(LARGE)) == LARGE, "never more than max_permits"
    # A permit the small one releases is found free at once: the large one reads the slot keys.
    assert mine[1].release() is True
    again = taken(large.acquire(KEY, TTL))
    assert again.slot == 1
    assert small.acquire(KEY, TTL) is None, "the large one holds slot 1 now"


def test_permits_a_large_semaphore_holds_keep_a_small_one_out(server: redis.Redis) -> None:
    large = DSemaphore("svc", server, max_permits=LARGE)
    small = DSemaphore("svc", server, max_permits=3)
    theirs = [taken(large.acquire(KEY, TTL)) for _ in range(4)]
    assert [p.slot for p in theirs] == [0, 1, 2, 3]
    assert small.acquire(KEY, TTL) is None, "slots 0..2 are the large one's"
    assert server.get(slot_key(3)) == theirs[3].token
    # Slot 3 is out of the small one's reach: by token it reads slots 0..2 only.
    assert small.release(KEY, theirs[3].token) is False
    assert small.extend(KEY, theirs[3].token, 5) is False
    assert server.get(slot_key(3)) == theirs[3].token
    assert server.pttl(slot_key(3)) > 50_000
    assert theirs[0].release() is True
    mine = taken(small.acquire(KEY, TTL))
    assert mine.slot == 0
    assert [server.get(key) for key in slot_keys(4)] == [
        mine.token,
        *(p.token for p in theirs[1:]),
    ]


def held_slots(server: redis.Redis) -> int:
    return int(server.exists(*slot_keys(LARGE)))


def granted_again(server: redis.Redis, large: DSemaphore) -> DSemaphorePermit:
    """The large semaphore's first grant, once a slot its index still counts is free.

    Each refusal must come while the index's last check is younger than
    CHECK_MS (server time, read before the attempt): the first attempt after
    that checks the index against the slot keys and grants the free slot.
    """
    again: list[DSemaphorePermit] = []

    def granted() -> bool:
        age = check_age_ms(server)
        permit = large.acquire(KEY, TTL)
        if permit is None:
            assert age < CHECK_MS, f"refused {age} ms after the index's last check"
            return False
        again.append(permit)
        return True

    until(granted, "the freed permit granted again", 5)
    return again[0]


def test_a_permit_a_small_semaphore_frees_by_token_is_granted_again_by_a_large_one(
    server: redis.Redis,
) -> None:
    """The large one's index over-reports it, for the index's check window at most."""
    large = DSemaphore("svc", server, max_permits=LARGE)
    small = DSemaphore("svc", server, max_permits=3)
    theirs = [taken(large.acquire(KEY, TTL)) for _ in range(LARGE)]
    assert large.acquire(KEY, TTL) is None  # full, and the index now checked
    assert small.release(KEY, theirs[1].token) is True
    assert server.exists(slot_key(1)) == 0
    assert server.zscore(HOLDERS, theirs[1].token) is not None, "still counted by the index"
    assert granted_again(server, large).slot == 1
    assert server.zscore(HOLDERS, theirs[1].token) is None, "the check dropped it"
    assert held_slots(server) == LARGE, "never more than max_permits"

    # Shortened by token through the small one: granted again once its key expired.
    assert small.extend(KEY, theirs[2].token, 0.05) is True
    assert 0 < server.pttl(slot_key(2)) <= 50
    assert server.zscore(HOLDERS, theirs[2].token) is not None, "its old expiry in the index"
    until(lambda: not server.exists(slot_key(2)), "the shortened permit's key expired", 5)
    assert granted_again(server, large).slot == 2
    assert held_slots(server) == LARGE, "never more than max_permits"


# --- an index record at the small semaphore's key --------------------------------------------


@pytest.mark.parametrize("kind", ["a large semaphore's", "string", "list", "zset without the mark"])
def test_an_index_record_is_neither_read_nor_changed_by_a_small_semaphore(
    redis_url: str, server: redis.Redis, kind: str
) -> None:
    """Its dump and expiry stay as they were, and no request of the small one names it."""
    first = 0
    if kind == "a large semaphore's":
        large = DSemaphore("svc", server, max_permits=LARGE)
        assert taken(large.acquire(KEY, 90)).slot == 0
        assert server.zcard(HOLDERS) == 2, "its mark and its token"
        first = 1
    elif kind == "string":
        server.set(HOLDERS, "a token", px=90_000)
    elif kind == "list":
        server.rpush(HOLDERS, "x")
        server.pexpire(HOLDERS, 90_000)
    else:
        server.zadd(HOLDERS, {"someone": 1.0})
        server.pexpire(HOLDERS, 90_000)
    before = server.dump(HOLDERS)
    with monitored(redis_url) as commands:
        clock = ManualClock()
        sem = DSemaphore("svc", server, max_permits=3, clock=clock)
        handles = [taken(sem.acquire(KEY, TTL, auto_renew=True)) for _ in range(first, 3)]
        assert [h.slot for h in handles] == list(range(first, 3))
        assert sem.acquire(KEY, TTL) is None
        assert waiting_attempt(server, 3) is not None
        assert handles[0].extend(30) is True
        assert sem.extend(KEY, handles[-1].token, 30) is True
        clock.advance(TTL / 3)  # renewed
        assert not any(h.lost for h in handles)
        assert handles[0].release() is True
        assert sem.release(KEY, handles[-1].token) is True
        assert sem.release(KEY, str(uuid.uuid4())) is False
        permit = taken(sem.acquire(KEY, TTL))
        assert permit.extend(30) is True
        assert permit.release() is True
    assert not [command for command in commands if HOLDERS in command], "never named"
    assert server.dump(HOLDERS) == before
    assert 80_000 < server.pttl(HOLDERS) <= 90_001


# --- what a waiter learns ---------------------------------------------------------------------


@pytest.mark.parametrize("permits", [3, INDEXED_ABOVE])
def test_a_waiter_of_a_full_small_semaphore_learns_the_soonest_expiry(
    server: redis.Redis, permits: int
) -> None:
    """No index to ask: the refused attempt reads its slot keys' PTTLs (rule 2)."""
    sem = DSemaphore("svc", server, max_permits=permits)
    ttls = [60.0] * (permits - 2) + [20.0, 40.0]
    for ttl in ttls:
        taken(sem.acquire(KEY, ttl))
    expires_in = waiting_attempt(server, permits)
    assert expires_in is not None
    assert 19 < expires_in <= 20.001
    assert server.exists(HOLDERS) == 0


def test_slot_keys_without_an_expiry_tell_a_waiter_nothing(server: redis.Redis) -> None:
    """A slot key someone set without ``PX`` is skipped; with none that expires, no answer."""
    server.set(slot_key(0), "set by hand")
    server.set(slot_key(1), str(uuid.uuid4()), px=45_000)
    server.set(slot_key(2), str(uuid.uuid4()), px=30_000)
    expires_in = waiting_attempt(server, 3)
    assert expires_in is not None
    assert 29 < expires_in <= 30.001
    server.persist(slot_key(1))
    server.persist(slot_key(2))
    assert waiting_attempt(server, 3) is None

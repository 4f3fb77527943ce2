"""A semaphore's holders index on real servers: a hint that is never trusted for safety.

The index (``{prefix}holders:{key}``, see ``_HOLDERS`` in the Redis store)
lets a full semaphore, and a release or extend by token, skip reading every
slot key. Only a semaphore of more than ``INDEXED_ABOVE`` (32) permits keeps
one: a smaller one reads its slot keys with one ``MGET`` and neither reads
nor writes an index (``test_redis_small_semaphore.py``). So these tests use
``PERMITS``, the smallest semaphore that keeps one, or a larger one. They
pin down what the index may and may not do: it may under-report (holders it
never saw), and then the slot keys decide; a record of that name that dmutex
did not write is never used nor changed; and where it over-reports (a slot
key deleted by hand, or released by the TypeScript library), the first
acquire that finds it full after its check window checks it against the
slot keys.
"""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from dmutex import MAX_PERMITS, DSemaphore
from dmutex._backends.redis import RedisStore
from dmutex._backends.redis.scripts import ACQUIRE, INDEXED_ABOVE
from dmutex._clock import SYSTEM_CLOCK
from dmutex._core.fences import US_PER_S, next_fence
from dmutex._core.waiting import waiter
from dmutex._runtime.drivers import SyncDriver
from tests._support.redis_clients import Recording, slot_key
from tests._support.sampling import until

HOLDERS = "_dsemaphore_svc:holders:api"
MARK = "dmutex:holders"
PERMITS = INDEXED_ABOVE + 1  # the smallest semaphore that keeps an index


def held(sem: DSemaphore, count: int, ttl: float = 60) -> list[str]:
    """Take ``count`` permits of ``"api"``; their tokens."""
    tokens = []
    for _ in range(count):
        permit = sem.acquire("api", ttl)
        assert permit is not None
        tokens.append(permit.token)
    return tokens


def test_only_a_semaphore_above_the_threshold_keeps_an_index(server: redis.Redis) -> None:
    """The sizes these tests rely on: ``PERMITS`` writes an index, one permit fewer does not."""
    small = DSemaphore("svc", server, max_permits=INDEXED_ABOVE)
    assert small.acquire("api") is not None
    assert server.exists(HOLDERS) == 0
    large = DSemaphore("svc", server, max_permits=PERMITS)
    assert large.acquire("api") is not None
    assert server.zcard(HOLDERS) == 2, "the mark and the large semaphore's token"


def test_holders_the_index_never_saw_are_found_in_the_slot_keys(server: redis.Redis) -> None:
    """Permits the TypeScript library took are not in the index: the slot keys decide."""
    sem = DSemaphore("svc", server, max_permits=PERMITS)
    mine = held(sem, 1)
    theirs = [str(uuid.uuid4()) for _ in range(PERMITS - 1)]
    with server.pipeline(transaction=False) as pipe:
        for slot, token in enumerate(theirs, start=1):
            pipe.set(slot_key(slot), token, px=60_000, nx=True)
        assert all(pipe.execute())
    assert server.zcard(HOLDERS) == 2, "the mark and the one token dmutex granted"
    assert sem.acquire("api") is None, "full, though the index counts one holder"
    assert sem.extend("api", theirs[0], 30) is True
    assert 0 < server.pttl(slot_key(1)) <= 30_000
    assert sem.release("api", theirs[-1]) is True
    assert server.get(slot_key(PERMITS - 1)) is None
    again = sem.acquire("api")
    assert again is not None
    assert again.slot == PERMITS - 1
    assert sem.release("api", mine[0]) is True


@pytest.mark.parametrize("kind", ["string", "list", "zset without the mark"])
def test_a_record_dmutex_did_not_write_at_the_index_name_is_left_alone(
    server: redis.Redis, kind: str
) -> None:
    """``_dsemaphore_svc:holders:api`` may hold anything someone stored there.

    (No other namespace of dmutex's names it: ``check_redis_prefix``.) The
    semaphore still works, by its slot keys; the record keeps its value and expiry.
    """
    if kind == "string":
        server.set(HOLDERS, "a token", px=90_000)
    elif kind == "list":
        server.rpush(HOLDERS, "x")
        server.pexpire(HOLDERS, 90_000)
    else:
        server.zadd(HOLDERS, {"someone": 1.0})
        server.pexpire(HOLDERS, 90_000)
    before = server.dump(HOLDERS)
    sem = DSemaphore("svc", server, max_permits=PERMITS)
    tokens = held(sem, PERMITS)
    assert sem.acquire("api") is None
    assert sem.extend("api", tokens[0], 30) is True
    assert sem.release("api", tokens[1]) is True
    permit = sem.acquire("api")
    assert permit is not None
    assert permit.extend(30) is True
    assert permit.release() is True
    assert server.dump(HOLDERS) == before
    assert 80_000 < server.pttl(HOLDERS) <= 90_000


def test_a_lease_that_expires_leaves_the_index_and_its_slot_is_taken(server: redis.Redis) -> None:
    sem = DSemaphore("svc", server, max_permits=PERMITS)
    held(sem, PERMITS - 1)
    short = sem.acquire("api", 0.05)
    assert short is not None
    assert sem.acquire("api") is None
    until(lambda: sem.acquire("api") is not None, "the expired permit's slot is free", 5)
    # The grant pruned the expired token from the index.
    members = server.zrange(HOLDERS, 0, -1)
    assert short.token not in members
    assert len(members) == 2 + PERMITS, "the mark, the full refusal's check stamp, the holders"
    assert "dmutex:checked" in members


def test_the_index_lasts_as_long_as_its_latest_lease(server: redis.Redis) -> None:
    sem = DSemaphore("svc", server, max_permits=PERMITS)
    long, short = sem.acquire("api", 60), sem.acquire("api", 5)
    assert long is not None
    assert short is not None
    assert 59_000 < server.pttl(HOLDERS) <= 60_001
    assert long.release() is True
    assert 4_000 < server.pttl(HOLDERS) <= 5_001, "now the short lease's expiry"
    assert short.extend(20) is True
    assert 19_000 < server.pttl(HOLDERS) <= 20_001
    assert short.release() is True
    assert server.exists(HOLDERS) == 0


def test_the_index_stays_as_small_as_the_semaphore(server: redis.Redis) -> None:
    """Each grant prunes the expired tokens, so leases that expire leave nothing behind."""
    sem = DSemaphore("svc", server, max_permits=PERMITS)
    for _ in range(10):  # without the pruning: 10 rounds' tokens, far above the bound
        tokens = held(sem, PERMITS)
        with server.pipeline(transaction=False) as pipe:
            for slot, token in enumerate(tokens):
                pipe.pexpireat(slot_key(slot), 1)
                # As the expiry would leave them: scored in the past.
                pipe.zadd(HOLDERS, {token: 1024 + slot}, xx=True)
            pipe.execute()
    assert server.zcard(HOLDERS) <= 1 + PERMITS + PERMITS


def test_a_re_sent_acquire_finds_its_own_grant_in_a_full_index(redis_url: str) -> None:
    """The reply of an acquire that took the last permit is lost; the client sends it again."""
    with redis.Redis.from_url(redis_url) as client:
        recording = Recording(client)
        sem = DSemaphore("svc", recording, max_permits=PERMITS)
        held(sem, PERMITS - 1)
        last = sem.acquire("api")
        assert last is not None
        command = recording.commands[-1]
        assert command[1] in (ACQUIRE.sha, ACQUIRE.text)
        assert HOLDERS in command, "the acquire named the index"
        before = int(time.time() * US_PER_S)
        again = client.execute_command(*command)
        after = int(time.time() * US_PER_S)
        assert int(again[0]) == last.slot, "the same permit, not a second one"
        # A copy counts a fence of its own, above every grant before it: the counter plus
        # one, or the server's clock in microseconds (this host's, within a second).
        assert last.fence is not None
        fence = int(again[1])
        assert next_fence(last.fence, before - US_PER_S) <= fence
        assert fence <= next_fence(last.fence, after + US_PER_S)
        assert client.get("_dsemaphore_svc:fence:api") == f"dmutex:fence:{fence}".encode()
        assert sem.acquire("api") is None


def test_a_slot_key_deleted_by_hand_is_found_when_the_full_index_is_checked(
    server: redis.Redis,
) -> None:
    """The index over-reports a holder removed behind its back, for CHECK_MS at most.

    Here it was never checked, so the first acquire that finds it full checks
    it against the slot keys, drops the deleted holder and takes its slot.
    (tests/integration/test_redis_holders_typescript.py times the window.)
    """
    sem = DSemaphore("svc", server, max_permits=PERMITS)
    tokens = held(sem, PERMITS)
    server.delete(slot_key(0))
    permit = sem.acquire("api")
    assert permit is not None
    assert permit.slot == 0
    assert tokens[0] not in server.zrange(HOLDERS, 0, -1), "the deleted holder left the index"


def test_a_lease_past_the_index_horizon_still_counts(server: redis.Redis) -> None:
    """Expiries past 2^43 ms (the year 2248) are stored rounded down to it: still ahead."""
    sem = DSemaphore("svc", server, max_permits=PERMITS)
    tokens = held(sem, PERMITS, ttl=300 * 365 * 86_400)
    score = server.zscore(HOLDERS, tokens[-1])
    assert score == (2**43 - 1) * 1024 + PERMITS - 1
    assert sem.acquire("api") is None
    assert sem.release("api", tokens[-1]) is True


def test_max_permits_slots_fit_the_score(server: redis.Redis) -> None:
    """The last slot of the largest semaphore is the score's lowest ten bits."""
    sem = DSemaphore("svc", server, max_permits=MAX_PERMITS)
    for slot in range(MAX_PERMITS - 1):
        server.set(slot_key(slot), "theirs", px=60_000)
    token = held(sem, 1)[0]
    score = server.zscore(HOLDERS, token)
    assert score is not None
    assert int(score) % 1024 == MAX_PERMITS - 1
    assert sem.extend("api", token, 30) is True
    assert sem.release("api", token) is True
    assert server.exists(HOLDERS) == 0, "gone with the last lease dmutex granted"


def test_a_waiter_of_a_full_semaphore_learns_the_earliest_expiry(server: redis.Redis) -> None:
    """The index gives a waiting attempt the time left on the first lease to end (rule 2)."""
    sem = DSemaphore("svc", server, max_permits=PERMITS)
    held(sem, PERMITS - 1, ttl=60)
    held(sem, 1, ttl=20)
    store = RedisStore(server, "_dsemaphore_svc:", PERMITS, SYSTEM_CLOCK)
    made = waiter(0.1)
    drive = SyncDriver(SYSTEM_CLOCK, store.ready)
    assert drive(store.acquire("api", str(uuid.uuid4()), 60_000, made)) is None
    assert made.expires_in is not None
    assert 19 < made.expires_in <= 20.001
    assert server.zscore(HOLDERS, "dmutex:checked") is not None, "answered by the full index"

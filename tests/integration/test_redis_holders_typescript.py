"""The TypeScript library frees a permit that dmutex granted: the holders index catches up.

The TypeScript library releases and extends by token on the slot keys alone:
it knows nothing of dmutex's holders index (``{prefix}holders:{key}``). So a
permit it releases, or shortens, is still counted there. An acquire that
finds the index full checks it against the slot keys when it was not checked
in the last ``CHECK_MS`` (250 ms), and drops what no slot key holds. What
must hold on a real Redis server:

- a permit released the TypeScript way (``GET`` then ``DEL`` of the slot key
  by token, its release script's effect) is granted again by dmutex at the
  first acquire after the check window, never more than ``CHECK_MS`` late,
  and at once when the index was not checked before;
- a permit shortened the TypeScript way (``PEXPIRE`` of its slot key) is
  granted once its key expires, within ``CHECK_MS`` of that;
- nothing is ever over-granted: at most ``max_permits`` slot keys exist;
- a full semaphore whose index was just checked answers from the index
  alone: no slot key is read (the cost the index exists to save).

Only a semaphore of more than ``INDEXED_ABOVE`` (32) permits keeps an index,
so these tests fill one of ``INDEXED_ABOVE + 1``. A smaller one has no index
to fall behind: it reads its slot keys, as the TypeScript library does
(``test_redis_small_semaphore.py``).
"""

from __future__ import annotations

import redis

from dmutex import DSemaphore
from dmutex._backends.redis.scripts import CHECK_MS, INDEXED_ABOVE
from tests._support.redis_clients import slot_key
from tests._support.sampling import until

KEY = "api"
PREFIX = "_dsemaphore_svc:"
HOLDERS = f"{PREFIX}holders:{KEY}"
PERMITS = INDEXED_ABOVE + 1  # the smallest semaphore that keeps an index


def full_semaphore(server: redis.Redis) -> tuple[DSemaphore, list[str]]:
    sem = DSemaphore("svc", server, max_permits=PERMITS)
    tokens = []
    for _ in range(PERMITS):
        permit = sem.acquire(KEY, 60)
        assert permit is not None
        tokens.append(permit.token)
    return sem, tokens


def typescript_release(server: redis.Redis, slot: int, token: str) -> None:
    """What the TypeScript library's release does: delete the slot key if it holds the token."""
    assert server.get(slot_key(slot)) == token
    assert server.delete(slot_key(slot)) == 1


def held_slots(server: redis.Redis) -> int:
    """How many of the semaphore's slot keys exist (one EXISTS counts them all)."""
    return int(server.exists(*(slot_key(slot) for slot in range(PERMITS))))


def test_a_permit_the_typescript_library_released_is_granted_again(server: redis.Redis) -> None:
    sem, tokens = full_semaphore(server)
    typescript_release(server, 1, tokens[1])
    assert server.zscore(HOLDERS, tokens[1]) is not None, "still counted by the index"
    permit = sem.acquire(KEY, 60)
    assert permit is not None, "the index was never checked: the first full answer checks it"
    assert permit.slot == 1
    assert held_slots(server) == PERMITS


def check_age_ms(server: redis.Redis) -> int:
    """How long ago (server time) the index was last checked against the slot keys."""
    seconds, micros = server.time()
    checked = server.zscore(HOLDERS, "dmutex:checked")
    assert checked is not None, "the index was checked"
    return seconds * 1000 + micros // 1000 + int(checked)  # the stamp scores -ms


def wait_for_check_window(server: redis.Redis) -> None:
    """Until the last check is CHECK_MS old: an acquire that finds the index full checks it."""
    until(lambda: check_age_ms(server) >= CHECK_MS, "the check window passed", 5)


def test_a_wrong_refusal_lasts_at_most_the_check_window(server: redis.Redis) -> None:
    sem, tokens = full_semaphore(server)
    assert sem.acquire(KEY, 60) is None  # full, and the index now checked
    typescript_release(server, 0, tokens[0])
    wait_for_check_window(server)
    permit = sem.acquire(KEY, 60)
    assert permit is not None, "the first acquire after the window checks the index"
    assert permit.slot == 0
    assert held_slots(server) == PERMITS, "never more than max_permits"


def test_a_permit_the_typescript_library_shortened_is_granted_when_it_expires(
    server: redis.Redis,
) -> None:
    sem, tokens = full_semaphore(server)
    assert sem.acquire(KEY, 60) is None  # checked
    assert server.get(slot_key(2)) == tokens[2]
    assert server.pexpire(slot_key(2), 100)  # the TypeScript extend: PEXPIRE, nothing else
    until(lambda: not server.exists(slot_key(2)), "the shortened permit's key expired", 5)
    wait_for_check_window(server)
    permit = sem.acquire(KEY, 60)
    assert permit is not None
    assert permit.slot == 2
    assert held_slots(server) == PERMITS


def gets(server: redis.Redis) -> int:
    stats = server.info("commandstats").get("cmdstat_get", {})
    assert isinstance(stats, dict)
    return int(stats.get("calls", 0))


def test_a_checked_full_index_answers_without_reading_the_slot_keys(server: redis.Redis) -> None:
    sem, _ = full_semaphore(server)
    assert sem.acquire(KEY, 60) is None  # checks the index: one GET per slot key
    fresh: list[int] = []
    for _ in range(5):  # a slow machine may let the window pass between two calls
        before = gets(server)
        assert sem.acquire(KEY, 60) is None
        read = gets(server) - before
        if check_age_ms(server) < CHECK_MS:
            fresh.append(read)
    assert fresh, "no two acquires within one check window"
    # One GET each: the fence counter's, read before anything is written.
    assert set(fresh) == {1}, "no slot key read while the check is fresh"

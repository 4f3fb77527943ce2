"""The TypeScript dmutex's Redis layout, byte for byte, on real servers (spec section 6).

A fence counter holds ``dmutex:fence:<n>``, ``n`` the last grant's fence: the
larger of the counter plus one and the server's ``TIME`` in microseconds
(``dmutex._core.fences``). The servers run on this host, so their clock is
this process's, within ``CLOCK_SLACK_US``.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from dmutex import DMutex, DMutexError, DSemaphore
from dmutex._backends.redis.scripts import (
    ACQUIRE,
    EXTEND,
    INDEXED_ABOVE,
    MUTEX_ACQUIRE,
    MUTEX_RELEASE,
    RELEASE,
)
from dmutex._core.fences import US_PER_S
from tests._support.redis_clients import Recording

CLOCK_SLACK_US = US_PER_S


@pytest.fixture
def recording(redis_url: str) -> Iterator[Recording]:
    with redis.Redis.from_url(redis_url) as client:
        yield Recording(client)


def stored(server: redis.Redis) -> dict[str, str]:
    """Every string key and its value (the client decodes replies to str)."""
    return {
        str(name): str(server.get(name))
        for name in server.keys("*")
        if server.type(name) == "string"
    }


def now_us() -> int:
    return int(time.time() * US_PER_S)


def check_fences(fences: list[int | None], before_us: int, after_us: int) -> list[int]:
    """Fences of grants made one after another between the two readings: each strictly
    above the one before, and taken from the server's clock."""
    assert all(fence is not None for fence in fences)
    taken = [fence for fence in fences if fence is not None]
    assert taken == sorted(set(taken)), f"not strictly increasing: {taken}"
    assert before_us - CLOCK_SLACK_US <= taken[0]
    assert taken[-1] <= after_us + CLOCK_SLACK_US
    return taken


def counter_value(fence: int) -> str:
    """What a counter holds after a grant of ``fence`` (positive): ``dmutex:fence:<digits>``."""
    assert fence > 0
    return f"dmutex:fence:{fence}"


def index(server: redis.Redis, name: str) -> dict[str, float]:
    """A semaphore's holders index: each token's score, and the mark at +inf."""
    assert server.type(name) == "zset"
    members = [str(member) for member in server.zrange(name, 0, -1)]
    return {member: float(server.zscore(name, member) or 0) for member in members}


@pytest.mark.parametrize("permits", [3, INDEXED_ABOVE + 1], ids=["small", "indexed"])
@pytest.mark.parametrize("fencing", [None, False])
def test_semaphore_and_mutex_leave_exactly_the_typescript_keys(
    server: redis.Redis, recording: Recording, fencing: bool | None, permits: int
) -> None:
    """The TypeScript slot keys, and one fence counter per lock (none with fencing=False),
    holding the lock's last fence. A semaphore of at most ``INDEXED_ABOVE`` permits
    leaves nothing else; a larger one also its holders index, and nothing more."""
    before = now_us()
    sem = DSemaphore("orders", recording, max_permits=permits, fencing=fencing)
    permits_held = [sem.acquire("api", ttl=60) for _ in range(permits)]
    lock = DMutex("orders", recording, fencing=fencing).acquire("job", ttl=60)
    after = now_us()
    assert lock is not None
    assert all(p is not None for p in permits_held)
    tokens = [p.token for p in permits_held if p is not None]
    slots = {f"_dsemaphore_orders:permit:{slot}:api": token for slot, token in enumerate(tokens)}
    slots["_dmutex_orders:permit:0:job"] = lock.token
    counters = ["_dsemaphore_orders:fence:api", "_dmutex_orders:fence:job"]
    fences = [p.fence for p in permits_held if p is not None]
    if fencing is False:
        assert [*fences, lock.fence] == [None] * (permits + 1)
        assert stored(server) == slots
    else:
        api = check_fences(fences, before, after)
        (job,) = check_fences([lock.fence], before, after)
        values = [counter_value(api[-1]), counter_value(job)]
        assert stored(server) == {**slots, **dict(zip(counters, values, strict=True))}
    for name in slots:
        assert 59_000 < server.pttl(name) <= 60_000
    for name in counters:
        assert server.pttl(name) == (-2 if fencing is False else -1), "counters never expire"
    holders = "_dsemaphore_orders:holders:api"
    if permits <= INDEXED_ABOVE:
        # Exactly what the TypeScript library leaves: its strings, no record beside them.
        assert set(server.keys("*")) == set(stored(server))
        assert not any(holders in command for command in recording.commands), "never named"
        return
    # The semaphore's holders index: its mark, and each token scored by the
    # slot and the expiry (in server milliseconds); it expires with them.
    scores = index(server, holders)
    assert scores.pop("dmutex:holders") == math.inf
    assert sorted(scores) == sorted(tokens)
    now_ms = int(server.time()[0]) * 1000
    for slot, token in enumerate(tokens):
        expiry, slot_of = divmod(int(scores[token]), 1024)
        assert slot_of == slot
        assert now_ms + 58_000 < expiry <= now_ms + 61_000
    assert 59_000 < server.pttl(holders) <= 60_000
    assert set(server.keys("*")) == {*stored(server), holders}, "the index, and nothing more"


def test_ttl_is_sent_as_px_milliseconds_rounded_up(recording: Recording) -> None:
    lock = DMutex("svc", recording).acquire("job", ttl=12.3451)
    assert lock is not None
    name, sha, *rest = recording.commands[-1]
    # EVALSHA, or EVAL with the script's text where the server had not cached it yet.
    assert (name, sha) in {("EVALSHA", MUTEX_ACQUIRE.sha), ("EVAL", MUTEX_ACQUIRE.text)}
    counter = "_dmutex_svc:fence:job"
    assert rest == [2, "_dmutex_svc:permit:0:job", counter, lock.token, math.ceil(12345.1)]
    for permits in (2, INDEXED_ABOVE + 1):
        sem = DSemaphore("svc", recording, max_permits=permits)
        permit = sem.acquire("api", ttl=0.0005)
        assert permit is not None
        name, sha, *rest = recording.commands[-1]
        assert (name, sha) in {("EVALSHA", ACQUIRE.sha), ("EVAL", ACQUIRE.text)}
        # Every slot key declared, in slot order, and the counter (then the holders
        # index, above INDEXED_ABOVE permits); then the token, PX and the records' names.
        keys = [f"_dsemaphore_svc:permit:{slot}:api" for slot in range(permits)]
        records = ["_dsemaphore_svc:fence:api"]
        if permits > INDEXED_ABOVE:
            records.append("_dsemaphore_svc:holders:api")
        kinds = "fence+holders" if permits > INDEXED_ABOVE else "fence"
        assert rest == [len(keys) + len(records), *keys, *records, permit.token, 1, kinds]


def test_key_prefix_replaces_the_default(server: redis.Redis) -> None:
    with redis.Redis.from_url(_url(server)) as client:
        before = now_us()
        lock = DMutex("svc", client, key_prefix="app:locks:").acquire("job")
        after = now_us()
        assert lock is not None
        (fence,) = check_fences([lock.fence], before, after)
        assert stored(server) == {
            "app:locks:permit:0:job": lock.token,
            "app:locks:fence:job": counter_value(fence),
        }


def _url(server: redis.Redis) -> str:
    kwargs = server.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}/{kwargs.get('db', 0)}"


def test_a_lock_written_by_the_typescript_library_is_honoured(server: redis.Redis) -> None:
    """What the TypeScript dmutex writes (SET key token PX ttl NX) guards Python too."""
    theirs = str(uuid.uuid4())
    assert server.set("_dsemaphore_svc:permit:0:api", theirs, px=60_000, nx=True)
    with redis.Redis.from_url(_url(server)) as client:
        sem = DSemaphore("svc", client, max_permits=2)
        mine = sem.acquire("api")
        assert mine is not None
        assert mine.slot == 1, "slot 0 is the TypeScript holder's"
        assert sem.acquire("api") is None
        assert sem.extend("api", theirs, 5) is True
        assert 0 < server.pttl("_dsemaphore_svc:permit:0:api") <= 5_000
        assert sem.release("api", theirs) is True
        assert server.get("_dsemaphore_svc:permit:0:api") is None
        assert server.get("_dsemaphore_svc:permit:1:api") == mine.token


def test_the_server_expires_the_lease(server: redis.Redis) -> None:
    """A lease ends when Redis expires its key; the old handle is then refused."""
    with redis.Redis.from_url(_url(server)) as client:
        mutex = DMutex("svc", client)
        old = mutex.acquire("job", ttl=0.05)
        assert old is not None
        assert mutex.acquire("job") is None
        deadline = time.monotonic() + 5
        new = None
        while new is None and time.monotonic() < deadline:
            time.sleep(0.01)
            new = mutex.acquire("job", ttl=60)
        assert new is not None, "the server never expired the 50 ms lease"
        assert old.release() is False
        assert old.extend() is False
        assert server.get("_dmutex_svc:permit:0:job") == new.token


def test_no_write_touches_a_name_outside_the_lock_s_slot_keys(server: redis.Redis) -> None:
    """Key prefixes are free-form, so one service's names can be another's slot keys.

    ``DSemaphore("s")`` on lock ``"permit:0:job"`` once wrote a hint record at
    ``_dsemaphore_s:hint:permit:0:job``, which is slot 0 of ``DSemaphore("s:hint")``'s
    lock ``"job"``, overwriting that holder's token. dmutex now writes slot keys
    only: the other service's record keeps its token and its expiry.
    """
    with redis.Redis.from_url(_url(server)) as client:
        theirs = DSemaphore("s:hint", client, max_permits=1)
        held = theirs.acquire("job", ttl=60)
        assert held is not None
        name = "_dsemaphore_s:hint:permit:0:job"
        assert server.get(name) == held.token
        mine = DSemaphore("s", client, max_permits=2)
        for _ in range(20):
            permits = [mine.acquire("permit:0:job") for _ in range(2)]
            assert all(p is not None for p in permits)
            assert all(p.release() for p in permits if p is not None)
            assert mine.release("permit:0:job", str(uuid.uuid4())) is False
        assert server.get(name) == held.token
        assert 0 < server.pttl(name) <= 60_000
        assert theirs.acquire("job") is None, "still held: no second holder got in"
        counters = ["_dsemaphore_s:fence:permit:0:job", "_dsemaphore_s:hint:fence:job"]
        # No holders index: a semaphore of 2 permits keeps none (INDEXED_ABOVE).
        assert sorted(server.keys("*")) == sorted([name, *counters])


@pytest.mark.parametrize("foreign", ["5", "dmutex:fence:x", "a token", "list"])
def test_a_fence_counter_name_holding_another_value_is_never_written(
    server: redis.Redis, foreign: str
) -> None:
    """Lock ``"permit:0:job"`` of ``DSemaphore("s")`` counts fences at
    ``_dsemaphore_s:fence:permit:0:job``, where someone else may have stored a value:
    a token, as slot 0 of ``DSemaphore("s:fence")``'s lock ``"job"`` would hold (a
    service name refused now, ``check_redis_prefix``, but a server may keep what an
    earlier version wrote). The acquire raises, and writes nothing: no slot taken,
    the other value unchanged.
    """
    name = "_dsemaphore_s:fence:permit:0:job"
    with redis.Redis.from_url(_url(server)) as client:
        if foreign == "a token":
            foreign = str(uuid.uuid4())
            server.set(name, foreign, px=60_000)
        elif foreign == "list":
            server.rpush(name, "x")
        else:
            server.set(name, foreign)
        before = server.dump(name)
        mine = DSemaphore("s", client, max_permits=2)
        refusals = (DMutexError, redis.ResponseError)
        with pytest.raises(refusals, match=r"dmutex did not write|WRONGTYPE"):
            mine.acquire("permit:0:job")
        assert server.dump(name) == before
        assert server.keys("_dsemaphore_s:permit:*") == []
        unfenced = DSemaphore("s", client, max_permits=2, fencing=False)
        assert unfenced.acquire("permit:0:job") is not None, "fencing=False never reads it"


def _touched(command: str) -> list[str]:
    """The keys a command a script ran touches (MONITOR's text; the test keys have no spaces)."""
    name, *args = [part.strip('"') for part in command.split(" ")]
    if name.upper() == "MGET":
        return args
    if name.upper() == "TIME":
        return []
    return args[:1]


def test_every_key_a_script_touches_is_declared(redis_url: str) -> None:
    """MONITOR shows each command a script runs: its keys are among the request's KEYS.

    Redis documents that a script must declare every key it touches; clusters,
    proxies, ACL key patterns and stricter Redis-compatible servers rely on it.
    A small semaphore, a mutex, and a semaphore that keeps a holders index
    (``INDEXED_ABOVE`` + 1 permits, filled so that its full index is checked).
    """
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        for script in (ACQUIRE, RELEASE, EXTEND, MUTEX_ACQUIRE, MUTEX_RELEASE):
            client.script_load(script.text)  # EVALSHA only: MONITOR quotes a script's text
        monitor = client.monitor()
        with monitor:
            sem = DSemaphore("svc", client, max_permits=3)
            mutex = DMutex("svc", client)
            indexed = DSemaphore("svc", client, max_permits=INDEXED_ABOVE + 1)
            # One acquire more than the permits, refused (the indexed one's full index checked).
            asks = ((sem, "api", 3), (mutex, "api", 3), (indexed, "big", INDEXED_ABOVE + 2))
            for lock, key, count in asks:
                handles = [lock.acquire(key) for _ in range(count)]
                for handle in handles:
                    if handle is not None:
                        assert handle.extend(5) is True
                        assert handle.release() is True
            for each, key in ((sem, "api"), (indexed, "big")):
                permit = each.acquire(key)
                assert permit is not None
                assert each.extend(key, permit.token, 5) is True
                assert each.release(key, permit.token) is True
                assert each.release(key, permit.token) is False
            client.echo("done")
            declared: set[str] = set()
            scripted = 0
            touched: set[str] = set()
            while True:
                seen = monitor.next_command()
                command: str = seen["command"]
                if command == "ECHO done":
                    break
                parts = command.split(" ")
                if parts[0] in ("EVALSHA", "EVAL"):
                    declared = set(parts[3 : 3 + int(parts[2])])
                elif seen.get("client_type") == "lua":
                    scripted += 1
                    keys = _touched(command)
                    assert keys or command == "TIME", command
                    assert set(keys) <= declared, f"{command!r} touches an undeclared key"
                    touched.update(keys)
    assert scripted >= 20, "MONITOR showed the commands the scripts ran"
    assert "_dsemaphore_svc:holders:big" in touched, "the indexed semaphore's index"
    assert "_dsemaphore_svc:holders:api" not in touched, "the small one keeps none"

"""The TypeScript dmutex's Redis layout, byte for byte, on real servers (spec section 6)."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis

from dmutex import DMutex, DSemaphore, RedisArg, RedisReply
from dmutex._backends.redis import ACQUIRE


class Recording:
    """A redis-py client that records the arguments of every command."""

    def __init__(self, inner: redis.Redis) -> None:
        # redis-py leaves execute_command unannotated; this is its sync signature.
        self._send: Callable[..., RedisReply] = inner.execute_command
        self.commands: list[tuple[RedisArg, ...]] = []

    def execute_command(self, *args: RedisArg) -> RedisReply:
        self.commands.append(args)
        return self._send(*args)


@pytest.fixture
def server(redis_url: str) -> Iterator[redis.Redis]:
    """A sync client reading strings, on an empty database."""
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        yield client


@pytest.fixture
def recording(redis_url: str) -> Iterator[Recording]:
    with redis.Redis.from_url(redis_url) as client:
        yield Recording(client)


def stored(server: redis.Redis) -> dict[str, str]:
    """Every key and its value (the client decodes replies to str)."""
    return {str(name): str(server.get(name)) for name in server.keys("*")}


def test_semaphore_and_mutex_leave_exactly_the_typescript_keys(
    server: redis.Redis, recording: Recording
) -> None:
    sem = DSemaphore("orders", recording, max_permits=3)
    permits = [sem.acquire("api", ttl=60) for _ in range(3)]
    lock = DMutex("orders", recording).acquire("job", ttl=60)
    assert lock is not None
    assert all(p is not None for p in permits)
    tokens = [p.token for p in permits if p is not None]
    assert stored(server) == {
        "_dsemaphore_orders:permit:0:api": tokens[0],
        "_dsemaphore_orders:permit:1:api": tokens[1],
        "_dsemaphore_orders:permit:2:api": tokens[2],
        "_dmutex_orders:permit:0:job": lock.token,
        # Beside them, not in their place: where the next acquire starts looking.
        "_dsemaphore_orders:hint:api": "0",
    }
    for name in server.keys("*"):
        assert 59_000 < server.pttl(name) <= 60_000


def test_ttl_is_sent_as_px_milliseconds_rounded_up(recording: Recording) -> None:
    lock = DMutex("svc", recording).acquire("job", ttl=12.3451)
    assert lock is not None
    assert recording.commands == [
        ("SET", "_dmutex_svc:permit:0:job", lock.token, "PX", math.ceil(12345.1), "NX")
    ]
    sem = DSemaphore("svc", recording, max_permits=2)
    permit = sem.acquire("api", ttl=0.0005)
    assert permit is not None
    name, sha, numkeys, *rest = recording.commands[-1]
    # EVALSHA, or EVAL with the script's text where the server had not cached it yet.
    assert (name, sha) in {("EVALSHA", ACQUIRE.sha), ("EVAL", ACQUIRE.text)}
    # On a single server the script builds the slot key names from the prefix.
    assert (numkeys, rest) == (0, [permit.token, 1, "_dsemaphore_svc:", "api", 2])


def test_key_prefix_replaces_the_default(server: redis.Redis) -> None:
    with redis.Redis.from_url(_url(server)) as client:
        lock = DMutex("svc", client, key_prefix="app:locks:").acquire("job")
        assert lock is not None
        assert stored(server) == {"app:locks:permit:0:job": lock.token}


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


@pytest.mark.parametrize("hint", ["abc", "-1", "1.5", "3", "999", "", "1e3"])
def test_a_bad_hint_only_changes_where_the_search_starts(server: redis.Redis, hint: str) -> None:
    """The hint key is advice: garbage or out-of-range values start the search at slot 0."""
    with redis.Redis.from_url(_url(server)) as client:
        sem = DSemaphore("svc", client, max_permits=3)
        server.set("_dsemaphore_svc:hint:api", hint)
        permits = [sem.acquire("api") for _ in range(4)]
        assert permits[3] is None
        assert sorted(p.slot for p in permits[:3] if p is not None) == [0, 1, 2]
        assert sorted(server.keys("_dsemaphore_svc:permit:*")) == [
            f"_dsemaphore_svc:permit:{i}:api" for i in range(3)
        ]


def test_the_search_wraps_past_held_slots_to_a_free_one(server: redis.Redis) -> None:
    """A hint at a held slot (say, written by a holder that a TypeScript service outlived)."""
    with redis.Redis.from_url(_url(server)) as client:
        sem = DSemaphore("svc", client, max_permits=4)
        for slot in (1, 2, 3):
            server.set(f"_dsemaphore_svc:permit:{slot}:api", f"ts-{slot}", px=60_000)
        server.set("_dsemaphore_svc:hint:api", "2")
        permit = sem.acquire("api")
        assert permit is not None
        assert permit.slot == 0
        assert sem.acquire("api") is None
        assert server.get("_dsemaphore_svc:hint:api") == "1"
        assert permit.release() is True
        assert server.get("_dsemaphore_svc:hint:api") == "0", "the freed slot is tried first"
        assert 0 < server.pttl("_dsemaphore_svc:hint:api") <= 300_000

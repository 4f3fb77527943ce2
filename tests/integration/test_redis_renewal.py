"""Batched renewal on real Redis servers: requests, declared keys, and foreign tokens.

The instances run on a ManualClock, so renewals happen when the test moves
it (inside ``advance()``), while the server keeps real time: a renewal shows
as a fresh PTTL on the server. Leases are 60 s long, so none runs out.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from dmutex import DMutex, DSemaphore, ManualClock
from dmutex._backends.redis.scripts import INDEXED_ABOVE, RENEW, RENEW_BATCH
from tests._support.redis_clients import Recording as RedisRecording

TTL = 60.0


class Recording(RedisRecording):
    """The recording client, which also counts the keys of each renewal request."""

    def renewals(self) -> list[int]:
        """How many leases each renewal request carried, in order; then forget them.

        ARGV holds three arguments per lease (token, TTL, its index's position).
        """
        counts = [
            (len(c) - 3 - int(str(c[2]))) // 3
            for c in self.commands
            if c[1] in (RENEW.sha, RENEW.text)
        ]
        self.commands.clear()
        return counts


@pytest.fixture
def recording(redis_url: str) -> Iterator[Recording]:
    with redis.Redis.from_url(redis_url) as client:
        client.script_load(RENEW.text)  # no NOSCRIPT fallback doubling a count
        yield Recording(client)


def test_many_leases_renew_in_batches_of_256(server: redis.Redis, recording: Recording) -> None:
    clock = ManualClock()
    mutex = DMutex("svc", recording, clock=clock)
    sem = DSemaphore("svc", recording, max_permits=3, clock=clock)
    # Above INDEXED_ABOVE permits a semaphore keeps a holders index, renewed with its leases.
    large = INDEXED_ABOVE + 1
    big = DSemaphore("svc", recording, max_permits=large, clock=clock)
    locks = [mutex.acquire(f"k{i}", TTL, auto_renew=True) for i in range(300)]
    permits = [sem.acquire("api", TTL, auto_renew=True) for _ in range(3)]
    indexed = [big.acquire("big", TTL, auto_renew=True) for _ in range(large)]
    held = [h for h in [*locks, *permits, *indexed] if h is not None]
    assert len(held) == 303 + large
    recording.commands.clear()
    for name in server.keys("*permit:*"):
        server.pexpire(name, 30_000)  # so that a renewal shows
    clock.advance(TTL / 3)  # every lease's first turn has come
    # One batch per instance (engine): 300 mutex leases in 256 + 44, 3 permits in one,
    # the large semaphore's in one.
    assert sorted(recording.renewals()) == sorted([RENEW_BATCH, 300 - RENEW_BATCH, 3, large])
    for name in server.keys("*permit:*"):
        assert server.pttl(name) > 50_000, f"{name!r} was renewed to a full TTL"
    # The large semaphore's holders index moved with them: expiry ms * 1024 + slot.
    now_ms = int(server.time()[0]) * 1000
    for permit in indexed:
        assert permit is not None
        score = server.zscore("_dsemaphore_svc:holders:big", permit.token)
        assert score is not None
        assert divmod(int(score), 1024)[1] == permit.slot
        assert divmod(int(score), 1024)[0] > now_ms + 50_000, "renewed in the index too"
    # The small one has none, written neither by its grants nor by their renewal.
    assert server.exists("_dsemaphore_svc:holders:api") == 0
    assert not any(h.lost for h in held)
    assert all(h.release() for h in held)


def test_a_renewal_never_extends_another_token(server: redis.Redis, recording: Recording) -> None:
    clock = ManualClock()
    mutex = DMutex("svc", recording, clock=clock)
    mine = mutex.acquire("a", TTL, auto_renew=True)
    stolen = mutex.acquire("b", TTL, auto_renew=True)
    assert mine is not None
    assert stolen is not None
    theirs = str(uuid.uuid4())
    server.set("_dmutex_svc:permit:0:b", theirs, px=5_000)  # taken over by another holder
    clock.advance(TTL / 3)
    assert recording.renewals() == [2], "both in one request"
    assert stolen.lost is True
    assert mine.lost is False
    assert server.get("_dmutex_svc:permit:0:b") == theirs
    assert 0 < server.pttl("_dmutex_svc:permit:0:b") <= 5_000, "its expiry untouched"
    assert server.pttl("_dmutex_svc:permit:0:a") > 50_000


def test_the_renewal_script_declares_every_key_it_touches(redis_url: str) -> None:
    """MONITOR: each GET and PEXPIRE the script runs names a key of the request's KEYS."""
    clock = ManualClock()
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        mutex = DMutex("svc", client, clock=clock)
        locks = [mutex.acquire(f"k{i}", TTL, auto_renew=True) for i in range(5)]
        monitor = client.monitor()
        with monitor:
            clock.advance(TTL / 3)
            client.echo("done")
            declared: set[str] = set()
            touched = 0
            while True:
                command: str = monitor.next_command()["command"]
                if command == "ECHO done":
                    break
                parts = command.split(" ")
                if parts[0] == "EVALSHA":
                    declared = set(parts[3 : 3 + int(parts[2])])
                elif parts[0] in ("GET", "PEXPIRE"):
                    touched += 1
                    assert parts[1] in declared, command
        assert touched == 10, "one GET and one PEXPIRE per lease"
        assert all(lock is not None and lock.release() for lock in locks)

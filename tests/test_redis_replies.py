"""How the Redis store reads replies, with no server: every shape a client may give."""

from __future__ import annotations

from typing import Any

import pytest

from dmutex import DMutex, DMutexError, DSemaphore, RedisArg, RedisReply
from dmutex._backends.redis.scripts import INDEXED_ABOVE


class Scripted:
    """A Redis-shaped client that answers each command with the next canned reply."""

    def __init__(self, *replies: object) -> None:
        # Replies a real client would never give are the point of these tests.
        self.replies: list[Any] = list(replies)
        self.commands: list[tuple[RedisArg, ...]] = []

    def execute_command(self, *args: RedisArg) -> RedisReply:
        self.commands.append(args)
        reply: RedisReply = self.replies.pop(0)
        return reply


@pytest.mark.parametrize("reply", [7, "7", b"7"])
def test_mutex_fence_in_any_decoding_grants(reply: object) -> None:
    """A mutex acquires by a script of its own, whose one number is the grant's fence."""
    client = Scripted(reply)
    lock = DMutex("svc", client).acquire("k")
    assert lock is not None
    assert lock.fence == 7
    assert [command[0] for command in client.commands] == ["EVALSHA"]


@pytest.mark.parametrize("reply", [0, "0", b"0"])
def test_mutex_zero_is_contention(reply: object) -> None:
    assert DMutex("svc", Scripted(reply)).acquire("k") is None


@pytest.mark.parametrize(
    "reply", [True, "OK", b"OK", None, False, -1, [0], [0, 1], [-1, 0], [0, 1, 2], "x", 1.0]
)
def test_impossible_mutex_acquire_reply_raises_not_contention(reply: object) -> None:
    """SET's replies, and the semaphore script's pairs, are not the mutex script's: they raise."""
    with pytest.raises(DMutexError, match="unexpected reply"):
        DMutex("svc", Scripted(reply, 0)).acquire("k")


@pytest.mark.parametrize(("reply", "slot"), [([2, 7], 2), ([b"1", b"7"], 1), (["0", "7"], 0)])
def test_script_slot_in_any_decoding(reply: object, slot: int) -> None:
    permit = DSemaphore("svc", Scripted(reply), max_permits=3).acquire("k")
    assert permit is not None
    assert permit.slot == slot
    assert permit.fence == 7


@pytest.mark.parametrize("reply", [[-1, 0], [b"-1", b"0"], ["-1", "0"]])
def test_script_minus_one_is_contention(reply: object) -> None:
    assert DSemaphore("svc", Scripted(reply), max_permits=3).acquire("k") is None


@pytest.mark.parametrize(
    "reply", [-2, 3, [-2, 1], [3, 1], [1, -1], [1, "x"], [1, 1.0], [True, 1], ["1"], "x", b""]
)
def test_impossible_acquire_reply_raises_not_contention(reply: object) -> None:
    with pytest.raises(DMutexError, match="unexpected reply"):
        DSemaphore("svc", Scripted(reply), max_permits=3).acquire("k")


def test_no_counter_means_no_fence() -> None:
    """fencing=False sends no counter key; the script then answers 1 for a grant, no fence."""
    client = Scripted(1)
    lock = DMutex("svc", client, fencing=False).acquire("k")
    assert lock is not None
    assert lock.fence is None
    (command,) = client.commands
    assert command[2:4] == (1, "_dmutex_svc:permit:0:k")
    assert "fence" not in command


@pytest.mark.parametrize("reply", [2, 7])
def test_a_fence_without_a_counter_raises(reply: int) -> None:
    """Without a counter the only grant is 1: a number above it is no reply of this script."""
    with pytest.raises(DMutexError, match="unexpected reply"):
        DMutex("svc", Scripted(reply, 0), fencing=False).acquire("k")


@pytest.mark.parametrize("permits", [2, INDEXED_ABOVE, INDEXED_ABOVE + 1])
def test_the_counter_then_the_index_follow_the_slot_keys(permits: int) -> None:
    """The index only above INDEXED_ABOVE permits: a smaller semaphore names none."""
    client = Scripted([1, 3])
    DSemaphore("svc", client, max_permits=permits).acquire("k")
    (command,) = client.commands
    keys = [f"_dsemaphore_svc:permit:{slot}:k" for slot in range(permits)]
    records = ["_dsemaphore_svc:fence:k"]
    if permits > INDEXED_ABOVE:
        records.append("_dsemaphore_svc:holders:k")
    kinds = "fence+holders" if permits > INDEXED_ABOVE else "fence"
    numkeys = len(keys) + len(records)
    assert command[2:] == (numkeys, *keys, *records, command[-3], command[-2], kinds)


@pytest.mark.parametrize("reply", [2, -1, "yes", None])
def test_impossible_release_or_extend_reply_raises(reply: object) -> None:
    sem = DSemaphore("svc", Scripted(reply, reply), max_permits=3)
    with pytest.raises(DMutexError, match="unexpected reply"):
        sem.release("k", "token")
    with pytest.raises(DMutexError, match="unexpected reply"):
        sem.extend("k", "token", 5)


@pytest.mark.parametrize(("reply", "expected"), [(1, True), (b"0", False), ("1", True)])
def test_release_reply_in_any_decoding(reply: object, expected: bool) -> None:
    assert DSemaphore("svc", Scripted(reply), max_permits=3).release("k", "t") is expected

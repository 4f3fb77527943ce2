"""Read-write locks: the pure decisions, bad input, the backends that refuse them, waking.

What every backend must do is in ``tests/contract/test_readwrite.py`` and
the state machine (``tests/model/test_readwrite_machine.py``); this file
holds what needs no backend, or the real time of an InMemoryBackend.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from dmutex import (
    AsyncDReadWriteLock,
    DReadLock,
    DReadWriteLock,
    DWriteLock,
    InMemoryBackend,
    UnsupportedClientError,
)
from dmutex._core import readwrite
from dmutex._core.readwrite import Grant, Refusal, State
from dmutex._core.waiting import waiter

NOW = 1_000_000  # epoch ms
US = NOW * 1000


def granted(decided: Grant | Refusal) -> Grant:
    assert isinstance(decided, Grant), decided
    return decided


# --- the pure decisions (dmutex._core.readwrite) ---------------------------------------


def test_a_resent_grant_finds_its_own_hold_with_a_new_fence() -> None:
    """Rule 4: the same token again is the same hold, its expiry set anew, not a second one."""
    state = State()
    first = granted(readwrite.take_read(state, "t", 1000, NOW, US, 1))
    again = granted(readwrite.take_read(state, "t", 5000, NOW + 10, US + 10_000, 1))
    assert list(state.readers) == ["t"]
    assert again.expires_ms == NOW + 10 + 5000
    assert again.fence > first.fence
    writer = State()
    granted(readwrite.take_write(writer, "w", 1000, NOW, US, None))
    granted(readwrite.take_write(writer, "w", 1000, NOW + 1, US + 1000, None))
    assert writer.writer == ("w", NOW + 1 + 1000)


def test_a_refused_writer_leaves_or_withdraws_its_intent() -> None:
    state = State(readers={"r": NOW + 500})
    refused = readwrite.take_write(state, "w", 1000, NOW, US, NOW + 2100)
    assert refused == Refusal(NOW + 500), "it clears when the last reader's lease ends"
    assert state.intents == {"w": NOW + 2100}
    assert readwrite.take_read(state, "r2", 1000, NOW, US, None) == Refusal(NOW + 2100)
    assert readwrite.take_write(state, "w", 1000, NOW, US, None) == Refusal(NOW + 500)
    assert state.intents == {}, "the last attempt withdraws it"


def test_fences_take_the_clock_as_a_floor_and_the_counter_plus_one() -> None:
    state = State(fence=5)
    assert granted(readwrite.take_read(state, "a", 10, NOW, 0, None)).fence == 6
    assert granted(readwrite.take_read(state, "b", 10, NOW, US, None)).fence == US


def test_a_release_ends_the_hold_and_the_intent_and_says_whether_a_hold_ended() -> None:
    state = State(readers={"r": NOW + 10}, intents={"w": NOW + 10})
    assert readwrite.drop(state, "w", NOW) is False, "an intent is no hold"
    assert state.intents == {}
    assert readwrite.drop(state, "r", NOW) is True
    assert state.empty()
    expired = State(writer=("w", NOW))
    assert readwrite.drop(expired, "w", NOW) is False, "an expired hold is no hold"


def test_extend_moves_only_an_active_hold_of_the_lease_s_kind() -> None:
    state = State(readers={"r": NOW + 10})
    assert readwrite.extend(state, "r", readwrite.WRITE_SLOT, 100, NOW) is None
    assert readwrite.extend(state, "r", readwrite.READ_SLOT, 100, NOW) == NOW + 100
    assert readwrite.extend(state, "r", None, 200, NOW) == NOW + 200
    assert state.until_ms() == NOW + 200


def test_an_intent_lasts_the_waiters_window_and_none_is_left_by_a_last_attempt() -> None:
    waiting = waiter(0.25)
    assert readwrite.intent_until(NOW, waiting) == NOW + 250 + 2000
    waiting.last = True
    assert readwrite.intent_until(NOW, waiting) is None
    assert readwrite.intent_until(NOW, None) is None


# --- bad input, before any request -------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, "from 1 to 1024"),
        (-1, ValueError, "from 1 to 1024"),
        (1025, ValueError, "from 1 to 1024"),
        (True, TypeError, "max_readers must be an int or None"),
        (2.0, TypeError, "max_readers must be an int or None"),
        ("2", TypeError, "max_readers must be an int or None"),
    ],
)
def test_max_readers_is_checked(value: Any, error: type[Exception], message: str) -> None:
    backend: Any = InMemoryBackend()
    with pytest.raises(error, match=message):
        DReadWriteLock("svc", backend, max_readers=value)
    assert backend.snapshot() == {}


class PostgresShaped:
    """An asyncpg-shaped client (``fetch`` beside ``fetchrow``) that records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    async def fetch(self, *args: object) -> list[object]:
        self.calls.append(args)
        return []

    async def fetchrow(self, *args: object) -> None:
        self.calls.append(args)


def test_a_sql_client_is_taken_without_a_request_and_the_other_face_is_refused() -> None:
    client: Any = PostgresShaped()
    AsyncDReadWriteLock("svc", client)  # an asyncpg client: the asyncio face's
    with pytest.raises(UnsupportedClientError, match="asyncio"):
        DReadWriteLock("svc", client)
    assert client.calls == [], "no request reached the server"


def test_the_defaults_name_the_readwrite_prefix() -> None:
    backend = InMemoryBackend()
    lock = DReadWriteLock("svc", backend)
    hold = lock.acquire_write("doc")
    assert isinstance(hold, DWriteLock)
    assert list(backend.snapshot()) == ["_drwlock_svc:write:doc"]
    hold.release()
    reader = lock.acquire_read("doc")
    assert isinstance(reader, DReadLock)
    assert list(backend.snapshot()) == [f"_drwlock_svc:read:{reader.token}:doc"]


# --- waking, on an InMemoryBackend in real time ----------------------------------------


def in_thread(target: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(target()), daemon=True)
    thread.start()
    return thread, out


def test_a_writers_release_wakes_a_waiting_reader() -> None:
    """The reader waits 15-30 s between attempts; the release ends its wait."""
    lock = DReadWriteLock("svc", InMemoryBackend())
    writer = lock.acquire_write("doc", ttl=60)
    assert writer is not None
    thread, out = in_thread(lambda: lock.acquire_read_with_retry("doc", timeout=60, retry_delay=30))
    thread.join(0.2)
    assert thread.is_alive(), "the reader waits while the writer holds the key"
    assert writer.release() is True
    thread.join(10)
    assert not thread.is_alive(), "the release did not wake the reader"
    assert isinstance(out[0], DReadLock)


def test_a_writer_waiting_for_a_stream_of_readers_gets_in() -> None:
    """Three readers re-enter as soon as they leave; the writer's intent stops them."""
    lock = DReadWriteLock("svc", InMemoryBackend())
    stop = threading.Event()
    entered: list[int] = []

    def reader() -> None:
        while not stop.is_set():
            hold = lock.acquire_read_with_retry("doc", ttl=5, timeout=10, retry_delay=0.01)
            if hold is not None:
                entered.append(1)
                stop.wait(0.02)
                hold.release()

    readers = [threading.Thread(target=reader, daemon=True) for _ in range(3)]
    for thread in readers:
        thread.start()
    try:
        while len(entered) < 10:
            stop.wait(0.01)
        writer = lock.acquire_write_with_retry("doc", ttl=5, timeout=20, retry_delay=0.05)
        assert writer is not None, "readers starved the writer"
        assert lock.acquire_read("doc") is None
        assert writer.release() is True
    finally:
        stop.set()
        for thread in readers:
            thread.join(10)


def test_asyncio_reader_woken_by_the_writers_release() -> None:
    async def main() -> None:
        lock = AsyncDReadWriteLock("svc", InMemoryBackend())
        writer = await lock.acquire_write("doc", ttl=60)
        assert writer is not None
        waiting = asyncio.create_task(
            lock.acquire_read_with_retry("doc", timeout=60, retry_delay=30)
        )
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await writer.release()
        reader = await asyncio.wait_for(waiting, 10)
        assert reader is not None
        await reader.release()

    asyncio.run(main())

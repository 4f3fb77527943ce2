"""Waiting between attempts: the jitter policy, InMemoryBackend's wake-up, and when Redis blocks.

Real-server wake-up is in ``tests/integration/test_redis_waiting.py``. Here
nothing is timed: attempts are counted (a spy on the store's acquire), and
a waiter that should wake at once is joined with a generous bound only so
that a failure cannot hang the suite.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dmutex import (
    AsyncDMutex,
    AsyncDSemaphore,
    DMutex,
    DSemaphore,
    DSemaphorePermit,
    InMemoryBackend,
    ManualClock,
    SQLiteBackend,
)
from dmutex._backends import memory, sqlite
from dmutex._backends.redis import RedisStore
from dmutex._backends.redis.waits import MIN_BLOCK, block_budget
from dmutex._clock import SYSTEM_CLOCK
from dmutex._core.effects import Call, Sleep
from dmutex._core.waiting import (
    MAX_WAIT,
    REGISTRATION_MARGIN_MS,
    Waiter,
    next_wait,
    pieces,
    waiter,
)

BOUND = 20.0  # seconds a woken waiter may take before the test fails instead of hanging
LONG = 30.0  # a retry_delay no test waits out: a waiter that returns was woken


def spy_on_acquire(
    monkeypatch: pytest.MonkeyPatch, store: type[memory.MemoryStore] | type[sqlite.SQLiteStore]
) -> list[str]:
    """Every key an acquire attempt of ``store`` is made for, in order."""
    seen: list[str] = []
    original = store.acquire

    def spy(self: Any, key: str, *args: Any) -> Any:
        seen.append(key)
        return original(self, key, *args)

    monkeypatch.setattr(store, "acquire", spy)
    return seen


@pytest.fixture
def attempts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every key an InMemoryBackend acquire attempt was made for, in order."""
    return spy_on_acquire(monkeypatch, memory.MemoryStore)


def registered(backend: InMemoryBackend, count: int = 1) -> None:
    """Block until ``count`` waiters wait on the backend (bounded)."""
    for _ in range(20_000):
        with backend._lock:
            if sum(len(wakeups) for wakeups in backend._waiters.values()) >= count:
                return
        threading.Event().wait(0.001)
    raise AssertionError("the waiter never registered")


def release_wakes_a_sync_waiter(mutex: DMutex, wait_registered: Callable[[], None]) -> None:
    """Hold ``job``; a thread waits for it with a retry_delay it never waits out; once
    ``wait_registered()`` returns, release: the waiter must wake at once with the lock."""
    holder = mutex.acquire("job", ttl=60)
    assert holder is not None
    got: list[object] = []
    waiter_thread = threading.Thread(
        target=lambda: got.append(mutex.acquire_with_retry("job", timeout=60, retry_delay=LONG))
    )
    waiter_thread.start()
    wait_registered()
    assert holder.release() is True
    waiter_thread.join(BOUND)
    assert not waiter_thread.is_alive(), "the release did not wake the waiter"
    assert got
    assert got[0] is not None


# --- the policy -------------------------------------------------------------------


@given(
    retry_delay=st.floats(0.0001, 100),
    remaining=st.floats(0.0001, 1000),
    expires_in=st.none() | st.floats(-5, 100),
)
def test_a_wait_is_jittered_and_never_longer_than_retry_delay(
    retry_delay: float, remaining: float, expires_in: float | None
) -> None:
    seconds = next_wait(retry_delay, remaining, expires_in)
    assert 0 <= seconds <= min(retry_delay, remaining)
    floor = (
        retry_delay / 2 - 0.001 if expires_in is None else min(retry_delay / 2 - 0.001, expires_in)
    )
    assert seconds >= min(floor, remaining)
    if (
        retry_delay >= 0.002
        and seconds < remaining
        and (expires_in is None or seconds < expires_in)
    ):
        assert seconds * 1000 == pytest.approx(round(seconds * 1000)), "whole milliseconds"


@pytest.mark.parametrize("retry_delay", [MAX_WAIT * 2, 1e12, 1e308])
def test_a_huge_retry_delay_waits_at_most_max_wait(retry_delay: float) -> None:
    assert MAX_WAIT / 2 <= next_wait(retry_delay, 1e308, None) <= MAX_WAIT
    assert waiter(retry_delay).window_ms == MAX_WAIT * 1000 + REGISTRATION_MARGIN_MS


def test_waits_are_spread_not_in_lockstep() -> None:
    waits = {next_wait(0.1, 10, None) for _ in range(200)}
    assert len(waits) > 20
    assert min(waits) >= 0.05
    assert max(waits) <= 0.1


def test_a_waiter_registers_for_its_window() -> None:
    made = waiter(0.25)
    assert made.window_ms == 250 + REGISTRATION_MARGIN_MS
    assert made.name.startswith("dmutex:waiter:")
    assert made.name != waiter(0.25).name


# --- InMemoryBackend --------------------------------------------------------------


def test_a_release_wakes_a_sync_waiter_without_another_attempt(attempts: list[str]) -> None:
    backend = InMemoryBackend()
    release_wakes_a_sync_waiter(DMutex("svc", backend), lambda: registered(backend))
    assert attempts == ["job", "job", "job"], "holder, waiter's failed try, waiter's winning try"


def test_a_release_wakes_an_async_waiter_without_another_attempt(attempts: list[str]) -> None:
    backend = InMemoryBackend()

    async def main() -> None:
        mutex = AsyncDMutex("svc", backend)
        holder = await mutex.acquire("job", ttl=60)
        assert holder is not None
        waiting = asyncio.create_task(mutex.acquire_with_retry("job", timeout=60, retry_delay=LONG))
        while not backend._waiters:
            await asyncio.sleep(0)
        assert await holder.release() is True
        lock = await asyncio.wait_for(waiting, BOUND)
        assert lock is not None

    asyncio.run(main())
    assert attempts == ["job", "job", "job"]


def test_a_sync_release_wakes_an_async_waiter_on_another_thread() -> None:
    backend = InMemoryBackend()
    holder = DMutex("svc", backend).acquire("job", ttl=60)
    assert holder is not None

    async def wait() -> object:
        return await AsyncDMutex("svc", backend).acquire_with_retry(
            "job", timeout=60, retry_delay=LONG
        )

    got: list[object] = []
    waiter_thread = threading.Thread(target=lambda: got.append(asyncio.run(wait())))
    waiter_thread.start()
    registered(backend)
    holder.release()
    waiter_thread.join(BOUND)
    assert not waiter_thread.is_alive()
    assert got
    assert got[0] is not None


def test_one_freed_permit_wakes_the_semaphore_waiters() -> None:
    backend = InMemoryBackend()
    sem = DSemaphore("svc", backend, max_permits=2)
    first, second = sem.acquire("api", ttl=60), sem.acquire("api", ttl=60)
    assert first is not None
    assert second is not None
    got: list[object] = []
    threads = [
        threading.Thread(
            target=lambda: got.append(sem.acquire_with_retry("api", timeout=60, retry_delay=LONG))
        )
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    registered(backend, 2)
    first.release()
    for _ in range(20_000):  # one of them takes the freed slot; the other waits on
        if got:
            break
        threading.Event().wait(0.001)
    assert len(got) == 1
    second.release()
    for thread in threads:
        thread.join(BOUND)
    assert sorted(permit.slot for permit in got if isinstance(permit, DSemaphorePermit)) == [0, 1]


def test_force_expire_wakes_waiters() -> None:
    backend = InMemoryBackend()
    mutex = DMutex("svc", backend)
    assert mutex.acquire("job", ttl=60) is not None
    got: list[object] = []
    waiter_thread = threading.Thread(
        target=lambda: got.append(mutex.acquire_with_retry("job", timeout=60, retry_delay=LONG))
    )
    waiter_thread.start()
    registered(backend)
    assert backend.force_expire("job") == 1
    waiter_thread.join(BOUND)
    assert got
    assert got[0] is not None


def test_a_waiter_on_a_manual_clock_waits_exactly_until_the_expiry(attempts: list[str]) -> None:
    clock = ManualClock()
    mutex = DMutex("svc", InMemoryBackend(clock=clock))
    assert mutex.acquire("job", ttl=5) is not None
    lock = mutex.acquire_with_retry("job", timeout=60, retry_delay=LONG)
    assert lock is not None
    assert clock.monotonic() == 5.0, "the wait ran to the holder's expiry, not to retry_delay"
    assert attempts == ["job", "job", "job"]


def abandon_a_waiter(backend: InMemoryBackend | SQLiteBackend, poll: float) -> None:
    """An asyncio waiter, cancelled once registered (polled every ``poll`` s): it must end
    cancelled and leave no wake-up registered."""

    async def main() -> None:
        mutex = AsyncDMutex("svc", backend)
        assert await mutex.acquire("job", ttl=60) is not None
        waiting = asyncio.create_task(mutex.acquire_with_retry("job", timeout=60, retry_delay=LONG))
        while not backend._waiters:
            await asyncio.sleep(poll)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(main())
    gc.collect()
    assert all(len(wakeups) == 0 for wakeups in backend._waiters.values())


def test_an_abandoned_waiter_leaves_nothing_registered() -> None:
    abandon_a_waiter(InMemoryBackend(), 0)


def test_a_waiter_that_times_out_is_forgotten() -> None:
    clock = ManualClock()
    backend = InMemoryBackend(clock=clock)
    mutex = DMutex("svc", backend)
    assert mutex.acquire("job", ttl=60) is not None
    assert mutex.acquire_with_retry("job", timeout=1, retry_delay=0.1) is None
    assert backend._waiters == {}, "the attempt at the deadline ended the registration"


# --- Redis: when a waiter may block -----------------------------------------------


class _Pool:
    def __init__(self, max_connections: object, socket_timeout: object = None) -> None:
        self.max_connections = max_connections
        self.connection_kwargs = {"socket_timeout": socket_timeout}


class _Client:
    def __init__(self, pool: object = None, connection: object = None) -> None:
        self.connection_pool = pool
        self.connection = connection
        self.single_connection_client = False
        self.sent: list[tuple[object, ...]] = []

    def execute_command(self, *args: object) -> object:
        self.sent.append(args)
        return None


@pytest.mark.parametrize(
    ("client", "budget"),
    [
        (_Client(connection=object()), None),  # single_connection_client: never block
        (_Client(_Pool(1)), None),  # the one connection is the caller's: poll
        (_Client(_Pool(2)), 1),
        (_Client(_Pool(100)), 50),
        (_Client(), None),  # no pool to read: unbounded
    ],
)
def test_blocking_waits_take_at_most_half_the_pool(client: _Client, budget: int | None) -> None:
    found = block_budget(client)
    if budget is None and client.connection_pool is None and client.connection is None:
        assert found is not None
        return
    if budget is None:
        assert found is None
        return
    assert found is not None
    blockers, _ = found
    assert [blockers.take() for _ in range(budget + 1)] == [True] * budget + [False]
    blockers.give()
    assert blockers.take() is True


def test_an_asyncio_single_connection_client_never_blocks_before_its_first_command() -> None:
    client = _Client(_Pool(10))  # redis.asyncio: no connection yet, only the flag
    client.single_connection_client = True
    assert block_budget(client) is None


def test_instances_on_one_pool_share_its_budget() -> None:
    pool = _Pool(4)
    first, second = block_budget(_Client(pool)), block_budget(_Client(pool))
    assert first is not None
    assert second is not None
    assert first[0] is second[0]


def test_a_block_ends_before_the_socket_timeout() -> None:
    found = block_budget(_Client(_Pool(10, socket_timeout=5)))
    assert found is not None
    assert found[1] == pytest.approx(4.0)


def _wait_effects(store: RedisStore, registered: bool, seconds: float) -> list[object]:
    return _wait_effects_of(store, Waiter(1000, registered=registered), seconds)


def _wait_effects_of(store: RedisStore, made: Waiter, seconds: float) -> list[object]:
    """The effects of one wait, each answered None (a BLPOP that timed out)."""
    steps = store.wait("job", made, seconds)
    effects: list[object] = []
    try:
        effect = next(steps)
        while True:
            effects.append(effect)
            effect = steps.send(None)
    except StopIteration:
        return effects


def test_a_registered_waiter_blocks_on_the_signal_list() -> None:
    client = _Client(_Pool(10))
    store = RedisStore(client, "_dmutex_svc:", 1, SYSTEM_CLOCK)
    (effect,) = _wait_effects(store, True, 0.25)
    assert isinstance(effect, Call)
    # A tick less than the wait: the server ends a block on its next tick.
    assert effect.args == ("BLPOP", "_dmutex_svc:signal:job", "0.150")
    (short,) = _wait_effects(store, True, 0.08)
    assert isinstance(short, Call)
    assert short.args == ("BLPOP", "_dmutex_svc:signal:job", "0.080"), "shorter than a tick"


def test_a_short_wait_cut_by_the_holders_expiry_sleeps() -> None:
    store = RedisStore(_Client(_Pool(10)), "_dmutex_svc:", 1, SYSTEM_CLOCK)
    made = Waiter(1000, registered=True, expires_in=0.04)
    # A block would end on the server's tick, up to 0.1 s after the expiry.
    assert _wait_effects_of(store, made, 0.04) == [Sleep(0.04)]
    made.expires_in = 5.0
    (block,) = _wait_effects_of(store, made, 0.04)
    assert isinstance(block, Call), "a wait that the expiry did not cut blocks"


@pytest.mark.parametrize(
    ("client", "clock", "registered", "seconds"),
    [
        (_Client(_Pool(10)), SYSTEM_CLOCK, False, 0.25),  # the attempt did not register it
        (_Client(_Pool(10)), SYSTEM_CLOCK, True, MIN_BLOCK / 2),  # too short for BLPOP
        (_Client(_Pool(1)), SYSTEM_CLOCK, True, 0.25),  # no connection to spare
        (_Client(_Pool(10)), ManualClock(), True, 0.25),  # time is not real
    ],
)
def test_otherwise_a_waiter_sleeps(
    client: _Client, clock: Any, registered: bool, seconds: float
) -> None:
    store = RedisStore(client, "_dmutex_svc:", 1, clock)
    assert _wait_effects(store, registered, seconds) == [Sleep(seconds)]


def test_a_failed_block_sleeps_the_rest_and_never_raises() -> None:
    clock = ManualClock()
    store = RedisStore(_Client(_Pool(10)), "_dmutex_svc:", 1, SYSTEM_CLOCK)
    store._clock = clock  # blocks as on real time, timed on a clock the test moves
    steps = store.wait("job", Waiter(1000, registered=True), 0.25)
    assert isinstance(next(steps), Call)
    clock.advance(0.1)  # the BLPOP failed after 0.1 s
    rest = steps.throw(ConnectionError("cut"))
    assert isinstance(rest, Sleep)
    assert rest.seconds == pytest.approx(0.15)
    with pytest.raises(StopIteration):
        steps.send(None)


def woken(made: Waiter) -> bool:
    """``made.woken``, read through a call: each read may differ (mypy narrows attributes)."""
    return made.woken


def test_a_woken_waiter_that_lost_pauses_before_blocking_again() -> None:
    client = _Client(_Pool(10))
    store = RedisStore(client, "_dmutex_svc:", 1, SYSTEM_CLOCK)
    made = Waiter(1000, registered=True)
    steps = store.wait("job", made, 0.25)
    assert isinstance(next(steps), Call)
    with pytest.raises(StopIteration):
        steps.send([b"_dmutex_svc:signal:job", b"dmutex:signal"])  # a signal woke it
    assert woken(made) is True
    # Its attempt lost; the next wait is a pause, not a block that the next
    # release of a tight loop would end only for it to lose again.
    (pause,) = _wait_effects_of(store, made, 0.25)
    assert isinstance(pause, Sleep)
    assert 0.005 <= pause.seconds <= 0.01
    assert woken(made) is False
    (block,) = _wait_effects_of(store, made, 0.25)
    assert isinstance(block, Call), "then it blocks again"


def test_a_block_that_times_out_is_not_a_wake() -> None:
    store = RedisStore(_Client(_Pool(10)), "_dmutex_svc:", 1, SYSTEM_CLOCK)
    made = Waiter(1000, registered=True)
    assert [type(e) for e in _wait_effects_of(store, made, 0.25)] == [Call]
    assert made.woken is False


# --- SQLiteBackend: woken through the same backend, else told the expiry ----------


@pytest.fixture
def sqlite_attempts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every key an SQLiteBackend acquire attempt was made for, in order."""
    return spy_on_acquire(monkeypatch, sqlite.SQLiteStore)


def sqlite_registered(backend: SQLiteBackend) -> None:
    """Block until a waiter waits on the backend (bounded)."""
    for _ in range(20_000):
        with backend._gate:
            if any(len(wakeups) for wakeups in backend._waiters.values()):
                return
        threading.Event().wait(0.001)
    raise AssertionError("the waiter never registered")


def test_an_sqlite_release_wakes_a_waiter_of_the_same_backend(
    tmp_path: Path, sqlite_attempts: list[str]
) -> None:
    backend = SQLiteBackend(tmp_path / "locks.sqlite3")
    release_wakes_a_sync_waiter(DMutex("svc", backend), lambda: sqlite_registered(backend))
    assert sqlite_attempts == ["job", "job", "job"]
    assert backend._waiters == {}, "the winning attempt ended the registration"
    backend.close()


def test_an_sqlite_release_wakes_an_async_waiter(tmp_path: Path) -> None:
    backend = SQLiteBackend(tmp_path / "locks.sqlite3")

    async def main() -> None:
        semaphore = AsyncDSemaphore("svc", backend, max_permits=2)
        held = [await semaphore.acquire("api", ttl=60) for _ in range(2)]
        waiting = asyncio.create_task(
            semaphore.acquire_with_retry("api", timeout=60, retry_delay=LONG)
        )
        while not backend._waiters:
            await asyncio.sleep(0.001)
        assert held[1] is not None
        assert await held[1].release() is True
        permit = await asyncio.wait_for(waiting, BOUND)
        assert permit is not None
        assert permit.slot == 1

    asyncio.run(main())
    backend.close()


@pytest.mark.parametrize("permits", [1, 2])
def test_an_sqlite_waiter_on_a_manual_clock_waits_exactly_until_the_first_expiry(
    tmp_path: Path, sqlite_attempts: list[str], permits: int
) -> None:
    """No release signals another process's expiry: the failed attempt read it."""
    clock = ManualClock()
    backend = SQLiteBackend(tmp_path / "locks.sqlite3")
    semaphore = DSemaphore("svc", backend, max_permits=permits, clock=clock)
    for ttl in (7, 5)[-permits:]:
        assert semaphore.acquire("job", ttl=ttl) is not None
    permit = semaphore.acquire_with_retry("job", timeout=60, retry_delay=LONG)
    assert permit is not None
    assert clock.monotonic() == 5.0, "the wait ran to the first expiry, not to retry_delay"
    assert sqlite_attempts == ["job"] * (permits + 2)
    backend.close()


def test_an_abandoned_sqlite_waiter_leaves_nothing_registered(tmp_path: Path) -> None:
    backend = SQLiteBackend(tmp_path / "locks.sqlite3")
    abandon_a_waiter(backend, 0.001)
    backend.close()


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (0.0, []),
        (-1.0, []),
        (1.5, [1.5]),
        (2.5 * MAX_WAIT, [MAX_WAIT, MAX_WAIT, 0.5 * MAX_WAIT]),
    ],
)
def test_a_wait_in_pieces_lasts_its_whole_and_no_piece_outlasts_max_wait(
    seconds: float, expected: list[float]
) -> None:
    now = [100.0]
    found = []
    for piece in pieces(seconds, lambda: now[0]):
        found.append(piece)
        now[0] += piece  # the piece ran out
    assert found == expected


def test_a_wait_without_end_is_pieces_of_max_wait_until_it_stops_asking() -> None:
    endless = pieces(None, lambda: 0.0)
    assert [next(endless) for _ in range(3)] == [MAX_WAIT] * 3

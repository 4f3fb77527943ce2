"""Renewal's policy and its renewers, with no server: intervals, retries, loss, threads, tasks.

The policy is checked on a ManualClock through a Redis-shaped client whose
extend replies the test scripts, so every request is counted and no test
sleeps. The renewers are checked for their scale (one thread, one task per
loop), their lifetime (they end with their last lease, a dropped handle is
no longer renewed) and their bookkeeping (a turn left behind is dropped).
On the real clock, a client whose renewals hang shows the loss told at the
deadline while the request is unanswered, and other instances renewing on.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Awaitable, Callable

import pytest

from dmutex import (
    AsyncDMutex,
    DMutex,
    InMemoryBackend,
    LeaseLostError,
    ManualClock,
    RedisArg,
    RedisReply,
)
from dmutex._backends.redis.scripts import (
    ACQUIRE,
    EXTEND,
    MUTEX_ACQUIRE,
    MUTEX_RELEASE,
    RELEASE,
    RENEW,
)
from dmutex._core import renewal

TTL = 3.0


class Flaky:
    """A Redis-shaped client: acquires and releases succeed; extends answer as planned.

    A planned reply is 1 (extended), 0 (refused) or an exception (raised);
    with no plan left, extends succeed.
    """

    def __init__(self) -> None:
        self.plan: list[int | Exception] = []
        self.extends = 0

    def execute_command(self, *args: RedisArg) -> RedisReply:
        if args[1] == ACQUIRE.sha:
            return [0, 1]
        if args[1] in (MUTEX_ACQUIRE.sha, MUTEX_RELEASE.sha, RELEASE.sha, EXTEND.sha):
            return 1  # a mutex's grant with fence 1; released; extended
        assert args[1] == RENEW.sha, args
        assert args[2] == 1, "one lease in these tests: one key per renewal"
        self.extends += 1
        reply = self.plan.pop(0) if self.plan else 1
        if isinstance(reply, Exception):
            raise reply
        return [reply]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def step(clock: ManualClock, seconds: float, by: float = 0.05) -> None:
    """Advance in small steps: renewals due inside the span run at their turn."""
    for _ in range(round(seconds / by)):
        clock.advance(by)


def renewer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dmutex-renewer"]


# --- the policy ------------------------------------------------------------------------


def test_intervals_are_a_third_of_the_ttl_less_up_to_a_tenth() -> None:
    drawn = [renewal.interval(3_000) for _ in range(2_000)]
    assert all(0.9 <= d <= 1.0 for d in drawn)
    assert max(drawn) - min(drawn) > 0.05, "jittered, not one fixed value"
    assert renewal.margin_ms(3_000) == 300
    assert renewal.margin_ms(600_000) == 2_000, "at most two seconds"
    assert renewal.margin_ms(1_000) == 200, "at least 0.2 s"
    assert renewal.margin_ms(500) == 125, "but never more than a quarter of the TTL"


def test_one_renewal_per_interval(clock: ManualClock) -> None:
    client = Flaky()
    lock = DMutex("svc", client, clock=clock).acquire("job", TTL, auto_renew=True)
    assert lock is not None
    step(clock, 30)
    # Every 0.9-1.0 s (checked at 0.05 s steps): 30 s hold 30 to 32 renewals.
    assert 30 <= client.extends <= 32
    assert lock.lost is False
    assert lock.release() is True


def test_a_refused_renewal_loses_the_lease_at_once(clock: ManualClock) -> None:
    client = Flaky()
    client.plan = [1, 0]
    lock = DMutex("svc", client, clock=clock).acquire("job", TTL, auto_renew=True)
    assert lock is not None
    step(clock, 1.0)
    assert (client.extends, lock.lost) == (1, False)
    step(clock, 1.0)
    assert (client.extends, lock.lost) == (2, True)
    step(clock, 5)
    assert client.extends == 2, "a lost lease is no longer renewed"


def test_errors_are_retried_and_a_success_keeps_the_lease(clock: ManualClock) -> None:
    client = Flaky()
    client.plan = [ConnectionError("down")] * 5
    lock = DMutex("svc", client, clock=clock).acquire("job", TTL, auto_renew=True)
    assert lock is not None
    step(clock, 2.5)
    assert client.extends == 6, "five failures retried at a fifth of the interval, then success"
    assert lock.lost is False
    step(clock, 10)
    assert lock.lost is False


def test_errors_until_the_margin_lose_the_lease_then(clock: ManualClock) -> None:
    client = Flaky()
    client.plan = [ConnectionError("down")] * 1_000
    lock = DMutex("svc", client, clock=clock).acquire("job", TTL, auto_renew=True)
    assert lock is not None
    expires = lock.expired_at
    margin = renewal.margin_ms(3_000) / 1000
    while not lock.lost:
        clock.advance(0.01)
        left = (expires - clock.now()).total_seconds()
        assert left >= margin - 0.2 or lock.lost, "never kept past the margin"
    left = (expires - clock.now()).total_seconds()
    assert 0 < left <= margin, f"given up {left:.3f} s before expiry, margin {margin}"
    assert client.extends > 5, "retried meanwhile"


def test_extend_with_a_shorter_ttl_brings_the_next_renewal_forward(clock: ManualClock) -> None:
    client = Flaky()
    lock = DMutex("svc", client, clock=clock).acquire("job", 60, auto_renew=True)
    assert lock is not None
    assert lock.extend(TTL) is True
    step(clock, 10)
    assert 10 <= client.extends <= 11, "renewed at the new TTL's pace, once per turn"
    assert lock.lost is False


# --- the renewers ------------------------------------------------------------------------


def test_one_thread_renews_every_sync_lease_and_ends_after_the_last() -> None:
    backend = InMemoryBackend()
    mutex = DMutex("svc", backend)
    locks = [mutex.acquire(f"k{i}", 1.5, auto_renew=True) for i in range(200)]
    assert all(lock is not None for lock in locks)
    assert len(renewer_threads()) == 1
    time.sleep(0.8)  # past one interval (0.45-0.5 s): the thread renews, the leases live on
    assert len(backend.snapshot()) == 200
    assert not any(lock.lost for lock in locks if lock is not None)
    assert all(lock.release() for lock in locks if lock is not None)
    deadline = time.monotonic() + 10
    while renewer_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert renewer_threads() == [], "the thread ends when no lease is left"


def test_one_task_per_loop_renews_every_async_lease() -> None:
    async def main() -> tuple[int, int]:
        backend = InMemoryBackend()
        mutex = AsyncDMutex("svc", backend)
        # Acquires on InMemoryBackend never suspend, so the loop's renewer
        # waits for them all: a lease long enough to outlast 200 of them.
        locks = [await mutex.acquire(f"k{i}", 1.5, auto_renew=True) for i in range(200)]
        named = [t for t in asyncio.all_tasks() if t.get_name() == "dmutex-renewer"]
        await asyncio.sleep(0.8)
        alive = len(backend.snapshot())
        for lock in locks:
            assert lock is not None
            assert await lock.release() is True
        for _ in range(100):
            if not [t for t in asyncio.all_tasks() if t.get_name() == "dmutex-renewer"]:
                break
            await asyncio.sleep(0.02)
        left = [t for t in asyncio.all_tasks() if t.get_name() == "dmutex-renewer"]
        assert left == [], "the task ends when no lease is left"
        return len(named), alive

    tasks, alive = asyncio.run(main())
    assert tasks == 1
    assert alive == 200


def test_a_dropped_handle_is_not_renewed(clock: ManualClock) -> None:
    backend = InMemoryBackend(clock=clock)
    mutex = DMutex("svc", backend)
    kept = mutex.acquire("kept", TTL, auto_renew=True)
    assert mutex.acquire("dropped", TTL, auto_renew=True) is not None  # handle dropped
    gc.collect()
    step(clock, 2 * TTL)
    assert kept is not None
    assert list(backend.snapshot()) == ["_dmutex_svc:permit:0:kept"], "the dropped one expired"


def test_wait_lost_wakes_on_loss_from_the_renewal_thread(clock: ManualClock) -> None:
    backend = InMemoryBackend(clock=clock)
    lock = DMutex("svc", backend).acquire("job", TTL, auto_renew=True)
    assert lock is not None
    assert lock.wait_lost(0) is False
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(lock.wait_lost(30)))
    waiter.start()
    backend.force_expire("job")
    step(clock, 1.0)
    waiter.join(30)
    assert woke == [True]


def test_wait_lost_returns_when_another_thread_releases(clock: ManualClock) -> None:
    lock = DMutex("svc", InMemoryBackend(clock=clock)).acquire("job", TTL, auto_renew=True)
    assert lock is not None
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(lock.wait_lost(30)))
    waiter.start()
    time.sleep(0.05)  # let it wait (if not yet waiting, it returns at once: same answer)
    assert lock.release() is True
    waiter.join(30)
    assert woke == [False]


async def run_until_cancelled(
    mutex: AsyncDMutex,
    key: str,
    ttl: float,
    hang: Callable[[], Awaitable[object]],
    events: list[str],
    cancelled: Callable[[], str],
) -> None:
    """``mutex.run(key, body, ttl, auto_renew=True)``, the body awaiting ``hang()``.

    Appends ``cancelled()`` when the body is cancelled, then the name of what
    ``run()`` raised.
    """

    async def body(handle: object) -> str:
        try:
            await hang()
        except asyncio.CancelledError:
            events.append(cancelled())
            raise
        return "never"

    try:
        await mutex.run(key, body, ttl, auto_renew=True)
    except Exception as error:  # noqa: BLE001 - the test names the type
        events.append(type(error).__name__)


def test_async_wait_lost_and_run_cancellation_on_a_manual_clock(clock: ManualClock) -> None:
    async def main() -> list[str]:
        backend = InMemoryBackend(clock=clock)
        mutex = AsyncDMutex("svc", backend)
        events: list[str] = []
        lock = await mutex.acquire("job", TTL, auto_renew=True)
        assert lock is not None
        waiting = asyncio.ensure_future(lock.wait_lost())
        backend.force_expire("job")
        await clock.sleep_async(1.0)
        events.append(f"wait_lost={await waiting}")

        async def expire_and_hang() -> None:
            backend.force_expire("other")
            await clock.sleep_async(1.0)
            await asyncio.sleep(3600)

        await run_until_cancelled(
            mutex, "other", TTL, expire_and_hang, events, lambda: "callback cancelled"
        )
        return events

    assert asyncio.run(main()) == ["wait_lost=True", "callback cancelled", "LeaseLostError"]


def test_leases_due_together_share_one_request(clock: ManualClock) -> None:
    """Renewals that fall due in the same pass go in one batch request per engine."""
    seen: list[int] = []

    class Batching(Flaky):
        def execute_command(self, *args: RedisArg) -> RedisReply:
            if args[1] == RENEW.sha:
                count = args[2]
                assert isinstance(count, int)
                seen.append(count)
                return [1] * count
            return super().execute_command(*args)

    mutex = DMutex("svc", Batching(), clock=clock)
    locks = [mutex.acquire(f"k{i}", TTL, auto_renew=True) for i in range(300)]
    clock.advance(1.0)  # past every first turn (0.9-1.0 s) at once
    assert seen == [256, 44], "one request per 256 leases"
    assert not any(lock.lost for lock in locks if lock is not None)


# --- loss by deadline, whatever the client does ------------------------------------------
# On the real clock: a ManualClock runs renewals inline, and these tests are
# about the worker a hung renewal occupies. They assert the order of events
# (the loss is told while the request is still unanswered), never a duration.

SHORT_TTL = 0.5  # deadline 0.45 s after each answered request's send time
HANG_LIMIT = 10.0  # a hung request is let go after this, so that no test can hang


class Hanging(Flaky):
    """A Redis-shaped client whose renewals hang until the test lets them answer (1)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.answered = threading.Event()

    def execute_command(self, *args: RedisArg) -> RedisReply:
        if args[1] != RENEW.sha:
            return super().execute_command(*args)
        self.extends += 1
        self.entered.set()
        self.gate.wait(HANG_LIMIT)
        self.answered.set()
        return [1]


class AsyncHanging(Hanging):
    """The same, for the asyncio face: the renewal's coroutine awaits the gate."""

    async def execute_command(self, *args: RedisArg) -> RedisReply:  # type: ignore[override]  # the async shape of the same client
        if args[1] != RENEW.sha:
            return super(Hanging, self).execute_command(*args)
        self.extends += 1
        self.entered.set()
        deadline = time.monotonic() + HANG_LIMIT
        while not self.gate.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        self.answered.set()
        return [1]


def test_a_hung_renewal_loses_the_lease_at_its_deadline_without_its_reply() -> None:
    client = Hanging()
    told: list[bool] = []
    lock = DMutex("svc", client).acquire("job", SHORT_TTL, auto_renew=True)
    assert lock is not None
    lock.on_lost(lambda handle: told.append(client.answered.is_set()))
    assert client.entered.wait(HANG_LIMIT), "the first renewal was sent"
    assert lock.wait_lost(HANG_LIMIT) is True
    assert told == [False], "told once, while the renewal was still unanswered"
    assert lock.time_left == 0.0
    client.gate.set()
    assert client.answered.wait(HANG_LIMIT)
    time.sleep(0.05)  # the worker handles the late success
    assert lock.lost is True, "a reply after the deadline does not revive the lease"
    assert client.extends == 1, "nothing more is sent for a lost lease"


def test_a_hung_renewal_cancels_the_async_run_body_at_its_deadline() -> None:
    client = AsyncHanging()

    async def main() -> list[str]:
        events: list[str] = []
        mutex = AsyncDMutex("svc", client)

        await run_until_cancelled(
            mutex,
            "job",
            SHORT_TTL,
            lambda: asyncio.sleep(HANG_LIMIT),
            events,
            lambda: f"cancelled, answered={client.answered.is_set()}",
        )
        client.gate.set()
        return events

    assert asyncio.run(main()) == ["cancelled, answered=False", "LeaseLostError"]


def test_a_hung_client_delays_no_other_instance() -> None:
    hung, healthy = Hanging(), Flaky()
    stuck = DMutex("svc", hung).acquire("stuck", SHORT_TTL, auto_renew=True)
    fine = DMutex("svc", healthy).acquire("fine", SHORT_TTL, auto_renew=True)
    assert stuck is not None
    assert fine is not None
    try:
        assert hung.entered.wait(HANG_LIMIT)
        assert stuck.wait_lost(HANG_LIMIT) is True
        before = healthy.extends
        # Several of the healthy lease's deadlines pass while the other hangs.
        until = time.monotonic() + HANG_LIMIT
        while healthy.extends < before + 4 and time.monotonic() < until:
            time.sleep(0.01)
        assert healthy.extends >= before + 4, "the healthy instance kept renewing"
        assert not hung.answered.is_set(), "... while the other's request still hung"
        assert fine.lost is False
    finally:
        hung.gate.set()
    assert fine.release() is True


def test_later_sent_answers_set_the_deadline(clock: ManualClock) -> None:
    """Rule 1: a shorter-TTL extend sent after a grant moves the deadline closer."""
    lock = DMutex("svc", Flaky(), clock=clock).acquire("job", 10.0)
    assert lock is not None
    assert lock.time_left == pytest.approx(9.0)  # 10 s less its tenth
    clock.advance(1.0)
    assert lock.extend(2.0) is True
    assert lock.time_left == pytest.approx(1.8)
    clock.advance(1.8)
    assert lock.lost is True


# --- run() reports the work's fate, not the clean-up's -------------------------------


class FailingRelease(Flaky):
    """Renewals as planned; every release raises, as through a partition."""

    def execute_command(self, *args: RedisArg) -> RedisReply:
        if args[1] in (RELEASE.sha, MUTEX_RELEASE.sha):
            raise ConnectionError("partitioned")
        return super().execute_command(*args)


class AsyncFailingRelease(FailingRelease):
    async def execute_command(self, *args: RedisArg) -> RedisReply:  # type: ignore[override]  # the async shape of the same client
        return super().execute_command(*args)


def test_a_lost_lease_surfaces_as_lease_lost_even_when_the_release_fails(
    clock: ManualClock,
) -> None:
    client = FailingRelease()
    client.plan = [0]  # the first renewal is refused: the lease is gone

    def work(handle: object) -> str:
        step(clock, 1.5)
        return "done"

    with pytest.raises(LeaseLostError) as caught:
        DMutex("svc", client, clock=clock).run("job", work, TTL, auto_renew=True)
    assert isinstance(caught.value.__cause__, ConnectionError)


def test_the_callbacks_exception_is_never_replaced_by_a_failing_release(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    def work(handle: object) -> str:
        raise ValueError("the work failed")

    with pytest.raises(ValueError, match="the work failed"):
        DMutex("svc", FailingRelease(), clock=clock).run("job", work, TTL)
    assert "releasing 'job' after its callback raised failed" in caplog.text


def test_an_async_body_cancelled_by_the_loss_surfaces_as_lease_lost(clock: ManualClock) -> None:
    client = AsyncFailingRelease()
    client.plan = [0]

    async def main() -> None:
        async def work(handle: object) -> str:
            await clock.sleep_async(1.5)
            await asyncio.sleep(3600)
            return "never"

        await AsyncDMutex("svc", client, clock=clock).run("job", work, TTL, auto_renew=True)

    with pytest.raises(LeaseLostError):
        asyncio.run(main())


@pytest.mark.parametrize("timeout", [1e10, 1e308, 2**63])
def test_wait_lost_takes_any_finite_timeout(timeout: float) -> None:
    """A timeout past what Event.wait and the loop's timers accept is waited in pieces."""
    backend = InMemoryBackend()
    lock = DMutex("svc", backend).acquire("job", TTL)
    assert lock is not None
    releasing = threading.Timer(0.05, lock.release)
    releasing.start()
    assert lock.wait_lost(timeout=timeout) is False, "ended by the release, not lost"
    releasing.join()

    async def main() -> bool:
        handle = await AsyncDMutex("svc", backend).acquire("other", TTL)
        assert handle is not None
        asyncio.get_running_loop().call_later(0.05, lambda: asyncio.ensure_future(handle.release()))
        return await handle.wait_lost(timeout=timeout)

    assert asyncio.run(main()) is False

"""The algorithms step by step, with no driver and no client: effects out, replies in."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone

import pytest

from dmutex import ManualClock
from dmutex._clock import Clock
from dmutex._core.abc import Inspection, Renewed, extend_each, sleep
from dmutex._core.effects import Call, Callback, Effect, Sleep, Steps
from dmutex._core.engine import Engine
from dmutex._core.lease import MAX_EXPIRY_MS, Lease
from dmutex._core.waiting import Waiter


def server(*args: object) -> object:
    """Stands for a client method; the test answers in its place."""
    raise AssertionError("never called: the test sends the reply")


class ScriptedStore:
    """A store that asks the 'server' one question per operation."""

    max_expiry_ms = MAX_EXPIRY_MS

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def ready(self) -> Steps[None]:
        yield Call(server, ("READY",))

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None = None
    ) -> Steps[Lease | None]:
        reply = yield Call(server, ("ACQUIRE", key, ttl_ms))
        return None if reply is None else Lease(key, token, int(str(reply)), 1000 + ttl_ms)

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        return bool((yield Call(server, ("RELEASE", key, slot))))

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        reply = yield Call(server, ("EXTEND", key, slot, ttl_ms))
        return None if reply is None else int(str(reply))

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        return extend_each(self, leases)

    def holders(self, key: str) -> Steps[Inspection]:
        reply = yield Call(server, ("HOLDERS", key))
        assert isinstance(reply, Inspection)
        return reply

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        return sleep(seconds)


def question(effect: Effect) -> tuple[object, ...]:
    assert isinstance(effect, Call), effect
    assert effect.fn is server
    return effect.args


def engine() -> Engine:
    return Engine(ScriptedStore(ManualClock()), default_ttl=300)


def test_acquire_is_the_stores_one_question() -> None:
    subject = engine()
    steps = subject.acquire("k", 1.5)
    assert question(next(steps)) == ("ACQUIRE", "k", 1500)
    with pytest.raises(StopIteration) as done:
        steps.send(2)
    lease = done.value.value
    assert isinstance(lease, Lease)
    assert (lease.key, lease.slot, lease.expires_ms) == ("k", 2, 2500)
    again = subject.acquire("k", None)
    assert question(next(again)) == ("ACQUIRE", "k", 300_000), "the default TTL, in ms"


def test_prepare_hands_out_the_stores_ready_steps() -> None:
    steps = engine().prepare()
    assert question(next(steps)) == ("READY",)
    with pytest.raises(StopIteration):
        steps.send(None)


def test_bad_input_raises_before_any_steps_exist() -> None:
    subject = engine()
    with pytest.raises(ValueError, match="key"):
        subject.acquire("", None)
    with pytest.raises(ValueError, match="ttl"):
        subject.extend(Lease("k", "t", 0, 0), -1)
    with pytest.raises(TypeError, match="callback"):
        subject.run(subject.acquire("k", None), "not callable", lambda lease: lease)  # type: ignore[arg-type]  # the mistake under test


def test_run_releases_when_the_callback_raises() -> None:
    subject = engine()
    steps = subject.run(subject.acquire("k", 10), print, lambda lease: lease.token)
    assert question(next(steps)) == ("ACQUIRE", "k", 10_000)
    effect = steps.send(0)
    assert isinstance(effect, Callback)
    assert effect.fn is print
    release = steps.throw(ValueError("callback failed"))
    assert question(release) == ("RELEASE", "k", 0)
    with pytest.raises(ValueError, match="callback failed"):
        steps.send(True)


def test_retry_sleeps_jittered_gaps_up_to_the_deadline_then_stops() -> None:
    clock = ManualClock()
    subject = Engine(ScriptedStore(clock), default_ttl=300)
    steps = subject.acquire_with_retry("k", None, timeout=2.5, retry_delay=0.1)
    seen: list[float] = []
    questions = 0
    effect = next(steps)
    while True:  # every question gets None: the key stays held
        if isinstance(effect, Sleep):
            seen.append(effect.seconds)
            clock.advance(effect.seconds)
        else:
            questions += 1
        try:
            effect = steps.send(None)
        except StopIteration as done:
            result = done.value
            break
    assert result is None
    assert sum(seen) == pytest.approx(2.5)
    assert questions == len(seen) + 1, "one attempt before each wait, and one at the deadline"
    # Every gap but the one cut by the deadline: between half and all of retry_delay.
    assert all(0.05 <= s <= 0.1 for s in seen[:-1]), seen
    assert 0 < seen[-1] <= 0.1
    assert len(set(seen)) > len(seen) // 2, "the gaps are jittered, not in lockstep"


def test_manual_clock() -> None:
    clock = ManualClock(datetime(2030, 5, 1, tzinfo=timezone.utc))
    assert clock.now() == datetime(2030, 5, 1, tzinfo=timezone.utc)
    assert clock.monotonic() == 0
    clock.advance(0.001)
    clock.sleep(2)
    assert clock.monotonic() == pytest.approx(2.001)
    with pytest.raises(ValueError, match="advance"):
        clock.advance(-1)
    with pytest.raises(ValueError, match="timezone-aware"):
        ManualClock(datetime(2030, 5, 1))

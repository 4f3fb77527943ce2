"""What observers are told (``dmutex._core.observe``), on InMemoryBackend with a ManualClock.

A scripted scenario, as issue 29 asks: acquires granted and refused, a
retrying acquire that waits a known time, one that times out, a renewal, a
lost lease, a run; every event checked, in order, with its figures exact
(the clock moves only when told). Then the rules: an observer that raises
changes nothing and is logged once; no observer, no event; a read-write
lock's two sides report their kinds; the options are checked before any
request.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from dmutex import (
    AsyncDMutex,
    DMutex,
    DReadWriteLock,
    DSemaphore,
    InMemoryBackend,
    LeaseLostError,
    ManualClock,
)
from dmutex._core.observe import (
    Acquired,
    Attempted,
    Ended,
    Event,
    Lost,
    NotAcquired,
    Released,
    Renewed,
    Source,
    Started,
    Woken,
)

SOURCE = Source("svc", "mutex", "memory")


class Recorder:
    """An observer that keeps every event, and the operations' names and keys as it saw them."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    def take(self) -> list[Event]:
        taken, self.events = self.events, []
        return taken


def summary(events: list[Event]) -> list[tuple[Any, ...]]:
    """Each event as a tuple of what it says, its operation shown by name and key."""
    shown: list[tuple[Any, ...]] = []
    for event in events:
        if isinstance(event, (Started, Woken)):
            op = event.operation
            shown.append((type(event).__name__, op.name, op.key))
        elif isinstance(event, Attempted):
            shown.append(("Attempted", event.operation.name, event.granted))
        elif isinstance(event, Acquired):
            op = event.operation
            shown.append(("Acquired", op.name, event.fence, event.waited, event.attempts))
        elif isinstance(event, NotAcquired):
            op = event.operation
            shown.append(("NotAcquired", op.name, event.outcome, event.waited, event.attempts))
        elif isinstance(event, Ended):
            shown.append(("Ended", event.operation.name, event.outcome))
        elif isinstance(event, Renewed):
            shown.append(("Renewed", event.key, event.ok))
        else:
            shown.append((type(event).__name__, event.key, event.fence, event.held))
    return shown


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def test_a_scripted_scenario_reports_every_event_exactly(clock: ManualClock) -> None:
    backend = InMemoryBackend(clock=clock)
    seen = Recorder()
    mutex = DMutex("svc", backend, observers=[seen])

    first = mutex.acquire("a", 10)
    assert first is not None
    assert summary(seen.take()) == [
        ("Started", "acquire", "a"),
        ("Attempted", "acquire", True),
        ("Acquired", "acquire", first.fence, 0.0, 1),
    ]
    assert mutex.acquire("a", 10) is None
    assert summary(seen.take()) == [
        ("Started", "acquire", "a"),
        ("Attempted", "acquire", False),
        ("NotAcquired", "acquire", "refused", 0.0, 1),
    ]

    # A retrying acquire that waits 2.5 s and gives up: its wait is exact.
    assert mutex.acquire_with_retry("a", ttl=10, timeout=2.5, retry_delay=1.0) is None
    events = seen.take()
    attempts = [e for e in events if isinstance(e, Attempted)]
    assert all(not e.granted for e in attempts)
    assert summary(events)[0] == ("Started", "acquire_with_retry", "a")
    assert summary(events)[-1] == (
        "NotAcquired",
        "acquire_with_retry",
        "timeout",
        2.5,
        len(attempts),
    )
    assert len(attempts) >= 3  # at least one a second, and one at the deadline

    # The holder leaves 3 s later: a waiter polling every 10 s gets in when its lease ends.
    clock.advance(3.0)  # first's lease now ends 4.5 s from now
    assert first.release() is True
    assert summary(seen.take()) == [("Released", "a", first.fence, 5.5)]
    second = mutex.acquire("a", 4)
    assert second is not None
    seen.take()
    third = mutex.acquire_with_retry("a", ttl=10, timeout=30, retry_delay=10)
    assert third is not None
    # Its first attempt learns that the lease in its way ends in 4 s, and waits that long.
    # (``second`` expires unreleased and unrenewed: nothing observes its end.)
    assert summary(seen.take()) == [
        ("Started", "acquire_with_retry", "a"),
        ("Attempted", "acquire_with_retry", False),
        ("Attempted", "acquire_with_retry", True),
        ("Acquired", "acquire_with_retry", third.fence, 4.0, 2),
    ]

    # A renewed lease: renewals reported; then its record is removed, and it is lost.
    assert third.release() is True
    seen.take()
    renewed = mutex.acquire("b", 3, auto_renew=True)
    assert renewed is not None
    seen.take()
    clock.advance(1.1)  # past its first renewal (a third of the TTL, less up to a tenth)
    assert summary(seen.take()) == [("Renewed", "b", True)]
    backend.force_expire("b")
    clock.advance(1.1)
    assert summary(seen.take()) == [("Lost", "b", renewed.fence, 2.2)]
    assert renewed.lost is True
    assert renewed.release() is False
    assert seen.take() == [], "a lost lease ends once"


def test_runs_report_their_start_their_acquire_and_their_end(clock: ManualClock) -> None:
    backend = InMemoryBackend(clock=clock)
    seen = Recorder()
    mutex = DMutex("svc", backend, observers=[seen])

    def work(handle: Any) -> str:
        clock.advance(0.25)
        return "done"

    assert mutex.run("k", work, 10) == "done"
    events = seen.take()
    lease = next(e for e in events if isinstance(e, Acquired))
    assert summary(events) == [
        ("Started", "run", "k"),
        ("Started", "acquire", "k"),
        ("Attempted", "acquire", True),
        ("Acquired", "acquire", lease.fence, 0.0, 1),
        ("Released", "k", lease.fence, 0.25),
        ("Ended", "run", "ok"),
    ]

    def boom(handle: Any) -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError):
        mutex.run_with_retry("k", boom, ttl=10, timeout=1)
    events = seen.take()
    assert summary(events)[0] == ("Started", "run_with_retry", "k")
    assert summary(events)[-1] == ("Ended", "run_with_retry", "raised")
    ended = events[-1]
    assert isinstance(ended, Ended)
    assert isinstance(ended.error, KeyError)

    holder = mutex.acquire("k", 10)
    assert holder is not None
    seen.take()
    assert mutex.run("k", work, 10) is None
    assert summary(seen.take())[-1] == ("Ended", "run", "not acquired")

    assert holder.release() is True
    seen.take()

    def lose_it(handle: Any) -> None:
        backend.force_expire("k")
        clock.advance(4.0)  # past its first renewal: it finds the lease gone

    with pytest.raises(LeaseLostError):
        mutex.run("k", lose_it, 3, auto_renew=True)
    events = seen.take()
    assert [type(e).__name__ for e in events if isinstance(e, (Lost, Released))] == ["Lost"]
    assert summary(events)[-1] == ("Ended", "run", "lost")


def test_an_observer_that_raises_changes_nothing_and_is_logged_once(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    calls = 0

    def broken(event: Event) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("observer bug")

    seen = Recorder()
    mutex = DMutex("svc", InMemoryBackend(clock=clock), observers=[broken, seen])
    with caplog.at_level(logging.WARNING, logger="dmutex.observe"):
        for _ in range(3):
            handle = mutex.acquire("k", 10)
            assert handle is not None
            assert handle.release() is True
    assert calls == 12, "every event still reached it"
    assert len(seen.events) == 12, "and the next observer"
    warned = [r for r in caplog.records if r.name == "dmutex.observe"]
    assert len(warned) == 1
    assert "RuntimeError" in warned[0].getMessage()


def test_the_sides_of_a_read_write_lock_and_a_semaphore_name_their_kind(
    clock: ManualClock,
) -> None:
    backend = InMemoryBackend(clock=clock)
    seen = Recorder()
    lock = DReadWriteLock("svc", backend, observers=[seen])
    reader = lock.acquire_read("k", 10)
    assert reader is not None
    assert lock.acquire_write("k", 10) is None
    sources = {e.operation.source for e in seen.take() if isinstance(e, Started)}
    assert sources == {Source("svc", "read", "memory"), Source("svc", "write", "memory")}
    sem = DSemaphore("svc", backend, max_permits=2, observers=[seen])
    assert sem.acquire("k", 10) is not None
    started = [e for e in seen.take() if isinstance(e, Started)]
    assert [e.operation.source for e in started] == [Source("svc", "semaphore", "memory")]


class Switch(Recorder):
    """A recorder that listens only while ``on`` (observe rule 5)."""

    on = False

    def listening(self) -> bool:
        return self.on


def test_an_operation_makes_events_only_if_an_observer_listens_as_it_starts(
    clock: ManualClock,
) -> None:
    switch = Switch()
    mutex = DMutex("svc", InMemoryBackend(clock=clock), observers=[switch])
    held = mutex.acquire("k", 10, auto_renew=True)
    assert held is not None
    assert held.release() is True
    assert not mutex._engine._listened()  # the defaults: logging below DEBUG, no SDK
    assert switch.events == [], "nobody listened: nothing was made"
    switch.on = True
    held = mutex.acquire("k", 10)
    assert held is not None
    switch.on = False
    assert held.release() is True  # observed at its grant: observed to its end
    names = [type(e).__name__ for e in switch.take()]
    assert names == ["Started", "Attempted", "Acquired", "Released"]


def test_debug_logging_listens_and_logs_grants_refusals_releases(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    mutex = DMutex("svc", InMemoryBackend(clock=clock))
    with caplog.at_level(logging.DEBUG, logger="dmutex.engine"):
        assert mutex._engine._listened()
        held = mutex.acquire("k", 10)
        assert held is not None
        assert mutex.acquire("k", 10) is None
        assert held.release() is True
    records = [r for r in caplog.records if r.name == "dmutex.engine"]
    assert [r.levelno for r in records] == [logging.DEBUG] * 3
    granted, refused, released = records
    assert "granted" in granted.getMessage()
    assert "not granted (refused)" in refused.getMessage()
    assert "released" in released.getMessage()
    for record in (granted, released):
        assert record.__dict__["dmutex_key"] == "k"
        assert record.__dict__["dmutex_token"] == held.token[:8]
        assert record.__dict__["dmutex_fence"] == held.fence
        assert record.__dict__["dmutex_kind"] == "mutex"


def test_a_lost_lease_is_a_warning_whoever_observes(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    backend = InMemoryBackend(clock=clock)
    mutex = DMutex("svc", backend)
    held = mutex.acquire("k", 3, auto_renew=True)
    assert held is not None
    backend.force_expire("k")
    with caplog.at_level(logging.WARNING, logger="dmutex"):
        clock.advance(1.1)
    (lost,) = [r for r in caplog.records if r.name == "dmutex.renewal"]
    assert lost.levelno == logging.WARNING
    assert "is lost" in lost.getMessage()
    assert lost.__dict__["dmutex_key"] == "k"
    assert lost.__dict__["dmutex_token"] == held.token[:8]


def test_an_asyncio_instance_reports_as_the_sync_one(clock: ManualClock) -> None:
    import asyncio

    seen = Recorder()
    mutex = AsyncDMutex("svc", InMemoryBackend(clock=clock), observers=[seen])

    async def main() -> None:
        handle = await mutex.acquire("k", 10)
        assert handle is not None
        clock.advance(0.5)
        assert await handle.release() is True

    asyncio.run(main())
    events = seen.take()
    fence = next(e.fence for e in events if isinstance(e, Acquired))
    assert summary(events) == [
        ("Started", "acquire", "k"),
        ("Attempted", "acquire", True),
        ("Acquired", "acquire", fence, 0.0, 1),
        ("Released", "k", fence, 0.5),
    ]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (print, "observers must be a list or tuple of callables, not builtin_function"),
        ([print, 3], "every observer must be callable with an event; 3 is not"),
        ("abc", "observers must be a list or tuple of callables, not str"),
    ],
)
def test_observers_are_checked_before_any_request(value: Any, message: str) -> None:
    backend = InMemoryBackend()
    with pytest.raises(TypeError, match=message):
        DMutex("svc", backend, observers=value)
    assert backend.snapshot() == {}


def test_a_failed_renewal_is_an_event_and_a_warning(
    clock: ManualClock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal whose request raises: Renewed(ok=False), a WARNING; the next succeeds."""
    seen = Recorder()
    mutex = DMutex("svc", InMemoryBackend(clock=clock), observers=[seen])
    held = mutex.acquire("k", 3, auto_renew=True)
    assert held is not None
    store: Any = mutex._engine._store
    working = store.extend_many
    calls = 0

    def failing_once(leases: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("the server went away")
        return (yield from working(leases))

    monkeypatch.setattr(store, "extend_many", failing_once)
    seen.take()
    with caplog.at_level(logging.WARNING, logger="dmutex.renewal"):
        clock.advance(1.1)  # the first renewal fails
        clock.advance(0.5)  # its retry (a fraction of the interval later) succeeds
    assert summary(seen.take()) == [("Renewed", "k", False), ("Renewed", "k", True)]
    (warned,) = [r for r in caplog.records if r.name == "dmutex.renewal"]
    assert "renewing the lease on 'k' failed (ConnectionError)" in warned.getMessage()
    assert warned.__dict__["dmutex_token"] == held.token[:8]
    assert held.lost is False
    assert held.release() is True

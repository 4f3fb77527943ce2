"""Elections on ``InMemoryBackend`` in real time: what the contract suite's ManualClock cannot show.

The contract suite (``tests/contract/test_election.py``) runs every
behaviour on every backend; its in-memory cases step a ManualClock, on
which a wait is a step of the clock. Here the backend reads the system
clock, so an observer's wait is a real one, and a release can end it.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from dmutex import AsyncDElection, DElection, DMutex, InMemoryBackend
from dmutex._core.abc import sleep as core_sleep
from dmutex._core.effects import Steps
from dmutex._core.terms import QUIET, STALE_READS
from dmutex._faces import elections

NAME = "scheduler"
# Far beyond any wait the tests make: an observer that polled would miss their bounds.
LONG_POLL = 30.0


def test_a_resignation_wakes_a_sync_observer_long_before_its_poll() -> None:
    backend = InMemoryBackend()
    leadership = DElection("svc", backend, ttl=60).campaign(NAME)
    assert leadership is not None
    changes = DElection("svc", backend).observe(NAME, poll=LONG_POLL)
    first = next(changes)
    assert first is not None
    assert first.term == leadership.term
    timer = threading.Timer(0.2, leadership.resign)
    timer.start()
    seen: list[object] = []
    reader = threading.Thread(target=lambda: seen.append(next(changes)), daemon=True)
    reader.start()
    reader.join(5.0)
    timer.join()
    assert seen == [None], "the resignation ended the observer's wait"


def test_a_resignation_wakes_an_asyncio_observer_long_before_its_poll() -> None:
    async def scenario() -> None:
        backend = InMemoryBackend()
        leadership = await AsyncDElection("svc", backend, ttl=60).campaign(NAME)
        assert leadership is not None
        changes = AsyncDElection("svc", backend).observe(NAME, poll=LONG_POLL)
        first = await anext(changes)
        assert first is not None
        assert first.term == leadership.term

        async def resign_soon() -> bool:
            await asyncio.sleep(0.2)
            return await leadership.resign()

        resigning = asyncio.ensure_future(resign_soon())
        assert await asyncio.wait_for(anext(changes), 5.0) is None
        assert await resigning is True

    asyncio.run(scenario())


def test_an_observer_reads_again_a_term_that_did_not_grow(monkeypatch: pytest.MonkeyPatch) -> None:
    """terms rule 6: a new holder read with its predecessor's term is read again first."""
    pauses: list[float] = []

    def sleep(seconds: float) -> Steps[None]:
        pauses.append(seconds)
        return core_sleep(seconds)

    monkeypatch.setattr(elections, "sleep", sleep)
    backend = InMemoryBackend()
    first = DElection("svc", backend, ttl=60, identity="a").campaign(NAME)
    assert first is not None
    changes = DElection("svc", backend).observe(NAME, poll=0.02)
    assert next(changes) is not None
    # A holder that keeps no fence on the name, while the observer still shows the leader:
    # its read shows the last fenced grant's term.
    assert first.resign() is True
    plain = DMutex("svc", backend, fencing=False, identity="plain").acquire(NAME, 60)
    assert plain is not None
    pauses.clear()
    shown = next(changes)
    assert shown is not None
    assert (shown.identity, shown.term) == ("plain", first.term)
    assert pauses.count(QUIET) == STALE_READS, "read again before it was shown"
    assert plain.release() is True

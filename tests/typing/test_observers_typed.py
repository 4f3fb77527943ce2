"""Static check: a downstream application's observers type-check against ``dmutex.Observer``.

mypy --strict checks this file (it runs in CI), as it would an application
that feeds Prometheus or its own logs from dmutex's events; pytest runs it
too, so the observers are shown to receive what their annotations say.
Observers of the wrong shape are in ``clients_refused.py``'s negative cases.
"""

from __future__ import annotations

from collections import Counter

from dmutex import DMutex, InMemoryBackend, ManualClock, Observer, events


class WaitHistogram:
    """An application's own observer: wait times by outcome, as a Prometheus one would keep."""

    def __init__(self) -> None:
        self.waits: dict[str, list[float]] = {}

    def __call__(self, event: events.Event) -> None:
        if isinstance(event, events.Acquired):
            self.waits.setdefault("acquired", []).append(event.waited)
        elif isinstance(event, events.NotAcquired):
            self.waits.setdefault(event.outcome, []).append(event.waited)


class OnlyWhileEnabled(WaitHistogram):
    """A switched observer: it says when it listens (``events.Switched``)."""

    enabled = True

    def listening(self) -> bool:
        return self.enabled


def test_observers_of_every_kind_are_accepted_and_receive_events() -> None:
    kinds: Counter[str] = Counter()

    def by_kind(event: events.Event) -> None:
        kinds[type(event).__name__] += 1

    histogram, switched = WaitHistogram(), OnlyWhileEnabled()
    chosen: list[Observer] = [by_kind, histogram, switched]
    witness: events.Switched = switched
    assert witness.listening() is True
    mutex = DMutex("svc", InMemoryBackend(clock=ManualClock()), observers=chosen)
    held = mutex.acquire("k", 10)
    assert held is not None
    assert mutex.acquire("k", 10) is None
    assert held.release() is True
    assert kinds == {"Started": 2, "Attempted": 2, "Acquired": 1, "NotAcquired": 1, "Released": 1}
    assert histogram.waits == {"acquired": [0.0], "refused": [0.0]}
    assert switched.waits == histogram.waits

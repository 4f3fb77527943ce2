"""What dmutex tells observers: one event per operation start, attempt, wake, grant and end.

Give any callable that takes an event (:class:`dmutex.Observer`) in
``observers=`` (every lock class takes it) to feed Prometheus, statsd or
your own logs; OpenTelemetry's observer is written on the same events
(:class:`dmutex.OpenTelemetryObserver`).
Observers are called synchronously where the event happens and must return
promptly; one that raises is logged (``dmutex.observe``) and skipped. An
object with a ``listening()`` method is asked, as each operation starts,
whether to make that operation's events at all (:class:`Switched`).

Every lease granted while observed ends in one :class:`Released` or one
:class:`Lost`, except a lease left to expire without a release or renewal,
whose end nothing sees.
"""

from __future__ import annotations

from ._core.observe import (
    Acquired,
    Attempted,
    Ended,
    Event,
    Kind,
    Lost,
    NotAcquired,
    Operation,
    OperationName,
    Released,
    Renewed,
    Source,
    Started,
    Switched,
    Woken,
)

__all__ = [
    "Acquired",
    "Attempted",
    "Ended",
    "Event",
    "Kind",
    "Lost",
    "NotAcquired",
    "Operation",
    "OperationName",
    "Released",
    "Renewed",
    "Source",
    "Started",
    "Switched",
    "Woken",
]

for _name in __all__:
    _value = globals()[_name]
    if isinstance(_value, type):
        _value.__module__ = __name__
del _name, _value

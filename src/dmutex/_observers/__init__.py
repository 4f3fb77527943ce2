"""The observers dmutex brings: logging (``logs.py``) and OpenTelemetry (``otel.py``).

They are written on the public observer protocol (``dmutex._core.observe``),
as a user's own would be, and every lock instance gets them by default
(:func:`defaults`); each listens only while it has somewhere to report to.
"""

from __future__ import annotations

from .._core.observe import Observer
from .logs import LogObserver

__all__ = ["LogObserver", "defaults"]


def defaults(chosen: tuple[Observer, ...]) -> tuple[Observer, ...]:
    """The observers of an instance given ``chosen``: these, then the defaults they lack.

    The logging observer always; OpenTelemetry's where ``opentelemetry-api``
    can be imported, unless ``chosen`` has one (with its own options).
    """
    found: list[Observer] = [*chosen]
    if not any(isinstance(o, LogObserver) for o in chosen):
        found.append(LogObserver())
    from . import otel  # the module imports opentelemetry only when asked

    made = otel.default(chosen)
    if made is not None:
        found.append(made)
    return tuple(found)

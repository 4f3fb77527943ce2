"""dmutex's log lines: a grant, a refusal, a release, a renewal at DEBUG.

Rules of this module:

1. The loggers are children of ``dmutex``, one per module that logs:
   ``dmutex.engine`` (grants, refusals, releases: this observer),
   ``dmutex.renewal`` (renewals: this observer; a renewal that failed and a
   lost lease at WARNING: ``dmutex._core.renewal`` itself), and
   ``dmutex.observe`` (an observer that raised). ``dmutex`` has a
   ``NullHandler``: nothing is printed unless the application configures
   logging.
2. This observer listens (``dmutex._core.observe``, rule 5) only while
   ``dmutex.engine`` or ``dmutex.renewal`` takes DEBUG records: with logging
   at its default level it costs one level test per operation.
3. Each record carries ``extra`` fields ``dmutex_key``, ``dmutex_token``
   (its first 8 characters: enough to tell holders apart in a log, not
   enough to release someone else's lease with) and ``dmutex_fence``, and
   ``dmutex_service`` and ``dmutex_kind``.
"""

from __future__ import annotations

import logging

from .._core.observe import (
    Acquired,
    Event,
    NotAcquired,
    Released,
    Renewed,
    Source,
)

__all__ = ["LogObserver"]

ENGINE = logging.getLogger("dmutex.engine")
RENEWAL = logging.getLogger("dmutex.renewal")
TOKEN_SHOWN = 8
"""How many characters of a token a log record shows (rule 3)."""


def _extra(source: Source, key: str, token: str | None, fence: int | None) -> dict[str, object]:
    return {
        "dmutex_service": source.service,
        "dmutex_kind": source.kind,
        "dmutex_key": key,
        "dmutex_token": None if token is None else token[:TOKEN_SHOWN],
        "dmutex_fence": fence,
    }


class LogObserver:
    """Logs grants, refusals, releases and renewals at DEBUG (rules 1-3)."""

    def listening(self) -> bool:
        """Whether either logger takes DEBUG records now (rule 2)."""
        return ENGINE.isEnabledFor(logging.DEBUG) or RENEWAL.isEnabledFor(logging.DEBUG)

    def __call__(self, event: Event) -> None:
        """Log ``event`` if it is one this observer logs."""
        if isinstance(event, Acquired):
            op = event.operation
            ENGINE.debug(
                "%s %r granted (%s, fence %s) after %.3f s and %d attempt(s)",
                op.source.kind,
                op.key,
                event.token[:TOKEN_SHOWN],
                event.fence,
                event.waited,
                event.attempts,
                extra=_extra(op.source, op.key, event.token, event.fence),
            )
        elif isinstance(event, NotAcquired):
            op = event.operation
            ENGINE.debug(
                "%s %r not granted (%s) after %.3f s and %d attempt(s)",
                op.source.kind,
                op.key,
                event.outcome,
                event.waited,
                event.attempts,
                extra=_extra(op.source, op.key, None, None),
            )
        elif isinstance(event, Released):
            ENGINE.debug(
                "%s %r released (%s, fence %s) after %.3f s held",
                event.source.kind,
                event.key,
                event.token[:TOKEN_SHOWN],
                event.fence,
                event.held,
                extra=_extra(event.source, event.key, event.token, event.fence),
            )
        elif isinstance(event, Renewed) and event.ok:
            RENEWAL.debug(
                "%s %r renewed (%s)",
                event.source.kind,
                event.key,
                event.token[:TOKEN_SHOWN],
                extra=_extra(event.source, event.key, event.token, None),
            )

    def __repr__(self) -> str:
        return "LogObserver()"

"""Clocks: where dmutex reads the time and how it waits.

Lease expiry uses the wall clock (``time``); retry deadlines use the monotonic
clock, so a wall-clock jump never stretches or cuts a wait.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Protocol

__all__ = ["Clock", "ManualClock", "SystemClock"]


class Clock(Protocol):
    """What dmutex needs from a clock."""

    def time(self) -> float:
        """Wall-clock seconds since the Unix epoch."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards."""
        ...

    def sleep(self, seconds: float) -> None:
        """Block the calling thread for ``seconds``."""
        ...

    def sleep_async(self, seconds: float) -> Awaitable[None]:
        """Suspend the calling task for ``seconds``."""
        ...


class SystemClock:
    """The real clock: :func:`time.time`, :func:`time.monotonic`, real sleeps."""

    def time(self) -> float:
        """Wall-clock seconds since the Unix epoch."""
        return time.time()

    def monotonic(self) -> float:
        """Seconds on :func:`time.monotonic`."""
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        """Block for ``seconds`` with :func:`time.sleep`."""
        time.sleep(seconds)

    async def sleep_async(self, seconds: float) -> None:
        """Suspend for ``seconds`` with :func:`asyncio.sleep`."""
        await asyncio.sleep(seconds)


SYSTEM_CLOCK = SystemClock()
"""The clock of every instance made without one: renewal keeps one timeline per clock."""

# 2026-01-01T00:00:00Z: a fixed, recognisable start for tests.
_DEFAULT_START = 1_767_225_600.0


class ManualClock:
    """A clock that moves only when told to, for tests.

    ``advance()`` moves the wall clock and the monotonic clock together.
    ``sleep()`` and ``sleep_async()`` do not wait: they advance the clock by the
    requested amount and return, so ``acquire_with_retry`` with a 30 s timeout
    finishes at once while the clock shows that 30 s went by. Every thread and
    task that shares the clock sees its time move. Thread-safe.

    Leases renewed automatically (``auto_renew=True``) on this clock renew
    as it advances, never in real time: a sync lease's renewals that fall
    due run inside ``advance()`` before it returns; an async lease's run on
    its event loop's next turn (``await clock.sleep_async(...)`` or
    ``await asyncio.sleep(0)`` after ``advance()``).
    """

    def __init__(self, start: float | datetime = _DEFAULT_START) -> None:
        """Start at ``start``: epoch seconds, or a timezone-aware datetime."""
        if isinstance(start, datetime):
            if start.tzinfo is None:
                raise ValueError("start must be a timezone-aware datetime")
            start = start.timestamp()
        self._lock = threading.Lock()
        # Integer nanoseconds, so that many small advances add up exactly.
        self._ns = round(start * 1e9)
        self._origin_ns = self._ns
        # Renewers waiting for time to move (held weakly: a renewer that is
        # gone is dropped).
        self._listeners: list[weakref.WeakMethod[Callable[[ManualClock], None]]] = []

    def time(self) -> float:
        """Current wall-clock reading, in seconds since the Unix epoch."""
        with self._lock:
            return self._ns / 1e9

    def monotonic(self) -> float:
        """Seconds advanced since this clock was made."""
        with self._lock:
            return (self._ns - self._origin_ns) / 1e9

    def now(self) -> datetime:
        """Current wall-clock reading as a timezone-aware UTC datetime."""
        return datetime.fromtimestamp(self.time(), tz=timezone.utc)

    def advance(self, seconds: float) -> None:
        """Move both clocks forward by ``seconds`` (>= 0)."""
        if not seconds >= 0:
            raise ValueError(f"cannot advance by {seconds!r} seconds")
        with self._lock:
            self._ns += round(seconds * 1e9)
            listeners = [fn for ref in self._listeners if (fn := ref()) is not None]
            self._listeners = [ref for ref in self._listeners if ref() is not None]
        # Outside the lock: a renewal reads the time.
        for listener in listeners:
            listener(self)

    def _listen(self, listener: Callable[[ManualClock], None]) -> None:
        """Call the bound method ``listener(clock)`` after every advance; once if added twice."""
        ref = weakref.WeakMethod(listener)
        with self._lock:
            if ref not in self._listeners:
                self._listeners.append(ref)

    def sleep(self, seconds: float) -> None:
        """Advance by ``seconds`` instead of blocking."""
        self.advance(seconds)

    async def sleep_async(self, seconds: float) -> None:
        """Advance by ``seconds``, then let other tasks run once."""
        self.advance(seconds)
        await asyncio.sleep(0)

"""Renewers: where renewed (and watched) leases wait for their next turn.

Rules of this module:

1. One thread per process tends every sync lease; one task per event loop
   every async one. Each starts with its first lease and ends after its
   last, so an idle process runs neither.
2. A renewer holds handles weakly: a handle that is garbage-collected is no
   longer renewed, and its lease expires on its own. The thread is a daemon:
   a process that exits keeps nothing alive.
3. A renewer decides nothing. A handle's ``_tend()`` runs the engine's
   renewal (or, for a lease that is only watched, checks its expiry) and
   answers when to come back, in seconds, or None: never.
4. Time is the lease's clock's. A :class:`~dmutex.ManualClock` drives the
   leases on it as it advances (sync ones inside ``advance()``, async ones
   on their loop, which ``advance()`` wakes); any other clock is waited on
   in real time.
5. Tends run one after another, outside every lock here: a renewal request
   that hangs delays the others on its renewer (give the client a socket
   timeout), never blocks ``add``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Awaitable, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from .._clock import Clock, ManualClock

_log = logging.getLogger("dmutex")
_order = itertools.count()
# Seconds early a renewal may run to share a request with one due now.
COALESCE = 0.02


class SyncTended(Protocol):
    """A sync handle as a renewer sees it.

    ``_ticket`` is the number of its latest turn: a handle rescheduled
    earlier (an extend with a shorter TTL) leaves its old turn behind, and a
    turn whose number is not the handle's ticket is dropped.
    """

    _ticket: int

    @property
    def _engine(self) -> object:
        """Handles of one engine are tended together: one request per batch where it can."""
        ...

    # The group is handles of this one's own class and engine.
    def _tend(self, group: Sequence[Any]) -> list[float | None]: ...


class AsyncTended(Protocol):
    """An async handle as a renewer sees it (see :class:`SyncTended`)."""

    _ticket: int

    @property
    def _engine(self) -> object: ...

    def _tend(self, group: Sequence[Any]) -> Awaitable[list[float | None]]: ...


Tended = TypeVar("Tended", SyncTended, AsyncTended)


class _Timeline(Generic[Tended]):
    """The handles due on one clock, earliest first; the caller holds its renewer's lock."""

    __slots__ = ("clock", "heap")

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.heap: list[tuple[float, int, weakref.ref[Tended]]] = []

    def add(self, handle: Tended, delay: float) -> None:
        due = self.clock.monotonic() + delay
        handle._ticket = ticket = next(_order)
        heapq.heappush(self.heap, (due, ticket, weakref.ref(handle)))

    def pop_due(self) -> list[list[Tended]]:
        """The handles whose turn has come, removed, in groups of one engine each.

        On a real clock, turns due within :data:`COALESCE` seconds come now
        too, so that renewals close in time share a request. Turns left
        behind (see :class:`SyncTended`) and collected handles are dropped.
        """
        now = self.clock.monotonic()
        if not isinstance(self.clock, ManualClock):
            now += COALESCE
        groups: dict[int, list[Tended]] = {}
        while self.heap and self.heap[0][0] <= now:
            _, ticket, ref = heapq.heappop(self.heap)
            handle = ref()
            if handle is not None and handle._ticket == ticket:
                groups.setdefault(id(handle._engine), []).append(handle)
        return list(groups.values())

    def wait(self) -> float | None:
        """Seconds until the next turn, or None when nothing waits (or the clock is manual)."""
        if not self.heap or isinstance(self.clock, ManualClock):
            return None
        return max(0.0, self.heap[0][0] - self.clock.monotonic())


def _schedule(
    timelines: dict[int, _Timeline[Tended]], clock: Clock, handle: Tended, delay: float
) -> None:
    """Put ``handle`` on ``clock``'s timeline, made if new."""
    timeline = timelines.get(id(clock))
    if timeline is None:
        timeline = timelines[id(clock)] = _Timeline(clock)
    timeline.add(handle, delay)


def _log_failure(group: Sequence[object]) -> None:
    _log.exception("renewing %d lease(s) failed; they are no longer renewed", len(group))


class SyncRenewer:
    """The process's renewer of sync leases: one daemon thread, started on demand."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._timelines: dict[int, _Timeline[SyncTended]] = {}
        self._thread: threading.Thread | None = None
        self._tending = threading.local()

    def add(self, handle: SyncTended, clock: Clock, delay: float) -> None:
        """Tend ``handle`` ``delay`` seconds from now on ``clock``."""
        with self._cond:
            _schedule(self._timelines, clock, handle, delay)
            if isinstance(clock, ManualClock):
                clock._listen(self._advanced)
            elif self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, name="dmutex-renewer", daemon=True
                )
                self._thread.start()
            else:
                self._cond.notify()

    def _advanced(self, clock: ManualClock) -> None:
        """Run, in the advancing thread, what fell due on ``clock``."""
        if getattr(self._tending, "active", False):
            return  # a tend advanced the clock: the outer pass picks it up
        self._tending.active = True
        try:
            while True:
                with self._cond:
                    timeline = self._timelines.get(id(clock))
                    if timeline is None:
                        return
                    due = timeline.pop_due()
                    if not timeline.heap and not due:
                        del self._timelines[id(clock)]
                if not due:
                    return
                self._tend_all(timeline, due)
                del due
        finally:
            self._tending.active = False

    def _tend_all(self, timeline: _Timeline[SyncTended], due: list[list[SyncTended]]) -> None:
        for group in due:
            try:
                delays = group[0]._tend(group)
            except Exception:  # noqa: BLE001 - a bug must not stop the other renewals
                _log_failure(group)
                continue
            with self._cond:
                for handle, delay in zip(group, delays, strict=True):
                    if delay is not None:
                        timeline.add(handle, delay)
                self._timelines.setdefault(id(timeline.clock), timeline)
            del group  # hold no handle while waiting

    def _serve(self) -> None:
        while True:
            with self._cond:
                while True:
                    due = [
                        (timeline, timeline.pop_due())
                        for timeline in self._timelines.values()
                        if not isinstance(timeline.clock, ManualClock)
                    ]
                    due = [(timeline, refs) for timeline, refs in due if refs]
                    if due:
                        break
                    for key in [k for k, t in self._timelines.items() if not t.heap]:
                        del self._timelines[key]
                    waits = [w for t in self._timelines.values() if (w := t.wait()) is not None]
                    if not waits:
                        self._thread = None
                        return
                    self._cond.wait(min(waits))
            for timeline, refs in due:
                self._tend_all(timeline, refs)

    def _forget(self) -> None:
        """In a forked child: the parent's leases are the parent's, and its thread is gone."""
        self._cond = threading.Condition()
        self._timelines = {}
        self._thread = None
        self._tending = threading.local()


SYNC = SyncRenewer()
if hasattr(os, "register_at_fork"):  # pragma: no branch - not on Windows
    os.register_at_fork(after_in_child=SYNC._forget)


class AsyncRenewer:
    """The renewer of one event loop's async leases: one task, started on demand."""

    _by_loop: ClassVar[dict[int, AsyncRenewer]] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._timelines: dict[int, _Timeline[AsyncTended]] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Future[None] | None = None

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> AsyncRenewer:
        """The renewer of ``loop``, made if it has none (kept only while it has work)."""
        renewer = cls._by_loop.get(id(loop))
        if renewer is None or renewer._loop is not loop:
            renewer = cls._by_loop[id(loop)] = cls(loop)
        return renewer

    def add(self, handle: AsyncTended, clock: Clock, delay: float) -> None:
        """Tend ``handle`` ``delay`` seconds from now on ``clock``; call on the loop."""
        _schedule(self._timelines, clock, handle, delay)
        if isinstance(clock, ManualClock):
            clock._listen(self._advanced)
        if self._task is None:
            self._task = self._loop.create_task(self._serve(), name="dmutex-renewer")
        else:
            self._poke()

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _advanced(self, clock: ManualClock) -> None:
        """Wake the loop's task: ``clock`` moved (from any thread)."""
        if self._loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._poke()
        else:
            self._loop.call_soon_threadsafe(self._poke)

    async def _serve(self) -> None:
        try:
            while True:
                due = [(t, refs) for t in list(self._timelines.values()) if (refs := t.pop_due())]
                for timeline, groups in due:
                    for group in groups:
                        try:
                            delays = await group[0]._tend(group)
                        except Exception:  # noqa: BLE001 - a bug must not stop the others
                            _log_failure(group)
                            continue
                        for handle, delay in zip(group, delays, strict=True):
                            if delay is not None:
                                timeline.add(handle, delay)
                        self._timelines.setdefault(id(timeline.clock), timeline)
                    del group, groups
                if due:
                    continue
                for key in [k for k, t in self._timelines.items() if not t.heap]:
                    del self._timelines[key]
                if not self._timelines:
                    return
                waits = [w for t in self._timelines.values() if (w := t.wait()) is not None]
                self._wake = self._loop.create_future()
                timer = self._loop.call_later(min(waits), self._poke) if waits else None
                try:
                    await self._wake
                finally:
                    self._wake = None
                    if timer is not None:
                        timer.cancel()
        finally:
            self._task = None
            if self._by_loop.get(id(self._loop)) is self:
                del self._by_loop[id(self._loop)]

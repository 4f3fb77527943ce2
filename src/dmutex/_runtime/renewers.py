"""Renewers: where renewed (and watched) leases wait for their next turn.

They sit in ``dmutex._runtime``, beside the drivers: the threads and tasks
that run ``dmutex._core.renewal``'s decisions for the public handles.

Rules of this module:

1. One thread per process keeps the time of every sync lease; one task per
   event loop of every async one. Each starts with its first lease and ends
   after its last, so an idle process runs neither.
2. A renewer holds handles weakly: a handle that is garbage-collected is no
   longer renewed, and its lease expires on its own. The threads are
   daemons: a process that exits keeps nothing alive.
3. A renewer decides nothing. A handle's ``_tend()`` runs the engine's
   renewal and answers when to come back, in seconds, or None: never. Its
   ``_check()`` runs the deadline's watch (``dmutex._core.renewal``, rule 1).
4. Two kinds of turn: a renewal, which makes requests, and a watch of a
   deadline, which makes none. The timekeeper runs watches itself, on
   time; it hands renewals to a worker of their engine (a thread, or a
   task), one worker per engine at a time. So a renewal request that hangs
   (a client with no socket timeout, a blackholed connection) costs one
   waiting worker and holds up only later renewals of its own engine,
   which wait for it; it delays neither another engine's renewals nor any
   lease's loss at its deadline.
5. What is watched: a renewed lease while its renewal is handed over and
   not yet answered (a *flight*: one watch per hand-over, at the earliest
   deadline of its leases), since between renewals its next turn comes
   before its deadline; a lease that is not renewed, once someone listens
   for its loss, at its own deadline. So a healthy renewal costs the
   timekeeper no wake of its own.
6. Time is the lease's clock's. A :class:`~dmutex.ManualClock` drives the
   leases on it as it advances (sync ones inside ``advance()``, async ones
   on their loop, which ``advance()`` wakes), renewals inline, so that tests
   see each step in order; any other clock is waited on in real time.
7. No lock here is held while a renewal or a listener runs: ``add`` never
   waits for a request.
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

_log = logging.getLogger("dmutex.renewal")
_order = itertools.count()
# Seconds early a renewal may run to share a request with one due now.
COALESCE = 0.02
# Seconds an engine's idle sync worker waits for more renewals before it ends.
LINGER = 1.0


class SyncTended(Protocol):
    """A sync handle as a renewer sees it.

    ``_ticket`` is the number of its latest renewal turn, ``_watch_ticket``
    of its latest watch: a handle rescheduled earlier (an extend with a
    shorter TTL) leaves its old turn behind, and a turn whose number is not
    the handle's is dropped.
    """

    _ticket: int
    _watch_ticket: int

    @property
    def _engine(self) -> object:
        """Handles of one engine are renewed together: one request per batch where it can."""
        ...

    @property
    def _over(self) -> bool:
        """The lease ended: its turns are dropped."""
        ...

    @property
    def _deadline(self) -> float:
        """The lease's deadline on its clock's monotonic time; it only moves on."""
        ...

    # The group is handles of this one's own class and engine.
    def _tend(self, group: Sequence[Any]) -> list[float | None]: ...

    def _check(self) -> float | None: ...


class AsyncTended(Protocol):
    """An async handle as a renewer sees it (see :class:`SyncTended`)."""

    _ticket: int
    _watch_ticket: int

    @property
    def _engine(self) -> object: ...

    @property
    def _over(self) -> bool: ...

    @property
    def _deadline(self) -> float: ...

    def _tend(self, group: Sequence[Any]) -> Awaitable[list[float | None]]: ...

    def _check(self) -> float | None: ...


Tended = TypeVar("Tended", SyncTended, AsyncTended)


class _Flight(Generic[Tended]):
    """Renewals handed to a worker and not yet answered (rule 5): their deadlines are watched."""

    __slots__ = ("handles", "landed")

    def __init__(self, handles: list[Tended]) -> None:
        self.handles: list[Tended] = handles
        self.landed = False


class _Timeline(Generic[Tended]):
    """The turns due on one clock, earliest first; the caller holds its renewer's lock.

    Renewals, watches and flights have a heap each: renewals due close
    together are coalesced into one request, watches and flights run
    exactly at their deadline.
    """

    __slots__ = ("clock", "flights", "renewals", "watches")

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.renewals: list[tuple[float, int, weakref.ref[Tended]]] = []
        self.watches: list[tuple[float, int, weakref.ref[Tended]]] = []
        self.flights: list[tuple[float, int, _Flight[Tended]]] = []

    def board(self, group: list[Tended]) -> _Flight[Tended]:
        """Watch ``group``, handed over for renewal, until :meth:`land`."""
        flight = _Flight(group)
        self.watch_flight(flight, min(handle._deadline for handle in group))
        return flight

    def watch_flight(self, flight: _Flight[Tended], due: float) -> None:
        heapq.heappush(self.flights, (due, next(_order), flight))

    @staticmethod
    def land(flights: list[_Flight[Tended]]) -> None:
        """The renewals of ``flights`` were answered: their watch is over."""
        for flight in flights:
            flight.landed = True
            flight.handles = []

    def add(self, handle: Tended, delay: float) -> None:
        handle._ticket = ticket = next(_order)
        heapq.heappush(self.renewals, (self.clock.monotonic() + delay, ticket, weakref.ref(handle)))

    def guard(self, handle: Tended, delay: float) -> None:
        handle._watch_ticket = ticket = next(_order)
        heapq.heappush(self.watches, (self.clock.monotonic() + delay, ticket, weakref.ref(handle)))

    @property
    def empty(self) -> bool:
        """Whether no live turn is left: dead turns at the front are dropped first."""
        while self.renewals:
            _, ticket, ref = self.renewals[0]
            handle = ref()
            if handle is not None and not handle._over and handle._ticket == ticket:
                break
            heapq.heappop(self.renewals)
        self._settle_watches()
        while self.flights and self.flights[0][2].landed:
            heapq.heappop(self.flights)
        return not self.renewals and not self.watches and not self.flights

    def _settle_watches(self) -> None:
        """Drop the dead watches at the front: of ended leases, collected handles, or left behind.

        Only leases that are not renewed are watched here (rule 5), and their
        deadline moves only by an extend through the handle, which watches
        anew: a live watch at the front is due at its lease's deadline.
        """
        heap = self.watches
        while heap:
            _, ticket, ref = heap[0]
            handle = ref()
            if handle is not None and not handle._over and handle._watch_ticket == ticket:
                return
            heapq.heappop(heap)

    def pop_due(self) -> list[list[Tended]]:
        """The renewals whose turn has come, removed, in groups of one engine each.

        None until the first is due. Then, on a real clock, turns due within
        :data:`COALESCE` seconds come too, so that renewals close in time
        share a request (a wake for a watch takes no renewal early, which
        would split batches). Turns left behind (see :class:`SyncTended`)
        and collected handles are dropped.
        """
        now = self.clock.monotonic()
        if not self.renewals or self.renewals[0][0] > now:
            return []
        if not isinstance(self.clock, ManualClock):
            now += COALESCE
        groups: dict[int, list[Tended]] = {}
        for handle in _pop(self.renewals, now, "_ticket"):
            groups.setdefault(id(handle._engine), []).append(handle)
        return list(groups.values())

    def pop_watches(self) -> list[Tended]:
        """The handles whose deadline's watch is due, removed."""
        return _pop(self.watches, self.clock.monotonic(), "_watch_ticket")

    def pop_flights(self) -> list[Tended]:
        """The handles of the flights whose watch is due, to check (not to watch on).

        Each such flight is watched again at the earliest deadline of its
        handles still to come, unless it lands first; the check that follows
        loses those whose deadline has come.
        """
        now = self.clock.monotonic()
        due: list[Tended] = []
        while self.flights and self.flights[0][0] <= now:
            _, _, flight = heapq.heappop(self.flights)
            if flight.landed:
                continue
            due.extend(flight.handles)
            later = [h._deadline for h in flight.handles if not h._over and h._deadline > now]
            if later:
                self.watch_flight(flight, min(later))
        return due

    def wait(self) -> float | None:
        """Seconds until the next turn, or None when nothing waits (or the clock is manual)."""
        if self.empty or isinstance(self.clock, ManualClock):
            return None
        heaps = (self.renewals, self.watches, self.flights)
        first = min(heap[0][0] for heap in heaps if heap)
        return max(0.0, first - self.clock.monotonic())


_Heap = list[tuple[float, int, "weakref.ref[Tended]"]]


def _pop(heap: _Heap[Tended], now: float, field: str) -> list[Tended]:
    """The live handles of ``heap``'s entries due by ``now``, removed, whose ticket still holds."""
    due: list[Tended] = []
    while heap and heap[0][0] <= now:
        _, ticket, ref = heapq.heappop(heap)
        handle = ref()
        if handle is not None and getattr(handle, field) == ticket:
            due.append(handle)
    return due


def _timeline(timelines: dict[int, _Timeline[Tended]], clock: Clock) -> _Timeline[Tended]:
    """``clock``'s timeline, made if new."""
    timeline = timelines.get(id(clock))
    if timeline is None:
        timeline = timelines[id(clock)] = _Timeline(clock)
    return timeline


def _log_failure(group: Sequence[object]) -> None:
    _log.exception("renewing %d lease(s) failed; they are no longer renewed", len(group))


def _check_all(handles: Sequence[SyncTended | AsyncTended]) -> list[float | None]:
    """Run each handle's watch (rule 3); a bug in one does not stop the others."""
    delays: list[float | None] = []
    for handle in handles:
        try:
            delays.append(handle._check())
        except Exception:  # noqa: BLE001 - a bug must not stop the other watches
            _log.exception("watching a lease's deadline failed")
            delays.append(None)
    return delays


class _Worker:
    """An engine's sync worker: the renewals queued behind the one it runs, and its wake."""

    __slots__ = ("flights", "pending", "wake")

    def __init__(self) -> None:
        self.pending: list[SyncTended] = []
        self.flights: list[_Flight[SyncTended]] = []  # the pending renewals' watches
        self.wake = threading.Event()


class _Queued(Generic[Tended]):
    """The renewals of an engine queued behind its worker task, and their flights."""

    __slots__ = ("flights", "pending")

    def __init__(self) -> None:
        self.pending: list[Tended] = []
        self.flights: list[_Flight[Tended]] = []


class SyncRenewer:
    """The process's renewer of sync leases: a timekeeper thread, and a worker per busy engine."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._timelines: dict[int, _Timeline[SyncTended]] = {}
        self._thread: threading.Thread | None = None
        self._tending = threading.local()
        # Engines with a worker thread, and the renewals waiting for it.
        self._busy: dict[int, _Worker] = {}

    def add(self, handle: SyncTended, clock: Clock, delay: float) -> None:
        """Renew ``handle`` ``delay`` seconds from now on ``clock``."""
        with self._cond:
            _timeline(self._timelines, clock).add(handle, delay)
            self._started(clock)

    def guard(self, handle: SyncTended, clock: Clock, delay: float) -> None:
        """Watch ``handle``'s deadline ``delay`` seconds from now on ``clock``."""
        with self._cond:
            _timeline(self._timelines, clock).guard(handle, delay)
            self._started(clock)

    def poke(self) -> None:
        """Have the thread look again: a lease ended, and its turns may go (any thread)."""
        with self._cond:
            self._cond.notify()

    def _started(self, clock: Clock) -> None:
        """Make sure someone keeps ``clock``'s time; the caller holds the lock."""
        if isinstance(clock, ManualClock):
            clock._listen(self._advanced)
        elif self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="dmutex-renewer", daemon=True)
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
                    watches = timeline.pop_watches()
                    due = timeline.pop_due()
                    if timeline.empty and not due and not watches:
                        del self._timelines[id(clock)]
                if not due and not watches:
                    return
                self._watch_all(timeline, watches)
                for group in due:
                    self._tend(timeline, group)
                del due, watches
        finally:
            self._tending.active = False

    def _watch_all(self, timeline: _Timeline[SyncTended], handles: list[SyncTended]) -> None:
        delays = _check_all(handles)
        with self._cond:
            for handle, delay in zip(handles, delays, strict=True):
                if delay is not None:
                    timeline.guard(handle, delay)
            self._timelines.setdefault(id(timeline.clock), timeline)

    def _tend(self, timeline: _Timeline[SyncTended], group: list[SyncTended]) -> None:
        """Renew ``group`` in this thread, then put each handle's next turn on ``timeline``."""
        try:
            delays = group[0]._tend(group)
        except Exception:  # noqa: BLE001 - a bug must not stop the other renewals
            _log_failure(group)
            return
        with self._cond:
            for handle, delay in zip(group, delays, strict=True):
                if delay is not None:
                    timeline.add(handle, delay)
            self._timelines.setdefault(id(timeline.clock), timeline)
            self._started(timeline.clock)

    def _hand_over(
        self,
        timeline: _Timeline[SyncTended],
        group: list[SyncTended],
        flights: list[_Flight[SyncTended]] | None = None,
    ) -> None:
        """Give ``group`` to its engine's worker, started if none runs; under the lock.

        Its deadlines are watched from now until it is answered (rule 5).
        """
        if flights is None:
            flights = [timeline.board(group)]
        engine = id(group[0]._engine)
        worker = self._busy.get(engine)
        if worker is not None:
            worker.pending.extend(group)  # behind the request in flight, if one is (rule 4)
            worker.flights.extend(flights)
            worker.wake.set()
            return
        worker = self._busy[engine] = _Worker()
        threading.Thread(
            target=self._work,
            args=(timeline, engine, worker, group, flights),
            name="dmutex-renewal",
            daemon=True,
        ).start()

    def _work(
        self,
        timeline: _Timeline[SyncTended],
        engine: int,
        worker: _Worker,
        group: list[SyncTended],
        flights: list[_Flight[SyncTended]],
    ) -> None:
        """A worker: renew ``group``, then what is handed over, until idle for :data:`LINGER`."""
        try:
            while True:
                self._tend(timeline, group)
                group = []  # hold no handle while waiting
                idle = False
                while not group:
                    with self._cond:
                        timeline.land(flights)
                        group, worker.pending = worker.pending, []
                        flights, worker.flights = worker.flights, []
                        if not group and idle:
                            return
                        worker.wake.clear()
                    if not group:
                        idle = not worker.wake.wait(LINGER)
        finally:
            with self._cond:
                # Whatever was handed over after the last look goes to the next worker.
                if self._busy.get(engine) is worker:
                    del self._busy[engine]
                    if worker.pending:
                        self._hand_over(timeline, worker.pending, worker.flights)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while True:
                    watches: list[tuple[_Timeline[SyncTended], list[SyncTended]]] = []
                    flying: list[SyncTended] = []
                    for timeline in self._timelines.values():
                        if isinstance(timeline.clock, ManualClock):
                            continue
                        for group in timeline.pop_due():
                            self._hand_over(timeline, group)
                        if due := timeline.pop_watches():
                            watches.append((timeline, due))
                        flying.extend(timeline.pop_flights())
                    if watches or flying:
                        break
                    for key in [k for k, t in self._timelines.items() if t.empty]:
                        del self._timelines[key]
                    waits = [w for t in self._timelines.values() if (w := t.wait()) is not None]
                    if not waits:
                        self._thread = None
                        return
                    self._cond.wait(min(waits))
            _check_all(flying)  # a flight is watched on by its own entry
            for timeline, handles in watches:
                self._watch_all(timeline, handles)
            del watches, flying

    def _forget(self) -> None:
        """In a forked child: the parent's leases are the parent's, and its threads are gone."""
        self._cond = threading.Condition()
        self._timelines = {}
        self._thread = None
        self._tending = threading.local()
        self._busy = {}


SYNC = SyncRenewer()
if hasattr(os, "register_at_fork"):  # pragma: no branch - not on Windows
    os.register_at_fork(after_in_child=SYNC._forget)


class AsyncRenewer:
    """The renewer of one event loop's async leases: a timekeeper task, a worker task per engine."""

    _by_loop: ClassVar[dict[int, AsyncRenewer]] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._timelines: dict[int, _Timeline[AsyncTended]] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Future[None] | None = None
        self._busy: dict[int, _Queued[AsyncTended]] = {}
        self._workers: set[asyncio.Task[None]] = set()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> AsyncRenewer:
        """The renewer of ``loop``, made if it has none (kept only while it has work)."""
        renewer = cls._by_loop.get(id(loop))
        if renewer is None or renewer._loop is not loop:
            renewer = cls._by_loop[id(loop)] = cls(loop)
        return renewer

    def add(self, handle: AsyncTended, clock: Clock, delay: float) -> None:
        """Renew ``handle`` ``delay`` seconds from now on ``clock``; call on the loop."""
        _timeline(self._timelines, clock).add(handle, delay)
        self._started(clock)

    def guard(self, handle: AsyncTended, clock: Clock, delay: float) -> None:
        """Watch ``handle``'s deadline ``delay`` seconds from now on ``clock``; call on the loop."""
        _timeline(self._timelines, clock).guard(handle, delay)
        self._started(clock)

    def _started(self, clock: Clock) -> None:
        if isinstance(clock, ManualClock):
            clock._listen(self._advanced)
        if self._task is None:
            self._by_loop[id(self._loop)] = self
            self._task = self._loop.create_task(self._serve(), name="dmutex-renewer")
        else:
            self._poke()

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def poke(self) -> None:
        """Have the task look again: a lease ended, and its turns may go (any thread)."""
        self._advanced(None)

    def _advanced(self, clock: ManualClock | None) -> None:
        """Wake the loop's task: ``clock`` moved, or a lease ended (from any thread)."""
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

    def _watch_all(self, timeline: _Timeline[AsyncTended], handles: list[AsyncTended]) -> None:
        for handle, delay in zip(handles, _check_all(handles), strict=True):
            if delay is not None:
                timeline.guard(handle, delay)
        self._timelines.setdefault(id(timeline.clock), timeline)

    async def _tend(self, timeline: _Timeline[AsyncTended], group: list[AsyncTended]) -> None:
        """Renew ``group``, then put each handle's next turn on ``timeline``."""
        try:
            delays = await group[0]._tend(group)
        except Exception:  # noqa: BLE001 - a bug must not stop the others
            _log_failure(group)
            return
        for handle, delay in zip(group, delays, strict=True):
            if delay is not None:
                timeline.add(handle, delay)
        self._timelines.setdefault(id(timeline.clock), timeline)
        self._started(timeline.clock)

    def _hand_over(self, timeline: _Timeline[AsyncTended], group: list[AsyncTended]) -> None:
        """Give ``group`` to its engine's worker task, started if none runs (rules 4, 5)."""
        flight = timeline.board(group)
        engine = id(group[0]._engine)
        queued = self._busy.get(engine)
        if queued is not None:
            queued.pending.extend(group)
            queued.flights.append(flight)
            return
        self._busy[engine] = _Queued()
        work = self._work(timeline, engine, group, [flight])
        worker = self._loop.create_task(work, name="dmutex-renewal")
        self._workers.add(worker)  # the loop keeps only a weak reference
        worker.add_done_callback(self._workers.discard)

    async def _work(
        self,
        timeline: _Timeline[AsyncTended],
        engine: int,
        group: list[AsyncTended],
        flights: list[_Flight[AsyncTended]],
    ) -> None:
        queued = self._busy[engine]
        try:
            while group:
                await self._tend(timeline, group)
                timeline.land(flights)
                group, queued.pending = queued.pending, []
                flights, queued.flights = queued.flights, []
        finally:
            timeline.land(flights + queued.flights)
            del self._busy[engine]

    async def _serve(self) -> None:
        try:
            while True:
                ran = False
                for timeline in list(self._timelines.values()):
                    if watches := timeline.pop_watches():
                        self._watch_all(timeline, watches)
                        ran = True
                    if flying := timeline.pop_flights():
                        _check_all(flying)  # a flight is watched on by its own entry
                        ran = True
                    for group in timeline.pop_due():
                        ran = True
                        if isinstance(timeline.clock, ManualClock):
                            await self._tend(timeline, group)  # inline: rule 6
                        else:
                            self._hand_over(timeline, group)
                    del watches, flying
                if ran:
                    continue
                for key in [k for k, t in self._timelines.items() if t.empty]:
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
            if self._by_loop.get(id(self._loop)) is self and not self._busy:
                del self._by_loop[id(self._loop)]

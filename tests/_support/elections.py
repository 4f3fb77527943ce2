"""One sync view over DElection and AsyncDElection, so each election test reads once.

``ElectionFace("async", ...)`` builds an AsyncDElection and runs each
coroutine on the rig's :class:`~tests._support.faces.LoopThread`;
``ElectionFace("sync", ...)`` calls straight through, as
:class:`~tests._support.faces.Face` does for mutexes. Build one with
``Rig.make_election``, which gives it the options ``Rig.make`` gives a mutex.

``watch()`` follows ``observe()`` in the background (a thread, or a task on
the loop) and hands its items over one at a time, with a bound on the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

from dmutex import AsyncDElection, AsyncLeadership, DElection, Leader, Leadership, ManualClock
from tests._support.faces import FaceName, LoopThread

Ending = Callable[[], None]
"""What ends a sync observer stuck between changes: one more change of leader."""


class RealSleeps:
    """A ManualClock's readings with real sleeps: for an observer that must not move the clock.

    An observer on the ManualClock itself moves it at each poll, as fast as it
    can read; one on this clock polls in real time and leaves the clock to the test.
    """

    def __init__(self, clock: ManualClock) -> None:
        self._clock = clock

    def time(self) -> float:
        return self._clock.time()

    def monotonic(self) -> float:
        return self._clock.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    async def sleep_async(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class LeadershipHandle:
    """A Leadership or AsyncLeadership with sync methods; ``with`` resigns on exit."""

    def __init__(self, raw: Leadership | AsyncLeadership, face: ElectionFace) -> None:
        self.raw = raw
        self._face = face

    @property
    def name(self) -> str:
        return self.raw.name

    @property
    def term(self) -> int:
        return self.raw.term

    @property
    def identity(self) -> str | None:
        return self.raw.identity

    @property
    def since(self) -> datetime | None:
        return self.raw.since

    @property
    def until(self) -> datetime:
        return self.raw.until

    @property
    def lost(self) -> bool:
        return self.raw.lost

    @property
    def time_left(self) -> float:
        return self.raw.time_left

    def raise_if_lost(self) -> None:
        self.raw.raise_if_lost()

    def resign(self) -> bool:
        resigned: bool = self._face.wait(self.raw.resign())
        return resigned

    def wait_lost(self, timeout: float | None = None) -> bool:
        lost: bool = self._face.wait(self.raw.wait_lost(timeout))
        return lost

    def __enter__(self) -> LeadershipHandle:
        raw = self.raw
        if isinstance(raw, AsyncLeadership):
            entered: object = self._face.wait(raw.__aenter__())
        else:
            entered = raw.__enter__()
        assert entered is raw
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if isinstance(self.raw, AsyncLeadership):
            self._face.wait(self.raw.__aexit__(*exc_info))
        else:
            self.raw.__exit__(*exc_info)


class Watch:
    """``observe(name, poll=poll)`` running in the background; :meth:`next` reads an item.

    On the asyncio face the observer is a task on the loop, cancelled by
    :meth:`close`. On the sync face it is a thread, which can stop only when
    the iterator yields: :meth:`stop_at_next` makes it end after the next
    item it reads (call it before the test's last change); otherwise
    :meth:`close` calls ``end()``, which must change the leader, and waits
    for the item that change brings.
    """

    def __init__(self, face: ElectionFace, name: str, poll: float, end: Ending) -> None:
        self._items: queue.Queue[Leader | BaseException | None] = queue.Queue()
        self._stop = threading.Event()
        self._end = end
        self._loop = face.loop
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        target = face.target
        if isinstance(target, AsyncDElection):
            assert self._loop is not None
            follow = self._follow_async(target, name, poll)

            async def start() -> asyncio.Task[None]:
                return asyncio.ensure_future(follow)

            self._task = self._loop.run(start())
        else:
            self._thread = threading.Thread(
                target=self._follow, args=(target, name, poll), daemon=True
            )
            self._thread.start()

    def _follow(self, election: DElection, name: str, poll: float) -> None:
        try:
            for item in election.observe(name, poll=poll):
                stopping = self._stop.is_set()  # asked before this item was read: it may end
                self._items.put(item)
                if stopping:
                    return
        except BaseException as error:  # noqa: BLE001 - handed to the test by next()
            self._items.put(error)

    async def _follow_async(self, election: AsyncDElection, name: str, poll: float) -> None:
        try:
            async for item in election.observe(name, poll=poll):
                self._items.put(item)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # noqa: BLE001 - handed to the test by next()
            self._items.put(error)

    def next(self, timeout: float = 2.0) -> Leader | None:
        """The observer's next item; fails if none comes within ``timeout`` seconds."""
        try:
            item = self._items.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"observe() yielded nothing within {timeout} s") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def pending(self) -> list[Leader | None]:
        """The items yielded and not read yet."""
        found: list[Leader | None] = []
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                return found
            if isinstance(item, BaseException):
                raise item
            found.append(item)

    def stop_at_next(self) -> None:
        """Make a sync observer end after its next item (call it before the last change)."""
        self._stop.set()

    def close(self, bound: float = 2.0) -> None:
        """Stop the observer: cancel its task, or end its thread (by ``end()`` if need be)."""
        self._stop.set()
        if self._task is not None:
            assert self._loop is not None
            self._loop.run(_cancelled(self._task))
            return
        assert self._thread is not None
        self._thread.join(bound)
        if self._thread.is_alive():
            self._end()
            self._thread.join(bound)
        if self._thread.is_alive():
            raise AssertionError(f"the sync observer went on {bound} s after a change")

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


async def _cancelled(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait until it ended."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class ElectionFace:
    """A DElection or AsyncDElection behind one sync interface."""

    def __init__(
        self,
        name: FaceName,
        client: object,
        *,
        service_name: str = "svc",
        loop: LoopThread | None = None,
        **options: Any,
    ) -> None:
        if name == "async" and loop is None:
            raise ValueError("an async face needs an event loop")
        self._loop = loop
        cls: Any = AsyncDElection if name == "async" else DElection
        self.target: DElection | AsyncDElection = cls(service_name, client, **options)

    @property
    def loop(self) -> LoopThread | None:
        return self._loop

    def wait(self, value: Any) -> Any:
        """The value itself (sync), or the result of awaiting it on the loop (async)."""
        if self._loop is None:
            return value

        async def awaited() -> Any:
            return await value

        return self._loop.run(awaited())

    def campaign(self, name: str, **options: Any) -> LeadershipHandle | None:
        raw = self.wait(self.target.campaign(name, **options))
        return None if raw is None else LeadershipHandle(raw, self)

    def leader(self, name: str) -> Leader | None:
        found: Leader | None = self.wait(self.target.leader(name))
        return found

    def run(self, name: str, work: Any, **options: Any) -> Any:
        """``run`` as the face has it: ``work`` is given to it as it is."""
        return self.wait(self.target.run(name, work, **options))

    def first(self, name: str, **options: Any) -> Leader | None:
        """The first item of ``observe(name, **options)``, the iterator then closed."""
        if isinstance(self.target, DElection):
            items: Iterator[Leader | None] = self.target.observe(name, **options)
            try:
                return next(items)
            finally:
                items.close()  # type: ignore[attr-defined]  # a generator
        target = self.target

        async def read() -> Leader | None:
            items = target.observe(name, **options)
            try:
                return await items.__anext__()
            finally:
                await items.aclose()  # type: ignore[attr-defined]  # an async generator

        assert self._loop is not None
        return self._loop.run(read())

    def watch(self, name: str, *, poll: float, end: Ending) -> Watch:
        """Follow ``observe(name, poll=poll)`` in the background; see :class:`Watch`."""
        return Watch(self, name, poll, end)

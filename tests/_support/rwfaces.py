"""One sync view over DReadWriteLock and AsyncDReadWriteLock, as ``faces.Face`` is for the others.

``RWFace("async", ...)`` runs every coroutine on a :class:`~tests._support.faces.LoopThread`;
``RWFace("sync", ...)`` calls straight through. Each method takes the side
(``"read"`` or ``"write"``) where the public class has a method per side.

Two calls reach below the public API, for the tests that need them:
:meth:`RWFace.intend` (a retrying writer's failed attempt, leaving its
intent, by a writer that then dies) and :meth:`RWFace.holders` (what the
store holds for a key).

:class:`SideFace` lends an RWFace the mutexes' :class:`~tests._support.faces.Face`
interface, each acquire a reader's or a writer's, so that what the fault
suites wrote for a Face (their workers, ``pausing.stale_calls``) drives a
read-write lock unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from dmutex import AsyncDReadWriteLock, DReadWriteLock
from dmutex._core import waiting
from dmutex._core.abc import Inspection
from dmutex._core.lease import new_token
from tests._support.faces import Face, FaceName, Handle, LoopThread, RawHold

T = TypeVar("T")
Side = Literal["read", "write"]


class RWFace:
    """A DReadWriteLock of either face behind one sync interface."""

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
        cls: Any = AsyncDReadWriteLock if name == "async" else DReadWriteLock
        self.target: DReadWriteLock | AsyncDReadWriteLock = cls(service_name, client, **options)

    @property
    def loop(self) -> LoopThread | None:
        return self._loop

    def wait(self, value: Any) -> Any:
        """The value itself (sync), or the result of awaiting it (async)."""
        if self._loop is None:
            return value
        return self._loop.run(value)

    def _handle(self, raw: RawHold | None) -> Handle | None:
        return None if raw is None else Handle(raw, self)

    def _callback(self, fn: Callable[[Handle], T]) -> Callable[[Any], Any]:
        if self._loop is None:
            return lambda raw: fn(Handle(raw, self))

        async def callback(raw: Any) -> T:
            return await asyncio.to_thread(fn, Handle(raw, self))

        return callback

    def settle(self) -> None:
        """Let the async face's loop run what is ready (its renewer, after a ManualClock moved)."""
        if self._loop is None:
            return

        async def turns() -> None:
            for _ in range(5):
                await asyncio.sleep(0)

        self._loop.run(turns())

    def acquire(
        self, side: Side, key: str, ttl: float | None = None, **options: Any
    ) -> Handle | None:
        target: Any = self.target
        method = target.acquire_read if side == "read" else target.acquire_write
        return self._handle(self.wait(method(key, ttl, **options)))

    def acquire_with_retry(self, side: Side, key: str, **options: Any) -> Handle | None:
        target: Any = self.target
        name = f"acquire_{side}_with_retry"
        method = getattr(target, name)
        return self._handle(self.wait(method(key, **options)))

    def run(
        self,
        side: Side,
        key: str,
        fn: Callable[[Handle], T],
        ttl: float | None = None,
        **options: Any,
    ) -> T | None:
        target: Any = self.target
        method = target.run_read if side == "read" else target.run_write
        result: T | None = self.wait(method(key, self._callback(fn), ttl, **options))
        return result

    def release_token(self, key: str, token: str) -> bool:
        released: bool = self.wait(self.target.release(key, token))
        return released

    def extend(self, key: str, token: str, ttl: float | None = None) -> bool:
        extended: bool = self.wait(self.target.extend(key, token, ttl))
        return extended

    def intend(self, key: str, ttl: float, retry_delay: float) -> tuple[bool, str, int]:
        """A retrying writer's first attempt, by a writer that then dies without trying again.

        Returns ``(granted, token, window_ms)``: refused, it leaves its
        intent for ``window_ms`` (the registration window of a waiter of
        ``retry_delay``); granted, it holds the key as a writer until ``ttl``.
        """
        engine = self.target._writing
        waiter = waiting.waiter(retry_delay)
        token = waiter.token = new_token()
        ttl_ms = engine.ttl_ms(ttl)
        steps = engine._store.acquire(key, token, ttl_ms, waiter)
        drive: Any = self.target._drive
        lease = self.wait(drive(steps))
        return lease is not None, token, waiter.window_ms

    def holders(self, key: str) -> Inspection:
        """The store's active holds of ``key`` (slot 0 the writer, 1 each reader)."""
        drive: Any = self.target._drive
        found: Inspection = self.wait(drive(self.target._reading._store.holders(key)))
        return found


class SideFace(Face):
    """An :class:`RWFace` behind the mutexes' :class:`~tests._support.faces.Face` methods.

    ``acquire`` and ``acquire_with_retry`` go to the side that :attr:`side`
    names; ``choose()`` draws it again once a hold was handed
    out, so a refused attempt's retry stays on its side. ``extend`` and
    ``release_token`` are the lock's (either kind of hold). :attr:`held` is
    the side of the last hold handed out, :attr:`sides` every hold's by its
    token. There is no ``target`` (a Face's is a DMutex or DSemaphore:
    ``rw.target`` is the lock), nor ``run``, ``run_with_retry``, ``lock`` or
    ``unlock``: use the RWFace for those.
    """

    def __init__(self, rw: RWFace, choose: Callable[[], Side]) -> None:
        # Not Face.__init__, which makes a DMutex or a DSemaphore.
        self.rw = rw
        self.max_permits = 1
        self._loop = rw.loop
        self._choose = choose
        self.side: Side = choose()
        self.held: Side | None = None
        self.sides: dict[str, Side] = {}

    def _handed(self, handle: Handle | None) -> Handle | None:
        if handle is not None:
            self.held = self.sides[handle.token] = self.side
            self.side = self._choose()
        return handle

    def acquire(self, key: str, ttl: float | None = None, **options: Any) -> Handle | None:
        return self._handed(self.rw.acquire(self.side, key, ttl, **options))

    def acquire_with_retry(self, key: str, **options: Any) -> Handle | None:
        return self._handed(self.rw.acquire_with_retry(self.side, key, **options))

    def extend(self, key: str, token: str, ttl: float | None = None) -> bool:
        return self.rw.extend(key, token, ttl)

    def release_token(self, key: str, token: str) -> bool:
        return self.rw.release_token(key, token)

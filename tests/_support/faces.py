"""One sync view over the four public classes, so each behaviour is tested once.

``Face("async", ...)`` builds an AsyncDMutex/AsyncDSemaphore and runs every
coroutine on a :class:`LoopThread`; ``Face("sync", ...)`` calls straight
through. Tests then read the same for both faces. Async ``run`` callbacks hand
the test's sync callback to a worker thread, so that it may itself use the
face (the loop stays free to serve it).

Where the asyncio side must run on the test's own loop (not on a
:class:`LoopThread`), the code is written once as :data:`Calls`, a generator
that yields each call, and run by :func:`run_calls` (sync) or
:func:`await_calls` (asyncio), as dmutex's own drivers run its steps.
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Generator
from datetime import datetime
from typing import Any, Literal, Protocol, TypeAlias, TypeVar

from dmutex import (
    AsyncDMutex,
    AsyncDMutexLock,
    AsyncDReadLock,
    AsyncDSemaphore,
    AsyncDSemaphorePermit,
    AsyncDWriteLock,
    DMutex,
    DMutexLock,
    DReadLock,
    DSemaphore,
    DSemaphorePermit,
    DWriteLock,
    LockHolder,
)

T = TypeVar("T")
FaceName = Literal["sync", "async"]
Kind = Literal["mutex", "semaphore"]
RawHandle = DMutexLock | DSemaphorePermit | AsyncDMutexLock | AsyncDSemaphorePermit
RawHold = DReadLock | DWriteLock | AsyncDReadLock | AsyncDWriteLock  # a read-write lock's
# Each yield is a call of either face: its result (sync), or an awaitable of it (asyncio).
# Any: what is sent back is the call's result, whose type the yield expression cannot carry.
Calls: TypeAlias = Generator[Any, Any, T]


def run_calls(calls: Calls[T]) -> T:
    """Run ``calls`` of the sync face: each yielded value is the call's result, sent back.

    A call that raises raised inside the generator already, where it was made.
    """
    value = None
    while True:
        try:
            value = calls.send(value)
        except StopIteration as stop:
            result: T = stop.value
            return result


async def await_calls(calls: Calls[T]) -> T:
    """Run ``calls`` of the asyncio face on the running loop: each yielded awaitable is awaited.

    Its result is sent back, or the exception it raised thrown in, at once on this
    loop, so that what the generator does next (reading the clock) happens here.
    Cancellation is not thrown in: it ends this coroutine, as it would the code inline.
    """
    value: Any = None
    error: Exception | None = None
    while True:
        try:
            step: Awaitable[Any] = calls.send(value) if error is None else calls.throw(error)
        except StopIteration as stop:
            result: T = stop.value
            return result
        try:
            value, error = await step, None
        except Exception as raised:  # noqa: BLE001 - thrown into the generator, which decides
            value, error = None, raised


class LoopThread:
    """An event loop running in a daemon thread, fed from any other thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class Waits(Protocol):
    """What a :class:`Handle` needs of its face: a way to wait for a call, and its loop."""

    def wait(self, value: Any) -> Any: ...

    @property
    def loop(self) -> LoopThread | None: ...


class Handle:
    """A lock, permit or read-write hold of either face, with sync methods."""

    def __init__(self, raw: RawHandle | RawHold, face: Waits) -> None:
        self.raw = raw
        self._face = face

    @property
    def key(self) -> str:
        return self.raw.key

    @property
    def token(self) -> str:
        return self.raw.token

    @property
    def expired_at(self) -> datetime:
        return self.raw.expired_at

    @property
    def slot(self) -> int:
        return (
            self.raw.slot if isinstance(self.raw, (DSemaphorePermit, AsyncDSemaphorePermit)) else 0
        )

    def release(self) -> bool:
        released: bool = self._face.wait(self.raw.release())
        return released

    def extend(self, ttl: float | None = None) -> bool:
        extended: bool = self._face.wait(self.raw.extend(ttl))
        return extended

    @property
    def fence(self) -> int | None:
        return self.raw.fence

    @property
    def lost(self) -> bool:
        return self.raw.lost

    @property
    def time_left(self) -> float:
        return self.raw.time_left

    @property
    def auto_renew(self) -> bool:
        return self.raw.auto_renew

    def raise_if_lost(self) -> None:
        self.raw.raise_if_lost()

    def on_lost(self, callback: Callable[[Handle], object]) -> None:
        """Register ``callback(handle)``; on the async face it is registered on the loop."""
        wrapped = self
        if self._face.loop is None:
            self.raw.on_lost(lambda raw: callback(wrapped))
            return
        raw = self.raw

        async def register() -> None:
            raw.on_lost(lambda _: callback(wrapped))

        self._face.wait(register())

    def wait_lost(self, timeout: float | None = None) -> bool:
        lost: bool = self._face.wait(self.raw.wait_lost(timeout))
        return lost


class Face:
    """A DMutex/DSemaphore of either face behind one sync interface."""

    def __init__(
        self,
        name: FaceName,
        kind: Kind,
        client: object,
        *,
        service_name: str = "svc",
        max_permits: int = 1,
        loop: LoopThread | None = None,
        **options: Any,
    ) -> None:
        self.max_permits = max_permits if kind == "semaphore" else 1
        if name == "async" and loop is None:
            raise ValueError("an async face needs an event loop")
        self._loop = loop
        target: Any
        if kind == "mutex":
            cls: Any = AsyncDMutex if name == "async" else DMutex
            target = cls(service_name, client, **options)
        else:
            cls = AsyncDSemaphore if name == "async" else DSemaphore
            target = cls(service_name, client, max_permits=max_permits, **options)
        self.target: DMutex | DSemaphore | AsyncDMutex | AsyncDSemaphore = target

    def wait(self, value: Any) -> Any:
        """The value itself (sync), or the result of awaiting it (async)."""
        if self._loop is None:
            return value
        return self._loop.run(value)

    def _handle(self, raw: RawHandle | None) -> Handle | None:
        return None if raw is None else Handle(raw, self)

    def _callback(self, fn: Callable[[Handle], T]) -> Callable[[Any], Any]:
        if self._loop is None:
            return lambda raw: fn(Handle(raw, self))

        async def callback(raw: Any) -> T:
            return await asyncio.to_thread(fn, Handle(raw, self))

        return callback

    @property
    def loop(self) -> LoopThread | None:
        return self._loop

    def settle(self) -> None:
        """Let the async face's loop run what is ready (its renewer, after a ManualClock moved).

        A few turns: the ManualClock's wake-up arrives by ``call_soon_threadsafe``, then
        the renewer task runs; with the in-process backends nothing waits on I/O.
        """
        if self._loop is None:
            return

        async def turns() -> None:
            for _ in range(5):
                await asyncio.sleep(0)

        self._loop.run(turns())

    def acquire(self, key: str, ttl: float | None = None, **options: Any) -> Handle | None:
        return self._handle(self.wait(self.target.acquire(key, ttl, **options)))

    def acquire_with_retry(self, key: str, **options: Any) -> Handle | None:
        return self._handle(self.wait(self.target.acquire_with_retry(key, **options)))

    def run(
        self, key: str, fn: Callable[[Handle], T], ttl: float | None = None, **options: Any
    ) -> T | None:
        target: Any = self.target
        result: T | None = self.wait(target.run(key, self._callback(fn), ttl, **options))
        return result

    def run_with_retry(self, key: str, fn: Callable[[Handle], T], **options: Any) -> T | None:
        target: Any = self.target
        result: T | None = self.wait(target.run_with_retry(key, self._callback(fn), **options))
        return result

    def extend(self, key: str, token: str, ttl: float | None = None) -> bool:
        result: bool = self.wait(self.target.extend(key, token, ttl))
        return result

    def holders(self, key: str) -> list[LockHolder]:
        """Who holds ``key``: the face's ``holders()``."""
        result: list[LockHolder] = self.wait(self.target.holders(key))
        return result

    def lock(self, key: str, ttl: float | None = None) -> bool:
        """The deprecated DMutex.lock (it warns)."""
        assert isinstance(self.target, (DMutex, AsyncDMutex)), "lock() is a mutex method"
        result: bool = self.wait(self.target.lock(key, ttl))
        return result

    def unlock(self, key: str, token: str | None = None) -> bool:
        """The deprecated DMutex.unlock (it warns)."""
        assert isinstance(self.target, (DMutex, AsyncDMutex)), "unlock() is a mutex method"
        result: bool = self.wait(self.target.unlock(key, token))
        return result

    def release_token(self, key: str, token: str) -> bool:
        """Release by key and token: DSemaphore.release, or DMutex.unlock(key, token)."""
        target: Any = self.target
        if isinstance(target, (DSemaphore, AsyncDSemaphore)):
            result: bool = self.wait(target.release(key, token))
            return result
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            result = self.wait(target.unlock(key, token))
        return result

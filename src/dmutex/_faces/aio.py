"""The asyncio classes: AsyncDMutex, AsyncDSemaphore and their handles.

They mirror the sync classes method for method (a test keeps them in step)
and run the same engine steps with the instance's
:class:`~dmutex._faces.drive.AsyncDriver`.
"""

from __future__ import annotations

import warnings
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Generic, TypeAlias, TypeVar, cast

from .._backends.clients import (
    AsyncMongoClientLike,
    AsyncRedisCommandClient,
    AsyncRedisSetEvalClient,
)
from .._backends.memory import InMemoryBackend
from .._core.effects import Steps
from .._core.engine import Engine
from .._core.lease import Lease
from .base import MutexBase, SemaphoreBase
from .drive import AsyncDriver
from .handles import HandleBase, SlotMixin

__all__ = [
    "AsyncClient",
    "AsyncDMutex",
    "AsyncDMutexLock",
    "AsyncDSemaphore",
    "AsyncDSemaphorePermit",
]

T = TypeVar("T")
H = TypeVar("H", bound="_AsyncHandle")
Self = TypeVar("Self", bound="_AsyncHandle")

AsyncClient: TypeAlias = (
    InMemoryBackend | AsyncMongoClientLike | AsyncRedisCommandClient | AsyncRedisSetEvalClient
)
"""Any client an asyncio class accepts."""


class _AsyncHandle(HandleBase[AsyncDriver]):
    __slots__ = ()

    async def release(self) -> bool:
        """Release this permit; see :meth:`DMutexLock.release`."""
        return await self._drive(self._engine.release(self._lease))

    async def extend(self, ttl: float | None = None) -> bool:
        """Extend this permit to now + ``ttl``; see :meth:`DMutexLock.extend`."""
        return await self._drive(self._engine.extend(self._lease, ttl))

    async def __aenter__(self: Self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()


class AsyncDMutexLock(_AsyncHandle):
    """A held mutex lock; ``async with lock:`` releases it on exit."""

    __slots__ = ()


class AsyncDSemaphorePermit(SlotMixin[AsyncDriver], _AsyncHandle):
    """A held semaphore permit; ``async with permit:`` releases it on exit."""

    __slots__ = ()


class _AsyncFace(Generic[H]):
    _ASYNC = True
    _engine: Engine
    _drive: AsyncDriver

    def _start_driver(self, engine: Engine) -> None:
        self._drive = AsyncDriver(engine.clock, engine.prepare)

    def _wrap(self, lease: Lease) -> H:
        raise NotImplementedError

    async def _drive_optional(self, steps: Steps[Lease | None]) -> H | None:
        lease = await self._drive(steps)
        return None if lease is None else self._wrap(lease)

    async def ready(self) -> None:
        """Prepare the backend once per instance; see :meth:`DMutex.ready`."""
        await self._drive.ready()

    async def acquire(self, key: str, ttl: float | None = None) -> H | None:
        """Try once to take a permit; see :meth:`DMutex.acquire`."""
        return await self._drive_optional(self._engine.acquire(key, ttl))

    async def acquire_with_retry(
        self,
        key: str,
        *,
        ttl: float | None = None,
        timeout: float = 30.0,
        retry_delay: float = 0.1,
    ) -> H | None:
        """Retry until a permit or the timeout; see :meth:`DMutex.acquire_with_retry`."""
        steps = self._engine.acquire_with_retry(key, ttl, timeout, retry_delay)
        return await self._drive_optional(steps)

    async def run(
        self, key: str, callback: Callable[[H], Awaitable[T]], ttl: float | None = None
    ) -> T | None:
        """Await ``callback(handle)`` while holding a permit; see :meth:`DMutex.run`."""
        steps = self._engine.run(self._engine.acquire(key, ttl), callback, self._wrap)
        return cast("T | None", await self._drive(steps))

    async def run_with_retry(
        self,
        key: str,
        callback: Callable[[H], Awaitable[T]],
        *,
        ttl: float | None = None,
        timeout: float = 30.0,
        retry_delay: float = 0.1,
    ) -> T | None:
        """Like :meth:`run`, acquiring as :meth:`acquire_with_retry` does."""
        acquisition = self._engine.acquire_with_retry(key, ttl, timeout, retry_delay)
        steps = self._engine.run(acquisition, callback, self._wrap)
        return cast("T | None", await self._drive(steps))

    async def extend(self, key: str, token: str, ttl: float | None = None) -> bool:
        """Extend the active permit holding ``token``; see :meth:`DMutex.extend`."""
        return await self._drive(self._engine.extend_token(key, token, ttl))


class AsyncDSemaphore(_AsyncFace[AsyncDSemaphorePermit], SemaphoreBase[AsyncClient]):
    """The asyncio :class:`DSemaphore`: same semantics, coroutine methods."""

    def _wrap(self, lease: Lease) -> AsyncDSemaphorePermit:
        return AsyncDSemaphorePermit(lease, self._engine, self._drive)

    async def release(self, key: str, token: str) -> bool:
        """Release the active permit holding ``token``; see :meth:`DSemaphore.release`."""
        return await self._drive(self._engine.release_token(key, token))


class AsyncDMutex(_AsyncFace[AsyncDMutexLock], MutexBase[AsyncClient]):
    """The asyncio :class:`DMutex`: same semantics, coroutine methods."""

    def _wrap(self, lease: Lease) -> AsyncDMutexLock:
        return AsyncDMutexLock(lease, self._engine, self._drive)

    async def lock(self, key: str, ttl: float | None = None) -> bool:
        """Deprecated: use :meth:`acquire`; see :meth:`DMutex.lock`."""
        warnings.warn(
            "AsyncDMutex.lock() is deprecated; use acquire()",
            DeprecationWarning,
            stacklevel=2,
        )
        return await self._drive(self._engine.lock(key, ttl))

    async def unlock(self, key: str, token: str | None = None) -> bool:
        """Deprecated: use the handle's ``release()``; see :meth:`DMutex.unlock`."""
        warnings.warn(
            "AsyncDMutex.unlock() is deprecated; use the handle's release()",
            DeprecationWarning,
            stacklevel=2,
        )
        return await self._drive(self._engine.unlock(key, token))

"""The asyncio classes: AsyncDMutex, AsyncDSemaphore and their handles.

They mirror the sync classes method for method (a test keeps them in step)
and run the same engine steps with the instance's
:class:`~dmutex._runtime.drivers.AsyncDriver`.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import TypeVar, cast

from .._backends.clients import AsyncClient
from .._core.engine import Engine
from .._core.lease import Lease
from .._core.waiting import pieces
from .._runtime.drivers import AsyncDriver, waker
from .._runtime.renewers import AsyncRenewer
from .._validate import check_timeout
from .base import MutexBase, ReadWriteBase, SemaphoreBase, Wrapping
from .handles import HandleBase, SlotMixin
from .holders import LockHolder, lock_holders

__all__ = [
    "AsyncDMutex",
    "AsyncDMutexLock",
    "AsyncDReadLock",
    "AsyncDReadWriteLock",
    "AsyncDSemaphore",
    "AsyncDSemaphorePermit",
    "AsyncDWriteLock",
]

T = TypeVar("T")
H = TypeVar("H", bound="_AsyncHandle")
Self = TypeVar("Self", bound="_AsyncHandle")


class _AsyncHandle(HandleBase[AsyncDriver]):
    __slots__ = ("_loop",)

    def _bind(self) -> None:
        # Made in a coroutine: the loop it runs on renews and watches it.
        self._loop = asyncio.get_running_loop()

    async def release(self) -> bool:
        """Release this permit; see :meth:`DMutexLock.release`."""
        return await self._drive(self._engine.release(self._lease))

    async def extend(self, ttl: float | None = None) -> bool:
        """Extend this permit to now + ``ttl``; see :meth:`DMutexLock.extend`."""
        return self._extended(await self._drive(self._engine.extend(self._lease, ttl)))

    async def wait_lost(self, timeout: float | None = None) -> bool:
        """Wait until the lease is found lost, or ends, or ``timeout`` seconds pass.

        Returns :attr:`lost`; see :meth:`DMutexLock.wait_lost`. ``timeout``
        is the event loop's time.
        """
        seconds = None if timeout is None else check_timeout(timeout)
        lease = self._lease
        ended, wake = waker()
        if lease.released or not lease.listen(wake):
            return self.lost
        try:
            if not self._settle():
                self._watch()
                for piece in pieces(seconds, asyncio.get_running_loop().time):
                    await asyncio.wait((ended,), timeout=piece)
                    if ended.done():
                        break
        finally:
            lease.unlisten(wake)
            ended.cancel()
        return self.lost

    def _schedule(self, delay: float | None) -> None:
        if delay is not None:
            AsyncRenewer.of(self._loop).add(self, self._engine.clock, delay)

    def _guard(self, delay: float | None) -> None:
        if delay is not None:
            AsyncRenewer.of(self._loop).guard(self, self._engine.clock, delay)

    def _poke(self) -> Callable[[], None]:
        return AsyncRenewer.of(self._loop).poke

    async def _tend(self, group: Sequence[_AsyncHandle]) -> list[float | None]:
        """Renew ``group`` in one batch where it can; see :meth:`DMutexLock._tend`."""
        return await self._drive(self._engine.renew([handle._lease for handle in group]))

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


class AsyncDReadLock(_AsyncHandle):
    """A held read lock; ``async with lock:`` releases it on exit."""

    __slots__ = ()


class AsyncDWriteLock(_AsyncHandle):
    """A held write lock; ``async with lock:`` releases it on exit."""

    __slots__ = ()


class _AsyncFace(Wrapping[H]):
    _ASYNC = True
    _engine: Engine
    _drive: AsyncDriver

    def _start_driver(self, engine: Engine) -> None:
        self._drive = AsyncDriver(engine.clock, engine.prepare)

    async def ready(self) -> None:
        """Prepare the backend once per instance; see :meth:`DMutex.ready`."""
        await self._drive.ready()

    async def acquire(
        self, key: str, ttl: float | None = None, *, auto_renew: bool = False
    ) -> H | None:
        """Try once to take a permit; see :meth:`DMutex.acquire`.

        ``auto_renew=True``: one task of the running event loop renews every
        such lease of the loop.
        """
        # _wrapper(auto_renew), its common case first: one call less per acquire.
        wrap = self._wrap if auto_renew is False else self._wrapper(auto_renew)
        lease = await self._drive(self._engine.acquire(key, ttl))
        return None if lease is None else wrap(lease)

    async def acquire_with_retry(
        self,
        key: str,
        *,
        ttl: float | None = None,
        timeout: float = 30.0,
        retry_delay: float = 0.1,
        auto_renew: bool = False,
    ) -> H | None:
        """Retry until a permit or the timeout; see :meth:`DMutex.acquire_with_retry`."""
        wrap = self._wrapper(auto_renew)
        steps = self._engine.acquire_with_retry(key, ttl, timeout, retry_delay)
        lease = await self._drive(steps)
        return None if lease is None else wrap(lease)

    async def run(
        self,
        key: str,
        callback: Callable[[H], Awaitable[T]],
        ttl: float | None = None,
        *,
        auto_renew: bool = False,
    ) -> T | None:
        """Await ``callback(handle)`` while holding a permit; see :meth:`DMutex.run`.

        With ``auto_renew=True``, a lease lost while the callback runs
        cancels the callback (it runs as a task of its own), and ``run()``
        raises :class:`~dmutex.LeaseLostError` after the release.
        """
        wrap = self._wrapper(auto_renew)
        acquisition = self._engine.acquire(key, ttl)
        steps = self._engine.run(acquisition, callback, wrap, renewing=auto_renew, key=key)
        return cast("T | None", await self._drive(steps))

    async def run_with_retry(
        self,
        key: str,
        callback: Callable[[H], Awaitable[T]],
        *,
        ttl: float | None = None,
        timeout: float = 30.0,
        retry_delay: float = 0.1,
        auto_renew: bool = False,
    ) -> T | None:
        """Like :meth:`run`, acquiring as :meth:`acquire_with_retry` does."""
        wrap = self._wrapper(auto_renew)
        acquisition = self._engine.acquire_with_retry(key, ttl, timeout, retry_delay)
        steps = self._engine.run(
            acquisition, callback, wrap, renewing=auto_renew, key=key, retrying=True
        )
        return cast("T | None", await self._drive(steps))

    async def extend(self, key: str, token: str, ttl: float | None = None) -> bool:
        """Extend the active permit holding ``token``; see :meth:`DMutex.extend`."""
        return await self._drive(self._engine.extend_token(key, token, ttl))

    async def holders(self, key: str) -> list[LockHolder]:
        """Who holds ``key`` now, by slot; see :meth:`DMutex.holders`."""
        return lock_holders(key, await self._drive(self._engine.holders(key)))


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


class _AsyncSide(_AsyncFace[H]):
    """One side of an :class:`AsyncDReadWriteLock`; see ``_SyncSide``."""

    def __init__(self, engine: Engine, drive: AsyncDriver, handle: Callable[..., H]) -> None:
        self._engine = engine
        self._drive = drive
        self._handle = handle

    def _wrap(self, lease: Lease) -> H:
        return self._handle(lease, self._engine, self._drive)


class AsyncDReadWriteLock(ReadWriteBase[AsyncClient]):
    """The asyncio twin of :class:`DReadWriteLock`: many readers or one writer per key."""

    _ASYNC = True

    def _start_driver(self, engine: Engine) -> None:
        self._drive = AsyncDriver(engine.clock, engine.prepare)
        self._read = _AsyncSide(self._reading, self._drive, AsyncDReadLock)
        self._write = _AsyncSide(self._writing, self._drive, AsyncDWriteLock)

    async def ready(self) -> None:
        """Prepare the backend once per instance; see :meth:`DMutex.ready`."""
        await self._drive.ready()

    async def acquire_read(
        self, key: str, ttl: float | None = None, *, auto_renew: bool = False
    ) -> AsyncDReadLock | None:
        """Try once to read-lock ``key``; see :meth:`DReadWriteLock.acquire_read`."""
        return await self._read.acquire(key, ttl, auto_renew=auto_renew)

    async def acquire_write(
        self, key: str, ttl: float | None = None, *, auto_renew: bool = False
    ) -> AsyncDWriteLock | None:
        """Try once to write-lock ``key``; see :meth:`DReadWriteLock.acquire_write`."""
        return await self._write.acquire(key, ttl, auto_renew=auto_renew)

    async def acquire_read_with_retry(
        self,
        key: str,
        *,
        ttl: float | None = None,
        timeout: float = 30.0,
        retry_delay: float = 0.1,
        auto_renew: bool = False,
    ) -> AsyncDReadLock | None:
        """Try to read-lock ``key`` until ``timeout``.

        See :meth:`DReadWriteLock.acquire_read_with_retry`.
        """
        return await self._read.acquire_with_retry(
            key, ttl=ttl, timeout=timeout, retry_delay=retry_delay, auto_renew=auto_renew
        )

    async def acquire_write_with_retry(
        self,
        key: str,
        *,
        ttl: float | None = None,
        timeout: float = 30.0,
        retry_delay: float = 0.1,
        auto_renew: bool = False,
    ) -> AsyncDWriteLock | None:
        """Try to write-lock ``key`` until ``timeout``, keeping new readers out meanwhile.

        See :meth:`DReadWriteLock.acquire_write_with_retry`.
        """
        return await self._write.acquire_with_retry(
            key, ttl=ttl, timeout=timeout, retry_delay=retry_delay, auto_renew=auto_renew
        )

    async def run_read(
        self,
        key: str,
        callback: Callable[[AsyncDReadLock], Awaitable[T]],
        ttl: float | None = None,
        *,
        auto_renew: bool = False,
    ) -> T | None:
        """Await ``callback(lock)`` while read-locking ``key``; see :meth:`AsyncDMutex.run`."""
        return await self._read.run(key, callback, ttl, auto_renew=auto_renew)

    async def run_write(
        self,
        key: str,
        callback: Callable[[AsyncDWriteLock], Awaitable[T]],
        ttl: float | None = None,
        *,
        auto_renew: bool = False,
    ) -> T | None:
        """Await ``callback(lock)`` while write-locking ``key``; see :meth:`AsyncDMutex.run`."""
        return await self._write.run(key, callback, ttl, auto_renew=auto_renew)

    async def run_read_with_retry(
        self,
        key: str,
        callback: Callable[[AsyncDReadLock], Awaitable[T]],
        *,
        ttl: float | None = None,
        timeout: float = 30.0,
        retry_delay: float = 0.1,
        auto_renew: bool = False,
    ) -> T | None:
        """Like :meth:`run_read`, acquiring as :meth:`acquire_read_with_retry` does."""
        return await self._read.run_with_retry(
            key, callback, ttl=ttl, timeout=timeout, retry_delay=retry_delay, auto_renew=auto_renew
        )

    async def run_write_with_retry(
        self,
        key: str,
        callback: Callable[[AsyncDWriteLock], Awaitable[T]],
        *,
        ttl: float | None = None,
        timeout: float = 30.0,
        retry_delay: float = 0.1,
        auto_renew: bool = False,
    ) -> T | None:
        """Like :meth:`run_write`, acquiring as :meth:`acquire_write_with_retry` does."""
        return await self._write.run_with_retry(
            key, callback, ttl=ttl, timeout=timeout, retry_delay=retry_delay, auto_renew=auto_renew
        )

    async def release(self, key: str, token: str) -> bool:
        """Release the active hold of ``key`` holding ``token``.

        See :meth:`DReadWriteLock.release`.
        """
        return await self._drive(self._reading.release_token(key, token))

    async def extend(self, key: str, token: str, ttl: float | None = None) -> bool:
        """Extend the active hold of ``key`` holding ``token`` to now + ``ttl``.

        See :meth:`DReadWriteLock.extend`.
        """
        return await self._drive(self._reading.extend_token(key, token, ttl))

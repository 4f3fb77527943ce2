"""The sync classes: DMutex, DSemaphore and their handles.

Each method validates nothing and decides nothing itself: it asks the engine
for the algorithm's steps and runs them with the instance's
:class:`~dmutex._runtime.drivers.SyncDriver`.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TypeVar, cast

from .._backends.clients import SyncClient
from .._core.engine import Engine
from .._core.lease import Lease
from .._core.waiting import pieces
from .._runtime.drivers import SyncDriver
from .._runtime.renewers import SYNC
from .._validate import check_timeout
from .base import MutexBase, ReadWriteBase, SemaphoreBase, Wrapping
from .handles import HandleBase, SlotMixin
from .holders import LockHolder, lock_holders

__all__ = [
    "DMutex",
    "DMutexLock",
    "DReadLock",
    "DReadWriteLock",
    "DSemaphore",
    "DSemaphorePermit",
    "DWriteLock",
]

T = TypeVar("T")
H = TypeVar("H", bound="_SyncHandle")
Self = TypeVar("Self", bound="_SyncHandle")


class _SyncHandle(HandleBase[SyncDriver]):
    __slots__ = ()

    def release(self) -> bool:
        """Release this permit; False if it had already expired or been released.

        Never touches a permit that another holder took over.
        """
        return self._drive(self._engine.release(self._lease))

    def extend(self, ttl: float | None = None) -> bool:
        """Make this permit expire ``ttl`` seconds from now (default: the instance's).

        Returns False, changing nothing, if the permit is no longer active.
        Updates :attr:`expired_at` on success.
        """
        return self._extended(self._drive(self._engine.extend(self._lease, ttl)))

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block until the lease is found lost, or ends, or ``timeout`` seconds pass.

        Returns :attr:`lost`. Returns at once for a lease already lost or
        released; returns False when another thread releases it meanwhile.
        ``timeout`` is real time, whatever the instance's clock.
        """
        seconds = None if timeout is None else check_timeout(timeout)
        lease = self._lease
        ended = threading.Event()
        if lease.released or not lease.listen(ended.set):
            return self.lost
        try:
            if not self._settle():
                self._watch()
                for piece in pieces(seconds, time.monotonic):
                    if ended.wait(piece):
                        break
        finally:
            lease.unlisten(ended.set)
        return self.lost

    def _schedule(self, delay: float | None) -> None:
        if delay is not None:
            SYNC.add(self, self._engine.clock, delay)

    def _guard(self, delay: float | None) -> None:
        if delay is not None:
            SYNC.guard(self, self._engine.clock, delay)

    def _poke(self) -> Callable[[], None]:
        return SYNC.poke

    def _tend(self, group: Sequence[_SyncHandle]) -> list[float | None]:
        """Renew ``group``, renewed handles of this one's engine, in one batch where it can."""
        return self._drive(self._engine.renew([handle._lease for handle in group]))

    def __enter__(self: Self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # The result is dropped, as run() drops it: an expired lease needs no release.
        self.release()


class DMutexLock(_SyncHandle):
    """A held mutex lock; ``with lock:`` releases it on exit."""

    __slots__ = ()


class DSemaphorePermit(SlotMixin[SyncDriver], _SyncHandle):
    """A held semaphore permit; ``with permit:`` releases it on exit."""

    __slots__ = ()


class DReadLock(_SyncHandle):
    """A held read lock (one of the key's readers); ``with lock:`` releases it on exit."""

    __slots__ = ()


class DWriteLock(_SyncHandle):
    """A held write lock (the key's one holder); ``with lock:`` releases it on exit."""

    __slots__ = ()


class _SyncFace(Wrapping[H]):
    _ASYNC = False
    _engine: Engine
    _drive: SyncDriver

    def _start_driver(self, engine: Engine) -> None:
        self._drive = SyncDriver(engine.clock, engine.prepare)

    def ready(self) -> None:
        """Prepare the backend (MongoDB: create the TTL index), once per instance.

        Every operation waits for this itself; calling it at startup surfaces a
        failure early. Raises what the backend raised.
        """
        self._drive.ready()

    def acquire(self, key: str, ttl: float | None = None, *, auto_renew: bool = False) -> H | None:
        """Try once to take a permit for ``key``, valid for ``ttl`` seconds.

        Returns a handle, or None when all permits are held by others. Every
        other failure raises. ``auto_renew=True``: dmutex's renewal thread
        extends the lease by ``ttl`` every third of it until it is released
        or its handle is garbage-collected, and reports a loss on the handle
        (``lost``, ``on_lost``, ``wait_lost``). The client is then called
        from that thread too.
        """
        # _wrapper(auto_renew), its common case first: one call less per acquire.
        wrap = self._wrap if auto_renew is False else self._wrapper(auto_renew)
        lease = self._drive(self._engine.acquire(key, ttl))
        return None if lease is None else wrap(lease)

    def acquire_with_retry(
        self,
        key: str,
        *,
        ttl: float | None = None,
        timeout: float = 30.0,
        retry_delay: float = 0.1,
        auto_renew: bool = False,
    ) -> H | None:
        """Try to take a permit, every ``retry_delay`` seconds, for ``timeout`` seconds.

        Returns a handle, or None when the timeout passed first. Never sleeps
        past the deadline; measures time on a monotonic clock. ``auto_renew``
        as for :meth:`acquire`.
        """
        wrap = self._wrapper(auto_renew)
        lease = self._drive(self._engine.acquire_with_retry(key, ttl, timeout, retry_delay))
        return None if lease is None else wrap(lease)

    def run(
        self,
        key: str,
        callback: Callable[[H], T],
        ttl: float | None = None,
        *,
        auto_renew: bool = False,
    ) -> T | None:
        """Run ``callback(handle)`` while holding a permit; release it afterwards.

        Returns the callback's result, or None (without calling it) when all
        permits are held. If the callback raises, the permit is released and
        the exception propagates. Without ``auto_renew`` the lease is not
        renewed: call ``handle.extend()`` in long callbacks.

        ``auto_renew=True`` renews it while the callback runs. A thread
        cannot be interrupted, so a lease lost meanwhile is reported after
        the callback returns: ``run()`` then raises
        :class:`~dmutex.LeaseLostError` instead of returning the result (the
        callback may call ``handle.raise_if_lost()`` between its steps).
        """
        wrap = self._wrapper(auto_renew)
        acquisition = self._engine.acquire(key, ttl)
        steps = self._engine.run(acquisition, callback, wrap, renewing=auto_renew, key=key)
        return cast("T | None", self._drive(steps))

    def run_with_retry(
        self,
        key: str,
        callback: Callable[[H], T],
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
        return cast("T | None", self._drive(steps))

    def extend(self, key: str, token: str, ttl: float | None = None) -> bool:
        """Extend the active permit of ``key`` holding ``token`` to now + ``ttl``.

        Returns False, changing nothing, if no active permit holds ``token``.
        """
        return self._drive(self._engine.extend_token(key, token, ttl))

    def holders(self, key: str) -> list[LockHolder]:
        """Who holds ``key`` now: its active permits, by slot; changes nothing.

        Any process can ask, with any instance of the same names: each
        holder's ``identity`` and ``since`` are read from its token (None
        for a holder that stamped none, such as the TypeScript library). One
        read; raises what the client raises.
        """
        return lock_holders(key, self._drive(self._engine.holders(key)))


class DSemaphore(_SyncFace[DSemaphorePermit], SemaphoreBase[SyncClient]):
    """A distributed semaphore: at most ``max_permits`` holders per key.

    Each permit is a token-protected lease with a TTL, kept in Redis, MongoDB,
    PostgreSQL, MySQL/MariaDB, an :class:`SQLiteBackend` file or an
    :class:`InMemoryBackend`. A holder that stops without releasing loses its
    permit when the TTL runs out.
    All callers of one key must use the same ``max_permits``.
    """

    def _wrap(self, lease: Lease) -> DSemaphorePermit:
        return DSemaphorePermit(lease, self._engine, self._drive)

    def release(self, key: str, token: str) -> bool:
        """Release the active permit of ``key`` holding ``token``.

        Returns False, changing nothing, if no active permit holds it.
        """
        return self._drive(self._engine.release_token(key, token))


class DMutex(_SyncFace[DMutexLock], MutexBase[SyncClient]):
    """A distributed mutex: one holder per key at a time (a one-permit semaphore).

    The lock is a token-protected lease with a TTL, kept in Redis, MongoDB,
    PostgreSQL, MySQL/MariaDB, an :class:`SQLiteBackend` file or an
    :class:`InMemoryBackend`. A holder that stops without releasing loses the
    lock when the TTL runs out; one that outlives its TTL must ``extend()`` or
    it may find another holder in its place.
    """

    def _wrap(self, lease: Lease) -> DMutexLock:
        return DMutexLock(lease, self._engine, self._drive)

    def lock(self, key: str, ttl: float | None = None) -> bool:
        """Deprecated: use :meth:`acquire`. Take the lock and remember its token.

        Returns True if taken. :meth:`unlock` on this instance releases it.
        """
        warnings.warn(
            "DMutex.lock() is deprecated; use acquire(), whose handle carries its token",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._drive(self._engine.lock(key, ttl))

    def unlock(self, key: str, token: str | None = None) -> bool:
        """Deprecated: use the handle's ``release()``. Release by token.

        Without ``token``, uses the token this instance remembered from
        :meth:`lock`; with neither, returns False and touches nothing.
        """
        warnings.warn(
            "DMutex.unlock() is deprecated; use the handle's release()",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._drive(self._engine.unlock(key, token))


class _SyncSide(_SyncFace[H]):
    """One side of a :class:`DReadWriteLock`: its engine, the lock's driver, its handle class."""

    def __init__(self, engine: Engine, drive: SyncDriver, handle: Callable[..., H]) -> None:
        self._engine = engine
        self._drive = drive
        self._handle = handle

    def _wrap(self, lease: Lease) -> H:
        return self._handle(lease, self._engine, self._drive)


class DReadWriteLock(ReadWriteBase[SyncClient]):
    """A distributed read-write lock: any number of readers, or one writer, per key.

    Each hold, read or write, is a token-protected lease with a TTL, as a
    :class:`DMutex` lock is, with the same renewal, loss reporting and
    fencing; a writer's fence is above every fence handed out before it on
    the key. A writer waiting in :meth:`acquire_write_with_retry` keeps new
    readers out until it gets in or gives up, so readers cannot starve it;
    one that dies while waiting holds them back for ``retry_delay`` + 2 s at
    most. All callers of one key must use the same ``max_readers``.
    """

    _ASYNC = False

    def _start_driver(self, engine: Engine) -> None:
        self._drive = SyncDriver(engine.clock, engine.prepare)
        self._read = _SyncSide(self._reading, self._drive, DReadLock)
        self._write = _SyncSide(self._writing, self._drive, DWriteLock)

    def ready(self) -> None:
        """Prepare the backend once per instance; see :meth:`DMutex.ready`."""
        self._drive.ready()

    def acquire_read(
        self, key: str, ttl: float | None = None, *, auto_renew: bool = False
    ) -> DReadLock | None:
        """Try once to read-lock ``key``; None while a writer holds it or waits for it.

        Also None when ``max_readers`` readers hold it. Otherwise as
        :meth:`DMutex.acquire`.
        """
        return self._read.acquire(key, ttl, auto_renew=auto_renew)

    def acquire_write(
        self, key: str, ttl: float | None = None, *, auto_renew: bool = False
    ) -> DWriteLock | None:
        """Try once to write-lock ``key``; None while anyone else holds it.

        A single attempt leaves no intent: readers are not held back. Otherwise
        as :meth:`DMutex.acquire`.
        """
        return self._write.acquire(key, ttl, auto_renew=auto_renew)

    def acquire_read_with_retry(
        self,
        key: str,
        *,
        ttl: float | None = None,
        timeout: float = 30.0,
        retry_delay: float = 0.1,
        auto_renew: bool = False,
    ) -> DReadLock | None:
        """Try to read-lock ``key`` until ``timeout``; see :meth:`DMutex.acquire_with_retry`.

        Woken when a writer releases or gives up, where the backend wakes waiters.
        """
        return self._read.acquire_with_retry(
            key, ttl=ttl, timeout=timeout, retry_delay=retry_delay, auto_renew=auto_renew
        )

    def acquire_write_with_retry(
        self,
        key: str,
        *,
        ttl: float | None = None,
        timeout: float = 30.0,
        retry_delay: float = 0.1,
        auto_renew: bool = False,
    ) -> DWriteLock | None:
        """Try to write-lock ``key`` until ``timeout``, keeping new readers out meanwhile.

        Each failed attempt but the last leaves this writer's intent, which
        refuses new readers for ``retry_delay`` + 2 s; the grant, the last
        attempt and an error withdraw it. Otherwise as
        :meth:`DMutex.acquire_with_retry`.
        """
        return self._write.acquire_with_retry(
            key, ttl=ttl, timeout=timeout, retry_delay=retry_delay, auto_renew=auto_renew
        )

    def run_read(
        self,
        key: str,
        callback: Callable[[DReadLock], T],
        ttl: float | None = None,
        *,
        auto_renew: bool = False,
    ) -> T | None:
        """Run ``callback(lock)`` while read-locking ``key``; see :meth:`DMutex.run`."""
        return self._read.run(key, callback, ttl, auto_renew=auto_renew)

    def run_write(
        self,
        key: str,
        callback: Callable[[DWriteLock], T],
        ttl: float | None = None,
        *,
        auto_renew: bool = False,
    ) -> T | None:
        """Run ``callback(lock)`` while write-locking ``key``; see :meth:`DMutex.run`."""
        return self._write.run(key, callback, ttl, auto_renew=auto_renew)

    def run_read_with_retry(
        self,
        key: str,
        callback: Callable[[DReadLock], T],
        *,
        ttl: float | None = None,
        timeout: float = 30.0,
        retry_delay: float = 0.1,
        auto_renew: bool = False,
    ) -> T | None:
        """Like :meth:`run_read`, acquiring as :meth:`acquire_read_with_retry` does."""
        return self._read.run_with_retry(
            key, callback, ttl=ttl, timeout=timeout, retry_delay=retry_delay, auto_renew=auto_renew
        )

    def run_write_with_retry(
        self,
        key: str,
        callback: Callable[[DWriteLock], T],
        *,
        ttl: float | None = None,
        timeout: float = 30.0,
        retry_delay: float = 0.1,
        auto_renew: bool = False,
    ) -> T | None:
        """Like :meth:`run_write`, acquiring as :meth:`acquire_write_with_retry` does."""
        return self._write.run_with_retry(
            key, callback, ttl=ttl, timeout=timeout, retry_delay=retry_delay, auto_renew=auto_renew
        )

    def release(self, key: str, token: str) -> bool:
        """Release the active hold (read or write) of ``key`` holding ``token``.

        Returns False, changing nothing, if no active hold has it. A waiting
        writer's token also withdraws its intent.
        """
        return self._drive(self._reading.release_token(key, token))

    def extend(self, key: str, token: str, ttl: float | None = None) -> bool:
        """Extend the active hold (read or write) of ``key`` holding ``token`` to now + ``ttl``.

        Returns False, changing nothing, if no active hold has it.
        """
        return self._drive(self._reading.extend_token(key, token, ttl))

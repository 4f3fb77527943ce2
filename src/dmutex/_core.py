"""The lock algorithms, written once and free of I/O.

:class:`Engine` holds one instance's settings and returns, for each public
operation, a generator of effects (see ``_effects.py``). ``_drive.py`` runs
those generators for the sync classes and for the asyncio classes; neither
face repeats any of the logic here.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ._clock import Clock
from ._effects import Call, Gate, Sleep, Steps
from ._errors import InvalidArgumentError
from ._store import MAX_EXPIRY_MS, Store, now_ms
from ._validate import (
    check_callback,
    check_key,
    check_retry_delay,
    check_timeout,
    check_token,
    check_ttl,
)

H = TypeVar("H")
T = TypeVar("T")

_ENTER = Gate(enter=True)
_LEAVE = Gate(enter=False)


def ttl_to_ms(seconds: float, clock: Clock, max_expiry_ms: int = MAX_EXPIRY_MS) -> int:
    """``seconds`` in whole milliseconds, if an expiry that far ahead can be stored.

    Rounds up, as the TypeScript library does for ``PX``, so a lease never
    lasts less than asked.
    """
    limit = min(MAX_EXPIRY_MS, max_expiry_ms)
    # Compare before multiplying: seconds * 1000 overflows to inf near 1e305.
    if seconds > limit / 1000 or now_ms(clock) + math.ceil(seconds * 1000) > limit:
        raise InvalidArgumentError(f"ttl={seconds} puts the expiry past what the backend can store")
    return math.ceil(seconds * 1000)


def new_token() -> str:
    """A random UUID4 string, as ``str(uuid.uuid4())`` gives, in half the time.

    It runs once per acquire: the version and variant bits are set on 16
    random bytes, which is all ``uuid4`` does.
    """
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40
    raw[8] = (raw[8] & 0x3F) | 0x80
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@dataclass(slots=True)
class Lease:
    """The state of one acquired permit, shared by its handle and the engine.

    ``expires_ms`` moves forward on a successful extend.
    """

    key: str
    token: str
    slot: int
    expires_ms: int
    fence: int | None = None


class Engine:
    """One DMutex/DSemaphore instance's algorithms over one store."""

    def __init__(self, store: Store, *, default_ttl: float) -> None:
        self._store = store
        # The store's clock, which also times retries; fixed for the store's life.
        self.clock: Clock = store.clock
        self.default_ttl = default_ttl
        # The default in ms, checked once, when no process could live to see it
        # pass the latest storable expiry (a century of margin); else None, and
        # it is checked on every use like any other TTL.
        default_ms = ttl_to_ms(default_ttl, self.clock, store.max_expiry_ms)
        margin = 100 * 365 * 86_400_000
        fits = now_ms(self.clock) + default_ms + margin <= store.max_expiry_ms
        self._default_ms: int | None = default_ms if fits else None
        self._ready = False
        # The ready gate, one per face; only the face's own driver uses its gate.
        self.thread_gate = threading.Lock()
        self.task_gate = asyncio.Lock()
        # Deprecated lock()/unlock(): the token of the last lock() per key.
        self._remembered: dict[str, str] = {}
        self._remembered_lock = threading.Lock()

    def ttl_ms(self, ttl: object | None) -> int:
        """Validate ``ttl`` (None: the default) and return it in whole milliseconds."""
        if ttl is None and self._default_ms is not None:
            return self._default_ms
        seconds = self.default_ttl if ttl is None else check_ttl("ttl", ttl)
        return ttl_to_ms(seconds, self.clock, self._store.max_expiry_ms)

    def ready(self) -> Steps[None]:
        """Prepare the store once per instance; concurrent callers wait for it.

        A failure propagates and leaves the instance unprepared, so the next
        operation tries again and surfaces the error again.
        """
        if self._ready:
            return
        yield _ENTER
        try:
            if not self._ready:
                yield from self._store.ready()
                self._ready = True
        finally:
            yield _LEAVE

    def acquire(self, key: str, ttl: float | None) -> Steps[Lease | None]:
        """Try once to take a permit; None only when all permits are active."""
        check_key(key)
        ttl_ms = self.ttl_ms(ttl)
        if not self._ready:
            yield from self.ready()
        token = new_token()
        grant = yield from self._store.acquire(key, token, ttl_ms)
        if grant is None:
            return None
        return Lease(key, token, grant.slot, grant.expires_ms, grant.fence)

    def acquire_with_retry(
        self, key: str, ttl: float | None, timeout: float, retry_delay: float
    ) -> Steps[Lease | None]:
        """Try to take a permit until ``timeout`` seconds have passed.

        Sleeps ``retry_delay`` between attempts, never past the deadline, and
        makes one last attempt at the deadline. Time is monotonic.
        """
        check_key(key)
        self.ttl_ms(ttl)
        timeout = check_timeout(timeout)
        retry_delay = check_retry_delay(retry_delay)
        deadline = self.clock.monotonic() + timeout
        while True:
            lease = yield from self.acquire(key, ttl)
            if lease is not None:
                return lease
            remaining = deadline - self.clock.monotonic()
            if remaining <= 0:
                return None
            yield Sleep(min(retry_delay, remaining))

    def run(
        self,
        acquisition: Steps[Lease | None],
        callback: Callable[[H], object],
        wrap: Callable[[Lease], H],
    ) -> Steps[object]:
        """Run ``callback(wrap(lease))`` while holding the lease ``acquisition`` takes.

        Returns None without calling it when no lease was taken. Releases in a
        ``finally``, so an exception from the callback propagates after the
        release. Never renews the lease.
        """
        check_callback(callback)
        lease = yield from acquisition
        if lease is None:
            return None
        try:
            return (yield Call(callback, (wrap(lease),), role="callback"))
        finally:
            yield from self.release(lease)

    def release(self, lease: Lease) -> Steps[bool]:
        """Release the permit of ``lease`` if it is still active."""
        steps = self._store.release(lease.key, lease.token, lease.slot)
        # Once ready, the store's own steps, with no frame of ours around them.
        return steps if self._ready else self._after_ready(steps)

    def _after_ready(self, steps: Steps[T]) -> Steps[T]:
        yield from self.ready()
        return (yield from steps)

    def extend(self, lease: Lease, ttl: float | None) -> Steps[bool]:
        """Set the expiry of ``lease`` to now + ttl if it is still active."""
        ttl_ms = self.ttl_ms(ttl)
        yield from self.ready()
        expires = yield from self._store.extend(lease.key, lease.token, lease.slot, ttl_ms)
        if expires is None:
            return False
        lease.expires_ms = expires
        return True

    def release_token(self, key: str, token: str) -> Steps[bool]:
        """Release the active permit of ``key`` that holds ``token``."""
        check_key(key)
        check_token(token)
        yield from self.ready()
        return (yield from self._store.release(key, token, None))

    def extend_token(self, key: str, token: str, ttl: float | None) -> Steps[bool]:
        """Extend the active permit of ``key`` that holds ``token``."""
        check_key(key)
        check_token(token)
        ttl_ms = self.ttl_ms(ttl)
        yield from self.ready()
        expires = yield from self._store.extend(key, token, None, ttl_ms)
        return expires is not None

    def lock(self, key: str, ttl: float | None) -> Steps[bool]:
        """Deprecated ``lock()``: acquire and remember the token for ``unlock``."""
        lease = yield from self.acquire(key, ttl)
        if lease is None:
            return False
        with self._remembered_lock:
            self._remembered[key] = lease.token
        return True

    def unlock(self, key: str, token: str | None) -> Steps[bool]:
        """Deprecated ``unlock()``: release by ``token``, else by the remembered one.

        With no token given and none remembered, returns False without I/O:
        there is nothing this instance may release.
        """
        check_key(key)
        if token is None:
            with self._remembered_lock:
                token = self._remembered.get(key)
            if token is None:
                return False
        released = yield from self.release_token(key, token)
        # Whatever the answer, that token no longer guards anything for us.
        with self._remembered_lock:
            if self._remembered.get(key) == token:
                del self._remembered[key]
        return released

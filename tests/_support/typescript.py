"""The TypeScript dmutex's semaphore replayed over any of its stores, and dmutex's side beside it.

The interop tests (``tests/integration/test_*_typescript.py``) replay what a
TypeScript service sends. What depends on the store (its statements) is
each test's subclass of :class:`TypeScriptSemaphore`; what does not is
here: the slot loops of the TypeScript library's ``src/semaphore.ts``
(``DSemaphore``; its ``DMutex`` is a one-permit semaphore), and
:class:`PythonSide`, dmutex's public classes on one client of either face.
"""

from __future__ import annotations

import inspect
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from dmutex import AsyncDMutex, AsyncDSemaphore, DMutex, DSemaphore

E = TypeVar("E")
T = TypeVar("T")


@dataclass
class Permit(Generic[E]):
    """What semaphore.ts's ``acquire`` answers: the slot, the token, the stored expiry."""

    slot: int
    token: str
    expired_at: E


class TypeScriptSemaphore(ABC, Generic[E]):
    """semaphore.ts's slot loops over a store's ``acquire``, ``release`` and ``extend``."""

    max_permits: int

    @abstractmethod
    def store_acquire(self, key: str, token: str, ttl_seconds: float) -> E | None:
        """The store's acquire of one slot's row: its expiry if granted."""

    @abstractmethod
    def store_release(self, key: str, token: str) -> bool:
        """The store's release of one slot's row."""

    @abstractmethod
    def store_extend(self, key: str, token: str, ttl_seconds: float) -> E | None:
        """The store's extend of one slot's row: its new expiry if extended."""

    @staticmethod
    def slot_key(key: str, slot: int) -> str:
        return f"permit:{slot}:{key}"

    def acquire(self, key: str, ttl: float = 300) -> Permit[E] | None:
        token = str(uuid.uuid4())
        for slot in range(self.max_permits):
            expired_at = self.store_acquire(self.slot_key(key, slot), token, ttl)
            if expired_at is not None:
                return Permit(slot, token, expired_at)
        return None

    def acquire_with_retry(
        self, key: str, ttl: float, timeout: float, retry_delay: float
    ) -> Permit[E] | None:
        deadline = time.monotonic() + timeout
        while True:
            permit = self.acquire(key, ttl)
            if permit is not None:
                return permit
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            time.sleep(min(retry_delay, remaining))

    def release(self, key: str, token: str) -> bool:
        return any(
            self.store_release(self.slot_key(key, slot), token) for slot in range(self.max_permits)
        )

    def extend(self, key: str, token: str, ttl: float = 300) -> bool:
        return any(
            self.store_extend(self.slot_key(key, slot), token, ttl) is not None
            for slot in range(self.max_permits)
        )


class PythonSide:
    """dmutex's public classes on one client, each call run to its end.

    A subclass sets ``client``, and ``loop`` for an asyncio client (None for
    a sync one), and closes them.
    """

    loop: Any
    client: Any

    def run(self, value: object) -> Any:
        """``value``, awaited on this side's loop if it is awaitable (the classes' answers)."""
        if inspect.isawaitable(value):
            assert self.loop is not None
            return self.loop.run_until_complete(_awaited(value))
        return value

    def mutex(self, service: str, **options: Any) -> Any:
        return (DMutex if self.loop is None else AsyncDMutex)(service, self.client, **options)

    def semaphore(self, service: str, permits: int, **options: Any) -> Any:
        kind = DSemaphore if self.loop is None else AsyncDSemaphore
        return kind(service, self.client, max_permits=permits, **options)


async def _awaited(work: Awaitable[T]) -> T:
    return await work

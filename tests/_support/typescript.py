"""The TypeScript dmutex's semaphore replayed over any of its stores, and dmutex's side beside it.

The SQL interop suite (``tests/integration/test_sql_typescript.py``) replays
what a TypeScript service sends. What depends on the store is a
:class:`Dialect` of its own module (``typescript_postgres.py``,
``typescript_mysql.py``): its statements, verbatim, in a subclass of
:class:`TypeScriptSemaphore`, its connections and how its table is read.
What does not is here: the slot loops of the TypeScript library's
``src/semaphore.ts`` (``DSemaphore``; its ``DMutex`` is a one-permit
semaphore), :class:`PythonSide`, dmutex's public classes on one client of
either face, and :class:`Dialect`, what the suite asks of each store.
"""

from __future__ import annotations

import inspect
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar, Generic, TypeVar

from dmutex import AsyncDMutex, AsyncDSemaphore, DMutex, DSemaphore

C = TypeVar("C")
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


class PythonSide(ABC):
    """dmutex's public classes on one client, each call run to its end.

    A subclass sets ``client``, and ``loop`` for an asyncio client (None for
    a sync one), and closes them.
    """

    loop: Any
    client: Any

    @abstractmethod
    def close(self) -> None:
        """Close the client, and the loop if there is one."""

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


class Dialect(ABC, Generic[C, E]):
    """What the SQL interop suite asks of one store: connections, the replay, the table.

    ``C`` is a plain autocommit connection that counts the statements it
    sends (``sent``), ``E`` an expiry as the store's table and the
    TypeScript store give it. The differences that are data, not SQL, are
    class attributes.
    """

    name: ClassVar[str]
    sides: ClassVar[tuple[str, ...]]
    """dmutex's clients: a test that takes a side runs once with each."""
    race_sides: ClassVar[tuple[str, ...]]
    """The dmutex semaphores that race two TypeScript ones, one thread each."""
    race_rounds: ClassVar[int]
    """Each racer's cycles."""
    race_pause: ClassVar[float]
    """A TypeScript racer's other work between two holds, in seconds."""
    overtaken: ClassVar[tuple[int, str]]
    """The statements dmutex sends when a TypeScript commit overtakes its take, and why."""

    @abstractmethod
    def connect(self) -> C:
        """A plain autocommit connection, as dmutex's clients are given here."""

    @abstractmethod
    def typescript_connection(self) -> C:
        """A connection as the TypeScript store's driver opens one."""

    @abstractmethod
    def python(self, kind: str) -> PythonSide:
        """dmutex's public classes on a new client of ``kind`` (one of :attr:`sides`)."""

    @abstractmethod
    def semaphore(self, conn: C, service: str, permits: int) -> TypeScriptSemaphore[E]:
        """The TypeScript ``DSemaphore`` on ``conn``, as its constructor leaves the table."""

    @abstractmethod
    def mutex(self, conn: C, service: str) -> TypeScriptSemaphore[E]:
        """The TypeScript ``DMutex`` on ``conn``, as its constructor leaves the table."""

    @abstractmethod
    def typescript(self, conn: C, raw: C, service: str, permits: int) -> TypeScriptSemaphore[E]:
        """The TypeScript ``DSemaphore`` on a table that both libraries use as it is."""

    @abstractmethod
    def typescript_mutex(self, conn: C, raw: C, service: str) -> TypeScriptSemaphore[E]:
        """The TypeScript ``DMutex`` on a table that both libraries use as it is."""

    @abstractmethod
    def rows(self, raw: C, table: str) -> dict[str, tuple[str, E]]:
        """The table's rows: key -> (value, expired_at)."""

    @abstractmethod
    def expiry_ms(self, at: E) -> int:
        """A stored or TypeScript expiry as epoch ms."""

    @abstractmethod
    def ms(self, at: datetime) -> int:
        """A dmutex handle's ``expired_at`` as epoch ms."""

    @abstractmethod
    def age(self, raw: C, table: str, key: str) -> None:
        """Let the lease in ``key``'s row run out now, without sleeping."""

    @abstractmethod
    def drop(self, raw: C, table: str) -> None:
        """Drop ``table`` if it exists."""

    @abstractmethod
    def uncommitted(self, conn: C) -> AbstractContextManager[None]:
        """A transaction on ``conn``, committed at the block's end."""

    @abstractmethod
    def blocked(self, raw: C, conn: C, late: C) -> Callable[[], None]:
        """A wait until ``conn``'s statement waits on a row lock that ``late`` holds."""


class Race:
    """The bookkeeping of a race of both libraries' semaphores on one key, thread per racer.

    Each racer calls :meth:`hold` between its grant and its release: a slot
    held twice at once, or more than ``permits`` held, is an over-grant
    (:attr:`faults`). :attr:`mixed` counts the moments a TypeScript racer
    (a name starting ``ts-``) and a dmutex one held permits together.
    """

    def __init__(self, permits: int, racers: int) -> None:
        self.permits = permits
        self.inside: dict[int, str] = {}
        self.faults: list[str] = []
        self.cycles: dict[str, int] = {}
        self.mixed = 0
        self.errors: list[BaseException] = []
        self.start = threading.Barrier(racers, timeout=30)
        self._guard = threading.Lock()

    def hold(self, slot: int, who: str) -> None:
        """Hold ``slot`` a moment as ``who``, recording any over-grant."""
        with self._guard:
            if slot in self.inside or len(self.inside) >= self.permits:
                self.faults.append(f"{who} got slot {slot} while {self.inside} held")
            self.inside[slot] = who
            if len({name.startswith("ts-") for name in self.inside.values()}) == 2:
                self.mixed += 1
        time.sleep(0.001)  # a holder stays a moment, so that an overlap would show
        with self._guard:
            del self.inside[slot]

    def cycled(self, who: str) -> None:
        """Count one completed cycle of ``who``."""
        with self._guard:
            self.cycles[who] = self.cycles.get(who, 0) + 1

    def run(self, racers: Mapping[str, Callable[[str], None]], timeout: float) -> None:
        """Run each racer (name: work) in a thread of its own; every one must end in time."""

        def guarded(work: Callable[[str], None], who: str) -> None:
            try:
                work(who)
            except BaseException as error:  # noqa: BLE001 - reported by the caller
                self.errors.append(error)

        threads = [
            threading.Thread(target=guarded, args=(work, who)) for who, work in racers.items()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=timeout)
        assert not any(thread.is_alive() for thread in threads), "bounded: every racer ended"


async def _awaited(work: Awaitable[T]) -> T:
    return await work

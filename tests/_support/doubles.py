"""Client doubles that record every call that reaches them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from dmutex._backends.redis.scripts import ACQUIRE, MUTEX_ACQUIRE


class RecordingRedis:
    """Redis-shaped: records commands and answers none."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def execute_command(self, *args: object) -> object:
        self.calls.append(args)
        raise AssertionError(f"no command should reach the client: {args!r}")


class RecordingMongo:
    """Mongo-shaped: records get_database calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def get_database(self, name: str) -> Any:
        self.calls.append(("get_database", name))
        raise AssertionError("no call should reach the client")


class RecordingBoth(RecordingRedis):
    """Matches both contracts."""

    def get_database(self, name: str) -> Any:
        self.calls.append(("get_database", name))
        raise AssertionError("no call should reach the client")


class _NoInfo:
    """A connection's ``info``: reading it is a call, and is recorded."""

    def __init__(self, calls: list[tuple[object, ...]]) -> None:
        self._calls = calls

    @property
    def transaction_status(self) -> int:
        self._calls.append(("info.transaction_status",))
        raise AssertionError("no call should reach the client")


class RecordingPsycopg:
    """psycopg-shaped and sync (``execute`` beside ``info``): records every call, answers none."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.info = _NoInfo(self.calls)

    @property
    def autocommit(self) -> bool:
        self.calls.append(("autocommit",))
        raise AssertionError("no call should reach the client")

    def execute(self, query: str, params: object = None, **options: object) -> Any:
        self.calls.append(("execute", query))
        raise AssertionError("no statement should reach the client")

    def transaction(self) -> Any:
        self.calls.append(("transaction",))
        raise AssertionError("no call should reach the client")


class AsyncRecordingPsycopg(RecordingPsycopg):
    """psycopg-shaped and asyncio: ``execute`` is a coroutine function."""

    async def execute(self, query: str, params: object = None, **options: object) -> Any:
        self.calls.append(("execute", query))
        raise AssertionError("no statement should reach the client")


class RecordingAsyncpg:
    """asyncpg-shaped (``fetch`` beside ``fetchrow``, coroutine functions): records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    async def fetch(self, query: str, *args: object) -> Any:
        self.calls.append(("fetch", query))
        raise AssertionError("no statement should reach the client")

    async def fetchrow(self, query: str, *args: object) -> Any:
        self.calls.append(("fetchrow", query))
        raise AssertionError("no statement should reach the client")


class RecordingRedisPsycopg(RecordingRedis, RecordingPsycopg):
    """Matches the Redis and the PostgreSQL (psycopg) contracts."""

    def __init__(self) -> None:
        RecordingPsycopg.__init__(self)


class AnsweringRedis:
    """Redis-shaped and sync: records every command and answers as a free server would.

    ``SET`` answers OK (the key was free); the acquire script answers
    ``[0, 1]`` (slot 0 taken, fence 1), the mutex's 1 (fence 1), the others
    0 (nothing released or extended).
    """

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def answer(self, args: tuple[object, ...]) -> object:
        self.calls.append(args)
        if args[0] == "SET":
            return "OK"
        if args[1] in (MUTEX_ACQUIRE.sha, MUTEX_ACQUIRE.text):
            return 1
        return [0, 1] if args[1] in (ACQUIRE.sha, ACQUIRE.text) else 0

    def execute_command(self, *args: object) -> object:
        return self.answer(args)

    def count(self, command: str) -> int:
        """How many ``command`` requests reached the client."""
        return sum(1 for call in self.calls if call[0] == command)


class AsyncAnsweringRedis(AnsweringRedis):
    """:class:`AnsweringRedis` for the asyncio classes."""

    async def execute_command(self, *args: object) -> object:
        return self.answer(args)


class _Result:
    """What pymongo's write results show dmutex: one document matched or deleted."""

    matched_count = 1
    deleted_count = 1
    upserted_id = None


class PreparingMongo:
    """Mongo-shaped and sync: ``create_index`` calls ``prepare``; every write succeeds.

    It is its own database and collection, so that a test sees when dmutex
    prepares the store (a stand-in for a slow or failing ``createIndexes``).
    """

    def __init__(self, prepare: Callable[[], object]) -> None:
        self.prepare = prepare

    def get_database(self, name: str) -> PreparingMongo:
        return self

    def get_collection(self, name: str) -> PreparingMongo:
        return self

    def create_index(self, keys: object, **options: object) -> object:
        return self.prepare()

    def update_one(self, *args: object, **options: object) -> _Result:
        return _Result()

    def delete_one(self, *args: object) -> _Result:
        return _Result()

    def distinct(self, *args: object) -> list[object]:
        return []


class AsyncPreparingMongo:
    """:class:`PreparingMongo` for the asyncio classes (``prepare`` is awaited)."""

    def __init__(self, prepare: Callable[[], Awaitable[object]]) -> None:
        self.prepare = prepare

    def get_database(self, name: str) -> AsyncPreparingMongo:
        return self

    def get_collection(self, name: str) -> AsyncPreparingMongo:
        return self

    async def create_index(self, keys: object, **options: object) -> object:
        return await self.prepare()

    async def update_one(self, *args: object, **options: object) -> _Result:
        return _Result()

    async def delete_one(self, *args: object) -> _Result:
        return _Result()

    async def distinct(self, *args: object) -> list[object]:
        return []


class RecordingMySQL:
    """A MySQL DB-API connection's shape (``cursor`` beside ``get_server_info``), sync.

    Records every call and answers none.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def cursor(self) -> Any:
        self.calls.append(("cursor",))
        raise AssertionError("no statement should reach the client")

    def commit(self) -> None:
        self.calls.append(("commit",))
        raise AssertionError("no call should reach the client")

    def rollback(self) -> None:
        self.calls.append(("rollback",))
        raise AssertionError("no call should reach the client")

    def get_server_info(self) -> str:
        self.calls.append(("get_server_info",))
        raise AssertionError("no call should reach the client")


class AsyncRecordingMySQL(RecordingMySQL):
    """The same, asyncio: ``commit`` and ``rollback`` are coroutine functions (aiomysql's)."""

    async def commit(self) -> None:  # type: ignore[override]  # the asyncio face of commit
        self.calls.append(("commit",))
        raise AssertionError("no call should reach the client")

    async def rollback(self) -> None:  # type: ignore[override]  # the asyncio face of rollback
        self.calls.append(("rollback",))
        raise AssertionError("no call should reach the client")


class Dialect:
    """A SQLAlchemy dialect's name and driver, all that dmutex reads of it."""

    def __init__(self, name: str, driver: str) -> None:
        self.name, self.driver = name, driver


class StandInEngine:
    """A sync engine's shape (``raw_connection`` is never called: the driver is refused first)."""

    def __init__(self, name: str, driver: str) -> None:
        self.dialect = Dialect(name, driver)

    def raw_connection(self) -> object:
        raise AssertionError("no I/O before the driver is checked")


class StandInAsyncEngine(StandInEngine):
    """An asyncio engine's shape, as :class:`StandInEngine`."""

    sync_engine = "the engine it wraps"

    async def raw_connection(self) -> object:
        raise AssertionError("no I/O before the driver is checked")

    def connect(self) -> object:
        raise AssertionError("no I/O before the driver is checked")

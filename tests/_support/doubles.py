"""Client doubles that record every call that reaches them."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from dmutex import InMemoryBackend
from dmutex._effects import Steps
from dmutex._memory import _MemoryStore
from dmutex._store import Grant, Namespace


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


class _RecordingStore(_MemoryStore):
    def __init__(self, store: _MemoryStore, calls: list[tuple[object, ...]]) -> None:
        super().__init__(store._backend, store._prefix, store._max_permits)
        self._calls = calls

    def ready(self) -> Steps[None]:
        self._calls.append(("ready",))
        return (yield from super().ready())

    def acquire(self, key: str, token: str, ttl_ms: int) -> Steps[Grant | None]:
        self._calls.append(("acquire", key, ttl_ms))
        return (yield from super().acquire(key, token, ttl_ms))

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        self._calls.append(("release", key, slot))
        return (yield from super().release(key, token, slot))

    def extend(
        self, key: str, token: str, slot: int | None, ttl_ms: int
    ) -> Generator[Any, object, int | None]:
        self._calls.append(("extend", key, slot, ttl_ms))
        return (yield from super().extend(key, token, slot, ttl_ms))


class RecordingBackend(InMemoryBackend):
    """An InMemoryBackend whose stores record every operation they are asked for."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.calls: list[tuple[object, ...]] = []

    def _bind(self, namespace: Namespace) -> _MemoryStore:
        return _RecordingStore(super()._bind(namespace), self.calls)

    def count(self, operation: str) -> int:
        return sum(1 for call in self.calls if call[0] == operation)

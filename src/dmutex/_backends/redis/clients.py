"""The Redis client contracts, as :class:`typing.Protocol` classes.

``dmutex._backends.clients`` gathers them for ``dmutex`` to publish.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Protocol, TypeAlias

__all__ = [
    "AsyncRedisCommandClient",
    "AsyncRedisSetEvalClient",
    "RedisArg",
    "RedisCommandClient",
    "RedisReply",
    "RedisSetEvalClient",
]


RedisArg: TypeAlias = str | bytes | int | float
"""An argument dmutex sends in a Redis command."""


RedisReply: TypeAlias = bool | int | float | str | bytes | Sequence[object] | None
"""A reply dmutex can read from a sync Redis client (RESP2 or RESP3)."""


class RedisCommandClient(Protocol):
    """A sync Redis client with ``execute_command`` (redis-py, valkey-py, fakeredis)."""

    def execute_command(self, *args: RedisArg) -> RedisReply:
        """Send one command and return its reply."""
        ...


class AsyncRedisCommandClient(Protocol):
    """An asyncio Redis client with ``execute_command`` (``redis.asyncio.Redis``)."""

    def execute_command(self, *args: RedisArg) -> Awaitable[object]:
        """Send one command; the awaitable gives its reply."""
        ...


class RedisSetEvalClient(Protocol):
    """A sync Redis client offering ``set`` with ``px``/``nx`` and ``eval``."""

    def set(self, name: str, value: str, /, *, px: int, nx: bool) -> bool | str | bytes | None:
        """``SET name value PX px [NX]``."""
        ...

    def eval(self, script: str, numkeys: int, /, *keys_and_args: RedisArg) -> object:
        """Run a Lua script with ``EVAL``."""
        ...


class AsyncRedisSetEvalClient(Protocol):
    """An asyncio Redis client offering ``set`` with ``px``/``nx`` and ``eval``."""

    def set(
        self, name: str, value: str, /, *, px: int, nx: bool
    ) -> Awaitable[bool | str | bytes | None]:
        """``SET name value PX px [NX]``."""
        ...

    def eval(self, script: str, numkeys: int, /, *keys_and_args: RedisArg) -> Awaitable[object]:
        """Run a Lua script with ``EVAL``."""
        ...

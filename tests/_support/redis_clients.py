"""The Redis client packages dmutex is pinned against, made the same way for every test.

Each variant makes a sync or an asyncio client for a server URL (fakeredis
ignores the URL and uses its own in-process server). ``SetEval*`` are the
ioredis-shaped clients: only ``set`` and ``eval``, no ``execute_command``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import fakeredis
import redis
import redis.asyncio
import valkey
import valkey.asyncio

from dmutex import RedisArg, RedisReply


def slot_key(slot: int, key: str = "api", prefix: str = "_dsemaphore_svc:") -> str:
    """The Redis key of ``key``'s slot ``slot``: ``{prefix}permit:{slot}:{key}``."""
    return f"{prefix}permit:{slot}:{key}"


class Recording:
    """A redis-py client that records the arguments of every command."""

    def __init__(self, inner: redis.Redis) -> None:
        # redis-py leaves execute_command unannotated; this is its sync signature.
        self._send: Callable[..., RedisReply] = inner.execute_command
        self.commands: list[tuple[RedisArg, ...]] = []

    def execute_command(self, *args: RedisArg) -> RedisReply:
        self.commands.append(args)
        return self._send(*args)


class SetEvalRedis:
    """A sync client with only ``set(..., px=, nx=)`` and ``eval``, over redis-py."""

    def __init__(self, inner: redis.Redis) -> None:
        self._inner = inner

    def set(self, name: str, value: str, /, *, px: int, nx: bool) -> bool | str | bytes | None:
        result: bool | str | bytes | None = self._inner.set(name, value, px=px, nx=nx)
        return result

    def eval(self, script: str, numkeys: int, /, *keys_and_args: str | int) -> object:
        return self._inner.eval(script, numkeys, *keys_and_args)

    def close(self) -> None:
        self._inner.close()


class AsyncSetEvalRedis:
    """The asyncio twin of :class:`SetEvalRedis`, over ``redis.asyncio``."""

    def __init__(self, inner: redis.asyncio.Redis) -> None:
        self._inner = inner

    async def set(
        self, name: str, value: str, /, *, px: int, nx: bool
    ) -> bool | str | bytes | None:
        result: bool | str | bytes | None = await self._inner.set(name, value, px=px, nx=nx)
        return result

    async def eval(self, script: str, numkeys: int, /, *keys_and_args: str | int) -> object:
        result: object = await self._inner.eval(script, numkeys, *keys_and_args)
        return result

    async def aclose(self) -> None:
        await self._inner.aclose()


@dataclass
class Made:
    """A client, and how to close it (async closers return an awaitable)."""

    client: object
    close: Callable[[], object]


def _sync(url: str, **options: Any) -> Made:
    client = redis.Redis.from_url(url, **options)
    return Made(client, client.close)


def _async(url: str, **options: Any) -> Made:
    client = redis.asyncio.Redis.from_url(url, **options)
    return Made(client, client.aclose)


def _valkey(url: str) -> Made:
    client = valkey.Valkey.from_url(url.replace("redis://", "valkey://", 1))
    return Made(client, client.close)


def _valkey_async(url: str) -> Made:
    client = valkey.asyncio.Valkey.from_url(url.replace("redis://", "valkey://", 1))
    return Made(client, client.aclose)


def _set_eval(url: str) -> Made:
    client = SetEvalRedis(redis.Redis.from_url(url))
    return Made(client, client.close)


def _set_eval_async(url: str) -> Made:
    client = AsyncSetEvalRedis(redis.asyncio.Redis.from_url(url))
    return Made(client, client.aclose)


# name -> (sync maker, async maker); every one speaks to the server at the URL.
SERVER_VARIANTS: dict[str, tuple[Callable[[str], Made], Callable[[str], Made]]] = {
    "redis-py": (_sync, _async),
    "redis-py-str": (
        lambda url: _sync(url, decode_responses=True),
        lambda url: _async(url, decode_responses=True),
    ),
    "redis-py-resp3": (
        lambda url: _sync(url, protocol=3),
        lambda url: _async(url, protocol=3),
    ),
    "valkey-py": (_valkey, _valkey_async),
    "set-eval": (_set_eval, _set_eval_async),
}


def fake_pair(asynchronous: bool) -> tuple[Made, redis.Redis]:
    """A fakeredis client of the given face and a sync inspector on the same fake server."""
    server = fakeredis.FakeServer()
    inspector = fakeredis.FakeRedis(server=server, decode_responses=True)
    if asynchronous:
        fake_async = fakeredis.FakeAsyncRedis(server=server)
        return Made(fake_async, fake_async.aclose), inspector
    fake = fakeredis.FakeRedis(server=server)
    return Made(fake, fake.close), inspector


def close_made(made: Made, run: Callable[[Awaitable[object]], object] | None) -> None:
    """Close a client; ``run`` awaits async closers on the client's event loop."""
    result = made.close()
    if isinstance(result, Awaitable):
        assert run is not None, "an async client needs its loop to close"
        run(result)

"""asyncio cancellation at random points leaves no permit held by nobody, and is never swallowed.

Seeded trials, run in batches of concurrent tasks on two keys, each with
``AsyncDMutex`` or ``AsyncDSemaphore`` (3 permits) and one pattern of use:

- ``run``: ``await face.run(key, body)``;
- ``run_with_retry``: the same, acquiring with retries;
- ``async with``: ``acquire_with_retry``, then ``async with handle: body``;
- ``release``: ``acquire``, then ``body`` and ``await handle.release()`` in a ``finally``;
- ``token release`` (semaphore): the same with ``await sem.release(key, token)``.

``body`` sleeps a random short time. Each task is cancelled with
``task.cancel()`` after a random delay, so the cancellation lands in the
acquire, the body, a retry wait or the release, or not at all. On a real
Redis server the client is wrapped in :class:`DelayingRedis`, which sleeps
before and after each command: a cancellation can land before a request is
sent, while it is in flight, or after the server executed it but before
the reply is returned. On ``InMemoryBackend`` there is no I/O to land in,
only the body and the retry waits.

After each batch, once every task of the event loop has finished, the test
reads storage directly (Redis: every ``*permit:*`` key, with a clean client;
InMemoryBackend: ``snapshot()``). Every permit left must belong to a task
that still believes it holds it, and since every trial ends by releasing,
that is none: a permit left is an orphan, held by nobody until its 30 s TTL
runs out. Each task whose ``cancel()`` was accepted must end cancelled (the
cancellation propagated, it was not swallowed); the others must end without
an error. Where a cancellation landed is what its task was awaiting when
``cancel()`` was accepted (a stage, ``acquire`` or ``release``, and a phase
of the request; or ``body``, ``retry wait``); the test asserts that every
phase of both stages was hit. The summary (trials, cancellations by where
they landed, orphans by where and by pattern) is printed and is part of
every failure message.

The asyncio client has no ``socket_timeout``: under one, redis-py sends
through ``asyncio.wait_for``, which on Python <= 3.11 swallows a
cancellation that arrives as the send completes (CPython gh-86296), a
client's fault this test is not about.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio

from dmutex import AsyncDMutex, AsyncDSemaphore, InMemoryBackend
from tests._support.cancellation import (
    Face,
    NotingClock,
    Plan,
    Storage,
    Tally,
    Trial,
    current,
    doing,
    judge,
    note_retry_waits,
    run_trials,
)
from tests._support.fault_clients import PHASES, DelayingRedis
from tests._support.redis_servers import Pool, flushed, newest

PERMITS = 3
KEYS = ("job-a", "job-b")
MAX_DELAY = 0.0015  # each of the delaying client's two sleeps, at most
SEED = 20261201


def plan(backend: str, batches: int, cancel_after: float) -> Plan:
    """16 concurrent tasks a batch; a task is cancelled after about as long as a trial."""
    return Plan(
        backend,
        batches=batches,
        batch=16,
        keys=KEYS,
        cancel_after=cancel_after,
        ttl=30.0,
        timeout=0.04,
        retry_delay=0.002,
        body=0.003,
    )


MEMORY = plan("memory", batches=60, cancel_after=0.005)
REDIS = plan("redis", batches=200, cancel_after=0.015)


def in_request(phase: str | None) -> None:
    """:class:`DelayingRedis`'s phases, with the trial's stage (``between``: no request)."""
    trial = current()
    if trial is not None:
        doing(f"{trial.stage}/{phase or 'between'}")


class Owners:
    """Which trial sent each string argument (tokens among them), to name an orphan's trial."""

    def __init__(self) -> None:
        self._by_arg: dict[str, Trial] = {}

    def sent(self, args: tuple[object, ...]) -> None:
        trial = current()
        if trial is None:
            return
        for arg in args:
            text = arg.decode() if isinstance(arg, bytes) else arg
            if isinstance(text, str):
                self._by_arg.setdefault(text, trial)

    def of(self, token: str) -> Trial | None:
        return self._by_arg.get(token)


def test_memory_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """InMemoryBackend: cancellations land in bodies and retry waits; nothing is left held."""
    note_retry_waits(monkeypatch)
    rng = random.Random(SEED)
    backend = InMemoryBackend(clock=NotingClock())
    faces: dict[str, Face] = {
        "mutex": AsyncDMutex("svc", backend),
        "semaphore": AsyncDSemaphore("svc", backend, max_permits=PERMITS),
    }

    def clear() -> None:
        for key in KEYS:
            backend.force_expire(key)

    storage = Storage(
        permits=lambda: {name: token for name, (token, _) in backend.snapshot().items()},
        clear=clear,
    )
    tally = asyncio.run(run_trials(MEMORY, faces, storage, rng))
    summary = judge(tally)
    assert tally.landed["retry wait"] > 0, summary


@pytest.fixture
def redis_url(redis_pool: Pool) -> Iterator[str]:
    """One real Redis server (the newest found), its database emptied."""
    url = flushed(newest(redis_pool).url)
    yield url
    flushed(url)


def test_real_redis(redis_url: str) -> None:
    """A real Redis server behind a delaying client: cancellations in every phase of a request."""
    rng = random.Random(SEED)
    owners = Owners()
    inspector = redis.Redis.from_url(redis_url, decode_responses=True)

    def permits() -> dict[str, str]:
        names = list(inspector.scan_iter(match="*permit:*"))
        tokens = inspector.mget(names) if names else []
        return {n: str(t) for n, t in zip(names, tokens, strict=True) if t is not None}

    def clear() -> None:
        names = list(inspector.scan_iter(match="*"))
        if names:
            inspector.delete(*names)

    async def main() -> tuple[Tally, DelayingRedis]:
        # No socket_timeout: see the module docstring.
        inner = redis.asyncio.Redis.from_url(redis_url, socket_timeout=None)
        client = DelayingRedis(
            inner,
            rng,
            MAX_DELAY,
            on_send=owners.sent,
            on_phase=in_request,
        )
        clock = NotingClock()
        faces: dict[str, Face] = {
            "mutex": AsyncDMutex("svc", client, clock=clock),
            "semaphore": AsyncDSemaphore("svc", client, max_permits=PERMITS, clock=clock),
        }
        try:
            storage = Storage(permits, clear, owner=owners.of)
            return await run_trials(REDIS, faces, storage, rng), client
        finally:
            await inner.aclose()

    try:
        tally, client = asyncio.run(main())
    finally:
        inspector.close()
    tally.sent = client.sent
    summary = judge(tally)
    for stage in ("acquire", "release"):
        for phase in PHASES:
            assert tally.landed[f"{stage}/{phase}"] > 0, summary

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
import contextvars
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import redis
import redis.asyncio

from dmutex import AsyncDMutex, AsyncDSemaphore, InMemoryBackend, SystemClock
from dmutex._core.waiting import Wakeup
from dmutex._faces import drive
from tests._support.fault_clients import PHASES, DelayingRedis
from tests._support.redis_servers import Pool

TTL = 30.0  # far longer than the test: an orphan stays visible
PERMITS = 3
KEYS = ("job-a", "job-b")
BATCH = 16  # concurrent tasks per batch
BATCHES = {"memory": 60, "redis": 200}
MAX_DELAY = 0.0015  # each of the delaying client's two sleeps, at most
BODY = 0.003  # the body's sleep, at most
# A task is cancelled after uniform(0, this) seconds: about as long as a trial.
CANCEL_AFTER = {"memory": 0.005, "redis": 0.015}
TIMEOUT, RETRY_DELAY = 0.04, 0.002
SETTLE = 10.0  # the longest wait for the loop's tasks to finish after a batch
SEED = 20261201

PATTERNS = {
    "mutex": ("run", "run_with_retry", "async with", "release"),
    "semaphore": ("run", "run_with_retry", "async with", "release", "token release"),
}

Face = AsyncDMutex | AsyncDSemaphore


@dataclass
class Trial:
    """One task: what it does, what it sent, and where its cancellation landed."""

    number: int
    kind: str
    pattern: str
    stage: str = "start"
    """``acquire`` until the body ends, then ``release``."""
    doing: str = "start"
    """What the task awaits now: ``stage/phase`` of a request, ``body``, ``retry wait``."""
    cancel_accepted: bool = False
    """Whether ``task.cancel()`` returned True (the task had not finished)."""
    landed: str | None = None
    """What the task was awaiting when ``cancel()`` was accepted."""


CURRENT: contextvars.ContextVar[Trial] = contextvars.ContextVar("trial")


def doing(what: str) -> str:
    """Say what the current task awaits now; returns what it awaited before."""
    trial = CURRENT.get(None)
    if trial is None:
        return what
    before, trial.doing = trial.doing, what
    return before


def in_request(phase: str | None) -> None:
    """:class:`DelayingRedis`'s phases, with the trial's stage (``between``: no request)."""
    trial = CURRENT.get(None)
    if trial is not None:
        doing(f"{trial.stage}/{phase or 'between'}")


class NotingClock(SystemClock):
    """The system clock, saying when a task is in a retry wait."""

    async def sleep_async(self, seconds: float) -> None:
        before = doing("retry wait")
        try:
            await asyncio.sleep(seconds)
        finally:
            doing(before)


@dataclass
class Storage:
    """Where the test reads what is left: the permits as ``{storage key: token}``."""

    permits: Callable[[], dict[str, str]]
    clear: Callable[[], None]


@dataclass
class Tally:
    """The counts the test reports."""

    trials: Counter[str] = field(default_factory=Counter)
    accepted: int = 0
    landed: Counter[str] = field(default_factory=Counter)
    orphans: Counter[str] = field(default_factory=Counter)
    """Orphans by where their trial's cancellation landed."""
    orphaned: Counter[str] = field(default_factory=Counter)
    """Orphans by the trial's kind and pattern."""
    swallowed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    sent: Counter[str] = field(default_factory=Counter)

    def summary(self, backend: str) -> str:
        lines = [
            f"{backend}: {sum(self.trials.values())} trials {dict(self.trials)}",
            f"  cancel() accepted: {self.accepted}; by what the task awaited then: "
            f"{dict(sorted(self.landed.items()))}",
            f"  orphans: {sum(self.orphans.values())}; by what their task awaited when cancelled: "
            f"{dict(sorted(self.orphans.items()))}",
            f"  orphans by pattern: {dict(sorted(self.orphaned.items()))}",
            f"  swallowed cancellations: {len(self.swallowed)} {self.swallowed[:5]}",
            f"  other errors: {len(self.errors)} {self.errors[:5]}",
        ]
        if self.sent:
            lines.append(f"  commands sent: {dict(self.sent)}")
        return "\n".join(lines)


async def body(rng: random.Random) -> None:
    """The guarded work: a short sleep. Whatever happens, what follows is the release."""
    trial = CURRENT.get()
    doing("body")
    try:
        await asyncio.sleep(rng.uniform(0, BODY))
    finally:
        trial.stage = "release"
        doing("release/between")


async def run_trial(
    trial: Trial, face: Face, key: str, believed: set[str], rng: random.Random
) -> None:
    """Use ``face`` on ``key`` in ``trial.pattern``; ``believed`` holds the tokens held."""
    CURRENT.set(trial)
    trial.stage = "acquire"
    doing("acquire/between")

    async def callback(handle: object) -> None:
        await body(rng)

    if trial.pattern == "run":
        await face.run(key, callback, ttl=TTL)
        return
    if trial.pattern == "run_with_retry":
        await face.run_with_retry(key, callback, ttl=TTL, timeout=TIMEOUT, retry_delay=RETRY_DELAY)
        return
    if trial.pattern == "async with":
        handle = await face.acquire_with_retry(
            key, ttl=TTL, timeout=TIMEOUT, retry_delay=RETRY_DELAY
        )
    else:
        handle = await face.acquire(key, ttl=TTL)
    if handle is None:
        trial.stage = "done"
        return
    token = handle.token
    believed.add(token)  # no await since the acquire returned: nothing can land between
    if trial.pattern == "async with":
        async with handle:
            try:
                await body(rng)
            finally:
                believed.discard(token)
        return
    try:
        await body(rng)
    finally:
        believed.discard(token)  # from here on, the task means to hold nothing
        if trial.pattern == "release":
            await handle.release()
        else:
            assert isinstance(face, AsyncDSemaphore)
            await face.release(key, token)


async def settle() -> None:
    """Wait until every other task of the loop has finished (cleanup a library may spawn)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE
    me = asyncio.current_task()
    while True:
        others = {task for task in asyncio.all_tasks() if task is not me}
        if not others:
            return
        remaining = deadline - loop.time()
        assert remaining > 0, f"{len(others)} task(s) still running {SETTLE} s after a batch"
        await asyncio.wait(others, timeout=remaining)


class Owners:
    """Which trial sent each string argument (tokens among them), to name an orphan's trial."""

    def __init__(self) -> None:
        self._by_arg: dict[str, Trial] = {}

    def sent(self, args: tuple[object, ...]) -> None:
        trial = CURRENT.get(None)
        if trial is None:
            return
        for arg in args:
            text = arg.decode() if isinstance(arg, bytes) else arg
            if isinstance(text, str):
                self._by_arg.setdefault(text, trial)

    def of(self, token: str) -> Trial | None:
        return self._by_arg.get(token)


async def run_trials(
    backend: str,
    faces: dict[str, Face],
    storage: Storage,
    owners: Owners,
    rng: random.Random,
) -> Tally:
    """Every batch of trials, each followed by the checks; returns the counts."""
    tally = Tally()
    believed: set[str] = set()
    loop = asyncio.get_running_loop()
    number = 0
    for _ in range(BATCHES[backend]):
        batch: list[tuple[Trial, asyncio.Task[None]]] = []
        timers: list[asyncio.TimerHandle] = []
        for _ in range(BATCH):
            kind = rng.choice(sorted(faces))
            trial = Trial(number, kind, rng.choice(PATTERNS[kind]))
            number += 1
            tally.trials[f"{kind} {trial.pattern}"] += 1
            task = asyncio.create_task(
                run_trial(trial, faces[kind], rng.choice(KEYS), believed, rng)
            )
            batch.append((trial, task))

            def cancel(trial: Trial = trial, task: asyncio.Task[None] = task) -> None:
                trial.cancel_accepted = task.cancel()
                if trial.cancel_accepted:
                    trial.landed = trial.doing

            timers.append(loop.call_later(rng.uniform(0, CANCEL_AFTER[backend]), cancel))
        await asyncio.wait([task for _, task in batch])
        for timer in timers:
            timer.cancel()
        await settle()
        for trial, task in batch:
            check_task(trial, task, tally)
        for token in storage.permits().values():
            if token in believed:
                continue
            owner = owners.of(token)
            tally.orphaned["unknown" if owner is None else f"{owner.kind} {owner.pattern}"] += 1
            tally.orphans["unknown" if owner is None else owner.landed or "not cancelled"] += 1
        storage.clear()
    assert not believed, f"tokens still believed held after every trial ended: {believed}"
    return tally


def check_task(trial: Trial, task: asyncio.Task[None], tally: Tally) -> None:
    """A task whose cancel() was accepted ended cancelled; any other ended without error."""
    if trial.cancel_accepted:
        tally.accepted += 1
        tally.landed[trial.landed or "unknown"] += 1
        if not task.cancelled():
            error = task.exception()
            tally.swallowed.append(
                f"trial {trial.number} {trial.kind} {trial.pattern} at {trial.landed}: "
                f"{'returned' if error is None else repr(error)}"
            )
        return
    if task.cancelled():
        tally.errors.append(f"trial {trial.number} cancelled without a cancel()")
    elif task.exception() is not None:
        tally.errors.append(f"trial {trial.number} {trial.pattern}: {task.exception()!r}")


def judge(tally: Tally, backend: str) -> None:
    summary = tally.summary(backend)
    print(summary)
    assert tally.accepted > 0, summary
    assert tally.landed["body"] > 0, summary
    assert not tally.errors, summary
    assert not tally.swallowed, summary
    assert sum(tally.orphans.values()) == 0, summary


def test_memory_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """InMemoryBackend: cancellations land in bodies and retry waits; nothing is left held."""
    # On the system clock a retry wait waits for a release (the driver's
    # _woken), not in the clock's sleep_async: say so there as well.
    woken = drive._woken

    async def noting(wakeup: Wakeup, seconds: float) -> None:
        before = doing("retry wait")
        try:
            await woken(wakeup, seconds)
        finally:
            doing(before)

    monkeypatch.setattr(drive, "_woken", noting)
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
    tally = asyncio.run(run_trials("memory", faces, storage, Owners(), rng))
    judge(tally, "memory")
    assert tally.landed["retry wait"] > 0, tally.summary("memory")


@pytest.fixture
def redis_url(redis_pool: Pool) -> Iterator[str]:
    """One real Redis server (the newest found), its database emptied."""
    labels = redis_pool.labels
    if not labels:
        pytest.skip(redis_pool.discovery.reason)
    url = redis_pool.server(labels[-1]).url
    with redis.Redis.from_url(url) as client:
        client.flushdb()
    yield url
    with redis.Redis.from_url(url) as client:
        client.flushdb()


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
            return await run_trials("redis", faces, Storage(permits, clear), owners, rng), client
        finally:
            await inner.aclose()

    try:
        tally, client = asyncio.run(main())
    finally:
        inspector.close()
    tally.sent = client.sent
    judge(tally, "redis")
    for stage in ("acquire", "release"):
        for phase in PHASES:
            assert tally.landed[f"{stage}/{phase}"] > 0, tally.summary("redis")

"""The cancellation harness: seeded trials of asyncio tasks, cancelled at random moments.

Shared by ``tests/faults/cancellation/test_cancellation.py`` (InMemoryBackend, a real
Redis server) and ``tests/faults/test_sqlite_faults.py`` (SQLiteBackend).
Batches of concurrent tasks, each an ``AsyncDMutex``, an ``AsyncDSemaphore``
or one side of an ``AsyncDReadWriteLock`` (:class:`ReadWriteSide`, for
``tests/faults/test_readwrite_faults.py``) used on one of the plan's keys in
one pattern:

- ``run``: ``await face.run(key, body)``;
- ``run_with_retry``: the same, acquiring with retries;
- ``async with``: ``acquire_with_retry``, then ``async with handle: body``;
- ``release``: ``acquire``, then ``body`` and ``await handle.release()`` in a ``finally``;
- ``token release`` (semaphore, read-write lock): the same with
  ``await lock.release(key, token)``.

Each task is cancelled after a random delay. What a task awaits is noted on
its :class:`Trial` (``doing``): the suites' clients and backends note the
phases of a request through :func:`doing`, :class:`NotingClock` and
:func:`note_retry_waits` the retry waits, :func:`run_trial` the body. Where
a cancellation landed is what its task awaited when ``cancel()`` was
accepted. After each batch, once every task of the loop has finished (but
those that ran before the trials: a pool's own workers), every
permit left in storage must belong to a task that still believes it holds
it (none: every trial ends by releasing); a task whose ``cancel()`` was
accepted must end cancelled, any other without an error. For a read-write
lock the storage also tells the waiting writers' intents left (none may be:
every task has ended) and whether a new reader of each key gets in at once
(:class:`Storage`'s ``intents`` and ``admits``).
"""

from __future__ import annotations

import asyncio
import contextvars
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import pytest

from dmutex import (
    AsyncDMutex,
    AsyncDMutexLock,
    AsyncDReadLock,
    AsyncDReadWriteLock,
    AsyncDSemaphore,
    AsyncDSemaphorePermit,
    AsyncDWriteLock,
    SystemClock,
)
from dmutex._core.waiting import Wakeup
from dmutex._runtime import drivers

T = TypeVar("T")

PATTERNS = {
    "mutex": ("run", "run_with_retry", "async with", "release"),
    "semaphore": ("run", "run_with_retry", "async with", "release", "token release"),
    # The two sides of a read-write lock (ReadWriteSide): run_read / run_write and so on.
    "read": ("run", "run_with_retry", "async with", "release", "token release"),
    "write": ("run", "run_with_retry", "async with", "release", "token release"),
}

Hold = AsyncDReadLock | AsyncDWriteLock


class ReadWriteSide:
    """One side of an :class:`AsyncDReadWriteLock` under the mutexes' method names.

    ``run``, ``run_with_retry``, ``acquire`` and ``acquire_with_retry`` are
    the side's (``run_read`` or ``run_write``, and so on); ``release(key,
    token)`` is the lock's. :func:`run_trial` uses it as it uses an
    ``AsyncDSemaphore``; its faces are keyed ``"read"`` and ``"write"``.
    """

    def __init__(self, lock: AsyncDReadWriteLock, *, write: bool) -> None:
        self.lock = lock
        self.write = write

    async def run(
        self, key: str, callback: Callable[[Hold], Awaitable[T]], ttl: float | None = None
    ) -> T | None:
        if self.write:
            return await self.lock.run_write(key, callback, ttl)
        return await self.lock.run_read(key, callback, ttl)

    async def run_with_retry(
        self,
        key: str,
        callback: Callable[[Hold], Awaitable[T]],
        *,
        ttl: float | None = None,
        timeout: float = 30.0,
        retry_delay: float = 0.1,
    ) -> T | None:
        run = self.lock.run_write_with_retry if self.write else self.lock.run_read_with_retry
        return await run(key, callback, ttl=ttl, timeout=timeout, retry_delay=retry_delay)

    async def acquire(self, key: str, ttl: float | None = None) -> Hold | None:
        if self.write:
            return await self.lock.acquire_write(key, ttl)
        return await self.lock.acquire_read(key, ttl)

    async def acquire_with_retry(
        self, key: str, *, ttl: float | None = None, timeout: float = 30.0, retry_delay: float = 0.1
    ) -> Hold | None:
        acquire = (
            self.lock.acquire_write_with_retry if self.write else self.lock.acquire_read_with_retry
        )
        return await acquire(key, ttl=ttl, timeout=timeout, retry_delay=retry_delay)

    async def release(self, key: str, token: str) -> bool:
        return await self.lock.release(key, token)

    async def ready(self) -> None:
        await self.lock.ready()


Face = AsyncDMutex | AsyncDSemaphore | ReadWriteSide


@dataclass(frozen=True)
class Plan:
    """How many trials, how they use their face, and when they are cancelled."""

    backend: str  # named in the summary
    batches: int
    batch: int  # concurrent tasks per batch
    keys: tuple[str, ...]
    cancel_after: float  # a task is cancelled after uniform(0, this) seconds
    ttl: float  # far longer than the test: an orphan stays visible
    timeout: float  # the retrying patterns'
    retry_delay: float
    body: float  # the body's sleep, at most
    settle: float = 10.0  # the longest wait for the loop's tasks to finish after a batch
    spread: tuple[float, ...] = (1.0,)
    """Batch ``n`` cancels after ``uniform(0, cancel_after * spread[n % len(spread)])``:
    later cancellations too, to reach the releases however slow the host."""


@dataclass
class Trial:
    """One task: what it does, and where its cancellation landed."""

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
    tokens: set[str] = field(default_factory=set)
    """The tokens of the handles it was given."""


CURRENT: contextvars.ContextVar[Trial] = contextvars.ContextVar("trial")


def current() -> Trial | None:
    """The trial of the running task (and of the tasks it started), if any."""
    return CURRENT.get(None)


def doing(what: str) -> str:
    """Say what the current task awaits now; returns what it awaited before."""
    trial = current()
    if trial is None:
        return what
    before, trial.doing = trial.doing, what
    return before


class NotingClock(SystemClock):
    """The system clock, saying when a task is in a retry wait."""

    async def sleep_async(self, seconds: float) -> None:
        before = doing("retry wait")
        try:
            await asyncio.sleep(seconds)
        finally:
            doing(before)


def note_retry_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Say so as well when a retry wait waits for a release (the driver's ``_woken``).

    On the system clock a retry wait waits there, not in the clock's ``sleep_async``.
    """
    woken = drivers._woken

    async def noting(wakeup: Wakeup, seconds: float) -> None:
        before = doing("retry wait")
        try:
            await woken(wakeup, seconds)
        finally:
            doing(before)

    monkeypatch.setattr(drivers, "_woken", noting)


@dataclass
class Storage:
    """Where the test reads what is left: the permits as ``{storage key: token}``."""

    permits: Callable[[], dict[str, str]]
    clear: Callable[[], None]
    owner: Callable[[str], Trial | None] = lambda token: None
    """Which trial sent ``token``, for a token no trial was handed (the suite's client knows)."""
    intents: Callable[[], dict[str, str]] = dict
    """A read-write lock's waiting writers' intents, as ``{storage name: token}`` (others: none).

    Read after each batch with the permits; :attr:`clear` removes them too.
    """
    admits: Callable[[str], Awaitable[bool]] | None = None
    """Whether a new reader of ``key`` gets in at once (a read-write lock's), or None: not asked.

    Asked of every key of the plan after each batch, before :attr:`clear`.
    """


@dataclass
class Tally:
    """The counts the test reports."""

    backend: str
    trials: Counter[str] = field(default_factory=Counter)
    accepted: int = 0
    landed: Counter[str] = field(default_factory=Counter)
    orphans: Counter[str] = field(default_factory=Counter)
    """Orphans by where their trial's cancellation landed."""
    orphaned: Counter[str] = field(default_factory=Counter)
    """Orphans by the trial's kind and pattern."""
    orphan_names: list[str] = field(default_factory=list)
    """The orphans' storage keys."""
    swallowed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    sent: Counter[str] = field(default_factory=Counter)
    """Commands sent, by name (where the suite's client counts them)."""
    calls: Counter[str] = field(default_factory=Counter)
    """Calls by stage (where the suite's backend counts them)."""
    intents: Counter[str] = field(default_factory=Counter)
    """Intents left after a batch, by the trial's kind and pattern (read-write locks)."""
    probes: int = 0
    """New readers sent after a batch to see whether they get in at once (read-write locks)."""
    refused: list[str] = field(default_factory=list)
    """Those that did not: ``"batch n: key"``."""

    def summary(self) -> str:
        lines = [
            f"{self.backend}: {sum(self.trials.values())} trials {dict(self.trials)}",
            f"  cancel() accepted: {self.accepted}; by what the task awaited then: "
            f"{dict(sorted(self.landed.items()))}",
            f"  orphans: {sum(self.orphans.values())}; by what their task awaited when cancelled: "
            f"{dict(sorted(self.orphans.items()))}",
            f"  orphans by pattern: {dict(sorted(self.orphaned.items()))}",
            f"  swallowed cancellations: {len(self.swallowed)} {self.swallowed[:5]}",
            f"  other errors: {len(self.errors)} {self.errors[:5]}",
        ]
        if self.orphan_names:
            lines.append(f"  orphaned permits: {self.orphan_names[:5]}")
        if self.sent:
            lines.append(f"  commands sent: {dict(self.sent)}")
        if self.calls:
            lines.append(f"  calls by stage: {dict(self.calls)}")
        if self.probes or self.intents:
            lines.append(
                f"  intents left: {sum(self.intents.values())} {dict(sorted(self.intents.items()))}"
                f"; new readers refused: {len(self.refused)} of {self.probes} {self.refused[:5]}"
            )
        return "\n".join(lines)


async def body(plan: Plan, rng: random.Random) -> None:
    """The guarded work: a short sleep. Whatever happens, what follows is the release."""
    trial = CURRENT.get()
    doing("body")
    try:
        await asyncio.sleep(rng.uniform(0, plan.body))
    finally:
        trial.stage = "release"
        doing("release/between")


async def run_trial(
    plan: Plan, trial: Trial, face: Face, key: str, believed: set[str], rng: random.Random
) -> None:
    """Use ``face`` on ``key`` in ``trial.pattern``; ``believed`` holds the tokens held."""
    CURRENT.set(trial)
    trial.stage = "acquire"
    doing("acquire/between")

    async def callback(handle: AsyncDMutexLock | AsyncDSemaphorePermit | Hold) -> None:
        trial.tokens.add(handle.token)
        await body(plan, rng)

    if trial.pattern == "run":
        await face.run(key, callback, ttl=plan.ttl)
        return
    if trial.pattern == "run_with_retry":
        await face.run_with_retry(
            key, callback, ttl=plan.ttl, timeout=plan.timeout, retry_delay=plan.retry_delay
        )
        return
    if trial.pattern == "async with":
        handle = await face.acquire_with_retry(
            key, ttl=plan.ttl, timeout=plan.timeout, retry_delay=plan.retry_delay
        )
    else:
        handle = await face.acquire(key, ttl=plan.ttl)
    if handle is None:
        trial.stage = "done"
        return
    token = handle.token
    trial.tokens.add(token)
    believed.add(token)  # no await since the acquire returned: nothing can land between
    if trial.pattern == "async with":
        async with handle:
            try:
                await body(plan, rng)
            finally:
                believed.discard(token)
        return
    try:
        await body(plan, rng)
    finally:
        believed.discard(token)  # from here on, the task means to hold nothing
        if trial.pattern == "release":
            await handle.release()
        else:
            assert isinstance(face, (AsyncDSemaphore, ReadWriteSide))
            await face.release(key, token)


async def settle(seconds: float, background: set[asyncio.Task[object]]) -> None:
    """Wait until every other task of the loop has finished (cleanup a library may spawn).

    ``background``: the tasks that ran before the trials began (a pool's own
    workers, alive as long as the pool), not waited for.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    me = asyncio.current_task()
    while True:
        others = {task for task in asyncio.all_tasks() if task is not me} - background
        if not others:
            return
        remaining = deadline - loop.time()
        assert remaining > 0, f"{len(others)} task(s) still running {seconds} s after a batch"
        await asyncio.wait(others, timeout=remaining)


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


async def run_trials(
    plan: Plan,
    faces: dict[str, Face],
    storage: Storage,
    rng: random.Random,
    enough: Callable[[Tally], bool] = lambda tally: False,
) -> Tally:
    """The batches of trials, each followed by the checks; returns the counts.

    ``plan.batches`` of them, or fewer: none after one that leaves ``enough(tally)`` true.
    """
    tally = Tally(plan.backend)
    believed: set[str] = set()
    owners: dict[str, Trial] = {}
    loop = asyncio.get_running_loop()
    background = asyncio.all_tasks()
    number = 0
    for batch_number in range(plan.batches):
        cancel_after = plan.cancel_after * plan.spread[batch_number % len(plan.spread)]
        batch: list[tuple[Trial, asyncio.Task[None]]] = []
        timers: list[asyncio.TimerHandle] = []
        for _ in range(plan.batch):
            kind = rng.choice(sorted(faces))
            trial = Trial(number, kind, rng.choice(PATTERNS[kind]))
            number += 1
            tally.trials[f"{kind} {trial.pattern}"] += 1
            task = asyncio.create_task(
                run_trial(plan, trial, faces[kind], rng.choice(plan.keys), believed, rng)
            )
            batch.append((trial, task))

            def cancel(trial: Trial = trial, task: asyncio.Task[None] = task) -> None:
                trial.cancel_accepted = task.cancel()
                if trial.cancel_accepted:
                    trial.landed = trial.doing

            timers.append(loop.call_later(rng.uniform(0, cancel_after), cancel))
        await asyncio.wait([task for _, task in batch])
        for timer in timers:
            timer.cancel()
        await settle(plan.settle, background)
        for trial, task in batch:
            check_task(trial, task, tally)
            owners.update(dict.fromkeys(trial.tokens, trial))
        for name, token in storage.permits().items():
            if token in believed:
                continue
            owner = owners.get(token) or storage.owner(token)
            tally.orphaned["unknown" if owner is None else f"{owner.kind} {owner.pattern}"] += 1
            tally.orphans["unknown" if owner is None else owner.landed or "not cancelled"] += 1
            tally.orphan_names.append(name)
        for name, token in storage.intents().items():
            owner = owners.get(token) or storage.owner(token)
            tally.intents["unknown" if owner is None else f"{owner.kind} {owner.pattern}"] += 1
            tally.orphan_names.append(name)
        if storage.admits is not None:
            for key in plan.keys:
                tally.probes += 1
                if not await storage.admits(key):
                    tally.refused.append(f"batch {batch_number}: {key}")
        storage.clear()
        if enough(tally):
            break
    assert not believed, f"tokens still believed held after every trial ended: {believed}"
    return tally


def judge(tally: Tally) -> str:
    """The checks every backend passes; returns the summary (also printed)."""
    summary = tally.summary()
    print(summary)
    assert tally.accepted > 0, summary
    assert tally.landed["body"] > 0, summary
    assert not tally.errors, summary
    assert not tally.swallowed, summary
    assert sum(tally.orphans.values()) == 0, summary
    assert sum(tally.intents.values()) == 0, summary
    assert not tally.refused, summary
    return summary

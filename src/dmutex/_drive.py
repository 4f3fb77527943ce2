"""Drivers: carry out the effects of ``Steps`` in the sync or the asyncio way.

These two functions are the only place where sync and async differ: a sync
driver calls and sleeps, an async driver calls, awaits and sleeps without
blocking the loop. Both feed results (or exceptions) back into the same
algorithm.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Coroutine
from typing import TypeVar, cast

from ._clock import Clock
from ._effects import Call, Effect, Gate, Steps
from ._errors import UnsupportedClientError

T = TypeVar("T")


class _Resume:
    """What goes back into the algorithm next: a result or an exception."""

    __slots__ = ("error", "value")

    def __init__(self) -> None:
        self.value: object = None
        self.error: BaseException | None = None

    def step(self, steps: Steps[T]) -> Effect:
        """Advance ``steps`` to its next effect; StopIteration carries the result."""
        value, error = self.value, self.error
        self.value, self.error = None, None
        if error is not None:
            return steps.throw(error)
        return steps.send(value)


def _mismatch(effect: Call, result: object) -> UnsupportedClientError:
    """The error for a call that returned the wrong kind of value for its face."""
    name = getattr(effect.fn, "__qualname__", repr(effect.fn))
    got_awaitable = inspect.isawaitable(result)
    if effect.role == "callback":
        if got_awaitable:
            return UnsupportedClientError(
                f"callback {name} returned an awaitable; a sync class cannot await "
                "it (use the Async class for async callbacks)"
            )
        return UnsupportedClientError(
            f"callback {name} returned {type(result).__name__}, not an awaitable; "
            "the Async classes need an async callback"
        )
    if got_awaitable:
        return UnsupportedClientError(
            f"{name} returned an awaitable: this is an asyncio client, "
            "use AsyncDMutex / AsyncDSemaphore"
        )
    return UnsupportedClientError(
        f"{name} did not return an awaitable: this is a sync client, use DMutex / DSemaphore"
    )


def run_sync(steps: Steps[T], clock: Clock, gate: threading.Lock) -> T:
    """Run ``steps`` to completion in the calling thread."""
    resume = _Resume()
    while True:
        try:
            effect = resume.step(steps)
        except StopIteration as done:
            return cast(T, done.value)
        try:
            if isinstance(effect, Call):
                result = effect.fn(*effect.args, **effect.kwargs)
                if inspect.isawaitable(result):
                    if isinstance(result, Coroutine):
                        result.close()  # never started, so no I/O happened
                    raise _mismatch(effect, result)
                resume.value = result
            elif isinstance(effect, Gate) and effect.enter:
                gate.acquire()
            elif isinstance(effect, Gate):
                gate.release()
            else:
                clock.sleep(effect.seconds)
        except BaseException as error:  # noqa: BLE001 - handed to the algorithm
            resume.error = error


async def run_async(steps: Steps[T], clock: Clock, gate: asyncio.Lock) -> T:
    """Run ``steps`` to completion in the running event loop."""
    resume = _Resume()
    while True:
        try:
            effect = resume.step(steps)
        except StopIteration as done:
            return cast(T, done.value)
        try:
            if isinstance(effect, Call):
                result = effect.fn(*effect.args, **effect.kwargs)
                if not inspect.isawaitable(result):
                    raise _mismatch(effect, result)
                resume.value = await result
            elif isinstance(effect, Gate) and effect.enter:
                await gate.acquire()
            elif isinstance(effect, Gate):
                gate.release()
            else:
                await clock.sleep_async(effect.seconds)
        except BaseException as error:  # noqa: BLE001 - handed to the algorithm
            resume.error = error

"""Drivers: carry out the effects of ``Steps`` in the sync or the asyncio way.

Each driver is one loop that performs an effect and sends its result (or
throws its exception) back into the algorithm. What differs between the two
is only how an effect is performed: the sync driver calls and sleeps, the
async driver calls, awaits and sleeps without blocking the event loop.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Coroutine
from typing import TypeVar, cast

from ._clock import Clock
from ._effects import Call, Sleep, Steps
from ._errors import UnsupportedClientError

T = TypeVar("T")


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


# Replies that are certainly not awaitable, checked by exact type before the
# slower inspect.isawaitable: the sync driver's per-request cost matters.
_PLAIN = frozenset({type(None), bool, int, float, str, bytes, list, dict, tuple})


def run_sync(steps: Steps[T], clock: Clock, gate: threading.Lock) -> T:
    """Run ``steps`` to completion in the calling thread.

    The same protocol as :func:`_drive`, without a coroutine around it: a sync
    effect never suspends, and this loop runs for every request, so it is
    kept flat.
    """
    send, throw = steps.send, steps.throw
    try:
        effect = send(None)
        while True:
            try:
                if isinstance(effect, Call):
                    kwargs = effect.kwargs
                    value = effect.fn(*effect.args, **kwargs) if kwargs else effect.fn(*effect.args)
                    if type(value) not in _PLAIN and inspect.isawaitable(value):
                        if isinstance(value, Coroutine):
                            value.close()  # never started, so no I/O happened
                        raise _mismatch(effect, value)
                elif isinstance(effect, Sleep):
                    value = None
                    clock.sleep(effect.seconds)
                else:
                    value = None
                    gate.acquire() if effect.enter else gate.release()
            except BaseException as exc:  # noqa: BLE001 - handed to the algorithm
                effect = throw(exc)
            else:
                effect = send(value)
    except StopIteration as done:
        result: T = done.value
        return result


async def run_async(steps: Steps[T], clock: Clock, gate: asyncio.Lock) -> T:
    """Run ``steps`` to completion in the running event loop."""
    value: object = None
    error: BaseException | None = None
    while True:
        try:
            effect = steps.send(value) if error is None else steps.throw(error)
        except StopIteration as done:
            return cast(T, done.value)
        value, error = None, None
        try:
            if isinstance(effect, Call):
                result = effect.fn(*effect.args, **(effect.kwargs or {}))
                if not inspect.isawaitable(result):
                    raise _mismatch(effect, result)
                value = await result
            elif isinstance(effect, Sleep):
                await clock.sleep_async(effect.seconds)
            elif effect.enter:
                await gate.acquire()
            else:
                gate.release()
        except GeneratorExit:
            raise  # this coroutine is being closed: nothing may run any more
        except BaseException as exc:  # noqa: BLE001 - handed to the algorithm
            error = exc

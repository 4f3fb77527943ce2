"""Drivers: where the algorithms' effects meet the world, sync or asyncio.

They sit in ``dmutex._runtime``, between the public classes (``_faces``),
each of which owns one, and the engine and stores whose effects they run.

Each public instance owns one driver, and the driver is the one place where
the instance's policy wraps the algorithms: before an operation starts it
prepares the store, once per instance, one caller at a time; a failure
reaches that caller and the next operation tries again. Before it starts,
not at its first request: an operation reads its clock as it starts (a
grant's deadline counts from then), and a preparation that takes seconds
(a DynamoDB table being made) must not eat a first lease's TTL.

The two drivers differ only in how they perform an effect: the sync one
calls and sleeps in the calling thread, the async one awaits and sleeps
without blocking the event loop.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine
from types import CoroutineType
from typing import Any, TypeVar

from .._backends.shapes import wrong_face
from .._clock import Clock, SystemClock
from .._core.effects import Call, Callback, Sleep, Steps, Wait
from .._core.lease import Lease
from .._core.waiting import Wakeup
from .._errors import LeaseLostError

if sys.version_info >= (3, 11):
    from typing import assert_never
else:  # pragma: no cover - Python 3.10
    from typing import NoReturn

    def assert_never(value: NoReturn) -> NoReturn:
        raise AssertionError(f"unhandled effect: {value!r}")


T = TypeVar("T")

# Replies that are certainly not awaitable, checked by exact type before the
# slower inspect.isawaitable: the sync driver's per-request cost matters.
_PLAIN = frozenset({type(None), bool, int, float, str, bytes, list, dict, tuple})


def _discard(value: object) -> None:
    """Close a coroutine a sync driver will not await: it never started, so no I/O happened."""
    if isinstance(value, Coroutine):
        value.close()


def _prepare_or_close(ready: Callable[[], None], steps: Steps[T]) -> None:
    """Prepare the store; if that fails, close ``steps``, none of whose requests was sent."""
    try:
        ready()
    except BaseException:
        steps.close()
        raise


class SyncDriver:
    """Runs steps to completion in the calling thread."""

    __slots__ = ("_clock", "_gate", "_prepare", "_ready")

    def __init__(self, clock: Clock, prepare: Callable[[], Steps[None]]) -> None:
        self._clock = clock
        self._prepare = prepare
        self._ready = False
        self._gate = threading.Lock()

    def ready(self) -> None:
        """Prepare the store unless done; concurrent threads wait for the first."""
        if self._ready:
            return
        with self._gate:
            if not self._ready:
                self(self._prepare(), prepared=True)
                self._ready = True

    def __call__(self, steps: Steps[T], *, prepared: bool = False) -> T:
        """Run ``steps``, preparing the store before they start (unless ``prepared``)."""
        # One flat loop, without a coroutine or a call around it: a sync
        # effect never suspends, and this runs for every request.
        if not (prepared or self._ready):
            _prepare_or_close(self.ready, steps)
        send, throw = steps.send, steps.throw
        try:
            effect = send(None)
            while True:
                try:
                    # An isinstance chain, not match: measurably faster per
                    # request, and as exhaustive (assert_never) for mypy.
                    if isinstance(effect, Call):
                        fn, kwargs = effect.fn, effect.kwargs
                        value = fn(*effect.args, **kwargs) if kwargs else fn(*effect.args)
                        if type(value) not in _PLAIN and inspect.isawaitable(value):
                            _discard(value)
                            raise wrong_face(fn, value)
                    elif isinstance(effect, Callback):
                        value = effect.fn(effect.handle)
                        if inspect.isawaitable(value):
                            _discard(value)
                            raise wrong_face(effect.fn, value, callback=True)
                    elif isinstance(effect, Sleep):
                        value = None
                        self._clock.sleep(effect.seconds)
                    elif isinstance(effect, Wait):
                        value = None
                        if isinstance(self._clock, SystemClock):
                            effect.wakeup.wait(effect.seconds)
                        elif not effect.wakeup.is_set():
                            self._clock.sleep(effect.seconds)
                    else:
                        assert_never(effect)
                except BaseException as exc:  # noqa: BLE001 - handed to the algorithm
                    effect = throw(exc)
                else:
                    effect = send(value)
        except StopIteration as done:
            outcome: T = done.value  # no cast(): a call, and this runs per operation
            return outcome


class AsyncDriver:
    """Runs steps to completion in the running event loop.

    Cancellation: a request marked :attr:`~dmutex._core.effects.Call.complete`
    (a release) is *shielded*: it runs to the end even if the task is
    cancelled meanwhile, the steps go on with its result, and the
    cancellation is raised when they end. A task cancelled while it waits on
    any other request has the ``CancelledError`` thrown into the steps, so
    that they can undo what the request may have done; every effect after
    that is shielded.
    """

    __slots__ = ("_clock", "_gate", "_prepare", "_ready")

    def __init__(self, clock: Clock, prepare: Callable[[], Steps[None]]) -> None:
        self._clock = clock
        self._prepare = prepare
        self._ready = False
        self._gate = asyncio.Lock()

    async def ready(self) -> None:
        """Prepare the store unless done; concurrent tasks wait for the first."""
        if self._ready:
            return
        async with self._gate:
            if not self._ready:
                await self._loop(self._prepare(), prepared=True)
                self._ready = True

    def __call__(self, steps: Steps[T]) -> Coroutine[Any, Any, T]:
        """Run ``steps``, preparing the store before their first request.

        A plain function returning the coroutine: one coroutine less per
        operation than an ``async def`` that awaits it.
        """
        return self._loop(steps, prepared=self._ready)

    async def _loop(self, steps: Steps[T], *, prepared: bool) -> T:
        if not prepared:
            try:
                await self.ready()
            except BaseException:
                steps.close()  # not started: no request of these steps was sent
                raise
        send, throw = steps.send, steps.throw
        value: object = None
        error: BaseException | None = None
        cancelled: asyncio.CancelledError | None = None
        try:
            while True:
                try:
                    effect = send(value) if error is None else throw(error)
                except StopIteration as done:
                    if cancelled is not None:
                        raise cancelled from None
                    outcome: T = done.value  # no cast(): a call, and this runs per operation
                    return outcome
                value, error = None, None
                try:
                    shielded = cancelled is not None
                    # An isinstance chain, not match, as in the sync driver.
                    result: Awaitable[object]
                    if isinstance(effect, Call):
                        shielded = shielded or effect.complete
                        fn: Callable[..., Any] = effect.fn
                        kwargs = effect.kwargs
                        reply = fn(*effect.args, **kwargs) if kwargs else fn(*effect.args)
                        if type(reply) is not CoroutineType and not inspect.isawaitable(reply):
                            raise wrong_face(fn, reply)
                        result = reply
                    elif isinstance(effect, Callback):
                        reply = effect.fn(effect.handle)
                        if not inspect.isawaitable(reply):
                            raise wrong_face(effect.fn, reply, callback=True)
                        result = reply
                        if effect.lease is not None:
                            result = _until_lost(result, effect.lease)
                    elif isinstance(effect, Sleep):
                        result = self._clock.sleep_async(effect.seconds)
                    elif isinstance(effect, Wait):
                        if isinstance(self._clock, SystemClock):
                            result = _woken(effect.wakeup, effect.seconds)
                        elif effect.wakeup.is_set():
                            result = asyncio.sleep(0)
                        else:
                            result = self._clock.sleep_async(effect.seconds)
                    else:
                        assert_never(effect)
                    if shielded:
                        task, caught = await _to_the_end(result)
                        cancelled = caught or cancelled
                        value = task.result()
                    else:
                        value = await result
                except GeneratorExit:
                    raise  # this coroutine is being closed: nothing may run any more
                except asyncio.CancelledError as exc:
                    # Thrown into the steps once, so that they can undo the
                    # request; what they do about it runs shielded.
                    error = cancelled = cancelled or exc
                except BaseException as exc:  # noqa: BLE001 - handed to the algorithm
                    error = exc
        except BaseException as exc:
            if cancelled is not None and exc is not cancelled:
                raise cancelled from exc  # the cancellation outranks what the cleanup raised
            raise


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], object]) -> None:
    """Call ``fn()`` on ``loop``: now if this thread runs it, else soon (unless it closed)."""
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        fn()
    elif not loop.is_closed():
        loop.call_soon_threadsafe(fn)


def waker() -> tuple[asyncio.Future[None], Callable[[], None]]:
    """A future of the running loop, and a function any thread may call to settle it."""
    loop = asyncio.get_running_loop()
    woken: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not woken.done():
            woken.set_result(None)

    def wake() -> None:
        on_loop(loop, settle)

    return woken, wake


async def _woken(wakeup: Wakeup, seconds: float) -> None:
    """Wait until ``wakeup`` is set (from any thread) or ``seconds`` pass."""
    woken, wake = waker()
    if not wakeup.listen(wake):
        return
    try:
        await asyncio.wait((woken,), timeout=seconds)
    finally:
        wakeup.unlisten(wake)
        woken.cancel()


async def _until_lost(callback: Awaitable[T], lease: Lease) -> T:
    """Await ``callback`` as a task of its own, cancelled if ``lease`` is lost meanwhile.

    Raises :class:`LeaseLostError` when that cancellation ended it. A
    cancellation of the caller cancels the callback too and waits for it
    to end, so that the release never overlaps the callback.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(callback)

    def cancel() -> None:
        if lease.lost:
            on_loop(loop, task.cancel)

    if not lease.listen(cancel):
        cancel()
    try:
        try:
            await asyncio.wait((task,))
        except asyncio.CancelledError:
            task.cancel()
            await _wait_out(task)
            raise
        if task.cancelled() and lease.lost:
            raise LeaseLostError(lease.key, lease.token)
        return task.result()
    finally:
        lease.unlisten(cancel)


async def _to_the_end(
    awaitable: Awaitable[object],
) -> tuple[asyncio.Future[object], asyncio.CancelledError | None]:
    """Run ``awaitable`` as a task of its own to its end, even if the caller is cancelled.

    Returns the done task and the caller's cancellation if one arrived, else
    None: what :func:`_wait_out` does for a task made here, cheaper. The task
    settles the caller's waiter itself as it ends, a turn of the event loop
    sooner than a done callback would; where it can (Python 3.12+), it starts
    eagerly, so that a request that needs no I/O ends without a turn at all.
    Every release of an asyncio face runs here once.
    """
    loop = asyncio.get_running_loop()
    signal: list[asyncio.Future[None] | None] = [None]
    task = _start(_signalling(awaitable, signal), loop)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        # A fresh waiter after a cancellation: a cancellation reaches only
        # the future awaited here, which the task's end settles.
        signal[0] = waiter = loop.create_future()
        try:
            await waiter
        except asyncio.CancelledError as exc:
            cancelled = cancelled or exc
    return task, cancelled


async def _signalling(awaitable: Awaitable[T], signal: list[asyncio.Future[None] | None]) -> T:
    """Await ``awaitable``, then settle the waiter in ``signal`` if one waits."""
    try:
        return await awaitable
    finally:
        waiter = signal[0]
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


if sys.version_info >= (3, 12):

    def _start(
        coroutine: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop
    ) -> asyncio.Future[T]:
        """A task of ``coroutine`` on the running ``loop``, eager unless the loop makes its own."""
        if loop.get_task_factory() is not None:
            return loop.create_task(coroutine)
        return asyncio.Task(coroutine, loop=loop, eager_start=True)

else:

    def _start(
        coroutine: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop
    ) -> asyncio.Future[T]:
        """A task of ``coroutine`` on the running ``loop``, made directly unless it makes its own.

        No eager start before Python 3.12. ``asyncio.Task`` directly skips the
        checks of the pure-Python ``create_task``, which cost more than the
        task.
        """
        if loop.get_task_factory() is not None:
            return loop.create_task(coroutine)
        return asyncio.Task(coroutine, loop=loop)


async def _wait_out(task: asyncio.Future[Any]) -> asyncio.CancelledError | None:
    """Wait until ``task`` is done, even if the caller is cancelled meanwhile.

    Returns the caller's cancellation if one arrived (the task runs on,
    untouched: a cancellation reaches only the future awaited here, which
    the task's completion settles), else None. What ``asyncio.wait((task,))``
    does, without its sets and its timeout: a ``run()`` callback that a
    lost lease cancels is waited out here.
    """
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        settle = _settler(waiter)
        task.add_done_callback(settle)
        try:
            await waiter
        except asyncio.CancelledError as exc:
            cancelled = cancelled or exc
        finally:
            task.remove_done_callback(settle)
    return cancelled


def _settler(waiter: asyncio.Future[None]) -> Callable[[object], None]:
    """A done callback that settles ``waiter`` unless it is done (cancelled)."""

    def settle(_: object) -> None:
        if not waiter.done():
            waiter.set_result(None)

    return settle

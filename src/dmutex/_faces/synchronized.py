"""``synchronized``: a function or coroutine that runs under a lock of its own key.

Rules of this module:

1. The decorator decides nothing about a lease. Each call of a decorated
   function is one ``run`` (``on_busy="skip"`` or ``"raise"``: one try) or
   one ``run_with_retry`` (``"wait"``) of the lock's own face, which
   acquires, renews (``auto_renew``), releases and reports a lost lease as
   the engine's rules say; nothing here acquires or releases by itself.
2. Every argument is checked when the decorator is made, before any request:
   the lock's face must be that of the function (a sync lock for a plain
   ``def``, an asyncio lock for an ``async def``, checked when the function
   is decorated), ``on_busy`` has no default, and an option that the chosen
   refusal does not use (``default`` but for ``"skip"``, ``timeout`` and
   ``retry_delay`` but for ``"wait"``) is refused rather than ignored.
3. A computed key is computed on each call, from the call's arguments,
   before the lock is asked: a key function that raises, or returns
   something other than a ``str``, stops the call before any request, and
   the function is not called.
4. A refusal is what ``on_busy`` says, and nothing else: ``"skip"`` returns
   ``default`` without calling the function; ``"raise"``, and ``"wait"``
   once its ``timeout`` has passed, raise :class:`LockBusyError`.
5. The function's own outcome is the caller's: its value is returned, its
   exception propagates after the release. A lease lost while it ran
   (``auto_renew=True``) is a :class:`~dmutex.LeaseLostError` instead of the
   value, as the faces' ``run`` reports it.
6. The wrapper stands for the function: ``functools.wraps`` metadata, the
   same parameters (``ParamSpec``), and an ``async def`` stays a coroutine
   function.
7. Imports come from the faces and the ranks below them only
   (``tests/test_layers.py``).

pottery's ``synchronize(key=..., masters=..., auto_release_time=...,
blocking=..., timeout=...)`` (read in its ``redlock.py``) takes one fixed key
for Redis masters only, wraps plain functions only (its wrapper is a plain
``def``), never extends the lease while the function runs, and on refusal
can only raise (``QuorumNotAchieved``); it waits forever by default. This one
computes the key from the arguments if asked, renews the lease, serves
``async def`` functions on the asyncio classes and runs on every dmutex
backend; it has no Redlock quorum over several independent servers.
"""

from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Literal, ParamSpec, TypeAlias, TypeVar, cast, overload

from .._errors import ArgumentTypeError, InvalidArgumentError, LockBusyError
from .._validate import check_flag, check_key, check_retry_delay, check_timeout, check_ttl
from .aio import AsyncDMutex, AsyncDSemaphore
from .sync import DMutex, DSemaphore

__all__ = ["OnBusy", "synchronized"]

P = ParamSpec("P")
R = TypeVar("R")
D = TypeVar("D")

OnBusy = Literal["wait", "skip", "raise"]
"""What a decorated call does when the lock is held by others."""

_ON_BUSY: tuple[OnBusy, ...] = ("wait", "skip", "raise")

_SyncLock: TypeAlias = "DMutex | DSemaphore"
_AsyncLock: TypeAlias = "AsyncDMutex | AsyncDSemaphore"
_Decorator: TypeAlias = "Callable[[Callable[..., object]], Callable[..., object]]"
_AsyncDecorator: TypeAlias = (
    "Callable[[Callable[..., Coroutine[object, object, object]]], "
    "Callable[..., Coroutine[object, object, object]]]"
)


class _Unset(enum.Enum):
    """An option that the call did not give (so that giving it where it means nothing is seen)."""

    UNSET = enum.auto()


_UNSET = _Unset.UNSET


@dataclass(frozen=True, slots=True)
class _Rule:
    """One decorator's checked arguments: how each call takes its lock and meets a refusal."""

    key: str
    """The fixed key, checked; unused when :attr:`compute` names each call's key."""
    compute: Callable[..., object] | None
    """The key function, called with each call's arguments; None for a fixed key."""
    on_busy: OnBusy
    ttl: float | None
    timeout: float
    retry_delay: float
    default: object
    auto_renew: bool

    def key_of(self, args: tuple[object, ...], kwargs: dict[str, object]) -> str:
        """The key of one call: the fixed one, or the key function's, checked to be a ``str``."""
        if self.compute is None:
            return self.key
        name = self.compute(*args, **kwargs)
        if not isinstance(name, str):
            raise ArgumentTypeError(
                f"the key function {_name(self.compute)} must return a str, "
                f"not {type(name).__name__}"
            )
        return name

    def refused(self, key: str) -> object:
        """What a call gets when the lock was held by others: ``default``, or the error."""
        if self.on_busy == "skip":
            return self.default
        raise LockBusyError(key, self.timeout if self.on_busy == "wait" else None)


def _name(function: object) -> str:
    return str(getattr(function, "__qualname__", None) or repr(function))


def _check(
    key: object,
    on_busy: object,
    ttl: object,
    timeout: object,
    retry_delay: object,
    default: object,
    auto_renew: object,
) -> _Rule:
    """The decorator's arguments, checked (rule 2); raises before any request."""
    mode = next((name for name in _ON_BUSY if isinstance(on_busy, str) and on_busy == name), None)
    if mode is None:
        raise InvalidArgumentError(f"on_busy must be 'wait', 'skip' or 'raise', not {on_busy!r}")
    if isinstance(key, str):
        fixed, compute = check_key(key), None
    elif callable(key):
        fixed, compute = "", key
    else:
        raise ArgumentTypeError(
            f"key must be a str or a function of the call's arguments, not {type(key).__name__}"
        )
    if mode != "wait":
        given = [
            n for n, v in (("timeout", timeout), ("retry_delay", retry_delay)) if v is not _UNSET
        ]
        if given:
            raise InvalidArgumentError(
                f"{' and '.join(given)} applies to on_busy='wait' only, not {mode!r}"
            )
    if mode != "skip" and default is not _UNSET:
        raise InvalidArgumentError(f"default applies to on_busy='skip' only, not {mode!r}")
    return _Rule(
        key=fixed,
        compute=compute,
        on_busy=mode,
        ttl=None if ttl is None else check_ttl("ttl", ttl),
        timeout=30.0 if timeout is _UNSET else check_timeout(timeout),
        retry_delay=0.1 if retry_delay is _UNSET else check_retry_delay(retry_delay),
        default=None if default is _UNSET else default,
        auto_renew=check_flag("auto_renew", auto_renew),
    )


def _sync(function: Callable[P, R], lock: _SyncLock, rule: _Rule) -> Callable[P, R | object]:
    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | object:
        key = rule.key_of(args, kwargs)

        def work(_: object) -> tuple[R]:
            return (function(*args, **kwargs),)

        if rule.on_busy == "wait":
            done = lock.run_with_retry(
                key,
                work,
                ttl=rule.ttl,
                timeout=rule.timeout,
                retry_delay=rule.retry_delay,
                auto_renew=rule.auto_renew,
            )
        else:
            done = lock.run(key, work, rule.ttl, auto_renew=rule.auto_renew)
        return rule.refused(key) if done is None else done[0]

    return wrapper


def _async(
    function: Callable[P, Coroutine[object, object, R]], lock: _AsyncLock, rule: _Rule
) -> Callable[P, Coroutine[object, object, R | object]]:
    @functools.wraps(function)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | object:
        key = rule.key_of(args, kwargs)

        async def work(_: object) -> tuple[R]:
            return (await function(*args, **kwargs),)

        if rule.on_busy == "wait":
            done = await lock.run_with_retry(
                key,
                work,
                ttl=rule.ttl,
                timeout=rule.timeout,
                retry_delay=rule.retry_delay,
                auto_renew=rule.auto_renew,
            )
        else:
            done = await lock.run(key, work, rule.ttl, auto_renew=rule.auto_renew)
        return rule.refused(key) if done is None else done[0]

    return wrapper


# The sync faces: a plain function.


@overload
def synchronized(
    lock: DMutex | DSemaphore,
    key: str | Callable[..., str],
    *,
    on_busy: Literal["wait"],
    ttl: float | None = None,
    timeout: float = 30.0,
    retry_delay: float = 0.1,
    auto_renew: bool = True,
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


@overload
def synchronized(
    lock: DMutex | DSemaphore,
    key: str | Callable[..., str],
    *,
    on_busy: Literal["raise"],
    ttl: float | None = None,
    auto_renew: bool = True,
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


@overload
def synchronized(
    lock: DMutex | DSemaphore,
    key: str | Callable[..., str],
    *,
    on_busy: Literal["skip"],
    ttl: float | None = None,
    auto_renew: bool = True,
) -> Callable[[Callable[P, R]], Callable[P, R | None]]: ...


@overload
def synchronized(
    lock: DMutex | DSemaphore,
    key: str | Callable[..., str],
    *,
    on_busy: Literal["skip"],
    default: D,
    ttl: float | None = None,
    auto_renew: bool = True,
) -> Callable[[Callable[P, R]], Callable[P, R | D]]: ...


# The asyncio faces: a coroutine function.


@overload
def synchronized(
    lock: AsyncDMutex | AsyncDSemaphore,
    key: str | Callable[..., str],
    *,
    on_busy: Literal["wait"],
    ttl: float | None = None,
    timeout: float = 30.0,
    retry_delay: float = 0.1,
    auto_renew: bool = True,
) -> Callable[
    [Callable[P, Coroutine[object, object, R]]], Callable[P, Coroutine[object, object, R]]
]: ...


@overload
def synchronized(
    lock: AsyncDMutex | AsyncDSemaphore,
    key: str | Callable[..., str],
    *,
    on_busy: Literal["raise"],
    ttl: float | None = None,
    auto_renew: bool = True,
) -> Callable[
    [Callable[P, Coroutine[object, object, R]]], Callable[P, Coroutine[object, object, R]]
]: ...


@overload
def synchronized(
    lock: AsyncDMutex | AsyncDSemaphore,
    key: str | Callable[..., str],
    *,
    on_busy: Literal["skip"],
    ttl: float | None = None,
    auto_renew: bool = True,
) -> Callable[
    [Callable[P, Coroutine[object, object, R]]],
    Callable[P, Coroutine[object, object, R | None]],
]: ...


@overload
def synchronized(
    lock: AsyncDMutex | AsyncDSemaphore,
    key: str | Callable[..., str],
    *,
    on_busy: Literal["skip"],
    default: D,
    ttl: float | None = None,
    auto_renew: bool = True,
) -> Callable[
    [Callable[P, Coroutine[object, object, R]]],
    Callable[P, Coroutine[object, object, R | D]],
]: ...


def synchronized(
    lock: DMutex | DSemaphore | AsyncDMutex | AsyncDSemaphore,
    key: str | Callable[..., str],
    *,
    on_busy: OnBusy,
    ttl: float | None = None,
    timeout: float | _Unset = _UNSET,
    retry_delay: float | _Unset = _UNSET,
    default: object = _UNSET,
    auto_renew: bool = True,
) -> _Decorator | _AsyncDecorator:
    """Run the decorated function only while holding ``lock``'s permit for ``key``.

    ``key`` names the lock: a ``str``, or a function that is called with
    each call's arguments and returns the key of that call (calls with
    different keys do not exclude each other). ``lock`` is a
    :class:`~dmutex.DMutex` or :class:`~dmutex.DSemaphore` for a plain
    function, an :class:`~dmutex.AsyncDMutex` or
    :class:`~dmutex.AsyncDSemaphore` for an ``async def`` one. ``ttl`` is the
    lease length (None: the lock's ``default_ttl_seconds``); with
    ``auto_renew=True`` (the default) the lease is renewed while the
    function runs.

    ``on_busy``, required, says what a call does when the permits are held
    by others: ``"wait"`` tries every ``retry_delay`` seconds for
    ``timeout`` seconds, then raises :class:`LockBusyError`; ``"skip"``
    returns ``default`` (None unless given) without calling the function;
    ``"raise"`` raises :class:`LockBusyError` at once.

    Guarantee: the function is called only while this call holds a permit
    of ``key``, and that permit is released after it returns or raises; its
    value is returned and its exception propagates. Bad arguments raise
    ``TypeError``/``ValueError`` here (a lock of the wrong face when the
    function is decorated), and a key function's bad result on the call,
    before any request.

    Caveats: a lease can still be lost while the function runs (the
    database unreachable past its TTL, say). A plain function cannot be
    interrupted: the loss is reported as :class:`~dmutex.LeaseLostError`
    after it returns, instead of its value, and what it did meanwhile is
    done. A coroutine is cancelled when the loss is found, and the call
    raises :class:`~dmutex.LeaseLostError` (with ``auto_renew=True`` it
    runs as a task of its own). Without ``auto_renew`` the lease simply
    expires after ``ttl``, unnoticed. The lock is not re-entrant: a
    decorated function that calls itself with the same key finds it busy.
    """
    rule = _check(key, on_busy, ttl, timeout, retry_delay, default, auto_renew)
    if isinstance(lock, (DMutex, DSemaphore)):
        asynchronous = False
    elif isinstance(lock, (AsyncDMutex, AsyncDSemaphore)):
        asynchronous = True
    else:
        raise ArgumentTypeError(
            "lock must be a DMutex, DSemaphore, AsyncDMutex or AsyncDSemaphore, "
            f"not {type(lock).__name__}"
        )
    face = type(lock).__name__

    def decorate(function: Callable[..., object]) -> Callable[..., object]:
        if not callable(function):
            raise ArgumentTypeError(
                f"synchronized decorates a function, not {type(function).__name__}"
            )
        if inspect.isgeneratorfunction(function) or inspect.isasyncgenfunction(function):
            raise ArgumentTypeError(
                f"{_name(function)} is a generator function: the lock would be held "
                "only while its generator is made; decorate a function that does the work"
            )
        if inspect.iscoroutinefunction(function) != asynchronous:
            if asynchronous:
                raise ArgumentTypeError(
                    f"{face} guards coroutine functions (async def); {_name(function)} "
                    f"is not one: use the sync {face.removeprefix('Async')}"
                )
            raise ArgumentTypeError(
                f"{face} is a sync lock; {_name(function)} is a coroutine function "
                f"(async def): use Async{face}"
            )
        if isinstance(lock, (AsyncDMutex, AsyncDSemaphore)):
            coroutine = cast("Callable[..., Coroutine[object, object, object]]", function)
            return _async(coroutine, lock, rule)
        return _sync(function, lock, rule)

    return decorate

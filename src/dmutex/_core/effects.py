"""The effects: everything dmutex's algorithms ask of the outside world.

An algorithm is a generator of :data:`Steps`. It yields an effect, a driver
(``dmutex._runtime.drivers``) carries it out the sync or the asyncio way and
sends the result back, or throws the exception in. The vocabulary is closed: a
driver matches :data:`Effect` exhaustively, so a new kind of effect is a type
error in every driver until each one handles it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import TypeAlias, TypeVar, cast

from .lease import Lease
from .waiting import Wakeup

T = TypeVar("T")


@dataclass(slots=True)
class Call:
    """One request to the database client: ``fn(*args, **kwargs)``.

    A sync driver calls it and needs a plain value back; an async driver needs
    an awaitable and awaits it. Either refuses the other kind as a client of
    the wrong face. One is made per request, so it is a plain slotted class;
    a store never yields the same one twice (:func:`completing` marks it).

    ``complete`` marks a request that must not be abandoned half-way (a
    release): an async driver lets it finish even if its task is cancelled
    meanwhile, and raises the cancellation after. See :func:`completing`.
    """

    fn: Callable[..., object]
    args: tuple[object, ...] = ()
    kwargs: Mapping[str, object] | None = None
    complete: bool = False


@dataclass(slots=True)
class Callback:
    """The user's ``run()`` callback, called with the handle of the held permit.

    ``lease`` is set when the lease is renewed: an async driver then cancels
    the callback when the lease is lost (a thread cannot be interrupted).
    """

    fn: Callable[..., object]
    handle: object
    lease: Lease | None = None


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait ``seconds`` on the instance's clock (never on the event loop's thread)."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait ``seconds`` on the instance's clock, or less if ``wakeup`` is set meanwhile.

    Only the system clock waits on the wakeup; any other clock sleeps the
    whole time (a :class:`~dmutex.ManualClock` advances), so that a test's
    time moves as it always did.
    """

    wakeup: Wakeup
    seconds: float


Effect: TypeAlias = Call | Callback | Sleep | Wait
Steps: TypeAlias = Generator[Effect, object, T]


def completing(steps: Steps[T]) -> Steps[T]:
    """``steps`` with every request marked :attr:`Call.complete`.

    Marks each request in place: a store makes a new :class:`Call` per
    request and never yields one twice.
    """
    send, throw = steps.send, steps.throw
    value: object = None
    error: BaseException | None = None
    while True:
        try:
            effect = send(value) if error is None else throw(error)
        except StopIteration as done:
            return cast(T, done.value)
        if isinstance(effect, Call):
            effect.complete = True
        try:
            value, error = (yield effect), None
        except BaseException as exc:  # noqa: BLE001 - handed to the wrapped steps
            value, error = None, exc

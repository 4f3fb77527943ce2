"""The requests that dmutex's algorithms make of the outside world.

Every algorithm in dmutex is a generator of :data:`Steps`: it yields an effect
(call this client method, sleep, enter the ready gate), a driver in
``_drive.py`` carries it out in the sync or the asyncio way, and sends the
result back (or throws the exception in). The algorithms never touch a client,
a clock's sleep or a lock themselves, which is how one copy of each serves both
``DMutex`` and ``AsyncDMutex``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Literal, TypeAlias, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class Call:
    """Call ``fn(*args, **kwargs)``; in async code, await what it returns.

    ``role`` names who ``fn`` belongs to, for the error raised when it returns
    the wrong kind of value (an awaitable to a sync driver, or not one to an
    async driver). One is made per request, so it is a plain slotted class.
    """

    fn: Callable[..., object]
    args: tuple[object, ...] = ()
    kwargs: Mapping[str, object] | None = None
    role: Literal["client", "callback"] = "client"


@dataclass(frozen=True)
class Sleep:
    """Wait ``seconds`` on the engine's clock."""

    seconds: float


@dataclass(frozen=True)
class Gate:
    """Enter (``enter=True``) or leave the instance's one-at-a-time gate."""

    enter: bool


Effect: TypeAlias = Call | Sleep | Gate
Steps: TypeAlias = Generator[Effect, object, T]

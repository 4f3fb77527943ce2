"""What dmutex reports of its locks: events as plain data, and the observers that receive them.

Rules of this module:

1. An event is a dataclass that says what happened to one lock instance's
   operation or lease: where (:class:`Source`: service, kind, backend), on
   which key, and what it measured. It is plain data, which observers read
   and never change (not frozen: a frozen dataclass's constructor costs
   each event a microsecond more). The engine makes them; nothing here
   does I/O.
2. An observer is any callable that takes an event (:class:`Observer`). It
   is called synchronously, in the thread or task where the event
   happened, in the order they happened: an operation's :class:`Started`
   before its attempts, its grant before that lease's release or loss. So
   an observer may keep per-operation state in :attr:`Operation.state`
   (an OpenTelemetry span, say) and find it again at the operation's end.
   It must return promptly: it runs inside the lock's call.
3. Observing never changes a lock's outcome. An observer that raises is
   logged on the ``dmutex.observe`` logger (at WARNING, once per observer
   and exception type) and the event is dropped for it; the others still
   get it, and the caller never sees the error.
4. Durations are seconds on the instance's clock (``monotonic()``): a
   :class:`~dmutex.ManualClock` makes them exact. ``waited`` runs from the
   call to the acquire's answer (durations are rounded to the nanosecond,
   so that a ManualClock's steps read back exactly), ``held`` from the
   grant's answer to the release's answer or the loss.
5. Nothing is built for nobody: an instance with no observer makes no
   event. An observer may say when it listens (:class:`Switched`: the
   logging observer while its logger takes DEBUG, OpenTelemetry's while an
   SDK is configured); each operation asks once, as it starts, and makes
   its events only if one listens. A lease observed at its grant is
   observed to its end.
6. Every lease granted while observed ends in at most one :class:`Released`
   or :class:`Lost`, whichever comes first (a lease found lost by its own
   release is :class:`Lost`); so "leases held now" is grants less ends.
   A lease that is neither released nor renewed and simply expires ends
   unseen: nothing watches it, so no event says so.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeAlias, cast

from .._errors import ArgumentTypeError

__all__ = [
    "Acquired",
    "Attempted",
    "Ended",
    "Event",
    "Kind",
    "Lost",
    "NotAcquired",
    "Observer",
    "Observers",
    "Operation",
    "OperationName",
    "Released",
    "Renewed",
    "Source",
    "Started",
    "Switched",
    "Woken",
    "check_observers",
]

_log = logging.getLogger("dmutex.observe")

Kind: TypeAlias = Literal["mutex", "semaphore", "read", "write"]
"""What an instance locks: a mutex's or a semaphore's permits, a read-write lock's side."""

OperationName: TypeAlias = Literal["acquire", "acquire_with_retry", "run", "run_with_retry"]
"""The call an operation's events belong to."""


@dataclass(frozen=True, slots=True)
class Source:
    """The lock instance an event comes from."""

    service: str
    """The instance's ``service_name``."""
    kind: Kind
    backend: str
    """``"redis"``, ``"mongodb"``, ``"postgresql"``, ``"mysql"``, ``"sqlite"`` or ``"memory"``."""


@dataclass(slots=True, eq=False)
class Operation:
    """One call of an acquire or a run, from :class:`Started` to its end.

    ``state`` is the observers' own: where one keeps what it needs between
    the operation's start and its end (rule 2). dmutex never reads it.
    """

    source: Source
    name: OperationName
    key: str
    attempts: int = 0
    """The attempts answered so far (the engine counts them)."""
    state: dict[object, object] = field(default_factory=dict)


@dataclass(slots=True)
class Started:
    """An acquire or a run was called."""

    operation: Operation


@dataclass(slots=True)
class Attempted:
    """One attempt of an acquire was answered: granted, or refused (all permits held)."""

    operation: Operation
    granted: bool


@dataclass(slots=True)
class Woken:
    """A retrying acquire's wait was ended by a release's signal (a hand-off), not by its time."""

    operation: Operation


@dataclass(slots=True)
class Acquired:
    """An acquire ended with a lease."""

    operation: Operation
    token: str
    fence: int | None
    slot: int
    waited: float
    """Seconds from the call to the grant's answer."""
    attempts: int


@dataclass(slots=True)
class NotAcquired:
    """An acquire ended without a lease.

    ``outcome``: ``"refused"`` (a single attempt found every permit held),
    ``"timeout"`` (a retrying acquire's time ran out) or ``"error"`` (it
    raised ``error``; a cancellation included).
    """

    operation: Operation
    outcome: Literal["refused", "timeout", "error"]
    waited: float
    attempts: int
    error: BaseException | None = None


@dataclass(slots=True)
class Ended:
    """A run ended.

    ``outcome``: ``"ok"``, ``"raised"`` (the callback's ``error``),
    ``"lost"`` (the lease was lost while it ran:
    :class:`~dmutex.LeaseLostError`), ``"not acquired"``, or ``"error"``
    (acquiring or releasing raised ``error``).
    """

    operation: Operation
    outcome: Literal["ok", "raised", "lost", "not acquired", "error"]
    error: BaseException | None = None


@dataclass(slots=True)
class Renewed:
    """One automatic renewal of a lease was answered: ``ok``, or failed (it is retried)."""

    source: Source
    key: str
    token: str
    ok: bool


@dataclass(slots=True)
class Released:
    """A lease's release was answered (its first): ``held`` seconds after its grant.

    Each lease ends in at most one :class:`Released` or :class:`Lost` (rule 6).
    """

    source: Source
    key: str
    token: str
    fence: int | None
    held: float


@dataclass(slots=True)
class Lost:
    """dmutex found a lease lost, by its deadline or a reply: ``held`` seconds after its grant."""

    source: Source
    key: str
    token: str
    fence: int | None
    held: float


Event: TypeAlias = (
    Started | Attempted | Woken | Acquired | NotAcquired | Ended | Renewed | Released | Lost
)
"""Everything an observer may be given."""


class Observer(Protocol):
    """Anything that takes dmutex's events: a function, or an object with ``__call__``.

    Called synchronously where the event happens (rule 2); must not block.
    Its exceptions are logged and dropped (rule 3).
    """

    def __call__(self, event: Event, /) -> None:
        """Take one event."""
        ...


class Switched(Observer, Protocol):
    """An observer that listens only at times: ``listening()`` says whether now (rule 5)."""

    def listening(self) -> bool:
        """Whether an operation starting now should be reported to it."""
        ...


class Observers:
    """The observers of one instance, called in order; none may break the others (rule 3).

    :meth:`listening` is asked as each operation starts (rule 5): True if
    an observer always listens, else if a :class:`Switched` one does now.
    """

    __slots__ = ("_always", "_asks", "_switched", "_warned", "observers")

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = tuple(observers)
        switched = [o for o in self.observers if callable(getattr(o, "listening", None))]
        self._switched = tuple(cast("list[Switched]", switched))  # each has listening()
        # Their listening(), looked up once: every acquire asks them (rule 5).
        self._asks = tuple(zip([o.listening for o in self._switched], self._switched, strict=True))
        self._always = len(switched) < len(self.observers)
        self._warned: set[tuple[int, type[BaseException]]] = set()

    def listening(self) -> bool:
        """Whether an operation starting now makes events (rule 5)."""
        if self._always:
            return True
        for listening, observer in self._asks:
            try:
                if listening():
                    return True
            except Exception as error:  # noqa: BLE001 - rule 3
                self._warn(observer, error)
        return False

    def __call__(self, event: Event) -> None:
        for observer in self.observers:
            try:
                observer(event)
            except Exception as error:  # noqa: BLE001 - rule 3: observing never breaks a lock
                self._warn(observer, error)

    def _warn(self, observer: Observer, error: Exception) -> None:
        seen = (id(observer), type(error))
        with _WARNED:
            if seen in self._warned:
                return
            self._warned.add(seen)
        _log.warning(
            "the dmutex observer %r raised %s; its events are dropped for it (logged once)",
            observer,
            type(error).__name__,
            exc_info=error,
        )


_WARNED = threading.Lock()


def check_observers(value: object) -> tuple[Observer, ...]:
    """Return ``value``'s observers as a tuple: a list or tuple of callables (observe rule 2)."""
    if not isinstance(value, (list, tuple)):
        raise ArgumentTypeError(
            f"observers must be a list or tuple of callables, not {type(value).__name__}"
        )
    for observer in value:
        if not callable(observer):
            raise ArgumentTypeError(
                f"every observer must be callable with an event; {observer!r} is not"
            )
    return tuple(cast("list[Observer]", value))  # each was checked callable just above

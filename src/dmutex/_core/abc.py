"""The store protocol: what a backend does for the engine, and the types it answers with.

It sits in ``_core`` (as psycopg keeps its protocols in ``abc.py`` below the
generators) so that the engine depends on the protocol, never on a backend:
``dmutex._backends`` implements it, one store module per kind of client.

Rules of this module:

1. A backend turns a client into a :class:`Store` bound to one namespace (a
   service's key prefix or collection, and a permit count). Each operation
   is a generator of effects, so one store serves sync and async clients
   alike.
2. Adding a backend means adding a store module in ``dmutex._backends`` and
   a branch in ``open_store`` (``dmutex._backends.__init__``); neither this
   protocol nor the engine changes.
3. The helpers here (:func:`sleep`, :func:`extend_each`) are what a store
   without a native mechanism answers with; like the protocol, they do no
   I/O: they only yield effects.
4. Listing a namespace's keys (:class:`Listing`) is a capability beside the
   protocol, not part of it: the engine never needs it, only ``dmutex
   status`` without a key does. Every store of ``dmutex._backends`` (and
   every read-write store) has it; a store written elsewhere (a test's) need
   not, and whoever lists checks for it.
5. A store whose server cannot hold every key or token that the engine's
   own checks accept (PostgreSQL's text holds no NUL) says so as a
   capability too (:class:`TextRule`): the engine asks it when an
   operation is asked for, before the steps exist, so that no request
   (not even the store's preparation) is sent for a text that would fail.
6. Waking an observer on a release (:class:`Watching`) is a capability too:
   an election's ``observe`` waits through it while someone leads, and
   sleeps its poll interval where a store has none. A store has it where a
   release reaches every listener without taking a waiter's place
   (:class:`~dmutex.InMemoryBackend`, PostgreSQL's ``LISTEN``); Redis's
   release signal wakes one waiter, which an observer must not take.
7. A store may mark its releases' requests to run to completion itself
   (:func:`releases_complete`: every request its ``release`` yields is a
   :class:`~dmutex._core.effects.Call` made with ``complete=True``); the
   engine then does not wrap them in ``effects.completing``, one generator
   less per release (engine rule 6). Redis's store does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

from .._clock import Clock
from .effects import Sleep, Steps
from .lease import Lease
from .waiting import Waiter

Renewed: TypeAlias = "int | Exception | None"
"""One lease's answer to ``extend_many``: its new expiry, None (not active), or the error."""


@dataclass(frozen=True, slots=True, order=True)
class Holder:
    """One active permit as storage holds it: its slot, token and expiry (epoch ms)."""

    slot: int
    token: str
    expires_ms: int


@dataclass(frozen=True, slots=True)
class Inspection:
    """What a key's storage holds at ``now_ms``: its active permits, and its fence counter.

    ``fence`` is the counter's value, which is the latest grant's fence, or
    None where the store keeps no counter for the key.
    """

    holders: list[Holder]
    fence: int | None
    now_ms: int


class Store(Protocol):
    """One namespace of lock records on one backend.

    Times are integer milliseconds since the Unix epoch, read from
    :attr:`clock`. A permit is active while ``now < expires_ms``.
    """

    @property
    def clock(self) -> Clock:
        """The clock that expiries are computed from, and retries timed by."""
        ...

    @property
    def max_expiry_ms(self) -> int:
        """The latest expiry this store can hold."""
        ...

    def ready(self) -> Steps[None]:
        """Prepare storage (indexes); a driver runs it once per instance."""
        ...

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None = None
    ) -> Steps[Lease | None]:
        """Take a free or expired slot of ``key`` for ``token``; None if all are active.

        The lease carries the grant's fence where the store keeps one. A
        store may raise (``InvalidArgumentError``) when this is called, before
        the steps exist, for a key it cannot serve as configured.

        ``waiter``: the attempt is one of a retrying acquire's. Where the
        store can wake waiters, a failed attempt registers it (unless
        ``waiter.last``) in the same request, and a successful one ends its
        registration.
        """
        ...

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        """Wait up to ``seconds`` for a release of ``key`` to wake ``waiter``.

        Never longer (``dmutex._core.waiting``, rule 2); a store that cannot
        be woken sleeps the whole time. Never raises an ``Exception``: a
        failed blocking request turns into sleeping out the rest.
        """
        ...

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        """Remove the active permit of ``key`` holding ``token``.

        ``slot`` is known when releasing by handle, ``None`` when releasing by
        key and token. Returns whether a permit was removed.
        """
        ...

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        """Set the expiry of the active permit holding ``token`` to now + ttl.

        Returns the new expiry, or None if no active permit holds ``token``.
        """
        ...

    def holders(self, key: str) -> Steps[Inspection]:
        """The active permits of ``key`` by slot, and its fence counter; changes nothing."""
        ...

    def extend_many(self, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
        """Extend each of ``leases`` (slot known) by its ``ttl_ms``, in as few requests as it can.

        Answers, lease by lease, what :meth:`extend` would (its new expiry,
        or None), or the exception that the request carrying it raised: one
        failed request fails only the leases it carried. Renewal uses it.
        """
        ...


@runtime_checkable
class Listing(Protocol):
    """A store that lists the keys of its namespace that are held (rule 4); changes nothing."""

    def keys(self, limit: int) -> Steps[list[str]]:
        """Up to ``limit`` (>= 1) keys of the namespace with an active hold, sorted.

        A key is listed where :meth:`Store.holders` would show a holder of it
        at the time of the read (a store may also list one it cannot tell
        from held without reading it whole: a read-write lock left with a
        waiting writer's intent alone; its holders then show none). Fewer
        than ``limit`` keys: every such key. ``limit`` keys: more may exist,
        and which ones are listed is the store's choice. Each store bounds
        its requests by ``limit`` where its server can (a ``LIMIT``, a
        cursor's limit); Redis's ``SCAN`` walks the database until it found
        ``limit`` keys or came round.
        """
        ...


@runtime_checkable
class Watching(Protocol):
    """A store that wakes an observer when a key is released (rule 6); changes nothing."""

    def watch(self, key: str, seconds: float) -> Steps[bool]:
        """Wait up to ``seconds`` for a release of ``key``; True when one ended it early.

        Never longer, and never raises an ``Exception``: a failed request
        turns into sleeping out the rest (False). A release that falls
        between the caller's last read and the start of the watch may go
        unseen: the wait then lasts its ``seconds``.
        """
        ...


@runtime_checkable
class TextRule(Protocol):
    """A store that cannot hold every key or token the engine accepts (rule 5); no I/O."""

    def refuse_text(self, what: str, text: str) -> None:
        """Raise :class:`~dmutex.InvalidArgumentError` if ``text`` cannot be held.

        ``what`` names it in the message: ``"key"`` or ``"token"``.
        """
        ...


def releases_complete(store: object) -> bool:
    """Whether ``store`` marks its releases' requests to run to completion itself (rule 7)."""
    return getattr(store, "releases_complete", False) is True


def text_rule(store: object) -> Callable[[str, str], None] | None:
    """``store``'s :meth:`TextRule.refuse_text`, or None: it holds every text the engine accepts."""
    return store.refuse_text if isinstance(store, TextRule) else None


def sleep(seconds: float) -> Steps[None]:
    """``wait`` for a store that cannot be woken: sleep the whole time."""
    yield Sleep(seconds)


class Extends(Protocol):
    """What :func:`extend_each` needs of a store: its ``extend``."""

    def extend(self, key: str, token: str, slot: int | None, ttl_ms: int) -> Steps[int | None]:
        """As :meth:`Store.extend`."""
        ...


def extend_each(store: Extends, leases: Sequence[Lease]) -> Steps[list[Renewed]]:
    """``extend_many`` for a store with no batch request: one ``extend`` per lease, in turn.

    A lease that ended while the requests before it were out (its deadline
    passed, or it was released) gets no request: its answer is None.
    """
    answers: list[Renewed] = []
    for lease in leases:
        if lease.ended:
            answers.append(None)
            continue
        try:
            expires = yield from store.extend(lease.key, lease.token, lease.slot, lease.ttl_ms)
        except Exception as error:  # noqa: BLE001 - this lease's answer; the others go on
            answers.append(error)
        else:
            answers.append(expires)
    return answers

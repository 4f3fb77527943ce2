"""Waiting for a permit: when a retrying acquire tries again, and what wakes it.

Rules of this module:

1. ``retry_delay`` is the longest gap between two attempts, as it always
   was. Each wait lasts a random ``U(0.5, 1) * retry_delay`` (never past the
   deadline), so that waiters that failed together do not retry together.
   No single wait outlasts :data:`MAX_WAIT`: a longer ``retry_delay`` only
   means an extra attempt, which rule 2 allows, and no clock or socket is
   asked for a timeout beyond what it can represent.
2. A wait may end early, never late: a release that the store can signal
   (Redis, :class:`~dmutex.InMemoryBackend`) ends it, and so does the
   expiry of the lease in the way, where the store knows it. A signal is a
   hint to try now, never a grant: the attempt after it decides.
3. No waiter depends on a signal. An expiry, a holder that crashed, a
   release by the TypeScript library: none sends one, and the waiter tries
   again when its wait ends anyway.
4. A waiter that a signal woke and that then lost the race (the holder
   that released took the permit again first, as a tight loop does) pauses
   a few milliseconds (:data:`LOST_PAUSE`) before it blocks again: blocked,
   every release of that loop would wake it only to lose again, at two
   requests each. The pause is part of the wait, never longer.
5. The policy is here, the mechanism is the store's: a store registers a
   :class:`Waiter` when its attempt fails and yields the wait itself
   (``Store.wait``), as a blocking request or a :class:`Wakeup` to wait on.
6. A store may send the next attempt with the wait, in the same round trip
   (Redis: ``BLPOP`` and the acquire script pipelined, so that the server
   runs the attempt the moment the release wakes the waiter). It keeps the
   answer as the waiter's :class:`Ahead`, and the attempt the engine asks
   for next is that one: it was sent with the acquire's one token, before
   the wait, so its deadline counts from then (renewal rule 1), and a lost
   reply is found by the next attempt, as any re-sent copy is.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .chance import CHANCE
from .lease import Lease

# How long past its wait a waiter's registration outlives it on a server: the
# time between the failed attempt's reply and the blocking request reaching
# the server, with room for a slow client.
REGISTRATION_MARGIN_MS = 2000
# Rule 4's pause, in seconds, before the jitter: long enough for a holder's
# tight loop to run a few cycles undisturbed, short enough that the end of
# the loop is noticed within it.
LOST_PAUSE = 0.01
# Rule 1's ceiling on one wait, in seconds: far beyond any useful retry_delay,
# far below what threading, time.sleep and a server's timeout accept.
MAX_WAIT = 3600.0


class Wakeup:
    """A flag that a release sets and one waiter's driver waits on; thread-safe.

    The sync driver blocks on it (``wait``); the async driver listens for it
    (``listen``) and awaits a future that the listener settles.
    """

    __slots__ = ("__weakref__", "_event", "_listeners", "_lock")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def set(self) -> None:
        """Wake the waiter (now, or its next wait returns at once)."""
        with self._lock:
            self._event.set()
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def clear(self) -> None:
        """Forget an earlier wake: the waiter is about to register again."""
        self._event.clear()

    def is_set(self) -> bool:
        """Whether a wake arrived since the last :meth:`clear`."""
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        """Block until woken or ``seconds`` pass; whether it was woken."""
        return self._event.wait(seconds)

    def listen(self, listener: Callable[[], None]) -> bool:
        """Call ``listener()`` on the next wake; False (and no call) if already woken."""
        with self._lock:
            if self._event.is_set():
                return False
            self._listeners.append(listener)
            return True

    def unlisten(self, listener: Callable[[], None]) -> None:
        """Forget ``listener`` if it was not called."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)


@dataclass(frozen=True, slots=True)
class Ahead:
    """An attempt a store sent with a wait (rule 6): its answer, and when it was sent.

    ``error`` is what the attempt raised, for the engine's next attempt to
    raise; ``sent`` is on the store's monotonic clock, taken before the
    request that carried the wait and the attempt went out.
    """

    lease: Lease | None
    error: Exception | None
    sent: float


@dataclass(slots=True, eq=False)
class Waiter:
    """One retrying acquire, as the store sees it between its attempts.

    ``name`` identifies it in a server-side registration (random, like a
    token); ``window_ms`` is how long one registration lasts. The engine
    sets ``last`` before the attempt at the deadline: a store then does not
    register it again. The store sets ``registered`` when an attempt
    registered it, ``expires_in`` (seconds) when it knows when the lease in
    the way runs out, and ``woken`` when a signal ended its last wait (rule
    4: if the attempt after it fails, the next wait starts with a pause).
    ``registered_at`` is when (on the store's monotonic clock) the store
    last registered it, so that it need not on every attempt.

    ``token`` and ``ttl_ms`` are the acquire's, the same for every attempt
    (the engine sets them), so that a store can send an attempt ahead with
    a wait (rule 6); ``ahead`` is that attempt until the engine's next
    attempt takes it, and ``sent`` the send time of the attempt the store
    answered last from ``ahead`` (the engine's deadline counts from it).
    """

    window_ms: int
    name: str = field(default_factory=lambda: f"dmutex:waiter:{os.urandom(12).hex()}")
    wakeup: Wakeup = field(default_factory=Wakeup)
    last: bool = False
    registered: bool = False
    expires_in: float | None = None
    woken: bool = False
    registered_at: float = 0.0
    token: str = ""
    ttl_ms: int = 0
    ahead: Ahead | None = None
    sent: float | None = None


def waiter(retry_delay: float) -> Waiter:
    """A waiter for an acquire that waits at most ``retry_delay`` seconds at a time."""
    return Waiter(math.ceil(min(retry_delay, MAX_WAIT) * 1000) + REGISTRATION_MARGIN_MS)


def next_wait(retry_delay: float, remaining: float, expires_in: float | None) -> float:
    """Seconds to wait before the next attempt: rule 1, cut short by a known expiry (rule 2)."""
    seconds = min(retry_delay * (0.5 + 0.5 * CHANCE.random()), MAX_WAIT)  # jitter, not secrecy
    if seconds >= 0.001:
        # Whole milliseconds, as every stored time is: a ManualClock's
        # readings stay exact, and a server counts a block in milliseconds.
        seconds = math.floor(seconds * 1000) / 1000
    if expires_in is not None:
        seconds = min(seconds, max(expires_in, 0.0))
    return min(seconds, remaining)


def lost_pause(seconds: float) -> float:
    """Rule 4: how long a woken waiter that lost pauses, jittered, within a wait of ``seconds``."""
    return min(seconds, LOST_PAUSE * (0.5 + 0.5 * CHANCE.random()))  # jitter, not secrecy


def pieces(seconds: float | None, now: Callable[[], float]) -> Iterator[float]:
    """The timeouts of one wait of ``seconds`` (None: no end) on clock ``now``, piece by piece.

    Each piece is at most :data:`MAX_WAIT` and is computed, when asked for,
    from what is left of the whole, so that the pieces together never
    outlast ``seconds``; the waiter stops asking once its wait ended. It
    serves waits that are not a retry's: ``wait_lost`` on both faces, whose
    event and timers refuse a timeout past the platform's limit.
    """
    until = None if seconds is None else now() + seconds
    while True:
        left = MAX_WAIT if until is None else until - now()
        if left <= 0:
            return
        yield min(left, MAX_WAIT)

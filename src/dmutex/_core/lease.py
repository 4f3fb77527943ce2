"""A lease, and the epoch-millisecond arithmetic of its expiry.

Every time dmutex stores is whole milliseconds since the Unix epoch, read
from a :class:`~dmutex.Clock`; a permit is active while ``now < expires_ms``.
"""

from __future__ import annotations

import math
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from operator import itemgetter

from .._clock import Clock
from .._errors import InvalidArgumentError

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

# The latest expiry a lease may have: handles show it as a datetime, and
# datetimes end in the year 9999.
MAX_EXPIRY_MS = (
    int((datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone.utc) - EPOCH).total_seconds()) * 1000
)


@dataclass(slots=True, eq=False)
class Lease:
    """One granted permit: what the store wrote, shared by its handle and the engine.

    ``expires_ms`` moves forward on a successful extend, and ``ttl_ms`` is
    the length the last grant or extend asked for (what renewal extends
    by); ``renewing`` says whether dmutex renews it. ``fence`` is the
    grant's fencing number where the store keeps one.

    ``deadline`` is when this holder counts the lease lost, in seconds on
    its clock's ``monotonic()``, and ``confirmed`` the send time of the
    request that set it (see :mod:`dmutex._core.renewal`, rule 1); until the
    engine stamps a grant, it is lost at once.

    ``released`` is set before a release is sent, so that renewal stops
    first; ``lost`` once dmutex learns that the lease ended without being
    released (see :mod:`dmutex._core.renewal`). ``listeners`` are called
    once each when the lease ends (``ended``): found lost, or released.
    """

    key: str
    token: str
    slot: int
    expires_ms: int
    fence: int | None = None
    ttl_ms: int = 0
    deadline: float = -math.inf
    confirmed: float = -math.inf
    renewing: bool = False
    released: bool = False
    lost: bool = False
    ended: bool = False
    listeners: list[Callable[[], None]] | None = None

    def listen(self, listener: Callable[[], None]) -> bool:
        """Call ``listener()`` when the lease ends; False (and no call) if it has ended."""
        with _LISTENING:
            if self.ended:
                return False
            if self.listeners is None:
                self.listeners = []
            self.listeners.append(listener)
            return True

    def unlisten(self, listener: Callable[[], None]) -> None:
        """Forget ``listener`` if it is still waiting."""
        with _LISTENING:
            if self.listeners is not None and listener in self.listeners:
                self.listeners.remove(listener)

    def end(self) -> Sequence[Callable[[], None]]:
        """Mark the lease ended and hand over its listeners, once: later calls get none."""
        with _LISTENING:
            self.ended = True
            listeners, self.listeners = self.listeners, None
        return listeners or ()


# Guards every lease's listener list: the renewal thread ends leases that
# other threads listen to.
_LISTENING = threading.Lock()


def now_ms(clock: Clock) -> int:
    """The clock's wall-clock reading in whole milliseconds."""
    return round(clock.time() * 1000)


def expiry_datetime(expires_ms: int) -> datetime:
    """An expiry in epoch milliseconds as a timezone-aware UTC datetime."""
    return EPOCH + timedelta(milliseconds=expires_ms)


def ttl_to_ms(seconds: float, clock: Clock, max_expiry_ms: int = MAX_EXPIRY_MS) -> int:
    """``seconds`` in whole milliseconds, if an expiry that far ahead can be stored.

    Rounds up, as the TypeScript library does for ``PX``, so a lease never
    lasts less than asked.
    """
    limit = min(MAX_EXPIRY_MS, max_expiry_ms)
    # Compare before multiplying: seconds * 1000 overflows to inf near 1e305.
    if seconds > limit / 1000 or now_ms(clock) + math.ceil(seconds * 1000) > limit:
        raise InvalidArgumentError(f"ttl={seconds} puts the expiry past what the backend can store")
    return math.ceil(seconds * 1000)


def new_token() -> str:
    """A random UUID4 string, as ``str(uuid.uuid4())`` gives, a fresh one per call.

    It runs once per acquire, so tokens are made 64 at a time from one
    ``os.urandom`` read (one system call instead of 64) and handed out one
    each; any thread may call it. A forked child drops the tokens it
    inherited, which its parent hands out too.
    """
    try:
        return _TOKENS.popleft()  # atomic: no two callers get the same one
    except IndexError:
        return _refill()


_BATCH = 64
# uuid4's version (0100) and variant (10) bits, set on every byte at once.
_VERSION = bytes((byte & 0x0F) | 0x40 for byte in range(256))
_VARIANT = bytes((byte & 0x3F) | 0x80 for byte in range(256))
# A UUID's groups of hex digits, 8-4-4-4-12.
_GROUPS = itemgetter(slice(0, 8), slice(8, 12), slice(12, 16), slice(16, 20), slice(20, 32))
_TOKENS: deque[str] = deque()


def _refill() -> str:
    """Make a batch of tokens: return one, keep the others for the next callers.

    Sets the version and variant bits on 16 random bytes each, which is all
    ``uuid4`` does. Two threads that refill at once just make more.
    """
    raw = bytearray(os.urandom(16 * _BATCH))
    raw[6::16] = raw[6::16].translate(_VERSION)
    raw[8::16] = raw[8::16].translate(_VARIANT)
    h = raw.hex()
    tokens = ["-".join(_GROUPS(h[i : i + 32])) for i in range(0, len(h), 32)]
    _TOKENS.extend(tokens[1:])
    return tokens[0]


if hasattr(os, "register_at_fork"):  # not on Windows, which cannot fork
    os.register_at_fork(after_in_child=_TOKENS.clear)

"""The backend seam: what a storage backend does for the core.

A backend turns a client into a :class:`Store` bound to one namespace (service,
prefix, permit count). The core asks the store for four things, each a
generator of effects so that one backend implementation serves sync and async
clients alike. Adding MongoDB or Redis means adding a store and a line in
``_backends.py``; the core does not change.

Room for what comes next:

- fencing: a store may return a monotonically increasing ``fence`` with each
  grant; the core carries it on the lease;
- background renewal: renewal is ``extend`` on a schedule, driven by the same
  drivers as everything else;
- waiting strategies: the retry loop only yields :class:`~dmutex._effects.Sleep`
  between attempts, so a store that can be told of releases (pub/sub, change
  streams) can plug in a different wait without touching the retry logic.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Literal, Protocol

from ._clock import Clock
from ._effects import Steps

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

# The latest expiry a lease may have: handles expose it as a datetime, and
# datetimes end in the year 9999.
MAX_EXPIRY_MS = (
    int((datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone.utc) - EPOCH).total_seconds()) * 1000
)


@dataclass(slots=True)
class Grant:
    """A permit the store handed out: its slot and when it expires."""

    slot: int
    expires_ms: int
    fence: int | None = None


@dataclass(frozen=True)
class Namespace:
    """Everything a store needs to know about the instance it serves.

    The names are already resolved from the constructor's options:
    ``key_prefix`` for Redis-shaped stores, ``db_name`` and ``collection_name``
    for MongoDB-shaped ones.
    """

    service_name: str
    kind: Literal["mutex", "semaphore"]
    max_permits: int
    key_prefix: str
    db_name: str
    collection_name: str
    asynchronous: bool


class Store(Protocol):
    """One namespace of lock records on one backend.

    Times are integer milliseconds since the Unix epoch, read from
    :attr:`clock`. A permit is active while ``now < expires_ms``.
    """

    @property
    def clock(self) -> Clock:
        """The clock that expiries are computed from."""
        ...

    @property
    def max_expiry_ms(self) -> int:
        """The latest expiry this store can hold."""
        ...

    def ready(self) -> Steps[None]:
        """Prepare storage (indexes); the core runs it once per instance."""
        ...

    def acquire(self, key: str, token: str, ttl_ms: int) -> Steps[Grant | None]:
        """Take a free or expired slot of ``key`` for ``token``; None if all are active."""
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


def now_ms(clock: Clock) -> int:
    """The clock's wall-clock reading in whole milliseconds."""
    return round(clock.time() * 1000)


def expiry_datetime(expires_ms: int) -> datetime:
    """An expiry in epoch milliseconds as a timezone-aware UTC datetime."""
    return EPOCH + timedelta(milliseconds=expires_ms)

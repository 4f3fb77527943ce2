"""What every lock handle shows, whichever face made it."""

from __future__ import annotations

from datetime import datetime
from typing import Generic, TypeVar

from .._core.engine import Engine
from .._core.lease import Lease, expiry_datetime

D = TypeVar("D")


class HandleBase(Generic[D]):
    """The read-only view of one lease: key, token and expiry.

    ``D`` is the face's driver for ``Steps[bool]``: a plain function for the
    sync handles, a coroutine function for the async ones.
    """

    __slots__ = ("_drive", "_engine", "_lease")

    def __init__(self, lease: Lease, engine: Engine, drive: D) -> None:
        self._lease = lease
        self._engine = engine
        self._drive = drive

    @property
    def key(self) -> str:
        """The key this permit was acquired for."""
        return self._lease.key

    @property
    def token(self) -> str:
        """The ownership token: a random UUID4 string, unique to this permit."""
        return self._lease.token

    @property
    def expired_at(self) -> datetime:
        """When the lease expires (UTC, timezone-aware), as the client computed it.

        Updated by a successful ``extend()``. The backend enforces the real
        expiry; with Redis and MongoDB, this value is only as right as the
        client's clock.
        """
        return expiry_datetime(self._lease.expires_ms)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} key={self.key!r} token={self.token!r} "
            f"expired_at={self.expired_at.isoformat()}>"
        )


class SlotMixin(HandleBase[D]):
    """Adds the permit's slot number, for semaphore permits."""

    __slots__ = ()

    @property
    def slot(self) -> int:
        """The internal permit slot, ``0 .. max_permits-1``."""
        return self._lease.slot

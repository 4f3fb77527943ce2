"""What every lock handle shows, whichever face made it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import Any, Generic, TypeVar

from .._core import renewal
from .._core.engine import Engine
from .._core.lease import Lease, expiry_datetime, now_ms
from .._errors import LeaseLostError
from .._validate import check_callback

D = TypeVar("D")
Self = TypeVar("Self", bound="HandleBase[Any]")


class HandleBase(Generic[D]):
    """The view of one lease: key, token, expiry, fence, and whether it is lost.

    ``D`` is the face's driver for ``Steps[bool]``: a plain function for the
    sync handles, a coroutine function for the async ones.
    """

    __slots__ = ("__weakref__", "_drive", "_engine", "_lease", "_ticket", "_watched")

    def __init__(self, lease: Lease, engine: Engine, drive: D) -> None:
        self._lease = lease
        self._engine = engine
        self._drive = drive
        self._watched = lease.renewing
        self._ticket = -1  # the renewer's number for this handle's next turn
        self._bind()

    def _bind(self) -> None:
        """Tie the handle to where its face renews it (async: the running loop)."""

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

    @property
    def fence(self) -> int | None:
        """The fencing token of this grant, or None where the backend keeps none.

        Strictly greater than the fence of every earlier grant of the same
        key (all permits of a key share one sequence). Pass it with every
        write to the resource the lock guards, and let the resource refuse
        a write whose fence is lower than the highest it has seen: a holder
        whose lease ran out then cannot overwrite its successor's work. See
        the README, "Fencing tokens", for which backends keep one.
        """
        return self._lease.fence

    @property
    def auto_renew(self) -> bool:
        """Whether dmutex renews this lease in the background (``auto_renew=True``)."""
        return self._lease.renewing

    @property
    def lost(self) -> bool:
        """True once the lease is known to be gone without this handle releasing it.

        Known gone: a renewal or an ``extend()`` was refused, a renewal could
        not reach the server before the expiry estimate (less a margin)
        passed, a ``release()`` found it already gone, or the expiry estimate
        passed without a renewal. False after a successful ``release()``.
        """
        return renewal.is_lost(self._lease, now_ms(self._engine.clock))

    def raise_if_lost(self) -> None:
        """Raise :class:`~dmutex.LeaseLostError` if :attr:`lost`: call it between steps of work."""
        if self.lost:
            raise LeaseLostError(self._lease.key, self._lease.token)

    def on_lost(self: Self, callback: Callable[[Self], object]) -> None:
        """Call ``callback(handle)`` once, when the lease is found lost; at once if it is.

        Sync handles call it in the thread that found the loss (the renewal
        thread, or the caller of ``extend()``/``release()``); async handles
        on their event loop. A lease that is not renewed is watched until
        its expiry estimate. Never called after a successful ``release()``.
        An exception from the callback is logged (logger ``dmutex``).
        """
        check_callback(callback)
        lease = self._lease

        def listener() -> None:
            if lease.lost:
                callback(self)

        if not lease.listen(listener):
            listener()  # it ended before: lost, or released
        elif not self._settle():
            self._watch()

    def _settle(self) -> bool:
        """Whether the lease is lost, marking it so (and calling listeners) if its expiry passed."""
        lease = self._lease
        if not lease.lost and renewal.is_lost(lease, now_ms(self._engine.clock)):
            renewal.lose(lease)
        return lease.lost

    def _watch(self) -> None:
        """Have the face's renewer watch this lease's expiry, once (renewed leases already are)."""
        if not self._watched:
            self._watched = True
            self._schedule(renewal.watch(self._lease, self._engine.clock))

    def _schedule(self, delay: float | None) -> None:
        raise NotImplementedError

    def _delays(
        self, group: Sequence[HandleBase[D]], renewed: Iterator[float | None]
    ) -> list[float | None]:
        """Each handle's next turn: from ``renewed`` in order if renewed, else its watch."""
        clock = self._engine.clock
        return [
            next(renewed) if handle._lease.renewing else renewal.watch(handle._lease, clock)
            for handle in group
        ]

    def _extended(self, done: bool) -> bool:
        """After an ``extend()``: a renewed lease's next renewal is a third of its new TTL away."""
        if done and self._lease.renewing and not self._lease.lost:
            self._schedule(renewal.interval(self._lease.ttl_ms))
        return done

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

"""What every lock handle shows, whichever face made it."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, Generic, TypeVar

from .._core import renewal
from .._core.engine import Engine
from .._core.lease import Lease, expiry_datetime
from .._errors import LeaseLostError
from .._validate import check_callback

D = TypeVar("D")
Self = TypeVar("Self", bound="HandleBase[Any]")


class HandleBase(Generic[D]):
    """The view of one lease: key, token, expiry, fence, and whether it is lost.

    ``D`` is the face's driver for ``Steps[bool]``: a plain function for the
    sync handles, a coroutine function for the async ones.
    """

    __slots__ = (
        "__weakref__",
        "_drive",
        "_engine",
        "_lease",
        "_ticket",
        "_watch_ticket",
        "_watched",
    )

    def __init__(self, lease: Lease, engine: Engine, drive: D) -> None:
        self._lease = lease
        self._engine = engine
        self._drive = drive
        self._watched = False
        self._ticket = -1  # the renewer's number for this handle's next renewal
        self._watch_ticket = -1  # and for its deadline's watch
        self._bind()

    def _bind(self) -> None:
        """Tie the handle to where its face renews it (async: the running loop)."""

    @property
    def key(self) -> str:
        """The key this permit was acquired for."""
        return self._lease.key

    @property
    def token(self) -> str:
        """The ownership token, unique to this permit: a random UUID4 string and the holder's stamp.

        ``uuid|since_ms|identity`` (see the Storage layout page), or the bare
        UUID4 string for an instance made with ``identity=""``. Whoever has
        it can release or extend the permit.
        """
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
        whose lease ran out then cannot overwrite its successor's work. The
        documentation's "Fencing tokens" page says which backends keep one.
        """
        return self._lease.fence

    @property
    def auto_renew(self) -> bool:
        """Whether dmutex renews this lease in the background (``auto_renew=True``)."""
        return self._lease.renewing

    @property
    def lost(self) -> bool:
        """True once the lease is known to be gone without this handle releasing it.

        Known gone: a renewal or an ``extend()`` was refused, a ``release()``
        found it already gone, or its deadline (:attr:`time_left`) passed
        before a renewal or extend was answered. False after a successful
        ``release()``. Read by this process's own clock: no reply is awaited.
        """
        return renewal.is_lost(self._lease, self._engine.clock.monotonic())

    @property
    def time_left(self) -> float:
        """Seconds until this holder must count the lease lost, by its own clock.

        The deadline is the send time of the last grant, renewal or extend
        that was answered, plus the TTL it set, less a margin (a tenth of
        the TTL, at least 0.2 s but at most a quarter of it, and at most
        2 s: ``renewal.margin_ms``). Until then no other holder can be granted
        this permit, whatever the network does, as long as the clocks keep
        the rate assumptions of the documentation's "Guarantees and limits". 0.0 once lost or
        released. Use it to bound work that cannot check :attr:`lost`.
        """
        return renewal.time_left(self._lease, self._engine.clock)

    def raise_if_lost(self) -> None:
        """Raise :class:`~dmutex.LeaseLostError` if :attr:`lost`: call it between steps of work."""
        if self.lost:
            raise LeaseLostError(self._lease.key, self._lease.token)

    def on_lost(self: Self, callback: Callable[[Self], object]) -> None:
        """Call ``callback(handle)`` once, when the lease is found lost; at once if it is.

        Called by the deadline (:attr:`time_left`) at the latest, even while
        a renewal request hangs. Sync handles call it in the thread that
        found the loss (the renewer's thread, or the caller of
        ``extend()``/``release()``); async handles on their event loop. A
        lease that is not renewed is watched until its deadline too. Never
        called after a successful ``release()``. An exception from the
        callback is logged (logger ``dmutex``). Keep it short: the renewer
        waits for it.
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
        """Whether the lease is lost, marking it so (listeners called) if its deadline passed."""
        lease = self._lease
        if not lease.lost and renewal.is_lost(lease, self._engine.clock.monotonic()):
            renewal.lose(lease)
        return lease.lost

    def _watch(self) -> None:
        """Have the face's renewer watch this lease's deadline, once."""
        if not self._watched:
            self._watched = True
            if not self._lease.renewing:  # a renewed one is watched while renewing
                self._guard(renewal.watch(self._lease, self._engine.clock))
            # Not a method of self: the lease must not keep its handle alive.
            self._lease.listen(self._poke())

    def _check(self) -> float | None:
        """The renewer's watch: seconds until the deadline, or None (lost now, or ended)."""
        return renewal.watch(self._lease, self._engine.clock)

    def _schedule(self, delay: float | None) -> None:
        """Renew this lease ``delay`` seconds from now (None: never)."""
        raise NotImplementedError

    def _guard(self, delay: float | None) -> None:
        """Watch this lease's deadline, ``delay`` seconds from now (None: never)."""
        raise NotImplementedError

    def _poke(self) -> Callable[[], None]:
        """A function that has the renewer drop this lease's turns once it ended."""
        raise NotImplementedError

    @property
    def _over(self) -> bool:
        """Whether the lease ended (lost or released): the renewer drops its turns."""
        return self._lease.ended

    @property
    def _deadline(self) -> float:
        """The lease's deadline, for the renewer's watch (see ``renewal``, rule 1)."""
        return self._lease.deadline

    def _extended(self, done: bool) -> bool:
        """After an ``extend()``: renew a third of the new TTL on, and watch the new deadline."""
        if done and not self._lease.lost:
            if self._lease.renewing:
                self._schedule(renewal.interval(self._lease.ttl_ms))
            if self._watched and not self._lease.renewing:  # the deadline may have come closer
                self._guard(renewal.watch(self._lease, self._engine.clock))
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

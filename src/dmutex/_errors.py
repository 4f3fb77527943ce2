"""The exceptions dmutex raises itself.

Each one also subclasses the built-in that the contract names, so
``except ValueError`` and ``except TypeError`` keep working.
"""

from __future__ import annotations

__all__ = [
    "AmbiguousClientError",
    "ArgumentTypeError",
    "DMutexError",
    "InvalidArgumentError",
    "LeaseLostError",
    "NotReplicatedError",
    "UnsupportedClientError",
]


class DMutexError(Exception):
    """Base class of every error that dmutex raises itself.

    Errors from the database client (connection refused, authentication,
    server errors) are not wrapped: they reach the caller as the client raised
    them.
    """


class InvalidArgumentError(DMutexError, ValueError):
    """An argument has the right type but a value dmutex cannot use."""


class ArgumentTypeError(DMutexError, TypeError):
    """An argument has a type dmutex does not accept."""


class UnsupportedClientError(DMutexError, TypeError):
    """The client meets no contract that this class can use.

    Raised for a client that matches neither the MongoDB nor the Redis
    contract, for a ``backend=`` that names a contract the client does not
    meet, and for an asyncio client given to a sync class (or the reverse).
    """


class AmbiguousClientError(UnsupportedClientError):
    """The client matches both contracts; pass ``backend=`` to choose one."""


class LeaseLostError(DMutexError):
    """A lease ended while its holder still relied on it.

    Raised by ``raise_if_lost()`` on a handle whose lease is lost, and by
    ``run(..., auto_renew=True)`` when the lease was lost while the callback
    ran: renewal was refused, could not reach the server before the expiry
    estimate passed, or the final release found the lease already gone.
    ``key`` and ``token`` name the lease.
    """

    def __init__(self, key: str, token: str) -> None:
        super().__init__(f"the lease on {key!r} (token {token}) was lost")
        self.key = key
        self.token = token

    def __reduce__(self) -> tuple[type[LeaseLostError], tuple[str, str]]:
        return (type(self), (self.key, self.token))


class NotReplicatedError(DMutexError):
    """A write was not acknowledged by ``replicas`` replicas in time; it counts for nothing.

    Raised with ``replicas=N`` (Redis) by an acquire whose grant reached
    fewer than N replicas within ``replicas_timeout``: the permit was released
    again before this was raised (if that release failed too, the permit
    lapses at its TTL). Raised by an ``extend`` the same way: the lease then
    keeps the expiry it had before, which replicas hold. A renewal that is not
    replicated is retried, as a renewal that could not reach the server is,
    and the lease is lost at its deadline if none is. ``key`` names the lock,
    ``acknowledged`` and ``required`` count replicas.
    """

    def __init__(self, key: str, acknowledged: int, required: int) -> None:
        super().__init__(
            f"the write on {key!r} reached {acknowledged} of the {required} replicas "
            f"required in time: it was not counted"
        )
        self.key = key
        self.acknowledged = acknowledged
        self.required = required

    def __reduce__(self) -> tuple[type[NotReplicatedError], tuple[str, int, int]]:
        return (type(self), (self.key, self.acknowledged, self.required))


class LockBusyError(DMutexError):
    """The lock was held by others: ``key``, and for ``"wait"`` the ``timeout`` that passed.

    Raised by a function decorated with :func:`~dmutex.synchronized` and
    ``on_busy="raise"`` when its one try found the lock held, or with
    ``on_busy="wait"`` when ``timeout`` seconds passed first; the function
    was not called. ``timeout`` is None for ``"raise"``.
    """

    def __init__(self, key: str, timeout: float | None = None) -> None:
        if timeout is None:
            message = f"the lock {key!r} is held by others"
        else:
            message = f"the lock {key!r} was still held by others after {timeout} s"
        super().__init__(message)
        self.key = key
        self.timeout = timeout

    def __reduce__(self) -> tuple[type[LockBusyError], tuple[str, float | None]]:
        return (type(self), (self.key, self.timeout))

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

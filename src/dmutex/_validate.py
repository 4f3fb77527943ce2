"""Checks that turn bad input into a clear error before any I/O happens."""

from __future__ import annotations

import math
import numbers
from typing import Literal, cast

from ._clock import Clock
from ._errors import ArgumentTypeError, InvalidArgumentError

BackendName = Literal["mongodb", "redis"]

_BACKENDS: tuple[BackendName, ...] = ("mongodb", "redis")


def check_str(name: str, value: object, *, allow_empty: bool = False) -> str:
    """Return ``value`` if it is a ``str`` (non-empty unless ``allow_empty``)."""
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be a str, not {type(value).__name__}")
    if not value and not allow_empty:
        raise InvalidArgumentError(f"{name} must not be empty")
    return value


def check_key(key: object) -> str:
    """Return a lock key: a non-empty ``str``."""
    if type(key) is str and key:  # the common case, on every operation
        return key
    return check_str("key", key)


def check_token(token: object) -> str:
    """Return an ownership token: a non-empty ``str``."""
    return check_str("token", token)


def _real(name: str, value: object) -> float:
    # bool is an int subclass; True seconds is always a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be an int or float, not {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise InvalidArgumentError(f"{name} must be finite, not {number}")
    return number


def check_ttl(name: str, value: object) -> float:
    """Return a lease duration in seconds: a finite number > 0."""
    seconds = _real(name, value)
    if seconds <= 0:
        raise InvalidArgumentError(f"{name} must be > 0 seconds, not {seconds}")
    return seconds


def check_timeout(value: object) -> float:
    """Return a retry timeout in seconds: a finite number >= 0."""
    seconds = _real("timeout", value)
    if seconds < 0:
        raise InvalidArgumentError(f"timeout must be >= 0 seconds, not {seconds}")
    return seconds


def check_retry_delay(value: object) -> float:
    """Return a delay between attempts in seconds: a finite number > 0."""
    return check_ttl("retry_delay", value)


def check_max_permits(value: object) -> int:
    """Return a permit count: an ``int`` >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"max_permits must be an int, not {type(value).__name__}")
    permits = int(value)
    if permits < 1:
        raise InvalidArgumentError(f"max_permits must be >= 1, not {permits}")
    return permits


def check_backend(value: object) -> BackendName | None:
    """Return ``None``, ``"mongodb"`` or ``"redis"``."""
    if value is None:
        return None
    for name in _BACKENDS:
        if isinstance(value, str) and value == name:
            return name
    raise InvalidArgumentError(f"backend must be 'mongodb', 'redis' or None, not {value!r}")


_CLOCK_METHODS = ("time", "monotonic", "sleep", "sleep_async")


def check_clock(value: object) -> Clock | None:
    """Return ``None`` or an object with the :class:`~dmutex.Clock` methods."""
    if value is None:
        return None
    missing = [name for name in _CLOCK_METHODS if not callable(getattr(value, name, None))]
    if missing:
        raise ArgumentTypeError(
            f"clock must be a dmutex.Clock; {type(value).__name__} has no {', '.join(missing)}"
        )
    return cast(Clock, value)  # its methods were checked just above


def check_callback(value: object) -> None:
    """Raise unless ``value`` is callable."""
    if not callable(value):
        raise ArgumentTypeError(f"callback must be callable, not {type(value).__name__}")


# MongoDB's own rules for names, so that a bad one fails at construction
# rather than at the first write.
_BAD_DB_CHARS = frozenset('/\\. "$\x00')


def check_db_name(value: object) -> str:
    """Return a MongoDB database name that the server will accept."""
    name = check_str("db_name", value)
    bad = sorted(_BAD_DB_CHARS.intersection(name))
    if bad:
        raise InvalidArgumentError(f"db_name {name!r} contains {bad!r}")
    if len(name.encode()) >= 64:
        raise InvalidArgumentError(f"db_name {name!r} is 64 bytes or longer")
    return name


def check_collection_name(value: str, origin: str) -> str:
    """Return a MongoDB collection name that the server will accept.

    ``origin`` says where the name came from, for the error message.
    """
    if not value:
        raise InvalidArgumentError(f"{origin} gives an empty collection name")
    if "$" in value or "\x00" in value:
        raise InvalidArgumentError(
            f"{origin} gives collection name {value!r}, which contains '$' or NUL"
        )
    if value.startswith("system."):
        raise InvalidArgumentError(
            f"{origin} gives collection name {value!r}; 'system.' is reserved"
        )
    return value

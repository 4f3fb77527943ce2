"""Checks that turn bad input into a clear error before any I/O happens."""

from __future__ import annotations

import math
import numbers
from typing import Literal, cast

from ._clock import Clock
from ._errors import ArgumentTypeError, InvalidArgumentError

BackendName = Literal["dynamodb", "etcd", "mongodb", "mysql", "postgresql", "redis"]
"""The values ``backend=`` takes: the backend to use instead of detecting it from the client."""

_BACKENDS: tuple[BackendName, ...] = ("dynamodb", "etcd", "mongodb", "mysql", "postgresql", "redis")

MAX_PERMITS = 1024
"""The largest ``max_permits`` a semaphore may have.

On Redis every operation that looks for a token runs one script over all of
a lock's slot keys, and the server serves nobody else meanwhile. Measured on
a 2-core VM with Redis 7.0 (SLOWLOG, 200 calls each), a full semaphore's
acquire at 1,024 permits ran 0.41 ms (median; 0.62 ms at most), as did a
release by an unknown token; at 4,096 permits, 2.1 ms (5.9 ms at most).
"""

MAX_KEY_LENGTH = 500
"""The longest key, in characters, that every backend accepts.

Every layout stores it: 512 characters (the TypeScript MySQL store's
``varchar(512)`` row key) less ``permit:1023:``, the longest slot prefix.
"""


def shown(value: object) -> str:
    """``repr(value)``, cut short: huge ints have thousands of digits (or too many to print)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def check_str(name: str, value: object, *, allow_empty: bool = False) -> str:
    """Return ``value`` if it is a ``str`` that UTF-8 can encode (non-empty unless ``allow_empty``).

    Every name ends up as UTF-8 bytes on the wire; a lone surrogate (such as
    U+D800 alone) cannot be encoded, and would fail inside the client.
    """
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be a str, not {type(value).__name__}")
    if not value and not allow_empty:
        raise InvalidArgumentError(f"{name} must not be empty")
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError as error:
            raise InvalidArgumentError(
                f"{name} {value!r} cannot be encoded as UTF-8 ({error.reason} at {error.start})"
            ) from None
    return value


def check_key(key: object) -> str:
    """Return a lock key: a non-empty plain ``str`` of at most 500 characters, UTF-8 encodable.

    A ``str`` subclass (a ``(str, Enum)`` member, say) names the lock of its
    ``str`` value, on every backend: it is returned as a plain ``str``. The
    length is the most every layout can store: the TypeScript MySQL store's
    ``varchar(512)`` row key holds ``permit:{slot}:{key}``.
    """
    if type(key) is str and key and key.isascii() and len(key) <= MAX_KEY_LENGTH:
        return key  # the common case, on every operation
    text = str.__str__(check_str("key", key))  # the value, whatever the subclass's __str__
    if len(text) > MAX_KEY_LENGTH:
        raise InvalidArgumentError(
            f"key must be at most {MAX_KEY_LENGTH} characters, not {len(text)} "
            f"(it starts {text[:20]!r})"
        )
    return text


def check_token(token: object) -> str:
    """Return an ownership token: a non-empty ``str``."""
    return check_str("token", token)


def refuse_nul(what: str, text: str, server: str) -> None:
    """Refuse ``text`` (a key or token, ``what``) with a NUL character: ``server`` cannot hold it.

    PostgreSQL's ``text`` holds no NUL (psycopg and asyncpg fail at the send,
    after the table was made); the stores whose servers cannot hold one call
    this before any request (``dmutex._core.abc.TextRule``).
    """
    if "\0" in text:
        raise InvalidArgumentError(
            f"{what} {shown(text)} contains a NUL character (U+0000), which {server} text "
            "cannot hold"
        )


def _real(name: str, value: object) -> float:
    # bool is an int subclass; True seconds is always a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be an int or float, not {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an int or Fraction beyond the largest float
        raise InvalidArgumentError(f"{name} must be finite, not {shown(value)}") from None
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
    """Return a permit count: an ``int`` from 1 to :data:`MAX_PERMITS`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"max_permits must be an int, not {type(value).__name__}")
    permits = int(value)
    if permits < 1:
        raise InvalidArgumentError(f"max_permits must be >= 1, not {shown(permits)}")
    if permits > MAX_PERMITS:
        raise InvalidArgumentError(f"max_permits must be <= {MAX_PERMITS}, not {shown(permits)}")
    return permits


def check_max_readers(value: object) -> int:
    """Return a bound on a read-write lock's readers: an ``int`` from 1 to :data:`MAX_PERMITS`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"max_readers must be an int or None, not {type(value).__name__}")
    readers = int(value)
    if not 1 <= readers <= MAX_PERMITS:
        raise InvalidArgumentError(
            f"max_readers must be from 1 to {MAX_PERMITS}, or None, not {shown(readers)}"
        )
    return readers


MAX_REPLICAS = 64
"""The largest ``replicas`` a lock may wait for: more than any Redis deployment runs."""


def check_replicas(value: object) -> int:
    """Return a replica count to wait for: an ``int`` from 0 to :data:`MAX_REPLICAS`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"replicas must be an int, not {type(value).__name__}")
    count = int(value)
    if not 0 <= count <= MAX_REPLICAS:
        raise InvalidArgumentError(f"replicas must be from 0 to {MAX_REPLICAS}, not {shown(count)}")
    return count


def check_replicas_timeout(value: object) -> int:
    """Return the replicas' acknowledgement wait in whole ms: a finite number of seconds > 0.

    Rounded up, never to 0: Redis's ``WAIT`` with a timeout of 0 waits forever.
    At most a day, which no lease that waits for it could want.
    """
    seconds = check_ttl("replicas_timeout", value)
    if seconds > 86_400:
        raise InvalidArgumentError(f"replicas_timeout must be at most 86400 seconds, not {seconds}")
    return max(1, math.ceil(seconds * 1000))


def check_backend(value: object) -> BackendName | None:
    """Return ``None`` or a backend's name: ``"dynamodb"``, ``"etcd"``, ``"mongodb"``, ...."""
    if value is None:
        return None
    for name in _BACKENDS:
        if isinstance(value, str) and value == name:
            return name
    raise InvalidArgumentError(
        "backend must be 'dynamodb', 'etcd', 'mongodb', 'mysql', 'postgresql', 'redis' or None, "
        f"not {value!r}"
    )


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


def check_flag(name: str, value: object) -> bool:
    """Return ``value`` if it is a ``bool``: a flag given as 0, 1 or a string is refused."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be a bool, not {type(value).__name__}")
    return value


def check_callback(value: object) -> None:
    """Raise unless ``value`` is callable."""
    if not callable(value):
        raise ArgumentTypeError(f"callback must be callable, not {type(value).__name__}")

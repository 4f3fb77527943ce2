"""dmutex: distributed mutexes, semaphores and read-write locks over your database.

Token-protected leases with a TTL. Inject the client your application already
uses; dmutex imports none of them. ``SQLiteBackend`` serves the processes of
one host from a file; ``InMemoryBackend`` stands in for a server in tests.
"""

from __future__ import annotations

import logging as _logging
from types import FunctionType as _FunctionType

from . import events
from ._backends import clients as _clients
from ._backends.clients import *  # noqa: F403 - the client contracts and the unions, as clients.__all__ lists them
from ._backends.memory import InMemoryBackend
from ._backends.sqlite import SQLiteBackend
from ._clock import Clock, ManualClock, SystemClock
from ._core.observe import Observer
from ._errors import (
    AmbiguousClientError,
    ArgumentTypeError,
    DMutexError,
    InvalidArgumentError,
    LeaseLostError,
    LockBusyError,
    NotReplicatedError,
    UnsupportedClientError,
)
from ._faces.aio import (
    AsyncDMutex,
    AsyncDMutexLock,
    AsyncDReadLock,
    AsyncDReadWriteLock,
    AsyncDSemaphore,
    AsyncDSemaphorePermit,
    AsyncDWriteLock,
)
from ._faces.elections import AsyncDElection, AsyncLeadership, DElection, Leader, Leadership
from ._faces.holders import LockHolder
from ._faces.sync import (
    DMutex,
    DMutexLock,
    DReadLock,
    DReadWriteLock,
    DSemaphore,
    DSemaphorePermit,
    DWriteLock,
)
from ._faces.synchronized import OnBusy, synchronized
from ._observers.otel import OpenTelemetryObserver
from ._validate import MAX_KEY_LENGTH, MAX_PERMITS, BackendName
from ._version import __version__

__all__ = [
    "MAX_KEY_LENGTH",
    "MAX_PERMITS",
    "AmbiguousClientError",
    "ArgumentTypeError",
    "AsyncDElection",
    "AsyncDMutex",
    "AsyncDMutexLock",
    "AsyncDReadLock",
    "AsyncDReadWriteLock",
    "AsyncDSemaphore",
    "AsyncDSemaphorePermit",
    "AsyncDWriteLock",
    "AsyncLeadership",
    "BackendName",
    "Clock",
    "DElection",
    "DMutex",
    "DMutexError",
    "DMutexLock",
    "DReadLock",
    "DReadWriteLock",
    "DSemaphore",
    "DSemaphorePermit",
    "DWriteLock",
    "InMemoryBackend",
    "InvalidArgumentError",
    "Leader",
    "Leadership",
    "LeaseLostError",
    "LockBusyError",
    "LockHolder",
    "ManualClock",
    "NotReplicatedError",
    "Observer",
    "OnBusy",
    "OpenTelemetryObserver",
    "SQLiteBackend",
    "SystemClock",
    "UnsupportedClientError",
    "__version__",
    "events",
    "synchronized",
]
__all__ += _clients.__all__

# The public classes report the package as their module, as httpcore's and
# trio's do: reprs, help(), docs and pickles show ``dmutex.DMutex``, the path
# users import, not the private module that defines it.
for _name in __all__:
    _value = globals()[_name]
    if isinstance(_value, (type, _FunctionType)):
        _value.__module__ = __name__
del _name, _value, _clients, _FunctionType

# A library's loggers print nothing until the application configures logging.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())
del _logging

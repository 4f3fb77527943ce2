"""dmutex: distributed mutexes and semaphores over MongoDB, Redis and SQLite.

Token-protected leases with a TTL. Inject the client your application already
uses; dmutex imports none of them. ``SQLiteBackend`` serves the processes of
one host from a file; ``InMemoryBackend`` stands in for a server in tests.
"""

from __future__ import annotations

from ._backends.clients import (
    AsyncMongoClientLike,
    AsyncMongoCollectionLike,
    AsyncMongoDatabaseLike,
    AsyncRedisCommandClient,
    AsyncRedisSetEvalClient,
    MongoClientLike,
    MongoCollectionLike,
    MongoDatabaseLike,
    MongoDeleteResultLike,
    MongoUpdateResultLike,
    RedisArg,
    RedisCommandClient,
    RedisReply,
    RedisSetEvalClient,
)
from ._backends.memory import InMemoryBackend
from ._backends.sqlite import SQLiteBackend
from ._clock import Clock, ManualClock, SystemClock
from ._errors import (
    AmbiguousClientError,
    ArgumentTypeError,
    DMutexError,
    InvalidArgumentError,
    LeaseLostError,
    UnsupportedClientError,
)
from ._faces.aio import (
    AsyncClient,
    AsyncDMutex,
    AsyncDMutexLock,
    AsyncDSemaphore,
    AsyncDSemaphorePermit,
)
from ._faces.sync import DMutex, DMutexLock, DSemaphore, DSemaphorePermit, SyncClient
from ._validate import MAX_KEY_LENGTH, MAX_PERMITS, BackendName
from ._version import __version__

__all__ = [
    "MAX_KEY_LENGTH",
    "MAX_PERMITS",
    "AmbiguousClientError",
    "ArgumentTypeError",
    "AsyncClient",
    "AsyncDMutex",
    "AsyncDMutexLock",
    "AsyncDSemaphore",
    "AsyncDSemaphorePermit",
    "AsyncMongoClientLike",
    "AsyncMongoCollectionLike",
    "AsyncMongoDatabaseLike",
    "AsyncRedisCommandClient",
    "AsyncRedisSetEvalClient",
    "BackendName",
    "Clock",
    "DMutex",
    "DMutexError",
    "DMutexLock",
    "DSemaphore",
    "DSemaphorePermit",
    "InMemoryBackend",
    "InvalidArgumentError",
    "LeaseLostError",
    "ManualClock",
    "MongoClientLike",
    "MongoCollectionLike",
    "MongoDatabaseLike",
    "MongoDeleteResultLike",
    "MongoUpdateResultLike",
    "RedisArg",
    "RedisCommandClient",
    "RedisReply",
    "RedisSetEvalClient",
    "SQLiteBackend",
    "SyncClient",
    "SystemClock",
    "UnsupportedClientError",
    "__version__",
]

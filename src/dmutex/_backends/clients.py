"""The client contracts, as :class:`typing.Protocol` classes.

dmutex imports no database package. It accepts any object shaped like one of
these, and detects which at run time from the object's type (see
``shapes.py``). The sync contracts return plain values and the asyncio ones
return awaitables, so that a type checker can tell an asyncio client handed
to a sync class wherever the client package's own annotations allow it.

Each backend writes its own contracts (``redis/clients.py``,
``mongodb/clients.py``, ``postgresql/clients.py``, ``mysql/clients.py``,
``etcd/clients.py``, ``dynamodb/clients.py``, and
``sql/clients.py`` for the SQLAlchemy engines both SQL backends accept);
this module gathers them for ``dmutex`` to publish, with the unions of
everything each face accepts. Arguments that dmutex passes are
positional-only here so that clients may name their parameters as they like.
"""

from __future__ import annotations

from typing import TypeAlias

from .dynamodb.clients import AsyncDynamoDBClientLike, DynamoDBClientLike
from .etcd.clients import AsyncEtcdClientLike, EtcdGatewayClientLike
from .memory import InMemoryBackend
from .mongodb.clients import (
    AsyncMongoClientLike,
    AsyncMongoCollectionLike,
    AsyncMongoDatabaseLike,
    MongoClientLike,
    MongoCollectionLike,
    MongoDatabaseLike,
    MongoDeleteResultLike,
    MongoUpdateResultLike,
)
from .mysql.clients import (
    AsyncMySQLConnectionLike,
    AsyncMySQLCursorLike,
    AsyncMySQLPoolLike,
    MySQLConnectionLike,
    MySQLConnectorPoolLike,
    MySQLCursorLike,
)
from .postgresql.clients import (
    AsyncpgLike,
    AsyncPsycopgConnectionLike,
    AsyncPsycopgCursorLike,
    AsyncPsycopgPoolLike,
    PsycopgConnectionInfoLike,
    PsycopgConnectionLike,
    PsycopgConnectionStateLike,
    PsycopgCursorLike,
    PsycopgPoolLike,
)
from .redis.clients import (
    AsyncRedisCommandClient,
    AsyncRedisSetEvalClient,
    RedisArg,
    RedisCommandClient,
    RedisReply,
    RedisSetEvalClient,
)
from .sql.clients import (
    AsyncSQLAlchemyConnectionLike,
    AsyncSQLAlchemyEngineLike,
    SQLAlchemyDialectLike,
    SQLAlchemyEngineLike,
    SQLAlchemyLentConnectionLike,
)
from .sqlite import SQLiteBackend

__all__ = [
    "AsyncClient",
    "AsyncDynamoDBClientLike",
    "AsyncEtcdClientLike",
    "AsyncMongoClientLike",
    "AsyncMongoCollectionLike",
    "AsyncMongoDatabaseLike",
    "AsyncMySQLConnectionLike",
    "AsyncMySQLCursorLike",
    "AsyncMySQLPoolLike",
    "AsyncPsycopgConnectionLike",
    "AsyncPsycopgCursorLike",
    "AsyncPsycopgPoolLike",
    "AsyncRedisCommandClient",
    "AsyncRedisSetEvalClient",
    "AsyncSQLAlchemyConnectionLike",
    "AsyncSQLAlchemyEngineLike",
    "AsyncpgLike",
    "DynamoDBClientLike",
    "EtcdGatewayClientLike",
    "MongoClientLike",
    "MongoCollectionLike",
    "MongoDatabaseLike",
    "MongoDeleteResultLike",
    "MongoUpdateResultLike",
    "MySQLConnectionLike",
    "MySQLConnectorPoolLike",
    "MySQLCursorLike",
    "PsycopgConnectionInfoLike",
    "PsycopgConnectionLike",
    "PsycopgConnectionStateLike",
    "PsycopgCursorLike",
    "PsycopgPoolLike",
    "RedisArg",
    "RedisCommandClient",
    "RedisReply",
    "RedisSetEvalClient",
    "SQLAlchemyDialectLike",
    "SQLAlchemyEngineLike",
    "SQLAlchemyLentConnectionLike",
    "SyncClient",
]

SyncClient: TypeAlias = (
    InMemoryBackend
    | SQLiteBackend
    | MongoClientLike
    | RedisCommandClient
    | RedisSetEvalClient
    | PsycopgConnectionLike
    | PsycopgPoolLike
    | SQLAlchemyEngineLike
    | MySQLConnectionLike
    | MySQLConnectorPoolLike
    | EtcdGatewayClientLike
    | DynamoDBClientLike
)
"""Any client a sync class accepts."""

AsyncClient: TypeAlias = (
    InMemoryBackend
    | SQLiteBackend
    | AsyncMongoClientLike
    | AsyncRedisCommandClient
    | AsyncRedisSetEvalClient
    | AsyncPsycopgConnectionLike
    | AsyncPsycopgPoolLike
    | AsyncpgLike
    | AsyncSQLAlchemyEngineLike
    | AsyncMySQLConnectionLike
    | AsyncMySQLPoolLike
    | AsyncEtcdClientLike
    | AsyncDynamoDBClientLike
)
"""Any client an asyncio class accepts."""

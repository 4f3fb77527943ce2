"""The MongoDB client contracts, as :class:`typing.Protocol` classes.

``dmutex._backends.clients`` gathers them for ``dmutex`` to publish.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from typing import Protocol, TypeAlias

__all__ = [
    "AsyncMongoClientLike",
    "AsyncMongoCollectionLike",
    "AsyncMongoDatabaseLike",
    "MongoClientLike",
    "MongoCollectionLike",
    "MongoDatabaseLike",
    "MongoDeleteResultLike",
    "MongoUpdateResultLike",
]


IndexKeys: TypeAlias = Sequence[tuple[str, int]]


Document: TypeAlias = Mapping[str, object]


class MongoUpdateResultLike(Protocol):
    """What dmutex reads from the result of ``update_one``."""

    @property
    def matched_count(self) -> int:
        """How many documents the filter matched."""
        ...

    @property
    def upserted_id(self) -> object:
        """The ``_id`` of an inserted document, or None."""
        ...


class MongoDeleteResultLike(Protocol):
    """What dmutex reads from the result of ``delete_one``."""

    @property
    def deleted_count(self) -> int:
        """How many documents were deleted."""
        ...


class MongoCollectionLike(Protocol):
    """A sync MongoDB collection (``pymongo.collection.Collection``).

    A duplicate-key error is any exception whose ``code`` attribute is 11000.
    """

    def create_index(self, keys: IndexKeys, /, *, expireAfterSeconds: int) -> object:
        """Create a TTL index (idempotent on the server)."""
        ...

    def update_one(
        self, filter: Document, update: Document, /, *, upsert: bool = ...
    ) -> MongoUpdateResultLike:
        """Update (or with ``upsert``, insert) one document."""
        ...

    def delete_one(self, filter: Document, /) -> MongoDeleteResultLike:
        """Delete one matching document."""
        ...

    def distinct(self, key: str, filter: Document, /) -> list[object]:
        """The distinct values of ``key`` among matching documents."""
        ...


class MongoDatabaseLike(Protocol):
    """A sync MongoDB database (``pymongo.database.Database``)."""

    def get_collection(self, name: str, /) -> MongoCollectionLike:
        """The named collection (no I/O)."""
        ...


class MongoClientLike(Protocol):
    """A sync MongoDB client (``pymongo.MongoClient``, ``mongomock.MongoClient``)."""

    def get_database(self, name: str, /) -> MongoDatabaseLike:
        """The named database (no I/O)."""
        ...


class AsyncMongoCollectionLike(Protocol):
    """An asyncio MongoDB collection (pymongo's ``AsyncCollection``, motor's)."""

    def create_index(
        self,
        keys: IndexKeys,
        /,
        *,
        expireAfterSeconds: int,
    ) -> Awaitable[object]:
        """Create a TTL index (idempotent on the server)."""
        ...

    def update_one(
        self, filter: Document, update: Document, /, *, upsert: bool = ...
    ) -> Awaitable[MongoUpdateResultLike]:
        """Update (or with ``upsert``, insert) one document."""
        ...

    def delete_one(self, filter: Document, /) -> Awaitable[MongoDeleteResultLike]:
        """Delete one matching document."""
        ...

    def distinct(self, key: str, filter: Document, /) -> Awaitable[list[object]]:
        """The distinct values of ``key`` among matching documents."""
        ...


class AsyncMongoDatabaseLike(Protocol):
    """An asyncio MongoDB database (pymongo's ``AsyncDatabase``, motor's)."""

    def get_collection(self, name: str, /) -> AsyncMongoCollectionLike:
        """The named collection (no I/O)."""
        ...


class AsyncMongoClientLike(Protocol):
    """An asyncio MongoDB client (``pymongo.AsyncMongoClient``, motor's)."""

    def get_database(self, name: str, /) -> AsyncMongoDatabaseLike:
        """The named database (no I/O)."""
        ...

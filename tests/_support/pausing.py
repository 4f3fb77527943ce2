"""What the paused-holder tests share: the child, its client, the leases' TTLs, the stale calls.

A holder (a child of :func:`tests._support.processes.spawned`) acquires with
:data:`TTL`, is stopped by SIGSTOP past it, its key is taken over with
:data:`NEW_TTL`, and on SIGCONT it makes the :data:`CALLS` on its stale lease,
its extends asking for :data:`STALE_TTL`: longer than the new holder's, so
that a wrong extend would show as a later expiry (:func:`stale_calls` makes them).

The child is :func:`paused_holder`, given the test's holder function (module
level, so that the spawned child imports it by name): it runs it and sends its
results, or its traceback. The holder is written once for both faces: it
drives a :class:`~tests._support.faces.Face` over the client and loop that
:func:`holder_client` gives it (an asyncio face runs its calls on a
:class:`~tests._support.faces.LoopThread`, so its renewals go on while the
holder's own thread waits). Its clients: redis-py, pymongo, and for PostgreSQL a
psycopg connection (sync) or an asyncpg connection (asyncio).
"""

from __future__ import annotations

import contextlib
import multiprocessing.synchronize
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import asyncpg
import psycopg
import pymongo
import redis
import redis.asyncio

from dmutex import AsyncDSemaphorePermit, DSemaphorePermit
from tests._support import processes
from tests._support.faces import Face, Handle, LoopThread, RawHandle

SELECTION_TIMEOUT_MS = 10_000  # the holder's MongoDB client fails within seconds

TTL = 0.5  # the paused holder's lease
NEW_TTL = 20.0  # the new holder's
STALE_TTL = 60.0  # what the paused holder's extend asks for: longer than NEW_TTL
FILL_TTL = 30.0  # a semaphore's other permit, held by the test throughout
CALLS = ("extend by handle", "extend by token", "release by handle", "release by token")


def slot_of(lease: RawHandle) -> int:
    """A permit's slot; a mutex's lock is in slot 0."""
    return lease.slot if isinstance(lease, (DSemaphorePermit, AsyncDSemaphorePermit)) else 0


def stale_calls(face: Face, key: str, lease: Handle) -> dict[str, bool]:
    """The :data:`CALLS` on ``lease`` of ``key``, in that order: what each returned."""
    return {
        "extend by handle": lease.extend(STALE_TTL),
        "extend by token": face.extend(key, lease.token, STALE_TTL),
        "release by handle": lease.release(),
        "release by token": face.release_token(key, lease.token),
    }


@dataclass(frozen=True)
class Record:
    """A slot's record as the server holds it: the token, and its expiry."""

    token: str | None
    expiry: (
        int | float | datetime | None
    )  # Redis: PTTL in ms; MongoDB: expiredAt; PostgreSQL: expired_at


class HolderCase(Protocol):
    """What the child needs of a test's case: the backend it holds on, and the face."""

    @property
    def backend(self) -> str: ...

    @property
    def face(self) -> str: ...


def paused_holder(
    holder: Callable[..., object],
    case: HolderCase,
    url: str,
    db_name: str | None,
    service: str,
    reports: processes.ChildReports,
    go: multiprocessing.synchronize.Event,
) -> None:
    """The paused-holder child: ``holder(case, url, db_name, service, reports, go)``, sent back."""
    processes.send_results(reports, lambda: holder(case, url, db_name, service, reports, go))


def spawned_holder(
    holder: Callable[..., object], case: HolderCase, *args: object
) -> contextlib.AbstractContextManager[processes.Child]:
    """:func:`paused_holder` started in a spawned child (:func:`processes.spawned`).

    ``args`` are the url, the database name and the service, as the holder takes them.
    """
    return processes.spawned(paused_holder, holder, case, *args)


@contextlib.contextmanager
def holder_client(
    case: HolderCase, url: str, **redis_options: Any
) -> Iterator[tuple[Any, LoopThread | None]]:
    """A new client of ``case.backend`` for ``case.face``, and the loop it runs on (sync: None).

    An asyncio client is made and closed on its loop. ``redis_options`` go to a
    Redis client only.
    """
    if case.face == "sync":
        client = _client(case, url, False, redis_options)
        try:
            yield client, None
        finally:
            client.close()
        return
    loop = LoopThread()

    async def made() -> Any:
        client = _client(case, url, True, redis_options)
        return (await client) if case.backend == "postgresql" else client  # asyncpg.connect

    try:
        client = loop.run(made())
        try:
            yield client, loop
        finally:
            loop.run(_close_async(case, client))
    finally:
        loop.close()


def _client(case: HolderCase, url: str, asynchronous: bool, redis_options: dict[str, Any]) -> Any:
    if case.backend == "redis":
        redis_class = redis.asyncio.Redis if asynchronous else redis.Redis
        return redis_class.from_url(url, **redis_options)
    if case.backend == "postgresql":
        return asyncpg.connect(url) if asynchronous else psycopg.connect(url, autocommit=True)
    mongo_class = pymongo.AsyncMongoClient if asynchronous else pymongo.MongoClient
    return mongo_class(url, serverSelectionTimeoutMS=SELECTION_TIMEOUT_MS)


async def _close_async(case: HolderCase, client: Any) -> None:
    # redis-py's asyncio client closes by aclose(), pymongo's and asyncpg's by close().
    if case.backend == "redis":
        await client.aclose()
    else:
        await client.close()

"""Which backend a client belongs to, and the store that serves it.

Detection is structural and static: it looks attributes up on the client's
type with :func:`inspect.getattr_static`, so a client whose ``__getattr__``
answers any name (pymongo's ``MongoClient`` returns a database for any
attribute) is judged by what it really defines.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Literal

from ._clock import Clock, SystemClock
from ._core import Engine, ttl_to_ms
from ._errors import AmbiguousClientError, UnsupportedClientError
from ._memory import InMemoryBackend
from ._mongo import MongoStore
from ._redis import RedisStore
from ._store import Namespace, Store
from ._validate import (
    BackendName,
    check_backend,
    check_collection_name,
    check_db_name,
    check_max_permits,
    check_str,
    check_ttl,
)

Kind = Literal["memory", "mongodb", "redis"]

_KEY_PREFIX = {"mutex": "_dmutex_", "semaphore": "_dsemaphore_"}

_NEEDS = {
    "mongodb": "get_database(name)",
    "redis": (
        "execute_command(*args), or both set(name, value, px=..., nx=...) "
        "and eval(script, numkeys, *keys_and_args)"
    ),
}


def _defines(client: object, name: str) -> bool:
    try:
        return inspect.getattr_static(client, name) is not None
    except AttributeError:
        return False


def _shapes(client: object) -> set[BackendName]:
    shapes: set[BackendName] = set()
    if _defines(client, "get_database"):
        shapes.add("mongodb")
    if _defines(client, "execute_command") or (
        _defines(client, "set") and _defines(client, "eval")
    ):
        shapes.add("redis")
    return shapes


def detect(client: object, backend: BackendName | None) -> Kind:
    """Name the backend for ``client``; raise if there is none or it is ambiguous.

    An :class:`InMemoryBackend` is accepted whatever ``backend`` says, so that
    code which passes ``backend=`` from its configuration can be tested with one.
    """
    if isinstance(client, InMemoryBackend):
        return "memory"
    shapes = _shapes(client)
    described = f"{type(client).__module__}.{type(client).__qualname__}"
    if backend is not None:
        if backend not in shapes:
            raise UnsupportedClientError(
                f"backend={backend!r}, but {described} does not offer {_NEEDS[backend]}"
            )
        return backend
    if len(shapes) > 1:
        raise AmbiguousClientError(
            f"{described} matches both the MongoDB and the Redis contract; "
            "pass backend='mongodb' or backend='redis'"
        )
    if shapes:
        return shapes.pop()
    raise UnsupportedClientError(
        f"{described} is not a client dmutex can use. A MongoDB client needs "
        f"{_NEEDS['mongodb']}; a Redis client needs {_NEEDS['redis']}; "
        "or pass a dmutex.InMemoryBackend"
    )


def _check_face(client: object, kind: Kind, asynchronous: bool) -> None:
    """Refuse an asyncio Redis client on a sync class, before any call.

    Only that direction can be told from the client alone: an async client's
    methods are coroutine functions, but a sync-looking method may still
    return an awaitable (motor does), so the other direction is caught by the
    async driver on the first call.
    """
    if kind != "redis" or asynchronous:
        return
    name = "execute_command" if _defines(client, "execute_command") else "set"
    if inspect.iscoroutinefunction(getattr(client, name)):
        raise UnsupportedClientError(
            f"{type(client).__qualname__}.{name} is a coroutine function: this "
            "is an asyncio client, use AsyncDMutex / AsyncDSemaphore"
        )


# The clock MongoDB leases are timed by (Redis times them on the server). Tests
# swap in a ManualClock here to move time under mongomock.
_mongo_clock: Callable[[], Clock] = SystemClock


def _open_store(client: object, kind: Kind, namespace: Namespace) -> Store:
    if isinstance(client, InMemoryBackend):
        return client._bind(namespace)
    if kind == "redis":
        return RedisStore(client, namespace)
    return MongoStore(client, namespace, _mongo_clock())


def build_engine(
    *,
    service_name: object,
    client: object,
    kind: Literal["mutex", "semaphore"],
    max_permits: object,
    default_ttl_seconds: object,
    backend: object,
    db_name: object,
    collection_name: object,
    collection_prefix: object,
    key_prefix: object,
    asynchronous: bool,
) -> Engine:
    """Validate a constructor's arguments, detect the backend, and build the engine.

    Every check runs before the client is touched.
    """
    service = check_str("service_name", service_name)
    permits = check_max_permits(max_permits)
    default_ttl = check_ttl("default_ttl_seconds", default_ttl_seconds)
    # Servers expire leases on their own clock; dmutex computes expired_at
    # with the system clock, or the InMemoryBackend's own.
    clock = client.clock if isinstance(client, InMemoryBackend) else SystemClock()
    ttl_to_ms(default_ttl, clock)
    chosen = check_backend(backend)
    # MongoDB names are only checked for value once the client is a MongoDB one.
    database = check_str("db_name", db_name, allow_empty=True)
    prefix = check_str("collection_prefix", collection_prefix, allow_empty=True)
    if collection_name is None:
        collection = prefix + service
        origin = f"collection_prefix {prefix!r} + service_name {service!r}"
    else:
        collection = check_str("collection_name", collection_name, allow_empty=True)
        origin = "collection_name"
    if key_prefix is None:
        keys = f"{_KEY_PREFIX[kind]}{service}:"
    else:
        keys = check_str("key_prefix", key_prefix, allow_empty=True)
    found = detect(client, chosen)
    if found == "mongodb":
        check_db_name(database)
        check_collection_name(collection, origin)
    _check_face(client, found, asynchronous)
    namespace = Namespace(
        service_name=service,
        kind=kind,
        max_permits=permits,
        key_prefix=keys,
        db_name=database,
        collection_name=collection,
        asynchronous=asynchronous,
    )
    store = _open_store(client, found, namespace)
    engine = Engine(store, default_ttl=default_ttl)
    engine.ttl_ms(None)  # a default TTL past what the store holds fails here
    return engine

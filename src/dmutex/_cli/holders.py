"""Reading what a lock's storage holds, without changing it: ``dmutex status``.

It sits with the command (``dmutex._cli``), its only user, since it drives a
store's effects (``dmutex._runtime.drivers``), which a backend does not.

Rules of this module:

1. Sync clients only. The store is prepared first (SQLite and PostgreSQL:
   its table created if missing, MongoDB: its index), as before any
   operation.
2. A read-write lock's holders are the writer (``role`` "write") or each
   reader ("read"): the store answers them as slots, ``WRITE_SLOT`` and
   ``READ_SLOT``, and :func:`role_of` names them.
"""

from __future__ import annotations

from typing import Literal

from .._backends import open_readwrite_store, open_store
from .._core.abc import Holder, Inspection
from .._core.readwrite import WRITE_SLOT
from .._errors import InvalidArgumentError
from .._options import DEFAULT_PREFIX, Kind, Options
from .._runtime.drivers import SyncDriver
from .._validate import check_key

__all__ = ["Holder", "Inspection", "Role", "read_holders", "role_of"]

Role = Literal["read", "write"]
"""A hold of a read-write lock: a reader's or the writer's."""


def role_of(holder: Holder) -> Role:
    """Which hold of a read-write lock ``holder`` is (rule 2)."""
    return "write" if holder.slot == WRITE_SLOT else "read"


def _options(
    kind: Kind, service: str, limit: int, db_name: str, schema_name: str | None, backend: str | None
) -> Options:
    """The options of ``service``'s lock of ``kind`` under the default names."""
    prefix = DEFAULT_PREFIX[kind]
    return Options.check(
        kind,
        service_name=service,
        max_permits=limit,
        default_ttl_seconds=300,
        db_name=db_name,
        collection_prefix=prefix,
        table_prefix=prefix,
        schema_name=schema_name,
        backend=backend,
    )


def read_holders(
    client: object,
    *,
    service: str,
    limit: int,
    key: str,
    db_name: str = "dmutex",
    schema_name: str | None = None,
    readwrite: bool = False,
) -> Inspection:
    """The active permits of ``key`` for ``service``'s lock of ``limit`` permits, and its fence.

    ``limit`` 1 reads a :class:`~dmutex.DMutex`'s records, more a
    :class:`~dmutex.DSemaphore`'s, under the default names for ``service``
    (PostgreSQL: in ``schema_name``, None for the search path's).
    ``readwrite``: a :class:`~dmutex.DReadWriteLock`'s (``limit`` must be
    1), its holders by slot as rule 2 says. Raises what the client raises;
    bad arguments raise before any request, and so does a backend that
    serves no read-write lock (:class:`~dmutex.UnsupportedClientError`).
    """
    key = check_key(key)
    if not readwrite:
        kind: Kind = "mutex" if limit == 1 else "semaphore"
        store = open_store(
            client, _options(kind, service, limit, db_name, schema_name, None), asynchronous=False
        )
        return SyncDriver(store.clock, store.ready)(store.holders(key))
    if limit != 1:
        raise InvalidArgumentError(f"a read-write lock has no limit of {limit} permits")
    options = _options("readwrite", service, 1, db_name, schema_name, None)
    rw = open_readwrite_store(client, options, asynchronous=False)
    return SyncDriver(rw.clock, rw.ready)(rw.holders(key))

"""Reading what a lock's storage holds, without changing it: ``dmutex status``.

It sits with the command (``dmutex._cli``), its only user, since it drives a
store's effects (``dmutex._runtime.drivers``), which a backend does not.

Sync clients only. The store is prepared first (SQLite and PostgreSQL: its
table created if missing, MongoDB: its index), as before any operation.
"""

from __future__ import annotations

from .._backends import open_store
from .._core.abc import Holder, Inspection
from .._options import DEFAULT_PREFIX, Kind, Options
from .._runtime.drivers import SyncDriver
from .._validate import check_key

__all__ = ["Holder", "Inspection", "read_holders"]


def read_holders(
    client: object,
    *,
    service: str,
    limit: int,
    key: str,
    db_name: str = "dmutex",
    schema_name: str | None = None,
) -> Inspection:
    """The active permits of ``key`` for ``service``'s lock of ``limit`` permits, and its fence.

    ``limit`` 1 reads a :class:`~dmutex.DMutex`'s records, more a
    :class:`~dmutex.DSemaphore`'s, under the default names for ``service``
    (PostgreSQL: in ``schema_name``, None for the search path's).
    Raises what the client raises; bad arguments raise before any request.
    """
    key = check_key(key)
    kind: Kind = "mutex" if limit == 1 else "semaphore"
    prefix = DEFAULT_PREFIX[kind]
    options = Options.check(
        kind,
        service_name=service,
        max_permits=limit,
        default_ttl_seconds=300,
        db_name=db_name,
        collection_prefix=prefix,
        table_prefix=prefix,
        schema_name=schema_name,
    )
    store = open_store(client, options, asynchronous=False)
    drive = SyncDriver(store.clock, store.ready)
    return drive(store.holders(key))

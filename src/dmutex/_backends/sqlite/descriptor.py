"""The SQLite backend as the registry sees it: its :class:`Descriptor`."""

from __future__ import annotations

from ..._clock import Clock
from ..._options import Options
from ..abc import Descriptor
from .backend import SQLiteBackend
from .readwrite import SQLiteReadWriteStore
from .statements import quote
from .store import SQLiteStore
from .url import FORM


def _backend(client: object, options: Options) -> SQLiteBackend:
    """The client; the table name refused here if SQLite cannot hold it, before any request."""
    assert isinstance(client, SQLiteBackend)  # recognised by its type
    quote(options.table_name)
    return client


def open_store(
    client: object, options: Options, clock: Clock, *, asynchronous: bool
) -> SQLiteStore:
    """The table of ``options``' mutexes or semaphores."""
    backend, fencing = _backend(client, options), options.fencing is not False
    table, permits = options.table_name, options.max_permits
    return SQLiteStore(backend, table, permits, clock, asynchronous=asynchronous, fencing=fencing)


def open_readwrite_store(
    client: object, options: Options, clock: Clock, *, asynchronous: bool
) -> SQLiteReadWriteStore:
    """The table of ``options``' read-write locks."""
    backend, fencing = _backend(client, options), options.fencing is not False
    table, readers = options.table_name, options.max_readers
    return SQLiteReadWriteStore(
        backend, table, readers, clock, asynchronous=asynchronous, fencing=fencing
    )


BACKEND = Descriptor(
    name="sqlite",
    label="SQLiteBackend",
    recognises=lambda client: isinstance(client, SQLiteBackend),
    open_store=open_store,
    open_readwrite_store=open_readwrite_store,
    instance=SQLiteBackend,
    url=FORM,
)
"""An :class:`SQLiteBackend`: taken whatever ``backend=`` says; ``replicas=`` waits for none."""

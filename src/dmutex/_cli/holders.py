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
3. A namespace is read as its store lists it (``dmutex._core.abc.Listing``):
   the store's held keys, at most ``max_keys`` + 1 of them, sorted, then
   the holders of the first ``max_keys``, one read per key, in that order.
   A ``max_keys`` + 1st key says that more exist
   (:attr:`Namespace.truncated`) and is not read. A key found free when read
   (its lease ended in between, or only a waiting writer's intent was
   left) is left out. A :class:`Reader` opens the store once, so that
   ``--watch`` reads again through the same client and driver.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from .._backends import open_readwrite_store, open_store
from .._core.abc import Holder, Inspection, Listing, Store, text_rule
from .._core.effects import Steps
from .._core.lease import now_ms
from .._core.readwrite import WRITE_SLOT, ReadWriteStore
from .._errors import InvalidArgumentError, UnsupportedClientError
from .._options import DEFAULT_PREFIX, Kind, Options
from .._runtime.drivers import SyncDriver
from .._validate import check_key

__all__ = [
    "Holder",
    "Inspection",
    "Namespace",
    "Reader",
    "Role",
    "read_holders",
    "role_of",
]

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


@dataclass(frozen=True)
class Namespace:
    """What a service's namespace holds (rule 3): each held key's holders, in key order."""

    found: list[tuple[str, Inspection]]
    """The held keys, at most ``max_keys``, each with what its read found."""
    truncated: bool
    """The store listed more than ``max_keys`` keys: more than ``found`` may be held."""
    now_ms: int
    """When the reads ended, by the store's clock (epoch ms)."""


class Reader:
    """One service's store of one kind, opened once and prepared before its first read.

    ``limit`` 1 reads a :class:`~dmutex.DMutex`'s records, more a
    :class:`~dmutex.DSemaphore`'s, under the default names for ``service``
    (PostgreSQL: in ``schema_name``, None for the search path's).
    ``readwrite``: a :class:`~dmutex.DReadWriteLock`'s (``limit`` must be
    1), its holders by slot as rule 2 says. Bad arguments raise here,
    before any request, and so does a backend that serves no read-write
    lock (:class:`~dmutex.UnsupportedClientError`).
    """

    def __init__(
        self,
        client: object,
        *,
        service: str,
        limit: int,
        db_name: str = "dmutex",
        schema_name: str | None = None,
        readwrite: bool = False,
    ) -> None:
        store: Store | ReadWriteStore
        if not readwrite:
            kind: Kind = "mutex" if limit == 1 else "semaphore"
            options = _options(kind, service, limit, db_name, schema_name, None)
            store = open_store(client, options, asynchronous=False)
        else:
            if limit != 1:
                raise InvalidArgumentError(f"a read-write lock has no limit of {limit} permits")
            options = _options("readwrite", service, 1, db_name, schema_name, None)
            store = open_readwrite_store(client, options, asynchronous=False)
        self._clock = store.clock
        self._refuse = text_rule(store)
        self._drive = SyncDriver(store.clock, store.ready)
        self._holders: Callable[[str], Steps[Inspection]] = store.holders
        self._keys: Callable[[int], Steps[list[str]]] | None = (
            store.keys if isinstance(store, Listing) else None
        )

    def holders(self, key: str) -> Inspection:
        """The active permits of ``key`` and its fence; raises what the client raises.

        A key the library refuses, or this store's server cannot hold (a NUL
        on PostgreSQL), raises :class:`~dmutex.InvalidArgumentError` first.
        """
        key = check_key(key)
        if self._refuse is not None:
            self._refuse("key", key)
        return self._drive(self._holders(key))

    def namespace(self, max_keys: int) -> Namespace:
        """The first ``max_keys`` held keys with their holders (rule 3).

        Raises :class:`~dmutex.UnsupportedClientError` for a store or client
        that cannot list its keys (a Redis Cluster client), before any
        request; otherwise what the client raises.
        """
        if self._keys is None:
            raise UnsupportedClientError("this backend's store cannot list its keys")
        listed = self._drive(self._keys(max_keys + 1))
        found: list[tuple[str, Inspection]] = []
        for key in listed[:max_keys]:
            seen = self._drive(self._holders(key))
            if seen.holders:
                found.append((key, seen))
        return Namespace(found, len(listed) > max_keys, now_ms(self._clock))


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

    As :class:`Reader` (``limit``, ``readwrite``, the names) reads them.
    Raises what the client raises; bad arguments raise before any request,
    and so does a backend that serves no read-write lock
    (:class:`~dmutex.UnsupportedClientError`).
    """
    key = check_key(key)
    reader = Reader(
        client,
        service=service,
        limit=limit,
        db_name=db_name,
        schema_name=schema_name,
        readwrite=readwrite,
    )
    return reader.holders(key)

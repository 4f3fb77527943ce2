"""The constructors, shared by the sync and the asyncio classes.

``DMutex`` and ``AsyncDMutex`` take the same arguments, as do ``DSemaphore``
and ``AsyncDSemaphore``; only the client type differs, which is the type
parameter here.
"""

from __future__ import annotations

from typing import ClassVar, Generic, TypeVar

from ._backends import build_engine
from ._core import Engine
from ._validate import BackendName

ClientT = TypeVar("ClientT")


class _Configured(Generic[ClientT]):
    _ASYNC: ClassVar[bool]
    _engine: Engine


class SemaphoreConfig(_Configured[ClientT]):
    """Construction of a semaphore (sync or async)."""

    def __init__(
        self,
        service_name: str,
        client: ClientT,
        *,
        max_permits: int,
        default_ttl_seconds: float = 300,
        backend: BackendName | None = None,
        db_name: str = "dmutex",
        collection_name: str | None = None,
        collection_prefix: str = "_dsemaphore_",
        key_prefix: str | None = None,
    ) -> None:
        """Make a semaphore of ``max_permits`` permits per key for ``service_name``.

        ``client`` is a MongoDB or Redis client (detected from its shape; force
        with ``backend=``) or an :class:`InMemoryBackend`. ``default_ttl_seconds``
        is the lease length when a call gives no ``ttl``. MongoDB uses database
        ``db_name`` and collection ``collection_name`` or
        ``collection_prefix + service_name``; Redis uses keys under
        ``key_prefix`` (default ``f"_dsemaphore_{service_name}:"``). Options of
        the other backend are ignored.

        Raises ``TypeError``/``ValueError`` for bad arguments and for a client
        that meets no contract, before touching the client.
        """
        self._engine = build_engine(
            service_name=service_name,
            client=client,
            kind="semaphore",
            max_permits=max_permits,
            default_ttl_seconds=default_ttl_seconds,
            backend=backend,
            db_name=db_name,
            collection_name=collection_name,
            collection_prefix=collection_prefix,
            key_prefix=key_prefix,
            asynchronous=self._ASYNC,
        )


class MutexConfig(_Configured[ClientT]):
    """Construction of a mutex (sync or async): a one-permit semaphore."""

    def __init__(
        self,
        service_name: str,
        client: ClientT,
        *,
        default_ttl_seconds: float = 300,
        backend: BackendName | None = None,
        db_name: str = "dmutex",
        collection_name: str | None = None,
        collection_prefix: str = "_dmutex_",
        key_prefix: str | None = None,
    ) -> None:
        """Make a mutex for ``service_name``: one holder per key at a time.

        The options mean what they mean for a semaphore; the defaults name
        ``_dmutex_`` instead of ``_dsemaphore_``.
        """
        self._engine = build_engine(
            service_name=service_name,
            client=client,
            kind="mutex",
            max_permits=1,
            default_ttl_seconds=default_ttl_seconds,
            backend=backend,
            db_name=db_name,
            collection_name=collection_name,
            collection_prefix=collection_prefix,
            key_prefix=key_prefix,
            asynchronous=self._ASYNC,
        )

"""The constructors both faces share, and what they build.

``DMutex`` and ``AsyncDMutex`` take the same arguments, as do ``DSemaphore``
and ``AsyncDSemaphore``, and ``DReadWriteLock`` and ``AsyncDReadWriteLock``;
only the client type differs, which is the type parameter here. Each
constructor checks its arguments into one :class:`~dmutex._options.Options`,
opens the store for the client, and makes the engine (a read-write lock: one
per side) and the face's driver.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Generic, TypeAlias, TypeVar

from .._backends import lookup, open_readwrite_store, open_store
from .._clock import Clock
from .._core import renewal
from .._core.engine import Engine
from .._core.lease import Lease
from .._core.observe import Kind as EventKind
from .._core.observe import Observer, Observers, Source, check_observers
from .._core.readwrite import side
from .._observers import defaults
from .._options import Kind, Options
from .._validate import BackendName, check_flag
from .handles import HandleBase

ClientT = TypeVar("ClientT")
H = TypeVar("H", bound=HandleBase[Any])


class Face(Generic[ClientT]):
    """An instance's engine and driver, made from checked options and a client."""

    _ASYNC: ClassVar[bool]
    _engine: Engine

    def _open(self, client: object, checked: Checked) -> None:
        options, observers = checked
        backend = lookup(client, options)
        store = open_store(client, options, asynchronous=self._ASYNC, backend=backend)
        kind: EventKind = "mutex" if options.kind == "mutex" else "semaphore"
        observe, source = _observing(backend.name, options, observers, kind)
        self._engine = Engine(
            store,
            default_ttl=options.default_ttl,
            shield=self._ASYNC,
            observe=observe,
            source=source,
            identity=options.identity,
        )
        self._start_driver(self._engine)

    def _start_driver(self, engine: Engine) -> None:
        raise NotImplementedError


class Wrapping(Generic[H]):
    """How a face turns a lease into its handle, renewed or not."""

    def _wrap(self, lease: Lease) -> H:
        raise NotImplementedError

    def _wrap_renewed(self, lease: Lease) -> H:
        lease.renewing = True
        handle = self._wrap(lease)
        handle._schedule(renewal.interval(lease.ttl_ms))
        handle._watch()
        return handle

    def _wrapper(self, auto_renew: bool) -> Callable[[Lease], H]:
        """The wrap for ``auto_renew``, checked before any request."""
        if auto_renew is False:
            return self._wrap  # the common case, on every acquire
        return self._wrap_renewed if check_flag("auto_renew", auto_renew) else self._wrap


def _observing(
    backend: str, options: Options, observers: tuple[Observer, ...], kind: EventKind
) -> tuple[Observers | None, Source | None]:
    """The instance's observers (its own, then the defaults) and its events' source."""
    source = Source(options.service_name, kind, backend)
    return Observers(defaults(observers)), source


Checked: TypeAlias = "tuple[Options, tuple[Observer, ...]]"
"""A constructor's arguments, checked: its options and its observers."""


def _check(kind: Kind, arguments: dict[str, object]) -> Checked:
    """A constructor's options, checked: ``arguments`` are its ``locals()``, on entry.

    Every parameter but ``self``, ``client`` and ``observers`` is an option,
    under the name that :meth:`Options.check` takes, so the options are
    written once, in the signature; an option it does not know is a
    ``TypeError`` at the first construction. ``observers``, the last
    parameter, is checked last.
    """
    named = {
        name: value
        for name, value in arguments.items()
        if name not in ("self", "client", "observers")
    }
    options = Options.check(kind, **named)
    return options, check_observers(arguments.get("observers", ()))


class SemaphoreBase(Face[ClientT]):
    """Construction of a semaphore, sync or async."""

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
        clock: Clock | None = None,
        fencing: bool | None = None,
        table_name: str | None = None,
        table_prefix: str = "_dsemaphore_",
        schema_name: str | None = None,
        database_name: str | None = None,
        replicas: int = 0,
        replicas_timeout: float = 1.0,
        identity: str | None = None,
        observers: Sequence[Observer] = (),
    ) -> None:
        """Make a semaphore of ``max_permits`` permits per key for ``service_name``.

        ``client`` is a MongoDB, Redis, PostgreSQL or MySQL client (detected
        from its shape; force with ``backend=``), an :class:`SQLiteBackend`
        or an :class:`InMemoryBackend`. ``default_ttl_seconds`` is the lease length
        when a call gives no ``ttl``. MongoDB uses database ``db_name`` and
        collection ``collection_name`` or ``collection_prefix + service_name``;
        Redis uses keys under ``key_prefix`` (default
        ``f"_dsemaphore_{service_name}:"``); SQLite, PostgreSQL and MySQL the
        table ``table_name`` or ``table_prefix + service_name``, PostgreSQL in
        schema ``schema_name`` (None: where the connection's search path finds
        or creates it), MySQL in database ``database_name`` (None: the
        connection's current database). Options of the other backends are
        ignored.

        ``clock`` is where this instance reads the time: the expiries it
        writes (MongoDB) or estimates (Redis: ``expired_at``), and its retry
        waits. A :class:`ManualClock` makes them testable without sleeping. An
        :class:`InMemoryBackend` keeps its own clock; pass none here for it.
        PostgreSQL and MySQL decide every expiry by the server's clock;
        there ``clock`` times the retry waits only.

        ``fencing``: whether grants carry a fencing token (``handle.fence``).
        None (the default) keeps one where it costs no extra request: Redis
        (in the acquire's own script; on a cluster only for a key with a
        hash tag), SQLite (in the acquire's transaction), PostgreSQL and
        MySQL (in the acquire's statement) and :class:`InMemoryBackend`. True
        also on MongoDB, where it costs one more request per successful
        acquire, and makes a cluster key without a hash tag an error. False keeps none, and Redis
        then writes no counter records.

        ``replicas`` (Redis only): a grant, an ``extend`` and a renewal count
        only once this many replicas acknowledged the write, within
        ``replicas_timeout`` seconds (Redis's ``WAIT``, sent in the same round
        trip as the write; on a cluster, the replicas of the key's shard). An
        acquire whose grant was not acknowledged in time releases it and raises
        :class:`NotReplicatedError`; an ``extend`` raises it and keeps the old
        expiry; a renewal retries, and the lease is lost at its deadline if
        none is acknowledged. It narrows what a failover can lose; it does not
        make Redis consistent (see the Redis page's "Failover"). 0 (the
        default) waits for none. Another backend with ``replicas`` > 0 is an
        error: MongoDB uses the collection's write concern.

        ``identity``: who this instance's leases say holds them, for whoever
        reads the lock (``holders()``, ``dmutex status``): None (the
        default) for ``host:pid``, ``""`` for nobody (a bare UUID4 token, as
        the TypeScript library writes). It rides in the lease's token,
        percent-encoded and cut to fit 128 characters in all (MySQL's
        column); only the token's random part is secret. See the Storage
        layout page.

        ``observers``: callables that are given an event for each operation,
        attempt, grant, renewal and end of a lease of this instance, as it
        happens (:mod:`dmutex.events`; see the Observing page). They add no
        request; one that raises is logged and skipped.

        Raises ``TypeError``/``ValueError`` for bad arguments and for a client
        that meets no contract, before any request reaches the client.
        """
        self._open(client, _check("semaphore", locals()))


class MutexBase(Face[ClientT]):
    """Construction of a mutex, sync or async: a one-permit semaphore."""

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
        clock: Clock | None = None,
        fencing: bool | None = None,
        table_name: str | None = None,
        table_prefix: str = "_dmutex_",
        schema_name: str | None = None,
        database_name: str | None = None,
        replicas: int = 0,
        replicas_timeout: float = 1.0,
        identity: str | None = None,
        observers: Sequence[Observer] = (),
    ) -> None:
        """Make a mutex for ``service_name``: one holder per key at a time.

        The options mean what they mean for a semaphore; the defaults name
        ``_dmutex_`` instead of ``_dsemaphore_``.
        """
        self._open(client, _check("mutex", {**locals(), "max_permits": 1}))


class ReadWriteFace(Generic[ClientT]):
    """A read-write lock's two engines (its readers' and its writers') and its driver."""

    _ASYNC: ClassVar[bool]
    _reading: Engine
    _writing: Engine

    def _open(self, client: object, checked: Checked) -> None:
        options, observers = checked
        backend = lookup(client, options)
        store = open_readwrite_store(client, options, asynchronous=self._ASYNC, backend=backend)
        ttl, shield = options.default_ttl, self._ASYNC
        observe, reads = _observing(backend.name, options, observers, "read")
        writes = None if reads is None else Source(reads.service, "write", reads.backend)
        me = options.identity
        self._reading = Engine(
            side(store, write=False),
            default_ttl=ttl,
            shield=shield,
            observe=observe,
            source=reads,
            identity=me,
        )
        self._writing = Engine(
            side(store, write=True),
            default_ttl=ttl,
            shield=shield,
            observe=observe,
            source=writes,
            identity=me,
        )
        self._start_driver(self._reading)

    def _start_driver(self, engine: Engine) -> None:
        raise NotImplementedError


class ReadWriteBase(ReadWriteFace[ClientT]):
    """Construction of a read-write lock, sync or async."""

    def __init__(
        self,
        service_name: str,
        client: ClientT,
        *,
        max_readers: int | None = None,
        default_ttl_seconds: float = 300,
        backend: BackendName | None = None,
        db_name: str = "dmutex",
        collection_name: str | None = None,
        collection_prefix: str = "_drwlock_",
        key_prefix: str | None = None,
        clock: Clock | None = None,
        fencing: bool | None = None,
        table_name: str | None = None,
        table_prefix: str = "_drwlock_",
        schema_name: str | None = None,
        database_name: str | None = None,
        replicas: int = 0,
        replicas_timeout: float = 1.0,
        identity: str | None = None,
        observers: Sequence[Observer] = (),
    ) -> None:
        """Make a read-write lock for ``service_name``: many readers or one writer per key.

        ``max_readers`` bounds the readers of a key at once (None: no bound).
        The other options mean what they mean for a semaphore; the defaults
        name ``_drwlock_`` instead of ``_dsemaphore_``.

        Raises ``TypeError``/``ValueError`` for bad arguments and for a client
        that meets no contract, before any request reaches the client.
        """
        self._open(client, _check("readwrite", {**locals(), "max_permits": 1}))

"""The backends: one package each, and the registry that finds a client's.

Each backend package (``memory/``, ``sqlite/``, ``redis/``, ``mongodb/``,
``postgresql/``, ``mysql/``; ``sql/`` holds what the SQL ones share) exports
one :class:`~dmutex._backends.abc.Descriptor`, ``BACKEND``. Its stores
implement the protocols the engine talks to, which live below this package
(``dmutex._core.abc``, ``dmutex._core.readwrite``).

The rules of the registry:

1. :data:`BACKENDS` lists every descriptor; this module is the only one
   above the packages that names them.
2. :func:`lookup` finds a client's backend without calling the client: an
   object of dmutex's (an :class:`InMemoryBackend`, an
   :class:`SQLiteBackend`) by its type, whatever ``backend=`` says, so that
   code which passes ``backend=`` from its configuration can be tested with
   one; any other client by the shapes the backends recognise. A SQLAlchemy
   engine that several SQL backends recognise is its dialect's backend's.
   ``backend=`` picks among the backends that recognise the client; none
   given, more than one is :class:`~dmutex.AmbiguousClientError`, and none
   is :class:`~dmutex.UnsupportedClientError` naming what each backend
   needs.
3. ``replicas=`` on a backend that does not take it is refused with the
   backend's reason, before its store is opened.
4. Opening makes no request (the descriptors' rule 2); a lock looks its
   backend up once (``lookup``), and opens its store from that answer.
"""

from __future__ import annotations

from .._clock import SYSTEM_CLOCK
from .._core.abc import Store
from .._core.readwrite import ReadWriteStore
from .._errors import AmbiguousClientError, InvalidArgumentError, UnsupportedClientError
from .._options import Options
from . import memory, mongodb, mysql, postgresql, redis, sqlite
from .abc import Descriptor
from .memory import InMemoryBackend
from .shapes import described
from .sql.shapes import dialect_of, is_engine
from .sqlite import SQLiteBackend

BACKENDS: tuple[Descriptor, ...] = (
    mongodb.BACKEND,
    redis.BACKEND,
    postgresql.BACKEND,
    mysql.BACKEND,
    sqlite.BACKEND,
    memory.BACKEND,
)
"""Every backend, in the order the error for an unknown client names them."""

_BY_NAME = {backend.name: backend for backend in BACKENDS}


def _recognising(client: object) -> list[Descriptor]:
    """The backends whose shape ``client`` has; an engine: its dialect's, if one claims it."""
    found = [backend for backend in BACKENDS if backend.recognises(client)]
    if len(found) > 1 and is_engine(client):
        dialect = dialect_of(client)
        claimed = [backend for backend in found if dialect in backend.dialects]
        found = claimed or found
    return found


def _unknown(client: object) -> UnsupportedClientError:
    shaped = "; ".join(
        f"a {backend.label} client needs {backend.needs}" for backend in BACKENDS if backend.needs
    )
    objects = " or ".join(f"dmutex.{backend.label}" for backend in BACKENDS if backend.instance)
    return UnsupportedClientError(
        f"{described(client)} is not a client dmutex can use. {shaped[0].upper()}{shaped[1:]}; "
        f"or pass a {objects}"
    )


def lookup(client: object, options: Options) -> Descriptor:
    """The backend of ``client`` (rule 2), ``replicas=`` checked against it (rule 3); no I/O."""
    found = _lookup(client, options.backend)
    if options.replicas and found.replicas is not None:
        raise InvalidArgumentError(
            f"replicas={options.replicas} is the Redis backend's option: {found.replicas}"
        )
    return found


def _lookup(client: object, backend: str | None) -> Descriptor:
    for known in BACKENDS:
        if known.instance is not None and isinstance(client, known.instance):
            return known
    found = _recognising(client)
    if backend is not None:
        chosen = _BY_NAME[backend]
        if chosen not in found:
            raise UnsupportedClientError(
                f"backend={backend!r}, but {described(client)} does not offer {chosen.needs}"
            )
        return chosen
    if len(found) > 1:
        found.sort(key=lambda known: known.name)
        labels = " and the ".join(known.label for known in found)
        choices = " or ".join(f"backend={known.name!r}" for known in found)
        both = "both " if len(found) == 2 else ""
        raise AmbiguousClientError(
            f"{described(client)} matches {both}the {labels} contract; pass {choices}"
        )
    if found:
        return found[0]
    raise _unknown(client)


def detect(client: object, backend: str | None) -> str:
    """The name of ``client``'s backend (rule 2); raise if there is none or it is ambiguous."""
    return _lookup(client, backend).name


def open_store(
    client: object, options: Options, *, asynchronous: bool, backend: Descriptor | None = None
) -> Store:
    """The store that serves ``options``' namespace through ``client``; no request.

    Opens ``backend``'s mutex and semaphore store: the client's, looked up
    here (:func:`lookup`) unless the caller did.
    """
    backend = lookup(client, options) if backend is None else backend
    clock = SYSTEM_CLOCK if options.clock is None else options.clock
    return backend.open_store(client, options, clock, asynchronous=asynchronous)


def open_readwrite_store(
    client: object, options: Options, *, asynchronous: bool, backend: Descriptor | None = None
) -> ReadWriteStore:
    """The store that serves ``options``' namespace of read-write locks; no request.

    As :func:`open_store`, for read-write locks.
    """
    backend = lookup(client, options) if backend is None else backend
    clock = SYSTEM_CLOCK if options.clock is None else options.clock
    return backend.open_readwrite_store(client, options, clock, asynchronous=asynchronous)


__all__ = [
    "BACKENDS",
    "InMemoryBackend",
    "SQLiteBackend",
    "Store",
    "detect",
    "lookup",
    "open_readwrite_store",
    "open_store",
]

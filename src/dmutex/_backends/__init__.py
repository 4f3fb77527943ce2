"""The backends: one package each, and the registry that finds a client's.

Each backend package (``memory/``, ``sqlite/``, ``redis/``, ``mongodb/``,
``postgresql/``, ``mysql/``, ``etcd/``, ``dynamodb/``; ``sql/`` holds what
the SQL ones share) exports
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
5. The ``dmutex`` command finds a URL's backend by its scheme
   (:func:`parse_url`, no I/O), among the backends whose descriptor has a
   :class:`~dmutex._backends.address.URLForm`; with no URL, the one form
   with a default gives the address (:func:`default_address`).
"""

from __future__ import annotations

from collections.abc import Mapping

from .._clock import SYSTEM_CLOCK
from .._core.abc import Store
from .._core.readwrite import ReadWriteStore
from .._errors import AmbiguousClientError, InvalidArgumentError, UnsupportedClientError
from .._options import Options
from . import dynamodb, etcd, memory, mongodb, mysql, postgresql, redis, sqlite
from .abc import Descriptor
from .address import Address, BadURL, Connection, URLForm, redact
from .memory import InMemoryBackend
from .shapes import described
from .sql.shapes import dialect_of, is_engine
from .sqlite import SQLiteBackend

BACKENDS: tuple[Descriptor, ...] = (
    mongodb.BACKEND,
    redis.BACKEND,
    postgresql.BACKEND,
    mysql.BACKEND,
    etcd.BACKEND,
    dynamodb.BACKEND,
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


def _forms() -> list[URLForm]:
    """The URL forms, the one with a default first (as ``--help`` lists them)."""
    forms = [known.url for known in BACKENDS if known.url is not None]
    return sorted(forms, key=lambda form: form.default is None)


URL_FORMS: tuple[URLForm, ...] = tuple(_forms())
"""Every backend's URL form (rule 5), the default's first."""

_BY_SCHEME = {scheme: form for form in URL_FORMS for scheme in form.schemes}


def parse_url(url: str) -> Address:
    """``url`` checked by its backend's form, no I/O (rule 5); raises :class:`BadURL`."""
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    form = _BY_SCHEME.get(scheme)
    if form is None:
        shown = [text for known in URL_FORMS for text in known.shown]
        raise BadURL(
            f"unsupported backend URL {redact(url)!r}: use {', '.join(shown[:-1])} or {shown[-1]}"
        )
    return form.parse(url)


def default_address(env: Mapping[str, str]) -> Address:
    """The command's default backend address in ``env`` (rule 5)."""
    form = URL_FORMS[0]
    assert form.default is not None  # one form has a default: the registry sorts it first
    return form.default(env)


def connect_url(address: Address, timeout: float, *, waits: bool = False) -> Connection:
    """A client for ``address``, by its backend's form: see ``URLForm``."""
    form = _BY_NAME[address.backend].url
    assert form is not None  # parse_url and default_address made the address from it
    return form.connect(address, timeout, waits)


__all__ = [
    "BACKENDS",
    "URL_FORMS",
    "InMemoryBackend",
    "SQLiteBackend",
    "Store",
    "connect_url",
    "default_address",
    "detect",
    "lookup",
    "open_readwrite_store",
    "open_store",
    "parse_url",
]

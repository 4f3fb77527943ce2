"""What a backend tells the rest of dmutex about itself: its :class:`Descriptor`.

Rules:

1. A backend is one package under ``_backends/``, and its ``descriptor.py``
   holds its one :class:`Descriptor`, ``BACKEND``. The registry
   (``_backends/__init__.py``) lists the descriptors; nothing else above
   the packages branches on a backend's name.
2. A descriptor's callables do no I/O. ``recognises`` reads the client's
   type (``shapes.defines``), never calls it; the openers check what
   depends on the backend (its names, the client's face) and build a store,
   which makes its first request when the engine first drives it.
3. Detection runs once per lock: the registry finds the descriptor, and the
   lock opens its store and names its events' backend from that one
   answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from .._clock import Clock
from .._core.abc import Store
from .._core.readwrite import ReadWriteStore
from .._options import Options
from .address import URLForm

S_co = TypeVar("S_co", covariant=True)


class Opener(Protocol[S_co]):
    """Opens one kind of store on a recognised client: checks, then builds; no I/O."""

    def __call__(
        self, client: object, options: Options, clock: Clock, *, asynchronous: bool
    ) -> S_co: ...


@dataclass(frozen=True, slots=True)
class Descriptor:
    """One backend, as the registry, the faces and the checks see it.

    ``name`` is what events report and ``backend=`` takes; ``label`` is how
    messages name it. A client is the backend's if ``recognises(client)``;
    ``needs`` says what that takes, for the error that names every
    backend's contract ("" for a backend that is an object of dmutex's,
    ``instance``, taken whatever ``backend=`` says). ``replicas``: None if
    ``replicas=`` is taken here, else why not (the error's reason).
    ``dialects``: the SQLAlchemy dialects whose engines are this backend's
    (an engine several backends recognise is its dialect's backend's).
    ``url``: how the ``dmutex`` command names and opens the backend (None:
    the command cannot reach it).
    """

    name: str
    label: str
    recognises: Callable[[object], bool]
    open_store: Opener[Store]
    open_readwrite_store: Opener[ReadWriteStore]
    needs: str = ""
    instance: type | None = None
    replicas: str | None = None
    dialects: tuple[str, ...] = ()
    url: URLForm | None = None

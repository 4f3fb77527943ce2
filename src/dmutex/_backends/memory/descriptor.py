"""The in-memory backend as the registry sees it: its :class:`Descriptor`."""

from __future__ import annotations

from ..._clock import Clock
from ..._errors import InvalidArgumentError
from ..._options import Options
from ..abc import Descriptor
from .backend import InMemoryBackend
from .readwrite import MemoryReadWriteStore
from .store import MemoryStore


def _backend(client: object, options: Options) -> InMemoryBackend:
    """The client, whose clock is the one: a lock's own ``clock=`` is refused."""
    assert isinstance(client, InMemoryBackend)  # recognised by its type
    if options.clock is not None and options.clock is not client.clock:
        raise InvalidArgumentError(
            "an InMemoryBackend decides expiry by its own clock: pass clock= to "
            "InMemoryBackend(clock=...), not to the lock"
        )
    return client


def open_store(
    client: object, options: Options, clock: Clock, *, asynchronous: bool
) -> MemoryStore:
    """A namespace (key prefix) of the backend's mutexes and semaphores."""
    fencing = options.fencing is not False
    backend = _backend(client, options)
    return MemoryStore(backend, options.key_prefix, options.max_permits, fencing=fencing)


def open_readwrite_store(
    client: object, options: Options, clock: Clock, *, asynchronous: bool
) -> MemoryReadWriteStore:
    """A namespace of the backend's read-write locks."""
    fencing = options.fencing is not False
    backend = _backend(client, options)
    return MemoryReadWriteStore(backend, options.key_prefix, options.max_readers, fencing=fencing)


BACKEND = Descriptor(
    name="memory",
    label="InMemoryBackend",
    recognises=lambda client: isinstance(client, InMemoryBackend),
    open_store=open_store,
    open_readwrite_store=open_readwrite_store,
    instance=InMemoryBackend,
)
"""An :class:`InMemoryBackend`: taken whatever ``backend=`` says; ``replicas=`` waits for none."""

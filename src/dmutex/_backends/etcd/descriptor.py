"""The etcd backend as the registry sees it: its :class:`Descriptor`."""

from __future__ import annotations

from ..._clock import Clock
from ..._options import Options
from ..abc import Descriptor
from ..shapes import Packages, refuse_other_face
from .names import check_etcd_prefix
from .readwrite import EtcdReadWriteStore
from .shapes import dialect, face, recognises
from .store import EtcdStore
from .url import FORM

PACKAGES = Packages(sync=("etcd3gw",), asyncio=("aetcd",))


def _checked(client: object, options: Options, asynchronous: bool) -> None:
    """The key prefix and the client's face, checked before any request."""
    check_etcd_prefix(options.key_prefix, options.key_origin)
    refuse_other_face(client, face(client), "client", PACKAGES, asynchronous=asynchronous)


def open_store(client: object, options: Options, clock: Clock, *, asynchronous: bool) -> EtcdStore:
    """The namespace (key prefix) of ``options``' mutexes or semaphores.

    The fence is the grant's revision: it costs no request, and is kept
    unless ``fencing=False``.
    """
    _checked(client, options, asynchronous)
    return EtcdStore(
        dialect(client), options.key_prefix, options.max_permits, clock, fencing=options.fencing
    )


def open_readwrite_store(
    client: object, options: Options, clock: Clock, *, asynchronous: bool
) -> EtcdReadWriteStore:
    """The namespace (key prefix) of ``options``' read-write locks; fences as the mutexes'."""
    _checked(client, options, asynchronous)
    return EtcdReadWriteStore(
        dialect(client), options.key_prefix, options.max_readers, clock, fencing=options.fencing
    )


BACKEND = Descriptor(
    name="etcd",
    label="etcd",
    recognises=recognises,
    open_store=open_store,
    open_readwrite_store=open_readwrite_store,
    needs=(
        "get_url(path), post(url, json=...) and watch_once(key, ...) (etcd3gw), or "
        "lease, refresh_lease, revoke_lease, transaction and watch_once (aetcd)"
    ),
    replicas=(
        "etcd commits every write to a majority of its members before it answers, "
        "so there is nothing for replicas= to wait for"
    ),
    url=FORM,
)
"""etcd v3 (etcd3gw over the JSON gateway, aetcd over gRPC)."""

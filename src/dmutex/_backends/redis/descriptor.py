"""The Redis backend as the registry sees it: its :class:`Descriptor`."""

from __future__ import annotations

from ..._clock import Clock
from ..._options import Options
from ..abc import Descriptor
from ..shapes import Packages, refuse_other_face
from .names import check_redis_prefix
from .readwrite import RedisReadWriteStore
from .shapes import face, recognises
from .store import RedisStore
from .url import FORM

PACKAGES = Packages(sync=("redis", "valkey"), asyncio=("redis.asyncio", "valkey.asyncio"))


def _checked(client: object, options: Options, asynchronous: bool) -> None:
    """The key prefix and the client's face, checked before any request."""
    check_redis_prefix(options.key_prefix, options.key_origin)
    refuse_other_face(
        client, face(client, asynchronous), "client", PACKAGES, asynchronous=asynchronous
    )


def open_store(client: object, options: Options, clock: Clock, *, asynchronous: bool) -> RedisStore:
    """The namespace (key prefix) of ``options``' mutexes or semaphores.

    ``fencing=None`` stays None: the store keeps a fence where it costs no
    request (a key with a hash tag on a cluster).
    """
    _checked(client, options, asynchronous)
    return RedisStore(
        client,
        options.key_prefix,
        options.max_permits,
        clock,
        fencing=options.fencing,
        replicas=options.replicas,
        replicas_ms=options.replicas_timeout_ms,
    )


def open_readwrite_store(
    client: object, options: Options, clock: Clock, *, asynchronous: bool
) -> RedisReadWriteStore:
    """The namespace of ``options``' read-write locks."""
    _checked(client, options, asynchronous)
    return RedisReadWriteStore(
        client,
        options.key_prefix,
        options.max_readers,
        clock,
        fencing=options.fencing is not False,
        replicas=options.replicas,
        replicas_ms=options.replicas_timeout_ms,
    )


BACKEND = Descriptor(
    name="redis",
    label="Redis",
    recognises=recognises,
    open_store=open_store,
    open_readwrite_store=open_readwrite_store,
    needs=(
        "execute_command(*args), or both set(name, value, px=..., nx=...) "
        "and eval(script, numkeys, *keys_and_args)"
    ),
    url=FORM,
)
"""Redis (and valkey): ``replicas=`` is its option, a ``WAIT`` beside each write."""

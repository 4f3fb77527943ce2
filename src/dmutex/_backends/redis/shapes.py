"""What makes a client a Redis client, and which of its faces it has: no I/O."""

from __future__ import annotations

from ..shapes import defines


def recognises(client: object) -> bool:
    """Whether ``client`` has the Redis shape: ``execute_command``, or ``set`` and ``eval``."""
    return defines(client, "execute_command") or (
        defines(client, "set") and defines(client, "eval")
    )


def face(client: object, asynchronous: bool) -> str:
    """The method whose face (coroutine function or not) tells sync from asyncio."""
    return "execute_command" if defines(client, "execute_command") else "eval"


def is_cluster_client(client: object) -> bool:
    """Whether a Redis ``client`` routes commands by hash slot: it has a ``keyslot`` method.

    Looked up dynamically, so a wrapper that forwards attributes to a cluster
    client counts as one. Erring towards "cluster" only costs requests (one
    key per request); erring the other way would send scripts the cluster
    refuses.
    """
    return callable(getattr(client, "keyslot", None))

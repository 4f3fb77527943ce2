"""What makes a client an etcd client, and which dialect speaks to it: no I/O."""

from __future__ import annotations

from ..shapes import defines
from .requests import Dialect, Gateway, Grpc

_GATEWAY = ("get_url", "post", "watch_once")
_GRPC = ("lease", "refresh_lease", "revoke_lease", "transaction", "watch_once")


def is_gateway(client: object) -> bool:
    """Whether ``client`` has etcd3gw's shape: ``get_url``, ``post`` and ``watch_once``."""
    return all(defines(client, name) for name in _GATEWAY)


def is_grpc(client: object) -> bool:
    """Whether ``client`` has aetcd's shape: lease methods, ``transaction``, ``watch_once``."""
    return all(defines(client, name) for name in _GRPC)


def recognises(client: object) -> bool:
    """Whether ``client`` has either etcd shape."""
    return is_gateway(client) or is_grpc(client)


def face(client: object) -> str:
    """The method whose face (coroutine function or not) tells sync from asyncio."""
    return "post" if is_gateway(client) else "transaction"


def dialect(client: object) -> Dialect:
    """The dialect that speaks to ``client`` (``requests.py``, rule 1)."""
    return Gateway(client) if is_gateway(client) else Grpc(client)

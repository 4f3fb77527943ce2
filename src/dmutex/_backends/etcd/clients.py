"""The etcd client contracts, as :class:`typing.Protocol` classes.

``dmutex._backends.clients`` gathers them for ``dmutex`` to publish. Two
families (``requests.py`` speaks each): etcd3gw's sync client, over etcd's
JSON gateway, and aetcd's asyncio client, over gRPC.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import Literal, Protocol

__all__ = ["AsyncEtcdClientLike", "EtcdGatewayClientLike"]


class EtcdGatewayClientLike(Protocol):
    """A sync etcd client over the JSON gateway (``etcd3gw.Etcd3Client``).

    dmutex sends every request but watches with ``post``, and reads the
    JSON the gateway answers.
    """

    def get_url(self, path: str, /) -> str:
        """The URL of an API path, such as ``/kv/txn``."""
        ...

    def post(self, url: str, /, *, json: Mapping[str, object]) -> object:
        """POST ``json`` to ``url``; the decoded JSON reply. Raises on an HTTP error."""
        ...

    def watch_once(
        self,
        key: bytes,
        /,
        timeout: float,
        *,
        start_revision: int,
        filters: list[Literal["NOPUT", "NODELETE"]],
    ) -> object:
        """The first event on ``key`` from ``start_revision``; raises after ``timeout`` s."""
        ...


class AsyncEtcdClientLike(Protocol):
    """An asyncio etcd client over gRPC (``aetcd.Client``).

    Its ``transactions`` attribute builds the comparisons and operations of
    ``transaction`` (dmutex imports nothing of aetcd).
    """

    @property
    def transactions(self) -> object:
        """The builders of ``transaction``'s comparisons and operations."""
        ...

    def lease(self, ttl: int, /, lease_id: int | None = ...) -> Awaitable[object]:
        """Grant a lease; raises if ``lease_id`` is in use."""
        ...

    def refresh_lease(self, lease_id: int, /) -> Awaitable[object]:
        """Renew a lease; the reply's ``TTL`` is 0 if it is gone."""
        ...

    def revoke_lease(self, lease_id: int, /) -> Awaitable[object]:
        """Revoke a lease and delete its keys; raises if it is gone."""
        ...

    def get_lease_info(self, lease_id: int, /, *, keys: bool = ...) -> Awaitable[object]:
        """A lease's time to live."""
        ...

    def transaction(
        self, compare: list[object], success: list[object], failure: list[object]
    ) -> Awaitable[object]:
        """Run a transaction; ``(succeeded, responses)``."""
        ...

    def get_prefix(self, key_prefix: bytes, /, *, keys_only: bool = ...) -> Awaitable[object]:
        """The keys that begin with ``key_prefix``."""
        ...

    def watch_once(
        self, key: bytes, /, timeout: float | None = ..., *, start_revision: int | None = ...
    ) -> Awaitable[object]:
        """The first event on ``key`` from ``start_revision``; raises after ``timeout`` s."""
        ...

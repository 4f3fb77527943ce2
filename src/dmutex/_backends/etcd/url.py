"""etcd's URL for the ``dmutex`` command: ``etcd://host:port``, or several endpoints.

Rules:

1. ``etcd://host[:port][,host[:port]...]``: the members' client endpoints
   (port 2379 when none is given), plain HTTP through etcd's JSON gateway,
   with etcd3gw. No user, path, query or fragment: the command does not
   authenticate to etcd.
2. Opening asks the endpoints in their order for the member's status, each
   within the request timeout, and starts with the first that answers;
   none: the backend is unreachable (status 69). Every request times out
   after the request timeout.
3. A request that cannot reach its member, or that the member cannot serve
   (etcd's gateway answers 503 without a quorum), goes to the next
   endpoint, and the command stays there (:class:`Endpoints`). Sending a
   request again is safe for every request the store makes: a grant's
   lease ID is the hold's own (a copy finds it), a transaction's comparison
   fails on a copy of itself (the attempt then fails, and frees what it
   took), a keep-alive is idempotent, and a copy of a revoke answers that
   the lease is gone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

from ..address import Address, BadURL, Connection, Unreachable, URLForm, missing, one_line, redact

__all__ = ["FORM", "Endpoints", "endpoints"]

DEFAULT_PORT = 2379


def endpoints(url: str) -> list[tuple[str, int]]:
    """The ``(host, port)`` endpoints of an ``etcd://`` URL (rule 1); :class:`BadURL` if not one."""
    parts = urlsplit(url)
    shown = redact(url)
    if "@" in parts.netloc:
        raise BadURL(f"bad etcd URL {shown}: the command does not authenticate to etcd")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise BadURL(f"bad etcd URL {shown}: give only endpoints, etcd://host:port[,host:port]")
    found = []
    for item in parts.netloc.split(","):
        try:
            endpoint = urlsplit(f"//{item}")
            host, port = endpoint.hostname, endpoint.port
        except ValueError as error:
            raise BadURL(f"bad etcd URL {shown}: {one_line(error)}") from None
        if not host:
            raise BadURL(f"bad etcd URL {shown}: an endpoint without a host")
        found.append((host, DEFAULT_PORT if port is None else port))
    return found


class Endpoints:
    """etcd3gw clients of several members as one gateway client: on to the next when one fails.

    ``get_url`` answers the API path itself, which ``post`` sends to the
    current member, or the next ones in turn (rule 3); ``watch_once`` does
    the same. ``retry`` names the client package's errors that mean the
    member was not reached or could not serve.
    """

    def __init__(self, clients: list[Any], retry: tuple[type[BaseException], ...]) -> None:
        self._clients = clients
        self._retry = retry
        self._current = 0

    def _each(self) -> list[Any]:
        start = self._current
        return [self._clients[(start + i) % len(self._clients)] for i in range(len(self._clients))]

    def _send(self, call: Callable[[Any], object]) -> object:
        error: BaseException | None = None
        for client in self._each():
            try:
                answer = call(client)
            except self._retry as failed:
                error = failed
                continue
            self._current = self._clients.index(client)
            return answer
        assert error is not None  # at least one endpoint
        raise error

    def get_url(self, path: str, /) -> str:
        """The API path itself: :meth:`post` sends it to a member."""
        return path

    def post(self, url: str, /, *, json: Mapping[str, object]) -> object:
        """POST ``json`` to the API path ``url`` of the current member, or the next ones."""
        return self._send(lambda client: client.post(client.get_url(url), json=json))

    def watch_once(
        self,
        key: bytes,
        /,
        timeout: float,
        *,
        start_revision: int,
        filters: list[Literal["NOPUT", "NODELETE"]],
        **options: object,
    ) -> object:
        """The first event on ``key`` from ``start_revision``, watched on a member that answers."""
        return self._send(
            lambda client: client.watch_once(
                key, timeout, start_revision=start_revision, filters=filters, **options
            )
        )

    def close(self) -> None:
        """Close every member's session."""
        for client in self._clients:
            client.session.close()


def _parse(url: str) -> Address:
    endpoints(url)
    return Address("etcd", url, redact(url))


def _connect(address: Address, timeout: float, waits: bool) -> Connection:
    """An etcd3gw client of the first endpoint that answers (rule 2)."""
    try:
        import etcd3gw
        import requests
    except ImportError:
        raise missing(address, "etcd3gw", "dmutex[etcd]") from None
    errors = (etcd3gw.exceptions.Etcd3Exception, requests.RequestException, OSError)
    unreached = (
        etcd3gw.exceptions.ConnectionFailedError,
        etcd3gw.exceptions.ConnectionTimeoutError,
    )
    clients = [
        etcd3gw.Etcd3Client(host=host, port=port, timeout=timeout)
        for host, port in endpoints(address.url)
    ]
    failures = []
    for first, client in enumerate(clients):
        try:
            client.status()
        except errors as error:
            failures.append(f"{client.host}:{client.port}: {one_line(error)}")
            continue
        members = Endpoints(clients[first:] + clients[:first], unreached)
        return Connection(address, members, errors, closer=members.close)
    for client in clients:
        client.session.close()
    raise Unreachable(f"cannot reach {address.shown}: {'; '.join(failures)}")


FORM = URLForm(
    schemes=("etcd",),
    shown=("etcd://",),
    help="etcd://host:port[,host:port...]",
    listing="etcd: ranges over the prefix's slot keys, a page of keys at a time",
    parse=_parse,
    connect=_connect,
)
"""``etcd://`` URLs."""

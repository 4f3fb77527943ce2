"""etcd's URL for the ``dmutex`` command: ``etcd://host:port``, or several endpoints.

Rules:

1. ``etcd://host[:port][,host[:port]...]``: the members' client endpoints
   (port 2379 when none is given), plain HTTP through etcd's JSON gateway,
   with etcd3gw. No user, path, query or fragment: the command does not
   authenticate to etcd.
2. Opening asks the endpoints in their order for the member's status, each
   within the request timeout, and uses the first that answers; none: the
   backend is unreachable (status 69). Every request times out after the
   request timeout. A member that fails later is not left for another:
   the command's requests fail, and its lease is lost by its deadline.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from ..address import Address, BadURL, Connection, Unreachable, URLForm, missing, one_line, redact

__all__ = ["FORM", "endpoints"]

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
    failures = []
    for host, port in endpoints(address.url):
        client = etcd3gw.Etcd3Client(host=host, port=port, timeout=timeout)
        try:
            client.status()
        except errors as error:
            client.session.close()
            failures.append(f"{host}:{port}: {one_line(error)}")
            continue
        return Connection(address, client, errors, closer=client.session.close)
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

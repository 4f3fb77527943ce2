"""Redis's URL for the ``dmutex`` command: ``redis://`` and ``rediss://``, as redis-py takes them.

Rules:

1. The URL goes to redis-py (``Redis.from_url``), which checks it, except
   its database (the path, or ``?db=``): redis-py reads one it cannot parse
   as database 0 and would lock there, so a database that is not a number
   is refused first.
2. The client connects on its first request (an unreachable server
   surfaces there), within ``min(timeout, 5)`` seconds, and every request
   times out after the request timeout.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from ..address import Address, BadURL, Connection, URLForm, missing, one_line, redact
from .requests import SCAN_COUNT

__all__ = ["FORM"]


def _parse(url: str) -> Address:
    """Check the URL's database (rule 1)."""
    parts = urlsplit(url)
    named = [("its path", unquote(parts.path[1:]))] if parts.path not in ("", "/") else []
    for item in parts.query.split("&") if parts.query else []:
        name, _, value = item.partition("=")
        if unquote(name) == "db":
            named.append(("db=", unquote(value)))
    for where, database in named:
        if not (database.isascii() and database.isdigit()):
            raise BadURL(
                f"bad Redis URL {redact(url)}: {where} names the database by its number "
                f"(0, 1, ...), not {database!r}"
            )
    return Address("redis", url, redact(url))


def _connect(address: Address, timeout: float, waits: bool) -> Connection:
    """A redis-py client that connects on first use (rule 2)."""
    try:
        import redis
    except ImportError:
        raise missing(address, "redis", "dmutex[redis]") from None
    try:
        client = redis.Redis.from_url(
            address.url, socket_connect_timeout=min(timeout, 5.0), socket_timeout=timeout
        )
    except ValueError as error:
        raise BadURL(f"bad Redis URL {address.shown}: {one_line(error)}") from None
    return Connection(address, client, (redis.RedisError, OSError), closer=client.close)


FORM = URLForm(
    schemes=("redis", "rediss"),
    shown=("redis://", "rediss://"),
    help="redis://..., rediss://...",
    listing=(
        f"Redis: SCAN on the service's prefix, {SCAN_COUNT} keys a request, until enough are "
        "found or the whole database was scanned"
    ),
    parse=_parse,
    connect=_connect,
)
"""``redis://`` and ``rediss://`` URLs."""

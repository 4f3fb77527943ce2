"""MongoDB's URL for the ``dmutex`` command: ``mongodb://`` or ``mongodb+srv://``, pymongo's.

Rules:

1. The URL goes to pymongo, which checks it (status 64 if it refuses it);
   its default database is the lock's ``db_name``, else ``dmutex``.
2. pymongo waits 30 s to find a server and for ever for a reply by
   default; the command's requests must fail well within the TTL, so the
   server selection and socket timeouts are the request timeout and the
   connect timeout at most 5 s, unless the URL names them
   (:func:`mongodb_timeouts`). The client connects on its first request.
"""

from __future__ import annotations

from typing import Any

from ..address import Address, BadURL, Connection, Unreachable, URLForm, missing, one_line, redact

__all__ = ["FORM", "mongodb_timeouts"]


def mongodb_timeouts(url: str, timeout: float) -> dict[str, int]:
    """Pymongo's timeouts for ``timeout`` seconds a request, less those ``url`` sets (rule 2).

    An option the URL names is left to it: a keyword would override it.
    """
    ms = round(timeout * 1000)
    wanted = {
        "serverSelectionTimeoutMS": ms,
        "socketTimeoutMS": ms,
        "connectTimeoutMS": min(ms, 5000),
    }
    named = url.lower()
    return {name: value for name, value in wanted.items() if f"{name.lower()}=" not in named}


def _parse(url: str) -> Address:
    return Address("mongodb", url, redact(url))


def _connect(address: Address, timeout: float, waits: bool) -> Connection:
    """A pymongo client (rule 2); its default database is the lock's (rule 1)."""
    try:
        import pymongo
        import pymongo.errors
    except ImportError:
        raise missing(address, "pymongo", "dmutex[mongodb]") from None
    try:
        # Any: MongoClient takes its URL options as **kwargs: Any.
        options: dict[str, Any] = dict(mongodb_timeouts(address.url, timeout))
        client: pymongo.MongoClient[dict[str, object]] = pymongo.MongoClient(address.url, **options)
    except (pymongo.errors.InvalidURI, ValueError) as error:  # ValueError: a port out of range
        raise BadURL(f"bad MongoDB URL {address.shown}: {one_line(error)}") from None
    except pymongo.errors.PyMongoError as error:  # mongodb+srv: the DNS lookup failed
        raise Unreachable(f"cannot reach {address.shown}: {one_line(error)}") from None
    db_name = client.get_default_database("dmutex").name
    return Connection(
        address,
        client,
        (pymongo.errors.PyMongoError, OSError),
        closer=client.close,
        options={"db_name": db_name},
    )


FORM = URLForm(
    schemes=("mongodb", "mongodb+srv"),
    shown=("mongodb://", "mongodb+srv://"),
    help="mongodb://..., mongodb+srv://...",
    listing="MongoDB: one find with a limit",
    parse=_parse,
    connect=_connect,
)
"""``mongodb://`` and ``mongodb+srv://`` URLs."""

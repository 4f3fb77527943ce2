"""Backend URLs: from ``--backend`` (or the default SQLite file) to a connected client.

Guarantee: :func:`parse` does no I/O and refuses a malformed URL with a
:class:`~dmutex._cli.errors.Failure` of status 64; :func:`connect` imports a
client package only for its own scheme, and turns a missing package into
status 69 naming the extra to install. Every URL shown to the user is
:func:`redact`-ed: a password never reaches stderr.

Caveats: ``sqlite:`` URLs follow ``file:`` URLs, not SQLAlchemy's:
``sqlite:///var/x.db`` is the absolute path ``/var/x.db``; a relative path
is written ``sqlite:x.db``. Redis and MongoDB URLs are passed to their
client packages as given, which validate them.
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from .._errors import InvalidArgumentError
from .._faces.sync import SyncClient
from .errors import UNAVAILABLE, USAGE, Failure, one_line

__all__ = [
    "Backend",
    "Target",
    "connect",
    "default_sqlite_path",
    "make_private_dirs",
    "parse",
    "redact",
]

Kind = Literal["sqlite", "redis", "mongodb"]

_SCHEMES: dict[str, Kind] = {
    "sqlite": "sqlite",
    "redis": "redis",
    "rediss": "redis",
    "mongodb": "mongodb",
    "mongodb+srv": "mongodb",
}
_EXTRA: dict[Kind, tuple[str, str]] = {
    "redis": ("redis", "dmutex[redis]"),
    "mongodb": ("pymongo", "dmutex[mongodb]"),
}
# userinfo "user:password@" in the authority of scheme://authority/...
_USERINFO = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/?#@:]*):[^/?#]*@")
_SECRET_PARAM = re.compile(r"(?i)([?&](?:password|pass|pwd)=)[^&#]*")


def redact(url: str) -> str:
    """``url`` with any password (in the userinfo or a ``password=`` parameter) as ``***``."""
    shown = _USERINFO.sub(r"\g<head>\g<user>:***@", url, count=1)
    return _SECRET_PARAM.sub(r"\1***", shown)


def default_sqlite_path(env: Mapping[str, str]) -> Path:
    """The per-user lock file: ``$XDG_STATE_HOME/dmutex/locks.sqlite3`` (or in ~/.local/state).

    A relative ``XDG_STATE_HOME`` is ignored, as the XDG spec says.
    """
    state = env.get("XDG_STATE_HOME", "")
    if state and os.path.isabs(state):
        base = Path(state)
    else:
        home = env.get("HOME") or str(Path.home())
        base = Path(home) / ".local" / "state"
    return base / "dmutex" / "locks.sqlite3"


def make_private_dirs(folder: Path) -> None:
    """``mkdir -p folder``, each directory it creates with mode 0o700 (less the umask).

    Directories that exist are left as they are. Raises ``OSError``.
    """
    missing: list[Path] = []
    current = folder
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another dmutex made it meanwhile
            path.mkdir(mode=0o700)


@dataclass(frozen=True)
class Target:
    """A parsed backend URL: its kind, how to show it, and the SQLite path where it has one."""

    kind: Kind
    url: str
    """The URL as given (``sqlite:///...`` for the default), with secrets: never print it."""
    shown: str
    """The URL with any password hidden, for messages."""
    path: Path | None = None
    """SQLite: the database file."""
    default: bool = False
    """SQLite: the per-user default file, whose directory is created on first use."""


def parse(url: str | None, env: Mapping[str, str]) -> Target:
    """Check ``url`` (None: the default SQLite file) without I/O; status 64 if malformed."""
    if url is None or url == "":
        path = default_sqlite_path(env)
        return Target("sqlite", f"sqlite://{path}", f"sqlite://{path}", path, default=True)
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    kind = _SCHEMES.get(scheme)
    if kind is None:
        raise Failure(
            USAGE,
            f"unsupported backend URL {redact(url)!r}: use sqlite:///PATH, redis://, rediss://, "
            "mongodb:// or mongodb+srv://",
        )
    if kind != "sqlite":
        return Target(kind, url, redact(url))
    return Target("sqlite", url, url, _sqlite_path(url))


def _sqlite_path(url: str) -> Path:
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise Failure(USAGE, f"a sqlite: URL takes no query or fragment: {url!r}")
    if parts.netloc:
        raise Failure(
            USAGE,
            f"a sqlite: URL names a local file, not a host: {url!r} "
            "(write sqlite:///ABSOLUTE/PATH or sqlite:RELATIVE/PATH)",
        )
    path = unquote(parts.path)
    if not path:
        raise Failure(USAGE, f"a sqlite: URL needs a file path: {url!r}")
    if path.startswith("//"):  # sqlite:////abs, SQLAlchemy's absolute form: the same file
        path = "/" + path.lstrip("/")
    return Path(path)


@dataclass
class Backend:
    """A connected client for one :class:`Target`, the errors it raises, and how to close it."""

    target: Target
    client: SyncClient
    errors: tuple[type[BaseException], ...]
    """The client package's own exceptions: any of them means status 69."""
    db_name: str = "dmutex"
    """MongoDB: the URL's default database, else ``dmutex``."""
    closer: Callable[[], None] = field(default=lambda: None)

    def close(self) -> None:
        """Close the client; a failure to close is not worth a message."""
        with contextlib.suppress(Exception):  # the process is ending: nothing to recover
            self.closer()


def connect(target: Target, *, timeout: float) -> Backend:
    """A client for ``target``; network clients time out requests after ``timeout`` seconds.

    Raises :class:`Failure`: 64 for a URL the client package refuses, 69 for a
    missing package or a backend that cannot be opened (an SQLite file that
    cannot be created or is not a database). Redis and MongoDB connect on
    first use, so an unreachable server surfaces at the first request.
    """
    if target.kind == "sqlite":
        return _connect_sqlite(target, timeout)
    if target.kind == "redis":
        return _connect_redis(target, timeout)
    return _connect_mongodb(target, timeout)


def _missing(target: Target) -> Failure:
    package, extra = _EXTRA[target.kind]
    scheme = target.url.partition(":")[0]
    return Failure(
        UNAVAILABLE,
        f"the {scheme}: backend needs the {package} package: pip install '{extra}'",
    )


def _connect_sqlite(target: Target, timeout: float) -> Backend:
    from .._backends.sqlite import SQLiteBackend

    assert target.path is not None  # parse() sets it for every sqlite: target
    try:
        if target.default:
            make_private_dirs(target.path.parent)
        client = SQLiteBackend(target.path, timeout=timeout)
    except (InvalidArgumentError, OSError, sqlite3.Error) as error:
        raise Failure(UNAVAILABLE, f"cannot open {target.shown}: {one_line(error)}") from None
    return Backend(target, client, (sqlite3.Error, OSError), closer=client.close)


def _connect_redis(target: Target, timeout: float) -> Backend:
    try:
        import redis
    except ImportError:
        raise _missing(target) from None
    try:
        client = redis.Redis.from_url(
            target.url, socket_connect_timeout=min(timeout, 5.0), socket_timeout=timeout
        )
    except ValueError as error:
        raise Failure(USAGE, f"bad Redis URL {target.shown}: {one_line(error)}") from None
    return Backend(target, client, (redis.RedisError, OSError), closer=client.close)


def mongodb_timeouts(url: str, timeout: float) -> dict[str, int]:
    """The timeouts pymongo gets for ``timeout`` seconds a request, less those ``url`` sets.

    pymongo waits 30 s to find a server and for ever for a reply by
    default; the command's requests must fail well within the TTL. An
    option the URL names is left to it: a keyword would override it.
    """
    ms = round(timeout * 1000)
    wanted = {
        "serverSelectionTimeoutMS": ms,
        "socketTimeoutMS": ms,
        "connectTimeoutMS": min(ms, 5000),
    }
    named = url.lower()
    return {name: value for name, value in wanted.items() if f"{name.lower()}=" not in named}


def _connect_mongodb(target: Target, timeout: float) -> Backend:
    try:
        import pymongo
        import pymongo.errors
    except ImportError:
        raise _missing(target) from None
    try:
        # Any: MongoClient takes its URL options as **kwargs: Any.
        options: dict[str, Any] = dict(mongodb_timeouts(target.url, timeout))
        client: pymongo.MongoClient[dict[str, object]] = pymongo.MongoClient(target.url, **options)
    except (pymongo.errors.InvalidURI, ValueError) as error:  # ValueError: a port out of range
        raise Failure(USAGE, f"bad MongoDB URL {target.shown}: {one_line(error)}") from None
    except pymongo.errors.PyMongoError as error:  # mongodb+srv: the DNS lookup failed
        raise Failure(UNAVAILABLE, f"cannot reach {target.shown}: {one_line(error)}") from None
    db_name = client.get_default_database("dmutex").name
    return Backend(
        target, client, (pymongo.errors.PyMongoError, OSError), db_name, closer=client.close
    )

"""Backend URLs: from ``--backend`` (or the default SQLite file) to a connected client.

Guarantee: :func:`parse` does no I/O and refuses a malformed URL with a
:class:`~dmutex._cli.errors.Failure` of status 64; :func:`connect` imports a
client package only for its own scheme, and turns a missing package into
status 69 naming the extra to install. Every URL shown to the user is
:func:`redact`-ed: a password never reaches stderr.

PostgreSQL (``postgresql://`` or ``postgres://``, as libpq takes them):

1. The command reads one query parameter itself, ``schema=NAME``: the
   schema of the lock tables (the library's ``schema_name``), checked by
   :func:`parse`; every other parameter is libpq's, and libpq's URL parser
   (psycopg's ``conninfo_to_dict``, no I/O) refuses what it does not know,
   with status 64. A port out of 1-65535 is refused there too. libpq's
   messages may quote the URL back: the URL's password is cut from them.
2. Requests are bounded where libpq can bound them: ``connect_timeout``
   (at most 5 s) and ``tcp_user_timeout`` (the request timeout) are set
   unless the URL (or ``PGCONNECT_TIMEOUT``) names them;
   ``fallback_application_name`` is ``dmutex``.
3. One connection is opened first, in autocommit: libpq's own message says
   why a server cannot be reached (status 69). ``status`` reads through it.
   ``run`` then uses a ``psycopg_pool.ConnectionPool`` of two connections
   (:data:`POOL_SIZE`): the renewer thread and the release never wait for
   each other, and a waiter ``LISTEN``s on one of them, so it wakes on the
   holder's release. Without ``psycopg_pool``, ``run`` keeps the one
   connection, shared by the threads, and its waits poll.

MySQL and MariaDB (``mysql://`` or ``mariadb://``, the same):

4. The form is ``mysql://[USER[:PASSWORD]@]HOST[:PORT]/DATABASE``. The
   database is required: the lock tables live in it (the connection's
   current database), and a URL without one is refused (status 64) with
   that form, as are a port out of 1-65535, a path of more than one
   database, a fragment, and any query parameter but the two the command
   knows: ``unix_socket=PATH`` (connect through that socket; the host is
   then not used) and ``ssl_ca=PATH`` (TLS required, the server's
   certificate checked against that CA file and its name against HOST).
   Percent-escapes are decoded in the user, password and database. No
   user: the login name, as PyMySQL and the ``mysql`` client take it; no
   host: localhost, over TCP; no port: 3306.
5. One PyMySQL connection (the ``dmutex[mysql]`` extra): autocommit,
   character set ``utf8mb4``, ``program_name`` ``dmutex``, a connect timeout
   of the request timeout (at most 5 s) and read and write timeouts of the
   request timeout (:func:`mysql_timeouts`). ``run`` shares it between its
   threads (the store's runner gives them turns), and its waits poll: MySQL
   has no cross-process wake-up. A request that fails on the wire (a
   timeout included) leaves PyMySQL's connection closed; the next request
   opens it again, so that a renewal after a passing outage succeeds.

Caveats: ``sqlite:`` URLs follow ``file:`` URLs, not SQLAlchemy's:
``sqlite:///var/x.db`` is the absolute path ``/var/x.db``; a relative path
is written ``sqlite:x.db``. Redis and MongoDB URLs are passed to their
client packages as given, which validate them, except a Redis database
(the path, or ``?db=``) that is not a number, which redis-py would read as
database 0: :func:`parse` refuses it. libpq checks some parameters' values
only as it connects; ``sslmode``, ``gssencmode``, ``target_session_attrs``
and the whole-number ones (``connect_timeout``, ``keepalives*``,
``tcp_user_timeout``) are checked before, status 64. A ``mysql:`` URL takes no
client certificate, and no other PyMySQL option. A PostgreSQL server that
accepts a request and never answers it (a paused server) holds it until it
answers: libpq has no reply timeout. ``run`` still stops the command by the
lease's deadline, which does not wait for a renewal to answer.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, unquote_to_bytes, urlsplit

from .._backends.clients import SyncClient
from .._backends.mysql.names import MAX_MYSQL_IDENTIFIER
from .._backends.postgresql.names import check_postgres_schema
from .._errors import InvalidArgumentError
from .errors import UNAVAILABLE, USAGE, Failure, one_line

__all__ = [
    "Backend",
    "Target",
    "connect",
    "default_sqlite_path",
    "make_private_dirs",
    "mysql_options",
    "mysql_timeouts",
    "parse",
    "postgres_timeouts",
    "redact",
]

Kind = Literal["sqlite", "redis", "mongodb", "postgresql", "mysql"]

_SCHEMES: dict[str, Kind] = {
    "sqlite": "sqlite",
    "redis": "redis",
    "rediss": "redis",
    "mongodb": "mongodb",
    "mongodb+srv": "mongodb",
    "postgresql": "postgresql",
    "postgres": "postgresql",
    "mysql": "mysql",
    "mariadb": "mysql",
}
_EXTRA: dict[Kind, tuple[str, str]] = {
    "redis": ("redis", "dmutex[redis]"),
    "mongodb": ("pymongo", "dmutex[mongodb]"),
    "postgresql": ("psycopg", "dmutex[postgresql]"),
    "mysql": ("PyMySQL", "dmutex[mysql]"),
}
SCHEMA_PARAM = "schema"  # the PostgreSQL query parameter the command reads itself (rule 1)
POOL_SIZE = 2  # run's pool: a waiter may LISTEN on half of it (listening.py, rule 1)
MYSQL_PARAMS = ("unix_socket", "ssl_ca")  # the only query parameters of a mysql: URL (rule 4)
MYSQL_FORM = "mysql://USER:PASSWORD@HOST:PORT/DATABASE"
# userinfo "user:password@" in the authority of scheme://authority/...
_USERINFO = re.compile(
    r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/?#@:]*):(?P<secret>[^/?#]*)@"
)
_SECRET_PARAM = re.compile(r"(?i)([?&](?:password|pass|pwd)=)(?P<secret>[^&#]*)")


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
    """The URL as given (``sqlite:///...`` for the default; PostgreSQL: less ``schema=``).

    With its secrets: never print it.
    """
    shown: str
    """The URL with any password hidden, for messages."""
    path: Path | None = None
    """SQLite: the database file."""
    default: bool = False
    """SQLite: the per-user default file, whose directory is created on first use."""
    schema: str | None = None
    """PostgreSQL: the ``schema=`` parameter, which :attr:`url` no longer has."""
    database: str | None = None
    """MySQL: the URL's database, where the lock tables live (rule 4)."""


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
            "mongodb://, mongodb+srv://, postgresql://, postgres://, mysql:// or mariadb://",
        )
    if kind == "postgresql":
        return _postgres_target(url)
    if kind == "mysql":
        database = _mysql_address(url)["database"]
        assert isinstance(database, str)  # _mysql_address refuses a URL without one
        return Target("mysql", url, redact(url), database=database)
    if kind == "redis":
        _check_redis_database(url)
    if kind != "sqlite":
        return Target(kind, url, redact(url))
    return Target("sqlite", url, url, _sqlite_path(url))


def _check_redis_database(url: str) -> None:
    """Refuse a ``redis://`` URL whose database (its path, or ``?db=``) is not a number.

    redis-py reads a path it cannot parse as database 0, and would lock there.
    """
    parts = urlsplit(url)
    named = [("its path", unquote(parts.path[1:]))] if parts.path not in ("", "/") else []
    for item in parts.query.split("&") if parts.query else []:
        name, _, value = item.partition("=")
        if unquote(name) == "db":
            named.append(("db=", unquote(value)))
    for where, database in named:
        if not (database.isascii() and database.isdigit()):
            raise Failure(
                USAGE,
                f"bad Redis URL {redact(url)}: {where} names the database by its number "
                f"(0, 1, ...), not {database!r}",
            )


def _postgres_target(url: str) -> Target:
    """``url`` less its ``schema=`` parameter, and that schema, checked (rule 1)."""
    shown = redact(url)
    head, _, query = url.partition("?")
    kept: list[str] = []
    schema: str | None = None
    for item in query.split("&") if query else []:
        name, _, value = item.partition("=")
        if unquote(name) != SCHEMA_PARAM:
            kept.append(item)
            continue
        if schema is not None:
            raise Failure(USAGE, f"{SCHEMA_PARAM}= is given twice in {shown}")
        schema = unquote(value)
        try:
            check_postgres_schema(schema, f"the {SCHEMA_PARAM}= parameter of {shown}")
        except InvalidArgumentError as error:
            raise Failure(USAGE, one_line(error)) from None
    scheme, _, rest = head.partition(":")
    head = f"{scheme.lower()}:{rest}"  # libpq knows its schemes in lower case only
    libpq = f"{head}?{'&'.join(kept)}" if kept else head
    return Target("postgresql", libpq, shown, schema=schema)


def _mysql_address(url: str) -> dict[str, object]:
    """PyMySQL's ``connect()`` arguments that ``url`` gives, checked without I/O (rule 4).

    ``host``, ``port``, ``user`` and ``password`` (bytes: PyMySQL would
    encode a ``str`` one as Latin-1) where the URL has them, ``database``
    always, and ``unix_socket`` or the TLS arguments of ``ssl_ca``.
    Raises :class:`Failure` (status 64) for anything else.
    """
    shown = redact(url)

    def bad(why: str) -> Failure:
        return Failure(USAGE, f"bad MySQL URL {shown}: {_scrubbed(why, url)}")

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:  # a port out of 0-65535 or not a number, a bad IPv6 address
        raise bad(one_line(error)) from None
    if port == 0:
        raise bad("port 0 is not 1-65535")
    if parts.fragment:
        raise bad("it takes no #fragment")
    found: dict[str, object] = {}
    if parts.hostname:
        found["host"] = parts.hostname
    if port is not None:
        found["port"] = port
    if parts.username:
        found["user"] = unquote(parts.username)
    if parts.password is not None:
        found["password"] = unquote_to_bytes(parts.password)
    database = unquote(parts.path[1:]) if parts.path.startswith("/") else ""
    if not database:
        raise Failure(
            USAGE,
            f"a {parts.scheme}: URL must name the database of the lock tables: "
            f"{MYSQL_FORM} (got {shown})",
        )
    if "/" in parts.path[1:]:
        raise bad("its path names one database (write a '/' in its name as %2F)")
    if "\0" in database or database.endswith(" ") or len(database) > MAX_MYSQL_IDENTIFIER:
        raise bad(
            f"database {database!r}: MySQL refuses a name with a NUL byte, ending in a space, "
            f"or over {MAX_MYSQL_IDENTIFIER} characters"
        )
    found["database"] = database
    for item in parts.query.split("&") if parts.query else []:
        name, _, value = (unquote(text) for text in item.partition("="))
        if name not in MYSQL_PARAMS:
            raise bad(
                f"unknown parameter {name!r}: a mysql: URL takes only "
                f"{' and '.join(f'{known}=PATH' for known in MYSQL_PARAMS)}"
            )
        if name in found:
            raise bad(f"{name}= is given twice")
        if not value:
            raise bad(f"{name}= needs a path")
        found[name] = value
    if "ssl_ca" in found:  # PyMySQL checks neither the certificate nor the name unless told
        found["ssl_verify_cert"] = True
        found["ssl_verify_identity"] = True
    return found


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


def connect(target: Target, *, timeout: float, waits: bool = False) -> Backend:
    """A client for ``target``; network clients time out requests after ``timeout`` seconds.

    Raises :class:`Failure`: 64 for a URL the client package refuses, 69 for a
    missing package or a backend that cannot be opened (an SQLite file that
    cannot be created or is not a database, a PostgreSQL server that cannot
    be connected to). Redis and MongoDB connect on first use, so an
    unreachable server surfaces at the first request. ``waits``: the client
    will wait for locks, from more than one thread (PostgreSQL: a pool where
    ``psycopg_pool`` is installed, rule 3; MySQL: the one connection, rule 5).
    """
    if target.kind == "sqlite":
        return _connect_sqlite(target, timeout)
    if target.kind == "redis":
        return _connect_redis(target, timeout)
    if target.kind == "postgresql":
        return _connect_postgres(target, timeout, waits)
    if target.kind == "mysql":
        return _connect_mysql(target, timeout)
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


def postgres_timeouts(
    named: Mapping[str, str], timeout: float, env: Mapping[str, str]
) -> dict[str, int | str]:
    """The libpq parameters a connection gets for ``timeout`` seconds a request (rule 2).

    Less those the URL names (``named``: its parameters) or the
    environment sets (``PGCONNECT_TIMEOUT``): a keyword would override them.
    libpq takes ``connect_timeout`` in whole seconds, 2 at the least.
    """
    wanted: dict[str, int | str] = {
        "connect_timeout": max(2, math.ceil(min(timeout, 5.0))),
        "tcp_user_timeout": round(timeout * 1000),
        "fallback_application_name": "dmutex",
    }
    if env.get("PGCONNECT_TIMEOUT"):
        del wanted["connect_timeout"]
    return {name: value for name, value in wanted.items() if name not in named}


def _scrubbed(text: str, url: str) -> str:
    """``text`` without any password of ``url``: libpq may quote a malformed one back."""
    found = [_USERINFO.search(url), *_SECRET_PARAM.finditer(url)]
    for secret in (match.group("secret") for match in found if match is not None):
        if secret:
            text = text.replace(secret, "***")
    return text


# libpq parameters whose values it checks only when it connects (then status
# 69, as if the server were unreachable): the command checks them first.
_LIBPQ_CHOICES = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "gssencmode": ("disable", "prefer", "require"),
    "target_session_attrs": (
        "any",
        "read-write",
        "read-only",
        "primary",
        "standby",
        "prefer-standby",
    ),
}
_LIBPQ_INTEGERS = (
    "connect_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
)
_LIBPQ_INTEGER = re.compile(r"\s*[-+]?[0-9]+\s*")


def _libpq_value(params: Mapping[str, str]) -> str | None:
    """Why one of ``params`` is a value libpq would refuse at connect time, or None."""
    for name, choices in _LIBPQ_CHOICES.items():
        value = params.get(name)
        if value is not None and value not in choices:
            return f"{name}={value!r} is not one of {', '.join(choices)}"
    for name in _LIBPQ_INTEGERS:
        value = params.get(name)
        if value is not None and not _LIBPQ_INTEGER.fullmatch(value):
            return f"{name}={value!r} is not a whole number"
    return None


def _ports(params: Mapping[str, str]) -> str | None:
    """The first port of ``params`` (one per host, comma-separated) outside 1-65535."""
    for port in params.get("port", "").split(","):
        if port and not (port.isdigit() and 1 <= int(port) <= 65535):
            return port
    return None


def _connect_postgres(target: Target, timeout: float, waits: bool) -> Backend:
    try:
        import psycopg
        import psycopg.conninfo
    except ImportError:
        raise _missing(target) from None
    try:
        found = psycopg.conninfo.conninfo_to_dict(target.url)
    except psycopg.Error as error:
        text = _scrubbed(one_line(error), target.url)
        raise Failure(USAGE, f"bad PostgreSQL URL {target.shown}: {text}") from None
    params = {name: str(value) for name, value in found.items() if value is not None}
    port = _ports(params)
    if port is not None:
        raise Failure(USAGE, f"bad PostgreSQL URL {target.shown}: port {port!r} is not 1-65535")
    wrong = _libpq_value(params)
    if wrong is not None:
        raise Failure(USAGE, f"bad PostgreSQL URL {target.shown}: {wrong}")
    conninfo = psycopg.conninfo.make_conninfo(
        target.url, **postgres_timeouts(params, timeout, os.environ)
    )
    errors = (psycopg.Error, OSError)
    try:
        first = psycopg.connect(conninfo, autocommit=True)
    except errors as error:
        text = _scrubbed(one_line(error), target.url)
        raise Failure(UNAVAILABLE, f"cannot connect to {target.shown}: {text}") from None
    if not waits:
        return Backend(target, first, errors, closer=first.close)
    try:
        import psycopg_pool
    except ImportError:  # one connection, shared by the threads: waits poll (rule 3)
        return Backend(target, first, errors, closer=first.close)
    first.close()
    # The pool's own reconnection warnings would add lines to stderr: its
    # failures reach the command as errors of the requests that wait for it.
    quiet = logging.getLogger("psycopg.pool")
    if not quiet.handlers:
        quiet.addHandler(logging.NullHandler())
    pool = psycopg_pool.ConnectionPool(
        conninfo,
        kwargs={"autocommit": True},
        min_size=1,
        max_size=POOL_SIZE,
        open=False,
        timeout=timeout,
        num_workers=1,
        name="dmutex",
    )
    try:
        pool.open(wait=True, timeout=timeout)
    except errors as error:
        pool.close(timeout=0)
        text = _scrubbed(one_line(error), target.url)
        raise Failure(UNAVAILABLE, f"cannot connect to {target.shown}: {text}") from None
    return Backend(target, pool, errors, closer=lambda: pool.close(timeout=1.0))


def mysql_timeouts(timeout: float) -> dict[str, float]:
    """PyMySQL's timeouts for ``timeout`` seconds a request (rule 5).

    PyMySQL waits 10 s to connect and for ever for a reply by default; the
    command's requests must fail well within the TTL.
    """
    return {
        "connect_timeout": min(timeout, 5.0),
        "read_timeout": timeout,
        "write_timeout": timeout,
    }


def mysql_options(url: str, timeout: float) -> dict[str, object]:
    """Every argument of PyMySQL's ``connect()`` for ``url`` (rules 4 and 5); no I/O."""
    return {
        **_mysql_address(url),
        **mysql_timeouts(timeout),
        "autocommit": True,
        "charset": "utf8mb4",
        "program_name": "dmutex",
    }


def _connect_mysql(target: Target, timeout: float) -> Backend:
    try:
        import pymysql
    except ImportError:
        raise _missing(target) from None
    options = mysql_options(target.url, timeout)
    errors = (pymysql.err.MySQLError, OSError)
    try:
        # Any: connect() takes its options as keywords of many types.
        args: dict[str, Any] = options
        conn = pymysql.connect(**args)
    except errors as error:
        text = _scrubbed(one_line(error), target.url)
        raise Failure(UNAVAILABLE, f"cannot connect to {target.shown}: {text}") from None
    send = conn.query

    def query(sql: str | bytes, unbuffered: bool = False) -> int:
        """A query, on the connection opened again if a failure closed it (rule 5)."""
        if not conn.open:
            conn.connect()
        return send(sql, unbuffered)

    # The instance's own attribute: every cursor's statement goes through it.
    vars(conn)["query"] = query
    return Backend(target, conn, errors, closer=conn.close)

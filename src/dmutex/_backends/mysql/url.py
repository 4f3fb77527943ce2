"""MySQL's and MariaDB's URL for the ``dmutex`` command: ``mysql://`` or ``mariadb://``, the same.

Rules:

1. The form is ``mysql://[USER[:PASSWORD]@]HOST[:PORT]/DATABASE``. The
   database is required: the lock tables live in it (the connection's
   current database), and a URL without one is refused with that form, as
   are a port out of 1-65535, a path of more than one database, a
   fragment, and any query parameter but two: ``unix_socket=PATH``
   (connect through that socket; the host is then not used) and
   ``ssl_ca=PATH`` (TLS required, the server's certificate checked against
   that CA file and its name against HOST). Percent-escapes are decoded in
   the user, password and database. No user: the login name, as PyMySQL
   and the ``mysql`` client take it; no host: localhost, over TCP; no port:
   3306.
2. One PyMySQL connection (the ``dmutex[mysql]`` extra): autocommit,
   character set ``utf8mb4``, ``program_name`` ``dmutex``, a connect timeout
   of the request timeout (at most 5 s) and read and write timeouts of the
   request timeout (:func:`mysql_timeouts`). A command that waits shares it
   between its threads (the store's runner gives them turns), and its waits
   poll: MySQL has no cross-process wake-up. A request that fails on the
   wire (a timeout included) leaves PyMySQL's connection closed; the next
   request opens it again, so that a renewal after a passing outage
   succeeds.

Caveat: a ``mysql:`` URL takes no client certificate, and no other PyMySQL
option.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, unquote_to_bytes, urlsplit

from ..address import (
    Address,
    BadURL,
    Connection,
    Unreachable,
    URLForm,
    missing,
    one_line,
    redact,
    scrubbed,
)
from .names import MAX_MYSQL_IDENTIFIER

__all__ = ["FORM", "MYSQL_FORM", "MYSQL_PARAMS", "mysql_options", "mysql_timeouts"]

MYSQL_PARAMS = ("unix_socket", "ssl_ca")  # the only query parameters of a mysql: URL (rule 1)
MYSQL_FORM = "mysql://USER:PASSWORD@HOST:PORT/DATABASE"


def _address(url: str) -> dict[str, object]:
    """PyMySQL's ``connect()`` arguments that ``url`` gives, checked without I/O (rule 1).

    ``host``, ``port``, ``user`` and ``password`` (bytes: PyMySQL would
    encode a ``str`` one as Latin-1) where the URL has them, ``database``
    always, and ``unix_socket`` or the TLS arguments of ``ssl_ca``.
    Raises :class:`BadURL` for anything else.
    """
    shown = redact(url)

    def bad(why: str) -> BadURL:
        return BadURL(f"bad MySQL URL {shown}: {scrubbed(why, url)}")

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
        raise BadURL(
            f"a {parts.scheme}: URL must name the database of the lock tables: "
            f"{MYSQL_FORM} (got {shown})"
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


def _parse(url: str) -> Address:
    _address(url)
    return Address("mysql", url, redact(url))


def mysql_timeouts(timeout: float) -> dict[str, float]:
    """PyMySQL's timeouts for ``timeout`` seconds a request (rule 2).

    PyMySQL waits 10 s to connect and for ever for a reply by default; the
    command's requests must fail well within the TTL.
    """
    return {
        "connect_timeout": min(timeout, 5.0),
        "read_timeout": timeout,
        "write_timeout": timeout,
    }


def mysql_options(url: str, timeout: float) -> dict[str, object]:
    """Every argument of PyMySQL's ``connect()`` for ``url`` (rules 1 and 2); no I/O."""
    return {
        **_address(url),
        **mysql_timeouts(timeout),
        "autocommit": True,
        "charset": "utf8mb4",
        "program_name": "dmutex",
    }


def _connect(address: Address, timeout: float, waits: bool) -> Connection:
    """One PyMySQL connection, opened again by the request after a failure closed it (rule 2)."""
    try:
        import pymysql
    except ImportError:
        raise missing(address, "PyMySQL", "dmutex[mysql]") from None
    options = mysql_options(address.url, timeout)
    errors = (pymysql.err.MySQLError, OSError)
    try:
        # Any: connect() takes its options as keywords of many types.
        args: dict[str, Any] = options
        conn = pymysql.connect(**args)
    except errors as error:
        text = scrubbed(one_line(error), address.url)
        raise Unreachable(f"cannot connect to {address.shown}: {text}") from None
    send = conn.query

    def query(sql: str | bytes, unbuffered: bool = False) -> int:
        """A query, on the connection opened again if a failure closed it (rule 2)."""
        if not conn.open:
            conn.connect()
        return send(sql, unbuffered)

    # The instance's own attribute: every cursor's statement goes through it.
    vars(conn)["query"] = query
    return Connection(address, conn, errors, closer=conn.close)


FORM = URLForm(
    schemes=("mysql", "mariadb"),
    shown=("mysql://", "mariadb://"),
    help=(
        "mysql://USER:PASSWORD@HOST:PORT/DATABASE or mariadb://... (the tables' database, "
        "required; ?unix_socket=PATH, ?ssl_ca=PATH)"
    ),
    listing="MySQL: one query with LIMIT",
    parse=_parse,
    connect=_connect,
)
"""``mysql://`` and ``mariadb://`` URLs."""

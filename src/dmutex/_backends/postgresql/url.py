"""PostgreSQL's URL for the ``dmutex`` command: ``postgresql://`` or ``postgres://``, libpq's.

Rules:

1. The command reads one query parameter itself, ``schema=NAME``: the
   schema of the lock tables (the library's ``schema_name``), checked by
   the parse; every other parameter is libpq's, and libpq's URL parser
   (psycopg's ``conninfo_to_dict``, no I/O) refuses what it does not know.
   A port out of 1-65535 is refused there too, and the parameters libpq
   checks only as it connects (``sslmode``, ``gssencmode``,
   ``target_session_attrs`` and the whole-number ones) are checked first.
   libpq's messages may quote the URL back: the URL's password is cut from
   them.
2. Requests are bounded where libpq can bound them: ``connect_timeout``
   (at most 5 s) and ``tcp_user_timeout`` (the request timeout) are set
   unless the URL (or ``PGCONNECT_TIMEOUT``) names them;
   ``fallback_application_name`` is ``dmutex``.
3. One connection is opened first, in autocommit: libpq's own message says
   why a server cannot be reached. A client that waits (``run``) then gets
   a ``psycopg_pool.ConnectionPool`` of two connections (:data:`POOL_SIZE`):
   the renewer thread and the release never wait for each other, and a
   waiter ``LISTEN``s on one of them, so it wakes on the holder's release.
   Without ``psycopg_pool``, it keeps the one connection, shared by the
   threads, and its waits poll.

Caveat: a server that accepts a request and never answers it (a paused
server) holds it until it answers: libpq has no reply timeout. ``run``
still stops the command by the lease's deadline, which does not wait for a
renewal to answer.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from urllib.parse import unquote

from ..._errors import InvalidArgumentError
from ..address import (
    Address,
    BadURL,
    Connection,
    LockOptions,
    Unreachable,
    URLForm,
    missing,
    one_line,
    redact,
    scrubbed,
)
from .names import check_postgres_schema

__all__ = ["FORM", "POOL_SIZE", "SCHEMA_PARAM", "postgres_timeouts"]

SCHEMA_PARAM = "schema"  # the query parameter the command reads itself (rule 1)
POOL_SIZE = 2  # a waiter may LISTEN on half of it (listening.py, rule 1)


def _parse(url: str) -> Address:
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
            raise BadURL(f"{SCHEMA_PARAM}= is given twice in {shown}")
        schema = unquote(value)
        try:
            check_postgres_schema(schema, f"the {SCHEMA_PARAM}= parameter of {shown}")
        except InvalidArgumentError as error:
            raise BadURL(one_line(error)) from None
    scheme, _, rest = head.partition(":")
    head = f"{scheme.lower()}:{rest}"  # libpq knows its schemes in lower case only
    libpq = f"{head}?{'&'.join(kept)}" if kept else head
    options = LockOptions() if schema is None else LockOptions(schema_name=schema)
    return Address("postgresql", libpq, shown, options=options)


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


# libpq parameters whose values it checks only when it connects (then the
# command would say the server is unreachable): checked first (rule 1).
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


def _connect(address: Address, timeout: float, waits: bool) -> Connection:
    """One connection, or for a client that waits a pool of two (rule 3)."""
    try:
        import psycopg
        import psycopg.conninfo
    except ImportError:
        raise missing(address, "psycopg", "dmutex[postgresql]") from None
    try:
        found = psycopg.conninfo.conninfo_to_dict(address.url)
    except psycopg.Error as error:
        text = scrubbed(one_line(error), address.url)
        raise BadURL(f"bad PostgreSQL URL {address.shown}: {text}") from None
    params = {name: str(value) for name, value in found.items() if value is not None}
    port = _ports(params)
    if port is not None:
        raise BadURL(f"bad PostgreSQL URL {address.shown}: port {port!r} is not 1-65535")
    wrong = _libpq_value(params)
    if wrong is not None:
        raise BadURL(f"bad PostgreSQL URL {address.shown}: {wrong}")
    conninfo = psycopg.conninfo.make_conninfo(
        address.url, **postgres_timeouts(params, timeout, os.environ)
    )
    errors = (psycopg.Error, OSError)
    options = address.options
    try:
        first = psycopg.connect(conninfo, autocommit=True)
    except errors as error:
        text = scrubbed(one_line(error), address.url)
        raise Unreachable(f"cannot connect to {address.shown}: {text}") from None
    if not waits:
        return Connection(address, first, errors, closer=first.close, options=options)
    try:
        import psycopg_pool
    except ImportError:  # one connection, shared by the threads: waits poll (rule 3)
        return Connection(address, first, errors, closer=first.close, options=options)
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
        text = scrubbed(one_line(error), address.url)
        raise Unreachable(f"cannot connect to {address.shown}: {text}") from None
    return Connection(
        address, pool, errors, closer=lambda: pool.close(timeout=1.0), options=options
    )


FORM = URLForm(
    schemes=("postgresql", "postgres"),
    shown=("postgresql://", "postgres://"),
    help=(
        "postgresql://... or postgres://... (?schema=NAME: the tables' schema; other "
        "parameters go to libpq)"
    ),
    listing="PostgreSQL: one query with LIMIT",
    parse=_parse,
    connect=_connect,
)
"""``postgresql://`` and ``postgres://`` URLs."""

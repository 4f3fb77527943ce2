"""Backend URLs: from ``--backend`` (or the default SQLite file) to a connected client.

Guarantee: :func:`parse` does no I/O and refuses a malformed URL with a
:class:`~dmutex._cli.errors.Failure` of status 64; :func:`connect` imports a
client package only for its own scheme, and turns a missing package, or a
server or file that cannot be opened, into status 69 (naming the extra to
install). Every URL shown to the user is redacted: a password never reaches
stderr.

Each backend's URL rules (its schemes, what it checks, its timeouts, how
it connects) are the backend's own, in ``dmutex._backends.<name>.url``;
this module only finds the backend by the scheme and turns its refusals
into exit statuses.
"""

from __future__ import annotations

from collections.abc import Mapping

from .._backends import connect_url, default_address, parse_url
from .._backends.address import Address, BadURL, Connection, Unreachable
from .errors import UNAVAILABLE, USAGE, Failure

__all__ = ["Address", "Connection", "connect", "parse"]


def parse(url: str | None, env: Mapping[str, str]) -> Address:
    """Check ``url`` (None or empty: the default file) without I/O; status 64 if malformed."""
    try:
        return default_address(env) if not url else parse_url(url)
    except BadURL as error:
        raise Failure(USAGE, str(error)) from None


def connect(address: Address, *, timeout: float, waits: bool = False) -> Connection:
    """A client for ``address``; network clients time out requests after ``timeout`` seconds.

    Raises :class:`Failure`: 64 for a URL the client package refuses, 69 for a
    missing package or a backend that cannot be opened. Some clients connect
    on first use, so an unreachable server surfaces at the first request.
    ``waits``: the client will wait for locks, from more than one thread.
    """
    try:
        return connect_url(address, timeout, waits=waits)
    except BadURL as error:
        raise Failure(USAGE, str(error)) from None
    except Unreachable as error:
        raise Failure(UNAVAILABLE, str(error)) from None

"""A backend's URL, as the ``dmutex`` command takes it: what every backend's ``url.py`` shares.

Rules:

1. A backend that the command can reach has a ``url.py`` holding its
   :class:`URLForm`, ``FORM``, which its descriptor carries. The schemes
   of the forms never overlap; the registry finds a URL's form by its
   scheme, in lower case.
2. ``parse`` does no I/O and imports no client package: a malformed URL is
   :class:`BadURL` (the command's status 64). ``connect`` imports its
   client package (missing: :class:`Unreachable` naming the extra to
   install) and opens a client; a URL the package refuses is
   :class:`BadURL`, a server or file it cannot open :class:`Unreachable`
   (status 69).
3. No message carries a password: an :class:`Address` shows itself
   :func:`redact`-ed, and a client's message that may quote the URL back is
   :func:`scrubbed` of it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:  # the hub imports every backend package, whose descriptors import this
    from .clients import SyncClient

__all__ = [
    "Address",
    "BadURL",
    "Connection",
    "LockOptions",
    "URLForm",
    "Unreachable",
    "missing",
    "one_line",
    "redact",
    "scrubbed",
]


class BadURL(Exception):
    """A URL refused as malformed, before any I/O: the command's usage error."""


class Unreachable(Exception):
    """A URL's backend that cannot be opened: a missing package, a server or file out of reach."""


class LockOptions(TypedDict, total=False):
    """The options of the library's locks that a URL sets (a database, a schema)."""

    db_name: str
    schema_name: str


@dataclass(frozen=True)
class Address:
    """A parsed backend URL: whose it is, how to show it, and what it sets."""

    backend: str
    """The name of the backend's descriptor."""
    url: str
    """The URL as its client takes it (less what the command reads itself). Never show it."""
    shown: str
    """The URL with any password hidden, for messages."""
    path: Path | None = None
    """A backend that keeps its locks in a local file: that file."""
    default: bool = False
    """The command's default file, whose directory is created on first use."""
    options: LockOptions = field(default_factory=lambda: LockOptions())
    """The lock options the URL itself sets."""


@dataclass
class Connection:
    """A client opened for one :class:`Address`, the errors it raises, and how to close it."""

    address: Address
    client: SyncClient
    errors: tuple[type[BaseException], ...]
    """The client package's own exceptions: any of them means the backend failed a request."""
    closer: Callable[[], None] = field(default=lambda: None)
    options: LockOptions = field(default_factory=lambda: LockOptions())
    """The lock options of the URL and of what opening found (MongoDB: the URL's database)."""

    def close(self) -> None:
        """Close the client; a failure to close is not worth a message."""
        with contextlib.suppress(Exception):  # the process is ending: nothing to recover
            self.closer()


@dataclass(frozen=True, slots=True)
class URLForm:
    """How one backend's URLs are written, checked and opened (rule 1).

    ``schemes``: the URL schemes, lower case. ``shown``: how the command's
    error for an unknown scheme writes them; ``help``: how ``--help`` does.
    ``parse(url)``: an :class:`Address`, no I/O (rule 2).
    ``connect(address, timeout, waits)``: a :class:`Connection` whose
    requests time out after ``timeout`` seconds where the client can bound
    them; ``waits``: the client will wait for locks from more than one
    thread. ``listing``: how ``dmutex status`` without a key finds the held
    keys, for its ``--help``. ``default``: the command's default address
    from its environment, for the one backend that has one.
    """

    schemes: tuple[str, ...]
    shown: tuple[str, ...]
    help: str
    parse: Callable[[str], Address]
    connect: Callable[[Address, float, bool], Connection]
    listing: str
    default: Callable[[Mapping[str, str]], Address] | None = None
    default_help: str = ""


def one_line(error: BaseException) -> str:
    """An exception as one line of text: its type when it says nothing, newlines folded."""
    text = " ".join(str(error).split())
    return text or type(error).__name__


# userinfo "user:password@" in the authority of scheme://authority/...
_USERINFO = re.compile(
    r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/?#@:]*):(?P<secret>[^/?#]*)@"
)
_SECRET_PARAM = re.compile(r"(?i)([?&](?:password|pass|pwd)=)(?P<secret>[^&#]*)")


def redact(url: str) -> str:
    """``url`` with any password (in the userinfo or a ``password=`` parameter) as ``***``."""
    shown = _USERINFO.sub(r"\g<head>\g<user>:***@", url, count=1)
    return _SECRET_PARAM.sub(r"\1***", shown)


def scrubbed(text: str, url: str) -> str:
    """``text`` without any password of ``url``: a client may quote a malformed URL back."""
    found = [_USERINFO.search(url), *_SECRET_PARAM.finditer(url)]
    for secret in (match.group("secret") for match in found if match is not None):
        if secret:
            text = text.replace(secret, "***")
    return text


def missing(address: Address, package: str, extra: str) -> Unreachable:
    """The error for a client package that is not installed, naming the extra that brings it."""
    scheme = address.url.partition(":")[0]
    return Unreachable(f"the {scheme}: backend needs the {package} package: pip install '{extra}'")

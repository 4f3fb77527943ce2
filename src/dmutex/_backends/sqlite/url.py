"""SQLite's URL for the ``dmutex`` command: a local file, or the per-user default.

Rules:

1. ``sqlite:`` URLs follow ``file:`` URLs, not SQLAlchemy's:
   ``sqlite:///var/x.db`` is the absolute path ``/var/x.db``,
   ``sqlite:////var/x.db`` (SQLAlchemy's absolute form) the same file, and a
   relative path is written ``sqlite:x.db``. A host, a query or a fragment
   is refused.
2. The default file is ``$XDG_STATE_HOME/dmutex/locks.sqlite3``, else
   ``~/.local/state/dmutex/locks.sqlite3`` (a relative ``XDG_STATE_HOME``
   is ignored, as the XDG spec says); the directories it needs are created
   on first use, each with mode 0o700 (less the umask).
3. The file's busy wait is the request timeout: a file another process
   keeps busy longer fails the request, as a server that does not answer.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ..._errors import InvalidArgumentError
from ..address import Address, BadURL, Connection, Unreachable, URLForm, one_line
from .backend import SQLiteBackend

__all__ = ["FORM", "default_path", "make_private_dirs"]


def default_path(env: Mapping[str, str]) -> Path:
    """The per-user lock file (rule 2)."""
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


def _default(env: Mapping[str, str]) -> Address:
    path = default_path(env)
    return Address("sqlite", f"sqlite://{path}", f"sqlite://{path}", path, default=True)


def _parse(url: str) -> Address:
    """The file of a ``sqlite:`` URL (rule 1)."""
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise BadURL(f"a sqlite: URL takes no query or fragment: {url!r}")
    if parts.netloc:
        raise BadURL(
            f"a sqlite: URL names a local file, not a host: {url!r} "
            "(write sqlite:///ABSOLUTE/PATH or sqlite:RELATIVE/PATH)"
        )
    path = unquote(parts.path)
    if not path:
        raise BadURL(f"a sqlite: URL needs a file path: {url!r}")
    if path.startswith("//"):  # sqlite:////abs, SQLAlchemy's absolute form: the same file
        path = "/" + path.lstrip("/")
    return Address("sqlite", url, url, Path(path))


def _connect(address: Address, timeout: float, waits: bool) -> Connection:
    """The file opened, in WAL mode (rule 3); the default file's directories made (rule 2)."""
    assert address.path is not None  # _parse and _default set it
    try:
        if address.default:
            make_private_dirs(address.path.parent)
        client = SQLiteBackend(address.path, timeout=timeout)
    except (InvalidArgumentError, OSError, sqlite3.Error) as error:
        raise Unreachable(f"cannot open {address.shown}: {one_line(error)}") from None
    return Connection(address, client, (sqlite3.Error, OSError), closer=client.close)


FORM = URLForm(
    schemes=("sqlite",),
    shown=("sqlite:///PATH",),
    help="sqlite:///PATH",
    listing="SQLite: one query with LIMIT",
    parse=_parse,
    connect=_connect,
    default=_default,
    default_help=(
        "the SQLite file $XDG_STATE_HOME/dmutex/locks.sqlite3, else "
        "~/.local/state/dmutex/locks.sqlite3"
    ),
)
"""``sqlite:`` URLs, and the command's default file."""

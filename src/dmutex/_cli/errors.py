"""Exit statuses of the ``dmutex`` command, and the error that carries one to ``main()``.

The numbers follow ``sysexits.h`` and the shell, as ``flock(1)`` does: a
script can tell "held" from "broken" from "the command failed". A client's
own error while the command uses the backend is status 69
(:func:`backend_errors`), for ``run`` and ``status`` alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .._backends.address import one_line

if TYPE_CHECKING:
    from .urls import Connection

__all__ = [
    "BROKEN",
    "CONFLICT",
    "FREE",
    "LOST",
    "NOT_EXECUTABLE",
    "NOT_FOUND",
    "OK",
    "UNAVAILABLE",
    "USAGE",
    "Failure",
    "backend_errors",
    "one_line",
]

OK = 0
FREE = 1  # dmutex status: nobody holds the key
USAGE = 64  # EX_USAGE: bad arguments or a bad backend URL
UNAVAILABLE = 69  # EX_UNAVAILABLE: the backend cannot be reached or used
LOST = 70  # EX_SOFTWARE: the lease was lost while the command ran
BROKEN = 70  # EX_SOFTWARE: dmutex status failed in a way it does not know (a bug)
CONFLICT = 75  # EX_TEMPFAIL: the lock was held (or the wait ran out); -E changes it
NOT_EXECUTABLE = 126  # the shell's "found but cannot execute"
NOT_FOUND = 127  # the shell's "command not found"


class Failure(Exception):
    """An exit status with the one line that ``main()`` prints on stderr before exiting.

    ``message`` may be empty: the status says it all (a conflict without ``-v``).
    """

    def __init__(self, status: int, message: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@contextlib.contextmanager
def backend_errors(backend: Connection) -> Iterator[None]:
    """Turn the client's own errors into status 69, naming the backend (password hidden)."""
    try:
        yield
    except backend.errors as error:
        raise Failure(
            UNAVAILABLE, f"cannot use the backend {backend.address.shown}: {one_line(error)}"
        ) from None

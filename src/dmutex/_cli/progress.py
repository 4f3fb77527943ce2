"""What ``dmutex run -v`` says on stderr while it waits, takes and releases a lock.

Guarantee: quiet without ``-v``. With it, a waiting line names the holders
(shortened tokens, slots, time left on each lease) and the time waited; on a
terminal it is rewritten in place about four times a second, elsewhere
(a log file, a pipe) a plain line is printed at most once a second.

Caveats: the holders are read with a separate request between attempts, so
they are what the backend held a moment ago; a backend dmutex cannot
inspect shows the time waited only.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import TextIO

from .errors import one_line
from .holders import Inspection

__all__ = ["Progress", "describe_holders", "short_token", "token_prefix"]

TOKEN_SHOWN = 8  # characters of a token shown: enough to tell holders apart, never the whole


def token_prefix(token: str) -> str:
    """The first characters of a token: 8, or half of a short one; never the whole token."""
    return token[: min(TOKEN_SHOWN, len(token) // 2)]


def short_token(token: str) -> str:
    """:func:`token_prefix` and an ellipsis, for text meant to be read."""
    return f"{token_prefix(token)}..."


def describe_holders(found: Inspection, limit: int) -> str:
    """``held by 3f2a9c1e..., 41.3 s left`` (a semaphore: per slot), or ``free``."""
    if not found.holders:
        return "free"
    if limit == 1:
        (only, *_) = found.holders
        return (
            f"held by {short_token(only.token)}, {_left(only.expires_ms, found.now_ms):.1f} s left"
        )
    shown = [
        f"slot {h.slot} {short_token(h.token)} {_left(h.expires_ms, found.now_ms):.1f} s left"
        for h in found.holders[:3]
    ]
    more = len(found.holders) - len(shown)
    tail = f", {more} more" if more > 0 else ""
    return f"{len(found.holders)} of {limit} permits held: {', '.join(shown)}{tail}"


def _left(expires_ms: int, now_ms: int) -> float:
    return max(0, expires_ms - now_ms) / 1000


class Progress:
    """The verbose output of one ``dmutex run``; every method is a no-op without ``-v``."""

    def __init__(
        self,
        stream: TextIO,
        *,
        verbose: bool,
        key: str,
        limit: int,
        wait: float | None,
        inspect: Callable[[], Inspection],
    ) -> None:
        self._stream = stream
        self._verbose = verbose
        self._key = key
        self._limit = limit
        self._wait = wait
        self._inspect = inspect
        self._tty = verbose and _isatty(stream)
        self._open_line = False  # an in-place line is on screen, not yet ended
        self._inspect_failed = False

    @property
    def every(self) -> float:
        """Seconds between waiting lines: the longest attempt chunk the waiter should use."""
        if not self._verbose:
            return 60.0
        return 0.25 if self._tty else 1.0

    def say(self, text: str) -> None:
        """One line ``dmutex: text`` (verbose only), after ending any in-place line."""
        if self._verbose:
            self._end_line()
            self._write(f"dmutex: {text}\n")

    def waiting(self, waited: float) -> None:
        """Show what the wait is for, ``waited`` seconds in."""
        if not self._verbose:
            return
        parts = [f"dmutex: waiting for {self._key!r}"]
        holders = self._holders()
        if holders:
            parts.append(f": {holders}")
        bound = f" of {self._wait:g}" if self._wait is not None else ""
        parts.append(f"; waited {waited:.1f}{bound} s")
        line = "".join(parts)
        if self._tty:
            width = shutil.get_terminal_size((80, 24)).columns
            if len(line) >= width:
                line = line[: max(10, width - 4)] + "..."
            self._write(f"\r{line}\x1b[K")
            self._open_line = True
        else:
            self._write(line + "\n")

    def done(self) -> None:
        """End an in-place line, so that what follows starts on a line of its own."""
        self._end_line()

    def _holders(self) -> str:
        if self._inspect_failed:
            return ""
        try:
            return describe_holders(self._inspect(), self._limit)
        except Exception as error:  # noqa: BLE001 - the wait goes on; say once why holders are not shown
            self._inspect_failed = True
            return f"(cannot read the holders: {one_line(error)})"

    def _end_line(self) -> None:
        if self._open_line:
            self._write("\n")
            self._open_line = False

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):  # stderr closed: progress is not worth failing for
            pass


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (OSError, ValueError):
        return False

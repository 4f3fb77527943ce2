"""What ``dmutex run -v`` says on stderr while it waits, takes and releases a lock.

Guarantee: quiet without ``-v``. With it, a waiting line names the holders
(shortened tokens, slots or a read-write lock's writer and readers, time
left on each lease) and the time waited; on a terminal it is rewritten in
place about four times a second, elsewhere (a log file, a pipe) a plain
line is printed at most once a second.

The waiting lines come from a thread of their own (:meth:`Progress.ticking`)
while the waiter makes one long library call: a waiting writer's intent,
which keeps new readers out, lasts from its call's first attempt to its
last, and a call cut short to print a line would let readers in at each cut.

Caveats: the holders are read with a separate request (from that thread,
on the same client, as renewals are), so they are what the backend held a
moment ago; a backend dmutex cannot inspect shows the time waited only. A
read-write lock's waiting writers are not shown: a reader that waits while
nothing is held waits behind one.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from .._core.stamps import token_prefix
from .errors import one_line
from .holders import Inspection, Role, role_of

__all__ = ["Progress", "describe_holders", "short_token", "token_prefix"]


def short_token(token: str) -> str:
    """:func:`token_prefix` and an ellipsis, for text meant to be read."""
    return f"{token_prefix(token)}..."


def describe_holders(found: Inspection, limit: int, role: Role | None = None) -> str:
    """``held by 3f2a9c1e..., 41.3 s left`` (a semaphore: per slot), or ``free``.

    ``role``: the waiter's hold of a read-write lock, whose holders are
    described by theirs.
    """
    if role is not None:
        return _describe_readwrite(found, role)
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


def _describe_readwrite(found: Inspection, role: Role) -> str:
    """``held by the writer 3f2a9c1e..., 41.3 s left``, or ``2 readers: ...``."""
    if not found.holders:
        # Only a waiting writer's intent, which holders do not show, keeps a reader out.
        return "no holder; a waiting writer goes first" if role == "read" else "free"
    (first, *_) = found.holders
    if role_of(first) == "write":
        left = _left(first.expires_ms, found.now_ms)
        return f"held by the writer {short_token(first.token)}, {left:.1f} s left"
    shown = [
        f"{short_token(h.token)} {_left(h.expires_ms, found.now_ms):.1f} s left"
        for h in found.holders[:3]
    ]
    more = len(found.holders) - len(shown)
    tail = f", {more} more" if more > 0 else ""
    count = len(found.holders)
    return f"{count} reader{'s' if count > 1 else ''}: {', '.join(shown)}{tail}"


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
        role: Role | None = None,
    ) -> None:
        self._stream = stream
        self._verbose = verbose
        self._key = key
        self._limit = limit
        self._wait = wait
        self._inspect = inspect
        self._role = role
        self._tty = verbose and _isatty(stream)
        self._open_line = False  # an in-place line is on screen, not yet ended
        self._inspect_failed = False
        # The ticking thread and the main thread both write: one line at a time,
        # and none from the thread once its ticking has ended.
        self._writing = threading.Lock()
        self._ticking_over = threading.Event()

    @property
    def every(self) -> float:
        """Seconds between waiting lines."""
        return 0.25 if self._tty else 1.0

    @contextlib.contextmanager
    def ticking(self, started: float) -> Iterator[None]:
        """Show a waiting line now and every :attr:`every` seconds until the block ends.

        ``started``: when the wait began, on the monotonic clock. The lines
        come from a daemon thread; once the block ends it writes nothing
        more, even if a holders' request of its is still under way (it is
        not waited for: the request may take the request timeout).
        """
        if not self._verbose:
            yield
            return
        stop = threading.Event()

        def tick() -> None:
            while not stop.is_set():
                self.waiting(time.monotonic() - started)
                stop.wait(self.every)

        self._ticking_over.clear()
        thread = threading.Thread(target=tick, name="dmutex-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            with self._writing:
                self._ticking_over.set()

    def say(self, text: str) -> None:
        """One line ``dmutex: text`` (verbose only), after ending any in-place line."""
        if self._verbose:
            with self._writing:
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
        with self._writing:
            if self._ticking_over.is_set():  # the wait ended while the holders were read
                return
            if self._tty:
                self._write(f"\r{line}\x1b[K")
                self._open_line = True
            else:
                self._write(line + "\n")

    def done(self) -> None:
        """End an in-place line, so that what follows starts on a line of its own."""
        with self._writing:
            self._end_line()

    def _holders(self) -> str:
        if self._inspect_failed:
            return ""
        try:
            return describe_holders(self._inspect(), self._limit, self._role)
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

"""The child process under a held lease: signals, lease loss, and its exit status.

Guarantee: :func:`supervise` returns only after the child has ended. SIGINT,
SIGTERM and SIGHUP that reach ``dmutex`` are passed on to the child (see
:class:`Signals` for the one exception). The child is stopped before the
lease can lapse: it gets SIGTERM ``kill_grace`` seconds before the lease's
deadline (``time_left`` of the handle: the holder's own clock, so a renewal
that hangs delays nothing) or as soon as the lease is found lost, and
SIGKILL ``kill_grace`` seconds later or at the deadline, whichever comes
first; the result is then :data:`~dmutex._cli.errors.LOST`. Otherwise it is
the child's exit status, 128+N if signal N ended it.

Caveats: POSIX only (signals, process groups). The child runs in
``dmutex``'s own process group, as under ``flock(1)``, so that it stays in
the terminal's foreground and can read from it; a ``dmutex`` killed with
SIGKILL cannot stop its child, which then runs on while the lease lapses
within one TTL. File descriptors ``dmutex`` inherited are passed on to
the child (as ``flock(1)`` does); dmutex's own are close-on-exec.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType

from .errors import LOST, NOT_EXECUTABLE, NOT_FOUND, Failure

__all__ = ["FORWARDED", "Interrupted", "Signals", "exit_status", "supervise"]

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """A forwarded signal arrived while no child ran: ``dmutex`` stops with 128+N.

    A ``BaseException``, like ``KeyboardInterrupt``, so that no ``except
    Exception`` on the way swallows it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _in_terminal_foreground() -> bool:
    """Whether this process's group is the foreground group of its controlling terminal."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:  # no controlling terminal
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


class Signals:
    """The handlers of :data:`FORWARDED` for one ``dmutex run``, from start to exit.

    Three phases: while the lock is awaited a signal raises
    :class:`Interrupted`; once it is held and before the child starts, a
    signal is recorded (:attr:`received`) and the child is not started; with
    the child running it is forwarded. One exception: a SIGINT is not
    forwarded while ``dmutex`` is in its terminal's foreground process
    group, because the terminal sent that Ctrl-C to the whole group, the
    child included, and a second copy would read as a second Ctrl-C.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self._child: subprocess.Popen[bytes] | None = None
        self._raising = True
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """Take over :data:`FORWARDED` (in the main thread); :meth:`restore` gives them back."""
        for signum in FORWARDED:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        """Put back the handlers that :meth:`install` replaced."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]  # what signal() returned
        self._previous.clear()

    def held(self) -> None:
        """The lock is held: from now on a signal is recorded, then forwarded, not raised."""
        self._raising = False

    def attach(self, child: subprocess.Popen[bytes]) -> None:
        """Forward to ``child`` from now on, first any signal recorded since :meth:`held`."""
        self._child = child
        for signum in self.received:
            self._forward(signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._raising:
            raise Interrupted(signum)
        self.received.append(signum)
        if self._child is not None:
            self._forward(signum)

    def _forward(self, signum: int) -> None:
        child = self._child
        if child is None or child.returncode is not None:
            return
        if signum == signal.SIGINT and _in_terminal_foreground():
            return  # the terminal sent it to the child too
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            child.send_signal(signum)


def exit_status(returncode: int) -> int:
    """A child's exit status as a shell shows it: 128+N for "killed by signal N"."""
    return 128 - returncode if returncode < 0 else returncode


def start(command: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Start ``command`` (no shell); a command that cannot run raises Failure 127 or 126."""
    try:
        return subprocess.Popen(list(command), env=dict(env), close_fds=False)
    except FileNotFoundError:
        raise Failure(NOT_FOUND, f"{command[0]}: command not found") from None
    except PermissionError:
        raise Failure(NOT_EXECUTABLE, f"{command[0]}: permission denied") from None
    except OSError as error:  # exec format error, not a directory, too long...
        reason = error.strerror or str(error)
        raise Failure(NOT_EXECUTABLE, f"{command[0]}: cannot execute: {reason}") from None


def supervise(
    child: subprocess.Popen[bytes],
    lost: threading.Event,
    wake: threading.Event,
    *,
    kill_grace: float,
    time_left: Callable[[], float],
    on_lost: Callable[[float], None],
) -> int:
    """Wait for ``child`` to end; stop it before the lease can lapse. Returns the exit status.

    ``time_left()`` is the seconds until the lease's deadline (0 once
    lost). ``wake`` is set by whoever sets ``lost`` (the renewal thread); a
    thread of this function sets it when the child ends. ``on_lost(left)``
    is called once, before the child is sent SIGTERM, with the seconds left
    until the deadline (0 if the lease was found lost).
    """
    ended = threading.Event()

    def reap() -> None:
        child.wait()
        ended.set()
        wake.set()

    threading.Thread(target=reap, name="dmutex-child", daemon=True).start()
    kill_at: float | None = None
    killed = False
    deadline = time.monotonic() + time_left()
    while True:
        # Cleared before the checks, so a set() after them wakes the wait below.
        wake.clear()
        if ended.is_set():
            break
        now = time.monotonic()
        timeout: float | None = None
        if kill_at is None:
            left = 0.0 if lost.is_set() else time_left()
            if left > 0:
                deadline = now + left  # moves on with each answered renewal
            if left <= kill_grace:
                on_lost(left)
                # SIGKILL by the deadline, even when the loss came earlier.
                kill_at = min(now + kill_grace, max(now, deadline))
                _send(child, signal.SIGTERM)
            else:
                timeout = left - kill_grace
        if kill_at is not None and not killed:
            timeout = kill_at - time.monotonic()
            if timeout <= 0:
                _send(child, signal.SIGKILL)
                killed = True
                timeout = None
        wake.wait(timeout)
    returncode = child.returncode
    assert returncode is not None  # reap() set ended after wait() returned
    return LOST if kill_at is not None else exit_status(returncode)


def _send(child: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
        child.send_signal(signum)

"""The child process under a held lease: signals, lease loss, and its exit status.

Guarantee: :func:`supervise` returns only after the child has ended. SIGINT,
SIGTERM and SIGHUP that reach ``dmutex`` are passed on to the child (see
:class:`Signals` for the one exception). The child is stopped before the
lease can lapse: it gets SIGTERM ``kill_grace`` seconds before the lease's
deadline (``time_left`` of the handle: the holder's own clock, so a renewal
that hangs delays nothing) or as soon as the lease is found lost, and
SIGKILL ``kill_grace`` seconds later or at the deadline, whichever comes
first; the result is then :data:`~dmutex._cli.errors.LOST`. Otherwise it is
the child's exit status, 128+N if signal N ended it. Those signals go to
the child and what it started (:class:`~dmutex._cli.watchdog.Command`).

The same holds when ``dmutex`` itself is killed, stopped or starved: a
:class:`Watchdog` process, told the deadline as renewals move it, stops the
command by that deadline (the rules are in :mod:`dmutex._cli.watchdog`).

:func:`guard` runs a command under a held lease, the watchdog and
:func:`supervise` included: ``dmutex run`` once, ``dmutex lead`` once per
term. :func:`holder_identity` is who their leases say holds them.

Caveats: POSIX only (signals, process groups). When ``dmutex`` is in its
terminal's foreground, the child stays in ``dmutex``'s process group, as
under ``flock(1)``, so that it can read from the terminal and gets Ctrl-C;
otherwise (a script, a service, a background job) it runs in the
watchdog's group. File descriptors ``dmutex`` inherited are passed on to
the child (as ``flock(1)`` does); dmutex's own are close-on-exec.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any, Protocol, TextIO

from .._core.stamps import default_identity
from .errors import BROKEN, LOST, NOT_EXECUTABLE, NOT_FOUND, Failure
from .watchdog import Command

__all__ = [
    "FORWARDED",
    "Interrupted",
    "Lease",
    "Signals",
    "Watchdog",
    "exit_status",
    "guard",
    "holder_identity",
    "say",
    "start",
    "supervise",
]

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

    def released(self) -> None:
        """The lock is no longer held (``dmutex lead`` campaigns again): a signal raises again.

        One recorded since :meth:`held` raises :class:`Interrupted` now; the
        child that was attached is forgotten.
        """
        self._child = None
        self._raising = True
        if self.received:
            raise Interrupted(self.received[0])

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


def _spawn(
    argv: Sequence[str], env: Mapping[str, str], group: int | None
) -> subprocess.Popen[bytes]:
    """``Popen(argv)`` with every inherited descriptor, in process ``group`` if given."""
    if group is None:
        return subprocess.Popen(list(argv), env=dict(env), close_fds=False)
    if sys.version_info >= (3, 11):
        return subprocess.Popen(list(argv), env=dict(env), close_fds=False, process_group=group)
    # 3.10 has no process_group: setpgid between fork and exec, a bare system call.
    return subprocess.Popen(  # pragma: no cover - 3.10
        list(argv), env=dict(env), close_fds=False, preexec_fn=lambda: os.setpgid(0, group)
    )


def start(
    command: Sequence[str], env: Mapping[str, str], group: int | None = None
) -> subprocess.Popen[bytes]:
    """Start ``command`` (no shell), in process ``group`` if given.

    A command that cannot run raises Failure 127 or 126.
    """
    try:
        return _spawn(command, env, group)
    except FileNotFoundError:
        raise Failure(NOT_FOUND, f"{command[0]}: command not found") from None
    except PermissionError:
        raise Failure(NOT_EXECUTABLE, f"{command[0]}: permission denied") from None
    except OSError as error:  # exec format error, not a directory, too long...
        reason = error.strerror or str(error)
        raise Failure(NOT_EXECUTABLE, f"{command[0]}: cannot execute: {reason}") from None


class Watchdog:
    """dmutex's end of the command's watchdog, a process of its own (:mod:`.watchdog`).

    Guarantee: once started, it stops the command by the last deadline it was
    told, whatever happens to ``dmutex``: killed (it sees its socket close),
    stopped or starved (it keeps time itself). :attr:`group` is the process
    group the command is started in (the watchdog's), or None when
    ``dmutex`` is in its terminal's foreground and the command stays in
    ``dmutex``'s group.

    Caveats: messages are sent without waiting; once the watchdog is gone
    they are dropped, and the command runs on under ``dmutex`` alone.
    """

    def __init__(self, *, grace: float, deadline: float) -> None:
        foreground = _in_terminal_foreground()
        # Message boundaries, and a pidfd beside its message, where the platform has them.
        kind = socket.SOCK_SEQPACKET if sys.platform == "linux" else socket.SOCK_STREAM
        ours, theirs = socket.socketpair(socket.AF_UNIX, kind)
        argv = [sys.executable, "-I", "-S", _WATCHDOG, str(theirs.fileno()), repr(grace)]
        argv.append("tree" if foreground else "group")
        try:
            with theirs:
                os.set_inheritable(theirs.fileno(), True)
                # posix_spawn, not Popen: dmutex need not reap it once it is told "done"
                # (it exits by itself within its start-up), which would cost every run.
                self.pid = os.posix_spawn(
                    sys.executable,
                    argv,
                    os.environ,  # -I: Python ignores its PYTHON* variables, not its loader's
                    file_actions=[
                        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDWR, 0),
                        (os.POSIX_SPAWN_DUP2, 0, 1),
                        (os.POSIX_SPAWN_DUP2, 0, 2),
                    ],
                    setpgroup=0,
                )
        except OSError as error:
            ours.close()
            raise Failure(
                BROKEN, f"cannot start the command's watchdog ({error}): the command did not start"
            ) from None
        self.group = None if foreground else self.pid
        # A watchdog that is stopped too never fills dmutex up: what it cannot take is dropped
        # (a deadline it misses only makes it act earlier).
        ours.setblocking(False)
        self._channel = ours
        self._deadline = deadline
        self._pidfd: int | None = None
        self._closed = False
        self._ended: int | None = None
        self._tell(f"deadline {deadline!r}")

    def watch(self, child: subprocess.Popen[bytes]) -> Command:
        """Tell the watchdog the command; returns what dmutex signals to stop it."""
        command = Command(group=self.group)
        command.pid = child.pid
        with contextlib.suppress(OSError, AttributeError):  # no pidfds: by pid
            self._pidfd = os.pidfd_open(child.pid)
        command.pidfd = self._pidfd
        self._tell(f"child {child.pid}", [] if self._pidfd is None else [self._pidfd])
        return command

    def ended(self) -> int | None:
        """The watchdog's exit status if it has ended (it should not before ``done``), else None."""
        if self._ended is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid != 0:
                    self._ended = os.waitstatus_to_exitcode(status)
        return self._ended

    def deadline(self, deadline: float) -> None:
        """Tell the lease's deadline (``time.monotonic()``) if it moved by a millisecond or more."""
        if abs(deadline - self._deadline) >= 0.001:
            self._deadline = deadline
            self._tell(f"deadline {deadline!r}")

    def stopping(self, kill_at: float) -> None:
        """Tell that dmutex stops the command itself (SIGTERM now), SIGKILL by ``kill_at``."""
        self._deadline = kill_at
        self._tell(f"deadline {kill_at!r}\nstopping")

    def close(self, *, done: bool, wait: float) -> None:
        """Let the watchdog go: it exits (``done``) or stops what is left of the command.

        Not ``done``, waits up to ``wait`` seconds for it to exit, and kills it
        after. Calls after the first do nothing.
        """
        if self._closed:
            return
        self._closed = True
        if done:
            self._tell("done")
        self._channel.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
        if done:
            return  # it exits as it reads "done"; an unreaped pid is gone when dmutex exits
        ends = time.monotonic() + wait
        with contextlib.suppress(ChildProcessError):  # reaped already
            while self.ended() is None:
                if time.monotonic() >= ends:
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
                    return
                time.sleep(0.01)

    def _tell(self, text: str, fds: Sequence[int] = ()) -> None:
        with contextlib.suppress(OSError):  # the watchdog is gone: nothing to tell
            socket.send_fds(self._channel, [f"{text}\n".encode()], list(fds))


_WATCHDOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "watchdog.py")


def supervise(
    child: subprocess.Popen[bytes],
    lost: threading.Event,
    wake: threading.Event,
    *,
    kill_grace: float,
    time_left: Callable[[], float],
    on_lost: Callable[[float], None],
    on_unwatched: Callable[[int], None],
    watchdog: Watchdog,
    command: Command,
    report_every: float,
) -> int:
    """Wait for ``child`` to end; stop it before the lease can lapse. Returns the exit status.

    ``time_left()`` is the seconds until the lease's deadline (0 once
    lost). ``wake`` is set by whoever sets ``lost`` (the renewal thread); a
    thread of this function sets it when the child ends. ``on_lost(left)``
    is called once, before the child is sent SIGTERM, with the seconds left
    until the deadline (0 if the lease was found lost). ``on_unwatched(status)``
    is called once if the watchdog ends before the command. The deadline goes to
    ``watchdog`` at least every ``report_every`` seconds; ``command`` is
    what is signalled. The watchdog is closed before this returns.
    """
    ended = threading.Event()

    def reap() -> None:
        child.wait()
        ended.set()
        wake.set()

    threading.Thread(target=reap, name="dmutex-child", daemon=True).start()
    kill_at: float | None = None
    killed = False
    unwatched = False
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
                watchdog.deadline(deadline)
            if not unwatched and watchdog.ended() is not None:
                unwatched = True
                on_unwatched(watchdog.ended() or 0)
            if left <= kill_grace:
                on_lost(left)
                # SIGKILL by the deadline, even when the loss came earlier.
                kill_at = min(now + kill_grace, max(now, deadline))
                watchdog.stopping(kill_at)
                command.signal(signal.SIGTERM)
            else:
                timeout = min(left - kill_grace, report_every)
        if kill_at is not None and not killed:
            timeout = kill_at - time.monotonic()
            if timeout <= 0:
                command.signal(signal.SIGKILL)
                killed = True
                timeout = None
        wake.wait(timeout)
    returncode = child.returncode
    assert returncode is not None  # reap() set ended after wait() returned
    # Stopped for the lease: the watchdog sweeps up what the command left in its group.
    watchdog.close(done=kill_at is None, wait=kill_grace + 1.0)
    return LOST if kill_at is not None else exit_status(returncode)


def holder_identity(command: Sequence[str]) -> str:
    """``host:pid COMMAND ARG...``: who a lease of ``dmutex run`` or ``dmutex lead`` says holds it.

    ``host:pid`` is ``dmutex``'s own (:func:`~dmutex._core.stamps.default_identity`),
    the command is shell-quoted; a lone surrogate (argv bytes that are not
    UTF-8) is shown as U+FFFD, which the library takes. The token's stamp
    cuts a long one to fit.
    """
    text = f"{default_identity()} {shlex.join(command)}"
    return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)


class Lease(Protocol):
    """What :func:`guard` needs of what it holds: a lock's handle, or a leadership."""

    @property
    def time_left(self) -> float: ...

    def on_lost(self, callback: Callable[[Any], object]) -> None: ...


def guard(
    command: Sequence[str],
    env: Mapping[str, str],
    lease: Lease,
    signals: Signals,
    stderr: TextIO,
    *,
    what: str,
    ttl: float,
    kill_grace: float,
) -> int:
    """Run ``command`` (environment ``env``) while ``lease`` is held; its exit status.

    The command is not started when a signal came since :meth:`Signals.held`
    (128+N) or the lease is lost already (:data:`LOST`); otherwise it runs
    under its watchdog and :func:`supervise`, with the signals forwarded to
    it. ``what`` names the lease in what is said on ``stderr`` ("the lease on
    'job'"); the watchdog hears the deadline every tenth of ``ttl`` (at most
    every second). Raises :class:`Failure` 127 / 126 when the command cannot
    run, 70 when its watchdog cannot start.
    """
    lost = threading.Event()
    wake = threading.Event()

    def found_lost(_: object) -> None:
        lost.set()
        wake.set()

    lease.on_lost(found_lost)
    if signals.received:  # a signal came before the command started: do not start it
        return 128 + signals.received[0]
    if lost.is_set():  # gone already (a stop longer than the TTL): do not start it unprotected
        say(stderr, f"lost {what} before {command[0]} started")
        return LOST
    watchdog = Watchdog(grace=kill_grace, deadline=time.monotonic() + lease.time_left)
    child: subprocess.Popen[bytes] | None = None
    try:
        child = start(command, env, watchdog.group)
        watched = watchdog.watch(child)
        signals.attach(child)
        return supervise(
            child,
            lost,
            wake,
            kill_grace=kill_grace,
            time_left=lambda: lease.time_left,
            on_lost=_stopping(stderr, what, command[0], child.pid, kill_grace),
            on_unwatched=lambda status: say(
                stderr,
                f"the watchdog of {command[0]} ended (status {status}): it runs on "
                "unguarded should dmutex be killed or stopped",
            ),
            watchdog=watchdog,
            command=watched,
            # Often enough that a renewal reaches the watchdog long before its SIGTERM would.
            report_every=min(ttl / 10, 1.0),
        )
    finally:  # supervise() closed it, unless the command did not start or an error came
        watchdog.close(done=child is None or child.poll() is not None, wait=kill_grace + 1.0)


def _stopping(
    stderr: TextIO, what: str, name: str, pid: int, kill_grace: float
) -> Callable[[float], None]:
    """What dmutex says as it stops the command ``name`` (pid ``pid``) for the lease."""

    def stopping(left: float) -> None:
        grace = f"{min(kill_grace, left) if left > 0 else kill_grace:.3g} s"
        why = (
            f"could not renew {what} ({left:.1f} s before it may lapse)"
            if left > 0
            else f"lost {what}"
        )
        say(stderr, f"{why}: stopping {name} (pid {pid}: SIGTERM, SIGKILL after {grace})")

    return stopping


def say(stderr: TextIO, text: str) -> None:
    """One line ``dmutex: text`` on ``stderr``; a closed stream is not worth failing for."""
    try:
        stderr.write(f"dmutex: {text}\n")
        stderr.flush()
    except (OSError, ValueError):
        pass

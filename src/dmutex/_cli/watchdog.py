"""The command's dead man's switch: it stops the command by the lease's deadline when dmutex cannot.

``dmutex run`` starts this file as a process of its own (``python -I -S
watchdog.py FD GRACE MODE``: the standard library only, nothing of dmutex's)
after the lease is taken and before the command starts. The two talk over a
socket (``FD``), one line per message.

Rules:

1. The deadline is a ``time.monotonic()`` reading: ``CLOCK_MONOTONIC``, one
   clock for every process of a Linux host, which runs on while a process is
   stopped. dmutex tells it the lease's deadline (``deadline T``) at start and
   each time a renewal moves it, the command (``child PID``, with a pidfd
   where the platform has one), that it is stopping the command itself
   (``stopping``), and that the command ended (``done``: the watchdog exits).
2. Told nothing more, the watchdog acts by the last deadline it was told:
   SIGTERM at the deadline less GRACE (plus :data:`LAG`, so that a dmutex that
   is alive sends its own first; not after ``stopping``), SIGKILL at the
   deadline. A dmutex that is stopped, starved or hung is thus covered by a
   process that is none of these.
3. dmutex's end of the socket closed without ``done`` (dmutex was killed):
   SIGTERM at once, SIGKILL GRACE seconds later or at the deadline, whichever
   comes first; the watchdog exits as soon as the command is gone.
4. What it signals (:class:`Command`): in ``group`` mode, the process group
   it leads, which the command was started in: the command and everything it
   started that stayed in the group; in ``tree`` mode (dmutex is in its
   terminal's foreground, so the command stays in that group to read the
   terminal), the command by its pidfd, and its descendants found in
   ``/proc`` at each signal.
5. It ignores the signals a terminal, a shell or a signal to a process group
   sends (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGTSTP, SIGTTIN, SIGTTOU): only
   SIGKILL ends it early. Its standard streams are ``/dev/null``, so a pipe
   read from dmutex's output ends when dmutex and the command are done.

Caveats: a whole group stopped together (SIGSTOP of dmutex's group in
``group`` mode, or of the machine, a cgroup freeze) stops the watchdog too;
when it continues past the deadline it kills the command at once, but a
pause is a pause: only a fenced resource refuses what the command sends
late. In ``tree`` mode, a dmutex killed in the microseconds between starting
the command and telling its watchdog leaves the command unwatched. A
process that leaves the group (``setsid``) or, in ``tree`` mode, was
started by a descendant that has ended, is not found. Without ``/proc`` and
pidfds (not Linux), ``tree`` mode signals the command's pid only.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Sequence

__all__ = ["LAG", "Command", "main"]

LAG = 0.1
"""Seconds the watchdog's SIGTERM waits behind the one dmutex would send (at most GRACE/4)."""

POLL = 0.05
"""Seconds between looks for what is left of the command, once dmutex is gone."""

IGNORED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGTSTP", "SIGTTIN", "SIGTTOU")


def _stat(pid: int) -> tuple[int, int, int] | None:
    """``(parent pid, group, start time)`` of a live process, from ``/proc``; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            data = file.read()
    except OSError:
        return None
    # The name (field 2) may hold spaces and parentheses: the fields follow its last ")".
    fields = data[data.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):  # ended, not reaped: it runs nothing
        return None
    return int(fields[1]), int(fields[2]), int(fields[19])


def _table() -> dict[int, tuple[int, int, int]]:
    """Every live process of ``/proc``; empty where there is no ``/proc``."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    table: dict[int, tuple[int, int, int]] = {}
    for name in names:
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None:
                table[int(name)] = stat
    return table


def descendants(pid: int) -> set[tuple[int, int]]:
    """``(pid, start time)`` of every live descendant of ``pid``, from ``/proc``."""
    table = _table()
    children: dict[int, list[int]] = {}
    for each, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(each)
    found: set[tuple[int, int]] = set()
    todo = list(children.get(pid, ()))
    while todo:
        each = todo.pop()
        found.add((each, table[each][2]))
        todo.extend(children.get(each, ()))
    return found


class Command:
    """What is signalled to stop a command: its process group, or its process tree.

    ``group``: the id of a process group the command was started in (its
    leader is the watchdog). Otherwise the command is ``pid`` (``pidfd``,
    where given, names it without the risk of a reused pid) and its
    descendants; those found at one signal are signalled again at the next,
    by pid and start time, even once their parent is gone.
    """

    def __init__(self, *, group: int | None = None) -> None:
        self.group = group
        self.pid: int | None = None
        self.pidfd: int | None = None
        self._seen: set[tuple[int, int]] = set()

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the command and what it started; what is gone is skipped."""
        if self.pid is not None:
            self._seen |= descendants(self.pid)
            self._to_command(signum)
        for pid, started in self._seen:
            stat = _stat(pid)
            if stat is not None and stat[2] == started:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signum)
        if self.group is not None:
            # Last: a SIGKILL to the watchdog's own group ends the watchdog too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.group, signum)

    def gone(self) -> bool:
        """Whether nothing of the command is left to signal (False where that cannot be seen)."""
        if self.group is not None:
            if not os.path.isdir("/proc"):
                return False
            me = os.getpid()
            return not any(g == self.group and p != me for p, (_, g, _) in _table().items())
        if self.pid is not None and self._running():
            return False
        return all(
            (stat := _stat(pid)) is None or stat[2] != started for pid, started in self._seen
        )

    def _to_command(self, signum: int) -> None:
        assert self.pid is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signum)
            else:
                os.kill(self.pid, signum)

    def _running(self) -> bool:
        if self.pidfd is not None:  # readable once the process has ended
            return not select.select([self.pidfd], [], [], 0)[0]
        assert self.pid is not None
        if os.path.isdir("/proc"):
            return _stat(self.pid) is not None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def main(argv: Sequence[str]) -> int:
    """Watch one command; see the rules at the top of this module."""
    fd, grace, mode = int(argv[0]), float(argv[1]), argv[2]
    for name in IGNORED:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    channel = socket.socket(fileno=fd)
    command = Command(group=os.getpgrp() if mode == "group" else None)
    lag = min(LAG, grace / 4)
    deadline = math.inf
    stopping = False
    closed_at: float | None = None
    terminated = False
    pending = b""
    while True:
        now = time.monotonic()
        if closed_at is not None:
            term_at, kill_at = closed_at, min(closed_at + grace, deadline)
        else:
            term_at = math.inf if stopping else deadline - grace + lag
            kill_at = deadline
        if now >= kill_at:
            command.signal(signal.SIGKILL)
            return 0
        if now >= term_at and not terminated:
            command.signal(signal.SIGTERM)
            terminated = True
        if closed_at is not None:
            if command.gone():
                return 0
            select.select([], [], [], min(POLL, kill_at - now))
            continue
        wake = min(kill_at, math.inf if terminated else term_at)
        timeout = None if wake == math.inf else max(0.0, wake - now)
        if not select.select([channel], [], [], timeout)[0]:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(channel, 4096, 1)
        except OSError:  # reset by a peer that died
            data, fds = b"", []
        if not data:
            closed_at = time.monotonic()
            continue
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            word, _, value = line.decode().partition(" ")
            if word == "deadline":
                deadline = float(value)
            elif word == "child":
                command.pid = int(value)
                command.pidfd = fds.pop() if fds else None
            elif word == "stopping":
                stopping = True
            elif word == "done":
                return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

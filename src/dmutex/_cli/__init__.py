"""The ``dmutex`` command: run a command under a lock or as a leader, or show who holds one.

``dmutex run [options] KEY -- COMMAND [ARG...]`` takes the lock KEY (a
semaphore of ``--limit`` permits; with ``--read`` or ``--write``, KEY's
read-write lock as a reader or as the writer), runs COMMAND as a child with
the lease renewed in the background, and releases it when the child ends.
``dmutex status [options] KEY`` shows the active permits (``--read-write``:
the read-write lock's writer or readers); without KEY, every held key of
the service, up to ``--max-keys``. ``dmutex lead [options] NAME -- COMMAND
[ARG...]`` campaigns for the leadership of NAME, runs COMMAND while it
leads, and campaigns again once COMMAND has ended, until signalled: one
host at a time runs COMMAND (its rules: :mod:`dmutex._cli.lead`). See
``dmutex --help``.

The rules of the command:

1. The lock is released before ``dmutex`` exits, whatever ended the child;
   a ``dmutex`` that is killed with SIGKILL leaves it to lapse within one TTL.
2. Exit status: the child's own (128+N if signal N ended it); 75 (``-E``)
   when the lock was not acquired (held with ``-n``, or the ``-w`` wait ran
   out); 64 for usage errors (among them a read-write lock on a backend
   that serves none, found before anything connects); 69 when the backend
   cannot be reached or the client package of its scheme is missing; 70
   after the lease was lost while the child ran (the child got SIGTERM,
   then SIGKILL after ``--kill-grace``); 127 / 126 when COMMAND is not
   found / not executable, as in the shell. ``status``: 0 held, 1 free.
   ``lead`` ends only by a signal (then the child's status, or 128+N when
   no child ran) or by 64, 69 (at its first attempt), 70 (no watchdog),
   127 / 126; a lost leadership stops the child and campaigns again.
3. A failure prints one line on stderr, ``dmutex: ...``, with any password
   in the backend URL hidden; a lock that stayed held prints nothing
   without ``-v``, as ``flock(1)`` does.
4. The default backend is an SQLite file per user
   (``$XDG_STATE_HOME/dmutex/locks.sqlite3``, else
   ``~/.local/state/dmutex/locks.sqlite3``): one host's processes share it.
   The Redis, MongoDB, PostgreSQL and MySQL client packages are imported only for
   their schemes.
5. The layout is the library's: a ``dmutex run`` and a ``DMutex`` (or,
   with ``--limit``, a ``DSemaphore``; with ``--read`` / ``--write``, a
   ``DReadWriteLock``'s readers / writer) of the same service name on the
   same backend guard the same keys.

6. The command never outlives the lease, even when ``dmutex`` is killed or
   stopped: a watchdog process stops it by the deadline
   (:mod:`dmutex._cli.watchdog`), under ``run`` and ``lead`` alike.
7. A lease of ``run`` or ``lead`` says who holds it: ``host:pid`` of
   ``dmutex`` and the command, what ``status`` shows as its holder.

Caveats: POSIX only (signals, process groups). The child stays in
``dmutex``'s process group, as under ``flock(1)``, when ``dmutex`` is in its
terminal's foreground; elsewhere it runs in its watchdog's.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence

from .args import LeadArgs, RunArgs, parse
from .errors import BROKEN, Failure
from .lead import lead
from .run import run
from .status import status

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dmutex`` with ``argv`` (default: ``sys.argv[1:]``); return the exit status.

    Never raises ``SystemExit``: the console script and ``python -m dmutex``
    exit with what it returns.
    """
    arguments = sys.argv[1:] if argv is None else list(argv)
    env = os.environ
    try:
        parsed = parse(arguments, env)
        if isinstance(parsed, RunArgs):
            return run(parsed, env, sys.stderr)
        if isinstance(parsed, LeadArgs):
            return lead(parsed, env, sys.stderr)
        try:
            return status(parsed, env, sys.stdout)
        except Failure:
            raise
        except Exception:  # noqa: BLE001 - a bug: status 1 means "free", never this
            traceback.print_exc()
            sys.stderr.write("dmutex: status failed unexpectedly (a bug; the traceback is above)\n")
            return BROKEN
    except Failure as failure:
        if failure.message:
            sys.stderr.write(f"dmutex: {failure.message}\n")
            sys.stderr.flush()
        return failure.status

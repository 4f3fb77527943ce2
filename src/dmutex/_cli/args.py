"""The command line: ``dmutex run``, ``lead`` and ``status``, parsed into checked dataclasses.

Guarantee: :func:`parse` returns a :class:`RunArgs`, :class:`LeadArgs` or
:class:`StatusArgs` whose every value is in range, or raises :class:`~dmutex._cli.errors.Failure`
(status 64 for a usage error, 0 after ``--help`` / ``--version``, with the
text already printed). It never raises ``SystemExit``. Each names one kind
of lock (:attr:`RunArgs.kind`): a mutex, a semaphore (``--limit N``) or a
read-write lock (``run --read`` / ``--write``, ``status --read-write``),
never two: a read-write lock with a ``--limit`` other than 1 is a usage error.
``lead`` campaigns for a name of the service's mutexes (an election is a
mutex with fencing): it takes no ``--limit``, and its ``--ttl`` defaults to
:data:`DEFAULT_LEAD_TTL`, the election's own default.

``status`` without KEY lists the service's namespace: the held keys, at
most ``--max-keys`` of them (:data:`DEFAULT_MAX_KEYS`, at most
:data:`MOST_KEYS`); ``--max-keys`` with KEY is a usage error. ``--watch
SECONDS`` (at least :data:`LEAST_WATCH`) reads again every SECONDS, a key's
status or the namespace's, until interrupted.

Caveats: as with ``flock(1)``, the options of ``run`` come before KEY (of
``lead``, before NAME): everything after it is the command (a first ``--``
after it is dropped).
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

from .._backends import URL_FORMS
from .._errors import ArgumentTypeError, InvalidArgumentError
from .._options import Kind
from .._validate import MAX_PERMITS, check_key, check_str
from .._version import __version__
from .errors import CONFLICT, USAGE, Failure, one_line
from .holders import Role

__all__ = ["LeadArgs", "RunArgs", "StatusArgs", "build_parser", "parse"]

DEFAULT_SERVICE = "dmutex"
DEFAULT_TTL = 60.0
# dmutex lead: DElection's default lease, so that a leader that dies is
# replaced within about 15 s (run's 60 s suits a job, not a standby).
DEFAULT_LEAD_TTL = 15.0
# dmutex lead's pause before it campaigns again once COMMAND has ended: the
# first, doubled after each run shorter than STEADY_RUN (a command that fails
# at once does not spin), at most LONGEST_PAUSE; a longer run resets it.
FIRST_PAUSE = 1.0
STEADY_RUN = 10.0
LONGEST_PAUSE = 60.0
DEFAULT_KILL_GRACE = 10.0
# COMMAND must be dead by the lease's deadline, and gets SIGTERM --kill-grace
# before it: a grace of at most a quarter of the TTL leaves a renewal and a
# few retries between the last answered renewal and the SIGTERM.
MAX_GRACE_FRACTION = 0.25
# The shortest --ttl: the holder's deadline comes at least 0.2 s before the
# lease can lapse (dmutex._core.renewal.margin_ms), renewals every third of
# the TTL, and a command to start and stop within it; a shorter lease would
# be lost before its command got to run (the library itself takes shorter).
MIN_TTL = 1.0
BACKEND_ENV = "DMUTEX_BACKEND"
# status without KEY: the held keys listed by default, and at most (each is
# one read of its holders), and the shortest --watch interval.
DEFAULT_MAX_KEYS = 1000
MOST_KEYS = 10_000
LEAST_WATCH = 0.1

_FORMS = [form.help for form in URL_FORMS]
_BACKEND_HELP = (
    f"where the locks live: {', '.join(_FORMS[:-1])}, or {_FORMS[-1]} (default: ${BACKEND_ENV}, "
    f"else {URL_FORMS[0].default_help})"
)

_RUN_EPILOG = """\
exit status:
  the command's own (128+N if a signal N killed it)
  75   the lock is held (-n), or the wait ran out (-w); change it with -E
  64   usage error          69   the backend cannot be reached
  70   the lease was lost, or could not be renewed in time, while the command ran
       (it got SIGTERM, then SIGKILL by the lease's deadline)
  126  COMMAND cannot be executed       127  COMMAND not found

the command's environment gains DMUTEX_KEY, DMUTEX_TOKEN, DMUTEX_FENCE (the
grant's fencing number: every grant gets one, on every backend) and DMUTEX_SLOT
(the permit held, 0 to N-1 with --limit N; 0 for a mutex, a reader and a writer).

examples:
  dmutex run nightly-backup -- ./backup.sh         # one backup at a time on this host
  dmutex run -n nightly-backup -- ./backup.sh      # skip if one is running (exit 75)
  dmutex run -w 300 -v deploy -- make deploy       # wait up to 5 minutes, showing holders
  dmutex run --limit 4 --backend redis://cache:6379/0 gpu -- train.py
                                                   # at most 4 at a time, across hosts
  dmutex run --read catalog -- ./export.sh         # exports run side by side ...
  dmutex run --write catalog -- ./rebuild.sh       # ... a rebuild runs alone
  DMUTEX_BACKEND=mongodb://db/ops dmutex run migrate -- ./migrate.sh
  dmutex run --backend 'postgresql://app@db/ops?schema=locks' report -- ./report.sh
  dmutex run --backend 'mysql://app@db:3306/ops' report -- ./report.sh
"""

_LISTING = textwrap.fill(
    "without KEY: every key of the service that is held, one line each (its holders, the "
    "time left of the first lease to end, its fence), at most --max-keys of them (then it "
    "says that more exist): the backend lists at most that many keys plus one "
    f"({'; '.join(form.listing for form in URL_FORMS)}), then each key's holders are read, "
    "one request each.",
    width=78,
    break_on_hyphens=False,
)

_STATUS_EPILOG = f"""\
{_LISTING}

exit status: 0 if KEY is held (any permit; with --read-write, a reader or the
writer), or without KEY if any key is; 1 if it is free (no key held); 64 usage
error, 69 the backend cannot be reached, 70 an error dmutex does not know (a
bug: the traceback is printed). 1 never means anything but free. With --watch:
0 when interrupted (Ctrl-C), else as above when a read fails.

examples:
  dmutex status nightly-backup
  dmutex status --json --backend redis://cache:6379/0 --limit 4 gpu
  dmutex status --read-write catalog
  dmutex status                                    # every held mutex of the service
  dmutex status --limit 4 --watch 2                # its semaphores of 4, every 2 s
"""

_LEAD_DESCRIPTION = textwrap.fill(
    "Campaign for the leadership of NAME (a mutex key of the service, with fencing), run "
    "COMMAND while leading (the lease renewed in the background), stop it before the lease "
    "can lapse when leadership is lost, and campaign again when COMMAND has ended, until a "
    "signal: SIGINT, SIGTERM and SIGHUP are passed on to a running COMMAND, then dmutex "
    f"resigns and exits. Before campaigning again it pauses {FIRST_PAUSE:g} s, twice as long "
    f"after each run shorter than {STEADY_RUN:g} s, at most {LONGEST_PAUSE:g} s.",
    width=78,
    break_on_hyphens=False,
)

_LEAD_EPILOG = """\
exit status (it campaigns again after COMMAND exits, or is stopped for a lost
leadership, until a signal ends it):
  after SIGINT, SIGTERM or SIGHUP: the command's own (128+N if a signal N killed
       it), or 128+N when the signal came while no command ran
  64   usage error          69   the backend cannot be reached at the start
  70   the command's watchdog could not start
  126  COMMAND cannot be executed       127  COMMAND not found

the command's environment gains DMUTEX_KEY (NAME), DMUTEX_FENCE (the term of
this leadership: greater than every earlier leader's, for fencing its writes)
and DMUTEX_SLOT (0).

examples:
  dmutex lead --backend redis://cache:6379/0 scheduler -- python -m myapp.scheduler
                                                   # on every replica: one runs it
  dmutex status --backend redis://cache:6379/0 scheduler     # who leads
"""

_MAIN_EPILOG = """\
Run 'dmutex run --help', 'dmutex lead --help' or 'dmutex status --help' for their options.
"""


class _Exit(Exception):
    """argparse wants to exit: after --help, or a usage error it already printed."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of exiting, and exits 64 on usage errors."""

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise _Exit(status)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(USAGE, f"{self.prog}: error: {message}\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


def _seconds(text: str, *, zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise argparse.ArgumentTypeError(f"must be a finite number {bound} seconds: {text!r}")
    return value


def _seconds_or_zero(text: str) -> float:
    return _seconds(text, zero=True)


def _ttl(text: str) -> float:
    value = _seconds(text, zero=False)
    if value < MIN_TTL:
        raise argparse.ArgumentTypeError(
            f"must be at least {MIN_TTL:g} s (a shorter lease would lapse before its "
            f"command ran): {text!r}"
        )
    return value


def _permits(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= MAX_PERMITS:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_PERMITS}: {text!r}")
    return value


def _service(text: str) -> str:
    """``--service``, checked as the library checks a ``service_name``, before any I/O."""
    try:
        return check_str("the service name", text)
    except (InvalidArgumentError, ArgumentTypeError) as error:
        raise argparse.ArgumentTypeError(one_line(error)) from None


def _interval(text: str) -> float:
    value = _seconds(text, zero=False)
    if value < LEAST_WATCH:
        raise argparse.ArgumentTypeError(f"must be at least {LEAST_WATCH:g} seconds: {text!r}")
    return value


def _max_keys(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= MOST_KEYS:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MOST_KEYS}: {text!r}")
    return value


def _exit_code(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an exit status: {text!r}") from None
    if not 0 <= value <= 255:
        raise argparse.ArgumentTypeError(f"an exit status is 0 to 255, not {text!r}")
    return value


def _add_place(parser: argparse.ArgumentParser) -> None:
    """``--backend`` and ``--service``: where the locks live."""
    parser.add_argument("--backend", metavar="URL", help=_BACKEND_HELP)
    parser.add_argument(
        "--service",
        metavar="NAME",
        type=_service,
        default=DEFAULT_SERVICE,
        help="the namespace of the keys, as the library's service_name (default: %(default)s)",
    )


def _add_common(parser: argparse.ArgumentParser) -> None:
    _add_place(parser)
    parser.add_argument(
        "--limit",
        metavar="N",
        type=_permits,
        default=1,
        help="a semaphore of N permits; 1 is a mutex (default: %(default)s). "
        "Every user of a key must give the same N",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``dmutex`` parser with its ``run`` and ``status`` subcommands."""
    parser = _Parser(
        prog="dmutex",
        description="Run commands under distributed locks (mutexes, semaphores and read-write "
        "locks, kept in SQLite, Redis, MongoDB, PostgreSQL, MySQL/MariaDB, etcd or DynamoDB).",
        epilog=_MAIN_EPILOG,
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"dmutex {__version__}")
    commands = parser.add_subparsers(dest="command_name", metavar="{run,lead,status}")

    run = commands.add_parser(
        "run",
        help="run a command while holding a lock",
        usage="dmutex run [options] KEY [--] COMMAND [ARG...]",
        description="Take the lock KEY, run COMMAND with it held (renewed in the background), "
        "and release it when COMMAND ends, whatever the reason. SIGINT, SIGTERM and SIGHUP "
        "are passed on to COMMAND.",
        epilog=_RUN_EPILOG,
        formatter_class=_Formatter,
    )
    _add_common(run)
    _add_ttl(
        run,
        DEFAULT_TTL,
        "the lease length, renewed every third of it while COMMAND runs; a dmutex "
        "that dies leaves the lock held this long at most",
    )
    waiting = run.add_mutually_exclusive_group()
    waiting.add_argument(
        "-n",
        "--no-wait",
        action="store_true",
        help="fail at once if the lock is held (default: wait)",
    )
    waiting.add_argument(
        "-w",
        "--wait",
        metavar="SECONDS",
        type=_seconds_or_zero,
        help="wait at most SECONDS for the lock (default: wait forever)",
    )
    # Both store into "role": argparse refuses the two together (a usage
    # error, 64) and names them.
    roles = run.add_mutually_exclusive_group()
    roles.add_argument(
        "--read",
        dest="role",
        action="store_const",
        const="read",
        help="hold KEY's read-write lock as a reader: any number of readers at once, "
        "none while a writer holds KEY or waits for it (not with --limit)",
    )
    roles.add_argument(
        "--write",
        dest="role",
        action="store_const",
        const="write",
        help="hold KEY's read-write lock as its writer: alone, once the readers are gone; "
        "while it waits, new readers wait behind it (not with --limit)",
    )
    run.add_argument(
        "-E",
        "--conflict-exit-code",
        metavar="CODE",
        type=_exit_code,
        default=CONFLICT,
        help="the exit status when the lock was not acquired (default: %(default)s)",
    )
    _add_kill_grace(run, "the lease")
    run.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="say on stderr what dmutex waits for, takes and releases (default: quiet)",
    )
    run.add_argument("key", metavar="KEY", help="the name of the lock")
    run.add_argument("command", metavar="COMMAND", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    lead = commands.add_parser(
        "lead",
        help="keep a command running on one host at a time (the leader)",
        usage="dmutex lead [options] NAME [--] COMMAND [ARG...]",
        description=_LEAD_DESCRIPTION,
        epilog=_LEAD_EPILOG,
        formatter_class=_Formatter,
    )
    _add_place(lead)
    _add_ttl(
        lead,
        DEFAULT_LEAD_TTL,
        "the leadership's lease, renewed every third of it while leading; a leader "
        "that dies is replaced after this long at most",
    )
    _add_kill_grace(lead, "leadership")
    lead.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="say on stderr when dmutex campaigns (and who leads), leads, resigns and "
        "pauses, and how COMMAND ended (default: only what went wrong)",
    )
    lead.add_argument("key", metavar="NAME", help="the name to lead: a mutex key of the service")
    lead.add_argument(
        "command", metavar="COMMAND", nargs=argparse.REMAINDER, help=argparse.SUPPRESS
    )

    status = commands.add_parser(
        "status",
        help="show who holds a lock, or which locks are held",
        usage="dmutex status [options] [KEY]",
        description="Show the active permits of KEY: slot (with --read-write: role), expiry, "
        "time left, fence,\nand a shortened token. Without KEY, list the service's held keys "
        "(of the kind of lock\nthe options name) with their holders.",
        epilog=_STATUS_EPILOG,
        formatter_class=_Formatter,
    )
    _add_common(status)
    status.add_argument(
        "--read-write",
        dest="readwrite",
        action="store_true",
        help="show KEY's read-write lock (that of run --read and --write): its writer or "
        "its readers; without KEY, list the held read-write locks (not with --limit)",
    )
    status.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (with --watch, one a line at each read)",
    )
    status.add_argument(
        "--max-keys",
        metavar="N",
        type=_max_keys,
        help="without KEY: list at most N held keys, 1 to "
        f"{MOST_KEYS} (default: {DEFAULT_MAX_KEYS})",
    )
    status.add_argument(
        "--watch",
        metavar="SECONDS",
        type=_interval,
        help=f"read again every SECONDS (at least {LEAST_WATCH:g}) until interrupted; "
        "Ctrl-C exits 0 (default: read once)",
    )
    status.add_argument(
        "key",
        metavar="KEY",
        nargs="?",
        help="the name of the lock (none: list the service's held keys)",
    )
    return parser


def _add_ttl(parser: argparse.ArgumentParser, default: float, meaning: str) -> None:
    parser.add_argument(
        "--ttl",
        metavar="SECONDS",
        type=_ttl,
        default=default,
        help=f"{meaning}; 1 or more (default: %(default)g)",
    )


def _add_kill_grace(parser: argparse.ArgumentParser, kept: str) -> None:
    parser.add_argument(
        "--kill-grace",
        metavar="SECONDS",
        type=_seconds_or_zero,
        default=None,
        help=f"how long COMMAND has between SIGTERM and SIGKILL when {kept} cannot be "
        "kept: SIGTERM comes this long before the lease's deadline, SIGKILL at it; at most "
        f"a quarter of --ttl (default: {DEFAULT_KILL_GRACE:g}, or a quarter of --ttl if less)",
    )


@dataclass(frozen=True)
class RunArgs:
    """``dmutex run``: what to lock, what to run, and how."""

    key: str
    command: list[str]
    backend: str | None
    service: str
    limit: int
    role: Role | None
    """``--read`` / ``--write``: a read-write lock; None: a mutex or semaphore (``limit``)."""
    ttl: float
    wait: float | None
    """Seconds to wait for the lock: 0 with ``-n``, None for ever."""
    conflict_exit_code: int
    kill_grace: float
    verbose: bool

    @property
    def kind(self) -> Kind:
        """The kind of lock: a read-write lock with a role, else by ``limit``."""
        return lock_kind(self.limit, readwrite=self.role is not None)


@dataclass(frozen=True)
class LeadArgs:
    """``dmutex lead``: what to lead, what to run while leading, and how."""

    name: str
    command: list[str]
    backend: str | None
    service: str
    ttl: float
    kill_grace: float
    verbose: bool


@dataclass(frozen=True)
class StatusArgs:
    """``dmutex status``: which key to show (None: the namespace's held keys), and how."""

    key: str | None
    backend: str | None
    service: str
    limit: int
    json: bool
    readwrite: bool = False
    """``--read-write``: show the key's read-write lock."""
    max_keys: int = DEFAULT_MAX_KEYS
    """Without a key: list at most this many held keys."""
    watch: float | None = None
    """``--watch``: seconds between reads until interrupted; None: read once."""

    @property
    def kind(self) -> Kind:
        """The kind of lock shown."""
        return lock_kind(self.limit, readwrite=self.readwrite)


def lock_kind(limit: int, *, readwrite: bool) -> Kind:
    """``readwrite`` (whose limit is 1), else a mutex (1) or a semaphore (more)."""
    if readwrite:
        return "readwrite"
    return "mutex" if limit == 1 else "semaphore"


def parse(argv: Sequence[str], env: Mapping[str, str]) -> RunArgs | LeadArgs | StatusArgs:
    """Parse ``argv`` (without the program name); ``--backend`` defaults to ``$DMUTEX_BACKEND``."""
    parser = build_parser()
    try:
        ns = parser.parse_args(list(argv))
    except _Exit as done:
        raise Failure(done.status) from None
    if ns.command_name is None:
        parser.print_usage(sys.stderr)
        raise Failure(USAGE, "a command is needed: run, lead or status (see dmutex --help)")
    backend = ns.backend or env.get(BACKEND_ENV) or None
    if ns.key is not None:
        _check_key(ns.key, "NAME" if ns.command_name == "lead" else "KEY")
    if ns.command_name == "lead":
        return LeadArgs(
            name=ns.key,
            command=_command(ns.command, "lead", "NAME"),
            backend=backend,
            service=ns.service,
            ttl=ns.ttl,
            kill_grace=_kill_grace(ns.kill_grace, ns.ttl),
            verbose=ns.verbose,
        )
    if ns.command_name == "status":
        if ns.readwrite:
            _no_limit("--read-write", ns.limit)
        if ns.key is not None and ns.max_keys is not None:
            raise Failure(
                USAGE,
                "--max-keys bounds the list of a service's held keys (dmutex status without "
                "KEY): it takes no KEY",
            )
        return StatusArgs(
            key=ns.key,
            backend=backend,
            service=ns.service,
            limit=ns.limit,
            json=ns.json,
            readwrite=ns.readwrite,
            max_keys=DEFAULT_MAX_KEYS if ns.max_keys is None else ns.max_keys,
            watch=ns.watch,
        )
    if ns.role is not None:
        _no_limit(f"--{ns.role}", ns.limit)
    wait: float | None = 0.0 if ns.no_wait else ns.wait
    kill_grace = _kill_grace(ns.kill_grace, ns.ttl)
    return RunArgs(
        key=ns.key,
        command=_command(ns.command, "run", "KEY"),
        backend=backend,
        service=ns.service,
        limit=ns.limit,
        role=ns.role,
        ttl=ns.ttl,
        wait=wait,
        conflict_exit_code=ns.conflict_exit_code,
        kill_grace=kill_grace,
        verbose=ns.verbose,
    )


def _command(given: Sequence[str], subcommand: str, key: str) -> list[str]:
    """The COMMAND after ``key`` (KEY or NAME), without a first ``--``; 64 if none, or an option."""
    command = list(given)
    if command[:1] == ["--"]:
        command = command[1:]
    usage = f"dmutex {subcommand} [options] {key} -- COMMAND [ARG...]"
    if not command:
        raise Failure(USAGE, f"no COMMAND to run: {usage}")
    if command[0].startswith("-"):
        raise Failure(USAGE, f"{command[0]!r} after {key}: options go before {key} ({usage})")
    return command


def _check_key(key: str, what: str) -> None:
    """Refuse a KEY (``what``: or NAME) the library would: empty, not UTF-8, too long (64)."""
    if not key:
        raise Failure(USAGE, f"{what} must not be empty")
    try:
        # The library's rule: UTF-8 (argv bytes that are not arrive as lone
        # surrogates), at most MAX_KEY_LENGTH characters.
        check_key(key)
    except (InvalidArgumentError, ArgumentTypeError) as error:
        raise Failure(USAGE, f"{what}: {one_line(error)}") from None


def _no_limit(option: str, limit: int) -> None:
    """Refuse ``--limit`` N > 1 beside a read-write option: which lock is meant is unclear."""
    if limit != 1:
        raise Failure(
            USAGE,
            f"{option} with --limit {limit}: a read-write lock has one writer or any number of "
            "readers, and takes no --limit (--limit N makes a semaphore of N permits)",
        )


def _kill_grace(given: float | None, ttl: float) -> float:
    """``--kill-grace``, or its default, once checked against ``--ttl``.

    The command must be dead by the lease's deadline (less than ``--ttl``
    after the last answered renewal); a grace it could not be given is a
    usage error that says what would work.
    """
    most = ttl * MAX_GRACE_FRACTION
    if given is None:
        return min(DEFAULT_KILL_GRACE, most)
    if given > most:
        raise Failure(
            USAGE,
            f"--kill-grace {given:g} is too long for --ttl {ttl:g}: COMMAND must be stopped "
            f"before the lease can lapse, so --kill-grace may be at most a quarter of --ttl; "
            f"use --kill-grace {most:g} or less, or --ttl {given / MAX_GRACE_FRACTION:g} or more",
        )
    return given

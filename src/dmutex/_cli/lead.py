"""``dmutex lead``: keep a command running on one host at a time, the leader's.

Rules of the command:

1. One leader at a time: ``dmutex lead NAME`` campaigns for NAME with a
   :class:`~dmutex.DElection` of ``--service`` (a mutex with fencing: NAME
   is the key that ``dmutex run NAME`` and ``DMutex(service, client)`` take,
   in the same table or prefix), and starts COMMAND only once it leads. Its
   leases say who leads: ``host:pid`` of ``dmutex`` and the command
   (:func:`~dmutex._cli.supervise.holder_identity`), what
   ``dmutex status NAME`` shows in its holder column.
2. COMMAND runs as under ``dmutex run`` (:func:`~dmutex._cli.supervise.guard`):
   the lease renewed every third of ``--ttl``; when leadership is lost,
   COMMAND is stopped before the lease can lapse (SIGTERM ``--kill-grace``
   before the deadline, SIGKILL at it), by ``dmutex`` or, should ``dmutex``
   be killed or stopped, by the command's watchdog. Its environment gains
   ``DMUTEX_KEY`` (NAME), ``DMUTEX_FENCE`` (the term) and ``DMUTEX_SLOT``
   (0); an inherited ``DMUTEX_TOKEN`` is removed (a leadership's token is
   not handed out).
3. Once COMMAND has ended (it exited, or was stopped for a lost
   leadership) ``dmutex`` resigns, pauses and campaigns again. The pause is
   :data:`~dmutex._cli.args.FIRST_PAUSE`, twice the last one after a run
   shorter than :data:`~dmutex._cli.args.STEADY_RUN`, at most
   :data:`~dmutex._cli.args.LONGEST_PAUSE`: a command that fails at once
   does not spin, and the others get their turn meanwhile.
4. Signals are ``dmutex run``'s: SIGINT, SIGTERM and SIGHUP are passed on to
   a running COMMAND; once it ends, ``dmutex`` resigns and exits with its
   status (128+N if signal N ended it; 70 if it was stopped for a lost
   leadership meanwhile). A signal while no COMMAND runs (campaigning,
   pausing) exits 128+N at once, leading nothing.
5. Other exit statuses: 64 for a usage error, before any I/O; 69 when the
   backend cannot be used at the first attempt (a wrong URL or password
   shows at once); 127 / 126 when COMMAND is not found / not executable,
   after resigning; 70 when its watchdog cannot start. A backend that fails
   a later campaign is said on stderr and tried again after the pause: a
   supervisor on every replica outlasts an outage.
6. Without ``-v`` only what went wrong is said on stderr, one line each: a
   lost leadership, a failed campaign or resignation. With it, also each
   campaign (and who leads then), each term won, how COMMAND ended, each
   pause.

Caveats: those of ``dmutex run`` (POSIX only; the child's process group;
a signal in the instant between a grant and ``dmutex`` recording it leaves
the lease to lapse after one TTL; a COMMAND that ignores the signal it is
passed keeps ``dmutex`` waiting). Leadership passes between processes by
their campaigns: a resigning leader's pause lets a waiting one win, but
nothing makes the turns fair.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TextIO

from .._errors import ArgumentTypeError, InvalidArgumentError
from .._faces.elections import DElection, Leadership
from . import supervise as sup
from .args import FIRST_PAUSE, LONGEST_PAUSE, STEADY_RUN, LeadArgs
from .errors import LOST, USAGE, Failure, backend_errors, one_line
from .run import RETRY_DELAY, session
from .urls import Connection

__all__ = ["Pauses", "lead"]


class Pauses:
    """Rule 3: the pause before the next campaign, from how long the last run lasted."""

    def __init__(self) -> None:
        self._next = FIRST_PAUSE

    def after(self, ran: float) -> float:
        """The pause after a run of ``ran`` seconds (0 for a campaign that failed)."""
        if ran >= STEADY_RUN:
            self._next = FIRST_PAUSE
        pause = self._next
        self._next = min(2 * pause, LONGEST_PAUSE)
        return pause


def lead(args: LeadArgs, env: Mapping[str, str], stderr: TextIO) -> int:
    """Do one ``dmutex lead``, until a signal; returns the exit status, or raises Failure."""
    return session(
        args.backend,
        env,
        args.ttl,
        lambda backend, signals: _lead(args, env, stderr, backend, signals),
    )


def _election(args: LeadArgs, backend: Connection) -> DElection:
    """The election of ``args.name`` (rule 1); an argument the library refuses is 64."""
    try:
        return DElection(
            args.service,
            backend.client,
            ttl=args.ttl,
            identity=sup.holder_identity(args.command),
            **backend.options,
        )
    except (InvalidArgumentError, ArgumentTypeError) as error:
        raise Failure(USAGE, one_line(error)) from None


def _lead(
    args: LeadArgs,
    env: Mapping[str, str],
    stderr: TextIO,
    backend: Connection,
    signals: sup.Signals,
) -> int:
    election = _election(args, backend)
    with backend_errors(backend):  # rule 5: the first attempt's failure is 69
        try:
            leadership = election.campaign(args.name, timeout=0)
        except (InvalidArgumentError, ArgumentTypeError) as error:  # a name the store refuses
            raise Failure(USAGE, one_line(error)) from None
    pauses = Pauses()
    started = time.monotonic()
    while True:
        if leadership is None:
            leadership = _campaign(election, args, stderr, backend, pauses)
        signals.held()
        _verbose(
            args,
            stderr,
            f"leading {args.name!r} (term {leadership.term}) after "
            f"{time.monotonic() - started:.1f} s: starting {args.command[0]}",
        )
        status, ran = _term(args, env, stderr, backend, leadership, signals)
        if signals.received:  # rule 4: the command ended after a signal
            return status
        pause = pauses.after(ran)
        _verbose(
            args,
            stderr,
            f"{args.command[0]} ended (status {status}) after {ran:.1f} s; resigned "
            f"{args.name!r}; campaigning again in {pause:g} s",
        )
        signals.released()  # a signal from now on exits 128+N at once
        time.sleep(pause)
        leadership = None
        started = time.monotonic()


def _campaign(
    election: DElection, args: LeadArgs, stderr: TextIO, backend: Connection, pauses: Pauses
) -> Leadership:
    """Campaign until leading; a backend failure is said, paused for and tried again (rule 5)."""
    if args.verbose:
        _verbose(args, stderr, f"campaigning for {args.name!r}{_led_by(election, args.name)}")
    while True:
        try:
            leadership = election.campaign(args.name, retry_delay=RETRY_DELAY)
        except backend.errors as error:
            pause = pauses.after(0.0)
            sup.say(
                stderr,
                f"cannot campaign for {args.name!r} on {backend.address.shown} "
                f"({one_line(error)}): trying again in {pause:g} s",
            )
            time.sleep(pause)
            continue
        assert leadership is not None  # no timeout: it campaigns until it leads
        return leadership


def _led_by(election: DElection, name: str) -> str:
    """`` (led by IDENTITY, term N)`` or `` (nobody leads it)``, for ``-v``; empty if unread."""
    try:
        leader = election.leader(name)
    except Exception:  # noqa: BLE001 - -v's aside; the campaign says what fails
        return ""
    if leader is None:
        return " (nobody leads it)"
    who = "an unknown holder" if leader.identity is None else leader.identity
    return f" (led by {who}, term {leader.term})"


def _term(
    args: LeadArgs,
    env: Mapping[str, str],
    stderr: TextIO,
    backend: Connection,
    leadership: Leadership,
    signals: sup.Signals,
) -> tuple[int, float]:
    """Run COMMAND while leading, then resign: its status, and the seconds it ran."""
    started = time.monotonic()
    try:
        status = sup.guard(
            args.command,
            _child_env(env, leadership),
            leadership,
            signals,
            stderr,
            what=f"leadership of {args.name!r}",
            ttl=args.ttl,
            kill_grace=args.kill_grace,
        )
    finally:
        resigned = True  # a failure said here is no loss to report again
        try:
            resigned = leadership.resign()
        except backend.errors as error:
            sup.say(
                stderr,
                f"could not resign {args.name!r} ({one_line(error)}): "
                "its lease lapses within its TTL",
            )
    if not resigned and leadership.lost and status != LOST:
        # The lease lapsed while nothing could tell (this process stopped,
        # its COMMAND stopped by the watchdog): as dmutex run says it.
        sup.say(stderr, f"leadership of {args.name!r} was found lost when it was resigned")
        status = LOST
    return status, time.monotonic() - started


def _child_env(env: Mapping[str, str], leadership: Leadership) -> dict[str, str]:
    """Rule 2: the command's environment."""
    child = dict(env)
    child.pop("DMUTEX_TOKEN", None)
    child["DMUTEX_KEY"] = leadership.name
    child["DMUTEX_FENCE"] = str(leadership.term)
    child["DMUTEX_SLOT"] = "0"
    return child


def _verbose(args: LeadArgs, stderr: TextIO, text: str) -> None:
    if args.verbose:
        sup.say(stderr, text)

"""``dmutex run`` killed or stopped: its command never outlives the lease.

Each trial runs the real console script (``tests/_support/cli.py``, in a
session of its own, as a service or a script runs it):
``dmutex run --ttl 2 KEY -- FIRST``, where FIRST (``tests/_support/stamps.py``)
forks a grandchild, and both stamp ``time.monotonic()`` into one log every
20 ms; on SIGTERM they exit (even trials) or go on (odd trials: only SIGKILL
stops them). Once both stamp, the test sends SIGKILL or SIGSTOP to the
``dmutex`` pid alone (the moment is the *cut*), then runs a second ``dmutex
run -w 20 --ttl 30 KEY -- SECOND`` (``stamps.SECOND_TTL``); SECOND notes when
it started and whether FIRST's pid still runs. For every trial:

- the last stamp (FIRST's or its grandchild's) comes before SECOND starts,
  and FIRST no longer runs then: no second command beside the first;
- the last stamp comes less than the TTL after the cut: every renewal that
  was answered was sent before the cut, so that is the latest the lease can
  lapse, and the command was dead by then;
- the watchdog is gone at the end, and the second ``dmutex`` exits 0; a
  stopped first ``dmutex``, continued, exits 70 (the lease was lost).

20 trials per backend (SQLite, Redis, PostgreSQL) and signal, 10 at once.
Then the whole pause: ``dmutex``, its watchdog and the command stopped
together past the TTL (a frozen machine or cgroup); continued, the command
is killed at once (the stamps it makes after it continues are counted and
bounded), and ``dmutex`` exits 70. And the terminal's foreground, where the
command stays in ``dmutex``'s process group: ``dmutex`` run by a shell that
owns a pseudo-terminal, killed or stopped; its watchdog signals the command
and its descendants. Last, a watchdog killed under a running command: ``dmutex``
says so, once, and the command runs to its end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests._support import cli, deadlines
from tests._support.redis_servers import Pool, flushed, newest
from tests._support.sampling import until
from tests._support.stamps import FIRST, SECOND, SECOND_TTL, Stamps

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc; dmutex run is POSIX only"
)

TTL = 2.0
TRIALS = 20  # per backend and signal
AT_ONCE = 10
STAMP_EVERY = 0.02
STARTED_TIMEOUT = 30.0  # FIRST and its grandchild stamping: Python start-ups on a busy machine
GONE_TIMEOUT = 15.0
# Stamps the command may make once a whole pause ends, before its watchdog
# (continued with it) kills it: 25 x 20 ms, a bound far above what it takes.
AFTER_PAUSE_STAMPS = 25


@dataclass
class Outcome:
    """One trial: what went wrong (empty: nothing) and its figures in seconds."""

    name: str
    problems: list[str] = field(default_factory=list)
    cut_to_last: float | None = None  # the cut to the command's last stamp
    last_to_second: float | None = None  # the last stamp to SECOND's start


@pytest.fixture(params=["sqlite", "redis", "postgresql"])
def backend_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The command's ``--backend`` for each backend (SQLite: a file in tmp)."""
    if request.param == "sqlite":
        yield f"sqlite://{tmp_path / 'locks.sqlite3'}"  # one_trial: each trial's own file
    elif request.param == "redis":
        pool: Pool = request.getfixturevalue("redis_pool")
        yield flushed(newest(pool).url)
    else:
        store = cli.postgres_store(
            request.getfixturevalue("postgres_server"),
            request.getfixturevalue("postgres_schema"),
        )
        try:
            yield store.url
        finally:
            store.close()


@contextlib.contextmanager
def reaped(*pids: int) -> Iterator[None]:
    """SIGKILL whichever of ``pids`` still runs when the block ends (only if a test failed)."""
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                if not cli.gone(pid):
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)


def first_command(folder: Path, index: int) -> list[str]:
    mode = "polite" if index % 2 == 0 else "stubborn"
    return [sys.executable, "-c", FIRST, str(folder), mode, str(STAMP_EVERY), "fork"]


def wait_stamping(
    folder: Path, name: str, dmutex: subprocess.Popen[str] | None = None
) -> tuple[int, int]:
    """FIRST's pid and process group, once it and its grandchild both stamp.

    ``dmutex``: the process that runs FIRST, said with its output if the wait fails.
    """

    def both() -> bool:
        whats = {what for what, _ in Stamps.read(folder / "first.log").lines}
        return (folder / "first.pid").exists() and {"alive", "grand"} <= whats

    why = None if dmutex is None else lambda: cli.account(dmutex)
    until(both, f"{name}: FIRST and its grandchild stamping", STARTED_TIMEOUT, poll=0.02, why=why)
    pid = int((folder / "first.pid").read_text())
    return pid, os.getpgid(pid)


def own_file(url: str, folder: Path) -> str:
    """``url``, or for SQLite a file of the trial's own.

    Why: ten trials' dmutex processes on one file once starved a write's busy
    wait past its 1 s bound (the request timeout at ``--ttl 2``; CI, trial 18:
    "database is locked", exit 69). Contention between trials is not what this
    test studies; the first and second command share one key in one file.
    """
    return f"sqlite://{folder / 'locks.sqlite3'}" if url.startswith("sqlite://") else url


def one_trial(url: str, env: dict[str, str], folder: Path, signum: int, index: int) -> Outcome:
    """One trial, start to end; its processes are gone when it returns or raises."""
    name = f"{signal.Signals(signum).name} trial {index}"
    key = f"supervisor-{signal.Signals(signum).name}-{index:02d}"
    outcome = Outcome(name)
    folder.mkdir()
    url = own_file(url, folder)
    args = ["run", "--backend", url, "--ttl", f"{TTL:g}"]
    second_args = ["run", "--backend", url, "--ttl", f"{SECOND_TTL:g}"]
    first = cli.start([*args, key, "--", *first_command(folder, index)], env)
    with contextlib.ExitStack() as stack:
        stack.enter_context(reaped(first.pid))
        pid, group = wait_stamping(folder, name, first)
        stack.enter_context(reaped(pid, group))
        cut = time.monotonic()
        os.kill(first.pid, signum)
        second_command = [sys.executable, "-c", SECOND, str(folder), str(pid)]
        second = cli.finish(
            cli.start([*second_args, "-w", "20", key, "--", *second_command], env),
            time.monotonic(),
        )
        if signum == signal.SIGSTOP:
            os.kill(first.pid, signal.SIGCONT)
        done = cli.finish(first, cut)
        until(lambda: cli.gone(group), f"{name}: the watchdog (pid {group}) gone", GONE_TIMEOUT)
    stamps = Stamps.read(folder / "first.log")
    expected = -signal.SIGKILL if signum == signal.SIGKILL else 70
    if done.status != expected:
        outcome.problems.append(f"the first dmutex exited {done.status}: {done.stderr!r}")
    if second.status != 0:
        # Its own lease (a starved machine can let it lapse): a problem, said with
        # how the machine ran; what SECOND saw of FIRST is judged all the same.
        outcome.problems.append(f"the second dmutex exited {second.status}: {second.stderr!r}")
    if not (folder / "second.json").exists():
        outcome.problems.append("SECOND never ran")
        return outcome
    report = json.loads((folder / "second.json").read_text())
    last = stamps.last()
    if last is None or not any(what == "grand" for what, _ in stamps.lines):
        outcome.problems.append("FIRST or its grandchild never stamped")
        return outcome
    outcome.cut_to_last = last - cut
    outcome.last_to_second = report["start"] - last
    if outcome.last_to_second <= 0:
        outcome.problems.append(
            f"the command stamped {-outcome.last_to_second:.3f} s after SECOND started"
        )
    if report["state"] not in ("gone", "Z", "X"):
        outcome.problems.append(f"FIRST still ran when SECOND started (state {report['state']})")
    if outcome.cut_to_last >= TTL:
        outcome.problems.append(
            f"the command stamped {outcome.cut_to_last:.3f} s after the cut: past the lease"
        )
    return outcome


def seconds(value: float | None) -> str:
    return "(none measured)" if value is None else f"{value:.3f} s"


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
def test_a_killed_or_stopped_dmutex_never_leaves_its_command_running_past_the_lease(
    backend_url: str, tmp_path: Path, signum: int
) -> None:
    env = cli.environment(tmp_path)
    with (
        deadlines.Scheduling.watching() as scheduling,
        ThreadPoolExecutor(AT_ONCE, thread_name_prefix="supervisor-trial") as pool,
    ):
        futures = [
            pool.submit(one_trial, backend_url, env, tmp_path / f"t{i:02d}", signum, i)
            for i in range(TRIALS)
        ]
        outcomes = [future.result(timeout=300) for future in futures]
    latest = max((o.cut_to_last for o in outcomes if o.cut_to_last is not None), default=None)
    closest = min(
        (o.last_to_second for o in outcomes if o.last_to_second is not None), default=None
    )
    summary = (
        f"[supervisor {signal.Signals(signum).name}] {len(outcomes)} trials: last stamp at most "
        f"{seconds(latest)} after the cut (ttl {TTL:g} s), at least {seconds(closest)} before "
        f"SECOND; "
        f"the test process {scheduling.text()}"
    )
    print(summary)
    problems = [f"{o.name}: {p}" for o in outcomes for p in o.problems]
    assert problems == [], summary + "\n" + "\n".join(problems)


def test_a_whole_pause_past_the_lease_ends_with_the_command_killed_as_it_continues(
    tmp_path: Path,
) -> None:
    """dmutex, the watchdog and the command all stopped: continued, the command dies at once."""
    env = cli.environment(tmp_path)
    folder = tmp_path / "pause"
    folder.mkdir()
    first = cli.start(["run", "--ttl", f"{TTL:g}", "pause", "--", *first_command(folder, 1)], env)
    with contextlib.ExitStack() as stack:
        stack.enter_context(reaped(first.pid))
        pid, group = wait_stamping(folder, "pause", first)
        stack.enter_context(reaped(pid, group))
        for each in (first.pid, group):  # dmutex leads a group of its own; the watchdog another
            os.killpg(each, signal.SIGSTOP)
        time.sleep(TTL + 0.5)  # the pause: past the lease's deadline
        resumed = time.monotonic()
        os.killpg(group, signal.SIGCONT)
        os.killpg(first.pid, signal.SIGCONT)
        done = cli.finish(first, resumed)
        until(lambda: cli.gone(pid), "the command gone", GONE_TIMEOUT)
        until(lambda: cli.gone(group), "the watchdog gone", GONE_TIMEOUT)
    after = [moment for _, moment in Stamps.read(folder / "first.log").lines if moment > resumed]
    print(f"[supervisor pause] {len(after)} stamps after the pause ended")
    assert done.status == 70, done.stderr
    assert len(after) <= AFTER_PAUSE_STAMPS, after


# In a pseudo-terminal: the session's leader takes it as its controlling
# terminal (so its group is the foreground one) and runs dmutex in that group,
# writing dmutex's pid to a file; then it stays, so that no hang-up reaches
# the foreground group when dmutex dies.
FOREGROUND = r"""
import fcntl, os, subprocess, sys, termios, time
fcntl.ioctl(0, termios.TIOCSCTTY, 0)
child = subprocess.Popen(sys.argv[2:])
with open(sys.argv[1] + ".tmp", "w") as out:
    out.write(str(child.pid))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
child.wait()
time.sleep(30)
"""


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
def test_in_the_terminals_foreground_the_watchdog_stops_the_command_and_its_descendants(
    tmp_path: Path, signum: int
) -> None:
    env = cli.environment(tmp_path)
    folder = tmp_path / "fg"
    folder.mkdir()
    controller, terminal = os.openpty()
    dmutex_pid_file = tmp_path / "dmutex.pid"
    argv = [str(cli.console_script()), "run", "--ttl", f"{TTL:g}", "fg", "--"]
    leader = subprocess.Popen(
        [sys.executable, "-c", FOREGROUND, str(dmutex_pid_file), *argv, *first_command(folder, 1)],
        env=env,
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        start_new_session=True,
    )
    os.close(terminal)
    try:
        pid, group = wait_stamping(folder, "foreground")
        dmutex = int(dmutex_pid_file.read_text())
        assert group == os.getpgid(dmutex) == leader.pid  # the command stayed in the foreground
        watchdogs = [
            p
            for p in os.listdir("/proc")
            if p.isdigit() and _parent(int(p)) == dmutex and b"watchdog.py" in _cmdline(int(p))
        ]
        assert len(watchdogs) == 1
        assert _cmdline(int(watchdogs[0])).endswith(b"tree\0")  # the foreground's mode
        cut = time.monotonic()
        os.kill(dmutex, signum)
        until(lambda: cli.gone(pid), "the command gone", TTL + GONE_TIMEOUT)
        until(lambda: cli.gone(int(watchdogs[0])), "the watchdog gone", GONE_TIMEOUT)
        last = Stamps.read(folder / "first.log").last()
        assert last is not None
        assert last - cut < TTL, (last, cut)
        assert not _grandchildren_left(folder, cut)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, signal.SIGCONT)
            os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
        os.close(controller)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read()
    except OSError:
        return b""


def _grandchildren_left(folder: Path, cut: float) -> bool:
    """Whether the grandchild still stamps: a stamp newer than a moment ago, after the cut."""
    time.sleep(5 * STAMP_EVERY)
    before = Stamps.read(folder / "first.log").last()
    time.sleep(5 * STAMP_EVERY)
    after = Stamps.read(folder / "first.log").last()
    return after is not None and before is not None and after > before and after > cut


# Kills its watchdog (the leader of its process group, outside a terminal),
# then runs on long enough for dmutex to look.
KILLS_ITS_WATCHDOG = r"""
import os, signal, time
os.kill(os.getpgrp(), signal.SIGKILL)
time.sleep(1.0)
"""


def test_a_watchdog_that_ends_before_the_command_is_said_and_the_command_runs_on(
    tmp_path: Path,
) -> None:
    env = cli.environment(tmp_path)
    command = [sys.executable, "-c", KILLS_ITS_WATCHDOG]
    done = cli.run(["run", "--ttl", f"{TTL:g}", "unwatched", "--", *command], env)
    assert done.status == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("dmutex:")]
    assert len(said) == 1, said
    assert "watchdog" in said[0]
    assert "status -9" in said[0]

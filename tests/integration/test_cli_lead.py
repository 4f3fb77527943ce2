"""``dmutex lead``: one host at a time runs the command, as real processes on SQLite and Redis.

Each test starts real ``dmutex lead`` processes (the console script, each in
a session of its own, as ``tests/_support/cli.py`` does) on one name, with a
command that stamps a shared file: ``start`` (its pid, its parent's, its
term), a ``tick`` every 0.05 s, and ``stop`` or ``term`` as it ends, each
with its time on the monotonic clock (one clock for every process of a
Linux host). One run of the command is the stamps of one pid; "exactly one
at a time" is that no run's first stamp comes before the previous run's
last. Leases are short (``--ttl`` 2 s, ``--kill-grace`` 0.5 s), every wait
is bounded, and every process is stopped by its pid.

The usage errors are checked through :func:`dmutex._cli.main` in this
process (fast; one case through the console script too): they come before
any I/O, so an unreachable backend never turns them into 69.
"""

from __future__ import annotations

import itertools
import json
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

from dmutex import DElection, DMutex
from dmutex._cli import main
from dmutex._cli.lead import Pauses
from dmutex._core.stamps import encode_identity
from tests._support import cli
from tests._support.cli import Store
from tests._support.redis_servers import Pool, flushed, newest
from tests._support.sampling import until

NAME = "scheduler"
TTL = "2"  # a SIGKILLed leader's lease lapses within 2 s
GRACE = "0.5"  # at most a quarter of --ttl
WAIT = 15.0  # the longest any one step may take on a loaded 2-core machine

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="dmutex lead is POSIX only")

# The command: stamps LOG (see the module's docstring) for SECONDS, then exits 0.
# Modes: "polite" ends on SIGTERM (stamp "term", exit 3); "stubborn" stamps
# "term" and carries on, so that only a SIGKILL ends it.
STAMPER = r"""
import os, signal, sys, time
log, seconds, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
def stamp(word, extra=""):
    line = f"{word} {os.getpid()} {time.monotonic():.6f}{extra}\n"
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
def on_term(signum, frame):
    stamp("term")
    if mode == "polite":
        os._exit(3)
signal.signal(signal.SIGTERM, on_term)
stamp("start", f" {os.getppid()} {os.environ['DMUTEX_FENCE']}")
ends = time.monotonic() + seconds
while time.monotonic() < ends:
    stamp("tick")
    time.sleep(0.05)
stamp("stop")
"""


@dataclass
class Run:
    """One run of the command, from its stamps."""

    pid: int
    parent: int
    term: int
    first: float
    last: float
    words: list[str]


def runs(log: Path) -> list[Run]:
    """The runs the log shows, in the order they started."""
    found: dict[int, Run] = {}
    if not log.exists():
        return []
    for line in log.read_text().splitlines():
        word, pid_text, at_text, *extra = line.split()
        pid, at = int(pid_text), float(at_text)
        if word == "start":
            found[pid] = Run(pid, int(extra[0]), int(extra[1]), at, at, [word])
        elif pid in found:
            found[pid].last = max(found[pid].last, at)
            found[pid].words.append(word)
    return sorted(found.values(), key=lambda run: run.first)


def assert_one_at_a_time(log: Path) -> list[Run]:
    """No run started before the previous one's last stamp; terms only grow. The runs."""
    seen = runs(log)
    for before, after in itertools.pairwise(seen):
        assert after.first > before.last, f"runs overlap: {before} and {after}"
        assert after.term > before.term, f"terms do not grow: {before} then {after}"
    return seen


@pytest.fixture
def redis_cli_url(redis_pool: Pool) -> str:
    """The newest discovered Redis server, its database emptied."""
    return flushed(newest(redis_pool).url)


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        found = cli.sqlite_store(tmp_path)
    else:
        found = cli.redis_store(request.getfixturevalue("redis_cli_url"))
    try:
        yield found
    finally:
        found.close()


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return cli.environment(tmp_path)


class Leads:
    """The ``dmutex lead`` processes of one test, each stopped by its pid at the end."""

    def __init__(self, store: Store, env: dict[str, str], tmp_path: Path) -> None:
        self.store, self.env, self.folder = store, env, tmp_path
        self.log = tmp_path / "stamps.log"
        self.processes: list[subprocess.Popen[str]] = []

    def command(self, seconds: float, mode: str = "polite") -> list[str]:
        return [sys.executable, "-c", STAMPER, str(self.log), str(seconds), mode]

    def start(self, seconds: float, mode: str = "polite") -> subprocess.Popen[str]:
        args = ["lead", "--backend", self.store.url, "--ttl", TTL, "--kill-grace", GRACE]
        process = cli.start([*args, NAME, "--", *self.command(seconds, mode)], self.env)
        self.processes.append(process)
        return process

    def wait_runs(self, count: int) -> list[Run]:
        until(
            lambda: len(runs(self.log)) >= count,
            f"{count} runs of the command",
            WAIT,
            poll=0.02,
            why=self.accounts,
        )
        return runs(self.log)

    def leader_of(self, run: Run) -> subprocess.Popen[str]:
        """The ``dmutex lead`` that started ``run``."""
        (process,) = [p for p in self.processes if p.pid == run.parent]
        return process

    def stop(self, process: subprocess.Popen[str]) -> cli.Finished:
        process.send_signal(signal.SIGTERM)
        return cli.finish(process, time.monotonic(), WAIT)

    def accounts(self) -> str:
        return "; ".join(cli.account(p) for p in self.processes)

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.communicate(timeout=WAIT)


@pytest.fixture
def leads(store: Store, env: dict[str, str], tmp_path: Path) -> Iterator[Leads]:
    found = Leads(store, env, tmp_path)
    try:
        yield found
    finally:
        found.close()


def is_free(store: Store) -> bool:
    """Whether the library can take NAME now (released again at once)."""
    handle = DMutex(cli.SERVICE, store.client).acquire(NAME, 5)
    if handle is None:
        return False
    assert handle.release()
    return True


# -- one at a time, and leadership passes ---------------------------------


def test_two_leads_run_the_command_one_at_a_time_and_take_turns(leads: Leads) -> None:
    """A command that exits after 0.6 s: the leader resigns, pauses, the other leads."""
    first, second = leads.start(0.6), leads.start(0.6)
    leads.wait_runs(3)
    for process in (first, second):
        done = leads.stop(process)
        # Signalled while no command of its ran (143), or the command's own "term" exit (3).
        assert done.status in (128 + signal.SIGTERM, 3), done.stderr
        assert "Traceback" not in done.stderr
    seen = assert_one_at_a_time(leads.log)
    assert len(seen) >= 3
    assert all("stop" in run.words for run in seen[:2])  # they ended by themselves
    # The pause after a resignation lets the waiting one in: both led.
    assert {run.parent for run in seen} == {first.pid, second.pid}
    assert is_free(leads.store)  # both resigned as they exited


# -- SIGTERM to the leader ---------------------------------------------------


def test_sigterm_to_the_leader_stops_its_command_and_the_other_takes_over(
    leads: Leads,
) -> None:
    """The signal reaches the command, which exits 3: so does dmutex, having resigned."""
    for _ in range(2):
        leads.start(60)
    (first,) = leads.wait_runs(1)
    leader = leads.leader_of(first)
    done = leads.stop(leader)
    assert done.status == 3, done.stderr  # the command's own status
    assert done.stderr == ""  # nothing went wrong: nothing said without -v
    assert "term" in runs(leads.log)[0].words  # the command got the SIGTERM
    _, second = leads.wait_runs(2)
    assert second.parent != leader.pid
    assert_one_at_a_time(leads.log)
    follower = leads.leader_of(second)
    assert leads.stop(follower).status == 3
    assert is_free(leads.store)


def test_a_signal_while_campaigning_exits_128_plus_n_and_runs_nothing(
    sqlite: Store, env: dict[str, str], tmp_path: Path
) -> None:
    holder = DMutex(cli.SERVICE, sqlite.client).acquire(NAME, 30)
    assert holder is not None
    leads = Leads(sqlite, env, tmp_path)
    try:
        process = leads.start(60)
        time.sleep(1.0)  # campaigning behind the library's holder
        assert process.poll() is None, leads.accounts()
        done = leads.stop(process)
        assert done.status == 128 + signal.SIGTERM, done.stderr
        assert runs(leads.log) == []
        assert holder.release()  # the library's lease was never touched
    finally:
        leads.close()


# -- SIGKILL to the leader's dmutex: the watchdog -------------------------


def test_a_sigkilled_leaders_command_is_stopped_by_the_watchdog_before_the_other_starts(
    leads: Leads,
) -> None:
    """The command ignores SIGTERM: the watchdog SIGKILLs it, before the lease can lapse."""
    for _ in range(2):
        leads.start(60, "stubborn")
    (first,) = leads.wait_runs(1)
    leader = leads.leader_of(first)
    leader.kill()
    assert leader.wait(WAIT) == -signal.SIGKILL
    killed_at = time.monotonic()
    until(lambda: cli.gone(first.pid), "the watchdog stopped the command", WAIT)
    # SIGTERM at once (it stamped "term" and went on), SIGKILL after --kill-grace at most.
    assert time.monotonic() - killed_at < float(TTL) + 1.0
    _, second = leads.wait_runs(2)
    assert second.parent != leader.pid
    seen = assert_one_at_a_time(leads.log)
    assert "term" in seen[0].words  # it got the watchdog's SIGTERM, and ignored it
    assert "stop" not in seen[0].words  # it did not end by itself: SIGKILL ended it
    assert second.first > seen[0].last


# -- dmutex status shows the leader --------------------------------------


def test_status_shows_the_leader_with_its_command(leads: Leads) -> None:
    process = leads.start(60)
    (first,) = leads.wait_runs(1)
    assert first.parent == process.pid
    command = leads.command(60)
    stamped = f"{socket.gethostname()}:{process.pid} {shlex.join(command)}"
    expected = unquote(encode_identity(stamped))  # cut to fit the token, as it reads back
    assert expected.startswith(f"{socket.gethostname()}:{process.pid} {shlex.quote(command[0])}")

    done = cli.run(["status", "--backend", leads.store.url, "--json", NAME], leads.env)
    assert done.status == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["kind"] == "mutex"  # an election is a mutex of the same service
    (holder,) = document["holders"]
    assert holder["identity"] == expected
    assert document["fence"] == first.term  # the term is the grant's fence

    text = cli.run(["status", "--backend", leads.store.url, NAME], leads.env)
    assert text.status == 0, text.stderr
    assert f"{socket.gethostname()}:{process.pid} " in text.stdout.splitlines()[2]

    leader = DElection(cli.SERVICE, leads.store.client).leader(NAME)
    assert leader is not None
    assert (leader.identity, leader.term) == (expected, first.term)
    assert leads.stop(process).status == 3


# -- what cannot run, and the pause ------------------------------------------


@pytest.fixture
def sqlite(tmp_path: Path) -> Iterator[Store]:
    found = cli.sqlite_store(tmp_path)
    try:
        yield found
    finally:
        found.close()


def test_a_command_not_found_exits_127_after_resigning(sqlite: Store, env: dict[str, str]) -> None:
    args = ["lead", "--backend", sqlite.url, NAME, "--", "/nonexistent/command"]
    done = cli.run(args, env)
    assert done.status == 127, done.stderr
    assert "command not found" in done.stderr
    assert is_free(sqlite)


def test_the_pause_doubles_after_short_runs_and_resets_after_a_long_one() -> None:
    pauses = Pauses()
    assert [pauses.after(0.5) for _ in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert pauses.after(10.0) == 1
    assert pauses.after(0.0) == 2


# -- usage errors --------------------------------------------------------------

# Nothing listens on port 1: a request would exit 69, not 64.
UNREACHABLE = "redis://127.0.0.1:1"


@pytest.mark.parametrize(
    "args",
    [
        ["lead", "", "--", "true"],  # an empty NAME
        ["lead", "\udcff", "--", "true"],  # argv bytes that are not UTF-8
        ["lead", "x" * 501, "--", "true"],  # longer than a key may be
        ["lead", NAME],  # no COMMAND
        ["lead", NAME, "--"],
        ["lead", NAME, "-v", "--", "true"],  # options go before NAME
        ["lead", "--ttl", "0", NAME, "--", "true"],
        ["lead", "--ttl", "0.5", NAME, "--", "true"],  # below the command's least TTL
        ["lead", "--ttl", "nan", NAME, "--", "true"],
        ["lead", "--ttl", "soon", NAME, "--", "true"],
        ["lead", "--ttl", "2", "--kill-grace", "0.6", NAME, "--", "true"],  # > a quarter
        ["lead", "--limit", "2", NAME, "--", "true"],  # an election is a mutex
        ["lead", "--service", "", NAME, "--", "true"],
        ["lead", "--service", "x:permit:0", NAME, "--", "true"],  # Redis's layout refuses it
    ],
)
def test_usage_errors_exit_64_before_any_io(
    args: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DMUTEX_BACKEND", UNREACHABLE)
    assert main(args) == 64
    err = capsys.readouterr().err
    assert err.strip(), "it says why"
    assert "Traceback" not in err


def test_a_usage_error_of_the_console_script_exits_64_and_creates_nothing(
    env: dict[str, str],
) -> None:
    state = Path(env["XDG_STATE_HOME"])
    done = cli.run(["lead", "--ttl", "0.5", NAME, "--", "true"], env)
    assert done.status == 64, done.stderr
    assert "--ttl" in done.stderr
    assert not state.exists() or not any(state.rglob("*")), sorted(state.rglob("*"))


def test_an_unreachable_backend_exits_69(env: dict[str, str]) -> None:
    done = cli.run(["lead", "--backend", UNREACHABLE, NAME, "--", "true"], env)
    assert done.status == 69, done.stderr
    assert "127.0.0.1:1" in done.stderr

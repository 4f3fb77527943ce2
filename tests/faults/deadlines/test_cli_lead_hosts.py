"""``dmutex lead`` on three "hosts", the leader killed, stopped and cut off: one COMMAND at a time.

Three real ``dmutex lead --ttl 2 -v NAME -- COMMAND`` processes (the console
script, each in a session of its own: ``tests/_support/cli.py``) stand for
three hosts. Each reaches the session's newest Redis server through a
:class:`~tests._support.fault_proxy.FaultProxy` of its own on 127.0.0.1, so
that one host's network can fail alone. COMMAND (:data:`STAMPER`) appends to
one shared log (``O_APPEND``, one ``write`` a line) ``start``, then ``tick``
every 50 ms, then ``stop`` on SIGTERM (and exits 3), each line with its host,
its pid, ``time.monotonic()`` (``CLOCK_MONOTONIC``: one clock for every
process of a Linux host, and the one the comparisons use: it never steps)
and ``time.time()``. Its ``start`` also says its parent (the ``dmutex`` that
leads), ``DMUTEX_FENCE`` (the term), its process group (its watchdog's) and
which COMMANDs that stamped ``start`` before it still run then (``/proc``;
a zombie runs nothing): there must be none.

Then the current leader fails, three times in turn, each time the host that
leads then, once its lease has been renewed (its PTTL, read through a client
of the test's own, went up: renewals were flowing before the failure):

(a) its ``dmutex lead`` (not COMMAND) is SIGKILLed: its watchdog stops
    COMMAND at once, and another host takes over once the lease lapses;
(b) its ``dmutex lead`` is SIGSTOPped: its watchdog stops COMMAND before the
    lease's deadline (COMMAND's ``stop`` comes while ``dmutex`` is stopped,
    so the watchdog sent it), another host takes over; then it is SIGCONTed,
    sees its COMMAND ended, and campaigns again (what it says then is not
    checked: today it says nothing of the lost leadership, its ``resign()``
    returning False unread, where a continued ``dmutex run`` says it, 70);
(c) its proxy becomes a blackhole (nothing crosses, nothing is closed): its
    renewals cannot get through, so its ``dmutex`` stops COMMAND before the
    lease can lapse; another host takes over, then the proxy is restored.

What must hold, across the whole run: every COMMAND's last stamp comes
before the next COMMAND's ``start`` (runs in the order they started), no
COMMAND still ran when the next one started, terms only grow, and each
takeover goes to another host that is still up. Measured per failure, and
printed (``pytest -s``): the failure to the next ``start`` (the takeover)
and the old COMMAND's last stamp to the new one's first (the gap). At the
end every host still up is stopped by its pid (SIGTERM, SIGKILL after a
bound): the one campaigning exits 143, the leader with its COMMAND's status
(3), as ``docs/command.md`` says; the key is free, and every watchdog gone.

One test, the three failures in a row (each starts from the leader the
previous one left): about 10 s on an idle 2-core machine. Like the other
deadline suites it times what it tests, so it runs with the fault suites,
last (``tests/conftest.py``); without a Redis server it skips.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from dmutex import DMutex
from tests._support import cli, deadlines
from tests._support.fault_proxy import FaultProxy, Rates
from tests._support.redis_servers import Pool, Server, flushed, newest
from tests._support.sampling import process_state, until, wait_stopped

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc; dmutex lead is POSIX only"
)

NAME = "hosts-leader"
HOSTS = ("host-a", "host-b", "host-c")
TTL = 2.0  # the lease; --kill-grace is left to its default, a quarter of it (0.5 s)
SEED = 20240717  # the proxies inject no random fault: the seed only fills the argument
WAIT = 15.0  # the longest any one step may take on a loaded 2-core machine
STOP_BOUND = 10.0  # SIGTERM to exit, before SIGKILL
COMMAND_STATUS = 3  # COMMAND's exit status on SIGTERM
RENEWAL_RISE_MS = 100  # a lease's PTTL that went up by this much: it was renewed

# COMMAND: argv LOG HOST. Stamps LOG (see the module's docstring) until
# SIGTERM ("stop", exit 3), or for 120 s at most (exit 0).
STAMPER = r"""
import os, signal, sys, time
log, host = sys.argv[1], sys.argv[2]
fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
def stamp(word, extra=""):
    line = f"{word} {host} {os.getpid()} {time.monotonic():.6f} {time.time():.6f}{extra}\n"
    os.write(fd, line.encode())
def on_term(signum, frame):
    stamp("stop")
    os._exit(3)
signal.signal(signal.SIGTERM, on_term)
def running(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False
with open(log) as earlier:
    lines = earlier.read().split("\n")[:-1]  # whole lines only
started = {int(l.split()[2]) for l in lines if l.startswith("start ")} - {os.getpid()}
alive = ",".join(str(pid) for pid in sorted(started) if running(pid)) or "-"
fence = os.environ["DMUTEX_FENCE"]
stamp("start", f" {os.getppid()} {fence} {os.getpgrp()} {alive}")
ends = time.monotonic() + 120
while time.monotonic() < ends:
    time.sleep(0.05)
    stamp("tick")
os._exit(0)
"""


@dataclass
class Run:
    """One run of COMMAND, from its stamps (monotonic seconds)."""

    pid: int
    host: str
    first: float
    last: float
    words: list[str] = field(default_factory=list)
    parent: int | None = None  # the dmutex lead that started it
    term: int | None = None
    group: int | None = None  # its process group: its watchdog's
    alive: str | None = None  # COMMANDs still running as it started ("-": none)
    stop: float | None = None  # when it got SIGTERM

    def text(self) -> str:
        return (
            f"{self.host} pid {self.pid} term {self.term} {self.first:.3f}..{self.last:.3f} "
            f"({self.words.count('tick')} ticks, {'stop' if self.stop else 'no stop'})"
        )


def runs(log: Path) -> list[Run]:
    """The runs the log shows, in the order they started (whole lines only)."""
    if not log.exists():
        return []
    found: dict[int, Run] = {}
    for line in log.read_text().split("\n")[:-1]:
        word, host, pid_text, at_text, _wall, *extra = line.split()
        pid, at = int(pid_text), float(at_text)
        run = found.setdefault(pid, Run(pid, host, at, at))
        run.first, run.last = min(run.first, at), max(run.last, at)
        run.words.append(word)
        if word == "start":
            run.parent, run.term, run.group = int(extra[0]), int(extra[1]), int(extra[2])
            run.alive = extra[3]
        elif word == "stop":
            run.stop = at
    return sorted(found.values(), key=lambda run: run.first)


def one_at_a_time(seen: list[Run]) -> list[str]:
    """What breaks "one COMMAND at a time" in ``seen``: overlaps, terms that do not grow."""
    problems = []
    for run in seen:
        if run.parent is None:
            problems.append(f"a COMMAND that never stamped start: {run.text()}")
        elif run.alive != "-":
            problems.append(f"{run.text()} started while COMMAND pid(s) {run.alive} still ran")
    for before, after in itertools.pairwise(seen):
        if not after.first > before.last:
            problems.append(
                f"overlap: {before.text()} stamped {before.last - after.first:.3f} s after "
                f"{after.text()} started"
            )
        if before.term is not None and after.term is not None and after.term <= before.term:
            problems.append(f"terms do not grow: {before.text()} then {after.text()}")
    return problems


@dataclass
class Host:
    """One host: its ``dmutex lead``, the proxy it reaches Redis through, its stderr file."""

    name: str
    proxy: FaultProxy
    stderr: Path
    process: subprocess.Popen[str] | None = None

    @property
    def lead(self) -> subprocess.Popen[str]:
        assert self.process is not None
        return self.process

    def said(self) -> str:
        return self.stderr.read_text() if self.stderr.exists() else ""

    def count(self, text: str) -> int:
        return self.said().count(text)


# What `dmutex lead` says when its COMMAND ended and it resigned (lead.py), and the same
# for a leadership lost (status 70). Not " ended (status ": the line that says the
# watchdog ended has it too, and CI run Q's wait took that line for the command's end.
ENDED = "; resigned "
LOST = " ended (status 70) after "


@dataclass
class Failure:
    """One failure of the leader, and what followed, in seconds."""

    fault: str
    failed: str
    next: str
    takeover: float  # the failure to the next COMMAND's start
    gap: float  # the old COMMAND's last stamp to the new one's start
    old_after: float  # the failure to the old COMMAND's last stamp

    def text(self) -> str:
        return (
            f"{self.fault:8} {self.failed} -> {self.next}: takeover {self.takeover:.3f} s after "
            f"the failure; old COMMAND's last stamp {self.old_after:+.3f} s from the failure, "
            f"{self.gap:.3f} s before the new start"
        )


def url_through(server: Server, proxy: FaultProxy) -> str:
    auth = f":{server.password}@" if server.password else ""
    return f"redis://{auth}{proxy.host}:{proxy.port}/{server.db}"


@pytest.fixture
def hosts_server(redis_pool: Pool) -> Server:
    """The newest Redis server of the session (skips without one), its database emptied."""
    server = newest(redis_pool)
    flushed(server.url)
    return server


class Hosts:
    """The three hosts of the test, the shared log, and the failures seen."""

    def __init__(self, server: Server, tmp_path: Path, stack: contextlib.ExitStack) -> None:
        self.server = server
        self.env = cli.environment(tmp_path)
        self.log = tmp_path / "stamps.log"
        self.log.touch()
        self.hosts: dict[str, Host] = {}
        for index, name in enumerate(HOSTS):
            proxy = FaultProxy((server.host, server.port), Rates(), seed=SEED + index)
            stack.enter_context(proxy)
            self.hosts[name] = Host(name, proxy, tmp_path / f"{name}.stderr")
        stack.callback(self.reap)  # before the proxies stop (last in, first out)
        self.observer = stack.enter_context(redis.Redis.from_url(server.url))
        self.failures: list[Failure] = []

    def start(self) -> None:
        for host in self.hosts.values():
            args = ["lead", "--backend", url_through(self.server, host.proxy), "--ttl", f"{TTL:g}"]
            command = [sys.executable, "-c", STAMPER, str(self.log), host.name]
            host.process = cli.start(
                [*args, "-v", NAME, "--", *command], self.env, stderr=host.stderr
            )

    def accounts(self) -> str:
        lines = [f"{run.text()}" for run in runs(self.log)]
        for host in self.hosts.values():
            status = None if host.process is None else host.process.poll()
            lines.append(f"{host.name} (status {status}) said: {host.said()!r}")
        return "\n".join(lines)

    def until(self, condition: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
        until(condition, what, timeout, poll=0.01, why=self.accounts)

    def leader(self) -> tuple[Run, Host]:
        """The run that started last, and the host whose ``dmutex lead`` started it."""
        run = runs(self.log)[-1]
        host = self.hosts[run.host]
        assert run.parent == host.lead.pid, self.accounts()
        return run, host

    def steady(self) -> tuple[Run, Host]:
        """The leader, once its lease was renewed (its PTTL went up): renewals flow."""
        run, host = self.leader()
        key = f"_dmutex_{cli.SERVICE}:permit:0:{NAME}"
        lowest: list[int] = []

        def renewed() -> bool:
            pttl = int(self.observer.pttl(key))
            if lowest and pttl > lowest[0] + RENEWAL_RISE_MS:
                return True
            if pttl > 0:
                lowest[:] = [min([pttl, *lowest])]
            return False

        self.until(renewed, f"{host.name}'s lease renewed")
        assert runs(self.log)[-1].pid == run.pid, self.accounts()
        return run, host

    def next_run(self, after: Run) -> Run:
        """The first run that started after ``after``, once there is one."""
        self.until(lambda: runs(self.log)[-1].first > after.first, f"a COMMAND after {after.pid}")
        return next(run for run in runs(self.log) if run.first > after.first)

    def run_of(self, pid: int) -> Run:
        (run,) = [run for run in runs(self.log) if run.pid == pid]
        return run

    def note(self, fault: str, failed: Run, failed_at: float, new: Run) -> Run:
        """Record the failure's figures, once the old COMMAND is gone; the old run, final."""
        self.until(lambda: cli.gone(failed.pid), f"{fault}: COMMAND {failed.pid} gone")
        old = self.run_of(failed.pid)
        self.failures.append(
            Failure(
                fault,
                old.host,
                new.host,
                takeover=new.first - failed_at,
                gap=new.first - old.last,
                old_after=old.last - failed_at,
            )
        )
        assert new.host != old.host, self.accounts()
        assert self.hosts[new.host].lead.poll() is None, self.accounts()
        return old

    def reap(self) -> None:
        """Whatever still runs (only if the test failed): SIGCONT and SIGKILL, by pid."""
        for host in self.hosts.values():
            process = host.process
            if process is None:
                continue
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGCONT)
                    os.kill(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired, ValueError):
                process.communicate(timeout=STOP_BOUND)
        for run in runs(self.log):
            for pid in (run.pid, run.group):
                if pid is not None and pid != os.getpgrp() and not cli.gone(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)


def stop_by_pid(process: subprocess.Popen[str]) -> tuple[int, str]:
    """SIGTERM, then SIGKILL after :data:`STOP_BOUND` (failing the test): status and stdout."""
    process.send_signal(signal.SIGTERM)
    try:
        out, _ = process.communicate(timeout=STOP_BOUND)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate(timeout=STOP_BOUND)
        pytest.fail(f"dmutex lead pid {process.pid} ran {STOP_BOUND} s past its SIGTERM")
    return process.returncode, out


@contextlib.contextmanager
def timed(label: str) -> Iterator[None]:
    began = time.monotonic()
    try:
        yield
    finally:
        print(f"[lead hosts] {label}: {time.monotonic() - began:.1f} s")


def test_the_leader_killed_stopped_and_cut_off_never_leaves_two_commands_running(
    hosts_server: Server, tmp_path: Path
) -> None:
    with (
        timed("the whole test"),
        contextlib.ExitStack() as stack,
        deadlines.Scheduling.watching() as scheduling,
    ):
        hosts = Hosts(hosts_server, tmp_path, stack)
        hosts.start()
        hosts.until(lambda: len(runs(hosts.log)) >= 1, "a first leader's COMMAND")
        first, _ = hosts.leader()
        others = [h for h in hosts.hosts.values() if h.name != first.host]
        hosts.until(
            lambda: all(h.count("campaigning for") >= 1 for h in others),
            "the other two hosts campaigning",
        )

        # (a) SIGKILL to the leader's dmutex lead: its watchdog stops COMMAND at once.
        old, host = hosts.steady()
        failed_at = time.monotonic()
        host.lead.kill()
        assert host.lead.wait(WAIT) == -signal.SIGKILL
        new = hosts.next_run(old)
        old = hosts.note("SIGKILL", old, failed_at, new)
        assert old.stop is not None, hosts.accounts()
        assert old.stop >= failed_at, hosts.accounts()  # the watchdog's SIGTERM, at once

        # (b) SIGSTOP: the watchdog stops COMMAND before the lease's deadline.
        old, host = hosts.steady()
        ended_before = host.count(ENDED)
        lost_before = host.count(LOST)
        failed_at = time.monotonic()
        os.kill(host.lead.pid, signal.SIGSTOP)
        wait_stopped(host.lead.pid, WAIT)
        new = hosts.next_run(old)
        old = hosts.note("SIGSTOP", old, failed_at, new)
        assert process_state(host.lead.pid) in ("T", "t"), "its dmutex lead stayed stopped"
        continued_at = time.monotonic()
        os.kill(host.lead.pid, signal.SIGCONT)
        # Its COMMAND got SIGTERM while its dmutex was stopped: from the watchdog.
        assert old.stop is not None, hosts.accounts()
        assert failed_at < old.stop < continued_at, hosts.accounts()
        assert old.last < new.first, hosts.accounts()  # and it was over before the next began
        hosts.until(lambda: host.count(ENDED) > ended_before, "(b) back to campaigning")
        assert host.lead.poll() is None, hosts.accounts()
        # Continued, it tells its leadership was lost while it was stopped (status 70).
        assert host.count(LOST) == lost_before + 1, host.said()

        # (c) Its proxy a blackhole: its own dmutex stops COMMAND before the lease lapses.
        old, host = hosts.steady()
        ended_before = host.count(ENDED)
        failed_at = time.monotonic()
        host.proxy.blackholed = True  # returns once nothing crosses any more
        new = hosts.next_run(old)
        old = hosts.note("blackhole", old, failed_at, new)
        host.proxy.blackholed = False
        assert old.stop is not None, hosts.accounts()
        assert old.stop > failed_at, hosts.accounts()
        # Its command ended; it campaigns again (a signal now exits 143 at once).
        hosts.until(lambda: host.count(ENDED) > ended_before, "(c) back to campaigning")
        assert host.lead.poll() is None, hosts.accounts()

        # The end: the hosts still up, stopped by pid; the campaigner first, so that
        # the leader's resignation cannot hand it a term.
        leading, leader = hosts.leader()
        assert leading.host == new.host
        alive = [h for h in hosts.hosts.values() if h.lead.poll() is None]
        assert {h.name for h in alive} == set(HOSTS) - {first.host}, hosts.accounts()
        statuses = {}
        for host in sorted(alive, key=lambda h: h is leader):
            statuses[host.name], _ = stop_by_pid(host.lead)
        expected = {h.name: 128 + signal.SIGTERM for h in alive} | {leader.name: COMMAND_STATUS}
        assert statuses == expected, hosts.accounts()

        seen = runs(hosts.log)
        for failure in hosts.failures:
            print(f"[lead hosts] {failure.text()}")
        print(f"[lead hosts] the test process {scheduling.text()}")
        for run in seen:
            print(f"[lead hosts]   {run.text()}")
        assert one_at_a_time(seen) == [], hosts.accounts()
        assert len(seen) == 4, hosts.accounts()  # the first leader and three takeovers
        assert [run.host for run in seen[1:]] == [f.next for f in hosts.failures]
        assert seen[-1].stop is not None  # the last COMMAND got its dmutex's SIGTERM
        for host in hosts.hosts.values():
            assert "Traceback" not in host.said(), host.said()
            assert host.proxy.errors == [], host.proxy.errors
        groups = [run.group for run in seen if run.group is not None]
        hosts.until(lambda: all(cli.gone(g) for g in groups), "every watchdog gone", 5.0)
        with redis.Redis.from_url(hosts_server.url) as client:
            handle = DMutex(cli.SERVICE, client).acquire(NAME, 5)
            assert handle is not None, "NAME is free: the last leader resigned"
            assert handle.release()

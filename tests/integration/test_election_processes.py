"""Leader election across OS processes, its leader killed three times: Redis and PostgreSQL.

Four contender processes and one observer (``tests._support.election_workers``,
each started with ``sys.executable -m``) share one name of a
:class:`~dmutex.DElection` with a 1.5 s TTL, on the newest Redis server found
(redis-py) or on the session's PostgreSQL server (a psycopg connection in
autocommit). A contender campaigns, and while it leads stamps
``lead <term> <pid> <time.time()>`` every 50 ms into its own file, asking
``leadership.lost`` before each stamp. The observer writes down every leader
``observe(name, poll=0.05)`` yields.

The test finds the leader from the stamps, lets it lead 0.5 s (plus 0, 1/3
or 2/3 of a renewal period, so that the kills land at different points of
the renewal cycle), reads its lease from storage (``leader()``), SIGKILLs
it, starts a fresh contender so that four keep campaigning, and waits for
the next leader's first stamp; three times. Then it stops every process by
its pid and checks:

1. one leader at a time: no two leaderships' stamps overlap (each one's
   first stamp comes after the previous one's last; one host, one clock);
2. a term never goes back: in time order terms only grow, and each
   leadership has one term of its own;
3. the observer saw every change: every term that led is in its sequence,
   with the leader's identity, in increasing order (leaders hold >= 0.5 s,
   it polls every 0.05 s);
4. failover (the next leader's first stamp minus the kill's time) is above
   the killed lease's time left as storage showed it, and at most the TTL
   plus 1 s.

The failover figures are printed (``-s``) and, when
``DMUTEX_ELECTION_FIGURES`` names a file, merged into it as JSON (one entry
per server). Each backend's run takes about 8-10 s here.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
import redis
from psycopg import sql

from dmutex import DElection
from tests._support import election_workers
from tests._support.election_workers import (
    TTL,
    Config,
    Stint,
    identity_of,
    read_lines,
    stints,
)
from tests._support.redis_servers import Pool, newest

ROOT = Path(__file__).resolve().parents[2]
NAME = "primary"
CONTENDERS = 4
LEAD_BEFORE_KILL = 0.5  # a leader leads at least this long before it is killed
# ... plus these, one per kill: renewals come every third of the TTL, so a kill
# after exactly 0.5 s would always land just after the first renewal (the whole
# TTL left); these spread the kills over a renewal period.
PHASES = (0.0, TTL / 9, 2 * TTL / 9)
LEAD_AT_END = 0.3  # the last leader leads this long before the processes are stopped
FAILOVER_SLACK = 1.0  # a failover takes at most TTL + this
EXPIRY_ROUNDING = 0.01  # storage shows its expiry in milliseconds
RECENT = 0.3  # a leadership whose last stamp is older than this is over
FIRST_LEADER_TIMEOUT = 20.0  # five interpreters importing on a busy 2-core machine
NEXT_LEADER_TIMEOUT = TTL + 5.0
OBSERVED_TIMEOUT = 3.0
STOP_TIMEOUT = 5.0
LIFETIME = 60.0  # a worker exits by itself after this, whatever happens to the test
POLL = 0.02  # how often the test reads the stamp files
FIGURES_ENV = "DMUTEX_ELECTION_FIGURES"

T = TypeVar("T")


@dataclass(frozen=True)
class Kill:
    """One kill of the leader, and what followed."""

    pid: int
    term: int
    at: float  # time.time() just before the SIGKILL
    lease_left: float  # the killed lease's expiry as storage showed it, minus ``at``
    until: float  # that expiry, time.time() seconds
    next_term: int
    next_first: float  # the next leader's first stamp

    @property
    def failover(self) -> float:
        return self.next_first - self.at


@dataclass
class Run:
    """One run's processes, their files, and the kills."""

    folder: Path
    base: Config  # every worker's config but its file
    election: DElection  # the test's own, to read the leader from storage
    contenders: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: list[Path] = field(default_factory=list)
    observer: subprocess.Popen[bytes] | None = None
    observer_log: Path | None = None
    kills: list[Kill] = field(default_factory=list)
    started: int = 0

    def start(self, role: str) -> tuple[subprocess.Popen[bytes], Path]:
        """Start one worker, its stamps and its stderr in files of its own."""
        self.started += 1
        stem = f"{role}-{self.started}"
        log = self.folder / f"{stem}.log"
        config = Config(**{**asdict(self.base), "log": str(log)})
        with (self.folder / f"{stem}.err").open("wb") as errors:
            process = subprocess.Popen(
                [sys.executable, "-m", election_workers.__name__, role, config.to_json()],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=errors,
                stderr=errors,
            )
        return process, log

    def start_contender(self) -> None:
        process, log = self.start("contender")
        self.contenders[process.pid] = process
        self.logs.append(log)

    def start_observer(self) -> None:
        self.observer, self.observer_log = self.start("observer")

    def stints(self) -> list[Stint]:
        return stints(self.logs)

    def exited(self) -> str:
        """What the workers that ended by themselves wrote on stderr (none should)."""
        killed = {kill.pid for kill in self.kills}
        found = []
        processes = [*self.contenders.values(), *([self.observer] if self.observer else [])]
        for process in processes:
            if process.pid not in killed and process.poll() is not None:
                found.append(f"pid {process.pid} exited {process.returncode}")
        errors = sorted(self.folder.glob("*.err"))
        tails = [f"{e.name}: {e.read_text()[-2000:]}" for e in errors if e.stat().st_size]
        return "; ".join(found) + ("\n" + "\n".join(tails) if tails else "")

    def wait_for(self, what: str, timeout: float, found: Callable[[], T | None]) -> T:
        """``found()`` once it is not None; fails the test after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            value = found()
            if value is not None:
                return value
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {timeout} s: {self.exited()}")
            time.sleep(POLL)

    def leading(self, after: int, *, led: float) -> Stint | None:
        """The leadership of a term above ``after`` stamping now, once it has led ``led`` s."""
        now = time.time()
        for stint in reversed(self.stints()):
            if stint.term > after and stint.last >= now - RECENT and stint.first <= now - led:
                return stint
        return None

    def next_leader(self, after: int) -> Stint | None:
        """The first leadership of a term above ``after``, as soon as it stamped."""
        return next((s for s in self.stints() if s.term > after), None)

    def kill(self, stint: Stint) -> Kill:
        """Read the leader's lease from storage, SIGKILL it, start a fresh contender."""
        process = self.contenders[stint.pid]
        leader = self.election.leader(NAME)
        assert leader is not None, "storage shows no leader while one stamps"
        assert (leader.term, leader.identity) == (stint.term, identity_of(stint.pid))
        at = time.time()
        os.kill(stint.pid, signal.SIGKILL)
        process.wait(STOP_TIMEOUT)
        assert process.returncode == -signal.SIGKILL
        until = leader.until.timestamp()
        self.start_contender()  # four keep campaigning
        following = self.wait_for(
            f"leader after term {stint.term}",
            NEXT_LEADER_TIMEOUT,
            lambda: self.next_leader(stint.term),
        )
        kill = Kill(stint.pid, stint.term, at, until - at, until, following.term, following.first)
        self.kills.append(kill)
        return kill

    def seen(self) -> list[tuple[int | None, str]]:
        """The observer's sequence: (term, identity) per leader it yielded, None for nobody."""
        assert self.observer_log is not None
        return [(line.term, line.who) for line in read_lines(self.observer_log)]

    def stop(self) -> None:
        """SIGTERM every worker still running, by its pid; SIGKILL one that lingers."""
        processes = [*([self.observer] if self.observer else []), *self.contenders.values()]
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_TIMEOUT)


def _elect(run: Run) -> None:
    """Start the workers, kill the leader once per phase, let the last one lead a while."""
    run.start_observer()
    for _ in range(CONTENDERS):
        run.start_contender()
    killed = 0  # the last killed leader's term: the next leader's is greater
    timeout = FIRST_LEADER_TIMEOUT
    for phase in PHASES:
        led = LEAD_BEFORE_KILL + phase
        stint = run.wait_for(
            f"leader after term {killed} for {led:.2f} s",
            timeout + led,
            lambda: run.leading(killed, led=led),  # noqa: B023 - called at once
        )
        killed = run.kill(stint).term
        timeout = NEXT_LEADER_TIMEOUT
    last = run.wait_for(
        f"last leader (after term {killed}) for {LEAD_AT_END} s",
        LEAD_AT_END + NEXT_LEADER_TIMEOUT,
        lambda: run.leading(killed, led=LEAD_AT_END),
    )
    run.wait_for(
        f"observer's sight of term {last.term}",
        OBSERVED_TIMEOUT,
        lambda: True if last.term in {seen for seen, _ in run.seen()} else None,
    )


def _check(run: Run) -> None:
    found = run.stints()
    shown = "\n".join(map(str, found))
    assert len(run.kills) == len(PHASES)
    # 1. One leader at a time: each leadership's first stamp after the previous one's last.
    for before, after in itertools.pairwise(found):
        assert after.first > before.last, f"two leaders at once:\n{before}\n{after}"
    # 2. Terms never go back: in time order (above) they grow, one per leadership.
    terms = [stint.term for stint in found]
    assert terms == sorted(set(terms)), f"a term went back or was led twice:\n{shown}"
    stamps = sorted(
        (line.at, line.term)
        for log in run.logs
        for line in read_lines(log)
        if line.what == "lead" and line.term is not None
    )
    assert [term for _, term in stamps] == sorted(term for _, term in stamps)
    # Each kill ended the leadership it aimed at, and the next one followed it.
    by_term = {stint.term: stint for stint in found}
    for kill in run.kills:
        killed = by_term[kill.term]
        assert killed.pid == kill.pid
        assert killed.stamps >= LEAD_BEFORE_KILL / election_workers.STAMP_EVERY / 2
        assert kill.next_term == min(t for t in terms if t > kill.term)
    # 3. The observer saw every leader, in order, with its identity.
    seen = [(term, who) for term, who in run.seen() if term is not None]
    observed = [pair for i, pair in enumerate(seen) if i == 0 or pair != seen[i - 1]]
    observed_terms = [term for term, _ in observed]
    assert observed_terms == sorted(set(observed_terms)), f"observer: {run.seen()}"
    assert set(terms) <= set(observed_terms), f"missed leaders: {observed} against\n{shown}"
    who = dict(observed)
    assert all(who[stint.term] == identity_of(stint.pid) for stint in found)
    # 4. Failover: after the killed lease ran out, within the TTL plus a second.
    for kill in run.kills:
        assert kill.failover > 0
        assert kill.next_first >= kill.until - EXPIRY_ROUNDING, f"granted before expiry: {kill}"
        assert kill.failover <= TTL + FAILOVER_SLACK, f"slow failover: {kill}"


def _record(label: str, run: Run) -> None:
    """Print the failover figures; merge them into ``$DMUTEX_ELECTION_FIGURES`` if set."""
    failovers = [round(kill.failover, 4) for kill in run.kills]
    left = [round(kill.lease_left, 4) for kill in run.kills]
    figures = {
        "ttl": TTL,
        "failovers": failovers,
        "median": round(statistics.median(failovers), 4),
        "worst": round(max(failovers), 4),
        "lease_left_at_kill": left,
        "leaderships": len(run.stints()),
        "observed": len([term for term, _ in run.seen() if term is not None]),
    }
    print(
        f"\nelection failover on {label}, ttl {TTL} s: "
        f"{', '.join(f'{f:.3f}' for f in failovers)} s (median {figures['median']:.3f}, "
        f"worst {figures['worst']:.3f}); lease left at kill "
        f"{', '.join(f'{f:.3f}' for f in left)} s"
    )
    target = os.environ.get(FIGURES_ENV)
    if target:
        path = Path(target)
        recorded: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        recorded[label] = figures
        path.write_text(json.dumps(recorded, indent=2) + "\n")


@contextlib.contextmanager
def _running(folder: Path, base: Config, election: DElection) -> Iterator[Run]:
    run = Run(folder, base, election)
    try:
        yield run
    finally:
        run.stop()


def _elect_and_check(label: str, folder: Path, base: Config, election: DElection) -> None:
    election.mutex.ready()  # the storage made once, not by four processes at once
    with _running(folder, base, election) as run:
        _elect(run)
    _record(label, run)
    _check(run)


def test_redis_leader_killed_three_times(redis_pool: Pool, tmp_path: Path) -> None:
    """On the newest Redis server found, through redis-py."""
    server = newest(redis_pool)
    service = f"elect_{uuid.uuid4().hex[:8]}"
    base = Config("redis", server.url, None, service, NAME, "", LIFETIME)
    with redis.Redis.from_url(server.url) as client:
        election = DElection(service, client, ttl=TTL)
        try:
            _elect_and_check(server.label, tmp_path, base, election)
        finally:
            leftovers = client.keys(f"*{service}*")
            if leftovers:
                client.delete(*leftovers)


def test_postgresql_leader_killed_three_times(
    postgres_server: str, postgres_schema: str, tmp_path: Path
) -> None:
    """On the session's PostgreSQL server, through a psycopg connection in autocommit."""
    service = f"elect_{uuid.uuid4().hex[:8]}"
    base = Config("postgresql", postgres_server, postgres_schema, service, NAME, "", LIFETIME)
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        election = DElection(service, conn, ttl=TTL, schema_name=postgres_schema)
        version = conn.info.server_version // 10000
        try:
            _elect_and_check(f"postgresql-{version}", tmp_path, base, election)
        finally:
            table = sql.Identifier(postgres_schema, f"_dmutex_{service}")
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))

"""``dmutex run`` whose backend stops answering: its command is stopped before another starts.

Each trial runs the real console script (``tests/_support/cli.py``) against
the session's Redis 7.0 server through a
:class:`~tests._support.fault_proxy.FaultProxy` of its own:
``dmutex run --ttl T KEY -- FIRST``, with the default ``--kill-grace``.
FIRST is a small Python program that writes its pid, then appends an
``alive`` stamp (``time.monotonic()``) to a log every 20 ms; on SIGTERM it
appends a ``term`` stamp, then exits ("polite", even trials) or goes on
stamping until SIGKILL stops it ("stubborn", odd trials). Once FIRST runs and
the lease has been renewed once (its PTTL, read every 20 ms by a direct
client, went up), the proxy becomes a blackhole: the connections stay open
and carry nothing more, new ones are accepted and never answered. Right
after, a second ``dmutex run --ttl 30 KEY -- SECOND`` starts directly against
the server (its own TTL is not what is measured: ``stamps.SECOND_TTL``).
SECOND, when it starts, notes ``time.monotonic()`` and whether FIRST's pid
still runs (``/proc``; a zombie runs nothing; ``os.kill(pid, 0)``
is noted too), and exits.

``time.monotonic()`` is ``CLOCK_MONOTONIC`` on Linux, one clock for every
process of the host, so the stamps of the two commands and the test's own
times compare. For every trial:

- FIRST's last stamp comes before SECOND's start, and FIRST no longer runs
  when SECOND starts;
- FIRST stamped after the cut (it was not stopped before), and its last
  stamp comes less than T after the cut (every renewal answered was sent
  before the cut, so the lease expires by then);
- the first ``dmutex`` exits with status 70, having said one line on
  stderr (the loss), the second with 0.

Trials run at once, each with its own key, proxy and folder: 20 at
``--ttl 2``, then 20 at ``--ttl 5``. After SECOND ran, the proxy stops, so that
the first ``dmutex``'s requests fail at once and it exits. The smallest
margin (SECOND's start less FIRST's last stamp) of each TTL is in the
terminal summary (``tests/faults/conftest.py``) and the failure message.

Then the usage check of ``--kill-grace``: a grace not well below ``--ttl``
(5 s or 2 s with ``--ttl 2``) is a usage error (exit status 64, naming
``--kill-grace``), while ``--ttl 2`` with the default grace, or with 0.25 s,
runs the command.
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
from pathlib import Path

import pytest
import redis

from tests._support import cli, deadlines
from tests._support.deadlines import Trial
from tests._support.fault_proxy import FaultProxy, Rates
from tests._support.redis_servers import Pool, Server
from tests._support.sampling import until
from tests._support.stamps import FIRST, SECOND, SECOND_TTL, Stamps

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="dmutex run is POSIX only")

SEED = 20240611  # the proxies inject no random fault: the seed only fills the argument
TRIALS = {2.0: 20, 5.0: 20}  # --ttl -> trials run at once (80 processes at the peak: fine here)
STAMP_EVERY = 0.02
RENEWAL_RISE_MS = 100  # a PTTL that went up by this much: the lease was renewed
POLL = 0.02
STARTED_TIMEOUT = 30.0  # for FIRST to run: two Python start-ups on a loaded machine
RENEWED_TIMEOUT = 15.0


@pytest.fixture
def cli_server(redis_pool: Pool) -> Server:
    return deadlines.redis_target(redis_pool)


def url_through(server: Server, proxy: FaultProxy) -> str:
    auth = f":{server.password}@" if server.password else ""
    return f"redis://{auth}{proxy.host}:{proxy.port}/{server.db}"


def lease_name(key: str) -> str:
    """The Redis key of ``dmutex run``'s lease on ``key`` (service "dmutex", slot 0)."""
    return f"_dmutex_{cli.SERVICE}:permit:0:{key}"


def wait_renewed(observer: redis.Redis, name: str, timeout: float) -> None:
    """Poll the lease's PTTL until it goes up: a renewal reached the server."""
    previous: int | None = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pttl = int(observer.pttl(name))
        if previous is not None and pttl > previous + RENEWAL_RISE_MS:
            return
        if pttl > 0:
            previous = pttl if previous is None else min(previous, pttl)
        time.sleep(POLL)
    pytest.fail(f"the lease {name} was not renewed within {timeout} s")


@contextlib.contextmanager
def stopping(process: subprocess.Popen[str] | None) -> Iterator[None]:
    """Kill ``process`` (by its handle) if it still runs when the block ends."""
    try:
        yield
    finally:
        if process is not None and process.poll() is None:
            process.kill()
            process.communicate()


def one_trial(server: Server, env: dict[str, str], folder: Path, ttl: float, index: int) -> Trial:
    """One trial, start to end; its processes are gone when it returns or raises."""
    mode = "polite" if index % 2 == 0 else "stubborn"
    key = f"cli-ttl{ttl:g}-{index:02d}-{mode}"
    trial = Trial(f"cli-ttl{ttl:g}", index, key, ttl, ("the command's last stamp",))
    folder.mkdir()
    first_command = [sys.executable, "-c", FIRST, str(folder), mode, str(STAMP_EVERY)]
    ttl_arg = f"{ttl:g}"
    first_pid: int | None = None
    with (
        FaultProxy((server.host, server.port), Rates(), seed=SEED + index) as proxy,
        redis.Redis.from_url(server.url) as observer,
    ):
        args = ["run", "--backend", url_through(server, proxy), "--ttl", ttl_arg, key, "--"]
        first = cli.start([*args, *first_command], env)
        first_started = time.monotonic()
        try:
            with stopping(first):
                pid_file = folder / "first.pid"
                account = lambda: cli.account(first)  # noqa: E731 - said only if the wait fails
                until(
                    pid_file.exists,
                    f"{key}: FIRST started",
                    STARTED_TIMEOUT,
                    poll=POLL,
                    why=account,
                )
                first_pid = int(pid_file.read_text())
                wait_renewed(observer, lease_name(key), RENEWED_TIMEOUT)
                stopped = first.poll() is not None
                trial.lost_before_cut = (
                    stopped or Stamps.read(folder / "first.log").term() is not None
                )
                trial.cut = time.monotonic()
                proxy.blackholed = True
                trial.cut_done = time.monotonic()  # from here on, nothing more crosses
                direct = ["run", "--backend", server.url, "--ttl", f"{SECOND_TTL:g}", key, "--"]
                second_command = [sys.executable, "-c", SECOND, str(folder), str(first_pid)]
                second = cli.start([*direct, *second_command], env)
                with stopping(second):
                    done_second = cli.finish(second, time.monotonic())
                proxy.stop()  # the first dmutex's requests fail now, so it exits soon
                done_first = cli.finish(first, first_started)
        finally:
            if first_pid is not None:  # FIRST outlived its dmutex only if the test failed
                with contextlib.suppress(ProcessLookupError):
                    if not cli.gone(first_pid):
                        os.kill(first_pid, signal.SIGKILL)
        assert proxy.errors == [], proxy.errors
    report = json.loads((folder / "second.json").read_text())
    stamps = Stamps.read(folder / "first.log")
    trial.taken = float(report["start"])
    last = stamps.last()
    if last is not None:
        trial.tell("the command's last stamp", last)
    trial.lost_at_end = True  # a command has no handle: its dmutex's status says it (below)
    if done_first.status != 70:
        trial.note(f"the first dmutex exited {done_first.status}, not 70: {done_first.stderr!r}")
    said = [line for line in done_first.stderr.splitlines() if line.startswith("dmutex:")]
    if len(said) != 1:  # the docs promise one line: the loss, not the failed release after it
        trial.note(f"the first dmutex said {len(said)} lines, not 1: {said!r}")
    if done_second.status != 0:
        trial.note(f"the second dmutex exited {done_second.status}: {done_second.stderr!r}")
    if report["state"] not in ("gone", "Z", "X"):
        trial.note(
            f"FIRST (pid {first_pid}) still ran when SECOND started: state {report['state']}, "
            f"os.kill(pid, 0) {'worked' if report['kill0'] else 'failed'}"
        )
    alive = [moment for what, moment in stamps.lines if what == "alive"]
    if not alive or trial.cut is None or alive[-1] < trial.cut:
        trial.note("FIRST stamped nothing after the cut: it was stopped before")
    term = stamps.term()
    if mode == "stubborn" and term is None:
        trial.note("the stubborn FIRST got no SIGTERM before its SIGKILL")
    return trial


@pytest.mark.parametrize("ttl", sorted(TRIALS), ids=[f"ttl{t:g}" for t in sorted(TRIALS)])
def test_a_blackholed_dmutex_run_stops_its_command_before_another_starts(
    cli_server: Server, tmp_path: Path, ttl: float
) -> None:
    """Every trial: FIRST's last stamp precedes SECOND's start; exit statuses 70 and 0."""
    env = cli.environment(tmp_path)
    count = TRIALS[ttl]
    started = time.monotonic()
    with (
        deadlines.Scheduling.watching() as scheduling,
        ThreadPoolExecutor(count, thread_name_prefix="cli-trial") as pool,
    ):
        futures = [
            pool.submit(one_trial, cli_server, env, tmp_path / f"trial-{i:02d}", ttl, i)
            for i in range(count)
        ]
        # Each trial bounds its own waits (start, renewal, both runs): a minute is plenty.
        trials = [future.result(timeout=120) for future in futures]
    case = f"cli-ttl{ttl:g}"
    margin = deadlines.record(case, trials, scheduling)
    print(f"[deadlines {case}] {margin.text()} seconds={time.monotonic() - started:.1f}")
    deadlines.judge(margin, trials)


# --- --kill-grace against --ttl ---------------------------------------------------------------


@pytest.mark.parametrize("grace", ["5", "2"])
def test_a_kill_grace_not_well_below_the_ttl_is_a_usage_error(tmp_path: Path, grace: str) -> None:
    env = cli.environment(tmp_path)
    done = cli.run(["run", "--ttl", "2", "--kill-grace", grace, "k", "--", "true"], env)
    assert done.status == 64, done.stderr
    assert "--kill-grace" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("grace", [None, "0.25"], ids=["default", "0.25"])
def test_a_short_ttl_runs_with_the_default_or_a_small_kill_grace(
    tmp_path: Path, grace: str | None
) -> None:
    env = cli.environment(tmp_path)
    options = [] if grace is None else ["--kill-grace", grace]
    done = cli.run(["run", "--ttl", "2", *options, "k", "--", "true"], env)
    assert done.status == 0, done.stderr

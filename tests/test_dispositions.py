"""A part of the suite run as a background job runs it: SIGINT and SIGQUIT ignored, no terminal.

A process started in the background by a non-interactive shell (``nohup``,
cron, a deploy hook, many CI runners) inherits SIGINT and SIGQUIT ignored,
and no controlling terminal; with stdin closed, it is how a new user's
``bash .ci/run &`` runs the suite. The tests here run, in such a process,
the tests that stop a child with SIGINT, and must pass there as they do in
a terminal's foreground (``tests/conftest.py`` gives children the default
dispositions).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).parent.parent

# The tests that interrupt a child with SIGINT: a Python server process (its
# KeyboardInterrupt), and `dmutex status --watch` on SQLite, both forms.
INTERRUPTING = (
    "tests/test_servers.py::test_a_process_is_stopped_with_its_own_stop_signal",
    "tests/integration/test_cli_namespace.py::test_watch_as_text_heads_each_read",
    "tests/integration/test_cli_namespace.py::test_watch_reads_again_until_interrupted[sqlite]",
)

# Ignores SIGINT and SIGQUIT, as a background job's shell does, then becomes
# the program of its arguments (exec keeps an ignored disposition).
AS_BACKGROUND_JOB = (
    "import os, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "signal.signal(signal.SIGQUIT, signal.SIG_IGN)\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)


def as_background_job(args: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` with SIGINT and SIGQUIT ignored, stdin closed, in a new session."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    return subprocess.run(
        [sys.executable, "-c", AS_BACKGROUND_JOB, sys.executable, *args],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,  # no controlling terminal
        check=False,
    )


def test_a_background_job_starts_with_sigint_and_sigquit_ignored() -> None:
    """The premise of the test below: the way it starts pytest ignores both signals."""
    probe = (
        "import signal, sys\n"
        "print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN,"
        " signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN, sys.stdin.read() == '')\n"
    )
    done = as_background_job(["-c", probe], timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "True"]


def test_the_interrupting_tests_pass_in_a_background_job() -> None:
    done = as_background_job(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *INTERRUPTING],
        timeout=300,
    )
    tail = "\n".join(done.stdout.splitlines()[-15:])
    assert done.returncode == 0, f"exit status {done.returncode}:\n{tail}\n{done.stderr[-2000:]}"
    assert f"{len(INTERRUPTING)} passed" in done.stdout, tail

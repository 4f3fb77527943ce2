"""The base the test servers share (tests/_support/servers.py): processes, the order, the pool."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests._support import servers
from tests._support.servers import (
    Discovery,
    Pool,
    ServerProcess,
    Step,
    alive,
    discover_in_order,
)

# A stand-in server: says where it runs, then sleeps until stopped.
SLEEPER = "import os, sys, time; print('up', os.getuid(), flush=True); time.sleep(600)"


def _sleeper(folder: Path, port: int) -> list[str]:
    return [sys.executable, "-I", "-c", SLEEPER]


def _logged(process: ServerProcess) -> str:
    if "up" not in process.log_tail():
        raise ConnectionError("not up yet")
    return process.log_tail()


def test_a_process_answers_then_is_stopped_by_its_pid_and_its_folder_removed() -> None:
    process = ServerProcess("sleeper")
    answer = process.start(_sleeper, lambda port: _logged(process), (ConnectionError,))
    assert answer.startswith("up ")
    pid, folder = process.pid, process.folder
    assert process.running
    assert folder.is_dir()
    assert alive(pid)
    process.stop()
    assert not alive(pid)
    assert not folder.exists()
    assert not process.running


def test_a_process_is_stopped_with_its_own_stop_signal() -> None:
    # Kept, so that its log outlives the stop: SIGINT is Python's KeyboardInterrupt.
    process = ServerProcess("sleeper", keep=True, stop_signal=signal.SIGINT)
    try:
        process.start(_sleeper, lambda port: _logged(process), (ConnectionError,))
        pid = process.pid
        process.stop()
        assert not alive(pid)
        assert "KeyboardInterrupt" in process.log_tail()
    finally:
        process.close()


def test_a_kept_process_restarts_on_the_same_port_and_folder() -> None:
    process = ServerProcess("sleeper", keep=True)
    try:
        process.start(_sleeper, lambda port: _logged(process), (ConnectionError,))
        port, folder, first = process.port, process.folder, process.pid
        process.kill()
        assert not alive(first)
        assert folder.is_dir()
        process.start(_sleeper, lambda port: _logged(process), (ConnectionError,))
        assert (process.port, process.folder) == (port, folder)
        assert process.pid != first
    finally:
        process.close()
    assert not folder.exists()


def test_a_process_that_exits_first_is_reported_with_its_log() -> None:
    process = ServerProcess("broken")

    def command(folder: Path, port: int) -> list[str]:
        return [sys.executable, "-c", "print('no config here'); raise SystemExit(3)"]

    def never(port: int) -> None:
        raise ConnectionError("not up")

    with pytest.raises(RuntimeError, match="broken exited with code 3 before answering: no config"):
        process.start(command, never, (ConnectionError,))
    assert process._proc is None
    assert process._dir is None


def test_a_running_process_refuses_a_second_start() -> None:
    process = ServerProcess("sleeper")
    try:
        process.start(_sleeper, lambda port: _logged(process), (ConnectionError,))
        with pytest.raises(RuntimeError, match=f"already running \\(pid {process.pid}\\)"):
            process.start(_sleeper, lambda port: _logged(process), (ConnectionError,))
    finally:
        process.stop()


def test_as_user_runs_the_command_through_runuser() -> None:
    assert servers.as_user(["postgres", "-D", "x"], None) == ["postgres", "-D", "x"]
    assert servers.as_user(["postgres"], "nobody") == ["runuser", "-u", "nobody", "--", "postgres"]


def test_a_process_run_as_another_user_owns_its_folder_and_is_stopped_with_its_group() -> None:
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        pytest.skip("runuser as another user needs root and util-linux's runuser")
    user = "nobody"
    uid = pwd.getpwnam(user).pw_uid
    process = ServerProcess("as-user", user=user)

    def command(folder: Path, port: int) -> list[str]:
        # The system's shell: the user may not read this checkout's interpreter.
        return ["/bin/sh", "-c", 'echo up "$(id -u)"; exec sleep 600']

    answer = process.start(command, lambda port: _logged(process), (ConnectionError,))
    assert answer == f"up {uid}"
    assert process.folder.stat().st_uid == uid
    leader = process.pid
    group = subprocess.run(
        ["ps", "-o", "pid=", "-g", str(leader)], capture_output=True, text=True, check=True
    ).stdout.split()
    assert str(leader) in group
    process.stop()
    assert not any(alive(int(pid)) for pid in group), group


@dataclass
class Fake:
    label: str
    fails: bool = False
    starts: int = 0
    stops: int = 0

    def start(self) -> str:
        self.starts += 1
        if self.fails:
            raise OSError(f"{self.label} cannot start")
        return f"running {self.label}"

    def stop(self) -> None:
        self.stops += 1


def test_discovery_takes_the_first_step_that_gives_sources_and_says_what_it_passed_over() -> None:
    steps = [
        Step("url", "X_URL is unset", lambda: []),
        Step("docker", "no Docker daemon answers", lambda: []),
        Step("path", "no x-server on PATH", lambda: [Fake("x-1"), Fake("x-2")]),
        Step("fallback", "no fallback", lambda: [Fake("never")]),
    ]
    found = discover_in_order(steps, "no X")
    assert found.labels == ["x-1", "x-2"]
    assert found.passed_over == ["X_URL is unset", "no Docker daemon answers"]
    assert found.header("x servers") == (
        "x servers: x-1, x-2 (X_URL is unset; no Docker daemon answers)"
    )


def test_no_source_gives_one_line_naming_each_step_and_what_a_knob_leaves_out() -> None:
    steps: list[Step[Fake]] = [
        Step("url", "X_URL is unset", list),
        Step("docker", "no Docker daemon answers", list),
    ]
    found = discover_in_order(steps, "no X")
    assert found.sources == []
    assert found.reason == "no X: X_URL is unset, and no Docker daemon answers"
    only = discover_in_order(steps, "no X", allowed=["docker"], knob="X_SERVERS")
    assert only.reason == "no X: no Docker daemon answers; X_SERVERS leaves out url"
    assert only.header("x") == f"x: none ({only.reason})"


class FakePool(Pool[Fake, str]):
    def start_source(self, source: Fake) -> str:
        return source.start()


def test_the_pool_starts_each_source_once_remembers_a_failure_and_stops_all() -> None:
    good, bad = Fake("good"), Fake("bad", fails=True)
    pool = FakePool(Discovery([good, bad]))
    assert pool.started("good") == pool.started("good") == "running good"
    assert good.starts == 1
    with pytest.raises(OSError, match="bad cannot start"):
        pool.started("bad")
    with pytest.raises(RuntimeError, match="bad did not start") as again:
        pool.started("bad")
    assert isinstance(again.value.__cause__, OSError)
    assert bad.starts == 1
    pool.close()
    assert (good.stops, bad.stops) == (1, 1)

"""The README's first command: the example runs and reports what happened."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parent.parent / "examples" / "threads.py"


def test_threads_example_runs_and_reports() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "with DMutex:    1600 of 1600 increments survived" in lines
    assert any(line.startswith("DSemaphore(max_permits=3): at most ") for line in lines)
    peak = int(lines[2].split("at most ")[1].split()[0])
    assert 1 <= peak <= 3
    assert "locks left behind: 0" in lines
    assert lines[-1] == "OK"


CONTEND = EXAMPLE.parent / "contend.sh"


def test_contend_example_shows_the_second_command_refused_and_the_third_waiting(
    tmp_path: Path,
) -> None:
    """Run as the README's first command runs it: dmutex on PATH, the default lock file."""
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "dmutex").exists(), "the console script is installed beside the interpreter"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "XDG_STATE_HOME": str(tmp_path)}
    done = subprocess.run(
        ["sh", str(CONTEND)], capture_output=True, text=True, timeout=120, check=False, env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 4, lines
    first = re.fullmatch(r"first:  holds quickstart \(fence (\d+)\) for 2 s", lines[0])
    assert first is not None, lines[0]
    assert lines[1] == "second: -n refused at once, exit status 75"
    third = re.fullmatch(r"third:  waited for the first, then ran \(fence (\d+)\)", lines[2])
    assert third is not None, lines[2]
    assert int(third[1]) > int(first[1]), "fences strictly increase"
    assert lines[3] == "lock free again: OK"
    assert (tmp_path / "dmutex" / "locks.sqlite3").exists()

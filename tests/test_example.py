"""The README's first command: the example runs and reports what happened."""

from __future__ import annotations

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

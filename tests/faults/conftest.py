"""The fault suites' report: the smallest deadline margin of each case, in the summary."""

from __future__ import annotations

import pytest

from tests._support import deadlines


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line, "deadline margins: redis-sync min 0.093 s (ttl 1 s) over 20 trials, ..."."""
    line = deadlines.summary_line()
    if line is not None:
        terminalreporter.write_line(line)

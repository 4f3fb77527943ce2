"""The test harness (``tests/_support``), loaded as pytest plugins: real servers and their rules.

The fault suites (``tests/faults``) run last, after every other test: they
time what they test, and CI starts this run while other interpreters' suites
still run beside it (``.ci/run``), which end long before.

The children the tests start get the signal dispositions the tests depend
on, not the ones this run inherited: a run started in the background by a
non-interactive shell (``nohup``, cron, a deploy hook, many CI runners)
inherits SIGINT and SIGQUIT *ignored*, and an ignored disposition is passed
on to every child through ``exec``. Tests that stop a child with SIGINT
(Python's ``KeyboardInterrupt``, ``dmutex status --watch``, PostgreSQL's fast
shutdown) would then wait for a child that never stops. So the run puts them
back to their defaults as it starts (:func:`pytest_configure`); a test that
wants a child to ignore a signal says so for that child. ``tests/test_dispositions.py``
runs a part of the suite with both ignored, so that this cannot come back unseen.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import pytest

pytest_plugins = [
    "tests._support.plugins.redis",
    "tests._support.plugins.mongodb",
    "tests._support.plugins.postgresql",
    "tests._support.plugins.mysql",
    "tests._support.plugins.etcd",
    "tests._support.plugins.dynamodb",
]

FAULTS = Path(__file__).parent / "faults"


# The signals whose inherited "ignored" the run undoes, and what it puts instead:
# SIGINT gets Python's own handler (children then start with the default, as
# handlers are reset by exec), SIGQUIT the default (a core dump, as in a shell).
DEFAULT_DISPOSITIONS: dict[signal.Signals, Callable[[int, FrameType | None], object] | int] = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGQUIT: signal.SIG_DFL,
}


def pytest_configure(config: pytest.Config) -> None:
    """Undo an inherited "ignored" SIGINT or SIGQUIT, so that children start with the defaults."""
    for signum, disposition in DEFAULT_DISPOSITIONS.items():
        if signal.getsignal(signum) == signal.SIG_IGN:
            signal.signal(signum, disposition)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move the fault suites' tests after all the others, each group in its own order."""
    items.sort(key=lambda item: item.path.is_relative_to(FAULTS))

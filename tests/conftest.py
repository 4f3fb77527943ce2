"""The test harness (``tests/_support``), loaded as pytest plugins: real servers and their rules.

The fault suites (``tests/faults``) run last, after every other test: they
time what they test, and CI starts this run while other interpreters' suites
still run beside it (``.ci/run``), which end long before.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = [
    "tests._support.plugins.redis",
    "tests._support.plugins.mongodb",
    "tests._support.plugins.postgresql",
    "tests._support.plugins.mysql",
]

FAULTS = Path(__file__).parent / "faults"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move the fault suites' tests after all the others, each group in its own order."""
    items.sort(key=lambda item: item.path.is_relative_to(FAULTS))

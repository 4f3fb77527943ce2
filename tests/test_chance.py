"""dmutex draws its jitter and spreading from its own generator, never the ``random`` module's.

``_core/chance.py`` states the rules. Checked here: no module of the
package but that one imports ``random`` (read from the sources), a seeded
``random`` generator is where its seed left it after retries, renewals and
semaphore slots, and a forked child's draws are not its parent's.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dmutex._core.chance import CHANCE

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "dmutex"
CHANCE_MODULE = PACKAGE / "_core" / "chance.py"


def imports_random(path: Path) -> list[int]:
    """The lines of ``path`` that import the ``random`` module or a name from it."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name == "random" for a in node.names):
            lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module == "random":
            lines.append(node.lineno)
    return lines


def test_only_the_chance_module_imports_random() -> None:
    found = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != CHANCE_MODULE and (lines := imports_random(path))
    }
    assert found == {}, "draw from dmutex._core.chance.CHANCE instead"
    assert imports_random(CHANCE_MODULE), "the check reads imports: it finds chance.py's own"


def shared_draws(source: str) -> list[int]:
    """The lines of ``source`` calling the ``random`` module's functions (its shared generator)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "random"
        and node.func.attr not in ("Random", "SystemRandom")
    ]


def test_the_suite_draws_from_no_shared_generator_either() -> None:
    # Why pyproject.toml may ignore Hypothesis's warning about draws from the
    # shared generator during a strategy: no test code makes one (its
    # generators are random.Random instances), so what it sees is a client's
    # background thread (pymongo's monitor, psycopg_pool's jitter).
    tests = Path(__file__).resolve().parent
    found = {
        str(path.relative_to(tests)): lines
        for path in sorted(tests.rglob("*.py"))
        if (lines := shared_draws(path.read_text()))
    }
    assert found == {}, "draw from a random.Random instance of the test's own"
    assert shared_draws("import random\nrandom.Random(1).random()\nrandom.choice([1])\n") == [3]


# Run in a fresh interpreter: in this one, the clients other tests left open
# (pymongo's monitor draws a request id per heartbeat) may draw from the
# shared generator at any moment.
EXERCISE = """
import random, sys, time
from dmutex import DMutex, DSemaphore, InMemoryBackend, SQLiteBackend

store = InMemoryBackend() if sys.argv[1] == "memory" else SQLiteBackend(sys.argv[2])
random.seed(1234)
before = random.getstate()

holder = DMutex("svc", store).acquire("job", 1.0, auto_renew=True)
assert holder is not None
# Retries: each wait between attempts is jittered.
assert DMutex("svc", store).acquire_with_retry("job", timeout=0.2, retry_delay=0.02) is None
# Renewals: each interval is jittered; a 1 s lease renews every 0.3 to 0.33 s.
time.sleep(0.8)
assert holder.lost is False
assert holder.release() is True
# Slots: a semaphore's permits, taken and given back.
semaphore = DSemaphore("svc", store, max_permits=3)
permits = [semaphore.acquire("pool", 5.0) for _ in range(3)]
assert semaphore.acquire_with_retry("pool", timeout=0.1, retry_delay=0.02) is None
assert [p is not None and p.release() for p in permits] == [True] * 3

print("unchanged" if random.getstate() == before else "drawn from")
"""


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
def test_retries_renewals_and_slots_leave_a_seeded_random_as_it_was(
    backend: str, tmp_path: Path
) -> None:
    child = subprocess.run(
        [sys.executable, "-c", EXERCISE, backend, str(tmp_path / "locks.db")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert child.stdout.strip() == "unchanged", "dmutex drew from the random module's generator"


def test_a_forked_child_does_not_repeat_its_parents_draws() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one draw, written for the parent, then out at once
        os.write(write, CHANCE.getrandbits(64).to_bytes(8, "big"))
        os._exit(0)
    os.close(write)
    theirs = int.from_bytes(os.read(read, 8), "big")
    os.close(read)
    assert os.waitpid(pid, 0)[1] == 0
    assert theirs != CHANCE.getrandbits(64), "a generator with state in the process was copied"

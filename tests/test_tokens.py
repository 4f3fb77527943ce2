"""Ownership tokens: random UUID4 strings, never handed out twice, made in batches.

``new_token`` makes 64 at a time from one ``os.urandom`` read and hands them
out one per acquire; these tests pin what that must not change: the shape of
``str(uuid.uuid4())``, uniqueness across batches and threads, and a forked
child that never hands out a token its parent holds in reserve.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid

import pytest

from dmutex._core.lease import new_token


def test_a_token_reads_as_uuid4_across_several_batches() -> None:
    tokens = [new_token() for _ in range(64 * 5 + 3)]
    assert len(set(tokens)) == len(tokens)
    for token in tokens:
        parsed = uuid.UUID(token)
        assert parsed.version == 4
        assert parsed.variant == uuid.RFC_4122
        assert str(parsed) == token


def test_threads_never_share_a_token() -> None:
    found: list[list[str]] = [[] for _ in range(8)]

    def take(mine: list[str]) -> None:
        mine.extend(new_token() for _ in range(500))

    threads = [threading.Thread(target=take, args=(mine,)) for mine in found]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [token for mine in found for token in mine]
    assert len(set(every)) == len(every) == 8 * 500


# Run in a fresh interpreter: forking this one, whose other tests may have
# left threads running, is what Python 3.12+ warns against.
FORKING = """
import os
from dmutex._core.lease import new_token

new_token()  # a batch made: the rest wait in reserve
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(write, "\\n".join(new_token() for _ in range(64)).encode())
    os._exit(0)
os.close(write)
with os.fdopen(read) as pipe:
    child = set(pipe.read().split("\\n"))
os.waitpid(pid, 0)
parent = {new_token() for _ in range(64)}
print(len(child), len(child & parent))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_forked_child_draws_none_of_its_parents_reserve() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FORKING], capture_output=True, text=True, timeout=60, check=True
    )
    made, shared = map(int, done.stdout.split())
    assert made == 64
    assert shared == 0, "the child handed out tokens its parent had in reserve"

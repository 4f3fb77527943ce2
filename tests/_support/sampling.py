"""Watching from a test: a sampler thread, a bounded poll, a process's state.

- :func:`sampling`: call a check every so often while a block runs;
- :func:`until`: poll a condition, failing the test after a timeout;
- :func:`process_state`: a process's state letter from /proc ("T" when stopped);
- :class:`Background`: a function in a daemon thread, its outcome awaited with a bound.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import pytest

T = TypeVar("T")


@contextlib.contextmanager
def sampling(sample: Callable[[], None], every: float, name: str) -> Iterator[None]:
    """Call ``sample()`` every ``every`` seconds in a thread named ``name`` while the block runs.

    The thread stops with the block; an exception it raised fails the test there.
    """
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            while not stop.wait(every):
                sample()
        except Exception as error:  # noqa: BLE001 - ends the sampling; the test reports it
            errors.append(error)

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive(), f"the sampler {name} did not stop"
    assert not errors, f"the sampler {name} raised: {errors!r}"


def until(
    condition: Callable[[], bool],
    what: str,
    timeout: float,
    *,
    poll: float = 0.005,
    why: Callable[[], str] | None = None,
) -> None:
    """Poll ``condition()`` every ``poll`` s until it holds; fail the test after ``timeout`` s.

    ``why``: called once on failure, for what the message should add (say, what
    the process that was to make the condition hold printed, and its exit status).
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {timeout} s" + (f"; {why()}" if why else ""))
        time.sleep(poll)


def process_state(pid: int) -> str | None:
    """The process state letter from /proc ("T" when stopped), or None without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or the read
        return None


def wait_stopped(pid: int, timeout: float, *, poll: float = 0.005) -> None:
    """After a SIGSTOP to ``pid``: wait until /proc shows it stopped (no wait without /proc)."""
    if process_state(pid) is not None:
        until(lambda: process_state(pid) in ("T", "t"), "the holder stopped", timeout, poll=poll)


class Background(Generic[T]):
    """``fn()`` in a daemon thread (so a failed test never hangs the run), and its outcome."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._value: T | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as error:  # noqa: BLE001 - re-raised in result()
            self._error = error
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, within: float = 10.0) -> T | None:
        """``fn``'s result, or what it raised; fails the test if it runs past ``within`` s."""
        if not self._done.wait(within):
            pytest.fail(f"the thread was still running after {within} s")
        if self._error is not None:
            raise self._error
        return self._value

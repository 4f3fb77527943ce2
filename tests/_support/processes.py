"""Test helpers for OS processes: workers started together, a child stopped, servers stopped.

- :func:`run_workers`: ``count`` spawned workers started together on a barrier,
  their reports collected; in a worker, :func:`report_errors` sends its report
  or its traceback, and :func:`cycle` / :func:`cycle_async` run its cycles
  (a plain ``acquire()``, on refusal counted and ``acquire_with_retry()``),
  counted in a :class:`Tally` that becomes its :class:`Report`;
- :func:`spawned`: one spawned child that reports ``(kind, payload)`` over a
  queue, which the test may stop (SIGSTOP), continue, let go on or kill; in
  the child, :func:`send_results` sends its results or its traceback;
- :func:`stop_process`: a server we started, stopped by its pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import os
import queue
import signal
import subprocess
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias, TypeVar

import pytest

from tests._support.sampling import wait_stopped

R = TypeVar("R")
Reports: TypeAlias = "multiprocessing.queues.Queue[tuple[int, object]]"
Barrier: TypeAlias = multiprocessing.synchronize.Barrier
ChildReports: TypeAlias = "multiprocessing.queues.Queue[tuple[str, object]]"

BARRIER_TIMEOUT = (
    60.0  # a worker's wait on the barrier: spawning and importing on a busy 2-core machine
)
DEADLINE = 120.0  # for a whole group of workers, start to finish


def stop_process(process: subprocess.Popen[bytes], timeout: float = 10) -> None:
    """Stop a server we started, by its pid: terminate, then kill if it lingers."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def run_workers(
    target: Callable[..., None], count: int, *args: object, deadline: float, report: type[R]
) -> list[R]:
    """Start ``count`` processes of ``target`` together; return their reports, in order.

    ``target(worker, reports, barrier, *args)`` waits on ``barrier`` and puts
    ``(worker, report)`` or ``(worker, traceback text)`` on ``reports``. Fails
    the test if a worker raised, died without reporting, or has not finished
    within ``deadline`` seconds; terminates any worker still running.
    """
    ctx = multiprocessing.get_context("spawn")
    reports: Reports = ctx.Queue()
    barrier = ctx.Barrier(count)
    processes = [
        ctx.Process(target=target, args=(i, reports, barrier, *args), daemon=True)
        for i in range(count)
    ]
    outcomes: dict[int, object] = {}
    ends = time.monotonic() + deadline
    problem = ""
    try:
        for process in processes:
            process.start()
        while len(outcomes) < count and not problem:
            remaining = ends - time.monotonic()
            if remaining <= 0:
                problem = f"workers still running after {deadline} s"
                break
            try:
                worker, outcome = reports.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [
                    i
                    for i, p in enumerate(processes)
                    if i not in outcomes and p.exitcode is not None
                ]
                if dead:
                    # Give a report already in the pipe a moment to arrive.
                    try:
                        worker, outcome = reports.get(timeout=2.0)
                    except queue.Empty:
                        problem = f"workers {dead} exited without a report"
                        break
                else:
                    continue
            outcomes[worker] = outcome
        for process in processes:
            process.join(max(0.1, ends - time.monotonic()))
    finally:
        stragglers = [i for i, p in enumerate(processes) if p.is_alive()]
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(5)
        for process in processes:
            if not process.is_alive():
                process.close()
        reports.close()
        reports.join_thread()
    errors = {i: o for i, o in outcomes.items() if isinstance(o, str)}
    if errors:
        pytest.fail("\n".join(f"worker {i} raised:\n{tb}" for i, tb in sorted(errors.items())))
    if problem:
        pytest.fail(problem)
    if stragglers:
        pytest.fail(f"workers {stragglers} reported but did not exit")
    return [o for _, o in sorted(outcomes.items()) if isinstance(o, report)]


class Reporting(Protocol):
    """A worker's running counts."""

    def report(self) -> object:
        """What the worker sends to the parent."""
        ...


T = TypeVar("T", bound=Reporting)


def report_errors(
    worker: int, reports: Reports, barrier: Barrier, tally: T, body: Callable[[T], None]
) -> None:
    """In a worker of :func:`run_workers`: run ``body(tally)``; send ``tally.report()``, or the
    traceback of what ``body`` raised."""
    try:
        body(tally)
    except BaseException:
        barrier.abort()  # release the others from the barrier if we failed before it
        reports.put((worker, traceback.format_exc()))
        raise
    reports.put((worker, tally.report()))


@dataclass(frozen=True)
class Report:
    """What one worker of a counter or gauge test saw (the Redis and PostgreSQL tests')."""

    worker: int
    cycles: int  # cycles completed: acquired, worked, released
    refused: int  # plain acquire() attempts that returned None
    peak: int = 0  # highest reading of the gauge (semaphore test)
    slots: tuple[int, ...] = ()  # every slot a permit reported (semaphore test)
    foreign: int = 0  # times the lock's record did not hold this worker's token
    failed_releases: int = 0  # release() that returned False


@dataclass
class Tally:
    """A worker's running counts, turned into a :class:`Report` at the end."""

    worker: int
    cycles: int = 0
    refused: int = 0
    peak: int = 0
    slots: set[int] = field(default_factory=set)
    foreign: int = 0
    failed_releases: int = 0

    def report(self) -> Report:
        return Report(
            self.worker,
            self.cycles,
            self.refused,
            self.peak,
            tuple(sorted(self.slots)),
            self.foreign,
            self.failed_releases,
        )


class Done(Protocol):
    """What a worker's report says of its cycles."""

    @property
    def cycles(self) -> int: ...

    @property
    def failed_releases(self) -> int: ...


def check_cycles(reports: Sequence[Done], workers: int, cycles: int) -> None:
    """Every worker reported, each ran all its ``cycles``, and no release returned False."""
    assert len(reports) == workers
    assert [r.cycles for r in reports] == [cycles] * workers
    assert sum(r.failed_releases for r in reports) == 0


# --- a worker's cycles: one plain acquire, then acquire_with_retry when refused ---------


class Counts(Protocol):
    """What :func:`cycle` counts in a worker's tally."""

    cycles: int
    refused: int  # plain acquire() attempts that returned None
    failed_releases: int  # release() that returned False


class Lease(Protocol):
    def release(self) -> bool: ...


class AsyncLease(Protocol):
    def release(self) -> Awaitable[bool]: ...


L = TypeVar("L", bound=Lease)
L_co = TypeVar("L_co", bound=Lease, covariant=True)
A = TypeVar("A", bound=AsyncLease)
A_co = TypeVar("A_co", bound=AsyncLease, covariant=True)


class Acquiring(Protocol[L_co]):
    """A DMutex or DSemaphore."""

    def acquire(self, key: str, ttl: float | None = None) -> L_co | None: ...

    def acquire_with_retry(
        self, key: str, *, ttl: float | None = None, timeout: float = ..., retry_delay: float = ...
    ) -> L_co | None: ...


class AsyncAcquiring(Protocol[A_co]):
    """An AsyncDMutex or AsyncDSemaphore."""

    def acquire(self, key: str, ttl: float | None = None) -> Awaitable[A_co | None]: ...

    def acquire_with_retry(
        self, key: str, *, ttl: float | None = None, timeout: float = ..., retry_delay: float = ...
    ) -> Awaitable[A_co | None]: ...


@dataclass(frozen=True)
class Retry:
    """How a worker's cycle acquires: its TTL, and ``acquire_with_retry``'s timeout and delay."""

    ttl: float
    timeout: float
    retry_delay: float


def cycle(
    face: Acquiring[L],
    key: str,
    tally: Counts,
    cycles: int,
    work: Callable[[L], None],
    retry: Retry,
    *,
    pause: float = 0.0,
) -> None:
    """``cycles`` times: acquire (counting a refusal, then retrying), ``work``, release.

    Counts the cycles and the releases that returned False; sleeps ``pause``
    after each release when given.
    """
    for _ in range(cycles):
        lease = face.acquire(key, ttl=retry.ttl)
        if lease is None:
            tally.refused += 1
            lease = face.acquire_with_retry(
                key, ttl=retry.ttl, timeout=retry.timeout, retry_delay=retry.retry_delay
            )
        assert lease is not None, "acquire_with_retry timed out"
        work(lease)
        if not lease.release():
            tally.failed_releases += 1
        tally.cycles += 1
        if pause:
            time.sleep(pause)


async def cycle_async(
    face: AsyncAcquiring[A],
    key: str,
    tally: Counts,
    cycles: int,
    work: Callable[[A], Awaitable[None]],
    retry: Retry,
) -> None:
    """:func:`cycle` on the asyncio face."""
    for _ in range(cycles):
        lease = await face.acquire(key, ttl=retry.ttl)
        if lease is None:
            tally.refused += 1
            lease = await face.acquire_with_retry(
                key, ttl=retry.ttl, timeout=retry.timeout, retry_delay=retry.retry_delay
            )
        assert lease is not None, "acquire_with_retry timed out"
        await work(lease)
        if not await lease.release():
            tally.failed_releases += 1
        tally.cycles += 1


# --- one child, stopped and continued by the test ---------------------------------------


def send_results(reports: ChildReports, run: Callable[[], object]) -> None:
    """In a :func:`spawned` child: send ``("results", run())``, or ``("error", traceback)``."""
    try:
        results = run()
    except BaseException:
        reports.put(("error", traceback.format_exc()))
        raise
    reports.put(("results", results))


@dataclass
class Child:
    """A spawned child process and its report queue (see :func:`spawned`)."""

    process: multiprocessing.process.BaseProcess
    reports: ChildReports
    go: multiprocessing.synchronize.Event
    who: str  # named in a failure: "the holder", "the child"
    stopped: bool = False

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert pid is not None
        return pid

    def report(self, expected: str, timeout: float) -> object:
        """The child's next report, which must be of kind ``expected``; fails the test if the
        child raised or sent nothing within ``timeout`` s."""
        try:
            kind, payload = self.reports.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"{self.who} sent no {expected!r} report within {timeout} s")
        if kind == "error":
            pytest.fail(f"{self.who} raised:\n{payload}")
        assert kind == expected
        return payload

    def stop(self, timeout: float, *, poll: float) -> None:
        """SIGSTOP, then wait until the kernel shows the child stopped."""
        os.kill(self.pid, signal.SIGSTOP)
        self.stopped = True
        wait_stopped(self.pid, timeout, poll=poll)

    def go_on(self) -> None:
        """SIGCONT, and set the event the child waits on."""
        os.kill(self.pid, signal.SIGCONT)
        self.stopped = False
        self.go.set()

    def finish(self, expected: str, timeout: float) -> object:
        """The child's last report, then its exit: it must exit 0 within ``timeout`` s."""
        payload = self.report(expected, timeout)
        self.process.join(timeout)
        assert self.process.exitcode == 0
        return payload

    def kill(self, timeout: float) -> None:
        """SIGKILL, and wait until the child is gone: killed, not exited."""
        os.kill(self.pid, signal.SIGKILL)
        self.process.join(timeout)
        assert self.process.exitcode == -signal.SIGKILL

    def _end(self) -> None:
        process = self.process
        if process.is_alive():
            if self.stopped:
                os.kill(self.pid, signal.SIGCONT)
            process.terminate()
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
        process.close()
        self.reports.close()
        self.reports.join_thread()


@contextlib.contextmanager
def spawned(target: Callable[..., None], *args: object, who: str = "the holder") -> Iterator[Child]:
    """Start ``target(*args, reports, go)`` in a spawned daemon process; end it after the block.

    ``reports`` is a queue of ``(kind, payload)``, ``go`` an event the child
    may wait on. After the block a child still alive is continued if stopped,
    then terminated (killed if it lingers); the queue is closed.
    """
    ctx = multiprocessing.get_context("spawn")
    reports: ChildReports = ctx.Queue()
    go = ctx.Event()
    process = ctx.Process(target=target, args=(*args, reports, go), daemon=True)
    process.start()
    child = Child(process, reports, go, who)
    try:
        yield child
    finally:
        child._end()


def by_kind(
    worker: int,
    sync: Callable[[Tally], None],
    asynchronous: Callable[[Tally], Coroutine[Any, Any, None]],
) -> Callable[[Tally], None]:
    """Even workers sync, odd ones asyncio (each in an event loop of its own)."""
    return sync if worker % 2 == 0 else (lambda tally: asyncio.run(asynchronous(tally)))

"""Test helpers for OS processes: workers started together, servers stopped by pid."""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import queue
import subprocess
import time
from collections.abc import Callable
from typing import TypeAlias, TypeVar

import pytest

R = TypeVar("R")
Reports: TypeAlias = "multiprocessing.queues.Queue[tuple[int, object]]"
Barrier: TypeAlias = multiprocessing.synchronize.Barrier


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

"""The second holders of a deadline case, in a process of their own.

A deadline case (``tests/faults/deadlines/test_deadlines.py``, and its PostgreSQL and
MySQL rigs) cuts the holders' network, then lets a second holder per trial
poll its key until granted. Those second holders run here, in a spawned
process (:func:`spawned_rivals`), not in the holders' process: twenty of them
polling every 10 ms there took the holders' GIL for most of each second (on
the MongoDB test server, pymongo's encoding and decoding alone), so that the
holders' timekeeper woke up to 0.14 s late, and in one CI run a holder was
told 1 ms after its key was taken. No deployment puts another holder's
polling in the holder's own process; the test now does not either.

The child reaches the store directly, as :class:`Direct` says (plain data,
so that it pickles), opens its locks and checks each is ready, reports
``ready``, waits for ``go`` (set right after the cut), then runs one thread
per trial: ``acquire_with_retry`` until granted, the grant time read
(``time.monotonic()``: ``CLOCK_MONOTONIC``, one clock for every process of
the host) as soon as the acquire returns, then a release. It reports each
trial's :class:`Taken`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dmutex import DMutex, SQLiteBackend
from tests._support import processes
from tests._support.processes import Child, ChildReports

READY_TIMEOUT = 60.0  # spawning, importing and connecting, on a busy 2-core machine
GO_TIMEOUT = 120.0  # the child's wait for the cut: the holders take their leases meanwhile


@dataclass(frozen=True)
class Direct:
    """How the second holders reach the store, bypassing the fault.

    ``target``: a Redis, MongoDB or PostgreSQL URL, or the folder of the SQLite
    files (trial ``i``'s is ``trial-{i:02d}.sqlite3``); ``connect``: PyMySQL's
    connect arguments; ``options``: what every ``DMutex`` is given besides its
    client (``db_name``, ``schema_name``, ``table_name``).
    """

    backend: Literal["redis", "mongo", "sqlite", "postgresql", "mysql"]
    target: str = ""
    connect: tuple[tuple[str, Any], ...] = ()
    options: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Rival:
    """One trial's second holder: its key, and how long it keeps trying."""

    index: int
    key: str
    ttl: float  # of its own lease, released at once
    timeout: float
    retry_delay: float


@dataclass(frozen=True)
class Taken:
    """What one second holder got: the grant's time, or why none."""

    key: str
    taken: float | None
    note: str | None = None


def sqlite_file(folder: Path, index: int) -> Path:
    """Trial ``index``'s SQLite file in ``folder``."""
    return folder / f"trial-{index:02d}.sqlite3"


def _locks(direct: Direct, service: str) -> tuple[Callable[[int], DMutex], list[Any]]:
    """A lock for each trial index (shared where one client serves all), and what to close."""
    options = dict(direct.options)
    closing: list[Any] = []
    if direct.backend == "sqlite":
        made: dict[int, DMutex] = {}

        def per_file(index: int) -> DMutex:
            if index not in made:
                backend = SQLiteBackend(sqlite_file(Path(direct.target), index))
                closing.append(backend)
                made[index] = DMutex(service, backend, **options)
            return made[index]

        return per_file, closing
    client: Any
    if direct.backend == "redis":
        import redis

        client = redis.Redis.from_url(direct.target)
    elif direct.backend == "mongo":
        import pymongo

        client = pymongo.MongoClient(direct.target)
    elif direct.backend == "postgresql":
        import psycopg

        client = psycopg.connect(direct.target, autocommit=True)
    else:
        import pymysql

        client = pymysql.connect(**dict(direct.connect))
    closing.append(client)
    shared = DMutex(service, client, **options)
    return lambda _index: shared, closing


def _hold(lock: DMutex, rival: Rival) -> Taken:
    try:
        handle = lock.acquire_with_retry(
            rival.key, ttl=rival.ttl, timeout=rival.timeout, retry_delay=rival.retry_delay
        )
    except Exception as error:  # noqa: BLE001 - a direct client should not fail: noted
        return Taken(rival.key, None, f"the second holder's acquire raised {error!r}")
    if handle is None:
        return Taken(rival.key, None)
    taken = time.monotonic()
    handle.release()
    return Taken(rival.key, taken)


def _serve(
    direct: Direct,
    service: str,
    rivals: Sequence[Rival],
    reports: ChildReports,
    go: Any,  # multiprocessing.synchronize.Event
) -> None:
    """In the child: open the locks, report ready, wait for go, run every rival at once."""

    def run() -> list[Taken]:
        lock_of, closing = _locks(direct, service)
        try:
            locks = {rival.key: lock_of(rival.index) for rival in rivals}
            for lock in {id(lock): lock for lock in locks.values()}.values():
                lock.ready()  # connected and ready before the cut
            reports.put(("ready", None))
            if not go.wait(GO_TIMEOUT):
                raise TimeoutError(f"no go within {GO_TIMEOUT} s")
            results: dict[str, Taken] = {}

            def one(rival: Rival) -> None:
                results[rival.key] = _hold(locks[rival.key], rival)

            threads = [
                threading.Thread(target=one, args=(rival,), name=f"rival-{rival.key}")
                for rival in rivals
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            return [results[rival.key] for rival in rivals]
        finally:
            for each in closing:
                each.close()

    processes.send_results(reports, run)


@contextmanager
def spawned_rivals(direct: Direct, service: str, rivals: Sequence[Rival]) -> Iterator[Child]:
    """The second holders' process, ready (its locks open) when the block starts.

    In the block: ``child.go.set()`` right after the cut, then
    ``child.finish("results", timeout)`` is a ``list[Taken]`` in ``rivals``' order.
    The process is ended (by its pid) after the block if it still runs.
    """
    with processes.spawned(
        _serve, direct, service, list(rivals), who="the second holders' process"
    ) as child:
        child.report("ready", READY_TIMEOUT)
        yield child

"""PostgreSQL killed (SIGKILL) and started again under load: acknowledged leases survive.

A cluster of the test's own (``RestartablePostgres``: ``synchronous_commit``
on, ``fsync`` off) SIGKILLed (postmaster by pid, then its backends) and
started again on its port and folder, twice, while sync (psycopg pools)
and asyncio (asyncpg pools) workers loop ``acquire_with_retry`` / work /
release on a mutex and a semaphore, each statement's tokens recorded
(``tests._support.postgres_faults``). A lease taken before the first kill
is still held after both restarts (its row read back) and releases True,
and leases acknowledged just before each kill are all there after it.
Exceptions are connection errors only, none before the first kill; no
overlap; nothing left but rows of a raised acquire or release.

``-s`` prints a summary line. ``DMUTEX_FAULT_SEED`` changes the seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import psycopg
import psycopg_pool
import pytest

from dmutex import AsyncDMutex, AsyncDSemaphore, DMutex, DSemaphore
from tests._support import fault_servers, postgres_servers
from tests._support.faces import Calls, await_calls, run_calls
from tests._support.postgres_faults import (
    ASYNC_FAILURES,
    PERMITS,
    SEED,
    SENT,
    SYNC_FAILURES,
    Inspector,
    Kind,
    Lock,
    SpiedAsyncpg,
    asyncpg_dsn,
    make_lock,
    spied_pool,
    table_of,
    unclear,
)
from tests._support.tracking import Tracker

RESTART_TTL = 2.0  # a leftover of a raised acquire blocks the key this long
STRADDLER_TTL = 60.0
RESTART_RETRY_TIMEOUT = 30.0  # longer than any outage here: acquire_with_retry never gives up
RESTART_WORK = 0.01
PROBES = 20  # leases acknowledged just before each kill, read back after the restart
CYCLES_AFTER_RESTART = 3  # every worker completes this many more after each restart
RESTART_WAIT = 30.0


@dataclass
class Restarts:
    """What the restart test's workers share."""

    inspectors: dict[Kind, Inspector]
    trackers: dict[Kind, Tracker]
    stop: threading.Event = field(default_factory=threading.Event)
    first_kill: float | None = None
    errors: list[tuple[float, str, str]] = field(default_factory=list)  # (when, worker, type)
    unexpected: list[str] = field(default_factory=list)
    raised: set[str] = field(default_factory=set)  # tokens of an acquire or release that raised
    cycles: Counter[str] = field(default_factory=Counter)
    gave_up: int = 0  # acquire_with_retry answered None
    stale: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def failed(self, worker: str, failures: tuple[type[Exception], ...], error: Exception) -> None:
        with self._lock:
            if isinstance(error, failures) and unclear(error) is None:
                self.errors.append((time.monotonic(), worker, type(error).__name__))
            else:
                self.unexpected.append(f"{worker}: {error!r}")


def restart_worker(
    shared: Restarts, name: str, kind: Kind, lock: Lock, failures: tuple[type[Exception], ...]
) -> Calls[None]:
    """Loop acquire_with_retry / work / release until told to stop; every error recorded."""
    asynchronous = isinstance(lock, (AsyncDMutex, AsyncDSemaphore))
    rng = random.Random(f"{SEED}:{name}")

    def nap(seconds: float) -> Any:
        if asynchronous:
            return asyncio.sleep(seconds)
        time.sleep(seconds)
        return None

    while not shared.stop.is_set():
        sent: list[str] = []
        SENT.set(sent)
        try:
            handle: Any = yield lock.acquire_with_retry(
                "k", ttl=RESTART_TTL, timeout=RESTART_RETRY_TIMEOUT, retry_delay=0.05
            )
        except Exception as error:  # noqa: BLE001 - judged: a connection error, when
            shared.failed(name, failures, error)
            shared.raised.update(sent)
            yield nap(0.05)
            continue
        if handle is None:
            shared.gave_up += 1
            continue
        shared.trackers[kind].enter("k", hash(name), handle.expired_at)
        yield nap(rng.uniform(0, RESTART_WORK))
        shared.trackers[kind].leave("k", hash(name))
        try:
            released = yield handle.release()
        except Exception as error:  # noqa: BLE001 - as above; its lease ends by its TTL
            shared.failed(name, failures, error)
            shared.raised.add(handle.token)
            continue
        try:
            held = shared.inspectors[kind].holding([handle.token])
        except psycopg.OperationalError:  # the server is down again: not the worker's doing
            held = []
        if held:
            shared.stale.append(f"{name}: release answered {released}, yet {held} hold")
        with shared._lock:
            shared.cycles[name] += 1


def probe(url: str, service: str) -> list[str]:
    """``PROBES`` leases acknowledged on a direct connection: their tokens."""
    with psycopg.connect(url, autocommit=True) as conn:
        lock = DMutex(service, conn, default_ttl_seconds=STRADDLER_TTL)
        tokens = []
        for n in range(PROBES):
            handle = lock.acquire(f"probe-{n}")
            assert handle is not None
            tokens.append(handle.token)
    return tokens


def test_the_server_killed_and_restarted_twice_under_load() -> None:
    """SIGKILL, restart on the same port and folder, twice: see the module docstring."""
    bindirs = postgres_servers.candidate_bindirs()
    if not bindirs:
        pytest.skip("no initdb and postgres to run a server of the test's own")
    rng = random.Random(f"{SEED}:restart")
    server = fault_servers.RestartablePostgres(bindirs[0])
    with contextlib.ExitStack() as stack:
        stack.enter_context(server)
        server.start()
        url = server.url
        services: dict[Kind, str] = {"mutex": "restart", "semaphore": "restart"}
        inspectors = {
            kind: stack.enter_context(
                contextlib.closing(Inspector(url, None, table_of(kind, services[kind])))
            )
            for kind in ("mutex", "semaphore")
        }
        # The straddler: one of the semaphore's three permits, across both restarts.
        with psycopg.connect(url, autocommit=True) as conn:
            make_lock("sync", "mutex", conn, services["mutex"], None).ready()
            keeper = make_lock("sync", "semaphore", conn, services["semaphore"], None)
            assert isinstance(keeper, DSemaphore)
            straddler = keeper.acquire("k", ttl=STRADDLER_TTL)
            assert straddler is not None
        trackers = {"mutex": Tracker(1), "semaphore": Tracker(PERMITS["semaphore"])}
        trackers["semaphore"].enter("k", -1, straddler.expired_at)
        shared = Restarts(inspectors, trackers)  # type: ignore[arg-type]  # closing() wraps
        pools: list[psycopg_pool.ConnectionPool[Any]] = []
        threads: list[threading.Thread] = []
        for kind in ("mutex", "semaphore"):
            for n in range(2):
                pool = spied_pool(url)
                stack.callback(pool.close)
                pools.append(pool)
                lock = make_lock("sync", kind, pool, services[kind], None)
                calls = restart_worker(shared, f"sync-{kind}-{n}", kind, lock, SYNC_FAILURES)
                threads.append(threading.Thread(target=run_calls, args=(calls,), daemon=True))

        async def asyncio_workers() -> None:
            pools: list[Any] = []
            try:
                tasks = []
                for kind in ("mutex", "semaphore"):
                    for n in range(2):
                        pool = await asyncpg.create_pool(
                            **asyncpg_dsn(url),
                            min_size=1,
                            max_size=2,
                            connection_class=SpiedAsyncpg,
                        )
                        pools.append(pool)
                        lock = make_lock("async", kind, pool, services[kind], None)
                        calls = restart_worker(
                            shared, f"async-{kind}-{n}", kind, lock, ASYNC_FAILURES
                        )
                        tasks.append(asyncio.ensure_future(await_calls(calls)))
                await asyncio.gather(*tasks)
            finally:
                for pool in pools:
                    pool.terminate()

        outcome: list[BaseException] = []

        def loop() -> None:
            try:
                asyncio.run(asyncio.wait_for(asyncio_workers(), 120))
            except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
                outcome.append(error)

        threads.append(threading.Thread(target=loop, daemon=True))
        names = [
            f"{face}-{kind}-{n}" for face in ("sync", "async") for kind in PERMITS for n in (0, 1)
        ]
        for thread in threads:
            thread.start()
        stack.callback(shared.stop.set)

        def more_cycles(least: int) -> None:
            deadline = time.monotonic() + RESTART_WAIT
            while not all(shared.cycles[n] >= least for n in names):
                assert time.monotonic() < deadline, f"cycles by worker: {dict(shared.cycles)}"
                assert not outcome, outcome
                time.sleep(0.02)

        more_cycles(CYCLES_AFTER_RESTART)
        lost_probes: list[int] = []
        downtimes = []
        for _ in range(2):
            tokens = probe(url, "probes")
            if shared.first_kill is None:
                shared.first_kill = time.monotonic()
            server.kill()
            down = rng.uniform(0.5, 1.0)
            downtimes.append(down)
            time.sleep(down)
            server.start()
            with psycopg.connect(url, autocommit=True) as conn:
                found = conn.execute(
                    'SELECT count(*) FROM "_dmutex_probes" WHERE "value" = ANY(%s)', (tokens,)
                ).fetchone()
                conn.execute('DELETE FROM "_dmutex_probes"')
            lost_probes.append(PROBES - int(found[0]) if found else PROBES)
            least = min(shared.cycles[n] for n in names) + CYCLES_AFTER_RESTART
            more_cycles(least)
        straddling = inspectors["semaphore"].holding([straddler.token])
        shared.stop.set()
        for thread in threads:
            thread.join(RESTART_RETRY_TIMEOUT + 10)
        assert not any(t.is_alive() for t in threads), "a worker did not stop"
        if outcome:
            raise outcome[0]
        with psycopg.connect(url, autocommit=True) as conn:
            keeper = make_lock("sync", "semaphore", conn, services["semaphore"], None)
            assert isinstance(keeper, DSemaphore)
            straddler_released = keeper.release("k", straddler.token)
            trackers["semaphore"].leave("k", -1)
        leftovers = {
            kind: [r for r in inspectors[kind].live() if r.token not in shared.raised]
            for kind in inspectors
        }
        explained = sum(
            1 for kind in inspectors for r in inspectors[kind].live() if r.token in shared.raised
        )
        errors = Counter(kind for _, _, kind in shared.errors)
        before = [e for e in shared.errors if shared.first_kill is None or e[0] < shared.first_kill]
        print(
            f"[pg-restart] seed={SEED} starts={server.starts} "
            f"down={[round(d, 2) for d in downtimes]} "
            f"cycles={sum(shared.cycles.values())} errors={dict(errors)} "
            f"lost_probes={lost_probes} explained_leftovers={explained} gave_up={shared.gave_up} "
            f"overlaps={trackers['mutex'].overlaps + trackers['semaphore'].overlaps}"
        )
        assert shared.unexpected == [], shared.unexpected
        assert before == [], f"errors before the first kill: {before}"
        assert sum(errors.values()) > 0, "the kills reached no worker"
        assert lost_probes == [0, 0], f"acknowledged leases lost by a kill: {lost_probes}"
        assert straddling == [f"permit:{straddler.slot}:k"], "the straddler's row after the kills"
        assert straddler_released is True
        assert shared.gave_up == 0
        assert shared.stale == [], shared.stale
        assert trackers["mutex"].overlaps == trackers["semaphore"].overlaps == 0
        assert leftovers == {"mutex": [], "semaphore": []}, f"orphans: {leftovers}"

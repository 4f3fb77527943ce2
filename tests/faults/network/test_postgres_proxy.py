"""PostgreSQL through a faulty network: no overlap, no orphan, no lie.

What must hold, whatever the network does: **no overlap** (at no instant
more unexpired holders of a key than its permits), **no orphan** (a row
still live after every worker has released is a lease whose acquire
raised: its clean-up release, engine rule 6, could not get through either;
it ends by its TTL), **no lie** (a release that answered True deleted the
row, an acquire that answered None holds nothing), and every failure is an
exception of the client's own, as clear as the client makes it. psycopg and
asyncpg retry nothing: a request or reply the network loses is an
exception to the caller, and that connection is dead. The workers use
pools, which replace a dead connection; each records the tokens its
statements carry (``tests._support.postgres_faults``: ``SpiedConnection``,
``SpiedAsyncpg``), so that a leftover row is matched to the raised acquire
that explains it.

Sync: a ``psycopg_pool.ConnectionPool``, or a single psycopg connection in
autocommit that the worker replaces after each failure and releases by
token on; asyncio: an ``asyncpg`` pool; mutex and ``max_permits=3``. Four
or six workers, each through a
:class:`~tests._support.fault_proxy.FaultProxy` of its own (2% requests
dropped, 5% replies dropped after the server ran them, 5% delayed, 1%
torn; the startup packet and the request after each fault spared), run
rounds of acquire (else ``acquire_with_retry``) / work / release; one has a
key of its own, the others share one. After each round, and at the end
with faults off, every live row must be explained, and expire within its
TTL. After a release returned (True or False) its token holds no row, and
no row is live after a release statement with its token completed; after
an acquire answered None its tokens hold none; an acquire that raised sent
its clean-up release (rule 6: on a pool it gets through, on a single
connection it fails with it, so those leftovers run out by TTL). An
acquire on the worker's own free key answering None is a wrong None
(unless an explained leftover holds it).

Everything is bounded: rounds stop after a few seconds, every wait has a
timeout, the proxies stop by themselves. ``-s`` prints a summary line per
case. ``DMUTEX_FAULT_SEED`` changes the seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import psycopg
import pytest

from dmutex import AsyncDMutex, AsyncDSemaphore, DMutex, DSemaphore
from tests._support import postgres_servers
from tests._support.faces import Calls, await_calls, run_calls
from tests._support.fault_proxy import Fault, FaultProxy, Rates
from tests._support.postgres_faults import (
    ASYNC_FAILURES,
    PERMITS,
    RELEASED,
    SEED,
    SENT,
    SYNC_FAILURES,
    TTL,
    Inspector,
    Kind,
    Lock,
    SpiedAsyncpg,
    SpiedConnection,
    SyncLock,
    asyncpg_dsn,
    is_startup,
    make_lock,
    proxied_url,
    release_by_token,
    service_name,
    spied_pool,
    table_of,
    unclear,
)
from tests._support.tracking import Tracker

# A mutex's lease released by its token on a new connection: unlock(key, token), deprecated,
# is the one way (a handle cannot move to another instance). Threads and tasks share the
# filters, so warnings.catch_warnings() around each call would not be safe here.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:(Async)?DMutex\.unlock\(\) is deprecated:DeprecationWarning"
)

RATES = Rates(drop_request=0.02, drop_reply=0.05, delay=0.05, cut=0.01)
WORK = 0.003  # the most a holder works, in seconds
RETRY_TIMEOUT = 4.0  # longer than TTL: a waiter outlasts a leftover lease
RETRY_DELAY = 0.01
RELEASE_ATTEMPTS = 3
WORKERS = {"mutex": 4, "semaphore": 6}  # per proxy case: one on its own key, the rest share one
ROUND = 10  # cycles per worker between two idle checks
ROUNDS = 10
ROUNDS_DEADLINE = 6.0  # no round starts after this, seconds from the first
ROUND_TIMEOUT = 30.0


# --- what a run saw ---------------------------------------------------------------------------


@dataclass
class Run:
    """What one proxy case's workers share, and what it found."""

    kind: Kind
    inspector: Inspector
    failures: tuple[type[Exception], ...]
    tracker: Tracker
    raised: set[str] = field(default_factory=set)  # tokens of acquires that raised
    abandoned: set[str] = field(default_factory=set)  # tokens whose release never answered
    returned: set[str] = field(default_factory=set)
    counts: Counter[str] = field(default_factory=Counter)
    exceptions: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    explained: int = 0  # leftover rows of a raised acquire or release
    overlong: list[str] = field(default_factory=list)  # leftovers that outlive their TTL
    stale: list[str] = field(default_factory=list)  # a token holding a row after its release
    took_on_none: list[str] = field(default_factory=list)  # an acquire answered None, yet holds
    no_cleanup: list[str] = field(default_factory=list)  # an acquire raised, sent no release
    after_release: list[str] = field(default_factory=list)  # live after its release completed
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def failed(self, what: str, error: Exception) -> None:
        with self._lock:
            self.exceptions[f"{what}:{type(error).__name__}"] += 1

    def blocked_by_leftover(self, key: str) -> bool:
        """Whether ``key``'s live rows are all leftovers a raise explains (then deleted)."""
        rows = [r for r in self.inspector.live() if r.key.endswith(f":{key}")]
        with self._lock:
            explained = [r for r in rows if r.token in self.raised or r.token in self.abandoned]
        if not rows or len(explained) != len(rows):
            return False
        with self._lock:
            self.explained += len(rows)
        self.inspector.delete([r.token for r in rows])
        return True

    def idle_check(self) -> None:
        """Nobody holds or acquires: every live row must be explained, and end within its TTL."""
        leftovers = self.inspector.live()
        with self._lock:
            for row in leftovers:
                if row.token in RELEASED:
                    self.after_release.append(f"{row.key} ({row.token})")
                elif row.token in self.raised or row.token in self.abandoned:
                    self.explained += 1
                    if row.left > TTL + 0.05:
                        self.overlong.append(f"{row.key} {row.left:.3f} s left")
                else:
                    self.orphans.append(f"{row.key} ({row.token})")
        if leftovers:  # the next round starts clean: each is counted once
            self.inspector.delete([row.token for row in leftovers])


class Worker:
    """One worker: its lock (on a pool through its proxy), key, and the calls of a cycle."""

    def __init__(
        self,
        run: Run,
        index: int,
        lock: Lock,
        key: str,
        solo: bool,
        reconnect: Callable[[], SyncLock] | None = None,
    ) -> None:
        self.run = run
        self.index = index
        self.lock = lock
        # A single connection: a new one (and lock) after each failure, which broke it.
        self.reconnect = reconnect
        self.key = key
        self.solo = solo
        self.rng = random.Random(f"{SEED}:{index}")
        self.asynchronous = isinstance(lock, (AsyncDMutex, AsyncDSemaphore))

    def nap(self, seconds: float) -> Any:
        if self.asynchronous:
            return asyncio.sleep(seconds)
        time.sleep(seconds)
        return None

    def cycle(self) -> Calls[None]:
        run = self.run
        sent: list[str] = []
        SENT.set(sent)
        handle: Any = None
        retrying = False
        try:
            handle = yield self.lock.acquire(self.key, ttl=TTL)
            if handle is None and self.solo and run.blocked_by_leftover(self.key):
                run.count("own_key_blocked_by_leftover")
            elif handle is None:
                run.count("wrong_none" if self.solo else "refused")
                if held := run.inspector.holding(sent):
                    run.took_on_none.append(f"acquire answered None, yet {held} hold its token")
                if not self.solo:
                    sent.clear()
                    retrying = True
                    handle = yield self.lock.acquire_with_retry(
                        self.key, ttl=TTL, timeout=RETRY_TIMEOUT, retry_delay=RETRY_DELAY
                    )
                    if handle is None:
                        run.count("retry_timeout")
                        if held := run.inspector.holding(sent):
                            run.took_on_none.append(f"retry answered None, yet {held} hold")
        except run.failures as error:
            run.failed("acquire", error)
            run.raised.update(sent)
            self.renew()
            if why := unclear(error):
                run.unexpected.append(why)
            # Sent, then failed: engine rule 6 sends a release by its token next (one attempt
            # sends its token once; the proxy lets the statement after a fault through).
            if not retrying and sent and sent.count(sent[0]) < 2:
                run.no_cleanup.append(f"acquire raised {error!r} and sent no release")
        except Exception as error:  # noqa: BLE001 - not a connection error: a defect, reported
            run.unexpected.append(f"acquire raised {error!r}")
            run.raised.update(sent)
        if handle is None:
            return
        run.count("acquired")
        run.returned.add(handle.token)
        run.tracker.enter(self.key, self.index, handle.expired_at)
        yield self.nap(self.rng.uniform(0, WORK))
        run.tracker.leave(self.key, self.index)
        for attempt in range(RELEASE_ATTEMPTS):
            try:
                if attempt and self.reconnect is not None:  # by its token, on the new connection
                    assert isinstance(self.lock, (DMutex, DSemaphore))
                    released = release_by_token(self.lock, self.key, handle.token)
                else:
                    released = yield handle.release()
            except run.failures as error:
                run.failed("release", error)
                self.renew()
                if why := unclear(error):
                    run.unexpected.append(why)
                continue
            if not released:
                run.count("release_false")
            if held := run.inspector.holding([handle.token]):
                run.stale.append(f"release answered {released}, yet {held} hold its token")
                run.inspector.delete([handle.token])
            return
        run.count("release_gave_up")
        run.abandoned.add(handle.token)

    def renew(self) -> None:
        """After a failure on a single connection: a new connection and lock (else nothing)."""
        if self.reconnect is None:
            return
        self.lock = self.reconnect()

    def cycles(self, count: int, deadline: float) -> Calls[None]:
        for _ in range(count):
            if time.monotonic() > deadline:
                return
            run_ = self.cycle()
            yield from run_


def summary(run: Run, label: str, proxies: Sequence[FaultProxy], seconds: float) -> str:
    faults: Counter[str] = Counter()
    for proxy in proxies:
        faults.update({f.value: n for f, n in proxy.counts.items() if f is not Fault.PASS})
    shown = " ".join(f"{f.value}={faults[f.value]}" for f in Fault if f is not Fault.PASS)
    exceptions = ",".join(f"{k}:{v}" for k, v in sorted(run.exceptions.items())) or "none"
    counts = " ".join(f"{k}={v}" for k, v in sorted(run.counts.items()))
    return (
        f"[pg-proxy {label} {run.kind}] seed={SEED} {counts} faults: {shown} "
        f"exceptions={exceptions} explained_leftovers={run.explained} orphans={len(run.orphans)} "
        f"stale={len(run.stale)} overlaps={run.tracker.overlaps} peak={run.tracker.peak} "
        f"seconds={seconds:.1f}"
    )


def judge(run: Run, proxies: Sequence[FaultProxy]) -> None:
    errors = [e for p in proxies for e in p.errors]
    assert not errors, errors
    assert sum(p.injected for p in proxies) > 0, "no fault was injected"
    assert run.counts["acquired"] > 0, "nothing was acquired"
    assert sum(run.exceptions.values()) > 0, "no fault reached a caller"
    problems = [
        f"{what}: {found}"
        for what, found in (
            ("overlaps", run.tracker.overlaps),
            ("wrong None on a free key", run.counts["wrong_none"]),
            ("unexpected exceptions", run.unexpected),
            ("orphans", run.orphans),
            ("leftovers outliving their TTL", run.overlong),
            ("tokens holding a row after release", run.stale),
            ("rows taken by an acquire that answered None", run.took_on_none),
            ("rows live after their release statement completed", run.after_release),
            ("failed acquires that sent no clean-up release", run.no_cleanup),
        )
        if found
    ]
    assert not problems, "; ".join(problems)


# --- the proxy cases --------------------------------------------------------------------------


def _cycles(worker: Worker, hard: float, errors: list[BaseException]) -> None:
    try:
        run_calls(worker.cycles(ROUND, hard))
    except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
        errors.append(error)


def drive_sync(workers: Sequence[Worker], run: Run) -> None:
    started = time.monotonic()
    for _ in range(ROUNDS):
        if time.monotonic() - started > ROUNDS_DEADLINE:
            break
        hard = time.monotonic() + ROUND_TIMEOUT
        errors: list[BaseException] = []
        threads = [
            threading.Thread(target=_cycles, args=(w, hard, errors), daemon=True) for w in workers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(ROUND_TIMEOUT + 10)
        assert not any(t.is_alive() for t in threads), "a worker hung"
        if errors:
            raise errors[0]
        run.idle_check()


async def drive_async(workers: Sequence[Worker], run: Run) -> None:
    started = time.monotonic()
    for _ in range(ROUNDS):
        if time.monotonic() - started > ROUNDS_DEADLINE:
            break
        hard = time.monotonic() + ROUND_TIMEOUT
        tasks = [asyncio.ensure_future(await_calls(w.cycles(ROUND, hard))) for w in workers]
        await asyncio.wait_for(asyncio.gather(*tasks), ROUND_TIMEOUT + 10)
        await asyncio.to_thread(run.idle_check)


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
@pytest.mark.parametrize("face", ["sync", "sync-connection", "async"])
def test_workers_through_a_faulty_network(
    postgres_server: str, postgres_schema: str, face: str, kind: Kind
) -> None:
    """Pools (or single connections) through seeded faults: no overlap, orphan or lie."""
    service = service_name("net")
    inspector = Inspector(postgres_server, postgres_schema, table_of(kind, service))
    failures = ASYNC_FAILURES if face == "async" else SYNC_FAILURES
    run = Run(kind, inspector, failures, Tracker(PERMITS[kind]))
    upstream = postgres_servers.upstream_of(postgres_server)
    keys = ["shared"] * (WORKERS[kind] - 1) + ["own"]
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        stack.callback(inspector.close)
        proxies = [
            stack.enter_context(
                FaultProxy(
                    upstream,
                    RATES,
                    seed=SEED + index + {"sync": 0, "sync-connection": 50, "async": 100}[face],
                    spare=is_startup,
                    calm_after_fault=1,
                    lifetime=120,
                )
            )
            for index in range(WORKERS[kind])
        ]
        if face == "sync":
            pools = [
                stack.enter_context(spied_pool(proxied_url(postgres_server, proxy)))
                for proxy in proxies
            ]
            workers = []
            for index, (pool, key) in enumerate(zip(pools, keys, strict=True)):
                lock = make_lock("sync", kind, pool, service, postgres_schema)
                assert isinstance(lock, (DMutex, DSemaphore))
                lock.ready()
                workers.append(Worker(run, index, lock, key, key == "own"))
            with contextlib.ExitStack() as faults:
                for proxy in proxies:
                    faults.enter_context(proxy.faults())
                drive_sync(workers, run)
        elif face == "sync-connection":
            opened: list[psycopg.Connection[Any]] = []

            @stack.callback
            def close_all() -> None:
                for conn in opened:
                    conn.close()

            def connected(proxy: FaultProxy) -> Callable[[], SyncLock]:
                made: list[psycopg.Connection[Any]] = []

                def reconnect() -> SyncLock:
                    """Close the worker's broken connection; a new one through its proxy."""
                    if made:
                        made.pop().close()
                    conn = SpiedConnection.connect(
                        proxied_url(postgres_server, proxy), autocommit=True
                    )
                    made.append(conn)
                    opened.append(conn)
                    lock = make_lock("sync", kind, conn, service, postgres_schema)
                    assert isinstance(lock, (DMutex, DSemaphore))
                    return lock

                return reconnect

            workers = []
            for index, (proxy, key) in enumerate(zip(proxies, keys, strict=True)):
                reconnect = connected(proxy)
                lock = reconnect()
                lock.ready()
                workers.append(Worker(run, index, lock, key, key == "own", reconnect))
            with contextlib.ExitStack() as faults:
                for proxy in proxies:
                    faults.enter_context(proxy.faults())
                drive_sync(workers, run)
        else:

            async def main() -> None:
                pools: list[asyncpg.Pool[Any]] = []
                try:
                    for proxy in proxies:
                        dsn = asyncpg_dsn(proxied_url(postgres_server, proxy))
                        pool = await asyncpg.create_pool(
                            **dsn, min_size=1, max_size=2, connection_class=SpiedAsyncpg
                        )
                        pools.append(pool)
                    workers = []
                    for index, (pool, key) in enumerate(zip(pools, keys, strict=True)):
                        lock = make_lock("async", kind, pool, service, postgres_schema)
                        assert isinstance(lock, (AsyncDMutex, AsyncDSemaphore))
                        await lock.ready()
                        workers.append(Worker(run, index, lock, key, key == "own"))
                    with contextlib.ExitStack() as faults:
                        for proxy in proxies:
                            faults.enter_context(proxy.faults())
                        await drive_async(workers, run)
                finally:
                    for pool in pools:
                        pool.terminate()

            asyncio.run(asyncio.wait_for(main(), 90))
        run.idle_check()  # faults off: whatever is left is judged too
        print(summary(run, face, proxies, time.monotonic() - started))
        judge(run, proxies)

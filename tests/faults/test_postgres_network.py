"""PostgreSQL through a faulty network, a killed server and bad server states.

What must hold, whatever the network or the server does: **no overlap** (at
no instant more unexpired holders of a key than its permits), **no orphan**
(a row still live after every worker has released is a lease whose acquire
raised: its clean-up release, engine rule 6, could not get through either;
it ends by its TTL), **no lie** (a release that answered True deleted the
row, an acquire that answered None holds nothing), and every failure is an
exception of the client's own, as clear as the client makes it. psycopg and
asyncpg retry nothing: a request or reply the network loses is an
exception to the caller, and that connection is dead. The workers use
pools, which replace a dead connection; each records the tokens its
statements carry (:class:`SpiedConnection`, :class:`SpiedAsyncpg`), so that
a leftover row is matched to the raised acquire that explains it.

- **Proxy** (sync: a ``psycopg_pool.ConnectionPool``, or a single psycopg
  connection in autocommit that the worker replaces after each failure and
  releases by token on; asyncio: an ``asyncpg`` pool; mutex and
  ``max_permits=3``): four or six workers, each through a
  :class:`~tests._support.fault_proxy.FaultProxy` of its own (2% requests
  dropped, 5% replies dropped after the server ran them, 5% delayed, 1%
  torn; the startup packet and the request after each fault spared), run
  rounds of acquire (else ``acquire_with_retry``) / work / release; one has
  a key of its own, the others share one. After each round, and at the end
  with faults off, every live row must be explained, and expire within its
  TTL. After a release returned (True or False) its token holds no row, and
  no row is live after a release statement with its token completed; after
  an acquire answered None its tokens hold none; an acquire that raised
  sent its clean-up release (rule 6: on a pool it gets through, on a
  single connection it fails with it, so those leftovers run out by TTL).
  An acquire on the worker's own free key answering None is a wrong None
  (unless an explained leftover holds it).
- **Lost reply**: a reply to an acquire dropped by the proxy after the
  server ran it; the same acquire (same token) sent again on a new
  connection answers with the slot the first took, and one row holds it.
- **Restart**: a cluster of the test's own (``RestartablePostgres``:
  ``synchronous_commit`` on, ``fsync`` off) SIGKILLed (postmaster by pid,
  then its backends) and started again on its port and folder, twice,
  while sync and asyncio workers loop ``acquire_with_retry`` / work /
  release on a mutex and a semaphore. A lease taken before the first kill
  is still held after both restarts (its row read back) and releases True.
  Exceptions are connection errors only, none before the first kill; no
  overlap; nothing left but rows of a raised acquire or release.
- **Killed connection**: ``pg_terminate_backend`` of the holder's backend
  from another session: its next call on a single connection raises a
  connection error (psycopg: ``AdminShutdown``; asyncpg: ``InterfaceError``
  or the internal error below); a psycopg pool that checks connections
  (``check=ConnectionPool.check_connection``) answers the next call; one
  that does not lends the dead connection once, and an asyncpg pool may
  (that call fails as a single connection does): either answers the call
  after. The lease row is
  intact throughout, and release by token on a new connection deletes it.
- **Deadline**: the partition guarantee on PostgreSQL, with
  ``test_deadlines.py``'s own cases (``sync_case``, ``async_case``; 10
  trials at TTLs of 1 to 2 s): holders with ``auto_renew=True`` through
  proxies that become blackholes, without any client timeout
  (:class:`PostgresDeadlineRig`); every telling comes before a direct
  second holder's grant, and the margins join the terminal summary.

asyncpg has one error that is not a connection error by type: a connection
whose server ended it while idle, used before asyncpg has seen it close,
raises ``InternalClientError("cannot switch to state 12; another operation
(2) is in progress")`` (MagicStack/asyncpg issues 784 and 1069). It is
accepted with that message only (:func:`unclear`), and shown by name in
the summaries.
- **Bad states**: a role that may only read the table (SELECT only; and
  ``default_transaction_read_only``): acquire raises the server's
  ``InsufficientPrivilege`` / ``ReadOnlySqlTransaction`` (asyncpg's twins),
  and nothing is written. A ``statement_timeout`` while another session
  holds the lease row's lock in an open transaction: acquire raises
  ``QueryCanceled``, no row changed, none left after the blocker rolls back
  or commits, and acquire then works.

Everything is bounded: rounds stop after a few seconds, every wait has a
timeout, the proxies stop by themselves. ``-s`` prints a summary line per
case. ``DMUTEX_FAULT_SEED`` changes the seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias
from urllib.parse import quote

import asyncpg
import psycopg
import psycopg.errors
import psycopg_pool
import pytest
from psycopg import sql

from dmutex import AsyncDMutex, AsyncDSemaphore, DMutex, DSemaphore
from dmutex._backends.postgresql import PostgresStore
from dmutex._clock import SYSTEM_CLOCK
from dmutex._core.effects import Steps
from dmutex._core.lease import Lease
from dmutex._runtime.drivers import AsyncDriver, SyncDriver
from tests._support import fault_servers, postgres_servers, servers
from tests._support.faces import Calls, await_calls, run_calls
from tests._support.fault_proxy import Fault, FaultProxy, Rates
from tests._support.rivals import Direct
from tests._support.tracking import Tracker
from tests.faults import test_deadlines

# A mutex's lease released by its token on a new connection: unlock(key, token), deprecated,
# is the one way (a handle cannot move to another instance). Threads and tasks share the
# filters, so warnings.catch_warnings() around each call would not be safe here.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:(Async)?DMutex\.unlock\(\) is deprecated:DeprecationWarning"
)

Kind: TypeAlias = Literal["mutex", "semaphore"]
FaceName: TypeAlias = Literal["sync", "async"]
SyncLock: TypeAlias = DMutex | DSemaphore
AsyncLock: TypeAlias = AsyncDMutex | AsyncDSemaphore
Lock: TypeAlias = SyncLock | AsyncLock

SEED = int(os.environ.get("DMUTEX_FAULT_SEED", "20240611"))
PERMITS = {"mutex": 1, "semaphore": 3}
RATES = Rates(drop_request=0.02, drop_reply=0.05, delay=0.05, cut=0.01)
TTL = 1.0  # every worker's lease: an orphan lasts this long at most
WORK = 0.003  # the most a holder works, in seconds
RETRY_TIMEOUT = 4.0  # longer than TTL: a waiter outlasts a leftover lease
RETRY_DELAY = 0.01
RELEASE_ATTEMPTS = 3
WORKERS = {"mutex": 4, "semaphore": 6}  # per proxy case: one on its own key, the rest share one
ROUND = 10  # cycles per worker between two idle checks
ROUNDS = 10
ROUNDS_DEADLINE = 6.0  # no round starts after this, seconds from the first
ROUND_TIMEOUT = 30.0
CONNECT_TIMEOUT = 2  # seconds: libpq's connect_timeout, asyncpg's timeout
POOL_TIMEOUT = 5.0  # psycopg_pool's wait for a connection

TOKEN = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")

# What the clients raise when the network or the server goes away.
SYNC_FAILURES: tuple[type[Exception], ...] = (psycopg.OperationalError,)
ASYNC_FAILURES: tuple[type[Exception], ...] = (
    asyncpg.PostgresConnectionError,  # ConnectionDoesNotExistError, ...
    asyncpg.CannotConnectNowError,  # the server starting up (recovery)
    asyncpg.InterfaceError,  # "connection is closed" on a proxy of a dead connection
    OSError,  # ConnectionRefusedError, ConnectionResetError
    asyncio.TimeoutError,  # the connect timeout
    # A connection whose server ended it while idle, used before asyncpg saw it close:
    # "cannot switch to state 12; another operation (2) is in progress" (MagicStack/asyncpg
    # issues 784 and 1069, open). Only that message is let through: see ``judged_async``.
    asyncpg.InternalClientError,
)
ASYNCPG_STATE_ERROR = "another operation (2) is in progress"


def unclear(error: BaseException) -> str | None:
    """Why ``error``, a failure of the asyncio client, is not the known one; None if it is."""
    if isinstance(error, asyncpg.InternalClientError) and ASYNCPG_STATE_ERROR not in str(error):
        return f"asyncpg's internal error is not the known one: {error!r}"
    return None


# --- the tokens each call sent ----------------------------------------------------------------

SENT: ContextVar[list[str] | None] = ContextVar("SENT", default=None)
# Tokens whose release statement completed: the server answered it, so no live row holds them.
RELEASED: set[str] = set()
RELEASE_TEXT = "WITH gone AS (DELETE FROM"  # how dmutex's release statement starts


def _released(query: object, values: Sequence[object]) -> None:
    if isinstance(query, str) and query.startswith(RELEASE_TEXT):
        RELEASED.update(v for v in values if isinstance(v, str) and TOKEN.fullmatch(v))


def _note(values: Sequence[object]) -> None:
    """Record every token among ``values`` in the calling worker's list (if it keeps one)."""
    sent = SENT.get()
    if sent is not None:
        sent.extend(v for v in values if isinstance(v, str) and TOKEN.fullmatch(v))


class SpiedConnection(psycopg.Connection[tuple[Any, ...]]):
    """A psycopg connection that records the tokens of each statement, before it is sent."""

    def execute(  # one signature for psycopg's overloads (Any: compatible with each)
        self,
        query: Any,
        params: Any = None,
        *,
        prepare: bool | None = None,
        binary: bool = False,
    ) -> psycopg.Cursor[tuple[Any, ...]]:
        values = list(params.values()) if isinstance(params, Mapping) else []
        _note(values)
        cursor = super().execute(query, params, prepare=prepare, binary=binary)
        _released(query, values)
        return cursor


class SpiedAsyncpg(asyncpg.Connection):
    """An asyncpg connection that records the tokens of each statement, before it is sent."""

    async def fetch(self, query: str, *args: object, **options: Any) -> list[Any]:
        _note(args)
        found: list[Any] = await super().fetch(query, *args, **options)
        _released(query, args)
        return found


def with_schema(url: str, schema: str) -> str:
    """``url`` with ``schema`` first on the search path (roles and tables of a test)."""
    joiner = "&" if "?" in url else "?"
    return f"{url}{joiner}options={quote(f'-csearch_path={schema}')}"


def proxied_url(url: str, proxy: FaultProxy) -> str:
    """``url`` through ``proxy``: its host and port, no TLS (the proxy sees plain messages)."""
    params = psycopg.conninfo.conninfo_to_dict(url)
    params.update(host=proxy.host, port=str(proxy.port), sslmode="disable")
    params.setdefault("connect_timeout", str(CONNECT_TIMEOUT))
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in params.items()})


def asyncpg_dsn(conninfo: str) -> dict[str, Any]:
    """asyncpg's keyword arguments for a libpq ``conninfo`` (host, port, user, database)."""
    params = psycopg.conninfo.conninfo_to_dict(conninfo)
    return {
        "host": str(params.get("host") or servers.LOOPBACK),
        "port": int(str(params.get("port") or 5432)),
        "user": str(params.get("user") or postgres_servers.SUPERUSER),
        "database": str(params.get("dbname") or postgres_servers.DATABASE),
        "password": None if params.get("password") is None else str(params["password"]),
        "ssl": False,
        "timeout": CONNECT_TIMEOUT,
    }


def is_startup(chunk: bytes) -> bool:
    """A startup packet (protocol 3.0) or SSLRequest: spared, so that connecting is not faulted."""
    return len(chunk) >= 8 and chunk[4:8] in (b"\x00\x03\x00\x00", b"\x04\xd2\x16\x2f")


def release_by_token(lock: SyncLock, key: str, token: str) -> bool:
    """``DSemaphore.release(key, token)``, else the mutex's ``unlock(key, token)`` (pytestmark)."""
    if isinstance(lock, DSemaphore):
        return lock.release(key, token)
    return lock.unlock(key, token)


async def release_by_token_async(lock: AsyncLock, key: str, token: str) -> bool:
    if isinstance(lock, AsyncDSemaphore):
        return await lock.release(key, token)
    return await lock.unlock(key, token)


def table_of(kind: Kind, service: str) -> str:
    return ("_dmutex_" if kind == "mutex" else "_dsemaphore_") + service


def make_lock(
    face: FaceName, kind: Kind, client: Any, service: str, schema: str | None, **more: Any
) -> Lock:
    options: dict[str, Any] = {"schema_name": schema, "default_ttl_seconds": TTL, **more}
    if kind == "semaphore":
        options["max_permits"] = PERMITS[kind]
    if face == "sync":
        return (DMutex if kind == "mutex" else DSemaphore)(service, client, **options)
    return (AsyncDMutex if kind == "mutex" else AsyncDSemaphore)(service, client, **options)


# --- the table, seen from a clean direct connection ------------------------------------------


@dataclass
class Live:
    """A live row: its key, token, and seconds left by the server's clock."""

    key: str
    token: str
    left: float


class Inspector:
    """One table through a direct autocommit connection of its own (shared, serialized)."""

    def __init__(self, url: str, schema: str | None, table: str) -> None:
        self.url = url
        self.conn = self._connect()
        self.name = sql.Identifier(table) if schema is None else sql.Identifier(schema, table)
        self._lock = threading.Lock()

    def _connect(self) -> psycopg.Connection[tuple[Any, ...]]:
        return psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT)

    def execute(self, query: sql.Composed, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        """Its rows; on a connection the server dropped (a restart), once more on a new one."""
        with self._lock:
            if self.conn.broken or self.conn.closed:
                self.conn = self._connect()
            try:
                cursor = self.conn.execute(query, params)
            except psycopg.OperationalError:
                if not (self.conn.broken or self.conn.closed):
                    raise
                self.conn = self._connect()
                cursor = self.conn.execute(query, params)
            return [] if cursor.description is None else cursor.fetchall()

    def live(self) -> list[Live]:
        query = sql.SQL(
            """SELECT "key", "value", extract(epoch FROM "expired_at" - clock_timestamp())
            FROM {} WHERE "key" LIKE 'permit:%%' AND "expired_at" > clock_timestamp()"""
        ).format(self.name)
        found = self.execute(query)
        return [Live(str(k), str(v), float(left)) for k, v, left in found]

    def holding(self, tokens: Sequence[str]) -> list[str]:
        """Keys of every row (live or not) that holds one of ``tokens``."""
        if not tokens:
            return []
        query = sql.SQL('SELECT "key" FROM {} WHERE "value" = ANY(%s)').format(self.name)
        return [str(k) for (k,) in self.execute(query, (list(tokens),))]

    def delete(self, tokens: Sequence[str]) -> None:
        query = sql.SQL('DELETE FROM {} WHERE "value" = ANY(%s)').format(self.name)
        self.execute(query, (list(tokens),))

    def close(self) -> None:
        self.conn.close()


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


def service_name(prefix: str) -> str:
    return f"{prefix}{random.Random().getrandbits(32):08x}"


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
                stack.enter_context(
                    psycopg_pool.ConnectionPool(
                        proxied_url(postgres_server, proxy),
                        min_size=1,
                        max_size=2,
                        kwargs={"autocommit": True},
                        connection_class=SpiedConnection,
                        timeout=POOL_TIMEOUT,
                        open=True,
                    )
                )
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


# --- a lost reply, and the same acquire sent again ----------------------------------------------


def _nothing() -> Steps[None]:
    yield from ()


@pytest.mark.parametrize("permits", [1, 3])
@pytest.mark.parametrize("face", ["sync", "async"])
def test_an_acquire_whose_reply_was_lost_is_recognised_when_sent_again(
    postgres_server: str, postgres_schema: str, face: FaceName, permits: int
) -> None:
    """DROP_REPLY after the server ran the acquire; the same token again takes no second slot."""
    table = f"_dmutex_lost{random.Random().getrandbits(32):08x}"
    inspector = Inspector(postgres_server, postgres_schema, table)
    key, token, ttl_ms = "k", "0f0f0f0f-0000-4000-8000-00000000beef", 30_000
    upstream = postgres_servers.upstream_of(postgres_server)
    proxy = FaultProxy(upstream, Rates(drop_reply=1.0), seed=SEED, spare=is_startup)
    with proxy, contextlib.closing(inspector):

        def store(client: object) -> PostgresStore:
            return PostgresStore(
                client,
                table,
                permits,
                SYSTEM_CLOCK,
                schema=postgres_schema,
                asynchronous=face == "async",
            )

        if face == "sync":
            drive = SyncDriver(SYSTEM_CLOCK, _nothing)
            with psycopg.connect(proxied_url(postgres_server, proxy), autocommit=True) as conn:
                through = store(conn)
                drive(through.ready())
                with proxy.faults(), pytest.raises(psycopg.OperationalError):
                    drive(through.acquire(key, token, ttl_ms))
                assert conn.closed, "the connection that lost its reply is broken"
            held = inspector.holding([token])
            with psycopg.connect(postgres_server, autocommit=True) as conn:
                again = drive(store(conn).acquire(key, token, ttl_ms))
        else:

            async def main() -> tuple[list[str], Lease | None]:
                drive = AsyncDriver(SYSTEM_CLOCK, _nothing)
                conn = await asyncpg.connect(**asyncpg_dsn(proxied_url(postgres_server, proxy)))
                through = store(conn)
                await drive(through.ready())
                # Prepared (asyncpg caches it) on another key: the faulted send is one chunk,
                # Bind and Execute, which the server runs before its reply is dropped.
                await drive(through.acquire("warm", token, ttl_ms))
                with proxy.faults(), pytest.raises(ASYNC_FAILURES):
                    await drive(through.acquire(key, token, ttl_ms))
                assert conn.is_closed(), "the connection that lost its reply is broken"
                held = await asyncio.to_thread(inspector.holding, [token])
                direct = await asyncpg.connect(**asyncpg_dsn(postgres_server))
                try:
                    again = await drive(store(direct).acquire(key, token, ttl_ms))
                finally:
                    await direct.close()
                return [h for h in held if h.endswith(f":{key}")], again

            held, again = asyncio.run(asyncio.wait_for(main(), 30))
        assert proxy.counts[Fault.DROP_REPLY] == 1
        assert len(held) == 1, f"the server ran the acquire whose reply was lost: {held}"
        assert isinstance(again, Lease)
        assert held == [f"permit:{again.slot}:{key}"], "the copy answers with the first's slot"
        now = [h for h in inspector.holding([token]) if h.endswith(f":{key}")]
        assert now == held, "one slot, not a second"


# --- a connection killed by the server ----------------------------------------------------------


def terminate(admin: psycopg.Connection[Any], pid: int) -> None:
    """``pg_terminate_backend(pid)`` and wait until the backend is gone."""
    row = admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()
    assert row == (True,), f"backend {pid} not terminated"
    deadline = time.monotonic() + 10
    while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
        assert time.monotonic() < deadline, f"backend {pid} still there"
        time.sleep(0.01)


def backend_pids(admin: psycopg.Connection[Any], name: str) -> list[int]:
    found = admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (name,)
    ).fetchall()
    return [int(pid) for (pid,) in found]


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
@pytest.mark.parametrize(
    "client", ["psycopg", "psycopg_pool", "psycopg_pool_unchecked", "asyncpg", "asyncpg_pool"]
)
def test_a_connection_killed_mid_use(
    postgres_server: str, postgres_schema: str, client: str, kind: Kind
) -> None:
    """pg_terminate_backend of the holder's backend: clear error or a pool's recovery; row kept."""
    service = service_name("killed")
    name = f"dmutex-{service}"  # application_name: its backends, found by the admin
    url = f"{postgres_server}{'&' if '?' in postgres_server else '?'}application_name={name}"
    inspector = Inspector(postgres_server, postgres_schema, table_of(kind, service))
    admin = psycopg.connect(postgres_server, autocommit=True)
    face: FaceName = "sync" if client.startswith("psycopg") else "async"
    pooled = "_pool" in client
    with contextlib.closing(admin), contextlib.closing(inspector):

        def after_kill(outcome: object, then: object = None) -> None:
            if client == "psycopg_pool":  # it checks a connection before it lends it
                assert not isinstance(outcome, BaseException), f"the pool failed: {outcome!r}"
            elif pooled:
                # asyncpg's lends the dead connection if it has not seen it close yet (it
                # reads the server's FATAL message in the background), psycopg's without
                # a check lends it always: that one call fails, and the pool has replaced
                # the connection for the next.
                if isinstance(outcome, BaseException):
                    assert isinstance(outcome, SYNC_FAILURES + ASYNC_FAILURES), repr(outcome)
                    assert unclear(outcome) is None, unclear(outcome)
                    print(f"[pg-killed {client} {kind}] the next call raised {outcome!r}")
                assert not isinstance(then, BaseException), f"the pool failed again: {then!r}"
            else:
                failures = SYNC_FAILURES if face == "sync" else ASYNC_FAILURES
                assert isinstance(outcome, failures), f"not a connection error: {outcome!r}"
                assert unclear(outcome) is None, unclear(outcome)
                print(f"[pg-killed {client} {kind}] the next call raised {outcome!r}")

        def row_intact(token: str, key: str) -> None:
            live = [r for r in inspector.live() if r.token == token]
            assert len(live) == 1, live
            assert re.fullmatch(rf"permit:[0-9]+:{key}", live[0].key), live

        if face == "sync":
            if pooled:
                target: Any = psycopg_pool.ConnectionPool(
                    url,
                    min_size=1,
                    max_size=1,
                    kwargs={"autocommit": True},
                    check=(
                        None
                        if client.endswith("unchecked")
                        else psycopg_pool.ConnectionPool.check_connection
                    ),
                    open=True,
                )
            else:
                target = psycopg.connect(url, autocommit=True)
            with contextlib.closing(target):
                lock = make_lock("sync", kind, target, service, postgres_schema)
                assert isinstance(lock, (DMutex, DSemaphore))
                handle = lock.acquire("k", ttl=30)
                assert handle is not None
                for pid in backend_pids(admin, name):
                    terminate(admin, pid)
                row_intact(handle.token, "k")
                outcome: object
                try:
                    outcome = lock.acquire("other", ttl=30)
                except Exception as error:  # noqa: BLE001 - judged below
                    outcome = error
                row_intact(handle.token, "k")
                then: object = None
                if pooled:
                    try:
                        then = lock.acquire("third", ttl=30)
                    except Exception as error:  # noqa: BLE001 - judged below
                        then = error
                after_kill(outcome, then)
            with psycopg.connect(postgres_server, autocommit=True) as fresh:
                other = make_lock("sync", kind, fresh, service, postgres_schema)
                assert isinstance(other, (DMutex, DSemaphore))
                assert release_by_token(other, "k", handle.token) is True
        else:

            async def main() -> tuple[object, object]:
                dsn = asyncpg_dsn(postgres_server)
                settings = {"application_name": name}
                target: Any
                if pooled:
                    target = await asyncpg.create_pool(
                        **dsn, min_size=1, max_size=1, server_settings=settings
                    )
                else:
                    target = await asyncpg.connect(**dsn, server_settings=settings)
                try:
                    lock = make_lock("async", kind, target, service, postgres_schema)
                    assert isinstance(lock, (AsyncDMutex, AsyncDSemaphore))
                    handle = await lock.acquire("k", ttl=30)
                    assert handle is not None
                    for pid in await asyncio.to_thread(backend_pids, admin, name):
                        await asyncio.to_thread(terminate, admin, pid)
                    await asyncio.to_thread(row_intact, handle.token, "k")
                    outcome: object
                    try:
                        outcome = await lock.acquire("other", ttl=30)
                    except Exception as error:  # noqa: BLE001 - judged by the caller
                        outcome = error
                    await asyncio.to_thread(row_intact, handle.token, "k")
                    then: object = None
                    if pooled:
                        try:
                            then = await lock.acquire("third", ttl=30)
                        except Exception as error:  # noqa: BLE001 - judged by the caller
                            then = error
                finally:
                    if pooled:
                        target.terminate()
                    else:
                        target.terminate()
                direct = await asyncpg.connect(**dsn)
                try:
                    other = make_lock("async", kind, direct, service, postgres_schema)
                    assert isinstance(other, (AsyncDMutex, AsyncDSemaphore))
                    assert await release_by_token_async(other, "k", handle.token) is True
                finally:
                    await direct.close()
                return outcome, then

            outcome, then = asyncio.run(asyncio.wait_for(main(), 30))
            after_kill(outcome, then)
        left = [r.key for r in inspector.live()]
        assert all(re.fullmatch(r"permit:[0-9]+:(other|third)", k) for k in left), left


# --- bad server states: a role that may only read, a statement timeout -------------------------


def may_create_roles(admin: psycopg.Connection[Any]) -> bool:
    row = admin.execute(
        "SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user"
    ).fetchone()
    return bool(row and row[0])


@contextlib.contextmanager
def role(admin: psycopg.Connection[Any], *settings: str) -> Iterator[str]:
    """A login role of the test's own (trust: no password), dropped with what it was granted."""
    name = f"dmutex_role_{random.Random().getrandbits(32):08x}"
    admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    try:
        for setting in settings:
            admin.execute(
                sql.SQL("ALTER ROLE {} SET {}").format(sql.Identifier(name), sql.SQL(setting))
            )
        yield name
    finally:
        admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def as_role(url: str, name: str) -> str:
    params = psycopg.conninfo.conninfo_to_dict(url)
    params["user"] = name
    params.pop("password", None)
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in params.items()})


def snapshot(inspector: Inspector) -> list[tuple[Any, ...]]:
    """Every row of the table, as it is."""
    query = sql.SQL('SELECT "key", "value", "expired_at" FROM {} ORDER BY "key"')
    return inspector.execute(query.format(inspector.name))


READ_ONLY = {
    # How the role may only read, and what the server answers an acquire.
    "select-only": ((), psycopg.errors.InsufficientPrivilege, "InsufficientPrivilegeError"),
    "read-only-transactions": (
        ("default_transaction_read_only = on",),
        psycopg.errors.ReadOnlySqlTransaction,
        "ReadOnlySQLTransactionError",
    ),
}


@pytest.mark.parametrize("how", sorted(READ_ONLY))
@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_role_that_may_only_read_cannot_acquire_and_writes_nothing(
    postgres_server: str, postgres_schema: str, face: FaceName, kind: Kind, how: str
) -> None:
    """The server's refusal comes through as its own error type and message; no row written."""
    settings, sync_error, async_error = READ_ONLY[how]
    service = service_name("ro")
    table = table_of(kind, service)
    with contextlib.ExitStack() as stack:
        admin = stack.enter_context(psycopg.connect(postgres_server, autocommit=True))
        if not may_create_roles(admin):
            pytest.skip("the server's role may not CREATE ROLE: no read-only role to test with")
        owner = make_lock("sync", kind, admin, service, postgres_schema)
        assert isinstance(owner, (DMutex, DSemaphore))
        owner.ready()  # the table and its index, made by a role that may
        inspector = Inspector(postgres_server, postgres_schema, table)
        stack.callback(inspector.close)
        name = stack.enter_context(role(admin, *settings))
        grant = "SELECT" if how == "select-only" else "SELECT, INSERT, UPDATE, DELETE"
        admin.execute(
            sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                sql.Identifier(postgres_schema), sql.Identifier(name)
            )
        )
        admin.execute(
            sql.SQL(f"GRANT {grant} ON {{}} TO {{}}").format(inspector.name, sql.Identifier(name))
        )
        url = as_role(postgres_server, name)
        if face == "sync":
            with psycopg.connect(url, autocommit=True) as conn:
                lock = make_lock("sync", kind, conn, service, postgres_schema)
                assert isinstance(lock, (DMutex, DSemaphore))
                lock.ready()  # the table is there: one read, which the role may
                with pytest.raises(sync_error) as raised:
                    lock.acquire("k")
                message = str(raised.value)
        else:

            async def main() -> BaseException:
                conn = await asyncpg.connect(**asyncpg_dsn(url))
                try:
                    lock = make_lock("async", kind, conn, service, postgres_schema)
                    assert isinstance(lock, (AsyncDMutex, AsyncDSemaphore))
                    await lock.ready()
                    try:
                        await lock.acquire("k")
                    except Exception as error:  # noqa: BLE001 - judged by the caller
                        return error
                    raise AssertionError("acquire by a role that may only read succeeded")
                finally:
                    await conn.close()

            error = asyncio.run(asyncio.wait_for(main(), 30))
            assert type(error).__name__ == async_error, repr(error)
            message = str(error)
        expected = "permission denied" if how == "select-only" else "read-only transaction"
        assert expected in message, message
        assert snapshot(inspector) == [], "nothing written"


def age_all(inspector: Inspector) -> None:
    """Let every lease of the table run out now, by the server's clock."""
    query = sql.SQL(
        """UPDATE {} SET "expired_at" = statement_timestamp() - interval '1 ms'
        WHERE "key" LIKE 'permit:%%'"""
    )
    inspector.execute(query.format(inspector.name))


STATEMENT_TIMEOUT_MS = 300


@pytest.mark.parametrize("ends", ["rollback", "commit"])
@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_statement_timeout_behind_a_row_lock_cancels_the_acquire_and_changes_nothing(
    postgres_server: str, postgres_schema: str, face: FaceName, kind: Kind, ends: str
) -> None:
    """Another session locks the key's rows; acquire times out (QueryCanceled), nothing changes."""
    service = service_name("st")
    table = table_of(kind, service)
    permits = PERMITS[kind]
    with contextlib.ExitStack() as stack:
        admin = stack.enter_context(psycopg.connect(postgres_server, autocommit=True))
        owner = make_lock("sync", kind, admin, service, postgres_schema)
        assert isinstance(owner, (DMutex, DSemaphore))
        for _ in range(permits):  # every slot's row, then all expired: free, and there to lock
            assert owner.acquire("k", ttl=30) is not None
        inspector = Inspector(postgres_server, postgres_schema, table)
        stack.callback(inspector.close)
        age_all(inspector)
        before = snapshot(inspector)
        blocker = stack.enter_context(psycopg.connect(postgres_server))  # not autocommit
        blocker.execute(
            sql.SQL("""SELECT 1 FROM {} WHERE "key" LIKE 'permit:%%' FOR UPDATE""").format(
                inspector.name
            )
        )  # its transaction stays open
        started = time.monotonic()
        if face == "sync":
            options = quote(f"-cstatement_timeout={STATEMENT_TIMEOUT_MS}")
            joiner = "&" if "?" in postgres_server else "?"
            conn = stack.enter_context(
                psycopg.connect(f"{postgres_server}{joiner}options={options}", autocommit=True)
            )
            lock = make_lock("sync", kind, conn, service, postgres_schema)
            assert isinstance(lock, (DMutex, DSemaphore))
            with pytest.raises(psycopg.errors.QueryCanceled) as raised:
                lock.acquire("k")
            error: BaseException = raised.value
        else:

            async def main() -> BaseException:
                conn = await asyncpg.connect(
                    **asyncpg_dsn(postgres_server),
                    server_settings={"statement_timeout": str(STATEMENT_TIMEOUT_MS)},
                )
                try:
                    lock = make_lock("async", kind, conn, service, postgres_schema)
                    assert isinstance(lock, (AsyncDMutex, AsyncDSemaphore))
                    try:
                        await lock.acquire("k")
                    except Exception as error:  # noqa: BLE001 - judged by the caller
                        return error
                    raise AssertionError("the acquire was not cancelled")
                finally:
                    await conn.close()

            error = asyncio.run(asyncio.wait_for(main(), 30))
            assert isinstance(error, asyncpg.QueryCanceledError), repr(error)
        waited = time.monotonic() - started
        assert "statement timeout" in str(error), str(error)
        assert waited >= STATEMENT_TIMEOUT_MS / 1000 * 0.9, f"cancelled after {waited:.3f} s"
        assert snapshot(inspector) == before, "the cancelled acquire changed a row"
        (blocker.rollback if ends == "rollback" else blocker.commit)()
        assert snapshot(inspector) == before, "a row changed when the blocker let go"
        assert inspector.live() == [], "a lease left by the cancelled acquire"
        after = owner.acquire("k", ttl=5)
        assert after is not None, "acquire works once the blocker let go"
        assert after.release() is True


# --- the deadline: a holder behind a blackhole is told before anyone takes its key -------------


class PostgresDeadlineRig(test_deadlines.ProxiedRig):
    """``test_deadlines``'s rig on PostgreSQL: one proxy per trial, no client timeout.

    Holders: a psycopg connection in autocommit (sync), an asyncpg pool of two
    (asyncio: the trial's ``acquire`` and ``run`` leases share it; an asyncpg
    connection runs one statement at a time). Neither has a timeout, so a
    statement the blackhole swallows waits for ever. The second holders
    share a direct psycopg connection, in a process of their own.
    """

    # The rig's Literal names test_deadlines' own three backends; only its test reads it.
    name = "postgresql"  # type: ignore[assignment]

    def __init__(self, url: str, schema: str) -> None:
        super().__init__(postgres_servers.upstream_of(url))
        self.url = url
        self.lock_options = {"schema_name": schema}
        self.pools: list[Any] = []

    def through(self, index: int) -> str:
        params = psycopg.conninfo.conninfo_to_dict(self.url)
        proxy = self.proxy(index)
        params.update(host=proxy.host, port=str(proxy.port), sslmode="disable")
        params.pop("connect_timeout", None)
        return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in params.items()})

    def direct(self) -> Direct:
        options = tuple(self.lock_options.items())
        return Direct("postgresql", self.url, options=options)

    def sync_lock(self, index: int) -> DMutex:
        if index not in self.sync_locks:
            conn = psycopg.connect(self.through(index), autocommit=True)
            self.sync_clients.append(conn)
            self.sync_locks[index] = DMutex(test_deadlines.SERVICE, conn, **self.lock_options)
        return self.sync_locks[index]

    async def async_lock(self, index: int) -> AsyncDMutex:
        if index not in self.async_locks:
            dsn = asyncpg_dsn(self.through(index))
            dsn.pop("timeout")
            pool = await asyncpg.create_pool(**dsn, min_size=1, max_size=2)
            self.pools.append(pool)
            self.async_locks[index] = AsyncDMutex(test_deadlines.SERVICE, pool, **self.lock_options)
        return self.async_locks[index]

    async def aclose(self) -> None:
        pools, self.pools = self.pools, []
        for pool in pools:
            pool.terminate()


DEADLINE_TRIALS = 10
DEADLINE_TTLS = (1.0, 1.0, 1.5, 2.0, 2.0)


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_holder_behind_a_blackhole_is_told_before_anyone_takes_the_key(
    postgres_server: str, postgres_schema: str, face: FaceName, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``test_deadlines``' case on PostgreSQL, 10 trials at TTLs of 1 to 2 s."""
    monkeypatch.setattr(test_deadlines, "TRIALS", DEADLINE_TRIALS)
    monkeypatch.setattr(test_deadlines, "TTLS", DEADLINE_TTLS)
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        DMutex(test_deadlines.SERVICE, conn, schema_name=postgres_schema).ready()
        name = sql.Identifier(postgres_schema, f"_dmutex_{test_deadlines.SERVICE}")
        conn.execute(sql.SQL("DELETE FROM {}").format(name))
    rig = PostgresDeadlineRig(postgres_server, postgres_schema)
    case = f"postgresql-{face}"
    try:
        test_deadlines.tell_case(rig, case, face)
    finally:
        rig.end_fault()
        rig.close()


# --- the server killed and started again ---------------------------------------------------------

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
                pool = psycopg_pool.ConnectionPool(
                    url,
                    min_size=1,
                    max_size=2,
                    kwargs={"autocommit": True},
                    connection_class=SpiedConnection,
                    timeout=POOL_TIMEOUT,
                    open=True,
                )
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

"""asyncio cancellation at random points leaves no permit held by nobody, and is never swallowed.

Seeded trials, run in batches of concurrent tasks on two keys, each with
``AsyncDMutex`` or ``AsyncDSemaphore`` (3 permits) and one pattern of use:

- ``run``: ``await face.run(key, body)``;
- ``run_with_retry``: the same, acquiring with retries;
- ``async with``: ``acquire_with_retry``, then ``async with handle: body``;
- ``release``: ``acquire``, then ``body`` and ``await handle.release()`` in a ``finally``;
- ``token release`` (semaphore): the same with ``await sem.release(key, token)``.

``body`` sleeps a random short time. Each task is cancelled with
``task.cancel()`` after a random delay, so the cancellation lands in the
acquire, the body, a retry wait or the release, or not at all. On a real
Redis server the client is wrapped in :class:`DelayingRedis`, which sleeps
before and after each command: a cancellation can land before a request is
sent, while it is in flight, or after the server executed it but before
the reply is returned. On ``InMemoryBackend`` there is no I/O to land in,
only the body and the retry waits.

On a real PostgreSQL server the same trials run over each asyncio client
that can be shared by concurrent tasks: an asyncpg pool, a psycopg
``AsyncConnection`` (its lock takes one statement at a time) and a psycopg
``AsyncConnectionPool``, each wrapped as Redis's is
(``tests/_support/postgres_clients.py``), so that a cancellation lands
before a statement is sent, while the driver awaits the server (psycopg then
cancels the statement on the server, asyncpg sends a cancel request; either
may have committed first), or after the reply. And one asyncpg connection:
asyncpg refuses a second statement while one is in progress
(``InterfaceError``), so dmutex's statements on one take turns
(``runners.py``, rule 5; before, a task's acquire beside another's failed).
The storage read is every active ``permit:`` row of the test's two tables,
by a plain psycopg connection. On an asyncpg pool this suite found two
swallowed cancellations in a listening wait, both fixed and pinned in
``test_holes.py``.

On a real MariaDB server the same trials run over an aiomysql pool, an
asyncmy pool and one connection of each, wrapped as PostgreSQL's are
(``test_mysql_faults.Intercepted``, its statements sent through
:class:`Phases`), and through a :class:`FaultProxy` that delays a fifth of
what a client sends by 1-6 ms and delivers it even after the client closed
(``deliver_late``), as a network does. aiomysql and asyncmy close a
connection when a task is cancelled while they await its reply; the
statement may not have reached the server yet, and before the fix the
acquire's clean-up release, on the pool's next connection, could run first:
the row the take then wrote was held by nobody. Before the fix, in five runs
of the four: 3 such rows behind the aiomysql pool each time (all cancelled
in flight), 0-2 behind asyncmy's, 0-2 on one connection of either, where
568-1,892 trials a run raised ``InterfaceError`` (every call after the first
cut). The delays around each statement alone hide the race (the clean-up
waits its own delay); the proxy's late delivery shows it. Now the runner opens the cut connection
again and ends its old session on the server before the cancellation goes on
(``mysql/runners.py``, rule 7); ``test_mysql_faults.py`` (scene 6) pins it
without randomness. The storage read is every active ``permit:`` row of the
test's two tables, by a plain PyMySQL connection. asyncmy's pool opens a
connection through ``asyncio.wait_for``, which on Python <= 3.11 swallows a
cancellation that arrives as it connects (CPython gh-86296; 7-9 of about 400
cancellations that landed in its ``acquire()`` with no dmutex involved, 0 on
Python 3.12; before the fix, 0-1 a run here, none with 3.12's ``wait_for``),
so its pool is opened full: dmutex gives back open the connections a
cancellation cut, and the pool never connects during the trials.

After each batch, once every task of the event loop has finished, the test
reads storage directly (Redis: every ``*permit:*`` key, with a clean client;
InMemoryBackend: ``snapshot()``). Every permit left must belong to a task
that still believes it holds it, and since every trial ends by releasing,
that is none: a permit left is an orphan, held by nobody until its 30 s TTL
runs out. Each task whose ``cancel()`` was accepted must end cancelled (the
cancellation propagated, it was not swallowed); the others must end without
an error. Where a cancellation landed is what its task was awaiting when
``cancel()`` was accepted (a stage, ``acquire`` or ``release``, and a phase
of the request; or ``body``, ``retry wait``); the test asserts that every
phase of both stages was hit. The summary (trials, cancellations by where
they landed, orphans by where and by pattern) is printed and is part of
every failure message.

The asyncio client has no ``socket_timeout``: under one, redis-py sends
through ``asyncio.wait_for``, which on Python <= 3.11 swallows a
cancellation that arrives as the send completes (CPython gh-86296), a
client's fault this test is not about.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, TypeVar

import asyncpg
import psycopg
import psycopg_pool
import pytest
import redis
import redis.asyncio

from dmutex import (
    AsyncDMutex,
    AsyncDSemaphore,
    AsyncpgLike,
    AsyncPsycopgConnectionLike,
    AsyncPsycopgPoolLike,
    InMemoryBackend,
)
from tests._support.cancellation import (
    Face,
    NotingClock,
    Plan,
    Storage,
    Tally,
    Trial,
    current,
    doing,
    judge,
    note_retry_waits,
    run_trials,
)
from tests._support.fault_clients import PHASES, DelayingRedis
from tests._support.fault_proxy import FaultProxy, Rates
from tests._support.mysql_servers import Server, Session, connect_args
from tests._support.postgres_clients import (
    InterceptedAsyncpg,
    InterceptedAsyncpgPool,
    InterceptedPsycopg,
    InterceptedPsycopgPool,
    Phases,
    active_permits,
    drop_permits,
)
from tests._support.redis_servers import Pool, flushed, newest
from tests.faults.test_mysql_faults import (
    Intercepted,
    InterceptedPool,
    Table,
    async_connection,
    async_pool,
    close_pool,
)

T = TypeVar("T")

PERMITS = 3
KEYS = ("job-a", "job-b")
MAX_DELAY = 0.0015  # each of the delaying client's two sleeps, at most
SEED = 20261201


def plan(
    backend: str,
    batches: int,
    cancel_after: float,
    spread: tuple[float, ...] = (1.0,),
    batch: int = 16,
) -> Plan:
    """16 concurrent tasks a batch; a task is cancelled after about as long as a trial."""
    return Plan(
        backend,
        batches=batches,
        batch=batch,
        keys=KEYS,
        cancel_after=cancel_after,
        ttl=30.0,
        timeout=0.04,
        retry_delay=0.002,
        body=0.003,
        spread=spread,
    )


MEMORY = plan("memory", batches=60, cancel_after=0.005)
REDIS = plan("redis", batches=200, cancel_after=0.015)
# At most; the trials stop once every phase of both stages was hit and 960 trials ran.
POSTGRES = plan("postgresql", batches=120, cancel_after=0.015, spread=(1, 2, 4))
# On one asyncpg connection, 4 tasks a batch: dmutex's statements take turns on it, so
# with 16 most cancellations land in a task's wait for its turn, few in a release.
POSTGRES_ONE = plan("postgresql", batches=480, cancel_after=0.015, spread=(1, 2, 4), batch=4)
POSTGRES_LEAST = 960
# The same on MariaDB: at most; stops once every phase of both stages was hit and 960 ran.
MYSQL = plan("mysql", batches=120, cancel_after=0.015, spread=(1, 2, 4))
# One aiomysql or asyncmy connection: dmutex's statements take turns on it (4 a batch).
MYSQL_ONE = plan("mysql", batches=480, cancel_after=0.015, spread=(1, 2, 4), batch=4)
MYSQL_LEAST = 960
MYSQL_BOUND = 120.0  # seconds, a MySQL client's trials at most (they take 2-10 s here)
STAGE_PHASES = [f"{stage}/{phase}" for stage in ("acquire", "release") for phase in PHASES]
POOL_SIZE = 8  # the asyncpg pool's connections: half of a batch's tasks wait for one
# The psycopg pool's, all opened first: more than a batch's tasks ever hold, so
# that none waits for a connection. psycopg_pool waits for one through
# asyncio.wait_for, which on Python <= 3.11 swallows a cancellation that
# arrives as a connection is handed over (CPython gh-86296): with a pool of 8,
# 39 of the 335 cancellations that landed there in one run returned normally,
# the pool's fault.
PSYCOPG_POOL_SIZE = 20
# The MySQL pools': half of a batch's tasks wait for a connection. asyncmy's is opened
# full: it connects through asyncio.wait_for, which on Python <= 3.11 swallows a
# cancellation that arrives as it connects (CPython gh-86296), as psycopg_pool's wait does.
MYSQL_POOL_SIZE = 8
# The network between the MySQL clients and the server: a fifth of the chunks a client sends
# reach the server 1-6 ms late, and still do if the client closed meanwhile (as a statement
# sent before a cancellation closed its connection would): the race rule 7 of
# mysql/runners.py is about, which the delays around each statement alone hide.
MYSQL_NETWORK = Rates(delay=0.2, delay_seconds=(0.001, 0.006))


def in_request(phase: str | None) -> None:
    """:class:`DelayingRedis`'s phases, with the trial's stage (``between``: no request)."""
    trial = current()
    if trial is not None:
        doing(f"{trial.stage}/{phase or 'between'}")


class Owners:
    """Which trial sent each string argument (tokens among them), to name an orphan's trial."""

    def __init__(self) -> None:
        self._by_arg: dict[str, Trial] = {}

    def sent(self, args: tuple[object, ...]) -> None:
        trial = current()
        if trial is None:
            return
        for arg in args:
            text = arg.decode() if isinstance(arg, bytes) else arg
            if isinstance(text, str):
                self._by_arg.setdefault(text, trial)

    def of(self, token: str) -> Trial | None:
        return self._by_arg.get(token)


def test_memory_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """InMemoryBackend: cancellations land in bodies and retry waits; nothing is left held."""
    note_retry_waits(monkeypatch)
    rng = random.Random(SEED)
    backend = InMemoryBackend(clock=NotingClock())
    faces: dict[str, Face] = {
        "mutex": AsyncDMutex("svc", backend),
        "semaphore": AsyncDSemaphore("svc", backend, max_permits=PERMITS),
    }

    def clear() -> None:
        for key in KEYS:
            backend.force_expire(key)

    storage = Storage(
        permits=lambda: {name: token for name, (token, _) in backend.snapshot().items()},
        clear=clear,
    )
    tally = asyncio.run(run_trials(MEMORY, faces, storage, rng))
    summary = judge(tally)
    assert tally.landed["retry wait"] > 0, summary


@pytest.fixture
def redis_url(redis_pool: Pool) -> Iterator[str]:
    """One real Redis server (the newest found), its database emptied."""
    url = flushed(newest(redis_pool).url)
    yield url
    flushed(url)


def test_real_redis(redis_url: str) -> None:
    """A real Redis server behind a delaying client: cancellations in every phase of a request."""
    rng = random.Random(SEED)
    owners = Owners()
    inspector = redis.Redis.from_url(redis_url, decode_responses=True)

    def permits() -> dict[str, str]:
        names = list(inspector.scan_iter(match="*permit:*"))
        tokens = inspector.mget(names) if names else []
        return {n: str(t) for n, t in zip(names, tokens, strict=True) if t is not None}

    def clear() -> None:
        names = list(inspector.scan_iter(match="*"))
        if names:
            inspector.delete(*names)

    async def main() -> tuple[Tally, DelayingRedis]:
        # No socket_timeout: see the module docstring.
        inner = redis.asyncio.Redis.from_url(redis_url, socket_timeout=None)
        client = DelayingRedis(
            inner,
            rng,
            MAX_DELAY,
            on_send=owners.sent,
            on_phase=in_request,
        )
        clock = NotingClock()
        faces: dict[str, Face] = {
            "mutex": AsyncDMutex("svc", client, clock=clock),
            "semaphore": AsyncDSemaphore("svc", client, max_permits=PERMITS, clock=clock),
        }
        try:
            storage = Storage(permits, clear, owner=owners.of)
            return await run_trials(REDIS, faces, storage, rng), client
        finally:
            await inner.aclose()

    try:
        tally, client = asyncio.run(main())
    finally:
        inspector.close()
    tally.sent = client.sent
    summary = judge(tally)
    for stage in ("acquire", "release"):
        for phase in PHASES:
            assert tally.landed[f"{stage}/{phase}"] > 0, summary


Closer = Callable[[], Awaitable[None]]
POSTGRES_CLIENTS = ("asyncpg pool", "asyncpg connection", "psycopg connection", "psycopg pool")


async def postgres_client(
    name: str, url: str, phases: Phases
) -> tuple[AsyncPsycopgConnectionLike | AsyncPsycopgPoolLike | AsyncpgLike, Closer]:
    """The delaying wrapper of client ``name`` on ``url``, and how to close the real one."""
    if name == "asyncpg pool":
        pool = await asyncpg.create_pool(url, min_size=2, max_size=POOL_SIZE)
        return InterceptedAsyncpgPool(pool, phases), pool.close
    if name == "asyncpg connection":
        made = await asyncpg.connect(url)
        return InterceptedAsyncpg(made, phases), made.close
    if name == "psycopg connection":
        conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
        return InterceptedPsycopg(conn, phases), conn.close
    size = PSYCOPG_POOL_SIZE
    lent = psycopg_pool.AsyncConnectionPool(
        url, min_size=size, max_size=size, open=False, kwargs={"autocommit": True}
    )
    await lent.open(wait=True)
    return InterceptedPsycopgPool(lent, phases), lent.close


@pytest.mark.parametrize("name", POSTGRES_CLIENTS)
def test_real_postgresql(
    postgres_server: str, postgres_schema: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real PostgreSQL server behind a delaying client: cancellations in every phase of a
    statement, none swallowed, no permit row left that no task holds."""
    note_retry_waits(monkeypatch)
    rng = random.Random(SEED)
    owners = Owners()
    service = f"cancel-{uuid.uuid4().hex[:8]}"
    tables = [f"_dmutex_{service}", f"_dsemaphore_{service}"]
    calls: Counter[str] = Counter()

    def sent(values: tuple[object, ...]) -> None:
        owners.sent(values)
        trial = current()
        if trial is not None:
            calls[trial.stage] += 1

    def enough(tally: Tally) -> bool:
        ran = sum(tally.trials.values())
        return ran >= POSTGRES_LEAST and all(tally.landed[where] for where in STAGE_PHASES)

    phases = Phases(rng, MAX_DELAY, on_send=sent, on_phase=in_request)
    inspector = psycopg.connect(postgres_server, autocommit=True)

    async def main() -> Tally:
        client, close = await postgres_client(name, postgres_server, phases)
        clock = NotingClock()
        faces: dict[str, Face] = {
            "mutex": AsyncDMutex(service, client, schema_name=postgres_schema, clock=clock),
            "semaphore": AsyncDSemaphore(
                service, client, max_permits=PERMITS, schema_name=postgres_schema, clock=clock
            ),
        }
        try:
            for face in faces.values():
                await face.ready()
            storage = Storage(
                lambda: active_permits(inspector, postgres_schema, tables),
                lambda: drop_permits(inspector, postgres_schema, tables),
                owner=owners.of,
            )
            chosen = POSTGRES_ONE if name == "asyncpg connection" else POSTGRES
            return await run_trials(chosen, faces, storage, rng, enough)
        finally:
            await close()

    try:
        tally = asyncio.run(main())
    finally:
        inspector.close()
    tally.calls = calls
    summary = judge(tally)
    for where in STAGE_PHASES:
        assert tally.landed[where] > 0, summary


MYSQL_CLIENTS = ("aiomysql pool", "asyncmy pool", "aiomysql connection", "asyncmy connection")


class Delaying:
    """``test_mysql_faults``' sender through :class:`Phases`: each statement delayed before it
    is sent and after its reply, its phases noted, its parameters' values seen by ``on_send``."""

    def __init__(self, phases: Phases) -> None:
        self.phases = phases

    async def send(
        self, conn: Intercepted, query: str, args: object, request: Callable[[], Awaitable[T]]
    ) -> T:
        values = tuple(args.values()) if isinstance(args, Mapping) else ()
        return await self.phases.send(values, request)


async def mysql_client(
    name: str, server: Server, proxy: FaultProxy, sender: Delaying
) -> tuple[Any, Closer]:
    """The delaying wrapper of client ``name`` on ``server``'s database through ``proxy``, and
    how to close it."""
    driver, kind = name.split()
    if kind == "pool":
        size = MYSQL_POOL_SIZE
        least = size if driver == "asyncmy" else 1  # asyncmy's opened full: see MYSQL_POOL_SIZE
        pool = await async_pool(driver, server, proxy.host, proxy.port, size, least)
        return InterceptedPool(pool, sender), lambda: close_pool(pool)
    conn = await async_connection(driver, server, proxy.host, proxy.port)

    async def close() -> None:
        conn.close()

    return Intercepted(conn, sender), close


@pytest.mark.parametrize("name", MYSQL_CLIENTS)
def test_real_mysql(mysql_session: Session, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real MariaDB server behind a delaying client: cancellations in every phase of a
    statement, none swallowed, no permit row left that no task holds."""
    note_retry_waits(monkeypatch)
    server = mysql_session.server()
    rng = random.Random(SEED)
    owners = Owners()
    service = f"cancel-{uuid.uuid4().hex[:8]}"
    calls: Counter[str] = Counter()

    def sent(values: tuple[object, ...]) -> None:
        owners.sent(values)
        trial = current()
        if trial is not None:
            calls[trial.stage] += 1

    def enough(tally: Tally) -> bool:
        ran = sum(tally.trials.values())
        return ran >= MYSQL_LEAST and all(tally.landed[where] for where in STAGE_PHASES)

    phases = Phases(rng, MAX_DELAY, on_send=sent, on_phase=in_request)
    inspector = server.connect()
    tables = [Table(inspector, f"_{kind}_{service}") for kind in ("dmutex", "dsemaphore")]

    def permits() -> dict[str, str]:
        return {f"{t.name}/{key}": token for t in tables for key, token in t.live().items()}

    def clear() -> None:
        for table in tables:
            table.clear_permits()

    async def main(proxy: FaultProxy) -> Tally:
        client, close = await mysql_client(name, server, proxy, Delaying(phases))
        clock = NotingClock()
        faces: dict[str, Face] = {
            "mutex": AsyncDMutex(service, client, clock=clock),
            "semaphore": AsyncDSemaphore(service, client, max_permits=PERMITS, clock=clock),
        }
        try:
            for face in faces.values():
                await face.ready()
            storage = Storage(permits, clear, owner=owners.of)
            chosen = MYSQL_ONE if name.endswith("connection") else MYSQL
            return await run_trials(chosen, faces, storage, rng, enough)
        finally:
            await close()

    args = connect_args(server.url)
    proxy = FaultProxy(
        (args["host"], args["port"]), MYSQL_NETWORK, seed=SEED, lifetime=120, deliver_late=True
    )
    try:
        with proxy, proxy.faults():
            tally = asyncio.run(asyncio.wait_for(main(proxy), MYSQL_BOUND))
    finally:
        for table in tables:
            table.drop()
        inspector.close()
    tally.calls = calls
    summary = judge(tally)
    for where in STAGE_PHASES:
        assert tally.landed[where] > 0, summary
    assert not proxy.errors, proxy.errors


def test_one_asyncpg_connection_serves_concurrent_tasks_and_a_renewal(
    postgres_server: str, postgres_schema: str
) -> None:
    """A mutex and a semaphore on one asyncpg connection, used by concurrent tasks while a
    lease renews: every call answers (before, all but one raised InterfaceError)."""
    service = f"turns-{uuid.uuid4().hex[:8]}"

    async def main() -> None:
        conn = await asyncpg.connect(postgres_server)
        try:
            mutex = AsyncDMutex(service, conn, schema_name=postgres_schema)
            semaphore = AsyncDSemaphore(
                service, conn, max_permits=PERMITS, schema_name=postgres_schema
            )
            # 0.6 s: a renewal has 0.25 s past its due time to come back (a 0.3 s lease
            # left it 0.125 s, and CI run P's final run once lost the lease, a pause
            # of that size in a process that had run 6,000 tests; never seen alone).
            renewed = await mutex.acquire("renewed", ttl=0.6, auto_renew=True)
            assert renewed is not None
            loop = asyncio.get_running_loop()
            end = loop.time() + 1.5
            while loop.time() < end:  # past the lease's TTL: its renewals meet the calls below
                held = await asyncio.gather(
                    *(mutex.acquire(f"m{n}") for n in range(4)),
                    *(semaphore.acquire("s") for _ in range(PERMITS)),
                )
                assert all(held), held
                assert all(await asyncio.gather(*(h.release() for h in held if h is not None)))
            assert not renewed.lost
            assert await renewed.release() is True
        finally:
            await conn.close()

    asyncio.run(asyncio.wait_for(main(), 20))

"""Issue 43's table in one run: the semaphore, the read-write lock, asyncio, against the mutex.

Run from the repository root (a report, not a test; about 4 minutes on a
shared 2-core VM, the three servers' start-ups included; ``--quick``:
9-13 seconds)::

    .venv/bin/python benchmarks/lean_paths.py
    .venv/bin/python benchmarks/lean_paths.py --quick
    .venv/bin/python benchmarks/lean_paths.py --store redis --json out.json
    .venv/bin/python benchmarks/lean_paths.py --store postgresql --store mysql
    .venv/bin/python benchmarks/lean_paths.py --store redis --url redis://127.0.0.1:6379/0
    .venv/bin/python benchmarks/lean_paths.py --mysql-url mysql://user:pw@127.0.0.1:3306/

The stores, one after another (``--store``, repeatable or a list: ``redis``,
``postgresql``, ``mysql``; all three by default), each on its server as its
own benchmark finds it, started for its part and stopped by pid after it:

- Redis: one server, 7.0 when the test harness finds it, else the newest it
  finds (``harness.one_redis``; ``--redis VERSION`` names another, one
  only), or ``--url``'s, on which it works under its own random names (its
  keys deleted at the end; the server's command counts then include other
  clients' commands);
- PostgreSQL: ``harness.postgres_server``: the server the tests find, or
  ``--postgres-url``'s, in a schema of its own, dropped at the end;
- MySQL: ``mysql_cycle.mysql_server``: the MariaDB/MySQL server the tests
  find, or ``--mysql-url``'s (``mysql://USER:PASSWORD@HOST:PORT/``), in a
  database of its own, dropped at the end.

Every lease has the library's defaults (``default_ttl_seconds`` 300, fences
on, no ``replicas``). The contenders, each an uncontended cycle (acquire of
a free key + ``release()``, its answers checked) on ONE connection per face
that all of that face's contenders share, each on a key of its own:

- ``mutex``: ``DMutex.acquire`` + release;
- ``semaphore``: ``DSemaphore(max_permits=3).acquire`` + release, no other
  permit held;
- ``read`` / ``write``: ``DReadWriteLock.acquire_read`` / ``acquire_write``
  + release;
- Redis only, ``raw``: ``SET key token PX ttl NX`` then ``EVALSHA`` of a
  compare-and-delete script, a fresh ``uuid4`` token a cycle
  (``redis_cycle.mutex_cycles``): the two requests any token lock needs;
- and their asyncio twins, ``mutex-async``, ``semaphore-async``,
  ``read-async``, ``write-async`` (``AsyncDMutex``, ``AsyncDSemaphore``,
  ``AsyncDReadWriteLock``) and, on Redis, ``raw-async``.

The faces: Redis, redis-py's ``Redis`` and ``redis.asyncio.Redis``, each
``single_connection_client`` (``redis_cycle.connections``); PostgreSQL,
psycopg (``autocommit=True``) and asyncpg; MySQL, PyMySQL and aiomysql (both
in autocommit). Each store's part:

1. The cycles, interleaved (``harness.interleave``): after ``--warmup``
   cycles of each, ``--rounds`` rounds of ``--cycles`` per contender
   (``--sql-cycles`` on PostgreSQL and MySQL) in turns of ``--chunk``, the
   order rotating each turn; each cycle timed by ``time.perf_counter_ns``,
   an asyncio turn run to completion on one event loop outside the timed
   region. Its table (ops/s, p50 / p99 / mean µs, the rounds' ops/s) and the
   ratios: ``semaphore / mutex``, ``write / mutex``, ``read / mutex`` of each
   face (each against its own face's mutex), and on Redis ``mutex / raw``
   and ``mutex-async / raw-async``.
2. What a cycle sends, each contender alone, ``--counted`` cycles after a
   warm-up, on connections of its own (not timed). Redis: the server's
   commands per cycle (``INFO commandstats``, which counts every command a
   script runs beside its ``EVALSHA``) and the requests (round trips, every
   one the client sent, by ``harness.trace_requests``; a pipeline is one),
   split into the acquire's and the release's (the release scripts told
   apart by their SHA1s). PostgreSQL: statements per cycle, counted at the
   client (psycopg: each ``execute`` of a connection subclass; asyncpg: its
   query logger, which notes every query the connection runs); in
   autocommit each is one round trip and one transaction. MySQL: the
   connection's ``Questions`` status before and after each cycle
   (``SHOW SESSION STATUS``, less what the ``SHOW`` counts itself;
   ``mysql_cycle.Counter``); the mean over the cycles.

Ratios are throughput ratios, as ``redis_peers.py`` and
``redis_readwrite.py`` compute theirs: per round, the contender's ops/s over
its baseline's (ops/s: cycles over the time spent in them, the rounds run
together), then the median of the rounds' ratios (``harness.ratio``; the
tables give their spread, the pooled ratio, and the same for p50). 0.9x
means the path does 90% of its baseline's cycles per second; a cycle that
takes 2.2x the time is about 0.45x.

Then the summary: one table shaped like the issue's, a row a figure and a
column a store's face, and the targets, PASS or MISS (Redis, when it ran).
Options: ``--cycles``, ``--sql-cycles``, ``--rounds``, ``--chunk``,
``--warmup`` (cycles per contender), ``--counted``; ``--store``; the
harness's ``--url``, ``--redis VERSION``, ``--postgres-url``, ``--quick``,
``--json FILE``, and ``--mysql-url``.

Targets (issue 43, Redis, one connection, ops/s, medians of the rounds'
ratios): ``DSemaphore(3)`` cycle >= 0.9x ``DMutex``'s; <= 10 server commands
per ``DSemaphore(3)`` cycle; ``DReadWriteLock`` write and read cycles each
>= 0.85x ``DMutex``'s; ``AsyncDMutex`` >= 0.9x raw ``redis.asyncio``'s. On
PostgreSQL and MySQL the same ratios and the statements per cycle are
figures, with no target.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import aiomysql
import asyncpg
import harness
import mysql_cycle
import psycopg
import pymysql
import redis
import redis_cycle
import redis_readwrite
from harness import Batch, BenchmarkError, Figures, Request, Target
from mysql_cycle import Counter, Sync
from redis_cycle import Connections, connections, timed, timed_async
from redis_readwrite import Counts

from dmutex import (
    AsyncClient,
    AsyncDMutex,
    AsyncDReadWriteLock,
    AsyncDSemaphore,
    DMutex,
    DReadWriteLock,
    DSemaphore,
    SyncClient,
)

STORES = ("redis", "postgresql", "mysql")
FACES = {  # store: its faces' columns in the summary, sync then asyncio
    "redis": ("Redis", "Redis asyncio"),
    "postgresql": ("PostgreSQL psycopg", "PostgreSQL asyncpg"),
    "mysql": ("MySQL PyMySQL", "MySQL aiomysql"),
}
MUTEX, SEMAPHORE, READ, WRITE, RAW = "mutex", "semaphore", "read", "write", "raw"
LEASES = (MUTEX, SEMAPHORE, READ, WRITE)
ASYNC = "-async"  # an asyncio twin's suffix
SUFFIXES = ("", ASYNC)  # the faces: sync, asyncio
PERMITS = 3  # the semaphore's
TTL_S = 300.0  # the library's default_ttl_seconds: the raw contenders' PX too
STATISTICS = ("ops/s", "p50")
OPTIONS = {  # name: (default, under --quick)
    "cycles": (2000, 300), "sql_cycles": (1000, 100), "rounds": (7, 2), "chunk": (100, 50),
    "warmup": (300, 30), "counted": (200, 20),
}  # fmt: skip
MYSQL_URL_HELP = "measure this MySQL/MariaDB server (mysql://USER:PASSWORD@HOST:PORT/)"
# The raw contenders' compare-and-delete, by its SHA1: a release.
RAW_RELEASE_SHA = hashlib.sha1(redis_cycle.RAW_RELEASE.encode()).hexdigest()


def pairs(redis_store: bool) -> list[tuple[str, str]]:
    """Each face's (contender, baseline) pairs; on Redis, the mutex against raw too."""
    found = [(name + s, MUTEX + s) for s in SUFFIXES for name in (SEMAPHORE, WRITE, READ)]
    return found + ([(MUTEX + s, RAW + s) for s in SUFFIXES] if redis_store else [])


def key(contender: str, baseline: str, statistic: str = "ops/s") -> str:
    """A ratio's key, as ``harness.ratio_table`` keys it."""
    return f"{contender} / {baseline}, {statistic}"


# --- the contenders, on any store ---------------------------------------------------------


class Held(Protocol):
    """A sync lease's handle (``DMutexLock``, ``DSemaphorePermit``, ``DReadLock``...)."""

    def release(self) -> bool: ...


class AsyncHeld(Protocol):
    """An asyncio lease's handle, whose ``release()`` is awaited."""

    def release(self) -> Awaitable[bool]: ...


def sync_leases(client: SyncClient, service: str) -> dict[str, Callable[[], None]]:
    """The four lease cycles on ``client`` (library defaults), in :data:`LEASES` order."""
    mutex = DMutex(service, client)
    sem = DSemaphore(service, client, max_permits=PERMITS)
    rw = DReadWriteLock(service, client)
    for face in (mutex, sem, rw):
        face.ready()  # a SQL store's table made, outside the cycles
    takes: dict[str, Callable[[str], Held | None]] = {
        MUTEX: mutex.acquire,
        SEMAPHORE: sem.acquire,
        READ: rw.acquire_read,
        WRITE: rw.acquire_write,
    }

    def cycle(name: str, take: Callable[[str], Held | None]) -> Callable[[], None]:
        def run() -> None:
            held = take(name)  # each contender on a key of its own
            if held is None or not held.release():
                raise BenchmarkError(f"{name}: uncontended acquire/release failed")

        return run

    return {name: cycle(name, take) for name, take in takes.items()}


def async_leases(
    client: AsyncClient, loop: asyncio.AbstractEventLoop, service: str
) -> dict[str, Callable[[], Awaitable[None]]]:
    """:func:`sync_leases` on an asyncio client, made ready on ``loop``."""
    mutex = AsyncDMutex(service, client)
    sem = AsyncDSemaphore(service, client, max_permits=PERMITS)
    rw = AsyncDReadWriteLock(service, client)
    for face in (mutex, sem, rw):
        loop.run_until_complete(face.ready())
    takes: dict[str, Callable[[str], Awaitable[AsyncHeld | None]]] = {
        MUTEX: mutex.acquire,
        SEMAPHORE: sem.acquire,
        READ: rw.acquire_read,
        WRITE: rw.acquire_write,
    }

    def cycle(
        name: str, take: Callable[[str], Awaitable[AsyncHeld | None]]
    ) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            held = await take(name)
            if held is None or not await held.release():
                raise BenchmarkError(f"{name}{ASYNC}: uncontended acquire/release failed")

        return run

    return {name: cycle(name, take) for name, take in takes.items()}


def batches(
    cycles: Mapping[str, Callable[[], None]],
    acycles: Mapping[str, Callable[[], Awaitable[None]]],
    loop: asyncio.AbstractEventLoop,
) -> dict[str, Batch]:
    """The sync cycles, then their asyncio twins (suffixed), each timed."""
    found = {name: timed(cycle) for name, cycle in cycles.items()}
    return found | {name + ASYNC: timed_async(loop, cycle) for name, cycle in acycles.items()}


@dataclass(frozen=True)
class Timed:
    """A store's interleaved cycles and their ratios (keyed as ``harness.ratio_table``)."""

    figures: dict[str, Figures]
    ratios: dict[str, harness.Ratio]

    def medians(self) -> dict[str, float]:
        """Each ratio's median of the rounds: the figure the summary and targets read."""
        return {name: r.median for name, r in self.ratios.items()}


def interleaved(
    contenders: Mapping[str, Batch], per_round: int, args: argparse.Namespace, redis_store: bool
) -> Timed:
    """``contenders`` in interleaved rounds; their table and ratios, printed."""
    harness.progress("the cycles, interleaved")
    figures = harness.interleave(
        contenders,
        rounds=args.rounds,
        per_round=per_round,
        turn=args.chunk,
        warmup=args.warmup,
    )
    harness.figures_table(figures, "1. The uncontended cycle (acquire + release), one connection")
    ratios = harness.ratio_table(figures, pairs(redis_store), STATISTICS)
    return Timed(figures, ratios)


# --- Redis ---------------------------------------------------------------------------------


def redis_contenders(faces: Connections, run_id: str) -> dict[str, Batch]:
    """Every Redis contender on ``faces``: the leases, raw; then the asyncio twins."""
    raws = redis_cycle.mutex_cycles(faces, run_id, TTL_S)
    loop = faces.loop
    found = batches(
        sync_leases(faces.client, f"lean-{run_id}"),
        async_leases(faces.aclient, loop, f"lean-async-{run_id}"),
        loop,
    )
    found |= {RAW: raws["raw"], RAW + ASYNC: raws["raw-async"]}
    order = [*LEASES, RAW, *(name + ASYNC for name in (*LEASES, RAW))]
    return {name: found[name] for name in order}


def is_release(request: Request) -> bool:
    """Whether ``request`` runs a release script: dmutex's, or the raw contenders'."""
    args = request[0]
    raw = len(args) > 1 and str(args[0]).upper() == "EVALSHA" and args[1] == RAW_RELEASE_SHA
    return raw or redis_readwrite.is_release(request)


def redis_counts(url: str, run_id: str, n: int) -> dict[str, Counts]:
    """Each Redis contender alone, ``n`` cycles after a warm-up: commands and requests."""
    found: dict[str, Counts] = {}
    with connections(url) as faces, redis.Redis.from_url(url) as probe:
        # Before dmutex binds the clients' execute_command and pipeline.
        logs = [harness.trace_requests(faces.client), harness.trace_requests(faces.aclient)]
        for name, batch in redis_contenders(faces, run_id).items():
            commands, sent = harness.sent_alone(probe, logs, batch, n)
            released = sum(map(is_release, sent))
            found[name] = Counts(
                commands=commands,
                acquire=(len(sent) - released) / n,
                release=released / n,
                sent=sorted({" + ".join(map(str, redis_readwrite.names(r))) for r in sent}),
            )
    rows = [
        [name, c.total, c.requests, c.acquire, c.release, c.breakdown()]
        for name, c in found.items()
    ]
    head = ["contender", "commands", "requests", "acquire", "release", "commands by name"]
    title = (
        f"2. Per cycle, {n} of each alone: the server's commands (INFO commandstats, a "
        "script's own included) and requests (round trips; a pipeline is one)"
    )
    harness.table(head, rows, title)
    return found


def redis_part(url: str, args: argparse.Namespace) -> dict[str, object]:
    run_id = uuid.uuid4().hex[:8]
    try:
        with connections(url) as faces:
            found = interleaved(redis_contenders(faces, f"{run_id}t"), args.cycles, args, True)
        harness.progress("counted cycles")
        counts = redis_counts(url, f"{run_id}n", args.counted)
    finally:
        harness.delete_keys(url, f"*{run_id}*")  # the fence counters, anything left
    return {
        "figures": found.figures,
        "ratios": found.ratios,
        "medians": found.medians(),
        "counts": counts,
        "commands": {name: c.total for name, c in counts.items()},
        "requests": {name: c.requests for name, c in counts.items()},
    }


# --- statements per cycle, on a SQL store ----------------------------------------------------


def statements(
    cycles: Mapping[str, Callable[[], None]], read: Callable[[], int], n: int
) -> dict[str, float]:
    """Each cycle's statements, the mean of ``n`` after 3 unmeasured, by ``read``'s counter."""
    counter = Counter(read, n, {})
    for name, cycle in cycles.items():
        for _ in range(3):
            cycle()
        counter.count(name, cycle)
    return counter.found


def on_loop(
    loop: asyncio.AbstractEventLoop, cycles: Mapping[str, Callable[[], Awaitable[None]]]
) -> dict[str, Callable[[], None]]:
    """Each asyncio cycle run to completion on ``loop``, its name suffixed."""

    def run(cycle: Callable[[], Awaitable[None]]) -> Callable[[], None]:
        async def once() -> None:
            await cycle()

        return lambda: loop.run_until_complete(once())

    return {name + ASYNC: run(cycle) for name, cycle in cycles.items()}


def statements_table(found: Mapping[str, float], how: str, n: int) -> None:
    rows = [[name, value] for name, value in found.items()]
    harness.table(["contender", "statements"], rows, f"2. Per cycle, {n} of each alone: {how}")


# --- PostgreSQL ------------------------------------------------------------------------------


class Counting(psycopg.Connection[tuple[Any, ...]]):
    """A psycopg connection that counts the statements it executes (dmutex's runner's calls)."""

    sent = 0

    def execute(self, *args: Any, **kwargs: Any) -> psycopg.Cursor[tuple[Any, ...]]:
        self.sent += 1
        cursor: psycopg.Cursor[tuple[Any, ...]] = super().execute(*args, **kwargs)
        return cursor


def postgres_counts(
    url: str, loop: asyncio.AbstractEventLoop, service: str, n: int
) -> dict[str, float]:
    """Statements per cycle on connections of their own, counted at the client."""
    logged: list[object] = []
    aconn = loop.run_until_complete(asyncpg.connect(url))
    try:
        aconn.add_query_logger(logged.append)

        def queries() -> int:
            loop.run_until_complete(asyncio.sleep(0))  # the logger runs by call_soon
            return len(logged)

        with Counting.connect(url, autocommit=True) as conn:
            found = statements(sync_leases(conn, service), lambda: conn.sent, n)
        acycles = on_loop(loop, async_leases(aconn, loop, f"{service}_async"))
        found |= statements(acycles, queries, n)
    finally:
        loop.run_until_complete(aconn.close())
    how = "statements counted at the client (psycopg's execute calls, asyncpg's query logger)"
    statements_table(found, how, n)
    return found


def postgres_part(url: str, args: argparse.Namespace) -> dict[str, object]:
    settings = harness.postgres_settings(url)
    run_id = uuid.uuid4().hex[:8]
    loop = asyncio.new_event_loop()
    try:
        aconn = loop.run_until_complete(asyncpg.connect(url))
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                contenders = batches(
                    sync_leases(conn, f"lean_{run_id}"),
                    async_leases(aconn, loop, f"lean_{run_id}_async"),
                    loop,
                )
                found = interleaved(contenders, args.sql_cycles, args, False)
        finally:
            loop.run_until_complete(aconn.close())
        harness.progress("counted cycles")
        counted = postgres_counts(url, loop, f"lean_{run_id}", args.counted)
    finally:
        loop.close()
    return {
        "settings": settings,
        "figures": found.figures,
        "ratios": found.ratios,
        "medians": found.medians(),
        "statements": counted,
    }


# --- MySQL -----------------------------------------------------------------------------------


@contextmanager
def aiomysql_connection(url: str, loop: asyncio.AbstractEventLoop) -> Iterator[aiomysql.Connection]:
    """One aiomysql connection to ``url``'s database, in autocommit, as ``mysql_cycle.py``'s."""
    connect = mysql_cycle.connect_args(url)
    aconn = loop.run_until_complete(
        aiomysql.connect(
            host=connect["host"],
            port=connect["port"],
            user=connect["user"],
            password=connect["password"],
            db=connect["database"],
            autocommit=True,
            charset="utf8mb4",
        )
    )
    try:
        yield aconn
    finally:
        aconn.close()


def mysql_part(url: str, args: argparse.Namespace) -> dict[str, object]:
    run_id = uuid.uuid4().hex[:8]
    loop = asyncio.new_event_loop()
    try:
        with (
            aiomysql_connection(url, loop) as aconn,
            pymysql.connect(**mysql_cycle.connect_args(url)) as conn,
        ):
            settings = mysql_cycle.settings(conn)
            cycles = sync_leases(conn, f"lean_{run_id}")
            acycles = async_leases(aconn, loop, f"lean_{run_id}_async")
            found = interleaved(batches(cycles, acycles, loop), args.sql_cycles, args, False)
            harness.progress("counted cycles")
            counted = mysql_statements(conn, aconn, loop, cycles, acycles, args.counted)
    finally:
        loop.close()
    return {
        "settings": settings,
        "figures": found.figures,
        "ratios": found.ratios,
        "medians": found.medians(),
        "statements": counted,
    }


def mysql_statements(
    conn: Sync,
    aconn: aiomysql.Connection,
    loop: asyncio.AbstractEventLoop,
    cycles: Mapping[str, Callable[[], None]],
    acycles: Mapping[str, Callable[[], Awaitable[None]]],
    n: int,
) -> dict[str, float]:
    """Statements per cycle by each connection's ``Questions`` status (``mysql_cycle``'s)."""
    found = statements(cycles, lambda: mysql_cycle.questions(conn), n)
    found |= statements(
        on_loop(loop, acycles), lambda: loop.run_until_complete(mysql_cycle.aquestions(aconn)), n
    )
    statements_table(found, "statements (the connection's Questions status)", n)
    return found


# --- the run ---------------------------------------------------------------------------------


Part = Callable[[str, argparse.Namespace], dict[str, object]]


def on_store(store: str, args: argparse.Namespace) -> dict[str, object]:
    """``store``'s part on its server, started and stopped here (or the one named)."""
    if store == "redis":
        if args.url:
            return {"server": "url", **harness.run_on("url", args.url, redis_part, args)}
        with closing(harness.redis_servers(args.redis or harness.one_redis("7.0"))) as servers:
            for label, url in servers:
                return {"server": label, **harness.run_on(label, url, redis_part, args)}
        raise BenchmarkError("no Redis server")  # redis_servers raises first
    part: Part = postgres_part if store == "postgresql" else mysql_part
    server = (
        harness.postgres_server(args.postgres_url)
        if store == "postgresql"
        else mysql_cycle.mysql_server(args.mysql_url)
    )
    with server as (label, url):
        print(f"\n## {label} ({harness.shown(url)})\n", flush=True)
        return {"server": label, "url": harness.shown(url), **part(url, args)}


def bench(_: str, args: argparse.Namespace) -> dict[str, object]:
    """Each store's part, one after another; then the summary and the targets."""
    stores = [store for store in STORES if store in (args.store or STORES)]
    print(
        f"Stores: {', '.join(stores)}. Cycles: {args.rounds} rounds x {args.cycles} (Redis) / "
        f"{args.sql_cycles} (SQL) per contender in turns of {args.chunk}, after {args.warmup} "
        f"warm-up; {args.counted} counted" + (" (--quick)" if args.quick else ""),
        flush=True,
    )
    print(f"Load average at the start: {os.getloadavg()[0]:.2f} (1 min)")
    runs: dict[str, dict[str, object]] = {}
    for store in stores:
        harness.progress(store)
        runs[store] = on_store(store, args)
    rows = summarize(runs)
    targets = check(runs["redis"]) if "redis" in runs else []
    if targets:
        harness.targets_table(targets)
    found: dict[str, object] = {**runs, "summary": {"rows": rows, "targets": targets}}
    return found


def per_cycle(run: Mapping[str, Any], name: str) -> str | None:
    """What a cycle sends: Redis, commands / requests; SQL, statements."""
    if "counts" in run:
        counts: Counts | None = run["counts"].get(name)
        return None if counts is None else f"{counts.total:g} / {counts.requests:g}"
    found: float | None = run["statements"].get(name)
    return None if found is None else f"{found:g}"


def summarize(runs: Mapping[str, Mapping[str, Any]]) -> list[list[object]]:
    """Print and return the issue's table: a row a figure, a column a store's face."""
    columns = [(store, s) for store in runs for s in SUFFIXES]

    def row(label: str, value: Callable[[Mapping[str, Any], str], object]) -> list[object]:
        return [label, *(value(runs[store], s) for store, s in columns)]

    def x(contender: str, baseline: str) -> Callable[[Mapping[str, Any], str], object]:
        def value(run: Mapping[str, Any], s: str) -> object:
            return run["medians"].get(key(contender + s, baseline + s))

        return value

    def sends(name: str) -> Callable[[Mapping[str, Any], str], object]:
        return lambda run, s: per_cycle(run, name + s)

    def figure(statistic: str) -> Callable[[Mapping[str, Any], str], object]:
        def value(run: Mapping[str, Any], s: str) -> object:
            found: Figures = run["figures"][MUTEX + s]
            return found.ops_per_s if statistic == "ops/s" else found.us(statistic)

        return value

    rows = [
        row(f"DSemaphore(max_permits={PERMITS}) cycle / DMutex cycle", x(SEMAPHORE, MUTEX)),
        row("DReadWriteLock write cycle / DMutex cycle", x(WRITE, MUTEX)),
        row("DReadWriteLock read cycle / DMutex cycle", x(READ, MUTEX)),
        row("DMutex cycle / raw (SET NX PX + EVALSHA)", x(MUTEX, RAW)),
        row("DMutex cycle, ops/s", figure("ops/s")),
        row("DMutex cycle, p50 µs", figure("p50")),
        row("per DMutex cycle", sends(MUTEX)),
        row(f"per DSemaphore({PERMITS}) cycle", sends(SEMAPHORE)),
        row("per DReadWriteLock read cycle", sends(READ)),
        row("per DReadWriteLock write cycle", sends(WRITE)),
        row("per raw cycle", sends(RAW)),
    ]
    head = ["figure", *(FACES[store][SUFFIXES.index(s)] for store, s in columns)]
    title = (
        "Summary (x: ops/s over the baseline's, the median of the rounds' ratios, each face "
        "against its own: an asyncio column's mutex is AsyncDMutex, its raw redis.asyncio's; "
        "per cycle: Redis, server commands (INFO commandstats, a script's included) / "
        "requests; SQL, statements)"
    )
    harness.table(head, rows, title)
    return rows


def check(run: Mapping[str, Any]) -> list[Target]:
    """Issue 43's targets, from this run's Redis figures (medians of the rounds' ratios)."""
    medians: Mapping[str, float] = run["medians"]
    counts: Mapping[str, Counts] = run["counts"]
    return [
        Target(
            f"DSemaphore({PERMITS}) cycle / DMutex cycle (ops/s)",
            medians[key(SEMAPHORE, MUTEX)],
            0.9,
            True,
        ),
        Target(
            f"server commands per DSemaphore({PERMITS}) cycle",
            counts[SEMAPHORE].total,
            10,
            False,
        ),
        Target("DReadWriteLock write cycle / DMutex cycle", medians[key(WRITE, MUTEX)], 0.85, True),
        Target("DReadWriteLock read cycle / DMutex cycle", medians[key(READ, MUTEX)], 0.85, True),
        Target(
            "AsyncDMutex cycle / raw redis.asyncio's (ops/s)",
            medians[key(MUTEX + ASYNC, RAW + ASYNC)],
            0.9,
            True,
        ),
    ]


def own_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        action="extend",
        nargs="+",
        choices=STORES,
        help="the stores to measure (repeatable; default: all three)",
    )
    parser.add_argument("--mysql-url", default="", help=MYSQL_URL_HELP)


def run(argv: Sequence[str] | None = None) -> int:
    args = harness.parse(__doc__, argv, OPTIONS, postgres=True, more=own_options)
    if len(args.redis) > 1:
        print("lean_paths.py measures one Redis: name one version", file=sys.stderr)
        return 2
    errors = (pymysql.err.MySQLError, asyncpg.PostgresError)
    return harness.main(bench, args, errors=errors, several=True)


if __name__ == "__main__":
    sys.exit(run())

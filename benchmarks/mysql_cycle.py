"""How close dmutex's MySQL lock cycle comes to hand-written SQL; a semaphore's acquire as N grows.

Run from the repository root (a report, not a test; about 3 minutes on a shared 2-core VM)::

    .venv/bin/python benchmarks/mysql_cycle.py
    .venv/bin/python benchmarks/mysql_cycle.py --quick --json out.json
    .venv/bin/python benchmarks/mysql_cycle.py --url mysql://user:password@127.0.0.1:3306/

The server is the one the tests find (``tests/_support/mysql_servers.py``:
``DMUTEX_MYSQL_URL``, Docker's ``mariadb:10.11``, or the ``mariadbd``
executables), started here and stopped by pid at the end, or the one
``--url`` names (never started or stopped). Either way the script works in
a database of its own, ``dmutex_bench_<random>``, dropped at the end. Its
settings (version, ``innodb_flush_log_at_trx_commit``, the binary log) are
printed: a commit's cost depends on them.

1. The uncontended cycle, acquire + release of one key, on ONE PyMySQL
   connection in autocommit (every contender shares it), then on one
   aiomysql connection in autocommit; after a warm-up, ``--rounds`` rounds of
   ``--cycles`` cycles per contender, interleaved in turns of ``--chunk``
   (``harness.interleave``), each cycle timed with ``time.perf_counter_ns``:

   - ``dmutex``: ``DMutex.acquire(key)`` then ``lock.release()``, with
     ``fencing=False``: the raw contenders keep no fence either;
   - ``dmutex fenced``: the same with ``fencing=True`` (the default), whose
     grant writes the fence row in the take's own statement (part 3 counts
     what each sends);
   - ``raw ts``: modeled on the TypeScript dmutex's MySQL store, written by
     hand: an upsert (``INSERT ... ON DUPLICATE KEY UPDATE`` that takes the row
     only if it expired, the expiry from the host's clock), a ``SELECT`` of
     the row's value to learn whether it holds the caller's token, and a
     ``DELETE`` by key and token: 3 statements;
   - ``raw 1``: the same upsert alone, its affected-row count saying whether
     it took the row (1 inserted, 2 took an expired one, 0 left a held one:
     PyMySQL and aiomysql do not set ``CLIENT_FOUND_ROWS``, which would
     count 1 for the last; checked at the start), then the ``DELETE``: 2
     statements, the fewest a hand-written lock can send;
   - ``raw sql``: dmutex's own two statements
     (``dmutex._backends.mysql.statements``: the take, whose answer rides in
     the OK packet's ``LAST_INSERT_ID``, and the release), sent raw with the
     parameters dmutex gives them: the floor of dmutex's protocol.

   - ``read`` and ``write``: a read-write lock's ``acquire_read`` /
     ``acquire_write`` then ``release()`` (``DReadWriteLock``, fenced as by
     default; issue 28): each acquire and release is a read then a
     compare-and-set write, four statements a cycle; the ratios to ``dmutex
     fenced`` say what that costs.

   Every raw contender uses a fresh ``uuid4`` token per cycle, one cursor
   per cycle, and checks its answers, as dmutex does.
2. A semaphore's acquire at each ``max_permits`` N of ``--permits`` (1, 64,
   1,024): one ``DSemaphore`` on the PyMySQL connection, three keys whose
   other slots' rows are written beforehand (the rows an acquire writes,
   held by other tokens for an hour): ``full`` (all N held: the acquire is
   refused), ``last free`` (N-1 held: it takes the last one) and ``empty``
   (it takes a random one of N). Granted permits are released untimed;
   ``--samples`` per case per round, in turns of ``--turn``, ``--rounds``
   rounds.
3. Statements per operation: the server's ``Questions`` counter of the
   connection (``SHOW SESSION STATUS LIKE 'Questions'``) before and after
   one operation, less what the ``SHOW`` itself counts; the mean of
   ``--counts`` operations. Not timed.

Options: ``--cycles``, ``--rounds``, ``--chunk``, ``--warmup`` (cycles, and
semaphore samples, per contender), ``--ttl`` (s), ``--permits N...``,
``--samples``, ``--turn``, ``--counts``; ``--url``, ``--quick``, ``--json FILE``.

Target: dmutex >= 0.9x raw ops/s (the median of the per-round ratios) with
each driver, against each raw contender. The semaphore: figures and the
ratios to N=1, no target.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeAlias

import aiomysql
import harness
import pymysql
from harness import Batch, BenchmarkError, Target
from pymysql.connections import Connection
from pymysql.cursors import Cursor
from redis_cycle import timed, timed_async

from dmutex import (
    AsyncDMutex,
    AsyncDReadWriteLock,
    DMutex,
    DMutexLock,
    DReadWriteLock,
    DSemaphore,
    DSemaphorePermit,
)
from dmutex._backends.mysql.statements import Statements, granted

OPTIONS = {  # name: (default, under --quick)
    "cycles": (2000, 100), "rounds": (5, 2), "chunk": (100, 50), "warmup": (300, 20),
    "ttl": (30.0, 30.0), "permits": ([1, 64, 1024], [1, 64]), "samples": (200, 20),
    "turn": (20, 10), "counts": (5, 2),
}  # fmt: skip
URL_HELP = "measure this MySQL/MariaDB server (mysql://USER:PASSWORD@HOST:PORT/)"
DRIVERS = ("pymysql", "aiomysql")
RAWS = ("raw ts", "raw 1", "raw sql")
HOLDER_TTL_MS = 3_600_000  # the semaphores' other slots: none expires during a run
SEMAPHORE_TTL_S = 300.0
FULL, LAST, EMPTY = "full", "last free", "empty"
CASES = {FULL: 0, LAST: 1, EMPTY: None}  # slots left free; None: all of them
QUESTIONS = "SHOW SESSION STATUS LIKE 'Questions'"
Sync: TypeAlias = "Connection[Cursor]"


def use_test_harness() -> None:
    """Make ``tests._support`` (the test harness's discovery and URLs) importable."""
    if str(harness.ROOT) not in sys.path:  # run as a script: sys.path[0] is benchmarks/
        sys.path.insert(0, str(harness.ROOT))


@contextmanager
def mysql_server(url: str) -> Iterator[tuple[str, str]]:
    """``(label, url)`` of ``url``'s server or the test harness's, in a database of its own.

    Without ``url`` the server the tests find starts here and stops (by pid)
    on the way out. The URL yielded names the database, dropped on the way out.
    """
    use_test_harness()
    from tests._support import mysql_servers as servers

    if not url:
        session = servers.new_session()
        try:
            if not session.discovery.sources:
                raise BenchmarkError(session.discovery.reason or "no MySQL server found")
            found = session.server()
            with mysql_server(found.url) as (_, inside):
                yield found.label, inside
        finally:
            session.close()
        return
    database = f"dmutex_bench_{uuid.uuid4().hex[:12]}"
    args = servers.connect_args(url)
    args.pop("database", None)
    with pymysql.connect(**args, autocommit=True) as conn, conn.cursor() as cursor:
        cursor.execute("SELECT VERSION()")
        version = str((cursor.fetchone() or ("?",))[0])
        cursor.execute(f"CREATE DATABASE `{database}` CHARACTER SET utf8mb4")
    try:
        flavour, number = servers.parse_version(version)
        yield f"{flavour}-{number}", servers.with_database(url, database)
    finally:
        with pymysql.connect(**args, autocommit=True) as conn, conn.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS `{database}`")


def connect_args(url: str) -> dict[str, Any]:
    """PyMySQL's connect() arguments for ``url`` (which names the database)."""
    use_test_harness()
    from tests._support.mysql_servers import connect_args as of_url

    args: dict[str, Any] = dict(of_url(url))
    return {**args, "autocommit": True, "charset": "utf8mb4"}


def settings(conn: Sync) -> dict[str, str]:
    """The settings a figure depends on, printed and returned."""
    names = ("version", "innodb_flush_log_at_trx_commit", "log_bin", "innodb_doublewrite")
    with conn.cursor() as cursor:
        cursor.execute("SELECT " + ", ".join(f"@@{name}" for name in names))
        row = cursor.fetchone()
    if row is None:
        raise BenchmarkError("the server did not answer its settings")
    found = {name: str(value) for name, value in zip(names, row, strict=True)}
    print(f"settings: {found}", flush=True)
    return found


# --- the hand-written statements -------------------------------------------------------


@dataclass(frozen=True)
class Hand:
    """Statements modeled on the TypeScript dmutex's MySQL store, by hand: host-clock expiries."""

    upsert: str
    read: str
    delete: str

    @classmethod
    def of(cls, table: str) -> Hand:
        t = f"`{table}`"
        return cls(
            upsert=(
                f"INSERT INTO {t} (`key`, `value`, `expired_at`)\n"
                "VALUES (%(row)s, %(token)s, %(expires)s)\n"
                "ON DUPLICATE KEY UPDATE\n"
                "  `value` = IF(`expired_at` <= %(now)s, %(token)s, `value`),\n"
                "  `expired_at` = IF(`expired_at` <= %(now)s, %(expires)s, `expired_at`)"
            ),
            read=f"SELECT `value` FROM {t} WHERE `key` = %(row)s",
            delete=f"DELETE FROM {t} WHERE `key` = %(row)s AND `value` = %(token)s",
        )


def hand_params(row: str, ttl_ms: int) -> dict[str, object]:
    """A hand-written acquire's parameters: a fresh token, the host's clock."""
    now = time.time_ns() // 1_000_000
    return {"row": row, "token": str(uuid.uuid4()), "expires": now + ttl_ms, "now": now}


def sql_params(row: str, ttl_ms: int) -> dict[str, object]:
    """The store's take and release parameters for slot 0, as it gives them: a fresh token."""
    return {"row": row, "token": str(uuid.uuid4()), "ttl": ttl_ms, "slot": 0}


def taken_by_count(count: int) -> bool:
    """Whether an upsert took the row: inserted (1) or took over an expired one (2)."""
    return count in (1, 2)


# --- part 1: the cycle ------------------------------------------------------------------


Cycle = Callable[[], None]
AsyncCycle = Callable[[], Awaitable[None]]
Raw = Callable[[str, bool], bool]
"""``raw(row, release)``: acquire ``row`` with a fresh token, and release it if asked; whether
it was taken (and released)."""
AsyncRaw = Callable[[str, bool], Awaitable[bool]]
ROWS = {"raw ts": "permit:0:t", "raw 1": "permit:0:o", "raw sql": "permit:0:s"}


def sync_raws(conn: Sync, table: str, ttl_ms: int) -> dict[str, Raw]:
    """The raw contenders on a PyMySQL connection."""
    hand, sql = Hand.of(table), Statements.of(table)

    def raw_ts(row: str, release: bool) -> bool:
        params = hand_params(row, ttl_ms)
        with conn.cursor() as cursor:
            cursor.execute(hand.upsert, params)
            cursor.execute(hand.read, params)
            found = cursor.fetchone()
            if found is None or found[0] != params["token"]:
                return False
            return not release or cursor.execute(hand.delete, params) == 1

    def raw_one(row: str, release: bool) -> bool:
        params = hand_params(row, ttl_ms)
        with conn.cursor() as cursor:
            if not taken_by_count(cursor.execute(hand.upsert, params)):
                return False
            return not release or cursor.execute(hand.delete, params) == 1

    def raw_sql(row: str, release: bool) -> bool:
        params = sql_params(row, ttl_ms)
        with conn.cursor() as cursor:
            cursor.execute(sql.take.text, params)
            if granted(cursor.lastrowid or 0) is None:
                return False
            return not release or cursor.execute(sql.release.text, params) == 1

    return {"raw ts": raw_ts, "raw 1": raw_one, "raw sql": raw_sql}


def async_raws(conn: aiomysql.Connection, table: str, ttl_ms: int) -> dict[str, AsyncRaw]:
    """The raw contenders on an aiomysql connection."""
    hand, sql = Hand.of(table), Statements.of(table)

    async def raw_ts(row: str, release: bool) -> bool:
        params = hand_params(row, ttl_ms)
        async with conn.cursor() as cursor:
            await cursor.execute(hand.upsert, params)
            await cursor.execute(hand.read, params)
            found = await cursor.fetchall()
            if len(found) != 1 or found[0][0] != params["token"]:
                return False
            return not release or await cursor.execute(hand.delete, params) == 1

    async def raw_one(row: str, release: bool) -> bool:
        params = hand_params(row, ttl_ms)
        async with conn.cursor() as cursor:
            if not taken_by_count(await cursor.execute(hand.upsert, params)):
                return False
            return not release or await cursor.execute(hand.delete, params) == 1

    async def raw_sql(row: str, release: bool) -> bool:
        params = sql_params(row, ttl_ms)
        async with conn.cursor() as cursor:
            await cursor.execute(sql.take.text, params)
            if granted(cursor.lastrowid or 0) is None:
                return False
            return not release or await cursor.execute(sql.release.text, params) == 1

    return {"raw ts": raw_ts, "raw 1": raw_one, "raw sql": raw_sql}


def check(name: str, took: bool, refused: bool) -> None:
    """A raw acquire took a free row and was refused a held one, else its figures mean nothing."""
    if not took:
        raise BenchmarkError(f"{name}: the acquire of a free key failed")
    if not refused:
        raise BenchmarkError(f"{name}: a held key was granted again (CLIENT_FOUND_ROWS set?)")


def sync_cycles(conn: Sync, service: str, ttl_s: float) -> dict[str, Cycle]:
    """Each contender's cycle on ``conn`` (PyMySQL), its table made and its raw SQL checked.

    The check leaves a row of each raw contender held (``check <name>``):
    the table is dropped with the database.
    """
    mutex = DMutex(service, conn, default_ttl_seconds=ttl_s, fencing=False)
    fenced = DMutex(service, conn, default_ttl_seconds=ttl_s, fencing=True)
    mutex.ready()
    fenced.ready()

    def cycle(face: DMutex, key: str, name: str) -> Cycle:
        def run() -> None:
            lock = face.acquire(key)
            if lock is None or not lock.release():
                raise BenchmarkError(f"{name}: uncontended acquire/release failed")

        return run

    def raw_cycle(name: str, raw: Raw) -> Cycle:
        row = ROWS[name]

        def run() -> None:
            if not raw(row, True):
                raise BenchmarkError(f"{name}: uncontended acquire/release failed")

        return run

    raws = sync_raws(conn, f"_dmutex_{service}", math.ceil(ttl_s * 1000))
    for name, raw in raws.items():
        row = f"permit:0:check {name}"
        check(name, raw(row, False), not raw(row, False))
    rw = DReadWriteLock(service, conn, default_ttl_seconds=ttl_s)
    rw.ready()

    def rw_cycle(write: bool) -> Cycle:
        take = rw.acquire_write if write else rw.acquire_read

        def run() -> None:
            held = take("rw")
            if held is None or not held.release():
                raise BenchmarkError(f"{'write' if write else 'read'}: uncontended cycle failed")

        return run

    return {
        "dmutex": cycle(mutex, "k", "dmutex"),
        "dmutex fenced": cycle(fenced, "f", "dmutex fenced"),
        **{name: raw_cycle(name, raw) for name, raw in raws.items()},
        "read": rw_cycle(False),
        "write": rw_cycle(True),
    }


def async_cycles(
    conn: aiomysql.Connection, loop: asyncio.AbstractEventLoop, service: str, ttl_s: float
) -> dict[str, AsyncCycle]:
    """:func:`sync_cycles` on an aiomysql connection (``AsyncDMutex``), names suffixed."""
    mutex = AsyncDMutex(service, conn, default_ttl_seconds=ttl_s, fencing=False)
    fenced = AsyncDMutex(service, conn, default_ttl_seconds=ttl_s, fencing=True)
    loop.run_until_complete(mutex.ready())
    loop.run_until_complete(fenced.ready())

    def cycle(face: AsyncDMutex, key: str, name: str) -> AsyncCycle:
        async def run() -> None:
            lock = await face.acquire(key)
            if lock is None or not await lock.release():
                raise BenchmarkError(f"{name}: uncontended acquire/release failed")

        return run

    def raw_cycle(name: str, raw: AsyncRaw) -> AsyncCycle:
        row = ROWS[name]

        async def run() -> None:
            if not await raw(row, True):
                raise BenchmarkError(f"{name} (aiomysql): uncontended acquire/release failed")

        return run

    raws = async_raws(conn, f"_dmutex_{service}", math.ceil(ttl_s * 1000))
    for name, raw in raws.items():
        row = f"permit:0:check {name}"
        took = loop.run_until_complete(raw(row, False))
        check(f"{name} aiomysql", took, not loop.run_until_complete(raw(row, False)))
    rw = AsyncDReadWriteLock(service, conn, default_ttl_seconds=ttl_s)
    loop.run_until_complete(rw.ready())

    def rw_cycle(write: bool) -> AsyncCycle:
        take = rw.acquire_write if write else rw.acquire_read

        async def run() -> None:
            held = await take("rw")
            if held is None or not await held.release():
                raise BenchmarkError(f"{'write' if write else 'read'} (aiomysql): cycle failed")

        return run

    return {
        "dmutex aiomysql": cycle(mutex, "k", "AsyncDMutex"),
        "dmutex fenced aiomysql": cycle(fenced, "f", "AsyncDMutex fenced"),
        **{f"{name} aiomysql": raw_cycle(name, raw) for name, raw in raws.items()},
        "read aiomysql": rw_cycle(False),
        "write aiomysql": rw_cycle(True),
    }


# --- part 2: a semaphore's acquire -----------------------------------------------------


def server_now_ms(conn: Sync) -> int:
    with conn.cursor() as cursor:
        cursor.execute("SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6)) DIV 1000")
        row = cursor.fetchone()
    if row is None:
        raise BenchmarkError("the server did not tell its time")
    return int(row[0])


def fill(conn: Sync, table: str, key: str, count: int) -> None:
    """Rows of slots 0 .. count-1 of ``key``, held by other tokens for an hour (server time)."""
    if count == 0:
        return
    expires = server_now_ms(conn) + HOLDER_TTL_MS
    rows = [(f"permit:{i}:{key}", str(uuid.uuid4()), expires) for i in range(count)]
    with conn.cursor() as cursor:
        cursor.executemany(
            f"INSERT INTO `{table}` (`key`, `value`, `expired_at`) VALUES (%s, %s, %s)", rows
        )


def semaphores(conn: Sync, permits: Sequence[int], run_id: str) -> dict[int, DSemaphore]:
    """One ``DSemaphore`` per N, its table made and its keys' other slots filled."""
    made = {}
    for n in permits:
        sem = DSemaphore(
            f"sem{n}_{run_id}",
            conn,
            max_permits=n,
            default_ttl_seconds=SEMAPHORE_TTL_S,
        )
        sem.ready()
        for case, free in CASES.items():
            if free is not None:
                fill(conn, f"_dsemaphore_sem{n}_{run_id}", case, n - free)
        made[n] = sem
    return made


def acquires(sem: DSemaphore, n: int, key: str, *, granted_: bool) -> Batch:
    """A batch of timed acquires of ``key``; granted permits are released untimed."""

    def run(count: int) -> list[int]:
        samples, clock = [0] * count, time.perf_counter_ns
        for i in range(count):
            start = clock()
            permit = sem.acquire(key)
            samples[i] = clock() - start
            if (permit is not None) != granted_:
                verb = "refused" if granted_ else "granted"
                raise BenchmarkError(f"{key} N={n}: the acquire was {verb}")
            if permit is not None and not permit.release():
                raise BenchmarkError(f"{key} N={n}: the release found no permit")
        return samples

    return run


# --- part 3: statements per operation --------------------------------------------------


def questions(conn: Sync) -> int:
    """The connection's ``Questions`` status: the statements it sent so far."""
    with conn.cursor() as cursor:
        cursor.execute(QUESTIONS)
        row = cursor.fetchone()
    if row is None:
        raise BenchmarkError("the server has no Questions status")
    return int(row[1])


async def aquestions(conn: aiomysql.Connection) -> int:
    async with conn.cursor() as cursor:
        await cursor.execute(QUESTIONS)
        rows = await cursor.fetchall()
    if len(rows) != 1:
        raise BenchmarkError("the server has no Questions status")
    return int(rows[0][1])


@dataclass
class Counter:
    """Statements per operation on one connection, by its ``Questions`` status."""

    read: Callable[[], int]
    times: int
    found: dict[str, float]

    def count(
        self,
        name: str,
        operation: Callable[[], object],
        after: Callable[[Any], object] = lambda _: None,
    ) -> None:
        """The mean statements of ``operation`` (``after`` gets its result, uncounted)."""
        first = self.read()
        own = self.read() - first  # what a SHOW counts itself
        total = 0
        for _ in range(self.times):
            before = self.read()
            result = operation()
            total += self.read() - before - own
            after(result)
        self.found[name] = total / self.times


def release(handle: DMutexLock | DSemaphorePermit | None) -> None:
    if handle is None or not handle.release():
        raise BenchmarkError("a counted acquire left nothing to release")


def count_sync(
    conn: Sync,
    service: str,
    cycles: Mapping[str, Cycle],
    sems: Mapping[int, DSemaphore],
    times: int,
) -> dict[str, float]:
    counter = Counter(lambda: questions(conn), times, {})
    mutex = DMutex(service, conn, fencing=False)
    fenced = DMutex(service, conn, fencing=True)
    mutex.ready()  # else the first acquire counts the table's check too
    fenced.ready()
    for name, cycle in cycles.items():
        counter.count(f"cycle: {name}", cycle)
    counter.count("DMutex(fencing=False).acquire, granted", lambda: mutex.acquire("c"), release)
    counter.count("DMutex(fencing=True).acquire, granted", lambda: fenced.acquire("c"), release)
    holder = mutex.acquire("held")
    counter.count("DMutex.acquire, refused", lambda: mutex.acquire("held"))
    if holder is None:
        raise BenchmarkError("the counted mutex was not taken")
    counter.count("DMutexLock.extend", holder.extend)
    locks = iter([mutex.acquire(f"r{i}") for i in range(times)])
    counter.count("DMutexLock.release", lambda: release(next(locks)))
    release(holder)
    for n, sem in sems.items():
        count_semaphore(counter, n, sem, times)
    return counter.found


def count_semaphore(counter: Counter, n: int, sem: DSemaphore, times: int) -> None:
    """A semaphore's acquires (full, last free, empty) and release at N = ``n``."""

    def acquire(key: str) -> Callable[[], DSemaphorePermit | None]:
        return lambda: sem.acquire(key)

    counter.count(f"DSemaphore.acquire, full, N={n}", acquire(FULL))
    counter.count(f"DSemaphore.acquire, last free, N={n}", acquire(LAST), release)
    counter.count(f"DSemaphore.acquire, empty, N={n}", acquire(EMPTY), release)
    permits = iter([sem.acquire(f"release {i}") for i in range(times)])
    counter.count(f"DSemaphorePermit.release, N={n}", lambda: release(next(permits)))


def count_async(
    conn: aiomysql.Connection,
    loop: asyncio.AbstractEventLoop,
    cycles: Mapping[str, AsyncCycle],
    times: int,
) -> dict[str, float]:
    counter = Counter(lambda: loop.run_until_complete(aquestions(conn)), times, {})

    def on_loop(cycle: AsyncCycle) -> Callable[[], None]:
        return lambda: loop.run_until_complete(cycle())

    for name, cycle in cycles.items():
        counter.count(f"cycle: {name}", on_loop(cycle))
    return counter.found


# --- the run ------------------------------------------------------------------------------


def suffix(driver: str) -> str:
    return "" if driver == "pymysql" else f" {driver}"


def bench(url: str, args: argparse.Namespace) -> dict[str, object]:
    """Measure every part on ``url``; print and return the figures."""
    run_id = uuid.uuid4().hex[:8]
    service = f"bench_{run_id}"
    connect = connect_args(url)
    loop = asyncio.new_event_loop()
    try:
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
            with pymysql.connect(**connect) as conn:
                found = settings(conn)
                return measure(conn, aconn, loop, service, run_id, args) | {"settings": found}
        finally:
            aconn.close()
    finally:
        loop.close()


def measure(
    conn: Sync,
    aconn: aiomysql.Connection,
    loop: asyncio.AbstractEventLoop,
    service: str,
    run_id: str,
    args: argparse.Namespace,
) -> dict[str, object]:
    print(
        f"Cycle: {args.rounds} rounds x {args.cycles} cycles in turns of {args.chunk}, after "
        f"{args.warmup} warm-up cycles; one connection per driver",
        flush=True,
    )
    cycles = sync_cycles(conn, service, args.ttl)
    acycles = async_cycles(aconn, loop, f"abench_{run_id}", args.ttl)
    contenders = {name: timed(cycle) for name, cycle in cycles.items()}
    contenders |= {name: timed_async(loop, cycle) for name, cycle in acycles.items()}
    figures = harness.interleave(
        contenders,
        rounds=args.rounds,
        per_round=args.cycles,
        turn=args.chunk,
        warmup=args.warmup,
    )
    harness.figures_table(figures, "Acquire + release on one connection (µs)")
    pairs = []
    for driver in DRIVERS:
        s = suffix(driver)
        pairs += [(f"dmutex{s}", f"{raw}{s}") for raw in RAWS]
        pairs += [(f"dmutex fenced{s}", f"raw ts{s}"), (f"raw 1{s}", f"raw ts{s}")]
        pairs += [(f"read{s}", f"dmutex fenced{s}"), (f"write{s}", f"dmutex fenced{s}")]
    ratios = harness.ratio_table(figures, pairs, ("ops/s", "p50", "mean"))
    targets = [
        Target(
            f"DMutex / {raw}, {driver} (ops/s)",
            ratios[f"dmutex{suffix(driver)} / {raw}{suffix(driver)}, ops/s"].median,
            0.9,
            True,
        )
        for driver in DRIVERS
        for raw in RAWS
    ]
    harness.targets_table(targets)

    permits = sorted(set(args.permits))
    print(
        f"\nSemaphore: N = {permits}: {args.rounds} rounds x {args.samples} samples a case in "
        f"turns of {args.turn}, after {args.warmup} warm-up samples",
        flush=True,
    )
    sems = semaphores(conn, permits, run_id)
    batches = {
        f"{case} N={n}": acquires(sem, n, case, granted_=free != 0)
        for n, sem in sems.items()
        for case, free in CASES.items()
    }
    sem_figures = harness.interleave(
        batches, rounds=args.rounds, per_round=args.samples, turn=args.turn, warmup=args.warmup
    )
    harness.figures_table(sem_figures, "A semaphore's acquire alone (µs), one connection")
    base = permits[0]
    sem_pairs = [(f"{c} N={n}", f"{c} N={base}") for c in CASES for n in permits if n != base]
    sem_ratios = harness.ratio_table(
        sem_figures, sem_pairs, ("p50", "p99", "mean"), f"Ratios to N={base}:"
    )

    statements = count_sync(conn, f"count_{run_id}", cycles, sems, args.counts)
    statements |= count_async(aconn, loop, acycles, args.counts)
    harness.table(
        ["operation", "statements"],
        [[name, value] for name, value in statements.items()],
        f"Statements per operation (the connection's Questions counter, mean of {args.counts})",
    )
    return {
        "figures": figures,
        "ratios": ratios,
        "targets": targets,
        "semaphore": {"figures": sem_figures, "ratios": sem_ratios},
        "statements": statements,
    }


def run(argv: Sequence[str] | None = None) -> int:
    args = harness.parse(__doc__, argv, OPTIONS, redis=False, url=URL_HELP)
    return harness.main(
        bench, args, server=lambda: mysql_server(args.url), errors=(pymysql.err.MySQLError,)
    )


if __name__ == "__main__":
    sys.exit(run())

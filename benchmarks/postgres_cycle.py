"""How close dmutex's PostgreSQL lock cycle comes to its two statements, and to an advisory lock.

Run from the repository root (a report, not a test; 2-3 minutes on a shared 2-core VM)::

    .venv/bin/python benchmarks/postgres_cycle.py
    .venv/bin/python benchmarks/postgres_cycle.py --cycles 4000 --rounds 7 --json out.json
    .venv/bin/python benchmarks/postgres_cycle.py --quick
    .venv/bin/python benchmarks/postgres_cycle.py --postgres-url postgresql://127.0.0.1/db

The server is the harness's (``harness.postgres_server``): the one the tests
find, started and stopped here, or ``--postgres-url``'s; either way in a
schema of its own, dropped at the end. Each driver's contenders share ONE
connection in autocommit, so each figure is the statements' round trips and
the server's work plus client-side Python work. After a warm-up, each round
runs every contender ``--cycles`` times, interleaved in turns of ``--chunk``
cycles (``harness.interleave``), timed with ``time.perf_counter_ns``:

- ``dmutex``: ``DMutex.acquire(key)`` then ``lock.release()`` on a psycopg
  connection (``psycopg.connect(url, autocommit=True)``);
- ``raw``: the two statements dmutex sends for it, taken from
  ``dmutex._backends.postgresql.statements`` (the mutex's acquire, with its
  fence, and the release), with the parameters dmutex gives them and a
  fresh ``str(uuid.uuid4())`` token per cycle, by ``conn.execute(...,
  prepare=False)`` as dmutex sends them: the floor of the protocol;
- ``advisory``: ``SELECT pg_try_advisory_lock(k)`` then ``SELECT
  pg_advisory_unlock(k)``, also ``prepare=False``: a session lock, held by
  the connection, with no TTL, no token, no fence and no row;
- ``... asyncpg``: the same three on one asyncpg connection (``AsyncDMutex``;
  ``fetch`` of the statements' ``$n`` form; ``fetchval``), which prepares
  and caches every statement it runs, dmutex's as the others;
- ``... psycopg-async``: ``dmutex`` and ``raw`` on one
  ``psycopg.AsyncConnection``. The asyncio turns each run to completion on
  one event loop, outside the timed region;
- ``read`` and ``write`` (and ``... asyncpg``): a read-write lock's
  ``acquire_read`` / ``acquire_write`` then ``release()``
  (``DReadWriteLock``, ``AsyncDReadWriteLock``; issue 28): each acquire and
  release is a read then a compare-and-set write, four statements a cycle
  where the mutex sends two; the ratios ``read / dmutex`` and ``write /
  dmutex`` say what that costs.

Options: ``--cycles`` per contender per round, ``--rounds``, ``--chunk``
(cycles per turn), ``--warmup`` (cycles per contender), ``--ttl`` (s); with
the harness's ``--postgres-url``, ``--quick``, ``--json FILE``.

Target (issue 24): dmutex >= 0.9x raw ops/s with each driver (the median of
the per-round ratios). What the lease costs beyond an advisory lock is the
``dmutex / advisory`` ratio: a figure, no target.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncpg
import harness
import psycopg
from harness import Batch, BenchmarkError, Target
from redis_cycle import timed, timed_async

from dmutex import AsyncDMutex, AsyncDReadWriteLock, DMutex, DReadWriteLock
from dmutex._backends.postgresql.statements import Statements

OPTIONS = {  # name: (default, under --quick)
    "cycles": (2000, 100), "rounds": (5, 2), "chunk": (100, 50), "warmup": (300, 20),
    "ttl": (30.0, 30.0),
}  # fmt: skip
Cycle = Callable[[], None]
ADVISORY_KEY = 0x646D7574  # "dmut": any bigint no other client of the benchmark's server uses
DRIVERS = ("psycopg", "asyncpg", "psycopg-async")


def raw_params(
    sql: Statements, key: str, ttl_ms: int
) -> tuple[dict[str, object], dict[str, object]]:
    """The acquire's and the release's parameters as dmutex gives them, a fresh token."""
    token = str(uuid.uuid4())
    acquire = {"key": key, "token": token, "ttl": ttl_ms, "permits": 1, "waiting": 0}
    return acquire, {"key": key, "token": token, "first": 0, "last": 0}


def granted(rows: Sequence[Sequence[object]], released: Sequence[object]) -> bool:
    """Whether the acquire's one row took slot 0 and the release removed a row."""
    return len(rows) == 1 and rows[0][0] == 0 and len(released) == 1


def sync_cycles(conn: psycopg.Connection[Any], service: str, ttl_s: float) -> dict[str, Batch]:
    mutex = DMutex(service, conn, default_ttl_seconds=ttl_s)
    mutex.ready()
    sql = Statements.of(f"_dmutex_{service}")
    acquire, release = sql.acquire_mutex.psycopg, sql.release.psycopg
    ttl_ms = math.ceil(ttl_s * 1000)

    def dmutex() -> None:
        lock = mutex.acquire("k")
        if lock is None or not lock.release():
            raise BenchmarkError("dmutex: uncontended acquire/release failed")

    def raw() -> None:
        taking, giving = raw_params(sql, "r", ttl_ms)
        rows = conn.execute(acquire, taking, prepare=False).fetchall()
        if not granted(rows, conn.execute(release, giving, prepare=False).fetchall()):
            raise BenchmarkError("raw: uncontended acquire/release failed")

    def advisory() -> None:
        taken = conn.execute(
            "SELECT pg_try_advisory_lock(%s)", (ADVISORY_KEY,), prepare=False
        ).fetchone()
        freed = conn.execute(
            "SELECT pg_advisory_unlock(%s)", (ADVISORY_KEY,), prepare=False
        ).fetchone()
        if taken != (True,) or freed != (True,):
            raise BenchmarkError("advisory: uncontended lock/unlock failed")

    return {
        "dmutex": timed(dmutex),
        "raw": timed(raw),
        "advisory": timed(advisory),
        **{name: timed(cycle) for name, cycle in rw_cycles(conn, service, ttl_s).items()},
    }


def rw_cycles(conn: psycopg.Connection[Any], service: str, ttl_s: float) -> dict[str, Cycle]:
    """A read-write lock's read and write cycles on ``conn``, its table made first."""
    lock = DReadWriteLock(service, conn, default_ttl_seconds=ttl_s)
    lock.ready()

    def read() -> None:
        held = lock.acquire_read("k")
        if held is None or not held.release():
            raise BenchmarkError("read: uncontended acquire/release failed")

    def write() -> None:
        held = lock.acquire_write("k")
        if held is None or not held.release():
            raise BenchmarkError("write: uncontended acquire/release failed")

    return {"read": read, "write": write}


def async_rw_cycles(
    conn: asyncpg.Connection, loop: asyncio.AbstractEventLoop, service: str, ttl_s: float
) -> dict[str, Batch]:
    """:func:`rw_cycles` on an asyncpg connection (``AsyncDReadWriteLock``), names suffixed."""
    lock = AsyncDReadWriteLock(service, conn, default_ttl_seconds=ttl_s)
    loop.run_until_complete(lock.ready())

    async def read() -> None:
        held = await lock.acquire_read("k")
        if held is None or not await held.release():
            raise BenchmarkError("read (asyncpg): uncontended acquire/release failed")

    async def write() -> None:
        held = await lock.acquire_write("k")
        if held is None or not await held.release():
            raise BenchmarkError("write (asyncpg): uncontended acquire/release failed")

    return {"read asyncpg": timed_async(loop, read), "write asyncpg": timed_async(loop, write)}


def async_dmutex(
    conn: asyncpg.Connection | psycopg.AsyncConnection[Any],
    loop: asyncio.AbstractEventLoop,
    service: str,
    ttl_s: float,
    driver: str,
) -> Callable[[], Awaitable[None]]:
    """``AsyncDMutex`` acquire + release on ``conn``, its table made first."""
    mutex = AsyncDMutex(service, conn, default_ttl_seconds=ttl_s)
    loop.run_until_complete(mutex.ready())

    async def dmutex() -> None:
        lock = await mutex.acquire("k")
        if lock is None or not await lock.release():
            raise BenchmarkError(f"AsyncDMutex ({driver}): uncontended acquire/release failed")

    return dmutex


def asyncpg_cycles(
    conn: asyncpg.Connection, loop: asyncio.AbstractEventLoop, service: str, ttl_s: float
) -> dict[str, Batch]:
    dmutex = async_dmutex(conn, loop, service, ttl_s, "asyncpg")
    sql = Statements.of(f"_dmutex_{service}")
    ttl_ms = math.ceil(ttl_s * 1000)
    fetch: Callable[..., Awaitable[list[Any]]] = conn.fetch

    async def raw() -> None:
        taking, giving = raw_params(sql, "r", ttl_ms)
        rows = await fetch(sql.acquire_mutex.asyncpg, *sql.acquire_mutex.arguments(taking))
        released = await fetch(sql.release.asyncpg, *sql.release.arguments(giving))
        if not granted(rows, released):
            raise BenchmarkError("raw (asyncpg): uncontended acquire/release failed")

    async def advisory() -> None:
        taken = await conn.fetchval("SELECT pg_try_advisory_lock($1)", ADVISORY_KEY)
        freed = await conn.fetchval("SELECT pg_advisory_unlock($1)", ADVISORY_KEY)
        if taken is not True or freed is not True:
            raise BenchmarkError("advisory (asyncpg): uncontended lock/unlock failed")

    return {
        "dmutex asyncpg": timed_async(loop, dmutex),
        "raw asyncpg": timed_async(loop, raw),
        "advisory asyncpg": timed_async(loop, advisory),
        **async_rw_cycles(conn, loop, service, ttl_s),
    }


def psycopg_async_cycles(
    conn: psycopg.AsyncConnection[Any], loop: asyncio.AbstractEventLoop, service: str, ttl_s: float
) -> dict[str, Batch]:
    dmutex = async_dmutex(conn, loop, service, ttl_s, "psycopg-async")
    sql = Statements.of(f"_dmutex_{service}")
    acquire, release = sql.acquire_mutex.psycopg, sql.release.psycopg
    ttl_ms = math.ceil(ttl_s * 1000)

    async def raw() -> None:
        taking, giving = raw_params(sql, "r", ttl_ms)
        rows = await (await conn.execute(acquire, taking, prepare=False)).fetchall()
        released = await (await conn.execute(release, giving, prepare=False)).fetchall()
        if not granted(rows, released):
            raise BenchmarkError("raw (psycopg-async): uncontended acquire/release failed")

    return {
        "dmutex psycopg-async": timed_async(loop, dmutex),
        "raw psycopg-async": timed_async(loop, raw),
    }


def bench(url: str, args: argparse.Namespace) -> dict[str, object]:
    """Measure every contender on ``url``; print and return the figures."""
    settings = harness.postgres_settings(url)
    print(
        f"{args.rounds} rounds x {args.cycles} cycles in turns of {args.chunk}, after "
        f"{args.warmup} warm-up cycles, one connection per driver",
        flush=True,
    )
    run_id = uuid.uuid4().hex[:8]
    loop = asyncio.new_event_loop()
    try:
        aconn = loop.run_until_complete(asyncpg.connect(url))
        pconn = loop.run_until_complete(psycopg.AsyncConnection.connect(url, autocommit=True))
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                contenders = {
                    **sync_cycles(conn, f"bench_{run_id}", args.ttl),
                    **asyncpg_cycles(aconn, loop, f"bench_asyncpg_{run_id}", args.ttl),
                    **psycopg_async_cycles(pconn, loop, f"bench_pasync_{run_id}", args.ttl),
                }
                figures = harness.interleave(
                    contenders,
                    rounds=args.rounds,
                    per_round=args.cycles,
                    turn=args.chunk,
                    warmup=args.warmup,
                )
        finally:
            loop.run_until_complete(aconn.close())
            loop.run_until_complete(pconn.close())
    finally:
        loop.close()
    harness.figures_table(figures, "Acquire + release on one connection (µs)")
    pairs = []
    for driver in DRIVERS:
        suffix = "" if driver == "psycopg" else f" {driver}"
        pairs.append((f"dmutex{suffix}", f"raw{suffix}"))
        if f"advisory{suffix}" in figures:
            pairs += [
                (f"dmutex{suffix}", f"advisory{suffix}"),
                (f"raw{suffix}", f"advisory{suffix}"),
            ]
    for driver in ("psycopg", "asyncpg"):
        suffix = "" if driver == "psycopg" else f" {driver}"
        pairs += [(f"read{suffix}", f"dmutex{suffix}"), (f"write{suffix}", f"dmutex{suffix}")]
    ratios = harness.ratio_table(figures, pairs, ("ops/s", "p50", "mean"))
    targets = [
        Target(
            f"DMutex / raw, {driver} (ops/s)",
            ratios[f"dmutex{s} / raw{s}, ops/s"].median,
            0.9,
            True,
        )
        for driver, s in ((d, "" if d == "psycopg" else f" {d}") for d in DRIVERS)
    ]
    harness.targets_table(targets)
    return {"figures": figures, "ratios": ratios, "targets": targets, "settings": settings}


def run(argv: Sequence[str] | None = None) -> int:
    return harness.main(bench, harness.parse(__doc__, argv, OPTIONS, redis=False, postgres=True))


if __name__ == "__main__":
    sys.exit(run())

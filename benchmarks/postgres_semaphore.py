"""What a PostgreSQL semaphore's acquire costs as ``max_permits`` grows: refused, and granted.

Run from the repository root (a report, not a test; about 10 seconds)::

    .venv/bin/python benchmarks/postgres_semaphore.py
    .venv/bin/python benchmarks/postgres_semaphore.py --samples 50 --permits 1 64
    .venv/bin/python benchmarks/postgres_semaphore.py --quick --json out.json

The server is the harness's (``harness.postgres_server``): the one the tests
find, started and stopped here, or ``--postgres-url``'s; either way in a
schema of its own, dropped at the end. For each ``max_permits`` N (1, 64
and 1024, or ``--permits``), one ``DSemaphore`` on one psycopg connection
in autocommit, and three keys, their other slots' rows written beforehand
(``INSERT ... SELECT FROM generate_series``, the rows an acquire writes:
``permit:{i}:{key}``, a token, an expiry an hour away):

- ``full``: all N slots held: ``acquire`` answers None (a refused attempt,
  as a waiter's first one, nobody marked waiting);
- ``last free``: N-1 slots held: ``acquire`` takes the last one;
- ``empty``: none held: ``acquire`` takes a random one of the N.

The granted permits are released untimed. A sample times the call alone
(``time.perf_counter_ns``); the cases run after a warm-up, interleaved in
turns of ``--turn`` samples (``harness.interleave``). Then the server's own
time of the refused acquire: its statement under ``EXPLAIN (ANALYZE)``, with
the parameters the store sends, ``--explains`` times at each N (the median
of the planning and of the execution time PostgreSQL reports; it writes
nothing, as the slots are all held).

Options: ``--permits N...``, ``--samples`` per case, ``--warmup`` samples per
case, ``--turn``, ``--explains``; the harness's ``--postgres-url``,
``--quick``, ``--json FILE``. No target: the figures and the ratios to N=1.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import harness
import psycopg
from harness import Batch, BenchmarkError

from dmutex import DSemaphore
from dmutex._backends.postgresql.statements import Statements

HOLDER_TTL = "1 hour"  # the other slots' rows: none expires during a run
TTL_S = 300.0  # the measured permits' ttl
OPTIONS = {  # name: (default, under --quick)
    "permits": ([1, 64, 1024], [1, 64]), "samples": (200, 40), "warmup": (10, 5),
    "turn": (20, 20), "explains": (5, 2),
}  # fmt: skip
FULL, LAST, EMPTY = "full", "last free", "empty"
CASES = (FULL, LAST, EMPTY)
HELD = {FULL: 0, LAST: 1, EMPTY: None}  # how many slots are left free; None: all of them
_TIME = re.compile(r"(Planning|Execution) Time: ([0-9.]+) ms")


def fill(conn: psycopg.Connection[Any], table: str, key: str, first: int, last: int) -> None:
    """Rows of slots ``first .. last`` of ``key``, held by other tokens for an hour."""
    conn.execute(
        f"INSERT INTO {table} (key, value, expired_at) "
        "SELECT 'permit:' || i || ':' || %(key)s, gen_random_uuid()::text, "
        f"statement_timestamp() + interval '{HOLDER_TTL}' "
        "FROM generate_series(%(first)s::int, %(last)s::int) AS s(i)",
        {"key": key, "first": first, "last": last},
    )


def contenders(
    conn: psycopg.Connection[Any], permits: Sequence[int], run_id: str
) -> dict[str, Batch]:
    """Each case at each N: a batch of timed acquires (granted ones released untimed)."""
    batches: dict[str, Batch] = {}
    for n in permits:
        sem = DSemaphore(f"bench{n}_{run_id}", conn, max_permits=n, default_ttl_seconds=TTL_S)
        sem.ready()
        table = Statements.of(f"_dsemaphore_bench{n}_{run_id}").table
        for case in CASES:
            free = HELD[case]
            if free is not None and n - free > 0:
                fill(conn, table, case, 0, n - free - 1)
            batches[f"{case} N={n}"] = acquires(sem, case, granted=free != 0)
    return batches


def acquires(sem: DSemaphore, key: str, *, granted: bool) -> Batch:
    def run(count: int) -> list[int]:
        samples, clock = [0] * count, time.perf_counter_ns
        for i in range(count):
            start = clock()
            permit = sem.acquire(key)
            samples[i] = clock() - start
            if (permit is not None) != granted:
                raise BenchmarkError(
                    f"{key}: the acquire was {'refused' if granted else 'granted'}"
                )
            if permit is not None and not permit.release():
                raise BenchmarkError(f"{key}: the release found no permit")
        return samples

    return run


def explained(conn: psycopg.Connection[Any], n: int, run_id: str, times: int) -> dict[str, float]:
    """The refused acquire's planning and execution time (ms) by ``EXPLAIN (ANALYZE)``: medians."""
    sql = Statements.of(f"_dsemaphore_bench{n}_{run_id}")
    statement = sql.acquire_semaphore_of(n) if n > 1 else sql.acquire_mutex
    params = {"key": FULL, "token": str(uuid.uuid4()), "ttl": 1000, "permits": n, "waiting": 0}
    found: dict[str, list[float]] = {"Planning": [], "Execution": []}
    for _ in range(times):
        plan = conn.execute("EXPLAIN (ANALYZE) " + statement.psycopg, params, prepare=False)
        for (line,) in plan.fetchall():
            matched = _TIME.search(str(line))
            if matched:
                found[matched[1]].append(float(matched[2]))
    if not all(found.values()):
        raise BenchmarkError("EXPLAIN (ANALYZE) reported no planning or execution time")
    return {f"{what.lower()}_ms": statistics.median(ms) for what, ms in found.items()}


def bench(url: str, args: argparse.Namespace) -> dict[str, object]:
    """Measure every case at every N on ``url``; print and return the figures."""
    settings = harness.postgres_settings(url)
    permits = sorted(set(args.permits))
    print(
        f"N = {permits}: {args.samples} samples a case in turns of {args.turn}, after "
        f"{args.warmup} warm-up samples, one connection",
        flush=True,
    )
    run_id = uuid.uuid4().hex[:8]
    with psycopg.connect(url, autocommit=True) as conn:
        batches = contenders(conn, permits, run_id)
        figures = harness.interleave(
            batches, rounds=1, per_round=args.samples, turn=args.turn, warmup=args.warmup
        )
        server = {n: explained(conn, n, run_id, args.explains) for n in permits}
    harness.figures_table(figures, "Acquire alone (µs), one connection")
    harness.table(
        ["N", "planning ms", "execution ms"],
        [[n, t["planning_ms"], t["execution_ms"]] for n, t in server.items()],
        f"The refused acquire on the server: EXPLAIN (ANALYZE), median of {args.explains}",
    )
    base = permits[0]
    pairs = [(f"{c} N={n}", f"{c} N={base}") for c in CASES for n in permits if n != base]
    ratios = harness.ratio_table(
        figures, pairs, ("p50", "p99", "mean"), f"Ratios to N={base} (contender / baseline):"
    )
    return {"figures": figures, "ratios": ratios, "server": server, "settings": settings}


def run(argv: Sequence[str] | None = None) -> int:
    return harness.main(bench, harness.parse(__doc__, argv, OPTIONS, redis=False, postgres=True))


if __name__ == "__main__":
    sys.exit(run())

"""A released PostgreSQL lock's hand-off to a waiter (LISTEN against polling); NOTIFY's cost.

Run from the repository root (a report, not a test; about a minute)::

    .venv/bin/python benchmarks/postgres_handoff.py
    .venv/bin/python benchmarks/postgres_handoff.py --quick --json out.json
    .venv/bin/python benchmarks/postgres_handoff.py --postgres-url postgresql://...

The server is the harness's (``harness.postgres_server``): the one the
tests find, started and stopped here, or ``--postgres-url``'s; either way
in a schema of its own, dropped at the end. It drives the store through
the engine, as the tests do, to time the release's variants.

1. Hand-off: the holder (a store on its own autocommit connection) takes the
   lock, a waiter thread calls ``acquire_with_retry(key, timeout=30,
   retry_delay=0.1)`` (the classes' default delay) on a store over a
   psycopg ``ConnectionPool``; once the waiter's first attempt failed and 20
   ms passed, the holder notes ``time.perf_counter()`` and releases; the
   hand-off is the time until the waiter holds the lock. Variants: ``listen``
   (the store listens: woken by the release's NOTIFY) and ``poll``
   (``listen=False``, as behind PgBouncer: jittered polling within
   ``retry_delay``). The variants take turns of 10 hand-offs.
2. The release's NOTIFY: an uncontended cycle (acquire + release, one
   statement each) on one autocommit connection, nobody waiting; the
   release as the store sends it (``store``: it reads the key's waiters
   mark and, none being there, does not notify), the same notifying
   whatever the mark says (``always notify``), and its ``DELETE`` alone
   (``delete only``), by ``harness.interleave``. With ``--threads`` > 1, that many threads on
   their own connections and keys cycle at once, each variant in turn,
   since a transaction that notified takes the notification queue's lock
   at commit: their cycles per second, each variant run twice (ABBA).

Options: ``--handoffs`` per variant, ``--cycles`` per round, ``--rounds``,
``--threads``; ``--postgres-url``, ``--quick``, ``--json FILE``.
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import harness
import psycopg
import psycopg_pool
from harness import BenchmarkError, Figures

from dmutex._backends.postgresql import PostgresStore
from dmutex._backends.postgresql.statements import Statement
from dmutex._clock import SYSTEM_CLOCK
from dmutex._core.engine import Engine
from dmutex._core.lease import Lease
from dmutex._runtime.drivers import SyncDriver

OPTIONS: dict[str, harness.Option] = {
    "handoffs": (100, 10),
    "cycles": (2000, 100),
    "rounds": (5, 2),
    "threads": (4, 2),
}
RETRY_DELAY = 0.1


class Side:
    """A store on ``client`` and the engine and driver an instance would hold."""

    def __init__(self, client: object, table: str, *, listen: bool = True) -> None:
        self.store = PostgresStore(
            client, table, 1, SYSTEM_CLOCK, asynchronous=False, listen=listen
        )
        self.engine = Engine(self.store, default_ttl=30)
        self.drive = SyncDriver(SYSTEM_CLOCK, self.store.ready)

    def take(self, key: str) -> Lease:
        lease = self.drive(self.engine.acquire(key, None))
        if lease is None:
            raise BenchmarkError(f"{key} is held: the benchmark's own lock")
        return lease


def handoff(holder: Side, waiter: Side, key: str) -> int:
    """One hand-off from ``holder`` to a blocked ``waiter``, in ns."""
    held = holder.take(key)
    got: list[float] = []

    def wait() -> None:
        lease = waiter.drive(waiter.engine.acquire_with_retry(key, None, 30, RETRY_DELAY))
        got.append(time.perf_counter())
        if lease is None or not waiter.drive(waiter.engine.release(lease)):
            raise BenchmarkError("the waiter did not get the lock")

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.02)  # its first attempt failed: it waits
    released = time.perf_counter()
    holder.drive(holder.engine.release(held))
    thread.join(timeout=60)
    if not got:
        raise BenchmarkError("the waiter did not get the lock")
    return round((got[0] - released) * 1e9)


def handoffs(url: str, table: str, count: int) -> dict[str, Figures]:
    with (
        psycopg.connect(url, autocommit=True) as conn,
        psycopg_pool.ConnectionPool(
            url, min_size=2, max_size=4, kwargs={"autocommit": True}
        ) as pool,
    ):
        holder = Side(conn, table)
        sides = {"listen": Side(pool, table), "poll": Side(pool, table, listen=False)}

        def batch(name: str) -> Callable[[int], list[int]]:
            return lambda n: [handoff(holder, sides[name], "handoff") for _ in range(n)]

        return harness.interleave(
            {name: batch(name) for name in sides}, rounds=1, per_round=count, turn=10, warmup=2
        )


def silent(release: Statement) -> Statement:
    """The release without its ``SELECT`` (no mark read, no NOTIFY): the ``DELETE`` alone."""
    text = release.psycopg
    return Statement.of(text[len("WITH gone AS (") : text.index(")\nSELECT")])


def loud(release: Statement) -> Statement:
    """The release notifying whether or not anyone waits."""
    return Statement.of(release.psycopg.replace("CASE WHEN EXISTS", "CASE WHEN true OR EXISTS", 1))


def cycles(
    url: str, table: str, args: argparse.Namespace
) -> tuple[dict[str, Figures], dict[str, float]]:
    def cycler(conn: psycopg.Connection[Any], key: str) -> dict[str, Callable[[int], list[int]]]:
        side = Side(conn, table)
        sql = side.store.statements
        releases = {
            "store": sql.release,
            "always notify": loud(sql.release),
            "delete only": silent(sql.release),
        }

        def batch(release: Statement) -> Callable[[int], list[int]]:
            def run(n: int) -> list[int]:
                spent = []
                for _ in range(n):
                    began = time.perf_counter_ns()
                    lease = side.take(key)
                    params = {"key": key, "token": lease.token, "first": 0, "last": 0}
                    if not conn.execute(release.psycopg, params, prepare=False).fetchall():
                        raise BenchmarkError("the release removed nothing")
                    spent.append(time.perf_counter_ns() - began)
                return spent

            return run

        return {name: batch(release) for name, release in releases.items()}

    with psycopg.connect(url, autocommit=True) as conn:
        figures = harness.interleave(
            cycler(conn, "cycle"), rounds=args.rounds, per_round=args.cycles, turn=100, warmup=50
        )
    rates: dict[str, float] = {}
    conns = [psycopg.connect(url, autocommit=True) for _ in range(args.threads)]
    try:
        runs = [cycler(conn, f"cycle{n}") for n, conn in enumerate(conns)]
        names = list(runs[0])
        spent = dict.fromkeys(names, 0.0)
        for name in [*names, *reversed(names)]:  # ABBA: neither goes first only
            start = threading.Barrier(len(runs) + 1)

            def one(run: Callable[[int], list[int]], start: threading.Barrier) -> None:
                start.wait()
                run(args.cycles)

            threads = [threading.Thread(target=one, args=(run[name], start)) for run in runs]
            for thread in threads:
                thread.start()
            start.wait()
            began = time.perf_counter()
            for thread in threads:
                thread.join()
            spent[name] += time.perf_counter() - began
        rates = {name: 2 * len(runs) * args.cycles / spent[name] for name in names}
    finally:
        for conn in conns:
            conn.close()
    return figures, rates


def bench(url: str, args: argparse.Namespace) -> dict[str, object]:
    settings = harness.postgres_settings(url)
    table = f"_dmutex_bench_{uuid.uuid4().hex[:8]}"
    handed = handoffs(url, table, args.handoffs)
    harness.figures_table(handed, "Hand-off to a waiter (µs), retry_delay 0.1 s")
    cycled, rates = cycles(url, table, args)
    harness.figures_table(cycled, "Uncontended cycle (µs), nobody waiting: the release's variants")
    harness.table(
        ["release", "cycles/s"],
        [[name, rate] for name, rate in rates.items()],
        f"{args.threads} threads cycling at once, a key each",
    )
    return {
        "handoff": {name: f.summary() for name, f in handed.items()},
        "cycle": {name: f.summary() for name, f in cycled.items()},
        "threads_cycles_per_s": rates,
        "settings": settings,
    }


def run(argv: Sequence[str] | None = None) -> int:
    return harness.main(bench, harness.parse(__doc__, argv, OPTIONS, redis=False, postgres=True))


if __name__ == "__main__":
    raise SystemExit(run())

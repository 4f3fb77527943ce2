"""dmutex against its peers on Redis, every figure of one table in one run (issue 25).

Run from the repository root (a report, not a test; about 2 minutes on 2
cores, ``--quick``: about 15 seconds)::

    .venv/bin/python benchmarks/redis_peers.py
    .venv/bin/python benchmarks/redis_peers.py --quick
    .venv/bin/python benchmarks/redis_peers.py --redis 7.4 --json out.json
    .venv/bin/python benchmarks/redis_peers.py --url redis://127.0.0.1:6379/0

One Redis server: 7.0 when the test harness finds it, else the newest it
finds; ``--redis`` names others (one after another), ``--url`` one of your
own, on which it works under its own random names (its keys deleted at the
end), and the server's command counts then include other clients' commands.

The peers: ``raw`` (the two requests any token lock needs: ``SET key token
PX ttl NX``, then ``EVALSHA`` of a compare-and-delete script; a fresh
``uuid4`` token each time) and ``raw-async`` (the same on ``redis.asyncio``),
redis-py's ``Lock`` (``redis-py``), python-redis-lock's ``Lock``
(``python-redis-lock``), ``DMutex`` (``dmutex``), ``AsyncDMutex``
(``dmutex-async``) and a ``DSemaphore`` of 3 permits (``dsemaphore``), which
no peer has: read its figures beside dmutex's mutex. Its parts, each
printing its own tables:

1. Cycle: acquire + release, uncontended, on ONE connection per face
   (``single_connection_client``): ``redis_cycle.py``'s lock cycles, with
   ``python-redis-lock`` (a new ``Lock`` per cycle, ``acquire(blocking=False)``,
   ``release()``) and ``dsemaphore`` (``acquire`` + ``release``, no other
   permit held). ``--rounds`` rounds of ``--cycles`` per contender in turns
   of ``--chunk`` after ``--warmup`` (``harness.interleave``).
2. Failed acquire: each one's single attempt on a key another holder has
   (a long TTL): raw ``SET NX`` (the baseline; ``raw-async`` for
   ``AsyncDMutex``), ``Lock(...).acquire(blocking=False)`` of redis-py and of
   python-redis-lock, ``DMutex.acquire`` / ``AsyncDMutex.acquire`` (None),
   ``DSemaphore.acquire`` with all 3 permits held. Interleaved as in 1.
3. Server commands and requests per operation: each contender of 1 and 2
   alone, ``--counted`` operations after a warm-up, on clients of their
   own: ``INFO commandstats`` calls (which count every command a script
   runs as well as the ``EVALSHA``) and requests (round trips, every one
   the client sent timestamped by ``harness.trace_requests``).
4. Contended: ``handoff.py``'s part 2, ``--contended-rounds`` rounds in
   which the variants take turns, each round ``--processes`` processes x
   ``--contended-cycles`` cycles of acquire (blocking) / ``GET`` counter /
   ``SET`` counter + 1 / release on one key; wall time (the summary gives
   the median of the rounds, the targets the median of the rounds'
   ratios), the counter (exact for a mutex; not for the semaphore, whose 3
   holders at once race on it), the most processes holding at once,
   fairness: the longest streak of one process's acquires and each
   process's longest acquire.
5. Hand-off to a blocked waiter: ``handoff.py``'s part 1, two processes
   ping-ponging one key, ``--handoffs`` each for the variants that wait by
   ``BLPOP`` (dmutex, dmutex-async, python-redis-lock and the semaphore,
   whose 2 other permits this process holds meanwhile), interleaved; then
   ``--polled-handoffs`` for redis-py's ``Lock``, which sleeps 0.1 s
   between attempts.

Then the summary: one table shaped like the issue's (a row a figure, a
column a contender; ratios are medians of the per-round ratios within this
run, each against its own face's raw baseline: ``raw-async`` for
``AsyncDMutex``), and the targets, PASS or MISS. Options: the counts named
above; and the harness's ``--url``, ``--redis VERSION...``, ``--quick``,
``--json FILE``.

Targets (issue 25): DMutex's cycle >= 1.0x redis-py Lock's and >= 0.9x raw
(ops/s); its failed acquire >= 1.0x redis-py Lock's; its contended wall
time <= 0.9x redis-py Lock's, the counter exact; its hand-off median <=
0.8x python-redis-lock's and p99 < 2 ms; AsyncDMutex's cycle >= 0.9x
raw-async's and its contended wall time <= 1.2x DMutex's; the semaphore
never held by more than 3 at once.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import handoff
import harness
import redis
import redis.asyncio
import redis_cycle
import redis_lock
from handoff import DMUTEX, DMUTEX_ASYNC, PRL, REDIS_PY, SEMAPHORE, Contended, HandOffs
from harness import Batch, BenchmarkError, Figures, Target
from redis_cycle import HOLDER_TTL_S, Connections, connections, timed, timed_async

from dmutex import AsyncDMutex, DMutex, DSemaphore

RAW, RAW_ASYNC = "raw", "raw-async"
PERMITS = 3  # the semaphore's
TTL_S = 30.0  # every lease the timed operations take
COLUMNS = {  # contender: its column in the summary
    RAW: "raw",
    RAW_ASYNC: "raw asyncio",
    REDIS_PY: "redis-py Lock",
    PRL: "python-redis-lock",
    DMUTEX: "DMutex",
    DMUTEX_ASYNC: "AsyncDMutex",
    SEMAPHORE: f"DSemaphore({PERMITS})",
}
CONTENDED = (DMUTEX, DMUTEX_ASYNC, REDIS_PY, PRL, SEMAPHORE)
OPTIONS = {  # name: (default, under --quick)
    "cycles": (2000, 300), "rounds": (7, 2), "chunk": (100, 100), "warmup": (300, 50),
    "counted": (500, 50), "processes": (4, 2), "contended_cycles": (500, 20),
    "contended_rounds": (5, 1), "handoffs": (300, 10), "polled_handoffs": (60, 4),
}  # fmt: skip


def baseline(name: str) -> str:
    """The raw contender ``name`` is measured against: its own face's."""
    return RAW_ASYNC if name in (DMUTEX_ASYNC, RAW_ASYNC) else RAW


# --- 1, 2. one process: the cycle and the failed acquire -------------------------------


def one_process(faces: Connections, run_id: str) -> tuple[dict[str, Batch], dict[str, Batch]]:
    """Each contender's cycle, and its refused acquire (the holders taken here, long TTLs)."""
    cycles, client = redis_cycle.mutex_cycles(faces, run_id, TTL_S), faces.client
    sem = DSemaphore(f"peers-sem-{run_id}", client, max_permits=PERMITS, default_ttl_seconds=TTL_S)
    prl_name = f"peers-prl-{run_id}"

    def prl_cycle() -> None:
        lock = redis_lock.Lock(client, prl_name, expire=math.ceil(TTL_S))
        if not lock.acquire(blocking=False):
            raise BenchmarkError("python-redis-lock: uncontended acquire failed")
        lock.release()  # raises NotAcquired if it was not ours

    def sem_cycle() -> None:
        permit = sem.acquire("k")
        if permit is None or not permit.release():
            raise BenchmarkError("DSemaphore: uncontended acquire/release failed")

    cycles |= {PRL: timed(prl_cycle), SEMAPHORE: timed(sem_cycle)}
    return {name: cycles[name] for name in COLUMNS}, refusals(faces, run_id)


def refusals(faces: Connections, run_id: str) -> dict[str, Batch]:
    """Each contender's one attempt on a key held by another (taken here, for an hour)."""
    client, aclient = faces.client, faces.aclient
    held_ms = math.ceil(HOLDER_TTL_S * 1000)
    ttl_ms = math.ceil(TTL_S * 1000)
    raw_key, name = f"_raw_refused-{run_id}", f"peers-refused-{run_id}"
    mutex = DMutex(name, client, default_ttl_seconds=TTL_S)
    amutex = AsyncDMutex(name, aclient, default_ttl_seconds=TTL_S)
    sem = DSemaphore(name, client, max_permits=PERMITS, default_ttl_seconds=TTL_S)
    held = [
        client.set(raw_key, "holder", px=held_ms, nx=True),
        client.lock(f"_redispy_{name}", timeout=HOLDER_TTL_S).acquire(blocking=False),
        redis_lock.Lock(client, name, expire=math.ceil(HOLDER_TTL_S)).acquire(blocking=False),
        mutex.acquire("k", ttl=HOLDER_TTL_S),
        *(sem.acquire("k", ttl=HOLDER_TTL_S) for _ in range(PERMITS)),
    ]
    if not all(held):
        raise BenchmarkError("could not take the held keys that the failed acquires meet")
    # redis-py leaves execute_command unannotated; its reply is any RESP value.
    execute: Callable[..., object] = client.execute_command
    aexecute: Callable[..., Awaitable[object]] = aclient.execute_command

    def refused(who: str, attempt: Callable[[], object]) -> Batch:
        def once() -> None:
            if attempt():
                raise BenchmarkError(f"{who}: took a key that another holds")

        return timed(once)

    def refused_async(who: str, attempt: Callable[[], Awaitable[object]]) -> Batch:
        async def once() -> None:
            if await attempt():
                raise BenchmarkError(f"{who}: took a key that another holds")

        return timed_async(faces.loop, once)

    return {
        RAW: refused(RAW, lambda: execute("SET", raw_key, str(uuid.uuid4()), "PX", ttl_ms, "NX")),
        RAW_ASYNC: refused_async(
            RAW_ASYNC, lambda: aexecute("SET", raw_key, str(uuid.uuid4()), "PX", ttl_ms, "NX")
        ),
        REDIS_PY: refused(
            REDIS_PY, lambda: client.lock(f"_redispy_{name}", timeout=TTL_S).acquire(blocking=False)
        ),
        PRL: refused(
            PRL,
            lambda: redis_lock.Lock(client, name, expire=math.ceil(TTL_S)).acquire(blocking=False),
        ),
        DMUTEX: refused(DMUTEX, lambda: mutex.acquire("k")),
        DMUTEX_ASYNC: refused_async(DMUTEX_ASYNC, lambda: amutex.acquire("k")),
        SEMAPHORE: refused(SEMAPHORE, lambda: sem.acquire("k")),
    }


# --- 3. what each operation sends -------------------------------------------------------


@dataclass(frozen=True)
class Counts:
    """Per operation: the server's commands (script's included), by name; the requests."""

    commands: dict[str, float]
    requests: float

    @property
    def total(self) -> float:
        return sum(self.commands.values())

    def breakdown(self) -> str:
        ordered = sorted(self.commands.items(), key=lambda item: (-item[1], item[0]))
        return ", ".join(f"{name.upper()} {n:g}" for name, n in ordered)


def counted(url: str, run_id: str, n: int) -> dict[str, dict[str, Counts]]:
    """Each contender of parts 1 and 2 alone, ``n`` times after a warm-up: what it sent."""
    found: dict[str, dict[str, Counts]] = {}
    with connections(url) as faces, redis.Redis.from_url(url) as probe:
        # Before dmutex binds the clients' execute_command.
        logs = [harness.trace_requests(faces.client), harness.trace_requests(faces.aclient)]
        cycles, failed = one_process(faces, run_id)
        for part, contenders in {"cycle": cycles, "failed": failed}.items():
            found[part] = {}
            for name, batch in contenders.items():
                batch(max(10, n // 10))  # scripts loaded, connections open
                before, sent = harness.server_counters(probe)[0], sum(map(len, logs))
                batch(n)
                after = harness.server_counters(probe)[0]
                requests = sum(map(len, logs)) - sent
                calls = {k: c - before.get(k, (0, 0))[0] for k, (c, _) in after.items()}
                commands = {k: c / n for k, c in calls.items() if c and k != "info"}
                found[part][name] = Counts(commands, requests / n)
    rows = [
        [part, name, c.total, c.requests, c.breakdown()]
        for part, contenders in found.items()
        for name, c in contenders.items()
    ]
    head = ["operation", "contender", "commands", "requests", "commands by name"]
    title = (
        f"3. Per operation, {n} of each alone: server commands (INFO commandstats: every "
        "command, those a script runs included) and requests (round trips)"
    )
    harness.table(head, rows, title)
    return found


# --- the run ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """An interleaved part's figures and their ratios, keyed as ``harness.ratio_table`` keys."""

    figures: dict[str, Figures]
    ratios: dict[str, harness.Ratio]


def interleaved(title: str, contenders: Mapping[str, Batch], args: argparse.Namespace) -> Part:
    """``contenders`` in interleaved rounds; their table and their ratios to raw, ops/s and p50."""
    harness.progress(title)
    figures = redis_cycle.interleaved(contenders, args)
    harness.figures_table(figures, title)
    pairs = [(name, baseline(name)) for name in COLUMNS if name != baseline(name)]
    pairs += [(DMUTEX, REDIS_PY), (DMUTEX, PRL)]
    return Part(figures, harness.ratio_table(figures, pairs, ("ops/s", "p50")))


def timed_parts(url: str, run_id: str, args: argparse.Namespace) -> dict[str, Part]:
    """Parts 1 and 2 on one connection per face; their figures and ratios."""
    print(
        f"{args.rounds} rounds x {args.cycles} per contender in turns of {args.chunk}, after "
        f"{args.warmup} warm-up, one connection per face",
        flush=True,
    )
    with connections(url) as faces:
        cycles, failed = one_process(faces, run_id)
        return {
            "cycle": interleaved("1. Cycle: acquire + release, uncontended", cycles, args),
            "failed": interleaved("2. Failed acquire: the key held", failed, args),
        }


def handoffs(url: str, run_id: str, args: argparse.Namespace) -> list[HandOffs]:
    """Part 5: the BLPOP variants interleaved (the semaphore's other permits held), redis-py."""
    woken = [handoff.Spec(kind, url, f"peers-pp-{kind}-{run_id}") for kind in handoff.BLPOP_WAITERS]
    sem_spec = next(spec for spec in woken if spec.kind == SEMAPHORE)
    with redis.Redis.from_url(url) as client:
        sem = DSemaphore(sem_spec.service, client, max_permits=sem_spec.permits)
        others = [sem.acquire(sem_spec.key, ttl=HOLDER_TTL_S) for _ in range(sem_spec.permits - 1)]
        if None in others:
            raise BenchmarkError("could not take the semaphore's other permits")
        try:
            harness.progress(f"hand-off: {', '.join(handoff.BLPOP_WAITERS)}, interleaved")
            results = handoff.handoffs(woken, args.handoffs, 0)
        finally:
            for permit in others:
                if permit is not None:
                    permit.release()
    harness.progress("hand-off: redis-py")
    polled = handoff.Spec(REDIS_PY, url, f"peers-pp-{REDIS_PY}-{run_id}")
    return results + handoff.handoffs([polled], args.polled_handoffs, 2)


def bench(url: str, args: argparse.Namespace) -> dict[str, object]:
    run_id = uuid.uuid4().hex[:8]
    print(f"python-redis-lock {redis_lock.__version__}" + (" (--quick)" if args.quick else ""))
    print(f"Load average at the start: {os.getloadavg()[0]:.2f} (1 min)")
    try:
        found = timed_parts(url, f"{run_id}t", args)
        harness.progress("counted operations")
        counts = counted(url, f"{run_id}n", args.counted)

        def spec(kind: str, part: str) -> handoff.Spec:
            return handoff.Spec(kind, url, f"peers-{part}-{kind}-{run_id}", permits=PERMITS)

        contention_args = argparse.Namespace(  # each round: --contended-cycles a process
            processes=args.processes,
            cycles=args.contended_cycles * args.contended_rounds,
            contended_rounds=args.contended_rounds,
        )
        contention = handoff.contend_in_turns(spec, CONTENDED, contention_args)
        contended = handoff.print_contended(contention, contention_args, "4. Contended")
        print(f"{SEMAPHORE}: {PERMITS} permits; its counter is not exact (3 holders race on it)")
        passed = handoffs(url, run_id, args)
        handed = handoff.print_handoffs(passed, None, "5. Hand-off")
    finally:
        harness.delete_keys(url, f"*{run_id}*")  # holders, fence counters, counters
    runs = cast(dict[str, Contended], contended["runs"])  # the rounds together
    walls = cast(dict[str, Figures], contended["walls"])  # ns, a round each
    summary = summarize(found, counts, (runs, walls), {r.kind: r for r in passed}, args)
    targets = check(found, (runs, walls), {r.kind: r for r in passed})
    harness.targets_table(targets)
    wrong = [c.kind for c in runs.values() if c.kind != SEMAPHORE and c.counter != c.expected]
    if wrong:
        print(f"WRONG counter (a lost update: mutual exclusion failed): {', '.join(wrong)}")
    return {
        **found,
        "counted": counts,
        "contended": contended,
        "handoff": handed,
        "summary": summary,
        "targets": targets,
        "wrong_counters": wrong,
    }


def median_ratio(part: Part, name: str) -> float:
    """``name``'s ops/s over its raw baseline's, median of the rounds (1.0 for a baseline)."""
    if name == baseline(name):
        return 1.0
    return part.ratios[f"{name} / {baseline(name)}, ops/s"].median


Contention = tuple[dict[str, Contended], dict[str, Figures]]
"""Each contended variant's rounds together, and its wall times (ns, a round each)."""


def summarize(
    found: dict[str, Part],
    counts: dict[str, dict[str, Counts]],
    contention: Contention,
    passed: dict[str, HandOffs],
    args: argparse.Namespace,
) -> list[list[object]]:
    """Print and return the issue's table: a row a figure, a column a contender."""
    runs, walls = contention

    def row(label: str, value: Callable[[str], object | None]) -> list[object]:
        return [label, *(value(name) for name in COLUMNS)]

    def contended(value: Callable[[Contended], object]) -> Callable[[str], object | None]:
        return lambda name: value(runs[name]) if name in runs else None

    def handed(name: str) -> str | None:
        if name not in passed:
            return None
        latency = passed[name].latency
        return (
            f"{harness.cell(latency.us('p50') / 1000)} / {harness.cell(latency.us('p99') / 1000)}"
        )

    cycle, failed = found["cycle"], found["failed"]
    load = f"{args.processes} processes x {args.contended_cycles} cycles"
    rounds = f"median of {args.contended_rounds}" if args.contended_rounds > 1 else "1 round"
    rows = [
        row("cycle (acquire + release), ops/s", lambda n: cycle.figures[n].ops_per_s),
        row("cycle, x raw (ops/s, median of rounds)", lambda n: median_ratio(cycle, n)),
        row("server commands per cycle", lambda n: counts["cycle"][n].total),
        row("requests per cycle", lambda n: counts["cycle"][n].requests),
        row("failed acquire (key held), ops/s", lambda n: failed.figures[n].ops_per_s),
        row("failed acquire, x raw SET NX (ops/s, median)", lambda n: median_ratio(failed, n)),
        row("server commands per failed acquire", lambda n: counts["failed"][n].total),
        row("requests per failed acquire", lambda n: counts["failed"][n].requests),
        row(
            f"contended, {load}, wall s ({rounds})",
            lambda n: walls[n].us("p50") / 1e6 if n in walls else None,
        ),
        row("contended: counter (all rounds)", contended(lambda c: f"{c.counter}/{c.expected}")),
        row("contended: most holding at once", contended(lambda c: c.peak)),
        row("contended: longest streak of one process", contended(lambda c: c.longest_streak)),
        row("contended: longest acquire, ms", contended(lambda c: c.waits.us("max") / 1000)),
        row("hand-off to a blocked waiter, median / p99 ms", handed),
    ]
    head = ["figure", *COLUMNS.values()]
    title = (
        "Summary (AsyncDMutex against raw asyncio; commands: INFO commandstats, a script's "
        f"commands included; {COLUMNS[SEMAPHORE]}: failed with all {PERMITS} held, "
        f"contended on {PERMITS} permits, hand-off with the other {PERMITS - 1} held)"
    )
    harness.table(head, rows, title)
    return rows


def check(
    found: dict[str, Part], contention: Contention, passed: dict[str, HandOffs]
) -> list[Target]:
    """The issue's targets, from this run's figures (ratios: medians of the rounds' ratios)."""
    cycle, failed = found["cycle"].ratios, found["failed"].ratios
    runs, walls = contention
    prl_ratio = harness.ratio(
        {k: passed[k].latency for k in (DMUTEX, PRL)}, DMUTEX, PRL, "p50"
    ).pooled
    return [
        Target(
            "DMutex cycle / redis-py Lock's (ops/s)",
            cycle["dmutex / redis-py, ops/s"].median,
            1.0,
            True,
        ),
        Target("DMutex cycle / raw's (ops/s)", cycle["dmutex / raw, ops/s"].median, 0.9, True),
        Target(
            "DMutex failed acquire / redis-py Lock's (ops/s)",
            failed["dmutex / redis-py, ops/s"].median,
            1.0,
            True,
        ),
        Target(
            "DMutex contended wall / redis-py Lock's",
            harness.ratio(walls, DMUTEX, REDIS_PY, "mean").median,
            0.9,
            False,
        ),
        Target(
            "DMutex contended: lost updates", runs[DMUTEX].expected - runs[DMUTEX].counter, 0, False
        ),
        Target("DMutex hand-off median / python-redis-lock's", prl_ratio, 0.8, False),
        Target(
            "DMutex hand-off p99, ms (< 2)", passed[DMUTEX].latency.us("p99") / 1000, 2.0, False
        ),
        Target(
            "AsyncDMutex cycle / raw asyncio's (ops/s)",
            cycle["dmutex-async / raw-async, ops/s"].median,
            0.9,
            True,
        ),
        Target(
            "AsyncDMutex contended wall / DMutex's",
            harness.ratio(walls, DMUTEX_ASYNC, DMUTEX, "mean").median,
            1.2,
            False,
        ),
        Target(
            f"{COLUMNS[SEMAPHORE]} contended: most holding at once",
            runs[SEMAPHORE].peak,
            PERMITS,
            False,
        ),
    ]


def run(argv: Sequence[str] | None = None) -> int:
    args = harness.parse(__doc__, argv, OPTIONS)
    if not args.url and not args.redis:
        args.redis = harness.one_redis("7.0")
    return harness.main(bench, args)


if __name__ == "__main__":
    sys.exit(run())

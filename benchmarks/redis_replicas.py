"""What ``replicas=1`` costs: each contender with and without it, in one run (issue 27).

Run from the repository root (a report, not a test; about 1.5 minutes on 2
cores, ``--quick``: about 5 seconds)::

    .venv/bin/python benchmarks/redis_replicas.py
    .venv/bin/python benchmarks/redis_replicas.py --quick --json out.json
    .venv/bin/python benchmarks/redis_replicas.py --url redis://127.0.0.1:6379/0

The servers: a primary and one replica on loopback, started here and
stopped by pid at the end (``tests/_support/redis_replicated.py``'s
``Replicated``, of the ``redis-server`` that
``tests/_support/fault_servers.redis_executable`` finds: 7.0 if there is
one, else the newest; no Docker), or the primary ``--url`` names, which must
have at least one replica online (never started or stopped; its keys under
random names, deleted at the end; its command counts then include other
clients'). ``replicas=N`` pipelines each grant, extend and renewal with
``WAIT N timeout``; a release does not wait.

The contenders, each a twin without and with the ``WAIT`` (``-r1``), on ONE
connection per face (``single_connection_client``; a pipeline, dmutex's and
``raw-wait``'s alike, takes a pooled connection of the same client):

- ``raw`` / ``raw-wait``: ``SET key token PX ttl NX`` then ``EVALSHA`` of a
  compare-and-delete script, a fresh ``uuid4`` token each time;
  ``raw-wait`` pipelines ``WAIT 1 1000`` after the ``SET`` (one round
  trip) and checks that 1 replica acknowledged: what ``WAIT`` itself costs;
- ``raw-async`` / ``raw-async-wait``: the same on ``redis.asyncio``;
- ``dmutex`` / ``dmutex-r1``: ``DMutex.acquire(key)`` + ``release()``,
  ``replicas=0`` / ``replicas=1`` (``replicas_timeout`` 1 s, the default);
- ``dmutex-async`` / ``dmutex-async-r1``: ``AsyncDMutex`` likewise;
- ``dsemaphore`` / ``dsemaphore-r1``: ``DSemaphore(max_permits=3)``
  ``acquire`` + ``release``, no other permit held;
- ``extend`` / ``extend-r1``: ``DMutexLock.extend()`` alone, of a lock held
  for the whole run.

1. Timed: ``--rounds`` rounds of ``--cycles`` per contender in turns of
   ``--chunk`` after ``--warmup`` (``harness.interleave``); p50 / p90 / p99
   µs, and each ``-r1``'s (and ``raw-wait``'s) ratio to its twin: the median
   of the per-round ratios of p50, p90 and ops/s, their spread and the
   pooled ratio.
2. Counted: each contender alone, ``--counted`` operations after a warm-up:
   the primary's commands per operation (``INFO commandstats``: a script's
   own commands counted beside its ``EVALSHA``; ``REPLCONF``, which the
   replica sends, counted apart) and requests (round trips, every one the
   client sent, by ``harness.trace_requests``; a pipeline is one), split
   into the acquire's (or the extend's) and the release's.

Then the summary: a row a pair, p50 / p90 µs of both twins, what the
``WAIT`` adds (µs at p50), the ratios, and the commands and requests of an
operation. Options: the counts named above; ``--url``, ``--quick``,
``--json FILE``. No target: figures.
"""

from __future__ import annotations

import argparse
import math
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import harness
import redis
import redis.asyncio
import redis_cycle
from harness import Batch, BenchmarkError, Figures, quantile
from redis_cycle import RAW_RELEASE, Connections, connections, timed, timed_async

from dmutex import AsyncDMutex, DMutex, DSemaphore

REPLICAS = 1  # the -r1 twins' replicas=; raw-wait's WAIT numreplicas
TIMEOUT_S = 1.0  # replicas_timeout, dmutex's default; raw-wait's WAIT timeout
TTL_S = 30.0  # every lease the timed operations take
PERMITS = 3  # the semaphore's
PAIRS = {  # contender: its twin without WAIT
    "raw-wait": "raw",
    "raw-async-wait": "raw-async",
    "dmutex-r1": "dmutex",
    "dmutex-async-r1": "dmutex-async",
    "dsemaphore-r1": "dsemaphore",
    "extend-r1": "extend",
}
OPTIONS = {  # name: (default, under --quick)
    "cycles": (2000, 200), "rounds": (7, 2), "chunk": (100, 100), "warmup": (300, 50),
    "counted": (500, 100),
}  # fmt: skip
URL_HELP = "measure this Redis primary, which has replicas online (its own keys only)"
# p90 is this benchmark's own statistic; the harness's ratios look it up by name.
harness.STATISTICS.setdefault("p90", lambda ns: quantile(ns, 0.9))


def use_test_harness() -> None:
    """Make ``tests._support`` (the servers the tests start) importable."""
    if str(harness.ROOT) not in sys.path:  # run as a script: sys.path[0] is benchmarks/
        sys.path.insert(0, str(harness.ROOT))


@contextmanager
def primary(url: str) -> Iterator[tuple[str, str]]:
    """``(label, url)`` of ``url``'s primary, or of a primary and a replica started here."""
    if url:
        yield f"redis-{version(url)}", url
        return
    use_test_harness()
    from tests._support import fault_servers
    from tests._support.redis_replicated import Replicated

    executable = fault_servers.redis_executable()
    if executable is None:
        raise BenchmarkError("no redis-server executable found (tests/_support/redis_servers.py)")
    servers = Replicated(executable.path, count=REPLICAS)
    servers.start()
    try:
        yield f"redis-{version(servers.url())}", servers.url()
    finally:
        servers.stop()


def version(url: str) -> str:
    with redis.Redis.from_url(url) as client:
        return str(client.info("server")["redis_version"])


def replication(url: str) -> dict[str, object]:
    """The primary's role and replicas online, printed; raises unless REPLICAS are online."""
    with redis.Redis.from_url(url) as client:
        info = client.info("replication")
    online = int(info.get("connected_slaves", 0))
    found = {"role": info.get("role"), "connected_replicas": online}
    print(f"replication: {found}", flush=True)
    if info.get("role") != "master" or online < REPLICAS:
        raise BenchmarkError(f"{url}: not a primary with {REPLICAS} replica(s) online: {found}")
    return found


# --- the contenders ---------------------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    """Every request the contenders' clients send, and what marks a release's."""

    logs: list[list[harness.Request]]
    releases: frozenset[str]  # the SHA1s of the scripts a release runs

    @property
    def count(self) -> int:
        return sum(map(len, self.logs))

    def since(self, counts: Sequence[int]) -> list[harness.Request]:
        return [r for log, n in zip(self.logs, counts, strict=True) for r in log[n:]]

    def marks(self) -> list[int]:
        return [len(log) for log in self.logs]

    def is_release(self, request: harness.Request) -> bool:
        args = request[0]
        return len(args) > 1 and args[0] == "EVALSHA" and str(args[1]) in self.releases


def contenders(faces: Connections, run_id: str) -> tuple[dict[str, Batch], frozenset[str]]:
    """Every contender's batch (in the order of the tables), and the release scripts' SHA1s."""
    client, aclient, loop = faces.client, faces.aclient, faces.loop
    sha = str(client.script_load(RAW_RELEASE))
    timeout_ms = math.ceil(TIMEOUT_S * 1000)
    ttl_ms = math.ceil(TTL_S * 1000)
    raw_key = f"_raw_replicas-{run_id}"
    # redis-py leaves execute_command unannotated; its reply is any RESP value.
    execute: Callable[..., object] = client.execute_command
    aexecute: Callable[..., Awaitable[object]] = aclient.execute_command

    def raw(wait: bool) -> Callable[[], None]:
        def cycle() -> None:
            token = str(uuid.uuid4())
            if wait:
                pipe = client.pipeline(transaction=False)
                queue: Callable[..., object] = pipe.execute_command  # unannotated in redis-py
                queue("SET", raw_key, token, "PX", ttl_ms, "NX")
                queue("WAIT", REPLICAS, timeout_ms)
                taken, acks = pipe.execute()
                if not taken or int(acks) < REPLICAS:
                    raise BenchmarkError(f"raw-wait: SET {taken!r}, WAIT {acks!r}")
            elif not execute("SET", raw_key, token, "PX", ttl_ms, "NX"):
                raise BenchmarkError("raw: uncontended SET NX failed")
            if execute("EVALSHA", sha, 1, raw_key, token) != 1:
                raise BenchmarkError("raw: compare-and-delete failed")

        return cycle

    def raw_async(wait: bool) -> Callable[[], Awaitable[None]]:
        async def cycle() -> None:
            token = str(uuid.uuid4())
            if wait:
                pipe = aclient.pipeline(transaction=False)
                queue: Callable[..., object] = pipe.execute_command  # unannotated in redis-py
                queue("SET", raw_key, token, "PX", ttl_ms, "NX")
                queue("WAIT", REPLICAS, timeout_ms)
                taken, acks = await pipe.execute()
                if not taken or int(acks) < REPLICAS:
                    raise BenchmarkError(f"raw-async-wait: SET {taken!r}, WAIT {acks!r}")
            elif not await aexecute("SET", raw_key, token, "PX", ttl_ms, "NX"):
                raise BenchmarkError("raw-async: uncontended SET NX failed")
            if await aexecute("EVALSHA", sha, 1, raw_key, token) != 1:
                raise BenchmarkError("raw-async: compare-and-delete failed")

        return cycle

    def mutex(replicas: int) -> Callable[[], None]:
        lock_of = DMutex(
            f"replicas-m{replicas}-{run_id}",
            client,
            default_ttl_seconds=TTL_S,
            replicas=replicas,
            replicas_timeout=TIMEOUT_S,
        )

        def cycle() -> None:
            lock = lock_of.acquire("k")
            if lock is None or not lock.release():
                raise BenchmarkError(f"DMutex(replicas={replicas}): acquire/release failed")

        return cycle

    def mutex_async(replicas: int) -> Callable[[], Awaitable[None]]:
        lock_of = AsyncDMutex(
            f"replicas-a{replicas}-{run_id}",
            aclient,
            default_ttl_seconds=TTL_S,
            replicas=replicas,
            replicas_timeout=TIMEOUT_S,
        )

        async def cycle() -> None:
            lock = await lock_of.acquire("k")
            if lock is None or not await lock.release():
                raise BenchmarkError(f"AsyncDMutex(replicas={replicas}): acquire/release failed")

        return cycle

    def semaphore(replicas: int) -> Callable[[], None]:
        sem = DSemaphore(
            f"replicas-s{replicas}-{run_id}",
            client,
            max_permits=PERMITS,
            default_ttl_seconds=TTL_S,
            replicas=replicas,
            replicas_timeout=TIMEOUT_S,
        )

        def cycle() -> None:
            permit = sem.acquire("k")
            if permit is None or not permit.release():
                raise BenchmarkError(f"DSemaphore(replicas={replicas}): acquire/release failed")

        return cycle

    def extend(replicas: int) -> Callable[[], None]:
        held = DMutex(
            f"replicas-e{replicas}-{run_id}",
            client,
            default_ttl_seconds=TTL_S,
            replicas=replicas,
            replicas_timeout=TIMEOUT_S,
        ).acquire("k")
        if held is None:
            raise BenchmarkError(f"DMutex(replicas={replicas}): could not take the extended lock")

        def once() -> None:
            if not held.extend():
                raise BenchmarkError(f"DMutex(replicas={replicas}): extend failed")

        return once

    found = {
        "raw": timed(raw(False)),
        "raw-wait": timed(raw(True)),
        "raw-async": timed_async(loop, raw_async(False)),
        "raw-async-wait": timed_async(loop, raw_async(True)),
        "dmutex": timed(mutex(0)),
        "dmutex-r1": timed(mutex(REPLICAS)),
        "dmutex-async": timed_async(loop, mutex_async(0)),
        "dmutex-async-r1": timed_async(loop, mutex_async(REPLICAS)),
        "dsemaphore": timed(semaphore(0)),
        "dsemaphore-r1": timed(semaphore(REPLICAS)),
        "extend": timed(extend(0)),
        "extend-r1": timed(extend(REPLICAS)),
    }
    releases = {harness.SCRIPT_SHAS["release"], harness.SCRIPT_SHAS["mutex-release"]}
    return found, frozenset({sha, *releases})


# --- 2. what each operation sends --------------------------------------------------------


@dataclass(frozen=True)
class Counts:
    """Per operation: the primary's commands by name (REPLCONF apart) and the requests."""

    commands: dict[str, float]
    replconf: float
    requests: float
    first: float  # the acquire's (or the extend's) requests
    release: float  # the release's requests
    pipelined: list[str]  # each distinct pipeline sent, by its commands' names

    @property
    def total(self) -> float:
        return sum(self.commands.values())

    def breakdown(self) -> str:
        ordered = sorted(self.commands.items(), key=lambda item: (-item[1], item[0]))
        return ", ".join(f"{name.upper()} {n:g}" for name, n in ordered)


def counted(url: str, run_id: str, n: int) -> dict[str, Counts]:
    """Each contender alone, ``n`` times after a warm-up: what the primary ran, what was sent."""
    found: dict[str, Counts] = {}
    with connections(url) as faces, redis.Redis.from_url(url) as probe:
        # Before dmutex binds the clients' execute_command and pipeline.
        sent_logs = [harness.trace_requests(faces.client), harness.trace_requests(faces.aclient)]
        batches, releases = contenders(faces, run_id)
        sent = Sent(sent_logs, releases)
        for name, batch in batches.items():
            batch(max(10, n // 10))  # scripts loaded, connections open
            before, marks = harness.server_counters(probe)[0], sent.marks()
            batch(n)
            after = harness.server_counters(probe)[0]
            requests = sent.since(marks)
            calls = {k: c - before.get(k, (0, 0))[0] for k, (c, _) in after.items()}
            released = sum(map(sent.is_release, requests))
            found[name] = Counts(
                commands={
                    k: c / n for k, c in calls.items() if c and k not in ("info", "replconf")
                },
                replconf=calls.get("replconf", 0) / n,
                requests=len(requests) / n,
                first=(len(requests) - released) / n,
                release=released / n,
                pipelined=sorted(
                    {" + ".join(map(str, r[0][1:])) for r in requests if r[0][0] == "PIPELINE"}
                ),
            )
    rows = [
        [
            name,
            c.total,
            c.replconf,
            c.requests,
            c.first,
            c.release,
            c.breakdown(),
            "; ".join(c.pipelined) or "-",
        ]
        for name, c in found.items()
    ]
    head = [
        "contender",
        "commands",
        "REPLCONF",
        "requests",
        "acquire/extend",
        "release",
        "commands by name",
        "pipelines",
    ]
    title = (
        f"2. Per operation (a cycle; extend: one extend), {n} of each alone: the primary's "
        "commands (INFO commandstats, a script's own included; REPLCONF, from the replica, "
        "apart) and requests (round trips; a pipeline is one)"
    )
    harness.table(head, rows, title)
    return found


# --- the run ----------------------------------------------------------------------------


def times_table(figures: Mapping[str, Figures], title: str) -> None:
    """Each contender's ops/s and p50 / p90 / p99 / mean µs."""
    rows = [
        [name, len(f.samples), f.ops_per_s, f.us("p50"), f.us("p90"), f.us("p99"), f.us("mean")]
        for name, f in figures.items()
    ]
    head = ["contender", "samples", "ops/s", "p50 µs", "p90 µs", "p99 µs", "mean µs"]
    harness.table(head, rows, title)


def summarize(
    figures: Mapping[str, Figures],
    ratios: Mapping[str, harness.Ratio],
    counts: Mapping[str, Counts],
) -> list[list[object]]:
    """A row a pair: both twins' p50 / p90, the WAIT's µs, the ratios, commands and requests."""

    def both(name: str, twin: str, statistic: str) -> str:
        without, with_wait = figures[twin].us(statistic), figures[name].us(statistic)
        return f"{harness.cell(without)} / {harness.cell(with_wait)}"

    def sends(name: str) -> str:
        c = counts[name]
        return f"{c.total:g} / {c.requests:g} ({c.first:g} + {c.release:g})"

    rows = []
    for name, twin in PAIRS.items():
        rows.append(
            [
                f"{name} / {twin}",
                both(name, twin, "p50"),
                both(name, twin, "p90"),
                figures[name].us("p50") - figures[twin].us("p50"),
                ratios[f"{name} / {twin}, p50"].median,
                ratios[f"{name} / {twin}, p90"].median,
                ratios[f"{name} / {twin}, ops/s"].median,
                f"{sends(twin)} -> {sends(name)}",
                counts[name].replconf,
            ]
        )
    head = [
        "with WAIT / without",
        "p50 µs, without / with",
        "p90 µs",
        "+ µs p50",
        "x p50",
        "x p90",
        "x ops/s",
        "commands / requests (acquire + release), without -> with",
        "REPLCONF, with",
    ]
    title = (
        "Summary (x: median of the per-round ratios, with WAIT over without; commands: the "
        "primary's, a script's own included, REPLCONF apart; extend: one extend, no release)"
    )
    harness.table(head, rows, title)
    return rows


def bench(url: str, args: argparse.Namespace) -> dict[str, object]:
    found = replication(url)
    run_id = uuid.uuid4().hex[:8]
    print(
        f"{args.rounds} rounds x {args.cycles} per contender in turns of {args.chunk}, after "
        f"{args.warmup} warm-up, one connection per face; replicas={REPLICAS}, "
        f"replicas_timeout={TIMEOUT_S}" + (" (--quick)" if args.quick else ""),
        flush=True,
    )
    try:
        with connections(url) as faces:
            batches, _ = contenders(faces, f"{run_id}t")
            harness.progress("1. timed, interleaved")
            figures = redis_cycle.interleaved(batches, args)
        times_table(figures, "1. Timed (extend, extend-r1: one extend; the others: a cycle)")
        pairs = [*PAIRS.items(), ("dmutex", "raw"), ("dmutex-r1", "raw-wait")]
        pairs += [("dmutex-async", "raw-async"), ("dmutex-async-r1", "raw-async-wait")]
        ratios = harness.ratio_table(figures, pairs, ("p50", "p90", "ops/s"))
        harness.progress("2. counted")
        counts = counted(url, f"{run_id}n", args.counted)
    finally:
        harness.delete_keys(url, f"*{run_id}*")  # held locks, fence counters
    summary = summarize(figures, ratios, counts)
    requests: dict[str, float] = {}
    for name, c in counts.items():  # requests per operation, as the tests check them
        if name.startswith("extend"):
            requests[f"{name}: extend"] = c.requests
        else:
            requests |= {f"{name}: acquire": c.first, f"{name}: cycle": c.requests}
    return {
        "redis_server": version(url),
        "replication": found,
        "figures": figures,
        "ratios": ratios,
        "counted": counts,
        "requests": requests,
        "summary": summary,
    }


def run(argv: Sequence[str] | None = None) -> int:
    args = harness.parse(__doc__, argv, OPTIONS, redis=False, url=URL_HELP)
    return harness.main(bench, args, server=lambda: primary(args.url))


if __name__ == "__main__":
    sys.exit(run())

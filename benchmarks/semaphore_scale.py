"""What a semaphore operation costs as ``max_permits`` grows, on Redis and in memory.

Run from the repository root (a report, not a test; about 30 seconds a server)::

    .venv/bin/python benchmarks/semaphore_scale.py
    .venv/bin/python benchmarks/semaphore_scale.py --samples 50 --permits 1 64
    .venv/bin/python benchmarks/semaphore_scale.py --redis 7.0 --json out.json

For each ``max_permits`` N (1, 64, 1024 and ``dmutex.MAX_PERMITS``, or
``--permits``), every case below on one ``DSemaphore`` (the measured one, on
its own connection) while other tokens hold the other slots:

- ``full acquire``: all N slots held by another ``DSemaphore`` instance of the
  same service (so any record dmutex keeps beside the slots is as in use),
  ``acquire`` answers None; ``full acquire, raw holders``: all N slot keys
  written by ``SET {prefix}permit:{i}:{key} token PX ttl NX``, as the
  TypeScript library writes them, and nothing else;
- ``last free slot``: N-1 held, ``acquire`` takes the last slot (released untimed);
- ``release by handle`` / ``release by token``: ``permit.release()`` /
  ``sem.release(key, token)`` of a permit taken untimed on the N-1 held;
- ``extend by token``: ``sem.extend(key, token)`` of the permit that fills it;
- ``floor``: a script that returns at once, sent with the full acquire's keys
  and arguments: what any one request naming every slot key costs.

A sample times the call alone (``time.perf_counter_ns``). Around it, untimed,
on a second connection: ``INFO commandstats`` and ``SLOWLOG`` (threshold 0
for the run, settings restored after): the server's time per call (the
``usec`` delta of the command sent, a script's own commands included) and the
measured connection's ``SLOWLOG`` entries (``CLIENT SETNAME``), whose longest
is the longest time one request blocked the server. The request's bytes are
one call's, packed by the connection's ``pack_command``; a wrapper on
``execute_command`` (``harness.trace_requests``) also counts the requests per
call. Cases run after a warm-up, interleaved in rounds of ``--turn`` samples.
The same cases (no raw holders, no floor) then run on ``InMemoryBackend``.

Options: ``--permits N...``, ``--samples`` per case, ``--warmup`` samples per
case, ``--turn`` (samples per turn, a round of the ratio table); and the
harness's ``--url``, ``--redis VERSION...``, ``--quick``, ``--json FILE``.

Targets (issue 14): full acquire and release by token p50 at N=64 <= 1.3x N=1,
at N=1024 <= 2x.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import harness
import redis
from harness import Batch, BenchmarkError, Figures, Request, Target

import dmutex
from dmutex import DSemaphore, DSemaphorePermit, InMemoryBackend
from dmutex._backends.redis.scripts import INDEXED_ABOVE

HOLDER_TTL_S = 3600.0  # the other tokens' permits: none expires during a run
TTL_S = 300.0  # the measured permits' ttl
SLOWLOG_LEN = 1024  # far more entries than one sample leaves
TARGETS = {64: 1.3, 1024: 2.0}  # N: the bound on its p50 over N=1's
NOOP = "return 0"
OPTIONS = {  # name: (default, under --quick)
    "permits": (sorted({1, 64, 1024, dmutex.MAX_PERMITS}), [1, 64]), "samples": (200, 40),
    "warmup": (10, 5), "turn": (20, 20),
}  # fmt: skip

FULL, RAW_FULL, LAST = "full acquire", "full acquire, raw holders", "last free slot"
BY_HANDLE, BY_TOKEN, EXTEND = "release by handle", "release by token", "extend by token"
FLOOR = "floor: a script that does nothing"
REDIS_CASES = (FULL, RAW_FULL, LAST, BY_HANDLE, BY_TOKEN, EXTEND, FLOOR)
MEMORY_CASES = (FULL, LAST, BY_HANDLE, BY_TOKEN, EXTEND)
TARGETED = (FULL, BY_TOKEN)


@dataclass
class Case:
    """One operation on one semaphore: ``begin``/``end`` around a turn, ``call`` timed.

    Each leaves the semaphore as it found it, so that the cases of one key
    can interleave.
    """

    name: str
    permits: int
    sem: DSemaphore
    key: str
    holder: DSemaphore
    conn: redis.Redis | None = None  # the measured connection (Redis only)
    floor_keys: list[str] = field(default_factory=list)
    permit: DSemaphorePermit | None = None  # held for the turn
    calls: int = 0  # server calls of the measured command
    usec: int = 0  # and their total time
    blocked: list[int] = field(default_factory=list)  # SLOWLOG durations, µs
    requests: list[int] = field(default_factory=list)  # requests per call
    command: str = ""
    size: int | None = None  # bytes of one call's requests, packed

    def take(self, by: DSemaphore, ttl: float = TTL_S) -> DSemaphorePermit:
        permit = by.acquire(self.key, ttl=ttl)
        if permit is None:
            raise BenchmarkError(f"{self.name}, N={self.permits}: no free slot")
        return permit

    def begin(self) -> None:
        if self.name == FULL:
            self.permit = self.take(self.holder, HOLDER_TTL_S)
        elif self.name == EXTEND:
            self.permit = self.take(self.sem)

    def end(self) -> None:
        if self.name in (FULL, EXTEND) and not (self.permit and self.permit.release()):
            raise BenchmarkError(f"{self.name}, N={self.permits}: the turn's permit was lost")

    def call(self) -> Callable[[], object]:
        """The timed call, with whatever it needs prepared untimed."""
        sem, key = self.sem, self.key
        if self.name in (FULL, RAW_FULL, LAST):
            return lambda: sem.acquire(key, ttl=TTL_S)
        if self.name == EXTEND:
            token = self.permit.token if self.permit else ""
            return lambda: sem.extend(key, token, TTL_S)
        if self.name == FLOOR and self.conn is not None:
            sha, keys = hashlib.sha1(NOOP.encode()).hexdigest(), self.floor_keys
            # redis-py leaves execute_command unannotated; the reply is any RESP value.
            send: Callable[..., object] = self.conn.execute_command
            args, ttl_ms = ("EVALSHA", sha, len(keys), *keys), round(TTL_S * 1000)
            return lambda: send(*args, str(uuid.uuid4()), ttl_ms, "fence+holders")  # as acquire
        permit = self.take(sem)
        if self.name == BY_HANDLE:
            return permit.release
        return lambda: sem.release(key, permit.token)

    def check(self, reply: object) -> None:
        wanted = {FULL: None, RAW_FULL: None, FLOOR: 0}.get(self.name, True)
        if self.name == LAST:
            ok = isinstance(reply, DSemaphorePermit) and reply.release()
        else:
            ok = reply == wanted
        if not ok:
            raise BenchmarkError(f"{self.name}, N={self.permits}: answered {reply!r}")


@dataclass
class Server:
    """What the server spent on the measured connection's calls, read on another connection."""

    probe: redis.Redis
    name: str  # the measured connection's CLIENT SETNAME
    log: list[Request]  # the measured connection's requests
    slowlog: bool

    def mark(self) -> tuple[dict[str, tuple[int, int]], int]:
        """Every command's (calls, usec) so far, and the newest SLOWLOG id (-1: none)."""
        pipe = self.probe.pipeline(transaction=False)
        pipe.info("commandstats")
        pipe.slowlog_get(1)
        stats, newest = pipe.execute()
        return harness.commandstats(stats), (int(newest[0]["id"]) if newest else -1)

    def sample(self, case: Case, call: Callable[[], object]) -> tuple[int, object]:
        """Time ``call``; its requests, server time and SLOWLOG entries go to ``case``."""
        (old_stats, old_newest), mark = self.mark(), len(self.log)
        start = time.perf_counter_ns()
        reply = call()
        took = time.perf_counter_ns() - start
        sent = [args for args, _, _ in self.log[mark:]]
        if not sent or case.conn is None or case.conn.connection is None:
            raise BenchmarkError(f"{case.name}: the call sent no request")
        case.command = str(sent[0][0]).lower()
        case.requests.append(len(sent))
        if case.size is None:
            # redis-py leaves pack_command unannotated: it returns the chunks to send.
            pack: Callable[..., list[bytes]] = case.conn.connection.pack_command
            case.size = sum(len(part) for args in sent for part in pack(*args))
        stats, newest = self.mark()
        calls, usec = stats.get(case.command, (0, 0))
        case.calls += calls - old_stats.get(case.command, (0, 0))[0]
        case.usec += usec - old_stats.get(case.command, (0, 0))[1]
        if self.slowlog and newest > old_newest:
            # +2: the reads of mark() are logged too, after the id they answered.
            for entry in self.probe.slowlog_get(min(newest - old_newest + 2, SLOWLOG_LEN)):
                name = entry.get("client_name")
                if int(entry["id"]) > old_newest and name in (self.name, self.name.encode()):
                    case.blocked.append(int(entry["duration"]))
        return took, reply


def measure(
    cases: Sequence[Case], server: Server | None, args: argparse.Namespace
) -> dict[str, Figures]:
    """Warm every case up, then interleave them in rounds of ``--turn`` samples."""

    def turns(case: Case, keep: bool = True) -> Batch:
        def run(n: int) -> list[int]:
            case.begin()
            try:
                samples = []
                for _ in range(n):
                    call = case.call()
                    if keep and server is not None:
                        took, reply = server.sample(case, call)
                    else:
                        start = time.perf_counter_ns()
                        reply = call()
                        took = time.perf_counter_ns() - start
                    case.check(reply)
                    samples.append(took)
                return samples
            finally:
                case.end()

        return run

    for case in cases:
        turns(case, keep=False)(args.warmup)
    contenders = {label(case): turns(case) for case in cases}
    rounds = max(1, args.samples // args.turn)
    return harness.interleave(contenders, rounds=rounds, per_round=args.turn, turn=args.turn)


def label(case: Case) -> str:
    return f"{case.name}, N={case.permits}"


def fill(holder: DSemaphore, key: str, count: int) -> None:
    """``count`` permits of ``key`` taken by ``holder``, one acquire each."""
    harness.progress(f"N={count + 1}: taking {count} permits of {key}")
    for i in range(count):
        if holder.acquire(key, ttl=HOLDER_TTL_S) is None:
            raise BenchmarkError(f"{key}: holder {i} found no free slot")


Measured = tuple[list[Case], dict[str, Figures]]


def redis_cases(url: str, args: argparse.Namespace, probe: redis.Redis, slowlog: bool) -> Measured:
    """Every Redis case at every N, interleaved; the keys deleted after."""
    run_id = uuid.uuid4().hex[:8]
    name, prefix = f"semscale-{run_id}", f"_semscale_{run_id}:"
    conn = redis.Redis.from_url(url, single_connection_client=True, client_name=name)
    log = harness.trace_requests(conn)  # before dmutex binds execute_command
    holders = redis.Redis.from_url(url)
    cases: list[Case] = []
    try:
        probe.script_load(NOOP)
        for n in args.permits:
            sem, holder = (
                DSemaphore(name, c, max_permits=n, key_prefix=prefix, default_ttl_seconds=TTL_S)
                for c in (conn, holders)
            )
            key, raw_key = f"held{n}", f"raw{n}"
            fill(holder, key, n - 1)
            pipe = probe.pipeline(transaction=False)
            for i in range(n):  # as the TypeScript library writes a permit
                token, ttl_ms = str(uuid.uuid4()), round(HOLDER_TTL_S * 1000)
                pipe.set(f"{prefix}permit:{i}:{raw_key}", token, px=ttl_ms, nx=True)
            if not all(pipe.execute()):
                raise BenchmarkError(f"{raw_key}: a raw holder's key existed already")
            slots = [f"{prefix}permit:{i}:{key}" for i in range(n)]
            # The acquire's own keys: the index only above INDEXED_ABOVE permits (scripts.py).
            index = [f"{prefix}holders:{key}"] if n > INDEXED_ABOVE else []
            floor = [*slots, f"{prefix}fence:{key}", *index]
            for case in REDIS_CASES:
                on = raw_key if case == RAW_FULL else key
                cases.append(Case(case, n, sem, on, holder, conn, floor))
        figures = measure(cases, Server(probe, name, log, slowlog), args)
    finally:
        harness.delete_keys(url, f"{prefix}*")
        conn.close()
        holders.close()
    return cases, figures


def memory_cases(args: argparse.Namespace) -> Measured:
    """The same cases on ``InMemoryBackend`` (no raw holders: only dmutex writes there)."""
    cases: list[Case] = []
    for n in args.permits:
        backend = InMemoryBackend()
        sem, holder = (
            DSemaphore("semscale", backend, max_permits=n, default_ttl_seconds=TTL_S)
            for _ in range(2)
        )
        fill(holder, "k", n - 1)
        cases += [Case(case, n, sem, "k", holder) for case in MEMORY_CASES]
    return cases, measure(cases, None, args)


def report(where: str, measured: Measured) -> tuple[dict[str, object], list[Target]]:
    """Print one backend's table and ratios to N=1; its figures and targets."""
    cases, figures = measured
    order = REDIS_CASES if where == "Redis" else MEMORY_CASES
    cases = sorted(cases, key=lambda c: (order.index(c.name), c.permits))
    base = {c.name: c for c in cases if c.permits == 1}

    def server_ratio(c: Case) -> float | None:
        one = base.get(c.name)
        return c.usec / c.calls / (one.usec / one.calls) if one and c.calls and one.calls else None

    rows = [
        [c.name, c.permits, figures[label(c)].us("p50"), figures[label(c)].us("p99")]
        + (
            [
                c.usec / c.calls if c.calls else None,
                server_ratio(c),
                max(c.blocked, default=None),
                statistics.median(c.blocked) if c.blocked else None,
                c.size,
                "/".join(map(str, sorted(set(c.requests)))) + f" {c.command.upper()}",
            ]
            if where == "Redis"
            else []
        )
        for c in cases
    ]
    head = ["case", "N", "p50 µs", "p99 µs"]
    if where == "Redis":
        head += ["server µs/call", "server x N=1", "longest request µs", "median request µs"]
        head += ["request bytes", "requests"]
    about = "; server: INFO commandstats; requests: SLOWLOG" if where == "Redis" else ""
    harness.table(head, rows, f"{where}: client µs{about}")
    pairs = [(label(c), label(base[c.name])) for c in cases if c.permits != 1 and c.name in base]
    ratios = harness.ratio_table(figures, pairs, ("p50",), f"{where}: p50 over N=1's, per round:")
    targets = [
        Target(f"{where} {c.name}, N={c.permits} / N=1 (p50)", r.pooled, TARGETS[c.permits], False)
        for c in cases
        if c.name in TARGETED and c.permits in TARGETS and c.name in base
        for r in [ratios[f"{label(c)} / {label(base[c.name])}, p50"]]
    ]
    server = {
        label(c): {
            "command": c.command,
            "requests_per_call": sorted(set(c.requests)),
            "request_bytes": c.size,
            "server_us_per_call": c.usec / c.calls if c.calls else None,
            "slowlog_us": c.blocked,
        }
        for c in cases
        if c.requests
    }
    return {"figures": figures, "ratios": ratios, "server": server}, targets


def bench(url: str, args: argparse.Namespace) -> dict[str, object]:
    print(f"max_permits {args.permits}; {args.samples} samples per case in turns of {args.turn}")
    with (
        redis.Redis.from_url(url) as probe,
        harness.slowlog_everything(probe, SLOWLOG_LEN) as slowlog,
    ):
        on_redis = redis_cases(url, args, probe, slowlog)
    harness.progress("InMemoryBackend")
    found, targets = report("Redis", on_redis)
    in_memory, memory_targets = report("InMemoryBackend", memory_cases(args))
    harness.targets_table(targets + memory_targets)
    return {"redis": found, "memory": in_memory, "targets": targets + memory_targets}


def run(argv: Sequence[str] | None = None) -> int:
    args = harness.parse(__doc__, argv, OPTIONS)
    args.permits = sorted(set(args.permits))
    if args.permits[-1] > dmutex.MAX_PERMITS:
        sys.exit(f"--permits must be from 1 to {dmutex.MAX_PERMITS}")
    return harness.main(bench, args)


if __name__ == "__main__":
    sys.exit(run())

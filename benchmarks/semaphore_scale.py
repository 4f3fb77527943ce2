"""What a semaphore operation costs as ``max_permits`` grows, on Redis and in memory.

Run from the repository root (a report, not a test; about a minute on 2 cores)::

    .venv/bin/python benchmarks/semaphore_scale.py
    .venv/bin/python benchmarks/semaphore_scale.py --samples 50 --permits 1 64
    .venv/bin/python benchmarks/semaphore_scale.py --server /path/to/redis-server --json out.json

Without ``--url`` it starts ``redis-server`` (``/usr/bin/redis-server``, or
``--server``) on a free 127.0.0.1 port with persistence off, and stops it by
pid at the end. With ``--url`` it works under its own random key prefix and
deletes its keys at the end; the server's command counts then include other
clients' commands, and its slowlog settings are restored after the run.

For each ``max_permits`` N (1, 64, 1024 and ``dmutex.MAX_PERMITS``, or
``--permits``), every case below on one ``DSemaphore`` (the measured one, on
its own connection) while other tokens hold the other slots:

- ``full acquire``: all N slots held by another ``DSemaphore`` instance of the
  same service (so any record dmutex keeps beside the slots is as it would
  be), ``acquire`` answers None;
- ``full acquire, raw holders``: all N slot keys written by ``SET ... PX ... NX``
  under the TypeScript layout (``{prefix}permit:{i}:{key}``), as the
  TypeScript library writes them, with no other record;
- ``last free slot``: N-1 held, ``acquire`` takes slot N-1 (a fresh permit per
  sample, released untimed);
- ``release by handle`` / ``release by token``: ``permit.release()`` /
  ``sem.release(key, token)`` of a permit acquired untimed on the N-1 held;
- ``extend by token``: ``sem.extend(key, token)`` of the one permit that,
  with the N-1 held, fills the semaphore.

A sample times the call alone with ``time.perf_counter_ns``. Around it, on
a second connection and untimed: ``INFO commandstats`` and the newest
``SLOWLOG`` id before, both again after. So the server's figures cover the
measured calls only: its time per call (the ``usec`` delta of the command
the call sent, ``EVALSHA``: a script's own commands included) and every
``SLOWLOG`` entry of the measured connection (``CLIENT SETNAME``; threshold
0 for the run), whose largest is the longest time one request blocked the
server. The request size is that of one measured call, packed by the
connection's ``pack_command``; a wrapper on ``execute_command`` captures it
and counts the requests of every call. Cases run after a warm-up, interleaved
in turns of ``--turn`` samples. The same cases then run on ``InMemoryBackend``
(client time only).

Targets (issue 14): the p50 of the full acquire and of release by token at
N=64 within 1.3x of N=1, at N=1024 within 2x; each printed as PASS or MISS.
The exit code is 0 either way (non-zero only when the benchmark itself could
not run).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis_cycle import BenchmarkError, Figures, Target, machine, run, shown

import dmutex
from dmutex import DSemaphore, DSemaphorePermit, InMemoryBackend

DEFAULT_SERVER = "/usr/bin/redis-server"  # Redis 7.0 here; PATH in the venv finds 6.2
HOLDER_TTL_S = 3600.0  # the other tokens' permits: none expires during a run
TTL_S = 300.0  # the measured permits' ttl
SLOWLOG_LEN = 1024  # far more entries than one sample leaves
FILL_REPORT_EVERY = 256  # holders between progress lines while filling a semaphore
TARGETS = {64: 1.3, 1024: 2.0}  # N: the bound on its p50 over N=1's

FULL, RAW_FULL, LAST = "full acquire", "full acquire, raw holders", "last free slot"
BY_HANDLE, BY_TOKEN, EXTEND = "release by handle", "release by token", "extend by token"
FLOOR = "floor: a script that does nothing"
REDIS_CASES = (FULL, RAW_FULL, LAST, BY_HANDLE, BY_TOKEN, EXTEND, FLOOR)
MEMORY_CASES = (FULL, LAST, BY_HANDLE, BY_TOKEN, EXTEND)
TARGETED = (FULL, BY_TOKEN)


# --- the measured client's requests ---------------------------------------------------


class Wire:
    """The requests of the measured client: counted per call, one call's arguments kept.

    Installed as an instance attribute before dmutex binds ``execute_command``;
    inside the timed region it costs one Python call and an append.
    """

    def __init__(self, client: redis.Redis) -> None:
        # redis-py leaves execute_command unannotated; its reply is any RESP value.
        self._send: Callable[..., object] = client.execute_command
        self.armed = False
        self.sent: list[tuple[object, ...]] = []
        vars(client)["execute_command"] = self.execute

    def execute(self, *args: object, **options: object) -> object:
        if self.armed:
            self.sent.append(args)
        return self._send(*args, **options)

    @contextmanager
    def recording(self) -> Iterator[list[tuple[object, ...]]]:
        """Keep the arguments of every request sent inside the block."""
        self.sent = []
        self.armed = True
        try:
            yield self.sent
        finally:
            self.armed = False


def request_bytes(client: redis.Redis, requests: Sequence[tuple[object, ...]]) -> int:
    """Bytes on the wire for ``requests``, packed as the client's connection packs them."""
    connection = client.connection
    if connection is None:
        raise BenchmarkError("the measured client has no dedicated connection")
    # redis-py leaves pack_command unannotated: it returns the chunks to send.
    pack: Callable[..., list[bytes | memoryview]] = connection.pack_command
    return sum(len(part) for args in requests for part in pack(*args))


# --- the server's side ----------------------------------------------------------------


@dataclass
class Server:
    """Reads, on its own connection, what the server spent on the measured client's calls."""

    probe: redis.Redis
    name: str  # the measured connection's CLIENT SETNAME
    slowlog: bool = True  # False when the server refused CONFIG SET

    def mark(self) -> tuple[dict[str, tuple[int, int]], int]:
        """Every command's (calls, usec) so far, and the newest SLOWLOG id (-1: none)."""
        pipe = self.probe.pipeline(transaction=False)
        pipe.info("commandstats")
        pipe.slowlog_get(1)
        stats, newest = pipe.execute()
        return _commandstats(stats), (int(newest[0]["id"]) if newest else -1)

    def since(
        self, before: tuple[dict[str, tuple[int, int]], int], command: str
    ) -> tuple[int, int, list[int]]:
        """``command``'s calls and usec since ``before``; the measured connection's SLOWLOG µs."""
        (stats, newest), (old_stats, old_newest) = self.mark(), before
        calls, usec = stats.get(command, (0, 0))
        old_calls, old_usec = old_stats.get(command, (0, 0))
        durations: list[int] = []
        if self.slowlog and newest > old_newest:
            # +2: the reads of mark() are logged too, after the id they answered.
            for entry in self.probe.slowlog_get(min(newest - old_newest + 2, SLOWLOG_LEN)):
                if int(entry["id"]) > old_newest and _text(entry.get("client_name")) == self.name:
                    durations.append(int(entry["duration"]))
        return calls - old_calls, usec - old_usec, durations


def _commandstats(stats: object) -> dict[str, tuple[int, int]]:
    """``INFO commandstats`` as ``{"evalsha": (calls, usec)}``."""
    found: dict[str, tuple[int, int]] = {}
    if isinstance(stats, dict):
        for name, value in stats.items():
            if isinstance(value, dict) and str(name).startswith("cmdstat_"):
                found[str(name).removeprefix("cmdstat_")] = (
                    int(value["calls"]),
                    int(value["usec"]),
                )
    return found


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@contextmanager
def slowlog_everything(probe: redis.Redis) -> Iterator[bool]:
    """Log every command for the block (threshold 0); restore the settings after.

    Yields False, changing nothing, when the server refuses ``CONFIG``.
    """
    try:
        old = probe.config_get("slowlog-*")
        probe.config_set("slowlog-max-len", SLOWLOG_LEN)
        probe.config_set("slowlog-log-slower-than", 0)
    except redis.ResponseError as error:
        print(f"  no SLOWLOG figures: {error}", file=sys.stderr)
        yield False
        return
    try:
        yield True
    finally:
        for name in ("slowlog-log-slower-than", "slowlog-max-len"):
            value = old.get(name)
            if value is not None:
                probe.config_set(name, value)


# --- the cases ------------------------------------------------------------------------


class Case:
    """One operation measured on one semaphore; the subclasses say which.

    ``begin`` and ``end`` run untimed around each turn of samples,
    ``prepare`` and ``settle`` around each sample; ``call`` is timed. Each
    leaves the semaphore as it found it, so that the cases of one key can
    interleave.
    """

    def __init__(self, sem: DSemaphore, key: str, holder: DSemaphore) -> None:
        self.sem, self.key, self.holder = sem, key, holder
        self.permit: DSemaphorePermit | None = None  # the measured permit, when one is held

    def begin(self) -> None:
        pass

    def end(self) -> None:
        pass

    def prepare(self) -> None:
        pass

    def call(self) -> object:
        raise NotImplementedError

    def settle(self, result: object) -> None:
        pass

    def _acquire(self) -> DSemaphorePermit:
        permit = self.sem.acquire(self.key, ttl=TTL_S)
        if permit is None:
            raise BenchmarkError(f"{self.key}: no free slot for the measured permit")
        return permit


class FullAcquire(Case):
    """``acquire`` with every slot held: the last by ``holder`` for the turn."""

    filler: DSemaphorePermit | None = None

    def begin(self) -> None:
        self.filler = self.holder.acquire(self.key, ttl=HOLDER_TTL_S)
        if self.filler is None:
            raise BenchmarkError(f"{self.key}: the holder could not fill the last slot")

    def end(self) -> None:
        if self.filler is None or not self.filler.release():
            raise BenchmarkError(f"{self.key}: the filler's permit was lost")

    def call(self) -> object:
        return self.sem.acquire(self.key, ttl=TTL_S)

    def settle(self, result: object) -> None:
        if result is not None:
            raise BenchmarkError(f"{self.key}: a full semaphore granted a permit")


class RawFullAcquire(FullAcquire):
    """``acquire`` with every slot key written by someone else, beside dmutex."""

    def begin(self) -> None:
        pass

    def end(self) -> None:
        pass


class LastSlot(Case):
    """``acquire`` of the one free slot; released untimed."""

    def call(self) -> object:
        return self.sem.acquire(self.key, ttl=TTL_S)

    def settle(self, result: object) -> None:
        if not isinstance(result, DSemaphorePermit) or not result.release():
            raise BenchmarkError(f"{self.key}: the last free slot was not granted")


class ReleaseByHandle(Case):
    """``permit.release()`` of a permit taken untimed."""

    def prepare(self) -> None:
        self.permit = self._acquire()

    def call(self) -> object:
        assert self.permit is not None
        return self.permit.release()

    def settle(self, result: object) -> None:
        if result is not True:
            raise BenchmarkError(f"{self.key}: release by handle answered {result!r}")


class ReleaseByToken(ReleaseByHandle):
    """``sem.release(key, token)`` of a permit taken untimed."""

    def call(self) -> object:
        assert self.permit is not None
        return self.sem.release(self.key, self.permit.token)

    def settle(self, result: object) -> None:
        if result is not True:
            raise BenchmarkError(f"{self.key}: release by token answered {result!r}")


class ExtendByToken(Case):
    """``sem.extend(key, token)`` of the permit that fills the semaphore for the turn."""

    def begin(self) -> None:
        self.permit = self._acquire()

    def end(self) -> None:
        if self.permit is None or not self.permit.release():
            raise BenchmarkError(f"{self.key}: the extended permit was lost")

    def call(self) -> object:
        assert self.permit is not None
        return self.sem.extend(self.key, self.permit.token, TTL_S)

    def settle(self, result: object) -> None:
        if result is not True:
            raise BenchmarkError(f"{self.key}: extend by token answered {result!r}")


class Floor(Case):
    """A script that returns at once, sent with the full acquire's KEYS and ARGV.

    What any one-request operation that must declare every slot key costs:
    packing the request, sending it, and the server's parsing of it and its
    building of the script's KEYS table, with no script work at all.
    """

    NOOP = "return 0"

    def __init__(self, sem: DSemaphore, key: str, holder: DSemaphore) -> None:
        super().__init__(sem, key, holder)
        self.client: redis.Redis | None = None
        self.keys: list[str] = []

    def bind(self, client: redis.Redis, prefix: str, permits: int) -> Floor:
        """Send through ``client``, with ``permits`` slot keys and the records beside them."""
        self.client = client
        slots = [f"{prefix}permit:{i}:{self.key}" for i in range(permits)]
        self.keys = [*slots, f"{prefix}fence:{self.key}", f"{prefix}holders:{self.key}"]
        return self

    def call(self) -> object:
        assert self.client is not None
        sha = hashlib.sha1(self.NOOP.encode()).hexdigest()  # how Redis names a cached script
        keys, ttl_ms = self.keys, round(TTL_S * 1000)
        # redis-py leaves execute_command unannotated; the reply is any RESP value.
        send: Callable[..., object] = self.client.execute_command
        return send("EVALSHA", sha, len(keys), *keys, str(uuid.uuid4()), ttl_ms, "fence+holders")

    def settle(self, result: object) -> None:
        if result != 0:
            raise BenchmarkError(f"{self.key}: the no-op script answered {result!r}")


KINDS: dict[str, type[Case]] = {
    FULL: FullAcquire,
    RAW_FULL: RawFullAcquire,
    LAST: LastSlot,
    BY_HANDLE: ReleaseByHandle,
    BY_TOKEN: ReleaseByToken,
    EXTEND: ExtendByToken,
    FLOOR: Floor,
}


# --- measuring ------------------------------------------------------------------------


@dataclass
class Result:
    """Every sample of one case at one N, and what the server saw of them."""

    case: str
    permits: int
    client: Figures = field(default_factory=Figures)
    calls: int = 0  # server calls of the measured command
    usec: int = 0  # and their total time
    blocked: list[int] = field(default_factory=list)  # SLOWLOG durations, µs
    requests: list[int] = field(default_factory=list)  # requests per call
    command: str = ""
    size: int | None = None  # bytes of one call's requests, packed

    def summary(self) -> dict[str, object]:
        out: dict[str, object] = {
            "p50_us": self.client.percentile_us(0.5),
            "p99_us": self.client.percentile_us(0.99),
            "mean_us": self.client.mean_us,
            "samples": len(self.client.samples),
        }
        if self.requests:
            out |= {
                "command": self.command,
                "requests_per_call": sorted(set(self.requests)),
                "request_bytes": self.size,
                "server_us_per_call": self.server_us,
                "slowlog_max_us": max(self.blocked) if self.blocked else None,
                "slowlog_p50_us": statistics.median(self.blocked) if self.blocked else None,
            }
        return out

    @property
    def server_us(self) -> float | None:
        return self.usec / self.calls if self.calls else None


@dataclass
class Measured:
    """A case, where its figures go, and how to see the server's side of it."""

    case: Case
    result: Result
    wire: Wire | None = None
    server: Server | None = None
    client: redis.Redis | None = None

    def sample(self, keep: bool) -> int:
        """Run one sample; return its duration in ns; its other figures go to ``result``.

        With ``keep`` False (a warm-up sample: the first call of a script
        also loads it), only the call's answer is checked.
        """
        case, result = self.case, self.result
        case.prepare()
        clock = time.perf_counter_ns
        if not keep or self.wire is None or self.server is None or self.client is None:
            start = clock()
            reply = case.call()
            took = clock() - start
        else:
            before = self.server.mark()
            with self.wire.recording() as sent:
                start = clock()
                reply = case.call()
                took = clock() - start
            if not sent:
                raise BenchmarkError(f"{result.case}: the call sent no request")
            result.command = _text(sent[0][0]).lower()
            result.requests.append(len(sent))
            if result.size is None:
                result.size = request_bytes(self.client, sent)
            calls, usec, blocked = self.server.since(before, result.command)
            result.calls, result.usec = result.calls + calls, result.usec + usec
            result.blocked.extend(blocked)
        case.settle(reply)
        return took

    def turn(self, n: int, keep: bool = True) -> None:
        self.case.begin()
        try:
            batch = [self.sample(keep) for _ in range(n)]
        finally:
            self.case.end()
        if keep:
            self.result.client.samples.extend(batch)


def interleave(measured: Sequence[Measured], samples: int, warmup: int, turn: int) -> None:
    """Warm every case up, then run them in turns of ``turn`` samples, the order rotating."""
    for m in measured:
        m.turn(warmup, keep=False)
    done, index = 0, 0
    while done < samples:
        n = min(turn, samples - done)
        shift = index % len(measured)
        for m in [*measured[shift:], *measured[:shift]]:
            gc.collect()  # one case's garbage is not collected on another's clock
            m.turn(n)
        done, index = done + n, index + 1
        print(f"  {done}/{samples} samples per case", file=sys.stderr, flush=True)


def fill(holder: DSemaphore, key: str, count: int) -> list[DSemaphorePermit]:
    """``count`` permits of ``key`` taken by ``holder``, one acquire each."""
    permits: list[DSemaphorePermit] = []
    for i in range(count):
        permit = holder.acquire(key, ttl=HOLDER_TTL_S)
        if permit is None:
            raise BenchmarkError(f"{key}: holder {i} found no free slot")
        permits.append(permit)
        if (i + 1) % FILL_REPORT_EVERY == 0:
            print(f"    {key}: {i + 1}/{count} held", file=sys.stderr, flush=True)
    return permits


# --- the run --------------------------------------------------------------------------


def redis_cases(
    url: str, args: argparse.Namespace, run_id: str, probe: redis.Redis, slowlog: bool
) -> list[Result]:
    """Every Redis case at every N, interleaved; the keys deleted after."""
    name = f"semscale-{run_id}"
    client = redis.Redis.from_url(url, single_connection_client=True, client_name=name)
    holders_client = redis.Redis.from_url(url)
    prefix = f"_semscale_{run_id}:"
    server = Server(probe, name, slowlog)
    wire = Wire(client)  # before dmutex binds execute_command
    measured: list[Measured] = []
    try:
        for n in args.permits:
            sem, holder = (
                DSemaphore(name, c, max_permits=n, key_prefix=prefix, default_ttl_seconds=TTL_S)
                for c in (client, holders_client)
            )
            key, raw_key = f"held{n}", f"raw{n}"
            print(f"  N={n}: taking {n - 1} permits with DSemaphore", file=sys.stderr, flush=True)
            fill(holder, key, n - 1)
            pipe = probe.pipeline(transaction=False)
            for i in range(n):  # as the TypeScript library writes a permit
                pipe.set(
                    f"{prefix}permit:{i}:{raw_key}",
                    str(uuid.uuid4()),
                    px=round(HOLDER_TTL_S * 1000),
                    nx=True,
                )
            if not all(pipe.execute()):
                raise BenchmarkError(f"{raw_key}: a raw holder's key existed already")
            probe.script_load(Floor.NOOP)
            for case in REDIS_CASES:
                on = raw_key if case == RAW_FULL else key
                made = KINDS[case](sem, on, holder)
                if isinstance(made, Floor):
                    made.bind(client, prefix, n)
                measured.append(Measured(made, Result(case, n), wire, server, client))
        interleave(measured, args.samples, args.warmup, args.turn)
    finally:
        for found in probe.scan_iter(match=f"{prefix}*", count=1000):
            probe.delete(found)
        client.close()
        holders_client.close()
    return [m.result for m in measured]


def memory_cases(args: argparse.Namespace) -> list[Result]:
    """The same cases on ``InMemoryBackend`` (no raw holders: only dmutex writes there)."""
    measured: list[Measured] = []
    for n in args.permits:
        backend = InMemoryBackend()
        sem = DSemaphore("semscale", backend, max_permits=n, default_ttl_seconds=TTL_S)
        holder = DSemaphore("semscale", backend, max_permits=n, default_ttl_seconds=TTL_S)
        fill(holder, "k", n - 1)
        for case in MEMORY_CASES:
            measured.append(Measured(KINDS[case](sem, "k", holder), Result(case, n)))
    interleave(measured, args.samples, args.warmup, args.turn)
    return [m.result for m in measured]


def _cell(value: float | int | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_redis(results: Sequence[Result]) -> None:
    print()
    print("Redis: client µs (p50 / p99); server µs per call (INFO commandstats); the longest and")
    print("the median request (SLOWLOG, µs); one call's request size")
    print(
        f"{'case':<27} {'N':>5} {'p50':>8} {'p99':>8} {'server':>8} {'slow max':>9} "
        f"{'slow p50':>9} {'bytes':>7}  requests"
    )
    for r in sorted(results, key=lambda r: (REDIS_CASES.index(r.case), r.permits)):
        fig = r.client
        blocked = r.blocked
        print(
            f"{r.case:<27} {r.permits:5d} {fig.percentile_us(0.5):8.1f} "
            f"{fig.percentile_us(0.99):8.1f} {_cell(r.server_us):>8} "
            f"{_cell(max(blocked) if blocked else None, 0):>9} "
            f"{_cell(statistics.median(blocked) if blocked else None, 0):>9} "
            f"{_cell(r.size, 0):>7}  {'/'.join(map(str, sorted(set(r.requests))))} "
            f"{r.command.upper()}"
        )


def print_memory(results: Sequence[Result]) -> None:
    print()
    print("InMemoryBackend: client µs")
    print(f"{'case':<27} {'N':>5} {'p50':>8} {'p99':>8}")
    for r in sorted(results, key=lambda r: (MEMORY_CASES.index(r.case), r.permits)):
        print(
            f"{r.case:<27} {r.permits:5d} {r.client.percentile_us(0.5):8.1f} "
            f"{r.client.percentile_us(0.99):8.1f}"
        )


def ratios(results: Sequence[Result], where: str) -> tuple[list[Target], list[str]]:
    """p50 at each N over p50 at N=1: the issue's targets, and the other ratios as lines."""
    by = {(r.case, r.permits): r for r in results}
    targets: list[Target] = []
    lines: list[str] = []
    cases = sorted({r.case for r in results}, key=REDIS_CASES.index)
    for case in cases:
        base = by.get((case, 1))
        if base is None:
            continue
        cells = []
        for n in sorted(p for c, p in by if c == case and p != 1):
            r = by[(case, n)]
            ratio = r.client.percentile_us(0.5) / base.client.percentile_us(0.5)
            server = ""
            if r.server_us is not None and base.server_us:
                server = f" (server {r.server_us / base.server_us:.2f}x)"
            cells.append(f"N={n} {ratio:.2f}x{server}")
            if case in TARGETED and n in TARGETS:
                mine, theirs = r.client.percentile_us(0.5), base.client.percentile_us(0.5)
                note = f"{mine:.1f} against {theirs:.1f} µs"
                targets.append(
                    Target(f"{where} {case}, N={n} / N=1", ratio, TARGETS[n], False, note)
                )
        lines.append(f"  {where} {case:<27} " + ", ".join(cells))
    return targets, lines


def bench(url: str, args: argparse.Namespace) -> dict[str, object]:
    run_id = uuid.uuid4().hex[:8]
    probe = redis.Redis.from_url(url)
    try:
        about = machine(probe)
        print(
            f"Redis {about['redis_server']} at {shown(url)}; Python {about['python']}, "
            f"redis-py {about['redis_py']} ({about['redis_py_parser']} parser), "
            f"dmutex from {Path(dmutex.__file__).parent}, {about['cpus']} CPUs; "
            f"max_permits {', '.join(map(str, args.permits))}; {args.samples} samples per case "
            f"in turns of {args.turn}, after {args.warmup} warm-up samples",
            flush=True,
        )
        started = time.monotonic()
        with slowlog_everything(probe) as slowlog:
            on_redis = redis_cases(url, args, run_id, probe, slowlog)
        print("  InMemoryBackend", file=sys.stderr, flush=True)
        in_memory = memory_cases(args)
        elapsed = time.monotonic() - started
    finally:
        probe.close()

    print_redis(on_redis)
    print_memory(in_memory)
    targets, lines = ratios(on_redis, "Redis")
    memory_targets, memory_lines = ratios(in_memory, "memory")
    print()
    print("p50 over N=1's:")
    print("\n".join(lines + memory_lines))
    print()
    print(f"Targets (client p50; {elapsed:.0f} s measuring):")
    for target in targets + memory_targets:
        print(target.line())
    return {
        "machine": about | {"dmutex": str(Path(dmutex.__file__).parent)},
        "config": {
            "permits": args.permits,
            "samples": args.samples,
            "warmup": args.warmup,
            "turn": args.turn,
            "url": shown(url) if args.url else "private redis-server",
            "slowlog": slowlog,
        },
        "redis": [{"case": r.case, "permits": r.permits} | r.summary() for r in on_redis],
        "memory": [{"case": r.case, "permits": r.permits} | r.summary() for r in in_memory],
        "targets": {
            t.name: {"value": t.value, "bound": t.bound, "passed": t.passed}
            for t in targets + memory_targets
        },
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--url", help="use this Redis server instead of starting one")
    parser.add_argument(
        "--server", default=DEFAULT_SERVER, help=f"redis-server to start (default {DEFAULT_SERVER})"
    )
    default_permits = sorted({1, 64, 1024, dmutex.MAX_PERMITS})
    parser.add_argument(
        "--permits",
        type=int,
        nargs="+",
        default=default_permits,
        help=f"the max_permits to measure (default {' '.join(map(str, default_permits))})",
    )
    parser.add_argument("--samples", type=int, default=200, help="measured samples per case")
    parser.add_argument("--warmup", type=int, default=10, help="warm-up samples per case")
    parser.add_argument("--turn", type=int, default=20, help="samples per turn when interleaving")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    args.permits = sorted(set(args.permits))
    if min(args.samples, args.turn) < 1 or args.warmup < 0:
        parser.error("--samples and --turn must be >= 1, --warmup >= 0")
    if not 1 <= args.permits[0] <= args.permits[-1] <= dmutex.MAX_PERMITS:
        parser.error(f"--permits must be from 1 to {dmutex.MAX_PERMITS}")
    return args


def main(argv: list[str] | None = None) -> int:
    return run(bench, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""How close dmutex's Redis lock cycle comes to the two-request limit.

Run from the repository root (a report, not a test; about 20 seconds)::

    .venv/bin/python benchmarks/redis_cycle.py
    .venv/bin/python benchmarks/redis_cycle.py --cycles 4000 --rounds 7 --json out.json
    .venv/bin/python benchmarks/redis_cycle.py --url redis://127.0.0.1:6379/0
    .venv/bin/python benchmarks/redis_cycle.py --server /path/to/redis-server

Without ``--url`` it starts ``redis-server`` (the one on PATH, or ``--server``)
on a free 127.0.0.1 port with persistence off, and stops it by pid at the end.
With ``--url`` it only creates and deletes keys under its own random names.

Everything runs on ONE connection (``single_connection_client=True``), so each
figure is request latency plus client-side Python work. After a warm-up, each
round runs every variant ``--cycles`` times, in interleaved turns of
``--chunk`` cycles, timed with ``time.perf_counter_ns``:

- ``dmutex``: ``DMutex.acquire(key)`` then ``lock.release()``;
- ``redis-py``: ``client.lock(name, timeout=ttl)``, ``acquire(blocking=False)``,
  ``release()`` (redis-py's own ``Lock``, a new one per cycle as in
  ``with client.lock(...)``);
- ``raw``: ``SET key token PX ttl NX`` then ``EVALSHA`` of a compare-and-delete
  script (loaded once), a fresh ``str(uuid.uuid4())`` token per cycle, through
  ``client.execute_command``: the two requests any token lock needs, with no
  library around them;
- ``sem-64`` / ``sem-1``: only the ``acquire()`` of a ``DSemaphore`` with
  ``max_permits=64`` and 63 permits already held (one script trying every
  slot) / with ``max_permits=1`` (one ``SET NX``); the release is not timed.

Targets (from the issue): dmutex >= 0.95x raw ops/s, >= 1.0x redis-py Lock
ops/s (each the median of the per-round ratios), and the N=64 acquire <= 1.3x
the N=1 acquire (p50 and mean, over all samples). Each is
printed as PASS or MISS; the exit code is 0 either way (non-zero only when the
benchmark itself could not run).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.utils import HIREDIS_AVAILABLE

from dmutex import DMutex, DSemaphore, DSemaphorePermit

# Compare-and-delete, as every token lock releases: one atomic script.
RAW_RELEASE = """\
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

START_TIMEOUT_S = 20.0
HOLDER_TTL_S = 3600.0  # the 63 permits held during the whole run

Batch = Callable[[int], list[int]]
"""Run ``n`` measured operations; return each one's duration in ns."""


class BenchmarkError(RuntimeError):
    """The benchmark could not measure what it claims to (a lock was not taken...)."""


# --- a private redis-server ---------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until_up(url: str, process: subprocess.Popen[bytes]) -> None:
    """Ping ``url`` until it answers; fail if the server exits or takes too long."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise BenchmarkError(f"redis-server exited with code {process.returncode}")
        try:
            with redis.Redis.from_url(url, socket_timeout=2) as probe:
                probe.ping()
                return
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@contextmanager
def private_server(binary: str) -> Iterator[str]:
    """Run ``binary`` on a free loopback port, persistence off; yield its URL."""
    path = shutil.which(binary) or binary
    if not Path(path).is_file():
        raise BenchmarkError(f"no redis-server at {binary!r} (use --server PATH or --url URL)")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="dmutex-bench-") as workdir:
        command = [
            path,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
        ]
        process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=workdir
        )
        try:
            url = f"redis://127.0.0.1:{port}/0"
            wait_until_up(url, process)
            yield url
        finally:
            process.terminate()  # this process only, by its pid
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


def shown(url: str) -> str:
    """``url`` without its password, for printing and the JSON file."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


# --- the measured operations ----------------------------------------------------------


def dmutex_cycle(mutex: DMutex, key: str) -> Batch:
    """``mutex.acquire(key)`` then ``lock.release()``."""

    def run(n: int) -> list[int]:
        samples = [0] * n
        clock = time.perf_counter_ns
        for i in range(n):
            start = clock()
            lock = mutex.acquire(key)
            if lock is None or not lock.release():
                raise BenchmarkError("dmutex: uncontended acquire/release failed")
            samples[i] = clock() - start
        return samples

    return run


def redis_py_cycle(client: redis.Redis, name: str, ttl_s: float) -> Batch:
    """redis-py's ``Lock``: ``acquire(blocking=False)`` then ``release()``."""

    def run(n: int) -> list[int]:
        samples = [0] * n
        clock = time.perf_counter_ns
        for i in range(n):
            start = clock()
            lock = client.lock(name, timeout=ttl_s)
            if not lock.acquire(blocking=False):
                raise BenchmarkError("redis-py Lock: uncontended acquire failed")
            lock.release()  # raises LockNotOwnedError if it was not ours
            samples[i] = clock() - start
        return samples

    return run


def raw_cycle(client: redis.Redis, key: str, ttl_ms: int, sha: str) -> Batch:
    """``SET key token PX ttl NX`` then ``EVALSHA`` compare-and-delete."""

    def run(n: int) -> list[int]:
        samples = [0] * n
        clock = time.perf_counter_ns
        # redis-py leaves execute_command unannotated; its reply is any RESP value.
        execute: Callable[..., object] = client.execute_command
        for i in range(n):
            start = clock()
            token = str(uuid.uuid4())
            taken = execute("SET", key, token, "PX", ttl_ms, "NX")
            if not taken or execute("EVALSHA", sha, 1, key, token) != 1:
                raise BenchmarkError("raw: uncontended SET NX / compare-and-delete failed")
            samples[i] = clock() - start
        return samples

    return run


def semaphore_acquire(sem: DSemaphore, key: str, slot: int) -> Batch:
    """``sem.acquire(key)`` alone; the release happens outside the timed region."""

    def run(n: int) -> list[int]:
        samples = [0] * n
        clock = time.perf_counter_ns
        for i in range(n):
            start = clock()
            permit = sem.acquire(key)
            samples[i] = clock() - start
            if permit is None or permit.slot != slot or not permit.release():
                raise BenchmarkError(f"semaphore: acquire did not get the free slot {slot}")
        return samples

    return run


# --- statistics -----------------------------------------------------------------------


@dataclass
class Figures:
    """Every sample of one variant, and each round's throughput."""

    samples: list[int] = field(default_factory=list)
    round_ops: list[float] = field(default_factory=list)

    def add(self, batch: list[int]) -> None:
        self.samples.extend(batch)
        self.round_ops.append(len(batch) / (sum(batch) / 1e9))

    @property
    def ops_per_s(self) -> float:
        """Operations per second of time spent inside the timed regions."""
        return len(self.samples) / (sum(self.samples) / 1e9)

    def percentile_us(self, q: float) -> float:
        """Nearest-rank percentile, in µs."""
        ordered = sorted(self.samples)
        index = max(0, math.ceil(q * len(ordered)) - 1)
        return ordered[index] / 1000

    @property
    def mean_us(self) -> float:
        return sum(self.samples) / len(self.samples) / 1000

    def summary(self) -> dict[str, float | list[float]]:
        return {
            "ops_per_s": self.ops_per_s,
            "p50_us": self.percentile_us(0.50),
            "p99_us": self.percentile_us(0.99),
            "mean_us": self.mean_us,
            "round_ops_per_s": self.round_ops,
        }


@dataclass(frozen=True)
class Target:
    """One ratio and the bound the issue sets for it."""

    name: str
    value: float
    bound: float
    at_least: bool  # True: value >= bound passes; False: value <= bound passes
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.value >= self.bound if self.at_least else self.value <= self.bound

    def line(self) -> str:
        sign = ">=" if self.at_least else "<="
        verdict = "PASS" if self.passed else "MISS"
        line = f"  {verdict}  {self.name:<34} {self.value:6.3f}  (target {sign} {self.bound})"
        return f"{line}\n        {self.note}" if self.note else line


def throughput_target(name: str, mine: Figures, other: Figures, bound: float) -> Target:
    """``mine`` / ``other`` in ops/s: the median of the per-round ratios.

    The rounds interleave the variants, so each round's ratio compares them
    under the same load; the median keeps one round that a burst of load from
    elsewhere hit from deciding the verdict. The overall ratio is shown beside it.
    """
    ratios = sorted(m / o for m, o in zip(mine.round_ops, other.round_ops, strict=True))
    note = (
        f"overall {mine.ops_per_s / other.ops_per_s:.3f}, per round {ratios[0]:.3f} .. "
        f"{ratios[-1]:.3f}, by p50 latency "
        f"{other.percentile_us(0.5) / mine.percentile_us(0.5):.3f}"
    )
    return Target(name, statistics.median(ratios), bound, at_least=True, note=note)


# --- the run --------------------------------------------------------------------------


def measure(
    variants: dict[str, Batch], *, cycles: int, rounds: int, warmup: int, chunk: int
) -> dict[str, Figures]:
    """Warm every variant up, then run them interleaved.

    Each round runs every variant ``cycles`` times, in turns of ``chunk``
    cycles (the order rotating each turn), so that a burst of load from
    elsewhere on the machine falls on all variants rather than on one.
    """
    names = list(variants)
    for name in names:
        variants[name](warmup)
    figures = {name: Figures() for name in names}
    for r in range(rounds):
        batches: dict[str, list[int]] = {name: [] for name in names}
        done, turn = 0, 0
        while done < cycles:
            n = min(chunk, cycles - done)
            shift = turn % len(names)
            for name in names[shift:] + names[:shift]:
                gc.collect()  # one variant's garbage is not collected on another's clock
                batches[name].extend(variants[name](n))
            done, turn = done + n, turn + 1
        for name in names:
            figures[name].add(batches[name])
        print(f"  round {r + 1}/{rounds} done", file=sys.stderr)
    return figures


def machine(client: redis.Redis) -> dict[str, str | int | None]:
    """What the figures were measured on."""
    info = client.info("server")
    parser = "hiredis" if HIREDIS_AVAILABLE else "python"
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "redis_server": str(info["redis_version"]),
        "redis_py": redis.__version__,
        "redis_py_parser": parser,
    }


def bench(url: str, args: argparse.Namespace) -> dict[str, object]:
    """Measure every variant against the server at ``url``; print and return the figures."""
    run_id = uuid.uuid4().hex[:8]
    ttl_s: float = args.ttl
    ttl_ms = math.ceil(ttl_s * 1000)
    client = redis.Redis.from_url(url, single_connection_client=True)
    holders: list[DSemaphorePermit] = []
    try:
        sha = client.script_load(RAW_RELEASE)
        if sha != hashlib.sha1(RAW_RELEASE.encode()).hexdigest():
            raise BenchmarkError(f"SCRIPT LOAD returned {sha!r}")
        mutex = DMutex(f"bench-{run_id}", client, default_ttl_seconds=ttl_s)
        sem64 = DSemaphore(f"bench64-{run_id}", client, max_permits=64, default_ttl_seconds=ttl_s)
        sem1 = DSemaphore(f"bench1-{run_id}", client, max_permits=1, default_ttl_seconds=ttl_s)
        for _ in range(63):
            permit = sem64.acquire("k", ttl=HOLDER_TTL_S)
            if permit is None:
                raise BenchmarkError("could not take the 63 held semaphore permits")
            holders.append(permit)

        variants: dict[str, Batch] = {
            "dmutex": dmutex_cycle(mutex, "k"),
            "redis-py": redis_py_cycle(client, f"_redispy_bench-{run_id}:k", ttl_s),
            "raw": raw_cycle(client, f"_raw_bench-{run_id}:permit:0:k", ttl_ms, sha),
            "sem-64": semaphore_acquire(sem64, "k", slot=63),
            "sem-1": semaphore_acquire(sem1, "k", slot=0),
        }
        about = machine(client)
        print(
            f"Redis {about['redis_server']} at {shown(url)}; Python {about['python']}, "
            f"redis-py {about['redis_py']} ({about['redis_py_parser']} parser), "
            f"{about['cpus']} CPUs; {args.rounds} rounds x {args.cycles} cycles "
            f"in turns of {args.chunk}, after {args.warmup} warm-up cycles, one connection",
            flush=True,
        )
        figures = measure(
            variants,
            cycles=args.cycles,
            rounds=args.rounds,
            warmup=args.warmup,
            chunk=args.chunk,
        )
    finally:
        for permit in holders:
            permit.release()
        client.close()

    print()
    print(f"{'variant':<10} {'ops/s':>9} {'p50 µs':>8} {'p99 µs':>8} {'mean µs':>8}  rounds ops/s")
    for name, fig in figures.items():
        spread = f"{min(fig.round_ops):.0f}..{max(fig.round_ops):.0f}"
        print(
            f"{name:<10} {fig.ops_per_s:9.0f} {fig.percentile_us(0.5):8.1f} "
            f"{fig.percentile_us(0.99):8.1f} {fig.mean_us:8.1f}  {spread}"
        )
    print("(dmutex, redis-py, raw: one acquire+release cycle; sem-64, sem-1: acquire only)")

    dm, rp, raw = figures["dmutex"], figures["redis-py"], figures["raw"]
    s64, s1 = figures["sem-64"], figures["sem-1"]
    targets = [
        throughput_target("DMutex / raw (ops/s)", dm, raw, 0.95),
        throughput_target("DMutex / redis-py Lock (ops/s)", dm, rp, 1.0),
        Target(
            "N=64 / N=1 acquire time (p50)",
            s64.percentile_us(0.5) / s1.percentile_us(0.5),
            1.3,
            at_least=False,
        ),
        Target("N=64 / N=1 acquire time (mean)", s64.mean_us / s1.mean_us, 1.3, at_least=False),
    ]
    print()
    print("Targets (ops/s ratios: median of the per-round ratios):")
    for target in targets:
        print(target.line())

    return {
        "machine": about,
        "config": {
            "cycles": args.cycles,
            "rounds": args.rounds,
            "chunk": args.chunk,
            "warmup": args.warmup,
            "ttl_s": ttl_s,
            "url": shown(url) if args.url else "private redis-server",
        },
        "variants": {name: fig.summary() for name, fig in figures.items()},
        "targets": {
            t.name: {"value": t.value, "bound": t.bound, "passed": t.passed, "note": t.note}
            for t in targets
        },
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--url", help="use this Redis server instead of starting one")
    parser.add_argument(
        "--server", default="redis-server", help="redis-server binary to start (default: on PATH)"
    )
    parser.add_argument("--cycles", type=int, default=2000, help="cycles per variant per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument(
        "--chunk", type=int, default=100, help="cycles per turn when interleaving in a round"
    )
    parser.add_argument("--warmup", type=int, default=500, help="warm-up cycles per variant")
    parser.add_argument("--ttl", type=float, default=30.0, help="lease TTL in seconds")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if min(args.cycles, args.rounds, args.chunk) < 1 or args.warmup < 0 or not args.ttl > 0:
        parser.error("--cycles, --rounds and --chunk must be >= 1, --warmup >= 0, --ttl > 0")
    return args


def run(measure: Callable[[str, argparse.Namespace], object], args: argparse.Namespace) -> int:
    """Run ``measure(url, args)`` on ``--url`` or a private server; write ``--json``; exit code.

    Shared by the benchmarks here: 2 when the run failed, else 0 (a report,
    not a test: a missed target is printed, not an error).
    """
    try:
        if args.url:
            report = measure(args.url, args)
        else:
            with private_server(args.server) as url:
                report = measure(url, args)
    except (BenchmarkError, redis.RedisError, OSError) as error:
        print(f"benchmark failed: {error}", file=sys.stderr)
        return 2
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"figures written to {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(bench, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

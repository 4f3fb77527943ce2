"""What observing costs a lock's uncontended cycle: without OpenTelemetry, with its API, recording.

Run from the repository root (a report, not a test; about a minute)::

    .venv/bin/python benchmarks/observe_cost.py
    .venv/bin/python benchmarks/observe_cost.py --quick --json out.json
    .venv/bin/python benchmarks/observe_cost.py --url redis://127.0.0.1:6379/0

``DMutex.acquire`` then ``release`` of one key, on ``InMemoryBackend`` and
on one Redis server (7.0 when the test harness finds it, else the newest it
finds, started and stopped here; ``--redis`` names others, one after another;
``--url`` one of your own, on which it works under its own service names),
three contenders on each, interleaved in turns (``harness.interleave``):

- ``none``: a lock without the OpenTelemetry observer, as every lock is when
  ``opentelemetry-api`` is not installed (its logging observer only, the
  ``dmutex`` loggers below DEBUG);
- ``api``: a lock with its default observers while the API is installed and
  no SDK is configured (this process sets no global provider);
- ``sdk``: a lock whose OpenTelemetry observer records through an SDK
  ``MeterProvider`` (an in-memory reader, collected at the end) and
  ``TracerProvider`` (no span processor: plain acquires make no span).

The ratios ``api / none`` and ``sdk / none`` per backend (the median of the
per-round ratios). Target (issue 29): ``api / none`` at most 1.03 at p50 on
both; the recording cost is reported, no target.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Sequence
from typing import Any

import harness
import redis
from harness import Batch, BenchmarkError, Target
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from redis_cycle import timed

import dmutex._observers.otel as otel
from dmutex import DMutex, InMemoryBackend, OpenTelemetryObserver

OPTIONS = {  # name: (default, under --quick)
    "cycles": (3000, 200), "rounds": (7, 2), "chunk": (100, 50), "warmup": (500, 50),
}  # fmt: skip
CONTENDERS = ("none", "api", "sdk")


def cycle(mutex: DMutex, name: str) -> Batch:
    def run() -> None:
        lock = mutex.acquire("k", 30)
        if lock is None or not lock.release():
            raise BenchmarkError(f"{name}: uncontended acquire/release failed")

    return timed(run)


def locks(client: Any, run_id: str) -> dict[str, DMutex]:
    """The three contenders' locks on ``client``, each under a service of its own."""
    available = otel.available
    otel.available = lambda: False  # as without the package: no OpenTelemetry observer
    try:
        none = DMutex(f"none_{run_id}", client)
    finally:
        otel.available = available
    api = DMutex(f"api_{run_id}", client)
    if not otel.available() or api._engine._listened():
        raise BenchmarkError("the API must be installed and no SDK configured in this process")
    recording = OpenTelemetryObserver(
        meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()]),
        tracer_provider=TracerProvider(),
    )
    sdk = DMutex(f"sdk_{run_id}", client, observers=[recording])
    return {"none": none, "api": api, "sdk": sdk}


def bench(url: str, args: argparse.Namespace) -> dict[str, object]:
    run_id = uuid.uuid4().hex[:8]
    contenders: dict[str, Batch] = {}
    for name, mutex in locks(InMemoryBackend(), run_id).items():
        contenders[f"memory {name}"] = cycle(mutex, f"memory {name}")
    client = redis.Redis.from_url(url)
    try:
        for name, mutex in locks(client, run_id).items():
            contenders[f"redis {name}"] = cycle(mutex, f"redis {name}")
        print(
            f"{args.rounds} rounds x {args.cycles} cycles in turns of {args.chunk}, "
            f"after {args.warmup} warm-up cycles",
            flush=True,
        )
        figures = harness.interleave(
            contenders,
            rounds=args.rounds,
            per_round=args.cycles,
            turn=args.chunk,
            warmup=args.warmup,
        )
    finally:
        client.close()
    harness.figures_table(figures, "Acquire + release, one key (µs)")
    pairs = [
        (f"{backend} {name}", f"{backend} none")
        for backend in ("memory", "redis")
        for name in ("api", "sdk")
    ]
    ratios = harness.ratio_table(figures, pairs, ("p50", "mean", "ops/s"))
    targets = [
        Target(
            f"API, no SDK / none, {backend} (p50)",
            ratios[f"{backend} api / {backend} none, p50"].median,
            1.03,
            False,
        )
        for backend in ("memory", "redis")
    ]
    harness.targets_table(targets)
    return {"figures": figures, "ratios": ratios, "targets": targets}


def run(argv: Sequence[str] | None = None) -> int:
    args = harness.parse(__doc__, argv, OPTIONS)
    if not args.url and not args.redis:
        args.redis = harness.one_redis("7.0")
    return harness.main(bench, args)


if __name__ == "__main__":
    sys.exit(run())

"""The benchmarks' harness: servers, interleaved rounds, ratio tables, ``--json``.

Every benchmark here is a script run from the repository root
(``.venv/bin/python benchmarks/<name>.py``) built on this module. Its rules:

- Servers: each Redis version the test harness finds (``tests/_support``:
  ``REDIS_URL``, Docker, or ``redis-server`` executables), or the versions
  ``--redis`` names, one after another, each started for its run and stopped
  by pid after it (a benchmark may default to one of them: :func:`one_redis`);
  or the one server ``--url`` names, never started or stopped, on which a
  benchmark works under its own random names. A PostgreSQL benchmark
  (``parse(..., postgres=True)``) runs on the server the test harness finds
  (``DMUTEX_POSTGRESQL_URL``, Docker, or ``initdb`` and ``postgres``
  executables), started for the run and stopped by pid after it, or on the
  one ``--postgres-url`` names; either way in a schema of its own
  (``dmutex_bench_<random>``) on the search path, dropped at the end. A
  benchmark of another server may bring its own (:func:`main`'s ``server``,
  with ``parse(..., url=...)`` for its ``--url``); one of several kinds
  of server (``lean_paths.py``) brings each itself (:func:`main`'s
  ``several``). Only
  :func:`redis_servers`, :func:`one_redis`, :func:`postgres_server` and such
  a benchmark's own server know the test harness.
- Interleaving (:func:`interleave`): contenders take turns within each round,
  the order rotating each turn, ``gc.collect()`` before each turn, so that a
  burst of load from elsewhere on a shared machine falls on all of them.
- Ratios (:func:`ratio_table`): a contender's statistic over its baseline's,
  per round; the median over the rounds, their spread (least .. most) and the
  ratio of the pooled samples. Figures, not verdicts; the issues' targets
  print as ``PASS`` or ``MISS`` beside them (:class:`Target`).
- ``--json FILE``: the machine, the options, and per server everything the
  benchmark returned, raw samples (ns, round by round) beside their summaries.
- Exit code: 0 after a run, whatever the figures; 2 when the benchmark could
  not measure what it claims to (:class:`BenchmarkError`, a Redis, PostgreSQL or OS error).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import multiprocessing
import os
import platform
import queue
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
import redis
import redis.asyncio
from redis.utils import HIREDIS_AVAILABLE

import dmutex

# dmutex's internals the benchmarks read: the Lua scripts' SHA1s (handoff.py
# tells its SLOWLOG entries apart by them). A move inside src/ changes this line.
from dmutex._backends.redis.scripts import ACQUIRE, MUTEX_RELEASE, RELEASE

# A waiting attempt runs ACQUIRE; a mutex releases by MUTEX_RELEASE.
SCRIPT_SHAS = {"acquire": ACQUIRE.sha, "release": RELEASE.sha, "mutex-release": MUTEX_RELEASE.sha}
ROOT = Path(__file__).resolve().parent.parent
WORKER_TIMEOUT_S = 120.0  # the longest the parent waits for a worker's answer


class BenchmarkError(RuntimeError):
    """The benchmark could not measure what it claims to (a lock was not taken...)."""


# --- servers --------------------------------------------------------------------------


def redis_servers(versions: Sequence[str]) -> Generator[tuple[str, str], None, None]:
    """``(label, url)`` of each Redis server the test harness finds, or of ``versions``.

    Each server starts when it is reached and stops (by pid) when the loop
    moves on or the generator is closed. With :func:`one_redis`, the one
    place that imports ``tests._support.redis_servers``.
    """
    _test_harness()
    from tests._support.redis_servers import discovered

    found = discovered()
    sources = [
        s for s in found.sources if not versions or s.label.removeprefix("redis-") in versions
    ]
    if not sources:
        raise BenchmarkError(found.reason or f"no Redis {versions} among {found.labels}")
    for source in sources:
        server = source.start()
        try:
            yield source.label, server.url
        finally:
            source.stop()


def one_redis(preferred: str) -> list[str]:
    """``[preferred]`` when the test harness finds that Redis version, else the newest it finds.

    For a benchmark that runs on one server unless ``--redis`` names others;
    ``[]`` (every server: :func:`redis_servers` then says why there is none) when it finds none.
    """
    _test_harness()
    from tests._support.redis_servers import discovered

    found = [label.removeprefix("redis-") for label in discovered().labels]
    return [preferred] if preferred in found else found[-1:]


def _test_harness() -> None:
    if str(ROOT) not in sys.path:  # run as a script: sys.path[0] is benchmarks/
        sys.path.insert(0, str(ROOT))


@contextmanager
def postgres_server(url: str) -> Iterator[tuple[str, str]]:
    """``(label, url)`` of ``url``'s server or the test harness's, in a fresh schema of its own.

    Without ``url`` the server the tests find starts here and stops (by pid)
    on the way out. The URL yielded puts the schema on the search path
    (``options=-csearch_path=...``); the schema is dropped on the way out.
    """
    if not url:
        _test_harness()
        from tests._support.postgres_servers import new_session

        session = new_session()
        try:
            if not session.discovery.sources:
                raise BenchmarkError(session.discovery.reason or "no PostgreSQL server found")
            found = session.server()
            with postgres_server(found.url) as (_, inside):
                yield found.label, inside
        finally:
            session.close()
        return
    schema = f"dmutex_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(url, autocommit=True) as conn:
        version = str((conn.execute("SHOW server_version").fetchone() or ("?",))[0])
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        joiner = "&" if "?" in url else "?"
        yield (
            f"postgresql-{version.split()[0]}",
            f"{url}{joiner}options={quote(f'-csearch_path={schema}')}",
        )
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


def postgres_settings(url: str) -> dict[str, str]:
    """The settings a PostgreSQL figure depends on, printed and returned.

    A commit that waits for the disk (``fsync``, ``synchronous_commit``) is
    slower, and makes the notification queue's lock held longer.
    """
    with psycopg.connect(url, autocommit=True) as conn:
        settings = {
            name: str((conn.execute(f"SHOW {name}").fetchone() or ("?",))[0])
            for name in ("server_version", "fsync", "synchronous_commit")
        }
    print(f"settings: {settings}", flush=True)
    return settings


def shown(url: str) -> str:
    """``url`` without its password, for printing and the JSON file."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}"
    return urlunsplit(parts._replace(netloc=netloc + (f":{parts.port}" if parts.port else "")))


# --- options and the run --------------------------------------------------------------

Option = tuple[Any, Any]
"""An option's default and its default under ``--quick``; the docstring says what it is."""


def parse(
    doc: str | None,
    argv: Sequence[str] | None,
    options: Mapping[str, Option],
    *,
    redis: bool = True,
    postgres: bool = False,
    url: str = "",
    more: Callable[[argparse.ArgumentParser], object] | None = None,
) -> argparse.Namespace:
    """The common options (``--url``, ``--redis``, ``--quick``, ``--json``) and ``options``.

    ``redis=False``: no Redis options; ``postgres=True``: ``--postgres-url``
    (the benchmark then runs on PostgreSQL, :func:`postgres_server`);
    ``url`` (with ``redis=False``): ``--url``, with that help, for the
    server of a benchmark that brings its own (:func:`main`'s ``server``);
    ``more(parser)``: adds the benchmark's own options that ``options``
    cannot say (a choice, a repeatable one, a string), after the common ones.

    ``--help`` shows the script's docstring, which says what each option is.
    An option's type is its default's (a list: one or more values); every
    number must be positive, a ``warmup`` one may be 0.
    """
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if redis:
        parser.add_argument("--url", help="measure this Redis server instead (its own keys only)")
        parser.add_argument(
            "--redis", nargs="+", default=[], metavar="VERSION", help="Redis versions (all found)"
        )
    if url and not redis:
        parser.add_argument("--url", default="", help=url)
    if postgres:
        parser.add_argument(
            "--postgres-url",
            default="",
            help="measure this PostgreSQL server (a schema of its own)",
        )
    parser.add_argument("--quick", action="store_true", help="a smoke run: small counts")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    if more is not None:
        more(parser)
    for name, (full, quick) in options.items():
        many = isinstance(full, list)
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=type(full[0] if many else full),
            nargs="+" if many else None,
            help=f"default {full}; --quick {quick}",
        )
    args = parser.parse_args(argv)
    for name, (full, quick) in options.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
        value = getattr(args, name)
        least = 0 if name.startswith("warmup") else 1e-9
        if (
            not isinstance(value, str)
            and min(value if isinstance(value, list) else [value]) < least
        ):
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


Bench = Callable[[str, argparse.Namespace], Mapping[str, object]]
Server = Callable[[], AbstractContextManager[tuple[str, str]]]
"""A benchmark's own server: a context that yields its ``(label, url)`` and stops it after."""


def main(
    bench: Bench,
    args: argparse.Namespace,
    *,
    server: Server | None = None,
    errors: tuple[type[Exception], ...] = (),
    several: bool = False,
) -> int:
    """Run ``bench(url, args)`` on each server (url "" without one); write ``--json``.

    ``server``: the one server of a benchmark that brings its own, whatever
    ``args`` says; ``errors``: its client's exceptions, which end the run
    with status 2 as a Redis or PostgreSQL error does; ``several``: a
    benchmark that finds, starts and stops its servers itself, several kinds
    of them: ``bench("", args)`` returns its runs by name.
    """
    report: dict[str, object] = {"machine": machine(), "options": vars(args)}
    runs: dict[str, object] = {}
    caught: tuple[type[Exception], ...] = (
        BenchmarkError,
        redis.RedisError,
        psycopg.Error,
        OSError,
        *errors,
    )
    try:
        if several:
            runs.update(bench("", args))
        elif server is not None:
            with server() as (label, url):
                print(f"\n## {label} ({shown(url)})\n", flush=True)
                runs[label] = {"url": shown(url), **bench(url, args)}
        elif hasattr(args, "postgres_url"):
            with postgres_server(args.postgres_url) as (label, url):
                print(f"\n## {label} ({shown(url)})\n", flush=True)
                runs[label] = {"url": shown(url), **bench(url, args)}
        elif not hasattr(args, "url"):
            runs["local"] = bench("", args)
        elif args.url:
            runs["url"] = run_on("url", args.url, bench, args)
        else:
            with closing(redis_servers(args.redis)) as servers:
                for label, url in servers:
                    runs[label] = run_on(label, url, bench, args)
    except caught as error:
        print(f"benchmark failed: {error}", file=sys.stderr)
        return 2
    report["runs"] = runs
    print(f"\nLoad average at the end: {os.getloadavg()[0]:.2f} (1 min)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=jsonable) + "\n")
        print(f"figures written to {args.json}")
    return 0


def run_on(label: str, url: str, bench: Bench, args: argparse.Namespace) -> dict[str, object]:
    with redis.Redis.from_url(url) as client:
        version = str(client.info("server")["redis_version"])
    print(f"\n## Redis {version} ({label}, {shown(url)})\n", flush=True)
    return {"redis_server": version, "url": shown(url), **bench(url, args)}


def machine() -> dict[str, object]:
    """What the figures were measured on."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
        "redis_py": redis.__version__,
        "redis_py_parser": "hiredis" if HIREDIS_AVAILABLE else "python",
        "psycopg": psycopg.__version__,
        "dmutex": str(Path(dmutex.__file__).parent),
    }


def jsonable(value: object) -> object:
    """``json.dumps``'s fallback: figures with their summary, dataclasses, sets, paths."""
    if isinstance(value, Figures):
        return value.summary() | {"rounds_ns": value.rounds}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, set | frozenset):
        return sorted(value)
    return str(value)


def progress(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


# --- figures and interleaved rounds ----------------------------------------------------


def quantile(values: Iterable[float], q: float) -> float:
    """Nearest-rank quantile; NaN for no values."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else math.nan


STATISTICS: dict[str, Callable[[Sequence[int]], float]] = {
    "p50": lambda ns: quantile(ns, 0.5),
    "p99": lambda ns: quantile(ns, 0.99),
    "mean": lambda ns: sum(ns) / len(ns),
    "max": lambda ns: max(ns),
    "ops/s": lambda ns: len(ns) * 1e9 / sum(ns),
}


@dataclass
class Figures:
    """One contender's durations in ns, round by round."""

    rounds: list[list[int]] = field(default_factory=list)

    @property
    def samples(self) -> list[int]:
        return [ns for batch in self.rounds for ns in batch]

    def us(self, statistic: str) -> float:
        """``statistic`` ("p50", "p99", "mean", "max") of all samples, in µs."""
        samples = self.samples
        return STATISTICS[statistic](samples) / 1000 if samples else math.nan

    @property
    def ops_per_s(self) -> float:
        """Operations per second of time spent in them."""
        samples = self.samples
        return STATISTICS["ops/s"](samples) if samples else math.nan

    @property
    def round_ops(self) -> list[float]:
        return [STATISTICS["ops/s"](batch) for batch in self.rounds if batch]

    def summary(self) -> dict[str, object]:
        times = {f"{name}_us": self.us(name) for name in ("p50", "p99", "mean", "max")}
        return {
            "samples": len(self.samples),
            "ops_per_s": self.ops_per_s,
            **times,
            "round_ops_per_s": self.round_ops,
        }


Batch = Callable[[int], list[int]]
"""Run ``n`` measured operations; return each one's duration in ns."""


def interleave(
    contenders: Mapping[str, Batch], *, rounds: int, per_round: int, turn: int, warmup: int = 0
) -> dict[str, Figures]:
    """Warm every contender up, then run ``rounds`` rounds of ``per_round`` each.

    A round runs the contenders in turns of ``turn`` operations, the order
    rotating each turn (counted across rounds), ``gc.collect()`` before each
    turn so that no contender's garbage is collected on another's clock.
    """
    names = list(contenders)
    if warmup:
        for name in names:
            contenders[name](warmup)
    figures = {name: Figures() for name in names}
    turns = 0
    for r in range(rounds):
        batches: dict[str, list[int]] = {name: [] for name in names}
        done = 0
        while done < per_round:
            n, shift = min(turn, per_round - done), turns % len(names)
            for name in names[shift:] + names[:shift]:
                gc.collect()
                batches[name].extend(contenders[name](n))
            done, turns = done + n, turns + 1
        for name in names:
            figures[name].rounds.append(batches[name])
        if rounds > 1:
            progress(f"round {r + 1}/{rounds} done")
    return figures


# --- tables, ratios, targets ----------------------------------------------------------


def cell(value: object) -> str:
    """A figure as a table shows it: about four significant digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        digits = 0 if abs(value) >= 1000 else 1 if abs(value) >= 100 else 2 if value >= 10 else 3
        return f"{value:.{digits}f}"
    return str(value)


def table(head: Sequence[str], rows: Iterable[Sequence[object]], title: str = "") -> None:
    """Print a Markdown table, its columns padded; columns of figures right-aligned."""
    body = [[cell(v) for v in row] for row in rows]
    cells = [list(head), *body]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    right = [all(is_figure(row[i]) for row in body) for i in range(len(head))]

    def line(row: Sequence[str]) -> str:
        padded = (
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right, strict=True)
        )
        return "| " + " | ".join(padded) + " |"

    rule = ["-" * (w - 1) + ":" if r else "-" * w for w, r in zip(widths, right, strict=True)]
    print(f"\n{title}" if title else "")
    print("\n".join([line(head), line(rule), *map(line, body)]), flush=True)


def is_figure(text: str) -> bool:
    try:
        float(text.replace(",", "").split(" ")[0])
    except ValueError:
        return text == "-"
    return True


def figures_table(figures: Mapping[str, Figures], title: str = "") -> None:
    """Each contender's ops/s, p50 / p99 / mean µs and its rounds' ops/s."""

    def spread(fig: Figures) -> str:
        ops = fig.round_ops
        return f"{min(ops):.0f} .. {max(ops):.0f}" if ops else "-"

    times = ("p50", "p99", "mean")
    rows = [
        [n, len(f.samples), f.ops_per_s, *map(f.us, times), spread(f)] for n, f in figures.items()
    ]
    head = ["contender", "samples", "ops/s", "p50 µs", "p99 µs", "mean µs", "rounds' ops/s"]
    table(head, rows, title)


@dataclass(frozen=True)
class Ratio:
    """``contender``'s ``statistic`` over ``baseline``'s: per round, and of the pooled samples."""

    contender: str
    baseline: str
    statistic: str
    per_round: list[float]
    pooled: float

    @property
    def median(self) -> float:
        return statistics.median(self.per_round) if self.per_round else math.nan


def ratio(figures: Mapping[str, Figures], contender: str, baseline: str, statistic: str) -> Ratio:
    """The ratio of two contenders' figures, round by round (rounds run together)."""
    of = STATISTICS[statistic]
    mine, theirs = figures[contender], figures[baseline]
    pairs = zip(mine.rounds, theirs.rounds, strict=True)
    per_round = [of(a) / of(b) for a, b in pairs if a and b]
    return Ratio(contender, baseline, statistic, per_round, of(mine.samples) / of(theirs.samples))


def ratio_table(
    figures: Mapping[str, Figures],
    pairs: Iterable[tuple[str, str]],
    statistics_: Sequence[str] = ("p50", "mean"),
    title: str = "Ratios (contender / baseline):",
) -> dict[str, Ratio]:
    """Print and return each pair's ratios, keyed ``"contender / baseline, statistic"``."""
    found = {f"{a} / {b}, {s}": ratio(figures, a, b, s) for a, b in pairs for s in statistics_}
    spreads = [
        (min(r.per_round, default=math.nan), max(r.per_round, default=math.nan))
        for r in found.values()
    ]
    rows = [
        [r.contender, r.baseline, r.statistic, r.median, *spread, r.pooled, len(r.per_round)]
        for r, spread in zip(found.values(), spreads, strict=True)
    ]
    head = [
        "contender",
        "baseline",
        "statistic",
        "median of rounds",
        "least",
        "most",
        "pooled",
        "rounds",
    ]
    table(head, rows, title)
    return found


@dataclass(frozen=True)
class Target:
    """A figure and the bound an issue set for it."""

    name: str
    value: float
    bound: float
    at_least: bool  # True: value >= bound passes; False: value <= bound passes

    @property
    def passed(self) -> bool:
        return self.value >= self.bound if self.at_least else self.value <= self.bound


def targets_table(targets: Sequence[Target]) -> None:
    verdicts = [("PASS" if t.passed else "MISS", ">=" if t.at_least else "<=") for t in targets]
    rows = [
        [t.name, t.value, f"{sign} {t.bound}", v]
        for t, (v, sign) in zip(targets, verdicts, strict=True)
    ]
    table(["target", "value", "bound", "verdict"], rows, "Targets:")


# --- the server's side ----------------------------------------------------------------


def commandstats(info: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """``INFO commandstats`` as ``{"evalsha": (calls, usec)}`` (a script's commands included)."""
    return {
        name.removeprefix("cmdstat_"): (int(stat["calls"]), int(stat["usec"]))
        for name, stat in info.items()
        if name.startswith("cmdstat_")
    }


def cpu_seconds(info: Mapping[str, Any]) -> float:
    """The server's CPU seconds so far (``INFO cpu``: user + system, all threads)."""
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def server_counters(client: redis.Redis) -> tuple[dict[str, tuple[int, int]], float]:
    """``INFO commandstats`` and ``INFO cpu``, parsed."""
    return commandstats(client.info("commandstats")), cpu_seconds(client.info("cpu"))


def delete_keys(url: str, pattern: str) -> None:
    """Delete every key matching ``pattern`` (``SCAN``, then ``UNLINK`` by the thousand)."""
    with redis.Redis.from_url(url) as client:
        names = list(client.scan_iter(match=pattern, count=1000))
        for i in range(0, len(names), 1000):
            client.unlink(*names[i : i + 1000])


@contextmanager
def slowlog_everything(client: redis.Redis, length: int) -> Iterator[bool]:
    """Log every command (``SLOWLOG``, threshold 0, ``length`` kept); settings restored after.

    Yields False, changing nothing, when the server refuses ``CONFIG``.
    """
    try:
        old = client.config_get("slowlog-*")
        client.config_set("slowlog-max-len", length)
        client.config_set("slowlog-log-slower-than", 0)
        client.slowlog_reset()
    except redis.ResponseError as error:
        progress(f"no SLOWLOG figures: {error}")
        yield False
        return
    try:
        yield True
    finally:
        for name in ("slowlog-log-slower-than", "slowlog-max-len"):
            value = old.get(name)
            if value is not None:
                client.config_set(name, value)


Request = tuple[tuple[object, ...], float, float]
"""A request's arguments, ``perf_counter()`` before it was sent and after its reply."""


def trace_requests(client: redis.Redis | redis.asyncio.Redis) -> list[Request]:
    """Note every request ``client`` sends from now on (``execute_command``'s and pipelines').

    Install it before handing the client to dmutex, which binds the methods;
    it costs two clock reads and an append per request. A pipeline is one
    request, noted as ``("PIPELINE", <each command's name>...)``: a dmutex
    waiter sends its ``BLPOP`` and its next attempt so. The wrappers are the
    instance's own attributes, so dmutex still sees the client's class as
    redis-py's and pipelines its waits as it would.
    """
    log: list[Request] = []
    clock, send, pipeline = time.perf_counter, client.execute_command, client.pipeline

    def traced(*args: Any, **options: Any) -> Any:
        start = clock()
        try:
            return send(*args, **options)
        finally:
            log.append((args, start, clock()))

    async def traced_async(*args: Any, **options: Any) -> Any:
        start = clock()
        try:
            return await send(*args, **options)
        finally:
            log.append((args, start, clock()))

    def traced_pipeline(*args: Any, **options: Any) -> Any:
        pipe = pipeline(*args, **options)
        names: list[object] = []
        # redis-py's two Pipeline classes, one signature: called as Callables.
        queue: Callable[..., Any] = pipe.execute_command
        execute: Callable[..., Any] = pipe.execute

        def queued(*command: Any, **more: Any) -> Any:
            names.append(command[0])
            return queue(*command, **more)

        def run(*more: Any, **options: Any) -> Any:
            start = clock()
            try:
                return execute(*more, **options)
            finally:
                log.append((("PIPELINE", *names), start, clock()))

        async def run_async(*more: Any, **options: Any) -> Any:
            start = clock()
            try:
                return await execute(*more, **options)
            finally:
                log.append((("PIPELINE", *names), start, clock()))

        vars(pipe)["execute_command"] = queued
        vars(pipe)["execute"] = run_async if is_async else run
        return pipe

    is_async = isinstance(client, redis.asyncio.Redis)
    vars(client)["execute_command"] = traced_async if is_async else traced
    vars(client)["pipeline"] = traced_pipeline
    return log


def sent_alone(
    probe: redis.Redis, logs: Sequence[list[Request]], batch: Batch, n: int
) -> tuple[dict[str, float], list[Request]]:
    """``batch`` alone, ``n`` operations after ``max(10, n // 10)`` unmeasured: what it sent.

    The server's commands per operation by name (``INFO commandstats`` read
    by ``probe`` before and after: a script's own commands counted beside
    its ``EVALSHA``; ``INFO`` itself left out) and the requests the clients
    traced into ``logs`` (:func:`trace_requests`) sent meanwhile. Other
    clients' commands on the server count too: alone means nobody else.
    """
    batch(max(10, n // 10))  # scripts loaded, connections open
    before, marks = server_counters(probe)[0], [len(log) for log in logs]
    batch(n)
    after = server_counters(probe)[0]
    calls = {name: c - before.get(name, (0, 0))[0] for name, (c, _) in after.items()}
    sent = [request for log, mark in zip(logs, marks, strict=True) for request in log[mark:]]
    return {name: c / n for name, c in calls.items() if c and name != "info"}, sent


# --- worker processes ------------------------------------------------------------------


def answer(results: Any, work: Callable[[], object]) -> None:
    """In a worker: put ``("ok", work())`` or ``("error", what went wrong)`` on ``results``."""
    try:
        results.put(("ok", work()))
    except BaseException as error:  # noqa: BLE001 - the parent reports it
        results.put(("error", f"{type(error).__name__}: {error}"))


@contextmanager
def workers(
    target: Callable[..., None], arglists: Sequence[tuple[object, ...]]
) -> Iterator[Callable[[], list[Any]]]:
    """One spawned process per argument tuple (a results queue appended); yield a collector.

    Each process puts one answer (:func:`answer`). On the way out every
    process is joined, and one that does not end is terminated by its handle.
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    processes = [ctx.Process(target=target, args=(*a, results), daemon=True) for a in arglists]
    for process in processes:
        process.start()

    def collect() -> list[Any]:
        answers = []
        for _ in processes:
            try:
                status, value = results.get(timeout=WORKER_TIMEOUT_S)
            except queue.Empty:
                raise BenchmarkError("a worker did not answer in time") from None
            if status != "ok":
                raise BenchmarkError(f"a worker failed: {value}")
            answers.append(value)
        return answers

    try:
        yield collect
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)

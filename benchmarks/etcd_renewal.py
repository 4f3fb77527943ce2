"""What holding 10,000 auto-renewed etcd leases in one process costs: requests and time per round.

Run from the repository root (a report, not a test)::

    .venv/bin/python benchmarks/etcd_renewal.py
    .venv/bin/python benchmarks/etcd_renewal.py --quick --json out.json
    .venv/bin/python benchmarks/etcd_renewal.py --faces async --leases 20000 --ttl 60

Its length is mostly the taking and releasing of the leases, which no
option bounds but ``--leases``: on the shared 2-core VM one etcd3gw client
takes 170-330 leases a second (two requests each, each about 1 ms of the
client's CPU), aetcd 550-1,000; the holding itself is ``--hold`` renewal
intervals. The default run (10,000 leases, each face) took 1.5-3 minutes
there, the sync face most of it; ``--faces async`` alone, under a minute.

The member is the one the tests find, as in ``etcd_cycle.py``
(``etcd_cycle.etcd_member``), the keys under the session's prefix.

1. Holding: ``--leases`` leases taken by ONE face with ``acquire(f"k{i}",
   ttl=--ttl, auto_renew=True)``: ``DMutex`` on one etcd3gw client (taken by
   ``--workers`` threads at once), then ``AsyncDMutex`` on one aetcd client
   (``--workers`` acquires in flight), one face at a time (``--faces``).
   dmutex renews each lease a third of its TTL after its last renewal, less
   up to 10% (the nominal interval: ``ttl / 3 * 0.95``), each one
   keep-alive request (the store's ``extend_many`` sends one per lease, 8 in
   flight at once). The window: ``--hold`` nominal
   intervals, opened when the acquisitions end if they took an interval or
   more (the renewals then come as a stream), else half an interval after
   the first pass (``renewal_scale.window_start``). Then every lease is
   released (by the same workers) and the renewer's end awaited. Requests
   are counted at the client (wrappers on etcd3gw's ``post``, aetcd's
   methods: ``etcd_cycle.count_gateway`` / ``count_grpc``), renewals by
   wrappers on the face's store's ``extend`` (each lease renewed) and
   ``extend_many`` (the renewer's batches, timed). Reported:

   - requests per lease per nominal interval: the interval over the mean gap
     between two renewals of one lease (1.0 when the renewer keeps up, less
     when it falls behind), times the requests per renewal, both over the
     whole hold; and the requests counted in the window, per lease per
     interval (which, right after a long acquisition, depends on where the
     renewals stand);
   - renewals against keep-alive requests over the hold (one each), and
     every other request beyond the takes and the releases: a renewal that
     finds its lease gone reads the slot (one request more), as does a
     keep-alive that races its lease's release;
   - the renewal round: the renewer's time in ``extend_many`` in the window
     per round of every lease, against the interval; each keep-alive's time
     at the client, p50 and p99;
   - the gap between renewals of one lease (p50, p99, max), leases lost, and
     the process's CPU time in the window (``time.process_time``).
2. Keep-alives, one after another, as the renewer sends them and as it
   could: ``--keepalives`` leases granted raw, each renewed once per turn,
   in interleaved rounds (``harness.interleave``): ``gateway`` (etcd3gw's
   ``post`` to ``/lease/keepalive``, what the sync store sends),
   ``grpc-call`` (aetcd's ``refresh_lease``: a LeaseKeepAlive stream opened
   per keep-alive, what the asyncio store sends), ``grpc-stream`` (one
   LeaseKeepAlive stream per turn, each answer read before the next request
   is written) and ``grpc-pipelined`` (one stream per turn, every request
   written while the answers are read). The last two use aetcd's private
   ``leasestub`` and its ``rpc`` messages. Keep-alives per second, the
   client's CPU per keep-alive, and how long a round of ``--leases`` would
   take at that rate.

Options: ``--leases``, ``--ttl`` (s), ``--hold`` (nominal intervals),
``--workers`` (threads or acquires in flight), ``--faces`` (``sync,async``,
or one of them), ``--keepalives`` (leases per turn of part 2), ``--rounds`` (of
part 2); ``--quick``, ``--json FILE``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import math
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aetcd
import etcd3gw
import harness
from etcd_cycle import (
    CLIENT_TIMEOUT_S,
    Member,
    Tally,
    count_gateway,
    count_grpc,
    run_on_member,
)
from harness import Batch, BenchmarkError
from renewal_scale import RENEWER, window_start

from dmutex import AsyncDMutex, AsyncDMutexLock, DMutex, DMutexLock

OPTIONS = {  # name: (default, under --quick)
    "leases": (10_000, 200), "ttl": (30.0, 6.0), "hold": (1.0, 1.0), "workers": (8, 8),
    "faces": ("sync,async", "sync,async"), "keepalives": (500, 50), "rounds": (5, 2),
}  # fmt: skip
KEEPALIVES = ("lease/keepalive", "refresh_lease")
# A take's lease grant and transaction, and a release's revoke, by face: the requests' kinds.
TAKES = {
    "sync": ("lease/grant", "kv/txn", "kv/lease/revoke"),
    "async": ("lease", "transaction", "revoke_lease"),
}
RENEWER_END_S = 30.0  # the longest the run waits for the renewer to end after the releases


@dataclass
class Renewals:
    """What the wrappers on a face's store saw: each lease renewed, each batch's span."""

    stamps: list[tuple[float, str]] = field(default_factory=list)  # monotonic s, key
    spans: list[tuple[float, float]] = field(default_factory=list)  # extend_many's start, end
    running: float | None = None  # the start of the extend_many under way, if one is

    def busy(self, start: float, stop: float, first: int) -> float:
        """Seconds in ``extend_many`` from ``start`` to ``stop``, of ``spans[first:]`` and after."""
        spans = self.spans[first:]
        done = sum(min(end, stop) - max(begin, start) for begin, end in spans if begin < stop)
        running = self.running
        return done + (stop - max(running, start) if running is not None and running < stop else 0)


def watch_renewals(face: DMutex | AsyncDMutex) -> Renewals:
    """Wrap the face's store's ``extend`` and ``extend_many`` (instance attributes) to note them.

    Reached through dmutex's private ``_engine._store``, as
    ``renewal_scale.py`` does; both are looked up on the instance. The etcd
    store's ``extend_many`` renews its batch together (one keep-alive a
    lease, several in flight), so a lease's renewal is noted from the
    batch's answers: each new expiry is one; ``extend`` notes the others
    (an ``extend`` by handle).
    """
    store = face._engine._store
    extend: Callable[..., Any] = store.extend
    extend_many: Callable[..., Any] = store.extend_many
    seen = Renewals()
    clock = time.monotonic

    def one(key: str, *args: Any) -> Any:
        result = yield from extend(key, *args)
        seen.stamps.append((clock(), key))
        return result

    def batch(leases: Sequence[Any]) -> Any:
        start = seen.running = clock()
        result = yield from extend_many(leases)
        seen.running = None
        end = clock()
        seen.spans.append((start, end))
        seen.stamps.extend(
            (end, lease.key)
            for lease, answer in zip(leases, result, strict=True)
            if isinstance(answer, int) and not isinstance(answer, bool)
        )
        return result

    vars(store)["extend"] = one
    vars(store)["extend_many"] = batch
    return seen


@dataclass
class Hold:
    """What holding ``leases`` renewed leases with one face showed."""

    face: str
    leases: int
    ttl_s: float
    acquire_s: float = 0.0
    window_s: float = 0.0
    window_after_acquire_s: float = 0.0
    window_requests: dict[str, int] = field(default_factory=dict)
    window_renewals: int = 0
    busy_s: float = 0.0  # the renewer's time in extend_many, within the window
    window_batches: int = 0  # extend_many calls that began in the window
    keepalive_ms: tuple[float, float] = (0.0, 0.0)  # p50, p99 at the client, in the window
    cpu_s: float = 0.0
    hold_renewals: int = 0  # from the first grant until the renewer ended
    hold_keepalives: int = 0
    hold_other_requests: dict[str, int] = field(default_factory=dict)  # beyond grants, releases
    gaps: list[float] = field(default_factory=list)
    lost: int = 0
    released: int = 0
    release_s: float = 0.0
    renewer_gone_s: float | None = None

    @property
    def interval_s(self) -> float:
        """The nominal renewal interval: a third of the TTL, less 5% (the jitter's mean)."""
        return self.ttl_s / 3 * 0.95

    @property
    def intervals(self) -> float:
        return self.window_s / self.interval_s

    @property
    def in_window(self) -> float:
        """Requests per lease per nominal interval in the window, every kind, counted."""
        return sum(self.window_requests.values()) / self.leases / self.intervals

    @property
    def renewals_per_interval(self) -> float:
        """Renewals per lease per nominal interval over the hold: the interval over the mean gap."""
        return self.interval_s / statistics.fmean(self.gaps) if self.gaps else math.nan

    @property
    def per_renewal(self) -> float:
        """Requests per renewal over the hold: its keep-alive, and any read after it."""
        extra = sum(self.hold_other_requests.values())
        return (self.hold_keepalives + extra) / self.hold_renewals if self.hold_renewals else 0.0

    @property
    def per_lease_per_interval(self) -> float:
        """Requests per lease per nominal interval: renewals per interval x requests per renewal."""
        return self.renewals_per_interval * self.per_renewal

    @property
    def round_s(self) -> float:
        """The renewer's time per round of every lease: busy time over rounds done."""
        rounds = self.window_renewals / self.leases
        return self.busy_s / rounds if rounds else float("nan")


async def hold(face: DMutex | AsyncDMutex, tally: Tally, args: argparse.Namespace) -> Hold:
    """Take ``--leases`` renewed leases with ``face``, hold them for the window, release them.

    Runs in the event loop for both faces; the sync face's acquires and
    releases run on ``--workers`` threads, its renewals on dmutex's.
    """
    is_async = isinstance(face, AsyncDMutex)
    result = Hold("async" if is_async else "sync", args.leases, args.ttl)
    seen = watch_renewals(face)
    if any(t.name == RENEWER for t in threading.enumerate()):
        raise BenchmarkError("a renewer is already running")
    granted: dict[str, float] = {}
    before = Counter(tally.counts)
    started = time.monotonic()
    handles = await take(face, args, granted)
    result.acquire_s = time.monotonic() - started

    interval = result.interval_s
    if max(granted.values()) - min(granted.values()) >= interval:
        opens = time.monotonic()  # the renewals come as a stream already
    else:
        opens = window_start(granted, interval)
    await asyncio.sleep(max(0.0, opens - time.monotonic()))
    counts, renewed, spans = Counter(tally.counts), len(seen.stamps), len(seen.spans)
    logged = len(tally.log or [])
    cpu, start = time.process_time(), time.monotonic()
    result.window_after_acquire_s = start - (started + result.acquire_s)
    await asyncio.sleep(args.hold * interval)
    result.cpu_s, stop = time.process_time() - cpu, time.monotonic()
    result.busy_s = seen.busy(start, stop, spans)
    result.window_batches = sum(1 for begin, _ in seen.spans[spans:] if start <= begin < stop)
    result.window_batches += seen.running is not None and start <= seen.running < stop
    result.window_s = stop - start
    result.window_requests = dict(tally.counts - counts)
    result.window_renewals = len(seen.stamps) - renewed
    times = [
        (end - begin) * 1000
        for kind, begin, end in (tally.log or [])[logged:]
        if kind in KEEPALIVES and end <= stop
    ]
    result.keepalive_ms = (harness.quantile(times, 0.5), harness.quantile(times, 0.99))

    result.lost = sum(handle.lost for handle in handles)
    released = time.monotonic()
    result.released = await give_back(handles, args.workers)
    result.release_s = time.monotonic() - released
    del handles
    gc.collect()
    while any(t.name == RENEWER for t in threading.enumerate()) or renewer_tasks():
        if time.monotonic() > released + RENEWER_END_S:
            break
        await asyncio.sleep(0.02)
    else:
        result.renewer_gone_s = time.monotonic() - released - result.release_s
    spent = tally.counts - before
    result.hold_renewals = len(seen.stamps)
    result.hold_keepalives = sum(spent[kind] for kind in KEEPALIVES)
    # Each take is a grant and a transaction, each release a revoke: anything beyond is other.
    grant, txn, revoke = TAKES["async" if is_async else "sync"]
    other = spent - Counter({grant: args.leases, txn: args.leases, revoke: args.leases})
    result.hold_other_requests = {k: n for k, n in other.items() if k not in KEEPALIVES}
    last = dict(granted)
    for at, key in seen.stamps:
        result.gaps.append(at - last[key])
        last[key] = at
    return result


def renewer_tasks() -> int:
    """Dmutex's renewer tasks on the running loop."""
    return sum(1 for task in asyncio.all_tasks() if task.get_name() == RENEWER)


async def take(
    face: DMutex | AsyncDMutex, args: argparse.Namespace, granted: dict[str, float]
) -> list[DMutexLock] | list[AsyncDMutexLock]:
    """``--leases`` renewed leases, ``--workers`` at a time; their grant times in ``granted``."""
    keys = [f"k{i}" for i in range(args.leases)]

    def noted(key: str, handle: object) -> None:
        if handle is None:
            raise BenchmarkError(f"could not take {key}: is the key space shared?")
        granted[key] = time.monotonic()

    if isinstance(face, DMutex):

        def one(key: str) -> DMutexLock:
            handle = face.acquire(key, ttl=args.ttl, auto_renew=True)
            noted(key, handle)
            assert handle is not None
            return handle

        with ThreadPoolExecutor(args.workers) as pool:
            return await asyncio.get_running_loop().run_in_executor(
                None, lambda: list(pool.map(one, keys))
            )
    gate = asyncio.Semaphore(args.workers)

    async def take_one(key: str) -> AsyncDMutexLock:
        async with gate:
            handle = await face.acquire(key, ttl=args.ttl, auto_renew=True)
        noted(key, handle)
        assert handle is not None
        return handle

    return list(await asyncio.gather(*(take_one(key) for key in keys)))


async def give_back(handles: list[DMutexLock] | list[AsyncDMutexLock], workers: int) -> int:
    """Release every handle, ``workers`` at a time; how many releases found their lease."""
    sync = [h for h in handles if isinstance(h, DMutexLock)]
    found = 0
    if sync:
        with ThreadPoolExecutor(workers) as pool:
            found += await asyncio.get_running_loop().run_in_executor(
                None, lambda: sum(pool.map(lambda h: h.release(), sync))
            )
    gate = asyncio.Semaphore(workers)

    async def one(handle: AsyncDMutexLock) -> bool:
        async with gate:
            return await handle.release()

    found += sum(await asyncio.gather(*(one(h) for h in handles if isinstance(h, AsyncDMutexLock))))
    return found


async def holds(member: Member, args: argparse.Namespace) -> list[Hold]:
    """Part 1 for each face of ``--faces``, one after another."""
    found = []
    for name in args.faces.split(","):
        tally = Tally(log=[])
        prefix = f"{member.prefix}renewal-{name}-{uuid.uuid4().hex[:8]}:"
        harness.progress(f"{name}: {args.leases} leases, ttl {args.ttl:g} s")
        if name == "sync":
            client = etcd3gw.Etcd3Client(
                host=member.host, port=member.port, timeout=CLIENT_TIMEOUT_S
            )
            count_gateway(client, tally)
            try:
                face = DMutex("bench", client, key_prefix=prefix, default_ttl_seconds=args.ttl)
                found.append(await hold(face, tally, args))
            finally:
                client.session.close()
        elif name == "async":
            aclient = aetcd.Client(host=member.host, port=member.port, timeout=CLIENT_TIMEOUT_S)
            count_grpc(aclient, tally)
            try:
                aface = AsyncDMutex(
                    "bench", aclient, key_prefix=prefix, default_ttl_seconds=args.ttl
                )
                found.append(await hold(aface, tally, args))
            finally:
                await aclient.close()
        else:
            raise BenchmarkError(f"--faces: {name!r} is neither sync nor async")
    return found


def report(args: argparse.Namespace, runs: list[Hold]) -> None:
    title = (
        f"Holding {args.leases} leases, ttl {args.ttl:g} s (renewed every "
        f"{args.ttl / 3 * 0.9:.2f} .. {args.ttl / 3:.2f} s, nominal {runs[0].interval_s:.2f} s), "
        f"window {args.hold:g} nominal interval(s)"
    )

    def kinds(found: dict[str, int]) -> str:
        return ", ".join(f"{kind} {n}" for kind, n in sorted(found.items())) or "-"

    def gaps(r: Hold) -> str:
        return " / ".join(f"{harness.quantile(r.gaps, q):.2f}" for q in (0.5, 0.99, 1.0))

    rows: list[tuple[str, Callable[[Hold], object]]] = [
        ("acquire all, s", lambda r: r.acquire_s),
        ("window opened after the last acquire, s", lambda r: r.window_after_acquire_s),
        ("window, s", lambda r: r.window_s),
        ("requests in the window, by kind", lambda r: kinds(r.window_requests)),
        ("requests per lease per nominal interval, counted", lambda r: r.in_window),
        ("renewals in the window", lambda r: r.window_renewals),
        ("renewer busy in the window, s", lambda r: r.busy_s),
        ("renewal batches begun in the window", lambda r: r.window_batches),
        ("renewal round (every lease once), s", lambda r: r.round_s),
        ("round / nominal interval", lambda r: r.round_s / r.interval_s),
        (
            "keep-alive at the client p50 / p99, ms",
            lambda r: "{:.2f} / {:.2f}".format(*r.keepalive_ms),
        ),
        ("process CPU in the window, s", lambda r: r.cpu_s),
        (
            "renewals / keep-alives, whole hold",
            lambda r: f"{r.hold_renewals} / {r.hold_keepalives}",
        ),
        ("other requests, whole hold", lambda r: kinds(r.hold_other_requests)),
        ("gap between renewals p50 / p99 / max, s", gaps),
        (
            "renewals per lease per nominal interval (interval / mean gap)",
            lambda r: r.renewals_per_interval,
        ),
        ("requests per renewal", lambda r: r.per_renewal),
        ("requests per lease per nominal interval", lambda r: r.per_lease_per_interval),
        ("leases lost / released", lambda r: f"{r.lost} / {r.released}"),
        ("release all, s", lambda r: r.release_s),
        ("renewer gone after the releases, s", lambda r: r.renewer_gone_s),
    ]
    head = ["", *(f"{r.face} ({'etcd3gw' if r.face == 'sync' else 'aetcd'})" for r in runs)]
    harness.table(head, [[name, *(cell(r) for r in runs)] for name, cell in rows], title)


# --- part 2: keep-alives, as sent and as they could be -------------------------------------


def keepalives(member: Member, args: argparse.Namespace) -> dict[str, object]:
    """Part 2: renew ``--keepalives`` leases per turn, four ways, interleaved."""
    client = etcd3gw.Etcd3Client(host=member.host, port=member.port, timeout=CLIENT_TIMEOUT_S)
    loop = asyncio.new_event_loop()
    aclient = aetcd.Client(host=member.host, port=member.port, timeout=CLIENT_TIMEOUT_S)
    seconds = max(1, round(args.ttl))
    cpu: dict[str, float] = {}
    try:
        ids = [
            int(client.post(client.get_url("/lease/grant"), json={"TTL": seconds, "ID": 0})["ID"])
            for _ in range(args.keepalives)
        ]
        loop.run_until_complete(aclient.connect())
        batches = keepalive_batches(client, aclient, loop, ids)

        def costed(name: str, batch: Batch) -> Batch:
            def run(n: int) -> list[int]:
                began = time.process_time()
                samples = batch(n)
                cpu[name] = cpu.get(name, 0.0) + time.process_time() - began
                return samples

            return run

        figures = harness.interleave(
            {name: costed(name, batch) for name, batch in batches.items()},
            rounds=args.rounds,
            per_round=len(ids),
            turn=len(ids),
            warmup=min(len(ids), 50),
        )
        for lease in ids:
            client.post(client.get_url("/kv/lease/revoke"), json={"ID": lease})
    finally:
        loop.run_until_complete(aclient.close())
        loop.close()
        client.session.close()
    harness.figures_table(figures, "One keep-alive each (pipelined: its turn's time / keep-alives)")
    samples = {name: len(fig.samples) for name, fig in figures.items()}
    warm = min(len(ids), 50)
    rows = [
        [
            name,
            fig.ops_per_s,
            cpu[name] / (samples[name] + warm) * 1e6,
            args.leases / fig.ops_per_s,
        ]
        for name, fig in figures.items()
    ]
    harness.table(
        ["keep-alives", "per s", "client CPU µs each", f"round of {args.leases}, s"],
        rows,
        f"Keep-alives of {len(ids)} leases per turn, {args.rounds} rounds:",
    )
    ratios = harness.ratio_table(
        figures,
        [
            ("grpc-call", "gateway"),
            ("grpc-stream", "grpc-call"),
            ("grpc-pipelined", "grpc-call"),
        ],
        ("ops/s",),
    )
    return {
        "figures": figures,
        "ratios": ratios,
        "client_cpu_us": {name: cpu[name] / (samples[name] + warm) * 1e6 for name in figures},
    }


def keepalive_batches(
    client: etcd3gw.Etcd3Client,
    aclient: aetcd.Client,
    loop: asyncio.AbstractEventLoop,
    ids: list[int],
) -> dict[str, Batch]:
    """The four ways to renew ``ids`` (a batch of n renews the first n), each keep-alive checked."""
    post, url = client.post, client.get_url("/lease/keepalive")
    # aetcd's gRPC stub and messages: private, untyped (stubs/aetcd types dmutex's calls only).
    raw: Any = aclient
    rpc = importlib.import_module("aetcd.rpc")

    def kept(ttl: object) -> None:
        if int(str(ttl)) <= 0:
            raise BenchmarkError(f"a keep-alive found its lease gone (TTL {ttl})")

    def gateway(n: int) -> list[int]:
        samples, clock = [0] * n, time.perf_counter_ns
        for i in range(n):
            start = clock()
            kept(post(url, json={"ID": ids[i]})["result"].get("TTL", -1))
            samples[i] = clock() - start
        return samples

    async def call(n: int) -> list[int]:
        samples, clock = [0] * n, time.perf_counter_ns
        for i in range(n):
            start = clock()
            kept((await aclient.refresh_lease(ids[i])).TTL)
            samples[i] = clock() - start
        return samples

    async def stream(n: int) -> list[int]:
        samples, clock = [0] * n, time.perf_counter_ns
        began = clock()
        keep = raw.leasestub.LeaseKeepAlive(timeout=CLIENT_TIMEOUT_S, metadata=raw.metadata)
        for i in range(n):
            start = clock()
            await keep.write(rpc.LeaseKeepAliveRequest(ID=ids[i]))
            kept((await keep.read()).TTL)
            samples[i] = clock() - start
        await keep.done_writing()
        samples[0] += clock() - began - sum(samples)  # opening and closing the stream
        return samples

    async def pipelined(n: int) -> list[int]:
        clock = time.perf_counter_ns
        began = clock()
        keep = raw.leasestub.LeaseKeepAlive(timeout=CLIENT_TIMEOUT_S, metadata=raw.metadata)

        async def write() -> None:
            for i in range(n):
                await keep.write(rpc.LeaseKeepAliveRequest(ID=ids[i]))
            await keep.done_writing()

        writing = asyncio.ensure_future(write())
        answers = 0
        async for answer in keep:
            kept(answer.TTL)
            answers += 1
        await writing
        if answers != n:
            raise BenchmarkError(f"{answers} keep-alive answers to {n} requests")
        spent = clock() - began
        return [spent // n] * n

    def on_loop(batch: Callable[[int], Awaitable[list[int]]]) -> Batch:
        return lambda n: loop.run_until_complete(batch(n))

    return {
        "gateway": gateway,
        "grpc-call": on_loop(call),
        "grpc-stream": on_loop(stream),
        "grpc-pipelined": on_loop(pipelined),
    }


def bench(member: Member, args: argparse.Namespace) -> dict[str, object]:
    started = time.monotonic()
    runs = asyncio.run(holds(member, args))
    report(args, runs)
    harness.progress(f"keep-alives: {args.keepalives} leases per turn")
    part2 = keepalives(member, args)
    print(f"\n(run took {time.monotonic() - started:.0f} s)")
    return {
        "renewal": runs,
        "per_lease_per_interval": {r.face: r.per_lease_per_interval for r in runs},
        "in_window": {r.face: r.in_window for r in runs},
        "per_renewal": {r.face: r.per_renewal for r in runs},
        "round_s": {r.face: r.round_s for r in runs},
        "keepalives": part2,
    }


def run(argv: Sequence[str] | None = None) -> int:
    return run_on_member(bench, harness.parse(__doc__, argv, OPTIONS, redis=False))


if __name__ == "__main__":
    sys.exit(run())

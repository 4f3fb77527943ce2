"""A released etcd lock's hand-off to a blocked waiter: woken by its watch, against polling.

Run from the repository root (a report, not a test; about a minute on a shared 2-core VM)::

    .venv/bin/python benchmarks/etcd_handoff.py
    .venv/bin/python benchmarks/etcd_handoff.py --quick --json out.json
    .venv/bin/python benchmarks/etcd_handoff.py --handoffs 300 --delay 5

The member is the one the tests find, as in ``etcd_cycle.py``
(``etcd_cycle.etcd_member``), the keys under the session's prefix.

A hand-off: the holder (a ``DMutex`` on an etcd3gw client of its own) takes
the key; a waiter thread calls ``acquire_with_retry(key, timeout=30,
retry_delay=...)`` on a ``DMutex`` on another etcd3gw client; once the
waiter's first attempt failed and it began to wait (its client's
``watch_once`` was called), and a further ``U(0.05, 0.15)`` s passed (so that
a poller is caught at any point of its sleep), the holder notes
``time.perf_counter()`` and releases (the lease's revoke); the hand-off is
the time until the waiter's ``acquire_with_retry`` returns with the lock.
The waiter then releases it, untimed. Variants:

- ``watch``: dmutex as it is, ``retry_delay=--delay`` (2 s): the waiter
  watches the holder's slot key for its deletion (the store's rule 7), and
  the revoke's delete event wakes it;
- ``poll``: the same store unable to wake: its client's ``watch_once``
  raises at once (no request), which the store takes as a failed watch and
  sleeps the rest of its wait, so the waiter tries every
  ``U(0.5, 1) * retry_delay`` with ``retry_delay=--poll`` (0.05 s): a
  retry-delay-only baseline;
- ``watch-async``, ``poll-async``: the same with ``AsyncDMutex`` on aetcd
  clients (holder and waiter, one event loop; the waiter a task).

The variants take turns of ``--turn`` hand-offs (``harness.interleave``,
one round), after one warm-up hand-off each. The waiter's requests are
counted at its client (``etcd_cycle.count_gateway`` / ``count_grpc``),
from its call to its return: a watch is one request, a refused one none.

Options: ``--handoffs`` per variant, ``--turn``, ``--delay`` (the watching
waiter's ``retry_delay``, s), ``--poll`` (the poller's, s); ``--quick``,
``--json FILE``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import aetcd
import etcd3gw
import harness
from etcd_cycle import CLIENT_TIMEOUT_S, Member, Tally, count_gateway, count_grpc, run_on_member
from harness import BenchmarkError, Figures

from dmutex import AsyncDMutex, DMutex

OPTIONS = {  # name: (default, under --quick)
    "handoffs": (100, 6), "turn": (10, 3), "delay": (2.0, 2.0), "poll": (0.05, 0.05),
}  # fmt: skip
WAIT_TIMEOUT_S = 30.0  # the waiter's acquire_with_retry timeout: never reached
PAUSE_S = (0.05, 0.15)  # between the waiter's first wait and the release
TTL_S = 30.0  # the holder's and the waiter's leases: none runs out during a hand-off
VARIANTS = ("watch", "poll", "watch-async", "poll-async")


class Unwoken(Exception):
    """What a ``watch_once`` that cannot wake raises at once: the store sleeps its wait."""


@dataclass
class Waits:
    """One variant's waiter: its requests, the hand-offs done, the time it spent waiting."""

    tally: Tally = field(default_factory=Tally)
    requests: Counter[str] = field(default_factory=Counter)
    handoffs: int = 0
    waited_s: float = 0.0

    def per_handoff(self) -> dict[str, float]:
        return {kind: n / self.handoffs for kind, n in sorted(self.requests.items())}

    def add(self, before: Counter[str], started: float, got: float) -> None:
        """One hand-off: the requests since ``before``, the time from ``started`` to ``got``."""
        self.requests.update(self.tally.counts - before)
        self.handoffs += 1
        self.waited_s += got - started


def waiting_gateway(client: etcd3gw.Etcd3Client, begun: threading.Event, wake: bool) -> None:
    """Set ``begun`` when ``client``'s ``watch_once`` is called; unless ``wake``, refuse it."""
    watch_once = client.watch_once

    def watch(*args: Any, **kwargs: Any) -> Any:
        begun.set()
        if not wake:
            raise Unwoken
        return watch_once(*args, **kwargs)

    vars(client)["watch_once"] = watch


def waiting_grpc(client: aetcd.Client, begun: asyncio.Event, wake: bool) -> None:
    """:func:`waiting_gateway` for an aetcd client."""
    watch_once = client.watch_once

    async def watch(*args: Any, **kwargs: Any) -> Any:
        begun.set()
        if not wake:
            raise Unwoken
        return await watch_once(*args, **kwargs)

    vars(client)["watch_once"] = watch


def pause() -> float:
    return random.uniform(*PAUSE_S)  # not secrecy: a point in a poller's sleep


@contextmanager
def sync_variant(
    member: Member, prefix: str, waits: Waits, wake: bool, retry_delay: float
) -> Iterator[Callable[[int], list[int]]]:
    """A batch of sync hand-offs: holder and waiter on etcd3gw clients of their own."""

    def connect() -> etcd3gw.Etcd3Client:
        return etcd3gw.Etcd3Client(host=member.host, port=member.port, timeout=CLIENT_TIMEOUT_S)

    holder_client, waiter_client = connect(), connect()
    begun = threading.Event()
    count_gateway(waiter_client, waits.tally)
    waiting_gateway(waiter_client, begun, wake)
    options: dict[str, Any] = {"key_prefix": prefix, "default_ttl_seconds": TTL_S}
    holder, waiter = (
        DMutex("bench", holder_client, **options),
        DMutex("bench", waiter_client, **options),
    )

    def handoff() -> int:
        held = holder.acquire("k")
        if held is None:
            raise BenchmarkError("the holder could not take the free key")
        begun.clear()
        got: list[float] = []
        failed: list[BaseException] = []

        def wait() -> None:
            try:
                before, started = Counter(waits.tally.counts), time.perf_counter()
                lock = waiter.acquire_with_retry(
                    "k", timeout=WAIT_TIMEOUT_S, retry_delay=retry_delay
                )
                got.append(time.perf_counter())
                waits.add(before, started, got[0])
                if lock is None or not lock.release():
                    raise BenchmarkError("the waiter did not get the lock")
            except BaseException as error:  # noqa: BLE001 - the holder reports it
                failed.append(error)

        thread = threading.Thread(target=wait, name="bench-waiter")
        thread.start()
        if not begun.wait(WAIT_TIMEOUT_S):
            raise BenchmarkError("the waiter never began to wait")
        time.sleep(pause())
        released = time.perf_counter()
        if not held.release():
            raise BenchmarkError("the holder's release found its lease gone")
        thread.join(WAIT_TIMEOUT_S + 10)
        if failed or not got:
            raise BenchmarkError(f"the waiter failed: {failed[0] if failed else 'no answer'}")
        return round((got[0] - released) * 1e9)

    try:
        yield lambda n: [handoff() for _ in range(n)]
    finally:
        holder_client.session.close()
        waiter_client.session.close()


@contextmanager
def async_variant(
    member: Member,
    loop: asyncio.AbstractEventLoop,
    prefix: str,
    waits: Waits,
    wake: bool,
    retry_delay: float,
) -> Iterator[Callable[[int], list[int]]]:
    """A batch of asyncio hand-offs: holder and waiter on aetcd clients of their own, one loop."""

    def connect() -> aetcd.Client:
        return aetcd.Client(host=member.host, port=member.port, timeout=CLIENT_TIMEOUT_S)

    holder_client, waiter_client = connect(), connect()
    begun = asyncio.Event()
    count_grpc(waiter_client, waits.tally)
    waiting_grpc(waiter_client, begun, wake)
    options: dict[str, Any] = {"key_prefix": prefix, "default_ttl_seconds": TTL_S}
    holder = AsyncDMutex("bench", holder_client, **options)
    waiter = AsyncDMutex("bench", waiter_client, **options)

    async def wait() -> float:
        before, started = Counter(waits.tally.counts), time.perf_counter()
        lock = await waiter.acquire_with_retry("k", timeout=WAIT_TIMEOUT_S, retry_delay=retry_delay)
        got = time.perf_counter()
        waits.add(before, started, got)
        if lock is None or not await lock.release():
            raise BenchmarkError("the waiter did not get the lock")
        return got

    async def handoff() -> int:
        held = await holder.acquire("k")
        if held is None:
            raise BenchmarkError("the holder could not take the free key")
        begun.clear()
        task = asyncio.ensure_future(wait())
        try:
            await asyncio.wait_for(begun.wait(), WAIT_TIMEOUT_S)
            await asyncio.sleep(pause())
            released = time.perf_counter()
            if not await held.release():
                raise BenchmarkError("the holder's release found its lease gone")
            got = await asyncio.wait_for(task, WAIT_TIMEOUT_S + 10)
        finally:
            task.cancel()
        return round((got - released) * 1e9)

    async def batch(n: int) -> list[int]:
        return [await handoff() for _ in range(n)]

    try:
        yield lambda n: loop.run_until_complete(batch(n))
    finally:
        for client in (holder_client, waiter_client):
            loop.run_until_complete(client.close())


def bench(member: Member, args: argparse.Namespace) -> dict[str, object]:
    """Time ``--handoffs`` hand-offs of each variant on ``member``; print and return them."""
    print(
        f"{args.handoffs} hand-offs per variant in turns of {args.turn}; the watching waiter's "
        f"retry_delay {args.delay:g} s, the poller's {args.poll:g} s",
        flush=True,
    )
    prefix = f"{member.prefix}handoff-{uuid.uuid4().hex[:8]}:"
    waits = {name: Waits() for name in VARIANTS}
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # asyncio.Event binds to it on 3.10
    delays = {"watch": args.delay, "poll": args.poll}
    try:
        with (
            sync_variant(member, f"{prefix}s:", waits["watch"], True, args.delay) as watch,
            sync_variant(member, f"{prefix}p:", waits["poll"], False, args.poll) as poll,
            async_variant(
                member, loop, f"{prefix}as:", waits["watch-async"], True, args.delay
            ) as watch_async,
            async_variant(
                member, loop, f"{prefix}ap:", waits["poll-async"], False, args.poll
            ) as poll_async,
        ):
            batches = {
                "watch": watch,
                "poll": poll,
                "watch-async": watch_async,
                "poll-async": poll_async,
            }
            # The warm-up's requests are the variants' too: counted with the rest.
            figures = harness.interleave(
                batches, rounds=1, per_round=args.handoffs, turn=args.turn, warmup=1
            )
    finally:
        asyncio.set_event_loop(None)
        loop.close()
    title = (
        f"Hand-off to a blocked waiter (µs): watch, retry_delay {args.delay:g} s; "
        f"poll, retry_delay {args.poll:g} s"
    )
    harness.figures_table(figures, title)
    ratios = harness.ratio_table(
        figures, [("poll", "watch"), ("poll-async", "watch-async")], ("p50", "p99", "mean")
    )
    rows = [
        [
            name,
            sum(w.requests.values()) / w.handoffs,
            ", ".join(f"{kind} {n:.2f}" for kind, n in w.per_handoff().items()),
            w.waited_s / w.handoffs * 1000,
            sum(w.requests.values()) / w.waited_s,
        ]
        for name, w in waits.items()
    ]
    head = ["waiter", "requests", "by kind", "call to return, ms", "requests per s of it"]
    harness.table(head, rows, "The waiter's requests per hand-off, from its call to its return:")
    return {
        "handoff": figures,
        "ratios": ratios,
        "requests_per_handoff": {
            name: sum(w.requests.values()) / w.handoffs for name, w in waits.items()
        },
        "requests_by_kind": {name: w.per_handoff() for name, w in waits.items()},
        "retry_delay_s": {name: delays[name.removesuffix("-async")] for name in VARIANTS},
        "summary": {name: summary(fig) for name, fig in figures.items()},
    }


def summary(figures: Figures) -> dict[str, float]:
    """Median and p99 of a variant's hand-offs, in ms."""
    return {"p50_ms": figures.us("p50") / 1000, "p99_ms": figures.us("p99") / 1000}


def run(argv: list[str] | None = None) -> int:
    return run_on_member(bench, harness.parse(__doc__, argv, OPTIONS, redis=False))


if __name__ == "__main__":
    sys.exit(run())

"""How close dmutex's etcd lock cycle comes to its three requests, and to the peers' locks.

Run from the repository root (a report, not a test; 1-2 minutes on a shared 2-core VM)::

    .venv/bin/python benchmarks/etcd_cycle.py
    .venv/bin/python benchmarks/etcd_cycle.py --quick --json out.json
    .venv/bin/python benchmarks/etcd_cycle.py --cycles 400 --rounds 7

The member is the one the tests find (``tests/_support/etcd_servers.py``:
``DMUTEX_ETCD_URL``, Docker's ``quay.io/coreos/etcd``, or the ``etcd``
executable, a single member started here on free loopback ports and stopped
by pid at the end). dmutex's keys, and the raw contenders', are under the
tests' session prefix (``dmutex-test-<12 hex>/``), deleted at the end;
etcd3gw's and tooz's locks write where they always do (``/locks/...``,
``/tooz/locks...``), under a name that holds the session prefix, and their
release deletes it. Every contender's cycle is three writes, each a raft
entry that the member fsyncs to its log before it answers.

The uncontended cycle, acquire + release of one key. After a warm-up,
``--rounds`` rounds of ``--cycles`` cycles per contender, interleaved in
turns of ``--chunk`` (``harness.interleave``), each cycle timed with
``time.perf_counter_ns``:

- ``dmutex``: ``DMutex.acquire(key)`` then ``lock.release()`` on an etcd3gw
  client (``etcd3gw.Etcd3Client``, one HTTP connection kept alive): the
  lease grant, the transaction that puts the slot key if it is absent, the
  lease's revoke (``dmutex/_backends/etcd/store.py``, rules 2 and 5);
- ``raw``: those three requests, with the payloads the store sends (a
  fresh ``uuid4`` token as the value, 63 bits of it as the lease ID), sent
  with the same client's ``post(client.get_url(path), json=...)``; the
  transaction's answer and the put's revision (the fence) read: the floor
  of the protocol;
- ``etcd3gw-lock``: etcd3gw's own ``client.lock(name, ttl)`` (a new
  ``etcd3gw.lock.Lock`` per cycle), ``acquire()`` then ``release()`` on
  the same client;
- ``tooz``: tooz's etcd3gw driver
  (``tooz.coordination.get_coordinator("etcd3+http://HOST:PORT", member_id)``,
  started without a heartbeat), ``get_lock(name)`` per cycle,
  ``acquire(blocking=False)`` then ``release()``; on its own etcd3gw client;
- ``dmutex-async``: ``AsyncDMutex`` on an aetcd client (gRPC);
- ``raw-async``: the three requests on the same aetcd client
  (``client.lease(ttl, lease_id=...)``, ``client.transaction(...)``,
  ``client.revoke_lease(...)``);
- ``aetcd-lock``: aetcd's own ``client.lock(key, ttl)`` (a new
  ``aetcd.locks.Lock`` per cycle), ``acquire()`` then ``release()``.

The asyncio turns each run to completion on one event loop, outside the
timed region. etcd3gw's, tooz's and aetcd's locks release by deleting the
key and never revoke the lease they granted: each cycle leaves one lease
behind, which the member expires after ``--ttl`` seconds (its own revoke, a
raft entry, then falls on whichever contender is running).

Requests per cycle are counted at the client, in the timed run itself: a
wrapper on the etcd3gw clients' ``post`` (every request but a watch) and on
the aetcd client's methods, by kind (the gateway's path, aetcd's method
name). Every contender goes through the same wrappers; each cycle's answers
are checked.

Options: ``--cycles`` per contender per round, ``--rounds``, ``--chunk``
(cycles per turn), ``--warmup`` (cycles per contender), ``--ttl`` (s, every
contender's lease); ``--quick``, ``--json FILE``.

Target (issue 40): dmutex >= 0.9x raw cycles/s on each face (the median of
the per-round ratios). The peers' ratios are figures, with no target.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import importlib.metadata
import math
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import aetcd
import etcd3gw
import etcd3gw.exceptions
import harness
from harness import Batch, BenchmarkError, Target
from redis_cycle import timed, timed_async

from dmutex import AsyncDMutex, DMutex, DMutexError

OPTIONS = {  # name: (default, under --quick)
    "cycles": (200, 20), "rounds": (5, 2), "chunk": (10, 10), "warmup": (30, 5),
    "ttl": (30.0, 30.0),
}  # fmt: skip
CLIENT_TIMEOUT_S = 10  # every client's request timeout
# The aetcd methods a contender may call, each counted as one request.
GRPC_METHODS = (
    "lease",
    "refresh_lease",
    "revoke_lease",
    "get_lease_info",
    "transaction",
    "get",
    "get_prefix",
    "put",
    "delete",
    "watch_once",
)
# What grants a lease, and what revokes one, on each client family.
GRANTS = ("lease/grant", "lease")
REVOKES = ("kv/lease/revoke", "revoke_lease")


# --- the member ------------------------------------------------------------------------


@dataclass(frozen=True)
class Member:
    """The etcd member a run measures, and the key prefix it works under."""

    label: str  # "etcd-3.4.23"
    host: str
    port: int
    prefix: str  # the test harness's session prefix: dmutex-test-<12 hex>/
    origin: str  # the etcd executable's path, "testcontainers" or DMUTEX_ETCD_URL
    version: str

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def request(self, path: str, body: Mapping[str, object]) -> dict[str, Any]:
        """POST ``body`` to ``/v3/{path}`` through the test harness's client (not counted)."""
        from tests._support.etcd_servers import Endpoint, request

        return request(Endpoint(self.host, self.port), f"/v3/{path}", body)

    def leases(self) -> int:
        """How many leases the member holds now (every client's)."""
        return len(self.request("lease/leases", {}).get("leases") or [])


def use_test_harness() -> None:
    """Make ``tests._support`` (the test harness's etcd discovery) importable."""
    if str(harness.ROOT) not in sys.path:  # run as a script: sys.path[0] is benchmarks/
        sys.path.insert(0, str(harness.ROOT))


@contextmanager
def etcd_member() -> Iterator[Member]:
    """The member the test harness finds, started here if it starts one, stopped by pid after.

    On the way out the session's prefix is deleted (the harness's
    ``Session.close``), and a member started here is stopped.
    """
    use_test_harness()
    from tests._support.etcd_servers import new_session

    session = new_session()
    try:
        if not session.discovery.sources:
            raise BenchmarkError(session.discovery.reason or "no etcd member found")
        found = session.server()
        yield Member(
            found.label, found.host, found.port, session.prefix, found.origin, found.version
        )
    finally:
        session.close()


def versions(member: Member) -> dict[str, str]:
    """The member's and the client packages' versions, printed and returned."""
    found = {"etcd": member.version, "origin": member.origin}
    for package in ("etcd3gw", "aetcd", "grpcio", "tooz", "requests"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    print(f"versions: {found}", flush=True)
    return found


# The client errors that end a run with status 2, as a Redis or PostgreSQL error does.
ERRORS: tuple[type[Exception], ...] = (
    etcd3gw.exceptions.Etcd3Exception,
    aetcd.ClientError,
    DMutexError,
)


def run_on_member(
    bench: Callable[[Member, argparse.Namespace], Mapping[str, object]],
    args: argparse.Namespace,
) -> int:
    """``harness.main`` of ``bench`` on the member :func:`etcd_member` gives."""
    found: list[Member] = []

    @contextmanager
    def server() -> Iterator[tuple[str, str]]:
        with etcd_member() as member:
            found.append(member)
            yield member.label, member.url

    def on_member(url: str, options: argparse.Namespace) -> Mapping[str, object]:
        return {"versions": versions(found[-1]), **bench(found[-1], options)}

    return harness.main(on_member, args, server=server, errors=ERRORS + tooz_errors())


# --- counting requests at the client -----------------------------------------------------


Noted = tuple[str, float, float]
"""A request's kind, and ``time.perf_counter()`` before it was sent and after its answer."""


@dataclass
class Tally:
    """The requests some clients sent, by kind; each one's times too, when ``log`` is a list."""

    counts: Counter[str] = field(default_factory=Counter)
    log: list[Noted] | None = None

    def note(self, kind: str, start: float, end: float) -> None:
        self.counts[kind] += 1
        if self.log is not None:
            self.log.append((kind, start, end))


def count_gateway(client: etcd3gw.Etcd3Client, tally: Tally) -> None:
    """Note each request ``client`` sends from now on in ``tally``: ``post``'s by path, watches.

    Install it before handing the client to dmutex, which binds the methods.
    The wrappers are the instance's own attributes: the client's class,
    which dmutex reads its shape from, is unchanged.
    """
    post, watch_once = client.post, client.watch_once
    clock = time.perf_counter

    def counted_post(url: str, *args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return post(url, *args, **kwargs)
        finally:
            tally.note(url.rpartition("/v3/")[2], start, clock())

    def counted_watch(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return watch_once(*args, **kwargs)
        finally:
            tally.note("watch", start, clock())

    vars(client)["post"] = counted_post
    vars(client)["watch_once"] = counted_watch


def count_grpc(client: aetcd.Client, tally: Tally) -> None:
    """Note each call of ``client``'s request methods in ``tally``, by method name.

    Instance attributes, as :func:`count_gateway`'s; dmutex looks its
    aetcd methods up on each call.
    """
    for name in GRPC_METHODS:
        vars(client)[name] = _counted(getattr(client, name), name, tally)


def _counted(method: Callable[..., Awaitable[Any]], name: str, tally: Tally) -> Any:
    clock = time.perf_counter

    async def counted(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return await method(*args, **kwargs)
        finally:
            tally.note(name, start, clock())

    return counted


@dataclass
class Spent:
    """What one contender's timed batches cost: cycles, requests by kind, the process's CPU."""

    cycles: int = 0
    requests: Counter[str] = field(default_factory=Counter)
    cpu_s: float = 0.0

    def per_cycle(self) -> dict[str, float]:
        return {kind: n / self.cycles for kind, n in sorted(self.requests.items())}

    @property
    def total(self) -> float:
        """Requests per cycle, every kind."""
        return sum(self.requests.values()) / self.cycles if self.cycles else math.nan

    @property
    def leases_left(self) -> float:
        """Leases granted and not revoked, per cycle: left for the member to expire."""
        grants = sum(self.requests[kind] for kind in GRANTS)
        return (grants - sum(self.requests[kind] for kind in REVOKES)) / self.cycles


def spending(batch: Batch, tally: Tally, spent: Spent) -> Batch:
    """``batch``, its cycles, requests (from ``tally``) and CPU time added to ``spent``."""

    def run(n: int) -> list[int]:
        before, cpu = Counter(tally.counts), time.process_time()
        samples = batch(n)
        spent.cpu_s += time.process_time() - cpu
        spent.requests.update(tally.counts - before)
        spent.cycles += n
        return samples

    return run


def exact(spent: Mapping[str, Spent]) -> dict[str, float]:
    """Requests per cycle of each contender; BenchmarkError if one is not a whole number."""
    found = {}
    for name, figures in spent.items():
        total = sum(figures.requests.values())
        if not figures.cycles or total % figures.cycles:
            raise BenchmarkError(f"{name}: {total} requests in {figures.cycles} cycles")
        found[name] = figures.total
    return found


# --- tooz, when it is installed -------------------------------------------------------------


def tooz_errors() -> tuple[type[Exception], ...]:
    """The error class of tooz, when it is installed: a run ends with status 2 on it."""
    try:
        import tooz
    except ImportError:
        return ()
    return (tooz.ToozError,)


@dataclass
class Tooz:
    """tooz's etcd3gw coordinator, started (no heartbeat), and its client's requests counted."""

    coordinator: Any  # tooz.drivers.etcd3gw.Etcd3Driver

    @classmethod
    def start(cls, member: Member, tally: Tally, ttl: int) -> Tooz | None:
        """The coordinator, or None (said why) when tooz is not installed."""
        try:
            from tooz import coordination
            from tooz.drivers.etcd3gw import Etcd3Driver
        except ImportError as error:
            harness.progress(f"tooz left out: {error}")
            return None
        url = f"etcd3+http://{member.host}:{member.port}"
        found = coordination.get_coordinator(
            url, f"dmutex-bench-{uuid.uuid4().hex[:8]}".encode(), lock_timeout=ttl
        )
        if not isinstance(found, Etcd3Driver):
            raise BenchmarkError(f"tooz gave {type(found).__name__} for {url}")
        count_gateway(found.client, tally)
        found.start(start_heart=False)
        return cls(found)

    def stop(self) -> None:
        self.coordinator.stop()


# --- the contenders ----------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def fresh_lease() -> tuple[bytes, int]:
    """A fresh ``uuid4`` token, and 63 bits of it as a lease ID (never 0: the server's pick)."""
    token = uuid.uuid4()
    return str(token).encode(), (token.int >> 65) or 1


def lease_seconds(ttl_s: float) -> int:
    """The TTL of a lease for ``ttl_s``, as dmutex asks for it: whole seconds, rounded up."""
    return max(1, math.ceil(ttl_s))


def sync_cycles(
    client: etcd3gw.Etcd3Client, coordinator: Tooz | None, prefix: str, ttl_s: float
) -> dict[str, Callable[[], None]]:
    """The sync contenders: ``dmutex``, ``raw``, ``etcd3gw-lock``, ``tooz`` (when installed)."""
    mutex = DMutex("bench", client, key_prefix=f"{prefix}dmutex:", default_ttl_seconds=ttl_s)
    seconds = lease_seconds(ttl_s)
    raw_key = _b64(f"{prefix}raw:permit:0:k".encode())
    post, url = client.post, client.get_url

    def dmutex() -> None:
        lock = mutex.acquire("k")
        if lock is None or not lock.release():
            raise BenchmarkError("dmutex: uncontended acquire/release failed")

    def raw() -> None:
        token, lease = fresh_lease()
        post(url("/lease/grant"), json={"TTL": seconds, "ID": lease})
        compare = {"key": raw_key, "target": "VERSION", "result": "EQUAL", "version": 0}
        put = {"key": raw_key, "value": _b64(token), "lease": lease}
        reply = post(
            url("/kv/txn"),
            json={
                "compare": [compare],
                "success": [{"request_put": put}],
                "failure": [{"request_range": {"key": raw_key}}],
            },
        )
        if reply.get("succeeded") is not True:
            raise BenchmarkError("raw: the put-if-absent transaction failed on a free key")
        fence = int(reply["responses"][0]["response_put"]["header"]["revision"])
        post(url("/kv/lease/revoke"), json={"ID": lease})
        if fence <= 0:
            raise BenchmarkError(f"raw: revision {fence}")

    def etcd3gw_lock() -> None:
        lock = client.lock(f"{prefix}etcd3gw", ttl=seconds)
        if not lock.acquire() or not lock.release():
            raise BenchmarkError("etcd3gw-lock: uncontended acquire/release failed")

    found = {"dmutex": dmutex, "raw": raw, "etcd3gw-lock": etcd3gw_lock}
    if coordinator is not None:
        tooz = coordinator.coordinator
        name = f"/{prefix}tooz".encode()

        def tooz_lock() -> None:
            lock = tooz.get_lock(name)
            if not lock.acquire(blocking=False) or not lock.release():
                raise BenchmarkError("tooz: uncontended acquire/release failed")

        found["tooz"] = tooz_lock
    return found


def async_cycles(
    client: aetcd.Client, prefix: str, ttl_s: float
) -> dict[str, Callable[[], Awaitable[None]]]:
    """The asyncio contenders, one aetcd client: ``dmutex-async``, ``raw-async``, ``aetcd-lock``."""
    mutex = AsyncDMutex(
        "bench", client, key_prefix=f"{prefix}dmutex-async:", default_ttl_seconds=ttl_s
    )
    seconds = lease_seconds(ttl_s)
    raw_key = f"{prefix}raw-async:permit:0:k".encode()
    lock_key = f"{prefix}aetcd-lock".encode()
    ops = client.transactions
    # aetcd's Lock is not in stubs/aetcd (dmutex never uses it): its own calls, untyped.
    make_lock: Callable[[bytes, int], Any] = cast(Any, client).lock

    async def dmutex() -> None:
        lock = await mutex.acquire("k")
        if lock is None or not await lock.release():
            raise BenchmarkError("dmutex-async: uncontended acquire/release failed")

    async def raw() -> None:
        token, lease = fresh_lease()
        await client.lease(seconds, lease_id=lease)
        succeeded, responses = await client.transaction(
            compare=[ops.version(raw_key) == 0],
            success=[ops.put(raw_key, token, lease=lease)],
            failure=[ops.get(raw_key)],
        )
        if succeeded is not True:
            raise BenchmarkError("raw-async: the put-if-absent transaction failed on a free key")
        fence = int(responses[0].response_put.header.revision)
        await client.revoke_lease(lease)
        if fence <= 0:
            raise BenchmarkError(f"raw-async: revision {fence}")

    async def aetcd_lock() -> None:
        lock = make_lock(lock_key, seconds)
        if await lock.acquire() is not True or await lock.release() is not True:
            raise BenchmarkError("aetcd-lock: uncontended acquire/release failed")

    return {"dmutex-async": dmutex, "raw-async": raw, "aetcd-lock": aetcd_lock}


# --- the run ---------------------------------------------------------------------------


def bench(member: Member, args: argparse.Namespace) -> dict[str, object]:
    """Measure every contender on ``member``; print and return the figures."""
    print(
        f"{args.rounds} rounds x {args.cycles} cycles in turns of {args.chunk}, after "
        f"{args.warmup} warm-up cycles; leases of {lease_seconds(args.ttl)} s",
        flush=True,
    )
    prefix = f"{member.prefix}cycle-{uuid.uuid4().hex[:8]}/"
    tally = Tally()
    leases_before = member.leases()
    client = etcd3gw.Etcd3Client(host=member.host, port=member.port, timeout=CLIENT_TIMEOUT_S)
    count_gateway(client, tally)
    coordinator = Tooz.start(member, tally, lease_seconds(args.ttl))
    loop = asyncio.new_event_loop()
    aclient = aetcd.Client(host=member.host, port=member.port, timeout=CLIENT_TIMEOUT_S)
    count_grpc(aclient, tally)
    spent: dict[str, Spent] = {}
    try:
        contenders: dict[str, Batch] = {}
        for name, cycle in sync_cycles(client, coordinator, prefix, args.ttl).items():
            contenders[name] = spending(timed(cycle), tally, spent.setdefault(name, Spent()))
        for name, acycle in async_cycles(aclient, prefix, args.ttl).items():
            batch = timed_async(loop, acycle)
            contenders[name] = spending(batch, tally, spent.setdefault(name, Spent()))
        figures = harness.interleave(
            contenders,
            rounds=args.rounds,
            per_round=args.cycles,
            turn=args.chunk,
            warmup=args.warmup,
        )
    finally:
        if coordinator is not None:
            coordinator.stop()
        loop.run_until_complete(aclient.close())
        loop.close()
        client.session.close()
    leases_after = member.leases()
    harness.figures_table(figures, "Acquire + release of a free mutex (cycles/s, µs)")
    requests = exact(spent)
    rows = [
        [
            name,
            requests[name],
            ", ".join(f"{kind} {n:g}" for kind, n in s.per_cycle().items()),
            s.leases_left,
            s.cpu_s / s.cycles * 1e6,
        ]
        for name, s in spent.items()
    ]
    head = ["contender", "requests", "by kind", "leases left", "client CPU µs"]
    harness.table(head, rows, "Per cycle, counted at the client in the timed run:")
    print(
        f"\nLeases on the member: {leases_before} before the run, {leases_after} after it "
        f"(the peers' leases live {lease_seconds(args.ttl)} s after their cycle)"
    )
    pairs = [("dmutex", "raw"), ("dmutex", "etcd3gw-lock"), ("raw", "etcd3gw-lock")]
    if "tooz" in figures:
        pairs += [("dmutex", "tooz"), ("tooz", "etcd3gw-lock")]
    pairs += [
        ("dmutex-async", "raw-async"),
        ("dmutex-async", "aetcd-lock"),
        ("raw-async", "aetcd-lock"),
        ("dmutex-async", "dmutex"),
    ]
    ratios = harness.ratio_table(figures, pairs, ("ops/s", "p50", "mean"))
    targets = [
        Target("DMutex / raw (cycles/s)", ratios["dmutex / raw, ops/s"].median, 0.9, True),
        Target(
            "AsyncDMutex / raw-async (cycles/s)",
            ratios["dmutex-async / raw-async, ops/s"].median,
            0.9,
            True,
        ),
    ]
    harness.targets_table(targets)
    return {
        "figures": figures,
        "ratios": ratios,
        "targets": targets,
        "requests": requests,
        "requests_by_kind": {name: s.per_cycle() for name, s in spent.items()},
        "leases_left_per_cycle": {name: s.leases_left for name, s in spent.items()},
        "client_cpu_us_per_cycle": {name: s.cpu_s / s.cycles * 1e6 for name, s in spent.items()},
        "member_leases": {"before": leases_before, "after": leases_after},
    }


def run(argv: Sequence[str] | None = None) -> int:
    return run_on_member(bench, harness.parse(__doc__, argv, OPTIONS, redis=False))


if __name__ == "__main__":
    sys.exit(run())

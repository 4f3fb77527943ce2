"""How close dmutex's DynamoDB lock cycle comes to its two requests, and what each operation sends.

Run from the repository root (a report, not a test; 3 min for both servers at load 4-5)::

    .venv/bin/python benchmarks/dynamodb_cycle.py
    .venv/bin/python benchmarks/dynamodb_cycle.py --server dynalite --quick --json out.json
    .venv/bin/python benchmarks/dynamodb_cycle.py --cycles 400 --rounds 7

NOT DynamoDB: the servers are the two the tests start
(``tests/_support/dynamodb_servers.py``), each of which speaks DynamoDB's
protocol: moto's server (``python -m moto.server``, the test extra) and
dynalite (the npm package, run by ``node`` on 127.0.0.1), each started here
in memory on a free loopback port and stopped by its pid after its run,
one after the other (``--server moto,dynalite``, the default; either alone).
This script never measures an endpoint it did not start:
``DMUTEX_DYNAMODB_URL`` is ignored. A time measured here is a local
server's, in Python or in JavaScript, and says nothing of DynamoDB's own
latency; the ratios between contenders that send the same requests, and
the requests and capacity units per operation, are what carry over.

1. The uncontended cycle, acquire + release of one key. After a warm-up,
   ``--rounds`` rounds of ``--cycles`` cycles per contender, interleaved in
   turns of ``--chunk`` (``harness.interleave``), each cycle timed with
   ``time.perf_counter_ns``:

   - ``dmutex``: ``DMutex.acquire(key)`` then ``lock.release()`` on one
     boto3 client: a conditional PutItem of the slot's item, a conditional
     DeleteItem of it (``dmutex/_backends/dynamodb/store.py``, rules 2 and 4);
   - ``raw``: those two requests, with the same expressions, sent through
     the same client (``client.put_item(...)``, ``client.delete_item(...)``),
     a fresh ``uuid4`` token a cycle: the floor of the protocol;
   - ``dmutex-async`` / ``raw-async``: the same on one aiobotocore client
     (``AsyncDMutex``; ``await client.put_item(...)``), each turn run to
     completion on one event loop, outside the timed region.

   The raw contenders' requests are checked against dmutex's, as botocore
   is handed them (the operation, its parameters' names, the condition and
   the attribute names and placeholders): a run where they differ fails.

2. Requests per operation, counted at the client (botocore's
   ``before-parameter-build`` event: one per operation called; its
   ``before-send``: each HTTP request, retries included), on fresh keys, each
   operation ``--counts`` times: a mutex acquire of a free key and of a held
   one, ``extend``, ``release``; a fenced acquire (``fencing=True``) with the
   key's counter absent and with it ahead of the clock; a semaphore of
   ``--permits`` permits: the acquire of an empty key, of a full one, of one
   with one free slot (the first slot tried is random: the mean), the
   release and extend by key and token, a permit's release. Beside them,
   the same operations as the TypeScript library's DynamoDB store sends them
   (``src/dynamodb-store.ts`` and ``src/semaphore.ts`` at
   :data:`TYPESCRIPT_COMMIT`): computed from its source, not measured.
   Capacity units per operation as DynamoDB's documentation defines them
   (:data:`CAPACITY_RULE`), computed from the requests counted; the largest
   item stored or written is measured by DynamoDB's item size rule, and a
   run whose items pass 1 KB fails (the rule would not hold).

Options: ``--cycles`` per contender per round, ``--rounds``, ``--chunk``
(cycles per turn), ``--warmup`` (cycles per contender), ``--ttl`` (s),
``--counts`` (samples per counted operation), ``--permits`` (the counted
semaphore's), ``--server`` (``moto``, ``dynalite`` or both, comma-separated);
``--quick``, ``--json FILE``.

Target: dmutex >= 0.9x raw cycles/s on each face (the median of the
per-round ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import math
import os
import shutil
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import botocore.exceptions
import harness
from harness import Batch, BenchmarkError, Target
from redis_cycle import timed, timed_async

from dmutex import AsyncDMutex, DMutex, DMutexError, DSemaphore

if TYPE_CHECKING:
    from tests._support.dynamodb_servers import Server

OPTIONS = {  # name: (default, under --quick)
    "cycles": (200, 20), "rounds": (5, 2), "chunk": (10, 10), "warmup": (30, 5),
    "ttl": (30.0, 30.0), "counts": (5, 2), "permits": (64, 64),
    "server": ("moto,dynalite", "moto,dynalite"),
}  # fmt: skip
KINDS = ("moto", "dynalite")
NOT_DYNAMODB = (
    "{label} is not DynamoDB: it speaks DynamoDB's protocol. Its times say nothing of "
    "DynamoDB's own latency; read the ratios, and the requests per operation."
)
TYPESCRIPT_COMMIT = "fa55975f7517c6862b68f9ce192c202ff10f7cfd"
"""The TypeScript dmutex's commit whose DynamoDB store the TypeScript rows are computed from."""

CAPACITY_RULE = (
    "DynamoDB's documented rule for items under 1 KB: a PutItem, UpdateItem or DeleteItem is "
    "1 write capacity unit (WCU), whether its condition holds or fails; a strongly consistent "
    "read is 1 read capacity unit (RCU) per item up to 4 KB, found or not, so a strongly "
    "consistent BatchGetItem is 1 RCU per key asked for (0.5 eventually consistent); "
    "TransactWriteItems is 2 WCU per item; DescribeTable and CreateTable none."
)
WRITES = ("PutItem", "UpdateItem", "DeleteItem")
FAR_MS = 3_600_000  # the expiry of the items that hold slots during a run: an hour away

# The store's expressions (dmutex/_backends/dynamodb/store.py), written out for the raw
# contenders; :func:`shape` checks that they are what dmutex sends.
GRANT = "attribute_not_exists(#k) OR #e <= :now OR #v = :token"
GRANT_NAMES = {"#k": "key", "#v": "value", "#e": "expiredAt"}
HELD_BY = "#v = :token AND #e > :now"
HELD_BY_NAMES = {"#v": "value", "#e": "expiredAt"}
# The TypeScript store's grant (src/dynamodb-store.ts): absent or expired; no own-token clause.
TS_GRANT = "attribute_not_exists(#key) OR #expiredAt <= :now"
TS_GRANT_NAMES = {"#key": "key", "#expiredAt": "expiredAt"}


# --- the servers -------------------------------------------------------------------------


def use_test_harness() -> None:
    """Make ``tests._support`` (the test harness's servers) importable."""
    if str(harness.ROOT) not in sys.path:  # run as a script: sys.path[0] is benchmarks/
        sys.path.insert(0, str(harness.ROOT))


def chosen(value: str) -> list[str]:
    """The kinds ``--server`` names (comma-separated), checked."""
    kinds = [kind.strip() for kind in value.split(",") if kind.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise BenchmarkError(f"--server {value!r}: give moto, dynalite or moto,dynalite")
    return list(dict.fromkeys(kinds))


def local_sources(kinds: Sequence[str]) -> tuple[list[Any], dict[str, str]]:
    """The test harness's sources of ``kinds`` found here (nothing started), and why not the rest.

    Only servers started here on 127.0.0.1: moto's server (``moto[server]``
    installed) and dynalite (found as the tests find it, with ``node``).
    """
    use_test_harness()
    from tests._support import dynamodb_servers as found

    sources: list[Any] = []
    missing: dict[str, str] = {}
    for kind in kinds:
        if kind == "moto":
            if found.moto_version() is None:
                missing[kind] = "moto's server is not installed (moto[server], the test extra)"
            else:
                sources.append(found.Moto())
            continue
        try:
            executable, where = found.find_dynalite()
        except ValueError as error:  # DMUTEX_DYNALITE names no file
            missing[kind] = str(error)
            continue
        node = shutil.which("node")
        if executable is None:
            missing[kind] = f"no dynalite ({found.DYNALITE_SOURCES})"
        elif node is None:
            missing[kind] = f"dynalite is at {executable}, but no node is on PATH"
        else:
            try:
                found.dynalite_package(executable)
            except ValueError as error:
                missing[kind] = f"{error} (found in {where})"
            else:
                sources.append(found.Dynalite(executable, Path(node)))
    return sources, missing


@contextmanager
def started(source: Any) -> Iterator[Server]:
    """``source``'s server, started on 127.0.0.1 in memory; stopped by its pid on the way out."""
    try:
        try:
            server: Server = source.start()
        except (RuntimeError, OSError, ValueError) as error:
            raise BenchmarkError(f"{source.label} did not start: {error}") from error
        yield server
    finally:
        source.stop()


def what(server: Server) -> str:
    """The server's name as the figures give it: never "DynamoDB"."""
    return "moto's server" if server.kind == "moto" else "dynalite"


def versions(server: Server) -> dict[str, str]:
    """The server's and the client packages' versions, printed and returned."""
    found = {"server": server.label, "origin": server.origin}
    for package in ("boto3", "botocore", "aiobotocore", "aiohttp"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    print(f"versions: {found}", flush=True)
    return found


ERRORS: tuple[type[Exception], ...] = (
    BenchmarkError,
    botocore.exceptions.BotoCoreError,
    botocore.exceptions.ClientError,
    DMutexError,
    OSError,
)
"""What ends a run with status 2: the benchmark's own failures, a client's, dmutex's, the OS's."""

Bench = Callable[["Server", argparse.Namespace], Mapping[str, object]]


def run_on_servers(bench: Bench, args: argparse.Namespace) -> int:
    """``bench(server, args)`` on each server ``--server`` names, one after the other.

    As ``harness.main``, for servers this script starts: the machine and the
    options, then per server (keyed by its label, ``moto-5.2.6``) what
    ``bench`` returned, in ``--json``; status 2 when a run could not measure.
    A kind named but not found here is said and passed over; none found is
    status 2.
    """
    report: dict[str, object] = {"machine": harness.machine(), "options": vars(args)}
    runs: dict[str, object] = {}
    print(f"Load average at the start: {os.getloadavg()[0]:.2f} (1 min)", flush=True)
    try:
        sources, missing = local_sources(chosen(args.server))
        for kind, why in missing.items():
            harness.progress(f"{kind} left out: {why}")
        if not sources:
            raise BenchmarkError(
                "no server speaking DynamoDB's protocol: " + "; ".join(missing.values())
            )
        for source in sources:
            with started(source) as server:
                print(f"\n## {server.label} ({what(server)}, {server.url}, pid {server.pid})\n")
                print(NOT_DYNAMODB.format(label=what(server)), flush=True)
                found = versions(server)
                runs[server.label] = {"url": server.url, "versions": found, **bench(server, args)}
    except ERRORS as error:
        print(f"benchmark failed: {error}", file=sys.stderr)
        return 2
    report["runs"] = runs
    print(f"\nLoad average at the end: {os.getloadavg()[0]:.2f} (1 min)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=harness.jsonable) + "\n")
        print(f"figures written to {args.json}")
    return 0


@contextmanager
def clients(server: Server, tally: Tally) -> Iterator[tuple[Any, Any, asyncio.AbstractEventLoop]]:
    """A boto3 client and an aiobotocore one (entered), both counted in ``tally``; a new loop."""
    from aiobotocore.session import get_session

    loop = asyncio.new_event_loop()
    client = server.client()
    made = get_session().create_client("dynamodb", **server.client_args())
    try:
        aclient = loop.run_until_complete(made.__aenter__())
        try:
            count(client, tally)
            count(aclient, tally)
            yield client, aclient, loop
        finally:
            loop.run_until_complete(made.__aexit__(None, None, None))
    finally:
        client.close()
        loop.close()


# --- counting at the client --------------------------------------------------------------------

Sent = tuple[str, Mapping[str, Any]]
"""An operation called (botocore's name: ``PutItem``) and the parameters it was called with."""


@dataclass
class Tally:
    """Every operation some clients called, with its parameters, and their HTTP requests."""

    calls: list[Sent] = field(default_factory=list)
    sends: int = 0


def count(client: Any, tally: Tally) -> None:
    """Note each operation ``client`` calls from now on, and each HTTP request it sends.

    botocore's events, on this client's own emitter (each client has a copy
    of its session's): ``before-parameter-build`` once per operation called,
    ``before-send`` once per HTTP request (a retry is another). aiobotocore
    emits the same events and calls these plain functions as botocore does.
    """

    def called(params: Mapping[str, Any], model: Any, **_: Any) -> None:
        tally.calls.append((str(model.name), params))

    def sent(**_: Any) -> None:
        tally.sends += 1

    client.meta.events.register("before-parameter-build.dynamodb", called)
    client.meta.events.register("before-send.dynamodb", sent)


def capacity(operation: str, params: Mapping[str, Any]) -> tuple[float, float]:
    """``(WCU, RCU)`` of one request by :data:`CAPACITY_RULE` (items under 1 KB)."""
    if operation in WRITES:
        return 1.0, 0.0
    if operation == "TransactWriteItems":
        return 2.0 * len(params.get("TransactItems", [])), 0.0
    if operation == "GetItem":
        return 0.0, 1.0 if params.get("ConsistentRead") else 0.5
    if operation == "BatchGetItem":
        units = 0.0
        for asked in params.get("RequestItems", {}).values():
            units += len(asked.get("Keys", [])) * (1.0 if asked.get("ConsistentRead") else 0.5)
        return 0.0, units
    return 0.0, 0.0


@dataclass
class Spent:
    """What some calls of one operation sent: requests by kind, HTTP requests, capacity units."""

    calls: int = 0
    requests: Counter[str] = field(default_factory=Counter)
    sends: int = 0
    wcu: float = 0.0
    rcu: float = 0.0

    def add(self, sent: Sequence[Sent], sends: int, calls: int) -> None:
        self.calls += calls
        self.sends += sends
        for operation, params in sent:
            self.requests[operation] += 1
            wcu, rcu = capacity(operation, params)
            self.wcu += wcu
            self.rcu += rcu

    @property
    def total(self) -> float:
        """Requests per call, every kind."""
        return sum(self.requests.values()) / self.calls if self.calls else math.nan

    def per_call(self) -> dict[str, float]:
        return {kind: n / self.calls for kind, n in sorted(self.requests.items())}

    def by_kind(self) -> str:
        return ", ".join(f"{n:g} {kind}" for kind, n in self.per_call().items())

    def summary(self) -> dict[str, object]:
        calls = self.calls or 1
        return {
            "calls": self.calls,
            "requests": self.total,
            "by_kind": self.per_call(),
            "http_requests": self.sends / calls,
            "wcu": self.wcu / calls,
            "rcu": self.rcu / calls,
        }


def whole(value: float) -> float | int:
    """``value`` as an int when it is one (a count prints as ``2``, not ``2.000``)."""
    return int(value) if math.isfinite(value) and value == int(value) else value


def spending(batch: Batch, tally: Tally, spent: Spent) -> Batch:
    """``batch``, its calls' requests (from ``tally``) added to ``spent``."""

    def run(n: int) -> list[int]:
        start, sends = len(tally.calls), tally.sends
        samples = batch(n)
        spent.add(tally.calls[start:], tally.sends - sends, n)
        return samples

    return run


def noted(tally: Tally, spent: Spent, operation: Callable[[], Any]) -> Any:
    """``operation()``, its requests (from ``tally``) added to ``spent`` as one call."""
    start, sends = len(tally.calls), tally.sends
    result = operation()
    spent.add(tally.calls[start:], tally.sends - sends, 1)
    return result


def exact(spent: Mapping[str, Spent]) -> dict[str, float]:
    """Requests per call of each; BenchmarkError if one is not a whole number, or retried."""
    found = {}
    for name, figures in spent.items():
        total = sum(figures.requests.values())
        if not figures.calls or total % figures.calls:
            raise BenchmarkError(f"{name}: {total} requests in {figures.calls} calls")
        if figures.sends != total:
            raise BenchmarkError(f"{name}: {figures.sends} HTTP requests for {total} operations")
        found[name] = figures.total
    return found


def shape(sent: Sent) -> tuple[object, ...]:
    """What a request must share with dmutex's to be "the same request", values aside."""
    operation, params = sent
    return (
        operation,
        tuple(sorted(params)),
        params.get("ConditionExpression"),
        params.get("UpdateExpression"),
        tuple(sorted(params.get("ExpressionAttributeNames", {}).items())),
        tuple(sorted(params.get("ExpressionAttributeValues", {}))),
        tuple(sorted(params.get("Item", {}))),
    )


def same_requests(tally: Tally, ours: Callable[[], object], theirs: Callable[[], object]) -> None:
    """BenchmarkError unless one call of ``theirs`` sends the requests one of ``ours`` does."""
    start = len(tally.calls)
    ours()
    middle = len(tally.calls)
    theirs()
    mine, raw = tally.calls[start:middle], tally.calls[middle:]
    if [shape(s) for s in mine] != [shape(s) for s in raw]:
        raise BenchmarkError(f"the raw requests are not dmutex's: {raw!r} against {mine!r}")


# --- items: sizes, fills ----------------------------------------------------------------------


def item_bytes(item: Mapping[str, Any]) -> int:
    """An item's size by DynamoDB's rule: names and strings in UTF-8, a number 1 + digits / 2."""
    size = 0
    for name, value in item.items():
        size += len(name.encode())
        if "S" in value:
            size += len(str(value["S"]).encode())
        elif "N" in value:
            digits = str(value["N"]).lstrip("-").replace(".", "").strip("0") or "0"
            size += (len(digits) + 1) // 2 + 1
        else:  # another type: its JSON, more than its size
            size += len(json.dumps(value))
    return size


def largest_item(client: Any, table: str, tally: Tally) -> int:
    """The largest item stored in ``table`` or written by a PutItem counted in ``tally``, bytes.

    BenchmarkError past 1 KB: :data:`CAPACITY_RULE` would not hold.
    """
    stored: list[Mapping[str, Any]] = []
    pages = client.get_paginator("scan").paginate(TableName=table, ConsistentRead=True)
    for page in pages:
        stored.extend(page["Items"])
    written = [params["Item"] for operation, params in tally.calls if operation == "PutItem"]
    largest = max((item_bytes(item) for item in [*stored, *written]), default=0)
    if largest > 1024:
        raise BenchmarkError(f"an item of {largest} bytes: the capacity rule is for items < 1 KB")
    return largest


def now_ms() -> int:
    return int(time.time() * 1000)


def fill(client: Any, table: str, key: str, slots: Sequence[int]) -> None:
    """Hold ``slots`` of ``key`` for an hour: items of the store's layout, 25 a BatchWriteItem."""
    expires = {"N": str(now_ms() + FAR_MS)}
    items = [
        {
            "PutRequest": {
                "Item": {
                    "key": {"S": f"permit:{slot}:{key}"},
                    "value": {"S": f"bench-holder-{slot}"},
                    "expiredAt": expires,
                }
            }
        }
        for slot in slots
    ]
    for start in range(0, len(items), 25):
        pending = {table: items[start : start + 25]}
        for _ in range(20):
            left = client.batch_write_item(RequestItems=pending).get("UnprocessedItems") or {}
            if not left:
                break
            pending = left
        else:
            raise BenchmarkError(f"BatchWriteItem left items unprocessed 20 times: {key}")


def made_ready(*faces: DMutex | DSemaphore) -> None:
    """Each face's table found or made now, so that no counted call pays DescribeTable."""
    for face in faces:
        face.ready()


# --- the cycle ---------------------------------------------------------------------------------


def raw_requests(table: str, name: str, ttl_ms: int) -> tuple[Callable[..., Any], ...]:
    """The raw cycle's two requests' builders: ``(put(token), delete(token))`` keyword arguments."""

    def put(token: str) -> dict[str, Any]:
        now = now_ms()
        return {
            "TableName": table,
            "Item": {
                "key": {"S": name},
                "value": {"S": token},
                "expiredAt": {"N": str(now + ttl_ms)},
            },
            "ConditionExpression": GRANT,
            "ExpressionAttributeNames": GRANT_NAMES,
            "ExpressionAttributeValues": {":now": {"N": str(now)}, ":token": {"S": token}},
        }

    def delete(token: str) -> dict[str, Any]:
        return {
            "TableName": table,
            "Key": {"key": {"S": name}},
            "ConditionExpression": HELD_BY,
            "ExpressionAttributeNames": HELD_BY_NAMES,
            "ExpressionAttributeValues": {":token": {"S": token}, ":now": {"N": str(now_ms())}},
        }

    return put, delete


@dataclass(frozen=True)
class Cycles:
    """The contenders, each one cycle: the sync ones, and the asyncio ones' coroutine functions."""

    sync: dict[str, Callable[[], None]]
    asynchronous: dict[str, Callable[[], Any]]


def cycles(
    client: Any, aclient: Any, loop: asyncio.AbstractEventLoop, table: str, ttl_s: float
) -> Cycles:
    """``dmutex`` and ``raw`` on ``client``; ``dmutex-async`` and ``raw-async`` on ``aclient``.

    The table is made here (the first ``ready()``), and each face's is found
    before any cycle, so that no cycle pays a DescribeTable.
    """
    ttl_ms = math.ceil(ttl_s * 1000)
    mutex = DMutex("bench", client, table_name=table, default_ttl_seconds=ttl_s)
    amutex = AsyncDMutex("bench", aclient, table_name=table, default_ttl_seconds=ttl_s)
    mutex.ready()
    loop.run_until_complete(amutex.ready())
    put, delete = raw_requests(table, "permit:0:raw", ttl_ms)
    aput, adelete = raw_requests(table, "permit:0:raw-async", ttl_ms)

    def dmutex() -> None:
        lock = mutex.acquire("cycle")
        if lock is None or not lock.release():
            raise BenchmarkError("dmutex: uncontended acquire/release failed")

    def raw() -> None:
        token = str(uuid.uuid4())
        client.put_item(**put(token))  # a failed condition raises ClientError
        client.delete_item(**delete(token))

    async def dmutex_async() -> None:
        lock = await amutex.acquire("cycle-async")
        if lock is None or not await lock.release():
            raise BenchmarkError("dmutex-async: uncontended acquire/release failed")

    async def raw_async() -> None:
        token = str(uuid.uuid4())
        await aclient.put_item(**aput(token))
        await aclient.delete_item(**adelete(token))

    return Cycles(
        {"dmutex": dmutex, "raw": raw},
        {"dmutex-async": dmutex_async, "raw-async": raw_async},
    )


# --- requests per operation ---------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What the TypeScript store sends for an operation, from its source: requests, WCU, RCU."""

    requests: int | str
    kinds: str
    wcu: int | str
    rcu: int | str = 0


@dataclass(frozen=True)
class Rows:
    """The counted operations' names, a semaphore's with its ``n`` permits."""

    n: int
    free: str = "DMutex.acquire, free"
    held: str = "DMutex.acquire, held"
    extend: str = "DMutexLock.extend"
    release: str = "DMutexLock.release"
    fenced: str = "DMutex(fencing=True).acquire, counter absent"
    ahead: str = "DMutex(fencing=True).acquire, counter ahead of the clock"
    permit_release: str = "DSemaphorePermit.release"

    @property
    def empty(self) -> str:
        return f"DSemaphore(N={self.n}).acquire, empty"

    @property
    def full(self) -> str:
        return f"DSemaphore(N={self.n}).acquire, full"

    @property
    def one_free(self) -> str:
        return f"DSemaphore(N={self.n}).acquire, slot {self.n - 1} alone free"

    @property
    def extend_by_token(self) -> str:
        return f"DSemaphore(N={self.n}).extend(key, token)"

    @property
    def release_by_token(self) -> str:
        return f"DSemaphore(N={self.n}).release(key, token)"


def typescript(n: int) -> dict[str, Plan | None]:
    """The TypeScript store's requests per operation (None: it has no such operation).

    From ``src/dynamodb-store.ts`` and ``src/semaphore.ts``: a mutex is a
    one-permit semaphore; ``acquire`` tries slot 0, 1, ... with a conditional
    PutItem each until one succeeds; ``release(key, token)`` and
    ``extend(key, token)`` try DeleteItem / UpdateItem slot after slot from
    0 until one succeeds (``s + 1`` for the permit at slot ``s``, N when the
    token holds none); a permit's own release and extend name its slot. No
    fencing. The one-free-slot row is this script's setup: slot N-1 free.
    """
    row = Rows(n)
    return {
        row.free: Plan(1, "1 PutItem", 1),
        row.held: Plan(1, "1 PutItem", 1),
        row.extend: Plan(1, "1 UpdateItem", 1),
        row.release: Plan(1, "1 DeleteItem", 1),
        row.fenced: None,
        row.ahead: None,
        row.empty: Plan(1, "1 PutItem (slot 0)", 1),
        row.full: Plan(n, f"{n} PutItem (slots 0..{n - 1})", n),
        row.one_free: Plan(n, f"{n} PutItem (slots 0..{n - 1})", n),
        row.extend_by_token: Plan(
            "s+1", f"UpdateItem on slots 0..s (s: the permit's slot; up to {n})", "s+1"
        ),
        row.release_by_token: Plan(
            "s+1", f"DeleteItem on slots 0..s (s: the permit's slot; up to {n})", "s+1"
        ),
        row.permit_release: Plan(1, "1 DeleteItem", 1),
    }


def granted(value: Any, name: str) -> Any:
    """``value``, unless it is None or False: then the operation ``name`` failed."""
    if value is None or value is False:
        raise BenchmarkError(f"{name}: {value!r} where a grant (or True) was due")
    return value


def operations(
    client: Any, admin: Any, tally: Tally, table: str, args: argparse.Namespace
) -> dict[str, Spent]:
    """Each operation ``--counts`` times on fresh keys, its requests counted (untimed)."""
    ttl, n = args.ttl, args.permits
    if n < 2:
        raise BenchmarkError(f"--permits {n}: the semaphore's rows need 2 or more")
    mutex = DMutex("bench", client, table_name=table, default_ttl_seconds=ttl)
    fenced = DMutex("bench", client, table_name=table, default_ttl_seconds=ttl, fencing=True)
    sem = DSemaphore("bench", client, table_name=table, max_permits=n, default_ttl_seconds=ttl)
    made_ready(mutex, fenced, sem)
    row = Rows(n)
    spent = {name: Spent() for name in typescript(n)}
    fill(admin, table, "full", range(n))
    fill(admin, table, "busy", range(n - 1))

    def note(name: str, operation: Callable[[], Any]) -> Any:
        return noted(tally, spent[name], operation)

    for i in range(args.counts):
        key, ahead = f"count-{i}", f"ahead-{i}"
        lock = granted(note(row.free, partial(mutex.acquire, key)), row.free)
        if note(row.held, partial(mutex.acquire, key)) is not None:
            raise BenchmarkError(f"{row.held}: granted")
        granted(note(row.extend, lock.extend), row.extend)
        granted(note(row.release, lock.release), row.release)
        granted(note(row.fenced, partial(fenced.acquire, f"fenced-{i}")), row.fenced).release()
        admin.put_item(
            TableName=table,
            Item={
                "key": {"S": f"fence:{ahead}"},
                "kind": {"S": "dmutex-fence"},
                "fence": {"N": str(now_ms() * 1000 + 10**12)},  # 11 days ahead, in µs
            },
        )
        granted(note(row.ahead, partial(fenced.acquire, ahead)), row.ahead).release()
        permit = granted(note(row.empty, partial(sem.acquire, key)), row.empty)
        if note(row.full, partial(sem.acquire, "full")) is not None:
            raise BenchmarkError(f"{row.full}: granted")
        busy = granted(note(row.one_free, partial(sem.acquire, "busy")), row.one_free)
        if busy.slot != n - 1 or not busy.release():
            raise BenchmarkError(f"{row.one_free}: granted slot {busy.slot}, not the free one")
        token = permit.token
        granted(note(row.extend_by_token, partial(sem.extend, key, token)), row.extend_by_token)
        granted(note(row.release_by_token, partial(sem.release, key, token)), row.release_by_token)
        permit = granted(sem.acquire(key), row.permit_release)
        granted(note(row.permit_release, permit.release), row.permit_release)
    return spent


def operations_table(spent: Mapping[str, Spent], plans: Mapping[str, Plan | None]) -> None:
    rows = []
    for name, mine in spent.items():
        plan = plans[name]
        theirs: list[object] = (
            ["-", "no fencing", "-", "-"]
            if plan is None
            else [plan.requests, plan.kinds, plan.wcu, plan.rcu]
        )
        rows.append(
            [
                name,
                whole(mine.total),
                mine.by_kind(),
                whole(mine.wcu / mine.calls),
                whole(mine.rcu / mine.calls),
                *theirs,
            ]
        )
    head = ["operation", "dmutex", "by kind", "WCU", "RCU", "TypeScript", "by kind", "WCU", "RCU"]
    harness.table(
        head,
        rows,
        "Requests and capacity units per operation: dmutex's counted at the client (mean of "
        f"{next(iter(spent.values())).calls}); the TypeScript store's computed from its source "
        f"(commit {TYPESCRIPT_COMMIT[:7]}), not measured",
    )
    print(f"\nCapacity units: {CAPACITY_RULE}", flush=True)


# --- the run -----------------------------------------------------------------------------------


def bench(server: Server, args: argparse.Namespace) -> dict[str, object]:
    """Measure the cycle and count each operation on ``server``; print and return the figures."""
    print(
        f"{args.rounds} rounds x {args.cycles} cycles in turns of {args.chunk}, after "
        f"{args.warmup} warm-up cycles; leases of {args.ttl:g} s; one client of each face",
        flush=True,
    )
    table = f"dmutex-bench-{uuid.uuid4().hex[:8]}"
    tally = Tally()
    spent: dict[str, Spent] = {}
    with server.connect() as admin, clients(server, tally) as (client, aclient, loop):
        found = cycles(client, aclient, loop, table, args.ttl)
        same_requests(tally, found.sync["dmutex"], found.sync["raw"])
        asynchronous = found.asynchronous
        same_requests(
            tally,
            lambda: loop.run_until_complete(asynchronous["dmutex-async"]()),
            lambda: loop.run_until_complete(asynchronous["raw-async"]()),
        )
        contenders: dict[str, Batch] = {}
        for name, cycle in found.sync.items():
            contenders[name] = spending(timed(cycle), tally, spent.setdefault(name, Spent()))
        for name, acycle in asynchronous.items():
            batch = timed_async(loop, acycle)
            contenders[name] = spending(batch, tally, spent.setdefault(name, Spent()))
        figures = harness.interleave(
            contenders,
            rounds=args.rounds,
            per_round=args.cycles,
            turn=args.chunk,
            warmup=args.warmup,
        )
        counted = operations(client, admin, tally, table, args)
        largest = largest_item(admin, table, tally)
    harness.figures_table(
        figures, f"Acquire + release of a free mutex on {what(server)} (cycles/s, µs)"
    )
    requests = exact(spent)
    rows = [
        [name, whole(requests[name]), s.by_kind(), whole(s.wcu / s.calls)]
        for name, s in spent.items()
    ]
    harness.table(
        ["contender", "requests", "by kind", "WCU"],
        rows,
        "Per cycle, counted at the client in the timed run (the raw contenders' requests are "
        "dmutex's: checked):",
    )
    ratios = harness.ratio_table(
        figures,
        [("dmutex", "raw"), ("dmutex-async", "raw-async"), ("dmutex-async", "dmutex")],
        ("ops/s", "p50", "mean"),
    )
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
    plans = typescript(args.permits)
    operations_table(counted, plans)
    print(f"The largest item stored or written: {largest} bytes (DynamoDB's item size rule)")
    return {
        "figures": figures,
        "ratios": ratios,
        "targets": targets,
        "requests": requests,
        "requests_by_kind": {name: s.per_call() for name, s in spent.items()},
        "operations": {name: s.summary() for name, s in counted.items()},
        "typescript": plans,
        "typescript_commit": TYPESCRIPT_COMMIT,
        "capacity_rule": CAPACITY_RULE,
        "largest_item_bytes": largest,
    }


def run(argv: Sequence[str] | None = None) -> int:
    return run_on_servers(bench, harness.parse(__doc__, argv, OPTIONS, redis=False))


if __name__ == "__main__":
    sys.exit(run())

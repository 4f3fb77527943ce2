"""A DynamoDB semaphore's full acquire at 1, 64 and 1,024 permits, against the TypeScript store's.

Run from the repository root (a report, not a test; 2.5 min for both servers at load 4-5)::

    .venv/bin/python benchmarks/dynamodb_semaphore.py
    .venv/bin/python benchmarks/dynamodb_semaphore.py --server dynalite --quick --json out.json
    .venv/bin/python benchmarks/dynamodb_semaphore.py --permits 1 16 256 --rounds 2

NOT DynamoDB: the servers are moto's server and dynalite, each of which
speaks DynamoDB's protocol, started here as ``dynamodb_cycle.py`` starts
them (``tests/_support/dynamodb_servers.py``: in memory on a free 127.0.0.1
port, stopped by pid after its run; ``--server moto,dynalite``, the default,
or either alone). A time measured here is a local server's and says nothing
of DynamoDB's own latency: read the requests per call, which carry over
(on DynamoDB each is a round trip over the network), and the ratios between
contenders measured in the same rounds.

The refused acquire: every one of a key's N permits held (items of the
store's layout, expiring in an hour, written by BatchWriteItem), the answer
None. For each N in ``--permits``, ``--rounds`` rounds in which the
contenders take turns (``harness.interleave``, a turn a round), each call
timed with ``time.perf_counter_ns``. A contender's turn is ``--samples``
calls times ``min(50, ceil(256 / N))`` (at least 1): 250 at N = 1, 20 at
N = 64, 5 at N = 1,024 by default, so that the cheap cases, the ratios'
base, are not read from a handful of calls while each N costs about the
same time:

- ``dmutex N=n``: ``DSemaphore(max_permits=n).acquire(key)`` on one boto3
  client: a conditional PutItem of a random slot, then (N > 1) a strongly
  consistent BatchGetItem of the N slots, 100 keys a request
  (``dmutex/_backends/dynamodb/store.py``, rule 3): 1 + ceil(N / 100)
  requests;
- ``raw N=n``: those requests, with the same expressions, sent through the
  same client, the replies read for their count of items: the floor of
  dmutex's algorithm (checked to be dmutex's requests, as botocore is
  handed them);
- ``typescript N=n``: the TypeScript library's algorithm
  (``src/semaphore.ts`` on ``src/dynamodb-store.ts``): a conditional PutItem
  of slot 0, 1, ... N-1 in turn, each refused, with that store's condition
  (absent or expired): N requests, sent raw through the same client.

Requests per call are counted at the client in the timed run (botocore's
events, as in ``dynamodb_cycle.py``), and capacity units per call computed
from them by DynamoDB's documented rule (``dynamodb_cycle.CAPACITY_RULE``):
dmutex's full acquire is 1 WCU and N RCU, the TypeScript store's N WCU.

Options: ``--permits`` (the Ns; ``--quick``: 1, 64 and 256), ``--rounds``,
``--samples`` (calls per contender per round at N = 1,024 and above, times
the factor above), ``--warmup`` (likewise), ``--server``; ``--quick``,
``--json FILE``.

No target: the ratios to the 1-permit case, and TypeScript / dmutex at each
N, are figures.
"""

from __future__ import annotations

import argparse
import math
import secrets
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import botocore.exceptions
import harness
from dynamodb_cycle import (
    CAPACITY_RULE,
    GRANT,
    GRANT_NAMES,
    TS_GRANT,
    TS_GRANT_NAMES,
    Spent,
    Tally,
    count,
    exact,
    fill,
    largest_item,
    now_ms,
    run_on_servers,
    same_requests,
    spending,
    what,
    whole,
)
from harness import Batch, BenchmarkError
from redis_cycle import timed

from dmutex import DSemaphore

if TYPE_CHECKING:
    from tests._support.dynamodb_servers import Server

OPTIONS = {  # name: (default, under --quick)
    "permits": ([1, 64, 1024], [1, 64, 256]), "rounds": (4, 1), "samples": (5, 1),
    "warmup": (1, 0), "server": ("moto,dynalite", "moto,dynalite"),
}  # fmt: skip
TTL_S = 30.0  # the refused acquires' TTL: nothing is granted
CHEAP = 256  # a contender at N permits makes min(MOST, ceil(CHEAP / N)) calls per call asked
MOST = 50
BATCH_KEYS = 100  # BatchGetItem's bound, as the store reads


def per_call(n: int) -> int:
    """How many calls a contender at ``n`` permits makes for each one asked for."""
    return max(1, min(MOST, math.ceil(CHEAP / n)))


def repeated(batch: Batch, times: int) -> Batch:
    """``batch``, ``times`` calls for each one asked for."""
    return lambda count: batch(count * times)


def refused(operation: Callable[..., object], **request: Any) -> None:
    """Send ``request``; return if its condition failed, else BenchmarkError (it was granted)."""
    try:
        operation(**request)
    except botocore.exceptions.ClientError as error:
        if error.response.get("Error", {}).get("Code") == "ConditionalCheckFailedException":
            return
        raise
    raise BenchmarkError(f"a conditional write on a full key succeeded: {request!r}")


def contenders(client: Any, table: str, n: int) -> dict[str, Callable[[], None]]:
    """``dmutex``, ``raw`` and ``typescript`` refused acquires of a full key of ``n`` permits."""
    key = f"full-{n}"
    names = [f"permit:{slot}:{key}" for slot in range(n)]
    ttl_ms = math.ceil(TTL_S * 1000)
    sem = DSemaphore("bench", client, table_name=table, max_permits=n, default_ttl_seconds=TTL_S)
    sem.ready()
    put, batch_get = client.put_item, client.batch_get_item

    def dmutex() -> None:
        if sem.acquire(key) is not None:
            raise BenchmarkError(f"dmutex N={n}: granted on a full key")

    def take(name: str, token: str, condition: str, attributes: dict[str, str]) -> None:
        now = now_ms()
        values = {":now": {"N": str(now)}}
        if condition == GRANT:
            values[":token"] = {"S": token}
        item = {"key": {"S": name}, "value": {"S": token}, "expiredAt": {"N": str(now + ttl_ms)}}
        refused(
            put,
            TableName=table,
            Item=item,
            ConditionExpression=condition,
            ExpressionAttributeNames=attributes,
            ExpressionAttributeValues=values,
        )

    def raw() -> None:
        token = str(uuid.uuid4())
        take(names[secrets.randbelow(n)], token, GRANT, GRANT_NAMES)
        if n == 1:
            return
        for start in range(0, n, BATCH_KEYS):
            keys = [{"key": {"S": name}} for name in names[start : start + BATCH_KEYS]]
            answer = batch_get(RequestItems={table: {"Keys": keys, "ConsistentRead": True}})
            if answer.get("UnprocessedKeys") or len(answer["Responses"][table]) != len(keys):
                raise BenchmarkError(f"raw N={n}: BatchGetItem answered {answer!r}")

    def typescript() -> None:
        token = str(uuid.uuid4())
        for name in names:
            take(name, token, TS_GRANT, TS_GRANT_NAMES)

    return {f"dmutex N={n}": dmutex, f"raw N={n}": raw, f"typescript N={n}": typescript}


def bench(server: Server, args: argparse.Namespace) -> dict[str, object]:
    """Measure the full acquire at every N on ``server``; print and return the figures."""
    permits = sorted(set(args.permits))
    turns = ", ".join(f"N={n}: {args.samples * per_call(n)}" for n in permits)
    warm = ", ".join(f"{args.warmup * per_call(n)}" for n in permits)
    print(
        f"{args.rounds} rounds; calls per contender a round: {turns}, after {warm} warm-up "
        "calls; every permit held; one boto3 client",
        flush=True,
    )
    table = f"dmutex-bench-{uuid.uuid4().hex[:8]}"
    tally = Tally()
    spent: dict[str, Spent] = {}
    batches: dict[str, Batch] = {}
    with server.connect() as admin, server.connect() as client:
        count(client, tally)
        for n in permits:
            calls = contenders(client, table, n)
            fill(admin, table, f"full-{n}", range(n))
            same_requests(tally, calls[f"dmutex N={n}"], calls[f"raw N={n}"])
            for name, call in calls.items():
                counted = spending(timed(call), tally, spent.setdefault(name, Spent()))
                batches[name] = repeated(counted, per_call(n))
        started = time.monotonic()
        figures = harness.interleave(
            batches,
            rounds=args.rounds,
            per_round=args.samples,
            turn=args.samples,
            warmup=args.warmup,
        )
        elapsed = time.monotonic() - started
        largest = largest_item(admin, table, tally)
    harness.figures_table(
        figures, f"The refused acquire of a full key on {what(server)} (calls/s, µs a call)"
    )
    requests = exact(spent)
    rows = [
        [name, whole(requests[name]), s.by_kind(), whole(s.wcu / s.calls), whole(s.rcu / s.calls)]
        for name, s in spent.items()
    ]
    harness.table(
        ["contender", "requests", "by kind", "WCU", "RCU"],
        rows,
        "Per call, counted at the client in the timed run; capacity units by DynamoDB's rule",
    )
    print(f"\nCapacity units: {CAPACITY_RULE}", flush=True)
    base = permits[0]
    pairs = [
        (f"{who} N={n}", f"{who} N={base}")
        for who in ("dmutex", "typescript", "raw")
        for n in permits
        if n != base
    ]
    pairs += [(f"typescript N={n}", f"dmutex N={n}") for n in permits]
    pairs += [(f"dmutex N={n}", f"raw N={n}") for n in permits]
    ratios = harness.ratio_table(
        figures,
        pairs,
        ("p50", "mean"),
        f"Ratios of time per call (contender / baseline), each pair in the same rounds; "
        f"N={base} the base:",
    )
    print(f"\nTimed part: {elapsed:.1f} s; the largest item: {largest} bytes")
    return {
        "figures": figures,
        "ratios": ratios,
        "requests": requests,
        "requests_by_kind": {name: s.per_call() for name, s in spent.items()},
        "capacity": {
            name: {"wcu": s.wcu / s.calls, "rcu": s.rcu / s.calls} for name, s in spent.items()
        },
        "capacity_rule": CAPACITY_RULE,
        "largest_item_bytes": largest,
    }


def run(argv: Sequence[str] | None = None) -> int:
    return run_on_servers(bench, harness.parse(__doc__, argv, OPTIONS, redis=False))


if __name__ == "__main__":
    sys.exit(run())

"""The benchmarks stay runnable: each quick run exits 0 and writes the figures it measured.

What this shows: the scripts and their harness (``benchmarks/harness.py``)
still run against this dmutex and the servers the test harness finds, and
their ``--json`` holds a positive median and rate for every figure (a finite one for the
figures that may be negative, ``SIGNED`` below). What it
does not: anything about speed (no figure is compared with a bound here;
the benchmarks' own targets print PASS/MISS and are read by people, on a
quiet machine). ``handoff.py`` is left out: its quickest run takes about a
minute; its measurement of one process's cycle is ``redis_cycle.py``'s,
which runs here, and ``redis_peers.py``'s quick run (about 15 seconds) runs
its hand-off and contended parts. The PostgreSQL scripts run on the session's PostgreSQL server
(``--postgres-url``, from ``tests/_support/postgres_servers.py``), each in a schema of its own;
``mysql_cycle.py`` on the session's MariaDB/MySQL server (``--url``), in a database of its own,
whose statement counts
are checked too: they are what that script reports beside its timings, and the known counts
(its raw contenders' own, one statement per mutex acquire, a semaphore's read and take) show
that it counted what it claims. ``redis_readwrite.py``'s counts are checked likewise: one
request per acquire and per release (mutex, read and write, both faces), and no reader granted
after a waiting writer's first attempt (writer preference; the grants placed by their fences).
The etcd scripts run on the member the test harness finds (``tests/_support/etcd_servers.py``),
each starting its own; their request counts, taken at the client, are checked: three requests
a cycle for every contender of ``etcd_cycle.py`` (the store's grant, transaction and revoke, as
its docstring promises), a watching waiter's exact requests per hand-off in
``etcd_handoff.py`` (a failed attempt, one watch, the winning attempt) and none of a refused
watch's, and in ``etcd_renewal.py`` one keep-alive per renewal and nothing else in its window.
The DynamoDB scripts start their own server (dynalite where it is here, else moto's server; both
speak DynamoDB's protocol and are not DynamoDB), in memory on 127.0.0.1; their request
counts, taken at the client, are checked: two a cycle for every contender of
``dynamodb_cycle.py`` and the store's documented requests per operation (a PutItem per mutex
acquire, one UpdateItem more when fenced, two when the counter is ahead of the clock, one
BatchGetItem per 100 permits beside a semaphore's refused acquire), and in
``dynamodb_semaphore.py`` 1 + ceil(N / 100) requests for dmutex's full acquire against N for
the TypeScript store's, with the capacity units computed from them. ``lean_paths.py`` runs on
each of Redis, PostgreSQL and MySQL found here (``--store``; the SQL ones the session's): its
ratios to the mutex are checked present and positive on every face, its counts as counts (whole
numbers, every Redis contender two requests a cycle, the raw one 4 server commands, a SQL mutex
2 statements), and issue 43's five targets printed when Redis ran.

The quick runs start together when the module does, two at a time (``quick_runs``: the
scripts that read a Redis server's command counts one after another, the others beside them),
and each test checks its own script's.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests._support import (
    dynamodb_servers,
    etcd_servers,
    fault_servers,
    mysql_servers,
    postgres_servers,
)
from tests._support.redis_servers import discovered

ROOT = Path(__file__).parent.parent
REDIS = [
    "redis_cycle",
    "renewal_scale",
    "semaphore_scale",
    "redis_peers",
    "redis_replicas",
    "redis_readwrite",
    "observe_cost",
]
# Those that run on every Redis version found unless --redis names some: here on
# the newest alone (a quick run shows the script works; the versions' figures are
# what a person runs it for). About 27 s less than on three.
EVERY_REDIS = {"redis_cycle", "renewal_scale", "semaphore_scale"}
POSTGRES = ["postgres_cycle", "postgres_semaphore", "postgres_handoff"]
MYSQL = ["mysql_cycle"]
ETCD = ["etcd_cycle", "etcd_handoff", "etcd_renewal"]
DYNAMODB = ["dynamodb_cycle", "dynamodb_semaphore"]
LEAN = ["lean_paths"]  # on every store found of Redis, PostgreSQL and MySQL
SCRIPTS = ["sqlite_cycle", *REDIS, *POSTGRES, *MYSQL, *ETCD, *DYNAMODB, *LEAN]
# What mysql_cycle.py must count: its raw SQL's, and the MySQL store's documented ones.
MYSQL_STATEMENTS = {
    "DMutex(fencing=False).acquire, granted": 1,
    "DMutex(fencing=True).acquire, granted": 1,
    "DMutex.acquire, refused": 1,
    "DMutexLock.release": 1,
    "DSemaphore.acquire, full, N=64": 1,
    "DSemaphore.acquire, empty, N=64": 2,
    "cycle: dmutex": 2,
    "cycle: dmutex fenced": 2,
    "cycle: raw ts": 3,
    "cycle: raw 1": 2,
    "cycle: dmutex aiomysql": 2,
}

# What etcd_cycle.py must count at the client, per cycle: every contender sends three
# requests; dmutex's are the store's lease grant, put-if-absent transaction and revoke.
# tooz's driver is measured when tooz (the bench extra) is installed.
ETCD_CYCLE_REQUESTS = dict.fromkeys(
    ("dmutex", "raw", "etcd3gw-lock", "dmutex-async", "raw-async", "aetcd-lock"), 3
)
ETCD_CYCLE_KINDS = {
    "dmutex": {"kv/lease/revoke": 1, "kv/txn": 1, "lease/grant": 1},
    "dmutex-async": {"lease": 1, "revoke_lease": 1, "transaction": 1},
}
# What etcd_handoff.py's watching waiter sends per hand-off: a failed attempt (grant,
# transaction, revoke), one watch, the winning attempt (grant, transaction).
ETCD_HANDOFF_WATCH = {
    "watch": {"kv/lease/revoke": 1, "kv/txn": 2, "lease/grant": 2, "watch": 1},
    "watch-async": {"lease": 2, "revoke_lease": 1, "transaction": 2, "watch_once": 1},
}
ETCD_KEEPALIVES = {"lease/keepalive", "refresh_lease"}

# What dynamodb_cycle.py must count at the client: two requests a cycle for every contender
# (a conditional PutItem and DeleteItem); per operation, the store's documented requests
# (store.py), at the quick run's 64 permits: one BatchGetItem beside a semaphore's refused
# acquire, and before a release or extend by key and token.
DYNAMODB_CYCLE_REQUESTS = dict.fromkeys(("dmutex", "raw", "dmutex-async", "raw-async"), 2)
DYNAMODB_OPERATIONS = {
    "DMutex.acquire, free": {"PutItem": 1},
    "DMutex.acquire, held": {"PutItem": 1},
    "DMutexLock.extend": {"UpdateItem": 1},
    "DMutexLock.release": {"DeleteItem": 1},
    "DMutex(fencing=True).acquire, counter absent": {"PutItem": 1, "UpdateItem": 1},
    "DMutex(fencing=True).acquire, counter ahead of the clock": {"PutItem": 1, "UpdateItem": 2},
    "DSemaphore(N=64).acquire, empty": {"PutItem": 1},
    "DSemaphore(N=64).acquire, full": {"BatchGetItem": 1, "PutItem": 1},
    "DSemaphore(N=64).extend(key, token)": {"BatchGetItem": 1, "UpdateItem": 1},
    "DSemaphore(N=64).release(key, token)": {"BatchGetItem": 1, "DeleteItem": 1},
    "DSemaphorePermit.release": {"DeleteItem": 1},
}
# What dynamodb_semaphore.py must count per refused acquire, at the quick run's Ns: dmutex
# (and its requests sent raw) a PutItem and a BatchGetItem per 100 permits; the TypeScript
# store's algorithm a PutItem per permit. Its capacity units: 1 WCU and N RCU against N WCU.
DYNAMODB_FULL_ACQUIRE = {
    f"{who} N={n}": requests
    for n, ours in ((1, 1), (64, 2), (256, 4))
    for who, requests in (("dmutex", ours), ("raw", ours), ("typescript", n))
}
DYNAMODB_FULL_CAPACITY = {
    "dmutex N=256": {"wcu": 1, "rcu": 256},
    "typescript N=256": {"wcu": 256, "rcu": 0},
}

# What redis_replicas.py must count: WAIT rides in the write's pipeline, a release does not wait.
REPLICAS_REQUESTS = {
    "dmutex-r1: acquire": 1,
    "dmutex-r1: cycle": 2,
    "dmutex-async-r1: acquire": 1,
    "dmutex-async-r1: cycle": 2,
    "dsemaphore-r1: acquire": 1,
    "dsemaphore-r1: cycle": 2,
    "extend-r1: extend": 1,
    "raw-wait: cycle": 2,
}

# What redis_readwrite.py must count: one script per acquire and per release, read or write,
# as the mutex's; and, the readers' grants placed by fence, none after a waiting writer's first
# attempt (writer preference).
READWRITE_REQUESTS = {
    f"{name}{face}: {half}": 1
    for name in ("mutex", "read", "write")
    for face in ("", "-async")
    for half in ("acquire", "release")
}

# What lean_paths.py must hold: each face's ratios to its own mutex (ops/s, median of the rounds)
# on every store it ran; what a cycle sends that issue 43 does not change: every Redis contender
# one request to acquire and one to release, the raw SET NX + compare-and-delete 4 server
# commands, a SQL mutex (fenced) one statement each way.
LEAN_RATIOS = [
    f"{name}{face} / mutex{face}, ops/s"
    for face in ("", "-async")
    for name in ("semaphore", "write", "read")
]
LEAN_REDIS_COMMANDS = {"raw": 4, "raw-async": 4}
# A read or write cycle on a key the store knows: one statement a change (rwcas.py, rule 8).
LEAN_SQL_STATEMENTS = {
    name + face: 2 for name in ("mutex", "read", "write") for face in ("", "-async")
}


# Figures that are the time between two processes' events in no fixed order, so may be
# negative: redis_readwrite.py's hand-off from the holder's release() returning to the
# waiter's acquire returning (the server may wake the waiter, and its acquire return,
# while the holder's process still waits for a CPU to read its own reply). Their
# counterpart from the release call ("from_call") is checked positive as every figure is.
SIGNED = {"from_return"}


def figures(tree: object, signed: bool = False) -> Iterator[tuple[dict[str, object], bool]]:
    """Every measured figure in a ``--json`` tree (the dicts that carry a p50), and if signed."""
    if isinstance(tree, dict):
        if "p50_us" in tree:
            yield tree, signed
        for name, value in tree.items():
            yield from figures(value, signed or name in SIGNED)
    elif isinstance(tree, list):
        for value in tree:
            yield from figures(value, signed)


def session_server(script: str, request: pytest.FixtureRequest) -> list[str]:
    """The options that point a SQL script at the session's server (started once, for the
    suite's other tests too), so that each quick run does not initialise its own: 3-4 s each."""
    if script in POSTGRES:
        return ["--postgres-url", str(request.getfixturevalue("postgres_server"))]
    if script in MYSQL:
        return ["--url", str(request.getfixturevalue("mysql_server"))]
    if script in LEAN:
        return lean_stores(request)
    if script in DYNAMODB:
        return ["--server", quick_dynamodb_server()]
    return []


def quick_dynamodb_server() -> str:
    """The one server a DynamoDB script's quick run starts: dynalite where it is here.

    What the test checks, the requests counted at the client, is the same on
    either; dynalite's run took 4 s, moto's 7 s. The suite's contract and
    fault tests run on both.
    """
    found = dynamodb_servers.find_dynalite()[0] is not None and shutil.which("node")
    return "dynalite" if found else "moto"


def lean_stores(request: pytest.FixtureRequest) -> list[str]:
    """``lean_paths.py``'s stores: those found here (none: skipped), the SQL ones the session's."""
    stores: list[str] = []
    options: list[str] = []
    if discovered().labels:
        stores.append("redis")
    if postgres_servers.required() or postgres_servers.new_session().discovery.sources:
        stores.append("postgresql")
        options += ["--postgres-url", str(request.getfixturevalue("postgres_server"))]
    if mysql_servers.required() or mysql_servers.new_session().discovery.sources:
        stores.append("mysql")
        options += ["--mysql-url", str(request.getfixturevalue("mysql_server"))]
    if not stores:
        pytest.skip("no Redis, PostgreSQL or MySQL server found")
    return ["--store", *stores, *options]


def skip_without_local_dynamodb_server() -> None:
    """Skip unless moto's server or dynalite can run here (what the DynamoDB scripts start).

    Under ``DMUTEX_REQUIRE_DYNAMODB`` a required kind that is missing fails
    instead (``new_session``), as the suite's other tests of those servers do.
    """
    dynamodb_servers.new_session()
    dynalite = dynamodb_servers.find_dynalite()[0] is not None and shutil.which("node")
    if dynamodb_servers.moto_version() is None and not dynalite:
        pytest.skip("neither moto's server (moto[server]) nor dynalite (and node) is here")


def prepare(script: str, request: pytest.FixtureRequest, tmp_path: Path) -> list[str]:
    """The command of ``script``'s quick run, writing its figures to ``tmp_path``.

    Skips (``pytest.skip``) where its servers are not here, or fails where
    they are required and missing, as the suite's other tests of them do.
    """
    if script in REDIS and not discovered().labels:
        pytest.skip(discovered().reason)
    if script in POSTGRES and not postgres_servers.required():
        found = postgres_servers.new_session().discovery
        if not found.sources:
            pytest.skip(found.reason)
    if script in MYSQL and not mysql_servers.required():
        discovery = mysql_servers.new_session().discovery
        if not discovery.sources:
            pytest.skip(discovery.reason)
    if script in ETCD and not etcd_servers.required():
        found_etcd = etcd_servers.new_session().discovery
        if not found_etcd.sources:
            pytest.skip(found_etcd.reason)
    if script in DYNAMODB:
        skip_without_local_dynamodb_server()
    if script == "redis_replicas" and fault_servers.redis_executable() is None:
        pytest.skip("no redis-server executable to start a primary and a replica")
    versions = []
    if script in EVERY_REDIS:
        versions = ["--redis", discovered().labels[-1].removeprefix("redis-")]
    return [
        sys.executable,
        str(ROOT / "benchmarks" / f"{script}.py"),
        "--quick",
        "--json",
        str(tmp_path / "figures.json"),
        *versions,
        *session_server(script, request),
    ]


def run_quick(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )


# Two quick runs at a time, one from each lane: the scripts that count a Redis server's
# commands (INFO commandstats counts every client's) take turns in one lane, the others
# (whose counts are their own client's or connection's) in the other. No figure is compared
# with a bound here, so running beside another script changes nothing this module checks;
# the module takes about half as long (its scripts mostly wait on servers and processes).
REDIS_LANE = {*REDIS, *LEAN}
Started = Future[subprocess.CompletedProcess[str]] | BaseException


@pytest.fixture(scope="module")
def quick_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[Path, Started]]]:
    """Every selected script's quick run, started in its lane: its folder and its run.

    The run is a future, or what preparing it raised (a skip, a failure),
    for that script's test to raise.
    """
    selected = [
        str(item.callspec.params["script"])
        for item in request.session.items
        if isinstance(item, pytest.Function)
        and item.function is test_a_quick_run_writes_its_figures
    ]
    lanes = {lane: ThreadPoolExecutor(1, f"quick-{lane}") for lane in ("redis", "other")}
    started: dict[str, tuple[Path, Started]] = {}
    try:
        for script in sorted(set(selected), key=SCRIPTS.index):
            folder = tmp_path_factory.mktemp(script)
            try:
                command = prepare(script, request, folder)
            # What one script's preparation raised is its own test's outcome, not the others'.
            except (pytest.skip.Exception, pytest.fail.Exception, Exception) as raised:  # noqa: BLE001
                started[script] = (folder, raised)
                continue
            lane = lanes["redis" if script in REDIS_LANE else "other"]
            started[script] = (folder, lane.submit(run_quick, command))
        yield started
    finally:
        for lane in lanes.values():
            lane.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_quick_run_writes_its_figures(
    script: str, quick_runs: dict[str, tuple[Path, Started]]
) -> None:
    folder, run = quick_runs[script]
    if isinstance(run, BaseException):
        raise run
    done = run.result()
    out = folder / "figures.json"
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert runs, "no run recorded"
    measured = list(figures(runs))
    assert measured, f"no figure in {sorted(runs)}"
    for figure, signed in measured:
        for name in ("p50_us", "ops_per_s"):
            value = figure[name]
            assert isinstance(value, float | int), figure
            assert math.isfinite(value) if signed else value > 0, figure
    assert not all(signed for _, signed in measured), "every figure is signed"
    if script in MYSQL:
        for run in runs.values():
            counted = run["statements"]
            assert all(value > 0 for value in counted.values()), counted
            assert {name: counted[name] for name in MYSQL_STATEMENTS} == MYSQL_STATEMENTS
    if script in LEAN:
        check_lean_paths(runs)
    if script == "redis_replicas":
        for run in runs.values():
            counted = run["requests"]
            assert {name: counted[name] for name in REPLICAS_REQUESTS} == REPLICAS_REQUESTS
    if script == "redis_readwrite":
        for run in runs.values():
            counted = run["requests"]
            assert {name: counted[name] for name in READWRITE_REQUESTS} == READWRITE_REQUESTS
            preference = run["preference"]
            assert preference["after_first_attempt"] == 0, preference
            assert preference["trials"] > 0, preference
    if script == "etcd_cycle":
        for run in runs.values():
            expected = dict(ETCD_CYCLE_REQUESTS)
            if importlib.util.find_spec("tooz") is not None:
                expected["tooz"] = 3
            assert run["requests"] == expected
            kinds = run["requests_by_kind"]
            assert {name: kinds[name] for name in ETCD_CYCLE_KINDS} == ETCD_CYCLE_KINDS
    if script == "etcd_handoff":
        for run in runs.values():
            kinds = run["requests_by_kind"]
            assert {name: kinds[name] for name in ETCD_HANDOFF_WATCH} == ETCD_HANDOFF_WATCH
            for poller in ("poll", "poll-async"):
                assert run["requests_per_handoff"][poller] > 0, run["requests_per_handoff"]
                assert not {"watch", "watch_once"} & set(kinds[poller]), kinds[poller]
    if script == "etcd_renewal":
        for run in runs.values():
            assert {hold["face"] for hold in run["renewal"]} == {"sync", "async"}
            for hold in run["renewal"]:
                assert hold["hold_renewals"] > 0, hold["face"]
                assert hold["hold_renewals"] == hold["hold_keepalives"], hold["face"]
                assert hold["window_requests"], hold["face"]
                assert set(hold["window_requests"]) <= ETCD_KEEPALIVES, hold["window_requests"]
    if script == "dynamodb_cycle":
        for run in runs.values():
            assert run["requests"] == DYNAMODB_CYCLE_REQUESTS
            counted = run["operations"]
            kinds = {name: counted[name]["by_kind"] for name in DYNAMODB_OPERATIONS}
            assert kinds == DYNAMODB_OPERATIONS
            full = counted["DSemaphore(N=64).acquire, full"]
            assert (full["wcu"], full["rcu"]) == (1, 64), full
            assert all(c["http_requests"] == c["requests"] for c in counted.values()), counted
            assert 0 < run["largest_item_bytes"] <= 1024
    if script == "dynamodb_semaphore":
        for run in runs.values():
            assert run["requests"] == DYNAMODB_FULL_ACQUIRE
            capacity = run["capacity"]
            assert {name: capacity[name] for name in DYNAMODB_FULL_CAPACITY} == (
                DYNAMODB_FULL_CAPACITY
            )


def check_lean_paths(runs: dict[str, Any]) -> None:
    """``lean_paths.py``'s figures: ratios on every face of every store, counts, targets."""
    stores = {name: run for name, run in runs.items() if name != "summary"}
    assert stores, f"no store in {sorted(runs)}"
    for store, run in stores.items():
        medians = run["medians"]
        assert all(medians[name] > 0 for name in LEAN_RATIOS), (store, medians)
        counted = run["commands"] if store == "redis" else run["statements"]
        assert all(value > 0 and value == int(value) for value in counted.values()), counted
        assert {"semaphore", "semaphore-async"} <= set(counted), counted
    if "redis" in stores:
        redis = stores["redis"]
        commands = redis["commands"]
        assert {name: commands[name] for name in LEAN_REDIS_COMMANDS} == LEAN_REDIS_COMMANDS
        assert set(redis["requests"].values()) == {2}, redis["requests"]
        assert redis["medians"]["mutex-async / raw-async, ops/s"] > 0
        assert len(runs["summary"]["targets"]) == 5, runs["summary"]["targets"]
    for store in (name for name in ("postgresql", "mysql") if name in stores):
        counted = stores[store]["statements"]
        assert {name: counted[name] for name in LEAN_SQL_STATEMENTS} == LEAN_SQL_STATEMENTS

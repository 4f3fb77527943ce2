"""Several OS processes contending for one lock key on a server that speaks DynamoDB's protocol.

Each test runs once per kind of server the session tries
(``dynamodb_servers.kinds()``, each run through ``dynamodb_session``):
dynalite, started on 127.0.0.1, and the endpoint ``DMUTEX_DYNAMODB_URL``
names when it is set; neither dynalite nor moto's server is DynamoDB. On
moto's server each test skips before the server is started
(:data:`NOT_ATOMIC` says why): it can grant one item to two conditional
writes at once, and no exclusion across processes holds on top of that.

Each worker is a separate process started with ``spawn`` (through
``processes.run_workers``): it opens its own client and its own dmutex
instance, waits on a barrier so that all of them start together, runs a
bounded number of cycles and reports a :class:`~tests._support.processes.Report`
(or the traceback of what it raised). A worker that has not reported by the
deadline is terminated and the test fails.

The workers take turns of kind: even ones use ``DMutex`` / ``DSemaphore`` on
a boto3 client, odd ones ``AsyncDMutex`` / ``AsyncDSemaphore`` on an
aiobotocore client; so the plain ``acquire()`` of one kind races the
other's. A worker's one client carries both dmutex's requests and the
guarded work's. No release signals another process: waiters poll
(``RETRY_DELAY``).

What the mutex guards is an item of a table of the test's own (``counter``,
named under the session's prefix): a strongly consistent ``GetItem`` of it,
then a ``PutItem`` of the value read plus one, two requests, so that two
holders at once lose an increment: the count must end at the total of the
cycles. Between them the holder reads the lock's item (strongly
consistent), which must hold its token. Each cycle first tries one plain
``acquire()``; when that is refused the worker counts it and falls back to
``acquire_with_retry()``: the refusals show that the processes contended.

The semaphore's gauge is the same table's other item, moved by one atomic
``UpdateItem`` (``ADD``, ``ReturnValues=UPDATED_NEW``) on entry and on exit:
its highest reading is the number of holders at once, which must not exceed
the permits; the permits all in use at once, or refusals, show contention.
Each slot's item must hold its holder's token, and every release must
answer True.

The clients retry 3 times in botocore's standard mode, with 5 s timeouts. A
re-sent ``ADD`` whose first reply was lost would count twice: a gauge off by
one is a failure to look into, not to retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import botocore.exceptions
import pytest
from aiobotocore.session import get_session

from dmutex import (
    AsyncDMutex,
    AsyncDMutexLock,
    AsyncDSemaphore,
    AsyncDSemaphorePermit,
    DMutex,
    DMutexLock,
    DSemaphore,
    DSemaphorePermit,
)
from dmutex._clock import SYSTEM_CLOCK
from dmutex._core.lease import now_ms
from tests._support import dynamodb_servers, processes
from tests._support.dynamodb_servers import Server, Session
from tests._support.processes import BARRIER_TIMEOUT, DEADLINE, Report, Tally

SERVICE = "procs"

# Kinds of server on which these tests skip, and why.
NOT_ATOMIC = {
    "moto": (
        "moto's server is not atomic under concurrent requests (its FAQ: not concurrency"
        " safe): it serves each request on a thread of its own and applies a conditional"
        " write as a read, then a write, with nothing held between them, so two"
        " conditional PutItems of one item can both succeed. Here it granted one lock to"
        " two processes in 2 of 10 runs of the mutex test, and let two of six"
        " conditional PutItems of one new key succeed in 1 of 800 rounds; dynalite locks"
        " the item across its condition and its write."
    ),
}

LOCK_KEY = "orders"
TTL = 30.0  # far longer than any test: no lease may expire while held
RETRY_TIMEOUT = 30.0
# No release wakes a waiter in another process: it polls within this. Each
# poll is a request to a server that the holder's requests wait behind.
RETRY_DELAY = 0.05
RETRY = processes.Retry(TTL, RETRY_TIMEOUT, RETRY_DELAY)
# The clients' botocore config: 3 retries in standard mode, 5 s to connect and to read.
CLIENT_CONFIG: dict[str, Any] = {
    "timeout": 5.0,
    "retries": {"max_attempts": 3, "mode": "standard"},
}

PROCESSES = 6
CYCLES = 150
SEM_PROCESSES = 4
SEM_PERMITS = 3
SEM_CYCLES = 100
HOLD = 0.003  # seconds a semaphore holder keeps its permit, so that holders overlap


@dataclass(frozen=True)
class Place:
    """Where a run's workers meet: the server, and the tables of the counter and the locks."""

    server: Server
    counter: str  # partition key ``name``: the items ``counter`` and ``gauge``, number ``n``
    mutex_table: str
    semaphore_table: str

    def client_args(self) -> dict[str, Any]:
        """What boto3's ``client("dynamodb", ...)`` and aiobotocore's ``create_client`` take."""
        return self.server.client_args(**CLIENT_CONFIG)


# --- the guarded work: the requests a holder sends, the same for both faces ---------------


@dataclass(frozen=True)
class Work:
    """The requests' keyword arguments, as botocore names them."""

    counter: str  # the counter's table
    locks: str  # the lock's table

    def read(self) -> dict[str, Any]:
        """The counter's item, strongly consistent."""
        return {
            "TableName": self.counter,
            "Key": {"name": {"S": "counter"}},
            "ConsistentRead": True,
        }

    def write(self, value: int) -> dict[str, Any]:
        """The counter's item, replaced by one of ``value``."""
        return {
            "TableName": self.counter,
            "Item": {"name": {"S": "counter"}, "n": {"N": str(value)}},
        }

    def holder(self, slot: int) -> dict[str, Any]:
        """The lock's item of ``slot``, strongly consistent."""
        return {
            "TableName": self.locks,
            "Key": {"key": {"S": f"permit:{slot}:{LOCK_KEY}"}},
            "ConsistentRead": True,
        }

    def gauge(self, step: int) -> dict[str, Any]:
        """The gauge moved by ``step`` atomically, answering its new value."""
        return {
            "TableName": self.counter,
            "Key": {"name": {"S": "gauge"}},
            "UpdateExpression": "ADD #n :step",
            "ExpressionAttributeNames": {"#n": "n"},
            "ExpressionAttributeValues": {":step": {"N": str(step)}},
            "ReturnValues": "UPDATED_NEW",
        }


def _number(answer: dict[str, Any], attributes: str) -> int:
    """The number ``n`` of a GetItem's ``Item`` or an UpdateItem's ``Attributes``."""
    return int(answer[attributes]["n"]["N"])


def _foreign(answer: dict[str, Any], token: str) -> bool:
    """Whether a GetItem of a lock's item found no item, or another token in it."""
    item = answer.get("Item")
    return item is None or item["value"]["S"] != token


# --- workers (module level: spawn imports this module to find them) ---------------------


@contextlib.contextmanager
def sync_client(place: Place) -> Iterator[Any]:
    """A sync worker's boto3 client, closed after."""
    with place.server.connect(**CLIENT_CONFIG) as client:
        yield client


@contextlib.asynccontextmanager
async def async_client(place: Place) -> AsyncIterator[Any]:
    """An asyncio worker's aiobotocore client, entered (which sends nothing) and exited."""
    async with get_session().create_client("dynamodb", **place.client_args()) as client:
        yield client


def mutex_counter_worker(
    worker: int, reports: processes.Reports, barrier: processes.Barrier, place: Place, cycles: int
) -> None:
    """``cycles`` times: lock, read the counter, write it plus one, unlock; sync or asyncio."""
    work = Work(place.counter, place.mutex_table)

    def sync(tally: Tally) -> None:
        with sync_client(place) as client:
            mutex = DMutex(SERVICE, client, table_name=place.mutex_table)
            barrier.wait(BARRIER_TIMEOUT)

            def guarded(lock: DMutexLock) -> None:
                value = _number(client.get_item(**work.read()), "Item")
                if _foreign(client.get_item(**work.holder(0)), lock.token):
                    tally.foreign += 1
                client.put_item(**work.write(value + 1))

            processes.cycle(mutex, LOCK_KEY, tally, cycles, guarded, RETRY)

    async def asynchronous(tally: Tally) -> None:
        async with async_client(place) as client:
            mutex = AsyncDMutex(SERVICE, client, table_name=place.mutex_table)
            barrier.wait(BARRIER_TIMEOUT)  # nothing else runs on this loop yet

            async def guarded(lock: AsyncDMutexLock) -> None:
                value = _number(await client.get_item(**work.read()), "Item")
                if _foreign(await client.get_item(**work.holder(0)), lock.token):
                    tally.foreign += 1
                await client.put_item(**work.write(value + 1))

            await processes.cycle_async(mutex, LOCK_KEY, tally, cycles, guarded, RETRY)

    processes.report_errors(
        worker, reports, barrier, Tally(worker), processes.by_kind(worker, sync, asynchronous)
    )


def semaphore_gauge_worker(
    worker: int,
    reports: processes.Reports,
    barrier: processes.Barrier,
    place: Place,
    cycles: int,
    permits: int,
) -> None:
    """``cycles`` times: take a permit, raise the gauge, read the slot's item, lower it, release."""
    work = Work(place.counter, place.semaphore_table)

    def sync(tally: Tally) -> None:
        with sync_client(place) as client:
            sem = DSemaphore(SERVICE, client, max_permits=permits, table_name=place.semaphore_table)
            barrier.wait(BARRIER_TIMEOUT)

            def guarded(permit: DSemaphorePermit) -> None:
                tally.slots.add(permit.slot)
                entered = client.update_item(**work.gauge(1))
                tally.peak = max(tally.peak, _number(entered, "Attributes"))
                if _foreign(client.get_item(**work.holder(permit.slot)), permit.token):
                    tally.foreign += 1
                time.sleep(HOLD)
                client.update_item(**work.gauge(-1))

            processes.cycle(sem, LOCK_KEY, tally, cycles, guarded, RETRY)

    async def asynchronous(tally: Tally) -> None:
        async with async_client(place) as client:
            sem = AsyncDSemaphore(
                SERVICE, client, max_permits=permits, table_name=place.semaphore_table
            )
            barrier.wait(BARRIER_TIMEOUT)

            async def guarded(permit: AsyncDSemaphorePermit) -> None:
                tally.slots.add(permit.slot)
                entered = await client.update_item(**work.gauge(1))
                tally.peak = max(tally.peak, _number(entered, "Attributes"))
                if _foreign(await client.get_item(**work.holder(permit.slot)), permit.token):
                    tally.foreign += 1
                await asyncio.sleep(HOLD)
                await client.update_item(**work.gauge(-1))

            await processes.cycle_async(sem, LOCK_KEY, tally, cycles, guarded, RETRY)

    processes.report_errors(
        worker, reports, barrier, Tally(worker), processes.by_kind(worker, sync, asynchronous)
    )


# --- the parent side --------------------------------------------------------------------


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Each test runs once per kind of server this run tries, its id the server's label."""
    if "kind" in metafunc.fixturenames:
        kinds = dynamodb_servers.kinds()
        metafunc.parametrize("kind", kinds, ids=[dynamodb_servers.label(k) for k in kinds])


@pytest.fixture
def place(kind: str, dynamodb_session: Session) -> Iterator[Place]:
    """``kind``'s server (skipped on one in :data:`NOT_ATOMIC`, before it is started), and
    tables of this test's own under the session's prefix: the counter (with its two items)
    and the locks' (made by the test); all three deleted after."""
    why = NOT_ATOMIC.get(kind)
    if why is not None:
        pytest.skip(why)
    dynamodb_server = dynamodb_session.server(kind)
    suffix = uuid.uuid4().hex[:8]
    found = Place(
        dynamodb_server,
        dynamodb_session.table_name(f"procs-{suffix}-counter"),
        dynamodb_session.table_name(f"procs-{suffix}-mutex"),
        dynamodb_session.table_name(f"procs-{suffix}-semaphore"),
    )
    with dynamodb_server.connect() as client:
        dynamodb_servers.create_table(client, found.counter, key="name")
        for name in ("counter", "gauge"):
            client.put_item(TableName=found.counter, Item={"name": {"S": name}, "n": {"N": "0"}})
    yield found
    with dynamodb_server.connect() as client:
        for table in (found.counter, found.mutex_table, found.semaphore_table):
            try:
                client.delete_table(TableName=table)
            except botocore.exceptions.ClientError as error:
                if dynamodb_servers.error_code(error) != "ResourceNotFoundException":
                    raise


def _counter(place: Place, name: str) -> int:
    with place.server.connect() as client:
        answer = client.get_item(
            TableName=place.counter, Key={"name": {"S": name}}, ConsistentRead=True
        )
    return _number(answer, "Item")


def _active(place: Place, table: str) -> list[str]:
    """The lock table's items of active permits: none once every holder released."""
    now = now_ms(SYSTEM_CLOCK)
    with place.server.connect() as client:
        pages = client.get_paginator("scan").paginate(TableName=table, ConsistentRead=True)
        items = [item for page in pages for item in page["Items"]]
    return [
        item["key"]["S"]
        for item in items
        if item["key"]["S"].startswith("permit:") and int(item["expiredAt"]["N"]) > now
    ]


def _print_figures(name: str, started: float, reports: list[Report]) -> None:
    elapsed = time.monotonic() - started
    refused = [r.refused for r in reports]
    peak = max(r.peak for r in reports)
    # Shown with -s; no assertion uses the time.
    print(f"\n{name}: {elapsed:.2f} s, refused per worker {refused}", end="")
    print(f", peak gauge {peak}" if peak else "")


def test_mutex_serializes_read_modify_write_across_processes(place: Place) -> None:
    """6 processes x 150 cycles: boto3 and aiobotocore clients taking turns."""
    with place.server.connect() as client:
        DMutex(SERVICE, client, table_name=place.mutex_table).ready()  # not 6 creating it
    started = time.monotonic()
    reports = processes.run_workers(
        mutex_counter_worker, PROCESSES, place, CYCLES, deadline=DEADLINE, report=Report
    )
    label = place.server.label
    _print_figures(f"{label} mutex counter, {PROCESSES} x {CYCLES} cycles", started, reports)
    processes.check_cycles(reports, PROCESSES, CYCLES)
    assert sum(r.foreign for r in reports) == 0, "a holder found another token in the lock's item"
    # A GetItem then a PutItem of what it read loses increments unless the lock excludes.
    assert _counter(place, "counter") == PROCESSES * CYCLES
    assert sum(r.refused for r in reports) > 0, "the workers never contended"
    assert _active(place, place.mutex_table) == [], "the lock's item outlived its last release"


def test_semaphore_bounds_concurrency_across_processes(place: Place) -> None:
    """4 processes x 100 cycles on 3 permits: at most 3 holders at once."""
    with place.server.connect() as client:
        DSemaphore(
            SERVICE, client, max_permits=SEM_PERMITS, table_name=place.semaphore_table
        ).ready()
    started = time.monotonic()
    reports = processes.run_workers(
        semaphore_gauge_worker,
        SEM_PROCESSES,
        place,
        SEM_CYCLES,
        SEM_PERMITS,
        deadline=DEADLINE,
        report=Report,
    )
    label = place.server.label
    name = f"{label} semaphore gauge, {SEM_PROCESSES} x {SEM_CYCLES} cycles"
    _print_figures(name, started, reports)
    processes.check_cycles(reports, SEM_PROCESSES, SEM_CYCLES)
    assert sum(r.foreign for r in reports) == 0, "a holder found another token in its slot's item"
    peak = max(r.peak for r in reports)
    assert peak <= SEM_PERMITS, f"{peak} holders at once with {SEM_PERMITS} permits"
    refused = sum(r.refused for r in reports)
    assert peak == SEM_PERMITS or refused > 0, "the workers never contended"
    assert {s for r in reports for s in r.slots} <= set(range(SEM_PERMITS))
    assert _counter(place, "gauge") == 0
    assert _active(place, place.semaphore_table) == [], "slots' items outlived their last release"

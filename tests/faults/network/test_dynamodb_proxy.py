"""A server that speaks DynamoDB's protocol, through a faulty network: no overlap, no lie.

What it breaks: every client reaches the server (dynalite for the racing
holders, moto's server too for a lost grant's reply; neither is DynamoDB:
moto's server lets two concurrent conditional writes of one item both
succeed, so no race is judged there) through a
:class:`~tests._support.fault_proxy.FaultProxy` of its own, which drops
requests, drops replies after the server ran the request, delays requests
and tears connections mid-message, at points a seeded generator picks (6%,
10%, 6% and 4% of what a client sends). The clients are botocore's, set as
an application should set them: standard retry mode with 2 retries, 2 s to
connect and to read, so a lost reply is a connection error that botocore
retries by sending the same request again (same token, same times), and
that reaches dmutex once the three attempts failed. dynalite 3.2.2 throws
from its request's ``error`` listener, and so exits, when a connection
closes before it read the request whole (``index.js``: ``req.on('error',
function(err) { throw err })``); the dynalite here runs with a second
``request`` listener that puts a listener that logs in place of that one,
so that a torn connection ends its request alone, as on moto's server.

The holders: boto3 clients in threads and aiobotocore clients in tasks of
one event loop, side by side on the same two locks, a ``DMutex`` and a
``DSemaphore(max_permits=3)``; each key shared by four (mutex) or six
(semaphore) holders, and one key per lock and face that a single holder
uses. A cycle is ``acquire`` (on a shared key held, ``acquire_with_retry``)
with ``auto_renew=True`` and a 1.5 s TTL, holding for up to a second (most
holds outlive a renewal interval, so renewals go through the faults too),
then ``release``. While it holds, the holder reads ``time_left`` every
20 ms; it stops working when it reads 0.

What must hold:

- **no overlap**, by the holders' own accounting: a holder holds from the
  moment its acquire returned until the earlier of its call to release
  and the last deadline it read (the moment of the read plus
  ``time_left``); at no instant does a key have more holders than permits;
- **every lease ends released or lost**: after ``release()`` its
  ``time_left`` is 0, and a release that answered False left its lease
  ``lost``;
- **no lie**: an acquire that answered None took nothing (no item holds
  any token it sent), an acquire on the holder's own free key answers
  with a lease (unless what holds the key is left by a failure, as
  below: it is then counted, and deleted), and after a release that
  answered True no item holds its token;
- **nothing held by nobody**: at the end, with the faults off, every
  active item is one a failure explains: an acquire or a release that
  raised, or a release that answered False (its lease was lost, and a
  copy of a renewal that botocore sent late, after the item expired,
  may have prolonged it: a copy carries its first send's time and
  expiry). None expires more than a TTL after the end, and once a TTL
  has passed the tables hold no active item: nothing renews any more;
- every failure is one of botocore's connection errors, or the
  ``ClientError`` botocore makes of an error reply torn inside its headers
  (urllib3 logs the headers it could not parse and goes on; the error is
  named by the bare HTTP status, "400", with no message);
- the faults reached dmutex: some grant was sent again by botocore and
  granted, and some acquire or release raised, or some lease was lost.

The lost reply made on purpose: a grant's PutItem, whose reply the proxy
drops after the server ran it, sent again by botocore, answers with the
lease (the copy finds the caller's own token: the store's rule 2), and
the server held the token before the copy arrived; without retries
(``total_max_attempts=1``) the acquire raises, and its clean-up release
(engine rule 6) finds the item and deletes it. Mutex and semaphore, sync
and asyncio, on both servers.

Everything is bounded: no cycle starts after 4 s, every wait has a
timeout, the proxies stop by themselves. ``-s`` prints a summary line per
case. ``DMUTEX_FAULT_SEED`` changes the seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import botocore.exceptions
import pytest
from aiobotocore.session import get_session

from dmutex import AsyncDMutex, AsyncDSemaphore, DMutex, DMutexError, DSemaphore
from tests._support import dynamodb_servers, servers
from tests._support.dynamodb_servers import Server, Session
from tests._support.faces import Calls, await_calls, run_calls
from tests._support.fault_proxy import Fault, FaultProxy, Rates

Kind = Literal["mutex", "semaphore"]
FaceName = Literal["sync", "async"]
Lock = DMutex | DSemaphore | AsyncDMutex | AsyncDSemaphore

SEED = int(os.environ.get("DMUTEX_FAULT_SEED", "20240611"))
KINDS: tuple[Kind, ...] = ("mutex", "semaphore")
PERMITS: dict[Kind, int] = {"mutex": 1, "semaphore": 3}
# Per client chunk (about one request): 6% dropped, 10% replies dropped after the server
# ran the request, 6% delayed by 1-10 ms, 4% torn mid-message.
RATES = Rates(drop_request=0.06, drop_reply=0.10, delay=0.06, cut=0.04)

TTL = 1.5  # every lease's: renewed every 0.5 s, its deadline 1.3 s after each renewal's send
HOLD = (0.05, 1.0)  # seconds a holder keeps its lease: most outlive a renewal interval
LOOK_EVERY = 0.02  # the holder's reading of its own deadline while it works
RETRY_TIMEOUT = 3.0  # longer than a TTL: a waiter outlasts a leftover lease
RETRY_DELAY = 0.05
RUN_SECONDS = 4.0  # no cycle starts after this
RUN_TIMEOUT = 60.0  # a face whose holders are not done by then fails the test
SETTLE = 0.2  # seconds past a TTL before the last look at the tables
# Shared-key holders per face (the semaphore's outnumber its permits), and one of each face
# alone on a key of its own.
SHARED = {"mutex": 2, "semaphore": 3}

REQUEST_TIMEOUT = 2.0  # botocore's connect and read timeouts
RETRIES = {"max_attempts": 2, "mode": "standard"}  # 3 attempts in all
NO_RETRIES = {"total_max_attempts": 1, "mode": "standard"}
SERVICE = "net"

# What botocore raises when the network fails it: ConnectionClosedError and
# ReadTimeoutError (HTTPClientError), EndpointConnectionError and
# ConnectTimeoutError (ConnectionError). aiobotocore raises the same classes.
FAILURES: tuple[type[Exception], ...] = (
    botocore.exceptions.HTTPClientError,
    botocore.exceptions.ConnectionError,
)


def torn_error_reply(error: BaseException) -> bool:
    """Whether ``error`` is botocore's reading of an error reply torn inside its headers.

    urllib3 logs the headers it cannot parse and goes on; botocore finds no
    error code in what is left and names the error by its HTTP status
    ("400"), with no message. A reply of 200 torn there reads as ``{}``.
    """
    if not isinstance(error, botocore.exceptions.ClientError):
        return False
    details = error.response.get("Error", {})
    return str(details.get("Code", "")).isdigit() and not details.get("Message")


def torn_batch_reply(error: BaseException) -> bool:
    """Whether ``error`` is dmutex refusing a BatchGetItem reply torn inside its headers.

    botocore reads such a 200 reply as ``{}`` (metadata alone); the store
    refuses a batch reply without ``Responses`` rather than read it as "no
    items" (``dynamodb/requests.py``, rule 5).
    """
    return isinstance(error, DMutexError) and str(error).startswith(
        "unexpected reply from DynamoDB BatchGetItem: {'ResponseMetadata'"
    )


# The tokens the PutItem requests of the current acquire carried, each send (a retry too).
SENT: ContextVar[list[str] | None] = ContextVar("grant_tokens_sent", default=None)
_TABLES = itertools.count()


def grant_token(request: Any) -> str:
    """The token of a PutItem request (a grant's: the slot item's ``value``)."""
    body = json.loads(request.body)
    return str(body["Item"]["value"]["S"])


def is_grant(chunk: bytes) -> bool:
    """Whether ``chunk`` starts a PutItem request: its target header."""
    return b"DynamoDB_20120810.PutItem" in chunk


# --- the servers ------------------------------------------------------------------------------


def start_dynalite(source: dynamodb_servers.Dynalite, process: servers.ServerProcess) -> Server:
    """dynalite in memory on ``process``'s port, a torn request ending it no more."""
    script = dynamodb_servers.DYNALITE_SCRIPT  # its throwing error listener replaced
    command = [str(source.node), "-e", script, str(source.package[0]), str(process.port)]
    url, region = f"http://{servers.LOOPBACK}:{process.port}", dynamodb_servers.region()
    probe = dynamodb_servers.make_client(
        **dynamodb_servers.client_args(url, region, local=True, **dynamodb_servers.PROBE_CONFIG)
    )
    with contextlib.closing(probe):
        process.start(
            lambda folder, port: command,
            lambda port: dynamodb_servers.list_tables_once(probe),
            dynamodb_servers.PROBE_ERRORS,
            what=f"dynalite ({source.executable})",
            timeout=dynamodb_servers.START_TIMEOUT,
        )
    return Server(source.kind, source.label, url, region, str(source.executable), process.pid)


@pytest.fixture(scope="module")
def dynalite_server(dynamodb_session: Session) -> Iterator[Server]:
    """This module's own dynalite (see the module docstring), stopped by its pid at the end."""
    source = dynamodb_session.found.source("dynalite")
    if source is None:
        pytest.skip(dynamodb_session.found.why_not("dynalite"))
    assert isinstance(source, dynamodb_servers.Dynalite)
    process = servers.ServerProcess("dynalite-faults", stop_timeout=dynamodb_servers.STOP_TIMEOUT)
    try:
        yield start_dynalite(source, process)
    finally:
        process.stop()


@pytest.fixture(
    params=["moto", "dynalite"],
    ids=[dynamodb_servers.label("moto"), dynamodb_servers.label("dynalite")],
)
def server(request: pytest.FixtureRequest, dynamodb_session: Session) -> Server:
    """moto's server (the session's) or dynalite (this module's), on loopback."""
    if request.param == "dynalite":
        found: Server = request.getfixturevalue("dynalite_server")
        return found
    found = dynamodb_session.server("moto")
    if not found.local:
        pytest.skip("the fault proxy runs on loopback, before a server the tests started")
    return found


def table_names(session: Session, what: str) -> dict[Kind, str]:
    number = next(_TABLES)
    return {kind: session.table_name(f"{what}-{number}-{kind}") for kind in KINDS}


def proxied_args(proxy: FaultProxy, server: Server, retries: dict[str, Any]) -> dict[str, Any]:
    """What a boto3 or aiobotocore client through ``proxy`` takes."""
    return dynamodb_servers.client_args(
        f"http://{proxy.host}:{proxy.port}",
        server.region,
        local=True,
        timeout=REQUEST_TIMEOUT,
        retries=retries,
    )


def make_lock(face: FaceName, kind: Kind, client: Any, table: str) -> Lock:
    if kind == "mutex":
        mutex = DMutex if face == "sync" else AsyncDMutex
        return mutex(SERVICE, client, table_name=table, default_ttl_seconds=TTL)
    semaphore = DSemaphore if face == "sync" else AsyncDSemaphore
    return semaphore(
        SERVICE, client, max_permits=PERMITS[kind], table_name=table, default_ttl_seconds=TTL
    )


# --- the tables, read directly ---------------------------------------------------------------


class Item(NamedTuple):
    """An active slot item: ``permit:<slot>:<key>``, its token and expiry (epoch ms)."""

    name: str
    key: str
    token: str
    expires_ms: int


def wall_ms() -> int:
    return int(time.time() * 1000)


class Inspector:
    """The tables as a client of the server's own port sees them (no proxy, retries on)."""

    def __init__(self, server: Server, tables: dict[Kind, str]) -> None:
        self.client = server.client(timeout=REQUEST_TIMEOUT)
        self.tables = tables

    def close(self) -> None:
        self.client.close()

    def active(self, kind: Kind) -> list[Item]:
        """Every active slot item of ``kind``'s table (a strongly consistent Scan)."""
        pages = self.client.get_paginator("scan").paginate(
            TableName=self.tables[kind], ConsistentRead=True
        )
        now, found = wall_ms(), []
        for page in pages:
            for raw in page["Items"]:
                name = raw["key"]["S"]
                if not name.startswith("permit:") or int(raw["expiredAt"]["N"]) <= now:
                    continue
                key = name.split(":", 2)[2]
                found.append(Item(name, key, raw["value"]["S"], int(raw["expiredAt"]["N"])))
        return found

    def holding(self, kind: Kind, tokens: Sequence[str]) -> list[Item]:
        """The active items of ``kind`` that hold one of ``tokens``."""
        wanted = set(tokens)
        return [item for item in self.active(kind) if item.token in wanted] if wanted else []

    def of_key(self, kind: Kind, key: str) -> list[Item]:
        return [item for item in self.active(kind) if item.key == key]

    def delete(self, kind: Kind, items: Sequence[Item]) -> None:
        """Delete these items (each counted already), each while it still holds its token."""
        for item in items:
            with contextlib.suppress(self.client.exceptions.ConditionalCheckFailedException):
                self.client.delete_item(
                    TableName=self.tables[kind],
                    Key={"key": {"S": item.name}},
                    ConditionExpression="#v = :token",
                    ExpressionAttributeNames={"#v": "value"},
                    ExpressionAttributeValues={":token": {"S": item.token}},
                )


# --- what the holders saw --------------------------------------------------------------------


@dataclass(eq=False)
class Hold:
    """One lease as its holder saw it: from its acquire's return to its release or deadline."""

    who: str
    start: float  # monotonic, when the acquire returned
    claimed: float  # the latest deadline it read: a reading's time plus time_left
    called_release: float | None = None

    def claim(self, deadline: float) -> None:
        self.claimed = max(self.claimed, deadline)

    @property
    def end(self) -> float:
        if self.called_release is None:
            return self.claimed
        return min(self.claimed, self.called_release)


def overlaps(holds: Sequence[Hold], limit: int) -> tuple[list[str], int]:
    """The instants at which more than ``limit`` holds were open, and the most open at once."""
    events = sorted(
        [(hold.start, 1, hold) for hold in holds if hold.end > hold.start]
        + [(hold.end, -1, hold) for hold in holds if hold.end > hold.start],
        key=lambda event: (event[0], event[1]),  # an end before a start at the same instant
    )
    open_: list[Hold] = []
    found: list[str] = []
    peak = 0
    for at, step, hold in events:
        if step < 0:
            open_.remove(hold)
            continue
        open_.append(hold)
        peak = max(peak, len(open_))
        if len(open_) > limit:
            found.append(f"at {at:.3f}: {', '.join(h.who for h in open_)}")
    return found, peak


@dataclass(eq=False)
class Ended:
    """A lease after its holder called release: the handle, and what the release answered."""

    handle: Any
    answer: bool | None  # None: the release raised
    lost_while_held: bool


@dataclass
class Run:
    """What one case's holders share, and what they found."""

    inspector: Inspector
    holds: dict[tuple[Kind, str], list[Hold]] = field(default_factory=dict)
    ended: list[Ended] = field(default_factory=list)
    sent: set[str] = field(default_factory=set)  # every token a grant carried
    grant_sends: Counter[str] = field(default_factory=Counter)  # PutItem sends per token
    granted: set[str] = field(default_factory=set)
    refused: set[str] = field(default_factory=set)  # tokens of acquires that answered None
    released: set[str] = field(default_factory=set)  # release answered True
    loose: set[str] = field(default_factory=set)  # a failure or a loss may have left its item
    counts: Counter[str] = field(default_factory=Counter)
    exceptions: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    wrong_none: list[str] = field(default_factory=list)
    took_on_none: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    explained: int = 0  # leftover items of a failure, found on a holder's own key
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def note_grant(self, request: Any, **_: Any) -> None:
        """botocore's ``before-send`` hook of PutItem: one more send of this token."""
        token = grant_token(request)
        sent = SENT.get()
        if sent is not None:
            sent.append(token)
        with self._lock:
            self.sent.add(token)
            self.grant_sends[token] += 1

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def failed(self, what: str, error: Exception, tokens: Sequence[str]) -> None:
        with self._lock:
            self.loose.update(tokens)
            if isinstance(error, FAILURES):
                self.exceptions[f"{what}:{type(error).__name__}"] += 1
            elif torn_error_reply(error):
                self.exceptions[f"{what}:ClientError(torn)"] += 1
            elif torn_batch_reply(error):
                self.exceptions[f"{what}:DMutexError(torn batch reply)"] += 1
            else:
                self.unexpected.append(f"{what} raised {error!r}")

    def opened(self, kind: Kind, key: str, who: str, token: str) -> Hold:
        """A lease granted now: open until its holder's first reading of its deadline."""
        start = time.monotonic()
        hold = Hold(who, start, start)
        with self._lock:
            self.holds.setdefault((kind, key), []).append(hold)
            self.granted.add(token)
            self.counts["acquired"] += 1
        return hold

    def none_answered(self, kind: Kind, key: str, tokens: Sequence[str], own: bool) -> None:
        """An acquire answered None: it took nothing; on a holder's own key, a leftover is why."""
        with self._lock:
            self.refused.update(tokens)
        if held := self.inspector.holding(kind, tokens):
            with self._lock:
                self.took_on_none.append(f"{kind} {key}: None, yet {held} hold its token")
        if not own:
            return
        items = self.inspector.of_key(kind, key)
        with self._lock:
            unexplained = [item for item in items if item.token not in self.loose]
            if items and not unexplained:
                self.counts["own_key_blocked_by_leftover"] += 1
                self.explained += len(items)
            else:
                self.wrong_none.append(f"{kind} {key}: None on a free key; active: {items}")
        if items and not unexplained:
            self.inspector.delete(kind, items)  # the next cycle starts clean

    def after_release(self, kind: Kind, ended: Ended) -> None:
        """A release answered: True leaves no item with its token; False, a lost lease."""
        handle, answer = ended.handle, ended.answer
        with self._lock:
            self.ended.append(ended)
            if answer is True:
                self.released.add(handle.token)
            else:
                self.loose.add(handle.token)  # lost: a late copy of a renewal may prolong it
            if ended.lost_while_held:
                self.counts["lost"] += 1
            self.counts[f"release_{'raised' if answer is None else str(answer).lower()}"] += 1
        if answer is True and (held := self.inspector.holding(kind, [handle.token])):
            with self._lock:
                self.stale.append(f"release answered True, yet {held} hold its token")
            self.inspector.delete(kind, held)


class Worker:
    """One holder: its lock (its own client, through its own proxy), its key, its cycles."""

    def __init__(self, run: Run, name: str, kind: Kind, lock: Lock, key: str, own: bool) -> None:
        self.run = run
        self.name = name
        self.kind = kind
        self.lock = lock
        self.key = key
        self.own = own
        self.rng = random.Random(f"{SEED}:{name}")
        self.asynchronous = isinstance(lock, (AsyncDMutex, AsyncDSemaphore))
        self.cycles_done = 0

    def nap(self, seconds: float) -> Any:
        if self.asynchronous:
            return asyncio.sleep(seconds)
        time.sleep(seconds)
        return None

    def look(self, read: Any, *args: Any) -> Any:
        """``read(*args)`` on the tables: off the event loop for the asyncio face."""
        if self.asynchronous:
            return asyncio.to_thread(read, *args)
        return read(*args)

    def cycles(self, deadline: float) -> Calls[None]:
        while time.monotonic() < deadline:
            yield from self.cycle()
            self.cycles_done += 1

    def cycle(self) -> Calls[None]:
        run, kind, key = self.run, self.kind, self.key
        sent: list[str] = []
        SENT.set(sent)
        handle: Any = None
        try:
            handle = yield self.lock.acquire(key, ttl=TTL, auto_renew=True)
            if handle is None:
                run.count("refused")
                yield self.look(run.none_answered, kind, key, list(sent), self.own)
                if not self.own:
                    sent.clear()
                    handle = yield self.lock.acquire_with_retry(
                        key,
                        ttl=TTL,
                        timeout=RETRY_TIMEOUT,
                        retry_delay=RETRY_DELAY,
                        auto_renew=True,
                    )
                    if handle is None:
                        run.count("retry_timeout")
                        yield self.look(run.none_answered, kind, key, list(sent), False)
        except Exception as error:  # noqa: BLE001 - judged: a connection error, or reported
            run.failed("acquire", error, sent)
            return
        finally:
            SENT.set(None)
        if handle is None:
            return
        hold = run.opened(kind, key, f"{self.name}#{self.cycles_done}", handle.token)
        until = hold.start + self.rng.uniform(*HOLD)
        lost = False
        while True:
            now = time.monotonic()  # read before time_left: the claim is never late
            left = handle.time_left
            if left <= 0:
                lost = True
                break
            hold.claim(now + left)
            if now >= until:
                break
            yield self.nap(min(LOOK_EVERY, until - now))
        hold.called_release = time.monotonic()
        try:
            answer = yield handle.release()
        except Exception as error:  # noqa: BLE001 - judged as above; its item ends by its TTL
            run.failed("release", error, [handle.token])
            answer = None
        yield self.look(run.after_release, kind, Ended(handle, answer, lost))


# --- a case -----------------------------------------------------------------------------------


def plan(face: FaceName) -> list[tuple[Kind, str, bool]]:
    """This face's holders: (lock, key, alone on its key)."""
    holders: list[tuple[Kind, str, bool]] = []
    for kind in KINDS:
        holders += [(kind, "shared", False)] * SHARED[kind]
        holders.append((kind, f"own-{face}", True))
    return holders


def run_sync(workers: Sequence[Worker], deadline: float, errors: list[BaseException]) -> None:
    def cycles(worker: Worker) -> None:
        try:
            run_calls(worker.cycles(deadline))
        except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=cycles, args=(w,), daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(RUN_TIMEOUT)
    if any(thread.is_alive() for thread in threads):
        errors.append(AssertionError("a sync holder hung"))


def run_async(
    run: Run,
    server: Server,
    proxies: Sequence[FaultProxy],
    tables: dict[Kind, str],
    ready: threading.Event,
    go: threading.Event,
    errors: list[BaseException],
) -> None:
    """The asyncio holders, on a loop of this thread: ready, then cycles once ``go`` is set."""

    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            workers = []
            for index, ((kind, key, own), proxy) in enumerate(
                zip(plan("async"), proxies, strict=True)
            ):
                made = get_session().create_client(
                    "dynamodb", **proxied_args(proxy, server, RETRIES)
                )
                client = await stack.enter_async_context(made)
                client.meta.events.register("before-send.dynamodb.PutItem", run.note_grant)
                lock = make_lock("async", kind, client, tables[kind])
                assert isinstance(lock, (AsyncDMutex, AsyncDSemaphore))
                await lock.ready()
                workers.append(Worker(run, f"async-{index}-{kind}-{key}", kind, lock, key, own))
            ready.set()
            if not await asyncio.to_thread(go.wait, RUN_TIMEOUT):
                return
            deadline = time.monotonic() + RUN_SECONDS
            tasks = [asyncio.ensure_future(await_calls(w.cycles(deadline))) for w in workers]
            await asyncio.wait_for(asyncio.gather(*tasks), RUN_TIMEOUT)

    try:
        asyncio.run(main())
    except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
        errors.append(error)
    finally:
        ready.set()


def summary(run: Run, server: Server, proxies: Sequence[FaultProxy], seconds: float) -> str:
    faults: Counter[str] = Counter()
    for proxy in proxies:
        faults.update({f.value: n for f, n in proxy.counts.items() if f is not Fault.PASS})
    shown = " ".join(f"{f.value}={faults[f.value]}" for f in Fault if f is not Fault.PASS)
    exceptions = ",".join(f"{k}:{v}" for k, v in sorted(run.exceptions.items())) or "none"
    counts = " ".join(f"{k}={v}" for k, v in sorted(run.counts.items()))
    resent = sum(1 for token in run.granted if run.grant_sends[token] > 1)
    peaks = " ".join(
        f"{kind}:{key}={overlaps(holds, PERMITS[kind])[1]}"
        for (kind, key), holds in sorted(run.holds.items())
    )
    return (
        f"[dynamodb-store proxy {server.label}] seed={SEED} {counts} "
        f"resent_grants_granted={resent} peaks: {peaks} "
        f"faults: {shown} exceptions={exceptions} explained_leftovers={run.explained} "
        f"seconds={seconds:.1f}"
    )


def test_holders_through_a_faulty_network(server: Server, dynamodb_session: Session) -> None:
    """Sync and asyncio holders of a mutex and a semaphore, through seeded faults: see above.

    On dynalite only: moto's server checks a conditional write's condition and
    applies the write without a lock between them, so racing holders can both
    be granted there whatever dmutex does (docs/usage/dynamodb.md).
    """
    if server.kind == "moto":
        pytest.skip("moto's server does not make a conditional write atomic under concurrency")
    tables = table_names(dynamodb_session, "net")
    inspector = Inspector(server, tables)
    run = Run(inspector)
    holders = {face: plan(face) for face in ("sync", "async")}
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        stack.callback(inspector.close)
        proxies = {
            face: [
                stack.enter_context(
                    FaultProxy(
                        (server.host, server.port),
                        RATES,
                        seed=SEED + index + (0 if face == "sync" else 100),
                        lifetime=120,
                    )
                )
                for index in range(len(holders[face]))
            ]
            for face in ("sync", "async")
        }
        workers = []
        for index, ((kind, key, own), proxy) in enumerate(
            zip(holders["sync"], proxies["sync"], strict=True)
        ):
            client = dynamodb_servers.make_client(**proxied_args(proxy, server, RETRIES))
            stack.callback(client.close)
            client.meta.events.register("before-send.dynamodb.PutItem", run.note_grant)
            lock = make_lock("sync", kind, client, tables[kind])
            assert isinstance(lock, (DMutex, DSemaphore))
            lock.ready()
            workers.append(Worker(run, f"sync-{index}-{kind}-{key}", kind, lock, key, own))
        ready, go = threading.Event(), threading.Event()
        errors: list[BaseException] = []
        loop = threading.Thread(
            target=run_async,
            args=(run, server, proxies["async"], tables, ready, go, errors),
            daemon=True,
        )
        loop.start()
        stack.callback(loop.join, RUN_TIMEOUT)
        stack.callback(go.set)  # on a failure below: the loop ends instead of waiting
        assert ready.wait(RUN_TIMEOUT), "the asyncio holders did not get ready"
        assert not errors, errors
        everyone = proxies["sync"] + proxies["async"]
        with contextlib.ExitStack() as faults:
            for proxy in everyone:
                faults.enter_context(proxy.faults())
            go.set()
            run_sync(workers, time.monotonic() + RUN_SECONDS, errors)
            loop.join(RUN_TIMEOUT)
        assert not loop.is_alive(), "the asyncio holders hung"
        if errors:
            raise errors[0]
        finished = wall_ms()
        # Faults off, every holder done: what is left must be explained, and end within a TTL.
        leftovers = {kind: inspector.active(kind) for kind in KINDS}
        time.sleep(max(0.0, (finished + TTL * 1000) / 1000 - time.time()) + SETTLE)
        after_ttl = {kind: inspector.active(kind) for kind in KINDS}
        print(summary(run, server, everyone, time.monotonic() - started))
        judge(run, everyone, leftovers, after_ttl, finished)


def judge(
    run: Run,
    proxies: Sequence[FaultProxy],
    leftovers: dict[Kind, list[Item]],
    after_ttl: dict[Kind, list[Item]],
    finished: int,
) -> None:
    assert [e for p in proxies for e in p.errors] == []
    assert sum(p.injected for p in proxies) > 0, "no fault was injected"
    assert run.counts["acquired"] > 0, "nothing was acquired"
    assert any(run.grant_sends[token] > 1 for token in run.granted), "no grant was sent again"
    reached = sum(run.exceptions.values()) + run.counts["lost"]
    assert reached > 0, "no acquire or release raised, no lease was lost"
    found_overlaps: list[str] = []
    for (kind, key), holds in run.holds.items():
        found, _ = overlaps(holds, PERMITS[kind])
        found_overlaps += [f"{kind} {key} {line}" for line in found]
    not_ended = [repr(e.handle) for e in run.ended if e.handle.time_left != 0.0]
    false_not_lost = [repr(e.handle) for e in run.ended if e.answer is False and not e.handle.lost]
    unexplained, overlong = [], []
    for kind, items in leftovers.items():
        for item in items:
            if item.token not in run.loose:
                why = "released" if item.token in run.released else "refused"
                why = why if item.token in run.released | run.refused else "unknown"
                unexplained.append(f"{kind} {item.name} ({why} token {item.token})")
            if item.expires_ms > finished + TTL * 1000:
                overlong.append(f"{kind} {item.name} expires {item.expires_ms - finished} ms on")
    problems = [
        f"{what}: {found}"
        for what, found in (
            ("overlaps", found_overlaps),
            ("unexpected exceptions", run.unexpected),
            ("None from acquire on a free key", run.wrong_none),
            ("items taken by an acquire that answered None", run.took_on_none),
            ("tokens holding an item after release() answered True", run.stale),
            ("leases with time left after release()", not_ended),
            ("release() answered False, lease not lost", false_not_lost),
            ("items no failure explains", unexplained),
            ("items expiring more than a TTL after the end", overlong),
            ("items still active once a TTL passed", [i for v in after_ttl.values() for i in v]),
        )
        if found
    ]
    assert not problems, "; ".join(problems)


# --- the lost reply, on purpose ---------------------------------------------------------------


class Spy:
    """A client's PutItem and clean-up sends, and what the server held just before each."""

    def __init__(self, inspector: Inspector, kind: Kind) -> None:
        self.inspector = inspector
        self.kind = kind
        self.grants: list[tuple[str, int]] = []  # (token, items holding it before this send)
        self.cleanups: list[int] = []  # items holding the grant's token before each DeleteItem

    def grant(self, request: Any, **_: Any) -> None:
        token = grant_token(request)
        self.grants.append((token, len(self.inspector.holding(self.kind, [token]))))

    def cleanup(self, request: Any, **_: Any) -> None:
        token = json.loads(request.body)["ExpressionAttributeValues"][":token"]["S"]
        self.cleanups.append(len(self.inspector.holding(self.kind, [token])))

    def watch(self, client: Any) -> None:
        client.meta.events.register("before-send.dynamodb.PutItem", self.grant)
        client.meta.events.register("before-send.dynamodb.DeleteItem", self.cleanup)


@contextlib.contextmanager
def grant_reply_dropped(server: Server) -> Iterator[FaultProxy]:
    """A proxy that drops the reply to the first PutItem while its faults are on, only that."""
    rates = Rates(drop_reply=1.0)
    with FaultProxy(
        (server.host, server.port),
        rates,
        seed=SEED,
        spare=lambda chunk: not is_grant(chunk),
        calm_after_fault=1_000_000,
        lifetime=60,
    ) as proxy:
        yield proxy


@dataclass
class Outcome:
    """What one acquire through :func:`grant_reply_dropped` gave, and the server meanwhile."""

    error: BaseException | None = None
    token: str = ""
    slot: int = 0
    expires_ms: int = 0
    held: list[Item] = field(default_factory=list)  # the items holding its token, while held
    released: bool | None = None


def granted(outcome: Outcome, handle: Any, inspector: Inspector, kind: Kind) -> None:
    outcome.token = handle.token
    outcome.slot = handle.slot if kind == "semaphore" else 0
    outcome.expires_ms = round(handle.expired_at.timestamp() * 1000)
    outcome.held = inspector.holding(kind, [handle.token])


def grant_through(
    server: Server,
    proxy: FaultProxy,
    face: FaceName,
    kind: Kind,
    table: str,
    retries: dict[str, Any],
    spy: Spy,
) -> Outcome:
    """One acquire of key ``k`` through ``proxy``, its faults on; the lease released after."""
    outcome = Outcome()
    args = proxied_args(proxy, server, retries)
    if face == "sync":
        client = dynamodb_servers.make_client(**args)
        with contextlib.closing(client):
            spy.watch(client)
            lock = make_lock(face, kind, client, table)
            assert isinstance(lock, (DMutex, DSemaphore))
            lock.ready()
            try:
                with proxy.faults():
                    handle = lock.acquire("k", ttl=30)
            except FAILURES as error:
                outcome.error = error
                return outcome
            assert handle is not None
            granted(outcome, handle, spy.inspector, kind)
            outcome.released = handle.release()
        return outcome

    async def main() -> None:
        async with get_session().create_client("dynamodb", **args) as client:
            spy.watch(client)
            lock = make_lock(face, kind, client, table)
            assert isinstance(lock, (AsyncDMutex, AsyncDSemaphore))
            await lock.ready()
            try:
                with proxy.faults():
                    handle = await lock.acquire("k", ttl=30)
            except FAILURES as error:
                outcome.error = error
                return
            assert handle is not None
            granted(outcome, handle, spy.inspector, kind)
            outcome.released = await handle.release()

    asyncio.run(asyncio.wait_for(main(), RUN_TIMEOUT))
    return outcome


@pytest.mark.parametrize("face", ["sync", "async"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_grant_whose_reply_was_lost_is_sent_again_and_found_to_be_the_callers_own(
    server: Server, dynamodb_session: Session, face: FaceName, kind: Kind
) -> None:
    """The first PutItem's reply dropped after the server ran it: botocore sends the same
    request again, and the store's condition lets the copy through as the caller's own. The
    lease is granted, its item holds the token with the first copy's expiry, and its release
    deletes it. Without retries the acquire raises, and its clean-up release finds the item
    the lost copy made and deletes it."""
    tables = table_names(dynamodb_session, "lost")
    inspector = Inspector(server, tables)
    try:
        for retries in (RETRIES, NO_RETRIES):
            spy = Spy(inspector, kind)
            with grant_reply_dropped(server) as proxy:
                outcome = grant_through(server, proxy, face, kind, tables[kind], retries, spy)
            assert proxy.errors == []
            assert proxy.counts[Fault.DROP_REPLY] == 1, proxy.counts
            if retries is RETRIES:
                assert outcome.error is None, outcome.error
                token = outcome.token
                # The first copy ran (nothing held the token before it); the second found it.
                assert spy.grants == [(token, 0), (token, 1)], spy.grants
                assert [(i.name, i.expires_ms) for i in outcome.held] == [
                    (f"permit:{outcome.slot}:k", outcome.expires_ms)
                ]
                assert outcome.released is True
            else:
                assert isinstance(outcome.error, botocore.exceptions.ConnectionClosedError)
                [(token, before)] = spy.grants
                assert before == 0
            # The release (rule 6's, without retries) found the item, and deleted it.
            assert spy.cleanups == [1], spy.cleanups
            assert inspector.holding(kind, [token]) == []
    finally:
        inspector.close()

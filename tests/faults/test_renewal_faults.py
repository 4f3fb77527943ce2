"""Renewal through a faulty network: no lease kept that the server dropped, no loss told early.

Ten leases are taken with ``auto_renew=True`` through
:class:`~tests._support.fault_proxy.FaultProxy`: TTLs of 0.6 to 1.5 s on Redis
(two leases per TTL, so that their renewals fall due together and share a
batched request), 1.5 to 3 s on the MongoDB test server (SecantusDB here),
one TTL per lease. Seven go through one proxy ("steady") that drops requests,
drops replies after the server executed the request, delays requests and
tears connections at seeded random points (10%, 8%, 10%, 4% of the requests)
for four to five seconds; the record of one of them ("dropped") is deleted on
the server as the second phase starts. Three ("outage") go through a second
proxy that does the same, then drops every request for longer than any of
their TTLs, then faults at random again. The clients retry nothing (redis-py
``retries=0``; pymongo does not retry writes against a standalone server), so
every fault reaches dmutex and its own retries are what is tested. Each test
records every renewal request dmutex sends (the extend and the batched RENEW
script on Redis, the extend ``update_one`` on MongoDB) and how it ended, lease
by lease: acknowledged, refused, or raised.

The server's truth is read by a separate clean client on the server's own
port: every 20 ms for all leases (on Redis in one ``MULTI``), and at the
moment each loss is reported, inside the ``on_lost`` callback. What must hold:

- **no lease kept that the server dropped**: the handle's expiry estimate
  (``expired_at``, read before the server's record) is never later than the
  server's expiry of the token (+2 ms for the rounding of both clocks to
  milliseconds), except for the record the test deleted; and the estimate is
  never past while the server does not hold the token unless ``lost`` is
  True. As ``lost`` is True once the estimate has passed, a lease the server
  dropped is reported lost by then; the deleted one's ``on_lost`` comes by
  its estimate (+50 ms), and a refused renewal reports the loss at once;
- **no loss reported while the lease had life left**: at the moment of the
  loss, either the last renewal was refused (and the server does not hold
  the token), or the last renewals raised and the estimate was at most the
  margin (a tenth of the TTL, at least 0.2 s but at most a quarter of it,
  at most 2 s) away; the last request before a loss is never an
  acknowledged renewal; a failed renewal is not retried past the
  estimate less the margin; and the server's remaining life of the token at
  the loss is at most the margin plus 50 ms (the time from reading the clock
  to the server applying an extend), unless a renewal whose answer was lost
  can explain the longer life: the server may have executed it (a dropped or
  torn reply), and no client can tell;
- no renewal is sent after a loss; every outage lease and the deleted one are
  lost, ``on_lost`` called once each, their records gone from the server on
  their own soon after, their ``release()`` False; every lease not lost is
  still held on the server and releases with True;
- some renewals failed through the proxy and a later one of the same lease
  succeeded (retries happened), the proxy injected faults, and (Redis) some
  requests renewed several leases.

``lost`` never goes from True back to False (``flips=0``; see also
``test_lost_never_goes_back_to_false``), and MongoDB leases share TTLs, so
their renewals share batches (see
``test_one_failed_extend_loses_no_other_lease_of_its_batch``).

Then a pause: a holder in a child process (``spawn``) with ``auto_renew=True``
and a 0.6 s TTL, renewed for three TTLs, is stopped with SIGSTOP; its lease
runs out on the server and the test takes the key. Continued with SIGCONT,
the holder's handle reports the loss (``wait_lost``, ``on_lost`` once,
``lost``, ``raise_if_lost`` raising ``LeaseLostError``) and its ``release()``
returns False; the new holder's record keeps its token and its expiry, and its
fence is higher than the old holder's (Redis by default; MongoDB with
``fencing=True``).

Each fault test prints one summary line (``pytest -s``). ``DMUTEX_FAULT_SEED``
changes the seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import os
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal, Protocol, TypeAlias, TypeVar

import pymongo
import pymongo.common
import pymongo.errors
import pytest
import redis
import redis.asyncio
import redis.asyncio.retry
import redis.backoff
import redis.exceptions
import redis.retry
from pymongo.collection import Collection
from pymongo.database import Database
from pymongo.results import DeleteResult, UpdateResult

from dmutex import (
    AsyncDMutex,
    AsyncDMutexLock,
    DMutex,
    DMutexLock,
    LeaseLostError,
)
from dmutex._backends.redis import scripts as redis_scripts
from dmutex._backends.redis.scripts import EXTEND
from tests._support import faces, pausing, processes
from tests._support.deadlines import Scheduling
from tests._support.fault_proxy import Fault, FaultProxy, Rates, upstream_address
from tests._support.mongo_servers import Session
from tests._support.proxied import redis_options
from tests._support.redis_servers import Pool, Server
from tests._support.sampling import sampling as sampling_thread
from tests._support.sampling import until

Doc: TypeAlias = dict[str, Any]
Handle: TypeAlias = DMutexLock | AsyncDMutexLock
Outcome: TypeAlias = Literal["ok", "refused", "raised"]
Group: TypeAlias = Literal["steady", "outage", "dropped"]

SEED = int(os.environ.get("DMUTEX_FAULT_SEED", "20240611"))
WANTED_REDIS = "redis-7.0"  # one server version; the newest found if there is no 7.0
SERVICE = "renewal-faults"

LEASES = 10
OUTAGE_LEASES = 3  # the last ones, on the proxy that goes down
DROPPED = 0  # this lease (on the steady proxy) has its record deleted as the outage starts
REDIS_TTLS = (0.6, 1.5)  # seconds; each lease's drawn from a seeded generator
REDIS_SHARING = 2  # leases per TTL: renewed in one RENEW script when due together
# MongoDB leases share TTLs too: a batch of MongoDB renewals is one
# update_one per lease, and one failing fails only its own lease (see
# test_one_failed_extend_loses_no_other_lease_of_its_batch).
MONGO_SHARING = 2
MONGO_TTLS = (1.5, 3.0)  # SecantusDB answers in milliseconds, not microseconds

# Per client chunk (about one request), as in network/test_proxy.py but more often.
RATES = Rates(drop_request=0.10, drop_reply=0.08, delay=0.10, cut=0.04)
OUTAGE = Rates(drop_request=1.0)  # nothing reaches the server; nothing is executed
CLEAN = Rates()  # every chunk passes
# (seconds, steady proxy's rates, outage proxy's rates), one after another.
# The first phase is clean and outlasts a third of every TTL: each lease is
# renewed at least once before the faults start, so the liveness check
# (common_asserts) cannot depend on where the first dropped chunk falls. With
# faults from the start, one dropped renewal holds up every later renewal of
# its engine for the socket timeout (renewers.py, rule 4): in one idle CI run
# all seven leases on the steady proxy were lost after 8 renewals in all.
PHASES: tuple[tuple[float, Rates, Rates], ...] = (
    (1.0, CLEAN, CLEAN),  # > 1.5 s / 3
    (2.2, RATES, OUTAGE),  # longer than every TTL of the outage leases
    (0.8, RATES, RATES),
)
MONGO_PHASES: tuple[tuple[float, Rates, Rates], ...] = (
    (1.5, CLEAN, CLEAN),  # > 3.0 s / 3
    (3.3, RATES, OUTAGE),
    (0.7, RATES, RATES),
)

SAMPLE_EVERY = 0.02  # seconds between two reads of every lease on the server
CLOCK_SLACK_MS = 2  # both sides round their clocks to milliseconds
# The time from dmutex reading its clock for an extend to the server applying
# it: the proxy's delay (<= 10 ms), scheduling on a busy machine.
APPLY_SLACK_MS = 50
# Beyond this process's latest measured wake-up: a switch interval (5 ms) and
# both clocks' rounding, for a renewal's answer that the timekeeper overtook.
RACE_SLACK_MS = 10
REDIS_TIMEOUT = 2.0  # socket timeouts: nothing hangs (the proxy delays by ms)
MONGO_TIMEOUT_MS = 3_000
MONGO_MIN_HEARTBEAT = 0.05  # seconds; pymongo's is 0.5 (see the MongoDB test)
SETTLE_TIMEOUT = 10.0  # the longest wait for a lost lease's key to go, at the end
# How late the renewal thread may start a retry due at the deadline: it
# tends one lease after another, and pymongo waits up to 50 ms for its monitor
# after each network error (see the MongoDB test).
REDIS_RETRY_SLACK_MS = 50
MONGO_RETRY_SLACK_MS = 200
REPORTED_PROBLEMS = 20  # problems listed in a failure message, at most


def now_ms() -> int:
    """Epoch milliseconds, as dmutex computes them (``round(time.time() * 1000)``)."""
    return round(time.time() * 1000)


def epoch_ms(moment: datetime) -> int:
    return round(moment.timestamp() * 1000)


def margin_ms(ttl_ms: int) -> int:
    """How long before its expiry estimate an unrenewable lease is given up (the README's rule).

    A tenth of the TTL, at least 0.2 s but at most a quarter of the TTL, and
    at most 2 s; written out here, not imported, so that the oracle is not the
    code it checks.
    """
    return min(max(ttl_ms // 10, 200), ttl_ms // 4, 2_000)


# --- what dmutex sent --------------------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """One renewal request, from before it was sent to when its answer (or error) came."""

    start_ms: int
    end_ms: int
    outcome: Outcome


class Renewals:
    """Every renewal request of every token, in order; written by the renewer, read by checks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_token: dict[str, list[Attempt]] = {}
        self.errors: Counter[str] = Counter()
        self.batches = 0  # requests that renewed more than one lease

    def record(self, token: str, start_ms: int, outcome: Outcome, error: str = "") -> None:
        with self._lock:
            self._by_token.setdefault(token, []).append(Attempt(start_ms, now_ms(), outcome))
            if error:
                self.errors[error] += 1

    def of(self, token: str) -> list[Attempt]:
        with self._lock:
            return list(self._by_token.get(token, ()))

    def outcomes(self) -> Counter[str]:
        with self._lock:
            return Counter(a.outcome for attempts in self._by_token.values() for a in attempts)

    def slowest_ms(self) -> int:
        """The longest a renewal request took, from before it was sent to its end."""
        with self._lock:
            spans = [a.end_ms - a.start_ms for v in self._by_token.values() for a in v]
        return max(spans, default=0)

    def recoveries(self) -> int:
        """Times a renewal raised and the next one of the same lease was acknowledged."""
        with self._lock:
            return sum(
                1
                for attempts in self._by_token.values()
                for before, after in itertools.pairwise(attempts)
                if before.outcome == "raised" and after.outcome == "ok"
            )


class Script(Protocol):
    """One of dmutex's Redis scripts."""

    @property
    def sha(self) -> str: ...
    @property
    def text(self) -> str: ...


# dmutex's renewal scripts: the one-lease extend, and the batched renewal
# where this version of dmutex has one (ARGV: token, TTL and the position of
# a semaphore's holders index, per lease).
_BATCH: Script | None = getattr(redis_scripts, "RENEW", None)
RENEWAL_SCRIPTS: list[Script] = [EXTEND] if _BATCH is None else [EXTEND, _BATCH]
RENEWAL_NAMES = {name for script in RENEWAL_SCRIPTS for name in (script.sha, script.text)}


def renewal_tokens(args: tuple[object, ...]) -> list[str]:
    """The tokens a Redis command renews, if it runs one of dmutex's renewal scripts."""
    if len(args) < 3 or args[0] not in ("EVALSHA", "EVAL") or args[1] not in RENEWAL_NAMES:
        return []
    keys = int(str(args[2]))
    if args[1] in (EXTEND.sha, EXTEND.text):
        return [str(args[3 + keys])]  # ... key..., token, ttl[, "holders"]
    return [str(token) for token in args[3 + keys :: 3]]  # ... key..., token, ttl, index, ...


def outcomes_of(reply: object) -> list[Outcome]:
    """Each lease's outcome in a renewal script's reply: one 1 or 0, or a list of them."""
    replies = list(reply) if isinstance(reply, (list, tuple)) else [reply]
    return ["ok" if one == 1 else "refused" for one in replies]


UNEXPECTED = "unexpected reply"
# What a fault may raise in the clients: anything else is a defect.
FAULT_ERRORS = {"ConnectionError", "TimeoutError", "AutoReconnect", "NetworkTimeout"}


def record_failed(renewals: Renewals, tokens: list[str], start: int, error: Exception) -> None:
    if not isinstance(error, redis.exceptions.NoScriptError):  # dmutex sends EVAL next
        for token in tokens:
            renewals.record(token, start, "raised", type(error).__name__)


def record_answer(renewals: Renewals, tokens: list[str], start: int, reply: object) -> None:
    outcomes = outcomes_of(reply)
    if len(outcomes) != len(tokens):  # not raised here: dmutex would take it for a fault
        renewals.errors[UNEXPECTED] += 1
        return
    if len(tokens) > 1:
        renewals.batches += 1  # only the renewal thread (or task) writes it
    for token, outcome in zip(tokens, outcomes, strict=True):
        renewals.record(token, start, outcome)


class RecordingRedis(redis.Redis):
    """redis-py's client, recording each renewal script it runs in :attr:`renewals`.

    ``late_reply`` seconds pass between the server's answer to a renewal and
    its return to dmutex (0: none).
    """

    renewals: Renewals
    late_reply = 0.0

    def execute_command(self, *args: Any, **options: Any) -> Any:
        # redis-py leaves execute_command unannotated: called as a Callable.
        execute: Callable[..., Any] = super().execute_command
        tokens = renewal_tokens(args)
        if not tokens:
            return execute(*args, **options)
        start = now_ms()
        try:
            reply = execute(*args, **options)
        except Exception as error:
            record_failed(self.renewals, tokens, start, error)
            raise
        time.sleep(self.late_reply)
        record_answer(self.renewals, tokens, start, reply)
        return reply


class RecordingAsyncRedis(redis.asyncio.Redis):
    """:class:`RecordingRedis` for ``redis.asyncio``."""

    renewals: Renewals

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        # redis-py leaves execute_command unannotated: called as a Callable.
        execute: Callable[..., Awaitable[Any]] = super().execute_command
        tokens = renewal_tokens(args)
        if not tokens:
            return await execute(*args, **options)
        start = now_ms()
        try:
            reply = await execute(*args, **options)
        except Exception as error:
            record_failed(self.renewals, tokens, start, error)
            raise
        record_answer(self.renewals, tokens, start, reply)
        return reply


class RecordingCollection:
    """A pymongo collection that records each extend ``update_one`` (what dmutex calls).

    An extend waits ``late_send`` seconds before it is sent (0: none), as
    pymongo waits to select a server after a network error.
    """

    def __init__(self, inner: Collection[Doc], renewals: Renewals) -> None:
        self.inner = inner
        self.renewals = renewals
        self.late_send = 0.0

    def create_index(self, keys: Sequence[tuple[str, int]], /, *, expireAfterSeconds: int) -> str:
        return self.inner.create_index(keys, expireAfterSeconds=expireAfterSeconds)

    def update_one(
        self, filter: Mapping[str, object], update: Mapping[str, object], /, *, upsert: bool = False
    ) -> UpdateResult:
        token = filter.get("value")
        if upsert or not isinstance(token, str):
            return self.inner.update_one(filter, update, upsert=upsert)
        start = now_ms()
        time.sleep(self.late_send)
        try:
            result = self.inner.update_one(filter, update, upsert=upsert)
        except Exception as error:
            self.renewals.record(token, start, "raised", type(error).__name__)
            raise
        self.renewals.record(token, start, "ok" if result.matched_count == 1 else "refused")
        return result

    def delete_one(self, filter: Mapping[str, object], /) -> DeleteResult:
        return self.inner.delete_one(filter)

    def distinct(self, key: str, filter: Mapping[str, object], /) -> list[object]:
        return self.inner.distinct(key, filter)

    def find_one_and_update(
        self, filter: Mapping[str, object], update: Mapping[str, object], **options: Any
    ) -> Doc | None:
        return self.inner.find_one_and_update(filter, update, **options)


class RecordingDatabase:
    def __init__(self, collection: RecordingCollection) -> None:
        self.collection = collection

    def get_collection(self, name: str, /) -> RecordingCollection:
        assert name == self.collection.inner.name, name
        return self.collection


class RecordingMongoClient:
    """What dmutex is given: ``get_database`` of the test database, one recording collection."""

    def __init__(self, inner: pymongo.MongoClient[Doc], db_name: str, renewals: Renewals) -> None:
        self.inner = inner
        self.db_name = db_name
        self.renewals = renewals
        self.collection = RecordingCollection(
            inner.get_database(db_name).get_collection(f"_dmutex_{SERVICE}"), renewals
        )

    def get_database(self, name: str, /) -> RecordingDatabase:
        assert name == self.db_name, name
        return RecordingDatabase(self.collection)


# --- what the server holds -------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """A key's record on the server, read between ``read_from`` and ``read_to`` (epoch ms).

    ``token`` is the token stored (None: no record). The server's expiry of
    it lies in ``expires_from .. expires_to`` (Redis answers a remaining TTL
    at an instant of the read; MongoDB stores the date itself).
    """

    token: str | None
    expires_from: int
    expires_to: int
    read_from: int
    read_to: int

    def holds(self, token: str) -> bool:
        """Whether the server surely still held ``token`` during the read."""
        return self.token == token and self.expires_from > self.read_to

    def expiry_of(self, token: str) -> int:
        """The latest the server's expiry of ``token`` can be: the read's end if it holds none."""
        if self.token == token:
            return max(self.expires_to, self.read_from)
        return self.read_to


class Truth(Protocol):
    """The server's records, through a clean client on the server's own port."""

    def read(self, keys: list[str]) -> dict[str, Record]: ...

    def delete(self, key: str) -> None:
        """Delete the key's record, as an operator or a failover might."""
        ...

    def close(self) -> None: ...


class RedisTruth:
    def __init__(self, server: Server) -> None:
        self.client = redis.Redis(host=server.host, port=server.port, password=server.password)

    def read(self, keys: list[str]) -> dict[str, Record]:
        names = [f"_dmutex_{SERVICE}:permit:0:{key}" for key in keys]
        with self.client.pipeline(transaction=True) as pipe:  # one instant on the server
            for name in names:
                pipe.get(name)
                pipe.pttl(name)
            start = now_ms()
            replies = pipe.execute()
            end = now_ms()
        found = {}
        for index, key in enumerate(keys):
            value, pttl = replies[2 * index], replies[2 * index + 1]
            if isinstance(value, bytes) and isinstance(pttl, int) and pttl >= 0:
                found[key] = Record(value.decode(), start + pttl, end + pttl, start, end)
            else:
                found[key] = Record(None, 0, end, start, end)
        return found

    def delete(self, key: str) -> None:
        self.client.delete(f"_dmutex_{SERVICE}:permit:0:{key}")

    def close(self) -> None:
        self.client.close()


class MongoTruth:
    def __init__(self, collection: Collection[Doc]) -> None:
        self.collection = collection

    def read(self, keys: list[str]) -> dict[str, Record]:
        ids = {f"permit:0:{key}": key for key in keys}
        start = now_ms()
        docs = list(self.collection.find({"_id": {"$in": list(ids)}}))
        end = now_ms()
        found = {key: Record(None, 0, end, start, end) for key in keys}
        for doc in docs:
            expiry = doc.get("expiredAt")
            token = doc.get("value")
            if isinstance(expiry, datetime) and isinstance(token, str):
                ms = epoch_ms(expiry)
                found[ids[str(doc["_id"])]] = Record(token, ms, ms, start, end)
        return found

    def delete(self, key: str) -> None:
        self.collection.delete_one({"_id": f"permit:0:{key}"})

    def close(self) -> None:
        pass


# --- the leases and the checks ---------------------------------------------------------------


@dataclass
class Loss:
    """What the ``on_lost`` callback saw: when, the estimate then, the server's record then."""

    at_ms: int
    estimate_ms: int
    record: Record
    thread: str


@dataclass
class Held:
    key: str
    group: Group
    ttl_ms: int
    handle: Handle
    losses: list[Loss] = field(default_factory=list)
    seen_lost: bool = False
    dropped_at: int | None = None  # when the test deleted its record (epoch ms)
    granted_ms: int = 0  # the estimate at the grant
    release_ms: int | None = None  # when the test's release() was called (epoch ms)
    raced: bool = False  # lost just after a renewal's answer came back (Checker.check_races)

    def __post_init__(self) -> None:
        self.granted_ms = epoch_ms(self.handle.expired_at)

    @property
    def token(self) -> str:
        return self.handle.token

    @property
    def margin(self) -> int:
        return margin_ms(self.ttl_ms)


def finder() -> str:
    """Who is running: the asyncio task's name on a loop, else the thread's."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running event loop in this thread
        task = None
    return task.get_name() if task is not None else threading.current_thread().name


class Checker:
    """Compares each handle with the server's truth; collects every problem found."""

    def __init__(self, truth: Truth, renewals: Renewals, retry_slack_ms: int) -> None:
        self.truth = truth
        self.renewals = renewals
        self.retry_slack_ms = retry_slack_ms
        self.leases: list[Held] = []
        self.problems: list[str] = []
        self.samples = 0
        self.lost_while_held = 0  # losses reported while the server still held the token
        self.explained = 0  # ... with more than the margin left, after a reply was lost
        self.max_skew_ms = 0  # the most the server's expiry exceeded the client's estimate
        self.flips = 0  # times a handle's lost went from True back to False
        self.retry_late_ms = -(10**9)  # the latest a retry started after its deadline
        self._lock = threading.Lock()
        # Losses with more life left on the server, judged after the run.
        self._unexplained: list[tuple[Held, str, int, int]] = []
        # Losses told just after an acknowledged renewal's answer came back:
        # (held, name, how long before the loss it came, in ms), judged after
        # the run against how late this process was scheduled (check_races).
        self._races: list[tuple[Held, str, int]] = []
        self.raced = 0  # ... that the scheduling explains (the renewer did not run in time)
        self.scheduling: Scheduling | None = None  # how the machine ran the phases

    def problem(self, text: str) -> None:
        with self._lock:
            self.problems.append(text)

    def track(self, held: Held) -> None:
        self.leases.append(held)
        held.handle.on_lost(lambda handle: self.on_lost(held))

    def drop(self) -> None:
        """Delete the dropped lease's record on the server: its holder must learn it."""
        for held in self.leases:
            if held.group == "dropped":
                held.dropped_at = now_ms()
                self.truth.delete(held.key)

    def on_lost(self, held: Held) -> None:
        """Called by dmutex (its renewer) when it finds ``held`` lost: check it at once."""
        at = now_ms()
        estimate = epoch_ms(held.handle.expired_at)
        record = self.truth.read([held.key])[held.key]  # a quick read on the clean client
        held.losses.append(Loss(at, estimate, record, finder()))
        attempts = [a for a in self.renewals.of(held.token) if a.end_ms <= at]
        last = attempts[-1].outcome if attempts else None
        name = f"{held.key} (ttl {held.ttl_ms} ms)"
        if len(held.losses) > 1:
            self.problem(f"{name}: on_lost called {len(held.losses)} times")
        if last == "ok":
            # The answer was back, but the renewer thread had not applied it when
            # the deadline came: judged after the run (check_races).
            with self._lock:
                self._races.append((held, name, at - attempts[-1].end_ms))
        if last == "refused":
            if record.token == held.token and record.expires_from > at + CLOCK_SLACK_MS:
                self.problem(f"{name}: renewal refused, but the server holds the token")
            return
        # The deadline counts from the send time of the renewal batch; on
        # MongoDB a lease's own request may go out up to the retry slack
        # after the batch started (one extend after another).
        if estimate - at > held.margin + self.retry_slack_ms + CLOCK_SLACK_MS:
            self.problem(
                f"{name}: lost {estimate - at} ms before its estimate (margin {held.margin} ms)"
            )
        if record.token != held.token:
            return
        left = record.expires_from - at
        if left > 0:
            self.lost_while_held += 1
        if left <= held.margin + APPLY_SLACK_MS:
            return
        # More life on the server than the client knew: only a renewal whose
        # answer never came, or came after the loss (renewal rule 6), can have
        # given it (the server executed it). One still in flight now is not
        # recorded yet: judged after the run (check_late_renewals).
        self._unexplained.append((held, name, at, record.expires_from))

    def check_races(self) -> None:
        """A loss told right after an acknowledged renewal is a race the scheduler made, or a bug.

        The renewal's answer came back before the loss, but the thread that
        applies it (renewal rule 1: the later answered request sets the
        deadline) had not run when the timekeeper reached the deadline. On a
        machine that runs this process, that takes no longer than the latest
        wake-up of a 10 ms sleep (the scheduling watch) plus a switch
        interval: a loss that came later than that after the answer is a
        problem, and the message says how the machine ran the phases.
        """
        late_ms = 0 if self.scheduling is None else round(self.scheduling.latest * 1000)
        shown = "(not watched)" if self.scheduling is None else self.scheduling.text()
        for held, name, gap_ms in self._races:
            if gap_ms <= late_ms + RACE_SLACK_MS:
                self.raced += 1
                held.raced = True
                continue
            self.problem(
                f"{name}: reported lost {gap_ms} ms after an acknowledged renewal's answer "
                f"came back; this process {shown}"
            )

    def check_late_renewals(self) -> None:
        """Each loss with more life left on the server has a renewal to explain it.

        Run after the run, when every attempt is recorded: one sent before the
        loss whose answer was lost (raised) or came after the loss, and that
        reached the server late enough to give the expiry found.
        """
        for held, name, at, expires_from in self._unexplained:
            if held.raced:  # its acknowledged renewal gave the expiry (check_races)
                self.explained += 1
                continue
            attempts = self.renewals.of(held.token)
            if any(
                a.start_ms <= at
                and (a.outcome == "raised" or a.end_ms > at)
                and a.end_ms + held.ttl_ms >= expires_from - CLOCK_SLACK_MS
                for a in attempts
            ):
                self.explained += 1
                continue
            self.problem(
                f"{name}: reported lost with {expires_from - at} ms left on the server (margin "
                f"{held.margin} ms) and no unanswered renewal to explain it; attempts "
                f"{[a for a in attempts if a.start_ms <= at][-5:]}"
            )

    def sample(self) -> None:
        """Every handle against the server: before the read, the read, after it."""
        before = [(h.handle.lost, epoch_ms(h.handle.expired_at)) for h in self.leases]
        records = self.truth.read([h.key for h in self.leases])
        after = [(h.handle.lost, epoch_ms(h.handle.expired_at), now_ms()) for h in self.leases]
        self.samples += 1
        for held, (lost_before, estimate_before), (lost_after, estimate_after, then) in zip(
            self.leases, before, after, strict=True
        ):
            record = records[held.key]
            name = f"{held.key} (ttl {held.ttl_ms} ms)"
            if held.seen_lost and not lost_before:
                # A renewal answered after the estimate had passed must not
                # revive the lease: see test_lost_never_goes_back_to_false.
                with self._lock:
                    self.flips += 1
                held.seen_lost = False
            if lost_before and not lost_after:
                with self._lock:
                    self.flips += 1
            held.seen_lost = held.seen_lost or lost_after
            server_expiry = record.expiry_of(held.token)
            # A record the test deleted is the one the estimate cannot foresee.
            deleted = held.dropped_at is not None
            if not deleted and estimate_before > server_expiry + CLOCK_SLACK_MS:
                self.problem(
                    f"{name}: kept: estimate {estimate_before} is later than the server's "
                    f"expiry {server_expiry} (lost={lost_before}, record {record})"
                )
            if not record.holds(held.token) and then > estimate_after and not lost_after:
                self.problem(f"{name}: the server dropped it, the estimate passed, not lost")
            if record.token == held.token and not lost_before:
                with self._lock:
                    self.max_skew_ms = max(self.max_skew_ms, record.expires_from - estimate_before)

    def check_renewals(self) -> None:
        """A refused renewal loses the lease at once; none is sent after a loss."""
        for held in self.leases:
            attempts = self.renewals.of(held.token)
            # A renewal answered after the release was asked for is the release's
            # doing (renewal rule 4: the release wins), not a loss.
            refused = [
                a
                for a in attempts
                if a.outcome == "refused"
                and (held.release_ms is None or a.end_ms < held.release_ms)
            ]
            if refused and not (
                held.losses and held.losses[0].at_ms <= refused[0].end_ms + APPLY_SLACK_MS
            ):
                self.problem(f"{held.key}: a renewal was refused, and the loss was not told then")
            self.check_retries(held, attempts)
            if held.losses:
                late = [a for a in attempts if a.start_ms > held.losses[0].at_ms]
                if late:
                    self.problem(f"{held.key}: {len(late)} renewals sent after the loss")

    def check_retries(self, held: Held, attempts: list[Attempt]) -> None:
        """A failed renewal is retried only until the estimate less the margin has passed.

        The estimate is at most the start of the last acknowledged renewal
        plus the TTL (dmutex reads its clock just before sending).
        """
        estimate = held.granted_ms
        retrying = False
        for attempt in attempts:
            deadline = estimate - held.margin
            if retrying:
                with self._lock:
                    self.retry_late_ms = max(self.retry_late_ms, attempt.start_ms - deadline)
            if retrying and attempt.start_ms > deadline + self.retry_slack_ms:
                late = attempt.start_ms - deadline
                self.problem(f"{held.key}: a failed renewal retried {late} ms past its deadline")
                return
            if attempt.outcome == "ok":
                estimate = max(estimate, attempt.start_ms + held.ttl_ms)
            retrying = attempt.outcome == "raised"

    def fail_if_problems(self, summary: str) -> None:
        with self._lock:
            problems = list(self.problems)
        shown = "; ".join(list(dict.fromkeys(problems))[:REPORTED_PROBLEMS])
        assert not problems, f"{len(problems)} problems: {shown}\n{summary}"


@contextlib.contextmanager
def sampling(checker: Checker) -> Iterator[None]:
    """Sample every lease against the server in a thread while the block runs."""
    with sampling_thread(checker.sample, SAMPLE_EVERY, "renewal-fault-sampler"):
        yield


def direct(
    steady: FaultProxy,
    outage: FaultProxy,
    phases: tuple[tuple[float, Rates, Rates], ...],
    checker: Checker,
) -> threading.Thread:
    """A thread that turns the proxies' faults on, runs the phases, and turns them off.

    As the second phase (the outage) starts, it deletes the dropped lease's record.
    """

    def run() -> None:
        steady.enabled = outage.enabled = True
        try:
            for index, (seconds, steady_rates, outage_rates) in enumerate(phases):
                steady.rates, outage.rates = steady_rates, outage_rates
                if index == 1:
                    checker.drop()
                time.sleep(seconds)
        finally:
            steady.enabled = outage.enabled = False

    thread = threading.Thread(target=run, name="renewal-fault-director", daemon=True)
    thread.start()
    return thread


def ttls(low_high: tuple[float, float], label: str, sharing: int) -> list[float]:
    """Each lease's TTL: ``sharing`` leases in a row share one, so that their
    renewals fall due together and go in one batch where dmutex batches."""
    rng = random.Random(f"{SEED}:{label}")
    drawn = [round(rng.uniform(*low_high), 3) for _ in range(-(-LEASES // sharing))]
    return [drawn[index // sharing] for index in range(LEASES)]


def group_of(index: int) -> Group:
    if index == DROPPED:
        return "dropped"
    return "outage" if index >= LEASES - OUTAGE_LEASES else "steady"


def proxy_of(group: Group) -> Literal["steady", "outage"]:
    return "outage" if group == "outage" else "steady"


def wait_gone(checker: Checker) -> None:
    """Wait (bounded) until the server holds no token of a lost lease: they expire on their own."""
    lost = [h for h in checker.leases if h.losses]
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while lost:
        records = checker.truth.read([h.key for h in lost])
        lost = [h for h in lost if records[h.key].holds(h.token)]
        if lost and time.monotonic() > deadline:
            checker.problem(f"still on the server {SETTLE_TIMEOUT} s on: {[h.key for h in lost]}")
            return
        time.sleep(SAMPLE_EVERY)


def final_checks(checker: Checker, records: dict[str, Record], released: dict[str, bool]) -> None:
    """After the faults: outage leases lost, the rest held (``records``, read before the
    releases); the releases answered accordingly."""
    checker.check_races()
    checker.check_late_renewals()
    checker.check_renewals()
    for held in checker.leases:
        lost = held.handle.lost
        if held.group == "outage" and not lost:
            checker.problem(f"{held.key}: renewals blocked for longer than its TTL, not lost")
        if held.group == "dropped" and not lost:
            checker.problem(f"{held.key}: its record was deleted, and it is not lost")
        for loss in held.losses[:1]:
            if held.group == "dropped" and loss.at_ms > loss.estimate_ms + APPLY_SLACK_MS:
                late = loss.at_ms - loss.estimate_ms
                checker.problem(
                    f"{held.key}: record deleted, loss told {late} ms after the estimate"
                )
        if lost and not held.losses:
            checker.problem(f"{held.key}: lost, but on_lost was never called")
        if lost and released[held.key] and not held.raced:
            # A raced loss (check_races) left the renewed record on the server.
            checker.problem(f"{held.key}: lost, but release() returned True")
        if not lost and not released[held.key]:
            checker.problem(f"{held.key}: not lost, but release() returned False")
        if not lost and not records[held.key].holds(held.token):
            checker.problem(f"{held.key}: not lost, but the server does not hold it")


def summary(
    label: str,
    checker: Checker,
    proxies: list[FaultProxy],
    started: float,
    released: Mapping[str, bool],
) -> str:
    counts: Counter[str] = Counter()
    for proxy in proxies:
        counts.update({fault.value: n for fault, n in proxy.counts.items()})
    faults = " ".join(f"{f.value}={counts[f.value]}" for f in Fault if f is not Fault.PASS)
    outcomes = checker.renewals.outcomes()
    lost = Counter(h.group for h in checker.leases if h.handle.lost)
    found_by = Counter(h.losses[0].thread for h in checker.leases if h.losses)
    finders = ",".join(f"{k}:{v}" for k, v in sorted(found_by.items())) or "none"
    errors = ",".join(f"{k}:{v}" for k, v in sorted(checker.renewals.errors.items())) or "none"
    return (
        f"[renewal-faults {label}] seed={SEED} leases={len(checker.leases)} "
        f"renewals ok={outcomes['ok']} refused={outcomes['refused']} raised={outcomes['raised']} "
        f"recovered={checker.renewals.recoveries()} batched={checker.renewals.batches} "
        f"slowest_ms={checker.renewals.slowest_ms()} "
        f"errors={errors} faults: {faults} "
        f"lost steady={lost['steady']} outage={lost['outage']} dropped={lost['dropped']} "
        f"found_by={finders} "
        f"lost_while_held={checker.lost_while_held} explained={checker.explained} "
        f"raced={checker.raced} "
        f"max_skew_ms={checker.max_skew_ms} flips={checker.flips} "
        f"retry_late_ms={checker.retry_late_ms} samples={checker.samples} "
        f"released_true={sum(released.values())} problems={len(checker.problems)} "
        f"seconds={time.monotonic() - started:.1f}"
    )


def common_asserts(checker: Checker, proxies: list[FaultProxy], text: str) -> None:
    for proxy in proxies:
        assert proxy.errors == [], proxy.errors
        assert proxy.injected > 0, "no fault was injected"
    assert checker.samples > 20, f"too few samples\n{text}"
    unexpected = set(checker.renewals.errors) - FAULT_ERRORS
    assert not unexpected, f"renewals failed otherwise than by a fault: {unexpected}\n{text}"
    assert checker.renewals.recoveries() > 0, f"no renewal failed and then recovered\n{text}"
    # Each lease is renewed in the clean first phase (PHASES).
    assert checker.renewals.outcomes()["ok"] >= LEASES, f"renewals did not get through\n{text}"
    assert checker.flips == 0, f"lost went from True back to False\n{text}"
    checker.fail_if_problems(text)


def assert_batched(checker: Checker, text: str) -> None:
    """Where dmutex batches Redis renewals, some requests renewed several leases."""
    if _BATCH is not None:
        assert checker.renewals.batches > 0, f"no renewal request renewed two leases\n{text}"


def run_phases(
    checker: Checker,
    steady: FaultProxy,
    outage: FaultProxy,
    phases: tuple[tuple[float, Rates, Rates], ...],
) -> None:
    """The phases of faults while the sampler watches; then wait until no lost lease is stored."""
    with sampling(checker), Scheduling.watching() as checker.scheduling:
        director = direct(steady, outage, phases, checker)
        director.join(sum(p[0] for p in phases) + 10)
        assert not director.is_alive()
        wait_gone(checker)


def release_all(checker: Checker) -> tuple[dict[str, Record], dict[str, bool]]:
    """Every (sync) lease's record, read first; then what each release() answered."""
    records = checker.truth.read([h.key for h in checker.leases])
    released: dict[str, bool] = {}
    for held in checker.leases:
        assert isinstance(held.handle, DMutexLock)
        held.release_ms = now_ms()
        released[held.key] = held.handle.release()
    return records, released


def report(
    label: str,
    checker: Checker,
    proxies: list[FaultProxy],
    started: float,
    records: dict[str, Record],
    released: dict[str, bool],
) -> str:
    """The final checks and assertions, after the summary line is printed; that line."""
    final_checks(checker, records, released)
    text = summary(label, checker, proxies, started, released)
    print(text)
    common_asserts(checker, proxies, text)
    return text


# --- Redis -----------------------------------------------------------------------------------


def redis_target(pool: Pool) -> Server:
    labels = pool.labels
    if not labels:
        pytest.skip(pool.discovery.reason)
    return pool.server(WANTED_REDIS if WANTED_REDIS in labels else labels[-1])


@pytest.fixture
def redis_target_server(redis_pool: Pool) -> Server:
    server = redis_target(redis_pool)
    with redis.Redis(host=server.host, port=server.port, password=server.password) as client:
        client.flushdb()
        for script in RENEWAL_SCRIPTS:  # no NOSCRIPT round trip in the middle of the faults
            client.script_load(script.text)
    return server


def redis_checker(server: Server) -> Checker:
    return Checker(RedisTruth(server), Renewals(), REDIS_RETRY_SLACK_MS)


Recording = TypeVar("Recording", RecordingRedis, RecordingAsyncRedis)


def recording(
    cls: type[Recording], proxy: FaultProxy, server: Server, renewals: Renewals
) -> Recording:
    """A client of ``cls`` to ``server`` through ``proxy``, retrying nothing; it notes
    its renewals in ``renewals``."""
    options = redis_options(proxy, server, REDIS_TIMEOUT)
    if cls is RecordingRedis:
        options["retry"] = redis.retry.Retry(redis.backoff.NoBackoff(), 0)
    else:
        options["retry"] = redis.asyncio.retry.Retry(redis.backoff.NoBackoff(), 0)
    client = cls(**options)
    client.renewals = renewals
    return client


def test_redis_sync_renewal_through_faults(redis_target_server: Server) -> None:
    """Sync leases renewed by the renewal thread through the faulty proxies."""
    server = redis_target_server
    checker = redis_checker(server)
    started = time.monotonic()
    with (
        contextlib.closing(checker.truth),
        FaultProxy((server.host, server.port), RATES, seed=SEED) as steady,
        FaultProxy((server.host, server.port), RATES, seed=SEED + 1) as outage,
        contextlib.ExitStack() as stack,
    ):
        clients = {
            name: stack.enter_context(recording(RecordingRedis, proxy, server, checker.renewals))
            for name, proxy in (("steady", steady), ("outage", outage))
        }
        locks = {group: DMutex(SERVICE, client) for group, client in clients.items()}
        for index, ttl in enumerate(ttls(REDIS_TTLS, "redis-sync", REDIS_SHARING)):
            group = group_of(index)
            handle = locks[proxy_of(group)].acquire(f"lease-{index}", ttl=ttl, auto_renew=True)
            assert handle is not None
            assert handle.fence is not None
            checker.track(Held(f"lease-{index}", group, round(ttl * 1000), handle))
        run_phases(checker, steady, outage, PHASES)
        records, released = release_all(checker)
        label = f"{server.label} sync"
        text = report(label, checker, [steady, outage], started, records, released)
        assert_batched(checker, text)


def test_redis_async_renewal_through_faults(redis_target_server: Server) -> None:
    """Async leases renewed by the event loop's renewal task through the faulty proxies."""
    server = redis_target_server
    checker = redis_checker(server)
    started = time.monotonic()
    released: dict[str, bool] = {}
    records: dict[str, Record] = {}

    async def main(steady: FaultProxy, outage: FaultProxy) -> None:
        clients = {
            name: recording(RecordingAsyncRedis, proxy, server, checker.renewals)
            for name, proxy in (("steady", steady), ("outage", outage))
        }
        try:
            locks = {group: AsyncDMutex(SERVICE, client) for group, client in clients.items()}
            for index, ttl in enumerate(ttls(REDIS_TTLS, "redis-async", REDIS_SHARING)):
                group = group_of(index)
                handle = await locks[proxy_of(group)].acquire(
                    f"lease-{index}", ttl=ttl, auto_renew=True
                )
                assert handle is not None
                assert handle.fence is not None
                checker.track(Held(f"lease-{index}", group, round(ttl * 1000), handle))
            await asyncio.to_thread(run_phases, checker, steady, outage, PHASES)
            records.update(checker.truth.read([h.key for h in checker.leases]))
            for held in checker.leases:
                assert isinstance(held.handle, AsyncDMutexLock)
                held.release_ms = now_ms()
                released[held.key] = await held.handle.release()
        finally:
            for client in clients.values():
                await client.aclose()

    with (
        contextlib.closing(checker.truth),
        FaultProxy((server.host, server.port), RATES, seed=SEED + 2) as steady,
        FaultProxy((server.host, server.port), RATES, seed=SEED + 3) as outage,
    ):
        asyncio.run(main(steady, outage))
        label = f"{server.label} async"
        text = report(label, checker, [steady, outage], started, records, released)
        assert_batched(checker, text)


# --- MongoDB (the SecantusDB test server) ----------------------------------------------------


def is_handshake(chunk: bytes) -> bool:
    """Whether ``chunk`` carries ``hello`` / ``isMaster`` (spared: see network/test_proxy.py)."""
    return b"hello\x00" in chunk or b"ismaster\x00" in chunk.lower()


def test_mongo_sync_renewal_through_faults(
    mongo_session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sync leases on the MongoDB test server (writes not retried by pymongo), as for Redis.

    After a network error pymongo marks the server unknown, and the next
    request waits until its monitor has checked the server again, about
    ``pymongo.common.MIN_HEARTBEAT_INTERVAL`` (0.5 s) later. One thread
    renews every sync lease, so each fault would hold every other lease's
    renewal up by that long: a limit of running renewals on one thread,
    which this test does not measure. Its clients use the polling monitor
    with that minimum lowered to 50 ms (the knob pymongo's own tests turn).
    """
    monkeypatch.setattr(pymongo.common, "MIN_HEARTBEAT_INTERVAL", MONGO_MIN_HEARTBEAT)
    server = mongo_session.fresh()
    renewals = Renewals()
    admin_db: Database[Doc] = mongo_session.admin.get_database(server.db_name)
    truth = MongoTruth(admin_db.get_collection(f"_dmutex_{SERVICE}"))
    checker = Checker(truth, renewals, MONGO_RETRY_SLACK_MS)
    started = time.monotonic()
    upstream = upstream_address(server.url)
    with (
        FaultProxy(upstream, RATES, seed=SEED + 4, spare=is_handshake) as steady,
        FaultProxy(upstream, RATES, seed=SEED + 5, spare=is_handshake) as outage,
        contextlib.ExitStack() as stack,
    ):
        locks = {}
        for group, proxy in (("steady", steady), ("outage", outage)):
            inner: pymongo.MongoClient[Doc] = stack.enter_context(
                pymongo.MongoClient(
                    f"mongodb://{proxy.host}:{proxy.port}/?directConnection=true",
                    serverSelectionTimeoutMS=MONGO_TIMEOUT_MS,
                    connectTimeoutMS=MONGO_TIMEOUT_MS,
                    socketTimeoutMS=MONGO_TIMEOUT_MS,
                    serverMonitoringMode="poll",
                )
            )
            client = RecordingMongoClient(inner, server.db_name, renewals)
            lock = DMutex(SERVICE, client, db_name=server.db_name)
            lock.ready()
            locks[group] = lock
        for index, ttl in enumerate(ttls(MONGO_TTLS, "mongo-sync", MONGO_SHARING)):
            group = group_of(index)
            handle = locks[proxy_of(group)].acquire(f"lease-{index}", ttl=ttl, auto_renew=True)
            assert handle is not None
            checker.track(Held(f"lease-{index}", group, round(ttl * 1000), handle))
        run_phases(checker, steady, outage, MONGO_PHASES)
        records, released = release_all(checker)
        report(server.label, checker, [steady, outage], started, records, released)


# --- a renewal answered after the estimate passed --------------------------------------------

LATE_TTL = 1.0
LATE_BY = 0.85  # the first renewal (at ~0.3 s) is answered at ~1.15 s, after the estimate
LATE_WATCH = 1.6  # seconds of watching: past the late answer, before the estimate it gives


@pytest.mark.parametrize("backend", ["redis", "mongodb"])
def test_lost_never_goes_back_to_false(request: pytest.FixtureRequest, backend: str) -> None:
    """Once ``lost`` reads True, it stays True (renewal rule 5).

    The first renewal is held up (Redis: its answer comes ``LATE_BY`` s after
    the server ran it; MongoDB: it is sent ``LATE_BY`` s late, as pymongo's
    server selection after a network error holds it) past the expiry
    estimate. ``lost`` is then True; it must not become False when the late
    renewal is answered. On Redis an expired key is never brought back. On
    MongoDB the held-up update carries a filter whose "now" was read before
    the wait, so it can extend a record that had expired meanwhile, if no one
    took it over (then no one held it in between, so no two holders overlap):
    the handle stays lost, and its release removes the record.
    """
    renewals = Renewals()
    truth: Truth
    if backend == "redis":
        server = redis_target(request.getfixturevalue("redis_pool"))
        client = RecordingRedis(host=server.host, port=server.port, password=server.password)
        client.renewals, client.late_reply = renewals, LATE_BY
        for script in RENEWAL_SCRIPTS:
            client.script_load(script.text)
        client.delete(f"_dmutex_{SERVICE}:permit:0:late")
        lock = DMutex(SERVICE, client)
        truth = RedisTruth(server)
        closing: Callable[[], None] = client.close
    else:
        session: Session = request.getfixturevalue("mongo_session")
        mongo = session.fresh()
        inner: pymongo.MongoClient[Doc] = pymongo.MongoClient(mongo.url)
        recording = RecordingMongoClient(inner, mongo.db_name, renewals)
        recording.collection.late_send = LATE_BY
        lock = DMutex(SERVICE, recording, db_name=mongo.db_name)
        lock.ready()
        truth = MongoTruth(session.admin.get_database(mongo.db_name)[f"_dmutex_{SERVICE}"])
        closing = inner.close
    try:
        handle = lock.acquire("late", ttl=LATE_TTL, auto_renew=True)
        assert handle is not None
        seen: list[tuple[int, bool, bool]] = []  # (ms since acquire, lost, server holds it)
        start = now_ms()
        while now_ms() - start < LATE_WATCH * 1000:
            lost = handle.lost
            holds = truth.read(["late"])["late"].holds(handle.token)
            if not seen or seen[-1][1:] != (lost, holds):
                seen.append((now_ms() - start, lost, holds))
            time.sleep(0.005)
        attempts = renewals.of(handle.token)
        assert attempts, "no renewal was sent"
        assert attempts[0].end_ms - attempts[0].start_ms >= LATE_BY * 1000 - 5
        lost_at = [at for at, lost, _ in seen if lost]
        assert lost_at, f"the estimate passed, and lost never read True: {seen}"
        gone_at = [at for at, _, holds in seen if not holds]
        problems = [
            f"lost went back to False at {at} ms"
            for at, lost, _ in seen
            if not lost and at > lost_at[0]
        ]
        if backend == "redis":
            problems += [
                f"the server held the token again at {at} ms, after it had expired"
                for at, _, holds in seen
                if holds and gone_at and at > gone_at[0]
            ]
        assert not problems, f"{problems} (ms since acquire, lost, server holds it): {seen}"
        assert handle.extend() is False, "a lost handle stays lost"
        handle.release()
        assert not truth.read(["late"])["late"].holds(handle.token), "released: no record left"
    finally:
        closing()
        truth.close()


# --- one failed request in a batch of MongoDB renewals -----------------------------------------

BATCH_GOOD = 6  # leases whose renewals all succeed on the server
BATCH_TTL = 1.0


class FailingFor(RecordingCollection):
    """Every extend of a token in :attr:`failing` raises, as a network error would."""

    def __init__(self, inner: Collection[Doc], renewals: Renewals) -> None:
        super().__init__(inner, renewals)
        self.failing: set[str] = set()

    def update_one(
        self, filter: Mapping[str, object], update: Mapping[str, object], /, *, upsert: bool = False
    ) -> UpdateResult:
        if not upsert and filter.get("value") in self.failing:
            raise pymongo.errors.AutoReconnect("connection closed (injected by the test)")
        return super().update_one(filter, update, upsert=upsert)


def test_one_failed_extend_loses_no_other_lease_of_its_batch(mongo_session: Session) -> None:
    """Leases renewed together with one whose every renewal fails are not lost.

    Their extends succeed on the server every time; only the one lease's
    request raises. (On Redis a batch is one request, so one answer; on
    MongoDB it is one ``update_one`` per lease, each with its own answer.)
    """
    mongo = mongo_session.fresh()
    renewals = Renewals()
    inner: pymongo.MongoClient[Doc] = pymongo.MongoClient(mongo.url)
    client = RecordingMongoClient(inner, mongo.db_name, renewals)
    failing = FailingFor(client.collection.inner, renewals)
    client.collection = failing
    truth = MongoTruth(mongo_session.admin.get_database(mongo.db_name)[f"_dmutex_{SERVICE}"])
    try:
        lock = DMutex(SERVICE, client, db_name=mongo.db_name)
        lock.ready()
        good = [
            lock.acquire(f"good-{i}", ttl=BATCH_TTL, auto_renew=True) for i in range(BATCH_GOOD)
        ]
        bad = lock.acquire("bad", ttl=BATCH_TTL, auto_renew=True)
        assert bad is not None
        failing.failing.add(bad.token)
        time.sleep(BATCH_TTL * 1.3)  # past the failing lease's deadline
        assert bad.lost, "every renewal of the failing lease raised, and it is not lost"
        handles = [h for h in good if h is not None]
        assert len(handles) == BATCH_GOOD
        records = truth.read([h.key for h in handles])
        wrongly = [
            f"{h.key} ({records[h.key].expires_from - now_ms()} ms left on the server)"
            for h in handles
            if h.lost and records[h.key].holds(h.token)
        ]
        assert not wrongly, f"lost while the server renewed them: {wrongly}"
        for handle in handles:
            assert handle.release() is True
    finally:
        inner.close()


# --- a holder paused past its TTL, with auto_renew --------------------------------------------

PauseBackend: TypeAlias = Literal["redis", "mongodb"]
Reports: TypeAlias = processes.ChildReports

PAUSE_KEY = "paused"
PAUSE_TTL = 0.6
PAUSE_HOLD = 3 * PAUSE_TTL  # renewed for this long before the pause
NEW_TTL = 20.0  # the new holder's lease
START_TIMEOUT = 60.0  # spawning and importing on a busy 2-core machine
STEP_TIMEOUT = 20.0
POLL = 0.01


@dataclass(frozen=True)
class PauseCase:
    backend: PauseBackend
    face: faces.FaceName

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.face}"

    @property
    def fencing(self) -> bool | None:
        # Redis fences by default; MongoDB only when asked (one more request).
        return True if self.backend == "mongodb" else None


PAUSE_CASES = [
    PauseCase("redis", "sync"),
    PauseCase("redis", "async"),
    PauseCase("mongodb", "sync"),
]


def _raised(call: Callable[[], None]) -> str:
    try:
        call()
    except LeaseLostError:
        return "LeaseLostError"
    return "nothing"


def _paused(
    case: PauseCase,
    url: str,
    db_name: str,
    service: str,
    reports: Reports,
    go: multiprocessing.synchronize.Event,
) -> dict[str, object]:
    calls: list[str] = []
    called = threading.Event()

    def on_lost(handle: faces.Handle) -> None:
        calls.append(finder())
        called.set()

    with pausing.holder_client(case, url, socket_timeout=5) as (client, loop):
        lock = faces.Face(
            case.face,
            "mutex",
            client,
            service_name=service,
            loop=loop,
            db_name=db_name,
            fencing=case.fencing,
        )
        handle = lock.acquire(PAUSE_KEY, ttl=PAUSE_TTL, auto_renew=True)
        assert handle is not None, "the key should be free for the holder"
        handle.on_lost(on_lost)
        first = handle.expired_at
        time.sleep(PAUSE_HOLD)  # an asyncio face renews on its loop's thread meanwhile
        assert not handle.lost, "lost while renewed on a healthy server"
        reports.put(("holding", (handle.token, handle.fence, handle.expired_at > first)))
        assert go.wait(STEP_TIMEOUT), "the test never let the holder go on"
        results: dict[str, object] = {"wait_lost": handle.wait_lost(STEP_TIMEOUT)}
        results["on_lost called"] = called.wait(STEP_TIMEOUT)
        results.update(
            lost=handle.lost,
            raise_if_lost=_raised(handle.raise_if_lost),
            release=handle.release(),
            lost_after_release=handle.lost,
            on_lost_calls=len(calls),
            on_lost_thread=calls[0] if calls else None,
        )
        return results


class PauseSide:
    """The test's view of the server: a clean client, and the paused key's record."""

    def __init__(self, case: PauseCase, url: str, db_name: str, service: str) -> None:
        self.case, self.url, self.db_name, self.service = case, url, db_name, service
        self.redis: redis.Redis | None = None
        self.mongo: pymongo.MongoClient[Doc] | None = None
        if case.backend == "redis":
            self.redis = redis.Redis.from_url(url)
        else:
            self.mongo = pymongo.MongoClient(url, tz_aware=True, serverSelectionTimeoutMS=10_000)

    def lock(self) -> DMutex:
        client: redis.Redis | pymongo.MongoClient[Doc] | None = self.redis or self.mongo
        assert client is not None
        return DMutex(self.service, client, db_name=self.db_name, fencing=self.case.fencing)

    def record(self) -> pausing.Record:
        if self.redis is not None:
            name = f"_dmutex_{self.service}:permit:0:{PAUSE_KEY}"
            with self.redis.pipeline(transaction=True) as pipe:
                pipe.get(name)
                pipe.pttl(name)
                value, pttl = pipe.execute()
            if not isinstance(value, bytes):
                return pausing.Record(None, None)
            return pausing.Record(value.decode(), int(pttl))
        assert self.mongo is not None
        collection = self.mongo.get_database(self.db_name)[f"_dmutex_{self.service}"]
        doc = collection.find_one({"_id": f"permit:0:{PAUSE_KEY}"})
        if doc is None:
            return pausing.Record(None, None)
        return pausing.Record(doc.get("value"), doc.get("expiredAt"))

    def expired(self, token: str) -> bool:
        found = self.record()
        if found.token != token:
            return True
        return isinstance(found.expiry, datetime) and found.expiry < datetime.now(timezone.utc)

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()
        if self.mongo is not None:
            self.mongo.close()


@pytest.fixture(params=PAUSE_CASES, ids=[c.id for c in PAUSE_CASES])
def pause_side(request: pytest.FixtureRequest) -> Iterator[PauseSide]:
    case: PauseCase = request.param
    service = f"renew-pause-{uuid.uuid4().hex[:8]}"  # fresh keys: nothing to flush
    if case.backend == "redis":
        side = PauseSide(
            case, redis_target(request.getfixturevalue("redis_pool")).url, "dmutex", service
        )
    else:
        session: Session = request.getfixturevalue("mongo_session")
        server = session.fresh()
        side = PauseSide(case, server.url, server.db_name, service)
    try:
        yield side
    finally:
        side.close()


def test_a_renewed_holder_paused_past_its_ttl_learns_it_lost(pause_side: PauseSide) -> None:
    """SIGSTOP past the TTL: the lease is taken over; on SIGCONT the handle reports the loss,
    its release returns False, the new holder's record is untouched and its fence higher."""
    side = pause_side
    with pausing.spawned_holder(_paused, side.case, side.url, side.db_name, side.service) as child:
        holding = child.report("holding", START_TIMEOUT)
        assert isinstance(holding, tuple)
        token, old_fence, renewed = holding
        assert renewed is True, "the holder's lease was not renewed in three TTLs"
        assert side.record().token == token, "renewed, yet the server no longer holds it"
        child.stop(STEP_TIMEOUT, poll=POLL)
        until(
            lambda: side.expired(token),
            "the paused holder's lease expired",
            STEP_TIMEOUT,
            poll=POLL,
        )

        taker = side.lock().acquire(PAUSE_KEY, ttl=NEW_TTL)
        assert taker is not None, "the expired lease should be free to take over"
        before = side.record()
        assert before.token == taker.token

        child.go_on()
        results = child.finish("results", STEP_TIMEOUT)

    after = side.record()
    assert isinstance(results, dict)
    expected = {
        "wait_lost": True,
        "on_lost called": True,
        "on_lost_calls": 1,
        "lost": True,
        "raise_if_lost": "LeaseLostError",
        "release": False,
        "lost_after_release": True,
    }
    got = {name: results.get(name) for name in expected}
    assert got == expected, f"{side.case.id}: {results}"
    assert after.token == taker.token, "the new holder's record lost its token"
    if isinstance(before.expiry, int):
        # PTTL only falls as time passes; a renewal by the old holder would raise it.
        assert isinstance(after.expiry, int)
        assert 0 < after.expiry <= before.expiry, f"PTTL {before.expiry} -> {after.expiry} ms"
    else:
        assert after.expiry == before.expiry, "the new holder's expiry moved"
    assert isinstance(old_fence, int)
    assert isinstance(taker.fence, int)
    assert taker.fence > old_fence, f"fence {taker.fence} after {old_fence}"
    print(
        f"[renewal-pause {side.case.id}] on_lost in {results.get('on_lost_thread')!r}, "
        f"fences {old_fence} -> {taker.fence}"
    )
    assert taker.release() is True

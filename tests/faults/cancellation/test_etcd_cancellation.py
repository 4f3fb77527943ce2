"""asyncio cancellation at random points on etcd leaves no permit held by nobody, and is never
swallowed.

The Redis trials of ``test_cancellation.py`` (``tests/_support/cancellation.py``:
the same :class:`Plan`, patterns, batches and checks) on a real etcd member
through aetcd, with ``AsyncDMutex`` and ``AsyncDSemaphore`` (3 permits) on
two keys, each lock's keys under the session's prefix
(``etcd_servers``). The client is wrapped in :class:`DelayingEtcd`, which
sleeps before and after each request (a lease grant, a transaction, a
revoke, a keep-alive, a watch): a cancellation can land before a request is
sent, while aetcd awaits the server (gRPC then cancels the call; the
server may have applied it, or may apply it later), or after the server
answered but before dmutex has the reply. A hold on etcd is a slot key
under a lease of its own (``store.py``): an acquire is a grant, then one
transaction; a release, the lease's revoke; a waiter watches the slot key
(its phases are noted ``watch/...``, the rest of a wait ``retry wait``).

Rules of the test:

- After each batch, once every task of the event loop has finished, every
  key under the test's prefix is read through the gateway: since every
  trial ends by releasing, any key left is an orphan, held by nobody until
  its lease's 30 s TTL runs out, and fails the test.
- Every lease the trials granted (their IDs are seen as the requests pass
  the wrapper) and that the server still holds (``LeaseLeases``) is
  counted: one that holds a key is an orphan's and fails the test; one
  that holds none is garbage. The store revokes the lease of a failed
  attempt, and an acquire that raises (a cancellation) revokes its token's
  lease; but a grant cancelled in flight can reach the server after that
  revoke (gRPC cancels the call on the client; the server may have it
  already, on a stream of its own), and its lease then lives out its TTL,
  holding nothing. Those are counted and printed by where their trial's
  cancellation landed, not failed: they block no one. Each batch's leases
  are revoked before the next, so that none is counted twice.
- Each task whose ``cancel()`` was accepted must end cancelled (the
  cancellation propagated); the others must end without an error. aetcd's
  ``watch_once`` waits for its event through ``asyncio.wait_for``, which on
  Python <= 3.11 returns the event and swallows a cancellation that arrives
  with it (CPython gh-86296; on 3.11, 38 of 399 cancellations of a bare
  ``watch_once`` whose event was due returned the event, none on 3.13): the
  store runs it in a task of its own and waits with ``asyncio.wait``, so
  that the waiter's cancellation propagates whatever aetcd does with its
  own (before, 0-2 trials a run on 3.11 took the lock after their
  cancellation). The trials whose cancellation landed in a watch that then
  returned are counted apart and printed, and any of them that swallowed
  it fails the test.
- Every phase of both stages (``acquire``, ``release``) must be hit, and a
  cancellation must land in a body.

The trials are bounded: at most :data:`BOUND` seconds of batches, and they
stop once every phase of both stages was hit and :data:`LEAST` trials ran,
as PostgreSQL's do. Later batches cancel later (``spread``), to reach the
releases however slow the host. The summary (trials, cancellations by
where they landed, orphans, leftover leases, requests by method) is printed
and is part of every failure message.

aetcd is connected and its watcher's stream opened before the trials: aetcd
waits for a concurrent connect through ``asyncio.wait_for``, which on
Python <= 3.11 swallows a cancellation that arrives as it returns (CPython
gh-86296), and its watcher's stream is a task of the client's, alive as
long as it is, not a trial's.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import aetcd
import pytest

from dmutex import AsyncDMutex, AsyncDSemaphore
from dmutex._backends.etcd.leases import lease_id
from dmutex._backends.etcd.store import PERMIT
from tests._support.cancellation import (
    Face,
    NotingClock,
    Plan,
    Storage,
    Tally,
    Trial,
    current,
    doing,
    judge,
    note_retry_waits,
    run_trials,
)
from tests._support.etcd_fault_clients import (
    RAISED,
    Arguments,
    DelayingEtcd,
    keys_under,
    lease_keys,
    live_leases,
    revoke,
)
from tests._support.etcd_servers import Endpoint, Session, delete_prefix
from tests._support.fault_clients import PHASES

PERMITS = 3
KEYS = ("job-a", "job-b")
MAX_DELAY = 0.0015  # each of the delaying client's two sleeps, at most
SEED = 20261201
# 16 tasks a batch, each cancelled after up to 30, 60, 120 or 240 ms: an etcd request takes
# about 2 ms alone here and 10-15 ms with 16 tasks at once (each write is committed to disk),
# so Redis's times, about 5 times longer. A 30 s TTL: an orphan stays visible. The retrying
# patterns give up after 200 ms and wait 20 ms at most between attempts: long enough for a
# cancellation to land in a watch, which ends at the release it waits for.
ETCD = Plan(
    "etcd",
    batches=400,
    batch=16,
    keys=KEYS,
    cancel_after=0.03,
    ttl=30.0,
    timeout=0.2,
    retry_delay=0.02,
    body=0.01,
    spread=(1, 2, 4, 8),
)
LEAST = 1920  # trials at least, once every phase of both stages was hit
BOUND = 60.0  # seconds of batches at most; the phases are asserted whatever ran
HARD_BOUND = 120.0  # seconds, the whole run: a batch that hangs fails the test
STAGE_PHASES = [f"{stage}/{phase}" for stage in ("acquire", "release") for phase in PHASES]


class Phases:
    """:class:`DelayingEtcd`'s phases, noted with the trial's stage (``between``: no request).

    A watch is a waiter's wait, not a request of the stage: ``watch/<phase>``.
    A watch that aetcd ends (with an event, or its timeout) after the
    trial's cancellation was accepted while aetcd awaited it has swallowed
    that cancellation (aetcd waits through ``asyncio.wait_for``: CPython
    gh-86296, Python <= 3.11): its trial is noted in :attr:`swallowed_by_aetcd`.
    """

    def __init__(self) -> None:
        self.swallowed_by_aetcd: set[int] = set()

    def __call__(self, method: str, phase: str | None) -> None:
        trial = current()
        if trial is None:
            return
        if phase is None:
            doing(f"{trial.stage}/between")
            return
        ended = method == "watch_once" and phase in ("after", RAISED)
        if ended and trial.landed == "watch/in-flight":
            # aetcd returned, or raised its own error: the cancellation went nowhere.
            self.swallowed_by_aetcd.add(trial.number)
        if phase != RAISED:  # an error ends the request: "between" follows
            doing(f"watch/{phase}" if method == "watch_once" else f"{trial.stage}/{phase}")


def set_aside(tally: Tally, trials: set[int]) -> list[str]:
    """Take the swallowed cancellations of ``trials`` out of ``tally``; return them."""
    taken = [text for text in tally.swallowed if int(text.split()[1]) in trials]
    tally.swallowed = [text for text in tally.swallowed if text not in taken]
    return taken


@dataclass
class Leftovers:
    """The leases the trials granted, and those left alive after their batch."""

    granted: dict[int, Trial] = field(default_factory=dict)
    """Lease ID -> the trial whose request granted it (every grant's ID is dmutex's own)."""
    owners: dict[str, Trial] = field(default_factory=dict)
    """Token -> the trial whose transaction put it (to name an orphan's trial)."""
    garbage: Counter[str] = field(default_factory=Counter)
    """Leases alive with no key, by where their trial's cancellation landed."""
    garbage_patterns: Counter[str] = field(default_factory=Counter)
    holding: list[str] = field(default_factory=list)
    """Leases alive that hold a key: ``"lease <id>: <keys>"`` (each an orphan's)."""
    alive: set[int] = field(default_factory=set)
    """This batch's leases still held by the server, read with the keys; revoked by clear()."""

    def sent(self, method: str, arguments: Arguments) -> None:
        trial = current()
        if trial is None:
            return
        if method == "lease":
            lease = arguments["lease_id"]
            assert isinstance(lease, int), f"a grant without dmutex's lease ID: {arguments}"
            self.granted.setdefault(lease, trial)
        elif method == "transaction":
            success = arguments["success"]
            assert isinstance(success, list)
            for op in success:
                value = getattr(op, "value", None)  # a put's value is the holder's token
                if isinstance(value, bytes):
                    self.owners.setdefault(value.decode(), trial)

    def audit(self, endpoint: Endpoint) -> None:
        """Count the granted leases the server still holds (none of their trials runs)."""
        self.alive = live_leases(endpoint) & set(self.granted)
        for lease in sorted(self.alive):
            keys = lease_keys(endpoint, lease)
            if keys is None:
                continue  # expired or revoked since it was listed
            if keys:
                self.holding.append(f"lease {lease}: {keys}")
                continue
            trial = self.granted[lease]
            self.garbage[trial.landed or "not cancelled"] += 1
            self.garbage_patterns[f"{trial.kind} {trial.pattern}"] += 1

    def summary(self) -> str:
        return (
            f"  leases granted by the trials: {len(self.granted)}; left alive with no key: "
            f"{sum(self.garbage.values())}, by what their task awaited when cancelled: "
            f"{dict(sorted(self.garbage.items()))}, by pattern: "
            f"{dict(sorted(self.garbage_patterns.items()))}; left holding a key: "
            f"{len(self.holding)} {self.holding[:5]}"
        )


def test_real_etcd(etcd_session: Session, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real etcd member behind a delaying aetcd client: cancellations in every phase of a
    request, none swallowed, no key left that no task holds, leftover leases counted."""
    note_retry_waits(monkeypatch)
    server = etcd_session.fresh()
    endpoint = server.endpoints[0]
    prefix = f"{etcd_session.prefix}cancel-{uuid.uuid4().hex[:8]}/"
    rng = random.Random(SEED)
    leftovers = Leftovers()
    phases = Phases()
    started = time.monotonic()

    def permits() -> dict[str, str]:
        # The keys and the leases, read together after the batch: every trial has ended.
        found = keys_under(endpoint, prefix)
        leftovers.audit(endpoint)
        return found

    def clear() -> None:
        for lease in leftovers.alive:
            revoke(endpoint, lease)
        delete_prefix(endpoint, etcd_session.prefix)

    def enough(tally: Tally) -> bool:
        if time.monotonic() - started >= BOUND:
            return True
        ran = sum(tally.trials.values())
        return ran >= LEAST and all(tally.landed[where] for where in STAGE_PHASES)

    async def main() -> tuple[Tally, DelayingEtcd]:
        inner = aetcd.Client(host=endpoint.host, port=endpoint.port, timeout=10)
        try:
            await warm(inner, prefix)
            client = DelayingEtcd(inner, rng, MAX_DELAY, leftovers.sent, phases)
            clock = NotingClock()
            faces: dict[str, Face] = {
                "mutex": AsyncDMutex(
                    "svc", client, key_prefix=f"{prefix}_dmutex_svc:", clock=clock
                ),
                "semaphore": AsyncDSemaphore(
                    "svc",
                    client,
                    max_permits=PERMITS,
                    key_prefix=f"{prefix}_dsemaphore_svc:",
                    clock=clock,
                ),
            }
            storage = Storage(permits, clear, owner=lambda token: leftovers.owners.get(token))
            return await run_trials(ETCD, faces, storage, rng, enough), client
        finally:
            await inner.close()

    try:
        tally, client = asyncio.run(asyncio.wait_for(main(), HARD_BOUND))
    finally:
        delete_prefix(endpoint, etcd_session.prefix)
    tally.sent = client.counts
    by_aetcd = set_aside(tally, phases.swallowed_by_aetcd)
    notes = (
        f"  {time.monotonic() - started:.1f} s of trials\n{leftovers.summary()}\n"
        f"  swallowed inside aetcd's watch_once (CPython gh-86296): {len(by_aetcd)} {by_aetcd[:5]}"
    )
    print(notes)
    summary = judge(tally) + "\n" + notes
    assert not by_aetcd, summary  # the store's task around aetcd's watch_once lets none through
    for where in STAGE_PHASES:
        assert tally.landed[where] > 0, summary
    assert not leftovers.holding, summary
    # The lease check saw the trials' grants (every one names dmutex's lease ID), so a
    # lease left holding a key could not have been missed.
    assert len(leftovers.granted) >= tally.accepted // 2, summary


async def warm(inner: aetcd.Client, prefix: str) -> None:
    """Connect, and open the watcher's stream: both the client's, before any trial runs.

    One grant and revoke of a lease the trials never use, and one watch that
    times out: the connection and the stream are up, and the tasks aetcd
    keeps for them are there before the trials' batches begin.
    """
    await inner.connect()
    warmup = lease_id(PERMIT, prefix, "warm-up", "warm-up")
    await inner.lease(30, lease_id=warmup)
    await inner.revoke_lease(warmup)
    with pytest.raises(aetcd.WatchTimeoutError):
        await inner.watch_once(f"{prefix}warm-up".encode(), timeout=0.01)

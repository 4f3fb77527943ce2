"""Three etcd members: the leader killed under load, and a holder's member cut off (issue 40).

The servers: three members of a new etcd cluster from the executable
(``tests/_support/etcd_servers.py``), on free 127.0.0.1 ports, etcd's default
timing (100 ms heartbeats, a 1 s election timeout: a lease lasts at least
2 s), each started, killed and stopped by its pid; the test's cluster is
closed (every member by its pid, its folder removed) whatever the outcome.
Every client talks to ONE member: dmutex does not move between endpoints,
the application does, by making a new client to another member.

**Leader kills under load** (:func:`test_leader_kills_under_load`). Eight
spawned worker processes (``tests/_support/etcd_failover_workers.py``,
built on the Redis proof's ``failover_workers.py``), four on the sync face
through etcd3gw and four on the asyncio face through aetcd, each first on
member ``i % 3``, take, hold and release a ``DMutex`` and a 3-permit
``DSemaphore`` on one key in a loop; when a request fails (its member is
dead, or has no leader) a worker reconnects to the next member and goes on.
Each holder records itself in the Redis proof's shared SQLite record (the
guarded resource), with a fenced write; under the mutex it also increments
a counter there, read when it enters and written when it leaves. Short
holds: a 2 s lease held 10-30 ms. In the last 0.2-0.5 s before each kill,
grants are *long*: ``auto_renew=True``, held 3 s (across the kill and the
election) by waiting in ``wait_lost()``, ``on_lost`` registered, the
holder's deadline in the record following its renewals. The fault,
:data:`ROUNDS` times, each at a random moment 0.5-1.5 s after the cluster
recovered from the previous one: the leader is SIGKILLed; the test waits
for a new leader named by a quorum, restarts the killed member on its
ports and data and waits until it is healthy, then until every worker has
been granted something since the kill (bounded). What must hold:

- no overlap: nobody enters the mutex (or a semaphore slot) that another
  holder is inside by a lease whose deadline has not passed, and never more
  than 3 holders are inside the semaphore (the record's overlap check);
- the counter is exact: it equals the increments the workers made under
  the mutex (an overlap would lose one; none is counted twice);
- fences strictly increase, per lock and slot, in the order the grants
  entered the record (etcd's revision), none missing;
- every long hold that was lost was told by its deadline: its ``on_lost``
  callback ran and its ``wait_lost()`` returned True before the TTL of its
  last answered request had run out from that request's send time (its
  ``expired_at``; dmutex's deadline is a margin earlier, and the lateness
  past it is printed); and no release answered False for a holder that
  left before its deadline (a lease that ended early, unannounced);
- every kill happened, and every worker was granted something after each.

The summary line has the Redis proof's fields, in its order (``[failover
replicas=...]`` there, ``[failover etcd]`` here), so that the figures page
can put etcd beside Redis with and without ``replicas=1``; what is etcd's
(losses told, the counter, reconnects) follows. ``not_replicated`` is a
Redis error, always 0 here; ``switch_s`` is from the kill until a quorum
names the new leader (every Sentinel naming the new primary, there).

**A holder's member cut off** (:func:`test_a_cut_off_member_tells_its_holder`,
once with the holder on a follower and once on the leader). The members
reach each other only through a switchboard of proxies
(``tests/_support/etcd_partition.py``) that knows which member dialed each
peer link; clients reach the members directly. A holder in a spawned
process (etcd3gw, ``auto_renew=True``, a 2 s lease) holds the lock through
member A; once a renewal has been answered, A is cut off from the other
two (its peer links blackholed both ways: nothing crosses, nothing is
closed). A rival then polls the lock through a member of the majority.
What must hold:

- the holder is told (callback and ``wait_lost()``) after the cut and by
  its lease's expiry (``expired_at``, as above): its renewals go to A,
  which cannot reach a quorum (a leader A renews alone until it steps down:
  its holder's deadline moves on for a while, which the line prints);
- the majority grants the lock only after that expiry, and after the
  holder was told; in etcd's own order, the holder's key was deleted (its
  lease ended) before the rival's put;
- healed, the cluster converges: all three members name one leader, A
  answers healthy and serves a linearizable read of the rival's key, and
  after the rival's release A grants the lock with a higher fence.

Each case is bounded (every wait has a timeout; the leader-kill run has a
budget); the lines (``[failover etcd]``, ``[partition etcd ...]``) go to
the CI log, as the Redis proof's do.
"""

from __future__ import annotations

import base64
import contextlib
import multiprocessing
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import etcd3gw
import pytest

from dmutex import DMutex
from dmutex._core.renewal import margin_ms
from tests._support import etcd_failover_workers, etcd_servers, processes, sampling
from tests._support.etcd_failover_workers import (
    MODE,
    PARTITION_SERVICE,
    SURVIVED,
    Config,
    EtcdRecord,
    EtcdReport,
    Held,
    Telling,
    Told,
)
from tests._support.etcd_partition import ProxiedCluster, partitioned_cluster
from tests._support.etcd_servers import Cluster, Endpoint
from tests._support.failover_workers import KEY, TTL, failover_rounds

T = TypeVar("T")

WORKERS = 8  # worker i: sync (etcd3gw) if even, asyncio (aetcd) if odd; first on member i % 3
ROUNDS = failover_rounds()  # 3 unless DMUTEX_FAILOVER_ROUNDS asks for more
CALM = (0.5, 1.5)  # seconds of normal running before each kill
LONG_LEAD = (0.2, 0.5)  # seconds before a kill during which grants are long
PROGRESS_WAIT = 15.0  # for every worker to be granted something after a kill
LEADER_WAIT = 15.0  # for a new leader (1-2 s with etcd's defaults), on a loaded machine
# Spawning eight interpreters that import dmutex, etcd3gw and aetcd (gRPC)
# takes 5-30 s on a loaded 2-core machine: the rounds' budget starts once
# every worker has been granted something.
SPAWN_WAIT = 45.0
ROUNDS_BUDGET = 45.0  # three rounds take 15-21 s, five 25-35 s
ROUND_NEEDS = 8.0  # a round is not started with less than this left of the budget
DURATION = SPAWN_WAIT + ROUNDS_BUDGET + 10.0  # a worker's own cap; the driver stops it before
SEED = 40
TTL_MS = int(TTL * 1000)


# --- leader kills: the faults, from a thread of the test while the workers run ---------------


@dataclass
class Kill:
    """One round's kill and what followed."""

    killed_at: float  # wall clock
    old: int
    new: int
    elected: float  # seconds from the kill until a quorum named the new leader
    rejoined: float  # seconds from the restart until the killed member was healthy
    progressed: frozenset[int]  # workers granted something after the kill, within the wait


@dataclass
class Driver:
    """Kills the leader ROUNDS times while the workers cycle; ends them when done."""

    cluster: Cluster
    record: EtcdRecord
    stop: Any  # multiprocessing Event: the workers stop
    hold_long: Any  # multiprocessing Event: grants made now are long
    kills: list[Kill] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    ends: float = 0.0  # monotonic: no round starts after ends - ROUND_NEEDS (set once all run)

    def run(self) -> None:
        """Every round, then stop the workers; an exception is kept for the test."""
        rng = random.Random(SEED)
        try:
            self._progress(0.0, SPAWN_WAIT)  # every worker granted once: they all run
            self.ends = time.monotonic() + ROUNDS_BUDGET
            for _ in range(ROUNDS):
                if self.stop.is_set() or time.monotonic() > self.ends - ROUND_NEEDS:
                    return
                time.sleep(rng.uniform(*CALM))
                self.kills.append(self._round(rng.uniform(*LONG_LEAD)))
        except BaseException as error:  # noqa: BLE001 - re-raised by the test, in its thread
            self.errors.append(error)
        finally:
            self.stop.set()

    def _round(self, lead: float) -> Kill:
        cluster = self.cluster
        old = cluster.wait_for_leader(self._left(LEADER_WAIT))
        try:
            self.hold_long.set()
            time.sleep(lead)
            killed_at, started = time.time(), time.monotonic()
            cluster.kill(old)
        finally:
            self.hold_long.clear()
        new = cluster.wait_for_leader(self._left(LEADER_WAIT))
        elected = time.monotonic() - started
        restarted = time.monotonic()
        cluster.start(old, timeout=self._left(etcd_servers.START_TIMEOUT))
        rejoined = time.monotonic() - restarted
        progressed = self._progress(killed_at, self._left(PROGRESS_WAIT))
        cluster.wait_for_leader(self._left(LEADER_WAIT))
        return Kill(killed_at, old, new, elected, rejoined, progressed)

    def _left(self, bound: float) -> float:
        return max(1.0, min(bound, self.ends - time.monotonic()))

    def _progress(self, since: float, wait: float) -> frozenset[int]:
        """Wait (``wait`` s at most) until every worker was granted something after ``since``."""
        until = time.monotonic() + wait
        while True:
            done = self.record.workers_since(since)
            if len(done) == WORKERS or time.monotonic() > until or self.stop.is_set():
                return frozenset(done)
            time.sleep(0.05)


# --- leader kills: the report -----------------------------------------------------------------


def spread(values: list[float]) -> str:
    """``min/median/max`` of ``values`` in seconds, or ``-``."""
    if not values:
        return "-"
    return f"{min(values):.2f}/{statistics.median(values):.2f}/{max(values):.2f}"


def deadline_of(telling: Telling) -> float:
    """The holder's deadline (wall clock): dmutex's margin before its ``expired_at``."""
    return telling.expired - margin_ms(int(telling.ttl * 1000)) / 1000


def late(telling: Telling) -> bool:
    """Whether a way of telling came after the lease could have ended at the server."""
    return telling.told > telling.expired or telling.waited > telling.expired


@dataclass
class Outcome:
    """What one run of the leader kills gave."""

    kills: list[Kill]
    reports: list[EtcdReport]
    grants: list[tuple[int, str, float, bool, bool, bool]]  # the record's, in time order
    fences: list[tuple[str, int, int | None]]  # the record's, in the order grants entered
    overlapped: int  # distinct holders someone entered beside
    counter: int
    seconds: float

    def total(self, name: str) -> int:
        return sum(int(getattr(report.base, name)) for report in self.reports)

    def increments(self) -> int:
        return sum(report.increments for report in self.reports)

    def tellings(self) -> list[Telling]:
        return [telling for report in self.reports for telling in report.tellings]

    def unordered_fences(self) -> list[tuple[str, int, int | None]]:
        """Grants whose fence is missing, or not above the last one of their lock and slot."""
        last: dict[tuple[str, int], int] = {}
        found = []
        for lock, slot, fence in self.fences:
            before = last.get((lock, slot))
            if fence is None or (before is not None and fence <= before):
                found.append((lock, slot, fence))
            if fence is not None:
                last[(lock, slot)] = max(fence, before or fence)
        return found

    def unavailable(self) -> list[float]:
        """Per kill: seconds from the kill to the first grant recorded after it."""
        windows = []
        for kill in self.kills:
            after = [at for _, _, at, _, _, _ in self.grants if at > kill.killed_at]
            if after:
                windows.append(min(after) - kill.killed_at)
        return windows

    def between(self, index: int) -> list[tuple[int, str, float, bool, bool, bool]]:
        """The grants from kill ``index`` to the next one (or the end)."""
        start = self.kills[index].killed_at
        end = self.kills[index + 1].killed_at if index + 1 < len(self.kills) else float("inf")
        return [g for g in self.grants if start < g[2] <= end]

    def nearest(self, moment: float) -> int:
        """The index of the kill nearest to wall-clock ``moment``."""
        return min(range(len(self.kills)), key=lambda i: abs(self.kills[i].killed_at - moment))

    def lines(self) -> list[str]:
        tag = "[failover etcd]"
        errors: dict[str, int] = {}
        for report in self.reports:
            for name, count in report.base.errors:
                errors[name] = errors.get(name, 0) + count
        tellings = self.tellings()
        lateness = [t.told - deadline_of(t) for t in tellings if t.told != float("inf")]
        lines = [
            f"{tag} failovers={len(self.kills)} (leader kills {len(self.kills)}) "
            f"grants={self.total('grants')} (long {self.total('long_holds')}) "
            f"overlaps={self.total('overlaps')} (holders overlapped {self.overlapped}) "
            f"stale_fences={self.total('stale_fences')} lost_grants={self.total('lost')} "
            f"not_replicated={self.total('not_replicated')} timeouts={self.total('timeouts')} "
            f"release_errors={self.total('release_errors')} "
            f"overstays={self.total('overstays')} unavailable_s={spread(self.unavailable())} "
            f"switch_s={spread([k.elected for k in self.kills])} seconds={self.seconds:.1f} "
            f"losses={len(tellings)} (told late {sum(late(t) for t in tellings)}, "
            f"after the deadline s {spread(lateness)}) "
            f"counter={self.counter}/{self.increments()} "
            f"reconnects={sum(r.reconnects for r in self.reports)}",
            f"{tag} errors survived: "
            + (", ".join(f"{k}:{v}" for k, v in sorted(errors.items())) or "none"),
        ]
        windows = self.unavailable()
        for i, kill in enumerate(self.kills):
            window = f"{windows[i]:.2f}" if i < len(windows) else "-"
            grants = self.between(i)
            # A long hold is made just before a kill, and ends within LONG_HOLD of it.
            long = [g for g in self.grants if g[3] and self.nearest(g[2]) == i]
            lost = [t for t in tellings if self.nearest(t.granted) == i]
            lines.append(
                f"{tag} #{i + 1} leader member{kill.old} killed: member{kill.new} led after "
                f"{kill.elected:.2f} s, member{kill.old} healthy {kill.rejoined:.2f} s after its "
                f"restart, first grant {window} s; long holds across it {len(long)}, "
                f"{len(lost)} lost; until the next kill {len(grants)} grants, "
                f"{sum(g[4] for g in grants)} overlaps, {sum(g[5] for g in grants)} stale "
                f"fences; workers granted {len(kill.progressed)}/{WORKERS}"
            )
        return lines


def run_kills(cluster: Cluster, folder: Path) -> Outcome:
    """The workers and the rounds, on ``cluster``; what they gave."""
    started = time.monotonic()
    record = EtcdRecord(folder / "record.sqlite")
    record.create()
    ctx = multiprocessing.get_context("spawn")
    stop, hold_long = ctx.Event(), ctx.Event()
    config = Config(
        endpoints=tuple((e.host, e.port) for e in (cluster.endpoint(i) for i in range(3))),
        record=str(record.path),
        duration=DURATION,
        seed=SEED,
    )
    driver = Driver(cluster, record, stop, hold_long)
    thread = threading.Thread(target=driver.run, name="etcd-failover-driver", daemon=True)
    thread.start()
    try:
        reports = processes.run_workers(
            etcd_failover_workers.work,
            WORKERS,
            config,
            stop,
            hold_long,
            deadline=DURATION + 30.0,  # spawning and importing, before the barrier
            report=EtcdReport,
        )
    finally:
        stop.set()
        thread.join(60.0)
    if driver.errors:
        raise driver.errors[0]
    assert not thread.is_alive(), "the fault driver did not end"
    return Outcome(
        driver.kills,
        reports,
        record.grants(MODE),
        record.fences(MODE),
        record.overlapped(MODE),
        record.counter(),
        time.monotonic() - started,
    )


def test_leader_kills_under_load(etcd_cluster: Cluster, tmp_path: Path) -> None:
    """No overlap, an exact counter, ordered fences, every loss told in time, through 5 kills."""
    outcome = run_kills(etcd_cluster, tmp_path)
    for line in outcome.lines():
        print(line)
    assert len(outcome.reports) == WORKERS
    assert sorted(r.base.face for r in outcome.reports) == ["async"] * 4 + ["sync"] * 4
    assert len(outcome.kills) == ROUNDS, "fewer kills than rounds: the budget ran out"
    assert outcome.total("overlaps") == 0
    assert outcome.overlapped == 0
    assert outcome.increments() > 0
    assert outcome.counter == outcome.increments(), "an increment under the mutex was lost"
    assert outcome.total("stale_fences") == 0
    assert len(outcome.fences) == outcome.total("grants")
    assert not outcome.unordered_fences()
    assert outcome.total("lost") == 0, "a release found a lease gone before its deadline"
    told_late = [t for t in outcome.tellings() if late(t)]
    assert not told_late, f"holders told after their lease's expiry: {told_late}"
    for i, kill in enumerate(outcome.kills):
        missing = set(range(WORKERS)) - kill.progressed
        assert not missing, f"kill #{i + 1}: workers {sorted(missing)} not granted after it"


# --- a holder's member cut off ----------------------------------------------------------------

CutCase = Literal["follower", "leader"]
RIVAL_TTL = 60.0  # the rival holds until the heal is checked, then releases
RIVAL_PATIENCE = 20.0  # the rival's polling, from the cut: the lease ends within 5 s
HELD_TIMEOUT = 30.0  # for the holder to spawn, take the lock and see a renewal answered
TOLD_TIMEOUT = 20.0  # for the holder's report of its loss, after the rival's grant
CONVERGE_TIMEOUT = 20.0  # for the healed cluster to agree again
POLL = 0.05


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def slot_key() -> bytes:
    """The etcd key of the mutex's one slot (the store's layout, default key prefix)."""
    return f"_dmutex_{PARTITION_SERVICE}:permit:0:{KEY}".encode()


def read_slot(endpoint: Endpoint) -> bytes | None:
    """The slot key's value through ``endpoint`` (a linearizable read), or None if absent."""
    found = etcd_servers.request(endpoint, "/v3/kv/range", {"key": _b64(slot_key())})
    kvs = found.get("kvs") or []
    return base64.b64decode(kvs[0].get("value", "")) if kvs else None


def deleted_revision(client: etcd3gw.Etcd3Client, after: int) -> int:
    """The revision at which the slot key was first deleted after revision ``after``.

    Read from etcd's history (a watch from ``after + 1``, deletions only), so
    that it is etcd's own order of events, not a time this test measured.
    """
    event: Any = client.watch_once(
        slot_key(), timeout=5.0, start_revision=after + 1, filters=["NOPUT"]
    )
    return int(event["kv"]["mod_revision"])


def polled(call: Callable[[], T | None], what: str, timeout: float) -> T:
    """``call()``'s first result that is not None, retrying what the cut makes it raise."""
    until = time.monotonic() + timeout
    while True:
        try:
            found = call()
        except SURVIVED:
            found = None
        if found is not None:
            return found
        if time.monotonic() > until:
            pytest.fail(f"{what}: nothing within {timeout:.0f} s")
        time.sleep(POLL)


def converged(cluster: ProxiedCluster, cut: int, rival: bytes) -> bool:
    """All members name one leader; the cut one is healthy and reads the rival's key."""
    statuses = cluster.statuses()
    if len(statuses) != cluster.size or len({s.leader for s in statuses.values()}) != 1:
        return False
    if 0 in {s.leader for s in statuses.values()}:
        return False
    try:
        etcd_servers.health(cluster.endpoint(cut))
        return read_slot(cluster.endpoint(cut)) == rival
    except etcd_servers.PROBE_ERRORS:
        return False


@contextlib.contextmanager
def gateway(endpoint: Endpoint) -> Iterator[etcd3gw.Etcd3Client]:
    """An etcd3gw client of ``endpoint``, its session closed after the block."""
    client = etcd3gw.Etcd3Client(host=endpoint.host, port=endpoint.port, timeout=2.0)
    try:
        yield client
    finally:
        client.session.close()


@dataclass(frozen=True)
class Cut:
    """One cut's figures: seconds from the cut (``time.monotonic()``), and the fences."""

    case: CutCase
    told: Told
    cut_at: float
    granted_at: float
    fences: tuple[int, int, int]  # the holder's, the deletion's revision, the rival's
    converged: float  # seconds from the heal
    dialers: tuple[int, int]  # peer connections whose dialer was named, and not

    def since(self, moment: float) -> str:
        return f"{moment - self.cut_at:.2f}"

    def moved(self) -> float:
        """How far the holder's deadline moved on after the cut (renewals A answered alone)."""
        deadlines = self.told.deadlines
        before = [d for seen, d in deadlines if seen <= self.cut_at]
        return max(0.0, deadlines[-1][1] - before[-1]) if before else 0.0

    def line(self) -> str:
        told = self.told
        deadline = told.expired - margin_ms(TTL_MS) / 1000
        return (
            f"[partition etcd cut={self.case}] told_s={self.since(told.told)} "
            f"(wait_lost {self.since(told.waited)}) deadline_s={self.since(deadline)} "
            f"expired_s={self.since(told.expired)} granted_s={self.since(self.granted_at)} "
            f"deadline_moved_after_cut_s={self.moved():.2f} "
            f"fences={self.fences[0]}<{self.fences[1]}(deleted)<{self.fences[2]} "
            f"holder_release={told.released} converged_s={self.converged:.2f} "
            f"peer_links named {self.dialers[0]}, unnamed {self.dialers[1]}"
        )


def cut_off(cluster: ProxiedCluster, case: CutCase) -> Cut:
    """Hold through member A, cut A off, let the majority grant, heal; the figures."""
    leader = cluster.wait_for_leader(LEADER_WAIT)
    cut = leader if case == "leader" else (leader + 1) % cluster.size
    other = (cut + 1) % cluster.size
    member = cluster.endpoint(cut)
    spawned = processes.spawned(etcd_failover_workers.partition_holder, member.host, member.port)
    with spawned as holder, gateway(cluster.endpoint(other)) as client:
        held = holder.report("held", HELD_TIMEOUT)
        assert isinstance(held, Held)
        assert held.fence is not None
        lock = DMutex(PARTITION_SERVICE, client)
        cut_at = time.monotonic()
        cluster.cut(cut)
        rival = polled(
            lambda: lock.acquire_with_retry(KEY, ttl=RIVAL_TTL, timeout=1.0, retry_delay=0.01),
            "the majority's grant",
            RIVAL_PATIENCE,
        )
        granted_at = time.monotonic()
        told = holder.finish("results", TOLD_TIMEOUT)
        assert isinstance(told, Told)
        assert rival.fence is not None
        deleted = deleted_revision(client, held.fence)
        healed = time.monotonic()
        cluster.heal()
        sampling.until(
            lambda: converged(cluster, cut, rival.token.encode()),
            "the healed cluster agreeing, the cut member reading the rival's key",
            CONVERGE_TIMEOUT,
            poll=POLL,
        )
        converged_s = time.monotonic() - healed
        assert rival.release()
    with gateway(member) as client:
        again = polled(
            lambda: DMutex(PARTITION_SERVICE, client).acquire(KEY, ttl=TTL),
            "a grant through the healed member",
            CONVERGE_TIMEOUT,
        )
        assert again.fence is not None
        assert again.fence > rival.fence
        assert again.release()
    assert not cluster.board.errors
    assert cluster.board.named > 0, "the switchboard named no dialer: the cut cut nothing"
    return Cut(
        case,
        told,
        cut_at,
        granted_at,
        (held.fence, deleted, rival.fence),
        converged_s,
        (cluster.board.named, cluster.board.unnamed),
    )


@pytest.mark.parametrize("case", ["follower", "leader"])
def test_a_cut_off_member_tells_its_holder(case: CutCase) -> None:
    """Told by its deadline; the majority grants only after the lease ended; healed, one cluster."""
    with partitioned_cluster() as cluster:
        made = cut_off(cluster, case)
    print(made.line())
    told = made.told
    assert told.lost
    assert made.cut_at < told.told <= told.expired, "the callback came before the cut, or late"
    assert made.cut_at < told.waited <= told.expired, "wait_lost() said so before the cut, or late"
    assert made.granted_at >= told.expired, "the majority granted before the holder's lease ended"
    assert max(told.told, told.waited) <= made.granted_at
    holder, deleted, rival = made.fences
    assert holder < deleted < rival, "etcd's history: the lease ended after the rival's put"

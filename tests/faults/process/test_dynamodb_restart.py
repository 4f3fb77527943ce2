"""dynalite killed (SIGKILL) and started again on its data: the lease outlives it, or is lost.

What it breaks: a dynalite of the test's own (dynalite is not DynamoDB; it
speaks DynamoDB's protocol) that keeps its tables on disk (``path``: LevelDB
through leveldown, ``dynamodb_servers.start_dynalite_on_disk``), killed
with SIGKILL while a holder holds a fenced lease that it renews
(``auto_renew=True``), and started again on the same port and folder. A
contender, another client and instance, polls the same key every 50 ms
all along. The clients are botocore's (standard retries, 2 of them; 1.5 s
to connect and to read). Where leveldown does not load, the tests skip
and say why: an in-memory dynalite would come back empty, and show
nothing of this.

What must hold:

1. The kill outlived (a 12 s TTL, sync and asyncio holders): the server
   is killed right after the grant, kept down until the holder's renewal
   has been tried against it, and started again. The lease's item is
   still there with the holder's token and at least the expiry it had
   (the contender cannot take it, before the kill, while the server is
   down, or after); the renewal resumes (a renewal answered after the
   restart moves the item's expiry on from the grant's) and the lease is
   never reported lost; its release answers True, and the contender gets
   the key after it. The margin: the lease's deadline is 10.8 s after the
   grant's send, the renewal that fails comes 4 s after it, and the
   restart takes under a second here.
2. The kill outlasted (a 2 s TTL, sync): the server stays down until the
   holder is told its lease is lost, by its deadline, with no reply from
   anyone. Started again, the item is still there with the holder's token
   and expiry; the contender is granted the key (once that expiry has
   passed), and the holder's release answers False.
3. In both: never two holders (each holder's own accounting: from its
   acquire's return to the earlier of its release call and the last
   deadline it read, ``time_left``); every fence is above every fence
   granted before it, each grant after the restart above all those
   before the kill (the counter item came back), and a counter pushed
   ahead of the clock before the kill (a grant by an instance whose clock
   reads a day ahead) is still ahead after it: the next fence is above it,
   where the clock alone would give one below. The contender sees
   connection errors only.

Loopback only; the server is started by the test and stopped by its pid.
``-s`` prints a summary line per case. ``DMUTEX_FAULT_SEED`` changes the
seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import botocore.exceptions
import pytest
from aiobotocore.session import get_session

from dmutex import AsyncDMutex, DMutex, ManualClock
from tests._support import dynamodb_servers, servers
from tests._support.dynamodb_servers import Server, Session
from tests._support.faces import LoopThread

FaceName = Literal["sync", "async"]

SEED = int(os.environ.get("DMUTEX_FAULT_SEED", "20240611"))
SERVICE = "restart"
KEY = "k"
AHEAD = "ahead"  # the key whose fence counter is pushed ahead of the clock
AHEAD_SECONDS = 86_400.0  # how far ahead the pushing instance's clock reads

OUTLIVED_TTL = 12.0  # renewed every 4 s; the deadline 10.8 s after each renewal's send
OUTLASTED_TTL = 2.0  # the deadline 1.8 s after each renewal's send
CONTENDER_TTL = 2.0
CONTENDER_HOLD = 0.05  # seconds the contender keeps the key when it gets it
POLL = 0.05  # the contender's pause between two tries
LOOK_EVERY = 0.02  # a holder's reading of its own deadline
EARLIER = 3  # grants of KEY (each released) before the holder's
RESTART_PAUSE = (0.0, 0.3)  # seconds, seeded, between the failed renewal and the restart

REQUEST_TIMEOUT = 1.5  # botocore's connect and read timeouts
RETRIES = {"max_attempts": 2, "mode": "standard"}  # 3 attempts in all
WAIT = 30.0  # the most any step waits for what it waits for

# What botocore raises while the server is down or going: refused, reset, timed out.
FAILURES: tuple[type[Exception], ...] = (
    botocore.exceptions.HTTPClientError,
    botocore.exceptions.ConnectionError,
)


def wait_for(what: str, done: Callable[[], bool], timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.01)


# --- the server -------------------------------------------------------------------------------


@dataclass
class DiskDynalite:
    """dynalite on a port and folder of its own, its tables on disk: killed, started again."""

    source: dynamodb_servers.Dynalite
    process: servers.ServerProcess
    server: Server | None = None
    starts: int = 0

    @property
    def data(self) -> Path:
        return self.process.folder / "data"

    def start(self) -> Server:
        self.server = dynamodb_servers.start_dynalite_on_disk(self.source, self.process, self.data)
        self.starts += 1
        return self.server

    def kill(self) -> None:
        self.process.kill()

    def down(self) -> bool:
        """Whether a request to its port fails: nothing answers there."""
        assert self.server is not None
        with self.server.connect(**dynamodb_servers.PROBE_CONFIG) as client:
            try:
                dynamodb_servers.list_tables_once(client)
            except dynamodb_servers.PROBE_ERRORS:
                return True
        return False


@pytest.fixture
def dynalite(dynamodb_session: Session) -> Iterator[DiskDynalite]:
    """A dynalite on disk, started; stopped by its pid and its folder removed at the end."""
    source = dynamodb_session.found.source("dynalite")
    if source is None:
        pytest.skip(dynamodb_session.found.why_not("dynalite"))
    assert isinstance(source, dynamodb_servers.Dynalite)
    problem = dynamodb_servers.leveldown_problem(source)
    if problem is not None:
        pytest.skip(f"dynalite cannot keep its tables on disk here: {problem}")
    process = servers.ServerProcess(
        "dynalite-disk", keep=True, stop_timeout=dynamodb_servers.STOP_TIMEOUT
    )
    found = DiskDynalite(source, process)
    try:
        found.start()
        yield found
    finally:
        process.close()


# --- what the holders saw ---------------------------------------------------------------------


@dataclass(eq=False)
class Hold:
    """A grant as its holder saw it: from its acquire's return to its release or deadline."""

    who: str
    fence: int
    start: float  # monotonic, when the acquire returned
    claimed: float  # the latest deadline the holder read: a reading's time plus time_left
    called_release: float | None = None

    def look(self, handle: Any) -> bool:
        """Read the holder's deadline: False once it reads none (lost, or released)."""
        now = time.monotonic()  # before time_left: the claim is never late
        left: float = handle.time_left
        if left > 0:
            self.claimed = max(self.claimed, now + left)
        return left > 0

    @property
    def end(self) -> float:
        if self.called_release is None:
            return self.claimed
        return min(self.claimed, self.called_release)


@dataclass
class Ledger:
    """Every grant of KEY, in the order they were granted, and the contender's errors."""

    holds: list[Hold] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def opened(self, who: str, handle: Any) -> Hold:
        start = time.monotonic()
        hold = Hold(who, handle.fence, start, start)
        hold.look(handle)
        with self._lock:
            self.holds.append(hold)
        return hold

    def overlaps(self) -> list[str]:
        """Pairs of holds open at one instant (one permit: no two may be)."""
        with self._lock:
            holds = sorted(self.holds, key=lambda hold: hold.start)
        return [
            f"{a.who} (until {a.end:.3f}) and {b.who} (from {b.start:.3f})"
            for i, a in enumerate(holds)
            for b in holds[i + 1 :]
            if b.start < a.end
        ]

    def fences_out_of_order(self) -> list[str]:
        """Grants whose fence is not above every fence granted before them."""
        with self._lock:
            holds = sorted(self.holds, key=lambda hold: hold.start)
        return [
            f"{b.who} fence {b.fence} after {a.who} fence {a.fence}"
            for i, a in enumerate(holds)
            for b in holds[i + 1 :]
            if b.fence <= a.fence
        ]


def watch(ledger: Ledger, hold: Hold, handle: Any, stop: threading.Event) -> threading.Thread:
    """A thread that reads ``handle``'s deadline into ``hold`` until it reads none, or ``stop``."""

    def look() -> None:
        while not stop.is_set() and hold.look(handle):
            stop.wait(LOOK_EVERY)

    thread = threading.Thread(target=look, name=f"watch-{hold.who}", daemon=True)
    thread.start()
    return thread


class Contender:
    """Another client and instance that tries KEY every :data:`POLL` seconds, in a thread."""

    def __init__(self, ledger: Ledger, lock: DMutex) -> None:
        self.ledger = ledger
        self.lock = lock
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, name="contender", daemon=True)
        self.grants = 0

    def __enter__(self) -> Contender:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(WAIT)
        assert not self.thread.is_alive(), "the contender hung"

    def _poll(self) -> None:
        while not self.stop.wait(POLL):
            try:
                handle = self.lock.acquire(KEY, ttl=CONTENDER_TTL)
            except Exception as error:  # noqa: BLE001 - judged: a connection error, or reported
                self._failed(error)
                continue
            if handle is None:
                continue
            hold = self.ledger.opened(f"contender#{self.grants}", handle)
            self.grants += 1
            self.stop.wait(CONTENDER_HOLD)
            hold.look(handle)
            hold.called_release = time.monotonic()
            try:
                handle.release()
            except Exception as error:  # noqa: BLE001 - as above; the lease ends by its TTL
                self._failed(error)

    def _failed(self, error: Exception) -> None:
        with self.ledger._lock:
            if isinstance(error, FAILURES):
                self.ledger.errors[type(error).__name__] += 1
            else:
                self.ledger.unexpected.append(repr(error))


# --- the instances ----------------------------------------------------------------------------


def lock_of(client: Any, table: str, **options: Any) -> DMutex:
    lock = DMutex(SERVICE, client, table_name=table, fencing=True, **options)
    lock.ready()
    return lock


def earlier_fences(lock: DMutex) -> list[int]:
    """:data:`EARLIER` grants of KEY, each released: their fences."""
    fences = []
    for _ in range(EARLIER):
        handle = lock.acquire(KEY, ttl=CONTENDER_TTL)
        assert handle is not None
        assert handle.fence is not None
        fences.append(handle.fence)
        assert handle.release() is True
    return fences


def push_ahead(client: Any, table: str) -> int:
    """A grant of :data:`AHEAD` by an instance whose clock reads a day ahead: its fence."""
    clock = ManualClock(time.time() + AHEAD_SECONDS)
    lock = lock_of(client, table, clock=clock)
    handle = lock.acquire(AHEAD, ttl=CONTENDER_TTL)
    assert handle is not None
    assert handle.fence is not None
    assert handle.release() is True
    return handle.fence


def fence_after(client: Any, table: str) -> int:
    """A grant of :data:`AHEAD` on this host's clock, released: its fence."""
    lock = lock_of(client, table)
    handle = lock.acquire(AHEAD, ttl=CONTENDER_TTL)
    assert handle is not None
    assert handle.fence is not None
    assert handle.release() is True
    return handle.fence


def slot_item(client: Any, table: str) -> tuple[str, int] | None:
    """KEY's slot item as stored (expired or not): its token and expiry (epoch ms)."""
    found = client.get_item(
        TableName=table, Key={"key": {"S": f"permit:0:{KEY}"}}, ConsistentRead=True
    ).get("Item")
    if found is None:
        return None
    return found["value"]["S"], int(found["expiredAt"]["N"])


class Holder:
    """The holder: a DMutex of either face, its own client, the UpdateItem sends it made."""

    def __init__(self, face: FaceName, server: Server, table: str) -> None:
        self.face = face
        self.updates = 0  # UpdateItem sends: each renewal attempt, and the grant's fence
        args = server.client_args(timeout=REQUEST_TIMEOUT, retries=RETRIES)
        self.loop: LoopThread | None = None
        if face == "sync":
            self.client = dynamodb_servers.make_client(**args)
            self.lock: DMutex | AsyncDMutex = lock_of(self.client, table)
        else:
            self.loop = LoopThread()
            made = get_session().create_client("dynamodb", **args)
            self._made = made
            self.client = self.run(made.__aenter__())
            self.lock = AsyncDMutex(SERVICE, self.client, table_name=table, fencing=True)
            self.run(self.lock.ready())
        self.client.meta.events.register("before-send.dynamodb.UpdateItem", self._sent)

    def _sent(self, **_: Any) -> None:
        self.updates += 1

    def run(self, coro: Any) -> Any:
        assert self.loop is not None
        return self.loop.run(asyncio.wait_for(coro, WAIT))

    def acquire(self, ttl: float) -> Any:
        if isinstance(self.lock, DMutex):
            return self.lock.acquire(KEY, ttl=ttl, auto_renew=True)
        return self.run(self.lock.acquire(KEY, ttl=ttl, auto_renew=True))

    def release(self, handle: Any) -> bool:
        if self.loop is None:
            released: bool = handle.release()
            return released
        answer: bool = self.run(handle.release())
        return answer

    def close(self) -> None:
        if self.loop is None:
            self.client.close()
            return
        self.run(self._made.__aexit__(None, None, None))
        self.loop.close()


@dataclass
class Scene:
    """What a case sets up: the table, a clean client, the contender's lock, the fences."""

    table: str
    inspector: Any
    contender: DMutex
    earlier: list[int]
    ahead: int


@contextlib.contextmanager
def scene(dynalite: DiskDynalite, session: Session, name: str) -> Iterator[Scene]:
    assert dynalite.server is not None
    server = dynalite.server
    table = session.table_name(name)
    with (
        server.connect(timeout=REQUEST_TIMEOUT) as inspector,
        server.connect(timeout=REQUEST_TIMEOUT, retries=RETRIES) as contender_client,
    ):
        contender = lock_of(contender_client, table, default_ttl_seconds=CONTENDER_TTL)
        earlier = earlier_fences(contender)
        ahead = push_ahead(inspector, table)
        yield Scene(table, inspector, contender, earlier, ahead)


def restart_pause(name: str) -> float:
    return random.Random(f"{SEED}:{name}").uniform(*RESTART_PAUSE)


def judge(ledger: Ledger, scene: Scene, restarted: float, after: int) -> None:
    """Never two holders; fences in order, those after the restart above those before."""
    before_kill = [h.fence for h in ledger.holds if h.start < restarted] + scene.earlier
    after_restart = [h.fence for h in ledger.holds if h.start > restarted]
    problems = [
        f"{what}: {found}"
        for what, found in (
            ("overlaps", ledger.overlaps()),
            ("fences out of order", ledger.fences_out_of_order()),
            (
                "fences after the restart not above those before",
                [f for f in after_restart if f <= max(before_kill)],
            ),
            (
                "the counter pushed ahead was lost",
                [] if after > scene.ahead else [f"{after} after {scene.ahead}"],
            ),
            ("contender's unexpected errors", ledger.unexpected),
        )
        if found
    ]
    assert not problems, "; ".join(problems)


# --- the cases --------------------------------------------------------------------------------


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_lease_outlives_a_kill_and_its_renewal_resumes(
    dynalite: DiskDynalite, dynamodb_session: Session, face: FaceName
) -> None:
    """Killed right after the grant, down until a renewal failed, started again: see above."""
    with scene(dynalite, dynamodb_session, f"outlived-{face}") as s:
        ledger = Ledger()
        assert dynalite.server is not None
        holder = Holder(face, dynalite.server, s.table)
        stop = threading.Event()
        try:
            handle = holder.acquire(OUTLIVED_TTL)
            assert handle is not None
            hold = ledger.opened(f"holder-{face}", handle)
            watcher = watch(ledger, hold, handle, stop)
            with Contender(ledger, s.contender):
                stored = slot_item(s.inspector, s.table)
                assert stored is not None
                assert stored[0] == handle.token
                tried = holder.updates
                dynalite.kill()
                assert dynalite.down()
                # Down until a renewal was sent, and failed: nothing answers.
                wait_for("a renewal tried while down", lambda: holder.updates > tried)
                time.sleep(restart_pause(f"outlived-{face}"))
                restarted = time.monotonic()
                dynalite.start()
                back = slot_item(s.inspector, s.table)
                assert back is not None
                assert back[0] == handle.token, "the lease's item lost its token"
                assert back[1] >= stored[1], "the lease's item went back in time"
                # A renewal answered (after the restart: nothing answered before it) moves the
                # expiry on from the grant's.
                wait_for(
                    "a renewal after the restart",
                    lambda: handle.lost or round(handle.expired_at.timestamp() * 1000) > stored[1],
                )
                renewed = slot_item(s.inspector, s.table)
                lost = handle.lost
                hold.look(handle)
                hold.called_release = time.monotonic()
                stop.set()
                watcher.join(WAIT)
                released = holder.release(handle)
                contender_before = sum(1 for h in ledger.holds if h.who.startswith("contender"))
                # After the release the key is free again: the contender takes it.
                wait_for(
                    "the contender's grant after the release",
                    lambda: (
                        sum(1 for h in ledger.holds if h.who.startswith("contender"))
                        > contender_before
                    ),
                )
            after = fence_after(s.inspector, s.table)
        finally:
            stop.set()
            holder.close()
        print(
            f"[dynamodb-store restart {dynalite.server.label} outlived {face}] seed={SEED} "
            f"starts={dynalite.starts} lost={lost} released={released} "
            f"grants={len(ledger.holds)} contender_errors={dict(ledger.errors)} "
            f"fences={[h.fence for h in ledger.holds]} ahead={s.ahead} after={after}"
        )
        assert not lost, "the lease was reported lost, though the server came back in time"
        assert renewed is not None
        assert renewed[0] == handle.token
        assert renewed[1] > stored[1]
        assert released is True
        assert not any(
            h.who.startswith("contender") and h.start < hold.end for h in ledger.holds
        ), "the contender was granted the key while the holder held it"
        judge(ledger, s, restarted, after)


def test_a_lease_is_lost_by_its_deadline_while_the_server_is_down(
    dynalite: DiskDynalite, dynamodb_session: Session
) -> None:
    """Killed and kept down until the holder is told its lease is lost: see above."""
    with scene(dynalite, dynamodb_session, "outlasted") as s:
        ledger = Ledger()
        assert dynalite.server is not None
        holder = Holder("sync", dynalite.server, s.table)
        stop = threading.Event()
        try:
            handle = holder.acquire(OUTLASTED_TTL)
            assert handle is not None
            hold = ledger.opened("holder", handle)
            watcher = watch(ledger, hold, handle, stop)
            with Contender(ledger, s.contender):
                stored = slot_item(s.inspector, s.table)
                assert stored is not None
                assert stored[0] == handle.token
                dynalite.kill()
                assert dynalite.down()
                lost = handle.wait_lost(WAIT)  # the server stays down meanwhile
                watcher.join(WAIT)
                restarted = time.monotonic()
                dynalite.start()
                back = slot_item(s.inspector, s.table)
                wait_for("the contender's grant after the restart", lambda: len(ledger.holds) > 1)
                hold.called_release = time.monotonic()
                released = holder.release(handle)
            after = fence_after(s.inspector, s.table)
        finally:
            stop.set()
            holder.close()
        print(
            f"[dynamodb-store restart {dynalite.server.label} outlasted sync] seed={SEED} "
            f"starts={dynalite.starts} lost={lost} released={released} "
            f"grants={len(ledger.holds)} contender_errors={dict(ledger.errors)} "
            f"fences={[h.fence for h in ledger.holds]} ahead={s.ahead} after={after}"
        )
        assert lost, "the holder was not told its lease is lost"
        assert back is not None
        assert back[0] == handle.token, "the lease's item lost its token"
        assert back[1] >= stored[1], "the lease's item went back in time"
        assert released is False
        assert handle.lost
        judge(ledger, s, restarted, after)

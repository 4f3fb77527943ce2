"""Random operation sequences against the model and the real classes side by side.

Every observable result (granted or not, slot, token, expiry, fence, release
and extend answers, what storage holds) must match the model after every step.
Keys come as plain strings or as ``(str, Enum)`` members of the same value,
which name the same lock on every backend. Some acquires renew their lease
(``auto_renew=True``): on a ManualClock the machine then moves time in steps
of a quarter of the shortest renewed TTL, and the invariants check that a
renewed lease stays active for as long as time runs, and that one whose
record was removed by someone else is reported lost within one renewal
interval, a third of its TTL.
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from dmutex._core.lease import EPOCH
from tests._support.backends import Backend, Memory, Mongomock, Postgres, RealRedis, Rig, SQLite
from tests._support.dynamodb_backend import Dynamo
from tests._support.dynamodb_servers import Session as DynamoSession
from tests._support.etcd_backend import Etcd
from tests._support.etcd_servers import Session as EtcdSession
from tests._support.faces import FaceName, Handle, Kind
from tests._support.mysql_backend import MySQL
from tests._support.mysql_servers import Session as MySQLSession
from tests._support.postgres_servers import Session as PostgresSession
from tests._support.redis_servers import Pool, Server
from tests.model.model import Model

KEYS = ("a", "b")


class Key(str, enum.Enum):
    """Keys as applications often spell them: each member names the lock of its value."""

    A = "a"
    B = "b"


# What the machine passes as a key: a plain str, or a str subclass of the same value.
SPELLINGS: tuple[str, ...] = (*KEYS, Key.A, Key.B)
CALLERS = 3
# 100 by default (DMUTEX_MODEL_EXAMPLES asks for more or fewer): each run
# draws new examples, and the whole suite must stay under 25 minutes on a
# 2-core machine (at 200 the machines took 570 of its 1,760 s). CI's runs on
# the other Python versions ask for 50: what the machine checks is the
# stores' decisions, which run the full count once, on 3.11.
EXAMPLES = int(os.environ.get("DMUTEX_MODEL_EXAMPLES", "100"))
if EXAMPLES < 1:
    raise ValueError(f"DMUTEX_MODEL_EXAMPLES must be a positive count, not {EXAMPLES}")
# A quarter as many where the store's decisions are checked in full
# elsewhere: Redis servers other than the newest found (the scripts are the
# same on each; what a version could change, a reply's shape or a command's
# edge, shows in the first examples) and the MongoDB test server (the
# MongoDB store runs all of them on mongomock; the server shows the wire).
FEWER_EXAMPLES = max(1, EXAMPLES // 4)
SETTINGS = settings(max_examples=EXAMPLES, stateful_step_count=30, deadline=None)
# A lease length is drawn as an index into the backend's own lengths, so that
# the rules can be declared once for every backend.
TTL_PICKS = st.integers(0, 3)
# Renewed leases use the backend's two longest lengths: renewal runs when the
# clock moves, so a lease must outlast the machine's time steps.
RENEWED_PICKS = (2, 3)


class Boom(Exception):
    """Raised by run() callbacks."""


class LeaseMachine(RuleBasedStateMachine):
    """Random operations on one backend, face, kind and permit count, checked against the model.

    A subclass per configuration (see :func:`machine_for`) sets the class
    attributes; ``created`` counts the examples Hypothesis ran.
    """

    make_backend: ClassVar[Callable[[], Backend]]
    face: ClassVar[FaceName]
    kind: ClassVar[Kind]
    max_permits: ClassVar[int]
    created: ClassVar[int] = 0

    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        type(self).created += 1
        self.rig = Rig(type(self).make_backend(), self.face)
        self.backend = self.rig.backend
        self.ttls = self.backend.ttls
        self.callers = [
            self.rig.make(self.kind, max_permits=self.max_permits, fencing=True)
            for _ in range(CALLERS)
        ]
        self.model = Model(self.callers[0].max_permits)
        self.prefix = f"_d{self.kind}_svc:"
        clock = self.rig.clock
        self.start_ms = None if clock is None else round(clock.time() * 1000)
        self.tokens: set[str] = set()
        # Renewed handles still renewing: token -> (handle, TTL in ms).
        self.renewed: dict[str, tuple[Handle, int]] = {}
        # Renewed handles whose record someone else removed: token -> (handle,
        # the model time by which the handle must say it is lost).
        self.doomed: dict[str, tuple[Handle, int]] = {}
        # Handles released by their own release(), which answered True.
        self.released: set[str] = set()

    def ttl(self, pick: int) -> float:
        """The lease length ``pick`` stands for, from this backend's lengths."""
        return self.ttls[pick % len(self.ttls)]

    def teardown(self) -> None:
        # The renewed holds still open end here, before the rig closes: on a rig in real
        # time their renewals would go on against closed clients (and, on DynamoDB, dropped
        # tables) until their deadlines, up to 90 s, keeping the process's renewer thread
        # alive through later tests (CI run K: test_renewal's check that it ends failed).
        for handle, _ in [*self.renewed.values(), *self.doomed.values()]:
            with contextlib.suppress(Exception):
                handle.release()
        self.rig.close()

    def check_expiry(self, handle: Handle, expires: int) -> None:
        if self.start_ms is not None:
            assert handle.expired_at == EPOCH + timedelta(milliseconds=self.start_ms + expires)

    def renewed_pick(self, handle: Handle, pick: int) -> int:
        return RENEWED_PICKS[pick % 2] if handle.token in self.renewed else pick

    def doom(self, token: str | None) -> None:
        """The renewed lease ``token`` lost its record: it must be reported lost in one interval."""
        if token is not None and token in self.renewed:
            handle, ttl_ms = self.renewed.pop(token)
            self.doomed[token] = (handle, self.model.now + math.ceil(ttl_ms / 3))

    @rule(
        target=handles,
        caller=st.integers(0, CALLERS - 1),
        spelled=st.sampled_from(SPELLINGS),
        pick=TTL_PICKS,
        renew=st.booleans(),
    )
    def acquire(self, caller: int, spelled: str, pick: int, renew: bool) -> Any:
        if renew:
            pick = RENEWED_PICKS[pick % 2]
        ttl = self.ttl(pick)
        key = str.__str__(spelled)  # the lock a str subclass names: its value's
        full = self.model.is_full(key)
        handle = self.callers[caller].acquire(spelled, ttl, auto_renew=renew)
        if full:
            assert handle is None, "granted a permit beyond max_permits"
            return multiple()
        assert handle is not None, "refused although a permit was free"
        assert type(handle.key) is str
        assert handle.key == key
        assert handle.token not in self.tokens, "token reused"
        self.tokens.add(handle.token)
        ttl_ms = round(ttl * 1000)
        expires = self.model.grant(key, handle.slot, handle.token, ttl_ms, renewed=renew)
        self.check_expiry(handle, expires)
        assert self.model.take_fence(key, handle.fence), "fences strictly increase per key"
        assert handle.auto_renew is renew
        if renew:
            self.renewed[handle.token] = (handle, ttl_ms)
        return handle

    @rule(handle=handles)
    def release(self, handle: Handle) -> None:
        released = self.model.release(handle.key, handle.token)
        assert handle.release() == released
        self.renewed.pop(handle.token, None)
        if released and handle.token not in self.released:
            self.released.add(handle.token)
            assert not handle.lost, "released, not lost"
        elif handle.token not in self.released:
            assert handle.lost, "a release that found the lease gone marks it lost"

    @rule(handle=handles, pick=TTL_PICKS)
    def extend(self, handle: Handle, pick: int) -> None:
        ttl = self.ttl(self.renewed_pick(handle, pick))
        expected = self.model.extend(handle.key, handle.token, round(ttl * 1000))
        assert handle.extend(ttl) == (expected is not None)
        if expected is not None:
            self.check_expiry(handle, expected)
            if handle.token in self.renewed:
                self.renewed[handle.token] = (handle, round(ttl * 1000))
        elif handle.token not in self.released:
            assert handle.lost, "a refused extend marks the handle lost"

    @rule(caller=st.integers(0, CALLERS - 1), handle=handles, wrong_key=st.booleans())
    def release_by_token(self, caller: int, handle: Handle, wrong_key: bool) -> None:
        key = KEYS[1 - KEYS.index(handle.key)] if wrong_key else handle.key
        expected = self.model.release(key, handle.token)
        assert self.callers[caller].release_token(key, handle.token) == expected
        if expected:
            self.doom(handle.token)

    @rule(caller=st.integers(0, CALLERS - 1), handle=handles, pick=TTL_PICKS)
    def extend_by_token(self, caller: int, handle: Handle, pick: int) -> None:
        ttl = self.ttl(pick)
        if handle.token in self.renewed:
            # Not through the handle, so its renewal keeps its own length and pace:
            # extend by that length, or the record could run out between renewals.
            ttl = self.renewed[handle.token][1] / 1000
        expected = self.model.extend(handle.key, handle.token, round(ttl * 1000))
        assert self.callers[caller].extend(handle.key, handle.token, ttl) == (expected is not None)

    @rule(caller=st.integers(0, CALLERS - 1), key=st.sampled_from(KEYS))
    def foreign_token(self, caller: int, key: str) -> None:
        stranger = str(uuid.uuid4())
        assert self.callers[caller].release_token(key, stranger) is False
        assert self.callers[caller].extend(key, stranger, self.ttls[-1]) is False

    @precondition(lambda self: self.rig.clock is not None)
    @rule(ms=st.integers(0, 40_000))
    def advance(self, ms: int) -> None:
        """Move time; with renewed leases, in steps of a quarter of the shortest one's TTL."""
        clock = self.rig.clock
        assert clock is not None
        while ms > 0:
            live = [ttl_ms for _, ttl_ms in self.renewed.values()]
            step = min([ms, *(ttl_ms // 4 for ttl_ms in live)])
            clock.advance(step / 1000)
            self.rig.settle(self.callers[0])
            self.model.advance(step)
            ms -= step

    @rule(handle=handles)
    def force_expire(self, handle: Handle) -> None:
        """The handle's lease, if it still holds its slot, expires now.

        Only its own: which other lease holds that slot by now depends on
        the slots the store chose, at random on PostgreSQL and MySQL, and
        what the machine draws next must not depend on that (else Hypothesis
        replays an example into other rules: ``FlakyStrategyDefinition``).
        """
        held = self.model.active(handle.key).get(handle.slot)
        if held is None or held.token != handle.token:
            return
        self.rig.expire(handle.key, handle.slot)
        self.doom(self.model.expire(handle.key, handle.slot))

    @rule(
        caller=st.integers(0, CALLERS - 1),
        spelled=st.sampled_from(SPELLINGS),
        pick=TTL_PICKS,
        raises=st.booleans(),
    )
    def run(self, caller: int, spelled: str, pick: int, raises: bool) -> None:
        ttl = self.ttl(pick)
        key = str.__str__(spelled)
        full = self.model.is_full(key)
        seen: list[str] = []

        def callback(handle: Handle) -> str:
            # While the callback runs, storage holds its permit in a free slot.
            stored = self.backend.active(self.prefix)
            assert stored.get(f"{self.prefix}permit:{handle.slot}:{key}") == handle.token
            assert handle.slot not in self.model.active(key)
            assert self.model.take_fence(key, handle.fence)
            seen.append(handle.token)
            if raises:
                raise Boom
            return handle.token

        if full:
            assert self.callers[caller].run(spelled, callback, ttl) is None
        elif raises:
            with pytest.raises(Boom):
                self.callers[caller].run(spelled, callback, ttl)
        else:
            assert self.callers[caller].run(spelled, callback, ttl) == seen[0]
        assert len(seen) == (0 if full else 1)
        self.tokens.update(seen)

    @invariant()
    def storage_matches_the_model(self) -> None:
        stored = self.backend.active(self.prefix)
        assert stored == self.model.storage(self.prefix)

    @invariant()
    def renewed_leases_are_not_lost_and_removed_ones_are_found_lost_in_one_interval(
        self,
    ) -> None:
        for handle, _ in self.renewed.values():
            assert not handle.lost, "a renewed lease nobody removed was reported lost"
        for handle, due in self.doomed.values():
            if self.model.now >= due:
                assert handle.lost, "a removed renewed lease was not found lost in one interval"
                assert handle.release() is False
                assert handle.extend() is False

    @invariant()
    def never_more_than_max_permits_nor_a_shared_token(self) -> None:
        stored = self.backend.active(self.prefix)
        for key in KEYS:
            tokens = [t for name, t in stored.items() if name.endswith(f":{key}")]
            assert len(tokens) <= self.model.max_permits
            assert len(set(tokens)) == len(tokens)


def machine_for(
    make_backend: Callable[[], Backend], face: FaceName, kind: Kind, max_permits: int
) -> type[LeaseMachine]:
    """The :class:`LeaseMachine` subclass for one backend, face, kind and permit count."""
    name = f"LeaseMachine_{face}_{kind}_{max_permits}"
    attributes = {
        "make_backend": staticmethod(make_backend),
        "face": face,
        "kind": kind,
        "max_permits": max_permits,
        "created": 0,
    }
    return type(name, (LeaseMachine,), attributes)


def check_machine(
    make_backend: Callable[[], Backend],
    face: FaceName,
    kind: Kind,
    max_permits: int,
    examples: int = EXAMPLES,
) -> None:
    """Run the :class:`LeaseMachine` on ``make_backend``'s backends (Hypothesis, SETTINGS).

    Fails on the first rule or invariant broken, and unless at least
    ``examples`` examples ran (half as many on the asyncio face: see
    :func:`for_face`).
    """
    examples = for_face(face, examples)
    machine = machine_for(make_backend, face, kind, max_permits)
    run_state_machine_as_test(machine, settings=settings(SETTINGS, max_examples=examples))
    assert machine.created >= examples


def for_face(face: FaceName, examples: int) -> int:
    """``examples`` on the sync face, half as many on the asyncio face.

    Both faces drive one engine over one store, so what the machine checks,
    the stores' decisions against the model, is the same; what is the
    asyncio face's own, its driver on each client, the contract suite runs
    on every backend and client. An asyncio example costs about twice a sync
    one (a loop thread between the test and the client), and the whole suite
    must stay under 25 minutes on 2 cores.
    """
    return examples if face == "sync" else max(1, examples // 2)


CONFIGS = [
    (face, kind, permits)
    for face in ("sync", "async")
    for kind, permits in (("mutex", 1), ("semaphore", 1), ("semaphore", 3))
]


@pytest.mark.parametrize(("face", "kind", "max_permits"), CONFIGS)
def test_in_memory_backend(face: FaceName, kind: Kind, max_permits: int) -> None:
    check_machine(Memory, face, kind, max_permits)


@pytest.mark.parametrize(("face", "kind", "max_permits"), CONFIGS)
def test_redis(
    redis_pool: Pool,
    redis_server: Server,
    redis_url: str,
    face: FaceName,
    kind: Kind,
    max_permits: int,
) -> None:
    """The same machine against a real Redis server (each version found), via redis-py.

    All EXAMPLES on the newest version found, FEWER_EXAMPLES on the others.
    """
    newest = redis_server.label == redis_pool.labels[-1]
    examples = EXAMPLES if newest else FEWER_EXAMPLES
    check_machine(lambda: RealRedis(redis_url), face, kind, max_permits, examples)


@pytest.mark.parametrize(("face", "kind", "max_permits"), CONFIGS)
def test_mongomock(face: FaceName, kind: Kind, max_permits: int) -> None:
    """The same machine on the MongoDB store, over mongomock (not a server)."""
    check_machine(Mongomock, face, kind, max_permits)


@pytest.mark.parametrize(("face", "kind", "max_permits"), CONFIGS)
def test_sqlite(face: FaceName, kind: Kind, max_permits: int) -> None:
    """The same machine on the SQLite store, over a temporary file."""
    check_machine(SQLite, face, kind, max_permits)


@pytest.mark.parametrize(("face", "kind", "max_permits"), CONFIGS)
def test_postgresql(
    postgres_session: PostgresSession, face: FaceName, kind: Kind, max_permits: int
) -> None:
    """The same machine against a real PostgreSQL server: psycopg (sync), asyncpg (asyncio).

    Half the examples, as on MySQL: each costs the server a table's rows and
    the session its connections, the store's decisions are checked again by
    the contract suite on every client package, and CI's whole run must stay
    under 25 minutes.
    """
    variant = "psycopg" if face == "sync" else "asyncpg"
    examples = max(1, EXAMPLES // 2)
    check_machine(lambda: Postgres(postgres_session, variant), face, kind, max_permits, examples)


@pytest.mark.parametrize(("face", "kind", "max_permits"), CONFIGS)
def test_mysql(mysql_session: MySQLSession, face: FaceName, kind: Kind, max_permits: int) -> None:
    """The same machine against a real MySQL server: PyMySQL (sync), asyncmy (asyncio).

    Half the examples: each costs the server a table's rows and the session
    two connections, and the store's decisions are checked again by the
    contract suite on 13 client variants; CI's whole run must stay under 25
    minutes.
    """
    variant = "pymysql" if face == "sync" else "asyncmy"
    examples = max(1, EXAMPLES // 2)
    check_machine(lambda: MySQL(mysql_session, variant), face, kind, max_permits, examples)


@pytest.mark.parametrize(("face", "kind", "max_permits"), CONFIGS)
def test_etcd(etcd_session: EtcdSession, face: FaceName, kind: Kind, max_permits: int) -> None:
    """The same machine against a real etcd member: etcd3gw (sync), aetcd (asyncio).

    A quarter of the examples: each costs the member a lease per grant and
    its revoke (about 60 s for the six configurations at half), the contract
    suite checks the store's decisions again on both clients, and CI's whole
    run must stay under 25 minutes.
    """
    check_machine(lambda: Etcd(etcd_session), face, kind, max_permits, FEWER_EXAMPLES)


@pytest.mark.parametrize(("face", "kind", "max_permits"), [c for c in CONFIGS if c[0] == "sync"])
def test_dynamodb(
    dynamodb_session: DynamoSession, face: FaceName, kind: Kind, max_permits: int
) -> None:
    """The same machine against dynalite, which speaks DynamoDB's protocol: boto3, aiobotocore.

    dynalite, not moto's server: the quicker of the two (a cycle takes about
    half moto's time here); the contract suite runs on both. The sync face
    only: the machine checks the store's decisions, which both faces share,
    and the contract suite runs aiobotocore on both servers. An eighth of
    the examples: each makes and drops its tables (the six configurations
    took 39 s at a quarter, beside a CI run), the store's decisions are
    checked again by the contract suite on both clients and servers, and
    CI's whole run must stay under 25 minutes.
    """
    server = dynamodb_session.server("dynalite")
    prefix = dynamodb_session.prefix
    check_machine(
        lambda: Dynamo(server, prefix), face, kind, max_permits, max(1, FEWER_EXAMPLES // 2)
    )

"""Random operation sequences on read-write locks, against the model (``rw_model.py``).

Every observable result (granted or not, expiry, fence, release and extend
answers, what the store holds) must match the model after every step, on
each backend and face. Readers and writers, renewed or not, a bound on
readers or none; writers that leave an intent and die (a retrying writer's
refused attempt with no attempt after it), which must keep new readers out
until the intent lapses; time moved on a ManualClock, holds forced to expire.
"""

from __future__ import annotations

import contextlib
import math
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

from dmutex import InMemoryBackend
from dmutex._core.lease import EPOCH
from tests._support.backends import Backend, Memory, Mongomock, Postgres, RealRedis, Rig, SQLite
from tests._support.dynamodb_backend import Dynamo
from tests._support.dynamodb_servers import Session as DynamoSession
from tests._support.etcd_backend import Etcd
from tests._support.etcd_servers import Session as EtcdSession
from tests._support.faces import FaceName, Handle
from tests._support.mysql_backend import MySQL
from tests._support.mysql_servers import Session as MySQLSession
from tests._support.postgres_servers import Session as PostgresSession
from tests._support.redis_servers import Pool, Server
from tests._support.rwfaces import RWFace, Side
from tests.model.rw_model import READ, WRITE, RWModel
from tests.model.test_state_machine import (
    CALLERS,
    EXAMPLES,
    FEWER_EXAMPLES,
    KEYS,
    RENEWED_PICKS,
    SETTINGS,
    SPELLINGS,
    TTL_PICKS,
    Boom,
    for_face,
)

SIDES: tuple[Side, ...] = ("read", "write")
SLOT = {"read": READ, "write": WRITE}
RETRY_DELAY = 0.1  # the dead writers' retry_delay: their intents last this + 2 s


def expire_hold(backend: Backend, key: str, token: str) -> None:
    """Make ``token``'s hold of ``key`` expire now, as the backend's storage allows."""
    if isinstance(backend, (SQLite, Mongomock, RealRedis, Postgres, MySQL, Etcd, Dynamo)):
        backend.expire_hold(key, token)
        return
    client = backend.client(False)
    if isinstance(client, InMemoryBackend):
        client.force_expire(key, token=token)
        return
    raise NotImplementedError(f"no way to expire a hold on {type(backend).__name__} yet")


class ReadWriteMachine(RuleBasedStateMachine):
    """Random operations on one backend and face, with or without a bound on readers."""

    make_backend: ClassVar[Callable[[], Backend]]
    face: ClassVar[FaceName]
    max_readers: ClassVar[int | None]
    created: ClassVar[int] = 0

    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        type(self).created += 1
        self.rig = Rig(type(self).make_backend(), self.face)
        self.backend = self.rig.backend
        self.ttls = self.backend.ttls
        options: dict[str, Any] = {"max_readers": self.max_readers, "fencing": True}
        if self.rig.clock is not None:
            options["clock"] = self.rig.clock
        if isinstance(self.backend, Etcd):
            options["key_prefix"] = self.backend.key_prefix("rwlock", options)
        if isinstance(self.backend, Dynamo):
            self.backend.table_options("rwlock", options)
        self.callers = [
            RWFace(self.face, self.rig.client, loop=self.rig.loop, **options)
            for _ in range(CALLERS)
        ]
        self.model = RWModel(self.max_readers)
        clock = self.rig.clock
        self.start_ms = None if clock is None else round(clock.time() * 1000)
        self.tokens: set[str] = set()
        self.side: dict[str, Side] = {}  # token -> the side it holds
        self.renewed: dict[str, tuple[Handle, int]] = {}
        self.doomed: dict[str, tuple[Handle, int]] = {}
        self.released: set[str] = set()

    def ttl(self, pick: int) -> float:
        return self.ttls[pick % len(self.ttls)]

    def teardown(self) -> None:
        # The renewed holds still open end here, before the rig closes: on a rig in real
        # time their renewals would go on against closed clients (and, on DynamoDB, dropped
        # tables) until their deadlines, up to 90 s, keeping the process's renewer thread
        # alive through later tests (CI run K: test_renewal's check that it ends failed).
        for handle, _ in self.renewed.values():
            with contextlib.suppress(Exception):
                handle.release()
        self.rig.close()

    def check_expiry(self, handle: Handle, expires: int) -> None:
        if self.start_ms is not None:
            assert handle.expired_at == EPOCH + timedelta(milliseconds=self.start_ms + expires)

    def doom(self, token: str) -> None:
        """The renewed hold ``token`` ended by another hand: found lost within one interval."""
        if token in self.renewed:
            handle, ttl_ms = self.renewed.pop(token)
            self.doomed[token] = (handle, self.model.now + math.ceil(ttl_ms / 3))

    def granted(self, side: Side, key: str) -> bool:
        return self.model.may_read(key) if side == "read" else self.model.may_write(key)

    def record(self, handle: Handle, side: Side, key: str, ttl: float, renew: bool) -> None:
        """Check a new hold against the model, and keep it there."""
        assert handle.key == key
        assert type(handle.key) is str
        assert handle.token not in self.tokens, "token reused"
        self.tokens.add(handle.token)
        self.side[handle.token] = side
        ttl_ms = round(ttl * 1000)
        expires = self.model.grant(key, handle.token, SLOT[side], ttl_ms, renewed=renew)
        self.check_expiry(handle, expires)
        assert self.model.take_fence(key, handle.fence), "fences strictly increase per key"
        if renew:
            self.renewed[handle.token] = (handle, ttl_ms)

    @rule(
        target=handles,
        caller=st.integers(0, CALLERS - 1),
        side=st.sampled_from(SIDES),
        spelled=st.sampled_from(SPELLINGS),
        pick=TTL_PICKS,
        renew=st.booleans(),
    )
    def acquire(self, caller: int, side: Side, spelled: str, pick: int, renew: bool) -> Any:
        if renew:
            pick = RENEWED_PICKS[pick % 2]
        ttl = self.ttl(pick)
        key = str.__str__(spelled)
        expected = self.granted(side, key)
        handle = self.callers[caller].acquire(side, spelled, ttl, auto_renew=renew)
        if not expected:
            assert handle is None, f"a {side} hold granted against the rules"
            return multiple()
        assert handle is not None, f"a {side} hold refused although the rules allow it"
        self.record(handle, side, key, ttl, renew)
        return handle

    @precondition(lambda self: self.rig.clock is not None)
    @rule(caller=st.integers(0, CALLERS - 1), key=st.sampled_from(KEYS), pick=TTL_PICKS)
    def writer_intends_and_dies(self, caller: int, key: str, pick: int) -> None:
        """A retrying writer's refused attempt and nothing after: its intent stands, then lapses."""
        if self.model.may_write(key):
            return  # the attempt would be granted: not this rule's case
        granted, token, window_ms = self.callers[caller].intend(key, self.ttl(pick), RETRY_DELAY)
        assert not granted, "a writer granted while others hold the key"
        self.model.intend(key, token, self.model.now + window_ms)

    @rule(handle=handles)
    def release(self, handle: Handle) -> None:
        released = self.model.release(handle.key, handle.token)
        assert handle.release() == released
        self.renewed.pop(handle.token, None)
        if released and handle.token not in self.released:
            self.released.add(handle.token)
            assert not handle.lost, "released, not lost"
        elif handle.token not in self.released:
            assert handle.lost, "a release that found the hold gone marks it lost"

    @rule(handle=handles, pick=TTL_PICKS)
    def extend(self, handle: Handle, pick: int) -> None:
        if handle.token in self.renewed:
            pick = RENEWED_PICKS[pick % 2]
        ttl = self.ttl(pick)
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
        """Move time; with renewed holds, in steps of a quarter of the shortest one's TTL."""
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
        """The handle's hold, if still active, expires now (renewal then finds it gone)."""
        if handle.token not in self.model.active(handle.key):
            return
        expire_hold(self.backend, handle.key, handle.token)
        if self.model.expire(handle.key, handle.token):
            self.doom(handle.token)

    @rule(
        caller=st.integers(0, CALLERS - 1),
        side=st.sampled_from(SIDES),
        spelled=st.sampled_from(SPELLINGS),
        pick=TTL_PICKS,
        raises=st.booleans(),
    )
    def run(self, caller: int, side: Side, spelled: str, pick: int, raises: bool) -> None:
        ttl = self.ttl(pick)
        key = str.__str__(spelled)
        expected = self.granted(side, key)
        seen: list[str] = []

        def callback(handle: Handle) -> str:
            # While the callback runs, the store holds it beside what the model has.
            held = self.callers[caller].holders(key)
            assert (SLOT[side], handle.token) in {(h.slot, h.token) for h in held.holders}
            assert self.model.take_fence(key, handle.fence)
            seen.append(handle.token)
            if raises:
                raise Boom
            return handle.token

        face = self.callers[caller]
        if not expected:
            assert face.run(side, spelled, callback, ttl) is None
        elif raises:
            with pytest.raises(Boom):
                face.run(side, spelled, callback, ttl)
        else:
            assert face.run(side, spelled, callback, ttl) == seen[0]
        assert len(seen) == (1 if expected else 0)
        self.tokens.update(seen)

    @invariant()
    def the_store_holds_what_the_model_holds(self) -> None:
        for key in KEYS:
            found = self.callers[0].holders(key)
            assert sorted((h.slot, h.token) for h in found.holders) == self.model.storage(key)

    @invariant()
    def one_writer_or_readers_never_both(self) -> None:
        for key in KEYS:
            sides = [side for side, _ in self.model.storage(key)]
            assert sides.count(WRITE) <= 1
            assert not (WRITE in sides and READ in sides)
            if self.max_readers is not None:
                assert sides.count(READ) <= self.max_readers

    @invariant()
    def renewed_holds_are_not_lost_and_removed_ones_are_found_lost_in_one_interval(
        self,
    ) -> None:
        for handle, _ in self.renewed.values():
            assert not handle.lost, "a renewed hold nobody removed was reported lost"
        for handle, due in self.doomed.values():
            if self.model.now >= due:
                assert handle.lost, "a removed renewed hold was not found lost in one interval"
                assert handle.release() is False


def check_machine(
    make_backend: Callable[[], Backend],
    face: FaceName,
    max_readers: int | None,
    examples: int = EXAMPLES,
) -> None:
    """Run the :class:`ReadWriteMachine` on ``make_backend``'s backends; at least ``examples``.

    Half as many on the asyncio face, as for the lease machine (``for_face``).
    """
    examples = for_face(face, examples)
    name = f"ReadWriteMachine_{face}_{max_readers}"
    attributes = {
        "make_backend": staticmethod(make_backend),
        "face": face,
        "max_readers": max_readers,
        "created": 0,
    }
    machine: type[ReadWriteMachine] = type(name, (ReadWriteMachine,), attributes)
    run_state_machine_as_test(machine, settings=settings(SETTINGS, max_examples=examples))
    assert machine.created >= examples


CONFIGS = [(face, readers) for face in ("sync", "async") for readers in (None, 2)]


@pytest.mark.parametrize(("face", "max_readers"), CONFIGS)
def test_in_memory_backend(face: FaceName, max_readers: int | None) -> None:
    check_machine(Memory, face, max_readers)


@pytest.mark.parametrize(("face", "max_readers"), CONFIGS)
def test_sqlite(face: FaceName, max_readers: int | None) -> None:
    """The same machine on the SQLite store, over a temporary file.

    A quarter of the examples: the store decides with ``_core.readwrite``'s
    functions, which the in-memory machine runs in full; what is SQLite's
    own (its row, its transactions) shows in the first examples.
    """
    check_machine(SQLite, face, max_readers, FEWER_EXAMPLES)


@pytest.mark.parametrize(("face", "max_readers"), CONFIGS)
def test_mongomock(face: FaceName, max_readers: int | None) -> None:
    """The same machine on the MongoDB store, over mongomock (not a server).

    All examples: the store decides in its own update pipeline.
    """
    check_machine(Mongomock, face, max_readers)


@pytest.mark.parametrize(("face", "max_readers"), CONFIGS)
def test_redis(
    redis_pool: Pool, redis_server: Server, redis_url: str, face: FaceName, max_readers: int | None
) -> None:
    """The same machine against a real Redis server, via redis-py: its scripts decide.

    All examples on the newest version found, a quarter on the others.
    """
    newest = redis_server.label == redis_pool.labels[-1]
    examples = EXAMPLES if newest else FEWER_EXAMPLES
    check_machine(lambda: RealRedis(redis_url), face, max_readers, examples)


@pytest.mark.parametrize(("face", "max_readers"), CONFIGS)
def test_postgresql(
    postgres_session: PostgresSession, face: FaceName, max_readers: int | None
) -> None:
    """The same machine against a real PostgreSQL server: psycopg (sync), asyncpg (asyncio).

    A quarter of the examples, as on SQLite: the store decides with
    ``_core.readwrite``'s functions (the in-memory machine runs them in
    full); what is the server's own (its read, its compare-and-set, the
    fence in the row) shows in the first examples, and the contract suite
    runs on every client package.
    """
    variant = "psycopg" if face == "sync" else "asyncpg"
    check_machine(lambda: Postgres(postgres_session, variant), face, max_readers, FEWER_EXAMPLES)


@pytest.mark.parametrize(("face", "max_readers"), CONFIGS)
def test_mysql(mysql_session: MySQLSession, face: FaceName, max_readers: int | None) -> None:
    """The same machine against a real MySQL server: PyMySQL (sync), asyncmy (asyncio).

    A quarter of the examples, for PostgreSQL's reasons.
    """
    variant = "pymysql" if face == "sync" else "asyncmy"
    check_machine(lambda: MySQL(mysql_session, variant), face, max_readers, FEWER_EXAMPLES)


@pytest.mark.parametrize(("face", "max_readers"), CONFIGS)
def test_etcd(etcd_session: EtcdSession, face: FaceName, max_readers: int | None) -> None:
    """The same machine against a real etcd member: etcd3gw (sync), aetcd (asyncio).

    A quarter of the examples, for PostgreSQL's reasons: each hold is a lease
    granted and revoked on the member, and the contract suite checks the
    store's decisions again on both clients.
    """
    check_machine(lambda: Etcd(etcd_session), face, max_readers, FEWER_EXAMPLES)


@pytest.mark.parametrize(("face", "max_readers"), [c for c in CONFIGS if c[0] == "sync"])
def test_dynamodb(dynamodb_session: DynamoSession, face: FaceName, max_readers: int | None) -> None:
    """The same machine against dynalite, which speaks DynamoDB's protocol: boto3, aiobotocore.

    The sync face, and an eighth of the examples, for the lease machine's reasons: the
    store's decisions are the SQL stores' compare-and-set (``rwcas.py``),
    and the contract suite checks them again on both clients and servers.
    """
    server = dynamodb_session.server("dynalite")
    prefix = dynamodb_session.prefix
    check_machine(lambda: Dynamo(server, prefix), face, max_readers, max(1, FEWER_EXAMPLES // 2))

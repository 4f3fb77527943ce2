"""Read-write locks on real Redis servers (``RedisReadWriteStore``), both faces.

One hash per lock, ``_drwlock_svc:rwlock:<key>``, pinned down byte for byte;
the rules of ``dmutex._core.readwrite`` as the scripts apply them (readers
share, a writer excludes, a waiting writer's intent keeps new readers out
until it lapses or is withdrawn, re-sent grants, release and extend by
token, fences); a record dmutex did not write, refused and left as it was;
one request per operation, counted by the client and by the server
(``INFO commandstats``); waiters woken by what may let them in, shown by
what they sent (``BLPOP`` answered with a signal) and never by timing; a
Redis Cluster; ``replicas=1``. The newest server found runs every test.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar, cast

import pytest
import redis
import redis.asyncio
import redis.cluster
import valkey
import valkey.asyncio

from dmutex import DMutexError, NotReplicatedError, RedisArg, RedisReply
from dmutex._backends.redis.cluster import hash_slot
from dmutex._backends.redis.scripts import (
    RW_ACQUIRE,
    RW_EXTEND,
    RW_INSPECT,
    RW_RELEASE,
    RW_RENEW,
)
from dmutex._core.lease import Lease, new_token
from tests._support import fault_servers
from tests._support.face_rigs import FaceRig
from tests._support.faces import FaceName, Handle
from tests._support.redis_clients import SetEvalRedis
from tests._support.redis_cluster import ClusterRecorded, LocalCluster, slot_ranges
from tests._support.redis_replicated import Replicated
from tests._support.redis_servers import Executable, Pool, executables, newest
from tests._support.rwfaces import RWFace, Side
from tests._support.sampling import Background
from tests._support.sampling import until as poll_until

T = TypeVar("T")

SERVICE = "svc"
PREFIX = f"_drwlock_{SERVICE}:"
MARK = "dmutex:rwlock"
WAITER = "dmutex-rw-waiter"  # the client name of a waiter's connections
SCRIPTS = {
    RW_ACQUIRE.sha: "acquire",
    RW_RELEASE.sha: "release",
    RW_EXTEND.sha: "extend",
    RW_RENEW.sha: "renew",
    RW_INSPECT.sha: "inspect",
}

LONG = 60.0  # the TTL of a hold that the test releases itself
PATIENT = 30.0  # a retry_delay longer than any test: a wait that ends was woken
SETTLE = 10.0  # the bound of every wait for the server or a thread to get somewhere
FACES: list[FaceName] = ["sync", "async"]

until = partial(poll_until, timeout=SETTLE)


def rwlock(key: str) -> str:
    """The hash of lock ``key``."""
    return f"{PREFIX}rwlock:{key}"


def held(handle: Handle | None) -> Handle:
    assert handle is not None, "expected the hold to be granted"
    return handle


def server_ms(server: redis.Redis) -> int:
    seconds, micros = server.time()
    return int(seconds) * 1000 + int(micros) // 1000


def expire_ms(server: redis.Redis, name: str) -> int:
    """The epoch ms at which ``name`` expires (PEXPIRETIME, Redis 7.0+)."""
    return int(server.pexpiretime(name))


def evalsha_calls(server: redis.Redis) -> int:
    """``INFO commandstats`` EVALSHA calls: the requests that ran a cached script."""
    stats: dict[str, Any] = server.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def blocked(server: redis.Redis, name: str = WAITER) -> int:
    """How many connections named ``name`` the server reports blocked (flag ``b``)."""
    clients: list[dict[str, Any]] = server.client_list()
    return sum(1 for c in clients if c.get("name") == name and "b" in str(c.get("flags", "")))


# --- recording clients -------------------------------------------------------------------


@dataclass
class Sent:
    """One command a client sent, and its reply once answered."""

    args: tuple[RedisArg, ...]
    reply: object = None

    @property
    def kind(self) -> str:
        """A read-write script's name (``"acquire"``...), or the command's."""
        name = str(self.args[0]).upper()
        if name == "EVALSHA":
            return SCRIPTS.get(str(self.args[1]), name)
        return name


class Recorded:
    """A redis-py client whose commands are recorded; it has no ``pipeline``: plain BLPOPs."""

    def __init__(self, inner: redis.Redis) -> None:
        # redis-py leaves execute_command unannotated; this is its sync signature.
        self._send: Callable[..., RedisReply] = inner.execute_command
        self.sent: list[Sent] = []

    def execute_command(self, *args: RedisArg) -> RedisReply:
        record = Sent(args)
        self.sent.append(record)
        record.reply = self._send(*args)
        return record.reply

    def kinds(self) -> list[str]:
        return [s.kind for s in self.sent]


class AsyncRecorded:
    """The asyncio twin of :class:`Recorded`."""

    def __init__(self, inner: redis.asyncio.Redis) -> None:
        self._send: Callable[..., Awaitable[RedisReply]] = inner.execute_command
        self.sent: list[Sent] = []

    async def execute_command(self, *args: RedisArg) -> RedisReply:
        record = Sent(args)
        self.sent.append(record)
        record.reply = await self._send(*args)
        return record.reply

    def kinds(self) -> list[str]:
        return [s.kind for s in self.sent]


# --- fixtures ----------------------------------------------------------------------------


@pytest.fixture
def url(redis_pool: Pool) -> str:
    """The newest server's URL, its database emptied and the scripts cached (one EVALSHA each)."""
    found = newest(redis_pool).url
    with redis.Redis.from_url(found) as client:
        client.flushdb()
        for script in (RW_ACQUIRE, RW_RELEASE, RW_EXTEND, RW_RENEW, RW_INSPECT):
            assert client.script_load(script.text) == script.sha
    return found


@pytest.fixture
def server(url: str) -> Iterator[redis.Redis]:
    """The test's own view of the server: a client that reads strings."""
    with redis.Redis.from_url(url, decode_responses=True) as client:
        yield client


@pytest.fixture(params=FACES)
def rig(request: pytest.FixtureRequest) -> Iterator[FaceRig]:
    made = FaceRig(request.param)
    try:
        yield made
    finally:
        made.close()


def client_of(rig: FaceRig, url: str, **kwargs: Any) -> redis.Redis | redis.asyncio.Redis:
    """A client of the rig's face, closed with it."""
    if rig.face == "async":
        return rig.keep(redis.asyncio.Redis.from_url(url, **kwargs))
    return rig.keep(redis.Redis.from_url(url, **kwargs))


def recorded_of(rig: FaceRig, url: str, **kwargs: Any) -> Recorded | AsyncRecorded:
    """A recording client of the rig's face (no pipeline), closed with it."""
    inner = client_of(rig, url, **kwargs)
    if isinstance(inner, redis.asyncio.Redis):
        return AsyncRecorded(inner)
    return Recorded(inner)


def lock_of(rig: FaceRig, client: object, **options: Any) -> RWFace:
    return RWFace(rig.face, client, service_name=SERVICE, loop=rig.loop, **options)


def attempt(lock: RWFace, side: Side, key: str, token: str, ttl_ms: int) -> Lease | None:
    """One attempt of ``side`` with ``token``, straight to the store: a re-sent copy's view."""
    engine = lock.target._writing if side == "write" else lock.target._reading
    drive: Any = lock.target._drive
    lease: Lease | None = lock.wait(drive(engine._store.acquire(key, token, ttl_ms, None)))
    return lease


# --- the rules ---------------------------------------------------------------------------


def test_readers_share_and_a_writer_excludes(rig: FaceRig, url: str, server: redis.Redis) -> None:
    lock = lock_of(rig, client_of(rig, url))
    first, second = held(lock.acquire("read", "doc", LONG)), held(lock.acquire("read", "doc"))
    assert lock.acquire("write", "doc") is None, "a writer passed the readers"
    assert first.release() is True
    assert lock.acquire("write", "doc") is None, "one reader is still in"
    assert second.release() is True
    assert server.exists(rwlock("doc")) == 0, "nothing held: the hash is gone"
    writer = held(lock.acquire("write", "doc", LONG))
    assert lock.acquire("read", "doc") is None, "a reader passed the writer"
    assert lock.acquire("write", "doc") is None, "a second writer"
    holders = lock.holders("doc")
    assert [(h.slot, h.token) for h in holders.holders] == [(0, writer.token)]
    assert holders.fence == writer.fence
    assert writer.release() is True
    assert server.keys("*") == []


def test_max_readers_bounds_the_readers(rig: FaceRig, url: str) -> None:
    lock = lock_of(rig, client_of(rig, url), max_readers=2)
    first = held(lock.acquire("read", "doc"))
    held(lock.acquire("read", "doc"))
    assert lock.acquire("read", "doc") is None
    assert first.release() is True
    held(lock.acquire("read", "doc"))


def test_the_layout_byte_for_byte(rig: FaceRig, url: str, server: redis.Redis) -> None:
    """``kind``, ``r:``/``w:``/``i:<token>`` = expiry ms by the server's clock, ``fence``.

    The hash expires with its latest hold or intent (PEXPIRETIME), and
    nothing else is written while nobody waits.
    """
    lock, other = lock_of(rig, client_of(rig, url)), lock_of(rig, client_of(rig, url))
    name = rwlock("doc")
    before = server_ms(server)
    first = held(lock.acquire("read", "doc", 10))
    second = held(lock.acquire("read", "doc", 20))
    after = server_ms(server)
    stored = server.hgetall(name)
    assert set(stored) == {"kind", f"r:{first.token}", f"r:{second.token}", "fence"}
    assert stored["kind"] == MARK
    assert stored["fence"] == str(second.fence)
    for handle, ttl_ms in ((first, 10_000), (second, 20_000)):
        expires = int(stored[f"r:{handle.token}"])
        assert before + ttl_ms <= expires <= after + ttl_ms
        assert stored[f"r:{handle.token}"] == str(expires), "decimal, no exponent"
    assert server.type(name) == "hash"
    latest = int(stored[f"r:{second.token}"])
    assert expire_ms(server, name) == latest
    assert server.keys("*") == [name], "nothing else while nobody waits"

    # A dead writer's intent: until its attempt's time + retry_delay + 2 s.
    before = server_ms(server)
    granted, token, window_ms = other.intend("doc", ttl=LONG, retry_delay=PATIENT)
    after = server_ms(server)
    assert not granted
    assert window_ms == 32_000
    intent = int(server.hget(name, f"i:{token}") or 0)
    assert before + window_ms <= intent <= after + window_ms
    assert expire_ms(server, name) == intent, "the intent outlasts both"
    assert other.release_token("doc", token) is False, "an intent is no hold"
    assert server.hexists(name, f"i:{token}") is False
    assert expire_ms(server, name) == latest

    assert first.release() is True
    assert second.release() is True
    assert server.exists(name) == 0, "the last hold gone, the hash goes, its fence with it"
    writer = held(lock.acquire("write", "doc", 5))
    assert server.hgetall(name) == {
        "kind": MARK,
        f"w:{writer.token}": server.hget(name, f"w:{writer.token}"),
        "fence": str(writer.fence),
    }
    assert writer.fence is not None
    assert second.fence is not None
    assert writer.fence > second.fence, "TIME in µs keeps fences rising past the deletion"
    assert writer.release() is True

    unfenced = lock_of(rig, client_of(rig, url), fencing=False)
    reader = held(unfenced.acquire("read", "doc"))
    assert reader.fence is None
    assert set(server.hgetall(name)) == {"kind", f"r:{reader.token}"}
    assert unfenced.holders("doc").fence is None


def test_expired_fields_are_dropped_by_the_next_write(
    rig: FaceRig, url: str, server: redis.Redis
) -> None:
    lock = lock_of(rig, client_of(rig, url))
    brief = held(lock.acquire("read", "doc", 0.05))
    until(lambda: server_ms(server) > int(server.hget(rwlock("doc"), f"r:{brief.token}") or 0), "")
    assert lock.holders("doc").holders == [], "expired: no holder, though still stored"
    writer = held(lock.acquire("write", "doc", LONG))
    assert set(server.hgetall(rwlock("doc"))) == {"kind", f"w:{writer.token}", "fence"}


def test_a_writers_intent_keeps_new_readers_out_until_it_lapses(
    rig: FaceRig, url: str, server: redis.Redis
) -> None:
    """A retrying writer's refused attempt, the writer then dead: readers in stay, new ones wait.

    Its intent lasts retry_delay + 2 s by the server's clock, then lapses.
    """
    lock, other = lock_of(rig, client_of(rig, url)), lock_of(rig, client_of(rig, url))
    reader = held(lock.acquire("read", "doc", LONG))
    granted, token, _ = other.intend("doc", ttl=LONG, retry_delay=0.01)
    assert not granted
    lapses = int(server.hget(rwlock("doc"), f"i:{token}") or 0)
    assert lock.acquire("read", "doc") is None, "a new reader passed a waiting writer"
    assert reader.extend(LONG) is True, "a reader already in renews"
    until(lambda: server_ms(server) >= lapses, "the intent's time passes on the server")
    late = held(lock.acquire("read", "doc"))
    assert server.hexists(rwlock("doc"), f"i:{token}") is False, "dropped by that grant"
    assert late.release() is True
    assert reader.release() is True


def test_a_withdrawn_intent_lets_readers_in(rig: FaceRig, url: str, server: redis.Redis) -> None:
    """By release of the writer's token, or by its last attempt (``readwrite`` rule 2)."""
    lock, other = lock_of(rig, client_of(rig, url)), lock_of(rig, client_of(rig, url))
    reader = held(lock.acquire("read", "doc", LONG))
    _, token, _ = other.intend("doc", ttl=LONG, retry_delay=PATIENT)
    assert lock.acquire("read", "doc") is None
    assert other.release_token("doc", token) is False
    held(lock.acquire("read", "doc"))
    assert other.acquire_with_retry("write", "doc", timeout=0.2, retry_delay=0.02) is None
    assert [f for f in server.hkeys(rwlock("doc")) if str(f).startswith("i:")] == []
    held(lock.acquire("read", "doc"))
    assert reader.release() is True


def test_a_resent_grant_finds_its_own_hold(rig: FaceRig, url: str, server: redis.Redis) -> None:
    """``readwrite`` rule 4: the same token again is granted again, a new fence, no second hold."""
    lock = lock_of(rig, client_of(rig, url))
    for side in ("read", "write"):
        key, token = f"doc-{side}", new_token()
        first = attempt(lock, side, key, token, 10_000)
        again = attempt(lock, side, key, token, 30_000)
        assert first is not None
        assert again is not None
        assert (again.token, again.slot) == (token, first.slot)
        assert first.fence is not None
        assert again.fence is not None
        assert again.fence > first.fence
        stored = server.hgetall(rwlock(key))
        assert len(stored) == 3, "one hold, the mark, the fence"
        assert int(stored[f"{side[0]}:{token}"]) >= int(server_ms(server)) + 20_000
        assert lock.release_token(key, token) is True


def test_release_and_extend_by_token(rig: FaceRig, url: str, server: redis.Redis) -> None:
    lock, other = lock_of(rig, client_of(rig, url)), lock_of(rig, client_of(rig, url))
    reader = held(lock.acquire("read", "doc", 5))
    name, field = rwlock("doc"), f"r:{reader.token}"
    before = int(server.hget(name, field) or 0)
    assert other.extend("doc", reader.token, 50) is True
    assert int(server.hget(name, field) or 0) >= before + 44_000
    assert expire_ms(server, name) == int(server.hget(name, field) or 0)
    stranger = str(uuid.uuid4())
    assert other.extend("doc", stranger, 50) is False
    assert other.release_token("doc", stranger) is False
    assert other.release_token("doc", reader.token) is True
    assert other.release_token("doc", reader.token) is False
    assert other.extend("doc", reader.token, 50) is False
    assert reader.release() is False
    writer = held(lock.acquire("write", "doc", 5))
    assert other.extend("doc", writer.token, 50) is True
    assert writer.extend(60) is True, "by handle: its kind only"
    assert other.release_token("doc", writer.token) is True
    assert server.exists(name) == 0


def test_fences_rise_and_a_writer_is_above_every_earlier_grant(rig: FaceRig, url: str) -> None:
    lock = lock_of(rig, client_of(rig, url))
    readers = [held(lock.acquire("read", "doc")) for _ in range(3)]
    fences = [r.fence or 0 for r in readers]
    assert 0 not in fences
    assert fences == sorted(fences)
    assert len(set(fences)) == 3
    for reader in readers:
        assert reader.release() is True
    writer = held(lock.acquire("write", "doc"))
    assert writer.fence is not None
    assert writer.fence > max(fences)
    assert lock.holders("doc").fence == writer.fence
    assert writer.release() is True
    reader = held(lock.acquire("read", "doc"))
    assert reader.fence is not None
    assert reader.fence > writer.fence


# --- records dmutex did not write ----------------------------------------------------------


FOREIGN = {
    "string": lambda s, n: s.set(n, "someone else's"),
    "unmarked hash": lambda s, n: s.hset(n, "w:token", "1"),
    "another kind": lambda s, n: s.hset(n, mapping={"kind": "theirs", "fence": "7"}),
    "list": lambda s, n: s.rpush(n, "a", "b"),
}


@pytest.mark.parametrize("what", list(FOREIGN))
def test_a_foreign_record_raises_and_is_left_as_it_was(
    rig: FaceRig, url: str, server: redis.Redis, what: str
) -> None:
    lock = lock_of(rig, client_of(rig, url))
    name = rwlock("doc")
    FOREIGN[what](server, name)
    server.expire(name, 1000)
    stored = server.dump(name)
    token = str(uuid.uuid4())
    operations: list[Callable[[], object]] = [
        lambda: lock.acquire("read", "doc"),
        lambda: lock.acquire("write", "doc"),
        lambda: lock.acquire_with_retry("write", "doc", timeout=0.05, retry_delay=0.01),
        lambda: lock.release_token("doc", token),
        lambda: lock.extend("doc", token, 10),
        lambda: lock.holders("doc"),
    ]
    for operation in operations:
        with pytest.raises(DMutexError, match="dmutex did not write"):
            operation()
        assert server.dump(name) == stored
        assert 0 < server.ttl(name) <= 1000
    assert server.keys("*") == [name]


def test_a_foreign_waiting_record_stops_a_waiting_writer_before_its_intent(
    rig: FaceRig, url: str, server: redis.Redis
) -> None:
    """The script decides before it writes: a refused writer that cannot register leaves nothing."""
    lock = lock_of(rig, client_of(rig, url))
    reader = held(lock.acquire("read", "doc", LONG))
    server.set(f"{PREFIX}waiters:doc", "someone else's")
    before = server.hgetall(rwlock("doc"))
    with pytest.raises(DMutexError, match="waiters:doc"):
        lock.acquire_with_retry("write", "doc", timeout=5, retry_delay=1)
    assert server.hgetall(rwlock("doc")) == before
    assert server.get(f"{PREFIX}waiters:doc") == "someone else's"
    assert reader.release() is True


# --- one request per operation -------------------------------------------------------------


def test_each_operation_is_one_request(rig: FaceRig, url: str, server: redis.Redis) -> None:
    """Counted twice: what the client was asked to send, and EVALSHA calls on the server."""
    client = recorded_of(rig, url)
    lock = lock_of(rig, client)
    seen: dict[str, tuple[list[str], int]] = {}

    def measure(label: str, action: Callable[[], T]) -> T:
        client.sent.clear()
        start = evalsha_calls(server)
        result = action()
        seen[label] = (client.kinds(), evalsha_calls(server) - start)
        return result

    first = held(measure("read, free", lambda: lock.acquire("read", "doc", LONG)))
    second = held(measure("read, shared", lambda: lock.acquire("read", "doc", LONG)))
    assert measure("write, refused", lambda: lock.acquire("write", "doc")) is None
    assert measure("extend", partial(first.extend, LONG)) is True
    assert measure("extend by token", lambda: lock.extend("doc", second.token, LONG)) is True
    measure("holders", lambda: lock.holders("doc"))
    assert measure("release", first.release) is True
    assert measure("release by token", lambda: lock.release_token("doc", second.token)) is True
    writer = measure(
        "write, retrying, free", lambda: lock.acquire_with_retry("write", "doc", timeout=5)
    )
    assert measure("read, refused", lambda: lock.acquire("read", "doc")) is None
    assert measure("release", held(writer).release) is True
    assert seen == {
        "read, free": (["acquire"], 1),
        "read, shared": (["acquire"], 1),
        "write, refused": (["acquire"], 1),
        "extend": (["extend"], 1),
        "extend by token": (["extend"], 1),
        "holders": (["inspect"], 1),
        "release": (["release"], 1),
        "release by token": (["release"], 1),
        "write, retrying, free": (["acquire"], 1),
        "read, refused": (["acquire"], 1),
    }


def test_renewals_of_many_holds_are_one_request(
    rig: FaceRig, url: str, server: redis.Redis
) -> None:
    """``extend_many``: holds of four locks, both kinds (one released), renewed by one RW_RENEW."""
    client = recorded_of(rig, url)
    lock = lock_of(rig, client)
    handles = [held(lock.acquire("read", "a", 5)), held(lock.acquire("read", "a", 5))]
    handles += [held(lock.acquire("write", "b", 5)), held(lock.acquire("read", "c", 5))]
    gone = held(lock.acquire("read", "d", 5))
    assert gone.release() is True
    leases: list[Lease] = [h.raw._lease for h in [*handles, gone]]
    for lease in leases:
        lease.ttl_ms = 40_000
    client.sent.clear()
    start = evalsha_calls(server)
    drive: Any = lock.target._drive
    answers = lock.wait(drive(lock.target._reading._store.extend_many(leases)))
    assert client.kinds() == ["renew"]
    assert evalsha_calls(server) - start == 1
    assert len(client.sent[0].args) == 3 + 4 + 4 * 5, "each hash once in KEYS; 4 ARGV a hold"
    now = server_ms(server)
    assert [a is not None for a in answers] == [True, True, True, True, False]
    for handle in handles:
        kind = "w" if handle.key == "b" else "r"
        stored = int(server.hget(rwlock(handle.key), f"{kind}:{handle.token}") or 0)
        assert now + 39_000 <= stored <= now + 40_000


def test_an_ioredis_shaped_client_runs_the_scripts_by_eval(url: str, server: redis.Redis) -> None:
    """``set`` + ``eval``: each operation one EVAL; its waiters poll."""
    inner = redis.Redis.from_url(url)
    try:
        lock = RWFace("sync", SetEvalRedis(inner), service_name=SERVICE)
        reader = held(lock.acquire("read", "doc"))
        assert lock.acquire("write", "doc") is None
        assert reader.extend(30) is True
        assert reader.release() is True
        writer = held(lock.acquire_with_retry("write", "doc", timeout=1))
        assert writer.release() is True
        assert server.keys("*") == []
    finally:
        inner.close()


@pytest.mark.parametrize("face", FACES)
def test_valkey_py_clients(url: str, server: redis.Redis, face: FaceName) -> None:
    rig = FaceRig(face)
    try:
        if face == "async":
            client: object = valkey.asyncio.Valkey.from_url(url)
        else:
            client = valkey.Valkey.from_url(url)
        lock = RWFace(face, client, service_name=SERVICE, loop=rig.loop)
        reader = held(lock.acquire("read", "doc"))
        assert lock.acquire("write", "doc") is None
        assert reader.release() is True
        writer = held(lock.acquire_with_retry("write", "doc", timeout=1))
        assert server.hget(rwlock("doc"), f"w:{writer.token}") is not None
        assert writer.release() is True
        if isinstance(client, valkey.asyncio.Valkey):
            assert rig.loop is not None
            rig.loop.run(client.aclose())
        else:
            closing: Any = client
            closing.close()
    finally:
        rig.close()


# --- waking --------------------------------------------------------------------------------


def _waiting(
    rig: FaceRig, url: str, side: Side, **options: Any
) -> tuple[Recorded | AsyncRecorded, Background[Handle | None]]:
    """A retrying acquire of ``side`` on "doc" that waits PATIENT s between attempts."""
    client = recorded_of(rig, url, client_name=WAITER)
    lock = lock_of(rig, client, **options)
    waiter = Background(
        lambda: lock.acquire_with_retry(
            side, "doc", ttl=LONG, timeout=2 * PATIENT, retry_delay=PATIENT
        )
    )
    return client, waiter


def _woken_once(client: Recorded | AsyncRecorded) -> None:
    """The waiter sent a refused attempt, one BLPOP that a signal answered, and the grant."""
    assert client.kinds() == ["acquire", "BLPOP", "acquire"]
    assert client.sent[1].reply is not None, "the BLPOP was answered by a signal"


def test_a_writers_release_wakes_a_waiting_reader(
    rig: FaceRig, url: str, server: redis.Redis
) -> None:
    lock = lock_of(rig, client_of(rig, url))
    writer = held(lock.acquire("write", "doc", LONG))
    client, waiter = _waiting(rig, url, "read")
    until(lambda: blocked(server) == 1, "the reader blocks on the signal list")
    assert server.zrange(f"{PREFIX}waiters:doc", 0, -1) == [
        str(client.sent[0].args[-3]),
        "dmutex:waiters",
    ]
    assert writer.release() is True
    reader = held(waiter.result())
    _woken_once(client)
    assert reader.release() is True


def test_the_last_readers_release_wakes_a_waiting_writer(
    rig: FaceRig, url: str, server: redis.Redis
) -> None:
    """A reader's release that leaves a reader in signals nothing; the last one's does."""
    lock = lock_of(rig, client_of(rig, url))
    first, second = held(lock.acquire("read", "doc", LONG)), held(lock.acquire("read", "doc", LONG))
    client, waiter = _waiting(rig, url, "write")
    until(lambda: blocked(server) == 1, "the writer blocks on the signal list")
    assert first.release() is True
    assert server.exists(f"{PREFIX}signal:doc") == 0, "no signal while a reader is in"
    assert blocked(server) == 1
    assert second.release() is True
    writer = held(waiter.result())
    _woken_once(client)
    assert writer.release() is True


def test_a_withdrawn_intent_wakes_the_readers_it_held_back(
    rig: FaceRig, url: str, server: redis.Redis
) -> None:
    lock, other = lock_of(rig, client_of(rig, url)), lock_of(rig, client_of(rig, url))
    reader = held(lock.acquire("read", "doc", LONG))
    _, token, _ = other.intend("doc", ttl=LONG, retry_delay=PATIENT)
    client, waiter = _waiting(rig, url, "read")
    until(lambda: blocked(server) == 1, "the new reader blocks behind the intent")
    assert other.release_token("doc", token) is False, "an intent is no hold"
    late = held(waiter.result())
    _woken_once(client)
    assert late.release() is True
    assert reader.release() is True


def test_a_readers_release_under_max_readers_wakes_a_waiting_reader(
    rig: FaceRig, url: str, server: redis.Redis
) -> None:
    lock = lock_of(rig, client_of(rig, url), max_readers=2)
    first, _ = held(lock.acquire("read", "doc", LONG)), held(lock.acquire("read", "doc", LONG))
    client, waiter = _waiting(rig, url, "read", max_readers=2)
    until(lambda: blocked(server) == 1, "the third reader blocks")
    assert first.release() is True
    held(waiter.result())
    _woken_once(client)


class _Pipelines(redis.Redis):
    """A redis-py client that records each pipeline it sends (commands, replies) and each command.

    It overrides ``pipeline`` and ``execute_command`` together, so dmutex
    still sends a waiter's attempt with its block through it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands: list[str] = []
        self.piped: list[tuple[list[str], list[Any]]] = []
        self.late = (
            0.0  # how long each pipeline's replies take to come back, after the server ran it
        )

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.commands.append(str(args[0]))
        send: Callable[..., Any] = super().execute_command
        return send(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        run: Callable[..., list[Any]] = pipe.execute
        queue: Callable[..., Any] = pipe.execute_command
        sent: list[str] = []

        def execute_command(*args: Any, **options: Any) -> Any:
            sent.append(str(args[0]) if args[0] != "EVALSHA" else SCRIPTS[str(args[1])])
            return queue(*args, **options)

        def execute(raise_on_error: bool = True) -> list[Any]:
            replies = run(raise_on_error=raise_on_error)
            self.piped.append((list(sent), replies))
            time.sleep(self.late)
            return replies

        pipe.execute_command = execute_command  # type: ignore[method-assign]  # records its commands
        pipe.execute = execute  # type: ignore[method-assign]  # records what it sent and got
        return pipe


def test_a_woken_readers_attempt_rides_with_its_block(url: str, server: redis.Redis) -> None:
    """Waiting rule 6: BLPOP and the next attempt in one pipeline; nothing sent after the wake."""
    holder = RWFace("sync", server, service_name=SERVICE)
    writer = held(holder.acquire("write", "doc", LONG))
    client = cast(_Pipelines, _Pipelines.from_url(url, client_name=WAITER))
    try:
        lock = RWFace("sync", client, service_name=SERVICE)
        waiter = Background(
            lambda: lock.acquire_with_retry(
                "read", "doc", ttl=LONG, timeout=SETTLE, retry_delay=0.4
            )
        )
        until(lambda: blocked(server) == 1, "the reader blocks")
        assert writer.release() is True
        reader = held(waiter.result())
        assert client.commands == ["EVALSHA"], "its first attempt; then only pipelines"
        sent, replies = client.piped[-1]
        assert sent == ["BLPOP", "acquire"]
        assert replies[0] is not None, "woken by the release"
        assert replies[1][0] == 1, "granted by the attempt that rode with the block"
        assert all(s == ["BLPOP", "acquire"] for s, _ in client.piped)
        assert server.hget(rwlock("doc"), f"r:{reader.token}") is not None
        assert reader.release() is True
    finally:
        client.close()


def test_a_writers_attempt_sent_ahead_past_the_deadline_is_not_its_last(
    url: str, server: redis.Redis
) -> None:
    """Its reply came after the deadline, which makes it the engine's last; it left the intent.

    So the store sends the last attempt itself, which withdraws the intent
    (``readwrite`` rule 2): no reader waits for it to lapse.
    """
    holder = RWFace("sync", server, service_name=SERVICE)
    reader = held(holder.acquire("read", "doc", LONG))
    client = cast(_Pipelines, _Pipelines.from_url(url, client_name=WAITER))
    client.late = 0.3  # the deadline (0.2 s) passes while the reply is on its way
    try:
        lock = RWFace("sync", client, service_name=SERVICE)
        writer = lock.acquire_with_retry("write", "doc", ttl=LONG, timeout=0.2, retry_delay=0.1)
        assert writer is None
        assert client.commands == ["EVALSHA", "EVALSHA"], "the first attempt, and the last"
        assert [sent for sent, _ in client.piped] == [["BLPOP", "acquire"]]
        assert [f for f in server.hkeys(rwlock("doc")) if str(f).startswith("i:")] == []
        held(holder.acquire("read", "doc"))
    finally:
        client.close()
    assert reader.release() is True


def test_a_server_without_the_scripts_runs_each_by_eval_once(
    rig: FaceRig, url: str, server: redis.Redis
) -> None:
    server.script_flush()
    client = recorded_of(rig, url)
    lock = lock_of(rig, client)
    reader = held(lock.acquire("read", "doc"))
    assert reader.release() is True
    assert [str(s.args[0]) for s in client.sent] == ["EVALSHA", "EVAL", "EVALSHA", "EVAL"]
    client.sent.clear()
    held(lock.acquire("read", "doc"))
    assert client.kinds() == ["acquire"], "cached by the EVAL"


# --- a cluster -----------------------------------------------------------------------------


def _newest_executable() -> list[Any]:
    found = sorted(executables(), key=lambda e: tuple(map(int, e.version.split("."))))
    if not found:
        return [pytest.param(None, id="no-redis-server")]
    return [pytest.param(found[-1], id=f"cluster-{found[-1].label}")]


@pytest.fixture(scope="module", params=_newest_executable())
def cluster(request: pytest.FixtureRequest) -> Iterator[list[tuple[str, int]]]:
    """A three-master cluster of the newest ``redis-server`` found, for this module."""
    executable: Executable | None = request.param
    if executable is None:
        pytest.skip("no Redis Cluster: no runnable redis-server executable")
    local = LocalCluster(executable.path, 3)
    try:
        yield local.start()
    finally:
        local.stop()


def _node_of(nodes: list[tuple[str, int]], name: str) -> redis.Redis:
    index = next(i for i, owned in enumerate(slot_ranges(len(nodes))) if hash_slot(name) in owned)
    host, port = nodes[index]
    return redis.Redis(host=host, port=port, decode_responses=True)


@pytest.mark.parametrize("key", ["{orders}", "orders"], ids=["hash-tagged", "untagged"])
def test_a_cluster_serves_any_key_fenced_and_wakes_on_a_hash_tagged_one(
    cluster: list[tuple[str, int]], key: str
) -> None:
    host, port = cluster[0]
    with (
        redis.cluster.RedisCluster(host=host, port=port) as holder_client,
        redis.cluster.RedisCluster(host=host, port=port) as inner,
        _node_of(cluster, rwlock(key)) as node,
    ):
        holder_client.flushall()
        lock = RWFace("sync", holder_client, service_name=SERVICE)
        first, second = held(lock.acquire("read", key, LONG)), held(lock.acquire("read", key, LONG))
        assert lock.acquire("write", key) is None
        assert first.fence is not None
        assert second.fence is not None
        assert second.fence > first.fence
        stored = node.hgetall(rwlock(key))
        assert stored["kind"] == MARK
        assert stored["fence"] == str(second.fence)
        assert first.release() is True
        recorded = ClusterRecorded(inner, lambda args: Sent(args).kind)
        waiting = RWFace("sync", recorded, service_name=SERVICE)
        tagged = key.startswith("{")
        waiter = Background(
            lambda: waiting.acquire_with_retry(
                "write", key, ttl=LONG, timeout=2 * PATIENT, retry_delay=PATIENT if tagged else 0.05
            )
        )
        if tagged:
            until(lambda: "BLPOP" in recorded.kinds, "the writer blocks")
            assert node.zcard(f"{PREFIX}waiters:{key}") == 2, "registered beside the hash"
        else:
            until(lambda: recorded.kinds.count("acquire") >= 3, "the writer polls")
        assert second.release() is True
        writer = held(waiter.result())
        assert writer.fence is not None
        assert writer.fence > second.fence
        if tagged:
            assert recorded.kinds == ["acquire", "BLPOP", "acquire"]
        else:
            assert set(recorded.kinds) == {"acquire"}, "no waiting record: polled"
        assert writer.release() is True
        assert node.exists(rwlock(key)) == 0


# --- replicas= ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicated() -> Iterator[Replicated]:
    executable = fault_servers.redis_executable()
    if executable is None:
        pytest.skip("no redis-server executable on this machine")
    servers = Replicated(executable.path, count=1)
    servers.start()
    try:
        yield servers
    finally:
        servers.stop()


class _Counted(redis.Redis):
    """A redis-py client that counts its round trips: commands sent alone, and pipelines."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands = 0
        self.pipelines = 0

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.commands += 1
        send: Callable[..., Any] = super().execute_command
        return send(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        self.pipelines += 1
        return super().pipeline(transaction, shard_hint)

    def trips(self) -> tuple[int, int]:
        """``(commands, pipelines)`` since the last call."""
        counted = (self.commands, self.pipelines)
        self.commands = self.pipelines = 0
        return counted


def test_replicas_grants_and_extends_are_on_the_replica_when_they_return(
    rig: FaceRig, replicated: Replicated
) -> None:
    """Each in one pipeline (the script and WAIT); a paused replica: NotReplicatedError, undone."""
    primary = replicated.client()
    replica = replicated.client(replicated.replicas[0].port)
    counted = cast(_Counted, _Counted.from_url(replicated.url()))
    try:
        primary.flushdb()
        for script in (RW_ACQUIRE, RW_RELEASE, RW_EXTEND):
            primary.script_load(script.text)  # cached: one EVALSHA a write, no NOSCRIPT then EVAL
        replicated.wait_online()
        client = counted if rig.face == "sync" else client_of(rig, replicated.url())
        lock = lock_of(rig, client, replicas=1, replicas_timeout=0.25)
        name = rwlock("doc")
        reader = held(lock.acquire("read", "doc", LONG))
        assert replica.hget(name, f"r:{reader.token}") is not None, "on the replica already"
        second = held(lock.acquire_with_retry("read", "doc", timeout=1))
        assert replica.hget(name, f"r:{second.token}") is not None
        assert reader.extend(LONG + 10) is True
        assert replica.hget(name, f"r:{reader.token}") == primary.hget(name, f"r:{reader.token}")
        if rig.face == "sync":
            assert counted.trips() == (0, 3), "three writes, a pipeline each, no command alone"
        assert reader.release() is True
        assert second.release() is True
        replicated.pause()
        try:
            with pytest.raises(NotReplicatedError):
                lock.acquire("write", "doc", LONG)
            assert primary.exists(name) == 0, "the grant was released again"
        finally:
            replicated.resume()
    finally:
        primary.close()
        replica.close()
        counted.close()

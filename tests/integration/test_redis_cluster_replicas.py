"""``replicas=`` on Redis Cluster: each grant waits for the replicas of its key's shard.

A local cluster of three masters with one replica each (``redis_cluster.py``).
The ``WAIT`` goes in the cluster client's pipeline beside the script, routed
to the node that owns the key's hash slot, on the connection that wrote. On
both faces (redis-py's ``RedisCluster`` and its asyncio twin):

- a grant is on the shard's replica when the acquire returns, for a mutex
  and for a semaphore whose slot keys share a hash tag, and for one whose
  slot keys fall in several shards (one request per slot key, each waited);
- with that shard's replica paused, the acquire raises
  :class:`~dmutex.NotReplicatedError` and leaves nothing, while a key of
  another shard is still granted.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio.cluster
import redis.cluster

from dmutex import NotReplicatedError
from dmutex._backends.redis.cluster import hash_slot
from tests._support import fault_servers
from tests._support.face_rigs import FaceRig
from tests._support.faces import Face, FaceName, Kind
from tests._support.redis_cluster import LocalCluster, slot_ranges

FACES: list[FaceName] = ["sync", "async"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    executable = fault_servers.redis_executable()
    if executable is None:
        pytest.skip("no redis-server executable on this machine")
    local = LocalCluster(executable.path, 3, replicas=1)
    try:
        local.start()
        yield local
    finally:
        local.stop()


@pytest.fixture(params=FACES)
def rig(request: pytest.FixtureRequest) -> Iterator[FaceRig]:
    made = FaceRig(request.param)
    try:
        yield made
    finally:
        made.close()


# A healthy replica's acknowledgement: the WAIT's bound, far above loopback's
# sub-millisecond replication (CI run N, at a load average of 8, saw a replica
# miss 0.25 s on two acquires). A paused replica's test waits for it to expire.
HEALTHY_TIMEOUT = 2.0
PAUSED_TIMEOUT = 0.25


def make(
    rig: FaceRig, cluster: LocalCluster, kind: Kind, timeout: float = HEALTHY_TIMEOUT
) -> tuple[Face, Any]:
    """A lock of ``kind`` (3 permits for a semaphore) with ``replicas=1``, and its client."""
    client: Any
    port = cluster.ports[0]
    if rig.face == "async":
        client = redis.asyncio.cluster.RedisCluster(host=cluster.host, port=port)
        assert rig.loop is not None
        rig.loop.run(client.initialize())
    else:
        client = redis.cluster.RedisCluster(host=cluster.host, port=port)
    permits = 3 if kind == "semaphore" else 1
    face = Face(
        rig.face,
        kind,
        client,
        max_permits=permits,
        loop=rig.loop,
        replicas=1,
        replicas_timeout=timeout,
    )
    return face, client


def close(rig: FaceRig, client: Any) -> None:
    if rig.loop is not None:
        rig.loop.run(client.aclose())
    else:
        client.close()


def master_of(cluster: LocalCluster, name: str) -> int:
    """The port of the master that owns ``name``'s hash slot."""
    at = hash_slot(name)
    ranges = slot_ranges(cluster.nodes)
    return next(port for port, owned in zip(cluster.ports, ranges, strict=True) if at in owned)


def on_replica(cluster: LocalCluster, name: str) -> bytes | None:
    """``name``'s value as its shard's replica has it (READONLY: a replica may serve reads)."""
    (replica,) = cluster.replica_ports[master_of(cluster, name)]
    with redis.Redis(host=cluster.host, port=replica) as node:
        node.execute_command("READONLY")
        value = node.get(name)
    assert value is None or isinstance(value, bytes)
    return value


def slot_name(kind: Kind, slot: int, key: str) -> str:
    prefix = "_dmutex_svc:" if kind == "mutex" else "_dsemaphore_svc:"
    return f"{prefix}permit:{slot}:{key}"


@pytest.mark.parametrize(
    ("kind", "tagged"),
    [("mutex", True), ("mutex", False), ("semaphore", True), ("semaphore", False)],
)
def test_a_grant_is_on_its_shards_replica_when_it_returns(
    rig: FaceRig, cluster: LocalCluster, kind: Kind, tagged: bool
) -> None:
    face, client = make(rig, cluster, kind)
    try:
        name = uuid.uuid4().hex[:8]
        key = f"{{{name}}}" if tagged else name
        handles = [face.acquire(key, ttl=30) for _ in range(face.max_permits)]
        for handle in handles:
            assert handle is not None
            stored = slot_name(kind, handle.slot, key)
            assert on_replica(cluster, stored) == handle.token.encode()
            assert handle.extend(60) is True
            assert handle.release() is True
    finally:
        close(rig, client)


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_a_paused_shard_replica_refuses_that_shards_grants_only(
    rig: FaceRig, cluster: LocalCluster, kind: Kind
) -> None:
    face, client = make(rig, cluster, kind, PAUSED_TIMEOUT)
    name = uuid.uuid4().hex[:8]
    key = f"{{{name}}}"
    master = master_of(cluster, slot_name(kind, 0, key))
    (replica,) = cluster.replica_ports[master]
    elsewhere = next(
        f"{{{n}}}"
        for n in range(100_000)
        if master_of(cluster, slot_name(kind, 0, f"{{{n}}}")) != master
    )
    pid = cluster.process(replica).pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(NotReplicatedError):
            face.acquire(key, ttl=30)
        with redis.Redis(host=cluster.host, port=master) as node:
            assert node.keys(f"*permit:*:{key}") == []
        other = face.acquire(elsewhere, ttl=30)
        assert other is not None
        assert other.release() is True
    finally:
        os.kill(pid, signal.SIGCONT)
        close(rig, client)

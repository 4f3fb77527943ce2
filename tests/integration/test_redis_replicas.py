"""``replicas=``: grants, extends and renewals that count only once replicas have them.

On a real primary with one replica (``redis_replicated.py``), on both faces
and both kinds:

- a grant, an extend and a renewal are on the replica when the call returns
  (read from the replica itself), each in one round trip: the script and its
  ``WAIT`` go in one pipeline, and no command goes on its own;
- with the replica paused (SIGSTOP), an acquire raises
  :class:`~dmutex.NotReplicatedError` and leaves no lease behind, on the
  primary or (once resumed) on the replica; a refusal stays a refusal; an
  extend raises and keeps the old expiry; renewals fail and the lease is
  lost at its deadline, before the primary's copy of it expires;
- a waiter woken by a release gets a replicated grant.

What a failover does with these guarantees is ``tests/faults/failover/test_failover.py``'s.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
import valkey
import valkey.asyncio

from dmutex import NotReplicatedError
from tests._support import fault_servers
from tests._support.face_rigs import FaceRig
from tests._support.faces import Face, FaceName, Handle, Kind
from tests._support.redis_replicated import Replicated

FACES: list[FaceName] = ["sync", "async"]
KINDS: list[Kind] = ["mutex", "semaphore"]
# Long enough that a paused replica is the only reason a WAIT ends unanswered.
TIMEOUT = 0.25


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


@pytest.fixture(params=FACES)
def rig(request: pytest.FixtureRequest) -> Iterator[FaceRig]:
    made = FaceRig(request.param)
    try:
        yield made
    finally:
        made.close()


class Counted(redis.Redis):
    """A redis-py client that counts the round trips dmutex makes: commands and pipelines."""

    commands = 0
    pipelines = 0

    def execute_command(self, *args: Any, **options: Any) -> Any:
        type(self).commands += 1
        return super().execute_command(*args, **options)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        type(self).pipelines += 1
        return super().pipeline(transaction, shard_hint)


class AsyncCounted(redis.asyncio.Redis):
    """The asyncio twin of :class:`Counted`."""

    commands = 0
    pipelines = 0

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        type(self).commands += 1
        return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        type(self).pipelines += 1
        return super().pipeline(transaction, shard_hint)


def make(rig: FaceRig, servers: Replicated, kind: Kind, **options: Any) -> Face:
    """A lock of ``kind`` on the primary with ``replicas=1`` (unless ``options`` say)."""
    options.setdefault("replicas", 1)
    options.setdefault("replicas_timeout", TIMEOUT)
    client: redis.Redis | redis.asyncio.Redis
    if rig.face == "async":
        client = rig.keep(AsyncCounted(port=servers.primary.port))
    else:
        client = rig.keep(Counted(port=servers.primary.port))
    permits = 3 if kind == "semaphore" else 1
    return Face(rig.face, kind, client, max_permits=permits, loop=rig.loop, **options)


def slot_key(face: Face, kind: Kind, handle: Handle) -> str:
    prefix = "_dmutex_svc:" if kind == "mutex" else "_dsemaphore_svc:"
    return f"{prefix}permit:{handle.slot}:{handle.key}"


def key() -> str:
    return f"k-{uuid.uuid4().hex[:8]}"


def counted(rig: FaceRig) -> type[Counted] | type[AsyncCounted]:
    return AsyncCounted if rig.face == "async" else Counted


@pytest.mark.parametrize("kind", KINDS)
def test_grant_and_extend_are_on_the_replica_when_they_return(
    rig: FaceRig, replicated: Replicated, kind: Kind
) -> None:
    face = make(rig, replicated, kind)
    name = key()
    # One cycle first, so the server has every script cached (EVALSHA answers).
    warm = face.acquire(key(), ttl=30)
    assert warm is not None
    assert warm.extend(30)
    assert warm.release()
    calls = counted(rig)
    calls.commands = calls.pipelines = 0
    handle = face.acquire(name, ttl=30)
    assert handle is not None
    # One round trip: one pipeline (the script and its WAIT), no command alone.
    assert (calls.commands, calls.pipelines) == (0, 1)
    with replicated.client(replicated.replicas[0].port) as replica:
        assert replica.get(slot_key(face, kind, handle)) == handle.token.encode()
        assert handle.extend(120) is True
        assert (calls.commands, calls.pipelines) == (0, 2)
        assert replica.pttl(slot_key(face, kind, handle)) > 60_000
        assert handle.release() is True
    # A release waits for no one: one command.
    assert (calls.commands, calls.pipelines) == (1, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_a_grant_no_replica_acknowledged_is_released_and_raises(
    rig: FaceRig, replicated: Replicated, kind: Kind
) -> None:
    face = make(rig, replicated, kind)
    name = key()
    replicated.pause()
    try:
        with pytest.raises(NotReplicatedError) as raised:
            face.acquire(name, ttl=30)
        with replicated.client() as primary:
            left = primary.keys(f"*permit:*:{name}")
    finally:
        replicated.resume()
    assert (raised.value.key, raised.value.acknowledged, raised.value.required) == (name, 0, 1)
    assert left == []
    replicated.wait_online()
    with replicated.client(replicated.replicas[0].port) as replica:
        assert replica.keys(f"*permit:*:{name}") == []
    # Nothing stays held: the next acquire is granted.
    handle = face.acquire(name, ttl=30)
    assert handle is not None
    assert handle.release() is True


@pytest.mark.parametrize("kind", KINDS)
def test_a_refusal_stays_a_refusal_without_replicas(
    rig: FaceRig, replicated: Replicated, kind: Kind
) -> None:
    face = make(rig, replicated, kind)
    name = key()
    held = [face.acquire(name, ttl=30) for _ in range(face.max_permits)]
    assert all(held)
    replicated.pause()
    try:
        assert face.acquire(name, ttl=30) is None
    finally:
        replicated.resume()
    with replicated.client() as primary:
        assert len(primary.keys(f"*permit:*:{name}")) == face.max_permits
    for handle in held:
        assert handle is not None
        assert handle.release() is True


@pytest.mark.parametrize("kind", KINDS)
def test_an_extend_no_replica_acknowledged_raises_and_keeps_the_old_expiry(
    rig: FaceRig, replicated: Replicated, kind: Kind
) -> None:
    face = make(rig, replicated, kind)
    handle = face.acquire(key(), ttl=30)
    assert handle is not None
    before = handle.expired_at
    replicated.pause()
    try:
        with pytest.raises(NotReplicatedError):
            handle.extend(120)
    finally:
        replicated.resume()
    assert handle.expired_at == before
    assert not handle.lost
    assert handle.release() is True


@pytest.mark.parametrize("kind", KINDS)
def test_renewals_no_replica_acknowledged_lose_the_lease_at_its_deadline(
    rig: FaceRig, replicated: Replicated, kind: Kind
) -> None:
    face = make(rig, replicated, kind, replicas_timeout=0.05)
    handle = face.acquire(key(), ttl=1.5, auto_renew=True)
    assert handle is not None
    replicated.pause()
    try:
        # Renewals go on reaching the primary, which extends the key; none counts.
        assert handle.wait_lost(timeout=10) is True
        with replicated.client() as primary:
            left = primary.pttl(slot_key(face, kind, handle))
    finally:
        replicated.resume()
    # The primary still has it, for a while: the loss was declared by the
    # holder's deadline, not by the key's end.
    assert left > 0
    assert handle.release() is True


@pytest.mark.parametrize("kind", KINDS)
def test_renewal_goes_on_while_replicas_acknowledge(
    rig: FaceRig, replicated: Replicated, kind: Kind
) -> None:
    face = make(rig, replicated, kind)
    handle = face.acquire(key(), ttl=0.9, auto_renew=True)
    assert handle is not None
    first = handle.expired_at
    time.sleep(1.2)
    assert not handle.lost
    assert handle.expired_at > first
    assert handle.release() is True


@pytest.mark.parametrize("kind", KINDS)
def test_a_woken_waiter_gets_a_replicated_grant(
    rig: FaceRig, replicated: Replicated, kind: Kind
) -> None:
    face = make(rig, replicated, kind)
    other = make(rig, replicated, kind)
    name = key()
    held = [face.acquire(name, ttl=30) for _ in range(face.max_permits)]
    assert all(held)
    calls = counted(rig)
    calls.commands = 0
    # The waiter blocks its own thread (the async face's, on the rig's loop).
    got: list[Handle | None] = []
    thread = threading.Thread(
        target=lambda: got.append(other.acquire_with_retry(name, timeout=10, retry_delay=2))
    )
    thread.start()
    time.sleep(0.3)
    first = held[0]
    assert first is not None
    assert first.release() is True
    thread.join(timeout=15)
    (handle,) = got
    assert handle is not None
    with replicated.client(replicated.replicas[0].port) as replica:
        assert replica.get(slot_key(other, kind, handle)) == handle.token.encode()
    # One command, the first holder's release: the waiter's attempts and its
    # wait (BLPOP) all went in pipelines, with their WAITs; the attempt after
    # the wake rode with the BLPOP.
    assert calls.commands == 1
    assert handle.release() is True
    for rest in held[1:]:
        assert rest is not None
        assert rest.release() is True


@pytest.mark.parametrize("face", FACES)
def test_valkey_clients_wait_for_replicas_too(face: FaceName, replicated: Replicated) -> None:
    """valkey-py's clients, of redis-py's shape, pipeline the WAIT the same way."""
    rig = FaceRig(face)
    client: Any
    if face == "async":
        client = valkey.asyncio.Valkey(port=replicated.primary.port)
    else:
        client = valkey.Valkey(port=replicated.primary.port)
    try:
        mutex = Face(face, "mutex", client, loop=rig.loop, replicas=1, replicas_timeout=TIMEOUT)
        handle = mutex.acquire(key(), ttl=30)
        assert handle is not None
        with replicated.client(replicated.replicas[0].port) as replica:
            assert replica.get(f"_dmutex_svc:permit:0:{handle.key}") == handle.token.encode()
        assert handle.release() is True
        replicated.pause()
        try:
            with pytest.raises(NotReplicatedError):
                mutex.acquire(key(), ttl=30)
        finally:
            replicated.resume()
    finally:
        if rig.loop is not None:
            rig.loop.run(client.aclose())
        else:
            client.close()
        rig.close()

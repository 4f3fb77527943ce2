"""The etcd store against a real member: its layout, leases, fences, requests and URLs.

Every lock keeps its keys under the session's prefix (``etcd_servers``),
read back through the JSON gateway with the harness's own requests, not
through dmutex. Request counts are counted at the client (etcd3gw's
``post``), as the store's docstring states them.
"""

from __future__ import annotations

import base64
import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

import etcd3gw
import pytest

from dmutex import DMutex, DReadWriteLock, DSemaphore
from dmutex._backends import connect_url, parse_url
from dmutex._backends.address import Unreachable
from dmutex._backends.etcd.leases import lease_id
from dmutex._backends.etcd.store import PERMIT
from dmutex._backends.etcd.url import Endpoints
from tests._support.etcd_servers import Endpoint, Server, Session, request


class Counting(etcd3gw.Etcd3Client):
    """etcd3gw's client, counting the API paths it posts to."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.paths: list[str] = []

    def post(self, url: str, *args: Any, json: Any = None, **kwargs: Any) -> Any:
        self.paths.append(url.split("/v3", 1)[1])
        return super().post(url, *args, json=json, **kwargs)


@pytest.fixture
def server(etcd_session: Session) -> Server:
    return etcd_session.fresh()


@pytest.fixture
def client(server: Server) -> Iterator[Counting]:
    made = Counting(host=server.host, port=server.port, timeout=10)
    made.api_path  # noqa: B018 - etcd3gw asks the member's version once: not a lock's request
    yield made
    made.session.close()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def kvs(endpoint: Endpoint, prefix: str) -> list[Mapping[str, Any]]:
    """The keys under ``prefix``, as the gateway answers them (base64)."""
    start = prefix.encode()
    end = start[:-1] + bytes([start[-1] + 1])
    found = request(endpoint, "/v3/kv/range", {"key": b64(start), "range_end": b64(end)})
    return list(found.get("kvs") or [])


def time_to_live(endpoint: Endpoint, lease: int) -> Mapping[str, Any]:
    return request(endpoint, "/v3/kv/lease/timetolive", {"ID": lease})


def test_a_grant_is_a_key_under_a_lease_of_its_own(server: Server, client: Counting) -> None:
    prefix = f"{server.prefix}m:"
    lock = DMutex("svc", client, key_prefix=prefix).acquire("job", 7.2)
    assert lock is not None
    assert client.paths == ["/lease/grant", "/kv/txn"]
    (kv,) = kvs(server.endpoints[0], prefix)
    assert base64.b64decode(kv["key"]) == f"{prefix}permit:0:job".encode()
    assert base64.b64decode(kv["value"]) == lock.token.encode()
    lease = lease_id(PERMIT, prefix, "job", lock.token)
    assert int(kv["lease"]) == lease
    assert int(time_to_live(server.endpoints[0], lease)["grantedTTL"]) == 8  # 7.2 s, rounded up
    assert lock.fence == int(kv["create_revision"])  # the grant's revision
    assert lock.release() is True
    assert kvs(server.endpoints[0], prefix) == []
    assert int(time_to_live(server.endpoints[0], lease)["TTL"]) == -1  # revoked: no garbage


def test_a_short_ttl_gets_etcds_minimum_and_the_holder_keeps_its_own_deadline(
    server: Server, client: Counting
) -> None:
    prefix = f"{server.prefix}short:"
    lock = DMutex("svc", client, key_prefix=prefix).acquire("job", 0.5)
    assert lock is not None
    lease = lease_id(PERMIT, prefix, "job", lock.token)
    granted = int(time_to_live(server.endpoints[0], lease)["grantedTTL"])
    assert granted >= 1  # etcd raises it to its minimum (2 s with its default timing)
    left = lock.expired_at.timestamp() - time.time()
    assert left <= 0.5  # the holder's expiry is the TTL it asked for
    assert lock.release() is True


def test_fences_are_revisions_rising_across_keys(server: Server, client: Counting) -> None:
    prefix = f"{server.prefix}f:"
    mutex = DMutex("svc", client, key_prefix=prefix)
    fences = []
    for key in ("a", "b", "a", "c"):
        lock = mutex.acquire(key, 10)
        assert lock is not None
        assert lock.fence is not None
        fences.append(lock.fence)
        assert lock.release() is True
    assert fences == sorted(set(fences))


def test_requests_per_operation(server: Server, client: Counting) -> None:
    prefix = f"{server.prefix}n:"
    mutex = DMutex("svc", client, key_prefix=prefix)
    lock = mutex.acquire("job", 10)
    assert lock is not None
    client.paths.clear()
    assert lock.extend(10) is True
    assert client.paths == ["/lease/keepalive"]
    client.paths.clear()
    assert mutex.acquire("job", 10) is None
    assert client.paths == ["/lease/grant", "/kv/txn", "/kv/lease/revoke"]
    client.paths.clear()
    assert lock.extend(30) is True  # longer than its 10 s lease: moved to a new one
    assert client.paths == ["/lease/keepalive", "/lease/grant", "/kv/txn", "/kv/lease/revoke"]
    (kv,) = kvs(server.endpoints[0], prefix)
    assert int(time_to_live(server.endpoints[0], int(kv["lease"]))["grantedTTL"]) == 30
    client.paths.clear()
    assert lock.release() is True
    assert client.paths == ["/kv/lease/revoke"]
    assert kvs(server.endpoints[0], prefix) == []


def test_a_semaphore_and_a_read_write_lock_keep_their_layouts(
    server: Server, client: Counting
) -> None:
    endpoint = server.endpoints[0]
    prefix = f"{server.prefix}s:"
    semaphore = DSemaphore("svc", client, key_prefix=prefix, max_permits=3)
    permits = [semaphore.acquire("gpu", 10) for _ in range(3)]
    assert all(permits)
    names = sorted(base64.b64decode(kv["key"]).decode() for kv in kvs(endpoint, prefix))
    assert names == [f"{prefix}permit:{i}:gpu" for i in range(3)]
    assert semaphore.acquire("gpu", 10) is None
    rw_prefix = f"{server.prefix}rw:"
    lock = DReadWriteLock("svc", client, key_prefix=rw_prefix)
    readers = [lock.acquire_read("doc", 10), lock.acquire_read("doc", 10)]
    assert all(readers)
    names = sorted(base64.b64decode(kv["key"]).decode() for kv in kvs(endpoint, rw_prefix))
    assert names == sorted(f"{rw_prefix}rwlock:3:doc:r:{r.token}" for r in readers if r)
    for reader in readers:
        assert reader is not None
        assert reader.release() is True
    writer = lock.acquire_write("doc", 10)
    assert writer is not None
    (kv,) = kvs(endpoint, rw_prefix)
    assert base64.b64decode(kv["key"]) == f"{rw_prefix}rwlock:3:doc:w".encode()
    assert writer.release() is True
    for permit in permits:
        assert permit is not None
        assert permit.release() is True


def test_the_command_uses_the_first_endpoint_that_answers(server: Server) -> None:
    endpoint = server.endpoints[0]
    address = parse_url(f"etcd://127.0.0.1:1,{endpoint.address}")
    connection = connect_url(address, 2.0)
    try:
        assert isinstance(connection.client, Endpoints)
        mutex = DMutex("svc", connection.client, key_prefix=f"{server.prefix}cmd:")
        lock = mutex.acquire("job", 5)  # through the member that answered, the dead one skipped
        assert lock is not None
        assert lock.release() is True
    finally:
        connection.close()
    with pytest.raises(Unreachable, match=re.escape("127.0.0.1:1")):
        connect_url(parse_url("etcd://127.0.0.1:1"), 1.0)

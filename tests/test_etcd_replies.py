"""How the etcd store asks and reads, with no server: requests per operation, replies, errors."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Mapping
from typing import Any

import aetcd
import etcd3gw
import pytest

from dmutex import (
    AsyncDMutex,
    DMutex,
    DMutexError,
    DSemaphore,
    InvalidArgumentError,
    UnsupportedClientError,
)
from dmutex._backends import detect
from dmutex._backends.address import BadURL
from dmutex._backends.etcd.leases import lease_id, lease_seconds
from dmutex._backends.etcd.requests import Gateway, prefix_end
from dmutex._backends.etcd.store import PERMIT, EtcdStore, _key_of_slot
from dmutex._backends.etcd.url import Endpoints, endpoints
from dmutex._clock import SYSTEM_CLOCK
from dmutex._core.lease import Lease
from dmutex._runtime.drivers import SyncDriver


class GatewayError(Exception):
    """Stands in for etcd3gw's errors: dmutex reads etcd's words in ``detail_text``."""

    def __init__(self, detail: str) -> None:
        super().__init__("Precondition Failed")
        self.detail_text = json.dumps({"error": detail, "message": detail})


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def kv(key: str, value: str, lease: int, revision: int) -> dict[str, str]:
    return {
        "key": b64(key),
        "value": b64(value),
        "lease": str(lease),
        "create_revision": str(revision),
        "mod_revision": str(revision),
    }


def put_ok(revision: int) -> dict[str, object]:
    header = {"revision": str(revision)}
    return {
        "header": header,
        "succeeded": True,
        "responses": [{"response_put": {"header": header}}],
    }


def taken(*records: dict[str, str]) -> dict[str, object]:
    """A failed grant's transaction: ``succeeded`` left out (false), the slots read."""
    ranges = [{"response_range": {"kvs": [record]}} for record in records]
    return {"header": {"revision": "9"}, "responses": ranges}


class Scripted:
    """An etcd3gw-shaped client that answers each request from a script, and records them."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.requests: list[tuple[str, Mapping[str, Any]]] = []

    def get_url(self, path: str, /) -> str:
        return f"http://etcd.invalid/v3{path}"

    def post(self, url: str, /, *, json: Mapping[str, Any]) -> object:
        self.requests.append((url.rsplit("/v3", 1)[1], json))
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def watch_once(
        self, key: bytes, /, timeout: float, *, start_revision: int, filters: list[Any]
    ) -> object:
        self.requests.append(("watch", {"key": key, "start_revision": start_revision}))
        return {"type": "DELETE"}

    @property
    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]


def test_a_free_mutex_is_two_requests_and_its_fence_is_the_puts_revision() -> None:
    client = Scripted({"ID": "1", "TTL": "30"}, put_ok(41))
    mutex = DMutex("svc", client, default_ttl_seconds=30)
    lock = mutex.acquire("k")
    assert lock is not None
    assert lock.fence == 41
    assert client.paths == ["/lease/grant", "/kv/txn"]
    grant, txn = (payload for _, payload in client.requests)
    assert grant == {"TTL": 30, "ID": lease_id(PERMIT, "_dmutex_svc:", "k", lock.token)}
    (compare,) = txn["compare"]
    assert compare == {
        "key": b64("_dmutex_svc:permit:0:k"),
        "target": "VERSION",
        "result": "EQUAL",
        "version": 0,
    }
    assert txn["success"][0]["request_put"]["lease"] == grant["ID"]


def test_a_held_mutex_fails_in_three_requests_and_revokes_its_lease() -> None:
    holder = kv("_dmutex_svc:permit:0:k", "someone", 5, 7)
    client = Scripted({"ID": "1", "TTL": "2"}, taken(holder), {})
    mutex = DMutex("svc", client, default_ttl_seconds=0.5)
    assert mutex.acquire("k") is None
    assert client.paths == ["/lease/grant", "/kv/txn", "/kv/lease/revoke"]
    assert client.requests[0][1]["TTL"] == 1  # 0.5 s, rounded up to a whole second
    assert client.requests[2][1] == {"ID": client.requests[0][1]["ID"]}


def test_a_regrant_after_a_lost_reply_finds_its_own_slot() -> None:
    token = "t-1"
    lease = lease_id(PERMIT, "p:", "k", token)
    own = kv("p:permit:0:k", token, lease, 12)
    client = Scripted(
        GatewayError("etcdserver: lease already exists"),
        {"result": {"ID": str(lease), "TTL": "30"}},
        {
            "header": {"revision": "13"},
            "succeeded": True,
            "responses": [{"response_range": {"kvs": [own]}}],
        },
    )
    store = EtcdStore(Gateway(client), "p:", 1, SYSTEM_CLOCK)
    lock = SyncDriver(store.clock, store.ready)(store.acquire("k", token, 30_000))
    assert lock is not None
    assert (lock.token, lock.slot, lock.fence) == (token, 0, 12)
    assert client.paths == ["/lease/grant", "/lease/keepalive", "/kv/txn"]
    assert client.requests[2][1]["compare"] == []  # a read of every slot, before any put


def test_a_semaphore_tries_a_slot_its_read_showed_free() -> None:
    held = kv("_dsemaphore_svc:permit:0:k", "other", 5, 7)
    client = Scripted({"ID": "1", "TTL": "30"}, taken(held), put_ok(20))
    semaphore = DSemaphore("svc", client, max_permits=2, default_ttl_seconds=30)
    permit = semaphore.acquire("k")
    assert permit is not None
    assert (permit.slot, permit.fence) == (1, 20)
    second = client.requests[2][1]
    assert second["compare"][0]["key"] == b64("_dsemaphore_svc:permit:1:k")
    assert len(second["failure"]) == 2  # every slot read again if this one is taken too


def test_release_is_the_leases_revoke_and_a_missing_lease_answers_false_after_a_read() -> None:
    nothing = {"header": {"revision": "4"}, "succeeded": True}
    client = Scripted({}, GatewayError("etcdserver: requested lease not found"), nothing)
    semaphore = DSemaphore("svc", client, max_permits=3)
    assert semaphore.release("k", "t") is True
    assert semaphore.release("k", "t") is False  # after a read: no slot holds the token
    assert client.paths == ["/kv/lease/revoke", "/kv/lease/revoke", "/kv/txn"]
    assert client.requests[0][1] == {"ID": lease_id(PERMIT, "_dsemaphore_svc:", "k", "t")}


def test_extend_is_one_keepalive_and_a_longer_ttl_moves_the_hold_to_a_new_lease() -> None:
    first = lease_id(PERMIT, "_dmutex_svc:", "k", "t")
    own = kv("_dmutex_svc:permit:0:k", "t", first, 5)
    client = Scripted(
        {"result": {"TTL": "30"}},
        {"result": {"TTL": "2"}},  # a 2 s lease cannot last 10 s: a move
        {"succeeded": True, "responses": [{"response_range": {"kvs": [own]}}]},
        {"ID": "777", "TTL": "10"},
        put_ok(31),
        {},
        {"result": {"TTL": "10"}},
    )
    mutex = DMutex("svc", client, default_ttl_seconds=30)
    assert mutex.extend("k", "t") is True
    assert mutex.extend("k", "t", ttl=10) is True
    assert mutex.extend("k", "t", ttl=10) is True
    assert client.paths == [
        "/lease/keepalive",
        "/lease/keepalive",
        "/kv/txn",  # where the token's slot is (extend by key and token)
        "/lease/grant",
        "/kv/txn",
        "/kv/lease/revoke",
        "/lease/keepalive",
    ]
    grant, move, revoke, again = (payload for _, payload in client.requests[3:])
    assert grant == {"TTL": 10, "ID": 0}
    assert move["compare"][0]["target"] == "VALUE"
    assert move["success"][0]["request_put"]["lease"] == 777
    assert revoke == {"ID": first}
    assert again == {"ID": 777}


def test_extend_of_a_hold_that_is_gone_reads_its_slot_once() -> None:
    client = Scripted({"result": {"ID": "1"}}, {"header": {"revision": "4"}, "succeeded": True})
    mutex = DMutex("svc", client, default_ttl_seconds=30)
    assert mutex.extend("k", "t") is False
    assert client.paths == ["/lease/keepalive", "/kv/txn"]


@pytest.mark.parametrize(
    "reply",
    [
        None,
        [],
        {"responses": "x"},
        {"responses": [{"response_what": {}}]},
        {"responses": [{"response_put": {"header": {"revision": "x"}}}]},
    ],
)
def test_a_malformed_transaction_reply_is_an_error_naming_it(reply: object) -> None:
    client = Scripted({"ID": "1", "TTL": "30"}, reply)
    with pytest.raises(DMutexError, match="etcd"):
        DMutex("svc", client).acquire("k")


def test_lease_ids_are_positive_63_bit_and_name_the_kind_namespace_key_and_token() -> None:
    ids = {
        lease_id(kind, p, k, t)
        for kind in (PERMIT, "w")
        for p in ("a:", "b:")
        for k in ("k", "k2")
        for t in ("t", "u")
    }
    assert len(ids) == 16
    assert all(0 < lease < 2**63 for lease in ids)
    # A NUL in a part does not make two tuples one: each part is hashed after its length.
    assert lease_id("w", "a:", "k\x00t", "") != lease_id("w", "a:", "k", "t\x00")


@pytest.mark.parametrize(
    ("ttl_ms", "seconds"), [(1, 1), (999, 1), (1000, 1), (1001, 2), (61_500, 62)]
)
def test_a_leases_ttl_is_whole_seconds_rounded_up(ttl_ms: int, seconds: int) -> None:
    assert lease_seconds(ttl_ms) == seconds


def test_slot_keys_read_back_as_their_lock_keys() -> None:
    assert _key_of_slot(b"0:k:with:colons", 1) == "k:with:colons"
    assert _key_of_slot(b"3:k", 3) is None  # not a slot of a 3-permit semaphore
    assert _key_of_slot(b"x:k", 3) is None
    assert _key_of_slot(b"0:", 3) is None
    assert _key_of_slot(b"0:\xff", 3) is None
    assert prefix_end(b"a:") == b"a;"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff") == b"\x00"


def test_the_gateway_reads_a_range_of_keys_and_more() -> None:
    gateway = Gateway(Scripted())
    reply = {"kvs": [{"key": b64("p:permit:0:k")}], "more": True}
    assert gateway.keys(reply) == ([b"p:permit:0:k"], True)
    assert gateway.keys({}) == ([], False)


def test_etcd_clients_are_detected_and_their_faces_checked_before_any_request() -> None:
    sync = etcd3gw.Etcd3Client(host="127.0.0.1", port=1)
    asynchronous = aetcd.Client(host="127.0.0.1", port=1)
    assert detect(sync, None) == "etcd"
    assert detect(asynchronous, None) == "etcd"
    # The published protocols tell the faces apart for a type checker too.
    with pytest.raises(UnsupportedClientError):
        AsyncDMutex("svc", sync)  # type: ignore[arg-type]  # the wrong face, on purpose
    with pytest.raises(UnsupportedClientError):
        DMutex("svc", asynchronous)  # type: ignore[arg-type]  # the wrong face, on purpose
    with pytest.raises(InvalidArgumentError, match="replicas"):
        DMutex("svc", sync, replicas=1)
    with pytest.raises(InvalidArgumentError, match="layout"):
        DMutex("x:permit:0", sync)


@pytest.mark.parametrize(
    ("url", "found"),
    [
        ("etcd://h", [("h", 2379)]),
        ("etcd://h:1,[::1]:2", [("h", 1), ("::1", 2)]),
        ("etcd://a:1,b:2/", [("a", 1), ("b", 2)]),
    ],
)
def test_etcd_urls_name_one_endpoint_or_several(url: str, found: list[tuple[str, int]]) -> None:
    assert endpoints(url) == found


@pytest.mark.parametrize(
    "url", ["etcd://u:p@h:1", "etcd://h:1/x", "etcd://h:1?a=b", "etcd://h:99999", "etcd://h:1,"]
)
def test_bad_etcd_urls_are_refused_before_any_io(url: str) -> None:
    with pytest.raises(BadURL) as caught:
        endpoints(url)
    assert ":p@" not in str(caught.value)


class Unreached(Exception):
    """Stands in for etcd3gw's ConnectionFailedError."""


class Member:
    """One member's etcd3gw-shaped client, answering or failing every request."""

    def __init__(self, name: str, fails: bool) -> None:
        self.name, self.fails = name, fails
        self.sent: list[str] = []

    def get_url(self, path: str) -> str:
        return f"http://{self.name}/v3{path}"

    def post(self, url: str, *, json: Mapping[str, object]) -> object:
        self.sent.append(url)
        if self.fails:
            raise Unreached(url)
        return {"member": self.name}


def test_the_commands_endpoints_go_on_to_the_next_member_and_stay_there() -> None:
    first, second = Member("a", fails=True), Member("b", fails=False)
    members = Endpoints([first, second], (Unreached,))
    assert members.post(members.get_url("/kv/txn"), json={}) == {"member": "b"}
    assert members.post(members.get_url("/kv/txn"), json={}) == {"member": "b"}
    assert first.sent == ["http://a/v3/kv/txn"]  # left once, not asked again
    assert second.sent == ["http://b/v3/kv/txn"] * 2
    second.fails = True
    with pytest.raises(Unreached):
        members.post("/kv/txn", json={})
    assert detect(members, None) == "etcd"


class ByLease:
    """An etcd3gw-shaped client answering keep-alives by lease ID, from any thread."""

    def __init__(self, ttl: dict[int, int | Exception]) -> None:
        self.ttl = ttl
        self.paths: list[str] = []
        self._lock = threading.Lock()

    def get_url(self, path: str, /) -> str:
        return path

    def post(self, url: str, /, *, json: Mapping[str, Any]) -> object:
        with self._lock:
            self.paths.append(url)
        if url == "/kv/txn":
            return {"header": {"revision": "9"}, "succeeded": True}
        answer = self.ttl[int(json["ID"])]
        if isinstance(answer, Exception):
            raise answer
        return {"result": {"TTL": str(answer)}} if answer else {"result": {}}

    def watch_once(self, key: bytes, /, timeout: float, **options: Any) -> object:
        raise AssertionError("no watch here")


def test_a_renewal_sends_every_keep_alive_at_once_and_each_lease_gets_its_own_answer() -> None:
    leases = [Lease(key, "t", 0, 0, ttl_ms=30_000) for key in ("a", "b", "c", "d")]
    failed = OSError("cut")
    ids = [lease_id(PERMIT, "p:", lease.key, "t") for lease in leases]
    client = ByLease({ids[0]: 30, ids[1]: 0, ids[2]: failed, ids[3]: 30})
    leases[3].ended = True  # released meanwhile: no request
    store = EtcdStore(Gateway(client), "p:", 1, SYSTEM_CLOCK)
    before = round(time.time() * 1000)
    answers = SyncDriver(store.clock, store.ready)(store.extend_many(leases))
    after = round(time.time() * 1000)
    first, gone, error, ended = answers
    assert isinstance(first, int)
    assert before + 30_000 <= first <= after + 30_000
    assert gone is None  # its lease is gone, and no slot holds the token
    assert error is failed
    assert ended is None
    # Three keep-alives together, then the gone one's own (the general path) and its read.
    assert sorted(client.paths[:3]) == ["/lease/keepalive"] * 3
    assert client.paths[3:] == ["/lease/keepalive", "/kv/txn"]

"""The holes of ``test_holes.py`` on etcd (1, 2, 7 and 8), each made to happen on purpose.

On a real etcd member (``etcd_session``), every lock's keys under a prefix
of the test's own within the session's. A hold is a slot key under an etcd
lease whose ID dmutex derives from the key and the token
(``dmutex/_backends/etcd/store.py``): an acquire is the lease's grant, then
one transaction that puts the slot key; a release is the lease's revoke.
What is left is read behind dmutex's back, through the gateway: the keys
under the test's prefix, and whether the hold's lease is still alive.

- Hole 1: a cancellation that lands while ``run()``'s release,
  ``__aexit__``'s release (after a first cancellation in the body), or an
  acquire's grant or transaction is held by :class:`GatedEtcd`, before it
  is sent or after the server applied it. The cancellation must propagate,
  and nothing may be left held by nobody: a release runs to the end, an
  acquire revokes its token's lease (engine rule 6). And a waiter cancelled
  as the release it watches for wakes it must end cancelled: aetcd's
  ``watch_once`` waits through ``asyncio.wait_for``, which on Python <= 3.11
  returns the event and swallows the cancellation (CPython gh-86296), so the
  store runs it in a task of its own and waits with ``asyncio.wait``
  (before, the waiter went on to take the lock).
- Hole 2: a grant whose reply is lost (:class:`LosingEtcd`): the lease's
  grant, or the transaction, reaches the server and a connection error
  comes back. The store's next attempt with the same token (the engine
  keeps one token for a retrying acquire's attempts) must find its own
  hold, by its lease ID (store rule 3): one key, not two, for a semaphore
  too. Through the public API the same lost reply raises, and the
  acquire's undo leaves nothing. And a transport that re-sends the grant's
  transaction itself (as redis-py does after a connection error): the copy
  finds the slot taken by its own lease, and the store answers with that
  hold (before, a mutex answered None and revoked its own hold, and a
  semaphore took a second slot).
- Hole 7: etcd3gw's sync client given to an asyncio class, and aetcd's
  given to a sync class, are refused when the lock is made, before the
  client sends anything (its HTTP session saw nothing; aetcd never opened
  its channel).
- Hole 8: a release whose reply is lost and that is re-sent, through aetcd
  and through etcd3gw: the first copy revokes the lease (deleting the key),
  the second finds none and answers False after one read; nothing else
  changes (the server's revision moved once, another hold is untouched).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aetcd
import etcd3gw
import pytest
import requests

from dmutex import (
    AsyncDMutex,
    AsyncDSemaphore,
    DMutex,
    DSemaphore,
    UnsupportedClientError,
)
from dmutex._backends.etcd.leases import lease_id
from dmutex._backends.etcd.shapes import dialect
from dmutex._backends.etcd.store import PERMIT, EtcdStore
from dmutex._clock import SYSTEM_CLOCK
from dmutex._runtime.drivers import AsyncDriver
from tests._support.etcd_fault_clients import (
    EtcdWrapper,
    GatedEtcd,
    LosingEtcd,
    ResendingGateway,
    keys_under,
    lease_keys,
    records_under,
    revision,
)
from tests._support.etcd_servers import Endpoint, Session, delete_prefix

TIMEOUT = 20.0  # seconds, each scenario at most

Lock = AsyncDMutex | AsyncDSemaphore


@dataclass(frozen=True)
class Etcd:
    """The test's etcd: its endpoint and its own prefix, under the session's."""

    endpoint: Endpoint
    prefix: str

    def key_prefix(self, permits: int) -> str:
        return f"{self.prefix}{'_dmutex_' if permits == 1 else '_dsemaphore_'}svc:"

    def slot_key(self, permits: int, slot: int, key: str = "k") -> str:
        return f"{self.key_prefix(permits)}permit:{slot}:{key}"

    def keys(self) -> dict[str, str]:
        """Every key under the test's prefix, and its value (a holder's token)."""
        return keys_under(self.endpoint, self.prefix)

    def lease_alive(self, permits: int, token: str, key: str = "k") -> bool:
        """Whether the lease of ``token``'s hold of ``key`` exists (dmutex derives its ID)."""
        lease = lease_id(PERMIT, self.key_prefix(permits), key, token)
        return lease_keys(self.endpoint, lease) is not None

    def lock(self, client: Any, permits: int) -> Lock:
        if permits == 1:
            return AsyncDMutex("svc", client, key_prefix=self.key_prefix(permits))
        return AsyncDSemaphore(
            "svc", client, max_permits=permits, key_prefix=self.key_prefix(permits)
        )

    def sync_lock(self, client: Any, permits: int) -> DMutex | DSemaphore:
        if permits == 1:
            return DMutex("svc", client, key_prefix=self.key_prefix(permits))
        return DSemaphore("svc", client, max_permits=permits, key_prefix=self.key_prefix(permits))

    def aetcd(self) -> aetcd.Client:
        return aetcd.Client(host=self.endpoint.host, port=self.endpoint.port, timeout=10)

    def etcd3gw(self, session: requests.Session | None = None) -> etcd3gw.Etcd3Client:
        host, port = self.endpoint.host, self.endpoint.port
        return etcd3gw.Etcd3Client(host=host, port=port, timeout=10, session=session)


@pytest.fixture
def etcd(etcd_session: Session) -> Iterator[Etcd]:
    """The session's etcd, emptied, and a prefix of the test's own; emptied again after."""
    server = etcd_session.fresh()
    endpoint = server.endpoints[0]
    yield Etcd(endpoint, f"{etcd_session.prefix}holes-{uuid.uuid4().hex[:8]}/")
    delete_prefix(endpoint, etcd_session.prefix)


@asynccontextmanager
async def connected(etcd: Etcd) -> AsyncIterator[aetcd.Client]:
    """An aetcd client, connected first (aetcd connects on its first request otherwise)."""
    client = etcd.aetcd()
    await client.connect()
    try:
        yield client
    finally:
        await client.close()


def on_etcd(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), TIMEOUT))


# --- hole 1: cancellation while a request is held ------------------------------------------

# Where GatedEtcd holds the request: before it is sent, or after the server applied it.
WHEN = ["unsent", "applied"]


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("permits", [1, 3])
def test_run_cancelled_during_its_release_still_releases(
    etcd: Etcd, permits: int, when: str
) -> None:
    """``run()`` cancelled while its revoke is held: it waits for the revoke, then raises."""
    before = when == WHEN[0]

    async def scenario() -> None:
        async with connected(etcd) as inner:
            client = GatedEtcd(inner)
            lock = etcd.lock(client, permits)
            tokens: list[str] = []

            async def work(handle: Any) -> str:
                tokens.append(handle.token)
                client.hold("revoke_lease", before=before)  # the next request is the release
                return "done"

            task = asyncio.create_task(lock.run("k", work))
            await client.arrived.wait()
            # Held unsent, the key is still there; applied, the server deleted it.
            assert etcd.keys() == ({etcd.slot_key(permits, 0): tokens[0]} if before else {})
            task.cancel()
            await asyncio.sleep(0)
            assert not task.done(), "the release is held: run() waits for it"
            client.gate.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert client.sent == ["lease", "transaction", "revoke_lease"]
            assert etcd.keys() == {}
            assert not etcd.lease_alive(permits, tokens[0])

    on_etcd(scenario)


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("permits", [1, 3])
def test_async_with_cancelled_in_body_and_again_during_release(
    etcd: Etcd, permits: int, when: str
) -> None:
    """``__aexit__`` releases to the end even if a second cancellation lands meanwhile."""
    before = when == WHEN[0]

    async def scenario() -> None:
        async with connected(etcd) as inner:
            client = GatedEtcd(inner)
            lock = etcd.lock(client, permits)
            inside = asyncio.Event()
            tokens: list[str] = []

            async def body() -> None:
                handle = await lock.acquire("k")
                assert handle is not None
                tokens.append(handle.token)
                async with handle:
                    client.hold("revoke_lease", before=before)
                    inside.set()
                    await asyncio.sleep(3600)  # cancelled here first

            task = asyncio.create_task(body())
            await inside.wait()
            task.cancel()  # lands in the body; __aexit__ starts the release
            await client.arrived.wait()
            task.cancel()  # lands while the release is held
            await asyncio.sleep(0)
            assert not task.done()
            client.gate.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert client.sent == ["lease", "transaction", "revoke_lease"]
            assert etcd.keys() == {}
            assert not etcd.lease_alive(permits, tokens[0])

    on_etcd(scenario)


# What reached the server, by the request held and when; the last request is the undo.
ACQUIRE_HELD = {
    # Never sent: the undo's revoke finds no lease, and reads the slots (leases.py, rule 4).
    ("lease", WHEN[0]): ["revoke_lease", "transaction"],
    # The lease exists, no key yet: the undo revokes it.
    ("lease", WHEN[1]): ["lease", "revoke_lease"],
    ("transaction", WHEN[0]): ["lease", "revoke_lease"],
    # The server put the key: the undo's revoke deletes it.
    ("transaction", WHEN[1]): ["lease", "transaction", "revoke_lease"],
}


@pytest.mark.parametrize(("method", "when"), list(ACQUIRE_HELD))
@pytest.mark.parametrize("permits", [1, 3])
def test_an_acquire_cancelled_while_its_request_is_held_leaves_nothing(
    etcd: Etcd, permits: int, method: str, when: str
) -> None:
    """The grant or the transaction held, before it is sent or after the server applied it:
    the cancellation propagates, and the acquire's undo revokes its token's lease."""
    before = when == WHEN[0]

    async def scenario() -> None:
        async with connected(etcd) as inner:
            client = GatedEtcd(inner)
            lock = etcd.lock(client, permits)
            client.hold(method, before=before)
            task = asyncio.create_task(lock.acquire("k"))
            await client.arrived.wait()
            taken = etcd.keys()
            if (method, when) == ("transaction", WHEN[1]):
                assert list(taken) == [etcd.slot_key(permits, 0)], "the server took the key"
            else:
                assert taken == {}
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            client.gate.set()  # nothing waits there any more
            assert client.sent == ACQUIRE_HELD[method, when]
            assert etcd.keys() == {}
            for token in taken.values():
                assert not etcd.lease_alive(permits, token)

    on_etcd(scenario)


def cancel_as_a_watch_event_arrives(inner: aetcd.Client, task: asyncio.Task[Any]) -> list[object]:
    """Make aetcd cancel ``task`` as it hands a watch's event to the watch: both at once.

    aetcd's watcher delivers an event by calling the watch's callback (a put
    into the queue its ``watch_once`` waits on); ``task`` is cancelled right
    after, before the watch's ``asyncio.wait_for`` has run again. Returns the
    events delivered so.
    """
    watcher = vars(inner)["_watcher"]  # aetcd's, made by connect()
    add: Callable[..., Awaitable[object]] = watcher.add_callback
    heard: list[object] = []

    async def add_callback(
        key: bytes, callback: Callable[..., Awaitable[None]], **options: Any
    ) -> object:
        async def deliver(event: object) -> None:
            await callback(event)
            heard.append(event)
            task.cancel()

        return await add(key, deliver, **options)

    watcher.add_callback = add_callback
    return heard


def test_a_waiter_cancelled_as_the_release_wakes_it_raises(etcd: Etcd) -> None:
    """A retrying acquire watches the holder's slot key; the holder's release wakes the watch
    and the waiter is cancelled at that moment: it must end cancelled, holding nothing."""

    async def scenario() -> None:
        async with connected(etcd) as inner:
            holder = etcd.lock(inner, 1)
            held = await holder.acquire("k", ttl=60)
            assert held is not None
            client = GatedEtcd(inner)
            waiter = etcd.lock(client, 1)
            client.hold("watch_once", before=True)
            task = asyncio.create_task(waiter.acquire_with_retry("k", timeout=30, retry_delay=20))
            heard = cancel_as_a_watch_event_arrives(inner, task)
            await client.arrived.wait()  # the attempt failed: the waiter watches the key
            client.gate.set()
            assert await held.release() is True  # the deletion wakes the watch
            try:
                taken = await asyncio.wait_for(task, 10)
            except asyncio.CancelledError:
                taken = None
            else:
                assert taken is not None
                await taken.release()  # the waiter went on and took the lock: give it back
            assert len(heard) == 1, "the release woke the watch"
            assert taken is None, "the cancellation was swallowed: the waiter took the lock"
            assert etcd.keys() == {}

    on_etcd(scenario)


# --- hole 2: a grant's reply lost, the grant re-sent ---------------------------------------


def store_of(etcd: Etcd, client: EtcdWrapper, permits: int) -> tuple[EtcdStore, AsyncDriver]:
    """The store an asyncio lock of ``permits`` on ``client`` uses, and a driver of its steps."""
    store = EtcdStore(dialect(client), etcd.key_prefix(permits), permits, SYSTEM_CLOCK)
    return store, AsyncDriver(SYSTEM_CLOCK, store.ready)


@pytest.mark.parametrize("lost", ["lease", "transaction"])
@pytest.mark.parametrize("permits", [1, 3])
def test_the_next_attempt_with_the_token_of_a_lost_grant_finds_its_own_hold(
    etcd: Etcd, permits: int, lost: str
) -> None:
    """The grant's lease, or its transaction too, reached the server; the reply was lost.
    The next attempt with the same token finds its lease taken (store rule 3), renews it,
    reads the slots and answers with the hold it has: one key, under its lease."""

    async def scenario() -> None:
        async with connected(etcd) as inner:
            client = LosingEtcd(inner)
            store, drive = store_of(etcd, client, permits)
            token = str(uuid.uuid4())
            client.lose(lost, resend=False)
            with pytest.raises(aetcd.ConnectionFailedError):
                await drive(store.acquire("k", token, 30_000))
            assert client.lost == 1
            lease = lease_id(PERMIT, etcd.key_prefix(permits), "k", token)
            left = records_under(etcd.endpoint, etcd.prefix)
            if lost == "transaction":
                assert {name: kv.value for name, kv in left.items()} == {
                    etcd.slot_key(permits, 0): token
                }, "the server put the key"
            else:
                assert left == {}
                assert lease_keys(etcd.endpoint, lease) == [], "a lease, no key"
            client.sent.clear()
            again = await drive(store.acquire("k", token, 30_000))
            assert again is not None, "the next attempt must find its own hold"
            found = records_under(etcd.endpoint, etcd.prefix)
            name = etcd.slot_key(permits, again.slot)
            assert list(found) == [name], "one hold, not two"
            assert (found[name].value, found[name].lease) == (token, lease)
            assert again.fence == found[name].create_revision
            if lost == "transaction":
                assert again.slot == 0
                # The grant refused (its lease exists), the lease renewed, the slots read.
                assert client.sent == ["lease", "refresh_lease", "transaction"]
            else:
                # ... and no slot held: the put, as a first attempt's.
                assert client.sent == ["lease", "refresh_lease", "transaction", "transaction"]
            assert await drive(store.release("k", token, again.slot)) is True
            assert etcd.keys() == {}
            assert lease_keys(etcd.endpoint, lease) is None

    on_etcd(scenario)


@pytest.mark.parametrize("lost", ["lease", "transaction"])
@pytest.mark.parametrize("permits", [1, 3])
def test_an_acquire_whose_grant_reply_is_lost_raises_and_leaves_nothing(
    etcd: Etcd, permits: int, lost: str
) -> None:
    """Through the public API: the lost reply raises, and the acquire's undo revokes the
    lease it may have taken (engine rule 6); the next acquire gets the key."""

    async def scenario() -> None:
        async with connected(etcd) as inner:
            client = LosingEtcd(inner)
            lock = etcd.lock(client, permits)
            client.lose(lost, resend=False)
            with pytest.raises(aetcd.ConnectionFailedError):
                await lock.acquire("k")
            # The undo's revoke: the lease existed, and with it went the key, if it was put.
            sent = ["lease", "transaction"] if lost == "transaction" else ["lease"]
            assert client.sent == [*sent, "revoke_lease"]
            assert etcd.keys() == {}
            assert len(client.leases) == 1
            assert lease_keys(etcd.endpoint, client.leases[0]) is None, "the lease was revoked"
            handle = await lock.acquire("k")
            assert handle is not None
            assert await handle.release() is True

    on_etcd(scenario)


@pytest.mark.parametrize("permits", [1, 3])
def test_a_grant_transaction_re_sent_by_the_transport_returns_its_one_hold(
    etcd: Etcd, permits: int
) -> None:
    """Redis's hole 2 exactly: the transport sends the transaction again after its reply was
    lost (as redis-py does after a connection error); the copy must answer the hold."""

    async def scenario() -> None:
        async with connected(etcd) as inner:
            client = LosingEtcd(inner)
            lock = etcd.lock(client, permits)
            client.lose("transaction", resend=True)
            handle = await lock.acquire("k")
            try:
                assert client.lost == 1
                assert handle is not None, "the first copy took the key: the copy must say so"
                assert etcd.keys() == {etcd.slot_key(permits, 0): handle.token}, "one slot"
            finally:
                if handle is not None:
                    await handle.release()
                assert etcd.keys() == {}

    on_etcd(scenario)


# --- hole 7: a client of the other face ----------------------------------------------------


class RecordingSession(requests.Session):
    """An HTTP session that lists every request etcd3gw sends through it."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[str] = []

    def request(self, method: str, url: Any, *args: Any, **kwargs: Any) -> requests.Response:
        self.requests.append(f"{method} {url}")
        return super().request(method, url, *args, **kwargs)


def test_an_asyncio_class_refuses_etcd3gw_before_any_request(etcd: Etcd) -> None:
    """Refused when the lock is made: etcd3gw's session sent nothing (not even its version
    probe), nothing was written; the sync classes take the same client, through it."""
    session = RecordingSession()
    client = etcd.etcd3gw(session)
    given: Any = client  # the type checker refuses it too: the test is what dmutex does
    try:
        makers: list[Callable[[], object]] = [
            lambda: etcd.lock(given, 1),
            lambda: etcd.lock(given, 2),
        ]
        for make in makers:
            with pytest.raises(UnsupportedClientError, match="is a sync client"):
                make()
        assert session.requests == []
        assert etcd.keys() == {}
        for permits in (1, 2):
            handle = etcd.sync_lock(client, permits).acquire("k")
            assert handle is not None
            assert handle.release() is True
        assert session.requests, "the session sees etcd3gw's requests"
    finally:
        session.close()


def test_a_sync_class_refuses_aetcd_before_any_request(etcd: Etcd) -> None:
    """Refused when the lock is made: aetcd never opened its channel (it does on its first
    request); the asyncio classes take the same client."""
    client = etcd.aetcd()
    given: Any = client
    makers: list[Callable[[], object]] = [
        lambda: etcd.sync_lock(given, 1),
        lambda: etcd.sync_lock(given, 2),
    ]
    for make in makers:
        with pytest.raises(UnsupportedClientError, match="is an asyncio client"):
            make()
    assert vars(client)["channel"] is None, "aetcd connected: a request was on its way"
    assert etcd.keys() == {}

    async def scenario() -> None:
        try:
            for permits in (1, 2):
                handle = await etcd.lock(client, permits).acquire("k")
                assert handle is not None
                assert await handle.release() is True
        finally:
            await client.close()

    on_etcd(scenario)


# --- hole 8: a release's reply lost, the release re-sent -----------------------------------


@pytest.mark.parametrize("permits", [1, 3])
def test_a_re_sent_aetcd_release_answers_false_and_changes_nothing_more(
    etcd: Etcd, permits: int
) -> None:
    """The first copy of the revoke deletes the key, the second finds no lease and answers
    False after reading the slots: the permit is released either way (False never means
    "still yours"); the server changed once, and another hold is untouched."""

    async def scenario() -> None:
        async with connected(etcd) as inner:
            client = LosingEtcd(inner)
            lock = etcd.lock(client, permits)
            # Another hold: of the same key for a semaphore, of another key for a mutex.
            other = await lock.acquire("k" if permits > 1 else "other")
            handle = await lock.acquire("k")
            assert other is not None
            assert handle is not None
            kept = {name: token for name, token in etcd.keys().items() if token == other.token}
            before = revision(etcd.endpoint)
            client.sent.clear()
            client.lose("revoke_lease", resend=True)
            assert await handle.release() is False, "the re-sent copy found nothing"
            assert client.lost == 1
            assert client.sent == ["revoke_lease", "revoke_lease", "transaction"]
            assert revision(etcd.endpoint) == before + 1, "one change: the first copy's delete"
            assert etcd.keys() == kept
            assert not etcd.lease_alive(permits, handle.token)
            assert await other.release() is True
            assert etcd.keys() == {}

    on_etcd(scenario)


@pytest.mark.parametrize("permits", [1, 3])
def test_a_re_sent_etcd3gw_release_answers_false_and_changes_nothing_more(
    etcd: Etcd, permits: int
) -> None:
    """The same through etcd3gw's gateway, on the sync classes."""
    inner = etcd.etcd3gw()
    try:
        client = ResendingGateway(inner)
        lock = etcd.sync_lock(client, permits)
        other = lock.acquire("k" if permits > 1 else "other")
        handle = lock.acquire("k")
        assert other is not None
        assert handle is not None
        kept = {name: token for name, token in etcd.keys().items() if token == other.token}
        before = revision(etcd.endpoint)
        client.posts.clear()
        client.resend("/kv/lease/revoke")
        assert handle.release() is False, "the re-sent copy found nothing"
        assert client.resends == 1
        assert client.posts == ["kv/lease/revoke", "kv/lease/revoke", "kv/txn"]
        assert revision(etcd.endpoint) == before + 1, "one change: the first copy's delete"
        assert etcd.keys() == kept
        assert not etcd.lease_alive(permits, handle.token)
        assert other.release() is True
        assert etcd.keys() == {}
    finally:
        inner.session.close()

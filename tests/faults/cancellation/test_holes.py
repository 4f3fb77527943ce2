"""The holes the fault probes found, each pinned by a deterministic test.

Issue 10 lists eight; the randomised suites (proxy, pause,
restart, cancellation, parameters) look for them by chance, these tests
make each one happen on purpose:

- hole 1: a cancellation that lands while ``run()``'s release, ``__aexit__``'s
  release, or an acquire's request is in flight;
- hole 2: an acquire whose reply is lost and that the client re-sends, as
  redis-py and valkey-py do after a connection error (and pymongo's retryable
  writes where the server does not deduplicate them);
- hole 7: a sync client given to an asyncio class;
- hole 8: a release whose reply is lost and that the client re-sends.

Holes 3 and 4 are pinned in ``tests/integration/test_redis_layout.py``,
holes 5 and 6 in ``tests/test_bad_input.py``.

On PostgreSQL (the section at the end): hole 1 on a psycopg
``AsyncConnection`` and an asyncpg connection whose replies a
:class:`~tests._support.postgres_clients.Gate` holds (the same scenes as
Redis's ``GatedRedis``, itself a ``Gate``), and two listening waits that
swallowed their cancellation before their fixes: one cancelled as the
release's notification reaches it, one on an asyncpg pool whose reset of
the wait's connection outlasts the wait; hole 7 for psycopg's
sync connection and pool, the server seeing no statement from them; hole 8,
the release statement sent twice. Hole 2 on PostgreSQL is
``tests/integration/test_postgres_store.py``'s
``test_a_resent_acquire_recognises_its_own_token``, on the store.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import asyncpg
import mongomock
import psycopg
import psycopg_pool
import pymongo
import pytest
import redis
import redis.asyncio
import valkey

from dmutex import (
    AsyncDMutex,
    AsyncDSemaphore,
    DMutex,
    DSemaphore,
    InMemoryBackend,
    RedisArg,
    RedisReply,
    UnsupportedClientError,
)
from dmutex._backends.postgresql.statements import Statements
from tests._support.mongo_clients import frozen_ttl_monitor
from tests._support.postgres_clients import (
    Gate,
    InterceptedAsyncpg,
    InterceptedPsycopg,
    active_permits,
)

# --- hole 2 and 8: a reply lost, the command re-sent ---------------------------------


class ResendingRedis:
    """redis-py underneath; each script request is sent twice, the first reply lost.

    That is what redis-py's retry does when a connection drops after the
    server executed a command: it sends the same command again and returns
    the second reply.
    """

    def __init__(self, inner: redis.Redis) -> None:
        # redis-py leaves execute_command unannotated; this is its sync signature.
        self._send: Callable[..., RedisReply] = inner.execute_command
        self.resent = 0

    def execute_command(self, *args: RedisArg) -> RedisReply:
        if args[0] in ("EVALSHA", "EVAL"):
            try:
                self._send(*args)  # executed; its reply never arrives
            except redis.exceptions.NoScriptError:
                pass  # not executed either: the re-sent copy meets the same answer
            else:
                self.resent += 1
        return self._send(*args)


class AsyncResendingRedis:
    """The asyncio twin of :class:`ResendingRedis`."""

    def __init__(self, inner: redis.asyncio.Redis) -> None:
        self._send: Callable[..., Awaitable[object]] = inner.execute_command
        self.resent = 0

    async def execute_command(self, *args: RedisArg) -> object:
        if args[0] in ("EVALSHA", "EVAL"):
            try:
                await self._send(*args)
            except redis.exceptions.NoScriptError:
                pass
            else:
                self.resent += 1
        return await self._send(*args)


@pytest.fixture
def admin(redis_url: str) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        yield client


def permit_keys(admin: redis.Redis) -> dict[str, str]:
    return {str(name): str(admin.get(name)) for name in admin.keys("*permit:*")}


@pytest.mark.parametrize("permits", [1, 2, 5])
def test_a_re_sent_redis_acquire_returns_its_lease_and_takes_one_slot(
    redis_url: str, admin: redis.Redis, permits: int
) -> None:
    """Before the fix: a mutex said None on a free key; a semaphore took two slots."""
    with redis.Redis.from_url(redis_url) as inner:
        client = ResendingRedis(inner)
        lock = (
            DSemaphore("svc", client, max_permits=permits) if permits > 1 else DMutex("svc", client)
        )
        handle = lock.acquire("k")
        assert client.resent >= 1
        assert handle is not None, "the first copy took the key: the re-sent one must say so"
        assert permit_keys(admin) == {f"{lock_prefix(permits)}permit:0:k": handle.token}
        # Hole 8, decided: the first copy of a release deletes the key, the
        # re-sent copy finds nothing and answers False. The permit is released
        # either way; False never means "still yours".
        assert handle.release() is False
        assert permit_keys(admin) == {}


def lock_prefix(permits: int) -> str:
    return "_dmutex_svc:" if permits == 1 else "_dsemaphore_svc:"


@pytest.mark.parametrize("permits", [1, 3])
def test_a_re_sent_async_redis_acquire_returns_its_lease(
    redis_url: str, admin: redis.Redis, permits: int
) -> None:
    async def scenario() -> None:
        inner = redis.asyncio.Redis.from_url(redis_url)
        try:
            client = AsyncResendingRedis(inner)
            lock: AsyncDMutex | AsyncDSemaphore = (
                AsyncDSemaphore("svc", client, max_permits=permits)
                if permits > 1
                else AsyncDMutex("svc", client)
            )
            handle = await lock.acquire("k")
            assert client.resent >= 1
            assert handle is not None
            assert permit_keys(admin) == {f"{lock_prefix(permits)}permit:0:k": handle.token}
            assert await handle.extend(30) is True, "extend is idempotent: True both times"
            assert await handle.release() is False
            assert permit_keys(admin) == {}
        finally:
            await inner.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 20))


class ResendingCollection:
    """A MongoDB collection whose writes are applied twice, the first reply lost."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.resent = 0

    def create_index(self, *args: Any, **kwargs: Any) -> object:
        return self._inner.create_index(*args, **kwargs)

    def distinct(self, *args: Any, **kwargs: Any) -> object:
        return self._inner.distinct(*args, **kwargs)

    def update_one(self, *args: Any, **kwargs: Any) -> object:
        return self._twice(self._inner.update_one, args, kwargs)

    def delete_one(self, *args: Any, **kwargs: Any) -> object:
        return self._twice(self._inner.delete_one, args, kwargs)

    def insert_one(self, *args: Any, **kwargs: Any) -> object:
        return self._inner.insert_one(*args, **kwargs)

    def _twice(self, call: Callable[..., object], args: Any, kwargs: Any) -> object:
        try:
            call(*args, **kwargs)
        except pymongo.errors.DuplicateKeyError:
            pass  # the first copy was refused: the second meets the same state
        else:
            self.resent += 1
        return call(*args, **kwargs)


class ResendingMongo:
    """A client whose every collection is a :class:`ResendingCollection`."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.collections: list[ResendingCollection] = []

    def get_database(self, name: str, /) -> Any:
        return ResendingMongo(self._inner.get_database(name))

    def get_collection(self, name: str, /) -> Any:
        collection = ResendingCollection(self._inner.get_collection(name))
        self.collections.append(collection)
        return collection


@pytest.mark.parametrize("permits", [1, 3])
def test_a_re_sent_mongodb_acquire_returns_its_lease_and_takes_one_slot(
    permits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On mongomock; the same filter runs on the real-server suite (test_mongo_real)."""
    # mongomock's TTL imitation calls datetime.utcnow(), deprecated since 3.12;
    # nothing here expires, so holding it still changes nothing.
    monkeypatch.setattr(mongomock, "utcnow", frozen_ttl_monitor)
    inner: mongomock.MongoClient[dict[str, object]] = mongomock.MongoClient()
    client = ResendingMongo(inner)
    lock = DSemaphore("svc", client, max_permits=permits) if permits > 1 else DMutex("svc", client)
    handle = lock.acquire("k")
    assert handle is not None, "the first copy took the slot: the re-sent one must say so"
    collection = inner.get_database("dmutex").get_collection(
        "_dmutex_svc" if permits == 1 else "_dsemaphore_svc"
    )
    documents = list(collection.find())
    assert [(d["_id"], d["value"]) for d in documents] == [
        (f"permit:{getattr(handle, 'slot', 0)}:k", handle.token)
    ]
    assert handle.release() is False, "hole 8, decided: the re-sent copy found nothing"
    assert list(collection.find()) == []


# --- hole 1: cancellation while a request is in flight ---------------------------------


class GatedRedis(Gate):
    """An asyncio Redis double (fakeredis semantics) that can hold one command mid-flight.

    ``hold()`` makes the next script request (EVALSHA, or the EVAL after a
    NOSCRIPT) execute on the server and then wait for ``gate`` before
    returning its reply: the moment a cancellation can land between "done on
    the server" and "reply read". ``scripts`` counts the scripts executed.
    """

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self._inner = inner

    @property
    def scripts(self) -> int:
        return self.sent

    async def execute_command(self, *args: RedisArg) -> object:
        send: Callable[[], Awaitable[object]] = lambda: self._inner.execute_command(*args)  # noqa: E731
        if args[0] in ("EVALSHA", "EVAL"):
            return await self.send(args, send)  # a NOSCRIPT raises before it is counted
        return await send()


@pytest.fixture
def fake_async() -> Any:
    fakeredis = pytest.importorskip("fakeredis")
    return fakeredis.FakeAsyncRedis(decode_responses=True)


async def keys_left(client: Any) -> list[str]:
    names: list[str] = await client.keys("*permit:*")
    return names


Lock = AsyncDMutex | AsyncDSemaphore


async def release_held_in_run(mutex: Lock, gate: Gate) -> None:
    """``run()`` cancelled while its release's reply is held: it waits for it, then raises."""

    async def work(lock: object) -> str:
        gate.hold()  # the next request is the release
        return "done"

    task = asyncio.create_task(mutex.run("k", work))
    await gate.arrived.wait()  # acquired, called back; the release is held mid-flight
    task.cancel()
    await asyncio.sleep(0)
    assert not task.done(), "the release is still in flight: run() waits for it"
    gate.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task


async def release_held_in_aexit(mutex: Lock, gate: Gate) -> None:
    """Cancelled in the body, and again while ``__aexit__``'s release is held: it releases."""
    await mutex.ready()
    gate.sent = 0
    inside = asyncio.Event()

    async def body() -> None:
        lock = await mutex.acquire("k")
        assert lock is not None
        async with lock:
            gate.hold()
            inside.set()
            await asyncio.sleep(3600)  # cancelled here first

    task = asyncio.create_task(body())
    await inside.wait()
    task.cancel()  # lands in the body; __aexit__ starts the release
    await gate.arrived.wait()
    task.cancel()  # lands while the release is held mid-flight
    await asyncio.sleep(0)
    assert not task.done()
    gate.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.sent == 2, "the acquire and the release"


async def acquire_held(lock: Lock, gate: Gate, held: Callable[[], Awaitable[int]]) -> None:
    """An acquire cancelled while its reply is held, the key taken (``held()`` permits)."""
    await lock.ready()
    gate.sent = 0
    gate.hold()
    task = asyncio.create_task(lock.acquire("k"))
    await gate.arrived.wait()
    assert await held() == 1, "the server took the key"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.sent == 2, "the acquire, then its release by token"


def test_run_cancelled_during_its_release_still_releases(fake_async: Any) -> None:
    """Before the fix the release was abandoned: the key kept its full TTL."""

    async def scenario() -> None:
        client = GatedRedis(fake_async)
        await release_held_in_run(AsyncDMutex("svc", client), client)
        assert await keys_left(fake_async) == []

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_async_with_cancelled_in_body_and_again_during_release(fake_async: Any) -> None:
    """``__aexit__`` releases to the end even if a second cancellation lands meanwhile."""

    async def scenario() -> None:
        client = GatedRedis(fake_async)
        await release_held_in_aexit(AsyncDMutex("svc", client), client)
        assert await keys_left(fake_async) == []

    asyncio.run(asyncio.wait_for(scenario(), 20))


@pytest.mark.parametrize("permits", [1, 3])
def test_an_acquire_cancelled_after_the_server_took_the_key_releases_it(
    fake_async: Any, permits: int
) -> None:
    """The request reached the server, the reply did not reach the caller: released by token."""

    async def held() -> int:
        return len(await keys_left(fake_async))

    async def scenario() -> None:
        client = GatedRedis(fake_async)
        lock: Lock = (
            AsyncDSemaphore("svc", client, max_permits=permits)
            if permits > 1
            else AsyncDMutex("svc", client)
        )
        await acquire_held(lock, client, held)
        assert await keys_left(fake_async) == []

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_a_cancellation_before_any_request_sends_nothing() -> None:
    """Cancelled while waiting between retries: no request was in flight, none is sent."""

    async def scenario() -> None:
        backend = InMemoryBackend()
        holder = AsyncDMutex("svc", backend)
        held = await holder.acquire("k", ttl=60)
        assert held is not None
        waiter = AsyncDMutex("svc", backend)
        task = asyncio.create_task(waiter.acquire_with_retry("k", timeout=60, retry_delay=30))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [token for token, _ in backend.snapshot().values()] == [held.token]

    asyncio.run(asyncio.wait_for(scenario(), 20))


# --- hole 7: a sync client given to an asyncio class ------------------------------------


@pytest.mark.parametrize("make", ["redis", "valkey", "cluster", "pymongo"])
def test_an_asyncio_class_refuses_a_sync_client_before_any_request(
    make: str, redis_url: str, admin: redis.Redis
) -> None:
    """Before the fix: AsyncDMutex sent the SET, then refused the reply; the key stayed 300 s."""
    client: Any
    if make == "redis":
        client = redis.Redis.from_url(redis_url)
    elif make == "valkey":
        client = valkey.Valkey.from_url(redis_url)
    elif make == "cluster":
        client = redis.cluster.RedisCluster.__new__(redis.cluster.RedisCluster)
    else:
        client = pymongo.MongoClient("mongodb://127.0.0.1:1", connect=False)
    calls_before = admin.info("commandstats")
    makers: list[Callable[[], object]] = [
        lambda: AsyncDMutex("svc", client),
        lambda: AsyncDSemaphore("svc", client, max_permits=2),
    ]
    for make_lock in makers:
        with pytest.raises(UnsupportedClientError, match="sync"):
            make_lock()
    after = admin.info("commandstats")
    sent = {
        name: s["calls"] - calls_before.get(name, {"calls": 0})["calls"]
        for name, s in after.items()
    }
    assert {name: n for name, n in sent.items() if n and name != "cmdstat_info"} == {}
    assert permit_keys(admin) == {}
    if make in ("redis", "valkey"):
        client.close()


def test_the_sync_classes_still_take_those_clients(redis_url: str) -> None:
    with redis.Redis.from_url(redis_url) as client:
        lock = DMutex("svc", client).acquire(str(uuid.uuid4()))
        assert lock is not None
        assert lock.release() is True


# --- PostgreSQL ----------------------------------------------------------------------------


@pytest.fixture
def pg_raw(postgres_server: str) -> Iterator[psycopg.Connection[Any]]:
    """A plain autocommit connection, to read the tables behind dmutex's back."""
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        yield conn


@pytest.fixture
def service() -> str:
    """A service name of the test's own: its tables are new."""
    return f"holes-{uuid.uuid4().hex[:8]}"


def pg_tables(service: str) -> list[str]:
    return [f"_dmutex_{service}", f"_dsemaphore_{service}"]


PG_GATED = ["psycopg", "asyncpg"]


async def gated(kind: str, url: str, gate: Gate) -> tuple[Any, Callable[[], Awaitable[None]]]:
    """A single asyncio connection of ``kind`` whose replies ``gate`` holds, and its closer."""
    if kind == "psycopg":
        conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
        return InterceptedPsycopg(conn, gate), conn.close
    made = await asyncpg.connect(url)
    return InterceptedAsyncpg(made, gate), made.close


def pg_lock(client: Any, service: str, schema: str, permits: int) -> Lock:
    if permits == 1:
        return AsyncDMutex(service, client, schema_name=schema)
    return AsyncDSemaphore(service, client, max_permits=permits, schema_name=schema)


def permits_left(raw: psycopg.Connection[Any], schema: str, service: str) -> dict[str, str]:
    return active_permits(raw, schema, pg_tables(service))


def on_gated(
    kind: str,
    url: str,
    schema: str,
    service: str,
    permits: int,
    scene: Callable[[Lock, Gate], Awaitable[None]],
) -> None:
    """``scene(lock, gate)`` on a connection of ``kind`` whose replies ``gate`` holds."""

    async def scenario() -> None:
        gate = Gate()
        client, close = await gated(kind, url, gate)
        try:
            await scene(pg_lock(client, service, schema, permits), gate)
        finally:
            await close()

    asyncio.run(asyncio.wait_for(scenario(), 20))


@pytest.mark.parametrize("scene", [release_held_in_run, release_held_in_aexit])
@pytest.mark.parametrize("kind", PG_GATED)
def test_postgresql_a_release_cancelled_in_flight_still_releases(
    kind: str,
    scene: Callable[[Lock, Gate], Awaitable[None]],
    postgres_server: str,
    postgres_schema: str,
    pg_raw: Any,
    service: str,
) -> None:
    """``run()``'s release, and ``__aexit__``'s cancelled a second time, with the reply held."""
    on_gated(kind, postgres_server, postgres_schema, service, 1, scene)
    assert permits_left(pg_raw, postgres_schema, service) == {}


@pytest.mark.parametrize("permits", [1, 3])
@pytest.mark.parametrize("kind", PG_GATED)
def test_postgresql_acquire_cancelled_after_the_server_took_the_key_releases_it(
    kind: str, permits: int, postgres_server: str, postgres_schema: str, pg_raw: Any, service: str
) -> None:
    """The statement committed, its reply did not reach the caller: released by token."""

    async def held() -> int:
        return len(permits_left(pg_raw, postgres_schema, service))

    async def scene(lock: Lock, gate: Gate) -> None:
        await acquire_held(lock, gate, held)

    on_gated(kind, postgres_server, postgres_schema, service, permits, scene)
    assert permits_left(pg_raw, postgres_schema, service) == {}


class CancellingListener(InterceptedAsyncpg):
    """An asyncpg connection that cancels :attr:`task` as a notification reaches its listener.

    The listener is called first, so the wait has been woken when the
    cancellation lands: both at once, as a release and a cancel can be.
    """

    task: asyncio.Task[Any] | None = None
    heard = 0

    def __init__(self, inner: Any, gate: Gate) -> None:
        super().__init__(inner, gate)
        self._wrapped: dict[object, Callable[..., None]] = {}

    async def add_listener(self, channel: str, callback: Callable[..., None], /) -> None:
        def heard(*args: object) -> None:
            callback(*args)
            self.heard += 1
            assert self.task is not None
            self.task.cancel()

        self._wrapped[callback] = heard
        await super().add_listener(channel, heard)

    async def remove_listener(self, channel: str, callback: Callable[..., None], /) -> None:
        await super().remove_listener(channel, self._wrapped.pop(callback))


def test_postgresql_wait_cancelled_as_the_release_wakes_it_raises(
    postgres_server: str, postgres_schema: str, pg_raw: Any, service: str
) -> None:
    """Before the fix (Python <= 3.11): the wait's asyncio.wait_for returned the wakeup and
    swallowed the cancellation; the retry then took the lock and returned it."""

    async def scenario() -> None:
        gate = Gate()
        inner = await asyncpg.connect(postgres_server)
        holder_conn = await psycopg.AsyncConnection.connect(postgres_server, autocommit=True)
        try:
            client = CancellingListener(inner, gate)
            waiter = pg_lock(client, service, postgres_schema, 1)
            holder = pg_lock(holder_conn, service, postgres_schema, 1)
            held = await holder.acquire("k", ttl=60)
            assert held is not None
            task = asyncio.create_task(waiter.acquire_with_retry("k", timeout=30, retry_delay=20))
            client.task = task
            await asyncio.to_thread(idle_after_the_holders_read, pg_raw, inner.get_server_pid())
            assert await held.release() is True  # notifies the waiter, which is cancelled too
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 10)
            assert client.heard == 1
        finally:
            await inner.close()
            await holder_conn.close()
        assert permits_left(pg_raw, postgres_schema, service) == {}

    asyncio.run(asyncio.wait_for(scenario(), 30))


SLOW_RESET = 0.5  # the pool's reset of a returned connection: longer than the wait below


def test_postgresql_wait_cancelled_on_an_asyncpg_pool_raises_though_the_release_is_slow(
    postgres_server: str, postgres_schema: str, pg_raw: Any, service: str
) -> None:
    """Before the fix: the wait's connection went back with the wait's own timeout as the
    budget of its reset; spent, asyncpg raised TimeoutError from the release, which took
    the cancellation's place, and the store, taking it for a failed wait, slept on."""

    async def slow_reset(conn: object) -> None:
        await asyncio.sleep(SLOW_RESET)

    async def scenario() -> None:
        pool = await asyncpg.create_pool(postgres_server, min_size=1, max_size=2, reset=slow_reset)
        holder_conn = await psycopg.AsyncConnection.connect(postgres_server, autocommit=True)
        try:
            waiter = pg_lock(pool, service, postgres_schema, 1)
            holder = pg_lock(holder_conn, service, postgres_schema, 1)
            held = await holder.acquire("k", ttl=60)
            assert held is not None
            task = asyncio.create_task(
                waiter.acquire_with_retry("k", timeout=30, retry_delay=SLOW_RESET / 5)
            )
            await asyncio.to_thread(idle_after_the_holders_read, pg_raw)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 3 * SLOW_RESET)
            assert await held.release() is True
        finally:
            await pool.close()
            await holder_conn.close()
        assert permits_left(pg_raw, postgres_schema, service) == {}

    asyncio.run(asyncio.wait_for(scenario(), 30))


def idle_after_the_holders_read(raw: psycopg.Connection[Any], pid: int | None = None) -> None:
    """Return once session ``pid`` (None: any) sits idle after a wait's holders read.

    Only a wait reads the holders, after its LISTEN (``listening.py``, rule
    2): from then on only a notification ends it early.
    """
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for found, query in raw.execute(
            "SELECT pid, query FROM pg_stat_activity WHERE state = 'idle'"
        ).fetchall():
            if pid in (None, found) and str(query).startswith("WITH slot AS"):
                return
        time.sleep(0.005)
    raise AssertionError(f"no session ({pid or 'any'}) waited after reading the holders")


@pytest.mark.parametrize("make", ["connection", "pool"])
def test_an_asyncio_class_refuses_a_sync_postgresql_client_before_any_statement(
    make: str, postgres_server: str, postgres_schema: str, pg_raw: Any, service: str
) -> None:
    """Refused at construction: the client's session never ran a statement, no table was made."""
    client: psycopg.Connection[Any] | psycopg_pool.ConnectionPool[Any]
    if make == "connection":
        client = psycopg.connect(postgres_server, autocommit=True)
    else:
        client = psycopg_pool.ConnectionPool(postgres_server, min_size=1, max_size=1, open=True)
    given: Any = client  # the type checker refuses it too: the test is what dmutex does at run time
    try:
        makers: list[Callable[[], object]] = [
            lambda: AsyncDMutex(service, given, schema_name=postgres_schema),
            lambda: AsyncDSemaphore(service, given, max_permits=2, schema_name=postgres_schema),
        ]
        for make_lock in makers:
            with pytest.raises(UnsupportedClientError, match="sync"):
                make_lock()
        if isinstance(client, psycopg.Connection):
            pid = client.info.backend_pid
        else:
            with client.connection() as conn:
                pid = conn.info.backend_pid
        found = pg_raw.execute(
            "SELECT query FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
        assert found == ("",), f"the client's session ran {found!r}"
        tables = pg_raw.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s AND tablename LIKE %s",
            (postgres_schema, f"%{service}"),
        ).fetchall()
        assert tables == []
    finally:
        client.close()


class ResendingPsycopg:
    """A sync psycopg connection that sends each statement of ``resent`` twice, the first
    reply lost (a driver or proxy that retries after a dropped connection)."""

    def __init__(self, inner: psycopg.Connection[Any], resent: set[str]) -> None:
        self._inner = inner
        self._resent = resent
        self.resent = 0

    @property
    def info(self) -> psycopg.ConnectionInfo:
        return self._inner.info

    @property
    def autocommit(self) -> bool:
        return self._inner.autocommit

    def transaction(self) -> Any:
        return self._inner.transaction()

    def execute(
        self, query: str, params: Mapping[str, object], /, *, prepare: bool | None = None
    ) -> psycopg.Cursor[Any]:
        if query in self._resent:
            self._inner.execute(query, params, prepare=prepare)  # its reply never arrives
            self.resent += 1
        return self._inner.execute(query, params, prepare=prepare)


@pytest.mark.parametrize("permits", [1, 3])
def test_a_re_sent_postgresql_release_answers_false_and_removes_the_row(
    permits: int, postgres_server: str, postgres_schema: str, pg_raw: Any, service: str
) -> None:
    """Hole 8 as on Redis: the first copy deletes the row, the second finds none: False."""
    table = pg_tables(service)[0 if permits == 1 else 1]
    release = Statements.of(table, postgres_schema).release.psycopg
    with psycopg.connect(postgres_server, autocommit=True) as inner:
        client = ResendingPsycopg(inner, {release})
        lock = (
            DSemaphore(service, client, max_permits=permits, schema_name=postgres_schema)
            if permits > 1
            else DMutex(service, client, schema_name=postgres_schema)
        )
        handle = lock.acquire("k")
        assert handle is not None
        assert permits_left(pg_raw, postgres_schema, service) == {
            f"{table}/permit:{getattr(handle, 'slot', 0)}:k": handle.token
        }
        assert client.resent == 0
        assert handle.release() is False, "the re-sent copy found nothing"
        assert client.resent == 1
        assert permits_left(pg_raw, postgres_schema, service) == {}

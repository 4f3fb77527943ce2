"""Waiters on PostgreSQL: woken by a release's NOTIFY where the client listens, else polling.

The store is not public yet: these tests build a ``PostgresStore`` (on a
pool, an asyncpg connection or a single connection, in the run's schema)
and run the engine's ``acquire_with_retry`` with the drivers, in a thread
of its own, while the test holds and releases the lock on a plain
connection. :class:`Watched` counts the waiter's attempts and records how
each wait ended, so that "woken by the release" is counted, not timed: with
``retry_delay=30`` the wait after a failed attempt lasts at least 15 s
unless something ends it, and a wait that a notification ended is one the
store marks ``woken``.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, ClassVar

import asyncpg
import psycopg
import psycopg_pool
import pytest

from dmutex._backends.postgresql import PostgresStore
from dmutex._backends.postgresql.listening import PID_CHECK
from dmutex._backends.postgresql.statements import Statements, channel
from dmutex._clock import SYSTEM_CLOCK
from dmutex._core.effects import Steps
from dmutex._core.engine import Engine
from dmutex._core.lease import Lease
from dmutex._core.waiting import Waiter
from dmutex._runtime.drivers import AsyncDriver, SyncDriver

# A waiter that no release woke would wait at least half of this before it
# tries again: far beyond how long a test waits for it.
LONG_DELAY = 30.0


class Watched(PostgresStore):
    """A store that counts acquire attempts and records how each wait ended (woken or not)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attempts = 0
        self.waits: list[bool] = []
        self.waiting = threading.Event()

    def acquire(
        self, key: str, token: str, ttl_ms: int, waiter: Waiter | None = None
    ) -> Steps[Lease | None]:
        self.attempts += 1
        return super().acquire(key, token, ttl_ms, waiter)

    def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
        self.waiting.set()
        yield from super().wait(key, waiter, seconds)
        self.waits.append(waiter.woken)


@pytest.fixture
def raw(postgres_server: str) -> Iterator[psycopg.Connection[Any]]:
    """A plain autocommit connection: the holder's, and the test's view of the server."""
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        yield conn


def _table(raw: psycopg.Connection[Any], schema: str) -> Iterator[str]:
    name = f"_dmutex_w{uuid.uuid4().hex[:12]}"
    yield name
    raw.execute(f'DROP TABLE IF EXISTS "{schema}"."{name}"')


@pytest.fixture
def table(raw: psycopg.Connection[Any], postgres_schema: str) -> Iterator[str]:
    """A fresh table name in the run's schema, dropped after the test."""
    yield from _table(raw, postgres_schema)


@pytest.fixture
def other_table(raw: psycopg.Connection[Any], postgres_schema: str) -> Iterator[str]:
    yield from _table(raw, postgres_schema)


class Holder:
    """Leases taken and released on the plain connection, as another service would."""

    def __init__(self, raw: psycopg.Connection[Any], table: str, schema: str) -> None:
        self.store = PostgresStore(raw, table, 1, SYSTEM_CLOCK, schema=schema, asynchronous=False)
        self.engine = Engine(self.store, default_ttl=60)
        self.drive = SyncDriver(SYSTEM_CLOCK, self.store.ready)

    def take(self, key: str) -> Lease:
        lease = self.drive(self.engine.acquire(key, None))
        assert lease is not None
        return lease

    def give(self, lease: Lease) -> None:
        assert self.drive(self.engine.release(lease)) is True


class Waiting:
    """``acquire_with_retry`` of a :class:`Watched` store, run in a thread of its own.

    ``make`` builds the store from a client that ``open_client`` opens (in
    the thread's event loop for an asyncio client) and ``close`` closes.
    """

    def __init__(
        self,
        make: Callable[[object], Watched],
        open_client: Callable[[], object],
        close: Callable[[object], object],
        *,
        asynchronous: bool,
        key: str,
        timeout: float,
        retry_delay: float,
    ) -> None:
        self.store: Watched | None = None
        self.made = threading.Event()
        self.lease: Lease | None = None
        self.error: BaseException | None = None
        args = (key, None, timeout, retry_delay)

        def sync() -> None:
            client = open_client()
            try:
                store = self._made(make(client))
                drive = SyncDriver(SYSTEM_CLOCK, store.ready)
                self.lease = drive(Engine(store, default_ttl=60).acquire_with_retry(*args))
            finally:
                close(client)

        async def main() -> None:
            client = await _awaited(open_client())
            try:
                store = self._made(make(client))
                drive = AsyncDriver(SYSTEM_CLOCK, store.ready)
                self.lease = await drive(Engine(store, default_ttl=60).acquire_with_retry(*args))
            finally:
                await _awaited(close(client))

        def run() -> None:
            try:
                asyncio.run(main()) if asynchronous else sync()
            except BaseException as error:  # noqa: BLE001 - reported by result()
                self.error = error
            finally:
                self.made.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def _made(self, store: Watched) -> Watched:
        self.store = store
        self.made.set()
        return store

    def watched(self) -> Watched:
        assert self.made.wait(30)
        assert self.error is None, self.error
        assert self.store is not None
        return self.store

    def result(self, within: float) -> Lease | None:
        self.thread.join(timeout=within)
        assert not self.thread.is_alive(), "the waiter is still waiting"
        if self.error is not None:
            raise self.error
        return self.lease


async def _awaited(value: object) -> object:
    if isinstance(value, Coroutine):
        return await value
    return value


def listening(raw: psycopg.Connection[Any], table: str, within: float = 20) -> None:
    """Return once a session of the server sits idle after the waiter's holders read.

    A wait reads the holders after its LISTEN (``listening.py``, rule 2):
    from then on only a notification ends it early.
    """
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = raw.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle' "
            "AND query LIKE 'WITH slot AS%%' AND pid <> pg_backend_pid()"
        ).fetchone()
        if found is not None and found[0] > 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"no waiter of {table} listened within {within} s")


def polls(waiting: Waiting, holder: Holder, lease: Lease) -> None:
    """The waiter of a store that does not listen gets the lock by polling once it is released."""
    store = waiting.watched()
    assert store.waiting.wait(20), "its first attempt failed"
    holder.give(lease)
    assert waiting.result(within=20) is not None
    assert store.attempts >= 2
    assert not any(store.waits), "polled within retry_delay: no wait was woken"
    assert not store.listens


# --- the clients that listen -------------------------------------------------------------


def _kinds(url: str) -> dict[str, tuple[bool, Callable[[], object], Callable[[object], object]]]:
    """Each client that listens: (asynchronous, open it, close it)."""

    def sync_pool() -> object:
        return psycopg_pool.ConnectionPool(
            url, min_size=1, max_size=4, kwargs={"autocommit": True}, open=True
        )

    async def async_pool() -> object:
        pool = psycopg_pool.AsyncConnectionPool(
            url, min_size=1, max_size=4, kwargs={"autocommit": True}, open=False
        )
        await pool.open()
        return pool

    async def asyncpg_pool() -> object:
        return await asyncpg.create_pool(url, min_size=1, max_size=4)

    async def asyncpg_connection() -> object:
        return await asyncpg.connect(url)

    def close(client: Any) -> object:
        return client.close()

    return {
        "psycopg-pool": (False, sync_pool, close),
        "psycopg-async-pool": (True, async_pool, close),
        "asyncpg-pool": (True, asyncpg_pool, close),
        "asyncpg-connection": (True, asyncpg_connection, close),
    }


KINDS = list(_kinds("").keys())


def waiting_on(
    kind: str,
    url: str,
    table: str,
    schema: str,
    key: str,
    *,
    timeout: float = 20,
    retry_delay: float = LONG_DELAY,
    listen: bool = True,
) -> Waiting:
    asynchronous, open_client, close = _kinds(url)[kind]

    def make(client: object) -> Watched:
        return Watched(
            client, table, 1, SYSTEM_CLOCK, schema=schema, asynchronous=asynchronous, listen=listen
        )

    return Waiting(
        make,
        open_client,
        close,
        asynchronous=asynchronous,
        key=key,
        timeout=timeout,
        retry_delay=retry_delay,
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_release_wakes_a_listening_waiter(
    kind: str, postgres_server: str, postgres_schema: str, raw: psycopg.Connection[Any], table: str
) -> None:
    holder = Holder(raw, table, postgres_schema)
    lease = holder.take("job")
    waiting = waiting_on(kind, postgres_server, table, postgres_schema, "job")
    store = waiting.watched()
    assert store.listens
    listening(raw, table)
    assert store.attempts == 1, "one failed attempt, then it listens"
    holder.give(lease)
    got = waiting.result(within=LONG_DELAY / 2)
    assert got is not None, "woken: the next poll would have come after the timeout"
    assert (store.attempts, store.waits) == (2, [True]), "one wait, ended by the notification"
    assert store.listens, "the check that finds a pooler (rule 4) did not take the server for one"


def test_a_release_before_the_listen_is_not_missed(
    postgres_server: str, postgres_schema: str, raw: psycopg.Connection[Any], table: str
) -> None:
    # Released between the failed attempt and the LISTEN: the read after the
    # LISTEN finds the permit free, and the wait ends at once.
    holder = Holder(raw, table, postgres_schema)
    lease = holder.take("job")
    gate = threading.Event()

    class Late(Watched):
        def wait(self, key: str, waiter: Waiter, seconds: float) -> Steps[None]:
            holder.give(lease)  # in the waiter's thread, before its wait listens
            gate.set()
            return super().wait(key, waiter, seconds)

    def make(client: object) -> Watched:
        return Late(client, table, 1, SYSTEM_CLOCK, schema=postgres_schema, asynchronous=False)

    _, open_client, close = _kinds(postgres_server)["psycopg-pool"]
    waiting = Waiting(
        make, open_client, close, asynchronous=False, key="job", timeout=20, retry_delay=LONG_DELAY
    )
    got = waiting.result(within=LONG_DELAY / 2)
    assert gate.is_set()
    assert got is not None
    store = waiting.watched()
    assert (store.attempts, store.waits) == (2, [True])


def test_no_notification_reaches_another_tables_or_another_keys_waiters(
    postgres_server: str,
    postgres_schema: str,
    raw: psycopg.Connection[Any],
    table: str,
    other_table: str,
) -> None:
    mine, other = Holder(raw, table, postgres_schema), Holder(raw, other_table, postgres_schema)
    assert mine.store.statements.channel != other.store.statements.channel
    held = mine.take("job")
    others = [other.take("job"), mine.take("another")]
    waiting = waiting_on("psycopg-pool", postgres_server, table, postgres_schema, "job")
    store = waiting.watched()
    listening(raw, table)
    other.give(others[0])  # the same key in another table
    mine.give(others[1])  # another key in the same table
    # Not timing a speed: time for a wrong wake to show as a second attempt.
    time.sleep(0.5)
    assert (store.attempts, store.waits) == (1, []), "still waiting"
    mine.give(held)
    assert waiting.result(within=LONG_DELAY / 2) is not None
    assert (store.attempts, store.waits) == (2, [True])


def test_a_release_notifies_only_while_the_keys_waiters_are_marked(
    postgres_server: str, postgres_schema: str, raw: psycopg.Connection[Any], table: str
) -> None:
    holder = Holder(raw, table, postgres_schema)
    sql = holder.store.statements
    with psycopg.connect(postgres_server, autocommit=True) as ear:
        ear.execute(sql.listen.psycopg, {})

        def heard() -> list[str]:
            return [note.payload for note in ear.notifies(timeout=0.3)]

        holder.give(holder.take("job"))
        assert heard() == [], "nobody waits: no NOTIFY (and no lock on the queue at commit)"
        lease = holder.take("job")
        with psycopg_pool.ConnectionPool(postgres_server, min_size=1, max_size=2) as pool:
            waiting = Watched(
                pool, table, 1, SYSTEM_CLOCK, schema=postgres_schema, asynchronous=False
            )
            marked = Waiter(5000)
            drive = SyncDriver(SYSTEM_CLOCK, waiting.ready)
            assert drive(waiting.acquire("job", "w", 1000, marked)) is None
        assert marked.registered, "the failed attempt marked the key's waiters"
        stored = raw.execute(
            f'SELECT "value" FROM "{postgres_schema}"."{table}" WHERE "key" = %s', ("waiters:job",)
        ).fetchall()
        assert stored == [("dmutex-waiters",)]
        holder.give(lease)
        assert heard() == ["job"], "a waiter is marked: the release notifies, once"
        holder.give(holder.take("other"))
        assert heard() == [], "another key's waiters are not marked"


def test_a_single_psycopg_connection_never_blocks_and_its_waiters_poll(
    postgres_server: str, postgres_schema: str, raw: psycopg.Connection[Any], table: str
) -> None:
    holder = Holder(raw, table, postgres_schema)
    lease = holder.take("job")

    def make(client: object) -> Watched:
        return Watched(client, table, 1, SYSTEM_CLOCK, schema=postgres_schema, asynchronous=False)

    def close(client: Any) -> object:
        return client.close()

    waiting = Waiting(
        make,
        lambda: psycopg.connect(postgres_server, autocommit=True),
        close,
        asynchronous=False,
        key="job",
        timeout=20,
        retry_delay=0.2,
    )
    polls(waiting, holder, lease)


@pytest.mark.parametrize(
    ("kind", "listen"), [*((kind, True) for kind in KINDS), ("psycopg-pool", False)]
)
def test_behind_pgbouncer_in_transaction_mode_waiters_poll_and_get_the_lock(
    kind: str,
    listen: bool,
    pgbouncer_url: str,
    postgres_schema: str,
    raw: psycopg.Connection[Any],
    table: str,
) -> None:
    # The first wait finds the pooler (its session's pid is not the one the
    # connection reported) and the store stops listening: its waiter polls.
    # listen=False skips even that check.
    holder = Holder(raw, table, postgres_schema)
    lease = holder.take("job")
    asynchronous, open_client, close = _kinds(pgbouncer_url)[kind]
    if kind.startswith("asyncpg"):
        pooled = kind == "asyncpg-pool"

        async def open_asyncpg() -> object:
            # Unnamed statements only, as a pooler in transaction mode needs.
            if pooled:
                return await asyncpg.create_pool(
                    pgbouncer_url, min_size=1, max_size=4, statement_cache_size=0
                )
            return await asyncpg.connect(pgbouncer_url, statement_cache_size=0)

        open_client = open_asyncpg

    def make(client: object) -> Watched:
        return Watched(
            client,
            table,
            1,
            SYSTEM_CLOCK,
            schema=postgres_schema,
            asynchronous=asynchronous,
            listen=listen,
        )

    waiting = Waiting(
        make, open_client, close, asynchronous=asynchronous, key="job", timeout=20, retry_delay=0.2
    )
    store = waiting.watched()
    assert store.listens is listen
    polls(waiting, holder, lease)


def test_channels_are_identifiers_one_per_table() -> None:
    long = "t" * 200
    assert channel('"s"."t"') == 'dmutex "s"."t"'
    hashed = channel(f'"s"."{long}"')
    assert len(hashed.encode()) == 63
    assert hashed.startswith("dmutex ")
    assert hashed != channel(f'"s"."{long}x"')
    assert len(channel('"' + "é" * 40 + '"').encode()) <= 63, "bytes, not characters"
    assert Statements.of("t", "a").channel != Statements.of("t", "b").channel
    assert Statements.of("t").listen.psycopg == 'LISTEN "dmutex ""t"""'


@pytest.mark.parametrize("kind", ["psycopg-async-pool", "asyncpg-pool"])
def test_a_cancelled_wait_gives_its_connection_back(
    kind: str, postgres_server: str, postgres_schema: str, raw: psycopg.Connection[Any], table: str
) -> None:
    holder = Holder(raw, table, postgres_schema)
    lease = holder.take("job")
    _, open_client, close = _kinds(postgres_server)[kind]

    async def main() -> tuple[bool, Lease | None, list[bool]]:
        pool = await _awaited(open_client())
        try:
            store = Watched(pool, table, 1, SYSTEM_CLOCK, schema=postgres_schema, asynchronous=True)
            engine = Engine(store, default_ttl=60)
            drive = AsyncDriver(SYSTEM_CLOCK, store.ready)

            async def waiter() -> asyncio.Future[Lease | None]:
                """A retrying acquire in a task of its own, once it listens."""
                store.waiting.clear()
                task = asyncio.ensure_future(drive(engine.acquire_with_retry("job", None, 20, 30)))
                while not store.waiting.is_set():
                    await asyncio.sleep(0.01)
                await asyncio.to_thread(listening, raw, table)
                return task

            first = await waiter()
            first.cancel()
            try:
                await asyncio.wait_for(first, 10)
            except asyncio.CancelledError:
                cancelled = True
            else:
                cancelled = False
            # The pool and its budget serve the next wait, which a release still wakes.
            second = await waiter()
            await asyncio.to_thread(holder.give, lease)
            return cancelled, await asyncio.wait_for(second, LONG_DELAY / 2), store.waits
        finally:
            await _awaited(close(pool))

    cancelled, again, waits = asyncio.run(main())
    assert cancelled
    assert again is not None
    assert waits == [True], "the cancelled wait recorded nothing; the next was woken"


class Counted(psycopg.Connection[Any]):
    """A psycopg connection that records every statement it sends."""

    sent: ClassVar[list[object]] = []

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        Counted.sent.append(query)
        return super().execute(query, params, **kwargs)


def test_a_listening_wait_costs_its_budget_of_statements(
    postgres_server: str, postgres_schema: str, raw: psycopg.Connection[Any], table: str
) -> None:
    # docs/usage/postgresql.md's budget: LISTEN, the holders read and UNLISTEN
    # per wait, and the pooler check once per pool (the first wait's); the
    # marks ride on the acquires' own statements.
    holder = Holder(raw, table, postgres_schema)

    def make(client: object) -> Watched:
        return Watched(client, table, 1, SYSTEM_CLOCK, schema=postgres_schema, asynchronous=False)

    with psycopg_pool.ConnectionPool(
        postgres_server,
        min_size=1,
        max_size=4,
        connection_class=Counted,
        kwargs={"autocommit": True},
    ) as pool:
        for check in ([PID_CHECK.psycopg], []):
            lease = holder.take("job")
            Counted.sent.clear()
            waiting = Waiting(
                make,
                lambda: pool,
                lambda _: None,
                asynchronous=False,
                key="job",
                timeout=20,
                retry_delay=5,
            )
            store = waiting.watched()
            listening(raw, table)
            holder.give(lease)
            got = waiting.result(within=10)
            assert got is not None
            assert store.waits == [True]
            sql = store.statements
            assert [text for text in Counted.sent if text != sql.shape.psycopg] == [
                sql.acquire_mutex.psycopg,
                *check,
                sql.listen.psycopg,
                sql.holders.psycopg,
                sql.unlisten.psycopg,
                sql.acquire_mutex.psycopg,
            ]
            holder.give(got)

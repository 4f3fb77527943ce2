"""PostgreSQL's server ending or refusing a holder's statements, and a holder behind a blackhole.

Each case ends with the rows read through a direct connection
(``tests._support.postgres_faults``: ``Inspector``):

- **Killed connection**: ``pg_terminate_backend`` of the holder's backend
  from another session: its next call on a single connection raises a
  connection error (psycopg: ``AdminShutdown``; asyncpg: ``InterfaceError``
  or the internal error ``postgres_faults.unclear`` accepts); a psycopg pool
  that checks connections (``check=ConnectionPool.check_connection``)
  answers the next call; one that does not lends the dead connection once,
  and an asyncpg pool may (that call fails as a single connection does):
  either answers the call after. The lease row is intact throughout, and
  release by token on a new connection deletes it.
- **Bad states**: a role that may only read the table (SELECT only; and
  ``default_transaction_read_only``): acquire raises the server's
  ``InsufficientPrivilege`` / ``ReadOnlySqlTransaction`` (asyncpg's twins),
  and nothing is written. A ``statement_timeout`` while another session
  holds the lease row's lock in an open transaction: acquire raises
  ``QueryCanceled``, no row changed, none left after the blocker rolls back
  or commits, and acquire then works.
- **Deadline**: the partition guarantee on PostgreSQL, with
  ``deadlines/test_deadlines.py``'s own cases (``sync_case``, ``async_case``; 10
  trials at TTLs of 1 to 2 s): holders with ``auto_renew=True`` through
  proxies that become blackholes, without any client timeout
  (:class:`PostgresDeadlineRig`); every telling comes before a direct
  second holder's grant, and the margins join the terminal summary.

Every wait has a timeout. ``-s`` prints what the killed connections' next
calls raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import asyncpg
import psycopg
import psycopg.errors
import psycopg_pool
import pytest
from psycopg import sql

from dmutex import AsyncDMutex, AsyncDSemaphore, DMutex, DSemaphore
from tests._support import postgres_servers
from tests._support.postgres_faults import (
    ASYNC_FAILURES,
    PERMITS,
    SYNC_FAILURES,
    FaceName,
    Inspector,
    Kind,
    asyncpg_dsn,
    make_lock,
    release_by_token,
    release_by_token_async,
    service_name,
    table_of,
    unclear,
)
from tests._support.rivals import Direct
from tests.faults.deadlines import test_deadlines

# A mutex's lease released by its token on a new connection: unlock(key, token), deprecated,
# is the one way (a handle cannot move to another instance). Threads and tasks share the
# filters, so warnings.catch_warnings() around each call would not be safe here.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:(Async)?DMutex\.unlock\(\) is deprecated:DeprecationWarning"
)


# --- a connection killed by the server ----------------------------------------------------------


def terminate(admin: psycopg.Connection[Any], pid: int) -> None:
    """``pg_terminate_backend(pid)`` and wait until the backend is gone."""
    row = admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()
    assert row == (True,), f"backend {pid} not terminated"
    deadline = time.monotonic() + 10
    while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
        assert time.monotonic() < deadline, f"backend {pid} still there"
        time.sleep(0.01)


def backend_pids(admin: psycopg.Connection[Any], name: str) -> list[int]:
    found = admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (name,)
    ).fetchall()
    return [int(pid) for (pid,) in found]


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
@pytest.mark.parametrize(
    "client", ["psycopg", "psycopg_pool", "psycopg_pool_unchecked", "asyncpg", "asyncpg_pool"]
)
def test_a_connection_killed_mid_use(
    postgres_server: str, postgres_schema: str, client: str, kind: Kind
) -> None:
    """pg_terminate_backend of the holder's backend: clear error or a pool's recovery; row kept."""
    service = service_name("killed")
    name = f"dmutex-{service}"  # application_name: its backends, found by the admin
    url = f"{postgres_server}{'&' if '?' in postgres_server else '?'}application_name={name}"
    inspector = Inspector(postgres_server, postgres_schema, table_of(kind, service))
    admin = psycopg.connect(postgres_server, autocommit=True)
    face: FaceName = "sync" if client.startswith("psycopg") else "async"
    pooled = "_pool" in client
    with contextlib.closing(admin), contextlib.closing(inspector):

        def after_kill(outcome: object, then: object = None) -> None:
            if client == "psycopg_pool":  # it checks a connection before it lends it
                assert not isinstance(outcome, BaseException), f"the pool failed: {outcome!r}"
            elif pooled:
                # asyncpg's lends the dead connection if it has not seen it close yet (it
                # reads the server's FATAL message in the background), psycopg's without
                # a check lends it always: that one call fails, and the pool has replaced
                # the connection for the next.
                if isinstance(outcome, BaseException):
                    assert isinstance(outcome, SYNC_FAILURES + ASYNC_FAILURES), repr(outcome)
                    assert unclear(outcome) is None, unclear(outcome)
                    print(f"[pg-killed {client} {kind}] the next call raised {outcome!r}")
                assert not isinstance(then, BaseException), f"the pool failed again: {then!r}"
            else:
                failures = SYNC_FAILURES if face == "sync" else ASYNC_FAILURES
                assert isinstance(outcome, failures), f"not a connection error: {outcome!r}"
                assert unclear(outcome) is None, unclear(outcome)
                print(f"[pg-killed {client} {kind}] the next call raised {outcome!r}")

        def row_intact(token: str, key: str) -> None:
            live = [r for r in inspector.live() if r.token == token]
            assert len(live) == 1, live
            assert re.fullmatch(rf"permit:[0-9]+:{key}", live[0].key), live

        if face == "sync":
            if pooled:
                target: Any = psycopg_pool.ConnectionPool(
                    url,
                    min_size=1,
                    max_size=1,
                    kwargs={"autocommit": True},
                    check=(
                        None
                        if client.endswith("unchecked")
                        else psycopg_pool.ConnectionPool.check_connection
                    ),
                    open=True,
                )
            else:
                target = psycopg.connect(url, autocommit=True)
            with contextlib.closing(target):
                lock = make_lock("sync", kind, target, service, postgres_schema)
                assert isinstance(lock, (DMutex, DSemaphore))
                handle = lock.acquire("k", ttl=30)
                assert handle is not None
                for pid in backend_pids(admin, name):
                    terminate(admin, pid)
                row_intact(handle.token, "k")
                outcome: object
                try:
                    outcome = lock.acquire("other", ttl=30)
                except Exception as error:  # noqa: BLE001 - judged below
                    outcome = error
                row_intact(handle.token, "k")
                then: object = None
                if pooled:
                    try:
                        then = lock.acquire("third", ttl=30)
                    except Exception as error:  # noqa: BLE001 - judged below
                        then = error
                after_kill(outcome, then)
            with psycopg.connect(postgres_server, autocommit=True) as fresh:
                other = make_lock("sync", kind, fresh, service, postgres_schema)
                assert isinstance(other, (DMutex, DSemaphore))
                assert release_by_token(other, "k", handle.token) is True
        else:

            async def main() -> tuple[object, object]:
                dsn = asyncpg_dsn(postgres_server)
                settings = {"application_name": name}
                target: Any
                if pooled:
                    target = await asyncpg.create_pool(
                        **dsn, min_size=1, max_size=1, server_settings=settings
                    )
                else:
                    target = await asyncpg.connect(**dsn, server_settings=settings)
                try:
                    lock = make_lock("async", kind, target, service, postgres_schema)
                    assert isinstance(lock, (AsyncDMutex, AsyncDSemaphore))
                    handle = await lock.acquire("k", ttl=30)
                    assert handle is not None
                    for pid in await asyncio.to_thread(backend_pids, admin, name):
                        await asyncio.to_thread(terminate, admin, pid)
                    await asyncio.to_thread(row_intact, handle.token, "k")
                    outcome: object
                    try:
                        outcome = await lock.acquire("other", ttl=30)
                    except Exception as error:  # noqa: BLE001 - judged by the caller
                        outcome = error
                    await asyncio.to_thread(row_intact, handle.token, "k")
                    then: object = None
                    if pooled:
                        try:
                            then = await lock.acquire("third", ttl=30)
                        except Exception as error:  # noqa: BLE001 - judged by the caller
                            then = error
                finally:
                    if pooled:
                        target.terminate()
                    else:
                        target.terminate()
                direct = await asyncpg.connect(**dsn)
                try:
                    other = make_lock("async", kind, direct, service, postgres_schema)
                    assert isinstance(other, (AsyncDMutex, AsyncDSemaphore))
                    assert await release_by_token_async(other, "k", handle.token) is True
                finally:
                    await direct.close()
                return outcome, then

            outcome, then = asyncio.run(asyncio.wait_for(main(), 30))
            after_kill(outcome, then)
        left = [r.key for r in inspector.live()]
        assert all(re.fullmatch(r"permit:[0-9]+:(other|third)", k) for k in left), left


# --- bad server states: a role that may only read, a statement timeout -------------------------


def may_create_roles(admin: psycopg.Connection[Any]) -> bool:
    row = admin.execute(
        "SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user"
    ).fetchone()
    return bool(row and row[0])


@contextlib.contextmanager
def role(admin: psycopg.Connection[Any], *settings: str) -> Iterator[str]:
    """A login role of the test's own (trust: no password), dropped with what it was granted."""
    name = f"dmutex_role_{random.Random().getrandbits(32):08x}"
    admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    try:
        for setting in settings:
            admin.execute(
                sql.SQL("ALTER ROLE {} SET {}").format(sql.Identifier(name), sql.SQL(setting))
            )
        yield name
    finally:
        admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def as_role(url: str, name: str) -> str:
    params = psycopg.conninfo.conninfo_to_dict(url)
    params["user"] = name
    params.pop("password", None)
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in params.items()})


def snapshot(inspector: Inspector) -> list[tuple[Any, ...]]:
    """Every row of the table, as it is."""
    query = sql.SQL('SELECT "key", "value", "expired_at" FROM {} ORDER BY "key"')
    return inspector.execute(query.format(inspector.name))


READ_ONLY = {
    # How the role may only read, and what the server answers an acquire.
    "select-only": ((), psycopg.errors.InsufficientPrivilege, "InsufficientPrivilegeError"),
    "read-only-transactions": (
        ("default_transaction_read_only = on",),
        psycopg.errors.ReadOnlySqlTransaction,
        "ReadOnlySQLTransactionError",
    ),
}


@pytest.mark.parametrize("how", sorted(READ_ONLY))
@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_role_that_may_only_read_cannot_acquire_and_writes_nothing(
    postgres_server: str, postgres_schema: str, face: FaceName, kind: Kind, how: str
) -> None:
    """The server's refusal comes through as its own error type and message; no row written."""
    settings, sync_error, async_error = READ_ONLY[how]
    service = service_name("ro")
    table = table_of(kind, service)
    with contextlib.ExitStack() as stack:
        admin = stack.enter_context(psycopg.connect(postgres_server, autocommit=True))
        if not may_create_roles(admin):
            pytest.skip("the server's role may not CREATE ROLE: no read-only role to test with")
        owner = make_lock("sync", kind, admin, service, postgres_schema)
        assert isinstance(owner, (DMutex, DSemaphore))
        owner.ready()  # the table and its index, made by a role that may
        inspector = Inspector(postgres_server, postgres_schema, table)
        stack.callback(inspector.close)
        name = stack.enter_context(role(admin, *settings))
        grant = "SELECT" if how == "select-only" else "SELECT, INSERT, UPDATE, DELETE"
        admin.execute(
            sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                sql.Identifier(postgres_schema), sql.Identifier(name)
            )
        )
        admin.execute(
            sql.SQL(f"GRANT {grant} ON {{}} TO {{}}").format(inspector.name, sql.Identifier(name))
        )
        url = as_role(postgres_server, name)
        if face == "sync":
            with psycopg.connect(url, autocommit=True) as conn:
                lock = make_lock("sync", kind, conn, service, postgres_schema)
                assert isinstance(lock, (DMutex, DSemaphore))
                lock.ready()  # the table is there: one read, which the role may
                with pytest.raises(sync_error) as raised:
                    lock.acquire("k")
                message = str(raised.value)
        else:

            async def main() -> BaseException:
                conn = await asyncpg.connect(**asyncpg_dsn(url))
                try:
                    lock = make_lock("async", kind, conn, service, postgres_schema)
                    assert isinstance(lock, (AsyncDMutex, AsyncDSemaphore))
                    await lock.ready()
                    try:
                        await lock.acquire("k")
                    except Exception as error:  # noqa: BLE001 - judged by the caller
                        return error
                    raise AssertionError("acquire by a role that may only read succeeded")
                finally:
                    await conn.close()

            error = asyncio.run(asyncio.wait_for(main(), 30))
            assert type(error).__name__ == async_error, repr(error)
            message = str(error)
        expected = "permission denied" if how == "select-only" else "read-only transaction"
        assert expected in message, message
        assert snapshot(inspector) == [], "nothing written"


def age_all(inspector: Inspector) -> None:
    """Let every lease of the table run out now, by the server's clock."""
    query = sql.SQL(
        """UPDATE {} SET "expired_at" = statement_timestamp() - interval '1 ms'
        WHERE "key" LIKE 'permit:%%'"""
    )
    inspector.execute(query.format(inspector.name))


STATEMENT_TIMEOUT_MS = 300


@pytest.mark.parametrize("ends", ["rollback", "commit"])
@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_statement_timeout_behind_a_row_lock_cancels_the_acquire_and_changes_nothing(
    postgres_server: str, postgres_schema: str, face: FaceName, kind: Kind, ends: str
) -> None:
    """Another session locks the key's rows; acquire times out (QueryCanceled), nothing changes."""
    service = service_name("st")
    table = table_of(kind, service)
    permits = PERMITS[kind]
    with contextlib.ExitStack() as stack:
        admin = stack.enter_context(psycopg.connect(postgres_server, autocommit=True))
        owner = make_lock("sync", kind, admin, service, postgres_schema)
        assert isinstance(owner, (DMutex, DSemaphore))
        for _ in range(permits):  # every slot's row, then all expired: free, and there to lock
            assert owner.acquire("k", ttl=30) is not None
        inspector = Inspector(postgres_server, postgres_schema, table)
        stack.callback(inspector.close)
        age_all(inspector)
        before = snapshot(inspector)
        blocker = stack.enter_context(psycopg.connect(postgres_server))  # not autocommit
        blocker.execute(
            sql.SQL("""SELECT 1 FROM {} WHERE "key" LIKE 'permit:%%' FOR UPDATE""").format(
                inspector.name
            )
        )  # its transaction stays open
        started = time.monotonic()
        if face == "sync":
            options = quote(f"-cstatement_timeout={STATEMENT_TIMEOUT_MS}")
            joiner = "&" if "?" in postgres_server else "?"
            conn = stack.enter_context(
                psycopg.connect(f"{postgres_server}{joiner}options={options}", autocommit=True)
            )
            lock = make_lock("sync", kind, conn, service, postgres_schema)
            assert isinstance(lock, (DMutex, DSemaphore))
            with pytest.raises(psycopg.errors.QueryCanceled) as raised:
                lock.acquire("k")
            error: BaseException = raised.value
        else:

            async def main() -> BaseException:
                conn = await asyncpg.connect(
                    **asyncpg_dsn(postgres_server),
                    server_settings={"statement_timeout": str(STATEMENT_TIMEOUT_MS)},
                )
                try:
                    lock = make_lock("async", kind, conn, service, postgres_schema)
                    assert isinstance(lock, (AsyncDMutex, AsyncDSemaphore))
                    try:
                        await lock.acquire("k")
                    except Exception as error:  # noqa: BLE001 - judged by the caller
                        return error
                    raise AssertionError("the acquire was not cancelled")
                finally:
                    await conn.close()

            error = asyncio.run(asyncio.wait_for(main(), 30))
            assert isinstance(error, asyncpg.QueryCanceledError), repr(error)
        waited = time.monotonic() - started
        assert "statement timeout" in str(error), str(error)
        assert waited >= STATEMENT_TIMEOUT_MS / 1000 * 0.9, f"cancelled after {waited:.3f} s"
        assert snapshot(inspector) == before, "the cancelled acquire changed a row"
        (blocker.rollback if ends == "rollback" else blocker.commit)()
        assert snapshot(inspector) == before, "a row changed when the blocker let go"
        assert inspector.live() == [], "a lease left by the cancelled acquire"
        after = owner.acquire("k", ttl=5)
        assert after is not None, "acquire works once the blocker let go"
        assert after.release() is True


# --- the deadline: a holder behind a blackhole is told before anyone takes its key -------------


class PostgresDeadlineRig(test_deadlines.ProxiedRig):
    """``test_deadlines``'s rig on PostgreSQL: one proxy per trial, no client timeout.

    Holders: a psycopg connection in autocommit (sync), an asyncpg pool of two
    (asyncio: the trial's ``acquire`` and ``run`` leases share it; an asyncpg
    connection runs one statement at a time). Neither has a timeout, so a
    statement the blackhole swallows waits for ever. The second holders
    share a direct psycopg connection, in a process of their own.
    """

    # The rig's Literal names test_deadlines' own three backends; only its test reads it.
    name = "postgresql"  # type: ignore[assignment]

    def __init__(self, url: str, schema: str) -> None:
        super().__init__(postgres_servers.upstream_of(url))
        self.url = url
        self.lock_options = {"schema_name": schema}
        self.pools: list[Any] = []

    def through(self, index: int) -> str:
        params = psycopg.conninfo.conninfo_to_dict(self.url)
        proxy = self.proxy(index)
        params.update(host=proxy.host, port=str(proxy.port), sslmode="disable")
        params.pop("connect_timeout", None)
        return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in params.items()})

    def direct(self) -> Direct:
        options = tuple(self.lock_options.items())
        return Direct("postgresql", self.url, options=options)

    def sync_lock(self, index: int) -> DMutex:
        if index not in self.sync_locks:
            conn = psycopg.connect(self.through(index), autocommit=True)
            self.sync_clients.append(conn)
            self.sync_locks[index] = DMutex(test_deadlines.SERVICE, conn, **self.lock_options)
        return self.sync_locks[index]

    async def async_lock(self, index: int) -> AsyncDMutex:
        if index not in self.async_locks:
            dsn = asyncpg_dsn(self.through(index))
            dsn.pop("timeout")
            pool = await asyncpg.create_pool(**dsn, min_size=1, max_size=2)
            self.pools.append(pool)
            self.async_locks[index] = AsyncDMutex(test_deadlines.SERVICE, pool, **self.lock_options)
        return self.async_locks[index]

    async def aclose(self) -> None:
        pools, self.pools = self.pools, []
        for pool in pools:
            pool.terminate()


DEADLINE_TRIALS = 10
DEADLINE_TTLS = (1.0, 1.0, 1.5, 2.0, 2.0)


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_holder_behind_a_blackhole_is_told_before_anyone_takes_the_key(
    postgres_server: str, postgres_schema: str, face: FaceName, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``test_deadlines``' case on PostgreSQL, 10 trials at TTLs of 1 to 2 s."""
    monkeypatch.setattr(test_deadlines, "TRIALS", DEADLINE_TRIALS)
    monkeypatch.setattr(test_deadlines, "TTLS", DEADLINE_TTLS)
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        DMutex(test_deadlines.SERVICE, conn, schema_name=postgres_schema).ready()
        name = sql.Identifier(postgres_schema, f"_dmutex_{test_deadlines.SERVICE}")
        conn.execute(sql.SQL("DELETE FROM {}").format(name))
    rig = PostgresDeadlineRig(postgres_server, postgres_schema)
    case = f"postgresql-{face}"
    try:
        test_deadlines.tell_case(rig, case, face)
    finally:
        rig.end_fault()
        rig.close()

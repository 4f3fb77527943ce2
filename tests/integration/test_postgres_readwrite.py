"""Read-write locks on a real PostgreSQL server (``PostgresReadWriteStore``), public classes.

What is checked, through ``DReadWriteLock`` on psycopg (a single connection,
or a ``psycopg_pool.ConnectionPool``) and ``AsyncDReadWriteLock`` on asyncpg
(``tests._support.rwfaces`` gives both one sync interface), with a plain
psycopg connection reading and changing the table behind the store's back:

- fences: every grant's above the one before, a writer's above every
  earlier reader's, the row's ``"f"`` the last one granted; ``fencing=False``
  shows none;
- the layout byte for byte (``rwcas.py``, ``rwstate.py``): the one
  row ``rwlock:{k}`` of ``_drwlock_{service}``, its JSON text (fields in
  order, tokens sorted, ``"f"`` last), its ``expired_at`` the forever value,
  the row kept once everything is released;
- a row of that key that dmutex did not write: every operation raises
  ``DMutexError`` and leaves it as it was;
- statements, counted by a recording psycopg connection: a first grant is a
  read and a write, then a grant, an extend or a release on that key the
  write alone (``rwcas.py``, rule 8), a refused attempt and a release of
  nothing the read alone, ``holders`` the read alone;
- waiting: a pool's waiters (readers and writers) listen, and a release's
  notification wakes them long before their ``retry_delay``; a reader's
  probe finds a release that landed before its ``LISTEN``, and so does a
  waiting writer's (its own intent is no reason to wait on); a single
  psycopg connection does not listen, and its release still wakes a pool's
  waiter (both found by this file first, as ``xfail`` tests, then fixed).

Leases are 30 s and more: nothing expires while a test runs, unless a test
rewrites a hold's expiry in the row (``tests._support.rwrows``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import asyncpg
import psycopg
import psycopg_pool
import pytest

from dmutex._backends.postgresql.statements import FOREVER
from tests._support.faces import FaceName, Handle, LoopThread
from tests._support.rwfaces import RWFace, Side
from tests._support.rwrows import granted, hold_expired, is_read
from tests._support.sql_rwchecks import (
    FOREIGN,
    KEY,
    ROW,
    TTL,
    WOKEN,
    Watch,
    check_fences,
    check_fencing_off,
    check_foreign,
    check_row,
    check_statements,
    store_of,
    waited,
    watch,
)

SETTLE = 0.3  # into a waiter's LISTEN (a release before it is found by its probe)
FACES: dict[str, FaceName] = {"psycopg": "sync", "asyncpg": "async"}

PgConnection = psycopg.Connection[tuple[Any, ...]]


# --- the rig ------------------------------------------------------------------------------


class Recording(psycopg.Connection[tuple[Any, ...]]):
    """A psycopg connection that records each statement it executes (one round trip each)."""

    sent: list[str]

    def execute(self, *args: Any, **kwargs: Any) -> psycopg.Cursor[tuple[Any, ...]]:
        self.sent.append(str(args[0] if args else kwargs["query"]))
        cursor: psycopg.Cursor[tuple[Any, ...]] = super().execute(*args, **kwargs)
        return cursor

    def taken(self) -> list[str]:
        """The first word of each statement sent since the last call; then forgets them."""
        found = [text.split(None, 1)[0].upper() for text in self.sent]
        self.sent.clear()
        return found


@pytest.fixture(scope="module")
def url(postgres_server: str, postgres_schema: str) -> str:
    """The session's server, the run's schema first on each connection's search path."""
    joiner = "&" if "?" in postgres_server else "?"
    return f"{postgres_server}{joiner}options={quote(f'-csearch_path={postgres_schema}')}"


@pytest.fixture
def raw(url: str) -> Iterator[PgConnection]:
    """Another program's connection: reads and changes the table behind the store's back."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET TIME ZONE 'UTC'")  # timestamptz as text: '...+00'
        yield conn


@pytest.fixture
def service(raw: PgConnection) -> Iterator[str]:
    """A service name of the test's own, so a table of its own; dropped afterwards."""
    name = f"rw{uuid.uuid4().hex[:12]}"
    yield name
    raw.execute(f'DROP TABLE IF EXISTS "_drwlock_{name}"')


@dataclass
class Env:
    """One client of one face, the service's table, and the plain connection to look at it."""

    face: FaceName
    client: object
    service: str
    raw: PgConnection
    loop: LoopThread | None = None
    closing: list[Callable[[], object]] = field(default_factory=list)

    @property
    def table(self) -> str:
        return f"_drwlock_{self.service}"

    def make(self, **options: Any) -> RWFace:
        """A read-write lock of this face on the service, prepared (its table made)."""
        rw = RWFace(self.face, self.client, service_name=self.service, loop=self.loop, **options)
        rw.wait(rw.target.ready())
        return rw

    def stored(self) -> tuple[str, str] | None:
        """The row ``rwlock:{KEY}``: its value and its ``expired_at`` as text (UTC)."""
        found = self.raw.execute(
            f'SELECT "value", "expired_at"::text FROM "{self.table}" WHERE "key" = %s', (ROW,)
        ).fetchone()
        return None if found is None else (str(found[0]), str(found[1]))

    def value(self) -> str:
        found = self.stored()
        assert found is not None, f"no row {ROW}"
        return found[0]

    def keys(self) -> list[str]:
        found = self.raw.execute(f'SELECT "key" FROM "{self.table}" ORDER BY "key"')
        return [str(key) for (key,) in found.fetchall()]

    def now_us(self) -> int:
        """The server's clock in µs (the store reads its time from the same clock)."""
        found = self.raw.execute(
            "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
        ).fetchone()
        assert found is not None
        return int(found[0])

    def expire(self, token: str) -> None:
        """Let ``token``'s hold run out now, by the server's clock, in the row's JSON."""
        now_ms = self.now_us() // 1000
        self.raw.execute(
            f'UPDATE "{self.table}" SET "value" = %s WHERE "key" = %s',
            (hold_expired(self.value(), token, now_ms), ROW),
        )


def _open(face: str, url: str, postgres_server: str, schema: str, env: Env) -> None:
    if face == "psycopg":
        conn = psycopg.connect(url, autocommit=True)
        env.client = conn
        env.closing.append(conn.close)
        return
    loop = env.loop = LoopThread()
    made = loop.run(asyncpg.connect(postgres_server, server_settings={"search_path": schema}))
    env.client = made
    env.closing.append(lambda: loop.run(made.close()))
    env.closing.append(loop.close)


@pytest.fixture(params=list(FACES))
def env(
    request: pytest.FixtureRequest,
    url: str,
    postgres_server: str,
    postgres_schema: str,
    raw: PgConnection,
    service: str,
) -> Iterator[Env]:
    made = Env(FACES[request.param], None, service, raw)
    try:
        _open(request.param, url, postgres_server, postgres_schema, made)
        yield made
    finally:
        for close in made.closing:
            close()


# --- fences -----------------------------------------------------------------------------------


def test_fences_rise_and_a_writers_is_above_every_earlier_grant(env: Env) -> None:
    check_fences(env)


def test_fencing_off_shows_no_fence(env: Env) -> None:
    check_fencing_off(env)


# --- the layout, byte for byte ------------------------------------------------------------


def test_the_table_and_the_row_byte_for_byte(env: Env) -> None:
    env.make()  # its table
    columns = env.raw.execute(
        "SELECT column_name, data_type, is_nullable FROM information_schema.columns "
        "WHERE table_schema = current_schema() AND table_name = %s ORDER BY ordinal_position",
        (env.table,),
    ).fetchall()
    assert columns == [
        ("key", "text", "NO"),
        ("value", "text", "NO"),
        ("expired_at", "timestamp with time zone", "NO"),
    ]
    assert FOREVER == "9999-01-01 00:00:00+00"
    check_row(env, FOREVER)


# --- a row dmutex did not write -----------------------------------------------------------


@pytest.mark.parametrize("value", FOREIGN)
def test_a_row_dmutex_did_not_write_raises_and_is_left_alone(env: Env, value: str) -> None:
    env.make()  # its table
    env.raw.execute(
        f'INSERT INTO "{env.table}" VALUES (%s, %s, %s::timestamptz)',
        (ROW, value, "1970-01-01 00:00:00+00"),  # long expired: an expiry would not save it
    )
    stored = env.stored()
    assert stored == (value, "1970-01-01 00:00:00+00")
    check_foreign(env)


# --- statements per operation -------------------------------------------------------------


def test_statements_per_operation(url: str, raw: PgConnection, service: str) -> None:
    conn = Recording.connect(url, autocommit=True)
    conn.sent = []
    try:
        lock = RWFace("sync", conn, service_name=service)
        lock.target.ready()
        conn.taken()
        check_statements(lock, conn.taken, "WITH", "WITH")
        found = raw.execute(f'SELECT count(*) FROM "_drwlock_{service}"').fetchone()
        assert found == (1,), "a key that was never held has no row"
    finally:
        conn.close()


# --- waiting ------------------------------------------------------------------------------


def listening(
    client: object, service: str, holder: RWFace, side: Side, *, early: bool = False
) -> tuple[RWFace, Watch, Handle]:
    """A lock on ``client`` whose ``side`` waits (watched), and ``holder``'s hold in its way.

    ``early``: the hold is released as the waiter's first wait begins.
    """
    rw = RWFace("sync", client, service_name=service)
    rw.target.ready()
    store = store_of(rw)
    assert store.listens is True
    hold = granted(holder.acquire("write" if side == "read" else "read", KEY, TTL))
    return rw, watch(store, hold if early else None), hold


def test_a_pools_waiters_listen_and_a_release_wakes_them(url: str, service: str) -> None:
    with psycopg_pool.ConnectionPool(url, min_size=1, max_size=4, open=True) as pool:
        holder = RWFace("sync", pool, service_name=service)
        holder.target.ready()
        sides: list[Side] = ["read", "write"]
        for side in sides:
            rw, seen, hold = listening(pool, service, holder, side)
            got, after = waited(rw, seen, side, hold, settle=SETTLE)
            assert after < WOKEN, f"a {side}r in {after:.2f} s after the release"
            assert seen.woken == [True], "its one wait ended early"
            assert is_read(got) is (side == "read")
            assert got.release() is True


def test_a_release_before_a_readers_listen_is_not_missed(url: str, service: str) -> None:
    """Released between its refused attempt and its LISTEN: its probe finds the key free."""
    with psycopg_pool.ConnectionPool(url, min_size=1, max_size=4, open=True) as pool:
        holder = RWFace("sync", pool, service_name=service)
        holder.target.ready()
        rw, seen, _ = listening(pool, service, holder, "read", early=True)
        got, after = waited(rw, seen, "read", None)
        assert after < WOKEN, f"in {after:.2f} s after the release"
        assert seen.woken == [True]
        assert got.release() is True


def test_a_release_before_a_writers_listen_is_not_missed(url: str, service: str) -> None:
    """As for a reader: its own intent is no reason to go on waiting."""
    with psycopg_pool.ConnectionPool(url, min_size=1, max_size=4, open=True) as pool:
        holder = RWFace("sync", pool, service_name=service)
        holder.target.ready()
        rw, seen, _ = listening(pool, service, holder, "write", early=True)
        # timeout=3.5: unwoken, its last attempt (at the deadline) gets in, ~3.5 s late.
        got, after = waited(rw, seen, "write", None, timeout=3.5)
        assert got.release() is True
        assert after < WOKEN, f"in {after:.2f} s after the release"


def test_a_single_psycopg_connection_does_not_listen_a_pool_and_asyncpg_do(
    env: Env, url: str
) -> None:
    listens = store_of(env.make()).listens
    assert listens is (env.face == "async"), "asyncpg listens itself; one psycopg connection not"
    with psycopg_pool.ConnectionPool(url, min_size=1, max_size=2, open=True) as pool:
        assert store_of(RWFace("sync", pool, service_name=env.service)).listens is True


def test_a_release_through_a_client_that_does_not_listen_wakes_a_pools_waiter(
    url: str, service: str
) -> None:
    """The release's NOTIFY is the write's (rwcas.py, rule 5), whatever its own client.

    As a mutex's release through a single psycopg connection wakes a pool's
    waiter (docs/usage/readwrite.md: "a change that can let a waiter in ...
    notifies in the write's own statement").
    """
    with (
        psycopg.connect(url, autocommit=True) as conn,
        psycopg_pool.ConnectionPool(url, min_size=1, max_size=4, open=True) as pool,
    ):
        holder = RWFace("sync", conn, service_name=service)
        holder.target.ready()
        assert store_of(holder).listens is False
        rw, seen, hold = listening(pool, service, holder, "read")
        # timeout=4: unwoken, its last attempt (at the deadline) gets in, ~3.7 s late.
        got, after = waited(rw, seen, "read", hold, timeout=4.0, settle=SETTLE)
        assert got.release() is True
        assert after < WOKEN, f"in {after:.2f} s after the release"

"""Read-write locks on a real PostgreSQL server (``PostgresReadWriteStore``), public classes.

What is checked, through ``DReadWriteLock`` on psycopg (a single connection,
or a ``psycopg_pool.ConnectionPool``) and ``AsyncDReadWriteLock`` on asyncpg
(``tests._support.rwfaces`` gives both one sync interface), with a plain
psycopg connection reading and changing the table behind the store's back:

- the rules of ``dmutex._core.readwrite``: readers share, a writer excludes
  everyone, ``max_readers``; a waiting writer's intent refuses new readers,
  and its grant, its release by token and its giving up withdraw it;
- fences: every grant's above the one before, a writer's above every
  earlier reader's, the row's ``"f"`` the last one granted; ``fencing=False``
  shows none;
- the layout byte for byte (``sql_readwrite.py``, ``rwstate.py``): the one
  row ``rwlock:{k}`` of ``_drwlock_{service}``, its JSON text (fields in
  order, tokens sorted, ``"f"`` last), its ``expired_at`` the forever value,
  the row kept once everything is released;
- a row of that key that dmutex did not write: every operation raises
  ``DMutexError`` and leaves it as it was;
- statements, counted by a recording psycopg connection: a grant is a read
  and a write, a refused attempt the read alone, a release a read and a
  write, ``holders`` the read alone;
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

import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import quote

import asyncpg
import psycopg
import psycopg_pool
import pytest

from dmutex import AsyncDReadLock, DMutexError, DReadLock
from dmutex._backends.postgres.statements import FOREVER
from dmutex._core.lease import EPOCH, Lease
from dmutex._core.readwrite import READ_SLOT, WRITE_SLOT
from tests._support.faces import FaceName, Handle, LoopThread
from tests._support.rwfaces import RWFace, Side
from tests._support.rwrows import hold_expired

KEY = "orders"
ROW = f"rwlock:{KEY}"
TTL = 30.0
STRANGER = "6f1c1a9e-3d0b-4c55-9b1e-1f2a3b4c5d6e"
# A waiter that nothing wakes waits U(0.5, 1) * this after a refused attempt
# (at least 5 s); a woken one must be in within WOKEN of the release.
LONG_DELAY = 10.0
WOKEN = 2.5
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


def granted(handle: Handle | None) -> Handle:
    assert handle is not None, "expected the hold to be granted"
    return handle


def fence_of(handle: Handle) -> int:
    assert handle.fence is not None, "read-write locks fence by default"
    return handle.fence


def is_read(handle: Handle) -> bool:
    return isinstance(handle.raw, (DReadLock, AsyncDReadLock))


def ms_of(moment: datetime) -> int:
    return (moment - EPOCH) // timedelta(milliseconds=1)


def held(rw: RWFace, key: str = KEY) -> list[tuple[int, str]]:
    return sorted((h.slot, h.token) for h in rw.holders(key).holders)


def store_of(rw: RWFace) -> Any:
    """The lock's ``PostgresReadWriteStore`` (both sides share it)."""
    return rw.target._reading._store._store  # type: ignore[attr-defined]


def send(rw: RWFace, token: str, ttl_ms: int, *, write: bool) -> Lease | None:
    """One attempt of the store's own, with a token of the caller's (a retrying writer's next)."""
    engine = rw.target._writing if write else rw.target._reading
    drive: Any = rw.target._drive
    lease: Lease | None = rw.wait(drive(engine._store.acquire(KEY, token, ttl_ms, None)))
    return lease


def text(
    writer: tuple[str, int] | None,
    readers: dict[str, int],
    intents: dict[str, int],
    fence: int,
) -> str:
    """The row's value as ``rwstate.py`` documents it, written out by hand."""
    w = "null" if writer is None else f'["{writer[0]}",{writer[1]}]'
    r = ",".join(f'"{t}":{e}' for t, e in sorted(readers.items()))
    i = ",".join(f'"{t}":{e}' for t, e in sorted(intents.items()))
    return f'{{"dmutex":"rwlock","w":{w},"r":{{{r}}},"i":{{{i}}},"f":{fence}}}'


def wait_for(condition: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


# --- the rules ----------------------------------------------------------------------------


def test_readers_share_and_a_writer_excludes_everyone(env: Env) -> None:
    lock, other = env.make(), env.make()
    a, b = granted(lock.acquire("read", KEY, TTL)), granted(other.acquire("read", KEY, TTL))
    assert is_read(a)
    assert is_read(b)
    assert held(lock) == sorted([(READ_SLOT, a.token), (READ_SLOT, b.token)])
    assert other.acquire("write", KEY, TTL) is None
    assert a.release() is True
    assert other.acquire("write", KEY, TTL) is None, "one reader is still in"
    assert b.release() is True
    writer = granted(other.acquire("write", KEY, TTL))
    assert not is_read(writer)
    assert held(lock) == [(WRITE_SLOT, writer.token)]
    assert lock.acquire("read", KEY, TTL) is None
    assert lock.acquire("write", KEY, TTL) is None
    assert other.acquire("write", KEY, TTL) is None, "a writer's second hold is refused too"
    assert granted(lock.acquire("read", "another key", TTL)).release() is True  # keys are apart
    assert writer.release() is True
    assert writer.release() is False
    assert a.release() is False
    assert granted(lock.acquire("read", KEY, TTL)).release() is True
    assert env.keys() == ["rwlock:another key", ROW]


def test_max_readers(env: Env) -> None:
    lock = env.make(max_readers=2)
    a = granted(lock.acquire("read", KEY, TTL))
    granted(env.make(max_readers=2).acquire("read", KEY, TTL))
    assert lock.acquire("read", KEY, TTL) is None, "a third reader"
    assert a.release() is True
    granted(lock.acquire("read", KEY, TTL))
    assert lock.acquire("read", KEY, TTL) is None
    assert len(json.loads(env.value())["r"]) == 2


def test_fences_rise_and_a_writers_is_above_every_earlier_grant(env: Env) -> None:
    lock, other = env.make(), env.make()
    before = env.now_us()
    r1, r2 = granted(lock.acquire("read", KEY, TTL)), granted(other.acquire("read", KEY, TTL))
    after = env.now_us()
    assert before <= fence_of(r1) <= after, "the first fence is the server's clock in µs"
    assert r1.release()
    assert r2.release()
    w1 = granted(lock.acquire("write", KEY, TTL))
    assert w1.release()
    r3 = granted(other.acquire("read", KEY, TTL))
    assert lock.acquire("write", KEY, TTL) is None
    r4 = granted(lock.acquire("read", KEY, TTL))
    assert r3.release()
    assert r4.release()
    w2 = granted(other.acquire("write", KEY, TTL))
    seen = [fence_of(h) for h in (r1, r2, w1, r3, r4, w2)]
    assert seen == sorted(set(seen)), f"not strictly rising: {seen}"
    assert fence_of(w1) > max(fence_of(r1), fence_of(r2))
    assert fence_of(w2) > max(fence_of(r3), fence_of(r4))
    assert json.loads(env.value())["f"] == fence_of(w2), "the row keeps the last fence"
    assert lock.holders(KEY).fence == fence_of(w2)
    assert w2.release()
    assert json.loads(env.value())["f"] == fence_of(w2), "a release leaves the counter"
    assert fence_of(granted(lock.acquire("read", KEY, TTL))) > fence_of(w2)


def test_fencing_off_shows_no_fence(env: Env) -> None:
    lock = env.make(fencing=False)
    reader = granted(lock.acquire("read", KEY, TTL))
    assert reader.fence is None
    assert lock.holders(KEY).fence is None
    assert reader.release() is True
    writer = granted(lock.acquire("write", KEY, TTL))
    assert writer.fence is None
    assert lock.holders(KEY).fence is None
    assert writer.release() is True


def test_a_waiting_writers_intent_refuses_new_readers_and_its_grant_withdraws_it(
    env: Env,
) -> None:
    lock, writer = env.make(), env.make()
    reader = granted(lock.acquire("read", KEY, TTL))
    started = env.now_us() // 1000
    done, token, window_ms = writer.intend(KEY, TTL, retry_delay=0.5)
    ended = env.now_us() // 1000
    assert not done
    assert window_ms == 2500, "retry_delay + 2 s"
    intents = json.loads(env.value())["i"]
    assert list(intents) == [token]
    assert started + window_ms <= intents[token] <= ended + window_ms
    assert lock.acquire("read", KEY, TTL) is None, "a new reader passed a waiting writer"
    assert reader.extend(TTL) is True, "a reader already in keeps its hold"
    assert reader.release() is True
    assert lock.acquire("read", KEY, TTL) is None, "the intent stands with no one inside"
    won = send(writer, token, 30_000, write=True)
    assert won is not None, "the waiting writer gets in once the readers are gone"
    state = json.loads(env.value())
    assert (state["w"][0], state["r"], state["i"]) == (token, {}, {}), "its grant withdrew it"
    assert writer.release_token(KEY, token) is True
    granted(lock.acquire("read", KEY, TTL))


def test_a_writer_waiting_in_a_thread_holds_readers_back_until_it_gets_in(env: Env) -> None:
    lock, writer = env.make(), env.make()
    reader = granted(lock.acquire("read", KEY, TTL))
    result: list[Handle | None] = []

    def write() -> None:
        result.append(
            writer.acquire_with_retry("write", KEY, ttl=TTL, timeout=20.0, retry_delay=0.2)
        )

    thread = threading.Thread(target=write)
    thread.start()
    try:
        wait_for(lambda: bool(json.loads(env.value())["i"]), "the writer's attempt left no intent")
        assert lock.acquire("read", KEY, TTL) is None, "a new reader passed a waiting writer"
        assert reader.extend(TTL) is True
        assert reader.release() is True
    finally:
        thread.join(20.0)
    assert not thread.is_alive()
    won = granted(result[0])
    assert not is_read(won)
    state = json.loads(env.value())
    assert (state["w"][0], state["r"], state["i"]) == (won.token, {}, {})
    assert won.release() is True


def test_a_writer_that_gives_up_or_is_released_withdraws_its_intent(env: Env) -> None:
    lock, writer = env.make(), env.make()
    reader = granted(lock.acquire("read", KEY, TTL))
    gave_up = writer.acquire_with_retry("write", KEY, ttl=TTL, timeout=0.4, retry_delay=0.1)
    assert gave_up is None
    assert json.loads(env.value())["i"] == {}, "its last attempt withdrew the intent"
    granted(lock.acquire("read", KEY, TTL))
    _, token, _ = writer.intend(KEY, TTL, retry_delay=0.5)
    assert lock.acquire("read", KEY, TTL) is None
    assert writer.release_token(KEY, token) is False, "an intent is no hold"
    assert json.loads(env.value())["i"] == {}
    granted(lock.acquire("read", KEY, TTL))
    assert reader.release() is True


# --- the layout, byte for byte ------------------------------------------------------------


def test_the_table_and_the_row_byte_for_byte(env: Env) -> None:
    lock, other = env.make(), env.make()
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
    a = granted(lock.acquire("read", KEY, 30.0))
    b = granted(other.acquire("read", KEY, 45.5))
    readers = {a.token: ms_of(a.expired_at), b.token: ms_of(b.expired_at)}
    assert fence_of(b) > fence_of(a)
    assert env.stored() == (text(None, readers, {}, fence_of(b)), FOREVER)
    assert env.keys() == [ROW], "one row per key, the fence counter inside it"

    _, token, _ = other.intend(KEY, TTL, retry_delay=0.5)
    until = json.loads(env.value())["i"][token]
    assert env.stored() == (text(None, readers, {token: until}, fence_of(b)), FOREVER)
    assert other.release_token(KEY, token) is False
    assert a.release() is True
    assert env.stored() == (text(None, {b.token: readers[b.token]}, {}, fence_of(b)), FOREVER)
    assert b.release() is True
    assert env.stored() == (text(None, {}, {}, fence_of(b)), FOREVER), "the row stays"

    writer = granted(lock.acquire("write", KEY, 12.345))
    expires = ms_of(writer.expired_at)
    assert env.stored() == (text((writer.token, expires), {}, {}, fence_of(writer)), FOREVER)
    assert writer.release() is True
    assert env.stored() == (text(None, {}, {}, fence_of(writer)), FOREVER)

    # A writer whose hold ran out: the next change drops it, its fence kept below.
    late = granted(lock.acquire("write", KEY, TTL))
    env.expire(late.token)
    reader = granted(other.acquire("read", KEY, TTL))
    assert fence_of(reader) > fence_of(late)
    assert env.stored() == (
        text(None, {reader.token: ms_of(reader.expired_at)}, {}, fence_of(reader)),
        FOREVER,
    )
    assert late.release() is False
    assert reader.release() is True
    assert env.stored() == (text(None, {}, {}, fence_of(reader)), FOREVER)
    assert env.keys() == [ROW]


# --- a row dmutex did not write -----------------------------------------------------------

FOREIGN = [
    STRANGER,  # a token, as a lock of another program
    "{not json",
    '{"dmutex":"rwlock","w":null,"r":{},"i":{}}',  # no fence counter: SQLite's layout
    '{"dmutex":"mutex","w":null,"r":{},"i":{},"f":0}',  # another mark
    '{"dmutex":"rwlock","w":null,"r":{},"i":{},"f":0,"v":2}',  # a field not known
    '{"dmutex":"rwlock","w":null,"r":{"t":1.5},"i":{},"f":0}',  # an expiry not an integer
]


@pytest.mark.parametrize("value", FOREIGN)
def test_a_row_dmutex_did_not_write_raises_and_is_left_alone(env: Env, value: str) -> None:
    lock = env.make()
    env.raw.execute(
        f'INSERT INTO "{env.table}" VALUES (%s, %s, %s::timestamptz)',
        (ROW, value, "1970-01-01 00:00:00+00"),  # long expired: an expiry would not save it
    )
    stored = env.stored()
    assert stored == (value, "1970-01-01 00:00:00+00")
    calls: list[Callable[[], object]] = [
        lambda: lock.acquire("read", KEY, TTL),
        lambda: lock.acquire("write", KEY, TTL),
        lambda: lock.acquire_with_retry("write", KEY, ttl=TTL, timeout=0.05, retry_delay=0.01),
        lambda: lock.release_token(KEY, STRANGER),
        lambda: lock.extend(KEY, STRANGER, TTL),
        lambda: lock.holders(KEY),
    ]
    message = re.escape(f"the row '{ROW}' of table ") + r".*did not write"
    for call in calls:
        with pytest.raises(DMutexError, match=message):
            call()
        assert env.stored() == stored
    assert granted(lock.acquire("read", "another key", TTL)).release() is True


# --- statements per operation -------------------------------------------------------------


def test_statements_per_operation(url: str, raw: PgConnection, service: str) -> None:
    conn = Recording.connect(url, autocommit=True)
    conn.sent = []
    try:
        lock = RWFace("sync", conn, service_name=service)
        lock.target.ready()
        conn.taken()
        first = granted(lock.acquire("read", KEY, TTL))
        assert conn.taken() == ["SELECT", "WITH"], "a grant: the read, then the write"
        second = granted(lock.acquire("read", KEY, TTL))
        assert conn.taken() == ["SELECT", "WITH"]
        assert lock.acquire("write", KEY, TTL) is None
        assert conn.taken() == ["SELECT"], "a refused writer (no intent: one attempt)"
        assert [h.token for h in lock.holders(KEY).holders] == sorted([first.token, second.token])
        assert conn.taken() == ["SELECT"], "holders: the read alone"
        assert first.extend(TTL) is True
        assert conn.taken() == ["SELECT", "WITH"]
        assert first.release() is True
        assert conn.taken() == ["SELECT", "WITH"]
        assert first.release() is False
        assert conn.taken() == ["SELECT"], "nothing to release: nothing written"
        assert second.release() is True
        assert conn.taken() == ["SELECT", "WITH"]
        writer = granted(lock.acquire("write", KEY, TTL))
        assert conn.taken() == ["SELECT", "WITH"]
        assert lock.acquire("read", KEY, TTL) is None
        assert conn.taken() == ["SELECT"], "a refused reader: the read alone"
        assert writer.release() is True
        assert conn.taken() == ["SELECT", "WITH"]
        assert lock.release_token("never held", STRANGER) is False
        assert conn.taken() == ["SELECT"], "no row: nothing written"
        assert lock.holders("never held").holders == []
        assert conn.taken() == ["SELECT"]
        found = raw.execute(f'SELECT count(*) FROM "_drwlock_{service}"').fetchone()
        assert found == (1,), "a key that was never held has no row"
    finally:
        conn.close()


# --- waiting ------------------------------------------------------------------------------


@dataclass
class Watch:
    """What a store's ``wait`` saw: when the first began, how each ended, an early release."""

    waiting: threading.Event = field(default_factory=threading.Event)
    woken: list[bool] = field(default_factory=list)
    released: list[tuple[float, bool]] = field(default_factory=list)


def watch(store: Any, early: Handle | None = None) -> Watch:
    """Wrap ``store.wait``; ``early`` is released as the first wait begins, before it listens."""
    seen = Watch()
    wait = store.wait

    def watched(key: str, waiter: Any, seconds: float) -> Any:
        if early is not None and not seen.waiting.is_set():
            seen.released.append((time.monotonic(), early.release()))
        seen.waiting.set()
        yield from wait(key, waiter, seconds)
        seen.woken.append(bool(waiter.woken))

    store.wait = watched
    return seen


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


def waited(
    rw: RWFace, seen: Watch, side: Side, hold: Handle | None, *, timeout: float = 30.0
) -> tuple[Handle, float]:
    """``rw``'s retrying acquire in a thread: what it got, and how long after the release.

    ``hold``: released here once the first wait began and had time to listen;
    None: released by that wait as it began (``watch(early=...)``).
    """
    result: list[tuple[Handle | None, float]] = []

    def take() -> None:
        got = rw.acquire_with_retry(side, KEY, ttl=TTL, timeout=timeout, retry_delay=LONG_DELAY)
        result.append((got, time.monotonic()))

    thread = threading.Thread(target=take)
    thread.start()
    try:
        assert seen.waiting.wait(10.0), "the first attempt was not refused"
        if hold is not None:
            time.sleep(0.3)  # into its LISTEN (a release before it is found by its probe)
            seen.released.append((time.monotonic(), hold.release()))
    finally:
        thread.join(30.0)
    assert not thread.is_alive()
    ((released, done),) = seen.released
    assert done is True, "the hold in the way was released"
    got, at = result[0]
    return granted(got), at - released


def test_a_pools_waiters_listen_and_a_release_wakes_them(url: str, service: str) -> None:
    with psycopg_pool.ConnectionPool(url, min_size=1, max_size=4, open=True) as pool:
        holder = RWFace("sync", pool, service_name=service)
        holder.target.ready()
        sides: list[Side] = ["read", "write"]
        for side in sides:
            rw, seen, hold = listening(pool, service, holder, side)
            got, after = waited(rw, seen, side, hold)
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
    """The release's NOTIFY is the write's (sql_readwrite.py, rule 5), whatever its own client.

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
        got, after = waited(rw, seen, "read", hold, timeout=4.0)
        assert got.release() is True
        assert after < WOKEN, f"in {after:.2f} s after the release"

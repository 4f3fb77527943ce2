"""Read-write locks on a real MariaDB/MySQL server (``MySQLReadWriteStore``), public classes.

What is checked, through ``DReadWriteLock`` on PyMySQL and
``AsyncDReadWriteLock`` on aiomysql (``tests._support.rwfaces`` gives both
one sync interface), with a plain PyMySQL connection reading and changing
the table behind the store's back:

- the rules of ``dmutex._core.readwrite``: readers share, a writer excludes
  everyone, ``max_readers``; a waiting writer's intent refuses new readers,
  and its grant, its release by token and its giving up withdraw it;
- fences: every grant's above the one before, a writer's above every
  earlier reader's, the row's ``"f"`` the last one granted; ``fencing=False``
  shows none;
- the layout byte for byte (``sql_readwrite.py``, ``rwstate.py``): the table
  ``_drwlock_{service}`` (the mutex table's shape, its ``value`` column
  ``mediumtext`` in a binary collation), its one row ``rwlock:{k}``, that
  row's JSON text (fields in order, tokens sorted, ``"f"`` last), its
  ``expired_at`` the forever value, the row kept once everything is
  released;
- a row of that key that dmutex did not write: every operation raises
  ``DMutexError`` and leaves it as it was;
- statements, counted by a recording PyMySQL connection: a grant is a read
  and a write, a refused attempt the read alone, a release a read and a
  write, ``holders`` the read alone;
- waiting: a release wakes a writer (or a reader) waiting through the same
  client object long before its ``retry_delay``, even one that lands between
  the waiter's refused attempt and its wait (it registered first).

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
from typing import TYPE_CHECKING, Any

import aiomysql
import pytest
from pymysql.connections import Connection
from pymysql.cursors import Cursor

from dmutex import AsyncDReadLock, DMutexError, DReadLock
from dmutex._backends.mysql.statements import COLLATIONS
from dmutex._core.lease import EPOCH, Lease
from dmutex._core.readwrite import READ_SLOT, WRITE_SLOT
from tests._support.faces import FaceName, Handle, LoopThread
from tests._support.mysql_servers import (
    CONNECT_TIMEOUT,
    Server,
    Session,
    connect_args,
    without_tls,
)
from tests._support.rwfaces import RWFace, Side
from tests._support.rwrows import hold_expired

if TYPE_CHECKING:
    _Connection = Connection[Cursor]
else:
    _Connection = Connection

KEY = "orders"
ROW = f"rwlock:{KEY}"
TTL = 30.0
FOREVER = 253370764800000  # 9999-01-01T00:00:00Z in epoch ms
STRANGER = "6f1c1a9e-3d0b-4c55-9b1e-1f2a3b4c5d6e"
# A waiter that nothing wakes waits U(0.5, 1) * this after a refused attempt
# (at least 5 s); a woken one must be in within WOKEN of the release.
LONG_DELAY = 10.0
WOKEN = 2.5
FACES: dict[str, FaceName] = {"pymysql": "sync", "aiomysql": "async"}
NOW_US = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))"


# --- the rig ------------------------------------------------------------------------------


class Counting(_Connection):
    """A PyMySQL connection that records each query it sends (one round trip each)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sent: list[str] = []  # before connecting: an init_command is a query
        super().__init__(*args, **kwargs)

    def query(self, sql: Any, unbuffered: bool = False) -> int:
        self.sent.append(sql.decode() if isinstance(sql, bytes) else str(sql))
        return super().query(sql, unbuffered)

    def commit(self) -> None:
        self.sent.append("COMMIT")
        super().commit()

    def rollback(self) -> None:
        self.sent.append("ROLLBACK")
        super().rollback()

    def taken(self) -> list[str]:
        """The first word of each statement sent since the last call; then forgets them."""
        found = [text.split(None, 1)[0].upper() for text in self.sent]
        self.sent.clear()
        return found


def connect(server: Server, cls: type[_Connection] = _Connection) -> _Connection:
    """A new connection of ``cls`` in the session's database, in autocommit."""
    args = connect_args(server.url)
    args["database"] = server.database
    return cls(
        **args,
        autocommit=True,
        connect_timeout=CONNECT_TIMEOUT,
        ssl_disabled=without_tls(server.url),
    )


def fetch(conn: _Connection, sql: str, args: tuple[object, ...] | None = None) -> list[Any]:
    with conn.cursor() as cursor:
        cursor.execute(sql, args)
        return list(cursor.fetchall())


def quoted(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


@pytest.fixture
def server(mysql_session: Session) -> Server:
    return mysql_session.server()


@pytest.fixture
def raw(server: Server) -> Iterator[_Connection]:
    """Another program's connection: reads and changes the table behind the store's back."""
    conn = connect(server)
    try:
        yield conn
    finally:
        conn.close()


@pytest.fixture
def service(raw: _Connection) -> Iterator[str]:
    """A service name of the test's own, so a table of its own; dropped afterwards."""
    name = f"rw{uuid.uuid4().hex[:12]}"
    yield name
    fetch(raw, f"DROP TABLE IF EXISTS {quoted(f'_drwlock_{name}')}")


@dataclass
class Env:
    """One client of one face, the service's table, and the plain connection to look at it."""

    face: FaceName
    client: object
    service: str
    raw: _Connection
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

    def stored(self) -> tuple[str, int] | None:
        """The row ``rwlock:{KEY}``: its value and its ``expired_at``."""
        found = fetch(
            self.raw,
            f"SELECT `value`, `expired_at` FROM {quoted(self.table)} WHERE `key` = %s",
            (ROW,),
        )
        if not found:
            return None
        ((value, expires),) = found
        return (value.decode() if isinstance(value, bytes) else str(value)), int(expires)

    def value(self) -> str:
        found = self.stored()
        assert found is not None, f"no row {ROW}"
        return found[0]

    def keys(self) -> list[str]:
        found = fetch(self.raw, f"SELECT `key` FROM {quoted(self.table)} ORDER BY `key`")
        return [key.decode() if isinstance(key, bytes) else str(key) for (key,) in found]

    def now_us(self) -> int:
        """The server's clock in µs (the store reads its time from the same clock)."""
        ((now,),) = fetch(self.raw, f"SELECT {NOW_US}")
        return int(now)

    def expire(self, token: str) -> None:
        """Let ``token``'s hold run out now, by the server's clock, in the row's JSON."""
        fetch(
            self.raw,
            f"UPDATE {quoted(self.table)} SET `value` = %s WHERE `key` = %s",
            (hold_expired(self.value(), token, self.now_us() // 1000), ROW),
        )


def _open(face: str, server: Server, env: Env) -> None:
    if face == "pymysql":
        conn = connect(server)
        env.client = conn
        env.closing.append(conn.close)
        return
    loop = env.loop = LoopThread()
    args = connect_args(server.url)

    async def open_client() -> aiomysql.Connection:
        return await aiomysql.connect(
            host=args["host"],
            port=args["port"],
            user=args["user"],
            password=args["password"],
            db=server.database,
            charset="utf8mb4",
            autocommit=True,
        )

    made = loop.run(open_client())
    env.client = made

    async def close() -> None:
        made.close()

    env.closing.append(lambda: loop.run(close()))
    env.closing.append(loop.close)


@pytest.fixture(params=list(FACES))
def env(
    request: pytest.FixtureRequest, server: Server, raw: _Connection, service: str
) -> Iterator[Env]:
    made = Env(FACES[request.param], None, service, raw)
    try:
        _open(request.param, server, made)
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


def test_the_table_and_the_row_byte_for_byte(env: Env, server: Server) -> None:
    lock, other = env.make(), env.make()
    collation = COLLATIONS[server.flavour]
    assert collation.endswith("_bin")
    columns = fetch(
        env.raw,
        "SELECT COLUMN_NAME, COLUMN_TYPE, IS_NULLABLE, CHARACTER_SET_NAME, COLLATION_NAME, "
        "COLUMN_KEY FROM information_schema.COLUMNS "
        "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
        (env.table,),
    )
    bigint = "bigint(20)" if server.flavour == "mariadb" else "bigint"
    assert columns == [
        ("key", "varchar(512)", "NO", "utf8mb4", collation, "PRI"),
        ("value", "mediumtext", "NO", "utf8mb4", collation, ""),
        ("expired_at", bigint, "NO", None, None, "MUL"),
    ]
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
    # Long expired: an expiry would not save it.
    fetch(env.raw, f"INSERT INTO {quoted(env.table)} VALUES (%s, %s, 0)", (ROW, value))
    stored = env.stored()
    assert stored == (value, 0)
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


def test_statements_per_operation(server: Server, raw: _Connection, service: str) -> None:
    conn = connect(server, Counting)
    assert isinstance(conn, Counting)
    try:
        lock = RWFace("sync", conn, service_name=service)
        lock.target.ready()
        conn.taken()
        first = granted(lock.acquire("read", KEY, TTL))
        assert conn.taken() == ["SELECT", "INSERT"], "a grant: the read, then the write"
        second = granted(lock.acquire("read", KEY, TTL))
        assert conn.taken() == ["SELECT", "INSERT"]
        assert lock.acquire("write", KEY, TTL) is None
        assert conn.taken() == ["SELECT"], "a refused writer (no intent: one attempt)"
        assert [h.token for h in lock.holders(KEY).holders] == sorted([first.token, second.token])
        assert conn.taken() == ["SELECT"], "holders: the read alone"
        assert first.extend(TTL) is True
        assert conn.taken() == ["SELECT", "INSERT"]
        assert first.release() is True
        assert conn.taken() == ["SELECT", "INSERT"]
        assert first.release() is False
        assert conn.taken() == ["SELECT"], "nothing to release: nothing written"
        assert second.release() is True
        assert conn.taken() == ["SELECT", "INSERT"]
        writer = granted(lock.acquire("write", KEY, TTL))
        assert conn.taken() == ["SELECT", "INSERT"]
        assert lock.acquire("read", KEY, TTL) is None
        assert conn.taken() == ["SELECT"], "a refused reader: the read alone"
        assert writer.release() is True
        assert conn.taken() == ["SELECT", "INSERT"]
        assert lock.release_token("never held", STRANGER) is False
        assert conn.taken() == ["SELECT"], "no row: nothing written"
        assert lock.holders("never held").holders == []
        assert conn.taken() == ["SELECT"]
        table = quoted(f"_drwlock_{service}")
        assert fetch(raw, f"SELECT COUNT(*) FROM {table}") == [(1,)], "no row for a key never held"
    finally:
        conn.close()


# --- waiting ------------------------------------------------------------------------------


def store_of(rw: RWFace) -> Any:
    """The lock's ``MySQLReadWriteStore`` (both sides share it)."""
    return rw.target._reading._store._store  # type: ignore[attr-defined]


@dataclass
class Watch:
    """What a store's ``wait`` saw: when the first began, and an early release's time."""

    waiting: threading.Event = field(default_factory=threading.Event)
    released: list[tuple[float, bool]] = field(default_factory=list)


def watch(store: Any, early: Handle | None = None) -> Watch:
    """Wrap ``store.wait``; ``early`` is released as the first wait begins (sync face only)."""
    seen = Watch()
    wait = store.wait

    def watched(key: str, waiter: Any, seconds: float) -> Any:
        if early is not None and not seen.waiting.is_set():
            seen.released.append((time.monotonic(), early.release()))
        seen.waiting.set()
        yield from wait(key, waiter, seconds)

    store.wait = watched
    return seen


def waited(
    rw: RWFace, seen: Watch, side: Side, hold: Handle | None, *, timeout: float = 30.0
) -> tuple[Handle, float]:
    """``rw``'s retrying acquire in a thread: what it got, and how long after the release.

    ``hold``: released here once the first wait began; None: released by that
    wait as it began (``watch(early=...)``).
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
            seen.released.append((time.monotonic(), hold.release()))
    finally:
        thread.join(30.0)
    assert not thread.is_alive()
    ((released, done),) = seen.released
    assert done is True, "the hold in the way was released"
    got, at = result[0]
    return granted(got), at - released


def test_a_release_wakes_a_waiter_through_the_same_client(env: Env) -> None:
    holder = env.make()
    sides: list[Side] = ["write", "read"]
    for side in sides:
        rw = env.make()  # another instance, the same client object
        seen = watch(store_of(rw))
        hold = granted(holder.acquire("read" if side == "write" else "write", KEY, TTL))
        got, after = waited(rw, seen, side, hold)
        assert after < WOKEN, f"a {side}r in {after:.2f} s after the release"
        assert is_read(got) is (side == "read")
        state = json.loads(env.value())
        assert state["i"] == {}, "a writer's grant withdrew its intent"
        assert got.release() is True


def test_a_release_between_a_refused_attempt_and_its_wait_is_not_missed(
    server: Server, service: str
) -> None:
    """The waiter is registered before its attempt: a wake before its wait ends that wait."""
    conn = connect(server)
    try:
        holder = RWFace("sync", conn, service_name=service)
        holder.target.ready()
        sides: list[Side] = ["write", "read"]
        for side in sides:
            rw = RWFace("sync", conn, service_name=service)
            hold = granted(holder.acquire("read" if side == "write" else "write", KEY, TTL))
            seen = watch(store_of(rw), early=hold)
            got, after = waited(rw, seen, side, None)
            assert after < WOKEN, f"a {side}r in {after:.2f} s after the release"
            assert got.release() is True
    finally:
        conn.close()

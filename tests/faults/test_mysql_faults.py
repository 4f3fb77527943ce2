"""MySQL / MariaDB through faults: what the rows say afterwards.

What must hold, whatever happens to a request: **nothing lost** (a lease
the holder was told it has is a row holding its token until it lets go or
is told otherwise) and **no orphan** (a row of a raised or cancelled
acquire is released by its token before the error reaches the caller,
engine rule 6). Every scene ends by reading the table through a plain
PyMySQL connection of the test's own, behind dmutex's back ("no row left"
counts ``permit:`` rows: a fenced key's counter row, ``fence:k``, is no
lease and stays).

1. **Holes** (asyncio, on an aiomysql and an asyncmy connection whose
   replies a :class:`Gate` holds after the server ran the statement): an
   acquire cancelled after the server took the key releases it (mutex and
   ``max_permits=3``); a release cancelled in flight, in ``run()`` and in
   ``__aexit__`` (cancelled a second time there), still releases; a
   retrying acquire cancelled as a release through the same client wakes
   it (the store's rule 5: only such a release wakes a MySQL waiter at
   once) raises ``CancelledError``, sends no attempt after the wake, and
   leaves nothing.
2. **Lost reply**: a :class:`~tests._support.fault_proxy.FaultProxy` that
   lets only the take (``INSERT INTO``) be faulted drops its reply after
   the server ran it (``DROP_REPLY``: both sides closed). Through a pool
   (a SQLAlchemy ``Engine`` on PyMySQL; aiomysql and asyncmy pools) the
   acquire raises the driver's ``OperationalError``; just before the
   engine's clean-up ``DELETE`` is sent, on a fresh connection of the
   pool, the server holds exactly one row with the take's token, and after
   it none. On the store (no engine, so no clean-up): the same take sent
   again with the same token through the pool answers the slot the first
   copy took, and exactly one row holds the token. The engine's retrying
   acquire does not send another attempt after an attempt raised (it
   releases and re-raises), so the re-sent copy is driven on the store,
   as the PostgreSQL test does.
3. **Blackhole**: ``test_deadlines``' sync and asyncio cases on MySQL
   (:class:`MySQLDeadlineRig`: PyMySQL connections and aiomysql pools
   without any read timeout, one proxy per trial, six trials at TTLs of 1
   to 2 s): every way of telling the holder its lease is lost comes after
   the cut, before the TTL ran out since it, and before a direct second
   client is first granted the key; the margins join the terminal summary.
4. **Restart**: a lease renewed through a pool (a SQLAlchemy ``Engine``, or
   an aiomysql pool) while the session's restartable MariaDB is stopped
   (SIGTERM) or killed (SIGKILL) and started again within the lease's
   deadline: a renewal fails while the server is down, the next after the
   start succeeds, the lease is never reported lost, and the row holds the
   token with the expiry the handle shows; its release deletes it.
5. **Pause**: the restartable server SIGSTOPped right after a renewal was
   answered, and kept stopped until its own expiry of the row has passed.
   The next renewal is sent into the pause and hangs; the holder is told
   at its own deadline, while the server is still stopped, and before the
   row's expiry by the host's clock (which the server reads). After
   SIGCONT the hung renewal is answered late and changes nothing (the row
   has expired; the lease stays lost); a direct second client is granted
   the key only after the telling; the old holder's release answers False
   and leaves the new row as it was.
6. **Late take** (aiomysql and asyncmy, a pool and a single connection): a
   proxy holds the take 0.3 s, and still delivers it after the client
   closed (``deliver_late``), as a network delivers what was sent before a
   close. The acquire is cancelled while the driver awaits the take's
   reply, so the driver closes the connection. The runner ends that
   connection's session on the server before the clean-up (``runners.py``,
   rule 7): no row, then or once the take has arrived, and the next
   acquire through the same client is granted. Before, the clean-up ran
   first, the late take wrote its row for good, and a single connection
   raised ``InterfaceError`` ever after.

Times are ``time.monotonic()`` readings compared with each other, and for
scene 5 ``time.time()`` against the server's ``expired_at`` (one host, one
clock); no assertion bounds how fast anything is.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import os
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import aiomysql
import asyncmy
import asyncmy.errors
import pymysql
import pytest
import sqlalchemy
from pymysql.connections import Connection
from pymysql.cursors import Cursor

from dmutex import (
    AsyncDMutex,
    AsyncDMutexLock,
    AsyncDSemaphore,
    DMutex,
    DMutexLock,
    DSemaphore,
)
from dmutex._backends.mysql import MySQLStore
from dmutex._clock import SYSTEM_CLOCK
from dmutex._core.lease import Lease
from dmutex._core.waiting import Wakeup
from dmutex._runtime.drivers import AsyncDriver, SyncDriver
from tests._support.faces import Calls, FaceName, await_calls, run_calls
from tests._support.fault_proxy import Fault, FaultProxy, Rates
from tests._support.mysql_rows import NOW_MS, quoted
from tests._support.mysql_servers import (
    CONNECT_TIMEOUT,
    Restartable,
    Server,
    Session,
    aiomysql_connection,
    connect_args,
    url_of,
)
from tests._support.rivals import Direct
from tests._support.sampling import process_state, until
from tests.faults.deadlines import test_deadlines

if TYPE_CHECKING:
    _Connection = Connection[Cursor]
else:
    _Connection = Connection

T = TypeVar("T")

SEED = 20240611  # the proxies' faults are all or nothing here: the seed only fills the argument
SERVICE = "faults"
SCENE_TIMEOUT = 30.0  # any one asyncio scene, start to finish
STEP_TIMEOUT = 10.0  # any one wait for something to happen
ASYNC_DRIVERS = ["aiomysql", "asyncmy"]
# What a driver raises when the server's reply never comes: the connection closed under it.
LOST = (2006, 2013)  # "MySQL server has gone away", "Lost connection to MySQL server"
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def first_word(text: str) -> str:
    """A statement's first word, upper case: what kind of statement it is."""
    words = text.split(None, 1)
    return words[0].upper() if words else ""


def ms_of(handle: DMutexLock | AsyncDMutexLock) -> int:
    """A handle's expiry in epoch ms (it shows it as a datetime)."""
    return round((handle.expired_at - EPOCH).total_seconds() * 1000)


def table_name() -> str:
    return f"faults_{uuid.uuid4().hex[:12]}"


# --- the table, seen from a plain connection ----------------------------------------------


class Table:
    """One lock table through a PyMySQL connection of its own (threads share it in turn)."""

    def __init__(self, conn: _Connection, name: str) -> None:
        self.conn = conn
        self.name = name
        self.quoted = quoted(name)
        self._lock = threading.Lock()

    def _fetch(self, sql: str, args: tuple[object, ...] | None = None) -> list[tuple[Any, ...]]:
        with self._lock, self.conn.cursor() as cursor:
            cursor.execute(sql, args)
            return list(cursor.fetchall())

    def rows(self) -> dict[str, tuple[str, int]]:
        """Every row, live or not: ``{key: (value, expired_at)}``; none if there is no table."""
        try:
            found = self._fetch(f"SELECT `key`, `value`, `expired_at` FROM {self.quoted}")
        except pymysql.err.ProgrammingError as error:
            if error.args[0] == 1146:  # ER_NO_SUCH_TABLE
                return {}
            raise
        return {str(key): (str(value), int(expires)) for key, value, expires in found}

    def permits(self) -> dict[str, tuple[str, int]]:
        """The permit rows, live or not (a fenced key's counter row, ``fence:k``, is no lease)."""
        return {key: row for key, row in self.rows().items() if key.startswith("permit:")}

    def live(self) -> dict[str, str]:
        """The permits active by the server's clock: ``{key: token}``."""
        found = self._fetch(
            f"SELECT `key`, `value` FROM {self.quoted} "
            f"WHERE `key` LIKE 'permit:%%' AND `expired_at` > {NOW_MS}"
        )
        return {str(key): str(value) for key, value in found}

    def holding(self, token: str) -> list[str]:
        """The keys of every row (live or not) that holds ``token``."""
        found = self._fetch(f"SELECT `key` FROM {self.quoted} WHERE `value` = %s", (token,))
        return sorted(str(key) for (key,) in found)

    def clear_permits(self) -> None:
        """Delete every permit row (a fenced key's counter row stays)."""
        self._fetch(f"DELETE FROM {self.quoted} WHERE `key` LIKE 'permit:%%'")

    def drop(self) -> None:
        self._fetch(f"DROP TABLE IF EXISTS {self.quoted}")


@pytest.fixture
def server(mysql_session: Session) -> Server:
    return mysql_session.server()


@pytest.fixture
def table(server: Server) -> Iterator[Table]:
    """A table name of the test's own in the session's database, dropped after."""
    conn = server.connect()
    found = Table(conn, table_name())
    try:
        yield found
    finally:
        found.drop()
        conn.close()


def pymysql_args(server: Server, host: str, port: int) -> dict[str, Any]:
    """PyMySQL's connect arguments for ``server``'s database at ``host:port`` (a proxy's, or its
    own); no read or write timeout: a request that gets no reply waits for ever."""
    args = connect_args(server.url)
    return {
        "host": host,
        "port": port,
        "user": args["user"],
        "password": args["password"],
        "database": server.database,
        "autocommit": True,
        "connect_timeout": CONNECT_TIMEOUT,
        "ssl_disabled": True,  # loopback only, and the proxy must see plain packets
    }


async def async_pool(
    driver: str, server: Server, host: str, port: int, size: int, least: int = 1
) -> Any:
    """An aiomysql or asyncmy pool on ``server``'s database at ``host:port``, in autocommit;
    ``least`` connections opened first and kept, ``size`` at most."""
    args = connect_args(server.url)
    common: dict[str, Any] = {
        "host": host,
        "port": port,
        "user": args["user"],
        "password": args["password"],
        "charset": "utf8mb4",
        "autocommit": True,
        "minsize": least,
        "maxsize": size,
    }
    if driver == "aiomysql":
        return await aiomysql.create_pool(db=server.database, **common)
    return await asyncmy.create_pool(database=server.database, **common)


async def close_pool(pool: Any) -> None:
    """Close ``pool`` and wait for its connections, forcing them after a bound."""
    pool.close()
    try:
        await asyncio.wait_for(pool.wait_closed(), STEP_TIMEOUT)
    except asyncio.TimeoutError:
        pool.terminate()
        await pool.wait_closed()


async def async_connection(
    driver: str, server: Server, host: str | None = None, port: int | None = None
) -> Any:
    """A single aiomysql or asyncmy connection in ``server``'s database, in autocommit; at
    ``host:port`` if given (a proxy's), else the server's own."""
    args = connect_args(server.url)
    host, port = host or args["host"], port or args["port"]
    if driver == "aiomysql":
        url = url_of(host, port, args["user"], args["password"])
        return await aiomysql_connection(url, server.database)
    return await asyncmy.connect(
        host=host,
        port=port,
        user=args["user"],
        password=args["password"],
        database=server.database,
        charset="utf8mb4",
        autocommit=True,
    )


def driver_failures(driver: str) -> tuple[type[Exception], ...]:
    """What ``driver`` raises for a connection that closed under a request."""
    if driver == "asyncmy-pool":
        return (asyncmy.errors.OperationalError,)
    return (pymysql.err.OperationalError,)  # PyMySQL's, and aiomysql's (it raises PyMySQL's)


def error_code(error: BaseException) -> object:
    return error.args[0] if error.args else None


# --- what each connection sent ---------------------------------------------------------------


@dataclass(frozen=True)
class Note:
    """One statement's start or end on one connection, or a connection that could not be made."""

    at: float  # time.monotonic()
    conn: int  # the connection's number, in the order the spy first saw each (-1: none)
    event: str  # "sent", "answered", "failed", "connect failed"
    word: str  # the statement's first word
    text: str  # its text (and parameters, on the asyncio drivers)
    error: BaseException | None = None


class Spy:
    """Every statement of a client's connections, in order; ``hook(note)`` sees each note as it is
    taken, in the thread or task of the statement (for ``sent``: before it goes out)."""

    def __init__(self, hook: Callable[[Note], None] | None = None) -> None:
        self.hook = hook
        self.notes: list[Note] = []
        self._conns: list[object] = []  # kept, so that identities are not reused
        self._lock = threading.Lock()

    def note(
        self, conn: object | None, event: str, text: str, error: BaseException | None = None
    ) -> Note:
        with self._lock:
            number = -1 if conn is None else self._number(conn)
            made = Note(time.monotonic(), number, event, first_word(text), text, error)
            self.notes.append(made)
        if self.hook is not None:
            self.hook(made)
        return made

    def _number(self, conn: object) -> int:
        for number, known in enumerate(self._conns):
            if known is conn:
                return number
        self._conns.append(conn)
        return len(self._conns) - 1

    def find(
        self,
        event: str,
        word: str | None = None,
        *,
        since: float = -math.inf,
        containing: str = "",
    ) -> list[Note]:
        """The notes of ``event`` (of ``word`` statements, taken at ``since`` or later, whose
        text contains ``containing``), in order."""
        with self._lock:
            notes = list(self.notes)
        return [
            n
            for n in notes
            if n.event == event
            and (word is None or n.word == word)
            and n.at >= since
            and containing in n.text
        ]


class Spied(_Connection):
    """A PyMySQL connection that notes each query it sends, and how it ended, in a :class:`Spy`."""

    def __init__(self, spy: Spy, **kwargs: Any) -> None:
        self.spy = spy  # before connecting: an init_command is a query
        super().__init__(**kwargs)

    def query(self, sql: Any, unbuffered: bool = False) -> int:
        text = sql.decode() if isinstance(sql, bytes) else str(sql)
        self.spy.note(self, "sent", text)
        try:
            result = super().query(sql, unbuffered)
        except BaseException as error:
            self.spy.note(self, "failed", text, error)
            raise
        self.spy.note(self, "answered", text)
        return result


def spied_engine(spy: Spy, args: Mapping[str, Any]) -> sqlalchemy.Engine:
    """A SQLAlchemy ``Engine`` (a pool of two) whose PyMySQL connections are :class:`Spied`; a
    connection that cannot be made is noted too."""

    def connect() -> Spied:
        try:
            return Spied(spy, **args)
        except Exception as error:
            spy.note(None, "connect failed", "", error)
            raise

    return sqlalchemy.create_engine(
        "mysql+pymysql://", creator=connect, pool_size=2, max_overflow=0
    )


# --- asyncio connections whose statements go through a sender -----------------------------------


class Sender(Protocol):
    """Sends one statement of ``conn``: ``request()`` sends it on the real connection."""

    async def send(
        self, conn: Intercepted, query: str, args: object, request: Callable[[], Awaitable[T]]
    ) -> T: ...


class Intercepted:
    """An aiomysql or asyncmy connection whose statements go through a :class:`Sender`.

    It has what dmutex reads of a connection (``runners.py``), and no more:
    after a cancellation (its rule 7) whether the driver closed it, its
    thread id, and ``ping`` to open it again.
    """

    def __init__(self, inner: Any, sender: Sender) -> None:
        self.inner = inner
        self.sender = sender

    @property
    def server_status(self) -> int:
        return int(self.inner.server_status)

    @property
    def closed(self) -> bool:
        closed = getattr(self.inner, "closed", None)  # aiomysql's; asyncmy says connected
        return closed if isinstance(closed, bool) else not self.inner.connected

    def thread_id(self) -> int:
        return int(self.inner.thread_id())

    async def ping(self, reconnect: bool = True) -> None:
        await self.inner.ping(reconnect=reconnect)

    def get_autocommit(self) -> bool:
        return bool(self.inner.get_autocommit())

    def get_server_info(self) -> str:
        return str(self.inner.get_server_info())

    async def commit(self) -> None:
        await self.inner.commit()

    async def rollback(self) -> None:
        await self.inner.rollback()

    async def cursor(self) -> InterceptedCursor:
        opened = self.inner.cursor()  # aiomysql: an awaitable of the cursor; asyncmy: the cursor
        cursor = await opened if inspect.isawaitable(opened) else opened
        return InterceptedCursor(cursor, self)


class InterceptedCursor:
    """A cursor of an :class:`Intercepted` connection: its ``execute`` goes through the sender."""

    def __init__(self, inner: Any, conn: Intercepted) -> None:
        self._inner = inner
        self._conn = conn

    @property
    def description(self) -> object:
        return self._inner.description

    @property
    def rowcount(self) -> object:
        return self._inner.rowcount

    @property
    def lastrowid(self) -> object:
        return self._inner.lastrowid

    async def execute(self, query: str, args: object = None) -> object:
        inner = self._inner
        return await self._conn.sender.send(
            self._conn, query, args, lambda: inner.execute(query, args)
        )

    async def fetchall(self) -> object:
        return await self._inner.fetchall()

    async def close(self) -> None:
        closing = self._inner.close()
        if inspect.isawaitable(closing):
            await closing


class InterceptedPool:
    """An aiomysql or asyncmy pool lending :class:`Intercepted` connections; a lend that fails
    (no server to connect to) is noted in ``spy``."""

    def __init__(self, inner: Any, sender: Sender, spy: Spy | None = None) -> None:
        self.inner = inner
        self.sender = sender
        self.spy = spy

    @property
    def freesize(self) -> int:
        return int(self.inner.freesize)

    def acquire(self) -> contextlib.AbstractAsyncContextManager[Intercepted]:
        return self._lent()

    @contextlib.asynccontextmanager
    async def _lent(self) -> AsyncIterator[Intercepted]:
        entered = False
        try:
            async with self.inner.acquire() as conn:
                entered = True
                yield Intercepted(conn, self.sender)
        except Exception as error:
            if not entered and self.spy is not None:
                self.spy.note(None, "connect failed", "", error)
            raise


class SpySender:
    """A :class:`Sender` that notes each statement in a :class:`Spy`, its parameters in the text."""

    def __init__(self, spy: Spy) -> None:
        self.spy = spy

    async def send(
        self, conn: Intercepted, query: str, args: object, request: Callable[[], Awaitable[T]]
    ) -> T:
        text = f"{query} -- {args!r}"
        self.spy.note(conn.inner, "sent", text)
        try:
            reply = await request()
        except BaseException as error:
            self.spy.note(conn.inner, "failed", text, error)
            raise
        self.spy.note(conn.inner, "answered", text)
        return reply


class Gate:
    """Each statement runs on the server; the reply of the one :meth:`hold` names waits for
    :attr:`opened`: the moment a cancellation can land between "done on the server" and
    "reply read". :attr:`sent` lists each statement as it is sent: (first word, its token)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str | None]] = []
        self.arrived = asyncio.Event()
        self.opened = asyncio.Event()
        self._held: str | None = None

    def hold(self, word: str) -> None:
        """Hold the reply of the next statement whose first word is ``word``."""
        self._held = word
        self.arrived.clear()
        self.opened.clear()

    def words(self) -> list[str]:
        return [word for word, _ in self.sent]

    async def send(
        self, conn: Intercepted, query: str, args: object, request: Callable[[], Awaitable[T]]
    ) -> T:
        word = first_word(query)
        token = args.get("token") if isinstance(args, Mapping) else None
        self.sent.append((word, None if token is None else str(token)))
        reply = await request()
        if word == self._held:
            self._held = None
            self.arrived.set()
            await self.opened.wait()
        return reply


async def until_async(condition: Callable[[], bool], what: str, timeout: float) -> None:
    """Poll ``condition()`` while the loop runs on; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {timeout} s")
        await asyncio.sleep(0.005)


# --- 1. holes: cancellations while a statement is in flight ------------------------------------

AsyncLock = AsyncDMutex | AsyncDSemaphore


def async_lock(client: Any, table: Table, permits: int) -> AsyncLock:
    if permits == 1:
        return AsyncDMutex(SERVICE, client, table_name=table.name)
    return AsyncDSemaphore(SERVICE, client, max_permits=permits, table_name=table.name)


def on_gated(
    driver: str, server: Server, scene: Callable[[Gate, Any], Awaitable[T]]
) -> tuple[Gate, T]:
    """``scene(gate, client)`` on a single ``driver`` connection whose replies ``gate`` holds."""

    async def main() -> tuple[Gate, T]:
        gate = Gate()
        conn = await async_connection(driver, server)
        try:
            return gate, await scene(gate, Intercepted(conn, gate))
        finally:
            conn.close()

    return asyncio.run(asyncio.wait_for(main(), SCENE_TIMEOUT))


@pytest.mark.parametrize("permits", [1, 3])
@pytest.mark.parametrize("driver", ASYNC_DRIVERS)
def test_an_acquire_cancelled_after_the_server_took_the_key_releases_it(
    driver: str, permits: int, server: Server, table: Table
) -> None:
    """The take ran on the server, its reply did not reach the caller: released by its token."""

    async def scene(gate: Gate, client: Any) -> dict[str, str]:
        lock = async_lock(client, table, permits)
        await lock.ready()
        gate.sent.clear()
        gate.hold("INSERT")
        task = asyncio.create_task(lock.acquire("k", ttl=60))
        await gate.arrived.wait()
        taken = await asyncio.to_thread(table.live)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return taken

    gate, taken = on_gated(driver, server, scene)
    assert len(taken) == 1, f"the server took the key: {taken}"
    ((row, token),) = taken.items()
    assert row in {f"permit:{slot}:k" for slot in range(permits)}
    took = [("INSERT", token), ("DELETE", token)]
    assert gate.sent == (took if permits == 1 else [("SELECT", None), *took]), (
        "the take, then its release by the same token"
    )
    assert table.permits() == {}, "no row left"


async def release_held_in_run(gate: Gate, client: Any, table: Table) -> None:
    """``run()`` cancelled while its release's reply is held: it waits for it, then raises."""
    lock = AsyncDMutex(SERVICE, client, table_name=table.name)

    async def work(handle: AsyncDMutexLock) -> str:
        gate.hold("DELETE")  # the next statement is the release
        return "done"

    task = asyncio.create_task(lock.run("k", work))
    await gate.arrived.wait()  # acquired, called back; the release ran, its reply is held
    task.cancel()
    await asyncio.sleep(0)
    assert not task.done(), "the release is still in flight: run() waits for it"
    gate.opened.set()
    with pytest.raises(asyncio.CancelledError):
        await task


async def release_held_in_aexit(gate: Gate, client: Any, table: Table) -> None:
    """Cancelled in the body, and again while ``__aexit__``'s release is held: it releases."""
    lock = AsyncDMutex(SERVICE, client, table_name=table.name)
    await lock.ready()
    gate.sent.clear()
    inside = asyncio.Event()

    async def body() -> None:
        handle = await lock.acquire("k")
        assert handle is not None
        async with handle:
            gate.hold("DELETE")
            inside.set()
            await asyncio.sleep(3600)  # cancelled here first

    task = asyncio.create_task(body())
    await inside.wait()
    task.cancel()  # lands in the body; __aexit__ starts the release
    await gate.arrived.wait()
    task.cancel()  # lands while the release's reply is held
    await asyncio.sleep(0)
    assert not task.done()
    gate.opened.set()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("scene", [release_held_in_run, release_held_in_aexit])
@pytest.mark.parametrize("driver", ASYNC_DRIVERS)
def test_a_release_cancelled_in_flight_still_releases(
    driver: str,
    scene: Callable[[Gate, Any, Table], Awaitable[None]],
    server: Server,
    table: Table,
) -> None:
    gate, _ = on_gated(driver, server, lambda gate, client: scene(gate, client, table))
    assert gate.words()[-2:] == ["INSERT", "DELETE"], gate.sent
    assert gate.words().count("DELETE") == 1, "one release, sent once"
    assert table.permits() == {}, "no row left"


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)
def test_a_wait_cancelled_as_a_release_wakes_it_raises_and_leaves_nothing(
    driver: str, server: Server, table: Table, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release (through the same client: store rule 5) wakes the waiter, and a cancellation
    lands at once: the wait raises CancelledError, and no attempt follows the wake."""
    listen = Wakeup.listen
    listened: list[Wakeup] = []

    def noting(self: Wakeup, listener: Callable[[], None]) -> bool:
        """``Wakeup.listen``, the wakeup noted: the asyncio driver waits on it."""
        waiting = listen(self, listener)
        if waiting:
            listened.append(self)
        return waiting

    monkeypatch.setattr(Wakeup, "listen", noting)

    async def scene(gate: Gate, client: Any) -> str:
        holder = AsyncDMutex(SERVICE, client, table_name=table.name)
        waiter = AsyncDMutex(SERVICE, client, table_name=table.name)
        held = await holder.acquire("k", ttl=60)
        assert held is not None
        task = asyncio.create_task(waiter.acquire_with_retry("k", timeout=30, retry_delay=20))
        await until_async(lambda: bool(listened), "the waiter waits for a wake", STEP_TIMEOUT)
        cancelled: list[bool] = []
        # Called after the driver's own listener: the wake, then the cancellation, at once.
        assert listen(listened[0], lambda: cancelled.append(task.cancel()))
        assert await held.release() is True
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, STEP_TIMEOUT)
        assert cancelled == [True], "the release woke the waiter"
        return held.token

    gate, holder_token = on_gated(driver, server, scene)
    waiter_sent = [(w, token) for w, token in gate.sent if token not in (None, holder_token)]
    assert len(waiter_sent) == 2, gate.sent
    waiter_token = waiter_sent[0][1]
    assert waiter_sent == [("INSERT", waiter_token), ("DELETE", waiter_token)], (
        "one refused attempt, no attempt after the wake, and the clean-up release by its token"
    )
    assert table.permits() == {}, "no row left"


# --- 2. a lost reply: the take ran, its reply was dropped ---------------------------------------

POOLS = ["sqlalchemy-pymysql", "aiomysql-pool", "asyncmy-pool"]
TAKE = b"INSERT INTO"  # how the take's text starts; nothing else dmutex sends here contains it


def take_proxy(server: Server) -> FaultProxy:
    """A proxy to ``server`` that, while faults are on, drops the reply of the first take it
    forwards, and then of nothing else (other chunks are spared)."""
    args = connect_args(server.url)
    return FaultProxy(
        (args["host"], args["port"]),
        Rates(drop_reply=1.0),
        seed=SEED,
        spare=lambda chunk: TAKE not in chunk,
        calm_after_fault=1_000_000,
        lifetime=60,
    )


def sync_lock(client: Any, table: Table, permits: int) -> DMutex | DSemaphore:
    if permits == 1:
        return DMutex(SERVICE, client, table_name=table.name)
    return DSemaphore(SERVICE, client, max_permits=permits, table_name=table.name)


@pytest.mark.parametrize("permits", [1, 3])
@pytest.mark.parametrize("client", POOLS)
def test_a_take_whose_reply_is_lost_raises_and_its_clean_up_leaves_no_row(
    client: str, permits: int, server: Server, table: Table
) -> None:
    """The acquire raises the driver's error; its release by token, on a fresh connection of
    the pool, deletes the row the take made."""
    seen: list[tuple[Note, dict[str, str]]] = []

    def before_delete(note: Note) -> None:
        if note.event == "sent" and note.word == "DELETE":
            seen.append((note, table.live()))

    spy = Spy(before_delete)
    raised: BaseException | None = None
    with take_proxy(server) as proxy:
        if client == "sqlalchemy-pymysql":
            engine = spied_engine(spy, pymysql_args(server, proxy.host, proxy.port))
            try:
                lock = sync_lock(engine, table, permits)
                lock.ready()
                with proxy.faults():
                    try:
                        lock.acquire("k", ttl=30)
                    except Exception as error:  # noqa: BLE001 - judged below
                        raised = error
            finally:
                engine.dispose()
        else:

            async def main() -> BaseException | None:
                driver = client.removesuffix("-pool")
                pool = await async_pool(driver, server, proxy.host, proxy.port, 2)
                try:
                    lock = async_lock(InterceptedPool(pool, SpySender(spy)), table, permits)
                    await lock.ready()
                    with proxy.faults():
                        try:
                            await lock.acquire("k", ttl=30)
                        except Exception as error:  # noqa: BLE001 - judged below
                            return error
                    return None
                finally:
                    await close_pool(pool)

            raised = asyncio.run(asyncio.wait_for(main(), SCENE_TIMEOUT))
        assert proxy.errors == []
        assert proxy.counts[Fault.DROP_REPLY] == 1, proxy.counts
    print(f"[mysql-lost-reply {client} permits={permits}] the acquire raised {raised!r}")
    assert isinstance(raised, driver_failures(client)), f"not the driver's error: {raised!r}"
    assert error_code(raised) in LOST, raised
    (take,) = spy.find("sent", "INSERT")
    (failed,) = spy.find("failed", "INSERT")
    assert failed.conn == take.conn
    assert len(seen) == 1, f"one clean-up release: {seen}"
    cleanup, live_then = seen[0]
    assert len(live_then) == 1, f"the server ran the take whose reply was lost: {live_then}"
    ((row, token),) = live_then.items()
    assert row in {f"permit:{slot}:k" for slot in range(permits)}
    assert token in take.text, "the row is the lost take's"
    assert token in cleanup.text, "released by the take's token"
    assert cleanup.conn != take.conn, "on a fresh connection of the pool"
    assert [n for n in spy.notes if n.conn == take.conn and n.at > failed.at] == [], (
        "the broken connection was not lent again"
    )
    assert len(spy.find("answered", "DELETE")) == 1
    assert table.permits() == {}, "no row left"


@pytest.mark.parametrize("permits", [1, 3])
@pytest.mark.parametrize("client", POOLS)
def test_a_take_sent_again_after_its_reply_was_lost_answers_the_same_slot(
    client: str, permits: int, server: Server, table: Table
) -> None:
    """On the store (no engine, so no clean-up release): the same acquire, same token, sent
    again through the pool takes no second slot."""
    token = str(uuid.uuid4())
    spy = Spy()

    def store_of(pool: object, asynchronous: bool) -> MySQLStore:
        return MySQLStore(pool, table.name, permits, SYSTEM_CLOCK, asynchronous=asynchronous)

    with take_proxy(server) as proxy:
        if client == "sqlalchemy-pymysql":
            engine = spied_engine(spy, pymysql_args(server, proxy.host, proxy.port))
            try:
                store = store_of(engine, False)
                drive = SyncDriver(SYSTEM_CLOCK, store.ready)
                drive.ready()
                with proxy.faults(), pytest.raises(driver_failures(client)) as caught:
                    drive(store.acquire("k", token, 30_000))
                raised: BaseException = caught.value
                first = table.rows()
                again = drive(store.acquire("k", token, 60_000))
            finally:
                engine.dispose()
        else:

            async def main() -> tuple[BaseException, dict[str, tuple[str, int]], Lease | None]:
                driver = client.removesuffix("-pool")
                pool = await async_pool(driver, server, proxy.host, proxy.port, 2)
                try:
                    store = store_of(InterceptedPool(pool, SpySender(spy)), True)
                    drive = AsyncDriver(SYSTEM_CLOCK, store.ready)
                    await drive.ready()
                    with proxy.faults(), pytest.raises(driver_failures(client)) as caught:
                        await drive(store.acquire("k", token, 30_000))
                    first = await asyncio.to_thread(table.rows)
                    return caught.value, first, await drive(store.acquire("k", token, 60_000))
                finally:
                    await close_pool(pool)

            raised, first, again = asyncio.run(asyncio.wait_for(main(), SCENE_TIMEOUT))
        assert proxy.errors == []
        assert proxy.counts[Fault.DROP_REPLY] == 1, proxy.counts
    assert error_code(raised) in LOST, raised
    held = [key for key, (value, _) in first.items() if value == token]
    assert len(held) == 1, f"the server ran the take whose reply was lost: {first}"
    assert isinstance(again, Lease)
    assert held == [f"permit:{again.slot}:k"], "the copy answers with the first copy's slot"
    assert table.holding(token) == held, "one row holds the token: no second slot"
    assert table.rows()[held[0]] == (token, again.expires_ms)
    assert again.expires_ms >= first[held[0]][1] + 30_000, "its expiry moved on"
    assert spy.find("sent", "DELETE") == [], "nothing released it meanwhile"
    (lost,) = spy.find("failed", "INSERT")
    resent = spy.find("sent", "INSERT", since=lost.at)
    assert len(resent) == 1
    assert resent[0].conn != lost.conn, "sent again on a fresh connection of the pool"


# --- 6. a take cut by a cancellation, which reaches the server late -----------------------------

LATE = 0.3  # seconds the proxy holds a take before the server gets it


def late_take_proxy(server: Server) -> FaultProxy:
    """A proxy to ``server`` that, while faults are on, holds each take :data:`LATE` s, and
    still delivers it if the client closed meanwhile (other chunks are spared)."""
    args = connect_args(server.url)
    return FaultProxy(
        (args["host"], args["port"]),
        Rates(delay=1.0, delay_seconds=(LATE, LATE)),
        seed=SEED,
        spare=lambda chunk: TAKE not in chunk,
        lifetime=60,
        deliver_late=True,
    )


@pytest.mark.parametrize("kind", ["pool", "connection"])
@pytest.mark.parametrize("driver", ASYNC_DRIVERS)
def test_a_take_cut_by_a_cancellation_that_reaches_the_server_late_leaves_no_row(
    driver: str, kind: str, server: Server, table: Table
) -> None:
    """The acquire is cancelled while its take is on its way; the driver closes the connection,
    and the take reaches the server after that. Its session is ended before the clean-up runs
    (``runners.py``, rule 7): no row then, nor once the take has arrived; and the client serves
    the next call (before: the row stayed, and a single connection raised InterfaceError)."""

    async def main() -> tuple[float, dict[str, tuple[str, int]], bool]:
        with late_take_proxy(server) as proxy:
            closing: Callable[[], Awaitable[None]]
            if kind == "pool":
                pool = await async_pool(driver, server, proxy.host, proxy.port, 2)
                client: Any = pool

                async def closing() -> None:
                    await close_pool(pool)

            else:
                client = await async_connection(driver, server, proxy.host, proxy.port)

                async def closing() -> None:
                    client.close()

            try:
                lock = async_lock(client, table, 1)
                await lock.ready()
                with proxy.faults():
                    task = asyncio.create_task(lock.acquire("k", ttl=60))
                    await until_async(
                        lambda: proxy.counts[Fault.DELAY] == 1, "the take held", STEP_TIMEOUT
                    )
                    cancelled = time.monotonic()
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                    took = time.monotonic() - cancelled
                    await asyncio.sleep(2 * LATE)  # the take has reached the server by now
                left = await asyncio.to_thread(table.permits)
                again = await lock.acquire("k", ttl=60)
                released = again is not None and await again.release()
            finally:
                await closing()
            assert proxy.errors == []
        return took, left, released

    took, left, released = asyncio.run(asyncio.wait_for(main(), SCENE_TIMEOUT))
    print(f"[mysql-late-take {driver} {kind}] the cancellation took {took * 1000:.1f} ms")
    assert left == {}, "no row left by the take that reached the server late"
    assert released, "the next acquire was granted and released"


# --- 3. a blackholed holder is told by its own deadline ------------------------------------------


class MySQLDeadlineRig(test_deadlines.ProxiedRig):
    """``test_deadlines``'s rig on MySQL: one proxy per trial, no read timeout anywhere.

    Holders: a PyMySQL connection in autocommit (sync), an aiomysql pool of two
    (asyncio: the trial's ``acquire`` and ``run`` leases share it). A statement the
    blackhole swallows waits for ever. The second holders share a direct PyMySQL
    connection, in a process of their own.
    """

    # The rig's Literal names test_deadlines' own three backends; only this file's test reads it.
    name = "mysql"  # type: ignore[assignment]

    def __init__(self, server: Server, table: str) -> None:
        args = connect_args(server.url)
        super().__init__((args["host"], args["port"]))
        self.server = server
        self.table = table
        self.lock_options = {"table_name": table}
        self.pools: list[Any] = []

    def _at(self, index: int) -> tuple[str, int]:
        proxy = self.proxy(index)
        return proxy.host, proxy.port

    def direct(self) -> Direct:
        connect = pymysql_args(self.server, *self.upstream)
        return Direct(
            "mysql", connect=tuple(connect.items()), options=(("table_name", self.table),)
        )

    def sync_lock(self, index: int) -> DMutex:
        if index not in self.sync_locks:
            conn = pymysql.connect(**pymysql_args(self.server, *self._at(index)))
            self.sync_clients.append(conn)
            self.sync_locks[index] = DMutex(test_deadlines.SERVICE, conn, **self.lock_options)
        return self.sync_locks[index]

    async def async_lock(self, index: int) -> AsyncDMutex:
        if index not in self.async_locks:
            pool = await async_pool("aiomysql", self.server, *self._at(index), 2)
            self.pools.append(pool)
            self.async_locks[index] = AsyncDMutex(test_deadlines.SERVICE, pool, **self.lock_options)
        return self.async_locks[index]

    async def aclose(self) -> None:
        pools, self.pools = self.pools, []
        for pool in pools:
            await close_pool(pool)


DEADLINE_TRIALS = 6
DEADLINE_TTLS = (1.0, 1.5, 2.0)


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_holder_behind_a_blackhole_is_told_before_anyone_takes_the_key(
    server: Server, table: Table, face: FaceName, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``test_deadlines``' case on MySQL, 6 trials at TTLs of 1 to 2 s."""
    monkeypatch.setattr(test_deadlines, "TRIALS", DEADLINE_TRIALS)
    monkeypatch.setattr(test_deadlines, "TTLS", DEADLINE_TTLS)
    DMutex(test_deadlines.SERVICE, table.conn, table_name=table.name).ready()
    rig = MySQLDeadlineRig(server, table.name)
    case = f"mysql-{face}"
    try:
        test_deadlines.tell_case(rig, case, face)
    finally:
        rig.end_fault()
        rig.close()
    assert table.live() == {}, "every key was taken over by its second holder, and released"


# --- 4. a renewal across a restart of the server -------------------------------------------------

RESTART_TTL = 6.0  # deadline 5.4 s after a renewal's send; a restart here takes well under 1 s


def nap(asynchronous: bool, seconds: float) -> Any:
    """A sleep of either face, as a call of ``Calls``."""
    if asynchronous:
        return asyncio.sleep(seconds)
    time.sleep(seconds)
    return None


def blocking(asynchronous: bool, fn: Callable[[], T]) -> Any:
    """``fn()`` as a call of ``Calls``: in a thread on the asyncio face (the loop renews)."""
    return asyncio.to_thread(fn) if asynchronous else fn()


def waiting(asynchronous: bool, condition: Callable[[], bool], what: str) -> Calls[None]:
    """Poll ``condition()`` (the loop runs on meanwhile); fail after :data:`STEP_TIMEOUT`."""
    deadline = time.monotonic() + STEP_TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {STEP_TIMEOUT} s")
        yield nap(asynchronous, 0.005)


@dataclass
class Restarted:
    """What the restart scene saw, in monotonic seconds and epoch ms."""

    down: float = 0.0
    up: float = 0.0
    before: int = 0  # the handle's expiry when the server went down
    during: int = 0  # and when it came up again
    after: int = 0  # after the first renewal on the restarted server
    lost: list[bool] | None = None  # handle.lost at each of those three moments
    row: tuple[str, int] | None = None
    token: str = ""
    released: bool | None = None


def restart_scene(
    lock: DMutex | AsyncDMutex, restartable: Restartable, how: str, spy: Spy, name: str
) -> Calls[Restarted]:
    asynchronous = isinstance(lock, AsyncDMutex)
    seen = Restarted()
    handle: Any = yield lock.acquire("k", ttl=RESTART_TTL, auto_renew=True)
    assert handle is not None
    seen.token = handle.token
    granted = ms_of(handle)
    yield from waiting(asynchronous, lambda: ms_of(handle) > granted, "the first renewal")
    seen.before = ms_of(handle)
    lost = [handle.lost]
    seen.down = time.monotonic()
    yield blocking(asynchronous, restartable.stop if how == "stop" else restartable.kill)

    def failed() -> bool:
        since = seen.down
        return bool(spy.find("failed", since=since) or spy.find("connect failed", since=since))

    yield from waiting(asynchronous, failed, "a renewal failed while the server was down")
    seen.during = ms_of(handle)
    lost.append(handle.lost)
    yield blocking(asynchronous, restartable.start)
    seen.up = time.monotonic()
    yield from waiting(
        asynchronous,
        lambda: ms_of(handle) > seen.during or handle.lost,
        "a renewal on the restarted server",
    )
    seen.after = ms_of(handle)
    lost.append(handle.lost)
    seen.lost = lost

    def read() -> tuple[str, int] | None:
        with contextlib.closing(restartable.connect()) as conn:
            return Table(conn, name).rows().get("permit:0:k")

    seen.row = yield blocking(asynchronous, read)
    seen.released = yield handle.release()
    return seen


def upstream(server: Server) -> tuple[str, int]:
    args = connect_args(server.url)
    return args["host"], args["port"]


@pytest.mark.parametrize(("face", "how"), [("sync", "stop"), ("async", "kill")])
def test_a_pooled_lease_renewed_across_a_restart_keeps_its_row(
    mysql_session: Session, face: str, how: str
) -> None:
    """Stopped (SIGTERM) or killed (SIGKILL) and started again within the deadline: a renewal
    fails while it is down, the next one after the start succeeds; the lease is never lost."""
    restartable = mysql_session.restartable()
    server = restartable.server
    name = table_name()
    spy = Spy()
    if face == "sync":
        engine = spied_engine(spy, pymysql_args(server, *upstream(server)))
        try:
            seen = run_calls(
                restart_scene(DMutex(SERVICE, engine, table_name=name), restartable, how, spy, name)
            )
        finally:
            engine.dispose()
    else:

        async def main() -> Restarted:
            pool = await async_pool("aiomysql", server, *upstream(server), 2)
            try:
                client: Any = InterceptedPool(pool, SpySender(spy), spy)
                lock = AsyncDMutex(SERVICE, client, table_name=name)
                return await await_calls(restart_scene(lock, restartable, how, spy, name))
            finally:
                await close_pool(pool)

        seen = asyncio.run(asyncio.wait_for(main(), SCENE_TIMEOUT))
    failures = [n for n in spy.notes if n.event in ("failed", "connect failed")]
    print(
        f"[mysql-restart {face}-{how}] failures while down: "
        f"{[(round(n.at - seen.down, 3), n.event, type(n.error).__name__) for n in failures]}"
    )
    assert seen.lost == [False, False, False], "never reported lost"
    assert all(seen.down <= n.at for n in failures), "no failure before the server went down"
    assert any(n.at < seen.up for n in failures), "a renewal failed while the server was down"
    assert seen.during == seen.before, "no renewal succeeded while the server was down"
    # After the first failure, only the restarted server can answer: it may do
    # so before start() returns (the server is up before the harness has seen it
    # ready; on a loaded machine a renewal fits between the two).
    renewed = spy.find("answered", "UPDATE", since=min(n.at for n in failures))
    assert renewed, "a renewal answered by the restarted server"
    assert seen.after > seen.before, "the restarted server moved the expiry on"
    assert seen.row is not None, "the row survived the restart"
    assert seen.row[0] == seen.token
    assert seen.row[1] >= seen.after, "the expiry the handle shows, or a later renewal's"
    assert seen.released is True
    with contextlib.closing(restartable.connect()) as conn:
        assert Table(conn, name).permits() == {}, "released: no row left"


# --- 5. the server paused while the holder renews ------------------------------------------------

PAUSE_TTL = 1.5  # renewed every ~0.5 s; its deadline 1.3 s after a renewal's send
PAUSE_SLACK_MS = 50  # the server is continued this long after its own expiry of the row
RENEWED = "SELECT `key`, `value`, `expired_at` FROM"  # a renewal's read-back (statements.renewed)


def test_a_holder_whose_server_is_paused_is_told_by_its_own_deadline(
    mysql_session: Session,
) -> None:
    """SIGSTOP right after a renewal's answer, SIGCONT after the row expired by the server's
    clock: the holder is told in between, by its deadline; the late renewal changes nothing."""
    restartable = mysql_session.restartable()
    server = restartable.server
    pid = restartable.pid
    name = table_name()
    armed, answered, go = threading.Event(), threading.Event(), threading.Event()

    def pause_after_renewal(note: Note) -> None:
        """In the renewer's thread: hold it right after a renewal's answer until the test let go."""
        if note.event == "answered" and note.text.startswith(RENEWED) and armed.is_set():
            armed.clear()
            answered.set()
            go.wait(STEP_TIMEOUT)

    spy = Spy(pause_after_renewal)
    told: list[tuple[float, float]] = []  # (monotonic, epoch s) when on_lost was called
    with contextlib.ExitStack() as stack:
        holder_conn = Spied(spy, **pymysql_args(server, *upstream(server)))
        stack.callback(holder_conn.close)
        rival_conn = stack.enter_context(contextlib.closing(restartable.connect()))
        look = Table(stack.enter_context(contextlib.closing(restartable.connect())), name)
        lock = DMutex(SERVICE, holder_conn, table_name=name)
        rival = DMutex(SERVICE, rival_conn, table_name=name)
        handle = lock.acquire("k", ttl=PAUSE_TTL, auto_renew=True)
        assert handle is not None
        rival.ready()  # the table is there: one read, before the pause
        handle.on_lost(lambda _: told.append((time.monotonic(), time.time())))
        armed.set()
        assert answered.wait(STEP_TIMEOUT), "no renewal was answered"
        confirmed = spy.find("sent", "UPDATE")[-1]  # the renewal just answered (its thread waits)
        before = ms_of(handle)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            if process_state(pid) is not None:
                until(lambda: process_state(pid) in ("T", "t"), "the server stopped", STEP_TIMEOUT)
            go.set()
            until(lambda: ms_of(handle) > before, "the renewal before the pause counted", 5)
            expiry = ms_of(handle)  # the row's expired_at, as that renewal read it back
            until(
                lambda: bool(spy.find("sent", "UPDATE", since=stopped)),
                "a renewal sent into the pause",
                STEP_TIMEOUT,
            )
            until(lambda: bool(told), "the holder told of the loss", STEP_TIMEOUT)
            lost_in_pause = handle.lost
            # The server reads the host's clock: keep it stopped until the row has expired by it.
            until(
                lambda: time.time() * 1000 > expiry + PAUSE_SLACK_MS,
                "the row's expiry passed",
                STEP_TIMEOUT,
            )
        finally:
            go.set()
            continued = time.monotonic()
            os.kill(pid, signal.SIGCONT)
        until(
            lambda: bool(spy.find("answered", containing=RENEWED, since=continued)),
            "the hung renewal answered after the pause",
            STEP_TIMEOUT,
        )
        late_row = look.permits()
        late_lost, late_left = handle.lost, handle.time_left
        taken = rival.acquire_with_retry("k", ttl=30, timeout=STEP_TIMEOUT, retry_delay=0.01)
        taken_at = time.monotonic()
        assert taken is not None, "the key is free once the row expired"
        stale_release = handle.release()
        after_stale = look.permits()
        assert taken.release() is True
        end_rows = look.permits()
    (hung,) = spy.find("sent", "UPDATE", since=stopped)
    (late,) = spy.find("answered", "UPDATE", since=continued)
    told_at, told_epoch = told[0]
    print(
        f"[mysql-pause] renewal sent {hung.at - stopped:.3f} s into the pause, told "
        f"{told_at - stopped:.3f} s in ({expiry - told_epoch * 1000:.0f} ms before the row's "
        f"expiry), continued {continued - stopped:.3f} s in, second holder "
        f"{taken_at - told_at:.3f} s after the telling"
    )
    assert confirmed.at < stopped
    assert stopped < hung.at < told_at < continued, "told while the server could answer nothing"
    assert lost_in_pause
    assert told_at < confirmed.at + PAUSE_TTL, "told within the TTL of the last answered renewal"
    assert told_epoch * 1000 < expiry, "told before the server's expiry of the row"
    assert late.text == hung.text, "the renewal sent into the pause"
    assert late.at > continued, "the hung renewal answered late"
    assert late_row == {"permit:0:k": (handle.token, expiry)}, "the late renewal changed nothing"
    assert late_lost, "the late answer did not revive the lease"
    assert late_left == 0.0
    assert told_at < taken_at, "the second holder was granted the key after the telling"
    assert stale_release is False, "the old holder's release finds the key not its own"
    assert after_stale == {"permit:0:k": (taken.token, ms_of(taken))}
    assert end_rows == {}, "no row left"

"""SQLiteBackend: the file, its connections, and the one call each operation is (rules 1, 3-5)."""

from __future__ import annotations

import asyncio
import math
import numbers
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ..._core.waiting import Waiter, Wakeup
from ..._errors import ArgumentTypeError, InvalidArgumentError

T = TypeVar("T")


Conn = sqlite3.Connection


_HEADER = b"SQLite format 3\x00"


_SQLITE_BUSY = 5  # the primary result code; sqlite3.SQLITE_BUSY is 3.11+


# Every open backend, so that a forked child drops the connections it inherited.
_OPEN: weakref.WeakSet[SQLiteBackend] = weakref.WeakSet()


# The connections a forked child inherited: kept, never closed nor collected,
# since closing one in the child would act on the parent's file state.
_INHERITED: list[Conn] = []


def _forked() -> None:
    for backend in list(_OPEN):
        backend._after_fork()


os.register_at_fork(after_in_child=_forked)


def _check_timeout(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"timeout must be an int or float, not {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:  # an int or Fraction beyond the largest float
        seconds = math.inf
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgumentError(f"timeout must be a finite number >= 0 seconds, not {value!r}")
    return seconds


def _check_path(path: object) -> str:
    """The absolute path of a database file dmutex can open, read and write; else a clear error."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise ArgumentTypeError(f"path must be a str or os.PathLike, not {type(path).__name__}")
    if path in ("", ":memory:") or path.startswith("file:"):
        raise InvalidArgumentError(
            f"path must name a file, not {path!r}: processes share locks through the file "
            "(use InMemoryBackend for locks within one process)"
        )
    full = os.path.abspath(path)
    folder = os.path.dirname(full)
    if not os.path.isdir(folder):
        raise InvalidArgumentError(
            f"cannot open the SQLite lock file {full!r}: its directory does not exist"
        )
    if os.path.isdir(full):
        raise InvalidArgumentError(f"cannot open the SQLite lock file {full!r}: it is a directory")
    if os.path.exists(full):
        if not os.access(full, os.R_OK | os.W_OK):
            raise InvalidArgumentError(
                f"the SQLite lock file {full!r} is not readable and writable by this user: "
                "every lock operation writes to it"
            )
        with open(full, "rb") as file:
            head = file.read(len(_HEADER))
        if head and head != _HEADER:
            raise InvalidArgumentError(f"{full!r} is not an SQLite database")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidArgumentError(
            f"cannot use the SQLite lock file {full!r}: its directory is not writable by this "
            "user, and SQLite creates the file and its -wal and -shm files there"
        )
    return full


class SQLiteBackend:
    """An SQLite database file holding lock tables: a client for every dmutex class.

    ``SQLiteBackend(path)`` opens (creating it if missing) the file at
    ``path`` in WAL mode with ``synchronous=FULL``. Locks are exclusive
    across every thread and process on the host that opens the same file,
    and survive the crash of any of them; a process that dies holding a
    lease leaves it until its TTL runs out. ``timeout`` is how long one
    operation waits for another process's transaction to finish before it
    raises ``sqlite3.OperationalError`` ("database is locked").

    Raises :class:`~dmutex.InvalidArgumentError` for a path whose directory
    is missing, a file this user cannot read and write, or a file that is
    not an SQLite database, before any lock state changes.

    Caveats: one host only. SQLite's locks do not work reliably over
    network filesystems (NFS, SMB), so neither does this. For a file that
    several users share, each needs write access to the file and to its
    directory (SQLite creates ``path-wal`` and ``path-shm`` beside it): a
    group-writable directory with the setgid bit and a umask of 002, say.
    """

    __slots__ = (
        "__weakref__",
        "_conn",
        "_gate",
        "_path",
        "_pid",
        "_starting",
        "_timeout",
        "_waiters",
        "_worker",
    )

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 30.0) -> None:
        self._timeout = _check_timeout(timeout)
        self._path = _check_path(path)
        self._gate = threading.Lock()
        # Guards _worker only: _gate is held through whole calls, busy waits
        # included, and the event loop must never wait for one.
        self._starting = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._conn: Conn | None = None
        # (table, key) -> the wakeups of this process's waiters (rule 4),
        # held weakly: an abandoned acquire leaves nothing. Under _gate.
        self._waiters: dict[tuple[str, str], weakref.WeakSet[Wakeup]] = {}
        try:
            self._conn = self._connect()
        except sqlite3.OperationalError:
            raise  # a file another process keeps busy past the timeout: not bad input
        except sqlite3.DatabaseError as error:
            raise InvalidArgumentError(
                f"cannot open the SQLite lock file {self._path!r}: {error}"
            ) from None
        _OPEN.add(self)

    @property
    def path(self) -> str:
        """The absolute path of the database file."""
        return self._path

    def _connect(self) -> Conn:
        conn = sqlite3.connect(
            self._path, timeout=self._timeout, isolation_level=None, check_same_thread=False
        )
        try:
            # WAL: readers never block the writer; FULL: a grant or fence
            # that was answered survives a power cut, so no fence is reused.
            _switch_to_wal(conn, time.monotonic() + self._timeout)
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA schema_version").fetchall()  # "not a database" surfaces here
        except BaseException:
            conn.close()
            raise
        return conn

    def _after_fork(self) -> None:
        # The parent's connection and worker thread are not the child's:
        # SQLite forbids carrying a connection across fork. Abandon them.
        if self._conn is not None:
            _INHERITED.append(self._conn)
        self._gate = threading.Lock()
        self._starting = threading.Lock()
        self._worker = None
        self._conn = None
        self._waiters = {}
        self._pid = os.getpid()

    def call(self, fn: Callable[[Conn], T]) -> T:
        """Run ``fn(connection)`` in this thread, one caller at a time."""
        with self._gate:
            conn = self._conn
            if conn is None or self._pid != os.getpid():
                self._pid = os.getpid()
                conn = self._conn = self._connect()
            return fn(conn)

    def call_async(self, fn: Callable[[Conn], T]) -> asyncio.Future[T]:
        """Run ``fn(connection)`` in this backend's worker thread; a future of the running loop."""
        loop = asyncio.get_running_loop()
        with self._starting:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="dmutex-sqlite")
            worker = self._worker
        return asyncio.wrap_future(worker.submit(self.call, fn), loop=loop)

    def close(self) -> None:
        """Close the connection and stop the worker thread; a later call opens them anew."""
        with self._starting:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)
        with self._gate:
            conn, self._conn = self._conn, None
        if conn is not None and self._pid == os.getpid():
            conn.close()

    def __del__(self) -> None:
        # A backend dropped without close() closes its connection, as a file
        # object would, and quietly: the file's locks never outlive a call.
        conn = self._conn if hasattr(self, "_conn") else None
        if conn is not None and self._pid == os.getpid():
            conn.close()

    def __repr__(self) -> str:
        return f"SQLiteBackend({self._path!r})"


def _switch_to_wal(conn: Conn, deadline: float) -> None:
    """Put the file in WAL mode, retrying while other connections are busy until ``deadline``.

    Why a loop: switching the journal mode can need the file's exclusive
    lock, and SQLite answers SQLITE_BUSY at once, without its busy handler,
    when processes open a new file together (one in ten of six doing so on
    this machine). The loop gives the switch the same ``timeout`` as any call.
    """
    pause = 0.001
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL").fetchall()
            return
        except sqlite3.OperationalError as error:
            if not _is_busy(error) or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _is_busy(error: sqlite3.OperationalError) -> bool:
    """Whether ``error`` is SQLITE_BUSY (any extended code): another connection holds the file."""
    code = getattr(error, "sqlite_errorcode", None)  # Python 3.11+; 3.10 has the message only
    if isinstance(code, int):
        return code & 0xFF == _SQLITE_BUSY
    return str(error) == "database is locked"


def register(backend: SQLiteBackend, name: tuple[str, str], waiter: Waiter, on: bool) -> None:
    """Add ``waiter`` to (or, ``on`` False, drop it from) ``name``'s waiters; under the gate."""
    waiting = backend._waiters
    wakeups = waiting.get(name)
    if not on:
        if wakeups is not None:
            wakeups.discard(waiter.wakeup)
            if not wakeups:
                del waiting[name]
        waiter.registered = False
        return
    if wakeups is None:
        wakeups = waiting[name] = weakref.WeakSet()
    waiter.wakeup.clear()
    wakeups.add(waiter.wakeup)
    waiter.registered = True


def in_transaction(conn: Conn, body: Callable[[Conn], T], begin: str = "BEGIN IMMEDIATE") -> T:
    """``body(conn)`` in ``begin``'s transaction: committed if it returns, rolled back if it raises.

    ``BEGIN IMMEDIATE`` (the default) for a body that writes; a plain
    ``BEGIN`` for one that only reads, which in WAL mode waits for no writer
    and sees one snapshot.
    """
    conn.execute(begin)
    try:
        result = body(conn)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    try:
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return result


def transaction(body: Callable[[Conn], T]) -> Callable[[Conn], T]:
    """``body`` run by :func:`in_transaction`."""

    def run(conn: Conn) -> T:
        return in_transaction(conn, body)

    return run

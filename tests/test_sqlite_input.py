"""Bad input to ``SQLiteBackend``: a clear error, and the file system as it was.

Each refusal is an ``InvalidArgumentError`` (a ``ValueError``) or an
``ArgumentTypeError`` (a ``TypeError``), raised before SQLite creates or
changes anything: no file made for a path in a missing directory, a junk
file's bytes unchanged, no ``-wal``/``-shm`` beside it.
"""

from __future__ import annotations

import math
import os
import pwd
import shutil
import sqlite3
import stat
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from dmutex import ArgumentTypeError, DMutex, InvalidArgumentError, SQLiteBackend
from tests._support.processes import Barrier, Reports, run_workers


def listing(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder``: a file's bytes, None for a directory."""
    return {
        str(entry.relative_to(folder)): None if entry.is_dir() else entry.read_bytes()
        for entry in sorted(folder.rglob("*"))
    }


def refused(
    folder: Path, make: Callable[[], object], error: type[Exception], match: str
) -> pytest.ExceptionInfo[Exception]:
    """``make()`` raises ``error`` (matching ``match``), and ``folder`` is as it was."""
    before = listing(folder)
    with pytest.raises(error, match=match) as raised:
        make()
    assert listing(folder) == before
    return raised


def test_a_path_in_a_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "missing" / "locks.sqlite3"
    raised = refused(
        tmp_path, lambda: SQLiteBackend(missing), InvalidArgumentError, "directory does not exist"
    )
    assert str(missing) in str(raised.value)
    assert not (tmp_path / "missing").exists()


def test_a_directory(tmp_path: Path) -> None:
    (tmp_path / "inside").write_bytes(b"x")
    refused(tmp_path, lambda: SQLiteBackend(tmp_path), InvalidArgumentError, "is a directory")


@pytest.mark.parametrize(
    "junk",
    [
        pytest.param(b"not a database, just some text\n" * 20, id="text"),
        pytest.param(b"SQLite", id="short-header-prefix"),
        pytest.param(b"\x00" * 4096, id="zeros"),
        pytest.param(b"SQLite format 3\x00" + b"junk" * 200, id="header-then-junk"),
    ],
)
def test_a_file_that_is_not_a_database(tmp_path: Path, junk: bytes) -> None:
    path = tmp_path / "locks.sqlite3"
    path.write_bytes(junk)
    refused(tmp_path, lambda: SQLiteBackend(path), InvalidArgumentError, "not .*database")
    assert path.read_bytes() == junk


def test_a_file_kept_busy_past_the_timeout_raises_the_busy_error_not_bad_input(
    tmp_path: Path,
) -> None:
    """The path is fine; the file is locked: sqlite3's own error, after ``timeout``."""
    path = tmp_path / "locks.sqlite3"
    SQLiteBackend(path).close()  # a WAL database, as dmutex leaves it
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        blocker.execute("PRAGMA locking_mode=EXCLUSIVE")
        blocker.execute("BEGIN EXCLUSIVE")
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            SQLiteBackend(path, timeout=0.05)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    SQLiteBackend(path).close()  # free again: accepted


def _rollback_file_with_a_writer(path: Path) -> sqlite3.Connection:
    """A database in rollback-journal mode, another connection in a write transaction on it."""
    writer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    writer.execute("CREATE TABLE t (x)")
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("INSERT INTO t VALUES (1)")
    return writer


def test_the_switch_to_wal_waits_for_a_writer_that_makes_sqlite_answer_busy_at_once(
    tmp_path: Path,
) -> None:
    """A writer on a rollback-mode file makes ``journal_mode=WAL`` fail at once, busy
    handler or not (so do processes opening a new file together): the backend waits."""
    path = tmp_path / "locks.sqlite3"
    writer = _rollback_file_with_a_writer(path)
    try:
        probe = sqlite3.connect(path, isolation_level=None, timeout=5)
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            probe.execute("PRAGMA journal_mode=WAL")  # the condition: busy, no waiting
        probe.close()
        committed = threading.Event()

        def commit_soon() -> None:
            time.sleep(0.2)
            writer.execute("COMMIT")
            committed.set()

        thread = threading.Thread(target=commit_soon)
        thread.start()
        backend = SQLiteBackend(path, timeout=30)
        thread.join()
        assert committed.is_set()
        lock = DMutex("svc", backend).acquire("k", ttl=5)
        assert lock is not None
        assert lock.release()
        backend.close()
    finally:
        writer.close()
    check = sqlite3.connect(path, isolation_level=None)
    assert check.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert check.execute("SELECT x FROM t").fetchall() == [(1,)]  # the writer's row kept
    check.close()


def test_a_writer_that_outlasts_the_timeout_still_raises_the_busy_error(tmp_path: Path) -> None:
    """The same writer, never committing: sqlite3's "database is locked" after ``timeout``."""
    path = tmp_path / "locks.sqlite3"
    writer = _rollback_file_with_a_writer(path)
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            SQLiteBackend(path, timeout=0.05)
    finally:
        writer.execute("ROLLBACK")
        writer.close()


def test_an_empty_file_and_a_path_object_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "locks.sqlite3"
    path.touch()
    backend = SQLiteBackend(path)
    try:
        assert backend.path == str(path)
        assert DMutex("svc", backend).acquire("job", ttl=60) is not None
    finally:
        backend.close()
    relative = SQLiteBackend(os.path.relpath(path))
    try:
        assert relative.path == str(path), "the absolute path"
    finally:
        relative.close()


class BytesPath:
    """An os.PathLike whose path is bytes."""

    def __fspath__(self) -> bytes:
        return b"/tmp/locks.sqlite3"


@pytest.mark.parametrize(
    "path",
    [b"locks.sqlite3", BytesPath(), 3, None, 1.5, ["locks.sqlite3"]],
    ids=["bytes", "bytes-pathlike", "int", "None", "float", "list"],
)
def test_path_types(tmp_path: Path, path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    refused(tmp_path, lambda: SQLiteBackend(path), ArgumentTypeError, "path must be a str")


@pytest.mark.parametrize(
    "path", ["", ":memory:", "file:locks.sqlite3", "file::memory:?cache=shared"]
)
def test_names_that_are_not_a_file_are_refused(
    tmp_path: Path, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    refused(tmp_path, lambda: SQLiteBackend(path), InvalidArgumentError, "path must name a file")
    if path:  # Path("") is ".", a directory
        refused(tmp_path, lambda: SQLiteBackend(Path(path)), InvalidArgumentError, "name a file")


BAD_TIMEOUTS: list[Any] = [
    (True, ArgumentTypeError),
    (False, ArgumentTypeError),
    ("1", ArgumentTypeError),
    (None, ArgumentTypeError),
    (Decimal("1.5"), ArgumentTypeError),  # not a numbers.Real
    (-1, InvalidArgumentError),
    (-0.001, InvalidArgumentError),
    (math.nan, InvalidArgumentError),
    (math.inf, InvalidArgumentError),
    (-math.inf, InvalidArgumentError),
    # Beyond the largest float: float() overflows (as for TTLs, issue 10, hole 6).
    pytest.param(10**400, InvalidArgumentError, id="10**400"),
    pytest.param(Fraction(10**400, 3), InvalidArgumentError, id="Fraction(10**400, 3)"),
]


@pytest.mark.parametrize(("timeout", "error"), BAD_TIMEOUTS)
def test_bad_timeouts(tmp_path: Path, timeout: Any, error: type[Exception]) -> None:
    path = tmp_path / "locks.sqlite3"
    refused(tmp_path, lambda: SQLiteBackend(path, timeout=timeout), error, "timeout")
    assert not path.exists(), "checked before the file is opened"


@pytest.mark.parametrize("timeout", [0, 0.0, 2.5, Fraction(1, 3), 10**6])
def test_good_timeouts(tmp_path: Path, timeout: Any) -> None:
    backend = SQLiteBackend(tmp_path / "locks.sqlite3", timeout=timeout)
    try:
        assert DMutex("svc", backend).acquire("job", ttl=60) is not None
    finally:
        backend.close()


# --- permissions ---------------------------------------------------------------------------


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory that user ``nobody`` may enter and list (pytest's tmp_path is 0o700)."""
    folder = Path(tempfile.mkdtemp(prefix="dmutex-perm-"))
    try:
        folder.chmod(0o755)
        yield folder
    finally:
        shutil.rmtree(folder)


def _open_as(
    worker: int, reports: Reports, barrier: Barrier, uid: int, gid: int, path: str
) -> None:
    """A worker process: become ``uid``/``gid``, try to open ``path``, report the outcome."""
    barrier.wait()
    try:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    except OSError:
        reports.put((worker, ("setup", traceback.format_exc())))
        return
    try:
        SQLiteBackend(path).close()
    except Exception as error:  # noqa: BLE001 - the outcome is the report
        reports.put((worker, (type(error).__name__, str(error))))
    else:
        reports.put((worker, ("opened", "")))


def open_as_other_user(path: Path) -> tuple[str, str]:
    """``SQLiteBackend(path)`` as a user without write access: (error class name, message).

    Not root: this user, after taking write access away (root passes
    ``os.access`` whatever the mode). Root: a process that becomes
    ``nobody`` once started (``run_workers``, spawned as root); not
    ``runuser`` nor a ``preexec_fn``, because ``nobody`` cannot run this
    Python when it lives under ``/root`` (mode 0o700).
    """
    if os.geteuid() != 0:
        path.chmod(0o444)
        try:
            SQLiteBackend(path).close()
        except Exception as error:  # noqa: BLE001 - the outcome is the report
            return type(error).__name__, str(error)
        return "opened", ""
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("running as root, and there is no user 'nobody' to drop to")
    ids = (nobody.pw_uid, nobody.pw_gid)
    (outcome,) = run_workers(_open_as, 1, *ids, str(path), deadline=60, report=tuple)
    name, message = outcome
    if name == "setup":
        pytest.skip(f"cannot become user nobody: {message}")
    return str(name), str(message)


def test_a_file_this_user_cannot_write(shared_dir: Path) -> None:
    path = shared_dir / "locks.sqlite3"
    made = SQLiteBackend(path)
    DMutex("svc", made).ready()
    made.close()
    path.chmod(0o644)  # root's file: others may read it, not write it
    before = listing(shared_dir)
    name, message = open_as_other_user(path)
    assert (name, message.split(":")[0]) == (
        "InvalidArgumentError",
        f"the SQLite lock file {str(path)!r} is not readable and writable by this user",
    )
    assert listing(shared_dir) == before
    assert stat.S_IMODE(path.stat().st_mode) in (0o644, 0o444)


def test_a_directory_this_user_cannot_write(shared_dir: Path) -> None:
    path = shared_dir / "locks.sqlite3"
    path.touch()
    path.chmod(0o666)
    before = listing(shared_dir)
    if os.geteuid() == 0:
        name, message = open_as_other_user(path)
    else:
        shared_dir.chmod(0o555)
        try:
            raised = refused(shared_dir, lambda: SQLiteBackend(path), InvalidArgumentError, "")
        finally:
            shared_dir.chmod(0o755)
        name, message = type(raised.value).__name__, str(raised.value)
    assert name == "InvalidArgumentError"
    assert "its directory is not writable by this user" in message
    assert listing(shared_dir) == before


@pytest.mark.parametrize(
    ("service", "table_name", "table_prefix"),
    [
        ("svc", "sqlite_master", "_dmutex_"),
        ("svc", "SQLite_Sequence", "_dmutex_"),  # SQLite reserves the prefix in any case
        ("sqlite_stat1", None, ""),  # from the prefix and the service name
    ],
)
def test_table_names_sqlite_reserves_are_refused_at_construction(
    tmp_path: Path, service: str, table_name: str | None, table_prefix: str
) -> None:
    """Not at the first acquire, where sqlite3 said "object name reserved for internal use"."""
    path = tmp_path / "locks.sqlite3"
    backend = SQLiteBackend(path)
    try:
        before = listing(tmp_path)
        with pytest.raises(InvalidArgumentError, match="reserves table names"):
            DMutex(service, backend, table_name=table_name, table_prefix=table_prefix)
        assert listing(tmp_path) == before
    finally:
        backend.close()

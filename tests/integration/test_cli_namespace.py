"""``dmutex status`` without KEY: a service's held keys, as the real console script shows them.

As ``test_cli_readwrite.py`` does: subprocesses, every exit status
asserted, on each backend the command reaches: its own SQLite file in
``tmp_path`` (``XDG_STATE_HOME`` there too), the newest discovered Redis
server (its database emptied first), the session's MongoDB server (the
test database in the URL's path), PostgreSQL server (the session's schema)
and MariaDB or MySQL server (the session's test database). Each test uses a
``--service`` of its own, so its tables and collections are new. The
library (``DMutex``, ``DSemaphore``, ``DReadWriteLock`` of that service)
takes the keys the command lists, with long leases; the ``--watch`` test
releases one while the command reads again, and stops it with SIGINT. The
usage errors are checked in this process (``dmutex._cli.main``): they are
refused before any I/O, against a backend URL that nothing answers.
"""

from __future__ import annotations

import json
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dmutex import DMutex, DMutexLock, DReadWriteLock, DSemaphore, SQLiteBackend, SyncClient
from dmutex._cli import main
from tests._support import cli, mongo_servers, mysql_servers
from tests._support.redis_servers import Pool, flushed, newest
from tests._support.sampling import until

HOUR = 3600.0
WATCH = "0.2"  # seconds between the --watch test's reads

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="dmutex is POSIX only")


@dataclass
class Backend:
    """A backend as the test sees it: the command's options for it and library locks on it."""

    name: str
    url: str
    service: str
    client: SyncClient
    db_name: str = "dmutex"
    """MongoDB: the database the URL names, which the command uses."""

    def status(self, *args: str) -> list[str]:
        """``status --backend URL --service SERVICE ARGS...``."""
        return ["status", "--backend", self.url, "--service", self.service, *args]

    def mutex(self) -> DMutex:
        return DMutex(self.service, self.client, db_name=self.db_name)

    def semaphore(self, permits: int) -> DSemaphore:
        return DSemaphore(self.service, self.client, max_permits=permits, db_name=self.db_name)

    def rwlock(self) -> DReadWriteLock:
        return DReadWriteLock(self.service, self.client, db_name=self.db_name)


@pytest.fixture(params=["sqlite", "redis", "mongodb", "postgresql", "mysql", "etcd"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Each backend the command lists keys on, with a service of the test's own."""
    service = f"ns_{secrets.token_hex(4)}"
    close: Callable[[], None]
    if request.param == "etcd":
        member = cli.etcd_store(request.getfixturevalue("etcd_session").server())
        found = Backend("etcd", member.url, service, member.client)
        close = member.close
    elif request.param == "sqlite":
        path = tmp_path / "locks.sqlite3"
        sqlite = SQLiteBackend(path)
        found = Backend("sqlite", f"sqlite://{path}", service, sqlite)
        close = sqlite.close
    elif request.param == "redis":
        pool: Pool = request.getfixturevalue("redis_pool")
        store = cli.redis_store(flushed(newest(pool).url))
        found = Backend("redis", store.url, service, store.client)
        close = store.close
    elif request.param == "postgresql":
        server = request.getfixturevalue("postgres_server")
        pg = cli.postgres_store(server, request.getfixturevalue("postgres_schema"))
        found = Backend("postgresql", pg.url, service, pg.client)
        close = pg.close
    elif request.param == "mysql":
        maria: mysql_servers.Session = request.getfixturevalue("mysql_session")
        db = maria.server()
        conn = db.connect()
        found = Backend("mysql", db.database_url, service, conn)
        close = conn.close
    else:
        session: mongo_servers.Session = request.getfixturevalue("mongo_session")
        mongo = session.server()
        url = cli.mongo_url(mongo.url, mongo.db_name)
        client = mongo.client()
        found = Backend("mongodb", url, service, client, mongo.db_name)
        close = client.close
    try:
        yield found
    finally:
        close()


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return cli.environment(tmp_path)


def document(done: cli.Finished) -> dict[str, object]:
    found = json.loads(done.stdout)
    assert isinstance(found, dict)
    return found


def entries(found: dict[str, object]) -> list[dict[str, object]]:
    keys = found["keys"]
    assert isinstance(keys, list)
    return keys


def holders_of(entry: dict[str, object]) -> list[dict[str, Any]]:
    """The holders of a key's document (JSON values)."""
    holders = entry["holders"]
    assert isinstance(holders, list)
    return holders


def steady(found: dict[str, object], moving: tuple[str, ...] = ()) -> dict[str, object]:
    """A key's document less what changes from one read to the next (the time, time left).

    ``moving``: a holder's fields that also change from one read to the next there.
    """
    dropped = ("left_seconds", *moving)
    return {
        **{k: v for k, v in found.items() if k != "now"},
        "holders": [{k: v for k, v in h.items() if k not in dropped} for h in holders_of(found)],
    }


def test_the_held_mutexes_as_a_table_and_as_json(backend: Backend, env: dict[str, str]) -> None:
    mutex = backend.mutex()
    handles: dict[str, DMutexLock] = {}
    for key in ("deploy", "nightly backup", "a:b"):
        handle = mutex.acquire(key, HOUR)
        assert handle is not None
        handles[key] = handle
    gone = mutex.acquire("released", HOUR)
    assert gone is not None
    assert gone.release()
    # The service's semaphores are another namespace.
    assert backend.semaphore(2).acquire("gpu", HOUR) is not None

    text = cli.run(backend.status(), env)
    assert text.status == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == f"service {backend.service!r} (mutexes): 3 keys held"
    assert lines[1].split() == ["key", "holders", "left", "fence"]
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == ["a:b", "deploy", "'nightly"]  # a key with a space: quoted
    for row in rows:
        assert row[-6:-3] == ["1", "of", "1"]
        assert row[-2] == "s"
        assert 3500 < float(row[-3]) <= HOUR  # the time left, in seconds
    fences = [handles[key].fence for key in ("a:b", "deploy", "nightly backup")]
    assert [row[-1] for row in rows] == ["-" if f is None else str(f) for f in fences]

    as_json = cli.run(backend.status("--json"), env)
    assert as_json.status == 0, as_json.stderr
    found = document(as_json)
    assert {k: v for k, v in found.items() if k not in ("now", "keys")} == {
        "service": backend.service,
        "kind": "mutex",
        "limit": 1,
        "held": True,
        "max_keys": 1000,
        "truncated": False,
    }
    listed = entries(found)
    assert [entry["key"] for entry in listed] == ["a:b", "deploy", "nightly backup"]
    for entry in listed:
        handle = handles[str(entry["key"])]
        assert set(entry) == {"key", "service", "kind", "limit", "held", "now", "fence", "holders"}
        assert (entry["kind"], entry["limit"], entry["held"]) == ("mutex", 1, True)
        assert entry["fence"] == handle.fence
        (holder,) = holders_of(entry)
        assert holder["slot"] == 0
        assert handle.token.startswith(holder["token_prefix"])
        assert holder["token_prefix"] != handle.token  # shortened, never whole
    # An entry is what dmutex status KEY --json prints, but for the moment it was read.
    single = document(cli.run(backend.status("--json", "deploy"), env))
    # etcd tells a lease's time left in whole seconds, and each read is its own
    # moment: the expiry it shows moves by up to a second between two reads.
    moving = ("expires_at", "expires_ms") if backend.name == "etcd" else ()
    assert steady(single, moving) == steady(listed[1], moving)


def test_max_keys_bounds_the_list_and_says_more_exist(
    backend: Backend, env: dict[str, str]
) -> None:
    mutex = backend.mutex()
    for key in ("k1", "k2", "k3"):
        assert mutex.acquire(key, HOUR) is not None
    text = cli.run(backend.status("--max-keys", "2"), env)
    assert text.status == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == f"service {backend.service!r} (mutexes): 2 keys held"
    assert len(lines) == 5  # heading, column names, two keys, the bound
    assert lines[-1] == "2 keys shown; more exist (--max-keys 2)"
    as_json = cli.run(backend.status("--max-keys", "2", "--json"), env)
    assert as_json.status == 0, as_json.stderr
    found = document(as_json)
    assert (found["max_keys"], found["truncated"]) == (2, True)
    shown = [entry["key"] for entry in entries(found)]
    assert len(shown) == 2
    assert set(shown) <= {"k1", "k2", "k3"}
    if backend.name != "redis":  # SCAN meets keys in its own order; the others list by key
        assert shown == ["k1", "k2"]
    exact = document(cli.run(backend.status("--max-keys", "3", "--json"), env))
    assert (len(entries(exact)), exact["truncated"]) == (3, False)


def test_semaphores_and_read_write_locks(backend: Backend, env: dict[str, str]) -> None:
    sem = backend.semaphore(3)
    permits = [sem.acquire("gpu", HOUR) for _ in range(2)]
    assert sem.acquire("port", HOUR) is not None
    lock = backend.rwlock()
    readers = [lock.acquire_read("catalog", HOUR) for _ in range(2)]
    writer = lock.acquire_write("warehouse", HOUR)
    assert writer is not None

    semaphores = cli.run(backend.status("--limit", "3", "--json"), env)
    assert semaphores.status == 0, semaphores.stderr
    found = document(semaphores)
    assert (found["kind"], found["limit"]) == ("semaphore", 3)
    listed = {str(entry["key"]): entry for entry in entries(found)}
    assert list(listed) == ["gpu", "port"]
    gpu = holders_of(listed["gpu"])
    assert sorted(h["slot"] for h in gpu) == sorted(p.slot for p in permits if p)
    text = cli.run(backend.status("--limit", "3"), env)
    assert text.status == 0, text.stderr
    assert "(semaphores of 3): 2 keys held" in text.stdout
    assert text.stdout.splitlines()[2].split()[1:4] == ["2", "of", "3"]

    rw = cli.run(backend.status("--read-write", "--json"), env)
    assert rw.status == 0, rw.stderr
    found = document(rw)
    assert (found["kind"], found["limit"]) == ("readwrite", None)
    roles = {str(entry["key"]): [h["role"] for h in holders_of(entry)] for entry in entries(found)}
    assert roles == {"catalog": ["read", "read"], "warehouse": ["write"]}
    rw_text = cli.run(backend.status("--read-write"), env)
    assert rw_text.status == 0, rw_text.stderr
    rows = [line.split()[:3] for line in rw_text.stdout.splitlines()[2:]]
    assert rows == [["catalog", "2", "readers"], ["warehouse", "writer", f"{rows[1][2]}"]]
    assert all(readers)


def test_an_empty_namespace_exits_1(backend: Backend, env: dict[str, str]) -> None:
    text = cli.run(backend.status(), env)
    assert text.status == 1, text.stderr
    assert text.stdout.strip() == f"service {backend.service!r} (mutexes): no key held"
    as_json = cli.run(backend.status("--json", "--read-write"), env)
    assert as_json.status == 1, as_json.stderr
    found = document(as_json)
    assert (found["held"], found["keys"], found["truncated"]) == (False, [], False)


def test_watch_reads_again_until_interrupted(
    backend: Backend, env: dict[str, str], tmp_path: Path
) -> None:
    mutex = backend.mutex()
    first = mutex.acquire("first", HOUR)
    assert first is not None
    assert mutex.acquire("second", HOUR) is not None
    out = tmp_path / "watch.jsonl"
    with out.open("w") as sink:
        process = subprocess.Popen(
            [str(cli.console_script()), *backend.status("--json", "--watch", WATCH)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    started = time.monotonic()

    def reads() -> list[list[object]]:
        return [
            [entry["key"] for entry in json.loads(line)["keys"]]
            for line in out.read_text().splitlines(keepends=True)
            if line.endswith("\n")
        ]

    try:
        until(lambda: len(reads()) >= 1, "the first read", cli.RUN_TIMEOUT)
        assert reads()[0] == ["first", "second"]
        assert first.release()
        until(lambda: ["second"] in reads(), "a read after the release", cli.RUN_TIMEOUT)
    finally:
        process.send_signal(signal.SIGINT)
    done = cli.finish(process, started)
    assert done.status == 0, done.stderr  # Ctrl-C ends --watch
    assert "Traceback" not in done.stderr
    assert len(reads()) >= 2


def test_watch_as_text_heads_each_read(env: dict[str, str], tmp_path: Path) -> None:
    """Not on a terminal: each read after a blank line, under a heading with its time."""
    path = tmp_path / "locks.sqlite3"
    client = SQLiteBackend(path)
    try:
        assert DMutex(cli.SERVICE, client).acquire("job", HOUR) is not None
        process = cli.start(["status", "--backend", f"sqlite://{path}", "--watch", WATCH], env)
        started = time.monotonic()
        time.sleep(1.0)  # about five reads
        process.send_signal(signal.SIGINT)
        done = cli.finish(process, started)
    finally:
        client.close()
    assert done.status == 0, done.stderr
    reads = done.stdout.split("\n\n")
    assert len(reads) >= 2
    for read in reads:
        lines = read.strip().splitlines()
        assert lines[0].startswith(f"every {WATCH} s until interrupted; read at ")
        assert lines[1] == f"service {cli.SERVICE!r} (mutexes): 1 key held"
        assert lines[3].split()[:4] == ["job", "1", "of", "1"]


def test_a_missing_sqlite_file_lists_nothing_and_creates_nothing(
    env: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "nothing-here.sqlite3"
    done = cli.run(["status", "--backend", f"sqlite://{path}", "--json"], env)
    assert done.status == 1, done.stderr
    assert json.loads(done.stdout)["keys"] == []
    assert not path.exists()


# -- usage errors, before any I/O ---------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.mark.parametrize(
    "args",
    [
        ["--max-keys", "0"],
        ["--max-keys", "10001"],
        ["--max-keys", "many"],
        ["--max-keys", "2", "job"],  # a key's status lists nothing
        ["--watch", "0"],
        ["--watch", "0.05"],
        ["--watch", "-1"],
        ["--watch", "nan"],
        ["--watch", "soon"],
        ["--read-write", "--limit", "2"],
        [""],  # an empty KEY is not "no KEY"
    ],
)
def test_usage_errors_exit_64_before_any_io(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"redis://127.0.0.1:{_closed_port()}/0"  # a request would exit 69
    assert main(["status", "--backend", url, *args]) == 64
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip(), "it says why"


def test_help_says_the_bound_and_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--help"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "usage: dmutex status [options] [KEY]" in shown
    for said in (
        "--max-keys N",
        "(default: 1000)",
        "--watch SECONDS",
        "Ctrl-C exits 0",
        "SCAN on the service's prefix, 1000 keys a request",
        "without KEY",
    ):
        assert said in shown, said

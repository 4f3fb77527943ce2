"""``dmutex run --read`` / ``--write`` and ``dmutex status --read-write``: the console script.

As ``test_cli.py`` does: subprocesses, every exit status asserted, each
test on its own SQLite file in ``tmp_path`` (``XDG_STATE_HOME`` there
too), on the newest discovered Redis server (its database emptied first),
on the session's MongoDB server (a service of the test's own, so a
collection of its own), on the session's PostgreSQL server (its schema,
tables dropped) and MySQL server (a service of the test's own). A library
:class:`~dmutex.DReadWriteLock` of the same service shares the keys with
the command. The children report through files and end when the test says
so, so that the test decides how long each lock is held; every wait is a
poll with a generous deadline, no duration is asserted.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dmutex import DReadWriteLock, SQLiteBackend
from tests._support import cli, mongo_servers, mysql_servers
from tests._support.redis_servers import Pool, flushed, newest
from tests._support.sampling import until

KEY = "catalog"
TTL = "3"  # renewed every second; the children end long before a lapse matters

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="dmutex run is POSIX only")

# The child: writes <me>.json (its DMUTEX_* variables) once it runs under its
# lock, waits for the file <other>.json if named (another child's report: both
# ran at once), then for the file <end>, and exits 0; 3 if a wait ran out.
CHILD = r"""
import json, os, sys, time
folder, me, other, end = sys.argv[1:5]
names = ("DMUTEX_KEY", "DMUTEX_TOKEN", "DMUTEX_FENCE", "DMUTEX_SLOT")
with open(os.path.join(folder, me + ".tmp"), "w") as out:
    json.dump({n: os.environ.get(n) for n in names}, out)
os.replace(os.path.join(folder, me + ".tmp"), os.path.join(folder, me + ".json"))
deadline = time.monotonic() + 25
for name in ([other + ".json"] if other else []) + [end]:
    while not os.path.exists(os.path.join(folder, name)):
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.02)
"""


@dataclass
class Backend:
    """A backend as the test sees it: the command's options for it and a library lock on it."""

    url: str
    service: str
    lock: DReadWriteLock

    @property
    def options(self) -> list[str]:
        return ["--backend", self.url, "--service", self.service]


@pytest.fixture(params=["sqlite", "redis", "mongodb", "postgresql", "mysql", "etcd"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Each backend that serves read-write locks to the command."""
    if request.param == "etcd":
        member = cli.etcd_store(request.getfixturevalue("etcd_session").server())
        found = Backend(member.url, cli.SERVICE, DReadWriteLock(cli.SERVICE, member.client))
        close: Callable[[], None] = member.close
    elif request.param == "sqlite":
        path = tmp_path / "locks.sqlite3"
        sqlite = SQLiteBackend(path)
        found = Backend(f"sqlite://{path}", cli.SERVICE, DReadWriteLock(cli.SERVICE, sqlite))
        close = sqlite.close
    elif request.param == "redis":
        pool: Pool = request.getfixturevalue("redis_pool")
        store = cli.redis_store(flushed(newest(pool).url))
        found = Backend(store.url, cli.SERVICE, DReadWriteLock(cli.SERVICE, store.client))
        close = store.close
    elif request.param == "postgresql":
        server = request.getfixturevalue("postgres_server")
        pg = cli.postgres_store(server, request.getfixturevalue("postgres_schema"))
        found = Backend(pg.url, cli.SERVICE, DReadWriteLock(cli.SERVICE, pg.client))
        close = pg.close
    elif request.param == "mysql":
        maria: mysql_servers.Session = request.getfixturevalue("mysql_session")
        db = maria.server()
        conn = db.connect()
        service = f"cli_rw_{secrets.token_hex(4)}"  # a table of this test's own
        found = Backend(db.database_url, service, DReadWriteLock(service, conn))
        close = conn.close
    else:
        session: mongo_servers.Session = request.getfixturevalue("mongo_session")
        server = session.server()
        url = cli.mongo_url(server.url, server.db_name)
        service = f"cli-rw-{tmp_path.name}"  # a collection of this test's own
        client = server.client()
        lock = DReadWriteLock(service, client, db_name=server.db_name)
        found = Backend(url, service, lock)
        close = client.close
    try:
        yield found
    finally:
        close()


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return cli.environment(tmp_path)


def start_child(
    backend: Backend,
    env: dict[str, str],
    folder: Path,
    role: str,
    me: str,
    *,
    other: str = "",
    options: tuple[str, ...] = (),
    stderr: Path | None = None,
) -> tuple[subprocess.Popen[str], float]:
    """Start ``dmutex run --ROLE OPTIONS KEY -- <CHILD me other end-me>``; it and its start."""
    args = ["run", *backend.options, "--ttl", TTL, f"--{role}", *options, KEY, "--"]
    command = [sys.executable, "-c", CHILD, str(folder), me, other, f"end-{me}"]
    return cli.start([*args, *command], env, stderr=stderr), time.monotonic()


def report(folder: Path, me: str, process: subprocess.Popen[str]) -> dict[str, str]:
    """What child ``me`` (run by ``process``) reported, once it runs under its lock."""
    path = folder / f"{me}.json"
    why = lambda: cli.account(process)  # noqa: E731 - said only if the wait fails
    until(path.exists, f"child {me} runs", cli.RUN_TIMEOUT, poll=0.02, why=why)
    found: dict[str, str] = json.loads(path.read_text())
    return found


def status(backend: Backend, env: dict[str, str], *options: str) -> cli.Finished:
    return cli.run(["status", *backend.options, *options, KEY], env)


def read_now(backend: Backend, env: dict[str, str]) -> int:
    """The exit status of ``dmutex run --read -n`` (it runs ``true`` if it gets in)."""
    done = cli.run(["run", *backend.options, "--read", "-n", KEY, "--", "true"], env)
    assert done.stderr == "", done.stderr  # quiet without -v, held or not
    return done.status


def test_readers_share_the_key_and_a_writer_is_refused_meanwhile(
    backend: Backend, env: dict[str, str], tmp_path: Path
) -> None:
    folder = tmp_path / "children"
    folder.mkdir()
    a, a_started = start_child(backend, env, folder, "read", "a", other="b")
    b, b_started = start_child(backend, env, folder, "read", "b", other="a")
    readers = {name: report(folder, name, p) for name, p in (("a", a), ("b", b))}
    for name, variables in readers.items():
        assert variables["DMUTEX_KEY"] == KEY
        assert variables["DMUTEX_SLOT"] == "0", name
        assert variables["DMUTEX_FENCE"].isdigit()
    tokens = {variables["DMUTEX_TOKEN"] for variables in readers.values()}
    assert len(tokens) == 2

    # Each child waits for the other's report: both ran under their read locks at once.
    both = lambda: (folder / "a.json").exists() and (folder / "b.json").exists()  # noqa: E731
    until(both, "both", 5, why=lambda: f"{cli.account(a)}; {cli.account(b)}")

    held = status(backend, env, "--read-write")
    assert held.status == 0, held.stderr
    lines = held.stdout.splitlines()
    assert lines[0] == f"{KEY!r} (service {backend.service!r}, read-write lock): held by 2 readers"
    assert lines[1].split() == ["role", "expires", "(UTC)", "left", "token", "holder"]
    rows = [line.split() for line in lines[2:4]]
    assert [row[0] for row in rows] == ["read", "read"]
    assert {row[4] for row in rows} == {f"{t[:8]}..." for t in tokens}
    assert all(t not in held.stdout for t in tokens)  # shortened, never whole
    assert lines[4].startswith("fence: ")

    document = json.loads(status(backend, env, "--read-write", "--json").stdout)
    assert document["kind"] == "readwrite"
    assert document["limit"] is None
    assert document["held"] is True
    assert [h["role"] for h in document["holders"]] == ["read", "read"]
    assert all("slot" not in h for h in document["holders"])
    assert {h["token_prefix"] for h in document["holders"]} == {t[:8] for t in tokens}
    assert all(h["left_seconds"] > 0 for h in document["holders"])

    refused = cli.run(["run", *backend.options, "--write", "-n", KEY, "--", "true"], env)
    assert refused.status == 75, refused.stderr
    assert refused.stderr == ""  # quiet without -v, as for a mutex
    assert backend.lock.acquire_write(KEY, 5) is None  # the library sees the readers too
    another = backend.lock.acquire_read(KEY, 5)  # and reads beside them
    assert another is not None
    assert another.release()

    for name in ("a", "b"):
        (folder / f"end-{name}").touch()
    assert cli.finish(a, a_started).status == 0
    assert cli.finish(b, b_started).status == 0
    writer = backend.lock.acquire_write(KEY, 5)  # both readers released their locks
    assert writer is not None
    assert writer.release()


def test_a_waiting_writer_keeps_new_readers_out_and_gets_in_after_the_readers(
    backend: Backend, env: dict[str, str], tmp_path: Path
) -> None:
    folder = tmp_path / "children"
    folder.mkdir()
    reader = backend.lock.acquire_read(KEY, 30)
    assert reader is not None
    log = tmp_path / "writer.txt"
    options = ("-v", "-w", "25")
    writer, started = start_child(backend, env, folder, "write", "w", options=options, stderr=log)
    said = lambda: cli.account(writer, log)  # noqa: E731 - said only if a wait fails
    until(
        lambda: "waiting for" in log.read_text(),
        "the writer says it waits",
        cli.RUN_TIMEOUT,
        why=said,
    )

    def reader_refused() -> bool:
        extra = backend.lock.acquire_read(KEY, 5)
        if extra is None:
            return True
        assert extra.release()  # not yet: the writer's first waiting attempt is under way
        return False

    # Writer preference: its intent, left by its first waiting attempt, keeps new readers out.
    until(
        reader_refused, "the waiting writer keeps readers out", cli.RUN_TIMEOUT, poll=0.05, why=said
    )
    assert read_now(backend, env) == 75
    assert writer.poll() is None
    text = log.read_text()
    assert f"1 reader: {reader.token[:8]}..." in text  # what it waits for, shortened ...
    assert reader.token not in text  # ... never the whole token

    assert reader.release()  # the last reader leaves: the writer gets in
    variables = report(folder, "w", writer)
    assert variables["DMUTEX_SLOT"] == "0"
    assert reader.fence is not None
    assert int(variables["DMUTEX_FENCE"]) > reader.fence  # above every fence before it
    token = variables["DMUTEX_TOKEN"]

    held = status(backend, env, "--read-write")
    assert held.status == 0, held.stderr
    lines = held.stdout.splitlines()
    assert lines[0].endswith("read-write lock): held by the writer")
    assert lines[2].split()[0] == "write"
    assert lines[2].split()[4] == f"{token[:8]}..."
    assert token not in held.stdout
    document = json.loads(status(backend, env, "--read-write", "--json").stdout)
    assert [(h["role"], h["token_prefix"]) for h in document["holders"]] == [("write", token[:8])]
    assert document["fence"] >= int(variables["DMUTEX_FENCE"])
    assert read_now(backend, env) == 75  # held by the writer
    assert backend.lock.acquire_read(KEY, 5) is None

    (folder / "end-w").touch()
    done = cli.finish(writer, started)
    assert done.status == 0, log.read_text()
    assert "acquired 'catalog' to write" in log.read_text()
    assert read_now(backend, env) == 0  # released: readers get in again

    free = status(backend, env, "--read-write")
    assert free.status == 1, free.stderr
    assert free.stdout.splitlines()[0] == (
        f"{KEY!r} (service {backend.service!r}, read-write lock): free"
    )


def test_every_status_document_names_its_kind(env: dict[str, str], tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'locks.sqlite3'}"
    kinds = {
        (): ("mutex", 1),
        ("--limit", "3"): ("semaphore", 3),
        ("--read-write",): ("readwrite", None),
    }
    for options, (kind, limit) in kinds.items():
        done = cli.run(["status", "--backend", url, "--json", *options, KEY], env)
        assert done.status == 1, done.stderr
        document = json.loads(done.stdout)
        assert (document["kind"], document["limit"], document["held"]) == (kind, limit, False)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["run", "--read", "--write", KEY, "--", "true"], "not allowed with argument"),
        (["run", "--write", "--read", KEY, "--", "true"], "not allowed with argument"),
        (["run", "--read", "--limit", "2", KEY, "--", "true"], "--read with --limit 2"),
        (
            ["run", "--limit", "3", "--write", KEY, "--", "true"],
            "--write with --limit 3",
        ),
        (["status", "--read-write", "--limit", "2", KEY], "--read-write with --limit 2"),
        (["status", "--write", KEY], "unrecognized arguments: --write"),
    ],
)
def test_usage_errors_exit_64(
    env: dict[str, str], tmp_path: Path, args: list[str], said: str
) -> None:
    """One line on stderr saying why, status 64, and the command never started."""
    marker = tmp_path / "ran"
    if args[-1] == "true":
        args = [*args[:-1], sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    done = cli.run(args, env)
    assert done.status == 64, done.stderr
    assert said in done.stderr
    assert "Traceback" not in done.stderr
    assert not marker.exists()


def test_help_describes_the_read_write_options(env: dict[str, str]) -> None:
    run_help = cli.run(["run", "--help"], env)
    assert run_help.status == 0
    assert "--read" in run_help.stdout
    assert "--write" in run_help.stdout
    status_help = cli.run(["status", "--help"], env)
    assert status_help.status == 0
    assert "--read-write" in status_help.stdout

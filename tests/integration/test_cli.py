"""The ``dmutex`` command, run as the real console script in subprocesses.

Every test asserts exit statuses. Each uses its own SQLite file in
``tmp_path`` and sets ``XDG_STATE_HOME`` there (the default file never
touches ``~``); the Redis tests use the newest discovered server, its
database emptied first; the PostgreSQL tests the session's server, in the
session's schema (named by the URL's ``schema=``), the lock tables dropped
first. Leases are short (``--ttl`` 1.5-3 s) and so is
``--kill-grace``, so that a lost lease is found and acted on in about a
second. Every wait is a poll with a generous deadline; durations are
measured on the monotonic clock and bounded loosely (at least the
asked-for time, well under the run timeout), never tightly.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import psycopg
import psycopg_pool
import pytest

from dmutex import DMutex, DMutexLock, SQLiteBackend
from dmutex._backends.mongodb.url import mongodb_timeouts
from dmutex._backends.postgresql.listening import listener
from dmutex._backends.postgresql.statements import Statements
from dmutex._backends.postgresql.url import POOL_SIZE, postgres_timeouts
from dmutex._cli import urls
from dmutex._cli.holders import read_holders
from dmutex._cli.run import request_timeout
from tests._support import cli, mongo_servers
from tests._support.cli import Child, Store
from tests._support.redis_servers import Pool, flushed, newest
from tests._support.sampling import until

KEY = "job"
TTL = "1.5"  # renewed every 0.5 s: a deleted lease is found within about that
GRACE = "0.3"  # at most a quarter of --ttl

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="dmutex run is POSIX only")


@pytest.fixture
def redis_cli_url(redis_pool: Pool) -> str:
    """The newest discovered Redis server (one is enough here), its database emptied."""
    return flushed(newest(redis_pool).url)


@pytest.fixture(params=["sqlite", "redis", "postgresql", "etcd"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """Each backend the command must interoperate with the library on."""
    if request.param == "sqlite":
        found = cli.sqlite_store(tmp_path)
    elif request.param == "redis":
        found = cli.redis_store(request.getfixturevalue("redis_cli_url"))
    elif request.param == "etcd":
        found = cli.etcd_store(request.getfixturevalue("etcd_session").server())
    else:
        server = request.getfixturevalue("postgres_server")
        found = cli.postgres_store(server, request.getfixturevalue("postgres_schema"))
    try:
        yield found
    finally:
        found.close()


@pytest.fixture
def sqlite(tmp_path: Path) -> Iterator[Store]:
    """A fresh SQLite file: the backend of the tests that are about the process, not storage."""
    found = cli.sqlite_store(tmp_path)
    try:
        yield found
    finally:
        found.close()


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return cli.environment(tmp_path)


def is_free(store: Store, key: str = KEY) -> bool:
    """Whether the library can take ``key`` now (it releases it again at once)."""
    handle = DMutex(cli.SERVICE, store.client).acquire(key, 5)
    if handle is None:
        return False
    assert handle.release()
    return True


def child_folder(tmp_path: Path, name: str = "child") -> Child:
    folder = tmp_path / name
    folder.mkdir()
    return Child(folder)


def run_child(
    tmp_path: Path, env: dict[str, str], url: str, mode: str, *options: str
) -> tuple[Child, subprocess.Popen[str], float]:
    """Start ``dmutex run --backend URL --ttl TTL OPTIONS KEY -- <the test child in mode>``.

    The child, the ``dmutex`` process, and when it started (monotonic).
    """
    child = child_folder(tmp_path)
    args = ["run", "--backend", url, "--ttl", TTL, *options, KEY, "--"]
    process = cli.start([*args, *cli.child_command(child.folder, mode)], env)
    child.process = process
    return child, process, time.monotonic()


def wait_behind_a_holder(
    store: Store, env: dict[str, str], log: Path, *args: str
) -> tuple[DMutexLock, subprocess.Popen[str], float]:
    """Take KEY with the library, start ``dmutex run --backend URL -v ARGS`` (stderr to
    ``log``) and wait until it says it waits.

    The holder's handle, the ``dmutex`` process, and when it started (monotonic).
    """
    holder = DMutex(cli.SERVICE, store.client).acquire(KEY, 30)
    assert holder is not None
    process = cli.start(["run", "--backend", store.url, "-v", *args], env, stderr=log)
    started = time.monotonic()
    until(lambda: "waiting for" in log.read_text(), "dmutex says it waits", cli.RUN_TIMEOUT)
    return holder, process, started


# -- the child's environment, the lock while it runs, and after it ends -------


def test_child_runs_holding_the_lock_and_it_is_released_when_the_child_is_killed(
    store: Store, env: dict[str, str], tmp_path: Path
) -> None:
    child, process, started = run_child(tmp_path, env, store.url, "plain")
    report = child.wait_ready()

    variables = report["env"]
    assert isinstance(variables, dict)
    assert variables["DMUTEX_KEY"] == KEY
    token = store.stored_token(KEY)
    assert token is not None
    assert variables["DMUTEX_TOKEN"] == token
    fence = variables["DMUTEX_FENCE"]
    assert isinstance(fence, str)
    assert fence.isdigit()  # every backend keeps a fence
    assert int(fence) >= 1
    assert variables["DMUTEX_SLOT"] == "0"  # a mutex: its one permit

    # The library sees the key held, and still held past the first lease's expiry (renewed).
    assert DMutex(cli.SERVICE, store.client).acquire(KEY, 5) is None
    first = read_holders(store.client, service=cli.SERVICE, limit=1, key=KEY)
    assert [h.token for h in first.holders] == [token]
    first_expiry = first.holders[0].expires_ms

    def past_first_expiry() -> bool:
        now = read_holders(store.client, service=cli.SERVICE, limit=1, key=KEY)
        return now.now_ms > first_expiry + 100

    until(past_first_expiry, "the first lease's expiry passed", cli.RUN_TIMEOUT, poll=0.05)
    assert DMutex(cli.SERVICE, store.client).acquire(KEY, 5) is None
    assert store.stored_token(KEY) == token

    # dmutex status shows it, with the token shortened.
    shown = cli.run(["status", "--backend", store.url, KEY], env)
    assert shown.status == 0, shown.stderr
    assert "held" in shown.stdout
    assert token[:8] in shown.stdout
    assert token not in shown.stdout
    assert f"fence: {fence} " in shown.stdout

    os.kill(child.pid, signal.SIGKILL)
    done = cli.finish(process, started)
    assert done.status == 128 + signal.SIGKILL, done.stderr
    assert is_free(store)


def test_a_held_key_gives_the_conflict_status(
    store: Store, env: dict[str, str], tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    command = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    base = ["run", "--backend", store.url, "--ttl", TTL]
    holder = DMutex(cli.SERVICE, store.client).acquire(KEY, 30)
    assert holder is not None
    try:
        no_wait = cli.run([*base, "-n", KEY, *command], env)
        assert no_wait.status == 75, no_wait.stderr
        assert no_wait.stderr == ""  # quiet without -v, as flock(1)

        custom = cli.run([*base, "--no-wait", "-E", "9", KEY, *command], env)
        assert custom.status == 9, custom.stderr

        waited = cli.run([*base, "-w", "1", KEY, *command], env)
        assert waited.status == 75, waited.stderr
        assert 1.0 <= waited.seconds < cli.RUN_TIMEOUT
        assert not marker.exists()
    finally:
        assert holder.release()
    free = cli.run([*base, "-n", KEY, *command], env)
    assert free.status == 0, free.stderr
    assert marker.exists()


def test_a_waiting_run_takes_the_lock_when_it_is_released(
    store: Store, env: dict[str, str], tmp_path: Path
) -> None:
    log = tmp_path / "stderr.txt"
    holder, process, started = wait_behind_a_holder(
        store, env, log, "--ttl", TTL, KEY, "--", "true"
    )
    assert process.poll() is None
    text = log.read_text()
    assert holder.token[:8] in text  # who holds it, shortened ...
    assert holder.token not in text  # ... never the whole token
    assert holder.release()
    done = cli.finish(process, started)
    assert done.status == 0, log.read_text()
    assert "acquired" in log.read_text()
    assert is_free(store)


# -- a lost lease -------------------------------------------------------------


def test_a_lost_lease_stops_the_child_with_sigterm_then_sigkill(
    store: Store, env: dict[str, str], tmp_path: Path
) -> None:
    child, process, started = run_child(tmp_path, env, store.url, "stubborn", "--kill-grace", GRACE)
    pid = child.pid
    store.delete_lease(KEY)
    deleted = time.monotonic()
    done = cli.finish(process, started)
    assert done.status == 70, done.stderr
    assert signal.SIGTERM in child.signals()  # asked first ...
    assert cli.gone(pid)  # ... then killed, since it ignores SIGTERM
    assert time.monotonic() - deleted >= float(GRACE)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "lost the lease" in lines[0]
    assert is_free(store)


# -- signals ------------------------------------------------------------------


def test_sigint_sigterm_and_sighup_are_forwarded_to_the_child(
    sqlite: Store, env: dict[str, str], tmp_path: Path
) -> None:
    child, process, started = run_child(tmp_path, env, sqlite.url, "record")
    child.wait_ready()
    process.send_signal(signal.SIGINT)
    assert child.wait_signals(1) == [signal.SIGINT]
    process.send_signal(signal.SIGTERM)
    assert child.wait_signals(2) == [signal.SIGINT, signal.SIGTERM]
    assert process.poll() is None  # the child chose to go on, so dmutex does
    process.send_signal(signal.SIGHUP)  # the child exits 42 on it
    done = cli.finish(process, started)
    assert done.status == 42, done.stderr
    assert child.signals() == [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    assert is_free(sqlite)


def test_sigterm_to_dmutex_ends_the_child_and_releases(
    sqlite: Store, env: dict[str, str], tmp_path: Path
) -> None:
    child, process, started = run_child(tmp_path, env, sqlite.url, "plain")
    pid = child.pid
    process.send_signal(signal.SIGTERM)
    done = cli.finish(process, started)
    assert done.status == 128 + signal.SIGTERM, done.stderr
    assert cli.gone(pid)
    assert is_free(sqlite)


def test_a_signal_while_waiting_stops_dmutex(
    sqlite: Store, env: dict[str, str], tmp_path: Path
) -> None:
    log = tmp_path / "stderr.txt"
    marker = tmp_path / "ran"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    holder, process, started = wait_behind_a_holder(sqlite, env, log, KEY, "--", *command)
    process.send_signal(signal.SIGINT)
    done = cli.finish(process, started)
    assert done.status == 128 + signal.SIGINT, log.read_text()
    assert not marker.exists()
    assert holder.release()  # still the holder's: the waiter took nothing


# -- the child's exit status --------------------------------------------------


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("raise SystemExit(0)", 0),
        ("raise SystemExit(3)", 3),
        ("import os, signal; os.kill(os.getpid(), signal.SIGUSR1)", 128 + signal.SIGUSR1),
    ],
)
def test_the_childs_exit_status_is_dmutexs(
    sqlite: Store, env: dict[str, str], script: str, expected: int
) -> None:
    done = cli.run(["run", "--backend", sqlite.url, KEY, "--", sys.executable, "-c", script], env)
    assert done.status == expected, done.stderr
    assert is_free(sqlite)


def test_a_command_that_cannot_run_gives_127_or_126_after_the_release(
    sqlite: Store, env: dict[str, str], tmp_path: Path
) -> None:
    base = ["run", "--backend", sqlite.url, KEY, "--"]
    missing = cli.run([*base, "dmutex-no-such-command", "x"], env)
    assert missing.status == 127
    assert "dmutex-no-such-command: command not found" in missing.stderr
    assert is_free(sqlite)

    script = tmp_path / "not-executable.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    refused = cli.run([*base, str(script)], env)
    assert refused.status == 126
    assert str(script) in refused.stderr
    assert is_free(sqlite)


def test_without_dashdash_everything_after_key_is_the_command(
    sqlite: Store, env: dict[str, str]
) -> None:
    # As with flock(1): `-c` and `--` belong to the command, not to dmutex.
    script = "import sys; raise SystemExit(len(sys.argv))"
    done = cli.run(
        ["run", "--backend", sqlite.url, KEY, sys.executable, "-c", script, "--", "-n"], env
    )
    assert done.status == 3, done.stderr  # argv: ["-c", "--", "-n"]


# -- semaphores ---------------------------------------------------------------


def test_limit_makes_a_semaphore(store: Store, env: dict[str, str], tmp_path: Path) -> None:
    base = ["run", "--backend", store.url, "--ttl", "3", "--limit", "2", KEY, "--"]
    children = [child_folder(tmp_path, f"child{i}") for i in range(2)]
    processes = [cli.start([*base, *cli.child_command(c.folder, "plain")], env) for c in children]
    for child, process in zip(children, processes, strict=True):
        child.process = process
    started = time.monotonic()
    tokens = set()
    slots = set()
    for child in children:
        variables = child.wait_ready()["env"]
        assert isinstance(variables, dict)
        tokens.add(variables["DMUTEX_TOKEN"])
        slots.add(variables["DMUTEX_SLOT"])
    assert len(tokens) == 2
    assert slots == {"0", "1"}  # each child knows its own permit

    third = cli.run(["run", "--backend", store.url, "--limit", "2", "-n", KEY, "--", "true"], env)
    assert third.status == 75, third.stderr
    # As a mutex (--limit 1) the key is another lock: the semaphore's permits do not hold it.
    assert cli.run(["run", "--backend", store.url, "-n", KEY, "--", "true"], env).status == 0

    shown = cli.run(["status", "--backend", store.url, "--limit", "2", "--json", KEY], env)
    assert shown.status == 0, shown.stderr
    document = json.loads(shown.stdout)
    assert document["held"] is True
    assert sorted(h["slot"] for h in document["holders"]) == [0, 1]
    for holder in document["holders"]:
        assert holder["left_seconds"] > 0
        assert any(str(t).startswith(holder["token_prefix"]) for t in tokens)
        assert holder["token_prefix"] not in tokens  # shortened, never whole

    for child in children:
        os.kill(child.pid, signal.SIGTERM)
    for process in processes:
        assert cli.finish(process, started).status == 128 + signal.SIGTERM
    free = cli.run(["status", "--backend", store.url, "--limit", "2", KEY], env)
    assert free.status == 1, free.stderr


# -- status -------------------------------------------------------------------


def test_status_of_a_free_key_exits_1(store: Store, env: dict[str, str]) -> None:
    text = cli.run(["status", "--backend", store.url, KEY], env)
    assert text.status == 1, text.stderr
    assert "free" in text.stdout
    as_json = cli.run(["status", "--backend", store.url, "--json", KEY], env)
    assert as_json.status == 1, as_json.stderr
    document = json.loads(as_json.stdout)
    assert document["held"] is False
    assert document["holders"] == []


def test_status_of_a_missing_sqlite_file_is_free_and_creates_nothing(
    env: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "nothing-here.sqlite3"
    done = cli.run(["status", "--backend", f"sqlite://{path}", KEY], env)
    assert done.status == 1, done.stderr
    assert not path.exists()


# -- the default backend, and python -m dmutex --------------------------------


def test_the_default_backend_is_a_private_sqlite_file_under_xdg_state_home(
    env: dict[str, str], tmp_path: Path
) -> None:
    state = Path(env["XDG_STATE_HOME"])
    assert not state.exists()
    done = cli.run(["run", KEY, "--", "true"], env)
    assert done.status == 0, done.stderr
    path = state / "dmutex" / "locks.sqlite3"
    assert path.is_file()
    for folder in (state, state / "dmutex"):
        assert stat.S_IMODE(folder.stat().st_mode) & 0o077 == 0  # created 0o700
    # The library on that file sees the command's locks.
    client = SQLiteBackend(path)
    try:
        holder = DMutex(cli.SERVICE, client).acquire(KEY, 30)
        assert holder is not None
        held = cli.run(["run", "-n", KEY, "--", "true"], env)
        assert held.status == 75, held.stderr
        assert holder.release()
    finally:
        client.close()


def test_python_dash_m_dmutex_runs_the_command(sqlite: Store, env: dict[str, str]) -> None:
    script = "import os; raise SystemExit(0 if os.environ['DMUTEX_KEY'] == 'job' else 1)"
    args = ["run", "--backend", sqlite.url, KEY, "--", sys.executable, "-c", script]
    done = cli.run(args, env, module=True)
    assert done.status == 0, done.stderr
    version = cli.run(["--version"], env, module=True)
    assert version.status == 0
    assert version.stdout.startswith("dmutex ")


def test_dmutex_backend_variable_picks_the_backend(store: Store, env: dict[str, str]) -> None:
    holder = DMutex(cli.SERVICE, store.client).acquire(KEY, 30)
    assert holder is not None
    done = cli.run(["run", "-n", KEY, "--", "true"], {**env, "DMUTEX_BACKEND": store.url})
    assert done.status == 75, done.stderr
    assert holder.release()


# -- usage errors and unreachable backends ------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["frobnicate"],
        ["run", KEY],
        ["run", KEY, "--"],
        ["run", KEY, "-n", "--", "true"],  # options go before KEY
        ["run", "-n", "-w", "1", KEY, "--", "true"],
        ["run", "--limit", "0", KEY, "--", "true"],
        ["run", "--ttl", "0", KEY, "--", "true"],
        ["run", "--ttl", "nan", KEY, "--", "true"],
        ["run", "-w", "-1", KEY, "--", "true"],
        ["run", "-E", "256", KEY, "--", "true"],
        ["run", "--backend", "postgresql://127.0.0.1:99999/x", KEY, "--", "true"],
        ["status", "--backend", "POSTGRES://127.0.0.1/x?no_such_parameter=1", KEY],
        ["status", "--backend", "postgresql://127.0.0.1/x?schema=", KEY],
        ["run", "--backend", "postgresql://127.0.0.1/x?schema=a&schema=b", KEY, "--", "true"],
        ["run", "--backend", "postgresql://127.0.0.1/x?schema=" + "s" * 64, KEY, "--", "true"],
        ["run", "--backend", "http://127.0.0.1/x", KEY, "--", "true"],
        ["run", "--backend", "sqlite://host/x.db", KEY, "--", "true"],
        ["status", "--max-keys", "1", KEY],  # a bound on the listing without KEY
        ["status", "--watch", "0", KEY],
        ["status", "--limit", "x", KEY],
        ["run", "--ttl", "2", "--kill-grace", "0.6", KEY, "--", "true"],  # > a quarter
        ["status", "\udcff\udcfe"],  # argv bytes that are not UTF-8
        ["run", "\udcff", "--", "true"],
        ["status", "--backend", "mongodb://127.0.0.1:99999/", KEY],  # a port out of range
        ["run", "--ttl", "1e-9", KEY, "--", "true"],  # below the command's least TTL
        ["run", "--ttl", "0.5", KEY, "--", "true"],
        ["run", "--service", "", KEY, "--", "true"],
        ["status", "--service", "", KEY],
        ["status", "--limit", "5000", KEY],  # more permits than a semaphore has
        ["run", "--backend", "redis://127.0.0.1:1/abc", KEY, "--", "true"],  # not database 0
        ["status", "--backend", "rediss://127.0.0.1:1/?db=x", KEY],
        ["status", "--backend", "postgresql://127.0.0.1:1/x?sslmode=bogus", KEY],
        ["run", "--backend", "postgresql://127.0.0.1:1/x?connect_timeout=abc", KEY, "--", "true"],
        ["run", "--backend", "mongodb://127.0.0.1:99999/", KEY, "--", "true"],
    ],
)
def test_usage_errors_exit_64(env: dict[str, str], args: list[str]) -> None:
    """One line on stderr, status 64: never a traceback, never 1 (which status means "free")."""
    done = cli.run(args, env)
    assert done.status == 64, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip(), "it says why"


# Nothing listens on port 1: a request would exit 69, not 64.
UNREACHABLE_REDIS = "redis://127.0.0.1:1"


@pytest.mark.parametrize(
    "args",
    [
        ["run", "--service", "x:permit:0", KEY, "--", "true"],
        ["run", "--service", "x:fence", "--limit", "3", KEY, "--", "true"],
        ["run", "--service", "y:rwlock", "--write", KEY, "--", "true"],
        ["status", "--service", "x:permit:0", KEY],
        ["status", "--service", "x:waiters", "--read-write", KEY],
        ["status", "--service", "x:signal"],  # the namespace's listing
    ],
)
def test_a_redis_service_name_that_could_reach_another_services_keys_exits_64(
    env: dict[str, str], args: list[str]
) -> None:
    """Refused as the library refuses it (``check_redis_prefix``), before any request.

    ``x:permit:0``'s key ``k`` would be ``x``'s key ``permit:0:k``; the
    server is unreachable, so reaching it would be status 69.
    """
    done = cli.run([args[0], "--backend", UNREACHABLE_REDIS, *args[1:]], env)
    assert done.status == 64, done.stderr
    assert "Redis key layout" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert "Traceback" not in done.stderr


def test_a_service_name_refused_on_redis_serves_on_sqlite(env: dict[str, str]) -> None:
    """The rule is Redis's layout's: a table-per-service backend takes the name."""
    done = cli.run(["run", "--service", "x:permit:0", KEY, "--", "true"], env)
    assert done.status == 0, done.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["run", "--service", "", KEY, "--", "true"],
        ["run", "--ttl", "1e-9", KEY, "--", "true"],
        ["status", "--service", "", KEY],
        ["status", "--limit", "5000", KEY],
    ],
)
def test_usage_errors_create_no_file(env: dict[str, str], args: list[str]) -> None:
    """Refused before the default SQLite file (or its folder) is made."""
    state = Path(env["XDG_STATE_HOME"])
    done = cli.run(args, env)
    assert done.status == 64, done.stderr
    assert not state.exists() or not any(state.rglob("*")), sorted(state.rglob("*"))


def test_mongodb_urls_get_timeouts_that_fit_the_ttl_unless_they_set_their_own() -> None:
    timeouts = mongodb_timeouts("mongodb://db/ops", request_timeout(2.0))
    assert timeouts == {
        "serverSelectionTimeoutMS": 1000,
        "socketTimeoutMS": 1000,
        "connectTimeoutMS": 1000,
    }
    assert mongodb_timeouts("mongodb://db/?socketTimeoutMS=250", 10.0) == {
        "serverSelectionTimeoutMS": 10000,
        "connectTimeoutMS": 5000,
    }


def test_help_lists_every_option_with_its_default_and_examples(env: dict[str, str]) -> None:
    done = cli.run(["run", "--help"], env)
    assert done.status == 0
    for option in ("--backend", "--service", "--limit", "--ttl", "--no-wait", "--wait"):
        assert option in done.stdout
    for option in ("--conflict-exit-code", "--kill-grace", "--verbose"):
        assert option in done.stdout
    assert "(default: 60)" in done.stdout
    assert "(default: 75)" in done.stdout
    assert "examples:" in done.stdout


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_an_unreachable_backend_exits_69_naming_it_without_its_password(
    env: dict[str, str], tmp_path: Path
) -> None:
    port = _closed_port()
    urls = [
        f"redis://:hunter2@127.0.0.1:{port}/0",
        f"mongodb://user:hunter2@127.0.0.1:{port}/?serverSelectionTimeoutMS=300",
        f"postgres://user:hunter2@127.0.0.1:{port}/db?schema=locks",
        f"sqlite://{tmp_path / 'no-such-dir' / 'locks.sqlite3'}",
    ]
    for url in urls:
        for command in (
            ["run", "--backend", url, KEY, "--", "true"],
            ["status", "--backend", url, KEY],
        ):
            done = cli.run(command, env)
            assert done.status == 69, (url, done.stderr)
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1, done.stderr
            assert "hunter2" not in done.stderr
            assert "127.0.0.1" in lines[0] or "no-such-dir" in lines[0]


@pytest.mark.parametrize(
    ("package", "url", "extra"),
    [
        ("redis", "redis://127.0.0.1:1/0", "dmutex[redis]"),
        ("pymongo", "mongodb://127.0.0.1:1/", "dmutex[mongodb]"),
        ("psycopg", "postgresql://127.0.0.1:1/x", "dmutex[postgresql]"),
    ],
)
def test_a_missing_client_package_exits_69_naming_the_extra(
    env: dict[str, str], tmp_path: Path, package: str, url: str, extra: str
) -> None:
    # A package of that name that fails to import stands in for an absent one.
    shadow = tmp_path / "shadow" / package
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(f"raise ImportError('no {package} here')\n")
    shadowed = {**env, "PYTHONPATH": str(shadow.parent)}
    done = cli.run(["run", "--backend", url, KEY, "--", "true"], shadowed)
    assert done.status == 69, done.stderr
    assert extra in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_mongodb_interoperates_with_the_library_and_fences_its_grants(
    mongo_session: mongo_servers.Session, env: dict[str, str], tmp_path: Path
) -> None:
    server = mongo_session.server()
    url = cli.mongo_url(server.url, server.db_name)
    service = f"cli-{tmp_path.name}"  # a collection of this test's own
    client = server.client()
    try:
        holder = DMutex(service, client, db_name=server.db_name).acquire(KEY, 30)
        assert holder is not None
        base = ["run", "--backend", url, "--service", service, "--ttl", "3"]
        held = cli.run([*base, "-n", KEY, "--", "true"], env)
        assert held.status == 75, held.stderr
        assert holder.release()

        script = "import os; print(repr(os.environ['DMUTEX_FENCE']))"
        done = cli.run([*base, "-n", KEY, "--", sys.executable, "-c", script], env)
        assert done.status == 0, done.stderr
        # The command asks for fences on MongoDB too (fencing=True).
        assert done.stdout.strip().strip("'").isdigit(), done.stdout
        assert DMutex(service, client, db_name=server.db_name).acquire(KEY, 1) is not None
    finally:
        client.close()


# -- PostgreSQL: the URL and the connection the command makes ------------------


def with_param(url: str, name: str, value: str) -> str:
    """``url`` with one more query parameter, its value percent-encoded."""
    return f"{url}{'&' if '?' in url else '?'}{name}={quote(value, safe='')}"


def test_postgresql_url_parameters_besides_schema_go_to_libpq(
    postgres_server: str, postgres_schema: str, env: dict[str, str]
) -> None:
    found = cli.postgres_store(postgres_server, postgres_schema)
    try:
        holder = DMutex(cli.SERVICE, found.client).acquire(KEY, 30)
        assert holder is not None
        # No schema=: libpq's own options= puts the schema on the search path.
        url = with_param(postgres_server, "options", f"-csearch_path={postgres_schema}")
        held = cli.run(["run", "--backend", url, "-n", KEY, "--", "true"], env)
        assert held.status == 75, held.stderr
        shown = cli.run(["status", "--backend", url, KEY], env)
        assert shown.status == 0, shown.stderr
        assert holder.token[:8] in shown.stdout
        assert holder.release()
    finally:
        found.close()


def test_postgresql_through_pgbouncer_in_transaction_mode_with_schema(
    postgres_server: str, postgres_schema: str, pgbouncer_url: str, env: dict[str, str]
) -> None:
    found = cli.postgres_store(postgres_server, postgres_schema)
    try:
        url = with_param(pgbouncer_url, "schema", postgres_schema)  # no search path through it
        holder = DMutex(cli.SERVICE, found.client).acquire(KEY, 30)
        assert holder is not None
        held = cli.run(["run", "--backend", url, "-n", KEY, "--", "true"], env)
        assert held.status == 75, held.stderr
        assert holder.release()
        script = "import os; print(os.environ['DMUTEX_TOKEN'])"
        done = cli.run(
            ["run", "--backend", url, "-n", KEY, "--", sys.executable, "-c", script], env
        )
        assert done.status == 0, done.stderr
        assert done.stdout.strip()
        assert is_free(found)
    finally:
        found.close()


def test_postgresql_connections_get_timeouts_that_fit_the_request_unless_set() -> None:
    assert postgres_timeouts({}, request_timeout(2.0), {}) == {
        "connect_timeout": 2,  # libpq's least
        "tcp_user_timeout": 1000,
        "fallback_application_name": "dmutex",
    }
    assert postgres_timeouts({}, request_timeout(60.0), {})["connect_timeout"] == 5
    named = {"tcp_user_timeout": "250", "application_name": "mine"}
    assert postgres_timeouts(named, 10.0, {"PGCONNECT_TIMEOUT": "7"}) == {
        "fallback_application_name": "dmutex"  # only a fallback: application_name wins
    }


def test_run_gets_a_pool_that_wakes_waiters_and_status_one_connection(
    postgres_server: str, postgres_schema: str
) -> None:
    target = urls.parse(with_param(postgres_server, "schema", postgres_schema), {})
    assert target.options == {"schema_name": postgres_schema}
    assert "schema=" not in target.url  # the command's own: libpq would refuse it
    statements = Statements.of("t", postgres_schema, fencing=True)
    waiting = urls.connect(target, timeout=2.0, waits=True)
    try:
        assert isinstance(waiting.client, psycopg_pool.ConnectionPool)
        assert waiting.client.max_size == POOL_SIZE
        assert listener(waiting.client, statements, 1, asynchronous=False) is not None
        with waiting.client.connection() as conn:
            assert conn.autocommit
            assert conn.info.get_parameters()["tcp_user_timeout"] == "2000"
            assert conn.info.parameter_status("application_name") == "dmutex"
    finally:
        waiting.close()
    reading = urls.connect(target, timeout=2.0)
    try:
        assert isinstance(reading.client, psycopg.Connection)
        assert reading.client.autocommit
    finally:
        reading.close()


def test_without_psycopg_pool_run_shares_one_connection_and_polls(
    postgres_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "psycopg_pool", None)  # its import raises ImportError
    backend = urls.connect(urls.parse(postgres_server, {}), timeout=2.0, waits=True)
    try:
        assert isinstance(backend.client, psycopg.Connection)
        assert backend.client.autocommit
        statements = Statements.of("t", None, fencing=True)
        assert listener(backend.client, statements, 1, asynchronous=False) is None
    finally:
        backend.close()


def test_a_malformed_postgresql_url_is_a_usage_error_that_hides_its_password(
    env: dict[str, str],
) -> None:
    # libpq quotes a malformed token back: here the password itself.
    done = cli.run(["status", "--backend", "postgresql://user:hunter%zz2@127.0.0.1/x", KEY], env)
    assert done.status == 64, done.stderr
    assert "percent-encoded" in done.stderr
    assert "hunter" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_status_never_exits_1_for_an_error_it_does_not_know(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """1 means "free": a bug inside status exits 70 with its traceback instead."""
    from dmutex._cli import main

    # The module, not the function of the same name that dmutex._cli exports.
    status_module = importlib.import_module("dmutex._cli.status")

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("a bug")

    monkeypatch.setattr(status_module, "Reader", broken)
    path = tmp_path / "locks.sqlite3"
    SQLiteBackend(path).close()
    assert main(["status", "--backend", f"sqlite://{path}", KEY]) == 70
    err = capsys.readouterr().err
    assert "RuntimeError: a bug" in err
    assert "status failed unexpectedly" in err
    assert main(["status", "--backend", "redis://127.0.0.1:99999/", KEY]) == 64, "known: usage"

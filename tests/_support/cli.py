"""Helpers for tests of the ``dmutex`` command: the real console script, in subprocesses.

- :func:`console_script`: ``dmutex`` next to ``sys.executable`` (what ``pip install`` made);
- :func:`environment`: the environment each run gets, with ``XDG_STATE_HOME`` in tmp;
- :func:`run` / :func:`start`: the command, to completion or in the background;
- :data:`CHILD` and :class:`Child`: a Python child that reports its pid, its
  ``DMUTEX_*`` variables and every signal it receives, through files;
- :class:`Store`: a backend seen from the test: its URL, a library client on
  it, and how to delete a lease from under its holder; :func:`sqlite_store`,
  :func:`redis_store` and :func:`postgres_store` make one.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import IO
from urllib.parse import quote, urlsplit, urlunsplit

import etcd3gw
import psycopg
import pytest
import redis
from psycopg import sql

from dmutex import SQLiteBackend, SyncClient
from tests._support import etcd_servers
from tests._support.sampling import process_state, until

RUN_TIMEOUT = 30.0  # one dmutex run, start to exit, on a loaded 2-core machine
SERVICE = "dmutex"  # the command's default --service

# The child: handles SIGINT, SIGTERM and SIGHUP as its mode says, writes
# ready.json (pid and DMUTEX_* variables) once its handlers are in place, and
# appends each signal number it gets to signals.txt. Modes: "record" records
# and goes on, exiting 42 on SIGHUP; "stubborn" records and ignores them all;
# "plain" keeps the default dispositions. It exits 99 after 60 s whatever.
CHILD = r"""
import json, os, signal, sys, time
folder, mode = sys.argv[1], sys.argv[2]
def record(signum, frame):
    with open(os.path.join(folder, "signals.txt"), "a") as log:
        log.write(f"{signum}\n")
    if mode == "record" and signum == signal.SIGHUP:
        sys.exit(42)
if mode != "plain":
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, record)
names = ("DMUTEX_KEY", "DMUTEX_TOKEN", "DMUTEX_FENCE", "DMUTEX_SLOT")
report = {"pid": os.getpid(), "env": {n: os.environ.get(n) for n in names}}
with open(os.path.join(folder, "ready.tmp"), "w") as out:
    json.dump(report, out)
os.replace(os.path.join(folder, "ready.tmp"), os.path.join(folder, "ready.json"))
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.02)
sys.exit(99)
"""


def console_script() -> Path:
    """The ``dmutex`` script of this interpreter's environment; fails the test if missing."""
    script = Path(sys.executable).parent / "dmutex"
    if not script.exists():
        pytest.fail(f"no console script at {script}: run `pip install -e .` in this environment")
    return script


def environment(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This process's environment for a run: XDG_STATE_HOME in ``tmp_path``, no DMUTEX_BACKEND."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMUTEX_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    env.update(extra)
    return env


def start(
    args: Sequence[str],
    env: Mapping[str, str],
    *,
    module: bool = False,
    stderr: Path | None = None,
) -> subprocess.Popen[str]:
    """Start ``dmutex ARGS`` (or ``python -m dmutex ARGS``) in a session of its own.

    Its own session: no controlling terminal, so that a signal the test sends
    reaches ``dmutex`` alone, as a ``kill`` from another shell would.
    ``stderr``: a file to write it to, for a test that reads it while the
    command runs (otherwise a pipe, read at the end).
    """
    program = [sys.executable, "-m", "dmutex"] if module else [str(console_script())]
    with contextlib.ExitStack() as files:
        err: int | IO[str] = subprocess.PIPE
        if stderr is not None:
            err = files.enter_context(stderr.open("w"))
        return subprocess.Popen(
            [*program, *args],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )


@dataclass(frozen=True)
class Finished:
    """A run that ended: its exit status, output, and monotonic seconds from start to exit."""

    status: int
    stdout: str
    stderr: str
    seconds: float


def finish(
    process: subprocess.Popen[str], started: float, timeout: float = RUN_TIMEOUT
) -> Finished:
    """Wait for ``process`` (killing it and failing the test after ``timeout`` s)."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"dmutex still running after {timeout} s; stdout: {out!r}; stderr: {err!r}")
    return Finished(process.returncode, out or "", err or "", time.monotonic() - started)


def account(process: subprocess.Popen[str], stderr: Path | None = None) -> str:
    """What ``process`` did, for a failed wait's message: its exit status and output.

    A process still running is killed first (the test fails anyway), so that
    what it printed can be read; ``stderr``: the file its stderr went to, if any.
    """
    state = "exited"
    if process.poll() is None:
        process.kill()
        state = "was still running (killed now)"
    try:
        out, err = process.communicate(timeout=10)
    except (subprocess.TimeoutExpired, ValueError):  # ValueError: its pipes were read already
        out, err = "", ""
    if stderr is not None and stderr.exists():
        err = stderr.read_text()
    return f"dmutex {state}, status {process.returncode}; stdout: {out!r}; stderr: {err!r}"


def run(args: Sequence[str], env: Mapping[str, str], *, module: bool = False) -> Finished:
    """Run ``dmutex ARGS`` to completion."""
    started = time.monotonic()
    return finish(start(args, env, module=module), started)


def child_command(folder: Path, mode: str) -> list[str]:
    """The COMMAND that runs :data:`CHILD` in ``mode``, reporting into ``folder``."""
    return [sys.executable, "-c", CHILD, str(folder), mode]


@dataclass
class Child:
    """What the child reported, read from its folder.

    ``process``: the ``dmutex`` that runs it, if the test started one, so that
    a wait that fails says what that process printed and how it ended.
    """

    folder: Path
    process: subprocess.Popen[str] | None = None

    def wait_ready(self, timeout: float = RUN_TIMEOUT) -> dict[str, object]:
        """The child's ready report, once it is written (its signal handlers are in place)."""
        ready = self.folder / "ready.json"
        process = self.process
        why = None if process is None else lambda: account(process)
        until(ready.exists, "the child started", timeout, poll=0.02, why=why)
        report: dict[str, object] = json.loads(ready.read_text())
        return report

    @property
    def pid(self) -> int:
        pid = self.wait_ready()["pid"]
        assert isinstance(pid, int)
        return pid

    def signals(self) -> list[int]:
        """Every signal number the child recorded, in order."""
        log = self.folder / "signals.txt"
        return [int(line) for line in log.read_text().split()] if log.exists() else []

    def wait_signals(self, count: int, timeout: float = RUN_TIMEOUT) -> list[int]:
        """The signals once ``count`` of them were recorded."""
        until(lambda: len(self.signals()) >= count, f"{count} signals reached the child", timeout)
        return self.signals()


def gone(pid: int) -> bool:
    """Whether no process ``pid`` exists (a zombie counts as gone: it runs nothing)."""
    return process_state(pid) in (None, "Z")


@dataclass
class Store:
    """One backend as the test sees it: the URL for ``--backend`` and a library client."""

    name: str
    url: str
    client: SyncClient
    sqlite_path: Path | None = None
    redis_client: redis.Redis | None = None
    postgres_schema: str | None = None
    """PostgreSQL: the schema of the tables; ``client`` has it first on its search path."""
    etcd: etcd_servers.Endpoint | None = None
    """etcd: the member the test reads and deletes keys through."""

    def delete_lease(self, key: str, slot: int = 0, service: str = SERVICE) -> None:
        """Delete the mutex lease of ``key`` from storage, under its holder; fails if none."""
        if self.sqlite_path is not None:
            with closing(sqlite3.connect(self.sqlite_path, isolation_level=None)) as conn:
                deleted = conn.execute(
                    f'DELETE FROM "_dmutex_{service}" WHERE key = ?', (f"permit:{slot}:{key}",)
                ).rowcount
        elif isinstance(self.client, psycopg.Connection):
            query = sql.SQL("DELETE FROM {} WHERE key = %s").format(self._table(service))
            deleted = self.client.execute(query, (f"permit:{slot}:{key}",)).rowcount
        elif self.etcd is not None:
            # As etcd ends a lease: its revoke deletes the key, and a keep-alive finds it gone.
            found = self._etcd_record(f"_dmutex_{service}:permit:{slot}:{key}")
            if found is not None:
                etcd_servers.request(self.etcd, "/v3/kv/lease/revoke", {"ID": found["lease"]})
            deleted = 0 if found is None else 1
        else:
            assert self.redis_client is not None
            deleted = self.redis_client.delete(f"_dmutex_{service}:permit:{slot}:{key}")
        assert deleted == 1, f"no lease of {key!r} to delete"

    def stored_token(self, key: str, slot: int = 0, service: str = SERVICE) -> str | None:
        """The token the mutex lease of ``key`` holds in storage, or None."""
        if self.sqlite_path is not None:
            with closing(sqlite3.connect(self.sqlite_path, isolation_level=None)) as conn:
                row = conn.execute(
                    f'SELECT value FROM "_dmutex_{service}" WHERE key = ?',
                    (f"permit:{slot}:{key}",),
                ).fetchone()
            return None if row is None else str(row[0])
        if isinstance(self.client, psycopg.Connection):
            query = sql.SQL("SELECT value FROM {} WHERE key = %s").format(self._table(service))
            found = self.client.execute(query, (f"permit:{slot}:{key}",)).fetchone()
            return None if found is None else str(found[0])
        if self.etcd is not None:
            record = self._etcd_record(f"_dmutex_{service}:permit:{slot}:{key}")
            return None if record is None else base64.b64decode(record["value"]).decode()
        assert self.redis_client is not None
        value = self.redis_client.get(f"_dmutex_{service}:permit:{slot}:{key}")
        return None if value is None else value.decode() if isinstance(value, bytes) else value

    def _etcd_record(self, name: str) -> dict[str, str] | None:
        """The etcd key ``name`` as the gateway answers it (base64 key and value), or None."""
        assert self.etcd is not None
        body = {"key": base64.b64encode(name.encode()).decode()}
        found = etcd_servers.request(self.etcd, "/v3/kv/range", body).get("kvs") or []
        return dict(found[0]) if found else None

    def _table(self, service: str, prefix: str = "_dmutex_") -> sql.Identifier:
        """The PostgreSQL table of ``service``'s locks, in the store's schema."""
        assert self.postgres_schema is not None
        return sql.Identifier(self.postgres_schema, f"{prefix}{service}")

    def close(self) -> None:
        """Close the test's clients."""
        if isinstance(self.client, (SQLiteBackend, psycopg.Connection)):
            self.client.close()
        if self.redis_client is not None:
            self.redis_client.close()
        if isinstance(self.client, etcd3gw.Etcd3Client):
            self.client.session.close()


def sqlite_store(tmp_path: Path) -> Store:
    """A fresh SQLite file in ``tmp_path``."""
    path = tmp_path / "locks.sqlite3"
    return Store("sqlite", f"sqlite://{path}", SQLiteBackend(path), sqlite_path=path)


def redis_store(url: str) -> Store:
    """The (emptied) Redis database at ``url``."""
    client = redis.Redis.from_url(url)
    return Store("redis", url, client, redis_client=client)


def etcd_store(server: etcd_servers.Server) -> Store:
    """A member the tests started, the command's namespaces (service ``SERVICE``) emptied.

    The command keeps its keys under the service's default prefixes, not the
    tests' own (it takes no key prefix): on an etcd the user named, the test
    skips rather than touch keys outside the tests' prefix.
    """
    if server.pid is None:
        pytest.skip("the command's keys would be outside the tests' prefix on the user's etcd")
    endpoint = server.endpoints[0]
    for kind in ("_dmutex_", "_dsemaphore_", "_drwlock_"):
        start = f"{kind}{SERVICE}:".encode()
        body = {
            "key": base64.b64encode(start).decode(),
            "range_end": base64.b64encode(etcd_servers.prefix_end(start)).decode(),
        }
        etcd_servers.request(endpoint, "/v3/kv/deleterange", body)
    client = etcd3gw.Etcd3Client(host=endpoint.host, port=endpoint.port, timeout=10)
    return Store("etcd", f"etcd://{endpoint.address}", client, etcd=endpoint)


def postgres_store(server_url: str, schema: str) -> Store:
    """The PostgreSQL server at ``server_url``, in ``schema``, its lock tables dropped.

    The command's URL names the schema with its own ``schema=`` parameter;
    the library's client, a connection in autocommit, has it first on its
    search path, so that both reach one table.
    """
    joiner = "&" if "?" in server_url else "?"
    path = quote(f"-csearch_path={schema}")
    client = psycopg.connect(f"{server_url}{joiner}options={path}", autocommit=True)
    store = Store(
        "postgresql",
        f"{server_url}{joiner}schema={quote(schema)}",
        client,
        postgres_schema=schema,
    )
    for prefix in ("_dmutex_", "_dsemaphore_"):
        client.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(store._table(SERVICE, prefix)))
    return store


def mongo_url(server_url: str, db_name: str) -> str:
    """The command's URL for a MongoDB test server: the test database in its path.

    The command takes its ``db_name`` from there.
    """
    parts = urlsplit(server_url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db_name}", parts.query, ""))

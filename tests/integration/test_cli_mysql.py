"""The ``dmutex`` command on MySQL/MariaDB: ``mysql://`` and ``mariadb://`` URLs, run and status.

Every test asserts exit statuses. The server is the session's
(``tests/_support/mysql_servers.py``), in the session's test database; each
test uses a ``--service`` of its own, so its tables are its own. The
library's client beside the command is a PyMySQL connection in autocommit in
that database. Leases are short (``--ttl`` 1.5-3 s), so that renewals and a
lost lease happen within a second or two. Every wait is a poll with a
generous deadline; nothing is timed tightly.

The URL rules these tests hold the command to are
``dmutex._backends.mysql.url``'s: a database is required, two query parameters are known,
the password is never printed, a bad URL is refused before any I/O, and a
connection the server dropped is opened again by the next request.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pymysql
import pytest
from pymysql.connections import Connection
from pymysql.cursors import Cursor

from dmutex import DMutex
from dmutex._backends.mysql.url import mysql_options
from dmutex._cli import urls
from dmutex._cli.errors import Failure
from dmutex._cli.holders import read_holders
from dmutex._cli.run import request_timeout
from tests._support import cli, mysql_servers
from tests._support.cli import Child
from tests._support.sampling import until

KEY = "job"
TTL = "1.5"  # renewed every 0.5 s
GRACE = "0.3"  # at most a quarter of --ttl

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="dmutex run is POSIX only")


@dataclass
class MySQLCli:
    """The command's URL for the session's test database, a service of the test's own, and a
    library client (PyMySQL, autocommit) in that database."""

    url: str
    service: str
    database: str
    conn: Connection[Cursor]

    def args(self, command: str, *more: str) -> list[str]:
        """``dmutex COMMAND --backend URL --service SERVICE MORE...``."""
        return [command, "--backend", self.url, "--service", self.service, *more]

    def mutex(self) -> DMutex:
        return DMutex(self.service, self.conn)

    def rows(self, table_prefix: str = "_dmutex_") -> list[tuple[str, str, int]]:
        """Every row of the service's table: ``(key, value, expired_at)``."""
        table = f"`{table_prefix}{self.service}`"
        with self.conn.cursor() as cursor:
            cursor.execute(f"SELECT `key`, `value`, `expired_at` FROM {table} ORDER BY `key`")
            return [(str(k), str(v), int(e)) for k, v, e in cursor.fetchall()]

    def stored_token(self, key: str = KEY) -> str | None:
        found = [value for name, value, _ in self.rows() if name == f"permit:0:{key}"]
        return found[0] if found else None

    def expiry(self, key: str = KEY) -> int:
        """The stored expiry (epoch ms) of the mutex lease of ``key``; fails if none."""
        found = [expires for name, _, expires in self.rows() if name == f"permit:0:{key}"]
        assert found, f"no lease of {key!r}"
        return found[0]

    def delete_lease(self, key: str = KEY) -> None:
        with self.conn.cursor() as cursor:
            deleted = cursor.execute(
                f"DELETE FROM `_dmutex_{self.service}` WHERE `key` = %s", (f"permit:0:{key}",)
            )
        assert deleted == 1, f"no lease of {key!r} to delete"

    def is_free(self, key: str = KEY) -> bool:
        """Whether the library can take ``key`` now (it releases it again at once)."""
        handle = self.mutex().acquire(key, 5)
        if handle is None:
            return False
        assert handle.release()
        return True


@pytest.fixture
def mysql(mysql_session: mysql_servers.Session) -> Iterator[MySQLCli]:
    server = mysql_session.server()
    conn = server.connect()
    try:
        yield MySQLCli(server.database_url, f"cli_{secrets.token_hex(4)}", server.database, conn)
    finally:
        conn.close()


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return cli.environment(tmp_path)


def child_folder(tmp_path: Path, name: str = "child") -> Child:
    folder = tmp_path / name
    folder.mkdir()
    return Child(folder)


def start_child(
    tmp_path: Path, env: dict[str, str], args: list[str], mode: str = "plain"
) -> tuple[Child, subprocess.Popen[str], float]:
    """Start ``dmutex ARGS KEY -- <the test child in mode>``: the child, the process, its start."""
    child = child_folder(tmp_path)
    process = cli.start([*args, KEY, "--", *cli.child_command(child.folder, mode)], env)
    child.process = process
    return child, process, time.monotonic()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# -- run and status, end to end -------------------------------------------------


def test_run_holds_and_renews_the_lock_and_status_shows_holder_and_fence(
    mysql: MySQLCli, env: dict[str, str], tmp_path: Path
) -> None:
    child, process, started = start_child(tmp_path, env, mysql.args("run", "--ttl", TTL))
    variables = child.wait_ready()["env"]
    assert isinstance(variables, dict)
    assert variables["DMUTEX_KEY"] == KEY
    token = mysql.stored_token()
    assert token is not None
    assert variables["DMUTEX_TOKEN"] == token
    fence = variables["DMUTEX_FENCE"]
    assert isinstance(fence, str)
    assert fence.isdigit()  # the command asks for fences on MySQL too (fencing=True)
    assert variables["DMUTEX_SLOT"] == "0"
    # The fence is the row dmutex keeps for the key, next to the lease's.
    assert (f"fence:{KEY}", fence) in {(k, v) for k, v, _ in mysql.rows()}

    # The library sees it held, and still held past the first lease's expiry (renewed).
    assert mysql.mutex().acquire(KEY, 5) is None
    first = read_holders(mysql.conn, service=mysql.service, limit=1, key=KEY)
    assert [h.token for h in first.holders] == [token]

    def past_first_expiry() -> bool:
        now = read_holders(mysql.conn, service=mysql.service, limit=1, key=KEY)
        return now.now_ms > first.holders[0].expires_ms + 100

    until(past_first_expiry, "the first lease's expiry passed", cli.RUN_TIMEOUT, poll=0.05)
    assert mysql.stored_token() == token
    assert mysql.mutex().acquire(KEY, 5) is None

    shown = cli.run(mysql.args("status", KEY), env)
    assert shown.status == 0, shown.stderr
    assert "held (1 of 1)" in shown.stdout
    assert token[:8] in shown.stdout
    assert token not in shown.stdout
    assert f"fence: {fence} " in shown.stdout
    as_json = cli.run(mysql.args("status", "--json", KEY), env)
    assert as_json.status == 0, as_json.stderr
    document = json.loads(as_json.stdout)
    assert document["held"] is True
    assert document["fence"] == int(fence)
    assert [h["slot"] for h in document["holders"]] == [0]
    assert token.startswith(document["holders"][0]["token_prefix"])
    assert document["holders"][0]["left_seconds"] > 0

    os.kill(child.pid, signal.SIGKILL)
    done = cli.finish(process, started)
    assert done.status == 128 + signal.SIGKILL, done.stderr
    free = cli.run(mysql.args("status", KEY), env)
    assert free.status == 1, free.stderr
    assert "free" in free.stdout
    assert f"fence: {fence} " in free.stdout  # the counter stays when the lease goes
    assert mysql.is_free()


def test_a_held_key_conflicts_and_a_waiter_polls_until_the_release(
    mysql: MySQLCli, env: dict[str, str], tmp_path: Path
) -> None:
    holder = mysql.mutex().acquire(KEY, 30)
    assert holder is not None
    no_wait = cli.run(mysql.args("run", "-n", KEY, "--", "true"), env)
    assert no_wait.status == 75, no_wait.stderr
    assert no_wait.stderr == ""  # quiet without -v, as flock(1)
    waited = cli.run(mysql.args("run", "-w", "0.5", KEY, "--", "true"), env)
    assert waited.status == 75, waited.stderr

    log = tmp_path / "stderr.txt"
    process = cli.start(mysql.args("run", "-v", "--ttl", "3", KEY, "--", "true"), env, stderr=log)
    started = time.monotonic()
    until(lambda: "waiting for" in log.read_text(), "dmutex says it waits", cli.RUN_TIMEOUT)
    assert holder.token[:8] in log.read_text()  # who holds it, shortened ...
    assert holder.token not in log.read_text()  # ... never whole
    assert process.poll() is None
    assert holder.release()  # no wake-up reaches another process: its next poll takes it
    done = cli.finish(process, started)
    assert done.status == 0, log.read_text()
    assert "acquired" in log.read_text()
    assert mysql.is_free()


def test_a_refused_run_leaves_no_fence_and_status_shows_none_for_a_key_never_granted(
    mysql: MySQLCli, env: dict[str, str]
) -> None:
    """Only a grant makes the key's counter row (statements rule 4): a refusal makes none.

    The slot is held by another program, as a TypeScript client's grant
    leaves it (the slot's row, no counter); ``dmutex run -n`` is refused,
    and ``dmutex status`` shows the holder and no fence line.
    """
    mysql.mutex().ready()
    with mysql.conn.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO `_dmutex_{mysql.service}` VALUES (%s, 'theirs-token', "
            "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6)) DIV 1000) + 60000)",
            (f"permit:0:{KEY}",),
        )
    no_wait = cli.run(mysql.args("run", "-n", KEY, "--", "true"), env)
    assert no_wait.status == 75, no_wait.stderr
    assert mysql.mutex().acquire(KEY, 5) is None
    assert [name for name, _, _ in mysql.rows()] == [f"permit:0:{KEY}"], "no fence row"

    shown = cli.run(mysql.args("status", KEY), env)
    assert shown.status == 0, shown.stderr
    assert "held (1 of 1)" in shown.stdout
    assert "theirs..." in shown.stdout, "the token, shortened"
    assert "fence" not in shown.stdout, shown.stdout
    as_json = cli.run(mysql.args("status", "--json", KEY), env)
    assert as_json.status == 0, as_json.stderr
    assert json.loads(as_json.stdout)["fence"] is None


def test_limit_makes_a_semaphore(mysql: MySQLCli, env: dict[str, str], tmp_path: Path) -> None:
    base = mysql.args("run", "--ttl", "3", "--limit", "2", KEY, "--")
    children = [child_folder(tmp_path, f"child{i}") for i in range(2)]
    processes = [cli.start([*base, *cli.child_command(c.folder, "plain")], env) for c in children]
    for child, process in zip(children, processes, strict=True):
        child.process = process
    started = time.monotonic()
    tokens, slots = set(), set()
    for child in children:
        variables = child.wait_ready()["env"]
        assert isinstance(variables, dict)
        tokens.add(str(variables["DMUTEX_TOKEN"]))
        slots.add(variables["DMUTEX_SLOT"])
    assert len(tokens) == 2
    assert slots == {"0", "1"}

    third = cli.run(mysql.args("run", "--limit", "2", "-n", KEY, "--", "true"), env)
    assert third.status == 75, third.stderr
    shown = cli.run(mysql.args("status", "--limit", "2", "--json", KEY), env)
    assert shown.status == 0, shown.stderr
    document = json.loads(shown.stdout)
    assert sorted(h["slot"] for h in document["holders"]) == [0, 1]
    assert {h["token_prefix"] for h in document["holders"]} == {t[:8] for t in tokens}

    for child in children:
        os.kill(child.pid, signal.SIGTERM)
    for process in processes:
        assert cli.finish(process, started).status == 128 + signal.SIGTERM
    free = cli.run(mysql.args("status", "--limit", "2", KEY), env)
    assert free.status == 1, free.stderr


def test_a_lost_lease_stops_the_child(mysql: MySQLCli, env: dict[str, str], tmp_path: Path) -> None:
    args = mysql.args("run", "--ttl", TTL, "--kill-grace", GRACE)
    child, process, started = start_child(tmp_path, env, args, "stubborn")
    pid = child.pid
    mysql.delete_lease()
    done = cli.finish(process, started)
    assert done.status == 70, done.stderr
    assert signal.SIGTERM in child.signals()
    assert cli.gone(pid)
    assert "lost the lease" in done.stderr
    assert mysql.is_free()


# -- the connection -------------------------------------------------------------


@dataclass
class Account:
    """A MySQL account of the test's own, whose password needs percent-encoding in a URL."""

    user: str
    password: str

    def url(self, server: mysql_servers.Server, scheme: str = "mysql") -> str:
        args = mysql_servers.connect_args(server.url)
        auth = f"{quote(self.user, safe='')}:{quote(self.password, safe='')}"
        return f"{scheme}://{auth}@{args['host']}:{args['port']}/{quote(server.database, safe='')}"


@pytest.fixture
def account(mysql_session: mysql_servers.Session) -> Iterator[Account]:
    """A user with every right on the test database, dropped at the end."""
    server = mysql_session.server()
    made = Account(f"dmutex_cli_{secrets.token_hex(4)}", "p@ss:w/rd%hunter2#é")
    with mysql_servers.connect(server.url) as admin, admin.cursor() as cursor:
        try:
            cursor.execute("CREATE USER %s@'%%' IDENTIFIED BY %s", (made.user, made.password))
        except pymysql.err.OperationalError as error:  # a server the user named: no CREATE USER
            pytest.skip(f"cannot create a MySQL user on {server.label}: {error}")
        try:
            cursor.execute(f"GRANT ALL ON `{server.database}`.* TO %s@'%%'", (made.user,))
            yield made
        finally:
            cursor.execute("DROP USER IF EXISTS %s@'%%'", (made.user,))


def connections_of(conn: Connection[Cursor], user: str) -> list[int]:
    with conn.cursor() as cursor:
        cursor.execute("SELECT ID FROM information_schema.PROCESSLIST WHERE USER = %s", (user,))
        return sorted(int(row[0]) for row in cursor.fetchall())


def test_a_password_that_needs_encoding_reaches_the_server_and_is_never_printed(
    mysql_session: mysql_servers.Session,
    mysql: MySQLCli,
    account: Account,
    env: dict[str, str],
) -> None:
    url = account.url(mysql_session.server(), "mariadb")  # the other scheme: the same backend
    holder = mysql.mutex().acquire(KEY, 30)
    assert holder is not None
    held = cli.run(
        ["run", "--service", mysql.service, "-v", "-n", KEY, "--", "true"],
        {**env, "DMUTEX_BACKEND": url},
    )
    assert held.status == 75, held.stderr  # it connected as the account and saw the holder
    shown = cli.run(["status", "--backend", url, "--service", mysql.service, KEY], env)
    assert shown.status == 0, shown.stderr
    assert holder.token[:8] in shown.stdout
    assert holder.release()

    wrong = url.replace(quote(account.password, safe=""), "hunter2")
    refused = cli.run(["status", "--backend", wrong, KEY], env)
    assert refused.status == 69, refused.stderr
    assert "Access denied" in refused.stderr
    for done in (held, shown, refused):
        assert "hunter2" not in done.stdout + done.stderr
        assert "p@ss" not in done.stdout + done.stderr
    assert ":***@" in refused.stderr


def test_a_connection_the_server_drops_is_opened_again_and_the_lease_kept(
    mysql_session: mysql_servers.Session,
    mysql: MySQLCli,
    account: Account,
    env: dict[str, str],
    tmp_path: Path,
) -> None:
    url = account.url(mysql_session.server())
    args = ["run", "--backend", url, "--service", mysql.service, "--ttl", "3"]
    child, process, started = start_child(tmp_path, env, args)
    token = child.wait_ready()["env"]
    assert isinstance(token, dict)
    first = connections_of(mysql.conn, account.user)
    assert len(first) == 1, first  # run's one connection
    with mysql.conn.cursor() as cursor:
        cursor.execute(f"KILL CONNECTION {first[0]}")
    killed_at = mysql.expiry()

    def renewed_since() -> bool:
        if process.poll() is not None:
            pytest.fail(f"dmutex ended: {cli.finish(process, started).stderr}")
        # Renewals come every second or so, each moving the expiry to 3 s after it: one at
        # least 2 s after the kill has come through a connection opened again.
        return mysql.expiry() > killed_at + 2000

    until(renewed_since, "renewals after the connection was killed", cli.RUN_TIMEOUT, poll=0.05)
    again = connections_of(mysql.conn, account.user)
    assert len(again) == 1, again
    assert again != first  # a new connection, the old one gone
    assert process.poll() is None  # the child still runs: the lease was never lost
    assert mysql.stored_token() == token["DMUTEX_TOKEN"]
    os.kill(child.pid, signal.SIGKILL)
    done = cli.finish(process, started)
    assert done.status == 128 + signal.SIGKILL, done.stderr
    assert "lost" not in done.stderr
    assert mysql.is_free()


def test_connect_gives_one_pymysql_connection_in_the_urls_database(mysql: MySQLCli) -> None:
    target = urls.parse(mysql.url, {})
    assert target.backend == "mysql"
    backend = urls.connect(target, timeout=request_timeout(2.0), waits=True)
    try:
        conn = backend.client
        assert isinstance(conn, Connection)
        with conn.cursor() as cursor:
            cursor.execute("SELECT DATABASE(), @@autocommit, @@character_set_client")
            assert cursor.fetchone() == (mysql.database, 1, "utf8mb4")
            cursor.execute("SELECT CONNECTION_ID()")
            row = cursor.fetchone()
        assert row is not None
        with mysql.conn.cursor() as cursor:
            cursor.execute(f"KILL CONNECTION {int(row[0])}")
        # The first request after the kill fails (its reply never comes) ...
        with pytest.raises(backend.errors):
            read_holders(conn, service=mysql.service, limit=1, key=KEY)
        # ... and the next one opens the connection again.
        found = read_holders(conn, service=mysql.service, limit=1, key=KEY)
        assert found.holders == []
        assert conn.open
    finally:
        backend.close()


# -- the URL ---------------------------------------------------------------------


def test_mysql_options_decode_the_url_and_bound_every_request() -> None:
    url = "mysql://us%40er:p%40ss%3Aw%2Frd%C3%A9@[::1]:3307/my%2Fdb?unix_socket=%2Frun%2Fm.sock"
    options = mysql_options(url, request_timeout(2.0))
    assert options == {
        "host": "::1",
        "port": 3307,
        "user": "us@er",
        "password": "p@ss:w/rdé".encode(),  # bytes: PyMySQL would encode a str as Latin-1
        "database": "my/db",
        "unix_socket": "/run/m.sock",
        "connect_timeout": 1.0,
        "read_timeout": 1.0,
        "write_timeout": 1.0,
        "autocommit": True,
        "charset": "utf8mb4",
        "program_name": "dmutex",
    }
    # No user, password, host or port: PyMySQL's defaults (the login name, localhost, 3306).
    bare = mysql_options("MariaDB:///ops?ssl_ca=/etc/ca.pem", request_timeout(60.0))
    assert {k: bare[k] for k in ("database", "connect_timeout", "read_timeout")} == {
        "database": "ops",
        "connect_timeout": 5.0,  # at most 5 s to connect
        "read_timeout": 10.0,
    }
    assert not {"host", "port", "user", "password"} & set(bare)
    # TLS with a CA file checks the certificate and the host name: PyMySQL does neither unless told.
    assert (bare["ssl_ca"], bare["ssl_verify_cert"], bare["ssl_verify_identity"]) == (
        "/etc/ca.pem",
        True,
        True,
    )


BAD_URLS = [
    ("mysql://root@127.0.0.1:{port}/", "must name the database"),
    ("mysql://root@127.0.0.1:{port}", "must name the database"),
    ("mariadb://root:hunter2@127.0.0.1:{port}", "must name the database"),
    ("mysql://root@127.0.0.1:{port}/a/b", "one database"),
    ("mysql://root@127.0.0.1:{port}/" + "d" * 65, "over 64"),
    ("mysql://root@127.0.0.1:{port}/db%00x", "NUL"),
    ("mysql://root@127.0.0.1:{port}/db?charset=latin1", "unknown parameter 'charset'"),
    ("mysql://root@127.0.0.1:{port}/db?schema=x", "unix_socket=PATH and ssl_ca=PATH"),
    ("mysql://root@127.0.0.1:{port}/db?ssl_ca=", "needs a path"),
    ("mysql://root@127.0.0.1:{port}/db?unix_socket=/a&unix_socket=/b", "given twice"),
    ("mysql://root@127.0.0.1:{port}/db#x", "fragment"),
    ("mysql://root:hunter2@127.0.0.1:99999/db", "out of range"),
    ("mysql://root@127.0.0.1:0/db", "port 0"),
    ("mysql://root:hunter2@127.0.0.1:x{port}/db", "Port"),
    ("mysql+pymysql://root@127.0.0.1:{port}/db", "unsupported backend URL"),
]


@pytest.mark.parametrize(("url", "says"), BAD_URLS)
def test_a_bad_url_exits_64_before_any_io(env: dict[str, str], url: str, says: str) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        given = url.format(port=listener.getsockname()[1])
        with pytest.raises(Failure) as parsed:  # parse() alone refuses it: no I/O there
            urls.parse(given, {})
        assert parsed.value.status == 64
        for command in (["status", "--backend", given, KEY], ["run", "--backend", given, KEY]):
            done = cli.run([*command, "--", "true"] if command[0] == "run" else command, env)
            assert done.status == 64, done.stderr
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1, done.stderr
            assert says in lines[0]
            assert "hunter2" not in lines[0]
        with pytest.raises(BlockingIOError):  # nobody connected to the URL's port
            listener.accept()


def test_an_unreachable_server_exits_69_naming_it_without_its_password(
    env: dict[str, str],
) -> None:
    url = f"mysql://user:hunter2@127.0.0.1:{_closed_port()}/db"
    for command in (
        ["run", "--backend", url, KEY, "--", "true"],
        ["status", "--backend", url, KEY],
    ):
        done = cli.run(command, env)
        assert done.status == 69, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert "hunter2" not in done.stderr
        assert f"mysql://user:***@127.0.0.1:{url.rsplit(':', 1)[1]}" in lines[0]


def test_an_unknown_database_exits_69(mysql: MySQLCli, env: dict[str, str]) -> None:
    url = mysql.url.replace(mysql.database, "dmutex_no_such_database")
    done = cli.run(["status", "--backend", url, KEY], env)
    assert done.status == 69, done.stderr
    assert "dmutex_no_such_database" in done.stderr


def test_a_missing_pymysql_exits_69_naming_the_extra(env: dict[str, str], tmp_path: Path) -> None:
    # A package of that name that fails to import stands in for an absent one.
    shadow = tmp_path / "shadow" / "pymysql"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no pymysql here')\n")
    shadowed = {**env, "PYTHONPATH": str(shadow.parent)}
    done = cli.run(["run", "--backend", "mysql://127.0.0.1:1/db", KEY, "--", "true"], shadowed)
    assert done.status == 69, done.stderr
    assert "pip install 'dmutex[mysql]'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1

"""The MariaDB/MySQL server the tests find or start (``mysql_servers.py``)."""

from __future__ import annotations

import os
import pwd
from collections.abc import Iterator
from pathlib import Path

import mysql.connector
import MySQLdb
import pymysql
import pytest

from tests._support import mysql_servers
from tests._support.mysql_servers import Executable, FromUrl, Restartable, Session
from tests._support.servers import Discovery, alive


def _uid(pid: int) -> int:
    """The real uid process ``pid`` runs as."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for pid {pid}")


def _expected_uid() -> int:
    user = mysql_servers.unprivileged_user()
    return os.geteuid() if user is None else pwd.getpwnam(user).pw_uid


def _databases(url: str, name: str) -> int:
    sql = f"SELECT count(*) FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = '{name}'"
    count = mysql_servers.query(url, sql)
    assert isinstance(count, int)
    return count


def test_the_server_answers_pymysql_mysqlclient_and_mysql_connector(mysql_server: str) -> None:
    args = mysql_servers.connect_args(mysql_server)
    assert mysql_servers.query(mysql_server, "SELECT 40 + 2") == 42
    with MySQLdb.connect(**args) as conn:
        cursor = conn.cursor()
        cursor.execute("SELECT 40 + 2")
        assert cursor.fetchone() == (42,)
    conn2 = mysql.connector.connect(**args)
    try:
        cursor2 = conn2.cursor()
        cursor2.execute("SELECT 40 + 2")
        assert cursor2.fetchone() == (42,)
        cursor2.close()
    finally:
        conn2.close()
    version = str(mysql_servers.query(mysql_server, "SELECT VERSION()"))
    assert mysql_servers.parse_version(version)[1][0].isdigit()


def test_the_session_has_a_database_of_its_own(
    mysql_session: Session, mysql_server: str, mysql_database: str
) -> None:
    server = mysql_session.server()
    assert (server.url, server.database) == (mysql_server, mysql_database)
    assert mysql_database.startswith(mysql_servers.TEST_DATABASE_PREFIX)
    assert len(mysql_database) == len(mysql_servers.TEST_DATABASE_PREFIX) + 12
    assert _databases(mysql_server, mysql_database) == 1
    with server.connect() as conn, conn.cursor() as cursor:
        cursor.execute("SELECT DATABASE()")
        assert cursor.fetchone() == (mysql_database,)
    assert mysql_servers.connect_args(server.database_url)["database"] == mysql_database
    assert server.label == f"{server.flavour}-{server.version}"


def test_the_collation_is_a_case_insensitive_utf8mb4_default(mysql_session: Session) -> None:
    server = mysql_session.fresh()
    with server.connect() as conn, conn.cursor() as cursor:
        cursor.execute(
            "SELECT DEFAULT_CHARACTER_SET_NAME, DEFAULT_COLLATION_NAME"
            " FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = DATABASE()"
        )
        charset, collation = cursor.fetchone() or (None, None)
        # A table made with no collation of its own: keys that differ in case collide.
        cursor.execute("CREATE TABLE names (name VARCHAR(64) PRIMARY KEY)")
        cursor.execute("INSERT INTO names VALUES ('Lock')")
        with pytest.raises(pymysql.err.IntegrityError, match="Duplicate entry"):
            cursor.execute("INSERT INTO names VALUES ('lock')")
        cursor.execute("SELECT count(*) FROM names WHERE name = 'LOCK'")
        assert cursor.fetchone() == (1,)
    assert charset == "utf8mb4"
    assert str(collation).startswith("utf8mb4_")
    assert str(collation).endswith("_ci")
    if server.flavour == "mariadb" and server.origin != "DMUTEX_MYSQL_URL":
        # The harness's own servers: Debian's defaults, not --no-defaults' latin1.
        assert collation == mysql_servers.COLLATION
        settings = "SELECT CONCAT(@@character_set_server, ' ', @@collation_server)"
        assert mysql_servers.query(server.url, settings) == "utf8mb4 utf8mb4_general_ci"


@pytest.fixture
def own_server() -> Iterator[Restartable]:
    """A server of its own from the executables (not the session's), its data kept on stop."""
    found = Restartable.from_executables()
    if found is None:
        if mysql_servers.required():
            pytest.fail("DMUTEX_REQUIRE_MYSQL is set, but no mariadbd was found")
        pytest.skip(mysql_servers.no_server_reason(("executables",)))
    with found:
        yield found


def test_a_started_server_runs_unprivileged_and_stops_by_its_pid(own_server: Restartable) -> None:
    server = own_server.start()
    folder, pid = own_server.folder, own_server.pid
    assert server.pid == pid
    assert (folder / "data" / "mysql").is_dir()
    assert (
        server.label == own_server.executable.label
    )  # the binary's version is the one that answers
    expected = _expected_uid()
    assert _uid(pid) == expected
    assert folder.stat().st_uid == expected
    assert (folder / "data").stat().st_uid == expected
    if mysql_servers.unprivileged_user() is not None:
        assert expected != 0
    client = own_server.connect()
    with client.cursor() as cursor:
        cursor.execute("CREATE TABLE survivor (x INT)")
        cursor.execute("INSERT INTO survivor VALUES (1)")

    own_server.stop()  # with a client still connected
    assert not alive(pid)
    assert not own_server.running
    # A normal shutdown (SIGTERM), not the SIGKILL after the bound.
    log = own_server.process.log_path.read_text()
    assert log.rstrip().endswith("Shutdown complete"), own_server.log_tail()
    with pytest.raises(pymysql.err.OperationalError):
        client.ping(reconnect=False)
    client.close()
    with pytest.raises(pymysql.err.OperationalError):
        mysql_servers.connect(server.url)

    # Kept: it starts again on the same port with the same data (no new install).
    again = own_server.restart()
    assert again.url == server.url
    assert again.pid != pid
    assert mysql_servers.query(again.url, "SELECT count(*) FROM survivor", own_server.database) == 1

    # Killed: every acknowledged commit is there after InnoDB's recovery.
    with own_server.connect() as conn, conn.cursor() as cursor:
        cursor.execute("INSERT INTO survivor VALUES (2)")
    killed = own_server.pid
    own_server.kill()
    assert not alive(killed)
    after = own_server.start()
    assert (after.url, own_server.starts) == (server.url, 3)
    assert mysql_servers.query(after.url, "SELECT sum(x) FROM survivor", own_server.database) == 3

    last = own_server.pid
    own_server.close()
    assert not alive(last)
    assert not folder.exists()


def test_the_restartable_server_is_a_second_one_closed_with_the_session(
    mysql_server: str,
) -> None:
    session = Session(Discovery([]))  # no server of its own: the restartable one needs none
    try:
        restartable = session.restartable()
        assert restartable.url != mysql_server
        assert restartable.database == session.database
        with restartable.connect() as conn, conn.cursor() as cursor:
            cursor.execute("CREATE TABLE leftover (x INT)")
        first = restartable.pid
        restartable.stop()
        assert not restartable.running
        assert not alive(first)
        # The next call starts it again, on the same port, its database emptied.
        assert session.restartable() is restartable
        assert alive(restartable.pid)
        assert restartable.server.url == restartable.url
        tables = "SELECT count(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE()"
        assert mysql_servers.query(restartable.url, tables, restartable.database) == 0
        pid, folder = restartable.pid, restartable.folder
        assert pid != first
        assert _uid(pid) == _expected_uid()
    finally:
        session.close()
    assert not alive(pid)
    assert not folder.exists()
    assert mysql_servers.query(mysql_server, "SELECT 1") == 1  # the fixture's server is not it


def test_the_url_from_the_environment_wins(
    mysql_session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = mysql_session.server()
    monkeypatch.delenv(mysql_servers.KNOB, raising=False)
    monkeypatch.setenv("DMUTEX_MYSQL_URL", server.url)
    found = mysql_servers.discover()
    assert found.sources == [FromUrl(server.url, "DMUTEX_MYSQL_URL")]
    assert found.passed_over == []
    assert found.header("mysql server") == f"mysql server: {server.label}"

    # The user's server: the tests make a database of their own there, drop
    # only that at the end, and leave the server running.
    session = Session(found)
    try:
        used = session.server()
        assert (used.origin, used.label, used.pid) == ("DMUTEX_MYSQL_URL", server.label, None)
        assert used.database != mysql_session.database
        assert _databases(server.url, used.database) == 1
    finally:
        session.close()
    assert _databases(server.url, used.database) == 0
    assert _databases(server.url, mysql_session.database) == 1
    assert server.pid is None or alive(server.pid)
    assert mysql_servers.query(server.url, "SELECT 1") == 1


def test_the_knob_limits_the_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DMUTEX_MYSQL_URL", "mysql://nobody@127.0.0.1:1/")
    monkeypatch.setenv(mysql_servers.KNOB, "none")
    found = mysql_servers.discover()
    assert found.sources == []
    assert (
        found.reason == "no MySQL server: DMUTEX_MYSQL_SERVERS leaves out url, docker, executables"
    )
    monkeypatch.setenv(mysql_servers.KNOB, "docker,executables")
    assert not any(isinstance(s, FromUrl) for s in mysql_servers.discover().sources)
    monkeypatch.setenv(mysql_servers.KNOB, "url")
    assert mysql_servers.discover().sources == [FromUrl("mysql://nobody@127.0.0.1:1/")]
    monkeypatch.setenv(mysql_servers.KNOB, "url,postgresql")
    with pytest.raises(ValueError, match="unknown postgresql"):
        mysql_servers.discover()


def test_with_no_docker_the_executables_follow_and_the_header_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DMUTEX_MYSQL_URL", raising=False)
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    monkeypatch.setenv(mysql_servers.KNOB, "docker")
    found = mysql_servers.discover()
    assert found.sources == []
    assert found.reason == (
        "no MySQL server: no Docker daemon answers;"
        " DMUTEX_MYSQL_SERVERS leaves out url, executables"
    )
    monkeypatch.delenv(mysql_servers.KNOB)
    found = mysql_servers.discover()
    if mysql_servers.find_executables() is None:
        assert found.sources == []
        return
    assert [type(source) for source in found.sources] == [Executable]
    assert found.passed_over == ["DMUTEX_MYSQL_URL is unset", "no Docker daemon answers"]
    label = found.labels[0]
    mariadbd = found.sources[0]
    assert isinstance(mariadbd, Executable)
    assert label == f"mariadb-{mysql_servers.mariadbd_version(mariadbd.mariadbd)}"
    assert found.header("mysql server") == (
        f"mysql server: {label} (DMUTEX_MYSQL_URL is unset; no Docker daemon answers)"
    )


def test_no_server_skips_unless_one_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    nothing: Discovery[mysql_servers.Source] = Discovery([], "no MySQL server: why")
    monkeypatch.delenv("DMUTEX_REQUIRE_MYSQL", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no MySQL server: why"):
        Session(mysql_servers.check_required(nothing)).server()
    monkeypatch.setenv("DMUTEX_REQUIRE_MYSQL", "0")
    assert mysql_servers.check_required(nothing) is nothing
    monkeypatch.setenv("DMUTEX_REQUIRE_MYSQL", "1")
    with pytest.raises(RuntimeError, match="DMUTEX_REQUIRE_MYSQL is set, but no MySQL server: why"):
        mysql_servers.check_required(nothing)


def test_fresh_empties_the_sessions_database_only(mysql_session: Session) -> None:
    server = mysql_session.server()
    other = mysql_servers.unique_database()  # ours too: a user's server keeps its own databases
    with server.connect() as conn, conn.cursor() as cursor:
        cursor.execute("CREATE TABLE leftover (x INT)")
        cursor.execute(f"CREATE DATABASE `{other}`")
        cursor.execute(f"CREATE TABLE `{other}`.kept (x INT)")
    try:
        assert mysql_session.fresh() == server
        tables = "SELECT count(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = '{}'"
        assert mysql_servers.query(server.url, tables.format(server.database)) == 0
        assert mysql_servers.query(server.url, tables.format(other)) == 1
        assert _databases(server.url, server.database) == 1
    finally:
        mysql_servers.drop_database(server.url, other)
    assert _databases(server.url, other) == 0


@pytest.mark.parametrize(
    "name", ["mysql", "dmutex_test_", "dmutex_test_0123456789ab_x", "dmutex_test_0123456789AB", "x"]
)
def test_only_the_tests_databases_are_ever_dropped(name: str) -> None:
    with pytest.raises(ValueError, match="refusing to drop database"):
        mysql_servers.check_ours(name)
    with pytest.raises(ValueError, match="refusing to drop database"):
        mysql_servers.drop_database("mysql://root@127.0.0.1:1/", name)  # refused before connecting
    with pytest.raises(ValueError, match="refusing"):
        Session(Discovery([]), database=name)
    assert mysql_servers.check_ours("dmutex_test_0123456789ab") == "dmutex_test_0123456789ab"


def test_connect_args_of_urls() -> None:
    assert mysql_servers.connect_args("mysql://root@127.0.0.1:3307/") == {
        "host": "127.0.0.1",
        "port": 3307,
        "user": "root",
        "password": "",
    }
    assert mysql_servers.connect_args("mariadb+pymysql://app%20user:s%3Acret@db.example/appdb") == {
        "host": "db.example",
        "port": 3306,
        "user": "app user",
        "password": "s:cret",
        "database": "appdb",
    }
    with pytest.raises(ValueError, match="not a MySQL URL"):
        mysql_servers.connect_args("postgresql://root@127.0.0.1/")
    url = mysql_servers.url_of("127.0.0.1", 3307, "app user", "s:cret")
    assert url == "mysql://app%20user:s%3Acret@127.0.0.1:3307/"
    assert mysql_servers.with_database(url, "d") == "mysql://app%20user:s%3Acret@127.0.0.1:3307/d"
    assert mysql_servers.parse_version("10.11.19-MariaDB-0+deb12u1") == ("mariadb", "10.11.19")
    assert mysql_servers.parse_version("8.0.36") == ("mysql", "8.0.36")


def test_the_server_command_runs_unprivileged_with_the_debian_charset() -> None:
    folder = Path("/nowhere")
    command = mysql_servers.server_command(Path("/usr/sbin/mariadbd"), folder, 7000, "mysql")
    assert command[:2] == ["/usr/sbin/mariadbd", "--no-defaults"]  # --no-defaults must be first
    for option in (
        "--port=7000",
        "--bind-address=127.0.0.1",
        "--user=mysql",
        "--datadir=/nowhere/data",
        "--socket=/nowhere/sock",
        "--character-set-server=utf8mb4",
        "--collation-server=utf8mb4_general_ci",
        "--innodb-flush-log-at-trx-commit=0",
    ):
        assert option in command
    durable = mysql_servers.server_command(Path("m"), folder, 1, None, flush_at_commit=True)
    assert "--innodb-flush-log-at-trx-commit=2" in durable
    assert not any(option.startswith("--user") for option in durable)

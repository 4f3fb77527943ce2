"""The PostgreSQL server and PgBouncer the tests find or start (``postgres_servers.py``)."""

from __future__ import annotations

import asyncio
import os
import pwd
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import psycopg
import pytest

from tests._support import postgres_servers
from tests._support.postgres_servers import Executable, FromUrl, Session
from tests._support.servers import Discovery, alive


def _query(url: str, query: str) -> object:
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute(query).fetchone()
    assert row is not None
    return row[0]


async def _asyncpg_query(url: str, query: str, statement_cache_size: int = 100) -> object:
    conn = await asyncpg.connect(url, timeout=5, statement_cache_size=statement_cache_size)
    try:
        return await conn.fetchval(query)
    finally:
        await conn.close()


def _uid(pid: int) -> int:
    """The real uid process ``pid`` runs as."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for pid {pid}")


def test_the_server_answers_psycopg_and_asyncpg(postgres_server: str) -> None:
    assert _query(postgres_server, "SELECT 40 + 2") == 42
    assert asyncio.run(_asyncpg_query(postgres_server, "SELECT 40 + 2")) == 42
    assert str(_query(postgres_server, "SHOW server_version_num")).isdigit()


def test_the_session_has_a_schema_of_its_own(postgres_server: str, postgres_schema: str) -> None:
    assert postgres_schema.startswith(postgres_servers.TEST_SCHEMA_PREFIX)
    assert postgres_schema != postgres_servers.TEST_SCHEMA_PREFIX
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        found = conn.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname = %s", (postgres_schema,)
        ).fetchone()
    assert found == (1,)


@pytest.fixture
def own_server() -> Iterator[Session]:
    """A server of its own from the executables (not the session's), its cluster kept on stop."""
    bindirs = postgres_servers.candidate_bindirs()
    if not bindirs:
        if postgres_servers.required():
            pytest.fail("DMUTEX_REQUIRE_POSTGRESQL is set, but no initdb and postgres was found")
        pytest.skip("no initdb and postgres on PATH or in " + postgres_servers.DEBIAN_BINDIRS)
    source = Executable(bindirs[0], keep=True)
    session = Session(Discovery([source]))
    try:
        yield session
    finally:
        session.close()
        source.process.close()


def test_a_started_server_runs_unprivileged_and_stops_by_its_pid(own_server: Session) -> None:
    source = own_server.discovery.sources[0]
    assert isinstance(source, Executable)
    server = own_server.server()
    process = source.process
    assert server.pid is not None
    postmaster, runner, folder = server.pid, process.pid, process.folder
    assert (folder / "data" / "PG_VERSION").is_file()
    assert server.label == source.label  # the version the binary says is the one that answers
    client = psycopg.connect(server.url, autocommit=True)
    backend = client.execute("SELECT pg_backend_pid()").fetchone()
    assert backend is not None
    client.execute("CREATE TABLE public.survivor (x int)")
    user = postgres_servers.unprivileged_user()
    expected = os.geteuid() if user is None else pwd.getpwnam(user).pw_uid
    assert _uid(postmaster) == expected
    assert _uid(backend[0]) == _uid(postmaster)
    if user is not None:
        assert expected != 0
        assert _uid(runner) == 0  # runuser, whose process group is signalled
    assert alive(postmaster)
    assert alive(backend[0])

    own_server.close()  # with a client still connected
    for pid in (postmaster, runner, backend[0]):
        assert not alive(pid), pid
    # A clean fast shutdown, not runuser's SIGKILL ("Session terminated, killing shell...").
    log = process.log_path.read_text()
    assert log.rstrip().endswith("database system is shut down"), process.log_tail()
    assert "killing shell" not in log
    with pytest.raises(psycopg.OperationalError):
        client.execute("SELECT 1")
    client.close()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(server.url, connect_timeout=2)

    # Kept: it starts again on the same port with the same cluster (no new initdb).
    again = source.start("unused")
    assert again.url == server.url
    assert again.pid != postmaster
    assert _query(again.url, "SELECT to_regclass('public.survivor') IS NOT NULL") is True
    source.stop()
    assert again.pid is not None
    assert not alive(again.pid)
    process.close()
    assert not folder.exists()


def test_the_url_from_the_environment_wins(
    postgres_session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = postgres_session.server()
    other = "postgresql://nobody@127.0.0.1:1/nowhere"
    monkeypatch.delenv(postgres_servers.KNOB, raising=False)
    monkeypatch.setenv("DMUTEX_POSTGRESQL_URL", server.url)
    monkeypatch.setenv("PG_URL", other)
    found = postgres_servers.discover()
    assert found.sources == [FromUrl(server.url, "DMUTEX_POSTGRESQL_URL")]
    assert found.passed_over == []
    assert found.header("postgresql server") == f"postgresql server: {server.label}"

    monkeypatch.delenv("DMUTEX_POSTGRESQL_URL")
    assert postgres_servers.discover().sources == [FromUrl(other, "PG_URL")]
    monkeypatch.setenv("PG_URL", server.url)

    # The user's server: the tests make a schema of their own there, drop only
    # that at the end, and leave the server running.
    session = Session(postgres_servers.discover())
    try:
        used = session.server()
        assert (used.origin, used.label, used.pid) == ("PG_URL", server.label, None)
        assert used.schema not in (server.schema, postgres_session.schema)
        count = "SELECT count(*) FROM pg_namespace WHERE nspname = '{}'"
        assert _query(server.url, count.format(used.schema)) == 1
    finally:
        session.close()
    assert _query(server.url, count.format(used.schema)) == 0
    assert _query(server.url, count.format(postgres_session.schema)) == 1
    assert _query(server.url, "SELECT 1") == 1


def test_the_knob_limits_the_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DMUTEX_POSTGRESQL_URL", "postgresql://nobody@127.0.0.1:1/nowhere")
    monkeypatch.setenv(postgres_servers.KNOB, "none")
    found = postgres_servers.discover()
    assert found.sources == []
    assert found.reason == (
        "no PostgreSQL server: DMUTEX_POSTGRESQL_SERVERS leaves out url, docker, executables"
    )
    monkeypatch.setenv(postgres_servers.KNOB, "docker,executables")
    assert not any(isinstance(s, FromUrl) for s in postgres_servers.discover().sources)
    monkeypatch.setenv(postgres_servers.KNOB, "url,mysql")
    with pytest.raises(ValueError, match="unknown mysql"):
        postgres_servers.discover()


def test_no_server_skips_unless_one_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    nothing: Discovery[postgres_servers.Source] = Discovery([], "no PostgreSQL server: why")
    monkeypatch.delenv("DMUTEX_REQUIRE_POSTGRESQL", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no PostgreSQL server: why"):
        Session(postgres_servers.check_required(nothing)).server()
    monkeypatch.setenv("DMUTEX_REQUIRE_POSTGRESQL", "0")
    assert postgres_servers.check_required(nothing) is nothing
    monkeypatch.setenv("DMUTEX_REQUIRE_POSTGRESQL", "1")
    with pytest.raises(RuntimeError, match="DMUTEX_REQUIRE_POSTGRESQL is set, but no Post"):
        postgres_servers.check_required(nothing)
    no_pooler: Discovery[postgres_servers.PgBouncer] = Discovery([], "no PgBouncer: why")
    with pytest.raises(RuntimeError, match="DMUTEX_REQUIRE_POSTGRESQL is set, but no PgB"):
        postgres_servers.check_required(no_pooler)


# --- PgBouncer ----------------------------------------------------------------------


def test_pgbouncer_answers_psycopg_and_asyncpg_on_the_same_database(
    postgres_session: Session, pgbouncer_url: str
) -> None:
    server = postgres_session.server()
    bouncer = postgres_session.bouncer()
    assert bouncer.url == pgbouncer_url
    database = "SELECT current_database()"
    assert _query(pgbouncer_url, database) == _query(server.url, database)
    schema = f"SELECT count(*) FROM pg_namespace WHERE nspname = '{server.schema}'"
    assert _query(pgbouncer_url, schema) == 1
    # asyncpg's statement cache names statements on one backend: off behind a pooler.
    query = _asyncpg_query(pgbouncer_url, "SELECT 40 + 2", statement_cache_size=0)
    assert asyncio.run(query) == 42
    assert alive(bouncer.pid)
    if postgres_servers.unprivileged_user() is not None:
        assert _uid(bouncer.pid) != 0  # it refuses root: it dropped to a user


def _admin(url: str, command: str) -> list[dict[str, object]]:
    """The rows the PgBouncer admin console at ``url`` answers ``command`` with."""
    with psycopg.connect(url, autocommit=True) as admin:
        # The admin console speaks the simple query protocol only: a client-side cursor.
        cursor = psycopg.ClientCursor(admin).execute(command)
        assert cursor.description is not None
        names = [column.name for column in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor]


def test_pgbouncer_pools_per_transaction(postgres_session: Session) -> None:
    bouncer = postgres_session.bouncer()
    # A pool exists once a client has used it.
    assert _query(bouncer.url, "SELECT 1") == _query(bouncer.single_url, "SELECT 1") == 1
    database = str(_query(bouncer.url, "SELECT current_database()"))
    config = {row["key"]: row["value"] for row in _admin(bouncer.admin_url, "SHOW CONFIG")}
    assert config["pool_mode"] == "transaction"
    modes = {row["database"]: row["pool_mode"] for row in _admin(bouncer.admin_url, "SHOW POOLS")}
    assert modes[database] == modes[postgres_servers.SINGLE_DB] == "transaction"
    sizes = {row["name"]: row["pool_size"] for row in _admin(bouncer.admin_url, "SHOW DATABASES")}
    assert sizes[postgres_servers.SINGLE_DB] == 1


def _shared_state(url: str) -> tuple[object, object, bool, bool]:
    """Two clients of ``url``, one statement at a time: what each sees of the other's session.

    Returns whether B saw A's setting, what A then sees after B's, whether
    their backends were one, and whether B could run A's prepared statement.
    """
    read = "SELECT current_setting('dmutex.probe', true)"
    with (
        psycopg.connect(url, autocommit=True) as a,
        psycopg.connect(url, autocommit=True) as b,
    ):
        a.execute("SET dmutex.probe = 'a'")
        a.execute("PREPARE dmutex_probe AS SELECT 1")
        b_sees = b.execute(read).fetchone()
        b.execute("SET dmutex.probe = 'b'")
        a_sees = a.execute(read).fetchone()
        pid_a = a.execute("SELECT pg_backend_pid()").fetchone()
        pid_b = b.execute("SELECT pg_backend_pid()").fetchone()
        try:
            b.execute("EXECUTE dmutex_probe")
            shared_statement = True
        except psycopg.errors.InvalidSqlStatementName:
            shared_statement = False
        a.execute("DEALLOCATE ALL")  # the backend goes back to the pool clean
        a.execute("RESET dmutex.probe")
    assert b_sees is not None
    assert a_sees is not None
    return b_sees[0], a_sees[0], pid_a == pid_b, shared_statement


def test_through_pgbouncer_a_session_is_not_the_clients_own(postgres_session: Session) -> None:
    server = postgres_session.server()
    bouncer = postgres_session.bouncer()
    # Direct: each client has its session; A's setting and statement are A's alone.
    assert _shared_state(server.url) == (None, "a", False, False)
    # Through a pool of one server connection in transaction mode, between
    # transactions a client holds no backend: the next one is whoever's turn
    # it is, so B sees A's setting and statement, and A sees B's.
    assert _shared_state(bouncer.single_url) == ("a", "b", True, True)


def test_pgbouncer_is_stopped_by_its_pid(postgres_session: Session) -> None:
    server = postgres_session.server()
    found = postgres_servers.discover_pgbouncer()
    if not found.sources:
        pytest.skip(found.reason)
    pooler = found.sources[0]
    bouncer = pooler.start(server)
    folder = pooler.process.folder
    try:
        assert _query(bouncer.url, "SELECT 1") == 1
        assert (folder / "pgbouncer.ini").is_file()
    finally:
        pooler.stop()
    assert not alive(bouncer.pid)
    assert not folder.exists()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(bouncer.url, connect_timeout=2)


def test_fresh_empties_the_sessions_schema_only(postgres_session: Session) -> None:
    server = postgres_session.server()
    other = postgres_servers.unique_schema()  # ours too: a user's server keeps its own schemas
    with server.connect() as conn:
        conn.execute(f'CREATE TABLE "{server.schema}".leftover (x int)')
        conn.execute(f'CREATE SCHEMA "{other}"')
        conn.execute(f'CREATE TABLE "{other}".kept (x int)')
    try:
        assert postgres_session.fresh() == server
        tables = "SELECT count(*) FROM pg_tables WHERE schemaname = '{}' AND tablename = '{}'"
        assert _query(server.url, tables.format(server.schema, "leftover")) == 0
        assert _query(server.url, tables.format(other, "kept")) == 1
        schemas = f"SELECT count(*) FROM pg_namespace WHERE nspname = '{server.schema}'"
        assert _query(server.url, schemas) == 1
    finally:
        with server.connect() as conn:
            conn.execute(f'DROP SCHEMA "{other}" CASCADE')


def test_the_pgbouncer_configuration_for_a_users_server() -> None:
    url = "postgresql://app%20user:s3cret@db.example:6543/appdb"
    ini, userlist, user = postgres_servers.pgbouncer_config(url, Path("/nowhere"), 7000)
    entry = "host='db.example' port='6543' dbname='appdb' user='app user' password='s3cret'"
    lines = ini.splitlines()
    assert f"appdb = {entry}" in lines
    assert f"{postgres_servers.SINGLE_DB} = {entry} pool_size=1" in lines
    for setting in ("listen_addr = 127.0.0.1", "listen_port = 7000", "pool_mode = transaction"):
        assert setting in lines
    assert "auth_file = /nowhere/userlist.txt" in lines
    assert (userlist, user) == ('"app user" ""\n', "app user")

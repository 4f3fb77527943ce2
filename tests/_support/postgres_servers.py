"""A PostgreSQL server for the tests, and a PgBouncer in transaction mode in front of it.

The server, found or started in a fixed order:

1. ``DMUTEX_POSTGRESQL_URL``, else ``PG_URL``: a server the user runs. The
   tests work in one schema of their own, ``dmutex_test_<random>``, unique to
   the session, and drop it at the end; they never drop a database or touch
   another schema. The role needs ``CREATE`` on the database.
2. testcontainers, when a Docker daemon answers: a ``postgres:15`` container.
3. Executables: ``initdb`` and ``postgres`` from the folder of the ``postgres``
   on PATH, else from the newest ``/usr/lib/postgresql/<N>/bin`` (Debian's
   ``postgresql`` package puts them there, off PATH). ``initdb`` makes a
   cluster in a temporary folder (trust authentication, superuser
   ``dmutex``), and ``postgres`` runs on a free loopback port with its unix
   socket in that folder. Run as root, both run as the unprivileged user
   ``postgres`` (else ``nobody``) through ``runuser``: PostgreSQL refuses
   root. ``fsync``, ``synchronous_commit`` and ``full_page_writes`` are off,
   for speed: a crash of the machine may lose the cluster, which is thrown
   away at the end anyway. It is stopped by its pid with SIGINT (fast
   shutdown: it ends its sessions and exits), not SIGTERM (smart shutdown
   waits for every client to leave, and ``runuser`` SIGKILLs it 2 s after a
   SIGTERM).
4. Otherwise the PostgreSQL tests skip, with one line saying why.

``DMUTEX_POSTGRESQL_SERVERS``, a comma-separated subset of
``url,docker,executables`` (or ``none``), limits the order to those sources.

The pooler, in front of whichever server was found: the ``pgbouncer`` on
PATH (or ``/usr/sbin``, where Debian's ``pgbouncer`` package puts it),
started on first use with a configuration file in its own temporary folder:
``pool_mode = transaction``, a free loopback port, no unix socket,
``auth_type = trust`` (loopback only; the server's own password, if the URL
has one, is in the configuration file, which only the owner reads). It
refuses to run as root, so run as root it is started with ``-u postgres``
(else ``nobody``): it reads its files, then drops to that user. It is stopped
by its pid with SIGTERM (immediate shutdown). It serves the server's database
under its own name, and once more as :data:`SINGLE_DB`, a pool of one server
connection, where every client shares one backend, one transaction at a time.
Otherwise the pooler tests skip, with one line saying why.

``DMUTEX_REQUIRE_POSTGRESQL=1`` turns "no server" and "no pgbouncer" into
failures, so that CI cannot skip the PostgreSQL suites unnoticed.

The order, the pool and the processes are ``servers.py``'s; this module says
what is PostgreSQL and PgBouncer about them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from urllib.parse import quote

import psycopg
import psycopg.conninfo
import pytest
from psycopg import sql

from tests._support import servers
from tests._support.servers import LOOPBACK, Src, docker_answers

START_TIMEOUT = 30.0
CONNECT_TIMEOUT = 2  # seconds, per probe
SUPERUSER = "dmutex"  # the role initdb makes; trust authentication, no password
DATABASE = "postgres"  # the database the tests use on a server they start
TEST_SCHEMA_PREFIX = "dmutex_test_"
CONTAINER_IMAGE = "postgres:15"
DEBIAN_BINDIRS = "/usr/lib/postgresql/*/bin"
SINGLE_DB = "dmutex_single"  # the pooler's alias with one server connection
UNPRIVILEGED = ("postgres", "nobody")  # the first that exists runs the servers, as root
PING_ERRORS = (psycopg.OperationalError,)

URL_VARIABLES = ("DMUTEX_POSTGRESQL_URL", "PG_URL")
SOURCE_NAMES = ("url", "docker", "executables")
_MISSING = {
    "url": "DMUTEX_POSTGRESQL_URL and PG_URL are unset",
    "docker": "no Docker daemon answers",
    "executables": f"no initdb and postgres on PATH or in {DEBIAN_BINDIRS}",
}
NO_SERVER = "no PostgreSQL server"
NO_PGBOUNCER = "no PgBouncer"
KNOB = "DMUTEX_POSTGRESQL_SERVERS"


def unprivileged_user() -> str | None:
    """The user the servers run as: None when the tests do not run as root."""
    return servers.unprivileged(UNPRIVILEGED)


def unique_schema() -> str:
    """A schema name no other session uses: ``dmutex_test_<12 hex digits>``."""
    return f"{TEST_SCHEMA_PREFIX}{secrets.token_hex(6)}"


def _check_ours(schema: str) -> None:
    if not schema.startswith(TEST_SCHEMA_PREFIX) or schema == TEST_SCHEMA_PREFIX:
        raise ValueError(f"refusing to drop schema {schema!r}: not one the tests created")


def server_version(url: str) -> str:
    """The version the server at ``url`` reports (one try: it raises if it is not up)."""
    with psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT, autocommit=True) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    assert row is not None
    return str(row[0]).split()[0]  # "15.18 (Debian 15.18-0+deb12u1)": "15.18"


def wait_until_up(url: str, timeout: float = START_TIMEOUT) -> str:
    """Connect until the server at ``url`` answers a query; return its version."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return server_version(url)
        except PING_ERRORS:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def url_of(host: str, port: int, user: str, dbname: str, password: str | None = None) -> str:
    """A ``postgresql://`` URL."""
    auth = quote(user, safe="") + (f":{quote(password, safe='')}" if password else "")
    return f"postgresql://{auth}@{host}:{port}/{quote(dbname, safe='')}"


def upstream_of(url: str) -> tuple[str, int]:
    """``(host, port)`` of a PostgreSQL URL: what a fault proxy forwards to."""
    params = psycopg.conninfo.conninfo_to_dict(url)
    return str(params.get("host") or LOOPBACK), int(str(params.get("port") or 5432))


@dataclass(frozen=True)
class Server:
    """A reachable PostgreSQL server, and the schema the tests may use on it."""

    label: str  # "postgresql-15.18": what messages show
    url: str
    origin: str  # "DMUTEX_POSTGRESQL_URL", "testcontainers", or the postgres path
    schema: str
    pid: int | None = None  # the postmaster's, when the tests started it

    def connect(self) -> psycopg.Connection[tuple[object, ...]]:
        """A new sync connection in autocommit; the caller closes it."""
        return psycopg.connect(self.url, connect_timeout=CONNECT_TIMEOUT, autocommit=True)


class Source(servers.Labelled, Protocol):
    """Something that gives a running server on demand (started, or found running)."""

    def start(self, schema: str) -> Server: ...


# --- the sources, in order --------------------------------------------------------


@dataclass
class FromUrl(servers.External):
    """The server ``DMUTEX_POSTGRESQL_URL`` (or ``PG_URL``) names; never started or stopped here."""

    url: str
    variable: str = "DMUTEX_POSTGRESQL_URL"

    @functools.cached_property
    def label(self) -> str:
        """Asked of the server; ``postgresql-url`` if it does not answer."""
        try:
            return f"postgresql-{server_version(self.url)}"
        except psycopg.Error:
            return "postgresql-url"

    def start(self, schema: str) -> Server:
        return Server(f"postgresql-{wait_until_up(self.url)}", self.url, self.variable, schema)


@dataclass
class Container(servers.Containerized):
    """A ``postgres:15`` container started by testcontainers."""

    label: str = f"postgresql-{CONTAINER_IMAGE.partition(':')[2]}"  # until it answers

    def start(self, schema: str) -> Server:
        container = self.run_container("postgres", "PostgresContainer", CONTAINER_IMAGE)
        host = str(container.get_container_host_ip())
        port = int(container.get_exposed_port(5432))
        url = url_of(host, port, container.username, container.dbname, container.password)
        return Server(f"postgresql-{wait_until_up(url)}", url, "testcontainers", schema)


def postgres_version(bindir: Path) -> str | None:
    """``X.Y`` that ``postgres --version`` prints ("postgres (PostgreSQL) 15.18 ..."), or None."""
    command = [str(bindir / "postgres"), "--version"]
    return servers.printed_version(command, r"\(PostgreSQL\) (\d+(?:\.\d+)*)")


def _major(bindir: Path) -> int:
    digits = re.sub(r"\D", "", bindir.parent.name)
    return int(digits) if digits else -1


def candidate_bindirs() -> list[Path]:
    """Folders holding ``initdb`` and ``postgres``: PATH's first, then Debian's, newest first."""
    found: list[Path] = []
    on_path = shutil.which("postgres")
    if on_path:
        found.append(Path(on_path).resolve().parent)
    found.extend(sorted(Path("/").glob(DEBIAN_BINDIRS.lstrip("/")), key=_major, reverse=True))
    usable = [d for d in found if (d / "initdb").is_file() and (d / "postgres").is_file()]
    return list(dict.fromkeys(usable))


def server_command(
    bindir: Path, folder: Path, port: int, *, synchronous_commit: bool = False
) -> list[str]:
    """``postgres`` on 127.0.0.1:``port``, data in ``folder/data``, its socket in ``folder``.

    ``synchronous_commit=True`` (the fault tests that SIGKILL the server): a
    commit is acknowledged only once its WAL is written; with ``fsync`` still
    off it is not flushed, but the kernel's page cache keeps it across the
    death of the process. Off (the default), the WAL writer writes it up to
    three ``wal_writer_delay`` later, from shared memory, which a SIGKILL of
    the server loses.
    """
    return [
        str(bindir / "postgres"),
        "-D", str(folder / "data"),
        "-p", str(port),
        "-c", f"listen_addresses={LOOPBACK}",
        "-c", f"unix_socket_directories={folder}",
        "-c", "max_connections=200",
        # Speed over durability: the cluster is thrown away at the end.
        "-c", "fsync=off",
        "-c", f"synchronous_commit={'on' if synchronous_commit else 'off'}",
        "-c", "full_page_writes=off",
    ]  # fmt: skip


def initdb_command(bindir: Path, folder: Path) -> list[str]:
    """``initdb`` of a cluster in ``folder/data``: superuser ``dmutex``, trust, no sync."""
    return [
        str(bindir / "initdb"),
        "-D", str(folder / "data"),
        "-U", SUPERUSER,
        "--auth=trust",
        "--encoding=UTF8",
        "--locale=C.UTF-8",
        "--no-sync",
        "--no-instructions",
    ]  # fmt: skip


def make_cluster(bindir: Path, folder: Path, user: str | None) -> None:
    """``initdb`` into ``folder/data`` as ``user``, unless it is there already."""
    if (folder / "data").exists():
        return
    done = subprocess.run(
        servers.as_user(initdb_command(bindir, folder), user),
        capture_output=True,
        text=True,
        cwd=folder,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"initdb exited with code {done.returncode}: {tail}")


def postmaster_pid(folder: Path) -> int:
    """The postmaster's pid, from ``folder/data/postmaster.pid`` (under runuser, not runuser's)."""
    return int((folder / "data" / "postmaster.pid").read_text().split()[0])


@dataclass
class Executable:
    """``initdb`` and ``postgres`` from ``bindir``: a cluster made and started on first use.

    ``keep=True`` keeps the cluster and the port when it stops, so that it can
    start again with the same data (the cluster is made once).
    """

    bindir: Path
    keep: bool = False
    # Its pid, port, folder and log.
    process: servers.ServerProcess = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.process = servers.ServerProcess(
            "postgres", user=unprivileged_user(), keep=self.keep, stop_signal=signal.SIGINT
        )

    @functools.cached_property
    def label(self) -> str:
        """``postgresql-<version>`` from ``postgres --version``."""
        return f"postgresql-{postgres_version(self.bindir) or 'unknown'}"

    def make_cluster(self, folder: Path) -> None:
        """``initdb`` into ``folder/data`` as the server's user, unless it is there already."""
        make_cluster(self.bindir, folder, self.process.user)

    def start(self, schema: str) -> Server:
        process = self.process
        self.make_cluster(process.folder)
        url = url_of(LOOPBACK, process.port, SUPERUSER, DATABASE)
        version = process.start(
            lambda folder, port: server_command(self.bindir, folder, port),
            lambda port: server_version(url),
            PING_ERRORS,
            what=str(self.bindir / "postgres"),
            timeout=START_TIMEOUT,
        )
        # Under runuser the process's pid is runuser's; the postmaster writes its own.
        postmaster = postmaster_pid(process.folder)
        return Server(f"postgresql-{version}", url, str(self.bindir), schema, postmaster)

    def stop(self) -> None:
        """Stop the server by its pid (fast shutdown) and, unless kept, remove its folder."""
        self.process.stop()


# --- the order ----------------------------------------------------------------------


def no_server_reason(allowed: tuple[str, ...]) -> str:
    """The one line a skip shows when none of the ``allowed`` sources gave a server."""
    steps = [(name, _MISSING[name]) for name in SOURCE_NAMES]
    return servers.no_server_reason(NO_SERVER, steps, allowed, KNOB)


def allowed_sources() -> tuple[str, ...]:
    """The sources ``DMUTEX_POSTGRESQL_SERVERS`` lets discovery try, in the fixed order."""
    return servers.allowed_sources(KNOB, SOURCE_NAMES)


def url_from_environment() -> FromUrl | None:
    """The server ``DMUTEX_POSTGRESQL_URL`` names, else ``PG_URL``'s, else None."""
    for variable in URL_VARIABLES:
        url = os.environ.get(variable, "").strip()
        if url:
            return FromUrl(url, variable)
    return None


def discover() -> servers.Discovery[Source]:
    """Find one server in the documented order (nothing is started yet)."""

    def url() -> list[Source]:
        found = url_from_environment()
        return [found] if found is not None else []

    def executables() -> list[Source]:
        bindirs = candidate_bindirs()
        return [Executable(bindirs[0])] if bindirs else []

    looks: dict[str, Callable[[], list[Source]]] = {
        "url": url,
        "docker": lambda: [Container()] if docker_answers() else [],
        "executables": executables,
    }
    steps = [servers.Step(name, _MISSING[name], looks[name]) for name in SOURCE_NAMES]
    found = servers.discover_in_order(steps, NO_SERVER, allowed_sources(), KNOB)
    found.sources = found.sources[:1]
    return found


# --- PgBouncer ----------------------------------------------------------------------


def find_pgbouncer() -> Path | None:
    """The ``pgbouncer`` on PATH, else Debian's ``/usr/sbin/pgbouncer`` (off a user's PATH)."""
    found = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
    return Path(found) if found else None


def pgbouncer_version(path: Path) -> str | None:
    """``X.Y.Z`` that ``pgbouncer --version`` prints ("PgBouncer 1.18.0"), or None."""
    return servers.printed_version([str(path), "--version"], r"PgBouncer (\d+(?:\.\d+)*)")


def _quoted(value: str) -> str:
    """``value`` as a libpq connection-string value (PgBouncer's ``[databases]`` entries)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def pgbouncer_config(server_url: str, folder: Path, port: int) -> tuple[str, str, str]:
    """``(pgbouncer.ini, userlist.txt, the client's user)`` for a pooler in front of ``server_url``.

    Transaction pooling on 127.0.0.1:``port``, trust authentication of the
    user the server's URL names, the server's database under its own name and
    as :data:`SINGLE_DB` with one server connection.
    """
    params = psycopg.conninfo.conninfo_to_dict(server_url)
    user = str(params.get("user") or SUPERUSER)
    dbname = str(params.get("dbname") or user)
    target = {
        "host": str(params.get("host") or LOOPBACK),
        "port": str(params.get("port") or 5432),
        "dbname": dbname,
        "user": user,
    }
    if params.get("password"):
        target["password"] = str(params["password"])
    entry = " ".join(f"{key}={_quoted(value)}" for key, value in target.items())
    ini = "\n".join([
        "[databases]",
        f"{_quoted(dbname)[1:-1]} = {entry}",
        f"{SINGLE_DB} = {entry} pool_size=1",
        "[pgbouncer]",
        f"listen_addr = {LOOPBACK}",
        f"listen_port = {port}",
        "unix_socket_dir =",
        "pool_mode = transaction",
        "auth_type = trust",
        f"auth_file = {folder / 'userlist.txt'}",
        f"admin_users = {user}",
        "max_client_conn = 500",
        "default_pool_size = 40",
        "ignore_startup_parameters = extra_float_digits",
        "",
    ])  # fmt: skip
    return ini, f'"{user}" ""\n', user


@dataclass(frozen=True)
class Bouncer:
    """A running PgBouncer in transaction mode, in front of a server."""

    label: str  # "pgbouncer-1.18.0"
    url: str  # the server's database, pooled per transaction
    single_url: str  # the same database through one server connection (SINGLE_DB)
    admin_url: str  # the admin console ("pgbouncer" database): SHOW POOLS, SHOW CONFIG
    pid: int


@dataclass
class PgBouncer:
    """A ``pgbouncer`` binary, started in front of a server on first use."""

    path: Path
    # Its pid, port, folder and log.
    process: servers.ServerProcess = field(
        default_factory=lambda: servers.ServerProcess("pgbouncer", stop_timeout=10),
        repr=False,
        compare=False,
    )

    @functools.cached_property
    def label(self) -> str:
        """``pgbouncer-<version>`` from ``pgbouncer --version``."""
        return f"pgbouncer-{pgbouncer_version(self.path) or 'unknown'}"

    def start(self, server: Server) -> Bouncer:
        """Write its configuration for ``server`` and start it; return it once it answers."""
        process = self.process
        ini, userlist, user = pgbouncer_config(server.url, process.folder, process.port)
        (process.folder / "pgbouncer.ini").write_text(ini)
        (process.folder / "userlist.txt").write_text(userlist)
        dbname = str(psycopg.conninfo.conninfo_to_dict(server.url).get("dbname") or user)
        url = url_of(LOOPBACK, process.port, user, dbname)
        drop = unprivileged_user()

        def command(folder: Path, port: int) -> list[str]:
            # As root it must drop to a user itself (it refuses root); its files,
            # read before that, stay the owner's (only the owner reads the password).
            return [str(self.path), *(["-u", drop] if drop else []), str(folder / "pgbouncer.ini")]

        process.start(command, lambda port: server_version(url), PING_ERRORS, what=str(self.path))
        return Bouncer(
            self.label,
            url,
            url_of(LOOPBACK, process.port, user, SINGLE_DB),
            url_of(LOOPBACK, process.port, user, "pgbouncer"),
            process.pid,
        )

    def stop(self) -> None:
        """Stop it by its pid (SIGTERM: immediate shutdown) and remove its folder."""
        self.process.stop()


def discover_pgbouncer() -> servers.Discovery[PgBouncer]:
    """The ``pgbouncer`` to start in front of the server, or why there is none."""
    step = servers.Step(
        "executables",
        "no pgbouncer on PATH or in /usr/sbin",
        lambda: [PgBouncer(path)] if (path := find_pgbouncer()) else [],
    )
    return servers.discover_in_order([step], NO_PGBOUNCER)


# --- the requirement and the session -------------------------------------------------------


def required() -> bool:
    """Whether ``DMUTEX_REQUIRE_POSTGRESQL`` insists on a server (any value but "", "0")."""
    return os.environ.get("DMUTEX_REQUIRE_POSTGRESQL", "").strip() not in ("", "0")


def check_required(found: servers.Discovery[Src]) -> servers.Discovery[Src]:
    """``found``, or a RuntimeError if it found nothing and ``DMUTEX_REQUIRE_POSTGRESQL`` is set."""
    if not found.sources and required():
        raise RuntimeError(f"DMUTEX_REQUIRE_POSTGRESQL is set, but {found.reason}")
    return found


@functools.cache
def _discovered_once() -> tuple[servers.Discovery[Source], servers.Discovery[PgBouncer]]:
    return discover(), discover_pgbouncer()


def postgres_label() -> str:
    """The label of the session's server, or ``no-server``, for test ids (nothing is started)."""
    server, _ = _discovered_once()
    return server.labels[0] if server.labels else "no-server"


def header() -> list[str]:
    """The run's header lines: the server and the pooler found, and what was passed over."""
    server, pooler = _discovered_once()
    return [server.header("postgresql server"), pooler.header("pgbouncer")]


class Session(servers.Pool[Source, Server]):
    """The server and its pooler, each started on first use; the schema dropped at the end."""

    def __init__(
        self,
        discovery: servers.Discovery[Source],
        pooler: servers.Discovery[PgBouncer] | None = None,
        schema: str | None = None,
    ) -> None:
        super().__init__(discovery)
        self.pooler = pooler if pooler is not None else servers.Discovery([], NO_PGBOUNCER)
        self.schema = schema or unique_schema()
        self._bouncer: Bouncer | None = None
        self._bouncer_failed: Exception | None = None

    def start_source(self, source: Source) -> Server:
        server = source.start(self.schema)
        with server.connect() as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(self.schema)))
        return server

    def server(self) -> Server:
        """The running server, or ``pytest.skip`` with discovery's one-line reason."""
        if not self.discovery.sources:
            pytest.skip(self.discovery.reason)
        return self.started(self.discovery.labels[0])

    def fresh(self) -> Server:
        """The server, its schema emptied (dropped and made again)."""
        server = self.server()
        _check_ours(self.schema)
        with server.connect() as conn:
            name = sql.Identifier(self.schema)
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(name))
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(name))
        return server

    def bouncer(self) -> Bouncer:
        """The PgBouncer in front of the server, started on first use, or a skip saying why.

        A start that failed once fails again at once, from the first error.
        """
        server = self.server()
        if not self.pooler.sources:
            pytest.skip(self.pooler.reason)
        if self._bouncer_failed is not None:
            raise RuntimeError("pgbouncer did not start") from self._bouncer_failed
        if self._bouncer is None:
            try:
                self._bouncer = self.pooler.sources[0].start(server)
            except Exception as error:
                self._bouncer_failed = error
                raise
        return self._bouncer

    def close(self) -> None:
        """Stop the pooler, drop the test schema, stop the server (each by its pid)."""
        for pooler in self.pooler.sources:
            with contextlib.suppress(Exception):
                pooler.stop()
        self._bouncer = None
        if self._running:
            server = next(iter(self._running.values()))
            _check_ours(self.schema)
            with contextlib.suppress(psycopg.Error), server.connect() as conn:
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema))
                )
        super().close()


def new_session() -> Session:
    """A new session over the discovery made once per run, checked against the requirement."""
    server, pooler = _discovered_once()
    return Session(check_required(server), check_required(pooler))

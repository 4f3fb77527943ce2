"""A MariaDB or MySQL server for the tests, found or started in a fixed order.

1. ``DMUTEX_MYSQL_URL`` (``mysql://user:password@host:port/``): a server the
   user runs, MySQL 8 or MariaDB. The tests work in one database of their
   own, ``dmutex_test_<12 hex digits>``, made when the server is first used
   and dropped at the end; they never drop or touch another (a database
   whose name is not of that form is refused). The user needs ``CREATE`` and
   ``DROP`` on such names.
2. testcontainers, when a Docker daemon answers: a ``mariadb:10.11``
   container (as ``root``).
3. Executables: ``mariadbd`` (PATH, else ``/usr/sbin``, where Debian's
   ``mariadb-server`` puts it) and ``mariadb-install-db`` (else
   ``mysql_install_db``). ``mariadb-install-db`` makes a data directory in a
   temporary folder (root with an empty password over TCP, no test
   database), and ``mariadbd --no-defaults`` runs on it on a free loopback
   port, its socket, pid file and log in that folder. Run as root, both take
   ``--user=mysql`` (else ``nobody``): ``mariadbd`` refuses root, and drops
   to that user itself, so the pid the harness started is the server's and
   its SIGTERM is a normal shutdown (under ``runuser`` a SIGTERM would be
   followed by runuser's SIGKILL 2 s later). The folder is that user's.
   ``--no-defaults`` would leave the server on latin1:
   ``--character-set-server=utf8mb4 --collation-server=utf8mb4_general_ci``
   make it look like Debian's MariaDB (MySQL 8's default collation,
   ``utf8mb4_0900_ai_ci``, is case-insensitive too). For speed, what a
   throwaway server can lose: no doublewrite buffer, no binary log, the redo
   log written and flushed about once a second rather than at each commit
   (:class:`Restartable`, which tests SIGKILL, writes it at each commit:
   see there).
4. Otherwise the MySQL tests skip, with one line saying why.

``DMUTEX_MYSQL_SERVERS``, a comma-separated subset of
``url,docker,executables`` (or ``none``), limits the order to those sources.
``DMUTEX_REQUIRE_MYSQL=1`` turns "no server" into failures, so that CI cannot
skip the MySQL suites unnoticed.

Connecting: :func:`connect_args` turns a URL into ``host``, ``port``,
``user``, ``password`` (and ``database`` when the URL names one) for
PyMySQL, mysqlclient (``MySQLdb``) and mysql-connector-python
(aiomysql calls the database ``db``); :func:`connect` is PyMySQL's
connection, and :meth:`Server.connect` one in the session's database.

The order, the pool and the processes are ``servers.py``'s; this module says
what is MariaDB/MySQL about them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, TypedDict
from urllib.parse import quote, unquote, urlsplit

import pymysql
import pytest
from pymysql.connections import Connection
from pymysql.cursors import Cursor

from tests._support import servers

if TYPE_CHECKING:
    import aiomysql
from tests._support.servers import LOOPBACK, Src, docker_answers

START_TIMEOUT = 30.0
CONNECT_TIMEOUT = 2  # seconds, per probe
LOCK_WAIT_TIMEOUT = 10  # seconds: a DROP DATABASE that waits on a client's lock fails, not hangs
DEFAULT_PORT = 3306
SUPERUSER = "root"  # mariadb-install-db's, with an empty password over TCP
TEST_DATABASE_PREFIX = "dmutex_test_"
_TEST_DATABASE = re.compile(rf"{TEST_DATABASE_PREFIX}[0-9a-f]{{12}}")
CONTAINER_IMAGE = "mariadb:10.11"
UNPRIVILEGED = ("mysql", "nobody")  # the first that exists runs the servers, as root
PING_ERRORS = (pymysql.err.OperationalError,)
SCHEMES = ("mysql", "mariadb")  # and "mysql+pymysql" and the like
CHARSET = "utf8mb4"
COLLATION = "utf8mb4_general_ci"  # Debian's MariaDB default: case-insensitive
INNODB_LOG_FILE_SIZE = "32M"  # mariadb-install-db's default is 96M, all of it written

URL_VARIABLE = "DMUTEX_MYSQL_URL"
SOURCE_NAMES = ("url", "docker", "executables")
_MISSING = {
    "url": f"{URL_VARIABLE} is unset",
    "docker": "no Docker daemon answers",
    "executables": (
        "no mariadbd and mariadb-install-db (or mysql_install_db) on PATH or in /usr/sbin, /usr/bin"
    ),
}
NO_SERVER = "no MySQL server"
KNOB = "DMUTEX_MYSQL_SERVERS"
REQUIRE = "DMUTEX_REQUIRE_MYSQL"


def unprivileged_user() -> str | None:
    """The user the servers run as: None when the tests do not run as root."""
    return servers.unprivileged(UNPRIVILEGED)


def unique_database() -> str:
    """A database name no other session uses: ``dmutex_test_<12 hex digits>``."""
    return f"{TEST_DATABASE_PREFIX}{secrets.token_hex(6)}"


def check_ours(database: str) -> str:
    """``database``, if it is one the tests make (``dmutex_test_<12 hex>``); else ValueError."""
    if not _TEST_DATABASE.fullmatch(database):
        raise ValueError(f"refusing to drop database {database!r}: not one the tests created")
    return database


# --- URLs and connections -----------------------------------------------------------


class _Required(TypedDict):
    host: str
    port: int
    user: str
    password: str


class ConnectArgs(_Required, total=False):
    """What ``connect(**...)`` of PyMySQL, mysqlclient and mysql-connector-python take."""

    database: str


def url_of(
    host: str, port: int, user: str = SUPERUSER, password: str | None = None, database: str = ""
) -> str:
    """A ``mysql://user[:password]@host:port/[database]`` URL."""
    auth = quote(user, safe="") + (f":{quote(password, safe='')}" if password else "")
    return f"mysql://{auth}@{host}:{port}/{quote(database, safe='')}"


def connect_args(url: str) -> ConnectArgs:
    """``host``, ``port``, ``user``, ``password`` (and ``database`` if named) of a MySQL URL.

    ``mysql://``, ``mariadb://`` and ``mysql+driver://`` URLs; the port is
    3306, the user ``root`` and the password empty unless the URL says
    otherwise. The host is as written: mysqlclient takes ``localhost`` for
    its unix socket, PyMySQL for TCP.
    """
    parts = urlsplit(url)
    if parts.scheme.partition("+")[0] not in SCHEMES:
        raise ValueError(f"not a MySQL URL (mysql://user:password@host:port/database): {url!r}")
    args = ConnectArgs(
        host=parts.hostname or LOOPBACK,
        port=parts.port or DEFAULT_PORT,
        user=unquote(parts.username or SUPERUSER),
        password=unquote(parts.password or ""),
    )
    database = unquote(parts.path.lstrip("/"))
    if database:
        args["database"] = database
    return args


def with_database(url: str, database: str) -> str:
    """``url`` with ``database`` in its path (the rest as it was)."""
    return urlsplit(url)._replace(path=f"/{quote(database, safe='')}").geturl()


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def without_tls(url: str) -> bool:
    """Whether a PyMySQL connection to ``url`` may skip TLS: a loopback server.

    PyMySQL 1.2 builds a TLS context with the system's CA certificates for
    every connection it makes (30 ms here), unless told ``ssl_disabled``:
    the tests and benchmarks, which connect often, tell it so on loopback.
    """
    return connect_args(url)["host"] in LOOPBACK_HOSTS


def connect(
    url: str, database: str | None = None, *, autocommit: bool = True
) -> Connection[Cursor]:
    """A new PyMySQL connection to ``url`` (in ``database`` if given); the caller closes it."""
    args = connect_args(url)
    if database is not None:
        args["database"] = database
    return pymysql.connect(
        **args,
        autocommit=autocommit,
        connect_timeout=CONNECT_TIMEOUT,
        ssl_disabled=without_tls(url),
    )


def _admin(url: str) -> Connection[Cursor]:
    """A connection whose DROP DATABASE fails after :data:`LOCK_WAIT_TIMEOUT`, not in a year."""
    args = connect_args(url)
    args.pop("database", None)
    return pymysql.connect(
        **args,
        autocommit=True,
        connect_timeout=CONNECT_TIMEOUT,
        ssl_disabled=without_tls(url),
        init_command=f"SET SESSION lock_wait_timeout = {LOCK_WAIT_TIMEOUT}",
    )


def query(url: str, sql: str, database: str | None = None) -> object:
    """The first column of the first row ``sql`` gives on ``url`` (None if no row)."""
    with connect(url, database) as conn, conn.cursor() as cursor:
        cursor.execute(sql)
        row = cursor.fetchone()
    return None if row is None else row[0]


def server_version(url: str) -> str:
    """What ``VERSION()`` says on ``url`` ("10.11.19-MariaDB-0+deb12u1"); one try."""
    with connect(url) as conn, conn.cursor() as cursor:
        cursor.execute("SELECT VERSION()")
        row = cursor.fetchone()
    assert row is not None
    return str(row[0])


def wait_until_up(url: str, timeout: float = START_TIMEOUT) -> str:
    """Connect until the server at ``url`` answers a query; return its ``VERSION()``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return server_version(url)
        except PING_ERRORS:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def parse_version(text: str) -> tuple[str, str]:
    """``(flavour, number)`` of a ``VERSION()``: ``("mariadb", "10.11.19")``, ``("mysql", "8.0")``.

    The flavour is ``mariadb`` when the text says MariaDB, else ``mysql``.
    """
    match = re.match(r"\d+(?:\.\d+)*", text)
    number = match.group(0) if match else "unknown"
    return ("mariadb" if "mariadb" in text.lower() else "mysql"), number


def make_database(url: str, database: str, *, empty: bool = False) -> None:
    """Create ``database`` (one of ours) on ``url``; ``empty=True`` drops it first."""
    name = f"`{check_ours(database)}`"
    with _admin(url) as conn, conn.cursor() as cursor:
        if empty:
            cursor.execute(f"DROP DATABASE IF EXISTS {name}")
        cursor.execute(f"CREATE DATABASE IF NOT EXISTS {name}")


def drop_database(url: str, database: str) -> None:
    """Drop ``database`` on ``url``, if it is one of ours (else ValueError) and exists."""
    name = f"`{check_ours(database)}`"
    with _admin(url) as conn, conn.cursor() as cursor:
        cursor.execute(f"DROP DATABASE IF EXISTS {name}")


@dataclass(frozen=True)
class Server:
    """A reachable MariaDB/MySQL server, and the database the tests may use on it."""

    label: str  # "mariadb-10.11.19", "mysql-8.0.36": what messages show
    url: str  # as given (a user's URL may name a database), or mysql://root@127.0.0.1:PORT/
    origin: str  # "DMUTEX_MYSQL_URL", "testcontainers", or the mariadbd path
    database: str  # the tests' own: dmutex_test_<12 hex>
    version: str  # "10.11.19"
    flavour: str = "mariadb"  # or "mysql"
    pid: int | None = None  # mariadbd's, when the tests started it

    @property
    def database_url(self) -> str:
        """``url`` in the tests' database (``mysql://root@127.0.0.1:PORT/dmutex_test_...``)."""
        return with_database(self.url, self.database)

    def connect(self, *, autocommit: bool = True) -> Connection[Cursor]:
        """A new PyMySQL connection in the tests' database; the caller closes it."""
        return connect(self.url, self.database, autocommit=autocommit)


def _server(url: str, origin: str, database: str, pid: int | None = None) -> Server:
    flavour, number = parse_version(wait_until_up(url))
    return Server(f"{flavour}-{number}", url, origin, database, number, flavour, pid)


class Source(servers.Labelled, Protocol):
    """Something that gives a running server on demand (started, or found running)."""

    def start(self, database: str) -> Server: ...


# --- the sources, in order --------------------------------------------------------


@dataclass
class FromUrl(servers.External):
    """The server ``DMUTEX_MYSQL_URL`` names; never started or stopped here."""

    url: str
    variable: str = URL_VARIABLE

    @functools.cached_property
    def label(self) -> str:
        """Asked of the server; ``mysql-url`` if it does not answer (or the URL is not one)."""
        try:
            flavour, number = parse_version(server_version(self.url))
        except (pymysql.err.Error, ValueError):  # the header must not fail: the tests will
            return "mysql-url"
        return f"{flavour}-{number}"

    def start(self, database: str) -> Server:
        return _server(self.url, self.variable, database)


@dataclass
class Container(servers.Containerized):
    """A ``mariadb:10.11`` container started by testcontainers; the tests connect as root."""

    label: str = f"mariadb-{CONTAINER_IMAGE.partition(':')[2]}"  # until it answers

    def start(self, database: str) -> Server:
        container = self.run_container("mysql", "MySqlContainer", CONTAINER_IMAGE)
        host = str(container.get_container_host_ip())
        port = int(container.get_exposed_port(3306))
        url = url_of(host, port, SUPERUSER, str(container.root_password))
        return _server(url, "testcontainers", database)


def find_mariadbd() -> Path | None:
    """The ``mariadbd`` on PATH, else Debian's ``/usr/sbin/mariadbd`` (off a user's PATH)."""
    found = shutil.which("mariadbd") or shutil.which("mariadbd", path="/usr/sbin")
    return Path(found) if found else None


def find_install_db(mariadbd: Path) -> Path | None:
    """``mariadb-install-db``, else ``mysql_install_db``: beside mariadbd, on PATH, in /usr/bin."""
    for name in ("mariadb-install-db", "mysql_install_db"):
        for path in (str(mariadbd.parent), None, "/usr/bin"):
            found = shutil.which(name, path=path)
            if found:
                return Path(found)
    return None


def find_executables() -> tuple[Path, Path] | None:
    """``(mariadbd, mariadb-install-db)``, or None if either is missing."""
    mariadbd = find_mariadbd()
    install_db = find_install_db(mariadbd) if mariadbd is not None else None
    return (mariadbd, install_db) if mariadbd is not None and install_db is not None else None


def mariadbd_version(mariadbd: Path) -> str | None:
    """``X.Y.Z`` that ``mariadbd --version`` prints ("... Ver 10.11.19-MariaDB ..."), or None."""
    return servers.printed_version([str(mariadbd), "--version"], r"Ver (\d+(?:\.\d+)*)")


def _as_user(user: str | None) -> list[str]:
    return [f"--user={user}"] if user else []


def install_db_command(install_db: Path, folder: Path, user: str | None) -> list[str]:
    """``mariadb-install-db`` of a data directory in ``folder/data``: root, no password."""
    return [
        str(install_db),
        "--no-defaults",  # first: no /etc/mysql/my.cnf
        f"--datadir={folder / 'data'}",
        *_as_user(user),
        "--auth-root-authentication-method=normal",  # root by password (empty), over TCP
        "--skip-test-db",
        f"--innodb-log-file-size={INNODB_LOG_FILE_SIZE}",
        # Its temporary tables in the folder, not /tmp: installs that run at
        # once (CI's interpreters) each remove their own, not another's.
        f"--tmpdir={folder}",
    ]


def server_command(
    mariadbd: Path, folder: Path, port: int, user: str | None, *, flush_at_commit: bool = False
) -> list[str]:
    """``mariadbd`` on 127.0.0.1:``port``, data in ``folder/data``, socket and log in ``folder``.

    ``flush_at_commit=True`` (:class:`Restartable`, which tests SIGKILL): a
    commit is acknowledged once its redo log is written to the kernel
    (``innodb_flush_log_at_trx_commit=2``), which a kill of the process does
    not undo. Off (the default, 0), the log is written and flushed about once
    a second, and a SIGKILL loses the commits of the last second.
    """
    return [
        str(mariadbd),
        "--no-defaults",  # first: no /etc/mysql/my.cnf
        f"--datadir={folder / 'data'}",
        f"--port={port}",
        f"--bind-address={LOOPBACK}",
        f"--socket={folder / 'sock'}",
        f"--pid-file={folder / 'mariadbd.pid'}",
        f"--log-error={folder / 'mariadbd.log'}",
        f"--tmpdir={folder}",
        *_as_user(user),
        # --no-defaults leaves latin1: Debian's defaults (a case-insensitive collation).
        f"--character-set-server={CHARSET}",
        f"--collation-server={COLLATION}",
        "--max-connections=200",
        # Speed over durability: the data is thrown away at the end.
        f"--innodb-flush-log-at-trx-commit={2 if flush_at_commit else 0}",
        "--innodb-doublewrite=0",
        "--skip-log-bin",
        "--innodb-buffer-pool-size=64M",
        f"--innodb-log-file-size={INNODB_LOG_FILE_SIZE}",
    ]


def install_db(install_db: Path, folder: Path, user: str | None) -> None:
    """``mariadb-install-db`` into ``folder/data`` as ``user``, unless it is there already."""
    if (folder / "data" / "mysql").is_dir():
        return
    done = subprocess.run(
        install_db_command(install_db, folder, user),
        capture_output=True,
        text=True,
        cwd=folder,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"{install_db.name} exited with code {done.returncode}: {tail}")


@dataclass
class Executable:
    """``mariadbd`` and ``mariadb-install-db``: a data directory made and started on first use.

    ``keep=True`` keeps the data directory and the port when it stops, so
    that it can start again with the same data (it is installed once).
    ``flush_at_commit``: see :func:`server_command`.
    """

    mariadbd: Path
    install_db: Path
    keep: bool = False
    flush_at_commit: bool = False
    # Its pid, port, folder and log (mariadbd's error log is that log).
    process: servers.ServerProcess = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # No runuser: run as root, mariadbd drops to --user itself, so the pid
        # is the server's and SIGTERM is its normal shutdown.
        self.process = servers.ServerProcess("mariadbd", keep=self.keep)

    @property
    def user(self) -> str | None:
        return unprivileged_user()

    @functools.cached_property
    def label(self) -> str:
        """``mariadb-<version>`` from ``mariadbd --version``."""
        return f"mariadb-{mariadbd_version(self.mariadbd) or 'unknown'}"

    def prepare(self) -> Path:
        """The folder, the server user's, with the data directory installed and the log there."""
        folder, user = self.process.folder, self.user
        if user is not None:
            shutil.chown(folder, user)
        install_db(self.install_db, folder, user)
        # The harness opens the log for the server's output (as root) and
        # mariadbd opens it again as its error log, as its user.
        log = self.process.log_path
        log.touch()
        if user is not None:
            shutil.chown(log, user)
        return folder

    def start(self, database: str) -> Server:
        process = self.process
        self.prepare()
        url = url_of(LOOPBACK, process.port)
        user = self.user
        version = process.start(
            lambda folder, port: server_command(
                self.mariadbd, folder, port, user, flush_at_commit=self.flush_at_commit
            ),
            lambda port: server_version(url),
            PING_ERRORS,
            what=str(self.mariadbd),
            timeout=START_TIMEOUT,
        )
        flavour, number = parse_version(version)
        return Server(
            f"{flavour}-{number}", url, str(self.mariadbd), database, number, flavour, process.pid
        )

    def stop(self) -> None:
        """Stop the server by its pid (SIGTERM, SIGKILL after the bound); unless kept, remove it."""
        self.process.stop()


class Restartable:
    """A server of its own from the executables, on one port and data directory across restarts.

    For the tests that stop, kill and restart a server: :meth:`start` (again),
    :meth:`stop` (SIGTERM by pid: a normal shutdown), :meth:`kill` (SIGKILL by
    pid: InnoDB recovers at the next start), :meth:`restart`; the data and
    the port stay until :meth:`close`. Commits are acknowledged once their redo
    log is written (``innodb_flush_log_at_trx_commit=2``), so a kill keeps
    every acknowledged commit. Its database (:attr:`database`, one of ours)
    is made at each start if it is missing.
    """

    def __init__(self, mariadbd: Path, install_db: Path, database: str | None = None) -> None:
        self.database = check_ours(database or unique_database())
        self.executable = Executable(mariadbd, install_db, keep=True, flush_at_commit=True)
        self.starts = 0
        self._server: Server | None = None

    @classmethod
    def from_executables(cls, database: str | None = None) -> Restartable | None:
        """One from the ``mariadbd`` found (nothing started), or None if there is none."""
        found = find_executables()
        return cls(*found, database=database) if found is not None else None

    @property
    def process(self) -> servers.ServerProcess:
        return self.executable.process

    @property
    def server(self) -> Server:
        """The server as its last start found it (its pid is that start's)."""
        if self._server is None:
            raise RuntimeError("the restartable server has not started yet")
        return self._server

    @property
    def url(self) -> str:
        """``mysql://root@127.0.0.1:PORT/``: the same across restarts."""
        return url_of(LOOPBACK, self.process.port)

    @property
    def port(self) -> int:
        return self.process.port

    @property
    def folder(self) -> Path:
        return self.process.folder

    @property
    def pid(self) -> int:
        """mariadbd's pid, while it runs."""
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process.running

    def start(self) -> Server:
        """Start it (again) on its port and data; return once it answers, its database made."""
        self.starts += 1
        server = self.executable.start(self.database)
        make_database(server.url, self.database)
        self._server = server
        return server

    def stop(self) -> None:
        """Stop it by its pid (SIGTERM, SIGKILL after the bound); the data stays."""
        self.executable.stop()

    def kill(self) -> None:
        """SIGKILL it by its pid and wait until it is gone; the data stays."""
        self.process.kill()

    def restart(self) -> Server:
        """:meth:`stop` if it runs, then :meth:`start`."""
        self.stop()
        return self.start()

    def empty(self) -> Server:
        """The running server, its database dropped and made again."""
        make_database(self.server.url, self.database, empty=True)
        return self.server

    def connect(self, *, autocommit: bool = True) -> Connection[Cursor]:
        """A new PyMySQL connection in its database; the caller closes it."""
        return connect(self.url, self.database, autocommit=autocommit)

    def log_tail(self, lines: int = 5) -> str:
        return self.process.log_tail(lines)

    def close(self) -> None:
        """Stop it if it runs (by pid) and remove its folder."""
        self.process.close()

    def __enter__(self) -> Restartable:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


# --- the order ----------------------------------------------------------------------


def no_server_reason(allowed: tuple[str, ...]) -> str:
    """The one line a skip shows when none of the ``allowed`` sources gave a server."""
    steps = [(name, _MISSING[name]) for name in SOURCE_NAMES]
    return servers.no_server_reason(NO_SERVER, steps, allowed, KNOB)


def allowed_sources() -> tuple[str, ...]:
    """The sources ``DMUTEX_MYSQL_SERVERS`` lets discovery try, in the fixed order."""
    return servers.allowed_sources(KNOB, SOURCE_NAMES)


def url_from_environment() -> FromUrl | None:
    """The server ``DMUTEX_MYSQL_URL`` names, else None."""
    url = os.environ.get(URL_VARIABLE, "").strip()
    return FromUrl(url) if url else None


def discover() -> servers.Discovery[Source]:
    """Find one server in the documented order (nothing is started yet)."""

    def url() -> list[Source]:
        found = url_from_environment()
        return [found] if found is not None else []

    def executables() -> list[Source]:
        found = find_executables()
        return [Executable(*found)] if found is not None else []

    looks: dict[str, Callable[[], list[Source]]] = {
        "url": url,
        "docker": lambda: [Container()] if docker_answers() else [],
        "executables": executables,
    }
    steps = [servers.Step(name, _MISSING[name], looks[name]) for name in SOURCE_NAMES]
    found = servers.discover_in_order(steps, NO_SERVER, allowed_sources(), KNOB)
    found.sources = found.sources[:1]
    return found


# --- the requirement and the session -------------------------------------------------------


def required() -> bool:
    """Whether ``DMUTEX_REQUIRE_MYSQL`` insists on a server (any value but "", "0")."""
    return os.environ.get(REQUIRE, "").strip() not in ("", "0")


def check_required(found: servers.Discovery[Src]) -> servers.Discovery[Src]:
    """``found``, or a RuntimeError if it found nothing and ``DMUTEX_REQUIRE_MYSQL`` is set."""
    if not found.sources and required():
        raise RuntimeError(f"{REQUIRE} is set, but {found.reason}")
    return found


@functools.cache
def _discovered_once() -> servers.Discovery[Source]:
    return discover()


def mysql_label() -> str:
    """The label of the session's server, or ``no-server``, for test ids (nothing is started)."""
    found = _discovered_once()
    return found.labels[0] if found.labels else "no-server"


def header() -> list[str]:
    """The run's header line: the server found, and what was passed over."""
    return [_discovered_once().header("mysql server")]


class Session(servers.Pool[Source, Server]):
    """The server, started on first use, its database made then and dropped at the end.

    :meth:`restartable` is a second server, from the executables, for tests
    that stop, kill or restart one.
    """

    def __init__(self, discovery: servers.Discovery[Source], database: str | None = None) -> None:
        super().__init__(discovery)
        self.database = check_ours(database or unique_database())
        self._restartable: Restartable | None = None
        self._restartable_failed: Exception | None = None

    def start_source(self, source: Source) -> Server:
        server = source.start(self.database)
        make_database(server.url, self.database)
        return server

    def server(self) -> Server:
        """The running server, or ``pytest.skip`` with discovery's one-line reason."""
        if not self.discovery.sources:
            pytest.skip(self.discovery.reason)
        return self.started(self.discovery.labels[0])

    def fresh(self) -> Server:
        """The server, its database emptied (dropped and made again)."""
        server = self.server()
        make_database(server.url, self.database, empty=True)
        return server

    def restartable(self) -> Restartable:
        """A server of the session's own from the executables, running, its database emptied.

        Not the session's server (another port, another data directory),
        whatever source that came from; started on first use and closed at
        the end. A test may stop, kill and restart it; the next call starts
        it again if it is down. No executables: a skip saying why (a failure
        under ``DMUTEX_REQUIRE_MYSQL``). A start that failed once fails again
        at once, from the first error.
        """
        if self._restartable_failed is not None:
            raise RuntimeError("the restartable server did not start") from (
                self._restartable_failed
            )
        if self._restartable is None:
            found = Restartable.from_executables(self.database)
            if found is None:
                reason = f"{NO_SERVER} to restart: {_MISSING['executables']}"
                if required():
                    raise RuntimeError(f"{REQUIRE} is set, but {reason}")
                pytest.skip(reason)
            self._restartable = found
        restartable = self._restartable
        try:
            if not restartable.running:
                restartable.start()
            restartable.empty()
        except Exception as error:
            self._restartable_failed = error
            raise
        return restartable

    def close(self) -> None:
        """Drop the test database, stop the servers (each by its pid)."""
        if self._restartable is not None:
            with contextlib.suppress(Exception):
                self._restartable.close()
            self._restartable = None
        if self._running:
            server = next(iter(self._running.values()))
            with contextlib.suppress(pymysql.err.Error):
                drop_database(server.url, self.database)
        super().close()


def new_session() -> Session:
    """A new session over the discovery made once per run, checked against the requirement."""
    return Session(check_required(_discovered_once()))


async def aiomysql_connection(url: str, database: str | None = None) -> aiomysql.Connection:
    """An aiomysql connection to the server of ``url``, in ``database`` (else the URL's).

    utf8mb4, in autocommit: as every test's aiomysql client is made.
    """
    import aiomysql

    args = connect_args(url)
    return await aiomysql.connect(
        host=args["host"],
        port=args["port"],
        user=args["user"],
        password=args["password"],
        db=database if database is not None else args.get("database"),
        charset="utf8mb4",
        autocommit=True,
    )

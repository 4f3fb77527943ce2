"""The servers speaking DynamoDB's protocol that the tests find or start (``dynamodb_servers.py``).

Neither moto's server nor dynalite is DynamoDB. What each leaves out of the
protocol that the library might want is recorded here
(:func:`test_what_each_server_does_with_what_the_other_lacks`), so that a new
version that changes it fails a test rather than a suite far away.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from tests._support import dynamodb_servers
from tests._support.dynamodb_servers import (
    Discovery,
    Dynalite,
    FromUrl,
    Moto,
    Server,
    Session,
    create_table,
    delete_tables,
    error_code,
)
from tests._support.servers import LOOPBACK, alive

LOCAL = ("moto", "dynalite")  # the kinds the tests start


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No variable of the harness's set: discovery as on a machine where nobody set any."""
    for variable in (
        dynamodb_servers.URL_VARIABLE,
        dynamodb_servers.DYNALITE_VARIABLE,
        dynamodb_servers.KNOB,
        dynamodb_servers.REQUIRE,
    ):
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


def _local(session: Session, kind: str) -> Server:
    """The session's server of ``kind``, one the tests started (a skip if it is not here)."""
    server = session.server(kind)
    assert server.local, server
    return server


def _fresh_source(kind: str) -> Moto | Dynalite:
    """A new source of ``kind`` (nothing started), or a skip saying why there is none."""
    found = dynamodb_servers.discover()
    source = found.source(kind)
    if source is None:
        pytest.skip(found.why_not(kind))
    assert isinstance(source, (Moto, Dynalite))
    return source


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s children, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


@contextlib.contextmanager
def _table(server: Server, name: str) -> Iterator[Any]:
    """A client of ``server`` and a new table ``name`` (key ``pk``), deleted after."""
    with server.connect() as client:
        create_table(client, name)
        try:
            yield client
        finally:
            client.delete_table(TableName=name)


# --- with no server --------------------------------------------------------------------------


def test_urls_name_scheme_host_and_port_only() -> None:
    parse = dynamodb_servers.parse_url
    assert parse("http://127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert parse(" https://dynamodb.eu-west-1.amazonaws.com/ ") == (
        "https://dynamodb.eu-west-1.amazonaws.com"
    )
    assert parse("HTTP://[::1]:8000") == "http://[::1]:8000"
    for bad, why in [
        ("", "not an http"),
        ("dynamodb://a:1", "not an http"),
        ("127.0.0.1:8000", "not an http"),
        ("http://key:secret@a:1", "no credentials"),
        ("http://a:1/tables", "no path"),
        ("http://a:1?x=1", "no path"),
        ("http://:1", "needs a host"),
        ("http://a:port", "Port could not be cast"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse(bad)


def test_the_url_takes_motos_place_and_dynalite_stays(
    clean_environment: pytest.MonkeyPatch,
) -> None:
    monkeypatch = clean_environment
    monkeypatch.setenv("DMUTEX_DYNAMODB_URL", "http://127.0.0.1:1/")
    found = dynamodb_servers.discover()
    assert found.sources[0] == FromUrl("http://127.0.0.1:1", dynamodb_servers.region())
    assert found.tried == ["url", "dynalite"]
    assert "moto" not in found.kinds
    assert found.why_not("moto") == "no moto: DMUTEX_DYNAMODB_URL takes the place of moto's server"
    assert found.kinds == ["url", "dynalite"] or found.kinds == ["url"]
    assert found.header(dynamodb_servers.WHAT).startswith(
        "servers speaking DynamoDB's protocol: url"
    )
    monkeypatch.setenv("DMUTEX_DYNAMODB_URL", "mysql://127.0.0.1:2")
    with pytest.raises(ValueError, match=r"^DMUTEX_DYNAMODB_URL: not an http"):
        dynamodb_servers.discover()

    # Unset: moto's server, then dynalite, each found or saying why not.
    monkeypatch.delenv("DMUTEX_DYNAMODB_URL")
    found = dynamodb_servers.discover()
    assert found.tried == ["moto", "dynalite"]
    assert found.source("moto") == Moto()  # moto[server] is in the test extra
    assert found.labels[0] == f"moto-{dynamodb_servers.moto_version()}"
    assert re.fullmatch(r"moto-\d+\.\d+\.\d+", found.labels[0])
    assert found.passed_over[0] == "DMUTEX_DYNAMODB_URL is unset"
    if found.source("dynalite") is None:
        assert found.missing["dynalite"].startswith("no dynalite (DMUTEX_DYNALITE is unset")
    else:
        assert re.fullmatch(r"dynalite-3\.\d+\.\d+", found.labels[1])


def test_the_knob_limits_the_kinds(clean_environment: pytest.MonkeyPatch) -> None:
    monkeypatch = clean_environment
    monkeypatch.setenv("DMUTEX_DYNAMODB_URL", "http://127.0.0.1:1")
    monkeypatch.setenv(dynamodb_servers.KNOB, "none")
    found = dynamodb_servers.discover()
    assert (found.sources, found.tried) == ([], [])
    assert found.reason == (
        "no server speaking DynamoDB's protocol: DMUTEX_DYNAMODB_SERVERS leaves out url; "
        "DMUTEX_DYNAMODB_SERVERS leaves out moto; DMUTEX_DYNAMODB_SERVERS leaves out dynalite"
    )
    assert found.why_not("") == found.reason
    assert found.header("x") == f"x: none ({found.reason})"
    # Without url, the URL is ignored: moto's server runs.
    monkeypatch.setenv(dynamodb_servers.KNOB, "moto")
    found = dynamodb_servers.discover()
    assert (found.sources, found.tried, found.passed_over) == ([Moto()], ["moto"], [])
    monkeypatch.setenv(dynamodb_servers.KNOB, "url,localstack")
    with pytest.raises(ValueError, match="unknown localstack"):
        dynamodb_servers.discover()


def _fake_dynalite(folder: Path, name: str = "dynalite", version: str = "3.9.9") -> Path:
    """A package folder like npm's (``node_modules/NAME``), and its ``.bin`` link; the link."""
    package = folder / "node_modules" / name
    package.mkdir(parents=True)
    (package / "package.json").write_text(json.dumps({"name": name, "version": version}))
    (package / "cli.js").write_text("#!/usr/bin/env node\n")
    (package / "cli.js").chmod(0o755)  # what PATH lookups want
    link = folder / "node_modules" / ".bin" / "dynalite"
    link.parent.mkdir()
    link.symlink_to(f"../{name}/cli.js")
    return link


def test_dynalite_is_looked_for_in_order(
    clean_environment: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch = clean_environment
    given = _fake_dynalite(tmp_path / "given", version="3.0.1")
    cache = _fake_dynalite(tmp_path / "cache")
    on_path = _fake_dynalite(tmp_path / "path")
    monkeypatch.setenv("PATH", f"{on_path.parent}{os.pathsep}{os.environ['PATH']}")
    find = dynamodb_servers.find_dynalite
    assert find(cache) == (cache, str(cache))
    assert find(tmp_path / "none") == (on_path, "PATH")
    monkeypatch.setenv("DMUTEX_DYNALITE", str(given))
    assert find(cache) == (given, "DMUTEX_DYNALITE")
    assert dynamodb_servers.dynalite_package(given) == (given.resolve().parent, "3.0.1")
    assert Dynalite(given, Path("node")).label == "dynalite-3.0.1"

    # What it names must be dynalite's: the user meant that one.
    monkeypatch.setenv("DMUTEX_DYNALITE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"DMUTEX_DYNALITE: .* is not a file"):
        dynamodb_servers.discover()
    other = _fake_dynalite(tmp_path / "other", name="left-pad")
    monkeypatch.setenv("DMUTEX_DYNALITE", str(other))
    with pytest.raises(ValueError, match=r"DMUTEX_DYNALITE: .* no dynalite package.json"):
        dynamodb_servers.discover()

    # No node: dynalite cannot run, and the reason says so.
    monkeypatch.setenv("DMUTEX_DYNALITE", str(given))
    monkeypatch.setenv("PATH", str(on_path.parent))
    found = dynamodb_servers.discover()
    assert found.source("dynalite") is None
    assert (
        found.why_not("dynalite") == f"no dynalite: dynalite is at {given}, but no node is on PATH"
    )


def test_the_command_serves_on_loopback_only(tmp_path: Path) -> None:
    moto = Moto().command(4567)
    assert moto[1:] == ["-m", "moto.server", "-H", LOOPBACK, "-p", "4567"]
    given = _fake_dynalite(tmp_path)
    command = Dynalite(given, Path("/usr/bin/node")).command(4567)
    assert command[:2] == ["/usr/bin/node", "-e"]
    assert command[3:] == [str(given.resolve().parent), "4567"]
    assert "'127.0.0.1'" in command[2]
    assert "createTableMs: 0" in command[2]


def test_no_server_skips_unless_one_is_required(clean_environment: pytest.MonkeyPatch) -> None:
    monkeypatch = clean_environment
    why = {"url": "U is unset", "moto": "M is missing", "dynalite": "D is missing"}
    nothing = Discovery([], "no server: why", tried=["moto", "dynalite"], missing=why)
    with pytest.raises(pytest.skip.Exception, match="no server: why"):
        Session(dynamodb_servers.check_required(nothing)).server()
    with pytest.raises(pytest.skip.Exception, match="no dynalite: D is missing"):
        Session(nothing).server("dynalite")
    with pytest.raises(ValueError, match="unknown kind 'dynamo'"):
        Session(nothing).server("dynamo")
    monkeypatch.setenv("DMUTEX_REQUIRE_DYNAMODB", "0")
    assert dynamodb_servers.check_required(nothing) is nothing
    monkeypatch.setenv("DMUTEX_REQUIRE_DYNAMODB", "1")
    with pytest.raises(
        RuntimeError,
        match="DMUTEX_REQUIRE_DYNAMODB is set, but no moto: M is missing; no dynalite: D is",
    ):
        dynamodb_servers.check_required(nothing)
    moto_only = Discovery([Moto()], tried=["moto", "dynalite"], missing={"dynalite": "D"})
    with pytest.raises(RuntimeError, match=r"is set, but no dynalite: D$"):
        dynamodb_servers.check_required(moto_only)
    monkeypatch.setenv("DMUTEX_REQUIRE_DYNAMODB", "moto")
    assert dynamodb_servers.check_required(moto_only) is moto_only
    monkeypatch.setenv("DMUTEX_REQUIRE_DYNAMODB", "moto,dynamodb")
    with pytest.raises(ValueError, match="unknown dynamodb"):
        dynamodb_servers.check_required(moto_only)
    # "1" with no kind tried (the knob left out all): still a server wanted.
    monkeypatch.setenv("DMUTEX_REQUIRE_DYNAMODB", "1")
    with pytest.raises(RuntimeError, match=r"is set, but none at all$"):
        dynamodb_servers.check_required(Discovery([], "none at all"))


class _Untouchable:
    """A client no request may go through."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a request was made: {name}")


@pytest.mark.parametrize(
    "prefix",
    ["", "dmutex-test-", "dmutex-test-0123456789ab", "dmutex-test-0123456789AB-", "x-", "locks"],
)
def test_only_the_tests_prefixes_are_ever_deleted(prefix: str) -> None:
    with pytest.raises(ValueError, match="refusing to delete tables"):
        dynamodb_servers.check_ours(prefix)
    with pytest.raises(ValueError, match="refusing to delete tables"):
        delete_tables(_Untouchable(), prefix)  # refused before any request
    with pytest.raises(ValueError, match="refusing"):
        Session(Discovery([]), prefix=prefix)
    ours = dynamodb_servers.unique_prefix()
    assert dynamodb_servers.check_ours(ours) == ours
    assert re.fullmatch(r"dmutex-test-[0-9a-f]{12}-", ours)
    session = Session(Discovery([]), prefix=ours)
    assert session.table_name("locks") == f"{ours}locks"
    with pytest.raises(ValueError, match="not a table name"):
        session.table_name("a/b")


def test_clients_of_a_local_server_have_dummy_credentials_and_no_proxy() -> None:
    local = Server("moto", "moto-5", "http://127.0.0.1:1", "eu-west-1", "moto.server", pid=1)
    args = local.client_args()
    assert args["aws_access_key_id"] == args["aws_secret_access_key"] == "testing"
    assert local.credentials == {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    assert (args["endpoint_url"], args["region_name"]) == ("http://127.0.0.1:1", "eu-west-1")
    config = args["config"]
    assert config.retries == {"max_attempts": 2, "mode": "standard"}
    assert (config.connect_timeout, config.read_timeout, config.proxies) == (10.0, 10.0, {})
    users = Server("url", "url", "https://example.invalid", "eu-west-1", "DMUTEX_DYNAMODB_URL")
    args = users.client_args(timeout=3)
    assert "aws_access_key_id" not in args  # botocore looks, as for any program
    assert users.credentials == {}
    assert (args["config"].read_timeout, args["config"].proxies) == (3, None)
    assert (users.host, users.port, local.port) == ("example.invalid", 443, 1)


def test_the_region_is_the_environments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    assert dynamodb_servers.region() == "us-east-1"
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    assert dynamodb_servers.region() == "eu-west-3"
    monkeypatch.setenv("AWS_REGION", "ap-south-1")
    assert dynamodb_servers.region() == "ap-south-1"


# --- with a server ---------------------------------------------------------------------------


def test_a_server_answers_tables_and_conditional_writes(
    dynamodb_server: Server, dynamodb_session: Session
) -> None:
    name = dynamodb_session.table_name(f"answers-{dynamodb_server.kind}")
    key = {"pk": {"S": "a"}}
    with dynamodb_server.connect() as client:
        created = create_table(client, name)
        try:
            assert created["TableStatus"] == "ACTIVE"
            assert client.describe_table(TableName=name)["Table"]["TableStatus"] == "ACTIVE"
            absent = "attribute_not_exists(pk)"
            client.put_item(
                TableName=name, Item={**key, "v": {"N": "1"}}, ConditionExpression=absent
            )
            with pytest.raises(ClientError) as failed:
                client.put_item(
                    TableName=name, Item={**key, "v": {"N": "2"}}, ConditionExpression=absent
                )
            assert error_code(failed.value) == "ConditionalCheckFailedException"
            assert isinstance(failed.value, client.exceptions.ConditionalCheckFailedException)
            read = client.get_item(TableName=name, Key=key, ConsistentRead=True)
            assert read["Item"] == {**key, "v": {"N": "1"}}
            client.delete_item(
                TableName=name,
                Key=key,
                ConditionExpression="v = :v",
                ExpressionAttributeValues={":v": {"N": "1"}},
            )
            assert "Item" not in client.get_item(TableName=name, Key=key, ConsistentRead=True)
        finally:
            client.delete_table(TableName=name)  # the session's others may be in use
        dynamodb_servers.wait_until_gone(client, name)
    assert dynamodb_server.label in dynamodb_session.labels
    if dynamodb_server.local:
        assert dynamodb_server.url == f"http://{LOOPBACK}:{dynamodb_server.port}"


@pytest.mark.parametrize("kind", LOCAL)
def test_a_started_server_listens_on_loopback_alone(dynamodb_session: Session, kind: str) -> None:
    server = _local(dynamodb_session, kind)
    assert server.pid is not None
    assert alive(server.pid)
    assert (server.host, server.kind) == (LOOPBACK, kind)
    assert re.fullmatch(rf"{kind}-\d+\.\d+\.\d+", server.label)
    # Every socket it listens on is on 127.0.0.1 (dynalite's own command would take them all).
    inodes = {
        os.readlink(fd).removeprefix("socket:[").rstrip("]")
        for fd in Path(f"/proc/{server.pid}/fd").iterdir()
        if os.readlink(fd).startswith("socket:")
    }
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                listening.append(fields[1])
    assert listening == [f"0100007F:{server.port:04X}"]


@pytest.mark.parametrize("kind", LOCAL)
def test_a_started_server_is_stopped_by_its_pid(kind: str) -> None:
    source = _fresh_source(kind)
    session = Session(Discovery([source], tried=[kind]))
    try:
        server = session.server(kind)
        assert server.pid == source.process.pid
        assert alive(server.pid)
        folder = source.process.folder
        assert source.process.log_path.parent == folder
        children = _children(server.pid)
        with server.connect() as client:
            assert client.list_tables()["TableNames"] == []  # a new server: nothing in it
    finally:
        session.close()
    assert not alive(server.pid)
    assert not any(alive(child) for child in children)
    assert not folder.exists()
    assert not source.process.running


@pytest.mark.parametrize("kind", LOCAL)
def test_a_server_that_cannot_listen_fails_with_its_log(kind: str) -> None:
    with socket.socket() as taken:
        # Bound, not listening: the server's bind fails, and the readiness
        # requests meanwhile are refused at once rather than left unanswered.
        taken.bind((LOOPBACK, 0))
        port = taken.getsockname()[1]
        found = _fresh_source(kind)
        source = (
            Dynalite(found.executable, found.node, port)
            if isinstance(found, Dynalite)
            else Moto(port=port)
        )
        session = Session(Discovery([source], tried=[kind]))
        try:
            with pytest.raises(
                RuntimeError, match=r"exited with code 1 before answering: .*in use"
            ):
                session.server(kind)
            with pytest.raises(RuntimeError, match="did not start"):  # at once, the second time
                session.server(kind)
            assert not source.process.running
        finally:
            session.close()


@pytest.mark.parametrize("kind", LOCAL)
def test_delete_tables_touches_only_the_prefixs(dynamodb_session: Session, kind: str) -> None:
    server = _local(dynamodb_session, kind)
    ours = dynamodb_servers.unique_prefix()
    other = dynamodb_servers.unique_prefix()
    mine = [f"{ours}{n}" for n in ("a", "b", "c")]
    kept = [f"{other}a", f"x{ours}a", ours.rstrip("-")]  # another's, ours inside, ours but one
    with server.connect() as client:
        for name in [*mine, *kept]:
            create_table(client, name)
        # Pages of two: a listing of several pages, every one read before any delete.
        assert delete_tables(client, ours, page=2) == mine
        for name in mine:
            dynamodb_servers.wait_until_gone(client, name)
        names = client.list_tables()["TableNames"]
        assert set(kept) <= set(names)
        assert not set(mine) & set(names)
        assert delete_tables(client, ours) == []
        assert delete_tables(client, other) == [f"{other}a"]
        for name in kept[1:]:
            client.delete_table(TableName=name)


# What each server answers to what the library might want and one of them
# lacks: an operation it does not know is UnknownOperationException, and
# ReturnValuesOnConditionCheckFailure is either honoured (the old item in the
# error) or ignored. DynamoDB itself honours all of them.
OBSERVED: dict[str, dict[str, object]] = {
    "moto": {
        "TransactWriteItems": "answers",
        "TransactWriteItems, its condition failing": (
            "TransactionCanceledException",
            ["ConditionalCheckFailed"],
            "the old item",
        ),
        "TransactGetItems": "answers",
        "UpdateTimeToLive": "answers",
        "PutItem, its condition failing": "the old item",
        "UpdateItem, its condition failing": "the old item",
        "DeleteItem, its condition failing": "the old item",
    },
    "dynalite": {
        "TransactWriteItems": "UnknownOperationException",
        "TransactWriteItems, its condition failing": "UnknownOperationException",
        "TransactGetItems": "UnknownOperationException",
        "UpdateTimeToLive": "UnknownOperationException",
        "PutItem, its condition failing": "no item",
        "UpdateItem, its condition failing": "no item",
        "DeleteItem, its condition failing": "no item",
    },
}


def _old_item(found: object, item: dict[str, Any]) -> str:
    """What a failed condition's error carries in its ``Item``: the old item, or nothing."""
    assert found in (None, item), found
    return "no item" if found is None else "the old item"


@pytest.mark.parametrize("kind", LOCAL)
def test_what_each_server_does_with_what_the_other_lacks(
    dynamodb_session: Session, kind: str
) -> None:
    server = _local(dynamodb_session, kind)
    name = dynamodb_session.table_name(f"lacks-{kind}")
    item = {"pk": {"S": "held"}, "v": {"N": "1"}}
    key = {"pk": item["pk"]}
    absent = "attribute_not_exists(pk)"
    seen: dict[str, object] = {}

    def record(what: str, call: Callable[[], object]) -> None:
        try:
            call()
        except ClientError as error:
            seen[what] = error_code(error)
        else:
            seen[what] = "answers"

    with _table(server, name) as client:
        client.put_item(TableName=name, Item=item)
        put = {"TableName": name, "Item": {"pk": {"S": "new"}}, "ConditionExpression": absent}
        record(
            "TransactWriteItems", lambda: client.transact_write_items(TransactItems=[{"Put": put}])
        )
        failing = {**put, "Item": item, "ReturnValuesOnConditionCheckFailure": "ALL_OLD"}
        try:
            client.transact_write_items(TransactItems=[{"Put": failing}])
        except ClientError as error:
            reasons = error.response.get("CancellationReasons")
            seen["TransactWriteItems, its condition failing"] = (
                error_code(error)
                if reasons is None
                else (
                    error_code(error),
                    [reason["Code"] for reason in reasons],
                    _old_item(reasons[0].get("Item"), item),
                )
            )
        get = {"Get": {"TableName": name, "Key": key}}
        record("TransactGetItems", lambda: client.transact_get_items(TransactItems=[get]))
        ttl = {"Enabled": True, "AttributeName": "expires"}
        record(
            "UpdateTimeToLive",
            lambda: client.update_time_to_live(TableName=name, TimeToLiveSpecification=ttl),
        )
        # Each write's condition fails on the stored item (v is 1), which it asks back.
        condition = {
            "ConditionExpression": "v = :two",
            "ExpressionAttributeValues": {":two": {"N": "2"}},
            "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
        }
        writes: dict[str, tuple[str, dict[str, Any]]] = {
            "PutItem": ("put_item", {"Item": {**item, "v": {"N": "2"}}}),
            "UpdateItem": ("update_item", {"Key": key, "UpdateExpression": "SET v = :two"}),
            "DeleteItem": ("delete_item", {"Key": key}),
        }
        for operation, (method, args) in writes.items():
            with pytest.raises(ClientError) as failed:
                getattr(client, method)(TableName=name, **args, **condition)
            assert error_code(failed.value) == "ConditionalCheckFailedException"
            old = failed.value.response.get("Item")
            seen[f"{operation}, its condition failing"] = _old_item(old, item)
        assert client.get_item(TableName=name, Key=key, ConsistentRead=True)["Item"] == item
    assert seen == OBSERVED[kind]


def test_the_url_from_the_environment_is_used_and_left_running(
    dynamodb_session: Session, clean_environment: pytest.MonkeyPatch
) -> None:
    monkeypatch = clean_environment
    moto = _local(dynamodb_session, "moto")  # stands for the user's endpoint
    monkeypatch.setenv("DMUTEX_DYNAMODB_URL", moto.url)
    # The user's credentials and region: botocore's environment variables.
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "users-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "users-secret")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask beyond the environment
    found = dynamodb_servers.discover()
    assert found.source("url") == FromUrl(moto.url, "eu-west-1")
    assert found.source("moto") is None

    session = Session(found)
    assert session.prefix != dynamodb_session.prefix
    other = dynamodb_servers.unique_prefix()  # another session's: the user's, as far as it goes
    kept = f"{other}kept"
    try:
        used = session.server("url")
        assert used == Server("url", "url", moto.url, "eu-west-1", "DMUTEX_DYNAMODB_URL")
        assert session.server() == used  # the first kind found
        with used.connect() as client:
            # botocore's own lookup found the environment's (the server checks none).
            assert client._request_signer._credentials.access_key == "users-key"
            create_table(client, session.table_name("mine"))
            create_table(client, kept)
    finally:
        session.close()
    # Only the session's tables went; the server still runs.
    assert moto.pid is not None
    assert alive(moto.pid)
    with used.connect() as client:
        dynamodb_servers.wait_until_gone(client, session.table_name("mine"))
        assert kept in client.list_tables()["TableNames"]
        assert delete_tables(client, other) == [kept]

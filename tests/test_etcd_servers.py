"""The etcd server and the local clusters the tests find or start (``etcd_servers.py``)."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import etcd3gw
import pytest

from tests._support import etcd_servers
from tests._support.etcd_servers import Cluster, Endpoint, Executable, FromUrl, Session
from tests._support.servers import LOOPBACK, Discovery, alive

WAIT = 10.0  # the bound of every wait for the cluster below


@contextlib.contextmanager
def _client(endpoint: Endpoint) -> Iterator[etcd3gw.Etcd3Client]:
    """An etcd3gw client of ``endpoint``; its HTTP session closed after (else a ResourceWarning)."""
    client = etcd3gw.Etcd3Client(host=endpoint.host, port=endpoint.port, timeout=5)
    try:
        yield client
    finally:
        client.session.close()


def _eventually(check: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.05)


def _etcd() -> Path:
    """The etcd executable, or a skip (a failure under DMUTEX_REQUIRE_ETCD)."""
    etcd = etcd_servers.find_etcd()
    if etcd is None:
        if etcd_servers.required():
            pytest.fail("DMUTEX_REQUIRE_ETCD is set, but no etcd was found")
        pytest.skip(etcd_servers.no_server_reason(("executables",)))
    return etcd


# --- with no server ------------------------------------------------------------------------


def test_endpoints_of_urls() -> None:
    parse = etcd_servers.parse_endpoints
    assert parse("http://127.0.0.1:2379") == (Endpoint("127.0.0.1", 2379),)
    assert parse("http://db.example/") == (Endpoint("db.example", 2379),)
    assert parse(" etcd://a:1, b:2 ,") == (Endpoint("a", 1), Endpoint("b", 2))
    assert parse("http://a:1,https://b:2,c") == (
        Endpoint("a", 1),
        Endpoint("b", 2, "https"),
        Endpoint("c", 2379, "https"),  # no scheme: the one before it
    )
    six = parse("etcd://[::1]:23790")[0]
    assert (six.host, six.address, six.url) == ("::1", "[::1]:23790", "http://[::1]:23790")
    assert Endpoint("127.0.0.1", 1).url == "http://127.0.0.1:1"
    for bad, why in [
        ("", "no etcd endpoint"),
        (" , ", "no etcd endpoint"),
        ("redis://a:1", "not an etcd URL"),
        ("http://user:secret@a:1", "credentials"),
        ("http://a:1/v3", "no path"),
        ("http://a:1?x=1", "no path"),
        ("http://:1", "needs a host"),
        ("http://a:port", "Port could not be cast"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse(bad)


def test_dmutex_etcd_url_comes_before_etcd_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(etcd_servers.KNOB, "url")
    monkeypatch.delenv("DMUTEX_ETCD_URL", raising=False)
    monkeypatch.setenv("ETCD_URL", "http://127.0.0.1:1")
    found = etcd_servers.discover()
    assert found.sources == [FromUrl((Endpoint(LOOPBACK, 1),), "ETCD_URL")]
    # Nothing answers there: the header still says what it is, and does not fail.
    assert found.header("etcd server") == "etcd server: etcd-url"
    monkeypatch.setenv("DMUTEX_ETCD_URL", "etcd://127.0.0.1:2,127.0.0.1:3")
    found = etcd_servers.discover()
    endpoints = (Endpoint(LOOPBACK, 2), Endpoint(LOOPBACK, 3))
    assert found.sources == [FromUrl(endpoints, "DMUTEX_ETCD_URL")]
    monkeypatch.setenv("DMUTEX_ETCD_URL", "mysql://127.0.0.1:2")
    with pytest.raises(ValueError, match=r"^DMUTEX_ETCD_URL: not an etcd URL"):
        etcd_servers.discover()


def test_the_knob_limits_the_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DMUTEX_ETCD_URL", "http://127.0.0.1:1")
    monkeypatch.setenv(etcd_servers.KNOB, "none")
    found = etcd_servers.discover()
    assert found.sources == []
    assert found.reason == "no etcd server: DMUTEX_ETCD_SERVERS leaves out url, docker, executables"
    monkeypatch.setenv(etcd_servers.KNOB, "docker,executables")
    assert not any(isinstance(s, FromUrl) for s in etcd_servers.discover().sources)
    monkeypatch.setenv(etcd_servers.KNOB, "url")
    assert etcd_servers.discover().sources == [FromUrl((Endpoint(LOOPBACK, 1),))]
    monkeypatch.setenv(etcd_servers.KNOB, "url,consul")
    with pytest.raises(ValueError, match="unknown consul"):
        etcd_servers.discover()


def test_with_no_docker_the_executable_follows_and_the_header_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DMUTEX_ETCD_URL", raising=False)
    monkeypatch.delenv("ETCD_URL", raising=False)
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    monkeypatch.setenv(etcd_servers.KNOB, "docker")
    found = etcd_servers.discover()
    assert found.sources == []
    assert found.reason == (
        "no etcd server: no Docker daemon answers; DMUTEX_ETCD_SERVERS leaves out url, executables"
    )
    monkeypatch.delenv(etcd_servers.KNOB)
    found = etcd_servers.discover()
    etcd = etcd_servers.find_etcd()
    if etcd is None:
        assert found.sources == []
        assert found.reason.endswith("and no etcd on PATH or in /usr/bin")
        return
    assert found.sources == [Executable(etcd)]
    assert found.passed_over == [
        "DMUTEX_ETCD_URL and ETCD_URL are unset",
        "no Docker daemon answers",
    ]
    label = found.labels[0]
    assert label == f"etcd-{etcd_servers.etcd_version(etcd)}"
    assert re.fullmatch(r"etcd-\d+\.\d+\.\d+", label)
    assert found.header("etcd server") == (
        f"etcd server: {label} (DMUTEX_ETCD_URL and ETCD_URL are unset; no Docker daemon answers)"
    )


def test_no_server_skips_unless_one_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    nothing: Discovery[etcd_servers.Source] = Discovery([], "no etcd server: why")
    monkeypatch.delenv("DMUTEX_REQUIRE_ETCD", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no etcd server: why"):
        Session(etcd_servers.check_required(nothing)).server()
    with pytest.raises(pytest.skip.Exception, match="no etcd server: why"):
        _ = Session(nothing).url
    monkeypatch.setenv("DMUTEX_REQUIRE_ETCD", "0")
    assert etcd_servers.check_required(nothing) is nothing
    monkeypatch.setenv("DMUTEX_REQUIRE_ETCD", "1")
    with pytest.raises(RuntimeError, match="DMUTEX_REQUIRE_ETCD is set, but no etcd server: why"):
        etcd_servers.check_required(nothing)


@pytest.mark.parametrize(
    "prefix",
    ["", "/", "dmutex-test-", "dmutex-test-0123456789ab", "dmutex-test-0123456789AB/", "x/"],
)
def test_only_the_tests_prefixes_are_ever_deleted(prefix: str) -> None:
    with pytest.raises(ValueError, match="refusing to delete prefix"):
        etcd_servers.check_ours(prefix)
    with pytest.raises(ValueError, match="refusing to delete prefix"):
        # Refused before any request is made.
        etcd_servers.delete_prefix(Endpoint(LOOPBACK, 1), prefix)
    with pytest.raises(ValueError, match="refusing"):
        Session(Discovery([]), prefix=prefix)
    ours = etcd_servers.unique_prefix()
    assert etcd_servers.check_ours(ours) == ours
    assert re.fullmatch(r"dmutex-test-[0-9a-f]{12}/", ours)


def test_a_prefix_range_ends_after_its_last_key() -> None:
    assert etcd_servers.prefix_end(b"dmutex-test-0123456789ab/") == b"dmutex-test-0123456789ab0"
    assert etcd_servers.prefix_end(b"a\xff") == b"b"
    assert etcd_servers.prefix_end(b"\xff") == b"\0"  # every key


def test_a_member_listens_on_loopback_only_with_flags_its_etcd_knows(tmp_path: Path) -> None:
    command = etcd_servers.member_command(
        Path("/usr/bin/etcd"), "m1", tmp_path, 7001, 7002, {"m0": 7000, "m1": 7002}, "tok"
    )
    options = dict(zip(command[1::2], command[2::2], strict=True))
    assert options["--name"] == "m1"
    assert options["--data-dir"] == str(tmp_path / "data")
    assert options["--listen-client-urls"] == "http://127.0.0.1:7001"
    assert options["--advertise-client-urls"] == "http://127.0.0.1:7001"
    assert options["--listen-peer-urls"] == "http://127.0.0.1:7002"
    assert options["--initial-advertise-peer-urls"] == "http://127.0.0.1:7002"
    assert options["--initial-cluster"] == "m0=http://127.0.0.1:7000,m1=http://127.0.0.1:7002"
    assert options["--initial-cluster-token"] == "tok"
    assert options["--initial-cluster-state"] == "new"
    assert (options["--logger"], options["--log-level"]) == ("zap", "warn")
    assert "--election-timeout" not in options  # etcd's defaults unless asked
    assert not any("0.0.0.0" in part or "localhost" in part for part in command)
    timed = etcd_servers.member_command(
        Path("e"), "m", tmp_path, 1, 2, {"m": 2}, "t", heartbeat_ms=50, election_ms=500
    )
    assert timed[-4:] == ["--heartbeat-interval", "50", "--election-timeout", "500"]
    # Every flag is one the etcd here knows (an unknown flag stops it at once).
    etcd = _etcd()
    usage = subprocess.run(
        [str(etcd), "--help"], capture_output=True, text=True, timeout=10, check=False
    )
    known = set(re.findall(r"^\s+(--[a-z0-9-]+)", usage.stdout + usage.stderr, re.MULTILINE))
    assert set(timed[1::2]) <= known, set(timed[1::2]) - known


# --- with a server -------------------------------------------------------------------------


def test_the_sessions_server_answers_etcd3gw(etcd_session: Session) -> None:
    server = etcd_session.server()
    assert (etcd_session.url, etcd_session.host, etcd_session.port) == (
        server.url,
        server.host,
        server.port,
    )
    assert etcd_session.url == f"http://{etcd_session.host}:{etcd_session.port}"
    assert etcd_session.endpoints == [f"{etcd_session.host}:{etcd_session.port}"]
    assert etcd_session.label == f"etcd-{server.version}" == etcd_servers.etcd_label()
    assert re.fullmatch(r"etcd-\d+\.\d+\.\d+", etcd_session.label)
    assert server.prefix == etcd_session.prefix
    etcd_servers.check_ours(etcd_session.prefix)
    key = f"{etcd_session.prefix}answers"
    with _client(server.endpoints[0]) as client:
        assert client.put(key, "42")
        assert client.get(key) == [b"42"]
        assert client.delete(key)
        assert client.get(key) == []
    if server.pid is not None:  # started here: on loopback, a process of this run
        assert server.host == LOOPBACK
        assert alive(server.pid)


def test_fresh_empties_the_sessions_prefix_only(etcd_session: Session) -> None:
    server = etcd_session.server()
    other = etcd_servers.unique_prefix()  # ours too: a user's etcd keeps its own keys
    endpoint = server.endpoints[0]
    # An earlier test's holds may still be there, under leases not yet run out.
    before = etcd_servers.count_prefix(endpoint, etcd_session.prefix.encode())
    try:
        for key in ("a", "b/c"):
            etcd_servers.put(endpoint, f"{etcd_session.prefix}{key}".encode(), b"1")
        etcd_servers.put(endpoint, f"{other}kept".encode(), b"1")
        # The next prefix up from ours must survive a delete of ours.
        assert etcd_servers.count_prefix(endpoint, etcd_session.prefix.encode()) == before + 2
        assert etcd_session.fresh() == server
        assert etcd_servers.count_prefix(endpoint, etcd_session.prefix.encode()) == 0
        assert etcd_servers.count_prefix(endpoint, other.encode()) == 1
    finally:
        etcd_servers.delete_prefix(endpoint, other)
    assert etcd_servers.count_prefix(endpoint, other.encode()) == 0


def test_a_started_member_is_stopped_by_its_pid_and_its_folder_removed() -> None:
    etcd = _etcd()
    session = Session(Discovery([Executable(etcd)]))
    try:
        server = session.server()
        pid = server.pid
        assert pid is not None
        assert alive(pid)
        assert (server.origin, server.host) == (str(etcd), LOOPBACK)
        source = session.discovery.sources[0]
        assert isinstance(source, Executable)
        folder = source.process.folder
        assert (folder / "data" / "member").is_dir()
        assert source.process.log_path.parent == folder
        assert server.label == source.label  # the binary's version is the one that answers
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert f"http://{LOOPBACK}:{source.peer_port}".encode() in cmdline
        with _client(server.endpoints[0]) as client:
            assert client.put(f"{session.prefix}k", "v")
            assert client.get(f"{session.prefix}k") == [b"v"]
    finally:
        session.close()
    assert not alive(pid)
    assert not folder.exists()


def test_the_url_from_the_environment_wins(
    etcd_session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = etcd_session.server()
    monkeypatch.delenv(etcd_servers.KNOB, raising=False)
    # A first endpoint that refuses: the next one serves.
    monkeypatch.setenv("DMUTEX_ETCD_URL", f"etcd://127.0.0.1:1,{server.endpoints[0].address}")
    found = etcd_servers.discover()
    endpoints = (Endpoint(LOOPBACK, 1), server.endpoints[0])
    assert found.sources == [FromUrl(endpoints)]
    assert found.passed_over == []
    assert found.header("etcd server") == f"etcd server: {server.label}"

    # The user's etcd: the tests keep their keys under a prefix of their own,
    # delete only that at the end, and leave the server running.
    session = Session(found)
    kept = f"{etcd_session.prefix}kept"
    try:
        used = session.server()
        assert (used.origin, used.label, used.pid) == ("DMUTEX_ETCD_URL", server.label, None)
        assert used.urls == ["http://127.0.0.1:1", server.url]
        assert session.prefix != etcd_session.prefix
        with _client(server.endpoints[0]) as client:
            assert client.put(f"{session.prefix}mine", "1")
            assert client.put(kept, "1")
    finally:
        session.close()
    endpoint = server.endpoints[0]
    assert etcd_servers.count_prefix(endpoint, session.prefix.encode()) == 0
    assert etcd_servers.count_prefix(endpoint, kept.encode()) == 1
    assert server.pid is None or alive(server.pid)
    etcd_servers.delete_prefix(endpoint, etcd_session.prefix)


# --- the cluster ---------------------------------------------------------------------------


def test_a_killed_leader_is_replaced_and_restarted_rejoins() -> None:
    with etcd_servers.fresh_cluster() as cluster:
        assert cluster.size == 3
        assert len(set(cluster.endpoints())) == 3
        assert all(address.startswith(f"{LOOPBACK}:") for address in cluster.endpoints())
        first = cluster.leader()
        assert first is not None
        ids = [cluster.status(i).member_id for i in range(3)]
        assert len(set(ids)) == 3
        assert {cluster.status(i).leader for i in range(3)} == {ids[first]}
        key = f"{etcd_servers.unique_prefix()}failover"

        # The leader dies: the other two elect one of themselves, and take writes.
        killed = cluster.pid(first)
        cluster.kill(first)
        assert not alive(killed)
        assert not cluster.running(first)
        second = cluster.wait_for_leader(WAIT)
        assert second != first
        follower = next(i for i in range(3) if i not in (first, second))
        with _client(cluster.endpoint(follower)) as client:
            assert client.put(key, "meanwhile")  # through a follower: passed to the leader

        # Restarted on its data and ports, it is the same member and catches up.
        cluster.start(first, timeout=WAIT)
        assert cluster.pid(first) != killed
        assert cluster.status(first).member_id == ids[first]
        with _client(cluster.endpoint(first)) as client:
            assert client.get(key) == [b"meanwhile"]
        leader = cluster.wait_for_leader(WAIT)
        _eventually(
            lambda: cluster.status(first).leader == ids[leader], "the restarted member's leader"
        )

        # A paused follower neither answers nor holds the others up; resumed, it catches up.
        paused = next(i for i in range(3) if i != leader)
        cluster.pause(paused)
        with _client(cluster.endpoint(leader)) as client:
            assert client.put(key, "while paused")
        with pytest.raises(etcd_servers.PROBE_ERRORS):
            cluster.status(paused, timeout=0.5)
        assert cluster.wait_for_leader(WAIT) == leader
        cluster.resume(paused)
        with _client(cluster.endpoint(paused)) as client:
            assert client.get(key) == [b"while paused"]

        pids = cluster.pids()
        folders = [cluster.folder(i) for i in range(3)]
        assert len(pids) == 3
    assert not any(alive(pid) for pid in pids)
    assert not any(folder.exists() for folder in folders)


def test_a_cluster_closes_every_member_after_a_failure() -> None:
    etcd = _etcd()
    cluster = Cluster(etcd)
    # A member whose peer port is taken exits at once: the start fails, and
    # what it had started is stopped and removed.
    with socket.socket() as taken:
        taken.bind((LOOPBACK, cluster.members[1].peer_port))
        taken.listen()
        with pytest.raises(RuntimeError, match="address already in use"):
            cluster.start_all(timeout=WAIT)
        first = cluster.members[0].process
        assert not first.running
        assert not cluster.members[1].process.running
        assert cluster.pids() == []

    # A test that fails with every member up (one of them paused) leaves none behind.
    pids: list[int] = []
    folders: list[Path] = []

    def failing_test() -> None:
        with Cluster(etcd) as again:
            again.start_all(timeout=WAIT)
            pids.extend(again.pids())
            folders.extend(again.folder(i) for i in range(3))
            again.pause(0)
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        failing_test()
    assert len(pids) == 3
    assert not any(alive(pid) for pid in pids)
    assert not any(folder.exists() for folder in folders)


def test_the_cluster_fixture_gives_a_new_cluster_with_a_leader(etcd_cluster: Cluster) -> None:
    leader = etcd_cluster.leader()
    assert leader is not None
    assert len(etcd_cluster.pids()) == 3
    assert etcd_cluster.urls() == [f"http://{address}" for address in etcd_cluster.endpoints()]
    with _client(etcd_cluster.endpoint(leader)) as client:
        assert client.get_prefix("dmutex-test-") == []  # new: nothing from another test
    # A follower stopped (SIGTERM) and started again: the same member, on its ports.
    follower = next(i for i in range(3) if i != leader)
    stopped, member_id = etcd_cluster.pid(follower), etcd_cluster.status(follower).member_id
    etcd_cluster.stop(follower)
    assert not alive(stopped)
    assert etcd_cluster.folder(follower).is_dir()
    etcd_cluster.start(follower, timeout=WAIT)
    assert etcd_cluster.status(follower).member_id == member_id
    assert etcd_cluster.wait_for_leader(WAIT) in range(3)

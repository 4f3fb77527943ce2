"""dmutex against a real server, through pymongo (sync and asyncio).

The server is found as ``tests/_support/mongo_servers.py`` describes: a
MongoDB (``MONGODB_URL``, a container, ``mongod``) or SecantusDB, a
MongoDB-compatible server that is not MongoDB. Where there is none, every
server test skips with one line saying what was missing. Test ids carry the
server's label (``secantusdb-0.7.0b3``, ``mongodb-7.0.14``). Tests that fail
only because the server differs from mongod are strict xfail, each with its
reason (``mongo_servers.DEVIATIONS``). The first tests here need no
server: they check discovery itself (the order, the skip line, the labels,
the database the tests confine themselves to).

Everything runs in one database unique to the session; instances that use the
default ``db_name`` are pointed at it by a client wrapper.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, TypeAlias

import mongomock
import pymongo
import pymongo.monitoring
import pytest
from pymongo.collection import Collection
from pymongo.database import Database
from pymongo.errors import OperationFailure

from dmutex import DMutex
from tests._support import mongo_servers, processes
from tests._support.backends import RealMongo
from tests._support.faces import Face, FaceName, Handle, Kind, LoopThread
from tests._support.mongo_servers import (
    NO_MONGODB,
    AsyncRedirectedClient,
    Container,
    Discovery,
    Doc,
    Executable,
    FromUrl,
    RedirectedClient,
    SecantusDB,
    Server,
    Session,
    allowed_sources,
    check_required,
    discover,
    discovered,
    drop_test_database,
    label_of,
    no_server_reason,
    unique_db_name,
    with_one_second_ttl_monitor,
)
from tests.model.test_state_machine import CONFIGS, FEWER_EXAMPLES, check_machine

INDEX_OPTIONS_CONFLICT = 85

# --- discovery, without a server -----------------------------------------------------


@pytest.fixture
def nothing_here(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("MONGODB_URL", raising=False)
    monkeypatch.delenv("DMUTEX_REQUIRE_MONGODB", raising=False)
    monkeypatch.delenv("DMUTEX_MONGODB_SERVERS", raising=False)
    monkeypatch.setattr(mongo_servers, "docker_answers", lambda: False)
    monkeypatch.setattr(mongo_servers, "find_mongod", lambda: None)
    monkeypatch.setattr(mongo_servers, "secantus_version", lambda: None)
    return monkeypatch


def found_first(
    nothing_here: pytest.MonkeyPatch,
    *,
    url: str | None = None,
    docker: bool = False,
    mongod: str | None = None,
    secantus: str | None = None,
) -> object:
    """The source discover() picks when only these are there: a MONGODB_URL, a Docker
    daemon that answers, a mongod at ``mongod``, SecantusDB ``secantus`` installed."""
    if url is not None:
        nothing_here.setenv("MONGODB_URL", url)
    nothing_here.setattr(mongo_servers, "docker_answers", lambda: docker)
    nothing_here.setattr(mongo_servers, "find_mongod", lambda: mongod)
    nothing_here.setattr(mongo_servers, "secantus_version", lambda: secantus)
    return discover().source


def test_no_server_gives_one_line_saying_what_was_missing(
    nothing_here: pytest.MonkeyPatch,
) -> None:
    found = discover()
    assert found.source is None
    assert found.reason == NO_MONGODB
    assert "\n" not in found.reason
    for named in ("MONGODB_URL", "Docker", "mongod", "PATH", "SecantusDB"):
        assert named in found.reason
    assert found.label == "no-server"


def test_mongodb_url_comes_first(nothing_here: pytest.MonkeyPatch) -> None:
    url = "mongodb://127.0.0.1:1/"
    source = found_first(nothing_here, url=url, docker=True, mongod="/usr/bin/mongod")
    assert isinstance(source, FromUrl)
    assert source.url == "mongodb://127.0.0.1:1/"


def test_an_empty_mongodb_url_counts_as_unset(nothing_here: pytest.MonkeyPatch) -> None:
    nothing_here.setenv("MONGODB_URL", "")
    assert discover().reason == NO_MONGODB


def test_docker_before_mongod(nothing_here: pytest.MonkeyPatch) -> None:
    source = found_first(nothing_here, docker=True, mongod="/usr/bin/mongod")
    assert isinstance(source, Container)
    assert source.image == "mongo:7"


def test_mongod_before_secantusdb(nothing_here: pytest.MonkeyPatch) -> None:
    source = found_first(nothing_here, mongod="/opt/mongo/bin/mongod", secantus="0.7.0b3")
    assert isinstance(source, Executable)
    assert source.path == Path("/opt/mongo/bin/mongod")


def test_secantusdb_last(nothing_here: pytest.MonkeyPatch) -> None:
    source = found_first(nothing_here, secantus="0.7.0b3")
    assert isinstance(source, SecantusDB)
    assert source.label == "secantusdb-0.7.0b3"


def test_the_test_extra_pins_the_installed_secantusdb() -> None:
    version = mongo_servers.secantus_version()
    if version is None:
        pytest.skip("SecantusDB is not installed (it comes with the test extra)")
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert f'"SecantusDB=={version}"' in pyproject


def test_dmutex_mongodb_servers_limits_the_order(nothing_here: pytest.MonkeyPatch) -> None:
    nothing_here.setenv("MONGODB_URL", "mongodb://127.0.0.1:1/")
    nothing_here.setattr(mongo_servers, "find_mongod", lambda: "/usr/bin/mongod")
    nothing_here.setattr(mongo_servers, "secantus_version", lambda: "0.7.0b3")
    nothing_here.setenv("DMUTEX_MONGODB_SERVERS", "mongod, secantusdb")
    assert allowed_sources() == ("mongod", "secantusdb")
    assert isinstance(discover().source, Executable)
    nothing_here.setenv("DMUTEX_MONGODB_SERVERS", "secantusdb")
    assert isinstance(discover().source, SecantusDB)
    nothing_here.setenv("DMUTEX_MONGODB_SERVERS", "url,docker,mongod")
    nothing_here.setattr(mongo_servers, "find_mongod", lambda: None)
    nothing_here.delenv("MONGODB_URL")
    found = discover()
    assert found.source is None
    assert found.reason == no_server_reason(("url", "docker", "mongod"))
    assert found.reason.endswith("DMUTEX_MONGODB_SERVERS leaves out secantusdb")
    assert "\n" not in found.reason
    nothing_here.setenv("DMUTEX_MONGODB_SERVERS", "none")
    assert allowed_sources() == ()
    assert discover().reason == (
        "no server for the MongoDB tests: "
        "DMUTEX_MONGODB_SERVERS leaves out url, docker, mongod, secantusdb"
    )
    nothing_here.setenv("DMUTEX_MONGODB_SERVERS", "mongo")
    with pytest.raises(ValueError, match="unknown mongo"):
        discover()


def test_labels_come_from_build_info_and_secantusdb_says_what_it_is() -> None:
    assert label_of({"version": "7.0.14"}) == "mongodb-7.0.14"
    # SecantusDB's "version" imitates a mongod's; its own is secantusVersion.
    assert label_of({"version": "8.2.11", "secantusVersion": "0.7.0b3"}) == "secantusdb-0.7.0b3"
    assert Container().label == "mongodb-7"
    assert Executable(Path("/nonexistent/mongod")).label == "mongodb-mongod"


def test_no_server_skips_with_the_one_line() -> None:
    session = Session(Discovery(None, NO_MONGODB))
    with pytest.raises(pytest.skip.Exception) as skipped:
        session.server()
    assert skipped.value.msg == NO_MONGODB
    session.close()  # nothing was started: nothing to stop or drop


def test_required_turns_the_skip_into_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    nothing = Discovery(None, NO_MONGODB)
    monkeypatch.delenv("DMUTEX_REQUIRE_MONGODB", raising=False)
    assert check_required(nothing) is nothing
    monkeypatch.setenv("DMUTEX_REQUIRE_MONGODB", "0")
    assert check_required(nothing) is nothing
    monkeypatch.setenv("DMUTEX_REQUIRE_MONGODB", "1")
    with pytest.raises(RuntimeError, match=NO_MONGODB):
        check_required(nothing)
    found = Discovery(FromUrl("mongodb://127.0.0.1:1/"))
    assert check_required(found) is found


def test_each_session_gets_its_own_database() -> None:
    names = {unique_db_name() for _ in range(20)}
    assert len(names) == 20
    assert all(name.startswith("dmutex_test_") for name in names)
    first, second = Session(Discovery(None, NO_MONGODB)), Session(Discovery(None, NO_MONGODB))
    assert first.db_name != second.db_name


def test_only_test_databases_are_ever_dropped() -> None:
    client: mongomock.MongoClient[Doc] = mongomock.MongoClient()
    try:
        for name in ("dmutex", "dmutex_test_", "app", "dmutex_test_ab12"):
            client.get_database(name).get_collection("c").insert_one({"_id": 1})
        for name in ("dmutex", "dmutex_test_", "app"):
            with pytest.raises(ValueError, match="refusing to drop"):
                drop_test_database(client, name)
        drop_test_database(client, "dmutex_test_ab12")
        assert sorted(client.list_database_names()) == ["app", "dmutex", "dmutex_test_"]
    finally:
        client.close()


def test_the_redirect_maps_only_the_default_database() -> None:
    client: pymongo.MongoClient[Doc] = pymongo.MongoClient(connect=False)
    try:
        redirected = RedirectedClient(client, "dmutex_test_ab12")
        assert redirected.get_database("dmutex").name == "dmutex_test_ab12"
        with pytest.raises(AssertionError, match="'other'"):
            redirected.get_database("other")
        assert redirected.asked == ["dmutex", "other"]
        DMutex("svc", redirected)  # detected as a MongoDB client, no I/O
    finally:
        client.close()
    aclient: pymongo.AsyncMongoClient[Doc] = pymongo.AsyncMongoClient(connect=False)
    try:
        aredirected = AsyncRedirectedClient(aclient, "dmutex_test_ab12")
        assert aredirected.get_database("dmutex").name == "dmutex_test_ab12"
    finally:
        asyncio.run(aclient.close())


def test_mongod_is_started_on_loopback_quietly_in_its_own_dbpath() -> None:
    args = Executable(Path("/x/mongod")).command(27999, "/tmp/d")
    assert args[0] == "/x/mongod"

    def value(flag: str) -> str:
        return args[args.index(flag) + 1]

    assert value("--port") == "27999"
    assert value("--bind_ip") == "127.0.0.1"
    assert value("--dbpath") == "/tmp/d"
    assert "--quiet" in args


def test_secantusdb_is_started_on_loopback_with_the_sweep_asked_for() -> None:
    args = SecantusDB("0.7.0b3", python="/venv/bin/python").command(27999)
    assert args[:3] == ["/venv/bin/python", "-I", str(mongo_servers.SECANTUS_LAUNCHER)]
    assert args[args.index("--port") + 1] == "27999"
    assert args[args.index("--ttl-sweep-seconds") + 1] == "60.0"
    assert mongo_servers.SECANTUS_LAUNCHER.is_file()
    # Imported here: it imports the SecantusDB package, which the rest needs not.
    from tests._support import secantus_daemon

    assert secantus_daemon.HOST == "127.0.0.1"
    parsed = secantus_daemon.parse(["--port", "1", "--ttl-sweep-seconds", "1"])
    assert (parsed.port, parsed.ttl_sweep_seconds, parsed.storage_path) == (1, 1.0, ":memory:")


def test_a_second_server_with_a_one_second_ttl_monitor_only_for_servers_started_here() -> None:
    fast = with_one_second_ttl_monitor(SecantusDB("0.7.0b3", python="/p"))
    assert isinstance(fast, SecantusDB)
    assert (fast.ttl_sweep_seconds, fast.python, fast.label) == (1.0, "/p", "secantusdb-0.7.0b3")
    mongod = with_one_second_ttl_monitor(Executable(Path("/x/mongod")))
    assert isinstance(mongod, Executable)
    args = mongod.command(1, "/d")
    assert args[-2:] == ["--setParameter", "ttlMonitorSleepSecs=1"]
    assert with_one_second_ttl_monitor(FromUrl("mongodb://127.0.0.1:1/")) is None
    assert with_one_second_ttl_monitor(Container()) is None


def test_a_secantusdb_that_exits_is_reported_and_cleaned_up() -> None:
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` executable to stand in for a broken interpreter")
    broken = SecantusDB("0.7.0b3", python=false)
    with pytest.raises(RuntimeError, match="SecantusDB exited with code 1 before answering"):
        broken.start("dmutex_test_ab12")
    assert broken._process._proc is None
    assert broken._process._dir is None


def test_a_started_source_refuses_to_start_again() -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait(10)
    for source in (SecantusDB("0.7.0b3"), Executable(Path("/x/mongod"))):
        source._process._proc = done  # as if started: a second start would lose this process
        with pytest.raises(RuntimeError, match=f"already running \\(pid {done.pid}\\)"):
            source.start("dmutex_test_ab12")
        assert source._process._proc is done
        source._process._proc = None


def test_a_mongod_that_exits_is_reported_and_cleaned_up() -> None:
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` executable to stand in for a broken mongod")
    broken = Executable(Path(false))
    with pytest.raises(RuntimeError, match="exited with code 1 before answering"):
        broken.start("dmutex_test_ab12")
    assert broken._process._proc is None
    assert broken._process._dir is None


# --- a real server --------------------------------------------------------------------


# mongo_session is the harness plugin's (_support/plugins/mongodb.py), the contract suite's too:
# a second session fixture here would start the same source a second time
# and lose the first process.


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that takes the server carries its label in its id, as the Redis ones do."""
    if "mongo_label" in metafunc.fixturenames:
        label = mongo_servers.mongo_label()
        metafunc.parametrize("mongo_label", [label], indirect=True, scope="session")


@pytest.fixture(scope="session")
def mongo_label(request: pytest.FixtureRequest) -> str:
    """The label of the session's server ("secantusdb-0.7.0b3", "mongodb-7.0.14", "no-server")."""
    label: str = request.param
    return label


@pytest.fixture
def mongo(mongo_session: Session, mongo_label: str) -> Server:
    """The server, with the test database empty; skips with the one line if there is none."""
    return mongo_session.fresh()


@pytest.fixture
def db(mongo_session: Session, mongo: Server) -> Database[Doc]:
    """The test database, read through a tz-aware client."""
    return mongo_session.admin.get_database(mongo.db_name)


@dataclass
class Env:
    """One face over a real client whose default database is the test database."""

    face: FaceName
    client: RedirectedClient | AsyncRedirectedClient
    loop: LoopThread | None

    def make(self, kind: Kind, **options: Any) -> Face:
        return Face(self.face, kind, self.client, loop=self.loop, **options)


@pytest.fixture(params=["sync", "async"])
def env(request: pytest.FixtureRequest, mongo: Server) -> Iterator[Env]:
    if request.param == "sync":
        client = mongo.client()
        try:
            yield Env("sync", RedirectedClient(client, mongo.db_name), None)
        finally:
            client.close()
        return
    loop = LoopThread()
    aclient = mongo.async_client()
    try:
        yield Env("async", AsyncRedirectedClient(aclient, mongo.db_name), loop)
    finally:
        loop.run(aclient.close())
        loop.close()


def ready(face: Face) -> None:
    face.wait(face.target.ready())


def now() -> datetime:
    return datetime.now(timezone.utc)


def permits_of(kind: Kind) -> int:
    return 1 if kind == "mutex" else 2


def collection(db: Database[Doc], kind: Kind, service: str = "svc") -> Collection[Doc]:
    return db.get_collection(f"_d{kind}_{service}")


def stored(coll: Collection[Doc]) -> dict[str, Doc]:
    return {str(doc["_id"]): doc for doc in coll.find()}


# --- the layout, byte for byte (spec section 6) ---------------------------------------


def test_ready_creates_exactly_the_ttl_index(env: Env, db: Database[Doc]) -> None:
    for kind in ("mutex", "semaphore"):
        ready(env.make(kind, service_name="orders", max_permits=3))
        info = collection(db, kind, "orders").index_information()
        assert sorted(info) == ["_id_", "expiredAt_1"]
        spec = {k: v for k, v in info["expiredAt_1"].items() if k not in ("v", "ns")}
        assert spec == {"key": [("expiredAt", 1)], "expireAfterSeconds": 0}
    assert set(env.client.asked) == {"dmutex"}, "the default database is 'dmutex'"


def test_semaphore_and_mutex_leave_exactly_the_typescript_documents(
    env: Env, db: Database[Doc]
) -> None:
    sem = env.make("semaphore", service_name="orders", max_permits=3)
    permits = [sem.acquire("api", 60) for _ in range(3)]
    assert sem.acquire("api", 60) is None
    lock = env.make("mutex", service_name="orders").acquire("job", 60)
    assert lock is not None
    held = [p for p in permits if p is not None]
    assert len(held) == 3
    assert sorted(p.slot for p in held) == [0, 1, 2]

    assert sorted(db.list_collection_names()) == ["_dmutex_orders", "_dsemaphore_orders"]

    def document(handle: Handle, key: str) -> Doc:
        assert handle.expired_at.microsecond % 1000 == 0, "expiries are whole milliseconds"
        _id = f"permit:{handle.slot}:{key}"
        return {"_id": _id, "value": handle.token, "expiredAt": handle.expired_at}

    assert stored(collection(db, "semaphore", "orders")) == {
        f"permit:{p.slot}:api": document(p, "api") for p in held
    }
    assert stored(collection(db, "mutex", "orders")) == {"permit:0:job": document(lock, "job")}
    # The types as the server sees them: string _id and value, a BSON date.
    typed = {"_id": {"$type": "string"}, "value": {"$type": "string"}}
    typed["expiredAt"] = {"$type": "date"}
    assert collection(db, "semaphore", "orders").count_documents(typed) == 3
    assert collection(db, "mutex", "orders").count_documents(typed) == 1
    for p in held:
        random = p.token.partition("|")[0]
        assert str(uuid.UUID(random, version=4)) == random


def ms_date(at: datetime) -> datetime:
    """``at`` cut to whole milliseconds, as a BSON date stores it."""
    return at.replace(microsecond=at.microsecond // 1000 * 1000)


def typescript_lease(key: str, slot: int, token: str, expired_at: datetime) -> Doc:
    """A lease exactly as the TypeScript dmutex writes it: string _id and value, a date."""
    return {"_id": f"permit:{slot}:{key}", "value": token, "expiredAt": ms_date(expired_at)}


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_typescript_written_leases_are_honoured_and_taken_over(
    env: Env, db: Database[Doc], kind: Kind
) -> None:
    permits = permits_of(kind)
    coll = collection(db, kind)  # _dmutex_svc / _dsemaphore_svc of the (redirected) "dmutex"
    active = typescript_lease("api", 0, str(uuid.uuid4()), now() + timedelta(minutes=1))
    # Expired but stored (the TTL monitor has not run), in every slot of "old".
    expired = [
        typescript_lease("old", slot, str(uuid.uuid4()), now() - timedelta(seconds=1))
        for slot in range(permits)
    ]
    coll.insert_many([active, *expired])
    face = env.make(kind, max_permits=permits)

    if kind == "semaphore":
        mine = face.acquire("api", 60)
        assert mine is not None
        assert mine.slot == 1, "slot 0 is the TypeScript holder's"
    assert face.acquire("api", 60) is None, "the TypeScript lease was not honoured"
    assert stored(coll)[active["_id"]] == active, "a refused acquire changed the foreign lease"

    assert face.release_token("api", active["value"]) is True
    assert active["_id"] not in stored(coll)
    after = face.acquire("api", 60)
    assert after is not None
    assert after.slot == 0

    taken = face.acquire("old", 60)
    assert taken is not None, "an expired TypeScript lease was not taken over"
    by_slot = {doc["_id"]: doc for doc in expired}
    _id = f"permit:{taken.slot}:old"
    assert stored(coll)[_id] == {"_id": _id, "value": taken.token, "expiredAt": taken.expired_at}
    assert face.release_token("old", by_slot[_id]["value"]) is False
    assert face.extend("old", by_slot[_id]["value"], 60) is False
    untouched = [doc for doc in expired if doc["_id"] != _id]
    assert [stored(coll)[doc["_id"]] for doc in untouched] == untouched


# --- the core behaviours (spec section 3) ----------------------------------------------


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_contention_returns_none(env: Env, db: Database[Doc], kind: Kind) -> None:
    permits = permits_of(kind)
    first = env.make(kind, max_permits=permits)
    holders = [first.acquire("k", 60) for _ in range(permits)]
    assert all(h is not None for h in holders)
    other = env.make(kind, max_permits=permits)
    before = stored(collection(db, kind))
    assert other.acquire("k", 60) is None
    assert first.acquire("k", 60) is None
    assert stored(collection(db, kind)) == before, "a refused acquire changed storage"
    assert other.acquire("another-key", 60) is not None


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_release_and_extend_by_handle(env: Env, db: Database[Doc], kind: Kind) -> None:
    face = env.make(kind, max_permits=permits_of(kind))
    handle = face.acquire("k", 60)
    assert handle is not None
    _id = f"permit:{handle.slot}:k"
    first_expiry = handle.expired_at
    assert handle.extend(120) is True
    assert handle.expired_at > first_expiry
    assert stored(collection(db, kind))[_id]["expiredAt"] == handle.expired_at
    assert handle.release() is True
    assert stored(collection(db, kind)) == {}
    assert handle.release() is False
    assert handle.extend(120) is False
    assert stored(collection(db, kind)) == {}, "extend after release re-created the record"


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_release_and_extend_by_token(env: Env, db: Database[Doc], kind: Kind) -> None:
    permits = permits_of(kind)
    holder, other = env.make(kind, max_permits=permits), env.make(kind, max_permits=permits)
    handle = holder.acquire("k", 60)
    assert handle is not None
    _id = f"permit:{handle.slot}:k"
    before = now()
    assert other.extend("k", handle.token, 120) is True
    after = now()
    expiry = stored(collection(db, kind))[_id]["expiredAt"]
    lease, slack = timedelta(seconds=120), timedelta(milliseconds=1)  # expiries are rounded
    assert before + lease - slack <= expiry <= after + lease + slack
    assert other.release_token("k", handle.token) is True
    assert stored(collection(db, kind)) == {}
    assert other.release_token("k", handle.token) is False
    assert other.extend("k", handle.token, 120) is False


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_a_foreign_token_changes_nothing(env: Env, db: Database[Doc], kind: Kind) -> None:
    face = env.make(kind, max_permits=permits_of(kind))
    handle = face.acquire("k", 60)
    assert handle is not None
    before = stored(collection(db, kind))
    stranger = str(uuid.uuid4())
    assert face.release_token("k", stranger) is False
    assert face.extend("k", stranger, 600) is False
    assert face.release_token("other", handle.token) is False, "right token, wrong key"
    assert face.extend("other", handle.token, 600) is False
    assert stored(collection(db, kind)) == before


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_an_expired_but_stored_record_is_taken_over(
    env: Env, db: Database[Doc], kind: Kind
) -> None:
    permits = permits_of(kind)
    face = env.make(kind, max_permits=permits)
    holders = [face.acquire("k", 60) for _ in range(permits)]
    old = holders[0]
    assert old is not None
    coll = collection(db, kind)
    _id = f"permit:{old.slot}:k"
    # Expired now, but stored: as on a server whose TTL monitor has not run yet.
    changed = coll.update_one({"_id": _id}, {"$set": {"expiredAt": now()}})
    assert changed.modified_count == 1
    new = env.make(kind, max_permits=permits).acquire("k", 60)
    assert new is not None, "the expired record was not taken over"
    assert new.slot == old.slot, "the only free slot is the expired one"
    assert new.token != old.token
    after_takeover = stored(coll)
    assert after_takeover[_id] == {"_id": _id, "value": new.token, "expiredAt": new.expired_at}
    assert old.release() is False
    assert old.extend(600) is False
    assert face.release_token("k", old.token) is False
    assert stored(coll) == after_takeover, "the old holder touched the new holder's record"
    assert new.release() is True


# --- the server's TTL monitor deletes an expired lease ---------------------------------------

MONITOR_DEADLINE = 10.0  # seconds for a 1 s monitor to delete a lease that expired
SHORT_TTL = 0.5


@pytest.fixture(scope="module")
def monitored(mongo_session: Session) -> Iterator[Session]:
    """A second server of the session's kind, whose TTL monitor runs every second."""
    source = discovered().source
    if source is None:
        pytest.skip(mongo_session.discovery.reason)
    fast = with_one_second_ttl_monitor(source)
    if fast is None:
        pytest.skip(
            f"{source.label}: the TTL monitor test needs a server the tests start "
            "(mongod or SecantusDB) with a 1 s monitor"
        )
    session = Session(Discovery(fast), mongo_session.db_name)
    try:
        yield session
    finally:
        session.close()


class UpdateReplies(pymongo.monitoring.CommandListener):
    """The replies to the ``update`` commands a client sent that wrote without error.

    An upsert into a held slot gets an ``ok`` reply carrying ``writeErrors``
    (E11000): left out.
    """

    def __init__(self) -> None:
        self.replies: list[Mapping[str, Any]] = []

    def started(self, event: pymongo.monitoring.CommandStartedEvent) -> None:
        pass

    def succeeded(self, event: pymongo.monitoring.CommandSucceededEvent) -> None:
        if event.command_name == "update" and "writeErrors" not in event.reply:
            self.replies.append(event.reply)

    def failed(self, event: pymongo.monitoring.CommandFailedEvent) -> None:
        pass


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_after_the_ttl_monitor_deletes_a_lease_acquire_inserts_a_new_one(
    monitored: Session, mongo_label: str, kind: Kind
) -> None:
    server = monitored.fresh()
    coll = collection(monitored.admin.get_database(server.db_name), kind)
    listener = UpdateReplies()
    client = server.client(event_listeners=[listener])
    try:
        permits = permits_of(kind)
        face = Face("sync", kind, RedirectedClient(client, server.db_name), max_permits=permits)
        others = [face.acquire("k", 60) for _ in range(permits - 1)]
        others.append(face.acquire("other-key", 60))
        old = face.acquire("k", SHORT_TTL)
        assert old is not None
        assert all(other is not None for other in others)
        _id = f"permit:{old.slot}:k"
        assert stored(coll)[_id]["value"] == old.token
        untouched = {name: doc for name, doc in stored(coll).items() if name != _id}
        assert len(untouched) == permits

        deadline = time.monotonic() + MONITOR_DEADLINE
        while coll.find_one({"_id": _id}) is not None:
            if time.monotonic() > deadline:
                pytest.fail(f"the TTL monitor left the expired lease for {MONITOR_DEADLINE} s")
            time.sleep(0.1)
        assert stored(coll) == untouched, "the monitor deleted something else"

        listener.replies.clear()
        new = face.acquire("k", 60)
        assert new is not None
        assert new.slot == old.slot, "the only free slot is the deleted one"
        assert new.token != old.token
        # A new document: the one upsert the server accepted inserted it.
        (reply,) = listener.replies
        assert reply["n"] == 1
        assert reply["nModified"] == 0
        assert [u["_id"] for u in reply["upserted"]] == [_id]
        after = stored(coll)
        assert after[_id] == {"_id": _id, "value": new.token, "expiredAt": new.expired_at}

        assert old.release() is False
        assert old.extend(60) is False
        assert face.release_token("k", old.token) is False
        assert face.extend("k", old.token, 60) is False
        assert stored(coll) == after, "the old token changed something"
        assert {name: doc for name, doc in after.items() if name != _id} == untouched
        assert new.release() is True
    finally:
        client.close()


# --- ready() failing ----------------------------------------------------------------------


def test_a_conflicting_index_fails_ready_and_every_acquire(env: Env, db: Database[Doc]) -> None:
    coll = collection(db, "mutex")
    coll.create_index([("expiredAt", 1)], name="expiredAt_1", expireAfterSeconds=3600)
    mutex = env.make("mutex")
    with pytest.raises(OperationFailure) as failed:
        ready(mutex)
    with pytest.raises(OperationFailure) as again:
        mutex.acquire("k", 60)
    assert again.value.code == failed.value.code, "the server's own error surfaces again"
    with pytest.raises(OperationFailure):
        env.make("mutex").acquire("k", 60)
    assert coll.count_documents({}) == 0, "an acquire wrote a lease although ready() failed"
    assert coll.index_information()["expiredAt_1"]["expireAfterSeconds"] == 3600


def test_a_conflicting_ttl_index_is_index_options_conflict(env: Env, db: Database[Doc]) -> None:
    """What mongod answers when the TTL index exists with another expiry: code 85."""
    collection(db, "mutex").create_index(
        [("expiredAt", 1)], name="expiredAt_1", expireAfterSeconds=3600
    )
    with pytest.raises(OperationFailure) as failed:
        ready(env.make("mutex"))
    assert (failed.value.code, (failed.value.details or {}).get("codeName")) == (
        INDEX_OPTIONS_CONFLICT,
        "IndexOptionsConflict",
    )


# --- several processes, one counter --------------------------------------------------------

SERVICE = "procs"
LOCK_KEY = "counter"
COUNTERS = "counters"
PROCESSES = 4
CYCLES = 500
TTL = 10.0
RETRY_TIMEOUT = 60.0
RETRY_DELAY = 0.001
BARRIER_TIMEOUT = 60.0  # spawning and importing on a busy machine
DEADLINE = 240.0  # for all workers, start to finish


@dataclass(frozen=True)
class Report:
    """What one worker saw."""

    worker: int
    cycles: int
    interleaved: int  # cycles that found the counter moved since this worker last wrote it
    foreign: int  # cycles where the lock document did not hold this worker's token
    failed_releases: int


Reports: TypeAlias = processes.Reports
Barrier: TypeAlias = processes.Barrier


def counter_worker(
    worker: int, reports: Reports, barrier: Barrier, url: str, db_name: str, cycles: int
) -> None:
    """``cycles`` times: lock, read the counter, write it back plus one, release."""
    try:
        client: pymongo.MongoClient[Doc] = pymongo.MongoClient(url, serverSelectionTimeoutMS=10_000)
        try:
            mutex = DMutex(SERVICE, client, db_name=db_name)
            mutex.ready()
            counters = client.get_database(db_name).get_collection(COUNTERS)
            locks = client.get_database(db_name).get_collection(f"_dmutex_{SERVICE}")
            interleaved = foreign = failed = done = 0
            last_written: int | None = None
            barrier.wait(BARRIER_TIMEOUT)
            for _ in range(cycles):
                lock = mutex.acquire_with_retry(
                    LOCK_KEY, ttl=TTL, timeout=RETRY_TIMEOUT, retry_delay=RETRY_DELAY
                )
                assert lock is not None, "acquire_with_retry timed out"
                record = locks.find_one({"_id": f"permit:0:{LOCK_KEY}"})
                if record is None or record["value"] != lock.token:
                    foreign += 1
                found = counters.find_one({"_id": "counter"})
                assert found is not None
                value = int(found["n"])
                if last_written is not None and value != last_written:
                    interleaved += 1
                # Read, then write back: without exclusion, updates get lost.
                written = counters.update_one({"_id": "counter"}, {"$set": {"n": value + 1}})
                assert written.matched_count == 1
                last_written = value + 1
                if not lock.release():
                    failed += 1
                done += 1
        finally:
            client.close()
    except BaseException:
        barrier.abort()  # free the others if this one failed before the barrier
        reports.put((worker, traceback.format_exc()))
        raise
    reports.put((worker, Report(worker, done, interleaved, foreign, failed)))


def run_workers(count: int, *args: object) -> list[Report]:
    """Start ``count`` counter workers together; their reports, or a failed test."""
    return processes.run_workers(counter_worker, count, *args, deadline=DEADLINE, report=Report)


def test_mutex_serializes_read_modify_write_across_processes(
    mongo: Server, db: Database[Doc]
) -> None:
    db.get_collection(COUNTERS).insert_one({"_id": "counter", "n": 0})
    started = time.monotonic()
    reports = run_workers(PROCESSES, mongo.url, mongo.db_name, CYCLES)
    # Shown with -s; no assertion uses the time.
    print(f"\nmongo counter on {mongo.label}: {time.monotonic() - started:.2f} s, {reports}")
    assert [r.cycles for r in reports] == [CYCLES] * PROCESSES
    assert sum(r.foreign for r in reports) == 0, "a holder found another token in the lock"
    assert sum(r.failed_releases for r in reports) == 0
    counter = db.get_collection(COUNTERS).find_one({"_id": "counter"})
    assert counter is not None
    assert counter["n"] == PROCESSES * CYCLES
    assert sum(r.interleaved for r in reports) > 0, "the workers ran one after another"
    assert db.get_collection(f"_dmutex_{SERVICE}").count_documents({}) == 0


# --- the state machine -------------------------------------------------------------------


@pytest.mark.parametrize(("face", "kind", "max_permits"), CONFIGS)
def test_state_machine(
    mongo_session: Session, mongo: Server, face: FaceName, kind: Kind, max_permits: int
) -> None:
    """The model's state machine against the real server, each example on fresh collections.

    FEWER_EXAMPLES (a quarter): mongomock runs the store's decisions in full.
    """
    check_machine(lambda: RealMongo(mongo_session), face, kind, max_permits, FEWER_EXAMPLES)

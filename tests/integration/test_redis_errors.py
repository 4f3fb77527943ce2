"""Contract section 3 on real servers: only contention returns None; all else raises.

A dead or refused connection, a wrong or missing password, a script error and
an out-of-memory server each reach the caller as the exception redis-py
raised, with the server's (or the socket's) message, from acquire, release
and extend, on both faces. A reply no Redis would give raises DMutexError.

Clients here never retry (``Retry(NoBackoff(), 0)``): redis-py's default
retries a refused connection with exponential backoff, seconds per call.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Iterator
from typing import Literal

import pytest
import redis
import redis.asyncio
import redis.asyncio.retry
import redis.retry
from redis.backoff import NoBackoff

from dmutex import DMutexError, RedisArg
from tests._support.face_rigs import FaceRig
from tests._support.faces import Face, FaceName, Handle
from tests._support.redis_servers import Executable, Server, executables, free_port

# The socket's words for a connection that is refused or cut: sync redis-py
# says "Connection refused", asyncio "Connect call failed", either may find the
# old connection closed first.
CONNECTION = r"Error 111|Connection refused|Connect call failed|Connection closed by server"
WRONG_PASSWORD = r"WRONGPASS|invalid username-password pair|invalid password|AUTH"
OOM = r"command not allowed when used memory > 'maxmemory'"

# (kind, max_permits): a SET NX acquire, and a script acquire.
SHAPES = [("mutex", 1), ("semaphore", 3)]
SHAPE_IDS = ["mutex", "semaphore-3"]


def held(handle: Handle | None) -> Handle:
    assert handle is not None, "expected the permit to be granted"
    return handle


class Rig(FaceRig):
    """One face: makes non-retrying clients and instances, closes them all."""

    def client(self, url: str) -> redis.Redis | redis.asyncio.Redis:
        # Each face its own Retry class: redis-py 8.2 warns when an asyncio
        # client is handed the synchronous one.
        if self.face == "async":
            no_retry = redis.asyncio.retry.Retry(NoBackoff(), 0)
            return self.keep(redis.asyncio.Redis.from_url(url, socket_timeout=5, retry=no_retry))
        return self.keep(
            redis.Redis.from_url(url, socket_timeout=5, retry=redis.retry.Retry(NoBackoff(), 0))
        )


@pytest.fixture(params=["sync", "async"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    made = Rig(request.param)
    try:
        yield made
    finally:
        made.close()


# --- private servers ------------------------------------------------------------------


@functools.cache
def _executables() -> dict[str, Executable]:
    return {exe.label: exe for exe in executables()}


class Private:
    """Starts ``redis-server`` processes of one version; stops each by its pid."""

    def __init__(self, template: Executable) -> None:
        self.template = template
        self._started: list[Executable] = []

    def start(self, password: str | None = None) -> tuple[Server, Executable]:
        exe = Executable(self.template.path, self.template.version, password=password)
        self._started.append(exe)
        return exe.start(), exe

    def stop_all(self) -> None:
        for exe in self._started:
            exe.stop()


@pytest.fixture(params=sorted(_executables()) or [""])
def private(request: pytest.FixtureRequest) -> Iterator[Private]:
    label: str = request.param
    if not label:
        pytest.skip("no runnable redis-server executable to start a private server")
    made = Private(_executables()[label])
    try:
        yield made
    finally:
        made.stop_all()  # each process by its own pid


def every_operation_raises(
    lock: Face,
    handle: Handle,
    kind: str,
    error: type[BaseException],
    match: str,
) -> list[BaseException]:
    """Acquire, release and extend (by handle, and by token on a semaphore) all raise."""
    actions: list[Callable[[], object]] = [
        lambda: lock.acquire("k"),
        lambda: lock.acquire("other"),
        handle.release,
        lambda: handle.extend(30),
    ]
    if kind == "semaphore":
        actions += [
            lambda: lock.release_token("k", handle.token),
            lambda: lock.extend("k", handle.token, 30),
        ]
    return each_raises(actions, error, match)


def every_token_call_raises(lock: Face, error: type[BaseException], match: str) -> None:
    """Acquire, and release and extend by a token of no lease, all raise."""
    each_raises(
        [
            lambda: lock.acquire("k"),
            lambda: lock.release_token("k", str(uuid.uuid4())),
            lambda: lock.extend("k", str(uuid.uuid4()), 30),
        ],
        error,
        match,
    )


def each_raises(
    actions: list[Callable[[], object]], error: type[BaseException], match: str
) -> list[BaseException]:
    """Each of ``actions`` raises ``error`` matching ``match``: what they raised."""
    raised = []
    for action in actions:
        with pytest.raises(error, match=match) as caught:
            action()
        raised.append(caught.value)
    return raised


# --- connections ----------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "permits"), SHAPES, ids=SHAPE_IDS)
def test_dead_server_raises(rig: Rig, private: Private, kind: str, permits: int) -> None:
    server, exe = private.start()
    lock = rig.make(kind, rig.client(server.url), permits)
    handle = held(lock.acquire("k"))
    exe.stop()
    every_operation_raises(lock, handle, kind, redis.ConnectionError, CONNECTION)


@pytest.mark.parametrize(("kind", "permits"), SHAPES, ids=SHAPE_IDS)
def test_refused_connection_raises(rig: Rig, kind: str, permits: int) -> None:
    lock = rig.make(kind, rig.client(f"redis://127.0.0.1:{free_port()}/0"), permits)
    every_token_call_raises(lock, redis.ConnectionError, CONNECTION)


# --- authentication -------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "permits"), SHAPES, ids=SHAPE_IDS)
def test_wrong_password_raises(rig: Rig, private: Private, kind: str, permits: int) -> None:
    server, _ = private.start(password="secret")
    lock = rig.make(kind, rig.client(f"redis://:wrong@{server.host}:{server.port}/0"), permits)
    every_token_call_raises(lock, redis.AuthenticationError, WRONG_PASSWORD)


@pytest.mark.parametrize(("kind", "permits"), SHAPES, ids=SHAPE_IDS)
def test_missing_password_raises_noauth(
    rig: Rig, private: Private, kind: str, permits: int
) -> None:
    server, _ = private.start(password="secret")
    lock = rig.make(kind, rig.client(f"redis://{server.host}:{server.port}/0"), permits)
    with pytest.raises(redis.AuthenticationError) as caught:
        lock.acquire("k")
    # redis-py moves the NOAUTH code into status_code and keeps the server's sentence.
    said = f"{getattr(caught.value, 'status_code', '')} {caught.value}"
    assert "NOAUTH" in said
    assert "authenticat" in str(caught.value).lower()

    with redis.Redis.from_url(server.url) as admin:
        assert admin.dbsize() == 0, "nothing was written"


# --- server errors --------------------------------------------------------------------


def test_wrongtype_in_the_compare_script_raises(rig: Rig, redis_url: str) -> None:
    """A slot key that is not a string: passed over when looking, an error when it is the one."""
    client = rig.client(redis_url)
    with redis.Redis.from_url(redis_url) as admin:
        try:
            admin.hset("_dsemaphore_svc:permit:0:k", "f", "v")
            sem = rig.make("semaphore", client, 3)
            permit = held(sem.acquire("k"))
            assert permit.slot == 1, "SET NX passes over the occupied slot 0"
            # By token: MGET reads the hash at slot 0 as nil, so the token is
            # found in slot 1 and the hash is left alone.
            assert sem.extend("k", permit.token, 30) is True
            assert admin.type("_dsemaphore_svc:permit:0:k") == b"hash"
            assert sem.release_token("k", permit.token) is True
            assert admin.exists("_dsemaphore_svc:permit:1:k") == 0
            permit = held(sem.acquire("k"))
            assert permit.slot == 1

            # By handle: the permit's own slot key replaced by a hash.
            mutex = rig.make("mutex", client)
            for lock, name in (
                (permit, "_dsemaphore_svc:permit:1:k"),
                (held(mutex.acquire("m")), "_dmutex_svc:permit:0:m"),
            ):
                admin.delete(name)
                admin.hset(name, "f", "v")
                with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
                    lock.release()
                with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
                    lock.extend(30)
                assert admin.type(name) == b"hash", "the script changed nothing"
        finally:
            admin.flushdb()


@pytest.mark.parametrize(
    ("kind", "permits"),
    [("mutex", 1), ("semaphore", 1), ("semaphore", 3)],
    ids=["mutex", "semaphore-1", "semaphore-3"],
)
def test_out_of_memory_raises(rig: Rig, private: Private, kind: str, permits: int) -> None:
    server, _ = private.start()
    lock = rig.make(kind, rig.client(server.url), permits)
    with redis.Redis.from_url(server.url) as admin:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)
        for _ in range(2):  # the first script call may go by EVAL after NOSCRIPT
            with pytest.raises(redis.ResponseError, match=OOM):
                lock.acquire("k")
        admin.config_set("maxmemory", 0)
        assert admin.dbsize() == 0
        held(lock.acquire("k"))  # the same instance works once memory is allowed


# --- replies no Redis gives -----------------------------------------------------------


class Scripted:
    """A sync client whose every command answers ``reply``."""

    def __init__(self, reply: object) -> None:
        self.reply = reply

    def execute_command(self, *args: RedisArg) -> object:
        return self.reply


class AsyncScripted:
    def __init__(self, reply: object) -> None:
        self.reply = reply

    async def execute_command(self, *args: RedisArg) -> object:
        return self.reply


class ScriptedSetEval:
    """A sync set + eval client whose every call answers ``reply``."""

    def __init__(self, reply: object) -> None:
        self.reply = reply

    def set(self, name: str, value: str, *, px: int, nx: bool) -> object:
        return self.reply

    def eval(self, script: str, numkeys: int, *keys_and_args: RedisArg) -> object:
        return self.reply


class AsyncScriptedSetEval:
    def __init__(self, reply: object) -> None:
        self.reply = reply

    async def set(self, name: str, value: str, *, px: int, nx: bool) -> object:
        return self.reply

    async def eval(self, script: str, numkeys: int, *keys_and_args: RedisArg) -> object:
        return self.reply


Scripts = Scripted | AsyncScripted | ScriptedSetEval | AsyncScriptedSetEval


def scripted(face: FaceName, path: Literal["command", "set_eval"], reply: object) -> Scripts:
    if path == "command":
        return AsyncScripted(reply) if face == "async" else Scripted(reply)
    return AsyncScriptedSetEval(reply) if face == "async" else ScriptedSetEval(reply)


@pytest.mark.parametrize("path", ["command", "set_eval"])
@pytest.mark.parametrize(("kind", "permits"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("weird", ["weird", b"weird", 2.5, ["OK"]], ids=repr)
def test_unexpected_reply_raises_dmutex_error(
    rig: Rig, path: Literal["command", "set_eval"], kind: str, permits: int, weird: object
) -> None:
    # A well-formed reply first: fence 1 from a mutex's acquire script, slot
    # 0 and fence 1 from a semaphore's.
    client = scripted(rig.face, path, 1 if kind == "mutex" else [0, 1])
    lock = rig.make(kind, client, permits)
    handle = held(lock.acquire("k"))
    client.reply = weird
    raised = every_operation_raises(lock, handle, kind, DMutexError, "unexpected reply from Redis")
    assert all(repr(weird) in str(error) for error in raised), "the reply is named"

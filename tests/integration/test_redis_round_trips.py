"""Spec section 7 on real servers: every Redis operation is ONE request.

Each operation is counted two independent ways:

- on the client side, by a wrapper client that records what dmutex calls
  (``execute_command`` for the redis-py path; ``set`` and ``eval`` for the
  ioredis-shaped path) before handing it to a real redis-py client;
- on the server side, by the ``calls`` deltas of ``INFO commandstats``. Lua's
  ``redis.call`` is counted there too, so a script's own GET/SET/DEL/PEXPIRE
  show up beside its EVALSHA; the requests the client sent are the
  EVALSHA/EVAL calls, or, when no script ran, the plain SETs. The INFO
  command that reads the stats counts itself, and is ignored.

Scripts are cached on the server once per test (see ``rig``), so EVALSHA is
answered; ``test_after_script_flush_*`` checks the NOSCRIPT fallback.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Protocol, TypeVar

import pytest
import redis
import redis.asyncio

from dmutex import DSemaphore, RedisArg
from dmutex._backends.redis.scripts import INDEXED_ABOVE
from tests._support.face_rigs import FaceRig
from tests._support.faces import FaceName, Handle
from tests._support.redis_clients import Recording

T = TypeVar("T")

SCRIPT_REQUESTS = ("evalsha", "eval")
# What the release/extend scripts may run inside their one request: one read
# (GET of the one slot key, or MGET of all), then DEL or PEXPIRE.
COMPARE_INSIDE = {"get", "mget", "del", "pexpire"}
# What a semaphore's scripts run on its holders index: ZSCORE (its mark, a
# token), ZCOUNT (the active holders), the server's TIME, and the writes.
INDEX = {"zscore", "zcount", "time", "zremrangebyscore", "zadd", "zrevrangebyscore", "pexpireat"}
INDEX |= {"zrem", "zrangebyscore"}  # the check of a full index against the slot keys
INDEX |= {"exists"}  # of an index that is not there yet


def without_index_ttl(server: dict[str, int]) -> dict[str, int]:
    """``server`` less the index's expiry: its latest lease read (ZREVRANGEBYSCORE), PEXPIREAT.

    The index is deleted instead when the last lease leaves it (one more DEL).
    """
    assert server.get("zrevrangebyscore") == 1
    assert server.get("pexpireat", 0) + server.get("del", 0) >= 1
    return {name: n for name, n in server.items() if name not in ("zrevrangebyscore", "pexpireat")}


# (kind, max_permits): one permit is a one-key script, more read every slot
# key with one MGET; above INDEXED_ABOVE (32) permits a semaphore also keeps a
# holders index. Both sides of that threshold are counted.
SMALL, INDEXED = INDEXED_ABOVE, INDEXED_ABOVE + 1
SHAPES = [("mutex", 1), ("semaphore", 1), ("semaphore", 3), ("semaphore", SMALL)]
SHAPES += [("semaphore", INDEXED)]
SHAPE_IDS = ["mutex", "semaphore-1", "semaphore-3", f"semaphore-{SMALL}", f"semaphore-{INDEXED}"]


def indexed(permits: int) -> bool:
    """Whether a semaphore of ``permits`` keeps a holders index (``scripts.INDEXED_ABOVE``)."""
    return permits > INDEXED_ABOVE


# --- the counting clients -------------------------------------------------------------


class Recorder(Protocol):
    commands: list[tuple[RedisArg, ...]]


class AsyncCountingCommands:
    """The asyncio twin of :class:`~tests._support.redis_clients.Recording`."""

    def __init__(self, inner: redis.asyncio.Redis) -> None:
        # redis-py leaves execute_command unannotated; this is its asyncio signature.
        self._send: Callable[..., Awaitable[object]] = inner.execute_command
        self.commands: list[tuple[RedisArg, ...]] = []

    async def execute_command(self, *args: RedisArg) -> object:
        self.commands.append(args)
        return await self._send(*args)


class CountingSetEval:
    """A sync client with only ``set`` and ``eval`` (the ioredis shape)."""

    def __init__(self, inner: redis.Redis) -> None:
        self.inner = inner
        self.commands: list[tuple[RedisArg, ...]] = []

    def set(self, name: str, value: str, *, px: int, nx: bool) -> bool | str | bytes | None:
        self.commands.append(("SET", name, value, px, nx))
        reply: bool | str | bytes | None = self.inner.set(name, value, px=px, nx=nx)
        return reply

    def eval(self, script: str, numkeys: int, *keys_and_args: RedisArg) -> object:
        self.commands.append(("EVAL", numkeys, *keys_and_args))
        return self.inner.eval(script, numkeys, *keys_and_args)


class AsyncCountingSetEval:
    """The asyncio twin of :class:`CountingSetEval`."""

    def __init__(self, inner: redis.asyncio.Redis) -> None:
        self.inner = inner
        self.commands: list[tuple[RedisArg, ...]] = []

    async def set(self, name: str, value: str, *, px: int, nx: bool) -> bool | str | bytes | None:
        self.commands.append(("SET", name, value, px, nx))
        reply: bool | str | bytes | None = await self.inner.set(name, value, px=px, nx=nx)
        return reply

    async def eval(self, script: str, numkeys: int, *keys_and_args: RedisArg) -> object:
        self.commands.append(("EVAL", numkeys, *keys_and_args))
        return await self.inner.eval(script, numkeys, *keys_and_args)


# --- measuring ----------------------------------------------------------------------


def command_calls(admin: redis.Redis) -> Counter[str]:
    """``calls`` per command from ``INFO commandstats``, keyed ``set``, ``evalsha``..."""
    info: dict[str, dict[str, int]] = admin.info("commandstats")
    return Counter({name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in info.items()})


@dataclass
class Seen:
    """What one operation sent: as the client recorded it, and as the server counted it."""

    requests: list[str]  # command names the wrapper was asked to send, in order
    server: dict[str, int]  # commandstats deltas, INFO left out

    @property
    def server_requests(self) -> int:
        """Requests from the client: the script calls, or the plain commands if none."""
        scripts = sum(self.server.get(name, 0) for name in SCRIPT_REQUESTS)
        return scripts if scripts else sum(self.server.values())


class Rig(FaceRig):
    """One face over one server: counting clients, instances, and a meter."""

    def __init__(self, face: FaceName, url: str) -> None:
        super().__init__(face)
        self.url = url
        self.admin = redis.Redis.from_url(url)

    def close(self) -> None:
        super().close()
        self.admin.close()

    def _sync_inner(self) -> redis.Redis:
        inner = self.keep(redis.Redis.from_url(self.url))
        inner.ping()  # connect now: the handshake is not an operation's request
        return inner

    def _async_inner(self) -> redis.asyncio.Redis:
        assert self.loop is not None
        inner = self.keep(redis.asyncio.Redis.from_url(self.url))

        async def connect() -> None:
            await inner.ping()  # the handshake is not an operation's request

        self.loop.run(connect())
        return inner

    def commands(self) -> Recording | AsyncCountingCommands:
        if self.face == "async":
            return AsyncCountingCommands(self._async_inner())
        return Recording(self._sync_inner())

    def set_eval(self) -> CountingSetEval | AsyncCountingSetEval:
        if self.face == "async":
            return AsyncCountingSetEval(self._async_inner())
        return CountingSetEval(self._sync_inner())

    def measure(self, client: Recorder, action: Callable[[], T]) -> tuple[T, Seen]:
        client.commands.clear()
        before = command_calls(self.admin)
        result = action()
        after = command_calls(self.admin)
        after.subtract(before)
        server = {name: n for name, n in after.items() if n and name != "info"}
        return result, Seen([str(call[0]).upper() for call in client.commands], server)


def warm_scripts(admin: redis.Redis) -> None:
    """Have the server cache dmutex's scripts, through the public API."""
    sem = DSemaphore("warm-up", admin, max_permits=2)
    permit = sem.acquire("scripts")
    assert permit is not None
    assert permit.extend(5) is True
    assert permit.release() is True
    lock = DSemaphore("warm-up", admin, max_permits=1).acquire("scripts")  # the mutex's pair
    assert lock is not None
    assert lock.release() is True


@pytest.fixture(params=["sync", "async"])
def rig(request: pytest.FixtureRequest, redis_url: str) -> Iterator[Rig]:
    made = Rig(request.param, redis_url)
    try:
        warm_scripts(made.admin)
        yield made
    finally:
        made.close()


def held(handle: Handle | None) -> Handle:
    assert handle is not None, "expected the permit to be granted"
    return handle


def read_of(permits: int) -> str:
    """How a script reads the slot keys: GET of the one, or one MGET of them all."""
    return "get" if permits == 1 else "mget"


# --- execute_command path -----------------------------------------------------------


@pytest.mark.parametrize(("kind", "permits"), SHAPES, ids=SHAPE_IDS)
def test_acquire_is_one_request_free_and_full(rig: Rig, kind: str, permits: int) -> None:
    client = rig.commands()
    lock = rig.make(kind, client, permits)
    for slot in range(permits):
        handle, seen = rig.measure(client, lambda: lock.acquire("k"))
        assert held(handle).slot == slot
        assert seen.requests == ["EVALSHA"]
        assert seen.server_requests == 1
        # The fence counter: one GET before anything is written, one SET after, and
        # the server's TIME that the fence is at least (in microseconds).
        grant = {"evalsha": 1, "get": 1, "set": 2, "time": 1}
        if permits == 1:
            assert seen.server == grant
        elif not indexed(permits):
            # One MGET read every slot; one SET NX took the first free one. Nothing
            # else: no index read or written.
            assert seen.server == {**grant, "mget": 1}
        else:
            # One MGET read every slot; one SET NX took the first free one;
            # the holders index (made by the first grant) records the token,
            # scored by the same TIME.
            index = {"zscore": 1, "exists": 1} if slot == 0 else {"zscore": 1, "zcount": 1}
            grant |= {"mget": 1}
            assert without_index_ttl(seen.server) == {
                **grant,
                **index,
                "zremrangebyscore": 1,
                "zadd": 1,
            }

    refused, seen = rig.measure(client, lambda: lock.acquire("k"))
    assert refused is None, "all permits are held"
    assert seen.requests == ["EVALSHA"]
    assert seen.server_requests == 1
    if permits == 1:
        # A mutex's SET NX fails, then GET shows another token; the counter
        # is read only for a grant.
        assert seen.server == {"evalsha": 1, "set": 1, "get": 1}
        return
    if not indexed(permits):
        # The counter's GET and one MGET of the slot keys, every time: no index
        # to consult, nothing written.
        read = {"evalsha": 1, "get": 1, "mget": 1}
        assert seen.server == read
        refused, seen = rig.measure(client, lambda: lock.acquire("k"))
        assert refused is None
        assert seen.requests == ["EVALSHA"]
        assert seen.server == read, "the same again"
        return
    # The first time the index says full, it is checked against the slot keys
    # (one GET each, its active members read), stamped, and its expiry settled.
    check = {"evalsha": 1, "get": 1 + permits, "zscore": 3, "time": 1, "zcount": 2}
    check |= {"zrangebyscore": 1, "zadd": 1}
    assert without_index_ttl(seen.server) == check, "the index checked once"
    # Within CHECK_MS of that, the index answers alone: no slot key is read,
    # and nothing is written (the counter is only read).
    refused, seen = rig.measure(client, lambda: lock.acquire("k"))
    assert refused is None
    fresh = {"evalsha": 1, "get": 1, "zscore": 3, "time": 1, "zcount": 1}
    assert seen.server == fresh, f"a full semaphore of {permits} answered by its index"


@pytest.mark.parametrize(("kind", "permits"), SHAPES, ids=SHAPE_IDS)
def test_release_and_extend_by_handle_are_one_request(rig: Rig, kind: str, permits: int) -> None:
    client = rig.commands()
    lock = rig.make(kind, client, permits)
    handles = [held(lock.acquire("k")) for _ in range(permits)]
    for handle in handles:
        # An indexed semaphore's index also moves the token's expiry (ZSCORE
        # of its mark and of the token, then ZADD XX). A small one's handle
        # costs what a mutex's does: its one slot key.
        index = indexed(permits)
        extended, seen = rig.measure(client, partial(handle.extend, 60))
        assert extended is True
        assert seen.requests == ["EVALSHA"]
        expected = {"evalsha": 1, "get": 1}
        if index:
            expected |= {"zscore": 2, "time": 1, "zadd": 1}
        if index:
            expected |= {"pexpire": 1}
            assert without_index_ttl(seen.server) == expected, "only its own slot key"
        else:
            assert seen.server == {**expected, "pexpire": 1}, "only its own slot key"

        released, seen = rig.measure(client, handle.release)
        assert released is True
        assert seen.requests == ["EVALSHA"]
        # Its own slot key, and one ZSCORE of the waiters record: nobody
        # waits, so nothing more is read or written. The index forgets the token.
        expected = {"evalsha": 1, "get": 1, "del": 1, "zscore": 1}
        if index:
            # The index goes with the last lease in it: a second DEL.
            expected |= {"zscore": 2, "zrem": 1, "del": 2 if handle is handles[-1] else 1}
            assert without_index_ttl(seen.server) == expected, "only its own slot key"
        else:
            assert seen.server == expected, "only its own slot key"

        # Gone now: the answer is False, still in one request.
        for action in (handle.release, partial(handle.extend, 60)):
            done, seen = rig.measure(client, action)
            assert done is False
            assert seen.requests == ["EVALSHA"]
            gone = {"evalsha": 1, "get": 1}
            if index and rig.admin.exists("_dsemaphore_svc:holders:k"):
                gone |= {"zscore": 1, "zrem": 1} if action == handle.release else {"zscore": 2}
            elif index:  # gone with the last lease: its mark not found, nor the record
                gone |= {"zscore": 1, "exists": 1}
            assert seen.server == gone
    assert rig.admin.keys("*permit:*") == []


@pytest.mark.parametrize("permits", [1, 3, SMALL, INDEXED])
def test_release_and_extend_by_token_are_one_request(rig: Rig, permits: int) -> None:
    client = rig.commands()
    sem = rig.make("semaphore", client, permits)
    handles = [held(sem.acquire("k")) for _ in range(permits)]
    last = handles[-1]
    assert last.slot == permits - 1

    def check(seen: Seen, inside: str | None) -> None:
        assert seen.requests == ["EVALSHA"]
        assert seen.server_requests == 1
        if not indexed(permits):
            # No index: the one slot key read (GET), or every slot by one MGET,
            # then the DEL or PEXPIRE; a release that deleted a permit asks
            # whether anyone waits (one ZSCORE of the waiters record).
            expected = {"evalsha": 1, read_of(permits): 1}
            if inside is not None:
                expected[inside] = 1
            if inside == "del":
                expected["zscore"] = 1
            assert seen.server == expected, "nothing else ran"
            return
        if inside is not None:
            # The index names the token's slot: that one key is read, not all.
            assert "mget" not in seen.server
            assert seen.server["get"] == 1
            assert set(seen.server) <= {"evalsha", *COMPARE_INSIDE, *INDEX}
            assert seen.server[inside] >= 1
            return
        # A token the index does not know: every slot read by one command,
        # beside the index's reads (and the ZREM of a token it does not hold).
        assert seen.server["mget"] == 1
        rest = set(seen.server) - {"zscore", "zrem", "exists"}
        assert rest == {"evalsha", "mget"}, "nothing else ran"

    extended, seen = rig.measure(client, lambda: sem.extend("k", last.token, 60))
    assert extended is True
    check(seen, "pexpire")

    stranger = str(uuid.uuid4())
    for action in (
        lambda: sem.release_token("k", stranger),
        lambda: sem.extend("k", stranger, 60),
        lambda: sem.release_token("nobody", stranger),
        lambda: sem.extend("nobody", stranger, 60),
    ):
        done, seen = rig.measure(client, action)
        assert done is False, "no permit holds that token"
        check(seen, None)

    released, seen = rig.measure(client, lambda: sem.release_token("k", last.token))
    assert released is True
    check(seen, "del")
    assert rig.admin.exists(f"_dsemaphore_svc:permit:{permits - 1}:k") == 0
    assert len(rig.admin.keys("_dsemaphore_svc:permit:*:k")) == permits - 1


@pytest.mark.parametrize(("kind", "permits"), SHAPES, ids=SHAPE_IDS)
def test_ready_sends_nothing(rig: Rig, kind: str, permits: int) -> None:
    client = rig.commands()
    lock = rig.make(kind, client, permits)
    for round_ in range(2):  # before any operation, and after one
        result, seen = rig.measure(client, lambda: lock.wait(lock.target.ready()))
        assert result is None
        assert seen.requests == []
        assert seen.server == {}
        held(lock.acquire(f"k{round_}"))


def test_after_script_flush_each_script_costs_two_requests_once(rig: Rig) -> None:
    client = rig.commands()
    sem = rig.make("semaphore", client, 3)
    lock = held(rig.make("mutex", client).acquire("m"))  # before the flush
    assert rig.admin.script_flush() is True

    def twice(action: Callable[[], T]) -> list[T]:
        """Run ``action`` twice: NOSCRIPT then EVAL the first time, EVALSHA after."""
        results = []
        for requests in (["EVALSHA", "EVAL"], ["EVALSHA"]):
            result, seen = rig.measure(client, action)
            results.append(result)
            assert seen.requests == requests
            assert seen.server_requests == len(requests)
            assert seen.server.get("evalsha") == 1, "NOSCRIPT is one request too"
            assert seen.server.get("eval", 0) == len(requests) - 1
            # The EVAL after NOSCRIPT sends the same keys and arguments.
            assert all(call[2:] == client.commands[0][2:] for call in client.commands)
        return results

    first, second = twice(lambda: held(sem.acquire("k")))  # the acquire script
    assert (first.slot, second.slot) == (0, 1)
    assert twice(lambda: sem.extend("k", first.token, 60)) == [True, True]  # extend script
    assert twice(lock.release) == [True, False]  # release script, by a mutex's handle
    assert rig.admin.script_flush() is True
    assert twice(lambda: sem.release_token("k", first.token)) == [True, False]
    assert twice(lambda: second.extend(60)) == [True, True]


# --- set + eval path ----------------------------------------------------------------


@pytest.mark.parametrize(("kind", "permits"), SHAPES, ids=SHAPE_IDS)
def test_set_eval_path_is_one_call_per_operation(rig: Rig, kind: str, permits: int) -> None:
    client = rig.set_eval()
    lock = rig.make(kind, client, permits)
    call = "EVAL"  # the one-key script as well: set() is never called
    _, seen = rig.measure(client, lambda: lock.wait(lock.target.ready()))
    assert (seen.requests, seen.server) == ([], {})

    handles = []
    for slot in range(permits):
        handle, seen = rig.measure(client, lambda: lock.acquire("k"))
        handles.append(held(handle))
        assert handles[-1].slot == slot
        assert seen.requests == [call]
        # With the fence counter's GET, SET and the server's TIME.
        took = {"eval": 1, "get": 1, "set": 2, "time": 1}
        if permits > 1:
            took["mget"] = 1
        if indexed(permits):
            index = {"zscore": 1, "exists": 1} if slot == 0 else {"zscore": 1, "zcount": 1}
            # The index's TIME is a second one.
            took |= {**index, "zremrangebyscore": 1, "zadd": 1}
            assert without_index_ttl(seen.server) == took
        else:
            assert seen.server == took
    refused, seen = rig.measure(client, lambda: lock.acquire("k"))
    assert refused is None
    assert seen.requests == [call]
    assert seen.server_requests == 1

    last = handles[-1]
    checks: list[tuple[Callable[[], object], object]] = [(lambda: last.extend(60), True)]
    if kind == "semaphore":
        stranger = str(uuid.uuid4())
        checks += [
            (lambda: lock.extend("k", last.token, 60), True),
            (lambda: lock.extend("k", stranger, 60), False),
            (lambda: lock.release_token("k", stranger), False),
            (lambda: lock.release_token("k", last.token), True),
        ]
    checks += [(last.release, kind == "mutex"), (lambda: last.extend(60), False)]
    for action, expected in checks:
        result, seen = rig.measure(client, action)
        assert result is expected
        assert seen.requests == ["EVAL"]
        assert seen.server_requests == 1
        assert set(seen.server) <= {"eval", *COMPARE_INSIDE, *(INDEX if indexed(permits) else ())}

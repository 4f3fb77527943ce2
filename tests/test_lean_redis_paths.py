"""The written-out common paths of issue 43: each must do what the general path it shortcuts does.

A mutex's acquire and release on Redis send their script's ``EVALSHA``
without the store's generic request generators, the store marks its
releases' requests to run to completion itself (so the engine adds no
``completing`` layer), the engine checks a plain key and the default TTL
inline, a reply's integer is read without a call, and a grant's deadline
span is worked out once per TTL. These tests pin that each shortcut keeps
the general path's behaviour: the NOSCRIPT fallback, a clear error for a
record dmutex did not write, the release's mark, the checks' refusals, the
exact deadline.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dmutex import (
    AsyncDMutex,
    AsyncDSemaphore,
    DMutex,
    DMutexError,
    InvalidArgumentError,
    ManualClock,
    RedisArg,
)
from dmutex._backends.redis.requests import as_int
from dmutex._backends.redis.scripts import FOREIGN, MUTEX_ACQUIRE, MUTEX_RELEASE
from dmutex._core import renewal
from dmutex._core.abc import releases_complete
from dmutex._core.effects import Call, Steps
from dmutex._core.engine import Engine
from dmutex._core.lease import Lease


class Scripted:
    """A Redis-shaped client: each command gets the next canned reply, raised if an exception."""

    def __init__(self, *replies: object) -> None:
        self.replies: list[Any] = list(replies)
        self.commands: list[tuple[RedisArg, ...]] = []

    def execute_command(self, *args: RedisArg) -> Any:
        self.commands.append(args)
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


class AsyncScripted(Scripted):
    async def execute_command(self, *args: RedisArg) -> Any:
        return Scripted.execute_command(self, *args)


def noscript() -> Exception:
    return Exception("NOSCRIPT No matching script. Please use EVAL.")


def names(client: Scripted) -> list[tuple[RedisArg, RedisArg]]:
    """Each command's name and its script (a SHA1 or the text)."""
    return [(command[0], command[1]) for command in client.commands]


def test_a_mutex_acquire_falls_back_to_eval_on_noscript() -> None:
    client = Scripted(noscript(), 5)
    lock = DMutex("svc", client).acquire("k")
    assert lock is not None
    assert lock.fence == 5
    assert names(client) == [("EVALSHA", MUTEX_ACQUIRE.sha), ("EVAL", MUTEX_ACQUIRE.text)]
    assert client.commands[0][2:] == client.commands[1][2:], "the same keys and arguments"


def test_a_mutex_release_falls_back_to_eval_on_noscript() -> None:
    client = Scripted(1, noscript(), 1)
    lock = DMutex("svc", client).acquire("k")
    assert lock is not None
    assert lock.release() is True
    assert names(client)[1:] == [("EVALSHA", MUTEX_RELEASE.sha), ("EVAL", MUTEX_RELEASE.text)]
    assert client.commands[1][2:] == client.commands[2][2:]


@pytest.mark.parametrize("eval_fails", [False, True])
def test_a_record_dmutex_did_not_write_is_a_clear_error(eval_fails: bool) -> None:
    """Raised by the EVALSHA, or by the EVAL after a NOSCRIPT: the same clear error."""
    refusal = Exception(f"ERR DMUTEX _dmutex_svc:fence:k {FOREIGN}")
    replies = [noscript(), refusal] if eval_fails else [refusal]
    client = Scripted(*replies)
    with pytest.raises(DMutexError, match="dmutex leaves it alone") as caught:
        DMutex("svc", client).acquire("k")
    assert caught.value.__cause__ is refusal
    # The acquire failed: the engine releases by its token before re-raising.
    assert client.commands[-1][:2] == ("EVALSHA", MUTEX_RELEASE.sha)


def test_another_error_of_an_acquire_is_raised_as_it_is() -> None:
    failure = ConnectionError("connection reset")
    client = Scripted(failure, 0)
    with pytest.raises(ConnectionError) as caught:
        DMutex("svc", client).acquire("k")
    assert caught.value is failure
    assert names(client) == [("EVALSHA", MUTEX_ACQUIRE.sha), ("EVALSHA", MUTEX_RELEASE.sha)]


def test_another_error_of_a_release_is_raised_as_it_is() -> None:
    failure = ConnectionError("connection reset")
    client = Scripted(1, failure)
    lock = DMutex("svc", client).acquire("k")
    assert lock is not None
    with pytest.raises(ConnectionError) as caught:
        lock.release()
    assert caught.value is failure


def marks(steps: Steps[Any], replies: list[object]) -> list[bool]:
    """Run ``steps`` by hand, answering each request in turn: each request's ``complete``."""
    seen: list[bool] = []
    value: object = None
    try:
        while True:
            effect = steps.send(value)
            assert isinstance(effect, Call)
            seen.append(effect.complete)
            reply = replies.pop(0)
            if isinstance(reply, Exception):
                value = None
                effect = steps.throw(reply)
                assert isinstance(effect, Call)
                seen.append(effect.complete)
                reply = replies.pop(0)
            value = reply
    except StopIteration:
        return seen


@pytest.mark.parametrize("permits", [1, 3])
def test_the_redis_store_marks_every_request_of_a_release_itself(permits: int) -> None:
    """The engine adds no ``completing`` for it, so the store's own mark must be on every one."""
    client = AsyncScripted()
    face = (
        AsyncDMutex("svc", client)
        if permits == 1
        else AsyncDSemaphore("svc", client, max_permits=permits)
    )
    engine = face._engine
    assert releases_complete(engine._store)
    assert marks(engine.release(Lease("k", "t", 0, 0)), [1]) == [True]
    assert marks(engine.release(Lease("k", "t", 0, 0)), [noscript(), 1]) == [True, True]
    assert marks(engine.release_token("k", "t"), [1]) == [True]
    assert client.commands == [], "only the steps ran, by hand"


def test_the_requests_of_an_acquire_are_not_marked() -> None:
    engine = AsyncDMutex("svc", AsyncScripted())._engine
    assert marks(engine.acquire("k", None), [1]) == [False]


class Unmarked:
    """A store whose release does not mark its request: the engine must (engine rule 6)."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        if name == "releases_complete":
            raise AttributeError(name)
        return getattr(self._store, name)

    def release(self, key: str, token: str, slot: int | None) -> Steps[bool]:
        reply = yield Call(print, (key, token))
        return reply == 1


@pytest.mark.parametrize(("shield", "marked"), [(True, True), (False, False)])
def test_a_store_that_does_not_mark_its_releases_is_marked_by_the_engine(
    shield: bool, marked: bool
) -> None:
    redis = DMutex("svc", Scripted())._engine._store
    engine = Engine(Unmarked(redis), default_ttl=300, shield=shield)
    assert not releases_complete(engine._store)
    assert marks(engine.release(Lease("k", "t", 0, 0)), [1]) == [marked]


def test_an_async_release_cancelled_in_flight_still_reaches_the_server() -> None:
    """The store's mark is what the driver shields by: a cancellation waits for the reply."""

    class Held(AsyncScripted):
        gate: asyncio.Event

        async def execute_command(self, *args: RedisArg) -> Any:
            if args[1] == MUTEX_RELEASE.sha:
                self.gate.set()
                await asyncio.sleep(0.01)
            return Scripted.execute_command(self, *args)

    async def main() -> None:
        client = Held(1, 1)
        client.gate = asyncio.Event()
        lock = await AsyncDMutex("svc", client).acquire("k")
        assert lock is not None
        releasing = asyncio.ensure_future(lock.release())
        await client.gate.wait()
        releasing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await releasing
        assert names(client)[-1] == ("EVALSHA", MUTEX_RELEASE.sha)
        assert client.replies == [], "the release's reply was read: the request ran to its end"

    asyncio.run(main())


@pytest.mark.parametrize(
    "key",
    ["k", "ключ", "x" * 500, type("Name", (str,), {})("k")],
    ids=["ascii", "non-ascii", "longest", "str-subclass"],
)
def test_a_key_the_inline_check_passes_over_is_checked_as_before(key: str) -> None:
    client = Scripted(1)
    lock = DMutex("svc", client).acquire(key)
    assert lock is not None
    assert type(lock.key) is str
    assert lock.key == str.__str__(key)


@pytest.mark.parametrize(
    "key", ["", "x" * 501, 7, None, b"k"], ids=["empty", "too-long", "int", "none", "bytes"]
)
def test_a_bad_key_is_refused_before_any_request(key: Any) -> None:
    client = Scripted()
    with pytest.raises((InvalidArgumentError, TypeError)):
        DMutex("svc", client).acquire(key)
    assert client.commands == []


@pytest.mark.parametrize("ttl", [None, 1.5, 300])
def test_the_ttl_sent_is_the_checked_one(ttl: float | None) -> None:
    client = Scripted(1)
    lock = DMutex("svc", client, default_ttl_seconds=30).acquire("k", ttl)
    assert lock is not None
    sent = client.commands[0][-1]
    assert sent == (30_000 if ttl is None else round(ttl * 1000))


@pytest.mark.parametrize(
    ("reply", "low", "high", "read"),
    [(0, 0, 1, 0), (1, 0, 1, 1), (7, 0, 2**63 - 1, 7), ("1", 0, 1, 1), (b"5", 0, 9, 5)],
)
def test_as_int_reads_an_integer_however_it_came(
    reply: object, low: int, high: int, read: int
) -> None:
    assert as_int(reply, low, high) == read


@pytest.mark.parametrize("reply", [True, False, 2, -1, 1.0, None])
def test_as_int_refuses_a_bool_and_a_number_out_of_range(reply: object) -> None:
    with pytest.raises(DMutexError, match="unexpected reply"):
        as_int(reply, 0, 1)


@pytest.mark.parametrize("ttl_ms", [1, 7, 800, 1_999, 2_000, 9_999, 30_000, 300_000, 10**9])
def test_a_deadline_is_the_send_time_plus_the_ttl_less_its_margin(ttl_ms: int) -> None:
    sent = 1234.5
    for _ in range(2):  # worked out, then kept
        assert renewal.deadline(sent, ttl_ms) == sent + (ttl_ms - renewal.margin_ms(ttl_ms)) / 1000


def test_the_deadline_spans_kept_are_bounded() -> None:
    for ttl_ms in range(10_000, 10_000 + 2 * renewal._SPANS_KEPT):
        assert renewal.deadline(0.0, ttl_ms) == (ttl_ms - renewal.margin_ms(ttl_ms)) / 1000
    assert len(renewal._SPANS) <= renewal._SPANS_KEPT


def test_a_grant_sets_its_deadline_from_before_its_request() -> None:
    """Renewal rule 1, through the written-out acquire: the send time is read before the request."""
    clock = ManualClock()

    class Slow(Scripted):
        def execute_command(self, *args: RedisArg) -> Any:
            clock.advance(2.0)  # the request takes 2 s
            return super().execute_command(*args)

    mutex = DMutex("svc", Slow(1), clock=clock, default_ttl_seconds=30)
    before, before_ms = clock.monotonic(), round(clock.time() * 1000)
    lock = mutex.acquire("k")
    assert lock is not None
    assert clock.monotonic() == before + 2.0
    assert lock._lease.deadline == before + (30_000 - renewal.margin_ms(30_000)) / 1000
    assert lock._lease.expires_ms == before_ms + 30_000, "estimated from before the request"

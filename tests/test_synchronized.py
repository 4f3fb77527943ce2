"""``synchronized``: a function or coroutine that runs under a lock of its own key.

Every test runs on :class:`InMemoryBackend` (or, where nothing may reach a
server, on a Redis-shaped double that records every command), sync and
asyncio. The lock is probed with the face's own ``acquire`` from the same
backend: a probe that gets None shows that the decorated call holds the key.
"""

from __future__ import annotations

import asyncio
import inspect
import pickle
import threading
import time
from typing import Any

import pytest

from dmutex import (
    ArgumentTypeError,
    AsyncDMutex,
    AsyncDSemaphore,
    DMutex,
    DMutexError,
    DReadWriteLock,
    DSemaphore,
    InMemoryBackend,
    InvalidArgumentError,
    LeaseLostError,
    LockBusyError,
    ManualClock,
    synchronized,
)
from tests._support.doubles import AnsweringRedis, AsyncAnsweringRedis


def free(lock: DMutex | DSemaphore, key: str) -> bool:
    """Whether ``key`` has a free permit now (taken and given back at once)."""
    handle = lock.acquire(key)
    if handle is None:
        return False
    handle.release()
    return True


def recorded() -> tuple[DMutex, AnsweringRedis]:
    """A mutex on a Redis-shaped double that records every command it is sent."""
    client = AnsweringRedis()
    shape: Any = client  # Redis-shaped, without the client's exact annotations
    return DMutex("svc", shape), client


# Plain functions


def test_the_function_runs_holding_its_key_and_returns_its_value() -> None:
    mutex = DMutex("svc", InMemoryBackend())
    probes: list[bool] = []

    @synchronized(mutex, "report", on_busy="raise")
    def build(n: int) -> int:
        probes.append(free(mutex, "report"))
        return n * 2

    result: int = build(21)
    assert result == 42
    assert probes == [False]  # held while the function ran
    assert free(mutex, "report")  # and released after


def test_skip_returns_default_without_calling_the_function() -> None:
    mutex = DMutex("svc", InMemoryBackend())
    calls: list[int] = []

    @synchronized(mutex, "job", on_busy="skip", default=-1)
    def job(n: int) -> int:
        calls.append(n)
        return n

    @synchronized(mutex, "job", on_busy="skip")
    def bare(n: int) -> int:
        calls.append(n)
        return n

    held = mutex.acquire("job")
    assert held is not None
    skipped: int = job(1)
    assert skipped == -1
    nothing: int | None = bare(2)
    assert nothing is None
    assert calls == []
    held.release()
    assert job(3) == 3
    assert bare(4) == 4
    assert calls == [3, 4]


def test_raise_raises_lock_busy_with_the_key_without_calling_the_function() -> None:
    mutex = DMutex("svc", InMemoryBackend())
    calls: list[str] = []

    @synchronized(mutex, "job", on_busy="raise")
    def job() -> None:
        calls.append("ran")

    held = mutex.acquire("job")
    assert held is not None
    with pytest.raises(LockBusyError) as caught:
        job()
    assert caught.value.key == "job"
    assert caught.value.timeout is None
    assert isinstance(caught.value, DMutexError)
    assert calls == []
    held.release()
    job()
    assert calls == ["ran"]


def test_wait_runs_once_another_thread_releases() -> None:
    mutex = DMutex("svc", InMemoryBackend())
    calls: list[str] = []

    @synchronized(mutex, "job", on_busy="wait", timeout=5.0, retry_delay=0.05)
    def job() -> str:
        calls.append("ran")
        return "done"

    held = mutex.acquire("job")
    assert held is not None
    releaser = threading.Timer(0.2, held.release)
    started = time.monotonic()
    releaser.start()
    try:
        assert job() == "done"
    finally:
        releaser.join()
    assert time.monotonic() - started >= 0.15  # it waited for the release
    assert calls == ["ran"]


def test_wait_raises_lock_busy_with_the_timeout_when_it_passes() -> None:
    # A ManualClock: the retry waits advance it instead of sleeping.
    mutex = DMutex("svc", InMemoryBackend(clock=ManualClock()))
    calls: list[str] = []

    @synchronized(mutex, "job", on_busy="wait", timeout=2.0, retry_delay=0.5)
    def job() -> None:
        calls.append("ran")

    assert mutex.acquire("job") is not None
    with pytest.raises(LockBusyError) as caught:
        job()
    assert (caught.value.key, caught.value.timeout) == ("job", 2.0)
    assert "after 2.0 s" in str(caught.value)
    assert calls == []


def test_computed_keys_exclude_only_calls_with_the_same_key() -> None:
    mutex = DMutex("svc", InMemoryBackend())
    keys: list[str] = []

    def user_key(user_id: int, note: str = "") -> str:
        return f"user:{user_id}"

    @synchronized(mutex, user_key, on_busy="raise")
    def touch(user_id: int, note: str = "") -> int:
        keys.extend(key for key in ("user:1", "user:2") if not free(mutex, key))
        return user_id

    held = mutex.acquire("user:1")
    assert held is not None
    assert touch(2, note="x") == 2  # another key: not excluded
    with pytest.raises(LockBusyError) as caught:
        touch(1)  # the same key: excluded
    assert caught.value.key == "user:1"
    held.release()
    assert touch(user_id=1) == 1
    # While each call ran, its own key was held, and for touch(2) also user:1 (the probe's).
    assert keys == ["user:1", "user:2", "user:1"]


def test_a_lambda_key_gets_the_call_s_arguments_including_self() -> None:
    mutex = DMutex("svc", InMemoryBackend())

    class Account:
        def __init__(self, number: str) -> None:
            self.number = number

        @synchronized(mutex, lambda self, amount: f"account:{self.number}", on_busy="raise")
        def deposit(self, amount: int) -> str:
            return "held" if not free(mutex, f"account:{self.number}") else "free"

    assert Account("7").deposit(10) == "held"
    held = mutex.acquire("account:7")
    assert held is not None
    with pytest.raises(LockBusyError, match="account:7"):
        Account("7").deposit(10)
    assert Account("8").deposit(10) == "held"


def test_the_function_s_exception_propagates_and_the_lock_is_released() -> None:
    mutex = DMutex("svc", InMemoryBackend())

    @synchronized(mutex, "job", on_busy="wait", timeout=1.0)
    def job() -> None:
        raise ValueError("the work failed")

    with pytest.raises(ValueError, match="the work failed"):
        job()
    assert free(mutex, "job")


def test_a_semaphore_of_two_admits_two_calls_and_refuses_a_third() -> None:
    sem = DSemaphore("svc", InMemoryBackend(), max_permits=2)
    entered: list[int] = []

    @synchronized(sem, "pool", on_busy="raise")
    def nest(depth: int) -> int:
        # Each level calls the next while it holds its own permit.
        entered.append(depth)
        return depth if depth == 1 else nest(depth - 1)

    assert nest(2) == 1  # two holders at once
    with pytest.raises(LockBusyError):
        nest(3)
    assert entered == [2, 1, 3, 2]  # the third level never ran
    assert free(sem, "pool")  # both permits given back
    a, b = sem.acquire("pool"), sem.acquire("pool")
    assert a is not None
    assert b is not None


def test_the_lease_is_renewed_while_a_function_outlives_its_ttl() -> None:
    mutex = DMutex("svc", InMemoryBackend())
    probes: list[bool] = []

    @synchronized(mutex, "long", on_busy="raise", ttl=0.5)
    def long_job() -> str:
        time.sleep(0.8)  # past the TTL: only renewal keeps it
        probes.append(free(mutex, "long"))
        time.sleep(0.2)
        return "finished"

    assert long_job() == "finished"
    assert probes == [False]
    assert free(mutex, "long")


def test_without_auto_renew_the_lease_expires_under_a_long_function() -> None:
    """The control for the renewal test: the same wait loses the lock without renewal."""
    mutex = DMutex("svc", InMemoryBackend())
    probes: list[bool] = []

    @synchronized(mutex, "long", on_busy="raise", ttl=0.2, auto_renew=False)
    def long_job() -> str:
        time.sleep(0.4)
        probes.append(free(mutex, "long"))
        return "finished"

    assert long_job() == "finished"  # no renewal, no loss reported
    assert probes == [True]


def test_a_lease_lost_while_a_function_ran_raises_lease_lost_after_it() -> None:
    backend = InMemoryBackend()
    mutex = DMutex("svc", backend)
    done: list[str] = []

    @synchronized(mutex, "job", on_busy="raise")
    def job() -> str:
        backend.force_expire("job")
        done.append("ran")
        return "value"

    with pytest.raises(LeaseLostError) as caught:
        job()
    assert caught.value.key == "job"
    assert done == ["ran"]  # a thread is not interrupted: the work was done


# Coroutine functions


def test_async_modes_and_computed_keys() -> None:
    backend = InMemoryBackend()
    mutex = AsyncDMutex("svc", backend)
    probe = DMutex("svc", backend)  # the same locks, seen from the sync face
    calls: list[int] = []

    @synchronized(mutex, lambda n: f"n:{n}", on_busy="raise")
    async def raising(n: int) -> int:
        calls.append(n)
        return 0 if free(probe, f"n:{n}") else n

    @synchronized(mutex, lambda n: f"n:{n}", on_busy="skip", default="busy")
    async def skipping(n: int) -> int:
        calls.append(n)
        return n

    async def main() -> None:
        assert await raising(1) == 1  # ran holding n:1
        held = await mutex.acquire("n:1")
        assert held is not None
        with pytest.raises(LockBusyError) as caught:
            await raising(1)
        assert caught.value.key == "n:1"
        result: int | str = await skipping(1)
        assert result == "busy"
        assert await raising(2) == 2  # another key
        await held.release()

    asyncio.run(main())
    assert calls == [1, 2]
    assert free(probe, "n:1")


def test_async_wait_runs_once_another_task_releases_and_times_out_otherwise() -> None:
    mutex = AsyncDMutex("svc", InMemoryBackend())
    calls: list[str] = []

    @synchronized(mutex, "job", on_busy="wait", timeout=2.0, retry_delay=0.05)
    async def job() -> str:
        calls.append("ran")
        return "done"

    @synchronized(mutex, "job", on_busy="wait", timeout=0.1, retry_delay=0.02)
    async def impatient() -> str:
        calls.append("impatient ran")
        return "done"

    async def main() -> None:
        held = await mutex.acquire("job")
        assert held is not None
        with pytest.raises(LockBusyError) as caught:
            await impatient()
        assert caught.value.timeout == 0.1

        async def release_later() -> None:
            await asyncio.sleep(0.15)
            await held.release()

        started = time.monotonic()
        releasing = asyncio.create_task(release_later())
        assert await job() == "done"
        assert time.monotonic() - started >= 0.1
        await releasing

    asyncio.run(main())
    assert calls == ["ran"]


def test_async_exception_propagates_and_the_lock_is_released() -> None:
    backend = InMemoryBackend()
    mutex = AsyncDMutex("svc", backend)

    @synchronized(mutex, "job", on_busy="raise")
    async def job() -> None:
        raise KeyError("missing")

    with pytest.raises(KeyError, match="missing"):
        asyncio.run(job())
    assert free(DMutex("svc", backend), "job")


def test_an_async_semaphore_of_two_admits_two_concurrent_calls_and_skips_a_third() -> None:
    sem = AsyncDSemaphore("svc", InMemoryBackend(), max_permits=2)
    inside: list[int] = []

    async def main() -> list[str]:
        gate = asyncio.Event()

        @synchronized(sem, "pool", on_busy="skip", default="skipped")
        async def work(n: int) -> str:
            inside.append(n)
            await gate.wait()
            return f"done {n}"

        first = asyncio.create_task(work(1))
        second = asyncio.create_task(work(2))
        while len(inside) < 2:  # both hold a permit and wait at the gate
            await asyncio.sleep(0.01)
        third: str = await work(3)  # refused while two are inside
        gate.set()
        return [await first, await second, third]

    assert asyncio.run(main()) == ["done 1", "done 2", "skipped"]
    assert inside == [1, 2]


def test_an_async_lease_is_renewed_while_a_coroutine_outlives_its_ttl() -> None:
    backend = InMemoryBackend()
    mutex = AsyncDMutex("svc", backend)
    probe = DMutex("svc", backend)
    probes: list[bool] = []

    @synchronized(mutex, "long", on_busy="raise", ttl=0.5)
    async def long_job() -> str:
        await asyncio.sleep(0.8)  # past the TTL: only renewal keeps it
        probes.append(free(probe, "long"))
        await asyncio.sleep(0.1)
        return "finished"

    assert asyncio.run(long_job()) == "finished"
    assert probes == [False]
    assert free(probe, "long")


def test_an_async_lease_lost_meanwhile_cancels_the_coroutine() -> None:
    backend = InMemoryBackend()
    mutex = AsyncDMutex("svc", backend)
    events: list[str] = []

    @synchronized(mutex, "job", on_busy="raise", ttl=0.3)
    async def job() -> str:
        backend.force_expire("job")
        try:
            await asyncio.sleep(5)  # the renewal, due at 0.1 s, finds the lease gone
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        return "never"

    started = time.monotonic()
    with pytest.raises(LeaseLostError):
        asyncio.run(job())
    assert time.monotonic() - started < 2
    assert events == ["cancelled"]


# The wrapper and bad input


def test_the_wrapper_keeps_the_function_s_name_doc_and_kind() -> None:
    mutex, amutex = DMutex("svc", InMemoryBackend()), AsyncDMutex("svc", InMemoryBackend())

    @synchronized(mutex, "k", on_busy="raise")
    def plain(x: int) -> int:
        """Plain's doc."""
        return x

    @synchronized(amutex, "k", on_busy="raise")
    async def coro(x: int) -> int:
        """Coro's doc."""
        return x

    assert (plain.__name__, plain.__doc__) == ("plain", "Plain's doc.")
    assert (coro.__name__, coro.__doc__) == ("coro", "Coro's doc.")
    assert not inspect.iscoroutinefunction(plain)
    assert inspect.iscoroutinefunction(coro)
    assert list(inspect.signature(plain).parameters) == ["x"]


def test_a_lock_of_the_wrong_face_is_refused_when_the_function_is_decorated() -> None:
    backend = InMemoryBackend()
    on_sync = synchronized(DMutex("svc", backend), "k", on_busy="raise")
    on_async: Any = synchronized(AsyncDMutex("svc", backend), "k", on_busy="raise")

    async def coro() -> None:
        pass

    def plain() -> None:
        pass

    def generator() -> Any:
        yield 1

    with pytest.raises(ArgumentTypeError, match="AsyncDMutex"):
        on_sync(coro)
    with pytest.raises(ArgumentTypeError, match="use the sync DMutex"):
        on_async(plain)
    with pytest.raises(ArgumentTypeError, match="generator function"):
        on_sync(generator)
    with pytest.raises(ArgumentTypeError, match="DReadWriteLock"):
        synchronized(DReadWriteLock("svc", backend), "k", on_busy="raise")  # type: ignore[call-overload]  # no such overload: the point
    assert free(DMutex("svc", backend), "k")


BAD_OPTIONS: list[tuple[str, dict[str, Any], type[Exception]]] = [
    ("unknown on_busy", {"on_busy": "sometimes"}, InvalidArgumentError),
    ("on_busy None", {"on_busy": None}, InvalidArgumentError),
    ("ttl 0", {"on_busy": "raise", "ttl": 0}, InvalidArgumentError),
    ("ttl negative", {"on_busy": "raise", "ttl": -1.0}, InvalidArgumentError),
    ("ttl a str", {"on_busy": "raise", "ttl": "5"}, ArgumentTypeError),
    ("ttl nan", {"on_busy": "skip", "ttl": float("nan")}, InvalidArgumentError),
    ("timeout negative", {"on_busy": "wait", "timeout": -1}, InvalidArgumentError),
    ("timeout a bool", {"on_busy": "wait", "timeout": True}, ArgumentTypeError),
    ("retry_delay 0", {"on_busy": "wait", "retry_delay": 0}, InvalidArgumentError),
    ("auto_renew 1", {"on_busy": "raise", "auto_renew": 1}, ArgumentTypeError),
    ("timeout with raise", {"on_busy": "raise", "timeout": 5}, InvalidArgumentError),
    ("retry_delay with skip", {"on_busy": "skip", "retry_delay": 1}, InvalidArgumentError),
    ("default with raise", {"on_busy": "raise", "default": 0}, InvalidArgumentError),
    ("default with wait", {"on_busy": "wait", "default": None}, InvalidArgumentError),
]


@pytest.mark.parametrize(
    ("options", "error"),
    [(options, error) for _, options, error in BAD_OPTIONS],
    ids=[name for name, _, _ in BAD_OPTIONS],
)
def test_bad_options_raise_before_any_request(
    options: dict[str, Any], error: type[Exception]
) -> None:
    mutex, client = recorded()
    decorate: Any = synchronized
    with pytest.raises(error):
        decorate(mutex, "k", **options)
    assert client.calls == []


@pytest.mark.parametrize(
    ("key", "error"),
    [("", InvalidArgumentError), ("x" * 501, InvalidArgumentError), (5, ArgumentTypeError)],
    ids=["empty", "too long", "an int"],
)
def test_a_bad_fixed_key_raises_when_the_decorator_is_made(
    key: object, error: type[Exception]
) -> None:
    mutex, client = recorded()
    decorate: Any = synchronized
    with pytest.raises(error):
        decorate(mutex, key, on_busy="raise")
    assert client.calls == []


def test_on_busy_has_no_default() -> None:
    decorate: Any = synchronized
    with pytest.raises(TypeError, match="on_busy"):
        decorate(DMutex("svc", InMemoryBackend()), "k")


def test_a_key_function_s_bad_result_raises_before_any_request() -> None:
    mutex, client = recorded()
    calls: list[int] = []
    not_a_str: Any = lambda n: n  # noqa: E731 - a key function that breaks its contract

    @synchronized(mutex, not_a_str, on_busy="raise")
    def job(n: int) -> None:
        calls.append(n)

    @synchronized(mutex, lambda n: "", on_busy="raise")
    def empty(n: int) -> None:
        calls.append(n)

    with pytest.raises(ArgumentTypeError, match="must return a str, not int"):
        job(1)
    with pytest.raises(InvalidArgumentError, match="key must not be empty"):
        empty(1)
    assert calls == []
    assert client.calls == []


def test_an_async_key_function_s_bad_result_raises_before_any_request() -> None:
    client = AsyncAnsweringRedis()
    shape: Any = client
    calls: list[int] = []
    not_a_str: Any = lambda n: [n]  # noqa: E731 - a key function that breaks its contract

    @synchronized(AsyncDMutex("svc", shape), not_a_str, on_busy="wait")
    async def job(n: int) -> None:
        calls.append(n)

    with pytest.raises(ArgumentTypeError, match="not list"):
        asyncio.run(job(1))
    assert calls == []
    assert client.calls == []


def test_lock_busy_pickles_with_its_key_and_timeout() -> None:
    error = pickle.loads(pickle.dumps(LockBusyError("job", 2.5)))
    assert isinstance(error, LockBusyError)
    assert (error.key, error.timeout, str(error)) == (
        "job",
        2.5,
        "the lock 'job' was still held by others after 2.5 s",
    )

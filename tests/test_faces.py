"""The sync and asyncio faces stay in step, and each face's own syntax works."""

from __future__ import annotations

import asyncio
import inspect
from datetime import timedelta
from typing import Any

import pytest

import dmutex
from dmutex import (
    AsyncDElection,
    AsyncDMutex,
    AsyncDMutexLock,
    AsyncDReadLock,
    AsyncDReadWriteLock,
    AsyncDSemaphore,
    AsyncDSemaphorePermit,
    AsyncDWriteLock,
    AsyncLeadership,
    DElection,
    DMutex,
    DMutexLock,
    DReadLock,
    DReadWriteLock,
    DSemaphore,
    DSemaphorePermit,
    DWriteLock,
    InMemoryBackend,
    Leadership,
    ManualClock,
)

PAIRS: list[tuple[type[Any], type[Any]]] = [
    (DMutex, AsyncDMutex),
    (DSemaphore, AsyncDSemaphore),
    (DMutexLock, AsyncDMutexLock),
    (DSemaphorePermit, AsyncDSemaphorePermit),
    (DReadWriteLock, AsyncDReadWriteLock),
    (DReadLock, AsyncDReadLock),
    (DWriteLock, AsyncDWriteLock),
    (DElection, AsyncDElection),
    (Leadership, AsyncLeadership),
]


def public_members(cls: type[Any]) -> dict[str, Any]:
    return {
        name: inspect.getattr_static(cls, name)
        for name in dir(cls)
        if not name.startswith("_") or name == "__init__"
    }


def _same_shape(annotation: object) -> object:
    """An async callback returns Awaitable[T] where a sync one returns T.

    And the asyncio handles are named as the sync ones with ``Async`` before,
    as is an asyncio iterator (an election's ``observe``).
    """
    if not isinstance(annotation, str):
        return annotation
    for asynchronous in ("Awaitable[T]", "AsyncD", "AsyncLeadership", "AsyncIterator"):
        annotation = annotation.replace(asynchronous, asynchronous.removeprefix("Async"))
    return annotation.replace("Awaitable[T]", "T")


def parameters(function: Any) -> list[tuple[str, Any, Any, Any]]:
    signature = inspect.signature(function)
    shape = [
        (p.name, p.kind, p.default, _same_shape(p.annotation))
        for p in signature.parameters.values()
    ]
    return [*shape, ("return", None, None, _same_shape(signature.return_annotation))]


SYNC_ONLY = {"__enter__": "__aenter__", "__exit__": "__aexit__"}
# Methods that never wait, so are plain functions on the async face too.
PLAIN_ON_BOTH = {"__init__", "on_lost", "raise_if_lost"}


@pytest.mark.parametrize(("sync", "async_"), PAIRS)
def test_same_methods_with_same_parameters(sync: type[Any], async_: type[Any]) -> None:
    sync_members, async_members = public_members(sync), public_members(async_)
    assert sorted(sync_members) == sorted(async_members), "method sets differ"
    for name, member in sync_members.items():
        other = async_members[name]
        if isinstance(member, property):
            assert isinstance(other, property), name
            continue
        assert parameters(member) == parameters(other), name
        if name in PLAIN_ON_BOTH:
            assert not inspect.iscoroutinefunction(other), f"{async_.__name__}.{name} is async"
            continue
        assert not inspect.iscoroutinefunction(member), f"{sync.__name__}.{name} is async"
        if inspect.isgeneratorfunction(member):  # an iterator: an asyncio iterator there
            assert inspect.isasyncgenfunction(other), f"{async_.__name__}.{name}: no async iterator"
            continue
        assert inspect.iscoroutinefunction(other), f"{async_.__name__}.{name} is not async"
    for sync_name, async_name in SYNC_ONLY.items():
        if hasattr(sync, sync_name):
            assert inspect.iscoroutinefunction(getattr(async_, async_name)), async_name


# Issue 11's names: renewal, loss and fencing.
# Issue 21's: the deadline by which the holder counts the lease lost.
LIFECYCLE = ("fence", "auto_renew", "lost", "raise_if_lost", "on_lost", "wait_lost", "time_left")
# Issue 41's: who holds a key (holders), and the election with its leadership handle.
COMMON = ("ready", "acquire", "acquire_with_retry", "run", "run_with_retry", "extend", "holders")
ELECTION = ("mutex", "campaign", "leader", "observe", "run")
LEADERSHIP = (
    "name", "term", "identity", "since", "until", "lost", "time_left", "raise_if_lost",
    "resign", "wait_lost", "on_lost",
)  # fmt: skip
# Issue 28's: each of the mutex's acquiring methods per side, release and extend by token.
READ_WRITE = (
    "ready", "release", "extend",
    *(f"{verb}_{side}{retry}" for verb in ("acquire", "run") for side in ("read", "write")
      for retry in ("", "_with_retry")),
)  # fmt: skip
SPEC_NAMES: dict[type[Any], tuple[str, ...]] = {
    DMutex: (*COMMON, "lock", "unlock"),
    AsyncDMutex: (*COMMON, "lock", "unlock"),
    DSemaphore: (*COMMON, "release"),
    AsyncDSemaphore: (*COMMON, "release"),
    DMutexLock: ("key", "token", "expired_at", "release", "extend", *LIFECYCLE),
    AsyncDMutexLock: ("key", "token", "expired_at", "release", "extend", *LIFECYCLE),
    DSemaphorePermit: ("key", "token", "expired_at", "slot", "release", "extend", *LIFECYCLE),
    AsyncDSemaphorePermit: (
        "key", "token", "expired_at", "slot", "release", "extend", *LIFECYCLE,
    ),
    DReadWriteLock: READ_WRITE,
    AsyncDReadWriteLock: READ_WRITE,
    DReadLock: ("key", "token", "expired_at", "release", "extend", *LIFECYCLE),
    AsyncDReadLock: ("key", "token", "expired_at", "release", "extend", *LIFECYCLE),
    DWriteLock: ("key", "token", "expired_at", "release", "extend", *LIFECYCLE),
    AsyncDWriteLock: ("key", "token", "expired_at", "release", "extend", *LIFECYCLE),
    DElection: ELECTION,
    AsyncDElection: ELECTION,
    Leadership: LEADERSHIP,
    AsyncLeadership: LEADERSHIP,
}  # fmt: skip


@pytest.mark.parametrize("cls", SPEC_NAMES, ids=lambda cls: cls.__name__)
def test_spec_names_exist(cls: type[Any]) -> None:
    """Section 1 of the contract, name by name, and nothing public beyond it."""
    public = {name for name in dir(cls) if not name.startswith("_")}
    assert public == set(SPEC_NAMES[cls])


def test_documented_defaults() -> None:
    for cls in (DMutex, AsyncDMutex, DSemaphore, AsyncDSemaphore):
        init = inspect.signature(cls.__init__).parameters
        assert init["default_ttl_seconds"].default == 300
        assert init["backend"].default is None
        assert init["db_name"].default == "dmutex"
        assert init["collection_name"].default is None
        assert init["key_prefix"].default is None
        retry = inspect.signature(cls.acquire_with_retry).parameters
        assert retry["timeout"].default == 30.0
        assert retry["retry_delay"].default == 0.1
        assert inspect.signature(cls.acquire).parameters["ttl"].default is None
    assert inspect.signature(DMutex.__init__).parameters["collection_prefix"].default == "_dmutex_"
    semaphore_init = inspect.signature(DSemaphore.__init__).parameters
    assert semaphore_init["collection_prefix"].default == "_dsemaphore_"
    assert semaphore_init["max_permits"].default is inspect.Parameter.empty


def test_every_public_name_is_exported_and_documented() -> None:
    for name in dmutex.__all__:
        value = getattr(dmutex, name)
        if not inspect.isclass(value):  # type aliases carry no runtime docstring
            continue
        assert inspect.getdoc(value), f"{name} has no docstring"
        if inspect.isclass(value):
            for member, attr in vars(value).items():
                if not member.startswith("_") and (callable(attr) or isinstance(attr, property)):
                    assert inspect.getdoc(attr), f"{name}.{member} has no docstring"


def test_with_releases_the_sync_handle() -> None:
    backend = InMemoryBackend()
    mutex = DMutex("svc", backend)
    lock = mutex.acquire("k")
    assert lock is not None
    with lock as entered:
        assert entered is lock
        assert mutex.acquire("k") is None
    assert backend.snapshot() == {}
    sem = DSemaphore("svc", backend, max_permits=2)
    permit = sem.acquire("k")
    assert permit is not None
    with pytest.raises(ZeroDivisionError), permit:
        _ = 1 / 0
    assert backend.snapshot() == {}


def test_async_with_releases_the_async_handle() -> None:
    backend = InMemoryBackend()

    async def main() -> None:
        mutex = AsyncDMutex("svc", backend)
        lock = await mutex.acquire("k")
        assert lock is not None
        async with lock as entered:
            assert entered is lock
            assert await mutex.acquire("k") is None
        assert backend.snapshot() == {}

    asyncio.run(main())


def test_run_callback_extends_its_own_lease() -> None:
    clock = ManualClock()
    sync = DSemaphore("svc", InMemoryBackend(clock=clock), max_permits=3)

    def work(permit: DSemaphorePermit) -> bool:
        clock.advance(50)
        return permit.extend(120) and permit.expired_at == clock.now() + timedelta(seconds=120)

    assert sync.run("api", work, 60) is True

    async def main() -> bool:
        sem = AsyncDSemaphore("svc", InMemoryBackend(clock=clock), max_permits=3)

        async def awork(permit: AsyncDSemaphorePermit) -> bool:
            clock.advance(50)
            ok = await permit.extend(120)
            return ok and permit.expired_at == clock.now() + timedelta(seconds=120)

        return await sem.run("api", awork, 60) is True

    assert asyncio.run(main())


def test_sync_and_async_instances_share_one_backend() -> None:
    backend = InMemoryBackend()
    lock = DMutex("svc", backend).acquire("k")
    assert lock is not None

    async def main() -> None:
        mutex = AsyncDMutex("svc", backend)
        assert await mutex.acquire("k") is None
        assert await mutex.extend("k", lock.token, 10) is True

    asyncio.run(main())


def test_handle_repr_names_key_and_expiry() -> None:
    lock = DMutex("svc", InMemoryBackend(clock=ManualClock())).acquire("job", ttl=60)
    assert repr(lock).startswith("<DMutexLock key='job' token=")
    assert "expired_at=2026-01-01T00:01:00+00:00" in repr(lock)

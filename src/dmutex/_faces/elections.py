"""Leader election over any backend: DElection and AsyncDElection, and their leadership handles.

Rules of this module:

1. An election is a mutex of the same names with fencing on
   (``dmutex._core.terms``): what one campaigns for is the mutex's key, and
   a mutex of the same service and key excludes it, and is excluded by it,
   as any mutex would (a TypeScript service's too).
2. Leadership is a renewed lease. The leader counts it lost by its own
   deadline (``renewal.py``), never by a reply: the handle's ``lost``,
   ``wait_lost`` and ``on_lost`` are the mutex handle's.
3. ``run`` stops the work when leadership is lost: asyncio cancels its task;
   a thread cannot be stopped, so it is told through the handle
   (``leadership.lost``, ``raise_if_lost``) and ``run`` raises
   :class:`~dmutex.LeaseLostError` when it returns. With ``again=True`` it
   campaigns again instead, after a loss or a return, until the work raises
   (or, asyncio, the task running ``run`` is cancelled).
4. Every argument is checked before any request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Generic, TypeVar, cast

from .._backends.clients import AsyncClient, SyncClient
from .._clock import Clock
from .._core.abc import sleep
from .._core.effects import Steps
from .._core.engine import Engine
from .._core.lease import expiry_datetime
from .._core.observe import Observer
from .._core.stamps import read_stamp
from .._core.terms import (
    CAMPAIGN_SLICE,
    QUIET,
    STALE_READS,
    Leader,
    changed,
    leader_of,
    stale,
)
from .._errors import InvalidArgumentError, LeaseLostError
from .._validate import BackendName, check_callback, check_key, check_retry_delay, check_timeout
from .aio import AsyncDMutex, AsyncDMutexLock
from .sync import DMutex, DMutexLock

__all__ = ["AsyncDElection", "AsyncLeadership", "DElection", "Leader", "Leadership"]

T = TypeVar("T")
L = TypeVar("L", DMutexLock, AsyncDMutexLock)
M = TypeVar("M", DMutex, AsyncDMutex)
C = TypeVar("C", SyncClient, AsyncClient)


class _LeadershipBase(Generic[L]):
    """What both faces' leadership handles show: the name, term, holder and lease."""

    __slots__ = ("_lock",)
    _lock: L

    def __init__(self, lock: L) -> None:
        self._lock = lock

    @property
    def name(self) -> str:
        """The name this process leads."""
        return self._lock.key

    @property
    def term(self) -> int:
        """The term of this leadership: greater than every earlier leader's of the name."""
        fence = self._lock.fence
        assert fence is not None  # an election's mutex fences every grant (rule 1)
        return fence

    @property
    def identity(self) -> str | None:
        """Who this process says it is, as other processes read it (``identity=``)."""
        return read_stamp(self._lock.token).identity

    @property
    def since(self) -> datetime | None:
        """When the slice of the campaign that won began, as others read it; None unstamped."""
        since_ms = read_stamp(self._lock.token).since_ms
        return None if since_ms is None else expiry_datetime(since_ms)

    @property
    def until(self) -> datetime:
        """When the lease ends unless renewed (it is renewed while this process leads)."""
        return self._lock.expired_at

    @property
    def lost(self) -> bool:
        """True once leadership is known lost, by this process's own deadline (rule 2)."""
        return self._lock.lost

    @property
    def time_left(self) -> float:
        """Seconds until this process must count leadership lost, by its own clock."""
        return self._lock.time_left

    def raise_if_lost(self) -> None:
        """Raise :class:`~dmutex.LeaseLostError` if leadership is lost: call it between steps."""
        self._lock.raise_if_lost()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} term={self.term} lost={self.lost}>"


class Leadership(_LeadershipBase[DMutexLock]):
    """A name this process leads: a renewed lease, until ``resign()`` or its loss.

    ``with leadership:`` resigns on exit. The term only grows from leader to
    leader; pass it as the fence of every write that only the leader may make.
    """

    __slots__ = ()

    def resign(self) -> bool:
        """Stop leading now, so that another campaign wins at once; False if already lost."""
        return self._lock.release()

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block until leadership is lost or resigned, or ``timeout`` seconds pass; :attr:`lost`."""
        return self._lock.wait_lost(timeout)

    def on_lost(self, callback: Callable[[Leadership], object]) -> None:
        """Call ``callback(leadership)`` once when leadership is found lost (at once if it is)."""
        check_callback(callback)
        self._lock.on_lost(lambda _lock: callback(self))

    def __enter__(self) -> Leadership:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.resign()


class AsyncLeadership(_LeadershipBase[AsyncDMutexLock]):
    """The asyncio :class:`Leadership`; ``async with leadership:`` resigns on exit."""

    __slots__ = ()

    async def resign(self) -> bool:
        """Stop leading now; see :meth:`Leadership.resign`."""
        return await self._lock.release()

    async def wait_lost(self, timeout: float | None = None) -> bool:
        """Wait until leadership is lost or resigned, or ``timeout`` seconds pass; :attr:`lost`."""
        return await self._lock.wait_lost(timeout)

    def on_lost(self, callback: Callable[[AsyncLeadership], object]) -> None:
        """Call ``callback(leadership)`` on the event loop once leadership is found lost."""
        check_callback(callback)
        self._lock.on_lost(lambda _lock: callback(self))

    async def __aenter__(self) -> AsyncLeadership:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.resign()


class _ElectionBase(Generic[M, C]):
    """The construction both faces share: a fencing mutex of the same options."""

    _MUTEX: type[M]

    def __init__(
        self,
        service_name: str,
        client: C,
        *,
        ttl: float = 15.0,
        identity: str | None = None,
        backend: BackendName | None = None,
        db_name: str = "dmutex",
        collection_name: str | None = None,
        collection_prefix: str = "_dmutex_",
        key_prefix: str | None = None,
        clock: Clock | None = None,
        table_name: str | None = None,
        table_prefix: str = "_dmutex_",
        schema_name: str | None = None,
        database_name: str | None = None,
        replicas: int = 0,
        replicas_timeout: float = 1.0,
        observers: Sequence[Observer] = (),
    ) -> None:
        """Make an election for ``service_name``'s names, over ``client``.

        ``ttl``: the leader's lease, renewed every third of it while it
        leads; a leader that dies is replaced within about ``ttl`` seconds
        (the Election page gives measured figures). ``identity``: who this
        process is to others (None: ``host:pid``). The other options name
        the storage as :class:`DMutex`'s do: the election's names are keys
        of that mutex (rule 1), whose fencing is always on (MongoDB: one
        more request per grant; a Redis Cluster key needs a hash tag).
        """
        mutex = self._MUTEX(
            service_name,
            client,  # type: ignore[arg-type]  # M's client is C: a TypeVar cannot say so
            default_ttl_seconds=ttl,
            identity=identity,
            backend=backend,
            db_name=db_name,
            collection_name=collection_name,
            collection_prefix=collection_prefix,
            key_prefix=key_prefix,
            clock=clock,
            fencing=True,
            table_name=table_name,
            table_prefix=table_prefix,
            schema_name=schema_name,
            database_name=database_name,
            replicas=replicas,
            replicas_timeout=replicas_timeout,
            observers=observers,
        )
        self._mutex: M = mutex

    @property
    def mutex(self) -> M:
        """The mutex the election campaigns with: its names are this election's."""
        return self._mutex


def _checked(name: object, timeout: object, retry_delay: object) -> tuple[str, float | None, float]:
    """A campaign's arguments, checked before any request (rule 4)."""
    key = check_key(name)
    seconds = None if timeout is None else check_timeout(timeout)
    return key, seconds, check_retry_delay(retry_delay)


def _slices(timeout: float | None, monotonic: Callable[[], float]) -> Iterator[float]:
    """A campaign's slices (terms rule 4): forever, or until ``timeout`` seconds are spent."""
    if timeout is None:
        while True:
            yield CAMPAIGN_SLICE
    deadline = monotonic() + timeout
    while True:
        left = deadline - monotonic()
        yield max(0.0, min(CAMPAIGN_SLICE, left))
        if left <= CAMPAIGN_SLICE:
            return


@dataclass(slots=True)
class _Following:
    """One observer's memory between two changes it showed (terms rules 3, 5 and 6)."""

    last: Leader | None = None
    first: bool = True
    woken: bool = False


def _next_change(
    engine: Engine, key: str, poll: float, following: _Following
) -> Steps[Leader | None]:
    """The next leader an observer shows: waits, reads, and reads again, until a change.

    Written once for both faces: each drives it and yields what it answers.
    The wait after a change shown comes first, when the next change is asked for.
    """
    if not following.first:
        following.woken = yield from _between_reads(engine, key, following.last, poll, False)
    rereads = 0
    while True:
        now = leader_of(key, (yield from engine.holders(key)))
        if stale(following.last, now) and rereads < STALE_READS:  # terms rule 6
            rereads += 1
            yield from sleep(QUIET)
            continue
        rereads = 0
        if following.first or changed(following.last, now):
            following.first, following.last = False, now
            return now
        following.woken = yield from _between_reads(engine, key, now, poll, following.woken)


def _between_reads(
    engine: Engine, key: str, leader: Leader | None, poll: float, quiet: bool
) -> Steps[bool]:
    """An observer's wait for its next read (terms rule 5).

    While someone leads, a watch that a release ends early where the store
    tells one; while nobody does, the poll interval (no store tells a grant).
    ``quiet``: the last wait was woken and the read after it showed no
    change; this one pauses :data:`QUIET` first, so that wakes that change
    nothing cannot make it spin. Answers whether a release woke it.
    """
    if leader is None:
        yield from sleep(poll)
        return False
    if quiet:
        yield from sleep(min(QUIET, poll))
    return (yield from engine.watch(key, poll))


def _check_poll(poll: object) -> float:
    """``observe``'s poll interval: seconds, more than none."""
    seconds = check_timeout(poll)
    if seconds <= 0:
        raise InvalidArgumentError(f"poll must be > 0, not {poll!r}")
    return seconds


class DElection(_ElectionBase[DMutex, SyncClient]):
    """Leader election: at most one leader per name at a time, each with a greater term.

    Campaign for a name to lead it (:meth:`campaign`, :meth:`run`), ask who
    leads (:meth:`leader`), follow the changes (:meth:`observe`). Works on
    every backend a :class:`DMutex` does, with the same client.

    Guarantee: two processes never both hold a name's lease at once, and
    each counts its leadership lost by its own deadline before another can
    be granted it (the "Guarantees and limits" page states the clock
    assumptions). Caveat: work that outlives the deadline (a paused process)
    can still act late; fence its writes with :attr:`Leadership.term`.
    """

    _MUTEX = DMutex

    def campaign(
        self, name: str, *, timeout: float | None = None, retry_delay: float = 0.1
    ) -> Leadership | None:
        """Wait until this process leads ``name``, then lead it as a renewed lease.

        Tries every ``retry_delay`` seconds (sooner where the backend wakes
        waiters on a release) for ``timeout`` seconds (None: until it
        leads). Returns the leadership, or None when the timeout passed.
        """
        key, timeout, retry_delay = _checked(name, timeout, retry_delay)
        mutex = self._mutex
        for piece in _slices(timeout, mutex._engine.clock.monotonic):
            lock = mutex.acquire_with_retry(
                key, timeout=piece, retry_delay=retry_delay, auto_renew=True
            )
            if lock is not None:
                return Leadership(lock)
        return None

    def leader(self, name: str) -> Leader | None:
        """Who leads ``name`` now, read from storage by any process; None: nobody.

        One read. On MongoDB a read that falls between a grant's two
        requests shows the new leader with its predecessor's term
        (:meth:`observe` reads again then); a holder that keeps no fence
        shows the last fenced grant's term.
        """
        key = check_key(name)
        return leader_of(key, self._mutex._drive(self._mutex._engine.holders(key)))

    def observe(self, name: str, *, poll: float = 1.0) -> Iterator[Leader | None]:
        """Who leads ``name``, then each change of leader (a new one, or nobody), forever.

        A change is seen within ``poll`` seconds and a read; a resignation
        sooner where the store tells observers of a release (in memory,
        PostgreSQL through a psycopg pool or asyncpg, etcd): its wait ends
        then. A renewal is no change; two changes within one wait are seen
        as the last of them. The terms it shows only grow: a read that
        finds a new leader with a term not above the last one shown is made
        again (MongoDB's grant moves the fence in a second request), unless
        the holder keeps no fence (a TypeScript service on the name).
        Redis, MongoDB, MySQL and SQLite poll (Redis's release signal wakes
        one waiter, which an observer must not take).
        """
        key, seconds = check_key(name), _check_poll(poll)
        drive, engine = self._mutex._drive, self._mutex._engine
        following = _Following()
        while True:
            yield drive(_next_change(engine, key, seconds, following))

    def run(
        self,
        name: str,
        work: Callable[[Leadership], T],
        *,
        again: bool = False,
        retry_delay: float = 0.1,
    ) -> T:
        """Campaign for ``name``, then call ``work(leadership)`` while leading; resign after.

        A thread cannot be stopped: when leadership is lost, ``work`` is
        told through the handle (``leadership.lost``, ``raise_if_lost()``),
        and once it returns ``run`` raises :class:`~dmutex.LeaseLostError`.
        ``again=True``: campaign again after a loss or a return, until
        ``work`` raises (its exception propagates after the resignation).
        """
        key, _, retry_delay = _checked(name, None, retry_delay)
        check_callback(work)
        while True:
            leadership = self.campaign(key, retry_delay=retry_delay)
            assert leadership is not None  # no timeout: it campaigns until it leads
            with leadership:
                result = work(leadership)
            if not again:
                leadership.raise_if_lost()
                return result


class AsyncDElection(_ElectionBase[AsyncDMutex, AsyncClient]):
    """The asyncio :class:`DElection`: same semantics, coroutine methods.

    ``run`` cancels the work's task when leadership is lost.
    """

    _MUTEX = AsyncDMutex

    async def campaign(
        self, name: str, *, timeout: float | None = None, retry_delay: float = 0.1
    ) -> AsyncLeadership | None:
        """Wait until this process leads ``name``; see :meth:`DElection.campaign`."""
        key, timeout, retry_delay = _checked(name, timeout, retry_delay)
        mutex = self._mutex
        for piece in _slices(timeout, mutex._engine.clock.monotonic):
            lock = await mutex.acquire_with_retry(
                key, timeout=piece, retry_delay=retry_delay, auto_renew=True
            )
            if lock is not None:
                return AsyncLeadership(lock)
        return None

    async def leader(self, name: str) -> Leader | None:
        """Who leads ``name`` now; see :meth:`DElection.leader`."""
        key = check_key(name)
        return leader_of(key, await self._mutex._drive(self._mutex._engine.holders(key)))

    async def observe(self, name: str, *, poll: float = 1.0) -> AsyncIterator[Leader | None]:
        """Who leads ``name``, then each change; see :meth:`DElection.observe`."""
        key, seconds = check_key(name), _check_poll(poll)
        drive, engine = self._mutex._drive, self._mutex._engine
        following = _Following()
        while True:
            yield await drive(_next_change(engine, key, seconds, following))

    async def run(
        self,
        name: str,
        work: Callable[[AsyncLeadership], Awaitable[T]],
        *,
        again: bool = False,
        retry_delay: float = 0.1,
    ) -> T:
        """Campaign for ``name``, then await ``work(leadership)`` while leading; resign after.

        ``work`` runs as a task of its own, cancelled when leadership is
        lost; ``run`` then raises :class:`~dmutex.LeaseLostError` (after the
        task ended), or with ``again=True`` campaigns again, as it does
        after a return, until ``work`` raises.
        """
        key, _, retry_delay = _checked(name, None, retry_delay)
        check_callback(work)
        while True:
            leadership = await self.campaign(key, retry_delay=retry_delay)
            assert leadership is not None  # no timeout: it campaigns until it leads
            async with leadership:
                lost, result = await _while_leading(leadership, work)
            if not again:
                if lost:
                    raise LeaseLostError(leadership.name, leadership._lock.token)
                return cast("T", result)


async def _while_leading(
    leadership: AsyncLeadership, work: Callable[[AsyncLeadership], Awaitable[T]]
) -> tuple[bool, T | None]:
    """Await ``work`` as a task, cancelled if leadership is lost first: (lost, its result).

    The work's own exception propagates; its cancellation by a loss does not.
    """
    task = asyncio.ensure_future(work(leadership))
    watch = asyncio.ensure_future(leadership.wait_lost())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    try:
        result = await task
    except asyncio.CancelledError:
        if task.cancelled() and leadership.lost:
            return True, None
        raise
    return leadership.lost, result

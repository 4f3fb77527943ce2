"""The lock algorithms, written once for both faces and every backend.

Rules of this module:

1. Every decision about a lease lives here or in a store: the faces only
   validate nothing, decide nothing and drive what this module returns.
2. Nothing here does I/O, sleeps or waits: each operation returns a generator
   of effects (``effects.py``) that a driver carries out.
3. Bad input raises when the operation is asked for, before its generator
   exists: a driver never starts a request for an operation that will fail
   its checks. A key or token is checked by ``dmutex._validate`` and then
   by the store's own rule where it has one (``abc.TextRule``).
4. Preparing the store (``ready``) is the driver's policy, not the engine's:
   :meth:`Engine.prepare` only hands out the steps.
5. No lock is ever held across a ``yield``. The one lock here guards the
   deprecated ``lock()`` token memory, a plain dict.
6. Nothing is left held by nobody. An acquire that raises (a connection
   error, a cancellation) may have taken its permit on the server before
   the reply was lost, so it releases by its token before re-raising; a
   retrying acquire keeps one token for all its attempts and does the same
   when a wait raises, since a wait may carry an attempt (waiting rule 6). On a
   face whose tasks can be cancelled (asyncio: ``shield=True``, the
   default) every release is marked to run to completion (``completing``,
   or by the store itself where it marks its releases' requests so:
   ``abc.releases_complete``), so that a cancellation cannot cut it short;
   a sync engine skips the mark, which its driver has no use for (a thread
   is not cancelled).
7. A release stops renewal before it is sent (``Lease.released``), and an
   answer that shows a lease gone marks it lost (``renewal.lose``); when to
   renew and when to give up is ``renewal.py``'s.
8. A retrying acquire waits as ``waiting.py`` says, through the store,
   which may be woken by a release; the next attempt decides, always. Its
   last attempt is marked so before it is sent (a store then leaves no
   registration, no writer's intent); an unmarked one answered after the
   deadline is followed by one marked last.
9. ``run`` reports what happened to the work, not to the clean-up: the
   callback's own exception is never replaced by a failing release (which
   is logged), and a lease lost while it ran surfaces as
   :class:`LeaseLostError`, the release's error as its cause.
10. Observing (``observe.py``): an engine made with observers reports each
    operation, attempt, wake, grant, renewal and end of a lease to them as
    it happens, from the same generators, adding no request and changing
    no decision; an engine without makes no event, and its generators are
    the unobserved ones.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar

from .._errors import LeaseLostError
from .._validate import (
    MAX_KEY_LENGTH,
    check_callback,
    check_key,
    check_retry_delay,
    check_timeout,
    check_token,
    check_ttl,
)
from . import renewal, waiting
from .abc import Inspection, Store, Watching, releases_complete, sleep, text_rule
from .abc import Renewed as Answer
from .effects import Callback, Steps, completing
from .lease import Lease, new_token, now_ms, ttl_to_ms
from .observe import (
    Acquired,
    Attempted,
    Ended,
    Lost,
    NotAcquired,
    Observers,
    Operation,
    OperationName,
    Released,
    Renewed,
    Source,
    Started,
    Woken,
)
from .stamps import Stamper
from .waiting import Waiter

H = TypeVar("H")
_log = logging.getLogger("dmutex.engine")

# A default TTL is converted once when no process could live to see it pass
# the latest storable expiry: a century of margin.
_CENTURY_MS = 100 * 365 * 86_400_000


class Engine:
    """One DMutex/DSemaphore instance's algorithms over one store.

    ``shield``: mark every release's requests :attr:`~.effects.Call.complete`
    (rule 6). Only a driver that can be cancelled mid-request needs it, and
    the mark costs a generator layer per release: the sync face turns it off.
    """

    def __init__(
        self,
        store: Store,
        *,
        default_ttl: float,
        shield: bool = True,
        observe: Observers | None = None,
        source: Source | None = None,
        identity: str | None = None,
    ) -> None:
        self._store = store
        # Who the tokens say holds them (stamps.py): None, this process.
        self._stamper = Stamper(identity)
        # Rule 6: releases are wrapped in completing() unless no driver
        # needs the mark, or the store marks its releases' requests itself.
        self._shield = shield and not releases_complete(store)
        # Rule 3: the store's own rule for keys and tokens, if it has one.
        self._refuse = text_rule(store)
        # Rule 10: who is told, and what they are told the events come from.
        self._observe = observe if source is not None else None
        self._source = source
        # The store's clock, which also times retries; fixed for the store's life.
        self.clock = store.clock
        # Its wall clock, as lease.now_ms reads it, one call less per token.
        self._wall = self.clock.time
        self.default_ttl = default_ttl
        default_ms = ttl_to_ms(default_ttl, self.clock, store.max_expiry_ms)
        fits = now_ms(self.clock) + default_ms + _CENTURY_MS <= store.max_expiry_ms
        self._default_ms: int | None = default_ms if fits else None
        # Deprecated lock()/unlock(): the token of the last lock() per key.
        self._remembered: dict[str, str] = {}
        self._remembered_lock = threading.Lock()

    def ttl_ms(self, ttl: object | None) -> int:
        """Validate ``ttl`` (None: the default) and return it in whole milliseconds."""
        if ttl is None and self._default_ms is not None:
            return self._default_ms
        seconds = self.default_ttl if ttl is None else check_ttl("ttl", ttl)
        return ttl_to_ms(seconds, self.clock, self._store.max_expiry_ms)

    def prepare(self) -> Steps[None]:
        """The store's one-time preparation (MongoDB: its TTL index)."""
        return self._store.ready()

    def _key(self, key: object) -> str:
        """``key`` checked (rule 3): as every backend's, then as this store's own rule says."""
        checked = check_key(key)
        if self._refuse is not None:
            self._refuse("key", checked)
        return checked

    def _token(self, token: object) -> None:
        """Refuse a bad ``token`` (rule 3), as :meth:`_key` refuses a key."""
        checked = check_token(token)
        if self._refuse is not None:
            self._refuse("token", checked)

    def acquire(self, key: str, ttl: float | None) -> Steps[Lease | None]:
        """Try once to take a permit; None only when all permits are active.

        Every acquire of a face runs here, so the common case is written out:
        a plain key and the default TTL pass the checks of :meth:`_key` and
        :meth:`ttl_ms` inline, and the token is minted as :meth:`_request`
        mints it.
        """
        if self._refuse is not None or not (
            type(key) is str and key and key.isascii() and len(key) <= MAX_KEY_LENGTH
        ):
            key = self._key(key)
        ttl_ms = self._default_ms if ttl is None else None
        if ttl_ms is None:
            ttl_ms = self.ttl_ms(ttl)
        token = new_token() + self._stamper.suffix(round(self._wall() * 1000))  # _mint()
        steps = self._store.acquire(key, token, ttl_ms, None)
        observe = self._observe
        if observe is None or not observe.listening():
            return self._attempt(key, token, ttl_ms, steps)
        operation = self._operation("acquire", key)
        steps = self._attempt(key, token, ttl_ms, steps, operation=operation)
        return self._observed(operation, steps)

    def _listened(self) -> bool:
        """Whether an operation starting now is reported (observe rule 5)."""
        observe = self._observe
        return observe is not None and observe.listening()

    def _operation(self, name: OperationName, key: str) -> Operation:
        assert self._source is not None  # rule 10: set with the observers
        return Operation(self._source, name, key)

    def _observed(self, operation: Operation, steps: Steps[Lease | None]) -> Steps[Lease | None]:
        """``steps`` of an acquire, reported from its call to its end (rule 10)."""
        observe, clock = self._observe, self.clock
        assert observe is not None
        started = clock.monotonic()
        observe(Started(operation))
        try:
            lease = yield from steps
        except BaseException as error:
            waited = _seconds(clock.monotonic() - started)
            observe(NotAcquired(operation, "error", waited, operation.attempts, error))
            raise
        waited = _seconds(clock.monotonic() - started)
        if lease is None:
            refused = operation.name == "acquire"
            outcome: Literal["refused", "timeout"] = "refused" if refused else "timeout"
            observe(NotAcquired(operation, outcome, waited, operation.attempts))
            return None
        self._watch_end(lease)
        attempts = operation.attempts
        observe(Acquired(operation, lease.token, lease.fence, lease.slot, waited, attempts))
        return lease

    def _watch_end(self, lease: Lease) -> None:
        """Report the end of ``lease``, released or lost, once (observe rule 6)."""
        observe, source, clock = self._observe, self._source, self.clock
        assert observe is not None
        assert source is not None
        granted = clock.monotonic()

        def ended() -> None:
            held = _seconds(clock.monotonic() - granted)
            kind = Lost if lease.lost else Released
            observe(kind(source, lease.key, lease.token, lease.fence, held))

        lease.listen(ended)

    def _request(
        self, key: str, ttl_ms: int, waiter: Waiter | None = None
    ) -> tuple[str, str, int, Steps[Lease | None]]:
        """A new token and the store's steps to acquire with it.

        Called before any generator of the operation runs: a store refuses
        here a key it cannot serve as configured (rule 3).
        """
        if waiter is None:
            token = self._mint()
        elif waiter.token:
            token = waiter.token
        else:
            # One token for every attempt of a retrying acquire: a store may
            # send an attempt ahead with a wait (waiting rule 6), and a copy
            # of any attempt is then recognised by the next (store rule 3).
            token = waiter.token = self._mint()
            waiter.ttl_ms = ttl_ms
        return key, token, ttl_ms, self._store.acquire(key, token, ttl_ms, waiter)

    def _mint(self) -> str:
        """A new token, stamped with its holder and the time (``stamps.py``)."""
        return new_token() + self._stamper.suffix(round(self._wall() * 1000))

    def _attempt(
        self,
        key: str,
        token: str,
        ttl_ms: int,
        steps: Steps[Lease | None],
        waiter: Waiter | None = None,
        *,
        operation: Operation | None = None,
    ) -> Steps[Lease | None]:
        # Taken before the first request: the grant's deadline counts from
        # no later than the server set its expiry (renewal rule 1).
        sent = self.clock.monotonic()
        try:
            lease = yield from steps
        except GeneratorExit:
            raise  # closed: no effect may be yielded any more
        except BaseException:
            yield from self._undo(key, token)
            raise
        if operation is not None and self._observe is not None:
            operation.attempts += 1
            self._observe(Attempted(operation, lease is not None))
        if waiter is not None and waiter.sent is not None:
            # The store answered from an attempt it sent with the wait before
            # (waiting rule 6): that request went out earlier.
            sent, waiter.sent = min(sent, waiter.sent), None
        if lease is not None:
            lease.ttl_ms = ttl_ms
            renewal.confirm(lease, sent, ttl_ms)
        return lease

    def acquire_with_retry(
        self, key: str, ttl: float | None, timeout: float, retry_delay: float
    ) -> Steps[Lease | None]:
        """Try to take a permit until ``timeout`` seconds have passed.

        Waits at most ``retry_delay`` between attempts, less when a release
        or an expiry the store knows of comes first (``waiting.py``), never
        past the deadline, and makes one last attempt at the deadline. Time
        is monotonic.
        """
        key = self._key(key)
        ttl_ms = self.ttl_ms(ttl)
        timeout, retry_delay = check_timeout(timeout), check_retry_delay(retry_delay)
        waiter = waiting.waiter(retry_delay) if timeout > 0 else None
        request = self._request(key, ttl_ms, waiter)
        if not self._listened():
            return self._retry(request, waiter, timeout, retry_delay)
        operation = self._operation("acquire_with_retry", key)
        steps = self._retry(request, waiter, timeout, retry_delay, operation)
        return self._observed(operation, steps)

    def _retry(
        self,
        first: tuple[str, str, int, Steps[Lease | None]],
        waiter: Waiter | None,
        timeout: float,
        retry_delay: float,
        operation: Operation | None = None,
    ) -> Steps[Lease | None]:
        key, token, ttl_ms, _ = request = first
        deadline = self.clock.monotonic() + timeout
        while True:
            lease = yield from self._attempt(*request, waiter, operation=operation)
            remaining = deadline - self.clock.monotonic()
            if lease is not None or waiter is None:
                return lease
            if remaining <= 0:
                if waiter.last:
                    return lease
                # Sent before the deadline, answered after it: that attempt
                # was not marked last, so it may have left what a waiting
                # attempt leaves (a registration, a writer's intent). One
                # more, marked last, withdraws it and decides.
                waiter.last = True
                request = self._request(key, ttl_ms, waiter)
                continue
            seconds = waiting.next_wait(retry_delay, remaining, waiter.expires_in)
            # What an attempt sent ahead with the wait is (waiting rule 6):
            # the last, unless a release ends the wait early.
            waiter.last = seconds >= remaining
            try:
                yield from self._store.wait(key, waiter, seconds)
            except GeneratorExit:
                raise  # closed: no effect may be yielded any more
            except BaseException:
                # The wait may have carried an attempt (waiting rule 6).
                waiter.ahead = None
                yield from self._undo(key, token)
                raise
            woken = waiter.woken or waiter.wakeup.is_set()
            if operation is not None and self._observe is not None and woken:
                self._observe(Woken(operation))
            waiter.last = deadline - self.clock.monotonic() <= 0
            request = self._request(key, ttl_ms, waiter)

    def run(
        self,
        acquisition: Steps[Lease | None],
        callback: Callable[[H], object],
        wrap: Callable[[Lease], H],
        *,
        renewing: bool = False,
        key: str | None = None,
        retrying: bool = False,
    ) -> Steps[object]:
        """Run ``callback(wrap(lease))`` while holding the lease ``acquisition`` takes.

        Returns None without calling it when no lease was taken. Releases in a
        ``finally``, so an exception from the callback propagates after the
        release. ``renewing``: ``wrap`` set the lease renewing, and a lease
        lost while the callback ran (or found gone by the release) raises
        :class:`LeaseLostError` instead of returning the callback's result.
        ``key`` (the acquisition's) and ``retrying`` name the operation to
        observers (rule 10): a ``run``, or a ``run_with_retry``.
        """
        check_callback(callback)
        if key is None or not self._listened():
            return self._run(acquisition, callback, wrap, renewing)
        name: OperationName = "run_with_retry" if retrying else "run"
        operation = self._operation(name, self._key(key))
        return self._run(acquisition, callback, wrap, renewing, operation)

    def _ended(
        self,
        operation: Operation | None,
        outcome: Literal["ok", "raised", "lost", "not acquired", "error"],
        error: BaseException | None = None,
    ) -> None:
        if operation is not None and self._observe is not None:
            self._observe(Ended(operation, outcome, error))

    def _run(
        self,
        acquisition: Steps[Lease | None],
        callback: Callable[[H], object],
        wrap: Callable[[Lease], H],
        renewing: bool,
        operation: Operation | None = None,
    ) -> Steps[object]:
        if operation is not None and self._observe is not None:
            self._observe(Started(operation))
        try:
            lease = yield from acquisition
        except BaseException as error:
            self._ended(operation, "error", error)
            raise
        if lease is None:
            self._ended(operation, "not acquired")
            return None
        try:
            result = yield Callback(callback, wrap(lease), lease if renewing else None)
        except BaseException as error:
            # Rule 9: the callback's exception (a LeaseLostError from a
            # cancelled async callback among them) is what the caller gets.
            try:
                yield from self.release(lease)
            except Exception:  # noqa: BLE001 - logged; the lease lapses within its TTL
                _log.warning(
                    "releasing %r after its callback raised failed", lease.key, exc_info=True
                )
            lost_meanwhile = isinstance(error, LeaseLostError)
            self._ended(operation, "lost" if lost_meanwhile else "raised", error)
            raise
        lost = renewing and renewal.is_lost(lease, self.clock.monotonic())
        try:
            released = yield from self.release(lease)
        except Exception as error:
            if lost or (renewing and lease.lost):
                gone = LeaseLostError(lease.key, lease.token)
                self._ended(operation, "lost", gone)
                raise gone from error
            self._ended(operation, "error", error)
            raise
        if lost or (renewing and not released):
            gone = LeaseLostError(lease.key, lease.token)
            self._ended(operation, "lost", gone)
            raise gone
        self._ended(operation, "ok")
        return result

    def release(self, lease: Lease) -> Steps[bool]:
        """Release the permit of ``lease`` if it is still active.

        Renewal stops first. An answer of False means the lease had been
        lost, and marks it so (unless an earlier release took it). Nothing
        to check, so the generator is the method itself (rule 3 holds).
        """
        earlier = lease.released
        lease.released = True
        try:
            steps = self._store.release(lease.key, lease.token, lease.slot)
            released = yield from (completing(steps) if self._shield else steps)  # _finishing
        except BaseException:
            renewal.end(lease)
            raise
        if not released and not earlier:
            renewal.lose(lease)
        else:
            renewal.end(lease)
        return released

    def _undo(self, key: str, token: str) -> Steps[None]:
        """Rule 6: release what a request of ``token`` may have taken before its reply was lost.

        The token is this acquire's own, so this releases nothing else; its
        own failure changes nothing (the caller re-raises what it caught).
        """
        with contextlib.suppress(Exception):
            yield from self._finishing(self._store.release(key, token, None))

    def _finishing(self, release: Steps[bool]) -> Steps[bool]:
        """``release``, marked to run to completion where the face needs it (rule 6)."""
        return completing(release) if self._shield else release

    def extend(self, lease: Lease, ttl: float | None) -> Steps[bool]:
        """Set the expiry of ``lease`` to now + ttl if it is still active.

        An answer of False marks the lease lost (unless it was released). A
        lease already declared lost stays lost whatever the answer (renewal
        rule 5). Renewal goes on with the new ``ttl``.
        """
        return self._extend(lease, self.ttl_ms(ttl))

    def _extend(self, lease: Lease, ttl_ms: int) -> Steps[bool]:
        sent = self.clock.monotonic()
        expires = yield from self._store.extend(lease.key, lease.token, lease.slot, ttl_ms)
        if expires is None:
            if not lease.released:
                renewal.lose(lease)
            return False
        lease.expires_ms = expires
        lease.ttl_ms = ttl_ms
        renewal.confirm(lease, sent, ttl_ms)
        return True

    def renew(self, leases: Sequence[Lease]) -> Steps[list[float | None]]:
        """One automatic renewal of each of ``leases``: seconds until its next, or None (stop).

        As few requests as the store can make (Redis: one per up to 256
        leases). See :func:`dmutex._core.renewal.renew`.
        """
        if not self._listened():
            return renewal.renew(self._store.extend_many, leases, self.clock)
        return renewal.renew(self._extend_observed, leases, self.clock)

    def _extend_observed(self, leases: Sequence[Lease]) -> Steps[list[Answer]]:
        """The store's ``extend_many``, each answer reported as a renewal (rule 10).

        A lease found gone is reported by its end (a :class:`Lost`), not here.
        """
        observe, source = self._observe, self._source
        assert observe is not None
        assert source is not None
        try:
            answers = yield from self._store.extend_many(leases)
        except Exception:
            for lease in leases:
                observe(Renewed(source, lease.key, lease.token, False))
            raise
        for lease, answer in zip(leases, answers, strict=True):
            if answer is not None:
                observe(Renewed(source, lease.key, lease.token, not isinstance(answer, Exception)))
        return answers

    def release_token(self, key: str, token: str) -> Steps[bool]:
        """Release the active permit of ``key`` that holds ``token``."""
        key = self._key(key)
        self._token(token)
        return self._finishing(self._store.release(key, token, None))

    def extend_token(self, key: str, token: str, ttl: float | None) -> Steps[bool]:
        """Extend the active permit of ``key`` that holds ``token``."""
        key = self._key(key)
        self._token(token)
        return self._extend_token(key, token, self.ttl_ms(ttl))

    def _extend_token(self, key: str, token: str, ttl_ms: int) -> Steps[bool]:
        return (yield from self._store.extend(key, token, None, ttl_ms)) is not None

    def holders(self, key: str) -> Steps[Inspection]:
        """What the store holds for ``key``: its active permits and fence; changes nothing."""
        return self._store.holders(self._key(key))

    def watch(self, key: str, seconds: float) -> Steps[bool]:
        """Wait up to ``seconds`` for a release of ``key``: True when one ended it early.

        Through the store where it wakes observers (``abc.Watching``); a
        store that cannot sleeps the whole time and answers False.
        """
        key = self._key(key)
        store = self._store
        if isinstance(store, Watching):
            return store.watch(key, seconds)
        return _slept(seconds)

    def lock(self, key: str, ttl: float | None) -> Steps[bool]:
        """Deprecated ``lock()``: acquire and remember the token for ``unlock``."""
        return self._lock(self.acquire(key, ttl))

    def _lock(self, acquisition: Steps[Lease | None]) -> Steps[bool]:
        lease = yield from acquisition
        if lease is None:
            return False
        with self._remembered_lock:
            self._remembered[lease.key] = lease.token
        return True

    def unlock(self, key: str, token: str | None) -> Steps[bool]:
        """Deprecated ``unlock()``: release by ``token``, else by the remembered one.

        With no token given and none remembered, returns False without I/O:
        there is nothing this instance may release.
        """
        key = self._key(key)
        if token is None:
            with self._remembered_lock:
                token = self._remembered.get(key)
            if token is None:
                return _answer(False)
        return self._unlock(key, token, self.release_token(key, token))

    def _unlock(self, key: str, token: str, release: Steps[bool]) -> Steps[bool]:
        released = yield from release
        # Whatever the answer, that token no longer guards anything for us.
        with self._remembered_lock:
            if self._remembered.get(key) == token:
                del self._remembered[key]
        return released


def _seconds(elapsed: float) -> float:
    """A duration to the nanosecond, so that a ManualClock's steps read back exactly."""
    return round(elapsed, 9)


def _answer(value: bool) -> Steps[bool]:
    """Steps that make no request and return ``value``."""
    yield from ()
    return value


def _slept(seconds: float) -> Steps[bool]:
    """``Engine.watch`` where nothing wakes: the whole wait, never woken."""
    yield from sleep(seconds)
    return False

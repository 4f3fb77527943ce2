"""``dmutex run``: take the lock, run the command under it, release it, exit with a status.

Guarantee: once the lock is taken it is released before ``dmutex`` exits,
whether the command ran, could not be started, ended by itself or by a
signal; the lease is renewed every third of ``--ttl`` meanwhile. The exit
status is decided here (see :mod:`dmutex._cli`). The lock is a
:class:`~dmutex.DMutex`, a :class:`~dmutex.DSemaphore` (``--limit``) or one
side of a :class:`~dmutex.DReadWriteLock` (``--read``, ``--write``), each
held the same way, its leases saying who holds them: ``host:pid`` of
``dmutex`` and the command (:func:`~dmutex._cli.supervise.holder_identity`).
A backend that serves no read-write lock is a usage error before anything
connects or runs.

A wait is one library call per :data:`LONGEST_WAIT` (or what is left of
``-w``), never cut short for ``-v``'s lines (they come from a thread): a
waiting writer's intent, which keeps new readers out, holds for the whole
call, and lapses only for a moment between two calls.

Caveats: a signal that lands in the instant between the backend granting
the lease and ``dmutex`` recording it leaves the lease to lapse after one
TTL. A release that cannot reach the backend is reported and left to lapse
the same way; the command's own status is kept then, since the command ran
with the lease held to its end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TextIO

from .._errors import ArgumentTypeError, InvalidArgumentError, UnsupportedClientError
from .._faces.sync import (
    DMutex,
    DMutexLock,
    DReadLock,
    DReadWriteLock,
    DSemaphore,
    DSemaphorePermit,
    DWriteLock,
)
from . import supervise as sup
from .args import RunArgs
from .errors import LOST, USAGE, Failure, backend_errors, one_line
from .holders import Inspection, read_holders
from .progress import Progress
from .urls import Connection, connect, parse

__all__ = ["LONGEST_WAIT", "RETRY_DELAY", "request_timeout", "run", "session"]

Handle = DMutexLock | DSemaphorePermit | DReadLock | DWriteLock
RETRY_DELAY = 0.2  # seconds between attempts while waiting; a release wakes a waiter sooner
# The longest library call of a wait (the timeout must be finite): between two
# calls a waiting writer's intent is withdrawn for a moment, once an hour.
LONGEST_WAIT = 3600.0


def request_timeout(ttl: float) -> float:
    """How long one backend request may take: half the TTL, within 1 to 10 seconds.

    A renewal that hangs longer than that could outlast the lease it renews.
    """
    return min(10.0, max(1.0, ttl / 2))


class _Once(Protocol):
    def __call__(
        self, key: str, ttl: float | None = None, *, auto_renew: bool = False
    ) -> Handle | None: ...


class _WithRetry(Protocol):
    def __call__(
        self,
        key: str,
        *,
        ttl: float | None = None,
        timeout: float = 30.0,
        retry_delay: float = 0.1,
        auto_renew: bool = False,
    ) -> Handle | None: ...


@dataclass(frozen=True)
class _Taker:
    """How ``run`` takes its lock: the library's single attempt, and its retrying one."""

    once: _Once
    with_retry: _WithRetry


def _lock(args: RunArgs, backend: Connection) -> _Taker:
    """The library's lock for ``args``: every grant fenced, for ``DMUTEX_FENCE``.

    ``fencing=True`` also on MongoDB, where it costs one more request per
    acquire: nothing next to starting a process, and the command's
    environment then always has a fence. The constructors make no request:
    a backend that serves no read-write lock is refused here, a usage error.
    """
    service, client, ttl, options = args.service, backend.client, args.ttl, backend.options
    identity = sup.holder_identity(args.command)
    try:
        if args.role is not None:
            rw = DReadWriteLock(
                service,
                client,
                default_ttl_seconds=ttl,
                fencing=True,
                identity=identity,
                **options,
            )
            if args.role == "read":
                return _Taker(rw.acquire_read, rw.acquire_read_with_retry)
            return _Taker(rw.acquire_write, rw.acquire_write_with_retry)
        if args.limit == 1:
            mutex = DMutex(
                service,
                client,
                default_ttl_seconds=ttl,
                fencing=True,
                identity=identity,
                **options,
            )
            return _Taker(mutex.acquire, mutex.acquire_with_retry)
        semaphore = DSemaphore(
            service,
            client,
            max_permits=args.limit,
            default_ttl_seconds=ttl,
            fencing=True,
            identity=identity,
            **options,
        )
        return _Taker(semaphore.acquire, semaphore.acquire_with_retry)
    except UnsupportedClientError as error:
        option = f"--{args.role}: " if args.role is not None else ""
        raise Failure(USAGE, f"{option}{one_line(error)}") from None
    except (InvalidArgumentError, ArgumentTypeError) as error:
        raise Failure(USAGE, one_line(error)) from None


def _acquire(taker: _Taker, args: RunArgs, progress: Progress) -> Handle | None:
    """Take the lock as ``-n`` / ``-w`` / the default ask; None if it stayed held."""
    started = time.monotonic()
    handle = taker.once(args.key, args.ttl, auto_renew=True)
    if handle is not None or args.wait == 0:
        return handle
    deadline = None if args.wait is None else started + args.wait
    with progress.ticking(started):
        while True:
            chunk = LONGEST_WAIT
            if deadline is not None:
                chunk = min(chunk, max(0.0, deadline - time.monotonic()))
            handle = taker.with_retry(
                args.key, ttl=args.ttl, timeout=chunk, retry_delay=RETRY_DELAY, auto_renew=True
            )
            if handle is not None or (deadline is not None and time.monotonic() >= deadline):
                return handle


def _child_env(env: Mapping[str, str], handle: Handle) -> dict[str, str]:
    child = dict(env)
    child["DMUTEX_KEY"] = handle.key
    child["DMUTEX_TOKEN"] = handle.token
    child["DMUTEX_FENCE"] = "" if handle.fence is None else str(handle.fence)
    # A mutex is a semaphore of one permit: slot 0, so scripts need no special case.
    child["DMUTEX_SLOT"] = str(handle.slot) if isinstance(handle, DSemaphorePermit) else "0"
    return child


def run(args: RunArgs, env: Mapping[str, str], stderr: TextIO) -> int:
    """Do one ``dmutex run``; returns the exit status, or raises :class:`Failure`."""
    return session(
        args.backend,
        env,
        args.ttl,
        lambda backend, signals: _run(args, env, stderr, backend, signals),
    )


def session(
    url: str | None,
    env: Mapping[str, str],
    ttl: float,
    body: Callable[[Connection, sup.Signals], int],
) -> int:
    """``body(backend, signals)``'s status, with the signals taken over and the backend open.

    The backend is ``url``'s (None: the default file), its requests timed
    out for leases of ``ttl`` (:func:`request_timeout`), closed after; a
    forwarded signal that :class:`~dmutex._cli.supervise.Signals` raises
    (no child runs) ends it with 128+N. The frame of ``dmutex run`` and
    ``dmutex lead`` alike.
    """
    address = parse(url, env)
    signals = sup.Signals()
    signals.install()
    try:
        backend = connect(address, timeout=request_timeout(ttl), waits=True)
        try:
            return body(backend, signals)
        finally:
            backend.close()
    except sup.Interrupted as stop:
        return 128 + stop.signum
    finally:
        signals.restore()


def _run(
    args: RunArgs, env: Mapping[str, str], stderr: TextIO, backend: Connection, signals: sup.Signals
) -> int:
    taker = _lock(args, backend)

    def inspect() -> Inspection:
        return read_holders(
            backend.client,
            service=args.service,
            limit=args.limit,
            key=args.key,
            **backend.options,
            readwrite=args.role is not None,
        )

    progress = Progress(
        stderr,
        verbose=args.verbose,
        key=args.key,
        limit=args.limit,
        wait=args.wait,
        inspect=inspect,
        role=args.role,
    )
    started = time.monotonic()
    with backend_errors(backend):
        try:
            handle = _acquire(taker, args, progress)
        except (InvalidArgumentError, ArgumentTypeError) as error:  # a key or TTL out of range
            raise Failure(USAGE, one_line(error)) from None
        finally:
            progress.done()
    if handle is None:
        waited = time.monotonic() - started
        reason = "is held" if args.wait == 0 else f"was still held after {waited:.1f} s"
        if args.role == "read":  # a writer that waits keeps readers out too
            reason += " (by a writer, or a writer waits for it)"
        progress.say(f"{args.key!r} {reason}")
        return args.conflict_exit_code
    signals.held()
    fence = "" if handle.fence is None else f" (fence {handle.fence})"
    taken = {None: "", "read": " to read", "write": " to write"}[args.role]
    progress.say(f"acquired {args.key!r}{taken}{fence} after {time.monotonic() - started:.1f} s")
    status: int | None = None
    try:
        status = sup.guard(
            args.command,
            _child_env(env, handle),
            handle,
            signals,
            stderr,
            what=f"the lease on {args.key!r}",
            ttl=args.ttl,
            kill_grace=args.kill_grace,
        )
    finally:
        # A lease already reported lost needs no second line when its release fails too.
        released = _release(handle, backend, None if status == LOST else stderr)
    if not released and handle.lost and status != LOST:
        sup.say(stderr, f"the lease on {args.key!r} was found lost when it was released")
        return LOST
    progress.say(f"released {args.key!r}")
    return status


def _release(handle: Handle, backend: Connection, stderr: TextIO | None) -> bool:
    """Release ``handle``; True if it was, False if it was gone or the backend failed.

    A failure is said on ``stderr`` (None: not said).
    """
    try:
        return handle.release()
    except backend.errors as error:
        if stderr is not None:
            sup.say(
                stderr,
                f"could not release {handle.key!r} ({one_line(error)}): it lapses within its TTL",
            )
        return True  # not lost: the command ran to its end with the lease renewed

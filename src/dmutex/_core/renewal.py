"""Renewal and loss: when a lease is renewed, and when it counts as lost.

Rules of this module:

1. Every renewal decision lives here: when the next renewal is due, how a
   failing one is retried, and when the lease is given up. The renewers
   (``dmutex._faces.renewers``) keep time and run what this module returns;
   they decide nothing.
2. Nothing here waits or does I/O. :func:`renew` returns the steps of one
   renewal of a batch of leases (one request where the store can), whose
   result is each one's delay until its next, in seconds, or None: stop.
3. A lease is lost at most once: :func:`lose` marks it and calls its
   listeners, as the end of a release does (:func:`end`). Only the
   release's own answer may find a released lease lost (it was gone before
   the release reached it); nothing else calls :func:`lose` for a released
   lease.
4. An answer that arrives after the release was asked for changes nothing:
   the release wins.
5. A declared loss is final, and a renewed lease whose expiry estimate
   has passed is declared lost: it is not renewed any more, and a renewal
   answered after the estimate passed does not revive it (on MongoDB such a
   renewal, held up in the client, could match a record that had expired;
   on Redis the key lived on, but the holder could not have known).

The guarantee: a lease renewed every third of its TTL survives one missed
renewal, and one that cannot be renewed is reported lost before its expiry
estimate passes (by a margin), so its holder learns first. The limit: the
estimate is this process's clock; see ``expired_at`` on the handles.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .._clock import Clock
from .effects import Steps
from .lease import Lease, now_ms

if TYPE_CHECKING:
    from .._backends.store import Renewed

_log = logging.getLogger("dmutex")

# A renewal is due a third of the TTL after the last success, less up to a
# tenth of that at random, so that leases taken together spread out.
FRACTION = 1 / 3
JITTER = 0.1
# After a failed attempt, the next comes a fifth of the interval later.
RETRY_FRACTION = 1 / 5
# The lease is given up this long before its expiry estimate: a tenth of the
# TTL, at most two seconds.
MAX_MARGIN_MS = 2_000


def interval(ttl_ms: int) -> float:
    """Seconds from a grant or renewal to the next renewal of a ``ttl_ms`` lease."""
    return ttl_ms / 1000 * FRACTION * random.uniform(1 - JITTER, 1)


def margin_ms(ttl_ms: int) -> int:
    """How long before its expiry estimate a lease that cannot be renewed is lost."""
    return min(ttl_ms // 10, MAX_MARGIN_MS)


def is_lost(lease: Lease, now: int) -> bool:
    """Whether ``lease`` is known to be gone at ``now`` (ms): declared lost, or past its expiry.

    A renewed lease past its expiry estimate is declared lost here and then
    (rule 5), listeners called, by whoever reads it first. For a lease that
    is not renewed the estimate is only that: an ``extend`` that finds it
    still active (another caller extended it by token) moves it on.
    """
    if lease.lost:
        return True
    if lease.released or now < lease.expires_ms:
        return False
    if lease.renewing:
        lose(lease)
    return True


def lose(lease: Lease) -> None:
    """Mark ``lease`` lost and call its listeners, once."""
    lease.lost = True
    end(lease)


def end(lease: Lease) -> None:
    """Call the listeners of ``lease``, once each: it was lost or released.

    A listener tells the two apart by ``lease.lost``. One that raises is
    logged (logger ``dmutex``); the others still run.
    """
    for listener in lease.end():
        try:
            listener()
        except Exception:  # noqa: BLE001 - the user's listener: logged, the others still run
            _log.exception("a listener of the lease on %r raised", lease.key)


def renew(
    extend_many: Callable[[Sequence[Lease]], Steps[list[Renewed]]],
    leases: Sequence[Lease],
    clock: Clock,
) -> Steps[list[float | None]]:
    """One renewal of each of ``leases`` by ``extend_many``: each one's delay until its next.

    ``extend_many`` sets each expiry to now + ``lease.ttl_ms`` and answers,
    lease by lease, the new expiry, None when the lease is no longer active
    (it is lost), or the exception its request raised. An error (connection
    refused, a timeout) is retried until the lease's expiry estimate, less
    the margin, has passed; then it is lost. None: stop renewing that lease
    (lost, released, or released meanwhile).
    """
    now = now_ms(clock)
    live = [lease for lease in leases if not _stopped(lease) and not _lapsed(lease, now)]
    delays: dict[int, float | None] = {}
    if live:
        before = [lease.expires_ms for lease in live]
        try:
            answers = yield from extend_many(live)
        except Exception as error:  # noqa: BLE001 - any failure to reach the server is retried
            answers = [error] * len(live)
        now = now_ms(clock)
        for lease, expiry, answer in zip(live, before, answers, strict=True):
            if isinstance(answer, Exception):
                delays[id(lease)] = _after_error(lease, now)
            else:
                delays[id(lease)] = _after(lease, expiry, answer, now)
    return [delays.get(id(lease)) for lease in leases]


def _lapsed(lease: Lease, now: int) -> bool:
    """Whether the expiry estimate of ``lease`` has passed (then it is lost: rule 5)."""
    if now >= lease.expires_ms and not lease.released:
        lose(lease)
        return True
    return False


def _after(lease: Lease, before: int, expires: int | None, now: int) -> float | None:
    """What an answer to a renewal means: the delay until the next one, or None.

    ``before`` is the expiry estimate when the renewal was sent; an answer
    that comes after it does not count (rule 5).
    """
    if lease.released:
        return None  # the release overtook this renewal
    if expires is None or now >= before:
        lose(lease)
        return None
    lease.expires_ms = max(lease.expires_ms, expires)
    return interval(lease.ttl_ms)


def _after_error(lease: Lease, now: int) -> float | None:
    """After a renewal that failed: retry soon, or give the lease up past the margin."""
    if lease.released:
        return None
    deadline = lease.expires_ms - margin_ms(lease.ttl_ms)
    if now >= deadline:
        lose(lease)
        return None
    return min(interval(lease.ttl_ms) * RETRY_FRACTION, (deadline - now) / 1000)


def _stopped(lease: Lease) -> bool:
    # A function, not an inline test: the answer changes across a yield.
    return lease.released or lease.lost


def watch(lease: Lease, clock: Clock) -> float | None:
    """For a lease that is not renewed but has listeners: seconds until it expires, or None.

    At its expiry estimate it is lost; an extend meanwhile moves the
    estimate, and the watch with it.
    """
    if lease.released or lease.lost:
        return None
    remaining = lease.expires_ms - now_ms(clock)
    if remaining <= 0:
        lose(lease)
        return None
    return remaining / 1000

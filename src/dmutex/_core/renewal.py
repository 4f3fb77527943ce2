"""Renewal and loss: when a lease is renewed, and when it counts as lost.

Rules of this module:

1. Loss by deadline, not by reply. Every lease keeps a local deadline on
   its clock's monotonic time: the send time of the last request that set
   its expiry and was answered, plus the TTL that request set, less a
   margin (:func:`margin_ms`). The server set that expiry when the request
   reached it, which is no earlier than it was sent, so until the deadline
   no one else can hold the permit, whatever happens to the requests in
   flight. At the deadline the lease is lost (:func:`watch`, :func:`is_lost`),
   whether or not any request has returned: the holder decides by its own
   clock, never by waiting for a reply. Of two answered requests, the later
   sent sets the deadline (:func:`confirm`).
2. Every renewal decision lives here: when the next renewal is due, how a
   failing one is retried, and when the lease is given up. The renewers
   (``dmutex._runtime.renewers``) keep time, run what this module returns
   and call :func:`watch` at each deadline; they decide nothing.
3. Nothing here waits or does I/O. :func:`renew` returns the steps of one
   renewal of a batch of leases (one request where the store can), whose
   result is each one's delay until its next, in seconds, or None: stop.
4. A lease is lost at most once: :func:`lose` marks it and calls its
   listeners, as the end of a release does (:func:`end`). Only the
   release's own answer may find a released lease lost (it was gone before
   the release reached it); nothing else calls :func:`lose` for a released
   lease.
5. An answer that arrives after the release was asked for changes nothing:
   the release wins.
6. A declared loss is final: a lost lease is not renewed any more, and an
   answer that arrives after its deadline (or after the loss) does not
   revive it. A lease that is neither renewed nor watched is not declared
   lost by reading :func:`is_lost`: an ``extend`` that succeeds moves its
   deadline on.
7. A loss and a renewal that failed are logged here at WARNING, on the
   logger ``dmutex.renewal``, with the key, the token's first 8
   characters and the fence in ``extra`` (``dmutex_key``,
   ``dmutex_token``, ``dmutex_fence``): rare, and wanted in every log.

The guarantee: a lease renewed every third of its TTL survives one missed
renewal; one that cannot be renewed is reported lost at its deadline, before
the server can expire it, provided the holder's clock does not run slower
than the server's (or, where holders compare expiries by their own wall
clocks, than theirs) by more than the margin over the TTL, and the server's
clock does not jump forward. Nothing is assumed of the network.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .._clock import Clock
from .chance import CHANCE
from .effects import Steps
from .lease import Lease

if TYPE_CHECKING:
    from .abc import Renewed

_log = logging.getLogger("dmutex.renewal")

# A renewal is due a third of the TTL after the last success, less up to a
# tenth of that at random, so that leases taken together spread out.
FRACTION = 1 / 3
JITTER = 0.1
# After a failed attempt, the next comes a fifth of the interval later.
RETRY_FRACTION = 1 / 5
# The deadline comes this long before the TTL runs out from the request's
# send time: a tenth of the TTL, at least 0.2 s (but never more than a quarter
# of the TTL), at most 2 s. It absorbs a clock rate drift (10% of the TTL;
# 0.33% of a 600 s one) and the delay between the deadline and the moment the
# holder's listeners have run, which the 0.2 s floor keeps from eating a short
# TTL's whole margin on a busy machine.
MIN_MARGIN_MS = 200
MAX_MARGIN_MS = 2_000


def interval(ttl_ms: int) -> float:
    """Seconds from a grant or renewal to the next renewal of a ``ttl_ms`` lease."""
    return ttl_ms / 1000 * FRACTION * CHANCE.uniform(1 - JITTER, 1)


def margin_ms(ttl_ms: int) -> int:
    """How long before a request's TTL runs out (from its send time) its lease is lost."""
    return min(max(ttl_ms // 10, MIN_MARGIN_MS), ttl_ms // 4, MAX_MARGIN_MS)


def deadline(sent: float, ttl_ms: int) -> float:
    """The deadline that a request sent at ``sent`` (monotonic s) setting ``ttl_ms`` gives."""
    span = _SPANS.get(ttl_ms)
    return sent + (_span(ttl_ms) if span is None else span)


# Each TTL's span from a request's send time to its deadline, in seconds:
# an instance's few TTLs, worked out once (a grant's deadline is set on
# every acquire). At most _SPANS_KEPT of them; the rest are worked out each time.
_SPANS: dict[int, float] = {}
_SPANS_KEPT = 256


def _span(ttl_ms: int) -> float:
    span = (ttl_ms - margin_ms(ttl_ms)) / 1000
    if len(_SPANS) < _SPANS_KEPT:
        _SPANS[ttl_ms] = span
    return span


def confirm(lease: Lease, sent: float, ttl_ms: int) -> None:
    """A request sent at ``sent`` set the expiry of ``lease`` ``ttl_ms`` on, and was answered.

    Rule 1: the later sent of two answered requests sets the deadline. A
    lost lease stays lost (rule 6).
    """
    if sent >= lease.confirmed:
        lease.confirmed = sent
        span = _SPANS.get(ttl_ms)  # deadline(sent, ttl_ms), one call less per grant
        lease.deadline = sent + (_span(ttl_ms) if span is None else span)


def time_left(lease: Lease, clock: Clock) -> float:
    """Seconds until the deadline of ``lease``; 0.0 once it is lost or released."""
    if lease.lost or lease.released:
        return 0.0
    return max(0.0, lease.deadline - clock.monotonic())


def is_lost(lease: Lease, now: float) -> bool:
    """Whether ``lease`` is known gone at ``now`` (monotonic s): lost, or past its deadline.

    A renewed lease past its deadline is declared lost here and then (rule
    6), listeners called, by whoever reads it first. One that is not
    renewed reads as lost, without being declared so: an ``extend`` that
    finds it still active (another caller extended it by token) moves it on.
    """
    if lease.lost:
        return True
    if lease.released or now < lease.deadline:
        return False
    if lease.renewing:
        lose(lease)
    return True


def lose(lease: Lease) -> None:
    """Mark ``lease`` lost and call its listeners, once; log it at WARNING, once (rule 7)."""
    if not lease.lost:
        _log.warning(
            "the lease on %r (fence %s) is lost",
            lease.key,
            lease.fence,
            extra={
                "dmutex_key": lease.key,
                "dmutex_token": lease.token[:8],
                "dmutex_fence": lease.fence,
            },
        )
    lease.lost = True
    end(lease)


def end(lease: Lease) -> None:
    """Call the listeners of ``lease``, once each: it was lost or released.

    A listener tells the two apart by ``lease.lost``. One that raises is
    logged (logger ``dmutex.renewal``); the others still run.
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
    refused, a timeout) is retried until the lease's deadline; then it is
    lost. None: stop renewing that lease (lost, released, or released
    meanwhile). An answer that comes after the deadline does not count
    (rule 6): the renewer may have declared the loss while it was awaited.
    """
    sent = clock.monotonic()
    live = [lease for lease in leases if not _stopped(lease) and not _lapsed(lease, sent)]
    delays: dict[int, float | None] = {}
    if live:
        ttls = [lease.ttl_ms for lease in live]
        try:
            answers = yield from extend_many(live)
        except Exception as error:  # noqa: BLE001 - any failure to reach the server is retried
            answers = [error] * len(live)
        now = clock.monotonic()
        for lease, ttl_ms, answer in zip(live, ttls, answers, strict=True):
            if isinstance(answer, Exception):
                _log.warning(
                    "renewing the lease on %r failed (%s); retried until its deadline",
                    lease.key,
                    type(answer).__name__,
                    extra={"dmutex_key": lease.key, "dmutex_token": lease.token[:8]},
                )
                delays[id(lease)] = _after_error(lease, now)
            else:
                delays[id(lease)] = _after(lease, sent, ttl_ms, answer, now)
    return [delays.get(id(lease)) for lease in leases]


def _lapsed(lease: Lease, now: float) -> bool:
    """Whether the deadline of ``lease`` has passed (then it is lost: rule 6)."""
    if now >= lease.deadline and not lease.released:
        lose(lease)
        return True
    return False


def _after(lease: Lease, sent: float, ttl_ms: int, expires: int | None, now: float) -> float | None:
    """What an answer to a renewal sent at ``sent`` means: the delay until the next, or None."""
    if lease.released or lease.lost:
        return None  # the release overtook this renewal, or the deadline passed meanwhile
    if expires is None:
        lose(lease)
        return None
    if _lapsed(lease, now):
        return None
    lease.expires_ms = max(lease.expires_ms, expires)
    confirm(lease, sent, ttl_ms)
    return interval(lease.ttl_ms)


def _after_error(lease: Lease, now: float) -> float | None:
    """After a renewal that failed: retry soon, or give the lease up at its deadline."""
    if lease.released or lease.lost or _lapsed(lease, now):
        return None
    return min(interval(lease.ttl_ms) * RETRY_FRACTION, lease.deadline - now)


def _stopped(lease: Lease) -> bool:
    # A function, not an inline test: the answer changes across a yield.
    return lease.released or lease.lost


def watch(lease: Lease, clock: Clock) -> float | None:
    """For a watched lease (renewed, or with listeners): seconds until its deadline, or None.

    At its deadline it is lost (rule 1); a renewal or an extend meanwhile
    moves the deadline, and the watch with it. None: it ended (lost or
    released), stop watching.
    """
    if lease.released or lease.lost:
        return None
    remaining = lease.deadline - clock.monotonic()
    if remaining <= 0:
        lose(lease)
        return None
    return remaining

"""Elections: who leads a name, and when leadership changed, read from a mutex's storage.

An election is a mutex with fencing: the name is the mutex's key, the leader
is the holder of its one permit, and a term is the fence of that holder's
grant. Nothing is stored that a mutex does not store, so ``dmutex status``
shows a leader as it shows any holder.

Rules of this module:

1. A term only grows: it is the grant's fence, strictly greater than every
   earlier grant's of the same name (the fence rule of every store). One
   grant, one leader, one term; a resigned or lost leader's term is over,
   and the next leader's term is greater.
2. Who leads is what storage holds now: the active holder of the name's
   permit, its identity and start as its token's stamp says
   (``stamps.py``), its term the name's fence counter (for a mutex, the
   active holder's grant is always the latest). Nobody holds it: nobody
   leads.
3. Leadership changed when the leader read now is not the one read before:
   another term, another holder, or nobody where somebody was (or the
   reverse). A renewal (a later ``until``) is no change.
4. A campaign tries in slices of at most :data:`CAMPAIGN_SLICE` seconds,
   each a retrying acquire with a token of its own: a retrying acquire keeps
   one token (engine rule 6), whose stamp's ``since`` is when it began, so a
   leader's ``since`` is at most one slice before its grant.
5. Observing reads who leads, then waits for its next read: while someone
   leads, a watch that a release ends early where the store tells one
   (``abc.Watching``: in memory, PostgreSQL's ``LISTEN``), never longer than
   the poll interval (``poll``); while nobody leads, the poll interval (no
   store tells a grant). A read that follows a wake and finds no change
   waits :data:`QUIET` before it watches again.
6. A term read with a new holder that is not greater than the last one
   shown is stale (:func:`stale`): MongoDB takes the slot, then moves the
   fence counter in a second request, and a read between the two finds the
   new holder with its predecessor's term. An observer reads again, after
   :data:`QUIET`, up to :data:`STALE_READS` times, before it shows such a
   leader: a holder that keeps no fence (the TypeScript library, a
   ``fencing=False`` mutex on the name) keeps showing the last fenced
   grant's term, and is shown with it then.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from .abc import Inspection
from .lease import expiry_datetime
from .stamps import read_stamp, token_prefix

QUIET = 0.05
"""Rule 5: seconds an observer pauses after a wake that showed no change."""

STALE_READS = 3
"""Rule 6: how many times an observer reads again before it shows a stale term."""

CAMPAIGN_SLICE = 1.0
"""Rule 4: the longest a campaign's retrying acquire lasts before it starts another."""


@dataclass(frozen=True, slots=True)
class Leader:
    """Who leads an election's name, as any process reads it from storage.

    ``term`` is the leader's fence: it only grows from one leader to the
    next. ``identity`` and ``since`` are what the leader's token says of it
    (None for a holder that stamped none, such as a TypeScript service
    holding the name as a mutex key); ``since`` is when the slice of its
    campaign that won began (rule 4: at most one second before its grant).
    ``until`` is when its lease ends unless renewed, as storage holds it.
    ``token_prefix`` tells leaders apart and releases nothing.
    """

    name: str
    identity: str | None
    term: int | None
    since: datetime | None
    until: datetime
    token_prefix: str


def leader_of(name: str, found: Inspection) -> Leader | None:
    """Who leads ``name`` by what a read of its storage found (rule 2); None: nobody."""
    if not found.holders:
        return None
    holder = found.holders[0]
    stamp = read_stamp(holder.token)
    since = None if stamp.since_ms is None else expiry_datetime(stamp.since_ms)
    until = expiry_datetime(holder.expires_ms)
    return Leader(name, stamp.identity, found.fence, since, until, token_prefix(holder.token))


def changed(before: Leader | None, now: Leader | None) -> bool:
    """Whether leadership changed from ``before`` to ``now`` (rule 3)."""
    if before is None or now is None:
        return before is not now
    return (before.term, before.token_prefix) != (now.term, now.token_prefix)


def stale(before: Leader | None, now: Leader | None) -> bool:
    """Whether ``now`` shows a new holder with a term not above ``before``'s (rule 6)."""
    if before is None or now is None or before.term is None or now.term is None:
        return False
    return now.token_prefix != before.token_prefix and now.term <= before.term

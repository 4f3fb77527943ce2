"""Who holds a lock: what ``holders()`` answers, read from the tokens in storage."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from .._core.abc import Inspection
from .._core.lease import expiry_datetime
from .._core.stamps import read_stamp, token_prefix


@dataclass(frozen=True, slots=True)
class LockHolder:
    """One active permit of a key, as any process reads it from storage.

    ``identity`` and ``since`` are what the holder's token says of it
    (``identity=`` of the instance that took it; ``since``: when the acquire
    that took it began), or None for a token without them: the TypeScript
    library's, an instance made with ``identity=""``, a dmutex before 0.9.
    ``expires_at`` is the expiry storage holds; ``token_prefix`` the first
    characters of the token, which tell holders apart and release nothing.
    """

    key: str
    slot: int
    identity: str | None
    since: datetime | None
    expires_at: datetime
    token_prefix: str


def lock_holders(key: str, found: Inspection) -> list[LockHolder]:
    """``found``'s active permits of ``key`` as :class:`LockHolder` s, by slot."""
    holders = []
    for holder in sorted(found.holders):
        stamp = read_stamp(holder.token)
        since = None if stamp.since_ms is None else expiry_datetime(stamp.since_ms)
        expires = expiry_datetime(holder.expires_ms)
        prefix = token_prefix(holder.token)
        holders.append(LockHolder(key, holder.slot, stamp.identity, since, expires, prefix))
    return holders

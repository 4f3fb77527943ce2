"""Who holds each key in a fault test, from acquire-returned to release-called.

:class:`Tracker` is the fault suites' oracle of mutual exclusion: a holder
counts from the moment its acquire returned until it calls release, cut at
its lease's expiry (a holder whose lease ran out holds nothing, whatever it
believes). A key with more live holders than its limit is an overlap.
"""

from __future__ import annotations

import threading
from datetime import datetime, timezone


def utcnow() -> datetime:
    """Now, in UTC (a lease's ``expired_at`` is aware)."""
    return datetime.now(timezone.utc)


class Tracker:
    """The holders of each key, from acquire-returned to release-called."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.overlaps = 0  # times a key had more unexpired holders than its limit
        self.peak = 0
        self.overran = 0  # holders that called release after their lease's expiry
        self._holders: dict[str, dict[int, datetime]] = {}
        self._lock = threading.Lock()

    def enter(self, key: str, who: int, expired_at: datetime) -> None:
        with self._lock:
            holders = self._holders.setdefault(key, {})
            holders[who] = expired_at
            now = utcnow()
            live = sum(1 for expiry in holders.values() if expiry > now)
            self.peak = max(self.peak, live)
            if live > self.limit:
                self.overlaps += 1

    def leave(self, key: str, who: int) -> None:
        with self._lock:
            expiry = self._holders[key].pop(who)
            if expiry <= utcnow():
                self.overran += 1

"""Waiting on etcd: a failed attempt notes what to watch, and the wait watches it.

Rules:

1. A failed attempt notes, for its waiter, the keys to watch (a key, or a
   range) and the revision to watch from: the one after the newest put it
   read there. A deletion (a release, an expiry, a revoke) between the
   attempt and the watch is replayed from etcd's history, so it is never
   missed.
2. The wait watches for up to its seconds, and a deletion ends it at once
   (``waiting.py``, rule 2). A waiter woken and then beaten to the permit
   pauses first (``waiting.py``, rule 4). Nothing to watch: it sleeps. A
   watch that fails, or times out, sleeps the rest: a wait never raises,
   and never ends early without a deletion.
3. A store remembers at most :data:`WATCHING` waiters' notes, the oldest
   forgotten first: an acquire given up between its attempt and its wait
   leaves its note behind.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ..._clock import Clock
from ..._core.effects import Sleep, Steps
from ..._core.waiting import Waiter, lost_pause
from .requests import Dialect, Record

__all__ = ["WATCHING", "Watches"]

WATCHING = 4096


class Watches:
    """The waiters' notes of one store, and their waits (rules at the top)."""

    def __init__(self, dialect: Dialect, clock: Clock) -> None:
        self._dialect = dialect
        self._clock = clock
        self._notes: OrderedDict[str, tuple[bytes, bytes | None, int]] = OrderedDict()

    def note(
        self, waiter: Waiter, key: bytes, end: bytes | None, records: Sequence[Record]
    ) -> None:
        """Note that ``waiter`` watches ``key`` (or ``[key, end)``), read as ``records``."""
        newest = max((record.mod_revision for record in records), default=0)
        self._notes[waiter.name] = (key, end, newest + 1)
        self._notes.move_to_end(waiter.name)
        waiter.registered = True
        while len(self._notes) > WATCHING:
            self._notes.popitem(last=False)

    def forget(self, waiter: Waiter | None) -> None:
        """Drop ``waiter``'s note: its acquire was granted."""
        if waiter is not None:
            self._notes.pop(waiter.name, None)

    def wait(self, waiter: Waiter, seconds: float) -> Steps[None]:
        """Watch what ``waiter``'s last attempt noted, up to ``seconds`` (rule 2)."""
        if waiter.woken:
            waiter.woken = False
            yield Sleep(lost_pause(seconds))
            return
        note = self._notes.pop(waiter.name, None)
        if note is None or seconds <= 0:
            yield Sleep(seconds)
            return
        key, end, revision = note
        started = self._clock.monotonic()
        try:
            yield self._dialect.watch(key, end, revision, seconds)
        except Exception:  # noqa: BLE001 - a timeout, or a failed watch: rule 2
            rest = seconds - (self._clock.monotonic() - started)
            if rest > 0:
                yield Sleep(rest)
        else:
            waiter.woken = True

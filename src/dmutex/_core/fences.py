"""Fences: the number each grant of a key carries, strictly above every earlier one.

Rules of this module:

1. A grant's fence is the larger of the key's stored counter plus one and
   the store's clock in whole microseconds since the epoch (Redis: ``TIME``;
   MongoDB: ``$$NOW``, milliseconds times 1,000; SQLite: the instance's
   clock), and the counter is set to it in the grant's own atomic step.
2. So a counter that is lost (a Redis restart without persistence, an
   eviction, a deletion by hand) or rolled back (a snapshot older than the
   last grant, a restored backup) restarts above every fence handed out
   before, as long as the clock has not stepped back below the last fence
   since: fences taken from the clock are microseconds apart at least, and
   one grant a microsecond is more than any store serves.
3. While the counter is intact, a clock that steps back changes nothing:
   the counter plus one wins. Only a counter lost *and* a clock behind the
   last fence can repeat a fence.

``InMemoryBackend`` counts 1, 2, 3, ...: its counters live as long as the
backend object, and tests read them more easily.
"""

from __future__ import annotations

from .._clock import Clock

US_PER_S = 1_000_000


def next_fence(counter: int, now_us: int) -> int:
    """The fence of a grant whose key's counter is ``counter``, at ``now_us`` (rule 1)."""
    return max(counter + 1, now_us)


def clock_us(clock: Clock) -> int:
    """``clock``'s wall-clock reading in whole microseconds since the epoch."""
    return int(clock.time() * US_PER_S)

"""The randomness dmutex spreads and jitters with: its own, never the ``random`` module's.

Rules of this module:

1. Nothing in dmutex draws from the ``random`` module's shared generator.
   An application that seeds it (``random.seed``) for a reproducible run
   gets the same sequence whether or not its locks renew, retry or pick a
   slot meanwhile, in its threads or in dmutex's; and a tool that watches
   that generator for draws it did not make (Hypothesis does, and fails the
   test) sees none of dmutex's.
2. The draws come from the operating system (:class:`random.SystemRandom`):
   the process holds no state of this generator, so a forked child never
   repeats its parent's choices, and no thread shares a seed with another.
   A draw costs about 0.6 µs here (a system call), nothing beside a round
   trip.
3. These draws spread and jitter; they protect nothing. A token's secret
   part comes from ``lease.new_token``.
"""

from __future__ import annotations

import random

CHANCE: random.Random = random.SystemRandom()
"""dmutex's generator for jitter and spreading (rules 1 and 2)."""

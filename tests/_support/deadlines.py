"""Deadline trials: when a holder was told its lease was lost, and when another holder took it.

- :class:`Trial`: one lease of one trial, its times on the monotonic clock
  (``time.monotonic()``, which is ``CLOCK_MONOTONIC`` on Linux and so
  comparable across the processes of one host): when its network (or its
  file) stopped answering, when each way of telling the holder fired, and
  when the second holder's acquire returned;
- :func:`record`: a case's smallest margin (the second holder's grant less
  the last telling), added to :data:`MARGINS` before anything is checked, so
  that a failing run reports it too; :func:`summary_line` turns them into
  the line ``tests/faults/conftest.py`` prints in the terminal summary
  ("deadline margins: redis-sync min 0.093 s (ttl 1 s) over 20 trials, ...");
- :class:`Scheduling`: how late the machine ran this process while a case
  ran (a thread that sleeps 10 ms at a time and notes how much later it woke)
  and the share of that time some task waited for a CPU
  (``/proc/pressure/cpu``), so that a reader tells a starved machine from a
  library that told its holder late;
- :func:`judge`: every problem of a case's trials in one failure message,
  which starts with the case's margin and how the machine scheduled it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from tests._support.redis_servers import Pool, Server

REPORTED_PROBLEMS = 20  # problems listed in a failure message, at most


@dataclass
class Trial:
    """One lease: the key, its TTL, and what happened to it, in monotonic seconds.

    ``expected`` names the tellings that must come (``on_lost``,
    ``wait_lost``, ``cancelled``: the asyncio ``run()`` body's
    ``CancelledError``). Each is written once, from whichever thread or task
    saw it; :meth:`tell` keeps the first time.
    """

    case: str
    index: int  # the trial's number: the leases of one trial share it
    key: str
    ttl: float
    expected: tuple[str, ...]
    cut: float | None = None  # the network or the file stopped answering this lease ...
    cut_done: float | None = None  # ... completely by then (None: at ``cut`` already)
    taken: float | None = None  # the second holder's acquire returned its handle
    lost_before_cut: bool | None = None
    lost_at_end: bool | None = None
    told: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # anything else found wrong
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def tell(self, how: str, at: float | None = None) -> None:
        """Record that the holder was told by ``how``, now (or at ``at``); the first time stays."""
        moment = time.monotonic() if at is None else at
        with self._lock:
            self.told.setdefault(how, moment)

    def note(self, text: str) -> None:
        with self._lock:
            self.notes.append(text)

    def last_told(self) -> float | None:
        """When the last expected telling came, or None if one never came."""
        with self._lock:
            if any(how not in self.told for how in self.expected):
                return None
            return max(self.told[how] for how in self.expected)

    def margin(self) -> float | None:
        """Seconds from the last expected telling to the second holder's grant, if both came."""
        last = self.last_told()
        return None if last is None or self.taken is None else self.taken - last

    def problems(self) -> list[str]:
        """What is wrong with this lease, one line each (empty: all is well)."""
        name = f"{self.case} trial {self.index} {self.key!r} (ttl {self.ttl:g} s)"
        found: list[str] = [f"{name}: {text}" for text in self.notes]
        if self.cut is None:
            return [*found, f"{name}: never cut"]
        if self.lost_before_cut is not False:
            found.append(f"{name}: lost before the cut (or not checked)")
        if self.taken is None:
            found.append(f"{name}: the second holder never took the key")
        if self.lost_at_end is not True:
            found.append(f"{name}: handle.lost is {self.lost_at_end} at the end")
        with self._lock:
            told = dict(self.told)
        cut_done = self.cut if self.cut_done is None else self.cut_done
        for how in self.expected:
            moment = told.get(how)
            if moment is None:
                found.append(f"{name}: never told by {how}")
                continue
            after_cut = moment - self.cut
            if after_cut < 0:
                found.append(f"{name}: told by {how} {-after_cut:.3f} s before the cut")
            # Every renewal answered was sent before the cut was done, so the
            # lease's record expires by then + ttl at the latest: telling must
            # come first.
            if moment - cut_done >= self.ttl:
                found.append(
                    f"{name}: told by {how} {moment - cut_done:.3f} s after the cut, not "
                    f"before the {self.ttl:g} s TTL ran out"
                )
            if self.taken is not None and moment >= self.taken:
                found.append(
                    f"{name}: told by {how} {moment - self.taken:.3f} s AFTER the second "
                    f"holder took the key (margin {self.taken - moment:+.3f} s; cut to "
                    f"told {after_cut:.3f} s, cut to taken {self.taken - self.cut:.3f} s)"
                )
        return found


PRESSURE = Path("/proc/pressure/cpu")  # Linux 4.20+ with PSI; absent elsewhere
NAP = 0.010  # the sampler's sleep


def _stalled_microseconds() -> int | None:
    """``/proc/pressure/cpu``'s "some" total: microseconds some task waited for a CPU."""
    try:
        first = PRESSURE.read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = dict(part.split("=", 1) for part in first.split()[1:])
    return int(fields["total"]) if "total" in fields else None


@dataclass
class Scheduling:
    """How the machine ran this process over a span: the latest wake-up and CPU pressure.

    A holder's deadline comes a margin before its lease can lapse, on the
    assumption that its process gets to run. When a case fails, these figures
    say whether the machine was starved (wake-ups seconds late, tasks waiting
    for a CPU most of the time) or the library was late on a machine that ran it.
    """

    latest: float = 0.0  # the most a 10 ms sleep overran, in seconds
    seconds: float = 0.0  # the span watched
    stalled: float | None = None  # of which some task waited for a CPU (None: no PSI)

    @classmethod
    @contextlib.contextmanager
    def watching(cls) -> Iterator[Scheduling]:
        """Watch while the block runs; the figures are final when it ends."""
        found = cls()
        stop = threading.Event()
        started = time.monotonic()
        stalled_before = _stalled_microseconds()

        def sample() -> None:
            while not stop.is_set():
                asked = time.monotonic()
                time.sleep(NAP)
                found.latest = max(found.latest, time.monotonic() - asked - NAP)

        thread = threading.Thread(target=sample, name="scheduling", daemon=True)
        thread.start()
        try:
            yield found
        finally:
            stop.set()
            thread.join(5)
            found.seconds = time.monotonic() - started
            stalled_after = _stalled_microseconds()
            if stalled_before is not None and stalled_after is not None:
                found.stalled = (stalled_after - stalled_before) / 1e6

    def text(self) -> str:
        woke = f"woke up to {self.latest:.3f} s late from a {NAP * 1000:g} ms sleep"
        if self.stalled is None or self.seconds <= 0:
            return woke
        share = min(1.0, self.stalled / self.seconds)
        return f"{woke}, some task waited for a CPU {share:.0%} of {self.seconds:.1f} s"


@dataclass(frozen=True)
class Margin:
    """A case's smallest margin over its trials, for the terminal summary."""

    case: str
    trials: int  # distinct trial numbers
    leases: int
    smallest: float | None  # None: no lease had both a telling and a grant
    ttl: float | None  # the TTL of the lease with the smallest margin
    without: int  # leases with no margin (never told, or never taken)
    scheduling: Scheduling | None = None  # how the machine ran the case

    def text(self) -> str:
        counted = f"over {self.trials} trials"
        if self.leases != self.trials:
            counted += f" ({self.leases} leases)"
        ran = "" if self.scheduling is None else f" ({self.scheduling.text()})"
        if self.smallest is None:
            return f"{self.case} no margin {counted}{ran}"
        missing = f", {self.without} without one" if self.without else ""
        smallest = f"min {self.smallest:.3f} s (ttl {self.ttl:g} s)"
        return f"{self.case} {smallest} {counted}{missing}{ran}"


MARGINS: list[Margin] = []
_MARGINS_LOCK = threading.Lock()


def record(case: str, trials: Sequence[Trial], scheduling: Scheduling | None = None) -> Margin:
    """Add the smallest margin of ``trials`` to :data:`MARGINS` (before any check) and return it.

    ``scheduling``: how the machine ran the case, said with the margin.
    """
    known = [(m, t.ttl) for t in trials if (m := t.margin()) is not None]
    smallest = min(known, default=None)
    margin = Margin(
        case=case,
        trials=len({t.index for t in trials}),
        leases=len(trials),
        smallest=None if smallest is None else smallest[0],
        ttl=None if smallest is None else smallest[1],
        without=len(trials) - len(known),
        scheduling=scheduling,
    )
    with _MARGINS_LOCK:
        MARGINS.append(margin)
    return margin


def judge(margin: Margin, trials: Sequence[Trial], extra: Iterable[str] = ()) -> None:
    """Fail naming every problem of ``trials`` (``extra``: the case's own), with the margin."""
    problems = [*extra, *(p for t in trials for p in t.problems())]
    if problems:
        shown = problems[:REPORTED_PROBLEMS]
        more = len(problems) - len(shown)
        tail = f"\n  ... and {more} more" if more else ""
        raise AssertionError(
            f"{margin.text()}; {len(problems)} problems:\n  " + "\n  ".join(shown) + tail
        )


def summary_line() -> str | None:
    """ "deadline margins: ..." for every case recorded this session, or None if none was."""
    with _MARGINS_LOCK:
        margins = list(MARGINS)
    if not margins:
        return None
    return "deadline margins: " + ", ".join(m.text() for m in margins)


WANTED_REDIS = "redis-7.0"  # one server version; the newest found if there is no 7.0


def redis_target(pool: Pool) -> Server:
    """The Redis server of the deadline suites: 7.0 if there is one, else the newest, emptied."""
    labels = pool.labels
    if not labels:
        pytest.skip(pool.discovery.reason)
    server = pool.server(WANTED_REDIS if WANTED_REDIS in labels else labels[-1])
    with redis.Redis.from_url(server.url) as client:
        client.flushdb()
    return server

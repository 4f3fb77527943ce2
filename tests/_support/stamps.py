"""Programs for tests of ``dmutex run``'s deadlines, and what they leave behind.

- :data:`FIRST`: the command under a lease, which stamps ``time.monotonic()``
  into a log every few milliseconds (``CLOCK_MONOTONIC`` on Linux: one clock
  for every process of the host, so its stamps and the test's times compare);
- :data:`SECOND`: the command of the next holder, which notes when it started
  and whether FIRST's pid still runs (its dmutex takes :data:`SECOND_TTL`);
- :class:`Stamps`: FIRST's log, read back.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

# FIRST: writes its pid, stamps "alive" every 20 ms; on SIGTERM stamps "term",
# then exits ("polite") or goes on ("stubborn"). Exits 99 after 60 s whatever.
# With a fourth argument "fork" it first forks a grandchild that does the same
# (stamping "grand"), so that what the command started is watched too.
FIRST = r"""
import os, signal, sys, time
folder, mode, every = sys.argv[1], sys.argv[2], float(sys.argv[3])
alive = "alive"
log = os.open(os.path.join(folder, "first.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
def stamp(what):
    os.write(log, f"{what} {time.monotonic():.6f}\n".encode())
def on_term(signum, frame):
    stamp("term")
    if mode == "polite":
        os._exit(0)
signal.signal(signal.SIGTERM, on_term)
if sys.argv[4:] == ["fork"] and os.fork() == 0:
    alive = "grand"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stamp(alive)
        time.sleep(every)
    os._exit(99)
with open(os.path.join(folder, "first.tmp"), "w") as out:
    out.write(str(os.getpid()))
os.replace(os.path.join(folder, "first.tmp"), os.path.join(folder, "first.pid"))
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    stamp(alive)
    time.sleep(every)
sys.exit(99)
"""

# The second dmutex's --ttl. What is measured is when it was granted (when
# FIRST's lease ran out), which its own TTL does not change; a TTL as short as
# FIRST's (2 s) let its watchdog stop SECOND in one CI run, where some task
# waited for a CPU 98% of the trial's 10.6 s and its renewal was not confirmed
# within 1.4 s (exit 143): right by the lease, and nothing this test measures.
SECOND_TTL = 30.0

# SECOND: notes when it started and whether FIRST's pid still runs, then exits.
SECOND = r"""
import json, os, sys, time
start = time.monotonic()
folder, pid = sys.argv[1], int(sys.argv[2])
try:
    with open(f"/proc/{pid}/stat") as stat:
        state = stat.read().rpartition(")")[2].split()[0]
except (FileNotFoundError, ProcessLookupError):  # gone before the open, or before the read
    state = "gone"
try:
    os.kill(pid, 0)
    signalable = True
except ProcessLookupError:
    signalable = False
report = {"start": start, "state": state, "kill0": signalable}
with open(os.path.join(folder, "second.tmp"), "w") as out:
    json.dump(report, out)
os.replace(os.path.join(folder, "second.tmp"), os.path.join(folder, "second.json"))
"""


@dataclass(frozen=True)
class Stamps:
    """FIRST's log: its stamps in order, ``(what, monotonic seconds)``."""

    lines: list[tuple[str, float]]

    @classmethod
    def read(cls, path: Path) -> Stamps:
        found: list[tuple[str, float]] = []
        for line in path.read_text().splitlines() if path.exists() else []:
            what, _, moment = line.partition(" ")
            with contextlib.suppress(ValueError):  # a line torn by SIGKILL
                found.append((what, float(moment)))
        return cls(found)

    def last(self) -> float | None:
        return self.lines[-1][1] if self.lines else None

    def term(self) -> float | None:
        return next((moment for what, moment in self.lines if what == "term"), None)

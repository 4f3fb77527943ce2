"""The election processes test's workers, and their stamp files read back.

Run as ``python -m tests._support.election_workers ROLE CONFIG`` from the
repository's root (``tests/integration/test_election_processes.py`` starts
them), ``CONFIG`` a :class:`Config` as JSON:

- ``contender``: campaigns for the name with a :class:`~dmutex.DElection`
  (TTL :data:`TTL`), and while it leads appends ``lead <term> <pid> <time>``
  to its own file every :data:`STAMP_EVERY` seconds, asking
  ``leadership.lost`` before each stamp; once lost it stamps ``lost`` and
  campaigns again. ``<time>`` is ``time.time()``: every process runs on
  this host, so all stamps read one clock (the servers' too).
- ``observer``: follows ``observe(name, poll=OBSERVE_POLL)`` and appends
  ``seen <term> <identity> <time>`` for each leader it yields
  (``seen none - <time>`` for nobody).

Each line is one ``os.write`` to a file opened with ``O_APPEND``: a SIGKILL
ends a process between two lines, not inside one. Every worker exits by
itself after :attr:`Config.lifetime` seconds, or once its parent is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dmutex import DElection

TTL = 1.5  # the leader's lease, renewed every third of it
STAMP_EVERY = 0.05  # a leader's stamp period, seconds
OBSERVE_POLL = 0.05  # the observer's poll
CAMPAIGN_SLICE = 1.0  # a campaign's timeout: between two, the worker checks it may go on


@dataclass(frozen=True)
class Config:
    """What every worker of one run is told (as JSON on its command line)."""

    backend: str  # "redis" or "postgresql"
    url: str
    schema: str | None  # PostgreSQL's schema; None on Redis
    service: str
    name: str  # the name campaigned for
    log: str  # this worker's stamp file
    lifetime: float  # the worker exits by itself after this many seconds

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Config:
        return cls(**json.loads(text))


def identity_of(pid: int) -> str:
    """The identity a contender campaigns under."""
    return f"pid:{pid}"


# --- in the worker ------------------------------------------------------------------------


@contextlib.contextmanager
def _election(config: Config, identity: str | None) -> Iterator[DElection]:
    """An election over a client of its own: redis-py, or a psycopg connection in autocommit."""
    options: dict[str, Any] = {"ttl": TTL, "identity": identity}
    if config.backend == "redis":
        import redis

        client = redis.Redis.from_url(config.url)
        try:
            yield DElection(config.service, client, **options)
        finally:
            client.close()
    elif config.backend == "postgresql":
        import psycopg

        with psycopg.connect(config.url, autocommit=True) as conn:
            yield DElection(config.service, conn, schema_name=config.schema, **options)
    else:
        raise ValueError(f"unknown backend {config.backend!r}")


def _guard(lifetime: float) -> None:
    """End this process after ``lifetime`` seconds, or as soon as its parent is gone."""
    parent, deadline = os.getppid(), time.monotonic() + lifetime

    def watch() -> None:
        while time.monotonic() < deadline and os.getppid() == parent:
            time.sleep(0.2)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


class _Log:
    """A stamp file: one ``os.write`` per line, appended."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def line(self, *fields: object) -> None:
        os.write(self._fd, (" ".join(map(str, fields)) + "\n").encode())


def contender(config: Config) -> None:
    """Campaign, stamp while leading, campaign again once lost: until stopped."""
    pid = os.getpid()
    log = _Log(config.log)
    with _election(config, identity_of(pid)) as election:
        log.line("ready", 0, pid, f"{time.time():.6f}")
        while True:
            leadership = election.campaign(config.name, timeout=CAMPAIGN_SLICE)
            if leadership is None:
                continue
            term = leadership.term
            while not leadership.lost:
                log.line("lead", term, pid, f"{time.time():.6f}")
                time.sleep(STAMP_EVERY)
            log.line("lost", term, pid, f"{time.time():.6f}")


def observer(config: Config) -> None:
    """Write down every leader ``observe`` yields: until stopped."""
    log = _Log(config.log)
    with _election(config, None) as election:
        for leader in election.observe(config.name, poll=OBSERVE_POLL):
            if leader is None:
                log.line("seen", "none", "-", f"{time.time():.6f}")
            else:
                log.line("seen", leader.term, leader.identity, f"{time.time():.6f}")


def main(argv: list[str]) -> None:
    role, text = argv
    config = Config.from_json(text)
    _guard(config.lifetime)
    {"contender": contender, "observer": observer}[role](config)


# --- in the test: the files read back -------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """One stamp: ``what`` (lead, lost, ready, seen), a term, who, and when (``time.time()``)."""

    what: str
    term: int | None
    who: str
    at: float


def read_lines(path: Path) -> list[Line]:
    """A worker's stamps, in the order written; a torn line (there should be none) is skipped."""
    found: list[Line] = []
    for text in path.read_text().splitlines() if path.exists() else []:
        parts = text.split(" ")
        if len(parts) != 4:
            continue
        what, term, who, at = parts
        with contextlib.suppress(ValueError):
            found.append(Line(what, None if term == "none" else int(term), who, float(at)))
    return found


@dataclass(frozen=True)
class Stint:
    """One process's leadership as its stamps show it: its term, first and last stamps."""

    term: int
    pid: int
    first: float
    last: float
    stamps: int


def stints(paths: list[Path]) -> list[Stint]:
    """Every leadership stamped in ``paths``, ordered by its first stamp.

    A stint is a process's run of ``lead`` stamps of one term, ended by a
    ``lost`` stamp, another term, or the end of its file.
    """
    found: list[Stint] = []
    for path in paths:
        current: Stint | None = None
        for line in read_lines(path):
            if line.what == "lead" and line.term is not None:
                if current is not None and current.term == line.term:
                    last = max(current.last, line.at)
                    current = Stint(
                        current.term, current.pid, current.first, last, current.stamps + 1
                    )
                    continue
                if current is not None:
                    found.append(current)
                current = Stint(line.term, int(line.who), line.at, line.at, 1)
            elif line.what == "lost" and current is not None:
                found.append(current)
                current = None
        if current is not None:
            found.append(current)
    return sorted(found, key=lambda stint: stint.first)


if __name__ == "__main__":
    main(sys.argv[1:])

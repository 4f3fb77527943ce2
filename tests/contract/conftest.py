"""The backends the contract suite runs against.

Each case makes clients for one backend and one face. Later backends add a
case here; the tests in this folder do not change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from dmutex import InMemoryBackend, ManualClock
from tests._support.faces import Face, FaceName, Kind, LoopThread


@dataclass
class Env:
    """One backend, one face: makes instances over a shared client."""

    face: FaceName
    client: object
    clock: ManualClock | None
    expire_fn: Callable[[str, int | None], None]
    loop: LoopThread | None = None

    def make(self, kind: Kind, **options: Any) -> Face:
        return Face(self.face, kind, self.client, loop=self.loop, **options)

    def expire(self, key: str, slot: int | None = None) -> None:
        """Make the permits of ``key`` expire now, leaving their records in place."""
        self.expire_fn(key, slot)

    def need_clock(self) -> ManualClock:
        if self.clock is None:
            pytest.skip("this backend keeps real time; the test needs a ManualClock")
        return self.clock


def _memory(face: FaceName) -> Env:
    clock = ManualClock()
    backend = InMemoryBackend(clock=clock)

    def expire(key: str, slot: int | None) -> None:
        backend.force_expire(key, slot)

    return Env(face, backend, clock, expire)


CASES: dict[str, Callable[[], Env]] = {
    "memory-sync": lambda: _memory("sync"),
    "memory-async": lambda: _memory("async"),
}


@pytest.fixture(params=sorted(CASES))
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    made = CASES[request.param]()
    if made.face == "async":
        made.loop = LoopThread()
    try:
        yield made
    finally:
        if made.loop is not None:
            made.loop.close()

"""What the state machine needs from a backend, and the InMemoryBackend's answer.

A harness makes clients, forces a permit to expire, reads what storage holds,
and cleans up. The Redis and MongoDB issues add a harness each; the state
machine does not change.
"""

from __future__ import annotations

from typing import Protocol

from dmutex import InMemoryBackend, ManualClock


class Harness(Protocol):
    clock: ManualClock | None
    """A clock the machine may move, or None where the backend keeps real time."""

    ttls: tuple[float, ...]
    """Lease lengths (seconds) to draw from; whole milliseconds each."""

    def client(self, asynchronous: bool) -> object:
        """A client for the sync or the asyncio classes; all share one storage."""
        ...

    def force_expire(self, prefix: str, key: str, slot: int) -> None:
        """Make the permit in ``slot`` of ``key`` expire now, wherever it is stored."""
        ...

    def active(self, prefix: str) -> dict[str, str]:
        """Active permits under ``prefix``: storage key -> token."""
        ...

    def close(self) -> None:
        """Release whatever the harness holds."""
        ...


class MemoryHarness:
    """InMemoryBackend on a ManualClock."""

    ttls: tuple[float, ...] = (0.001, 0.25, 1.5, 30.0)

    def __init__(self) -> None:
        self.clock: ManualClock | None = ManualClock()
        self._backend = InMemoryBackend(clock=self.clock)

    def client(self, asynchronous: bool) -> object:
        return self._backend

    def force_expire(self, prefix: str, key: str, slot: int) -> None:
        self._backend.force_expire(key, slot)

    def active(self, prefix: str) -> dict[str, str]:
        return {
            name: token
            for name, (token, _) in self._backend.snapshot().items()
            if name.startswith(prefix)
        }

    def close(self) -> None:
        pass

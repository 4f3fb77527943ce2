"""An executable model of a read-write lock, on a logical clock, with renewal, intents and fences.

Time is an integer count of milliseconds. Per key: any number of readers
(at most ``max_readers``) or one writer, never both; a hold is active while
``now < expires`` or while it is renewed. A waiting writer's intent, active
while ``now < until``, refuses new readers (not writers, not readers already
in). Every grant of a key, read or write, carries a fence strictly above
every earlier grant's of that key. Nothing here knows about backends, faces
or I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

READ = 1  # the slot a reader's hold reports
WRITE = 0  # and a writer's


@dataclass
class Hold:
    token: str
    side: int  # READ or WRITE
    expires: int
    renewed: bool = False


@dataclass
class RWModel:
    """The holds and intents of every key, and the time."""

    max_readers: int | None
    now: int = 0
    holds: dict[str, dict[str, Hold]] = field(default_factory=dict)
    intents: dict[str, dict[str, int]] = field(default_factory=dict)
    fences: dict[str, int] = field(default_factory=dict)

    def active(self, key: str) -> dict[str, Hold]:
        """Token -> hold, for the holds of ``key`` active now."""
        held = self.holds.get(key, {})
        return {t: h for t, h in held.items() if h.renewed or self.now < h.expires}

    def intending(self, key: str) -> dict[str, int]:
        """Token -> until, for the intents of ``key`` standing now."""
        return {t: u for t, u in self.intents.get(key, {}).items() if self.now < u}

    def writer(self, key: str) -> Hold | None:
        return next((h for h in self.active(key).values() if h.side == WRITE), None)

    def readers(self, key: str) -> list[Hold]:
        return [h for h in self.active(key).values() if h.side == READ]

    def may_read(self, key: str) -> bool:
        """Whether a new reader of ``key`` is granted now."""
        full = self.max_readers is not None and len(self.readers(key)) >= self.max_readers
        return self.writer(key) is None and not self.intending(key) and not full

    def may_write(self, key: str) -> bool:
        """Whether a new writer of ``key`` is granted now (others' intents do not stop it)."""
        return not self.active(key)

    def grant(self, key: str, token: str, side: int, ttl: int, *, renewed: bool = False) -> int:
        """Record ``token``'s new hold; it must be allowed. Returns the expiry."""
        assert self.may_read(key) if side == READ else self.may_write(key)
        self.holds.setdefault(key, {})[token] = Hold(token, side, self.now + ttl, renewed)
        self.intents.get(key, {}).pop(token, None)
        return self.now + ttl

    def intend(self, key: str, token: str, until: int) -> None:
        """A writer's refused attempt leaves its intent until ``until``."""
        self.intents.setdefault(key, {})[token] = until

    def take_fence(self, key: str, fence: int | None) -> bool:
        """Whether a grant of ``key`` may carry ``fence``: above every earlier one. Keeps it."""
        if fence is None:
            return False
        earlier, self.fences[key] = self.fences.get(key, 0), fence
        return fence > earlier

    def release(self, key: str, token: str) -> bool:
        """End ``token``'s hold and intent on ``key``; whether a hold was active."""
        self.intents.get(key, {}).pop(token, None)
        if token not in self.active(key):
            return False
        del self.holds[key][token]
        return True

    def extend(self, key: str, token: str, ttl: int) -> int | None:
        """The new expiry, or None when no active hold has ``token``."""
        hold = self.active(key).get(token)
        if hold is None:
            return None
        hold.expires = self.now + ttl
        return hold.expires

    def expire(self, key: str, token: str) -> bool:
        """``token``'s hold (if active) expires now; whether it was renewed (its renewal ends)."""
        hold = self.active(key).get(token)
        if hold is None:
            return False
        hold.expires = self.now
        renewed, hold.renewed = hold.renewed, False
        return renewed

    def advance(self, ms: int) -> None:
        self.now += ms

    def storage(self, key: str) -> list[tuple[int, str]]:
        """The active holds of ``key`` as a store reports them: ``(slot, token)``, sorted."""
        return sorted((h.side, h.token) for h in self.active(key).values())

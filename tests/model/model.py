"""An executable model of the contract's section 3, on a logical clock, with renewal and fences.

Time is an integer count of milliseconds. A permit is active while
``now < expires``, or while it is renewed: renewal keeps it active for as long
as nothing removes it (the machine moves time in steps short enough for
that). Each grant of a key carries a fence strictly above every earlier
grant's of that key (a store may skip numbers: its clock in microseconds is
a floor). Nothing here knows about backends, faces or I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Permit:
    token: str
    expires: int
    renewed: bool = False


@dataclass
class Model:
    """The permits of every key, and the time."""

    max_permits: int
    now: int = 0
    permits: dict[str, dict[int, Permit]] = field(default_factory=dict)
    fences: dict[str, int] = field(default_factory=dict)

    def active(self, key: str) -> dict[int, Permit]:
        """Slot -> permit, for the permits of ``key`` that are active now."""
        slots = self.permits.get(key, {})
        return {slot: p for slot, p in slots.items() if p.renewed or self.now < p.expires}

    def take_fence(self, key: str, fence: int | None) -> bool:
        """Whether a grant of ``key`` may carry ``fence`` now: above every earlier one. Keeps it."""
        if fence is None:
            return False
        earlier, self.fences[key] = self.fences.get(key, 0), fence
        return fence > earlier

    def is_full(self, key: str) -> bool:
        return len(self.active(key)) == self.max_permits

    def grant(self, key: str, slot: int, token: str, ttl: int, *, renewed: bool = False) -> int:
        """Record that ``token`` took ``slot``; the slot must be free. Returns the expiry."""
        assert 0 <= slot < self.max_permits, f"slot {slot} out of range"
        assert slot not in self.active(key), f"slot {slot} of {key!r} is taken"
        self.permits.setdefault(key, {})[slot] = Permit(token, self.now + ttl, renewed)
        return self.now + ttl

    def _holding(self, key: str, token: str) -> int | None:
        return next((s for s, p in self.active(key).items() if p.token == token), None)

    def release(self, key: str, token: str) -> bool:
        slot = self._holding(key, token)
        if slot is None:
            return False
        del self.permits[key][slot]
        return True

    def extend(self, key: str, token: str, ttl: int) -> int | None:
        """The new expiry, or None when no active permit holds ``token``."""
        slot = self._holding(key, token)
        if slot is None:
            return None
        self.permits[key][slot].expires = self.now + ttl
        return self.now + ttl

    def advance(self, ms: int) -> None:
        self.now += ms

    def expire(self, key: str, slot: int) -> str | None:
        """The permit in ``slot`` (if any) expires now; returns its token if it was renewed.

        Renewal of that permit is then refused: it ends too.
        """
        permit = self.active(key).get(slot)
        if permit is None:
            return None
        permit.expires = self.now
        renewed, permit.renewed = permit.renewed, False
        return permit.token if renewed else None

    def storage(self, prefix: str) -> dict[str, str]:
        """Active permits as the Redis layout names them: storage key -> token."""
        return {
            f"{prefix}permit:{slot}:{key}": permit.token
            for key in self.permits
            for slot, permit in self.active(key).items()
        }

"""What the paused-holder tests share: the leases' TTLs, the stale calls, a lease's slot.

A holder (a child of :func:`tests._support.processes.spawned`) acquires with
:data:`TTL`, is stopped by SIGSTOP past it, its key is taken over with
:data:`NEW_TTL`, and on SIGCONT it makes the :data:`CALLS` on its stale lease,
its extends asking for :data:`STALE_TTL`: longer than the new holder's, so
that a wrong extend would show as a later expiry.
"""

from __future__ import annotations

from dmutex import AsyncDSemaphorePermit, DSemaphorePermit
from tests._support.faces import RawHandle

TTL = 0.5  # the paused holder's lease
NEW_TTL = 20.0  # the new holder's
STALE_TTL = 60.0  # what the paused holder's extend asks for: longer than NEW_TTL
FILL_TTL = 30.0  # a semaphore's other permit, held by the test throughout
CALLS = ("extend by handle", "extend by token", "release by handle", "release by token")


def slot_of(lease: RawHandle) -> int:
    """A permit's slot; a mutex's lock is in slot 0."""
    return lease.slot if isinstance(lease, (DSemaphorePermit, AsyncDSemaphorePermit)) else 0

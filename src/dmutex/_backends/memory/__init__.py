"""The in-memory backend: one process's memory, for tests and single-process use.

- ``backend.py``: :class:`InMemoryBackend`, its records and waiters;
- ``store.py``: the mutex and semaphore store;
- ``readwrite.py``: the read-write store.
"""

from __future__ import annotations

from .backend import InMemoryBackend
from .descriptor import BACKEND
from .readwrite import MemoryReadWriteStore
from .store import MemoryStore

__all__ = ["BACKEND", "InMemoryBackend", "MemoryReadWriteStore", "MemoryStore"]

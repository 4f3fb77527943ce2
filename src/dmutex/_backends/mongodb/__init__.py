"""The MongoDB backend: leases as documents of one collection.

- ``store.py``: mutexes and semaphores (a document per slot, the fence
  counter's document), and what the read-write store shares with it;
- ``readwrite.py``: read-write locks, one document per key, updated by
  aggregation pipelines.
"""

from __future__ import annotations

from .descriptor import BACKEND
from .readwrite import MongoReadWriteStore
from .store import MongoStore

__all__ = ["BACKEND", "MongoReadWriteStore", "MongoStore"]

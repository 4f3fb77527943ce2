"""The DynamoDB backend: leases as items of one table, taken by conditional writes.

- ``store.py``: mutexes and semaphores (its rules and limits at its top);
- ``readwrite.py``: read-write locks, one item per key, compare-and-set;
- ``table.py``: the table, found or created, and waited for;
- ``requests.py``: the requests' and replies' shapes; ``names.py``: the
  naming rules; ``shapes.py``: what a client looks like.
"""

from __future__ import annotations

from .descriptor import BACKEND
from .readwrite import DynamoReadWriteStore
from .store import DynamoStore

__all__ = ["BACKEND", "DynamoReadWriteStore", "DynamoStore"]

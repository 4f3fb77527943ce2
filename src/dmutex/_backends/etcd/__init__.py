"""The etcd backend: leases as keys under etcd leases, fenced by etcd's revision.

- ``store.py``: mutexes and semaphores (its rules and limits at its top);
- ``readwrite.py``: read-write locks, each hold a key under a lease;
- ``leases.py``: the leases of both stores' holds; ``watching.py``: waits;
- ``requests.py``: the two dialects its requests are sent in (etcd3gw's
  JSON gateway, aetcd's gRPC), and the plain types their replies are read
  into.
"""

from __future__ import annotations

from .descriptor import BACKEND
from .readwrite import EtcdReadWriteStore
from .store import EtcdStore

__all__ = ["BACKEND", "EtcdReadWriteStore", "EtcdStore"]

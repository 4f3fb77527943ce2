"""etcd's key layout words, the prefix rule that keeps namespaces apart, a transaction's size."""

from __future__ import annotations

from ..prefixes import check_prefix

ETCD_KINDS = ("permit", "rwlock")
"""The words of the etcd layout: each key is ``f"{key_prefix}{kind}:..."`` of one of them."""

TXN_OPS = 128
"""The most operations dmutex puts in one etcd transaction: etcd's ``--max-txn-ops`` default."""


def check_etcd_prefix(prefix: str, origin: str) -> None:
    """Refuse a key prefix whose keys could be another prefix's (``prefixes.check_prefix``)."""
    check_prefix(prefix, origin, ETCD_KINDS, "etcd")

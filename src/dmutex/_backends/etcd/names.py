"""etcd's key layout words, the prefix rule that keeps namespaces apart, and its permit limit."""

from __future__ import annotations

from ..._errors import InvalidArgumentError
from ..prefixes import check_prefix

ETCD_KINDS = ("permit", "rwlock")
"""The words of the etcd layout: each key is ``f"{key_prefix}{kind}:..."`` of one of them."""

MAX_ETCD_PERMITS = 127
"""The most permits a semaphore has on etcd.

A failed grant reads every slot key in one transaction, and etcd takes at
most 128 operations in one (its ``--max-txn-ops`` default).
"""


def check_etcd_prefix(prefix: str, origin: str) -> None:
    """Refuse a key prefix whose keys could be another prefix's (``prefixes.check_prefix``)."""
    check_prefix(prefix, origin, ETCD_KINDS, "etcd")


def check_etcd_permits(permits: int) -> None:
    """Refuse more permits than one etcd transaction can read (:data:`MAX_ETCD_PERMITS`)."""
    if permits > MAX_ETCD_PERMITS:
        raise InvalidArgumentError(
            f"max_permits={permits}: on etcd a semaphore has at most {MAX_ETCD_PERMITS} "
            "permits (a grant reads every slot in one transaction, and etcd takes at most "
            "128 operations in one)"
        )

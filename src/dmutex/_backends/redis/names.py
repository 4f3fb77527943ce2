"""Redis's key layout words, and the rule that keeps two namespaces' records apart."""

from __future__ import annotations

from ..prefixes import check_prefix

REDIS_KINDS = ("permit", "fence", "holders", "waiters", "signal", "rwlock")
"""The words of the Redis layout: each record is ``f"{key_prefix}{kind}:..."`` of one of them."""


def check_redis_prefix(prefix: str, origin: str) -> None:
    """Refuse a Redis key prefix whose records could be another prefix's.

    The rule, and why it keeps names apart, is ``prefixes.check_prefix``'s,
    with the words of :data:`REDIS_KINDS`: ``x:permit:0``, ``x:fence``,
    ``y:rwlock`` are refused; ``permit``, ``x:permits``, ``fence-x:y`` are
    not.
    """
    check_prefix(prefix, origin, REDIS_KINDS, "Redis")

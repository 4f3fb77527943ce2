"""Redis's key layout words, and the rule that keeps two namespaces' records apart."""

from __future__ import annotations

from ..._errors import InvalidArgumentError

REDIS_KINDS = ("permit", "fence", "holders", "waiters", "signal", "rwlock")
"""The words of the Redis layout: each record is ``f"{key_prefix}{kind}:..."`` of one of them."""


def check_redis_prefix(prefix: str, origin: str) -> None:
    """Refuse a Redis key prefix whose records could be another prefix's.

    Every Redis record of a lock is ``prefix + kind + ":" + rest``: ``kind``
    one of :data:`REDIS_KINDS`, ``rest`` the key, or ``f"{slot}:{key}"``
    for a slot key (``key_prefix`` defaults to ``f"_dmutex_{service}:"``,
    ``_dsemaphore_`` or ``_drwlock_``).

    Rule: no ``:``-separated part of the prefix other than its last (the
    text after its last ``:``, empty for every default prefix) is one of
    :data:`REDIS_KINDS`. For a default prefix: no part of the service name
    but its first is one (``x:permit:0``, ``x:fence``, ``y:rwlock`` are
    refused; ``permit``, ``x:permits``, ``fence-x:y`` are not).

    Why no two names collide: let accepted prefixes ``P`` and ``Q``, each
    empty or ending in ``:`` (every default one does), give one record
    name, ``P`` the shorter (equal lengths make ``P == Q``, and the rest
    then reads back one way: the kind up to the first ``:``, a slot key's
    slot up to the next). ``Q`` continues ``P`` in that name with the start
    of ``kind + ":" + rest``; ``Q`` ends in ``:`` and no kind holds one, so
    ``Q`` holds all of ``kind + ":"`` after ``P``, which is empty or ends
    in ``:``: ``kind`` is a whole part of ``Q`` before its last ``:``,
    which the rule refuses. A ``key_prefix`` that ends in another character
    (``"app-"``) is accepted as before and stays out of this guarantee:
    ``"app-"`` and ``"app-fence:"`` can collide, and keeping such prefixes
    apart is the caller's choice. ``origin`` says where the prefix came from.
    """
    parts = prefix.split(":")[:-1]
    for part in parts:
        if part in REDIS_KINDS:
            words = ", ".join(REDIS_KINDS)
            raise InvalidArgumentError(
                f"{origin} cannot name a Redis namespace: its ':'-separated part {part!r} "
                f"is a word of dmutex's Redis key layout ({words}), so its records could be "
                "those of another service or key_prefix"
            )

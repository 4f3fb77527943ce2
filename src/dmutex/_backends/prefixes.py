"""The rule that keeps two key prefixes' records apart, where names are prefix + word + key.

Used by the key-value stores, whose every record of a lock is
``prefix + kind + ":" + rest``: Redis (``redis/names.py``) and etcd
(``etcd/names.py``), each with its own words.
"""

from __future__ import annotations

from .._errors import InvalidArgumentError


def check_prefix(prefix: str, origin: str, kinds: tuple[str, ...], label: str) -> None:
    """Refuse a key prefix whose records could be another prefix's.

    Every record of a lock is ``prefix + kind + ":" + rest``: ``kind`` one
    of ``kinds``, ``rest`` the key, or ``f"{slot}:{key}"`` for a slot key
    (``key_prefix`` defaults to ``f"_dmutex_{service}:"``, ``_dsemaphore_``
    or ``_drwlock_``).

    Rule: no ``:``-separated part of the prefix other than its last (the
    text after its last ``:``, empty for every default prefix) is one of
    ``kinds``. For a default prefix: no part of the service name but its
    first is one (``x:permit:0``, ``y:rwlock`` are refused; ``permit``,
    ``x:permits``, ``fence-x:y`` are not).

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
    apart is the caller's choice. ``origin`` says where the prefix came
    from; ``label`` names the backend in the message.
    """
    for part in prefix.split(":")[:-1]:
        if part in kinds:
            words = ", ".join(kinds)
            raise InvalidArgumentError(
                f"{origin} cannot name a {label} namespace: its ':'-separated part {part!r} "
                f"is a word of dmutex's {label} key layout ({words}), so its records could be "
                "those of another service or key_prefix"
            )

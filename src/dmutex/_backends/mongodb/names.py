"""MongoDB's rules for database and collection names, checked before any request."""

from __future__ import annotations

from ..._errors import InvalidArgumentError
from ..._validate import check_str

# MongoDB's own rules for names, so that a bad one fails at construction
# rather than at the first write.
_BAD_DB_CHARS = frozenset('/\\. "$\x00')


def check_db_name(value: object) -> str:
    """Return a MongoDB database name that the server will accept."""
    name = check_str("db_name", value)
    bad = sorted(_BAD_DB_CHARS.intersection(name))
    if bad:
        raise InvalidArgumentError(f"db_name {name!r} contains {bad!r}")
    if len(name.encode()) >= 64:
        raise InvalidArgumentError(f"db_name {name!r} is 64 bytes or longer")
    return name


# MongoDB's longest namespace, f"{db_name}.{collection_name}", in UTF-8 bytes.
_MAX_NAMESPACE_BYTES = 255


def check_collection_name(value: str, origin: str, db_name: str) -> str:
    """Return a MongoDB collection name that the server (and pymongo) will accept.

    ``origin`` says where the name came from, for the error message.
    """
    if not value:
        raise InvalidArgumentError(f"{origin} gives an empty collection name")
    if value.startswith(".") or value.endswith(".") or ".." in value:
        raise InvalidArgumentError(
            f"{origin} gives collection name {value!r}: it must not start or end with '.' "
            "or contain '..'"
        )
    namespace = len(db_name.encode()) + 1 + len(value.encode())
    if namespace > _MAX_NAMESPACE_BYTES:
        raise InvalidArgumentError(
            f"{origin} gives collection name {value[:40]!r}...: with db_name {db_name!r} the "
            f"namespace is {namespace} bytes, over MongoDB's {_MAX_NAMESPACE_BYTES}"
        )
    if "$" in value or "\x00" in value:
        raise InvalidArgumentError(
            f"{origin} gives collection name {value!r}, which contains '$' or NUL"
        )
    if value.startswith("system."):
        raise InvalidArgumentError(
            f"{origin} gives collection name {value!r}; 'system.' is reserved"
        )
    return value

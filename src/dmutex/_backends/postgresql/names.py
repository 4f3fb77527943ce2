"""PostgreSQL's rules for table and schema names, checked before any statement."""

from __future__ import annotations

from ..._errors import InvalidArgumentError
from ..._validate import shown

# PostgreSQL truncates a longer identifier (NAMEDATALEN - 1 bytes) with only a
# NOTICE; the table and its index would then have names dmutex never asked for.
MAX_POSTGRES_IDENTIFIER_BYTES = 63
# The index beside the table is named f"{table}{_INDEX_SUFFIX}" (the TypeScript store's name).
_INDEX_SUFFIX = "_expired_at_idx"


def check_postgres_names(table: str, origin: str, schema: str | None) -> None:
    """Refuse a PostgreSQL table or schema name the server would not keep as given.

    Non-empty, no NUL byte, and at most 63 bytes of UTF-8 (PostgreSQL cuts a
    longer identifier short); for the table, its index name
    ``<table>_expired_at_idx`` too, so the table's own name is at most 48
    bytes. ``origin`` says where the table name came from.
    """
    if schema is not None:
        _check_postgres_identifier(schema, "schema_name", "schema_name")
    _check_postgres_identifier(table, origin, "table name")
    index = len(table.encode()) + len(_INDEX_SUFFIX)
    if index > MAX_POSTGRES_IDENTIFIER_BYTES:
        raise InvalidArgumentError(
            f"{origin} gives table name {shown(table)}: its index name (the table's "
            f"+ {_INDEX_SUFFIX!r}) would be {index} bytes, over PostgreSQL's "
            f"{MAX_POSTGRES_IDENTIFIER_BYTES}; a table name may have at most "
            f"{MAX_POSTGRES_IDENTIFIER_BYTES - len(_INDEX_SUFFIX)} bytes (UTF-8)"
        )


def check_postgres_schema(schema: str, origin: str) -> None:
    """Refuse a PostgreSQL schema name as :func:`check_postgres_names` does.

    ``origin`` says where the name came from.
    """
    _check_postgres_identifier(schema, origin, "schema name")


def _check_postgres_identifier(value: str, origin: str, what: str) -> None:
    if not value or "\0" in value:
        raise InvalidArgumentError(
            f"{origin} gives PostgreSQL {what} {value!r}: it must be non-empty, without NUL bytes"
        )
    size = len(value.encode())
    if size > MAX_POSTGRES_IDENTIFIER_BYTES:
        raise InvalidArgumentError(
            f"{origin} gives PostgreSQL {what} {shown(value)} of {size} bytes, over PostgreSQL's "
            f"{MAX_POSTGRES_IDENTIFIER_BYTES} (the server would cut it short)"
        )

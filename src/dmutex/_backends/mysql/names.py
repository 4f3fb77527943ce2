"""MySQL's and MariaDB's rules for table and database names, checked before any statement."""

from __future__ import annotations

from ..._errors import InvalidArgumentError
from ..._validate import shown

MAX_MYSQL_IDENTIFIER = 64
"""The longest MySQL table or database name, in characters."""


def check_mysql_names(table: str, origin: str, database: str | None) -> None:
    """Refuse a MySQL table or database name the server would refuse or change.

    Non-empty, no NUL byte, at most 64 characters, not ending in a space
    (MySQL and MariaDB refuse all of these, but only once a statement
    reaches them). ``origin`` says where the table name came from.
    """
    if database is not None:
        _check_mysql_identifier(database, "database_name", "database name")
    _check_mysql_identifier(table, origin, "table name")


def _check_mysql_identifier(value: str, origin: str, what: str) -> None:
    if not value or "\0" in value or value.endswith(" "):
        raise InvalidArgumentError(
            f"{origin} gives MySQL {what} {shown(value)}: it must be non-empty, without NUL "
            "bytes, and not end with a space"
        )
    if len(value) > MAX_MYSQL_IDENTIFIER:
        raise InvalidArgumentError(
            f"{origin} gives MySQL {what} {shown(value)} of {len(value)} characters, over "
            f"MySQL's {MAX_MYSQL_IDENTIFIER}"
        )

"""DynamoDB's rule for table names, checked before any request; why item keys need none."""

from __future__ import annotations

import re

from ..._errors import InvalidArgumentError

# The TypeScript store's check, which is DynamoDB's own rule for a table name.
_TABLE_NAME = re.compile(r"[a-zA-Z0-9_.-]{3,255}")

KEY_BYTES = 2048
"""The longest partition key value DynamoDB stores, in UTF-8 bytes.

No lock key reaches it, so the stores have no rule of their own for keys:
a key is at most 500 characters (``dmutex._validate``), 2,000 bytes of
UTF-8, and the longest item key made of one, ``permit:1023:<key>``, is
2,012 bytes. A lone surrogate, which UTF-8 cannot carry, is refused for
every backend.
"""


def check_table_name(name: str, origin: str) -> str:
    """Return ``name`` if DynamoDB takes it as a table name; ``origin`` names where it came from."""
    if not _TABLE_NAME.fullmatch(name):
        raise InvalidArgumentError(
            f"{origin} gives DynamoDB table name {name[:60]!r}: it must be 3 to 255 characters, "
            "each a letter, a digit, '_', '-' or '.'"
        )
    return name

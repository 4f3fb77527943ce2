"""What a token dmutex writes looks like, for tests that find tokens among a request's arguments.

A UUID4 string, then, unless the instance was made with ``identity=""``,
the holder's stamp (``dmutex._core.stamps``): ``|since_ms|identity``, the
identity percent-encoded, with no ``|`` of its own.
"""

from __future__ import annotations

import re

TOKEN = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}(?:\|[0-9]{1,13}\|[^|]*)?"
)
"""A whole token (``TOKEN.fullmatch``): its UUID4, and its stamp where it has one."""

"""What makes a client a MongoDB client: no I/O."""

from __future__ import annotations

from ..shapes import defines


def recognises(client: object) -> bool:
    """Whether ``client`` has the MongoDB shape: ``get_database``."""
    return defines(client, "get_database")

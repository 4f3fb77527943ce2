"""Read-write lock rows as the SQL stores keep them (JSON state), changed by hand in tests."""

from __future__ import annotations

import json


def hold_expired(value: str, token: str, now: int) -> str:
    """A read-write row's JSON ``value``, ``token``'s hold expiring by ``now`` (ms)."""
    state = json.loads(value)
    if state["w"] is not None and state["w"][0] == token:
        state["w"][1] = min(state["w"][1], now)
    if token in state["r"]:
        state["r"][token] = min(state["r"][token], now)
    return json.dumps(state, separators=(",", ":"))

"""Redis Cluster hash slots: which keys one script may touch together.

A cluster runs a script only when every key it declares lies in one hash
slot. These functions compute slots as the server does (CRC16/XMODEM of the
hashed part, mod 16384), so that dmutex can tell before sending.
"""

from __future__ import annotations

from collections.abc import Sequence


def _crc16_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
        table.append(crc & 0xFFFF)
    return table


_CRC16 = _crc16_table()


def _hashed_part(key: str) -> bytes:
    """The part of ``key`` Redis Cluster hashes: the first non-empty ``{tag}``, or all."""
    data = key.encode()
    start = data.find(b"{")
    if start != -1:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            return data[start + 1 : end]
    return data


def hash_slot(key: str) -> int:
    """The Redis Cluster hash slot of ``key`` (CRC16/XMODEM mod 16384, hash tags honoured)."""
    crc = 0
    for byte in _hashed_part(key):
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16[((crc >> 8) ^ byte) & 0xFF]
    return crc % 16384


def same_hash_slot(keys: Sequence[str]) -> bool:
    """Whether a cluster keeps all of ``keys`` in one hash slot (so one script may touch them)."""
    part = _hashed_part(keys[0])
    # CRCs only for keys whose hashed parts differ; untagged slot keys stop at
    # the second key.
    return all(_hashed_part(k) == part or hash_slot(k) == hash_slot(keys[0]) for k in keys[1:])

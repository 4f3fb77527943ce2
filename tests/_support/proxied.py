"""How a redis-py client of a fault test reaches its server through a fault proxy.

:func:`redis_options` gives the keyword arguments: the proxy's address, the
server's password, and one timeout for connecting and for each reply, so
that no request hangs for ever on a fault. The caller adds its retry policy.
"""

from __future__ import annotations

from typing import Any

from tests._support.fault_proxy import FaultProxy
from tests._support.redis_servers import Server


def redis_options(proxy: FaultProxy, server: Server, timeout: float) -> dict[str, Any]:
    """Keyword arguments of a ``redis.Redis`` / ``redis.asyncio.Redis`` to ``server`` via ``proxy``.

    ``timeout`` bounds the connection and every reply (``socket_timeout``).
    """
    return {
        "host": proxy.host,
        "port": proxy.port,
        "password": server.password,
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
    }

"""One face's Redis clients and lock instances, closed together at the end of a test.

A :class:`FaceRig` holds a test's face (sync or async), its event loop (a
:class:`~tests._support.faces.LoopThread`, async face only) and every Redis
client the test keeps with it. ``close()`` closes the sync clients, then the
async ones on the loop, then stops the loop: nothing outlives the test.
"""

from __future__ import annotations

from typing import TypeVar

import redis
import redis.asyncio

from tests._support.faces import Face, FaceName, Kind, LoopThread

C = TypeVar("C", redis.Redis, redis.asyncio.Redis)


class FaceRig:
    """One face's event loop (async only) and kept clients; :meth:`close` ends them all."""

    def __init__(self, face: FaceName) -> None:
        self.face = face
        self.loop = LoopThread() if face == "async" else None
        self._sync: list[redis.Redis] = []
        self._async: list[redis.asyncio.Redis] = []

    def keep(self, client: C) -> C:
        """Close ``client`` with the rig; the client itself, for chaining."""
        if isinstance(client, redis.asyncio.Redis):
            self._async.append(client)
        else:
            self._sync.append(client)
        return client

    def make(self, kind: str, client: object, max_permits: int = 1) -> Face:
        """A mutex (``kind == "mutex"``) or semaphore of the rig's face over ``client``."""
        chosen: Kind = "mutex" if kind == "mutex" else "semaphore"
        return Face(self.face, chosen, client, max_permits=max_permits, loop=self.loop)

    def close(self) -> None:
        """Close every kept client, the async ones on the loop, then stop the loop."""
        for client in self._sync:
            client.close()
        if self.loop is not None:
            for aclient in self._async:
                self.loop.run(aclient.aclose())
            self.loop.close()

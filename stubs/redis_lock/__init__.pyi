# The part of python-redis-lock 4.0.1 that benchmarks/handoff.py uses (the
# package ships no annotations).

from redis import Redis

__version__: str
UNLOCK_SCRIPT: bytes

class Lock:
    def __init__(
        self,
        redis_client: Redis,
        name: str,
        expire: int | None = None,
        id: str | bytes | None = None,
        auto_renewal: bool = False,
        strict: bool = True,
        signal_expire: int = 1000,
        blocking: bool = True,
    ) -> None: ...
    def acquire(self, blocking: bool = True, timeout: int | None = None) -> bool: ...
    def release(self) -> None: ...

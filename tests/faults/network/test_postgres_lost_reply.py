"""PostgreSQL: an acquire whose reply was lost, sent again, finds the slot it took.

A reply to an acquire dropped by a
:class:`~tests._support.fault_proxy.FaultProxy` after the server ran it
(psycopg sync, asyncpg asyncio; 1 and 3 permits): the connection that lost
it is broken, and the same acquire (same token) sent again on a new
connection answers with the slot the first took, and one row holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random

import asyncpg
import psycopg
import pytest

from dmutex._backends.postgresql import PostgresStore
from dmutex._clock import SYSTEM_CLOCK
from dmutex._core.effects import Steps
from dmutex._core.lease import Lease
from dmutex._runtime.drivers import AsyncDriver, SyncDriver
from tests._support import postgres_servers
from tests._support.fault_proxy import Fault, FaultProxy, Rates
from tests._support.postgres_faults import (
    ASYNC_FAILURES,
    SEED,
    FaceName,
    Inspector,
    asyncpg_dsn,
    is_startup,
    proxied_url,
)


def _nothing() -> Steps[None]:
    yield from ()


@pytest.mark.parametrize("permits", [1, 3])
@pytest.mark.parametrize("face", ["sync", "async"])
def test_an_acquire_whose_reply_was_lost_is_recognised_when_sent_again(
    postgres_server: str, postgres_schema: str, face: FaceName, permits: int
) -> None:
    """DROP_REPLY after the server ran the acquire; the same token again takes no second slot."""
    table = f"_dmutex_lost{random.Random().getrandbits(32):08x}"
    inspector = Inspector(postgres_server, postgres_schema, table)
    key, token, ttl_ms = "k", "0f0f0f0f-0000-4000-8000-00000000beef", 30_000
    upstream = postgres_servers.upstream_of(postgres_server)
    proxy = FaultProxy(upstream, Rates(drop_reply=1.0), seed=SEED, spare=is_startup)
    with proxy, contextlib.closing(inspector):

        def store(client: object) -> PostgresStore:
            return PostgresStore(
                client,
                table,
                permits,
                SYSTEM_CLOCK,
                schema=postgres_schema,
                asynchronous=face == "async",
            )

        if face == "sync":
            drive = SyncDriver(SYSTEM_CLOCK, _nothing)
            with psycopg.connect(proxied_url(postgres_server, proxy), autocommit=True) as conn:
                through = store(conn)
                drive(through.ready())
                with proxy.faults(), pytest.raises(psycopg.OperationalError):
                    drive(through.acquire(key, token, ttl_ms))
                assert conn.closed, "the connection that lost its reply is broken"
            held = inspector.holding([token])
            with psycopg.connect(postgres_server, autocommit=True) as conn:
                again = drive(store(conn).acquire(key, token, ttl_ms))
        else:

            async def main() -> tuple[list[str], Lease | None]:
                drive = AsyncDriver(SYSTEM_CLOCK, _nothing)
                conn = await asyncpg.connect(**asyncpg_dsn(proxied_url(postgres_server, proxy)))
                through = store(conn)
                await drive(through.ready())
                # Prepared (asyncpg caches it) on another key: the faulted send is one chunk,
                # Bind and Execute, which the server runs before its reply is dropped.
                await drive(through.acquire("warm", token, ttl_ms))
                with proxy.faults(), pytest.raises(ASYNC_FAILURES):
                    await drive(through.acquire(key, token, ttl_ms))
                assert conn.is_closed(), "the connection that lost its reply is broken"
                held = await asyncio.to_thread(inspector.holding, [token])
                direct = await asyncpg.connect(**asyncpg_dsn(postgres_server))
                try:
                    again = await drive(store(direct).acquire(key, token, ttl_ms))
                finally:
                    await direct.close()
                return [h for h in held if h.endswith(f":{key}")], again

            held, again = asyncio.run(asyncio.wait_for(main(), 30))
        assert proxy.counts[Fault.DROP_REPLY] == 1
        assert len(held) == 1, f"the server ran the acquire whose reply was lost: {held}"
        assert isinstance(again, Lease)
        assert held == [f"permit:{again.slot}:{key}"], "the copy answers with the first's slot"
        now = [h for h in inspector.holding([token]) if h.endswith(f":{key}")]
        assert now == held, "one slot, not a second"

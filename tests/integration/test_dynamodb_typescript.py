"""The TypeScript dmutex's DynamoDB store and dmutex on one table, on moto's server and dynalite.

The TypeScript library (github.com/song-younghoon/dmutex, 0.4.0) cannot run
here: its store's requests are replayed verbatim through boto3
(``tests._support.typescript_dynamodb``), driven by its ``semaphore.ts``
slot loops. dmutex runs through its public classes on boto3. Neither
server is DynamoDB; both speak its protocol.

What must hold:

- a TypeScript holder excludes dmutex and dmutex excludes it, for a mutex
  and a semaphore, and either takes over the other's expired item;
- both semaphores racing from threads never hold more than ``max_permits``
  together, and every cycle of each side completes (on dynalite: moto's
  server does not make a conditional write atomic under concurrency);
- either library releases and extends the other's grant by its token;
  ``holders`` shows TypeScript grants (an unknown holder: its tokens carry
  no stamp);
- each library's table is the other's: dmutex's ``ready()`` takes the
  table the TypeScript store made, and the TypeScript store dmutex's;
- dmutex's fence item is no permit to the TypeScript store, which never
  changes it.

Known differences, as facts: the TypeScript release ignores expiry (an
expired grant is still deleted by its token), and its semaphore tries slot
after slot (a full one costs a request per permit; dmutex's two).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from dmutex import DMutex, DSemaphore
from tests._support.dynamodb_servers import Server, Session
from tests._support.typescript import Race
from tests._support.typescript_dynamodb import TypeScriptDynamo

KEY = "orders"
# Why races run on dynalite only (docs/usage/dynamodb.md says the same).
MOTO_RACES = (
    "moto's server checks a conditional write's condition and applies the write without a "
    "lock between them: two concurrent writes of one item can both succeed there"
)


@pytest.fixture
def client(dynamodb_server: Server) -> Iterator[Any]:
    made = dynamodb_server.client()
    yield made
    made.close()


@pytest.fixture
def service(
    dynamodb_session: Session, client: Any, request: pytest.FixtureRequest
) -> Iterator[str]:
    """A service name whose default tables are the session's, dropped after the test."""
    name = f"ts{abs(hash(request.node.nodeid)) % 10**8}"
    prefix = dynamodb_session.prefix
    yield f"{prefix}{name}"
    for kind in ("_dmutex_", "_dsemaphore_"):
        try:
            client.delete_table(TableName=f"{kind}{prefix}{name}")
        except client.exceptions.ResourceNotFoundException:
            continue


def age(client: Any, table: str, name: str) -> None:
    """Let the lease in item ``name`` run out now, without sleeping."""
    client.update_item(
        TableName=table,
        Key={"key": {"S": name}},
        UpdateExpression="SET expiredAt = :past",
        ExpressionAttributeValues={":past": {"N": str(int(time.time() * 1000) - 1)}},
    )


def test_a_typescript_mutex_and_dmutexs_exclude_each_other(client: Any, service: str) -> None:
    ts = TypeScriptDynamo(client, f"_dmutex_{service}", 1)
    mutex = DMutex(service, client)
    theirs = ts.acquire(KEY, 60)
    assert theirs is not None
    assert mutex.acquire(KEY, 60) is None
    assert ts.release(KEY, theirs.token)
    ours = mutex.acquire(KEY, 60)
    assert ours is not None
    assert ts.acquire(KEY, 60) is None
    age(client, f"_dmutex_{service}", "permit:0:orders")
    taken = ts.acquire(KEY, 60)
    assert taken is not None, "an expired dmutex item is free to the TypeScript store"
    assert ours.release() is False, "and dmutex's holder knows it is gone"
    age(client, f"_dmutex_{service}", "permit:0:orders")
    assert mutex.acquire(KEY, 60) is not None, "and the reverse"


def test_a_typescript_semaphore_and_dmutexs_share_the_permits(client: Any, service: str) -> None:
    ts = TypeScriptDynamo(client, f"_dsemaphore_{service}", 3)
    sem = DSemaphore(service, client, max_permits=3)
    first, second = ts.acquire(KEY, 60), ts.acquire(KEY, 60)
    assert first is not None
    assert second is not None
    ours = sem.acquire(KEY, 60)
    assert ours is not None
    assert {first.slot, second.slot, ours.slot} == {0, 1, 2}
    assert sem.acquire(KEY, 60) is None
    before = ts.requests
    assert ts.acquire(KEY, 60) is None
    assert ts.requests - before == 3, "the TypeScript store tries slot after slot"
    holders = sem.holders(KEY)
    assert sorted(h.slot for h in holders) == [0, 1, 2]
    unstamped = [h for h in holders if h.slot in (first.slot, second.slot)]
    assert [(h.identity, h.since) for h in unstamped] == [(None, None)] * 2


def test_either_library_releases_and_extends_the_others_grant(client: Any, service: str) -> None:
    ts = TypeScriptDynamo(client, f"_dsemaphore_{service}", 2)
    sem = DSemaphore(service, client, max_permits=2)
    theirs = ts.acquire(KEY, 60)
    assert theirs is not None
    assert sem.extend(KEY, theirs.token, 120) is True
    assert sem.release(KEY, theirs.token) is True
    ours = sem.acquire(KEY, 60)
    assert ours is not None
    assert ts.extend(KEY, ours.token, 120) is True
    assert ts.release(KEY, ours.token) is True
    assert ours.release() is False


def test_the_typescript_release_ignores_expiry_and_dmutexs_does_not(
    client: Any, service: str
) -> None:
    ts = TypeScriptDynamo(client, f"_dmutex_{service}", 1)
    mutex = DMutex(service, client)
    ours = mutex.acquire(KEY, 60)
    assert ours is not None
    age(client, f"_dmutex_{service}", "permit:0:orders")
    assert ours.release() is False, "dmutex: an expired permit is not released"
    assert ts.release(KEY, ours.token) is True, "TypeScript: deleted by its token all the same"


def test_each_librarys_table_is_the_others(client: Any, service: str) -> None:
    TypeScriptDynamo(client, f"_dmutex_{service}", 1)  # the TypeScript store makes it
    DMutex(service, client).ready()
    DSemaphore(service, client, max_permits=2).ready()  # dmutex makes this one
    ts = TypeScriptDynamo(client, f"_dsemaphore_{service}", 2)
    assert ts.acquire(KEY, 60) is not None


def test_dmutexs_fence_item_is_no_permit_to_the_typescript_store(client: Any, service: str) -> None:
    mutex = DMutex(service, client, fencing=True)
    lock = mutex.acquire(KEY, 60)
    assert lock is not None
    assert lock.fence is not None
    assert lock.release() is True
    table = f"_dmutex_{service}"
    fence = client.get_item(TableName=table, Key={"key": {"S": "fence:orders"}})["Item"]
    ts = TypeScriptDynamo(client, table, 1)
    theirs = ts.acquire(KEY, 60)
    assert theirs is not None
    assert ts.release(KEY, theirs.token)
    assert client.get_item(TableName=table, Key={"key": {"S": "fence:orders"}})["Item"] == fence
    again = mutex.acquire(KEY, 60)
    assert again is not None
    assert again.fence is not None
    assert again.fence > lock.fence, "a TypeScript grant between moves no fence back"


def test_a_race_of_both_semaphores_never_exceeds_max_permits(
    dynamodb_server: Server, client: Any, service: str
) -> None:
    if dynamodb_server.kind == "moto":
        pytest.skip(MOTO_RACES)
    # Two TypeScript slot loops and two dmutex semaphores, each in a thread with
    # a client of its own, cycle on one key of two permits. Each records its
    # slot between its grant and its release: a slot held twice at once, or
    # more than two held, is an over-grant.
    permits, rounds = 2, 25
    race = Race(permits, 4)
    table = f"_dsemaphore_{service}"

    def typescript(who: str) -> None:
        with dynamodb_server.connect() as own:
            ts = TypeScriptDynamo(own, table, permits)
            race.start.wait()
            for _ in range(rounds):
                permit = ts.acquire_with_retry(KEY, 30, timeout=30, retry_delay=0.005)
                assert permit is not None, f"{who}: no permit in 30 s"
                race.hold(permit.slot, who)
                assert ts.release(KEY, permit.token)
                race.cycled(who)

    def dmutex_side(who: str) -> None:
        with dynamodb_server.connect() as own:
            sem = DSemaphore(service, own, max_permits=permits)
            race.start.wait()
            for _ in range(rounds):
                permit = sem.acquire_with_retry(KEY, ttl=30, timeout=30, retry_delay=0.005)
                assert permit is not None, f"{who}: no permit in 30 s"
                race.hold(permit.slot, who)
                assert permit.release()
                race.cycled(who)

    DSemaphore(service, client, max_permits=permits).ready()
    racers = {"ts-1": typescript, "ts-2": typescript, "py-1": dmutex_side, "py-2": dmutex_side}
    race.run(racers, timeout=120)
    assert race.errors == []
    assert race.faults == []
    assert race.cycles == dict.fromkeys(racers, rounds)
    assert race.mixed > 0, "the libraries held the permits together: they raced"

"""Elections (``DElection``, ``AsyncDElection``) on every backend and face.

An election is a fencing mutex of the same names: the leader is the holder,
its term the grant's fence. Tests that need time to pass use a short lease
in real time (a renewal every half second), or step the ManualClock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import pytest

from dmutex import ArgumentTypeError, InvalidArgumentError, Leader
from tests._support.backends import Memory, Postgres, Rig
from tests._support.elections import LeadershipHandle, RealSleeps
from tests._support.etcd_backend import Etcd
from tests._support.faces import Handle

NAME = "lead"
# Long enough that no lease runs out during a test, in real time or on a ManualClock.
LONG = 60.0
# A lease that renews (every third of it) within 0.5 s of real time, leaving its
# renewal a second to come back: with 0.6 s (0.4 s left), CI's Python 3.10 run lost
# the lease of an asyncio leader on Redis (run L) and on dynalite (stop 55), a loaded
# machine's renewal taking longer. On a ManualClock, long enough that the clock's
# steps (a quarter second) never miss a renewal.
SHORT_REAL, SHORT_MANUAL = 1.5, 3.0
STEP = 0.25
MS = timedelta(milliseconds=1)


def elected(leadership: LeadershipHandle | None) -> LeadershipHandle:
    assert leadership is not None, "expected the campaign to lead"
    return leadership


def leading(found: Leader | None) -> Leader:
    assert found is not None, "expected somebody to lead"
    return found


def lock(handle: Handle | None) -> Handle:
    assert handle is not None, "expected the permit to be granted"
    return handle


def lost(leadership: LeadershipHandle) -> bool:
    # A call, not the property: mypy would narrow a property across the steps between.
    return leadership.lost


def short_ttl(env: Rig) -> float:
    return SHORT_REAL if env.clock is None else SHORT_MANUAL


def let_renewals_run(env: Rig, seconds: float) -> None:
    """``seconds`` pass: on a ManualClock in steps, letting the async face's renewers run."""
    if env.clock is None:
        time.sleep(seconds)
        return
    turner = env.make("mutex")  # any face on the rig's loop turns it
    remaining = seconds
    while remaining > 1e-9:
        step = min(STEP, remaining)
        env.clock.advance(step)
        env.settle(turner)
        remaining -= step


def eventually(condition: Callable[[], bool], within: float = 3.0) -> bool:
    """Whether ``condition()`` holds within ``within`` seconds of real time."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_a_campaign_on_a_free_name_leads_at_once(env: Rig) -> None:
    mine = env.make_election(identity="node-a", ttl=LONG)
    other = env.make_election(identity="node-b")
    assert other.leader(NAME) is None
    started = None if env.clock is None else env.clock.monotonic()
    before = env.now()
    leadership = elected(mine.campaign(NAME))
    after = env.now()
    if env.clock is not None:
        assert env.clock.monotonic() == started, "no wait at all"
    assert isinstance(leadership.term, int)
    assert not isinstance(leadership.term, bool)
    assert (leadership.name, leadership.identity, leadership.lost) == (NAME, "node-a", False)
    env.assert_expiry(before, after, leadership.until, LONG)
    seen = leading(other.leader(NAME))
    assert (seen.name, seen.identity, seen.term) == (NAME, "node-a", leadership.term)
    assert seen.since is not None
    assert seen.since == leadership.since
    assert before - MS <= seen.since <= after + MS
    assert seen.since <= env.now() + MS, "stamps count whole milliseconds"
    # As the store reads it: etcd's leases count whole seconds.
    assert abs(seen.until - leadership.until) <= timedelta(seconds=1)
    (holder,) = env.make("mutex").holders(NAME)
    assert seen.token_prefix == holder.token_prefix
    assert len(seen.token_prefix) == 8
    assert leadership.resign() is True


def test_a_rival_leads_after_the_resignation_with_a_greater_term(env: Rig) -> None:
    first_node = env.make_election(identity="node-a", ttl=LONG)
    second_node = env.make_election(identity="node-b", ttl=LONG)
    first = elected(first_node.campaign(NAME, timeout=0))
    assert second_node.campaign(NAME, timeout=0) is None
    if env.clock is not None:  # a campaign that times out, in slices of at most a second
        started = env.clock.monotonic()
        assert second_node.campaign(NAME, timeout=2.5, retry_delay=0.5) is None
        assert env.clock.monotonic() - started == pytest.approx(2.5, abs=1e-9)
    seen = leading(second_node.leader(NAME))
    assert (seen.term, seen.identity) == (first.term, "node-a")
    assert first.resign() is True
    assert second_node.leader(NAME) is None, "nobody leads between the two"
    second = elected(second_node.campaign(NAME, timeout=0))
    assert second.term > first.term
    seen = leading(first_node.leader(NAME))
    assert (seen.term, seen.identity) == (second.term, "node-b")
    assert first.resign() is False, "a resigned leadership is over"
    assert first_node.campaign(NAME, timeout=0) is None
    assert second.resign() is True
    assert first_node.leader(NAME) is None


def test_terms_only_grow_and_the_context_manager_resigns(env: Rig) -> None:
    nodes = [env.make_election(identity=f"node-{n}", ttl=LONG) for n in range(3)]
    observer = env.make_election()
    terms: list[int] = []
    for n, node in enumerate(nodes):
        with elected(node.campaign(NAME, timeout=0)) as leadership:
            terms.append(leadership.term)
            seen = leading(observer.leader(NAME))
            assert (seen.term, seen.identity) == (leadership.term, f"node-{n}")
            assert nodes[n - 1].campaign(NAME, timeout=0) is None
        assert observer.leader(NAME) is None, "leaving the block resigned"
        assert lost(leadership) is False, "resigned, not lost"
        assert leadership.resign() is False
    assert len(terms) == 3
    assert terms == sorted(set(terms)), f"terms must strictly grow: {terms}"


def test_a_leader_whose_lease_expired_is_replaced_with_a_greater_term(env: Rig) -> None:
    ttl = short_ttl(env)
    old_node = env.make_election(identity="node-a", ttl=ttl)
    new_node = env.make_election(identity="node-b", ttl=ttl)
    old = elected(old_node.campaign(NAME, timeout=0))
    env.expire(NAME)
    assert new_node.leader(NAME) is None, "an expired lease leads nothing"
    new = elected(new_node.campaign(NAME, timeout=0))
    assert new.term > old.term
    # The old leader finds it lost at its next renewal: within a third of its TTL.
    if env.clock is None:
        assert old.wait_lost(3.0) is True
    else:
        let_renewals_run(env, ttl / 3)
    assert lost(old) is True
    assert old.resign() is False
    seen = leading(old_node.leader(NAME))
    assert (seen.term, seen.identity) == (new.term, "node-b")
    assert lost(new) is False
    if env.clock is not None:
        # A jump of the clock past the TTL: the renewal due comes too late.
        env.clock.advance(ttl + 0.001)
        env.settle(env.make("mutex"))
        assert lost(new) is True
        assert old_node.leader(NAME) is None
        third = elected(old_node.campaign(NAME, timeout=0))
        assert third.term > new.term
        assert third.resign() is True
    else:
        assert new.resign() is True


def test_an_election_and_a_plain_mutex_of_the_name_exclude_each_other(env: Rig) -> None:
    mutex = env.make("mutex", identity="plain")
    election = env.make_election(identity="elected", ttl=LONG)
    held = lock(mutex.acquire(NAME, LONG))
    assert election.campaign(NAME, timeout=0) is None
    assert leading(election.leader(NAME)).identity == "plain", "a mutex's holder leads"
    assert held.release() is True
    leadership = elected(election.campaign(NAME, timeout=0))
    assert mutex.acquire(NAME) is None
    (holder,) = mutex.holders(NAME)
    seen = leading(election.leader(NAME))
    assert (holder.identity, holder.token_prefix) == ("elected", seen.token_prefix)
    # Another service's mutex of the same key is another lock.
    lock(env.make("mutex", service_name="other").acquire(NAME, LONG))
    assert leadership.resign() is True
    assert lock(mutex.acquire(NAME, LONG)).release() is True


def test_observe_yields_the_leader_then_each_change_and_no_renewal(env: Rig) -> None:
    ttl = short_ttl(env)
    first_node = env.make_election(identity="node-a", ttl=ttl)
    second_node = env.make_election(identity="node-b", ttl=ttl)
    closer = env.make_election(identity="closer", ttl=LONG)

    def end() -> None:  # only if the test failed before its last change: make one more
        env.expire(NAME)
        closer.campaign(NAME, timeout=0)

    # On a ManualClock the observer polls in real time where the backend lets an instance
    # have a clock of its own; InMemoryBackend's observer moves the clock at each poll.
    spins = isinstance(env.backend, Memory)
    observer = env.make_election(
        **({} if env.clock is None or spins else {"clock": RealSleeps(env.clock)})
    )
    first = elected(first_node.campaign(NAME, timeout=0))
    with observer.watch(NAME, poll=STEP if spins else 0.03, end=end) as watch:
        seen = leading(watch.next())
        assert (seen.term, seen.identity) == (first.term, "node-a")
        until = first.until
        if env.clock is not None and not spins:
            let_renewals_run(env, ttl / 2)
        assert eventually(lambda: first.until > until), "the leader renewed its lease"
        time.sleep(0.07)  # two more polls, after the renewal
        assert watch.pending() == [], "a renewal is no change"
        assert first.resign() is True
        assert watch.next() is None, "nobody leads"
        watch.stop_at_next()
        second = elected(second_node.campaign(NAME, timeout=0))
        seen = leading(watch.next())
    assert second.resign() is True
    assert (seen.term, seen.identity) == (second.term, "node-b")


# The cases whose store tells an observer of a release (abc.Watching): PostgreSQL through
# a psycopg pool or asyncpg (LISTEN; a single connection, an engine or PgBouncer poll), and
# etcd (a watch). InMemoryBackend tells too; its rig's ManualClock makes every wait a
# step of the clock, so tests/test_elections.py shows it on the system clock.
TELLING_POSTGRES = ("psycopg-pool", "asyncpg")
# Far beyond any wait the test makes: an observer that polled instead would miss the bound.
LONG_POLL = 30.0


def tells(env: Rig) -> bool:
    backend = env.backend
    if isinstance(backend, Postgres):
        return backend.variant in TELLING_POSTGRES
    return isinstance(backend, Etcd)


def test_a_resignation_wakes_an_observer_where_the_store_tells_one(env: Rig) -> None:
    if not tells(env):
        pytest.skip("this store tells no observer of a release: observe polls (the test above)")
    leader_node = env.make_election(identity="node-a", ttl=LONG)
    closer = env.make_election(identity="closer", ttl=LONG)

    def end() -> None:  # only if the test failed before its last change: make one more
        closer.campaign(NAME, timeout=0)

    leadership = elected(leader_node.campaign(NAME, timeout=0))
    with env.make_election().watch(NAME, poll=LONG_POLL, end=end) as watch:
        assert leading(watch.next()).term == leadership.term
        time.sleep(0.2)  # the observer is in its watch by now
        watch.stop_at_next()
        assert leadership.resign() is True
        assert watch.next(timeout=5.0) is None, "the resignation ended the watch"


def test_bad_arguments_raise_before_any_request(env: Rig) -> None:
    events: list[object] = []
    election = env.make_election(observers=[events.append])
    for name, timeout, retry_delay in (("", None, 0.1), (NAME, -1, 0.1), (NAME, 1, 0)):
        with pytest.raises(InvalidArgumentError):
            election.campaign(name, timeout=timeout, retry_delay=retry_delay)
    with pytest.raises(ArgumentTypeError):
        election.campaign(7)  # type: ignore[arg-type]  # what a caller without mypy may pass
    with pytest.raises(InvalidArgumentError):
        election.leader("")
    for name, poll in (("", 1.0), (NAME, 0), (NAME, -0.5)):
        with pytest.raises(InvalidArgumentError):
            election.first(name, poll=poll)
    with pytest.raises(ArgumentTypeError):
        election.run(NAME, "not callable")
    with pytest.raises(InvalidArgumentError):
        election.run("", lambda leadership: None)
    assert events == [], "no campaign started"
    assert election.leader(NAME) is None

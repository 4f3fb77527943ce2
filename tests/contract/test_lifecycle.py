"""Renewal, loss and fencing (issue 11), for every backend and face.

Tests that move time run on the ManualClock cases (``manual_clock``): there a
renewal happens when the clock passes its turn, so the tests count turns, not
seconds. The others run on every case, real servers included, in real time
with leases long enough that none runs out.
"""

from __future__ import annotations

import threading
import time

import pytest

from dmutex import LeaseLostError
from dmutex._cli.holders import read_holders
from dmutex._core.fences import US_PER_S, clock_us, next_fence
from tests._support.backends import Memory, Mongomock, Postgres, RealMongo, Rig, SQLite
from tests._support.dynamodb_backend import Dynamo
from tests._support.etcd_backend import Etcd
from tests._support.faces import Face, Handle, Kind
from tests._support.mysql_backend import MySQL

# A 3 s lease is renewed every 0.9-1.0 s; the tests step the clock by a quarter second.
TTL = 3.0
STEP = 0.25
MARGIN = TTL / 10  # renewal.margin_ms of a 3 s TTL: its tenth
# A real server's clock (Redis TIME, MongoDB $$NOW) against this host's: same host.
CLOCK_SLACK_US = US_PER_S


def held(handle: Handle | None) -> Handle:
    assert handle is not None, "expected the permit to be granted"
    return handle


def lost(handle: Handle) -> bool:
    # A call, not the property: mypy would narrow a property across the steps between.
    return handle.lost


def fences_on_request(env: Rig) -> bool:
    """Whether the backend fences only with ``fencing=True``: where it costs a request more."""
    return isinstance(env.backend, (Mongomock, RealMongo, Dynamo))


def advance(env: Rig, face: Face, seconds: float) -> None:
    """Move the ManualClock in steps, letting the async face's renewer run after each."""
    clock = env.need_clock()
    remaining = seconds
    while remaining > 1e-9:
        step = min(STEP, remaining)
        clock.advance(step)
        env.settle(face)
        remaining -= step


# --- fencing ---------------------------------------------------------------------------


def test_fences_strictly_increase_across_grants_of_a_key(env: Rig) -> None:
    """One sequence per key, whichever permit and however the last lease ended."""
    sem = env.make("semaphore", max_permits=3, fencing=True)
    mutex = env.make("mutex", fencing=True)
    for lock in (sem, mutex):
        fences: list[int] = []
        for round_ in range(4):
            handles = [held(lock.acquire("job", 60)) for _ in range(lock.max_permits)]
            fences += [h.fence for h in handles if h.fence is not None]
            if round_ % 2:
                env.expire("job")  # ended by expiry: taken over, not released
            else:
                assert all(h.release() for h in handles)
        assert len(fences) == 4 * lock.max_permits, "every grant carries a fence"
        assert fences == sorted(set(fences)), f"not strictly increasing: {fences}"


def now_us() -> int:
    return int(time.time() * US_PER_S)


def stored_fence(env: Rig, kind: Kind, key: str) -> int | None:
    """The fence counter stored for ``key`` in ``kind``'s namespace (service ``svc``), or None.

    Read as ``dmutex status`` reads it, through a sync client of the same storage.
    """
    limit = 1 if kind == "mutex" else 2
    backend = env.backend
    if isinstance(backend, Dynamo):  # its tables are under the backend's namespace
        return backend.stored_fence(kind, "svc", key)
    if isinstance(backend, (Postgres, MySQL)):
        client = backend.status_client()
    else:
        client = backend.client(False)
    return read_holders(client, service="svc", limit=limit, key=key).fence


def granted(env: Rig, lock: Face, key: str, previous: int) -> int:
    """Take and release ``key``; its fence, checked against the rule after fence ``previous``.

    ``previous`` is the key's last fence, 0 for its first grant. Exact where the
    fence's clock is known: InMemoryBackend counts 1, 2, 3, and so does mongomock
    (it does not evaluate $$NOW); SQLite takes the ManualClock. On a real server
    the clock is its own, within ``CLOCK_SLACK_US`` of this host's.
    """
    before = now_us()
    handle = held(lock.acquire(key, 60))
    after = now_us()
    assert handle.release()
    fence = handle.fence
    assert fence is not None
    if isinstance(env.backend, (Memory, Mongomock)):
        assert fence == previous + 1
    elif isinstance(env.backend, SQLite):
        assert fence == next_fence(previous, clock_us(env.need_clock()))
    elif isinstance(env.backend, Etcd):
        assert fence > previous  # etcd's revision: no clock in it
    else:
        assert fence > previous
        assert before - CLOCK_SLACK_US <= fence <= after + CLOCK_SLACK_US
    return fence


def test_fences_of_different_keys_and_kinds_are_separate_sequences(env: Rig) -> None:
    """Each key of each namespace has a counter of its own: grants of one never move another's.

    etcd's fence is the grant's revision, one sequence for the whole cluster:
    there, the grants of every key and kind follow one another in it.
    """
    mutex = env.make("mutex", fencing=True)
    sem = env.make("semaphore", max_permits=2, fencing=True)
    if isinstance(env.backend, Etcd):
        order = [granted(env, mutex, "b", 0)]
        order.append(granted(env, sem, "a", order[-1]))
        for _ in range(5):
            order.append(granted(env, mutex, "a", order[-1]))
        assert order == sorted(set(order)), f"not one increasing sequence: {order}"
        return
    # Each first grant starts from no counter (previous 0), not from the other's.
    others: dict[tuple[Kind, str], int] = {("mutex", "b"): granted(env, mutex, "b", 0)}
    others["semaphore", "a"] = granted(env, sem, "a", 0)
    assert stored_fence(env, "mutex", "b") == others["mutex", "b"]
    assert stored_fence(env, "semaphore", "a") == others["semaphore", "a"]
    assert stored_fence(env, "mutex", "a") is None, "another namespace's key 'a' wrote none"
    fences = [0]
    for _ in range(5):
        fences.append(granted(env, mutex, "a", fences[-1]))
    assert stored_fence(env, "mutex", "a") == fences[-1]
    for (kind, key), fence in others.items():
        assert stored_fence(env, kind, key) == fence, f"{kind} {key!r} moved: not its own counter"


def test_fencing_false_gives_none_and_default_depends_on_the_backend(env: Rig) -> None:
    assert held(env.make("mutex", fencing=False).acquire("job", 60)).fence is None
    default = held(env.make("semaphore", max_permits=2).acquire("job", 60)).fence
    if fences_on_request(env):
        assert default is None, (
            "MongoDB and DynamoDB fence only with fencing=True (one request more)"
        )
    else:
        assert isinstance(default, int)
        assert default >= 1


def test_a_token_release_keeps_the_sequence(env: Rig) -> None:
    sem = env.make("semaphore", max_permits=2, fencing=True)
    one = held(sem.acquire("job", 60))
    assert sem.release_token("job", one.token) is True
    two = held(sem.acquire("job", 60))
    assert one.fence is not None
    assert two.fence is not None
    assert two.fence > one.fence


# --- loss, found by an answer ----------------------------------------------------------


def test_a_refused_extend_or_release_marks_the_handle_lost(env: Rig) -> None:
    mutex = env.make("mutex")
    lock = held(mutex.acquire("job", 60))
    assert lost(lock) is False
    lock.raise_if_lost()
    calls: list[str] = []
    lock.on_lost(lambda handle: calls.append(handle.token))
    env.expire("job")
    assert lock.extend(60) is False
    assert lost(lock) is True
    assert calls == [lock.token], "called once, with the handle"
    with pytest.raises(LeaseLostError) as raised:
        lock.raise_if_lost()
    assert (raised.value.key, raised.value.token) == ("job", lock.token)
    assert lock.release() is False
    assert calls == [lock.token], "still once"
    assert lock.wait_lost(0) is True


def test_a_released_handle_is_not_lost(env: Rig) -> None:
    sem = env.make("semaphore", max_permits=2)
    permit = held(sem.acquire("job", 60))
    calls: list[str] = []
    permit.on_lost(lambda handle: calls.append(handle.token))
    assert permit.release() is True
    assert lost(permit) is False
    assert permit.wait_lost(0) is False
    assert permit.release() is False, "released already"
    assert lost(permit) is False, "a second release does not make it lost"
    assert calls == []


def test_auto_renew_is_off_by_default_and_checked_before_any_request(env: Rig) -> None:
    mutex = env.make("mutex")
    assert held(mutex.acquire("a", 60)).auto_renew is False
    renewed = held(mutex.acquire("b", 60, auto_renew=True))
    assert renewed.auto_renew is True
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="auto_renew must be a bool"):
            mutex.acquire("c", 60, auto_renew=bad)
    assert renewed.release() is True
    assert mutex.acquire("c", 60) is not None, "the refused calls took nothing"


def test_a_renewed_lease_is_released_and_stays_released(env: Rig) -> None:
    mutex = env.make("mutex")
    lock = held(mutex.acquire("job", 60, auto_renew=True))
    assert lock.release() is True
    assert lost(lock) is False
    assert held(mutex.acquire("job", 60)).key == "job"


# --- renewal on a ManualClock ------------------------------------------------------------


@pytest.mark.manual_clock
@pytest.mark.parametrize(("kind", "permits"), [("mutex", 1), ("semaphore", 3)])
def test_a_renewed_lease_stays_active_across_many_ttls(env: Rig, kind: Kind, permits: int) -> None:
    mine = env.make(kind, max_permits=permits)
    other = env.make(kind, max_permits=permits)
    handles = [held(mine.acquire("job", TTL, auto_renew=True)) for _ in range(permits)]
    plain = held(env.make(kind, max_permits=permits, service_name="plain").acquire("job", TTL))
    for _ in range(10):
        advance(env, mine, TTL)
        assert other.acquire("job", TTL) is None, "no permit ever came free"
    assert lost(plain) is True, "the lease that was not renewed ran out after one TTL"
    clock = env.need_clock()
    for handle in handles:
        assert lost(handle) is False
        assert clock.now() < handle.expired_at, "renewed: its expiry keeps ahead of the clock"
    assert all(handle.release() for handle in handles)


@pytest.mark.manual_clock
def test_loss_is_found_within_one_renewal_interval(env: Rig) -> None:
    mutex = env.make("mutex")
    lock = held(mutex.acquire("job", TTL, auto_renew=True))
    calls: list[str] = []
    lock.on_lost(lambda handle: calls.append(handle.token))
    advance(env, mutex, 2.5)
    assert lost(lock) is False
    env.expire("job")
    # The next renewal is due at most one interval (a third of the TTL) away.
    advance(env, mutex, TTL / 3)
    assert lost(lock) is True
    assert calls == [lock.token]
    assert lock.extend() is False
    assert lock.release() is False


@pytest.mark.manual_clock
def test_a_lease_taken_over_is_lost_and_the_new_holder_keeps_it(env: Rig) -> None:
    mine, theirs = env.make("mutex"), env.make("mutex")
    lock = held(mine.acquire("job", TTL, auto_renew=True))
    env.expire("job")
    new = held(theirs.acquire("job", 60))
    advance(env, mine, TTL / 3)
    assert lost(lock) is True
    assert lock.release() is False, "never the new holder's record"
    assert theirs.acquire("job", 60) is None
    assert new.extend(60) is True


@pytest.mark.manual_clock
def test_a_watched_lease_without_renewal_is_lost_at_its_deadline(env: Rig) -> None:
    """The deadline is the TTL less its margin (a tenth), from the request's send time."""
    mutex = env.make("mutex")
    other = env.make("mutex")
    lock = held(mutex.acquire("job", TTL))
    calls: list[str] = []
    lock.on_lost(lambda handle: calls.append(handle.token))
    advance(env, mutex, TTL - MARGIN - STEP)
    assert (lost(lock), calls) == (False, [])
    assert lock.time_left == pytest.approx(STEP)
    assert lock.extend(TTL) is True, "an extend moves the watch"
    advance(env, mutex, TTL - MARGIN - STEP)
    assert (lost(lock), calls) == (False, [])
    advance(env, mutex, 2 * STEP)
    assert lost(lock) is True
    assert calls == [lock.token]
    assert lock.time_left == 0.0
    assert other.acquire("job", TTL) is None, "told before the server lets anyone else in"


@pytest.mark.manual_clock
def test_run_with_auto_renew_outlives_its_ttl_and_returns(env: Rig) -> None:
    mutex = env.make("mutex")
    other = env.make("mutex")

    def work(handle: Handle) -> str:
        for _ in range(4 * int(TTL / STEP)):
            env.need_clock().advance(STEP)
            assert other.acquire("job", TTL) is None
            handle.raise_if_lost()
        return "done"

    # On the async face the callback runs in a worker thread while the loop renews.
    assert mutex.run("job", work, TTL, auto_renew=True) == "done"
    assert held(other.acquire("job", TTL)).key == "job", "released after"


@pytest.mark.manual_clock
def test_run_with_auto_renew_raises_when_the_lease_is_lost(env: Rig) -> None:
    mutex = env.make("mutex")
    stop = threading.Event()
    seen: list[str] = []

    def work(handle: Handle) -> str:
        env.expire("job")
        for _ in range(int(TTL / STEP)):
            env.need_clock().advance(STEP)
            if mutex.loop is None:
                if handle.lost:
                    seen.append("lost")
                    break
            elif stop.wait(0.05):
                break
        return "result"

    with pytest.raises(LeaseLostError):
        mutex.run("job", work, TTL, auto_renew=True)
    stop.set()
    if mutex.loop is None:
        assert seen == ["lost"], "the sync callback saw the loss and returned; run raised"


def test_on_lost_callback_errors_are_logged_not_raised(
    env: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    lock = held(env.make("mutex").acquire("job", 60))
    calls: list[str] = []

    def boom(handle: Handle) -> None:
        raise RuntimeError("boom")

    lock.on_lost(boom)
    lock.on_lost(lambda handle: calls.append(handle.token))
    env.expire("job")
    with caplog.at_level("ERROR", logger="dmutex"):
        assert lock.extend() is False
    assert calls == [lock.token], "the second listener still ran"
    assert any("boom" in str(record.exc_info) for record in caplog.records)

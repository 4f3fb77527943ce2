"""The behaviours the TypeScript README documents, for every backend and face."""

from __future__ import annotations

import enum
import uuid
from datetime import timedelta

import pytest

from dmutex import ManualClock
from tests._support.backends import Rig
from tests._support.faces import Face, Handle


def held(handle: Handle | None) -> Handle:
    assert handle is not None, "expected the permit to be granted"
    return handle


def taken_then_free(mutex: Face, clock: ManualClock, almost: float) -> None:
    """``job`` is still taken ``almost`` seconds on; then the clock moves 1 ms more."""
    clock.advance(almost)
    assert mutex.acquire("job") is None
    clock.advance(0.001)


# --- acquire ------------------------------------------------------------------


def test_default_ttl_is_300_seconds(env: Rig) -> None:
    mutex = env.make("mutex")
    before = env.now()
    lock = held(mutex.acquire("job"))
    env.assert_expiry(before, env.now(), lock.expired_at, 300)
    assert lock.expired_at.utcoffset() == timedelta(0)


def test_default_ttl_seconds_option(env: Rig) -> None:
    sem = env.make("semaphore", max_permits=2, default_ttl_seconds=7.5)
    before = env.now()
    lock = held(sem.acquire("job"))
    env.assert_expiry(before, env.now(), lock.expired_at, 7.5)


@pytest.mark.manual_clock
def test_ttl_is_seconds_rounded_up_to_milliseconds(env: Rig) -> None:
    clock = env.need_clock()
    lock = held(env.make("mutex").acquire("job", ttl=0.0001))
    assert lock.expired_at == clock.now() + timedelta(milliseconds=1)


def test_mutex_contention_returns_none(env: Rig) -> None:
    first, second = env.make("mutex"), env.make("mutex")
    lock = held(first.acquire("job"))
    assert second.acquire("job") is None
    assert first.acquire("job") is None, "not reentrant: the same instance is refused too"
    assert lock.release() is True
    assert held(second.acquire("job")).key == "job"


class Job(str, enum.Enum):
    """A key as many applications spell it: ``str(Job.DAILY)`` is "Job.DAILY", its value "daily"."""

    DAILY = "daily"


class Tagged(str):
    """A str subclass whose ``__str__`` says something else."""

    def __str__(self) -> str:
        return f"tagged:{super().__str__()}"


@pytest.mark.parametrize("key", [Job.DAILY, Tagged("daily")], ids=["str-enum", "str-subclass"])
def test_a_str_subclass_names_the_lock_of_its_value(env: Rig, key: str) -> None:
    """On every backend, or a test on one hides a double grant on another."""
    mutex = env.make("mutex")
    lock = held(mutex.acquire(key))
    assert type(lock.key) is str
    assert lock.key == "daily"
    assert mutex.acquire("daily") is None
    assert lock.release() is True
    plain = held(mutex.acquire("daily"))
    assert mutex.acquire(key) is None
    assert plain.release() is True


def test_the_longest_key_is_a_lock_on_every_backend(env: Rig) -> None:
    sem = env.make("semaphore", max_permits=1024)
    key = "é" * 500  # MAX_KEY_LENGTH characters, 1,000 bytes
    permit = held(sem.acquire(key))
    assert permit.key == key
    assert permit.release() is True


def test_keys_are_independent(env: Rig) -> None:
    mutex = env.make("mutex")
    held(mutex.acquire("a"))
    held(mutex.acquire("b"))


def test_semaphore_admits_max_permits_then_none(env: Rig) -> None:
    sem = env.make("semaphore", max_permits=3)
    permits = [held(sem.acquire("api")) for _ in range(3)]
    assert sorted(p.slot for p in permits) == [0, 1, 2]
    assert len({p.token for p in permits}) == 3
    assert sem.acquire("api") is None
    assert permits[1].release() is True
    again = held(sem.acquire("api"))
    assert again.slot == permits[1].slot
    assert sem.acquire("api") is None


def test_tokens_are_uuid4_strings_stamped_with_their_holder(env: Rig) -> None:
    lock = held(env.make("mutex", identity="worker 7").acquire("job"))
    random, since, identity = lock.token.split("|")
    assert uuid.UUID(random).version == 4
    assert str(uuid.UUID(random)) == random
    assert identity == "worker 7"
    assert int(since) > 0
    bare = held(env.make("mutex", identity="").acquire("other"))
    assert str(uuid.UUID(bare.token)) == bare.token, "no identity: a bare UUID4, as TypeScript's"


def test_any_instance_reads_who_holds_a_key_from_storage(env: Rig) -> None:
    sem = env.make("semaphore", max_permits=3, identity="billing-7 (cron)")
    reader = env.make("semaphore", max_permits=3)
    assert reader.holders("job") == []
    before = env.now()
    first = held(sem.acquire("job", ttl=60))
    second = held(env.make("semaphore", max_permits=3, identity="").acquire("job", ttl=60))
    after = env.now()
    found = reader.holders("job")
    assert [h.slot for h in found] == sorted([first.slot, second.slot])
    by_slot = {h.slot: h for h in found}
    mine, bare = by_slot[first.slot], by_slot[second.slot]
    assert mine.identity == "billing-7 (cron)"
    assert mine.since is not None
    assert before - timedelta(milliseconds=1) <= mine.since <= after + timedelta(milliseconds=1)
    # As the store reads it: etcd's leases count whole seconds.
    assert abs(mine.expires_at - first.expired_at) <= timedelta(seconds=1)
    assert mine.token_prefix == first.token[:8]
    assert mine.key == "job"
    assert (bare.identity, bare.since) == (None, None), "a bare token says nothing of its holder"
    assert first.release()
    assert [h.slot for h in reader.holders("job")] == [second.slot]


def test_mutex_and_semaphore_of_one_service_do_not_collide(env: Rig) -> None:
    held(env.make("mutex").acquire("job"))
    held(env.make("semaphore", max_permits=1).acquire("job"))
    held(env.make("mutex", service_name="other").acquire("job"))
    # Each backend reads its own option and ignores the other's.
    held(
        env.make(
            "mutex", key_prefix="custom:", collection_name="custom", table_name="custom"
        ).acquire("job")
    )
    assert env.make("mutex").acquire("job") is None


# --- release ------------------------------------------------------------------


def test_release_twice_returns_false_the_second_time(env: Rig) -> None:
    lock = held(env.make("mutex").acquire("job"))
    assert lock.release() is True
    assert lock.release() is False


def test_release_by_key_and_token(env: Rig) -> None:
    sem = env.make("semaphore", max_permits=2)
    permit = held(sem.acquire("api"))
    other = env.make("semaphore", max_permits=2)
    assert other.release_token("api", permit.token) is True
    assert other.release_token("api", permit.token) is False


def test_foreign_token_changes_nothing(env: Rig) -> None:
    for kind in ("mutex", "semaphore"):
        face = env.make(kind, max_permits=2, service_name=f"foreign-{kind}")
        lock = held(face.acquire("job"))
        stranger = str(uuid.uuid4())
        assert face.release_token("job", stranger) is False
        assert face.extend("job", stranger, 60) is False
        assert face.extend("other-key", lock.token, 60) is False
        assert face.release_token("other-key", lock.token) is False
        assert lock.release() is True


def test_stale_token_refused_after_expiry_and_takeover(env: Rig) -> None:
    mutex = env.make("mutex")
    old = held(mutex.acquire("job", ttl=60))
    env.expire("job")
    assert old.extend(60) is False, "an expired permit cannot be extended"
    assert old.release() is False, "an expired permit cannot be released"
    new = held(mutex.acquire("job", ttl=60))
    assert old.release() is False
    assert old.extend(60) is False
    assert mutex.release_token("job", old.token) is False
    assert mutex.extend("job", old.token, 60) is False
    assert mutex.acquire("job") is None, "the new holder was not disturbed"
    assert new.release() is True


def test_expired_record_still_stored_is_not_active(env: Rig) -> None:
    sem = env.make("semaphore", max_permits=2)
    first, second = held(sem.acquire("api")), held(sem.acquire("api"))
    env.expire("api", first.slot)
    assert first.release() is False
    taken = held(sem.acquire("api"))
    assert taken.slot == first.slot
    assert second.release() is True


# --- extend -------------------------------------------------------------------


@pytest.mark.manual_clock
def test_extend_sets_now_plus_ttl(env: Rig) -> None:
    clock = env.need_clock()
    mutex = env.make("mutex")
    lock = held(mutex.acquire("job", ttl=10))
    clock.advance(4)
    assert lock.extend(10) is True
    assert lock.expired_at == clock.now() + timedelta(seconds=10)
    clock.advance(9)
    assert mutex.extend("job", lock.token, 3) is True
    taken_then_free(mutex, clock, 2.999)
    assert held(mutex.acquire("job")).key == "job"


def test_extend_without_ttl_uses_the_default(env: Rig) -> None:
    lock = held(env.make("mutex", default_ttl_seconds=20).acquire("job", ttl=1))
    before = env.now()
    assert lock.extend() is True
    env.assert_expiry(before, env.now(), lock.expired_at, 20)


@pytest.mark.manual_clock
def test_lease_expires_at_its_ttl(env: Rig) -> None:
    clock = env.need_clock()
    mutex = env.make("mutex")
    lock = held(mutex.acquire("job", ttl=2))
    taken_then_free(mutex, clock, 1.999)
    assert lock.extend() is False
    assert held(mutex.acquire("job")).key == "job"


# --- run ----------------------------------------------------------------------


def test_run_returns_the_callback_result_and_releases(env: Rig) -> None:
    mutex = env.make("mutex")
    seen: list[str] = []

    def work(lock: Handle) -> str:
        seen.append(lock.token)
        assert mutex.acquire("job") is None, "held while the callback runs"
        return "done"

    assert mutex.run("job", work, 60) == "done"
    assert len(seen) == 1
    held(mutex.acquire("job"))


def test_run_reraises_after_releasing(env: Rig) -> None:
    sem = env.make("semaphore", max_permits=1)

    class Boom(Exception):
        pass

    def work(permit: Handle) -> None:
        raise Boom(permit.token)

    with pytest.raises(Boom):
        sem.run("job", work)
    held(sem.acquire("job"))


def test_run_on_contention_returns_none_without_calling(env: Rig) -> None:
    mutex = env.make("mutex")
    held(mutex.acquire("job"))
    called: list[Handle] = []
    assert mutex.run("job", called.append) is None
    assert called == []


@pytest.mark.manual_clock
def test_run_does_not_renew(env: Rig) -> None:
    clock = env.need_clock()
    mutex = env.make("mutex")

    def slow(lock: Handle) -> bool:
        clock.advance(5)
        return lock.extend(5)

    assert mutex.run("job", slow, ttl=1) is False


def test_run_with_retry_waits_for_the_holder_to_expire(env: Rig) -> None:
    # On a real server the holder's lease really runs out, so it is kept short.
    ttl = 1 if env.clock is not None else 0.2
    mutex = env.make("mutex")
    held(mutex.acquire("job", ttl=ttl))
    assert mutex.acquire("job") is None
    result = mutex.run_with_retry("job", lambda lock: lock.key, timeout=5, retry_delay=0.05)
    assert result == "job"
    if env.clock is not None:
        # retry_delay is the longest gap: taken within 0.05 s of the expiry.
        assert 1.0 <= env.clock.monotonic() <= 1.05
    held(mutex.acquire("job"))


# --- acquire_with_retry ---------------------------------------------------------


@pytest.mark.manual_clock
def test_retry_returns_none_at_the_deadline_without_sleeping_past_it(env: Rig) -> None:
    clock = env.need_clock()
    mutex = env.make("mutex")
    held(mutex.acquire("job"))
    start = clock.monotonic()
    assert mutex.acquire_with_retry("job", timeout=1.05, retry_delay=0.1) is None
    assert clock.monotonic() - start == pytest.approx(1.05, abs=1e-9)
    assert clock.monotonic() - start <= 1.05


@pytest.mark.manual_clock
def test_retry_defaults_wait_30_seconds(env: Rig) -> None:
    clock = env.need_clock()
    mutex = env.make("mutex")
    held(mutex.acquire("job"))
    assert mutex.acquire_with_retry("job") is None
    assert clock.monotonic() == pytest.approx(30.0, abs=1e-9)


def test_retry_timeout_zero_is_one_attempt(env: Rig) -> None:
    mutex = env.make("mutex")
    assert held(mutex.acquire_with_retry("job", timeout=0)).key == "job"
    assert mutex.acquire_with_retry("job", timeout=0) is None
    if env.clock is not None:
        assert env.clock.monotonic() == 0, "no sleep at all"


def test_retry_gets_the_lock_when_it_expires(env: Rig) -> None:
    ttl = 1 if env.clock is not None else 0.2
    mutex = env.make("mutex")
    held(mutex.acquire("job", ttl=ttl))
    before = env.now()
    lock = held(mutex.acquire_with_retry("job", ttl=9, timeout=5, retry_delay=0.3))
    env.assert_expiry(before, env.now(), lock.expired_at, 9)
    if env.clock is not None:
        assert 1.0 <= env.clock.monotonic() <= 1.3
        assert lock.expired_at == env.clock.now() + timedelta(seconds=9)


def test_semaphore_retry_gets_a_released_permit(env: Rig) -> None:
    sem = env.make("semaphore", max_permits=2)
    first = held(sem.acquire("api", ttl=0.5))
    held(sem.acquire("api", ttl=60))
    if env.clock is None:
        first.release()
    third = held(sem.acquire_with_retry("api", timeout=5, retry_delay=0.2))
    assert third.slot == first.slot


# --- deprecated lock / unlock -----------------------------------------------------


def test_deprecated_lock_and_unlock_work_and_warn(env: Rig) -> None:
    mutex, other = env.make("mutex"), env.make("mutex")
    with pytest.warns(DeprecationWarning, match="lock"):
        assert mutex.lock("job", 60) is True
    with pytest.warns(DeprecationWarning, match="lock"):
        assert other.lock("job") is False
    with pytest.warns(DeprecationWarning, match="unlock"):
        assert other.unlock("job") is False, "other never locked it"
    assert other.acquire("job") is None
    with pytest.warns(DeprecationWarning, match="unlock"):
        assert mutex.unlock("job") is True
    with pytest.warns(DeprecationWarning, match="unlock"):
        assert mutex.unlock("job") is False, "the remembered token is spent"


def test_deprecated_unlock_with_explicit_token(env: Rig) -> None:
    mutex = env.make("mutex")
    lock = held(mutex.acquire("job"))
    assert mutex.release_token("job", str(uuid.uuid4())) is False
    assert mutex.release_token("job", lock.token) is True
    held(mutex.acquire("job"))

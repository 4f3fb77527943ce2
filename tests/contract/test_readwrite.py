"""Read-write locks, for every backend that serves them and both faces (``rw_env``).

The rules are ``dmutex._core.readwrite``'s: any number of readers (or
``max_readers``) or one writer; a waiting writer's intent keeps new readers
out; every grant's fence above the key's earlier ones.
"""

from __future__ import annotations

import uuid

import pytest

from tests._support.backends import Rig
from tests._support.faces import Handle
from tests._support.rwfaces import RWFace


def held(handle: Handle | None) -> Handle:
    assert handle is not None, "expected the hold to be granted"
    return handle


def fences(*handles: Handle) -> list[int]:
    found = [h.fence for h in handles]
    assert None not in found, "fencing is on by default on every backend here"
    return [f for f in found if f is not None]


def test_readers_share_and_keep_a_writer_out(rw_env: Rig) -> None:
    first, second = rw_env.make_rw(), rw_env.make_rw()
    a = held(first.acquire("read", "doc"))
    b = held(second.acquire("read", "doc"))
    assert a.token != b.token
    assert first.acquire("write", "doc") is None
    assert second.acquire("write", "doc") is None
    assert a.release() is True
    assert first.acquire("write", "doc") is None, "one reader is still in"
    assert b.release() is True
    assert held(first.acquire("write", "doc")).key == "doc"


def test_a_writer_keeps_everyone_out(rw_env: Rig) -> None:
    first, second = rw_env.make_rw(), rw_env.make_rw()
    writer = held(first.acquire("write", "doc"))
    assert second.acquire("read", "doc") is None
    assert second.acquire("write", "doc") is None
    assert first.acquire("write", "doc") is None, "not reentrant"
    assert first.acquire("read", "doc") is None, "no downgrade by a second acquire"
    assert writer.release() is True
    reader = held(second.acquire("read", "doc"))
    assert second.acquire("write", "doc") is None
    assert reader.release() is True


def test_keys_are_independent(rw_env: Rig) -> None:
    lock = rw_env.make_rw()
    held(lock.acquire("write", "a"))
    held(lock.acquire("read", "b"))
    held(lock.acquire("write", "c"))


def test_max_readers_bounds_the_readers(rw_env: Rig) -> None:
    lock = rw_env.make_rw(max_readers=2)
    a, _ = held(lock.acquire("read", "doc")), held(lock.acquire("read", "doc"))
    assert lock.acquire("read", "doc") is None
    assert a.release() is True
    held(lock.acquire("read", "doc"))


def test_fences_rise_and_a_writer_is_above_every_earlier_grant(rw_env: Rig) -> None:
    lock = rw_env.make_rw()
    r1, r2 = held(lock.acquire("read", "doc")), held(lock.acquire("read", "doc"))
    assert r1.release()
    assert r2.release()
    w1 = held(lock.acquire("write", "doc"))
    assert w1.release()
    r3 = held(lock.acquire("read", "doc"))
    assert r3.release()
    w2 = held(lock.acquire("write", "doc"))
    seen = fences(r1, r2, w1, r3, w2)
    assert seen == sorted(seen)
    assert len(set(seen)) == len(seen)
    assert seen[2] > max(seen[:2])
    assert seen[4] > max(seen[:4])


def test_release_and_extend_by_token_for_either_kind(rw_env: Rig) -> None:
    lock, other = rw_env.make_rw(), rw_env.make_rw()
    reader = held(lock.acquire("read", "doc", ttl=5))
    assert other.extend("doc", reader.token, 20) is True
    assert other.extend("other", reader.token, 20) is False, "the wrong key"
    assert other.release_token("doc", reader.token) is True
    assert other.release_token("doc", reader.token) is False
    writer = held(lock.acquire("write", "doc", ttl=5))
    assert other.extend("doc", writer.token, 20) is True
    assert other.release_token("doc", writer.token) is True
    assert writer.release() is False
    assert writer.lost, "a release that found the hold gone marks it lost"


def test_a_foreign_token_changes_nothing(rw_env: Rig) -> None:
    lock = rw_env.make_rw()
    reader = held(lock.acquire("read", "doc"))
    stranger = str(uuid.uuid4())
    assert lock.release_token("doc", stranger) is False
    assert lock.extend("doc", stranger, 10) is False
    assert [h.token for h in lock.holders("doc").holders] == [reader.token]


def test_extend_by_handle_sets_now_plus_ttl(rw_env: Rig) -> None:
    lock = rw_env.make_rw()
    for side in ("read", "write"):
        hold = held(lock.acquire(side, "doc", ttl=5))
        before = rw_env.now()
        assert hold.extend(40) is True
        rw_env.assert_expiry(before, rw_env.now(), hold.expired_at, 40)
        assert hold.release() is True


def test_a_waiting_writers_intent_keeps_new_readers_out(rw_env: Rig) -> None:
    """A retrying writer that was refused and then died: readers in stay, new ones wait."""
    lock, other = rw_env.make_rw(), rw_env.make_rw()
    reader = held(lock.acquire("read", "doc"))
    granted, token, _ = other.intend("doc", ttl=30, retry_delay=0.1)
    assert not granted
    assert lock.acquire("read", "doc") is None, "a new reader passed a waiting writer"
    assert reader.extend(30) is True, "a reader already in keeps its lease"
    assert reader.release() is True
    writer = held(lock.acquire("write", "doc"))  # another writer may take it meanwhile
    assert writer.release() is True
    assert lock.acquire("read", "doc") is None, "the intent still stands"
    assert other.release_token("doc", token) is False, "an intent is no hold"
    held(lock.acquire("read", "doc"))


@pytest.mark.manual_clock
def test_a_dead_writers_intent_lapses(rw_env: Rig) -> None:
    clock = rw_env.need_clock()
    lock, other = rw_env.make_rw(), rw_env.make_rw()
    reader = held(lock.acquire("read", "doc", ttl=60))
    granted, _, window_ms = other.intend("doc", ttl=30, retry_delay=0.1)
    assert not granted
    assert window_ms == 2100, "retry_delay + 2 s"
    clock.advance(2.099)
    assert lock.acquire("read", "doc") is None
    clock.advance(0.001)
    held(lock.acquire("read", "doc"))
    assert reader.release() is True


def test_a_writer_that_gives_up_lets_readers_in(rw_env: Rig) -> None:
    """Its last attempt withdraws its intent: no reader waits for an intent to lapse."""
    lock, writer = rw_env.make_rw(), rw_env.make_rw()
    reader = held(lock.acquire("read", "doc", ttl=60))
    assert writer.acquire_with_retry("write", "doc", timeout=0.3, retry_delay=0.05) is None
    held(lock.acquire("read", "doc"))
    assert reader.release() is True


def test_run_read_and_run_write(rw_env: Rig) -> None:
    lock, other = rw_env.make_rw(), rw_env.make_rw()
    seen: list[str] = []

    def read(hold: Handle) -> str:
        assert other.acquire("write", "doc") is None
        held(other.acquire("read", "doc")).release()
        seen.append(hold.token)
        return "read"

    def write(hold: Handle) -> str:
        assert other.acquire("read", "doc") is None
        seen.append(hold.token)
        return "write"

    assert lock.run("read", "doc", read) == "read"
    assert lock.run("write", "doc", write) == "write"
    assert len(seen) == 2
    assert lock.holders("doc").holders == []
    blocker = held(other.acquire("write", "doc"))
    assert lock.run("read", "doc", read) is None
    assert lock.run("write", "doc", write) is None
    assert len(seen) == 2
    assert blocker.release() is True


def test_run_write_releases_when_the_callback_raises(rw_env: Rig) -> None:
    lock = rw_env.make_rw()

    def fail(hold: Handle) -> None:
        raise KeyError(hold.token)

    with pytest.raises(KeyError):
        lock.run("write", "doc", fail)
    assert lock.holders("doc").holders == []


def test_a_mutex_and_a_readwrite_lock_of_one_service_do_not_collide(rw_env: Rig) -> None:
    mutex = rw_env.make("mutex")
    lock = rw_env.make_rw()
    held(mutex.acquire("doc"))
    held(lock.acquire("write", "doc"))


@pytest.mark.manual_clock
def test_holds_expire_at_their_ttl(rw_env: Rig) -> None:
    clock = rw_env.need_clock()
    lock, other = rw_env.make_rw(), rw_env.make_rw()
    writer = held(lock.acquire("write", "doc", ttl=5))
    clock.advance(4.999)
    assert other.acquire("read", "doc") is None
    clock.advance(0.001)
    reader = held(other.acquire("read", "doc", ttl=5))
    assert writer.release() is False
    assert writer.extend() is False
    assert reader.fence is not None
    assert writer.fence is not None
    assert reader.fence > writer.fence


def test_holders_report_the_writer_or_the_readers(rw_env: Rig) -> None:
    lock: RWFace = rw_env.make_rw()
    a, b = held(lock.acquire("read", "doc")), held(lock.acquire("read", "doc"))
    found = lock.holders("doc")
    assert sorted((h.slot, h.token) for h in found.holders) == sorted([(1, a.token), (1, b.token)])
    assert found.fence == b.fence
    a.release()
    b.release()
    writer = held(lock.acquire("write", "doc"))
    assert [(h.slot, h.token) for h in lock.holders("doc").holders] == [(0, writer.token)]

"""How the MongoDB store reads answers, with no server: errors, results, request counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from dmutex import DMutex, DMutexError, DSemaphore
from dmutex._core.chance import CHANCE


class ServerError(Exception):
    """Stands in for a driver error: only its ``code`` matters to dmutex."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Result:
    matched_count: Any = 0
    deleted_count: Any = 0
    upserted_id: Any = None


class Scripted:
    """A Mongo-shaped client whose one collection answers from a script."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.requests: list[str] = []

    def get_database(self, name: str, /) -> Scripted:
        return self

    def get_collection(self, name: str, /) -> Scripted:
        return self

    def _answer(self, request: str) -> Any:
        self.requests.append(request)
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def create_index(self, keys: Any, /, *, expireAfterSeconds: int) -> Any:
        return self._answer("createIndexes")

    def update_one(self, filter: Any, update: Any, /, *, upsert: bool = False) -> Any:
        return self._answer("upsert" if upsert else "update")

    def delete_one(self, filter: Any, /) -> Any:
        return self._answer("delete")

    def distinct(self, key: str, filter: Any, /) -> Any:
        return self._answer("distinct")


HELD = ServerError(11000, "E11000 duplicate key error collection: dmutex._dmutex_svc")


def test_duplicate_key_is_contention_and_nothing_else_is() -> None:
    client = Scripted("index", HELD)
    assert DMutex("svc", client).acquire("k") is None
    assert client.requests == ["createIndexes", "upsert"]
    for code, message in [(2, "BadValue"), (13, "not authorized"), (11600, "interrupted")]:
        failing = Scripted("index", ServerError(code, message))
        with pytest.raises(ServerError, match=message):
            DMutex("svc", failing).acquire("k")


def test_a_semaphore_whose_permits_are_all_active_costs_two_requests() -> None:
    ids = [f"permit:{i}:k" for i in range(64)]
    client = Scripted("index", HELD, ids)
    assert DSemaphore("svc", client, max_permits=64).acquire("k") is None
    assert client.requests == ["createIndexes", "upsert", "distinct"]


def test_each_race_lost_costs_one_more_request(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first slot tried (0) is held; distinct says slots 1 and 2 are free;
    # both are taken by others before we get there; then nothing is left to try.
    monkeypatch.setattr(CHANCE, "randrange", lambda n: 0)
    client = Scripted("index", HELD, ["permit:0:k"], HELD, HELD)
    sem = DSemaphore("svc", client, max_permits=3)
    assert sem.acquire("k") is None
    assert client.requests == ["createIndexes", "upsert", "distinct", "upsert", "upsert"]


@pytest.mark.parametrize("answer", [None, "many", True, 1.0])
def test_unreadable_results_raise(answer: object) -> None:
    client = Scripted("index", Result(deleted_count=answer), Result(matched_count=answer))
    sem = DSemaphore("svc", client, max_permits=2)
    with pytest.raises(DMutexError, match="unexpected result"):
        sem.release("k", "token")
    with pytest.raises(DMutexError, match="unexpected result"):
        sem.extend("k", "token", 5)


def test_distinct_must_answer_a_list() -> None:
    client = Scripted("index", HELD, "permit:0:k")
    with pytest.raises(DMutexError, match="unexpected result"):
        DSemaphore("svc", client, max_permits=2).acquire("k")


def test_ready_failure_surfaces_again_from_the_next_operation() -> None:
    conflict = ServerError(85, "Index with name: expiredAt_1 already exists with different options")
    client = Scripted(conflict, conflict, "index", Result(), Result())
    mutex = DMutex("svc", client)
    with pytest.raises(ServerError, match="different options"):
        mutex.ready()
    with pytest.raises(ServerError, match="different options"):
        mutex.acquire("k")
    assert mutex.acquire("k") is not None, "the index was made on the third try"
    assert mutex.acquire("other") is not None
    assert client.requests == ["createIndexes"] * 3 + ["upsert"] * 2, "then never again"

"""Random campaigns, resignations and clock moves on one election name, checked against a model.

Three contenders campaign for one name (``timeout=0``: one attempt), the
leader resigns, and the ManualClock moves: in short steps, which the
leader's renewal outlasts, or in a jump past the TTL, after which its lease
is gone and its handle lost. The model is who leads (or nobody) and every
term granted. The invariants are the election's (``dmutex._core.terms``):

- a term never repeats and never goes back: each is greater than all before it;
- one leader per term (term -> contender);
- at most one contender believes it leads (a handle neither resigned nor lost);
- a resigned or expired leader's term is over: its handle is resigned or lost,
  and ``leader()`` never shows that term again;
- ``leader()`` agrees with the model: the current leader's term and identity, or None.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests._support.backends import Backend, Memory, Mongomock, Rig, SQLite
from tests._support.elections import ElectionFace, LeadershipHandle

NAME = "lead"
CONTENDERS = 3
TTL_MS = 3000  # renewed every second; a step of a quarter TTL never misses a renewal
# 60 by default: three fifths of the lease machine's count (DMUTEX_MODEL_EXAMPLES, 100).
EXAMPLES = max(1, int(os.environ.get("DMUTEX_MODEL_EXAMPLES", "100")) * 3 // 5)
SETTINGS = settings(max_examples=EXAMPLES, stateful_step_count=20, deadline=None)


class ElectionMachine(RuleBasedStateMachine):
    """Contenders for one name on one backend (sync face), checked against the model."""

    make_backend: ClassVar[Callable[[], Backend]]
    created: ClassVar[int] = 0

    def __init__(self) -> None:
        super().__init__()
        type(self).created += 1
        self.rig = Rig(type(self).make_backend(), "sync")
        clock = self.rig.clock
        assert clock is not None, "the machine moves a ManualClock"
        self.clock = clock
        ttl = TTL_MS / 1000
        self.nodes: list[ElectionFace] = [
            self.rig.make_election(identity=f"node-{n}", ttl=ttl) for n in range(CONTENDERS)
        ]
        self.observer = self.rig.make_election(identity="observer")
        # The model: who leads now (contender, handle), and every term granted.
        self.leader: tuple[int, LeadershipHandle] | None = None
        self.granted: dict[int, tuple[int, LeadershipHandle]] = {}  # term -> (contender, handle)
        self.ended: set[int] = set()  # terms over: resigned or expired
        self.resigned: set[int] = set()

    def teardown(self) -> None:
        self.rig.close()

    def end_term(self, leadership: LeadershipHandle, *, resigned: bool) -> None:
        self.ended.add(leadership.term)
        if resigned:
            self.resigned.add(leadership.term)
        self.leader = None

    @rule(node=st.integers(0, CONTENDERS - 1))
    def campaign(self, node: int) -> None:
        leadership = self.nodes[node].campaign(NAME, timeout=0)
        if self.leader is not None:
            assert leadership is None, "a campaign led while another leader held the name"
            return
        assert leadership is not None, "nobody led, yet the campaign did not lead"
        term = leadership.term
        assert term not in self.granted, "one leader per term"
        assert all(term > earlier for earlier in self.granted), "a term repeated or went back"
        assert leadership.identity == f"node-{node}"
        self.granted[term] = (node, leadership)
        self.leader = (node, leadership)

    @precondition(lambda self: self.leader is not None)
    @rule()
    def resign(self) -> None:
        assert self.leader is not None
        _, leadership = self.leader
        assert leadership.resign() is True
        self.end_term(leadership, resigned=True)

    @precondition(lambda self: bool(self.ended))
    @rule(data=st.data())
    def resign_an_ended_term(self, data: st.DataObject) -> None:
        """A leadership that is over resigns nothing: not the current leader's lease."""
        term = data.draw(st.sampled_from(sorted(self.ended)))
        _, leadership = self.granted[term]
        assert leadership.resign() is False

    @rule(ms=st.integers(1, TTL_MS // 4))
    def tick(self, ms: int) -> None:
        """Time passes in a short step: a leader's renewal keeps its lease."""
        self.clock.advance(ms / 1000)
        if self.leader is not None:
            assert not self.leader[1].lost, "a renewed leader lost its lease"

    @rule(ms=st.integers(TTL_MS + 1, 3 * TTL_MS))
    def lapse(self, ms: int) -> None:
        """The clock jumps past the TTL: the renewal due comes too late, the lease is gone."""
        self.clock.advance(ms / 1000)
        if self.leader is not None:
            leadership = self.leader[1]
            assert leadership.lost, "a leader whose lease ran out is not lost"
            self.end_term(leadership, resigned=False)

    @rule(node=st.integers(0, CONTENDERS - 1))
    def read(self, node: int) -> None:
        """Any contender reads who leads as the model says (the invariant reads as a bystander)."""
        self.check_leader(self.nodes[node])

    def check_leader(self, reader: ElectionFace) -> None:
        seen = reader.leader(NAME)
        if self.leader is None:
            assert seen is None, f"nobody leads, yet leader() says {seen}"
            return
        node, leadership = self.leader
        assert seen is not None, "leader() says nobody leads"
        assert (seen.term, seen.identity) == (leadership.term, f"node-{node}")
        assert seen.term not in self.ended
        assert seen.until > self.clock.now()

    @invariant()
    def leader_agrees_with_the_model(self) -> None:
        self.check_leader(self.observer)

    @invariant()
    def at_most_one_contender_believes_it_leads(self) -> None:
        believers = [
            term
            for term, (_, leadership) in self.granted.items()
            if term not in self.resigned and not leadership.lost
        ]
        expected = [] if self.leader is None else [self.leader[1].term]
        assert believers == expected

    @invariant()
    def an_ended_term_is_over(self) -> None:
        for term in self.ended:
            leadership = self.granted[term][1]
            assert term in self.resigned or leadership.lost
            assert leadership.time_left == 0.0


def check_machine(make_backend: Callable[[], Backend]) -> None:
    """Run the :class:`ElectionMachine` on ``make_backend``'s backends; at least EXAMPLES ran."""
    name = f"ElectionMachine_{make_backend.__name__}"
    attributes = {"make_backend": staticmethod(make_backend), "created": 0}
    machine: type[ElectionMachine] = type(name, (ElectionMachine,), attributes)
    run_state_machine_as_test(machine, settings=SETTINGS)
    assert machine.created >= EXAMPLES


@pytest.mark.parametrize("make_backend", [Memory, SQLite, Mongomock], ids=lambda b: b.__name__)
def test_terms(make_backend: Callable[[], Backend]) -> None:
    check_machine(make_backend)

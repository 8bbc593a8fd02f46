"""A `Liveness` (node/swarm/liveness.py) from plain functions, for tests that give a replicator SWIM's answers
without running SWIM."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from node.swarm.crdt import MemberState

__all__ = ["CallableLiveness"]


@dataclass
class CallableLiveness:
    """A `Liveness` from plain functions: for a caller whose answers come from elsewhere (tests, a simulation).
    Unless given, nobody was ever heard from and nobody is unheard of."""

    state: Callable[[str], MemberState]
    heard: Callable[[str], float | None] = lambda peer_id: None
    unheard: Callable[[str], bool] = lambda peer_id: False

    def member_state(self, peer_id: str) -> MemberState:
        return self.state(peer_id)

    def last_heard(self, peer_id: str) -> float | None:
        return self.heard(peer_id)

    def unheard_of(self, peer_id: str) -> bool:
        return self.unheard(peer_id)

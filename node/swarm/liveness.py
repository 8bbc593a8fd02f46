"""What the state replicator asks of a membership service that knows which members live (issue #53).

Why an interface: the replicator shows members' states from its own heartbeats (gossip membership) or, in
SWIM mode, from SWIM's probes (node/swarm/swim_service.py). It used to take SWIM's answers as three loose
callables, each None in gossip mode; one `Liveness` object (None: gossip mode) says the same with one
mode switch, and `SwimService` is that object as it stands.
"""

from __future__ import annotations

from typing import Protocol

from node.swarm.crdt import MemberState

__all__ = ["Liveness"]


class Liveness(Protocol):
    """SWIM's view of the members, by peer id (base58)."""

    def member_state(self, peer_id: str) -> MemberState:
        """Alive, suspect or gone, as the probes say (a member it never heard of: gone)."""
        ...

    def last_heard(self, peer_id: str) -> float | None:
        """When (wall time) it last had evidence that the member lives; None if never."""
        ...

    def unheard_of(self, peer_id: str) -> bool:
        """Whether it never heard of the member (not the same as holding it dead): worth a dial."""
        ...

"""What the state replicator and SWIM tell and ask of the node's connection manager (issue #53).

Why interfaces: the replicator used to take the manager's answers and ears as three loose callables
(`crowded`, `on_served`, `on_heard`), and SWIM had two patched in after it was built, wired by the daemon one
by one. The manager (p2p/connmgr.py `ConnManager`) is each object as it stands; a test gives a recording one.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

from libp2p.peer.id import ID

__all__ = ["Connections", "SwimConnections"]


class Connections(Protocol):
    """What the replicator tells and asks of the node's connection manager (p2p/connmgr.py's `ConnManager`)."""

    def crowded(self) -> bool:
        """Whether the node holds more connections than it keeps: it then hands a newcomer on
        (:meth:`StateReplicator._hands_on`) rather than serving it the whole table."""
        ...

    def served(self, peer_id: ID) -> None:
        """``peer_id`` has what a newcomer needs from this node (a session's records, or a referral): over the
        cap its connection may close without waiting out the newcomer's grace period."""
        ...

    def heard_from(self, peer_id: ID) -> None:
        """A session with ``peer_id`` ended with its answer (synced, or refused): its connection delivers (the
        manager drops connections that deliver nothing)."""
        ...


class SwimConnections(Protocol):
    """What SWIM tells and asks of the node's connection manager (p2p/connmgr.py's `ConnManager` is it)."""

    def heard_from(self, peer_id: ID) -> None:
        """A message arrived from ``peer_id``: its connection delivers."""
        ...

    def redial(self, peer_id: ID) -> Awaitable[bool]:
        """Dial a member whose connection dropped; True if connected after."""
        ...

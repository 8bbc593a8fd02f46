"""The transport layer's sections of a daemon's status (`starling status --json`), as TypedDicts.

Their builders are here in p2p/ (the `status()` of the connection manager, discovery, access control and
the per-subnet stream limits); the whole status is node/status_schema.py's `NodeStatus`, which names these.
This module imports nothing else, so that the status schema stays cheap to import (`starling status`).
"""

from typing import TypedDict

__all__ = ["AuthorizationStatus", "BootstrapPeerStatus", "ConnectionsStatus", "DiscoveryStatus", "MuxerStatus", "StreamLimitsStatus"]


class ConnectionsStatus(TypedDict):
    """``connections`` (p2p/connmgr.py): the connection manager's targets and queues."""

    target: int
    cap: int
    connected: int
    candidates: int  # known peers
    dialing: int
    backing_off: int
    max_per_subnet: int
    subnet_pruned: int
    cap_pruned: int  # connections closed because the node had more than ``cap``
    silent_closed: int  # connections closed because every connection had delivered nothing for a while


class BootstrapPeerStatus(TypedDict):
    """``bootstrap.peers[i]`` (p2p/connmgr.py): one bootstrap peer, and why dialling it fails."""

    peer_id: str
    addrs: list[str]
    connected: bool
    failures: int  # failed dials in a row
    last_error: str  # why the last dial failed ("" while connected or not yet tried): the cause, when known


class DiscoveryStatus(TypedDict):
    """``discovery`` (p2p/discovery.py): swarm members found through the DHT."""

    members_found: int
    routing_table: int
    lookups: int
    last_error: str  # "" while none failed
    dials_withheld: int  # DHT queries to unconnected peers not sent: the node had its target of connections
    lookups_skipped: int  # lookups not run: the node had its connections, or enough candidates to dial (records)


class AuthorizationStatus(TypedDict):
    """``authorization`` (p2p/auth.py): the swarm key, the allowlist and what they refused."""

    swarm_key: bool  # the swarm is closed by a pre-shared key
    allowlist: int  # peers in node.allow_peers (0: any peer)
    refused_handshakes: int
    refused_peers: int


class StreamLimitsStatus(TypedDict):
    """``stream_limits`` (p2p/netgroup.py): streams per network group and protocol."""

    per_subnet: dict[str, int]  # protocol -> streams one network group may hold at once
    refused: dict[str, int]  # protocol -> streams reset because their group had its share


class MuxerStatus(TypedDict):
    """``muxer`` (p2p/limits.py): peers that broke Yamux flow control, and what was not buffered."""

    window_overruns: int  # connections closed because the peer sent past a stream's receive window
    dropped_bytes: int  # bytes not buffered: past a window, or for streams no longer read
    offenders: int  # distinct peers with an overrun (the most recent 1024)

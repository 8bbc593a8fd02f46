"""p2p: the transport layer, the bottom of p2p <- protocols <- node (pyproject.toml's import contracts).

What a node needs to reach peers and move bytes, with no knowledge of training:

    host.py            build_host: the libp2p host (TCP, Noise, yamux) with honest announce addresses
    identity.py        load_or_create_identity, peer_id_of: the node's ed25519 key on disk
    addrs.py           parse_listen, parse_bootstrap, AddrError: operators' multiaddrs, checked
    auth.py            AccessControl, read_swarm_key: the swarm key (private network) and PeerID allowlist
    connmgr.py         ConnManager: keeps about `target` connections to members, no more than `cap` for long
    discovery.py       SwarmDiscovery: swarm members found through the Kademlia DHT
    netgroup.py        SubnetStreamLimits, group_of: per-subnet limits (Sybil bounds)
    multiselect.py     PipelinedMultiselectClient: a new stream's protocol chosen in one round trip, not two
    limits.py          BoundedYamux, MuxerOffences, release_inbound_slots_on_close: limits py-libp2p declares
                       but does not keep (Yamux windows, inbound connection slots)
    gossip.py          send_peer_record_once, idontwant_for_large_messages_only: gossipsub without py-libp2p's
                       peer record on every message, nor an IDONTWANT for every small one
    bootstrap_file.py  watch_bootstrap_files, write_addr_file: bootstrap addresses shared through files
    framing.py         FrameSplitter, ProtocolError, Reason: length-prefixed msgpack frames, sans-io (every
                       protocol's and the daemon-worker channel's: one prefix, one limit, one error)
    wire.py            FrameChannel, send_msg, recv_msg, from_map: the framing on streams, messages validated
    datapath.py        DataPathListener, connect_datapath: the encrypted TCP side channel for bulk tensors
    punch.py           simultaneous_open: TCP hole punching for that side channel
    fsutil.py          atomic_write_bytes: atomic, private file writes
    status.py          ConnectionsStatus, DiscoveryStatus, ...: this layer's sections of the daemon's status
    lazy.py            lazy_exports: the packages' surfaces, loaded on first use

The names below are importable from the package itself (``from p2p import ConnManager``); each module is
imported on first use, so ``import p2p`` loads neither libp2p nor anything else.
"""

from __future__ import annotations

from p2p.lazy import lazy_exports

_EXPORTS = {
    "build_host": "p2p.host",
    "load_or_create_identity": "p2p.identity",
    "peer_id_of": "p2p.identity",
    "AddrError": "p2p.addrs",
    "parse_bootstrap": "p2p.addrs",
    "parse_listen": "p2p.addrs",
    "AccessControl": "p2p.auth",
    "read_swarm_key": "p2p.auth",
    "ConnManager": "p2p.connmgr",
    "SwarmDiscovery": "p2p.discovery",
    "SubnetStreamLimits": "p2p.netgroup",
    "group_of": "p2p.netgroup",
    "watch_bootstrap_files": "p2p.bootstrap_file",
    "write_addr_file": "p2p.bootstrap_file",
    "FrameChannel": "p2p.wire",
    "ProtocolError": "p2p.wire",
    "recv_msg": "p2p.wire",
    "send_msg": "p2p.wire",
    "DataPathListener": "p2p.datapath",
    "connect_datapath": "p2p.datapath",
    "simultaneous_open": "p2p.punch",
    "atomic_write_bytes": "p2p.fsutil",
    "AuthorizationStatus": "p2p.status",
    "ConnectionsStatus": "p2p.status",
    "DiscoveryStatus": "p2p.status",
    "StreamLimitsStatus": "p2p.status",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

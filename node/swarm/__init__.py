"""node.swarm: who is in the swarm and how to reach them (the daemon's side; no torch).

    crdt.py        SwarmState, MemberState: the swarm state as signed CRDTs (the replica)
    manifest_trust.py  ManifestAuthority: which run manifest this node adopts (founder, hash, first use);
                   read_manifest_pin, write_manifest_pin: HOME/manifest.pin, what first use remembers
    replicator.py  StateReplicator: that state replicated by gossip and anti-entropy
    liveness.py    Liveness: what the replicator asks of SWIM (states, last heard, never heard of)
    connections.py Connections, SwimConnections: what the replicator and SWIM tell and ask of the
                   connection manager
    nat.py         NatService: reachability, circuit relays, hole punching, the path to each peer
    circuit.py     parse_circuit_addr, connection_is_relayed: circuit relay v2's addresses and answers
    holepunch.py   ReportingDCUtR: py-libp2p's DCUtR, with each punch's outcome and why it failed
    membership.py  Membership: SWIM failure detection and piggy-backed dissemination, sans-io (issue #24)
    swim_service.py SwimService: that core over libp2p, one long-lived stream per connected peer
                   (node.membership = "swim": liveness from SWIM, records re-signed only on change)

Imports the status contract (node/status_schema.py) and nothing else of node/.
"""

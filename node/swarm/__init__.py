"""node.swarm: who is in the swarm and how to reach them (the daemon's side; no torch).

    crdt.py        SwarmState, MemberState, ManifestAuthority: the swarm state as signed CRDTs
    replicator.py  StateReplicator: that state replicated by gossip and anti-entropy
    nat.py         NatService: reachability, circuit relays, hole punching, the path to each peer

Imports the status contract (node/status_schema.py) and nothing else of node/.
"""

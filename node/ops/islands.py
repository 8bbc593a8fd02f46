"""The swarm's pairing graph as one node sees it: who has averaged with whom lately, and whether the
trainers still form one group.

Why this exists: NoLoCo has no all-reduce, so the only thing that keeps the trainers' models one model
is that pairwise averaging mixes them. If the trainers split into groups that only ever pair among
themselves (islands: two speed classes in different outer-step ranges, a firewall between two sites, a
version skew that refuses exchanges), each island trains its own model and nothing in the loss curve of
a single node says so. Every member record carries the PeerIDs its author averaged with over its last
outer steps (`partners`), so any node, a network-only one included, can rebuild the graph and see the
split. This module does that as a pure function of `starling status --json`'s member list, so that
`starling status`, `starling doctor` and the metrics give the same answer and tests can feed it
synthetic swarms.

Only alive trainers are vertices: a gone member cannot mix with anyone any more, and a network-only
node never averages. An edge is one member naming another in `partners`, in either direction (the two
records are published independently, so one side may lag). A trainer with no edge to another alive
trainer (it names nobody yet, or only members that have since gone) is *unpaired*, reported apart from
the islands: otherwise every freshly started swarm, where nobody has paired yet, would look split into
one-member islands.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from node.status_schema import MemberStatus


@dataclass(frozen=True)
class PairingGraph:
    """Connected groups of alive trainers (largest first, members sorted) and the trainers with no edge."""

    islands: list[list[str]]
    unpaired: list[str]

    @property
    def split(self) -> bool:
        """True when the paired trainers form two or more groups that never average across."""
        return len(self.islands) >= 2

    @property
    def paired(self) -> int:
        """How many trainers belong to some island."""
        return sum(len(island) for island in self.islands)


def alive_trainers(members: Iterable[MemberStatus]) -> dict[str, list[str]]:
    """{PeerID: the PeerIDs it names as recent partners} for members that are alive and train.

    Entries that are not dicts, lack a PeerID, or carry a malformed `partners` field are skipped or read
    as naming nobody: the status comes from the network, and a view must never crash on it.
    """
    trainers: dict[str, list[str]] = {}
    for m in members:
        if not isinstance(m, Mapping) or m.get("state") != "alive" or m.get("role") != "trainer":
            continue
        peer_id = m.get("peer_id")
        if not isinstance(peer_id, str) or not peer_id:
            continue
        partners = m.get("partners")
        named = [p for p in partners if isinstance(p, str)] if isinstance(partners, list) else []
        trainers[peer_id] = named
    return trainers


def _adjacency(trainers: Mapping[str, list[str]]) -> dict[str, set[str]]:
    """Undirected edges between alive trainers: naming is enough on one side."""
    adjacent: dict[str, set[str]] = {p: set() for p in trainers}
    for peer_id, named in trainers.items():
        for partner in named:
            if partner in adjacent and partner != peer_id:
                adjacent[peer_id].add(partner)
                adjacent[partner].add(peer_id)
    return adjacent


def _component(start: str, adjacent: Mapping[str, set[str]]) -> set[str]:
    """Every trainer reachable from `start` (iterative, so a long chain cannot hit the recursion limit)."""
    seen, todo = {start}, [start]
    while todo:
        for neighbour in adjacent[todo.pop()]:
            if neighbour not in seen:
                seen.add(neighbour)
                todo.append(neighbour)
    return seen


def pairing_graph(members: Iterable[MemberStatus]) -> PairingGraph:
    """The islands and unpaired trainers among `members` (the `members` list of the status dict)."""
    adjacent = _adjacency(alive_trainers(members))
    unpaired = sorted(p for p, edges in adjacent.items() if not edges)
    islands: list[list[str]] = []
    seen: set[str] = set(unpaired)
    for peer_id in sorted(adjacent):
        if peer_id not in seen:
            island = _component(peer_id, adjacent)
            seen |= island
            islands.append(sorted(island))
    islands.sort(key=lambda island: (-len(island), island))
    return PairingGraph(islands=islands, unpaired=unpaired)

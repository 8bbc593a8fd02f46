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

The same graph also measures a pairing *rule* (node/averaging/pairing.py) rather than a live swarm:
`mutual_share` is the share of nodes whose scheduled partner names them back when each computed the
schedule from its own member list, and `window_mixing` how well a run of matchings mixes (distinct partners
per node, and the spectral gap of the window's averaged mixing matrix, which bounds how fast repeated
pairwise averaging over such windows drives every node to the mean). Benches and the scale simulation use
them to compare rules as the swarm grows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from node.status_schema import MemberStatus

if TYPE_CHECKING:
    import numpy as np


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


def mutual_share(partner_of: Mapping[str, str | None]) -> float:
    """The share of nodes whose partner (`partner_of[node]`: the partner its own view of the schedule gives
    it, None for a bye) names them back. A bye counts as agreeing when no other node names it: it steps solo
    as planned and keeps nobody waiting. 1.0 for no nodes."""
    named: dict[str, int] = {}
    for partner in partner_of.values():
        if partner is not None:
            named[partner] = named.get(partner, 0) + 1
    agreed = sum(1 for node, partner in partner_of.items()
                 if (partner_of.get(partner) == node if partner is not None else node not in named))
    return agreed / len(partner_of) if partner_of else 1.0


@dataclass(frozen=True)
class WindowMixing:
    """How a window of matchings mixes: distinct partners per node (least and mean over nodes) and the
    spectral gap of the window's averaged mixing matrix (0: the pairs leave the nodes in separate groups; the
    larger, the faster repeated windows bring every node to the mean)."""

    nodes: int
    rounds: int
    distinct_min: int
    distinct_mean: float
    spectral_gap: float


DENSE_MAX = 2048  # nodes up to which the spectral gap comes from a full eigendecomposition, Lanczos above


def window_mixing(rounds: Sequence[Mapping[str, str | None]], dense_max: int = DENSE_MAX) -> WindowMixing:
    """The mixing of `rounds` (one matching per outer step: {node: its partner, None for a bye}).

    A pair averages only when both name each other, so one-sided entries are no edge. Round r's mixing
    matrix W_r replaces both members of each pair by their mean (and leaves everyone else as is); the
    window's averaged matrix is W = mean of the W_r = I - L / (2R), with L the Laplacian of the window's
    pairs (a multigraph) and R the number of rounds. W is symmetric, doubly stochastic and positive
    semidefinite (each W_r is a projection), so its spectral gap 1 - max |lambda_i(W)|, i >= 2, is
    lambda_2(L) / (2R): the algebraic connectivity of the window's pairing graph. Up to `dense_max` nodes
    that comes from numpy's eigvalsh; above, from a Lanczos iteration on W restricted to the vectors that sum
    to zero (a full eigendecomposition at 10,000 nodes takes minutes and 800 MB; Lanczos a fraction of a
    second). numpy is imported here, not at the top, so that `starling status` (which imports this module
    for the islands) does not load it."""
    import numpy as np

    names = sorted({n for r in rounds for n in r} | {p for r in rounds for p in r.values() if p is not None})
    index = {n: i for i, n in enumerate(names)}
    n, count = len(names), max(len(rounds), 1)
    partners: dict[str, set[str]] = {name: set() for name in names}
    us: list[int] = []
    vs: list[int] = []
    for r in rounds:
        for a, b in r.items():
            if b is not None and a < b and r.get(b) == a:
                partners[a].add(b)
                partners[b].add(a)
                us.append(index[a])
                vs.append(index[b])
    distinct = [len(p) for p in partners.values()]
    if n < 2:
        return WindowMixing(n, len(rounds), min(distinct, default=0), float(sum(distinct)), 0.0)
    u, v = np.array(us, dtype=np.int64), np.array(vs, dtype=np.int64)
    degree = np.bincount(u, minlength=n) + np.bincount(v, minlength=n)
    if n <= dense_max:
        laplacian = np.diag(degree.astype(np.float64))
        np.add.at(laplacian, (u, v), -1.0)
        np.add.at(laplacian, (v, u), -1.0)
        fiedler = float(np.linalg.eigvalsh(laplacian)[1])
    else:
        fiedler = 2 * count * (1.0 - _lanczos_second(u, v, degree, count))
    return WindowMixing(n, len(rounds), min(distinct), sum(distinct) / n, max(0.0, fiedler / (2 * count)))


def _lanczos_second(u: np.ndarray, v: np.ndarray, degree: np.ndarray, rounds: int, steps: int = 200) -> float:
    """The largest eigenvalue of W = I - L / (2R) on the vectors orthogonal to the ones (W's second), by
    Lanczos with full reorthogonalization from a fixed start (deterministic). The top of a random
    matching graph's spectrum is a continuum edge, so the Ritz value approaches it from below like 1/k^2:
    200 steps leave it within about 1e-4 at 10,000 nodes."""
    import numpy as np

    deg = degree.astype(np.float64)
    n = deg.size

    def apply(x: np.ndarray) -> np.ndarray:
        adj = np.bincount(u, weights=x[v], minlength=n) + np.bincount(v, weights=x[u], minlength=n)
        return x - (deg * x - adj) / (2 * rounds)

    def deflate(x: np.ndarray) -> np.ndarray:
        return x - x.mean()

    k = min(steps, n - 1)
    basis = np.zeros((k, n))
    alphas: list[float] = []
    betas: list[float] = []
    q = deflate(np.random.default_rng(0).standard_normal(n))
    q /= np.linalg.norm(q)
    for j in range(k):
        basis[j] = q
        w = deflate(apply(q))
        alphas.append(float(w @ q))
        w -= basis[: j + 1].T @ (basis[: j + 1] @ w)  # full reorthogonalization (twice is enough)
        w -= basis[: j + 1].T @ (basis[: j + 1] @ w)
        beta = float(np.linalg.norm(w))
        if beta < 1e-12 or j == k - 1:
            break
        betas.append(beta)
        q = w / beta
    t = np.diag(alphas) + np.diag(betas[: len(alphas) - 1], 1) + np.diag(betas[: len(alphas) - 1], -1)
    return float(np.linalg.eigvalsh(t)[-1])

"""Who averages with whom at each outer step: a schedule every trainer computes alone, from its own view.

Why a schedule: pairing by "whoever asks first" lets equal machines phase-lock. Trainers that publish at the
same moment every round ask in the same order every round, so the same pairs form again and again and, with
an odd number of trainers, the same one starves; NoLoCo's convergence argument needs a well-mixing gossip
graph, a fresh random partner at every outer step. The NoLoCo reference code gets that from a permutation
seeded by the step count, which every rank draws alike because ranks run in lock step. Starling has no lock
step and no rank list, but after an exchange both partners continue from the larger of their outer steps,
so trainers that average share their outer-step counter; and each trainer knows a member list (the swarm
state). From those two, each trainer computes the matching for each outer step.

Member lists differ between nodes: a join or a death reaches nodes seconds apart, a partial view or a
capped table leaves members out, and each averager drops partners that missed rounds (partner_misses.py).
So the matching must change only *locally* when the list changes. A permutation seeded by the whole list
(the rule before issue #24) does not: two views one member apart draw unrelated matchings, and almost
nobody's scheduled partner names them back. The matching here is built so that it does:

- Every member gets a key for the outer step, a 64-bit hash of (outer step, PeerID): `h(r, name)`.
- The keys, as bit strings, form a binary trie. It is matched bottom-up: each subtree hands up at most one
  unmatched member (its *leftover*), and the leftovers of two sibling subtrees pair. The result is a
  perfect matching (one bye, the root's leftover, when the count is odd) that each node computes from its
  own list alone.
- Adding or removing a member flips the parity of the subtrees on its root path only, so only the pairs
  formed along that path change: the matching of a node whose view lacks or has one member more differs in
  the partners of O(log2 N) nodes: about 0.55 x log2 N on average at 64 to 10,000 members, rarely more
  than 2.5 x log2 N (tests/test_pairing.py gives the analysis; docs/benchmarks.md "Tolerating different
  member lists" the agreement it buys). d differences cost about d times one at most.
- Keys are fresh at every outer step and independent of each other, so (outside the like-speed steps
  below) each member's partner is uniform over the others, the members being exchangeable under i.i.d.
  keys, and drawn afresh: partners spread over the whole swarm and no pairs stay fixed, as with the
  reference's permutation. (The matching is not uniform over all perfect matchings: pairs never cross in
  key order. Per member and over a window it mixes as a uniform one does: docs/benchmarks.md.)

Byes. With an odd number of trainers one trainer sits out (a *bye*: a solo step). In a small swarm byes go
round the trainers in a fixed order (by a hash of each PeerID, so a join moves it locally too): each sits
out exactly once every N outer steps, and with three trainers each averages in two of every three (a bye
drawn at random instead can hit the same trainer several times in a row; over the ten or twenty outer steps
of a few minutes that starves one trainer visibly). The rotating bye steps out of its trie pair and the
trie's leftover takes its place, so the rotation moves three partners, not a root path. Above
`BYE_ROTATION_MAX` trainers the bye is simply the trie's root leftover: uniform at random, so fair on
average, and at that size a random bye starves nobody (at 33 trainers the unluckiest of them sits out 4 or
more of 20 outer steps in 9% of windows, while falling below issue #12's 60% averaged would take 9). The
rotation costs locality: `round mod N` names another trainer for every N, so views of different odd counts
disagree on the bye and on the three partners around it (measured at 16 and 17 members: 4.1 nodes' partners
differ on average, against 2.7 from the trie alone). Small swarms hold every member and their views agree
but for seconds after a join, so there exact fairness wins; in large ones locality does. The threshold is
even, so views one member apart never straddle it with both counts odd (31 and 32, 32 and 33: one side has
no bye at all).

Machines of different speeds. Where the member records show trainers in more than one speed tier (factor-2
buckets of their `samples_per_s`), a share `TIER_SHARE` of the outer steps (drawn from the outer step
alone) pairs trainers of like speed: the keys are prefixed with the tier, so each tier is one subtree and
pairs within itself, and only the tiers' leftovers meet across. The other steps draw the matching at
random as above, so trainers of different speeds still meet in most steps and the swarm stays one model.
Why: a pair's outer step takes both to a sample-weighted point (node/worker/outer.py), so a fast machine
that meets a slow one moves towards a model that carries fewer samples, and with only random pairs the
fast machines (which carry most of the swarm's samples) spend two of every three steps apart from each
other. In-process (2 trainers at H = 20, 2 at H = 8, random pairs, 3 seeds; docs/benchmarks.md, "Pairing
rule") the fast members reached 2.2195 with random pairs, 2.2117 with like-speed pairs in 40% of steps,
against 2.2131 for the two fast machines alone; the slow ones stayed within 0.5% of the fast ones, and
fast-slow exchanges were 40% of all. Equal machines are one tier (a common prefix changes no subtree), and
their matchings are exactly the random ones.

Groups (`sync.group_size` = 4, opt-in: see docs/benchmarks.md "Groups of four"). Pairs alone leave every
trainer with its own phi, and the spread between them (the consensus error) costs loss: in-process, one
group of all four of 2 fast + 2 slow machines reached 0.019 below the 2 fast alone, random pairs 0.003
above. So each outer step has a second round (`schedule`): the first round's pairs are matched by the same
trie one level up (a pair's key is its first member's), and two pairs meet crosswise (a-c and b-d after
a-b and c-d), and each side sends its pair's mean, so that all four end with the mean of the four, from
pairwise exchanges only (a butterfly). A bye joins the pair that has no other pair to join (its first
member), so with three trainers nobody steps solo. Groups never grow past four: the second round's
partners carry at most two trainers' values each (`protocols.avg.MAX_MEMBERS`).

`agreement` measures how well a set of differing views still pairs (the share of nodes whose partner names
them back); node/ops/islands.py, `window_mixing`, how well a run of matchings mixes.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Mapping

from node.ops.islands import mutual_share

BYE = None
TIER_SHARE = 0.4  # of outer steps, where speeds differ, that pair trainers of like speed
UNKNOWN_TIER = -1000  # a trainer whose speed is not known yet
# Up to this many trainers an odd one out rotates exactly (once every N outer steps); above it the bye is
# the trie's root leftover, which keeps the matching local (module docstring). Even, so that views one
# member apart never use the two rules with both counts odd.
BYE_ROTATION_MAX = 32
KEY_BITS = 64
_DOMAIN = "starling/pairing/v3"


def speed_tier(samples_per_s: float | None) -> int:
    """A trainer's speed class: factor-2 buckets of its samples/s, so that equal machines share one tier
    despite jitter, and nodes that read slightly different records still agree."""
    if samples_per_s is None or not math.isfinite(samples_per_s) or samples_per_s <= 0:
        return UNKNOWN_TIER
    return max(-60, min(60, math.floor(math.log2(samples_per_s))))


def _hasher(*parts: object) -> hashlib.blake2b:
    """A hash every node seeds alike from the same parts (not Python's salted `hash`)."""
    return hashlib.blake2b("/".join(map(str, (_DOMAIN, *parts, ""))).encode(), digest_size=KEY_BITS // 8)


def _keys(names: Iterable[str], *parts: object) -> dict[str, int]:
    """Each name's 64-bit key under `parts` (the outer step, or "byes")."""
    base = _hasher(*parts)
    keys: dict[str, int] = {}
    for name in names:
        h = base.copy()
        h.update(name.encode())
        keys[name] = int.from_bytes(h.digest(), "big")
    return keys


def _tiered(round_no: int) -> bool:
    """Whether outer step `round_no` pairs like speeds: from the outer step alone, so every view agrees."""
    return int.from_bytes(_hasher("tiered", round_no).digest(), "big") < TIER_SHARE * 2**KEY_BITS


def _tier_code(tier: int) -> int:
    """A tier as 8 bits (unknown: 0, the known ones above it, faster higher)."""
    return 0 if tier == UNKNOWN_TIER else 128 + tier


def trie_matching(keyed: Iterable[tuple[int, str]]) -> tuple[list[tuple[str, str]], str | None]:
    """The pairs of the binary trie of the keys, matched bottom-up, and the leftover (None when the count
    is even). Each pair is (the smaller key's name, the larger's).

    Each subtree hands up at most one unmatched entry; two from sibling subtrees pair. The recursion
    follows only branching nodes (the highest bit in which a range's smallest and largest keys differ), so
    it makes about 2N calls and goes at most as deep as the keys have bits. Equal keys (a hash collision)
    pair in name order."""
    items = sorted(keyed)
    pairs: list[tuple[str, str]] = []

    def solve(lo: int, hi: int) -> str | None:
        if hi - lo == 1:
            return items[lo][1]
        diff = items[lo][0] ^ items[hi - 1][0]
        if diff == 0:
            for i in range(lo, hi - 1, 2):
                pairs.append((items[i][1], items[i + 1][1]))
            return items[hi - 1][1] if (hi - lo) % 2 else None
        shift = diff.bit_length() - 1
        mid = bisect.bisect_left(items, ((items[hi - 1][0] >> shift) << shift,), lo, hi)
        left, right = solve(lo, mid), solve(mid, hi)
        if left is not None and right is not None:
            pairs.append((left, right))
            return None
        return left if left is not None else right

    leftover = solve(0, len(items)) if items else None
    return pairs, leftover


def matching(members: Iterable[str], round_no: int, speeds: Mapping[str, float] | None = None) -> dict[str, str | None]:
    """Everyone's partner at outer step `round_no` (BYE: a solo step), for the given member list and the
    members' samples/s (`speeds`, as their records show; None or missing: unknown)."""
    return {name: first for name, (first, _) in schedule(members, round_no, speeds).items()}


def schedule(members: Iterable[str], round_no: int,
             speeds: Mapping[str, float] | None = None,
             fragment: int | None = None) -> dict[str, tuple[str | None, str | None]]:
    """Everyone's two partners at outer step `round_no`: (the first round's, the second round's), either
    None where there is none.

    `fragment`: the streaming fragment the step syncs (`sync.fragments` > 1, node/averaging/averager.py):
    the keys and the bye's turn are then drawn for (outer step, fragment), so that each fragment sync of a
    period has its own partner, drawn as freshly as the outer steps' are; None (one fragment): the outer
    step's, as it always was.

    The first round is the trie matching of the members' keys for this outer step (prefixed by their
    speed tier in the tiered share of steps); where the count is odd and at most `BYE_ROTATION_MAX`, the
    rotating bye swaps places with the trie's leftover. The second round matches the first round's pairs by the same trie, each pair keyed
    by its first member's key, and two matched pairs (a, b) and (c, d) meet crosswise: a-c and b-d. After
    the second round (each side sending its pair's mean, node/averaging/averager.py) all four hold the mean
    of the four: groups of four from pairwise exchanges only, as a butterfly all-reduce builds them. A bye
    meets the first member of the pair that the second round leaves over, so that with three trainers
    nobody steps solo. Why groups: in-process, averaging all four of 2 fast + 2 slow machines at every
    outer step reached a loss 0.019 below the 2 fast machines alone, while random pairs stayed 0.003 above
    it (docs/benchmarks.md, "Heterogeneous machines, in-process"): the pairs' consensus error ate what the
    slow machines' samples brought."""
    names = set(members)
    keys = _keys(names, "round", round_no) if fragment is None else _keys(names, "round", round_no, "fragment",
                                                                          fragment)
    if _tiered(round_no):
        keys = {n: (_tier_code(speed_tier((speeds or {}).get(n))) << KEY_BITS) | k for n, k in keys.items()}
    pairs, bye = trie_matching((k, n) for n, k in keys.items())
    if bye is not None and len(names) <= BYE_ROTATION_MAX:
        # The rotation's bye steps out of its pair, and the trie's leftover takes its place: three
        # partners move, not the whole trie (as leaving the bye out of the trie would move its root path).
        rank = _keys(names, "byes")
        turn = round_no if fragment is None else round_no + fragment  # fragments of a step: byes move on
        rotating = sorted(names, key=lambda n: (rank[n], n))[turn % len(names)]
        if rotating != bye:
            i = next(i for i, pair in enumerate(pairs) if rotating in pair)
            other = pairs[i][1] if pairs[i][0] == rotating else pairs[i][0]
            pairs[i] = (bye, other) if keys[bye] < keys[other] else (other, bye)
            bye = rotating
    first: dict[str, str | None] = {}
    second: dict[str, str | None] = {}
    if bye is not None:
        first[bye] = BYE
    for a, b in pairs:
        first[a], first[b] = b, a
    pair_of = {a: (a, b) for a, b in pairs}
    groups, alone = trie_matching((keys[a], a) for a, _ in pairs)
    for x, y in groups:
        (a, b), (c, d) = pair_of[x], pair_of[y]
        second[a], second[c], second[b], second[d] = c, a, d, b
    if alone is not None and bye is not None:
        second[bye], second[alone] = alone, bye
    return {name: (first[name], second.get(name)) for name in first}


def scheduled_partner(me: str, others: Iterable[str], round_no: int,
                      speeds: Mapping[str, float] | None = None) -> str | None:
    """This node's partner at outer step `round_no` among `others` (the trainers it could pair with); None
    when the schedule gives it a bye or it knows no one."""
    return matching([me, *others], round_no, speeds).get(me)


def scheduled_partners(me: str, others: Iterable[str], round_no: int,
                       speeds: Mapping[str, float] | None = None,
                       fragment: int | None = None) -> tuple[str | None, str | None]:
    """This node's (first-round, second-round) partners at outer step `round_no` (`schedule`; `fragment`:
    that streaming fragment's sync of the step)."""
    return schedule([me, *others], round_no, speeds, fragment).get(me, (None, None))


def agreement(views: Mapping[str, Iterable[str]], round_no: int,
              speeds: Mapping[str, float] | None = None) -> float:
    """The share of nodes whose first-round partner at outer step `round_no` names them back, when each
    node computes the schedule from its own view (`views`: {node: the members it knows, itself included
    or not}). A node the schedule gives a bye counts as agreeing when no other node names it. Nodes that
    hold equal views share one matching, so a simulation of many nodes with a few distinct views is cheap.
    (node/ops/islands.py, `mutual_share`, does the counting; benches feed it other rules' partners.)"""
    cache: dict[frozenset[str], dict[str, str | None]] = {}
    partner_of: dict[str, str | None] = {}
    for node, view in views.items():
        full = frozenset(view) | {node}
        if full not in cache:
            cache[full] = matching(full, round_no, speeds)
        partner_of[node] = cache[full][node]
    return mutual_share(partner_of)

"""Who averages with whom at each outer step: a schedule every trainer computes alone, and the same.

Why a schedule: pairing by "whoever asks first" lets equal machines phase-lock. Trainers that publish at the
same moment every round ask in the same order every round, so the same pairs form again and again and, with
an odd number of trainers, the same one starves; NoLoCo's convergence argument needs a well-mixing gossip
graph, a fresh random partner at every outer step. The NoLoCo reference code gets that from a permutation
seeded by the step count, which every rank draws alike because ranks run in lock step. Starling has no lock
step and no rank list, but after an exchange both partners continue from the larger of their outer steps,
so trainers that average share their outer-step counter; and every trainer knows the same member list
(the swarm state). From those two, each trainer computes the same matching for each outer step.

The matching is drawn afresh for every outer step from a seed that every node derives from the outer step
and the member list alone, as the reference code does: a random perfect matching, so partners spread over
the whole swarm and no pairs stay fixed. With an odd number of trainers one trainer sits out (a
*bye*: a solo step), and byes go round the trainers in a fixed order (drawn once per member list), so
each trainer sits out exactly once every N outer steps: with three trainers each averages in two of every
three. (A bye drawn at random instead can hit the same trainer several times in a row; over the ten or
twenty outer steps of a few minutes that starves one trainer visibly.)

Machines of different speeds. Where the member records show trainers in more than one speed tier (factor-2
buckets of their `samples_per_s`), a share `TIER_SHARE` of the outer steps (drawn from the same seed) pairs
trainers of like speed: each tier is shuffled, the tiers are laid out fastest first and neighbours pair.
The other steps draw the matching at random as above, so trainers of different speeds still meet in most
steps and the swarm stays one model. Why: a pair's outer step takes both to a sample-weighted point
(node/worker/outer.py), so a fast machine that meets a slow one moves towards a model that carries fewer
samples, and with only random pairs the fast machines (which carry most of the swarm's samples) spend two
of every three steps apart from each other. In-process (2 trainers at H = 20, 2 at H = 8, random pairs, 3
seeds; docs/benchmarks.md, "Pairing rule") the fast members reached 2.2195 with random pairs, 2.2117 with
like-speed pairs in 40% of steps, against 2.2131 for the two fast machines alone; the slow ones stayed
within 0.5% of the fast ones, and fast-slow exchanges were 40% of all. Equal machines are one tier, and
their matchings are exactly the random ones.

Groups (`sync.group_size` = 4, opt-in: see docs/benchmarks.md "Groups of four"). Pairs alone leave every trainer with its own phi, and the
spread between them (the consensus error) costs loss: in-process, one group of all four of 2 fast + 2 slow
machines reached 0.019 below the 2 fast alone, random pairs 0.003 above. So each outer step has a second
round (`schedule`): the first round's pairs are joined two by two, crosswise (a-c and b-d after a-b and
c-d), and each side sends its pair's mean, so that all four end with the mean of the four, from pairwise
exchanges only (a butterfly). A bye joins a pair that has no other pair to join (its first member), so
with three trainers nobody steps solo. Groups never grow past four: the second round's partners carry at
most two trainers' values each (`protocols.avg.MAX_MEMBERS`).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable, Mapping

BYE = None
TIER_SHARE = 0.4  # of outer steps, where speeds differ, that pair trainers of like speed
UNKNOWN_TIER = -1000  # a trainer whose speed is not known yet


def speed_tier(samples_per_s: float | None) -> int:
    """A trainer's speed class: factor-2 buckets of its samples/s, so that equal machines share one tier
    despite jitter, and nodes that read slightly different records still agree."""
    if samples_per_s is None or not math.isfinite(samples_per_s) or samples_per_s <= 0:
        return UNKNOWN_TIER
    return max(-60, min(60, math.floor(math.log2(samples_per_s))))


def _rng(*parts: object) -> random.Random:
    """A generator every node seeds alike from the same parts (sha256, not Python's salted hash)."""
    return random.Random(hashlib.sha256("/".join(map(str, ("starling/pairing/v2", *parts))).encode()).digest())


def matching(members: Iterable[str], round_no: int, speeds: Mapping[str, float] | None = None) -> dict[str, str | None]:
    """Everyone's partner at outer step `round_no` (BYE: a solo step), for the given member list and the
    members' samples/s (`speeds`, as their records show; None or missing: unknown)."""
    return {name: first for name, (first, _) in schedule(members, round_no, speeds).items()}


def schedule(members: Iterable[str], round_no: int,
             speeds: Mapping[str, float] | None = None) -> dict[str, tuple[str | None, str | None]]:
    """Everyone's two partners at outer step `round_no`: (the first round's, the second round's), either
    None where there is none.

    The first round is the matching (a random one, or like speeds together in a share of the steps where
    speeds differ). The second round joins the first round's pairs two by two, crosswise: pairs (a, b)
    and (c, d), in the order the first round laid them out, meet as a-c and b-d. After the second round
    (each side sending its pair's mean, node/averaging/averager.py) all four hold the mean of the four: groups of
    four from pairwise exchanges only, as a butterfly all-reduce builds them. A bye meets the first member
    of the last pair that has no pair to join, so that with three trainers nobody steps solo. Why groups:
    in-process, averaging all four of 2 fast + 2 slow machines at every outer step reached a loss 0.019
    below the 2 fast machines alone, while random pairs stayed 0.003 above it (docs/benchmarks.md,
    "Heterogeneous machines, in-process"): the pairs' consensus error ate what the slow machines' samples
    brought."""
    names = sorted(set(members))
    bye: str | None = None
    if len(names) % 2:
        order = list(names)
        _rng("byes", *names).shuffle(order)
        bye = order[round_no % len(order)]
        names.remove(bye)
    tiers = {n: speed_tier((speeds or {}).get(n)) for n in names}
    rng = _rng("round", round_no, *names)
    if len(set(tiers.values())) > 1 and _rng("tiered", round_no, *names).random() < TIER_SHARE:
        # Like speeds: each tier shuffled, tiers laid out fastest first, neighbours pair.
        names = [n for t in sorted(set(tiers.values()), reverse=True)
                 for n in _shuffled([m for m in names if tiers[m] == t], rng)]
    else:
        rng.shuffle(names)
    pairs = list(zip(names[0::2], names[1::2], strict=True))
    first: dict[str, str | None] = {}
    second: dict[str, str | None] = {}
    if bye is not None:
        first[bye] = BYE
    for a, b in pairs:
        first[a], first[b] = b, a
    for i in range(0, len(pairs), 2):
        if i + 1 < len(pairs):
            (a, b), (c, d) = pairs[i], pairs[i + 1]
            second[a], second[c], second[b], second[d] = c, a, d, b
        elif bye is not None:
            second[bye], second[pairs[i][0]] = pairs[i][0], bye
    return {name: (first[name], second.get(name)) for name in first}


def _shuffled(names: list[str], rng: random.Random) -> list[str]:
    rng.shuffle(names)
    return names


def scheduled_partner(me: str, others: Iterable[str], round_no: int,
                      speeds: Mapping[str, float] | None = None) -> str | None:
    """This node's partner at outer step `round_no` among `others` (the trainers it could pair with); None
    when the schedule gives it a bye or it knows no one."""
    return matching([me, *others], round_no, speeds).get(me)


def scheduled_partners(me: str, others: Iterable[str], round_no: int,
                       speeds: Mapping[str, float] | None = None) -> tuple[str | None, str | None]:
    """This node's (first-round, second-round) partners at outer step `round_no` (`schedule`)."""
    return schedule([me, *others], round_no, speeds).get(me, (None, None))

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
(node/outer.py), so a fast machine that meets a slow one moves towards a model that carries fewer
samples, and with only random pairs the fast machines (which carry most of the swarm's samples) spend two
of every three steps apart from each other. In-process (2 trainers at H = 20, 2 at H = 8, random pairs, 3
seeds; docs/benchmarks.md, "Pairing rule") the fast members reached 2.2195 with random pairs, 2.2117 with
like-speed pairs in 40% of steps, against 2.2131 for the two fast machines alone; the slow ones stayed
within 0.5% of the fast ones, and fast-slow exchanges were 40% of all. Equal machines are one tier, and
their matchings are exactly the random ones.
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
    names = sorted(set(members))
    pairs: dict[str, str | None] = {}
    if len(names) % 2:
        order = list(names)
        _rng("byes", *names).shuffle(order)
        bye = order[round_no % len(order)]
        pairs[bye] = BYE
        names.remove(bye)
    tiers = {n: speed_tier((speeds or {}).get(n)) for n in names}
    rng = _rng("round", round_no, *names)
    if len(set(tiers.values())) > 1 and _rng("tiered", round_no, *names).random() < TIER_SHARE:
        # Like speeds: each tier shuffled, tiers laid out fastest first, neighbours pair.
        names = [n for t in sorted(set(tiers.values()), reverse=True)
                 for n in _shuffled([m for m in names if tiers[m] == t], rng)]
    else:
        rng.shuffle(names)
    for a, b in zip(names[0::2], names[1::2], strict=True):
        pairs[a], pairs[b] = b, a
    return pairs


def _shuffled(names: list[str], rng: random.Random) -> list[str]:
    rng.shuffle(names)
    return names


def scheduled_partner(me: str, others: Iterable[str], round_no: int,
                      speeds: Mapping[str, float] | None = None) -> str | None:
    """This node's partner at outer step `round_no` among `others` (the trainers it could pair with); None
    when the schedule gives it a bye or it knows no one."""
    return matching([me, *others], round_no, speeds).get(me)

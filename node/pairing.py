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
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable

BYE = None


def _rng(*parts: object) -> random.Random:
    """A generator every node seeds alike from the same parts (sha256, not Python's salted hash)."""
    return random.Random(hashlib.sha256("/".join(map(str, ("starling/pairing/v2", *parts))).encode()).digest())


def matching(members: Iterable[str], round_no: int) -> dict[str, str | None]:
    """Everyone's partner at outer step `round_no` (BYE: a solo step), for the given member list."""
    names = sorted(set(members))
    pairs: dict[str, str | None] = {}
    if len(names) % 2:
        order = list(names)
        _rng("byes", *names).shuffle(order)
        bye = order[round_no % len(order)]
        pairs[bye] = BYE
        names.remove(bye)
    _rng("round", round_no, *names).shuffle(names)
    for a, b in zip(names[0::2], names[1::2], strict=True):
        pairs[a], pairs[b] = b, a
    return pairs


def scheduled_partner(me: str, others: Iterable[str], round_no: int) -> str | None:
    """This node's partner at outer step `round_no` among `others` (the trainers it could pair with); None
    when the schedule gives it a bye or it knows no one."""
    return matching([me, *others], round_no).get(me)

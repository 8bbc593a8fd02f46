"""Who averages with whom at each outer step: a schedule every trainer computes alone, and the same.

Why a schedule: pairing by "whoever asks first" lets equal machines phase-lock. Trainers that publish at the
same moment every round ask in the same order every round, so the same pairs form again and again and, with
an odd number of trainers, the same one starves; NoLoCo's convergence argument needs a well-mixing gossip
graph, a fresh random partner at every outer step. The NoLoCo reference code gets that from a permutation
seeded by the step count, which every rank draws alike because ranks run in lock step. Starling has no lock
step and no rank list, but after an exchange both partners continue from the larger of their outer steps,
so trainers that average share their outer-step counter; and every trainer knows the same member list
(the swarm state). From those two, each trainer computes the same matching for each outer step.

The matching is a round-robin tournament (the "circle method") over the sorted trainers, in an order
shuffled afresh every epoch (one tournament) from a seed that every node derives from the epoch alone:

- within one epoch every trainer meets every other trainer exactly once, so partners spread as widely as
  they can, and the epoch's shuffle keeps the order of meetings random across epochs;
- with an odd number of trainers one slot is a *bye*: each trainer has exactly one bye per epoch (the solo
  step rotates), instead of the same trainer sitting out every round.

Where views differ (a member that some nodes do not know yet, outer steps that have not met) the schedules
disagree for some trainers; the averager then falls back to any ready partner, least recently paired first
(`node/averager.py`), and the next exchange realigns the counters.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable

BYE = None


def epoch_order(members: Iterable[str], epoch: int) -> list[str | None]:
    """The members in this epoch's shuffled order, with a BYE slot appended when their number is odd.

    The seed depends only on the epoch and the (sorted) member list, so every node that knows the same
    members draws the same order."""
    names = sorted(set(members))
    digest = hashlib.sha256(f"starling/pairing/v1/{epoch}/".encode() + "\n".join(names).encode()).digest()
    ordered: list[str | None] = list(names)
    random.Random(digest).shuffle(ordered)
    if len(ordered) % 2:
        ordered.append(BYE)
    return ordered


def matching(members: Iterable[str], round_no: int) -> dict[str, str | None]:
    """Everyone's partner at outer step `round_no` (BYE: a solo step), for the given member list.

    Round-robin by the circle method: slot 0 stays, the others rotate by one slot per round; slot j meets
    slot M-1-j. An epoch has M-1 rounds (M = members rounded up to even), after which a new shuffle starts.
    """
    members = sorted(set(members))
    if len(members) < 2:
        return {m: BYE for m in members}
    slots = len(members) + (len(members) % 2)
    rounds_per_epoch = slots - 1
    epoch, turn = divmod(round_no, rounds_per_epoch)
    order = epoch_order(members, epoch)
    rest = order[1:]
    turn %= len(rest)
    arrangement = [order[0], *rest[turn:], *rest[:turn]]
    pairs: dict[str, str | None] = {}
    for j in range(slots // 2):
        a, b = arrangement[j], arrangement[slots - 1 - j]
        if a is not None:
            pairs[a] = b
        if b is not None:
            pairs[b] = a
    return pairs


def scheduled_partner(me: str, others: Iterable[str], round_no: int) -> str | None:
    """This node's partner at outer step `round_no` among `others` (the trainers it could pair with); None
    when the schedule gives it a bye or it knows no one."""
    return matching([me, *others], round_no).get(me)

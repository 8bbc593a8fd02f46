"""After a round: which outer step a trainer continues from, and how far it moves its next publish.

The outer-step counter keys the pairing schedule (node/averaging/pairing.py) and `sync.max_step_gap`
refuses partners too far apart, so counters must not drift apart; the counter carries no weights (the lr
follows the inner step), so moving it is safe. Four rules, each a pure function of what the round saw:

- `group_outer_step`: partners continue from the larger of their two outer steps (within our own gap).
- `meet_the_waiting`: and after an averaged round, so that the next publish is the largest outer step a
  trainer of the run showed meanwhile (it is waiting there).
- `follow_the_swarm`: a node fallen more than half the gap behind the swarm jumps to the swarm's count.
- `phase_shift`: a node that found nobody ready moves its next publish towards the phase of the trainers
  that were between outer steps (node/averaging/averager.py's docstring says why).

And the pace itself, `swarm_pace`: the seconds between two outer steps that every trainer of the swarm
keeps, from the speeds the trainers claim; `outer_period_s`: the compute time of one of our outer steps.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping

log = logging.getLogger("starling.averager")

MAX_SPEEDUP = 64.0  # the fastest trainer the pace believes in, relative to this machine


def swarm_pace(own_speed: float, partner_speeds: list[float], samples_per_outer_step: int) -> float:
    """Seconds between two outer steps for every trainer of the swarm: `samples_per_outer_step` (H inner
    steps of one batch each, times a worker group's ranks) at the speed of the fastest trainer we know
    (samples/s, measured over whole outer steps), so the fastest takes about H inner steps and slower
    machines fewer in the same time (node/worker/trainer.py, `publish_due`). Batch sizes are assumed equal
    across the swarm (they are part of one run's settings).

    0 (every H inner steps of this machine) with no possible partner: a lone trainer has no phase to share
    and honours H (paced by its own smoothed speed it did 25-47 inner steps per outer step at H = 50, its
    evaluations and checkpoints taking time); 0 too before any speed is known."""
    if not partner_speeds:
        return 0.0
    fastest = max((v for v in (own_speed, *partner_speeds) if math.isfinite(v)), default=0.0)
    if own_speed > 0:
        # A record is a claim: no trainer is taken as more than MAX_SPEEDUP times faster than we are, so
        # no member can make everyone publish after every inner step.
        fastest = min(fastest, own_speed * MAX_SPEEDUP)
    if fastest <= 0:
        return 0.0
    return samples_per_outer_step / fastest


def outer_period_s(pace: float, own_speed: float, samples_per_outer_step: int) -> float:
    """Compute seconds of one of our outer steps, what `sync.compression = auto` weighs a transfer against
    (node/averaging/compression_choice.py): the swarm's pace where there is one, else
    `samples_per_outer_step` at this machine's measured speed; 0 before any speed is known."""
    if pace > 0:
        return pace
    if not own_speed > 0 or not math.isfinite(own_speed):
        return 0.0
    return samples_per_outer_step / own_speed


def group_outer_step(ours: int, theirs: int | None, max_gap: int) -> int:
    """The outer step both partners continue from: the larger one. A partner's step beyond our own gap
    (its `max_step_gap` may be larger than ours) is not adopted: we keep our own."""
    if theirs is None or abs(theirs - ours) > max_gap:
        return ours
    if theirs > ours:
        log.debug("adopting the partner's outer step %d (ours was %d)", theirs, ours)
    return max(ours, theirs)


def meet_the_waiting(continue_from: int, ours: int, seen: int | None, max_gap: int) -> int:
    """The outer step to continue from after an averaged round (`continue_from`, the pair's), moved up so
    that our next publish is the largest outer step that a trainer of our run showed us during the round
    (`seen`: its request or its busy answer; within our own gap of `ours`, else ignored).

    Why: on links where an exchange outlasts the compute of an outer step, pairs whose exchanges take
    different times (one partner's link 5x slower) advance their counts at different rates, a step or two
    apart within a minute; the schedule is keyed by the count, so the two groups then compute different
    matchings, and a trainer that waits for its scheduled partner finds it pairing by another schedule
    (traced in the network lab: fast trainers stepping solo in runs of three). A trainer that asked us while
    we were exchanging is most likely still waiting in that outer step, for us (its schedule gives it us),
    so we publish that very step next; counts then spread as a maximum does through gossip, and groups
    that hear of each other keep one count. (A solo round already follows the largest count it saw:
    `group_outer_step` in the averager.)"""
    if seen is None or abs(seen - ours) > max_gap or seen - 1 <= continue_from:
        return continue_from
    log.debug("continuing from outer step %d so as to publish %d, where a trainer waited (ours was %d)",
              seen - 1, seen, ours)
    return seen - 1


def follow_the_swarm(me: str, outer_step: int, group_step: int | None, swarm_steps: Mapping[str, int],
                     max_gap: int) -> int | None:
    """The outer step to continue from (`group_step`, the exchange's, None: our own `outer_step`), jumped
    up to the swarm's when we have fallen more than half the step gap behind it.

    Why: pairs adopt each other's larger count only when they meet. Groups whose outer steps take different
    times (a faster exchange, a node that started later from a fresh model) drift apart, and past the gap
    they never meet again: islands. The swarm's count is the second largest outer step among the other
    alive trainers' records (`swarm_steps`, ours left out), so that no single record (a liar) can move it."""
    others = sorted((step for peer, step in swarm_steps.items() if peer != me), reverse=True)
    if len(others) < 2:
        return group_step
    lead, ours = others[1], max(outer_step, group_step or 0)
    if lead > ours + max(1, max_gap // 2):
        log.info("outer step %d is far behind the swarm's %d: following it", ours, lead)
        return lead
    return group_step


def phase_shift(gaps: list[tuple[float, bool]], period: float) -> float:
    """How far to move our next publish towards the trainers that were between outer steps (`gaps`: how
    far each one's publish was from ours, theirs - ours, and whether its last outer step was averaged):
    the median over them of the distance to each one's phase, taken modulo the pace `period` (a trainer
    that published 1 s before the end of its period is 1 s ahead of our next publish, not a period behind
    ours), all of it towards one that averaged (it keeps its phase), half of it towards one that stepped
    solo (it moves towards us as well: two solo nodes moving all the way would only swap places). 0
    without a pace or without any answer."""
    if period <= 0 or not gaps:
        return 0.0
    moves = [(((g + period / 2) % period) - period / 2) * (1.0 if paired else 0.5) for g, paired in gaps]
    return statistics.median(moves)

"""How far one partner's values may move us: the bounds on a partner's phi and Delta at every exchange.

Every byte a partner sends is hostile until bounded. NoLoCo applies a partner's contribution twice:

    m <- alpha*m + beta*mean(Delta) - gamma*(phi - mean(phi))

so a partner moves us through its Delta (the beta term) *and* through its phi (the gamma pull). Both are
bounded here, against references that only this node writes:

- The reference is the norm of *our own* Delta per inner step: this outer step's, or the median of our
  last outer steps' if larger (early in training the current one can be small). Partners' figures never
  enter it. A reference that accepted partners' norms fed (max(own, median of recent norms) with the
  partners' in the median) let a partner staying just under the bound lift it 1,300x in 35 rounds.
- The reference is scaled by the inner steps the exchange covers (the larger of ours and the partner's):
  on a swarm of mixed speeds a faster partner's Delta covers more steps, and phis drift apart by about as
  much. A partner's claimed steps count up to the swarm's H at most (the pace gives the fastest trainer H
  inner steps per outer step, node/worker/trainer.py): claiming more buys nothing.
- The partner's Delta norm, and the distance of its phi from ours, are each *clipped*, to `clip_ratio`
  and `clip_phi_ratio` x the reference (as hivemind's CenteredClip clips each peer's deviation from the centre,
  here the centre is our own phi and zero Delta): an honest partner slightly outside still counts, in the
  right direction, and a dishonest one moves us at most a bounded step per round. Measured on the default
  task (docs/reliability.md): honest partners in step with us stay within ~1.05x (Delta) and ~1.4x (phi
  distance) of the reference, so their exchanges are not clipped and stay bit-exact. The phi distance
  gets the wider ratio (4 against 2) because honest phis random-walk apart between pairings: in a 5-node
  swarm at H = 5 a phi clip of 2 cut the pull of 25-50% of honest exchanges (the swarm mixed slower),
  one of 4 cuts 3-6%, and the strongest bounded attack still moves a victim 6x, not 10x, what honest
  training does.
- Honest partners can be far outside the reference too, and must not be punished for it: a node that
  trained alone for a while (it started first, or a partition) has a phi many references away, and one
  still in its learning-rate warm-up has a tiny reference next to a trained partner's Delta. Those are
  clipped, never refused: the pull between them is bounded per round, which also keeps a trained node
  from being dragged half-way to a fresh one. Only values that are no model of ours at all are refused
  and count as an offence (repeated offences ban the partner, node/averaging/admission.py): non-finite ones, or a
  Delta or phi distance longer than `reject_ratio` x the norm of our own phi (two models of one
  architecture are at most about the sum of their norms apart; +1000 on every weight is not training).

Streaming fragments (`sync.fragments` > 1): an exchange carries one fragment, and every bound applies to it
as if it were the model: our own Delta's norm on the fragment is the reference (its history kept per
fragment, since fragments of different layers have norms of different sizes, and a median over all of
them would bound a small fragment by a large one's scale), the phi distance and norms are the fragment's,
and refusing takes our phi's norm on the fragment as the size of a model. Per coordinate nothing changes:
a partner moves each fragment at most as far as the whole-model bound moves the model.

What the bounds buy: a partner that always sends the most it may along one direction moves our momentum by
at most beta/2 * clip + gamma/2 * clip references per round, i.e. about (beta + gamma) * clip references of
phi per round with the momentum's 1 / (1 - alpha) gain. docs/reliability.md measures it against honest
training.
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass

from protocols.avg import Clip, Received, Rejected

HISTORY = 32  # our own recent outer steps that the reference looks back over
MAX_STEP_RATIO = 64  # with no H given, a partner's steps are credited up to this many times ours


@dataclass(frozen=True)
class Credited:
    """What we believe of a partner's claims: inner steps and samples, capped at what an honest one can have."""

    inner_steps: int
    samples: int


class UpdateBound:
    """Clips or refuses a partner's contribution; remembers only this node's own Delta norms."""

    def __init__(self, clip_ratio: float, reject_ratio: float, max_inner_steps: int | None = None,
                 clip_phi_ratio: float | None = None) -> None:
        """`clip_ratio` (Delta) and `clip_phi_ratio` (phi distance; default: `clip_ratio`): of the reference;
        `reject_ratio`: of our own phi's norm. `max_inner_steps`: the swarm's H (None: unknown, then a
        partner's steps count up to MAX_STEP_RATIO times ours)."""
        clip_phi_ratio = clip_ratio if clip_phi_ratio is None else clip_phi_ratio
        if clip_ratio < 1.0 or clip_phi_ratio < 1.0 or reject_ratio <= 0.0:
            raise ValueError("clip ratios must be at least 1 and reject_ratio positive")
        self.clip_ratio = clip_ratio
        self.clip_phi_ratio = clip_phi_ratio
        self.reject_ratio = reject_ratio
        self.max_inner_steps = max_inner_steps
        # Our own Delta norm per inner step over recent exchanges, by streaming fragment (0: the whole model).
        self._own_per_step: dict[int, collections.deque[float]] = {}

    def credit(self, own_steps: int, own_samples: int, their_steps: int, their_samples: int) -> Credited:
        """A partner's steps count up to the swarm's H (or ours, if we did more); its samples up to what our
        per-step batch gives for those steps. Honest partners of the same run are never capped below what
        they did: the pace gives the fastest trainer H steps, and the batch size is part of the manifest."""
        cap = self.max_inner_steps if self.max_inner_steps else max(1, own_steps) * MAX_STEP_RATIO
        steps = min(max(0, their_steps), max(cap, own_steps))
        samples = max(0, their_samples)
        if own_steps > 0 and own_samples > 0:
            samples = min(samples, math.ceil(own_samples * max(steps, 1) / own_steps))
        return Credited(steps, samples)

    def reference(self, own_norm: float, own_steps: int, their_steps: int, fragment: int = 0) -> float:
        """The norm one exchange may legitimately carry: our Delta per inner step (now, or our recent
        median if larger, on the same `fragment`) times the inner steps the exchange covers."""
        per_step = own_norm / own_steps if own_steps > 0 else own_norm
        history = list(self._own_per_step.get(fragment, ()))
        if history:
            per_step = max(per_step, statistics.median(history))
        steps = max(own_steps, their_steps, 1) if own_steps > 0 else 1
        return per_step * steps

    def remember(self, own_norm: float, own_steps: int, fragment: int = 0) -> None:
        """Record our own Delta (every exchange that reached the end of the transfer, whoever the partner),
        on `fragment` (a streaming fragment's index; 0: the whole model)."""
        if math.isfinite(own_norm) and own_norm > 0:
            history = self._own_per_step.setdefault(fragment, collections.deque(maxlen=HISTORY))
            history.append(own_norm / own_steps if own_steps > 0 else own_norm)

    def judge(self, seen: Received, own_steps: int, their_steps: int, fragment: int = 0) -> Clip:
        """The clip to apply to the partner's values, or Rejected. `their_steps` must be credited already;
        `fragment`: the streaming fragment the values are (0: the whole model)."""
        own_norm, their_norm = seen.delta_norms
        phi_distance = seen.phi_distance
        self.remember(own_norm, own_steps, fragment)
        if not math.isfinite(phi_distance):
            raise Rejected("non_finite", "partner's phi is too far from ours to measure (overflow)")
        # The whole Delta against our whole phi's norm, the phi distance against the norm of the same
        # fragment it was measured on (under a lossy preset phi crosses the wire a fragment at a time).
        model = self.reject_ratio * seen.own_model_norm
        _refuse_garbage(their_norm, model, self.reject_ratio, "delta_norm", "Delta norm")
        phi_limit = self.reject_ratio * seen.own_phi_norm
        _refuse_garbage(phi_distance, phi_limit, self.reject_ratio, "phi_distance", "phi distance from ours",
                        wild=phi_distance > model)
        reference = self.reference(own_norm, own_steps, their_steps, fragment)
        return Clip(_scale(their_norm, self.clip_ratio * reference),
                    _scale(phi_distance, self.clip_phi_ratio * reference))


def _refuse_garbage(value: float, limit: float, ratio: float, reason: str, what: str, *, wild: bool = True) -> None:
    if value > limit:
        raise Rejected(reason, f"{what} {value:.3g} is over {ratio:g}x the norm of our own phi: not a model of ours",
                       wild=wild)


def _scale(value: float, bound: float) -> float:
    """1.0 within the bound, else the factor that brings `value` down to it (0.0 for a zero bound: with no
    Delta of our own there is no scale to trust a partner's by)."""
    if value <= bound:
        return 1.0
    return bound / value

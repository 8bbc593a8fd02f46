"""Outer optimizers on flat fp32 slow weights: NoLoCo and DiLoCo, in plain torch, with no network in sight.

Each replica keeps slow weights `phi`, outer momentum `m` and fast weights `theta` (trained by the inner
Adam steps). After H inner steps the outer gradient is `Delta = theta - phi`, and (shared/design/noloco.md):

    NoLoCo:  m <- alpha*m + beta*mean_G(Delta) - gamma*(phi - mean_G(phi));   phi <- phi + m
    DiLoCo:  m <- alpha*m + beta*mean_all(Delta);                              phi <- phi + m

Sign: `+ beta` (the paper's printed Eq. 2 has a minus, which with Delta = theta - phi walks away from
where the inner steps went; the appendix and the reference code use plus). DiLoCo here is the heavy-ball
form of the NoLoCo paper's baseline (`m = alpha*m - beta*g` with `g = mean(phi - theta) = -mean(Delta)`).

A group of one (no partner came in time) is the *solo step*: the means are the replica's own values, the
gamma term vanishes and both rules reduce to heavy-ball on the replica's own Delta. If the group is every
replica and all start from the same phi, NoLoCo's gamma term is zero and it equals DiLoCo.

The worker keeps these tensors in fp32 on the CPU (master copies, as the design notes recommend) whatever
device the model trains on. The steps take the group's *sums* of Delta and phi (what the daemon leaves in
shared memory) and fold the 1/n into their scalars. Steps work in place; the NoLoCo pull allocates one
temporary so that it is exactly zero when a pair's phis are equal (identical replicas stay identical, bit
for bit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from node.bridge.exchange import pair_weights
from node.config.train import OUTER_KINDS


@dataclass(frozen=True)
class OuterHyper:
    """Outer-step hyper-parameters; gamma is ignored by DiLoCo."""

    alpha: float = 0.5
    beta: float = 0.7
    gamma: float = 0.7


def noloco_step(
    phi: torch.Tensor,
    momentum: torch.Tensor,
    sum_delta: torch.Tensor,
    sum_phi: torch.Tensor,
    hyper: OuterHyper,
    n: int = 1,
    weighted: PairWeights | None = None,
    phi_range: tuple[int, int] | None = None,
    overwrite_sum_phi: bool = False,
) -> None:
    """One NoLoCo outer step, in place on `phi` and `momentum`, given the sums of Delta and phi over a
    group of `n` (with n = 1, the means themselves).

    `overwrite_sum_phi`: the pull's difference ``sum_phi - n*phi`` is computed in `sum_phi` itself instead of
    a new model-sized tensor (the same operation, so the same bits). The worker passes its phi_out slot, free
    once the exchange is over: a fresh 4 B/param temporary at every outer step cost its page faults, about
    half of this step's time on one thread.

    Why sums: the daemon leaves the group's sums, not its means, in shared memory (one pass less over
    every received byte); the 1/n goes into the step's own scalars at no cost. For a pair this is bit for
    bit the step on the means: halving is exact, so ``(beta/2)*sum == beta*(sum/2)`` and
    ``sum - 2*phi == 2*(sum/2 - phi)``.

    With `weighted` (a pair whose members trained different numbers of samples) both means are the pair's
    sample-weighted ones instead (see `PairWeights`).

    `phi_range` = (lo, hi): the group exchanged phi on those coordinates only (a fragment,
    protocols/compress.py): the pull applies there, and `sum_phi` outside it is not read."""
    _add_mean_delta(momentum.mul_(hyper.alpha), sum_delta, hyper.beta, n, weighted)
    if phi_range is not None:
        lo, hi = phi_range
        phi_part, sum_phi, momentum_part = phi[lo:hi], sum_phi[lo:hi], momentum[lo:hi]
    else:
        phi_part, momentum_part = phi, momentum
    if hyper.gamma:
        # - gamma * (phi - mean(phi)); exactly zero when a pair's phis are equal. The weighted mean's
        # pull is gamma * w_partner / W * (S - 2*phi) (phi - mean_w = w_p * (2*phi - S) / W).
        out = sum_phi if overwrite_sum_phi else None
        coefficients = weighted.coefficients if weighted is not None and n == 2 else None
        if coefficients is None:
            momentum_part.add_(torch.sub(sum_phi, phi_part, alpha=n, out=out), alpha=hyper.gamma / n)
        else:
            momentum_part.add_(torch.sub(sum_phi, phi_part, alpha=2, out=out), alpha=hyper.gamma * coefficients[0])
    phi.add_(momentum)


def diloco_step(
    phi: torch.Tensor,
    momentum: torch.Tensor,
    sum_delta: torch.Tensor,
    hyper: OuterHyper,
    n: int = 1,
    weighted: PairWeights | None = None,
) -> None:
    """One DiLoCo (heavy-ball) outer step, in place, given the sum of Delta over `n` replicas (n = 1: the
    mean), or a pair's sample-weighted mean with `weighted`."""
    _add_mean_delta(momentum.mul_(hyper.alpha), sum_delta, hyper.beta, n, weighted)
    phi.add_(momentum)


@dataclass(frozen=True)
class PairWeights:
    """What a pair's members trained since their last outer step (samples), and this replica's own Delta.

    Why weight: on machines of different speeds the outer steps are paced by time (node/worker/trainer.py), so a
    slower machine's Delta covers fewer inner steps. The pair's Delta is then the *sample-weighted* mean,
    as hivemind's collaborative optimizer weights by samples: each machine counts in proportion to the
    compute it put in, and a slow partner neither dilutes a fast one's progress as a plain mean would nor
    is ignored.

    The NoLoCo pull goes to the pair's sample-weighted mean of phi too: both members move towards the
    same point, the faster one by gamma * w_slow / W of their distance and the slower one by
    gamma * w_fast / W. The two pulls still sum to gamma, so the pair's difference shrinks exactly as
    under the plain mean (the spread's stability condition, shared/design/noloco.md, is unchanged). But
    the point they meet at is the better-trained model: with the plain mean, every meeting with a slower
    machine dragged a fast machine half-way back towards a model trained on a fraction of its samples,
    and a swarm of 2 fast + 2 slow machines trained its fast members to a worse loss than 2 fast
    machines alone (docs/benchmarks.md, "Swarm").

    The exchange leaves the plain sum S = D_own + D_partner (both sides compute the same bits); the weighted
    mean follows from it and our own Delta without a second exchange:
    (w_own*D_own + w_p*D_p) / W = (w_p*S + (w_own - w_p)*D_own) / W, with W = w_own + w_p. Equal weights
    give exactly the plain step (the second term is skipped)."""

    own_samples: int
    partner_samples: int
    own_delta: torch.Tensor

    @property
    def coefficients(self) -> tuple[float, float] | None:
        """(a, b) of the weighted mean ``a * S + b * own`` (node/bridge/exchange.py, `pair_weights`, the one
        rule); None: the plain mean (equal or unknown counts)."""
        return pair_weights(self.own_samples, self.partner_samples)


def _add_mean_delta(
    momentum: torch.Tensor, sum_delta: torch.Tensor, beta: float, n: int, weighted: PairWeights | None
) -> None:
    """momentum += beta * (the group's mean Delta, or a pair's sample-weighted mean)."""
    coefficients = weighted.coefficients if weighted is not None and n == 2 else None
    if coefficients is None:
        momentum.add_(sum_delta, alpha=beta / n)
        return
    a, b = coefficients
    momentum.add_(sum_delta, alpha=beta * a)
    momentum.add_(weighted.own_delta, alpha=beta * b)


class OuterOptimizer:
    """The outer momentum of one replica plus the rule that uses it.

    `step` takes the replica's own Delta and the group means the daemon produced; `group_size <= 1` means
    no partner (a solo step), in which case the means are ignored.
    """

    def __init__(self, kind: str, hyper: OuterHyper, numel: int) -> None:
        if kind not in OUTER_KINDS:
            raise ValueError(f"unknown outer optimizer {kind!r} (known: {', '.join(OUTER_KINDS)})")
        self.kind = kind
        self.hyper = hyper
        self.momentum = torch.zeros(numel, dtype=torch.float32)

    def step(
        self,
        phi: torch.Tensor,
        own_delta: torch.Tensor,
        *,
        group_size: int,
        sum_phi: torch.Tensor | None = None,
        sum_delta: torch.Tensor | None = None,
        samples: tuple[int, int] | None = None,
        phi_range: tuple[int, int] | None = None,
        overwrite_sum_phi: bool = False,
        span: tuple[int, int] | None = None,
    ) -> None:
        """Update `phi` in place. Solo when `group_size <= 1`; otherwise both of the group's sums (over its
        `group_size` members, this replica included) are required. `samples` = (ours, the partner's) makes a
        pair's Delta term and phi pull sample-weighted (`PairWeights`); None or equal counts give the plain mean.
        `phi_range`: the fragment whose phi was exchanged (`noloco_step`); None: all of it.
        `overwrite_sum_phi`: `sum_phi` may be used as the pull's scratch (`noloco_step`).

        `span` = (lo, hi): a streaming fragment's step (node/worker/trainer.py, `Trainer.publish_fragment`):
        `phi`, `own_delta` and the sums are that slice of the flat vector (`phi_range` relative to it), and
        the state is the momentum's slice [lo, hi). Why the momentum is simply sliced: every rule here is
        per coordinate, so the steps of a partition's fragments, taken with one group's sums, are the
        whole-vector step bit for bit, and a fragment's step never touches another's coordinates."""
        momentum = self.momentum
        if span is not None:
            lo, hi = span
            if not 0 <= lo < hi <= self.momentum.numel():
                raise ValueError(f"span [{lo}, {hi}) is not a fragment of {self.momentum.numel()} elements")
            momentum = self.momentum[lo:hi]
        if phi.shape != momentum.shape or own_delta.shape != momentum.shape:
            raise ValueError("phi and Delta must be flat tensors of the optimizer's size (or of the span's)")
        if group_size <= 1:
            # Solo: mean(Delta) is our own and the gamma term is zero, so both rules are heavy-ball.
            diloco_step(phi, momentum, own_delta, self.hyper)
            return
        if sum_phi is None or sum_delta is None:
            raise ValueError("a group step needs both sum_phi and sum_delta")
        weighted = None if samples is None or group_size != 2 else PairWeights(samples[0], samples[1], own_delta)
        if self.kind == "noloco":
            noloco_step(phi, momentum, sum_delta, sum_phi, self.hyper, group_size, weighted, phi_range,
                        overwrite_sum_phi=overwrite_sum_phi)
        else:
            diloco_step(phi, momentum, sum_delta, self.hyper, group_size, weighted)

    def state_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "momentum": self.momentum}

    def load_state_dict(self, state: dict[str, object]) -> None:
        momentum = state["momentum"]
        if not isinstance(momentum, torch.Tensor) or momentum.shape != self.momentum.shape:
            raise ValueError("outer momentum in the checkpoint does not match the model size")
        # A switch between noloco and diloco keeps the momentum: both rules use it the same way.
        self.momentum.copy_(momentum)

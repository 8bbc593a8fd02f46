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
device the model trains on. Steps work in place; the NoLoCo pull allocates one temporary so that it is
exactly zero when phi equals the group mean (a group of identical replicas stays identical, bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from node.train_config import OUTER_KINDS


@dataclass(frozen=True)
class OuterHyper:
    """Outer-step hyper-parameters; gamma is ignored by DiLoCo."""

    alpha: float = 0.5
    beta: float = 0.7
    gamma: float = 0.7


def noloco_step(
    phi: torch.Tensor,
    momentum: torch.Tensor,
    mean_delta: torch.Tensor,
    mean_phi: torch.Tensor,
    hyper: OuterHyper,
) -> None:
    """One NoLoCo outer step, in place on `phi` and `momentum`, given the group means."""
    momentum.mul_(hyper.alpha).add_(mean_delta, alpha=hyper.beta)
    if hyper.gamma:
        momentum.add_(mean_phi - phi, alpha=hyper.gamma)  # - gamma * (phi - mean_phi)
    phi.add_(momentum)


def diloco_step(phi: torch.Tensor, momentum: torch.Tensor, mean_delta: torch.Tensor, hyper: OuterHyper) -> None:
    """One DiLoCo (heavy-ball) outer step, in place, given the all-reduced mean Delta."""
    momentum.mul_(hyper.alpha).add_(mean_delta, alpha=hyper.beta)
    phi.add_(momentum)


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
        mean_phi: torch.Tensor | None = None,
        mean_delta: torch.Tensor | None = None,
    ) -> None:
        """Update `phi` in place. Solo when `group_size <= 1`; otherwise both means are required."""
        if phi.shape != self.momentum.shape or own_delta.shape != self.momentum.shape:
            raise ValueError("phi and Delta must be flat tensors of the optimizer's size")
        if group_size <= 1:
            # Solo: mean(Delta) is our own and the gamma term is zero, so both rules are heavy-ball.
            diloco_step(phi, self.momentum, own_delta, self.hyper)
            return
        if mean_phi is None or mean_delta is None:
            raise ValueError("a group step needs both mean_phi and mean_delta")
        if self.kind == "noloco":
            noloco_step(phi, self.momentum, mean_delta, mean_phi, self.hyper)
        else:
            diloco_step(phi, self.momentum, mean_delta, self.hyper)

    def state_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "momentum": self.momentum}

    def load_state_dict(self, state: dict[str, object]) -> None:
        momentum = state["momentum"]
        if not isinstance(momentum, torch.Tensor) or momentum.shape != self.momentum.shape:
            raise ValueError("outer momentum in the checkpoint does not match the model size")
        # A switch between noloco and diloco keeps the momentum: both rules use it the same way.
        self.momentum.copy_(momentum)

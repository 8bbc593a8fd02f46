"""The arithmetic of a group of four's second round: sample-weighted means from a pair's plain sums.

A first round leaves the pair's plain sums in the worker's output slots (protocols/avg.py), bit-identical
on both partners, and the worker weights the pair by samples itself (node/worker/outer.py, `PairWeights`).
A second round (node/averaging/pairing.py, `schedule`) needs those weighted means earlier: each side sends
its pair's means, and both end with n times the group's sample-weighted means, already weighted, in the
outputs. Everything here works from `pair_sum = own + other` in place, block by block, so no model-sized
temporary (nor a copy of the partner's values) is ever made, whatever the model's size.
"""

from __future__ import annotations

import numpy as np

from node.bridge.exchange import pair_weights
from protocols.avg import Tensors

BLOCK = 1 << 20  # elements per step of `weighted_mean`: its temporaries stay a few MB, whatever the model


def weighted_mean(out: np.ndarray, own: np.ndarray, pair_sum: np.ndarray, w_own: int, w_partner: int,
                  *, scale: float = 1.0) -> None:
    """out = scale * (w_own * own + w_partner * other) / (w_own + w_partner), given pair_sum = own + other,
    as `scale * (a * pair_sum + b * own)`: no copy of `other` is needed. `out` may be `own` or `pair_sum`
    (in place). The weights are `pair_weights`' (node/bridge/exchange.py): equal or unknown ones give the
    plain mean.

    Block by block through two block-sized buffers, so that a model of billions of parameters costs no
    model-sized temporary (numpy has no fused in-place `add(x, alpha=...)`)."""
    share, own_share = pair_weights(w_own, w_partner) or (0.5, 0.0)
    a, b = np.float32(scale * share), np.float32(scale * own_share)
    block = min(BLOCK, out.size)
    scaled, term = np.empty(block, np.float32), np.empty(block, np.float32)
    for start in range(0, out.size, block):
        stop = min(start + block, out.size)
        s = scaled[: stop - start]
        np.multiply(pair_sum[start:stop], a, out=s)
        if b:
            t = term[: stop - start]
            np.multiply(own[start:stop], b, out=t)
            s += t
        out[start:stop] = s


class GroupMean:
    """The second round's arithmetic over one worker's slots, and a model-sized buffer for the pair's mean
    phi kept between outer steps (the worker's phi slot is its live phi: it cannot hold a mean)."""

    def __init__(self) -> None:
        self._phi_mean: np.ndarray | None = None

    def _buffer(self, like: np.ndarray) -> np.ndarray:
        if self._phi_mean is None or self._phi_mean.shape != like.shape:
            self._phi_mean = np.empty_like(like)
        return self._phi_mean

    def pair_means(self, arrays: Tensors, w_own: int, w_partner: int) -> Tensors:
        """What a pair sends in the second round: its weighted means, phi's into our buffer, Delta's into the
        worker's Delta slot, which it only wrote for us (its outer step recomputes its own Delta from its
        weights, node/worker/trainer.py `apply_result`); the outputs (the pair's sums) stay as they are."""
        phi_mean = self._buffer(arrays.phi)
        weighted_mean(phi_mean, arrays.phi, arrays.phi_out, w_own, w_partner)
        weighted_mean(arrays.delta, arrays.delta, arrays.delta_out, w_own, w_partner)
        return Tensors(phi_mean, arrays.delta, arrays.phi_out, arrays.delta_out)


def restore_pair(arrays: Tensors, means: Tensors) -> None:
    """A second round that failed may have written into the outputs: put back the pair's result (twice its
    means: the worker divides by the group size, 2)."""
    np.multiply(means.phi, 2, out=arrays.phi_out)
    np.multiply(means.delta, 2, out=arrays.delta_out)


def group_sums(arrays: Tensors, means: Tensors, w_ours: int, w_theirs: int, group: int) -> None:
    """After a second round the outputs hold the plain sum of the two sides' means: leave `group` times the
    group's weighted mean there (each side weighted by `w_ours` / `w_theirs`), for the worker's 1/n."""
    weighted_mean(arrays.phi_out, means.phi, arrays.phi_out, w_ours, w_theirs, scale=group)
    weighted_mean(arrays.delta_out, means.delta, arrays.delta_out, w_ours, w_theirs, scale=group)

"""The contract of one outer step's exchange between the supervisor and the daemon's averager.

The supervisor (node/bridge/supervisor.py) hands an `ExchangeRequest` to the daemon's exchange function (an
`ExchangeFn`: `Averager.exchange` in the daemon, `solo_exchange` for a node without averaging) and gets
one `ExchangeOutcome` back: the request is the input, the outcome (with the sums in the request's output
slots) the only result. No torch here: the slots are numpy float32 arrays over the shared memory
(node/bridge/shm.py), and the daemon process loads no torch at all.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

#: Parameter names and shapes, in the order of the flat vectors (the worker's `param_layout`, node/worker/task.py).
#: Here, not in the worker's task module, because the daemon reads it too and never imports the worker.
Layout = list[tuple[str, tuple[int, ...]]]


def pair_weights(own_samples: int, partner_samples: int) -> tuple[float, float] | None:
    """The one rule of sample weighting: a pair's sample-weighted mean from its plain sum S = own + other,
    as ``mean_w = a * S + b * own`` with ``a = w_partner / W`` and ``b = (w_own - w_partner) / W`` (W = w_own +
    w_partner); None where the plain mean applies (equal counts, or one unknown: 0 or less).

    Why weight: on machines of different speeds the outer steps are paced by time, so a slower machine's
    Delta covers fewer samples; each machine then counts in proportion to the compute it put in (hivemind
    weights by samples too). Why from the sum: both partners hold the same bits of S after the exchange,
    and the weighted mean follows from it and one's own values without a second transfer. Used by the
    worker's outer step (node/worker/outer.py, `PairWeights`) and by a group of four's second round in the
    daemon (node/averaging/group_mean.py); what count a partner is credited with is
    node/averaging/robust.py's `credit`."""
    if own_samples <= 0 or partner_samples <= 0 or own_samples == partner_samples:
        return None
    total = own_samples + partner_samples
    return partner_samples / total, (own_samples - partner_samples) / total


@dataclass
class ExchangeRequest:
    """One outer step's exchange, handed to the daemon's averager.

    The arrays are views of shared memory: `phi` is the worker's live phi and must only be read; the
    daemon writes the group's sums into `phi_out` and `delta_out` before returning an outcome of group
    size n (`ExchangeOutcome`; sums, not means: the worker's outer step folds the 1/n into its scalars,
    the daemon saves a pass).
    `delta` is written by the worker for the daemon only: a group's second round overwrites it with the
    pair's mean Delta (the worker recomputes its own Delta from its weights). They stay valid until the
    exchange function returns (or is cancelled).
    """

    outer_step: int
    phi: np.ndarray  # flat fp32 slow weights
    delta: np.ndarray  # flat fp32 outer gradient, Delta = theta - phi
    phi_out: np.ndarray  # flat fp32: sum of phi over the group, filled by the daemon
    delta_out: np.ndarray  # flat fp32: sum of Delta over the group, filled by the daemon
    layout: Layout  # parameter names and shapes (for the run manifest)
    # The worker's task layout hash (node/worker/task.py, `layout_hash`, sent in its hello): partners compare it
    # before they exchange, so every side must compute it with that one function.
    layout_hash: str
    inner_steps: int = 0  # inner steps that Delta covers
    samples: int = 0  # sequences they trained on (the weight of this Delta in a pair's mean)
    # A streaming fragment's exchange (`sync.fragments` > 1): fragment `fragment` of `fragments`. The four
    # arrays are then that fragment's slices of the slots (other fragments' exchanges and results change
    # the rest meanwhile), and `outer_step` is the fragment's own count; every check, bound and preset
    # choice of the exchange applies to the fragment as if it were the model.
    fragment: int = 0
    fragments: int = 1


@dataclass(frozen=True)
class ExchangeOutcome:
    """How one outer step's exchange ended: what the supervisor tells the worker with its result.

    `group_size` is the number n of trainers whose values were combined: 1 (or 0) for a solo step (the
    outputs are ignored, whatever is in them), 2 for a pair, up to 4 after a group's second round. With n >= 2
    the request's `phi_out` and `delta_out` hold the group's sums of phi and Delta (the worker's outer
    step divides by n): after one round the pair's plain sums (the same bits on both partners), after a
    second round n times the group's sample-weighted means, already weighted.

    `group_outer_step` is the largest outer step of the group, which the worker adopts (paired nodes'
    counters never drift apart); after a solo step the largest outer step that ready trainers showed
    meanwhile (within our step gap), or the swarm's when this node fell far behind it. None: keep ours.

    `partner_samples` is the partner's (credited) samples, for a pair's sample-weighted step
    (node/worker/outer.py); 0 where the sums are plain or already weighted (a group's second round), or unknown.

    `shift_s` moves the worker's next publish by this many seconds, towards the partners' phase.

    `compression` is the `sync.compression` preset the wire used, and `phi_range` the [lo, hi) of phi it
    carried (a fragment; None: all of it): the worker's error feedback and pull need both
    (node/worker/trainer.py, `Trainer.apply_result`); `phi_out` outside the range holds nothing of this exchange.

    `exact_outer_step`, after a solo step only: continue from exactly this outer step, below ours too (a
    catch-up that moves the count alone, node/averaging/latejoin.py `CatchUp.follow_instead`). None: as above.

    `own_exact`: the exchange was lossy only because the link was not known yet (`sync.compression = auto`'s
    probe or its way back to `none`, node/averaging/compression_choice.py `keeps_own_exact`): the worker
    applies its own Delta in full rather than the wire's copy plus error feedback.
    """

    group_size: int
    group_outer_step: int | None = None
    partner_samples: int = 0
    shift_s: float = 0.0
    compression: str = "none"
    phi_range: tuple[int, int] | None = None
    exact_outer_step: int | None = None
    own_exact: bool = False

    @classmethod
    def solo(cls, group_outer_step: int | None = None, shift_s: float = 0.0) -> ExchangeOutcome:
        """A solo step (outputs ignored), optionally with an outer step to follow and a phase shift."""
        return cls(1, group_outer_step, 0, shift_s)


# The daemon's exchange: one outcome per request; it may raise or be cancelled (the supervisor then steps
# solo).
ExchangeFn = Callable[[ExchangeRequest], Awaitable[ExchangeOutcome]]


async def solo_exchange(request: ExchangeRequest) -> ExchangeOutcome:
    """The exchange of a node without averaging: always a solo step."""
    return ExchangeOutcome.solo()

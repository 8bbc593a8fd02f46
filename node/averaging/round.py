"""The averaging round: one published outer step's search for a partner and its exchange (issue #53).

A `Round` is created when the worker publishes (node/averaging/averager.py, `Averager.exchange`), one per
round of the outer step (a group of four's second round is a second `Round`). Its `state` is explicit
(`RoundState`): the averager's asking side (`_pair`, `_try_partner`) and answering side (`_serve_request`)
both claim it through `Round.claim`, so a crossing request and an accepted answer cannot both own its outputs,
and the window's end closes it through `Round.close`. The status's `sync.state` reads the state's value.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import trio

from node.bridge.exchange import ExchangeRequest
from protocols.avg import Contribution, Progress, Tensors

__all__ = ["Round", "RoundState"]


class RoundState(enum.Enum):
    """Where one round of a published outer step stands; the status's `sync.state` is its value. A round
    starts `PAIRING` (it asks and may be asked), becomes `EXCHANGING` once an exchange owns its outputs (one
    partner: `Round.claim`) or `SOLO` when its window closed without one (`Round.close`: late requests
    are refused); neither goes back."""

    PAIRING = "pairing"
    EXCHANGING = "exchanging"
    SOLO = "solo"


@dataclass
class Round:
    """One round of this node's published outer step: what it offers, where it stands (`state`, moved only
    by `claim` and `close`), what its partner stated, and how its pairing window runs."""

    request: ExchangeRequest  # its `layout_hash` is what partners compare
    tensors: Tensors
    stage: int = 1  # the round of the outer step (node/averaging/pairing.py, `schedule`)
    members: int = 1  # trainers whose (mean) values `tensors` carries: 2 in a second round after a pair
    samples: int | None = None  # the samples those values stand for (None: the request's own)
    inner_steps: int | None = None  # the most inner steps among them (None: the request's own)
    window_s: float | None = None  # how long this round looks for a partner (None: sync.pair_window_s)
    open_phase: bool = True  # whether anyone may be asked once the scheduled partner is out of reach
    state: RoundState = RoundState.PAIRING  # moved only by `claim` and `close`
    partner: str | None = None  # the peer id whose exchange owns the outputs (`EXCHANGING`)
    progress: Progress | None = None  # the claiming exchange's bytes, while its transfer runs (status)
    initiating_to: str | None = None
    result: int = 1
    done: trio.Event = field(default_factory=trio.Event)
    transfer_finished: trio.Event = field(default_factory=trio.Event)
    transfer_scope: trio.CancelScope | None = None
    # The partner's contribution as its request or its answer stated it (its wait capped to our window).
    theirs: Contribution | None = None
    began: float = 0.0  # when the worker published (trio clock)
    waited_s: float = 0.0  # from the publish to the pairing
    scheduled: str | None = None  # this outer step's partner by the schedule (None: a bye, or no schedule)
    next_partner: str | None = None  # the schedule's partner for the outer step's next round (groups of four)
    scheduled_until: float = 0.0  # end of the scheduled phase
    scheduled_busy: bool = False  # the scheduled partner answered "exchanging": its phase was stretched
    busy_until: float | None = None  # the end of that wait (an open phase follows it: `_round_ends`)
    probed: bool = False  # the larger PeerID asked its scheduled partner once, its request not having come
    saw_ready: bool = False  # some partner was ready (busy with someone else counts) during the window
    # Between-steps answers: how far (s) each asked trainer's publish was from ours (theirs - ours), and
    # whether its last outer step was averaged.
    phase_gaps: list[tuple[float, bool]] = field(default_factory=list)
    largest_seen: int = 0  # the largest outer step a ready partner showed us in this window
    # The exchange's `sync.compression` preset and phi fragment: the initiator's choice (protocols/compress.py,
    # node/averaging/compression_choice.py), set when the round is paired.
    compression: str = "none"
    fragment: int = 0

    @property
    def own_steps(self) -> int:
        return self.request.inner_steps if self.inner_steps is None else self.inner_steps

    def in_scheduled_phase(self, now: float) -> bool:
        return self.scheduled is not None and now < self.scheduled_until

    @property
    def open(self) -> bool:
        """Still looking for a partner: no exchange owns the outputs and the window has not closed."""
        return self.state is RoundState.PAIRING

    def claim(self, partner: str, now: float) -> None:
        """An exchange with `partner` owns this round's outputs from now on."""
        assert self.open, f"round already {self.state.value}"
        self.state, self.partner = RoundState.EXCHANGING, partner
        self.waited_s = now - self.began

    def close(self) -> None:
        """The window ended without a partner: a solo step, and the door shut to late requests."""
        assert self.open, f"round already {self.state.value}"
        self.state = RoundState.SOLO
        self.result = 1
        self.done.set()

"""What the averager asks of the rest of the node (`SwarmView`) and what it tells it (`AveragerHooks`).

Why an interface here and not a class of node.swarm: the averager may not import node.swarm (the rooms are
siblings, `make lint` checks it), and it needs only these answers, which the daemon computes from the swarm
state, the NAT service and the supervisor (node/daemon.py, `AveragerSwarm`). Tests and benchmarks hand in
`starling_testing.averaging.FakeSwarm` instead, so the averager has no "no view given" branch of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class SwarmView(Protocol):
    """The swarm as one averager sees it; every answer is read at the moment it is needed."""

    def manifest_hash(self) -> str | None:
        """The run manifest that partners' requests must carry (None: not known yet)."""

    def eligible_partners(self) -> list[str]:
        """Trainers we could average with now (alive, of our run, a usable path, the outer step within
        the gap): the schedule pairs us among them, the same on every node."""

    def anyone_else(self) -> bool:
        """Whether any other trainer of our run could pair at all, whatever its outer step: when none can,
        an outer step is solo at once (averager.py's docstring says why the step gap does not count)."""

    def path_of(self, peer: str) -> str:
        """How we reach `peer`: direct | hole-punched | relayed | none (node/swarm/nat.py)."""

    def reachable(self) -> bool:
        """Whether partners can connect to our side channel (behind a NAT they cannot: offering its port
        would cost them a connect timeout on every round before they fall back to the libp2p stream)."""

    def rtt_s(self, peer: str) -> float | None:
        """Seconds of round trip to `peer` as the connection's muxer measured it (None: not yet): what a
        transfer's time holds besides its bytes (link_model.py)."""

    def pace(self) -> float:
        """The swarm's pace: seconds between two publishes (0: none)."""

    def outer_period(self) -> float:
        """Compute seconds of one of our outer steps (0: unknown), against which `sync.compression = auto`
        weighs a transfer's predicted time."""

    def swarm_steps(self) -> dict[str, int]:
        """Outer steps of the swarm's alive trainers (their records), to keep our counter in their range."""

    def speeds(self) -> dict[str, float]:
        """Samples/s of the trainers (ours included) as their records show: the schedule pairs like speeds
        in some outer steps (node/averaging/pairing.py)."""


def _ignore(*_: object) -> None:
    return None


@dataclass(frozen=True)
class AveragerHooks:
    """What the averager tells the rest of the node, as it happens (each a no-op unless given)."""

    # A transfer with a partner completed: (peer, bytes both ways, seconds), for the NAT service's link figures.
    on_transfer: Callable[[str, int, float], None] = _ignore
    # Every outer step's end: whether it was averaged (the catch-up counts the steps without a partner).
    # Not whether a partner looked eligible at its start: a partner one step beyond `sync.max_step_gap` is
    # eligible by its record (which may lag a heartbeat) and yet refuses every request, and two such
    # trainers stepped solo side by side for minutes, never catching up.
    on_outer_step: Callable[[bool], None] = _ignore
    # A partner refused us as too far behind it, at its outer step: the catch-up starts now, not after
    # `sync.catch_up_after` more outer steps (a restarted worker resumes from a checkpoint up to
    # `train.checkpoint_every` outer steps back, while its partner went on).
    on_behind: Callable[[int], None] = _ignore
    # Whether our weights are the swarm's (latejoin.py `CatchUp.weights_fresh`, which also knows of worker
    # restarts and adopted snapshots); None: the averager judges by its own outer steps alone.
    weights_fresh: Callable[[], bool] | None = None


NO_HOOKS = AveragerHooks()

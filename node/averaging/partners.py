"""Partner policy: which trainers this node could average with, and the swarm's pace, from the member records.

Why a room of its own: the policy is the averager's (who counts as a partner decides when an outer step pairs,
waits or goes solo, and the swarm's pace when it publishes), but it reads the swarm's records, the NAT
service's paths and the worker's status, which averaging/ may not import (the rooms are siblings, `make lint`
checks it). So it takes what it reads as small callables and the records through a `Protocol`, and the daemon
wires it from its components (node/daemon.py). It was the daemon's private methods, reached by the averager's
view through `self._daemon._...` (issue #53).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from node.averaging.stepping import outer_period_s, swarm_pace
from node.config.sync import SyncConfig
from node.config.train import TrainConfig
from node.status_schema import DIRECT_PATHS


class PartnerRecord(Protocol):
    """What the policy reads of a member's signed record (node/swarm/crdt.py, `MemberRecord`)."""

    @property
    def peer_id(self) -> str: ...

    @property
    def role(self) -> str: ...

    @property
    def manifest_hash(self) -> str | None: ...

    @property
    def outer_step(self) -> int: ...

    @property
    def samples_per_s(self) -> float: ...


class PartnerMember(Protocol):
    """A member as the swarm's state lists it (node/swarm/replicator.py, `MemberView`)."""

    @property
    def record(self) -> PartnerRecord: ...


@dataclass
class Partners:
    """The partner policy of one node, every answer read at the moment it is asked.

    `candidates`: alive or suspect members not known to be incompatible (`StateReplicator.partner_candidates`
    says why suspect ones count); `alive`: the alive ones only; `path_of`: how we reach a peer (direct |
    hole-punched | relayed | none); `sits_out`: whether the averager keeps a peer out of rounds (banned, or it
    missed round after round); `training`: the worker's training status (outer_step, samples_per_s; empty
    before a worker spoke)."""

    me: str
    sync: SyncConfig
    train: TrainConfig
    candidates: Callable[[], Iterable[PartnerMember]]
    alive: Callable[[], Iterable[PartnerMember]]
    path_of: Callable[[str], str]
    sits_out: Callable[[str], bool]
    training: Callable[[], Mapping[str, Any]]

    def possible(self) -> list[PartnerMember]:
        """Alive or suspect trainers with our manifest (`candidates` checks it) and (unless the config allows
        bulk over relays) a direct or hole-punched path: bulk tensors never cross a relay. None at all makes
        the outer step solo at once. A trainer the averager says sits out does not count: a record that
        claims the trainer role from a peer that never averages made every outer step wait out the whole
        pairing window."""
        allow_relay = self.sync.allow_relay_bulk
        return [
            m
            for m in self.candidates()
            if m.record.role == "trainer"
            and m.record.manifest_hash  # a trainer whose task is not loaded yet can only refuse
            and m.record.peer_id != self.me
            and (allow_relay or self.path_of(m.record.peer_id) in DIRECT_PATHS)
            and not self.sits_out(m.record.peer_id)
        ]

    def eligible(self) -> list[str]:
        """Possible partners whose outer step is within the allowed gap (plus one: a record is a heartbeat
        old): the pairing schedule pairs us among them, the same on every node."""
        ours = self.own_outer_step()
        gap = self.sync.max_step_gap
        return [m.record.peer_id for m in self.possible() if abs(m.record.outer_step - ours) <= gap + 1]

    def own_outer_step(self) -> int:
        return int(self.training().get("outer_step") or 0)

    def own_samples_per_s(self) -> float:
        return float(self.training().get("samples_per_s") or 0.0)

    def _samples_per_outer_step(self) -> int:
        """A worker group's inner step covers `local_ranks` batches, and its samples/s counts them all."""
        return self.train.inner_steps * self.train.batch_size * self.train.local_ranks

    def pace(self) -> float:
        """Seconds between two outer steps for every trainer of the swarm (`stepping.swarm_pace`, from the
        speeds of the possible partners' records and ours); 0 (every H inner steps of this machine) with
        `sync.pace = steps`."""
        if self.sync.pace != "swarm":
            return 0.0
        return swarm_pace(self.own_samples_per_s(), [m.record.samples_per_s for m in self.possible()],
                          self._samples_per_outer_step())

    def outer_period_s(self) -> float:
        """Compute seconds of one of our outer steps, for `sync.compression = auto` (`stepping.outer_period_s`)."""
        return outer_period_s(self.pace(), self.own_samples_per_s(), self._samples_per_outer_step())

    def speeds(self) -> dict[str, float]:
        """Samples/s of the trainers we could pair with, and ours (for the pairing schedule's speed tiers)."""
        speeds = {m.record.peer_id: m.record.samples_per_s for m in self.possible()}
        speeds[self.me] = self.own_samples_per_s()
        return speeds

    def swarm_steps(self) -> dict[str, int]:
        """Outer step of every alive trainer of our run (for the catch-up's swarm median)."""
        return {m.record.peer_id: m.record.outer_step for m in self.alive() if m.record.role == "trainer"}

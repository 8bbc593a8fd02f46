"""The partner policy (node/averaging/partners.py), through its public surface: who counts as a partner, who is
eligible this outer step, and the swarm's pace, from member records as the swarm lists them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from node.averaging.partners import Partners
from node.config.sync import SyncConfig
from node.config.train import TrainConfig


@dataclass(frozen=True)
class _Record:
    peer_id: str
    role: str = "trainer"
    manifest_hash: str | None = "m1"
    outer_step: int = 10
    samples_per_s: float = 100.0


@dataclass(frozen=True)
class _Member:
    record: _Record


@dataclass
class _Swarm:
    """What the daemon wires into `Partners`: the replica's members, the NAT paths, the averager's outs."""

    candidates: list[_Member] = field(default_factory=list)
    alive: list[_Member] = field(default_factory=list)
    paths: dict[str, str] = field(default_factory=dict)
    out: set[str] = field(default_factory=set)
    training: dict[str, Any] = field(default_factory=lambda: {"outer_step": 10, "samples_per_s": 50.0})

    def partners(self, sync: SyncConfig | None = None, train: TrainConfig | None = None) -> Partners:
        return Partners("me", sync or SyncConfig(), train or TrainConfig(), candidates=lambda: self.candidates,
                        alive=lambda: self.alive, path_of=lambda p: self.paths.get(p, "direct"),
                        sits_out=lambda p: p in self.out, training=lambda: self.training)


def test_a_possible_partner_is_another_trainer_with_a_manifest_a_direct_path_and_not_sitting_out() -> None:
    swarm = _Swarm(candidates=[_Member(_Record("ok")), _Member(_Record("punched")), _Member(_Record("me")),
                               _Member(_Record("relayed")), _Member(_Record("net", role="network")),
                               _Member(_Record("loading", manifest_hash=None)), _Member(_Record("banned"))],
                   paths={"relayed": "relayed", "punched": "hole-punched"}, out={"banned"})
    assert [m.record.peer_id for m in swarm.partners().possible()] == ["ok", "punched"]
    # With bulk over relays allowed, the relayed trainer counts too.
    relay = swarm.partners(replace(SyncConfig(), allow_relay_bulk=True))
    assert [m.record.peer_id for m in relay.possible()] == ["ok", "punched", "relayed"]
    swarm.out.clear()  # the averager lets it back in: it counts again, read at the moment of asking
    assert "banned" in [m.record.peer_id for m in swarm.partners().possible()]


def test_eligible_partners_are_within_the_outer_step_gap_plus_one_heartbeat() -> None:
    gap = SyncConfig().max_step_gap
    swarm = _Swarm(candidates=[_Member(_Record("near", outer_step=10 + gap + 1)),
                               _Member(_Record("far", outer_step=10 + gap + 2)),
                               _Member(_Record("behind", outer_step=10 - gap - 1))])
    assert swarm.partners().eligible() == ["near", "behind"]
    swarm.training = {}  # no worker status yet: our outer step counts as 0, and `behind` is gap + 1 from it
    assert swarm.partners().eligible() == ["behind"]


def test_the_pace_follows_the_fastest_possible_partner_and_is_off_with_steps_or_alone() -> None:
    train = TrainConfig()
    samples = train.inner_steps * train.batch_size * train.local_ranks
    swarm = _Swarm(candidates=[_Member(_Record("fast", samples_per_s=100.0)), _Member(_Record("slow", samples_per_s=20.0))])
    partners = swarm.partners()
    assert partners.pace() == samples / 100.0
    assert partners.outer_period_s() == samples / 100.0
    assert partners.speeds() == {"fast": 100.0, "slow": 20.0, "me": 50.0}
    assert swarm.partners(replace(SyncConfig(), pace="steps")).pace() == 0.0
    assert _Swarm().partners().pace() == 0.0  # no partner: H inner steps of this machine


def test_the_swarm_steps_are_the_alive_trainers_outer_steps() -> None:
    swarm = _Swarm(alive=[_Member(_Record("a", outer_step=7)), _Member(_Record("b", role="network", outer_step=3))])
    assert swarm.partners().swarm_steps() == {"a": 7}

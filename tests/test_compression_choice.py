"""`sync.compression = auto` (node/averaging/compression_choice.py): which preset an initiator picks from the partner's
measured rate and the outer step's compute period.

The figures: a model of 1M parameters, so one side sends 4 MB under `none` (bf16), 0.44 MB under `medium`
and 0.08 MB under `high`; rates are bytes/s each way, as node/averaging/averager.py `_learn_rate` keeps them.
"""

from __future__ import annotations

import pytest

from node.averaging.compression_choice import RELAX_SHARE, STRETCH, choose_compression, transfer_s
from node.averaging.stepping import outer_period_s
from node.config.sync import SyncConfig
from protocols.compress import PRESETS

NUMEL = 1_000_000
MB = 1e6


def test_the_predicted_transfer_is_one_sides_bytes_over_the_rate_each_way() -> None:
    """Both sides send at once over the link, and the rate each way is half the rate of both directions
    together: a bf16 exchange's time is its 4 B/param on one side over that rate."""
    assert transfer_s("none", NUMEL, 2 * MB) == pytest.approx(4 * NUMEL / (2 * MB))
    assert transfer_s("none", NUMEL, 1 * MB, wire_dtype="fp32") == pytest.approx(8.0)
    assert transfer_s("medium", NUMEL, 1 * MB) == pytest.approx(PRESETS["medium"].bytes_per_param(NUMEL) * NUMEL / MB)


def test_without_a_measured_rate_or_a_known_period_it_is_none() -> None:
    """A bf16 transfer is what measures a link best; with no period there is nothing to compare against."""
    assert choose_compression(rate_bps=None, period_s=5.0 / STRETCH, numel=NUMEL) == "none"
    assert choose_compression(rate_bps=0.0, period_s=5.0 / STRETCH, numel=NUMEL) == "none"
    assert choose_compression(rate_bps=0.01 * MB, period_s=0.0 / STRETCH, numel=NUMEL) == "none"


def test_a_link_that_moves_bf16_within_the_period_keeps_none() -> None:
    assert choose_compression(rate_bps=10 * MB, period_s=5.0 / STRETCH, numel=NUMEL) == "none"  # 0.4 s of 5


def test_a_slow_link_gets_medium_and_a_very_slow_one_high() -> None:
    # 1 MB/s: bf16 takes 4 s, medium 0.44 s, against a period of 2 s.
    assert choose_compression(rate_bps=1 * MB, period_s=2.0 / STRETCH, numel=NUMEL) == "medium"
    # 50 kB/s: bf16 80 s, medium 8.8 s, high 1.6 s.
    assert choose_compression(rate_bps=0.05 * MB, period_s=2.0 / STRETCH, numel=NUMEL) == "high"
    # Slower still, nothing fits: the most compressed preset is the least bad.
    assert choose_compression(rate_bps=0.001 * MB, period_s=2.0 / STRETCH, numel=NUMEL) == "high"


def test_a_less_compressed_preset_comes_back_only_below_half_the_period() -> None:
    """Hysteresis: at 1 MB/s bf16 takes 4 s. With a period of 5 s (0.8 of it) a node on `none` stays there,
    while one that went to `medium` stays there too; only at 0.4 of the period does it return."""
    assert RELAX_SHARE == 0.5
    assert choose_compression(rate_bps=1 * MB, period_s=5.0 / STRETCH, numel=NUMEL, previous="none") == "none"
    assert choose_compression(rate_bps=1 * MB, period_s=5.0 / STRETCH, numel=NUMEL, previous="medium") == "medium"
    assert choose_compression(rate_bps=1 * MB, period_s=10.0 / STRETCH, numel=NUMEL, previous="medium") == "none"
    # From high, medium must fit in half the period too: its 0.44 s at 1 MB/s fits half of 1 s, not of 0.8 s.
    assert choose_compression(rate_bps=1 * MB, period_s=0.8 / STRETCH, numel=NUMEL, previous="high") == "high"
    assert choose_compression(rate_bps=1 * MB, period_s=1.0 / STRETCH, numel=NUMEL, previous="high") == "medium"
    # Towards more compression there is no margin: a preset that stops fitting is left at once.
    assert choose_compression(rate_bps=1 * MB, period_s=3.9 / STRETCH, numel=NUMEL, previous="none") == "medium"


def test_groups_of_four_always_use_none() -> None:
    """A lossy preset needs pairs (node/config/sync.py): a group's second round re-encodes the pair's mean."""
    assert choose_compression(rate_bps=0.001 * MB, period_s=2.0 / STRETCH, numel=NUMEL, group_size=4) == "none"
    assert choose_compression(rate_bps=0.001 * MB, period_s=2.0 / STRETCH, numel=NUMEL, group_size=4, previous="high") == "none"


def test_auto_is_the_default_and_is_valid_with_any_group_size() -> None:
    assert SyncConfig().compression == "auto"
    SyncConfig().validate()
    SyncConfig(compression="auto", group_size=4).validate()
    with pytest.raises(ValueError, match="group_size = 2"):
        SyncConfig(compression="medium", group_size=4).validate()
    with pytest.raises(ValueError, match="auto"):
        SyncConfig(compression="automatic").validate()


def test_the_daemon_gives_auto_the_pace_or_else_h_inner_steps_at_its_own_speed() -> None:
    """The period `auto` weighs a transfer against: the swarm's pace where there is one; with `sync.pace =
    steps` (no pace) H inner steps at this machine's measured samples/s; 0 (unknown) before any speed."""
    def period(pace: float, samples_per_s: float) -> float:
        return outer_period_s(pace, samples_per_s, 50 * 8)

    assert period(4.6, 80.0) == 4.6
    assert period(0.0, 80.0) == pytest.approx(50 * 8 / 80.0)
    assert period(0.0, 0.0) == 0.0
    assert period(0.0, float("nan")) == 0.0


def test_the_measured_slow_link_gets_medium_the_preset_that_won_there() -> None:
    """bench/wan.py at 0.4 Mbit/s (docs/benchmarks.md): the 0.47M-parameter model, 4.6 s of compute per
    outer step, about 40 kB/s each way left to the exchange. `medium` (exchanges of 1.2-1.5 periods)
    reached the lowest loss there, ahead of `high` and of bf16; the rule picks it."""
    assert choose_compression(rate_bps=40e3, period_s=4.6, numel=470_000) == "medium"

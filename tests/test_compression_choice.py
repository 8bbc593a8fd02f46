"""`sync.compression = auto` (node/averaging/compression_choice.py): which preset an initiator picks from the partner's
measured rate and the outer step's compute period.

The figures: a model of 1M parameters, so one side sends 4 MB under `none` (bf16), 0.44 MB under `medium`
and 0.08 MB under `high`; rates are bytes/s each way, as node/averaging/averager.py `_learn_rate` keeps them.
"""

from __future__ import annotations

import itertools

import pytest

from node.averaging.compression_choice import (
    AUTO,
    ORDER,
    PROBE,
    RELAX_SHARE,
    STRETCH,
    accepts,
    after_refusal,
    choose_compression,
    keeps_own_exact,
    preset_for,
    refusal_reason,
    transfer_s,
    wanted_in,
)
from node.averaging.stepping import outer_period_s
from node.config.sync import SyncConfig
from protocols.avg import AnswerCode
from protocols.compress import PRESETS

NUMEL = 1_000_000
MB = 1e6


def test_the_predicted_transfer_is_one_sides_bytes_over_the_rate_each_way() -> None:
    """Both sides send at once over the link, and the rate each way is half the rate of both directions
    together: a bf16 exchange's time is its 4 B/param on one side over that rate."""
    assert transfer_s("none", NUMEL, 2 * MB) == pytest.approx(4 * NUMEL / (2 * MB))
    assert transfer_s("none", NUMEL, 1 * MB, wire_dtype="fp32") == pytest.approx(8.0)
    assert transfer_s("medium", NUMEL, 1 * MB) == pytest.approx(PRESETS["medium"].bytes_per_param(NUMEL) * NUMEL / MB)


def test_without_any_measured_rate_the_first_exchange_is_the_cheapest_probe() -> None:
    """Nothing measured anywhere: the most compressed preset, so that the transfer that teaches the rate does
    not flood a link that may be slow (bench/wan.py one-slow: the 0.08 Mbit/s trainer's first, bf16, exchange
    could not finish in the run)."""
    assert PROBE == ORDER[-1] == "high"
    assert choose_compression(rate_bps=None, period_s=5.0 / STRETCH, numel=NUMEL) == PROBE
    assert choose_compression(rate_bps=0.0, period_s=5.0 / STRETCH, numel=NUMEL) == PROBE


def test_without_a_known_period_it_is_none_as_before() -> None:
    """With no period there is nothing to weigh a transfer against, so nothing a probe would teach."""
    assert choose_compression(rate_bps=0.01 * MB, period_s=0.0 / STRETCH, numel=NUMEL) == "none"
    assert choose_compression(rate_bps=None, period_s=0.0, numel=NUMEL) == "none"


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


# --- the slower side's view wins: an `auto` responder's say (issue 23, bench/wan.py one-slow) -------------------

# bench/wan.py's one-slow scenario: the 0.47M-parameter model, 4.6 s of compute per outer step; the slow trainer's
# link is 0.08 Mbit/s (10 kB/s), its fast partners' 0.4 Mbit/s (about 40 kB/s each way left to an exchange).
WAN_NUMEL, WAN_PERIOD = 470_000, 4.6


def wants(*, link: float | None = None, typical: float | None = None, previous: str | None = None,
          stage: int = 1, group_size: int = 2, period: float = WAN_PERIOD) -> str:
    """What an `auto` node wants for one partner: the same rule as an initiator's (`preset_for`)."""
    return preset_for(AUTO, stage=stage, link_rate_bps=link, typical_rate_bps=typical, period_s=period,
                      numel=WAN_NUMEL, previous=previous, group_size=group_size, wire_dtype="bf16")


def test_a_responder_behind_a_slow_link_refuses_bf16_from_a_partner_that_only_knows_fast_links() -> None:
    """The fast partner has never measured the slow one and guesses from its own fast links (`medium` at
    40 kB/s, or `none` before it measured anything); the slow trainer's typical rate (10 kB/s) calls for
    `high`, and it refuses anything less compressed, taking `high`."""
    assert wants(typical=40e3) == "medium" and wants(typical=1e9) == "none"  # the fast initiator's views
    slow = wants(typical=10e3)
    assert slow == "high"
    assert not accepts(AUTO, 2, "none", slow) and not accepts(AUTO, 2, "medium", slow)
    assert accepts(AUTO, 2, "high", slow)


def test_an_auto_responder_takes_its_own_choice_or_anything_more_compressed() -> None:
    assert [accepts(AUTO, 2, name, "medium") for name in ORDER] == [False, True, True]
    assert [accepts(AUTO, 2, name, "none") for name in ORDER] == [True, True, True]


def test_a_responder_that_has_measured_no_rate_wants_the_probe_as_it_would_ask_for_itself() -> None:
    """No rate measured with anyone: its first exchange is the probe whichever side asks, so a fast partner's
    bf16 request is refused (the slow trainer's first exchange used to be that bf16, and could not finish)."""
    assert wants() == PROBE
    assert [accepts(AUTO, 2, name, wants()) for name in ORDER] == [False, False, True]


def test_a_responder_with_no_known_period_takes_any_preset_as_before() -> None:
    for typical in (10e3, None):
        assert wants(typical=typical, period=0.0) == "none"
        assert all(accepts(AUTO, 2, name, wants(typical=typical, period=0.0)) for name in ORDER)


def test_groups_of_four_and_fixed_presets_are_unchanged_by_the_responders_say() -> None:
    """A group's second round and `auto` with groups of four want `none` and take `none` only; a fixed
    preset takes itself only, whatever it would want."""
    assert wants(typical=10e3, stage=2) == "none" and wants(typical=10e3, group_size=4) == "none"
    assert [accepts(AUTO, 4, name, "none") for name in ORDER] == [True, False, False]
    assert [accepts("medium", 2, name, "medium") for name in ORDER] == [False, True, False]
    assert [accepts("none", 2, name, "none") for name in ORDER] == [True, False, False]


def test_the_refusal_names_the_preset_wanted_in_bounded_words_a_1_2_peer_reads_as_a_compression_refusal() -> None:
    reason = refusal_reason(AUTO, 2, "none", "medium")
    assert reason.startswith("compression mismatch: wants medium") and len(reason) <= 300
    assert AnswerCode.of("refuse", "", reason) is AnswerCode.COMPRESSION  # a 1.2.0 stream: no code, words only
    assert wanted_in(reason) == "medium"
    assert wanted_in(refusal_reason(AUTO, 4, "medium", "none")) == "none"
    assert len(refusal_reason(AUTO, 2, "x" * 16, "high")) <= 300
    # A fixed preset's words are as they were: they name no wanted preset.
    fixed = refusal_reason("none", 2, "medium", "none")
    assert fixed == "compression mismatch: yours 'medium', ours 'none': set the same sync.compression on every trainer"
    assert wanted_in(fixed) is None


@pytest.mark.parametrize("words", [
    "compression mismatch: wants highest", "compression mismatch: wants huge", "compression mismatch: wants ",
    "Compression mismatch: wants high", "compression mismatch:  wants high", "no, compression mismatch: wants high",
    "compression mismatch: yours 'none', ours 'high'; wants high", "compression mismatch: wants " + "h" * 400, "",
])
def test_only_a_known_preset_name_in_its_one_place_is_read_from_a_refusal(words: str) -> None:
    """The words are a partner's free text: anything but a known preset right after the fixed prefix names
    nothing (the initiator then steps one preset on, `after_refusal`)."""
    assert wanted_in(words) is None


def test_after_a_refusal_the_initiator_only_moves_towards_more_compression() -> None:
    assert after_refusal("none", "high") == "high"  # straight to the named preset
    assert after_refusal("none", "medium") == "medium"
    assert after_refusal("none", None) == "medium"  # nothing readable: one step on
    assert after_refusal("medium", None) == "high"
    assert after_refusal("high", None) is None  # nothing more compressed: no retry
    assert after_refusal("medium", "none") is None  # a named preset less compressed: no retry
    assert after_refusal("medium", "medium") is None
    assert after_refusal("auto", "high") is None and after_refusal("huge", None) is None


@pytest.mark.parametrize("start", ORDER)
def test_whatever_a_partner_names_an_exchange_asks_at_most_once_per_preset(start: str) -> None:
    """Every retry is strictly more compressed than the last request, so however a hostile responder words
    its refusals (any name, or none), one exchange asks at most `len(ORDER)` times and never loops."""
    for names in itertools.product([None, *ORDER], repeat=len(ORDER)):
        asked, retries = start, 0
        for wanted in names:
            nxt = after_refusal(asked, wanted)
            if nxt is None:
                break
            assert ORDER.index(nxt) > ORDER.index(asked)
            asked, retries = nxt, retries + 1
        assert retries <= len(ORDER) - 1 - ORDER.index(start)


def test_a_partner_not_measured_yet_keeps_the_preset_it_asked_for_until_its_own_rate_is_known() -> None:
    """`previous` is a floor while the partner's rate is unknown: our typical rate comes from other links
    (the fast partner's guess of 40 kB/s would relax `high` to `medium`), and the partner said what its link
    needs. Once its own rate is measured the usual hysteresis decides, both ways."""
    assert wants(typical=40e3, previous="high") == "high"
    assert wants(previous="high") == "high"  # nothing measured at all
    assert wants(typical=40e3, previous="none") == "medium"  # a floor, never a ceiling
    assert wants(link=1e9, typical=40e3, previous="high") == "medium"  # its own link, measured fast: one step
    assert wants(link=1e9, typical=40e3, previous="medium") == "none"
    assert wants(link=10e3, previous="medium") == "high"


def test_a_less_compressed_preset_comes_back_one_step_at_a_time() -> None:
    """bench/wan.py one-slow on the default lab queue: the 37 kB probe passed within the 64 KiB token bucket's
    burst, taught a rate far above the 0.4 Mbit/s link's, and fast pairs went straight from `high` to bf16.
    From `high` the next is at most `medium`, whose bigger transfer measures the link before `none`."""
    fast = dict(rate_bps=1e3 * MB, period_s=5.0, numel=NUMEL)
    assert choose_compression(**fast, previous="high") == "medium"
    assert choose_compression(**fast, previous="medium") == "none"
    assert choose_compression(**fast, previous="none") == "none"
    assert choose_compression(rate_bps=0.001 * MB, period_s=5.0, numel=NUMEL, previous="none") == "high"  # more: at once


def test_only_the_ramp_of_a_fast_link_applies_our_own_delta_in_full() -> None:
    """`keeps_own_exact`: a lossy exchange after which the link, as measured now, would already relax the
    preset (the probe on a fast link, the `medium` step back to `none`) applies our own Delta in full; a
    lossy preset that the link keeps (a slow link's steady `medium`), `none`, a fixed preset, or a link
    with no rate or no period keep error feedback, as before."""
    fast = dict(rate_bps=10 * MB, period_s=5.0 / STRETCH, numel=NUMEL)  # bf16 0.4 s of 5
    assert keeps_own_exact(AUTO, "high", **fast) and keeps_own_exact(AUTO, "medium", **fast)
    assert not keeps_own_exact(AUTO, "none", **fast)
    assert not keeps_own_exact("medium", "medium", **fast)  # the operator's steady lossy wire
    slow = dict(rate_bps=1 * MB, period_s=2.0 / STRETCH, numel=NUMEL)  # medium fits, bf16 does not
    assert not keeps_own_exact(AUTO, "medium", **slow)
    assert keeps_own_exact(AUTO, "high", **slow)  # a probe that measured a link medium fits: relaxes at once
    # Hysteresis as `choose_compression`'s: bf16 at 0.8 of the period fits, but not half of it: medium stays.
    assert not keeps_own_exact(AUTO, "medium", rate_bps=1 * MB, period_s=5.0 / STRETCH, numel=NUMEL)
    assert not keeps_own_exact(AUTO, "high", rate_bps=None, period_s=5.0, numel=NUMEL)
    assert not keeps_own_exact(AUTO, "high", rate_bps=10 * MB, period_s=0.0, numel=NUMEL)

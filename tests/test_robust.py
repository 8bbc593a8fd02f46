"""The bounds on a partner's values (node/averaging/robust.py) and the clip that the transfer applies (protocols/avg.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.averaging.robust import UpdateBound
from protocols.avg import Clip, Received, Rejected, Tensors, apply_clip


def seen(own: float, theirs: float, phi_distance: float = 0.0, own_phi: float = 100.0) -> Received:
    return Received(their_delta_sq=theirs**2, own_delta_sq=own**2, phi_distance_sq=phi_distance**2,
                    own_phi_sq=own_phi**2)


def test_values_within_the_clip_ratio_are_kept_whole() -> None:
    bound = UpdateBound(clip_ratio=2, reject_ratio=10, max_inner_steps=10)
    assert bound.judge(seen(own=1.0, theirs=2.0, phi_distance=2.0), 10, 10) == Clip(1.0, 1.0)


def test_values_beyond_the_clip_ratio_are_scaled_down_to_it() -> None:
    bound = UpdateBound(clip_ratio=2, reject_ratio=10, max_inner_steps=10)
    clip = bound.judge(seen(own=1.0, theirs=5.0, phi_distance=8.0), 10, 10)
    assert clip.delta_scale == pytest.approx(2 / 5) and clip.phi_scale == pytest.approx(2 / 8)


def test_the_phi_distance_has_its_own_wider_clip_ratio() -> None:
    # Honest phis drift a few Deltas apart between pairings (in a 5-node swarm at H = 5 a clip of 2 cut
    # the pull of 25-50% of honest exchanges), while a Delta covers one outer step: two ratios.
    bound = UpdateBound(clip_ratio=2, reject_ratio=10, max_inner_steps=10, clip_phi_ratio=4)
    assert bound.judge(seen(own=1.0, theirs=2.0, phi_distance=4.0), 10, 10) == Clip(1.0, 1.0)
    clip = bound.judge(seen(own=1.0, theirs=3.0, phi_distance=8.0), 10, 10)
    assert clip.delta_scale == pytest.approx(2 / 3) and clip.phi_scale == pytest.approx(4 / 8)


@pytest.mark.parametrize(("theirs", "distance", "reason"), [(401.0, 0.0, "delta_norm"), (1.0, 401.0, "phi_distance"),
                                                           (1.0, float("inf"), "non_finite")])
def test_values_longer_than_reject_ratio_times_our_phi_are_no_model_and_refused(theirs, distance, reason) -> None:
    bound = UpdateBound(clip_ratio=2, reject_ratio=4, max_inner_steps=10)
    with pytest.raises(Rejected) as refused:
        bound.judge(seen(own=1.0, theirs=theirs, phi_distance=distance, own_phi=100.0), 10, 10)
    assert refused.value.reason == reason


def test_under_a_phi_fragment_the_whole_delta_is_judged_against_the_whole_model_not_the_fragment() -> None:
    """Under `high` phi crosses the wire a 32nd at a time while the Delta is the whole model's: a Delta
    within 4x our whole phi was refused as "not a model of ours" against the fragment's norm (two fresh
    founders never averaged once `auto` began with `high`). The phi distance is still judged on the
    fragment it was measured on."""
    bound = UpdateBound(clip_ratio=2, reject_ratio=4, max_inner_steps=10)
    fragment = Received(their_delta_sq=300.0**2, own_delta_sq=1.0, phi_distance_sq=3.0**2,
                        own_phi_sq=1.0, model_phi_sq=100.0**2)  # our whole phi: norm 100; its fragment's: 1
    bound.judge(fragment, 10, 10)  # 300 < 4 x 100: a model (clipped, not refused)
    with pytest.raises(Rejected) as refused:
        bound.judge(Received(their_delta_sq=401.0**2, own_delta_sq=1.0, own_phi_sq=1.0, model_phi_sq=100.0**2),
                    10, 10)
    assert refused.value.reason == "delta_norm"
    with pytest.raises(Rejected) as refused:  # 5 > 4 x 1, the fragment's own norm
        bound.judge(Received(their_delta_sq=1.0, own_delta_sq=1.0, phi_distance_sq=5.0**2,
                             own_phi_sq=1.0, model_phi_sq=100.0**2), 10, 10)
    assert refused.value.reason == "phi_distance"
    assert not refused.value.wild  # 5 is within 4 x 100, the whole model: what a trained partner can show a fresh one
    with pytest.raises(Rejected) as refused:
        bound.judge(Received(their_delta_sq=1.0, own_delta_sq=1.0, phi_distance_sq=401.0**2,
                             own_phi_sq=1.0, model_phi_sq=100.0**2), 10, 10)
    assert refused.value.reason == "phi_distance" and refused.value.wild


def test_an_honest_partner_far_from_us_is_clipped_never_refused() -> None:
    """A node that trained alone for a while is many references away, and one in its warm-up has a tiny
    reference next to a trained partner's Delta: both honest, so clipped (a bounded pull), not punished."""
    bound = UpdateBound(clip_ratio=2, reject_ratio=4, max_inner_steps=10)
    clip = bound.judge(seen(own=0.01, theirs=5.0, phi_distance=150.0, own_phi=100.0), 10, 10)
    assert clip.delta_scale == pytest.approx(0.02 / 5.0) and clip.phi_scale == pytest.approx(0.02 / 150.0)


def test_partners_norms_never_move_the_reference() -> None:
    """The old reference took the median of recent norms *including accepted partners'*: a partner just
    under the bound lifted it round after round (a 1,300x ratchet in 35 rounds). Only our own norms count."""
    bound = UpdateBound(clip_ratio=2, reject_ratio=10, max_inner_steps=10)
    for _ in range(100):
        bound.judge(seen(own=1.0, theirs=1.99, phi_distance=1.99), 10, 10)
    assert bound.reference(own_norm=1.0, own_steps=10, their_steps=10) == pytest.approx(1.0)
    assert bound.judge(seen(own=1.0, theirs=10.0), 10, 10).delta_scale == pytest.approx(0.2)


def test_the_reference_is_our_recent_median_when_this_steps_delta_is_small() -> None:
    bound = UpdateBound(clip_ratio=2, reject_ratio=10, max_inner_steps=10)
    for _ in range(5):
        bound.remember(own_norm=4.0, own_steps=10)
    assert bound.reference(own_norm=0.1, own_steps=10, their_steps=10) == pytest.approx(4.0)


def test_with_no_delta_of_our_own_a_partners_values_count_for_nothing() -> None:
    bound = UpdateBound(clip_ratio=2, reject_ratio=10, max_inner_steps=10)
    assert bound.judge(seen(own=0.0, theirs=1e-6, phi_distance=1e-6), 10, 10) == Clip(0.0, 0.0)
    assert bound.judge(seen(own=0.0, theirs=0.0), 10, 10) == Clip()


def test_with_no_h_given_a_partners_steps_count_up_to_64x_ours() -> None:
    bound = UpdateBound(clip_ratio=2, reject_ratio=10)
    assert bound.credit(own_steps=2, own_samples=8, their_steps=10_000, their_samples=10**9).inner_steps == 128


@settings(max_examples=50, deadline=None)
@given(delta_scale=st.floats(0.0, 1.0), phi_scale=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_the_clipped_sums_are_those_of_a_partner_that_sent_clipped_values(delta_scale, phi_scale, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    own_phi, own_delta, their_phi, their_delta = (torch.randn(257, generator=g, dtype=torch.float64) for _ in range(4))
    t = Tensors(own_phi, own_delta, own_phi + their_phi, own_delta + their_delta)
    apply_clip(t, Clip(delta_scale, phi_scale))
    assert torch.allclose(t.delta_out, own_delta + delta_scale * their_delta)
    assert torch.allclose(t.phi_out, own_phi + (own_phi + phi_scale * (their_phi - own_phi)))


def test_an_unclipped_result_leaves_the_sums_bit_for_bit() -> None:
    t = Tensors(torch.randn(100), torch.randn(100), torch.randn(100), torch.randn(100))
    before = (t.phi_out.clone(), t.delta_out.clone())
    apply_clip(t, Clip())
    assert torch.equal(t.phi_out, before[0]) and torch.equal(t.delta_out, before[1])

"""Streaming fragments, the worker side (issue #23): `Trainer.set_fragments`, `publish_fragment` and
`apply_result(fragment=...)`.

What these prove: one fragment is the whole-vector path bit for bit (error feedback, the exact pull and a
pair's sample weights included); with several fragments in flight, a result applied late and out of order
changes its own slice of phi, the momentum and theta only, and keeps what was learnt meanwhile (the rebase
on the slice); error feedback conserves the update across fragment steps (what the wire carried plus the
residual is the sum of the true Deltas); each fragment's count continues its group's; and a checkpoint taken
with fragments in flight resumes as if those publishes never happened.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from node.bridge.ckptfile import CheckpointError
from node.bridge.exchange import ExchangeOutcome
from node.config.train import TrainConfig
from node.worker.outer import OuterHyper, noloco_step
from node.worker.trainer import Trainer
from protocols.compress import get_compression
from tests.test_compression import flat, wire

TINY = TrainConfig(d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=4, data_bytes=100_000,
                   eval_batches=1, warmup=2, lr=3e-3, inner_steps=5, max_lag=2, checkpoint_every=1)
HYPER = OuterHyper(TINY.alpha, TINY.beta, TINY.gamma)
MEDIUM = get_compression("medium")


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def steps(t: Trainer, n: int) -> None:
    for _ in range(n):
        t.inner_step()


def publish(t: Trainer, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    phi, delta = torch.empty(hi - lo), torch.empty(hi - lo)
    t.publish_fragment(lo, hi, phi, delta)
    return phi, delta


def lossy_sums(lo: int, hi: int, sync: int, *published: tuple[torch.Tensor, torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """A `medium` group's fragment sums as the wire carries them: Delta in top-k, phi in int8 on one of its
    sub-ranges (rotating with the fragment's sync count), NaN outside it (never read)."""
    plo, phi_hi = MEDIUM.fragment_range(hi - lo, MEDIUM.fragment_of(sync))
    sum_phi = torch.full((hi - lo,), float("nan"))
    sum_phi[plo:phi_hi] = sum(wire(phi[plo:phi_hi], MEDIUM.phi_codec("bf16")) for phi, _ in published)
    sum_delta = sum(wire(delta, MEDIUM.delta_codec("bf16")) for _, delta in published)
    assert isinstance(sum_delta, torch.Tensor)
    return sum_phi, sum_delta, (plo, phi_hi)


def test_one_fragment_is_the_whole_vector_path_bit_for_bit(tmp_path: Path) -> None:
    """Same history, one trainer by `publish`/`apply_result`, the other by a one-fragment partition: lossy
    pair steps (error feedback and the exact pull), a sample-weighted one and a solo step leave the same
    phi, momentum, residual, theta and counters, bit for bit."""
    whole, frag = Trainer(TINY, tmp_path / "w", "p"), Trainer(TINY, tmp_path / "f", "p")
    (lo, hi), = frag.set_fragments(1)
    assert (lo, hi) == (0, frag.numel)
    for sync, (group, partner_samples) in enumerate([(2, 0), (2, 0), (2, 12), (1, 0)]):
        for t in (whole, frag):
            steps(t, TINY.inner_steps)
        w_phi, w_delta = torch.empty(whole.numel), torch.empty(whole.numel)
        announced = whole.publish(w_phi, w_delta)
        f_phi, f_delta = publish(frag, lo, hi)
        assert torch.equal(f_phi, w_phi) and torch.equal(f_delta, w_delta)
        partner = (w_phi + 0.01 * (sync + 1), w_delta * 0.5 + 0.001)
        sum_phi, sum_delta, phi_range = lossy_sums(lo, hi, sync, (w_phi, w_delta), partner)
        outcome = ExchangeOutcome(group, compression="medium", phi_range=phi_range, partner_samples=partner_samples,
                                  group_outer_step=sync + 3) if group == 2 else ExchangeOutcome(group)
        whole.apply_result(outcome, sum_phi.clone(), sum_delta.clone())
        got = frag.apply_result(outcome, sum_phi.clone(), sum_delta.clone(), fragment=(lo, hi))
        assert got == group
        assert torch.equal(frag.phi, whole.phi) and torch.equal(frag.outer.momentum, whole.outer.momentum)
        assert frag.residual is not None and whole.residual is not None
        assert torch.equal(frag.residual, whole.residual)
        assert torch.equal(flat(frag), flat(whole))
        assert frag.outer_step == whole.outer_step == frag.fragment_outer_steps[0]
        assert frag.in_flight == {} and whole.pending is None
    assert announced.samples == TINY.inner_steps * TINY.batch_size


def test_two_fragments_in_flight_applied_late_and_out_of_order_touch_their_own_slices_only(tmp_path: Path) -> None:
    """Fragments 0 and 2 of 3 (their edges cut parameters in two) are published at different inner steps
    and both results come late, the later publish's first. Each result moves phi and the momentum by the
    NoLoCo step on its own slice, rebases theta on that slice only (theta_now + phi_new - theta_published),
    and leaves the other slices, the other fragment's pending publish included, as they were."""
    t = Trainer(TINY, tmp_path / "t", "p")
    ranges = t.set_fragments(3)
    (a_lo, a_hi), (m_lo, m_hi), (b_lo, b_hi) = ranges
    steps(t, 3)
    theta_a = flat(t)[a_lo:a_hi]
    a_phi, a_delta = publish(t, a_lo, a_hi)
    steps(t, 2)
    theta_b = flat(t)[b_lo:b_hi]
    b_phi, b_delta = publish(t, b_lo, b_hi)
    assert torch.equal(a_delta, theta_a - t.phi[a_lo:a_hi]) and torch.equal(b_delta, theta_b - t.phi[b_lo:b_hi])
    assert sorted(t.in_flight) == [0, 2]
    steps(t, 2)  # trained on while both exchanges ran

    def apply(lo: int, hi: int, theta_pub: torch.Tensor, sums: tuple[torch.Tensor, torch.Tensor]) -> None:
        theta_now, phi_before, m_before = flat(t), t.phi.clone(), t.outer.momentum.clone()
        want_phi, want_m = phi_before.clone(), m_before.clone()
        noloco_step(want_phi[lo:hi], want_m[lo:hi], sums[1].clone(), sums[0].clone(), HYPER, 2)
        t.apply_result(ExchangeOutcome(2), sums[0].clone(), sums[1].clone(), fragment=(lo, hi))
        assert torch.equal(t.phi, want_phi) and torch.equal(t.outer.momentum, want_m)
        theta = flat(t)
        outside = torch.ones(t.numel, dtype=torch.bool)
        outside[lo:hi] = False
        assert torch.equal(theta[outside], theta_now[outside])
        assert torch.equal(theta[lo:hi], theta_now[lo:hi] + (want_phi[lo:hi] - theta_pub))
        assert not torch.equal(theta[lo:hi], want_phi[lo:hi])  # what was learnt meanwhile is kept

    apply(b_lo, b_hi, theta_b, (b_phi * 2 + 0.01, b_delta * 2))
    assert list(t.in_flight) == [0]
    steps(t, 1)
    apply(a_lo, a_hi, theta_a, (a_phi * 2 - 0.02, a_delta * 1.5))
    assert t.in_flight == {}
    assert t.fragment_outer_steps == [1, 0, 1] and t.outer_step == 0  # the middle fragment has not synced
    m_phi, m_delta = publish(t, m_lo, m_hi)
    t.apply_result(ExchangeOutcome(2), m_phi * 2, m_delta * 2, fragment=(m_lo, m_hi))
    assert t.outer_step == 1


def test_one_publish_per_fragment_and_only_fragments_of_the_partition(tmp_path: Path) -> None:
    t = Trainer(TINY, tmp_path / "t", "p")
    with pytest.raises(RuntimeError):
        publish(t, 0, t.numel)  # no partition declared
    (lo, hi), (lo2, hi2) = t.set_fragments(2)
    steps(t, 1)
    with pytest.raises(ValueError):
        publish(t, lo, hi - 1)  # not a fragment of the partition: it would overlap another's slice
    with pytest.raises(RuntimeError):
        t.apply_result(ExchangeOutcome(1), fragment=(lo, hi))  # nothing in flight for it
    publish(t, lo, hi)
    with pytest.raises(RuntimeError):
        publish(t, lo, hi)  # its result is still to come
    with pytest.raises(RuntimeError):
        t.publish(torch.empty(t.numel), torch.empty(t.numel))  # the whole vector overlaps it
    with pytest.raises(RuntimeError):
        t.set_fragments(4)  # a publish was made on this cut
    with pytest.raises(ValueError):
        # the fragment's size, not the model's
        t.apply_result(ExchangeOutcome(1), scratch=torch.empty(t.numel), fragment=(lo, hi))
    publish(t, lo2, hi2)  # another fragment may be in flight at once
    t.apply_result(ExchangeOutcome(1), fragment=(lo, hi))
    t.apply_result(ExchangeOutcome(1), fragment=(lo2, hi2))
    assert t.in_flight == {} and t.fragment_outer_steps == [1, 1] and t.outer_step == 1


def test_a_fragments_count_continues_its_groups_and_the_outer_step_is_the_lowest(tmp_path: Path) -> None:
    t = Trainer(TINY, tmp_path / "t", "p")
    (lo, hi), (lo2, hi2) = t.set_fragments(2)
    steps(t, 2)
    phi, delta = publish(t, lo, hi)
    publish(t, lo2, hi2)
    t.apply_result(ExchangeOutcome(2, group_outer_step=6), phi * 2, delta * 2, fragment=(lo, hi))
    assert t.fragment_outer_steps == [7, 0] and t.outer_step == 0
    t.apply_result(ExchangeOutcome(1), fragment=(lo2, hi2))
    assert t.fragment_outer_steps == [7, 1] and t.outer_step == 1
    steps(t, 3)
    again = t.publish_fragment(lo2, hi2, torch.empty(hi2 - lo2), torch.empty(hi2 - lo2))
    assert (again.outer_step, again.inner_steps) == (1, 3)  # its own count, its own steps since its publish


def test_error_feedback_conserves_the_update_across_fragment_steps(tmp_path: Path) -> None:
    """Two trainers, three fragments synced at staggered inner steps with `medium` (top-k Delta), results two
    slots late (two fragments in flight at once), one of them a solo step: for every coordinate, what the wire carried of a's Deltas (the whole
    D for the solo step) plus a's final residual is the sum of a's true Deltas. Nothing is lost, only delayed."""
    a, b = Trainer(TINY, tmp_path / "a", "peer-a"), Trainer(TINY, tmp_path / "b", "peer-b")
    ranges = a.set_fragments(3)
    assert b.set_fragments(3) == ranges
    true_sum, sent_sum = torch.zeros(a.numel, dtype=torch.float64), torch.zeros(a.numel, dtype=torch.float64)
    late: list[tuple[int, int, int, dict[Trainer, tuple[torch.Tensor, torch.Tensor]]]] = []

    def apply_late(solo: bool) -> None:
        lo, hi, sync, published = late.pop(0)
        if solo:
            sent_sum[lo:hi] += published[a][1].double()  # a solo step applies D in full
            for t in (a, b):
                t.apply_result(ExchangeOutcome(1), fragment=(lo, hi))
            return
        sum_phi, sum_delta, phi_range = lossy_sums(lo, hi, sync, published[a], published[b])
        sent_sum[lo:hi] += wire(published[a][1], MEDIUM.delta_codec("bf16")).double()
        for t in (a, b):
            assert t.apply_result(ExchangeOutcome(2, compression="medium", phi_range=phi_range),
                                  sum_phi.clone(), sum_delta.clone(), fragment=(lo, hi)) == 2

    slot = 0
    for period in range(3):
        for f, (lo, hi) in enumerate(ranges):
            for t in (a, b):
                steps(t, 2)
            if len(late) == 2:
                apply_late(solo=slot == 4)
            true_sum[lo:hi] += (flat(a)[lo:hi] - a.phi[lo:hi]).double()
            published = {t: publish(t, lo, hi) for t in (a, b)}
            late.append((lo, hi, a.fragment_outer_steps[f], published))
            slot += 1
        assert a.residual is not None and a.residual.abs().sum() > 0  # top-k left something behind
        assert period == a.outer_step
    while late:
        apply_late(solo=False)
    assert a.residual is not None
    assert torch.allclose(sent_sum + a.residual.double(), true_sum, atol=1e-5)


def test_a_checkpoint_with_fragments_in_flight_resumes_as_if_those_publishes_never_happened(tmp_path: Path) -> None:
    """After some lossy fragment syncs (a residual, fragment counts apart), two fragments are published and
    a checkpoint is taken before their results: its state is the one taken just before the publishes, and a
    resumed trainer publishes the same fragment with the same phi, D, count and covered steps as the
    original did."""
    a, b = Trainer(TINY, tmp_path / "a", "peer-a"), Trainer(TINY, tmp_path / "b", "peer-b")
    ranges = a.set_fragments(2)
    b.set_fragments(2)
    (lo, hi), (lo2, hi2) = ranges
    for sync, (flo, fhi) in enumerate([ranges[0], ranges[1], ranges[0]]):
        for t in (a, b):
            steps(t, 2)
        published = [publish(t, flo, fhi) for t in (a, b)]
        sum_phi, sum_delta, phi_range = lossy_sums(flo, fhi, sync, *published)
        for t in (a, b):
            t.apply_result(ExchangeOutcome(2, compression="medium", phi_range=phi_range), sum_phi.clone(),
                           sum_delta.clone(), fragment=(flo, fhi))
    assert a.fragment_outer_steps == [2, 1] and a.residual is not None and a.residual.abs().sum() > 0
    steps(a, 2)
    before = a.state_dict()
    first = publish(a, lo, hi)
    announced = a.publish_fragment(lo2, hi2, torch.empty(hi2 - lo2), torch.empty(hi2 - lo2))
    steps(a, 1)
    after = a.state_dict()
    assert after["fragments"] == before["fragments"] == {"count": 2, "outer_steps": [2, 1], "publish_steps": [6, 4]}
    for key in ("phi", "residual"):
        assert torch.equal(after[key], before[key])
    assert torch.equal(after["outer"]["momentum"], before["outer"]["momentum"])
    a.save_checkpoint()

    resumed = Trainer(TINY, tmp_path / "a", "peer-a")
    resumed.resume()
    assert resumed.set_fragments(2) == ranges  # re-declared as the daemon would: the counters are kept
    assert resumed.in_flight == {} and resumed.fragment_outer_steps == [2, 1] and resumed.outer_step == 1
    assert torch.equal(flat(resumed), flat(a)) and torch.equal(resumed.phi, a.phi)
    again = publish(resumed, lo, hi)
    assert torch.equal(again[0], first[0])  # the same phi ...
    # ... and the same D but for the step taken after the original publish, which the rebase would keep
    assert torch.equal(again[1], (flat(a)[lo:hi] - a.phi[lo:hi]) + a.residual[lo:hi])
    repeat = resumed.publish_fragment(lo2, hi2, torch.empty(hi2 - lo2), torch.empty(hi2 - lo2))
    assert (repeat.outer_step, repeat.inner_steps) == (announced.outer_step, announced.inner_steps + 1)


def test_a_checkpoint_with_malformed_fragment_counters_is_refused(tmp_path: Path) -> None:
    t = Trainer(TINY, tmp_path / "t", "p")
    t.set_fragments(2)
    good = t.state_dict()
    t.check_state(good)
    for bad in ({"count": 2, "outer_steps": [0], "publish_steps": [0, 0]},
                {"count": 0, "outer_steps": [], "publish_steps": []},
                {"count": 2, "outer_steps": [0, -1], "publish_steps": [0, 0]},
                {"count": 2, "outer_steps": [0, 0], "publish_steps": [0, 99]},
                [2]):
        with pytest.raises(CheckpointError):
            t.check_state({**good, "fragments": bad})


def test_fragment_syncs_allocate_no_model_sized_buffer_when_the_caller_lends_the_scratch(tmp_path: Path) -> None:
    """theta_published, phi, the momentum and the residual are the whole-vector path's buffers, written per
    slice; the outer step's own Delta goes into the caller's fragment-sized scratch (the worker's Delta slot's
    slice), so no private scratch is allocated."""
    t = Trainer(TINY, tmp_path / "t", "p")
    (lo, hi), (lo2, hi2) = t.set_fragments(2)
    steps(t, 2)
    for flo, fhi in ((lo, hi), (lo2, hi2)):
        phi, delta = publish(t, flo, fhi)
        sum_phi, sum_delta, phi_range = lossy_sums(flo, fhi, 0, (phi, delta), (phi, delta))
        t.apply_result(ExchangeOutcome(2, compression="medium", phi_range=phi_range), sum_phi, sum_delta,
                       scratch=delta, sum_phi_is_scratch=True, fragment=(flo, fhi))
    assert t._scratch_buf is None
    assert t.residual is not None and t.residual.shape == (t.numel,)


def test_equal_replicas_feel_no_pull_through_a_lossy_wire_on_a_fragment(tmp_path: Path) -> None:
    """A fragment away from the vector's start, its phi in int8 on a sub-range of it: the pull is
    gamma/2 * (Q(phi_p) - Q(phi)) on the fragment's own coordinates, zero for equal replicas, so phi moves by
    exactly beta * mean Delta there (`medium`: ours whole, the partner's as carried) and not at all elsewhere."""
    t = Trainer(TINY, tmp_path / "t", "p")
    lo, hi = t.set_fragments(3)[2]
    steps(t, 3)
    phi, delta = publish(t, lo, hi)
    sum_phi, _, phi_range = lossy_sums(lo, hi, 1, (phi, delta), (phi, delta))
    assert phi_range[0] > 0
    carried = wire(delta, MEDIUM.delta_codec("bf16"))
    before = t.phi.clone()
    t.apply_result(ExchangeOutcome(2, compression="medium", phi_range=phi_range), sum_phi, 2 * carried,
                   fragment=(lo, hi))
    want = before.clone()
    want[lo:hi] += TINY.beta * (delta + carried) / 2  # first step (zero momentum)
    assert torch.allclose(t.phi, want, atol=1e-6)
    assert torch.equal(t.phi[:lo], before[:lo])


def test_an_own_exact_fragment_step_applies_its_whole_delta_and_empties_its_own_slice_only(tmp_path: Path) -> None:
    """`auto`'s ramp on a fragment: our own D in full (the sum's own term becomes D), the fragment's slice of
    the residual emptied, and what the other fragments' slices hold of earlier top-k steps kept."""
    t = Trainer(TINY, tmp_path / "t", "p")
    (lo, hi), (lo2, hi2) = t.set_fragments(2)
    steps(t, 2)
    for flo, fhi in ((lo, hi), (lo2, hi2)):  # a top-k step on each: both slices hold something
        phi, delta = publish(t, flo, fhi)
        sum_phi, sum_delta, phi_range = lossy_sums(flo, fhi, 0, (phi, delta), (phi, delta))
        t.apply_result(ExchangeOutcome(2, compression="medium", phi_range=phi_range), sum_phi, sum_delta,
                       fragment=(flo, fhi))
    assert t.residual is not None and t.residual[lo:hi].abs().sum() > 0 and t.residual[lo2:hi2].abs().sum() > 0
    kept = t.residual[lo:hi].clone()
    steps(t, 2)
    phi, delta = publish(t, lo2, hi2)
    partner = delta * 0.5
    sum_phi, sum_delta, phi_range = lossy_sums(lo2, hi2, 1, (phi, delta), (phi, partner))
    want_sum = wire(partner, MEDIUM.delta_codec("bf16")) + delta
    m_before, before = t.outer.momentum.clone(), t.phi.clone()
    t.apply_result(ExchangeOutcome(2, compression="medium", phi_range=phi_range, own_exact=True), sum_phi,
                   sum_delta, fragment=(lo2, hi2))
    assert torch.allclose(sum_delta, want_sum, atol=1e-6)  # the sum's own term is D, in full
    assert t.residual is not None and not t.residual[lo2:hi2].any() and torch.equal(t.residual[lo:hi], kept)
    assert torch.equal(t.phi[lo:hi], before[lo:hi]) and torch.equal(t.outer.momentum[lo:hi], m_before[lo:hi])

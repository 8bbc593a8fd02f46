"""bench/fragments.py (streaming fragments, issue #23): the fragment outer step's algebra.

- applied to every fragment at once, with one partner's sums, the fragment steps are the whole-vector NoLoCo
  step, bit for bit, however the vector is cut;
- with one fragment, a replica's publish and result are the worker's own (`Trainer.publish` and
  `apply_result`), error feedback and int8 phi included, and a whole run is bench/compression.py's;
- a fragment's result touches its own slice only, and a late one keeps what was learnt meanwhile (the
  worker's rebase, on the slice).

No loss is asserted: the figures are docs/benchmarks.md's ("Streaming fragments (tried)").
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import compression, fragments  # noqa: E402
from bench.convergence import BenchConfig  # noqa: E402
from node.bridge.exchange import ExchangeOutcome  # noqa: E402
from node.worker.outer import OuterHyper, noloco_step  # noqa: E402
from node.worker.trainer import Trainer  # noqa: E402
from protocols.compress import BLOCK, get_compression  # noqa: E402

HYPER = OuterHyper(alpha=0.5, beta=0.7, gamma=0.7)
TINY = BenchConfig(outer_steps=4, inner_steps=4, batch_size=4, seq_len=32, d_model=32, n_layers=1, n_heads=2,
                   lr=3e-3, warmup=2, data_bytes=100_000, eval_batches=1)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7])
def test_every_fragments_step_at_once_with_one_partner_is_the_whole_vector_step(count: int) -> None:
    numel = 3 * BLOCK + 123  # a short last block, and more fragments than blocks for count = 7
    gen = torch.Generator().manual_seed(count)
    phi, momentum, sum_delta, sum_phi = (torch.randn(numel, generator=gen) for _ in range(4))
    whole_phi, whole_m = phi.clone(), momentum.clone()
    noloco_step(whole_phi, whole_m, sum_delta.clone(), sum_phi.clone(), HYPER, 2)
    ranges = fragments.fragment_ranges(numel, count)
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))  # a partition, in order
    for lo, hi in ranges:
        if hi > lo:
            fragments.fragment_step(phi, momentum, lo, hi, HYPER, 2, sum_delta[lo:hi].clone(), sum_phi[lo:hi].clone())
    assert torch.equal(phi, whole_phi) and torch.equal(momentum, whole_m)


def test_a_solo_fragment_step_is_heavy_ball_on_its_slice_only() -> None:
    phi, momentum, own = torch.randn(10), torch.randn(10), torch.randn(10)
    want_phi, want_m = phi.clone(), momentum.clone()
    want_m[3:7] = want_m[3:7] * HYPER.alpha + own[3:7] * HYPER.beta
    want_phi[3:7] += want_m[3:7]
    fragments.fragment_step(phi, momentum, 3, 7, HYPER, 1, own[3:7])
    assert torch.allclose(phi, want_phi) and torch.allclose(momentum, want_m)
    assert torch.equal(phi[:3], want_phi[:3]) and torch.equal(phi[7:], want_phi[7:])


@pytest.mark.parametrize("preset", ["none", "medium"])
def test_one_fragment_is_the_workers_publish_and_result_bit_for_bit(tmp_path: Path, preset: str) -> None:
    torch.set_num_threads(1)
    cfg = TINY.train_config("noloco")
    worker, plain = Trainer(cfg, tmp_path / "w", "p"), Trainer(cfg, tmp_path / "f", "p")
    replica = fragments.Replica(plain)
    comp = get_compression(preset)
    numel = worker.numel
    (lo, hi), = fragments.fragment_ranges(numel, 1)
    assert (lo, hi) == (0, numel)
    for outer in range(3):  # the error feedback of one result feeds the next publish
        for t in (worker, plain):
            for _ in range(TINY.inner_steps):
                t.inner_step()
        phi_w, delta_w = torch.empty(numel), torch.empty(numel)
        worker.publish(phi_w, delta_w)
        phi_f, delta_f = replica.publish(lo, hi)
        assert torch.equal(phi_f, phi_w) and torch.equal(delta_f, delta_w)
        partner_phi, partner_delta = phi_w + 0.01 * (outer + 1), delta_w * 0.5 + 0.001
        phi_range = comp.fragment_range(numel, comp.fragment_of(outer)) if comp.lossy else None
        plo, phi_hi = phi_range if phi_range is not None else (0, numel)
        dcodec, pcodec = comp.delta_codec("bf16"), comp.phi_codec("bf16")
        sum_phi = torch.zeros(numel)
        sum_phi[plo:phi_hi] = fragments.wire_sum([phi_w[plo:phi_hi], partner_phi[plo:phi_hi]], pcodec)
        sum_delta = fragments.wire_sum([delta_w, partner_delta], dcodec)
        worker.apply_result(ExchangeOutcome(2, compression=preset, phi_range=phi_range), sum_phi.clone(),
                            sum_delta.clone())
        replica.apply(lo, hi, 2, sum_phi.clone(), sum_delta.clone(), comp, phi_range)
        assert torch.equal(plain.phi, worker.phi)
        assert torch.equal(plain.outer.momentum, worker.outer.momentum)
        for a, b in zip(worker.params, plain.params, strict=True):
            assert torch.equal(a, b)
        if comp.lossy:
            assert worker.residual is not None and replica.residual is not None
            assert torch.equal(replica.residual, worker.residual) and bool(replica.residual.abs().sum() > 0)
        else:
            assert worker.residual is None and replica.residual is None


@pytest.mark.parametrize("preset", ["none", "medium"])
def test_a_one_fragment_run_is_bench_compressions_run(tmp_path: Path, preset: str) -> None:
    """The whole simulation with F = 1 gives bench/compression.py's figures exactly (same pairing draws,
    same codecs, same steps), so the fragment rows are comparable with the Compression section's."""
    torch.set_num_threads(1)
    mine = fragments.run_variant(TINY, 4, fragments.Variant("one", 1, preset), tmp_path / "frag")
    theirs = compression.run_preset(TINY, 4, preset, tmp_path / "comp")
    assert (mine.val_mean, mine.val_avg_model, mine.spread) == (theirs.val_mean, theirs.val_avg_model,
                                                                 theirs.spread)
    assert mine.bytes_per_param == pytest.approx(get_compression(preset).bytes_per_param(mine.params))


def test_fragments_send_the_same_bytes_per_period_with_a_smaller_peak_and_their_own_partners(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    bc = dataclasses.replace(TINY, outer_steps=2)
    one = fragments.run_variant(bc, 4, fragments.VARIANTS["none"], tmp_path / "one")
    four = fragments.run_variant(bc, 4, fragments.VARIANTS["f4"], tmp_path / "four")
    assert four.bytes_per_param == one.bytes_per_param == 4.0  # bf16 phi and Delta, each fragment once
    numel = one.params
    assert one.peak_bytes == 4 * numel
    assert four.peak_bytes == 4 * max(hi - lo for lo, hi in fragments.fragment_ranges(numel, 4))
    assert fragments.slot_ends(50, 4) == [12, 25, 37, 50] and fragments.slot_ends(5, 1) == [5]
    with pytest.raises(ValueError):
        fragments.slot_ends(3, 4)


def test_a_fragments_late_result_changes_its_slice_only_and_keeps_what_was_learnt_meanwhile(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    t = Trainer(TINY.train_config("noloco"), tmp_path / "r", "r")
    replica = fragments.Replica(t, 2)
    (a_lo, a_hi), (lo, hi) = fragments.fragment_ranges(t.numel, 2)
    for _ in range(3):
        t.inner_step()
    phi_pub, delta = replica.publish(lo, hi)
    theta_pub = replica.theta_published[lo:hi].clone()
    for _ in range(2):  # trained on while the exchange ran
        t.inner_step()
    theta_now = torch.cat([p.detach().reshape(-1) for p in t.params])
    phi_before, m_before = t.phi.clone(), t.outer.momentum.clone()
    sum_phi, sum_delta = phi_pub * 2 + 0.01, delta * 2
    replica.apply(lo, hi, 2, sum_phi.clone(), sum_delta.clone(), get_compression("none"), None)
    want_phi, want_m = phi_before.clone(), m_before.clone()
    noloco_step(want_phi[lo:hi], want_m[lo:hi], sum_delta, sum_phi, HYPER, 2)
    assert torch.equal(t.phi, want_phi) and torch.equal(t.outer.momentum, want_m)
    assert torch.equal(t.phi[a_lo:a_hi], phi_before[a_lo:a_hi])
    theta = torch.cat([p.detach().reshape(-1) for p in t.params])
    assert torch.equal(theta[a_lo:a_hi], theta_now[a_lo:a_hi])  # the other fragment: untouched
    assert torch.equal(theta[lo:hi], theta_now[lo:hi] + (want_phi[lo:hi] - theta_pub))

"""NoLoCo and DiLoCo outer steps against hand-computed values, and small convergence runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from node.worker.outer import OuterHyper, OuterOptimizer, diloco_step, noloco_step

HYPER = OuterHyper(alpha=0.5, beta=0.7, gamma=0.7)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_noloco_step_matches_hand_computed_values() -> None:
    phi, momentum = t(1.0, 2.0), t(0.5, -1.0)
    mean_delta, mean_phi = t(0.2, -0.4), t(0.8, 2.5)
    noloco_step(phi, momentum, mean_delta, mean_phi, HYPER)
    # m = 0.5*m + 0.7*mean_delta - 0.7*(phi - mean_phi)
    #   = [0.25, -0.5] + [0.14, -0.28] - 0.7*[0.2, -0.5] = [0.25, -0.43];  phi = [1.25, 1.57]
    assert torch.allclose(momentum, t(0.25, -0.43), atol=1e-6)
    assert torch.allclose(phi, t(1.25, 1.57), atol=1e-6)


def test_diloco_step_matches_hand_computed_values() -> None:
    phi, momentum = t(1.0, 2.0), t(0.5, -1.0)
    diloco_step(phi, momentum, t(0.2, -0.4), HYPER)
    # m = 0.5*m + 0.7*mean_delta = [0.39, -0.78]
    assert torch.allclose(momentum, t(0.39, -0.78), atol=1e-6)
    assert torch.allclose(phi, t(1.39, 1.22), atol=1e-6)


def test_outer_step_moves_slow_weights_towards_where_the_inner_steps_went() -> None:
    # The sign check: with Delta = theta - phi, the first (momentum-free) step is phi += beta * Delta.
    for kind in ("noloco", "diloco"):
        opt = OuterOptimizer(kind, HYPER, 3)
        phi, theta = t(0.0, 1.0, -1.0), t(1.0, 0.0, -1.0)
        opt.step(phi, theta - phi, group_size=1)
        assert torch.allclose(phi, t(0.7, 0.3, -1.0)), kind


def test_solo_step_is_heavy_ball_on_own_delta_and_ignores_the_outputs() -> None:
    opt = OuterOptimizer("noloco", HYPER, 2)
    phi = t(1.0, 1.0)
    opt.step(phi, t(1.0, 0.0), group_size=1, sum_phi=t(99.0, 99.0), sum_delta=t(99.0, 99.0))
    opt.step(phi, t(1.0, 0.0), group_size=0)
    # m1 = 0.7*[1,0];  m2 = 0.5*m1 + 0.7*[1,0] = [1.05, 0];  phi = 1 + 0.7 + 1.05
    assert torch.allclose(phi, t(2.75, 1.0), atol=1e-6)


def test_a_noloco_pair_pulls_two_replicas_together() -> None:
    a, b = OuterOptimizer("noloco", HYPER, 1), OuterOptimizer("noloco", HYPER, 1)
    phi_a, phi_b = t(0.0), t(1.0)
    delta = t(0.5)  # both replicas moved +0.5 in their inner steps
    sum_phi, sum_delta = phi_a + phi_b, delta + delta  # what the daemon leaves: the pair's sums
    a.step(phi_a, delta, group_size=2, sum_phi=sum_phi, sum_delta=sum_delta)
    b.step(phi_b, delta, group_size=2, sum_phi=sum_phi, sum_delta=sum_delta)
    # a: m = 0.35 - 0.7*(0 - 0.5) = 0.7;  b: m = 0.35 - 0.7*(1 - 0.5) = 0
    assert torch.allclose(phi_a, t(0.7)) and torch.allclose(phi_b, t(1.0))
    assert abs(float(phi_b - phi_a)) < 1.0


def test_noloco_with_the_group_of_all_replicas_equals_diloco() -> None:
    gen = torch.Generator().manual_seed(7)
    n, size, steps = 4, 64, 5
    start = torch.randn(size, generator=gen)
    noloco = [OuterOptimizer("noloco", HYPER, size) for _ in range(n)]
    diloco = OuterOptimizer("diloco", HYPER, size)
    phis = [start.clone() for _ in range(n)]
    phi_d = start.clone()
    for _ in range(steps):
        thetas = [phis[0] + 0.1 * torch.randn(size, generator=gen) for _ in range(n)]
        deltas = [theta - phi for theta, phi in zip(thetas, phis, strict=True)]
        sum_delta = torch.stack(deltas).sum(0)
        sum_phi = torch.stack(phis).sum(0)
        for opt, phi, delta in zip(noloco, phis, deltas, strict=True):
            opt.step(phi, delta, group_size=n, sum_phi=sum_phi, sum_delta=sum_delta)
        diloco.step(phi_d, sum_delta / n, group_size=n, sum_phi=sum_phi, sum_delta=sum_delta)
        for phi in phis:
            assert torch.allclose(phi, phi_d, atol=1e-6)
    assert not torch.allclose(phi_d, start)  # the steps did something


def test_a_pair_with_equal_phis_makes_the_gamma_term_exactly_zero() -> None:
    opt_n = OuterOptimizer("noloco", HYPER, 3)
    opt_d = OuterOptimizer("diloco", HYPER, 3)
    phi_n, phi_d = t(0.1, 0.2, 0.3), t(0.1, 0.2, 0.3)
    delta = t(0.3, -0.1, 0.0)
    opt_n.step(phi_n, delta, group_size=2, sum_phi=phi_n + phi_n, sum_delta=delta + delta)
    opt_d.step(phi_d, delta, group_size=2, sum_phi=phi_d + phi_d, sum_delta=delta + delta)
    assert torch.equal(phi_n, phi_d)


@pytest.mark.parametrize("kind", ["noloco", "diloco"])
def test_a_pair_step_from_the_sums_is_bit_identical_to_the_step_from_the_means(kind: str) -> None:
    """The daemon leaves sums and the step divides by 2 in its scalars: for a pair that must be exactly
    the step on the means (halving is exact), so nothing changed for the model but one pass less."""
    gen = torch.Generator().manual_seed(3)
    phi, momentum = torch.randn(10_000, generator=gen), torch.randn(10_000, generator=gen)
    a = [torch.randn(10_000, generator=gen) * s for s in (1.0, 1e-3)]  # the two phis
    b = [torch.randn(10_000, generator=gen) * s for s in (1e-2, 1e-5)]  # the two Deltas
    sums = (a[0] + a[1], b[0] + b[1])
    means = (sums[0] * 0.5, sums[1] * 0.5)
    by_sum, by_mean = (phi.clone(), momentum.clone()), (phi.clone(), momentum.clone())
    if kind == "noloco":
        noloco_step(*by_sum, sums[1], sums[0], HYPER, 2)
        noloco_step(*by_mean, means[1], means[0], HYPER)
    else:
        diloco_step(*by_sum, sums[1], HYPER, 2)
        diloco_step(*by_mean, means[1], HYPER)
    assert torch.equal(by_sum[0], by_mean[0]) and torch.equal(by_sum[1], by_mean[1])


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("phi_range", [None, (1_000, 7_000)])
def test_the_pull_computed_in_the_sum_phi_buffer_gives_the_same_bits(weighted: bool, phi_range) -> None:
    """The worker lets the step use its phi_out slot as the pull's scratch (no model-sized temporary): the
    same operation into another buffer, so phi and the momentum come out bit for bit as before."""
    from node.worker.outer import PairWeights

    gen = torch.Generator().manual_seed(5)
    phi, momentum = torch.randn(10_000, generator=gen), torch.randn(10_000, generator=gen)
    sum_phi, sum_delta = torch.randn(10_000, generator=gen), torch.randn(10_000, generator=gen) * 1e-2
    weights = PairWeights(300, 100, sum_delta * 0.5) if weighted else None
    plain, scratch = (phi.clone(), momentum.clone()), (phi.clone(), momentum.clone())
    kept = sum_phi.clone()
    noloco_step(*plain, sum_delta, kept, HYPER, 2, weights, phi_range)
    assert torch.equal(kept, sum_phi)  # untouched without the flag
    used = sum_phi.clone()
    noloco_step(*scratch, sum_delta, used, HYPER, 2, weights, phi_range, overwrite_sum_phi=True)
    assert torch.equal(plain[0], scratch[0]) and torch.equal(plain[1], scratch[1])
    lo, hi = phi_range or (0, 10_000)
    assert not torch.equal(used[lo:hi], sum_phi[lo:hi])  # it was the scratch
    assert torch.equal(used[:lo], sum_phi[:lo]) and torch.equal(used[hi:], sum_phi[hi:])  # only the fragment


def test_group_step_without_sums_is_refused() -> None:
    opt = OuterOptimizer("noloco", HYPER, 2)
    with pytest.raises(ValueError, match="sum_phi and sum_delta"):
        opt.step(t(0.0, 0.0), t(1.0, 1.0), group_size=2)


def test_unknown_outer_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown outer optimizer"):
        OuterOptimizer("adamw", HYPER, 2)


def test_momentum_survives_a_state_dict_round_trip() -> None:
    opt = OuterOptimizer("noloco", HYPER, 2)
    opt.step(t(0.0, 0.0), t(1.0, 2.0), group_size=1)
    fresh = OuterOptimizer("noloco", HYPER, 2)
    fresh.load_state_dict(opt.state_dict())
    assert torch.equal(fresh.momentum, opt.momentum)
    with pytest.raises(ValueError, match="does not match"):
        OuterOptimizer("noloco", HYPER, 3).load_state_dict(opt.state_dict())


# --- small versions of bench/convergence.py ---------------------------------------------------------------


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).resolve().parent.parent / "bench" / "convergence.py"
    spec = importlib.util.spec_from_file_location("bench_convergence", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def tiny(bench):
    return bench.BenchConfig(outer_steps=6, inner_steps=5, batch_size=4, seq_len=32, d_model=32, n_layers=1,
                             n_heads=2, lr=3e-3, warmup=4, data_bytes=100_000, eval_batches=2)


def test_noloco_replicas_learn_and_stay_close(bench, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    r = bench.run_outer(tiny(bench), 4, "noloco", tmp_path)
    assert r.val_mean < r.initial_val - 0.5
    assert 0.0 < r.spread < 0.05  # distinct replicas (pairs, not a global average), yet close


def test_diloco_replicas_learn_and_stay_identical(bench, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    r = bench.run_outer(tiny(bench), 4, "diloco", tmp_path)
    assert r.val_mean < r.initial_val - 0.5
    assert r.spread == 0.0


def test_data_parallel_stand_in_learns(bench) -> None:
    torch.set_num_threads(1)
    r = bench.run_ddp(tiny(bench), 2)
    assert r.val_mean < r.initial_val - 0.5


def test_benchmark_replaces_only_its_own_section(bench, tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Discovery\n\nkeep me\n\n## Convergence\n\nold\n\n## Later\n\nme too\n")
    bench.write_section("## Convergence\n\nnew table\n", doc)
    text = doc.read_text()
    assert "keep me" in text and "me too" in text and "new table" in text and "old" not in text
    fresh = tmp_path / "fresh.md"
    bench.write_section("## Convergence\n\nfirst\n", fresh)
    assert fresh.read_text().startswith("# Benchmarks\n") and "first" in fresh.read_text()


# --- sample-weighted pairs (machines of different speeds) --------------------------------------------------


def test_a_pairs_delta_is_weighted_by_the_samples_each_member_trained() -> None:
    g = torch.Generator().manual_seed(3)
    phi, own, theirs, their_phi = (torch.randn(50, generator=g) for _ in range(4))
    for kind in ("noloco", "diloco"):
        opt = OuterOptimizer(kind, HYPER, 50)
        p = phi.clone()
        # We trained 160 samples, the partner (a machine 4x faster) 640: the mean Delta is 0.2/0.8.
        opt.step(p, own, group_size=2, sum_phi=phi + their_phi, sum_delta=own + theirs, samples=(160, 640))
        mean_delta = 0.2 * own + 0.8 * theirs
        # The pull goes to the sample-weighted mean of phi as well.
        pull = HYPER.gamma * (phi - (0.2 * phi + 0.8 * their_phi)) if kind == "noloco" else 0.0
        expected_momentum = HYPER.beta * mean_delta - pull
        assert torch.allclose(opt.momentum, expected_momentum, atol=1e-5), kind
        assert torch.allclose(p, phi + expected_momentum, atol=1e-5), kind


def test_both_partners_of_a_weighted_pair_take_the_same_step_from_the_same_sums() -> None:
    g = torch.Generator().manual_seed(4)
    phi_a, phi_b, d_a, d_b = (torch.randn(100, generator=g) for _ in range(4))
    a, b = OuterOptimizer("noloco", HYPER, 100), OuterOptimizer("noloco", HYPER, 100)
    sum_phi, sum_delta = phi_a + phi_b, d_a + d_b
    pa, pb = phi_a.clone(), phi_b.clone()
    a.step(pa, d_a, group_size=2, sum_phi=sum_phi, sum_delta=sum_delta, samples=(100, 300))
    b.step(pb, d_b, group_size=2, sum_phi=sum_phi, sum_delta=sum_delta, samples=(300, 100))
    # The same weighted Delta on both sides (each derives it from its own Delta and the common sum), and
    # both pulled towards the same weighted phi: the two end on the same side of it, their difference
    # shrunk by gamma exactly as under the plain mean.
    mean_phi = 0.25 * phi_a + 0.75 * phi_b
    delta_term_a = a.momentum + HYPER.gamma * (phi_a - mean_phi)
    delta_term_b = b.momentum + HYPER.gamma * (phi_b - mean_phi)
    assert torch.allclose(delta_term_a, delta_term_b, atol=1e-5)
    pull_a, pull_b = a.momentum - delta_term_a, b.momentum - delta_term_b
    assert torch.allclose(pull_a - pull_b, -HYPER.gamma * (phi_a - phi_b), atol=1e-5)


def test_equal_or_unknown_sample_counts_give_exactly_the_plain_pair_step() -> None:
    g = torch.Generator().manual_seed(5)
    phi, own, sum_phi, sum_delta = (torch.randn(64, generator=g) for _ in range(4))
    plain = OuterOptimizer("noloco", HYPER, 64)
    p_plain = phi.clone()
    plain.step(p_plain, own, group_size=2, sum_phi=sum_phi, sum_delta=sum_delta)
    for samples in [(200, 200), (0, 300), (300, 0)]:
        opt = OuterOptimizer("noloco", HYPER, 64)
        p = phi.clone()
        opt.step(p, own, group_size=2, sum_phi=sum_phi, sum_delta=sum_delta, samples=samples)
        assert torch.equal(p, p_plain) and torch.equal(opt.momentum, plain.momentum), samples


def test_the_daemon_and_the_worker_weight_a_pair_by_one_rule() -> None:
    """Sample weighting lives in one place (node/bridge/exchange.py, `pair_weights`): the daemon's numpy
    mean of a group of four's second round and the worker's torch outer step take the same weights, and
    equal or unknown counts mean the plain mean on both sides."""
    import numpy as np

    from node.averaging.group_mean import weighted_mean
    from node.bridge.exchange import pair_weights
    from node.worker.outer import PairWeights

    assert pair_weights(8, 8) is None and pair_weights(0, 8) is None and pair_weights(8, -1) is None
    assert pair_weights(30, 10) == (0.25, 0.5)
    gen = torch.Generator().manual_seed(3)
    own, other = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen)
    for w_own, w_partner in ((30, 10), (10, 30), (8, 8), (0, 5)):
        assert PairWeights(w_own, w_partner, own).coefficients == pair_weights(w_own, w_partner)
        out = np.empty(1000, np.float32)
        weighted_mean(out, own.numpy(), (own + other).numpy(), w_own, w_partner)
        if w_own > 0 and w_partner > 0:
            want = (w_own * own + w_partner * other) / (w_own + w_partner)
        else:
            want = (own + other) / 2
        torch.testing.assert_close(torch.from_numpy(out), want, rtol=0, atol=1e-6)

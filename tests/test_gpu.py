"""The training path on an accelerator: a trainer on `train.device = cuda` trains in every precision, takes
averaged outer steps, checkpoints and resumes exactly (the CUDA RNG included), and two real daemons on CUDA
average, resume and export.

Each test runs on the CPU too, so that CI (which has no GPU) proves the test itself; the `cuda` variants
carry the `gpu` marker and skip with the reason where no CUDA device is visible. `make test-gpu` runs them
(README, "On a GPU"; the figures are in docs/benchmarks.md, "On a GPU").
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from node.bridge.exchange import ExchangeOutcome
from node.config.train import TrainConfig
from node.worker.trainer import Trainer
from starling_testing.daemon import TINY, TINY_TRAIN, DaemonGroup

NO_CUDA = "no CUDA device is visible to torch here (run `make test-gpu` on a GPU host)"
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason=NO_CUDA)])
DEVICES = [pytest.param("cpu"), CUDA]

SMALL = TrainConfig(d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=4, data_bytes=100_000,
                    eval_batches=2, warmup=2, lr=3e-3, inner_steps=5, max_lag=2, checkpoint_every=1)


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def averaged_outer_step(a: Trainer, b: Trainer) -> None:
    """Both trainers step to their publish and apply the pair's sums, as two paired workers would."""
    slots = {}
    for t in (a, b):
        while not t.publish_due():
            t.inner_step()
        slots[id(t)] = (torch.empty(t.numel), torch.empty(t.numel))
        t.publish(*slots[id(t)])
    sum_phi = slots[id(a)][0] + slots[id(b)][0]
    sum_delta = slots[id(a)][1] + slots[id(b)][1]
    for t in (a, b):
        assert t.apply_result(ExchangeOutcome(2), sum_phi.clone(), sum_delta.clone()) == 2


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_trainer_on_the_device_trains_averages_and_resumes_exactly(tmp_path: Path, device: str,
                                                                     precision: str) -> None:
    cfg = replace(SMALL, device=device, precision=precision, seed=1)
    a, b = Trainer(cfg, tmp_path / "a", "peer-a"), Trainer(replace(cfg, seed=2), tmp_path / "b", "peer-b")
    assert {p.device.type for p in a.model.parameters()} == {device}
    untrained = a.evaluate()
    for _ in range(4):
        averaged_outer_step(a, b)
    # The master copies stay fp32 on the host, whatever the device and the precision.
    assert a.phi.device.type == "cpu" and a.phi.dtype == torch.float32
    assert bool(torch.isfinite(a.phi).all()) and a.skipped_steps == 0
    assert a.evaluate() < untrained - 0.3, (untrained, a.val_loss)
    assert a.outer_step == b.outer_step == 4

    a.inner_step()  # fast weights that are not the slow ones, and an RNG that has moved
    a.save_checkpoint()
    resumed = Trainer(cfg, tmp_path / "a", "peer-a")
    path, rejected = resumed.resume()
    assert path is not None and not rejected
    assert (resumed.step, resumed.outer_step) == (a.step, a.outer_step)
    assert torch.equal(resumed.phi, a.phi)
    for p, q in zip(a.model.parameters(), resumed.model.parameters(), strict=True):
        assert q.device.type == device and torch.equal(p, q)
    if device == "cuda":
        assert torch.equal(torch.cuda.get_rng_state(resumed.device), torch.cuda.get_rng_state(a.device))
    # The next inner step of the resumed trainer is the one the original takes: same batch, same dropout.
    assert resumed.inner_step() == pytest.approx(a.inner_step(), rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_two_daemons_on_the_device_average_resume_and_export(tmp_path: Path, device: str) -> None:
    group = DaemonGroup(tmp_path)
    dev = ["--set", f"train.device={device}"]
    try:
        a = group.start("a", *TINY, *dev, "--swarm", f"gpu-{device}")
        b = group.start("b", *TINY, *dev, "--swarm", f"gpu-{device}", "--bootstrap", a.addr())
        for d in (a, b):
            st = d.wait_status(lambda s: s["sync"]["rounds"] >= 2 and bool(s["training"].get("checkpoint_step")),
                               timeout=180)
            assert st["training"]["device"].startswith(device)
        assert b.stop() == 0
        b_again = group.start("b", *TINY, *dev, "--swarm", f"gpu-{device}", "--bootstrap", a.addr())
        # (A status served before the worker's hello has no `training` section yet.)
        st = b_again.wait_status(lambda s: ((s.get("training") or {}).get("resumed_step") or 0) > 0, timeout=120)
        assert st["training"]["device"].startswith(device)
        b_again.wait_status(lambda s: s["sync"]["rounds"] >= 1, timeout=120)
        assert b_again.stop() == 0 and a.stop() == 0
    finally:
        group.close()
    # The checkpoint written on the device exports (on whatever device `export` loads it) and evaluates.
    out = tmp_path / "export"
    done = subprocess.run([sys.executable, "-m", "node.cli", "export", "--home", str(tmp_path / "b"),
                           "--out", str(out), "--evaluate", *TINY_TRAIN, *dev],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    assert weights and all(bool(torch.isfinite(t).all()) for t in weights.values())
    outer = re.search(r"outer step (\d+)", done.stdout)
    assert outer is not None and int(outer.group(1)) >= 2, done.stdout

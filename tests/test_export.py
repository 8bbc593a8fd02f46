"""`starling export`: the slow weights of the latest checkpoint as plain files, and its one-line errors."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest
import torch

from node.bridge.exchange import ExchangeOutcome
from node.cli import main
from node.config.load import load_config
from node.worker.trainer import Trainer

TINY_TOML = """[train]
d_model = 32
n_layers = 1
n_heads = 2
seq_len = 32
batch_size = 4
data_bytes = 100000
eval_batches = 1
warmup = 2
lr = 0.003
inner_steps = 5
max_lag = 2
"""


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def train_and_checkpoint(home: Path) -> Trainer:
    """Two outer steps, evaluated right after the second (theta = phi then), then one more inner step so
    that the checkpoint's fast weights are not its slow weights: the export must take phi."""
    tr = Trainer(load_config(home, environ={}).train, home, "peer-a")
    for _ in range(2):
        while not tr.publish_due():
            tr.inner_step()
        tr.publish(torch.empty(tr.numel), torch.empty(tr.numel))
        tr.apply_result(ExchangeOutcome(1))
    tr.evaluate()
    tr.inner_step()
    tr.save_checkpoint()
    return tr


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Trainer]:
    home = tmp_path_factory.mktemp("home")
    (home / "config.toml").write_text(TINY_TOML)
    return home, train_and_checkpoint(home)


def test_the_safetensors_export_is_phi_and_gives_the_recorded_validation_loss(trained, tmp_path: Path, capsys) -> None:
    from safetensors.torch import load_file

    home, tr = trained
    assert main(["export", "--home", str(home), "--out", str(tmp_path / "out")]) == 0
    assert "step 11, outer step 2" in capsys.readouterr().out
    state = load_file(tmp_path / "out" / "model.safetensors")
    fresh = tr.task.build_model()
    fresh.load_state_dict(state)  # strict: every name of the model, nothing else
    flat = torch.cat([p.detach().reshape(-1).cpu() for p in fresh.parameters()])  # built on the trainer's device
    assert torch.equal(flat, tr.phi)
    assert tr.task.evaluate(fresh) == pytest.approx(tr.val_loss, abs=1e-6)
    assert tr.task.evaluate(tr.model) != pytest.approx(tr.val_loss, abs=1e-6)  # theta moved on: not exported


def test_the_torch_export_is_a_plain_state_dict_for_weights_only_load(trained, tmp_path: Path) -> None:
    home, tr = trained
    assert main(["export", "--home", str(home), "--out", str(tmp_path), "--format", "torch"]) == 0
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(state) == set(tr.model.state_dict())
    fresh = tr.task.build_model()
    fresh.load_state_dict(state)
    assert tr.task.evaluate(fresh) == pytest.approx(tr.val_loss, abs=1e-6)


def test_export_evaluate_measures_the_exported_weights(trained, tmp_path: Path, capsys) -> None:
    home, tr = trained
    assert main(["export", "--home", str(home), "--out", str(tmp_path), "--evaluate"]) == 0
    printed = re.search(r"([0-9.]+) measured on the exported weights", capsys.readouterr().out)
    # `export` evaluates on the CPU in fp32: the very loss of a CPU trainer, and the loss of a trainer on a GPU
    # (bf16 autocast there) to within that precision.
    on_cpu = tr.device.type == "cpu"
    tolerance = {"abs": 1e-6} if on_cpu else {"rel": 1e-3}
    assert printed is not None  # printed to 4 decimals
    assert float(printed.group(1)) == pytest.approx(tr.val_loss, **({"abs": 5.1e-5} if on_cpu else tolerance))
    # Issue #27: the measured loss was printed but not recorded beside the weights.
    info = json.loads((tmp_path / "starling-export.json").read_text())
    assert info["eval_loss"] == pytest.approx(tr.val_loss, **tolerance)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_every_exported_file_has_the_same_private_mode(trained, tmp_path: Path, fmt: str) -> None:
    """Issue #27: model.safetensors was 0600 but model.pt and starling-export.json 0644."""
    home, _ = trained
    old = os.umask(0o022)  # what a shell usually has: files the writer does not chmod come out 0644
    try:
        assert main(["export", "--home", str(home), "--out", str(tmp_path), "--format", fmt]) == 0
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir() if p.is_file()}
    assert len(modes) == 2 and set(modes.values()) == {0o600}, modes


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--format", "onnx"], "--format: one of safetensors, torch, hf; got 'onnx'"),
        (["--format", "hf"], "--format hf: the model of task stdlib-lm is not a Hugging Face model"),
        (["--set", "train.d_model=64"], "no checkpoint of the configured model (stdlib-lm-"),
        (["--out", "{file}/sub"], "cannot create it: Not a directory"),
        (["--set", "train.lr=lots"], "train.lr: expected a number"),
    ],
)
def test_export_errors_are_one_line_and_exit_2(trained, tmp_path: Path, capsys, args: list[str], message: str) -> None:
    home, _ = trained
    (tmp_path / "file").write_text("not a directory")
    args = [a.replace("{file}", str(tmp_path / "file")) for a in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / "out")]
    assert main(["export", "--home", str(home), *out, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_export_before_the_first_checkpoint_says_so(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.toml").write_text(TINY_TOML)
    assert main(["export", "--home", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "no checkpoint yet" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_home_trained_with_set_options_exports_without_repeating_them(group, tmp_path: Path) -> None:
    """Issue #27: `export` after `run --set train.d_model=48` said there was no checkpoint of the configured
    model unless given the same `--set` again. The daemon records the options it ran with."""
    from safetensors.torch import load_file

    from starling_testing.daemon import TINY as TINY_DAEMON
    from starling_testing.daemon import starling

    d = group.start("wide", *TINY_DAEMON, "--set", "train.d_model=48")
    d.wait_status(lambda s: (s.get("training") or {}).get("checkpoint_step") is not None, timeout=120, interval=1)
    assert d.stop() == 0
    recorded = d.home / "run-config.toml"
    assert stat.S_IMODE(recorded.stat().st_mode) == 0o600 and "d_model = 48" in recorded.read_text()
    out = tmp_path / "out"
    r = starling("export", "--home", str(d.home), "--out", str(out), timeout=120)
    assert r.returncode == 0, r.stderr
    weights = load_file(out / "model.safetensors")
    assert any(t.shape[-1] == 48 for t in weights.values())
    # A `--set` given to export still wins over what the run recorded.
    r = starling("export", "--home", str(d.home), "--out", str(tmp_path / "other"), "--set", "train.d_model=64",
                 timeout=120)
    assert r.returncode == 2 and "no checkpoint of the configured model" in r.stderr, r.stderr


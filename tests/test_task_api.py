"""The open task API (issue 15): the [task] section, optimizer and schedule hooks, gradient accumulation,
precision, the checkpoint format, and the example custom task (examples/mlp_task.py), in-process and in
two real daemons that average it."""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from node.config.load import ConfigError, load_config, render_config_file, unknown_environment
from node.config.train import TrainConfig
from node.worker.task import TaskContext, TaskError, fingerprint_digest, model_hash, resolve_precision
from node.worker.trainer import Trainer

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY = TrainConfig(d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=4, data_bytes=100_000,
                   eval_batches=1, warmup=2, lr=3e-3, inner_steps=5, max_lag=2, checkpoint_every=1)
MLP = dataclasses.replace(TINY, task="mlp_task:make_task", batch_size=8)


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
def examples_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """What README tells a user to do: put the task's directory on PYTHONPATH."""
    monkeypatch.syspath_prepend(str(EXAMPLES))


def flat(trainer: Trainer) -> torch.Tensor:
    out = torch.empty(trainer.numel)
    trainer.gather_theta(out)
    return out


# --- the [task] section -----------------------------------------------------------------------------------


def test_task_options_come_from_the_file_the_environment_and_flags_as_typed_toml_values(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('[task]\nhidden = 64\ndata = "/from/file"\n[task.model]\nn_embd = 32\n')
    cfg = load_config(tmp_path, environ={"STARLING_TASK_LAYERS": "3", "STARLING_TASK_DATA": "/from/env"},
                      overrides={"task.noise": "0.5", "task.arch": "{ n = 1 }", "task.name": "two words"})
    assert cfg.task.values == {"hidden": 64, "data": "/from/env", "model": {"n_embd": 32}, "layers": 3,
                               "noise": 0.5, "arch": {"n": 1}, "name": "two words"}
    assert cfg.to_dict()["task"] == cfg.task.values


def test_a_bad_task_option_is_refused_in_one_line_naming_it_and_its_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^task\.Hidden: option names are lower-case"):
        load_config(None, environ={}, overrides={"task.Hidden": "1"})
    (tmp_path / "config.toml").write_text("[task]\nwhen = 1979-05-27\n")
    with pytest.raises(ConfigError, match=r"config\.toml: task\.when: date values .* are not supported"):
        load_config(tmp_path, environ={})


def test_starling_task_variables_are_options_not_typos() -> None:
    assert unknown_environment({"STARLING_TASK_ANYTHING": "1"}) == []
    assert len(unknown_environment({"STARLING_TRAIN_ANYTHING": "1"})) == 1


def test_the_config_template_documents_the_task_section_and_loads_back(tmp_path: Path) -> None:
    text = render_config_file()
    assert "\n[task]\n" in text
    (tmp_path / "config.toml").write_text(text)
    assert load_config(tmp_path, environ={}).task.values == {}


def test_new_train_options_are_checked() -> None:
    with pytest.raises(ValueError, match="train.accum_steps: must divide train.batch_size"):
        dataclasses.replace(TINY, accum_steps=3).validate()
    with pytest.raises(ValueError, match="train.precision: one of auto, bf16, fp16, fp32"):
        dataclasses.replace(TINY, precision="fp8").validate()
    with pytest.raises(ValueError, match="train.weight_decay"):
        dataclasses.replace(TINY, weight_decay=-0.1).validate()


# --- the manifest -----------------------------------------------------------------------------------------


class _FakeTask:
    name = "fake"
    local_options = frozenset({"data"})

    def fingerprint(self) -> dict:
        return {"width": 8}


def test_shared_task_options_are_in_the_model_hash_and_local_ones_are_not() -> None:
    task = _FakeTask()
    assert model_hash(task, {"data": "/a", "hidden": 1}) == model_hash(task, {"data": "/b", "hidden": 1})
    assert model_hash(task, {"hidden": 1}) != model_hash(task, {"hidden": 2})
    # Without options the hash is the one before [task] existed: old checkpoints and swarms keep theirs.
    assert model_hash(task, {"data": "/a"}) == model_hash(task) == fingerprint_digest({"task": "fake", "fingerprint": {"width": 8}})


def test_the_trainer_hashes_the_task_options_it_was_given(tmp_path: Path, examples_on_path: None) -> None:
    a = Trainer(MLP, tmp_path / "a", "peer-a", {"hidden": 16})
    b = Trainer(MLP, tmp_path / "b", "peer-b", {"hidden": 16})
    c = Trainer(MLP, tmp_path / "c", "peer-a", {"hidden": 16, "noise": 0.5})
    assert a.model_hash == b.model_hash != c.model_hash
    assert a.numel == sum(p.numel() for p in a.model.parameters()) and "16" in str(a.model)


# --- optimizer, schedule, accumulation, precision ---------------------------------------------------------


def test_the_default_inner_optimizer_is_adamw_decaying_only_weight_matrices(tmp_path: Path) -> None:
    tr = Trainer(dataclasses.replace(TINY, weight_decay=0.05), tmp_path, "peer-a")
    assert type(tr.optimizer) is torch.optim.AdamW
    decay, plain = tr.optimizer.param_groups
    assert decay["weight_decay"] == 0.05 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in plain["params"])
    assert len(decay["params"]) + len(plain["params"]) == len(tr.params)


def test_the_configured_weight_decay_wins_over_the_checkpoints_after_a_restart(tmp_path: Path) -> None:
    a = Trainer(TINY, tmp_path, "peer-a")
    a.inner_step()
    a.save_checkpoint()
    b = Trainer(dataclasses.replace(TINY, weight_decay=0.2), tmp_path, "peer-a")
    assert b.resume()[0] is not None
    assert b.optimizer.param_groups[0]["weight_decay"] == 0.2
    state = next(iter(b.optimizer.state.values()))
    assert int(state["step"]) == 1  # the moments did come from the checkpoint


def test_a_format_1_checkpoint_of_plain_adam_resumes_with_its_moments(tmp_path: Path) -> None:
    old = Trainer(TINY, tmp_path, "peer-a")
    old.optimizer = torch.optim.Adam(old.params, lr=TINY.lr)  # what format 1 trained with: one group
    for _ in range(2):
        old.inner_step()
    state = old.state_dict()
    state["format"] = 1
    del state["scaler"]
    old.checkpoints.save(state, old.step)
    new = Trainer(TINY, tmp_path, "peer-a")
    assert new.resume()[0] is not None and new.step == 2
    assert type(new.optimizer) is torch.optim.AdamW and len(new.optimizer.param_groups) == 2
    for p_old, p_new in zip(old.params, new.params, strict=True):
        assert torch.equal(old.optimizer.state[p_old]["exp_avg"], new.optimizer.state[p_new]["exp_avg"])
    assert new.optimizer.param_groups[0]["weight_decay"] == TINY.weight_decay
    assert all(torch.isfinite(torch.tensor(new.inner_step())) for _ in range(2))


def test_gradient_accumulation_takes_the_step_of_the_whole_batch(tmp_path: Path) -> None:
    unclipped = dataclasses.replace(TINY, grad_clip=0.0)  # compare the raw gradients
    whole = Trainer(unclipped, tmp_path / "whole", "peer-a")
    split = Trainer(dataclasses.replace(unclipped, accum_steps=2), tmp_path / "split", "peer-a")
    assert split.task.cfg.batch_size == 2  # the task sees micro-batches
    # fp32 on the CPU: equal to rounding. On a GPU (bf16 autocast) two micro-batches round differently from
    # one batch, so there the check is to bf16's precision: a sum instead of a mean would still be 2x off.
    close = {"atol": 1e-6, "rtol": 1e-5} if whole.device.type == "cpu" else {"atol": 1e-4, "rtol": 5e-2}
    loss_tol = 1e-5 if whole.device.type == "cpu" else 2e-3
    assert whole.evaluate() == pytest.approx(split.evaluate(), abs=loss_tol)  # the same validation set
    for _ in range(3):
        assert whole.inner_step() == pytest.approx(split.inner_step(), abs=loss_tol)
        # The mean loss's gradient, not the sum's: the gradients are freed after the step, so compare what
        # AdamW kept of them (its first moment, an average of the gradients so far; a sum would double it).
        for p, q in zip(whole.params, split.params, strict=True):
            assert torch.allclose(whole.optimizer.state[p]["exp_avg"], split.optimizer.state[q]["exp_avg"], **close)
    if whole.device.type == "cpu":
        # (Not on a GPU: there AdamW's normalised step turns bf16 rounding differences in near-zero gradients
        # into lr-sized weight differences; the first moments above are the check there.)
        assert torch.allclose(flat(whole), flat(split), atol=1e-5)
    assert split.step == 3  # one inner step per whole batch


def test_precision_auto_is_bf16_on_cuda_and_fp32_on_cpu() -> None:
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert resolve_precision("auto", torch.device("cuda")) == "bf16"
    assert resolve_precision("fp16", torch.device("cpu")) == "fp16"


def test_fp16_trains_with_a_grad_scaler_whose_state_is_checkpointed(tmp_path: Path) -> None:
    a = Trainer(dataclasses.replace(TINY, precision="fp16"), tmp_path, "peer-a")
    assert a.scaler is not None and Trainer(TINY, tmp_path / "fp32", "peer-a").scaler is None
    before = flat(a)
    losses = [a.inner_step() for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert not torch.equal(before, flat(a))
    a.scaler.update(new_scale=1024.0)
    a.save_checkpoint()
    b = Trainer(dataclasses.replace(TINY, precision="fp16"), tmp_path, "peer-a")
    b.resume()
    assert b.scaler.get_scale() == 1024.0


# --- hooks and the example custom task --------------------------------------------------------------------


def test_the_example_task_chooses_its_optimizer_and_schedule_and_learns(tmp_path: Path, examples_on_path: None) -> None:
    tr = Trainer(dataclasses.replace(MLP, warmup=10), tmp_path, "peer-a", {"optimizer": "sgd", "hidden": 32})
    assert type(tr.optimizer) is torch.optim.SGD and tr.task.name == "mlp-task"
    first = tr.evaluate()
    for _ in range(40):
        tr.inner_step()
    assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(MLP.lr)  # its schedule: constant after warm-up
    assert tr.lr_at(10_000) == MLP.lr  # where the default cosine would have decayed
    assert tr.evaluate() < 0.7 * first


def test_an_optimizer_hook_that_returns_something_else_is_a_one_line_task_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, examples_on_path: None
) -> None:
    import mlp_task

    fake = types.ModuleType("bad_hook_task")

    def make(ctx: TaskContext):
        task = mlp_task.make_task(ctx)
        task.configure_optimizer = lambda model: "adam please"
        return task

    fake.make = make
    monkeypatch.setitem(sys.modules, "bad_hook_task", fake)
    with pytest.raises(TaskError, match="configure_optimizer returned str, not a torch.optim.Optimizer"):
        Trainer(dataclasses.replace(MLP, task="bad_hook_task:make"), tmp_path, "peer-a")


def test_the_example_task_names_a_bad_option(tmp_path: Path, examples_on_path: None) -> None:
    with pytest.raises(TaskError, match=r"task\.hiden: not an option of mlp-task"):
        Trainer(MLP, tmp_path, "peer-a", {"hiden": 3})
    with pytest.raises(TaskError, match=r"task\.hidden: expected an integer"):
        Trainer(MLP, tmp_path, "peer-a", {"hidden": "wide"})


@pytest.mark.slow
def test_two_daemons_average_the_example_task_and_its_export_gives_the_reported_loss(
    group, tmp_path: Path, examples_on_path: None
) -> None:
    from starling_testing.daemon import TINY as TINY_DAEMON
    from starling_testing.daemon import starling

    env = {"PYTHONPATH": str(EXAMPLES)}
    args = [*TINY_DAEMON, "--swarm", "byo", "--set", "train.task=mlp_task:make_task", "--set", "task.hidden=32",
            "--set", "train.overlap=false"]
    a = group.start("a", *args, env=env)
    b = group.start("b", *args, "--bootstrap", a.addr(), env=env)
    for d in (a, b):
        st = d.wait_status(lambda s: (s.get("training") or {}).get("exchanges", {}).get("group", 0) >= 2,
                           timeout=120, interval=1)
        assert st["training"]["task"] == "mlp-task"
    assert a.stop() == 0
    # Without overlap the validation loss is measured right after each outer step, when theta = phi: the
    # exported slow weights must give exactly the loss the daemon reported (its final checkpoint records it).
    out = tmp_path / "export"
    options = {**_set_pairs(args)}  # export builds the model from the same options as `run` had
    sets = [x for k, v in options.items() for x in ("--set", f"{k}={v}")]
    r = starling("export", "--home", str(a.home), "--out", str(out), "--evaluate", *sets, env=env)
    assert r.returncode == 0, r.stderr
    info = json.loads((out / "starling-export.json").read_text())
    assert info["task"] == "mlp-task" and info["outer_step"] >= 2
    import mlp_task
    from safetensors.torch import load_file

    cfg = load_config(a.home, environ={}, overrides=options)
    task = mlp_task.make_task(TaskContext(cfg.train, "x", torch.device("cpu"), cfg.task.values))
    model = task.build_model()
    model.load_state_dict(load_file(out / "model.safetensors"))
    assert task.evaluate(model) == pytest.approx(info["val_loss"], rel=1e-5)


def _set_pairs(args: list[str]) -> dict[str, str]:
    """The `--set key=value` pairs of a daemon's argument list (the train/task options among them)."""
    pairs = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    return {k: v for k, _, v in (p.partition("=") for p in pairs) if k.startswith(("train.", "task."))}


def test_the_default_task_refuses_task_options_it_would_ignore(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match=r"task\.hidden: stdlib-lm takes no \[task\] options"):
        Trainer(TINY, tmp_path, "peer-a", {"hidden": 3})


def test_doctor_does_not_call_task_variables_typos() -> None:
    from node.ops.doctor_local import check_environment

    findings = check_environment({"STARLING_TASK_DATA": "/srv/text", "STARLING_TRAIN_LRR": "1"})
    assert [f.message for f in findings] == ["environment variable STARLING_TRAIN_LRR is not an option and is ignored"]


def test_a_param_group_with_lr_scale_follows_the_schedule_scaled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, examples_on_path: None
) -> None:
    import mlp_task

    def make(ctx: TaskContext):
        task = mlp_task.make_task(ctx)

        def two_groups(model):
            *hidden, head = list(model.children())
            first = [p for m in hidden for p in m.parameters()]
            return torch.optim.AdamW([{"params": first}, {"params": head.parameters(), "lr_scale": 0.1}])

        task.configure_optimizer = two_groups
        return task

    fake = types.ModuleType("scaled_lr_task")
    fake.make = make
    monkeypatch.setitem(sys.modules, "scaled_lr_task", fake)
    tr = Trainer(dataclasses.replace(MLP, task="scaled_lr_task:make"), tmp_path, "peer-a")
    tr.inner_step()
    assert [g["lr"] for g in tr.optimizer.param_groups] == pytest.approx([tr.lr_at(0), 0.1 * tr.lr_at(0)])

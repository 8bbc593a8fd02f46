"""The Hugging Face causal-LM task (node/tasks/hf_causal_lm.py) at tiny size on CPU: local text, a fresh
model from a config, a local pretrained directory, a local tokenizer, `export --format hf`, and two
daemons averaging it. Nothing is downloaded: models and tokenizers are made here and saved to tmp."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]') is not installed")

from node.bridge.exchange import ExchangeOutcome
from node.cli import main  # noqa: E402
from node.config.load import load_config  # noqa: E402
from node.config.train import TrainConfig  # noqa: E402
from node.worker.task import TaskError, load_task, task_context  # noqa: E402
from node.worker.trainer import Trainer  # noqa: E402

TASK = "node.tasks.hf_causal_lm:make_task"
TINY = TrainConfig(task=TASK, seq_len=32, batch_size=4, data_bytes=60_000, eval_batches=1, warmup=2, lr=3e-3,
                   inner_steps=5, max_lag=2)
MODEL = {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2}
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A few local text files (stdlib sources: on every machine, nothing to download)."""
    out = tmp_path_factory.mktemp("text")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("os.py", "random.py", "textwrap.py", "string.py", "bisect.py", "heapq.py"):
        (out / f"{name}.txt").write_text((stdlib / name).read_text())
    return out


def options(text_dir: Path, **more) -> dict:
    return {"data": str(text_dir), "model": MODEL, **more}


def test_a_tiny_gpt2_from_a_config_learns_from_local_text(tmp_path: Path, text_dir: Path) -> None:
    tr = Trainer(TINY, tmp_path, "peer-a", options(text_dir))
    assert tr.task.name == "hf-causal-lm" and type(tr.model).__name__ == "GPT2LMHeadModel"
    assert tr.model.config.vocab_size == 256  # bytes: no tokenizer was given
    first = tr.evaluate()
    for _ in range(25):
        tr.inner_step()
    assert tr.evaluate() < first - 0.5


def test_every_peer_builds_the_same_model_and_paths_do_not_change_the_manifest(tmp_path: Path, text_dir: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in text_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    a = Trainer(TINY, tmp_path / "a", "peer-a", options(text_dir))
    b = Trainer(TINY, tmp_path / "b", "peer-b", options(copy))
    wider = Trainer(TINY, tmp_path / "c", "peer-a", options(text_dir, model={**MODEL, "n_embd": 64}))
    assert a.model_hash == b.model_hash != wider.model_hash
    assert all(torch.equal(p, q) for p, q in zip(a.params, b.params, strict=True))


def test_build_model_loads_a_local_pretrained_directory(tmp_path: Path, text_dir: Path) -> None:
    trained = Trainer(TINY, tmp_path / "a", "peer-a", options(text_dir))
    for _ in range(3):
        trained.inner_step()
    saved = tmp_path / "pretrained"
    trained.model.save_pretrained(saved)
    fresh = Trainer(TINY, tmp_path / "b", "peer-a", options(text_dir))
    tuned = Trainer(TINY, tmp_path / "c", "peer-a", {"data": str(text_dir), "pretrained": str(saved)})
    assert all(torch.equal(p, q) for p, q in zip(trained.params, tuned.params, strict=True))
    assert tuned.model_hash != fresh.model_hash  # other initial weights: never averaged with a fresh model
    assert tuned.evaluate() == pytest.approx(trained.evaluate(), abs=1e-5)


def test_a_local_tokenizer_directory_is_used(tmp_path: Path, text_dir: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    texts = [f.read_text() for f in sorted(text_dir.iterdir())]
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path / "tok")
    tr = Trainer(TINY, tmp_path / "home", "peer-a", options(text_dir, tokenizer=str(tmp_path / "tok")))
    vocab = tr.model.config.vocab_size
    assert 256 < vocab <= 400 and int(tr.task.train_ids.max()) < vocab
    assert tr.task.tokens.eos_id == tr.task.tokens.tokenizer.convert_tokens_to_ids("</s>")
    assert torch.isfinite(torch.tensor(tr.inner_step()))
    assert tr.model_hash != Trainer(TINY, tmp_path / "h2", "peer-a", options(text_dir)).model_hash


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        ({}, "task.data: hf-causal-lm needs the text to train on"),
        ({"data": "/no/such/dir"}, "task.data: /no/such/dir does not exist"),
        ({"data": "TEXT", "modle": {}}, "task.modle: not an option of hf-causal-lm"),
        ({"data": "TEXT", "model": {"n_layer": 1}}, "task.model: needs model_type"),
        ({"data": "TEXT", "model": {"model_type": "no-such-arch"}}, "task.model: ValueError"),
        ({"data": "TEXT", "model": {**MODEL, "n_positions": 16}}, "n_positions = 16 is shorter than train.seq_len"),
        ({"data": "TEXT", "data_glob": "*.md"}, "task.data: no file matches '*.md'"),
    ],
)
def test_bad_options_are_one_line_task_errors(text_dir: Path, opts: dict, message: str) -> None:
    opts = {k: (str(text_dir) if v == "TEXT" else v) for k, v in opts.items()}
    with pytest.raises(TaskError) as e:
        load_task(TASK, task_context(TINY, "peer-a", CPU, opts))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_export_hf_and_safetensors_load_and_give_the_recorded_validation_loss(tmp_path: Path, text_dir: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[train]\ntask = "{TASK}"\nseq_len = 32\nbatch_size = 4\ndata_bytes = 60000\neval_batches = 1\n'
        f'warmup = 2\nlr = 0.003\ninner_steps = 5\nmax_lag = 2\n[task]\ndata = "{text_dir}"\n'
        '[task.model]\nmodel_type = "gpt2"\nn_embd = 32\nn_layer = 1\nn_head = 2\n')
    cfg = load_config(home, environ={})
    tr = Trainer(cfg.train, home, "peer-a", cfg.task.values)
    while not tr.publish_due():
        tr.inner_step()
    tr.publish(torch.empty(tr.numel), torch.empty(tr.numel))
    tr.apply_result(ExchangeOutcome(1))
    tr.evaluate()
    tr.save_checkpoint()

    assert main(["export", "--home", str(home), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    # On the trainer's device (the task's batches are there), where the recorded loss was measured.
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).to(tr.device)
    assert tr.task.evaluate(loaded) == pytest.approx(tr.val_loss, abs=1e-5)
    assert json.loads((tmp_path / "hf" / "starling-export.json").read_text())["outer_step"] == 1

    assert main(["export", "--home", str(home), "--out", str(tmp_path / "st")]) == 0
    fresh = tr.task.build_model()
    fresh.load_state_dict(load_file(tmp_path / "st" / "model.safetensors"))  # tied head and embedding too
    assert tr.task.evaluate(fresh) == pytest.approx(tr.val_loss, abs=1e-5)


def test_without_transformers_the_task_says_which_extra_to_install(monkeypatch, text_dir: Path) -> None:
    import builtins

    real_import = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("No module named 'transformers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    with pytest.raises(TaskError, match=r"pip install 'starling\[hf\]'"):
        load_task(TASK, task_context(TINY, "peer-a", CPU, options(text_dir)))


@pytest.mark.slow
def test_two_daemons_average_the_hf_task_on_loopback(group, text_dir: Path) -> None:
    from starling_testing.daemon import TINY as TINY_DAEMON

    args = [*TINY_DAEMON, "--swarm", "hf", "--set", f"train.task={TASK}", "--set", f"task.data={text_dir}",
            "--set", "task.model={ model_type = 'gpt2', n_embd = 32, n_layer = 1, n_head = 2 }",
            "--set", "train.data_bytes=60000"]
    a = group.start("a", *args)
    b = group.start("b", *args, "--bootstrap", a.addr())
    for d in (a, b):
        st = d.wait_status(lambda s: (s.get("training") or {}).get("exchanges", {}).get("group", 0) >= 2,
                           timeout=150, interval=1)
        assert st["training"]["task"] == "hf-causal-lm" and st["training"]["loss"] is not None


@pytest.mark.slow
def test_export_hf_of_a_daemons_home_needs_no_repeated_set(group, text_dir: Path, tmp_path: Path) -> None:
    """Issue #27: `export --format hf` of a home that trained hf-causal-lm said "the model of task stdlib-lm
    is not a Hugging Face model" unless `run`'s `--set` options were given again."""
    from transformers import AutoModelForCausalLM

    from starling_testing.daemon import TINY as TINY_DAEMON
    from starling_testing.daemon import starling

    d = group.start("hf", *TINY_DAEMON, "--swarm", "hf", "--set", f"train.task={TASK}", "--set",
                    f"task.data={text_dir}", "--set", "task.model={ model_type = 'gpt2', n_embd = 32, n_layer = 1, "
                    "n_head = 2 }", "--set", "train.data_bytes=60000")
    d.wait_status(lambda s: (s.get("training") or {}).get("checkpoint_step") is not None, timeout=150, interval=1)
    assert d.stop() == 0
    out = tmp_path / "out"
    r = starling("export", "--home", str(d.home), "--out", str(out), "--format", "hf", timeout=120)
    assert r.returncode == 0, r.stderr
    assert AutoModelForCausalLM.from_pretrained(out).config.n_embd == 32


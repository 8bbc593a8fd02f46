"""The default task: stdlib corpus, split and shards, the resumable stream, the model, the task loader."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest
import torch

from node.config.train import TrainConfig
from node.tasks import stdlib_lm
from node.tasks.stdlib_lm import (
    WindowStream,
    list_sources,
    read_budget,
    shard_order,
    split_files,
    stdlib_root,
)
from node.worker.task import TaskContext, TaskError, load_task, model_hash

CPU = torch.device("cpu")
TINY = TrainConfig(d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=4, data_bytes=100_000,
                   eval_batches=2, warmup=2, lr=3e-3)


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def stdlib_files() -> list[str]:
    return list_sources(stdlib_root())


def test_the_corpus_is_the_python_files_of_the_stdlib_without_third_party_code(stdlib_files) -> None:
    assert "os.py" in stdlib_files and "json/__init__.py" in stdlib_files
    assert all(f.endswith(".py") for f in stdlib_files)
    assert not any("site-packages" in f or "__pycache__" in f for f in stdlib_files)


def test_listing_skips_site_packages_and_caches(tmp_path: Path) -> None:
    for rel in ("a.py", "pkg/b.py", "pkg/data.txt", "site-packages/evil.py", "pkg/__pycache__/c.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    assert list_sources(tmp_path) == ["a.py", "pkg/b.py"]


def test_train_and_validation_split_by_file_is_disjoint_and_deterministic(stdlib_files) -> None:
    train, val = split_files(stdlib_files, 0.05)
    assert set(train).isdisjoint(val) and set(train) | set(val) == set(stdlib_files)
    assert 0.02 < len(val) / len(stdlib_files) < 0.10
    assert split_files(list(reversed(stdlib_files)), 0.05)[1] == list(reversed(val))


def test_each_peer_gets_its_own_order_of_the_files_from_its_peer_id(stdlib_files) -> None:
    a1, a2, b = (shard_order(stdlib_files, p) for p in ("12D3KooWA", "12D3KooWA", "12D3KooWB"))
    assert a1 == a2
    assert a1 != b and sorted(a1) == sorted(b)
    assert a1[:20] != b[:20]  # different starting files, so different data under a small budget


def test_reading_stops_at_the_byte_budget(tmp_path: Path) -> None:
    for name in ("a.py", "b.py", "c.py"):
        (tmp_path / name).write_bytes(b"x" * 100)
    data = read_budget(tmp_path, ["a.py", "b.py", "c.py"], 150)
    assert len(data) <= 152 and data.count(stdlib_lm.DOC_SEPARATOR) == 2


def test_validation_text_is_the_same_for_every_peer() -> None:
    a = stdlib_lm.load_corpus("peer-a", 50_000, 0.05, 32)
    b = stdlib_lm.load_corpus("peer-b", 50_000, 0.05, 32)
    assert torch.equal(a.val, b.val)
    assert not torch.equal(a.train[:5000], b.train[:5000])


def stream_for(data: torch.Tensor, batch: int = 3) -> WindowStream:
    return WindowStream(data, seq_len=8, batch_size=batch, seed=0, peer_id="p", device=CPU)


def test_targets_are_the_inputs_shifted_by_one_byte() -> None:
    data = torch.arange(200, dtype=torch.uint8)
    x, y = stream_for(data).next_batch()
    assert x.shape == (3, 8) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y[:, -1], x[:, -1] + 1)


def test_a_restored_stream_yields_exactly_the_same_batches_across_epochs() -> None:
    data = torch.randint(0, 256, (100,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    original = stream_for(data)  # 12 windows, 3 per batch: an epoch every 4 batches
    for _ in range(5):
        original.next_batch()
    saved = original.state_dict()
    expected = [original.next_batch() for _ in range(9)]
    restored = stream_for(data)
    restored.load_state_dict(saved)
    for (x1, y1), (x2, y2) in zip(expected, (restored.next_batch() for _ in range(9)), strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert restored.epoch >= 3


def test_every_window_is_seen_once_per_epoch() -> None:
    data = torch.arange(97, dtype=torch.uint8)  # 12 windows of 8 (+1 target byte)
    stream = stream_for(data, batch=4)
    firsts = [int(v) for _ in range(3) for v in stream.next_batch()[0][:, 0]]
    assert sorted(firsts) == [8 * i for i in range(12)]


def test_the_default_model_has_a_few_million_parameters() -> None:
    cfg = TrainConfig()
    model = stdlib_lm.ByteTransformer(cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.seq_len)
    n = sum(p.numel() for p in model.parameters())
    assert 2_000_000 <= n <= 10_000_000


@pytest.fixture(scope="module")
def tiny_task():
    torch.set_num_threads(1)
    return load_task(TINY.task, TaskContext(TINY, "peer-a", CPU))


def test_every_peer_builds_the_same_initial_model_from_the_seed(tiny_task) -> None:
    other = load_task(TINY.task, TaskContext(TINY, "peer-b", CPU))
    for (n1, p1), (_, p2) in zip(tiny_task.build_model().named_parameters(),
                                 other.build_model().named_parameters(), strict=True):
        assert torch.equal(p1, p2), n1
    reseeded = dataclasses.replace(TINY, seed=1)
    third = load_task(TINY.task, TaskContext(reseeded, "peer-a", CPU)).build_model()
    assert not torch.equal(next(third.parameters()), next(tiny_task.build_model().parameters()))


def test_building_the_model_leaves_the_global_rng_alone(tiny_task) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tiny_task.build_model()
    assert torch.equal(torch.rand(3), expected)


def test_the_tiny_model_learns_within_a_few_dozen_steps(tiny_task) -> None:
    model = tiny_task.build_model()
    stream = tiny_task.train_stream()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    before = tiny_task.evaluate(model)
    for _ in range(40):
        loss = tiny_task.loss(model, stream.next_batch())
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = tiny_task.evaluate(model)
    assert before > 5.0  # ~ln(256): an untrained byte model
    assert after < before - 1.0


def test_evaluation_is_deterministic_and_keeps_the_training_mode(tiny_task) -> None:
    model = tiny_task.build_model()
    model.train()
    assert tiny_task.evaluate(model) == tiny_task.evaluate(model)
    assert model.training


def test_the_model_hash_changes_with_the_architecture_only(tiny_task) -> None:
    wider = load_task(TINY.task, TaskContext(dataclasses.replace(TINY, d_model=64), "peer-a", CPU))
    other_peer = load_task(TINY.task, TaskContext(dataclasses.replace(TINY, lr=0.1), "peer-b", CPU))
    assert model_hash(wider) != model_hash(tiny_task)
    assert model_hash(other_peer) == model_hash(tiny_task)


# --- the task loader --------------------------------------------------------------------------------------


def ctx() -> TaskContext:
    return TaskContext(TINY, "peer-a", CPU)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon_here", "expected module:function"),
        ("no_such_module_xyz:make", "cannot import 'no_such_module_xyz'"),
        ("node.tasks.stdlib_lm:no_such_factory", "has no attribute 'no_such_factory'"),
        ("node.tasks.stdlib_lm:TASK_NAME", "is not callable"),
    ],
)
def test_a_bad_task_spec_gives_a_one_line_error(spec: str, message: str) -> None:
    with pytest.raises(TaskError, match=message):
        load_task(spec, ctx())


def test_a_factory_that_returns_something_else_is_refused(monkeypatch) -> None:
    fake = types.ModuleType("fake_task_mod")
    fake.make = lambda c: object()
    fake.boom = lambda c: 1 / 0
    monkeypatch.setitem(__import__("sys").modules, "fake_task_mod", fake)
    with pytest.raises(TaskError, match="lacks name, build_model, train_stream, loss, evaluate, fingerprint"):
        load_task("fake_task_mod:make", ctx())
    with pytest.raises(TaskError, match="failed: ZeroDivisionError"):
        load_task("fake_task_mod:boom", ctx())

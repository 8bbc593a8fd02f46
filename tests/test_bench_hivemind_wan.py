"""bench/wan.py's hivemind contender, the parts that need no lab: bench/hivemind_wan.py's inner optimizer is the
trainers' (node.worker.trainer.default_optimizer, which the hivemind venv cannot import), the loss curve is the mean of
each peer's latest loss, and the timeouts grow with the slowest link. The run itself is covered by
tests/test_bench_wan.py (the lab, and bench/.venv-hivemind where it exists)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))


def test_the_inner_optimizer_is_the_trainers(bench: None) -> None:
    import hivemind_wan
    from convergence import BenchConfig

    from node.worker.task import TaskContext, load_task
    from node.worker.trainer import default_optimizer

    cfg = BenchConfig().train_config("diloco")
    model = load_task(cfg.task, TaskContext(cfg, "p", torch.device("cpu"))).build_model()
    ours, theirs = hivemind_wan.inner_optimizer(model, cfg, cfg.lr), default_optimizer(model, cfg)
    assert type(ours) is type(theirs)
    assert len(ours.param_groups) == len(theirs.param_groups) == 2
    for a, b in zip(ours.param_groups, theirs.param_groups, strict=True):
        assert [id(p) for p in a["params"]] == [id(p) for p in b["params"]]
        assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}


def test_the_curve_is_the_mean_of_each_peers_latest_loss(bench: None) -> None:
    import wan

    curve = wan.mean_curve([[(2.0, 4.0), (6.0, 2.0)], [(4.0, 3.0)]], initial=5.0)
    assert curve == [(0.0, 5.0), (2.0, 4.5), (4.0, 3.5), (6.0, 2.5)]
    assert wan.mean_curve([[], []], initial=5.0) == [(0.0, 5.0)]


def test_timeouts_grow_with_the_slowest_link_and_an_epoch_is_h_steps_of_every_peer(bench: None) -> None:
    import wan
    from convergence import BenchConfig

    bc = BenchConfig()
    fast = wan.HivemindSettings.for_links(bc, 470_000, [2.0] * 4)
    slow = wan.HivemindSettings.for_links(bc, 470_000, [2.0, 2.0, 2.0, 0.08])
    assert fast.target_batch_size == slow.target_batch_size == 4 * bc.inner_steps * bc.batch_size
    allreduce_s = 2 * 3 / 4 * 470_000 * 4 * 8 / 0.08e6
    assert slow.averaging_timeout >= 3 * allreduce_s > fast.averaging_timeout >= 60
    assert slow.next_chunk_timeout <= slow.averaging_timeout
    assert slow.request_timeout < slow.matchmaking_time  # hivemind: or matchmaking may deadlock


def test_off_leaves_hivemind_out_with_a_note(bench: None) -> None:
    import wan

    plan = wan.Plan(True, wan.bench_for("bench", True, None), "bench", 40, 20, 240, 35, ["2"], ["uniform"],
                    [("defaults", {})], hivemind="off")
    assert wan.hivemind_python(plan) == (None, "hivemind left out (--hivemind off)")
    assert dataclasses.replace(plan, hivemind="auto").hivemind == "auto"

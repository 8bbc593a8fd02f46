"""A multi-device host as one node (node/worker/group.py): a torch.distributed worker group on CPU with gloo.

The group's Delta must be the one a single process computes on the concatenated batch, every rank must
continue from the weights of the outer step, and the supervisor must restart the group as a unit."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import trio
from test_worker import TINY, alive, wait_until

from node.bridge.exchange import ExchangeOutcome, ExchangeRequest
from node.bridge.group_procs import Rendezvous
from node.bridge.supervisor import Lifetimes, WorkerSupervisor
from node.config.train import TrainConfig
from node.worker import group as worker_group
from node.worker.checkpoint import read_checkpoint
from node.worker.group import GroupTrainer, WorkerGroup, buckets, exit_group_process, group_store
from node.worker.task import TaskContext
from node.worker.trainer import Trainer
from starling_testing.daemon import TINY as TINY_DAEMON
from starling_testing.daemon import DaemonGroup

# --- a tiny task whose data is a function of the *global* batch ----------------------------------------------


class _GlobalBatches:
    """Batch i of the node is `world_size * batch_size` rows drawn from seed i; rank r takes its slice. So
    a 2-rank group with batch b and one process with batch 2b train on exactly the same sequences."""

    def __init__(self, ctx: TaskContext) -> None:
        self.ctx, self.i = ctx, 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        b, r = self.ctx.cfg.batch_size, self.ctx.rank
        g = torch.Generator().manual_seed(1000 + self.i)
        x = torch.randn(b * self.ctx.world_size, 4, generator=g)
        y = torch.randn(b * self.ctx.world_size, 3, generator=g)
        self.i += 1
        return x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = int(state["i"])


class _LinearTask:
    name = "group-linear"

    def __init__(self, ctx: TaskContext) -> None:
        self.ctx = ctx

    def build_model(self) -> torch.nn.Module:
        torch.manual_seed(self.ctx.cfg.seed)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))

    def train_stream(self) -> _GlobalBatches:
        return _GlobalBatches(self.ctx)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    def evaluate(self, model: torch.nn.Module) -> float:
        with torch.no_grad():
            return float(self.loss(model, (torch.ones(2, 4), torch.zeros(2, 3))))

    def fingerprint(self) -> dict[str, Any]:
        return {"hidden": 8}


def make_linear_task(ctx: TaskContext) -> _LinearTask:
    return _LinearTask(ctx)


LINEAR = dataclasses.replace(TINY, task=f"{__name__}:make_linear_task", device="cpu", batch_size=3,
                             lr=1e-2, warmup=1, inner_steps=3)
STEPS = 3


def _flat(trainer: Trainer) -> torch.Tensor:
    out = torch.empty(trainer.numel)
    trainer.gather_theta(out)
    return out


def _join(rank: int, directory: str, out: str) -> GroupTrainer:
    torch.set_num_threads(1)
    rendezvous = Rendezvous(Path(directory), 2)
    group = WorkerGroup.join(rendezvous, rank, LINEAR, group_store(rendezvous))
    trainer = GroupTrainer(group, LINEAR, Path(out) / "home", "peer-a")
    trainer.resume()
    return trainer


def _rank(rank: int, directory: str, out: str) -> None:
    """One rank of the 2-process group: rank 0 drives (3 inner steps, publish, a group outer step, one more
    inner step); rank 1 follows. Each saves what the parent checks."""
    worker_group.BUCKET_BYTES = 64  # several buckets per collective, even for this tiny model
    trainer = _join(rank, directory, out)
    if rank == 0:
        for _ in range(STEPS):
            trainer.inner_step()
        phi, delta = torch.empty(trainer.numel), torch.empty(trainer.numel)
        published = trainer.publish(phi, delta)
        torch.save({"delta": delta.clone(), "samples": published.samples}, Path(out) / "published.pt")
        # A partner whose slow weights are 1 higher everywhere: the outer step moves phi, and both ranks
        # must go on from the result. The Delta buffer is lent as scratch, as the worker lends its slot.
        trainer.apply_result(ExchangeOutcome(2), 2 * phi + 1, 2 * delta, scratch=delta)
        trainer.inner_step()
        trainer.save_checkpoint()  # gathers rank 1's data position too
        theta = _flat(trainer)
        trainer.close()
    else:
        assert trainer.follow() == 0
        theta = _flat(trainer)
    kept = {"phi": trainer.phi.numel(), "theta_published": trainer.theta_published.numel(),
            "momentum": trainer.outer.momentum.numel(), "scratch": trainer._scratch_buf is not None,
            "numel": trainer.numel}
    torch.save({"theta": theta, "kept": kept}, Path(out) / f"theta{rank}.pt")
    exit_group_process(0)  # as node/worker/main.py does: no finalization race with gloo's threads


@pytest.mark.slow
def test_a_two_rank_gloo_group_publishes_the_delta_of_one_process_on_the_concatenated_batch(
    tmp_path: Path,
) -> None:
    (tmp_path / "store").mkdir()
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    group = torch.load(tmp_path / "published.pt")

    single = Trainer(dataclasses.replace(LINEAR, batch_size=2 * LINEAR.batch_size), tmp_path / "single", "peer-a")
    for _ in range(STEPS):
        single.inner_step()
    phi, delta = torch.empty(single.numel), torch.empty(single.numel)
    published = single.publish(phi, delta)

    assert delta.abs().max() > 1e-3  # it trained
    torch.testing.assert_close(group["delta"], delta, rtol=1e-5, atol=1e-7)
    assert group["samples"] == published.samples == STEPS * 2 * LINEAR.batch_size
    # After the outer step every rank holds the same weights, bit for bit.
    rank0, rank1 = torch.load(tmp_path / "theta0.pt"), torch.load(tmp_path / "theta1.pt")
    assert torch.equal(rank0["theta"], rank1["theta"])
    # Only rank 0 keeps the fp32 master copies, and neither rank a model-sized scratch for the broadcast.
    n = rank0["kept"]["numel"]
    assert rank0["kept"] == {"phi": n, "theta_published": n, "momentum": n, "scratch": False, "numel": n}
    assert rank1["kept"] == {"phi": 0, "theta_published": 0, "momentum": 0, "scratch": False, "numel": n}
    ckpt = next((tmp_path / "home" / "checkpoints").rglob("ckpt-*.pt"))
    assert read_checkpoint(ckpt)["group"]["ranks"][0]["data"] == {"i": STEPS + 1}


class _TwoHeadsTask(_LinearTask):
    """Rank 1's forward also uses `extra`; no rank's uses `unused`."""

    name = "group-two-heads"

    def build_model(self) -> torch.nn.Module:
        torch.manual_seed(self.ctx.cfg.seed)
        return torch.nn.ModuleDict({"body": torch.nn.Linear(4, 3), "extra": torch.nn.Linear(4, 3),
                                    "unused": torch.nn.Linear(4, 3)})

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        out = model["body"](x)
        if self.ctx.rank == 1:
            out = out + model["extra"](x)
        return torch.nn.functional.mse_loss(out, y)


def make_two_heads_task(ctx: TaskContext) -> _TwoHeadsTask:
    return _TwoHeadsTask(ctx)


def _two_heads_rank(rank: int, directory: str, out: str) -> None:
    torch.set_num_threads(1)
    cfg = dataclasses.replace(LINEAR, task=f"{__name__}:make_two_heads_task")
    rendezvous = Rendezvous(Path(directory), 2)
    group = WorkerGroup.join(rendezvous, rank, cfg, group_store(rendezvous))
    trainer = GroupTrainer(group, cfg, Path(out) / "home", "peer-a")
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    if rank == 0:
        for _ in range(2):
            trainer.inner_step()
        trainer.close()
    else:
        trainer.follow()
    after = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    torch.save({"before": before, "after": after}, Path(out) / f"heads{rank}.pt")
    exit_group_process(0)


@pytest.mark.slow
def test_a_parameter_that_only_one_rank_uses_gets_the_same_update_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    mp.spawn(_two_heads_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = torch.load(tmp_path / "heads0.pt"), torch.load(tmp_path / "heads1.pt")
    for key, value in rank0["after"].items():
        assert torch.equal(value, rank1["after"][key]), key  # the ranks stay identical
    # Rank 1's gradient of `extra` (a zero on rank 0) moved it everywhere; `unused` had no gradient on any
    # rank, so the optimizer left it alone (a zero gradient would have let weight decay shrink it).
    assert not torch.equal(rank0["after"]["extra.weight"], rank0["before"]["extra.weight"])
    assert torch.equal(rank0["after"]["unused.weight"], rank0["before"]["unused.weight"])


def test_buckets_keep_the_order_and_cut_at_the_byte_cap_and_at_a_dtype_change() -> None:
    f32 = [torch.zeros(4), torch.zeros(4), torch.zeros(4)]  # 16 bytes each
    big, half = torch.zeros(100), torch.zeros(2, dtype=torch.bfloat16)
    tensors = [*f32, big, half, torch.zeros(1)]
    runs = list(buckets(tensors, cap_bytes=32))
    assert [[id(t) for t in run] for run in runs] == [
        [id(f32[0]), id(f32[1])], [id(f32[2])], [id(big)], [id(half)], [id(tensors[-1])]]
    assert list(buckets([], cap_bytes=32)) == []


def _nan_rank(rank: int, directory: str, out: str) -> None:
    """Rank 1's second loss is NaN: both ranks must skip that update (and neither wait for the other)."""
    trainer = _join(rank, directory, out)
    if rank == 1:
        real, calls = trainer.task.loss, [0]

        def loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
            calls[0] += 1
            return real(model, batch) * (float("nan") if calls[0] == 2 else 1.0)

        trainer.task.loss = loss  # type: ignore[method-assign]
        trainer.follow()
        losses: list[float] = []
    else:
        losses = [trainer.inner_step() for _ in range(3)]
        trainer.close()
    torch.save({"losses": losses, "skipped": trainer.skipped_steps, "theta": _flat(trainer)},
               Path(out) / f"nan{rank}.pt")
    exit_group_process(0)


@pytest.mark.slow
def test_a_non_finite_loss_on_one_rank_skips_the_update_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    mp.spawn(_nan_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = torch.load(tmp_path / "nan0.pt"), torch.load(tmp_path / "nan1.pt")
    assert [x != x for x in rank0["losses"]] == [False, True, False]  # the group's loss is the ranks' mean
    assert rank0["skipped"] == rank1["skipped"] == 1
    assert torch.equal(rank0["theta"], rank1["theta"])


def test_a_group_config_is_checked_with_one_line_errors() -> None:
    with pytest.raises(ValueError, match="train.device: with train.local_ranks > 1 use cuda or auto"):
        dataclasses.replace(TrainConfig(), local_ranks=2, device="cuda:1").validate()
    with pytest.raises(ValueError, match="train.group_backend: nccl needs CUDA"):
        dataclasses.replace(TrainConfig(), local_ranks=2, device="cpu", group_backend="nccl").validate()
    with pytest.raises(ValueError, match="train.local_ranks: must be an integer between 1 and 64"):
        dataclasses.replace(TrainConfig(), local_ranks=0).validate()


# --- the supervisor starts, serves and restarts the group as one worker ------------------------------------


@pytest.mark.slow
async def test_the_supervisor_restarts_the_whole_group_when_any_rank_dies(tmp_path: Path) -> None:
    async def twin(req: ExchangeRequest) -> ExchangeOutcome:
        # A partner identical to us: a group step of 2, as when averaging with another node.
        np.multiply(req.phi, 2, out=req.phi_out)  # the daemon's views of the slots are numpy arrays
        np.multiply(req.delta, 2, out=req.delta_out)
        return ExchangeOutcome(2)

    cfg = dataclasses.replace(TINY, device="cpu", local_ranks=2, batch_size=2)
    sup = WorkerSupervisor(cfg, tmp_path, "peer-a", twin, lifetimes=Lifetimes(backoff_initial=0.1, stop_grace=8.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await wait_until(lambda: sup.status()["exchanges"]["group"] >= 2 and sup.status()["checkpoint_step"])
        first = sup.status()["group_pids"]
        assert len(first) == 2 and first[0] == sup.status()["pid"]
        os.kill(first[1], signal.SIGKILL)  # rank 1 dies: rank 0 must go too, and both come back
        await wait_until(lambda: sup.status()["restarts"] == 1 and sup.status()["state"] == "training")
        status = sup.status()
        assert "worker rank 1 exited (killed by signal 9)" in status["error"]
        assert not alive(first[0]) and not alive(first[1])
        second = status["group_pids"]
        assert status["resumed_step"] and all(alive(pid) for pid in second)
        await wait_until(lambda: sup.status()["exchanges"]["group"] >= 3)  # and it trains on as one node
        os.kill(second[0], signal.SIGKILL)  # rank 0 dies: rank 1 must not be left behind
        await wait_until(lambda: sup.status()["restarts"] == 2 and sup.status()["state"] == "training")
        assert not alive(second[1])
        third = sup.status()["group_pids"]
        nursery.cancel_scope.cancel()
    assert not any(alive(pid) for pid in third)
    assert sup.status()["state"] == "stopped" and sup.status()["samples_per_s"] > 0


@pytest.mark.slow
def test_a_two_rank_node_averages_with_a_single_process_node(group: DaemonGroup) -> None:
    # Same sequences per inner step on both nodes (2 ranks x 2 = 4), as the swarm's pace assumes.
    pair = ["--swarm", "ranks", "--set", "train.device=cpu"]
    a = group.start("a", *TINY_DAEMON, *pair, "--set", "train.local_ranks=2", "--set", "train.batch_size=2")
    b = group.start("b", *TINY_DAEMON, *pair, "--bootstrap", a.addr())
    for node in (a, b):
        node.wait_status(lambda s: s["sync"]["rounds"] >= 2, timeout=120)
    training = a.status()["training"]
    assert training["state"] == "training" and len(training["group_pids"]) == 2
    assert training["exchanges"]["group"] >= 2

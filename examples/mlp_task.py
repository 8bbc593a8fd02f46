"""A custom Starling task, small enough to read in one sitting: an MLP that learns a fixed random function.

Run it (README: "Bring your own model"):

    PYTHONPATH=/path/to/examples starling run --set train.task=mlp_task:make_task --set task.hidden=128

Everything a task must have is here (`name`, `build_model`, `train_stream`, `loss`, `evaluate`,
`fingerprint`), settings from the `[task]` config section (`ctx.options`), and two of the optional hooks:
`configure_optimizer` (SGD with momentum when `task.optimizer = "sgd"`) and `lr_at` (warm-up, then a
constant learning rate). The data is synthetic, so there is nothing to download or ship: inputs
x ~ N(0, 1), targets y = teacher(x) + noise, where the teacher is a random MLP fixed by `train.seed`.

The rules a task must keep (node/worker/task.py):
- every peer builds the same initial model: seed it with `cfg.seed`, never with the PeerID;
- each peer's data differs: seed its stream with the PeerID too;
- the stream's position must be saved and restored exactly (here one integer: batches drawn);
- `fingerprint()` and the `[task]` options that are not in `local_options` fix the model: peers whose
  values differ never average (they are hashed into the swarm's run manifest).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from node.config.train import TrainConfig
from node.worker.task import TaskContext, TaskError, autocast

DEFAULTS: dict[str, Any] = {"in_dim": 16, "hidden": 64, "layers": 2, "noise": 0.01, "optimizer": "adamw"}


@dataclass(frozen=True)
class MLPOptions:
    in_dim: int
    hidden: int
    layers: int
    noise: float
    optimizer: str

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> MLPOptions:
        """Check `[task]`: a one-line TaskError naming the option (the daemon exits 2 with it)."""
        unknown = sorted(set(options) - set(DEFAULTS))
        if unknown:
            raise TaskError(f"task.{unknown[0]}: not an option of mlp-task (it reads {', '.join(DEFAULTS)})")
        values = {**DEFAULTS, **options}
        for name in ("in_dim", "hidden", "layers"):
            v = values[name]
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 4096:
                raise TaskError(f"task.{name}: expected an integer between 1 and 4096, got {v!r}")
        if isinstance(values["noise"], bool) or not isinstance(values["noise"], int | float) or values["noise"] < 0:
            raise TaskError(f"task.noise: expected a number >= 0, got {values['noise']!r}")
        if values["optimizer"] not in ("adamw", "sgd"):
            raise TaskError(f"task.optimizer: adamw or sgd, got {values['optimizer']!r}")
        return cls(**{**values, "noise": float(values["noise"])})


def mlp(in_dim: int, hidden: int, layers: int) -> nn.Sequential:
    mods: list[nn.Module] = []
    width = in_dim
    for _ in range(layers):
        mods += [nn.Linear(width, hidden), nn.GELU()]
        width = hidden
    mods.append(nn.Linear(width, 1))
    return nn.Sequential(*mods)


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "big")


class Stream:
    """Endless batches of (x, teacher(x) + noise); batch i is drawn from a generator seeded by
    (seed, PeerID, i), so the position is just i and a restored stream repeats exactly."""

    def __init__(self, task: MLPTask) -> None:
        self.task = task
        self.index = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(_seed("train", self.task.cfg.seed, self.task.peer_id, self.index))
        self.index += 1
        return self.task.sample(self.task.cfg.batch_size, g)

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])


class MLPTask:
    name = "mlp-task"
    local_options: frozenset[str] = frozenset()  # every option here fixes the model or its data

    def __init__(self, ctx: TaskContext, opts: MLPOptions) -> None:
        self.cfg: TrainConfig = ctx.cfg  # cfg.batch_size is the micro-batch (train.accum_steps)
        self.peer_id = ctx.peer_id
        self.device = ctx.device
        self.opts = opts
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_seed("teacher", self.cfg.seed))
            self.teacher = mlp(opts.in_dim, 32, 2).eval()
        g = torch.Generator().manual_seed(_seed("val", self.cfg.seed))  # the same on every peer
        n = max(1, self.cfg.eval_batches) * self.cfg.batch_size * ctx.accum_steps
        self.val = self.sample(n, g)

    @torch.no_grad()
    def sample(self, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, self.opts.in_dim, generator=g)
        y = self.teacher(x) + self.opts.noise * torch.randn(n, 1, generator=g)
        return x.to(self.device), y.to(self.device)

    def fingerprint(self) -> dict[str, Any]:
        return {"in_dim": self.opts.in_dim, "hidden": self.opts.hidden, "layers": self.opts.layers,
                "seed": self.cfg.seed}

    def build_model(self) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            return mlp(self.opts.in_dim, self.opts.hidden, self.opts.layers).to(self.device)

    def train_stream(self) -> Stream:
        return Stream(self)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x).float(), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> float:
        was_training = model.training
        model.eval()
        try:
            with autocast(self.device, self.cfg.precision):
                return float(self.loss(model, self.val))
        finally:
            model.train(was_training)

    # -- optional hooks --

    def configure_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """SGD with momentum on request; otherwise Starling's default AdamW (weight decay on matrices)."""
        if self.opts.optimizer == "sgd":
            return torch.optim.SGD(model.parameters(), lr=self.cfg.lr, momentum=0.9)
        from node.worker.trainer import default_optimizer

        return default_optimizer(model, self.cfg)

    def lr_at(self, step: int) -> float:
        """Linear warm-up over `train.warmup` steps, then constant (no cosine decay)."""
        return self.cfg.lr * min(1.0, (step + 1) / max(1, self.cfg.warmup))


def make_task(ctx: TaskContext) -> MLPTask:
    """The factory named by `train.task = "mlp_task:make_task"`."""
    return MLPTask(ctx, MLPOptions.parse(ctx.options))

"""The `[train]` section of config.toml: what the local torch worker trains and how.

Only plain types (int, float, str, bool) so every option maps to TOML, `STARLING_TRAIN_*` environment
variables and `--set train.x=...` flags. This module must not import torch: the daemon loads its config
long before (and sometimes without) starting a worker.

Defaults follow the NoLoCo paper where it says something (H = 50, alpha 0.5, beta 0.7, gamma 0.7, grad
clip 1.0, warm-up then cosine to 0.1x) and are sized so the default `stdlib-lm` task trains visibly on a
2-core CPU: a ~3.4M-parameter byte-level transformer whose loss falls within minutes. One departure: the
inner optimizer is AdamW with a small decoupled weight decay (0.01, on weight matrices only) where the
paper uses plain Adam. At lr 1e-3 that shrinks a weight by 1e-5 per step, invisible over the default
task's short runs, yet it keeps weights bounded over the long runs of real models; `weight_decay = 0`
is the paper's Adam.

Task-specific settings (a data path, a hidden size) are not here but in the free-form `[task]` section
(node/config/load.py, `TaskOptions`), which is handed to the task as it is.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from node.config.base import opt

# "package.module:function" - the factory that builds the task (see node/worker/task.py).
_TASK_SPEC = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:[0-9]+)$")
OUTER_KINDS = ("noloco", "diloco")
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
GROUP_BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class TrainConfig:
    task: str = opt("node.tasks.stdlib_lm:make_task", "training task as module:function returning a Task")
    device: str = opt("auto", "auto | cpu | cuda | cuda:N (auto = cuda when present, else cpu)")
    threads: int = opt(1, "torch CPU threads in the worker (leave cores for the daemon)")
    outer_threads: int = opt(0, "torch CPU threads for the outer step's host work (publish, apply, rebase over the "
                             "fp32 master copies); 0 = auto: on CUDA half this machine's cores up to 8 (the inner "
                             "steps need none there), on the CPU train.threads")
    local_ranks: int = opt(1, "worker processes on this host trained as one node (torch.distributed; with CUDA rank r uses cuda:r)")
    group_backend: str = opt("auto", "auto | gloo | nccl: the worker group's backend when local_ranks > 1 (auto = nccl on CUDA, gloo on CPU)")
    seed: int = opt(0, "seed for the initial weights (same on every peer) and the data order")
    inner_steps: int = opt(50, "H: inner optimizer steps between two outer steps")
    outer: str = opt("noloco", "outer optimizer: noloco | diloco (diloco alone = solo heavy-ball step)")
    alpha: float = opt(0.5, "outer momentum (alpha)")
    beta: float = opt(0.7, "outer learning rate (beta)")
    gamma: float = opt(0.7, "NoLoCo pull towards the group's mean slow weights (gamma)")
    lr: float = opt(1e-3, "peak inner learning rate (AdamW, or the task's own optimizer)")
    weight_decay: float = opt(0.01, "AdamW decoupled weight decay on weight matrices (biases, norms: none; 0 = Adam)")
    warmup: int = opt(100, "inner steps of linear learning-rate warm-up")
    total_steps: int = opt(20000, "inner steps of the cosine decay; the lr stays at its floor afterwards")
    min_lr_ratio: float = opt(0.1, "floor of the cosine schedule as a fraction of lr")
    grad_clip: float = opt(1.0, "gradient-norm clip for the inner steps (0 = off)")
    batch_size: int = opt(16, "sequences per inner step")
    accum_steps: int = opt(1, "micro-batches each inner step is split into (must divide batch_size; saves memory)")
    precision: str = opt("auto", "auto | bf16 | fp16 | fp32 autocast (auto = bf16 on CUDA, fp32 on CPU; fp16 adds a GradScaler)")
    seq_len: int = opt(128, "tokens (bytes) per sequence")
    d_model: int = opt(256, "transformer width")
    n_layers: int = opt(4, "transformer blocks")
    n_heads: int = opt(4, "attention heads (must divide d_model)")
    data_bytes: int = opt(8_000_000, "bytes of training text this peer reads (caps start-up time and memory)")
    val_fraction: float = opt(0.05, "fraction of source files held out for validation (chosen by file)")
    eval_every: int = opt(1, "outer steps between two validation-loss measurements")
    eval_batches: int = opt(4, "validation batches per measurement")
    overlap: bool = opt(True, "keep training while the outer exchange runs (false = wait for it)")
    max_lag: int = opt(0, "most inner steps an outer result may lag behind its publish before training waits "
                       "for it (0 = never wait: on a slow link the outer step lasts as long as its exchange)")
    exchange_timeout: float = opt(7200.0, "seconds one outer exchange may take before a solo step is used (a last "
                                  "resort: the exchange's own deadlines, sync.stall_timeout_s and "
                                  "sync.max_transfer_s, end a dead one long before)")
    checkpoint_every: int = opt(5, "outer steps between two checkpoints")
    checkpoint_min_s: float = opt(30.0, "least seconds between two checkpoints, whatever checkpoint_every says "
                                  "(outer steps of a tiny model take well under a second; 0 = no floor)")
    checkpoints_keep: int = opt(3, "checkpoints kept on disk (older ones are deleted)")
    tensorboard_dir: str = opt("", "TensorBoard event files of this node's training and averaging, one point per "
                               "outer step ('' = off; a relative path is under HOME): `tensorboard --logdir` it")
    wandb_dir: str = opt("", "an offline Weights & Biases run of this node's training and averaging, one point per outer "
                         "step ('' = off; a relative path is under HOME; needs `pip install 'starling[wandb]'`; "
                         "nothing is sent: `wandb sync` it)")

    def validate(self) -> None:
        """Raise ValueError("train.<field>: why") for the first bad option."""
        if "\0" in self.tensorboard_dir:
            raise ValueError("train.tensorboard_dir: a path cannot hold a NUL character")
        if "\0" in self.wandb_dir:
            raise ValueError("train.wandb_dir: a path cannot hold a NUL character")
        if not _TASK_SPEC.match(self.task):
            raise ValueError("train.task: expected module:function, e.g. node.tasks.stdlib_lm:make_task")
        if not _DEVICE.match(self.device):
            raise ValueError("train.device: one of auto, cpu, cuda, cuda:N")
        _int_range("threads", self.threads, 1, 256)
        _int_range("outer_threads", self.outer_threads, 0, 256)
        _int_range("local_ranks", self.local_ranks, 1, 64)
        if self.group_backend not in GROUP_BACKENDS:
            raise ValueError(f"train.group_backend: one of {', '.join(GROUP_BACKENDS)}, got {self.group_backend!r}")
        if self.local_ranks > 1 and self.device.startswith("cuda:"):
            raise ValueError("train.device: with train.local_ranks > 1 use cuda or auto (rank r runs on cuda:r;"
                             " choose the GPUs with CUDA_VISIBLE_DEVICES)")
        if self.group_backend == "nccl" and self.device == "cpu":
            raise ValueError("train.group_backend: nccl needs CUDA devices; use gloo (or auto) with train.device = cpu")
        _int_range("seed", self.seed, 0, 2**63 - 1)
        _int_range("inner_steps", self.inner_steps, 1, 1_000_000)
        if self.outer not in OUTER_KINDS:
            raise ValueError(f"train.outer: one of {', '.join(OUTER_KINDS)}")
        _float_range("alpha", self.alpha, 0.0, 1.0, high_open=True)
        _float_range("beta", self.beta, 0.0, 10.0, low_open=True)
        _float_range("gamma", self.gamma, 0.0, 10.0)
        _float_range("lr", self.lr, 0.0, 1.0, low_open=True)
        _int_range("warmup", self.warmup, 0, 100_000_000)
        _int_range("total_steps", self.total_steps, 1, 10**12)
        if self.warmup >= self.total_steps:
            raise ValueError("train.warmup: must be smaller than train.total_steps")
        _float_range("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _float_range("weight_decay", self.weight_decay, 0.0, 1.0)
        _float_range("grad_clip", self.grad_clip, 0.0, 1e6)
        _int_range("batch_size", self.batch_size, 1, 65536)
        _int_range("accum_steps", self.accum_steps, 1, 65536)
        if self.batch_size % self.accum_steps:
            raise ValueError(f"train.accum_steps: must divide train.batch_size ({self.batch_size}), got {self.accum_steps}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision: one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        _int_range("seq_len", self.seq_len, 2, 65536)
        _int_range("d_model", self.d_model, 1, 65536)
        _int_range("n_layers", self.n_layers, 1, 1024)
        _int_range("n_heads", self.n_heads, 1, 1024)
        if self.d_model % self.n_heads:
            raise ValueError("train.n_heads: must divide train.d_model")
        _int_range("data_bytes", self.data_bytes, 4096, 2**40)
        _float_range("val_fraction", self.val_fraction, 0.0, 0.5, low_open=True)
        _int_range("eval_every", self.eval_every, 1, 1_000_000)
        _int_range("eval_batches", self.eval_batches, 1, 10_000)
        _int_range("max_lag", self.max_lag, 0, 1_000_000_000)
        _float_range("exchange_timeout", self.exchange_timeout, 0.1, 86400.0)
        _int_range("checkpoint_every", self.checkpoint_every, 1, 1_000_000)
        _float_range("checkpoint_min_s", self.checkpoint_min_s, 0.0, 86400.0)
        _int_range("checkpoints_keep", self.checkpoints_keep, 1, 1000)


def _int_range(name: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"train.{name}: must be an integer between {low} and {high}, got {value!r}")


def _float_range(
    name: str, value: float, low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
        raise ValueError(f"train.{name}: must be a number in {lo}{low}, {high}{hi}, got {value!r}")

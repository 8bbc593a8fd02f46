"""What a training task provides, and how `train.task = "module:function"` is turned into one.

A task is anything with the members of `Task` below: a model, this peer's data stream, the loss and an
evaluation. The factory named in config is called with a `TaskContext` (the train config, this node's
PeerID and the torch device) and returns the task. Sharding needs no global rank: a task derives its
shard from the PeerID (the default task orders the file list by a hash of PeerID and path), so any number
of peers can join without coordination.

Every peer must build the *same* initial model (NoLoCo averages weights position by position), so
`build_model` must be deterministic given the config - seed it with `cfg.seed`, never with the PeerID.
`fingerprint()` names everything that fixes the model's architecture; peers whose fingerprints differ
cannot average and must not pair (the daemon puts its hash in the run manifest). So do the task's own
settings (the `[task]` config section, `TaskContext.options`): every one of them is hashed into the
manifest, except those the task names in `local_options` (paths to this machine's data, which may differ
from peer to peer).

Optional hooks (`TaskHooks`; a task without them gets the defaults): `configure_optimizer(model)` for the
inner optimizer (default AdamW, node/worker/trainer.py `default_optimizer`), `lr_at(step)` for the learning-rate
schedule (default warm-up + cosine, node/worker/trainer.py `lr_at`) and `save_pretrained(model, directory)` for
`starling export --format hf`. Gradient accumulation and precision are config (`train.accum_steps`,
`train.precision`): the trainer does them for every task, so a task only ever sees micro-batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from node.bridge.exchange import Layout
from node.config.train import TrainConfig


class TaskError(Exception):
    """The configured task cannot be loaded or built; the message is one line for the operator."""


@dataclass(frozen=True)
class TaskContext:
    """What a task factory is given.

    `cfg.batch_size` is the *micro*-batch: `train.batch_size / train.accum_steps` sequences, what one
    `next_batch()` must yield (the trainer accumulates `accum_steps` of them into one inner step).
    `accum_steps` is there for a task that wants its validation set independent of it (the default task
    evaluates `eval_batches * batch_size * accum_steps` sequences, the same set whatever the split).
    `options` is the `[task]` config section as it was given (plain TOML values).
    `rank` / `world_size`: this process's place in the node's worker group (`train.local_ranks`,
    node/worker/group.py); each rank must draw a different shard. `peer_id` already differs per rank
    (`<PeerID>/rank<r>` for r > 0), so a task that shards by PeerID needs nothing more; `cfg.batch_size`
    stays per rank (the node's inner step covers `world_size` times as many sequences).
    """

    cfg: TrainConfig
    peer_id: str
    device: torch.device
    options: Mapping[str, Any] = field(default_factory=dict)
    accum_steps: int = 1
    rank: int = 0
    world_size: int = 1


@runtime_checkable
class DataStream(Protocol):
    """An endless stream of training batches whose position can be saved and restored exactly."""

    def next_batch(self) -> Any:
        """The next batch, already on the task's device."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The stream's position (plain ints/strings/tensors, so it fits a weights-only checkpoint)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...


@runtime_checkable
class Task(Protocol):
    name: str  # short task name for status and the manifest, e.g. "stdlib-lm"

    def build_model(self) -> torch.nn.Module:
        """A fresh model, identical on every peer for the same config, on the task's device."""
        ...

    def train_stream(self) -> DataStream:
        """This peer's shard of the training data."""
        ...

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """Scalar training loss of `model` on `batch` (the caller handles autocast and backward)."""
        ...

    def evaluate(self, model: torch.nn.Module) -> float:
        """Validation loss on a fixed held-out set (the same on every peer and every call)."""
        ...

    def fingerprint(self) -> dict[str, Any]:
        """JSON-able description of everything that fixes the model's architecture."""
        ...


def task_context(cfg: TrainConfig, peer_id: str, device: torch.device,
                 options: Mapping[str, Any] | None = None, *, rank: int = 0, world_size: int = 1) -> TaskContext:
    """The context a task is built with: `cfg` with `batch_size` cut to the micro-batch (see TaskContext)."""
    micro = dataclasses.replace(cfg, batch_size=cfg.batch_size // cfg.accum_steps)
    return TaskContext(micro, peer_id, device, dict(options or {}), cfg.accum_steps, rank, world_size)


class TaskHooks(Protocol):
    """Optional members of a task; the trainer uses each one a task has, and its default otherwise."""

    #: `[task]` option names that may differ between peers (local data paths): left out of the manifest.
    local_options: frozenset[str]

    def configure_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """The inner optimizer over the model's trainable parameters. The trainer sets each param group's
        `lr` before every step (to `lr_at(step)` times the group's `lr_scale`, if it has one); every other
        hyperparameter is the task's, and wins over what a resumed checkpoint held."""
        ...

    def lr_at(self, step: int) -> float:
        """The learning rate of inner step `step` (counted from 0 over the node's whole run)."""
        ...

    def save_pretrained(self, model: torch.nn.Module, directory: Path) -> None:
        """Write the model (and its tokenizer, say) for `starling export --format hf`."""
        ...


def load_task(spec: str, ctx: TaskContext) -> Task:
    """Import `module:function`, call it with `ctx` and check the result is a Task; TaskError otherwise."""
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise TaskError(f"train.task: expected module:function, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise TaskError(f"train.task: cannot import {module_name!r}: {e}") from e
    except Exception as e:
        raise TaskError(f"train.task: importing {module_name!r} failed: {type(e).__name__}: {e}") from e
    factory = getattr(module, func_name, None)
    if factory is None:
        raise TaskError(f"train.task: module {module_name!r} has no attribute {func_name!r}")
    if not callable(factory):
        raise TaskError(f"train.task: {spec!r} is not callable")
    try:
        task = factory(ctx)
    except TaskError:
        raise
    except Exception as e:
        raise TaskError(f"train.task: {spec} failed: {type(e).__name__}: {e}") from e
    if not isinstance(task, Task):
        missing = [m for m in ("name", "build_model", "train_stream", "loss", "evaluate", "fingerprint")
                   if not hasattr(task, m)]
        raise TaskError(f"train.task: {spec} returned {type(task).__name__}, which lacks {', '.join(missing)}")
    return task


def resolve_precision(precision: str, device: torch.device) -> str:
    """`train.precision` as used on `device`: `auto` is bf16 on CUDA (the fast path on modern GPUs, no
    loss scaling needed) and fp32 elsewhere (CPU autocast is rarely faster, and fp32 is exact)."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str = "auto") -> contextlib.AbstractContextManager[Any]:
    """The autocast context for `train.precision` on `device` (fp32: none). Weights, gradients and the
    optimizer stay fp32 whatever the precision: only the forward pass runs in bf16/fp16."""
    dtype = _AUTOCAST_DTYPES.get(resolve_precision(precision, device))
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


Batch = tuple[torch.Tensor, torch.Tensor]


def fixed_val_batches(ids: torch.Tensor, cfg: TrainConfig, accum_steps: int, device: torch.device) -> list[Batch]:
    """Evenly spaced (input, target) windows of a token sequence, the same at every evaluation and for
    every `accum_steps` (in micro-batch sized batches, so evaluation fits where training does): what the
    language-model tasks evaluate on."""
    n = cfg.eval_batches * cfg.batch_size * accum_steps
    windows = (len(ids) - 1) // cfg.seq_len
    starts = torch.linspace(0, windows - 1, n).long() * cfg.seq_len
    chunk = ids[starts.unsqueeze(1) + torch.arange(cfg.seq_len + 1)].long()
    xs, ys = chunk[:, :-1].to(device), chunk[:, 1:].to(device)
    return [(xs[i : i + cfg.batch_size], ys[i : i + cfg.batch_size]) for i in range(0, n, cfg.batch_size)]


@torch.no_grad()
def mean_loss(task: Task, model: torch.nn.Module, batches: list[Batch], device: torch.device, precision: str) -> float:
    """The task's mean loss over fixed batches, in eval mode (restored after) and the run's precision."""
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        with autocast(device, precision):
            for batch in batches:
                total += float(task.loss(model, batch))
        return total / len(batches)
    finally:
        model.train(was_training)


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; an explicit `cuda` without a GPU is a configuration error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:  # a string torch does not know: name it, not torch's list of backends
        raise TaskError(f"train.device: {name!r} is not a torch device ({str(e).splitlines()[0]})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise TaskError(f"train.device: {name} requested but no CUDA device is available")
        count = torch.cuda.device_count()
        # torch only fails at the first tensor moved there, deep inside the task: say it here instead.
        if device.index is not None and device.index >= count:
            raise TaskError(f"train.device: {name} requested but this machine has {count} CUDA device(s)"
                            f" (cuda:0..cuda:{count - 1})")
    return device


def param_layout(model: torch.nn.Module) -> Layout:
    """Names and shapes of the trainable parameters, in the order the flat vectors use."""
    return [(name, tuple(p.shape)) for name, p in model.named_parameters() if p.requires_grad]


def fingerprint_digest(obj: Any) -> str:
    """The hex SHA-256 of `obj`'s canonical JSON (sorted keys, no spaces): what the model and layout hashes
    are, so that every peer computes them alike from the same values."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def shared_options(task: Task, options: Mapping[str, Any]) -> dict[str, Any]:
    """The `[task]` options that must be equal on peers that average: all but the task's `local_options`."""
    local = frozenset(getattr(task, "local_options", ()) or ())
    return {k: v for k, v in options.items() if k not in local}


def model_hash(task: Task, options: Mapping[str, Any] | None = None) -> str:
    """Hash of the task name, its architecture fingerprint and its shared `[task]` options: equal on peers
    that can average. Without options the hash is what it was before `[task]` existed, so that existing
    checkpoints (whose directory is named by it) and swarms keep theirs."""
    body: dict[str, Any] = {"task": task.name, "fingerprint": task.fingerprint()}
    shared = shared_options(task, options or {})
    if shared:
        body["options"] = shared
    return fingerprint_digest(body)


def layout_hash(layout: Layout) -> str:
    """Hash of parameter names and shapes: a cheap check that flat vectors line up between peers."""
    return fingerprint_digest([[name, list(shape)] for name, shape in layout])


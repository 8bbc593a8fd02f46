"""What a training task provides, and how `train.task = "module:function"` is turned into one.

A task is anything with the members of `Task` below: a model, this peer's data stream, the loss and an
evaluation. The factory named in config is called with a `TaskContext` (the train config, this node's
PeerID and the torch device) and returns the task. Sharding needs no global rank: a task derives its
shard from the PeerID (the default task orders the file list by a hash of PeerID and path), so any number
of peers can join without coordination.

Every peer must build the *same* initial model (NoLoCo averages weights position by position), so
`build_model` must be deterministic given the config - seed it with `cfg.seed`, never with the PeerID.
`fingerprint()` names everything that fixes the model's architecture; peers whose fingerprints differ
cannot average and must not pair (the daemon puts its hash in the run manifest).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from node.train_config import TrainConfig


class TaskError(Exception):
    """The configured task cannot be loaded or built; the message is one line for the operator."""


@dataclass(frozen=True)
class TaskContext:
    """What a task factory is given."""

    cfg: TrainConfig
    peer_id: str
    device: torch.device


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


def autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on CUDA (the fast path on modern GPUs), plain fp32 elsewhere."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; an explicit `cuda` without a GPU is a configuration error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TaskError(f"train.device: {name} requested but no CUDA device is available")
    return device


Layout = list[tuple[str, tuple[int, ...]]]


def param_layout(model: torch.nn.Module) -> Layout:
    """Names and shapes of the trainable parameters, in the order the flat vectors use."""
    return [(name, tuple(p.shape)) for name, p in model.named_parameters() if p.requires_grad]


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def model_hash(task: Task) -> str:
    """Hash of the task name and its architecture fingerprint: equal on peers that can average."""
    return _digest({"task": task.name, "fingerprint": task.fingerprint()})


def layout_hash(layout: Layout) -> str:
    """Hash of parameter names and shapes: a cheap check that flat vectors line up between peers."""
    return _digest([[name, list(shape)] for name, shape in layout])


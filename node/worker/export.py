"""`starling export`: the slow weights of a node's latest checkpoint, as files any torch user can load.

A checkpoint (node/worker/checkpoint.py) is Starling's whole training state behind a hashed header, so a plain
`torch.load` cannot read it, and it holds the weights twice: the fast weights `theta` and the slow weights
`phi`. What a user wants from a run is `phi`, the weights the swarm agrees on (every outer step pulls
each node's `phi` towards its partners'; `theta` is where this node's inner steps have wandered since).
So the export is `phi` in the model's own parameter names:

- `safetensors` (default): `DIR/model.safetensors`, for `safetensors.torch.load_file`;
- `torch`: `DIR/model.pt`, a plain `torch.save` of the state dict (`torch.load(weights_only=True)`);
- `hf`: the task's `save_pretrained` (the Hugging Face task: model and tokenizer), for `from_pretrained`.

Beside it, `DIR/starling-export.json` says where the weights came from (checkpoint, steps, task, model
hash, the validation loss the node recorded, and with `--evaluate` the loss measured on the exported
weights, `eval_loss`). Every file written is private (mode 0600, as the checkpoints are): a run's weights
are shared on purpose, with `chmod`.

How: the task is built as the worker builds it (from HOME's config, on the CPU), its model gets the
checkpoint's state and then `phi` in its trainable parameters; buffers come from the checkpoint's model.
Building the task is what maps the flat `phi` back to names (tied weights included), and it is the only
way to `save_pretrained`. It reads the task's data too (the default task: a few MB of the stdlib), which
`--evaluate` then uses to measure the exported weights. Only reads HOME, so it is safe beside a running
daemon.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from node.config.home import Home
from node.config.load import Config
from node.worker.checkpoint import CheckpointError, list_checkpoints, read_checkpoint
from node.worker.task import TaskError, layout_hash, load_task, model_hash, param_layout, task_context
from p2p.fsutil import unwritable_reason

FORMATS = ("safetensors", "torch", "hf")
WEIGHT_FILES = {"safetensors": "model.safetensors", "torch": "model.pt"}
INFO_FILE = "starling-export.json"
#: Every exported file's mode: private, as the checkpoints it comes from (share it with `chmod` on purpose).
EXPORT_FILE_MODE = 0o600


class ExportError(Exception):
    """Why nothing was exported; one line for the operator (exit code 2)."""


@dataclass
class ExportResult:
    """What was written, and from which checkpoint."""

    checkpoint: Path
    step: int
    outer_step: int
    val_loss: float | None  # as the node recorded it with the checkpoint
    files: list[Path]
    eval_loss: float | None = None  # of the exported weights, with --evaluate


def export_weights(home: Path, out: Path, fmt: str, cfg: Config, *, evaluate: bool = False) -> ExportResult:
    """Write the slow weights of HOME's newest good checkpoint of the configured model to `out`."""
    if fmt not in FORMATS:
        raise ExportError(f"--format: one of {', '.join(FORMATS)}; got {fmt!r}")
    root = Home(home).checkpoints
    if not root.is_dir() or not any(root.iterdir()):
        raise ExportError(f"{home}: no checkpoint yet (a trainer writes one every train.checkpoint_every outer "
                          "steps, and when it stops)")
    train = dataclasses.replace(cfg.train, device="cpu")  # never take a GPU from a running worker
    options = dict(cfg.sections["task"].values) if "task" in cfg.sections else {}
    task = load_task(train.task, task_context(train, "export", torch.device("cpu"), options))
    try:
        model = task.build_model()
    except TaskError:
        raise
    except Exception as e:  # the task's own bug: one line here, as the worker's restart reason would be
        raise ExportError(f"{task.name}.build_model failed: {type(e).__name__}: {e}") from e
    if fmt == "hf" and not (hasattr(task, "save_pretrained") or hasattr(model, "save_pretrained")):
        raise ExportError(f"--format hf: the model of task {task.name} is not a Hugging Face model; "
                          "use --format safetensors or torch")
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    mhash, lhash = model_hash(task, options), layout_hash(param_layout(model))
    directory = Home(home).model_checkpoints(task.name, mhash)
    state, path = _newest_state(directory, mhash, lhash, sum(p.numel() for p in params))

    try:
        model.load_state_dict(state["model"])  # buffers, and theta until phi replaces it below
    except (RuntimeError, KeyError) as e:
        raise ExportError(f"{path}: does not load into the model: {str(e).splitlines()[0]}") from None
    phi = state["phi"].reshape(-1)
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(phi[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    model.eval()

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"--out {out}: cannot create it: {e.strerror or e}") from None
    problem = unwritable_reason(out)
    if problem:
        raise ExportError(f"--out {out}: cannot write there: {problem}")
    result = ExportResult(checkpoint=path, step=int(state["step"]), outer_step=int(state["outer_step"]),
                          val_loss=state.get("val_loss"), files=[])
    info = {"task": task.name, "train.task": train.task, "model_hash": mhash, "checkpoint": str(path),
            "step": result.step, "outer_step": result.outer_step, "val_loss": result.val_loss,
            "weights": "phi (slow weights)", "format": fmt, "task_options": options}
    if evaluate:  # before anything is written, so that starling-export.json records it
        result.eval_loss = info["eval_loss"] = float(task.evaluate(model))
    try:
        result.files = _write(task, model, out, fmt, info)
        info_path = out / INFO_FILE
        info_path.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        result.files.append(info_path)
        for path in result.files:  # one mode for all, whatever the writer's (save_pretrained's) umask
            os.chmod(path, EXPORT_FILE_MODE)
    except OSError as e:
        raise ExportError(f"--out {out}: writing failed: {e.strerror or e}") from None
    return result


def _newest_state(directory: Path, mhash: str, lhash: str, numel: int) -> tuple[dict[str, Any], Path]:
    """The newest checkpoint in `directory` that verifies and is of this model; ExportError otherwise."""
    if not directory.is_dir() or not list_checkpoints(directory):
        others = sorted(p.name for p in directory.parent.iterdir() if p.is_dir() and p != directory)
        seen = f"; there are checkpoints of {', '.join(others)}: was the model's config changed?" if others else ""
        raise ExportError(f"no checkpoint of the configured model ({directory.name}) in {directory.parent} yet{seen}")
    reasons = []
    for _, path in list_checkpoints(directory):
        try:
            state = read_checkpoint(path)
        except CheckpointError as e:  # corrupt, or deleted by the running worker's rotation meanwhile
            reasons.append(f"{path.name}: {e}")
            continue
        phi = state.get("phi")
        if state.get("model_hash") != mhash or state.get("layout_hash") != lhash:
            reasons.append(f"{path.name}: of a different model")
        elif not isinstance(phi, torch.Tensor) or phi.numel() != numel or not isinstance(state.get("model"), dict):
            reasons.append(f"{path.name}: lacks the slow weights")
        else:
            return state, path
    raise ExportError(f"no readable checkpoint in {directory}: {'; '.join(reasons)}")


def _write(task: Any, model: torch.nn.Module, out: Path, fmt: str, info: dict[str, Any]) -> list[Path]:
    if fmt == "hf":
        if hasattr(task, "save_pretrained"):
            task.save_pretrained(model, out)
        else:
            model.save_pretrained(str(out))  # type: ignore[operator]
        return sorted(p for p in out.iterdir() if p.is_file() and p.name != INFO_FILE)
    # Own copies: tied parameters (an LM head sharing the embedding) become two plain tensors, which
    # safetensors requires and every loader's load_state_dict accepts.
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in model.state_dict().items()}
    target = out / WEIGHT_FILES[fmt]
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file

            meta = {k: json.dumps(v) if not isinstance(v, str) else v for k, v in info.items()}
            save_file(tensors, str(tmp), metadata=meta)
        else:
            torch.save(tensors, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return [target]

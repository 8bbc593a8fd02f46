"""Atomic, hashed checkpoints of the worker's whole training state, last N kept (the worker's side: torch).

The file format is `node.bridge.ckptfile`'s: a hashed header, then the slow weights `phi` as raw float32 with a
msgpack map of their counters, then a `torch.save` payload of the rest of the state. `phi` is apart so that
the daemon, which imports no torch, can serve it to late joiners (`node.bridge.ckptfile.read_phi`) and leave the
swarm's weights for the worker (`node.bridge.ckptfile.write_phi`), which reads them here as a state dict.
`read_checkpoint` returns the state as it was saved, from current (format 2) and older (format 1: one
`torch.save` of everything) files alike; a corrupt or truncated file is a CheckpointError, and the store
sets it aside as `*.corrupt` and falls back to the previous checkpoint.

Writing is atomic (temp file, fsync, rename, directory fsync). Loading uses
`torch.load(weights_only=True)`, so a planted file cannot run code.

Permissions: checkpoint files are 0600 and their folders 0700, whatever the umask (a checkpoint is the
whole model and optimizer state); a store opened on an older, world-readable folder tightens it.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from node.bridge.ckptfile import (
    MAGIC_V1,
    MAGIC_V2,
    PHI_DTYPE,
    TMP_PREFIX,
    CheckpointError,
    HashingWriter,
    read_file,
    write_file,
)
from node.config.home import checkpoint_name, checkpoint_step
from p2p.fsutil import PRIVATE_FILE_MODE, private_dir

__all__ = [
    "MAGIC", "MAGIC_V1", "MAGIC_V2", "CheckpointError", "CheckpointStore", "LoadResult", "LoadedCheckpoint",
    "list_checkpoints", "read_checkpoint", "write_checkpoint",
]

log = logging.getLogger("starling.checkpoint")

MAGIC = MAGIC_V2  # what write_checkpoint writes
_COUNTERS = ("step", "outer_step", "layout_hash")  # also in the meta, where the daemon reads them


@dataclass
class LoadedCheckpoint:
    """One verified checkpoint."""

    state: dict[str, Any]
    path: Path
    step: int


@dataclass
class LoadResult:
    """The newest good checkpoint (None if there is none) and the newer files rejected on the way, with why."""

    checkpoint: LoadedCheckpoint | None
    rejected: list[tuple[Path, str]] = field(default_factory=list)


def write_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write `state` to `path` atomically (temp file + fsync + rename + directory fsync), in format 2:
    `state["phi"]` (a plain float32 tensor) in the raw section, with the counters in the meta; the rest of
    the state in the torch payload. A state without such a phi is all payload.

    A float32 numpy phi goes to the raw section too (and reads back as a tensor): in the payload it would
    make a file that `torch.load(weights_only=True)` refuses."""
    phi = state.get("phi")
    raw: np.ndarray | None = None
    rest = state
    meta: dict[str, Any] = {}
    if isinstance(phi, np.ndarray) and phi.dtype == np.float32:
        phi = torch.from_numpy(np.ascontiguousarray(phi))
    if (type(phi) is torch.Tensor and phi.dtype == torch.float32 and phi.layout == torch.strided
            and not phi.requires_grad):
        cpu = phi.detach().to("cpu").contiguous()
        raw = cpu.numpy().reshape(-1).astype(PHI_DTYPE, copy=False)  # a view of phi on a little-endian host
        rest = {k: v for k, v in state.items() if k != "phi"}
        meta = {"numel": int(cpu.numel()), "shape": [int(n) for n in cpu.shape]}
        for key in _COUNTERS:
            value = state.get(key)
            if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
                meta[key] = value

    def payload(writer: HashingWriter) -> None:
        torch.save(rest, writer)  # type: ignore[arg-type]  # only .write is needed

    write_file(path, meta, raw, payload)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Read and verify one checkpoint file (format 1 or 2); raise CheckpointError with a one-line reason.

    Returns the state as written: phi is a float32 CPU tensor. A file of the slow weights only
    (`node.bridge.ckptfile.write_phi`) gives {"phi", "step", "outer_step", "layout_hash"}, and "donors" if any."""
    raw = read_file(path)
    state: dict[str, Any] = {}
    if raw.payload or raw.version == 1:
        try:
            loaded = torch.load(io.BytesIO(raw.payload or b""), map_location="cpu", weights_only=True)
        except Exception as e:  # a payload that hashes right but does not unpickle: a writer bug
            raise CheckpointError(f"payload does not load: {type(e).__name__}: {e}") from None
        if not isinstance(loaded, dict):
            raise CheckpointError("payload is not a state dict")
        state = loaded
    elif raw.phi is None:
        raise CheckpointError("holds neither slow weights nor a payload")
    else:  # slow weights only: the counters are the meta's
        state = {key: raw.meta[key] for key in (*_COUNTERS, "donors") if key in raw.meta}
    if raw.phi is not None:
        phi = raw.phi if raw.phi.dtype == np.float32 else raw.phi.astype(np.float32)  # a big-endian host
        state["phi"] = torch.from_numpy(phi).reshape(raw.meta.get("shape", [phi.size]))
    return state


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file in `directory`, newest first; read-only (unlike opening a
    CheckpointStore, which tightens permissions and removes temp files), so a reader beside a running
    worker (`starling export`) may use it."""
    found = []
    for p in directory.iterdir():
        step = checkpoint_step(p.name)
        if step is not None:
            found.append((step, p))
    found.sort(reverse=True)
    return found


class CheckpointStore:
    """The checkpoints of one model in one directory, named by the global inner step they were taken at."""

    def __init__(self, directory: Path, keep: int) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.directory = directory
        self.keep = keep
        private_dir(directory)
        # Temp files left by a writer that died mid-write are garbage; nobody else writes here.
        for stale in directory.glob(f"{TMP_PREFIX}*"):
            stale.unlink(missing_ok=True)
        for _, path in self.checkpoints():  # written 0644 by versions before 0600 was the rule
            os.chmod(path, PRIVATE_FILE_MODE)

    def path_for(self, step: int) -> Path:
        return self.directory / checkpoint_name(step)

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every checkpoint file, newest first."""
        return list_checkpoints(self.directory)

    def save(self, state: dict[str, Any], step: int) -> Path:
        """Write a checkpoint for `step`, then delete all but the newest `keep`."""
        path = self.path_for(step)
        write_checkpoint(path, state)
        for _, old in self.checkpoints()[self.keep :]:
            old.unlink(missing_ok=True)
        return path

    def load_latest(self, check: Callable[[dict[str, Any]], None] | None = None) -> LoadResult:
        """The newest checkpoint that verifies (and passes `check`, which raises CheckpointError).

        Each rejected file is logged, renamed to `*.corrupt` so it is not tried again, and listed in
        the result so the caller can report it too.
        """
        rejected: list[tuple[Path, str]] = []
        for step, path in self.checkpoints():
            try:
                state = read_checkpoint(path)
                if check is not None:
                    check(state)
            except CheckpointError as e:
                self.discard(path, str(e))
                rejected.append((path, str(e)))
                continue
            return LoadResult(LoadedCheckpoint(state=state, path=path, step=step), rejected)
        if rejected:
            log.warning("no usable checkpoint in %s; starting from scratch", self.directory)
        return LoadResult(None, rejected)

    def discard(self, path: Path, reason: str) -> None:
        """Report a bad checkpoint and rename it to `*.corrupt`, so it is kept for a post-mortem but
        never tried again (and a later save of the same step does not collide with it)."""
        log.warning("checkpoint %s rejected: %s; falling back to the previous one", path, reason)
        try:
            path.rename(path.with_name(path.name + ".corrupt"))
        except OSError as e:
            log.warning("cannot set aside %s: %s", path, e)


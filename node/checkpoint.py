"""Atomic, hashed checkpoints of the worker's whole training state, last N kept.

A checkpoint file is a fixed header followed by a `torch.save` payload:

    b"STLCKPT1" | sha256(payload) (32 bytes) | len(payload) (8 bytes, big endian) | payload

Why the header: a power cut or a full disk can leave a short or garbled file behind despite the atomic
rename (e.g. a filesystem that reorders data and metadata writes), and `torch.load` on such a file fails
in unhelpful ways or, worse, succeeds on a bit flip inside a tensor. With the hash we detect it, say so,
set the file aside as `*.corrupt` and fall back to the previous checkpoint.

Writing is atomic: the payload goes to a hidden temp file in the same directory, which is fsynced, renamed
over the final name, and the directory fsynced; readers never see a half-written checkpoint under a real
name. Loading uses `torch.load(weights_only=True)`, so a planted file cannot run code.

Permissions: checkpoint files are 0600 and their folders 0700, whatever the umask (a checkpoint is the
whole model and optimizer state); a store opened on an older, world-readable folder tightens it.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from p2p.fsutil import PRIVATE_FILE_MODE, open_private, private_dir

log = logging.getLogger("starling.checkpoint")

MAGIC = b"STLCKPT1"
_HEADER = struct.Struct(">8s32sQ")
_NAME = re.compile(r"^ckpt-(\d{12})\.pt$")
_TMP_PREFIX = ".ckpt-tmp-"


class CheckpointError(Exception):
    """A checkpoint file is unreadable, truncated, corrupt or does not fit the model."""


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


class _HashingWriter:
    """A write-only file wrapper that hashes and counts what `torch.save` writes through it."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None  # the file's own error, which torch would otherwise mask

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self._f.flush()


def write_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write `state` to `path` atomically (temp file + fsync + rename + directory fsync)."""
    tmp = path.with_name(f"{_TMP_PREFIX}{path.name}.{os.getpid()}")
    writer: _HashingWriter | None = None
    try:
        with open_private(tmp, "wb") as f:
            f.write(b"\0" * _HEADER.size)  # placeholder: the hash is known only after the payload
            writer = _HashingWriter(f)
            torch.save(state, writer)  # type: ignore[arg-type]  # only .write is needed
            f.seek(0)
            f.write(_HEADER.pack(MAGIC, writer.sha.digest(), writer.size))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if writer is not None and writer.error is not None and not isinstance(e, OSError):
            # torch's zip writer turns e.g. ENOSPC into "RuntimeError: unexpected pos ..."; say what it was.
            raise writer.error from e
        raise
    _fsync_dir(path.parent)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Read and verify one checkpoint file; raise CheckpointError with a one-line reason."""
    try:
        with open(path, "rb") as f:
            header = f.read(_HEADER.size)
            if len(header) < _HEADER.size:
                raise CheckpointError("truncated header")
            magic, digest, size = _HEADER.unpack(header)
            if magic != MAGIC:
                raise CheckpointError("not a Starling checkpoint (bad magic)")
            if size > os.fstat(f.fileno()).st_size - _HEADER.size:
                raise CheckpointError("truncated payload")
            payload = f.read(size)
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror or e}") from None
    if len(payload) != size:
        raise CheckpointError("truncated payload")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError("hash mismatch (the file is corrupt)")
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # a payload that hashes right but does not unpickle: a writer bug
        raise CheckpointError(f"payload does not load: {type(e).__name__}: {e}") from None
    if not isinstance(state, dict):
        raise CheckpointError("payload is not a state dict")
    return state


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file in `directory`, newest first; read-only (unlike opening a
    CheckpointStore, which tightens permissions and removes temp files), so a reader beside a running
    worker (`starling export`) may use it."""
    found = []
    for p in directory.iterdir():
        m = _NAME.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
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
        for stale in directory.glob(f"{_TMP_PREFIX}*"):
            stale.unlink(missing_ok=True)
        for _, path in self.checkpoints():  # written 0644 by versions before 0600 was the rule
            os.chmod(path, PRIVATE_FILE_MODE)

    def path_for(self, step: int) -> Path:
        return self.directory / f"ckpt-{step:012d}.pt"

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


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable: fsync the directory entry (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

"""The checkpoint file format, and the torch-free reading and writing of a checkpoint's slow weights.

Current files (format 2) are a fixed header, then a body of three sections:

    b"STLCKPT2" | sha256(body) (32 bytes) | len(body) (8 bytes, big endian) | body

    body = len(meta) (8 bytes, big endian) | len(phi) in bytes (8 bytes, big endian)
           | meta: msgpack map {"step", "outer_step", "layout_hash", "numel", "shape", ...}
           | phi: the slow weights, raw little-endian float32
           | payload: `torch.save` of the rest of the state (empty in a file of the slow weights only)

Why phi has a section of its own: the daemon touches checkpoints only to serve its slow weights to late
joiners and to leave the swarm's weights for its worker (node/averaging/latejoin.py), and the daemon process
imports no torch (it stays in the worker process: hundreds of MB of memory and seconds of start-up).
Raw float32 plus a msgpack map is all it needs, here, with numpy: `read_phi` and `write_phi`. The worker's
side - the whole state, with the torch payload - is `node.worker.checkpoint`.

Why the header: a power cut or a full disk can leave a short or garbled file behind despite the atomic
rename (e.g. a filesystem that reorders data and metadata writes), and `torch.load` on such a file fails
in unhelpful ways or, worse, succeeds on a bit flip inside a tensor. One hash covers the whole body (the
section lengths, meta, phi and payload), so a flip anywhere is detected: the reader says so, and the
store sets the file aside as `*.corrupt` and falls back to the previous checkpoint. Nothing in the body
is decoded before its hash matches, except the two lengths, which are checked against the file's size.

Large models: reading hashes the file in chunks as it streams by and reads phi straight into one
preallocated array, so a multi-GB file is never held twice in memory (`read_phi` keeps only phi).

Format 1 files (b"STLCKPT1": the same header, then the whole state, phi included, as one `torch.save`
payload) are still read by `node.worker.checkpoint.read_checkpoint`; `read_phi` refuses them (their phi is
inside the torch payload), and a worker's next checkpoint is written in format 2.

Writing is atomic: the file goes to a hidden temp file in the same directory, which is fsynced, renamed
over the final name, and the directory fsynced; readers never see a half-written file under a real
name. Files are created 0600, whatever the umask (a checkpoint is the whole model and optimizer state).
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeGuard

import msgpack
import numpy as np

from p2p.fsutil import open_private

MAGIC_V1 = b"STLCKPT1"
MAGIC_V2 = b"STLCKPT2"
HEADER = struct.Struct(">8s32sQ")  # magic | sha256 of the body | body length: the same in both formats
SECTIONS = struct.Struct(">QQ")  # len(meta) | len(phi) in bytes: the body's first 16 bytes (format 2)
MAX_META_BYTES = 1 << 20  # the meta is a few counters; a larger length is corruption
MAX_DIMS = 64  # the most dimensions the shape of phi may have (numpy's own limit)
PHI_DTYPE = np.dtype("<f4")
CHUNK_BYTES = 8 << 20  # reads and writes of phi and the payload, each hashed as it passes
TMP_PREFIX = ".ckpt-tmp-"

_V1_REFUSED = ("a format-1 checkpoint (STLCKPT1): its slow weights are inside the torch payload, which only "
               "the worker reads; the worker's next checkpoint is in format 2")


class CheckpointError(Exception):
    """A checkpoint file is unreadable, truncated, corrupt or does not fit the model."""


@dataclass
class PhiState:
    """A checkpoint's slow weights and step counters, as the daemon reads them (no torch)."""

    phi: np.ndarray  # flat float32
    step: int
    outer_step: int
    layout_hash: str
    donors: list[str] = field(default_factory=list)  # whose mean it is (a swarm snapshot); else empty


@dataclass
class RawCheckpoint:
    """One verified file, sections undecoded beyond the meta: what `node.worker.checkpoint` builds the state from.

    Format 1: `meta` empty, `phi` None, `payload` the whole state's `torch.save`. Format 2: `phi` None
    when the state had no raw slow weights (`meta` then has no "numel"); `payload` None when not asked
    for (it was hashed, not kept), b"" in a file of the slow weights only."""

    version: int
    meta: dict[str, Any]
    phi: np.ndarray | None
    payload: bytes | None


class HashingWriter:
    """A write-only file wrapper that hashes and counts what goes through it (`torch.save` included)."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None  # the file's own error, which torch would otherwise mask

    def write(self, data: bytes | memoryview) -> int:
        self.sha.update(data)
        self.size += len(data)
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self._f.flush()


def write_file(
    path: Path, meta: dict[str, Any], phi: np.ndarray | None, payload: Callable[[HashingWriter], None] | None
) -> None:
    """Write a format-2 file atomically (temp file + fsync + rename + directory fsync), 0600.

    `meta` must be msgpack-able; `phi` (flat little-endian float32, C-contiguous) goes to the raw section;
    `payload`, if given, writes the payload through the hashing writer it is handed."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    meta_bytes = msgpack.packb(meta, use_bin_type=True)
    raw = memoryview(b"") if phi is None else phi.data.cast("B")
    writer: HashingWriter | None = None
    try:
        with open_private(tmp, "wb") as f:
            f.write(b"\0" * HEADER.size)  # placeholder: the hash is known only after the body
            writer = HashingWriter(f)
            writer.write(SECTIONS.pack(len(meta_bytes), raw.nbytes))
            writer.write(meta_bytes)
            for start in range(0, raw.nbytes, CHUNK_BYTES):
                writer.write(raw[start : start + CHUNK_BYTES])
            if payload is not None:
                payload(writer)
            f.seek(0)
            f.write(HEADER.pack(MAGIC_V2, writer.sha.digest(), writer.size))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if writer is not None and writer.error is not None and not isinstance(e, OSError):
            # torch's zip writer turns e.g. ENOSPC into "RuntimeError: unexpected pos ..."; say what it was.
            raise writer.error from e
        raise
    fsync_dir(path.parent)


def read_file(path: Path, *, keep_payload: bool = True) -> RawCheckpoint:
    """Read and verify one checkpoint file (either format); CheckpointError with a one-line reason.

    `keep_payload=False` hashes the torch payload without keeping it, and refuses a format-1 file."""
    try:
        with open(path, "rb") as f:
            header = f.read(HEADER.size)
            if len(header) < HEADER.size:
                raise CheckpointError("truncated header")
            magic, digest, size = HEADER.unpack(header)
            if magic not in (MAGIC_V1, MAGIC_V2):
                raise CheckpointError("not a Starling checkpoint (bad magic)")
            if magic == MAGIC_V1 and not keep_payload:
                raise CheckpointError(_V1_REFUSED)
            if size > os.fstat(f.fileno()).st_size - HEADER.size:
                raise CheckpointError("truncated payload")
            if magic == MAGIC_V1:
                payload = f.read(size)
                if len(payload) != size:
                    raise CheckpointError("truncated payload")
                if hashlib.sha256(payload).digest() != digest:
                    raise CheckpointError("hash mismatch (the file is corrupt)")
                return RawCheckpoint(1, {}, None, payload)
            return _read_body(f, digest, size, keep_payload)
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror or e}") from None


def _read_body(f: io.BufferedReader, digest: bytes, size: int, keep_payload: bool) -> RawCheckpoint:
    sha = hashlib.sha256()
    if size < SECTIONS.size:
        raise CheckpointError("bad section lengths (the file is corrupt)")
    meta_len, phi_len = SECTIONS.unpack(_read_hashed(f, SECTIONS.size, sha))
    if meta_len > MAX_META_BYTES or phi_len % PHI_DTYPE.itemsize or SECTIONS.size + meta_len + phi_len > size:
        raise CheckpointError("bad section lengths (the file is corrupt)")
    meta_bytes = _read_hashed(f, meta_len, sha)
    phi = np.empty(phi_len // PHI_DTYPE.itemsize, dtype=PHI_DTYPE)
    _readinto_hashed(f, phi.data.cast("B"), sha)
    payload_len = size - SECTIONS.size - meta_len - phi_len
    payload: bytes | None = None
    if keep_payload:
        payload = _read_hashed(f, payload_len, sha)
    else:
        scratch = memoryview(bytearray(min(CHUNK_BYTES, payload_len)))
        left = payload_len
        while left:
            _readinto_hashed(f, scratch[: min(left, len(scratch))], sha)
            left -= min(left, len(scratch))
    if sha.digest() != digest:
        raise CheckpointError("hash mismatch (the file is corrupt)")
    try:
        meta = msgpack.unpackb(meta_bytes, raw=False)
    except Exception as e:  # hashes right but does not decode: a writer bug
        raise CheckpointError(f"meta does not load: {type(e).__name__}: {e}") from None
    if not isinstance(meta, dict):
        raise CheckpointError("meta is not a map")
    if "numel" not in meta:
        if phi_len:
            raise CheckpointError("meta does not describe the slow weights")
        return RawCheckpoint(2, meta, None, payload)
    shape = meta.get("shape", [meta["numel"]])
    # The shape's length is checked before its product: math.prod over a long list of big ints is slow.
    if (not _is_int(meta["numel"]) or meta["numel"] != phi.size or not isinstance(shape, list)
            or len(shape) > MAX_DIMS or not all(_is_int(n) and n >= 0 for n in shape)
            or math.prod(shape) != phi.size):
        raise CheckpointError("the slow weights' size does not match the meta")
    return RawCheckpoint(2, meta, phi, payload)


def _read_hashed(f: io.BufferedReader, n: int, sha: Any) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CheckpointError("truncated payload")
    sha.update(data)
    return data


def _readinto_hashed(f: io.BufferedReader, view: memoryview, sha: Any) -> None:
    """Fill `view` from `f` in chunks, hashing each as it arrives."""
    for start in range(0, len(view), CHUNK_BYTES):
        chunk = view[start : start + CHUNK_BYTES]
        got = 0
        while got < len(chunk):
            n = f.readinto(chunk[got:])
            if not n:
                raise CheckpointError("truncated payload")
            got += n
        sha.update(chunk)


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def read_phi(path: Path) -> PhiState:
    """The slow weights and counters of a format-2 checkpoint, verified (the whole file is hashed), without
    torch; CheckpointError with a one-line reason (a format-1 file, or one without slow weights, too)."""
    raw = read_file(path, keep_payload=False)
    meta, phi = raw.meta, raw.phi
    if phi is None:
        raise CheckpointError("holds no slow weights")
    step, outer_step, layout = meta.get("step"), meta.get("outer_step"), meta.get("layout_hash")
    if not _is_int(step) or not _is_int(outer_step) or not isinstance(layout, str) or step < 0 or outer_step < 0:
        raise CheckpointError("lacks valid step counters or layout hash")
    donors = meta.get("donors", [])
    if not isinstance(donors, list) or not all(isinstance(d, str) for d in donors):
        raise CheckpointError("has an invalid donor list")
    if phi.dtype != np.float32:  # a big-endian host
        phi = phi.astype(np.float32)
    return PhiState(phi=phi, step=step, outer_step=outer_step, layout_hash=layout, donors=donors)


def write_phi(
    path: Path, phi: np.ndarray, step: int, outer_step: int, layout_hash: str, *, donors: Sequence[str] = ()
) -> None:
    """Write a format-2 file of slow weights and counters only (empty torch payload), atomically and 0600,
    without torch: what `node.worker.checkpoint.read_checkpoint` reads as {"phi", "step", "outer_step",
    "layout_hash"} (and "donors" if given). `phi` is flattened and stored as float32."""
    flat = np.ascontiguousarray(phi, dtype=PHI_DTYPE).reshape(-1)
    meta: dict[str, Any] = {"step": int(step), "outer_step": int(outer_step), "layout_hash": str(layout_hash),
                            "numel": int(flat.size), "shape": [int(flat.size)]}
    if donors:
        meta["donors"] = [str(d) for d in donors]
    write_file(path, meta, flat, None)


def fsync_dir(directory: Path) -> None:
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

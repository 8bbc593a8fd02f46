"""Tensor wire codecs: how a flat fp32 tensor travels as bytes, chunk by chunk.

Four wire dtypes, chosen per run:

* ``fp32`` -- the raw little-endian floats; bit-exact, 4 bytes/element.
* ``bf16`` (default) -- bfloat16, round-to-nearest-even; 2 bytes/element, ~3 significant digits,
  which is plenty for averaging pseudo-gradients.
* ``int8`` -- blockwise absmax quantization: each block of ``block`` elements is sent as one fp32
  scale (``absmax / 127``) plus one int8 code per element; ~1 byte/element. Decoding multiplies back
  in fp32 and can accumulate straight into an fp32 sum.
* ``topk`` -- blockwise top-k sparsification (:class:`TopKCodec`): per block, the ``k`` entries of
  largest magnitude as uint16 indices plus int8 codes with one fp32 scale; ``3k + 4`` bytes per block.
  Lossy by design: it is meant for Delta with an error-feedback buffer in the worker (node/worker/trainer.py),
  which adds what was not sent to the next outer step's Delta. ``topkq`` is its low-bit sibling
  (protocols/lowbit.py: 12-bit indices, 2-bit values by default).

Everything works on *slices* so that neither side ever holds more than one chunk of encoded bytes:
the sender encodes ``flat[start:stop]`` into a reusable buffer and sends it as one frame; the receiver
decodes each frame straight into (or adds it onto) ``out[start:stop]``. Encoded sizes depend only on the
element count (:meth:`TensorCodec.encoded_size`), so a receiver knows the exact size of every chunk
from the header alone and rejects a short or oversized chunk before decoding it.

int8 blocks are aligned to chunk starts: a :class:`ChunkPlan`'s chunk length is a multiple of the
codec's ``align``, so every chunk except the last is made of whole blocks.

numpy only, no torch: the daemon, which moves these bytes, must not load torch (only the worker process
does). The arrays are flat C-contiguous float32; anything that ``np.asarray`` views as one without a copy
is accepted too (a CPU torch tensor is, so callers that still hold tensors work unchanged, and what is
decoded into such a tensor lands in its memory). Bytes become arrays through ``np.frombuffer`` and arrays
become bytes through a zero-copy ``memoryview`` (:func:`tensor_bytes`). numpy has no bfloat16: the bf16
codec takes it from ``ml_dtypes``, which rounds bit for bit as torch's ``.to(torch.bfloat16)`` did.
"""

from __future__ import annotations

import enum
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
from ml_dtypes import bfloat16

from p2p.wire import DEFAULT_MAX_FRAME, Buffer, FrameChannel, ProtocolError, Reason

__all__ = [
    "DEFAULT_INT8_BLOCK",
    "Bf16Codec",
    "ChunkPlan",
    "Flat",
    "Fp32Codec",
    "Int8BlockCodec",
    "TopKCodec",
    "PASS_ELEMS",
    "TensorCodec",
    "WireDtype",
    "flat_fp32",
    "get_codec",
    "TensorReceiver",
    "recv_tensor",
    "recv_tensor_blocking",
    "round_trip",
    "send_tensor",
    "send_tensor_blocking",
    "tensor_frames",
    "tensor_bytes",
]

DEFAULT_INT8_BLOCK = 4096

Flat: TypeAlias = npt.NDArray[np.float32]
"""A 1-D C-contiguous float32 array: what every codec reads and writes."""

#: Elements per vectorised pass within a chunk. The int8 codec makes several passes (numpy has no fused
#: kernels); over this many elements the scratch arrays and the slice stay in the L2 cache between them.
PASS_ELEMS = 1 << 16
#: The quiet NaN that a NaN becomes in bf16 (with the NaN's sign: 0xFFC0 for a negative one). torch gave
#: 0x7FC0 on its scalar path and 0xFFFF on its vectorised one: only NaN-ness was ever promised.
BF16_NAN = 0x7FC0


class WireDtype(enum.StrEnum):
    """How tensors are encoded on the wire; the string goes into exchange headers and config."""

    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "int8"
    TOPK = "topk"
    TOPK_LOWBIT = "topkq"  # protocols/lowbit.py


def flat_fp32(x: Any, what: str = "array", *, writable: bool = False) -> Flat:
    """``x`` as a 1-D contiguous float32 array without copying it, or ``ValueError``.

    Codecs address raw memory, so they accept exactly one shape of array. A copy is never made: a
    converted copy would silently swallow what is written into an output. ``writable``: the result will
    be written, so it must be ``x``'s own memory (an ndarray, or a CPU torch tensor's zero-copy view).
    """
    try:
        arr = np.asarray(x)
    except (TypeError, RuntimeError) as exc:  # e.g. a tensor on a GPU, or one that requires grad
        raise ValueError(f"{what} must be a 1-D contiguous float32 CPU array: {exc}") from None
    if arr.dtype != np.float32 or arr.ndim != 1 or not arr.flags.c_contiguous:
        raise ValueError(f"{what} must be a 1-D contiguous float32 CPU array, got {arr.dtype} {arr.shape}")
    if writable and (not arr.flags.writeable or (arr is not x and arr.base is None)):
        raise ValueError(f"{what} must be writable in place (an array, not a copy of {type(x).__name__})")
    return arr


def _frombuffer(data: Buffer, dtype: npt.DTypeLike, count: int, offset: int = 0) -> np.ndarray:
    """``np.frombuffer`` that also takes ``count == 0`` at the end of a buffer (an empty slice)."""
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset)


class _Scratch(threading.local):
    """Per-thread reusable work arrays (at most :data:`PASS_ELEMS` elements, or one int8 block, each).

    Per thread, not per codec: an exchange sends from one thread and receives in another at the same time
    through the same codec object. Reused, because allocating and faulting in a chunk-sized temporary for
    every chunk costs as much as the pass that fills it."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, dtype: npt.DTypeLike, n: int) -> np.ndarray:
        buf = self.arrays.get(name)
        if buf is None or buf.size < n:
            buf = self.arrays[name] = np.empty(max(n, PASS_ELEMS), dtype=dtype)
        return buf[:n]


_scratch = _Scratch()


def tensor_bytes(t: Any) -> memoryview:
    """A zero-copy byte view of a contiguous array's memory (writable where the array is).

    Accepts what ``np.asarray`` views without a copy (a CPU torch tensor included). The view holds the
    array, and so its memory, alive.
    """
    arr = np.asarray(t)
    if not arr.flags.c_contiguous:
        raise ValueError("tensor_bytes needs a contiguous array")
    return arr.data.cast("B")  # ndarray.data: the array's memoryview


class TensorCodec(ABC):
    """Encodes slices of a flat fp32 array to bytes and decodes them back (optionally accumulating)."""

    dtype: WireDtype
    #: Chunk boundaries must fall on multiples of this many elements.
    align: int = 1

    @abstractmethod
    def encoded_size(self, numel: int) -> int:
        """Exact number of bytes :meth:`encode_into` produces for ``numel`` elements."""

    @abstractmethod
    def _encode(self, src: Flat, dst: Buffer) -> None:
        """Encode ``src`` (non-empty, checked) into ``dst`` (checked to hold ``encoded_size`` bytes)."""

    @abstractmethod
    def _decode(self, data: Buffer, out: Flat, accumulate: bool) -> None: ...

    def encode_into(self, src: Any, dst: Buffer) -> int:
        """Encode ``src`` (1-D fp32) into the writable buffer ``dst``; returns the bytes written."""
        flat = flat_fp32(src, "encode input")
        size = self.encoded_size(flat.size)
        view = memoryview(dst)
        if view.readonly or view.nbytes < size:
            raise ValueError(f"encode buffer must be writable and hold {size} bytes, got {view.nbytes}")
        if size:
            self._encode(flat, dst)
        return size

    def decode_into(self, data: Buffer, out: Any, *, accumulate: bool = False) -> None:
        """Decode ``data`` into ``out`` (1-D fp32), overwriting it or, with ``accumulate``, adding to it.

        ``data`` comes from a peer: a size that does not match ``out`` raises :class:`ProtocolError`
        (``BAD_SIZE``) before anything is written. Overflow to infinity is the peer's (numpy's warnings
        about it are silenced: a log line per hostile chunk would be the only effect).
        """
        flat = flat_fp32(out, "decode output", writable=True)
        size = memoryview(data).nbytes
        expected = self.encoded_size(flat.size)
        if size != expected:
            raise ProtocolError(
                Reason.BAD_SIZE,
                f"{self.dtype} chunk of {size} bytes, {expected} expected for {flat.size} elements",
            )
        if flat.size:
            with np.errstate(over="ignore", invalid="ignore"):
                self._decode(data, flat, accumulate)

    def encode(self, src: Any) -> bytes:
        """Convenience: encode into a fresh ``bytes`` object (tests, small arrays)."""
        flat = flat_fp32(src, "encode input")
        buf = bytearray(self.encoded_size(flat.size))
        self.encode_into(flat, buf)
        return bytes(buf)


class Fp32Codec(TensorCodec):
    """Raw little-endian fp32: exact, and zero-copy on the send side (see :func:`send_tensor`)."""

    dtype = WireDtype.FP32

    def encoded_size(self, numel: int) -> int:
        return 4 * numel

    def _encode(self, src: Flat, dst: Buffer) -> None:
        np.copyto(_frombuffer(dst, np.float32, src.size), src)

    def _decode(self, data: Buffer, out: Flat, accumulate: bool) -> None:
        values = _frombuffer(data, np.float32, out.size)
        if accumulate:
            np.add(out, values, out=out)
        else:
            np.copyto(out, values)


class Bf16Codec(TensorCodec):
    """bfloat16 (round-to-nearest-even on encode): half the bytes of fp32, same exponent range.

    numpy has no bfloat16; ``ml_dtypes`` (the JAX team's numpy dtypes) gives it one, with casts that round
    as torch's ``c10::BFloat16`` does: finite values and infinities get exactly torch's bits (overflow to
    infinity included), a NaN stays a NaN (:data:`BF16_NAN`, its sign kept). Decoding widens exactly.
    Chosen over the same rounding in ``uint32`` bit operations, which took 7 numpy passes per chunk:
    on 4 MiB chunks ml_dtypes encodes in 0.42 ms and decodes in 0.08 ms, the bit operations 0.55 and 0.18.
    """

    dtype = WireDtype.BF16

    def encoded_size(self, numel: int) -> int:
        return 2 * numel

    def _encode(self, src: Flat, dst: Buffer) -> None:
        with np.errstate(over="ignore", invalid="ignore"):  # NaN and overflow are encoded, not warned about
            np.copyto(_frombuffer(dst, bfloat16, src.size), src, casting="unsafe")

    def _decode(self, data: Buffer, out: Flat, accumulate: bool) -> None:
        values = _frombuffer(data, bfloat16, out.size)
        if accumulate:
            np.add(out, values, out=out, dtype=np.float32)
        else:
            np.copyto(out, values, casting="unsafe")  # bf16 -> fp32 is exact; numpy just does not know it


class Int8BlockCodec(TensorCodec):
    """Blockwise absmax int8: per block of ``block`` elements one fp32 scale and int8 codes.

    Chunk layout: ``ceil(n / block)`` fp32 scales, then ``n`` int8 codes (scales first keeps both arrays
    naturally aligned). Per-element error is at most ``scale / 2 = absmax / 254`` of its block.
    Non-finite input cannot be quantized and raises ``ValueError`` on encode; a chunk whose scales are
    negative or non-finite cannot come from a valid encoder and raises :class:`ProtocolError` on decode.

    The arithmetic is IEEE float32 step by step (``absmax / 127``, ``(1 / absmax) * 127``, ``x * inv``,
    round half to even, clamp), so the scales and codes are those torch computed with the same steps. Decoding
    with ``accumulate`` rounds the product, then the sum (torch's ``addcmul_`` fused the two on its
    vectorised path, so a sum may differ from the torch codec's in its last bit; the wire does not).
    """

    dtype = WireDtype.INT8

    def __init__(self, block: int = DEFAULT_INT8_BLOCK) -> None:
        if not 1 <= block <= 1 << 20:
            raise ValueError(f"int8 block size must be in 1..{1 << 20}, got {block}")
        self.block = block
        self.align = block

    def _n_blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def encoded_size(self, numel: int) -> int:
        return 4 * self._n_blocks(numel) + numel

    def _encode(self, src: Flat, dst: Buffer) -> None:
        n = src.size
        nb = self._n_blocks(n)
        scales = _frombuffer(dst, np.float32, nb)
        codes = _frombuffer(dst, np.int8, n, offset=4 * nb)
        for rows, (lo, hi), (blo, bhi) in self._pieces(n):
            width = (hi - lo) // rows
            self._quantize(src[lo:hi].reshape(rows, width), scales[blo:bhi], codes[lo:hi].reshape(rows, width))

    def _pieces(self, n: int) -> Iterator[tuple[int, tuple[int, int], tuple[int, int]]]:
        """Split ``n`` elements into (rows, element range, block range): groups of whole blocks of about
        :data:`PASS_ELEMS` elements (one block where blocks are larger), then the tail."""
        full = n // self.block
        group = max(1, PASS_ELEMS // self.block)
        for first in range(0, full, group):
            last = min(first + group, full)
            yield last - first, (first * self.block, last * self.block), (first, last)
        if n > full * self.block:
            yield 1, (full * self.block, n), (full, full + 1)

    @staticmethod
    def _quantize(x: np.ndarray, scales: np.ndarray, codes: np.ndarray) -> None:
        work = _scratch.get("int8.encode", np.float32, x.size).reshape(x.shape)
        absmax = np.abs(x, out=work).max(axis=1)
        if not np.isfinite(absmax).all():
            raise ValueError("int8 codec cannot quantize NaN or infinite values")
        np.divide(absmax, np.float32(127.0), out=scales)
        with np.errstate(divide="ignore", over="ignore"):
            # The torch codec's ``127.0 / absmax`` ran as ``absmax.reciprocal() * 127`` (Tensor.__rdiv__):
            # two roundings, which decide the code of a value that lands near a half step. Kept as such.
            inv = np.multiply(np.reciprocal(absmax), np.float32(127.0))
        # All-zero blocks (and absmax so tiny that 127/absmax overflows) encode as zeros.
        inv[~np.isfinite(inv)] = 0.0
        q = np.multiply(x, inv[:, None], out=work)
        np.rint(q, out=q)  # half to even, as torch.round
        np.clip(q, -127.0, 127.0, out=q)
        np.copyto(codes, q, casting="unsafe")

    def _decode(self, data: Buffer, out: Flat, accumulate: bool) -> None:
        n = out.size
        nb = self._n_blocks(n)
        scales = _frombuffer(data, np.float32, nb)
        if not np.isfinite(scales).all() or (scales < 0).any():
            raise ProtocolError(Reason.MALFORMED, "int8 chunk with negative or non-finite scales")
        codes = _frombuffer(data, np.int8, n, offset=4 * nb)
        for rows, (lo, hi), (blo, bhi) in self._pieces(n):
            width = (hi - lo) // rows
            c = codes[lo:hi].reshape(rows, width)
            s = scales[blo:bhi, None]
            o = out[lo:hi].reshape(rows, width)
            if accumulate:
                work = _scratch.get("int8.decode", np.float32, hi - lo).reshape(rows, width)
                np.add(o, np.multiply(c, s, out=work), out=o)
            else:
                np.multiply(c, s, out=o)


class TopKCodec(TensorCodec):
    """Blockwise top-k: per block of ``block`` elements, the ``keep`` entries of largest magnitude.

    Chunk layout (``nb`` blocks, the last one possibly short, ``m`` entries kept in all): ``nb`` fp32 scales,
    then ``m`` uint16 indices within their block (strictly increasing per block), then ``m`` int8 codes
    (``code * scale`` is the value; the scale is the block's kept absmax / 127, as :class:`Int8BlockCodec`
    computes it). A block of ``w`` elements keeps ``min(keep, w)`` entries, so the encoded size depends only
    on the element count (the codec contract): a frame carries no count that a peer could inflate, and a
    short or oversized frame is refused by its size before it is decoded. What is not kept decodes as 0.

    Why these choices: SparseLoCo (arXiv 2508.15706) shows that the top 1-3% of a pseudo-gradient's entries,
    with low-bit values and error feedback, train as well as the dense update. Indices within a block fit
    16 bits (blocks of at most 65,536), and blocks aligned to chunk starts (``align``) make the encoding of a
    whole tensor the concatenation of its chunks' encodings, so the worker can reproduce what the wire carried
    without knowing the chunking (:func:`round_trip`).

    Decoding is hostile-input safe: indices not strictly increasing or beyond their block, and scales that are
    negative or non-finite, raise :class:`ProtocolError` (``MALFORMED``) before anything is written.
    """

    dtype = WireDtype.TOPK

    def __init__(self, block: int = DEFAULT_INT8_BLOCK, keep: int = 256) -> None:
        if not 16 <= block <= 1 << 16:
            raise ValueError(f"top-k block size must be in 16..{1 << 16}, got {block}")
        if not 1 <= keep <= block:
            raise ValueError(f"top-k must keep 1..{block} entries per block, got {keep}")
        self.block, self.keep, self.align = block, keep, block

    def _layout(self, numel: int) -> tuple[int, int, int, int]:
        """(full blocks, tail length, entries kept in the tail, entries kept in all)."""
        full, tail = divmod(numel, self.block)
        tail_keep = min(self.keep, tail)
        return full, tail, tail_keep, full * self.keep + tail_keep

    def encoded_size(self, numel: int) -> int:
        full, tail, _, kept = self._layout(numel)
        return 4 * (full + (tail > 0)) + 3 * kept

    def _views(self, data: Buffer, numel: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        full, tail, _, kept = self._layout(numel)
        nb = full + (tail > 0)
        return (_frombuffer(data, np.float32, nb), _frombuffer(data, np.uint16, kept, offset=4 * nb),
                _frombuffer(data, np.int8, kept, offset=4 * nb + 2 * kept))

    def _rows(self, numel: int) -> Iterator[tuple[int, int, int, int, int]]:
        """(rows, width, kept per row, first element, first kept entry) for the full blocks, in groups of about
        :data:`PASS_ELEMS` elements, then the tail."""
        full, tail, tail_keep, _ = self._layout(numel)
        group = max(1, PASS_ELEMS // self.block)
        for first in range(0, full, group):
            rows = min(group, full - first)
            yield rows, self.block, self.keep, first * self.block, first * self.keep
        if tail:
            yield 1, tail, tail_keep, full * self.block, full * self.keep

    def _encode(self, src: Flat, dst: Buffer) -> None:
        scales, indices, codes = self._views(dst, src.size)
        block_no = 0
        for rows, width, k, lo, klo in self._rows(src.size):
            x = src[lo : lo + rows * width].reshape(rows, width)
            idx = self._top(x, k)
            indices[klo : klo + rows * k] = idx.reshape(-1)
            Int8BlockCodec._quantize(np.take_along_axis(x, idx, axis=1), scales[block_no : block_no + rows],
                                     codes[klo : klo + rows * k].reshape(rows, k))
            block_no += rows

    @staticmethod
    def _top(x: np.ndarray, k: int) -> np.ndarray:
        """Per row, the indices of the ``k`` largest magnitudes, increasing (ties: numpy's partition order).
        Non-finite values are left to the quantizer, which refuses them."""
        width = x.shape[1]
        if k >= width:
            return np.broadcast_to(np.arange(width, dtype=np.intp), x.shape).copy()
        mag = np.abs(x)
        idx = np.argpartition(mag, width - k, axis=1)[:, width - k :]
        idx.sort(axis=1)
        return idx

    def _decode(self, data: Buffer, out: Flat, accumulate: bool) -> None:
        scales, indices, codes = self._views(data, out.size)
        if not np.isfinite(scales).all() or (scales < 0).any():
            raise ProtocolError(Reason.MALFORMED, "top-k chunk with negative or non-finite scales")
        pieces = list(self._rows(out.size))
        for rows, width, k, _, klo in pieces:  # check everything before writing anything
            idx = indices[klo : klo + rows * k].reshape(rows, k)
            if k > 1 and not (np.diff(idx.astype(np.int32), axis=1) > 0).all():
                raise ProtocolError(Reason.MALFORMED, "top-k indices not strictly increasing within a block")
            if (idx[:, -1] >= width).any():
                raise ProtocolError(Reason.MALFORMED, f"top-k index beyond its block of {width} elements")
        block_no = 0
        for rows, width, k, lo, klo in pieces:
            o = out[lo : lo + rows * width].reshape(rows, width)
            idx = indices[klo : klo + rows * k].reshape(rows, k).astype(np.intp)
            values = np.multiply(codes[klo : klo + rows * k].reshape(rows, k), scales[block_no : block_no + rows, None],
                                 dtype=np.float32)
            if not accumulate:
                o.fill(0.0)
            # Indices are unique within a row (strictly increasing), so a fancy-indexed add is exact.
            rows_idx = np.arange(rows)[:, None]
            if accumulate:
                o[rows_idx, idx] += values
            else:
                o[rows_idx, idx] = values
            block_no += rows


def round_trip(codec: TensorCodec, src: Any, out: Any) -> None:
    """``out = decode(encode(src))``: what the wire carries of ``src`` (``out`` may be ``src``, in place).

    Pieces of whole ``codec.align`` blocks, so for the blockwise codecs the result is bit for bit what a
    transfer under any :class:`ChunkPlan` decodes (their chunks are whole blocks too): the worker uses it to
    know what its own error-feedback residual is, and what its own phi looked like on the wire, without the
    daemon's chunking. One piece of encoded bytes at a time, whatever the model size."""
    flat = flat_fp32(src, "round_trip input")
    dst = flat_fp32(out, "round_trip output", writable=True)
    if dst.size != flat.size:
        raise ValueError(f"round_trip output has {dst.size} elements, input {flat.size}")
    step = max(1, PASS_ELEMS // codec.align) * codec.align
    buf = bytearray(codec.encoded_size(min(step, flat.size)))
    for lo in range(0, flat.size, step):
        hi = min(lo + step, flat.size)
        n = codec.encode_into(flat[lo:hi], buf)
        codec.decode_into(memoryview(buf)[:n], dst[lo:hi])


def get_codec(dtype: WireDtype | str, *, int8_block: int = DEFAULT_INT8_BLOCK, topk_keep: int = 256) -> TensorCodec:
    """The codec for a wire dtype name (``ValueError`` for unknown names, e.g. from config). ``topk`` uses
    ``int8_block`` as its block and keeps ``topk_keep`` entries of each."""
    if sys.byteorder != "little":  # the wire format is little-endian and we map bytes directly
        raise RuntimeError("Starling's tensor codecs require a little-endian host")
    try:
        wire = WireDtype(dtype)
    except ValueError:
        raise ValueError(
            f"unknown wire dtype {dtype!r}; expected one of {[d.value for d in WireDtype]}"
        ) from None
    if wire is WireDtype.FP32:
        return Fp32Codec()
    if wire is WireDtype.BF16:
        return Bf16Codec()
    if wire is WireDtype.TOPK:
        return TopKCodec(int8_block, topk_keep)
    if wire is WireDtype.TOPK_LOWBIT:  # it builds on this module: made by its preset (protocols/compress.py)
        raise ValueError("the topkq codec is protocols.lowbit.TopKLowBitCodec, made by its compression preset")
    return Int8BlockCodec(int8_block)


# --------------------------------------------------------------------------------------------------
# Chunked transfer of one flat tensor over a frame channel
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkPlan:
    """How a flat tensor of ``numel`` elements is cut into frames; both sides must build the same plan.

    The sender puts ``numel``, the wire dtype and ``chunk_elems`` in its header; the receiver rebuilds
    the plan with :meth:`from_header`, which refuses values that would make it allocate or accept more
    than its own frame limit.
    """

    numel: int
    codec: TensorCodec
    chunk_elems: int

    def __post_init__(self) -> None:
        if self.numel < 0:
            raise ValueError(f"numel must be >= 0, got {self.numel}")
        if self.chunk_elems <= 0 or self.chunk_elems % self.codec.align:
            raise ValueError(
                f"chunk_elems {self.chunk_elems} must be a positive multiple of {self.codec.align}"
            )

    @classmethod
    def for_frame_size(
        cls, numel: int, codec: TensorCodec, max_frame_size: int = DEFAULT_MAX_FRAME
    ) -> ChunkPlan:
        """The plan with the largest chunks whose encoding fits in one frame."""
        per_align = codec.encoded_size(codec.align)
        chunk = max(1, max_frame_size // per_align) * codec.align
        if codec.encoded_size(chunk) > max_frame_size:
            raise ValueError(f"frame size {max_frame_size} cannot hold one {codec.dtype} block")
        return cls(numel, codec, chunk)

    @classmethod
    def from_header(
        cls, numel: int, codec: TensorCodec, chunk_elems: int, max_frame_size: int = DEFAULT_MAX_FRAME
    ) -> ChunkPlan:
        """Validate a peer's announced plan; :class:`ProtocolError` (``BAD_FIELD``) if unacceptable."""
        try:
            plan = cls(numel, codec, chunk_elems)
        except ValueError as exc:
            raise ProtocolError(Reason.BAD_FIELD, str(exc)) from exc
        if plan.max_chunk_bytes > max_frame_size:
            raise ProtocolError(
                Reason.BAD_FIELD,
                f"chunks of {plan.max_chunk_bytes} bytes exceed the {max_frame_size}-byte frame limit",
            )
        return plan

    @property
    def n_chunks(self) -> int:
        return -(-self.numel // self.chunk_elems)

    @property
    def max_chunk_bytes(self) -> int:
        return self.codec.encoded_size(min(self.chunk_elems, self.numel))

    @property
    def total_bytes(self) -> int:
        """Exact payload bytes of the whole transfer (framing excluded)."""
        full, rest = divmod(self.numel, self.chunk_elems)
        return full * self.codec.encoded_size(self.chunk_elems) + self.codec.encoded_size(rest)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for start in range(0, self.numel, self.chunk_elems):
            yield start, min(start + self.chunk_elems, self.numel)


def tensor_frames(flat: Any, plan: ChunkPlan) -> Iterator[memoryview]:
    """The frames that carry ``flat`` under ``plan``, in order, without any I/O (so that a coroutine and a
    thread send alike). fp32 frames are views of the array's memory (zero copy); other codecs encode each
    chunk into one reusable buffer, so a frame is valid only until the next one is drawn and memory stays
    at one chunk whatever the model size. ``flat`` must not change meanwhile."""
    flat = flat_fp32(flat, "send_tensor input")
    if flat.size != plan.numel:
        raise ValueError(f"array has {flat.size} elements, plan expects {plan.numel}")
    if isinstance(plan.codec, Fp32Codec):
        raw = tensor_bytes(flat)
        for start, stop in plan:
            yield raw[4 * start : 4 * stop]
        return
    buf = memoryview(bytearray(plan.max_chunk_bytes))
    for start, stop in plan:
        n = plan.codec.encode_into(flat[start:stop], buf)
        yield buf[:n]


async def send_tensor(channel: FrameChannel, flat: Any, plan: ChunkPlan) -> int:
    """Stream ``flat`` through ``channel`` as ``plan.n_chunks`` frames; returns the payload bytes sent."""
    sent = 0
    for frame in tensor_frames(flat, plan):
        await channel.send(frame)
        sent += frame.nbytes
    return sent


def send_tensor_blocking(send: Callable[[Buffer], None], flat: Any, plan: ChunkPlan) -> int:
    """:func:`send_tensor` for a thread, with a blocking ``send(frame)``."""
    sent = 0
    for frame in tensor_frames(flat, plan):
        send(frame)
        sent += frame.nbytes
    return sent


class TensorReceiver:
    """The receiving half of the chunk protocol without its I/O, so that a coroutine and a thread receive
    alike: iterate to get the buffer each frame must be read into (exactly the room the plan allows, so a
    larger frame is refused before it is read), and report each frame's size with :meth:`landed`.

    ``on_chunk(start, stop)`` runs as soon as ``out[start:stop]`` holds its chunk, while those bytes are
    still in the CPU cache: work done there (checks, means) costs a fraction of a later pass over a
    model-sized tensor. On any error ``out`` holds a partial result: use it only once all chunks landed.
    """

    def __init__(
        self,
        out: Any,
        plan: ChunkPlan,
        *,
        accumulate: bool = False,
        on_chunk: Callable[[int, int], None] | None = None,
    ) -> None:
        out = flat_fp32(out, "recv_tensor output", writable=True)
        if out.size != plan.numel:
            raise ValueError(f"output has {out.size} elements, plan expects {plan.numel}")
        self.out, self.plan, self.accumulate, self.on_chunk = out, plan, accumulate, on_chunk
        direct = isinstance(plan.codec, Fp32Codec) and not accumulate
        self._raw = tensor_bytes(out) if direct else None
        self._buf = None if direct else memoryview(bytearray(plan.max_chunk_bytes))
        self._current: tuple[int, int, int, memoryview] | None = None
        self.received = 0

    def __iter__(self) -> Iterator[memoryview]:
        codec = self.plan.codec
        for index, (start, stop) in enumerate(self.plan):
            expected = codec.encoded_size(stop - start)
            if self._raw is not None:
                target = self._raw[4 * start : 4 * stop]
            else:
                assert self._buf is not None
                target = self._buf[:expected]
            self._current = (index, start, stop, target)
            yield target
            if self._current is not None:
                raise RuntimeError("TensorReceiver: landed() was not called for the previous frame")

    def landed(self, n: int) -> None:
        """The frame drawn last is in its buffer, ``n`` bytes long (0: the channel closed cleanly)."""
        assert self._current is not None, "landed() without a frame drawn"
        index, start, stop, target = self._current
        self._current = None
        if n == 0:
            raise ProtocolError(Reason.TRUNCATED, f"channel closed after {index} of {self.plan.n_chunks} chunks")
        if n != len(target):
            raise ProtocolError(Reason.BAD_SIZE, f"chunk {index}: {n} bytes, {len(target)} expected")
        if self._raw is None:
            self.plan.codec.decode_into(target, self.out[start:stop], accumulate=self.accumulate)
        if self.on_chunk is not None:
            self.on_chunk(start, stop)
        self.received += n


async def recv_tensor(
    channel: FrameChannel,
    out: Any,
    plan: ChunkPlan,
    *,
    accumulate: bool = False,
    on_chunk: Callable[[int, int], None] | None = None,
) -> int:
    """Receive ``plan.n_chunks`` frames into ``out`` (or add them onto it); returns the payload bytes.

    Each frame's size is checked against the plan before it is read (``BAD_SIZE``); a channel that
    ends early raises ``TRUNCATED``. On any error ``out`` holds a partial result: receive into a scratch
    buffer and use it only once this returns, so that nothing is ever half-applied. ``on_chunk``: see
    :class:`TensorReceiver` (here it runs on the event loop, so it must stay a few microseconds per chunk).
    """
    rx = TensorReceiver(out, plan, accumulate=accumulate, on_chunk=on_chunk)
    for target in rx:
        rx.landed(await channel.recv_into(target))
    return rx.received


def recv_tensor_blocking(
    recv_into: Callable[[Buffer], int],
    out: Any,
    plan: ChunkPlan,
    *,
    on_chunk: Callable[[int, int], None] | None = None,
) -> int:
    """:func:`recv_tensor` for a thread, with a blocking ``recv_into(buf)``."""
    rx = TensorReceiver(out, plan, on_chunk=on_chunk)
    for target in rx:
        rx.landed(recv_into(target))
    return rx.received

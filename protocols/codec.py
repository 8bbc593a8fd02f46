"""Tensor wire codecs: how a flat fp32 tensor travels as bytes, chunk by chunk.

Three wire dtypes, chosen per run:

* ``fp32`` -- the raw little-endian floats; bit-exact, 4 bytes/element.
* ``bf16`` (default) -- bfloat16, round-to-nearest-even; 2 bytes/element, ~3 significant digits,
  which is plenty for averaging pseudo-gradients.
* ``int8`` -- blockwise absmax quantization: each block of ``block`` elements is sent as one fp32
  scale (``absmax / 127``) plus one int8 code per element; ~1 byte/element. Decoding multiplies back
  in fp32 and can accumulate straight into an fp32 sum.

Everything works on *slices* so that neither side ever holds more than one chunk of encoded bytes:
the sender encodes ``flat[start:stop]`` into a reusable buffer and sends it as one frame; the receiver
decodes each frame straight into (or adds it onto) ``out[start:stop]``. Encoded sizes depend only on the
element count (:meth:`TensorCodec.encoded_size`), so a receiver knows the exact size of every chunk
from the header alone and rejects a short or oversized chunk before decoding it.

int8 blocks are aligned to chunk starts: a :class:`ChunkPlan`'s chunk length is a multiple of the
codec's ``align``, so every chunk except the last is made of whole blocks.

Only torch is used (no numpy): bytes become tensors through ``torch.frombuffer`` and fp32 tensors
become bytes through a zero-copy ``memoryview`` of their memory (:func:`tensor_bytes`).
"""

from __future__ import annotations

import ctypes
import enum
import sys
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from p2p.wire import DEFAULT_MAX_FRAME, Buffer, FrameChannel, ProtocolError, Reason

__all__ = [
    "DEFAULT_INT8_BLOCK",
    "Bf16Codec",
    "ChunkPlan",
    "Fp32Codec",
    "Int8BlockCodec",
    "TensorCodec",
    "WireDtype",
    "get_codec",
    "TensorReceiver",
    "recv_tensor",
    "recv_tensor_blocking",
    "send_tensor",
    "send_tensor_blocking",
    "tensor_frames",
    "tensor_bytes",
]

DEFAULT_INT8_BLOCK = 4096


class WireDtype(enum.StrEnum):
    """How tensors are encoded on the wire; the string goes into exchange headers and config."""

    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "int8"


def _check_flat_fp32(t: torch.Tensor, what: str) -> None:
    """Codecs address raw memory, so they accept exactly one shape of tensor: 1-D contiguous fp32 CPU."""
    if t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(
            f"{what} must be a 1-D contiguous float32 CPU tensor, got {t.dtype} {tuple(t.shape)} on {t.device}"
        )


def _frombuffer(data: Buffer, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    """``torch.frombuffer`` that tolerates read-only buffers (``bytes`` from the network).

    torch warns that it cannot mark the tensor read-only; we only ever read from such tensors, so the
    warning is noise and is silenced for this call only.
    """
    if count == 0:
        return torch.empty(0, dtype=dtype)
    if memoryview(data).readonly:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(data, dtype=dtype, count=count, offset=offset)
    return torch.frombuffer(data, dtype=dtype, count=count, offset=offset)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable, zero-copy byte view of a contiguous CPU tensor's memory.

    torch storages do not export the buffer protocol, so the view is built over the raw pointer. The
    view does *not* keep ``t`` alive: the caller must hold ``t`` for as long as it uses the view.
    """
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


class TensorCodec(ABC):
    """Encodes slices of a flat fp32 tensor to bytes and decodes them back (optionally accumulating)."""

    dtype: WireDtype
    #: Chunk boundaries must fall on multiples of this many elements.
    align: int = 1

    @abstractmethod
    def encoded_size(self, numel: int) -> int:
        """Exact number of bytes :meth:`encode_into` produces for ``numel`` elements."""

    @abstractmethod
    def encode_into(self, src: torch.Tensor, dst: Buffer) -> int:
        """Encode ``src`` (1-D fp32) into the writable buffer ``dst``; returns the bytes written."""

    @abstractmethod
    def _decode(self, data: Buffer, out: torch.Tensor, accumulate: bool) -> None: ...

    def decode_into(self, data: Buffer, out: torch.Tensor, *, accumulate: bool = False) -> None:
        """Decode ``data`` into ``out`` (1-D fp32), overwriting it or, with ``accumulate``, adding to it.

        ``data`` comes from a peer: a size that does not match ``out`` raises :class:`ProtocolError`
        (``BAD_SIZE``) before anything is written.
        """
        _check_flat_fp32(out, "decode output")
        size = memoryview(data).nbytes
        expected = self.encoded_size(out.numel())
        if size != expected:
            raise ProtocolError(
                Reason.BAD_SIZE,
                f"{self.dtype} chunk of {size} bytes, {expected} expected for {out.numel()} elements",
            )
        self._decode(data, out, accumulate)

    def encode(self, src: torch.Tensor) -> bytes:
        """Convenience: encode into a fresh ``bytes`` object (tests, small tensors)."""
        buf = bytearray(self.encoded_size(src.numel()))
        self.encode_into(src, buf)
        return bytes(buf)

    def _check_encode_args(self, src: torch.Tensor, dst: Buffer) -> int:
        _check_flat_fp32(src, "encode input")
        size = self.encoded_size(src.numel())
        view = memoryview(dst)
        if view.readonly or view.nbytes < size:
            raise ValueError(f"encode buffer must be writable and hold {size} bytes, got {view.nbytes}")
        return size


class Fp32Codec(TensorCodec):
    """Raw little-endian fp32: exact, and zero-copy on the send side (see :func:`send_tensor`)."""

    dtype = WireDtype.FP32

    def encoded_size(self, numel: int) -> int:
        return 4 * numel

    def encode_into(self, src: torch.Tensor, dst: Buffer) -> int:
        size = self._check_encode_args(src, dst)
        if size:
            _frombuffer(dst, torch.float32, src.numel()).copy_(src)
        return size

    def _decode(self, data: Buffer, out: torch.Tensor, accumulate: bool) -> None:
        values = _frombuffer(data, torch.float32, out.numel())
        if accumulate:
            out.add_(values)
        else:
            out.copy_(values)


class Bf16Codec(TensorCodec):
    """bfloat16 (round-to-nearest-even on encode): half the bytes of fp32, same exponent range."""

    dtype = WireDtype.BF16

    def encoded_size(self, numel: int) -> int:
        return 2 * numel

    def encode_into(self, src: torch.Tensor, dst: Buffer) -> int:
        size = self._check_encode_args(src, dst)
        if size:
            _frombuffer(dst, torch.bfloat16, src.numel()).copy_(src)  # converts in place, no temporary
        return size

    def _decode(self, data: Buffer, out: torch.Tensor, accumulate: bool) -> None:
        values = _frombuffer(data, torch.bfloat16, out.numel())
        if accumulate:
            out.add_(values)  # promotes to fp32 elementwise
        else:
            out.copy_(values)


class Int8BlockCodec(TensorCodec):
    """Blockwise absmax int8: per block of ``block`` elements one fp32 scale and int8 codes.

    Chunk layout: ``ceil(n / block)`` fp32 scales, then ``n`` int8 codes (scales first keeps both arrays
    naturally aligned). Per-element error is at most ``scale / 2 = absmax / 254`` of its block.
    Non-finite input cannot be quantized and raises ``ValueError`` on encode; a chunk whose scales are
    negative or non-finite cannot come from a valid encoder and raises :class:`ProtocolError` on decode.
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

    def encode_into(self, src: torch.Tensor, dst: Buffer) -> int:
        size = self._check_encode_args(src, dst)
        n = src.numel()
        if n == 0:
            return 0
        nb = self._n_blocks(n)
        scales = _frombuffer(dst, torch.float32, nb)
        codes = _frombuffer(dst, torch.int8, n, offset=4 * nb)
        for rows, (lo, hi), (blo, bhi) in self._pieces(n):
            width = (hi - lo) // rows
            self._quantize(src[lo:hi].view(rows, width), scales[blo:bhi], codes[lo:hi].view(rows, width))
        return size

    def _pieces(self, n: int) -> Iterator[tuple[int, tuple[int, int], tuple[int, int]]]:
        """Split ``n`` elements into (rows, element range, block range): whole blocks, then the tail."""
        full = n // self.block
        if full:
            yield full, (0, full * self.block), (0, full)
        if n > full * self.block:
            yield 1, (full * self.block, n), (full, full + 1)

    @staticmethod
    def _quantize(x: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor) -> None:
        absmax = x.abs().amax(dim=1)
        if not bool(torch.isfinite(absmax).all()):
            raise ValueError("int8 codec cannot quantize NaN or infinite values")
        torch.div(absmax, 127.0, out=scales)
        inv = 127.0 / absmax
        # All-zero blocks (and absmax so tiny that 127/absmax overflows) encode as zeros.
        inv = torch.where(torch.isfinite(inv), inv, torch.zeros_like(inv))
        q = x * inv.unsqueeze(1)
        codes.copy_(q.round_().clamp_(-127.0, 127.0))

    def _decode(self, data: Buffer, out: torch.Tensor, accumulate: bool) -> None:
        n = out.numel()
        if n == 0:
            return
        nb = self._n_blocks(n)
        scales = _frombuffer(data, torch.float32, nb)
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise ProtocolError(Reason.MALFORMED, "int8 chunk with negative or non-finite scales")
        codes = _frombuffer(data, torch.int8, n, offset=4 * nb)
        for rows, (lo, hi), (blo, bhi) in self._pieces(n):
            width = (hi - lo) // rows
            c = codes[lo:hi].view(rows, width)
            s = scales[blo:bhi].unsqueeze(1)
            o = out[lo:hi].view(rows, width)
            if accumulate:
                o.addcmul_(c, s)
            else:
                torch.mul(c, s, out=o)


def get_codec(dtype: WireDtype | str, *, int8_block: int = DEFAULT_INT8_BLOCK) -> TensorCodec:
    """The codec for a wire dtype name (``ValueError`` for unknown names, e.g. from config)."""
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


def tensor_frames(flat: torch.Tensor, plan: ChunkPlan) -> Iterator[memoryview]:
    """The frames that carry ``flat`` under ``plan``, in order, without any I/O (so that a coroutine and a
    thread send alike). fp32 frames are views of the tensor's memory (zero copy); other codecs encode each
    chunk into one reusable buffer, so a frame is valid only until the next one is drawn and memory stays
    at one chunk whatever the model size. ``flat`` must not change meanwhile."""
    _check_flat_fp32(flat, "send_tensor input")
    if flat.numel() != plan.numel:
        raise ValueError(f"tensor has {flat.numel()} elements, plan expects {plan.numel}")
    if isinstance(plan.codec, Fp32Codec):
        raw = tensor_bytes(flat)
        for start, stop in plan:
            yield raw[4 * start : 4 * stop]
        return
    buf = memoryview(bytearray(plan.max_chunk_bytes))
    for start, stop in plan:
        n = plan.codec.encode_into(flat[start:stop], buf)
        yield buf[:n]


async def send_tensor(channel: FrameChannel, flat: torch.Tensor, plan: ChunkPlan) -> int:
    """Stream ``flat`` through ``channel`` as ``plan.n_chunks`` frames; returns the payload bytes sent."""
    sent = 0
    for frame in tensor_frames(flat, plan):
        await channel.send(frame)
        sent += frame.nbytes
    return sent


def send_tensor_blocking(send: Callable[[Buffer], None], flat: torch.Tensor, plan: ChunkPlan) -> int:
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
        out: torch.Tensor,
        plan: ChunkPlan,
        *,
        accumulate: bool = False,
        on_chunk: Callable[[int, int], None] | None = None,
    ) -> None:
        _check_flat_fp32(out, "recv_tensor output")
        if out.numel() != plan.numel:
            raise ValueError(f"output has {out.numel()} elements, plan expects {plan.numel}")
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
    out: torch.Tensor,
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
    out: torch.Tensor,
    plan: ChunkPlan,
    *,
    on_chunk: Callable[[int, int], None] | None = None,
) -> int:
    """:func:`recv_tensor` for a thread, with a blocking ``recv_into(buf)``."""
    rx = TensorReceiver(out, plan, on_chunk=on_chunk)
    for target in rx:
        rx.landed(recv_into(target))
    return rx.received

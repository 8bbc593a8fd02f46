"""protocols.codec: wire dtypes, chunk plans, and chunked tensor transfer over a frame channel.

The codecs run on numpy (the daemon imports no torch); torch appears here only as the reference the wire
format was defined by (bf16 bits, int8 scales and codes) and as a caller's tensor the codecs still take.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.wire import PlainFrameChannel, ProtocolError, Reason, TrioByteStream
from protocols.codec import (
    PASS_ELEMS,
    Bf16Codec,
    ChunkPlan,
    Fp32Codec,
    Int8BlockCodec,
    TensorCodec,
    TopKCodec,
    WireDtype,
    get_codec,
    recv_tensor,
    send_tensor,
    tensor_bytes,
)

torch.set_num_threads(1)

ALL_CODECS: list[TensorCodec] = [Fp32Codec(), Bf16Codec(), Int8BlockCodec(64), Int8BlockCodec(), TopKCodec(64, 8)]
REPO = Path(__file__).resolve().parent.parent


def randn(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n, dtype=np.float32)


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.int32)


def roundtrip(codec: TensorCodec, x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    codec.decode_into(codec.encode(x), out)
    return out


def test_the_protocols_import_no_torch() -> None:
    """The daemon's side of the wire (codec, avg, snapshot) must not pull torch in: only the worker has it."""
    code = "import protocols.codec, protocols.avg, protocols.snapshot, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


# ---------------------------------------------------------------------------------------------
# Codecs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: f"{c.dtype}-{c.align}")
@pytest.mark.parametrize("numel", [0, 1, 63, 64, 65, 4096, 5000])
def test_encoded_size_is_exactly_what_encode_produces(codec: TensorCodec, numel: int) -> None:
    assert len(codec.encode(randn(numel))) == codec.encoded_size(numel)


def test_fp32_is_bit_exact_including_special_values() -> None:
    x = np.concatenate([randn(1000), np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, 3.4e38], dtype=np.float32)])
    assert np.array_equal(bits(roundtrip(Fp32Codec(), x)), bits(x))


def test_bf16_matches_torch_round_to_nearest_even() -> None:
    x = randn(10_000) * np.float32(1e3)
    expected = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    assert np.array_equal(roundtrip(Bf16Codec(), x), expected)
    assert float((np.abs(roundtrip(Bf16Codec(), x) - x) / np.abs(x)).max()) <= 2**-8


def special_floats(n: int, seed: int) -> np.ndarray:
    """Every exponent (subnormals, the largest finite values, which round up to infinity), random
    mantissas, exact ties (lowest 16 bits 0x8000) with both parities, and +-0, +-inf."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    ties = rng.random(n) < 0.2
    raw[ties] = (raw[ties] & 0xFFFF0000) | 0x8000
    near = rng.random(n) < 0.1  # just below / above a tie
    low = np.array([0x7FFF, 0x8001, 0xFFFF, 0x0001], dtype=np.uint32)
    raw[near] = (raw[near] & 0xFFFF0000) | rng.choice(low, int(near.sum()))
    x = raw.view(np.float32)
    x[np.isnan(x)] = 1.0  # NaNs are tested on their own: only NaN-ness is promised for them
    fixed = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 1.1754942e-38, 3.4028235e38, -3.4028235e38,
                      3.3895314e38, 3.3961775e38, 65504.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8], dtype=np.float32)
    return np.concatenate([fixed, x])


@pytest.mark.parametrize("seed", range(3))
def test_bf16_bits_are_torchs_for_every_finite_value_and_infinity(seed: int) -> None:
    x = special_floats(PASS_ELEMS * 2 + 1001, seed)  # several passes, and a ragged last one
    ours = np.frombuffer(Bf16Codec().encode(x), dtype=np.uint16)
    theirs = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs)
    assert np.array_equal(roundtrip(Bf16Codec(), x), torch.from_numpy(x.copy()).to(torch.bfloat16).float().numpy())


def test_bf16_keeps_nan_a_nan_and_never_an_infinity_or_a_number() -> None:
    x = randn(2000)
    payloads = np.array(
        [0x7F800001, 0x7FBFFFFF, 0x7FC00000, 0x7FFFFFFF, 0xFF800001, 0xFFFFFFFF, 0x7F807FFF, 0x7F808000],
        dtype=np.uint32,
    )
    where = np.arange(len(payloads)) * 97 + 5
    x.view(np.uint32)[where] = payloads
    y = roundtrip(Bf16Codec(), x)
    assert np.isnan(y[where]).all()
    others = np.setdiff1d(np.arange(x.size), where)
    assert np.array_equal(y[others], torch.from_numpy(x[others]).to(torch.bfloat16).float().numpy())


def test_bf16_halves_the_bytes() -> None:
    assert Bf16Codec().encoded_size(1000) == 2000


def int8_reference(x: torch.Tensor, block: int) -> bytes:
    """The int8 encoding as the torch codec computed it (scales, then codes), kept as the definition."""
    n = x.numel()
    nb = -(-n // block)
    padded = torch.zeros(nb * block)
    padded[:n] = x
    rows = padded.view(nb, block)
    absmax = rows.abs().amax(dim=1)  # zero padding leaves the tail block's absmax as it is
    scales = torch.div(absmax, 127.0)
    inv = 127.0 / absmax  # torch: absmax.reciprocal() * 127, two roundings (the codec follows)
    inv = torch.where(torch.isfinite(inv), inv, torch.zeros_like(inv))
    codes = (rows * inv.unsqueeze(1)).round_().clamp_(-127.0, 127.0).to(torch.int8).view(-1)[:n]
    return scales.numpy().tobytes() + codes.numpy().tobytes()


@pytest.mark.parametrize("block", [16, 64, 1000, 4096, PASS_ELEMS * 2])
def test_int8_scales_and_codes_are_the_torch_codecs(block: int) -> None:
    rng = np.random.default_rng(block)
    n = 3 * max(block, PASS_ELEMS) + 77
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-40, 40, n))).astype(np.float32)
    x[:block] = 0.0  # an all-zero block
    x[block : 2 * block] = 1e-40  # subnormal: 127/absmax overflows
    x[2 * block] = 3.4e38
    half = np.arange(2 * block + 1, min(3 * block, n), 7)
    x[half] = x[2 * block] / 127 * 0.5  # ties after scaling, some of them
    assert Int8BlockCodec(block).encode(x) == int8_reference(torch.from_numpy(x), block)
    # Every value near a multiple of half a step of a block with a random absmax: where rounding the
    # scaled value can go either way, the codes must still be the torch codec's.
    halves = rng.integers(-254, 255, n).astype(np.float32) / np.float32(254)
    absmax = np.repeat(np.exp(rng.uniform(-20, 20, -(-n // block))).astype(np.float32), block)[:n]
    y = halves * absmax
    assert Int8BlockCodec(block).encode(y) == int8_reference(torch.from_numpy(y), block)


@pytest.mark.parametrize("numel", [1, 100, 4096, 4096 * 3 + 17])
def test_int8_error_is_within_half_a_step_of_each_block_absmax(numel: int) -> None:
    codec = Int8BlockCodec(4096)
    x = randn(numel) * np.logspace(-3, 3, numel, dtype=np.float32)  # blocks with very different ranges
    y = roundtrip(codec, x)
    for start in range(0, numel, codec.block):
        block, approx = x[start : start + codec.block], y[start : start + codec.block]
        step = float(np.abs(block).max()) / 127
        assert float(np.abs(approx - block).max()) <= step / 2 * (1 + 1e-5) + 1e-30


def test_int8_preserves_zero_blocks_and_block_maxima_exactly() -> None:
    x = np.zeros(256, dtype=np.float32)
    x[64:128] = np.linspace(-2.0, 1.0, 64, dtype=np.float32)
    y = roundtrip(Int8BlockCodec(64), x)
    assert np.array_equal(y[:64], np.zeros(64)) and np.array_equal(y[128:], np.zeros(128))
    assert float(y[64]) == pytest.approx(-2.0, rel=1e-6)


def test_int8_tiny_values_do_not_produce_nan() -> None:
    x = np.full(64, 1e-40, dtype=np.float32)  # subnormal: 127 / absmax overflows
    assert np.isfinite(roundtrip(Int8BlockCodec(64), x)).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_int8_refuses_to_quantize_non_finite_values(bad: float) -> None:
    x = randn(100)
    x[7] = bad
    with pytest.raises(ValueError):
        Int8BlockCodec(64).encode(x)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: f"{c.dtype}-{c.align}")
def test_decode_with_accumulate_adds_the_decoded_values(codec: TensorCodec) -> None:
    x = randn(300, seed=1)
    base = randn(300, seed=2)
    acc = base.copy()
    codec.decode_into(codec.encode(x), acc, accumulate=True)
    assert np.allclose(acc, base + roundtrip(codec, x), atol=1e-6)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: f"{c.dtype}-{c.align}")
def test_codecs_take_cpu_torch_tensors_and_decode_into_their_memory(codec: TensorCodec) -> None:
    """Callers that still hold tensors: ``np.asarray`` views them, so what is decoded lands in them."""
    x = torch.randn(5000)
    assert codec.encode(x) == codec.encode(x.numpy())
    out = torch.full((5000,), 7.0)
    codec.decode_into(codec.encode(x), out)
    assert np.array_equal(out.numpy(), roundtrip(codec, x.numpy()))
    codec.decode_into(codec.encode(x), out, accumulate=True)
    assert np.allclose(out.numpy(), 2 * roundtrip(codec, x.numpy()))


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: f"{c.dtype}-{c.align}")
def test_decode_refuses_a_chunk_of_the_wrong_size_without_writing(codec: TensorCodec) -> None:
    data = codec.encode(randn(100))
    out = np.full(100, 7.0, dtype=np.float32)
    for wrong in (data[:-1], data + b"\x00"):
        with pytest.raises(ProtocolError) as exc:
            codec.decode_into(wrong, out)
        assert exc.value.reason is Reason.BAD_SIZE
    assert np.array_equal(out, np.full(100, 7.0, dtype=np.float32))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0])
def test_int8_refuses_scales_no_encoder_produces(scale: float) -> None:
    codec = Int8BlockCodec(64)
    data = bytearray(codec.encode(randn(64)))
    data[:4] = struct.pack("<f", scale)
    with pytest.raises(ProtocolError) as exc:
        codec.decode_into(bytes(data), np.empty(64, dtype=np.float32))
    assert exc.value.reason is Reason.MALFORMED


def test_codecs_refuse_arrays_they_cannot_address() -> None:
    codec = Fp32Codec()
    bad_inputs = (
        randn(16).reshape(4, 4),
        randn(8)[::2],
        np.zeros(4),
        torch.randn(8)[::2],
        torch.randn(4, dtype=torch.float64),
        torch.randn(4, requires_grad=True),
    )
    for bad in bad_inputs:
        with pytest.raises(ValueError):
            codec.encode(bad)
    with pytest.raises(ValueError):
        codec.encode_into(randn(4), bytearray(15))
    with pytest.raises(ValueError):  # a list would be decoded into a copy, and the values lost
        codec.decode_into(codec.encode(randn(2)), [0.0, 0.0])
    with pytest.raises(ValueError):
        codec.decode_into(codec.encode(randn(2)), np.frombuffer(bytes(8), dtype=np.float32))  # read-only


def test_get_codec_knows_the_three_wire_dtypes() -> None:
    assert isinstance(get_codec("fp32"), Fp32Codec)
    assert isinstance(get_codec(WireDtype.BF16), Bf16Codec)
    assert get_codec("int8", int8_block=128).align == 128
    with pytest.raises(ValueError):
        get_codec("fp8")


def test_tensor_bytes_is_a_zero_copy_view() -> None:
    for t in (np.zeros(2, dtype=np.float32), torch.zeros(2)):
        view = tensor_bytes(t)
        view[:4] = struct.pack("<f", 1.5)
        assert float(t[0]) == 1.5 and view.nbytes == 8
    assert tensor_bytes(np.zeros(0, dtype=np.float32)).nbytes == 0


def test_codecs_are_safe_from_two_threads_at_once() -> None:
    """An exchange encodes in its send thread while its receive thread decodes, through one codec object:
    the scratch arrays are per thread."""
    from concurrent.futures import ThreadPoolExecutor

    x = randn(PASS_ELEMS * 3 + 5)
    for codec in ALL_CODECS:
        expected = codec.encode(x)

        def work(_: int, codec: TensorCodec = codec, expected: bytes = expected) -> bool:
            ok = True
            for _ in range(5):
                ok &= codec.encode(x) == expected
                out = np.zeros_like(x)
                codec.decode_into(expected, out, accumulate=True)
                ok &= np.array_equal(out, roundtrip(codec, x))
            return ok

        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(work, range(4)))


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["fp32", "bf16", "int8", "topk"]),
    st.integers(min_value=0, max_value=300),
    st.binary(max_size=1500),
    st.booleans(),
)
def test_decoders_on_garbage_raise_only_protocol_or_value_errors(
    dtype: str, numel: int, data: bytes, accumulate: bool
) -> None:
    codec = get_codec(dtype, int8_block=64, topk_keep=8)
    out = np.zeros(numel, dtype=np.float32)
    try:
        codec.decode_into(data, out, accumulate=accumulate)
    except (ProtocolError, ValueError):
        pass


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=1, max_value=300), st.data())
def test_decoders_on_right_sized_garbage_raise_only_protocol_errors(numel: int, data: st.DataObject) -> None:
    codec = get_codec(data.draw(st.sampled_from(["fp32", "bf16", "int8", "topk"])), int8_block=64, topk_keep=8)
    payload = data.draw(st.binary(min_size=codec.encoded_size(numel), max_size=codec.encoded_size(numel)))
    try:
        codec.decode_into(payload, np.zeros(numel, dtype=np.float32))
    except ProtocolError:
        pass


# ---------------------------------------------------------------------------------------------
# Chunk plans
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: f"{c.dtype}-{c.align}")
def test_plan_covers_the_tensor_once_with_chunks_that_fit_a_frame(codec: TensorCodec) -> None:
    plan = ChunkPlan.for_frame_size(1_000_003, codec, max_frame_size=65536)
    chunks = list(plan)
    assert chunks[0][0] == 0 and chunks[-1][1] == 1_000_003
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))
    assert all(start % codec.align == 0 for start, _ in chunks)
    assert plan.max_chunk_bytes <= 65536
    assert plan.total_bytes == sum(codec.encoded_size(b - a) for a, b in chunks)
    assert plan.n_chunks == len(chunks)


def test_plan_from_a_peer_header_is_validated() -> None:
    codec = Int8BlockCodec(64)
    assert ChunkPlan.from_header(1000, codec, 128, max_frame_size=1024).n_chunks == 8
    for numel, chunk in ((1000, 100), (1000, 0), (-1, 64), (10_000, 64 * 64)):
        with pytest.raises(ProtocolError) as exc:
            ChunkPlan.from_header(numel, codec, chunk, max_frame_size=1024)
        assert exc.value.reason is Reason.BAD_FIELD


def test_empty_tensor_plan_has_no_chunks() -> None:
    plan = ChunkPlan.for_frame_size(0, Bf16Codec())
    assert list(plan) == [] and plan.total_bytes == 0


# ---------------------------------------------------------------------------------------------
# Chunked transfer
# ---------------------------------------------------------------------------------------------


def channel_pair(max_frame_size: int) -> tuple[PlainFrameChannel, PlainFrameChannel]:
    a, b = trio.testing.memory_stream_pair()
    return (
        PlainFrameChannel(TrioByteStream(a), max_frame_size=max_frame_size),
        PlainFrameChannel(TrioByteStream(b), max_frame_size=max_frame_size),
    )


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: f"{c.dtype}-{c.align}")
async def test_chunked_transfer_equals_one_shot_encoding(codec: TensorCodec) -> None:
    x = randn(50_001)
    plan = ChunkPlan.for_frame_size(x.size, codec, max_frame_size=16384)
    sender, receiver = channel_pair(16384)
    out = np.full_like(x, np.nan)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_tensor, sender, x, plan)
        assert await recv_tensor(receiver, out, plan) == plan.total_bytes
    expected = np.empty_like(x)
    for start, stop in plan:  # chunk-aligned blocks: the same as encoding each chunk alone
        codec.decode_into(codec.encode(x[start:stop]), expected[start:stop])
    assert np.array_equal(bits(out), bits(expected))
    if isinstance(codec, Fp32Codec):
        assert np.array_equal(bits(out), bits(x))


async def test_chunked_transfer_can_accumulate_into_a_sum() -> None:
    x, base = randn(10_000, seed=1), randn(10_000, seed=2)
    plan = ChunkPlan.for_frame_size(x.size, Fp32Codec(), max_frame_size=4096)
    sender, receiver = channel_pair(4096)
    acc = base.copy()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_tensor, sender, x, plan)
        await recv_tensor(receiver, acc, plan, accumulate=True)
    assert np.array_equal(acc, base + x)


async def test_sender_stopping_mid_transfer_is_a_clean_truncation_error() -> None:
    x = randn(10_000)
    plan = ChunkPlan.for_frame_size(x.size, Bf16Codec(), max_frame_size=4096)
    sender, receiver = channel_pair(4096)
    await sender.send(Bf16Codec().encode(x[: plan.chunk_elems]))
    await sender.aclose()
    with pytest.raises(ProtocolError) as exc:
        await recv_tensor(receiver, np.empty_like(x), plan)
    assert exc.value.reason is Reason.TRUNCATED


async def test_chunk_of_another_dtype_is_refused_by_size() -> None:
    x = randn(10_000)
    sender, receiver = channel_pair(1 << 16)
    await sender.send(Fp32Codec().encode(x[:1024]))  # the peer encodes fp32...
    expected_plan = ChunkPlan(x.size, Bf16Codec(), 1024)  # ...where the header said bf16
    with pytest.raises(ProtocolError) as exc:
        await recv_tensor(receiver, np.empty_like(x), expected_plan)
    assert exc.value.reason is Reason.BAD_SIZE


async def test_transfer_refuses_a_tensor_that_does_not_match_the_plan() -> None:
    sender, _ = channel_pair(4096)
    with pytest.raises(ValueError):
        await send_tensor(sender, randn(10), ChunkPlan(11, Fp32Codec(), 4))


async def test_a_transfer_into_a_torch_tensor_lands_in_its_memory() -> None:
    x = torch.randn(20_000)
    plan = ChunkPlan.for_frame_size(x.numel(), Bf16Codec(), max_frame_size=4096)
    sender, receiver = channel_pair(4096)
    out = torch.zeros(20_000)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_tensor, sender, x, plan)
        await recv_tensor(receiver, out, plan)
    assert torch.equal(out, x.to(torch.bfloat16).float())

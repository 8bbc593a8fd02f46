"""protocols.codec: wire dtypes, chunk plans, and chunked tensor transfer over a frame channel."""

from __future__ import annotations

import struct

import pytest
import torch
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.wire import PlainFrameChannel, ProtocolError, Reason, TrioByteStream
from protocols.codec import (
    Bf16Codec,
    ChunkPlan,
    Fp32Codec,
    Int8BlockCodec,
    TensorCodec,
    WireDtype,
    get_codec,
    recv_tensor,
    send_tensor,
    tensor_bytes,
)

torch.set_num_threads(1)

ALL_CODECS: list[TensorCodec] = [Fp32Codec(), Bf16Codec(), Int8BlockCodec(64), Int8BlockCodec()]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def roundtrip(codec: TensorCodec, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    codec.decode_into(codec.encode(x), out)
    return out


# ---------------------------------------------------------------------------------------------
# Codecs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: f"{c.dtype}-{c.align}")
@pytest.mark.parametrize("numel", [0, 1, 63, 64, 65, 4096, 5000])
def test_encoded_size_is_exactly_what_encode_produces(codec: TensorCodec, numel: int) -> None:
    assert len(codec.encode(torch.randn(numel))) == codec.encoded_size(numel)


def test_fp32_is_bit_exact_including_special_values() -> None:
    x = torch.cat([torch.randn(1000), torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, 3.4e38])])
    assert torch.equal(bits(roundtrip(Fp32Codec(), x)), bits(x))


def test_bf16_matches_torch_round_to_nearest_even() -> None:
    x = torch.randn(10_000) * 1e3
    assert torch.equal(roundtrip(Bf16Codec(), x), x.to(torch.bfloat16).float())
    assert float(((roundtrip(Bf16Codec(), x) - x).abs() / x.abs()).max()) <= 2**-8


def test_bf16_halves_the_bytes() -> None:
    assert Bf16Codec().encoded_size(1000) == 2000


@pytest.mark.parametrize("numel", [1, 100, 4096, 4096 * 3 + 17])
def test_int8_error_is_within_half_a_step_of_each_block_absmax(numel: int) -> None:
    codec = Int8BlockCodec(4096)
    x = torch.randn(numel) * torch.logspace(-3, 3, numel)  # blocks with very different ranges
    y = roundtrip(codec, x)
    for start in range(0, numel, codec.block):
        block, approx = x[start : start + codec.block], y[start : start + codec.block]
        step = float(block.abs().max()) / 127
        assert float((approx - block).abs().max()) <= step / 2 * (1 + 1e-5) + 1e-30


def test_int8_preserves_zero_blocks_and_block_maxima_exactly() -> None:
    x = torch.zeros(256)
    x[64:128] = torch.linspace(-2.0, 1.0, 64)
    y = roundtrip(Int8BlockCodec(64), x)
    assert torch.equal(y[:64], torch.zeros(64)) and torch.equal(y[128:], torch.zeros(128))
    assert float(y[64]) == pytest.approx(-2.0, rel=1e-6)


def test_int8_tiny_values_do_not_produce_nan() -> None:
    x = torch.full((64,), 1e-40)  # subnormal: 127 / absmax overflows
    assert torch.isfinite(roundtrip(Int8BlockCodec(64), x)).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_int8_refuses_to_quantize_non_finite_values(bad: float) -> None:
    x = torch.randn(100)
    x[7] = bad
    with pytest.raises(ValueError):
        Int8BlockCodec(64).encode(x)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: f"{c.dtype}-{c.align}")
def test_decode_with_accumulate_adds_the_decoded_values(codec: TensorCodec) -> None:
    x = torch.randn(300)
    base = torch.randn(300)
    acc = base.clone()
    codec.decode_into(codec.encode(x), acc, accumulate=True)
    assert torch.allclose(acc, base + roundtrip(codec, x), atol=1e-6)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: f"{c.dtype}-{c.align}")
def test_decode_refuses_a_chunk_of_the_wrong_size_without_writing(codec: TensorCodec) -> None:
    data = codec.encode(torch.randn(100))
    out = torch.full((100,), 7.0)
    for wrong in (data[:-1], data + b"\x00"):
        with pytest.raises(ProtocolError) as exc:
            codec.decode_into(wrong, out)
        assert exc.value.reason is Reason.BAD_SIZE
    assert torch.equal(out, torch.full((100,), 7.0))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0])
def test_int8_refuses_scales_no_encoder_produces(scale: float) -> None:
    codec = Int8BlockCodec(64)
    data = bytearray(codec.encode(torch.randn(64)))
    data[:4] = struct.pack("<f", scale)
    with pytest.raises(ProtocolError) as exc:
        codec.decode_into(bytes(data), torch.empty(64))
    assert exc.value.reason is Reason.MALFORMED


def test_codecs_refuse_tensors_they_cannot_address() -> None:
    codec = Fp32Codec()
    for bad in (torch.randn(4, 4), torch.randn(8)[::2], torch.randn(4, dtype=torch.float64)):
        with pytest.raises(ValueError):
            codec.encode(bad)
    with pytest.raises(ValueError):
        codec.encode_into(torch.randn(4), bytearray(15))


def test_get_codec_knows_the_three_wire_dtypes() -> None:
    assert isinstance(get_codec("fp32"), Fp32Codec)
    assert isinstance(get_codec(WireDtype.BF16), Bf16Codec)
    assert get_codec("int8", int8_block=128).align == 128
    with pytest.raises(ValueError):
        get_codec("fp8")


def test_tensor_bytes_is_a_zero_copy_view() -> None:
    t = torch.zeros(2)
    view = tensor_bytes(t)
    view[:4] = struct.pack("<f", 1.5)
    assert float(t[0]) == 1.5


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["fp32", "bf16", "int8"]),
    st.integers(min_value=0, max_value=300),
    st.binary(max_size=1500),
    st.booleans(),
)
def test_decoders_on_garbage_raise_only_protocol_or_value_errors(
    dtype: str, numel: int, data: bytes, accumulate: bool
) -> None:
    codec = get_codec(dtype, int8_block=64)
    out = torch.zeros(numel)
    try:
        codec.decode_into(data, out, accumulate=accumulate)
    except (ProtocolError, ValueError):
        pass


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=1, max_value=300), st.data())
def test_decoders_on_right_sized_garbage_raise_only_protocol_errors(numel: int, data: st.DataObject) -> None:
    codec = get_codec(data.draw(st.sampled_from(["fp32", "bf16", "int8"])), int8_block=64)
    payload = data.draw(st.binary(min_size=codec.encoded_size(numel), max_size=codec.encoded_size(numel)))
    try:
        codec.decode_into(payload, torch.zeros(numel))
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
    x = torch.randn(50_001)
    plan = ChunkPlan.for_frame_size(x.numel(), codec, max_frame_size=16384)
    sender, receiver = channel_pair(16384)
    out = torch.full_like(x, float("nan"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_tensor, sender, x, plan)
        assert await recv_tensor(receiver, out, plan) == plan.total_bytes
    expected = torch.empty_like(x)
    for start, stop in plan:  # chunk-aligned blocks: the same as encoding each chunk alone
        codec.decode_into(codec.encode(x[start:stop]), expected[start:stop])
    assert torch.equal(bits(out), bits(expected))
    if isinstance(codec, Fp32Codec):
        assert torch.equal(bits(out), bits(x))


async def test_chunked_transfer_can_accumulate_into_a_sum() -> None:
    x, base = torch.randn(10_000), torch.randn(10_000)
    plan = ChunkPlan.for_frame_size(x.numel(), Fp32Codec(), max_frame_size=4096)
    sender, receiver = channel_pair(4096)
    acc = base.clone()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_tensor, sender, x, plan)
        await recv_tensor(receiver, acc, plan, accumulate=True)
    assert torch.equal(acc, base + x)


async def test_sender_stopping_mid_transfer_is_a_clean_truncation_error() -> None:
    x = torch.randn(10_000)
    plan = ChunkPlan.for_frame_size(x.numel(), Bf16Codec(), max_frame_size=4096)
    sender, receiver = channel_pair(4096)
    await sender.send(Bf16Codec().encode(x[: plan.chunk_elems]))
    await sender.aclose()
    with pytest.raises(ProtocolError) as exc:
        await recv_tensor(receiver, torch.empty_like(x), plan)
    assert exc.value.reason is Reason.TRUNCATED


async def test_chunk_of_another_dtype_is_refused_by_size() -> None:
    x = torch.randn(10_000)
    sender, receiver = channel_pair(1 << 16)
    await sender.send(Fp32Codec().encode(x[:1024]))  # the peer encodes fp32...
    expected_plan = ChunkPlan(x.numel(), Bf16Codec(), 1024)  # ...where the header said bf16
    with pytest.raises(ProtocolError) as exc:
        await recv_tensor(receiver, torch.empty_like(x), expected_plan)
    assert exc.value.reason is Reason.BAD_SIZE


async def test_transfer_refuses_a_tensor_that_does_not_match_the_plan() -> None:
    sender, _ = channel_pair(4096)
    with pytest.raises(ValueError):
        await send_tensor(sender, torch.randn(10), ChunkPlan(11, Fp32Codec(), 4))

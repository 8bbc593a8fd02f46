"""protocols/lowbit.py: top-k with packed indices and 2-bit values (issue #51, item 2).

What these prove: the packed layout round-trips what it keeps (the right positions, the right signs, each
group's mean as its magnitude, so a block's kept mass per group is exact); the encoded size depends on the
element count only and is far below the int8 top-k's; any chunking of whole blocks decodes the same values (the
worker's error feedback rests on it); error feedback over the codec loses nothing, only defers; a malformed
frame is a ProtocolError that writes nothing (a mis-sized one, accumulating decodes and chunked transfers:
tests/test_compression.py, beside the int8 top-k's); and the trial presets stay out of `sync.compression`.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.wire import ProtocolError, Reason
from protocols.codec import TopKCodec, round_trip
from protocols.compress import BLOCK, EXPERIMENTAL, PRESETS, get_compression
from protocols.lowbit import TopKLowBitCodec, pack_bits, unpack_bits


def randn(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n, dtype=np.float32)


@given(st.integers(1, 16).flatmap(lambda b: st.tuples(st.just(b), st.lists(st.integers(0, (1 << b) - 1),
                                                                            max_size=300))))
@settings(max_examples=60, deadline=None)
def test_packed_bits_round_trip_at_every_width(case: tuple[int, list[int]]) -> None:
    bits, values = case
    arr = np.array(values, dtype=np.uint32)
    out = np.zeros((len(values) * bits + 7) // 8, dtype=np.uint8)
    pack_bits(arr, bits, out)
    assert unpack_bits(out, len(values), bits).tolist() == values


@pytest.mark.parametrize(("numel", "block", "keep", "bits"), [(300, 64, 8, 2), (100, 64, 8, 3), (4096 * 2 + 5, BLOCK, 64, 2),
                                                              (50, 64, 64, 4), (7, 64, 8, 2)])
def test_it_keeps_the_largest_entries_with_their_signs_and_each_groups_mean_magnitude(
        numel: int, block: int, keep: int, bits: int) -> None:
    codec = TopKLowBitCodec(block, keep, bits)
    x = randn(numel, seed=numel)
    out = np.full(numel, 7.0, np.float32)
    codec.decode_into(codec.encode(x), out)
    levels = 1 << (bits - 1)
    for lo in range(0, numel, block):
        xb, ob = x[lo : lo + block], out[lo : lo + block]
        k = min(keep, xb.size)
        kept = np.sort(np.argsort(-np.abs(xb), kind="stable")[:k])
        assert set(np.flatnonzero(ob)) == set(kept.tolist())
        assert (np.sign(ob[kept]) == np.sign(xb[kept])).all()
        ranked = np.sort(np.abs(xb[kept]))
        bounds = [-(-g * k // levels) for g in range(levels + 1)]
        for g in range(levels):  # each group's decoded mass is its true mass
            group = ranked[bounds[g] : bounds[g + 1]]
            if group.size:
                decoded = np.sort(np.abs(ob[kept]))[bounds[g] : bounds[g + 1]]
                assert decoded.sum() == pytest.approx(group.sum(), rel=1e-5)


def test_the_encoded_size_depends_on_the_element_count_only_and_is_a_fraction_of_the_int8_top_ks() -> None:
    codec = TopKLowBitCodec(BLOCK, 64, 2)
    assert len(codec.encode(randn(10_000, 1))) == len(codec.encode(np.zeros(10_000, np.float32))) \
        == codec.encoded_size(10_000)
    per_block = codec.encoded_size(BLOCK)
    assert per_block == 4 * 2 + 64 * 12 // 8 + 64 * 2 // 8 == 120
    assert per_block < 0.62 * TopKCodec(BLOCK, 64).encoded_size(BLOCK)
    assert EXPERIMENTAL["k64q2"].bytes_per_param(10_000_000) <= 0.1
    assert EXPERIMENTAL["k128q2"].bytes_per_param(10_000_000) <= 0.1


def test_error_feedback_through_the_codec_defers_and_loses_nothing() -> None:
    """D_t = Delta_t + e_{t-1}; the wire carries Q(D_t); e_t = D_t - Q(D_t): what was sent plus the last
    residual is the sum of the true Deltas (the worker's `_feed_back`, with this codec)."""
    codec = TopKLowBitCodec(64, 4, 2)
    residual = np.zeros(640, np.float32)
    true_sum, sent_sum = np.zeros(640, np.float64), np.zeros(640, np.float64)
    for t in range(20):
        delta = randn(640, seed=t)
        d = delta + residual
        q = np.empty_like(d)
        round_trip(codec, d, q)
        residual = d - q
        true_sum += delta
        sent_sum += q
    assert np.allclose(sent_sum + residual, true_sum, atol=1e-4)
    assert np.abs(residual).max() < np.abs(true_sum).max()  # deferred, bounded: nothing piles up unsent


def _index_bytes_at(codec: TopKLowBitCodec, numel: int) -> int:
    blocks = -(-numel // codec.block)
    return 4 * codec.levels * blocks


def _with_indices(codec: TopKLowBitCodec, data: bytearray, numel: int, change: dict[int, int]) -> bytes:
    """`data` with the kept entries' indices at positions `change` replaced (repacked in place)."""
    _, _, _, kept = codec._layout(numel)
    at = _index_bytes_at(codec, numel)
    size = (kept * codec.index_bits + 7) // 8
    packed = np.frombuffer(bytes(data[at : at + size]), np.uint8).copy()
    idx = unpack_bits(packed, kept, codec.index_bits)
    for pos, value in change.items():
        idx[pos] = value
    pack_bits(idx, codec.index_bits, packed)
    data[at : at + size] = packed.tobytes()
    return bytes(data)


@pytest.mark.parametrize("mutate", [
    pytest.param(lambda c, d: _with_indices(c, d, 100, {1: 0}), id="repeated-index"),  # 0 after 0.. or equal
    pytest.param(lambda c, d: _with_indices(c, d, 100, {0: 60, 1: 3}), id="decreasing-index"),
    pytest.param(lambda c, d: _with_indices(c, d, 100, {15: 40}), id="index-beyond-the-short-tail-block"),
    pytest.param(lambda c, d: bytes(d[:0] + np.array([np.nan], np.float32).tobytes() + d[4:]), id="nan-level"),
    pytest.param(lambda c, d: bytes(d[:4] + np.array([np.inf], np.float32).tobytes() + d[8:]), id="infinite-level"),
    pytest.param(lambda c, d: bytes(d[:0] + np.array([-1.0], np.float32).tobytes() + d[4:]), id="negative-level"),
])
def test_malformed_frames_are_protocol_errors_and_write_nothing(mutate: object) -> None:
    codec = TopKLowBitCodec(64, 8, 2)
    data = bytearray(codec.encode(randn(100, seed=3)))
    bad = mutate(codec, data)  # type: ignore[operator]
    out = np.full(100, 7.0, np.float32)
    with pytest.raises(ProtocolError) as info:
        codec.decode_into(bad, out)
    assert info.value.reason is Reason.MALFORMED
    assert (out == 7.0).all()


def test_non_finite_values_are_not_encoded_and_bad_parameters_are_named() -> None:
    x = randn(100)
    x[3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        TopKLowBitCodec(64, 8, 2).encode(x)
    with pytest.raises(ValueError, match="2..8 bits"):
        TopKLowBitCodec(64, 8, 1)
    with pytest.raises(ValueError, match="keep"):
        TopKLowBitCodec(64, 65, 2)


def test_the_trial_presets_are_no_sync_compression_choice_until_the_judge_picks_one() -> None:
    assert not set(EXPERIMENTAL) & set(PRESETS)
    with pytest.raises(ValueError, match="unknown compression"):
        get_compression("k64q2")
    assert isinstance(EXPERIMENTAL["k64q2"].delta_codec("bf16"), TopKLowBitCodec)
    assert isinstance(PRESETS["high"].delta_codec("bf16"), TopKCodec)  # the shipped presets are unchanged

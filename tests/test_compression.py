"""`sync.compression`: the top-k codec, the presets, the worker's error feedback and the fragment pull.

What these prove: the top-k wire format round-trips exactly what it can represent and bounds the error of
the rest; a malformed top-k frame is a ProtocolError and writes nothing; the worker's reproduction of what
the wire carried (`round_trip`) is bit for bit what a chunked transfer decodes; error feedback loses nothing
of a node's updates (what was sent plus the residual is the sum of the true Deltas); and the pull on a phi
fragment is the exact pull on its coordinates and nothing elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import trio
import trio.testing

from node.bridge.ckptfile import CheckpointError
from node.bridge.exchange import ExchangeOutcome
from node.config.train import TrainConfig
from node.worker.outer import OuterHyper, noloco_step
from node.worker.trainer import Trainer, feed_back_own_in_full
from p2p.wire import PlainFrameChannel, ProtocolError, Reason, TrioByteStream
from protocols.codec import ChunkPlan, TopKCodec, get_codec, recv_tensor, round_trip, send_tensor
from protocols.compress import BLOCK, EXPERIMENTAL, PRESETS, get_compression
from protocols.lowbit import TopKLowBitCodec

TINY = TrainConfig(d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=4, data_bytes=100_000,
                   eval_batches=1, warmup=2, lr=3e-3, inner_steps=5, max_lag=2, checkpoint_every=1)


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def randn(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n, dtype=np.float32)


def decode(codec: TopKCodec, data: bytes, n: int) -> np.ndarray:
    out = np.full(n, 7.0, np.float32)
    codec.decode_into(data, out)
    return out


# ---------------------------------------------------------------------------------------------
# The top-k codec
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("numel", [1, 7, 64, 100, 129, 300])
def test_topk_is_exact_for_sparse_blocks_of_representable_values(numel: int) -> None:
    """At most k non-zeros per block, each a multiple of a power-of-two step whose block absmax is 127 steps:
    the int8 codes and the indices carry them exactly, and everything else decodes as 0."""
    codec = TopKCodec(64, 8)
    rng = np.random.default_rng(numel)
    x = np.zeros(numel, np.float32)
    for lo in range(0, numel, 64):
        width = min(64, numel - lo)
        where = rng.choice(width, size=min(8, width), replace=False)
        codes = rng.integers(-127, 128, size=where.size)
        codes[0] = 127
        x[lo + where] = codes.astype(np.float32) * np.float32(2.0**-7)
    assert np.array_equal(decode(codec, codec.encode(x), numel), x)


@pytest.mark.parametrize("numel", [64, 300, 5000])
def test_topk_keeps_the_largest_entries_with_a_bounded_error(numel: int) -> None:
    codec = TopKCodec(64, 8)
    x = randn(numel, seed=numel)
    y = decode(codec, codec.encode(x), numel)
    for lo in range(0, numel, 64):
        xb, yb = x[lo : lo + 64], y[lo : lo + 64]
        mags = np.sort(np.abs(xb))[::-1]
        k = min(8, xb.size)
        step = mags[0] / 127  # the block's int8 step (its scale)
        # The k largest: within half an int8 step; the rest: dropped (0), and no larger than the k-th.
        top = np.abs(xb) >= mags[k - 1]
        assert np.abs(yb[top] - xb[top]).max() <= step / 2 * 1.0001
        assert (yb[~top] == 0).all()
        assert np.count_nonzero(yb) <= k


def test_topk_encoded_size_depends_on_the_element_count_only() -> None:
    codec = TopKCodec(BLOCK, 256)
    assert codec.encoded_size(BLOCK) == 4 + 3 * 256
    assert codec.encoded_size(2 * BLOCK + 10) == 3 * 4 + 3 * (2 * 256 + 10)
    assert codec.encoded_size(0) == 0
    for numel in (1, 4095, 4097, 3 * BLOCK):
        assert len(codec.encode(randn(numel))) == codec.encoded_size(numel)
    with pytest.raises(ValueError):
        TopKCodec(1 << 17, 8)  # indices are 16 bits
    with pytest.raises(ValueError):
        TopKCodec(64, 65)


def _frame(codec: TopKCodec, n: int) -> tuple[bytearray, int]:
    """A valid frame of n elements and the offset of its indices."""
    data = bytearray(codec.encode(randn(n, seed=3)))
    blocks = -(-n // codec.block)
    return data, 4 * blocks


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda d, off: d.__setitem__(slice(off, off + 4), np.array([5, 5], np.uint16).tobytes()),
                     id="repeated-index"),
        pytest.param(lambda d, off: d.__setitem__(slice(off, off + 4), np.array([9, 3], np.uint16).tobytes()),
                     id="decreasing-index"),
        pytest.param(lambda d, off: d.__setitem__(slice(off + 14, off + 16), np.array([64], np.uint16).tobytes()),
                     id="index-beyond-block"),
        pytest.param(lambda d, off: d.__setitem__(slice(0, 4), np.array([np.nan], np.float32).tobytes()),
                     id="nan-scale"),
        pytest.param(lambda d, off: d.__setitem__(slice(4, 8), np.array([np.inf], np.float32).tobytes()),
                     id="infinite-scale"),
        pytest.param(lambda d, off: d.__setitem__(slice(0, 4), np.array([-1.0], np.float32).tobytes()),
                     id="negative-scale"),
    ],
)
def test_malformed_topk_frames_are_protocol_errors_and_write_nothing(mutate: object) -> None:
    codec = TopKCodec(64, 8)
    data, off = _frame(codec, 100)
    mutate(data, off)  # type: ignore[operator]
    out = np.full(100, 7.0, np.float32)
    with pytest.raises(ProtocolError) as info:
        codec.decode_into(bytes(data), out)
    assert info.value.reason is Reason.MALFORMED
    assert (out == 7.0).all()


def test_topk_index_beyond_a_short_tail_block_is_refused() -> None:
    """The tail block of 36 elements keeps 8 entries: an index of 36..63 is beyond it."""
    codec = TopKCodec(64, 8)
    data, off = _frame(codec, 100)
    last_tail_index = off + 2 * (8 + 7)
    data[last_tail_index : last_tail_index + 2] = np.array([40], np.uint16).tobytes()
    with pytest.raises(ProtocolError):
        codec.decode_into(bytes(data), np.zeros(100, np.float32))


TOPK_CODECS = [TopKCodec(64, 8), TopKLowBitCodec(64, 8, 2)]  # int8 values; 2-bit ones (protocols/lowbit.py)


@pytest.mark.parametrize("codec", TOPK_CODECS, ids=["int8", "2-bit"])
@pytest.mark.parametrize("size", [-1, 1])
def test_topk_frames_of_the_wrong_size_are_refused(size: int, codec: TopKCodec | TopKLowBitCodec) -> None:
    data = codec.encode(randn(100))
    bad = data[:size] if size < 0 else data + b"\0"
    with pytest.raises(ProtocolError) as info:
        codec.decode_into(bad, np.zeros(100, np.float32))
    assert info.value.reason is Reason.BAD_SIZE


@pytest.mark.parametrize("codec", TOPK_CODECS, ids=["int8", "2-bit"])
def test_topk_decode_accumulates_onto_a_sum(codec: TopKCodec | TopKLowBitCodec) -> None:
    x, base = randn(300, 1), randn(300, 2)
    out = base.copy()
    codec.decode_into(codec.encode(x), out, accumulate=True)
    assert np.allclose(out, base + decode(codec, codec.encode(x), 300), atol=1e-6)  # type: ignore[arg-type]


def test_topk_refuses_to_encode_non_finite_values() -> None:
    x = randn(100)
    x[3] = np.inf
    with pytest.raises(ValueError):
        TopKCodec(64, 8).encode(x)


@pytest.mark.parametrize("codec", [TopKCodec(64, 8), TopKCodec(BLOCK, 256), get_codec("int8", int8_block=64),
                                   TopKLowBitCodec(BLOCK, 64, 2)],
                         ids=lambda c: f"{c.dtype}-{c.align}")
async def test_round_trip_is_bit_for_bit_what_a_chunked_transfer_decodes(codec: object) -> None:
    """The worker's error feedback rests on this: its own `round_trip` of D is what the daemon's partner
    decoded (and what the daemon put in the sum) under any chunk plan."""
    x = randn(3 * BLOCK + 1000, seed=5)
    carried = np.empty_like(x)
    round_trip(codec, x, carried)  # type: ignore[arg-type]
    for chunk in (codec.align, 5 * codec.align):  # type: ignore[attr-defined]
        plan = ChunkPlan(x.size, codec, chunk)  # type: ignore[arg-type]
        a, b = trio.testing.memory_stream_pair()
        out = np.empty_like(x)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_tensor, PlainFrameChannel(TrioByteStream(a)), x, plan)
            await recv_tensor(PlainFrameChannel(TrioByteStream(b)), out, plan)
        assert np.array_equal(out, carried)
    in_place = x.copy()
    round_trip(codec, in_place, in_place)  # type: ignore[arg-type]
    assert np.array_equal(in_place, carried)


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------


def test_presets_meet_their_byte_budgets() -> None:
    numel = 10_000_000
    assert PRESETS["none"].bytes_per_param(numel) == 4.0  # phi and Delta in bf16
    assert PRESETS["medium"].bytes_per_param(numel) <= 0.5
    assert PRESETS["high"].bytes_per_param(numel) <= 0.1
    with pytest.raises(ValueError, match="medium"):
        get_compression("extreme")


def test_fragments_are_block_aligned_and_cover_the_model_once() -> None:
    preset = PRESETS["medium"]
    for numel in (1, BLOCK, 5 * BLOCK + 3, 1_000_003):
        ranges = [preset.fragment_range(numel, f) for f in range(preset.fragments)]
        assert ranges[0][0] == 0 and ranges[-1][1] == numel
        for (_, hi), (lo, _) in zip(ranges, ranges[1:], strict=False):
            assert hi == lo and (lo % BLOCK == 0 or lo == numel)
    assert [preset.fragment_of(s) for s in range(6)] == [0, 1, 2, 3, 0, 1]
    with pytest.raises(ValueError):
        preset.fragment_range(100, 4)


# ---------------------------------------------------------------------------------------------
# The worker: error feedback and the fragment pull
# ---------------------------------------------------------------------------------------------


def flat(trainer: Trainer) -> torch.Tensor:
    out = torch.empty(trainer.numel)
    trainer.gather_theta(out)
    return out


def wire(x: torch.Tensor, codec: object) -> torch.Tensor:
    out = torch.empty_like(x)
    round_trip(codec, x, out)  # type: ignore[arg-type]
    return out


def test_error_feedback_conserves_the_update(tmp_path: Path) -> None:
    """Over group steps (top-k on the wire) and a solo step: the sum of what the wire carried (the whole D
    for the solo step) plus the final residual is the sum of the true Deltas. Nothing is lost, only delayed."""
    preset = get_compression("medium")
    codec = preset.delta_codec("bf16")
    a, b = Trainer(TINY, tmp_path / "a", "peer-a"), Trainer(TINY, tmp_path / "b", "peer-b")
    true_sum, sent_sum = torch.zeros(a.numel, dtype=torch.float64), torch.zeros(a.numel, dtype=torch.float64)
    for outer, solo in enumerate([False, False, True, False, False]):
        slots = {}
        for t in (a, b):
            while not t.publish_due():
                t.inner_step()
            slots[t] = (torch.empty(t.numel), torch.empty(t.numel))
            true_delta = flat(t) - t.phi
            t.publish(*slots[t])
            if t is a:
                true_sum += true_delta.double()
                assert torch.allclose(slots[t][1], true_delta + (a.residual if a.residual is not None else 0))
        if solo:
            sent_sum += slots[a][1].double()  # a solo step applies D in full
            for t in (a, b):
                t.apply_result(ExchangeOutcome(1))
            assert a.residual is not None and not a.residual.any()
            continue
        carried = {t: wire(slots[t][1], codec) for t in (a, b)}
        sent_sum += carried[a].double()
        lo, hi = preset.fragment_range(a.numel, preset.fragment_of(outer))
        sum_phi = torch.full((a.numel,), float("nan"))  # outside the fragment: never read
        sum_phi[lo:hi] = wire(slots[a][0][lo:hi], preset.phi_codec("bf16")) + wire(slots[b][0][lo:hi],
                                                                                   preset.phi_codec("bf16"))
        sum_delta = carried[a] + carried[b]
        for t in (a, b):
            assert t.apply_result(ExchangeOutcome(2, compression="medium", phi_range=(lo, hi)),
                                  sum_phi.clone(), sum_delta.clone()) == 2
            assert bool(torch.isfinite(t.phi).all())
        assert a.residual is not None and a.residual.abs().sum() > 0  # top-k left something behind
    assert a.residual is not None
    assert torch.allclose(sent_sum + a.residual.double(), true_sum, atol=1e-5)


def _one_lossy_pair_step(a: Trainer, b: Trainer, outer: int) -> None:
    """a and b publish and apply one `medium` pair step from the sums their wire would carry."""
    preset = get_compression("medium")
    slots = {}
    for t in (a, b):
        while not t.publish_due():
            t.inner_step()
        slots[t] = (torch.empty(t.numel), torch.empty(t.numel))
        t.publish(*slots[t])
    lo, hi = preset.fragment_range(a.numel, preset.fragment_of(outer))
    sum_phi = torch.full((a.numel,), float("nan"))
    sum_phi[lo:hi] = sum(wire(slots[t][0][lo:hi], preset.phi_codec("bf16")) for t in (a, b))
    sum_delta = sum(wire(slots[t][1], preset.delta_codec("bf16")) for t in (a, b))
    for t in (a, b):
        t.apply_result(ExchangeOutcome(2, compression="medium", phi_range=(lo, hi)), sum_phi.clone(),
                       sum_delta.clone())


def test_a_restart_keeps_the_error_feedback_residual_so_nothing_of_the_update_is_lost(tmp_path: Path) -> None:
    """The residual is this node's update not yet carried by the wire: a checkpoint holds it, and a resumed
    worker's next publish carries it, as the worker that never stopped would have."""
    a, b = Trainer(TINY, tmp_path / "a", "peer-a"), Trainer(TINY, tmp_path / "b", "peer-b")
    _one_lossy_pair_step(a, b, 0)
    assert a.residual is not None and a.residual.abs().sum() > 0
    a.save_checkpoint()
    resumed = Trainer(TINY, tmp_path / "a", "peer-a")
    resumed.resume()
    assert resumed.residual is not None and torch.equal(resumed.residual, a.residual)
    for t in (a, resumed):
        while not t.publish_due():
            t.inner_step()
    delta_a, delta_r = torch.empty(a.numel), torch.empty(a.numel)
    a.publish(torch.empty(a.numel), delta_a)
    resumed.publish(torch.empty(a.numel), delta_r)
    assert torch.equal(delta_r, delta_a)  # the same D = Delta + e, bit for bit


def test_a_checkpoint_with_an_empty_residual_stores_none_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    """No 4 bytes per parameter for a residual that holds nothing (after a solo or `none` step), and a
    residual of the wrong size or not finite makes the checkpoint one of another model, set aside."""
    a, b = Trainer(TINY, tmp_path / "a", "peer-a"), Trainer(TINY, tmp_path / "b", "peer-b")
    _one_lossy_pair_step(a, b, 0)
    while not a.publish_due():
        a.inner_step()
    a.publish(torch.empty(a.numel), torch.empty(a.numel))
    a.apply_result(ExchangeOutcome(1))  # a solo step applies D in full: the residual is emptied
    assert a.residual is not None and not a.residual.any()
    assert "residual" not in a.state_dict()
    state = a.state_dict()
    for bad in (torch.zeros(a.numel - 1), torch.full((a.numel,), float("nan"))):
        with pytest.raises(CheckpointError, match="residual"):
            a.check_state({**state, "residual": bad})


def test_uncompressed_results_keep_no_residual(tmp_path: Path) -> None:
    tr = Trainer(TINY, tmp_path, "peer-a")
    while not tr.publish_due():
        tr.inner_step()
    phi, delta = torch.empty(tr.numel), torch.empty(tr.numel)
    tr.publish(phi, delta)
    tr.apply_result(ExchangeOutcome(2), phi + phi, delta + delta)
    assert tr.residual is None  # `none`: no model-sized buffer, and the step is the one it always was


def test_the_fragment_pull_is_the_exact_pull_there_and_nothing_elsewhere() -> None:
    n, lo, hi = 1000, 200, 600
    g = torch.Generator().manual_seed(0)
    phi, partner = torch.randn(n, generator=g), torch.randn(n, generator=g)
    m0, sum_delta = torch.randn(n, generator=g), torch.randn(n, generator=g)
    hyper = OuterHyper()
    exact_phi, exact_m = phi.clone(), m0.clone()
    noloco_step(exact_phi, exact_m, sum_delta, phi + partner, hyper, 2)
    nopull_phi, nopull_m = phi.clone(), m0.clone()
    noloco_step(nopull_phi, nopull_m, sum_delta, phi + phi, hyper, 2)  # equal phis: no pull
    frag_phi, frag_m = phi.clone(), m0.clone()
    sum_phi = torch.full((n,), float("nan"))
    sum_phi[lo:hi] = phi[lo:hi] + partner[lo:hi]
    noloco_step(frag_phi, frag_m, sum_delta, sum_phi, hyper, 2, phi_range=(lo, hi))
    assert torch.equal(frag_m[lo:hi], exact_m[lo:hi]) and torch.equal(frag_phi[lo:hi], exact_phi[lo:hi])
    outside = torch.ones(n, dtype=torch.bool)
    outside[lo:hi] = False
    assert torch.equal(frag_m[outside], nopull_m[outside]) and torch.equal(frag_phi[outside], nopull_phi[outside])


def test_equal_replicas_feel_no_pull_through_a_lossy_wire(tmp_path: Path) -> None:
    """Both phis crossed the wire in int8: the worker's pull is gamma/2 * (Q(phi_p) - Q(phi)), zero for equal
    replicas (without the rewrite it would drag phi towards the int8 grid). `medium` applies our own Delta in
    full and the partner's as carried: the step is beta * (D + Q(D)) / 2."""
    preset = get_compression("medium")
    tr = Trainer(TINY, tmp_path, "peer-a")
    while not tr.publish_due():
        tr.inner_step()
    phi, delta = torch.empty(tr.numel), torch.empty(tr.numel)
    tr.publish(phi, delta)
    lo, hi = preset.fragment_range(tr.numel, 0)
    carried = wire(delta, preset.delta_codec("bf16"))
    sum_phi = torch.zeros(tr.numel)
    sum_phi[lo:hi] = 2 * wire(phi[lo:hi], preset.phi_codec("bf16"))
    before = tr.phi.clone()
    tr.apply_result(ExchangeOutcome(2, compression="medium", phi_range=(lo, hi)), sum_phi, 2 * carried)
    # First step (zero momentum): phi moves by exactly beta * mean Delta (ours whole, the partner's as carried),
    # pull 0.
    assert torch.allclose(tr.phi, before + TINY.beta * (delta + carried) / 2, atol=1e-6)


def test_an_own_exact_lossy_step_applies_our_whole_delta_and_keeps_no_residual(tmp_path: Path) -> None:
    """`auto`'s probe and its way back to `none` (compression_choice.py `keeps_own_exact`): the wire carried
    Q(D) both ways, but this replica applies its own D in full beside the partner's Q(D_p), with the same
    fragment pull as any lossy step, and keeps no residual: nothing of its own update is delayed. The
    reference is the same replica (same seed and peer id) given the sums that step means outright."""
    preset = get_compression("high")
    dcodec, pcodec = preset.delta_codec("bf16"), preset.phi_codec("bf16")
    x, ref = Trainer(TINY, tmp_path / "x", "peer-a"), Trainer(TINY, tmp_path / "ref", "peer-a")
    partner = Trainer(TINY, tmp_path / "p", "peer-b")
    slots = {}
    for t in (x, ref, partner):
        while not t.publish_due():
            t.inner_step()
        slots[t] = (torch.empty(t.numel), torch.empty(t.numel))
        t.publish(*slots[t])
    assert torch.equal(slots[x][1], slots[ref][1]) and torch.equal(slots[x][0], slots[ref][0])
    own_phi, own_d = slots[x]
    lo, hi = preset.fragment_range(x.numel, preset.fragment_of(0))
    sum_phi = torch.full((x.numel,), float("nan"))
    sum_phi[lo:hi] = wire(own_phi[lo:hi], pcodec) + wire(slots[partner][0][lo:hi], pcodec)
    sum_delta = wire(own_d, dcodec) + wire(slots[partner][1], dcodec)
    assert x.apply_result(ExchangeOutcome(2, compression="high", phi_range=(lo, hi), own_exact=True),
                          sum_phi.clone(), sum_delta.clone()) == 2
    # The same step outright: our D plus the partner's Q(D_p), and the lossy pull gamma/2 (Q(phi_p) - Q(phi)).
    exact_phi = sum_phi.clone()
    exact_phi[lo:hi] += 2 * (own_phi[lo:hi] - wire(own_phi[lo:hi], pcodec))
    ref.apply_result(ExchangeOutcome(2, compression="none", phi_range=(lo, hi)), exact_phi,
                     own_d + wire(slots[partner][1], dcodec))
    assert torch.allclose(x.phi, ref.phi, atol=1e-6)
    assert torch.allclose(x.outer.momentum, ref.outer.momentum, atol=1e-6)
    assert x.residual is None  # nothing delayed, and no residual buffer kept
    # Without own_exact `high` takes the same step (our own Delta in full), but keeps the top-k's remainder for
    # the next partner; plain error feedback (`high-deferred`) also defers most of our own Delta: a real difference.
    PRESETS.setdefault("high-deferred", EXPERIMENTAL["high-deferred"])
    try:
        y, z = (Trainer(TINY, tmp_path / name, "peer-a") for name in ("y", "z"))
        for t in (y, z):
            while not t.publish_due():
                t.inner_step()
            t.publish(torch.empty(t.numel), torch.empty(t.numel))
        y.apply_result(ExchangeOutcome(2, compression="high", phi_range=(lo, hi)), sum_phi.clone(),
                       sum_delta.clone())
        z.apply_result(ExchangeOutcome(2, compression="high-deferred", phi_range=(lo, hi)), sum_phi.clone(),
                       sum_delta.clone())
    finally:
        PRESETS.pop("high-deferred", None)
    assert y.residual is not None and y.residual.abs().sum() > 0
    assert torch.allclose(y.phi, x.phi, atol=1e-6)
    assert z.residual is not None and torch.equal(z.residual, y.residual)
    assert not torch.allclose(z.phi, x.phi, atol=1e-6)


def test_own_in_full_keeps_plain_error_feedbacks_residual_but_takes_its_own_delta_whole(tmp_path: Path) -> None:
    """`Compression.own_in_full` (presets `medium`, `high`, `k64q2-own`): with a residual e from earlier steps, the
    published D + e crossed the wire as Q(D + e). The residual becomes (D + e) - Q(D + e), the bits plain error
    feedback keeps (the partner gets the rest later), while our own term of the sum becomes D: not Q(D + e),
    which deferred most of our own update, and not D + e, whose e was applied when it was learnt. Over several
    codec passes (more than PASS_ELEMS entries), so the piecewise loop is covered."""
    own_preset = get_compression("high")
    assert own_preset.own_in_full
    codec = own_preset.delta_codec("bf16")
    g = torch.Generator().manual_seed(3)
    n = 3 * 65_536 + 5 * BLOCK + 17
    delta, e, partner = (torch.randn(n, generator=g) for _ in range(3))
    e.mul_(0.3)
    published = delta + e
    carried = wire(published, codec)
    own, residual, sum_delta = published.clone(), e.clone(), carried + partner
    feed_back_own_in_full(own, residual, sum_delta, own_preset)
    assert torch.equal(residual, published - carried)  # plain error feedback's residual, bit for bit
    assert torch.allclose(own, delta, atol=1e-6)
    assert torch.allclose(sum_delta, delta + partner, atol=1e-5)


def test_a_step_of_an_own_in_full_preset_is_our_delta_whole_and_the_partners_as_carried(tmp_path: Path) -> None:
    """Through `apply_result`: the same step outright (our D plus the partner's Q(D_p), the lossy pull) gives the
    same phi and momentum, and the residual is the one plain error feedback (`high-deferred`, `high` until the
    own Delta in full became its rule) keeps from the same state."""
    PRESETS.setdefault("high-deferred", EXPERIMENTAL["high-deferred"])
    try:
        preset = get_compression("high")
        dcodec, pcodec = preset.delta_codec("bf16"), preset.phi_codec("bf16")
        x, ref, y = (Trainer(TINY, tmp_path / name, "peer-a") for name in ("x", "ref", "y"))
        partner = Trainer(TINY, tmp_path / "p", "peer-b")
        slots = {}
        for t in (x, ref, y, partner):
            while not t.publish_due():
                t.inner_step()
            slots[t] = (torch.empty(t.numel), torch.empty(t.numel))
            t.publish(*slots[t])
        own_phi, own_d = slots[x]
        lo, hi = preset.fragment_range(x.numel, preset.fragment_of(0))
        sum_phi = torch.full((x.numel,), float("nan"))
        sum_phi[lo:hi] = wire(own_phi[lo:hi], pcodec) + wire(slots[partner][0][lo:hi], pcodec)
        sum_delta = wire(own_d, dcodec) + wire(slots[partner][1], dcodec)
        x.apply_result(ExchangeOutcome(2, compression="high", phi_range=(lo, hi)), sum_phi.clone(),
                       sum_delta.clone())
        y.apply_result(ExchangeOutcome(2, compression="high-deferred", phi_range=(lo, hi)), sum_phi.clone(),
                       sum_delta.clone())
        exact_phi = sum_phi.clone()
        exact_phi[lo:hi] += 2 * (own_phi[lo:hi] - wire(own_phi[lo:hi], pcodec))
        ref.apply_result(ExchangeOutcome(2, compression="none", phi_range=(lo, hi)), exact_phi,
                         own_d + wire(slots[partner][1], dcodec))
        assert torch.allclose(x.phi, ref.phi, atol=1e-6)
        assert torch.allclose(x.outer.momentum, ref.outer.momentum, atol=1e-6)
        assert x.residual is not None and y.residual is not None and torch.equal(x.residual, y.residual)
        assert not torch.allclose(x.phi, y.phi, atol=1e-6)  # plain error feedback deferred most of our own D
    finally:
        PRESETS.pop("high-deferred", None)

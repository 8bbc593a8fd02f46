"""Late-join snapshot download: verified chunks, several donors at once, resumable, donors limit service."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import multiaddr
import numpy as np
import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr

from p2p.host import build_host
from p2p.wire import LibP2PByteStream, PlainFrameChannel, recv_as, send_msg
from protocols import snapshot as snap
from protocols.codec import tensor_bytes

LISTEN = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
NUMEL = int(snap.CHUNK_ELEMS * 3.5)
OURS = snap.ModelShape("L", NUMEL)  # the joiner's own model


def randn(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n, dtype=np.float32)


async def hosts(stack: AsyncExitStack, n: int) -> list:
    hs = [build_host(create_new_key_pair()) for _ in range(n)]
    for h in hs:
        await stack.enter_async_context(h.run(LISTEN))
    for h in hs[1:]:
        await hs[0].connect(info_from_p2p_addr(h.get_addrs()[0]))
    return hs


def opener(joiner):
    from libp2p.peer.id import ID

    async def open_stream(donor: str):
        return await joiner.new_stream(ID.from_base58(donor), [snap.PROTOCOL_ID])

    return open_stream


async def test_two_donors_at_once_give_their_verified_mean_and_low_median_counters(tmp_path: Path) -> None:
    a, b = randn(NUMEL, 1), randn(NUMEL, 2)
    snaps = [snap.Snapshot.of(a, 100, 10, "L"), snap.Snapshot.of(b, 120, 12, "L")]
    async with AsyncExitStack() as stack:
        joiner, d1, d2 = await hosts(stack, 3)
        for donor, s in ((d1, snaps[0]), (d2, snaps[1])):
            donor.set_stream_handler(snap.PROTOCOL_ID, snap.SnapshotServer(lambda s=s: s).handle)
        dl = snap.JoinDownload(tmp_path / "dl", OURS)
        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                for donor in (d1, d2):
                    n.start_soon(lambda d=donor: dl.fetch(opener(joiner), str(d.get_id()), timeout_s=20))
        state = snap.combine(dl.complete())
    assert isinstance(state["phi"], np.ndarray) and state["phi"].dtype == np.float32
    assert np.array_equal(state["phi"], (a + b) / 2)  # float32 sum, then division: as the torch code did
    assert (state["step"], state["outer_step"], state["layout_hash"]) == (100, 10, "L")
    assert len(state["donors"]) == 2


async def test_an_interrupted_download_resumes_from_the_first_missing_chunk(tmp_path: Path) -> None:
    phi = randn(NUMEL, 3)
    s = snap.Snapshot.of(phi, 50, 5, "L")
    requests: list[snap.SnapRequest] = []

    async def flaky(stream) -> None:  # serves the meta and two chunks, then the donor "dies"
        control = LibP2PByteStream(stream)
        requests.append(await recv_as(control, snap.SnapRequest))
        await send_msg(control, s.meta(), max_bytes=snap.MAX_META_BYTES)
        channel = PlainFrameChannel(control, max_frame_size=snap.FRAME)
        raw = tensor_bytes(s.phi)
        for i in range(2):
            await channel.send(raw[i * snap.FRAME : (i + 1) * snap.FRAME])
        # It ends the stream early. (A reset could overtake the second chunk, still in the muxer's buffers:
        # the joiner then held one chunk, not two, and the test failed by chance.)
        await stream.close()

    server = snap.SnapshotServer(lambda: s)

    async def honest(stream) -> None:
        requests.append(None)  # marker: the second attempt reached the honest server
        await server.handle(stream)

    async with AsyncExitStack() as stack:
        joiner, donor = await hosts(stack, 2)
        donor.set_stream_handler(snap.PROTOCOL_ID, flaky)
        first = await snap.JoinDownload(tmp_path / "dl", OURS).fetch(opener(joiner), str(donor.get_id()), timeout_s=10)
        assert not first.done and first.have == 2 and first.error
        donor.set_stream_handler(snap.PROTOCOL_ID, honest)
        dl = snap.JoinDownload(tmp_path / "dl", OURS)  # a new process would start exactly like this
        second = await dl.fetch(opener(joiner), str(donor.get_id()), timeout_s=10)
        assert second.done and second.bytes == (NUMEL - 2 * snap.CHUNK_ELEMS) * 4  # only the missing part moved
        state = snap.combine(dl.complete())
    assert np.array_equal(state["phi"], phi)


async def test_a_chunk_that_does_not_match_its_hash_stops_the_download(tmp_path: Path) -> None:
    s = snap.Snapshot.of(randn(NUMEL, 4), 1, 1, "L")

    async def liar(stream) -> None:
        control = LibP2PByteStream(stream)
        await recv_as(control, snap.SnapRequest)
        await send_msg(control, s.meta(), max_bytes=snap.MAX_META_BYTES)
        await PlainFrameChannel(control, max_frame_size=snap.FRAME).send(b"\x01" * snap.FRAME)
        await trio.sleep(5)

    async with AsyncExitStack() as stack:
        joiner, donor = await hosts(stack, 2)
        donor.set_stream_handler(snap.PROTOCOL_ID, liar)
        p = await snap.JoinDownload(tmp_path / "dl", OURS).fetch(opener(joiner), str(donor.get_id()), timeout_s=10)
    assert not p.done and p.have == 0 and "hash" in p.error


async def test_a_donor_serving_its_limit_answers_busy(tmp_path: Path) -> None:
    s = snap.Snapshot.of(randn(NUMEL, 5), 1, 1, "L")
    server = snap.SnapshotServer(lambda: s, max_serving=0)
    async with AsyncExitStack() as stack:
        joiner, donor = await hosts(stack, 2)
        donor.set_stream_handler(snap.PROTOCOL_ID, server.handle)
        p = await snap.JoinDownload(tmp_path / "dl", OURS).fetch(opener(joiner), str(donor.get_id()), timeout_s=10)
    assert not p.done and p.error.startswith("busy") and server.refused_busy == 1


class ChunksLease:
    """A live snapshot's lease that holds for `chunks` checks (chunks sent), then the weights "change"."""

    def __init__(self, chunks: int) -> None:
        self.left, self.released = chunks, 0

    def valid(self) -> bool:
        self.left -= 1
        return self.left >= 0

    def release(self) -> None:
        self.released += 1


async def test_live_weights_are_served_first_and_a_cut_download_gets_the_checkpoint_next(tmp_path: Path) -> None:
    live_phi, ckpt_phi = randn(NUMEL, 6), randn(NUMEL, 7)
    checkpoint = snap.Snapshot.of(ckpt_phi, 10, 1, "L")
    leases: list[ChunksLease] = []
    has_checkpoint = True

    async def live() -> snap.Snapshot:
        leases.append(ChunksLease(2 if len(leases) == 0 else 99))
        s = snap.Snapshot.of(live_phi, 90, 9, "L")
        return snap.Snapshot(s.phi, s.step, s.outer_step, s.layout_hash, s.chunk_hashes, s.snapshot_id, lease=leases[-1])

    server = snap.SnapshotServer(lambda: checkpoint if has_checkpoint else None, live=live)
    async with AsyncExitStack() as stack:
        joiner, donor = await hosts(stack, 2)
        donor.set_stream_handler(snap.PROTOCOL_ID, server.handle)
        cut = await snap.JoinDownload(tmp_path / "dl", OURS).fetch(opener(joiner), str(donor.get_id()), timeout_s=10)
        # Two chunks copied while the lease held went out (and matched their hashes); the third did not.
        assert not cut.done and cut.have == 2 and cut.meta["outer_step"] == 9
        assert leases[0].released == 1 and str(joiner.get_id()) in server.cut_peers
        dl = snap.JoinDownload(tmp_path / "dl", OURS)
        second = await dl.fetch(opener(joiner), str(donor.get_id()), timeout_s=10)
        assert second.done and second.meta["outer_step"] == 1  # the checkpoint, which no outer step cuts
        assert np.array_equal(snap.combine(dl.complete())["phi"], ckpt_phi)
        has_checkpoint = False  # with nothing else to serve, a cut joiner gets the live weights again
        dl = snap.JoinDownload(tmp_path / "dl2", OURS)
        third = await dl.fetch(opener(joiner), str(donor.get_id()), timeout_s=10)
        assert third.done and third.meta["outer_step"] == 9 and leases[-1].released == 1
        assert np.array_equal(snap.combine(dl.complete())["phi"], live_phi)
    assert (server.served, server.served_live) == (2, 1)  # the checkpoint, then the live weights whole


async def test_with_no_checkpoint_and_no_still_weights_a_donor_says_why(tmp_path: Path) -> None:
    async def live() -> None:
        return None

    server = snap.SnapshotServer(lambda: None, live=live)
    async with AsyncExitStack() as stack:
        joiner, donor = await hosts(stack, 2)
        donor.set_stream_handler(snap.PROTOCOL_ID, server.handle)
        p = await snap.JoinDownload(tmp_path / "dl", OURS).fetch(opener(joiner), str(donor.get_id()), timeout_s=10)
    assert not p.done and p.error == f"none: {snap.NO_SNAPSHOT}"


def test_a_snapshot_of_a_tensor_is_the_snapshot_of_its_values_as_flat_float32() -> None:
    """The worker's checkpoint may hold a torch tensor of any shape (or one that requires grad): it is
    served as the same flat float32 values, with the same chunk hashes, as the numpy array would be."""
    values = randn(snap.CHUNK_ELEMS + 10, 6)
    expected = snap.Snapshot.of(values, 3, 1, "L")
    assert expected.phi.dtype == np.float32 and expected.phi.shape == (values.size,)
    for phi in (torch.from_numpy(values.copy()).reshape(2, -1), torch.from_numpy(values.copy()).requires_grad_(),
                values.astype(np.float64)):
        s = snap.Snapshot.of(phi, 3, 1, "L")
        assert np.array_equal(s.phi, values)
        assert (s.chunk_hashes, s.snapshot_id) == (expected.chunk_hashes, expected.snapshot_id)


def donor_file(tmp_path: Path, name: str, phi: np.ndarray, **meta: object) -> tuple[snap.DonorProgress, Path]:
    path = tmp_path / f"{name}.bin"
    phi.astype("<f4").tofile(path)
    fields = {"layout_hash": "L", "numel": phi.size, "step": 1, "outer_step": 1, **meta}
    return snap.DonorProgress(name, meta=fields, done=True), path


def test_combine_returns_the_float32_mean_of_two_donors_on_the_majority_layout(tmp_path: Path) -> None:
    a, b, c = randn(1000, 7), randn(1000, 8), randn(1000, 9)
    # The odd one out comes first: the first donor no longer decides the layout.
    state = snap.combine([donor_file(tmp_path, "c", c, layout_hash="other", step=99),
                          donor_file(tmp_path, "a", a, step=5), donor_file(tmp_path, "b", b, outer_step=4)])
    assert state["phi"].dtype == np.float32 and state["phi"].shape == (1000,)
    assert np.array_equal(state["phi"], (a + b) / np.float32(2))
    assert (state["step"], state["outer_step"], state["donors"]) == (1, 1, ["a", "b"])


def test_combine_leaves_out_a_donor_whose_file_is_not_the_size_its_meta_says(tmp_path: Path) -> None:
    """A donor that claims twice the values, listed first: before, the honest files were 'too short' and
    the joiner's daemon died with a ValueError; now the liar is left out."""
    a, b = randn(1000, 1), randn(1000, 2)
    liar = donor_file(tmp_path, "liar", randn(1000, 3), numel=2000)
    state = snap.combine([liar, donor_file(tmp_path, "a", a), donor_file(tmp_path, "b", b)])
    assert state["donors"] == ["a", "b"] and np.array_equal(state["phi"], (a + b) / np.float32(2))


def test_combine_refuses_a_data_file_shorter_than_its_meta(tmp_path: Path) -> None:
    p, path = donor_file(tmp_path, "a", randn(1000, 10))
    assert p.meta is not None
    p.meta["numel"] = 1001
    with pytest.raises(ValueError, match="no complete download"):
        snap.combine([(p, path)])


def test_combine_refuses_donors_that_disagree_on_the_model_with_no_majority(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="disagree on the model"):
        snap.combine([donor_file(tmp_path, "a", randn(1000, 1)),
                      donor_file(tmp_path, "b", randn(1000, 2), layout_hash="other")])


def test_combine_leaves_out_a_donor_with_values_that_are_not_finite(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(snap, "COMBINE_BLOCK", 300)  # the NaN in a later block than the first
    a, b, bad = randn(1000, 1), randn(1000, 2), randn(1000, 3)
    bad[700] = np.nan
    state = snap.combine([donor_file(tmp_path, "bad", bad), donor_file(tmp_path, "a", a),
                          donor_file(tmp_path, "b", b)])
    assert state["donors"] == ["a", "b"] and np.array_equal(state["phi"], (a + b) / np.float32(2))
    with pytest.raises(ValueError, match="not finite"):
        snap.combine([donor_file(tmp_path, "bad", bad)])


def test_one_lying_donor_of_three_moves_no_weight_and_no_counter_outside_the_honest_ones(
    tmp_path: Path, monkeypatch,
) -> None:
    """The median of three: a finite donor far from the others (1e30 everywhere, 2^50 outer steps) moves
    every weight only within the honest two's range; the counters are an honest donor's."""
    monkeypatch.setattr(snap, "COMBINE_BLOCK", 300)
    a, b = randn(1000, 1), randn(1000, 2)
    liar = np.full(1000, 1e30, dtype=np.float32)
    state = snap.combine([donor_file(tmp_path, "liar", liar, step=1 << 50, outer_step=1 << 50),
                          donor_file(tmp_path, "a", a, step=40, outer_step=4),
                          donor_file(tmp_path, "b", b, step=50, outer_step=5)])
    assert np.array_equal(state["phi"], np.maximum(a, b))  # the median of {a, b, +huge}
    assert (state["step"], state["outer_step"]) == (50, 5)
    assert state["donors"] == ["liar", "a", "b"]


async def test_a_donors_pacer_keeps_all_its_downloads_together_under_its_rate(autojump_clock: Any) -> None:
    """sync.serve_mbps: two downloads of 10 chunks each at 1 MB/s take 20 s together (the trio clock's), and
    take turns; without a limit the pacer never waits."""
    pacer = snap.Pacer(bytes_per_s=1_000_000)
    done: dict[str, float] = {}
    began = trio.current_time()

    async def download(name: str) -> None:
        for _ in range(10):
            await pacer.take(1_000_000)
        done[name] = trio.current_time() - began

    async with trio.open_nursery() as n:
        n.start_soon(download, "a")
        n.start_soon(download, "b")
    assert 19 <= max(done.values()) < 20.5 and min(done.values()) >= 18  # interleaved, not one after the other
    unlimited = snap.Pacer()
    before = trio.current_time()
    for _ in range(100):
        await unlimited.take(1 << 20)
    assert trio.current_time() == before

"""Slow links: a transfer runs as long as it moves, the link's rate is learned from the bytes, and the
worker never idles while the exchange is on the wire (issue: over slow links).

Speeds are not asserted here (they are benchmark figures, bench/wan.py); what is asserted is which
transfers are kept, which are cut and why, and what the worker does meanwhile."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path

import numpy as np
import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr

from node.averaging.averager import Averager
from node.bridge.exchange import ExchangeOutcome, ExchangeRequest
from node.config.sync import SyncConfig
from node.config.train import TrainConfig
from node.worker.task import layout_hash
from node.worker.trainer import Trainer
from p2p.datapath import KeyAgreement
from p2p.host import build_host
from p2p.wire import LibP2PByteStream, PlainFrameChannel, encode_msg, recv_as, send_msg
from protocols import avg
from protocols.avg import Progress, TransferLimits
from starling_testing.averaging import FakeSwarm
from starling_testing.fakes import FakeHost, FakeNetStream
from tests.test_averaging import LISTEN
from tests.test_worker import run_scripted

# -- the limits ---------------------------------------------------------------------------------------

LIMITS = TransferLimits(stall_s=30.0, floor_bps=2_000.0, max_s=3600.0)


def progress_at(times_and_bytes: list[tuple[float, int]]) -> Progress:
    p = Progress()
    for t, n in times_and_bytes:
        p.first = t if p.first is None else p.first
        p.last = t
        p.bytes += n
    return p


def test_a_transfer_that_keeps_moving_at_a_slow_links_rate_is_never_cut_however_long_it_takes() -> None:
    # 0.4 Mbit/s each way (100 kB/s both ways together), 20 minutes in: a 1B model's outer step on a home link.
    p = progress_at([(0.0, 0), (1199.5, 120_000_000)])
    assert LIMITS.verdict(p, began=0.0, now=1200.0) is None


def test_a_transfer_with_no_byte_for_the_stall_timeout_is_cut_as_stalled() -> None:
    p = progress_at([(0.0, 10_000_000), (10.0, 10_000_000)])
    assert LIMITS.verdict(p, began=0.0, now=39.0) is None
    assert "no byte moved for 30s" in (LIMITS.verdict(p, began=0.0, now=40.5) or "")


def test_a_transfer_where_no_byte_ever_came_is_cut_after_the_stall_timeout() -> None:
    assert LIMITS.verdict(Progress(), began=5.0, now=34.0) is None
    assert "no byte moved" in (LIMITS.verdict(Progress(), began=5.0, now=35.5) or "")


def test_a_trickle_below_the_floor_is_cut_even_though_bytes_keep_coming() -> None:
    # One byte every 10 s never stalls, but holds our outer step hostage: the floor ends it.
    p = progress_at([(float(t), 1) for t in range(0, 60, 10)])
    assert "below the floor" in (LIMITS.verdict(p, began=0.0, now=59.0) or "")


def test_no_transfer_outlives_max_s() -> None:
    p = progress_at([(0.0, 0), (3599.9, 10**12)])
    assert "longer than 3600s" in (LIMITS.verdict(p, began=0.0, now=3600.0) or "")


def test_the_rate_is_taken_over_the_time_bytes_flowed_not_the_whole_exchange() -> None:
    p = progress_at([(100.0, 0), (110.0, 1_000_000)])  # a 100 s wait for the handshake does not count
    assert p.rate_bps() == pytest.approx(100_000)
    assert progress_at([(1.0, 100)]).rate_bps() is None  # one instant says nothing about the link


# -- real averagers, one partner that trickles --------------------------------------------------------

SMALL_LAYOUT = [("w", (200, 100))]
SMALL = 200 * 100
# fp32, so each direction carries 2 x 80 kB: at the pace below the partner's half takes ~11 s, longer
# than the deadline the old code gave it at an assumed 100 Mbit/s (10 s + 3 x the expected 26 ms).
TRICKLE_PIECES = 40
TRICKLE_PAUSE_S = 11.0 / TRICKLE_PIECES


def small_request(seed: int) -> ExchangeRequest:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(SMALL, generator=torch.Generator().manual_seed(0))
    return ExchangeRequest(3, phi=base + torch.randn(SMALL, generator=g) * 0.01,
                           delta=torch.randn(SMALL, generator=g) * 0.01,
                           phi_out=torch.full((SMALL,), float("nan")), delta_out=torch.full((SMALL,), float("nan")),
                           layout=SMALL_LAYOUT, layout_hash=layout_hash(SMALL_LAYOUT))


class SlowWrites:
    """A byte stream whose writes go out in `pieces` slices, `pause_s` apart: a slow link's pace."""

    def __init__(self, stream: LibP2PByteStream, pieces: int, pause_s: float) -> None:
        self.stream, self.pieces, self.pause_s = stream, pieces, pause_s

    async def read(self, max_bytes: int) -> bytes:
        return await self.stream.read(max_bytes)

    async def write(self, data) -> None:
        data = bytes(data)
        step = max(1, len(data) // self.pieces)
        for i in range(0, len(data), step):
            await self.stream.write(data[i : i + step])
            if len(data) > 1024:  # the bulk, not the small control messages
                await trio.sleep(self.pause_s)

    async def aclose(self) -> None:
        await self.stream.aclose()


async def _with_scripted_partner(partner, cfg: SyncConfig, *, pieces: int = 1, pause_s: float = 0.0,
                                 seen: list | None = None, raw_handler=None, prepare=None) -> tuple[int, dict]:
    """Our averager (`cfg`) exchanges with a host whose avg handler runs `partner(channel, request)` after
    the handshake, its writes slowed to `pieces` slices `pause_s` apart; returns our group size and status
    (and appends our status's sync state and transfer to `seen` every half second meanwhile). With
    `raw_handler` the host's handler is that instead, handshake included; `prepare(averager, partner)` runs
    before the exchange."""
    hosts = [build_host(create_new_key_pair()) for _ in range(2)]
    async with AsyncExitStack() as stack:
        for h in hosts:
            await stack.enter_async_context(h.run(LISTEN))
        nursery = await stack.enter_async_context(trio.open_nursery())
        ours = Averager(hosts[0], cfg, FakeSwarm(hosts[0]))
        await nursery.start(ours.run)

        async def handler(stream) -> None:
            control = LibP2PByteStream(stream)
            req = await recv_as(control, avg.AvgRequest)
            await send_msg(control, avg.AvgAnswer(verdict="accept", pubkey=KeyAgreement().public_key,
                                                  session_id=b"x" * 16, outer_step=req.outer_step))
            await recv_as(control, avg.AvgPath)
            slow = SlowWrites(control, pieces, pause_s)
            await partner(PlainFrameChannel(slow, max_frame_size=avg.MAX_FRAME), req)  # type: ignore[arg-type]
            await stream.close()

        hosts[1].set_stream_handler(avg.PROTOCOL_ID, raw_handler or handler)
        await hosts[0].connect(info_from_p2p_addr(hosts[1].get_addrs()[0]))
        async def sample() -> None:
            while seen is not None:
                st = ours.status()
                seen.append((st["state"], st.get("transfer")))
                await trio.sleep(0.5)

        nursery.start_soon(sample)
        if prepare is not None:
            prepare(ours, str(hosts[1].get_id()))
        with trio.fail_after(60):
            outcome = await ours.exchange(small_request(1))
        status = dict(ours.status())
        nursery.cancel_scope.cancel()
    return outcome.group_size, status


def _slow_cfg() -> SyncConfig:
    return SyncConfig(wire_dtype="fp32", pair_window_s=3, datapath=False, stall_timeout_s=5.0, compression="none")


async def _drain(channel: PlainFrameChannel, elems: int) -> None:
    got = 0
    while got < 2 * elems * 4:
        got += len(await channel.recv())


async def test_an_exchange_whose_partner_sends_slowly_but_steadily_completes_and_teaches_its_rate() -> None:
    partner_values = small_request(2)

    async def trickler(channel: PlainFrameChannel, req: avg.AvgRequest) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_drain, channel, req.numel)
            for tensor in (partner_values.phi, partner_values.delta):  # one chunk each (fp32, one frame)
                await channel.send(np.asarray(tensor).tobytes())

    seen: list = []
    size, status = await _with_scripted_partner(trickler, _slow_cfg(), pieces=TRICKLE_PIECES // 2,
                                                pause_s=TRICKLE_PAUSE_S, seen=seen)
    assert size == 2, status["last_error"]
    # Meanwhile status said it was exchanging, and how much had moved.
    moving = [t for state, t in seen if state == "exchanging" and t is not None and t["bytes"] > 0]
    assert moving and moving[-1]["bytes"] > moving[0]["bytes"]
    (peer,) = status["per_peer"].values()
    assert peer["rate_mbps"] is not None and peer["rounds"] == 1


async def test_a_partner_that_goes_silent_mid_transfer_is_cut_as_stalled_and_its_rate_is_still_learned() -> None:
    async def staller(channel: PlainFrameChannel, req: avg.AvgRequest) -> None:
        with trio.move_on_after(0.6):  # three slices of phi's frame, 0.2 s apart, then silence
            await channel.send(b"\x00" * (req.numel * 4))
        await trio.sleep_forever()  # keeps the stream open, sends nothing more

    size, status = await _with_scripted_partner(staller, _slow_cfg(), pieces=8, pause_s=0.2)
    assert size == 1
    assert "no byte moved for 5s" in status["last_error"]
    (peer,) = status["per_peer"].values()
    assert peer["rate_mbps"] is not None and peer["failures"] == 1


# -- the worker: never idle while the exchange is on the wire -------------------------------------------

TINY = TrainConfig(d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=4, data_bytes=100_000,
                   eval_batches=1, warmup=2, lr=3e-3, inner_steps=5, checkpoint_every=1)


def test_by_default_the_worker_trains_on_through_several_outer_steps_worth_of_a_slow_exchange(tmp_path: Path) -> None:
    """The stand-in daemon answers each publish only after the worker took 3H more inner steps: the worker
    never blocks (it would with a max_lag), and the next publish waits for the result (one in flight)."""
    trainer = Trainer(TINY, tmp_path, "peer-a")
    assert trainer.cfg.max_lag == 0 and trainer.cfg.overlap
    h = TINY.inner_steps
    lags = run_scripted(trainer, 3, answer_at_lag=3 * h)
    assert lags == [3 * h, 3 * h, 3 * h]
    assert trainer.blocked_s == 0.0


def test_a_result_applied_outer_steps_late_keeps_everything_learnt_meanwhile(tmp_path: Path) -> None:
    """theta <- theta_now + (phi_new - theta_published), whatever the lag: the outer step moves phi, and the
    inner steps taken while the exchange ran stay on top of it."""
    trainer = Trainer(dataclasses.replace(TINY, outer="diloco"), tmp_path, "peer-a")
    while not trainer.publish_due():
        trainer.inner_step()
    slot_phi, slot_delta = torch.empty(trainer.numel), torch.empty(trainer.numel)
    trainer.publish(slot_phi, slot_delta)
    published = trainer.theta_published.clone()
    phi_before = trainer.phi.clone()
    for _ in range(4 * TINY.inner_steps):  # four outer steps' worth of training while the exchange runs
        trainer.inner_step()
    theta_now = torch.empty(trainer.numel)
    trainer.gather_theta(theta_now)
    partner_delta = torch.randn(trainer.numel) * 1e-3
    sum_delta = slot_delta + partner_delta
    sum_phi = phi_before * 2
    trainer.apply_result(ExchangeOutcome(2), sum_phi, sum_delta)
    theta_after = torch.empty(trainer.numel)
    trainer.gather_theta(theta_after)
    assert not torch.equal(trainer.phi, phi_before)  # the outer step moved phi
    torch.testing.assert_close(theta_after, trainer.phi + (theta_now - published), rtol=0, atol=1e-6)


# -- pairing: a scheduled partner still transferring is waited for -------------------------------------------

class _EveryoneExchanging(FakeHost):
    """Connected to `peers`, each of which answers every pairing request "already exchanging" (busy moving
    its previous outer step); lists whom the averager asked, and when."""

    def __init__(self, key: KeyPair, peers: list[ID], code: avg.AnswerCode = avg.AnswerCode.EXCHANGING) -> None:
        super().__init__(key, peers={p: "10.0.0.2" for p in peers})
        self.asked: list[tuple[str, float]] = []
        self.code = code

    async def new_stream(self, peer: ID, protocols: Sequence[str]) -> FakeNetStream:
        self.asked.append((str(peer), trio.current_time()))
        busy = avg.AvgAnswer(verdict="busy", reason="still moving its last outer step", code=self.code.value)
        return FakeNetStream(encode_msg(busy), peer)


def _asking_a_busy_partner(window: float, code: avg.AnswerCode = avg.AnswerCode.EXCHANGING,
                           ) -> tuple[_EveryoneExchanging, Averager, ID, ID, ExchangeRequest]:
    """Our averager (pairing window `window`) connected to two trainers that answer "exchanging": the one
    the schedule gives us and another (`old`); the request is for an outer step where the schedule gives
    us the first. We are the smaller PeerID of the pair, the one that asks (the larger one waits for it
    and asks once)."""
    from node.averaging.pairing import scheduled_partners

    ours, theirs = sorted((create_new_key_pair() for _ in range(2)), key=lambda k: str(ID.from_pubkey(k.public_key)))
    scheduled, old = ID.from_pubkey(theirs.public_key), ID.from_pubkey(create_new_key_pair().public_key)
    host = _EveryoneExchanging(ours, [scheduled, old], code)
    averager = Averager(host, SyncConfig(pair_window_s=window, datapath=False), FakeSwarm(host))
    request = small_request(1)
    request.outer_step = next(s for s in range(100)
                              if scheduled_partners(averager.me, [str(scheduled), str(old)], s)[0] == str(scheduled))
    return host, averager, scheduled, old, request


async def test_a_scheduled_partner_still_transferring_over_a_slow_link_is_waited_for_not_swapped_for_the_old_one(
    autojump_clock,
) -> None:
    """Pairs end their minutes-long transfers seconds apart. The one that ends first used to give up on its
    scheduled partner after the first answer "exchanging" and pair again with its old partner in the open
    phase (fixed pairs, islands); now it keeps asking the scheduled partner only, for the whole wait
    (`busy_wait_s`: the pairing window here, with no transfer of ours measured yet; longer on a slow link,
    below), though another eligible partner is connected. Only after the wait does an open phase ask anyone."""
    from node.averaging.averager import SCHEDULED_RETRY_S

    window = 1.0
    host, averager, scheduled, old, request = _asking_a_busy_partner(window)
    began = trio.current_time()
    with trio.fail_after(30):
        assert (await averager.exchange(request)).group_size == 1  # it never stopped exchanging
    waited = [peer for peer, at in host.asked if at < began + window]  # the wait (here the window)
    assert len(waited) >= 2 and set(waited) == {str(scheduled)}  # never the old partner while waiting
    assert str(old) in [peer for peer, _ in host.asked]  # after the wait, an open phase: anyone
    # Asked again after the first "exchanging", at the slow pace of a wait (3 x SCHEDULED_RETRY_S, random within
    # it: the last ask may come anywhere after 0.45 s of the 1 s wait, so no tighter bound holds).
    assert max(at for peer, at in host.asked if peer == str(scheduled) and at < began + window) - began >= (
        3 * SCHEDULED_RETRY_S[0])


async def test_the_wait_for_a_busy_scheduled_partner_counts_from_its_first_answer_not_from_our_publish(
    autojump_clock,
) -> None:
    """The larger PeerID of a pair waits to be asked and asks only as its scheduled phase ends; a partner
    that answers "exchanging" then may have begun a whole transfer just before. The wait (`busy_wait_s`)
    is counted from that answer: counted from our publish it ended a fraction of a transfer before the
    partner came free (traced over slow links: solo steps by 0.1-0.5 s)."""
    from node.averaging.pairing import scheduled_partners

    theirs, ours = sorted((create_new_key_pair() for _ in range(2)), key=lambda k: str(ID.from_pubkey(k.public_key)))
    scheduled = ID.from_pubkey(theirs.public_key)  # the smaller: we are the one that waits to be asked
    host = _EveryoneExchanging(ours, [scheduled])
    window = 1.0
    averager = Averager(host, SyncConfig(pair_window_s=window, datapath=False), FakeSwarm(host))
    step = next(s for s in range(100) if scheduled_partners(averager.me, [str(scheduled)], s)[0] == str(scheduled))
    request = small_request(1)
    request.outer_step = step
    began = trio.current_time()
    with trio.fail_after(30):
        assert (await averager.exchange(request)).group_size == 1
    first_answer = host.asked[0][1]
    assert first_answer - began > 0.2  # asked only near the end of the scheduled phase (half the window)
    # The wait (here the window: no transfer of ours measured) runs from that first answer.
    assert trio.current_time() - first_answer >= window


async def test_a_wait_for_a_busy_partner_that_outlasts_the_window_asks_the_other_trainers_too(autojump_clock) -> None:
    """One slow link among fast ones: the two fast trainers that had just averaged with each other each
    waited up to 15 s for a member of the busy slow pair and stepped solo side by side (bench/wan.py,
    one-slow at 0.4 Mbit/s). Within the round's window the wait asks its scheduled partner only; past it,
    it also asks the others (the last partner included) between the asks of the scheduled one."""

    window = 1.0
    host, averager, scheduled, old, request = _asking_a_busy_partner(window)
    averager._transfers_s.append(10.0)  # a slow link: the wait for a busy partner is 15 s
    averager._last_paired[str(old)] = 1  # the partner we last averaged with
    began = trio.current_time()
    with trio.fail_after(60):
        assert (await averager.exchange(request)).group_size == 1
    within = {peer for peer, at in host.asked if at < began + window}
    stretched = [peer for peer, at in host.asked if began + window <= at < began + 15]
    assert within == {str(scheduled)}
    assert str(old) in stretched and str(scheduled) in stretched  # both, taking turns


async def test_a_round_among_partners_busy_in_rounds_of_their_own_looks_as_long_as_a_busy_wait_before_a_solo_step(
    autojump_clock,
) -> None:
    """One slow link among fast ones: the scheduled partner waits for a member of the busy slow pair (it answers
    "waiting for the partner the schedule gives it", no transfer of its own to wait for) and the other fast
    trainer is in a busy wait of its own. The round used to end at its window, a second before that other
    trainer would have taken us (bench/wan.py, one-slow at 0.4 Mbit/s, two solo steps side by side). Partners
    busy in rounds of their own now keep the round looking as long as a busy wait would (`busy_wait_s`: 1.5 x
    our longest recent transfer); on a fast link that is the window itself, as before."""
    window = 1.0
    host, averager, _, _, request = _asking_a_busy_partner(window, avg.AnswerCode.SCHEDULED)
    averager._transfers_s.append(10.0)  # a slow link: the wait is 15 s
    began = trio.current_time()
    with trio.fail_after(60):
        assert (await averager.exchange(request)).group_size == 1  # nobody ever came free
    assert trio.current_time() - began >= 15.0
    # Still asking near the end (the round used to stop at its 1 s window): asks come 0.45-0.9 s apart in a
    # busy wait, with open-phase tries between; one full suite run saw the last at 13.85 s of the 15.
    assert max(at for _, at in host.asked) - began > 13.0

    host, averager, _, _, request = _asking_a_busy_partner(window, avg.AnswerCode.SCHEDULED)
    began = trio.current_time()
    with trio.fail_after(60):
        assert (await averager.exchange(request)).group_size == 1
    assert trio.current_time() - began < 2 * window  # nothing measured (a fast link): the window, as before


def test_the_wait_for_a_busy_partner_follows_the_longest_of_our_recent_transfers() -> None:
    """With one slower link among the partners, a busy partner is often moving its exchange with that link's
    trainer: the wait follows our longest recent transfer (the slow partner's), not a typical fast one."""
    from node.averaging.averager import RECENT_TRANSFERS

    host = FakeHost(create_new_key_pair(), peers={})
    averager = Averager(host, SyncConfig(pair_window_s=2.0, datapath=False), FakeSwarm(host))
    assert averager._busy_wait_s() == 2.0  # nothing measured: the window
    for seconds in (4.0, 7.0, 3.5, 4.2):
        averager._transfers_s.append(seconds)
    assert averager._busy_wait_s() == pytest.approx(1.5 * 7.0)
    for _ in range(RECENT_TRANSFERS):  # the slow one falls out of the recent ones
        averager._transfers_s.append(4.0)
    assert averager._busy_wait_s() == pytest.approx(6.0)


def test_the_wait_for_a_busy_partner_follows_our_own_transfer_time_and_never_drops_below_the_window() -> None:
    from node.averaging.averager import busy_wait_s

    assert busy_wait_s(5.0, None, 3600.0) == 5.0  # no transfer measured yet
    assert busy_wait_s(5.0, 0.05, 3600.0) == 5.0  # loopback
    assert busy_wait_s(5.0, 100.0, 3600.0) == 150.0  # 1.9 MB at 0.4 Mbit/s
    assert busy_wait_s(5.0, 3000.0, 3600.0) == 3600.0  # never past sync.max_transfer_s


async def test_a_partner_that_never_answers_the_pairing_request_fails_with_a_reason_that_names_the_deadline() -> None:
    """A bare `TooSlowError:` was all an operator saw for every exchange of a trainer whose saturated link
    delayed each answer past the deadline (bench/wan.py one-slow, docs/benchmarks.md)."""
    cfg = dataclasses.replace(_slow_cfg(), handshake_timeout_s=0.5, pair_window_s=2)

    async def never_answers(stream) -> None:
        await recv_as(LibP2PByteStream(stream), avg.AvgRequest)
        await trio.sleep_forever()

    size, status = await _with_scripted_partner(None, cfg, raw_handler=never_answers)
    assert size == 1
    assert status["last_error"].endswith(
        "TooSlowError: no answer to the pairing request within 0.5s (sync.handshake_timeout_s)")


async def test_a_partner_measured_slow_is_given_a_queue_of_its_bulk_data_to_answer_a_pairing_request() -> None:
    """A partner busy moving an exchange over a slow link has its answer queued behind that transfer's bytes:
    the 0.08 Mbit/s trainer's answers took over 5 s (bench/wan.py one-slow), every ask of it failed with
    "no answer within 5s", and each failure cost it a back-off and the asker a solo step. With the link
    measured slow, the asker waits as long as `QUEUED_BYTES` take at that rate; unmeasured, the setting."""
    from node.averaging.averager import QUEUED_BYTES

    cfg = dataclasses.replace(_slow_cfg(), handshake_timeout_s=0.5, pair_window_s=2)

    async def answers_late(stream) -> None:
        control = LibP2PByteStream(stream)
        req = await recv_as(control, avg.AvgRequest)
        await trio.sleep(1.0)  # behind its own bulk data in its link's queue
        await send_msg(control, avg.AvgAnswer(verdict="busy", reason="already exchanging", outer_step=req.outer_step,
                                              code=avg.AnswerCode.EXCHANGING.value))
        await stream.close()

    def measured_slow(averager: Averager, partner: str) -> None:
        averager.admission.link(partner).rate_bps = QUEUED_BYTES / 3.0  # a queue's worth takes 3 s

    size, status = await _with_scripted_partner(None, cfg, raw_handler=answers_late, prepare=measured_slow)
    assert size == 1
    (peer,) = status["per_peer"].values()
    assert peer["failures"] == 0 and "no answer" not in (status["last_error"] or "")

    size, status = await _with_scripted_partner(None, cfg, raw_handler=answers_late)  # nothing measured
    assert size == 1
    assert "no answer to the pairing request within 0.5s (sync.handshake_timeout_s)" in status["last_error"]


def test_the_wait_for_a_pairing_answer_follows_the_measured_link_and_stays_bounded() -> None:
    from node.averaging.averager import MAX_ANSWER_WAIT_FACTOR, QUEUED_BYTES

    host = FakeHost(create_new_key_pair(), peers={})
    averager = Averager(host, SyncConfig(handshake_timeout_s=5.0, datapath=False), FakeSwarm(host))
    assert averager._answer_deadline_s("never-met") == 5.0
    averager.admission.link("fast").rate_bps = 1e6  # 8 Mbit/s: a queue's worth in 0.13 s
    assert averager._answer_deadline_s("fast") == 5.0
    averager.admission.link("slow").rate_bps = 1e4  # 0.08 Mbit/s
    assert averager._answer_deadline_s("slow") == pytest.approx(QUEUED_BYTES / 1e4)
    averager.admission.link("crawl").rate_bps = 10.0
    assert averager._answer_deadline_s("crawl") == MAX_ANSWER_WAIT_FACTOR * 5.0  # bounded: 20 s


async def test_a_partner_exchanging_with_someone_else_is_asked_again_after_half_an_exchange_with_it(
    autojump_clock,
) -> None:
    """A slow-link partner that said "exchanging" and was asked again a second later was still moving its
    transfer; its answer sat seconds in its link's queue while the asker turned away its own scheduled
    partner ("asking someone else"). The hold is half an exchange with that partner (its mean bytes over
    the rate measured with it); with nothing measured, the usual second."""
    from node.averaging.averager import _arrays
    from node.averaging.partner_misses import Attempt
    from node.averaging.round import Round

    host, averager, _, old, request = _asking_a_busy_partner(1.0)  # every partner answers "exchanging"
    assert averager._busy_hold_s(str(old)) == 0.0
    link = averager.admission.link(str(old))
    link.rate_bps, link.rounds, link.bytes_sent = 1e4, 2, 200_000  # 100 kB per exchange at 10 kB/s
    assert averager._busy_hold_s(str(old)) == pytest.approx(5.0)
    assert await averager._try_partner(Round(request, _arrays(request)), str(old)) is Attempt.EXCHANGING
    await trio.sleep(4.9)
    assert not averager.admission.may_ask(str(old))
    await trio.sleep(0.2)
    assert averager.admission.may_ask(str(old))


async def test_outside_the_schedule_a_partner_measured_slow_is_asked_only_where_every_partner_is() -> None:
    """bench/wan.py, one-slow at 0.4 Mbit/s: 1 of 49 asks of the 0.08 Mbit/s trainer outside the schedule
    paired (it is busy with its scheduled partner nearly all the time), and while its answer waited seconds
    in its link's queue the asker turned away the fast trainer that asked it. The open phase (and the asks
    beside a busy wait) now choose among the partners that answer within `sync.handshake_timeout_s`."""
    from node.averaging.averager import QUEUED_BYTES

    _, averager, slow, fast, _ = _asking_a_busy_partner(1.0)
    averager.admission.link(str(slow)).rate_bps = QUEUED_BYTES / 20  # its answer may take 20 s
    averager.admission.link(str(fast)).rate_bps = QUEUED_BYTES  # within a second
    assert {averager._choose_partner() for _ in range(20)} == {str(fast)}
    averager.admission.back_off(str(fast), soft=True)
    assert averager._choose_partner() is None  # the fast one backs off: wait, do not ask the slow one
    assert averager._choose_partner(exclude=str(fast)) == str(slow)  # only slow ones left: asked
    averager.admission.link(str(fast)).rate_bps = QUEUED_BYTES / 30  # every partner slow (we are the slow one)
    assert averager._choose_partner() == str(slow)


# -- `auto`'s first exchange is a compressed probe, and a probe too fast to time still teaches a rate --------

def test_a_completed_transfer_too_fast_to_time_teaches_a_lower_bound_a_cut_one_nothing() -> None:
    """`auto` now probes an unmeasured link with its most compressed preset (compression_choice.py, `PROBE`):
    on loopback such a probe completes in well under 10 ms, too fast to time, and used to teach nothing, so
    every exchange would have probed again. A completed one counts as at least its bytes over
    `TIMED_FLOW_S`; a cut one, too fast to time, still teaches nothing."""
    from node.averaging.averager import TIMED_FLOW_S

    host = FakeHost(create_new_key_pair())
    averager = Averager(host, SyncConfig(datapath=False), FakeSwarm(host))
    partner = str(ID.from_pubkey(create_new_key_pair().public_key))
    fast = Progress()
    fast.moved(37_000)  # a probe of the 0.47M-parameter model, both ways, in one instant
    averager._learn_rate(partner, fast)
    assert averager.admission.link(partner).rate_bps is None and averager._rate_bps is None
    averager._learn_rate(partner, fast, completed=True)
    assert averager.admission.link(partner).rate_bps == pytest.approx(37_000 / TIMED_FLOW_S / 2)
    assert averager._rate_bps == pytest.approx(37_000 / TIMED_FLOW_S / 2)


def test_a_probe_that_passed_in_a_token_buckets_burst_does_not_outweigh_the_transfer_that_timed_the_link() -> None:
    """bench/wan.py, uniform at 0.4 Mbit/s (50 kB/s each way, a 64 KiB tbf bucket): the 37 kB probe passed
    in the burst, timed at 2.5 MB/s each way, and the next `medium` transfer (207 kB each way, 2.9 s) at 71
    kB/s. An average of the two rates (1.3 MB/s) made `auto` relax to bf16 `none`, 38 s a transfer on that
    link, for three outer steps running: 5-6 outer steps in 180 s against 20. Bytes over the seconds they
    flowed (78 kB/s here) keep `medium`, the preset that fits 2 periods of 3 s."""
    from node.averaging.averager import Averager as _Averager
    from node.averaging.compression_choice import preset_for

    host = FakeHost(create_new_key_pair())
    averager = _Averager(host, SyncConfig(datapath=False), FakeSwarm(host))
    partner = str(ID.from_pubkey(create_new_key_pair().public_key))

    def transfer(nbytes: int, seconds: float) -> Progress:
        p = Progress()
        p.bytes, p.first, p.last = nbytes, 100.0, 100.0 + seconds
        return p

    averager._learn_rate(partner, transfer(2 * 37_000, 0.015), completed=True)  # the probe, both ways
    averager._learn_rate(partner, transfer(2 * 207_000, 2.9), completed=True)  # `medium`, both ways
    rate = averager.admission.link(partner).rate_bps
    assert rate is not None and rate == pytest.approx((0.5 * 37_000 + 207_000) / (0.5 * 0.015 + 2.9))
    assert rate < 100_000 and averager._rate_bps == pytest.approx(rate)
    chosen = preset_for("auto", stage=1, link_rate_bps=rate, typical_rate_bps=averager._rate_bps, period_s=3.0,
                        numel=470_000, previous="medium", group_size=2, wire_dtype="bf16")
    assert chosen == "medium"


async def test_a_new_partner_is_asked_at_most_one_preset_beyond_what_this_node_has_completed() -> None:
    """bench/wan.py, one-slow at 0.4 Mbit/s: a fast trainer's first exchange, a `high` probe, passed in a
    token bucket's burst; its next partner, never measured, was asked bf16 `none` on that typical rate:
    3.8 MB that took 54 s of a 180 s run. A partner not measured yet now starts at most one preset less
    compressed than any exchange this node completed (`first_ask_floor`): `medium` after `high`, and
    `none` once a `medium` or `none` exchange has measured the rate."""
    from types import SimpleNamespace

    from node.averaging.compression_choice import first_ask_floor

    assert first_ask_floor(None) is None
    assert first_ask_floor("high") == "medium"
    assert first_ask_floor("medium") == "none" and first_ask_floor("none") == "none"

    host = FakeHost(create_new_key_pair())
    averager = Averager(host, SyncConfig(datapath=False), FakeSwarm(host, period=3.0))
    probed, new = (str(ID.from_pubkey(create_new_key_pair().public_key)) for _ in range(2))
    burst = Progress()
    burst.bytes, burst.first, burst.last = 2 * 37_000, 100.0, 100.015  # the probe at 2.5 MB/s each way
    averager._learn_rate(probed, burst, completed=True)
    result = avg.TransferResult(bytes_sent=37_000, bytes_received=37_000, duration_s=0.015, path="datapath")
    averager._succeed(probed, result, 470_000, "high")
    ask = SimpleNamespace(stage=1, numel=470_000, wire_dtype="bf16")
    assert averager._compression_wanted(new, ask) == "medium"  # not `none`, which the burst's rate allows
    averager._succeed(probed, result, 470_000, "medium")
    assert averager._compression_wanted(new, ask) == "none"

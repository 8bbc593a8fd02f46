"""Pairwise averaging between two real libp2p hosts: exact sums, both data paths, refusals, failures."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager

import multiaddr
import pytest
import torch
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr

from node.averaging.averager import Averager
from node.averaging.robust import Credited, UpdateBound
from node.averaging.swarm_view import AveragerHooks
from node.bridge.exchange import ExchangeRequest
from node.config.sync import SyncConfig
from node.ops.status_view import render_status
from node.worker.task import layout_hash
from p2p.host import build_host
from p2p.wire import (
    LibP2PByteStream,
    ProtocolError,
    encode_msg,
    from_map,
    recv_as,
    recv_msg,
    send_msg,
    to_map,
)
from protocols import avg
from protocols.avg import AnswerCode, AvgAnswer, AvgRequest, Clip, Received, make_plans
from protocols.codec import round_trip
from protocols.compress import get_compression
from starling_testing.averaging import FakeSwarm, exchange_both, group_sizes
from starling_testing.fakes import FakeHost, FakeNetStream

LISTEN = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
LAYOUT = [("w", (1000, 300)), ("b", (300,))]
NUMEL = 1000 * 300 + 300
LAYOUT_HASH = layout_hash(LAYOUT)  # the worker's (node/worker/task.py), which it sends in its hello


BASE = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))


def request(seed: int, outer_step: int = 3) -> ExchangeRequest:
    """Replicas of one model: phis a little apart around a common point (as far apart as their Deltas are
    long, well inside the bounds of node/averaging/robust.py), Deltas of the same size; outputs NaN until written."""
    g = torch.Generator().manual_seed(seed)
    return ExchangeRequest(
        outer_step,
        phi=BASE + torch.randn(NUMEL, generator=g) * 0.01,
        delta=torch.randn(NUMEL, generator=g) * 0.01,
        phi_out=torch.full((NUMEL,), float("nan")),
        delta_out=torch.full((NUMEL,), float("nan")),
        layout=LAYOUT,
        layout_hash=LAYOUT_HASH,
    )


async def pair(stack: AsyncExitStack, cfg_a: SyncConfig, cfg_b: SyncConfig, *, manifest_b: str = "m1"):
    hosts = [build_host(create_new_key_pair()) for _ in range(2)]
    for h in hosts:
        await stack.enter_async_context(h.run(LISTEN))
    nursery = await stack.enter_async_context(trio.open_nursery())
    avs = [
        Averager(hosts[0], cfg_a, FakeSwarm(hosts[0])),
        Averager(hosts[1], cfg_b, FakeSwarm(hosts[1], manifest=manifest_b)),
    ]
    for a in avs:
        await nursery.start(a.run)
    await hosts[0].connect(info_from_p2p_addr(hosts[1].get_addrs()[0]))
    return avs, nursery


@pytest.mark.parametrize("datapath", [True, False], ids=["side-channel", "libp2p-stream"])
async def test_two_nodes_end_with_the_exact_fp32_sums_that_give_the_exact_mean(datapath: bool) -> None:
    cfg = SyncConfig(wire_dtype="fp32", datapath=datapath, pair_window_s=10, compression="none")
    async with AsyncExitStack() as stack:
        avs, nursery = await pair(stack, cfg, cfg)
        reqs = [request(1), request(2)]
        assert group_sizes(await exchange_both(avs, reqs)) == [2, 2]
        phi_sum, delta_sum = reqs[0].phi + reqs[1].phi, reqs[0].delta + reqs[1].delta
        for r in reqs:
            assert torch.equal(r.phi_out, phi_sum) and torch.equal(r.delta_out, delta_sum)
            # The worker's step divides by the group size: halving is exact, so that is the exact fp32 mean.
            assert torch.equal(r.phi_out * 0.5, (reqs[0].phi + reqs[1].phi) / 2)
        st = avs[0].status()
        assert st["rounds"] == 1 and st["distinct_partners"] == 1
        assert st["last_path"] == ("datapath" if datapath else "stream")
        assert st["bytes_sent"] == 2 * NUMEL * 4
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
async def test_both_partners_compute_bit_identical_sums_with_lossy_wire_dtypes(dtype: str) -> None:
    cfg = SyncConfig(wire_dtype=dtype, pair_window_s=10, compression="none")
    async with AsyncExitStack() as stack:
        avs, nursery = await pair(stack, cfg, cfg)
        reqs = [request(5), request(6)]
        assert group_sizes(await exchange_both(avs, reqs)) == [2, 2]
        assert torch.equal(reqs[0].phi_out, reqs[1].phi_out)
        assert torch.equal(reqs[0].delta_out, reqs[1].delta_out)
        exact = reqs[0].phi + reqs[1].phi
        assert (reqs[0].phi_out - exact).abs().max() < 0.1
        nursery.cancel_scope.cancel()


async def test_a_partner_with_another_manifest_is_refused_and_both_step_solo() -> None:
    cfg = SyncConfig(wire_dtype="fp32", pair_window_s=1.5)
    async with AsyncExitStack() as stack:
        avs, nursery = await pair(stack, cfg, cfg, manifest_b="other")
        reqs = [request(1), request(2)]
        assert group_sizes(await exchange_both(avs, reqs)) == [1, 1]
        assert avs[0].status()["rounds"] == 0 and avs[0].status()["solo_rounds"] == 1
        nursery.cancel_scope.cancel()


async def test_partners_whose_outer_steps_are_too_far_apart_refuse() -> None:
    cfg = SyncConfig(wire_dtype="fp32", pair_window_s=1.5, max_step_gap=2)
    async with AsyncExitStack() as stack:
        avs, nursery = await pair(stack, cfg, cfg)
        assert group_sizes(await exchange_both(avs, [request(1, outer_step=3), request(2, outer_step=10)])) == [1, 1]
        nursery.cancel_scope.cancel()


async def test_one_step_beyond_the_gap_says_why_in_status_and_log_wakes_the_catch_up_and_misses_no_round(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue #27 (`kill -9` of a worker): the restarted worker resumed outer steps back, one step beyond
    `sync.max_step_gap` from its partner. Each record (the daemon's eligibility allows one step more, as a
    record lags a heartbeat) kept the other eligible, every request was refused, `declined` rose, the
    reason went to the debug log only, the catch-up (which counted outer steps without an *eligible*
    partner) never started, and each counted the other's refusals as missed rounds until it sat out."""
    cfg = SyncConfig(wire_dtype="fp32", pair_window_s=1.0, max_step_gap=4)
    behind_calls: list[list[int]] = [[], []]
    averaged: list[list[bool]] = [[], []]
    async with AsyncExitStack() as stack:
        hosts = [build_host(create_new_key_pair()) for _ in range(2)]
        for h in hosts:
            await stack.enter_async_context(h.run(LISTEN))
        nursery = await stack.enter_async_context(trio.open_nursery())
        ids = [str(h.get_id()) for h in hosts]
        avs = [
            Averager(hosts[i], cfg, FakeSwarm(hosts[i], partners=[ids[1 - i]]),
                     hooks=AveragerHooks(on_behind=behind_calls[i].append, on_outer_step=averaged[i].append))
            for i in range(2)
        ]
        for a in avs:
            await nursery.start(a.run)
        await hosts[0].connect(info_from_p2p_addr(hosts[1].get_addrs()[0]))
        caplog.set_level(logging.INFO, logger="starling.averager")
        for k in range(4):  # more than partner_misses.MISS_LIMIT rounds
            outcomes = await exchange_both(avs, [request(1, outer_step=10 + k), request(2, outer_step=15 + k)])
            assert group_sizes(outcomes) == [1, 1]
        nursery.cancel_scope.cancel()
    assert averaged == [[False] * 4, [False] * 4]  # each outer step told the catch-up it was not averaged
    assert behind_calls[1] == [] and behind_calls[0] and set(behind_calls[0]) <= {15, 16, 17, 18}
    assert not avs[0].sits_out(ids[1]) and not avs[1].sits_out(ids[0])  # an honest state, no missed round
    st = [a.status() for a in avs]
    assert st[0]["declined"] > 0
    mine = st[0]["last_refusal"]
    assert mine is not None and mine["peer"] == ids[1] and mine["reason"].startswith("outer steps too far apart")
    assert mine["by"] == "partner" or mine["by"] == "us"
    assert "this node is 5 outer steps behind (sync.max_step_gap 4): it catches up from the swarm" in mine["hint"]
    theirs = st[1]["last_refusal"]
    assert theirs is not None and "the partner is 5 outer steps behind" in theirs["hint"]
    assert mine["averaged_since"] is False
    line = render_status({"sync": st[0]})  # type: ignore[typeddict-item]
    assert "not averaging: " in line and "this node is 5 outer steps behind" in line, line
    st[0]["last_refusal"] = {**mine, "averaged_since": True}  # once an exchange completed after it: gone
    assert "not averaging" not in render_status({"sync": st[0]})  # type: ignore[typeddict-item]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "to average" in r.getMessage()]
    # Logged at INFO, once per peer and reason (a minute apart at most), on both sides.
    assert len([m for m in infos if ids[0] in m]) == 1 and len([m for m in infos if ids[1] in m]) == 1, infos
    assert any("this node is 5 outer steps behind" in m for m in infos), infos


async def test_a_node_alone_takes_a_solo_step_after_the_pairing_window() -> None:
    cfg = SyncConfig(pair_window_s=0.5)
    async with AsyncExitStack() as stack:
        avs, nursery = await pair(stack, cfg, cfg)
        with trio.fail_after(5):
            assert (await avs[0].exchange(request(1))).group_size == 1  # the partner is connected but never ready
        nursery.cancel_scope.cancel()


class LoneHost:
    """A host with no connections and no network: enough for an averager that never reaches anyone."""

    def __init__(self) -> None:
        self._id = ID.from_pubkey(create_new_key_pair().public_key)

    def get_id(self) -> ID:
        return self._id

    def get_connected_peers(self) -> list:
        return []


async def test_the_catch_ups_count_moves_the_next_outer_step_once_forward_or_back(autojump_clock) -> None:
    """Issue #23: a trainer off the swarm only in count over a slow link takes the swarm's count without a
    download (node/averaging/latejoin.py, `CatchUp.follow_instead`); the averager hands it to the worker at
    the end of its next round, once: ahead of ours as the outer step to follow, behind ours exactly."""
    av = Averager(LoneHost(), SyncConfig(pair_window_s=600, datapath=False), FakeSwarm(partners=[], others=False))
    av.follow(9)
    outcome = await av.exchange(request(1, outer_step=3))
    assert (outcome.group_outer_step, outcome.exact_outer_step) == (9, None)
    outcome = await av.exchange(request(1, outer_step=10))  # asked once only
    assert outcome.group_outer_step in (None, 10) and outcome.exact_outer_step is None
    av.follow(5)
    outcome = await av.exchange(request(1, outer_step=11))
    assert outcome.group_size == 1 and outcome.exact_outer_step == 5


async def test_with_no_other_trainer_the_outer_step_is_solo_at_once_instead_of_after_the_window(
    autojump_clock,
) -> None:
    # Virtual time (autojump): any wait shows up as elapsed time, and none passes unless something waits.
    cfg = SyncConfig(pair_window_s=600, datapath=False)
    seen: list[bool] = []
    alone = Averager(LoneHost(), cfg, FakeSwarm(partners=[], others=False),
                     hooks=AveragerHooks(on_outer_step=seen.append))
    began = trio.current_time()
    assert (await alone.exchange(request(1))).group_size == 1
    assert trio.current_time() == began
    assert seen == [False]
    st = alone.status()
    assert st["solo_rounds"] == 1 and st["unpaired_rounds"] == 1 and st["state"] == "idle"

    # Trainers whose records put them outside the step gap: the window still applies (they may ask us:
    # records lag, and the gap is judged on the actual request); the catch-up counts the step as unpaired.
    distant = Averager(LoneHost(), cfg, FakeSwarm(partners=[], others=True),
                       hooks=AveragerHooks(on_outer_step=seen.append))
    began = trio.current_time()
    assert (await distant.exchange(request(1))).group_size == 1
    assert trio.current_time() - began >= 600
    assert seen == [False, False] and distant.status()["unpaired_rounds"] == 0

    # An eligible partner that never becomes ready (busy, or not connected yet) is waited for; the step was
    # not averaged, which the catch-up counts (it starts only where the records show someone beyond the
    # gap: a partner one step beyond it looked eligible and refused every request, issue #27).
    partner = str(ID.from_pubkey(create_new_key_pair().public_key))
    hopeful = Averager(LoneHost(), cfg, FakeSwarm(partners=[partner], others=True),
                       hooks=AveragerHooks(on_outer_step=seen.append))
    began = trio.current_time()
    assert (await hopeful.exchange(request(1))).group_size == 1
    assert trio.current_time() - began >= 600
    assert seen == [False, False, False] and hopeful.status()["unpaired_rounds"] == 0


@pytest.mark.parametrize("steps", [(3, 7), (7, 3)], ids=["responder-ahead", "initiator-ahead"])
async def test_after_an_exchange_both_partners_hold_the_larger_outer_step(steps: tuple[int, int]) -> None:
    cfg = SyncConfig(wire_dtype="fp32", pair_window_s=10, max_step_gap=4)
    async with AsyncExitStack() as stack:
        hosts = [build_host(create_new_key_pair()) for _ in range(2)]
        for h in hosts:
            await stack.enter_async_context(h.run(LISTEN))
        nursery = await stack.enter_async_context(trio.open_nursery())
        # The responder's only eligible partner is one it is not connected to, so it never asks anyone:
        # the initiator is always hosts[0], and both directions of the counter adoption are exercised.
        elsewhere = str(ID.from_pubkey(create_new_key_pair().public_key))
        initiator = Averager(hosts[0], cfg, FakeSwarm(hosts[0]))
        responder = Averager(hosts[1], cfg, FakeSwarm(hosts[1], partners=[elsewhere]))
        for a in (initiator, responder):
            await nursery.start(a.run)
        await hosts[0].connect(info_from_p2p_addr(hosts[1].get_addrs()[0]))
        reqs = [request(1, outer_step=steps[0]), request(2, outer_step=steps[1])]
        outcomes = await exchange_both([initiator, responder], reqs)
        assert group_sizes(outcomes) == [2, 2]
        assert responder.status()["per_peer"][initiator.me]["rounds"] == 1
        assert [o.group_outer_step for o in outcomes] == [7, 7]
        # Where the asker's time went (issue #50): every phase, adding up to no more than the whole exchange
        # as the asker timed it from its request; the responder asked nothing.
        asked = initiator.status()["last_asked"]
        assert asked is not None and asked["partner"] == responder.me
        assert list(asked["phases_s"]) == ["open", "answer", "connect", "transfer", "result"]
        assert all(x >= 0 for x in asked["phases_s"].values()) and asked["phases_s"]["transfer"] > 0
        assert responder.status()["last_asked"] is None
        nursery.cancel_scope.cancel()


async def test_a_partner_that_confirmed_the_protocol_gets_the_next_request_with_the_streams_proposal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #50: after a partner confirmed the averaging protocol's latest version, the next request rides
    with the stream's proposal (p2p/multiselect.py, `open_optimistic`): no round trip for the protocol. A
    partner that no longer speaks it (an older daemon since) costs one failed exchange, and the next one
    negotiates the usual way, in the version it has."""
    import p2p.multiselect as multiselect_module

    optimistic: list[str] = []
    real_open = multiselect_module.open_optimistic

    async def counting_open(host, peer, protocol):  # type: ignore[no-untyped-def]
        optimistic.append(protocol)
        return await real_open(host, peer, protocol)

    monkeypatch.setattr(multiselect_module, "open_optimistic", counting_open)
    cfg = SyncConfig(wire_dtype="fp32", pair_window_s=4, compression="none")
    async with AsyncExitStack() as stack:
        hosts = [build_host(create_new_key_pair()) for _ in range(2)]
        for h in hosts:
            await stack.enter_async_context(h.run(LISTEN))
        nursery = await stack.enter_async_context(trio.open_nursery())
        elsewhere = str(ID.from_pubkey(create_new_key_pair().public_key))  # the responder never asks
        initiator = Averager(hosts[0], cfg, FakeSwarm(hosts[0]))
        responder = Averager(hosts[1], cfg, FakeSwarm(hosts[1], partners=[elsewhere]))
        for a in (initiator, responder):
            await nursery.start(a.run)
        await hosts[0].connect(info_from_p2p_addr(hosts[1].get_addrs()[0]))
        link = initiator.admission.link(responder.me)
        assert not link.speaks_latest
        outcomes = await exchange_both([initiator, responder], [request(1, 3), request(2, 3)])
        assert group_sizes(outcomes) == [2, 2] and link.speaks_latest
        # (A round may ask more than once, a partner not ready yet: every ask after the first confirmation is
        # optimistic already.)
        before = len(optimistic)
        outcomes = await exchange_both([initiator, responder], [request(1, 4), request(2, 4)])
        assert group_sizes(outcomes) == [2, 2] and link.speaks_latest
        assert len(optimistic) > before and set(optimistic) == {avg.PROTOCOL_ID}  # no round trip for the protocol
        # The responder now speaks only the older version: the optimistic stream is refused...
        hosts[1].remove_stream_handler(avg.PROTOCOL_ID)
        before = len(optimistic)
        await exchange_both([initiator, responder], [request(1, 5), request(2, 5)])
        assert len(optimistic) > before and not link.speaks_latest
        # ...and the next exchange negotiates, in the version it has, with no optimistic stream.
        link.next_try = link.banned_until = 0.0
        link.failures = 0
        before = len(optimistic)
        outcomes = await exchange_both([initiator, responder], [request(1, 6), request(2, 6)])
        assert group_sizes(outcomes) == [2, 2] and len(optimistic) == before and not link.speaks_latest
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("tensor", "value"),
    [("delta", float("nan")), ("delta", float("-inf")), ("delta", 1e30), ("phi", float("inf")), ("phi", float("nan"))],
    ids=["nan-delta", "inf-delta", "overflowing-delta", "inf-phi", "nan-phi"],
)
async def test_a_partner_that_sends_non_finite_values_is_rejected_with_no_update(tensor: str, value: float) -> None:
    cfg = SyncConfig(wire_dtype="fp32", pair_window_s=5, compression="none")
    async with AsyncExitStack() as stack:
        avs, nursery = await pair(stack, cfg, cfg)
        bad = request(2)
        getattr(bad, tensor)[NUMEL - 3] = value  # in the last chunk: every chunk before it was folded already
        results = await exchange_both(avs, [request(1), bad])
        assert results[0].group_size == 1  # the honest node rejected the poisoned values and stepped solo
        assert avs[0].status()["failures"] == 1
        assert avs[0].status()["rejections"] == {"non_finite": 1}
        nursery.cancel_scope.cancel()


async def test_a_1000x_norm_update_is_rejected_and_repeated_offences_ban_the_partner() -> None:
    cfg = SyncConfig(wire_dtype="fp32", pair_window_s=3, ban_after=2, backoff_s=0.1)
    async with AsyncExitStack() as stack:
        avs, nursery = await pair(stack, cfg, cfg)
        for round_no in range(2):
            honest, poisoned = request(10 + round_no, outer_step=round_no), request(20 + round_no, outer_step=round_no)
            poisoned.delta.mul_(1000)
            results = await exchange_both(avs, [honest, poisoned])
            assert results[0].group_size == 1
            await trio.sleep(0.3)  # let the back-off pass
        st = avs[0].status()
        assert st["rejections"] == {"delta_norm": 2}
        assert st["banned"] == [str(avs[1].me)]
        # A banned partner is refused outright: the next exchange is solo without any transfer.
        sent_before = st["bytes_sent"]
        assert group_sizes(await exchange_both(avs, [request(30, 2), request(31, 2)])) == [1, 1]
        assert avs[0].status()["bytes_sent"] == sent_before
        nursery.cancel_scope.cancel()


async def test_a_5x_norm_update_is_clipped_to_the_bound_and_still_averaged() -> None:
    """Between the clip and the refusal ratio a partner's Delta still counts, scaled down to the bound
    (node/averaging/robust.py); its own side keeps the plain sum: only the victim's view is clipped."""
    cfg = SyncConfig(wire_dtype="fp32", pair_window_s=5, clip_ratio=2, compression="none")
    async with AsyncExitStack() as stack:
        avs, nursery = await pair(stack, cfg, cfg)
        honest, loud = request(40), request(41)
        loud.delta.mul_(5)
        assert group_sizes(await exchange_both(avs, [honest, loud])) == [2, 2]
        scale = 2 * float(honest.delta.norm()) / float(loud.delta.norm())
        assert torch.allclose(honest.delta_out, honest.delta + scale * loud.delta, atol=1e-6)
        assert torch.equal(honest.phi_out, honest.phi + loud.phi)  # phis within bounds: exact
        assert torch.equal(loud.delta_out, honest.delta + loud.delta)
        assert avs[0].status()["clipped"] == {"delta": 1, "phi": 0} and avs[0].status()["rejections"] == {}
        nursery.cancel_scope.cancel()


async def test_a_partner_that_stops_mid_transfer_costs_one_solo_step_and_no_update() -> None:
    from p2p.datapath import KeyAgreement
    from p2p.wire import LibP2PByteStream, PlainFrameChannel, recv_as, send_msg
    from protocols import avg

    cfg = SyncConfig(wire_dtype="fp32", pair_window_s=3, datapath=False, compression="none")
    hosts = [build_host(create_new_key_pair()) for _ in range(2)]
    async with AsyncExitStack() as stack:
        for h in hosts:
            await stack.enter_async_context(h.run(LISTEN))
        nursery = await stack.enter_async_context(trio.open_nursery())
        honest = Averager(hosts[0], cfg, FakeSwarm(hosts[0]))
        await nursery.start(honest.run)

        async def quitter(stream) -> None:  # accepts, sends two valid chunks of phi, then vanishes
            control = LibP2PByteStream(stream)
            req = await recv_as(control, avg.AvgRequest)
            await send_msg(control, avg.AvgAnswer(verdict="accept", pubkey=KeyAgreement().public_key,
                                                  session_id=b"x" * 16))
            await recv_as(control, avg.AvgPath)
            channel = PlainFrameChannel(control, max_frame_size=avg.MAX_FRAME)
            for _ in range(2):
                await channel.send(b"\x00" * (req.chunk_elems * 4))
            await stream.reset()

        hosts[1].set_stream_handler(avg.PROTOCOL_ID, quitter)
        await hosts[0].connect(info_from_p2p_addr(hosts[1].get_addrs()[0]))
        req = request(1)
        with trio.fail_after(20):
            assert (await honest.exchange(req)).group_size == 1
        st = honest.status()
        assert st["failures"] >= 1 and st["rounds"] == 0 and st["solo_rounds"] == 1
        nursery.cancel_scope.cancel()


async def three_connected(stack: AsyncExitStack, cfg: SyncConfig) -> tuple[list[Averager], trio.Nursery]:
    hosts = [build_host(create_new_key_pair()) for _ in range(3)]
    for h in hosts:
        await stack.enter_async_context(h.run(LISTEN))
    nursery = await stack.enter_async_context(trio.open_nursery())
    avs = [Averager(h, cfg, FakeSwarm(h)) for h in hosts]
    for a in avs:
        await nursery.start(a.run)
    for i in range(3):
        for j in range(i + 1, 3):
            await hosts[i].connect(info_from_p2p_addr(hosts[j].get_addrs()[0]))
    return avs, nursery


async def test_a_trainer_that_always_publishes_a_little_later_than_the_other_two_still_averages_with_both() -> None:
    """With "whoever asks first", the two trainers that publish together pair with each other every round
    and the third always steps solo (phase lock). The schedule gives every trainer a partner in two of
    every three outer steps, the late one included, and every trainer meets both others."""
    cfg = SyncConfig(wire_dtype="fp32", pair_window_s=1.5)
    async with AsyncExitStack() as stack:
        avs, nursery = await three_connected(stack, cfg)
        averaged = [0, 0, 0]
        for outer_step in range(6):

            async def one(i: int, step: int = outer_step) -> None:
                if i == 2:
                    await trio.sleep(0.3)  # the late one
                averaged[i] += (await avs[i].exchange(request(10 * step + i, outer_step=step))).group_size >= 2

            with trio.fail_after(20):
                async with trio.open_nursery() as n:
                    for i in range(3):
                        n.start_soon(one, i)
        assert all(count >= 4 for count in averaged), averaged
        for a in avs:
            mixing = a.status()["mixing"]
            assert mixing["distinct_partners"] == 2, mixing
            assert mixing["outer_steps"] == 6 and mixing["averaged"] + mixing["solo"] == 6
        nursery.cancel_scope.cancel()


def test_a_partner_that_trained_more_inner_steps_may_send_a_proportionally_longer_delta() -> None:
    """On a swarm of mixed speeds a faster partner's Delta covers more inner steps: the bound scales our
    per-step reference by the steps exchanged, up to the swarm's H, instead of clipping every fast
    partner; claiming more steps than H buys nothing."""
    bound = UpdateBound(clip_ratio=2, reject_ratio=10, max_inner_steps=20)
    credited = bound.credit(own_steps=2, own_samples=16, their_steps=20, their_samples=160)
    assert credited == Credited(20, 160)
    # Our Delta of norm 1 over 2 steps: 0.5 per step; 20 steps exchanged give a reference of 10.
    assert bound.judge(seen(own=1.0, theirs=15.0), 2, credited.inner_steps) == Clip(1.0, 1.0)
    liar = bound.credit(own_steps=2, own_samples=16, their_steps=1_000_000, their_samples=10**9)
    assert liar == Credited(20, 160)  # capped at H, and at our per-step batch for those steps
    # So its Delta is clipped to the bound that 20 steps give (2 x 10), no larger.
    assert bound.judge(seen(own=1.0, theirs=100.0), 2, liar.inner_steps).delta_scale == pytest.approx(0.2)


def seen(own: float, theirs: float, phi_distance: float = 0.0) -> Received:
    return Received(their_delta_sq=theirs**2, own_delta_sq=own**2, phi_distance_sq=phi_distance**2,
                    own_phi_sq=1e6)


async def test_a_trainer_one_outer_step_behind_joins_the_others_count_and_their_schedule() -> None:
    """The schedule is keyed by the outer step: a trainer one step behind computes another matching than
    the others at every step. A solo step follows the largest outer step that ready trainers showed, so
    the counts meet and the trainer is scheduled with the others again."""
    cfg = SyncConfig(wire_dtype="fp32", pair_window_s=1.5, max_step_gap=4)
    async with AsyncExitStack() as stack:
        avs, nursery = await three_connected(stack, cfg)
        steps = [5, 5, 4]
        averaged = [0, 0, 0]
        apart = 0  # rounds that began with the counts apart
        for round_no in range(6):
            apart += len(set(steps)) > 1

            async def one(i: int, seed: int = round_no) -> None:
                req = request(10 * seed + i, outer_step=steps[i])
                outcome = await avs[i].exchange(req)
                averaged[i] += outcome.group_size >= 2
                # What the worker does with the result: continue from the larger count.
                steps[i] = max(steps[i], outcome.group_outer_step or 0) + 1

            with trio.fail_after(20):
                async with trio.open_nursery() as n:
                    for i in range(3):
                        n.start_soon(one, i)
        assert len(set(steps)) == 1, steps
        assert apart == 1  # the first one only
        assert all(count >= 3 for count in averaged), averaged
        nursery.cancel_scope.cancel()


async def test_after_averaging_a_trainer_publishes_next_the_outer_step_a_waiting_trainer_showed_it() -> None:
    """Over slow links pairs whose exchanges take different times drift a count or two apart, and then
    compute different schedules (fast trainers stepped solo in runs of three, waiting for a scheduled partner
    that paired by another count). A trainer that asks us during our round is waiting in its outer step, so
    after we average we continue from just below it: our next publish is its outer step. Our partner, which
    never heard of it, keeps the pair's count."""
    cfg = SyncConfig(wire_dtype="fp32", pair_window_s=2.0, max_step_gap=4)
    async with AsyncExitStack() as stack:
        avs, nursery = await three_connected(stack, cfg)
        names = [a.me for a in avs]
        from node.averaging.pairing import scheduled_partner

        # A and B (counts s) are each other's scheduled partners; C, two steps ahead, is scheduled with A
        # and is the smaller PeerID of that pair, so it asks A at once.
        a, b, c, s = next((x, y, z, s) for x, y, z in itertools.permutations(range(3)) for s in range(30)
                          if names[z] < names[x]
                          and scheduled_partner(names[x], [names[y], names[z]], s) == names[y]
                          and scheduled_partner(names[z], [names[x], names[y]], s + 2) == names[x])
        outcomes: dict[int, object] = {}

        async def one(i: int, step: int, delay: float) -> None:
            await trio.sleep(delay)
            outcomes[i] = await avs[i].exchange(request(i, outer_step=step))

        with trio.fail_after(20):
            async with trio.open_nursery() as n:
                n.start_soon(one, a, s, 0.0)
                n.start_soon(one, c, s + 2, 0.1)  # asks A while A waits for B
                n.start_soon(one, b, s, 0.5)  # comes within A's scheduled phase (1 s)
        assert outcomes[a].group_size == 2 and outcomes[b].group_size == 2  # type: ignore[attr-defined]
        assert outcomes[a].group_outer_step == s + 1  # type: ignore[attr-defined]  # next publish: s + 2
        assert outcomes[b].group_outer_step == s  # type: ignore[attr-defined]
        nursery.cancel_scope.cancel()


def test_the_outer_step_moves_up_to_meet_a_waiting_trainer_only_within_our_gap() -> None:
    from node.averaging.stepping import meet_the_waiting

    assert meet_the_waiting(5, 5, 8, max_gap=4) == 7  # publish 8 next, where it waits
    assert meet_the_waiting(5, 5, 6, max_gap=4) == 5  # 6 is our next publish anyway
    assert meet_the_waiting(6, 5, 4, max_gap=4) == 6  # never down
    assert meet_the_waiting(5, 5, None, max_gap=4) == 5
    assert meet_the_waiting(5, 5, 10, max_gap=4) == 5  # beyond our gap: not believed


def test_a_node_that_found_nobody_ready_moves_towards_the_others_phase() -> None:
    """Trainers between outer steps say how long ago they published and whether they averaged. A node late
    by 4 s of a 15 s pace moves its next publish 4 s earlier towards trainers that averaged (they keep their
    phase), 2 s towards solo ones (they move too); an early one (the others published 11 s before it, i.e.
    they are due 4 s after it) moves later; without a pace nothing moves."""
    from node.averaging.stepping import phase_shift

    assert phase_shift([(-4.0, True)], 15.0) == pytest.approx(-4.0)
    assert phase_shift([(-4.0, False)], 15.0) == pytest.approx(-2.0)
    assert phase_shift([(-11.0, True)], 15.0) == pytest.approx(4.0)
    # The median of the moves, each wrapped: -4, -3 and 4.5 (= -30 + 4.5, two periods earlier).
    assert phase_shift([(-4.0, True), (-3.0, True), (-25.5, True)], 15.0) == pytest.approx(-3.0)
    assert phase_shift([], 15.0) == 0.0
    assert phase_shift([(-4.0, True)], 0.0) == 0.0


class FakeStream:
    """An inbound pairing stream from `ip` (what the averager's admission looks at)."""

    def __init__(self, ip: str) -> None:
        self.ip, self.was_reset = ip, False

    def get_remote_address(self) -> tuple[str, int]:
        return (self.ip, 4001)

    async def reset(self) -> None:
        self.was_reset = True

    async def close(self) -> None:
        pass


def test_one_ip_holds_at_most_4_pairing_requests_at_once_whatever_its_identities() -> None:
    """One machine's Sybil identities share its IP: they cannot take all MAX_INBOUND request slots, and
    the slots come back when the requests are done."""
    from node.averaging.admission import MAX_INBOUND_PER_IP, Admission

    admission = Admission(SyncConfig(), clock=lambda: 0.0)
    with ExitStack() as held:
        sybils = [held.enter_context(admission.inbound("10.0.0.66")) for _ in range(MAX_INBOUND_PER_IP + 3)]
        honest = held.enter_context(admission.inbound("10.0.0.7"))
        assert sybils.count(True) == MAX_INBOUND_PER_IP and honest
        assert admission.rejections == {"too_many_requests_from_ip": 3}
        assert admission.inbound_held() == (MAX_INBOUND_PER_IP + 1, {"10.0.0.66": MAX_INBOUND_PER_IP, "10.0.0.7": 1})
    assert admission.inbound_held() == (0, {})


async def test_an_ip_whose_identities_keep_getting_banned_is_banned_itself() -> None:
    """A fresh PeerID costs nothing: after IP_BAN_AFTER identities from one IP are banned, the IP is, and
    a request from a new identity behind it is reset before a byte of it is read."""
    from node.averaging.admission import IP_BAN_AFTER

    cfg = SyncConfig(ban_after=2, datapath=False)
    host = FakeHost()
    av = Averager(host, cfg, FakeSwarm())
    async with trio.open_nursery() as nursery:
        await nursery.start(av.run)
        for i in range(IP_BAN_AFTER):
            av.admission.saw(f"sybil-{i}", "10.0.0.66")  # where its requests came from
            for _ in range(cfg.ban_after):
                av.note_offence(f"sybil-{i}", "delta_norm")
        assert av.admission.ip_banned("10.0.0.66") and not av.admission.ip_banned("10.0.0.7")
        assert av.status()["banned"] == ["sybil-0", "sybil-1"]
        fresh = FakeStream("10.0.0.66")
        await host.handlers[avg.PROTOCOL_ID](fresh)
        assert fresh.was_reset and av.status()["rejections"]["banned_ip"] == 1
        assert av.sits_out("sybil-0") and not av.sits_out("someone-else")
        nursery.cancel_scope.cancel()


def test_the_partner_table_is_bounded_and_keeps_its_bans() -> None:
    from node.averaging.admission import MAX_LINKS, Admission

    admission = Admission(SyncConfig(), clock=lambda: 0.0)
    admission.link("banned").banned_until = float("inf")
    for i in range(MAX_LINKS + 50):
        admission.link(f"fresh-{i}")
    assert len(admission.links) == MAX_LINKS and "banned" in admission.links


def test_loopback_peers_are_exempt_from_per_ip_limits() -> None:
    """`make run`'s local swarm puts every peer on 127.0.0.1: they are the operator's own machine."""
    from node.averaging.admission import MAX_INBOUND_PER_IP, Admission, per_ip_key

    assert per_ip_key("127.0.0.1") is None and per_ip_key("::1") is None and per_ip_key("10.0.0.7") == "10.0.0.7"
    admission = Admission(SyncConfig(), clock=lambda: 0.0)
    with ExitStack() as held:
        assert all(held.enter_context(admission.inbound(per_ip_key("127.0.0.1")))
                   for _ in range(MAX_INBOUND_PER_IP + 3))
    assert admission.rejections == {}


async def test_a_trainer_far_behind_the_swarms_outer_step_follows_it_and_one_liar_cannot_move_it() -> None:
    """Groups whose outer steps take different times drift apart in their counters, and past
    `sync.max_step_gap` they never pair again (islands). A node more than half the gap behind the
    swarm's second largest outer step jumps to it; a single record claiming a huge step moves nobody."""
    cfg = SyncConfig(max_step_gap=10)
    steps = {"a": 200, "b": 198, "c": 12}
    av = Averager(LoneHost(), cfg, FakeSwarm(partners=[], others=False, steps=lambda: steps))
    behind = request(1, outer_step=12)
    outcome = await av.exchange(behind)
    assert outcome.group_size == 1 and outcome.group_outer_step == 198
    steps.update(a=10**9, b=14)  # one liar, everyone else where we are
    near = request(2, outer_step=13)
    assert (await av.exchange(near)).group_outer_step in (None, 13)


# --- sync.compression (protocols/compress.py) ------------------------------------------------------------------


def on_wire(x: torch.Tensor, codec: object) -> torch.Tensor:
    out = torch.empty_like(x)
    round_trip(codec, x, out)  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("preset", ["medium", "high"])
async def test_compressed_exchange_gives_both_partners_bit_identical_sums_of_what_the_wire_carried(preset: str) -> None:
    """Delta in top-k and phi on one fragment in int8: both sides hold the same bits, the Delta sum is the sum
    of both round trips (what the worker's error feedback assumes), phi_out is written on the fragment only,
    and the bytes sent are the preset's."""
    cfg = SyncConfig(compression=preset, pair_window_s=10)
    comp = get_compression(preset)
    async with AsyncExitStack() as stack:
        avs, nursery = await pair(stack, cfg, cfg)
        reqs = [request(5, outer_step=6), request(6, outer_step=6)]
        outcomes = await exchange_both(avs, reqs)
        assert group_sizes(outcomes) == [2, 2]
        lo, hi = comp.fragment_range(NUMEL, comp.fragment_of(6))
        assert all(o.compression == preset and o.phi_range == (lo, hi) for o in outcomes)
        assert torch.equal(reqs[0].delta_out, reqs[1].delta_out)
        assert torch.equal(reqs[0].phi_out[lo:hi], reqs[1].phi_out[lo:hi])
        dcodec, pcodec = comp.delta_codec("bf16"), comp.phi_codec("bf16")
        assert torch.equal(reqs[0].delta_out, on_wire(reqs[1].delta, dcodec) + on_wire(reqs[0].delta, dcodec))
        assert torch.equal(reqs[0].phi_out[lo:hi],
                           on_wire(reqs[1].phi[lo:hi], pcodec) + on_wire(reqs[0].phi[lo:hi], pcodec))
        outside = torch.cat([reqs[0].phi_out[:lo], reqs[0].phi_out[hi:]])
        assert bool(outside.isnan().all())  # never written
        st = avs[0].status()
        plans = make_plans(NUMEL, "bf16", 4096, preset, comp.fragment_of(6))
        assert st["bytes_sent"] == plans.total_bytes and st["compression"] == preset
        assert st["last_bytes_per_param"] == round(plans.total_bytes / NUMEL, 4)
        assert st["last_bytes_per_param"] <= (0.5 if preset == "medium" else 0.12)
        nursery.cancel_scope.cancel()


async def test_partners_with_different_compression_refuse_each_other() -> None:
    async with AsyncExitStack() as stack:
        avs, nursery = await pair(stack, SyncConfig(compression="medium", pair_window_s=1.5),
                                  SyncConfig(compression="none", pair_window_s=1.5))
        assert group_sizes(await exchange_both(avs, [request(1), request(2)])) == [1, 1]
        assert avs[0].status()["rounds"] == 0 and avs[1].status()["rounds"] == 0
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def in_a_round(av: Averager) -> AsyncIterator[None]:
    """`av` looking for a partner for outer step 3 (there is none) while the block runs."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(av.exchange, request(1))
        await trio.testing.wait_all_tasks_blocked()
        assert av.status()["state"] == "pairing"
        yield
        nursery.cancel_scope.cancel()


def asking_with(compression: str) -> AvgRequest:
    return AvgRequest(outer_step=3, manifest_hash="m1", layout_hash=LAYOUT_HASH, numel=NUMEL, wire_dtype="bf16",
                      int8_block=4096, chunk_elems=4096, pubkey=bytes(32), compression=compression)


async def judged(cfg: SyncConfig, compression: str, *, typical_rate_bps: float | None = 1e9) -> tuple[AnswerCode, str] | None:
    """How an averager on `cfg` in a round answers a request for preset `compression`, its typical rate over
    its partners (`_learn_rate`) `typical_rate_bps` (a fast link by default; None: nothing measured yet)."""
    av = Averager(LoneHost(), cfg, FakeSwarm(period=5.0))
    av._rate_bps = typical_rate_bps
    async with in_a_round(av):
        return av.answer_for(asking_with(compression), "peer")


async def test_while_the_scheduled_partner_is_busy_transferring_anyone_but_the_last_partner_may_pair() -> None:
    """bench/wan.py, one-slow at 0.4 Mbit/s: a trainer whose scheduled partner was busy transferring answered
    every other free trainer "waiting for the partner the schedule gives it", and they stepped solo. During
    that wait it now takes anyone but the partner it last averaged with (the pair that ends first going back
    to each other is what the wait prevents); before the wait is stretched, only the scheduled partner."""
    av = Averager(LoneHost(), SyncConfig(compression="none"), FakeSwarm(period=5.0))
    async with in_a_round(av):
        pending = av._pending
        assert pending is not None
        pending.scheduled, pending.scheduled_until = "scheduled", trio.current_time() + 100
        av._last_paired.update({"other": 1, "last": 2})
        for asker in ("other", "last", "new"):
            verdict = av.answer_for(asking_with("none"), asker)
            assert verdict is not None and verdict[0] is AnswerCode.SCHEDULED
        pending.scheduled_busy = True  # its scheduled partner answered "exchanging"
        assert av.answer_for(asking_with("none"), "other") is None
        assert av.answer_for(asking_with("none"), "new") is None
        verdict = av.answer_for(asking_with("none"), "last")
        assert verdict is not None and verdict[0] is AnswerCode.SCHEDULED
        # Once the wait has outlasted the round's own window (a slow link's stretch), the last partner too:
        # a round without the wait would have ended, and its open phase taken it.
        pending.began = trio.current_time() - av.cfg.pair_window_s
        assert av.answer_for(asking_with("none"), "last") is None
        pending.scheduled_busy = False  # not a busy wait: a scheduled phase keeps its partner, however long
        verdict = av.answer_for(asking_with("none"), "last")
        assert verdict is not None and verdict[0] is AnswerCode.SCHEDULED


async def test_in_a_busy_wait_the_last_partner_is_taken_once_its_own_wait_has_outlasted_the_window() -> None:
    """Two trainers that had just averaged with each other publish seconds apart, each waiting for a member
    of the busy slow pair; each took the other only once its *own* wait had outlasted its window, so the one
    that published first was refused and stepped solo just before the other would have taken it (bench/wan.py,
    one-slow at 0.4 Mbit/s). The asker's wait counts too: it says how long it has looked (`waited_ms`)."""
    av = Averager(LoneHost(), SyncConfig(compression="none"), FakeSwarm(period=5.0))
    window_ms = int(av.cfg.pair_window_s * 1000)
    async with in_a_round(av):
        pending = av._pending
        assert pending is not None
        pending.scheduled, pending.scheduled_until = "scheduled", trio.current_time() + 100
        pending.scheduled_busy = True
        av._last_paired.update({"last": 1})
        fresh = dataclasses.replace(asking_with("none"), waited_ms=window_ms - 1)
        verdict = av.answer_for(fresh, "last")
        assert verdict is not None and verdict[0] is AnswerCode.SCHEDULED  # within its window: refused
        assert av.answer_for(dataclasses.replace(fresh, waited_ms=window_ms), "last") is None


async def test_the_responder_judges_a_compression_mismatch_with_a_clear_reason() -> None:
    verdict = await judged(SyncConfig(compression="high"), "medium")
    assert verdict is not None and verdict[0] is AnswerCode.COMPRESSION
    assert "compression mismatch" in verdict[1] and "set the same sync.compression on every trainer" in verdict[1]
    assert await judged(SyncConfig(compression="high"), "high") is None


async def test_a_responder_on_auto_takes_the_preset_the_initiator_chose_and_one_on_none_refuses_it() -> None:
    """With `auto` the initiator picks the preset from the link it measured, the pair's bottleneck, so an
    `auto` responder follows it; a fixed setting still refuses another preset, telling the operator what to do."""
    for preset in ("none", "medium", "high"):
        assert await judged(SyncConfig(compression="auto"), preset) is None
    # One that has measured no link at all wants the probe (compression_choice.py, `PROBE`): its first exchange.
    for preset in ("none", "medium"):
        verdict = await judged(SyncConfig(compression="auto"), preset, typical_rate_bps=None)
        assert verdict is not None and verdict[1].startswith("compression mismatch: wants high")
    assert await judged(SyncConfig(compression="auto"), "high", typical_rate_bps=None) is None
    verdict = await judged(SyncConfig(compression="none"), "medium")
    assert verdict is not None and verdict[0] is AnswerCode.COMPRESSION
    assert verdict[1] == ("compression mismatch: yours 'medium', ours 'none': set the same sync.compression "
                          "on every trainer")
    for unknown in ("auto", "huge"):  # a request names the preset its wire uses, never `auto`
        refused = await judged(SyncConfig(compression="auto"), unknown)
        assert refused is not None and refused[0] is AnswerCode.COMPRESSION and "compression mismatch" in refused[1]


async def test_a_responder_on_auto_in_groups_of_four_takes_none_only() -> None:
    """A lossy preset needs pairs (`SyncConfig.validate`): `auto` with groups of four never takes one."""
    cfg = SyncConfig(compression="auto", group_size=4)
    assert await judged(cfg, "none") is None
    verdict = await judged(cfg, "medium")
    assert verdict is not None and verdict[0] is AnswerCode.COMPRESSION and "sync.group_size = 4" in verdict[1]


async def test_two_auto_nodes_probe_first_then_exchange_the_preset_their_measured_link_calls_for() -> None:
    """End to end over loopback, both nodes on `auto`: the first exchange (no rate measured anywhere) is the
    cheapest probe, `high`, and it teaches the link's rate, too fast to time on loopback but counted as a
    lower bound (averager.py `_learn_rate`), so that with a long outer step the next exchange is bf16
    `none`. Once the link is known to be slow against the outer step (a bf16 transfer longer than the
    compute period, a `medium` one shorter), the next exchange is `medium` on both sides (bit-identical
    sums, the fragment's phi only); with a long period again the pair returns to `none`. Loopback is far too
    fast to be slow, so the slow link is its measured rate set to 1 MB/s each way, as `_learn_rate` would
    leave it: bf16 then takes 1.2 s, `medium` 0.13 s.

    The probe and the `medium` step back were lossy only while the link was unknown: their outcomes tell the
    worker to apply its own Delta in full (`own_exact`, compression_choice.py `keeps_own_exact`; a `none`
    exchange never does). (The slow link's `medium` is not judged here: its transfer on loopback measures
    the link fast again. tests/test_compression_choice.py judges the rule on rates.)"""
    from node.averaging.compression_choice import PROBE, transfer_s

    cfg = SyncConfig(pair_window_s=10)
    assert cfg.compression == "auto"
    async with AsyncExitStack() as stack:
        avs, nursery = await pair(stack, cfg, cfg)
        others = [avs[1].me, avs[0].me]
        period = 0.5
        assert transfer_s("medium", NUMEL, 1e6) < period < transfer_s("none", NUMEL, 1e6)
        for av in avs:
            av.swarm.period = 1e9  # a FakeSwarm's compute period of an outer step: known, and long

        reqs = [request(1, outer_step=4), request(2, outer_step=4)]
        outcomes = await exchange_both(avs, reqs)
        assert group_sizes(outcomes) == [2, 2] and [o.compression for o in outcomes] == [PROBE, PROBE]
        assert [o.own_exact for o in outcomes] == [True, True]
        assert torch.equal(reqs[0].delta_out, reqs[1].delta_out)
        for av, other in zip(avs, others, strict=True):
            st = av.status()
            assert st["compression"] == "auto" and st["last_compression"] == PROBE
            assert st["last_bytes_per_param"] < 0.1
            assert av.admission.link(other).rate_bps is not None  # the probe taught the link's rate

        # One preset at a time back towards bf16 (a small transfer's rate can be a token bucket's burst).
        outcomes = await exchange_both(avs, [request(7, outer_step=5), request(8, outer_step=5)])
        assert group_sizes(outcomes) == [2, 2] and [o.compression for o in outcomes] == ["medium", "medium"]
        assert [o.own_exact for o in outcomes] == [True, True]
        outcomes = await exchange_both(avs, [request(9, outer_step=6), request(10, outer_step=6)])
        assert group_sizes(outcomes) == [2, 2] and [o.compression for o in outcomes] == ["none", "none"]
        assert all(o.phi_range is None and not o.own_exact for o in outcomes)
        for av in avs:
            st = av.status()
            assert st["compression"] == "auto" and st["last_compression"] == "none"
            assert st["last_bytes_per_param"] == pytest.approx(4.0, abs=0.01)

        for av, other in zip(avs, others, strict=True):
            av.admission.link(other).rate_bps = 1e6
            av.swarm.period = period  # a FakeSwarm's compute period of an outer step
        comp = get_compression("medium")
        reqs = [request(3, outer_step=7), request(4, outer_step=7)]
        outcomes = await exchange_both(avs, reqs)
        assert group_sizes(outcomes) == [2, 2] and [o.compression for o in outcomes] == ["medium", "medium"]
        lo, hi = comp.fragment_range(NUMEL, comp.fragment_of(7))
        assert all(o.phi_range == (lo, hi) for o in outcomes)
        assert torch.equal(reqs[0].delta_out, reqs[1].delta_out)
        assert torch.equal(reqs[0].phi_out[lo:hi], reqs[1].phi_out[lo:hi])
        for av in avs:
            st = av.status()
            assert st["compression"] == "auto" and st["last_compression"] == "medium"
            assert st["last_bytes_per_param"] <= 0.5

        for av in avs:
            av.swarm.period = 1e9
        outcomes = await exchange_both(avs, [request(5, outer_step=8), request(6, outer_step=8)])
        assert group_sizes(outcomes) == [2, 2] and [o.compression for o in outcomes] == ["none", "none"]
        nursery.cancel_scope.cancel()


async def test_a_responder_behind_a_slow_link_gets_the_compression_it_needs_from_a_partner_that_sees_a_fast_one() -> None:
    """The slower side's view wins (node/averaging/compression_choice.py; bench/wan.py one-slow, where fast
    partners sent bf16 to a 10 kB/s trainer and stalled its link for minutes). The initiator has never
    measured this partner and guesses from its fast links (bf16 `none`: 1.2 MB at 1.6 MB/s each way, 0.75 s,
    within two periods of 0.5 s); the responder knows its own link is slow (1 MB/s typical: bf16 1.2 s, too
    long; `medium` 0.13 s). It refuses `none` once, naming `medium`; the initiator asks again at once, in
    the same round, and the exchange completes with `medium` on both sides. The next exchange starts at
    `medium` with no refusal (the initiator's own hysteresis keeps it: at 1.6 MB/s bf16 does not fit in
    half the budget). Rates are set as `_learn_rate` would leave them (loopback is far too fast to be slow)."""
    cfg = SyncConfig(pair_window_s=10)
    assert cfg.compression == "auto"
    async with AsyncExitStack() as stack:
        avs, nursery = await pair(stack, cfg, cfg)
        initiator, responder = sorted(avs, key=lambda av: av.me)  # the smaller PeerID of a pair asks
        refusals: list[tuple[str, AnswerCode, str]] = []
        refused = responder.report.refused

        def counting(peer: str, by: str, code: AnswerCode, reason: str, ours: int, theirs: int) -> None:
            refusals.append((by, code, reason))
            refused(peer, by, code, reason, ours, theirs)

        responder.report.refused = counting  # type: ignore[method-assign]

        def views() -> None:
            initiator._rate_bps, responder._rate_bps = 1.6e6, 1e6
            for av in avs:
                av.swarm.period = 0.5

        views()
        assert initiator.admission.link(responder.me).rate_bps is None  # never measured: its typical rate
        reqs = [request(1, outer_step=4), request(2, outer_step=4)]
        outcomes = await exchange_both(avs, reqs)
        assert group_sizes(outcomes) == [2, 2] and [o.compression for o in outcomes] == ["medium", "medium"]
        assert torch.equal(reqs[0].delta_out, reqs[1].delta_out)
        assert refusals == [("us", AnswerCode.COMPRESSION, refusals[0][2])]
        assert refusals[0][2].startswith("compression mismatch: wants medium")
        last = initiator.status()["last_refusal"]
        assert last is not None and last["by"] == "partner" and last["averaged_since"]

        views()
        initiator.admission.link(responder.me).rate_bps = 1.6e6
        responder.admission.link(initiator.me).rate_bps = 1e6
        outcomes = await exchange_both(avs, [request(3, outer_step=5), request(4, outer_step=5)])
        assert group_sizes(outcomes) == [2, 2] and [o.compression for o in outcomes] == ["medium", "medium"]
        assert len(refusals) == 1
        nursery.cancel_scope.cancel()


class AlwaysRefusing(FakeHost):
    """Connected to one partner that refuses every pairing request for its compression, in `words`, with
    the 1.3.0 code or (`coded` False) as a 1.2.0 peer does, by its words only; keeps the requests."""

    def __init__(self, partner: ID, words: str, coded: bool) -> None:
        super().__init__(create_new_key_pair(), peers={partner: "10.0.0.2"})
        self.answer = AvgAnswer(verdict="refuse", reason=words, outer_step=3,
                                code=AnswerCode.COMPRESSION.value if coded else "")
        self.streams: list[FakeNetStream] = []

    async def new_stream(self, peer: ID, protocols: object) -> FakeNetStream:
        stream = FakeNetStream(encode_msg(self.answer), peer)
        self.streams.append(stream)
        return stream

    async def asked(self) -> list[str]:
        """The preset each request named, in order."""
        return [(await recv_as(LibP2PByteStream(FakeNetStream(bytes(s.written))), AvgRequest)).compression
                for s in self.streams]


@pytest.mark.parametrize("coded", [True, False], ids=["1.3.0", "1.2.0-words"])
async def test_a_partner_that_always_wants_more_compression_gets_its_named_preset_and_no_loop(
    autojump_clock, coded: bool
) -> None:
    """A hostile (or confused) partner refuses every preset, naming `high`: the first try asks `none` (we
    know nothing of the link) and then `high` at once; every later try starts at `high` (the preset it
    named, kept for it), is refused once more and not retried. Whatever it says, we never ask a less
    compressed preset than the last within a try, nor more than one retry here."""
    partner = ID.from_pubkey(create_new_key_pair().public_key)
    host = AlwaysRefusing(partner, "compression mismatch: wants high; yours 'none'", coded)
    averager = Averager(host, SyncConfig(pair_window_s=2, datapath=False), FakeSwarm(host))
    averager._rate_bps = 1e9  # it has measured fast links: `auto` asks `none` first (no probe)
    with trio.fail_after(60):
        assert (await averager.exchange(request(1))).group_size == 1
    asked = await host.asked()
    assert asked[:2] == ["none", "high"] and len(asked) >= 3 and set(asked[2:]) == {"high"}
    assert averager.admission.link(str(partner)).compression == "high"


@pytest.mark.parametrize("coded", [True, False], ids=["1.3.0", "1.2.0-words"])
async def test_a_refusal_that_names_no_preset_moves_one_step_per_retry_and_never_past_high(
    autojump_clock, coded: bool
) -> None:
    """A fixed-preset partner's words name no preset it wants (or a hostile one's name none we know): each
    try steps one preset on per refusal, `none`, `medium`, `high`, and stops there; nothing is kept for
    the partner, so the next try starts from our own choice again."""
    partner = ID.from_pubkey(create_new_key_pair().public_key)
    words = "compression mismatch: yours 'none', ours 'huge': set the same sync.compression on every trainer"
    host = AlwaysRefusing(partner, words, coded)
    averager = Averager(host, SyncConfig(pair_window_s=2, datapath=False), FakeSwarm(host))
    averager._rate_bps = 1e9  # it has measured fast links: `auto` asks `none` first (no probe)
    with trio.fail_after(60):
        assert (await averager.exchange(request(1))).group_size == 1
    asked = await host.asked()
    assert asked[:3] == ["none", "medium", "high"]
    order = ["none", "medium", "high"]
    # Within a try each request is more compressed than the one before; a try after `high` starts over.
    assert all(order.index(b) > order.index(a) or (a == "high" and b == "none") for a, b in itertools.pairwise(asked))
    assert averager.admission.link(str(partner)).compression is None


async def test_a_refusal_naming_a_preset_holds_it_until_a_transfer_measures_the_link_again(autojump_clock) -> None:
    """bench/wan.py, one-slow at 0.4 Mbit/s: a fast trainer had timed the slow trainer's link on a `high`
    probe that passed in a token bucket's burst, so its hysteresis relaxed to `medium` at every exchange,
    and every exchange began with a refusal naming `high` and a retry through that link's queue. The
    refusal now says our rate of that link is no evidence: the named preset holds until a transfer times
    the link again."""
    partner = ID.from_pubkey(create_new_key_pair().public_key)
    host = AlwaysRefusing(partner, "compression mismatch: wants high; yours 'medium'", True)
    averager = Averager(host, SyncConfig(pair_window_s=4, datapath=False), FakeSwarm(host, period=3.0))
    link = averager.admission.link(str(partner))
    link.rate_bps, link.compression = 2.5e6, "high"  # the burst's reading, after a `high` exchange
    with trio.fail_after(60):
        assert (await averager.exchange(request(1))).group_size == 1
    asked = await host.asked()
    assert asked[:2] == ["medium", "high"] and len(asked) >= 3 and set(asked[2:]) == {"high"}
    assert link.compression == "high" and link.rate_bps is None


async def test_a_fixed_preset_initiator_does_not_retry_a_compression_refusal(autojump_clock) -> None:
    partner = ID.from_pubkey(create_new_key_pair().public_key)
    host = AlwaysRefusing(partner, "compression mismatch: wants high", True)
    averager = Averager(host, SyncConfig(compression="none", pair_window_s=2, datapath=False), FakeSwarm(host))
    with trio.fail_after(60):
        assert (await averager.exchange(request(1))).group_size == 1
    assert set(await host.asked()) == {"none"}


async def test_the_bounds_clip_the_decoded_compressed_delta_and_keep_our_own_term_as_the_wire_carried_it() -> None:
    """A 5x Delta through top-k is measured and clipped as decoded; our own term in the clipped sum is still
    our round trip (the worker's error feedback relies on it)."""
    cfg = SyncConfig(compression="medium", pair_window_s=5, clip_ratio=2)
    comp = get_compression("medium")
    async with AsyncExitStack() as stack:
        avs, nursery = await pair(stack, cfg, cfg)
        honest, loud = request(40), request(41)
        loud.delta.mul_(5)
        assert group_sizes(await exchange_both(avs, [honest, loud])) == [2, 2]
        codec = comp.delta_codec("bf16")
        theirs = on_wire(loud.delta, codec)
        scale = 2 * float(honest.delta.norm()) / float(theirs.norm())
        assert scale < 1
        assert torch.allclose(honest.delta_out, on_wire(honest.delta, codec) + scale * theirs, atol=1e-6)
        assert avs[0].status()["clipped"]["delta"] == 1
        nursery.cancel_scope.cancel()


def test_lossy_compression_needs_pairs_and_a_known_preset() -> None:
    with pytest.raises(ValueError, match="sync.compression"):
        SyncConfig(compression="huge").validate()
    with pytest.raises(ValueError, match="group_size = 2"):
        SyncConfig(compression="medium", group_size=4).validate()
    SyncConfig(compression="high").validate()


def test_auto_guesses_a_new_partners_link_from_our_typical_rate_and_keeps_second_rounds_uncompressed() -> None:
    """A partner never measured gets our typical rate (over all partners) until its own is known; without
    either it is the cheapest probe, `high`. A group's second round is always `none`, whatever the link."""
    from node.averaging.compression_choice import preset_for

    def asked(compression: str = "auto", *, stage: int = 1, link: float | None = None, typical: float | None = None,
              group_size: int = 2) -> str:
        return preset_for(compression, stage=stage, link_rate_bps=link, typical_rate_bps=typical, period_s=0.5,
                          numel=NUMEL, previous=None, group_size=group_size, wire_dtype="bf16")

    assert asked() == "high"  # nothing measured anywhere: the cheapest probe (compression_choice.py, `PROBE`)
    assert asked(typical=1e6) == "medium"  # 1 MB/s each way: bf16 takes 1.2 s, medium 0.13 s, against 0.5 s
    assert asked(link=1e9, typical=1e6) == "none"  # the partner's own rate, once measured
    assert asked(stage=2, typical=1e6) == "none"
    assert asked("high") == "high"
    assert asked(typical=1e3, group_size=4) == "none"  # hopeless for bf16, yet groups of four stay `none`


# --- why a partner said no: a code beside the words (protocols/avg.py, `/starling/avg/1.3.0`) ----------------


def test_an_answer_is_read_by_its_code_a_1_2_peers_by_its_words_and_an_unknown_code_as_a_plain_no() -> None:
    """The asker acts on `AnswerCode`, never on the words a 1.3.0 peer sends; a 1.2.0 peer sends only the
    words, which map to the codes they meant; a code added after 1.3.0, or one that contradicts the
    verdict, is a plain busy or refusal (not a malformed answer: swarms upgrade node by node)."""
    assert AnswerCode.of("busy", "not_ready", "whatever it says") is AnswerCode.NOT_READY
    assert AnswerCode.of("busy", "exchanging", "not ready (training between outer steps)") is AnswerCode.EXCHANGING
    assert AnswerCode.of("busy", "", "not ready (training between outer steps)") is AnswerCode.NOT_READY
    assert AnswerCode.of("busy", "", "not ready (in the first round of its outer step)") is AnswerCode.NOT_IN_ROUND
    assert AnswerCode.of("busy", "", "already exchanging") is AnswerCode.EXCHANGING
    assert AnswerCode.of("refuse", "", "outer steps too far apart: yours 3, ours 10") is AnswerCode.STEP_GAP
    assert AnswerCode.of("refuse", "", "not ready") is AnswerCode.REFUSED  # words of a busy answer, refused
    assert AnswerCode.of("busy", "", "something new") is AnswerCode.BUSY
    assert AnswerCode.of("busy", "from_the_future", "not ready") is AnswerCode.BUSY
    assert AnswerCode.of("refuse", "not_ready", "") is AnswerCode.REFUSED  # the code contradicts the verdict
    # (Another streaming fragment's round: the partner reaches ours soon, as one between steps does.)
    assert all(code.asks_again == (code in (AnswerCode.NOT_READY, AnswerCode.NOT_IN_ROUND, AnswerCode.OTHER_FRAGMENT))
               for code in AnswerCode)
    with pytest.raises(ProtocolError):  # the field's limit
        from_map(AvgAnswer, {**to_map(AvgAnswer(verdict="busy")), "code": "x" * (avg.MAX_CODE_LEN + 1)})


@pytest.mark.parametrize("version", [avg.PROTOCOL_ID, avg.PROTOCOL_ID_1_2])
async def test_an_averager_answers_each_protocol_version_in_the_fields_that_version_reads(version: str) -> None:
    """A 1.3.0 averager serves 1.2.0 askers too (nodes not upgraded yet): asked on the 1.2.0 id, its answer
    has no `code`, which a 1.2.0 node's strict decoder would refuse as an unknown field (and count as a
    malformed answer, an offence); asked on the 1.3.0 id, the answer carries the code."""
    legacy_fields = {f.name for f in dataclasses.fields(AvgAnswer)} - {"code"}
    async with AsyncExitStack() as stack:
        hosts = [build_host(create_new_key_pair()) for _ in range(2)]
        for h in hosts:
            await stack.enter_async_context(h.run(LISTEN))
        nursery = await stack.enter_async_context(trio.open_nursery())
        await nursery.start(Averager(hosts[1], SyncConfig(), FakeSwarm(hosts[1])).run)
        await hosts[0].connect(info_from_p2p_addr(hosts[1].get_addrs()[0]))
        asking = AvgRequest(outer_step=3, manifest_hash="m1", layout_hash=LAYOUT_HASH, numel=NUMEL,
                            wire_dtype="bf16", int8_block=4096, chunk_elems=4096, pubkey=bytes(32))
        with trio.fail_after(10):
            stream = await hosts[0].new_stream(hosts[1].get_id(), [version])
            await send_msg(LibP2PByteStream(stream), asking)
            raw = await recv_msg(LibP2PByteStream(stream))
        answer = from_map(AvgAnswer, raw)
        assert answer.verdict == "busy" and answer.reason == "not ready (training between outer steps)"
        if version == avg.PROTOCOL_ID:
            assert raw["code"] == "not_ready"
        else:
            assert set(raw) - {"t", "v"} <= legacy_fields  # what a 1.2.0 decoder accepts
            assert AnswerCode.of(answer.verdict, answer.code, answer.reason) is AnswerCode.NOT_READY
        nursery.cancel_scope.cancel()


async def test_a_node_that_never_averaged_refuses_a_far_phi_without_banning_its_sender() -> None:
    """A fresh model beside a trained swarm (its late join found no trained member in time) is the one far
    from everybody: a partner's phi refused as too far from ours (within 4x our whole model, `wild` False)
    is refused and backed off, but counts as an offence only once our phi is the swarm's (averaged within
    the step gap). Before, three such refusals banned the honest swarm's trainer for 10 minutes
    (tests/test_nat_swarm_lab.py under make test). A wild phi is an offence whatever our phi."""
    from protocols.avg import Rejected

    cfg = SyncConfig(pair_window_s=10, ban_after=3)
    async with AsyncExitStack() as stack:
        avs, nursery = await pair(stack, cfg, cfg)
        me, partner = avs[0], str(avs[1].me)
        far = Rejected("phi_distance", "phi distance from ours 12.5 is over 4x the norm of our own phi", wild=False)
        for _ in range(3):
            me._fail(partner, far, 0.0)
        assert not me.admission.barred(partner)
        assert "not counted as an offence" in me.status()["last_error"]
        me._since_averaged = 0  # averaged just now: our phi is the swarm's
        for _ in range(3):
            me._fail(partner, far, 0.0)
        assert me.admission.barred(partner)
        other = str(avs[0].me)
        for _ in range(3):  # a wild phi, seen by a node that never averaged
            avs[1]._fail(other, Rejected("phi_distance", "phi distance from ours 1e+06", wild=True), 0.0)
        assert avs[1].admission.barred(other)
        nursery.cancel_scope.cancel()


async def test_the_daemons_judge_of_fresh_weights_decides_whether_a_far_phi_is_an_offence() -> None:
    """In the daemon the catch-up judges whether our weights are the swarm's (it also knows that a worker
    restarted from an older checkpoint, which the averager's own count of averaged steps does not): a
    node that averaged a step ago but whose worker went back does not ban an honest partner over its phi."""
    from node.averaging.swarm_view import AveragerHooks
    from protocols.avg import Rejected

    fresh = [False]
    hooks = AveragerHooks(weights_fresh=lambda: fresh[0])
    av = Averager(LoneHost(), SyncConfig(ban_after=3), FakeSwarm(), hooks=hooks)
    av._since_averaged = 0  # its own count says: averaged just now
    far = Rejected("phi_distance", "phi distance from ours 12.5 is over 4x the norm of our own phi", wild=False)
    for _ in range(3):
        av._fail("peer", far, 0.0)
    assert not av.admission.barred("peer")
    fresh[0] = True
    for _ in range(3):
        av._fail("peer", far, 0.0)
    assert av.admission.barred("peer")

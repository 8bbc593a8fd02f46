"""Groups from pairwise exchanges: a second round joins two pairs into a group of four (or a bye into a
pair, a group of three), and every member ends with the group's sample-weighted means."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr
from test_averaging import LISTEN, request

import node.averaging.averager as averager_module
import node.averaging.group_mean as group_mean_module
from node.averaging.averager import Averager
from node.averaging.group_mean import weighted_mean
from node.averaging.swarm_view import AveragerHooks
from node.config.sync import SyncConfig
from p2p.host import build_host
from starling_testing.averaging import FakeSwarm, exchange_both, group_sizes

CFG = SyncConfig(wire_dtype="fp32", pair_window_s=3, group_size=4)


async def connected(stack: AsyncExitStack, n: int, cfg: SyncConfig = CFG) -> list[Averager]:
    hosts = [build_host(create_new_key_pair()) for _ in range(n)]
    for h in hosts:
        await stack.enter_async_context(h.run(LISTEN))
    nursery = await stack.enter_async_context(trio.open_nursery())
    stack.callback(nursery.cancel_scope.cancel)
    avs = [Averager(h, cfg, FakeSwarm(h)) for h in hosts]
    for a in avs:
        await nursery.start(a.run)
    for i in range(n):
        for j in range(i + 1, n):
            await hosts[i].connect(info_from_p2p_addr(hosts[j].get_addrs()[0]))
    return avs


def weighted(values: list[torch.Tensor], weights: list[int]) -> torch.Tensor:
    return sum(w * v for w, v in zip(weights, values, strict=True)) / sum(weights)


def with_samples(seed: int, inner_steps: int, samples: int, outer_step: int = 3):
    r = request(seed, outer_step)
    r.inner_steps, r.samples = inner_steps, samples
    return r


async def test_four_trainers_of_two_speeds_all_end_with_the_sample_weighted_mean_of_the_four() -> None:
    """Two fast trainers (20 inner steps, 160 samples) and two slow ones (10 steps, 80 samples): whatever
    the first round's pairs, the second round crosses them, and every trainer holds 4 x the four's
    sample-weighted means of phi and Delta (the worker divides by 4; no pair weighting is left to it)."""
    async with AsyncExitStack() as stack:
        avs = await connected(stack, 4)
        shape = [(20, 160), (20, 160), (10, 80), (10, 80)]
        reqs = [with_samples(i + 1, *shape[i]) for i in range(4)]
        phis = [r.phi.clone() for r in reqs]
        deltas = [r.delta.clone() for r in reqs]
        outcomes = await exchange_both(avs, reqs)
        assert group_sizes(outcomes) == [4, 4, 4, 4]
        assert all(o.partner_samples == 0 for o in outcomes)
        weights = [s for _, s in shape]
        phi_mean, delta_mean = weighted(phis, weights), weighted(deltas, weights)
        for r in reqs:
            torch.testing.assert_close(r.phi_out / 4, phi_mean, rtol=0, atol=1e-5)
            torch.testing.assert_close(r.delta_out / 4, delta_mean, rtol=0, atol=1e-6)
        for a in avs:
            mixing = a.status()["mixing"]
            assert mixing["averaged"] == 1 and mixing["distinct_partners"] == 2, mixing


async def test_with_three_trainers_the_bye_joins_a_pair_and_nobody_steps_solo() -> None:
    """Three trainers: one pair in the first round, and the bye meets one of the pair in the second. Those
    two hold the three's means (a group of 3); the pair's other member keeps the pair's plain sums
    (its worker weights them by the partner's samples). At no outer step does anyone step solo."""
    async with AsyncExitStack() as stack:
        avs = await connected(stack, 3)
        for step in range(3):
            reqs = [request(10 * step + i, outer_step=step) for i in range(3)]
            phis = [r.phi.clone() for r in reqs]
            results = group_sizes(await exchange_both(avs, reqs))
            assert sorted(results) == [2, 3, 3], results
            mean3 = sum(phis) / 3
            for r, size in zip(reqs, results, strict=True):
                if size == 3:
                    torch.testing.assert_close(r.phi_out / 3, mean3, rtol=0, atol=1e-5)
        for a in avs:
            assert a.status()["solo_rounds"] == 0


async def test_a_pair_whose_second_round_partner_is_absent_keeps_the_pairs_weighted_mean(monkeypatch) -> None:
    """The second round's partner never shows up: the pair's result stands, as n x its sample-weighted
    means (whatever the failed round may have written into the outputs), and the step is not solo."""
    async with AsyncExitStack() as stack:
        avs = await connected(stack, 2)
        a, b = avs[0].me, avs[1].me
        ghost = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # a peer nobody is connected to
        monkeypatch.setattr(averager_module, "scheduled_partners",
                            lambda me, others, step, speeds=None: ((b if me == a else a), ghost))
        reqs = [with_samples(1, 20, 160), with_samples(2, 5, 40)]  # 8 samples per step, as the manifest fixes
        phis = [r.phi.clone() for r in reqs]
        deltas = [r.delta.clone() for r in reqs]
        with trio.fail_after(30):
            outcomes = await exchange_both(avs, reqs)
        assert group_sizes(outcomes) == [2, 2]
        assert all(o.partner_samples == 0 for o in outcomes)
        for r in reqs:
            torch.testing.assert_close(r.phi_out / 2, weighted(phis, [160, 40]), rtol=0, atol=1e-5)
            torch.testing.assert_close(r.delta_out / 2, weighted(deltas, [160, 40]), rtol=0, atol=1e-6)


def bye_joins_in_the_second_round(avs: list[Averager], monkeypatch) -> tuple[Averager, Averager, Averager]:
    """(A, B, C) of three trainers whose schedule pairs A with B in the first round and gives the bye C to A
    in the second (C < A, so C asks A; B < A, so B asks A); a declined request is asked again only after
    every window has passed."""
    c, b, a = sorted(avs, key=lambda av: av.me)
    schedule = {a.me: (b.me, c.me), b.me: (a.me, None), c.me: (None, a.me)}
    monkeypatch.setattr(averager_module, "scheduled_partners", lambda me, others, step, speeds=None: schedule[me])
    monkeypatch.setattr(averager_module, "SCHEDULED_RETRY_S", (8.0, 8.0))
    return a, b, c


async def exchange_c_early_b_late(a: Averager, b: Averager, c: Averager, reqs: dict[str, Any]) -> dict[str, int]:
    """A and C publish at once, B half a second later; each trainer's group size."""
    sizes: dict[str, int] = {}

    async def one(av: Averager, delay: float) -> None:
        await trio.sleep(delay)
        sizes[av.me] = (await av.exchange(reqs[av.me])).group_size

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, a, 0.0)
            nursery.start_soon(one, c, 0.0)
            nursery.start_soon(one, b, 0.5)
    return sizes


async def test_a_second_round_request_that_arrives_during_the_first_round_is_held_not_sent_away(monkeypatch) -> None:
    """Three trainers: A pairs with B in the first round and the bye C joins A in the second. C asks A at
    once, while A still waits for B (B publishes half a second later). A holds C's request until its
    second round begins and serves it then, so A and C end in a group of three. Sent away with "not
    ready", C would ask again only after the retry interval (here set past every window): C would step
    solo and A keep the pair's result."""
    async with AsyncExitStack() as stack:
        a, b, c = bye_joins_in_the_second_round(await connected(stack, 3), monkeypatch)
        reqs = {av.me: request(i + 1) for i, av in enumerate((a, b, c))}
        sizes = await exchange_c_early_b_late(a, b, c, reqs)
        assert [sizes[a.me], sizes[b.me], sizes[c.me]] == [3, 2, 3]
        assert c.status()["declined"] == 0  # C's one request was held and served, never sent away
        mean3 = sum(r.phi for r in reqs.values()) / 3
        for av in (a, c):
            torch.testing.assert_close(reqs[av.me].phi_out / 3, mean3, rtol=0, atol=1e-5)


async def test_a_scheduled_partner_refused_for_another_reason_is_answered_at_once_not_held(monkeypatch) -> None:
    """The same three trainers, but A has banned C: C's second-round request is refused on arrival, though
    C is the partner A's schedule gives it and A is still in its first round. A hold would keep a refused
    request (and one of A's inbound slots) for up to half of C's deadline for nothing: C would hear only
    once A's first round with B had ended."""
    async with AsyncExitStack() as stack:
        a, b, c = bye_joins_in_the_second_round(await connected(stack, 3), monkeypatch)
        for _ in range(a.cfg.ban_after):
            a.note_offence(c.me, "delta_norm")
        assert a.status()["banned"] == [c.me]
        a_rounds_when_c_was_answered: list[int] = []
        c.hooks = AveragerHooks(on_outer_step=lambda averaged: a_rounds_when_c_was_answered.append(a.status()["rounds"]))
        reqs = {av.me: request(i + 1) for i, av in enumerate((a, b, c))}
        sizes = await exchange_c_early_b_late(a, b, c, reqs)
        assert a_rounds_when_c_was_answered == [0]  # answered while A still waited for B
        assert [sizes[a.me], sizes[b.me], sizes[c.me]] == [2, 2, 1]  # A and B pair; C is refused, steps solo
        refusal = c.status()["last_refusal"]
        assert refusal is not None and refusal["by"] == "partner" and refusal["peer"] == a.me


async def test_group_size_2_keeps_one_partner_per_outer_step() -> None:
    """`sync.group_size = 2` turns the second round off: four trainers form two pairs, each with the
    pair's plain sums, as before groups existed."""
    async with AsyncExitStack() as stack:
        avs = await connected(stack, 4, SyncConfig(wire_dtype="fp32", pair_window_s=3, group_size=2,
                                                compression="none"))
        reqs = [request(i + 1) for i in range(4)]
        phis = [r.phi.clone() for r in reqs]
        assert group_sizes(await exchange_both(avs, reqs)) == [2, 2, 2, 2]
        for r in reqs:
            assert any(torch.equal(r.phi_out, r.phi + other) for other in phis if other is not r.phi)


@pytest.mark.parametrize("target", ["fresh", "own", "sum"])
@pytest.mark.parametrize("weights", [(3, 1), (2, 2), (0, 5)], ids=["unequal", "equal", "unknown"])
def test_the_weighted_mean_from_a_pair_sum_is_right_in_place_or_not(target: str, weights: tuple[int, int],
                                                                   monkeypatch) -> None:
    """Also across blocks: 1000 elements in blocks of 300 (three whole ones and a tail)."""
    monkeypatch.setattr(group_mean_module, "BLOCK", 300)
    g = torch.Generator().manual_seed(7)
    own, other = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    pair_sum = own + other
    w_own, w_other = weights if min(weights) > 0 else (1, 1)
    expected = 3 * (w_own * own + w_other * other) / (w_own + w_other)
    out = {"fresh": torch.empty(1000), "own": own.clone(), "sum": pair_sum.clone()}[target]
    mine = out if target == "own" else own.clone()
    total = out if target == "sum" else pair_sum.clone()
    weighted_mean(out.numpy(), mine.numpy(), total.numpy(), *weights, scale=3)  # the daemon's numpy views
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)

"""Streaming fragments in the daemon (issue #23, `sync.fragments`): the setting, the request header and its
refusals, the schedule per (outer step, fragment), two real averagers exchanging fragment by fragment, the
status's bytes per parameter, and the worker loop's slots (tests/test_fragments_worker.py has the trainer's
algebra)."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trio
import trio.testing
from test_averaging import BASE, LAYOUT, LAYOUT_HASH, NUMEL, LoneHost, pair

from node.averaging.averager import Averager
from node.averaging.pairing import matching, scheduled_partners
from node.averaging.report import Report
from node.bridge.exchange import ExchangeOutcome, ExchangeRequest
from node.bridge.ipc import Attach, Publish, Result, Stop, encode_message
from node.bridge.shm import ExchangeSlots
from node.bridge.supervisor import Lifetimes, WorkerSupervisor
from node.config.sync import SyncConfig
from node.config.train import TrainConfig
from node.worker.loop import StopFlag, train_loop
from node.worker.trainer import Trainer
from p2p.wire import ProtocolError, from_map, to_map
from protocols import avg
from protocols.avg import AnswerCode, AvgRequest, Clip, TransferResult
from protocols.compress import MAX_FRAGMENTS, stream_fragment_range
from starling_testing.averaging import FakeSwarm, exchange_both, group_sizes

# --- the setting and the header ---------------------------------------------------------------------------


@pytest.mark.parametrize("count", [0, MAX_FRAGMENTS + 1])
def test_sync_fragments_outside_1_to_64_is_refused_with_the_setting_named(count: int) -> None:
    with pytest.raises(ValueError, match=r"sync\.fragments: between 1 .* and 64, got"):
        SyncConfig(fragments=count).validate()
    SyncConfig(fragments=MAX_FRAGMENTS).validate()


def asking(**fields: object) -> AvgRequest:
    base: dict[str, object] = dict(outer_step=3, manifest_hash="m1", layout_hash=LAYOUT_HASH, numel=NUMEL,
                                   wire_dtype="bf16", int8_block=4096, chunk_elems=4096, pubkey=bytes(32),
                                   compression="none")
    return AvgRequest(**{**base, **fields})  # type: ignore[arg-type]


def test_a_whole_model_request_has_no_fragment_fields_on_the_wire_and_a_fragments_request_has_both() -> None:
    whole = avg.request_map(asking())
    assert "stream_fragment" not in whole and "stream_fragments" not in whole
    assert from_map(AvgRequest, whole) == asking()  # what a peer reads: the defaults, one fragment
    cut = avg.request_map(asking(stream_fragment=2, stream_fragments=4))
    assert (cut["stream_fragment"], cut["stream_fragments"]) == (2, 4)
    assert from_map(AvgRequest, cut) == asking(stream_fragment=2, stream_fragments=4)


@pytest.mark.parametrize("field, value", [("stream_fragments", MAX_FRAGMENTS + 1), ("stream_fragments", 0),
                                          ("stream_fragment", MAX_FRAGMENTS), ("stream_fragment", -1)])
def test_a_fragment_field_beyond_its_limit_is_a_malformed_request(field: str, value: int) -> None:
    with pytest.raises(ProtocolError):
        from_map(AvgRequest, {**to_map(asking()), field: value})


async def judged(cfg: SyncConfig, request: AvgRequest, own: ExchangeRequest) -> tuple[AnswerCode, str] | None:
    """How an averager on `cfg`, looking for a partner for `own` (there is none), answers `request`."""
    av = Averager(LoneHost(), cfg, FakeSwarm(period=5.0))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(av.exchange, own)
        await trio.testing.wait_all_tasks_blocked()
        assert av.status()["state"] == "pairing"
        verdict = av.answer_for(request, "peer")
        nursery.cancel_scope.cancel()
    return verdict


def fragment_request(index: int, count: int, outer_step: int = 3, seed: int = 1) -> ExchangeRequest:
    """Fragment `index` of `count` of a node's slots (slices of whole-model tensors: views, as the
    supervisor hands them)."""
    g = torch.Generator().manual_seed(seed)
    slots = [BASE + torch.randn(NUMEL, generator=g) * 0.01, torch.randn(NUMEL, generator=g) * 0.01,
             torch.full((NUMEL,), float("nan")), torch.full((NUMEL,), float("nan"))]
    lo, hi = stream_fragment_range(NUMEL, index, count)
    phi, delta, phi_out, delta_out = (t[lo:hi] for t in slots)
    return ExchangeRequest(outer_step, phi, delta, phi_out, delta_out, LAYOUT, LAYOUT_HASH, fragment=index,
                           fragments=count)


async def test_a_responder_refuses_another_fragment_count_or_an_index_out_of_range_with_the_fragments_code() -> None:
    cfg = SyncConfig(fragments=4, compression="none")
    own = fragment_request(1, 4)
    size = own.phi.numel()
    code, reason = await judged(cfg, asking(numel=size, stream_fragment=1, stream_fragments=2), own) or (None, "")
    assert code is AnswerCode.FRAGMENTS and code.verdict == "refuse"
    assert reason == "fragments mismatch: yours 2, ours 4 (sync.fragments must be the same on every trainer)"
    code, reason = await judged(cfg, asking(numel=size, stream_fragment=5, stream_fragments=4), own) or (None, "")
    assert code is AnswerCode.FRAGMENTS and reason == "fragments mismatch: fragment 5 out of range for 4"
    # A whole-model request (no fragment fields: one fragment) is another count too.
    assert (await judged(cfg, asking(), own) or (None,))[0] is AnswerCode.FRAGMENTS
    # The same cut, another fragment than our round's: busy, ask again (partners go through the period alike).
    code, _ = await judged(cfg, asking(numel=size, stream_fragment=2, stream_fragments=4), own) or (None, "")
    assert code is AnswerCode.OTHER_FRAGMENT and code.busy and code.asks_again
    # Our fragment, at its size: accepted.
    assert await judged(cfg, asking(numel=size, stream_fragment=1, stream_fragments=4), own) is None
    # Our fragment at another size (another model cut alike): a layout mismatch, not an exception.
    code, _ = await judged(cfg, asking(numel=size - 1, stream_fragment=1, stream_fragments=4), own) or (None, "")
    assert code is AnswerCode.LAYOUT


# --- the schedule -------------------------------------------------------------------------------------------


def test_each_fragment_sync_of_an_outer_step_draws_its_own_matching() -> None:
    members = [f"peer-{i}" for i in range(8)]
    by_fragment = [matching_of(members, 5, f) for f in range(4)]
    assert len({tuple(sorted(m.items())) for m in by_fragment}) > 1  # not one partner for the whole period
    # Every node computes the same matching for a (step, fragment): partners name each other back.
    for f in range(4):
        for me in members:
            partner, _ = scheduled_partners(me, [m for m in members if m != me], 5, fragment=f)
            assert partner is not None and by_fragment[f][partner] == me


def matching_of(members: list[str], step: int, fragment: int) -> dict[str, str | None]:
    return {me: scheduled_partners(me, [m for m in members if m != me], step, fragment=fragment)[0]
            for me in members}


def test_without_fragments_the_schedule_is_the_outer_steps_as_before() -> None:
    members = [f"peer-{i}" for i in range(7)]
    for step in range(6):
        assert matching_of_whole(members, step) == matching(members, step)


def matching_of_whole(members: list[str], step: int) -> dict[str, str | None]:
    return {me: scheduled_partners(me, [m for m in members if m != me], step)[0] for me in members}


# --- two real averagers -------------------------------------------------------------------------------------


async def test_two_averagers_exchanging_fragment_by_fragment_leave_each_fragments_sums_in_its_slice_only() -> None:
    count = 3
    cfg = SyncConfig(wire_dtype="fp32", pair_window_s=10, compression="none", fragments=count)
    slots = [[t.clone() for t in whole_slots(seed)] for seed in (1, 2)]
    async with AsyncExitStack() as stack:
        avs, nursery = await pair(stack, cfg, cfg)
        for f in range(count):
            lo, hi = stream_fragment_range(NUMEL, f, count)
            # Meanwhile the worker changes the other fragments' phi (their results): the exchange must
            # read this fragment's slice alone.
            for phi, *_ in slots:
                phi[:lo] += 1.0
                phi[hi:] -= 1.0
            before = [(s[0][lo:hi].clone(), s[1][lo:hi].clone()) for s in slots]
            reqs = [ExchangeRequest(3, *(t[lo:hi] for t in s), LAYOUT, LAYOUT_HASH, fragment=f, fragments=count)
                    for s in slots]
            assert group_sizes(await exchange_both(avs, reqs)) == [2, 2]
            for _, _, phi_out, delta_out in slots:
                assert torch.equal(phi_out[lo:hi], before[0][0] + before[1][0])
                assert torch.equal(delta_out[lo:hi], before[0][1] + before[1][1])
                assert bool(torch.isnan(phi_out[hi:]).all()) and bool(torch.isnan(delta_out[hi:]).all())
            assert avs[0].status()["rounds"] == f + 1
        st = avs[0].status()
        # Bytes per parameter per outer step: each fragment's latest sync over the model: fp32 phi + Delta.
        assert st["last_bytes_per_param"] == 8.0 and st["bytes_sent"] == 8 * NUMEL
        assert st["fragments"] == count and st["fragment"] is None
        nursery.cancel_scope.cancel()


def whole_slots(seed: int) -> list[torch.Tensor]:
    """A node's four slots (phi, Delta, and the outputs, NaN until written)."""
    g = torch.Generator().manual_seed(seed)
    return [BASE + torch.randn(NUMEL, generator=g) * 0.01, torch.randn(NUMEL, generator=g) * 0.01,
            torch.full((NUMEL,), float("nan")), torch.full((NUMEL,), float("nan"))]


async def test_partners_with_different_fragment_counts_refuse_each_other_and_both_step_solo() -> None:
    async with AsyncExitStack() as stack:
        avs, nursery = await pair(stack, SyncConfig(fragments=2, pair_window_s=1.5, compression="none"),
                                  SyncConfig(fragments=4, pair_window_s=1.5, compression="none"))
        reqs = [fragment_request(0, 2, seed=1), fragment_request(0, 4, seed=2)]
        assert group_sizes(await exchange_both(avs, reqs)) == [1, 1]
        refusals = [av.status()["last_refusal"] for av in avs]
        assert any(r is not None and r["reason"].startswith("fragments mismatch") for r in refusals)
        assert avs[0].status()["rounds"] == avs[1].status()["rounds"] == 0
        nursery.cancel_scope.cancel()


async def test_bytes_per_parameter_with_fragments_is_per_outer_step_over_each_fragments_latest_sync() -> None:
    report = Report(4)

    def sent(n: int) -> TransferResult:
        return TransferResult("stream", n, n, 1.0, (1.0, 1.0), Clip())

    report.exchanged("p", sent(400), 100, "none", (0, 2))  # fragment 0: 4 B/param
    assert report.stats["last_bytes_per_param"] == 4.0
    report.exchanged("q", sent(60), 300, "medium", (1, 2))  # fragment 1: 0.2 B/param
    assert report.stats["last_bytes_per_param"] == pytest.approx(460 / 400)
    report.exchanged("p", sent(20), 100, "medium", (0, 2))  # fragment 0 again: its latest sync counts
    assert report.stats["last_bytes_per_param"] == pytest.approx(80 / 400)
    report.exchanged("p", sent(800), 200, "none")  # the whole model at once: that exchange alone
    assert report.stats["last_bytes_per_param"] == 4.0


# --- the control channel and the worker loop ---------------------------------------------------------------


def test_with_one_fragment_the_control_messages_are_the_frames_they_were() -> None:
    for msg, fields in [(Publish(outer_step=3, step=10), b"fragment"), (Result(outer_step=3, group_size=2), b"fragment"),
                        (Attach(names={"phi": "x"}), b"fragments")]:
        assert fields not in encode_message(msg)
    assert b"fragment" in encode_message(Publish(outer_step=3, step=10, fragment=1, fragments=2))


TINY = TrainConfig(d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=4, data_bytes=100_000,
                   eval_batches=1, warmup=2, lr=3e-3, inner_steps=6, max_lag=1, checkpoint_every=1000,
                   checkpoint_min_s=0)


def test_the_loop_publishes_each_fragment_at_its_slot_skips_one_still_in_flight_and_never_waits(
    tmp_path: Path,
) -> None:
    """H = 6, F = 2: fragment 0 at inner step 3 of each period, fragment 1 at 6. The stand-in daemon
    answers fragment 1 at once and holds fragment 0's first result until step 11, past its next slot
    (step 9), which is then skipped; the worker never blocks for a result (even with max_lag 1)."""
    torch.manual_seed(0)
    trainer = Trainer(TINY, tmp_path, "peer-a")
    published: list[tuple[int, int, int]] = []  # (fragment, inner step, its outer step)
    applied: list[tuple[int, int]] = []

    class Daemon:
        held: list[Publish] = []

        def send(self, msg: object) -> None:
            if isinstance(msg, Publish):
                assert msg.fragments == 2
                published.append((msg.fragment, trainer.step, msg.outer_step))
                self.held.append(msg)

        def receive(self, timeout: float) -> object:
            assert timeout == 0, "the worker blocked for a result"
            if trainer.step >= 20:
                return Stop()
            for msg in self.held:
                if msg.fragment == 1 or trainer.step >= 11:
                    self.held.remove(msg)
                    applied.append((msg.fragment, trainer.step))
                    return Result(outer_step=msg.outer_step, group_size=1, fragment=msg.fragment, fragments=2)
            return None

    slots = ExchangeSlots.create(trainer.numel)
    try:
        train_loop(Daemon(), trainer, slots, StopFlag(), fragments=2)  # type: ignore[arg-type]
    finally:
        slots.close()
    assert published == [(0, 3, 0), (1, 6, 0), (1, 12, 1), (0, 15, 1), (1, 18, 2)]
    assert trainer.fragment_skips == 1  # fragment 0's slot at step 9
    assert applied[:3] == [(1, 6), (0, 11), (1, 12)]
    assert trainer.fragment_outer_steps == [2, 3] and trainer.outer_step == 2


async def wait_until(predicate: Any, timeout: float = 90.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.05)


@pytest.mark.slow
async def test_a_real_worker_and_its_supervisor_exchange_each_fragment_on_its_slices_one_at_a_time(
    tmp_path: Path,
) -> None:
    """Through the control channel and the shared slots: each exchange gets its fragment's slices (views at
    the fragment's offset), exchanges never overlap, and each fragment's count moves on its own."""
    count = 3
    seen: list[tuple[int, int, int]] = []  # (fragment, outer step, size)
    running, most = 0, 0

    async def exchange(req: ExchangeRequest) -> ExchangeOutcome:
        nonlocal running, most
        running += 1
        most = max(most, running)
        assert sup._slots is not None and req.fragments == count
        lo, hi = stream_fragment_range(sup._hello.numel if sup._hello else 0, req.fragment, count)
        base = sup._slots.phi.array.__array_interface__["data"][0]
        assert req.phi.__array_interface__["data"][0] - base == 4 * lo and req.phi.size == hi - lo
        assert np.shares_memory(req.delta_out, sup._slots.delta_out.array) and req.delta_out.size == hi - lo
        seen.append((req.fragment, req.outer_step, req.phi.size))
        await trio.sleep(0.01)
        np.multiply(req.phi, 2, out=req.phi_out)  # a partner identical to us
        np.multiply(req.delta, 2, out=req.delta_out)
        running -= 1
        return ExchangeOutcome(2)

    sup = WorkerSupervisor(TINY, tmp_path, "peer-a", exchange, fragments=count,
                           lifetimes=Lifetimes(backoff_initial=0.1, stop_grace=8.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await wait_until(lambda: len(seen) >= 4 * count)
        nursery.cancel_scope.cancel()
    assert most == 1
    assert {f for f, _, _ in seen} == set(range(count))
    for f in range(count):
        steps = [step for g, step, _ in seen if g == f]
        assert steps == list(range(len(steps)))  # each result reached the worker: its count moved on by one
    assert sup.status()["exchanges"]["group"] >= 4 * count - 1 and sup.status()["exchanges"]["failed"] == 0


def test_the_bounds_reference_is_each_fragments_own_history_not_a_median_over_all_fragments() -> None:
    """A small fragment (norm 1 per step) and a large one (norm 100): the large one's history must not lift
    the small one's reference, or a partner could send 100x the small fragment's honest update unclipped."""
    from node.averaging.robust import UpdateBound

    bound = UpdateBound(clip_ratio=2.0, reject_ratio=1e6)
    for _ in range(5):
        bound.remember(100.0, 1, fragment=1)
    bound.remember(1.0, 1, fragment=0)
    assert bound.reference(1.0, 1, 1, fragment=0) == 1.0
    assert bound.reference(1.0, 1, 1, fragment=1) == 100.0
    assert bound.reference(1.0, 1, 1) == 1.0  # the whole model's (fragment 0's) history alone


async def test_the_catch_ups_count_reaches_every_fragment_once(autojump_clock: Any) -> None:
    """Each fragment keeps its own count: the count the catch-up asks for goes to the next sync of every
    fragment, once each, not to whichever fragment happens to sync next alone."""
    av = Averager(LoneHost(), SyncConfig(pair_window_s=600, datapath=False, fragments=2),
                  FakeSwarm(partners=[], others=False))
    av.follow(9)
    first = await av.exchange(fragment_request(0, 2, outer_step=3))
    again = await av.exchange(fragment_request(0, 2, outer_step=10))  # fragment 0 followed already
    other = await av.exchange(fragment_request(1, 2, outer_step=3))
    after = await av.exchange(fragment_request(1, 2, outer_step=10))  # both followed: asked no more
    assert [o.group_outer_step for o in (first, other)] == [9, 9]
    assert again.group_outer_step in (None, 10) and after.group_outer_step in (None, 10)


def test_judging_a_fragment_reads_that_fragments_history_for_the_reference() -> None:
    """The reference a judged exchange gets is the median of the same fragment's history (a bug once read
    another variable as the fragment, and every judge fell back to the current norm alone)."""
    from node.averaging.robust import UpdateBound
    from protocols.avg import Received

    bound = UpdateBound(clip_ratio=2.0, reject_ratio=1e6, clip_phi_ratio=4.0)
    for norm in (1.0, 1.0, 1.0):
        bound.remember(norm, 1, fragment=2)
    # Our Delta now 0.5, the history's median 1.0: the partner's phi distance of 4.0 is within 4 x 1.0.
    seen = Received(their_delta_sq=0.25, own_delta_sq=0.25, phi_distance_sq=16.0, own_phi_sq=1e6, model_phi_sq=1e6)
    assert bound.judge(seen, 1, 1, fragment=2).phi_scale == 1.0
    assert bound.judge(seen, 1, 1, fragment=3).phi_scale == pytest.approx(0.5)  # no history: 4 x 0.5


def test_with_the_swarms_pace_fragment_f_is_due_at_f_plus_1_over_f_of_the_period(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer = Trainer(TINY, tmp_path, "peer-a")
    trainer.set_fragments(4)
    trainer.inner_step()  # (a slot needs a step since the period began, as a publish does)
    trainer.step_time_s = 0.0
    trainer.set_pace(8.0)
    assert trainer.next_publish_at is not None
    start = trainer.next_publish_at - 8.0
    for f in range(4):
        slot = start + 2.0 * (f + 1)
        assert trainer.fragment_due(now=slot - 0.01) is None
        assert trainer.fragment_due(now=slot) == f
        trainer.pass_fragment_slot()
    # After the last slot a new period begins, a period from now.
    assert trainer.fragment_slot == 0 and trainer.next_publish_at >= start + 8.0

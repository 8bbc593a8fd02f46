"""Catch-up: a trainer that drifted out of every partner's reach re-syncs from the swarm and pairs again.

In-process first (the choice of reference and donors, the trigger, a real snapshot download, the worker's
adoption), then one test with two real daemons, one of them far behind.
"""

from __future__ import annotations

import dataclasses
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import multiaddr
import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr

from node.averaging import latejoin
from node.averaging.latejoin import CatchUp
from node.bridge.exchange import ExchangeOutcome
from node.bridge.ipc import Adopted, CheckpointSaved, Publish, Result, Stop
from node.bridge.shm import ExchangeSlots
from node.config.sync import SyncConfig
from node.config.train import TrainConfig
from node.worker.checkpoint import CheckpointError, write_checkpoint
from node.worker.loop import StopFlag, train_loop
from node.worker.trainer import Trainer
from p2p.host import build_host
from protocols import snapshot as snap
from starling_testing.daemon import TINY as TINY_DAEMON
from starling_testing.daemon import DaemonGroup

TINY = TrainConfig(d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=4, data_bytes=100_000,
                   eval_batches=1, warmup=2, lr=3e-3, inner_steps=5, max_lag=2, checkpoint_every=1,
                   checkpoint_min_s=0)
LISTEN = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
MODEL = snap.ModelShape("L", 10)  # our worker's model, where no real download checks it


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def catch_up(tmp_path: Path, own: int, others: dict[str, int], *, host: Any = None,
             delivered: list | None = None, model: snap.ModelShape = MODEL, relayed: tuple[str, ...] = (),
             **cfg: Any) -> CatchUp:
    return CatchUp(
        host,
        tmp_path,
        SyncConfig(**{"max_step_gap": 4, "catch_up_after": 3, **cfg}),
        own_outer_step=lambda: own,
        trainers=lambda: dict(others),
        deliver=lambda path, outer_step: (delivered if delivered is not None else []).append((path, outer_step)),
        model=lambda: model,
        may_download_from=lambda peer: peer not in relayed,
    )


# --- whom to catch up to ----------------------------------------------------------------------------------


def test_a_node_far_behind_takes_donors_nearest_the_swarms_median(tmp_path: Path) -> None:
    plan = catch_up(tmp_path, 0, {"a": 20, "b": 22, "c": 19, "d": 40}).plan()
    assert plan == (20, ["a", "c", "b"])  # median of 0, 19, 20, 22, 40; the runaway d is no donor


def test_a_trainer_reachable_only_through_a_relay_counts_for_the_swarms_position_but_serves_no_snapshot(
    tmp_path: Path,
) -> None:
    assert catch_up(tmp_path, 0, {"a": 20, "b": 22, "c": 19}, relayed=("a",)).plan() == (20, ["c", "b"])
    assert catch_up(tmp_path, 0, {"a": 20, "b": 22}, relayed=("a", "b")).plan() is None  # no donor: no plan


def test_a_runaway_node_comes_back_to_the_majority_and_the_majority_stays(tmp_path: Path) -> None:
    assert catch_up(tmp_path, 100, {"a": 10, "b": 11}).plan() == (11, ["b", "a"])
    assert catch_up(tmp_path, 10, {"a": 11, "runaway": 100}).plan() is None  # we are the swarm's middle


def test_between_two_nodes_the_one_behind_catches_up_to_the_one_ahead(tmp_path: Path) -> None:
    assert catch_up(tmp_path, 0, {"ahead": 30}).plan() == (30, ["ahead"])
    assert catch_up(tmp_path, 30, {"behind": 0}).plan() is None


def test_no_catch_up_when_alone_or_when_every_trainer_is_within_reach(tmp_path: Path) -> None:
    assert catch_up(tmp_path, 5, {}).plan() is None
    assert catch_up(tmp_path, 5, {"a": 9, "b": 1}).plan() is None


def test_donors_must_have_trained_and_there_is_at_least_one_even_with_late_join_off(tmp_path: Path) -> None:
    assert catch_up(tmp_path, 50, {"a": 0, "b": 0, "c": 1, "d": 2}).plan() == (2, ["d", "c"])


def test_a_trainer_that_has_not_made_an_outer_step_is_no_part_of_the_swarms_position(tmp_path: Path) -> None:
    """Seen in a late-join run: a node at outer step 22 planned a catch-up towards the founder at 179, and a
    joiner still downloading (outer step 0) then made the median of {22, 179, 0} 22: the snapshot was
    delivered at outer step 22 ("outer step 22 -> 22"), and the same joiner could stop the plan itself."""
    cu = catch_up(tmp_path, 22, {"founder": 179, "joiner": 0})
    assert cu.plan() == (179, ["founder"])
    assert cu.swarm_outer_step() == 179
    assert catch_up(tmp_path, 22, {"joiner": 0}).swarm_outer_step() is None  # alone as far as steps go
    assert catch_up(tmp_path, 0, {"a": 20, "b": 21}, join_donors=0).plan() == (20, ["a"])


def test_a_late_join_takes_donors_near_the_swarms_position_not_a_mean_of_far_apart_models() -> None:
    """A founder that ran ahead alone (179) and a second node still catching up (22): the joiner took the
    mean of both, at the low median's outer step 22. Between two, the one further ahead is the reference."""
    assert latejoin.near_the_swarm({"founder": 179, "second": 22}, 4) == ["founder"]
    assert sorted(latejoin.near_the_swarm({"a": 30, "b": 31, "c": 28, "runaway": 90}, 4)) == ["a", "b", "c"]
    assert latejoin.near_the_swarm({}, 4) == []


# --- when: the trigger ------------------------------------------------------------------------------------


@pytest.fixture
def fake_download(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Replace the network download with one that writes nothing and succeeds; records the donors."""
    calls: list[list[str]] = []

    async def fetch(host, directory, donors, target, *, model, timeout_s, status, on_refused=None):
        calls.append(list(donors))
        return {"step": 100, "outer_step": 20, "donors": list(donors)}

    monkeypatch.setattr(latejoin, "fetch_swarm_snapshot", fetch)
    return calls


async def test_a_catch_up_starts_after_catch_up_after_outer_steps_in_a_row_without_a_partner(
    tmp_path: Path, fake_download: list, autojump_clock
) -> None:
    delivered: list = []
    cu = catch_up(tmp_path, 0, {"a": 20, "b": 21}, delivered=delivered)
    async with trio.open_nursery() as nursery:
        await nursery.start(cu.run)
        for had_partner in (False, False, True, False, False):  # a partner in between resets the count
            cu.note_outer_step(had_partner)
            await trio.sleep(1)
        assert fake_download == [] and delivered == []
        cu.note_outer_step(False)
        await trio.sleep(1)
        assert fake_download == [["a", "b"]]
        assert [p for p, _ in delivered] == [tmp_path / "catchup" / "snapshot.pt"]
        assert delivered[0][1]() == 20  # the swarm's outer step, asked when the worker adopts
        assert cu.status["state"] == "waiting for the next outer step"

        # Until the worker has adopted the snapshot, no further download starts.
        for _ in range(5):
            cu.note_outer_step(False)
            await trio.sleep(1)
        assert len(fake_download) == 1
        cu.adopted(Adopted(previous_step=10, previous_outer_step=2, step=100, outer_step=21, donors=["a", "b"]))
        assert cu.catch_ups == 1 and cu.status["state"] == "done"
        nursery.cancel_scope.cancel()


async def test_a_refusal_as_too_far_behind_starts_the_catch_up_at_once(
    tmp_path: Path, fake_download: list, autojump_clock
) -> None:
    """Issue #27: a worker restarted after `kill -9` resumed outer steps back; its partner refused it as too
    far behind while both stepped solo. The refusal starts the catch-up, without `catch_up_after` more
    outer steps (each a whole pairing window); a partner within the gap, or ahead of nobody, does not."""
    cu = catch_up(tmp_path, 10, {"a": 15})
    async with trio.open_nursery() as nursery:
        await nursery.start(cu.run)
        cu.behind(14)  # within the gap (4): no catch-up
        await trio.sleep(1)
        assert fake_download == []
        cu.behind(15)
        await trio.sleep(1)
        assert fake_download == [["a"]]
        cu.adopted(Adopted(previous_step=10, previous_outer_step=10, step=100, outer_step=15, donors=["a"]))
        # A refusal soon after (a worker restarted from an older checkpoint) does not wait out the
        # interval that guards the member records' lag.
        cu.behind(15)
        await trio.sleep(1)
        assert len(fake_download) == 2
        nursery.cancel_scope.cancel()


async def test_a_worker_restarted_from_an_older_checkpoint_soon_after_a_catch_up_catches_up_at_once(
    tmp_path: Path, fake_download: list, autojump_clock
) -> None:
    """Issue #27, `kill -9` of a worker (through real daemons: tests/test_diagnostics_daemons.py): restarted
    20 s after the node's previous catch-up, out of its partner's reach, it stepped solo for the 10 s left
    of `CATCH_UP_INTERVAL_S`. Its own step going back is no lagging record: the interval is lifted."""
    own, swarm = [0], [20]
    cu = CatchUp(None, tmp_path, SyncConfig(max_step_gap=4, catch_up_after=3), own_outer_step=lambda: own[0],
                 trainers=lambda: {"a": swarm[0]}, deliver=lambda path, step: None, model=lambda: MODEL)
    async with trio.open_nursery() as nursery:
        await nursery.start(cu.run)
        for _ in range(3):
            cu.note_outer_step(False)
            await trio.sleep(1)
        assert len(fake_download) == 1
        first = trio.current_time()
        own[0] = 20
        cu.adopted(Adopted(previous_step=10, previous_outer_step=3, step=100, outer_step=20, donors=["a"]))
        for _ in range(5):  # averaged again
            own[0] += 1
            swarm[0] += 1
            cu.note_outer_step(True)
            await trio.sleep(1)
        own[0], swarm[0] = 12, 27  # the worker resumed from a checkpoint 13 outer steps back
        for _ in range(3):
            cu.note_outer_step(False)
            await trio.sleep(1)
            own[0] += 1
        assert len(fake_download) == 2
        assert trio.current_time() - first < latejoin.CATCH_UP_INTERVAL_S
        nursery.cancel_scope.cancel()


async def test_catch_up_after_0_never_catches_up(tmp_path: Path, fake_download: list, autojump_clock) -> None:
    cu = catch_up(tmp_path, 0, {"a": 20}, catch_up_after=0)
    async with trio.open_nursery() as nursery:
        await nursery.start(cu.run)
        for _ in range(10):
            cu.note_outer_step(False)
            await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert fake_download == [] and cu.unpaired == 10


# --- over a slow link: the count alone ---------------------------------------------------------------------

SLOW_MODEL = snap.ModelShape("L", 1_000_000)  # 4 MB of float32 per donor


def slow_link_catch_up(tmp_path: Path, own: list[int], others: dict[str, int], *, rate_bps: float | None,
                       period_s: float = 10.0) -> tuple[CatchUp, list[int]]:
    """A catch-up whose link measured `rate_bps` (bytes/s each way) and whose outer steps take `period_s`;
    returns it and the counts it asked the averager to follow."""
    followed: list[int] = []
    cu = CatchUp(None, tmp_path, SyncConfig(max_step_gap=4, catch_up_after=3), own_outer_step=lambda: own[0],
                 trainers=lambda: dict(others), deliver=lambda path, step: None, model=lambda: SLOW_MODEL,
                 link_rate_bps=lambda: rate_bps, period_s=lambda: period_s, follow=followed.append)
    return cu, followed


async def test_a_trainer_behind_only_in_count_over_a_slow_link_follows_the_swarm_without_a_download(
    tmp_path: Path, fake_download: list, autojump_clock
) -> None:
    """Issue #23, bench/wan.py one-slow: the 10 kB/s trainer averaged most of its outer steps but fell 5
    behind in count (its exchanges stretched its outer steps), was refused as too far behind, and spent the
    rest of the run downloading three donors' float32 weights (minutes over its link) while its pairing and
    SWIM timed out. Its weights were the swarm's: moving its count is enough, and costs no byte."""
    own = [10]
    cu, followed = slow_link_catch_up(tmp_path, own, {"a": 15, "b": 16, "c": 15}, rate_bps=10_000)
    async with trio.open_nursery() as nursery:
        await nursery.start(cu.run)
        cu.note_outer_step(True)  # averaged: its weights are the swarm's
        cu.behind(16)
        await trio.sleep(1)
        assert fake_download == [] and followed == [15]  # the swarm's median, not the refusing partner's word
        assert cu.follows == 1 and cu.catch_ups == 0
        assert cu.status["state"] == "followed the swarm's outer step without a download"
        assert (cu.status["from_outer_step"], cu.status["swarm_outer_step"]) == (10, 15)
        nursery.cancel_scope.cancel()


async def test_a_count_that_ran_ahead_over_a_slow_link_goes_back_to_the_swarms_without_a_download(
    tmp_path: Path, fake_download: list, autojump_clock
) -> None:
    """bench/wan.py one-slow after the change above: the 10 kB/s trainer's exchanges failed, it stepped solo
    at its compute pace while its partners waited on theirs, and its count ran 5 past the swarm's; after
    3 solo steps it downloaded two donors' weights. Averaged 3 outer steps before, its weights were the
    swarm's: the count goes back, and its own move back is not taken for a worker restart."""
    own = [22]
    cu, followed = slow_link_catch_up(tmp_path, own, {"a": 17, "b": 17, "c": 16}, rate_bps=10_000)
    async with trio.open_nursery() as nursery:
        await nursery.start(cu.run)
        for had_partner in (True, False, False, False):
            cu.note_outer_step(had_partner)
            await trio.sleep(1)
        assert fake_download == [] and followed == [17]
        own[0] = 18  # the worker went back to the swarm's count
        cu.note_outer_step(False)
        assert cu.since_averaged == 4  # no restart: still fresh
        nursery.cancel_scope.cancel()


async def test_a_cheap_download_or_stale_weights_still_download_the_swarms_weights(
    tmp_path: Path, fake_download: list, autojump_clock
) -> None:
    """The count alone only where the weights are fresh and the download dear; otherwise, as before, the
    swarm's weights: a fast link (a second of download: the exact weights are worth it), a node that has
    not averaged for more than `max_step_gap` outer steps, a worker gone back to an older checkpoint, and
    a rate never measured."""
    others = {"a": 15, "b": 16, "c": 15}
    fast, _ = slow_link_catch_up(tmp_path, [10], others, rate_bps=100e6)
    fast.note_outer_step(True)
    assert fast.follow_instead(15, 3) is None
    unknown, _ = slow_link_catch_up(tmp_path, [10], others, rate_bps=None)
    unknown.note_outer_step(True)
    assert unknown.follow_instead(15, 3) is None
    stale, _ = slow_link_catch_up(tmp_path, [10], others, rate_bps=10_000)
    assert stale.follow_instead(15, 3) is None  # never averaged since it started
    for had_partner in (True, False, False, False, False):
        stale.note_outer_step(had_partner)
    assert stale.follow_instead(15, 3) is not None  # 4 outer steps solo since: within the gap
    stale.note_outer_step(False)
    assert stale.follow_instead(15, 3) is None  # 5: beyond it
    restarts = [0]
    killed, _ = slow_link_catch_up(tmp_path, [10], others, rate_bps=10_000)
    killed.worker_restarts = lambda: restarts[0]
    killed.note_outer_step(True)
    assert killed.follow_instead(15, 3) is not None
    restarts[0] = 1  # its worker was killed and resumed a checkpoint at the same outer step
    assert killed.follow_instead(15, 3) is None
    own = [12]
    restarted, _ = slow_link_catch_up(tmp_path, own, others, rate_bps=10_000)
    restarted.note_outer_step(True)
    assert restarted.follow_instead(15, 3) is not None
    own[0] = 9  # the worker resumed from an older checkpoint
    restarted.note_outer_step(False)
    assert restarted.follow_instead(15, 3) is None

    own = [10]
    cu, followed = slow_link_catch_up(tmp_path, own, others, rate_bps=10_000)
    async with trio.open_nursery() as nursery:
        await nursery.start(cu.run)
        for _ in range(3):  # never averaged since it started
            cu.note_outer_step(False)
            await trio.sleep(1)
        assert [sorted(d) for d in fake_download] == [["a", "b", "c"]] and followed == []
        nursery.cancel_scope.cancel()


# --- the download and the adoption -------------------------------------------------------------------------


def trained(home: Path, outer_steps: int) -> Trainer:
    tr = Trainer(TINY, home, "peer-a")
    for _ in range(outer_steps):
        while not tr.publish_due():
            tr.inner_step()
        tr.publish(torch.empty(tr.numel), torch.empty(tr.numel))
        tr.apply_result(ExchangeOutcome(1))
    return tr


def flat(trainer: Trainer) -> torch.Tensor:
    out = torch.empty(trainer.numel)
    trainer.gather_theta(out)
    return out


async def test_a_node_far_behind_downloads_the_swarms_weights_and_adopts_them_at_the_swarms_outer_step(
    tmp_path: Path,
) -> None:
    donor = trained(tmp_path / "donor", 4)
    behind = trained(tmp_path / "behind", 1)
    served = snap.Snapshot.of(donor.phi, donor.step, donor.outer_step, donor.layout_hash)
    delivered: list = []
    async with AsyncExitStack() as stack:
        hosts = [build_host(create_new_key_pair()) for _ in range(2)]
        for h in hosts:
            await stack.enter_async_context(h.run(LISTEN))
        await hosts[0].connect(info_from_p2p_addr(hosts[1].get_addrs()[0]))
        hosts[1].set_stream_handler(snap.PROTOCOL_ID, snap.SnapshotServer(lambda: served).handle)
        # The donor has moved on since its checkpoint: the swarm is at outer step 30.
        cu = catch_up(tmp_path / "behind", behind.outer_step, {str(hosts[1].get_id()): 30}, host=hosts[0],
                      delivered=delivered, model=snap.ModelShape(behind.layout_hash, behind.numel))
        nursery = await stack.enter_async_context(trio.open_nursery())
        await nursery.start(cu.run)
        with trio.fail_after(30):
            while not delivered:
                cu.note_outer_step(False)
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    path, swarm_outer_step = delivered[0]
    assert cu.status["snapshot_outer_step"] == donor.outer_step

    while not behind.publish_due():
        behind.inner_step()
    behind.publish(torch.empty(behind.numel), torch.empty(behind.numel))
    behind.outer.momentum.fill_(0.5)
    adam_before = {k: v.clone() for k, v in behind.optimizer.state[behind.params[0]].items()}
    report = behind.adopt_snapshot(path, swarm_outer_step())
    assert (report.previous_outer_step, report.outer_step) == (1, 30)
    assert (behind.step, behind.outer_step, behind.pending) == (donor.step, 30, None)
    assert torch.equal(behind.phi, donor.phi) and torch.equal(flat(behind), donor.phi)
    assert not behind.outer.momentum.any()  # its own solo trajectory's momentum is dropped
    kept = behind.optimizer.state[behind.params[0]]
    assert all(torch.equal(kept[k], v) for k, v in adam_before.items())  # the inner Adam state is kept
    assert report.val_loss == behind.val_loss is not None
    assert not path.exists()  # consumed
    assert behind.publish_due() is False and behind.last_publish_step == behind.step


def test_a_solo_result_with_an_exact_count_sets_the_workers_outer_step_back(tmp_path: Path) -> None:
    """The count alone, back: a solo step's `exact_outer_step` sets the counter outright (below ours), and
    leaves the weights and the inner step as a solo step leaves them."""
    tr = trained(tmp_path / "ahead", 3)
    assert tr.outer_step == 3
    while not tr.publish_due():
        tr.inner_step()
    tr.publish(torch.empty(tr.numel), torch.empty(tr.numel))
    step = tr.step
    assert tr.apply_result(ExchangeOutcome(1, exact_outer_step=1)) == 1
    assert (tr.outer_step, tr.step) == (2, step)


def test_a_catch_up_never_sets_the_outer_step_below_the_snapshots_own(tmp_path: Path) -> None:
    """The catch-up's `outer step 22 -> 22` while the swarm was at 179: the weights came from outer step 179
    but the daemon's swarm median (22, dragged down by a trainer that had not started) set the counter."""
    donor = trained(tmp_path / "donor", 4)
    behind = trained(tmp_path / "behind", 1)
    path = tmp_path / "snapshot.pt"
    write_checkpoint(path, {"phi": donor.phi, "step": donor.step, "outer_step": donor.outer_step,
                            "layout_hash": donor.layout_hash, "donors": ["d"]})
    report = behind.adopt_snapshot(path, behind.outer_step)
    assert (report.previous_outer_step, report.outer_step) == (1, 4)
    assert behind.outer_step == donor.outer_step and behind.step == donor.step


def test_a_snapshot_of_another_model_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    tr = trained(tmp_path, 1)
    before = (tr.step, tr.outer_step, tr.phi.clone())
    path = tmp_path / "snapshot.pt"
    write_checkpoint(path, {"phi": torch.zeros(7), "step": 5, "outer_step": 9, "layout_hash": tr.layout_hash})
    with pytest.raises(CheckpointError, match="different model"):
        tr.adopt_snapshot(path, 40)
    assert (tr.step, tr.outer_step) == before[:2] and torch.equal(tr.phi, before[2])


def test_a_snapshot_whose_slow_weights_are_not_finite_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    tr = trained(tmp_path, 1)
    before = (tr.step, tr.outer_step, tr.phi.clone())
    phi = tr.phi.clone()
    phi[3] = float("nan")
    path = tmp_path / "snapshot.pt"
    write_checkpoint(path, {"phi": phi, "step": 5, "outer_step": 9, "layout_hash": tr.layout_hash})
    with pytest.raises(CheckpointError, match="not finite"):
        tr.adopt_snapshot(path, 40)
    assert (tr.step, tr.outer_step) == before[:2] and torch.equal(tr.phi, before[2])


async def test_a_late_join_whose_donors_cannot_be_combined_starts_a_fresh_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, combine's ValueError (donors that disagree on the model, a file of the wrong size) escaped
    late_join and took the daemon down with a traceback, at every start."""

    async def fetch(host, directory, donors, target, *, model, timeout_s, status, on_refused=None):
        raise ValueError("the donors disagree on the model (layout or size) and no majority decides")

    monkeypatch.setattr(latejoin, "fetch_swarm_snapshot", fetch)
    status: dict[str, Any] = {}
    joined = await latejoin.late_join(None, tmp_path, lambda: ["a", "b"], model=MODEL, max_donors=3, wait_s=1, timeout_s=5,
                                      status=status)
    assert joined is False
    assert status["state"].startswith("download failed (the donors disagree") and "fresh model" in status["state"]


async def test_a_late_join_that_knows_no_one_starts_at_once_instead_of_after_join_wait_s(
    tmp_path: Path, autojump_clock
) -> None:
    """Issue #27: every first start of a trainer waited `sync.join_wait_s` (10 s) for donors, even the
    founder of a swarm with no bootstrap peer and nobody else known. A node that knows someone still waits."""
    status: dict[str, Any] = {}
    began = trio.current_time()
    assert not await latejoin.late_join(None, tmp_path, list, model=MODEL, max_donors=3, wait_s=600, timeout_s=5,
                                        status=status, alone=lambda: True)
    assert trio.current_time() - began <= latejoin.ALONE_GRACE_S + 0.5
    assert status["state"] == "alone: starting a fresh model"

    began = trio.current_time()
    assert not await latejoin.late_join(None, tmp_path, list, model=MODEL, max_donors=3, wait_s=600, timeout_s=5,
                                        status=status, alone=lambda: False)
    assert trio.current_time() - began >= 600 and status["state"] == "no donors: starting a fresh model"


async def test_a_late_join_waits_for_donors_that_appear_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock
) -> None:
    """With SWIM membership a joiner holds its seed alive at once and the other trainers a second or two
    later. Before, the first list was taken: the bootstrap node alone, and the joiner started from one
    replica instead of the swarm's mean (test_swarm's late joiner found 1 donor of 2)."""
    asked: list[list[str]] = []

    async def fetch(host, directory, donors, target, *, model, timeout_s, status, on_refused=None):
        asked.append(list(donors))
        raise ValueError("stop here: the donors chosen are what this test checks")

    monkeypatch.setattr(latejoin, "fetch_swarm_snapshot", fetch)
    began = trio.current_time()

    def donors() -> list[str]:
        late = trio.current_time() - began
        return ["seed"] + (["b"] if late >= 2.0 else []) + (["c"] if late >= 4.0 else [])

    await latejoin.late_join(None, tmp_path, donors, model=MODEL, max_donors=3, wait_s=60, timeout_s=5, status={})
    assert sorted(asked[0]) == ["b", "c", "seed"]

    asked.clear()  # no second donor ever: the wait ends DONOR_SETTLE_S after the first, not at wait_s
    began = trio.current_time()
    await latejoin.late_join(None, tmp_path, lambda: ["seed"], model=MODEL, max_donors=3, wait_s=60, timeout_s=5,
                             status={})
    assert asked == [["seed"]] and trio.current_time() - began <= latejoin.DONOR_SETTLE_S + 1.0


def test_a_runaway_that_comes_back_drops_its_later_checkpoints_so_a_restart_does_not_undo_it(tmp_path: Path) -> None:
    donor = trained(tmp_path / "donor", 1)
    runaway = trained(tmp_path / "runaway", 3)
    runaway.save_checkpoint()
    path = tmp_path / "snapshot.pt"
    write_checkpoint(path, {"phi": donor.phi, "step": donor.step, "outer_step": donor.outer_step,
                            "layout_hash": donor.layout_hash, "donors": ["d"]})
    runaway.adopt_snapshot(path)
    assert runaway.outer_step == donor.outer_step  # no swarm step given: the snapshot's
    runaway.save_checkpoint()
    again = Trainer(TINY, tmp_path / "runaway", "peer-a")
    again.resume()
    assert (again.step, again.outer_step) == (donor.step, donor.outer_step)
    assert torch.equal(again.phi, donor.phi)


class ScriptedDaemon:
    """The daemon's end of the worker channel: answers the first publish with `first`, later ones solo."""

    def __init__(self, trainer: Trainer, first: Result, outer_steps: int) -> None:
        self.trainer = trainer
        self.first: Result | None = first
        self.outer_steps = outer_steps
        self.sent: list = []
        self.pending: Publish | None = None

    def send(self, msg) -> None:
        self.sent.append(msg)
        if isinstance(msg, Publish):
            self.pending = msg

    def receive(self, timeout: float):
        if len([m for m in self.sent if isinstance(m, Publish)]) > self.outer_steps:
            return Stop()
        if self.pending is None:
            return None
        msg, self.pending = self.pending, None
        if self.first is not None:
            answer, self.first = self.first, None
            return dataclasses.replace(answer, outer_step=msg.outer_step)
        return Result(outer_step=msg.outer_step, group_size=1)


def run_worker_loop(trainer: Trainer, first: Result, outer_steps: int = 2) -> list:
    daemon = ScriptedDaemon(trainer, first, outer_steps)
    slots = ExchangeSlots.create(trainer.numel)
    try:
        train_loop(daemon, trainer, slots, StopFlag())  # type: ignore[arg-type]
    finally:
        slots.close()
    return daemon.sent


def test_the_worker_loop_adopts_a_catch_up_reports_it_and_checkpoints_at_once(tmp_path: Path) -> None:
    donor = trained(tmp_path / "donor", 3)
    path = tmp_path / "snapshot.pt"
    write_checkpoint(path, {"phi": donor.phi, "step": donor.step, "outer_step": donor.outer_step,
                            "layout_hash": donor.layout_hash, "donors": ["d1", "d2"]})
    tr = Trainer(TINY, tmp_path / "behind", "peer-b")
    sent = run_worker_loop(tr, Result(outer_step=0, group_size=1, adopt=str(path), adopt_outer_step=25))
    adopted = [m for m in sent if isinstance(m, Adopted)]
    assert len(adopted) == 1 and adopted[0].error == ""
    assert (adopted[0].previous_outer_step, adopted[0].outer_step, adopted[0].step) == (0, 25, donor.step)
    assert adopted[0].donors == ["d1", "d2"]
    after = sent[sent.index(adopted[0]) + 1]
    assert isinstance(after, CheckpointSaved) and (after.step, after.outer_step) == (donor.step, 25)
    publishes = [m for m in sent if isinstance(m, Publish)]
    assert publishes[1].outer_step == 25 and publishes[1].step == donor.step + TINY.inner_steps


def test_a_catch_up_snapshot_that_cannot_be_read_becomes_a_solo_step(tmp_path: Path) -> None:
    tr = Trainer(TINY, tmp_path, "peer-b")
    sent = run_worker_loop(tr, Result(outer_step=0, group_size=1, adopt=str(tmp_path / "missing.pt"),
                                      adopt_outer_step=25))
    adopted = [m for m in sent if isinstance(m, Adopted)]
    assert len(adopted) == 1 and adopted[0].error
    assert adopted[0].outer_step == 1  # the pending outer step was taken solo
    assert [m.outer_step for m in sent if isinstance(m, Publish)] == [0, 1, 2]


# --- two real daemons ---------------------------------------------------------------------------------------

# H = 200 makes an outer step take about a second: longer than a heartbeat, as with real models (minutes),
# so the swarm records say where a partner is. With H = 10 a lone node would race through dozens of outer
# steps per heartbeat, and no record could keep up with it.

DAEMON = [
    *TINY_DAEMON, "--set", "train.inner_steps=200", "--set", "sync.max_step_gap=6", "--set", "sync.catch_up_after=2",
]


@pytest.mark.slow
def test_a_node_started_far_behind_catches_up_with_the_swarm_and_pairs_again(group: DaemonGroup) -> None:
    ahead = group.start("ahead", *DAEMON, "--swarm", "catchup")
    ahead.wait_status(lambda s: (s.get("training") or {}).get("outer_step", 0) >= 16, timeout=150, interval=1)
    # A fresh model (no late join: it does not wait for donors), 16+ outer steps behind, gap 6.
    behind = group.start("behind", *DAEMON, "--swarm", "catchup", "--bootstrap", ahead.addr(),
                         "--set", "sync.join_wait_s=0")
    head_start = ahead.status()["training"]["outer_step"]
    st = behind.wait_status(lambda s: (s.get("sync") or {}).get("catch_ups", 0) >= 1, timeout=150, interval=1)
    assert st["training"]["outer_step"] >= head_start  # it landed among the others
    assert "caught up with the swarm" in behind.log()
    st = behind.wait_status(lambda s: s["sync"]["rounds"] >= 1, timeout=90, interval=1)
    assert abs(st["training"]["outer_step"] - ahead.status()["training"]["outer_step"]) <= 6 + 4
    assert ahead.status()["sync"]["catch_ups"] == 0  # the reference did not move to the node behind

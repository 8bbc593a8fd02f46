"""The torch worker: config, wire protocol, shared memory, the inner/outer loop, and the supervisor."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trio

from node.bridge.exchange import ExchangeOutcome, ExchangeRequest, solo_exchange
from node.bridge.ipc import (
    MAX_FRAME,
    FrameBuffer,
    Metrics,
    Publish,
    Result,
    Stop,
    encode_message,
    outcome_of,
)
from node.bridge.shm import ExchangeSlots, SharedTensor
from node.bridge.supervisor import Lifetimes, WorkerSupervisor
from node.config.train import TrainConfig
from node.worker.checkpoint import CheckpointError, write_checkpoint
from node.worker.loop import StopFlag, train_loop
from node.worker.trainer import Trainer, lr_at
from p2p.framing import ProtocolError

TINY = TrainConfig(d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=4, data_bytes=100_000,
                   eval_batches=1, warmup=2, lr=3e-3, inner_steps=5, max_lag=2, checkpoint_every=1,
                   checkpoint_min_s=0)


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


# --- config -----------------------------------------------------------------------------------------------


def test_the_default_train_config_is_valid() -> None:
    TrainConfig().validate()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"task": "no colon"}, "train.task:"),
        ({"device": "tpu"}, "train.device:"),
        ({"outer": "adam"}, "train.outer:"),
        ({"alpha": 1.0}, "train.alpha:"),
        ({"beta": 0.0}, "train.beta:"),
        ({"inner_steps": 0}, "train.inner_steps:"),
        ({"max_lag": -1}, "train.max_lag:"),
        ({"n_heads": 3}, "train.n_heads: must divide"),
        ({"warmup": 20000}, "train.warmup:"),
        ({"lr": float("nan")}, "train.lr:"),
        ({"checkpoints_keep": 0}, "train.checkpoints_keep:"),
        ({"threads": True}, "train.threads:"),
        ({"outer_threads": -1}, "train.outer_threads:"),
    ],
)
def test_a_bad_train_option_is_named_in_the_error(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TrainConfig(), **change).validate()


def test_every_train_option_has_a_help_line_and_a_plain_type() -> None:
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata.get("help"), f.name
        assert type(getattr(TrainConfig(), f.name)) in (int, float, str, bool), f.name


def test_the_learning_rate_warms_up_then_decays_by_cosine_to_its_floor() -> None:
    cfg = dataclasses.replace(TrainConfig(), lr=1.0, warmup=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(cfg, 0) == pytest.approx(0.1) and lr_at(cfg, 9) == pytest.approx(1.0)
    assert lr_at(cfg, 60) == pytest.approx(0.55)
    assert lr_at(cfg, 110) == pytest.approx(0.1) and lr_at(cfg, 10_000) == pytest.approx(0.1)


# --- wire protocol and shared memory ----------------------------------------------------------------------


def test_messages_round_trip_through_frames_split_anywhere() -> None:
    msgs = [Publish(outer_step=3, step=150), Result(outer_step=3, group_size=2),
            Metrics(step=1, outer_step=0, loss=None, val_loss=2.5, samples_per_s=10.0, lr=1e-3)]
    wire = b"".join(encode_message(m) for m in msgs)
    frames = FrameBuffer()
    got = []
    for i in range(0, len(wire), 7):
        frames.feed(wire[i : i + 7])
        while (m := frames.next_message()) is not None:
            got.append(m)
    assert got == msgs


def test_a_result_gives_the_worker_the_exchanges_outcome_whole_after_a_trip_through_frames() -> None:
    """Every field of an `ExchangeOutcome` (the worker's outer step takes it whole, `Trainer.apply_result`)
    survives the supervisor's `Result` and its frame: one that `outcome_of` dropped or mixed up fails."""
    outcome = ExchangeOutcome(2, group_outer_step=41, partner_samples=96, shift_s=-1.5, compression="medium",
                              phi_range=(4096, 8192), exact_outer_step=39, own_exact=True)
    msg = Result(outer_step=40, group_size=outcome.group_size, group_outer_step=outcome.group_outer_step,
                 partner_samples=outcome.partner_samples, shift_s=outcome.shift_s,
                 compression=outcome.compression, phi_range=list(outcome.phi_range or ()),
                 exact_outer_step=outcome.exact_outer_step, own_exact=outcome.own_exact)
    frames = FrameBuffer()
    frames.feed(encode_message(msg))
    got = frames.next_message()
    assert isinstance(got, Result) and outcome_of(got) == outcome
    assert outcome_of(Result(outer_step=1, group_size=1)) == ExchangeOutcome(1)


def test_an_oversized_or_malformed_frame_is_a_protocol_error() -> None:
    frames = FrameBuffer()
    frames.feed((MAX_FRAME + 1).to_bytes(4, "big"))
    with pytest.raises(ProtocolError, match="exceeds"):
        frames.next_message()
    import msgpack

    for body in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"v": 1, "t": "nope"}),
                 msgpack.packb({"v": 1, "t": "result", "outer_step": 1, "group_size": 1, "x": 0})):
        frames = FrameBuffer()
        frames.feed(len(body).to_bytes(4, "big") + body)
        with pytest.raises(ProtocolError):
            frames.next_message()


def test_the_control_channel_refuses_frames_as_every_protocol_does_with_the_same_error_and_reasons() -> None:
    """One framing layer (p2p/framing.py): a bad frame from the worker is the p2p layer's ProtocolError, with
    the reason a peer's would carry, and a message's bytes are those of the shared framing."""
    import msgpack

    from p2p import wire

    cases = [((MAX_FRAME + 1).to_bytes(4, "big"), wire.Reason.TOO_LARGE),
             ((2).to_bytes(4, "big") + b"\xc1\xc1", wire.Reason.MALFORMED)]
    for body, reason in [(msgpack.packb({"v": 2, "t": "stop"}), wire.Reason.BAD_VERSION),
                         (msgpack.packb({"v": 1, "t": "nope"}), wire.Reason.BAD_KIND),
                         (msgpack.packb({"v": 1, "t": "stop", "x": 0}), wire.Reason.BAD_FIELD)]:
        cases.append((len(body).to_bytes(4, "big") + body, reason))
    for data, reason in cases:
        frames = FrameBuffer()
        frames.feed(data)
        with pytest.raises(wire.ProtocolError) as info:
            frames.next_message()
        assert info.value.reason is reason, data
    msg = Publish(outer_step=3, step=150)
    # (The streaming-fragment fields stay off the frame at their defaults: the frame is the one it was.)
    fields = {k: v for k, v in dataclasses.asdict(msg).items() if k not in ("fragment", "fragments")}
    assert encode_message(msg) == wire.encode_msg({"v": 1, "t": "publish", **fields}, max_bytes=MAX_FRAME)
    cut = Publish(outer_step=3, step=150, fragment=1, fragments=2)
    assert encode_message(cut) == wire.encode_msg({"v": 1, "t": "publish", **dataclasses.asdict(cut)},
                                                  max_bytes=MAX_FRAME)


def test_shared_slots_are_one_memory_for_creator_and_attacher() -> None:
    owner = ExchangeSlots.create(16)
    try:
        peer = ExchangeSlots.attach(owner.names(), 16)
        owner.phi.array[:] = np.arange(16.0)
        assert np.array_equal(peer.phi.array, np.arange(16.0))
        torch.from_numpy(peer.delta_out.array).fill_(2.5)  # the worker's view: a tensor over the same pages
        assert np.array_equal(owner.delta_out.array, np.full(16, 2.5))
        peer.close()  # the attacher's close must not remove the owner's segments
        again = SharedTensor.attach(owner.phi.name, 16)
        assert np.array_equal(again.array, np.arange(16.0))
        again.close()
    finally:
        owner.close()
    with pytest.raises(FileNotFoundError):
        SharedTensor.attach(owner.phi.name, 16)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_view_that_outlives_its_slots_stays_valid_and_their_close_is_quiet() -> None:
    """The worker's phi tensor is a view of its slot and may outlive the slots' close (a restart, the end
    of a test): the pages stay mapped while the view lives (no dangling pointer), the owner's names are
    gone at once, and nothing prints "Exception ignored" when the closed segments are collected."""
    owner = ExchangeSlots.create(16)
    view = torch.from_numpy(owner.phi.array)
    name = owner.phi.name
    owner.close()
    del owner
    gc.collect()
    view.fill_(1.5)
    assert float(view.sum()) == 24.0
    with pytest.raises(FileNotFoundError):
        SharedTensor.attach(name, 16)
    del view
    gc.collect()


# --- the trainer: outer step, rebase, checkpoints ---------------------------------------------------------


def flat(trainer: Trainer) -> torch.Tensor:
    out = torch.empty(trainer.numel)
    trainer.gather_theta(out)
    return out


def test_the_outer_result_keeps_the_progress_made_while_the_exchange_ran(tmp_path: Path) -> None:
    tr = Trainer(TINY, tmp_path, "peer-a")
    while not tr.publish_due():
        tr.inner_step()
    phi_slot, delta_slot = torch.empty(tr.numel), torch.empty(tr.numel)
    tr.publish(phi_slot, delta_slot)
    phi_old, theta_pub = tr.phi.clone(), flat(tr)
    assert torch.equal(phi_slot, phi_old) and torch.allclose(delta_slot, theta_pub - phi_old)
    tr.inner_step()
    tr.inner_step()
    theta_now = flat(tr)
    assert tr.lag() == 2
    tr.apply_result(ExchangeOutcome(1))
    expected_phi = phi_old + TINY.beta * (theta_pub - phi_old)  # first step: zero momentum
    assert torch.allclose(tr.phi, expected_phi, atol=1e-6)
    assert torch.allclose(flat(tr), expected_phi + (theta_now - theta_pub), atol=1e-6)
    assert tr.outer_step == 1 and tr.pending is None


def test_a_group_result_uses_the_group_sums_and_non_finite_sums_fall_back_to_solo(tmp_path: Path) -> None:
    tr = Trainer(TINY, tmp_path, "peer-a")
    while not tr.publish_due():
        tr.inner_step()
    tr.publish(torch.empty(tr.numel), torch.empty(tr.numel))
    phi_old = tr.phi.clone()
    mean_phi, mean_delta = phi_old + 0.01, torch.full((tr.numel,), 0.02)
    # The daemon leaves the pair's sums: ours plus a partner whose phi is 0.02 higher.
    assert tr.apply_result(ExchangeOutcome(2), phi_old + (phi_old + 0.02), torch.full((tr.numel,), 0.04)) == 2
    expected = phi_old + TINY.beta * mean_delta - TINY.gamma * (phi_old - mean_phi)
    assert torch.allclose(tr.phi, expected, atol=1e-6)
    assert torch.allclose(flat(tr), tr.phi)  # no steps while in flight: theta restarts at phi

    while not tr.publish_due():
        tr.inner_step()
    tr.publish(torch.empty(tr.numel), torch.empty(tr.numel))
    poisoned = torch.full((tr.numel,), float("nan"))
    assert tr.apply_result(ExchangeOutcome(2), poisoned, poisoned) == 1
    assert bool(torch.isfinite(tr.phi).all())


def test_a_group_step_continues_from_the_groups_largest_outer_step_and_keeps_the_inner_step(tmp_path: Path) -> None:
    tr = Trainer(TINY, tmp_path, "peer-a")

    def one_outer_step(group_size: int, group_outer_step: int | None) -> None:
        while not tr.publish_due():
            tr.inner_step()
        tr.publish(torch.empty(tr.numel), torch.empty(tr.numel))
        tr.apply_result(ExchangeOutcome(group_size, group_outer_step=group_outer_step), tr.phi * group_size,
                        torch.zeros(tr.numel))

    one_outer_step(2, 6)  # published at 0, the partner was at 6: both continue from 7
    assert (tr.outer_step, tr.step) == (7, TINY.inner_steps)
    one_outer_step(2, 7)  # the group's largest is our own
    assert tr.outer_step == 8
    one_outer_step(1, None)  # a solo step that heard of no larger outer step keeps its own count
    assert (tr.outer_step, tr.step) == (9, 3 * TINY.inner_steps)
    one_outer_step(1, 11)  # one that did (ready trainers further on) follows them, as a pair does
    assert tr.outer_step == 12


def run_scripted(trainer: Trainer, outer_steps: int, answer_at_lag: int | None = None) -> list[int]:
    """Drive the real worker loop with a stand-in daemon that answers a publish only once the worker
    blocks for it (or, with `answer_at_lag`, once it has trained that many inner steps past the publish, and
    then fails if the worker ever blocks); returns the lag (inner steps since the publish) at each answer."""
    lags: list[int] = []

    class Daemon:
        pending: Publish | None = None

        def send(self, msg) -> None:
            if isinstance(msg, Publish):
                assert self.pending is None, "a second publish while one is in flight"
                self.pending = msg

        def receive(self, timeout: float):
            if answer_at_lag is not None:
                assert timeout == 0, "the worker blocked for its result"
            if trainer.outer_step >= outer_steps:
                return Stop()
            due = timeout > 0 if answer_at_lag is None else trainer.lag() >= answer_at_lag
            if self.pending is not None and due:  # the worker waits for its result, or it is its time
                lags.append(trainer.lag())
                msg, self.pending = self.pending, None
                return Result(outer_step=msg.outer_step, group_size=1)
            return None

    slots = ExchangeSlots.create(trainer.numel)
    try:
        train_loop(Daemon(), trainer, slots, StopFlag())  # type: ignore[arg-type]
    finally:
        slots.close()
    return lags


def test_overlap_mode_trains_on_until_the_lag_bound_then_waits(tmp_path: Path) -> None:
    tr = Trainer(dataclasses.replace(TINY, overlap=True, max_lag=3), tmp_path, "peer-a")
    assert run_scripted(tr, 3) == [3, 3, 3]
    # Publishes stay H apart (at steps 5, 10, 15): the steps taken while waiting count towards the next.
    assert tr.outer_step == 3 and tr.step == 3 * TINY.inner_steps + 3


def test_blocking_mode_waits_for_the_result_right_after_publishing(tmp_path: Path) -> None:
    tr = Trainer(dataclasses.replace(TINY, overlap=False), tmp_path, "peer-a")
    assert run_scripted(tr, 3) == [0, 0, 0]
    assert tr.step == 3 * TINY.inner_steps


def test_the_loop_checkpoints_every_k_outer_steps_and_on_stop(tmp_path: Path) -> None:
    cfg = dataclasses.replace(TINY, checkpoint_every=2, checkpoints_keep=10, overlap=False)
    tr = Trainer(cfg, tmp_path, "peer-a")
    run_scripted(tr, 3)
    steps = sorted(s for s, _ in tr.checkpoints.checkpoints())
    assert steps == [2 * TINY.inner_steps, 3 * TINY.inner_steps]  # at outer step 2, then on stop


def test_checkpoints_are_paced_by_time_as_well_as_by_outer_steps(tmp_path: Path) -> None:
    """Issue #27: a tiny model at the swarm's pace made several outer steps a second and `checkpoint_every`
    alone wrote about one checkpoint a second. `train.checkpoint_min_s` is a floor between two (fake clock)."""
    tr = Trainer(dataclasses.replace(TINY, checkpoint_every=2, checkpoint_min_s=30.0), tmp_path, "peer-a")
    tr.outer_step = 1
    assert not tr.checkpoint_due(now=0.0)  # the step rule: every 2nd outer step
    tr.outer_step = 2
    assert tr.checkpoint_due(now=0.0)  # the first of a process follows the step rule alone
    tr.save_checkpoint(now=100.0)
    tr.outer_step = 4
    assert not tr.checkpoint_due(now=110.0)  # 2 outer steps on, but 10 s: too soon
    tr.outer_step = 5
    assert tr.checkpoint_due(now=131.0)  # the first outer step past the floor, not the next multiple of 2
    tr.save_checkpoint(now=131.0)
    tr.outer_step = 6
    assert not tr.checkpoint_due(now=500.0)  # a long time, but one outer step since
    assert Trainer(dataclasses.replace(TINY, checkpoint_min_s=0.0), tmp_path / "b", "peer-b").cfg.checkpoint_min_s == 0


def test_the_loop_writes_no_checkpoint_sooner_than_checkpoint_min_s(tmp_path: Path) -> None:
    cfg = dataclasses.replace(TINY, checkpoint_every=1, checkpoint_min_s=3600.0, checkpoints_keep=10, overlap=False)
    tr = Trainer(cfg, tmp_path, "peer-a")
    run_scripted(tr, 4)
    steps = sorted(s for s, _ in tr.checkpoints.checkpoints())
    assert steps == [TINY.inner_steps, 4 * TINY.inner_steps]  # the first outer step's, then the one on stop


def test_a_resumed_trainer_continues_exactly_where_the_checkpoint_was(tmp_path: Path) -> None:
    a = Trainer(TINY, tmp_path, "peer-a")
    while not a.publish_due():
        a.inner_step()
    a.publish(torch.empty(a.numel), torch.empty(a.numel))
    a.apply_result(ExchangeOutcome(1))
    a.inner_step()
    a.save_checkpoint()
    b = Trainer(TINY, tmp_path, "peer-a")
    path, rejected = b.resume()
    assert path is not None and rejected == []
    assert (b.step, b.outer_step, b.last_publish_step) == (a.step, a.outer_step, a.last_publish_step)
    assert torch.equal(b.phi, a.phi) and torch.equal(b.outer.momentum, a.outer.momentum)
    assert torch.equal(flat(b), flat(a))
    # Same data position, optimizer state and RNG: the next steps are bit-identical.
    assert [a.inner_step() for _ in range(6)] == [b.inner_step() for _ in range(6)]


def test_a_late_joiner_starts_from_the_swarm_snapshot_and_reports_its_loss_before_training(tmp_path: Path) -> None:
    donor = Trainer(TINY, tmp_path / "donor", "peer-a")
    for _ in range(3):
        while not donor.publish_due():
            donor.inner_step()
        donor.publish(torch.empty(donor.numel), torch.empty(donor.numel))
        donor.apply_result(ExchangeOutcome(1))
    snapshot = {"phi": donor.phi.clone(), "step": donor.step, "outer_step": donor.outer_step,
                "layout_hash": donor.layout_hash, "donors": ["peer-a"]}
    (tmp_path / "joiner" / "join").mkdir(parents=True)
    write_checkpoint(tmp_path / "joiner" / "join" / "snapshot.pt", snapshot)
    donor.scatter_theta(donor.phi)
    swarm_loss = donor.evaluate()

    joiner = Trainer(TINY, tmp_path / "joiner", "peer-b")
    fresh_loss = joiner.evaluate()
    path, rejected = joiner.resume()
    assert (path, rejected) == (tmp_path / "joiner" / "join" / "snapshot.pt", [])
    assert (joiner.step, joiner.outer_step) == (donor.step, donor.outer_step)
    assert torch.equal(joiner.phi, donor.phi) and torch.equal(flat(joiner), donor.phi)
    # The loss it reports first is that of the swarm's weights, measured before any inner step of its own.
    assert joiner.val_loss == pytest.approx(swarm_loss) and joiner.val_loss < fresh_loss
    assert not (tmp_path / "joiner" / "join" / "snapshot.pt").exists()  # consumed: restarts use own checkpoints


def test_a_checkpoint_taken_mid_exchange_resumes_as_if_the_publish_never_happened(tmp_path: Path) -> None:
    a = Trainer(TINY, tmp_path, "peer-a")
    while not a.publish_due():
        a.inner_step()
    a.publish(torch.empty(a.numel), torch.empty(a.numel))
    a.inner_step()
    a.save_checkpoint()
    b = Trainer(TINY, tmp_path, "peer-a")
    b.resume()
    assert b.outer_step == 0 and b.pending is None and b.step == TINY.inner_steps + 1
    assert b.publish_due()  # it publishes again at once, with all of its progress in Delta
    assert torch.equal(flat(b), flat(a)) and torch.equal(b.phi, a.phi)


def test_a_corrupt_latest_checkpoint_is_reported_and_the_previous_one_resumed(tmp_path: Path) -> None:
    a = Trainer(TINY, tmp_path, "peer-a")
    a.inner_step()
    first = a.step
    a.save_checkpoint()
    a.inner_step()
    newest = a.save_checkpoint()
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    newest.write_bytes(bytes(raw))
    b = Trainer(TINY, tmp_path, "peer-a")
    path, rejected = b.resume()
    assert b.step == first and len(rejected) == 1 and str(newest) in rejected[0]


def test_a_checkpoint_that_fails_to_load_is_set_aside_so_the_restart_uses_the_previous_one(
    tmp_path: Path,
) -> None:
    a = Trainer(TINY, tmp_path, "peer-a")
    a.inner_step()
    first = a.step
    a.save_checkpoint()
    a.inner_step()
    bad = a.state_dict()
    bad["optimizer"]["param_groups"][0]["params"] = [0]  # verifies, but Adam refuses it
    a.checkpoints.save(bad, a.step)
    with pytest.raises(CheckpointError, match="does not load"):
        Trainer(TINY, tmp_path, "peer-a").resume()
    again = Trainer(TINY, tmp_path, "peer-a")
    again.resume()
    assert again.step == first


def test_a_checkpoint_of_another_architecture_is_not_loaded(tmp_path: Path) -> None:
    a = Trainer(TINY, tmp_path, "peer-a")
    a.inner_step()
    a.save_checkpoint()
    b = Trainer(dataclasses.replace(TINY, d_model=64), tmp_path, "peer-a")
    assert b.resume() == (None, []) and b.step == 0  # a separate directory per model hash


# --- the supervisor with a real worker process ------------------------------------------------------------


async def wait_until(predicate, timeout: float = 90.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def newest_checkpoint_step(home: Path) -> int:
    steps = [int(p.name[5:17]) for p in (home / "checkpoints").rglob("ckpt-*.pt")]
    return max(steps, default=0)


def supervisor(home: Path, exchange=solo_exchange, **cfg_changes) -> WorkerSupervisor:
    cfg = dataclasses.replace(TINY, **cfg_changes)
    return WorkerSupervisor(cfg, home, "peer-a", exchange, lifetimes=Lifetimes(backoff_initial=0.1, stop_grace=8.0))


@pytest.mark.slow
async def test_a_sigkilled_worker_is_restarted_and_resumes_from_its_last_checkpoint(tmp_path: Path) -> None:
    sup = supervisor(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await wait_until(lambda: sup.status()["outer_step"] >= 3 and sup.status()["checkpoint_step"])
        first_pid = sup.status()["pid"]
        os.kill(first_pid, signal.SIGKILL)
        await wait_until(lambda: not alive(first_pid))
        on_disk = newest_checkpoint_step(tmp_path)
        await wait_until(lambda: sup.status()["restarts"] == 1 and sup.status()["state"] == "training")
        status = sup.status()
        assert status["pid"] != first_pid
        assert on_disk > 0 and status["resumed_step"] == on_disk
        await wait_until(lambda: sup.status()["step"] > on_disk)  # and it trains on
        second_pid = status["pid"]
        nursery.cancel_scope.cancel()
    assert not alive(second_pid)
    assert sup.status()["state"] == "stopped"


@pytest.mark.slow
async def test_a_stopped_daemon_resumes_with_its_step_counters_intact(tmp_path: Path) -> None:
    sup = supervisor(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await wait_until(lambda: sup.status()["outer_step"] >= 2)
        nursery.cancel_scope.cancel()
    stopped = sup.status()
    assert stopped["checkpoint_step"] == stopped["step"] == newest_checkpoint_step(tmp_path)

    again = supervisor(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(again.run)
        await wait_until(lambda: again.status()["state"] == "training")
        status = again.status()
        assert status["resumed_step"] == stopped["step"]
        # The resumed worker may already have taken its next outer step by now; a reset would show 0.
        assert status["outer_step"] >= stopped["outer_step"] >= 2
        nursery.cancel_scope.cancel()


FAKE_DAEMON = textwrap.dedent(
    """
    import dataclasses, json, sys, trio
    from pathlib import Path
    from node.bridge.exchange import solo_exchange
    from node.bridge.supervisor import WorkerSupervisor
    from node.config.train import TrainConfig

    async def main():
        cfg = TrainConfig(**json.loads(sys.argv[2]))
        sup = WorkerSupervisor(cfg, Path(sys.argv[1]), "peer-a", solo_exchange)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sup.run)
            while True:
                await trio.sleep(0.1)
                print(json.dumps(sup.status()), flush=True)

    trio.run(main)
    """
)


@pytest.mark.slow
async def test_the_worker_exits_when_the_daemon_is_killed_and_the_next_daemon_resumes(tmp_path: Path) -> None:
    log_path = tmp_path / "status.jsonl"
    with open(log_path, "w") as out:
        daemon = subprocess.Popen(
            [sys.executable, "-c", FAKE_DAEMON, str(tmp_path), json.dumps(dataclasses.asdict(TINY))],
            stdout=out,
        )
    try:

        def last_status() -> dict:
            lines = log_path.read_text().splitlines()
            return json.loads(lines[-1]) if lines else {}

        await wait_until(lambda: (last_status().get("checkpoint_step") or 0) > 0)
        seen = last_status()
        worker_pid = seen["pid"]
        daemon.kill()
        daemon.wait()
        await wait_until(lambda: not alive(worker_pid))  # it noticed the end of file and left
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    on_disk = newest_checkpoint_step(tmp_path)
    assert on_disk >= seen["step"]  # its farewell checkpoint

    sup = supervisor(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await wait_until(lambda: sup.status()["state"] == "training")
        assert sup.status()["resumed_step"] == on_disk
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_failed_and_hung_exchanges_become_solo_steps_and_group_sums_reach_the_worker(
    tmp_path: Path,
) -> None:
    requests: list[ExchangeRequest] = []

    async def exchange(req: ExchangeRequest) -> ExchangeOutcome:
        requests.append(req)
        if len(requests) == 1:
            raise ConnectionError("partner vanished")
        if len(requests) == 2:
            await trio.sleep_forever()  # cut off by train.exchange_timeout
        # A partner identical to us: the sums are twice our own values (so the step equals a solo one),
        # but 10 outer steps ahead: the worker adopts its counter.
        np.multiply(req.phi, 2, out=req.phi_out)  # the daemon's views of the slots are numpy arrays
        np.multiply(req.delta, 2, out=req.delta_out)
        return ExchangeOutcome(2, group_outer_step=req.outer_step + 10)

    sup = supervisor(tmp_path, exchange, exchange_timeout=0.5)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await wait_until(lambda: len(requests) >= 4)
        nursery.cancel_scope.cancel()
    status = sup.status()
    assert status["exchanges"]["failed"] == 2
    assert status["exchanges"]["solo"] == 2 and status["exchanges"]["group"] >= 1
    assert [r.outer_step for r in requests[:4]] == [0, 1, 2, 13]  # after the group round: its step + 1
    req = requests[-1]
    total = sum(torch.Size(shape).numel() for _, shape in req.layout)
    assert req.phi.size == req.delta.size == req.phi_out.size == total
    assert sup.manifest_fields() == {
        "task": "stdlib-lm", "model_hash": sup._hello.model_hash, "layout_hash": sup._hello.layout_hash,
        "numel": total, "outer": "noloco",
    }


@pytest.mark.slow
async def test_a_donor_serves_the_weights_its_worker_publishes_and_holds_the_result_not_training(
    tmp_path: Path,
) -> None:
    """Issue #55: the daemon serves the worker's current phi from the shared slot (no checkpoint needed), exactly
    what the worker publishes at that outer step; a result that would change it waits for the download while
    the worker keeps training, and goes out when the download ends."""
    published: dict[int, np.ndarray] = {}

    async def exchange(req: ExchangeRequest) -> ExchangeOutcome:
        published[req.outer_step] = req.phi.copy()
        return await solo_exchange(req)

    sup = supervisor(tmp_path, exchange, max_lag=0, checkpoint_every=100_000)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await wait_until(lambda: sup.status()["outer_step"] >= 2)
        assert newest_checkpoint_step(tmp_path) == 0  # nothing on disk to serve
        with trio.fail_after(30):
            snap = await sup.live.snapshot()
        assert snap is not None and snap.lease is not None
        served = np.array(snap.phi)
        step, outer = sup.status()["step"], snap.outer_step
        await wait_until(lambda: outer in published and sup.status()["step"] >= step + 10)
        assert sup.status()["outer_step"] == outer  # its result is held while the download runs ...
        assert snap.lease.valid()
        snap.lease.release()
        await wait_until(lambda: sup.status()["outer_step"] > outer)  # ... and goes out when it ends
        nursery.cancel_scope.cancel()
    assert np.array_equal(served, published[outer])
    assert sup.live.cut == 0 and sup.live.held_s > 0


@pytest.mark.slow
async def test_a_task_that_cannot_load_fails_once_with_its_reason_and_is_not_restarted(tmp_path: Path) -> None:
    sup = supervisor(tmp_path, task="no_such_module_xyz:make_task")
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await wait_until(lambda: sup.status()["state"] == "failed")
        await trio.sleep(0.5)
        status = sup.status()
        assert "cannot import 'no_such_module_xyz'" in status["error"]
        assert status["restarts"] == 0 and status["pid"] is None
        nursery.cancel_scope.cancel()



# --- pacing by the swarm (machines of different speeds) ----------------------------------------------------


def test_without_a_pace_an_outer_step_is_published_every_h_inner_steps(tmp_path: Path) -> None:
    tr = Trainer(TINY, tmp_path, "peer-a")
    for _ in range(TINY.inner_steps - 1):
        tr.inner_step()
    assert not tr.publish_due(now=1e12)  # no pace: the clock does not matter
    tr.inner_step()
    assert tr.publish_due()


def test_with_the_swarms_pace_a_slow_machine_publishes_on_time_with_fewer_inner_steps(tmp_path: Path) -> None:
    """A machine k times slower publishes at the same moments as the fastest one, covering 1/k of its
    inner steps (and so stays within every partner's step gap), never after fewer than one step."""
    tr = Trainer(TINY, tmp_path, "slow")
    while not tr.publish_due():
        tr.inner_step()
    msg = tr.publish(torch.empty(tr.numel), torch.empty(tr.numel))
    assert (msg.inner_steps, msg.samples) == (TINY.inner_steps, TINY.inner_steps * TINY.batch_size)
    tr.apply_result(ExchangeOutcome(1))
    tr.set_pace(period_s=10.0)
    assert tr.next_publish_at is not None
    start = tr.next_publish_at - 10.0
    tr.step_time_s = 4.0  # this machine's step: the fastest takes 2 s (H = 5 in 10 s)
    assert not tr.publish_due(now=start + 9.0)  # no step taken yet
    tr.inner_step()
    tr.step_time_s = 4.0
    assert not tr.publish_due(now=start + 4.0)  # another step would end at 8 s: nearer the 10 s deadline
    assert tr.publish_due(now=start + 8.5)  # one more would end at 12.5 s: publish now, on time
    tr.inner_step()
    msg = tr.publish(torch.empty(tr.numel), torch.empty(tr.numel))
    assert msg.inner_steps == 2 < TINY.inner_steps


def test_the_pace_never_packs_more_than_2h_inner_steps_into_one_outer_step(tmp_path: Path) -> None:
    tr = Trainer(TINY, tmp_path, "fast")
    tr.set_pace(period_s=3600.0)  # a stale pace: the fast machine that set it has left
    for _ in range(2 * TINY.inner_steps - 1):
        tr.inner_step()
    assert not tr.publish_due()
    tr.inner_step()
    assert tr.publish_due()


def test_partners_move_their_next_publish_towards_each_other_by_at_most_half_a_period(tmp_path: Path) -> None:
    tr = Trainer(TINY, tmp_path, "a")
    tr.set_pace(period_s=10.0)
    due = tr.next_publish_at
    assert due is not None
    tr.set_pace(period_s=10.0, shift_s=1.5)
    assert tr.next_publish_at == pytest.approx(due + 1.5)
    tr.set_pace(period_s=10.0, shift_s=-100.0)
    assert tr.next_publish_at == pytest.approx(due + 1.5 - 5.0)
    tr.set_pace(period_s=0.0)  # the daemon dropped the pace (sync.pace = steps): back to H inner steps
    assert tr.next_publish_at is None


def test_a_weighted_pair_result_reaches_the_outer_step(tmp_path: Path) -> None:
    tr = Trainer(TINY, tmp_path, "slow")
    while not tr.publish_due():
        tr.inner_step()
    tr.publish(torch.empty(tr.numel), torch.empty(tr.numel))
    own_delta = tr.theta_published - tr.phi
    phi_old = tr.phi.clone()
    their_delta = torch.full((tr.numel,), 0.05)
    partner_samples = 3 * tr.published_samples
    tr.apply_result(ExchangeOutcome(2, partner_samples=partner_samples), 2 * phi_old, own_delta + their_delta)
    expected = phi_old + TINY.beta * (0.25 * own_delta + 0.75 * their_delta)
    assert torch.allclose(tr.phi, expected, atol=1e-5)


def test_phi_in_the_slot_and_a_lent_scratch_give_the_same_bits_without_a_private_scratch(tmp_path: Path) -> None:
    """The worker's memory cuts (bench/memory.py): phi kept in the shared phi slot, our own Delta computed in
    the lent Delta slot and the rebase done in theta_published take the same steps, bit for bit, as the
    in-process trainer with its own copies; and no model-sized scratch is ever allocated."""
    plain, lean = Trainer(TINY, tmp_path / "plain", "p"), Trainer(TINY, tmp_path / "lean", "p")
    assert torch.equal(plain.phi, lean.phi)
    slot_phi, slot_delta = torch.empty(lean.numel), torch.empty(lean.numel)
    lean.share_phi(slot_phi)
    assert lean.phi.data_ptr() == slot_phi.data_ptr()
    partner_phi = plain.phi + 0.01
    for _ in range(2):
        for tr in (plain, lean):
            while not tr.publish_due():
                tr.inner_step()
            assert all(p.grad is None for p in tr.params)  # freed right after the optimizer step
        plain.publish(torch.empty(plain.numel), torch.empty(plain.numel))
        lean.publish(slot_phi, slot_delta)
        assert torch.equal(slot_phi, plain.phi) and torch.equal(slot_delta, plain.theta_published - plain.phi)
        for tr in (plain, lean):
            tr.inner_step()  # progress made while the exchange runs, which the rebase keeps
        theta_now = torch.cat([p.detach().reshape(-1).cpu() for p in plain.params])  # the device's, on the host
        theta_pub = plain.theta_published.clone()
        sum_phi, sum_delta = plain.phi + partner_phi, slot_delta + 0.02
        plain.apply_result(ExchangeOutcome(2, partner_samples=plain.published_samples), sum_phi.clone(),
                           sum_delta.clone())
        lean.apply_result(ExchangeOutcome(2, partner_samples=lean.published_samples), sum_phi.clone(),
                          sum_delta.clone(), scratch=slot_delta)
        assert torch.equal(plain.phi, lean.phi) and lean.phi.data_ptr() == slot_phi.data_ptr()
        for a, b in zip(plain.params, lean.params, strict=True):
            assert torch.equal(a, b)
        # The flat form of the rebase, theta <- theta_now + (phi - theta_published), to the bit.
        assert torch.equal(torch.cat([p.detach().reshape(-1).cpu() for p in lean.params]),
                           theta_now + (plain.phi - theta_pub))
    assert lean._scratch_buf is None


def test_the_outer_steps_host_threads_are_the_inner_steps_on_the_cpu_and_idle_cores_on_a_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU host the inner steps leave the cores idle, and the outer step's passes over the fp32 masters
    on one thread took longer than the H inner steps they follow (docs/benchmarks.md "On a GPU")."""
    from node.worker.trainer import outer_threads

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    assert outer_threads(TrainConfig(threads=2), cpu) == 2  # the CPU: as the inner steps, leaving the daemon its cores
    assert outer_threads(TrainConfig(), cuda) == 8  # half of 16 cores, at most 8
    assert outer_threads(TrainConfig(outer_threads=3), cuda) == 3 and outer_threads(TrainConfig(outer_threads=5), cpu) == 5
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2})
    assert outer_threads(TrainConfig(), cuda) == 1
    assert outer_threads(TrainConfig(threads=4), cuda) == 4  # never fewer than the inner steps have


def test_publish_and_the_outer_step_run_on_the_host_threads_and_training_keeps_its_own(tmp_path: Path) -> None:
    tr = Trainer(dataclasses.replace(TINY, outer_threads=3), tmp_path, "p")
    seen: list[int] = []
    step = tr.outer.step

    def counting_step(*args: Any, **kwargs: Any) -> None:
        seen.append(torch.get_num_threads())
        step(*args, **kwargs)

    tr.outer.step = counting_step  # type: ignore[method-assign]
    torch.set_num_threads(1)
    try:
        while not tr.publish_due():
            tr.inner_step()
        tr.publish(torch.empty(tr.numel), torch.empty(tr.numel))
        assert torch.get_num_threads() == 1
        tr.apply_result(ExchangeOutcome(1))
        assert seen == [3] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_non_finite_entry_anywhere_makes_a_group_result_non_finite(bad: float) -> None:
    from node.worker.trainer import all_finite

    x = torch.randn(100_003)
    assert all_finite(x) and all_finite(x[:0])
    for where in (0, 50_000, 100_002):
        y = x.clone()
        y[where] = bad
        assert not all_finite(y), where
    y = x.clone()
    y[1], y[2] = float("inf"), float("-inf")  # they would cancel in a careless check; the sum is NaN
    assert not all_finite(y)
    # Finite values so large that they overflow fp32 when summed are refused as well (no usable result).
    assert not all_finite(torch.full((10,), 3e38))


def test_the_reported_speed_follows_the_last_outer_steps_not_a_slow_first_one(tmp_path: Path, monkeypatch) -> None:
    """`samples_per_s` (the speed the swarm's pace is built from) is the median of the last outer steps: a
    first outer step 10x slower (one-off allocations and warm-up; on an H200 an average kept from it read
    65 samples/s where the step counter made 536) is forgotten after three normal ones."""
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    tr = Trainer(TINY, tmp_path, "gpu")
    h = TINY.inner_steps

    def outer_step(seconds_per_step: float) -> None:
        for _ in range(h):
            tr.inner_step()
        clock[0] += seconds_per_step * h
        tr.publish(torch.empty(tr.numel), torch.empty(tr.numel))
        tr.apply_result(ExchangeOutcome(1))

    outer_step(1.0)  # the first publish only starts the clock
    outer_step(1.0)  # the slow first timed outer step
    for _ in range(3):
        outer_step(0.1)
    assert tr.samples_per_s() == pytest.approx(TINY.batch_size / 0.1)

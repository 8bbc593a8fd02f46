"""Whole daemons training together: averaging partners, swarm-state membership, failures and restarts.

Every node is a real `starling run` process (plus its torch worker) on 127.0.0.1, with a tiny model so
that five of them fit on two cores.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from node.config.home import Home
from node.ops.control import request_sync
from starling_testing.daemon import TINY, DaemonGroup, DaemonProc

pytestmark = pytest.mark.slow



def start_swarm(group: DaemonGroup, n: int, swarm: str) -> list:
    boot = group.start("n0", *TINY, "--swarm", swarm)
    addr = boot.addr()
    return [boot] + [group.start(f"n{i}", *TINY, "--swarm", swarm, "--bootstrap", addr) for i in range(1, n)]


def test_five_trainers_average_with_several_distinct_partners_while_loss_falls(group: DaemonGroup) -> None:
    nodes = start_swarm(group, 5, "avg5")
    first_loss = {}
    for d in nodes:
        st = d.wait_status(lambda s: (s.get("training") or {}).get("loss") is not None, timeout=90)
        first_loss[d.home.name] = st["training"]["loss"]
    for d in nodes:
        st = d.wait_status(lambda s: s["sync"]["distinct_partners"] >= 3, timeout=150, interval=1)
        assert st["sync"]["rounds"] >= 3
    # Against the untrained model's loss (the highest first loss): a node that joined late starts from the
    # swarm's trained weights, so its own first loss may already be low.
    untrained = max(first_loss.values())
    for d in nodes:
        st = d.wait_status(lambda s: s["training"]["loss"] < untrained - 0.3, timeout=60)
        assert st["training"]["outer_step"] >= 3


def test_members_converge_a_killed_node_turns_suspect_then_gone_and_returns_alive(group: DaemonGroup) -> None:
    nodes = start_swarm(group, 4, "members4")
    ids = {d.wait_status()["peer_id"] for d in nodes}

    def alive_ids(s: dict) -> set:
        return {m["peer_id"] for m in s.get("members", []) if m["state"] == "alive"}

    for d in nodes:
        d.wait_status(lambda s: alive_ids(s) == ids, timeout=60)
    victim = nodes[3]
    victim_id = victim.status()["peer_id"]
    victim.signal(signal.SIGKILL)
    victim.proc.wait(10)

    def state_of(s: dict, pid: str) -> str | None:
        return next((m["state"] for m in s.get("members", []) if m["peer_id"] == pid), None)

    for d in nodes[:3]:
        d.wait_status(lambda s: state_of(s, victim_id) == "suspect", timeout=20, interval=0.3)
    for d in nodes[:3]:
        st = d.wait_status(lambda s: state_of(s, victim_id) == "gone", timeout=20)
        member = next(m for m in st["members"] if m["peer_id"] == victim_id)
        assert member["outer_step"] >= 0  # its history is kept
    restarted = group.start("n3", *TINY, "--swarm", "members4", "--bootstrap", nodes[0].addr())
    assert restarted.wait_status()["peer_id"] == victim_id
    for d in nodes[:3]:
        d.wait_status(lambda s: state_of(s, victim_id) == "alive", timeout=40)


def test_a_graceful_stop_is_seen_as_left(group: DaemonGroup) -> None:
    """A running node's SIGTERM: its peer sees it `left`, not gone. Running means both have met: a node
    stopped in the second after it connected, before its own first state session completed, may still be
    seen only as gone (its departure can be lost with that session)."""
    nodes = start_swarm(group, 2, "leave2")
    a_id, b_id = nodes[0].wait_status()["peer_id"], nodes[1].wait_status()["peer_id"]

    def alive(peer: str) -> Callable[[dict], bool]:
        return lambda s: any(m["peer_id"] == peer and m["state"] == "alive" for m in s.get("members", []))

    nodes[0].wait_status(alive(b_id), timeout=60)
    nodes[1].wait_status(alive(a_id), timeout=60)
    assert nodes[1].stop() == 0
    nodes[0].wait_status(lambda s: any(m["peer_id"] == b_id and m["state"] == "left" for m in s["members"]),
                         timeout=10)


def test_a_partner_killed_mid_run_leaves_the_other_training_with_solo_steps(group: DaemonGroup) -> None:
    nodes = start_swarm(group, 2, "kill2")
    a, b = nodes
    a.wait_status(lambda s: s["sync"]["rounds"] >= 2, timeout=120)
    b.signal(signal.SIGKILL)
    b.proc.wait(10)
    before = a.status()
    after = a.wait_status(lambda s: s["sync"]["solo_rounds"] >= before["sync"]["solo_rounds"] + 2, timeout=60)
    assert after["training"]["outer_step"] > before["training"]["outer_step"]
    assert after["training"]["state"] == "training"
    time.sleep(1)
    assert a.proc.poll() is None


def test_a_late_joiner_starts_from_the_swarms_weights_not_a_fresh_model(group: DaemonGroup) -> None:
    steady = ["--set", "train.eval_batches=8"]  # validation loss over 8 batches: a steadier yardstick
    boot = group.start("n0", *TINY, *steady, "--swarm", "late")
    nodes = [boot, group.start("n1", *TINY, *steady, "--swarm", "late", "--bootstrap", boot.addr())]
    # Trained, and together: a founder starts at once and runs ahead alone while the second node's worker
    # loads; until that node has caught up, the joiner's donors would be the founder alone.
    for d in nodes:
        # A status read while the daemon starts has no training or sync section yet.
        d.wait_status(lambda s: (s.get("training") or {}).get("outer_step", 0) >= 8
                      and (s.get("training") or {}).get("checkpoint_step")
                      and (s.get("sync") or {}).get("rounds", 0) >= 1, timeout=200)
    joiner = group.start("late", *TINY, *steady, "--swarm", "late", "--bootstrap", boot.addr(),
                         "--set", "sync.join_wait_s=30")
    st = joiner.wait_status(lambda s: s.get("join", {}).get("state") == "done", timeout=90)
    assert len(st["join"]["donors"]) == 2
    first = joiner.wait_status(lambda s: s["training"]["val_loss"] is not None, timeout=90, interval=0.2)["training"]
    assert first["outer_step"] >= 8  # step counters came with the weights
    # The yardstick: the donors' own validation loss when they were at the step the joiner starts from
    # (they trained on while it downloaded, so their loss now is lower than the snapshot's).
    donor_val = swarm_val_loss_at(boot, [d.wait_status()["peer_id"] for d in nodes], first["outer_step"])
    fresh_loss = 5.5  # ln(256): a byte-level model that knows nothing
    assert donor_val < 0.8 * fresh_loss  # the swarm has really trained
    # Close to the swarm's loss at that step (the mean of two donors is often a little better than either).
    assert first["val_loss"] <= 1.10 * donor_val, (first, donor_val)
    assert first["val_loss"] < 0.6 * fresh_loss, first
    # The donors served their checkpoints' phi and the joiner wrote the swarm's mean for its worker, and
    # not one of the three daemon processes loaded torch: only their workers do.
    for d in [*nodes, joiner]:
        assert "libtorch" not in Path(f"/proc/{d.proc.pid}/maps").read_text(), f"{d.home.name}'s daemon loaded torch"


@pytest.mark.parametrize("checkpoints", [
    pytest.param(["--set", "train.checkpoint_every=100000"], id="checkpoints-off"),
    pytest.param(["--set", "train.checkpoint_every=5", "--set", "train.checkpoint_min_s=30"], id="default-pace"),
])  # fmt: skip
def test_a_joiner_starts_from_the_founders_live_weights_and_averages_within_5_of_its_outer_steps(
    group: DaemonGroup, checkpoints: list[str]
) -> None:
    """Issue #55's scenario: a founder runs ahead alone (H = 2) with no checkpoint to serve, or one a period old;
    a second trainer started seconds later joins from the founder's current weights, lands within the
    shipped sync.max_step_gap (4) of it, and averages within 5 of its own outer steps after its first.
    Before, with checkpoints off it got "no checkpoint yet" from every catch-up and averaged 0 times."""
    opts = [*TINY, "--set", "train.inner_steps=2", "--set", "sync.max_step_gap=4", *checkpoints, "--swarm", "live"]
    founder = group.start("founder", *opts)
    founder.wait_status(lambda s: s["training"]["outer_step"] >= 3, timeout=120)
    joiner = group.start("joiner", *opts, "--bootstrap", founder.addr())
    seen = joiner.wait_status(lambda s: s.get("join", {}).get("state") not in (None, "not started", "looking for donors",
                                                                               "downloading"), timeout=120)
    assert seen["join"]["state"] == "done", seen["join"]
    st = joiner.wait_status(lambda s: s["training"]["exchanges"]["group"] >= 1, timeout=120, interval=0.2)
    own = st["training"]["exchanges"]
    assert own["solo"] + own["failed"] <= 5, own  # outer steps taken before the first averaged one
    served = founder.wait_status()["join"]
    assert served["served_live"] >= 1 and served["live_cut"] == 0, served


def swarm_val_loss_at(node: DaemonProc, peer_ids: list[str], outer_step: int) -> float:
    """Mean over ``peer_ids`` of the last validation loss ``node``'s loss history holds for each of them at or
    before ``outer_step``."""
    history = request_sync(Home(node.home).control_socket, {"cmd": "history"})["history"]
    values = []
    for pid in peer_ids:
        series = history[pid]
        points = [(o, v) for o, v in zip(series["outer_step"], series["val_loss"], strict=True)
                  if v is not None and o <= outer_step]
        assert points, f"no validation loss of {pid} at or before outer step {outer_step}: {series}"
        values.append(max(points)[1])
    return sum(values) / len(values)


def test_sigterm_during_an_exchange_aborts_it_checkpoints_and_exits_0(group: DaemonGroup, tmp_path: Path) -> None:
    # A partner whose worker is stopped (SIGSTOP) stays an eligible member but never publishes: with a long
    # pairing window every outer step sits in an exchange waiting for it. (A node with nobody who could
    # come steps solo at once, without an exchange.) It is stopped once it trains: only then does its
    # record carry the run manifest that makes it eligible.
    partner = group.start("stalled", *TINY, "--swarm", "drain")
    worker = partner.wait_status(lambda s: (s.get("training") or {}).get("loss") is not None,
                                 timeout=90)["training"]["pid"]
    partner.wait_status(lambda s: any(m.get("self") and m.get("manifest_hash") for m in s.get("members") or []),
                        timeout=30)
    os.kill(worker, signal.SIGSTOP)
    try:
        d = group.start("solo", *TINY, "--swarm", "drain", "--bootstrap", partner.addr(),
                        "--set", "sync.pair_window_s=60")
        d.wait_status(lambda s: s.get("sync", {}).get("state") == "pairing" and s["training"]["outer_step"] >= 0,
                      timeout=90, interval=0.3)
        ckpt_dir = d.home / "checkpoints"
        before = {p.name for p in ckpt_dir.rglob("ckpt-*.pt")}
        t0 = time.monotonic()
        d.signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0  # within the unit's TimeoutStopSec
        assert time.monotonic() - t0 < 15
    finally:
        os.kill(worker, signal.SIGCONT)
    after = {p.name for p in ckpt_dir.rglob("ckpt-*.pt")}
    assert after - before, "the drain wrote a checkpoint of the progress made while waiting"
    assert "written at step" in d.log() and "stopped" in d.log()

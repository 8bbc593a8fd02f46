"""Issue #27's rows through real `starling run` daemons: a swarm key mismatch and a wrong bootstrap PeerID
(log, `status`, `doctor`), a peer training another model (`status`), a trainer whose HOME fills up (`status`,
`doctor`, the exit code). The unit-level tests of the same rows are in tests/test_diagnostics.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from node.ops.status_view import render_status
from starling_testing.daemon import TINY, DaemonGroup, DaemonProc, starling
from starling_testing.disk import tiny_tmpfs

REAL_PEER = "12D3KooWPoxc3GetHDNMfRYL4h9TgTs2Dkrxk53DHHVDEVfqWV33"  # a valid PeerID no node here has

LOOPBACK = ["--listen", "/ip4/127.0.0.1/tcp/0"]


def _status(home: Path) -> dict:
    r = starling("status", "--home", str(home), "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["running"] is True  # as the no-daemon answer has "running": false (issue #27, status details)
    return st


@pytest.mark.slow
def test_a_node_with_another_swarm_key_or_a_wrong_peer_id_is_told_why_by_log_status_and_doctor(
    group: DaemonGroup, tmp_path: Path
) -> None:
    """The dialling side of a swarm key mismatch, and a bootstrap address naming another node's PeerID."""
    key, other = tmp_path / "key", tmp_path / "other"
    for path in (key, other):
        assert starling("swarm-key", "--out", str(path)).returncode == 0
    for name, k in (("boot", key), ("x", other)):
        assert starling("init", "--home", str(tmp_path / name), "--swarm-key", str(k)).returncode == 0
    keyed_addr = group.start("boot", *LOOPBACK, "--no-train").addr()
    x = group.start("x", *LOOPBACK, "--no-train", "--bootstrap", keyed_addr)  # another key
    addr = group.start("open", *LOOPBACK, "--no-train").addr()  # an open swarm
    boot_id = addr.rsplit("/", 1)[1]
    wrong = addr.rsplit("/p2p/", 1)[0] + f"/p2p/{REAL_PEER}"
    w = group.start("w", *LOOPBACK, "--no-train", "--bootstrap", wrong)  # another node's PeerID
    keyed_id = keyed_addr.rsplit("/", 1)[1]

    def last_error(st: dict) -> str:
        peers = st.get("bootstrap", {}).get("peers") or [{}]
        return str(peers[0].get("last_error") or "")

    x.wait_status(lambda st: "swarm key" in last_error(st), timeout=90)
    w.wait_status(lambda st: "is " in last_error(st), timeout=90)
    assert f"is {boot_id}, not {REAL_PEER}" in last_error(_status(w.home))

    text = starling("status", "--home", str(x.home))
    assert text.returncode == 0
    assert f"bootstrap {keyed_id[:6]}..{keyed_id[-6:]} at " in text.stdout and "a different swarm key" in text.stdout
    assert "a different swarm key (or none) is the likely cause" in x.log()
    assert f"is {boot_id}, not {REAL_PEER}" in w.log()

    for node, says in ((x, "swarm key"), (w, f"is {boot_id}, not {REAL_PEER}")):
        r = starling("doctor", "--home", str(node.home), timeout=90)
        assert r.returncode == 1, r.stdout
        errors = [line for line in r.stdout.splitlines() if "ERROR" in line]
        assert any("bootstrap" in line and says in line for line in errors), r.stdout
        assert any("connected to no peer although it has 1 bootstrap peer" in line for line in errors), r.stdout
        assert "TCP port open" not in r.stdout

    # doctor --bootstrap with another node's real PeerID at a live address, no daemon on that home.
    r = starling("doctor", "--home", str(tmp_path / "fresh"), "--bootstrap", wrong, timeout=90)
    assert r.returncode == 1 and f"is {boot_id}, not {REAL_PEER}" in r.stdout, r.stdout


@pytest.mark.slow
def test_a_peer_training_another_task_is_shown_as_incompatible_by_status(group: DaemonGroup) -> None:
    """It was `suspect ... 31s ago`, and plain `status` never said why."""
    a = group.start("a", *TINY)
    addr = a.addr()
    b = group.start("b", *TINY, "--set", "train.d_model=48", "--bootstrap", addr)  # another model
    a_id = addr.rsplit("/", 1)[1]
    b.wait_status(lambda st: a_id in (st.get("swarm_totals") or {}).get("incompatible_peers", []), timeout=120)
    [differs] = _status(b.home)["swarm_totals"]["incompatible"]
    assert differs["peer_id"] == a_id and differs["field"] == "manifest" and differs["theirs"] != differs["ours"]
    assert differs["differs"] == ["model_hash"]  # a runs the swarm's manifest, which b holds
    text = starling("status", "--home", str(b.home)).stdout
    assert f"incompatible {a_id[:6]}..{a_id[-6:]}" in text and "they differ in model_hash" in text, text
    rows = [line for line in text.splitlines() if line.strip().startswith(f"{a_id[:6]}..{a_id[-6:]}") and " ago" in line]
    assert rows and all("incompatible" in row and "suspect" not in row for row in rows), text


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MB tmpfs, unmounted when the test ends."""
    with tiny_tmpfs(tmp_path / "disk", "2m") as mountpoint:
        yield mountpoint



@pytest.mark.slow
def test_a_trainer_on_a_full_disk_says_so_in_status_doctor_and_its_exit_code(
    group: DaemonGroup, tiny_disk: Path, tmp_path: Path
) -> None:
    home = tiny_disk / "home"
    assert starling("init", "--home", str(home)).returncode == 0
    d = DaemonProc(home, [*TINY, "--set", "train.checkpoint_every=1"]).start(log=tmp_path / "daemon.log")
    group.daemons.append(d)
    d.wait_status(lambda st: (st.get("training") or {}).get("checkpoint_step") is not None, timeout=120)
    filler = home / "filler"
    with open(filler, "wb") as f:  # the disk is full from now on
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    st = d.wait_status(lambda st: bool((st.get("training") or {}).get("checkpoint_error")), timeout=120)
    assert "No space left on device" in st["training"]["checkpoint_error"]
    text = starling("status", "--home", str(home))
    assert text.returncode == 0 and "checkpoints failing:" in text.stdout
    r = starling("doctor", "--home", str(home), timeout=90)
    assert r.returncode == 1
    assert any("disk" in line and "MB free" in line for line in r.stdout.splitlines() if "ERROR" in line), r.stdout
    assert any("checkpoints fail" in line for line in r.stdout.splitlines() if "ERROR" in line), r.stdout
    d.wait_status(lambda st: st["training"]["checkpoint_failures"] >= 3, timeout=120)
    # The count first, then the log: unlimited logging would give at least one line per failure counted.
    failures = d.wait_status()["training"]["checkpoint_failures"]
    failed_lines = [line for line in d.log().splitlines() if "checkpoint at step" in line and "failed" in line]
    assert failures >= 3
    assert 1 <= len(failed_lines) < failures, (failures, failed_lines)  # rate-limited: one line a minute

    assert "MB free on the file system of" in d.log()  # said at start: the tmpfs has 2 MB
    assert d.stop(timeout=30) == 1  # the final checkpoint failed too: non-zero, and said
    assert "stopped, but the final checkpoint (step" in d.log() and "No space left on device" in d.log()


@pytest.mark.slow
def test_a_nodes_own_member_record_carries_the_reachability_its_status_shows(group: DaemonGroup) -> None:
    """Its own record said `reachability unknown` while the top line of the same status said public."""
    a = group.start("a", *LOOPBACK, "--no-train")
    b = group.start("b", *LOOPBACK, "--no-train", "--bootstrap", a.addr())

    def own_record(st: dict) -> dict:
        return next((m for m in st.get("members", []) if m.get("self")), {})

    st = b.wait_status(lambda s: s.get("reachability") == "public" and own_record(s).get("reachability") == "public",
                       timeout=60, interval=1)
    assert _status(b.home)["running"] is True and own_record(st)["peer_id"] == st["peer_id"]


def _newest_checkpoint_step(home: Path) -> int | None:
    """The inner step of the newest checkpoint on disk: what a restarted worker resumes from."""
    steps = [int(p.stem.split("-", 1)[1]) for p in (home / "checkpoints").glob("*/ckpt-*.pt")]
    return max(steps, default=None)


@pytest.mark.slow
def test_a_worker_killed_with_sigkill_resumes_from_its_checkpoint_and_averages_again_saying_why_meanwhile(
    group: DaemonGroup,
) -> None:
    """Issue #27, `kill -9` of a worker: restarted from a checkpoint outer steps back, the two trainers
    stepped solo for about 4 minutes, `declined` rising and logged at debug only, while `status` said "one
    island of 2 trainers". Here the worker is killed while its newest checkpoint is more than
    `sync.max_step_gap` outer steps back, so the restarted worker resumes out of its partner's reach. It
    must catch up from the swarm and average again; meanwhile, whenever `status` itself holds the reason
    (the partner's outer step beyond the gap, or a refusal), what `starling status` prints says so."""
    gap, h = 2, 5  # sync.max_step_gap; TINY's train.inner_steps: an outer step is at most H inner steps
    opts = [*TINY, "--swarm", "k9", "--set", "train.checkpoint_every=20", "--set", f"sync.max_step_gap={gap}"]
    a = group.start("a", *opts)
    b = group.start("b", *opts, "--bootstrap", a.addr())
    for d in (a, b):
        d.wait_status(lambda s: (s.get("sync") or {}).get("rounds", 0) >= 3, timeout=180, interval=1)

    def far_from_its_checkpoint(s: dict) -> bool:
        newest = _newest_checkpoint_step(b.home)
        return newest is not None and s["training"]["step"] - newest >= (gap + 2) * h

    st = b.wait_status(far_from_its_checkpoint, timeout=120, interval=0.2)
    worker = st["training"]["pid"]
    os.kill(worker, signal.SIGKILL)
    checkpoint_step = _newest_checkpoint_step(b.home)
    rounds = {d.home.name: d.status()["sync"]["rounds"] for d in (a, b)}
    catch_ups = st["sync"].get("catch_ups", 0)
    a_id = a.status()["peer_id"]

    samples: list[dict] = []

    def averaged_again(s: dict) -> bool:
        tr = s.get("training") or {}
        if tr.get("restarts", 0) >= 1 and tr.get("pid") not in (None, worker):
            samples.append(s)  # the restarted worker runs
        return bool(samples) and s["sync"]["rounds"] > rounds["b"] and s["sync"].get("catch_ups", 0) > catch_ups

    b.wait_status(averaged_again, timeout=150, interval=0.3)
    a.wait_status(lambda s: s["sync"]["rounds"] > rounds["a"], timeout=60)

    log = b.log()
    resumed = [line for line in log.splitlines() if "worker" in line and "resumed from" in line]
    assert resumed and "checkpoints" in resumed[-1], log[-3000:]
    assert int(resumed[-1].rsplit("at step", 1)[1].split()[0]) == checkpoint_step, resumed[-1]
    assert "catching up from" in log, log[-3000:]
    told = 0
    for s in samples[:-1]:  # before it averaged again
        text = render_status(s)  # what `starling status` prints for this status
        ours = s["training"]["outer_step"]
        theirs = next((m["outer_step"] for m in s.get("members", []) if m["peer_id"] == a_id), None)
        last = s["sync"].get("last_refusal")
        if theirs is not None and abs(theirs - ours) > gap + 1:
            assert "not averaging: the other trainer of this run is" in text, text
            assert "this node is behind: it catches up from the swarm" in text, text
            told += 1
        if last and not last["averaged_since"] and last["seconds_ago"] < 60:
            assert "not averaging: " in text and last["reason"] in text, text
    assert told, "no status sample showed the restarted worker out of its partner's reach"


@pytest.mark.slow
def test_a_lone_founder_starts_training_without_waiting_join_wait_s(group: DaemonGroup) -> None:
    """Every first start of a trainer waited `sync.join_wait_s` for donors, even with no bootstrap peer and
    nobody known. Here the wait is 120 s; the node trains long before. (That it then runs far ahead of
    the second trainer, whose worker loads for seconds meanwhile, is closed by the second's catch-up:
    tests/test_swarm.py's late-join test, and the kill -9 test above, start their swarms this way.)"""
    d = group.start("founder", *TINY, "--set", "sync.join_wait_s=120")
    st = d.wait_status(lambda s: (s.get("training") or {}).get("state") == "training", timeout=90, interval=1)
    assert st["join"]["state"] == "alone: starting a fresh model", st["join"]
    assert "without waiting sync.join_wait_s" in d.log()


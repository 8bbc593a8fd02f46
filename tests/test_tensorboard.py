"""TensorBoard event files (`train.tensorboard_dir`, issue #56): one point per outer step of a node's status, its
training and its averaging; a directory that cannot be written is one warning line and the node trains on.

The event files are read back with tensorboard's own reader (EventAccumulator), as `tensorboard --logdir` does.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from node.ops.tensorboard import TensorBoardLog, scalars_of
from starling_testing.daemon import TINY, TINY_TRAIN, DaemonGroup
from starling_testing.dashboards import wandb_history

ROOT = Path(__file__).resolve().parent.parent


def _status(outer: int, step: int, loss: float | None = 2.5, **sync: Any) -> dict[str, Any]:
    return {"training": {"step": step, "outer_step": outer, "loss": loss, "val_loss": 2.6, "lr": 1e-3,
                         "samples_per_s": 80.0, "last_group_size": 2},
            "sync": {"rounds": outer, "solo_rounds": 0, "failures": 0, "last_duration_s": 0.4,
                     "last_bytes_per_param": 4.0, "last_compression": "none", "distinct_partners": 1,
                     "mixing": {"outer_steps": 10, "averaged": 9}, **sync}}


def _read(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_one_point_per_new_outer_step_at_the_inner_step_with_training_and_averaging(tmp_path: Path) -> None:
    board = TensorBoardLog(tmp_path / "tb")
    assert board.open()
    board.observe({"training": {"step": 0, "outer_step": 0}})  # nothing trained yet: no point
    board.observe(_status(1, 50))
    board.observe(_status(1, 60))  # the same outer step, read again a second later: no second point
    board.observe(_status(2, 100, loss=float("nan"), last_compression="medium"))
    board.close()
    scalars = _read(tmp_path / "tb")
    assert scalars["train/loss"] == [(50, 2.5)]  # the NaN of the second point is left out, not drawn as 0
    assert [s for s, _ in scalars["train/val_loss"]] == [50, 100]
    assert scalars["sync/averaged_share"][0][1] == pytest.approx(0.9)
    assert scalars["sync/compressed"] == [(50, 0.0), (100, 1.0)]
    assert {"train/lr", "train/samples_per_s", "sync/last_exchange_s", "sync/last_bytes_per_param"} <= set(scalars)
    assert board.points == 2


def test_a_status_without_training_or_with_garbage_gives_no_point() -> None:
    assert scalars_of({}) is None and scalars_of({"training": None}) is None
    assert scalars_of({"training": {"step": "x", "outer_step": 1}}) is None
    step, outer, values = scalars_of({"training": {"step": 5, "outer_step": 1, "loss": True, "lr": float("inf")}})
    assert (step, outer) == (5, 1) and "train/loss" not in values and "train/lr" not in values


def test_an_unwritable_directory_is_one_warning_and_no_exception(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    board = TensorBoardLog(blocker / "tb")
    with caplog.at_level(logging.WARNING, "starling.tensorboard"):
        assert not board.open()
        board.observe(_status(1, 50))
        assert not board.open()  # tried once
    warnings = [r.getMessage() for r in caplog.records if r.name == "starling.tensorboard"]
    assert len(warnings) == 1 and "training goes on without them" in warnings[0] and str(blocker) in warnings[0]


def test_a_writer_that_fails_mid_run_is_dropped_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def add_event(self, event: object) -> None:
            raise OSError(28, "No space left on device")

        def close(self) -> None:
            pass

    board = TensorBoardLog(tmp_path, writer_factory=lambda d: Broken())
    assert board.open()
    with caplog.at_level(logging.WARNING, "starling.tensorboard"):
        board.observe(_status(1, 50))
        board.observe(_status(2, 100))
    warnings = [r.getMessage() for r in caplog.records if r.name == "starling.tensorboard"]
    assert len(warnings) == 1 and "No space left on device" in warnings[0] and not board.active


@pytest.mark.slow
def test_a_training_daemon_writes_its_curves_under_home_and_one_with_a_bad_directory_trains_on(
        group: DaemonGroup, tmp_path: Path) -> None:
    """Both dashboards at once (the status is built once a second for both): TensorBoard files and an offline
    W&B run under HOME; a node whose directories cannot be made trains on with one line for each."""
    a = group.start("a", *TINY, "--set", "train.tensorboard_dir=tb", "--set", "train.wandb_dir=wb")
    (tmp_path / "blocker").write_text("a file where the directory would go")
    b = group.start("b", *TINY, "--set", f"train.tensorboard_dir={tmp_path / 'blocker' / 'tb'}",
                    "--set", f"train.wandb_dir={tmp_path / 'blocker' / 'wb'}")
    for d in (a, b):  # the status is read once a second: a few seconds of TINY's quick outer steps
        d.wait(lambda s, d=d: "W&B run in" in d.log() or "cannot write W&B" in d.log(), timeout=120)
        d.wait_status(lambda s: (s.get("training") or {}).get("outer_step", 0) >= 1, timeout=120)
    time.sleep(6)  # about six reads of the status, each at a later outer step (TINY's take well under a second)
    group.close()  # graceful stop: the writers flush
    scalars = _read(tmp_path / "a" / "tb")
    assert len(scalars["train/loss"]) >= 2 and "sync/exchanges" in scalars
    history = wandb_history(tmp_path / "a" / "wb")
    assert len(history) >= 2 and all("train/outer_step" in values for _, values in history)
    for what in ("TensorBoard", "W&B"):
        assert f"cannot write {what} files" in b.log(), what
    assert b.log().count("training goes on without them") == 2


@pytest.mark.slow
def test_make_runs_local_swarm_leaves_every_trainers_curves_for_one_tensorboard_command(tmp_path: Path) -> None:
    """Issue #56: `make run` (node/ops/localswarm.py) turns TensorBoard on for its trainers and prints the one
    `tensorboard --logdir` that shows them side by side; every trainer's files hold training and averaging."""
    sets = [arg for arg in TINY_TRAIN if arg != "--set"]
    root = tmp_path / "run"
    cmd = [sys.executable, "-m", "node.ops.localswarm", "--peers", "2", "--seconds", "50", "--root", str(root),
           "--fresh", *[x for s in sets for x in ("--set", s)]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"TensorBoard: tensorboard --logdir {root}" in out.stdout
    boards = sorted(root.glob("*/tensorboard"))
    assert len(boards) == 2, boards  # the trainers', not the network-only bootstrap node's
    for board in boards:
        scalars = _read(board)
        assert scalars.get("train/loss") and "train/lr" in scalars and "sync/exchanges" in scalars, (board, sorted(scalars))

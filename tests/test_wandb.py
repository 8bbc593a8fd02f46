"""An offline W&B run per node (`train.wandb_dir`, issue #56): one point per outer step of the node's status, read
back from the run's own file; no package or an unwritable directory is one warning line, never a crash."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest

from node.ops.wandb_log import WandbLog
from starling_testing.dashboards import wandb_history


def _status(outer: int, step: int, loss: float = 2.0) -> dict[str, Any]:
    return {"training": {"step": step, "outer_step": outer, "loss": loss, "lr": 1e-3},
            "sync": {"rounds": outer, "last_bytes_per_param": 2.0, "last_compression": "none"}}


def test_an_offline_run_holds_one_point_per_new_outer_step_at_the_inner_step(tmp_path: Path) -> None:
    board = WandbLog(tmp_path, "node-a", "swarm-1")
    assert board.open()
    for status in (_status(1, 50, 3.0), _status(1, 55), _status(2, 100, 2.5), _status(3, 150, 2.0)):
        board.observe(status)  # the repeated outer step 1 is not a new point
    board.close()
    history = wandb_history(tmp_path)
    assert [step for step, _ in history] == [50, 100, 150]
    assert [values["train/loss"] for _, values in history] == [3.0, 2.5, 2.0]
    assert history[-1][1]["sync/exchanges"] == 3 and history[-1][1]["sync/compressed"] == 0


def test_without_the_package_the_setting_is_one_warning_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    board = WandbLog(tmp_path, "node-a", "swarm-1")
    with caplog.at_level(logging.WARNING, "starling.wandb"):
        assert not board.open()
        board.observe(_status(1, 50))
        assert not board.open()
    warnings = [r.getMessage() for r in caplog.records if r.name == "starling.wandb"]
    assert warnings == ["cannot write W&B files: wandb is not installed (pip install 'starling[wandb]'); "
                        "training goes on without them (train.wandb_dir)"]


def test_an_unwritable_directory_is_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    board = WandbLog(blocker / "wb", "node-a", "swarm-1")
    with caplog.at_level(logging.WARNING, "starling.wandb"):
        assert not board.open()
        board.observe(_status(1, 50))
    warnings = [r.getMessage() for r in caplog.records if r.name == "starling.wandb"]
    assert len(warnings) == 1 and str(blocker) in warnings[0] and "training goes on" in warnings[0]

"""An offline Weights & Biases run of this node's training and averaging (`train.wandb_dir`, issue #56).

W&B is where many ML engineers watch a run; hivemind's runs log to it. The run is *offline*: written under
`train.wandb_dir` (DIR/wandb/offline-run-*), nothing is sent, and `wandb sync DIR/wandb/offline-run-*` is the
user's own choice. Each node's run is named by its PeerID (short) and grouped by swarm, so a synced swarm shows
its nodes side by side. The points, one per outer step, are node/ops/dashboards.py's.

`wandb` is an optional extra (`pip install 'starling[wandb]'`): it is large and starts a service process of its
own. Where it is not installed, or its directory cannot be written, the setting costs one warning line.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from node.ops.dashboards import StatusLog

log = logging.getLogger("starling.wandb")

__all__ = ["WandbLog"]

PROJECT = "starling"


class WandbLog(StatusLog):
    """An offline W&B run in `directory`, named `name`, in group `group` (the swarm)."""

    what = "W&B files"
    setting = "train.wandb_dir"

    def __init__(self, directory: Path, name: str, group: str) -> None:
        super().__init__(directory, self._start, logger=log)
        self.name = name
        self.group = group

    def _start(self, directory: Path) -> Any:
        try:
            import wandb
        except ImportError:
            raise ImportError("wandb is not installed (pip install 'starling[wandb]')") from None
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True,
                                  save_code=False, mode="offline")
        return wandb.init(dir=str(directory), project=PROJECT, name=self.name, group=self.group,
                          settings=settings, reinit="create_new")

    def _write(self, writer: Any, step: int, values: dict[str, float]) -> None:
        writer.log(values, step=step)

    def _close(self, writer: Any) -> None:
        """Finish the run, then stop wandb's service process: `finish` returns before that service has written
        the run's file (read at once, it held only its header in about one run of three), and the service writes
        it whole only as it stops. The daemon has one run and closes it as it shuts down, so nothing else in the
        process needs the service afterwards."""
        import wandb

        writer.finish()
        wandb.teardown()

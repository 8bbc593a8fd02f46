"""TensorBoard event files of this node's training and averaging (`train.tensorboard_dir`, issue #56).

`tensorboard --logdir DIR` then shows the loss curves where ML engineers already look; a local swarm's nodes,
each writing under its own HOME, show side by side from their common parent (`make run` prints the command).
The points, one per outer step, are node/ops/dashboards.py's.

Why tensorboard's own `EventFileWriter`: torch's `SummaryWriter` is a thin layer over it, and the daemon never
imports torch. It queues events and writes them from its own thread, so the trio loop never waits on the disk.
Why off by default: the package's import costs the daemon about half a second and some memory at start, and an
operator who watches with Prometheus needs none of it; one setting turns it on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from node.ops.dashboards import StatusLog, scalars_of

log = logging.getLogger("starling.tensorboard")

__all__ = ["TensorBoardLog", "scalars_of"]

#: Seconds between the writer's flushes to disk (tensorboard's default, 120, leaves a live curve minutes behind).
FLUSH_S = 10


def _event_file_writer(directory: Path) -> Any:
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    return EventFileWriter(str(directory), flush_secs=FLUSH_S)


class TensorBoardLog(StatusLog):
    """The event files of `directory`: one event per point, its scalars under their tags."""

    what = "TensorBoard files"
    setting = "train.tensorboard_dir"

    def __init__(self, directory: Path, *, writer_factory: Callable[[Path], Any] = _event_file_writer,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(directory, writer_factory, logger=log)
        self._clock = clock

    def _write(self, writer: Any, step: int, values: dict[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])
        writer.add_event(Event(wall_time=self._clock(), step=step, summary=summary))

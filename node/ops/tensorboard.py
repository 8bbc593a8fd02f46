"""TensorBoard event files of this node's training and averaging (`train.tensorboard_dir`, issue #56).

`tensorboard --logdir DIR` then shows the loss curves where ML engineers already look; a local swarm's nodes,
each writing under its own HOME, show side by side from their common parent (`make run` prints the command).

Why in the daemon, from its status: the daemon holds both sides (the worker's metrics arrive about once a second,
the exchanges are its own), and the status is what `starling status` and the Prometheus endpoint show, so the
three never disagree. One point per outer step of this node, at its inner step:

    train/loss  train/val_loss  train/lr  train/samples_per_s  train/outer_step  train/group_size
    sync/averaged_share (of the recent window's outer steps)  sync/exchanges  sync/solo_rounds  sync/failures
    sync/last_exchange_s  sync/last_bytes_per_param  sync/compressed (1 where the last exchange used a lossy
    preset)  sync/distinct_partners  sync/catch_ups

Why tensorboard's own `EventFileWriter`: torch's `SummaryWriter` is a thin layer over it, and the daemon never
imports torch. It queues events and writes them from its own thread, so the trio loop never waits on the disk.
Why off by default: the package's import costs the daemon about half a second and some memory at start, and an
operator who watches with Prometheus needs none of it; one setting turns it on.

A directory that cannot be made or written is one warning line, and training goes on without the files.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

log = logging.getLogger("starling.tensorboard")

__all__ = ["TensorBoardLog", "board_directory", "open_board", "scalars_of"]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def scalars_of(status: Mapping[str, Any]) -> tuple[int, int, dict[str, float]] | None:
    """(inner step, outer step, {tag: value}) of a node's status, or None for a node that does not train yet.
    Missing or non-finite values are left out (a point is never invented)."""
    training = status.get("training")
    if not isinstance(training, Mapping):
        return None
    step, outer = training.get("step"), training.get("outer_step")
    if not isinstance(step, int) or not isinstance(outer, int) or outer <= 0:
        return None
    sync = status.get("sync") if isinstance(status.get("sync"), Mapping) else {}
    assert isinstance(sync, Mapping)
    mixing = sync.get("mixing") if isinstance(sync.get("mixing"), Mapping) else {}
    assert isinstance(mixing, Mapping)
    window = _number(mixing.get("outer_steps"))
    averaged = _number(mixing.get("averaged"))
    last_compression = sync.get("last_compression")
    values = {
        "train/loss": _number(training.get("loss")),
        "train/val_loss": _number(training.get("val_loss")),
        "train/lr": _number(training.get("lr")),
        "train/samples_per_s": _number(training.get("samples_per_s")),
        "train/outer_step": float(outer),
        "train/group_size": _number(training.get("last_group_size")),
        "sync/averaged_share": averaged / window if window and averaged is not None else None,
        "sync/exchanges": _number(sync.get("rounds")),
        "sync/solo_rounds": _number(sync.get("solo_rounds")),
        "sync/failures": _number(sync.get("failures")),
        "sync/last_exchange_s": _number(sync.get("last_duration_s")),
        "sync/last_bytes_per_param": _number(sync.get("last_bytes_per_param")),
        "sync/compressed": (float(last_compression != "none") if isinstance(last_compression, str) else None),
        "sync/distinct_partners": _number(sync.get("distinct_partners")),
        "sync/catch_ups": _number(sync.get("catch_ups")),
    }
    return step, outer, {k: v for k, v in values.items() if v is not None}


#: Seconds between the writer's flushes to disk (tensorboard's default, 120, leaves a live curve minutes behind).
FLUSH_S = 10


def _event_file_writer(directory: Path) -> Any:
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    return EventFileWriter(str(directory), flush_secs=FLUSH_S)


class TensorBoardLog:
    """Writes one point per new outer step of the statuses it is shown (`observe`); `close` flushes.

    `open` imports the package and creates the event file: the daemon calls it in a thread (the import takes
    about half a second); `observe` before it writes nothing."""

    def __init__(self, directory: Path, *, writer_factory: Callable[[Path], Any] = _event_file_writer,
                 clock: Callable[[], float] = time.time) -> None:
        self.directory = directory
        self._factory = writer_factory
        self._clock = clock
        self._writer: Any = None
        self._failed = False
        self._last_outer = 0
        self.points = 0

    @property
    def active(self) -> bool:
        return not self._failed

    def open(self) -> bool:
        """Create the directory and the event file (once); False, with one warning line, where that fails."""
        if self._writer is None and not self._failed:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._writer = self._factory(self.directory)
            except (OSError, ImportError) as e:
                self._fail(f"cannot write TensorBoard files in {self.directory}: {e}")
        return self._writer is not None

    def _fail(self, why: str) -> None:
        self._failed = True
        log.warning("%s; training goes on without them (train.tensorboard_dir)", why)

    def observe(self, status: Mapping[str, Any]) -> None:
        """Write the status's point if its outer step is new; never raises (a dashboard must not stop a node)."""
        point = scalars_of(status)
        if point is None or self._failed:
            return
        step, outer, values = point
        if outer <= self._last_outer or self._writer is None:
            return
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary

            summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])
            self._writer.add_event(Event(wall_time=self._clock(), step=step, summary=summary))
        except Exception as e:  # the writer's thread re-raises whatever stopped it (a full disk...): never ours to die of
            self._fail(f"cannot write TensorBoard files in {self.directory}: {e}")
            return
        self._last_outer = outer
        self.points += 1

    def close(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception as e:  # as in observe: a failed flush is a log line
                log.warning("could not flush the TensorBoard files in %s: %s", self.directory, e)
            self._writer = None


def board_directory(setting: str, home: Path) -> Path:
    """Where `train.tensorboard_dir` puts the files: a relative path lives under HOME."""
    directory = Path(setting).expanduser()
    return directory if directory.is_absolute() else home / directory


@asynccontextmanager
async def open_board(directory: Path) -> AsyncIterator[TensorBoardLog | None]:
    """The daemon's TensorBoard files for as long as it runs: the board, or None (one warning said why) where
    the directory cannot be written. Opened in a thread (the package's import takes about half a second) and
    flushed on the way out, within 5 s even when the daemon is being cancelled."""
    board = TensorBoardLog(directory)
    try:
        if not await trio.to_thread.run_sync(board.open):
            yield None
            return
        log.info("TensorBoard files in %s (tensorboard --logdir %s)", board.directory, board.directory)
        yield board
    finally:
        with trio.move_on_after(5, shield=True):
            await trio.to_thread.run_sync(board.close, abandon_on_cancel=True)

"""What the daemon writes for the dashboards ML engineers already watch (issue #56): one point per outer step of
this node's status, to TensorBoard event files (node/ops/tensorboard.py) and to an offline W&B run
(node/ops/wandb_log.py).

Why from the status: the daemon holds both sides (the worker's metrics arrive about once a second, the
exchanges are its own), and the status is what `starling status` and the Prometheus endpoint show, so every
reader agrees. The points, by tag:

    train/loss  train/val_loss  train/lr  train/samples_per_s  train/outer_step  train/group_size
    sync/averaged_share (of the recent window's outer steps)  sync/exchanges  sync/solo_rounds  sync/failures
    sync/last_exchange_s  sync/last_bytes_per_param  sync/compressed (1 where the last exchange used a lossy
    preset)  sync/distinct_partners  sync/catch_ups

A dashboard must never stop a node: a directory that cannot be written, a package that is not installed or a
writer that fails mid-run is one warning line, and training goes on without it.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

log = logging.getLogger("starling.dashboards")

__all__ = ["StatusLog", "log_directory", "open_log", "scalars_of"]


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


class StatusLog(ABC):
    """Writes one point per new outer step of the statuses it is shown (`observe`); `close` flushes.

    `open` creates the directory and the writer (`writer_factory`, which imports its package: the daemon calls
    it in a thread); `observe` before it writes nothing. Subclasses say how a point is written (`_write`) and
    how the writer is closed (`_close`); `what` and `setting` name them in the one warning line."""

    what = "dashboard files"
    setting = ""

    def __init__(self, directory: Path, writer_factory: Callable[[Path], Any], *, logger: logging.Logger = log) -> None:
        self.directory = directory
        self._factory = writer_factory
        self._log = logger
        self._writer: Any = None
        self._failed = False
        self._last_outer = 0
        self.points = 0

    @property
    def active(self) -> bool:
        return not self._failed

    def open(self) -> bool:
        """Create the directory and the writer (once); False, with one warning line, where that fails."""
        if self._writer is None and not self._failed:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._writer = self._factory(self.directory)
            except ImportError as e:
                self._fail(f"cannot write {self.what}: {e}")
            except Exception as e:  # OSError, or whatever the package raises for a directory it cannot use
                self._fail(f"cannot write {self.what} in {self.directory}: {e}")
        return self._writer is not None

    def _fail(self, why: str) -> None:
        self._failed = True
        self._log.warning("%s; training goes on without them (%s)", why, self.setting)

    def observe(self, status: Mapping[str, Any]) -> None:
        """Write the status's point if its outer step is new; never raises."""
        point = scalars_of(status)
        if point is None or self._failed:
            return
        step, outer, values = point
        if outer <= self._last_outer or self._writer is None:
            return
        try:
            self._write(self._writer, step, values)
        except Exception as e:  # a writer's thread re-raises whatever stopped it (a full disk...): never ours to die of
            self._fail(f"cannot write {self.what} in {self.directory}: {e}")
            return
        self._last_outer = outer
        self.points += 1

    def close(self) -> None:
        if self._writer is not None:
            try:
                self._close(self._writer)
            except Exception as e:  # as in observe: a failed flush is a log line
                self._log.warning("could not flush the %s in %s: %s", self.what, self.directory, e)
            self._writer = None

    @abstractmethod
    def _write(self, writer: Any, step: int, values: dict[str, float]) -> None:
        """Write one point: `values` by tag, at inner step `step`."""

    def _close(self, writer: Any) -> None:
        writer.close()


def log_directory(setting: str, home: Path) -> Path:
    """Where a `train.*_dir` setting puts the files: a relative path lives under HOME."""
    directory = Path(setting).expanduser()
    return directory if directory.is_absolute() else home / directory


@asynccontextmanager
async def open_log(board: StatusLog, ready: str) -> AsyncIterator[StatusLog | None]:
    """`board` for as long as the daemon runs, or None (one warning said why) where it cannot be written.
    Opened in a thread (a package's import takes a second or so), `ready` logged once open, and closed on the way
    out within 5 s even when the daemon is being cancelled."""
    try:
        if not await trio.to_thread.run_sync(board.open):
            yield None
            return
        board._log.info("%s", ready)
        yield board
    finally:
        with trio.move_on_after(5, shield=True):
            await trio.to_thread.run_sync(board.close, abandon_on_cancel=True)

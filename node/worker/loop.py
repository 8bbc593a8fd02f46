"""The worker process's loop: the conversation with the daemon around a `Trainer` (node/worker/trainer.py),
one OS process per node.

Started by `node.bridge.supervisor.WorkerSupervisor` as `python -m node.worker --fd N`, where N is this end of a
socketpair. Why a separate process: the trio daemon never competes with torch for the GIL, so networking
never waits on training and training never waits on networking; and a crashed or OOM-killed worker does
not take the node off the network.

Conversation with the daemon (msgpack maps, length-prefixed, over the socketpair):

    daemon -> worker   init      config, HOME, PeerID
    worker -> daemon   hello     parameter count and layout, task, device, hashes, resumed counters
    daemon -> worker   attach    names of the four shared-memory slots (node/bridge/shm.py)
    worker -> daemon   publish   phi and Delta are in the slots for outer step k (and the inner steps and
                                 samples that Delta covers)
    daemon -> worker   result    group size n for outer step k (sums over the group in phi_out/delta_out
                                 when n >= 2), the outer step to continue from, the partner's samples,
                                 the swarm's pace and a phase shift, or a swarm snapshot to adopt instead
    worker -> daemon   adopted   the snapshot was adopted (counters before and after) or why not
    worker -> daemon   metrics   step, loss, val_loss, samples/s ... about once a second, and how many
                                 results it has handled (phi changes only then: node/bridge/livephi.py)
    worker -> daemon   checkpoint  a checkpoint was written
    daemon -> worker   stop      checkpoint and exit
    worker -> daemon   stopped   the final checkpoint is on disk
    worker -> daemon   fatal     a start-up error that a restart cannot fix (bad task, bad config)
    worker -> daemon   crashed   an unexpected error (e.g. the task's loss() raised), sent just before
                                 exiting, so that status can say why the worker is being restarted

`python -m node.worker --check` (no socket) only loads the configured device and task from a JSON request
on stdin and exits 0, or 2 with the reason on one line: the daemon runs it before it reports ready, so a
task that cannot be imported or built, or a missing GPU, stops the start-up with exit code 2.

With `train.local_ranks > 1` this process is rank 0 of a worker group (`--fd N --group DIR`), and ranks
1.. run as `python -m node.worker --follow DIR --rank R`: node/worker/group.py says how they train as one.

Streaming fragments (`sync.fragments` = F > 1, named in `attach`; issue #23): the model is cut into F
fragments (`Trainer.set_fragments`), and fragment f is published at inner step floor((f + 1) H / F) of each
period, or at (f + 1) / F of the daemon's pace (`Trainer.fragment_due`), its phi and Delta in its slice of
the slots; `publish` and `result` then name the fragment. Each fragment's publish and result are
independent of the others', and a fragment whose previous result has not come when its slot does skips
that slot (`Trainer.fragment_skips`) rather than waiting: the worker never idles for a result, whatever
`train.overlap` and `train.max_lag` say (they concern the whole vector's single publish). A result's phase
shift is divided by F: each of the period's F results moves the phase towards its own partner.

The worker dies with the daemon: end-of-file on the socket means the daemon is gone, and the worker then
writes a checkpoint and exits. SIGTERM/SIGINT mean the same (it runs in its own session, so a Ctrl+C
meant for the daemon does not interrupt it mid-step; the daemon asks it to stop instead).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from node.bridge.exchange import ExchangeOutcome
from node.bridge.ipc import (
    Adopted,
    Attach,
    CheckpointFailed,
    CheckpointSaved,
    DaemonGone,
    Fatal,
    Hello,
    Init,
    Metrics,
    Result,
    Stop,
    Stopped,
    WorkerChannel,
    outcome_of,
)
from node.bridge.shm import ExchangeSlots, SharedTensor
from node.config.train import TrainConfig
from node.worker.checkpoint import CheckpointError
from node.worker.task import TaskError
from node.worker.trainer import Trainer
from p2p.framing import ProtocolError, Reason

log = logging.getLogger("starling.worker")

METRICS_INTERVAL = 1.0  # seconds between metrics messages (also the worker's heartbeat)


class StopFlag:
    """Set by SIGTERM/SIGINT; checked between steps so a signal never interrupts a step half-way."""

    def __init__(self) -> None:
        self.set = False

    def __call__(self, signum: int, frame: Any) -> None:
        self.set = True


class _Meter:
    """Loss and throughput over the interval since the last metrics message."""

    def __init__(self) -> None:
        self.reset()
        self.first = True
        self.results = 0  # results handled in this worker's life (not reset: a count, reported in metrics)

    def reset(self) -> None:
        self.started = time.monotonic()
        self.losses: list[float] = []
        self.first = False

    def due(self) -> bool:
        # The first report goes out right after the first inner step: the loss curve (`starling plot`)
        # starts where training starts instead of a second and some hundred steps in.
        return (self.first and bool(self.losses)) or time.monotonic() - self.started >= METRICS_INTERVAL


def run_worker(chan: WorkerChannel, init: Init, stop: StopFlag,
               build: Callable[[TrainConfig, Init], Trainer] | None = None) -> int:
    """Build the trainer, resume, and train until told to stop; returns the process exit code. `build`
    makes the trainer from the config and the daemon's init (default: a plain `Trainer`); rank 0 of a
    worker group passes node/worker/group.py's (node/worker/main.py does), so that this module, which the
    group's trainer subclasses, never imports the group."""
    try:
        cfg = TrainConfig(**init.config)
        cfg.validate()
    except (TypeError, ValueError) as e:
        chan.send(Fatal(f"bad train config: {e}"))
        return 2
    torch.set_num_threads(cfg.threads)
    try:
        if build is None:
            trainer = Trainer(cfg, Path(init.home), init.peer_id, init.task_options)
        else:
            trainer = build(cfg, init)
    except TaskError as e:
        # One line for the operator; the task's own traceback only at debug (it is the task author's).
        log.error("%s", e)
        log.debug("the task failed with", exc_info=e.__cause__)
        chan.send(Fatal(str(e)))
        return 2
    resumed_from, rejected = trainer.resume()
    if resumed_from is not None:
        log.info("resumed from %s at step %d (outer step %d)", resumed_from, trainer.step, trainer.outer_step)
    chan.send(
        Hello(
            pid=os.getpid(),
            numel=trainer.numel,
            layout=[[name, list(shape)] for name, shape in trainer.layout],
            task=trainer.task.name,
            device=str(trainer.device),
            model_hash=trainer.model_hash,
            layout_hash=trainer.layout_hash,
            step=trainer.step,
            outer_step=trainer.outer_step,
            resumed_from=None if resumed_from is None else str(resumed_from),
            rejected=rejected,
        )
    )
    attach = _wait_for(chan, Attach, timeout=60.0, stop=stop)
    if attach is None:
        trainer.close()
        return 0
    slots = ExchangeSlots.attach(attach.names, trainer.numel)
    try:
        code = train_loop(chan, trainer, slots, stop, attach.fragments)
    finally:
        slots.close()
    trainer.close()  # not after an exception: the other ranks may be mid-collective; the supervisor kills them
    return code


def _wait_for(chan: WorkerChannel, kind: type, *, timeout: float, stop: StopFlag) -> Any:
    """Block for a message of `kind` (the daemon is local and answers at once; the timeout is a bug
    guard). None if told to stop meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.set:
        msg = chan.receive(timeout=0.5)
        if isinstance(msg, Stop):
            return None
        if isinstance(msg, kind):
            return msg
        if msg is not None:
            raise ProtocolError(Reason.BAD_KIND, f"expected {kind.__name__}, got {type(msg).__name__}")
    if stop.set:
        return None
    raise TimeoutError(f"no {kind.__name__} from the daemon within {timeout:.0f}s")


def _view(slot: SharedTensor) -> torch.Tensor:
    """A shared-memory slot as a torch tensor over the same pages (no copy; the daemon sees numpy)."""
    return torch.from_numpy(slot.array)


def train_loop(chan: WorkerChannel, trainer: Trainer, slots: ExchangeSlots, stop: StopFlag,
               fragments: int = 1) -> int:
    """The worker's loop once attached to its slots: train, publish, apply results and snapshots, report
    metrics and checkpoint, until `stop` or the daemon says stop; returns the exit code. Public because the
    tests drive it with a scripted daemon on the channel's other end. `fragments`: `sync.fragments`."""
    cfg = trainer.cfg
    trainer.share_phi(_view(slots.phi))  # one copy of phi, in the slot the daemon sends it from
    if fragments > 1 or trainer.fragments is not None:  # (a checkpoint may have restored another count)
        trainer.set_fragments(fragments if fragments > 1 else None)
    meter = _Meter()
    try:
        while not stop.set:
            # 1. Take in whatever the daemon said; block for the outer result if it lags too far behind.
            must_wait = trainer.pending is not None and (
                not cfg.overlap or (cfg.max_lag > 0 and trainer.lag() >= cfg.max_lag))
            waiting_since = time.monotonic()
            msg = chan.receive(timeout=0.5 if must_wait else 0.0)
            if must_wait:
                trainer.blocked_s += time.monotonic() - waiting_since
            if isinstance(msg, Stop):
                break
            if isinstance(msg, Result):
                if trainer.fragments is None:
                    _on_result(chan, trainer, slots, msg)
                else:
                    _on_fragment_result(chan, trainer, slots, msg)
                meter.results += 1  # phi is written only here: the daemon serves it live in between
            elif msg is not None:
                log.warning("ignoring unexpected %s from the daemon", type(msg).__name__)
            elif trainer.fragments is not None and (f := trainer.fragment_due()) is not None:
                # 2'. A streaming fragment's slot: publish it, or skip it while its previous one is out.
                _publish_fragment(chan, trainer, slots, f)
            elif trainer.fragments is None and trainer.publish_due():
                # 2. Publish every H inner steps (only one outer exchange in flight at a time).
                chan.send(trainer.publish(_view(slots.phi), _view(slots.delta)))
            elif not must_wait:
                # 3. One inner step.
                meter.losses.append(trainer.inner_step())
            # Metrics double as the heartbeat, so they go out while waiting for a result too.
            if meter.due():
                _send_metrics(chan, trainer, meter)
    except DaemonGone:
        log.warning("the daemon is gone; checkpointing and exiting")
        _final_checkpoint(None, trainer)
        return 0
    _final_checkpoint(chan, trainer)
    return 0


def _on_result(chan: WorkerChannel, trainer: Trainer, slots: ExchangeSlots, msg: Result) -> None:
    if msg.outer_step != trainer.pending:
        log.warning("ignoring a result for outer step %s (pending: %s)", msg.outer_step, trainer.pending)
        return
    if msg.adopt:
        _adopt(chan, trainer, msg)
        return
    used = _apply(trainer, slots, msg)
    trainer.set_pace(msg.period_s, msg.shift_s)
    log.debug("outer step %d applied (group of %d)", trainer.outer_step, max(1, used))
    _after_outer_step(chan, trainer)


def _apply(trainer: Trainer, slots: ExchangeSlots, msg: Result, span: tuple[int, int] | None = None) -> int:
    """Apply `msg`'s outer step from the slots (their `span` slice for a streaming fragment); returns the
    group size used. The Delta slot is lent for our own Delta: the exchange is over (Trainer.apply_result)."""
    lo, hi = span if span is not None else (0, trainer.numel)
    return trainer.apply_result(outcome_of(msg), _view(slots.phi_out)[lo:hi], _view(slots.delta_out)[lo:hi],
                                scratch=_view(slots.delta)[lo:hi], sum_phi_is_scratch=True, fragment=span)


def _after_outer_step(chan: WorkerChannel, trainer: Trainer) -> None:
    """Evaluate and checkpoint where the model's outer step calls for it."""
    if trainer.outer_step % trainer.cfg.eval_every == 0:
        trainer.evaluate()
    if trainer.checkpoint_due():
        _checkpoint(chan, trainer)


def _publish_fragment(chan: WorkerChannel, trainer: Trainer, slots: ExchangeSlots, f: int) -> None:
    """Fragment f's slot has come: publish it (its slice of the slots), or skip the slot where its previous
    publish still awaits its result, or where it is empty (a model of fewer blocks than fragments)."""
    assert trainer.fragments is not None
    lo, hi = trainer.fragments[f]
    if hi > lo and f not in trainer.in_flight:
        publish = trainer.publish_fragment(lo, hi, _view(slots.phi)[lo:hi], _view(slots.delta)[lo:hi])
        publish.fragment, publish.fragments = f, len(trainer.fragments)
        chan.send(publish)
    elif hi > lo:
        trainer.fragment_skips += 1
        log.debug("fragment %d skips its slot at step %d: its previous result has not come", f, trainer.step)
    trainer.pass_fragment_slot()


def _on_fragment_result(chan: WorkerChannel, trainer: Trainer, slots: ExchangeSlots, msg: Result) -> None:
    """A streaming fragment's result: the outer step and rebase on its slice (`Trainer.apply_result`'s
    `fragment`), whatever the other fragments in flight; or a catch-up, which replaces them all (the
    daemon sends one only while no other fragment is in flight)."""
    assert trainer.fragments is not None
    flight = trainer.in_flight.get(msg.fragment) if msg.fragments == len(trainer.fragments) else None
    if flight is None or msg.outer_step != flight.outer_step:
        log.warning("ignoring a result for fragment %d of %d at outer step %s (not in flight)", msg.fragment,
                    msg.fragments, msg.outer_step)
        return
    lo, hi = trainer.fragments[msg.fragment]
    if msg.adopt:
        _adopt(chan, trainer, msg, (lo, hi))
        return
    before = trainer.outer_step
    used = _apply(trainer, slots, msg, (lo, hi))
    trainer.set_pace(msg.period_s, msg.shift_s / len(trainer.fragments))
    log.debug("fragment %d at outer step %d applied (group of %d)", msg.fragment, msg.outer_step, max(1, used))
    # The model's outer step is the lowest fragment's: evaluate and checkpoint when it moves, as the whole
    # vector's do (not at each of the period's F results).
    if trainer.outer_step != before:
        _after_outer_step(chan, trainer)


def _adopt(chan: WorkerChannel, trainer: Trainer, msg: Result, fragment: tuple[int, int] | None = None) -> None:
    """A catch-up instead of this outer step (or of this `fragment`'s sync); a snapshot that cannot be used
    means a solo step."""
    previous = (trainer.step, trainer.outer_step)
    try:
        adopted = trainer.adopt_snapshot(Path(msg.adopt), msg.adopt_outer_step)
    except CheckpointError as e:
        log.warning("not adopting the swarm snapshot %s: %s; taking a solo step", msg.adopt, e)
        trainer.apply_result(ExchangeOutcome(1), fragment=fragment)
        chan.send(Adopted(previous_step=previous[0], previous_outer_step=previous[1], step=trainer.step,
                          outer_step=trainer.outer_step, error=str(e)[:300]))
        return
    chan.send(adopted)
    # At once, not at the next interval: a restart must not resume from the abandoned weights.
    _checkpoint(chan, trainer)


CHECKPOINT_ERROR_LOG_S = 60.0  # at most one line per this many seconds about failing checkpoints


class CheckpointErrorLog:
    """Rate-limits the log of failing checkpoints: the first failure at once, then at most one line per
    `every` seconds, counting the failures it stands for. A full disk fails every checkpoint (one per outer
    step: 124 lines in 40 s with a tiny model), and the lines would bury everything else."""

    def __init__(self, every: float = CHECKPOINT_ERROR_LOG_S, clock: Any = time.monotonic) -> None:
        self.every = every
        self.clock = clock
        self.unlogged = 0  # failures since the last line
        self.failures = 0  # in a row, since the last checkpoint that was written
        self._last: float | None = None

    def failed(self, step: int, error: OSError) -> None:
        self.failures += 1
        now = self.clock()
        if self._last is not None and now - self._last < self.every:
            self.unlogged += 1
            return
        more = f" ({self.unlogged} more failures since the last such line)" if self.unlogged else ""
        log.error("checkpoint at step %d failed: %s%s; the previous checkpoint is kept, training goes on: free "
                  "space on the file system of HOME (`starling status` shows the error while it lasts)",
                  step, error, more)
        self._last, self.unlogged = now, 0

    def written(self, step: int) -> None:
        if self.failures:
            log.info("checkpoint written again at step %d, after %d failed ones", step, self.failures)
        self.failures, self.unlogged, self._last = 0, 0, None


_checkpoint_errors = CheckpointErrorLog()


def _checkpoint(chan: WorkerChannel, trainer: Trainer) -> None:
    try:
        path = trainer.save_checkpoint()
    except OSError as e:
        # A full or failing disk: the previous checkpoint is intact (atomic write). Crashing would
        # only restart from it, lose the progress since, and fail again: keep training instead.
        _checkpoint_errors.failed(trainer.step, e)
        chan.send(CheckpointFailed(step=trainer.step, outer_step=trainer.outer_step, error=_one_line(e)))
        return
    _checkpoint_errors.written(trainer.step)
    chan.send(CheckpointSaved(step=trainer.step, outer_step=trainer.outer_step, path=str(path)))


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def _send_metrics(chan: WorkerChannel, trainer: Trainer, meter: _Meter) -> None:
    finite = [x for x in meter.losses if math.isfinite(x)]
    chan.send(
        Metrics(
            step=trainer.step,
            outer_step=trainer.outer_step,
            loss=sum(finite) / len(finite) if finite else None,
            val_loss=trainer.val_loss,
            # The machine's training speed, smoothed (steady whatever this interval holds): what the swarm
            # paces outer steps by (node/daemon.py).
            samples_per_s=trainer.samples_per_s(),
            lr=trainer.lr_at(trainer.step),
            results=meter.results,
        )
    )
    meter.reset()


def _final_checkpoint(chan: WorkerChannel | None, trainer: Trainer) -> None:
    error = ""
    try:
        path: Path | None = trainer.save_checkpoint()
        log.info("checkpoint %s written at step %d (outer step %d)", path, trainer.step, trainer.outer_step)
    except OSError as e:
        path, error = None, _one_line(e)
        log.error("final checkpoint at step %d failed: %s; the previous checkpoint is kept (a restart resumes "
                  "from it): free space on the file system of HOME", trainer.step, e)
    if chan is not None:
        try:
            if path is not None:
                chan.send(CheckpointSaved(step=trainer.step, outer_step=trainer.outer_step, path=str(path)))
            else:
                chan.send(CheckpointFailed(step=trainer.step, outer_step=trainer.outer_step, error=error, final=True))
            chan.send(Stopped(step=trainer.step, outer_step=trainer.outer_step))
        except DaemonGone:
            pass

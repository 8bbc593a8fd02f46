"""The local torch worker: inner Adam steps, the outer step, checkpoints; one OS process per node.

Started by `node.supervisor.WorkerSupervisor` as `python -m node.worker --fd N`, where N is this end of a
socketpair. Why a separate process: the trio daemon never competes with torch for the GIL, so networking
never waits on training and training never waits on networking; and a crashed or OOM-killed worker does
not take the node off the network.

Conversation with the daemon (msgpack maps, length-prefixed, over the socketpair):

    daemon -> worker   init      config, HOME, PeerID
    worker -> daemon   hello     parameter count and layout, task, device, hashes, resumed counters
    daemon -> worker   attach    names of the four shared-memory slots (node/shm.py)
    worker -> daemon   publish   phi and Delta are in the slots for outer step k (and the inner steps and
                                 samples that Delta covers)
    daemon -> worker   result    group size n for outer step k (sums over the group in phi_out/delta_out
                                 when n >= 2), the outer step to continue from, the partner's samples,
                                 the swarm's pace and a phase shift, or a swarm snapshot to adopt instead
    worker -> daemon   adopted   the snapshot was adopted (counters before and after) or why not
    worker -> daemon   metrics   step, loss, val_loss, samples/s ... about once a second
    worker -> daemon   checkpoint  a checkpoint was written
    daemon -> worker   stop      checkpoint and exit
    worker -> daemon   stopped   the final checkpoint is on disk
    worker -> daemon   fatal     a start-up error that a restart cannot fix (bad task, bad config)

The inner/outer loop (overlap mode, the default): after H inner steps the worker writes `phi` and
`Delta = theta - phi` into shared memory, says `publish`, and keeps training. When the result arrives it
applies the outer step to `phi` and keeps the progress made meanwhile:
`theta <- phi_new + (theta_now - theta_published)`. If the result lags `max_lag` inner steps behind the
publish, training waits for it. With `overlap = false` it waits right away (the blocking baseline).

Outer-step counters. After an exchange the worker continues from the larger of the two partners' outer
steps, so paired nodes keep the same counter. A node that fell too far from the swarm to pair gets a
catch-up instead of a result: the daemon downloaded the swarm's weights (node/latejoin.py, `CatchUp`) and
the worker adopts them at that outer step (`Trainer.adopt_snapshot`). The learning-rate schedule follows
the inner `step`, which only a snapshot changes.

The worker dies with the daemon: end-of-file on the socket means the daemon is gone, and the worker then
writes a checkpoint and exits. SIGTERM/SIGINT mean the same (it runs in its own session, so a Ctrl+C
meant for the daemon does not interrupt it mid-step; the daemon asks it to stop instead).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import select
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import torch

from node.checkpoint import CheckpointError, CheckpointStore, read_checkpoint
from node.outer import OuterHyper, OuterOptimizer
from node.shm import ExchangeSlots
from node.task import (
    Layout,
    TaskContext,
    TaskError,
    autocast,
    layout_hash,
    load_task,
    model_hash,
    param_layout,
    resolve_device,
)
from node.train_config import TrainConfig

log = logging.getLogger("starling.worker")

PROTOCOL_VERSION = 1
MAX_FRAME = 8 << 20  # bytes; the largest message is `hello` with the parameter layout
_LEN = struct.Struct(">I")
CHECKPOINT_FORMAT = 1
METRICS_INTERVAL = 1.0  # seconds between metrics messages (also the worker's heartbeat)


# --- wire messages ----------------------------------------------------------------------------------------


@dataclass
class Init:
    config: dict[str, Any]
    home: str
    peer_id: str
    log_level: str = "info"


@dataclass
class Hello:
    pid: int
    numel: int
    layout: list[list[Any]]  # [[name, [dims...]], ...]
    task: str
    device: str
    model_hash: str
    layout_hash: str
    step: int
    outer_step: int
    resumed_from: str | None
    rejected: list[str] = field(default_factory=list)  # "path: reason" for each corrupt checkpoint


@dataclass
class Attach:
    names: dict[str, str]


@dataclass
class Publish:
    outer_step: int
    step: int
    inner_steps: int = 0  # inner steps this Delta covers (since the previous publish)
    samples: int = 0  # sequences those steps trained on: the weight of this Delta in a pair's mean


@dataclass
class Result:
    outer_step: int
    group_size: int
    # The outer step to continue from when larger than ours: the group's largest (n >= 2), or for a solo
    # step the largest that ready trainers showed the daemon meanwhile (node/averager.py).
    group_outer_step: int | None = None
    adopt: str = ""  # a swarm snapshot file to adopt instead of this outer step (a catch-up)
    adopt_outer_step: int | None = None  # the swarm's outer step to continue from with the snapshot
    partner_samples: int = 0  # a pair's other member's samples (0: unknown, plain mean)
    period_s: float = 0.0  # the swarm's pace: seconds between two publishes (0: every H inner steps)
    shift_s: float = 0.0  # move the next publish by this much, to meet the swarm's phase


@dataclass
class Adopted:
    """The answer to a result with `adopt`: the counters before and after, or why it was not adopted."""

    previous_step: int
    previous_outer_step: int
    step: int
    outer_step: int
    donors: list[str] = field(default_factory=list)
    val_loss: float | None = None
    error: str = ""


@dataclass
class Metrics:
    step: int
    outer_step: int
    loss: float | None
    val_loss: float | None
    samples_per_s: float
    lr: float


@dataclass
class CheckpointSaved:
    step: int
    outer_step: int
    path: str


@dataclass
class Stop:
    pass


@dataclass
class Stopped:
    step: int
    outer_step: int


@dataclass
class Fatal:
    error: str


Message = (
    Init | Hello | Attach | Publish | Result | Adopted | Metrics | CheckpointSaved | Stop | Stopped | Fatal
)
_TYPES: dict[str, type] = {
    "init": Init, "hello": Hello, "attach": Attach, "publish": Publish, "result": Result, "adopted": Adopted,
    "metrics": Metrics, "checkpoint": CheckpointSaved, "stop": Stop, "stopped": Stopped, "fatal": Fatal,
}
_NAMES = {cls: name for name, cls in _TYPES.items()}


class ProtocolError(Exception):
    """A malformed frame or message on the daemon-worker channel (a bug on one side, or a stray writer)."""


def encode_message(msg: Message) -> bytes:
    body = msgpack.packb({"v": PROTOCOL_VERSION, "t": _NAMES[type(msg)], **dataclasses.asdict(msg)})
    return _LEN.pack(len(body)) + body


def decode_body(body: bytes) -> Message:
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:
        raise ProtocolError(f"undecodable frame: {e}") from None
    if not isinstance(obj, dict) or obj.pop("v", None) != PROTOCOL_VERSION:
        raise ProtocolError("frame is not a versioned map")
    cls = _TYPES.get(obj.pop("t", None))  # type: ignore[arg-type]
    if cls is None:
        raise ProtocolError("unknown message type")
    names = {f.name for f in dataclasses.fields(cls)}
    if not set(obj) <= names:
        raise ProtocolError(f"unexpected fields in {cls.__name__}: {sorted(set(obj) - names)}")
    try:
        return cls(**obj)
    except TypeError as e:
        raise ProtocolError(f"bad {cls.__name__}: {e}") from None


class FrameBuffer:
    """Accumulates bytes and splits off complete frames (bounded by MAX_FRAME)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next_message(self) -> Message | None:
        if len(self._buf) < _LEN.size:
            return None
        (size,) = _LEN.unpack_from(self._buf)
        if size > MAX_FRAME:
            raise ProtocolError(f"frame of {size} bytes exceeds the {MAX_FRAME}-byte limit")
        if len(self._buf) < _LEN.size + size:
            return None
        body = bytes(self._buf[_LEN.size : _LEN.size + size])
        del self._buf[: _LEN.size + size]
        return decode_body(body)


class DaemonGone(Exception):
    """End of file on the control socket: the daemon died or closed it."""


class WorkerChannel:
    """The worker's blocking end of the control socket, with a poll for use between training steps."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self._sock = sock
        self._frames = FrameBuffer()

    def send(self, msg: Message) -> None:
        try:
            self._sock.sendall(encode_message(msg))
        except (BrokenPipeError, ConnectionResetError) as e:
            raise DaemonGone(str(e)) from None

    def receive(self, timeout: float) -> Message | None:
        """The next message, waiting at most `timeout` seconds (0 = just poll); None if none came."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self._frames.next_message()
            if msg is not None:
                return msg
            remaining = max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([self._sock], [], [], remaining)
            if not readable:
                return None
            try:
                data = self._sock.recv(1 << 16)
            except ConnectionResetError:
                data = b""
            if not data:
                raise DaemonGone("control socket closed")
            self._frames.feed(data)

    def close(self) -> None:
        self._sock.close()


# --- the training core ------------------------------------------------------------------------------------


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to `lr`, then cosine down to `min_lr_ratio * lr` at `total_steps`, flat after."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.total_steps - cfg.warmup))
    floor = cfg.min_lr_ratio
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


class Trainer:
    """Model, inner optimizer, slow weights, outer optimizer and counters of one replica; no I/O policy.

    The process loop (`run_worker`) decides *when* to step, publish, apply and checkpoint; this class only
    does each of those correctly, which keeps it testable in-process.
    """

    def __init__(self, cfg: TrainConfig, home: Path, peer_id: str) -> None:
        self.cfg = cfg
        self.home = home
        self.device = resolve_device(cfg.device)
        self.task = load_task(cfg.task, TaskContext(cfg, peer_id, self.device))
        self.model = self.task.build_model()
        self.model.train()
        self.params = [p for _, p in self.model.named_parameters() if p.requires_grad]
        self.layout: Layout = param_layout(self.model)
        self.numel = sum(p.numel() for p in self.params)
        self.model_hash = model_hash(self.task)
        self.layout_hash = layout_hash(self.layout)
        # Plain Adam, no weight decay, as in the paper; its state is never averaged nor reset.
        self.optimizer = torch.optim.Adam(self.params, lr=cfg.lr)
        self.stream = self.task.train_stream()
        self.outer = OuterOptimizer(cfg.outer, OuterHyper(cfg.alpha, cfg.beta, cfg.gamma), self.numel)
        # fp32 CPU master copies: slow weights, the fast weights at publish time, and scratch space.
        self.phi = torch.empty(self.numel, dtype=torch.float32)
        self.theta_published = torch.empty(self.numel, dtype=torch.float32)
        self._scratch = torch.empty(self.numel, dtype=torch.float32)
        self.gather_theta(self.phi)

        self.step = 0  # inner steps taken, ever (the lr schedule and checkpoint names use it)
        self.outer_step = 0  # outer steps applied
        self.last_publish_step = 0  # inner step of the latest publish (the next one is H later)
        # Pacing by the swarm (see publish_due): the daemon's period, when the next publish is due on this
        # process's monotonic clock, and this machine's measured seconds per inner step.
        self.period_s = 0.0
        self.next_publish_at: float | None = None
        self.step_time_s: float | None = None
        self.published_samples = 0
        # Seconds per inner step over whole outer steps, the outer step's own work (evaluation, publish,
        # apply) included and the time blocked on a lagging result excluded: what this machine reports
        # as its speed, so that the swarm's pace gives the fastest machine time for H steps in full.
        self.phase_step_s: float | None = None
        self.blocked_s = 0.0
        self._last_publish_time: float | None = None
        self.pending: int | None = None  # outer step of the publish awaiting its result
        self._publish_before_pending = 0
        self.val_loss: float | None = None
        self.skipped_steps = 0  # inner steps skipped because the loss was not finite

        # One directory per model: a changed architecture starts fresh instead of tripping over old files.
        ckpt_dir = home / "checkpoints" / f"{self.task.name}-{self.model_hash[:12]}"
        self.checkpoints = CheckpointStore(ckpt_dir, cfg.checkpoints_keep)

    # -- flat views --

    def gather_theta(self, out: torch.Tensor) -> None:
        """Copy the model's parameters into the flat fp32 CPU tensor `out`."""
        offset = 0
        for p in self.params:
            n = p.numel()
            out[offset : offset + n].copy_(p.detach().reshape(-1))
            offset += n

    def scatter_theta(self, src: torch.Tensor) -> None:
        """Copy the flat tensor `src` into the model's parameters."""
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(src[offset : offset + n].view_as(p))
                offset += n

    # -- the inner step --

    def inner_step(self) -> float:
        """One Adam step on the next batch; returns the loss (a non-finite loss skips the update)."""
        began = time.perf_counter()
        try:
            return self._inner_step()
        finally:
            took = time.perf_counter() - began
            self.step_time_s = took if self.step_time_s is None else 0.9 * self.step_time_s + 0.1 * took

    def _inner_step(self) -> float:
        lr = lr_at(self.cfg, self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = self.stream.next_batch()
        with autocast(self.device):
            loss = self.task.loss(self.model, batch)
        self.optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach())
        self.step += 1
        if not math.isfinite(value):
            self.skipped_steps += 1
            log.warning("inner step %d: loss is %s; update skipped", self.step, value)
            return value
        loss.backward()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.optimizer.step()
        return value

    # -- the outer step --

    def publish_due(self, now: float | None = None) -> bool:
        """Whether to publish now: after H inner steps, or, when the daemon sets a pace (`period_s`), when
        the period since the last publish is up, whichever machine this is.

        Why pace by time: with a fixed H a machine k times slower makes k times fewer outer steps, falls out
        of every faster partner's step gap and forms an island of its own. Paced by the swarm (the period is
        H inner steps of the swarm's fastest trainer, node/daemon.py), every trainer makes outer steps at
        the same rate and a slower one simply covers fewer inner steps in each (dynamic local updates, Liu
        et al. 2024, "Asynchronous Local-SGD Training for Language Modeling"); its Delta then counts in
        proportion to its samples (node/outer.py, `PairWeights`). The fastest trainer still takes about H.
        A step is taken only if it ends nearer the deadline than not (half a step's time early is on time),
        and never more than 2H steps go into one outer step (a stale pace after the fastest trainer left)."""
        if self.pending is not None:
            return False
        done = self.step - self.last_publish_step
        if self.period_s <= 0 or self.next_publish_at is None:
            return done >= self.cfg.inner_steps
        if done < 1:
            return False
        if done >= 2 * self.cfg.inner_steps:
            return True
        now = time.monotonic() if now is None else now
        return now + (self.step_time_s or 0.0) / 2 >= self.next_publish_at

    def lag(self) -> int:
        """Inner steps taken since the pending publish (0 when nothing is pending)."""
        return 0 if self.pending is None else self.step - self.last_publish_step

    def publish(self, phi_out: torch.Tensor, delta_out: torch.Tensor) -> Publish:
        """Write phi and Delta = theta - phi (into the shared slots) and remember theta for the rebase."""
        self.gather_theta(self.theta_published)
        phi_out.copy_(self.phi)
        torch.sub(self.theta_published, self.phi, out=delta_out)
        inner_steps = self.step - self.last_publish_step
        self._publish_before_pending = self.last_publish_step
        self.last_publish_step = self.step
        self.pending = self.outer_step
        self.published_samples = inner_steps * self.cfg.batch_size
        now = time.monotonic()
        if self._last_publish_time is not None and inner_steps > 0:
            per_step = max(now - self._last_publish_time - self.blocked_s, 1e-6) / inner_steps
            self.phase_step_s = per_step if self.phase_step_s is None else 0.7 * self.phase_step_s + 0.3 * per_step
        self._last_publish_time, self.blocked_s = now, 0.0
        if self.period_s > 0:
            self.next_publish_at = now + self.period_s
        return Publish(outer_step=self.outer_step, step=self.step, inner_steps=inner_steps,
                       samples=self.published_samples)

    def samples_per_s(self) -> float:
        """This machine's training speed: sequences per second over whole outer steps (`phase_step_s`),
        or of the inner steps alone before the first outer step has been timed."""
        per_step = self.phase_step_s or self.step_time_s
        return self.cfg.batch_size / per_step if per_step else 0.0

    def set_pace(self, period_s: float, shift_s: float = 0.0) -> None:
        """Take the daemon's pace for the next outer steps (0: every H inner steps) and move the pending
        deadline by `shift_s` (towards the partner's phase, node/averager.py)."""
        if period_s <= 0 or not math.isfinite(period_s):
            self.period_s, self.next_publish_at = 0.0, None
            return
        if self.next_publish_at is None:
            # The first pace: the current phase began at the last publish (not now: a result that came after
            # a whole pairing window would otherwise push this node's phase that much behind its partners').
            began = self._last_publish_time if self._last_publish_time is not None else time.monotonic()
            self.next_publish_at = began + period_s
        elif self.period_s > 0 and period_s != self.period_s:
            self.next_publish_at += period_s - self.period_s
        self.period_s = period_s
        if math.isfinite(shift_s):
            self.next_publish_at += max(-period_s / 2, min(period_s / 2, shift_s))

    def apply_result(
        self,
        group_size: int,
        sum_phi: torch.Tensor | None = None,
        sum_delta: torch.Tensor | None = None,
        group_outer_step: int | None = None,
        partner_samples: int = 0,
    ) -> int:
        """Apply the outer step for the pending publish and rebase the fast weights; returns the group
        size actually used (a group result with non-finite sums falls back to a solo step). `sum_phi` and
        `sum_delta` are the group's sums over its `group_size` members, this one included.

        After a group step the outer-step counter continues from the group's largest one
        (`group_outer_step`), as the partner's does: counters of paired nodes stay together. A solo step
        follows a `group_outer_step` too (the largest the daemon saw among ready trainers), so that a node
        that sat out keeps the counter that keys the pairing schedule. The inner
        `step` (and so the learning rate) is this node's own and does not change."""
        if self.pending is None:
            raise RuntimeError("apply_result without a pending publish")
        if group_size >= 2:
            if sum_phi is None or sum_delta is None:
                raise ValueError("a group result needs sum_phi and sum_delta")
            if not (bool(torch.isfinite(sum_phi).all()) and bool(torch.isfinite(sum_delta).all())):
                log.warning("outer step %d: group sums are not finite; taking a solo step", self.outer_step)
                group_size = 1
        own_delta = torch.sub(self.theta_published, self.phi, out=self._scratch)
        samples = (self.published_samples, partner_samples) if group_size == 2 and partner_samples > 0 else None
        self.outer.step(self.phi, own_delta, group_size=group_size, sum_phi=sum_phi, sum_delta=sum_delta,
                        samples=samples)
        # theta <- phi_new + (theta_now - theta_published): keep what was learnt while the exchange ran.
        theta = self._scratch
        self.gather_theta(theta)
        theta.sub_(self.theta_published).add_(self.phi)
        self.scatter_theta(theta)
        published_at = self.pending
        self.pending = None
        if group_outer_step is not None:
            published_at = max(published_at, group_outer_step)
        self.outer_step = published_at + 1
        return group_size

    def evaluate(self) -> float:
        self.val_loss = self.task.evaluate(self.model)
        return self.val_loss

    # -- checkpoints --

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly; a publish still in flight is treated as not made
        (phi is the pre-exchange one and theta has all progress, so the next publish carries it)."""
        last_publish = self._publish_before_pending if self.pending is not None else self.last_publish_step
        rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "format": CHECKPOINT_FORMAT,
            "task": self.task.name,
            "model_hash": self.model_hash,
            "layout_hash": self.layout_hash,
            "step": self.step,
            "outer_step": self.outer_step,
            "last_publish_step": last_publish,
            "model": self.model.state_dict(),
            "phi": self.phi,
            "outer": self.outer.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "data": self.stream.state_dict(),
            "rng": rng,
            "val_loss": self.val_loss,
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """Reject (with CheckpointError) a checkpoint that verifies but does not belong to this model."""
        if state.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"unknown checkpoint format {state.get('format')!r}")
        if state.get("model_hash") != self.model_hash or state.get("layout_hash") != self.layout_hash:
            raise CheckpointError("checkpoint is for a different model")
        phi = state.get("phi")
        if not isinstance(phi, torch.Tensor) or phi.shape != self.phi.shape:
            raise CheckpointError("slow weights have the wrong size")
        for key in ("model", "outer", "optimizer", "data", "rng"):
            if not isinstance(state.get(key), dict):
                raise CheckpointError(f"checkpoint lacks {key}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.phi.copy_(state["phi"])
        self.outer.load_state_dict(state["outer"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.stream.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["cpu"])
        if self.device.type == "cuda" and "cuda" in state["rng"]:
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        self.step = int(state["step"])
        self.outer_step = int(state["outer_step"])
        self.last_publish_step = int(state["last_publish_step"])
        self.pending = None
        self.val_loss = state.get("val_loss")

    def save_checkpoint(self) -> Path:
        return self.checkpoints.save(self.state_dict(), self.step)

    def read_swarm_snapshot(self, path: Path) -> dict[str, Any]:
        """A snapshot the daemon downloaded from the swarm (node/latejoin.py), checked to be of this model;
        CheckpointError otherwise."""
        state = read_checkpoint(path)
        phi = state.get("phi")
        if state.get("layout_hash") != self.layout_hash or not isinstance(phi, torch.Tensor) or phi.numel() != self.numel:
            raise CheckpointError("the swarm snapshot is for a different model")
        for key in ("step", "outer_step"):
            if not isinstance(state.get(key), int) or state[key] < 0:
                raise CheckpointError(f"the swarm snapshot has no valid {key}")
        return state

    def _take_swarm_weights(self, state: dict[str, Any], outer_step: int) -> None:
        """phi and theta = the snapshot's slow weights, counters from the snapshot, nothing pending."""
        self.phi.copy_(state["phi"].reshape(-1))
        self.scatter_theta(self.phi)
        self.step = int(state["step"])
        self.outer_step = outer_step
        self.last_publish_step = self.step
        self.pending = None

    def start_from_join_snapshot(self) -> Path | None:
        """A late joiner's first start: slow and fast weights and step counters from the swarm snapshot the
        daemon downloaded (node/latejoin.py); its own data shard, RNG and a fresh inner optimizer. The
        snapshot is consumed (renamed) so that later restarts use this node's own checkpoints."""
        path = self.home / "join" / "snapshot.pt"
        if not path.exists():
            return None
        try:
            state = self.read_swarm_snapshot(path)
        except CheckpointError as e:
            log.warning("not starting from %s: %s", path, e)
            path.rename(path.with_name(path.name + ".rejected"))
            return None
        self._take_swarm_weights(state, int(state["outer_step"]))
        path.rename(path.with_name(path.name + ".used"))
        # Measure the downloaded weights before the first inner step: the first validation loss this node
        # reports is then the swarm's (what the user checks a late join by), not a figure taken after H
        # steps of a fresh inner optimizer.
        self.evaluate()
        log.info("starting from the swarm snapshot of %d donors at step %d (outer step %d): validation loss %.3f",
                 len(state.get("donors", [])), self.step, self.outer_step, self.val_loss)
        return path

    def adopt_snapshot(self, path: Path, outer_step: int | None = None) -> Adopted:
        """A catch-up: continue from the swarm's weights instead of this node's own (which drifted too far
        from everyone else's to average with). Replaces the pending outer step; the file is consumed.

        Taken: the slow weights as both phi and theta, the snapshot's inner `step` (so the learning-rate
        schedule is the swarm's) and `outer_step` (the swarm's current one when the daemon knows it, so
        that the node pairs again at once; the weights are at most a checkpoint interval older, which the
        next averaging's pull closes). Reset: the outer momentum, because it is the direction of this
        node's own solo trajectory, which is abandoned; carrying it would push the swarm's weights along
        it. Kept: the inner Adam state, because a fresh Adam at the (post warm-up) learning rate takes
        sign-sized steps on every parameter in its first iterations, while the kept moments are those of
        the same model on the same task and decay within their own horizons (about 10 and 1000 steps).
        Also kept: this node's data shard and RNG. Checkpoints of later inner steps than the snapshot's (a
        node that ran ahead) are deleted, or a restart would resume from them and undo the catch-up.

        Raises CheckpointError (nothing changed) if the snapshot is unreadable or of another model.
        """
        state = self.read_swarm_snapshot(path)
        before = (self.step, self.outer_step)
        self._take_swarm_weights(state, int(state["outer_step"]) if outer_step is None else outer_step)
        self.outer.momentum.zero_()
        # From here on the adoption has happened: a file that cannot be removed is worth a warning only.
        try:
            path.unlink(missing_ok=True)
            for step, old in self.checkpoints.checkpoints():
                if step > self.step:
                    old.unlink(missing_ok=True)
        except OSError as e:
            log.warning("after the catch-up: %s", e)
        self.evaluate()
        log.info("caught up with the swarm from the mean of %d donors: outer step %d -> %d, step %d -> %d, "
                 "validation loss %.3f", len(state.get("donors", [])), before[1], self.outer_step, before[0],
                 self.step, self.val_loss)
        return Adopted(previous_step=before[0], previous_outer_step=before[1], step=self.step,
                       outer_step=self.outer_step, donors=[str(d) for d in state.get("donors", [])],
                       val_loss=self.val_loss)

    def resume(self) -> tuple[Path | None, list[str]]:
        """Load the newest good checkpoint, if any: (its path, ["path: reason" for rejected ones])."""
        result = self.checkpoints.load_latest(check=self.check_state)
        rejected = [f"{path}: {why}" for path, why in result.rejected]
        loaded = result.checkpoint
        if loaded is None:
            return self.start_from_join_snapshot(), rejected
        try:
            self.load_state_dict(loaded.state)
        except Exception as e:
            # The state is half-applied now, so this process cannot go on; set the file aside so that
            # the restarted worker falls back to the previous checkpoint instead of failing again.
            self.checkpoints.discard(loaded.path, f"does not load into the model: {type(e).__name__}: {e}")
            raise CheckpointError(f"checkpoint {loaded.path} does not load; restarting without it") from e
        return loaded.path, rejected


# --- the process loop -------------------------------------------------------------------------------------


class _StopFlag:
    """Set by SIGTERM/SIGINT; checked between steps so a signal never interrupts a step half-way."""

    def __init__(self) -> None:
        self.set = False

    def __call__(self, signum: int, frame: Any) -> None:
        self.set = True


class _Meter:
    """Loss and throughput over the interval since the last metrics message."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.started = time.monotonic()
        self.losses: list[float] = []

    def due(self) -> bool:
        return time.monotonic() - self.started >= METRICS_INTERVAL


def run_worker(chan: WorkerChannel, init: Init, stop: _StopFlag) -> int:
    """Build the trainer, resume, and train until told to stop; returns the process exit code."""
    try:
        cfg = TrainConfig(**init.config)
        cfg.validate()
    except (TypeError, ValueError) as e:
        chan.send(Fatal(f"bad train config: {e}"))
        return 2
    torch.set_num_threads(cfg.threads)
    try:
        trainer = Trainer(cfg, Path(init.home), init.peer_id)
    except TaskError as e:
        log.error("%s", e, exc_info=e.__cause__ is not None)
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
        return 0
    slots = ExchangeSlots.attach(attach.names, trainer.numel)
    try:
        return _train(chan, trainer, slots, stop)
    finally:
        slots.close()


def _wait_for(chan: WorkerChannel, kind: type, *, timeout: float, stop: _StopFlag) -> Any:
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
            raise ProtocolError(f"expected {kind.__name__}, got {type(msg).__name__}")
    if stop.set:
        return None
    raise ProtocolError(f"no {kind.__name__} from the daemon within {timeout:.0f}s")


def _train(chan: WorkerChannel, trainer: Trainer, slots: ExchangeSlots, stop: _StopFlag) -> int:
    cfg = trainer.cfg
    meter = _Meter()
    try:
        while not stop.set:
            # 1. Take in whatever the daemon said; block for the outer result if it lags too far behind.
            must_wait = trainer.pending is not None and (not cfg.overlap or trainer.lag() >= cfg.max_lag)
            waiting_since = time.monotonic()
            msg = chan.receive(timeout=0.5 if must_wait else 0.0)
            if must_wait:
                trainer.blocked_s += time.monotonic() - waiting_since
            if isinstance(msg, Stop):
                break
            if isinstance(msg, Result):
                _on_result(chan, trainer, slots, msg)
            elif msg is not None:
                log.warning("ignoring unexpected %s from the daemon", type(msg).__name__)
            elif trainer.publish_due():
                # 2. Publish every H inner steps (only one outer exchange in flight at a time).
                chan.send(trainer.publish(slots.phi.tensor, slots.delta.tensor))
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
    used = trainer.apply_result(msg.group_size, slots.phi_out.tensor, slots.delta_out.tensor, msg.group_outer_step,
                                partner_samples=msg.partner_samples)
    trainer.set_pace(msg.period_s, msg.shift_s)
    log.debug("outer step %d applied (group of %d)", trainer.outer_step, max(1, used))
    if trainer.outer_step % trainer.cfg.eval_every == 0:
        trainer.evaluate()
    if trainer.outer_step % trainer.cfg.checkpoint_every == 0:
        _checkpoint(chan, trainer)


def _adopt(chan: WorkerChannel, trainer: Trainer, msg: Result) -> None:
    """A catch-up instead of this outer step; a snapshot that cannot be used means a solo step."""
    previous = (trainer.step, trainer.outer_step)
    try:
        adopted = trainer.adopt_snapshot(Path(msg.adopt), msg.adopt_outer_step)
    except CheckpointError as e:
        log.warning("not adopting the swarm snapshot %s: %s; taking a solo step", msg.adopt, e)
        trainer.apply_result(1)
        chan.send(Adopted(previous_step=previous[0], previous_outer_step=previous[1], step=trainer.step,
                          outer_step=trainer.outer_step, error=str(e)[:300]))
        return
    chan.send(adopted)
    # At once, not at the next interval: a restart must not resume from the abandoned weights.
    _checkpoint(chan, trainer)


def _checkpoint(chan: WorkerChannel, trainer: Trainer) -> None:
    try:
        path = trainer.save_checkpoint()
    except OSError as e:
        # A full or failing disk: the previous checkpoint is intact (atomic write). Crashing would
        # only restart from it, lose the progress since, and fail again: keep training instead.
        log.error("checkpoint at step %d failed: %s; the previous checkpoint is kept, training goes on",
                  trainer.step, e)
        return
    chan.send(CheckpointSaved(step=trainer.step, outer_step=trainer.outer_step, path=str(path)))


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
            lr=lr_at(trainer.cfg, trainer.step),
        )
    )
    meter.reset()


def _final_checkpoint(chan: WorkerChannel | None, trainer: Trainer) -> None:
    try:
        path: Path | None = trainer.save_checkpoint()
        log.info("checkpoint %s written at step %d (outer step %d)", path, trainer.step, trainer.outer_step)
    except OSError as e:
        path = None
        log.error("final checkpoint at step %d failed: %s; the previous checkpoint is kept", trainer.step, e)
    if chan is not None:
        try:
            if path is not None:
                chan.send(CheckpointSaved(step=trainer.step, outer_step=trainer.outer_step, path=str(path)))
            chan.send(Stopped(step=trainer.step, outer_step=trainer.outer_step))
        except DaemonGone:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m node.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True, help="this end of the daemon's control socketpair")
    args = parser.parse_args(argv)
    stop = _StopFlag()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    chan = WorkerChannel(socket.socket(fileno=args.fd))
    try:
        init = chan.receive(timeout=60.0)
        if not isinstance(init, Init):
            print("worker: no init message from the daemon", file=sys.stderr)
            return 2
        _setup_logging(init.log_level)
        return run_worker(chan, init, stop)
    except DaemonGone:
        return 0
    finally:
        chan.close()


def _setup_logging(level: str) -> None:
    try:
        from node.logs import setup_logging
    except ImportError:  # keep the worker usable without the daemon's helpers
        logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO))
    else:
        setup_logging(level)


if __name__ == "__main__":
    sys.exit(main())

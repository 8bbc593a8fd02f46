"""The worker's training core: `Trainer`, one replica's inner optimizer steps, outer step, slow weights,
counters and checkpoints, with no I/O policy.

Why a module apart from the process loop (node/worker/loop.py, the conversation with the daemon): the loop
decides *when* to step, publish, apply and checkpoint; this module only does each of those correctly, so
that the worker group (node/worker/group.py subclasses `Trainer`), the benchmarks and the tests drive it
in-process, without a daemon or a socket.

The inner/outer loop (overlap mode, the default): after H inner steps the worker writes `phi` and
`Delta = theta - phi` into shared memory, says `publish`, and keeps training. When the result arrives it
applies the outer step to `phi` and keeps the progress made meanwhile:
`theta <- theta_now + (phi_new - theta_published)`, however late it comes: by default (`max_lag` = 0)
training never waits for it. Why: on a slow link one exchange can take many times H inner steps (a
1B-parameter model's outer step moves GBs), and a worker that waited idled for most of its time (3-6% of
its compute on 0.4-2 Mbit/s links). Instead the outer step stretches: the next publish comes only once
the result is applied (one exchange in flight), so its Delta covers the steps taken meanwhile and the
outer steps go at the pace the wire allows; the delayed result is applied with the same rebase (the
"eager"/overlapped outer step of Streaming DiLoCo, here one outer step or more late). A `max_lag` > 0
makes training wait once the result lags that many inner steps; `overlap = false` waits right away (the
blocking baseline).

Streaming fragments (issue #23; `set_fragments`, `publish_fragment`, `apply_result(fragment=...)`): the
flat vector cut into F contiguous block-aligned fragments, each published, exchanged and applied on its own
(its Delta, phi, outer step, error feedback and rebase on its slice), one publish in flight per fragment and
several fragments at once. Why: at a given link rate a fragment's transfer is F times shorter, so a result
that comes late is F times fresher (docs/benchmarks.md, "Streaming fragments (tried)"). No buffer beyond the
whole-vector path's: each fragment writes its own slice of theta_published, phi, the momentum and the
residual. Each fragment keeps its own outer-step count; `outer_step` is then the lowest of them.

Outer-step counters. After an exchange the worker continues from the larger of the two partners' outer
steps, so paired nodes keep the same counter. A node that fell too far from the swarm to pair gets a
catch-up instead of a result: the daemon downloaded the swarm's weights (node/averaging/latejoin.py, `CatchUp`) and
the worker adopts them at that outer step (`Trainer.adopt_snapshot`). The learning-rate schedule follows
the inner `step`, which only a snapshot changes.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import statistics
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from node.bridge.exchange import ExchangeOutcome
from node.bridge.ipc import (
    Adopted,
    Publish,
)
from node.config.home import Home
from node.config.train import TrainConfig
from node.worker.checkpoint import CheckpointError, CheckpointStore, read_checkpoint
from node.worker.outer import OuterHyper, OuterOptimizer
from node.worker.task import (
    Layout,
    TaskError,
    autocast,
    layout_hash,
    load_task,
    model_hash,
    param_layout,
    resolve_device,
    resolve_precision,
    task_context,
)
from protocols.codec import PASS_ELEMS, round_trip
from protocols.compress import Compression, get_compression, stream_fragment_range

log = logging.getLogger("starling.worker")

# 2: the inner optimizer became AdamW with two param groups (weight decay on matrices only) and an fp16
# run's GradScaler state is kept; format-1 checkpoints (plain Adam, one group) still load.
CHECKPOINT_FORMAT = 2
READABLE_FORMATS = (1, 2)
PHASE_WINDOW = 5  # outer steps whose median is this machine's speed (Trainer.samples_per_s)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to `lr`, then cosine down to `min_lr_ratio * lr` at `total_steps`, flat after."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.total_steps - cfg.warmup))
    floor = cfg.min_lr_ratio
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def default_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay `cfg.weight_decay` on weight matrices (parameters of 2 or more
    dimensions) and none on biases, norm gains and other vectors, as GPT-style training does: decaying a
    LayerNorm gain or a bias towards 0 only fights the normalisation. The decayed group comes first.
    With `weight_decay = 0` this is plain Adam, the NoLoCo paper's inner optimizer."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    plain = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr)


def all_finite(t: torch.Tensor) -> bool:
    """Whether `t` holds no NaN and no infinity, in one read-only pass: any of them makes the sum non-finite.

    Why not ``torch.isfinite(t).all()``: that writes a model-sized bool tensor and reads it again, and this
    check runs on every group result in the worker's own thread (train.threads, 1 by default): on 25M
    elements and one thread the sum took 9 ms where isfinite + all took 224 ms, and at 100M parameters the two
    checks were most of the outer step's host time on a GPU host (bench/gpu.py). A sum beyond fp32's range
    (finite values near 1e38) reads as non-finite too: such a result is as unusable, refused the same way."""
    return math.isfinite(float(t.sum()))


def outer_threads(cfg: TrainConfig, device: torch.device) -> int:
    """Torch CPU threads for the outer step's host work: `train.outer_threads`, or with 0 (auto) half this
    machine's cores up to 8 on CUDA and `train.threads` on the CPU.

    Why more on a GPU host: the outer step reads and writes the fp32 master copies on the host (12-20 bytes
    per parameter per pass), which on one thread is memory-bound at a few GB/s: at 100M parameters
    applying a pair's result took 0.74 s on an H200 host, against 0.72 s for the H = 50 inner steps it
    follows (bench/gpu.py, docs/benchmarks.md "On a GPU"). The inner steps run on the GPU and need no CPU
    threads, so the cores are idle then. On the CPU the inner steps use `train.threads` and the daemon the
    rest, so the outer step takes the same."""
    if cfg.outer_threads > 0:
        return cfg.outer_threads
    if device.type != "cuda":
        return cfg.threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(cfg.threads, min(8, cores // 2))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with `n` torch CPU threads, then restore the count: the inner steps keep theirs (more
    threads there would spin beside the daemon for nothing on a GPU host)."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _continued_count(published_at: int, outcome: ExchangeOutcome, group_size: int) -> int:
    """The outer step an applied result counts from: the publish's, or the group's largest where that is
    further (`group_outer_step`: paired counters stay together); a solo step's `exact_outer_step` sets it
    outright, lower too (a catch-up, node/averaging/latejoin.py). `group_size`: the size actually used."""
    if outcome.group_outer_step is not None:
        published_at = max(published_at, outcome.group_outer_step)
    if outcome.exact_outer_step is not None and group_size < 2:
        published_at = max(0, outcome.exact_outer_step)
    return published_at


@dataclass(frozen=True)
class InFlight:
    """A streaming fragment's publish awaiting its result (`Trainer.publish_fragment`): at most one per
    fragment, several fragments at once."""

    outer_step: int  # the fragment's own outer-step count at the publish: its result continues from it
    step: int  # the inner step of the publish
    previous_step: int  # the fragment's publish before this one: a checkpoint treats this one as not made
    samples: int  # sequences the fragment's Delta covers (its weight in a pair's mean)


def feed_back_own_in_full(own: torch.Tensor, residual: torch.Tensor, sum_delta: torch.Tensor,
                          compression: Compression) -> None:
    """Error feedback for a preset that applies our own Delta in full (`Compression.own_in_full`).

    On entry ``own = Delta + e`` (what was published), ``residual = e`` and ``sum_delta = Q(Delta + e) +
    partner's``, as the wire carried them. On return ``residual = (Delta + e) - Q(Delta + e)``, the same
    bits as plain error feedback (the partner still gets, later, what the wire has not carried yet), but
    ``own = Delta`` and ``sum_delta = Delta + partner's``: this replica's step takes its own update whole
    and at once, where plain error feedback deferred all but the top entries of it (e was applied here
    when it was learnt, so it is not applied again). Why: bench/phi_schemes.py, `+own`: a replica that
    waited for its own progress to come back through the wire trained worse than one that never joined.

    In pieces of whole codec blocks (as `round_trip` cuts them, so Q has the wire's bits): a piece-sized
    temporary, no model-sized one."""
    codec = compression.delta_codec("bf16")
    step = max(1, PASS_ELEMS // codec.align) * codec.align
    wire = torch.empty(min(step, own.numel()), dtype=torch.float32)
    for lo in range(0, own.numel(), step):
        hi = min(lo + step, own.numel())
        o, e, s, q = own[lo:hi], residual[lo:hi], sum_delta[lo:hi], wire[: hi - lo]
        round_trip(codec, o, q)  # Q(Delta + e): our term of the sum, as the wire carried it
        s.add_(o).sub_(q).sub_(e)  # Q + partner + (Delta + e) - Q - e = Delta + partner
        q.neg_().add_(o)  # (Delta + e) - Q(Delta + e): plain error feedback's residual, bit for bit
        o.sub_(e)  # Delta
        e.copy_(q)


class Trainer:
    """Model, inner optimizer, slow weights, outer optimizer and counters of one replica; no I/O policy.

    The process loop (node/worker/loop.py `run_worker`) decides *when* to step, publish, apply and checkpoint; this class only
    does each of those correctly, which keeps it testable in-process.
    """

    def __init__(
        self, cfg: TrainConfig, home: Path, peer_id: str, task_options: Mapping[str, Any] | None = None,
        *, rank: int = 0, world_size: int = 1, slow_weights: bool = True,
    ) -> None:
        """`slow_weights=False`: this process takes no outer step and keeps none of the fp32 master copies
        (phi, theta at publish, outer momentum: 12 bytes per parameter). A worker group's ranks 1.. are
        built so; only rank 0 publishes and applies results (node/worker/group.py)."""
        self.cfg = cfg
        self.home = home
        self.device = resolve_device(cfg.device)
        self.precision = resolve_precision(cfg.precision, self.device)
        self.host_threads = outer_threads(cfg, self.device)  # for publish and apply_result
        self.task_options = dict(task_options or {})
        # The task sees the micro-batch as its batch size (TaskContext): accumulation is the trainer's.
        self.task = load_task(cfg.task, task_context(cfg, peer_id, self.device, self.task_options,
                                                     rank=rank, world_size=world_size))
        self.model = self.task.build_model()
        self.model.train()
        self.params = [p for _, p in self.model.named_parameters() if p.requires_grad]
        self.layout: Layout = param_layout(self.model)
        self.numel = sum(p.numel() for p in self.params)
        self.model_hash = model_hash(self.task, self.task_options)
        self.layout_hash = layout_hash(self.layout)
        # The inner optimizer's state is never averaged nor reset (see adopt_snapshot).
        self.optimizer = self._build_optimizer()
        # fp16 needs loss scaling (its range underflows small gradients); bf16 has fp32's range and does not.
        self.scaler = torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None
        self.stream = self.task.train_stream()
        self.slow_weights = slow_weights
        masters = self.numel if slow_weights else 0
        self.outer = OuterOptimizer(cfg.outer, OuterHyper(cfg.alpha, cfg.beta, cfg.gamma), masters)
        # fp32 CPU master copies: slow weights and the fast weights at publish time. The worker moves phi
        # into its shared phi slot (`share_phi`) and lends its Delta slot to the outer step (`apply_result`),
        # so a single worker keeps no model-sized scratch; `_scratch` is allocated only where it is used
        # without one (in-process trainers). See bench/memory.py.
        self.phi = torch.empty(masters, dtype=torch.float32)
        # Page-locked on a GPU host: the publish gathers theta from the device into it, and the rebase writes
        # it back, at about 4x the speed of pageable memory (bench/gpu.py, docs/benchmarks.md "On a GPU").
        self.theta_published = torch.empty(masters, dtype=torch.float32, pin_memory=self.device.type == "cuda")
        self._scratch_buf: torch.Tensor | None = None
        # Error feedback (`sync.compression` other than none): what the wire has not yet carried of our own
        # Deltas, added to the next one at publish. Model-sized fp32, allocated by the first lossy result.
        self.residual: torch.Tensor | None = None
        if slow_weights:
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
        # The median of the last PHASE_WINDOW outer steps: one-off costs (the first outer step's
        # allocations and, on a GPU, its pinned buffers and kernel warm-up; a checkpoint) are outliers that
        # an average kept for many outer steps (an EMA from the first phase read 65 samples/s on an H200
        # whose step counter made 536), and the pace derived from a stale speed is stale too.
        self._phase_steps: collections.deque[float] = collections.deque(maxlen=PHASE_WINDOW)
        self.phase_step_s: float | None = None
        self.blocked_s = 0.0
        self._last_publish_time: float | None = None
        self.pending: int | None = None  # outer step of the publish awaiting its result
        self._publish_before_pending = 0
        # Streaming fragments (`set_fragments`): None while the whole vector is synced at once (the
        # default); else the partition's [lo, hi) ranges, each fragment's own outer-step count and inner step
        # of its latest publish, and the publishes in flight by fragment index. Small lists: the only
        # model-sized state of a fragment is its slice of theta_published, phi, the momentum and the residual.
        self.fragments: list[tuple[int, int]] | None = None
        self.fragment_outer_steps: list[int] = []
        self.fragment_publish_steps: list[int] = []
        self.in_flight: dict[int, InFlight] = {}
        self.fragment_slot = 0  # the fragment whose slot comes next in the period (`fragment_due`)
        self.fragment_skips = 0  # slots passed without a publish: the fragment's previous result had not come
        self.val_loss: float | None = None
        self.skipped_steps = 0  # inner steps skipped because the loss was not finite

        # One directory per model: a changed architecture starts fresh instead of tripping over old files.
        ckpt_dir = Home(home).model_checkpoints(self.task.name, self.model_hash)
        self.checkpoints = CheckpointStore(ckpt_dir, cfg.checkpoints_keep)
        # The latest checkpoint tried (written or failed): the next one is due `checkpoint_every` outer steps
        # and `checkpoint_min_s` seconds later (`checkpoint_due`). None: none yet in this process.
        self._checkpoint_tried: tuple[int, float] | None = None  # (outer step, monotonic time)

    # -- flat views --

    @property
    def _scratch(self) -> torch.Tensor:
        """A model-sized fp32 scratch tensor, allocated on first use (a single worker never uses it)."""
        if self._scratch_buf is None:
            self._scratch_buf = torch.empty(self.numel, dtype=torch.float32)
        return self._scratch_buf

    def share_phi(self, buf: torch.Tensor) -> None:
        """Keep the slow weights in `buf` (the worker's shared phi slot) instead of a private copy.

        Why it is safe: the daemon only reads the phi slot, and only while an exchange is in flight, which
        lasts from a publish until its result (the supervisor answers only once the exchange has returned,
        its side-channel threads included); the worker changes phi only when no exchange is in flight
        (applying a result, adopting a snapshot). The publish's copy of phi into the slot then is a no-op.
        With streaming fragments the same holds slice by slice: a fragment's result changes phi on its own
        slice only, while other fragments may be in flight, so the daemon must read a fragment's slice alone."""
        if buf.shape != self.phi.shape or buf.dtype != self.phi.dtype:
            raise ValueError("the phi buffer must be a flat fp32 tensor of the model's size")
        if buf.data_ptr() != self.phi.data_ptr():
            buf.copy_(self.phi)
            self.phi = buf

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

    def _pieces(self, lo: int, hi: int) -> Iterator[tuple[torch.Tensor, int, int, int]]:
        """(parameter, a, b, flat offset of element a) for each parameter that overlaps [lo, hi) of the flat
        vector: its elements [a, b) lie there."""
        offset = 0
        for p in self.params:
            n = p.numel()
            a, b = max(lo, offset) - offset, min(hi, offset + n) - offset
            if a < b:
                yield p, a, b, offset + a
            offset += n
            if offset >= hi:
                return

    def gather_theta_range(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """Copy elements [lo, hi) of the flat parameter vector into `out` (hi - lo elements), reading only
        the parameters that overlap the range: a fragment's publish gathers its slice, not the model."""
        for p, a, b, at in self._pieces(lo, hi):
            out[at - lo : at - lo + b - a].copy_(p.detach().reshape(-1)[a:b])

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """The task's `configure_optimizer(model)` if it has one, else `default_optimizer`; TaskError if the
        hook fails or returns something else than a torch optimizer."""
        hook = getattr(self.task, "configure_optimizer", None)
        if hook is None:
            return default_optimizer(self.model, self.cfg)
        try:
            optimizer = hook(self.model)
        except Exception as e:
            raise TaskError(f"train.task: {self.task.name}.configure_optimizer failed: {type(e).__name__}: {e}") from e
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TaskError(f"train.task: {self.task.name}.configure_optimizer returned {type(optimizer).__name__},"
                            " not a torch.optim.Optimizer")
        return optimizer

    def lr_at(self, step: int) -> float:
        """The inner learning rate at `step`: the task's `lr_at` hook if it has one, else warm-up + cosine."""
        hook = getattr(self.task, "lr_at", None)
        if hook is None:
            return lr_at(self.cfg, step)
        lr = float(hook(step))
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"{self.task.name}.lr_at({step}) returned {lr}, not a learning rate >= 0")
        return lr

    # -- the inner step --

    def inner_step(self) -> float:
        """One optimizer step over `accum_steps` micro-batches; returns the mean loss (a non-finite loss
        skips the update)."""
        began = time.perf_counter()
        try:
            return self._inner_step()
        finally:
            took = time.perf_counter() - began
            self.step_time_s = took if self.step_time_s is None else 0.9 * self.step_time_s + 0.1 * took

    def _inner_step(self) -> float:
        lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        micro = self.cfg.accum_steps
        total = 0.0
        for _ in range(micro):
            batch = self.stream.next_batch()
            with autocast(self.device, self.precision):
                loss = self.task.loss(self.model, batch)
            value = float(loss.detach())
            total += value
            if not math.isfinite(value):
                break
            # Each micro-batch's graph is freed by its backward: memory is that of one micro-batch. The
            # 1/micro makes the summed gradients those of the mean loss over the whole batch.
            scaled = loss / micro if micro > 1 else loss
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        total = self.reduce_gradients(total)
        self.step += 1
        if not math.isfinite(total):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            log.warning("inner step %d: loss is %s; update skipped", self.step, total)
            return total
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skipped when fp16 gradients overflowed; the scale backs off
            self.scaler.update()
        else:
            self.optimizer.step()
        # Free the gradients now rather than at the next step: the outer step, evaluation and checkpoint
        # that may come in between then run without them (4 bytes per parameter less at their peak).
        self.optimizer.zero_grad(set_to_none=True)
        return total / micro

    def reduce_gradients(self, loss_sum: float) -> float:
        """Hook between backward and the update: a worker group (node/worker/group.py) averages the
        gradients and the loss over its ranks here, so that every rank takes the same step. A single
        process has nothing to do."""
        return loss_sum

    def close(self) -> None:
        """Release what outlives the process loop: a worker group's rank 0 tells the other ranks to stop."""

    # -- the outer step --

    def publish_due(self, now: float | None = None) -> bool:
        """Whether to publish now: after H inner steps, or, when the daemon sets a pace (`period_s`), when
        the period since the last publish is up, whichever machine this is.

        Why pace by time: with a fixed H a machine k times slower makes k times fewer outer steps, falls out
        of every faster partner's step gap and forms an island of its own. Paced by the swarm (the period is
        H inner steps of the swarm's fastest trainer, node/daemon.py), every trainer makes outer steps at
        the same rate and a slower one simply covers fewer inner steps in each (dynamic local updates, Liu
        et al. 2024, "Asynchronous Local-SGD Training for Language Modeling"); its Delta then counts in
        proportion to its samples (node/worker/outer.py, `PairWeights`). The fastest trainer still takes about H.
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

    def _require_slow_weights(self, what: str) -> None:
        if not self.slow_weights:
            raise RuntimeError(f"{what}: this trainer keeps no slow weights (a worker group's rank > 0)")

    def lag(self) -> int:
        """Inner steps taken since the pending publish (0 when nothing is pending)."""
        return 0 if self.pending is None else self.step - self.last_publish_step

    def publish(self, phi_out: torch.Tensor, delta_out: torch.Tensor) -> Publish:
        """Write phi and Delta = theta - phi (into the shared slots) and remember theta for the rebase."""
        self._require_slow_weights("publish")
        if self.fragments is not None:
            raise RuntimeError("publish: this trainer syncs by fragments (publish_fragment)")
        with torch_threads(self.host_threads):
            self.gather_theta(self.theta_published)
            if phi_out.data_ptr() != self.phi.data_ptr():  # equal when phi lives in the slot (share_phi)
                phi_out.copy_(self.phi)
            self._own_delta(delta_out)
        inner_steps = self.step - self.last_publish_step
        self._publish_before_pending = self.last_publish_step
        self.last_publish_step = self.step
        self.pending = self.outer_step
        self.published_samples = inner_steps * self.cfg.batch_size
        self._period_began(inner_steps)
        return Publish(outer_step=self.outer_step, step=self.step, inner_steps=inner_steps,
                       samples=self.published_samples)

    # -- streaming fragments --

    def set_fragments(self, count: int | None) -> list[tuple[int, int]]:
        """Sync the model as `count` streaming fragments from now on (issue #23; None: the whole vector at
        once, `publish`); returns the partition's [lo, hi) ranges.

        The partition is the daemon's rule (protocols/compress.py `stream_fragment_range`: contiguous
        runs of whole codec blocks), so both partners cut the model alike and a fragment's top-k blocks are
        the whole vector's. Each fragment keeps its own outer-step count (a fragment's partner continues it,
        as the whole vector's does) and the inner step of its last publish (what its next Delta covers);
        `outer_step` is then the lowest count of a fragment, the periods every fragment has completed.
        The same count again keeps them (a resumed trainer re-declares what its checkpoint restored); a
        change starts every fragment at `outer_step`. Only with nothing in flight: a publish in flight was
        made on the old cut."""
        if self.pending is not None or self.in_flight:
            raise RuntimeError("set_fragments with a publish in flight")
        if count is not None and count < 1:
            raise ValueError(f"{count} fragments: need at least 1")
        if count is not None and self.fragments is not None and len(self.fragments) == count:
            return list(self.fragments)
        since = self.last_publish_step if self.fragments is None else min(self.fragment_publish_steps)
        if count is None:
            self.fragments, self.fragment_outer_steps, self.fragment_publish_steps = None, [], []
            self.last_publish_step = since
            return [(0, self.numel)]
        self.fragments = [stream_fragment_range(self.numel, f, count) for f in range(count)]
        self.fragment_slot = 0
        self.fragment_outer_steps = [self.outer_step] * count
        self.fragment_publish_steps = [since] * count
        return list(self.fragments)

    def fragment_due(self, now: float | None = None) -> int | None:
        """The fragment whose slot in the period has come (node/worker/loop.py publishes it, or skips it
        while its previous publish is in flight), else None. Fragment f's slot is inner step
        floor((f + 1) H / F) of the period, or with the daemon's pace (`period_s`) the moment (f + 1) / F
        of the period, within the same rules as `publish_due` (half a step early is on time, at most 2H
        inner steps per period); the last fragment's slot is where `publish_due` puts the whole vector's
        publish. The period starts at `last_publish_step` (`pass_fragment_slot` moves it)."""
        if self.fragments is None:
            return None
        f, count = self.fragment_slot, len(self.fragments)
        done = self.step - self.last_publish_step
        steps = (f + 1) * self.cfg.inner_steps // count
        if self.period_s <= 0 or self.next_publish_at is None:
            return f if done >= steps else None
        if done < 1:
            return None
        if done >= 2 * steps:
            return f
        now = time.monotonic() if now is None else now
        slot_at = self.next_publish_at - self.period_s * (1 - (f + 1) / count)
        return f if now + (self.step_time_s or 0.0) / 2 >= slot_at else None

    def pass_fragment_slot(self) -> None:
        """The due fragment's slot is taken (published) or skipped: the next fragment's comes next, and
        after the last one a new period begins, timed as `publish` times an outer step (the machine's
        speed, the pace's next deadline)."""
        assert self.fragments is not None
        self.fragment_slot += 1
        if self.fragment_slot < len(self.fragments):
            return
        self.fragment_slot = 0
        inner_steps = self.step - self.last_publish_step
        self.last_publish_step = self.step
        self._period_began(inner_steps)

    def _period_began(self, inner_steps: int) -> None:
        """A new period (an outer step's publish, or the last fragment slot's) after `inner_steps`: this
        machine's speed between the two (the median of its recent periods, time blocked on results left
        out) and, with a pace, the next publish's deadline."""
        now = time.monotonic()
        if self._last_publish_time is not None and inner_steps > 0:
            self._phase_steps.append(max(now - self._last_publish_time - self.blocked_s, 1e-6) / inner_steps)
            self.phase_step_s = statistics.median(self._phase_steps)
        self._last_publish_time, self.blocked_s = now, 0.0
        if self.period_s > 0:
            self.next_publish_at = now + self.period_s

    def fragment_index(self, lo: int, hi: int) -> int:
        """The index of fragment [lo, hi) in the declared partition; ValueError if it is not one of them
        (or RuntimeError without a partition): a range of another cut would overlap fragments in flight."""
        if self.fragments is None:
            raise RuntimeError("no fragments declared (set_fragments)")
        try:
            return self.fragments.index((lo, hi))
        except ValueError:
            raise ValueError(f"[{lo}, {hi}) is not a fragment of this trainer's partition") from None

    def publish_fragment(self, lo: int, hi: int, phi_out: torch.Tensor, delta_out: torch.Tensor) -> Publish:
        """Publish fragment [lo, hi): write its phi and D = Delta + residual (hi - lo elements each, e.g. the
        fragment's slices of the shared slots) and record theta on the slice for its rebase.

        Other fragments may be in flight meanwhile, one publish each: their slices of theta_published,
        phi, the momentum and the residual are disjoint, so each result touches its own and no buffer
        beyond the whole-vector path's is needed. The Publish carries the fragment's own outer-step count
        and the inner steps since the fragment's previous publish (what its Delta covers)."""
        self._require_slow_weights("publish_fragment")
        if self.pending is not None:
            raise RuntimeError("publish_fragment while a whole-vector publish is in flight")
        f = self.fragment_index(lo, hi)
        if hi <= lo:
            raise ValueError(f"fragment {f} is empty (a model of fewer blocks than fragments): nothing to sync")
        if f in self.in_flight:
            raise RuntimeError(f"fragment {f} already has a publish in flight")
        if phi_out.shape != (hi - lo,) or delta_out.shape != (hi - lo,):
            raise ValueError("phi_out and delta_out must be flat tensors of the fragment's size")
        span = (lo, hi)
        with torch_threads(self.host_threads):
            self.gather_theta_range(lo, hi, self.theta_published[lo:hi])
            mine = self.phi[lo:hi]
            if phi_out.data_ptr() != mine.data_ptr():  # equal when phi lives in the slot (share_phi)
                phi_out.copy_(mine)
            self._own_delta(delta_out, span)
        previous = self.fragment_publish_steps[f]
        inner_steps = self.step - previous
        samples = inner_steps * self.cfg.batch_size
        self.in_flight[f] = InFlight(self.fragment_outer_steps[f], self.step, previous, samples)
        self.fragment_publish_steps[f] = self.step
        return Publish(outer_step=self.fragment_outer_steps[f], step=self.step, inner_steps=inner_steps,
                       samples=samples)

    def _own_delta(self, out: torch.Tensor, span: tuple[int, int] | None = None) -> torch.Tensor:
        """What this replica publishes as its Delta: ``theta_published - phi``, plus the error-feedback
        residual where there is one (D = Delta + e), on fragment `span` or the whole vector. The same
        operations at publish and at the result, so the result's recomputation has the bits that were
        published."""
        if span is None:
            torch.sub(self.theta_published, self.phi, out=out)
            if self.residual is not None:
                out.add_(self.residual)
            return out
        lo, hi = span
        torch.sub(self.theta_published[lo:hi], self.phi[lo:hi], out=out)
        if self.residual is not None:
            out.add_(self.residual[lo:hi])
        return out

    def _feed_back(self, own: torch.Tensor, group_size: int, compression: Compression,
                   sum_delta: torch.Tensor | None = None, own_exact: bool = False,
                   span: tuple[int, int] | None = None) -> None:
        """Update the residual after an outer step on D = `own` (rewritten in place to what was applied).

        A lossy group step: the wire carried Q(D) (top-k), so ``e = D - Q(D)`` and ``own`` becomes Q(D), the
        value in the group's sum (a pair's sample-weighted mean needs our own term as the sum has it). Why
        here and not in the daemon: the worker holds D and e, and the codec is deterministic numpy, so the
        same ``round_trip`` gives bit for bit what the daemon's transfer carried, with no model-sized buffer
        in the daemon and no race with its sending thread, which reads the Delta slot while the sums form.
        A solo step, or a group over an uncompressed wire: D was applied in full, so ``e = 0``.

        `own_exact` (a lossy pair step of `auto`'s ramp, node/averaging/compression_choice.py
        `keeps_own_exact` says why): D is applied in full here too, so ``e = 0``, ``own`` stays D and the
        sum's own term becomes D: ``sum_delta += D - Q(D)`` (the partner's term stays as the wire carried
        it). The residual's buffer is the temporary, freed afterwards (a fast link's ramp leaves no 4 B/param
        behind; a link that keeps a lossy preset allocates it again at its first steady exchange).

        `span` = (lo, hi): a fragment's step, on the residual's slice alone (`own` and `sum_delta` are the
        fragment's): the rule is per coordinate. The buffer stays then (other fragments' slices may hold
        something); `own_exact` zeroes the slice instead."""
        if group_size >= 2 and compression.lossy:
            if self.residual is None:
                self.residual = torch.zeros(self.numel, dtype=torch.float32)
            residual = self.residual if span is None else self.residual[span[0] : span[1]]
            if compression.own_in_full and not own_exact and sum_delta is not None:
                feed_back_own_in_full(own, residual, sum_delta, compression)
                return
            residual.copy_(own)
            round_trip(compression.delta_codec("bf16"), own, own)
            residual.sub_(own)
            if own_exact and sum_delta is not None:
                sum_delta.add_(residual)  # D - Q(D): the sum's own term is D
                own.add_(residual)  # back to D
                if span is None:
                    self.residual = None
                else:
                    residual.zero_()
        elif self.residual is not None:
            (self.residual if span is None else self.residual[span[0] : span[1]]).zero_()

    def _own_phi_on_wire(self, sum_phi: torch.Tensor, phi_range: tuple[int, int], compression: Compression,
                         offset: int = 0) -> None:
        """Rewrite the fragment's sum ``S = Q(phi_p) + Q(phi)`` (both phis as int8 carried them) as
        ``S + 2 * (phi - Q(phi))``, so that the outer step's pull ``gamma/2 * (S - 2*phi)`` becomes
        ``gamma/2 * (Q(phi_p) - Q(phi))``.

        Why: unrewritten, the pull is ``gamma/2 * (Q(phi_p) - Q(phi)) + gamma * (Q(phi) - phi)``, whose second
        term drags every replica towards the int8 grid by up to half a step of its block's absmax at every
        outer step, whatever the spread. Rewritten, it is zero for equal replicas and equal and opposite on
        the two partners (the pair's mean is kept). Only for lossy presets: ``none`` stays bit for bit as it
        was. `offset`: where `sum_phi` (a fragment's, `phi_range` relative to it) starts in phi."""
        lo, hi = phi_range
        if hi <= lo:
            return
        mine = self.phi[offset + lo : offset + hi]
        wire = torch.empty(hi - lo, dtype=torch.float32)
        round_trip(compression.phi_codec("bf16"), mine, wire)
        torch.sub(mine, wire, out=wire)
        sum_phi[lo:hi].add_(wire, alpha=2)

    def samples_per_s(self) -> float:
        """This machine's training speed: sequences per second over whole outer steps (`phase_step_s`),
        or of the inner steps alone before the first outer step has been timed."""
        per_step = self.phase_step_s or self.step_time_s
        return self.cfg.batch_size / per_step if per_step else 0.0

    def set_pace(self, period_s: float, shift_s: float = 0.0) -> None:
        """Take the daemon's pace for the next outer steps (0: every H inner steps) and move the pending
        deadline by `shift_s` (towards the partner's phase, node/averaging/averager.py)."""
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
        outcome: ExchangeOutcome,
        sum_phi: torch.Tensor | None = None,
        sum_delta: torch.Tensor | None = None,
        *,
        scratch: torch.Tensor | None = None,
        sum_phi_is_scratch: bool = False,
        fragment: tuple[int, int] | None = None,
    ) -> int:
        """Apply the outer step for the pending publish and rebase the fast weights; returns the group
        size actually used (a group result with non-finite sums falls back to a solo step).

        `outcome` is what the exchange decided (node/bridge/exchange.py, `ExchangeOutcome`: the group size n,
        the counts to continue from, the partner's samples, the preset the wire used, the phi fragment it
        carried, `own_exact`), taken whole: one typed value from the daemon's exchange to this step. `sum_phi`
        and `sum_delta` are where the exchange left the group's sums over its n members, this one included;
        the keywords say what the caller lends beside them and which fragment's publish this answers.

        `scratch`: a flat fp32 tensor of `numel` elements that the caller lends for our own Delta (the
        worker lends its Delta slot, which holds that very Delta since the publish and which the daemon
        no longer reads once the result came); without it, the trainer's own `_scratch`. Afterwards
        `theta_published` holds the rebase's move, phi_new - theta_published (it is rewritten at the next
        publish).

        After a group step the outer-step counter continues from the group's largest one
        (`outcome.group_outer_step`), as the partner's does: counters of paired nodes stay together. A solo step
        follows a `group_outer_step` too (the largest the daemon saw among ready trainers), so that a node
        that sat out keeps the counter that keys the pairing schedule. The inner
        `step` (and so the learning rate) is this node's own and does not change. `exact_outer_step` (a solo
        step's only) sets the counter outright, lower too: a catch-up that moves the count alone because
        this node's weights are the swarm's but its count ran away from it (node/averaging/latejoin.py).

        `outcome.compression` (a `sync.compression` preset) says what the wire carried: with a lossy one the
        error-feedback residual is updated (`_feed_back`), and `outcome.phi_range` = [lo, hi) is the fragment whose
        phi was exchanged: the pull applies there only (`sum_phi` outside it is not read).

        `sum_phi_is_scratch`: `sum_phi` may be overwritten (the worker's phi_out slot, which nobody reads once
        the exchange is over): the NoLoCo pull then needs no model-sized temporary (node/worker/outer.py).

        `outcome.own_exact`: after a lossy pair step, apply our own Delta in full instead of the wire's copy plus
        error feedback (`_feed_back`; the daemon says when: `auto`'s probe and its way back to `none`).

        `fragment` = (lo, hi): the result of that fragment's publish (`publish_fragment`), however late and
        in whatever order among the fragments in flight. `sum_phi`, `sum_delta` and `scratch` are then the
        fragment's (hi - lo elements) and `phi_range` is relative to it; the outer step, the error feedback
        and the rebase act on [lo, hi) alone, and the counters are the fragment's (`_apply_fragment`)."""
        if fragment is not None:
            return self._apply_fragment(fragment, outcome, sum_phi, sum_delta, scratch, sum_phi_is_scratch)
        if self.pending is None:
            raise RuntimeError("apply_result without a pending publish")
        with torch_threads(self.host_threads):
            group_size = self._outer_step(outcome, sum_phi, sum_delta, scratch, sum_phi_is_scratch)
        published_at = _continued_count(self.pending, outcome, group_size)
        self.pending = None
        self.outer_step = published_at + 1
        return group_size

    def _apply_fragment(
        self, fragment: tuple[int, int], outcome: ExchangeOutcome, sum_phi: torch.Tensor | None,
        sum_delta: torch.Tensor | None, scratch: torch.Tensor | None, sum_phi_is_scratch: bool,
    ) -> int:
        """`apply_result` for fragment [lo, hi): the outer step on the slices, the rebase of the slice, and
        the fragment's count continued from the group's as the whole vector's is; `outer_step` becomes the
        lowest count of a fragment (the periods every fragment has completed: with one fragment, today's)."""
        lo, hi = fragment
        f = self.fragment_index(lo, hi)
        flight = self.in_flight.get(f)
        if flight is None:
            raise RuntimeError(f"apply_result without a pending publish of fragment {f} [{lo}, {hi})")
        for name, t in (("sum_phi", sum_phi), ("sum_delta", sum_delta), ("scratch", scratch)):
            if t is not None and t.shape != (hi - lo,):
                raise ValueError(f"{name} must be a flat tensor of the fragment's size ({hi - lo})")
        with torch_threads(self.host_threads):
            group_size = self._outer_step(outcome, sum_phi, sum_delta, scratch, sum_phi_is_scratch, fragment,
                                          flight.samples)
        del self.in_flight[f]
        self.fragment_outer_steps[f] = _continued_count(flight.outer_step, outcome, group_size) + 1
        self.outer_step = self._fragments_outer_step()
        return group_size

    def _fragments_outer_step(self) -> int:
        """The lowest outer-step count of a non-empty fragment (an empty one, of a model with fewer blocks
        than fragments, never syncs and would hold the count back)."""
        assert self.fragments is not None
        counts = [c for c, (lo, hi) in zip(self.fragment_outer_steps, self.fragments, strict=True) if hi > lo]
        return min(counts) if counts else self.outer_step

    def _outer_step(self, outcome: ExchangeOutcome, sum_phi: torch.Tensor | None, sum_delta: torch.Tensor | None,
                    scratch: torch.Tensor | None, sum_phi_is_scratch: bool,
                    span: tuple[int, int] | None = None, published_samples: int | None = None) -> int:
        """`apply_result`'s host work: the checks, the outer step on phi and the rebase; returns the group
        size used. `span`: a fragment's (its sums, scratch and `outcome.phi_range` are the fragment's, and
        `published_samples` its publish's); None: the whole vector, as it always was."""
        lo, hi = span if span is not None else (0, self.numel)
        group_size, phi_range, partner_samples = outcome.group_size, outcome.phi_range, outcome.partner_samples
        if group_size >= 2:
            if sum_phi is None or sum_delta is None:
                raise ValueError("a group result needs sum_phi and sum_delta")
            plo, phi_hi = phi_range if phi_range is not None else (0, hi - lo)
            if not (all_finite(sum_phi[plo:phi_hi]) and all_finite(sum_delta)):
                log.warning("outer step %d: group sums are not finite; taking a solo step", self.outer_step)
                group_size = 1
        preset = get_compression(outcome.compression)
        if scratch is None:
            scratch = self._scratch if span is None else self._scratch[: hi - lo]
        own_delta = self._own_delta(scratch, span)
        self._feed_back(own_delta, group_size, preset, sum_delta, outcome.own_exact and group_size == 2, span)
        if group_size >= 2 and preset.lossy and sum_phi is not None:
            phi_range = phi_range if phi_range is not None else (0, hi - lo)
            self._own_phi_on_wire(sum_phi, phi_range, preset, lo)
        own_samples = self.published_samples if published_samples is None else published_samples
        samples = (own_samples, partner_samples) if group_size == 2 and partner_samples > 0 else None
        self.outer.step(self.phi if span is None else self.phi[lo:hi], own_delta, group_size=group_size,
                        sum_phi=sum_phi, sum_delta=sum_delta, samples=samples,
                        phi_range=phi_range if group_size >= 2 else None, overwrite_sum_phi=sum_phi_is_scratch,
                        span=span)
        self._rebase(span)
        return group_size

    def _rebase(self, span: tuple[int, int] | None = None) -> None:
        """theta <- theta_now + (phi_new - theta_published): keep what was learnt while the exchange ran.

        The move ``phi_new - theta_published`` is formed on the host in `theta_published` (not needed once
        the outer step is taken: no model-sized scratch) and added to each parameter where it lives. Why in
        this order and not ``(theta_now - theta_published) + phi_new``: on a GPU that form copied all of
        theta to the host and back, and here theta never leaves the device; one host pass less on the CPU
        too. Parameter by parameter, with the same bits as the flat form.

        `span` = (lo, hi): a fragment's rebase, on its slice alone (the other fragments' slices of
        theta_published may belong to publishes still in flight). A parameter cut by the fragment's edge
        gets its part through a flat view (parameters are contiguous, as `torch.nn` creates them)."""
        lo, hi = span if span is not None else (0, self.numel)
        if span is None:
            torch.sub(self.phi, self.theta_published, out=self.theta_published)
        else:
            torch.sub(self.phi[lo:hi], self.theta_published[lo:hi], out=self.theta_published[lo:hi])
        with torch.no_grad():
            for p, a, b, at in self._pieces(lo, hi):
                move = self.theta_published[at : at + b - a]
                target = p if b - a == p.numel() else p.view(-1)[a:b]
                move = move.view_as(target)
                target.add_(move.to(device=p.device, dtype=p.dtype)
                            if p.device != move.device or p.dtype != move.dtype else move)

    def evaluate(self) -> float:
        self.val_loss = self.task.evaluate(self.model)
        return self.val_loss

    # -- checkpoints --

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly; a publish still in flight is treated as not made
        (phi is the pre-exchange one and theta has all progress, so the next publish carries it). So are
        fragments in flight: their slices of phi, the momentum and the residual change only when their
        results come, and a publish changes no state but the counters that `_fragment_state` rolls back."""
        self._require_slow_weights("checkpoint")
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
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "data": self.stream.state_dict(),
            "rng": rng,
            "val_loss": self.val_loss,
            **self._residual_state(),
            **self._fragment_state(),
        }

    def _fragment_state(self) -> dict[str, Any]:
        """The streaming fragments' counters, where fragments are declared: how many, each one's outer-step
        count and the inner step of its last publish not in flight (the one before, for a fragment in
        flight). Why kept: a fragment's count keys its partner and its Delta's weight follows its steps
        since its last publish; a restart that reset them would mis-pair and mis-weight every fragment
        that was ahead."""
        if self.fragments is None:
            return {}
        steps = list(self.fragment_publish_steps)
        for f, flight in self.in_flight.items():
            steps[f] = flight.previous_step
        return {"fragments": {"count": len(self.fragments), "outer_steps": list(self.fragment_outer_steps),
                              "publish_steps": steps}}

    def _residual_state(self) -> dict[str, Any]:
        """The error-feedback residual, where it holds anything: what the wire has not carried yet of this
        node's own updates. Without it a restart would drop that share of the node's work for good, where
        error feedback promises only to delay it (4 bytes per parameter more in the checkpoint while a lossy
        preset is in use; nothing once a `none` exchange or the own-Delta rule emptied it)."""
        if self.residual is None or not bool(self.residual.any()):
            return {}
        return {"residual": self.residual.clone()}

    def check_state(self, state: dict[str, Any]) -> None:
        """Reject (with CheckpointError) a checkpoint that verifies but does not belong to this model."""
        if state.get("format") not in READABLE_FORMATS:
            raise CheckpointError(f"unknown checkpoint format {state.get('format')!r}")
        if state.get("model_hash") != self.model_hash or state.get("layout_hash") != self.layout_hash:
            raise CheckpointError("checkpoint is for a different model")
        phi = state.get("phi")
        if not isinstance(phi, torch.Tensor) or phi.shape != (self.numel,):
            raise CheckpointError("slow weights have the wrong size")
        for key in ("model", "outer", "optimizer", "data", "rng"):
            if not isinstance(state.get(key), dict):
                raise CheckpointError(f"checkpoint lacks {key}")
        residual = state.get("residual")
        if residual is not None and not (isinstance(residual, torch.Tensor) and residual.shape == (self.numel,)
                                         and residual.dtype == torch.float32 and bool(torch.isfinite(residual).all())):
            raise CheckpointError("the error-feedback residual has the wrong size or is not finite")
        fragments = state.get("fragments")
        if fragments is not None and not self._valid_fragment_state(fragments, int(state.get("step", 0))):
            raise CheckpointError("the fragment counters are malformed")

    @staticmethod
    def _valid_fragment_state(fragments: object, step: int) -> bool:
        """Whether a checkpoint's `fragments` entry is a count >= 1 and that many non-negative outer-step
        counts and publish steps no later than the checkpoint's step."""
        if not isinstance(fragments, dict):
            return False
        count, outer_steps, steps = fragments.get("count"), fragments.get("outer_steps"), fragments.get("publish_steps")
        if not isinstance(count, int) or count < 1 or not isinstance(outer_steps, list) or not isinstance(steps, list):
            return False
        if len(outer_steps) != count or len(steps) != count:
            return False
        return (all(isinstance(c, int) and c >= 0 for c in outer_steps)
                and all(isinstance(s, int) and 0 <= s <= step for s in steps))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        if self.slow_weights:
            self.phi.copy_(state["phi"])
            self.outer.load_state_dict(state["outer"])
        self._load_optimizer(state["optimizer"], int(state["format"]))
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.stream.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["cpu"])
        if self.device.type == "cuda" and "cuda" in state["rng"]:
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        self.step = int(state["step"])
        self.outer_step = int(state["outer_step"])
        self.last_publish_step = int(state["last_publish_step"])
        self.pending = None
        self.val_loss = state.get("val_loss")
        residual = state.get("residual")  # absent: none held (or a checkpoint from before it was saved)
        self.residual = residual.clone() if isinstance(residual, torch.Tensor) else None
        self.in_flight = {}
        self.fragments, self.fragment_outer_steps, self.fragment_publish_steps = None, [], []
        fragments = state.get("fragments")
        if isinstance(fragments, dict):
            self.set_fragments(int(fragments["count"]))
            self.fragment_outer_steps = [int(c) for c in fragments["outer_steps"]]
            self.fragment_publish_steps = [int(s) for s in fragments["publish_steps"]]

    def _load_optimizer(self, saved: dict[str, Any], fmt: int) -> None:
        """Load the inner optimizer's state (its moments) and keep the configured hyperparameters: torch
        would take the checkpoint's, so a changed `train.weight_decay` would be ignored after a restart.
        A format-1 checkpoint (plain Adam over all parameters in one group) has its per-parameter state
        moved into the default optimizer's groups; raises (ValueError, KeyError) if it does not fit."""
        configured = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        if fmt == 1 and len(saved["param_groups"]) == 1 and len(self.optimizer.param_groups) > 1:
            saved = self._regroup_format1(saved)
        self.optimizer.load_state_dict(saved)
        for group, hyper in zip(self.optimizer.param_groups, configured, strict=True):
            group.update(hyper)

    def _regroup_format1(self, saved: dict[str, Any]) -> dict[str, Any]:
        """A one-group optimizer state (indices in model parameter order) re-indexed for our groups."""
        if len(saved["param_groups"][0]["params"]) != len(self.params):
            raise ValueError("the checkpoint's optimizer covers a different number of parameters")
        position = {id(p): i for i, p in enumerate(self.params)}
        old_state = saved["state"]
        state, groups, index = {}, [], 0
        for group in self.optimizer.param_groups:
            ids = []
            for p in group["params"]:
                if position[id(p)] in old_state:
                    state[index] = old_state[position[id(p)]]
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    def checkpoint_due(self, now: float | None = None) -> bool:
        """Whether the outer step just applied should be checkpointed: every `checkpoint_every` outer steps,
        but never sooner than `checkpoint_min_s` seconds after the previous one tried.

        Why a time floor: with a tiny model and the swarm's pace, outer steps come several a second, and
        `checkpoint_every` alone wrote about one checkpoint a second (disk wear and I/O for nothing: a
        crash costs at most the floor's seconds). The first one of a process follows the step rule alone."""
        if self._checkpoint_tried is None:
            return self.outer_step % self.cfg.checkpoint_every == 0
        outer, at = self._checkpoint_tried
        now = time.monotonic() if now is None else now
        return self.outer_step - outer >= self.cfg.checkpoint_every and now - at >= self.cfg.checkpoint_min_s

    def save_checkpoint(self, now: float | None = None) -> Path:
        self._checkpoint_tried = (self.outer_step, time.monotonic() if now is None else now)
        return self.checkpoints.save(self.state_dict(), self.step)

    def read_swarm_snapshot(self, path: Path) -> dict[str, Any]:
        """A snapshot the daemon downloaded from the swarm (node/averaging/latejoin.py), checked to be of this model;
        CheckpointError otherwise."""
        state = read_checkpoint(path)
        phi = state.get("phi")
        if state.get("layout_hash") != self.layout_hash or not isinstance(phi, torch.Tensor) or phi.numel() != self.numel:
            raise CheckpointError("the swarm snapshot is for a different model")
        if not bool(torch.isfinite(phi).all()):  # the daemon's combine leaves such donors out; never start from one
            raise CheckpointError("the swarm snapshot's slow weights are not finite")
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
        self.in_flight = {}
        self.fragment_slot = 0
        if self.fragments is not None:  # every fragment starts from the snapshot's weights and count
            self.fragment_outer_steps = [outer_step] * len(self.fragments)
            self.fragment_publish_steps = [self.step] * len(self.fragments)

    def start_from_join_snapshot(self) -> Path | None:
        """A late joiner's first start: slow and fast weights and step counters from the swarm snapshot the
        daemon downloaded (node/averaging/latejoin.py); its own data shard, RNG and a fresh inner optimizer. The
        snapshot is consumed (renamed) so that later restarts use this node's own checkpoints."""
        path = Home(self.home).join.snapshot
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
        next averaging's pull closes; never below the snapshot's own). Reset: the outer momentum, because it is the direction of this
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
        # Never below the snapshot's own outer step: the daemon's swarm median counts every alive trainer,
        # and a third one that has barely started (a late joiner) made it this node's own old step, so a
        # catch-up took weights 157 outer steps ahead and kept the counter ("outer step 22 -> 22"): out of
        # every partner's reach again, and a donor of a step its weights are not.
        snapshot_outer_step = int(state["outer_step"])
        self._take_swarm_weights(state, snapshot_outer_step if outer_step is None
                                 else max(outer_step, snapshot_outer_step))
        self.outer.momentum.zero_()
        if self.residual is not None:
            self.residual.zero_()  # the residual of an abandoned trajectory
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

"""A multi-GPU host as one node: the worker runs as a `torch.distributed` group of `train.local_ranks`
processes, data parallel within the host, and the swarm sees one node.

Why: one daemon per GPU would average a host's GPUs through NoLoCo's outer steps over TCP, when they can
average gradients at every inner step over the host's own links (NVLink/NCCL) at no cost to the swarm. So
the ranks keep identical weights: after each inner step's backward they all-reduce the gradients and the
loss (the mean over ranks, DDP's semantics: the gradient of the mean loss over the group's
`local_ranks x batch_size` sequences), then clip and step alike. Only rank 0 talks to the daemon: it runs
the unchanged single-worker loop (node/worker/loop.py `train_loop`): it publishes phi/Delta, applies the outer result,
evaluates and writes checkpoints. The other ranks follow its commands:

    STEP   one inner step (its gradient all-reduce is where the ranks meet)
    SYNC   take rank 0's flat weights and inner-step counter (after an outer step, a catch-up, a resume),
           so that every rank continues from exactly the weights the outer step produced
    SAVE   send this rank's data-stream position and RNG for rank 0's checkpoint
    STOP   exit (rank 0 stops when the daemon says so, or is gone)

Processes. The supervisor starts rank 0 as `python -m node.worker --fd N --group DIR --world-size W` and
ranks 1..W-1 as `python -m node.worker --follow DIR --rank R --world-size W` (`FollowerProcs`, node/bridge/group_procs.py); they meet
through a `FileStore` in DIR, so there is no port to pick or collide on. Rank 0 puts the daemon's `init` in
the store for the others. If any rank dies the supervisor kills the others and restarts the whole group: a
group that lost a rank cannot go on (its collectives would wait forever), and the restart resumes every
rank from rank 0's last checkpoint, which carries each rank's data position.

Data. Rank r's task is built with `TaskContext(rank=r, world_size=W)` and the PeerID `<PeerID>/rank<r>`
for r > 0 (rank 0 keeps the node's own, so going from one process to a group keeps its shard): a task that
shards by PeerID, as the default does, gives each rank its own shard unchanged.

Memory. Only rank 0 keeps `Trainer`'s fp32 master copies (phi, theta at publish, outer momentum: 12 bytes
per parameter); ranks 1.. take no outer step and are built without them. Gradients and weights cross the
group in buckets of at most `BUCKET_BYTES`, so no rank holds a model-sized flat buffer for them: a rank
beyond 0 costs its model, gradients and optimizer state, as one DDP process would.

Backends: `gloo` on CPU (tested with 2 processes), `nccl` on CUDA with rank r on cuda:r (not tested here).
Not done: communication does not overlap the backward pass (the gradient buckets are all-reduced after
all micro-batches, one after the other).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from node.bridge.exchange import ExchangeOutcome
from node.bridge.group_procs import Rendezvous
from node.bridge.ipc import Adopted, Init
from node.config.train import TrainConfig
from node.ops.logs import setup_logging
from node.worker.checkpoint import read_checkpoint
from node.worker.task import TaskError, resolve_device
from node.worker.trainer import Trainer

log = logging.getLogger("starling.worker_group")

# A collective that waits this long means a rank is gone or hung; the supervisor's silence timeout
# (no metrics from rank 0) usually restarts the group well before. Ranks 1.. wait in one while rank 0
# waits for an outer result, hence at least a few `train.exchange_timeout`s where rank 0 may wait for one
# (`train.overlap` off or a `train.max_lag`; by default it never waits).
GROUP_TIMEOUT = datetime.timedelta(minutes=30)
INIT_KEY = "starling/init"
# Ranks 1.. wait this long for rank 0 to hand them the daemon's init.
INIT_TIMEOUT = datetime.timedelta(minutes=10)

STEP, SYNC, SAVE, STOP = 1, 2, 3, 4

# The most a bucket of gradients or weights crossing the group holds (DDP's default bucket is 25 MiB): large
# enough that a collective's latency does not matter, small enough to be no memory to speak of.
BUCKET_BYTES = 32 << 20


def group_store(rendezvous: Rendezvous) -> dist.FileStore:
    """The group's `torch.distributed.FileStore` in the rendezvous directory (here, not on `Rendezvous`:
    the daemon, which makes the directory and starts the ranks, loads no torch)."""
    store = dist.FileStore(str(rendezvous.directory / "store"), rendezvous.world_size)
    store.set_timeout(INIT_TIMEOUT)
    return store


def buckets(tensors: Sequence[torch.Tensor], cap_bytes: int | None = None) -> Iterator[list[torch.Tensor]]:
    """`tensors` in order, cut into runs of one dtype and device of at most `cap_bytes` (default
    `BUCKET_BYTES`) each, a larger tensor forming a run of its own: what one collective moves at a time."""
    cap = BUCKET_BYTES if cap_bytes is None else cap_bytes
    run: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if run and (t.dtype != run[0].dtype or t.device != run[0].device or size + nbytes > cap):
            yield run
            run, size = [], 0
        run.append(t)
        size += nbytes
    if run:
        yield run


def rank_device(cfg: TrainConfig, rank: int) -> torch.device:
    """Rank r's device: cuda:r when `train.device` resolves to CUDA, else the CPU."""
    device = resolve_device(cfg.device)
    return torch.device("cuda", rank) if device.type == "cuda" else device


def group_backend(cfg: TrainConfig, device: torch.device) -> str:
    """`train.group_backend`, with auto = nccl on CUDA and gloo on the CPU."""
    if cfg.group_backend != "auto":
        return cfg.group_backend
    return "nccl" if device.type == "cuda" else "gloo"


def check_group(cfg: TrainConfig, device: torch.device) -> None:
    """TaskError (one line for the operator) if this host cannot run `train.local_ranks` ranks on `device`."""
    if not dist.is_available():
        raise TaskError("train.local_ranks: this torch build has no torch.distributed")
    if device.type == "cuda" and torch.cuda.device_count() < cfg.local_ranks:
        raise TaskError(f"train.local_ranks: {cfg.local_ranks} ranks need as many CUDA devices, this machine has"
                        f" {torch.cuda.device_count()}")
    backend = group_backend(cfg, device)
    if backend == "nccl" and (device.type != "cuda" or not dist.is_nccl_available()):
        raise TaskError("train.group_backend: nccl needs CUDA devices and a torch build with NCCL")
    if backend == "gloo" and not dist.is_gloo_available():
        raise TaskError("train.group_backend: this torch build has no gloo")


class WorkerGroup:
    """This process's membership of the worker group: its rank and the few collectives the trainer uses."""

    def __init__(self, rank: int, world_size: int, backend: str, device: torch.device) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        # nccl moves CUDA tensors only; gloo CPU ones (the trainer's flat copies live on the CPU).
        self.device = device if backend == "nccl" else torch.device("cpu")
        self.closed = False

    @classmethod
    def join(cls, rendezvous: Rendezvous, rank: int, cfg: TrainConfig, store: dist.Store) -> WorkerGroup:
        device = rank_device(cfg, rank)
        backend = group_backend(cfg, device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        waits_for_results = not cfg.overlap or cfg.max_lag > 0
        timeout = max(GROUP_TIMEOUT, datetime.timedelta(seconds=3 * cfg.exchange_timeout)) if waits_for_results \
            else GROUP_TIMEOUT
        dist.init_process_group(backend, store=store, rank=rank, world_size=rendezvous.world_size, timeout=timeout)
        return cls(rank, rendezvous.world_size, backend, device)

    def command(self, cmd: int, arg: int = 0) -> None:
        """Rank 0: tell the other ranks what comes next."""
        dist.broadcast(torch.tensor([cmd, arg], dtype=torch.int64, device=self.device), src=0)

    def receive_command(self) -> tuple[int, int]:
        t = torch.zeros(2, dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return int(t[0]), int(t[1])

    def broadcast_(self, tensor: torch.Tensor) -> None:
        """Overwrite `tensor` on every rank with rank 0's."""
        if tensor.device == self.device:
            dist.broadcast(tensor, src=0)
            return
        buf = tensor.to(self.device)
        dist.broadcast(buf, src=0)
        tensor.copy_(buf)

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks, in place."""
        if tensor.device == self.device:
            dist.all_reduce(tensor)
            return
        buf = tensor.to(self.device)
        dist.all_reduce(buf)
        tensor.copy_(buf)

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, on rank 0 (None elsewhere)."""
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            dist.destroy_process_group()


class GroupTrainer(Trainer):
    """A `Trainer` whose inner steps are data parallel over the worker group (see the module docstring).

    On rank 0 each overridden method first commands the other ranks to do their part; on the others the
    same methods are driven by `follow()`. `cfg.batch_size` is the node's batch (ranks x per-rank batch)
    once built, so a publish's `samples` and the reported samples/s count the whole group."""

    def __init__(self, group: WorkerGroup, cfg: TrainConfig, home: Path, peer_id: str,
                 task_options: dict[str, Any] | None = None) -> None:
        self.group = group
        rank_cfg = dataclasses.replace(cfg, device=str(rank_device(cfg, group.rank)))
        shard_id = peer_id if group.rank == 0 else f"{peer_id}/rank{group.rank}"
        super().__init__(rank_cfg, home, shard_id, task_options, rank=group.rank, world_size=group.world_size,
                         slow_weights=group.rank == 0)
        self.cfg = dataclasses.replace(rank_cfg, batch_size=cfg.batch_size * group.world_size)

    # -- the inner step: every rank, in lockstep --

    def inner_step(self) -> float:
        if self.group.rank == 0:
            self.group.command(STEP)
        return super().inner_step()

    def reduce_gradients(self, loss_sum: float) -> float:
        """Average the loss and the gradients over the ranks. The loss first, with one "has a gradient"
        flag per parameter: if the loss is not finite on any rank, every rank skips the update (one that
        skipped alone would leave the others waiting); a parameter that some rank's forward did not use
        counts as a zero gradient there, as DDP's would, and one that no rank used keeps no gradient."""
        world = self.group.world_size
        stats = torch.tensor([loss_sum] + [0.0 if p.grad is None else 1.0 for p in self.params], dtype=torch.float64)
        self.group.all_reduce_(stats)
        total = float(stats[0]) / world
        if not math.isfinite(total):
            return total
        used = [p for p, flag in zip(self.params, stats[1:].tolist(), strict=True) if flag > 0]
        for p in used:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        with torch.no_grad():
            for bucket in buckets([p.grad for p in used if p.grad is not None]):
                # fp32 whatever the parameters' dtype, as the sum of a group's gradients deserves.
                flat = torch.cat([g.reshape(-1).float() for g in bucket])
                self.group.all_reduce_(flat)
                flat.div_(world)
                self._unflatten(flat, bucket)
        return total

    @staticmethod
    def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n

    # -- rank 0 decides; the others take its weights --

    def apply_result(self, outcome: ExchangeOutcome, sum_phi: torch.Tensor | None = None,
                     sum_delta: torch.Tensor | None = None, *, scratch: torch.Tensor | None = None,
                     sum_phi_is_scratch: bool = False, fragment: tuple[int, int] | None = None) -> int:
        used = super().apply_result(outcome, sum_phi, sum_delta, scratch=scratch,
                                    sum_phi_is_scratch=sum_phi_is_scratch, fragment=fragment)
        self._share_weights()
        return used

    def adopt_snapshot(self, path: Path, outer_step: int | None = None) -> Adopted:
        adopted = super().adopt_snapshot(path, outer_step)
        self._share_weights()
        return adopted

    def _share_weights(self) -> None:
        """Rank 0: every rank continues from rank 0's theta and inner step (the outer step's result)."""
        self.group.command(SYNC, self.step)
        self._broadcast_params()

    def _take_weights(self, step: int) -> None:
        self._broadcast_params()
        self.step = step

    def _broadcast_params(self) -> None:
        """Every rank's parameters become rank 0's, bit for bit (in their own dtype), one bucket at a time."""
        with torch.no_grad():
            for bucket in buckets(self.params):
                if self.group.rank == 0:
                    self.group.broadcast_(torch.cat([p.detach().reshape(-1) for p in bucket]))
                else:
                    flat = torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
                    self.group.broadcast_(flat)
                    self._unflatten(flat, bucket)

    def resume(self) -> tuple[Path | None, list[str]]:
        """Rank 0 resumes as a single worker does; the others load the same checkpoint (for the inner
        optimizer's state, which must be the same on every rank) with their own data position, then take
        rank 0's weights and step."""
        if self.group.rank == 0:
            path, rejected = super().resume()
            own = path is not None and path.parent == self.checkpoints.directory  # not a swarm snapshot
            self.group.broadcast_object(str(path) if own else "")
            self._share_weights()
            return path, rejected
        source = self.group.broadcast_object(None)
        if source:
            self._load_as_follower(Path(source))
        cmd, step = self.group.receive_command()
        if cmd != SYNC:
            raise RuntimeError(f"worker rank {self.group.rank}: expected the resumed weights, got command {cmd}")
        self._take_weights(step)
        return None, []

    def _load_as_follower(self, path: Path) -> None:
        state = read_checkpoint(path)
        self.check_state(state)
        ranks = (state.get("group") or {}).get("ranks") or []
        mine = ranks[self.group.rank - 1] if len(ranks) >= self.group.rank else None
        own = dict(state)
        # Rank 0's data position is of another shard: keep ours (fresh if the checkpoint has none).
        own["data"] = mine["data"] if mine else self.stream.state_dict()
        own["rng"] = {"cpu": mine["rng"] if mine else torch.get_rng_state()}
        own.pop("residual", None)  # rank 0's: only rank 0 takes outer steps
        self.load_state_dict(own)

    def state_dict(self) -> dict[str, Any]:
        """Rank 0's state plus each other rank's data position and RNG (under "group")."""
        state = super().state_dict()
        if self.group.rank == 0:
            self.group.command(SAVE)
            gathered = self.group.gather_object(None) or []
            state["group"] = {"world_size": self.group.world_size, "ranks": gathered[1:]}
        return state

    # -- the other ranks' loop, and the end --

    def follow(self) -> int:
        """Ranks 1..: do what rank 0 commands until it says stop; returns the exit code."""
        while True:
            cmd, arg = self.group.receive_command()
            if cmd == STEP:
                self.inner_step()
            elif cmd == SYNC:
                self._take_weights(arg)
            elif cmd == SAVE:
                self.group.gather_object({"data": self.stream.state_dict(), "rng": torch.get_rng_state()})
            elif cmd == STOP:
                self.group.close()
                return 0
            else:
                raise RuntimeError(f"worker rank {self.group.rank}: unknown command {cmd} from rank 0")

    def close(self) -> None:
        """Rank 0: stop the other ranks (they exit) and leave the group."""
        if self.group.rank == 0 and not self.group.closed:
            self.group.command(STOP)
            self.group.close()


def exit_group_process(code: int) -> None:
    """End a worker-group process now, without the interpreter's finalization.

    Why: gloo's worker thread drops its reference to a finished collective (and to the tensors it moved)
    a moment after `wait()` returns. When that moment falls inside interpreter finalization, dropping a
    tensor's Python object needs the GIL, which a finalizing interpreter no longer hands out, and the
    process aborts with `terminate called without an active exception` (SIGABRT; torch PR 179291
    describes it). The supervisor would read that as a crash after a clean stop. Everything the group's
    processes write (checkpoints, saved files) is closed by then, so flushing the logs and stdio is all
    that finalization would have done for us.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def lead_group(rendezvous: Rendezvous, cfg: TrainConfig, init: Init) -> GroupTrainer:
    """Rank 0: hand the daemon's init to the other ranks, join the group and build this rank's trainer."""
    check_group(cfg, resolve_device(cfg.device))
    store = group_store(rendezvous)
    store.set(INIT_KEY, msgpack.packb(dataclasses.asdict(init)))
    group = WorkerGroup.join(rendezvous, 0, cfg, store)
    return GroupTrainer(group, cfg, Path(init.home), init.peer_id, init.task_options)


def follow_main(rendezvous: Rendezvous, rank: int) -> int:
    """`python -m node.worker --follow DIR --rank R`: one of ranks 1.. of a worker group."""
    # Rank 0 decides when the group stops (it checkpoints first); a signal here would only break the group.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not 1 <= rank < rendezvous.world_size:
        print(f"worker: --rank must be between 1 and {rendezvous.world_size - 1}, got {rank}", file=sys.stderr)
        return 2
    try:
        store = group_store(rendezvous)
        init = Init(**msgpack.unpackb(store.get(INIT_KEY), raw=False))
        cfg = TrainConfig(**init.config)
        cfg.validate()
    except Exception as e:
        print(f"worker rank {rank}: no usable init from rank 0: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    setup_logging(init.log_level)
    torch.set_num_threads(cfg.threads)
    try:
        group = WorkerGroup.join(rendezvous, rank, cfg, store)
        try:
            trainer = GroupTrainer(group, cfg, Path(init.home), init.peer_id, init.task_options)
        except TaskError as e:
            log.error("worker rank %d: %s", rank, e)  # rank 0 builds the same task and reports why
            return 2
        trainer.resume()
        return trainer.follow()
    except Exception:
        log.exception("worker rank %d failed", rank)
        return 1


# --- the supervisor's side ----------------------------------------------------------------------------------

"""End-to-end swarm benchmark: real `starling` daemons on 127.0.0.1, judged by the simulation's own evaluation.

bench/convergence.py measures NoLoCo in one process with an in-memory exchange. This benchmark runs the
same training through real daemons (separate processes: libp2p discovery, pairing, the encrypted side
channel, the supervised torch worker) and asks whether the swarm delivers what the simulation promises.
Every loss below comes from the same code as the simulation's: after a graceful stop (SIGTERM, so each
worker writes a final checkpoint) each node's checkpoint is read with `node.worker.checkpoint`, its slow weights
`phi` are scattered into a `node.worker.trainer.Trainer` built with the identical TrainConfig, and
`Trainer.evaluate()` measures it on the shared held-out files.

Scenarios (`--scenarios`, default all three):

- mixing3: 3 identical trainers, the daemon's DEFAULT model, `train.inner_steps=20`, for `--seconds`
  (default 300) after all three train. Per trainer: the share of its outer steps that were averaged (not
  solo) and the number of distinct partners (targets: >= 60 % and >= 2).
- hetero: 2 fast + 2 slow trainers (each slow WORKER process in its own cgroup v1 cpu group capped at 25 %
  of one core; the daemons stay unthrottled), the bench/convergence.py model, `train.inner_steps=20`, for
  `--seconds`; then {2 fast} alone for the same time. Fast-slow exchanges as a share of all exchanges
  (>= 30 %), distinct partners per trainer (>= 2), slow nodes' validation loss vs the fast nodes' (within
  3 %), and the 4-node swarm's loss vs {2 fast}'s (no worse).
- convergence: N = 4 daemons with bench/convergence.py's BenchConfig (H = 50, 20 outer steps = 1000 inner
  steps each), beside the in-process simulation's NoLoCo (`run_outer`), the same 4 daemons with no
  communication (each alone in its own swarm: every outer step solo) and DDP (`run_ddp`). Printed: the
  share of the no-communication -> DDP gap each closes, and the swarm's share over the simulation's
  (target >= 0.9). Also a heterogeneous row: the same swarm with 2 of the 4 workers throttled.

    .venv/bin/python bench/swarm.py                  # all scenarios (about 30 min on 2 cores); prints only
    .venv/bin/python bench/swarm.py --write-docs     # also writes the `## Swarm` section of docs/benchmarks.md
    .venv/bin/python bench/swarm.py --quick          # a smoke run (tiny model, about a minute a scenario)
    .venv/bin/python bench/swarm.py --scenarios convergence
    .venv/bin/python bench/swarm.py --scenarios convergence --repeats 1 --sync compression=none --keep /tmp/conv

`--sync KEY=VALUE` (repeatable) sets a sync option on every daemon of every scenario (a diagnosis: which
option a result depends on); `--keep DIR` runs in DIR and leaves it, the daemons' homes and logs with it.

Throttling needs root and the cgroup v1 cpu controller (/sys/fs/cgroup/cpu); without them the rows that
need it are skipped with a note. Every daemon is stopped and every cgroup removed on the way out, also on
Ctrl+C and SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from convergence import QUICK as QUICK_BENCH  # bench/convergence.py, beside this script
from convergence import BenchConfig, relative_spread, run_ddp, run_outer
from records import RESULTS_DIR, keep_results, tree_id

from node.config.home import Home
from node.config.sync import SyncConfig
from node.config.train import TrainConfig
from node.worker.checkpoint import CheckpointError, read_checkpoint
from node.worker.trainer import Trainer
from p2p.identity import create_identity, peer_id_of
from starling_testing.daemon import DaemonProc
from starling_testing.report import replace_section

ROOT = Path(__file__).resolve().parent.parent

DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## Swarm"
RESULTS = RESULTS_DIR / "swarm.jsonl"  # every full run's raw results (issue #52): figures traceable to a run
SCENARIOS = ("mixing3", "hetero", "convergence")
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
SLOW_QUOTA_US, SLOW_PERIOD_US = 25_000, 100_000  # a slow worker: 25 % of one core
POLL_S = 0.3  # status polls: often enough to stop a convergence node within its 50 inner steps after the target

# Targets of issue #12 (the verdict lines say met / not met with the figure).
MIN_AVERAGED_SHARE = 0.60
MIN_PARTNERS = 2
MIN_FAST_SLOW_SHARE = 0.30
MAX_SLOW_FAST_GAP = 0.03
MIN_GAP_RATIO = 0.9


class BenchError(Exception):
    """The run could not be carried out (a daemon exited, a timeout); the message says why."""


# --- settings ---------------------------------------------------------------------------------------------


def model_fields(bc: BenchConfig) -> dict[str, Any]:
    """The model and data options of a BenchConfig (what the issue calls "the BenchConfig model")."""
    names = ("d_model", "n_layers", "n_heads", "seq_len", "batch_size", "lr", "warmup", "data_bytes", "eval_batches")
    return {name: getattr(bc, name) for name in names}


def convergence_fields(bc: BenchConfig) -> dict[str, Any]:
    """Every train option in which bench/convergence.py's TrainConfig differs from the daemon's defaults:
    the daemons then train with exactly the simulation's config (H, model, schedule, no overlap, seed).
    A checkpoint at every outer step lets the evaluation take the one written right at the target step
    (ckpt-<total_steps>), whatever inner steps a node ran between reaching it and being stopped."""
    cfg, default = bc.train_config("noloco"), TrainConfig()
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
              if getattr(cfg, f.name) != getattr(default, f.name)}
    # Keep enough that the checkpoint at the target survives a stop that comes many outer steps late (a
    # slow poll on a loaded machine, instant solo steps at a tiny H); the files are deleted with the run.
    return {**fields, "checkpoint_every": 1, "checkpoint_min_s": 0.0, "checkpoints_keep": min(1000, 2 * bc.outer_steps + 10)}


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def set_args(train: dict[str, Any], sync: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for section, options in (("train", train), ("sync", sync)):
        for key, value in options.items():
            args += ["--set", f"{section}.{key}={_text(value)}"]
    return args


def eval_config(train: dict[str, Any]) -> TrainConfig:
    """The TrainConfig the evaluation builds its Trainer with: the daemons' own options (same model hash)."""
    cfg = TrainConfig(**{**train, "device": "cpu"})
    cfg.validate()
    return cfg


# --- cgroup v1 throttling ---------------------------------------------------------------------------------


def can_throttle() -> bool:
    return os.geteuid() == 0 and (CGROUP_CPU / "cgroup.procs").exists()


class CpuCap:
    """One cgroup v1 cpu group holding ONE worker at quota/period of a core (a quota is shared by everything
    in its group, so every slow worker gets its own). Processes are moved by `cgroup.procs` (the whole
    process, every thread; `tasks` would move a single thread and leave torch's other threads uncapped)."""

    def __init__(self, name: str, quota_us: int = SLOW_QUOTA_US, period_us: int = SLOW_PERIOD_US) -> None:
        self.path = CGROUP_CPU / name
        self.path.mkdir()
        (self.path / "cpu.cfs_period_us").write_text(str(period_us))
        (self.path / "cpu.cfs_quota_us").write_text(str(quota_us))

    def holds(self, pid: int) -> bool:
        return str(pid) in (self.path / "cgroup.procs").read_text().split()

    def add(self, pid: int) -> None:
        """Cap `pid` (idempotent; a pid that is already gone is ignored: its restart is caught next poll)."""
        try:
            if not self.holds(pid):
                (self.path / "cgroup.procs").write_text(str(pid))
        except (ProcessLookupError, FileNotFoundError):
            pass

    def remove(self) -> None:
        """Move anything left back to the root group, then delete the group."""
        if not self.path.exists():
            return
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (CGROUP_CPU / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
        print(f"warning: could not remove {self.path}", file=sys.stderr)


# --- daemons ----------------------------------------------------------------------------------------------


@dataclass
class Node:
    """One trainer daemon of a swarm. `role` is fast/slow/trainer; `cap` throttles its worker."""

    name: str
    role: str
    proc: DaemonProc
    cap: CpuCap | None = None
    peer_id: str | None = None
    last: dict[str, Any] | None = None  # the last status it answered
    stopping: bool = False  # we sent it SIGTERM (an exit is then expected)

    def status(self) -> dict[str, Any] | None:
        """The daemon's status over its control socket (what `starling status --json` prints, without
        spawning a Python process per poll, which costs a second of CPU on a loaded 2-core machine)."""
        st = self.proc.status(timeout=5.0)
        if st is None:
            return None
        self.peer_id = st.get("peer_id", self.peer_id)
        self.last = st
        return st

    def exited(self) -> bool:
        return self.proc.proc is not None and self.proc.proc.poll() is not None

    def terminate(self) -> None:
        if self.proc.proc is not None and self.proc.proc.poll() is None:
            self.proc.proc.send_signal(signal.SIGTERM)
        self.stopping = True


def checkpoint_steps(home: Path) -> dict[int, Path]:
    """{inner step: file} of every checkpoint a node has on disk (written atomically: a name is a whole file)."""
    return dict(Home(home).checkpoint_files())


def first_checkpoint_from(home: Path, step: int) -> Path | None:
    """The earliest checkpoint at inner step >= `step`. With a checkpoint after every outer step and no
    overlap (the convergence runs), that is the one written right after the outer step that covers inner
    step `step` was applied: it exists exactly when that outer step is done."""
    later = {k: p for k, p in checkpoint_steps(home).items() if k >= step}
    return later[min(later)] if later else None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (None if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def training(st: dict[str, Any] | None) -> dict[str, Any]:
    return (st or {}).get("training") or {}


def sync_of(st: dict[str, Any] | None) -> dict[str, Any]:
    return (st or {}).get("sync") or {}


def outer_steps_done(st: dict[str, Any] | None) -> int:
    """Outer steps this node's worker has been given a result for (averaged + solo; a failed exchange
    counts as solo): `training.exchanges`, kept by the daemon across worker restarts."""
    ex = training(st).get("exchanges") or {}
    return int(ex.get("group", 0)) + int(ex.get("solo", 0))


class Swarm:
    """A bootstrap node plus trainers on loopback (or, `connected=False`, trainers each alone in its own
    swarm). Use as a context manager: leaving it stops every daemon (SIGTERM, SIGKILL after a timeout) and
    removes every cgroup, whatever happened."""

    def __init__(self, root: Path, roles: list[tuple[str, str]], args: list[str], *, connected: bool = True,
                 quotas: dict[str, int] | None = None) -> None:
        self.root = root
        # Per role, the worker's cgroup quota in us per SLOW_PERIOD_US (absent: uncapped).
        self.quotas = {"slow": SLOW_QUOTA_US} if quotas is None else quotas
        self.swarm = f"bench-{uuid.uuid4().hex[:10]}"
        self.connected = connected
        self.boot: DaemonProc | None = None
        self.nodes: list[Node] = []
        addr_file = root / "boot.addr"
        base = ["--listen", "/ip4/127.0.0.1/tcp/0"]
        if connected:
            self.boot = DaemonProc(root / "boot", [*base, "--swarm", self.swarm, "--no-train",
                                                   "--addr-file", str(addr_file)])
        for name, role in roles:
            where = (["--swarm", self.swarm, "--bootstrap-file", str(addr_file)] if connected
                     else ["--swarm", f"{self.swarm}-{name}"])  # alone: nobody to pair with, every step solo
            self.nodes.append(Node(name, role, DaemonProc(root / name, [*base, *where, *args])))

    def __enter__(self) -> Swarm:
        try:
            for node in self.nodes:
                if self.quotas.get(node.role):
                    node.cap = CpuCap(f"starling-bench-{os.getpid()}-{self.swarm}-{node.name}", self.quotas[node.role])
            if self.boot is not None:
                self.boot.start()
            for node in self.nodes:
                node.proc.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def poll(self) -> dict[str, dict[str, Any] | None]:
        """Every trainer's status; re-caps slow workers (a restarted worker has a new pid) and raises
        BenchError if a daemon exited that was not told to."""
        statuses = {}
        for node in self.nodes:
            if node.exited():
                if not node.stopping:
                    raise BenchError(f"{node.name} exited with {node.proc.proc.returncode}:\n{node.proc.log()[-3000:]}")
                statuses[node.name] = None
                continue
            st = node.status()
            pid = training(st).get("pid")
            if node.cap is not None and pid:
                node.cap.add(int(pid))
            statuses[node.name] = st
        if self.boot is not None and self.boot.proc is not None and self.boot.proc.poll() is not None:
            raise BenchError(f"the bootstrap node exited:\n{self.boot.log()[-3000:]}")
        return statuses

    def wait_training(self, timeout: float) -> dict[str, dict[str, Any] | None]:
        """Until every trainer has taken an inner step (its worker is up and capped, if slow)."""
        deadline = time.monotonic() + timeout
        while True:
            statuses = self.poll()
            if all(training(st).get("step", 0) > 0 and training(st).get("pid") for st in statuses.values()):
                return statuses
            if time.monotonic() > deadline:
                waiting = [n for n, st in statuses.items() if not training(st).get("step")]
                raise BenchError(f"{', '.join(waiting)} not training within {timeout:.0f} s")
            time.sleep(1.0)

    def stop_all(self, timeout: float = 60.0) -> dict[str, int | None]:
        """SIGTERM every trainer at once (each worker writes its final checkpoint), then wait; exit codes."""
        for node in self.nodes:
            node.terminate()
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        for node in self.nodes:
            p = node.proc.proc
            try:
                codes[node.name] = None if p is None else p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[node.name] = None
        return codes

    def close(self) -> None:
        procs = [n.proc for n in self.nodes] + ([self.boot] if self.boot is not None else [])
        for d in procs:
            if d.proc is not None and d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30.0
        for d in procs:
            if d.proc is None:
                continue
            try:
                d.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"warning: {d.home.name} did not stop within 30 s of SIGTERM; killed", file=sys.stderr)
                d.kill()
        for node in self.nodes:
            if node.cap is not None:
                node.cap.remove()


# --- evaluation (the simulation's code) -------------------------------------------------------------------


class Evaluator:
    """A Trainer built with the daemons' TrainConfig: each node's checkpointed phi is scattered into it and
    measured by `Trainer.evaluate()`, the function bench/convergence.py uses for its replicas."""

    def __init__(self, train: dict[str, Any], home: Path) -> None:
        self.trainer = Trainer(eval_config(train), home, "evaluator")

    def checkpoint(self, home: Path, at_step: int | None = None) -> dict[str, Any]:
        """The node's earliest checkpoint at inner step >= `at_step` if it has one, else its newest
        (verified, and checked to be of this model)."""
        steps = checkpoint_steps(home)
        if not steps:
            raise BenchError(f"{home.name} wrote no checkpoint")
        path = (first_checkpoint_from(home, at_step) if at_step is not None else None) or steps[max(steps)]
        try:
            state = read_checkpoint(path)
            self.trainer.check_state(state)
        except CheckpointError as e:
            raise BenchError(f"{path}: {e}") from e
        return state

    def loss(self, phi: torch.Tensor) -> float:
        self.trainer.scatter_theta(phi)
        return self.trainer.evaluate()


@dataclass
class Evaluated:
    """The validation losses of a set of nodes' slow weights."""

    per_node: dict[str, float]
    avg_model: float  # the loss of the nodes' averaged phi
    spread: float
    steps: dict[str, int]  # inner step of each checkpoint evaluated
    publishes: dict[str, int]  # inner step of the last publish whose outer step phi includes

    @property
    def mean(self) -> float:
        return statistics.fmean(self.per_node.values())

    @property
    def best(self) -> float:
        return min(self.per_node.values())


def evaluate_nodes(ev: Evaluator, nodes: list[Node], at_step: int | None = None) -> Evaluated:
    states = {n.name: ev.checkpoint(n.proc.home, at_step) for n in nodes}
    phis = {name: s["phi"].reshape(-1).float() for name, s in states.items()}
    per_node = {name: ev.loss(phi) for name, phi in phis.items()}
    avg = ev.loss(torch.stack(list(phis.values())).mean(0))
    return Evaluated(per_node, avg, relative_spread(list(phis.values())),
                     {k: int(s["step"]) for k, s in states.items()},
                     {k: int(s["last_publish_step"]) for k, s in states.items()})


# --- mixing: mixing3 and hetero ---------------------------------------------------------------------------


@dataclass
class TrainerMixing:
    """One trainer's outer steps during the measured window."""

    name: str
    role: str
    outer_steps: int
    averaged: int
    partners: int  # peers it averaged with at least once in the window (from sync.per_peer)
    distinct_partners: int  # sync.distinct_partners at the end (since the daemon started)
    rounds_with: dict[str, int]  # per partner name: averaged rounds in the window
    cpu_share: float | None = None  # its worker's CPU time / the window (cores); None if it restarted
    val_loss: float | None = None

    @property
    def share(self) -> float:
        return self.averaged / self.outer_steps if self.outer_steps else 0.0


@dataclass
class MixingRun:
    label: str
    seconds: float
    trainers: list[TrainerMixing]
    restarts: int = 0
    evaluated: Evaluated | None = None

    def role_loss(self, role: str) -> float | None:
        losses = [t.val_loss for t in self.trainers if t.role == role and t.val_loss is not None]
        return statistics.fmean(losses) if losses else None

    def pair_rounds(self, roles: set[str] | None = None) -> int:
        """Exchanges, each counted once per pair (both partners count it): all, or those between `roles`."""
        by_name = {t.name: t for t in self.trainers}
        total = 0
        for t in self.trainers:
            for other, rounds in t.rounds_with.items():
                role = by_name[other].role if other in by_name else "?"  # "?": a peer not of this run
                if roles is None or {t.role, role} == roles:
                    total += rounds
        return total // 2

    @property
    def fast_slow_share(self) -> float:
        """Fast-slow exchanges over all exchanges (the brief's "sum over fast nodes of per_peer rounds with
        slow peers / all exchanges counted once per pair", computed symmetrically)."""
        everything = self.pair_rounds()
        return self.pair_rounds({"fast", "slow"}) / everything if everything else 0.0


def _counters(st: dict[str, Any] | None) -> tuple[int, int, dict[str, int]]:
    """(outer steps, averaged, {peer_id: averaged rounds}) from a status."""
    ex = training(st).get("exchanges") or {}
    per_peer = {p: int(v.get("rounds", 0)) for p, v in (sync_of(st).get("per_peer") or {}).items()}
    return int(ex.get("group", 0)) + int(ex.get("solo", 0)), int(ex.get("group", 0)), per_peer


def measure_mixing(swarm: Swarm, label: str, seconds: float, startup_s: float,
                   bystanders: Swarm | None = None) -> MixingRun:
    """Wait until every trainer trains, then measure `seconds` of outer steps (counter deltas, so the
    start-up, when not everyone was up yet, does not count), then stop every daemon gracefully.
    `bystanders` train meanwhile without being measured (polled, so that their caps hold)."""
    if bystanders is not None:
        bystanders.wait_training(startup_s)
    first = swarm.wait_training(startup_s)
    t0 = time.monotonic()
    cpu0 = {name: (training(st).get("pid"), cpu_seconds(int(training(st).get("pid") or 0))) for name, st in first.items()}
    print(f"  {label}: all {len(swarm.nodes)} trainers training; measuring {seconds:.0f} s", file=sys.stderr, flush=True)
    last = dict(first)
    while time.monotonic() - t0 < seconds:
        for name, st in swarm.poll().items():
            if st is not None:
                last[name] = st
        if bystanders is not None:
            bystanders.poll()
        time.sleep(1.0)
    elapsed = time.monotonic() - t0
    cpu = {}  # each worker's share of a core over the window: what the throttle (and the machine) left it
    for name, st in last.items():
        pid, before = cpu0[name]
        after = cpu_seconds(int(pid or 0)) if training(st).get("pid") == pid else None
        cpu[name] = None if before is None or after is None else (after - before) / elapsed
    codes = swarm.stop_all()
    bad = {k: v for k, v in codes.items() if v != 0}
    if bad:
        print(f"  warning: {label}: exit codes after SIGTERM: {bad}", file=sys.stderr)
    names = {n.peer_id: n.name for n in swarm.nodes}
    trainers = []
    for node in swarm.nodes:
        o0, a0, p0 = _counters(first[node.name])
        o1, a1, p1 = _counters(last[node.name])
        with_names = {names.get(p, p[-8:]): r - p0.get(p, 0) for p, r in p1.items() if r - p0.get(p, 0) > 0}
        trainers.append(TrainerMixing(node.name, node.role, o1 - o0, a1 - a0, len(with_names),
                                      int(sync_of(last[node.name]).get("distinct_partners") or 0), with_names,
                                      cpu[node.name]))
    restarts = sum(int(training(st).get("restarts") or 0) for st in last.values())
    return MixingRun(label, elapsed, trainers, restarts)


def run_mixing(root: Path, label: str, roles: list[tuple[str, str]], train: dict[str, Any], sync: dict[str, Any],
               seconds: float, startup_s: float, evaluate: bool,
               bystander_roles: list[tuple[str, str]] | None = None,
               quotas: dict[str, int] | None = None) -> MixingRun:
    """One measured swarm; `bystander_roles` train at the same time, each alone (not measured), so that a
    smaller swarm is compared with a larger one under the same load on this shared machine."""
    with contextlib.ExitStack() as stack:
        bystanders = None
        if bystander_roles:
            bystanders = stack.enter_context(Swarm(root / "bystanders", bystander_roles, set_args(train, sync),
                                                   connected=False, quotas=quotas))
        swarm = stack.enter_context(Swarm(root, roles, set_args(train, sync), quotas=quotas))
        run = measure_mixing(swarm, label, seconds, startup_s, bystanders)
        nodes = swarm.nodes
    if evaluate:
        ev = Evaluator(train, root / "eval")
        run.evaluated = evaluate_nodes(ev, nodes)
        for t in run.trainers:
            t.val_loss = run.evaluated.per_node[t.name]
    return run


# --- convergence --------------------------------------------------------------------------------------------


@dataclass
class ConvRow:
    label: str
    nodes: int
    val_mean: float
    val_avg_model: float
    spread: float
    seconds: float
    averaged_share: float | None = None  # of the nodes' outer steps (daemon rows)
    note: str = ""
    gap_closed: float | None = None  # (nocomm - val_mean) / (nocomm - ddp), filled in by `fill_gaps`


def make_identities(directory: Path, n: int) -> tuple[list[Path], list[str]]:
    """`n` fresh identity files and their PeerIDs. Why: a node's data shard follows its PeerID, so the
    rows of one repeat that start their daemons from these files (and the simulation, whose replicas take
    the same PeerIDs as names) train on the same shards: a paired comparison, free of the shard noise
    that random PeerIDs bring (a few hundredths of loss from run to run on this small model)."""
    paths = [directory / f"n{i}.key" for i in range(n)]
    return paths, [str(peer_id_of(create_identity(p))) for p in paths]


def seed_home(home: Path, key: Path) -> None:
    """A fresh daemon home holding the identity `key` (from `make_identities`): the daemon started on it has
    that PeerID, so its data shard is the one the paired runs share."""
    home.mkdir(parents=True, mode=0o700)
    (Home(home).identity).write_bytes(key.read_bytes())
    (Home(home).identity).chmod(0o600)


def run_daemons_to_target(bc: BenchConfig, n: int, root: Path, label: str, *, connected: bool, slow: int,
                          sync: dict[str, Any], timeout_s: float, identities: list[Path] | None = None) -> ConvRow:
    """N daemons train until each has applied the outer step that covers inner step `bc.total_steps`
    (with `sync.pace=steps`: exactly its `bc.outer_steps`-th); each is stopped (SIGTERM) as soon as it gets
    there, so every node spends the simulation's compute and a node that finishes early does not keep the
    CPU from the others, which pair among themselves (or step solo when alone), as in a real swarm whose
    members leave. "Got there" is read from its checkpoints (one after every outer step, see
    `first_checkpoint_from`), not from status counters: that is also the file the evaluation reads."""
    train = convergence_fields(bc)
    roles = [(f"n{i}", "slow" if i >= n - slow else "trainer") for i in range(n)]
    for (name, _), key in zip(roles, identities or [], strict=False):
        seed_home(root / name, key)
    started = time.monotonic()
    with Swarm(root, roles, set_args(train, sync), connected=connected) as swarm:
        done: dict[str, dict[str, Any] | None] = {}
        while len(done) < n:
            swarm.poll()
            for node in swarm.nodes:
                if node.name not in done and first_checkpoint_from(node.proc.home, bc.total_steps) is not None:
                    done[node.name] = node.last
                    node.terminate()
            if time.monotonic() - started > timeout_s:
                behind = {x.name: training(x.last).get("step") for x in swarm.nodes if x.name not in done}
                raise BenchError(f"{label}: not every node reached inner step {bc.total_steps} within "
                                 f"{timeout_s:.0f} s (steps so far: {behind})")
            time.sleep(POLL_S)
        swarm.stop_all()
        nodes = swarm.nodes
    seconds = time.monotonic() - started
    ev = Evaluator(train, root / "eval")
    res = evaluate_nodes(ev, nodes, at_step=bc.total_steps)
    group = sum(int((training(st).get("exchanges") or {}).get("group", 0)) for st in done.values())
    total = sum(outer_steps_done(st) for st in done.values())
    return ConvRow(label, n, res.mean, res.avg_model, res.spread, seconds, group / total if total else 0.0,
                   steps_note(res, bc.total_steps, sync.get("pace", "swarm")))


def steps_note(res: Evaluated, target: int, pace: str) -> str:
    """The pace, and the inner steps in each node's evaluated phi when they are not all exactly `target`
    (with `sync.pace=swarm` an outer step ends on time, not on a multiple of H)."""
    off = {k: v for k, v in res.publishes.items() if v != target}
    return f"pace={pace}" + ("" if not off else "; inner steps in phi: " + ", ".join(
        f"{k} {v}" for k, v in sorted(res.publishes.items())))


def run_simulation(bc: BenchConfig, n: int, home: Path, replica_ids: list[list[str]]) -> list[ConvRow]:
    """bench/convergence.py's own NoLoCo, one run per list of replica PeerIDs (the daemons' of the same
    repeat, so on their data shards), and DDP, called directly (same BenchConfig, same N)."""
    rows = []
    sims = []
    for k, ids in enumerate(replica_ids):
        sim = run_outer(bc, n, "noloco", home / f"run{k}", ids=ids)
        sims.append(ConvRow(SIM, n, sim.val_mean, sim.val_avg_model, sim.spread, sim.seconds,
                            1.0 if n % 2 == 0 else None))
    rows.append(mean_row(sims))
    ddp = run_ddp(bc, n)
    rows.append(ConvRow("DDP (simulation)", n, ddp.val_mean, ddp.val_avg_model, 0.0, ddp.seconds))
    return rows


def mean_row(runs: list[ConvRow]) -> ConvRow:
    """Repeats of one row as one: the means, and each run's loss in the note. Why repeats: each daemon's
    data shard follows its PeerID, other ones in every repeat (`make_identities`), and on this small model
    one run's mean loss moves by a few hundredths with its shards, as much as the differences measured."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    shares = [r.averaged_share for r in runs if r.averaged_share is not None]
    losses = ", ".join(f"{r.val_mean:.4f}" for r in runs)
    note = f"mean of {len(runs)} runs ({losses})" + (f"; {first.note}" if first.note else "")
    return ConvRow(first.label, first.nodes, statistics.fmean(r.val_mean for r in runs),
                   statistics.fmean(r.val_avg_model for r in runs), statistics.fmean(r.spread for r in runs),
                   sum(r.seconds for r in runs), statistics.fmean(shares) if shares else None, note)


def fill_gaps(rows: list[ConvRow]) -> None:
    by = {r.label: r for r in rows}
    nocomm, ddp = by.get(NOCOMM), by.get(DDP)
    if nocomm is None or ddp is None or nocomm.val_mean <= ddp.val_mean:
        return  # no gap to close (a run too short for DDP to pull ahead, e.g. --quick): left undefined
    for r in rows:
        r.gap_closed = (nocomm.val_mean - r.val_mean) / (nocomm.val_mean - ddp.val_mean)


SWARM_ROW = "swarm (real daemons)"
HETERO_ROW = "swarm, half the workers throttled"
NOCOMM = "no communication (real daemons)"
SIM = "simulation NoLoCo (in-process)"
DDP = "DDP (simulation)"


# --- the plan ---------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """What a run does: full (the issue's settings) or quick (a tiny smoke run)."""

    quick: bool
    seconds: float
    bench: BenchConfig
    replicas: int
    startup_s: float
    sync: dict[str, Any] = field(default_factory=dict)  # every scenario's sync options besides the defaults
    repeats: int = 1  # runs of each homogeneous convergence row (swarm, no communication, simulation)
    # hetero: the fast workers' quota too (us per SLOW_PERIOD_US; 0 = uncapped). On this one shared machine
    # the slow nodes' daemons take CPU that their workers' fast partners would have on separate machines;
    # a cap that binds in both runs gives the fast workers the same compute with and without them.
    fast_quota_us: int = 0
    throttled_row: bool = True  # the convergence scenario's row with half the workers throttled

    def quotas(self) -> dict[str, int]:
        return {"slow": SLOW_QUOTA_US, **({"fast": self.fast_quota_us} if self.fast_quota_us else {})}

    def mixing_train(self) -> dict[str, Any]:
        """mixing3: the DEFAULT model (quick: the tiny one) at H = 20."""
        return {"device": "cpu", **(model_fields(QUICK_BENCH) if self.quick else {}), **self.h()}

    def hetero_train(self) -> dict[str, Any]:
        return {"device": "cpu", **model_fields(self.bench), **self.h()}

    def h(self) -> dict[str, Any]:
        """H = 20 (the issue's); quick: H = 5, with max_lag within it (its default 10 must be <= H)."""
        return {"inner_steps": 5, "max_lag": 5} if self.quick else {"inner_steps": 20}

    def convergence_sync(self) -> dict[str, Any]:
        """No late join (a fresh node must train its own 1000 steps from the common initial weights, not
        copy a neighbour's weights and step counter) and no catch-up (an adoption would replace phi)."""
        return {**self.sync, "join_donors": 0, "catch_up_after": 0}


def make_plan(quick: bool, seconds: float | None) -> Plan:
    if quick:
        # Quick pairing as in starling_testing's TINY_TRAIN; the default 10 s join wait would only idle.
        return Plan(True, seconds or 10.0, dataclasses.replace(QUICK_BENCH), 2, 120.0,
                    {"pair_window_s": 2, "join_wait_s": 2, "backoff_s": 1})
    return Plan(False, seconds or 300.0, BenchConfig(), 4, 300.0, repeats=3)


# --- scenarios --------------------------------------------------------------------------------------------


@dataclass
class Results:
    mixing3: MixingRun | None = None
    hetero: MixingRun | None = None
    fast_only: MixingRun | None = None
    convergence: list[ConvRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def scenario_mixing3(plan: Plan, tmp: Path, out: Results) -> None:
    roles = [(f"n{i}", "trainer") for i in range(3)]
    out.mixing3 = run_mixing(tmp / "mixing3", "mixing3", roles, plan.mixing_train(), plan.sync, plan.seconds,
                             plan.startup_s, evaluate=False)


def scenario_hetero(plan: Plan, tmp: Path, out: Results) -> None:
    if not can_throttle():
        out.notes.append("hetero skipped: throttling needs root and the cgroup v1 cpu controller")
        return
    train = plan.hetero_train()
    roles = [("f0", "fast"), ("f1", "fast"), ("s0", "slow"), ("s1", "slow")]
    out.hetero = run_mixing(tmp / "hetero", "2 fast + 2 slow", roles, train, plan.sync, plan.seconds,
                            plan.startup_s, evaluate=True, quotas=plan.quotas())
    # The slow machines still run, each alone, while the fast pair is measured: on this shared machine the
    # comparison is then "the slow machines join the swarm" against "they train apart", at equal load.
    out.fast_only = run_mixing(tmp / "fast-only", "2 fast alone", roles[:2], train, plan.sync, plan.seconds,
                               plan.startup_s, evaluate=True, bystander_roles=roles[2:], quotas=plan.quotas())


def scenario_convergence(plan: Plan, tmp: Path, out: Results) -> None:
    bc, n = plan.bench, plan.replicas
    timeout = 600.0 if plan.quick else 3600.0
    sync = plan.convergence_sync()
    # The homogeneous rows run at a fixed H (`sync.pace=steps`): the simulation's outer steps exactly. The
    # heterogeneous row runs at the daemon's default pace (`swarm`: outer steps on the fastest trainer's
    # clock, fewer inner steps per outer step on a throttled node): what the daemon does for slow machines.
    steps = {**sync, "pace": "steps"}

    # One set of PeerIDs per repeat, shared by that repeat's swarm, no-communication and simulation runs.
    keys = [make_identities(tmp / f"keys-{k}", n) for k in range(plan.repeats)]

    def repeated(label: str, connected: bool, name: str) -> ConvRow:
        runs = []
        for k in range(plan.repeats):
            runs.append(run_daemons_to_target(bc, n, tmp / f"{name}-{k}", label, connected=connected, slow=0,
                                              sync=steps, timeout_s=timeout, identities=keys[k][0]))
            _progress(runs[-1])
        return mean_row(runs)

    rows = [repeated(SWARM_ROW, True, "conv-swarm")]
    if not plan.throttled_row:
        out.notes.append("heterogeneous convergence row left out (--no-throttled-row)")
    elif can_throttle():
        rows.append(run_daemons_to_target(bc, n, tmp / "conv-hetero", HETERO_ROW, connected=True, slow=n // 2,
                                          sync=sync, timeout_s=timeout))
        _progress(rows[-1])
    else:
        out.notes.append("heterogeneous convergence row skipped: throttling needs root and cgroup v1 cpu")
    rows.append(repeated(NOCOMM, False, "conv-nocomm"))
    for row in run_simulation(bc, n, tmp / "conv-sim", [ids for _, ids in keys]):
        rows.append(row)
        _progress(row)
    fill_gaps(rows)
    out.convergence = rows


def _progress(row: ConvRow) -> None:
    print(f"  {row.label}: val {row.val_mean:.4f} (averaged weights {row.val_avg_model:.4f}) {row.seconds:.0f} s",
          file=sys.stderr, flush=True)


RUNNERS = {"mixing3": scenario_mixing3, "hetero": scenario_hetero, "convergence": scenario_convergence}


# --- report -----------------------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{x * 100:.0f}%"


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def mixing_table(runs: list[MixingRun]) -> str:
    lines = ["| run | node | role | outer steps | averaged | averaged share | partners (window) | "
             "sync.distinct_partners | averaged with | worker CPU (cores) | val loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for t in run.trainers:
            with_ = ", ".join(f"{k}:{v}" for k, v in sorted(t.rounds_with.items())) or "-"
            val = "-" if t.val_loss is None else f"{t.val_loss:.4f}"
            cpu = "-" if t.cpu_share is None else f"{t.cpu_share:.2f}"
            lines.append(f"| {run.label} | {t.name} | {t.role} | {t.outer_steps} | {t.averaged} | {_pct(t.share)} | "
                         f"{t.partners} | {t.distinct_partners} | {with_} | {cpu} | {val} |")
    return "\n".join(lines)


def mixing3_verdicts(run: MixingRun) -> list[str]:
    low = min(run.trainers, key=lambda t: t.share)
    few = min(run.trainers, key=lambda t: t.partners)
    return [
        f"- mixing3, averaged share >= {_pct(MIN_AVERAGED_SHARE)} for every trainer: "
        f"{_met(low.share >= MIN_AVERAGED_SHARE)} (lowest {low.name} {_pct(low.share)}; "
        + ", ".join(f"{t.name} {_pct(t.share)}" for t in run.trainers) + ")",
        f"- mixing3, distinct partners >= {MIN_PARTNERS} for every trainer: {_met(few.partners >= MIN_PARTNERS)} "
        f"(fewest {few.name} {few.partners})",
    ]


def hetero_verdicts(run: MixingRun, fast_only: MixingRun) -> list[str]:
    few = min(run.trainers, key=lambda t: t.partners)
    fast, slow = run.role_loss("fast"), run.role_loss("slow")
    gap = (slow - fast) / fast if fast and slow is not None else float("nan")
    a, b = run.evaluated, fast_only.evaluated
    assert a is not None and b is not None
    no_worse = a.mean <= b.mean and a.best <= b.best
    return [
        f"- hetero, fast-slow exchanges >= {_pct(MIN_FAST_SLOW_SHARE)} of all exchanges: "
        f"{_met(run.fast_slow_share >= MIN_FAST_SLOW_SHARE)} ({_pct(run.fast_slow_share)}: "
        f"{run.pair_rounds({'fast', 'slow'})} of {run.pair_rounds()})",
        f"- hetero, distinct partners >= {MIN_PARTNERS} for every trainer: {_met(few.partners >= MIN_PARTNERS)} "
        f"(fewest {few.name} {few.partners})",
        f"- hetero, slow nodes' validation loss within {_pct(MAX_SLOW_FAST_GAP)} of the fast nodes': "
        f"{_met(abs(gap) <= MAX_SLOW_FAST_GAP)} (slow {slow:.4f}, fast {fast:.4f}: {gap * 100:+.1f}%)",
        f"- hetero, {{2f+2s}} no worse than {{2f}} alone for the same wall time: {_met(no_worse)} "
        f"(mean over nodes {a.mean:.4f} vs {b.mean:.4f}; best node {a.best:.4f} vs {b.best:.4f}; "
        f"averaged weights {a.avg_model:.4f} vs {b.avg_model:.4f})",
        f"- hetero, how slow the slow ones were (not a target): worker CPU slow {_cores(run, 'slow')}, "
        f"fast {_cores(run, 'fast')} cores each on average",
    ]


def _cores(run: MixingRun, role: str) -> str:
    shares = [t.cpu_share for t in run.trainers if t.role == role and t.cpu_share is not None]
    return f"{statistics.fmean(shares):.2f}" if shares else "?"


def convergence_table(rows: list[ConvRow]) -> str:
    lines = ["| run | N | val loss (mean of nodes) | val loss (averaged weights) | weight spread | "
             "averaged outer steps | gap closed | time | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = "-" if r.averaged_share is None else _pct(r.averaged_share)
        gap = "-" if r.gap_closed is None else f"{r.gap_closed:.3f}"
        lines.append(f"| {r.label} | {r.nodes} | {r.val_mean:.4f} | {r.val_avg_model:.4f} | {r.spread:.2e} | "
                     f"{share} | {gap} | {r.seconds:.0f} s | {r.note} |")
    return "\n".join(lines)


def convergence_verdicts(rows: list[ConvRow]) -> list[str]:
    by = {r.label: r for r in rows}
    out = []
    sim = by.get(SIM)
    if NOCOMM in by and DDP in by and by[NOCOMM].val_mean <= by[DDP].val_mean:
        return [f"- convergence: no gap to close here: DDP ({by[DDP].val_mean:.4f}) is not better than no "
                f"communication ({by[NOCOMM].val_mean:.4f}), so the gap shares are undefined (NOT met)"]
    for label in (SWARM_ROW, HETERO_ROW):
        row = by.get(label)
        if row is None or sim is None or row.gap_closed is None or sim.gap_closed is None:
            continue
        ratio = row.gap_closed / sim.gap_closed if sim.gap_closed else float("nan")
        out.append(f"- convergence, {label}: gap share closed {row.gap_closed:.3f} vs the simulation's "
                   f"{sim.gap_closed:.3f}, ratio {ratio:.2f} (target >= {MIN_GAP_RATIO}): {_met(ratio >= MIN_GAP_RATIO)}")
    return out


def render(plan: Plan, res: Results, command: str, wall: float, scenarios: list[str]) -> str:
    parts = [f"{SECTION}\n",
             f"Command: `{command}` ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {wall / 60:.1f} min wall, on a "
             f"{os.cpu_count()}-core {platform.machine()} machine, {platform.system()} {platform.release()}; "
             f"torch {torch.__version__}, Python {platform.python_version()}). Scenarios: {', '.join(scenarios)}.",
             "Real `starling` daemons on 127.0.0.1 (a network-only bootstrap node plus the trainers, each its own "
             "process with its supervised torch worker). Validation losses are bench/convergence.py's: each node's "
             "checkpointed slow weights phi evaluated by `Trainer.evaluate()` after a graceful stop. Throttled "
             f"('slow') workers run in their own cgroup v1 cpu group at {SLOW_QUOTA_US}/{SLOW_PERIOD_US} us (25% of "
             "one core); their daemons are not throttled."
             + (f" With --fast-cap, the fast workers are capped likewise at {plan.fast_quota_us}/{SLOW_PERIOD_US} us, so "
                "that the slow nodes' daemons on this shared machine do not take compute from the fast workers (as "
                "they would not on separate machines)." if plan.fast_quota_us else "")]
    verdicts: list[str] = []
    if res.mixing3 is not None:
        parts.append(f"### mixing3\n\n3 trainers, the default model, train.inner_steps=20"
                     f"{' (quick: tiny model, H = 5)' if plan.quick else ''}; outer steps counted over "
                     f"{res.mixing3.seconds:.0f} s after all three were training (worker restarts: "
                     f"{res.mixing3.restarts}).\n\n{mixing_table([res.mixing3])}")
        verdicts += mixing3_verdicts(res.mixing3)
    if res.hetero is not None and res.fast_only is not None:
        h, f = res.hetero, res.fast_only
        parts.append(f"### hetero\n\nThe bench/convergence.py model at H = {plan.hetero_train()['inner_steps']}; "
                     f"{h.seconds:.0f} s of {h.label}, then {f.seconds:.0f} s of {f.label} while the 2 slow ones train "
                     "apart (each alone, so that both runs load this shared machine alike), each timed from when "
                     f"all its trainers were training. Averaged weights: {h.label} {h.evaluated.avg_model:.4f}, "
                     f"{f.label} {f.evaluated.avg_model:.4f}. The cap binds only where a worker would otherwise get "
                     "more than 25% of a core: the 'worker CPU' column says what each actually got (on a machine "
                     "busy with other jobs the fast ones may get little more).\n\n"
                     f"{mixing_table([h, f])}")
        verdicts += hetero_verdicts(h, f)
    if res.convergence:
        bc = plan.bench
        cfg = ", ".join(f"{x.name}={getattr(bc, x.name)}" for x in dataclasses.fields(bc))
        parts.append(
            f"### convergence\n\nN = {plan.replicas}, BenchConfig ({cfg}), the simulation's TrainConfig (no "
            f"overlap, the same lr schedule over {bc.total_steps} inner steps). The homogeneous daemon rows run "
            f"at a fixed H (`sync.pace=steps`): exactly {bc.outer_steps} outer steps of H = {bc.inner_steps}, as "
            "the simulation; the throttled row runs at the daemon's default pace (`swarm`: outer steps on the "
            "fastest trainer's clock, so a slow node covers fewer inner steps per outer step). Each daemon is "
            "stopped (SIGTERM) as soon as it has applied the outer step that covers inner step "
            f"{bc.total_steps}, and evaluated on the checkpoint it wrote right then: equal compute per node, and "
            "a node that finishes early stops taking CPU from the others (which pair among themselves, or step "
            "solo when alone). No late join, no catch-up. 'no communication' = the same daemons, each alone in "
            "its own swarm (every outer step solo). Gap closed = (no-comm - run) / (no-comm - DDP), on the mean "
            f"over nodes. The swarm, no-communication and simulation rows are each the mean of {plan.repeats} "
            "run(s) (the note lists them): a daemon's data shard follows its PeerID, and each repeat's swarm, "
            "no-communication and simulation runs share one set of PeerIDs (identity keys made by the bench; "
            "the simulation's replicas take them as names), so they train on the same shards and compare "
            "paired; from one repeat to the next the shards differ, and a run's mean loss moves by a few "
            "hundredths with them on this small model.\n\n"
            f"{convergence_table(res.convergence)}")
        verdicts += convergence_verdicts(res.convergence)
    if verdicts or res.notes:
        parts.append("### Targets (issue #12)\n\n" + "\n".join(verdicts + [f"- {n}" for n in res.notes]))
    return "\n\n".join(parts) + "\n"


# --- main -------------------------------------------------------------------------------------------------


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """A SIGTERM to the bench unwinds like Ctrl+C, so every `finally` stops its daemons and cgroups."""
    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def parse_sync_overrides(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, str]:
    """``--sync KEY=VALUE`` items as a dict, each KEY a SyncConfig field (the daemon checks the value)."""
    known = {f.name for f in dataclasses.fields(SyncConfig)}
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().removeprefix("sync.")
        if not sep or key not in known:
            parser.error(f"--sync {item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(known))}")
        out[key] = value.strip()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated: {', '.join(SCENARIOS)}")
    parser.add_argument("--seconds", type=float, default=None, help="measured time of mixing3 and hetero (300; quick 10)")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run; never writes docs")
    parser.add_argument("--write-docs", action="store_true", help=f"write the `{SECTION}` section of {DOCS.name}")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the simulation and evaluation")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each homogeneous convergence row, averaged (default 3; quick 1)")
    parser.add_argument("--fast-cap", type=float, default=0.0, metavar="PCT",
                        help="hetero: cap the fast workers too, at PCT %% of a core (default 0: uncapped)")
    parser.add_argument("--sync", action="append", default=[], metavar="KEY=VALUE",
                        help="a sync option for every daemon, e.g. compression=none (repeatable; a diagnosis)")
    parser.add_argument("--no-throttled-row", action="store_true",
                        help="convergence: leave out the row with half the workers throttled")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="run in DIR (new or empty) and keep it: the daemons' homes and logs")
    parser.add_argument("--jsonl", type=Path, default=None,
                        help=f"append the raw results here (default {RESULTS.relative_to(RESULTS_DIR.parent.parent)}; "
                        "a --quick run keeps none unless given)")
    args = parser.parse_args(argv)
    sync_overrides = parse_sync_overrides(parser, args.sync)
    if args.write_docs and (sync_overrides or args.no_throttled_row):
        parser.error("--write-docs: the section holds the defaults' run; --sync and --no-throttled-row are diagnoses")
    if args.keep is not None and args.keep.exists() and (not args.keep.is_dir() or any(args.keep.iterdir())):
        parser.error(f"--keep: {args.keep} exists and is not an empty directory")
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown or not scenarios:
        parser.error(f"--scenarios: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SCENARIOS)}")
    if args.seconds is not None and args.seconds <= 0:
        parser.error("--seconds must be positive")
    torch.set_num_threads(args.threads)
    plan = make_plan(args.quick, args.seconds)
    if args.repeats is not None:
        if not 1 <= args.repeats <= 20:
            parser.error("--repeats must be between 1 and 20")
        plan = dataclasses.replace(plan, repeats=args.repeats)
    if not 0 <= args.fast_cap <= 100:
        parser.error("--fast-cap must be between 0 and 100 (percent of a core)")
    if args.fast_cap:
        plan = dataclasses.replace(plan, fast_quota_us=int(args.fast_cap / 100 * SLOW_PERIOD_US))
    plan = dataclasses.replace(plan, sync={**plan.sync, **sync_overrides}, throttled_row=not args.no_throttled_row)
    res = Results()
    started = time.monotonic()
    tree = tree_id()  # read at the start: HEAD may move during a long run
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    workdir = (contextlib.nullcontext(str(args.keep)) if args.keep is not None
               else tempfile.TemporaryDirectory(prefix="starling-bench-swarm-"))
    with sigterm_as_interrupt(), workdir as tmp:
        for name in scenarios:
            print(f"{name}...", file=sys.stderr, flush=True)
            try:
                RUNNERS[name](plan, Path(tmp), res)
            except BenchError as e:
                print(f"error: {name}: {e}", file=sys.stderr)
                return 1
            except KeyboardInterrupt:
                print("interrupted: every daemon was stopped and every cgroup removed", file=sys.stderr)
                return 130
    command = ("python bench/swarm.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    text = render(plan, res, command, time.monotonic() - started, scenarios)
    print(text)
    keep_results(args.jsonl or (None if args.quick else RESULTS), "swarm", res, command, tree,
                 scenarios=scenarios, plan=plan, seconds=round(time.monotonic() - started, 1))
    if args.write_docs and not args.quick:
        replace_section(DOCS, SECTION, text)
        print(f"written to {DOCS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak memory of a trainer for real model sizes: the daemon and its torch worker, in bytes per parameter.

For each size, two real `starling run` daemons on 127.0.0.1 train the default task (node/tasks/stdlib_lm.py,
sized with train.d_model / train.n_layers) and average with each other: a few inner steps, at least one
averaged outer step (so the four shared-memory slots and the exchange path are in use), the evaluation and
the checkpoint that follow it. The peak resident set (`VmHWM` in /proc/PID/status) of each daemon and of
its worker (`training.pid` in the daemon's status) is read at the end; while the run lasts, the resident
anonymous and shared-memory parts (`RssAnon`, `RssShmem`) are sampled too, to say which is which.

Bytes per parameter are given two ways: gross (peak / parameters, the fixed cost of Python, torch and
libp2p included) and marginal (the slope between the two sizes, what each further parameter costs). 1B
parameters does not fit a 2-core / 24 GB machine with two daemons: its row is extrapolated from the
measured fixed cost and slope, never measured.

Shared memory is counted in both processes' peaks (both map and touch the slots), so "daemon + worker"
double-counts it; the "machine" column counts it once.

    .venv/bin/python bench/memory.py                         # 10M and 100M (about 3 minutes on 2 cores)
    .venv/bin/python bench/memory.py --sizes 10M             # one size
    .venv/bin/python bench/memory.py --before bench/memory_before.json --write-docs
                                                             # the `## Memory` section of docs/benchmarks.md
                                                             # (`make bench-memory`), beside the figures of
                                                             # the code before the cuts (an earlier --json)
    .venv/bin/python bench/memory.py --group --before bench/memory_group_before.json --write-docs
                                                             # node a's worker as a 2-process group: the
                                                             # daemon's and each rank's peak, section
                                                             # `## Memory of a worker group`

bench/memory_before.json is `--json` of a run on the code before the cuts of issue #15 (a private
`Trainer.phi`, a model-sized `Trainer._scratch`, gradients kept until the next inner step);
bench/memory_group_before.json is `--group --json` of a run on the code before ranks 1.. of a worker group
dropped the master copies and the model-sized broadcast and gradient buffers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from node.bridge.shm import sweep_orphans
from starling_testing.daemon import DaemonProc
from starling_testing.report import replace_section

ROOT = Path(__file__).resolve().parent.parent

DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## Memory"
MIB = 1 << 20

# name -> (d_model, n_layers, n_heads): the default task at about 10M, 100M and 1B parameters (1B only with
# --device cuda: two nodes need about 50 GB of host memory and 40 GB of GPU memory).
SIZES: dict[str, tuple[int, int, int]] = {"10M": (512, 3, 8), "100M": (1024, 8, 16), "1B": (2048, 20, 16)}
SEQ_LEN = 32
TIMEOUT_S = {"10M": 240.0, "100M": 540.0, "1B": 420.0}  # the whole run of one size, start-up included
# A 1B checkpoint is about 20 GB, and a GPU host's 64 GB disk does not hold two nodes' first two: at 1B no
# periodic checkpoint is written, and the run ends after the averaged outer step (torch.save streams each
# tensor, so a checkpoint adds next to nothing to the peak: see "Where the bytes go").
SIZE_SETS: dict[str, dict[str, object]] = {"1B": {"train.checkpoint_every": 1_000_000}}
NO_CHECKPOINT = {"1B"}
SETTLE_S = 8.0  # without a checkpoint to wait for: sampling after the averaged step, for its outer step
GPU_SECTION = "## Memory on a GPU"
EXTRAPOLATE = 1_000_000_000
GROUP_RANKS = 2  # --group: node a's worker as a 2-process gloo group (the CPU stand-in for a 2-GPU host)
GROUP_SECTION = "## Memory of a worker group"
RowT = TypeVar("RowT")

# Small batches (a 100M step is seconds on one CPU thread), H = 3, a checkpoint after every outer step (so
# its transient memory is in the peak), outer steps every H steps of this machine (no pace to wait for).
TRAIN_SETS = {
    "train.seq_len": SEQ_LEN, "train.batch_size": 2, "train.inner_steps": 3, "train.max_lag": 2,
    "train.warmup": 1, "train.total_steps": 1000, "train.eval_batches": 1, "train.checkpoint_every": 1,
    "train.checkpoint_min_s": 0,
    "train.data_bytes": 1_000_000, "train.threads": 1, "train.exchange_timeout": 300,
    "sync.pace": "steps", "sync.max_step_gap": 50,
}


def param_count(d: int, n_layers: int) -> int:
    """Parameters of node/tasks/stdlib_lm.py's ByteTransformer (256-byte vocabulary, untied head)."""
    vocab = 256
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return vocab * d + SEQ_LEN * d + n_layers * block + 2 * d + d * vocab


@dataclass
class Proc:
    """One process's memory: the peak RSS (VmHWM) and the largest anonymous / shared parts sampled."""

    pid: int = 0
    hwm: int = 0  # bytes
    anon: int = 0
    shmem: int = 0

    def sample(self) -> None:
        fields = read_status(self.pid)
        if fields:
            self.hwm = max(self.hwm, fields.get("VmHWM", 0))
            self.anon = max(self.anon, fields.get("RssAnon", 0))
            self.shmem = max(self.shmem, fields.get("RssShmem", 0))


@dataclass
class Row:
    size: str
    params: int
    daemon: Proc = field(default_factory=Proc)
    worker: Proc = field(default_factory=Proc)
    averaged: int = 0
    seconds: float = 0.0
    device: str = "cpu"
    gpu: int = 0  # the worker's peak GPU memory as nvidia-smi reports it (bytes; the CUDA context included)

    @property
    def total(self) -> int:
        return self.daemon.hwm + self.worker.hwm

    @property
    def machine(self) -> int:
        """Daemon + worker with the shared slots counted once."""
        return self.total - min(self.daemon.shmem, self.worker.shmem)


@dataclass
class GroupRow:
    """Node a of a run whose worker is a group (`train.local_ranks`): its daemon and each rank."""

    size: str
    params: int
    daemon: Proc = field(default_factory=Proc)
    ranks: list[Proc] = field(default_factory=list)
    averaged: int = 0
    seconds: float = 0.0


def read_status(pid: int) -> dict[str, int]:
    """The kB fields of /proc/PID/status, in bytes ({} if the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0]) * 1024
    return out


def status(d: DaemonProc) -> dict[str, Any] | None:
    return d.status(timeout=5.0) if d.running() else None


def set_args(d_model: int, n_layers: int, n_heads: int, extra: dict[str, object] | None = None) -> list[str]:
    sets = {**TRAIN_SETS, "train.d_model": d_model, "train.n_layers": n_layers, "train.n_heads": n_heads,
            **(extra or {})}
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


def gpu_memory() -> dict[int, int]:
    """Bytes of GPU memory per process, as nvidia-smi lists its compute processes ({} without it)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    used = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            used[int(pid)] = int(mib) * MIB
    return used


def kill(d: DaemonProc, worker_pids: list[int]) -> None:
    """SIGKILL the worker's processes first (a worker that sees its daemon go writes a final checkpoint),
    then the daemon; wait for all."""
    for pid in worker_pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if d.proc is not None and d.proc.poll() is None:
        d.proc.kill()
        d.proc.wait(30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in worker_pids):
        time.sleep(0.1)


def measure(size: str, root: Path, device: str = "cpu") -> Row:
    """Two daemons training the default task at `size`, until both have averaged an outer step and written
    the checkpoint after it; the busier node's figures (each process's larger peak of the two)."""
    row = Row(size, param_count(*SIZES[size][:2]), device=device)
    gpu_peaks: dict[int, int] = {}
    procs, row.averaged, row.seconds = run_pair(size, root, local_ranks=1, device=device, gpu_peaks=gpu_peaks)
    row.daemon, (row.worker,) = max(procs, key=lambda pair: pair[0].hwm + pair[1][0].hwm)
    row.gpu = max((gpu_peaks.get(ranks[0].pid, 0) for _, ranks in procs), default=0)
    return row


def measure_group(size: str, root: Path) -> GroupRow:
    """The same run with node a's worker a group of `GROUP_RANKS` processes (node b stays one process):
    node a's daemon and each of its ranks."""
    row = GroupRow(size, param_count(*SIZES[size][:2]))
    procs, row.averaged, row.seconds = run_pair(size, root, local_ranks=GROUP_RANKS)
    row.daemon, row.ranks = procs[0]
    return row


def run_pair(size: str, root: Path, local_ranks: int, device: str = "cpu", gpu_peaks: dict[int, int] | None = None,
             ) -> tuple[list[tuple[Proc, list[Proc]]], int, float]:
    """Run the two daemons (node a with `train.local_ranks = local_ranks`) until both have averaged an outer
    step and written the checkpoint after it; per node (daemon, [worker processes, rank 0 first]), the
    averaged outer steps and the seconds it took. On `device` cuda, `gpu_peaks` collects each process's
    peak GPU memory (nvidia-smi, sampled with the rest)."""
    d_model, n_layers, n_heads = SIZES[size]
    swarm = f"mem-{uuid.uuid4().hex[:8]}"
    common = ["--listen", "/ip4/127.0.0.1/tcp/0", "--swarm", swarm, "--set", "sync.datapath_port=0",
              *set_args(d_model, n_layers, n_heads, {**SIZE_SETS.get(size, {}), "train.device": device})]
    addr = root / "a.addr"
    nodes = [DaemonProc(root / "a", [*common, "--addr-file", str(addr), "--set", f"train.local_ranks={local_ranks}"]),
             DaemonProc(root / "b", [*common, "--bootstrap-file", str(addr)])]
    procs: list[tuple[Proc, list[Proc]]] = [(Proc(), []) for _ in nodes]
    workers: list[int | None] = [None, None]  # rank 0's pid, to see a restart
    averaged = 0
    began = time.monotonic()
    deadline = began + TIMEOUT_S[size]
    try:
        for d in nodes:
            d.start()
        for (dp, _), d in zip(procs, nodes, strict=True):
            dp.pid = d.proc.pid
        ckpt_after: list[int | None] = [None, None]  # a checkpoint step seen once the node had averaged
        averaged_at: list[float | None] = [None, None]  # NO_CHECKPOINT sizes: when the node had averaged
        done = [False, False]
        while not all(done):
            if time.monotonic() > deadline:
                raise SystemExit(f"{size}: no averaged outer step and checkpoint within {TIMEOUT_S[size]:.0f} s:\n"
                                 + "\n".join(d.log()[-2000:] for d in nodes))
            for i, d in enumerate(nodes):
                if d.proc.poll() is not None:
                    raise SystemExit(f"{size}: daemon {d.home.name} exited with {d.proc.returncode}:\n{d.log()[-3000:]}")
                st = status(d)
                tr = (st or {}).get("training") or {}
                pid = tr.get("pid")
                if pid:
                    if workers[i] not in (None, pid):
                        raise SystemExit(f"{size}: the worker of {d.home.name} restarted ({tr.get('error')})")
                    workers[i] = int(pid)
                    pids = [int(p) for p in (tr.get("group_pids") or [pid])]
                    if [p.pid for p in procs[i][1]] != pids:  # the group's followers show up after rank 0
                        known = {p.pid: p for p in procs[i][1]}
                        procs[i][1][:] = [known.get(p) or Proc(pid=p) for p in pids]
                for p in [procs[i][0], *procs[i][1]]:
                    p.sample()
                if gpu_peaks is not None and device != "cpu":
                    for pid, used in gpu_memory().items():
                        gpu_peaks[pid] = max(gpu_peaks.get(pid, 0), used)
                group = int((tr.get("exchanges") or {}).get("group", 0))
                ckpt = tr.get("checkpoint_step")
                if group >= 1 and not done[i] and size in NO_CHECKPOINT:
                    at = averaged_at[i]
                    if at is None:
                        averaged_at[i] = time.monotonic()
                    elif time.monotonic() - at > SETTLE_S:
                        done[i] = True
                        averaged = max(averaged, group)
                elif group >= 1 and not done[i]:
                    if ckpt_after[i] is None:
                        ckpt_after[i] = -1 if ckpt is None else int(ckpt)
                    elif ckpt is not None and int(ckpt) > ckpt_after[i]:
                        done[i] = True
                        averaged = max(averaged, group)
            time.sleep(0.25)
        for _ in range(4):  # a second more of sampling, then the peaks
            for daemon, ranks in procs:
                for p in [daemon, *ranks]:
                    p.sample()
            time.sleep(0.25)
    finally:
        for (_, ranks), d in zip(procs, nodes, strict=True):
            kill(d, [p.pid for p in ranks])
        sweep_orphans()
    if any(len(ranks) != n for (_, ranks), n in zip(procs, (local_ranks, 1), strict=True)):
        raise SystemExit(f"{size}: did not see every worker process: {[[p.pid for p in r] for _, r in procs]}")
    return procs, averaged, time.monotonic() - began


# --- the report -------------------------------------------------------------------------------------------


def per_param(n_bytes: float, params: int) -> str:
    return f"{n_bytes / params:.1f}"


def fit(rows: list[Row], key: str) -> tuple[float, float] | None:
    """(fixed bytes, bytes per parameter) of a line through the two sizes, or None with fewer."""
    if len(rows) < 2:
        return None
    a, b = rows[0], rows[-1]
    ya, yb = value(a, key), value(b, key)
    slope = (yb - ya) / (b.params - a.params)
    return ya - slope * a.params, slope


def value(r: Row, key: str) -> float:
    return {"daemon": r.daemon.hwm, "worker": r.worker.hwm, "total": r.total, "machine": r.machine}[key]


KEYS = ("daemon", "worker", "total", "machine")


def table(rows: list[Row]) -> list[str]:
    out = ["| model | parameters | daemon peak MiB (B/param) | worker peak MiB (B/param) | daemon + worker MiB "
           "(B/param) | machine, shared slots once, MiB (B/param) | shared slots in each MiB |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{value(r, k) / MIB:,.0f} ({per_param(value(r, k), r.params)})" for k in KEYS]
        out.append(f"| {r.size} (measured) | {r.params:,} | " + " | ".join(cells)
                   + f" | {min(r.daemon.shmem, r.worker.shmem) / MIB:,.0f} |")
    fits = {k: fit(rows, k) for k in KEYS}
    if all(fits.values()):
        slope_cells = [f"+{fits[k][1]:.1f} B/param over {fits[k][0] / MIB:,.0f} MiB fixed" for k in KEYS]  # type: ignore[index]
        out.append("| marginal (slope 10M -> 100M) | | " + " | ".join(slope_cells) + " | |")
        cells = []
        for k in KEYS:
            fixed, slope = fits[k]  # type: ignore[misc]
            y = fixed + slope * EXTRAPOLATE
            cells.append(f"{y / MIB:,.0f} ({per_param(y, EXTRAPOLATE)})")
        out.append(f"| **1B (extrapolated, not measured)** | {EXTRAPOLATE:,} | " + " | ".join(cells) + " | |")
    return out


# The copies per parameter the code keeps (fp32 = 4 bytes), before and after this benchmark's cuts: (process,
# what, B/param before, after, where the peak is). The peak of a single worker is the AdamW step: the
# gradients, the optimizer's state and its one temporary are all alive then, beside every master copy.
ACCOUNTING = [
    ("worker", "model parameters (the fast weights theta)", "4", "4"),
    ("worker", "gradients (backward until zero_grad: before, the next inner step; after, right after the "
               "optimizer step, so not during the outer step, evaluation and checkpoint)", "4", "4"),
    ("worker", "AdamW state (exp_avg, exp_avg_sq)", "8", "8"),
    ("worker", "AdamW step temporary (torch's foreach AdamW: sqrt(exp_avg_sq), during the step only)", "4", "4"),
    ("worker", "slow weights phi (`Trainer.phi`): after, kept in the shared phi slot (`share_phi`)", "4", "0"),
    ("worker", "theta at publish (`Trainer.theta_published`)", "4", "4"),
    ("worker", "scratch (`Trainer._scratch`): after, own Delta in the Delta slot, rebase in theta_published",
     "4", "0"),
    ("worker", "outer momentum (node/worker/outer.py)", "4", "4"),
    ("worker", "NoLoCo pull temporary `sum_phi - n*phi` (node/worker/outer.py, outer step only; grads are freed "
               "by then after the cut, so it no longer adds to the peak; since issue #28 computed in the phi_out "
               "slot, for time: the measured rows above predate that)", "4", "0"),
    ("worker", "checkpoint write (torch.save streams each tensor's storage)", "~0", "~0"),
    ("both", "shared slots phi, Delta, phi_out, Delta_out (node/bridge/shm.py), resident in both processes", "16", "16"),
    ("daemon", "exchange buffers (protocols/avg.py, codec.py: one 1 MiB frame and chunk-sized scratch)", "~0", "~0"),
]


def accounting() -> list[str]:
    out = ["| process | what | fp32 B/param before | after |", "|---|---|---|---|"]
    out += [f"| {p} | {what} | {b} | {a} |" for p, what, b, a in ACCOUNTING]
    out.append("| **worker, at its peak (the AdamW step)** | params + grads + AdamW + its temporary + master "
               "copies + slots | 4+4+8+4 + 16 + 16 = **52** | 4+4+8+4 + 8 + 16 = **44** |")
    out.append("| **worker, during the outer step** | | 4+4+8 + 16 + 4 + 16 = 52 | 4+8 + 8 + 16 = 36 (40 with the pull's temporary, before issue #28) |")
    out.append("| **daemon** | the shared slots | **16** | **16** |")
    return out


def render(rows: list[Row], before: list[Row] | None, command: str) -> str:
    parts = [SECTION,
             f"`{command}`: two `starling run` daemons on 127.0.0.1 train the default task "
             f"(node/tasks/stdlib_lm.py; sizes via `train.d_model` / `train.n_layers`; batch "
             f"{TRAIN_SETS['train.batch_size']} x {SEQ_LEN} bytes, H = {TRAIN_SETS['train.inner_steps']}, fp32 on "
             "CPU, AdamW) until each has averaged an outer step with the other and written the checkpoint "
             "after it. Peak RSS is `VmHWM` of /proc/PID/status of the daemon and of its worker (of the node "
             "whose two peaks sum higher); B/param = peak / parameters, the fixed cost of Python, torch, "
             "libp2p and the data included. The shared slots are resident in both processes and so counted "
             "in both peaks; the machine column counts them once. The marginal row is the slope between the "
             "two sizes: what each further parameter costs, the figure to size a machine by. **1B is "
             "extrapolated, not measured** (fixed + slope x 1B): two daemons at 1B do not fit this 2-core, "
             "24 GB machine, so it was not run here (measured on a GPU host: section `Memory on a GPU`).",
             "### After\n\n" + "\n".join(table(rows))]
    if before:
        parts.append("### Before (the same benchmark on the code before the cuts)\n\n" + "\n".join(table(before)))
    parts.append("### Where the bytes go\n\n"
                 "Expected fp32 copies per parameter, from the code, to read beside the measured marginal "
                 "figures (the inner step's activations grow with batch x seq_len, not with the parameters, "
                 "and are small here):\n\n" + "\n".join(accounting()) + "\n\n"
                 "Measured against expected: the daemon's marginal 16.0 B/param is exactly the four slots; "
                 "the worker's lies 1 to 4 B/param above the table and moves by about 2.5 B/param from run "
                 "to run of the same code (two runs after the cuts gave 44.9 and 47.4): a high-water mark "
                 "also catches freed gradients and temporaries that the allocator has not returned to the "
                 "system yet, more or fewer of them depending on timing.")
    parts.append("What was cut (8 B/param of the worker's peak, 12 B/param during its outer step), each giving "
                 "the same bits as before (tests/test_worker.py):\n\n"
                 "- `Trainer._scratch`: the outer step's own Delta is recomputed into the worker's Delta slot, "
                 "which holds exactly that Delta since the publish; the rebase `theta <- theta_now + "
                 "(phi - theta_published)` forms its move in `theta_published`, which the next "
                 "publish rewrites anyway. A trainer used in-process without slots (tests, starling_testing/adversary.py) "
                 "allocates the scratch on first use (a worker group broadcasts theta in buckets instead, "
                 "section `Memory of a worker group`).\n"
                 "- The private copy of phi: the worker keeps phi in its shared phi slot (`Trainer.share_phi`), "
                 "and the publish's copy into the slot becomes a no-op.\n"
                 "- The gradients are freed right after the optimizer step instead of at the next one, so the "
                 "outer step, the evaluation and the checkpoint run without them.\n"
                 "- Later (issue #16), the daemon's fixed cost: the daemon process no longer loads torch (it "
                 "averages on numpy views of the slots, node/bridge/shm.py, and reads a checkpoint's phi through "
                 "node/bridge/ckptfile.py), about 180 MiB less per daemon, whatever the model size.\n\n"
                 "Why the slots may be used so: the daemon reads phi and Delta (and writes the sums) only while "
                 "an exchange is in flight, from a publish until its result, and the supervisor sends the "
                 "result only once the exchange has returned, its side-channel threads included "
                 "(`SecureChannel.run_in_threads` returns only after both stopped; a worker's death cancels and "
                 "awaits its exchange before a new worker starts). The worker changes phi and the Delta slot "
                 "only after a result.\n\n"
                 "Not cut, and why: the daemon holds no model-sized buffer of its own (the exchange decodes "
                 "into the shared outputs chunk by chunk), so its 16 B/param are the slots themselves; "
                 "`theta_published` is needed for the rebase (phi + Delta does not give theta's bits back); "
                 "the AdamW temporary is torch's (`foreach=False` would trade it "
                 "for speed).")
    return "\n\n".join(parts) + "\n"


def group_table(rows: list[GroupRow]) -> list[str]:
    columns = ["daemon"] + [f"rank {r}" for r in range(GROUP_RANKS)]
    out = ["| model | parameters | " + " | ".join(f"{c} peak MiB (B/param)" for c in columns) + " |",
           "|---|---|" + "---|" * len(columns)]

    def peaks(r: GroupRow) -> list[int]:
        return [r.daemon.hwm, *(p.hwm for p in r.ranks)]

    for r in rows:
        out.append(f"| {r.size} (measured) | {r.params:,} | "
                   + " | ".join(f"{b / MIB:,.0f} ({per_param(b, r.params)})" for b in peaks(r)) + " |")
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        slopes = [(yb - ya) / (b.params - a.params) for ya, yb in zip(peaks(a), peaks(b), strict=True)]
        fixed = [ya - k * a.params for ya, k in zip(peaks(a), slopes, strict=True)]
        out.append(f"| marginal (slope {a.size} -> {b.size}) | | "
                   + " | ".join(f"+{k:.1f} B/param over {f / MIB:,.0f} MiB fixed" for k, f in zip(slopes, fixed, strict=True))
                   + " |")
    return out


def render_group(rows: list[GroupRow], before: list[GroupRow] | None, command: str) -> str:
    parts = [GROUP_SECTION,
             f"`{command}`: the run of `## Memory` with node a's worker a group of {GROUP_RANKS} processes "
             f"(`train.local_ranks = {GROUP_RANKS}`, gloo on the CPU, the stand-in for a {GROUP_RANKS}-GPU host; "
             "node b stays one process), until node a has averaged an outer step and written the checkpoint "
             "after it. Peaks (`VmHWM`) of node a's daemon and of each rank; B/param = peak / parameters.",
             "### After\n\n" + "\n".join(group_table(rows))]
    if before:
        parts.append("### Before (the same benchmark on the code before the cut)\n\n" + "\n".join(group_table(before)))
    parts.append("Expected fp32 B/param, from the code. Rank 0 runs the single worker's loop: model 4, "
                 "gradients 4, AdamW 8 and its temporary 4, theta at publish 4, outer momentum 4, the four "
                 "shared slots 16 = 44; before the cut it also wrote a model-sized scratch for the weight "
                 "broadcast and a flat fp32 gradient buffer for the all-reduce (8 more). A rank beyond 0 takes "
                 "no outer step: model, gradients, AdamW and its temporary = 20, what one DDP process holds. "
                 "Before the cut it also allocated phi, theta at publish and the outer momentum, which only "
                 "rank 0 uses, and the same scratch and gradient buffer (40 B/param); a fresh start writes "
                 "phi, the scratch and the gradient buffer of those, so 32 were resident (pages never written "
                 "are not: theta at publish is never written on a follower, the outer momentum only when it "
                 "resumes from a checkpoint). What was cut (node/worker/group.py): ranks 1.. are built "
                 "without the master copies (`Trainer(slow_weights=False)`), and gradients and weights cross "
                 "the group in buckets of `BUCKET_BYTES` (32 MiB) instead of model-sized flat buffers; the "
                 "group's Delta still equals one process's on the concatenated batch, and the ranks' weights "
                 "stay identical (tests/test_worker_group.py). On "
                 "a GPU host the model, gradients and AdamW state sit on the devices, and so did the gradient "
                 "buffer: there the cut saves 4 B/param of GPU memory on every rank, and host RAM: 8 to 12 "
                 "B/param resident (16 allocated) per rank beyond 0, 8 to 12 GB per extra GPU at 1B "
                 "parameters, and the scratch's 4 on rank 0.")
    return "\n\n".join(parts) + "\n"


def load_group_rows(path: Path) -> list[GroupRow]:
    return [GroupRow(o["size"], o["params"], Proc(**o["daemon"]), [Proc(**r) for r in o["ranks"]],
                     o.get("averaged", 0), o.get("seconds", 0.0)) for o in json.loads(path.read_text())]


def load_rows(path: Path) -> list[Row]:
    rows = []
    for obj in json.loads(path.read_text()):
        rows.append(Row(obj["size"], obj["params"], Proc(**obj["daemon"]), Proc(**obj["worker"]),
                        obj.get("averaged", 0), obj.get("seconds", 0.0), obj.get("device", "cpu"), obj.get("gpu", 0)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated: {', '.join(SIZES)}")
    ap.add_argument("--json", type=Path, help="also write the measured rows to this JSON file")
    ap.add_argument("--before", type=Path, help="an earlier run's --json, shown as the 'before' table")
    ap.add_argument("--write-docs", action="store_true",
                    help=f"write the `{SECTION}` section of {DOCS.name} (with --group: `{GROUP_SECTION}`)")
    ap.add_argument("--group", action="store_true",
                    help=f"measure node a with its worker as a {GROUP_RANKS}-process group instead")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help=f"train.device of both nodes; cuda adds each worker's GPU memory (section `{GPU_SECTION}`)")
    args = ap.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or not sizes:
        ap.error(f"--sizes: unknown {', '.join(unknown) or '(none)'}; choose from {', '.join(SIZES)}")
    command = ("python bench/memory.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    if args.group:
        group_rows = []
        for size in sizes:  # each size's line as soon as it is measured
            g = run_size(size, measure_group)
            group_rows.append(g)
            print(f"{size} group: {g.params:,} params in {g.seconds:.0f} s: daemon {g.daemon.hwm / MIB:,.0f} MiB, "
                  + ", ".join(f"rank {i} {p.hwm / MIB:,.0f} MiB ({p.hwm / g.params:.1f} B/param)"
                              for i, p in enumerate(g.ranks)), file=sys.stderr, flush=True)
        before_group = load_group_rows(args.before) if args.before else None
        return publish(args, [asdict(r) for r in group_rows], render_group(group_rows, before_group, command),
                       GROUP_SECTION)
    if args.group and args.device != "cpu":
        ap.error("--group measures the CPU worker group; use it without --device")
    if "1B" in sizes and args.device == "cpu":
        ap.error("--sizes 1B needs --device cuda (two nodes need about 50 GB of memory)")
    rows = []
    for size in sizes:
        row = run_size(size, lambda size, root: measure(size, root, args.device))
        rows.append(row)
        print(f"{size}: {row.params:,} params in {row.seconds:.0f} s: daemon {row.daemon.hwm / MIB:,.0f} MiB, "
              f"worker {row.worker.hwm / MIB:,.0f} MiB ({row.total / row.params:.1f} B/param together; shared "
              f"slots {row.worker.shmem / MIB:,.0f} MiB in each)"
              + (f"; worker GPU {row.gpu / MIB:,.0f} MiB ({row.gpu / row.params:.1f} B/param)" if row.gpu else ""),
              file=sys.stderr, flush=True)
        if args.json:  # each size as soon as it is measured: a later size may not finish
            args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    if args.device != "cpu":
        return publish(args, [asdict(r) for r in rows], render_gpu(rows, command, gpu_name()), GPU_SECTION)
    before = load_rows(args.before) if args.before else None
    return publish(args, [asdict(r) for r in rows], render(rows, before, command), SECTION)


def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return out.splitlines()[0] if out else "an unnamed GPU"


def render_gpu(rows: list[Row], command: str, device: str) -> str:
    """The `## Memory on a GPU` section: host memory beside the worker's GPU memory, per size, and the slope."""
    out = [GPU_SECTION, "",
           f"`{command}` on one {device}: the run of `## Memory` with `train.device = cuda` (autocast bf16, "
           "the default precision on CUDA; AdamW). Host columns as there (VmHWM of the daemon and the worker of "
           "the node whose two peaks sum higher; machine = both with the shared slots once). GPU = the "
           "largest `used_memory` nvidia-smi listed for either worker while sampling (every 0.25 s), the CUDA "
           "context and the caching allocator's reserve included. At 1B no periodic checkpoint is written "
           "(two nodes' 20 GB checkpoints do not fit the host's disk twice over); the run ends 8 s after the "
           "averaged outer step instead.", "",
           "| model | parameters | daemon host MiB (B/param) | worker host MiB (B/param) | machine host MiB (B/param) "
           "| worker GPU MiB (B/param) | averaged outer steps | seconds |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{v / MIB:,.0f} ({per_param(v, r.params)})" for v in (r.daemon.hwm, r.worker.hwm, r.machine, r.gpu)]
        out.append(f"| {r.size} | {r.params:,} | " + " | ".join(cells) + f" | {r.averaged} | {r.seconds:.0f} |")
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        slope = [(vb - va) / (b.params - a.params) for va, vb in
                 ((a.daemon.hwm, b.daemon.hwm), (a.worker.hwm, b.worker.hwm), (a.machine, b.machine), (a.gpu, b.gpu))]
        out.append(f"| marginal ({a.size} -> {b.size}) | | " + " | ".join(f"+{x:.1f} B/param" for x in slope) + " | | |")
    out += ["", "Expected on a GPU, from the code (`## Memory`, \"Where the bytes go\"): the worker's GPU holds "
            "the parameters, gradients, AdamW state and its step temporary (4 + 4 + 8 + 4 = 20 B/param at the "
            "AdamW step); its host memory keeps the fp32 master copies (theta at publish and the outer momentum, "
            "8 B/param) and the four shared slots (16 B/param, mapped by the daemon too)."]
    return "\n".join(out) + "\n"


def run_size(size: str, measure_one: Callable[[str, Path], RowT]) -> RowT:
    """One size's run in a temporary home directory, removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix=f"starling-mem-{size}-"))
    try:
        return measure_one(size, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def publish(args: argparse.Namespace, rows: list[dict[str, Any]], text: str, section: str) -> int:
    """--json, the report on stdout and, with --write-docs, `section` of docs/benchmarks.md."""
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(text)
    if args.write_docs:
        replace_section(DOCS, section, text)
        print(f"written to {DOCS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

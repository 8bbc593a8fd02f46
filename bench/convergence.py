"""Convergence benchmark: data-parallel all-reduce vs DiLoCo vs NoLoCo, N replicas in one process.

Each of N replicas trains the `stdlib-lm` task on its own shard (PeerIDs "replica-0".."replica-N-1"),
for the same total compute in every method (N replicas x T inner steps x B sequences):

- ddp:    one model, gradients averaged over the N replicas' batches at every step (what DDP computes);
- diloco: H inner Adam steps per replica, then every replica applies the all-reduced mean Delta
          (heavy-ball outer step, node/worker/outer.py), so all replicas share one phi;
- noloco: H inner steps, then random pairs (a fresh permutation each outer step, pairs (p[j], p[j+N/2])
          as in the reference code) exchange phi and Delta; each applies the NoLoCo step with its pair's means.

DiLoCo and NoLoCo replicas are `node.worker.trainer.Trainer`s - the worker's own inner step, publish, outer step
and rebase - with the exchange done in memory (blocking mode). Reported per method and N: the validation
loss (mean over replicas, and of the replicas' averaged weights), the spread of the replicas' slow weights
(sqrt(mean_i |phi_i - mean phi|^2) / |mean phi|), and the bytes each replica would send per inner step
(fp32; a ring all-reduce sends 2(N-1)/N of the vector, a NoLoCo pair sends phi and Delta once).

    .venv/bin/python bench/convergence.py            # the full run (N = 4 and 8), writes docs/benchmarks.md
    .venv/bin/python bench/convergence.py --quick    # a smoke run in well under a minute; prints only
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from node.bridge.exchange import ExchangeOutcome
from node.config.train import TrainConfig
from node.worker.task import TaskContext, autocast, load_task
from node.worker.trainer import Trainer, default_optimizer, lr_at

METHODS = ("ddp", "diloco", "noloco")
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
SECTION = "## Convergence"


@dataclass
class BenchConfig:
    """The model and schedule of every run (a small model, so the whole table fits ~10 min on 2 cores)."""

    outer_steps: int = 20
    inner_steps: int = 50
    batch_size: int = 8
    seq_len: int = 64
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    lr: float = 2e-3
    warmup: int = 50
    alpha: float = 0.5
    beta: float = 0.7
    gamma: float = 0.7
    data_bytes: int = 1_000_000
    eval_batches: int = 8
    seed: int = 0

    @property
    def total_steps(self) -> int:
        return self.outer_steps * self.inner_steps

    def train_config(self, outer: str) -> TrainConfig:
        cfg = TrainConfig(
            outer=outer if outer in ("noloco", "diloco") else "noloco",
            device="cpu",
            inner_steps=self.inner_steps,
            alpha=self.alpha,
            beta=self.beta,
            gamma=self.gamma,
            lr=self.lr,
            warmup=self.warmup,
            total_steps=self.total_steps,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            data_bytes=self.data_bytes,
            eval_batches=self.eval_batches,
            overlap=False,
            max_lag=0,
            seed=self.seed,
        )
        cfg.validate()
        return cfg


QUICK = BenchConfig(outer_steps=8, inner_steps=5, batch_size=4, seq_len=32, d_model=32, n_layers=1,
                    n_heads=2, warmup=4, data_bytes=200_000, eval_batches=2)


@dataclass
class RunResult:
    method: str
    replicas: int
    initial_val: float
    val_mean: float  # mean over replicas of each replica's validation loss
    val_avg_model: float  # validation loss of the replicas' averaged weights
    spread: float  # relative spread of the slow weights
    bytes_per_step: float  # per replica, per inner step
    params: int
    seconds: float
    # (inner steps per replica, validation loss) along the run, when asked for (`curve_every`): the loss
    # against the step that bench/wan.py multiplies by a measured time per step.
    curve: list[tuple[int, float]] = field(default_factory=list)


def replica_ids(n: int, prefix: str = "replica") -> list[str]:
    """The replicas' PeerIDs, which pick their data shards: another prefix gives other shards."""
    return [f"{prefix}-{i}" for i in range(n)]


def relative_spread(vectors: list[torch.Tensor]) -> float:
    """sqrt(mean_i |v_i - mean v|^2) / |mean v|, in float64 so identical replicas give exactly 0."""
    mean = torch.stack(vectors).double().mean(0)
    var = sum(float((v.double() - mean).pow(2).sum()) for v in vectors) / len(vectors)
    return math.sqrt(var) / max(float(mean.norm()), 1e-12)


def allreduce_bytes(numel: int, n: int) -> float:
    """Bytes one replica sends in a ring all-reduce of `numel` fp32 values among n."""
    return 2 * (n - 1) / n * numel * 4


def run_ddp(bc: BenchConfig, n: int, ids: list[str] | None = None, curve_every: int = 0) -> RunResult:
    """The data-parallel stand-in: one model, the N replicas' gradients averaged at every step (`ids`: the
    replicas' PeerIDs, as in `run_outer`; `curve_every`: record the validation loss every so many steps)."""
    started = time.monotonic()
    cfg = bc.train_config("noloco")
    device = torch.device("cpu")
    names = ids if ids is not None else replica_ids(n)
    if len(names) != n:
        raise ValueError(f"{len(names)} replica ids for {n} replicas")
    tasks = [load_task(cfg.task, TaskContext(cfg, pid, device)) for pid in names]
    model = tasks[0].build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = default_optimizer(model, cfg)  # the trainers' inner optimizer, for a like-for-like baseline
    streams = [t.train_stream() for t in tasks]
    initial = tasks[0].evaluate(model)
    curve = [(0, initial)] if curve_every else []
    for step in range(bc.total_steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step)
        optimizer.zero_grad(set_to_none=True)
        for task, stream in zip(tasks, streams, strict=True):
            with autocast(device):
                loss = task.loss(model, stream.next_batch()) / n
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        if curve_every and (step + 1) % curve_every == 0 and step + 1 < bc.total_steps:
            curve.append((step + 1, tasks[0].evaluate(model)))
    val = tasks[0].evaluate(model)
    curve += [(bc.total_steps, val)] if curve_every else []
    numel = sum(p.numel() for p in params)
    return RunResult("ddp", n, initial, val, val, 0.0, allreduce_bytes(numel, n), numel,
                     time.monotonic() - started, curve)


def averaged_model_loss(trainers: list[Trainer]) -> float:
    """The validation loss of the replicas' mean slow weights (evaluated in the first trainer's model,
    whose own weights are put back afterwards)."""
    mean_phi = torch.stack([t.phi for t in trainers]).mean(0)
    probe = trainers[0]
    keep = probe.phi.clone()
    probe.scatter_theta(mean_phi)
    val_avg = probe.evaluate()
    probe.scatter_theta(keep)
    return val_avg


def publish_all(trainers: list[Trainer], phis: list[torch.Tensor], deltas: list[torch.Tensor]) -> None:
    """Every replica trains to its next publish (H inner steps) and publishes phi and Delta into its slots."""
    for t in trainers:
        while not t.publish_due():
            t.inner_step()
    for t, phi, delta in zip(trainers, phis, deltas, strict=True):
        t.publish(phi, delta)


def random_groups(n: int, generator: torch.Generator) -> list[list[int]]:
    """NoLoCo's random pairs among n replicas: a fresh permutation p from `generator`, pairs (p[j], p[j+n/2])
    as in the reference code, and an odd one out in a group of its own (a solo step)."""
    perm = torch.randperm(n, generator=generator).tolist()
    half = n // 2
    groups = [[perm[j], perm[j + half]] for j in range(half)]
    if n % 2:
        groups.append([perm[-1]])
    return groups


def run_outer(bc: BenchConfig, n: int, method: str, home: Path, prefix: str = "replica",
              ids: list[str] | None = None, curve: bool = False) -> RunResult:
    """DiLoCo or NoLoCo with N in-process `Trainer`s and an in-memory exchange (`prefix`: see replica_ids;
    `ids`: the replicas' PeerIDs themselves, e.g. real daemons', whose data shards they then train on;
    `curve`: record the replicas' mean validation loss after every outer step)."""
    started = time.monotonic()
    cfg = bc.train_config(method)
    names = ids if ids is not None else replica_ids(n, prefix)
    if len(names) != n:
        raise ValueError(f"{len(names)} replica ids for {n} replicas")
    trainers = [Trainer(cfg, home / pid, pid) for pid in names]
    numel = trainers[0].numel
    initial = trainers[0].evaluate()
    phis = [torch.empty(numel) for _ in trainers]
    deltas = [torch.empty(numel) for _ in trainers]
    pairing = torch.Generator().manual_seed(bc.seed + 1)
    points = [(0, initial)] if curve else []
    for outer in range(bc.outer_steps):
        publish_all(trainers, phis, deltas)
        groups = [list(range(n))] if method == "diloco" else random_groups(n, pairing)
        for group in groups:
            sum_phi = torch.stack([phis[i] for i in group]).sum(0)  # what the daemon leaves: the group's sums
            sum_delta = torch.stack([deltas[i] for i in group]).sum(0)
            for i in group:
                trainers[i].apply_result(ExchangeOutcome(len(group)), sum_phi, sum_delta)
        if curve and outer + 1 < bc.outer_steps:
            points.append(((outer + 1) * bc.inner_steps, sum(t.evaluate() for t in trainers) / n))
    vals = [t.evaluate() for t in trainers]
    val_avg = averaged_model_loss(trainers)
    spread = relative_spread([t.phi for t in trainers])
    per_outer = allreduce_bytes(numel, n) if method == "diloco" else 2 * numel * 4
    points += [(bc.total_steps, sum(vals) / n)] if curve else []
    return RunResult(method, n, initial, sum(vals) / n, val_avg, spread, per_outer / bc.inner_steps, numel,
                     time.monotonic() - started, points)


def run(bc: BenchConfig, replica_counts: list[int], methods: list[str]) -> list[RunResult]:
    results = []
    with tempfile.TemporaryDirectory(prefix="starling-bench-") as tmp:
        for n in replica_counts:
            for method in methods:
                if method == "ddp":
                    r = run_ddp(bc, n)
                else:
                    r = run_outer(bc, n, method, Path(tmp) / f"{method}-{n}")
                print(f"  N={n} {method:<6} val {r.val_mean:.4f} (avg model {r.val_avg_model:.4f}) "
                      f"spread {r.spread:.2e}  {r.seconds:.0f} s", file=sys.stderr, flush=True)
                results.append(r)
    return results


def _bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024:
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return f"{b:.1f} TiB"


def table(results: list[RunResult]) -> str:
    lines = [
        "| N | method | val loss (mean of replicas) | val loss (averaged weights) | weight spread | "
        "bytes sent / replica / step | time |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.replicas} | {r.method} | {r.val_mean:.4f} | {r.val_avg_model:.4f} | {r.spread:.2e} | "
            f"{_bytes(r.bytes_per_step)} | {r.seconds:.0f} s |"
        )
    return "\n".join(lines)


def verdict(results: list[RunResult]) -> str:
    """One line per N: does the paper's ordering DDP < NoLoCo <= DiLoCo hold here, and by how much?"""
    out = []
    for n in sorted({r.replicas for r in results}):
        by = {r.method: r.val_mean for r in results if r.replicas == n}
        if set(by) != set(METHODS):
            continue
        ddp, dil, nol = by["ddp"], by["diloco"], by["noloco"]
        holds = ddp < nol <= dil
        gap = (dil - nol) / ddp * 100
        out.append(
            f"- N = {n}: the paper's ordering DDP < NoLoCo <= DiLoCo {'holds' if holds else 'does not hold'} "
            f"(DDP {ddp:.4f}, NoLoCo {nol:.4f}, DiLoCo {dil:.4f}). Relative to DDP: DiLoCo {(dil / ddp - 1) * 100:+.1f}%, "
            f"NoLoCo {(nol / ddp - 1) * 100:+.1f}%; NoLoCo vs DiLoCo, the paper's measure "
            f"(DiLoCo - NoLoCo) / DDP: {gap:+.2f}% ({'NoLoCo better' if gap > 0 else 'NoLoCo worse' if gap < 0 else 'equal'})."
        )
    return "\n".join(out)


def render_section(bc: BenchConfig, results: list[RunResult], command: str, wall: float, cpu: float) -> str:
    params = results[0].params if results else 0
    cfg = ", ".join(f"{f.name}={getattr(bc, f.name)}" for f in dataclasses.fields(bc))
    return (
        f"{SECTION}\n\n"
        f"Command: `{command}` ({wall / 60:.1f} min wall, {cpu / 60:.1f} min CPU, on a {os.cpu_count()}-core VM "
        f"shared with other jobs; {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
        f"Python {platform.python_version()}).\n\n"
        f"Task `stdlib-lm`, a {params / 1e6:.2f}M-parameter byte-level transformer. Every method spends the same "
        f"compute: N replicas x {bc.total_steps} inner steps x {bc.batch_size} sequences of {bc.seq_len} bytes, "
        f"each replica on its own shard. DDP = gradients all-reduced every step (one model, N x the batch); "
        f"DiLoCo = all-reduce of Delta every H = {bc.inner_steps} steps; NoLoCo = random pairs every H steps "
        f"(the same H for both, which favours DiLoCo: the paper ran DiLoCo at H = 100 against NoLoCo at 50). "
        f"Validation loss in nats per byte on the shared held-out files. Settings: {cfg}.\n\n"
        f"{table(results)}\n\n"
        f"{verdict(results)}\n\n"
        "How to read it: one seed, a tiny model and a few minutes of training, against a paper that trained "
        "125M-6.8B models for 25k steps; seed-to-seed variation has not been measured here, so differences "
        "in the second decimal deserve more trust than those in the third. The spread column is NoLoCo's "
        "price: its replicas are N close models, not one (DiLoCo's and DDP's spread is zero by construction); "
        "the paper shows it shrinking as the inner learning rate decays. Per step, DiLoCo's ring all-reduce "
        "sends fewer bytes than NoLoCo's pair exchange (phi and Delta, twice the vector); what NoLoCo buys is "
        "latency and robustness - one partner instead of a collective that waits for the slowest replica - "
        "which a single-process benchmark does not measure.\n"
    )


def write_section(text: str, path: Path = DOCS) -> None:
    """Replace the `## Convergence` section of docs/benchmarks.md (or add it), keeping everything else."""
    if path.exists():
        lines = path.read_text().splitlines(keepends=True)
    else:
        lines = ["# Benchmarks\n"]
    start = next((i for i, line in enumerate(lines) if line.rstrip() == SECTION), None)
    if start is None:
        body = "".join(lines).rstrip("\n") + "\n\n" + text
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        tail = "".join(lines[end:])
        body = "".join(lines[:start]) + text + ("\n" + tail if tail else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run (N = 2 and 4); does not write docs")
    parser.add_argument("--replicas", default=None, help="comma-separated replica counts (default 4,8)")
    parser.add_argument("--outer-steps", type=int, default=None, help="outer steps per run")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--write", action=argparse.BooleanOptionalAction, default=None,
                        help="write the table into docs/benchmarks.md (default: yes unless --quick)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    bc = dataclasses.replace(QUICK) if args.quick else BenchConfig()
    if args.outer_steps is not None:
        if args.outer_steps < 1:
            parser.error("--outer-steps must be at least 1")
        bc = dataclasses.replace(bc, outer_steps=args.outer_steps)
    try:
        counts = [int(x) for x in (args.replicas or ("2,4" if args.quick else "4,8")).split(",")]
    except ValueError:
        parser.error("--replicas takes comma-separated integers, e.g. 4,8")
    if any(n < 2 for n in counts):
        parser.error("--replicas: each count must be at least 2")
    started, cpu_started = time.monotonic(), time.process_time()
    results = run(bc, counts, list(METHODS))
    wall, cpu = time.monotonic() - started, time.process_time() - cpu_started
    command = "python bench/convergence.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = render_section(bc, results, command.strip(), wall, cpu)
    print(text)
    if args.write if args.write is not None else not args.quick:
        write_section(text)
        print(f"written to {DOCS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

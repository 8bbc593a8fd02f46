"""Machines of different speeds, in-process: does adding slow machines to a swarm help its fast ones?

Issue #12 asks that {2 fast + 2 slow} reach a validation loss no worse than {2 fast} alone at equal wall
time. This simulation isolates the averaging rule from the machine it runs on: 4 `Trainer`s (the real
worker's training and outer step, bench/convergence.py's model at d_model 64) take outer steps together,
the fast ones with H = 20 inner steps each and the slow ones with H = 8 (the pace of `sync.pace = swarm`
gives a machine 2.5x slower about that many), and exchange in memory. Equal wall time is equal outer steps.
Each pair's outer step is the worker's own `apply_result` with the partner's samples, as the daemon hands
it over.

Rows (the fast members' mean validation loss, mean of 3 seeds; each seed draws other data shards):
- random pairs: a fresh random perfect matching every outer step (the schedule of node/averaging/pairing.py when
  every trainer is one speed tier);
- like-speed tiers: node/averaging/pairing.py's `matching` with the trainers' speeds (the landed rule);
- all four averaged: every outer step one group of all four, the sample-weighted mean of Delta (not what
  the daemon does: a reference for what complete mixing would give);
- 2 fast alone: the two fast trainers, paired with each other every step.

`python bench/hetero_sim.py` (about 5 min on 2 cores) prints the table; `--write-docs` also records it in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch
from convergence import BenchConfig  # bench/convergence.py, beside this script (run as `python bench/...`)

from node.averaging.pairing import BYE, matching
from node.bridge.exchange import ExchangeOutcome
from node.bridge.ipc import Publish
from node.worker.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent

DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## Heterogeneous machines, in-process"
FAST_H, SLOW_H = 20, 8
OUTER_STEPS = 40
SEEDS = (0, 1, 2)
MODES = ("random pairs", "like-speed tiers", "all four averaged", "2 fast alone")


@dataclasses.dataclass
class Row:
    mode: str
    fast: list[float]  # per seed: mean over the fast trainers
    slow: list[float]  # per seed: mean over the slow trainers (empty for "2 fast alone")
    fast_slow_share: float  # fast-slow exchanges over all exchanges

    @property
    def fast_mean(self) -> float:
        return sum(self.fast) / len(self.fast)

    @property
    def slow_mean(self) -> float | None:
        return sum(self.slow) / len(self.slow) if self.slow else None


def _pairs(mode: str, names: list[str], speeds: dict[str, float], step: int, gen: torch.Generator) -> list[tuple[int, int]]:
    if mode == "random pairs":
        perm = torch.randperm(len(names), generator=gen).tolist()
        half = len(names) // 2
        return [(perm[j], perm[j + half]) for j in range(half)]
    m = matching(names, step, speeds if mode == "like-speed tiers" else None)
    return [(names.index(a), names.index(b)) for a, b in m.items() if b is not BYE and a < b]


def run(mode: str, seed: int) -> tuple[list[float], list[float], int, int]:
    bc = BenchConfig(outer_steps=OUTER_STEPS, inner_steps=FAST_H, d_model=64, seed=seed)
    cfg = dataclasses.replace(bc.train_config("noloco"), total_steps=OUTER_STEPS * FAST_H)
    home = Path(tempfile.mkdtemp(prefix="starling-hetero-sim-"))
    roles = [("fast", FAST_H)] * 2 + ([] if mode == "2 fast alone" else [("slow", SLOW_H)] * 2)
    names = [f"s{seed}-{role}{i}" for i, (role, _) in enumerate(roles)]
    # The schedule's tiers come from samples/s as member records show them: H sequences per outer step.
    speeds = {n: float(h * cfg.batch_size) for n, (_, h) in zip(names, roles, strict=True)}
    trainers = [Trainer(cfg, home / n, n) for n in names]
    numel = trainers[0].numel
    phis = [torch.empty(numel) for _ in trainers]
    deltas = [torch.empty(numel) for _ in trainers]
    pubs: list[Publish | None] = [None] * len(trainers)
    gen = torch.Generator().manual_seed(seed + 7)
    mixed = total = 0
    for step in range(OUTER_STEPS):
        for k, (t, (_, h)) in enumerate(zip(trainers, roles, strict=True)):
            for _ in range(h):
                t.inner_step()
            pubs[k] = t.publish(phis[k], deltas[k])
        if mode == "all four averaged":
            weight = sum(p.samples for p in pubs if p)
            mean_delta = sum(deltas[k] * (pubs[k].samples / weight) for k in range(len(trainers)))  # type: ignore[union-attr]
            sum_phi = torch.stack(phis).sum(0)
            for t in trainers:
                t.apply_result(ExchangeOutcome(len(trainers)), sum_phi, mean_delta * len(trainers))
            continue
        for a, b in _pairs(mode, names, speeds, step, gen):
            total += 1
            mixed += roles[a][0] != roles[b][0]
            sum_phi, sum_delta = phis[a] + phis[b], deltas[a] + deltas[b]
            for me, other in ((a, b), (b, a)):
                outcome = ExchangeOutcome(2, partner_samples=pubs[other].samples)  # type: ignore[union-attr]
                trainers[me].apply_result(outcome, sum_phi, sum_delta)
    losses = [t.evaluate() for t in trainers]
    fast = [v for v, (role, _) in zip(losses, roles, strict=True) if role == "fast"]
    slow = [v for v, (role, _) in zip(losses, roles, strict=True) if role == "slow"]
    return fast, slow, mixed, total


def measure(modes: tuple[str, ...] = MODES, seeds: tuple[int, ...] = SEEDS) -> list[Row]:
    rows = []
    for mode in modes:
        fast, slow, mixed, total = [], [], 0, 0
        for seed in seeds:
            f, s, m, t = run(mode, seed)
            fast.append(sum(f) / len(f))
            if s:
                slow.append(sum(s) / len(s))
            mixed, total = mixed + m, total + t
            print(f"  {mode}, seed {seed}: fast {fast[-1]:.4f}" + (f", slow {slow[-1]:.4f}" if s else ""), flush=True)
        rows.append(Row(mode, fast, slow, mixed / total if total else 0.0))
    return rows


def table(rows: list[Row]) -> str:
    alone = next((r.fast_mean for r in rows if r.mode == "2 fast alone"), None)
    lines = ["| rule | fast members' val loss (mean of seeds) | per seed | slow members' | fast-slow share of exchanges | vs 2 fast alone |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        vs = f"{r.fast_mean - alone:+.4f}" if alone is not None else "-"
        slow = f"{r.slow_mean:.4f}" if r.slow_mean is not None else "-"
        share = f"{r.fast_slow_share:.0%}" if r.mode not in ("2 fast alone", "all four averaged") else "-"
        lines.append(f"| {r.mode} | {r.fast_mean:.4f} | {', '.join(f'{v:.4f}' for v in r.fast)} | {slow} | {share} | {vs} |")
    return "\n".join(lines)


def render_section(rows: list[Row], wall: float) -> str:
    return (f"{SECTION}\n\nCommand: `python bench/hetero_sim.py --write-docs` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"{wall / 60:.1f} min). 2 fast trainers (H = {FAST_H}) and 2 slow ones (H = {SLOW_H}), {OUTER_STEPS} outer "
            f"steps, bench/convergence.py's model at d_model 64, seeds {', '.join(map(str, SEEDS))} (bench/hetero_sim.py "
            "says why each row). Lower is better; the last column is the fast members' loss minus that of the "
            "2 fast trainers alone (issue #12: adding machines must not hurt).\n\n" + table(rows) + "\n")


def write_section(text: str, path: Path = DOCS) -> None:
    doc = path.read_text()
    start = doc.find(SECTION + "\n")
    if start < 0:
        doc = doc.rstrip("\n") + "\n\n" + text
    else:
        nxt = doc.find("\n## ", start + len(SECTION))
        doc = doc[:start] + text + ("" if nxt < 0 else doc[nxt:])
    path.write_text(doc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true", help=f"record the table in {DOCS.name}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    rows = measure()
    section = render_section(rows, time.monotonic() - started)
    print(section)
    if args.write_docs:
        write_section(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())

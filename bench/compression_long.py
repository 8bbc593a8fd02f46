"""Compression over the long run: each preset against bf16 NoLoCo, DiLoCo in bf16 and DiLoCo with the same
Delta compressor, over >= 200 outer steps and several seeds (issue #51, item 1).

Why a second compression bench: error feedback defers what top-k drops to later outer steps, so over the 20
outer steps of bench/compression.py a deferral and a loss look the same. Here every run is long, repeated over
seeds, and records its validation loss every few outer steps, so a gap that closes with time (a deferral) reads
apart from one that stays (a loss).

A *variant* is ``method:preset[:name=value,...]``:

- ``method``: ``noloco`` (random pairs each outer step, phi and Delta exchanged: Starling's exchange) or
  ``diloco`` (all N replicas in one group, the mean of their Deltas as the wire carried them, one shared phi:
  what SparseLoCo and its production descendants compress, the strongest fair peer);
- ``preset``: a `sync.compression` preset (protocols/compress.py): ``none`` is bf16 on the wire; a lossy one's
  Delta codec (top-k with error feedback) is applied to DiLoCo's Deltas too, so both methods get the same
  compressor, and its phi fragments to NoLoCo's phi. A preset on trial (`EXPERIMENTAL` there: SparseLoCo's
  2-bit top-k, protocols/lowbit.py) is added to the presets of the run's own process only;
- options: ``alpha``, ``beta``, ``gamma`` replace the outer step's (e.g. ``alpha=0``: error feedback alone in
  place of outer momentum, as SparseLoCo has it).

The simulation is bench/compression.py's `run_method` (bench/convergence.py's model, shards, schedule and pairing:
`Trainer`s with the worker's own publish, error feedback and outer step; exchanges through the real codecs).
One process per (variant, seed), `--jobs` at a time, each with one torch thread; each finished run appends one
JSON line (the figures, the curve, the tree, the command, the machine, the time) to `--jsonl`, and a rerun skips
what the file already holds, so a long campaign can be stopped and resumed.

    .venv/bin/python bench/compression_long.py                          # the default campaign (hours on 2 cores)
    .venv/bin/python bench/compression_long.py --variants noloco:none,diloco:none --seeds 0,1,2 --jobs 2
    .venv/bin/python bench/compression_long.py --report [--write-docs]  # the table from the JSON lines only
    .venv/bin/python bench/compression_long.py --quick --jsonl /tmp/q.jsonl   # a smoke run (seconds)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/compression_long.py` as well as `-m bench.compression_long`
    sys.path.insert(0, str(ROOT))

from bench.compression import register_trial_preset, run_method  # noqa: E402
from bench.convergence import QUICK, BenchConfig  # noqa: E402
from bench.records import append_record, provenance, tree_id  # noqa: E402
from bench.records import read_records as _read_records  # noqa: E402
from protocols.compress import EXPERIMENTAL, PRESETS  # noqa: E402
from starling_testing.report import publish  # noqa: E402

DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## Compression over the long run"
RESULTS = ROOT / "bench" / "results" / "compression_long.jsonl"
METHODS = ("noloco", "diloco")
OPTIONS = ("alpha", "beta", "gamma")
BASELINE = "noloco:none"
DILOCO = "diloco:none"
DEFAULT_VARIANTS = ("noloco:none", "diloco:none", "noloco:high", "diloco:high", "noloco:medium", "diloco:medium")
#: Issue #51's bar: a preset at <= 0.1 B/param each way reaches bf16 NoLoCo's loss within the seeds' spread,
#: or within 0.01 where the spread is smaller.
MIN_TOLERANCE = 0.01
MIN_SEEDS = 3


class VariantError(ValueError):
    """A variant spec that names no method, preset or option this bench knows."""


@dataclass(frozen=True)
class Variant:
    method: str
    preset: str
    options: tuple[tuple[str, float], ...] = ()

    @classmethod
    def parse(cls, spec: str) -> Variant:
        parts = spec.strip().split(":")
        if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
            raise VariantError(f"{spec!r}: expected method:preset[:name=value,...], e.g. noloco:none or diloco:high")
        method, preset = parts[0], parts[1]
        if method not in METHODS:
            raise VariantError(f"{spec!r}: unknown method {method!r}; expected one of {', '.join(METHODS)}")
        if preset not in PRESETS and preset not in EXPERIMENTAL:
            raise VariantError(f"{spec!r}: unknown preset {preset!r}; expected one of "
                               f"{', '.join([*PRESETS, *EXPERIMENTAL])}")
        options: dict[str, float] = {}
        for item in (parts[2].split(",") if len(parts) == 3 else []):
            name, _, value = item.partition("=")
            if name not in OPTIONS:
                raise VariantError(f"{spec!r}: unknown option {name!r}; expected {', '.join(OPTIONS)}")
            try:
                options[name] = float(value)
            except ValueError:
                raise VariantError(f"{spec!r}: option {name} needs a number, got {value!r}") from None
            if not math.isfinite(options[name]) or options[name] < 0:
                raise VariantError(f"{spec!r}: option {name} must be a finite number >= 0")
        return cls(method, preset, tuple(sorted(options.items())))

    @property
    def name(self) -> str:
        opts = ",".join(f"{k}={v:g}" for k, v in self.options)
        return f"{self.method}:{self.preset}" + (f":{opts}" if opts else "")

    def config(self, bc: BenchConfig) -> BenchConfig:
        return dataclasses.replace(bc, **dict(self.options))


def parse_variants(text: str) -> list[Variant]:
    """Comma-separated variants; a piece with "=" and no ":" is an option of the variant before it
    ("noloco:none:alpha=0,beta=1,diloco:none" is two variants)."""
    specs: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if "=" in piece and ":" not in piece and specs:
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    if not specs:
        raise VariantError(f"no variant in {text!r}")
    return [Variant.parse(s) for s in specs]


def run_key(record: dict) -> tuple:
    """What makes two records the same run: the variant, the seed and the whole bench configuration."""
    return record["variant"], record["seed"], json.dumps(record["config"], sort_keys=True), record["replicas"]


def run_one(variant: Variant, seed: int, bc: BenchConfig, replicas: int, curve_every: int,
            command: str = "") -> dict:
    """One run in this process; its JSON record (`command`: the campaign's command line)."""
    torch.set_num_threads(1)
    register_trial_preset(variant.preset)  # on trial: a preset of this process only (the worker looks it up there)
    cfg = dataclasses.replace(variant.config(bc), seed=seed)
    tree = tree_id()  # the code that runs: read before the hour the run takes, in which HEAD may move
    with tempfile.TemporaryDirectory(prefix="starling-compression-long-") as tmp:
        r = run_method(cfg, replicas, variant.method, variant.preset, Path(tmp), curve_every=curve_every)
    return {
        "variant": variant.name, "method": variant.method, "preset": variant.preset, "seed": seed,
        "replicas": replicas, "config": dataclasses.asdict(dataclasses.replace(bc, seed=0)),  # options: in the name
        "bytes_per_param": r.bytes_per_param, "val_mean": r.val_mean, "val_avg_model": r.val_avg_model,
        "spread": r.spread, "pull_error": r.pull_error, "curve": r.curve, "seconds": round(r.seconds, 1),
        **provenance(command, tree),
    }


RECORD_KEYS = frozenset({"variant", "seed", "config", "replicas", "val_mean"})


def read_records(path: Path, keys: frozenset[str] = RECORD_KEYS) -> list[dict]:
    """Every well-formed record of `path` with all of `keys` (bench/phi_schemes.py reads its own with its own)."""
    return _read_records(path, keys)


@dataclass
class Row:
    """A variant's seeds at one configuration."""

    variant: str
    bytes_per_param: float
    vals: list[float]
    curves: list[list[tuple[int, float]]]
    spreads: list[float]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.vals)

    @property
    def range(self) -> float:
        return max(self.vals) - min(self.vals)

    def curve_mean(self) -> dict[int, float]:
        """Mean over seeds of the validation loss at each inner step every seed recorded."""
        steps = set.intersection(*(set(int(s) for s, _ in c) for c in self.curves)) if self.curves else set()
        return {s: statistics.fmean(v for c in self.curves for cs, v in c if int(cs) == s) for s in sorted(steps)}


def rows(records: Iterable[dict]) -> tuple[list[Row], dict]:
    """Rows of the configuration most runs share (the campaign's): the default variants first, in their order,
    then the others by name; and that configuration."""
    records = list(records)
    if not records:
        return [], {}
    by_config: dict[str, list[dict]] = {}
    for r in records:
        by_config.setdefault(json.dumps([r["config"], r["replicas"]], sort_keys=True), []).append(r)
    chosen = max(by_config.values(), key=len)
    seen: dict[str, dict[int, dict]] = {}
    for r in chosen:
        seen.setdefault(r["variant"], {})[r["seed"]] = r  # a repeated seed: its last record
    out = [Row(v, next(iter(by_seed.values()))["bytes_per_param"], [r["val_mean"] for r in by_seed.values()],
               [r.get("curve") or [] for r in by_seed.values()], [r["spread"] for r in by_seed.values()])
           for v, by_seed in seen.items()]
    order = {v: i for i, v in enumerate(DEFAULT_VARIANTS)}
    out.sort(key=lambda r: (order.get(r.variant, len(order)), r.variant))
    return out, {**chosen[0]["config"], "replicas": chosen[0]["replicas"]}


def verdict(row: Row, base: Row | None) -> str:
    """Issue #51's bar for one variant against `base`, bf16 under the same method."""
    if base is None or row.variant == base.variant:
        return "-"
    if len(row.vals) < MIN_SEEDS or len(base.vals) < MIN_SEEDS:
        return f"not judged ({min(len(row.vals), len(base.vals))} of {MIN_SEEDS} seeds)"
    tolerance = max(base.range, MIN_TOLERANCE)
    gap = row.mean - base.mean
    return f"{'reaches' if gap <= tolerance else 'does NOT reach'} it ({gap:+.3f} against {tolerance:.3f})"


def render(records: list[dict], path: Path = RESULTS) -> str:
    table_rows, config = rows(records)
    if not table_rows:
        return f"{SECTION}\n\nNo runs recorded yet.\n"
    by_name = {r.variant: r for r in table_rows}
    base, diloco = by_name.get(BASELINE), by_name.get(DILOCO)
    trees = sorted({r["tree"] for r in records})
    commands = sorted({r.get("command") or "python bench/compression_long.py" for r in records})
    utcs = sorted(r["utc"] for r in records)
    machines = sorted({r["machine"].split(", ")[0] + ", " + r["machine"].split(", ")[1] for r in records
                       if r.get("machine", "").count(", ") >= 1})
    outer, inner = config.get("outer_steps"), config.get("inner_steps")
    lines = [SECTION, "",
             "Commands: " + ", ".join(f"`{c}`" for c in commands) + " (`make bench-compression-long`); "
             "`python bench/compression_long.py --report --write-docs` renders this section from the raw results in "
             f"`{_shown(path)}` "
             f"({len(records)} runs, {utcs[0]} to {utcs[-1]} UTC, trees {', '.join(trees)}, {'; '.join(machines)}). "
             f"N = {config.get('replicas')} replicas of bench/convergence.py's model, {outer} outer steps of H = {inner} "
             f"inner steps ({outer * inner if outer and inner else '?'} in all), each variant over the seeds shown "
             "(model init, shards and pairing). `noloco`: random pairs exchanging phi and Delta (Starling); `diloco`: "
             "all replicas in one group, their Deltas all-gathered (SparseLoCo's setting); a preset's Delta codec and "
             "error feedback apply to both. B/param: what one replica sends per outer step (NoLoCo: phi and Delta to "
             "its partner; DiLoCo: its Delta, to every other replica). Val loss: the mean over replicas at the end, "
             "then mean, standard deviation and range over seeds.", "",
             "| variant | B/param each way | seeds | val loss | sd | range | vs bf16 NoLoCo | vs bf16 DiLoCo | "
             "issue #51's bar: bf16 of the same method within its seeds' range (at least 0.01) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in table_rows:
        sd = statistics.stdev(r.vals) if len(r.vals) > 1 else 0.0
        vs = f"{r.mean - base.mean:+.3f}" if base and r is not base else "-"
        vd = f"{r.mean - diloco.mean:+.3f}" if diloco and r is not diloco else "-"
        lines.append(f"| {r.variant} | {r.bytes_per_param:.3f} | {len(r.vals)} | {r.mean:.4f} | {sd:.4f} | "
                     f"{min(r.vals):.4f}-{max(r.vals):.4f} | {vs} | {vd} | "
                     f"{verdict(r, by_name.get(r.variant.split(':')[0] + ':none'))} |")
    if base and base.curves:
        base_curve = base.curve_mean()
        marks = _marks(sorted(base_curve))
        if marks:
            lines += ["", "The gap to bf16 NoLoCo along the run (each row's mean over its own seeds against bf16's over "
                      "all of its seeds; a gap that shrinks is error feedback's deferral, one that stays is a loss):", "",
                      "| variant | " + " | ".join(f"at {s:,} inner steps" for s in marks) + " |",
                      "|---|" + "---|" * len(marks)]
            for r in table_rows:
                curve = r.curve_mean()
                cells = [f"{base_curve[s]:.3f}" if r is base else
                         (f"{curve[s] - base_curve[s]:+.3f}" if s in curve else "-") for s in marks]
                lines.append(f"| {r.variant} | " + " | ".join(cells) + " |")
            lines.append("")
            lines.append("(The bf16 NoLoCo row gives its own loss; the others their difference from it.)")
    return "\n".join(lines) + "\n"


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _marks(steps: list[int], count: int = 5) -> list[int]:
    """About `count` recorded steps spread over the run, the last one included."""
    if not steps:
        return []
    picks = {steps[min(len(steps) - 1, round(i * (len(steps) - 1) / (count - 1)))] for i in range(count)}
    return sorted(picks)


def campaign(variants: list[Variant], seeds: list[int], bc: BenchConfig, replicas: int, curve_every: int,
             jobs: int, path: Path, passthrough: list[str], command: str) -> int:
    """Run what `path` does not hold yet, `jobs` processes at a time; 0 when every run finished."""
    done = {run_key(r) for r in read_records(path)}
    todo = []
    for seed in seeds:
        for v in variants:
            probe = {"variant": v.name, "seed": seed, "replicas": replicas,
                     "config": dataclasses.asdict(dataclasses.replace(bc, seed=0))}
            if run_key(probe) not in done:
                todo.append((v, seed))
    print(f"{len(todo)} run(s) to do, {len(variants) * len(seeds) - len(todo)} already in {path}", file=sys.stderr)
    running: list[tuple[subprocess.Popen, str, float]] = []
    failed = 0
    while todo or running:
        while todo and len(running) < jobs:
            v, seed = todo.pop(0)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--one", v.name, "--seeds", str(seed),
                   "--jsonl", str(path), "--command", command, *passthrough]
            running.append((subprocess.Popen(cmd, cwd=ROOT), f"{v.name} seed {seed}", time.monotonic()))
        time.sleep(1)
        for proc, label, started in list(running):
            if proc.poll() is not None:
                running.remove((proc, label, started))
                ok = proc.returncode == 0
                failed += not ok
                print(f"{label}: {'done' if ok else f'FAILED (exit {proc.returncode})'} in "
                      f"{time.monotonic() - started:.0f} s; {len(todo)} to start, {len(running)} running",
                      file=sys.stderr, flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated method:preset[:opts]")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--outer-steps", type=int, default=200)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--curve-every", type=int, default=10, help="outer steps between validation points")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one process and one torch thread each")
    parser.add_argument("--jsonl", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="bench/convergence.py's QUICK model (a smoke run)")
    parser.add_argument("--report", action="store_true", help="only render the table from --jsonl")
    parser.add_argument("--write-docs", action="store_true", help=f"make the table {SECTION!r} of docs/benchmarks.md")
    parser.add_argument("--one", metavar="VARIANT", help=argparse.SUPPRESS)  # a child of the campaign
    parser.add_argument("--command", default="", help=argparse.SUPPRESS)  # the campaign's command, for the record
    args = parser.parse_args(argv)
    try:
        variants = parse_variants(args.one or args.variants)
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError as e:
        parser.error(str(e))
    if args.outer_steps < 1 or args.replicas < 2 or args.curve_every < 0 or args.jobs < 1 or not seeds:
        parser.error("--outer-steps >= 1, --replicas >= 2, --curve-every >= 0, --jobs >= 1 and a seed are required")
    bc = dataclasses.replace(QUICK if args.quick else BenchConfig(), outer_steps=args.outer_steps)
    command = "python bench/compression_long.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    if args.one:
        record = run_one(variants[0], seeds[0], bc, args.replicas, args.curve_every, args.command or command)
        append_record(args.jsonl, record)
        print(f"{record['variant']} seed {record['seed']}: val {record['val_mean']:.4f} ({record['seconds']:.0f} s)",
              file=sys.stderr)
        return 0 if math.isfinite(record["val_mean"]) else 1
    rc = 0
    if not args.report:
        passthrough = ["--outer-steps", str(args.outer_steps), "--replicas", str(args.replicas),
                       "--curve-every", str(args.curve_every), *(["--quick"] if args.quick else [])]
        rc = campaign(variants, seeds, bc, args.replicas, args.curve_every, args.jobs, args.jsonl, passthrough, command)
    publish(render(read_records(args.jsonl), args.jsonl), DOCS, SECTION, write=args.write_docs)
    return rc


if __name__ == "__main__":
    sys.exit(main())

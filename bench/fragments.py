"""Streaming fragments: NoLoCo in memory with the model cut into F fragments synced at staggered times.

Issue #23, item 2 (after Streaming DiLoCo, arXiv 2501.18512): the flat parameter vector is cut into F
contiguous, block-aligned slices (protocols/compress.py's `fragment_range`; the flat order is the model's
parameter order, so a slice is a run of layers). Within each outer period of H inner steps, fragment f syncs
at inner step floor((f + 1) * H / F): its Delta (theta - phi on the slice, plus its error feedback) and its
phi cross the wire, each sync with its own random partner (a fresh permutation per fragment sync), and the
NoLoCo outer step (momentum + pull towards the partner's phi) is applied to that slice alone, with the slice
of the outer momentum as its state. Every fragment syncs once per period: the same bytes per period as
the whole-vector exchange, a peak per sync F times smaller, and F independent partner draws per period.

Everything else is bench/compression.py's simulation (the same model, shards, schedule, pairing generator
and codecs: `none` = bf16, `medium` = top 256/4096 of Delta + error feedback, phi in int8 on 1 of 4
sub-ranges, here of the fragment, rotating with the fragment's own sync count). `stale` variants apply each
sync's result one slot later (H/F inner steps; a whole period when F = 1), rebased as the worker does
(theta <- phi_new + (theta_now - theta_published)): in the daemon the exchange overlaps compute.

With F = 1 a run is bench/compression.py's `run_preset`, bit for bit (tests/test_bench_fragments.py).

    .venv/bin/python bench/fragments.py --seeds 0,1,2 --jsonl /tmp/fragments.jsonl   # every variant
    .venv/bin/python bench/fragments.py --quick                                      # a smoke run
    .venv/bin/python bench/fragments.py --table /tmp/fragments.jsonl                 # the markdown table
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.convergence import (
    QUICK,
    BenchConfig,
    averaged_model_loss,
    random_groups,
    relative_spread,
    replica_ids,
)
from node.bridge.exchange import ExchangeOutcome
from node.worker.outer import OuterHyper, OuterOptimizer
from node.worker.trainer import Trainer
from protocols.codec import TensorCodec, round_trip
from protocols.compress import Compression, get_compression


@dataclass(frozen=True)
class Variant:
    """One row: how many fragments, which `sync.compression` preset on each, and whether results come late."""

    name: str
    fragments: int = 1
    compression: str = "none"
    stale: bool = False


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("none"),
    Variant("f2", 2),
    Variant("f4", 4),
    Variant("medium", 1, "medium"),
    Variant("f4-medium", 4, "medium"),
    Variant("stale", 1, "none", stale=True),
    Variant("f4-stale", 4, "none", stale=True),
    Variant("medium-stale", 1, "medium", stale=True),
    Variant("f4-medium-stale", 4, "medium", stale=True),
)}


@dataclass
class FragmentResult:
    variant: str
    fragments: int
    compression: str
    stale: bool
    seed: int
    params: int
    bytes_per_param: float  # per node per outer period, each way (payload: phi and Delta)
    peak_bytes: int  # the largest single sync one node sends, each way
    val_mean: float
    val_avg_model: float
    spread: float
    seconds: float


def fragment_ranges(numel: int, fragments: int) -> list[tuple[int, int]]:
    """[lo, hi) of each fragment: F contiguous ranges of whole codec blocks (the daemon's fragment rule)."""
    split = Compression("fragments", fragments=fragments)
    return [split.fragment_range(numel, f) for f in range(fragments)]


def slot_ends(inner_steps: int, fragments: int) -> list[int]:
    """The inner step within a period at which each fragment syncs: floor((f + 1) * H / F), staggered."""
    if not 1 <= fragments <= inner_steps:
        raise ValueError(f"{fragments} fragments for H = {inner_steps}: need 1 <= F <= H")
    return [(f + 1) * inner_steps // fragments for f in range(fragments)]


def wire(x: torch.Tensor, codec: TensorCodec) -> torch.Tensor:
    """What the wire carries of `x` under `codec`."""
    out = torch.empty_like(x)
    round_trip(codec, x, out)
    return out


def wire_sum(xs: list[torch.Tensor], codec: TensorCodec) -> torch.Tensor:
    """The group's sum of what the wire carries of each `x`, added in order (a pair: wire(a) + wire(b))."""
    total = wire(xs[0], codec)
    for x in xs[1:]:
        total.add_(wire(x, codec))
    return total


class Replica:
    """One trainer synced fragment by fragment, through the worker's own methods: `Trainer.set_fragments`,
    `publish_fragment` and `apply_result(fragment=...)`. Why not a copy of the algebra here: the bench then
    measures the code the daemon will drive, error feedback, the exact pull and the rebase on the slice
    included, and a change to the worker's outer step shows in these figures."""

    def __init__(self, trainer: Trainer, fragments: int = 1) -> None:
        self.trainer = trainer
        self.ranges = trainer.set_fragments(fragments)

    @property
    def theta_published(self) -> torch.Tensor:
        """The trainer's theta at each fragment's latest publish (each fragment writes its own slice)."""
        return self.trainer.theta_published

    @property
    def residual(self) -> torch.Tensor | None:
        """The trainer's error-feedback residual (allocated by the first lossy result)."""
        return self.trainer.residual

    def publish(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Publish fragment [lo, hi) and return (phi, D) of the fragment as it goes on the wire."""
        phi, delta = torch.empty(hi - lo), torch.empty(hi - lo)
        self.trainer.publish_fragment(lo, hi, phi, delta)
        return phi, delta

    def apply(self, lo: int, hi: int, group_size: int, sum_phi: torch.Tensor | None, sum_delta: torch.Tensor | None,
              preset: Compression, phi_range: tuple[int, int] | None) -> None:
        """The outer step on fragment [lo, hi) and its rebase (`Trainer.apply_result` with the fragment).

        `sum_phi` and `sum_delta` are the group's fragment-sized sums; `phi_range` (relative to the fragment)
        is where phi crossed the wire (None: all of it)."""
        self.trainer.apply_result(ExchangeOutcome(group_size, compression=preset.name, phi_range=phi_range),
                                  sum_phi, sum_delta, fragment=(lo, hi))


def fragment_step(phi: torch.Tensor, momentum: torch.Tensor, lo: int, hi: int, hyper: OuterHyper, group_size: int,
                  sum_delta: torch.Tensor, sum_phi: torch.Tensor | None = None,
                  phi_range: tuple[int, int] | None = None) -> None:
    """The NoLoCo outer step on fragment [lo, hi) of the flat `phi` and `momentum`, in place, given the
    group's fragment-sized sums (group_size 1: a solo step on our own Delta, heavy-ball): the worker's
    `OuterOptimizer.step` with its `span`. The state of the step is the momentum's slice: fragments never
    touch each other's coordinates."""
    outer = OuterOptimizer("noloco", hyper, 0)
    outer.momentum = momentum  # the caller's, stepped in place
    if group_size >= 2 and sum_phi is None:
        raise ValueError("a group step needs the group's sum of phi")
    # Our own Delta only weights a pair of unequal samples, which this step does not take.
    outer.step(phi[lo:hi], sum_delta, group_size=group_size, sum_phi=sum_phi, sum_delta=sum_delta,
               phi_range=phi_range, span=(lo, hi))


def run_variant(bc: BenchConfig, n: int, variant: Variant, home: Path, wire_dtype: str = "bf16") -> FragmentResult:
    """N replicas, H inner steps per period and `bc.outer_steps` periods, fragment by fragment."""
    started = time.monotonic()
    preset = get_compression(variant.compression)
    cfg = bc.train_config("noloco")
    replicas = [Replica(Trainer(cfg, home / pid, pid), variant.fragments) for pid in replica_ids(n)]
    numel = replicas[0].trainer.numel
    ranges = fragment_ranges(numel, variant.fragments)
    ends = slot_ends(bc.inner_steps, variant.fragments)
    dcodec, pcodec = preset.delta_codec(wire_dtype), preset.phi_codec(wire_dtype)
    pairing = torch.Generator().manual_seed(bc.seed + 1)
    syncs = [0] * variant.fragments  # each fragment's own sync count (rotates medium's phi sub-range)
    sent = peak = 0
    pending: list[tuple[int, int, int, list[int], torch.Tensor | None, torch.Tensor | None, tuple[int, int] | None]] = []

    def apply_pending() -> None:
        for lo, hi, _, group, sum_phi, sum_delta, phi_range in pending:
            for i in group:
                replicas[i].apply(lo, hi, len(group), None if sum_phi is None else sum_phi.clone(),
                                  None if sum_delta is None else sum_delta.clone(), preset, phi_range)
        pending.clear()

    for outer in range(bc.outer_steps):
        for f, end in enumerate(ends):
            for r in replicas:
                while r.trainer.step < outer * bc.inner_steps + end:
                    r.trainer.inner_step()
            if variant.stale:
                apply_pending()  # the previous slot's result, one slot late, before this slot's publish
            lo, hi = ranges[f]
            if hi <= lo:
                continue
            phi_range = preset.fragment_range(hi - lo, preset.fragment_of(syncs[f])) if preset.lossy else None
            plo, phi_hi = phi_range if phi_range is not None else (0, hi - lo)
            syncs[f] += 1
            published = [r.publish(lo, hi) for r in replicas]
            size = dcodec.encoded_size(hi - lo) + pcodec.encoded_size(phi_hi - plo)
            sent += size
            peak = max(peak, size)
            for group in random_groups(n, pairing):
                if len(group) == 1:
                    pending.append((lo, hi, f, group, None, None, None))
                    continue
                sum_phi = torch.zeros(hi - lo)
                sum_phi[plo:phi_hi] = wire_sum([published[i][0][plo:phi_hi] for i in group], pcodec)
                sum_delta = wire_sum([published[i][1] for i in group], dcodec)
                pending.append((lo, hi, f, group, sum_phi, sum_delta, phi_range))
            if not variant.stale:
                apply_pending()
    apply_pending()  # the last slot's result (stale): nothing is left to train on
    trainers = [r.trainer for r in replicas]
    vals = [t.evaluate() for t in trainers]
    spread = relative_spread([t.phi for t in trainers])
    val_avg = averaged_model_loss(trainers)  # last: it leaves trainer 0's model at its phi
    return FragmentResult(variant.name, variant.fragments, variant.compression, variant.stale, bc.seed, numel,
                          sent / bc.outer_steps / numel, peak, sum(vals) / n, val_avg, spread,
                          time.monotonic() - started)


def table(results: list[FragmentResult]) -> str:
    """Mean and range over seeds per variant, in the order of VARIANTS."""
    lines = ["| variant | F | preset | result | seeds | B/param/period each way | peak per sync | "
             "val loss (mean of replicas) | val loss (avg model) | spread |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    order = {name: i for i, name in enumerate(VARIANTS)}
    names = sorted({r.variant for r in results}, key=lambda v: order.get(v, len(order)))
    for name in names:
        rows = [r for r in results if r.variant == name]
        r0 = rows[0]

        def cell(xs: list[float], fmt: str) -> str:
            if len(xs) == 1:
                return format(xs[0], fmt)
            return f"{format(statistics.mean(xs), fmt)} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"

        peak = f"{r0.peak_bytes / 1024:.0f} KiB ({r0.peak_bytes / r0.params:.3f} B/param)"
        lines.append(
            f"| {name} | {r0.fragments} | {r0.compression} | {'1 slot late' if r0.stale else 'at once'} | "
            f"{','.join(str(r.seed) for r in rows)} | {r0.bytes_per_param:.3f} | {peak} | "
            f"{cell([r.val_mean for r in rows], '.4f')} | {cell([r.val_avg_model for r in rows], '.4f')} | "
            f"{cell([r.spread for r in rows], '.2e')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--outer-steps", type=int, default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (model init, shards and pairing)")
    parser.add_argument("--jsonl", type=Path, default=None, help="append each run's result to this file")
    parser.add_argument("--table", type=Path, default=None, help="print the table of the runs in this file; run nothing")
    args = parser.parse_args(argv)
    if args.table is not None:
        rows = [FragmentResult(**json.loads(line)) for line in args.table.read_text().splitlines() if line.strip()]
        print(table(rows))
        return 0
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    bc = QUICK if args.quick else BenchConfig()
    if args.outer_steps is not None:
        bc = dataclasses.replace(bc, outer_steps=args.outer_steps)
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            for name in args.variants.split(","):
                sbc = dataclasses.replace(bc, seed=seed)
                r = run_variant(sbc, args.replicas, VARIANTS[name], Path(tmp) / f"{name}-{seed}")
                print(f"{name} seed {seed}: {r.val_mean:.4f} spread {r.spread:.2e} "
                      f"{r.bytes_per_param:.3f} B/param, peak {r.peak_bytes} B ({r.seconds:.0f}s)",
                      file=sys.stderr, flush=True)
                if args.jsonl is not None:
                    with args.jsonl.open("a") as fh:
                        fh.write(json.dumps(dataclasses.asdict(r)) + "\n")
                results.append(r)
    print(table(results))
    return 0 if all(math.isfinite(r.val_mean) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

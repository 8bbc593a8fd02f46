"""Compression benchmark: NoLoCo in memory with what each `sync.compression` preset puts on the wire.

The in-process NoLoCo simulation of bench/convergence.py (the same model, schedule, shards and pairing:
`node.worker.trainer.Trainer`s, random pairs each outer step), with the exchange done through the real codecs: each
pair's sums are those the daemon leaves (both partners' values round-tripped through the wire encoding, phi on
the preset's fragment only), and each trainer applies them with `apply_result(compression=..., phi_range=...)`,
so the error feedback and the fragment pull are the worker's own.

Reported per preset: bytes per parameter per outer step each way, the final validation loss (mean over
replicas, and of their averaged weights), the replicas' spread (as bench/convergence.py), and the pull's
error: |applied pull - exact pull| / |exact pull| averaged over every pair and outer step, where the exact
pull is gamma/2 * (phi_partner - phi_own) on every coordinate in fp32, beside the spread it acts on.

    .venv/bin/python bench/compression.py                 # N = 4, all presets, prints a markdown table
    .venv/bin/python bench/compression.py --quick         # a smoke run
    .venv/bin/python bench/compression.py --presets none --first high,medium [--first-own-exact]
                                  # `auto`'s ramp on a fast link: its first steps lossy, then `none`
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench.convergence import (
    QUICK,
    BenchConfig,
    averaged_model_loss,
    publish_all,
    random_groups,
    relative_spread,
    replica_ids,
)
from node.bridge.exchange import ExchangeOutcome
from node.worker.trainer import Trainer
from protocols.codec import round_trip
from protocols.compress import EXPERIMENTAL, PRESETS, get_compression


@dataclass
class CompressionResult:
    preset: str
    seed: int
    bytes_per_param: float
    val_mean: float
    val_avg_model: float
    spread: float
    pull_error: float  # mean over pairs and outer steps of |pull - exact| / |exact|
    seconds: float
    curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (inner steps, mean val loss)


def register_trial_preset(name: str) -> None:
    """Make a preset on trial (`EXPERIMENTAL`) known to this bench process's `PRESETS`: the simulation looks
    presets up as the worker does (`get_compression`). A shipped preset's name changes nothing."""
    if name in EXPERIMENTAL:
        PRESETS.setdefault(name, EXPERIMENTAL[name])


def wire(x: torch.Tensor, codec: object) -> torch.Tensor:
    """What the wire carries of `x` under `codec`."""
    out = torch.empty_like(x)
    round_trip(codec, x, out)  # type: ignore[arg-type]
    return out


def run_preset(bc: BenchConfig, n: int, name: str, home: Path, wire_dtype: str = "bf16",
               first: tuple[str, ...] = (), first_own_exact: bool = False) -> CompressionResult:
    """NoLoCo under preset `name` (see `run_method`)."""
    return run_method(bc, n, "noloco", name, home, wire_dtype, first, first_own_exact)


def run_method(bc: BenchConfig, n: int, method: str, name: str, home: Path, wire_dtype: str = "bf16",
               first: tuple[str, ...] = (), first_own_exact: bool = False, curve_every: int = 0,
               ids: list[str] | None = None) -> CompressionResult:
    """`method` ("noloco": random pairs; "diloco": all N in one group, the mean of their Deltas as the wire
    carried them, each trainer's own error feedback: SparseLoCo's setting) under preset `name`.

    `first`: the presets of the first outer steps, `name` after them (what `auto` does on a fast link: a
    `high` probe, then `medium`, then `none`); `first_own_exact`: those steps apply each trainer's own Delta
    in full (`ExchangeOutcome(own_exact=True)`, what the daemon does on `auto`'s ramp). `curve_every`: the mean
    validation loss every that many outer steps (and at the end) into `curve`. Presets are looked up as the worker
    looks them up (`get_compression`): a bench's experimental preset is added to `PRESETS` in its process.
    `ids`: the replicas' PeerIDs (e.g. real daemons', whose data shards they then train on; default
    `replica_ids(n)`)."""
    if method not in ("noloco", "diloco"):
        raise ValueError(f"unknown method {method!r}")
    label = "+".join([*first, name]) + (" (own exact first)" if first_own_exact else "") if first else name
    if method == "diloco":
        # One shared phi needs every replica to apply the same sum: each one's own Delta in full
        # (`own_in_full`, a NoLoCo rule: every replica there has its own phi) would make them drift apart.
        # DiLoCo therefore runs a preset's plain-error-feedback twin, the same codec and bytes.
        with _plain_twins((*first, name)) as twin:
            return _run_method(bc, n, method, twin(name), home, wire_dtype, tuple(twin(p) for p in first),
                               first_own_exact, curve_every, label, ids)
    return _run_method(bc, n, method, name, home, wire_dtype, first, first_own_exact, curve_every, label, ids)


@contextlib.contextmanager
def _plain_twins(names: tuple[str, ...]) -> Iterator[Callable[[str], str]]:
    """Within the block, each preset of `names` that applies its own Delta in full has a twin in `PRESETS` with
    plain error feedback (``<name>~plain``); the callable maps a name to what DiLoCo runs."""
    added = []
    for name in names:
        preset = get_compression(name)
        if preset.own_in_full and f"{name}~plain" not in PRESETS:
            PRESETS[f"{name}~plain"] = dataclasses.replace(preset, name=f"{name}~plain", own_in_full=False)
            added.append(f"{name}~plain")
    try:
        yield lambda name: f"{name}~plain" if get_compression(name).own_in_full else name
    finally:
        for twin in added:
            PRESETS.pop(twin, None)


def _run_method(bc: BenchConfig, n: int, method: str, name: str, home: Path, wire_dtype: str,
                first: tuple[str, ...], first_own_exact: bool, curve_every: int, label: str,
                ids: list[str] | None = None) -> CompressionResult:
    started = time.monotonic()
    cfg = bc.train_config(method)
    names = ids if ids is not None else replica_ids(n)
    if len(names) != n:
        raise ValueError(f"{len(names)} replica ids for {n} replicas")
    trainers = [Trainer(cfg, home / pid, pid) for pid in names]
    numel = trainers[0].numel
    phis = [torch.empty(numel) for _ in trainers]
    deltas = [torch.empty(numel) for _ in trainers]
    pairing = torch.Generator().manual_seed(bc.seed + 1)
    errors: list[float] = []
    curve: list[tuple[int, float]] = []
    for outer in range(bc.outer_steps):
        step_name = first[outer] if outer < len(first) else name
        preset = get_compression(step_name)
        dcodec, pcodec = preset.delta_codec(wire_dtype), preset.phi_codec(wire_dtype)
        publish_all(trainers, phis, deltas)
        groups = [list(range(n))] if method == "diloco" else random_groups(n, pairing)
        for group in groups:
            if len(group) == 1:  # an odd one out: a solo step, nothing on the wire
                trainers[group[0]].apply_result(ExchangeOutcome(1, compression=step_name))
                continue
            if method == "diloco":
                # All-gather of the compressed Deltas (a top-k sum is no top-k, so no ring all-reduce): every
                # replica sums what the wire carried of each; phi is not exchanged (one shared phi).
                sum_delta = torch.stack([wire(deltas[i], dcodec) for i in group]).sum(0)
                for i in group:
                    outcome = ExchangeOutcome(len(group), compression=step_name,
                                              own_exact=first_own_exact and outer < len(first))
                    trainers[i].apply_result(outcome, phis[i].clone(), sum_delta.clone())
                continue
            a, b = group
            lo, hi = preset.fragment_range(numel, preset.fragment_of(outer)) if preset.lossy else (0, numel)
            sum_phi = torch.zeros(numel)
            sum_phi[lo:hi] = wire(phis[a][lo:hi], pcodec) + wire(phis[b][lo:hi], pcodec)
            sum_delta = wire(deltas[a], dcodec) + wire(deltas[b], dcodec)
            for me, other in ((a, b), (b, a)):
                t = trainers[me]
                exact = (phis[other] - phis[me]) * (bc.gamma / 2)
                before = t.outer.momentum.clone()
                outcome = ExchangeOutcome(2, compression=step_name, phi_range=(lo, hi) if preset.lossy else None,
                                          own_exact=first_own_exact and outer < len(first))
                t.apply_result(outcome, sum_phi.clone(), sum_delta.clone())
                # The pull is what the momentum got beyond alpha*m + beta*mean(Delta as the wire carried it).
                pull = t.outer.momentum - (before * bc.alpha + sum_delta * (bc.beta / 2))
                norm = float(exact.norm())
                if norm > 0:
                    errors.append(float((pull - exact).norm()) / norm)
        if curve_every and (outer + 1) % curve_every == 0 and outer + 1 < bc.outer_steps:
            curve.append(((outer + 1) * bc.inner_steps, sum(t.evaluate() for t in trainers) / n))
    vals = [t.evaluate() for t in trainers]
    if curve_every:
        curve.append((bc.total_steps, sum(vals) / n))
    val_avg = averaged_model_loss(trainers)
    final = get_compression(name)
    per_param = final.delta_codec(wire_dtype).encoded_size(numel) / numel if method == "diloco" \
        else final.bytes_per_param(numel, wire_dtype)
    return CompressionResult(label, bc.seed, per_param, sum(vals) / n, val_avg,
                             relative_spread([t.phi for t in trainers]), float(np.mean(errors)) if errors else 0.0,
                             time.monotonic() - started, curve)


def table(results: list[CompressionResult]) -> str:
    lines = ["| preset | seed | B/param each way | val loss (mean) | val loss (avg model) | spread | pull error |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.preset} | {r.seed} | {r.bytes_per_param:.3f} | {r.val_mean:.4f} | {r.val_avg_model:.4f}"
                     f" | {r.spread:.2e} | {r.pull_error:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--outer-steps", type=int, default=None)
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (model init, shards and pairing)")
    parser.add_argument("--first", default="", metavar="P1,P2,...",
                        help="presets of the first outer steps, each preset of --presets after them (e.g. high,medium: "
                             "what sync.compression = auto does on a fast link)")
    parser.add_argument("--first-own-exact", action="store_true",
                        help="the --first steps apply each trainer's own Delta in full (the daemon's rule on auto's ramp)")
    args = parser.parse_args(argv)
    first = tuple(p.strip() for p in args.first.split(",") if p.strip())
    unknown = [p for p in (*first, *args.presets.split(",")) if p not in PRESETS and p not in EXPERIMENTAL]
    if unknown:
        parser.error(f"unknown preset(s) {', '.join(unknown)}; choose from {', '.join([*PRESETS, *EXPERIMENTAL])}")
    for name in (*first, *args.presets.split(",")):  # a preset on trial: this process's own (protocols/compress.py)
        register_trial_preset(name)
    bc = QUICK if args.quick else BenchConfig()
    if args.outer_steps is not None:
        bc = dataclasses.replace(bc, outer_steps=args.outer_steps)
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            for name in args.presets.split(","):
                sbc = dataclasses.replace(bc, seed=seed)
                r = run_preset(sbc, args.replicas, name, Path(tmp) / f"{name}-{seed}", first=first,
                               first_own_exact=args.first_own_exact)
                print(f"{name} seed {seed}: {r.val_mean:.4f} spread {r.spread:.2e} pull error {r.pull_error:.2f} "
                      f"({r.seconds:.0f}s)", file=sys.stderr, flush=True)
                results.append(r)
    print(table(results))
    return 0 if all(math.isfinite(r.val_mean) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Ways to send phi for compressed NoLoCo, screened over the first outer steps of the long run's schedule
(issue #51, item 3).

Why a screen: bench/compression_long.py showed that, with the same Delta codec, NoLoCo ends 0.12-0.14 above
DiLoCo, and that its replicas drift 26 times further apart than bf16 NoLoCo's: phi's pull on 1 of 32 fragments
per outer step is too weak. A long run costs 45 minutes of a core, so candidate ways to send phi are first
compared here over the first `--outer-steps` (40) outer steps of the same 200-step schedule (the learning rate is
that of a 200-step run), one process per scheme, against bf16 NoLoCo, the preset's own fragments and DiLoCo with the
same Delta. What wins here earns a long run; what loses is kept, with its figures, so the rows can be rerun.

Every scheme below sends Delta as `k64q2` does (SparseLoCo's top 64 of 4096 at 2 bits, error feedback: 0.029
B/param) and differs in phi only; the pull is the worker's own outer step, given the partner's phi as the scheme
delivers it (`Trainer.apply_result`), so only what crosses the wire is simulated:

- ``none``: bf16 NoLoCo (4 B/param), the yardstick; ``alone``: no exchange at all, each replica's solo steps
  (what a trainer gets by not joining: a scheme worse than it makes joining harmful); ``frag``: the preset's own
  phi, int8 on 1 of 32 fragments; ``frag:F``: the same on 1 of F fragments (more of phi's bytes, the same Delta);
  ``diloco``: all replicas in one group, one shared phi, the same Delta codec (the strongest fair peer).
- ``oracle``: the pull on the top 64 of every 4096 entries of |phi_partner - phi_own|, exact. Not buildable (it
  needs the partner's phi to choose), it bounds every scheme that sends phi on 1.6% of the entries.
- ``mom``: each side sends phi in bf16 (with 12-bit indices) on the top 64 of 4096 of |its outer momentum|, the
  entries it moved most lately; the other pulls there. ``moveacc``: the same on a decayed sum (0.9 per outer
  step) of its own phi moves, cleared where sent (4 B/param of state).
- ``wz:F,B,C``: phi on 1 of F fragments at B bits per entry, as side information (Wyner-Ziv): the sender puts
  phi on a dithered grid of step d per 4096-block and sends each entry's grid index modulo 2^B; the receiver
  takes the grid point with that residue nearest its own phi. d = C x the sender's estimate of the partner
  distance there (the RMS of the distances it decoded on that block, its own grid's variance taken off, doubled
  where many decoded near the range's edge, a sign of wraps; before any, 4 x the RMS of its own Delta), so one
  outlier does not set a block's step (the prototype of "phi with side information" took the block's maximum,
  and failed).
- ``choco:P`` / ``chocox:P``: CHOCO-gossip's public copies, one per ordered pair (every replica starts from the
  same phi, so every copy starts there): at a meeting each side sends its phi's move from the copy the pair keeps
  of it through P (a preset's Delta codec, e.g. ``k64q2``, or ``lrR``: each weight matrix's move at rank R, its
  factors in bf16, vectors whole in bf16), and both add what arrived. ``choco`` pulls on the copies' difference
  (x_i + x^_j - x^_i, CHOCO's rule), ``chocox`` towards the partner's copy itself.
- ``lrdiff:R``: the pull on the pair's difference phi_b - phi_a at rank R per weight matrix (vectors whole).
  A power iteration on that difference is linear in each side's phi, so two round trips (each side's phi Q, then
  its phi^T P, in fp32: differences of large values) give both sides the same factors, as PowerSGD all-reduces
  them; here the truncated SVD, the bound that iteration approaches. ``lrpi:R``: the same through one power
  iteration warm-started from the asker's last Q, what a wire would do.
- a ``+gG`` suffix: the pull's gamma G instead of bench/convergence.py's 0.7 (the pull enters the outer momentum,
  alpha 0.5, so one pull moves a pair's difference by gamma / (1 - alpha) of it in all: 0.5 closes it, 0.7
  overshoots; matters where a coordinate is pulled rarely, as on fragments).
- a ``+smean`` suffix: the pair's Delta sum as SparseLoCo aggregates it (the reference CCLoco decompresses with
  ``scatter_reduce(..., reduce="mean")``): an entry kept by one sender counts at its value, not half of it.
- a ``+own`` suffix: each replica applies its own Delta in full and the others' as the wire carried them, and
  error feedback keeps what the wire has not carried yet for its next partner (today the worker applies its own
  Delta as the wire carried it too, so that both partners take the same step, except on `auto`'s ramp).

    .venv/bin/python bench/phi_schemes.py --schemes none,frag,diloco,oracle --jobs 2
    .venv/bin/python bench/phi_schemes.py --report --write-docs   # the table from bench/results/phi_schemes.jsonl
    .venv/bin/python bench/phi_schemes.py --quick --jsonl /tmp/q.jsonl --schemes wz:4,2,2.5   # a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/phi_schemes.py` as well as `-m bench.phi_schemes`
    sys.path.insert(0, str(ROOT))

from bench.compression import wire  # noqa: E402
from bench.compression_long import _shown, read_records  # noqa: E402
from bench.convergence import QUICK, BenchConfig, publish_all, random_groups, relative_spread, replica_ids  # noqa: E402
from bench.records import append_record, provenance, tree_id  # noqa: E402
from node.bridge.exchange import ExchangeOutcome  # noqa: E402
from node.worker.trainer import Trainer  # noqa: E402
from protocols.compress import BLOCK, EXPERIMENTAL, MAX_FRAGMENTS, PRESETS, Compression  # noqa: E402
from starling_testing.report import publish  # noqa: E402

DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## phi for compressed NoLoCo: schemes screened"
RESULTS = ROOT / "bench" / "results" / "phi_schemes.jsonl"
DELTA_PRESET = "k64q2"
KEEP = 64  # entries per BLOCK that `oracle`, `mom` and `moveacc` pull on (as k64q2 keeps of Delta)
BASES = ("none", "alone", "frag", "diloco", "oracle", "mom", "moveacc")
MOVE_DECAY = 0.9
RECORD_KEYS = frozenset({"scheme", "seed", "outer_steps", "schedule_outer_steps", "val"})
EDGE_SHARE = 0.05  # `wz`: the share of a block decoded near its range's edge that doubles the step
FIRST_SIGMA = 4.0  # `wz`: before any measurement, the partner distance is taken as this x RMS(own Delta)


class SchemeError(ValueError):
    """A scheme spec this bench does not know."""


@dataclass(frozen=True)
class Scheme:
    base: str
    smean: bool = False
    wz: tuple[int, int, float] | None = None  # (fragments F, bits B, scale C) of `wz`
    own: bool = False
    fragments: int | None = None  # `frag:F`: phi on 1 of F fragments (None: the Delta preset's own, 32)
    copies: str | None = None  # `choco:P` / `chocox:P`: the preset whose Delta codec carries phi's move
    gamma: float | None = None  # `+gG`: the pull's gamma instead of bench/convergence.py's (0.7)

    @classmethod
    def parse(cls, spec: str) -> Scheme:
        text, *mods = spec.strip().split("+")
        gammas = [m for m in mods if m.startswith("g")]
        mods = [m for m in mods if not m.startswith("g")]
        if unknown := set(mods) - {"smean", "own"}:
            raise SchemeError(f"{spec!r}: unknown modifier {sorted(unknown)[0]!r}; expected +smean, +own or +gG")
        gamma = None
        if gammas:
            try:
                gamma = float(gammas[-1][1:])
            except ValueError:
                raise SchemeError(f"{spec!r}: +gG takes the pull's gamma, e.g. +g0.5") from None
            if not (math.isfinite(gamma) and 0 <= gamma <= 2):
                raise SchemeError(f"{spec!r}: +gG needs 0 <= G <= 2")
        return dataclasses.replace(cls._parse(spec, text, mods), gamma=gamma)

    @classmethod
    def _parse(cls, spec: str, text: str, mods: list[str]) -> Scheme:
        smean, own = "smean" in mods, "own" in mods
        if smean and own:
            raise SchemeError(f"{spec!r}: +smean and +own do not combine here")
        if text.startswith("wz:"):
            try:
                f, b, c = text[3:].split(",")
                wz = (int(f), int(b), float(c))
            except ValueError:
                raise SchemeError(f"{spec!r}: wz takes F,B,C (fragments, bits, scale), e.g. wz:4,2,2.5") from None
            if not (1 <= wz[0] <= 64 and 1 <= wz[1] <= 8 and math.isfinite(wz[2]) and wz[2] > 0):
                raise SchemeError(f"{spec!r}: wz needs 1 <= F <= 64, 1 <= B <= 8 and C > 0")
            return cls("wz", smean, wz, own)
        if text.startswith(("lrdiff:", "lrpi:")):
            base, _, rank = text.partition(":")
            if not (rank.isdigit() and 1 <= int(rank) <= 64):
                raise SchemeError(f"{spec!r}: {base}:R takes the rank, 1 to 64, e.g. {base}:2")
            return cls(base, smean, None, own, None, f"lr{rank}")
        if text.startswith(("choco:", "chocox:")):
            base, _, codec = text.partition(":")
            lowrank = codec.startswith("lr") and codec[2:].isdigit() and 1 <= int(codec[2:]) <= 64
            if not lowrank and (codec not in PRESETS and codec not in EXPERIMENTAL or codec == "none"):
                raise SchemeError(f"{spec!r}: {base}:P takes a lossy preset's name (e.g. {base}:k64q2) or lrR "
                                  "(rank R of each weight matrix's move, e.g. {base}:lr4)")
            return cls(base, smean, None, own, None, codec)
        if text.startswith("frag:"):
            try:
                fragments = int(text[5:])
            except ValueError:
                raise SchemeError(f"{spec!r}: frag:F takes a whole number of fragments, e.g. frag:16") from None
            if not 1 <= fragments <= MAX_FRAGMENTS:
                raise SchemeError(f"{spec!r}: frag:F needs 1 <= F <= {MAX_FRAGMENTS}")
            return cls("frag", smean, None, own, fragments)
        if text not in BASES:
            raise SchemeError(f"{spec!r}: unknown scheme; expected one of {', '.join(BASES)}, wz:F,B,C "
                              "(each with an optional +smean)")
        if text in ("none", "alone") and (smean or own):
            raise SchemeError(f"{spec!r}: +smean and +own need a lossy Delta (none sends all of it)")
        if own and text == "diloco":
            raise SchemeError(f"{spec!r}: +own is a pair's (the worker applies its own Delta in full in pairs only)")
        return cls(text, smean, None, own)

    @property
    def name(self) -> str:
        base = f"wz:{self.wz[0]},{self.wz[1]},{self.wz[2]:g}" if self.wz else self.base
        if self.copies is not None:
            base += f":{self.copies[2:]}" if self.base in ("lrdiff", "lrpi") else f":{self.copies}"
        base += f":{self.fragments}" if self.fragments is not None else ""
        return (base + ("+smean" if self.smean else "") + ("+own" if self.own else "")
                + (f"+g{self.gamma:g}" if self.gamma is not None else ""))

    @property
    def method(self) -> str:
        return "diloco" if self.base == "diloco" else "noloco"

    @property
    def preset(self) -> str:
        if self.base in ("none", "alone"):
            return "none"
        return DELTA_PRESET if self.fragments is None else f"{DELTA_PRESET}-f{self.fragments}"

    def compression(self) -> Compression:
        """The preset the worker applies under this scheme: the Delta preset's, with `frag:F`'s fragments."""
        if self.preset in PRESETS:
            return PRESETS[self.preset]
        base = EXPERIMENTAL[DELTA_PRESET]
        return base if self.fragments is None else dataclasses.replace(base, name=self.preset,
                                                                      fragments=self.fragments)


def parse_schemes(text: str) -> list[Scheme]:
    """Schemes separated by ';' or by ',' outside a wz's own F,B,C."""
    out: list[Scheme] = []
    pieces = [p.strip() for p in text.replace(";", ",").split(",")]
    i = 0
    while i < len(pieces):
        piece = pieces[i]
        if piece.startswith("wz:"):
            piece = ",".join(pieces[i:i + 3])
            i += 3
        else:
            i += 1
        if piece:
            out.append(Scheme.parse(piece))
    if not out:
        raise SchemeError(f"no scheme in {text!r}")
    return out


def bytes_per_param(scheme: Scheme, numel: int, shapes: list[tuple[int, ...]] = ()) -> float:
    """What one side sends per outer step, phi and Delta (framing excluded); `oracle` counts Delta only."""
    preset = scheme.compression()
    if scheme.base == "alone":
        return 0.0
    if scheme.base in ("none", "frag"):
        return preset.bytes_per_param(numel)
    delta = preset.delta_codec("bf16").encoded_size(numel) / numel
    if scheme.base in ("diloco", "oracle"):
        return delta
    if scheme.base in ("mom", "moveacc"):
        return delta + KEEP / BLOCK * (2 + 1.5)  # bf16 value and a 12-bit index per entry
    if scheme.base in ("lrdiff", "lrpi"):  # each side's phi times the factors, in fp32 (a difference of large values)
        assert scheme.copies is not None
        return delta + 2 * LowRank(int(scheme.copies[2:]), shapes).size_bytes() / numel
    if scheme.copies is not None and scheme.copies.startswith("lr"):
        return delta + LowRank(int(scheme.copies[2:]), shapes).size_bytes() / numel
    if scheme.copies is not None:
        return delta + copies_codec(scheme).encoded_size(numel) / numel
    assert scheme.wz is not None
    f, b, _ = scheme.wz
    return delta + (b / 8 + 4 / BLOCK) / f  # B bits per entry and an fp32 step per block, on 1 of F


class LowRank:
    """PowerSGD's idea for a public copy's move: each weight matrix's move as its best rank-R approximation
    (truncated SVD here: the bound a power iteration approaches), its two factors in bf16; vectors (biases,
    norms) whole in bf16. `shapes`: the model's parameters, in the flat vector's order."""

    def __init__(self, rank: int, shapes: list[tuple[int, ...]]) -> None:
        self.rank, self.shapes = rank, list(shapes)

    def size_bytes(self) -> int:
        total = 0
        for shape in self.shapes:
            if len(shape) == 2 and min(shape) > self.rank:
                total += 2 * self.rank * (shape[0] + shape[1])
            else:
                total += 2 * math.prod(shape)
        return total

    def power_step(self, move: torch.Tensor, warm: dict[int, torch.Tensor], seed: int) -> torch.Tensor:
        """PowerSGD's one power iteration per matrix, warm-started from `warm` (matrix index -> Q, updated in
        place; a seeded Gaussian the first time): P = orth(M Q), Q <- M^T P, M ~ P Q^T. M Q and M^T P are
        linear in M, so for M = phi_b - phi_a each side sends phi Q and then phi^T P, and both get the same
        factors without either knowing the other's phi (two round trips)."""
        out = torch.empty_like(move)
        at = 0
        for index, shape in enumerate(self.shapes):
            size = math.prod(shape)
            part = move[at:at + size]
            if len(shape) == 2 and min(shape) > self.rank:
                m = part.view(shape)
                q = warm.get(index)
                if q is None:
                    q = torch.randn(shape[1], self.rank, generator=torch.Generator().manual_seed(seed + index))
                pmat = torch.linalg.qr(m @ q).Q
                q = m.T @ pmat
                warm[index] = q
                out[at:at + size] = (pmat @ q.T).view(-1)
            else:
                out[at:at + size] = part
            at += size
        return out

    def __call__(self, move: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(move)
        at = 0
        for shape in self.shapes:
            size = math.prod(shape)
            part = move[at:at + size]
            if len(shape) == 2 and min(shape) > self.rank:
                u, sv, vh = torch.linalg.svd(part.view(shape), full_matrices=False)
                left = (u[:, :self.rank] * sv[:self.rank]).bfloat16().float()
                right = vh[:self.rank].bfloat16().float()
                out[at:at + size] = (left @ right).view(-1)
            else:
                out[at:at + size] = part.bfloat16().float()
            at += size
        assert at == move.numel(), "the shapes do not cover the flat vector"
        return out


def copies_codec(scheme: Scheme) -> object:
    """The codec that carries phi's move from the pair's public copy under `choco:P` / `chocox:P`."""
    assert scheme.copies is not None
    preset = PRESETS.get(scheme.copies) or EXPERIMENTAL[scheme.copies]
    return preset.delta_codec("bf16")


class PublicCopies:
    """CHOCO-gossip's public copies, one per ordered pair: `copy[(i, j)]` is replica i's phi as pair (i, j) both
    know it. Every replica starts from the same phi, so every copy starts there and the first meeting sends no
    whole model. At a meeting, i sends its phi's move from that copy through the codec and both add what
    arrived, so the copy trails phi by what the codec has not carried yet (error feedback by construction)."""

    def __init__(self, start: torch.Tensor, carry: object) -> None:
        self.start, self.carry = start, carry  # carry(move) -> what the wire delivers of it
        self.copy: dict[tuple[int, int], torch.Tensor] = {}

    def meet(self, phis: list[torch.Tensor], i: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pair (i, j) meets; the copies of i's and of j's phi after the exchange."""
        for a, b in ((i, j), (j, i)):
            c = self.copy.setdefault((a, b), self.start.clone())
            c.add_(self.carry(phis[a] - c))  # type: ignore[operator]
        return self.copy[(i, j)], self.copy[(j, i)]


def block_topk_mask(score: torch.Tensor, keep: int = KEEP) -> torch.Tensor:
    """True on the `keep` entries of largest |score| in every whole BLOCK (entries past the last whole block:
    all, as the codecs keep a short tail whole)."""
    numel = score.numel()
    whole = numel // BLOCK
    mask = torch.ones(numel, dtype=torch.bool)
    if whole:
        idx = score[: whole * BLOCK].view(whole, BLOCK).abs().topk(min(keep, BLOCK), dim=1).indices
        blocks = torch.zeros(whole, BLOCK, dtype=torch.bool)
        blocks.scatter_(1, idx, True)
        mask[: whole * BLOCK] = blocks.view(-1)
    return mask


def selected_mean_sum(terms: list[torch.Tensor]) -> torch.Tensor:
    """The sum that, divided by len(terms), is on each entry the mean over the terms that kept it (nonzero):
    SparseLoCo's aggregation of sparse Deltas (zero where none kept it)."""
    total = torch.stack(terms).sum(0)
    kept = torch.stack([t != 0 for t in terms]).sum(0).clamp(min=1)
    return total * len(terms) / kept


def wz_encode(phi: torch.Tensor, step: torch.Tensor, dither: torch.Tensor, bits: int) -> torch.Tensor:
    """Each entry's index on the dithered grid of `step`, modulo 2^bits (what crosses the wire)."""
    return torch.remainder(torch.round(phi / step + dither), 2 ** bits)


def wz_decode(residue: torch.Tensor, near: torch.Tensor, step: torch.Tensor, dither: torch.Tensor,
              bits: int) -> torch.Tensor:
    """The grid point with index `residue` modulo 2^bits nearest `near` (the receiver's own phi): the sender's
    value to within step/2 wherever |sender - near| < (2^(bits-1) - 1/2) x step, a whole 2^bits steps off
    elsewhere (a wrap)."""
    levels = 2 ** bits
    index = residue + levels * torch.round((near / step + dither - residue) / levels)
    return (index - dither) * step


def _block_mean(values: torch.Tensor, blocks: torch.Tensor, count: int) -> torch.Tensor:
    sums = torch.zeros(count).index_add_(0, blocks, values)
    return sums / torch.zeros(count).index_add_(0, blocks, torch.ones_like(values)).clamp(min=1)


class WzState:
    """Each replica's estimate of the partner distance per block (NaN: none yet)."""

    def __init__(self, n: int, numel: int) -> None:
        self.blocks = -(-numel // BLOCK)
        self.sigma = [torch.full((self.blocks,), float("nan")) for _ in range(n)]

    def exchange(self, phis: list[torch.Tensor], deltas: list[torch.Tensor], sender: int, receiver: int,
                 lo: int, hi: int, bits: int, scale: float, key: int) -> tuple[torch.Tensor, float]:
        """The receiver's view of the sender's phi on [lo, hi), and the share of entries that wrapped."""
        blocks = torch.arange(lo, hi) // BLOCK
        fallback = FIRST_SIGMA * _block_mean(deltas[sender][lo:hi].square(), blocks, self.blocks).sqrt()
        sigma = self.sigma[sender]
        step = (scale * torch.where(torch.isnan(sigma), fallback, sigma)[blocks]).clamp(min=1e-12)
        dither = torch.rand(hi - lo, generator=torch.Generator().manual_seed(key)) - 0.5
        residue = wz_encode(phis[sender][lo:hi], step, dither, bits)
        got = wz_decode(residue, phis[receiver][lo:hi], step, dither, bits)
        wraps = float((torch.round(phis[sender][lo:hi] / step + dither) - torch.round(got / step + dither))
                      .ne(0).float().mean())
        distance = got - phis[receiver][lo:hi]
        var = _block_mean(distance.square(), blocks, self.blocks)
        grid = _block_mean(step.square() / 12, blocks, self.blocks)
        # A wrap decodes inside the range, so the distances measured understate a spread that outgrew it, and a
        # smaller step follows: a runaway (the first version of this scheme wrapped 8-20% of its entries). Where
        # more than EDGE_SHARE of a block decoded in the outer quarter of its range, the estimate doubles.
        edge = _block_mean((distance.abs() > 0.75 * (2 ** (bits - 1)) * step).float(), blocks, self.blocks)
        touched = torch.zeros(self.blocks, dtype=torch.bool)
        touched[blocks] = True
        measured = (var - grid).clamp(min=0).maximum(var * 0.05).sqrt()
        used = _block_mean(step / scale, blocks, self.blocks)
        estimate = torch.where(edge > EDGE_SHARE, torch.maximum(measured, 2 * used), measured)
        self.sigma[receiver][touched] = estimate[touched]
        return got, wraps


def run_scheme(scheme: Scheme, bc: BenchConfig, outer_steps: int, n: int, home: Path,
               curve_every: int = 10) -> dict:
    """`outer_steps` outer steps of `bc`'s schedule under `scheme`; the figures as a dict. The Delta preset on
    trial is a preset (the worker looks presets up by name) for the run only: a daemon in the same process, or a
    test after this one, must not find it."""
    added = scheme.preset not in PRESETS
    PRESETS.setdefault(scheme.preset, scheme.compression())
    try:
        return _run_scheme(scheme, bc, outer_steps, n, home, curve_every)
    finally:
        if added:
            PRESETS.pop(scheme.preset, None)


def _run_scheme(scheme: Scheme, bc: BenchConfig, outer_steps: int, n: int, home: Path, curve_every: int) -> dict:
    started = time.monotonic()
    torch.set_num_threads(1)
    if scheme.gamma is not None:
        bc = dataclasses.replace(bc, gamma=scheme.gamma)
    trainers = [Trainer(bc.train_config(scheme.method), home / pid, pid) for pid in replica_ids(n)]
    custom = scheme.base in ("oracle", "mom", "moveacc", "wz", "choco", "chocox", "lrdiff", "lrpi")
    if custom:  # the scheme gives the pull it means in sum_phi: no int8 own-term rewrite
        for t in trainers:
            t._own_phi_on_wire = lambda *args, **kwargs: None  # type: ignore[method-assign]
    numel = trainers[0].numel
    preset = PRESETS[scheme.preset]
    dcodec, pcodec = preset.delta_codec("bf16"), preset.phi_codec("bf16")
    phis = [torch.empty(numel) for _ in trainers]
    deltas = [torch.empty(numel) for _ in trainers]
    pairing = torch.Generator().manual_seed(bc.seed + 1)
    moved = [torch.zeros(numel) for _ in trainers] if scheme.base == "moveacc" else []
    wz = WzState(n, numel) if scheme.wz else None
    warm_q: dict[int, dict[int, torch.Tensor]] = {}  # `lrpi`: each asker's Q per matrix
    shapes = [tuple(p.shape) for p in trainers[0].model.parameters()]
    copies = None
    lowrank = LowRank(int(scheme.copies[2:]), shapes) if scheme.copies and scheme.copies.startswith("lr") else None
    if scheme.copies is not None and scheme.base not in ("lrdiff", "lrpi"):
        if lowrank is not None:
            carry: object = lowrank
        else:
            codec = copies_codec(scheme)
            carry = lambda move: wire(move, codec)  # noqa: E731
        copies = PublicCopies(trainers[0].phi.clone(), carry)
    if copies is not None and any(not torch.equal(t.phi, copies.start) for t in trainers):
        raise SystemExit("choco: the replicas do not start from the same phi; public copies need a shared start")
    unsent = [torch.zeros(numel) for _ in trainers] if scheme.own else []  # +own: error feedback, kept here
    wraps: list[float] = []
    curve: list[tuple[int, float, float]] = []

    def aggregate(terms: list[torch.Tensor]) -> torch.Tensor:
        return selected_mean_sum(terms) if scheme.smean else torch.stack(terms).sum(0)

    for outer in range(outer_steps):
        publish_all(trainers, phis, deltas)
        groups = [list(range(n))] if scheme.method == "diloco" else random_groups(n, pairing)
        if scheme.base == "alone":
            groups = [[i] for i in range(n)]
        for group in groups:
            if len(group) == 1:
                trainers[group[0]].apply_result(ExchangeOutcome(1, compression=scheme.preset))
                continue
            sum_delta = aggregate([wire(deltas[i], dcodec) for i in group])
            sums = {i: sum_delta for i in group}
            if scheme.own:
                # What each sends: its Delta plus what the wire has not carried yet; the worker's own_exact turns
                # its own term, given as the wire's copy of its Delta, into the Delta itself.
                sent = {}
                for i in group:
                    sent[i] = wire(deltas[i] + unsent[i], dcodec)
                    unsent[i].add_(deltas[i]).sub_(sent[i])
                sums = {i: wire(deltas[i], dcodec) + sum(sent[j] for j in group if j != i) for i in group}
            if scheme.method == "diloco":
                for i in group:
                    outcome = ExchangeOutcome(len(group), compression=scheme.preset, own_exact=scheme.own)
                    trainers[i].apply_result(outcome, phis[i].clone(), sums[i].clone())
                continue
            a, b = group
            if not custom:
                lo, hi = preset.fragment_range(numel, preset.fragment_of(outer)) if preset.lossy else (0, numel)
                sum_phi = torch.zeros(numel)
                sum_phi[lo:hi] = wire(phis[a][lo:hi], pcodec) + wire(phis[b][lo:hi], pcodec)
                for me in (a, b):
                    outcome = ExchangeOutcome(2, compression=scheme.preset, own_exact=scheme.own,
                                              phi_range=(lo, hi) if preset.lossy else None)
                    trainers[me].apply_result(outcome, sum_phi.clone(), sums[me].clone())
                continue
            seen: dict[int, torch.Tensor] = {}  # what each side pulls towards: the partner's phi as delivered
            if scheme.base == "oracle":
                mask = block_topk_mask(phis[b] - phis[a])
                for me, other in ((a, b), (b, a)):
                    seen[me] = torch.where(mask, phis[other], phis[me])
            elif scheme.base in ("mom", "moveacc"):
                score = {i: (trainers[i].outer.momentum if scheme.base == "mom" else moved[i]) for i in (a, b)}
                masks = {i: block_topk_mask(score[i]) for i in (a, b)}
                for me, other in ((a, b), (b, a)):
                    seen[me] = torch.where(masks[other], phis[other].bfloat16().float(), phis[me])
                if scheme.base == "moveacc":
                    for i in (a, b):
                        moved[i][masks[i]] = 0  # sent: the partner has it now
            elif scheme.base == "lrdiff":
                # The pair's difference itself at rank R per matrix: linear in each side's phi, so two rounds
                # of a power iteration (PowerSGD's, on phi_a - phi_b) give both sides the same factors without
                # either knowing the other's phi. Here: the truncated SVD, the bound that iteration approaches.
                assert lowrank is not None
                diff = lowrank(phis[b] - phis[a])
                seen[a], seen[b] = phis[a] + diff, phis[b] - diff
            elif scheme.base == "lrpi":
                # The same with what a wire would do: one power iteration, warm-started from the asker's last Q.
                assert lowrank is not None
                diff = lowrank.power_step(phis[b] - phis[a], warm_q.setdefault(min(a, b), {}), bc.seed)
                seen[a], seen[b] = phis[a] + diff, phis[b] - diff
            elif copies is not None:
                # choco: the pull acts on the copies' difference (CHOCO-gossip's x_i + (x^_j - x^_i)), so
                # what the codec has not carried yet of either side does not enter it; chocox pulls towards
                # the partner's copy itself.
                ca, cb = copies.meet(phis, a, b)
                for me, mine, theirs in ((a, ca, cb), (b, cb, ca)):
                    seen[me] = theirs.clone() if scheme.base == "chocox" else phis[me] + theirs - mine
            else:
                assert wz is not None and scheme.wz is not None
                fragments, bits, scale = scheme.wz
                lo, hi = Compression("wz", fragments=fragments).fragment_range(numel, outer % fragments)
                for me, other in ((a, b), (b, a)):
                    got, wrapped = wz.exchange(phis, deltas, other, me, lo, hi, bits, scale,
                                               key=(bc.seed * 1_000_003 + outer) * 64 + other)
                    seen[me] = phis[me].clone()
                    seen[me][lo:hi] = got
                    wraps.append(wrapped)
            for me in (a, b):
                before = trainers[me].phi.clone() if moved else None
                outcome = ExchangeOutcome(2, compression=scheme.preset, phi_range=(0, numel), own_exact=scheme.own)
                trainers[me].apply_result(outcome, phis[me] + seen[me], sums[me].clone())
                if before is not None:
                    moved[me].mul_(MOVE_DECAY).add_((trainers[me].phi - before).abs())
        if curve_every and ((outer + 1) % curve_every == 0 or outer + 1 == outer_steps):
            val = sum(t.evaluate() for t in trainers) / n
            curve.append((outer + 1, val, relative_spread([t.phi for t in trainers])))
    final = curve[-1] if curve else (outer_steps, sum(t.evaluate() for t in trainers) / n,
                                     relative_spread([t.phi for t in trainers]))
    return {"scheme": scheme.name, "bytes_per_param": bytes_per_param(scheme, numel, shapes), "val": final[1],
            "spread": final[2], "wraps": sum(wraps) / len(wraps) if wraps else None, "curve": curve,
            "seconds": round(time.monotonic() - started, 1)}


def render(records: list[dict], path: Path = RESULTS) -> str:
    if not records:
        return f"{SECTION}\n\nNo runs recorded yet.\n"
    latest: dict[tuple, dict] = {}
    for r in records:  # a rerun of the same scheme, seed and length replaces the earlier record
        latest[(r["scheme"], r["seed"], r["outer_steps"], r["schedule_outer_steps"])] = r
    rows = sorted(latest.values(), key=lambda r: (r["outer_steps"], r["seed"], r["scheme"] != "none",
                                                   r["scheme"] != "diloco", r["bytes_per_param"]))
    base = {(r["seed"], r["outer_steps"]): r for r in rows if r["scheme"] == "none"}
    frag = {(r["seed"], r["outer_steps"]): r for r in rows if r["scheme"] == "frag"}
    commands = sorted({r["command"] for r in records})
    utcs = sorted(r["utc"] for r in records)
    lines = [SECTION, "",
             "Commands: " + ", ".join(f"`{c}`" for c in commands) + "; `python bench/phi_schemes.py --report "
             f"--write-docs` renders this section from `{_shown(path)}` "
             f"({len(records)} runs, {utcs[0]} to {utcs[-1]} UTC, trees {', '.join(sorted({r['tree'] for r in records}))}). "
             "bench/convergence.py's model, N = 4 replicas, the first outer steps shown of a 200-step schedule "
             "(H = 50), one seed; every scheme but `none` sends Delta as `k64q2` (0.029 B/param). The module "
             "docstring of bench/phi_schemes.py says what each scheme sends. Val loss: mean over replicas; "
             "spread: relative, as in \"Convergence\"; wraps: the share of `wz` entries decoded a whole grid "
             "period off.", "",
             "| scheme | B/param each way | outer steps | seed | val loss | vs bf16 NoLoCo | vs `frag` (today's phi) "
             "| spread | wraps |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        key = (r["seed"], r["outer_steps"])
        b, f = base.get(key), frag.get(key)
        vs_base = f"{r['val'] - b['val']:+.3f}" if b and r is not b else "-"
        vs_frag = f"{r['val'] - f['val']:+.3f}" if f and r is not f else "-"
        wraps = "-" if r["wraps"] is None else f"{r['wraps']:.1e}"
        lines.append(f"| {r['scheme']} | {r['bytes_per_param']:.3f} | {r['outer_steps']} of "
                     f"{r['schedule_outer_steps']} | {r['seed']} | {r['val']:.4f} | {vs_base} | {vs_frag} | "
                     f"{r['spread']:.3f} | {wraps} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", default="none,frag,diloco,oracle,mom,moveacc,wz:8,3,1,wz:4,2,2.5")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--outer-steps", type=int, default=40, help="outer steps run, of the schedule's")
    parser.add_argument("--schedule-outer-steps", type=int, default=200, help="the schedule's length (the lr's)")
    parser.add_argument("--jobs", type=int, default=2, help="schemes at once, one process and torch thread each")
    parser.add_argument("--jsonl", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="bench/convergence.py's QUICK model (a smoke run)")
    parser.add_argument("--report", action="store_true", help="only render the table from --jsonl")
    parser.add_argument("--write-docs", action="store_true", help=f"make the table {SECTION!r} of docs/benchmarks.md")
    parser.add_argument("--one", metavar="SCHEME", help=argparse.SUPPRESS)  # a child of the campaign
    parser.add_argument("--command", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        schemes = parse_schemes(args.one or args.schemes)
    except SchemeError as e:
        parser.error(str(e))
    if not 1 <= args.outer_steps <= args.schedule_outer_steps or args.jobs < 1:
        parser.error("--outer-steps between 1 and --schedule-outer-steps, and --jobs >= 1, are required")
    bc = dataclasses.replace(QUICK if args.quick else BenchConfig(), outer_steps=args.schedule_outer_steps,
                             seed=args.seed)
    command = "python bench/phi_schemes.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    if args.one:
        tree = tree_id()
        with tempfile.TemporaryDirectory(prefix="starling-phi-schemes-") as tmp:
            figures = run_scheme(schemes[0], bc, args.outer_steps, 4, Path(tmp))
        append_record(args.jsonl, {
            **figures, "seed": args.seed, "outer_steps": args.outer_steps,
            "schedule_outer_steps": args.schedule_outer_steps, "quick": args.quick,
            **provenance(args.command or command, tree)})
        print(f"{figures['scheme']}: val {figures['val']:.4f} spread {figures['spread']:.3f} "
              f"({figures['seconds']:.0f} s)", file=sys.stderr)
        return 0 if math.isfinite(figures["val"]) else 1
    rc = 0
    if not args.report:
        todo = list(schemes)
        running: list[tuple[subprocess.Popen, str]] = []
        while todo or running:
            while todo and len(running) < args.jobs:
                s = todo.pop(0)
                cmd = [sys.executable, str(Path(__file__).resolve()), "--one", s.name, "--seed", str(args.seed),
                       "--outer-steps", str(args.outer_steps), "--schedule-outer-steps",
                       str(args.schedule_outer_steps), "--jsonl", str(args.jsonl), "--command", command,
                       *(["--quick"] if args.quick else [])]
                running.append((subprocess.Popen(cmd, cwd=ROOT), s.name))
            time.sleep(1)
            for proc, label in list(running):
                if proc.poll() is not None:
                    running.remove((proc, label))
                    if proc.returncode:
                        rc = 1
                        print(f"{label}: FAILED (exit {proc.returncode})", file=sys.stderr)
    records = [r for r in read_phi_records(args.jsonl) if r.get("quick", False) == args.quick]
    publish(render(records, args.jsonl), DOCS, SECTION, write=args.write_docs)
    return rc


def read_phi_records(path: Path) -> list[dict]:
    """This bench's well-formed records in `path`."""
    return read_records(path, RECORD_KEYS)

if __name__ == "__main__":
    sys.exit(main())

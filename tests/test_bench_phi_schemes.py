"""bench/phi_schemes.py (issue #51, item 3): the ways to send phi it screens do what its docstring says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import phi_schemes  # noqa: E402
from bench.convergence import QUICK  # noqa: E402
from bench.phi_schemes import Scheme, SchemeError, parse_schemes  # noqa: E402
from protocols.compress import PRESETS  # noqa: E402


def test_side_information_decodes_within_half_a_step_inside_its_range_and_a_whole_period_off_outside() -> None:
    g = torch.Generator().manual_seed(0)
    own = torch.randn(10_000, generator=g)
    step = torch.full((10_000,), 0.01)
    dither = torch.rand(10_000, generator=g) - 0.5
    bits = 3  # 8 residues: exact to step/2 while |sender - own| < 3.5 steps
    near = own + (torch.rand(10_000, generator=g) * 2 - 1) * 3.0 * 0.01
    got = phi_schemes.wz_decode(phi_schemes.wz_encode(near, step, dither, bits), own, step, dither, bits)
    assert float((got - near).abs().max()) <= 0.005 + 1e-6
    far = own + 5.0 * 0.01  # beyond the range: the nearest point with that residue is 8 steps off
    got = phi_schemes.wz_decode(phi_schemes.wz_encode(far, step, dither, bits), own, step, dither, bits)
    assert torch.allclose((got - far).abs(), torch.full_like(far, 0.08), atol=0.0051)


def test_the_selected_mean_counts_an_entry_kept_by_one_sender_at_its_value_and_averages_where_both_kept_it() -> None:
    a = torch.tensor([1.0, 0.0, 2.0, 0.0])
    b = torch.tensor([0.0, 3.0, 4.0, 0.0])
    summed = phi_schemes.selected_mean_sum([a, b])
    assert summed.tolist() == [2.0, 6.0, 6.0, 0.0]  # divided by 2 in the outer step: 1, 3, 3 (the mean of 2, 4), 0


def test_the_block_mask_keeps_the_largest_entries_of_each_block_and_all_of_a_short_tail() -> None:
    score = torch.zeros(phi_schemes.BLOCK * 2 + 10)
    score[5] = -9.0
    score[phi_schemes.BLOCK + 7] = 3.0
    mask = phi_schemes.block_topk_mask(score, keep=1)
    assert mask[5] and mask[phi_schemes.BLOCK + 7] and mask[-10:].all()
    assert int(mask.sum()) == 2 + 10


def test_schemes_are_parsed_with_the_commas_of_wz_and_bad_ones_are_refused_naming_why() -> None:
    schemes = parse_schemes("none,wz:4,2,2.5,frag+smean,oracle+own")
    assert [s.name for s in schemes] == ["none", "wz:4,2,2.5", "frag+smean", "oracle+own"]
    assert schemes[1] == Scheme("wz", False, (4, 2, 2.5)) and schemes[2].smean
    for spec, says in (("nope", "unknown scheme"), ("wz:4,2", "wz takes F,B,C"), ("wz:0,2,1", "1 <= F"),
                       ("none+smean", "lossy Delta"), ("frag+nope", "unknown modifier"),
                       ("diloco+own", "pair's"), ("frag+smean+own", "do not combine"),
                       ("frag:16+own+smean", "do not combine"), ("wz:4,2,2.5+smean+own", "do not combine")):
        with pytest.raises(SchemeError, match=says):
            Scheme.parse(spec)


def test_every_scheme_runs_and_the_oracle_pulls_less_far_than_no_exchange_of_phi(tmp_path: Path) -> None:
    """A smoke run of each scheme on the QUICK model; `oracle` and `wz` change phi's pull (their spread is not
    `frag`'s), so the harness really hands the worker their view of the partner."""
    figures = {}
    for spec in ("none", "alone", "frag", "diloco", "oracle", "mom", "moveacc", "wz:2,3,1", "frag+own"):
        s = Scheme.parse(spec)
        figures[spec] = phi_schemes.run_scheme(s, QUICK, 3, 4, tmp_path / spec.replace(":", "_"), curve_every=0)
        assert figures[spec]["val"] > 0 and (figures[spec]["bytes_per_param"] > 0) == (spec != "alone")
    assert figures["diloco"]["spread"] == 0.0
    assert figures["alone"]["spread"] > figures["none"]["spread"]  # no pull: the replicas drift apart
    assert figures["none"]["bytes_per_param"] > figures["frag"]["bytes_per_param"]
    assert figures["wz:2,3,1"]["wraps"] is not None
    assert figures["oracle"]["spread"] != figures["frag"]["spread"]
    assert figures["frag+own"]["spread"] != figures["frag"]["spread"]  # the own Delta in full: other steps
    assert "k64q2" not in PRESETS  # the preset on trial was the runs' only: no other test or daemon finds it


def test_a_run_appends_its_record_and_the_report_renders_it_beside_the_yardstick(tmp_path: Path) -> None:
    jsonl = tmp_path / "runs.jsonl"
    cmd = [sys.executable, str(ROOT / "bench" / "phi_schemes.py"), "--quick", "--outer-steps", "2",
           "--schedule-outer-steps", "4", "--schemes", "none,mom", "--jsonl", str(jsonl)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert sorted(rec["scheme"] for rec in records) == ["mom", "none"]
    assert all(rec["outer_steps"] == 2 and rec["schedule_outer_steps"] == 4 and rec["tree"] for rec in records)
    assert "| mom |" in r.stdout and "2 of 4" in r.stdout


def test_a_bad_scheme_on_the_command_line_is_one_line_not_a_traceback() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "phi_schemes.py"), "--schemes", "nope"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "unknown scheme" in r.stderr and "Traceback" not in r.stderr


def test_frag_f_pulls_on_1_of_f_fragments_with_the_same_delta_and_its_preset_lives_for_the_run_only(
        tmp_path: Path) -> None:
    """`frag:F` spends more bytes on phi (1 of F fragments in int8) with `k64q2`'s Delta: F = 4 sends 8x the phi
    bytes of the default 32 and pulls on 8x the coordinates, so the replicas end closer."""
    s = Scheme.parse("frag:4+own")
    assert (s.name, s.preset, s.compression().fragments) == ("frag:4+own", "k64q2-f4", 4)
    numel = 1_000_000
    default = phi_schemes.bytes_per_param(Scheme.parse("frag"), numel)
    delta = s.compression().delta_codec("bf16").encoded_size(numel) / numel
    assert phi_schemes.bytes_per_param(s, numel) - delta == pytest.approx(8 * (default - delta), rel=0.01)
    four = phi_schemes.run_scheme(s, QUICK, 4, 4, tmp_path / "f4", curve_every=0)
    many = phi_schemes.run_scheme(Scheme.parse("frag:64+own"), QUICK, 4, 4, tmp_path / "f64", curve_every=0)
    assert four["spread"] < many["spread"]
    assert not [name for name in PRESETS if name.startswith("k64q2")]
    for spec, says in (("frag:x", "whole number"), ("frag:0", "1 <= F"), ("frag:65", "1 <= F")):
        with pytest.raises(SchemeError, match=says):
            Scheme.parse(spec)


SHAPES = [(48, 16), (16,), (32, 32)]


def _low_rank_flat(rank: int, g: torch.Generator) -> torch.Tensor:
    """A flat vector whose matrices (SHAPES) have rank `rank`, its vector any values."""
    parts = []
    for shape in SHAPES:
        if len(shape) == 2:
            parts.append((torch.randn(shape[0], rank, generator=g) @ torch.randn(rank, shape[1], generator=g)).view(-1))
        else:
            parts.append(torch.randn(shape, generator=g))
    return torch.cat(parts)


def test_the_low_rank_carry_is_exact_on_rank_r_moves_and_one_warm_power_step_recovers_them() -> None:
    """`lrdiff` and `choco:lrR` send each matrix at rank R: a move of rank <= R crosses whole (to bf16 for the
    SVD's factors); `lrpi`'s one power iteration spans a rank-R matrix's columns from any generic Q, so it too
    gives it back, and the warm Q it keeps is the next step's start."""
    g = torch.Generator().manual_seed(3)
    low = phi_schemes.LowRank(2, SHAPES)
    move = _low_rank_flat(2, g)
    assert torch.allclose(low(move), move, atol=0.05 * float(move.abs().max()))
    warm: dict[int, torch.Tensor] = {}
    assert torch.allclose(low.power_step(move, warm, seed=0), move, atol=1e-4)
    assert sorted(warm) == [0, 2] and warm[0].shape == (16, 2)
    higher = _low_rank_flat(6, g)
    assert float((low(higher) - higher).norm()) > 0.1 * float(higher.norm())  # rank 6 does not cross at rank 2
    assert low.size_bytes() == 2 * 2 * (48 + 16) + 2 * 16 + 2 * 2 * (32 + 32)


def test_public_copies_start_shared_and_trail_phi_by_what_the_carry_has_not_delivered() -> None:
    start = torch.zeros(8)
    phis = [torch.arange(8.0), torch.ones(8)]
    exact = phi_schemes.PublicCopies(start, lambda move: move)
    mine, theirs = exact.meet(phis, 0, 1)
    assert torch.equal(mine, phis[0]) and torch.equal(theirs, phis[1])
    half = phi_schemes.PublicCopies(start, lambda move: move / 2)  # a carry that delivers half each meeting
    half.meet(phis, 0, 1)
    mine, _ = half.meet(phis, 0, 1)
    assert torch.allclose(mine, 0.75 * phis[0])  # what is not delivered yet is sent again: error feedback


def test_the_new_schemes_parse_run_and_set_the_pull_s_gamma(tmp_path: Path) -> None:
    schemes = parse_schemes("choco:k64q2+own;chocox:lr2+own;lrdiff:2+own;lrpi:1+own;frag:16+own+g0.5")
    assert [s.name for s in schemes] == ["choco:k64q2+own", "chocox:lr2+own", "lrdiff:2+own", "lrpi:1+own",
                                         "frag:16+own+g0.5"]
    assert schemes[-1].gamma == 0.5 and schemes[0].gamma is None
    for spec, says in (("choco:nope", "lossy preset"), ("lrdiff:0", "rank"), ("frag+gx", r"\+gG"),
                       ("frag+g3", "G <= 2")):
        with pytest.raises(SchemeError, match=says):
            Scheme.parse(spec)
    figures = {s.name: phi_schemes.run_scheme(s, QUICK, 3, 4, tmp_path / str(i), curve_every=0)
               for i, s in enumerate(schemes)}
    frag = phi_schemes.run_scheme(Scheme.parse("frag:16+own"), QUICK, 3, 4, tmp_path / "frag", curve_every=0)
    assert all(f["val"] > 0 and f["bytes_per_param"] > 0 for f in figures.values())
    assert figures["frag:16+own+g0.5"]["spread"] != frag["spread"]  # gamma reached the worker's pull
    assert figures["lrdiff:2+own"]["bytes_per_param"] > figures["lrpi:1+own"]["bytes_per_param"]

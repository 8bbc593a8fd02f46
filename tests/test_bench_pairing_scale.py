"""`bench/pairing_scale.py` runs end to end at small sizes and prints its three tables, old rule and new rule
side by side (no figure is asserted beyond the direction the docs claim: the bench's job is to measure)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_pairing_scale_bench_prints_agreement_mixing_and_cost_for_both_rules() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "pairing_scale.py"), "--sizes", "16", "64"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| 64 |")]
    assert len(rows) == 5, r.stdout  # agreement and mixing, old and new; the cost row
    old, new = (float(row.split("|")[3].strip().rstrip("%")) for row in rows[:2])
    assert new > old  # one newcomer: the trie rule keeps more partners than the list-seeded permutation

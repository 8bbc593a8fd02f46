"""`bench/swarm.py --quick` runs end to end: real daemons train, stop gracefully and are evaluated.

No figure is asserted (the targets belong to the full run's verdict lines in docs/benchmarks.md); this
proves the benchmark itself works, so those figures can be reproduced: every row of the convergence table
and every trainer of the mixing table is there, with finite losses and shares, and nothing is left behind
(no daemon, no cgroup).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SWARM = ROOT / "bench" / "swarm.py"
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")


def _rows(stdout: str, first_cell: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in stdout.splitlines()
            if ln.startswith(f"| {first_cell} |")]


def _cgroups() -> set[str]:
    return {p.name for p in CGROUP_CPU.glob("starling-bench-*")} if CGROUP_CPU.is_dir() else set()


@pytest.mark.slow
@pytest.mark.long  # a benchmark smoke run: `make test-long`
@pytest.mark.timeout(400)
def test_quick_swarm_benchmark_prints_the_convergence_and_mixing_rows(tmp_path: Path) -> None:
    before = _cgroups()
    kept = tmp_path / "swarm.jsonl"
    r = subprocess.run(
        [sys.executable, str(SWARM), "--quick", "--scenarios", "convergence,mixing3", "--jsonl", str(kept)],
        capture_output=True, text=True, timeout=380, cwd=ROOT,
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    out = r.stdout
    labels = ["swarm (real daemons)", "no communication (real daemons)", "simulation NoLoCo (in-process)",
              "DDP (simulation)"]
    for label in labels:
        rows = _rows(out, label)
        assert len(rows) == 1, f"no row for {label}:\n{out}"
        assert math.isfinite(float(rows[0][2])) and math.isfinite(float(rows[0][3])), rows[0]
    for label in labels[:2]:  # fixed H: evaluated at exactly the simulation's last step
        assert _rows(out, label)[0][-1] == "pace=steps", f"{label}: {_rows(out, label)[0][-1]}"
    # A quick run is too short for DDP to pull ahead of no communication at times: the verdict then says
    # the gap is undefined rather than printing a share.
    assert "| swarm (real daemons) |" in out
    assert "gap share closed" in out or "no gap to close here" in out, out
    mixing = _rows(out, "mixing3")
    assert sorted(row[1] for row in mixing) == ["n0", "n1", "n2"], out
    assert all(int(row[3]) > 0 for row in mixing), out  # every trainer took outer steps in the window
    assert "- mixing3, averaged share >= 60% for every trainer: " in out
    assert "- mixing3, distinct partners >= 2 for every trainer: " in out
    assert _cgroups() <= before, "a cgroup was left behind"
    # The raw results are kept too (issue #52): the rows the tables were rendered from, with their provenance.
    [record] = [json.loads(line) for line in kept.read_text().splitlines()]
    assert record["bench"] == "swarm" and record["scenarios"] == ["convergence", "mixing3"]
    assert {row["label"] for row in record["results"]["convergence"]} >= {"DDP (simulation)"}
    assert len(record["results"]["mixing3"]["trainers"]) == 3 and record["command"].startswith("python bench/swarm.py")


def test_an_unknown_scenario_is_refused_with_a_message_not_a_traceback() -> None:
    r = subprocess.run([sys.executable, str(SWARM), "--scenarios", "nope"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 2
    assert "unknown nope" in r.stderr and "Traceback" not in r.stderr

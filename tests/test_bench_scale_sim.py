"""bench/scale_sim.py's smoke run: the simulation drives the real membership and pairing code end to end at
50 nodes and reports every figure of issue #24's table (structure, not speeds)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_scale_simulation_reports_traffic_spread_and_pairing_at_a_small_size() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale_sim.py"), "--nodes", "50", "--minutes", "1.5",
         "--churn", "0.05", "--sample", "20"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in out.stdout.splitlines()
            if line.startswith("| ") and line.count("|") == 3}
    assert rows["nodes churned (crashed and joined)"] == "3"
    msgs_mean, msgs_p99 = (float(x) for x in rows["membership messages sent per node per minute: mean / p99"].split(" / "))
    assert 0 < msgs_mean <= msgs_p99
    for key in ("a death known to 99% (suspect or dead)", "a death confirmed by 99% (dead)", "a join known to 99% (alive)"):
        assert "reached 99%" in rows[key], rows
    agreed = next(v for k, v in rows.items() if k.startswith("outer steps where scheduled partners agreed"))
    share, checks = agreed.split(" of ")
    assert 0 <= float(share.removesuffix("%")) <= 100 and int(checks) > 0
    assert any(k.startswith("... of which `Ping`") for k in rows)
    mixing = next(v for k, v in rows.items() if k.startswith("the schedule on the true member list"))
    mean, least, gap = mixing.split(" / ")
    assert 0 < float(mean) <= 20 and 0 <= int(least) <= float(mean) and 0 <= float(gap) <= 1

"""bench/scale.py's smoke run: 3 real daemons through every phase (join, settled window, one churn round,
the profile); the report's structure only, no speeds (those are docs/benchmarks.md's, "Scale: real daemons")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.long
def test_the_scale_bench_reports_join_idle_cost_and_churn_of_real_daemons(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), "--sizes", "3", "--timeout", "60", "--settle", "2",
         "--window", "5", "--churn-rounds", "1", "--churn-every", "15", "--poll", "1",
         "--json", str(tmp_path / "r.json"), "--profile", str(tmp_path / "prof"), "--trace",
         "--keep-logs", str(tmp_path / "logs"), "--jsonl", str(tmp_path / "scale.jsonl")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    [r] = json.loads((tmp_path / "r.json").read_text())
    # The raw results are kept too (issue #52): one record, the same results, with where they came from.
    [kept] = [json.loads(line) for line in (tmp_path / "scale.jsonl").read_text().splitlines()]
    assert kept["bench"] == "scale" and kept["results"] == [r] and kept["sizes"] == [3]
    assert {"tree", "command", "machine", "utc"} <= kept.keys() and "--jsonl" not in kept["command"]
    assert r["n"] == 3 and r["join_mode"] == "bootstrap"
    settled = r["settled"]
    assert settled["cpu_s_per_min"]["min"] > 0 and settled["rss_mib"]["min"] > 0
    assert settled["sent_bytes_per_min"]["min"] > 0
    assert settled["protocol_bytes_per_min_mean"]  # (swim, the default, runs no gossipsub: no meshsub here)
    # --trace: every status round of the join, each daemon's view and why members are missing.
    rounds = r["trace"]
    assert rounds and set(rounds[-1]["daemons"]) == {"0", "1", "2"}
    row = rounds[-1]["daemons"]["1"]
    assert {"alive", "missing", "connections", "sessions_ok", "session_failures", "busy_refusals"} <= set(row)
    assert set(row["missing"]) == {"no_record", "gone", "suspect", "other"}
    assert r["join"]["all_known_s"] is None or r["join"]["last_view_complete_s"] is not None
    assert len(list((tmp_path / "logs").glob("scale3-n*.log"))) == 3
    assert settled["connections"]["max"] >= 1
    # Suspicions over the whole run: the join's polls, and each daemon's recent_suspects read at the window's end.
    assert settled["suspect_after_join_members"] >= 0 and settled["suspect_after_join_views"] >= 0
    assert r["ever_suspect_members"] >= r["join"]["ever_suspect_members"]
    assert [c["killed"] for c in r["churn"]] == [1]
    assert r["profile"]["daemons"] == 1 and r["profile"]["total_s_per_min"] > 0  # the bootstrap node only
    assert len(list((tmp_path / "prof").glob("*.prof"))) == 1
    assert any(k.startswith("opened /starling/") for k in r["join"]["streams"]), r["join"]["streams"]
    table = [line for line in out.stdout.splitlines() if line.startswith("| 3 | bootstrap |")]
    assert len(table) == 1 and table[0].count("|") == 11, out.stdout


def _scale() -> Any:
    """bench/scale.py as a module (it imports bench/membership.py beside it)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import scale
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return scale


def test_the_scale_bench_never_gives_two_daemons_the_same_port() -> None:
    """Ports are drawn at random below the ephemeral range and checked free, but a port checked is free again
    until its daemon listens: two of 64 daemons got the same one about one run in ten ("port already in
    use" at a daemon's start, twice on 2026-11-27)."""
    scale = _scale()
    ports = [scale.listen_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)


def test_the_scale_bench_counts_the_streams_each_protocol_opened_over_the_join() -> None:
    """At 64 daemons the join was slowed by the streams queued at its busiest nodes (issue #24): the bench sums
    each daemon's probe counters of streams opened and accepted between the last daemon listening and the end
    of the join; a daemon not read at both ends is left out, not counted from zero."""
    scale = _scale()
    before = {0: {"counts": {"streams opened /ipfs/kad/1.0.0": 5, "frames": 9}},
              1: {"counts": {}}, 2: None}
    after = {0: {"counts": {"streams opened /ipfs/kad/1.0.0": 7, "streams accepted /starling/state/2.0.0": 3,
                            "frames": 20}},
             1: {"counts": {"streams opened /ipfs/kad/1.0.0 failed": 1, "streams opened /ipfs/kad/1.0.0": 2}},
             2: {"counts": {"streams opened /ipfs/kad/1.0.0": 50}}}
    assert scale.streams_over(before, after) == {
        "opened /ipfs/kad/1.0.0": 4, "accepted /starling/state/2.0.0": 3, "opened /ipfs/kad/1.0.0 failed": 1}

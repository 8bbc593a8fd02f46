"""bench/membership.py's smoke run: the probe loads into real daemons and counts what they send."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.long
def test_the_membership_bench_counts_gossip_and_frames_of_real_daemons() -> None:
    """In gossip membership (heartbeats on gossipsub; swim, the default, sends almost nothing there), so that
    the peer-record patch of p2p/gossip.py is what is counted."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "membership.py"), "--nodes", "3", "--settle", "5", "--seconds", "5",
         "--set", "node.membership=gossip"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in out.stdout.splitlines()
            if line.startswith("| ") and line.count("|") == 3}
    assert float(rows["tcp bytes"].removesuffix(" B").replace(",", "")) > 0
    assert float(rows["frames"].replace(",", "")) > 0
    gossip = [value for key, value in rows.items() if "meshsub" in key]
    assert gossip, rows
    writes = float(gossip[0].split(" in ")[1].split()[0])
    # p2p/gossip.py: only a stream's hello carries the peer record (the library: every RPC).
    assert float(rows["gossip rpcs with a peer record"]) < 0.5 * writes, rows

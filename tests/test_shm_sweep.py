"""Shared-memory segments of a killed daemon are removed by the next daemon; live ones are kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from node.bridge.shm import sweep_orphans


def test_segments_of_dead_pids_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"stl{dead.pid}_abcd_phi").write_bytes(b"x")
    (tmp_path / f"stl{os.getpid()}_abcd_phi").write_bytes(b"x")
    (tmp_path / "other").write_bytes(b"x")
    assert sweep_orphans(str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"stl{os.getpid()}_abcd_phi", "other"])

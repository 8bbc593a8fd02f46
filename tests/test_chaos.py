"""The chaos run, small: `bench/chaos.py --quick` (3 trainers, a SIGKILL of a whole node every 10 s for 40 s).

The script does the measuring and judging (see its docstring for the six checks); this test holds every
change to the daemon to it: the run must pass every check, and say so check by check.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(450)]  # a chaos run: `make test-long` / `make chaos`

CHAOS = Path(__file__).resolve().parent.parent / "bench" / "chaos.py"
CHECKS = (
    "(a) exchanges within their deadline",
    "(b) restarted nodes resumed from their checkpoint",
    "(c) checkpoints verified after a graceful stop",
    "(d) loss falls",
    "(e) member tables converge after the kills",
    "(f) a fresh identity joins the churned swarm",
)


def test_repeatedly_sigkilled_trainers_resume_from_verified_checkpoints_while_the_swarm_keeps_training(
    tmp_path: Path,
) -> None:
    r = subprocess.run(
        [sys.executable, str(CHAOS), "--quick", "--root", str(tmp_path / "chaos")],
        capture_output=True, text=True, timeout=420,  # + up to 120 s for (f)
    )
    report = f"{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    assert r.returncode == 0, report
    lines = r.stdout.splitlines()
    for check in CHECKS:
        verdict = next((line for line in lines if line.startswith(check)), None)
        assert verdict is not None and " PASS " in verdict, report
    assert any(line.startswith("newcomer: PASS a fresh identity joined") for line in lines), report

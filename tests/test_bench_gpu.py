"""bench/gpu.py: the GPU run's stored files render the `## On a GPU` section, and a step's time limit holds
(a bench killed at its limit leaves no daemon behind: a GPU lease is minutes, and the next step needs the GPU)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu  # noqa: E402


def test_the_stored_gpu_run_renders_its_figures_by_host_threads_and_the_throughput_ratios() -> None:
    results = json.loads((ROOT / "bench" / "gpu_run" / "gpu.json").read_text())
    text = gpu.render(results, results["command"])
    assert text.startswith(gpu.SECTION)
    assert "NVIDIA H100" in text and "**averaging / alone = 1.103**" in text and "same run: **0.914**" in text
    # The outer step's host work, one column per count of threads, timed in one run.
    assert "| ms, 1 thread | ms, 8 threads |" in text
    assert "| apply a pair's result (the NoLoCo step, its finite checks, the rebase) | 745.4 | 166.7 |" in text
    assert "**118%**" in text and "**28%**" in text
    assert "188 passed" in text and "| alone again | - | - | not run in either call" in text


def test_the_earlier_h200_run_still_renders_its_tests_that_failed() -> None:
    results = json.loads((ROOT / "bench" / "gpu_run" / "gpu-h200.json").read_text())
    text = gpu.render(results, results["command"])
    assert "NVIDIA H200" in text and "**averaging / alone = 0.447**" in text
    assert "test_export::test_export_evaluate_measures_the_exported_weights" in text
    assert "Re-run" in text and "| one inner step | 14.5 |" in text


def test_a_step_that_overruns_its_limit_is_killed_with_its_whole_process_group(tmp_path: Path) -> None:
    marker = tmp_path / "child.pid"
    script = (f"import os, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(60)']); open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    began = time.monotonic()
    code, _ = gpu.run([sys.executable, "-c", script], timeout=2.0)
    assert code is None and time.monotonic() - began < 30
    child = int(marker.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        status = Path(f"/proc/{child}/status").read_text() if Path(f"/proc/{child}/status").exists() else ""
        if "zombie" in status:
            break
        time.sleep(0.1)
    status = Path(f"/proc/{child}/status").read_text() if Path(f"/proc/{child}/status").exists() else "gone"
    assert status == "gone" or "zombie" in status, status


@pytest.mark.parametrize("missing", ["no-such-program-here"])
def test_a_missing_program_is_an_exit_status_not_an_exception(missing: str) -> None:
    code, text = gpu.run([missing], timeout=5.0)
    assert code == 127 and missing in text


def test_memory_rows_carry_the_gpu_of_the_run_that_measured_them(tmp_path: Path) -> None:
    """The stored memory rows came from the H200 lease; gpu.json is the later H100's, which ran no memory step.
    They were labelled H100 (issue #52)."""
    assert gpu.memory_gpu(ROOT / "bench" / "gpu_run").startswith("NVIDIA H200")
    (tmp_path / "gpu.json").write_text(json.dumps({"env": {"nvidia_smi": "NVIDIA H100 80GB HBM3"}, "memory": {}}))
    (tmp_path / "gpu-h200.json").write_text(json.dumps({"env": {"nvidia_smi": "NVIDIA H200"}, "memory": {}}))
    assert gpu.memory_gpu(tmp_path) == "NVIDIA H100 80GB HBM3"  # this run measured memory itself
    (tmp_path / "gpu.json").write_text(json.dumps({"env": {"nvidia_smi": "NVIDIA H100 80GB HBM3"}}))
    (tmp_path / "gpu-h200.json").unlink()
    assert gpu.memory_gpu(tmp_path) == "a GPU the run's files do not name"

"""CI shows what it skipped (issue #52, item 4): as root with STRICT_LAB_SKIPS=1, a network-lab or disk test
that skips fails with the skip's reason; any other skip, or any skip elsewhere, stays a skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from starling_testing.skips import STRICT_ENV, strict_failure

ROOT = Path(__file__).resolve().parent.parent
LAB = "network lab unavailable: cannot create network namespaces"


def test_only_environment_skips_as_root_under_the_setting_become_failures() -> None:
    on = {STRICT_ENV: "1"}
    assert "network lab unavailable" in (strict_failure(LAB, euid=0, env=on) or "")
    assert strict_failure("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): 32", euid=0, env=on)
    assert strict_failure(LAB, euid=1000, env=on) is None  # not root: the lab cannot run, a skip is honest
    assert strict_failure(LAB, euid=0, env={}) is None  # a developer's machine: no setting
    assert strict_failure("no CUDA device is visible to torch here", euid=0, env=on) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="the strict mode applies to root only")
def test_a_lab_test_that_skips_under_strict_skips_fails_the_run_and_says_why(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        f"def test_lab():\n    pytest.skip({LAB!r})\n"
        "def test_gpu():\n    pytest.skip('no CUDA device is visible to torch here')\n")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "starling_testing.skips", "-p", "no:cacheprovider",
           str(tmp_path / "test_x.py")]
    strict = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT), STRICT_ENV: "1"})
    assert strict.returncode == 1 and "1 failed, 1 skipped" in strict.stdout, strict.stdout
    assert "skipped as root with STRICT_LAB_SKIPS=1" in strict.stdout and LAB in strict.stdout
    relaxed = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                             env={**{k: v for k, v in os.environ.items() if k != STRICT_ENV}, "PYTHONPATH": str(ROOT)})
    assert relaxed.returncode == 0 and "2 skipped" in relaxed.stdout, relaxed.stdout


def test_the_ci_setting_is_not_in_starlings_namespace_so_daemons_under_ci_print_no_warning() -> None:
    """CI exports the setting to every process it starts, daemons included; a STARLING_* name would make each
    `starling` command warn that it is not an option, and tests that read the operator's exact stderr fail."""
    from node.config.load import unknown_environment

    assert unknown_environment({STRICT_ENV: "1"}) == []

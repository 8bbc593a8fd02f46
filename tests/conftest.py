"""Shared test setup: makes tests/ helper modules importable and provides the network-lab and daemon-group
fixtures."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import netlab` under any import mode

import netlab  # noqa: E402
from procs import DaemonGroup  # noqa: E402


@pytest.fixture
def group(tmp_path: Path) -> Iterator[DaemonGroup]:
    """Real `starling run` daemons for one test (tests/procs.py), all stopped and their homes under tmp_path."""
    g = DaemonGroup(tmp_path)
    yield g
    g.close()


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[netlab.Lab]:
    """A fresh network-namespace lab, torn down after the test; logs under the test's tmp_path.

    Skips only when this kernel/user cannot create network namespaces.
    """
    reason = netlab.unavailable_reason()
    if reason is not None:
        pytest.skip(f"network lab unavailable: {reason}")
    with netlab.Lab(log_dir=tmp_path / "lab-logs") as the_lab:
        yield the_lab


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that uses the `lab` fixture is a `lab` test (so `-m "not lab"` leaves it out)."""
    for item in items:
        if "lab" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.lab)

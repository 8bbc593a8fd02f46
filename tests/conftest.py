"""Shared test setup: the network-lab and daemon-group fixtures (from the starling_testing package).

tests/ itself is on sys.path through pyproject.toml's `[tool.pytest.ini_options] pythonpath`, for the few
tests that share a helper with another test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from starling_testing import netlab
from starling_testing.daemon import DaemonGroup
from starling_testing.skips import pytest_runtest_makereport  # noqa: F401  (CI: a lab test that skips as root fails)


@pytest.fixture
def group(tmp_path: Path) -> Iterator[DaemonGroup]:
    """Real `starling run` daemons for one test (starling_testing/daemon.py), all stopped and their homes under tmp_path."""
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

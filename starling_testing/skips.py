"""A test run that shows what it skipped and, on CI, fails where a lab or disk test could not run (issue #52).

Why: the network-lab and disk tests skip, saying why, where this machine cannot run them (not root, no network
namespaces, no tmpfs mounts). On CI the machine can (root, the lab's packages installed by `make test`), so a skip
there hides a broken install step or a broken fixture behind a green run. With ``STRICT_LAB_SKIPS=1`` (what
`.ci/run` sets) and root, such a skip is reported as a failure carrying the skip's reason. Other skips (no CUDA
device, an optional extra not installed, compose tests left to `make test-compose`) stay skips.

Used as a pytest plugin: tests/conftest.py imports the hook; ``-p starling_testing.skips`` loads it elsewhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

__all__ = ["ENVIRONMENT_SKIPS", "STRICT_ENV", "pytest_runtest_makereport", "strict_failure"]

STRICT_ENV = "STRICT_LAB_SKIPS"
#: Skip reasons (their starts) that mean "this machine lacks what the test needs": starling_testing's lab fixture
#: and tmpfs helper word them so.
ENVIRONMENT_SKIPS = ("network lab unavailable", "cannot mount a tmpfs here")


def strict_failure(reason: str, *, euid: int, env: Mapping[str, str]) -> str | None:
    """The failure message a skip with `reason` becomes under strict skips as root; None where it stays a skip."""
    if env.get(STRICT_ENV) != "1" or euid != 0 or not reason.startswith(ENVIRONMENT_SKIPS):
        return None
    return (f"skipped as root with {STRICT_ENV}=1, where the lab and disk tests must run: {reason} "
            "(`make sysdeps` installs what the lab needs)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        why = strict_failure(reason, euid=os.geteuid(), env=os.environ)
        if why is not None:
            report.outcome = "failed"
            report.longrepr = why

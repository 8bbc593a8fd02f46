"""A small tmpfs for tests of a full disk: real ENOSPC, at a size the test picks, always unmounted."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tiny_tmpfs(mountpoint: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of `size` (mount's syntax: "1m", "2m") on `mountpoint` (created), yield it, unmount it
    lazily (a daemon that still holds a file open cannot keep it mounted). Skips the test, saying why, where
    mounting is not allowed (not root, no CAP_SYS_ADMIN)."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mountpoint)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip() or r.returncode}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=True)

"""Atomic file replacement, shared by everything the daemon persists (swarm state, loss history).

Readers (`starling plot` while the daemon runs, the next start after a power cut) must see the old file or
the new one, never half of one: write a temp file in the same directory, fsync it, rename it over the
target, then fsync the directory so the rename itself survives a crash. Blocking: from trio, call it with
`trio.to_thread.run_sync` on bytes prepared in the trio task.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path: Path, data: bytes, *, mode: int | None = None) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
